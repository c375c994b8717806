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
    """input [..., in_features] with target [...]: the leading dimensions are
    the rows; a 1-D input is one row with a 0-d target."""
    batch_shape = {"2d": (30,), "3d": (3, 7), "1d": ()}[shape]
    x, w, b, t, weight = make_case(None, 24, 40, dtype, batch_shape=batch_shape, seed=3)
    if shape == "1d":
        t = torch.tensor(5)  # not ignored
    kw = dict(weight=weight, reduction=reduction, label_smoothing=0.1)
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
    rounding, so both are held to the float64 bound instead."""
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
    for name, a, c in zip(GRAD_NAMES, g1, g2):
        assert torch.equal(a, c), name


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


# ---------------------------------------------------- paths and exact equalities


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shape", ["2d", "3d"])
def test_chunking_none_is_the_reference_exactly(shape, reduction):
    batch_shape = (25,) if shape == "2d" else (5, 5)
    x, w, b, t, weight = make_case(None, 16, 30, torch.bfloat16, batch_shape=batch_shape, weighted=True)
    weight = weight.bfloat16()  # the reference path is F.cross_entropy's: the logits' dtype
    kw = dict(weight=weight, reduction=reduction, ignore_index=-100, label_smoothing=0.1)
    got = run(ours, x, w, b, t, options=opts(chunking_method="none"), **kw)
    ref = run(torch_lce, x, w, b, t, **kw)
    assert torch.equal(got[0], ref[0])
    for a, c in zip(got[1], ref[1]):
        assert torch.equal(a, c)


@pytest.mark.parametrize("shape", ["2d", "3d"])
def test_probability_targets_warn_and_take_the_reference_path(shape):
    batch_shape = (12,) if shape == "2d" else (3, 4)
    x, w, b, _, _ = make_case(None, 8, 10, torch.float32, batch_shape=batch_shape)
    probs = torch.softmax(torch.randn(*batch_shape, 10), -1)
    xs = x.clone().requires_grad_()
    with pytest.warns(UserWarning, match="class-probability targets take the reference path"):
        loss = FF.linear_cross_entropy(xs, w, probs, linear_bias=b, label_smoothing=0.1)
    loss.backward()
    xr = x.clone().requires_grad_()
    ref = F.cross_entropy(F.linear(xr, w, b).reshape(-1, 10), probs.reshape(-1, 10), label_smoothing=0.1)
    ref.backward()
    assert torch.equal(loss, ref) and torch.equal(xs.grad, xr.grad)
    # chunking_method="none" asked for the reference: no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FF.linear_cross_entropy(x, w, probs, linear_bias=b, options=opts(chunking_method="none"))


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
    classes: 512-row chunks, not the whole batch) and gradients_in_forward:
    with_grad in the forward, or the backward op in the backward graph."""
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
    chunk_rows, with_grad = forward[0].args[8:10]
    assert chunk_rows == _C.linear_cross_entropy_chunk_rows(n, h, c, torch.float32, "cpu") == 512
    assert with_grad == gradients_in_forward
    assert len(backward) == (0 if gradients_in_forward else 1)
    if backward:
        assert backward[0].args[11] == 512


COMPILE_CASES = {
    # dtype, batch shape, bias, weighted, reduction, ignore_index, chunk, gradients_in_forward, autocast
    "fp32_weighted_mean": (torch.float32, (40,), True, True, "mean", None, 7, True, False),
    "bf16_3d_none": (torch.bfloat16, (4, 9), False, False, "none", 3, 5, True, False),
    "autocast_sum_in_backward": (torch.float32, (33,), True, False, "sum", -100, None, False, True),
}


@pytest.mark.parametrize("case", COMPILE_CASES.values(), ids=COMPILE_CASES.keys())
def test_torch_compile_matches_eager_bitwise(case):
    """torch.compile (fullgraph: no graph break) traces the Python autograd
    Function into the same two ops the C++ Function calls: the same bits."""
    dtype, batch_shape, bias, weighted, reduction, ignore_index, chunk, gif, autocast = case
    x, w, b, t, weight = make_case(None, 16, 37, dtype, batch_shape=batch_shape, bias=bias, weighted=weighted,
                                   ignore_index=ignore_index, seed=7)
    o = opts(batch_chunk_size=chunk, gradients_in_forward=gif)

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


