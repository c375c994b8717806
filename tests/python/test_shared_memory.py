"""The torch.distributed backend "fusetrain" (Note [Shared-memory allreduce]
in csrc/dist/shared_memory.h): gloo, with the allreduces of dense CPU tensors
going through shared memory when every rank is on this host.

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

from fusetrain.parallel import DistributedDataParallel, uses_shared_memory

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


SUITES = {"shm": [sc_allreduce, sc_ddp]}


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
