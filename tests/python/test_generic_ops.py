"""The device-generic implementations (Note [Device-generic ops],
csrc/ops/generic.h, issue 17): ATen-only versions of every op, registered
under CompositeExplicitAutograd so that a backend without kernels of ours (a
TPU through torch_tpu, XPU, MPS) still runs fusetrain.

Here they are called directly on the CPU (the dispatcher's
CompositeExplicitAutograd entry, what such a backend reaches) and checked
against the CPU kernels: bit for bit for the loss-scale ops and, against the
scalar loops (FUSETRAIN_CPU_PATH=scalar, in a subprocess), for the
optimizers, which follow those loops operation by operation; within the
summation error for the L2 norm and cross-entropy. Then the scaler,
optimizers, clipping and loss run end to end with FUSETRAIN_CPU_PATH=generic.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._C import DispatchKey

import fusetrain  # noqa: F401  (registers the ops)

OPS = (
    "non_finite_check_and_unscale_",
    "update_scale_",
    "fused_adamw_",
    "fused_sgd_",
    "multi_tensor_l2norm",
    "softmax_cross_entropy_forward",
    "softmax_cross_entropy_backward",
)


def generic(name):
    """The op's CompositeExplicitAutograd kernel: what a backend with no
    kernel of ours runs."""
    op = getattr(torch.ops.fusetrain, name).default
    return lambda *args, **kwargs: op._op_dk(DispatchKey.CompositeExplicitAutograd, *args, **kwargs)


def kernel(name):
    return getattr(torch.ops.fusetrain, name).default


# ------------------------------------------------------------ registration


@pytest.mark.parametrize("name", OPS)
def test_every_other_backend_gets_the_generic_kernel(name):
    table = torch._C._dispatch_dump_table(f"fusetrain::{name}")
    rows = dict(line.split(": ", 1) for line in table.splitlines() if ": " in line)
    # CPU, CUDA and Meta keep their own kernels...
    for key in ("CPU", "CUDA", "Meta"):
        assert rows[key].endswith("[kernel]") and "generic.cpp" not in rows[key], (key, rows[key])
    # ...every other backend reaches the generic one.
    for key in ("PrivateUse1", "XPU", "MPS", "XLA", "HPU"):
        assert "generic.cpp" in rows[key] and "default backend kernel" in rows[key], (key, rows[key])
    # Autograd is not shadowed (CompositeImplicitAutograd would be).
    assert "generic.cpp" not in rows.get("AutogradCPU", "")


# ---------------------------------------------------------- loss-scale ops

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(a, b):
    """The same values bit for bit (signed zeros included, strides aside);
    a NaN matches a NaN, whatever its payload (x * 1 may requiet it)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    as_int = lambda t: t.contiguous().flatten().view(_INT[t.element_size()])  # noqa: E731
    nan = a.isnan().flatten()
    return torch.equal(nan, b.isnan().flatten()) and torch.equal(as_int(a)[~nan], as_int(b)[~nan])



def unscale_inputs(dtype, special, g):
    ts = [(torch.randn(n, generator=g) * 100).to(dtype) for n in (1, 7, 64, 1000, 4099)]
    ts.append(torch.randn(6, 10, generator=g).to(dtype).t())  # a strided view
    ts.append(torch.empty(0, dtype=dtype))
    if special == "inf":
        ts[3][17] = float("inf")
    elif special == "nan":
        ts[5][2, 3] = float("nan")
    elif special == "overflow":  # finite, but past the range once scaled by 4
        ts[4][1] = torch.finfo(dtype).max / 2
    return ts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("special", ["none", "inf", "nan", "overflow"])
@pytest.mark.parametrize("inv", [1.0, 1 / 1024, 1 / 3, 4.0])
def test_unscale_matches_the_kernel_bit_for_bit(dtype, special, inv):
    g = torch.Generator().manual_seed(0)
    ts = unscale_inputs(dtype, special, g)
    ref = [t.clone() for t in ts]
    found, found_ref = torch.zeros(1), torch.zeros(1)
    inv_scale = torch.tensor([inv])
    generic("non_finite_check_and_unscale_")(ts, found, inv_scale)
    kernel("non_finite_check_and_unscale_")(ref, found_ref, inv_scale)
    assert found.item() == found_ref.item() == (1.0 if special in ("inf", "nan") else 0.0)
    for a, b in zip(ts, ref):
        assert a.dtype == b.dtype and a.stride() == b.stride()
        assert same_bits(a, b)


