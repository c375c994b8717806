"""fusetrain.nn.functional.softmax_cross_entropy against F.cross_entropy.

Forward and backward for every dtype, reduction, label smoothing and
ignore_index case, odd class counts and batch sizes. The loss (float32 for
every logits dtype) is held to a float64 computation on the same (rounded)
logits, within what float32 arithmetic owes it (loss_tolerance); torch's own
16-bit loss, computed in 16 bits, is no yardstick for it. The gradient (in the
logits' dtype) is held to torch's own accuracy: its error against float64
must be within 2x of the error torch's kernels make (or within one unit of
the output dtype). CUDA results are compared with the CPU implementation,
outputs poisoned first; those tests skip without a GPU.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import fusetrain
import fusetrain.nn
from fusetrain.nn import functional as FF

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
REDUCTIONS = ["mean", "sum", "none"]
SMOOTHING = [0.0, 0.1]
IGNORE = ["no_ignored", "some_ignored", "all_ignored"]
# (N, C): a single class, odd small C, C = 1000, and a prime C past 32768
# (every row starts at a different 16-byte misalignment).
SHAPES = [(5, 1), (13, 7), (33, 1000), (3, 32771)]
IGNORE_INDEX = -100


def make_case(n, c, dtype, ignore, seed=0, device="cpu", ignore_index=IGNORE_INDEX):
    g = torch.Generator().manual_seed(seed)
    # Logits spread like a trained model's (std 3), so that the softmax is
    # far from uniform and the row maxima matter.
    x = (torch.randn(n, c, generator=g) * 3.0).to(dtype)
    t = torch.randint(0, c, (n,), generator=g)
    if ignore == "some_ignored":
        t[::3] = ignore_index
    elif ignore == "all_ignored":
        t[:] = ignore_index
    return x.to(device), t.to(device)


def upstream(loss, seed=1):
    """A non-trivial gradient of the loss, random per element for "none",
    in multiples of 1/8 so that torch's 16-bit loss takes it exactly too."""
    if loss.dim() == 0:
        return torch.tensor(1.75, dtype=loss.dtype, device=loss.device)
    g = torch.randint(-16, 17, loss.shape, generator=torch.Generator().manual_seed(seed)) / 8
    return g.to(loss.device, loss.dtype)


def loss_and_grad(fn, x, t, reduction, **kw):
    x = x.detach().clone().requires_grad_()
    loss = fn(x, t, reduction=reduction, **kw)
    (grad,) = torch.autograd.grad(loss, x, upstream(loss))
    return loss.detach(), grad


def max_err(a, ref):
    return (a.double() - ref).abs().max().item() if ref.numel() else 0.0


def ulp_floor(dtype, ref):
    """One unit of `dtype`'s precision at the reference's largest magnitude:
    the error of a correctly rounded result, below which nothing is owed."""
    return torch.finfo(dtype).eps * (ref.abs().max().item() if ref.numel() else 0.0)


def assert_within_2x_torch(ours, theirs, ref, what, extra=0.0):
    e_ours = max_err(ours, ref)
    e_torch = max_err(theirs, ref)
    bound = max(2.0 * e_torch, ulp_floor(ours.dtype, ref)) + extra
    assert e_ours <= bound, f"{what}: our error {e_ours:.3g} > 2x torch's {e_torch:.3g} (bound {bound:.3g})"


F32_EPS = torch.finfo(torch.float32).eps  # 2^-23: one fp32 ulp at 1


