"""torch.ops.fusetrain.non_finite_check_and_unscale_ and update_scale_
against torch's own kernels (torch._amp_foreach_non_finite_check_and_unscale_
and torch._amp_update_scale_), run side by side on identical inputs: odd sizes
that end in vector tails and cross the CPU kernel's chunk boundaries, four
dtypes, misaligned, strided and permuted views, inf/NaN in the last element.
Results must be bit-equal to torch's, signed zeros included; NaN payloads are
not compared (torch's own bf16 kernel changes a NaN's payload in its vector body
but not in its scalar tail), but where NaNs are is.
"""

from __future__ import annotations

import functools
import math
import random

import pytest
import torch

import fusetrain  # noqa: F401  (registers torch.ops.fusetrain)
from conftest import assert_bits_equal

unscale_ = torch.ops.fusetrain.non_finite_check_and_unscale_
update_scale_ = torch.ops.fusetrain.update_scale_

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SIZES = [278011, 1, 7, 65537, 32768, 32769, 15, 16, 17]
INF, NAN = float("inf"), float("nan")


def inv_of(scale: float) -> torch.Tensor:
    """The inverse scale exactly as GradScaler computes it."""
    return torch.tensor(scale, dtype=torch.float32).double().reciprocal().float()


INV_SCALES = {
    "pow2": inv_of(2.0**16),
    "third": inv_of(3.0),  # not a power of two: rounding must match torch's
    "tiny": inv_of(3.0e7),  # fp16 results land in the subnormal range
    "one": torch.tensor(1.0),  # passthrough
}


