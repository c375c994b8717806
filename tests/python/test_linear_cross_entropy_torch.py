"""fusetrain.nn.functional.linear_cross_entropy, fusetrain.nn.LinearCrossEntropyLoss
and LinearCrossEntropyOptions against torch's own (torch 2.13+), call for call.

Every case runs ours and torch's on the same inputs (ours with options X,
torch with the torch options of the same fields) and a float64 reference
(torch's function, options=None, on float64 copies of the same dtype-rounded
inputs). Values and gradients are held, elementwise, to

    |ours - ref64| <= 2 |torch - ref64| + FLOOR_UNITS u max |ref64|

(u the dtype's unit roundoff): no worse than torch's own error in that dtype
at that element, up to a few roundoffs of the tensor's magnitude (about 2e-6
relative for float32, 3e-14 for float64). A wrong denominator, a dropped term
or a lost chunk is far outside that. Where ours runs the same ops as torch's
reference (K-dimensional weights, probability targets with options=None) the
results must be bit-equal.

Deliberate differences, not tested as equalities: options=None is
fusetrain's chunked path, not torch's reference (same values and autograd,
other rounding); with options given ours computes label smoothing chunked
(torch falls back to its reference with a warning), takes the reference for
probability targets (with a warning; torch chunks them) and follows autocast;
where torch's chunked path fails by accident (an IndexError from its
class-weight gather, a slice error for a short target) ours raises the
reference's error.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

if not hasattr(F, "linear_cross_entropy"):  # torch < 2.13
    pytest.skip("torch.nn.functional.linear_cross_entropy needs torch 2.13+", allow_module_level=True)

import fusetrain.nn  # noqa: E402
from fusetrain.nn import functional as FF  # noqa: E402

TorchOptions = torch.nn.LinearCrossEntropyOptions
Options = FF.LinearCrossEntropyOptions

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
REDUCTIONS = ["mean", "sum", "none"]
UNIT = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# Measured need on this grid (x86 CPU): float64 18, float32 11, bfloat16 1.3,
# float16 1.7 units; the floors leave room for other CPUs' GEMM kernels.
FLOOR_UNITS = {torch.float64: 256.0, torch.float32: 32.0, torch.bfloat16: 4.0, torch.float16: 4.0}
GRAD_NAMES = ("grad_input", "grad_linear_weight", "grad_linear_bias")

OPTIONS = {
    "none": None,
    "default": Options(),
    "chunk7": Options(batch_chunk_size=7),
    "aspect_ratio2": Options(chunking_method="aspect_ratio:2"),
    "one_chunk": Options(chunking_method=None),
    "accurate": Options(acc_policy="accurate"),
    "compact": Options(acc_policy="compact"),
    "chunk7_grads_in_backward": Options(batch_chunk_size=7, gradients_in_forward=False),
    "retain_chunk7": Options(allow_retain_graph=True, batch_chunk_size=7),
}
# (ignore_index, label_smoothing, bias, class weights). ignore_index: (as
# passed, what the targets hold on every 4th row). Every combination for the
# options most used; for the others every pair of values of any two of the
# four, in 6 cases.
IGNORE = {
    "ignNone": (None, None),
    "ignNone_-100present": (None, -100),
    "ign3": (3, 3),
}
FULL_CASES = {
    f"{ik}_ls{ls}_{'bias' if bias else 'nobias'}_{'weighted' if wt else 'unweighted'}": (iv, ls, bias, wt)
    for ik, iv in IGNORE.items() for ls in (0.0, 0.1) for bias in (False, True) for wt in (False, True)
}
PAIRWISE_CASES = {
    "ignNone_ls0.0_nobias_unweighted": ((None, None), 0.0, False, False),
    "ignNone_ls0.1_bias_weighted": ((None, None), 0.1, True, True),
    "ignNone_-100present_ls0.0_bias_unweighted": ((None, -100), 0.0, True, False),
    "ign-100_-100present_ls0.1_nobias_weighted": ((-100, -100), 0.1, False, True),
    "ign3_ls0.0_nobias_weighted": ((3, 3), 0.0, False, True),
    "ign3_ls0.1_bias_unweighted": ((3, 3), 0.1, True, False),
}
FULL_GRID_OPTIONS = ("none", "default", "chunk7")
GRID = [
    pytest.param(OPTIONS[name], case, id=f"{name}-{cid}")
    for name in OPTIONS
    for cid, case in (FULL_CASES if name in FULL_GRID_OPTIONS else PAIRWISE_CASES).items()
]


def torch_options(options):
    """torch's LinearCrossEntropyOptions with the same fields as ours (ours
    has one more, gradients_in_forward, which torch has no counterpart of)."""
    if options is None:
        return None
    return TorchOptions(**{f.name: getattr(options, f.name) for f in dataclasses.fields(TorchOptions)})


# ------------------------------------------------------------------ helpers


def make_case(rows, h, c, dtype, *, bias=True, weighted=False, ignored=None, seed=0):
    """input [rows, h] ([h] and a 0-d target when rows is None), linear_weight
    [c, h], linear_bias [c], target, class weights [c]. Every 5th row from the
    2nd targets class 3 and every 4th row `ignored` (when given; the one
    target when unbatched). Class weights are multiples of 1/8 in [1/8, 2] in
    the input's dtype (torch's reference wants the logits' dtype), exact."""
    g = torch.Generator().manual_seed(seed)
    lead = () if rows is None else (rows,)
    x = torch.randn(*lead, h, generator=g).to(dtype)
    # Logits of std ~2 plus a bias of std 1: a peaked softmax.
    w = (torch.randn(c, h, generator=g) * (2.0 / math.sqrt(h))).to(dtype)
    b = torch.randn(c, generator=g).to(dtype) if bias else None
    t = torch.randint(0, c, lead, generator=g)
    if rows is not None:
        t[1::5] = 3
        if ignored is not None:
            t[::4] = ignored
    elif ignored is not None:
        t.fill_(ignored)
    weight = (torch.randint(1, 17, (c,), generator=g) / 8).to(dtype) if weighted else None
    return x, w, b, t, weight