def loss_tolerance(x, t, reduction, label_smoothing):
    """What float32 arithmetic owes the float64 loss on the same logits.

    Per row, loss = lse - (1 - ls) x_t - ls mean_j x_j, lse = m + log s,
    s = sum_j exp(x_j - m), m the row's maximum:
    - each exp term is good to about an ulp (for fp32 logits x_j - m adds
      |x_j - m| ulps, which the softmax weights average to at most ln C);
      the kernel sums the terms in blocks of fp32 adds then in fp64, so s's
      relative error stays within a few ulps times log2(C) for any blocked
      or tree order, and log s carries it as an absolute error;
    - the logits' sum (label smoothing) errs the same way relative to
      sum_j |x_j|, i.e. ls * mean_j |x_j| absolute in the loss;
    - the row's loss is rounded to fp32 once (half an ulp of |loss|), and a
      reduction rounds its total once more.
    So, in units of F32_EPS: |loss_i| + (2 + log2 C) (1 + ls mean_j |x_ij|)
    a row (0 for ignored rows, which must be exactly 0); the sum, or the
    mean over the kept rows, of those plus |total| for a reduction.
    Returns the allowance, elementwise for "none"."""
    x64 = x.double()
    row_ref = F.cross_entropy(x64, t, reduction="none", label_smoothing=label_smoothing)
    kept = t != IGNORE_INDEX
    growth = 2.0 + math.log2(max(x.shape[1], 1))
    rows = torch.where(kept, row_ref.abs() + growth * (1.0 + label_smoothing * x64.abs().mean(1)), 0.0)
    if reduction == "none":
        return F32_EPS * rows
    total, ref_total = rows.sum(), row_ref.sum()
    if reduction == "mean":
        total, ref_total = total / kept.sum(), ref_total / kept.sum()
    return F32_EPS * (total + ref_total.abs())


def assert_loss_near_float64(loss, ref_loss, x, t, reduction, label_smoothing):
    tol = loss_tolerance(x, t, reduction, label_smoothing)
    err = (loss.double() - ref_loss).abs()
    worst = (err / tol.clamp_min(1e-300)).max().item() if err.numel() else 0.0
    assert bool((err <= tol).all()), (
        f"loss: error {err.max().item():.3g} against float64, {worst:.3g}x the fp32 allowance "
        f"(max {tol.max().item():.3g})")


def lse_rounding(x, ref_grad):
    """What storing each row's log-sum-exp in fp32 costs the gradient: p =
    exp(x - lse) inherits lse's rounding, eps * |lse| relative. It matters for
    float32 logits only (torch keeps log-probabilities, of smaller magnitude);
    for 16-bit gradients it is far below one unit of the output."""
    if x.numel() == 0 or ref_grad.numel() == 0:
        return 0.0
    lse = torch.logsumexp(x.double(), 1).abs().max().item()
    return torch.finfo(torch.float32).eps * lse * ref_grad.abs().max().item()


