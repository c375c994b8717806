"""The fused batch norm + ReLU (fusetrain.nn.functional.batch_norm_relu, its
ops and fusetrain.nn.BatchNormReLU2d) against torch's batch norm computed in
float64 on the same inputs.

Tolerances: the kernels compute in float32 and round the result once to the
output dtype, so an element is off by at most half an ulp of the output
dtype (2^-8 relative for bfloat16, 2^-24 for float32) plus the float32 error
of the statistics, a few 1e-7 relative to the largest normalised value; the
weight and bias gradients are float32 sums of N*H*W terms, checked against a
bound of 1e-5 of the sum of the terms' magnitudes (float32 blocks of <= 16
terms, then float64).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import fusetrain
import fusetrain.nn
from fusetrain import _C

OP = torch.ops.fusetrain.batch_norm_relu.default
BACKWARD = torch.ops.fusetrain.batch_norm_relu_backward.default

# (shape, memory format): channels_last with C a multiple of the vector
# width and not, NCHW planes with tails, [N, C], [N, C, L], a 5-D one.
CASES = [
    ((16, 24, 14, 14), torch.channels_last),
    ((8, 5, 3, 7), torch.channels_last),
    ((16, 24, 14, 14), torch.contiguous_format),
    ((8, 5, 3, 7), torch.contiguous_format),
    ((33, 17), torch.contiguous_format),
    ((4, 3, 10), torch.contiguous_format),
    ((2, 6, 3, 4, 5), torch.channels_last_3d),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HALF_ULP = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def make(shape, fmt, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = shape[1]
    # An offset mean (3) against a unit spread: the shifted sums must not
    # cancel.
    x = (torch.randn(shape, generator=g) * 2 + 3).to(dtype).contiguous(memory_format=fmt)
    weight = torch.randn(c, generator=g)
    bias = torch.randn(c, generator=g)
    running_mean = torch.randn(c, generator=g)
    running_var = torch.rand(c, generator=g) + 0.5
    dy = torch.randn(shape, generator=g).to(dtype).contiguous(memory_format=fmt)
    return x, weight, bias, running_mean, running_var, dy


def reference(x, weight, bias, running_mean, running_var, training, relu_mask=None, dy=None):
    """float64 torch: (out, running_mean, running_var, grads of x, weight, bias),
    the ReLU's gradient mask taken from `relu_mask` (the kernel's output > 0)."""
    xd = x.double().requires_grad_()
    wd = weight.double().requires_grad_()
    bd = bias.double().requires_grad_()
    rm, rv = running_mean.double(), running_var.double()
    y = F.batch_norm(xd, rm, rv, wd, bd, training, 0.1, 1e-5)
    out = torch.relu(y)
    grads = (None, None, None)
    if dy is not None:
        g = dy.double() if relu_mask is None else dy.double() * relu_mask
        y.backward(g)
        grads = (xd.grad, wd.grad, bd.grad)
    return (out.detach(), rm, rv) + grads


def assert_elementwise(ours, ref, dtype, what):
    err = (ours.double() - ref).abs()
    bound = HALF_ULP[dtype] * ref.abs() * (1 + 1e-3) + 2e-6 * ref.abs().max()
    worst = (err - bound).argmax()
    assert bool((err <= bound).all()), (
        f"{what}: {ours.reshape(-1)[worst].item()} vs {ref.reshape(-1)[worst].item()}"
    )


def assert_sum(ours, ref, terms, what):
    bound = 1e-5 * terms + 1e-6
    assert bool(((ours.double() - ref).abs() <= bound).all()), (what, (ours.double() - ref).abs().max())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,fmt", CASES, ids=lambda v: str(v))
def test_training_forward_and_backward_match_float64(shape, fmt, dtype):
    x, w, b, rm, rv, dy = make(shape, fmt, dtype)
    rm_ours, rv_ours = rm.clone(), rv.clone()
    out, mean, invstd = OP(x, w, b, rm_ours, rv_ours, True, 0.1, 1e-5, True)
    assert out.dtype == dtype and out.shape == x.shape
    assert out.is_contiguous(memory_format=fmt)
    mask = (~(out <= 0)).double()
    ref_out, ref_rm, ref_rv, gx, gw, gb = reference(x, w, b, rm, rv, True, mask, dy)
    assert_elementwise(out, ref_out, dtype, "out")
    torch.testing.assert_close(rm_ours.double(), ref_rm, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rv_ours.double(), ref_rv, rtol=1e-6, atol=1e-6)

    grad_input, grad_weight, grad_bias = BACKWARD(dy, x, out, w, mean, invstd, True, True,
                                                  [True, True, True])
    assert grad_input.is_contiguous(memory_format=fmt)
    assert_elementwise(grad_input, gx, dtype, "grad_input")
    dims = [d for d in range(x.dim()) if d != 1]
    xhat = x.double() - x.double().mean(dims, keepdim=True)
    g = dy.double() * mask
    assert_sum(grad_weight, gw, (g * xhat).abs().sum(dims) * invstd.double(), "grad_weight")
    assert_sum(grad_bias, gb, g.abs().sum(dims), "grad_bias")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_eval_uses_running_statistics_and_leaves_them(dtype):
    x, w, b, rm, rv, dy = make((8, 24, 5, 5), torch.channels_last, dtype)
    rm_ours, rv_ours = rm.clone(), rv.clone()
    out, mean, invstd = OP(x, w, b, rm_ours, rv_ours, False, 0.1, 1e-5, True)
    assert torch.equal(rm_ours, rm) and torch.equal(rv_ours, rv)
    mask = (~(out <= 0)).double()
    ref_out, _, _, gx, gw, gb = reference(x, w, b, rm, rv, False, mask, dy)
    assert_elementwise(out, ref_out, dtype, "out")
    grad_input, grad_weight, grad_bias = BACKWARD(dy, x, out, w, mean, invstd, False, True,
                                                  [True, True, True])
    assert_elementwise(grad_input, gx, dtype, "grad_input")
    torch.testing.assert_close(grad_weight.double(), gw, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grad_bias.double(), gb, rtol=1e-5, atol=1e-4)


def test_relu_mask_is_torchs_threshold_backward():
    """The gradient stops where out <= 0 and passes elsewhere (a NaN output
    passes it): torch.relu's backward, threshold_backward, on the output."""
    # [3, 2]: channel 0 holds -1, 0, 3; channel 1 holds a NaN.
    x = torch.tensor([[-1.0, 1.0], [0.0, 2.0], [3.0, float("nan")]])
    out, mean, invstd = OP(x, None, None, None, None, True, 0.1, 1e-5, True)
    assert torch.isnan(out[:, 1]).all() and not torch.isnan(out[:, 0]).any()
    dy = torch.ones_like(x)
    gi, _, gb = BACKWARD(dy, x, out, None, mean, invstd, True, True, [True, False, True])
    expected_passed = torch.ops.aten.threshold_backward(dy, out, 0)
    torch.testing.assert_close(gb, expected_passed.sum(0))
    assert torch.isnan(gi[:, 1]).all()