def test_reference_path_is_twice_differentiable():
    """chunking_method="none" is torch's own ops: twice differentiable, like torch."""
    x, w, b, t, _ = make_case(6, 4, 5, torch.float32)
    xs = x.clone().requires_grad_()
    loss = FF.linear_cross_entropy(xs, w, t, linear_bias=b, options=opts(chunking_method="none"))
    (g,) = torch.autograd.grad(loss, xs, create_graph=True)
    (h,) = torch.autograd.grad(g.sum(), xs)
    assert torch.isfinite(h).all() and h.abs().sum() > 0



def test_retain_graph_needs_the_recomputing_backward():
    """The eager path hands the gradients it computed in the forward to the
    backward (rescaled in place, not copied): a second backward through the
    same graph is an error naming the option that allows it, and with that
    option both backwards give the same gradients (a scale of 2 on the
    second: the accumulated sum)."""
    x, w, b, t, _ = make_case(20, 8, 11, torch.float32)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = FF.linear_cross_entropy(xs, ws, t, linear_bias=b)
    loss.backward(retain_graph=True)
    first = ws.grad.clone()
    with pytest.raises(RuntimeError, match="retain_graph=True.*gradients_in_forward = false"):
        loss.backward()
    ws.grad = None
    loss = FF.linear_cross_entropy(xs, ws, t, linear_bias=b, options=opts(gradients_in_forward=False))
    loss.backward(retain_graph=True)
    torch.testing.assert_close(ws.grad, first, rtol=1e-6, atol=1e-7)
    loss.backward(torch.tensor(0.5))
    torch.testing.assert_close(ws.grad, first * 1.5, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("gradients_in_forward", [True, False], ids=["grads_in_forward", "grads_in_backward"])
@pytest.mark.parametrize("path", ["cpp_function", "python_function"])
def test_double_backward_raises_a_clear_error(path, gradients_in_forward):
    x, w, b, t, _ = make_case(6, 4, 5, torch.float32)
    xs = x.clone().requires_grad_()
    if path == "cpp_function":
        loss = FF.linear_cross_entropy(xs, w, t, linear_bias=b, options=opts(gradients_in_forward=gradients_in_forward))
    else:  # what torch.compile traces
        loss = FF._LinearCrossEntropy.apply(xs, w, b, t, None, -100, 0.0, "mean", 4, gradients_in_forward)
    # A Hessian-vector product of a loss with another term in x: the
    # first-order gradient requires grad through (x ** 3).sum(). The error
    # may come at the create_graph=True backward or at the second one.
    total = loss + (xs**3).sum()
    with pytest.raises(RuntimeError, match=r"(?i)twice|double.backward|second.order|once_differentiable"):
        (g,) = torch.autograd.grad(total, xs, create_graph=True)
        torch.autograd.grad(g.sum(), xs)


# ------------------------------------------------------------------ the ops


def op_args(dtype=torch.float32, *, bias=True, weighted=True, reduction="mean", with_grad=True, n=10, h=8, c=7,
            device="cpu"):
    x, w, b, t, weight = make_case(n, h, c, dtype, bias=bias, weighted=weighted, device=device)
    return (x, w, b, t, weight, -100, 0.1, reduction, 3, with_grad)


OPCHECK_CASES = {
    "mean_with_grad": dict(),
    "sum_bf16_no_bias": dict(dtype=torch.bfloat16, bias=False, reduction="sum", weighted=False),
    "none_no_grad": dict(reduction="none", with_grad=False),
    "mean_no_grad": dict(with_grad=False, weighted=False),
}


@pytest.mark.parametrize("case", OPCHECK_CASES.values(), ids=OPCHECK_CASES.keys())
def test_opcheck(case):
    """Schema (no aliasing or mutation the schema does not declare) and
    FakeTensor (the Meta kernels agree with the CPU ones) for both ops."""
    args = op_args(**case)
    torch.library.opcheck(FWD, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
    x, w, b, t, weight, ii, ls, reduction, chunk, _ = args
    loss, lse, denominator, *_ = FWD(x, w, b, t, weight, ii, ls, reduction, chunk, False)
    grad = upstream_for(loss).float()
    for mask in ([True, True, True], [False, True, False]):
        torch.library.opcheck(BWD, (grad, x, w, b, t, weight, lse, denominator, ii, ls, reduction, chunk, mask),
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))



def test_opcheck_autograd_registration():
    x, w, b, t, weight, *rest = op_args()
    args = (x.requires_grad_(), w.requires_grad_(), b, t, weight, *rest)
    torch.library.opcheck(FWD, args, test_utils=("test_autograd_registration",))


def test_op_outputs():
    x, w, b, t, weight, ii, ls, _, chunk, _ = op_args(torch.bfloat16, n=13)
    kept = t != ii
    for reduction in REDUCTIONS:
        with_grad = reduction != "none"
        loss, lse, den, gi, gw, gb = FWD(x, w, b, t, weight, ii, ls, reduction, chunk, with_grad)
        assert loss.dtype == torch.float32 and loss.shape == ((13,) if reduction == "none" else ())
        z = F.linear(x.double(), w.double(), b.double())
        torch.testing.assert_close(lse, torch.logsumexp(z, 1).float(), rtol=2.0**-7, atol=0.05)
        expected_den = (weight[t.clamp_min(0)] * kept).sum() if reduction == "mean" else torch.tensor(1.0)
        assert den.dtype == torch.float32 and den.shape == () and den.item() == expected_den.item()
        if with_grad:
            assert (gi.shape, gw.shape, gb.shape) == (x.shape, w.shape, b.shape)
            assert gi.dtype == gw.dtype == gb.dtype == torch.bfloat16
        else:
            assert gi.numel() == gw.numel() == gb.numel() == 0
    with pytest.raises(RuntimeError, match="with_grad needs a scalar loss"):
        FWD(x, w, b, t, weight, ii, ls, "none", chunk, True)
    # The backward divides "mean" by the denominator it is given.
    loss, lse, den, *_ = FWD(x, w, b, t, weight, ii, ls, "mean", chunk, False)
    g1 = BWD(torch.tensor(1.0), x, w, b, t, weight, lse, den, ii, ls, "mean", chunk, [True, True, True])
    g2 = BWD(torch.tensor(1.0), x, w, b, t, weight, lse, den * 2, ii, ls, "mean", chunk, [True, True, True])
    for a, c in zip(g1, g2):
        torch.testing.assert_close(c.float(), a.float() / 2, rtol=2.0**-7, atol=0)
    gi, gw, gb = BWD(torch.tensor(1.0), x, w, None, t, weight, lse, den, ii, ls, "mean", chunk, [False, True, True])
    assert gi.numel() == 0 and gw.shape == w.shape and gb.numel() == 0
    with pytest.raises(RuntimeError, match="grad_loss must have shape"):
        BWD(torch.ones(3), x, w, b, t, weight, lse, den, ii, ls, "none", chunk, [True, True, True])


@pytest.mark.parametrize("bias", [False, True])
def test_meta_shapes(bias):
    x, w, b, t, weight, ii, ls, _, chunk, _ = op_args(torch.bfloat16, bias=bias, n=7, h=11, c=5, device="meta")
    for reduction in REDUCTIONS:
        for with_grad in ([False] if reduction == "none" else [False, True]):
            loss, lse, den, gi, gw, gb = FWD(x, w, b, t, weight, ii, ls, reduction, chunk, with_grad)
            assert loss.shape == ((7,) if reduction == "none" else ()) and loss.dtype == torch.float32
            assert lse.shape == (7,) and den.shape == () and lse.device.type == "meta"
            assert gi.shape == ((7, 11) if with_grad else (0,)) and gi.dtype == torch.bfloat16
            assert gw.shape == ((5, 11) if with_grad else (0,)) and gw.dtype == torch.bfloat16
            assert gb.shape == ((5,) if with_grad and bias else (0,))
            grad = torch.empty(loss.shape, device="meta")
            for mask in ([True, True, True], [True, False, False]):
                gi, gw, gb = BWD(grad, x, w, b, t, weight, lse, den, ii, ls, reduction, chunk, mask)
                assert gi.shape == ((7, 11) if mask[0] else (0,)) and gi.device.type == "meta"
                assert gw.shape == ((5, 11) if mask[1] else (0,))
                assert gb.shape == ((5,) if mask[2] and bias else (0,))



@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_functional_and_module_on_meta_tensors(reduction):
    xm = torch.empty(3, 4, 11, device="meta", dtype=torch.bfloat16)
    tm = torch.empty(3, 4, device="meta", dtype=torch.long)
    ref = FF.linear_cross_entropy(xm, torch.empty(5, 11, device="meta", dtype=torch.bfloat16), tm,
                                  reduction=reduction, options=opts(chunking_method="none"))
    m = fusetrain.nn.LinearCrossEntropyLoss(11, 5, bias=True, device="meta", dtype=torch.bfloat16,
                                            reduction=reduction)
    out = m(xm, tm)
    assert out.shape == ref.shape == ((3, 4) if reduction == "none" else ())
    assert out.dtype == torch.bfloat16 and out.device.type == "meta"


# ------------------------------------------------------------------ errors


def test_out_of_range_target_names_the_index_and_the_value():
    x, w, b, t, _ = make_case(10, 8, 13, torch.float32, ignore_index=None)
    for bad in (13, -1, -7):
        tb = t.clone()
        tb[6] = bad
        with pytest.raises(IndexError, match=rf"target\[6\] = {bad}"):
            FF.linear_cross_entropy(x, w, tb)
    # -100 is a class index like any other when ignore_index is 3.
    with pytest.raises(IndexError, match=r"target\[0\] = -100"):
        FF.linear_cross_entropy(x, w, t, ignore_index=3)
    # A 3-D batch: the index is the flattened row's.
    t3 = t.reshape(2, 5).clone()
    t3[1, 2] = 99
    with pytest.raises(IndexError, match=r"target\[7\] = 99"):
        FF.linear_cross_entropy(x.reshape(2, 5, 8), w, t3)
    # The backward op checks too (it is called with the forward's targets).
    _, lse, den, *_ = FWD(x, w, None, t, None, -100, 0.0, "mean", 4, False)
    tb = t.clone()
    tb[2] = 50
    with pytest.raises(IndexError, match=r"target\[2\] = 50"):
        BWD(torch.tensor(1.0), x, w, None, tb, None, lse, den, -100, 0.0, "mean", 4, [True, True, True])


def test_argument_errors_name_what_is_wrong():
    x, w, b, t, _ = make_case(10, 8, 13, torch.float32)
    with pytest.raises(RuntimeError, match=r"10, 8.*13, 5|13, 5.*10, 8"):
        FF.linear_cross_entropy(x, w[:, :5], t)
    with pytest.raises(RuntimeError, match=r"(?i)float.*double|double.*float"):
        FF.linear_cross_entropy(x, w.double(), t)
    with pytest.raises(RuntimeError, match=r"(?i)bfloat16.*float|float.*bfloat16"):
        FF.linear_cross_entropy(x.bfloat16(), w, t)
    with pytest.raises(RuntimeError, match=r"linear_bias must have shape \[13\]"):
        FF.linear_cross_entropy(x, w, t, linear_bias=b[:4])
    with pytest.raises(RuntimeError, match=r"linear_bias is"):
        FF.linear_cross_entropy(x, w, t, linear_bias=b.bfloat16())
    with pytest.raises(RuntimeError, match=r"weight \(class weights\) must have shape \[13\]"):
        FF.linear_cross_entropy(x, w, t, weight=torch.ones(4))
    with pytest.raises(ValueError, match=r"needs target of shape \(10,\).*got \(5,\)"):
        FF.linear_cross_entropy(x, w, t[:5])
    with pytest.raises(ValueError, match=r"needs target of shape \(2, 5\)"):
        FF.linear_cross_entropy(x.reshape(2, 5, 8), w, t)
    with pytest.raises(TypeError, match="integer class indices"):
        FF.linear_cross_entropy(x, w, t.bool())
    with pytest.raises(ValueError, match='reduction must be "mean", "sum" or "none", got "avg"'):
        FF.linear_cross_entropy(x, w, t, reduction="avg")
    for ls in (-0.1, 1.5):
        with pytest.raises(ValueError, match=rf"label_smoothing must be in \[0, 1\], got {ls}"):
            FF.linear_cross_entropy(x, w, t, label_smoothing=ls)
    with pytest.raises(ValueError, match=r"chunking_method must be \"auto\" or \"none\", got 'chunked'"):
        FF.LinearCrossEntropyOptions(chunking_method="chunked")
    for bad in (0, -3):
        with pytest.raises(ValueError, match=rf"batch_chunk_size must be at least 1, got {bad}"):
            FF.LinearCrossEntropyOptions(batch_chunk_size=bad)
    with pytest.raises(ValueError, match="feature dimension"):
        FF.linear_cross_entropy(torch.tensor(1.0), w, torch.tensor(1))
    # The raw op's own checks.
    with pytest.raises(RuntimeError, match="chunk_rows must be at least 1, got 0"):
        FWD(x, w, b, t, None, -100, 0.0, "mean", 0, False)
    with pytest.raises(RuntimeError, match="input must be float32, float16 or bfloat16"):
        FWD(x.double(), w.double(), None, t, None, -100, 0.0, "mean", 4, False)
    with pytest.raises(RuntimeError, match="target must be int64"):
        FWD(x, w, b, t.int(), None, -100, 0.0, "mean", 4, False)


def test_integer_targets_of_other_dtypes():
    x, w, b, t, _ = make_case(12, 8, 13, torch.float32, ignore_index=3)
    ref = FF.linear_cross_entropy(x, w, t, linear_bias=b, ignore_index=3)
    for dtype in (torch.int32, torch.uint8):
        assert torch.equal(FF.linear_cross_entropy(x, w, t.to(dtype), linear_bias=b, ignore_index=3), ref)


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
    assert "in_features=8, num_classes=13, bias=True, reduction='sum'" in r
    assert "(linear): Linear(in_features=8, out_features=13, bias=True)" in r
    assert fusetrain.nn.LinearCrossEntropyOptions is FF.LinearCrossEntropyOptions
    assert fusetrain.nn.linear_cross_entropy is FF.linear_cross_entropy


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
def test_default_chunk_follows_the_inputs_device(device):
    """The C++ face picks the rule of the inputs' device: under a
    FakeTensorMode (no GPU needed, nothing allocated) 16384 x 64 -> 128256
    bf16 rows go to the op in 512-row chunks on the CPU, 2048 on CUDA."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    chunks = []

    class RecordChunkRows(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is FWD:
                chunks.append(args[8])
            return func(*args, **(kwargs or {}))

    n, h, c = 16384, 64, 128256
    with FakeTensorMode():
        x = torch.empty(n, h, device=device, dtype=torch.bfloat16, requires_grad=True)
        w = torch.empty(c, h, device=device, dtype=torch.bfloat16, requires_grad=True)
        t = torch.zeros(n, dtype=torch.long, device=device)
        with RecordChunkRows():
            FF.linear_cross_entropy(x, w, t)
    expected = {"cpu": 512, "cuda": 2048}[device]
    assert chunks == [expected] == [FF._lce_chunk_rows(n, h, c, torch.bfloat16, device)]


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
    reference path, run the same way, does allocate them (the measurement
    sees what it must)."""
    n, h, c = 2048, 16, 1000
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g).requires_grad_()
    w = (torch.randn(c, h, generator=g) / 4).requires_grad_()
    t = torch.randint(0, c, (n,), generator=g)
    logits_bytes = n * c * 4

    def step(o):
        return lambda: FF.linear_cross_entropy(x, w, t, label_smoothing=0.1, options=o).backward()

    peak, largest = peak_and_largest(step(opts(batch_chunk_size=64, gradients_in_forward=gradients_in_forward)))
    chunk_bytes = 64 * c * 4
    assert largest <= 2 * chunk_bytes, largest
    budget = n * h * 4 + 2 * c * h * 4 + 4 * chunk_bytes  # dx, dW + its fp32 accumulator, 4 chunk buffers
    assert budget < logits_bytes / 4
    assert peak <= budget, peak
    ref_peak, ref_largest = peak_and_largest(step(opts(chunking_method="none")))
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
        return FWD(x[:rows], w, bias, t[:rows], wt, -100, ls, "mean", 16, False)[0].to(loss.dtype)

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