@pytest.mark.parametrize("ignore", IGNORE)
@pytest.mark.parametrize("label_smoothing", SMOOTHING)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("n,c", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_torch(dtype, n, c, reduction, label_smoothing, ignore):
    x, t = make_case(n, c, dtype, ignore)
    kw = dict(label_smoothing=label_smoothing)
    loss, grad = loss_and_grad(FF.softmax_cross_entropy, x, t, reduction, **kw)
    assert loss.dtype == torch.float32
    assert grad.dtype == dtype
    assert loss.shape == ((n,) if reduction == "none" else ())

    ref_loss, ref_grad = loss_and_grad(F.cross_entropy, x.double(), t, reduction, **kw)
    if ignore == "all_ignored" and reduction == "mean":
        # torch: 0 / 0 for the loss, zero gradient.
        assert torch.isnan(loss) and torch.isnan(ref_loss)
        assert torch.equal(grad, torch.zeros_like(grad))
        return
    if ignore != "no_ignored":
        ignored = t == IGNORE_INDEX
        assert torch.equal(grad[ignored], torch.zeros_like(grad[ignored]))
        if reduction == "none":
            assert torch.equal(loss[ignored], torch.zeros_like(loss[ignored]))

    assert_loss_near_float64(loss, ref_loss, x, t, reduction, label_smoothing)
    # The gradient within 2x torch's error for float32 logits too (torch's
    # label-smoothing path loses digits that ours keeps, so matching torch's
    # values would be the wrong test).
    _, torch_grad = loss_and_grad(F.cross_entropy, x, t, reduction, **kw)
    assert_within_2x_torch(grad, torch_grad, ref_grad, "gradient", extra=lse_rounding(x, ref_grad))


def test_lse_is_the_row_logsumexp():
    x, t = make_case(17, 1000, torch.float32, "some_ignored")
    loss, lse, _ = torch.ops.fusetrain.softmax_cross_entropy_forward(x, t, IGNORE_INDEX, 0.0, "none")
    torch.testing.assert_close(lse, torch.logsumexp(x.double(), 1).float(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["no_ignored", "some_ignored", "all_ignored"])
def test_the_forwards_kept_row_count_is_what_mean_divides_by(case):
    x, t = make_case(33, 40, torch.bfloat16, case)
    fwd = torch.ops.fusetrain.softmax_cross_entropy_forward
    bwd = torch.ops.fusetrain.softmax_cross_entropy_backward
    kept = (t != IGNORE_INDEX).sum().item()
    for reduction in ("mean", "sum"):
        _, lse, kept_rows = fwd(x, t, IGNORE_INDEX, 0.1, reduction)
        assert kept_rows.shape == () and kept_rows.dtype == torch.float32 and kept_rows.item() == kept
    assert fwd(x, t, IGNORE_INDEX, 0.1, "none")[2].shape == (0,)
    # Given the count, "mean" divides by it (bits equal to counting again);
    # a different count shows it is the one used.
    g = torch.tensor(0.75)
    counted = bwd(g, x, t, lse, IGNORE_INDEX, 0.1, "mean")
    given = bwd(g, x, t, lse, IGNORE_INDEX, 0.1, "mean", kept_rows)
    assert torch.equal(counted.view(torch.int16), given.view(torch.int16))
    if kept:
        halved = bwd(g, x, t, lse, IGNORE_INDEX, 0.1, "mean", kept_rows * 2)
        torch.testing.assert_close(halved.float(), given.float() / 2, rtol=2.0**-7, atol=0)
    with pytest.raises(RuntimeError, match="kept_rows must be the forward's float32 count"):
        bwd(g, x, t, lse, IGNORE_INDEX, 0.1, "mean", torch.ones(2))


def test_expanded_gradient_of_none():
    # loss.sum().backward() hands the backward a stride-0 [N] gradient.
    x, t = make_case(9, 33, torch.bfloat16, "some_ignored")
    a = x.clone().requires_grad_()
    FF.softmax_cross_entropy(a, t, reduction="none").sum().backward()
    b = x.clone().requires_grad_()
    FF.softmax_cross_entropy(b, t, reduction="sum").backward()
    assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("layout", ["transposed", "row_slice"])
def test_non_contiguous_logits(layout):
    base, t = make_case(24, 50, torch.float32, "some_ignored")
    if layout == "transposed":
        x = base.t().contiguous().t()
    else:
        # Every row contiguous, rows 60 apart: read in place.
        wide = torch.randn(24, 60)
        wide[:, 5:55] = base
        x = wide[:, 5:55]
    assert not x.is_contiguous()
    for reduction in REDUCTIONS:
        loss, grad = loss_and_grad(FF.softmax_cross_entropy, x, t, reduction, label_smoothing=0.1)
        ref_loss, ref_grad = loss_and_grad(F.cross_entropy, base, t, reduction, label_smoothing=0.1)
        torch.testing.assert_close(loss, ref_loss)
        torch.testing.assert_close(grad, ref_grad)


def test_masked_logits():
    # -inf logits (a masked vocabulary) have probability exactly 0.
    x, t = make_case(6, 40, torch.float32, "no_ignored")
    x[:, 20:] = float("-inf")
    t = t % 20
    loss, grad = loss_and_grad(FF.softmax_cross_entropy, x, t, "none")
    ref_loss, ref_grad = loss_and_grad(F.cross_entropy, x, t, "none")
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grad, ref_grad)
    assert torch.equal(grad[:, 20:], torch.zeros_like(grad[:, 20:]))


def test_nan_logit_gives_nan_loss():
    x, t = make_case(4, 100, torch.bfloat16, "no_ignored")
    x[2, 37] = float("nan")
    loss = FF.softmax_cross_entropy(x, t, reduction="none")
    assert torch.isnan(loss[2]) and torch.isfinite(loss[[0, 1, 3]]).all()


def test_spatial_and_unbatched_inputs():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 3, 4, generator=g)
    t = torch.randint(0, 5, (2, 3, 4), generator=g)
    t[0, 1, 2] = IGNORE_INDEX
    for reduction in REDUCTIONS:
        loss, grad = loss_and_grad(FF.softmax_cross_entropy, x, t, reduction, label_smoothing=0.1)
        ref_loss, ref_grad = loss_and_grad(F.cross_entropy, x, t, reduction, label_smoothing=0.1)
        torch.testing.assert_close(loss, ref_loss)
        torch.testing.assert_close(grad, ref_grad)
    x1, t1 = x[0, :, 0, 0], t[0, 0, 0]
    for reduction in REDUCTIONS:
        torch.testing.assert_close(
            FF.softmax_cross_entropy(x1, t1, reduction=reduction), F.cross_entropy(x1, t1, reduction=reduction)
        )


