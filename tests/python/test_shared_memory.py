"""The torch.distributed backend "fusetrain" (Note [Shared-memory allreduce]
in csrc/dist/shared_memory.h): gloo, with the allreduces, all-gathers,
reduce-scatters and broadcasts of CPU tensors going through shared memory
when every rank is on this host.

Each rank checks every dtype and reduction against torch's own ops applied
to all ranks' inputs in rank order (16-bit types in float32, rounded once),
bit for bit, at sizes around the 2 MiB chunk; torch's DDP and fusetrain's DDP
on a "fusetrain" group train to the same parameters as on a gloo group (the
same bits for two ranks, whose sum is a + b either way).
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ddp_harness
from ddp_harness import findings

from fusetrain.parallel import DistributedDataParallel, shared_memory_collectives, uses_shared_memory

OPS = {
    "sum": (dist.ReduceOp.SUM, torch.add),
    "product": (dist.ReduceOp.PRODUCT, torch.mul),
    "min": (dist.ReduceOp.MIN, torch.minimum),
    "max": (dist.ReduceOp.MAX, torch.maximum),
    "avg": (dist.ReduceOp.AVG, torch.add),  # then divided by the world size
}
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64]
CHUNK_FLOATS = (2 << 20) // 4  # one slot a rank for two or three ranks


def _input(rank: int, n: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + n % 997 + len(op))
    if not dtype.is_floating_point:
        hi = 4 if op == "product" else 100000
        return torch.randint(-hi, hi, (n,), generator=g, dtype=dtype)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    if op == "product":
        x = x.abs() + 0.5
    if n > 5:
        x[n // 3] = float("nan") if rank == 1 else 1.0
    return x.to(dtype)


def sc_allreduce(pg, rank, world):
    assert uses_shared_memory(pg)
    wrong = []
    for dtype in DTYPES:
        narrow = dtype in (torch.bfloat16, torch.float16)
        for name, (op, fn) in OPS.items():
            if name == "avg" and not dtype.is_floating_point:
                continue
            for n in (1, 17, 4099, CHUNK_FLOATS + 17, 2 * CHUNK_FLOATS + 1000):
                expected = _input(0, n, dtype, name)
                expected = expected.float() if narrow else expected
                for r in range(1, world):
                    x = _input(r, n, dtype, name)
                    expected = fn(expected, x.float() if narrow else x)
                expected = expected.to(dtype)
                if name == "avg":
                    expected.div_(world)  # gloo's AVG: the sum, divided in place
                t = _input(rank, n, dtype, name)
                dist.all_reduce(t, op=op, group=pg)
                if not torch.equal(torch.nan_to_num(t), torch.nan_to_num(expected)) or \
                        not torch.equal(t.isnan(), expected.isnan()):
                    wrong.append((str(dtype), name, n))
    # A strided view: its own elements, not the first numel() of its memory.
    base = torch.full((10,), float(rank + 1))
    dist.all_reduce(base[::2], group=pg)
    strided_ok = torch.equal(base[::2], torch.full((5,), world * (world + 1) / 2)) and \
        torch.equal(base[1::2], torch.full((5,), float(rank + 1)))
    return {"wrong": wrong, "strided_ok": strided_ok}


def _reduced(world: int, n: int, dtype: torch.dtype, name: str, piece: slice = slice(None)):
    """The ranks' inputs reduced in rank order as torch would (16-bit types
    in float32, rounded once; AVG the rounded sum divided in place)."""
    narrow = dtype in (torch.bfloat16, torch.float16)
    fn = OPS[name][1]
    acc = None
    for r in range(world):
        x = _input(r, n, dtype, name)[piece]
        x = x.float() if narrow else x
        acc = x if acc is None else fn(acc, x)
    acc = acc.to(dtype)
    return acc.div_(world) if name == "avg" else acc


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.dtype.is_floating_point:
        return torch.equal(a, b)
    return torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)) and torch.equal(a.isnan(), b.isnan())


def sc_collectives(pg, rank, world):
    """all_gather_into_tensor, all_gather, reduce_scatter_tensor and
    broadcast against the inputs moved by hand, bit for bit, out of place and
    in place, at sizes on both sides of a slot chunk; each call is counted as
    a shared-memory one (not handed to gloo)."""
    wrong, counted = [], []

    def check(label, ok, kind, before):
        if not ok:
            wrong.append(label)
        if shared_memory_collectives(pg).get(kind, 0) != before.get(kind, 0) + 1:
            counted.append(label)

    sizes = (1, 17, 4099, CHUNK_FLOATS // world + 17, CHUNK_FLOATS + 1000)
    for dtype in DTYPES + [torch.bool, torch.uint8]:
        for n in sizes:
            mine = _input(rank, n, torch.float64, "sum").gt(0) if dtype == torch.bool else \
                _input(rank, n, dtype if dtype != torch.uint8 else torch.int32, "sum").to(dtype)
            every = [(_input(r, n, torch.float64, "sum").gt(0) if dtype == torch.bool else
                      _input(r, n, dtype if dtype != torch.uint8 else torch.int32, "sum").to(dtype))
                     for r in range(world)]
            label = (str(dtype), n)
            before = shared_memory_collectives(pg)
            out = torch.empty(world * n, dtype=dtype)
            dist.all_gather_into_tensor(out, mine, group=pg)
            check(("all_gather_into_tensor",) + label, _same(out, torch.cat(every)),
                  "all_gather_into_tensor", before)
            # In place: the input is the output's own piece.
            before = shared_memory_collectives(pg)
            out = torch.zeros(world * n, dtype=dtype)
            out[rank * n:(rank + 1) * n] = mine
            dist.all_gather_into_tensor(out, out[rank * n:(rank + 1) * n], group=pg)
            check(("all_gather_into_tensor in place",) + label, _same(out, torch.cat(every)),
                  "all_gather_into_tensor", before)
            before = shared_memory_collectives(pg)
            outs = [torch.empty(n, dtype=dtype) for _ in range(world)]
            dist.all_gather(outs, mine, group=pg)
            check(("all_gather",) + label, all(_same(a, b) for a, b in zip(outs, every)), "all_gather", before)
            for root in range(world):
                before = shared_memory_collectives(pg)
                t = mine.clone()
                dist.broadcast(t, src=root, group=pg)
                check(("broadcast", root) + label, _same(t, every[root]), "broadcast", before)
    for dtype in DTYPES:
        for name, (op, _) in OPS.items():
            if name == "avg" and not dtype.is_floating_point:
                continue
            for n in sizes:
                piece = slice(rank * n, (rank + 1) * n)
                expected = _reduced(world, world * n, dtype, name, piece)
                label = (str(dtype), name, n)
                before = shared_memory_collectives(pg)
                out = torch.empty(n, dtype=dtype)
                dist.reduce_scatter_tensor(out, _input(rank, world * n, dtype, name), op=op, group=pg)
                check(("reduce_scatter_tensor",) + label, _same(out, expected), "reduce_scatter_tensor", before)
                before = shared_memory_collectives(pg)
                whole = _input(rank, world * n, dtype, name)
                dist.reduce_scatter_tensor(whole[piece], whole, op=op, group=pg)
                check(("reduce_scatter_tensor in place",) + label, _same(whole[piece], expected),
                      "reduce_scatter_tensor", before)
    # A strided broadcast: its own elements, the rest of its memory untouched.
    before = shared_memory_collectives(pg)
    base = torch.full((10,), float(rank + 1))
    dist.broadcast(base[1::2], src=world - 1, group=pg)
    check(("broadcast strided",), torch.equal(base[1::2], torch.full((5,), float(world))) and
          torch.equal(base[::2], torch.full((5,), float(rank + 1))), "broadcast", before)
    # A bitwise reduction is gloo's, and not counted.
    before = shared_memory_collectives(pg)
    t = torch.tensor([1 << rank] * 3, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.BOR, group=pg)
    gloo_not_counted = shared_memory_collectives(pg) == before and torch.equal(t, torch.full((3,), (1 << world) - 1))
    return {"wrong": wrong, "counted": counted, "gloo_not_counted": gloo_not_counted}


def sc_errors(pg, rank, world):
    """Paths chosen alike on every rank, local errors kept local, and
    mismatched calls failing every rank at once instead of hanging."""
    out = {}
    # An expanded root tensor is a fine source (the path must not depend on
    # this rank's strides, or the root would go to gloo and the rest wait).
    t = torch.full((1,), 7.0).expand(1000) if rank == 0 else torch.zeros(1000)
    dist.broadcast(t, src=0, group=pg)
    out["expanded_root"] = bool(torch.equal(t, torch.full((1000,), 7.0)))
    # A receiver whose elements share memory fails alone, after the data
    # moved; the ranks stay in step.
    t = torch.zeros(1).expand(1000) if rank == world - 1 else torch.ones(1000)
    try:
        dist.broadcast(t, src=0, group=pg)
        out["expanded_receiver_error"] = None
    except RuntimeError as e:
        out["expanded_receiver_error"] = str(e)
    s = torch.ones(5)
    dist.all_reduce(s, group=pg)
    out["in_step_after_local_error"] = bool(torch.equal(s, torch.full((5,), float(world))))
    # ReduceOp.AVG of integers (gloo's "result type Float can't be cast to
    # the desired output type Long" after the sum): refused on every rank
    # before anything is sent, saying what to do; the group goes on.
    out["avg_int_errors"] = []
    for call in (lambda: dist.all_reduce(torch.ones(4, dtype=torch.int64), op=dist.ReduceOp.AVG, group=pg),
                 lambda: dist.reduce_scatter_tensor(torch.zeros(2, dtype=torch.int32),
                                                    torch.ones(2 * world, dtype=torch.int32),
                                                    op=dist.ReduceOp.AVG, group=pg)):
        try:
            call()
            out["avg_int_errors"].append(None)
        except ValueError as e:
            out["avg_int_errors"].append(str(e))
    s = torch.ones(5)
    dist.all_reduce(s, op=dist.ReduceOp.AVG, group=pg)
    out["in_step_after_avg_errors"] = bool(torch.equal(s, torch.ones(5)))
    # Mismatched sizes: every rank raises, naming the mismatch; then every
    # later collective fails at once too.
    try:
        dist.broadcast(torch.zeros(10 + rank), src=0, group=pg)
        out["mismatch_error"] = None
    except RuntimeError as e:
        out["mismatch_error"] = str(e)
    try:
        dist.all_reduce(torch.ones(3), group=pg)
        out["after_mismatch_error"] = None
    except RuntimeError as e:
        out["after_mismatch_error"] = str(e)
    return out


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 300), nn.Tanh(), nn.Linear(300, 41), nn.Tanh(), nn.Linear(41, 5))


def _train(model: nn.Module, rank: int, world: int) -> torch.Tensor:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(8):
        g = torch.Generator().manual_seed(7000 + step)
        x, y = torch.randn(8 * world, 7, generator=g), torch.randn(8 * world, 5, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x[rank::world]), y[rank::world]).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def sc_ddp(pg, rank, world):
    gloo = dist.new_group(backend="gloo", timeout=timedelta(seconds=ddp_harness.PG_TIMEOUT_S))
    out = {}
    for name, wrap in (("torch", torch.nn.parallel.DistributedDataParallel), ("fusetrain", DistributedDataParallel)):
        kw = dict(bucket_cap_mb=0.02)
        out[name + "_shm"] = _train(wrap(_net(100 + rank), process_group=pg, **kw), rank, world)
        out[name + "_gloo"] = _train(wrap(_net(100 + rank), process_group=gloo, **kw), rank, world)
    out["gloo_uses_shm"] = uses_shared_memory(gloo)
    return out


SUITES = {"shm": [sc_allreduce, sc_collectives, sc_ddp, sc_errors]}


@pytest.fixture(scope="module", params=[2, 3], ids=["w2", "w3"])
def shm(request, tmp_path_factory):
    world = request.param
    results = ddp_harness.launch(Path(__file__), world, "shm", tmp_path_factory.mktemp(f"shm_w{world}"),
                                 backend="fusetrain")
    return world, results


def test_allreduce_every_dtype_and_op_bit_for_bit(shm):
    world, results = shm
    for rank, d in enumerate(findings(results, "allreduce")):
        assert d["wrong"] == [], f"rank {rank}: wrong results for {d['wrong'][:5]}"
        assert d["strided_ok"], f"rank {rank}: a strided view came back wrong"


def test_gathers_scatters_and_broadcasts_bit_for_bit_through_the_segment(shm):
    world, results = shm
    for rank, d in enumerate(findings(results, "collectives")):
        assert d["wrong"] == [], f"rank {rank}: wrong results for {d['wrong'][:5]}"
        assert d["counted"] == [], f"rank {rank}: not run through shared memory: {d['counted'][:5]}"
        assert d["gloo_not_counted"], f"rank {rank}: a bitwise allreduce was counted or came back wrong"


def test_paths_agree_local_errors_stay_local_and_mismatches_fail_every_rank(shm):
    world, results = shm
    for rank, d in enumerate(findings(results, "errors")):
        assert d["expanded_root"], f"rank {rank}: the expanded root's data did not arrive"
        if rank == world - 1:
            assert d["expanded_receiver_error"] is not None, "an expanded receiver was written"
        else:
            assert d["expanded_receiver_error"] is None, d["expanded_receiver_error"]
        assert d["in_step_after_local_error"], f"rank {rank}: a local error broke the group"
        for e, kind in zip(d["avg_int_errors"], ("all_reduce", "reduce_scatter_tensor")):
            assert e is not None and kind in e and "ReduceOp.SUM and divide" in e, (rank, d["avg_int_errors"])
        assert d["in_step_after_avg_errors"], f"rank {rank}: the refused averages broke the group"
        assert d["mismatch_error"] is not None and "do not match" in d["mismatch_error"], d["mismatch_error"]
        assert d["after_mismatch_error"] is not None, f"rank {rank}: the group went on after a mismatch"


def test_ddp_trains_as_over_gloo(shm):
    world, results = shm
    for rank, d in enumerate(findings(results, "ddp")):
        assert not d["gloo_uses_shm"]
        for name in ("torch", "fusetrain"):
            a, b = d[name + "_shm"], d[name + "_gloo"]
            if world == 2:
                assert torch.equal(a, b), f"rank {rank}, {name} DDP: not the gloo bits"
            else:  # a rank-order sum against gloo's ring order: float32 rounding only
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    params = [d["fusetrain_shm"] for d in findings(results, "ddp")]
    assert all(torch.equal(params[0], p) for p in params), "ranks' parameters differ"


def test_registered_as_a_torch_distributed_backend():
    assert "fusetrain" in dist.Backend.backend_list


if __name__ == "__main__":
    ddp_harness.worker_main(sys.argv[1:], SUITES)
