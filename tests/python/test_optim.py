"""fusetrain.optim (FusedAdamW, FusedAdam, FusedSGD) against torch.optim, side
by side on the same parameters and gradients.

- fp32 trajectories over 55 steps, odd sizes, several param groups, every
  option (amsgrad, maximize, weight decay, Adam's decoupled mode, SGD
  momentum / dampening / nesterov / none), closures, params without grads.
- master weights for bf16 / fp16 params: the fp32 master follows torch's fp32
  run on the same gradients, the 16-bit params are the master rounded.
- the GradScaler handshake (torch's and fusetrain's): an overflow changes
  nothing, step counts included; without one, a scaled run equals an
  unscaled run bit for bit.
- state dicts move between torch's optimizers and ours in both directions.
- max_grad_norm folded into the step against clip_grad_norm_ + torch's step.
- errors that name the argument and index; CUDA kernels against the CPU op.

Tolerance for fp32 comparisons with torch (Note [Trajectory tolerance]):
``assert_close(rtol=1e-6, atol=1e-6 * max|expected|)``. The two sides compute
the same update with different operation orders (torch: lerp / addcdiv,
ours: one fused expression), so each step differs by an ulp or so. A purely
elementwise relative tolerance is meaningless for entries near zero (a weight
that crosses zero has an arbitrarily large relative error from a 1-ulp
difference in its update), so the absolute part is 1e-6 of the tensor's
largest magnitude.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusetrain.amp as famp
import fusetrain.optim as fo
from conftest import (
    SCALERS,
    assert_bits_equal,
    assert_state_equal,
    make_batches,
    make_model,
    optimizer_state_snapshot,
    params_of,
)

INF, NAN = float("inf"), float("nan")

# Odd sizes: a 278011-element tensor spans several CPU chunks (32768) and CUDA
# chunks (65536) with a ragged tail; 65537 is one element past a chunk.
SIZES = [(278011,), (7, 3), (1,), (65537,)]
STEPS = 55

# ----------------------------------------------------------------- helpers


def assert_tracks(actual: torch.Tensor, expected: torch.Tensor, what: str = "", rtol: float = 1e-6):
    """Note [Trajectory tolerance]: rtol elementwise, plus rtol * max|expected|
    absolute (elementwise relative error means nothing near zero)."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    expected = expected.detach()
    atol = rtol * float(expected.abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(
        actual.detach(), expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}"
    )


def initial_params(seed: int = 0, dtype: torch.dtype = torch.float32, sizes=SIZES) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in sizes]


def grouped(params: list, groups) -> list:
    """Param groups from (indices, overrides) pairs."""
    return [dict(params=[params[i] for i in idx], **kw) for idx, kw in groups]


# Three groups with different learning rates and weight decays: a group
# override must reach the kernel for its own params only.
ADAM_GROUPS = [([0], {}), ([1, 2], dict(lr=3e-3, weight_decay=0.3)), ([3], dict(lr=2e-2, weight_decay=0.0))]
SGD_GROUPS = [([0], {}), ([1, 2], dict(lr=3e-2, weight_decay=0.01)), ([3], dict(lr=5e-3))]


def grads_for(params: list, g: torch.Generator, scale: float = 1.0) -> list:
    return [torch.randn(p.shape, generator=g) * scale for p in params]


def run_side_by_side(ours_cls, ref_cls, kwargs, groups, *, steps=STEPS, ref_kwargs=None,
                     dtype=torch.float32, seed=0, grad_scale=1.0, clip=None):
    """Runs ours and torch's optimizer on identical params and gradients."""
    init = initial_params(seed, dtype)
    ours = [nn.Parameter(t.clone()) for t in init]
    ref = [nn.Parameter(t.clone()) for t in init]
    opt_o = ours_cls(grouped(ours, groups), **kwargs)
    opt_r = ref_cls(grouped(ref, groups), **{**kwargs, **(ref_kwargs or {})})
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        for a, b, grad in zip(ours, ref, grads_for(ours, g, grad_scale)):
            a.grad = grad.to(dtype)
            b.grad = grad.to(dtype)
        opt_o.step()
        opt_r.step()
    return ours, ref, opt_o, opt_r


def assert_same_trajectory(ours, ref, opt_o, opt_r, rtol=1e-6):
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert_tracks(a, b, f"param {i}", rtol)
    so, sr = opt_o.state_dict()["state"], opt_r.state_dict()["state"]
    assert so.keys() == sr.keys()
    for k in sr:
        for key, value in sr[k].items():
            assert key in so[k], f"state[{k}] lacks {key!r}"
            if key == "step":
                assert float(so[k][key]) == float(value), f"state[{k}]['step']"
            elif isinstance(value, torch.Tensor):
                assert_tracks(so[k][key], value, f"state[{k}][{key!r}]", rtol)


# ------------------------------------------------- fp32 against torch.optim

ADAMW_CASES = {
    "default": {},
    "amsgrad": dict(amsgrad=True),
    "maximize": dict(maximize=True),
    "amsgrad_maximize": dict(amsgrad=True, maximize=True),
    "no_weight_decay": dict(weight_decay=0.0),
    "betas_eps": dict(betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05),
}


@pytest.mark.parametrize("case", list(ADAMW_CASES))
def test_adamw_matches_torch(case):
    ours, ref, oo, orf = run_side_by_side(fo.FusedAdamW, torch.optim.AdamW, dict(lr=1e-2, **ADAMW_CASES[case]), ADAM_GROUPS)
    assert_same_trajectory(ours, ref, oo, orf)


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_adamw_matches_torchs_foreach_and_fused(impl):
    ours, ref, oo, orf = run_side_by_side(
        fo.FusedAdamW, torch.optim.AdamW, dict(lr=1e-2, amsgrad=True), ADAM_GROUPS, ref_kwargs={impl: True}
    )
    assert_same_trajectory(ours, ref, oo, orf)


ADAM_CASES = {
    "default": {},
    "l2_weight_decay": dict(weight_decay=0.1),
    "decoupled_weight_decay": dict(weight_decay=0.1, decoupled_weight_decay=True),
    "amsgrad_l2": dict(weight_decay=0.05, amsgrad=True),
    "maximize_l2": dict(weight_decay=0.05, maximize=True),
}


@pytest.mark.parametrize("case", list(ADAM_CASES))
def test_adam_matches_torch(case):
    groups = [([0], {}), ([1, 2], dict(lr=3e-3)), ([3], dict(lr=2e-2, weight_decay=0.0))]
    ours, ref, oo, orf = run_side_by_side(fo.FusedAdam, torch.optim.Adam, dict(lr=1e-2, **ADAM_CASES[case]), groups)
    assert_same_trajectory(ours, ref, oo, orf)


def test_adam_defaults_are_torchs():
    p = [nn.Parameter(torch.randn(3))]
    for ours, theirs in ((fo.FusedAdam(p), torch.optim.Adam(p)), (fo.FusedAdamW(p), torch.optim.AdamW(p)),
                         (fo.FusedSGD(p), torch.optim.SGD(p))):
        for key, value in theirs.defaults.items():
            if key in ("foreach", "fused", "capturable", "differentiable"):
                continue
            assert ours.defaults[key] == value, f"{type(ours).__name__} default {key}"


SGD_CASES = {
    "plain": dict(momentum=0.0),
    "momentum": dict(momentum=0.9),
    "dampening": dict(momentum=0.9, dampening=0.3),
    "nesterov": dict(momentum=0.9, nesterov=True),
    "weight_decay": dict(momentum=0.5, weight_decay=0.02),
    "maximize": dict(momentum=0.9, weight_decay=0.01, maximize=True),
    "nesterov_wd_maximize": dict(momentum=0.8, nesterov=True, weight_decay=0.01, maximize=True),
}


@pytest.mark.parametrize("case", list(SGD_CASES))
def test_sgd_matches_torch(case):
    ours, ref, oo, orf = run_side_by_side(fo.FusedSGD, torch.optim.SGD, dict(lr=1e-2, **SGD_CASES[case]), SGD_GROUPS)
    assert_same_trajectory(ours, ref, oo, orf)
    if SGD_CASES[case]["momentum"] == 0:
        assert all(s.get("momentum_buffer") is None for s in oo.state.values())