def test_custom_ignore_index_and_uint8_targets():
    x, t = make_case(10, 12, torch.float32, "no_ignored")
    t[4] = 3
    for reduction in REDUCTIONS:
        torch.testing.assert_close(
            FF.softmax_cross_entropy(x, t, ignore_index=3, reduction=reduction),
            F.cross_entropy(x, t, ignore_index=3, reduction=reduction),
        )
    torch.testing.assert_close(FF.softmax_cross_entropy(x, t.to(torch.uint8)), F.cross_entropy(x, t))


def test_legacy_reduction_arguments():
    x, t = make_case(8, 9, torch.float32, "no_ignored")
    with pytest.warns(UserWarning):
        ours = FF.softmax_cross_entropy(x, t, size_average=False)
    with pytest.warns(UserWarning):
        ref = F.cross_entropy(x, t, size_average=False)
    torch.testing.assert_close(ours, ref)


def test_module_matches_torch_module():
    x, t = make_case(11, 7, torch.float32, "some_ignored")
    ours = fusetrain.nn.CrossEntropyLoss(ignore_index=IGNORE_INDEX, label_smoothing=0.05, reduction="sum")
    ref = torch.nn.CrossEntropyLoss(ignore_index=IGNORE_INDEX, label_smoothing=0.05, reduction="sum")
    assert isinstance(ours, torch.nn.CrossEntropyLoss)
    assert ours.state_dict().keys() == ref.state_dict().keys()
    torch.testing.assert_close(ours(x, t), ref(x, t))
    assert fusetrain.nn.functional.cross_entropy is FF.softmax_cross_entropy


def test_unsupported_arguments_raise():
    x, t = make_case(4, 5, torch.float32, "no_ignored")
    with pytest.raises(NotImplementedError, match="weight"):
        FF.softmax_cross_entropy(x, t, weight=torch.ones(5))
    with pytest.raises(NotImplementedError, match="weight"):
        fusetrain.nn.CrossEntropyLoss(weight=torch.ones(5))
    with pytest.raises(NotImplementedError, match="probability"):
        FF.softmax_cross_entropy(x, torch.softmax(x, 1))
    with pytest.raises(NotImplementedError, match="float64"):
        FF.softmax_cross_entropy(x.double(), t)
    with pytest.raises(ValueError, match="label_smoothing"):
        FF.softmax_cross_entropy(x, t, label_smoothing=1.5)
    with pytest.raises(ValueError, match="reduction"):
        FF.softmax_cross_entropy(x, t, reduction="average")


@pytest.mark.parametrize("bad", [5, -1, -101])
def test_out_of_range_target_names_the_row(bad):
    x, t = make_case(6, 5, torch.float32, "no_ignored")
    t[4] = bad
    with pytest.raises(IndexError, match=rf"target\[4\] = {bad}"):
        FF.softmax_cross_entropy(x, t)
    lse = torch.zeros(6)
    with pytest.raises(IndexError, match=r"target\[4\]"):
        torch.ops.fusetrain.softmax_cross_entropy_backward(torch.tensor(1.0), x, t, lse, IGNORE_INDEX, 0.0, "mean")


