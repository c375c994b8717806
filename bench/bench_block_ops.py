"""The fused transformer-block ops (issue 52) against torch eager, forward +
backward, side by side: layer norm and RMS norm with the residual add
(``add_layer_norm`` / ``add_rms_norm`` against ``x + r`` then torch's norm),
bias + GELU (against ``F.gelu(x + b)``) and SwiGLU from one [gate | up]
input (against ``F.silu(g) * u`` of its halves), at transformer widths
(768, 2048, 4096) and 8192 rows, bf16 and fp32.

Bytes each op must move (one activation = rows x width elements), the floor
the rate below counts against a copy timed in the same loop:
- add + norm: forward reads x and r, writes the sum and the output (4);
  backward reads dy, ds and the sum, writes dx (4): 8 activations.
- bias + GELU: forward reads x, writes y (2); backward reads dy and x,
  writes dx (3): 5.
- SwiGLU of [gate | up] (2 activations of width w): forward reads 2, writes
  1; backward reads dy and 2, writes 2: 8 of width w.
- rotary of q and k: forward reads and writes both, backward their
  gradients: 8 q-sized transfers (q is [8, 8, 128, 128]).
The weight/bias gradient partials (fp32, a row of them per 32 rows) add
1/16 of an fp32 activation and are not counted.

    python bench/run.py --only block_ops [--device cuda]
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import fusetrain.nn.functional as FF
from common import Context, copy_variant, gbps, interleave, median, result, spread

NAME = "block_ops"
ROWS = 8192
WIDTHS = (768, 2048, 4096)
GOAL = 2.0


def _leaves(*ts):
    return [t.detach().requires_grad_() for t in ts]


def cases(ctx: Context, width: int, dtype: torch.dtype):
    """(label, {"ours": fn, "torch": fn}, activation-sized transfers)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    dev = ctx.device

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=dev, dtype=dtype)

    x, r, dy, ds = (rand(ROWS, width) for _ in range(4))
    w, b = (torch.randn(width, generator=g).to(dev).requires_grad_() for _ in range(2))

    def add_norm(kind):
        def ours():
            xi, ri = _leaves(x, r)
            out, s = (FF.add_layer_norm(xi, ri, width, w, b) if kind == "layer"
                      else FF.add_rms_norm(xi, ri, width, w, 1e-6))
            torch.autograd.backward([out, s], [dy, ds])

        def eager():
            xi, ri = _leaves(x, r)
            s = xi + ri
            out = F.layer_norm(s, [width], w, b) if kind == "layer" else F.rms_norm(s, [width], w, 1e-6)
            torch.autograd.backward([out, s], [dy, ds])

        return {"ours": ours, "torch": eager}

    bias = rand(width).requires_grad_()

    def gelu_fns(approximate):
        def ours():
            (xi,) = _leaves(x)
            FF.gelu(xi, approximate, bias=bias).backward(dy)

        def eager():
            (xi,) = _leaves(x)
            F.gelu(xi + bias, approximate=approximate).backward(dy)

        return {"ours": ours, "torch": eager}

    gu = rand(ROWS, 2 * width)

    def swiglu_ours():
        (a,) = _leaves(gu)
        FF.swiglu(a).backward(dy)

    def swiglu_eager():
        (a,) = _leaves(gu)
        gate, up = a.chunk(2, -1)
        (F.silu(gate) * up).backward(dy)

    # Rotary: q and k [8, 8 heads, 128 positions, 128] (8192 rows of 128:
    # the same bytes as a 8192 x 1024 activation each), Hugging Face's
    # rotate_half form against ours; forward reads and writes q and k,
    # backward their gradients: 8 q-sized transfers.
    qk = [rand(8, 8, 128, 128) for _ in range(2)]
    dq = [rand(8, 8, 128, 128) for _ in range(2)]
    angles = torch.outer(torch.arange(128.0), 1e-2 * torch.arange(64.0)).to(dev)
    cos, sin = angles.cos(), angles.sin()
    cos_full, sin_full = (torch.cat([t, t], -1).to(dtype) for t in (cos, sin))

    def rotate_half(t):
        return torch.cat([-t[..., 64:], t[..., :64]], -1)

    def rotary_ours():
        q, k = _leaves(*qk)
        torch.autograd.backward(list(FF.apply_rotary(q, k, cos, sin)), dq)

    def rotary_eager():
        q, k = _leaves(*qk)
        outs = [t * cos_full + rotate_half(t) * sin_full for t in (q, k)]
        torch.autograd.backward(outs, dq)

    return [
        ("rotary q+k [8,8,128,128]", {"ours": rotary_ours, "torch": rotary_eager}, 8, qk[0]),
        ("add + layer norm", add_norm("layer"), 8, x),
        ("add + RMS norm", add_norm("rms"), 8, x),
        ("bias + GELU (erf)", gelu_fns("none"), 5, x),
        ("bias + GELU (tanh)", gelu_fns("tanh"), 5, x),
        ("SwiGLU [gate|up]", {"ours": swiglu_ours, "torch": swiglu_eager}, 8, x),
    ]


def bench(ctx: Context, label, fns, transfers, x) -> dict:
    copy_fn, copy_bytes = copy_variant(ctx, x.numel(), x.dtype)
    repeats = 5 if ctx.quick else 15
    times = interleave(dict(fns, copy=copy_fn), ctx, warmup=2, repeats=repeats)
    ours_s, torch_s, copy_s = (median(times[k]) for k in ("ours", "torch", "copy"))
    copy_gbps = gbps(copy_bytes, copy_s)
    moved = transfers * x.numel() * x.element_size()
    rate = gbps(moved, ours_s)
    dtype = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}[x.dtype]
    shape = "" if x.dim() > 2 else f" {ROWS}x{x.size(1)}"
    return result(
        f"{label} fwd+bwd, {dtype}{shape}",
        ours=ours_s * 1e3,
        torch_=torch_s * 1e3,
        unit="ms",
        higher_is_better=False,
        goal=GOAL,
        times={"ours": times["ours"], "torch": times["torch"]},
        notes=(f"{ctx.threads} threads; ours {rate:.1f} GB/s = {rate / copy_gbps:.0%} of copy "
               f"({copy_gbps:.1f} GB/s; floor {moved / (copy_gbps * 1e9) * 1e3:.2f} ms)"),
        spread_ours=spread(times["ours"]),
        spread_torch=spread(times["torch"]),
        bytes_moved=moved,
        copy_gbps=copy_gbps,
        copy_fraction=rate / copy_gbps,
        repeats=repeats,
    )


def run(ctx: Context) -> list:
    rows = []
    dtypes = (torch.bfloat16, torch.float32)
    widths = WIDTHS[:1] if ctx.quick else WIDTHS
    for dtype in dtypes:
        for width in widths:
            for label, fns, transfers, x in cases(ctx, width, dtype):
                if x.dim() > 2 and width != widths[0]:
                    continue  # the rotary row does not depend on the width
                rows.append(bench(ctx, label, fns, transfers, x))
    return rows


if __name__ == "__main__":
    import run as harness

    sys.exit(harness.main(["--only", NAME] + sys.argv[1:]))
