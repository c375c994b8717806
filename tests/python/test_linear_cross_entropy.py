"""fusetrain.nn.functional.linear_cross_entropy and nn.LinearCrossEntropyLoss
(issue 38) against F.cross_entropy(F.linear(...)).

The reference is float64 F.linear + F.cross_entropy on the same (dtype-rounded)
inputs. Each result is held to it within

    2 x torch's own error (F.linear + F.cross_entropy in the same dtype, same
    element) + a bound derived for our arithmetic (lce_bounds)

elementwise, for the loss and the input, weight and bias gradients. The
derived bound follows the computation (Note [Chunked linear cross-entropy] in
csrc/ops/linear_cross_entropy.cpp) from the unit roundoffs of the dtypes and
the sizes; it is a first-order worst case, so the test does not depend on
torch's error happening to be large on a given CPU, and it is still tight
enough to catch a wrong denominator, a lost chunk, an ignored bias or label
smoothing and the like (test_bounds_reject_plausible_bugs shows which).
The CUDA cases (``@pytest.mark.cuda``, skipped without a GPU) hold the CUDA
results to the same float64 bound and to the CPU op's results.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import fusetrain
import fusetrain.nn
from fusetrain import _C
from fusetrain.nn import functional as FF

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
REDUCTIONS = ["mean", "sum", "none"]
U32 = 2.0**-24  # float32 unit roundoff: one rounding moves v by at most U32 |v|
UNIT = {torch.float32: U32, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# First-order bounds leave out products of two errors; with 16-bit logits those
# are at most (max dz)^2 ~ (2^-8 * 10)^2 < 1% of the first-order terms here.
SECOND_ORDER = 1.1

GRAD_NAMES = ("grad_input", "grad_weight", "grad_bias")
FWD = torch.ops.fusetrain.linear_cross_entropy_forward.default
BWD = torch.ops.fusetrain.linear_cross_entropy_backward.default


def opts(**kw):
    kw.setdefault("acc_policy", "compact")  # 16-bit GEMMs: the bounds below are eager's
    return FF.LinearCrossEntropyOptions(**kw)


# ------------------------------------------------------------------ cases


def make_case(rows, h, c, dtype, *, bias=True, weighted=False, ignore_index=None, batch_shape=None, seed=0,
              device="cpu"):
    """input [*batch_shape or rows, h], linear_weight [c, h], linear_bias [c],
    target; every 4th row is ignored (its target is the ignore_index) and
    every 5th row from the 2nd targets class 3 (ignored too where
    ignore_index is 3). Class weights are multiples of 1/4 in [1/4, 2]:
    exact in every dtype, so torch's 16-bit run sees the same weights."""
    g = torch.Generator().manual_seed(seed)
    lead = tuple(batch_shape) if batch_shape is not None else (rows,)
    x = torch.randn(*lead, h, generator=g).to(dtype)
    # Logits of std ~2 and a bias of std 1: a peaked softmax, as a trained head's.
    w = (torch.randn(c, h, generator=g) * (2.0 / math.sqrt(h))).to(dtype)
    b = torch.randn(c, generator=g).to(dtype) if bias else None
    t = torch.randint(0, c, lead, generator=g)
    flat = t.view(-1)
    if flat.numel() > 1:
        flat[1::5] = 3
        flat[::4] = -100 if ignore_index is None else ignore_index
    weight = torch.randint(1, 9, (c,), generator=g) / 4 if weighted else None
    to = lambda v: None if v is None else v.to(device)  # noqa: E731
    return to(x), to(w), to(b), to(t), to(weight)


def upstream_for(loss, seed=1):
    """A non-trivial loss gradient: 1.75 for a scalar, multiples of 1/8 in
    [-2, 2] per element for "none" (exact in every dtype)."""
    if loss.dim() == 0:
        return torch.tensor(1.75, dtype=loss.dtype, device=loss.device)
    g = torch.randint(-16, 17, loss.shape, generator=torch.Generator().manual_seed(seed)) / 8
    return g.to(loss.device, loss.dtype)


def torch_lce(x, w, t, *, linear_bias=None, weight=None, reduction="mean", ignore_index=None, label_smoothing=0.0):
    """F.cross_entropy(F.linear(...)) with the leading dimensions of x as rows."""
    logits = F.linear(x, w, linear_bias)
    c = logits.shape[-1]
    if weight is not None and not torch.is_autocast_enabled(x.device.type):
        weight = weight.to(logits.dtype)
    loss = F.cross_entropy(logits.reshape(-1, c), t.reshape(-1), weight=weight, reduction=reduction,
                           ignore_index=-100 if ignore_index is None else ignore_index,
                           label_smoothing=label_smoothing)
    return loss.reshape(t.shape) if reduction == "none" else loss


def ours(x, w, t, **kw):
    return FF.linear_cross_entropy(x, w, t, **kw)


def run(fn, x, w, b, t, *, upstream=None, cast=None, **kw):
    """Loss and the gradients of (input, linear_weight, linear_bias) for the
    upstream gradient upstream_for(loss); `cast` (float64 for the reference)
    converts the inputs first."""
    leaves = [None if v is None else (v.to(cast) if cast else v).detach().clone().requires_grad_() for v in (x, w, b)]
    if cast is not None and kw.get("weight") is not None:
        kw["weight"] = kw["weight"].to(cast)
    loss = fn(leaves[0], leaves[1], t, linear_bias=leaves[2], **kw)
    up = upstream_for(loss) if upstream is None else upstream.to(loss.device, loss.dtype)
    needed = [v for v in leaves if v is not None]
    grads = iter(torch.autograd.grad(loss, needed, up))
    return loss.detach(), [None if v is None else next(grads) for v in leaves]


# ------------------------------------------------------ derived error bound


def lce_bounds(x, w, b, t, *, weight, reduction, ignore_index, label_smoothing, dtype, loss_dtype, chunk):
    """The float64 reference (loss, [grad_input, grad_weight, grad_bias]) for
    upstream_for(loss), and first-order bounds of what our arithmetic may
    differ from it by, elementwise, for inputs rounded to `dtype` (the
    GEMMs' dtype), a loss rounded to `loss_dtype` and `chunk` rows a chunk.
    u is dtype's unit roundoff, U32 float32's; rows X [N, H], W [C, H]:

    - logits z = X W^T + b: a GEMM accumulating H products in fp32, its output
      rounded to dtype, and the bias added (at most one more rounding):
        dz_ij <= u (|z_ij| + |X_i . W_j|) + (H + 2) U32 (|X_i| . |W_j| + |b_j|)
      (for fp32 the first term is within the second).
    - the loss: d loss / d z is G1 (the float64 logits gradient for a loss
      gradient of 1), so the logits' errors move it by sum_ij |G1_ij| dz_ij;
      the fp32 cross-entropy of a row (a log-sum-exp of C terms, the weighted
      sums of label smoothing) errs by a few fp32 ulps per log2 C of the
      row's magnitudes, T_i = 2^-23 (3 + log2 C) (|lse_i| + max_j |z_ij|)
      sum_j c_ij (c_ij the row's class coefficients below); the row loss is
      rounded to fp32, the reduction sums in double and divides by a float32
      denominator (N U32 relative), and the loss is rounded to loss_dtype.
    - the logits' gradient: G_ij = S_i p_ij - s_i c_ij, with c_ij = (1 - ls)
      w_t [j = t] + ls / C w_j on kept rows, s_i the row's upstream gradient
      (over the denominator for "mean") and S_i = s_i sum_j c_ij. The logits'
      errors move it by S_i p_ij (dz_ij + sum_k p_ik dz_ik), the fp32 softmax
      (exp of z - lse, lse stored in fp32) by 4 U32 S_i p_ij (1 + |z_ij -
      lse_i| + |lse_i|), and it is rounded to dtype: u |G_ij|.
    - grad_input = G W: dG |W| + (C + 1) U32 |G| |W| (fp32 accumulation) + 2 u
      |grad_input| (rounded to dtype, and again when the loss gradient scales
      the gradients computed in the forward);
      grad_weight = G^T X: dG^T |X| + (N + 1) U32 |G|^T |X| (fp32 accumulation
      across and within chunks) + 2 u |grad_weight|, and for 16-bit dtypes u
      sum_chunks |G_c^T X_c| (on the CPU each chunk's GEMM output is 16-bit
      before it is added to the fp32 accumulator);
      grad_bias = sum_i G_i: sum_i dG_i + (N + 1) U32 sum_i |G_i| + 2 u |grad_bias|.
    Each rounding to a 16-bit dtype also errs by up to half its smallest
    subnormal, eta (fp16: 2^-25; the relative bound fails below the normal
    range, where the small gradients of a "mean" over many rows can fall): once
    for G, twice for each gradient, once per chunk for grad_weight's 16-bit
    chunk GEMMs, once for the loss.
    Everything is scaled by SECOND_ORDER."""
    h = x.shape[-1]
    c = w.shape[0]
    ii = -100 if ignore_index is None else ignore_index
    xl = x.detach().double().requires_grad_()
    wl = w.detach().double().requires_grad_()
    bl = None if b is None else b.detach().double().requires_grad_()
    w64 = None if weight is None else weight.double()
    rows = xl.reshape(-1, h)
    tf = t.reshape(-1)
    z = F.linear(rows, wl, bl)
    loss = F.cross_entropy(z, tf, weight=w64, reduction=reduction, ignore_index=ii, label_smoothing=label_smoothing)
    loss = loss.reshape(t.shape) if reduction == "none" else loss
    up = upstream_for(loss)
    leaves = [v for v in (xl, wl, bl) if v is not None]
    G, *grads = torch.autograd.grad(loss, [z, *leaves], up, retain_graph=True)
    (G1,) = torch.autograd.grad(loss, z, torch.ones_like(loss))
    grads = iter(grads)
    ref_grads = [None if v is None else next(grads) for v in (xl, wl, bl)]

    with torch.no_grad():
        X, W, z = rows.detach(), wl.detach(), z.detach()
        B = torch.zeros(c, dtype=torch.float64) if bl is None else bl.detach()
        n = X.shape[0]
        u, u_loss = UNIT[dtype], UNIT[loss_dtype]
        eta, eta_loss = (torch.finfo(d).smallest_normal * torch.finfo(d).eps / 2 for d in (dtype, loss_dtype))
        chunks = -(-n // chunk)
        kept = tf != ii
        tc = torch.where(kept, tf, 0)
        wv = torch.ones(c, dtype=torch.float64) if w64 is None else w64
        onehot = F.one_hot(tc, c).double()
        coef = kept[:, None] * ((1 - label_smoothing) * onehot * wv[tc][:, None] + label_smoothing / c * wv[None, :])
        denominator = (wv[tc] * kept).sum() if reduction == "mean" else torch.tensor(1.0, dtype=torch.float64)
        s = (up.reshape(-1).double() if reduction == "none" else up.double().expand(n)) / denominator
        p = torch.softmax(z, 1)
        lse = torch.logsumexp(z, 1)
        S = s * coef.sum(1)  # may be negative ("none" with a negative upstream): |S| in the bounds
        # The gradient formula the bound rests on is the reference's.
        torch.testing.assert_close(G, S[:, None] * p - s[:, None] * coef, rtol=1e-9, atol=1e-12)

        A = X.abs() @ W.abs().T + B.abs()
        dz = u * (z.abs() + (X @ W.T).abs()) + (h + 2) * U32 * A
        row_loss = F.cross_entropy(z, tf, weight=w64, reduction="none", ignore_index=ii,
                                   label_smoothing=label_smoothing)
        T = 2.0**-23 * (3 + math.log2(c)) * (lse.abs() + z.abs().amax(1)) * coef.sum(1)
        from_logits = (G1.abs() * dz).sum(1)
        if reduction == "none":
            loss_bound = (from_logits + T + (u_loss + U32) * row_loss.abs() + eta_loss).reshape(t.shape)
        else:
            loss_bound = (from_logits.sum() + (T.sum() + U32 * row_loss.abs().sum()) / denominator
                          + (u_loss + (n + 2) * U32) * loss.detach().abs() + eta_loss)

        dG = (S.abs()[:, None] * p * (dz + (p * dz).sum(1, keepdim=True))
              + 4 * U32 * S.abs()[:, None] * p * (1 + (z - lse[:, None]).abs() + lse.abs()[:, None])
              + u * G.abs() + eta)
        gx_bound = (dG @ W.abs() + (c + 1) * U32 * G.abs() @ W.abs() + 2 * u * ref_grads[0].reshape(n, h).abs()
                    + 2 * eta)
        gw_bound = dG.T @ X.abs() + (n + 1) * U32 * G.abs().T @ X.abs() + 2 * u * ref_grads[1].abs() + 2 * eta
        if dtype != torch.float32:
            for r0 in range(0, n, chunk):
                gw_bound += u * (G[r0:r0 + chunk].T @ X[r0:r0 + chunk]).abs() + eta
        bounds = [loss_bound, gx_bound.reshape(x.shape), gw_bound]
        if bl is not None:
            bounds.append(dG.sum(0) + (n + 1) * U32 * G.abs().sum(0) + 2 * u * ref_grads[2].abs() + 2 * eta)
        else:
            bounds.append(None)
    return (loss.detach(), ref_grads), [None if v is None else SECOND_ORDER * v for v in bounds]


def assert_near_reference(what, ours_v, torch_v, ref_v, bound):
    """|ours - ref| <= 2 |torch - ref| + bound, elementwise (torch's own error
    at that element, in the same dtype, plus our derived bound)."""
    assert ours_v.shape == ref_v.shape, f"{what}: shape {tuple(ours_v.shape)} != {tuple(ref_v.shape)}"
    err = (ours_v.detach().cpu().double() - ref_v).abs()
    allowed = 2 * (torch_v.detach().cpu().double() - ref_v).abs() + bound
    bad = ~(err <= allowed)
    if bad.any():
        ratio = torch.where(bad, err / allowed.clamp_min(1e-300), 0.0)
        i = int(ratio.flatten().argmax())
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {err.numel()} elements past the bound; worst at flat index {i}: "
            f"ours {ours_v.flatten()[i].item()!r}, float64 {ref_v.flatten()[i].item()!r}, "
            f"torch {torch_v.flatten()[i].item()!r}, allowed {allowed.flatten()[i].item():.3g} "
            f"({ratio.flatten()[i].item():.3g}x)")


