"""DistributedDataParallel's side stream and its timing of exposed
communication (Note [DDP and CUDA graphs] in csrc/dist/ddp.h), on one rank
in this process: gloo on the CPU, NCCL with world size 1 on the GPU box.

The CUDA case is the crash a reading of the reducer found: DDP built on the
legacy default stream made its gradient accumulators there, and capturing a
backward through them in ``fuse_steps`` failed. It now runs the K fused steps
as one CUDA graph and must equal the same steps run eagerly.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fusetrain
import fusetrain.amp
from fusetrain.optim import FusedAdamW
from fusetrain.parallel import DistributedDataParallel as DDP

from conftest import make_batches, make_model


@pytest.fixture
def world_of_one(request):
    """A one-rank default group (the backend is the test's parameter) on a
    store bound to a port the OS picks, destroyed afterwards."""
    backend = request.param
    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    if backend == "nccl" and not dist.is_nccl_available():
        pytest.skip("torch built without NCCL")
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    try:
        yield backend
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_of_one", ["gloo"], indirect=True)
def test_cpu_ddp_has_no_stream_and_times_on_the_host(world_of_one):
    model = DDP(make_model())
    assert model.stream is None
    assert math.isnan(model.last_exposed_comm_seconds()), "nothing ran yet"
    x, y = make_batches(1)[0]
    F.mse_loss(model(x), y).backward()
    exposed = model.last_exposed_comm_seconds()
    assert 0 <= exposed < 10


def _fused_ddp_run(use_cuda_graph: bool, k: int = 4, steps: int = 48):
    torch.manual_seed(0)
    model = make_model(d_in=12, d_hidden=64, d_out=5).cuda()
    # Small buckets: several allreduces per backward inside the graph.
    ddp = DDP(model, bucket_cap_mb=0.002)
    opt = FusedAdamW(ddp.parameters(), lr=torch.tensor(1e-2, device="cuda"))
    scaler = fusetrain.amp.GradScaler("cuda", init_scale=1024.0, growth_interval=3)

    def step(x, y):
        opt.zero_grad(set_to_none=False)
        loss = F.mse_loss(ddp(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    batches = [(x.cuda(), y.cuda()) for x, y in make_batches(steps, batch=16)]
    fused = fusetrain.fuse_steps(step, batches[0], steps_per_execution=k, use_cuda_graph=use_cuda_graph)
    losses = torch.cat([fused(batches[i:i + k]) for i in range(0, steps, k)])
    torch.cuda.synchronize()
    assert fused.captured == use_cuda_graph
    return ddp, losses.cpu(), [p.detach().cpu() for p in model.parameters()], scaler.get_scale()


@pytest.mark.cuda
@pytest.mark.parametrize("world_of_one", ["nccl"], indirect=True)
def test_nccl_ddp_fuse_steps_graph_equals_eager_steps(world_of_one):
    ddp, eager_losses, eager_params, eager_scale = _fused_ddp_run(use_cuda_graph=False)
    assert ddp.stream is not None
    assert ddp.stream != torch.cuda.default_stream(), "the accumulators must not run on the legacy stream"
    exposed = ddp.last_exposed_comm_seconds()
    assert 0 <= exposed < 10, f"device-timed exposed communication: {exposed}"

    ddp, graph_losses, graph_params, graph_scale = _fused_ddp_run(use_cuda_graph=True)
    # The last backward the host ran was the captured one: nothing timed.
    assert math.isnan(ddp.last_exposed_comm_seconds())
    assert graph_scale == eager_scale
    # The same kernels in the same order: equal up to the order of atomic
    # float adds in cuBLAS/NCCL reductions, ~1e-7 relative per step.
    torch.testing.assert_close(graph_losses, eager_losses, rtol=1e-5, atol=1e-6)
    for g, e in zip(graph_params, eager_params):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5 * e.abs().max().item())