def test_relu_false_is_batch_norm_alone():
    x, w, b, rm, rv, dy = make((8, 24, 6, 6), torch.channels_last, torch.float32)
    out, mean, invstd = OP(x, w, b, rm.clone(), rv.clone(), True, 0.1, 1e-5, False)
    xd = x.double().requires_grad_()
    y = F.batch_norm(xd, None, None, w.double(), b.double(), True, 0.1, 1e-5)
    assert (out < 0).any()
    assert_elementwise(out, y.detach(), torch.float32, "out")
    y.backward(dy.double())
    gi, _, _ = BACKWARD(dy, x, None, w, mean, invstd, True, False, [True, False, False])
    assert_elementwise(gi, xd.grad, torch.float32, "grad_input")


def test_thread_count_does_not_change_a_bit():
    """The statistics are summed per fixed chunk, then in order."""
    script = textwrap.dedent(
        """
        import sys, torch, fusetrain
        torch.set_num_threads(int(sys.argv[2]))
        g = torch.Generator().manual_seed(0)
        res = {}
        for shape, fmt in [((64, 24, 28, 28), torch.channels_last), ((64, 24, 28, 28), torch.contiguous_format)]:
            x = torch.randn(shape, generator=g).to(torch.bfloat16).contiguous(memory_format=fmt)
            dy = torch.randn(shape, generator=g).to(torch.bfloat16).contiguous(memory_format=fmt)
            w, b = torch.randn(24, generator=g), torch.randn(24, generator=g)
            out, mean, invstd = torch.ops.fusetrain.batch_norm_relu(x, w, b, None, None, True, 0.1, 1e-5, True)
            grads = torch.ops.fusetrain.batch_norm_relu_backward(dy, x, out, w, mean, invstd, True, True, [True, True, True])
            res[str(fmt)] = (out, mean, invstd) + tuple(grads)
        torch.save(res, sys.argv[1])
        """
    )
    results = []
    for threads in (1, 2):
        path = f"{os.environ.get('TMPDIR', '/tmp')}/bn_threads_{os.getpid()}_{threads}.pt"
        subprocess.run([sys.executable, "-c", script, path, str(threads)], check=True)
        results.append(torch.load(path))
        os.unlink(path)
    for key in results[0]:
        for a, b in zip(results[0][key], results[1][key]):
            assert torch.equal(a, b), key