def check_against_reference(x, w, b, t, *, dtype, loss_dtype=None, chunk=None, got=None, theirs=None, **kw):
    """Runs ours and torch's (unless given) and holds both the loss and every
    gradient to the float64 reference within assert_near_reference's bound."""
    loss_dtype = dtype if loss_dtype is None else loss_dtype
    rows = x.reshape(-1, x.shape[-1]).shape[0]
    if got is None:
        got = run(ours, x, w, b, t, options=opts(batch_chunk_size=chunk), **kw)
    if theirs is None:
        theirs = run(torch_lce, x, w, b, t, **kw)
    used_chunk = chunk if chunk is not None else FF._lce_chunk_rows(rows, x.shape[-1], w.shape[0], dtype,
                                                                    got[0].device.type)
    cpu = lambda v: None if v is None else v.cpu()  # noqa: E731
    (ref_loss, ref_grads), bounds = lce_bounds(
        cpu(x), cpu(w), cpu(b), cpu(t), weight=cpu(kw.get("weight")), reduction=kw.get("reduction", "mean"),
        ignore_index=kw.get("ignore_index"), label_smoothing=kw.get("label_smoothing", 0.0), dtype=dtype,
        loss_dtype=loss_dtype, chunk=used_chunk)
    assert_near_reference("loss", got[0], theirs[0], ref_loss, bounds[0])
    for name, g, tg, rg, bd in zip(GRAD_NAMES, got[1], theirs[1], ref_grads, bounds[1:]):
        if rg is None:
            assert g is None
            continue
        assert_near_reference(name, g, tg, rg, bd)
    return got


# --------------------------------------------------- values against float64


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "class_weights"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("ignore_index", [None, -100, 3])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64_reference(dtype, bias, reduction, ignore_index, label_smoothing, weighted):
    # 53 rows in chunks of 16: three full chunks and a partial one.
    x, w, b, t, weight = make_case(53, 32, 97, dtype, bias=bias, weighted=weighted, ignore_index=ignore_index)
    kw = dict(weight=weight, reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing)
    loss, grads = check_against_reference(x, w, b, t, dtype=dtype, chunk=16, **kw)
    assert loss.dtype == dtype and loss.shape == ((53,) if reduction == "none" else ())
    assert all(g is None or g.dtype == dtype for g in grads)
    ignored = t == (-100 if ignore_index is None else ignore_index)
    assert ignored.any() and (t == 3).any()
    # Ignored rows: no gradient at all, and a zero loss for "none".
    assert torch.equal(grads[0][ignored], torch.zeros_like(grads[0][ignored]))
    if reduction == "none":
        assert torch.equal(loss[ignored], torch.zeros_like(loss[ignored]))


CHUNKS = {
    "default": None,  # the default rule: one chunk at these sizes
    "divides": 16,  # 48 rows = 3 chunks
    "does_not_divide": 7,  # 6 chunks and a partial one
    "one_row": 1,
    "rows_lt_chunk": 1000,
}