def test_float64_and_float32_params_in_one_group_match_torch():
    # One group, two dtypes: the optimizer launches once per dtype.
    init = initial_params()
    mixed = [t.double() if i % 2 else t for i, t in enumerate(init)]
    ours = [nn.Parameter(t.clone()) for t in mixed]
    ref = [nn.Parameter(t.clone()) for t in mixed]
    oo = fo.FusedAdamW(ours, lr=1e-2, amsgrad=True)
    orf = torch.optim.AdamW(ref, lr=1e-2, amsgrad=True)
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        for a, b in zip(ours, ref):
            grad = torch.randn(a.shape, generator=g, dtype=a.dtype)
            a.grad, b.grad = grad.clone(), grad
        oo.step()
        orf.step()
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert_tracks(a, b, f"param {i} ({a.dtype})", 1e-6 if a.dtype == torch.float32 else 1e-12)


def test_transposed_param_with_a_contiguous_grad_matches_torch():
    # A user may assign p.grad in any layout; torch steps it, so must we.
    base = torch.randn(6, 4)
    ours, ref = nn.Parameter(base.clone().t()), nn.Parameter(base.clone().t())
    oo, orf = fo.FusedAdamW([ours], lr=1e-2), torch.optim.AdamW([ref], lr=1e-2)
    so, sr = fo.FusedSGD([ours], lr=1e-2, momentum=0.9), torch.optim.SGD([ref], lr=1e-2, momentum=0.9)
    for _ in range(3):
        grad = torch.randn(4, 6)
        ours.grad, ref.grad = grad.clone(), grad.clone()
        oo.step()
        orf.step()
        so.step()
        sr.step()
    assert_tracks(ours, ref, "transposed param")


# ------------------------------------------ zero_grad, params without grads


def test_zero_grad_sets_to_none_and_then_step_changes_nothing():
    init = initial_params()
    ps = [nn.Parameter(t.clone()) for t in init]
    opt = fo.FusedAdamW(grouped(ps, ADAM_GROUPS), lr=1e-2)
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    before, state_before = [p.detach().clone() for p in ps], optimizer_state_snapshot(opt)
    opt.zero_grad()  # set_to_none=True is the default, as torch's
    assert all(p.grad is None for p in ps)
    opt.step()
    for i, (p, b) in enumerate(zip(ps, before)):
        assert_bits_equal(p.detach(), b, f"param {i}")
    assert_state_equal(optimizer_state_snapshot(opt), state_before, "after a step without grads")
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in ps)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param((fo.FusedAdamW, torch.optim.AdamW, dict(lr=1e-2, amsgrad=True)), id="adamw"),
        pytest.param((fo.FusedAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1)), id="adam"),
        pytest.param((fo.FusedSGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9, dampening=0.2)), id="sgd"),
    ],
)
def test_params_without_grads_are_untouched_and_stepped_like_torch(make):
    ours_cls, ref_cls, kwargs = make
    init = initial_params()
    ours = [nn.Parameter(t.clone()) for t in init]
    ref = [nn.Parameter(t.clone()) for t in init]
    oo, orf = ours_cls(grouped(ours, ADAM_GROUPS), **kwargs), ref_cls(grouped(ref, ADAM_GROUPS), **kwargs)
    g = torch.Generator().manual_seed(5)
    never = init[2]
    for step in range(12):
        # param 2 never has a gradient; param 1 only on every third step, and
        # param 3 only from step 5 on (its state starts late).
        for i, (a, b) in enumerate(zip(ours, ref)):
            has = i == 0 or (i == 1 and step % 3 == 0) or (i == 3 and step >= 5)
            grad = torch.randn(a.shape, generator=g) if has else None
            a.grad = None if grad is None else grad.clone()
            b.grad = grad
        if step == 3:
            frozen = ours[3].detach().clone()
        oo.step()
        orf.step()
        if step == 3:
            assert_bits_equal(ours[3].detach(), frozen, "param 3 before its first grad")
    assert_bits_equal(ours[2].detach(), never, "param 2 (never had a grad)")
    assert ours[2] not in oo.state or not oo.state[ours[2]]
    assert_same_trajectory(ours, ref, oo, orf)


# ----------------------------------------------------------------- closure


@pytest.mark.parametrize("make", [
    (fo.FusedAdamW, torch.optim.AdamW, dict(lr=1e-2)),
    (fo.FusedSGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9)),
], ids=["adamw", "sgd"])
def test_closure_is_called_once_with_grad_and_its_loss_returned(make):
    ours_cls, ref_cls, kwargs = make
    model_o, model_r = make_model(0), make_model(0)
    oo, orf = ours_cls(model_o.parameters(), **kwargs), ref_cls(model_r.parameters(), **kwargs)
    for x, y in make_batches(6):
        calls = []

        def closure(model, opt):
            def fn():
                calls.append(torch.is_grad_enabled())
                opt.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                return loss
            return fn

        loss_o = oo.step(closure(model_o, oo))
        loss_r = orf.step(closure(model_r, orf))
        assert calls == [True, True]
        assert isinstance(loss_o, torch.Tensor)
        torch.testing.assert_close(loss_o, loss_r, rtol=1e-5, atol=0)
    for (name, a), b in zip(model_o.named_parameters(), model_r.parameters()):
        assert_tracks(a, b, name, rtol=1e-5)  # the grads differ by the params' ulps
    assert oo.step() is None


# ---------------------------------------------------------- master weights


def _master_run(ours_cls, ref_cls, kwargs, groups, dtype, steps=STEPS):
    """Three runs on the same 16-bit gradients: ours with 16-bit params and
    master weights, ours on fp32 params, torch's on fp32 params."""
    init = initial_params(0, dtype)
    low = [nn.Parameter(t.clone()) for t in init]
    f32 = [nn.Parameter(t.float()) for t in init]  # exact: 16-bit values are fp32 values
    ref = [nn.Parameter(t.float()) for t in init]
    oo = ours_cls(grouped(low, groups), master_weights=True, **kwargs)
    o32 = ours_cls(grouped(f32, groups), **kwargs)
    orf = ref_cls(grouped(ref, groups), **kwargs)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        for a, b, c, grad in zip(low, f32, ref, grads_for(low, g)):
            a.grad = grad.to(dtype)
            b.grad = a.grad.float()  # the same (rounded) gradients, exactly
            c.grad = a.grad.float()
        oo.step()
        o32.step()
        orf.step()
        for i, p in enumerate(low):
            master = oo.state[p]["master_param"]
            assert master.dtype == torch.float32
            # Exactly the master rounded to the param's dtype, every step.
            assert torch.equal(p.detach(), master.to(dtype)), f"step {step} param {i}: p != master.to({dtype})"
    return low, f32, ref, oo, o32, orf