def test_op_argument_checks_name_the_argument():
    x, t = make_case(4, 5, torch.float32, "no_ignored")
    fwd = torch.ops.fusetrain.softmax_cross_entropy_forward
    with pytest.raises(RuntimeError, match="logits must be 2-D"):
        fwd(x[0], t, IGNORE_INDEX, 0.0, "mean")
    with pytest.raises(RuntimeError, match="target must be int64"):
        fwd(x, t.int(), IGNORE_INDEX, 0.0, "mean")
    with pytest.raises(RuntimeError, match="one class index per row"):
        fwd(x, t[:3], IGNORE_INDEX, 0.0, "mean")
    loss, lse, _ = fwd(x, t, IGNORE_INDEX, 0.0, "none")
    with pytest.raises(RuntimeError, match="grad_loss must have shape"):
        torch.ops.fusetrain.softmax_cross_entropy_backward(torch.ones(3), x, t, lse, IGNORE_INDEX, 0.0, "none")


def test_meta_shapes():
    x = torch.empty(7, 11, device="meta", dtype=torch.bfloat16)
    t = torch.empty(7, device="meta", dtype=torch.long)
    for reduction, shape in (("mean", ()), ("sum", ()), ("none", (7,))):
        loss, lse, kept = torch.ops.fusetrain.softmax_cross_entropy_forward(x, t, IGNORE_INDEX, 0.1, reduction)
        assert loss.shape == shape and loss.dtype == torch.float32
        assert lse.shape == (7,) and lse.dtype == torch.float32
        assert kept.shape == ((0,) if reduction == "none" else ()) and kept.dtype == torch.float32
        g = torch.ops.fusetrain.softmax_cross_entropy_backward(
            torch.empty(shape, device="meta"), x, t, lse, IGNORE_INDEX, 0.1, reduction
        )
        assert g.shape == (7, 11) and g.dtype == torch.bfloat16 and g.device.type == "meta"


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shape", [(33, 1000), (3, 32771)])
def test_backward_out_may_write_over_the_logits(dtype, reduction, shape):
    """The .out overload gives the functional backward's bits into memory of
    its own or over the logits themselves (what the chunked linear
    cross-entropy does): each element is read before its gradient replaces
    it, the target's logit included."""
    x, t = make_case(*shape, dtype, "some_ignored")
    fwd = torch.ops.fusetrain.softmax_cross_entropy_forward
    bwd = torch.ops.fusetrain.softmax_cross_entropy_backward
    loss, lse, kept = fwd(x, t, IGNORE_INDEX, 0.1, reduction)
    g = upstream(loss)
    want = bwd(g, x, t, lse, IGNORE_INDEX, 0.1, reduction, kept)
    apart = torch.full_like(x, 7.0)
    assert bwd.out(g, x, t, lse, IGNORE_INDEX, 0.1, reduction, kept, out=apart) is apart
    assert same_bits(apart, want)
    logits = x.clone()
    assert bwd.out(g, logits, t, lse, IGNORE_INDEX, 0.1, reduction, kept, out=logits) is logits
    assert same_bits(logits, want)