@pytest.mark.parametrize("gradients_in_forward", [True, False], ids=["grads_in_forward", "grads_in_backward"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("chunk", CHUNKS.values(), ids=CHUNKS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_chunk_sizes(dtype, chunk, reduction, gradients_in_forward):
    x, w, b, t, weight = make_case(48, 16, 61, dtype, weighted=chunk == 7, seed=2)
    kw = dict(weight=weight, reduction=reduction, label_smoothing=0.1)
    got = run(ours, x, w, b, t, options=opts(batch_chunk_size=chunk, gradients_in_forward=gradients_in_forward), **kw)
    check_against_reference(x, w, b, t, dtype=dtype, chunk=chunk, got=got, **kw)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shape", ["2d", "3d", "1d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_input_shapes(dtype, shape, reduction):
    """input [N, in_features] with target [N], or a 1-D input (one row) with
    a 0-d target; as torch's, no [B, T, in_features] form: a 3-D input is an
    error, and flattened to [B * T, in_features] it is the rows."""
    batch_shape = {"2d": (30,), "3d": (3, 7), "1d": ()}[shape]
    x, w, b, t, weight = make_case(None, 24, 40, dtype, batch_shape=batch_shape, seed=3)
    if shape == "1d":
        t = torch.tensor(5)  # not ignored
    kw = dict(weight=weight, reduction=reduction, label_smoothing=0.1)
    if shape == "3d":
        for o in (None, opts(batch_chunk_size=4)):
            with pytest.raises(RuntimeError, match="^expected input with dimensionality 1 or 2, got 3$"):
                ours(x, w, t, linear_bias=b, options=o, **kw)
        x, t = x.reshape(-1, x.shape[-1]), t.reshape(-1)
    loss, grads = check_against_reference(x, w, b, t, dtype=dtype, chunk=4, **kw)
    assert loss.shape == (t.shape if reduction == "none" else ())
    assert grads[0].shape == x.shape


def test_non_contiguous_input_and_weight():
    x, w, b, t, _ = make_case(40, 16, 30, torch.float32, seed=4)
    xt = x.t().contiguous().t()  # column-major rows
    wt = w.t().contiguous().t()
    assert not xt.is_contiguous() and not wt.is_contiguous()
    kw = dict(reduction="sum", label_smoothing=0.1)
    got = run(ours, xt, wt, b, t, options=opts(batch_chunk_size=9), **kw)
    check_against_reference(x, w, b, t, dtype=torch.float32, chunk=9, got=got, **kw)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "class_weights"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gradients_in_forward_gives_the_same_values(dtype, weighted, reduction):
    """For a loss gradient of 1 both ways compute the same products (1 /
    denominator scales the logits' gradient either way): the same bits. For
    another loss gradient the forward's gradients are rescaled, one more
    rounding, so both are held to the float64 bound instead. float16 "mean"
    is the exception: the forward's float16 GEMMs take the logits' gradient
    at one row's scale and 1 / denominator comes after them (Note
    [Accumulation precision]), so there both ways are held to the bound
    alone (test_float16_gradients_are_held_at_one_rows_scale checks that
    way exactly)."""
    x, w, b, t, weight = make_case(45, 16, 50, dtype, weighted=weighted, seed=5)
    kw = dict(weight=weight, reduction=reduction, label_smoothing=0.1)
    results = {}
    for gif in (True, False):
        o = opts(batch_chunk_size=8, gradients_in_forward=gif)
        loss = run(ours, x, w, b, t, options=o, **kw)[0]
        ones = torch.ones_like(loss)
        results[gif] = run(ours, x, w, b, t, options=o, upstream=ones, **kw)
        assert torch.equal(results[gif][0], loss)
        check_against_reference(x, w, b, t, dtype=dtype, chunk=8, got=run(ours, x, w, b, t, options=o, **kw), **kw)
    (l1, g1), (l2, g2) = results[True], results[False]
    assert torch.equal(l1, l2)
    if dtype == torch.float16 and reduction == "mean":
        return
    for name, a, c in zip(GRAD_NAMES, g1, g2):
        assert torch.equal(a, c), name


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "class_weights"])
@pytest.mark.parametrize("acc_policy", ["compact", "accurate"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_float16_gradients_are_held_at_one_rows_scale(dtype, acc_policy, weighted):
    """The forward op's gradients times grad_loss * grad_scale, rounded once,
    are the gradients autograd hands out. float16 holds them in float32 and,
    with float16 GEMMs, at one row's scale: the "mean" ones are the "sum"
    ones bit for bit and grad_scale is 1 / denominator (Note [Accumulation
    precision]); everywhere else they are the linear's dtype and grad_scale
    is 1."""
    x, w, b, t, weight = make_case(45, 16, 50, dtype, weighted=weighted, seed=5)
    accurate = acc_policy == "accurate" and dtype != torch.float32
    held = {r: FWD(x, w, b, t, weight, -100, 0.1, r, 8, [True, True, True], accurate) for r in ("mean", "sum")}
    loss, _, den, gi, gw, gb, grad_scale = held["mean"]
    kept = t != -100
    assert den.item() == ((weight[t.clamp_min(0)] * kept).sum() if weighted else kept.sum()).item()
    assert held["sum"][2].item() == 1.0
    per_row = dtype == torch.float16 and not accurate
    for r in held:
        assert held[r][6].dtype == torch.float32 and held[r][6].shape == ()
        assert held[r][6].item() == (1 / held[r][2]).item() if per_row else held[r][6].item() == 1.0
        assert all(g.dtype == (torch.float32 if dtype == torch.float16 else dtype) for g in held[r][3:6])
    if per_row:
        for name, a, c in zip(GRAD_NAMES, held["mean"][3:6], held["sum"][3:6]):
            assert torch.equal(a, c), name
    # (torch's rule: "accurate" computes in acc_dtype, float32 only when asked for or under "auto".)
    o = opts(batch_chunk_size=8, acc_policy=acc_policy, acc_dtype=torch.float32 if accurate else None)
    up = torch.tensor(1.75, dtype=dtype)
    got_loss, got = run(ours, x, w, b, t, options=o, upstream=up, weight=weight, label_smoothing=0.1)
    assert torch.equal(got_loss, loss.to(dtype))
    for name, g, h in zip(GRAD_NAMES, got, (gi, gw, gb)):
        assert torch.equal(g, (h * (up.to(grad_scale.dtype) * grad_scale)).to(dtype)), name


@pytest.mark.parametrize("gradients_in_forward", [True, False])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "class_weights"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_rows_ignored(dtype, reduction, weighted, gradients_in_forward):
    """As torch: "mean" over no kept row is 0 / 0 = NaN, "sum" 0, "none"
    zeros; every gradient is exactly zero (not NaN)."""
    x, w, b, t, weight = make_case(20, 8, 11, dtype, weighted=weighted)
    t = torch.full_like(t, -100)
    kw = dict(weight=weight, reduction=reduction, label_smoothing=0.1)
    loss, grads = run(ours, x, w, b, t, options=opts(batch_chunk_size=6, gradients_in_forward=gradients_in_forward),
                      upstream=torch.tensor(1.0) if reduction != "none" else torch.ones(20), **kw)
    ref_loss, _ = run(torch_lce, x, w, b, t, cast=torch.float64, **kw)
    assert loss.dtype == dtype
    if reduction == "mean":
        assert torch.isnan(loss) and torch.isnan(ref_loss)
    else:
        assert torch.equal(loss, torch.zeros_like(loss))
    for g in grads:
        assert torch.equal(g, torch.zeros_like(g))



@pytest.mark.parametrize("gradients_in_forward", [True, False])
def test_empty_batch(gradients_in_forward):
    x, w, b, _, _ = make_case(1, 8, 11, torch.float32)
    x, t = x[:0], torch.zeros(0, dtype=torch.long)
    o = opts(gradients_in_forward=gradients_in_forward)
    for reduction in REDUCTIONS:
        loss, grads = run(ours, x, w, b, t, reduction=reduction, options=o,
                          upstream=torch.ones(()) if reduction != "none" else torch.ones(0))
        ref, _ = run(torch_lce, x, w, b, t, reduction=reduction,
                     upstream=torch.ones(()) if reduction != "none" else torch.ones(0))
        assert loss.shape == ref.shape
        assert torch.equal(loss, ref) or (torch.isnan(loss) and torch.isnan(ref))
        assert grads[0].shape == (0, 8)
        assert torch.equal(grads[1], torch.zeros_like(grads[1])) and torch.equal(grads[2], torch.zeros_like(grads[2]))


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "class_weights"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_autocast_bfloat16_with_float32_parameters(reduction, weighted):
    """Under CPU autocast the GEMMs run in bfloat16, as F.linear's would, and
    the loss comes out float32, as autocast's cross_entropy gives; the
    gradients are the parameters' float32."""
    x, w, b, t, weight = make_case(37, 32, 70, torch.float32, weighted=weighted, seed=6)
    kw = dict(weight=weight, reduction=reduction, label_smoothing=0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = run(ours, x, w, b, t, options=opts(batch_chunk_size=10), **kw)
        theirs = run(torch_lce, x, w, b, t, **kw)
    assert got[0].dtype == torch.float32 and theirs[0].dtype == torch.float32
    assert all(g.dtype == torch.float32 for g in got[1])
    bf = lambda v: None if v is None else v.to(torch.bfloat16)  # noqa: E731  (what autocast gives the GEMMs)
    (ref_loss, ref_grads), bounds = lce_bounds(bf(x), bf(w), bf(b), t, weight=weight, reduction=reduction,
                                               ignore_index=None, label_smoothing=0.1, dtype=torch.bfloat16,
                                               loss_dtype=torch.float32, chunk=10)
    assert_near_reference("loss", got[0], theirs[0], ref_loss, bounds[0])
    for name, g, tg, rg, bd in zip(GRAD_NAMES, got[1], theirs[1], ref_grads, bounds[1:]):
        assert_near_reference(name, g, tg, rg, bd)


@pytest.mark.parametrize("options", ["options_none", "options_given"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_float64(reduction, options):
    """float64 linears compute in float64 throughout: the loss and the
    gradients are float64 and agree with F.cross_entropy(F.linear(...)) in
    float64 to a few ulps."""
    x, w, b, t, weight = make_case(53, 32, 97, torch.float64, weighted=True, ignore_index=3)
    kw = dict(weight=weight.double(), reduction=reduction, ignore_index=3, label_smoothing=0.1)
    o = None if options == "options_none" else opts(batch_chunk_size=16)
    got = run(ours, x, w, b, t, options=o, **kw)
    ref = run(torch_lce, x, w, b, t, **kw)
    assert got[0].dtype == torch.float64 and all(g.dtype == torch.float64 for g in got[1])
    for a, c in zip([got[0], *got[1]], [ref[0], *ref[1]]):
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("gradients_in_forward", [True, False], ids=["grads_in_forward", "grads_in_backward"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_accurate_is_float32_arithmetic(dtype, reduction, gradients_in_forward):
    """acc_policy "accurate" (acc_dtype float32; "auto" on the CPU) computes
    16-bit linears in float32: for a loss gradient of 1 the loss and the
    gradients are the float32 computation's on the same values, rounded once
    to the 16-bit dtype. options=None computes float16 that way on the CPU
    too, and bfloat16 as "compact"."""
    x, w, b, t, weight = make_case(45, 16, 50, dtype, weighted=reduction == "sum", seed=13)
    kw = dict(weight=weight, reduction=reduction, label_smoothing=0.1)
    up = torch.ones(45 if reduction == "none" else ())
    f32 = lambda v: v.float()  # noqa: E731
    want = run(ours, f32(x), f32(w), f32(b), t, upstream=up,
               options=opts(batch_chunk_size=7, gradients_in_forward=gradients_in_forward), **kw)
    want = [want[0].to(dtype), [g.to(dtype) for g in want[1]]]
    accurate = [FF.LinearCrossEntropyOptions(batch_chunk_size=7, gradients_in_forward=gradients_in_forward,
                                             acc_policy=policy, acc_dtype=acc_dtype)
                for policy, acc_dtype in (("accurate", torch.float32), ("auto", None), ("auto", torch.float32))]
    compact = opts(batch_chunk_size=7, gradients_in_forward=gradients_in_forward)
    for o in accurate + [compact]:
        got = run(ours, x, w, b, t, upstream=up, options=o, **kw)
        same = all(torch.equal(a, c) for a, c in zip([got[0], *got[1]], [want[0], *want[1]]))
        assert same == (o is not compact), o
    # options=None: the default chunk (one chunk here) in both; class
    # weights of the input's dtype, as torch's reference takes them (these
    # are exact in 16 bits).
    kw["weight"] = None if weight is None else weight.to(dtype)
    none = run(ours, x, w, b, t, upstream=up, **kw)
    if dtype == torch.float16:
        want = run(ours, f32(x), f32(w), f32(b), t, upstream=up, **dict(kw, weight=weight))
        want = [want[0].to(dtype), [g.to(dtype) for g in want[1]]]
    else:
        want = run(ours, x, w, b, t, upstream=up, options=opts(batch_chunk_size=45), **kw)
    for a, c in zip([none[0], *none[1]], [want[0], *want[1]]):
        assert torch.equal(a, c)


# ---------------------------------------------------- paths and exact equalities


def k_dimensional_reference(x, w, t, *, linear_bias=None, **kw):
    """torch's reference for a K-dimensional linear_weight [C, d1, ..., H]:
    the logits [N, C, d1, ...] of the flattened linear."""
    c, *out_features, h = w.shape
    b = None if linear_bias is None else linear_bias.reshape(-1)
    logits = F.linear(x, w.reshape(-1, h), b).reshape(*x.shape[:-1], c, *out_features)
    return F.cross_entropy(logits, t, **kw)


@pytest.mark.parametrize("given", [False, True], ids=["options_none", "options_given"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_k_dimensional_weights_take_the_reference_exactly(reduction, given):
    """linear_weight [C, d1, H] (targets [N, d1]): torch's reference, every
    logit held, the same bits as F.cross_entropy of F.linear; silently with
    options=None, with a warning that the options were ignored otherwise."""
    x, w, b, t, weight = make_case(25, 16, 30, torch.bfloat16, weighted=True)
    w3 = torch.cat([w, w.flip(0)], 1).reshape(30, 2, 16)  # [C, d1 = 2, H]
    b3 = torch.stack([b, b.flip(0)], 1)  # [C, d1]
    t3 = torch.stack([t, t.flip(0)], 1)  # [N, d1]
    weight = weight.bfloat16()  # the reference path is F.cross_entropy's: the logits' dtype
    kw = dict(weight=weight, reduction=reduction, label_smoothing=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run(ours, x, w3, b3, t3, ignore_index=-100, options=opts() if given else None, **kw)
    ignored = [str(c.message) for c in caught if "``options`` ignored" in str(c.message)]
    assert len(ignored) == (1 if given else 0), [str(c.message) for c in caught]
    assert all(issubclass(c.category, UserWarning) for c in caught)
    ref = run(k_dimensional_reference, x, w3, b3, t3, ignore_index=-100, **kw)
    assert got[0].shape == ((25, 2) if reduction == "none" else ())
    assert torch.equal(got[0], ref[0])
    for name, a, c in zip(GRAD_NAMES, got[1], ref[1]):
        assert torch.equal(a, c), name


@pytest.mark.parametrize("shape", ["2d", "1d"])
def test_probability_targets_take_the_reference_path(shape):
    """Class probabilities (the logits' shape) are torch's reference exactly:
    silently with options=None, with a warning when options were given."""
    batch_shape = (12,) if shape == "2d" else ()
    x, w, b, _, _ = make_case(None, 8, 10, torch.float32, batch_shape=batch_shape)
    probs = torch.softmax(torch.randn(*batch_shape, 10, generator=torch.Generator().manual_seed(1)), -1)
    xr = x.clone().requires_grad_()
    ref = F.cross_entropy(F.linear(xr, w, b), probs, label_smoothing=0.1)
    ref.backward()
    for o in (None, opts(batch_chunk_size=4)):
        xs = x.clone().requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            if o is None:
                loss = FF.linear_cross_entropy(xs, w, probs, linear_bias=b, label_smoothing=0.1, options=o)
            else:
                with pytest.warns(UserWarning, match=r"``options`` ignored.*a probability target: True"):
                    loss = FF.linear_cross_entropy(xs, w, probs, linear_bias=b, label_smoothing=0.1, options=o)
        loss.backward()
        assert torch.equal(loss, ref) and torch.equal(xs.grad, xr.grad)


def test_eager_calls_take_the_cpp_function():
    """Eager calls run the C++ autograd Function (no Python in the backward)."""
    x, w, b, t, _ = make_case(10, 8, 12, torch.float32)
    loss = FF.linear_cross_entropy(x.requires_grad_(), w, t, linear_bias=b)
    assert not isinstance(loss.grad_fn, torch.autograd.function.BackwardCFunction), type(loss.grad_fn)
    assert "LinearCrossEntropy" in type(loss.grad_fn).__name__ or "LinearCrossEntropy" in loss.grad_fn.name()


def op_calls(fn):
    """How many times each fusetrain op ran during fn (profiler events)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    calls = {}
    for e in prof.events():
        if e.name.startswith("fusetrain::"):
            calls[e.name] = calls.get(e.name, 0) + 1
    return calls


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("gradients_in_forward", [True, False])
def test_chunks_and_passes_are_what_the_options_ask(gradients_in_forward, reduction):
    """One fused cross-entropy per chunk of batch_chunk_size rows (the default
    rule: one chunk at this size); gradients_in_forward computes the logits'
    gradient in the forward (no backward op) except for "none"."""
    x, w, b, t, _ = make_case(48, 8, 20, torch.float32)
    x.requires_grad_()
    recompute = not gradients_in_forward or reduction == "none"
    for chunk, chunks in ((None, 1), (16, 3), (7, 7), (1, 48), (1000, 1)):
        o = opts(batch_chunk_size=chunk, gradients_in_forward=gradients_in_forward)
        calls = op_calls(lambda: FF.linear_cross_entropy(x, w, t, linear_bias=b, reduction=reduction,
                                                         options=o).sum().backward())
        assert calls.get("fusetrain::linear_cross_entropy_forward") == 1, calls
        assert calls.get("fusetrain::linear_cross_entropy_backward", 0) == (1 if recompute else 0), calls
        assert calls.get("fusetrain::softmax_cross_entropy_forward") == chunks, (chunk, calls)
        assert calls.get("fusetrain::softmax_cross_entropy_backward") == chunks, (chunk, calls)


def gemm_calls(fn):
    """The chunks' GEMMs during fn: (logits: addmm with the bias, input
    gradient: mm, weight gradient: addmm_ into its float32 sum)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = [e.name for e in prof.events()]
    return tuple(names.count(n) for n in ("aten::addmm", "aten::mm", "aten::addmm_"))


@pytest.mark.parametrize("options", ["options_none", "options_given"])
@pytest.mark.parametrize("needs", [(1, 1, 1), (1, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1), (0, 0, 0)],
                         ids=["all", "input", "weight", "bias", "frozen_input", "none"])
def test_only_the_needed_gradients_are_computed(needs, options):
    """The forward computes the gradients autograd will ask for and no other
    (a frozen head: no weight-gradient GEMM; under no_grad: none), and they
    are those of a call that computes every gradient, bit for bit."""
    x, w, b, t, _ = make_case(48, 8, 20, torch.float32)
    o = None if options == "options_none" else opts(batch_chunk_size=16)
    chunks = 1 if o is None else 3

    def call(leaves):
        return FF.linear_cross_entropy(leaves[0], leaves[1], t, linear_bias=leaves[2], options=o)

    every = [v.clone().requires_grad_() for v in (x, w, b)]
    call(every).backward()
    leaves = [v.clone().requires_grad_(bool(r)) for v, r in zip((x, w, b), needs)]
    losses = []
    assert gemm_calls(lambda: losses.append(call(leaves))) == (chunks, chunks * needs[0], chunks * needs[1])
    with torch.no_grad():
        assert gemm_calls(lambda: call(every)) == (chunks, 0, 0)
    if any(needs):
        losses[0].backward()
    for name, v, e in zip(GRAD_NAMES, leaves, every):
        assert (v.grad is None) == (not v.requires_grad), name
        assert v.grad is None or torch.equal(v.grad, e.grad), name


def recorded_graphs():
    """A torch.compile backend (aot_eager's, recording the forward and
    backward graphs it is given) and the list the graphs go to."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=record, bw_compiler=record), graphs


@pytest.mark.parametrize("gradients_in_forward", [True, False])
def test_compiled_graph_calls_the_ops_as_eager_does(gradients_in_forward):
    """The traced path takes the C++ default chunk rule (1100 rows x 20000
    classes: 512-row chunks, not the whole batch), the GEMMs' precision and
    gradients_in_forward: the gradients that are needed (the input's; the
    weight is frozen) in the forward, or the backward op in the backward
    graph."""
    backend, graphs = recorded_graphs()
    n, h, c = 1100, 8, 20000
    g = torch.Generator().manual_seed(8)
    x = torch.randn(n, h, generator=g)
    w = torch.randn(c, h, generator=g) / 3
    t = torch.randint(0, c, (n,), generator=g)
    o = opts(gradients_in_forward=gradients_in_forward)

    def step(x, w, t):
        return FF.linear_cross_entropy(x, w, t, options=o)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    lc, le = compiled(xc, w, t), step(xe, w, t)
    lc.backward()
    le.backward()
    assert torch.equal(lc, le) and torch.equal(xc.grad, xe.grad)
    nodes = [node for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
    forward = [node for node in nodes if node.target is FWD]
    backward = [node for node in nodes if node.target is BWD]
    assert len(forward) == 1
    chunk_rows, grad_mask, accurate = forward[0].args[8:11]
    assert chunk_rows == _C.linear_cross_entropy_chunk_rows(n, h, c, torch.float32, "cpu") == 512
    assert list(grad_mask) == [gradients_in_forward, False, False] and accurate is False
    assert len(backward) == (0 if gradients_in_forward else 1)
    if backward:
        assert backward[0].args[11] == 512
        assert list(backward[0].args[12]) == [True, False, False] and backward[0].args[13] is False


COMPILE_CASES = {
    # dtype, batch shape, bias, weighted, reduction, ignore_index, chunk, gradients_in_forward, autocast
    # (gradients_in_forward None: options=None)
    "fp32_weighted_mean": (torch.float32, (40,), True, True, "mean", None, 7, True, False),
    "bf16_none": (torch.bfloat16, (36,), False, False, "none", 3, 5, True, False),
    "autocast_sum_in_backward": (torch.float32, (33,), True, False, "sum", -100, None, False, True),
    "bf16_options_none": (torch.bfloat16, (30,), True, True, "mean", None, None, None, False),
    "fp16_options_none": (torch.float16, (30,), True, False, "sum", None, None, None, False),
    "fp16_1d_options_none": (torch.float16, (), True, False, "mean", None, None, None, False),
}


@pytest.mark.parametrize("case", COMPILE_CASES.values(), ids=COMPILE_CASES.keys())
def test_torch_compile_matches_eager_bitwise(case):
    """torch.compile (fullgraph: no graph break) traces the Python autograd
    Function into the same two ops the C++ Function calls: the same bits."""
    dtype, batch_shape, bias, weighted, reduction, ignore_index, chunk, gif, autocast = case
    x, w, b, t, weight = make_case(None, 16, 37, dtype, batch_shape=batch_shape, bias=bias, weighted=weighted,
                                   ignore_index=ignore_index, seed=7)
    o = None if gif is None else opts(batch_chunk_size=chunk, gradients_in_forward=gif)
    if o is None and weight is not None and not autocast:
        weight = weight.to(dtype)  # torch's reference takes class weights of the logits' dtype only
    if batch_shape == ():
        t = torch.tensor(4)

    def step(x, w, b, t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return FF.linear_cross_entropy(x, w, t, linear_bias=b, weight=weight, reduction=reduction,
                                           ignore_index=ignore_index, label_smoothing=0.1, options=o)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (compiled, step):
        leaves = [None if v is None else v.clone().requires_grad_() for v in (x, w, b)]
        loss = fn(leaves[0], leaves[1], leaves[2], t)
        loss.backward(upstream_for(loss))
        results.append((loss.detach(), [None if v is None else v.grad for v in leaves]))
    (cl, cg), (el, eg) = results
    assert cl.dtype == el.dtype and cl.shape == el.shape
    assert torch.equal(cl, el)
    for name, a, c in zip(GRAD_NAMES, cg, eg):
        assert (a is None) == (c is None), name
        assert a is None or torch.equal(a, c), name


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_options_none_is_twice_differentiable_as_the_reference(reduction):
    """options=None has the reference's autograd: a create_graph backward
    builds the reference's graph, so double backward works (gradgradcheck in
    float64) and gives the reference's second derivatives."""
    x, w, b, t, weight = make_case(6, 4, 5, torch.float64, weighted=True, ignore_index=3)
    weight = weight.double()
    kw = dict(weight=weight, reduction=reduction, ignore_index=3, label_smoothing=0.1)

    def ours_fn(x, w, b):
        return FF.linear_cross_entropy(x, w, t, linear_bias=b, **kw)

    def ref_fn(x, w, b):
        return torch_lce(x, w, t, linear_bias=b, **kw)

    leaves = tuple(v.clone().requires_grad_() for v in (x, w, b))
    assert torch.autograd.gradcheck(ours_fn, leaves)
    assert torch.autograd.gradgradcheck(ours_fn, leaves)
    results = []
    for fn in (ours_fn, ref_fn):
        loss = fn(*leaves)
        grads = torch.autograd.grad(loss, leaves, upstream_for(loss), create_graph=True)
        assert all(g.requires_grad for g in grads)
        # A Hessian-vector product through every gradient.
        hvp = torch.autograd.grad(sum((g * g).sum() for g in grads), leaves)
        results.append([loss, *grads, *hvp])
    for a, c in zip(*results):
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-14)


def test_options_none_double_backward_under_autocast_with_float32_class_weights():
    """Under bf16 autocast the linear runs in bf16 and the class weights stay
    float32 (autocast's cross_entropy casts to float32): the create_graph
    backward's reference graph must take them as autocast would, giving the
    reference's gradients and a graph through them."""
    x, w, b, t, weight = make_case(12, 8, 9, torch.float32, weighted=True)
    grads = []
    for fn in (FF.linear_cross_entropy, torch_lce):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fn(xs, ws, t, weight=weight)
        assert loss.dtype == torch.float32
        gx, gw = torch.autograd.grad(loss, (xs, ws), create_graph=True)
        assert gx.requires_grad and gw.requires_grad
        grads.append((gx, gw))
    for a, c in zip(*grads):
        # The same bf16 GEMMs, float32 cross-entropy: within bf16 rounding.
        torch.testing.assert_close(a, c, rtol=2**-7, atol=2**-7 * c.abs().max().item())


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_options_none_retain_graph_recomputes(reduction):
    """options=None: backward(retain_graph=True) may be called again (the
    second recomputes the chunks), the gradients accumulating as torch's."""
    x, w, b, t, _ = make_case(20, 8, 11, torch.float32)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = FF.linear_cross_entropy(xs, ws, t, linear_bias=b, reduction=reduction)
    up = upstream_for(loss)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = torch_lce(xr, wr, t, linear_bias=b, reduction=reduction)
    ref.backward(up)
    loss.backward(up, retain_graph=True)
    torch.testing.assert_close(ws.grad, wr.grad, rtol=1e-5, atol=1e-6)
    calls = op_calls(lambda: loss.backward(up / 2))
    assert calls.get("fusetrain::linear_cross_entropy_backward") == 1, calls
    torch.testing.assert_close(ws.grad, wr.grad * 1.5, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xs.grad, xr.grad * 1.5, rtol=1e-5, atol=1e-6)


def test_explicit_options_retain_graph_needs_allow_retain_graph():
    """With options given, torch's chunked-path semantics: the gradients
    computed in the forward are handed to the backward (rescaled in place,
    not copied), so a second backward through the same graph is torch's
    error, unless allow_retain_graph keeps them (then both backwards give the
    same gradients: the accumulated sum is 1.5x for a second loss gradient of
    1/2); with gradients_in_forward=False the backward recomputes anyway."""
    x, w, b, t, _ = make_case(20, 8, 11, torch.float32)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = FF.linear_cross_entropy(xs, ws, t, linear_bias=b, options=opts())
    loss.backward(retain_graph=True)
    first = ws.grad.clone()
    with pytest.raises(RuntimeError, match=r"^linear_cross_entropy chunked backward called twice; "
                                           r"retain_graph=True / double backward are not supported\.$"):
        loss.backward()
    for o in (opts(allow_retain_graph=True), opts(gradients_in_forward=False)):
        ws.grad = None
        loss = FF.linear_cross_entropy(xs, ws, t, linear_bias=b, options=o)
        loss.backward(retain_graph=True)
        torch.testing.assert_close(ws.grad, first, rtol=1e-6, atol=1e-7)
        loss.backward(torch.tensor(0.5))
        torch.testing.assert_close(ws.grad, first * 1.5, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("gradients_in_forward", [True, False], ids=["grads_in_forward", "grads_in_backward"])
def test_explicit_options_create_graph_is_torchs_chunked_path(gradients_in_forward, reduction):
    """With options given, as torch's chunked path: a create_graph backward
    gives gradients with no grad_fn (no second derivative through the loss;
    torch documents higher-order AD as unsupported there), and no warning."""
    x, w, b, t, _ = make_case(6, 4, 5, torch.float64)
    xs = x.clone().requires_grad_()
    o = opts(gradients_in_forward=gradients_in_forward)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = FF.linear_cross_entropy(xs, w, t, linear_bias=b, reduction=reduction, options=o)
        (g,) = torch.autograd.grad(loss, xs, upstream_for(loss), create_graph=True)
    assert g.grad_fn is None and not g.requires_grad
    if hasattr(F, "linear_cross_entropy"):
        theirs = F.linear_cross_entropy(xs, w, t, linear_bias=b, reduction=reduction,
                                        options=torch.nn.LinearCrossEntropyOptions())
        (tg,) = torch.autograd.grad(theirs, xs, upstream_for(theirs), create_graph=True)
        assert tg.grad_fn is None
        torch.testing.assert_close(g, tg)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("gradients_in_forward", [True, False], ids=["grads_in_forward", "grads_in_backward"])
def test_python_function_create_graph_gives_no_grad_fn(gradients_in_forward, reduction):
    """The Python autograd Function (what torch.compile traces) is
    once_differentiable, as torch's chunked path: a create_graph backward
    gives the gradients (those of the C++ Function, bit for bit) with no
    grad_fn."""
    x, w, b, t, _ = make_case(6, 4, 5, torch.float32)
    grad = gradients_in_forward and reduction != "none"
    xs, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss = FF._LinearCrossEntropy.apply(xs, w, b, t, None, -100, 0.0, reduction, 4, False, [grad, False, False])
    eager = FF.linear_cross_entropy(xe, w, t, linear_bias=b, reduction=reduction,
                                    options=opts(batch_chunk_size=4, gradients_in_forward=gradients_in_forward))
    assert torch.equal(loss, eager)
    (g,) = torch.autograd.grad(loss, xs, upstream_for(loss), create_graph=True)
    (ge,) = torch.autograd.grad(eager, xe, upstream_for(eager))
    assert g.grad_fn is None and not g.requires_grad
    assert torch.equal(g, ge)


# ------------------------------------------------------------------ the ops


def op_args(dtype=torch.float32, *, bias=True, weighted=True, reduction="mean", grad_mask=(True, True, True), n=10,
            h=8, c=7, accurate=False, device="cpu"):
    x, w, b, t, weight = make_case(n, h, c, dtype, bias=bias, weighted=weighted, device=device)
    return (x, w, b, t, weight, -100, 0.1, reduction, 3, list(grad_mask), accurate)


NO_GRAD = (False, False, False)
OPCHECK_CASES = {
    "mean_with_grad": dict(),
    "sum_bf16_no_bias": dict(dtype=torch.bfloat16, bias=False, reduction="sum", weighted=False),
    "none_no_grad": dict(reduction="none", grad_mask=NO_GRAD),
    "mean_no_grad": dict(grad_mask=NO_GRAD, weighted=False),
    "mean_weight_grad_only": dict(grad_mask=(False, True, False)),
    "sum_fp16_compact": dict(dtype=torch.float16, reduction="sum"),
    "mean_fp16_accurate": dict(dtype=torch.float16, accurate=True),
    "mean_bf16_accurate_input_grad_only": dict(dtype=torch.bfloat16, accurate=True, grad_mask=(True, False, False)),
    "mean_fp64": dict(dtype=torch.float64),
}


@pytest.mark.parametrize("case", OPCHECK_CASES.values(), ids=OPCHECK_CASES.keys())
def test_opcheck(case):
    """Schema (no aliasing or mutation the schema does not declare) and
    FakeTensor (the Meta kernels agree with the CPU ones) for both ops."""
    args = op_args(**case)
    torch.library.opcheck(FWD, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
    x, w, b, t, weight, ii, ls, reduction, chunk, _, accurate = args
    loss, lse, denominator, *_ = FWD(x, w, b, t, weight, ii, ls, reduction, chunk, list(NO_GRAD), accurate)
    grad = upstream_for(loss)
    for mask in ([True, True, True], [False, True, False]):
        torch.library.opcheck(BWD, (grad, x, w, b, t, weight, lse, denominator, ii, ls, reduction, chunk, mask,
                                    accurate),
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_opcheck_autograd_registration():
    x, w, b, t, weight, *rest = op_args()
    args = (x.requires_grad_(), w.requires_grad_(), b, t, weight, *rest)
    torch.library.opcheck(FWD, args, test_utils=("test_autograd_registration",))


ALL = [True, True, True]


def test_op_outputs():
    x, w, b, t, weight, ii, ls, _, chunk, _, _ = op_args(torch.bfloat16, n=13)
    kept = t != ii
    for reduction in REDUCTIONS:
        mask = ALL if reduction != "none" else list(NO_GRAD)
        loss, lse, den, gi, gw, gb, grad_scale = FWD(x, w, b, t, weight, ii, ls, reduction, chunk, mask, False)
        assert loss.dtype == torch.float32 and loss.shape == ((13,) if reduction == "none" else ())
        z = F.linear(x.double(), w.double(), b.double())
        torch.testing.assert_close(lse, torch.logsumexp(z, 1).float(), rtol=2.0**-7, atol=0.05)
        expected_den = (weight[t.clamp_min(0)] * kept).sum() if reduction == "mean" else torch.tensor(1.0)
        assert den.dtype == torch.float32 and den.shape == () and den.item() == expected_den.item()
        assert grad_scale.dtype == torch.float32 and grad_scale.shape == () and grad_scale.item() == 1.0
        if mask[0]:
            assert (gi.shape, gw.shape, gb.shape) == (x.shape, w.shape, b.shape)
            assert gi.dtype == gw.dtype == gb.dtype == torch.bfloat16
        else:
            assert gi.numel() == gw.numel() == gb.numel() == 0
    with pytest.raises(RuntimeError, match="gradients in the forward need a scalar loss"):
        FWD(x, w, b, t, weight, ii, ls, "none", chunk, [False, True, False], False)
    # Only the gradients grad_mask asks for: the others are empty (no bias: no bias gradient).
    for mask in ([True, False, False], [False, True, False], [False, False, True]):
        out = FWD(x, w, b, t, weight, ii, ls, "mean", chunk, mask, False)
        for want, g, like in zip(mask, out[3:6], (x, w, b)):
            assert g.shape == (like.shape if want else (0,))
    assert FWD(x, w, None, t, weight, ii, ls, "sum", chunk, [False, False, True], False)[5].numel() == 0
    # The backward divides "mean" by the denominator it is given.
    loss, lse, den, *_ = FWD(x, w, b, t, weight, ii, ls, "mean", chunk, list(NO_GRAD), False)
    g1 = BWD(torch.tensor(1.0), x, w, b, t, weight, lse, den, ii, ls, "mean", chunk, ALL, False)
    g2 = BWD(torch.tensor(1.0), x, w, b, t, weight, lse, den * 2, ii, ls, "mean", chunk, ALL, False)
    for a, c in zip(g1, g2):
        torch.testing.assert_close(c.float(), a.float() / 2, rtol=2.0**-7, atol=0)
    gi, gw, gb = BWD(torch.tensor(1.0), x, w, None, t, weight, lse, den, ii, ls, "mean", chunk, [False, True, True],
                     False)
    assert gi.numel() == 0 and gw.shape == w.shape and gb.numel() == 0
    with pytest.raises(RuntimeError, match="grad_loss must have shape"):
        BWD(torch.ones(3), x, w, b, t, weight, lse, den, ii, ls, "none", chunk, ALL, False)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16], ids=str)
def test_op_outputs_float64_and_float16(dtype):
    """float64: the loss, lse and denominator float64, the gradients float64.
    float16: the held gradients float32; with float16 GEMMs at one row's
    scale (grad_scale 1 / denominator), computed in float32 grad_scale 1.
    Either way (held * grad_scale) is the float64 reference's gradient."""
    x, w, b, t, weight, ii, ls, _, chunk, _, _ = op_args(dtype, n=13)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    z = F.linear(x.double().requires_grad_(), w.double(), b.double())
    ref = F.cross_entropy(z, t, weight=weight.double(), ignore_index=ii, label_smoothing=ls)
    (ref_gz,) = torch.autograd.grad(ref, z)
    ref_gw = ref_gz.T @ x.double()
    for accurate in (False, True):
        loss, lse, den, gi, gw, gb, grad_scale = FWD(x, w, b, t, weight, ii, ls, "mean", chunk, ALL, accurate)
        assert loss.dtype == lse.dtype == den.dtype == grad_scale.dtype == acc
        held = torch.float32 if dtype == torch.float16 else dtype
        assert gi.dtype == gw.dtype == gb.dtype == held
        per_row = dtype == torch.float16 and not accurate
        assert grad_scale.item() == ((1 / den).item() if per_row else 1.0)
        tol = dict(rtol=1e-12, atol=1e-14) if dtype == torch.float64 else dict(rtol=2.0**-8, atol=2.0**-12)
        torch.testing.assert_close(loss.double(), ref.detach(), **tol)
        torch.testing.assert_close((gw * grad_scale).double(), ref_gw, **tol)
        torch.testing.assert_close((gb * grad_scale).double(), ref_gz.sum(0), **tol)
        gi2, gw2, gb2 = BWD(torch.ones((), dtype=acc), x, w, b, t, weight, lse, den, ii, ls, "mean", chunk, ALL,
                            accurate)
        assert gi2.dtype == gw2.dtype == gb2.dtype == dtype
        torch.testing.assert_close(gw2.double(), ref_gw, **tol)


@pytest.mark.parametrize("bias", [False, True])
def test_meta_shapes(bias):
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        x, w, b, t, weight, ii, ls, *_ = op_args(dtype, bias=bias, n=7, h=11, c=5, device="meta")
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        held = torch.float32 if dtype == torch.float16 else dtype
        for reduction in REDUCTIONS:
            for mask in ([list(NO_GRAD)] if reduction == "none" else [list(NO_GRAD), ALL, [False, True, False]]):
                loss, lse, den, gi, gw, gb, grad_scale = FWD(x, w, b, t, weight, ii, ls, reduction, 0, mask, False)
                assert loss.shape == ((7,) if reduction == "none" else ()) and loss.dtype == acc
                assert lse.shape == (7,) and den.shape == () and lse.device.type == "meta"
                assert grad_scale.shape == () and grad_scale.dtype == acc
                assert gi.shape == ((7, 11) if mask[0] else (0,)) and gi.dtype == held
                assert gw.shape == ((5, 11) if mask[1] else (0,)) and gw.dtype == held
                assert gb.shape == ((5,) if mask[2] and bias else (0,))
                grad = torch.empty(loss.shape, device="meta", dtype=acc)
                for bmask in ([True, True, True], [True, False, False]):
                    gi, gw, gb = BWD(grad, x, w, b, t, weight, lse, den, ii, ls, reduction, 0, bmask, True)
                    assert gi.shape == ((7, 11) if bmask[0] else (0,)) and gi.device.type == "meta"
                    assert gi.dtype == dtype
                    assert gw.shape == ((5, 11) if bmask[1] else (0,))
                    assert gb.shape == ((5,) if bmask[2] and bias else (0,))


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_functional_and_module_on_meta_tensors(reduction):
    xm = torch.empty(12, 11, device="meta", dtype=torch.bfloat16)
    tm = torch.empty(12, device="meta", dtype=torch.long)
    wm = torch.empty(5, 11, device="meta", dtype=torch.bfloat16)
    ref = torch_lce(xm, wm, tm, reduction=reduction)
    for o in (None, opts(batch_chunk_size=4)):
        out = FF.linear_cross_entropy(xm, wm, tm, reduction=reduction, options=o)
        assert out.shape == ref.shape == ((12,) if reduction == "none" else ())
        assert out.dtype == torch.bfloat16 and out.device.type == "meta"
    m = fusetrain.nn.LinearCrossEntropyLoss(11, 5, bias=True, device="meta", dtype=torch.bfloat16,
                                            reduction=reduction)
    out = m(xm, tm)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16 and out.device.type == "meta"


# ------------------------------------------------------------------ errors


def test_out_of_range_target_names_the_index_and_the_value():
    x, w, b, t, _ = make_case(10, 8, 13, torch.float32, ignore_index=None)
    for bad in (13, -1, -7):
        tb = t.clone()
        tb[6] = bad
        for o in (None, opts(batch_chunk_size=4)):
            with pytest.raises(IndexError, match=rf"target\[6\] = {bad}"):
                FF.linear_cross_entropy(x, w, tb, options=o)
    # -100 is a class index like any other when ignore_index is 3.
    with pytest.raises(IndexError, match=r"target\[0\] = -100"):
        FF.linear_cross_entropy(x, w, t, ignore_index=3)
    # A 1-D input: its one row.
    with pytest.raises(IndexError, match=r"target\[0\] = 99"):
        FF.linear_cross_entropy(x[3], w, torch.tensor(99))
    # The backward op checks too (it is called with the forward's targets).
    _, lse, den, *_ = FWD(x, w, None, t, None, -100, 0.0, "mean", 4, list(NO_GRAD), False)
    tb = t.clone()
    tb[2] = 50
    with pytest.raises(IndexError, match=r"target\[2\] = 50"):
        BWD(torch.tensor(1.0), x, w, None, tb, None, lse, den, -100, 0.0, "mean", 4, ALL, False)


def test_argument_errors_name_what_is_wrong():
    """torch's checks, exception types and words (options=None and given)."""
    x, w, b, t, _ = make_case(10, 8, 13, torch.float32)
    probs = torch.softmax(torch.randn(10, 13), 1)
    cases = [
        (RuntimeError, r"expected equal input and linear_weight last dimensions \(in_features\), got 8 and 5, "
                       r"respectively", dict(linear_weight=w[:, :5])),
        (RuntimeError, r"expected m1 and m2 to have the same dtype, but got: float != double",
         dict(linear_weight=w.double())),
        (RuntimeError, r"expected m1 and m2 to have the same dtype, but got: double != float", dict(input=x.double())),
        (RuntimeError, r"expected linear_bias shape \(13,\), got \(4,\)", dict(linear_bias=b[:4])),
        (RuntimeError, r"weight tensor should be defined either for all 13 classes or no classes but got weight "
                       r"tensor of shape: \[4\]", dict(weight=torch.ones(4))),
        (ValueError, r"Expected input batch_size \(10\) to match target batch_size \(5\)\.", dict(target=t[:5])),
        (RuntimeError, r"expected input with dimensionality 1 or 2, got 3",
         dict(input=x.reshape(2, 5, 8), target=t.reshape(2, 5))),
        (RuntimeError, r"expected input with dimensionality 1 or 2, got 0",
         dict(input=torch.tensor(1.0), target=torch.tensor(1))),
        (RuntimeError, r"expected linear_weight with dimensionality at least 2, got 1", dict(linear_weight=w[0])),
        (RuntimeError, r"K-dimensional loss defined by linear_weight shape \(13, 1, 8\) requires batched input, "
                       r"\(N, 8\), got unbatched input with shape \(8,\)",
         dict(input=x[0], linear_weight=w.reshape(13, 1, 8), target=t[0])),
        (RuntimeError, r"expected target dtype to be Long or Byte, but got Int", dict(target=t.int())),
        (RuntimeError, r"expected target dtype to be Long or Byte, but got Bool", dict(target=t.bool())),
        (RuntimeError, r"expected target dtype to be Long or Byte, but got Float", dict(target=t.float())),
        (ValueError, r"avg is not a valid value for reduction", dict(reduction="avg")),
        (RuntimeError, r"label_smoothing must be between 0\.0 and 1\.0\. Got: 1\.5", dict(label_smoothing=1.5)),
        (RuntimeError, r"ignore_index cannot be specified when target contains probabilities",
         dict(target=probs, ignore_index=3)),
    ]
    def call(fn, change, **kw):
        args = {**dict(input=x, linear_weight=w, target=t), **kw, **change}
        return fn(args.pop("input"), args.pop("linear_weight"), args.pop("target"), **args)

    for o in (None, opts(batch_chunk_size=4)):
        for error, message, change in cases:
            with pytest.raises(error, match="^" + message + "$"):
                call(FF.linear_cross_entropy, change, options=o)
            if hasattr(F, "linear_cross_entropy") and o is None:  # torch's reference: the same
                with pytest.raises(error, match="^" + message + "$"):
                    call(F.linear_cross_entropy, change)
    # The options: torch's validation, at construction.
    for bad, message in (
        (dict(chunking_method="chunked"), r"invalid chunking_method: 'chunked'"),
        (dict(chunking_method="none"), r"invalid chunking_method: 'none'"),
        (dict(chunking_method="aspect_ratio:0"), r"invalid chunking_method: 'aspect_ratio:0'"),
        (dict(batch_chunk_size=0), r"batch_chunk_size must be positive int or None, got 0"),
        (dict(batch_chunk_size=-3), r"batch_chunk_size must be positive int or None, got -3"),
        (dict(acc_policy="fast"), r"invalid acc_policy: 'fast'; expected one of .*'compact'"),
        (dict(acc_dtype=torch.int32), r"acc_dtype must be one of \{None, torch\.float16, torch\.bfloat16, "
                                      r"torch\.float32, torch\.float64\}, got torch\.int32\..*"),
    ):
        with pytest.raises(ValueError, match="^" + message + "$"):
            FF.LinearCrossEntropyOptions(**bad)
    o = FF.LinearCrossEntropyOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.batch_chunk_size = 4
    # ... and at the call.
    with pytest.raises(ValueError, match=r"batch_chunk_size \(=3\) and chunking_method \('aspect_ratio'\) give "
                                         r"different chunk sizes"):
        FF.linear_cross_entropy(x, w, t, options=opts(batch_chunk_size=3, chunking_method="aspect_ratio"))
    with pytest.raises(RuntimeError, match=r"supports float32 acc_dtype with float16/bfloat16 inputs"):
        FF.linear_cross_entropy(x, w, t, options=opts(acc_dtype=torch.float64))
    # The raw op's own checks.
    with pytest.raises(RuntimeError, match="input must be float32, float64, float16 or bfloat16, got Int"):
        FWD(x.int(), w.int(), None, t, None, -100, 0.0, "mean", 4, list(NO_GRAD), False)
    with pytest.raises(RuntimeError, match="target must be int64"):
        FWD(x, w, b, t.int(), None, -100, 0.0, "mean", 4, list(NO_GRAD), False)
    with pytest.raises(RuntimeError, match="linear_bias is BFloat16 but input and linear_weight are Float"):
        FWD(x, w, b.bfloat16(), t, None, -100, 0.0, "mean", 4, list(NO_GRAD), False)


def test_integer_targets_of_other_dtypes():
    """uint8 class indices are torch's other target dtype (the same loss as
    int64); int32 and the others are torch's error."""
    x, w, b, t, _ = make_case(12, 8, 13, torch.float32, ignore_index=3)
    ref = FF.linear_cross_entropy(x, w, t, linear_bias=b, ignore_index=3)
    assert torch.equal(FF.linear_cross_entropy(x, w, t.to(torch.uint8), linear_bias=b, ignore_index=3), ref)
    for dtype, name in ((torch.int32, "Int"), (torch.int16, "Short"), (torch.int8, "Char")):
        with pytest.raises(RuntimeError, match=f"^expected target dtype to be Long or Byte, but got {name}$"):
            FF.linear_cross_entropy(x, w, t.to(dtype), linear_bias=b, ignore_index=3)


# ------------------------------------------------------------------ module


def test_module_parameters_buffers_and_state_dict():
    weight = torch.rand(13)
    m = fusetrain.nn.LinearCrossEntropyLoss(8, 13, bias=True, weight=weight, label_smoothing=0.1, ignore_index=3)
    assert [n for n, _ in m.named_parameters()] == ["linear.weight", "linear.bias"]
    assert [n for n, _ in m.named_buffers()] == ["weight"]
    assert set(m.state_dict()) == {"linear.weight", "linear.bias", "weight"}
    assert torch.equal(m.weight, weight)
    plain = fusetrain.nn.LinearCrossEntropyLoss(8, 13)
    assert list(plain.state_dict()) == ["linear.weight"]
    assert plain.linear.bias is None and plain.weight is None
    assert isinstance(plain.linear, torch.nn.Linear) and plain.linear.weight.shape == (13, 8)
    # A state dict loads into a new module.
    other = fusetrain.nn.LinearCrossEntropyLoss(8, 13, bias=True, weight=torch.zeros(13))
    other.load_state_dict(m.state_dict())
    assert torch.equal(other.linear.weight, m.linear.weight) and torch.equal(other.weight, weight)


@pytest.mark.parametrize("bias", [False, True])
def test_module_equals_the_functional(bias):
    x, _, _, t, weight = make_case(30, 8, 13, torch.float32, weighted=True, ignore_index=3)
    o = opts(batch_chunk_size=7)
    m = fusetrain.nn.LinearCrossEntropyLoss(8, 13, bias=bias, weight=weight, reduction="sum", ignore_index=3,
                                            label_smoothing=0.1, options=o)
    xs = x.clone().requires_grad_()
    loss = m(xs, t)
    loss.backward()
    xf = x.clone().requires_grad_()
    lw = m.linear.weight.detach().clone().requires_grad_()
    lb = None if m.linear.bias is None else m.linear.bias.detach().clone().requires_grad_()
    ref = FF.linear_cross_entropy(xf, lw, t, linear_bias=lb, weight=weight, reduction="sum", ignore_index=3,
                                  label_smoothing=0.1, options=o)
    ref.backward()
    assert torch.equal(loss, ref) and torch.equal(xs.grad, xf.grad) and torch.equal(m.linear.weight.grad, lw.grad)
    if bias:
        assert torch.equal(m.linear.bias.grad, lb.grad)


def test_module_device_dtype_and_repr():
    m = fusetrain.nn.LinearCrossEntropyLoss(8, 13, bias=True, dtype=torch.bfloat16, device="cpu")
    assert m.linear.weight.dtype == torch.bfloat16 and m.linear.bias.dtype == torch.bfloat16
    x, _, _, t, _ = make_case(6, 8, 13, torch.bfloat16)
    assert m(x, t).dtype == torch.bfloat16
    meta = fusetrain.nn.LinearCrossEntropyLoss(8, 13, device="meta")
    assert meta.linear.weight.device.type == "meta"
    r = repr(fusetrain.nn.LinearCrossEntropyLoss(8, 13, bias=True, reduction="sum"))
    assert ("in_features=8, num_classes=13, out_features=(), bias=True, reduction=sum, ignore_index=None, "
            "label_smoothing=0.0, options=None") in r
    assert "(linear): Linear(in_features=8, out_features=13, bias=True)" in r
    assert fusetrain.nn.LinearCrossEntropyOptions is FF.LinearCrossEntropyOptions
    assert fusetrain.nn.linear_cross_entropy is FF.linear_cross_entropy


@pytest.mark.skipif(not hasattr(torch.nn, "LinearCrossEntropyLoss"), reason="torch < 2.13")
def test_module_is_torchs():
    """A subclass of torch's module, with its constructor checks, attributes,
    state dict and repr."""
    kw = dict(bias=True, weight=torch.rand(13), reduction="sum", ignore_index=3, label_smoothing=0.1)
    m = fusetrain.nn.LinearCrossEntropyLoss(8, 13, **kw)
    theirs = torch.nn.LinearCrossEntropyLoss(8, 13, **kw)
    assert isinstance(m, torch.nn.LinearCrossEntropyLoss)
    assert repr(m) == repr(theirs)
    assert m.state_dict().keys() == theirs.state_dict().keys()
    for name in ("num_classes", "out_features", "reduction", "ignore_index", "label_smoothing", "options"):
        assert getattr(m, name) == getattr(theirs, name), name
    for cls in (fusetrain.nn.LinearCrossEntropyLoss, torch.nn.LinearCrossEntropyLoss):
        with pytest.raises(RuntimeError, match=r"^expected weight shape to be \(13,\), got \(4,\)$"):
            cls(8, 13, weight=torch.ones(4))
        for ls in (-0.1, 1.5):
            with pytest.raises(RuntimeError, match=rf"^expected label_smoothing to be in range \[0, 1\], got {ls}$"):
                cls(8, 13, label_smoothing=ls)


def test_module_with_out_features():
    """out_features (d1, ...): the linear holds C * d1 * ... outputs, the
    loss is the K-dimensional reference's."""
    m = fusetrain.nn.LinearCrossEntropyLoss(8, 13, out_features=(2,), bias=True, reduction="none")
    assert m.linear.weight.shape == (26, 8) and m.linear.bias.shape == (26,)
    x, _, _, t, _ = make_case(10, 8, 13, torch.float32)
    t2 = torch.stack([t, t.flip(0)], 1)
    loss = m(x, t2)
    ref = k_dimensional_reference(x, m.linear.weight.reshape(13, 2, 8), t2,
                                  linear_bias=m.linear.bias.reshape(13, 2), reduction="none")
    assert loss.shape == (10, 2) and torch.equal(loss, ref)


# ------------------------------------------------------------ chunk rule, memory


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunk_rule_matches_the_cpp_rule(dtype, device_type):
    sizes = [(1, 8, 10), (63, 8, 10), (64, 8, 10), (1000, 64, 1000), (8192, 4096, 128256), (4096, 768, 50257),
             (100000, 16, 3), (70000, 1024, 262144), (5, 1, 1), (16384, 4096, 128256), (3000, 64, 1000)]
    for rows, h, c in sizes:
        py = FF._lce_chunk_rows(rows, h, c, dtype, device_type)
        cpp = _C.linear_cross_entropy_chunk_rows(rows, h, c, dtype, device_type)
        assert py == cpp, (rows, h, c, dtype, device_type, py, cpp)
        assert 1 <= py <= rows and (py == rows or py % 64 == 0)
        element = torch.empty((), dtype=dtype).element_size()
        # A chunk's logits and gradient: about the input's memory, at least 64 MiB ...
        memory_rule = max(64, max(rows * h * element, 64 << 20) // (2 * c * element) // 64 * 64)
        # ... and at least 512 rows on the CPU, 2048 on CUDA (the dW GEMM's flops
        # per byte of its fp32 sum: Note [Chunked linear cross-entropy]).
        assert py == min(max(memory_rule, {"cpu": 512, "cuda": 2048}[device_type]), rows)
    # The GPU goal's shape: 256 rows by memory alone.
    assert FF._lce_chunk_rows(16384, 4096, 128256, torch.bfloat16, "cpu") == 512
    assert FF._lce_chunk_rows(16384, 4096, 128256, torch.bfloat16, "cuda") == 2048
    # The CPU benchmark's fp32 shape: 128 rows by memory alone.
    assert FF._lce_chunk_rows(8192, 768, 50257, torch.float32, "cpu") == 512


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_default_chunk_is_left_to_the_op(device):
    """options=None and "auto" chunking without batch_chunk_size give the op
    chunk_rows 0, its own rule for the inputs' device and compute dtype
    (under a FakeTensorMode: no GPU needed, nothing allocated)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []

    class RecordChunkRows(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is FWD:
                calls.append(args[8:11])
            return func(*args, **(kwargs or {}))

    n, h, c = 16384, 64, 128256
    with FakeTensorMode():
        x = torch.empty(n, h, device=device, dtype=torch.bfloat16, requires_grad=True)
        w = torch.empty(c, h, device=device, dtype=torch.bfloat16, requires_grad=True)
        t = torch.zeros(n, dtype=torch.long, device=device)
        with RecordChunkRows():
            FF.linear_cross_entropy(x, w, t)
            FF.linear_cross_entropy(x, w, t, options=FF.LinearCrossEntropyOptions())
            FF.linear_cross_entropy(x, w, t, options=opts(batch_chunk_size=100))
    # options=None: bf16 GEMMs; "auto" acc_policy: float32 on the CPU, bf16 on CUDA.
    assert [tuple(a[:1]) + (list(a[1]), a[2]) for a in calls] == [
        (0, [True, True, False], False), (0, [True, True, False], device == "cpu"),
        (100, [True, True, False], False)]


def default_chunks(device, dtype, options):
    """How many chunks the forward of 3000 rows x 8 features -> 20000
    classes takes (the fused cross-entropy's calls): the rule gives 512 rows
    for float32 GEMMs on the CPU (6 chunks), 832 for 16-bit ones (4), 2048
    on CUDA (2)."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3000, 8, generator=g).to(device, dtype)
    w = (torch.randn(20000, 8, generator=g) / 3).to(device, dtype)
    t = torch.randint(0, 20000, (3000,), generator=g).to(device)
    calls = op_calls(lambda: FF.linear_cross_entropy(x, w, t, options=options))
    return calls.get("fusetrain::softmax_cross_entropy_forward")


def test_default_chunk_follows_the_inputs_device_and_dtype():
    """The op's rule for the CPU, in the dtype the GEMMs run in: float16 is
    computed in float32 on the CPU with options=None (and under "auto"
    acc_policy), bfloat16 in bfloat16 with options=None."""
    assert FF._lce_chunk_rows(3000, 8, 20000, torch.float32, "cpu") == 512
    assert FF._lce_chunk_rows(3000, 8, 20000, torch.bfloat16, "cpu") == 832
    assert default_chunks("cpu", torch.float32, None) == 6
    assert default_chunks("cpu", torch.bfloat16, None) == 4
    assert default_chunks("cpu", torch.float16, None) == 6
    assert default_chunks("cpu", torch.bfloat16, FF.LinearCrossEntropyOptions()) == 6
    assert default_chunks("cpu", torch.bfloat16, opts()) == 4


@pytest.mark.cuda
def test_cuda_default_chunk_follows_the_inputs_device():
    assert FF._lce_chunk_rows(3000, 8, 20000, torch.float32, "cuda") == 2048
    for dtype in DTYPES:
        assert default_chunks("cuda", dtype, None) == 2, dtype


def peak_and_largest(fn):
    """Peak of the bytes live (allocations minus frees) while fn runs, and the
    largest single CPU allocation, from the profiler's memory events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes = [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for s in sizes:
        live += s
        peak = max(peak, live)
    return peak, max(sizes)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("gradients_in_forward", [True, False])
def test_chunked_path_never_holds_the_logits(gradients_in_forward):
    """With 64-row chunks of 2048 rows x 1000 classes, no allocation comes
    near the [N, C] fp32 logits (8 MB): the peak stays within the gradients
    (dx 128 KB, dW fp32 64 KB) and a few chunk-sized [64, C] buffers. The
    reference path (which a K-dimensional weight [C, 1, H] takes), run the
    same way, does allocate them (the measurement sees what it must)."""
    n, h, c = 2048, 16, 1000
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g).requires_grad_()
    w = (torch.randn(c, h, generator=g) / 4).requires_grad_()
    t = torch.randint(0, c, (n,), generator=g)
    logits_bytes = n * c * 4

    def step(o, k_dimensional=False):
        if k_dimensional:
            return lambda: FF.linear_cross_entropy(x, w.reshape(c, 1, h), t.reshape(n, 1), label_smoothing=0.1,
                                                   options=o).backward()
        return lambda: FF.linear_cross_entropy(x, w, t, label_smoothing=0.1, options=o).backward()

    peak, largest = peak_and_largest(step(opts(batch_chunk_size=64, gradients_in_forward=gradients_in_forward)))
    chunk_bytes = 64 * c * 4
    assert largest <= 2 * chunk_bytes, largest
    budget = n * h * 4 + 2 * c * h * 4 + 4 * chunk_bytes  # dx, dW + its fp32 accumulator, 4 chunk buffers
    assert budget < logits_bytes / 4
    assert peak <= budget, peak
    ref_peak, ref_largest = peak_and_largest(step(None, k_dimensional=True))
    assert ref_largest >= logits_bytes and ref_peak >= logits_bytes


@pytest.mark.parametrize("gradients_in_forward", [True, False])
def test_bf16_weight_gradient_sum_takes_four_bytes_a_weight(gradients_in_forward):
    """A bf16 linear's weight gradient is summed in float32 on the CPU as two
    16-bit halves, the high one becoming the gradient (Note [Split float32
    sum]): at 8192 x 1024 weights (bf16 dW 16 MiB) the peak stays under dW's
    two halves plus a GEMM block and chunk buffers, where a float32
    accumulator beside its bf16 rounding would be 48 MiB."""
    n, h, c = 128, 1024, 8192
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, h, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(c, h, generator=g) / 32).bfloat16().requires_grad_()
    t = torch.randint(0, c, (n,), generator=g)
    o = opts(batch_chunk_size=64, gradients_in_forward=gradients_in_forward)
    peak, _ = peak_and_largest(lambda: FF.linear_cross_entropy(x, w, t, options=o).backward())
    dw_bytes = c * h * 2
    block_bytes = 1024 * h * 2  # a GEMM block of dW's rows (4 MiB of float32 / h)
    chunk_bytes = 64 * c * 2
    budget = 2 * dw_bytes + 2 * block_bytes + 4 * chunk_bytes + n * h * 2
    assert budget < 3 * dw_bytes  # the float32 accumulator and its bf16 rounding
    assert peak <= budget, (peak, budget)


# ------------------------------------------------------------- the bound's power


def mutants():
    """Plausible bugs, as the wrong results they would give (each from our
    own correct results, or from the raw op called with the wrong argument)."""
    x, w, b, t, weight = make_case(53, 32, 97, torch.bfloat16, weighted=True)
    kw = dict(weight=weight, reduction="mean", label_smoothing=0.1)
    good = run(ours, x, w, b, t, options=opts(batch_chunk_size=16), **kw)
    kept = (t != -100).sum().item()
    loss, (gx, gw, gb) = good
    up = upstream_for(loss)

    def raw(ls=0.1, wt=weight, bias=b, rows=53):
        """Our loss from the raw forward op with one argument changed."""
        return FWD(x[:rows], w, bias, t[:rows], wt, -100, ls, "mean", 16, list(NO_GRAD), False)[0].to(loss.dtype)

    return {
        "mean over all rows, not the kept ones": (loss * kept / 53, [gx, gw, gb]),
        "unweighted denominator with class weights": (
            (loss * (weight[t.clamp_min(0)] * (t != -100)).sum() / kept).to(loss.dtype), [gx, gw, gb]),
        "label smoothing dropped": (raw(ls=0.0), [gx, gw, gb]),
        "bias dropped": (raw(bias=None), [gx, gw, gb]),
        "class weights dropped": (raw(wt=None), [gx, gw, gb]),
        "last partial chunk dropped (loss)": (raw(rows=48), [gx, gw, gb]),
        "last partial chunk dropped (grad_weight)": (loss, [gx, gw + _chunk_grad_w(x, w, b, t, kw, up), gb]),
        "grad_input of the last chunk zero": (loss, [torch.cat([gx[:48], torch.zeros_like(gx[48:])]), gw, gb]),
        "grad_bias not scaled by the loss gradient": (loss, [gx, gw, (gb.float() / 1.75).to(gb.dtype)]),
        "grad_weight 3% off": (loss, [gx, (gw.float() * 1.03).to(gw.dtype), gb]),
    }, (x, w, b, t, kw)


def _chunk_grad_w(x, w, b, t, kw, up):
    """-(the last partial chunk's part of grad_weight): dropping it from the sum."""
    xs, ts = x[48:].clone(), t[48:].clone()
    # The chunk's contribution to the full loss's gradient: the same rows with
    # the full batch's denominator (weights of the kept rows of all 53 rows).
    weight = kw["weight"]
    den_all = (weight[t.clamp_min(0)] * (t != -100)).sum()
    den_chunk = (weight[ts.clamp_min(0)] * (ts != -100)).sum()
    _, (_, gw_chunk, _) = run(ours, xs, w, b, ts, upstream=up, options=opts(batch_chunk_size=16), **kw)
    return -(gw_chunk.float() * den_chunk / den_all).to(gw_chunk.dtype)


def test_bounds_reject_plausible_bugs():
    """Each of these wrong results fails check_against_reference (the bound
    the value tests use is tight enough to see them); the right one passes."""
    cases, (x, w, b, t, kw) = mutants()
    theirs = run(torch_lce, x, w, b, t, **kw)
    check_against_reference(x, w, b, t, dtype=torch.bfloat16, chunk=16, theirs=theirs, **kw)
    for name, got in cases.items():
        with pytest.raises(AssertionError):
            check_against_reference(x, w, b, t, dtype=torch.bfloat16, chunk=16, got=got, theirs=theirs, **kw)
            pytest.fail(f"not caught: {name}")  # Failed is no AssertionError: it propagates


# ------------------------------------------------------------------ CUDA


CUDA_CASES = {
    # dtype, bias, weighted, reduction, ignore_index, label_smoothing, chunk
    "fp32_mean": (torch.float32, True, False, "mean", None, 0.0, 16),
    "fp32_weighted_sum": (torch.float32, False, True, "sum", 3, 0.1, 7),
    "bf16_none": (torch.bfloat16, True, True, "none", -100, 0.1, 16),
    "bf16_weighted_mean": (torch.bfloat16, True, True, "mean", None, 0.1, None),
    "fp16_mean": (torch.float16, True, False, "mean", 3, 0.1, 1),
    "fp16_none": (torch.float16, False, False, "none", None, 0.0, 64),
}


@pytest.mark.cuda
@pytest.mark.parametrize("gradients_in_forward", [True, False])
@pytest.mark.parametrize("case", CUDA_CASES.values(), ids=CUDA_CASES.keys())
def test_cuda_matches_float64_and_the_cpu(case, gradients_in_forward):
    dtype, bias, weighted, reduction, ignore_index, ls, chunk = case
    x, w, b, t, weight = make_case(200, 64, 999, dtype, bias=bias, weighted=weighted, ignore_index=ignore_index,
                                   seed=11)
    kw = dict(weight=weight, reduction=reduction, ignore_index=ignore_index, label_smoothing=ls)
    o = opts(batch_chunk_size=chunk, gradients_in_forward=gradients_in_forward)
    cpu = run(ours, x, w, b, t, options=o, **kw)
    cuda = lambda v: None if v is None else v.cuda()  # noqa: E731
    kwc = dict(kw, weight=cuda(weight))
    got = run(ours, cuda(x), cuda(w), cuda(b), cuda(t), options=o, **kwc)
    assert got[0].is_cuda and got[0].dtype == dtype and all(g is None or g.is_cuda for g in got[1])
    theirs = run(torch_lce, cuda(x), cuda(w), cuda(b), cuda(t), **kwc)
    # Both sides within the float64 bound: within twice it of each other.
    check_against_reference(x, w, b, t, dtype=dtype, chunk=chunk, got=got, theirs=theirs, **kw)
    (_, _), bounds = lce_bounds(x, w, b, t, weight=weight, reduction=reduction, ignore_index=ignore_index,
                                label_smoothing=ls, dtype=dtype, loss_dtype=dtype,
                                chunk=chunk or FF._lce_chunk_rows(200, 64, 999, dtype, "cuda"))
    for name, a, c, bd in zip(("loss", "grad_input", "grad_weight", "grad_bias"), [got[0], *got[1]],
                              [cpu[0], *cpu[1]], bounds):
        if c is None:
            continue
        diff = (a.cpu().double() - c.double()).abs()
        assert bool((diff <= 2 * bd).all()), f"{name}: CUDA vs CPU {diff.max().item():.3g}"
    ignored = t == (-100 if ignore_index is None else ignore_index)
    assert torch.equal(got[1][0].cpu()[ignored], torch.zeros_like(x[ignored]))


@pytest.mark.cuda
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cuda_all_rows_ignored(reduction):
    x, w, b, t, _ = make_case(20, 8, 11, torch.bfloat16, device="cuda")
    t = torch.full_like(t, -100)
    loss, grads = run(ours, x, w, b, t, reduction=reduction, options=opts(batch_chunk_size=6),
                      upstream=torch.tensor(1.0) if reduction != "none" else torch.ones(20))
    if reduction == "mean":
        assert torch.isnan(loss).item()
    else:
        assert torch.equal(loss.cpu(), torch.zeros(loss.shape, dtype=loss.dtype))
    for g in grads:
        assert torch.equal(g.cpu(), torch.zeros_like(g.cpu()))


@pytest.mark.cuda
def test_cuda_autocast_and_compile():
    x, w, b, t, weight = make_case(64, 32, 300, torch.float32, weighted=True, seed=12, device="cuda")
    kw = dict(weight=weight, reduction="mean", label_smoothing=0.1)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = run(ours, x, w, b, t, options=opts(batch_chunk_size=16), **kw)
        theirs = run(torch_lce, x, w, b, t, **kw)
    assert got[0].dtype == torch.float32 and all(g.dtype == torch.float32 for g in got[1])
    bf = lambda v: v.cpu().to(torch.bfloat16)  # noqa: E731
    (ref_loss, ref_grads), bounds = lce_bounds(bf(x), bf(w), bf(b), t.cpu(), weight=weight.cpu(), reduction="mean",
                                               ignore_index=None, label_smoothing=0.1, dtype=torch.bfloat16,
                                               loss_dtype=torch.float32, chunk=16)
    assert_near_reference("loss", got[0], theirs[0], ref_loss, bounds[0])
    for name, g, tg, rg, bd in zip(GRAD_NAMES, got[1], theirs[1], ref_grads, bounds[1:]):
        assert_near_reference(name, g, tg, rg, bd)

    def step(x, w, b, t):
        return FF.linear_cross_entropy(x, w, t, linear_bias=b, **kw, options=opts(batch_chunk_size=16))

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    a = run(lambda x, w, t, linear_bias, **_: compiled(x, w, linear_bias, t), x, w, b, t)
    e = run(lambda x, w, t, linear_bias, **_: step(x, w, linear_bias, t), x, w, b, t)
    assert torch.equal(a[0], e[0]) and all(torch.equal(p, q) for p, q in zip(a[1], e[1]))


@pytest.mark.cuda
def test_cuda_never_holds_the_logits():
    """2048 rows x 32000 classes in bf16: the [N, C] fp32 logits would be
    250 MiB; with 128-row chunks the extra peak stays within the gradients
    and a few chunk buffers."""
    n, h, c = 2048, 256, 32000
    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(c, h, device="cuda") / 16).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, c, (n,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    FF.linear_cross_entropy(x, w, t, options=opts(batch_chunk_size=128)).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    grads = n * h * 2 + c * h * (2 + 4)  # dx, dW and its fp32 accumulator
    assert extra < grads + 8 * 128 * c * 4 < n * c * 4 / 2, extra


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_wide_float32_logits_by_class_blocks(dtype):
    """At 512 features and more a CPU float32 chunk builds its logits from
    blocks of 1024 classes (chunk_logits in csrc/ops/linear_cross_entropy.cpp):
    2500 classes (two whole blocks and a tail) with a bias, float32 and bf16
    "accurate" (float32 compute), against float64 arithmetic on the same
    values: a misplaced block or a lost bias is off by O(1)."""
    g = torch.Generator().manual_seed(21)
    x = torch.randn(24, 512, generator=g).to(dtype)
    w = (torch.randn(2500, 512, generator=g) / 512**0.5).to(dtype)
    b = torch.randn(2500, generator=g).to(dtype)
    t = torch.randint(0, 2500, (24,), generator=g)
    # (acc_policy "accurate" with acc_dtype None would be bf16 accumulation,
    # torch's rule: float32 is named.)
    o = FF.LinearCrossEntropyOptions(acc_policy="accurate", acc_dtype=torch.float32, batch_chunk_size=10)
    leaves = [v.clone().requires_grad_() for v in (x, w, b)]
    loss = FF.linear_cross_entropy(leaves[0], leaves[1], t, linear_bias=leaves[2], options=o)
    loss.backward()
    ref_leaves = [v.double().requires_grad_() for v in (x, w, b)]
    ref = F.cross_entropy(F.linear(*ref_leaves), t)
    ref.backward()
    # Rounded to the input dtype once (half its eps), after float32 sums of
    # up to 512 terms (their error grows as sqrt(n) eps32 ~ 23 eps32: 64 is
    # the margin); a misplaced block errs by the gradients' own size.
    tol = torch.finfo(dtype).eps / 2 + 64 * torch.finfo(torch.float32).eps
    assert abs(loss.double().item() - ref.item()) <= tol * abs(ref.item())
    for got, want in zip(leaves, ref_leaves):
        err = (got.grad.double() - want.grad).abs().max().item()
        assert err <= tol * want.grad.abs().max().item(), err
