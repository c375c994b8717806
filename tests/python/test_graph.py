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


def _unfused(device, batches):
    """The reference: the step called once per batch, no fuse_steps at all
    (whose K = 1 path is the same code as its K > 1 eager path)."""
    model, step = _setup(device)
    return model, torch.stack([step(*b) for b in batches])


def test_cpu_fused_equals_unfused():
    batches = _batches(20, "cpu")
    ref_model, ref_losses = _unfused("cpu", batches)
    assert len(set(ref_losses.tolist())) == 20, "the batches' losses must differ for this test to see them"
    for k in (1, 4, 8):  # 8 leaves a partial last execution of 4 steps
        model, losses = _run("cpu", k, batches)
        assert losses.shape == (20,)
        assert torch.equal(losses, ref_losses), k
        for p, q in zip(model.parameters(), ref_model.parameters()):
            assert torch.equal(p, q), k


def test_an_iterator_feeds_k_batches_per_call():
    batches = _batches(10, "cpu")
    ref_model, ref_losses = _unfused("cpu", batches)
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


@pytest.mark.cuda
def test_cuda_graph_equals_eager():
    batches = _batches(48, "cuda")
    ref_model, ref_losses = _unfused("cuda", batches)
    model, losses = _run("cuda", 16, batches)  # 2 eager executions, then one replay
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
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


def _scheduled_setup(device):
    """A step whose optimizer reads a tensor learning rate, which the caller
    halves in place every 8 steps: captured graphs read it on the device, so
    fused runs follow the schedule."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(device)
    lr = torch.tensor(1e-2, dtype=torch.float64, device=device)
    opt = FusedAdamW(model.parameters(), lr=lr)

    def step(x, y):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return model[0].weight.detach().sum()

    return model, step, lr


def _scheduled_run(device, k, batches, cuda_graph=True):
    model, step, lr = _scheduled_setup(device)
    fused = fusetrain.fuse_steps(step, batches[0], steps_per_execution=k, use_cuda_graph=cuda_graph)
    outs = []
    for i in range(0, len(batches), k):
        outs.append(fused(batches[i:i + k]))
        if (i + k) % 8 == 0:
            lr.mul_(0.5)
    return model, torch.cat(outs)


def _scheduled_unfused(device, batches):
    model, step, lr = _scheduled_setup(device)
    outs = []
    for i, b in enumerate(batches):
        outs.append(step(*b))
        if (i + 1) % 8 == 0:
            lr.mul_(0.5)
    return model, torch.stack(outs)


def test_cpu_tensor_lr_schedule_fused_equals_unfused():
    batches = _batches(32, "cpu")
    ref_model, ref = _scheduled_unfused("cpu", batches)
    model, out = _scheduled_run("cpu", 8, batches)
    assert torch.equal(out, ref)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.cuda
def test_cuda_graph_follows_a_tensor_lr_schedule():
    batches = _batches(64, "cuda")
    ref_model, ref = _scheduled_unfused("cuda", batches)
    model, out = _scheduled_run("cuda", 8, batches)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
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


@pytest.mark.cuda
def test_cuda_full_executions_after_the_warm_up_replay_a_graph():
    # Four executions of 16: two eager warm-ups, a capture (then its replay)
    # and a replay of the captured graph. Each replay must read its own 16
    # batches (copied into the static inputs) and continue the training: the
    # losses and parameters follow the unfused steps throughout.
    batches = _batches(64, "cuda")
    ref_model, ref_losses = _unfused("cuda", batches)
    model, step = _setup("cuda")
    fused = fusetrain.fuse_steps(step, batches[0], steps_per_execution=16)
    assert fused.warmup_executions == 2
    outs = []
    for i in range(0, 64, 16):
        outs.append(fused(batches[i:i + 16]))
        assert fused.captured == (i >= 32), i
    assert all(o.is_cuda and o.shape == (16,) for o in outs)
    torch.testing.assert_close(torch.cat(outs), ref_losses, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