def test_backward_out_checks_its_memory():
    x, t = make_case(6, 10, torch.float32, "no_ignored")
    bwd = torch.ops.fusetrain.softmax_cross_entropy_backward
    _, lse, kept = torch.ops.fusetrain.softmax_cross_entropy_forward(x, t, IGNORE_INDEX, 0.0, "mean")
    g = torch.tensor(1.0)
    # Rows shifted by one against the logits: row i's gradient would land on
    # row i + 1's logits before they are read.
    buf = torch.randn(7 * 10)
    logits, shifted = buf[:60].view(6, 10), buf[10:].view(6, 10)
    with pytest.raises(RuntimeError, match="overlaps the logits only in part"):
        bwd.out(g, logits, t, lse, IGNORE_INDEX, 0.0, "mean", kept, out=shifted)
    with pytest.raises(RuntimeError, match=r"out must have the logits' shape \[6, 10\], got \[6, 9\]"):
        bwd.out(g, x, t, lse, IGNORE_INDEX, 0.0, "mean", kept, out=torch.empty(6, 9))
    with pytest.raises(RuntimeError, match="out must have the logits' dtype Float, got BFloat16"):
        bwd.out(g, x, t, lse, IGNORE_INDEX, 0.0, "mean", kept, out=torch.empty(6, 10, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="out must be contiguous"):
        bwd.out(g, x, t, lse, IGNORE_INDEX, 0.0, "mean", kept, out=torch.empty(10, 6).t())
    meta = x.to("meta")
    out = torch.empty_like(meta)
    assert bwd.out(g.to("meta"), meta, t.to("meta"), lse.to("meta"), IGNORE_INDEX, 0.0, "mean", out=out) is out


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_eager_backward_runs_in_cpp(reduction):
    """Eager calls go through the C++ autograd Function (issue 14's per-call
    overhead: no Python in the backward), with the bits of the Python
    Function that torch.compile traces: the same two ops."""
    x, t = make_case(9, 41, torch.bfloat16, "some_ignored")
    a = x.clone().requires_grad_()
    loss = FF.softmax_cross_entropy(a, t, reduction=reduction, label_smoothing=0.1)
    assert not isinstance(loss.grad_fn, torch.autograd.function.BackwardCFunction), type(loss.grad_fn)
    b = x.clone().requires_grad_()
    ref, _ = FF._SoftmaxCrossEntropy.apply(b, t, IGNORE_INDEX, 0.1, reduction)
    assert isinstance(ref.grad_fn, torch.autograd.function.BackwardCFunction)
    assert torch.equal(loss, ref)
    g = torch.linspace(0.5, 2.0, loss.numel()).reshape(loss.shape)
    loss.backward(g)
    ref.backward(g)
    assert torch.equal(a.grad, b.grad)


def test_torch_compile_traces_the_ops():
    x, t = make_case(16, 37, torch.bfloat16, "some_ignored")

    def step(logits, target):
        return FF.softmax_cross_entropy(logits, target, label_smoothing=0.1)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    a = x.clone().requires_grad_()
    compiled(a, t).backward()
    b = x.clone().requires_grad_()
    step(b, t).backward()
    assert torch.equal(a.grad, b.grad)


def test_large_gradients_reuse_only_freed_blocks():
    # Gradients of 16 MiB and more come from a cache of freed blocks (Note
    # [Gradient block cache]): a live gradient must never be handed out
    # again, and a reused block must hold the new gradient, not the old one.
    n, c = 64, 65536  # 16 MiB of float32
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, c, generator=g).requires_grad_() for _ in range(3)]
    t = torch.randint(0, c, (n,), generator=g)
    refs = []
    for x in xs:
        ref = x.detach().clone().requires_grad_()
        F.cross_entropy(ref, t).backward()
        refs.append(ref.grad)
    FF.softmax_cross_entropy(xs[0], t).backward()
    kept = xs[0].grad.clone()
    FF.softmax_cross_entropy(xs[1], t).backward()  # xs[0].grad still alive
    assert xs[0].grad.data_ptr() != xs[1].grad.data_ptr()
    assert torch.equal(xs[0].grad, kept)
    freed = xs[1].grad.data_ptr()
    xs[1].grad = None  # its block goes back to the cache...
    FF.softmax_cross_entropy(xs[2], t).backward()  # ...and serves this one
    assert xs[2].grad.data_ptr() == freed
    kept2 = xs[2].grad.clone()
    x4 = torch.randn(n, c, generator=g).requires_grad_()
    FF.softmax_cross_entropy(x4, t).backward()  # the reused block is live again: not for x4
    assert x4.grad.data_ptr() not in (xs[0].grad.data_ptr(), xs[2].grad.data_ptr())
    assert torch.equal(xs[2].grad, kept2)
    for x, ref in zip((xs[0], xs[2]), (refs[0], refs[2])):
        torch.testing.assert_close(x.grad, ref, rtol=1e-5, atol=1e-7)


def lower_cpu_paths():
    f = fusetrain._C.cpu_features()
    order = ["scalar", "avx2", "avx512"]
    return order[: order.index(f["path"])]