def test_unscale_leaves_a_set_found_inf_set():
    found = torch.ones(1)
    generic("non_finite_check_and_unscale_")([torch.ones(3)], found, torch.tensor([0.5]))
    assert found.item() == 1.0


def run_scale_updates(fn, found_seq, growth_factor, backoff_factor, interval, max_scale, hysteresis,
                      init=2.0**15):
    scale = torch.tensor([init])
    growth = torch.zeros(1, dtype=torch.int32)
    overflows = torch.zeros(1, dtype=torch.int32)
    history = []
    for f in found_seq:
        fn(scale, growth, overflows, torch.tensor([float(f)]), growth_factor, backoff_factor, interval,
           max_scale, hysteresis)
        history.append((scale.item(), growth.item(), overflows.item()))
    return history


FOUND = [0, 0, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0]


@pytest.mark.parametrize(
    "growth_factor,backoff_factor,interval,max_scale,hysteresis",
    [(2.0, 0.5, 2, float("inf"), 0), (2.0, 0.5, 3, 2.0**17, 1), (1.5, 0.25, 1, float("inf"), 2),
     (2.0, 0.5, 1, float("inf"), 0)],
)
def test_scale_update_matches_the_kernel(growth_factor, backoff_factor, interval, max_scale, hysteresis):
    args = (FOUND, growth_factor, backoff_factor, interval, max_scale, hysteresis)
    got = run_scale_updates(generic("update_scale_"), *args)
    want = run_scale_updates(kernel("update_scale_"), *args)
    assert got == want


def test_scale_update_keeps_a_finite_scale():
    # Growth past float32's range is not taken (the kernel's isfinite rule).
    big = torch.finfo(torch.float32).max / 1.5
    args = ([0, 0, 0], 2.0, 0.5, 1, float("inf"), 0)
    got = run_scale_updates(generic("update_scale_"), *args, init=big)
    assert got == run_scale_updates(kernel("update_scale_"), *args, init=big)
    assert got[-1][0] == pytest.approx(big)


def test_scale_update_with_a_factor_that_is_not_a_float():
    # 1.1 is not a float32: the kernel rounds the float64 product, the
    # generic op the float32 one; they may differ by one ulp.
    args = ([0] * 12, 1.1, 0.5, 1, float("inf"), 0)
    got = run_scale_updates(generic("update_scale_"), *args, init=3.0)
    want = run_scale_updates(kernel("update_scale_"), *args, init=3.0)
    for (a, *ra), (b, *rb) in zip(got, want):
        assert ra == rb
        assert abs(a - b) <= abs(b) * 2.0**-23 * len(got)


# ------------------------------------------------------------- optimizers