def upstream_for(loss, seed=1):
    """A loss gradient other than 1: 1.75 for a scalar, multiples of 1/8 in
    [-2, 2] for "none" (exact in every dtype)."""
    if loss.dim() == 0:
        return torch.tensor(1.75, dtype=loss.dtype)
    g = torch.randint(-16, 17, loss.shape, generator=torch.Generator().manual_seed(seed)) / 8
    return g.to(loss.dtype)


def run(fn, x, w, b, t, *, cast=None, upstream=None, **kw):
    """The loss and the gradients of (input, linear_weight, linear_bias) for
    upstream_for(loss); `cast` converts the inputs (and class weights) first."""
    leaves = [None if v is None else (v.to(cast) if cast else v).detach().clone().requires_grad_()
              for v in (x, w, b)]
    if cast is not None and kw.get("weight") is not None:
        kw["weight"] = kw["weight"].to(cast)
    if cast is not None and t.is_floating_point():
        t = t.to(cast)
    with warnings.catch_warnings():
        # torch's chunked path warns where it falls back to its reference
        # (label smoothing); ours where it takes the reference (probabilities).
        warnings.simplefilter("ignore", UserWarning)
        loss = fn(leaves[0], leaves[1], t, linear_bias=leaves[2], **kw)
    up = upstream_for(loss) if upstream is None else upstream.to(loss.dtype)
    needed = [v for v in leaves if v is not None]
    grads = iter(torch.autograd.grad(loss, needed, up))
    return loss.detach(), [None if v is None else next(grads) for v in leaves]


def run_three(x, w, b, t, options, **kw):
    """(ours with `options`, torch's with the same torch options, the float64
    reference): each (loss, [grad_input, grad_linear_weight, grad_linear_bias])."""
    ours = run(FF.linear_cross_entropy, x, w, b, t, options=options, **kw)
    theirs = run(F.linear_cross_entropy, x, w, b, t, options=torch_options(options), **kw)
    ref = run(F.linear_cross_entropy, x, w, b, t, cast=torch.float64, options=None, **kw)
    return ours, theirs, ref


def assert_no_worse_than_torch(what, ours, theirs, ref, dtype):
    """Elementwise |ours - ref| <= 2 |torch - ref| + FLOOR_UNITS u max|ref|,
    the same dtype and shape as torch's, NaN exactly where the reference is
    NaN (a "mean" over no kept row). Where torch's own result is not finite
    but the reference is (its chunked path's gradients of a "mean" over no
    kept row), ours is held to the floor alone."""
    assert ours.dtype == theirs.dtype, f"{what}: dtype {ours.dtype}, torch's {theirs.dtype}"
    assert ours.shape == theirs.shape == ref.shape, (
        f"{what}: shape {tuple(ours.shape)}, torch's {tuple(theirs.shape)}")
    o, th = ours.double(), theirs.double()
    nan = ref.isnan()
    assert torch.equal(o.isnan(), nan), (
        f"{what}: NaN at {o.isnan().nonzero().flatten().tolist()}, the reference's at "
        f"{nan.nonzero().flatten().tolist()}")
    finite_ref = ref[~nan]
    scale = finite_ref.abs().max().item() if finite_ref.numel() else 0.0
    floor = FLOOR_UNITS[dtype] * UNIT[dtype] * max(scale, 1e-30)
    err = torch.where(nan, 0.0, (o - ref).abs())
    torch_err = torch.where(nan | ~th.isfinite(), 0.0, (th - ref).abs())
    allowed = 2 * torch_err + floor
    bad = ~(err <= allowed)
    if bad.any():
        ratio = torch.where(bad, err / allowed, 0.0)
        i = int(ratio.flatten().argmax())
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {err.numel()} elements past 2 x torch's error + floor; worst at flat "
            f"index {i}: ours {o.flatten()[i].item()!r}, torch {th.flatten()[i].item()!r}, float64 "
            f"{ref.flatten()[i].item()!r}, allowed {allowed.flatten()[i].item():.3g} "
            f"({ratio.flatten()[i].item():.3g}x)")


def assert_same_results(got, theirs, ref, dtype):
    (loss, grads), (tloss, tgrads), (rloss, rgrads) = got, theirs, ref
    assert_no_worse_than_torch("loss", loss, tloss, rloss, dtype)
    for name, g, tg, rg in zip(GRAD_NAMES, grads, tgrads, rgrads):
        assert (g is None) == (tg is None) == (rg is None), name
        if g is not None:
            assert_no_worse_than_torch(name, g, tg, rg, dtype)


def assert_bitwise(got, theirs):
    """Loss and gradients: the same dtype, shape and values bit for bit."""
    (loss, grads), (tloss, tgrads) = got, theirs
    for name, a, e in zip(("loss",) + GRAD_NAMES, [loss, *grads], [tloss, *tgrads]):
        assert (a is None) == (e is None), name
        if a is not None:
            assert a.dtype == e.dtype and a.shape == e.shape, f"{name}: {a.dtype} {a.shape}, {e.dtype} {e.shape}"
            same = torch.equal(a, e) or (torch.equal(a.isnan(), e.isnan())
                                         and torch.equal(a.nan_to_num(), e.nan_to_num()))
            assert same, f"{name}: ours {a}, torch's {e}"


