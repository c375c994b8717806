"""fusetrain's FusedAdamW and GradScaler under Hugging Face Accelerate, 2 CPU
processes (Accelerate's notebook_launcher, gloo), against
``torch.optim.AdamW(fused=True)`` in the same script.

One launch runs every variant (this file is its worker): per precision, an MLP
is prepared with ``accelerator.prepare(model, optimizer, loader)`` and trained
for STEPS steps with ``accelerator.backward``, ``accelerator.clip_grad_norm_``
and ``optimizer.step()``, saving ``accelerator.save_state`` halfway; a second
run loads that state and finishes. Checked here on rank 0's results:

- bf16: FusedAdamW's weights and losses within twice torch's own bf16 error
  (torch's bf16 run against its fp32 run).
- fp16: Accelerate runs float32 on a CPU (no scaler, no autocast): FusedAdamW
  and torch's fused AdamW agree to fp32 rounding. With
  ``fusetrain.integrations.use_grad_scaler`` it is float16 with loss scaling:
  fusetrain's scaler + FusedAdamW against torch's CPU scaler + fused AdamW,
  within twice torch's fp16 error, with one overflow step (an inf loss on
  rank 0) skipped by both and the scalers' states equal.
- save_state / load_state: the resumed run ends on the uninterrupted run's
  bits (optimizer state, fp32 masters of a bf16 model, the scaler's state).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

STEPS, SAVE_AT, LR, CLIP = 8, 4, 1e-2, 1.0
OVERFLOW_STEP = 2  # fp16 with a scaler: rank 0's loss is inf here


# ---------------------------------------------------------------- the worker (2 processes)


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 16, generator=g)
    teacher = torch.randn(16, 4, generator=g)
    return x, (x @ teacher).argmax(1)


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 4)
    ).to(dtype)


def _run(precision: str, impl: str, scaler: bool, state_dir: Path, resume: bool, model_dtype=torch.float32):
    """One training run; returns its final weights and per-step losses (the
    mean over ranks) on every rank."""
    import torch.nn.functional as F
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    import fusetrain
    from fusetrain.integrations import use_grad_scaler

    AcceleratorState._reset_state(reset_partial_state=False)  # a new precision in this process
    GradientState._reset_state()
    acc = Accelerator(mixed_precision=precision, cpu=True)
    if scaler:
        make = fusetrain.amp.GradScaler if impl == "ours" else torch.amp.GradScaler
        use_grad_scaler(acc, make("cpu", init_scale=2.0**8))
    model = _model(model_dtype)
    if impl == "ours":
        opt = fusetrain.optim.FusedAdamW(model.parameters(), lr=LR, master_weights=model_dtype != torch.float32)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    x, y = _data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    model, opt, loader = acc.prepare(model, opt, loader)
    first = 0
    if resume:
        acc.load_state(str(state_dir))
        loader, first = acc.skip_first_batches(loader, SAVE_AT), SAVE_AT
    losses = []
    for step, (xb, yb) in enumerate(loader, start=first):
        if step == STEPS:
            break
        loss = F.cross_entropy(model(xb.to(model_dtype)).float(), yb)
        if scaler and step == OVERFLOW_STEP and acc.process_index == 0:
            loss = loss * float("inf")
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(float(acc.reduce(loss.detach(), "mean")))
        if step + 1 == SAVE_AT and not resume:
            acc.save_state(str(state_dir))
    inner = opt.optimizer
    result = {
        "params": [p.detach().float().clone() for p in acc.unwrap_model(model).parameters()],
        "losses": losses,
        "scaler": acc.scaler.state_dict() if acc.scaler is not None else None,
        "state": {k: v.clone() if torch.is_tensor(v) else v for k, v in
                  inner.state[inner.param_groups[0]["params"][0]].items()},
    }
    acc.wait_for_everyone()
    return result


def _worker(out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = Path(out)
    results = {}
    variants = [
        ("no", "torch", False, torch.float32),
        ("bf16", "ours", False, torch.float32),
        ("bf16", "torch", False, torch.float32),
        ("bf16", "ours", False, torch.bfloat16),  # fp32 masters
        ("fp16", "ours", False, torch.float32),
        ("fp16", "torch", False, torch.float32),
        ("fp16", "ours", True, torch.float32),
        ("fp16", "torch", True, torch.float32),
    ]
    for precision, impl, scaler, dtype in variants:
        key = f"{precision}-{impl}{'-scaler' if scaler else ''}{'-bf16model' if dtype != torch.float32 else ''}"
        state_dir = out / f"state-{key}"
        results[key] = _run(precision, impl, scaler, state_dir, False, dtype)
        if impl == "ours":
            results[key + "-resumed"] = _run(precision, impl, scaler, state_dir, True, dtype)
    if dist.get_rank() == 0:
        torch.save(results, out / "results.pt")


# ---------------------------------------------------------------- the test


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("accelerate", reason='needs accelerate: pip install "fusetrain[accelerate]"')
    import fusetrain.integrations  # noqa: F401  (an import error fails here, not in 2 processes)

    out = tmp_path_factory.mktemp("accelerate")
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    proc = subprocess.Popen([sys.executable, __file__, str(out), str(port)], env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        log, _ = proc.communicate(timeout=420)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"the 2-process Accelerate run did not finish in 420 s:\n{log[-4000:]}")
    assert proc.returncode == 0, f"the 2-process Accelerate run failed:\n{log[-6000:]}"
    return torch.load(out / "results.pt")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _max_diff(a: list, b: list) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _assert_within_twice_torchs_error(results, ours: str, theirs: str, what: str) -> None:
    ref = results["no-torch"]
    o, t = results[ours], results[theirs]
    weight_err = _max_diff(t["params"], ref["params"])
    assert weight_err > 0, f"{what}: torch's run equals the fp32 run: nothing ran in 16 bits"
    assert _max_diff(o["params"], t["params"]) <= 2 * weight_err, (
        f"{what}: weights {_max_diff(o['params'], t['params']):.3g} from torch's, its own error {weight_err:.3g}"
    )
    finite = [i for i, v in enumerate(ref["losses"]) if abs(t["losses"][i]) != float("inf")]
    loss_err = max(abs(t["losses"][i] - ref["losses"][i]) for i in finite)
    loss_diff = max(abs(o["losses"][i] - t["losses"][i]) for i in finite)
    assert loss_diff <= 2 * loss_err + 1e-6, f"{what}: losses {o['losses']} vs torch's {t['losses']}"
    assert o["losses"][-1] < o["losses"][0], f"{what}: the loss did not fall: {o['losses']}"


def _assert_fp32_close(a: list, b: list, what: str) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5 * float(y.abs().max()),
                                   msg=lambda m: f"{what}, param {i}: {m}")


def test_bf16_trains_like_torchs_fused_adamw(results):
    _assert_within_twice_torchs_error(results, "bf16-ours", "bf16-torch", "bf16")


def test_fp16_on_the_cpu_is_float32_and_matches_torchs_fused_adamw(results):
    assert results["fp16-ours"]["scaler"] is None
    _assert_fp32_close(results["fp16-ours"]["params"], results["fp16-torch"]["params"], "fp16 flag on the CPU")
    _assert_fp32_close(results["fp16-ours"]["params"], results["no-torch"]["params"], "fp16 flag vs fp32")


def test_fp16_with_use_grad_scaler_skips_the_overflow_like_torch(results):
    ours, theirs = results["fp16-ours-scaler"], results["fp16-torch-scaler"]
    assert ours["losses"][OVERFLOW_STEP] == float("inf")
    # One back-off (2^8 -> 2^7), the growth tracker restarted after it.
    assert ours["scaler"]["scale"] == theirs["scaler"]["scale"] == 2.0**7
    assert ours["scaler"]["_growth_tracker"] == theirs["scaler"]["_growth_tracker"] == STEPS - OVERFLOW_STEP - 1
    # The skipped step counts no step, as torch's fused AdamW.
    assert float(ours["state"]["step"]) == float(theirs["state"]["step"]) == STEPS - 1
    _assert_within_twice_torchs_error(results, "fp16-ours-scaler", "fp16-torch-scaler", "fp16 with loss scaling")


@pytest.mark.parametrize("key", ["bf16-ours", "bf16-ours-bf16model", "fp16-ours-scaler"])
def test_load_state_resumes_to_the_uninterrupted_run(results, key):
    from conftest import assert_bits_equal

    whole, resumed = results[key], results[key + "-resumed"]
    for i, (a, b) in enumerate(zip(resumed["params"], whole["params"])):
        assert_bits_equal(a, b, f"param {i}")
    for name, value in whole["state"].items():
        assert_bits_equal(resumed["state"][name], value, name)
    if key == "bf16-ours-bf16model":
        assert whole["state"]["master_param"].dtype == torch.float32
    assert resumed["scaler"] == whole["scaler"]
    assert resumed["losses"] == whole["losses"][SAVE_AT:]


if __name__ == "__main__":
    from accelerate import notebook_launcher

    notebook_launcher(_worker, args=(sys.argv[1],), num_processes=2, use_port=sys.argv[2])