OPTIM_SCRIPT = textwrap.dedent(
    """
    import itertools, json, sys, torch
    import fusetrain
    from torch._C import DispatchKey
    from fusetrain import _C
    assert _C.cpu_features()["path"] == "scalar", _C.cpu_features()
    torch.set_num_threads(2)

    def call(op, generic, *args, **kwargs):
        op = getattr(torch.ops.fusetrain, op).default
        if generic:
            return op._op_dk(DispatchKey.CompositeExplicitAutograd, *args, **kwargs)
        return op(*args, **kwargs)

    SIZES = (1, 7, 33, 1025, 40000)  # tails, and more than one chunk

    def lr_tensor_of(kind):
        if kind == "float":
            return None
        return torch.tensor([3e-3], dtype=torch.float64 if kind == "tensor64" else torch.float32)

    def step_grads(params, g, unscale):
        return [(torch.randn(p.shape, generator=g) * (1024.0 if unscale else 1.0)).to(p.dtype)
                for p in params]

    def scaler_args(unscale, skip, step):
        # What GradScaler hands a fused optimizer; with `skip`, step 1 overflowed.
        return {"grad_scale": torch.tensor([1024.0]) if unscale else None,
                "found_inf": torch.tensor([1.0 if step == 1 else 0.0]) if skip else None}

    def adam_run(generic, dtype, master, amsgrad, maximize, decoupled, wd, unscale, skip, lr_kind):
        g = torch.Generator().manual_seed(3)
        params = [torch.randn(n, generator=g).to(dtype) for n in SIZES]
        state_dtype = torch.float32 if master else dtype
        masters = [p.float() + 1e-3 * torch.randn(p.shape, generator=g) for p in params] if master else []
        m = [torch.randn(p.shape, generator=g).to(state_dtype) * 0.1 for p in params]
        v = [torch.rand(p.shape, generator=g).to(state_dtype) * 0.01 for p in params]
        vmax = [x.clone() * 1.5 for x in v] if amsgrad else []
        steps = [torch.tensor([float(k)]) for k in range(len(params))]
        lr = 1e-2
        lr_tensor = lr_tensor_of(lr_kind)
        out = []
        for step in range(3):
            grads = step_grads(params, g, unscale)
            call("fused_adamw_", generic, params, grads, m, v, vmax, masters, steps, lr=lr,
                 beta1=0.9, beta2=0.999, weight_decay=wd, eps=1e-8, amsgrad=amsgrad,
                 maximize=maximize, decoupled_weight_decay=decoupled,
                 lr_tensor=lr_tensor, **scaler_args(unscale, skip, step))
            out.append(grads)
        return [params, masters, m, v, vmax, steps] + out

    def sgd_run(generic, dtype, master, momentum, dampening, nesterov, maximize, wd, unscale, skip,
                lr_kind):
        g = torch.Generator().manual_seed(4)
        params = [torch.randn(n, generator=g).to(dtype) for n in SIZES]
        masters = [p.float() + 1e-3 * torch.randn(p.shape, generator=g) for p in params] if master else []
        state_dtype = torch.float32 if master else dtype
        bufs = [torch.zeros(p.shape, dtype=state_dtype) for p in params] if momentum else []
        lr_tensor = lr_tensor_of(lr_kind)
        out = []
        for step in range(3):
            grads = step_grads(params, g, unscale)
            call("fused_sgd_", generic, params, grads, bufs, masters, lr=1e-2, momentum=momentum,
                 dampening=dampening, weight_decay=wd, nesterov=nesterov, maximize=maximize,
                 is_first_step=step == 0, lr_tensor=lr_tensor, **scaler_args(unscale, skip, step))
            out.append(grads)
        return [params, masters, bufs] + out

    def same(a, b, dtype):
        if dtype == torch.float64:
            # torch's float64 sqrt on the CPU is not correctly rounded (the
            # float32 one goes through float64, Note [Device-generic ops]):
            # an ulp of the denominator, in about 1% of the elements.
            return all(torch.allclose(x, y, rtol=2.0**-50, atol=2.0**-56)
                       for xs, ys in zip(a, b) for x, y in zip(xs, ys))
        return all(torch.equal(x, y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))

    cases, bad = 0, []
    dtypes = [(torch.float32, False), (torch.float64, False), (torch.bfloat16, False),
              (torch.bfloat16, True), (torch.float16, True)]
    for (dtype, master), amsgrad, maximize, decoupled, wd, unscale, skip, lr_kind in itertools.product(
            dtypes, (False, True), (False, True), (True, False), (0.0, 0.1), (False, True),
            (False, True), ("float", "tensor32", "tensor64")):
        if lr_kind != "float" and (maximize or amsgrad):
            continue  # the lr tensor's cases: the common options suffice
        key = (str(dtype), master, amsgrad, maximize, decoupled, wd, unscale, skip, lr_kind)
        args = (dtype, master, amsgrad, maximize, decoupled, wd, unscale, skip, lr_kind)
        cases += 1
        if not same(adam_run(True, *args), adam_run(False, *args), dtype):
            bad.append(("adamw",) + key)
    for (dtype, master), momentum, dampening, nesterov, maximize, wd, unscale, skip, lr_kind in itertools.product(
            dtypes, (0.0, 0.9), (0.0, 0.25), (False, True), (False, True), (0.0, 0.1), (False, True),
            (False, True), ("float", "tensor64")):
        if nesterov and (momentum == 0 or dampening != 0):
            continue
        if momentum == 0 and dampening != 0:
            continue
        key = (str(dtype), master, momentum, dampening, nesterov, maximize, wd, unscale, skip, lr_kind)
        cases += 1
        args = (dtype, master, momentum, dampening, nesterov, maximize, wd, unscale, skip, lr_kind)
        if not same(sgd_run(True, *args), sgd_run(False, *args), dtype):
            bad.append(("sgd",) + key)
    print(json.dumps({"cases": cases, "bad": [list(map(str, b)) for b in bad]}))
    """
)