@pytest.mark.parametrize("path", ["scalar", "avx2"])
def test_lower_cpu_path_matches_the_default_path(tmp_path, path):
    """FUSETRAIN_CPU_PATH selects a lower path's row loops (the portable scalar
    ones, or AVX2 on an AVX-512 CPU; Note [Cross-entropy CPU vectorization]):
    each must agree with the default path's."""
    if path not in lower_cpu_paths():
        pytest.skip(f"this CPU's default path is {path} or below it: nothing lower to compare")
    script = textwrap.dedent(
        """
        import sys, torch, fusetrain
        from fusetrain.nn import functional as FF
        sys.path.insert(0, sys.argv[2])
        from test_cross_entropy import make_case, loss_and_grad
        out = {}
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for n, c in ((5, 1), (13, 7), (7, 1003), (3, 4099)):
                for ls in (0.0, 0.1):
                    x, t = make_case(n, c, dtype, "some_ignored")
                    out[(str(dtype), n, c, ls)] = loss_and_grad(FF.softmax_cross_entropy, x, t, "none", label_smoothing=ls)
                    # This path's row loops over the logits in place: the
                    # bits they give into memory of their own.
                    ops = torch.ops.fusetrain
                    _, lse, _ = ops.softmax_cross_entropy_forward(x, t, -100, ls, "sum")
                    g = torch.tensor(0.5)
                    want = ops.softmax_cross_entropy_backward(g, x, t, lse, -100, ls, "sum")
                    y = x.clone()
                    ops.softmax_cross_entropy_backward.out(g, y, t, lse, -100, ls, "sum", out=y)
                    assert torch.equal(y, want), (dtype, n, c, ls)
        torch.save(out, sys.argv[1])
        """
    )
    out = tmp_path / f"{path}.pt"
    env = {k: v for k, v in os.environ.items() if k not in ("FUSETRAIN_CPU_PATH", "ATEN_CPU_CAPABILITY")}
    env["FUSETRAIN_CPU_PATH"] = path
    here = os.path.dirname(os.path.abspath(__file__))
    subprocess.run([sys.executable, "-c", script, str(out), here], check=True, env=env, timeout=300)
    scalar = torch.load(out)
    for (dtype_name, n, c, ls), (s_loss, s_grad) in scalar.items():
        dtype = getattr(torch, dtype_name.split(".")[1])
        x, t = make_case(n, c, dtype, "some_ignored")
        v_loss, v_grad = loss_and_grad(FF.softmax_cross_entropy, x, t, "none", label_smoothing=ls)
        torch.testing.assert_close(s_loss, v_loss, rtol=1e-5, atol=1e-6)
        # The exp implementations and summation orders differ by a few fp32
        # ulps, which may move a 16-bit rounding by one unit.
        eps = max(torch.finfo(dtype).eps, 1e-5)
        torch.testing.assert_close(s_grad.float(), v_grad.float(), rtol=2 * eps, atol=eps * v_grad.abs().max().item())


# ----------------------------------------------------------------- CUDA


