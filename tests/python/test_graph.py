"""fusetrain.fuse_steps: K steps per execution equal K unfused steps."""

import copy

import pytest
import torch

import fusetrain
from fusetrain.amp import GradScaler
from fusetrain.optim import FusedAdamW


def _setup(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(device)
    opt = FusedAdamW(model.parameters(), lr=1e-2)
    scaler = GradScaler(device, init_scale=2.0**10, growth_interval=3)

    def step(x, y):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=False)
        return loss.detach()

    return model, step


def _batches(n, device):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g).to(device), torch.randint(0, 4, (8,), generator=g).to(device))
            for _ in range(n)]


def _run(device, k, batches, cuda_graph=True):
    model, step = _setup(device)
    fused = fusetrain.fuse_steps(step, batches[0], steps_per_execution=k, use_cuda_graph=cuda_graph)
    losses = [fused(batches[i:i + k]) for i in range(0, len(batches), k)]
    return model, torch.cat(losses)


def test_cpu_fused_equals_unfused():
    batches = _batches(20, "cpu")
    ref_model, ref_losses = _run("cpu", 1, batches)
    for k in (4, 8):  # 8 leaves a partial last execution of 4 steps
        model, losses = _run("cpu", k, batches)
        assert losses.shape == (20,)
        assert torch.equal(losses, ref_losses)
        for p, q in zip(model.parameters(), ref_model.parameters()):
            assert torch.equal(p, q)


def test_an_iterator_feeds_k_batches_per_call():
    batches = _batches(10, "cpu")
    ref_model, ref_losses = _run("cpu", 1, batches)
    model, step = _setup("cpu")
    fused = fusetrain.fuse_steps(step, batches[0], steps_per_execution=4)
    it, outs = iter(batches), []
    while True:
        try:
            outs.append(fused(it))
        except StopIteration:
            break
    assert [o.shape[0] for o in outs] == [4, 4, 2]
    assert torch.equal(torch.cat(outs), ref_losses)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)


def test_outputs_stay_tensors_without_sync():
    batches = _batches(4, "cpu")
    _, step = _setup("cpu")
    out = fusetrain.fuse_steps(step, batches[0], steps_per_execution=4)(batches)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.shape == (4,)


def test_errors_name_the_cause():
    batches = _batches(3, "cpu")
    _, step = _setup("cpu")
    fused = fusetrain.fuse_steps(step, batches[0], steps_per_execution=2)
    with pytest.raises(ValueError, match="1 to 2 batches"):
        fused(batches)
    bad = [batches[0], (torch.randn(7, 16), torch.randint(0, 4, (7,)))]
    with pytest.raises(ValueError, match=r"batch 1 tensor 0 has shape \(7, 16\)"):
        fused(bad)
    with pytest.raises(ValueError, match="steps_per_execution"):
        fusetrain.fuse_steps(step, batches[0], steps_per_execution=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs in make gpu-check)")
def test_cuda_graph_equals_eager():
    batches = _batches(48, "cuda")
    ref_model, ref_losses = _run("cuda", 1, batches, cuda_graph=False)
    model, losses = _run("cuda", 16, batches)  # 2 eager executions, then one replay
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs in make gpu-check)")
def test_cuda_capture_error_names_host_sync():
    batches = _batches(4, "cuda")
    model, _ = _setup("cuda")

    def syncing_step(x, y):
        loss = model(x).sum()
        loss.item()
        return loss.detach()

    fused = fusetrain.fuse_steps(syncing_step, batches[0], steps_per_execution=2, warmup_executions=0)
    with pytest.raises(RuntimeError, match="host sync"):
        fused(batches[:2])


def _scheduled_run(device, k, batches, cuda_graph=True):
    """A tensor learning rate halved every 8 steps, in place: captured graphs
    read it on the device, so fused runs follow the schedule."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(device)
    lr = torch.tensor(1e-2, dtype=torch.float64, device=device)
    opt = FusedAdamW(model.parameters(), lr=lr)

    def step(x, y):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return model[0].weight.detach().sum()

    fused = fusetrain.fuse_steps(step, batches[0], steps_per_execution=k, use_cuda_graph=cuda_graph)
    outs = []
    for i in range(0, len(batches), k):
        outs.append(fused(batches[i:i + k]))
        if (i + k) % 8 == 0:
            lr.mul_(0.5)
    return model, torch.cat(outs)


def test_cpu_tensor_lr_schedule_fused_equals_unfused():
    batches = _batches(32, "cpu")
    ref_model, ref = _scheduled_run("cpu", 1, batches)
    model, out = _scheduled_run("cpu", 8, batches)
    assert torch.equal(out, ref)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs in make gpu-check)")
def test_cuda_graph_follows_a_tensor_lr_schedule():
    batches = _batches(64, "cuda")
    ref_model, ref = _scheduled_run("cuda", 8, batches, cuda_graph=False)
    model, out = _scheduled_run("cuda", 8, batches)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs in make gpu-check)")
def test_cuda_capture_error_names_a_non_capturable_optimizer():
    batches = _batches(4, "cuda")
    model = torch.nn.Linear(16, 4).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # capturable=False

    def step(x, y):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        return model.weight.detach().sum()

    fused = fusetrain.fuse_steps(step, batches[0], steps_per_execution=2, warmup_executions=1)
    fused(batches[:2])  # eager warm-up allocates the optimizer state
    with pytest.raises(RuntimeError, match="optimizer is not capturable"):
        fused(batches[2:4])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs in make gpu-check)")
def test_cuda_full_executions_after_the_warm_up_replay_a_graph():
    batches = _batches(32, "cuda")
    _, step = _setup("cuda")
    fused = fusetrain.fuse_steps(step, batches[0], steps_per_execution=16)
    for i in range(0, 32, 16):
        out = fused(batches[i:i + 16])
    fused(batches[:16])
    assert fused.captured and out.is_cuda and out.shape == (16,)