MASTER_CASES = {
    "adamw": (fo.FusedAdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adamw_amsgrad": (fo.FusedAdamW, torch.optim.AdamW, dict(lr=1e-2, amsgrad=True, maximize=True)),
    "adam_l2": (fo.FusedAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1)),
    "sgd_nesterov": (fo.FusedSGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "sgd_plain": (fo.FusedSGD, torch.optim.SGD, dict(lr=1e-2)),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", list(MASTER_CASES))
def test_master_weights_track_the_fp32_run(case, dtype):
    # The master update is fp32 maths on exactly the fp32 run's gradients (the
    # 16-bit gradients converted), so the master equals our own fp32 run bit
    # for bit and tracks torch's fp32 run within the fp32 tolerance (1e-6,
    # Note [Trajectory tolerance]); the 16-bit params are the master rounded
    # (checked every step in _master_run).
    ours_cls, ref_cls, kwargs = MASTER_CASES[case]
    groups = ADAM_GROUPS if ref_cls is not torch.optim.SGD else SGD_GROUPS
    low, f32, ref, oo, o32, orf = _master_run(ours_cls, ref_cls, kwargs, groups, dtype)
    for i, (p, q, r) in enumerate(zip(low, f32, ref)):
        assert p.dtype == dtype
        master = oo.state[p]["master_param"]
        assert_bits_equal(master, q.detach(), f"master {i} vs our fp32 run")
        if case != "adam_l2":
            # (Adam's L2 term: a 16-bit gradient g and param p often cancel
            # exactly, g + wd * p == 0, where torch's FMA leaves a 1e-9 residue
            # that Adam normalises into a full lr-sized step: no tolerance
            # holds for those elements. test_adam_matches_torch covers L2
            # with fp32 gradients, and the bit-equality above the master.)
            assert_tracks(master, r.detach(), f"master {i} vs torch's fp32 run")
    sd = oo.state_dict()["state"]
    ref_sd = o32.state_dict()["state"]
    for k, s in sd.items():
        assert s["master_param"].dtype == torch.float32, "master_param in the state dict"
        assert torch.equal(s["master_param"], oo.state[low[k]]["master_param"])
        assert s.keys() - {"master_param"} == ref_sd.get(k, {}).keys()
        for key, value in ref_sd.get(k, {}).items():
            if isinstance(value, torch.Tensor):
                assert s[key].dtype == torch.float32, f"state {key} of a master-weights param"
                assert_bits_equal(s[key], value, f"state[{k}][{key!r}]")


def test_master_weights_leave_fp32_params_alone():
    # master_weights applies to 16-bit params; fp32 ones step as without it.
    a, b = nn.Parameter(torch.randn(1001)), None
    b = nn.Parameter(a.detach().clone())
    oa, ob = fo.FusedAdamW([a], lr=1e-2, master_weights=True), fo.FusedAdamW([b], lr=1e-2)
    for _ in range(3):
        grad = torch.randn(1001)
        a.grad, b.grad = grad.clone(), grad.clone()
        oa.step()
        ob.step()
    assert_bits_equal(a.detach(), b.detach(), "fp32 param with master_weights=True")
    assert "master_param" not in oa.state[a]


# ------------------------------------------------- found_inf / GradScaler

FOUND_INF_OPTS = {
    "adamw": lambda ps: fo.FusedAdamW(ps, lr=1e-2, weight_decay=0.1),
    "adamw_amsgrad": lambda ps: fo.FusedAdamW(ps, lr=1e-2, amsgrad=True),
    "adam": lambda ps: fo.FusedAdam(ps, lr=1e-2, weight_decay=0.1),
    "sgd": lambda ps: fo.FusedSGD(ps, lr=1e-2, momentum=0.9, dampening=0.1),
    "adamw_clip": lambda ps: fo.FusedAdamW(ps, lr=1e-2, max_grad_norm=0.5),
}


@pytest.mark.parametrize("master", [False, True], ids=["fp32", "bf16_master"])
@pytest.mark.parametrize("opt_name", list(FOUND_INF_OPTS))
@pytest.mark.parametrize("scaler_name", list(SCALERS))
@pytest.mark.parametrize("poison", [INF, NAN], ids=["inf", "nan"])
def test_found_inf_changes_nothing(scaler_name, opt_name, master, poison):
    dtype = torch.bfloat16 if master else torch.float32
    model = make_model(0, dtype=dtype)
    factory = FOUND_INF_OPTS[opt_name]
    opt = factory(model.parameters())
    if master:
        for g in opt.param_groups:
            g["master_weights"] = True
    scaler = SCALERS[scaler_name]("cpu", init_scale=2.0**10)
    batches = make_batches(6, dtype=dtype)
    overflow_at = (0, 3)  # the very first step (state just created) and a later one
    skipped = 0
    for i, (x, y) in enumerate(batches):
        opt.zero_grad()
        scaler.scale(F.mse_loss(model(x), y)).backward()
        if i in overflow_at:
            model.fc2.weight.grad[1, 3] = poison
            params_before, state_before = params_of(model), optimizer_state_snapshot(opt)
        scaler.step(opt)
        if i in overflow_at:
            skipped += 1
            for (name, p), b in zip(model.named_parameters(), params_before):
                assert_bits_equal(p.detach(), b, f"step {i}: {name} after a skipped step")
            after = optimizer_state_snapshot(opt)
            if i == 0:
                # Fresh state may appear (as torch's fused optimizers create it),
                # but holds only zeros, the initial master and step 0.
                for k, s in after.items():
                    for key, v in s.items():
                        if key == "step":
                            assert float(v) == 0.0, f"state[{k}]['step'] advanced on a skipped step"
                        elif key == "master_param":
                            assert torch.equal(v.to(dtype), params_before[k])
                        elif isinstance(v, torch.Tensor):
                            assert not v.any(), f"state[{k}][{key!r}] changed on a skipped step"
            else:
                assert_state_equal(after, state_before, f"step {i}: state after a skipped step")
        scaler.update()
    state = opt.state_dict()["state"]
    assert len(state) == len(list(model.parameters())), "every parameter has state after the clean steps"
    if opt_name == "sgd":
        # SGD keeps no step count (as torch's): its momentum buffers must
        # exist and be finite, however many steps were skipped.
        assert all("step" not in s and torch.isfinite(s["momentum_buffer"]).all() for s in state.values())
    else:
        steps = [float(s["step"]) for s in state.values()]
        assert steps == [len(batches) - skipped] * len(state), steps


@pytest.mark.parametrize("opt_name", list(FOUND_INF_OPTS))
@pytest.mark.parametrize("scaler_name", list(SCALERS))
@pytest.mark.parametrize("unscale_first", [False, True], ids=["in_kernel", "unscale_first"])
def test_scaled_run_equals_unscaled_run(scaler_name, opt_name, unscale_first):
    # Power-of-two scale: the scaled gradients, and their unscaling (in the
    # kernel, or by unscale_), are exact, so the runs agree bit for bit.
    factory = FOUND_INF_OPTS[opt_name]
    m_s, m_u = make_model(0), make_model(0)
    o_s, o_u = factory(m_s.parameters()), factory(m_u.parameters())
    scaler = SCALERS[scaler_name]("cpu", init_scale=2.0**12, growth_interval=3)
    for x, y in make_batches(8):
        o_s.zero_grad()
        scaler.scale(F.mse_loss(m_s(x), y)).backward()
        if unscale_first:
            scaler.unscale_(o_s)
        scaler.step(o_s)
        scaler.update()
        o_u.zero_grad()
        F.mse_loss(m_u(x), y).backward()
        o_u.step()
    assert scaler.get_scale() > 2.0**12  # it grew: several scales were exercised
    for (name, a), b in zip(m_s.named_parameters(), m_u.parameters()):
        assert_bits_equal(a.detach(), b.detach(), name)
    assert_state_equal(optimizer_state_snapshot(o_s), optimizer_state_snapshot(o_u), "scaled vs unscaled")
    if opt_name == "adamw_clip":
        assert torch.equal(o_s.last_grad_norm, o_u.last_grad_norm)


def test_step_supports_amp_scaling():
    p = [nn.Parameter(torch.randn(3))]
    for cls in (fo.FusedAdamW, fo.FusedAdam, fo.FusedSGD):
        assert cls(p, lr=1e-3)._step_supports_amp_scaling is True


# ---------------------------------------------------- state dict interchange

INTERCHANGE = {
    "adamw": (fo.FusedAdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adamw_amsgrad": (fo.FusedAdamW, torch.optim.AdamW, dict(lr=1e-2, amsgrad=True)),
    "adam_l2": (fo.FusedAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1)),
    "adam_decoupled": (fo.FusedAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)),
    "sgd_momentum": (fo.FusedSGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9, dampening=0.1)),
    "sgd_nesterov": (fo.FusedSGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True)),
}