def scalar_env():
    env = {k: v for k, v in os.environ.items() if k not in ("FUSETRAIN_CPU_PATH", "ATEN_CPU_CAPABILITY")}
    env["FUSETRAIN_CPU_PATH"] = "scalar"
    return env


def test_optimizers_match_the_scalar_loops_bit_for_bit():
    """Every option of AdamW/Adam and SGD (masters, amsgrad, maximize, L2 or
    decoupled decay, grad_scale, a skipped step, float and tensor learning
    rates, float32/bfloat16/float16; float64 within an ulp of its sqrt): the
    generic op gives the scalar kernel's bits in every tensor it writes, over
    three steps."""
    p = subprocess.run([sys.executable, "-c", OPTIM_SCRIPT], capture_output=True, text=True,
                       env=scalar_env(), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result["cases"] > 300
    assert result["bad"] == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adamw_against_the_vector_kernel(dtype):
    """On the default (vector) path the kernel contracts multiply-adds into
    FMAs (Note [Vector Adam]): a few float32 ulps of each update apart, and
    no more than one rounding of the 16-bit parameters."""
    g = torch.Generator().manual_seed(5)
    params = [torch.randn(n, generator=g).to(dtype) for n in (5, 300, 4099)]
    runs = []
    for fn in (generic("fused_adamw_"), kernel("fused_adamw_")):
        gg = torch.Generator().manual_seed(6)
        ps = [p.clone() for p in params]
        m = [torch.zeros_like(p) for p in ps]
        v = [torch.zeros_like(p) for p in ps]
        steps = [torch.zeros(1) for _ in ps]
        for _ in range(3):
            grads = [torch.randn(p.shape, generator=gg).to(dtype) for p in ps]
            fn(ps, grads, m, v, [], [], steps, lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1,
               eps=1e-8, amsgrad=False, maximize=False, decoupled_weight_decay=True)
        runs.append(ps)
    for a, b in zip(*runs):
        # 3 steps of at most lr each, each off by a few ulps of itself.
        # When the updates differ, the rounded parameter may too: one ulp of
        # the parameter a step.
        ulp = 3 * 2.0**-23 if dtype == torch.float32 else 2.0**-7
        torch.testing.assert_close(a.float(), b.float(), rtol=ulp, atol=3 * 1e-2 * 2.0**-20)


# ---------------------------------------------------------------- L2 norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_l2norm_matches_the_kernel(dtype, per_tensor):
    g = torch.Generator().manual_seed(7)
    ts = [torch.randn(n, generator=g).to(dtype) for n in (1, 13, 4096, 70001)]
    ts.append(torch.randn(30, 20, generator=g).to(dtype).t())
    total, per = generic("multi_tensor_l2norm")(ts, per_tensor)
    want_total, want_per = kernel("multi_tensor_l2norm")(ts, per_tensor)
    assert total.dtype == torch.float32 and total.shape == want_total.shape == ()
    assert per.shape == want_per.shape
    # Both sum in float64 (in different orders: ~1e-16 relative) and round
    # once to float32: the same float unless the sum sits on a rounding
    # boundary, so at most one ulp.
    torch.testing.assert_close(total, want_total, rtol=2.0**-23, atol=0)
    torch.testing.assert_close(per, want_per, rtol=2.0**-23, atol=0)
    # And against torch's own norm, another way.
    ref = torch.linalg.vector_norm(torch.cat([t.double().flatten() for t in ts]))
    torch.testing.assert_close(total.double(), ref, rtol=2.0**-23, atol=0)


def test_l2norm_propagates_non_finite_and_empty_lists():
    ts = [torch.ones(3), torch.tensor([1.0, float("inf")])]
    assert generic("multi_tensor_l2norm")(ts, False)[0].item() == float("inf")
    ts[1][0] = float("nan")
    assert generic("multi_tensor_l2norm")(ts, False)[0].isnan()
    total, per = generic("multi_tensor_l2norm")([], True)
    assert total.item() == 0.0 and per.shape == (0,)


# ---------------------------------------------------------- cross-entropy


def ce_inputs(n, c, dtype, ignore, g):
    x = (torch.randn(n, c, generator=g) * 4).to(dtype)
    t = torch.randint(0, c, (n,), generator=g)
    if ignore:
        t[::3] = -100
    return x, t


# The generic op sums exp in float32 (the kernel in float64): lse carries a
# relative summation error of about log2(C) float32 ulps of the row sum,
# i.e. an absolute error of ~log2(C) * 2^-24 in lse, plus one ulp of |lse|.
def lse_tol(c, x):
    return (torch.log2(torch.tensor(float(c))).item() + 2) * 2.0**-24 * max(1.0, x.abs().max().item() + 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ls", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore", [False, True])
def test_cross_entropy_matches_the_kernel(dtype, ls, reduction, ignore):
    g = torch.Generator().manual_seed(8)
    n, c = 37, 1000
    x, t = ce_inputs(n, c, dtype, ignore, g)
    loss, lse, kept_rows = generic("softmax_cross_entropy_forward")(x, t, -100, ls, reduction)
    want_loss, want_lse, want_kept = kernel("softmax_cross_entropy_forward")(x, t, -100, ls, reduction)
    assert torch.equal(kept_rows, want_kept)
    tol = lse_tol(c, x.float())
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=tol)
    # A row's loss is lse minus logits: lse's error; a reduction adds one
    # float32 rounding per row at most.
    kept = (t != -100).sum().item()
    scale = {"none": 1, "sum": n, "mean": n / kept}[reduction]
    torch.testing.assert_close(loss, want_loss, rtol=n * 2.0**-24, atol=tol * scale)

    grad_loss = torch.rand(n, generator=g) if reduction == "none" else torch.tensor(0.7)
    grad = generic("softmax_cross_entropy_backward")(grad_loss, x, t, want_lse, -100, ls, reduction)
    want = kernel("softmax_cross_entropy_backward")(grad_loss, x, t, want_lse, -100, ls, reduction)
    # The forward's count given, the bits of counting again.
    with_count = generic("softmax_cross_entropy_backward")(grad_loss, x, t, want_lse, -100, ls, reduction, kept_rows)
    assert torch.equal(with_count.float(), grad.float())
    assert grad.dtype == dtype and grad.shape == want.shape
    # p = exp(x - lse) in float32 both ways (the exp's rounding: a few ulps of
    # p <= 1), times a row scale <= 1; then one rounding to the output dtype.
    out_ulp = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[dtype]
    torch.testing.assert_close(grad.float(), want.float(), rtol=out_ulp, atol=8 * 2.0**-24)
    if ignore:
        assert torch.all(grad[t == -100] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_backward_out_over_the_logits(dtype):
    """The generic .out overload: the functional result's bits, into the
    logits themselves too."""
    x, t = ce_inputs(9, 50, dtype, True, torch.Generator().manual_seed(3))
    _, lse, kept = kernel("softmax_cross_entropy_forward")(x, t, -100, 0.1, "mean")
    want = generic("softmax_cross_entropy_backward")(torch.tensor(0.5), x, t, lse, -100, 0.1, "mean", kept)
    op = torch.ops.fusetrain.softmax_cross_entropy_backward.out
    logits = x.clone()
    got = op._op_dk(DispatchKey.CompositeExplicitAutograd, torch.tensor(0.5), logits, t, lse, -100, 0.1, "mean", kept,
                    out=logits)
    assert got is logits and same_bits(logits, want)


def test_cross_entropy_every_row_ignored_and_bad_targets():
    x = torch.randn(4, 5)
    t = torch.full((4,), -100)
    loss, _, _ = generic("softmax_cross_entropy_forward")(x, t, -100, 0.0, "mean")
    assert loss.isnan()  # 0 / 0, as torch's mean gives
    g = generic("softmax_cross_entropy_backward")(torch.tensor(1.0), x, t, torch.zeros(4), -100, 0.0, "mean")
    assert torch.all(g == 0)
    # An out-of-range target cannot be checked without a host sync: its row
    # is NaN, the others exact.
    t = torch.tensor([0, 7, 2, -100])
    loss, _, _ = generic("softmax_cross_entropy_forward")(x, t, -100, 0.0, "none")
    assert loss[1].isnan() and not loss[[0, 2, 3]].isnan().any()
    assert loss[3] == 0
    ref = torch.nn.functional.cross_entropy(x[[0, 2]], t[[0, 2]], reduction="none")
    torch.testing.assert_close(loss[[0, 2]], ref)


def test_generic_ops_keep_the_checks():
    with pytest.raises(RuntimeError, match="found_inf must be"):
        generic("non_finite_check_and_unscale_")([torch.ones(2)], torch.zeros(1, dtype=torch.int32),
                                                  torch.ones(1))
    with pytest.raises(ValueError, match="label_smoothing"):
        generic("softmax_cross_entropy_forward")(torch.ones(2, 3), torch.zeros(2, dtype=torch.long),
                                                  -100, 2.0, "mean")
    with pytest.raises(RuntimeError, match=r"exp_avgs\[0\] has shape"):
        p = [torch.ones(3)]
        generic("fused_adamw_")(p, [torch.ones(3)], [torch.ones(2)], [torch.ones(3)], [], [],
                                [torch.zeros(1)], lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0,
                                eps=1e-8, amsgrad=False, maximize=False, decoupled_weight_decay=True)


# ------------------------------------------------------------- end to end

TRAIN_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    import fusetrain, fusetrain.amp, fusetrain.optim, fusetrain.nn
    from fusetrain import _C
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = fusetrain.optim.FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sgd_model = torch.nn.Linear(20, 10)
    sgd = fusetrain.optim.FusedSGD(sgd_model.parameters(), lr=1e-2, momentum=0.9, nesterov=True)
    scaler = fusetrain.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)
    g = torch.Generator().manual_seed(1)
    losses, scales, norms = [], [], []
    for step in range(12):
        x = torch.randn(32, 20, generator=g)
        y = torch.randint(0, 10, (32,), generator=g)
        if step in (3, 7):
            x = x * 1e35  # a loss of ~1e35: inf once scaled, a skipped step
        with fusetrain.amp.autocast("mixed_bfloat16", device_type="cpu"):
            loss = fusetrain.nn.functional.cross_entropy(model(x), y, label_smoothing=0.1)
            loss2 = fusetrain.nn.functional.cross_entropy(sgd_model(x), y)
        scaler.scale(loss + loss2).backward()
        scaler.unscale_(opt)
        norms.append(float(fusetrain.utils.clip_grad_norm_(model.parameters(), 1.0)))
        scaler.step(opt)
        scaler.step(sgd)
        scaler.update()
        opt.zero_grad()
        sgd.zero_grad()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
    params = [p.detach().flatten().tolist() for p in list(model.parameters()) + list(sgd_model.parameters())]
    print(json.dumps({"path": _C.cpu_features()["path"], "losses": losses, "scales": scales,
                      "norms": norms, "params": params}))
    """
)


def run_training(path):
    env = {k: v for k, v in os.environ.items() if k not in ("FUSETRAIN_CPU_PATH", "ATEN_CPU_CAPABILITY")}
    env["FUSETRAIN_CPU_PATH"] = path
    p = subprocess.run([sys.executable, "-c", TRAIN_SCRIPT], capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_scaler_optimizers_and_loss_train_through_the_generic_ops():
    """GradScaler (two overflows skipped, backoff, growth), unscale_,
    clipping, FusedAdamW, FusedSGD and the fused loss, all on the generic
    ops, against the same run on the scalar kernels: the same scale history
    and skips, and the same trajectory within the loss's float32-vs-float64
    summation differences."""
    got, want = run_training("generic"), run_training("scalar")
    assert got["path"] == "generic" and want["path"] == "scalar"
    assert got["scales"] == want["scales"]
    pairs = list(zip(got["scales"], got["scales"][1:]))
    assert any(b < a for a, b in pairs) and any(b > a for a, b in pairs)  # backed off and grew
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(want["norms"]), rtol=1e-4, atol=1e-5,
                               equal_nan=True)  # NaN: the overflowed steps
    for a, b in zip(got["params"], want["params"]):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-5)