def poison_cuda_cache(nbytes):
    """Fills the caching allocator's free blocks with NaN so that outputs the
    ops allocate start as garbage: a kernel that skips an element fails."""
    torch.cuda.synchronize()
    junk = torch.full((nbytes // 4 + 1024,), float("nan"), device="cuda")
    del junk


CUDA_SHAPES = [(5, 1), (13, 7), (257, 1000), (64, 1025), (9, 4097), (6, 32771), (2, 65536)]


@pytest.mark.cuda
@pytest.mark.parametrize("ignore", IGNORE)
@pytest.mark.parametrize("label_smoothing", SMOOTHING)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("n,c", CUDA_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_matches_cpu(dtype, n, c, reduction, label_smoothing, ignore):
    x, t = make_case(n, c, dtype, ignore, seed=5)
    kw = dict(label_smoothing=label_smoothing)
    cpu_loss, cpu_grad = loss_and_grad(FF.softmax_cross_entropy, x, t, reduction, **kw)
    poison_cuda_cache(2 * x.numel() * x.element_size())
    xc, tc = x.cuda(), t.cuda()
    loss, grad = loss_and_grad(FF.softmax_cross_entropy, xc, tc, reduction, **kw)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    # The loss against the CPU's, which test_matches_torch holds to float64
    # within the fp32 allowance (~1e-7 relative): 1e-5 leaves room for the
    # GPU's per-thread fp32 sums of up to C / 256 terms and __expf's few ulps,
    # and is still over 100x below what a 10% error in label smoothing moves
    # a row's loss by (0.1 ls |x_t - mean_j x_j|, ~3e-2 for these logits).
    torch.testing.assert_close(loss.cpu(), cpu_loss, rtol=1e-5, atol=1e-5, equal_nan=True)
    # Both round p = exp(x - lse) through an fp32 lse that may differ by an
    # ulp between the two summation orders, and the exps by a few ulps.
    eps = torch.finfo(dtype).eps
    lse = torch.logsumexp(x.float(), 1).abs().max().item() if x.numel() else 0.0
    atol = (eps + 4 * torch.finfo(torch.float32).eps * (1 + lse)) * cpu_grad.abs().max().item()
    torch.testing.assert_close(grad.cpu().float(), cpu_grad.float(), rtol=2 * eps, atol=atol)
    _, ref_grad = loss_and_grad(F.cross_entropy, xc.double(), tc, reduction, **kw)
    if dtype != torch.float32 and not (ignore == "all_ignored"):
        _, torch_grad = loss_and_grad(F.cross_entropy, xc, tc, reduction, **kw)
        assert_within_2x_torch(grad, torch_grad, ref_grad, "CUDA gradient", extra=lse_rounding(x, ref_grad))


@pytest.mark.cuda
def test_cuda_misaligned_and_strided_rows():
    base, t = make_case(33, 1001, torch.bfloat16, "some_ignored", seed=7)
    wide = torch.randn(33, 1013).to(torch.bfloat16)
    wide[:, 3:1004] = base
    for x in (base, wide[:, 3:1004], base.t().contiguous().t()):
        cpu = loss_and_grad(FF.softmax_cross_entropy, x, t, "none", label_smoothing=0.1)
        poison_cuda_cache(4 * x.numel())
        gpu = loss_and_grad(FF.softmax_cross_entropy, x.cuda(), t.cuda(), "none", label_smoothing=0.1)
        torch.testing.assert_close(gpu[0].cpu(), cpu[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gpu[1].cpu().float(), cpu[1].float(), rtol=0.016, atol=1e-3 * cpu[1].abs().max().item())


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,c", [(13, 7), (64, 1025), (9, 4097), (6, 32771)])
def test_cuda_backward_out_over_the_logits(dtype, n, c):
    """The CUDA kernel's gradient over the logits themselves (the chunked
    linear cross-entropy's use): the bits it writes into memory of its own."""
    x, t = make_case(n, c, dtype, "some_ignored", seed=9)
    xc, tc = x.cuda(), t.cuda()
    ops = torch.ops.fusetrain
    for reduction in REDUCTIONS:
        loss, lse, kept = ops.softmax_cross_entropy_forward(xc, tc, IGNORE_INDEX, 0.1, reduction)
        g = upstream(loss)
        want = ops.softmax_cross_entropy_backward(g, xc, tc, lse, IGNORE_INDEX, 0.1, reduction, kept)
        y = xc.clone()
        assert ops.softmax_cross_entropy_backward.out(g, y, tc, lse, IGNORE_INDEX, 0.1, reduction, kept, out=y) is y
        assert same_bits(y.cpu(), want.cpu()), reduction


@pytest.mark.cuda
def test_cuda_keeps_no_fp32_copy_of_the_logits():
    n, c = 2048, 32768
    x = (torch.randn(n, c, device="cuda") * 3).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, c, (n,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    FF.softmax_cross_entropy(x, t).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    # The gradient (bf16, like the logits) plus O(N) scratch; an fp32 [N, C]
    # buffer alone would be twice the logits.
    assert extra < x.numel() * x.element_size() * 1.1, extra


@pytest.mark.cuda
def test_cuda_all_ignored_mean_is_nan_without_sync():
    x, t = make_case(8, 100, torch.float16, "all_ignored")
    loss, grad = loss_and_grad(FF.softmax_cross_entropy, x.cuda(), t.cuda(), "mean")
    assert torch.isnan(loss).item()
    assert torch.equal(grad.cpu(), torch.zeros_like(grad.cpu()))