@functools.lru_cache(maxsize=None)
def _base_values(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Within fp16's range; a few exact zeros, negative zeros and tiny values.
    t = torch.randn(n, generator=g) * 900
    if n > 8:
        t[1], t[2], t[3] = 0.0, -0.0, 1e-6
    return t


def values(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A fresh tensor of n reproducible values."""
    return _base_values(n, seed).to(dtype, copy=True)


def poison(t: torch.Tensor, where: str) -> None:
    """Puts an inf or NaN at a position of t (in logical order; t may be a view)."""
    if where == "none":
        return
    n = t.numel()
    index, value = {
        "first": (0, -INF),
        "last": (n - 1, INF),
        "last_nan": (n - 1, NAN),
        "middle": (n // 2, NAN),
        "chunk_edge": (min(32768, n - 1), NAN),  # first element of the CPU kernel's second chunk
    }[where]
    t[tuple(int(i) for i in torch.unravel_index(torch.tensor(index), t.shape))] = value


def run_both(factory, inv: torch.Tensor, found_init: float = 0.0):
    """factory() -> (tensors to unscale, tensors to compare afterwards). It is
    called twice with identical results: once for fusetrain, once for torch."""
    ours, ours_check = factory()
    theirs, theirs_check = factory()
    found_ours = torch.full((), found_init)
    found_theirs = torch.full((), found_init)
    unscale_(ours, found_ours, inv.clone())
    torch._amp_foreach_non_finite_check_and_unscale_(theirs, found_theirs, inv.clone())
    for i, (a, b) in enumerate(zip(ours_check, theirs_check, strict=True)):
        assert a.isnan().equal(b.isnan()), f"tensor {i}: NaNs in different places"
        assert_bits_equal(a, b, f"tensor {i}", nan_payload=False)
    assert_bits_equal(found_ours, found_theirs, "found_inf")
    return found_ours.item()


# ------------------------------------------------------- unscale + inf check


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inv_name", list(INV_SCALES))
def test_unscale_rounds_as_torch_on_odd_sizes(dtype, inv_name):
    for n in SIZES:
        def factory():
            t = values(n, dtype, seed=n)
            return [t], [t]

        assert run_both(factory, INV_SCALES[inv_name]) == 0.0, n


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("where", ["last", "last_nan", "first", "middle", "chunk_edge"])
def test_unscale_finds_inf_nan_as_torch_on_odd_sizes(dtype, where):
    for n in SIZES:
        def factory():
            t = values(n, dtype, seed=n)
            poison(t, where)
            return [t], [t]

        assert run_both(factory, INV_SCALES["third"]) == 1.0, n


LAYOUTS = ["misaligned", "strided", "transposed", "permuted4d", "mixed_list"]


def layout_factory(layout: str, dtype: torch.dtype, where: str):
    def factory():
        if layout == "misaligned":
            base = values(278011 + 1, dtype, seed=1)
            views = [base[1:], values(65537 + 3, dtype, seed=2)[3:]]
            bases = [base]
        elif layout == "strided":  # not dense: every other element
            base = values(2 * 65537, dtype, seed=3)
            views = [base[::2], base[1::2][:7]]
            bases = [base]
        elif layout == "transposed":  # dense, not contiguous
            base = values(517 * 539, dtype, seed=4).view(517, 539)
            views = [base.t()]
            bases = [base]
        elif layout == "permuted4d":  # channels-last-like
            base = values(3 * 5 * 7 * 11, dtype, seed=5).view(3, 5, 7, 11)
            views = [base.permute(0, 2, 3, 1)]
            bases = [base]
        else:  # many tensors in one call, contiguous and not
            rng = random.Random(6)
            views, bases = [], []
            for k in range(200):
                n = rng.choice([1, 3, 7, 64, 100, 4097, 9999])
                t = values(n + 1, dtype, seed=100 + k)
                views.append(t[1:] if k % 3 == 0 else t)
                bases.append(t)
        poison(views[-1], where)
        return views, bases

    return factory


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("where", ["none", "last"])
def test_unscale_matches_torch_on_views(dtype, layout, where):
    """Views are unscaled in place and nothing outside them is touched."""
    for inv_name, inv in INV_SCALES.items():
        found = run_both(layout_factory(layout, dtype, where), inv)
        assert found == (0.0 if where == "none" else 1.0), inv_name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_parallel_kernel_matches_torch(dtype, intra_op_threads):
    """With several threads the chunks of one call run in parallel: the flag
    must be found whichever thread's chunk holds the inf, and every chunk unscaled."""
    assert torch.get_num_threads() == intra_op_threads
    for where in ("none", "last", "chunk_edge", "first"):
        found = run_both(layout_factory("mixed_list", dtype, where), INV_SCALES["third"])
        assert found == (0.0 if where == "none" else 1.0), where

        def big():
            t = values(278011, dtype, seed=11)
            poison(t, where)
            return [t, values(65537, dtype, seed=12)], [t]

        assert run_both(big, INV_SCALES["third"]) == (0.0 if where == "none" else 1.0), where


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_inv_scale_one_is_a_bitwise_passthrough(dtype):
    t = values(4099, dtype, seed=9)
    t[100], t[200], t[300] = NAN, -0.0, torch.finfo(dtype).tiny / 4
    original = t.clone()
    found = torch.zeros(())
    unscale_([t], found, torch.tensor(1.0))
    assert_bits_equal(t, original, "passthrough")
    assert found.item() == 1.0
    run_both(lambda: ([t.clone()],) * 2, torch.tensor(1.0))


def test_found_inf_is_only_ever_set_never_cleared():
    """The caller zeroes found_inf: a set flag survives finite tensors, as in torch."""
    found = run_both(lambda: ([values(1000, torch.float32, 1)],) * 2, inv_of(8.0), found_init=1.0)
    assert found == 1.0


def test_empty_list_and_empty_tensors():
    found = torch.zeros(())
    unscale_([], found, inv_of(2.0))
    assert found.item() == 0.0
    run_both(lambda: ([torch.empty(0), values(5, torch.float32, 0)],) * 2, inv_of(4.0))


def test_every_position_of_a_small_tensor_is_checked():
    """An inf in any lane of the vector body or the scalar tail is found."""
    for dtype in DTYPES:
        for n in (1, 2, 15, 31, 33, 67):
            for i in range(n):
                t = torch.ones(n, dtype=dtype)
                t[i] = NAN if i % 2 else INF
                found = torch.zeros(())
                unscale_([t], found, inv_of(2.0))
                assert found.item() == 1.0, (dtype, n, i)


def test_unscale_rejects_bad_arguments_naming_them():
    good = torch.ones(4)
    found, inv = torch.zeros(()), inv_of(2.0)
    with pytest.raises(RuntimeError, match=r"self\[1\].*floating point.*Long"):
        unscale_([good, torch.ones(3, dtype=torch.int64)], found, inv)
    with pytest.raises(RuntimeError, match=r"self\[2\] is on meta"):
        unscale_([good, good.clone(), torch.ones(3, device="meta")], found, inv)
    with pytest.raises(RuntimeError, match=r"found_inf must be Float"):
        unscale_([good], torch.zeros((), dtype=torch.float64), inv)
    with pytest.raises(RuntimeError, match=r"inv_scale must hold exactly one element"):
        unscale_([good], found, torch.ones(2))
    # A sparse tensor reaches the device-generic kernel (Note [Device-generic
    # ops]), whose argument check names it.
    with pytest.raises(RuntimeError, match=r"self\[0\] must be a strided tensor; pass a sparse gradient's values"):
        unscale_([torch.ones(3).to_sparse()], found, inv)
    assert torch.equal(good, torch.ones(4)) and found.item() == 0.0


def test_meta_kernel_traces_without_data():
    """Tracing (torch.compile's fake tensors) goes through the Meta kernels:
    they take what the CPU kernel takes, return update_scale_'s self, and
    reject what it rejects, with the same message."""
    ts = [torch.empty(10, device="meta"), torch.empty(3, 3, device="meta", dtype=torch.bfloat16)]
    found = torch.empty((), device="meta")
    assert unscale_(ts, found, torch.empty((), device="meta")) is None
    assert [(t.shape, t.dtype, t.device.type) for t in ts] == [
        ((10,), torch.float32, "meta"), ((3, 3), torch.bfloat16, "meta")]
    scale = torch.empty((), device="meta")
    tracker = torch.empty((), device="meta", dtype=torch.int32)
    out = update_scale_(scale, tracker, tracker.clone(), torch.empty((), device="meta"), 2.0, 0.5, 10, INF, 0)
    assert out is scale
    with pytest.raises(RuntimeError, match=r"self\[1\].*floating point.*Long"):
        unscale_([ts[0], torch.empty(3, device="meta", dtype=torch.int64)], found, found.clone())
    with pytest.raises(RuntimeError, match=r"inv_scale must hold exactly one element"):
        unscale_(ts, found, torch.empty(2, device="meta"))
    with pytest.raises(RuntimeError, match="growth_tracker must be Int"):
        update_scale_(scale, torch.empty((), device="meta"), tracker, found, 2.0, 0.5, 10, INF, 0)
    with pytest.raises(RuntimeError, match="growth_interval must be > 0"):
        update_scale_(scale, tracker, tracker.clone(), found, 2.0, 0.5, 0, INF, 0)


# --------------------------------------------------------------- update_scale_


def ours_update(scale, tracker, overflow, found, gf, bf, gi, max_scale=INF, hysteresis=0):
    return update_scale_(scale, tracker, overflow, found, gf, bf, gi, max_scale, hysteresis)


@pytest.mark.parametrize(
    "growth_factor,backoff_factor,growth_interval",
    [(2.0, 0.5, 1), (2.0, 0.5, 3), (1.5, 0.7, 2), (3.7, 0.3, 7), (1.0000001, 0.9999999, 2), (65536.0, 0.125, 1)],
)
def test_update_scale_matches_torch_over_random_sequences(growth_factor, backoff_factor, growth_interval):
    rng = random.Random(growth_interval * 31 + int(growth_factor * 7))
    for init in (2.0**16, 1.0, 3.0e38, 1e-40):
        s_o, s_t = torch.full((), init), torch.full((), init)
        g_o = torch.zeros((), dtype=torch.int32)
        g_t = torch.zeros((), dtype=torch.int32)
        overflow = torch.zeros((), dtype=torch.int32)
        for step in range(60):
            f = torch.tensor(rng.choice([0.0, 0.0, 0.0, 1.0, 2.0]))
            out = ours_update(s_o, g_o, overflow, f, growth_factor, backoff_factor, growth_interval)
            assert out.data_ptr() == s_o.data_ptr()  # in place, returns self
            torch._amp_update_scale_(s_t, g_t, f, growth_factor, backoff_factor, growth_interval)
            assert_bits_equal(s_o, s_t, f"scale at step {step} from {init}")
            assert torch.equal(g_o, g_t), f"growth tracker at step {step}: {g_o} != {g_t}"


def test_update_scale_edge_cases_match_torch():
    cases = [
        # (scale, tracker, found_inf, growth, backoff, interval)
        (3.0e38, 0, 0.0, 2.0, 0.5, 1),  # growth would overflow to inf: keep the scale
        (torch.finfo(torch.float32).max, 4, 0.0, 1.5, 0.5, 5),
        (1.4e-45, 0, 1.0, 2.0, 0.5, 1),  # backoff of the smallest subnormal
        (1024.0, 7, 0.0, 2.0, 0.5, 3),  # tracker already past the interval: torch's `==`
        (1024.0, 2, NAN, 2.0, 0.5, 3),  # a NaN flag counts as an overflow
        (1024.0, 2, -1.0, 2.0, 0.5, 3),  # any non-zero flag does
        (INF, 0, 0.0, 2.0, 0.5, 1),
        (1000.0, 0, 0.0, 1.1, 0.5, 1),
    ]
    for scale, tracker, found, gf, bf, gi in cases:
        s_o, s_t = torch.tensor(scale), torch.tensor(scale)
        g_o, g_t = torch.tensor(tracker, dtype=torch.int32), torch.tensor(tracker, dtype=torch.int32)
        ours_update(s_o, g_o, torch.zeros((), dtype=torch.int32), torch.tensor(found), gf, bf, gi)
        torch._amp_update_scale_(s_t, g_t, torch.tensor(found), gf, bf, gi)
        assert_bits_equal(s_o, s_t, f"scale for case {(scale, tracker, found, gf, bf, gi)}")
        assert torch.equal(g_o, g_t), (scale, tracker, found, gf, bf, gi)


def test_update_scale_max_scale_and_hysteresis():
    s = torch.tensor(4096.0)
    g = torch.zeros((), dtype=torch.int32)
    o = torch.zeros((), dtype=torch.int32)
    no, yes = torch.tensor(0.0), torch.tensor(1.0)
    ours_update(s, g, o, no, 2.0, 0.5, 1, max_scale=5000.0)
    assert s.item() == 5000.0
    ours_update(s, g, o, no, 2.0, 0.5, 1, max_scale=5000.0)
    assert s.item() == 5000.0
    # hysteresis 2: two overflows tolerated (counted), the third backs off
    for k, expected in enumerate([5000.0, 5000.0, 2500.0]):
        ours_update(s, g, o, yes, 2.0, 0.5, 1, max_scale=5000.0, hysteresis=2)
        assert s.item() == expected, k
        assert g.item() == 0
    assert o.item() == 0  # backing off starts a fresh count


def test_update_scale_rejects_bad_arguments_naming_them():
    s, g, o, f = torch.tensor(1.0), torch.zeros((), dtype=torch.int32), torch.zeros((), dtype=torch.int32), torch.tensor(0.0)
    with pytest.raises(RuntimeError, match="growth_tracker must be Int"):
        update_scale_(s, torch.zeros(()), o, f, 2.0, 0.5, 1, INF, 0)
    with pytest.raises(RuntimeError, match="overflow_tracker must be Int"):
        update_scale_(s, g, torch.zeros(()), f, 2.0, 0.5, 1, INF, 0)
    with pytest.raises(RuntimeError, match="growth_factor must be > 1"):
        update_scale_(s, g, o, f, 1.0, 0.5, 1, INF, 0)
    with pytest.raises(RuntimeError, match="backoff_factor must be in"):
        update_scale_(s, g, o, f, 2.0, 1.5, 1, INF, 0)
    with pytest.raises(RuntimeError, match="growth_interval must be > 0"):
        update_scale_(s, g, o, f, 2.0, 0.5, 0, INF, 0)
    with pytest.raises(RuntimeError, match="found_inf is on meta"):
        update_scale_(s, g, o, torch.empty((), device="meta"), 2.0, 0.5, 1, INF, 0)
    assert s.item() == 1.0 and g.item() == 0
    assert not math.isnan(s.item())


def test_mixed_dtypes_in_one_call_match_torch():
    """One list may mix dtypes (an optimizer with fp32, bf16, fp16 and fp64 parameters)."""
    def factory():
        ts = [values(n, dt, seed=i) for i, (n, dt) in enumerate(
            [(1001, torch.float32), (77, torch.bfloat16), (65537, torch.float16), (9, torch.float64),
             (32769, torch.bfloat16), (3, torch.float32)])]
        poison(ts[3], "last")
        return ts, ts

    assert run_both(factory, INV_SCALES["third"]) == 1.0


# ------------------------------------------------------------ CUDA (GPU box)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_unscale_matches_the_cpu_kernel_and_torch(dtype):
    """The CUDA kernel gives the CPU kernel's bits (itself checked against
    torch's above), and torch's CUDA kernel's where torch has one (it has
    long lacked bf16)."""
    for n in SIZES:
        for where in ("none", "last", "first", "chunk_edge"):
            cpu = values(n, dtype, seed=n)
            poison(cpu, where)
            gpu = cpu.cuda()
            misaligned = torch.cat([cpu.new_zeros(1), cpu]).cuda()[1:]
            f_cpu, f_gpu, f_mis = torch.zeros(()), torch.zeros((), device="cuda"), torch.zeros((), device="cuda")
            inv = INV_SCALES["third"]
            unscale_([cpu], f_cpu, inv)
            unscale_([gpu], f_gpu, inv.cuda())
            unscale_([misaligned], f_mis, inv.cuda())
            assert_bits_equal(gpu.cpu(), cpu, f"cuda n={n} {where}", nan_payload=False)
            assert_bits_equal(misaligned.cpu(), cpu, f"cuda misaligned n={n} {where}", nan_payload=False)
            assert f_gpu.item() == f_mis.item() == f_cpu.item() == (0.0 if where == "none" else 1.0)
            theirs = values(n, dtype, seed=n)
            poison(theirs, where)
            theirs = theirs.cuda()
            f_theirs = torch.zeros((), device="cuda")
            try:
                torch._amp_foreach_non_finite_check_and_unscale_([theirs], f_theirs, inv.cuda())
            except (RuntimeError, NotImplementedError):
                assert dtype == torch.bfloat16
                continue
            assert_bits_equal(gpu, theirs, f"cuda vs torch n={n} {where}", nan_payload=False)
            assert f_theirs.item() == f_gpu.item()


@pytest.mark.cuda
def test_cuda_update_scale_matches_torch():
    rng = random.Random(5)
    for gf, bf, gi in [(2.0, 0.5, 1), (1.5, 0.7, 3)]:
        s_o, s_t = torch.full((), 1024.0, device="cuda"), torch.full((), 1024.0, device="cuda")
        g_o = torch.zeros((), dtype=torch.int32, device="cuda")
        g_t = torch.zeros((), dtype=torch.int32, device="cuda")
        o = torch.zeros((), dtype=torch.int32, device="cuda")
        for step in range(40):
            f = torch.tensor(rng.choice([0.0, 0.0, 1.0, 2.0]), device="cuda")
            ours_update(s_o, g_o, o, f, gf, bf, gi)
            torch._amp_update_scale_(s_t, g_t, f, gf, bf, gi)
            assert_bits_equal(s_o, s_t, f"scale at step {step}")
            assert torch.equal(g_o, g_t), step
