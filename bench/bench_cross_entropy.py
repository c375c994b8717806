"""Fused softmax cross-entropy: fusetrain.nn.functional.softmax_cross_entropy
against eager ``F.cross_entropy``, forward + backward on the same bf16
logits, side by side (issue 3's benchmark).

CUDA: N=16384 rows of C=32768 classes (a language model's vocabulary), the
issue's case; CPU: N=4096, a quarter of the rows, so that a run stays short
on a small machine. Each call is a forward and a backward into a fresh
gradient, as in a training step. Ours reads the logits twice (forward,
backward) and writes the gradient once, nothing else of size N x C; the rate
below counts those bytes against a plain copy of the logits timed in the same
loop. On CUDA the peak memory above the inputs shows what each keeps beyond
the gradient (torch: its bf16 log-softmax output and the one-hot gradient of
nll_loss; an fp32 copy of the logits would be twice their size).

    python bench/run.py --only cross_entropy [--device cuda]
    python bench/bench_cross_entropy.py [--device cuda]      # the same
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import fusetrain
from common import Context, copy_variant, cuda_peak_extra_mib, gbps, interleave, median, result, spread

NAME = "cross_entropy"

GOAL = 2.0  # issue 3, CUDA: at least 2x eager F.cross_entropy
C = 32768
ROWS = {"cuda": 16384, "cpu": 4096}
DTYPE = torch.bfloat16
MIB = 1 << 20


def make_inputs(ctx: Context, n: int, dtype: torch.dtype = DTYPE):
    g = torch.Generator().manual_seed(0)
    # Generated in chunks: an fp32 N x C staging copy would be the very
    # buffer this benchmark is about.
    x = torch.empty(n, C, dtype=dtype, device=ctx.device)
    for i in range(0, n, 1024):
        x[i : i + 1024] = (torch.randn(min(1024, n - i), C, generator=g) * 3.0).to(dtype)
    t = torch.randint(0, C, (n,), generator=g)
    t[::50] = -100  # a few padding positions, as in language-model batches
    return x.requires_grad_(), t.to(ctx.device)


def step_fn(loss_fn, x, t):
    def step():
        loss_fn(x, t).backward()

    return step


def clear_grad(x):
    # Untimed: freeing the previous call's gradient (the other variant's, as
    # the calls interleave) is an munmap of N x C elements, ~25 ms here, that
    # belongs to neither variant's work.
    def clear():
        x.grad = None

    return clear


def bench_forward_backward(ctx: Context, dtype: torch.dtype = DTYPE) -> dict:
    n = ROWS[ctx.device.type]
    x, t = make_inputs(ctx, n, dtype)
    fns = {
        "ours": step_fn(fusetrain.nn.functional.softmax_cross_entropy, x, t),
        "torch": step_fn(F.cross_entropy, x, t),
    }
    copy_fn, copy_bytes = copy_variant(ctx, n * C, dtype)
    fns["copy"] = copy_fn
    # A CPU call takes about a second: a few repeats say enough.
    repeats = ctx.repeats if ctx.is_cuda else (3 if ctx.quick else 7)
    warmup = ctx.warmup if ctx.is_cuda else 1
    times = interleave(fns, ctx, setup={"ours": clear_grad(x), "torch": clear_grad(x), "copy": None},
                       warmup=warmup, repeats=repeats)

    ours_s, torch_s, copy_s = (median(times[k]) for k in ("ours", "torch", "copy"))
    name = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}[dtype]
    logits_bytes = n * C * x.element_size()
    moved = 3 * logits_bytes  # forward read, backward read, gradient write
    copy_gbps = gbps(copy_bytes, copy_s)
    rate = gbps(moved, ours_s)
    floor_ms = moved / (copy_gbps * 1e9) * 1e3
    notes = (
        f"N={n} C={C} {name}, {ctx.threads} threads; ours {rate:.0f} GB/s = {rate / copy_gbps:.0%} of copy "
        f"({copy_gbps:.0f} GB/s, floor {floor_ms:.1f} ms)"
    )
    extra = {}
    if ctx.is_cuda:
        mem = {k: cuda_peak_extra_mib(ctx, fns[k]) for k in ("ours", "torch")}
        logits_mib = logits_bytes / MIB
        notes += (
            f"; peak memory beyond inputs: ours {mem['ours']:.0f} MiB, torch {mem['torch']:.0f} MiB "
            f"(gradient {logits_mib:.0f} MiB; an fp32 N x C buffer would be {2 * logits_mib:.0f} MiB)"
        )
        extra = {"peak_extra_mib_ours": mem["ours"], "peak_extra_mib_torch": mem["torch"], "logits_mib": logits_mib}
    return result(
        f"cross-entropy fwd+bwd, {name} {n}x{C}",
        ours=ours_s * 1e3,
        torch_=torch_s * 1e3,
        unit="ms",
        higher_is_better=False,
        goal=GOAL if ctx.is_cuda else None,
        notes=notes,
        spread_ours=spread(times["ours"]),
        spread_torch=spread(times["torch"]),
        bytes_moved=moved,
        copy_gbps=copy_gbps,
        floor_ms=floor_ms,
        repeats=repeats,
        **extra,
    )


def run(ctx: Context) -> list:
    rows = [bench_forward_backward(ctx)]
    if not ctx.is_cuda and not ctx.quick:
        # issue 14: within 2x of the memory floor for fp32 too on a CPU.
        rows.append(bench_forward_backward(ctx, torch.float32))
    return rows


if __name__ == "__main__":
    import run as harness

    sys.exit(harness.main(["--only", NAME] + sys.argv[1:]))
