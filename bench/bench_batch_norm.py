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

Also the 2x2 max pooling that follows each block (fusetrain.nn.functional.
max_pool2d against ``F.max_pool2d``), forward + backward on the current
default CNN's activations (16 channels at 28x28, 32 at 14x14; and the
first in NCHW, as a model without channels_last has it): ours reads
the activation and writes a quarter of it and a byte a window forward,
reads those back and writes the input gradient backward (2.5 activations
and two bytes a window).

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
    return timed_row(ctx, "batch norm + ReLU", fns, x, TRANSFERS * x.numel() * x.element_size())


def timed_row(ctx: Context, label: str, fns: dict, x: torch.Tensor, moved: int) -> dict:
    """ours against torch, interleaved with a copy of x, as one result row:
    time, and the rate of `moved` bytes against the copy's."""
    copy_fn, copy_bytes = copy_variant(ctx, x.numel(), x.dtype)
    fns = dict(fns, copy=copy_fn)
    repeats = 7 if ctx.quick else 31
    times = interleave(fns, ctx, warmup=3, repeats=repeats)
    ours_s, torch_s, copy_s = (median(times[k]) for k in ("ours", "torch", "copy"))
    copy_gbps = gbps(copy_bytes, copy_s)
    rate = gbps(moved, ours_s)
    name = {torch.bfloat16: "bf16", torch.float32: "fp32"}[x.dtype]
    return result(
        f"{label} fwd+bwd, {name} {'x'.join(map(str, x.shape))} "
        f"{'NCHW' if x.is_contiguous() and x.size(1) > 1 else 'channels_last'}",
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


POOL_SHAPES = [(64, 16, 28, 28), (64, 32, 14, 14)]


def bench_pool(ctx: Context, shape, dtype, fmt=torch.channels_last) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(dtype).contiguous(memory_format=fmt)
    out_shape = (shape[0], shape[1], shape[2] // 2, shape[3] // 2)
    dy = torch.randn(out_shape, generator=g).to(dtype).contiguous(memory_format=fmt)

    def step(fn):
        def call():
            xi = x.detach().requires_grad_()
            fn(xi, 2).backward(dy)

        return call

    fns = {"ours": step(FF.max_pool2d), "torch": step(F.max_pool2d)}
    return timed_row(ctx, "2x2 max pool", fns, x, int(2.5 * x.numel() * x.element_size()) + 2 * x.numel() // 4)


def run(ctx: Context) -> list:
    if ctx.is_cuda:
        return []
    return ([bench_shape(ctx, s, d) for d in (torch.bfloat16, torch.float32) for s in SHAPES]
            + [bench_pool(ctx, s, d) for d in (torch.bfloat16, torch.float32) for s in POOL_SHAPES]
            + [bench_pool(ctx, POOL_SHAPES[0], d, torch.contiguous_format) for d in (torch.bfloat16, torch.float32)])


if __name__ == "__main__":
    import run as harness

    sys.exit(harness.main(["--only", NAME] + sys.argv[1:]))
