"""What ``p.grad`` holds after a scaled fused step, against torch's fused
optimizers on the CPU (the reference): torch's fused AdamW / Adam / SGD
divide each gradient by ``grad_scale`` in the kernel and write the quotient
back, so after ``scaler.step(opt)`` without an earlier ``unscale_`` the
gradients are unscaled; with ``found_inf`` set they are left as they were.
fusetrain's fused optimizers must leave the same bits in ``p.grad`` (and, as
before, in the parameters and the state).
"""

from __future__ import annotations

import itertools

import pytest
import torch

import fusetrain.amp
from fusetrain.optim import FusedAdam, FusedAdamW, FusedSGD

from conftest import assert_bits_equal

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# A power of two (the GradScaler's usual values: division and multiplication
# by the reciprocal agree) and one that is not (they round differently: the
# kernels must divide, as torch's do).
SCALES = [1024.0, 3.0]

CASES = {
    "adamw": (torch.optim.AdamW, FusedAdamW, [dict(), dict(amsgrad=True), dict(maximize=True, weight_decay=0.1)]),
    "adam": (torch.optim.Adam, FusedAdam, [dict(), dict(weight_decay=0.05, amsgrad=True)]),
    "sgd": (
        torch.optim.SGD,
        FusedSGD,
        [dict(lr=0.1), dict(lr=0.1, momentum=0.9, nesterov=True), dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01, maximize=True)],
    ),
}


def _cases():
    for name, (_, _, option_sets) in CASES.items():
        for k, dtype, scale, inf in itertools.product(range(len(option_sets)), DTYPES, SCALES, (False, True)):
            yield pytest.param(name, k, dtype, scale, inf, id=f"{name}-{k}-{str(dtype)[6:]}-{scale:g}-{'inf' if inf else 'finite'}")


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Odd sizes: the vector body and the padded tail of the CPU kernels.
    return [torch.randn(n, generator=g).to(dtype) for n in (37, 1000, 3)]


def _scaled_grads(dtype, scale, inf, seed=1):
    g = torch.Generator().manual_seed(seed)
    grads = [(torch.randn(n, generator=g) * scale).to(dtype) for n in (37, 1000, 3)]
    if inf:
        grads[1][17] = float("inf")
    return grads


def _step(cls, dtype, scale, inf, options, steps=3, **extra):
    """`steps` steps on fresh scaled gradients, handed over as the GradScaler
    does for _step_supports_amp_scaling optimizers; with `inf` the last
    gradients hold an inf and found_inf is set."""
    params = [torch.nn.Parameter(p) for p in _params(dtype)]
    opt = cls(params, **options, **extra)
    grads_before = None
    for step in range(steps):
        last_overflows = inf and step == steps - 1
        grads = _scaled_grads(dtype, scale, last_overflows, seed=step + 1)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        grads_before = [g.clone() for g in grads]
        opt.grad_scale = torch.tensor(scale)
        opt.found_inf = torch.tensor(1.0 if last_overflows else 0.0)
        opt.step()
        del opt.grad_scale, opt.found_inf
    return params, grads_before


def _unscaled_reference(torch_cls, dtype, scale, inf, options, steps=3):
    """The parameters torch's for-loop optimizer reaches on the unscaled
    gradients (torch 2.11's fused CPU SGD with momentum is off by up to 0.5
    on 16-bit parameters, so it cannot be the reference for those)."""
    params = [torch.nn.Parameter(p) for p in _params(dtype)]
    opt = torch_cls(params, **options, foreach=False)
    for step in range(steps if not inf else steps - 1):
        for p, g in zip(params, _scaled_grads(dtype, scale, False, seed=step + 1)):
            p.grad = (g.double() / scale).to(dtype)
        opt.step()
    return params