PATH_SCRIPT = textwrap.dedent(
    """
    import sys, torch, fusetrain
    from fusetrain import _C
    torch.set_num_threads(1)
    out = {"path": _C.cpu_features()["path"]}
    for i, (shape, fmt) in enumerate([((16, 24, 14, 14), torch.channels_last), ((8, 5, 3, 7), torch.channels_last),
                                      ((8, 5, 3, 7), torch.contiguous_format), ((33, 17), torch.contiguous_format)]):
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator().manual_seed(i)
            x = (torch.randn(shape, generator=g) * 2 + 3).to(dtype).contiguous(memory_format=fmt)
            dy = torch.randn(shape, generator=g).to(dtype).contiguous(memory_format=fmt)
            w, b = torch.randn(shape[1], generator=g), torch.randn(shape[1], generator=g)
            rm, rv = torch.zeros(shape[1]), torch.ones(shape[1])
            y, mean, invstd = torch.ops.fusetrain.batch_norm_relu(x, w, b, rm, rv, True, 0.1, 1e-5, True)
            grads = torch.ops.fusetrain.batch_norm_relu_backward(dy, x, y, w, mean, invstd, True, True, [True, True, True])
            out[(i, str(dtype))] = (x, dy, w, b, y, mean, invstd, rm, rv) + tuple(grads)
    torch.save(out, sys.argv[1])
    """
)


def _paths():
    best = _C.cpu_features()["path"]
    order = ["generic", "scalar", "avx2", "avx512"]
    return order[: order.index(best) + 1] if best in order else ["generic", "scalar"]


