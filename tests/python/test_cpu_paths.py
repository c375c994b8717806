"""The CPU vector paths (Note [CPU paths], issue 14): every lower path the
CPU can run, forced with FUSETRAIN_CPU_PATH in a subprocess, gives what the
default path gives: bit for bit for the unscale op (same operations in the
same order); for the optimizers bit for bit between the two vector paths
(one source, Note [SIMD regions]) and within a few float32 ulps of the
scalar loops (the vector loops contract multiply-adds into FMAs); the L2 norm
within its summation order; cross-entropy in its own test
(test_cross_entropy.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fusetrain import _C

SCRIPT = textwrap.dedent(
    """
    import sys, torch
    import fusetrain, fusetrain.optim
    from fusetrain import _C
    torch.set_num_threads(1)
    out = {"path": _C.cpu_features()["path"]}
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        grads = [(torch.randn(n, generator=g) * 1e3).to(dtype) for n in (1, 7, 64, 1000, 4099)]
        grads[3][17] = float("inf") if dtype != torch.float32 else grads[3][17]
        found = torch.zeros(1)
        torch.ops.fusetrain.non_finite_check_and_unscale_(grads, found, torch.tensor([1 / 1024.0]))
        out[f"unscale {dtype}"] = (grads, found)
        out[f"norm {dtype}"] = torch.ops.fusetrain.multi_tensor_l2norm(grads[:3] + grads[4:], False)[0]
    for name in ("adamw", "sgd"):
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator().manual_seed(1)
            params = [torch.randn(n, generator=g).to(dtype).requires_grad_() for n in (3, 33, 1025)]
            opt = (fusetrain.optim.FusedAdamW(params, lr=1e-2, weight_decay=0.1) if name == "adamw"
                   else fusetrain.optim.FusedSGD(params, lr=1e-2, momentum=0.9, weight_decay=0.1))
            for step in range(3):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=g).to(dtype)
                opt.step()
            out[f"{name} {dtype}"] = [p.detach() for p in params]
    torch.save(out, sys.argv[1])
    """
)


def run_on(path: str, tmp_path) -> dict:
    target = tmp_path / f"{path or 'default'}.pt"
    env = {k: v for k, v in os.environ.items() if k not in ("FUSETRAIN_CPU_PATH", "ATEN_CPU_CAPABILITY")}
    if path:
        env["FUSETRAIN_CPU_PATH"] = path
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(target)], capture_output=True, text=True,
                       env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return torch.load(target)


def lower_paths():
    f = _C.cpu_features()
    best = "avx512" if f["avx512"] else "avx2" if f["avx2"] else "scalar"
    order = ["scalar", "avx2", "avx512"]
    return order[: order.index(best)]


@pytest.mark.parametrize("path", ["scalar", "avx2"])
def test_forced_lower_path_matches_the_default(tmp_path, path):
    if path not in lower_paths():
        pytest.skip(f"{path} is this CPU's best path (or above it): nothing lower to compare")
    default = run_on("", tmp_path)
    forced = run_on(path, tmp_path)
    assert forced["path"] == path and default["path"] != path
    for key, value in default.items():
        if key == "path":
            continue
        got = forced[key]
        if key.startswith("unscale"):
            (grads, found), (fgrads, ffound) = value, got
            assert torch.equal(found, ffound), key
            for a, b in zip(grads, fgrads):
                assert torch.equal(a, b), key  # same operations, same order: bit for bit
        elif key.startswith("norm"):
            torch.testing.assert_close(got, value, rtol=1e-6, atol=0, msg=key)
        elif path == "avx2" and default["path"] == "avx512":
            for a, b in zip(value, got):
                assert torch.equal(a, b), key  # the same loop source at 8 and 16 lanes
        else:
            for a, b in zip(value, got):
                # float32: a few ulps of FMA contraction over 3 steps; bf16
                # parameters round those to at most one bf16 ulp.
                tol = dict(rtol=1e-6, atol=1e-7) if a.dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
                torch.testing.assert_close(b, a, msg=key, **tol)
