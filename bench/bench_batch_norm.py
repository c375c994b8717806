"""Fused batch norm + ReLU (fusetrain.nn.functional.batch_norm_relu) against
torch's ``F.relu(F.batch_norm(...))``, forward + backward in training mode on
the default CNN's activations (issue 14), side by side.

Shapes: the per-rank batch of ``configs/fashion_mnist.yaml`` (64 images),
its two layer sizes (24 channels at 28x28, 48 at 14x14), channels_last, bf16
(what ``mixed_bfloat16`` gives the layer) and fp32. Ours reads the
activation twice and writes once forward, reads it (and the output and the
incoming gradient) twice and writes the input gradient once backward: 10
activation-sized transfers a step; the rate below counts those against a
plain copy of the activation timed in the same loop. CPU only: on CUDA the
function is torch's (cuDNN) batch norm.

    python bench/run.py --only batch_norm
    python bench/bench_batch_norm.py            # the same
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import fusetrain.nn.functional as FF
from common import Context, copy_variant, gbps, interleave, median, result, spread

NAME = "batch_norm"
SHAPES = [(64, 24, 28, 28), (64, 48, 14, 14)]
TRANSFERS = 10  # forward 2 reads + 1 write; backward 2 x (dy, out, x) reads + 1 write


def bench_shape(ctx: Context, shape, dtype) -> dict:
    g = torch.Generator().manual_seed(0)
    c = shape[1]
    x = (torch.randn(shape, generator=g) + 0.5).to(dtype).contiguous(memory_format=torch.channels_last)
    dy = torch.randn(shape, generator=g).to(dtype).contiguous(memory_format=torch.channels_last)
    weight = torch.randn(c, generator=g).requires_grad_()
    bias = torch.randn(c, generator=g).requires_grad_()
    stats = {k: (torch.zeros(c), torch.ones(c)) for k in ("ours", "torch")}

    def step(fn, key):
        def call():
            xi = x.detach().requires_grad_()
            rm, rv = stats[key]
            fn(xi, rm, rv).backward(dy)

        return call

    fns = {
        "ours": step(lambda xi, rm, rv: FF.batch_norm_relu(xi, rm, rv, weight, bias, training=True), "ours"),
        "torch": step(lambda xi, rm, rv: F.relu(F.batch_norm(xi, rm, rv, weight, bias, training=True)), "torch"),
    }
    copy_fn, copy_bytes = copy_variant(ctx, x.numel(), dtype)
    fns["copy"] = copy_fn
    repeats = 7 if ctx.quick else 31
    times = interleave(fns, ctx, warmup=3, repeats=repeats)
    ours_s, torch_s, copy_s = (median(times[k]) for k in ("ours", "torch", "copy"))
    moved = TRANSFERS * x.numel() * x.element_size()
    copy_gbps = gbps(copy_bytes, copy_s)
    rate = gbps(moved, ours_s)
    name = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    return result(
        f"batch norm + ReLU fwd+bwd, {name} {'x'.join(map(str, shape))} channels_last",
        ours=ours_s * 1e3,
        torch_=torch_s * 1e3,
        unit="ms",
        higher_is_better=False,
        notes=(f"{ctx.threads} threads; ours {rate:.1f} GB/s = {rate / copy_gbps:.0%} of copy "
               f"({copy_gbps:.1f} GB/s, floor {moved / (copy_gbps * 1e9) * 1e3:.2f} ms)"),
        spread_ours=spread(times["ours"]),
        spread_torch=spread(times["torch"]),
        bytes_moved=moved,
        copy_gbps=copy_gbps,
        repeats=repeats,
    )


def run(ctx: Context) -> list:
    if ctx.is_cuda:
        return []
    return [bench_shape(ctx, s, d) for d in (torch.bfloat16, torch.float32) for s in SHAPES]


if __name__ == "__main__":
    import run as harness

    sys.exit(harness.main(["--only", NAME] + sys.argv[1:]))