@pytest.mark.parametrize("path", _paths())
def test_every_cpu_path_matches_float64(path, tmp_path):
    """Each path this CPU runs (forced with FUSETRAIN_CPU_PATH) within the
    same bounds of the float64 reference."""
    file = tmp_path / "out.pt"
    env = dict(os.environ, FUSETRAIN_CPU_PATH=path)
    subprocess.run([sys.executable, "-c", PATH_SCRIPT, str(file)], check=True, env=env)
    res = torch.load(file)
    assert res.pop("path") == path
    for key, (x, dy, w, b, y, mean, invstd, rm, rv, gi, gw, gb) in res.items():
        dtype = x.dtype
        ref_out, ref_rm, ref_rv, gx, _, ref_gb = reference(
            x, w, b, torch.zeros_like(rm), torch.ones_like(rv), True, (~(y <= 0)).double(), dy)
        assert_elementwise(y, ref_out, dtype, f"{path} {key} out")
        assert_elementwise(gi, gx, dtype, f"{path} {key} grad_input")
        torch.testing.assert_close(rm.double(), ref_rm, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(rv.double(), ref_rv, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(gb.double(), ref_gb, rtol=1e-5, atol=1e-4)


def test_functional_autograd_and_module_match_torchs():
    """fusetrain.nn.BatchNormReLU2d is nn.Sequential(BatchNorm2d, ReLU): same
    state dict, forward, gradients, running statistics and batch count, in
    training and evaluation, with momentum=None (the cumulative average)."""
    for momentum in (0.1, None):
        torch.manual_seed(0)
        ref = torch.nn.BatchNorm2d(24, momentum=momentum)
        ours = fusetrain.nn.BatchNormReLU2d(24, momentum=momentum)
        with torch.no_grad():
            ref.weight.normal_()
            ref.bias.normal_()
        ours.load_state_dict(ref.state_dict())
        assert list(ours.state_dict()) == list(ref.state_dict())
        for step in range(3):
            x = (torch.randn(8, 24, 6, 6) + 1).contiguous(memory_format=torch.channels_last)
            xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
            ya, yb = torch.relu(ref(xa)), ours(xb)
            torch.testing.assert_close(yb, ya, rtol=1e-5, atol=1e-5)
            dy = torch.randn_like(x)
            ya.backward(dy)
            yb.backward(dy)
            torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(ours.weight.grad, ref.weight.grad, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(ours.bias.grad, ref.bias.grad, rtol=1e-4, atol=1e-4)
        for name, t in ref.state_dict().items():
            torch.testing.assert_close(ours.state_dict()[name], t, rtol=1e-5, atol=1e-6, msg=name)
        ref.eval(), ours.eval()
        x = torch.randn(4, 24, 3, 3)
        torch.testing.assert_close(ours(x), torch.relu(ref(x)), rtol=1e-5, atol=1e-5)


def test_float64_and_non_cpu_take_torchs_ops():
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    y = fusetrain.nn.functional.batch_norm_relu(x, None, None, w, None, training=True)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, torch.relu(F.batch_norm(x, None, None, w, None, True)))
    assert torch.autograd.gradcheck(
        lambda a, b: fusetrain.nn.functional.batch_norm_relu(a, None, None, b, None, training=True),
        (x, w),
    )


def test_errors_name_the_argument():
    x = torch.randn(4, 3, 5, 5)
    with pytest.raises(RuntimeError, match="weight must be 1-D with one value per channel"):
        OP(x, torch.ones(4), None, None, None, True, 0.1, 1e-5, True)
    with pytest.raises(RuntimeError, match="input must be float32, float16 or bfloat16"):
        OP(x.double(), None, None, None, None, True, 0.1, 1e-5, True)
    with pytest.raises(RuntimeError, match="pass running_mean and running_var"):
        OP(x, None, None, None, None, False, 0.1, 1e-5, True)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        fusetrain.nn.functional.batch_norm_relu(torch.randn(1, 3), None, None, training=True)
    with pytest.raises(RuntimeError, match="relu=True needs the forward's output"):
        BACKWARD(x, x, None, None, torch.zeros(3), torch.ones(3), True, True, [True, False, False])


def test_meta_kernels_and_schema():
    """The Meta kernels give the CPU kernels' shapes, dtypes and layouts and
    the schema's mutation annotations hold (torch.library.opcheck)."""
    x, w, b, rm, rv, dy = make((8, 24, 5, 5), torch.channels_last, torch.bfloat16)
    out, mean, invstd = OP(x, w, b, rm, rv, True, 0.1, 1e-5, True)
    args = (x, w, b, rm, rv, True, 0.1, 1e-5, True)
    torch.library.opcheck(OP, args, test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(BACKWARD, (dy, x, out, w, mean, invstd, True, True, [True, True, True]),
                          test_utils=("test_schema", "test_faketensor"))


def test_compiled_model_matches_eager():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), fusetrain.nn.BatchNormReLU2d(8))
    x = torch.randn(4, 3, 8, 8)
    eager = model(x)
    compiled = torch.compile(model, backend="aot_eager")(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
def test_cuda_runs_torchs_ops_and_the_generic_op():
    x, w, b, rm, rv, dy = make((8, 24, 5, 5), torch.channels_last, torch.bfloat16)
    cpu = OP(x, w, b, rm.clone(), rv.clone(), True, 0.1, 1e-5, True)
    cuda = OP(x.cuda(), w.cuda(), b.cuda(), rm.cuda(), rv.cuda(), True, 0.1, 1e-5, True)
    for a, c in zip(cpu, cuda):
        torch.testing.assert_close(c.cpu().float(), a.float(), rtol=2**-7, atol=1e-5)
    y = fusetrain.nn.functional.batch_norm_relu(x.cuda(), rm.cuda(), rv.cuda(), w.cuda(), b.cuda(), True)
    torch.testing.assert_close(y.cpu().float(), cpu[0].float(), rtol=2**-7, atol=1e-2)


EDGE_SCRIPT = textwrap.dedent(
    """
    import sys, torch, fusetrain
    torch.manual_seed(0)
    op = torch.ops.fusetrain.batch_norm_relu
    out = {}
    # Evaluation: save_mean is a new tensor, not the running buffer.
    x = torch.randn(4, 3, 5, 5)
    rm, rv = torch.randn(3), torch.rand(3) + 0.5
    y, mean, invstd = op(x, None, None, rm, rv, False, 0.1, 1e-5, True)
    out["eval_alias"] = mean.data_ptr() == rm.data_ptr()
    # An empty batch leaves the running statistics.
    rm0, rv0 = rm.clone(), rv.clone()
    op(torch.randn(0, 3, 4, 4), None, None, rm0, rv0, True, 0.1, 1e-5, True)
    out["empty_rm"], out["empty_rv"] = rm0, rv0
    # A NaN in channel 0 and an inf in channel 1 reach the running variance.
    z = torch.randn(4, 3, 4, 4)
    z[1, 0, 2, 2], z[2, 1, 0, 3] = float("nan"), float("inf")
    rmz, rvz = torch.zeros(3), torch.ones(3)
    op(z, None, None, rmz, rvz, True, 0.1, 1e-5, True)
    out["nan_rv"] = rvz
    # Output strides: those of a dense input ([2, 1, 5, 5]; [4, 3, 1, 1] channels_last).
    out["strides"] = [(t.stride(), op(t, None, None, None, None, True, 0.1, 1e-5, True)[0].stride())
                      for t in (torch.randn(2, 1, 5, 5), torch.randn(4, 3, 1, 1),
                                torch.randn(4, 3, 1, 1).contiguous(memory_format=torch.channels_last),
                                torch.randn(2, 1, 5, 5).contiguous(memory_format=torch.channels_last))]
    torch.save(out, sys.argv[1])
    """
)


@pytest.mark.parametrize("path", ["default", "generic"])
def test_edge_cases_as_torch(path, tmp_path):
    """As torch's batch norm: evaluation's saved mean is not the running
    buffer, an empty batch leaves the running statistics, a NaN or inf
    reaches the running variance, the output takes a dense input's strides;
    on the kernels and on the device-generic implementation."""
    file = tmp_path / "out.pt"
    env = dict(os.environ)
    if path == "generic":
        env["FUSETRAIN_CPU_PATH"] = "generic"
    subprocess.run([sys.executable, "-c", EDGE_SCRIPT, str(file)], check=True, env=env)
    res = torch.load(file)
    assert res["eval_alias"] is False
    torch.manual_seed(0)
    torch.randn(4, 3, 5, 5)
    rm, rv = torch.randn(3), torch.rand(3) + 0.5
    assert torch.equal(res["empty_rm"], rm) and torch.equal(res["empty_rv"], rv)
    assert torch.isnan(res["nan_rv"][0]) and not torch.isfinite(res["nan_rv"][1]) and torch.isfinite(res["nan_rv"][2])
    for given, got in res["strides"]:
        assert got == given


def test_running_statistics_update_bumps_their_version():
    x = torch.randn(4, 3, 5, 5)
    rm, rv = torch.zeros(3), torch.ones(3)
    before = rm._version, rv._version
    OP(x, None, None, rm, rv, True, 0.1, 1e-5, True)
    assert rm._version > before[0] and rv._version > before[1]


@pytest.mark.parametrize("shape", [(16, 10007), (64, 4096)], ids=str)
def test_wide_inputs_match_float64(shape):
    """A period beyond the loops' limit (an odd wide C) takes the generic
    composition, a wide even C the loops with bounded scratch: both exact."""
    x, w, b, rm, rv, dy = make(shape, torch.contiguous_format, torch.float32)
    out, mean, invstd = OP(x, w, b, rm.clone(), rv.clone(), True, 0.1, 1e-5, True)
    mask = (~(out <= 0)).double()
    ref_out, _, _, gx, _, _ = reference(x, w, b, rm, rv, True, mask, dy)
    assert_elementwise(out, ref_out, torch.float32, "out")
    gi, _, _ = BACKWARD(dy, x, out, w, mean, invstd, True, True, [True, True, True])
    assert_elementwise(gi, gx, torch.float32, "grad_input")