# ------------------------------------------------- values and gradients, grid


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize(("options", "case"), GRID)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_torch(dtype, options, case, reduction):
    (ignore_index, ignored), label_smoothing, bias, weighted = case
    # 37 rows: chunks of 7 leave a partial one; 150 classes over 24 features
    # make torch's aspect_ratio:2 chunks 4 rows.
    x, w, b, t, weight = make_case(37, 24, 150, dtype, bias=bias, weighted=weighted, ignored=ignored)
    got, theirs, ref = run_three(x, w, b, t, options, weight=weight, reduction=reduction,
                                 ignore_index=ignore_index, label_smoothing=label_smoothing)
    assert got[0].shape == ((37,) if reduction == "none" else ())
    assert_same_results(got, theirs, ref, dtype)


UNBATCHED_OPTIONS = ("none", "default", "chunk7_grads_in_backward", "compact")


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("options", [OPTIONS[k] for k in UNBATCHED_OPTIONS], ids=UNBATCHED_OPTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unbatched_input_matches_torch(dtype, options, reduction):
    """input [H] and a 0-d target: a 0-d loss, as torch's."""
    x, w, b, t, weight = make_case(None, 24, 150, dtype, weighted=True)
    got, theirs, ref = run_three(x, w, b, t, options, weight=weight, reduction=reduction, label_smoothing=0.1)
    assert got[0].shape == () and t.shape == ()
    assert_same_results(got, theirs, ref, dtype)


ALL_IGNORED_OPTIONS = {
    "none": None,
    "default": Options(),
    "compact": Options(acc_policy="compact"),
    "accurate": Options(acc_policy="accurate"),
    "compact_grads_in_backward": Options(acc_policy="compact", gradients_in_forward=False),
}


@pytest.mark.parametrize("unbatched", [False, True], ids=["batched", "unbatched"])
@pytest.mark.parametrize("dtype_options", [
    pytest.param((dtype, o), id=f"{str(dtype)[6:]}-{name}")
    for dtype in DTYPES for name, o in ALL_IGNORED_OPTIONS.items()])
def test_mean_over_no_kept_row(dtype_options, unbatched):
    """Every target ignored: a NaN "mean" (0 / 0) and zero gradients, as
    torch's reference (torch's chunked path gives NaN gradients there; ours
    keeps the reference's zeros on every path)."""
    dtype, options = dtype_options
    x, w, b, t, _ = make_case(None if unbatched else 9, 8, 10, dtype)
    t.fill_(-100)
    got = run(FF.linear_cross_entropy, x, w, b, t, options=options, upstream=torch.tensor(1.0))
    ref = run(F.linear_cross_entropy, x, w, b, t, upstream=torch.tensor(1.0))
    assert got[0].isnan() and ref[0].isnan()
    for name, g, r in zip(GRAD_NAMES, got[1], ref[1]):
        assert torch.equal(r, torch.zeros_like(r))
        assert g.dtype == dtype and torch.equal(g, torch.zeros_like(g)), f"{name}: {g}"


@pytest.mark.parametrize("options", [None, Options(allow_retain_graph=True),
                                     Options(allow_retain_graph=True, batch_chunk_size=3),
                                     Options(batch_chunk_size=3, gradients_in_forward=False)],
                         ids=["none", "retain", "retain_chunk3", "chunk3_grads_in_backward"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_gradcheck_float64(reduction, options):
    """float64 on both paths, to gradcheck's precision (gradcheck runs the
    backward more than once, hence allow_retain_graph with options)."""
    x, w, b, t, weight = make_case(8, 4, 5, torch.float64, weighted=True, ignored=-100)
    leaves = [v.clone().requires_grad_() for v in (x, w, b)]

    def fn(x, w, b):
        return FF.linear_cross_entropy(x, w, t, linear_bias=b, weight=weight, reduction=reduction,
                                       label_smoothing=0.1, options=options)

    assert torch.autograd.gradcheck(fn, leaves)


# ------------------------------------------------------------ K-dimensional


KDIM = {"d1": (3,), "d1_d2": (2, 3)}
KDIM_VARIANTS = {
    "plain": dict(),
    "weighted_ls": dict(weighted=True, label_smoothing=0.1),
    "ignore3": dict(ignore_index=3),
}


def make_kdim(out_features, *, bias=True, weighted=False, probabilities=False, ignored=-100, seed=2):
    n, h, c = 6, 8, 5
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g, dtype=torch.float64).float()
    w = torch.randn(c, *out_features, h, generator=g)
    b = torch.randn(c, *out_features, generator=g) if bias else None
    if probabilities:
        t = torch.randn(n, c, *out_features, generator=g).softmax(1)
    else:
        t = torch.randint(0, c, (n, *out_features), generator=g)
        t.view(-1)[::4] = 3
        t.view(-1)[1::7] = ignored
    weight = torch.randint(1, 17, (c,), generator=g) / 8 if weighted else None
    return x, w, b, t, weight


@pytest.mark.parametrize("variant", KDIM_VARIANTS.values(), ids=KDIM_VARIANTS.keys())
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("out_features", KDIM.values(), ids=KDIM.keys())
def test_k_dimensional_is_torchs_reference_bitwise(out_features, reduction, variant):
    variant = dict(variant)
    x, w, b, t, weight = make_kdim(out_features, weighted=variant.pop("weighted", False),
                                   ignored=variant.get("ignore_index", -100))
    kw = dict(weight=weight, reduction=reduction, **variant)
    got = run(FF.linear_cross_entropy, x, w, b, t, **kw)
    theirs = run(F.linear_cross_entropy, x, w, b, t, **kw)
    assert got[0].shape == ((6, *out_features) if reduction == "none" else ())
    assert_bitwise(got, theirs)


@pytest.mark.parametrize("probabilities", [False, True], ids=["indices", "probabilities"])
def test_k_dimensional_with_options_warns_and_takes_the_reference(probabilities):
    """Both warn that the options are ignored and compute the reference."""
    x, w, b, t, _ = make_kdim((3,), probabilities=probabilities)
    with pytest.warns(UserWarning, match=re.escape("``options`` ignored")):
        theirs = F.linear_cross_entropy(x, w, t, linear_bias=b, options=TorchOptions(batch_chunk_size=2))
    with pytest.warns(UserWarning, match=re.escape("``options`` ignored")):
        ours = FF.linear_cross_entropy(x, w, t, linear_bias=b, options=Options(batch_chunk_size=2))
    assert torch.equal(ours, theirs)
    assert torch.equal(ours, F.linear_cross_entropy(x, w, t, linear_bias=b))


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "class_weights"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_k_dimensional_module_loads_torchs_state_dict(bias, weighted):
    torch.manual_seed(3)
    class_weight = torch.randint(1, 17, (5,)) / 8 if weighted else None
    kw = dict(out_features=(3,), bias=bias, reduction="sum", label_smoothing=0.1)
    theirs = torch.nn.LinearCrossEntropyLoss(8, 5, weight=class_weight, **kw)
    ours = fusetrain.nn.LinearCrossEntropyLoss(8, 5, weight=None if class_weight is None else torch.ones(5), **kw)
    keys = ["linear.weight"] + (["linear.bias"] if bias else [])
    assert sorted(ours.state_dict()) == sorted(theirs.state_dict()) == sorted(keys + (["weight"] if weighted else []))
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()] == keys
    assert ours.linear.weight.shape == theirs.linear.weight.shape == (15, 8)
    if bias:
        assert ours.linear.bias.shape == theirs.linear.bias.shape == (15,)
    ours.load_state_dict(theirs.state_dict())
    if weighted:
        assert torch.equal(ours.weight, class_weight)
    x, _, _, t, _ = make_kdim((3,))
    loss = ours(x, t)
    ref = theirs(x, t)
    assert torch.equal(loss, ref)
    loss.backward()
    ref.backward()
    assert torch.equal(ours.linear.weight.grad, theirs.linear.weight.grad)
    if bias:
        assert torch.equal(ours.linear.bias.grad, theirs.linear.bias.grad)


# ----------------------------------------------------- probability targets


@pytest.mark.parametrize("shape", ["batched", "unbatched", "k_dimensional"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_probability_targets_are_torchs_reference_bitwise(reduction, shape):
    if shape == "k_dimensional":
        x, w, b, t, weight = make_kdim((3,), weighted=True, probabilities=True)
    else:
        x, w, b, _, weight = make_case(None if shape == "unbatched" else 12, 8, 10, torch.float32, weighted=True)
        t = torch.randn(*x.shape[:-1], 10, generator=torch.Generator().manual_seed(4)).softmax(-1)
    kw = dict(weight=weight, reduction=reduction, label_smoothing=0.1)
    assert_bitwise(run(FF.linear_cross_entropy, x, w, b, t, **kw), run(F.linear_cross_entropy, x, w, b, t, **kw))


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1], ids=["ls0", "ls0.1"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("options", [OPTIONS[k] for k in ("default", "chunk7", "compact")],
                         ids=["default", "chunk7", "compact"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_probability_targets_with_options_match_torch(dtype, options, reduction, label_smoothing):
    """torch chunks probability targets of the input's dtype (without label
    smoothing); ours takes the reference: the same values either way."""
    x, w, b, _, weight = make_case(23, 16, 40, dtype, weighted=True)
    t = torch.randn(23, 40, generator=torch.Generator().manual_seed(4)).softmax(-1).to(dtype)
    got, theirs, ref = run_three(x, w, b, t, options, weight=weight, reduction=reduction,
                                 label_smoothing=label_smoothing)
    assert_same_results(got, theirs, ref, dtype)


# ------------------------------------------------------------------ errors


def _args(x=None, w=None, t=None, **kw):
    """Valid arguments (64 rows, 16 features, 10 classes), some replaced."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 16, generator=g) if x is None else x
    w = torch.randn(10, 16, generator=g) if w is None else w
    t = torch.randint(0, 10, (64,), generator=g) if t is None else t
    return (x, w, t), kw


# name: (arguments, exception type, torch's message or a key phrase of it,
# whether torch's chunked path raises it too: where it does not, ours is held
# to the reference's error on both paths and torch's only on its reference).
ERRORS = {
    "input_0d": (lambda: _args(x=torch.randn(())), RuntimeError,
                 "expected input with dimensionality 1 or 2, got 0", True),
    "input_3d": (lambda: _args(x=torch.randn(2, 64, 16)), RuntimeError,
                 "expected input with dimensionality 1 or 2, got 3", True),
    "linear_weight_1d": (lambda: _args(w=torch.randn(16)), RuntimeError,
                         "expected linear_weight with dimensionality at least 2, got 1", True),
    "in_features": (lambda: _args(w=torch.randn(10, 15)), RuntimeError,
                    "expected equal input and linear_weight last dimensions (in_features), got 16 and 15", True),
    "bias_shape": (lambda: _args(linear_bias=torch.randn(11)), RuntimeError,
                   "expected linear_bias shape (10,), got (11,)", True),
    "k_dim_unbatched": (lambda: _args(x=torch.randn(16), w=torch.randn(10, 3, 16), t=torch.randint(0, 10, (3,))),
                        RuntimeError, "requires batched input, (N, 16), got unbatched input with shape (16,)", True),
    "ignore_index_with_probabilities": (lambda: _args(t=torch.rand(64, 10), ignore_index=3), RuntimeError,
                                        "ignore_index cannot be specified when target contains probabilities", True),
    "bad_reduction": (lambda: _args(reduction="avg"), ValueError, "avg is not a valid value for reduction", True),
    "label_smoothing_2": (lambda: _args(label_smoothing=2.0), RuntimeError,
                          "label_smoothing must be between 0.0 and 1.0", True),
    "int32_target": (lambda: _args(t=torch.randint(0, 10, (64,), dtype=torch.int32)), RuntimeError,
                     "expected target dtype to be Long or Byte, but got Int", True),
    "target_batch": (lambda: _args(t=torch.randint(0, 10, (10,))), ValueError,
                     "Expected input batch_size (64) to match target batch_size (10)", False),
    "dtype_mismatch": (lambda: _args(w=torch.randn(10, 16, dtype=torch.float64)), RuntimeError,
                       "expected m1 and m2 to have the same dtype, but got: float != double", True),
    "class_weight_size": (lambda: _args(weight=torch.rand(9)), RuntimeError,
                          "weight tensor should be defined either for all 10 classes or no classes", False),
}


@pytest.mark.filterwarnings("ignore:linear_cross_entropy")
@pytest.mark.parametrize("options", [None, "default", "chunk7"])
@pytest.mark.parametrize("case", ERRORS.values(), ids=ERRORS.keys())
def test_errors_match_torch(case, options):
    make, exc, phrase, torch_chunked_raises_it = case
    ours_options = None if options is None else OPTIONS[options]
    if options is None or torch_chunked_raises_it:
        args, kw = make()
        with pytest.raises(exc, match=re.escape(phrase)) as theirs:
            F.linear_cross_entropy(*args, **kw, options=torch_options(ours_options))
        assert type(theirs.value) is exc
    args, kw = make()
    with pytest.raises(exc, match=re.escape(phrase)) as got:
        FF.linear_cross_entropy(*args, **kw, options=ours_options)
    assert type(got.value) is exc


@pytest.mark.parametrize("options", [None, "default"])
@pytest.mark.parametrize("value", [10, -5])
def test_target_out_of_range_raises_index_error(value, options):
    """torch's reference raises IndexError; its chunked path a RuntimeError
    from its gather; ours an IndexError on both."""
    (x, w, t), _ = _args(t=torch.full((64,), value))
    if options is None:
        with pytest.raises(IndexError):
            F.linear_cross_entropy(x, w, t)
        with pytest.raises(IndexError):
            FF.linear_cross_entropy(x, w, t)
    else:
        with pytest.raises((IndexError, RuntimeError)):
            FF.linear_cross_entropy(x, w, t, options=OPTIONS[options])


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_unbatched_input_with_a_one_element_target(reduction):
    """torch's reference takes a [1] target for an unbatched input
    (F.cross_entropy of [C] logits): a 0-d loss. (Its backward then fails
    in torch's nll_loss: "size mismatch"; only the values are compared.)"""
    x, w, b, _, _ = make_case(None, 16, 10, torch.float32)
    t = torch.tensor([3])
    expected = F.linear_cross_entropy(x, w, t, linear_bias=b, reduction=reduction)
    for options in (None, Options()):
        got = FF.linear_cross_entropy(x, w, t, linear_bias=b, reduction=reduction, options=options)
        assert got.shape == expected.shape == ()
        assert torch.equal(got, expected)


TARGET_SHAPE_ERRORS = {
    # input shape, target shape, torch's error
    "unbatched_target_2": ((16,), (2,), ValueError, "For 1D input, 1D target must have size 1, but got target size: 2"),
    "unbatched_target_1x1": ((16,), (1, 1), RuntimeError, "0D or 1D target tensor expected, multi-target"),
    "multi_target": ((4, 16), (4, 2), RuntimeError, "0D or 1D target tensor expected, multi-target"),
    "target_0d": ((4, 16), (), ValueError, "Expected input batch_size (4) to match target batch_size (0)"),
}


@pytest.mark.parametrize("options", [None, "default"])
@pytest.mark.parametrize("case", TARGET_SHAPE_ERRORS.values(), ids=TARGET_SHAPE_ERRORS.keys())
def test_target_shape_errors(case, options):
    x_shape, t_shape, exc, phrase = case
    x, w = torch.randn(x_shape), torch.randn(10, 16)
    t = torch.randint(0, 10, t_shape)
    with pytest.raises(exc, match=re.escape(phrase)):
        F.linear_cross_entropy(x, w, t)
    with pytest.raises(exc, match=re.escape(phrase)) as got:
        FF.linear_cross_entropy(x, w, t, options=None if options is None else OPTIONS[options])
    assert type(got.value) is exc


@pytest.mark.parametrize(("dtype", "weight_dtype", "phrase"), [
    (torch.bfloat16, torch.float32, "expected scalar type BFloat16 but found Float"),
    (torch.float32, torch.float64, "expected scalar type Float but found Double"),
], ids=["bf16_input_fp32_weights", "fp32_input_fp64_weights"])
def test_class_weights_of_another_dtype(dtype, weight_dtype, phrase):
    x, w, _, t, weight = make_case(8, 16, 10, dtype, bias=False, weighted=True)
    weight = weight.to(weight_dtype)
    # torch's (outside the expected failure: if torch stops raising, this fails outright).
    with pytest.raises(RuntimeError, match=re.escape(phrase)):
        F.linear_cross_entropy(x, w, t, weight=weight)
    try:
        loss = FF.linear_cross_entropy(x, w, t, weight=weight)
    except RuntimeError as e:
        assert phrase in str(e), f"another message: {e}"
    else:
        raise AssertionError(f"ours accepted {weight_dtype} class weights for {dtype} input: loss {loss}")


OPTION_ERRORS = {
    "acc_policy_x": dict(acc_policy="x"),
    "acc_policy_balanced": dict(acc_policy="balanced"),
    "chunking_method_none_string": dict(chunking_method="none"),
    "chunking_method_aspect_ratio_0": dict(chunking_method="aspect_ratio:0"),
    "batch_chunk_size_0": dict(batch_chunk_size=0),
    "batch_chunk_size_float": dict(batch_chunk_size=1.5),
    "acc_dtype_int32": dict(acc_dtype=torch.int32),
}


@pytest.mark.parametrize("kw", OPTION_ERRORS.values(), ids=OPTION_ERRORS.keys())
def test_options_errors_at_construction(kw):
    try:
        TorchOptions(**kw)
    except ValueError as e:
        theirs = str(e)
    else:  # torch 2.13 still takes acc_policy="balanced": so do we there
        Options(**kw)
        return
    with pytest.raises(ValueError) as ours:
        Options(**kw)
    # Our words are torch 2.14+'s (2.13 said "invalid acc_policy: 'x'" alone).
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 14):
        assert str(ours.value) == theirs


def test_batch_chunk_size_disagreeing_with_chunking_method():
    """Constructed fine; a ValueError at the call, torch's words."""
    (x, w, t), _ = _args()
    kw = dict(batch_chunk_size=8, chunking_method="aspect_ratio")
    with pytest.raises(ValueError, match=re.escape("give different chunk sizes (8 vs 64)")) as theirs:
        F.linear_cross_entropy(x, w, t, options=TorchOptions(**kw))
    with pytest.raises(ValueError, match=f"^{re.escape(str(theirs.value))}$"):
        FF.linear_cross_entropy(x, w, t, options=Options(**kw))
    # Where they agree (64 rows, 10 classes over 16 features: 64), no error.
    kw["batch_chunk_size"] = 64
    assert torch.allclose(FF.linear_cross_entropy(x, w, t, options=Options(**kw)),
                          F.linear_cross_entropy(x, w, t, options=TorchOptions(**kw)), rtol=1e-6, atol=0)


@pytest.mark.parametrize("kw", [dict(weight=torch.rand(9)), dict(weight=torch.rand(10, 1)),
                                dict(label_smoothing=2.0), dict(label_smoothing=-0.1)],
                         ids=["weight_9", "weight_10x1", "label_smoothing_2", "label_smoothing_negative"])
def test_module_construction_errors(kw):
    with pytest.raises(RuntimeError) as theirs:
        torch.nn.LinearCrossEntropyLoss(16, 10, **kw)
    with pytest.raises(RuntimeError, match=f"^{re.escape(str(theirs.value))}$"):
        fusetrain.nn.LinearCrossEntropyLoss(16, 10, **kw)


# ------------------------------------------------------------------ autograd


def _leaves(dtype=torch.float32, rows=20, reduction="mean"):
    x, w, b, t, weight = make_case(rows, 8, 11, dtype, weighted=True, ignored=None if rows is None else -100)
    return [v.clone().requires_grad_() for v in (x, w, b)], t, dict(weight=weight, reduction=reduction)


def _backward_twice(fn, options, reduction):
    """The gradients of the first and of a second backward through the same graph."""
    (x, w, b), t, kw = _leaves(reduction=reduction)
    loss = fn(x, w, t, linear_bias=b, options=options, **kw)
    up = upstream_for(loss)
    loss.backward(up, retain_graph=True)
    first = [v.grad for v in (x, w, b)]
    for v in (x, w, b):
        v.grad = None
    loss.backward(up)
    return first, [v.grad for v in (x, w, b)]


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_retain_graph_without_options(reduction):
    """options=None: a second backward works (torch's reference allows it)
    and gives the same gradients; both match torch's."""
    first, second = _backward_twice(FF.linear_cross_entropy, None, reduction)
    tfirst, tsecond = _backward_twice(F.linear_cross_entropy, None, reduction)
    for name, a, c, ta, tc in zip(GRAD_NAMES, first, second, tfirst, tsecond):
        torch.testing.assert_close(c, a, rtol=1e-6, atol=1e-6, msg=name)
        torch.testing.assert_close(a, ta, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(c, tc, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_second_backward_with_options_raises_on_both(reduction):
    for fn, options in ((F.linear_cross_entropy, TorchOptions()), (FF.linear_cross_entropy, Options())):
        (x, w, b), t, kw = _leaves(reduction=reduction)
        loss = fn(x, w, t, linear_bias=b, options=options, **kw)
        loss.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="called twice"):
            loss.backward()


RETAIN = {
    "retain_mean": (dict(allow_retain_graph=True, batch_chunk_size=7), "mean"),
    "retain_sum": (dict(allow_retain_graph=True, batch_chunk_size=7), "sum"),
    "retain_none": (dict(allow_retain_graph=True, batch_chunk_size=7), "none"),
    "default_none": (dict(batch_chunk_size=7), "none"),
    "retain_sum_ours_given_torchs_options": (dict(allow_retain_graph=True, batch_chunk_size=7), "sum", True),
}


@pytest.mark.parametrize("case", RETAIN.values(), ids=RETAIN.keys())
def test_retain_graph_with_options(case):
    """allow_retain_graph=True (any reduction), and "none" without it (it
    recomputes in the backward): a second backward works on both and gives
    the same gradients."""
    kw, reduction, *given_torchs = case
    ours_options = TorchOptions(**kw) if given_torchs else Options(**kw)
    first, second = _backward_twice(FF.linear_cross_entropy, ours_options, reduction)
    tfirst, tsecond = _backward_twice(F.linear_cross_entropy, TorchOptions(**kw), reduction)
    for name, a, c, ta, tc in zip(GRAD_NAMES, first, second, tfirst, tsecond):
        torch.testing.assert_close(c, a, rtol=1e-6, atol=1e-6, msg=name)
        torch.testing.assert_close(a, ta, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(c, tc, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("unbatched", [False, True], ids=["batched", "unbatched"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_double_backward_matches_torchs_reference(reduction, unbatched):
    """options=None is twice differentiable, as torch's reference: the
    gradient of (grad_input . v) matches torch's in float64."""
    results = []
    for fn in (FF.linear_cross_entropy, F.linear_cross_entropy):
        (x, w, b), t, kw = _leaves(torch.float64, rows=None if unbatched else 20, reduction=reduction)
        loss = fn(x, w, t, linear_bias=b, label_smoothing=0.1, **kw)
        (gx,) = torch.autograd.grad(loss, x, upstream_for(loss), create_graph=True)
        v = torch.linspace(-1, 1, gx.numel(), dtype=torch.float64).reshape(gx.shape)
        results.append([gx.detach(), *torch.autograd.grad((gx * v).sum(), (x, w, b))])
    for name, a, e in zip(("grad_input",) + tuple("grad_grad_" + n[5:] for n in GRAD_NAMES), *results):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12, msg=name)
        assert e.abs().sum() > 0, name


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_gradgradcheck_without_options(reduction):
    x, w, b, t, weight = make_case(6, 4, 5, torch.float64, weighted=True, ignored=-100)
    leaves = [v.clone().requires_grad_() for v in (x, w, b)]

    def fn(x, w, b):
        return FF.linear_cross_entropy(x, w, t, linear_bias=b, weight=weight, reduction=reduction,
                                       label_smoothing=0.1)

    assert torch.autograd.gradgradcheck(fn, leaves)


# ------------------------------------------------- only the needed gradients


@pytest.mark.parametrize("frozen", ["linear_weight", "input", "input_and_weight"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("options", [OPTIONS[k] for k in ("none", "default", "chunk7_grads_in_backward")],
                         ids=["none", "default", "chunk7_grads_in_backward"])
def test_only_the_needed_gradients(options, reduction, frozen):
    x, w, b, t, weight = make_case(37, 24, 150, torch.float32, weighted=True, ignored=3)
    kw = dict(weight=weight, reduction=reduction, ignore_index=3)
    # requires_grad of (input, linear_weight, linear_bias).
    wants = {"linear_weight": (True, False, True), "input": (False, True, True),
             "input_and_weight": (False, False, True)}[frozen]
    results = []
    for fn, opt, cast in ((FF.linear_cross_entropy, options, None),
                          (F.linear_cross_entropy, torch_options(options), None),
                          (F.linear_cross_entropy, None, torch.float64)):
        leaves = [v.to(cast) if cast else v.clone() for v in (x, w, b)]
        for v, want in zip(leaves, wants):
            v.requires_grad_(want)
        loss = fn(leaves[0], leaves[1], t, linear_bias=leaves[2], options=opt,
                  **dict(kw, weight=weight.to(cast) if cast else weight))
        loss.backward(upstream_for(loss))
        results.append((loss.detach(), [v.grad for v in leaves]))
    (loss, grads), (tloss, tgrads), (rloss, rgrads) = results
    assert_no_worse_than_torch("loss", loss, tloss, rloss, torch.float32)
    for name, g, tg, rg, want in zip(GRAD_NAMES, grads, tgrads, rgrads, wants):
        assert (g is None) == (tg is None) == (not want), name
        if want:
            assert_no_worse_than_torch(name, g, tg, rg, torch.float32)


# ------------------------------------------------------------------ module


MODULE_ARGS = {
    "plain": dict(),
    "everything": dict(bias=True, reduction="sum", ignore_index=3, label_smoothing=0.1),
    "k_dim": dict(out_features=(2, 3), bias=True, reduction="none"),
    "torch_options": dict(options=TorchOptions(batch_chunk_size=7)),
}


@pytest.mark.parametrize("kw", MODULE_ARGS.values(), ids=MODULE_ARGS.keys())
def test_module_is_torchs(kw):
    ours = fusetrain.nn.LinearCrossEntropyLoss(16, 10, **kw)
    theirs = torch.nn.LinearCrossEntropyLoss(16, 10, **kw)
    assert isinstance(ours, torch.nn.LinearCrossEntropyLoss)
    assert repr(ours) == repr(theirs)
    for name in ("num_classes", "out_features", "reduction", "ignore_index", "label_smoothing", "options"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.linear.in_features == theirs.linear.in_features
    assert ours.linear.out_features == theirs.linear.out_features
    assert (ours.linear.bias is None) == (theirs.linear.bias is None)


def test_module_repr_with_options_names_our_options():
    """With our options the repr is torch's but for the options' own repr
    (ours has gradients_in_forward)."""
    ours = fusetrain.nn.LinearCrossEntropyLoss(16, 10, options=Options(batch_chunk_size=7))
    theirs = torch.nn.LinearCrossEntropyLoss(16, 10, options=TorchOptions(batch_chunk_size=7))
    assert repr(ours).replace(", gradients_in_forward=True", "") == repr(theirs)


@pytest.mark.parametrize("options", ["none", "default", "chunk7"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_module_matches_torchs_module(reduction, options):
    """Ours with torch's state dict and the same arguments: torch's loss and
    gradients (within torch's own error of a float64 copy of torch's module)."""
    options = OPTIONS[options]
    class_weight = torch.randint(1, 17, (150,), generator=torch.Generator().manual_seed(7)) / 8
    kw = dict(bias=True, reduction=reduction, weight=class_weight, ignore_index=3)
    theirs = torch.nn.LinearCrossEntropyLoss(24, 150, options=torch_options(options), **kw)
    ours = fusetrain.nn.LinearCrossEntropyLoss(24, 150, options=options, **kw)
    ours.load_state_dict(theirs.state_dict())
    ref = torch.nn.LinearCrossEntropyLoss(24, 150, **kw)
    ref.load_state_dict(theirs.state_dict())
    ref.double()
    x, _, _, t, _ = make_case(37, 24, 150, torch.float32, ignored=3)
    results = []
    for m, xx in ((ours, x), (theirs, x), (ref, x.double())):
        xs = xx.clone().requires_grad_()
        loss = m(xs, t)
        loss.backward(upstream_for(loss))
        results.append((loss.detach(), [xs.grad, m.linear.weight.grad, m.linear.bias.grad]))
    assert_same_results(results[0], results[1], results[2], torch.float32)


# ------------------------------------------------------------ options class


def test_options_fields_and_defaults_are_torchs():
    theirs = [(f.name, f.default) for f in dataclasses.fields(TorchOptions)]
    ours = [(f.name, f.default) for f in dataclasses.fields(Options)]
    assert ours == theirs + [("gradients_in_forward", True)]
    # Positional construction means the same.
    args = (True, 7, None, "accurate", torch.float32)
    assert [getattr(Options(*args), n) for n, _ in theirs] == [getattr(TorchOptions(*args), n) for n, _ in theirs]
    assert fusetrain.nn.LinearCrossEntropyOptions is Options


def test_options_are_frozen_with_slots():
    o = Options()
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.batch_chunk_size = 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.gradients_in_forward = False
    assert not hasattr(o, "__dict__") and not hasattr(TorchOptions(), "__dict__")
    assert o == Options() and hash(o) == hash(Options()) and o != Options(batch_chunk_size=4)
    assert dataclasses.replace(o, batch_chunk_size=4) == Options(batch_chunk_size=4)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("kw", [dict(), dict(batch_chunk_size=7), dict(chunking_method="aspect_ratio:2"),
                                dict(acc_policy="compact", allow_retain_graph=True)],
                         ids=["default", "chunk7", "aspect_ratio2", "compact_retain"])
def test_torchs_options_instance_is_accepted(kw, reduction):
    """A torch LinearCrossEntropyOptions passed to ours means our options of
    the same fields: the same results bit for bit, through the function and
    the module."""
    x, w, b, t, weight = make_case(37, 24, 150, torch.bfloat16, weighted=True)
    args = dict(weight=weight, reduction=reduction, ignore_index=3)
    with_torchs = run(FF.linear_cross_entropy, x, w, b, t, options=TorchOptions(**kw), **args)
    with_ours = run(FF.linear_cross_entropy, x, w, b, t, options=Options(**kw), **args)
    assert_bitwise(with_torchs, with_ours)
    module = fusetrain.nn.LinearCrossEntropyLoss(24, 150, bias=True, dtype=torch.bfloat16, options=TorchOptions(**kw),
                                                 **args)
    with torch.no_grad():
        module.linear.weight.copy_(w)
        module.linear.bias.copy_(b)
    assert torch.equal(module(x, t), with_ours[0])


# ------------------------------------------------------------------ autocast


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_autocast_bfloat16(reduction):
    """Under CPU autocast to bfloat16 (options=None): a float32 loss and
    float32 gradients, within torch's own error of the float64 reference of
    the bfloat16-rounded input and weights."""
    x, w, b, t, _ = make_case(37, 24, 150, torch.float32, ignored=-100)
    kw = dict(reduction=reduction, label_smoothing=0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = run(FF.linear_cross_entropy, x, w, b, t, **kw)
        theirs = run(F.linear_cross_entropy, x, w, b, t, **kw)
    assert got[0].dtype == theirs[0].dtype == torch.float32
    assert all(g.dtype == torch.float32 for g in got[1])
    bf = [v.to(torch.bfloat16) for v in (x, w, b)]
    ref = run(F.linear_cross_entropy, *bf, t, cast=torch.float64, **kw)
    # The GEMMs are bfloat16: bfloat16's floor.
    assert_same_results(got, theirs, ref, torch.bfloat16)