def _through_file(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("direction", ["torch_to_ours", "ours_to_torch"])
@pytest.mark.parametrize("case", list(INTERCHANGE))
def test_state_dict_interchange_continues_like_the_source(case, direction):
    ours_cls, ref_cls, kwargs = INTERCHANGE[case]
    src_cls, dst_cls = (ref_cls, ours_cls) if direction == "torch_to_ours" else (ours_cls, ref_cls)
    groups = SGD_GROUPS if ref_cls is torch.optim.SGD else ADAM_GROUPS
    src = [nn.Parameter(t.clone()) for t in initial_params()]
    opt_src = src_cls(grouped(src, groups), **kwargs)
    g = torch.Generator().manual_seed(7)
    for _ in range(10):
        for p, grad in zip(src, grads_for(src, g)):
            p.grad = grad
        opt_src.step()
    sd = _through_file(opt_src.state_dict())
    dst = [nn.Parameter(p.detach().clone()) for p in src]
    # The destination starts from the default options: everything comes from the state dict.
    opt_dst = dst_cls(grouped(dst, [(idx, {}) for idx, _ in groups]), lr=1.0)
    opt_dst.load_state_dict(sd)
    # Loaded state equals the source's exactly.
    loaded = opt_dst.state_dict()
    for k, s in sd["state"].items():
        for key, v in s.items():
            got = loaded["state"][k][key]
            if key == "step":
                assert float(got) == float(v)
            elif isinstance(v, torch.Tensor):
                assert_bits_equal(got, v, f"loaded state[{k}][{key!r}]")
    for gs, gd in zip(sd["param_groups"], loaded["param_groups"]):
        assert gd["lr"] == gs["lr"] and gd["weight_decay"] == gs["weight_decay"]
    # Both continue on the same gradients.
    for _ in range(10):
        for a, b, grad in zip(src, dst, grads_for(src, g)):
            a.grad, b.grad = grad.clone(), grad
        opt_src.step()
        opt_dst.step()
    for i, (a, b) in enumerate(zip(dst, src)):
        assert_tracks(a, b, f"param {i} after continuing", 1e-6)
    assert_same_trajectory(dst, src, opt_dst, opt_src)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", ["adamw_amsgrad", "sgd_momentum"])
def test_master_weights_state_stays_fp32_through_save_and_load(case, dtype):
    ours_cls, _, kwargs = INTERCHANGE[case]
    init = initial_params(0, dtype)
    a = [nn.Parameter(t.clone()) for t in init]
    oa = ours_cls(a, master_weights=True, **kwargs)
    g = torch.Generator().manual_seed(9)
    for _ in range(5):
        for p, grad in zip(a, grads_for(a, g)):
            p.grad = grad.to(dtype)
        oa.step()
    sd = _through_file(oa.state_dict())
    b = [nn.Parameter(p.detach().clone()) for p in a]
    ob = ours_cls(b, master_weights=True, **kwargs)
    ob.load_state_dict(sd)
    for i, p in enumerate(b):
        for key, v in oa.state[a[i]].items():
            got = ob.state[p][key]
            if key == "step":
                assert got.dtype == torch.float32 and float(got) == float(v)
            else:
                assert got.dtype == torch.float32, f"{key} became {got.dtype} on load"
                assert_bits_equal(got, v, f"loaded {key} of param {i}")
    # The resumed run continues exactly as the uninterrupted one.
    for _ in range(5):
        for x, y, grad in zip(a, b, grads_for(a, g)):
            x.grad, y.grad = grad.to(dtype), grad.to(dtype)
        oa.step()
        ob.step()
    for i, (x, y) in enumerate(zip(a, b)):
        assert_bits_equal(y.detach(), x.detach(), f"param {i} after resuming")
        assert_bits_equal(ob.state[y]["master_param"], oa.state[x]["master_param"], f"master {i}")


def test_torch_bf16_state_loads_into_master_weights_as_fp32():
    # A bf16 model trained with torch's AdamW (bf16 state) moves to ours with
    # master weights: the moments become fp32, the master starts from the param.
    init = initial_params(0, torch.bfloat16)
    ps = [nn.Parameter(t.clone()) for t in init]
    ref = torch.optim.AdamW(ps, lr=1e-2)
    for p in ps:
        p.grad = torch.randn_like(p)
    ref.step()
    sd = _through_file(ref.state_dict())
    ours = fo.FusedAdamW(ps, lr=1e-2, master_weights=True)
    ours.load_state_dict(sd)
    for i, p in enumerate(ps):
        s = ours.state[p]
        assert s["exp_avg"].dtype == torch.float32 and s["exp_avg_sq"].dtype == torch.float32
        assert torch.equal(s["exp_avg"], sd["state"][i]["exp_avg"].float())
    ours.step()
    for p in ps:
        assert torch.equal(p.detach(), ours.state[p]["master_param"].to(torch.bfloat16))
        assert float(ours.state[p]["step"]) == 2.0


# ------------------------------------------------------- folded clipping


def assert_norm_close(ours: torch.Tensor, torch_norm: torch.Tensor, grads) -> float:
    """Our norm (fp64 accumulation on the CPU) of `grads` against torch's
    (fp32): both against an fp64 reference; ours within a few fp32 roundings
    of it, and never farther from it than twice torch's own error. Returns
    torch's error."""
    exact = torch.linalg.vector_norm(torch.cat([g.double().flatten() for g in grads]))
    ours = ours.reshape(()).double()
    err_ours = float((ours - exact).abs() / exact)
    err_torch = float((torch_norm.double() - exact).abs() / exact)
    assert err_ours <= 3e-7, f"norm {float(ours)} vs exact {float(exact)}: {err_ours:.2e} relative"
    assert err_ours <= max(2 * err_torch, 3e-7), (err_ours, err_torch)
    return err_torch


@pytest.mark.parametrize("make", [
    (fo.FusedAdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (fo.FusedSGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9)),
], ids=["adamw", "sgd"])
def test_max_grad_norm_equals_clip_grad_norm_then_torchs_step(make):
    ours_cls, ref_cls, kwargs = make
    max_norm = 600.0  # the gradients' norm is ~586 x the step's factor
    init = initial_params()
    ours = [nn.Parameter(t.clone()) for t in init]
    ref = [nn.Parameter(t.clone()) for t in init]
    groups = ADAM_GROUPS if ref_cls is not torch.optim.SGD else SGD_GROUPS
    oo = ours_cls(grouped(ours, groups), max_grad_norm=max_norm, **kwargs)
    orf = ref_cls(grouped(ref, groups), **kwargs)
    g = torch.Generator().manual_seed(11)
    clipped, torch_err = 0, 0.0
    for step in range(STEPS):
        factor = (0.5, 2.0, 7.0)[step % 3]  # below the limit, above it, far above
        for a, b, grad in zip(ours, ref, grads_for(ours, g, factor)):
            a.grad, b.grad = grad.clone(), grad
        norm = torch.nn.utils.clip_grad_norm_(ref, max_norm)
        orf.step()
        unclipped = [a.grad.clone() for a in ours]
        oo.step()
        assert oo.last_grad_norm.dtype == torch.float32
        torch_err = max(torch_err, assert_norm_close(oo.last_grad_norm, norm, unclipped))
        # The step leaves p.grad clipped, as clip_grad_norm_ leaves torch's
        # (one division by 1/coef here, a multiplication by coef there).
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a.grad, b.grad, rtol=max(1e-6, 4 * torch_err), atol=0)
        clipped += bool(norm > max_norm)
    assert 0 < clipped < STEPS
    # torch's fp32 norm is off by up to ~2e-6 (ours by < 1e-7): its clip
    # coefficient carries that error, and exp_avg_sq its square. Tolerance:
    # twice torch's own error in v, or 1e-6, whichever is larger.
    assert_same_trajectory(ours, ref, oo, orf, rtol=max(1e-6, 4 * torch_err))


@pytest.mark.parametrize("unscale_first", [False, True], ids=["in_kernel", "unscale_first"])
@pytest.mark.parametrize("scaler_name", list(SCALERS))
def test_max_grad_norm_with_a_scaler_clips_the_unscaled_norm(scaler_name, unscale_first):
    max_norm = 0.3
    m_o, m_r = make_model(0), make_model(0)
    oo = fo.FusedAdamW(m_o.parameters(), lr=1e-2, max_grad_norm=max_norm)
    orf = torch.optim.AdamW(m_r.parameters(), lr=1e-2)
    s_o = SCALERS[scaler_name]("cpu", init_scale=2.0**14)
    s_r = torch.amp.GradScaler("cpu", init_scale=2.0**14)
    norms = []
    for x, y in make_batches(20):
        oo.zero_grad()
        s_o.scale(F.mse_loss(m_o(x), y)).backward()
        if unscale_first:
            s_o.unscale_(oo)
        s_o.step(oo)
        s_o.update()
        orf.zero_grad()
        s_r.scale(F.mse_loss(m_r(x), y)).backward()
        s_r.unscale_(orf)
        norm = torch.nn.utils.clip_grad_norm_(m_r.parameters(), max_norm)
        s_r.step(orf)
        s_r.update()
        # (The two models drift apart by ulps, so their gradients differ a
        # little: 1e-5 here; the exact norm is tested above.)
        torch.testing.assert_close(oo.last_grad_norm.reshape(()), norm, rtol=1e-5, atol=0)
        norms.append(float(norm))
    assert any(n > max_norm for n in norms) and min(norms) < 1e3, norms
    for (name, a), b in zip(m_o.named_parameters(), m_r.parameters()):
        assert_tracks(a, b.detach(), name, rtol=1e-5)


def test_max_grad_norm_must_be_positive():
    p = [nn.Parameter(torch.randn(3))]
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="max_grad_norm"):
            fo.FusedAdamW(p, max_grad_norm=bad)


# ------------------------------------------- one step against float64 maths

OP_SIZES = [(278011,), (7, 3), (1,), (65537,), (8,), (33,)]  # chunk edges, 8-lane tails