@pytest.mark.parametrize("name, k, dtype, scale, inf", list(_cases()))
def test_grads_after_a_scaled_step_equal_torch_fused(name, k, dtype, scale, inf):
    torch_cls, ours_cls, option_sets = CASES[name]
    options = option_sets[k]
    ref_params, before = _step(torch_cls, dtype, scale, inf, options, fused=True)
    params, _ = _step(ours_cls, dtype, scale, inf, options)
    # torch's fused kernels compute in fp32 like ours, its for-loop Adam in
    # the 16-bit dtype (its eps underflows in fp16): the parameter reference
    # is the fused one, but for SGD (see _unscaled_reference).
    if name == "sgd":
        ref_params_of_update = _unscaled_reference(torch_cls, dtype, scale, inf, options)
    else:
        ref_params_of_update = ref_params
    for i, (p, r, q) in enumerate(zip(params, ref_params, ref_params_of_update)):
        assert_bits_equal(p.grad, r.grad, f"{name} {options} p.grad[{i}]")
        if inf:
            # The last step overflowed: its gradients stay scaled, as given.
            assert_bits_equal(p.grad, before[i], f"{name} p.grad[{i}] after a skipped step")
        else:
            # Independently of torch: the quotient, rounded once to the dtype.
            assert_bits_equal(p.grad, (before[i].double() / scale).to(dtype), f"{name} p.grad[{i}] = g / scale")
        # The parameters: the unscaled steps, to a few ulps (the SGD
        # reference steps on gradients rounded to the dtype, the kernels on
        # the fp32 quotient, and vector arithmetic fuses multiply-adds
        # differently): four ulps of the dtype at the largest value.
        ulp = torch.finfo(dtype).eps * q.detach().abs().max().item()
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=4 * ulp)


@pytest.mark.parametrize("cls, options", [(FusedAdamW, dict()), (FusedSGD, dict(lr=0.1, momentum=0.9))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inf", [False, True])
def test_master_weights_write_the_unscaled_16bit_gradient(cls, options, dtype, inf):
    params, before = _step(cls, dtype, 3.0, inf, options, master_weights=True)
    for i, p in enumerate(params):
        expected = before[i] if inf else (before[i].double() / 3.0).to(dtype)
        assert_bits_equal(p.grad, expected, f"master weights p.grad[{i}]")


def test_a_gradient_in_another_layout_is_written_back():
    # p.grad assigned by hand in another layout than p: the optimizer copies
    # it into p's layout for the kernel, and must copy the result back.
    p = torch.nn.Parameter(torch.randn(6, 4).t())  # strides (1, 4)
    g = torch.randn(4, 6) * 512.0  # contiguous: strides (6, 1)
    p.grad = g.clone()
    assert p.grad.stride() != p.stride()
    opt = FusedAdamW([p])
    opt.grad_scale, opt.found_inf = torch.tensor(512.0), torch.tensor(0.0)
    opt.step()
    assert_bits_equal(p.grad.contiguous(), g / 512.0, "written back through the copy")


@pytest.mark.parametrize("make_opt", [lambda ps: FusedAdamW(ps, lr=1e-2), lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9)])
def test_gradscaler_step_leaves_unscaled_grads(make_opt):
    """End to end through fusetrain's GradScaler (scaler.step without an
    unscale_): after each step p.grad is the scaled gradient divided by the
    scale, as torch's GradScaler + fused optimizers leave it, and a step the
    scaler skips leaves the scaled gradients."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 5))
    opt = make_opt(model.parameters())
    scaler = fusetrain.amp.GradScaler("cpu", init_scale=2.0**12)
    g = torch.Generator().manual_seed(3)
    for step in range(4):
        x, y = torch.randn(8, 12, generator=g), torch.randn(8, 5, generator=g)
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if step == 2:
            model[0].weight.grad[0, 0] = float("inf")
        scale = scaler.get_scale()
        scaled = [p.grad.clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        for i, (p, s) in enumerate(zip(model.parameters(), scaled)):
            expected = s if step == 2 else s / scale
            assert_bits_equal(p.grad, expected, f"step {step} p.grad[{i}]")
