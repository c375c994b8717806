"""fusetrain.utils.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_, and
the multi-tensor L2 norm op (torch.ops.fusetrain.multi_tensor_l2norm) against
torch.linalg.vector_norm computed in float64.

Norms: ours accumulates the 2-norm in fp64 on the CPU (fp32 on CUDA) and
returns it as float32; torch accumulates in the gradients' dtype. So ours is
held to an fp64 reference (a few fp32 roundings), and where torch differs,
ours must be no farther from the reference than twice torch's own error
(the project's rule for low-precision tolerances).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fusetrain.utils as fu
from conftest import assert_bits_equal

INF, NAN = float("inf"), float("nan")
SIZES = [(278011,), (7, 3), (1,), (65537,), (0,), (33, 257)]


def make_params(dtype=torch.float32, sizes=SIZES, seed=0, scale=1.0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    params = []
    for s in sizes:
        p = nn.Parameter(torch.randn(s, generator=g).to(device=device, dtype=dtype))
        p.grad = (torch.randn(s, generator=g) * scale).to(device=device, dtype=dtype)
        params.append(p)
    return params


def clone_params(params):
    out = []
    for p in params:
        q = nn.Parameter(p.detach().clone())
        q.grad = None if p.grad is None else p.grad.clone()
        out.append(q)
    return out


def exact_norm(grads, norm_type=2.0) -> torch.Tensor:
    flat = torch.cat([g.detach().double().flatten().cpu() for g in grads]) if grads else torch.zeros(0, dtype=torch.float64)
    return torch.linalg.vector_norm(flat, norm_type)


def rel_err(x, ref) -> float:
    ref = ref.double().cpu()
    return float((x.double().cpu() - ref).abs().max() / ref.abs().max().clamp_min(1e-300))


# ------------------------------------------------ clip_grad_norm_ vs torch


@pytest.mark.parametrize("max_norm", [1e9, 1.0], ids=["no_clip", "clip"])
@pytest.mark.parametrize("norm_type", [2.0, INF, 1.0], ids=["l2", "inf", "l1"])
def test_clip_fp32_matches_torch(norm_type, max_norm):
    # (torch's inf-norm refuses empty tensors: only the 2- and 1-norms get one.)
    ours = make_params(sizes=SIZES if norm_type != INF else [s for s in SIZES if s != (0,)])
    ref = clone_params(ours)
    originals = [p.grad.double() for p in ours]
    exact = exact_norm(originals, norm_type)
    n_ours = fu.clip_grad_norm_(ours, max_norm, norm_type=norm_type)
    n_ref = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type=norm_type)
    assert n_ours.dtype == torch.float32 and n_ours.dim() == 0
    if norm_type == 2.0:
        # Ours accumulates in fp64: one or two fp32 roundings from exact.
        assert rel_err(n_ours, exact) <= 3e-7
        assert rel_err(n_ours, exact) <= max(2 * rel_err(n_ref, exact), 3e-7)
        for i, (a, b) in enumerate(zip(ours, ref)):
            if max_norm > float(exact):
                assert_bits_equal(a.grad, b.grad, f"grad {i} (below max_norm: untouched)")
            else:
                # Against exact maths: grad * max_norm / (norm + 1e-6), to the
                # coefficient's error (3e-7) plus the product's rounding.
                want = originals[i] * (max_norm / (float(exact) + 1e-6))
                torch.testing.assert_close(a.grad.double(), want, rtol=4e-7, atol=0)
    else:
        # inf and 1: torch's own foreach norms, the same coefficient, the
        # same single fp32 multiply: bit for bit.
        assert_bits_equal(n_ours, n_ref, "total norm")
        for i, (a, b) in enumerate(zip(ours, ref)):
            assert_bits_equal(a.grad, b.grad, f"clipped grad {i}")
        # (The 1-norm sums 278011 magnitudes in fp32: torch's error, ~5e-6.)
        assert rel_err(n_ours, exact) <= (3e-7 if norm_type == INF else 2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("norm_type", [2.0, INF, 1.0], ids=["l2", "inf", "l1"])
def test_clip_16bit_is_at_least_as_accurate_as_torch(norm_type, dtype):
    # Ours computes every norm in fp32; torch in the grads' dtype, where the
    # fp16 1-norm of these 343k gradients overflows (torch then zeroes them).
    ours = make_params(dtype, sizes=SIZES if norm_type != INF else [s for s in SIZES if s != (0,)])
    ref = clone_params(ours)
    grads64 = [p.grad.double() for p in ours]
    exact = exact_norm(grads64, norm_type)
    max_norm = float(exact) / 3  # clips
    n_ours = fu.clip_grad_norm_(ours, max_norm, norm_type=norm_type)
    n_ref = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type=norm_type)
    # Ours: float32 whatever the grads' dtype (torch's: the grads' dtype).
    assert n_ours.dtype == torch.float32
    tol = 3e-7 if norm_type != 1.0 else 2e-5  # the 1-norm sums magnitudes in fp32
    assert rel_err(n_ours, exact) <= max(tol, 2 * rel_err(n_ref, exact))
    # The clipped gradients against exact maths on the original values.
    coef = max_norm / (float(exact) + 1e-6)
    err_o = max(rel_err(a.grad, g * coef) for a, g in zip(ours, grads64) if g.numel())
    err_t = max(rel_err(b.grad, g * coef) for b, g in zip(ref, grads64) if g.numel())
    assert err_o <= 2 * err_t, (err_o, err_t)
    assert err_o <= torch.finfo(dtype).eps, err_o  # one rounding to the 16-bit type


@pytest.mark.parametrize("norm_type", [2.0, INF, 1.0], ids=["l2", "inf", "l1"])
def test_clip_float64_and_mixed_with_16bit(norm_type):
    sizes = [(1001,), (7, 3), (65537,)]
    ours = make_params(torch.float64, sizes=sizes) + make_params(torch.bfloat16, sizes=sizes, seed=1)
    ref = clone_params(ours)
    originals = [p.grad.double() for p in ours]
    exact = exact_norm(originals, norm_type)
    n_ours = fu.clip_grad_norm_(ours, float(exact) / 2, norm_type=norm_type)
    n_ref = torch.nn.utils.clip_grad_norm_(ref, float(exact) / 2, norm_type=norm_type)
    assert n_ours.dtype == torch.float32
    tol = 3e-7 if norm_type != 1.0 else 2e-6
    assert rel_err(n_ours, exact) <= max(tol, 2 * rel_err(n_ref, exact))
    coef = (float(exact) / 2) / (float(exact) + 1e-6)
    for i, (a, b, g) in enumerate(zip(ours, ref, originals)):
        err_o, err_t = rel_err(a.grad, g * coef), rel_err(b.grad, g * coef)
        assert err_o <= max(2 * err_t, 4e-7), (i, err_o, err_t)


def test_clip_mixed_dtypes_and_params_without_grads():
    ours = make_params(torch.float32, sizes=[(1001,), (7, 3), (65537,)])
    extra = make_params(torch.bfloat16, sizes=[(513,), (3,)], seed=1)
    ours += extra
    ours[1].grad = None
    ref = clone_params(ours)
    originals = [None if p.grad is None else p.grad.double() for p in ours]
    exact = exact_norm([g for g in originals if g is not None])
    n_ours = fu.clip_grad_norm_(iter(ours), 0.5)  # a generator, as model.parameters()
    n_ref = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    assert n_ours.dtype == torch.float32
    # torch's total carries the bf16 group's norm rounded to bf16; ours does not.
    assert rel_err(n_ours, exact) <= 3e-7
    assert rel_err(n_ours, exact) <= max(2 * rel_err(n_ref, exact), 3e-7)
    assert ours[1].grad is None
    coef = 0.5 / (float(exact) + 1e-6)
    for i, (a, b, g) in enumerate(zip(ours, ref, originals)):
        if g is None:
            continue
        err_o, err_t = rel_err(a.grad, g * coef), rel_err(b.grad, g * coef)
        assert err_o <= max(2 * err_t, 4e-7), (i, err_o, err_t)


def test_clip_single_tensor_and_empty():
    p = make_params(sizes=[(1000,)])[0]
    q = clone_params([p])[0]
    assert_bits_equal(fu.clip_grad_norm_(p, 0.1, norm_type=INF), torch.nn.utils.clip_grad_norm_(q, 0.1, norm_type=INF))
    assert_bits_equal(p.grad, q.grad, "single tensor")
    for empty in ([], [nn.Parameter(torch.randn(3))]):  # nothing, and a param without grad
        n_ours = fu.clip_grad_norm_(empty, 1.0)
        n_ref = torch.nn.utils.clip_grad_norm_(empty, 1.0)
        assert_bits_equal(n_ours, n_ref, "norm of no gradients")
        assert n_ours.device == n_ref.device


@pytest.mark.parametrize("poison", [INF, NAN], ids=["inf", "nan"])
@pytest.mark.parametrize("norm_type", [2.0, INF, 1.0], ids=["l2", "inf", "l1"])
def test_error_if_nonfinite(norm_type, poison):
    ours = make_params(sizes=[(1001,), (65537,)])
    ours[1].grad[12345] = poison
    ref = clone_params(ours)
    before = [p.grad.clone() for p in ours]
    with pytest.raises(RuntimeError, match="non-finite") as e_ref:
        torch.nn.utils.clip_grad_norm_(ref, 1.0, norm_type=norm_type, error_if_nonfinite=True)
    with pytest.raises(RuntimeError, match="non-finite") as e_ours:
        fu.clip_grad_norm_(ours, 1.0, norm_type=norm_type, error_if_nonfinite=True)
    assert str(e_ours.value) == str(e_ref.value)
    for i, (p, b) in enumerate(zip(ours, before)):
        assert_bits_equal(p.grad, b, f"grad {i} after the error")
    # Without the flag: torch's result, a non-finite norm and NaN/0 gradients.
    n_ours = fu.clip_grad_norm_(ours, 1.0, norm_type=norm_type)
    n_ref = torch.nn.utils.clip_grad_norm_(ref, 1.0, norm_type=norm_type)
    torch.testing.assert_close(n_ours, n_ref, equal_nan=True)
    for i, (a, b) in enumerate(zip(ours, ref)):
        torch.testing.assert_close(a.grad, b.grad, equal_nan=True, rtol=0, atol=0, msg=f"grad {i}")


def test_finite_norm_passes_error_check():
    ours = make_params(sizes=[(100,)])
    ref = clone_params(ours)
    n = fu.clip_grad_norm_(ours, 1.0, error_if_nonfinite=True)
    torch.nn.utils.clip_grad_norm_(ref, 1.0, error_if_nonfinite=True)
    assert torch.isfinite(n)
    torch.testing.assert_close(ours[0].grad, ref[0].grad, rtol=1e-6, atol=0)


# -------------------------------------------------- multi_tensor_l2norm op


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp64", "fp16", "bf16"])
def test_l2norm_per_tensor_and_total_match_fp64(dtype):
    tensors = [p.grad for p in make_params(dtype, scale=3.0)]
    total, per = torch.ops.fusetrain.multi_tensor_l2norm(tensors, True)
    assert total.dtype == per.dtype == torch.float32
    assert total.shape == () and per.shape == (len(tensors),)
    want = torch.stack([torch.linalg.vector_norm(t.double()) for t in tensors])
    # fp64 accumulation, one rounding to fp32: within one fp32 ulp.
    torch.testing.assert_close(per.double(), want, rtol=1.2e-7, atol=0)
    torch.testing.assert_close(total.double(), exact_norm(tensors), rtol=1.2e-7, atol=0)
    assert float(per[4]) == 0.0  # the empty tensor
    total_only, empty = torch.ops.fusetrain.multi_tensor_l2norm(tensors, False)
    assert_bits_equal(total_only, total, "total with and without per_tensor")
    assert empty.numel() == 0


def test_l2norm_mixed_dtypes_and_strided_inputs():
    g = torch.Generator().manual_seed(3)
    tensors = [
        torch.randn(301, 7, generator=g).t(),  # transposed (dense, not contiguous)
        torch.randn(1000, generator=g)[::3],  # strided with gaps
        torch.randn(65537, generator=g).bfloat16(),
        torch.randn(5, generator=g).half(),
        torch.randn(2, 3, 4, generator=g).double().permute(2, 0, 1),
    ]
    total, per = torch.ops.fusetrain.multi_tensor_l2norm(tensors, True)
    want = torch.stack([torch.linalg.vector_norm(t.double()) for t in tensors])
    torch.testing.assert_close(per.double(), want, rtol=1.2e-7, atol=0)
    torch.testing.assert_close(total.double(), exact_norm(tensors), rtol=1.2e-7, atol=0)


def test_l2norm_nonfinite():
    total, per = torch.ops.fusetrain.multi_tensor_l2norm([torch.ones(5), torch.tensor([1.0, INF])], True)
    assert float(total) == INF and per.tolist() == [pytest.approx(5**0.5), INF]
    total, per = torch.ops.fusetrain.multi_tensor_l2norm([torch.ones(5), torch.tensor([NAN, 1.0])], True)
    assert total.isnan() and per[1].isnan() and not per[0].isnan()


def test_l2norm_is_deterministic_across_thread_counts(intra_op_threads):
    tensors = [p.grad for p in make_params(scale=10.0)]
    two = torch.ops.fusetrain.multi_tensor_l2norm(tensors, True)
    torch.set_num_threads(1)
    one = torch.ops.fusetrain.multi_tensor_l2norm(tensors, True)
    assert_bits_equal(two[0], one[0], "total")
    assert_bits_equal(two[1], one[1], "per tensor")


def test_l2norm_errors_name_the_tensor():
    with pytest.raises(RuntimeError, match=r"tensors\[1\] must be a floating point"):
        torch.ops.fusetrain.multi_tensor_l2norm([torch.ones(3), torch.ones(3, dtype=torch.int64)], False)


# Chunk lengths: the CPU op's work items (csrc/ops/cpu/optim_cpu.cpp) and the CUDA
# kernels' (csrc/kernels/multi_tensor_apply.cuh); 65536 is a multiple of both.
CPU_CHUNK, CUDA_CHUNK = 32768, 65536
SPIKE = 100.0


def spiked(n: int, dtype: torch.dtype, device: str, misaligned: bool):
    """n values of 1e-2 noise with +-SPIKE at the first and last element of
    every CPU and CUDA chunk and at the last three (a 4-element vector
    load's ragged tail); a view one element into its buffer when misaligned
    (the CUDA kernel then takes its scalar path instead of 16-byte loads).
    Returns the tensor and the spikes' positions."""
    g = torch.Generator().manual_seed(n)
    values = torch.randn(n, generator=g) * 1e-2
    edges = {k * CPU_CHUNK + d for k in range(1, n // CPU_CHUNK + 1) for d in (-1, 0)}
    where = sorted(i for i in edges | {0, n - 3, n - 2, n - 1} if 0 <= i < n)
    values[where] = SPIKE * (1 - 2 * (torch.arange(len(where)) % 2)).float()
    buf = torch.zeros(n + 1, dtype=dtype, device=device)
    t = buf[1:] if misaligned else buf[:n]
    t.copy_(values.to(dtype))
    return t, where


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, "mixed"],
                         ids=["fp32", "fp16", "bf16", "mixed"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_l2norm_counts_every_chunk_edge_and_tail(device, dtype):
    """A whole-tensor norm at rtol 1e-5 hides dropped elements of ordinary
    size (dropping the first or the last element of every 64K chunk moves
    the norms of test_cuda_l2norm_matches_cpu_op's gradients by at most
    9e-6): here 4 to 20 spikes carry nearly all of each norm, so a kernel
    that skips or double-counts any chunk's first or last element, or a tail
    element, misses the reference by about 1/(2 * spikes) relative, far past
    the tolerance (checked below on the reference itself). Aligned tensors (vector loads) and misaligned views
    (scalar loads) in one call; "mixed" puts the three dtypes in one call
    (per-dtype launches scattered back into order)."""
    shapes = [278011, 65537, CUDA_CHUNK, 65542, 7]
    dtypes = [torch.float32, torch.float16, torch.bfloat16] if dtype == "mixed" else [dtype]
    tensors, spikes = [], []
    for i, n in enumerate(shapes):
        for misaligned in (False, True):
            t, where = spiked(n, dtypes[(i + misaligned) % len(dtypes)], device, misaligned)
            tensors.append(t)
            spikes.append(where)
    assert not all(t.data_ptr() % 16 == 0 for t in tensors) and any(t.data_ptr() % 16 == 0 for t in tensors)
    if device == "cuda":
        _poison_cuda_allocator()
    total, per = torch.ops.fusetrain.multi_tensor_l2norm(tensors, True)
    rtol = 1e-5  # the CUDA tests' fp32-accumulation tolerance; the CPU op's fp64 is far inside it
    squares = [t.detach().double().cpu().square() for t in tensors]
    want = torch.stack([sq.sum() for sq in squares]).sqrt()
    for sq, where, norm in zip(squares, spikes, want):
        dropped = (norm.square() - sq[where]).sqrt()  # the norm without each spike, one at a time
        assert bool(((norm - dropped) / norm > 100 * rtol).all()), "a spike too small to be missed"
    torch.testing.assert_close(per.double().cpu(), want, rtol=rtol, atol=0)
    torch.testing.assert_close(total.double().cpu(), want.square().sum().sqrt(), rtol=rtol, atol=0)


# ------------------------------------------------------------------- CUDA


def _poison_cuda_allocator(nbytes=256 << 20):
    """Fills cached-but-free device memory with NaN, so outputs the op forgets
    to write show up as NaN rather than as a lucky zero."""
    torch.full((nbytes // 4,), NAN, device="cuda")  # freed to the cache at once
    for n in (1, 7, 1000, 100000):
        torch.full((n,), NAN, device="cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_cuda_l2norm_matches_cpu_op(dtype):
    g = torch.Generator().manual_seed(5)
    sizes = SIZES + [(int(n),) for n in torch.randint(1, 5000, (700,), generator=g)]
    cpu = [p.grad for p in make_params(dtype, sizes=sizes, scale=2.0)]
    gpu = [t.cuda() for t in cpu]
    _poison_cuda_allocator()
    total, per = torch.ops.fusetrain.multi_tensor_l2norm(gpu, True)
    total_c, per_c = torch.ops.fusetrain.multi_tensor_l2norm(cpu, True)
    torch.cuda.synchronize()
    assert total.device.type == "cuda" and total.dtype == torch.float32
    # fp32 accumulation on the GPU (each thread sums <= 128 squares before the
    # tree): within 1e-5 of the fp64-accumulated CPU result.
    torch.testing.assert_close(per.cpu(), per_c, rtol=1e-5, atol=0)
    torch.testing.assert_close(total.cpu(), total_c, rtol=1e-5, atol=0)
    _poison_cuda_allocator()
    total_only, empty = torch.ops.fusetrain.multi_tensor_l2norm(gpu, False)
    torch.testing.assert_close(total_only.cpu(), total_c, rtol=1e-5, atol=0)
    assert empty.numel() == 0


@pytest.mark.cuda
def test_cuda_l2norm_mixed_dtypes_keep_their_order():
    g = torch.Generator().manual_seed(6)
    cpu = [torch.randn(n, generator=g).to(dt) for n, dt in
           [(1001, torch.float32), (70000, torch.bfloat16), (3, torch.float32), (65536, torch.float16),
            (0, torch.bfloat16), (5, torch.float32)]]
    _poison_cuda_allocator()
    total, per = torch.ops.fusetrain.multi_tensor_l2norm([t.cuda() for t in cpu], True)
    total_c, per_c = torch.ops.fusetrain.multi_tensor_l2norm(cpu, True)
    torch.testing.assert_close(per.cpu(), per_c, rtol=1e-5, atol=0)
    torch.testing.assert_close(total.cpu(), total_c, rtol=1e-5, atol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_clip_grad_norm_matches_torch(dtype):
    ours = make_params(dtype, device="cuda")
    ref = clone_params(ours)
    grads64 = [p.grad.double() for p in ours]
    exact = exact_norm(grads64)
    n_ours = fu.clip_grad_norm_(ours, float(exact) / 3)
    n_ref = torch.nn.utils.clip_grad_norm_(ref, float(exact) / 3)
    assert n_ours.device.type == "cuda"
    assert rel_err(n_ours, exact) <= max(1e-5, 2 * rel_err(n_ref, exact))
    coef = (float(exact) / 3) / (float(exact) + 1e-6)
    err_o = max(rel_err(a.grad, g * coef) for a, g in zip(ours, grads64) if g.numel())
    err_t = max(rel_err(b.grad, g * coef) for b, g in zip(ref, grads64) if g.numel())
    assert err_o <= max(2 * err_t, 2e-5), (err_o, err_t)


@pytest.mark.cuda
def test_cuda_l2norm_over_more_tensors_than_one_launch_holds():
    # 17000 tensors, 8500 of each dtype: the per-tensor sums and the dtype
    # scatter each take two launches (their index lists travel as kernel
    # parameters, 7995 a launch).
    g = torch.Generator().manual_seed(7)
    cpu = [torch.randn(int(n), generator=g).to(torch.float32 if i % 2 else torch.bfloat16)
           for i, n in enumerate(torch.randint(1, 300, (17000,), generator=g))]
    _poison_cuda_allocator()
    total, per = torch.ops.fusetrain.multi_tensor_l2norm([t.cuda() for t in cpu], True)
    total_c, per_c = torch.ops.fusetrain.multi_tensor_l2norm(cpu, True)
    torch.cuda.synchronize()
    torch.testing.assert_close(per.cpu(), per_c, rtol=1e-5, atol=0)
    torch.testing.assert_close(total.cpu(), total_c, rtol=1e-5, atol=0)


@pytest.mark.cuda
def test_cuda_l2norm_is_capturable():
    # Nothing is staged through host memory: a graph replay sees new values.
    xs = [torch.randn(n, device="cuda") for n in (70000, 3, 65536)] + [torch.randn(9, device="cuda").bfloat16()]
    torch.ops.fusetrain.multi_tensor_l2norm(xs, True)  # warm-up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        total, per = torch.ops.fusetrain.multi_tensor_l2norm(xs, True)
    for seed in range(3):
        g = torch.Generator(device="cuda").manual_seed(seed)
        for x in xs:
            x.copy_(torch.randn(x.shape, generator=g, device="cuda"))
        graph.replay()
        want_total, want_per = torch.ops.fusetrain.multi_tensor_l2norm([x.cpu() for x in xs], True)
        torch.testing.assert_close(per.cpu(), want_per, rtol=1e-5, atol=0)
        torch.testing.assert_close(total.cpu(), want_total, rtol=1e-5, atol=0)