def _op_case(pdtype, master, amsgrad, seed=0, step=4.0):
    """Random, never-zero op arguments (moments positive where they must be)."""
    g = torch.Generator().manual_seed(seed)
    sdtype = torch.float32 if master else pdtype

    def rnd(shape, dtype, positive=False):
        t = torch.randn(shape, generator=g)
        t = torch.where(t.abs() < 1e-3, torch.full_like(t, 0.5), t)
        return (t.abs() * 0.1 if positive else t).to(dtype)

    masters = [rnd(s, torch.float32) for s in OP_SIZES] if master else []
    return dict(
        params=[m.to(pdtype) for m in masters] if master else [rnd(s, pdtype) for s in OP_SIZES],
        grads=[rnd(s, pdtype) for s in OP_SIZES],
        exp_avgs=[rnd(s, sdtype) * 0.1 for s in OP_SIZES],
        exp_avg_sqs=[rnd(s, sdtype, positive=True) for s in OP_SIZES],
        max_exp_avg_sqs=[rnd(s, sdtype, positive=True) for s in OP_SIZES] if amsgrad else [],
        master_params=masters,
        state_steps=[torch.full((), step + i % 3) for i in range(len(OP_SIZES))],
    )


def _adam_reference(case, i, kw, inv_scale):
    """One Adam(W) step of tensor i in float64: {name: (value, magnitude)} for
    "param", "exp_avg", "exp_avg_sq" and "second" (max v with amsgrad, else v),
    where magnitude is that of the terms the kernel combines into the
    value (what its fp32 roundings are relative to, see _assert_near_reference)."""
    d = torch.float64
    p = (case["master_params"][i] if case["master_params"] else case["params"][i]).to(d)
    grad = case["grads"][i].to(d) * inv_scale
    if kw["maximize"]:
        grad = -grad
    lr, wd = kw["lr"], kw["weight_decay"]
    p_mag = p.abs()
    if wd:
        if kw["decoupled_weight_decay"]:
            p = p * (1 - lr * wd)
        else:
            grad = grad + wd * p
    m_old = kw["beta1"] * case["exp_avgs"][i].to(d)
    m = m_old + (1 - kw["beta1"]) * grad
    v = kw["beta2"] * case["exp_avg_sqs"][i].to(d) + (1 - kw["beta2"]) * grad * grad
    second = torch.maximum(case["max_exp_avg_sqs"][i].to(d), v) if kw["amsgrad"] else v
    step = float(case["state_steps"][i]) + 1
    bc1, bc2 = 1 - kw["beta1"] ** step, 1 - kw["beta2"] ** step
    update = (lr / bc1) * m / (second.sqrt() / bc2**0.5 + kw["eps"])
    return {
        "param": (p - update, p_mag + update.abs()),
        "exp_avg": (m, m_old.abs() + (1 - kw["beta1"]) * grad.abs()),
        "exp_avg_sq": (v, v),
        "second": (second, second),
    }


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` at each |x| (float64): eps * 2^floor(log2 |x|)
    for normal magnitudes, the smallest subnormal's spacing below them (and
    at zero)."""
    fi = torch.finfo(dtype)
    _, e = torch.frexp(x.abs())  # |x| = f * 2^e, f in [0.5, 1)
    spacing = fi.eps * torch.pow(2.0, (e - 1).to(torch.float64))
    return torch.where(x.abs() < fi.tiny, torch.full_like(spacing, fi.tiny * fi.eps), spacing)


def _assert_near_reference(actual, expected, magnitude, what):
    """fp32/fp64 results: the fp32 math's few roundings (2e-6 of max, which
    the 1e-5-relative error of a float beta would break). 16-bit results,
    elementwise: the kernel's fp32 result rounded once to the 16-bit type is
    within half an ulp of it, and the fp32 result within a few fp32 roundings
    (8 * 2^-23 relative to `magnitude`, that of the terms it combines) of
    the exact one; so |actual - exact| <= ulp(exact) + 8 * 2^-23 * magnitude. The
    second term matters only where the terms cancel (a weight stepping across
    zero), where it is still far below one ulp of the terms."""
    if actual.dtype in (torch.float16, torch.bfloat16):
        allowed = ulp(expected, actual.dtype) + 8 * torch.finfo(torch.float32).eps * magnitude
        err = (actual.double() - expected).abs()
        bad = ~(err <= allowed)
        if bad.any():
            i = int(bad.flatten().nonzero()[0])
            raise AssertionError(
                f"{what}: {int(bad.sum())} of {bad.numel()} elements beyond one {actual.dtype} ulp; first "
                f"at flat index {i}: {actual.flatten()[i].item()!r} vs exact {expected.flatten()[i].item()!r} "
                f"(allowed {allowed.flatten()[i].item():.3g})")
    else:
        rtol = 2e-6 if actual.dtype == torch.float32 else 1e-12
        assert_tracks(actual.double(), expected, what, rtol=rtol)


ADAM_MODES = {
    "adamw": dict(decoupled_weight_decay=True, weight_decay=0.1, maximize=False),
    "adam_l2": dict(decoupled_weight_decay=False, weight_decay=0.1, maximize=True),
    "no_decay": dict(decoupled_weight_decay=True, weight_decay=0.0, maximize=False),
}
DTYPE_MASTER = {
    "fp32": (torch.float32, False), "fp64": (torch.float64, False),
    "bf16": (torch.bfloat16, False), "bf16_master": (torch.bfloat16, True),
    "fp16": (torch.float16, False), "fp16_master": (torch.float16, True),
}


@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "grad_scale"])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("mode", list(ADAM_MODES))
@pytest.mark.parametrize("dtype_master", list(DTYPE_MASTER))
def test_fused_adamw_op_step_matches_float64_maths(dtype_master, mode, amsgrad, scaled):
    pdtype, master = DTYPE_MASTER[dtype_master]
    case = _op_case(pdtype, master, amsgrad)
    if master:
        for p in case["params"]:
            p.fill_(NAN)  # write-only with masters
    before = copy.deepcopy(case)
    # lr 0.1 and beta2 0.9 at step 5-7 move the median weight by ~11 bf16
    # ulps and ~88 fp16 ulps (lr 1e-2 with beta2 0.999 moved it by a quarter
    # of a bf16 ulp, which a kernel that never updates the weights, or
    # applies twice or half the lr, passed within one ulp).
    kw = dict(lr=0.1, beta1=0.9, beta2=0.9, eps=1e-8, amsgrad=amsgrad, **ADAM_MODES[mode])
    scale = 1024.0 if scaled else 1.0
    if scaled:
        case["grads"] = [g * 1024 for g in case["grads"]]
        before["grads"] = [g.clone() for g in case["grads"]]
    _call_adam(case, grad_scale=torch.full((), scale) if scaled else None, **kw)
    for i in range(len(OP_SIZES)):
        ref = _adam_reference(before, i, kw, 1.0 / scale)
        _assert_near_reference(case["exp_avgs"][i], *ref["exp_avg"], f"exp_avgs[{i}]")
        _assert_near_reference(case["exp_avg_sqs"][i], *ref["exp_avg_sq"], f"exp_avg_sqs[{i}]")
        if amsgrad:
            _assert_near_reference(case["max_exp_avg_sqs"][i], *ref["second"], f"max_exp_avg_sqs[{i}]")
        if master:
            _assert_near_reference(case["master_params"][i], *ref["param"], f"master_params[{i}]")
            assert torch.equal(case["params"][i], case["master_params"][i].to(pdtype))
        else:
            _assert_near_reference(case["params"][i], *ref["param"], f"params[{i}]")
        assert float(case["state_steps"][i]) == float(before["state_steps"][i]) + 1
        # With a grad_scale the op leaves the unscaled gradient (torch's fused
        # optimizers do), else the gradient as it was.
        expected_grad = (before["grads"][i].double() / scale).to(pdtype)
        assert torch.equal(case["grads"][i], expected_grad), "grads must end divided by grad_scale"


@pytest.mark.parametrize("nesterov", [False, True], ids=["momentum", "nesterov"])
@pytest.mark.parametrize("dtype_master", ["fp32", "bf16", "bf16_master", "fp16_master", "fp64"])
@pytest.mark.parametrize("first", [False, True], ids=["running", "first_step"])
def test_fused_sgd_op_step_matches_float64_maths(dtype_master, nesterov, first):
    pdtype, master = DTYPE_MASTER[dtype_master]
    src = _op_case(pdtype, master, amsgrad=False, seed=2)
    case = dict(params=src["params"], grads=src["grads"], bufs=src["exp_avgs"], masters=src["master_params"])
    if first:
        for b in case["bufs"]:
            b.fill_(NAN)  # a first step only writes the buffers
    before = copy.deepcopy(case)
    lr, mom, damp, wd = 0.05, 0.9, 0.0 if nesterov else 0.2, 0.01
    torch.ops.fusetrain.fused_sgd_(case["params"], case["grads"], case["bufs"], case["masters"], lr=lr,
                                   momentum=mom, dampening=damp, weight_decay=wd, nesterov=nesterov,
                                   maximize=True, is_first_step=first, grad_scale=torch.full((), 4.0))
    d = torch.float64
    for i in range(len(OP_SIZES)):
        # Each value with the magnitude of the terms it combines (see
        # _assert_near_reference).
        p = (before["masters"][i] if master else before["params"][i]).to(d)
        g = before["grads"][i].to(d)
        grad, grad_mag = -g / 4.0 + wd * p, g.abs() / 4.0 + wd * p.abs()
        if first:
            buf, buf_mag = grad, grad_mag
        else:
            buf_old = before["bufs"][i].to(d)
            buf = mom * buf_old + (1 - damp) * grad
            buf_mag = mom * buf_old.abs() + (1 - damp) * grad_mag
        step, step_mag = (grad + mom * buf, grad_mag + mom * buf_mag) if nesterov else (buf, buf_mag)
        p, p_mag = p - lr * step, p.abs() + lr * step_mag
        _assert_near_reference(case["bufs"][i], buf, buf_mag, f"momentum_buffers[{i}]")
        _assert_near_reference(case["masters"][i] if master else case["params"][i], p, p_mag, f"param {i}")
        if master:
            assert torch.equal(case["params"][i], case["masters"][i].to(pdtype))


def test_fused_adamw_op_is_identical_for_one_and_two_threads(intra_op_threads):
    results = []
    for threads in (2, 1):
        torch.set_num_threads(threads)
        case = _op_case(torch.bfloat16, True, amsgrad=True, seed=8)
        _call_adam(case, lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1, eps=1e-8, amsgrad=True,
                   maximize=False, decoupled_weight_decay=True)
        results.append(case)
    for field, ts in results[0].items():
        for i, (a, b) in enumerate(zip(ts, results[1][field])):
            assert_bits_equal(a, b, f"{field}[{i}] with 2 threads vs 1")


# --------------------------------------------------------- argument errors


def _adam_lists(dtype=torch.float32, sizes=((5,), (3, 4), (7,))):
    params = [torch.randn(s).to(dtype) for s in sizes]
    return dict(
        params=params,
        grads=[torch.randn_like(p) for p in params],
        exp_avgs=[torch.zeros_like(p) for p in params],
        exp_avg_sqs=[torch.zeros_like(p) for p in params],
        max_exp_avg_sqs=[],
        master_params=[],
        state_steps=[torch.zeros(()) for _ in params],
    )


def _call_adam(lists, **kw):
    args = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False,
                maximize=False, decoupled_weight_decay=True)
    args.update(kw)
    torch.ops.fusetrain.fused_adamw_(
        lists["params"], lists["grads"], lists["exp_avgs"], lists["exp_avg_sqs"],
        lists["max_exp_avg_sqs"], lists["master_params"], lists["state_steps"], **args)


def _bad(field, index, value):
    def edit(lists):
        lists[field][index] = value(lists)
    return edit


ADAM_ERRORS = {
    "grad shape": (_bad("grads", 2, lambda L: torch.randn(8)), r"grads\[2\] has shape \[8\] but params\[2\] has shape \[7\]"),
    "exp_avg dtype": (_bad("exp_avgs", 1, lambda L: torch.zeros(3, 4, dtype=torch.float64)), r"exp_avgs\[1\] must be Float, got Double"),
    "exp_avg_sq dtype": (_bad("exp_avg_sqs", 0, lambda L: torch.zeros(5, dtype=torch.float16)), r"exp_avg_sqs\[0\] must be Float"),
    "grad dtype": (_bad("grads", 1, lambda L: torch.randn(3, 4).bfloat16()), r"grads\[1\] must be Float, got BFloat16"),
    "step dtype": (_bad("state_steps", 2, lambda L: torch.zeros((), dtype=torch.float64)), r"state_steps\[2\]"),
    "step shape": (_bad("state_steps", 1, lambda L: torch.zeros(2)), r"state_steps\[1\] must hold exactly one element"),
    "state strides": (_bad("exp_avgs", 1, lambda L: torch.zeros(4, 3).t()), r"exp_avgs\[1\] has strides"),
    "short list": (lambda L: L["exp_avg_sqs"].pop(), r"exp_avg_sqs has 2 tensors but params has 3"),
    "integer param": (_bad("params", 0, lambda L: torch.zeros(5, dtype=torch.int32)), r"params\[0\] must be a floating point"),
}


@pytest.mark.parametrize("case", list(ADAM_ERRORS))
def test_fused_adamw_errors_name_the_argument_and_index(case):
    edit, pattern = ADAM_ERRORS[case]
    lists = _adam_lists()
    edit(lists)
    snapshot = copy.deepcopy(lists)
    with pytest.raises(RuntimeError, match=pattern):
        _call_adam(lists)
    for field, ts in lists.items():
        for i, (t, s) in enumerate(zip(ts, snapshot[field])):
            assert torch.equal(t, s), f"{field}[{i}] modified by a failing call"


def test_fused_adamw_refuses_mixed_param_dtypes_in_one_call():
    lists = _adam_lists()
    # params[1] and everything belonging to it in float64: consistent per
    # index, but one launch serves one dtype.
    for field in ("params", "grads", "exp_avgs", "exp_avg_sqs"):
        lists[field][1] = lists[field][1].double()
    with pytest.raises(RuntimeError, match=r"params\[1\] is Double but params\[0\] is Float"):
        _call_adam(lists)


def test_fused_adamw_master_and_amsgrad_list_errors():
    lists = _adam_lists(torch.bfloat16)
    lists["master_params"] = [p.float() for p in lists["params"]]
    with pytest.raises(RuntimeError, match=r"exp_avgs\[0\] must be Float, got BFloat16"):
        _call_adam(lists)  # with masters, the state is fp32
    for field in ("exp_avgs", "exp_avg_sqs"):
        lists[field] = [torch.zeros_like(p, dtype=torch.float32) for p in lists["params"]]
    lists["master_params"][2] = lists["params"][2].clone()
    with pytest.raises(RuntimeError, match=r"master_params\[2\] must be Float, got BFloat16"):
        _call_adam(lists)
    lists = _adam_lists()
    with pytest.raises(RuntimeError, match=r"max_exp_avg_sqs has 0 tensors but params has 3"):
        _call_adam(lists, amsgrad=True)
    lists["max_exp_avg_sqs"] = [torch.zeros_like(p) for p in lists["params"]]
    with pytest.raises(RuntimeError, match=r"max_exp_avg_sqs must be empty without amsgrad"):
        _call_adam(lists)
    lists = _adam_lists()
    with pytest.raises(RuntimeError, match=r"found_inf must be Float"):
        _call_adam(lists, found_inf=torch.zeros(1, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"grad_scale must hold exactly one element"):
        _call_adam(lists, grad_scale=torch.ones(2))


def test_fused_sgd_errors_name_the_argument_and_index():
    params = [torch.randn(5), torch.randn(3, 4)]
    grads = [torch.randn_like(p) for p in params]
    bufs = [torch.zeros_like(p) for p in params]
    kw = dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False,
              is_first_step=False)
    with pytest.raises(RuntimeError, match=r"momentum_buffers\[1\] has shape \[12\] but params\[1\] has shape \[3, 4\]"):
        torch.ops.fusetrain.fused_sgd_(params, grads, [bufs[0], torch.zeros(12)], [], **kw)
    with pytest.raises(RuntimeError, match=r"grads\[0\] must be Float, got Half"):
        torch.ops.fusetrain.fused_sgd_(params, [grads[0].half(), grads[1]], bufs, [], **kw)
    with pytest.raises(RuntimeError, match=r"momentum_buffers must be empty when momentum is 0"):
        torch.ops.fusetrain.fused_sgd_(params, grads, bufs, [], **{**kw, "momentum": 0.0})
    with pytest.raises(RuntimeError, match=r"params\[1\] is Half but params\[0\] is Float"):
        torch.ops.fusetrain.fused_sgd_([params[0], params[1].half()], [grads[0], grads[1].half()],
                                       [bufs[0], bufs[1].half()], [], **kw)


def test_constructor_errors_match_torch():
    p = [nn.Parameter(torch.randn(3))]
    for ours, theirs, kw in [
        (fo.FusedAdamW, torch.optim.AdamW, dict(lr=-1.0)),
        (fo.FusedAdamW, torch.optim.AdamW, dict(betas=(1.0, 0.999))),
        (fo.FusedAdam, torch.optim.Adam, dict(betas=(0.9, -0.1))),
        (fo.FusedAdam, torch.optim.Adam, dict(eps=-1.0)),
        (fo.FusedSGD, torch.optim.SGD, dict(lr=0.1, nesterov=True)),
        (fo.FusedSGD, torch.optim.SGD, dict(lr=0.1, momentum=-0.5)),
    ]:
        with pytest.raises(ValueError):
            theirs(p, **kw)
        with pytest.raises(ValueError):
            ours(p, **kw)


# ------------------------------------------------------------------- CUDA


def _nonzero(shape, g, dtype=torch.float32, positive=False):
    t = torch.randn(shape, generator=g)
    t = torch.where(t.abs() < 1e-3, torch.full_like(t, 0.5), t)  # never zero
    if positive:
        t = t.abs() * 0.1
    return t.to(dtype)


def _adam_case(sizes, pdtype, master, amsgrad, seed=0, step=4.0):
    g = torch.Generator().manual_seed(seed)
    sdtype = torch.float32 if master else pdtype
    masters = [_nonzero(s, g) for s in sizes] if master else []
    params = [m.to(pdtype) for m in masters] if master else [_nonzero(s, g, pdtype) for s in sizes]
    return dict(
        params=params,
        grads=[_nonzero(s, g, pdtype) for s in sizes],
        exp_avgs=[_nonzero(s, g, sdtype) * 0.1 for s in sizes],
        exp_avg_sqs=[_nonzero(s, g, sdtype, positive=True) for s in sizes],
        max_exp_avg_sqs=[_nonzero(s, g, sdtype, positive=True) for s in sizes] if amsgrad else [],
        master_params=masters,
        state_steps=[torch.full((), step + i % 3) for i in range(len(sizes))],
    )


def _to_cuda(lists, misalign=False):
    def move(t):
        if not misalign or t.dim() == 0:
            return t.cuda()
        # A view one element into a buffer: the 16-byte vector path is off.
        base = torch.empty(t.numel() + 1, dtype=t.dtype, device="cuda")
        return base[1:].view(t.shape).copy_(t)
    return {k: [move(t) for t in v] for k, v in lists.items()}


def _assert_lists_close(cuda_lists, cpu_lists, what, dtype_tol=None):
    for field, ts in cpu_lists.items():
        for i, (c, r) in enumerate(zip(cuda_lists[field], ts)):
            got = c.cpu()
            if r.dtype in (torch.float16, torch.bfloat16):
                # A 1-ulp fp32 difference (FMA contraction on the GPU) may flip
                # a rounding to 16 bits: allow one ulp of the 16-bit type.
                eps = torch.finfo(r.dtype).eps
                torch.testing.assert_close(got.float(), r.float(), rtol=eps, atol=eps * float(r.abs().max()),
                                           msg=lambda m: f"{what}: {field}[{i}]: {m}")
            else:
                assert_tracks(got, r, f"{what}: {field}[{i}]", rtol=2e-6)


CUDA_SIZES = [(278011,), (7, 3), (1,), (65537,), (65536,), (3, 5, 7)]
CUDA_ADAM = {
    "fp32": dict(pdtype=torch.float32, master=False, amsgrad=False, kw={}),
    "fp32_amsgrad_maximize": dict(pdtype=torch.float32, master=False, amsgrad=True, kw=dict(maximize=True)),
    "fp32_adam_l2": dict(pdtype=torch.float32, master=False, amsgrad=False, kw=dict(decoupled_weight_decay=False)),
    "bf16_master": dict(pdtype=torch.bfloat16, master=True, amsgrad=False, kw={}),
    "bf16_master_amsgrad": dict(pdtype=torch.bfloat16, master=True, amsgrad=True, kw={}),
    "fp16_master": dict(pdtype=torch.float16, master=True, amsgrad=False, kw={}),
    "bf16_no_master": dict(pdtype=torch.bfloat16, master=False, amsgrad=False, kw={}),
    "fp16_no_master_amsgrad": dict(pdtype=torch.float16, master=False, amsgrad=True, kw={}),
}


@pytest.mark.cuda
@pytest.mark.parametrize("misalign", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "grad_scale"])
@pytest.mark.parametrize("case", list(CUDA_ADAM))
def test_cuda_fused_adamw_matches_cpu(case, scaled, misalign):
    c = CUDA_ADAM[case]
    cpu = _adam_case(CUDA_SIZES, c["pdtype"], c["master"], c["amsgrad"])
    gpu = _to_cuda(cpu, misalign)
    if c["master"]:
        # With masters the params are only written: poison them on both sides.
        for p in cpu["params"] + gpu["params"]:
            p.fill_(NAN)
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1, eps=1e-8, amsgrad=c["amsgrad"],
              maximize=False, decoupled_weight_decay=True)
    kw.update(c["kw"])
    scale = torch.full((), 1024.0) if scaled else None
    if scaled:
        for lst in (cpu, gpu):
            lst["grads"] = [g * 1024 for g in lst["grads"]]
    for lists, dev in ((cpu, "cpu"), (gpu, "cuda")):
        _call_adam(lists, grad_scale=None if scale is None else scale.to(dev),
                   found_inf=torch.zeros((), device=dev), **kw)
    torch.cuda.synchronize()
    _assert_lists_close(gpu, cpu, case)
    if c["master"]:
        for i, (p, m) in enumerate(zip(gpu["params"], gpu["master_params"])):
            assert torch.equal(p, m.to(p.dtype)), f"params[{i}] != master rounded"
    for s_gpu, s_cpu in zip(gpu["state_steps"], cpu["state_steps"]):
        assert float(s_gpu) == float(s_cpu)


@pytest.mark.cuda
@pytest.mark.parametrize("master", [False, True], ids=["fp32", "bf16_master"])
def test_cuda_found_inf_skips_adamw_and_sgd(master):
    pdtype = torch.bfloat16 if master else torch.float32
    gpu = _to_cuda(_adam_case(CUDA_SIZES, pdtype, master, amsgrad=True))
    before = copy.deepcopy(gpu)
    found = torch.ones((), device="cuda")
    _call_adam(gpu, amsgrad=True, found_inf=found, grad_scale=torch.full((), 8.0, device="cuda"))
    bufs = [torch.randn(p.shape, device="cuda") if master else torch.randn_like(p) for p in gpu["params"]]
    bufs_before = [b.clone() for b in bufs]
    torch.ops.fusetrain.fused_sgd_(gpu["params"], gpu["grads"], bufs, gpu["master_params"], lr=0.1, momentum=0.9,
                                   dampening=0.0, weight_decay=0.1, nesterov=True, maximize=False,
                                   is_first_step=False, found_inf=found)
    torch.cuda.synchronize()
    for field, ts in before.items():
        for i, (a, b) in enumerate(zip(gpu[field], ts)):
            assert_bits_equal(a.cpu(), b.cpu(), f"{field}[{i}] after a skipped step")
    for i, (a, b) in enumerate(zip(bufs, bufs_before)):
        assert_bits_equal(a.cpu(), b.cpu(), f"momentum_buffers[{i}] after a skipped step")


CUDA_SGD = {
    "momentum": dict(momentum=0.9, dampening=0.1),
    "first_step": dict(momentum=0.9, dampening=0.3, is_first_step=True),
    "nesterov_wd": dict(momentum=0.9, nesterov=True, weight_decay=0.05),
    "plain_maximize": dict(momentum=0.0, maximize=True, weight_decay=0.01),
}


@pytest.mark.cuda
@pytest.mark.parametrize("master", [False, True], ids=["fp32", "bf16_master"])
@pytest.mark.parametrize("case", list(CUDA_SGD))
def test_cuda_fused_sgd_matches_cpu(case, master):
    pdtype = torch.bfloat16 if master else torch.float32
    src = _adam_case(CUDA_SIZES, pdtype, master, amsgrad=False, seed=3)
    kw = dict(lr=0.05, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False,
              is_first_step=False)
    kw.update(CUDA_SGD[case])
    cpu = dict(params=src["params"], grads=src["grads"], master_params=src["master_params"],
               momentum_buffers=src["exp_avgs"] if kw["momentum"] else [])
    gpu = _to_cuda(cpu)
    if master:
        for p in cpu["params"] + gpu["params"]:
            p.fill_(NAN)
    if kw["is_first_step"]:
        for b in cpu["momentum_buffers"] + gpu["momentum_buffers"]:
            b.fill_(NAN)  # write-only on the first step
    for lists, dev in ((cpu, "cpu"), (gpu, "cuda")):
        torch.ops.fusetrain.fused_sgd_(lists["params"], lists["grads"], lists["momentum_buffers"],
                                       lists["master_params"], grad_scale=torch.full((), 2.0, device=dev),
                                       found_inf=torch.zeros((), device=dev), **kw)
    torch.cuda.synchronize()
    _assert_lists_close(gpu, cpu, case)


@pytest.mark.cuda
def test_cuda_many_small_tensors_span_several_launches():
    # More tensors than one launch's parameter block holds (440 for Adam).
    g = torch.Generator().manual_seed(4)
    sizes = [(int(n),) for n in torch.randint(1, 3000, (1000,), generator=g)] + [(278011,)]
    cpu = _adam_case(sizes, torch.bfloat16, True, amsgrad=True, seed=5)
    gpu = _to_cuda(cpu)
    for p in cpu["params"] + gpu["params"]:
        p.fill_(NAN)
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=True, maximize=False,
              decoupled_weight_decay=True)
    for lists in (cpu, gpu):
        _call_adam(lists, **kw)
    torch.cuda.synchronize()
    _assert_lists_close(gpu, cpu, "1001 tensors")


@pytest.mark.cuda
def test_cuda_optimizer_with_grad_scaler_and_master_weights():
    # The whole Python path on the GPU: bf16 model, fp32 masters, fusetrain's
    # scaler handing grad_scale / found_inf; an injected inf changes nothing.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 257), nn.Tanh(), nn.Linear(257, 10)).cuda().bfloat16()
    ref = copy.deepcopy(model).float()
    opt = fo.FusedAdamW(model.parameters(), lr=1e-2, master_weights=True, max_grad_norm=1.0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    scaler = famp.GradScaler("cuda", init_scale=2.0**8)
    g = torch.Generator().manual_seed(1)
    for i in range(6):
        x = torch.randn(32, 64, generator=g).cuda().bfloat16()
        opt.zero_grad()
        scaler.scale(model(x).float().square().mean()).backward()
        if i == 3:
            model[0].weight.grad[0, 0] = INF
            before, state_before = params_of(model), optimizer_state_snapshot(opt)
        else:
            ref_opt.zero_grad()
            for p, q in zip(model.parameters(), ref.parameters()):
                q.grad = p.grad.float() / scaler.get_scale()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            ref_opt.step()
        scaler.step(opt)
        scaler.update()
        if i == 3:
            for a, b in zip(params_of(model), before):
                assert_bits_equal(a.cpu(), b.cpu(), "param after a skipped step")
            after = optimizer_state_snapshot(opt)
            for k in after:
                for key in after[k]:
                    assert_bits_equal(after[k][key].cpu(), state_before[k][key].cpu(), f"state[{k}][{key}]")
    for p, q in zip(model.parameters(), ref.parameters()):
        master = opt.state[p]["master_param"]
        assert torch.equal(p.detach(), master.to(torch.bfloat16))
        assert_tracks(master, q.detach(), "master vs torch fp32 run", rtol=1e-5)
        assert float(opt.state[p]["step"]) == 5.0


# ------------------------------------------------------ tensor learning rate
#
# A one-element tensor lr is read by the kernels (on the params' device), so a
# captured CUDA graph follows a schedule written into it in place.


@pytest.mark.parametrize("make", [
    lambda ps, lr: fo.FusedAdamW(ps, lr=lr, weight_decay=0.1),
    lambda ps, lr: fo.FusedAdam(ps, lr=lr, weight_decay=0.1),
    lambda ps, lr: fo.FusedSGD(ps, lr=lr, momentum=0.9, weight_decay=0.01),
], ids=["adamw", "adam", "sgd"])
def test_tensor_lr_with_a_scheduler_equals_float_lr(make):
    # torch's schedulers fill_ a tensor lr in place; the trajectory is the
    # float one bit for bit (a float64 tensor holds the same double).
    init = initial_params(7)
    a = [nn.Parameter(t.clone()) for t in init]
    b = [nn.Parameter(t.clone()) for t in init]
    lr_t = torch.tensor(1e-2, dtype=torch.float64)
    opt_a, opt_b = make(a, 1e-2), make(b, lr_t)
    assert opt_b.param_groups[0]["lr"] is lr_t
    sched_a = torch.optim.lr_scheduler.StepLR(opt_a, step_size=3, gamma=0.5)
    sched_b = torch.optim.lr_scheduler.StepLR(opt_b, step_size=3, gamma=0.5)
    g = torch.Generator().manual_seed(8)
    for _ in range(10):
        for p, q, grad in zip(a, b, grads_for(a, g)):
            p.grad, q.grad = grad.clone(), grad.clone()
        opt_a.step()
        opt_b.step()
        sched_a.step()
        sched_b.step()
    assert isinstance(opt_b.param_groups[0]["lr"], torch.Tensor)
    assert float(opt_b.param_groups[0]["lr"]) == opt_a.param_groups[0]["lr"]
    for i, (p, q) in enumerate(zip(a, b)):
        assert_bits_equal(q.detach(), p.detach(), f"param {i}")


def test_tensor_lr_op_argument_overrides_lr():
    lists = _adam_case([(33,), (5, 4)], torch.float32, False, amsgrad=False)
    ref = copy.deepcopy(lists)
    _call_adam(ref, lr=3e-3, weight_decay=0.2)
    _call_adam(lists, lr=123.0, weight_decay=0.2, lr_tensor=torch.tensor([3e-3], dtype=torch.float64))
    for i, (p, q) in enumerate(zip(lists["params"], ref["params"])):
        assert_bits_equal(p, q, f"params[{i}]")
    sgd = [torch.ones(4)], [torch.full((4,), 2.0)]
    torch.ops.fusetrain.fused_sgd_(*sgd, [], [], lr=5.0, momentum=0.0, dampening=0.0, weight_decay=0.0,
                                   nesterov=False, maximize=False, is_first_step=False,
                                   lr_tensor=torch.tensor(0.25))
    assert torch.equal(sgd[0][0], torch.full((4,), 0.5))


@pytest.mark.parametrize("bad, match", [
    (torch.ones(2, dtype=torch.float64), r"lr_tensor must hold exactly one element"),
    (torch.ones((), dtype=torch.int64), r"lr_tensor must be float32 or float64, got Long"),
    (torch.ones((), dtype=torch.bfloat16), r"lr_tensor must be float32 or float64, got BFloat16"),
    (torch.ones((), dtype=torch.float64, device="meta"), r"lr_tensor is on meta but params\[0\] is on cpu"),
], ids=["shape", "int", "bf16", "device"])
def test_tensor_lr_op_errors_name_the_argument(bad, match):
    lists = _adam_case([(3,)], torch.float32, False, amsgrad=False)
    with pytest.raises(RuntimeError, match=match):
        _call_adam(lists, lr_tensor=bad)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.fusetrain.fused_sgd_(lists["params"], lists["grads"], [], [], lr=0.1, momentum=0.0,
                                       dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False,
                                       is_first_step=False, lr_tensor=bad)


def test_tensor_lr_constructor_errors():
    p = [nn.Parameter(torch.ones(3))]
    with pytest.raises(ValueError, match="1-element"):
        fo.FusedAdamW(p, lr=torch.ones(2))
    with pytest.raises(ValueError, match="Invalid learning rate"):
        fo.FusedSGD(p, lr=torch.tensor(-1.0))


@pytest.mark.cuda
@pytest.mark.parametrize("lr_dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", ["fp32", "bf16_master"])
def test_cuda_tensor_lr_matches_cpu_float_lr(case, lr_dtype):
    c = CUDA_ADAM[case]
    cpu = _adam_case(CUDA_SIZES, c["pdtype"], c["master"], c["amsgrad"])
    gpu = _to_cuda(cpu)
    lr = float(torch.tensor(1e-2, dtype=lr_dtype))  # what the kernel reads, as a double
    kw = dict(beta1=0.9, beta2=0.99, weight_decay=0.1, eps=1e-8, amsgrad=c["amsgrad"])
    _call_adam(cpu, lr=lr, **kw)
    _call_adam(gpu, lr=99.0, lr_tensor=torch.tensor(1e-2, dtype=lr_dtype, device="cuda"), **kw)
    sgd_cpu = [torch.ones(70000)], [torch.full((70000,), 2.0)]
    sgd_gpu = [t.cuda() for t in sgd_cpu[0]], [t.cuda() for t in sgd_cpu[1]]
    common = dict(momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False, is_first_step=False)
    torch.ops.fusetrain.fused_sgd_(*sgd_cpu, [], [], lr=lr, **common)
    torch.ops.fusetrain.fused_sgd_(*sgd_gpu, [], [], lr=99.0, lr_tensor=torch.tensor(1e-2, dtype=lr_dtype, device="cuda"),
                                   **common)
    torch.cuda.synchronize()
    _assert_lists_close(gpu, cpu, case)
    assert torch.equal(sgd_gpu[0][0].cpu(), sgd_cpu[0][0])
