"""End-to-end tests of the `fusetrain train` / `fusetrain eval` CLI (issue 5):
the built binary run through subprocess on configs/tiny.yaml (a 4/8-channel
CNN on 1024 Fashion-MNIST images, seconds per run). One and two processes,
resumption equal to an uninterrupted run bit for bit, checkpoints that load
in Python and give the trainer's predictions, every bad-input case with its
message and exit code, and config override parsing.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("FUSETRAIN_BUILD_DIR", ROOT / "build")) / "fusetrain"
TINY = ROOT / "configs" / "tiny.yaml"
# Debian's dataset-fashion-mnist; the GPU box gets a copy (scripts/gpu_check.sh).
FASHION = Path(os.environ.get("FUSETRAIN_FASHION_MNIST", "/usr/share/datasets/fashion-mnist"))

pytestmark = [
    pytest.mark.skipif(not BIN.exists(), reason=f"{BIN} is missing: build it first "
                       "(cmake --build build --target fusetrain_cli, or make build)"),
    pytest.mark.skipif(not (FASHION / "train-images-idx3-ubyte.gz").exists(),
                       reason="Fashion-MNIST is missing: apt-get install dataset-fashion-mnist"),
]

# Exit codes of the CLI.
USAGE = 2
INTERRUPTED = 130


def run(*args, cwd=None, env=None, timeout=180) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(k, None)
    full_env.update(env or {})
    return subprocess.run([str(BIN), *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env=full_env, timeout=timeout)


def train(run_dir, *args, **kw) -> subprocess.CompletedProcess:
    if "FUSETRAIN_FASHION_MNIST" in os.environ:
        args = ("--set", f"data.path={FASHION}", *args)
    return run("train", "--config", TINY, "--run-dir", run_dir, *args, **kw)


def ok(p: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return p


def checkpoints(run_dir) -> list:
    return sorted((Path(run_dir) / "checkpoints").glob("step_*.pt"))


def load(path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def records(run_dir, kind) -> list:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def assert_same_state(a: dict, b: dict, prefixes=("model.", "optim.", "scaler.")) -> None:
    keys = [k for k in a if k.startswith(prefixes)]
    assert keys and sorted(keys) == sorted(k for k in b if k.startswith(prefixes))
    for k in keys:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), f"{k} differs: max |diff| {(a[k].double() - b[k].double()).abs().max()}"


# ------------------------------------------------------------------ runs


def test_single_process_run(tmp_path):
    p = ok(train(tmp_path / "run"))
    run_dir = tmp_path / "run"
    assert "epoch 2/2" in p.stdout and "accuracy" in p.stdout and "samples/s" in p.stdout
    assert "1 intra-op thread each" in p.stdout
    train_recs, evals = records(run_dir, "train"), records(run_dir, "eval")
    assert [r["epoch"] for r in evals] == [1, 2]
    for r in train_recs + evals:
        for field in ("step", "loss", "lr", "scale", "skipped", "samples_per_s", "accuracy"):
            assert field in r, field
    assert train_recs[-1]["step"] == 32 and all(r["samples_per_s"] > 0 for r in train_recs)
    assert evals[-1]["accuracy"] > 0.55, evals  # 10 classes: chance is 0.1
    assert train_recs[-1]["loss"] < train_recs[0]["loss"]
    # Checkpoints every 8 steps and at the end, readable by torch.load.
    assert [c.name for c in checkpoints(run_dir)] == [f"step_{s:08d}.pt" for s in (8, 16, 24, 32)]
    ckpt = load(checkpoints(run_dir)[-1])
    assert int(ckpt["trainer.step"]) == 32 and int(ckpt["trainer.epoch"]) == 2
    assert all(isinstance(v, torch.Tensor) for v in ckpt.values())
    for key in ("model.features.0.weight", "model.features.1.running_mean", "model.head.weight",
                "optim.head.weight.exp_avg", "optim.head.weight.step", "rng.cpu_state", "config.yaml"):
        assert key in ckpt, key
    import yaml

    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["model"]["channels"] == [8, 16] and resolved["output"]["run_dir"] == str(run_dir)


def test_two_processes_equal_one_process(tmp_path):
    # An MLP (no batch norm, whose statistics are per rank by design): data
    # parallelism over 2 ranks must give the single-process result.
    args = ("--set", "model.name=mlp", "--set", "model.hidden=32", "--epochs", "1")
    one = ok(train(tmp_path / "one", *args))
    two = ok(train(tmp_path / "two", "--nproc", "2", *args))
    assert "2 ranks on cpu (gloo, allreduce through shared memory)" in two.stdout
    # Only rank 0 prints.
    assert two.stdout.count("epoch 1/1") == 1 and one.stdout.count("epoch 1/1") == 1
    a, b = load(checkpoints(tmp_path / "one")[-1]), load(checkpoints(tmp_path / "two")[-1])
    for k in a:
        if k.startswith("model."):
            torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)
    # gloo's TCP allreduce instead: two ranks sum alike (a + b), so the same bits.
    tcp = ok(train(tmp_path / "tcp", "--nproc", "2", "--set", "parallel.shared_memory=false", *args))
    assert "2 ranks on cpu (gloo)" in tcp.stdout
    c = load(checkpoints(tmp_path / "tcp")[-1])
    for k in b:
        if k.startswith(("model.", "optim.")):
            assert torch.equal(c[k], b[k]), k
    assert abs(records(tmp_path / "one", "eval")[-1]["accuracy"] - records(tmp_path / "two", "eval")[-1]["accuracy"]) < 0.01


def test_communication_hooks_on_two_ranks(tmp_path):
    # parallel.comm_hook: "allreduce" (fusetrain's C++ hook) must give the
    # one-process result as the default reduction does; "bf16" and
    # "powersgd" (compressing from step 2, rank 2) must engage (other
    # parameters than the allreduce run) and still train.
    args = ("--set", "model.name=mlp", "--set", "model.hidden=32", "--epochs", "1")
    one = tmp_path / "one"
    ok(train(one, *args))
    runs = {}
    for hook in ("allreduce", "bf16", "powersgd"):
        runs[hook] = tmp_path / hook
        ok(train(runs[hook], "--nproc", "2", *args, "--set", f"parallel.comm_hook={hook}",
                 "--set", "parallel.powersgd_rank=2", "--set", "parallel.powersgd_start_iter=2"))
    a, b = load(checkpoints(one)[-1]), load(checkpoints(runs["allreduce"])[-1])
    keys = [k for k in a if k.startswith("model.")]
    for k in keys:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)
    for hook in ("bf16", "powersgd"):
        c = load(checkpoints(runs[hook])[-1])
        assert any(not torch.equal(c[k], b[k]) for k in keys), f"{hook}: the hook changed nothing"
        assert records(runs[hook], "eval")[-1]["accuracy"] > 0.55, hook  # 10 classes: chance is 0.1
    import yaml

    resolved = yaml.safe_load((runs["powersgd"] / "config.yaml").read_text())
    assert resolved["parallel"] == {"comm_hook": "powersgd", "powersgd_rank": 2, "powersgd_start_iter": 2,
                                    "shard": "none", "shared_memory": True}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def _run_ranks_by_hand(tmp_path, args, world=2, timeout=120, attempts=3):
    """Starts `world` trainer processes with torchrun's variables, as torchrun
    or a scheduler would, each in a session of its own; returns their exit
    codes, (stdout, stderr) and the directory holding their run dirs
    (run0, run1, ...). A port picked by binding port 0 and closing
    the socket can be taken by another process before rank 0 binds it again
    (the trainer's store needs a fixed MASTER_PORT, shared with the other
    ranks): when rank 0 fails with EADDRINUSE the attempt is killed and
    retried on a new port. Past the deadline every process is killed and the
    test fails with their output, so a rank that hangs cannot outlive it."""
    attempt = 0
    while True:
        port = _free_port()
        base = tmp_path / f"attempt{attempt}"
        base.mkdir()
        procs, files = [], []
        for rank in range(world):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            out, err = base / f"rank{rank}.out", base / f"rank{rank}.err"
            files.append((out, err))
            with open(out, "w") as fo, open(err, "w") as fe:
                procs.append(subprocess.Popen([str(BIN), "train", "--config", str(TINY), "--run-dir",
                                               str(base / f"run{rank}"), *args],
                                              stdout=fo, stderr=fe, env=env, start_new_session=True))
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                if procs[0].poll() not in (None, 0) and "EADDRINUSE" in files[0][1].read_text():
                    break
                time.sleep(0.1)
        finally:
            hung = [r for r, p in enumerate(procs) if p.poll() is None]
            for p in procs:
                _kill_group(p)
        outs = [(o.read_text(), e.read_text()) for o, e in files]
        if procs[0].returncode != 0 and "EADDRINUSE" in outs[0][1]:
            attempt += 1
            if attempt < attempts:
                continue
            pytest.fail(f"rank 0 found its port taken in {attempts} attempts:\n{outs[0][1][:1000]}")
        if hung:
            pytest.fail(f"ranks {hung} still running after {timeout} s (killed): {outs}")
        return [p.returncode for p in procs], outs, base


def test_joins_a_group_from_the_torchrun_environment(tmp_path):
    # Two ranks started by hand, as torchrun or a scheduler would: each joins
    # the group the variables describe; rank 0 alone prints and writes.
    args = ("--set", "model.name=mlp", "--set", "model.hidden=32", "--epochs", "1")
    codes, outs, runs = _run_ranks_by_hand(tmp_path, args)
    assert codes == [0, 0], outs
    assert "2 ranks on cpu (gloo, allreduce through shared memory)" in outs[0][0] and outs[1][0] == ""
    assert checkpoints(runs / "run0") and not (runs / "run1").exists()
    ok(train(tmp_path / "single", *args))
    a, b = load(checkpoints(tmp_path / "single")[-1]), load(checkpoints(runs / "run0")[-1])
    for k in a:
        if k.startswith("model."):
            torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)


def test_two_process_cnn_with_mixed_precision(tmp_path):
    p = ok(train(tmp_path / "run", "--nproc", "2", "--precision", "mixed_bfloat16",
                 "--set", "train.grad_accum=2", "--set", "train.clip_grad_norm=1.0"))
    assert "mixed_bfloat16" in p.stdout and "2 micro-batches" in p.stdout
    assert records(tmp_path / "run", "eval")[-1]["accuracy"] > 0.5


@pytest.mark.parametrize(
    "variant",
    [
        ("--precision", "float32"),
        # Dropout (random streams), fp16 loss scaling, accumulation with
        # no_sync, clipping and master weights, on two ranks.
        ("--nproc", "2", "--precision", "mixed_float16", "--set", "model.name=mlp", "--set", "model.dropout=0.2",
         "--set", "train.grad_accum=2", "--set", "train.clip_grad_norm=0.5", "--set", "precision.master_weights=true"),
    ],
    ids=["cnn-float32", "mlp-fp16-2proc"],
)
def test_resume_equals_uninterrupted(tmp_path, variant):
    ok(train(tmp_path / "full", *variant))
    full = checkpoints(tmp_path / "full")
    middle = full[1]  # step 16 of 32
    assert middle.name == "step_00000016.pt"
    ok(train(tmp_path / "resumed", *variant, "--resume", middle))
    assert_same_state(load(full[-1]), load(checkpoints(tmp_path / "resumed")[-1]))
    # The resumed run's metrics continue where the checkpoint left off.
    steps = [r["step"] for r in records(tmp_path / "resumed", "train")]
    assert steps[0] == 20 and steps[-1] == 32


def test_resume_auto_into_the_same_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    ok(train(run_dir, "--set", "train.max_steps=16"))
    # Same dir, longer schedule would change the LR; resume the finished run.
    p = ok(train(run_dir, "--set", "train.max_steps=16", "--resume", "auto"))
    assert "nothing to train" in p.stdout
    p = ok(train(tmp_path / "fresh", "--set", "train.max_steps=4", "--resume", "auto"))
    assert "resumed" not in p.stdout


def test_steps_per_execution_gives_identical_results(tmp_path):
    ok(train(tmp_path / "k1", "--epochs", "1"))
    p = ok(train(tmp_path / "k4", "--epochs", "1", "--steps-per-execution", "4"))
    assert_same_state(load(checkpoints(tmp_path / "k1")[-1]), load(checkpoints(tmp_path / "k4")[-1]))


def test_steps_per_execution_with_accumulation_clipping_and_resume_is_identical(tmp_path):
    # 16 steps an epoch, K = 5: executions of 5, 5, 5 and 1 steps per epoch.
    # A second K = 5 run resumes from a checkpoint in the middle of epoch 2.
    args = ("--set", "train.grad_accum=2", "--set", "train.clip_grad_norm=0.5", "--set", "model.dropout=0.3",
            "--epochs", "3")
    ok(train(tmp_path / "k1", *args))
    ok(train(tmp_path / "k5", *args, "--steps-per-execution", "5"))
    mid = [c for c in checkpoints(tmp_path / "k5") if 16 < load(c)["trainer.step"] < 32]
    assert mid and load(mid[0])["trainer.step"] % 16 != 0, checkpoints(tmp_path / "k5")
    ok(train(tmp_path / "resumed", *args, "--steps-per-execution", "5", "--resume", mid[0]))
    final = load(checkpoints(tmp_path / "k1")[-1])
    assert_same_state(final, load(checkpoints(tmp_path / "k5")[-1]))
    assert_same_state(final, load(checkpoints(tmp_path / "resumed")[-1]))


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["float32", "mixed_float16", "mixed_bfloat16"])
def test_cuda_graph_steps_match_eager_steps(tmp_path, precision):
    # K = 8 captures each full execution as a CUDA graph (16 steps an epoch:
    # two eager warm-up executions, then replays); the learning rate schedule
    # runs inside the graph. A replay runs the eager step's kernels on the same
    # inputs (the lr the same double, read from a device tensor; this model
    # draws no random numbers), so every state tensor must come out the same
    # bits, as on the CPU (test_steps_per_execution_gives_identical_results).
    # No tolerance could stand in for that: on the CPU, this run with 2
    # threads instead of 1 (other summation orders) ends with parameters up
    # to 0.8% and moments up to 11% of their largest entry apart after these
    # 48 steps, and with an lr one fp32 ulp larger, 16-bit runs end up to 28%
    # apart; a tolerance that admits one rounding admits any bug.
    common = ("--device", "cuda", "--precision", precision, "--set", "train.clip_grad_norm=1.0")
    ok(train(tmp_path / "eager", *common, "--epochs", "3"))
    p = ok(train(tmp_path / "graph", *common, "--epochs", "3", "--steps-per-execution", "8"))
    assert "cuda" in p.stdout
    a, b = load(checkpoints(tmp_path / "eager")[-1]), load(checkpoints(tmp_path / "graph")[-1])
    assert int(a["trainer.step"]) == int(b["trainer.step"]) == 48
    assert_same_state(a, b)
    eager, graph = records(tmp_path / "eager", "eval")[-1], records(tmp_path / "graph", "eval")[-1]
    # The CPU run's floor (test_single_process_run, 2 epochs): both learn.
    assert eager["accuracy"] > 0.55, eager
    assert graph["accuracy"] == eager["accuracy"] and graph["test_loss"] == eager["test_loss"], (graph, eager)


def _fashion_test_images(n: int) -> torch.Tensor:
    raw = gzip.open(FASHION / "t10k-images-idx3-ubyte.gz").read()
    return torch.from_numpy(np.frombuffer(raw, np.uint8, offset=16).copy()).view(-1, 28, 28)[:n]


def test_checkpoint_loads_in_python_with_the_same_predictions(tmp_path):
    from fusetrain.load_checkpoint import load_model, preprocess

    ok(train(tmp_path / "run"))
    ckpt = checkpoints(tmp_path / "run")[-1]
    preds = tmp_path / "preds.pt"
    p = ok(run("eval", "--checkpoint", ckpt, "--predictions", preds))
    acc = records(tmp_path / "run", "eval")[-1]["accuracy"]
    assert f"accuracy {100 * acc:.2f}%" in p.stdout
    trainer_logits = load(preds)["logits"]
    model = load_model(str(ckpt))
    with torch.no_grad():
        logits = model(preprocess(_fashion_test_images(256), model))
    torch.testing.assert_close(logits, trainer_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(logits.argmax(1), trainer_logits.argmax(1))
    cli = subprocess.run([sys.executable, "-m", "fusetrain.load_checkpoint", str(ckpt)],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0 and "Cnn with" in cli.stdout, cli.stdout + cli.stderr


def test_plot_writes_a_png(tmp_path):
    ok(train(tmp_path / "run", "--epochs", "1"))
    p = subprocess.run([sys.executable, "-m", "fusetrain.plot", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "run" / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args",
    [
        ("--set", "model.name=resnet", "--set", "model.depth=18", "--set", "model.width=4",
         "--set", "data.name=synthetic_images", "--set", "data.image_size=8", "--set", "data.train_samples=128",
         "--set", "data.test_samples=64"),
        ("--set", "model.name=resnet", "--set", "model.depth=50", "--set", "model.width=2",
         "--set", "data.name=synthetic_images", "--set", "data.image_size=8", "--set", "data.train_samples=128",
         "--set", "data.test_samples=64", "--precision", "mixed_bfloat16"),
        ("--config", ROOT / "configs" / "gpt_tiny.yaml", "--set", "model.d_model=32", "--set", "model.n_layer=1",
         "--set", "model.seq_len=32", "--set", "train.max_steps=6"),
        ("--config", ROOT / "configs" / "gpt_tiny.yaml", "--set", "data.name=synthetic_tokens",
         "--set", "model.d_model=32", "--set", "model.seq_len=16", "--set", "data.train_samples=256",
         "--set", "data.test_samples=64", "--set", "train.max_steps=6", "--set", "optimizer.name=sgd"),
    ],
    ids=["resnet18", "resnet50-bf16", "gpt-text", "gpt-synthetic-sgd"],
)
def test_other_models_train_and_load_in_python(tmp_path, args):
    from fusetrain.load_checkpoint import load_model

    p = ok(run("train", "--config", TINY, *args, "--run-dir", tmp_path / "run", "--epochs", "1"))
    evals = records(tmp_path / "run", "eval")
    assert evals and np.isfinite(evals[-1]["test_loss"]), p.stdout
    # The rebuilt torch.nn.Module gives the trainer's predictions (float32 both).
    ckpt, preds = checkpoints(tmp_path / "run")[-1], tmp_path / "preds.pt"
    ok(run("eval", "--checkpoint", ckpt, "--predictions", preds, "--set", "precision.policy=float32"))
    saved = load(preds)
    model = load_model(str(ckpt))
    with torch.no_grad():
        logits = model(saved["inputs"])
    torch.testing.assert_close(logits, saved["logits"], rtol=1e-4, atol=1e-4)


def test_gpt_fused_head_loss_follows_the_unfused_loss_curve(tmp_path):
    """model.fused_head_loss (the head and the loss as one chunked op) takes
    the steps the logits-then-cross-entropy path takes, up to fp32 rounding:
    float32 throughout, so the losses agree to a few ulps a step, and the
    parameters after 8 AdamW steps to ~1e-5 (AdamW's update divides by
    sqrt(v), which amplifies a gradient's last-bit difference at most by
    the learning rate's order)."""
    args = ("--config", ROOT / "configs" / "gpt_tiny.yaml", "--set", "model.d_model=32", "--set",
            "model.n_layer=1", "--set", "model.seq_len=32", "--set", "train.max_steps=8", "--set",
            "train.log_every=1", "--set", "train.label_smoothing=0.1", "--precision", "float32")
    runs = {}
    for fused in ("true", "false"):
        ok(run("train", "--config", TINY, *args, "--set", f"model.fused_head_loss={fused}",
               "--run-dir", tmp_path / fused))
        runs[fused] = ([r["loss"] for r in records(tmp_path / fused, "train")],
                       load(checkpoints(tmp_path / fused)[-1]))
    losses, state = runs["true"]
    ref_losses, ref_state = runs["false"]
    assert len(losses) == len(ref_losses) == 8
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for k, v in ref_state.items():
        if k.startswith("model.") and torch.is_tensor(v) and v.is_floating_point():
            torch.testing.assert_close(state[k], v, rtol=1e-4, atol=1e-5, msg=k)


# ------------------------------------------------------------------ signals and failures


def _wait_for(path: Path, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and path.stat().st_size > 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"{path} did not appear within {timeout} s")


def _children(pid: int) -> list:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("nproc", [1, 2])
def test_ctrl_c_saves_a_checkpoint_and_resume_continues(tmp_path, nproc):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([str(BIN), "train", "--config", str(TINY), "--run-dir", str(run_dir),
                             "--epochs", "200", "--nproc", str(nproc), "--set", "output.checkpoint_every=0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(run_dir / "metrics.jsonl", 60)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == INTERRUPTED, out + err
    assert "interrupted at step" in out and "--resume" in out
    saved = checkpoints(run_dir)
    assert len(saved) == 1
    step = int(load(saved[0])["trainer.step"])
    assert step > 0
    p = ok(train(run_dir, "--epochs", "200", "--nproc", str(nproc), "--set", "train.max_steps=" + str(step + 4),
                 "--resume", saved[0]))
    assert f"resumed from {saved[0]} at step {step}" in p.stdout


@pytest.mark.parametrize("k, stop_step, syncs, log_steps", [
    # K = 1: stop checks at 5, 10, ..., 30; logs at 12, 24, 32; epoch ends 16, 32.
    (1, 5, 10, [12, 24, 32]),
    # K = 3, executions ending at 3, 6, 9, 12, 15, 16, 19, ..., 31, 32: the
    # checks fall at the first bound at or past each multiple of 5 (6, 12, 15,
    # 22, 25, 31), the logs at 12, 25, 32.
    (3, 6, 8, [12, 25, 32]),
])
def test_stop_checks_follow_sync_every_on_every_rank(tmp_path, k, stop_step, syncs, log_steps):
    # train.sync_every=5 on two ranks, 32 steps: the host synchronises at the
    # stop checks and where a value is read (logging, epoch ends) and nowhere
    # else, with the same results as synchronising at every execution.
    # train.max_time_s already spent at the start stops the run at the first
    # stop check, on both ranks (a rank that checked at another step would
    # leave the other waiting in a collective), and resuming from there ends
    # with the uninterrupted bits.
    common = ("--nproc", "2", "--steps-per-execution", k, "--set", "train.log_every=12",
              "--set", "output.checkpoint_every=0")
    every = ok(train(tmp_path / "every", *common, "--set", "train.sync_every=1", timeout=120))
    executions = 32 if k == 1 else 12
    assert f"host: {executions} synchronisations in 32 steps; stop checks every 1 step (train.sync_every)" in every.stdout
    five = ok(train(tmp_path / "five", *common, "--set", "train.sync_every=5", timeout=120))
    assert f"host: {syncs} synchronisations in 32 steps; stop checks every 5 steps (train.sync_every)" \
        in five.stdout, five.stdout
    final = load(checkpoints(tmp_path / "every")[-1])
    assert_same_state(final, load(checkpoints(tmp_path / "five")[-1]))
    assert [r["step"] for r in records(tmp_path / "five", "train")] == log_steps
    assert [r["step"] for r in records(tmp_path / "five", "eval")] == [16, 32]

    cut = ok(train(tmp_path / "cut", *common, "--set", "train.sync_every=5", "--set", "train.max_time_s=0.001",
                   timeout=120))
    assert f"train.max_time_s=0.001 s reached at step {stop_step} of 32" in cut.stdout, cut.stdout
    saved = checkpoints(tmp_path / "cut")
    assert [int(load(c)["trainer.step"]) for c in saved] == [stop_step]
    ok(train(tmp_path / "resumed", *common, "--set", "train.sync_every=5", "--resume", saved[0], timeout=120))
    assert_same_state(final, load(checkpoints(tmp_path / "resumed")[-1]))


def test_a_failing_rank_stops_the_others(tmp_path):
    proc = subprocess.Popen([str(BIN), "train", "--config", str(TINY), "--run-dir", str(tmp_path / "run"),
                             "--epochs", "500", "--nproc", "2", "--set", "output.checkpoint_every=0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(tmp_path / "run" / "metrics.jsonl", 60)
        ranks = _children(proc.pid)
        assert len(ranks) == 2
        os.kill(ranks[1], signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert "was killed by signal 9" in err and "stopping the other 1 rank" in err, err
    time.sleep(0.2)
    assert not any(_alive(pid) for pid in ranks), "a rank outlived the launcher"


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "args, expected",
    [
        (("--set", "optimizer.lrr=0.1"), ['unknown key "optimizer.lrr"', 'did you mean "lr"', "keys of optimizer:"]),
        (("--set", "optimiser.lr=0.1"), ['unknown key "optimiser.lr"', "sections: model, data"]),
        (("--set", "optimizer.lr=fast"), ["optimizer.lr", '"fast" is not a number', "accepted: a number >= 0"]),
        (("--set", "model.name=cnnn"), ["model.name", "accepted values: mlp, cnn, resnet, gpt"]),
        (("--set", "model.depth=34"), ["model.depth", "accepted values: 18, 50"]),
        (("--set", "model.channels=8,x"), ["model.channels", '"x", not an integer']),
        (("--set", "train.epochs=0"), ["train.epochs", "out of range"]),
        (("--set", "optimizer.lr"), ["expected key=value"]),
        (("--epochs", "two"), ["--epochs", "train.epochs", "not an integer"]),
        (("--nproc", "3"), ["data.batch_size=64", "divisible by the world size 3"]),
        (("--set", "data.path=/nonexistent"), ["/nonexistent/train-images-idx3-ubyte.gz does not exist",
                                               "apt-get install dataset-fashion-mnist"]),
        (("--set", "precision.master_weights=true"), ["precision.master_weights", "needs a mixed policy"]),
        (("--set", "model.name=gpt"), ["model.name", "gpt trains on tokens"]),
        (("--set", "model.convs_per_block=[1,2,2]"), ["model.convs_per_block=1,2,2", "3 counts for 2 blocks"]),
        (("--resume", "/nonexistent.pt"), ["--resume /nonexistent.pt: no such checkpoint file"]),
        (("--bogus",), ["Option", "bogus"]),
    ],
    ids=["unknown-key", "unknown-section", "not-a-number", "bad-choice", "bad-int-choice", "bad-list",
         "out-of-range", "no-equals", "bad-flag", "indivisible-batch", "missing-dataset",
         "master-weights-float32", "model-data-mismatch", "convs-per-block-count", "missing-checkpoint",
         "unknown-option"],
)
def test_bad_input_is_a_usage_error(tmp_path, args, expected):
    p = train(tmp_path / "run", *args)
    assert p.returncode == USAGE, p.stdout + p.stderr
    for text in expected:
        assert text in p.stderr, f"{text!r} not in {p.stderr!r}"
    assert not (tmp_path / "run").exists(), "a failed start wrote files"


def test_bad_yaml_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  name: cnn\noptimizer:\n  lr: 0.1\n  momentun: 0.9\n")
    p = run("train", "--config", bad, "--run-dir", tmp_path / "run")
    assert p.returncode == USAGE
    assert f"{bad}:5: unknown key \"optimizer.momentun\"" in p.stderr and 'did you mean "momentum"' in p.stderr
    bad.write_text("model:\n  name: [cnn\n")
    p = run("train", "--config", bad)
    assert p.returncode == USAGE and f"{bad}:" in p.stderr and "not valid YAML" in p.stderr


def _cuda_devices() -> int:
    # Asked of the binary: the CLI's view is what the checks use.
    info = ok(run("info")).stdout
    return int(info.split("CUDA devices: ")[1].split()[0])


def test_cuda_request_without_a_gpu_fails_before_work(tmp_path):
    if _cuda_devices() > 0:
        pytest.skip("checks the message for a machine without a GPU")
    p = train(tmp_path / "run", "--device", "cuda")
    assert p.returncode == USAGE and "no CUDA device is visible" in p.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.cuda
def test_cuda_request_for_more_ranks_than_gpus_fails_before_work(tmp_path):
    gpus = _cuda_devices()
    assert gpus > 0, "torch sees a GPU but the trainer does not: is it a CPU-only build?"
    p = train(tmp_path / "run", "--device", "cuda", "--nproc", str(gpus + 1))
    assert p.returncode == USAGE and "runtime.nproc" in p.stderr and "GPUs" in p.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_checkpoint_is_an_error_and_nothing_is_overwritten(tmp_path, damage):
    run_dir = tmp_path / "run"
    ok(train(run_dir, "--epochs", "1"))
    ckpt = checkpoints(run_dir)[-1]
    data = bytearray(ckpt.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF  # inside the tensor data
    ckpt.write_bytes(bytes(data))
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    p = train(run_dir, "--epochs", "1", "--resume", ckpt)
    assert p.returncode == USAGE, p.stdout + p.stderr
    assert "corrupt" in p.stderr and str(ckpt) in p.stderr
    after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert before == after
    e = run("eval", "--checkpoint", ckpt)
    assert e.returncode == USAGE and "corrupt" in e.stderr


def test_malformed_torchrun_environment(tmp_path):
    p = train(tmp_path / "run", env={"RANK": "one", "WORLD_SIZE": "2"})
    assert p.returncode == USAGE and "RANK" in p.stderr


def test_unknown_command_and_help():
    assert run("fly").returncode == USAGE
    p = run("train", "--help")
    assert p.returncode == 0 and "--steps-per-execution" in p.stdout and "--resume" in p.stdout
    p = run("train", "--list-keys")
    assert p.returncode == 0 and "optimizer.lr" in p.stdout and "precision.policy" in p.stdout


# ------------------------------------------------------------------ overrides


def test_config_overrides_are_parsed(tmp_path):
    import yaml

    p = ok(run("train", "--config", "tiny", "--set", "model.channels=[8, 16]", "--set", "optimizer.lr=3e-4",
               "--set", "precision.master_weights=yes", "--precision", "mixed_bfloat16", "--epochs", "3",
               "--steps-per-execution", "4", "--device", "cpu", "--set", "output.run_dir=somewhere",
               "--set", "model.hidden=32,16", "--print-config", cwd=tmp_path))
    c = yaml.safe_load(p.stdout)
    assert c["model"]["channels"] == [8, 16] and c["model"]["hidden"] == [32, 16]
    assert c["optimizer"]["lr"] == pytest.approx(3e-4)
    assert c["precision"]["master_weights"] is True and c["precision"]["policy"] == "mixed_bfloat16"
    assert c["train"]["epochs"] == 3 and c["train"]["steps_per_execution"] == 4
    assert c["output"]["run_dir"] == str(tmp_path / "somewhere")  # resolved in the working directory
    assert c["data"]["train_samples"] == 1024  # from the file
    assert c["optimizer"]["beta2"] == pytest.approx(0.999)  # a default
    assert not (tmp_path / "runs").exists()
    # The last of repeated overrides wins; the printed config reads back the same.
    p = ok(run("train", "--config", "tiny", "--set", "train.seed=1", "--set", "train.seed=7", "--print-config"))
    assert yaml.safe_load(p.stdout)["train"]["seed"] == 7
    again = tmp_path / "again.yaml"
    again.write_text(p.stdout)
    assert ok(run("train", "--config", again, "--print-config")).stdout == p.stdout


def test_print_schema_is_the_schema_as_json():
    """--print-schema: every key --list-keys lists, with its type, a default
    of that type, accepted values and meaning (docs/reference/config.md is
    generated from it)."""
    p = ok(run("train", "--print-schema"))
    keys = json.loads(p.stdout)["keys"]
    by_key = {k["key"]: k for k in keys}
    listed = ok(run("train", "--list-keys")).stdout
    assert len(by_key) == len(keys) > 50
    for k in keys:
        assert f"  {k['key']} = " in listed, k["key"]
        assert k["section"] == k["key"].split(".")[0] and k["help"]
        expected = {"int": int, "float": float, "bool": bool, "string": str, "int_list": list}[k["type"]]
        assert type(k["default"]) is expected, k
    assert by_key["optimizer.lr"] == {"key": "optimizer.lr", "section": "optimizer", "type": "float",
                                      "default": 0.001, "choices": [], "min": 0, "max": None,
                                      "help": "peak learning rate"}
    assert by_key["model.channels"]["default"] == [16, 32]
    assert by_key["precision.policy"]["choices"][0] == "auto" and by_key["precision.policy"]["default"] == "auto"
    assert by_key["data.std"]["min"] == pytest.approx(1e-12)
