"""The window max pool (fusetrain.nn.functional.max_pool2d, fusetrain.nn.MaxPool2d
and their ops) against torch's F.max_pool2d and its autograd on the same
inputs: pooling picks input elements and the gradient moves them, so there
is no rounding to allow for and every comparison is bit for bit (NaN
payloads aside, see bits()), including
the choice among equal maxima (torch keeps the first), NaNs (the last),
-inf windows, -0.0 gradients (torch adds them to zeros: +0.0) and the rows
and columns past the last whole window (zero gradient).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import fusetrain.nn
from fusetrain import _C
from fusetrain.nn import functional as FF

OP = torch.ops.fusetrain.max_pool2d.default
BACKWARD = torch.ops.fusetrain.max_pool2d_backward.default
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bits of every element, with one pattern for every NaN: torch's
    own layouts disagree on NaN payloads (its NCHW bfloat16 pooling returns
    0x7fc0 for an input NaN of 0xffff, its channels_last pooling the input's
    bits), so only where the NaNs are is compared."""
    t = t.contiguous()
    return torch.where(t.isnan(), -1, t.view(BITS[t.dtype]).to(torch.int32))


def make(shape, dtype, fmt, seed=0):
    """Values from a handful of integers (many ties in a window), a few NaNs
    and -infs, and gradients with -0.0 and NaN among them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, shape, generator=g).float()
    u = torch.rand(shape, generator=g)
    x[u < 0.02] = float("nan")
    x[(u >= 0.02) & (u < 0.05)] = float("-inf")
    x = x.to(dtype).contiguous(memory_format=fmt)
    return x


def grad_like(out: torch.Tensor, seed=1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    dy = torch.randn(out.shape, generator=g)
    u = torch.rand(out.shape, generator=g)
    dy[u < 0.1] = -0.0
    dy[u > 0.98] = float("nan")
    return dy.to(out.dtype).contiguous(memory_format=torch.channels_last if out.is_contiguous(
        memory_format=torch.channels_last) else torch.contiguous_format)


def torch_reference(x, kernel, dy):
    xr = x.detach().clone().requires_grad_()
    out, idx = F.max_pool2d(xr, kernel, return_indices=True)
    out.backward(dy)
    return out.detach(), idx, xr.grad


def positions(idx: torch.Tensor, kernel, width: int) -> torch.Tensor:
    """torch's flat indices (h * W + w) as positions in the window."""
    kh, kw = kernel
    oh = torch.arange(idx.shape[2]).view(-1, 1) * kh
    ow = torch.arange(idx.shape[3]).view(1, -1) * kw
    return ((idx // width - oh) * kw + (idx % width - ow)).to(torch.uint8)


# (shape, kernel): channel counts below, at and past the 8- and 16-lane
# vectors (channels_last), rows of windows past them (NCHW 2x2), odd heights
# and widths (rows and columns past the last window), windows of 2x2, 3x3,
# 2x3 and 1x1.
CASES = [
    ((4, 16, 8, 8), (2, 2)),
    ((3, 19, 9, 11), (2, 2)),
    ((2, 40, 7, 7), (2, 2)),
    ((2, 1, 5, 6), (2, 2)),
    ((2, 5, 10, 9), (3, 3)),
    ((2, 24, 7, 10), (2, 3)),
    ((1, 9, 3, 4), (1, 1)),
    ((2, 3, 6, 70), (2, 2)),  # NCHW rows of 35 windows: vectors of 8 and 16, the last overlapping
    ((3, 4, 4, 28), (2, 2)),  # 14 windows: under one 16-lane vector, so 8-lane ones
    ((2, 2, 5, 67), (2, 2)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", [torch.channels_last, torch.contiguous_format], ids=["cl", "nchw"])
@pytest.mark.parametrize("shape,kernel", CASES)
def test_matches_torch_bit_for_bit(shape, kernel, fmt, dtype):
    x = make(shape, dtype, fmt)
    out, argmax = OP(x, list(kernel))
    dy = grad_like(out)
    ref_out, ref_idx, ref_grad = torch_reference(x, kernel, dy)
    assert out.dtype == dtype and argmax.dtype == torch.uint8
    assert out.is_contiguous(memory_format=fmt) and argmax.is_contiguous(memory_format=fmt)
    assert torch.equal(bits(out), bits(ref_out))
    assert torch.equal(argmax, positions(ref_idx, kernel, shape[3]))
    grad = BACKWARD(dy, x, argmax, list(kernel))
    assert grad.is_contiguous(memory_format=fmt)
    assert torch.equal(bits(grad), bits(ref_grad))


def test_functional_and_module_are_drop_ins():
    """F.max_pool2d's arguments: non-overlapping windows take the fused ops
    (its autograd node), anything else is torch's op, same results."""
    x = make((4, 16, 12, 12), torch.float32, torch.channels_last).requires_grad_()
    for kwargs, fused in [
        (dict(kernel_size=2), True),
        (dict(kernel_size=(2, 2), stride=2), True),
        (dict(kernel_size=3, stride=2), False),
        (dict(kernel_size=2, padding=1), False),
        (dict(kernel_size=2, ceil_mode=True), False),
        (dict(kernel_size=2, dilation=2), False),
    ]:
        ours = FF.max_pool2d(x, **kwargs)
        module = fusetrain.nn.MaxPool2d(**kwargs)(x)
        ref = F.max_pool2d(x, **kwargs)
        assert ("_MaxPool2d" in type(ours.grad_fn).__name__) == fused, kwargs
        for y in (ours, module):
            assert torch.equal(bits(y.detach()), bits(ref.detach())), kwargs
            dy = grad_like(y.detach())
            (g,) = torch.autograd.grad(y, x, dy)
            (g_ref,) = torch.autograd.grad(ref, x, dy, retain_graph=True)
            assert torch.equal(bits(g), bits(g_ref)), kwargs
    nchw = x.detach().contiguous().requires_grad_()  # NCHW: 2x2 windows ours, others torch's
    assert "_MaxPool2d" in type(FF.max_pool2d(nchw, 2).grad_fn).__name__
    assert "_MaxPool2d" not in type(FF.max_pool2d(nchw, 3).grad_fn).__name__
    assert "_MaxPool2d" in type(FF.max_pool2d(x, 3).grad_fn).__name__
    one = torch.randn(4, 1, 8, 8).as_strided((4, 1, 8, 8), (64, 1, 8, 1)).requires_grad_()
    assert "_MaxPool2d" in type(FF.max_pool2d(one, 2).grad_fn).__name__  # one channel, channels_last strides
    out, idx = FF.max_pool2d(x, 2, return_indices=True)  # torch's, with its indices
    assert idx.dtype == torch.int64
    y = FF.max_pool2d(x.double(), 2)  # float64: torch's
    assert y.dtype == torch.float64
    assert isinstance(fusetrain.nn.MaxPool2d(2), torch.nn.MaxPool2d)


def test_errors_name_the_argument():
    x = torch.randn(2, 3, 8, 8)
    with pytest.raises(RuntimeError, match=r"input must be 4-D \[N, C, H, W\]"):
        OP(x[0], [2, 2])
    with pytest.raises(RuntimeError, match="kernel_size must be positive"):
        OP(x, [0, 2])
    with pytest.raises(RuntimeError, match="smaller than the 9x2 window"):
        OP(x, [9, 2])
    with pytest.raises(RuntimeError, match="more than 256 positions"):
        OP(torch.randn(1, 1, 20, 20), [17, 17])
    with pytest.raises(RuntimeError, match="must be float32, float16 or bfloat16"):
        OP(x.double(), [2, 2])
    out, argmax = OP(x, [2, 2])
    with pytest.raises(RuntimeError, match=r"grad_out must have the output's shape \[2, 3, 4, 4\]"):
        BACKWARD(out[:, :2], x, argmax, [2, 2])
    with pytest.raises(RuntimeError, match="argmax must be uint8"):
        BACKWARD(out, x, argmax.long(), [2, 2])


def test_thread_count_does_not_change_a_bit():
    x = make((8, 32, 28, 28), torch.bfloat16, torch.channels_last)
    results = []
    for threads in (1, 2):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out, argmax = OP(x, [2, 2])
            results.append((out, argmax, BACKWARD(grad_like(out), x, argmax, [2, 2])))
        finally:
            torch.set_num_threads(before)
    for a, b in zip(*results):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.uint8 else bits(a),
                           b.view(torch.uint8) if b.dtype == torch.uint8 else bits(b))


PATH_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, sys.argv[1])
    import test_max_pool as t
    from fusetrain import _C
    assert _C.cpu_features()["path"] == sys.argv[2], _C.cpu_features()["path"]
    for shape, kernel in t.CASES:
        for fmt in (torch.channels_last, torch.contiguous_format):
            for dtype in t.DTYPES:
                t.test_matches_torch_bit_for_bit(shape, kernel, fmt, dtype)
    print("ok")
    """
)


def _paths():
    best = _C.cpu_features()["path"]
    order = ["generic", "scalar", "avx2", "avx512"]
    return order[: order.index(best) + 1] if best in order else ["generic", "scalar"]


@pytest.mark.parametrize("path", _paths())
def test_every_cpu_path_matches_torch(path):
    """Each path this CPU runs (forced with FUSETRAIN_CPU_PATH), the
    device-generic ATen composition included, gives torch's bits."""
    env = dict(os.environ, FUSETRAIN_CPU_PATH=path)
    here = os.path.dirname(os.path.abspath(__file__))
    p = subprocess.run([sys.executable, "-c", PATH_SCRIPT, here, path], env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-3000:]
