"""fusetrain.amp precision policies: Policy, the global policy, autocast,
float32 islands (keep_float32) and apply_policy, on CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fusetrain.amp as famp
from fusetrain.amp import Policy

NAMES = {
    "float32": torch.float32,
    "mixed_float16": torch.float16,
    "mixed_bfloat16": torch.bfloat16,
}


def matmul_dtype() -> torch.dtype:
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    return (a @ b).dtype


# ----------------------------------------------------------------- Policy


@pytest.mark.parametrize("name", list(NAMES))
def test_policy_properties(name):
    p = Policy(name)
    assert p.name == name
    assert p.compute_dtype == NAMES[name]
    assert p.variable_dtype == torch.float32
    assert p == Policy(name) and hash(p) == hash(Policy(name))
    assert Policy(p) == p  # a Policy is accepted where a name is
    assert name in repr(p)
    assert p != Policy("float32" if name != "float32" else "mixed_bfloat16")


@pytest.mark.parametrize("bad", ["mixed_fp16", "bfloat16", "", "Float32"])
def test_unknown_policy_name_lists_the_valid_ones(bad):
    with pytest.raises(ValueError) as info:
        Policy(bad)
    msg = str(info.value)
    assert f'"{bad}"' in msg
    for name in NAMES:
        assert name in msg


def test_global_policy_set_and_get():
    assert famp.global_policy() == Policy("float32")  # the default
    famp.set_global_policy("mixed_bfloat16")
    assert famp.global_policy() == Policy("mixed_bfloat16")
    famp.set_global_policy(Policy("mixed_float16"))
    assert famp.global_policy().compute_dtype == torch.float16
    with pytest.raises(ValueError, match="valid names"):
        famp.set_global_policy("half")
    assert famp.global_policy() == Policy("mixed_float16")  # unchanged by the failed set


# --------------------------------------------------------------- autocast


@pytest.mark.parametrize("name,dtype", [("mixed_bfloat16", torch.bfloat16), ("mixed_float16", torch.float16)])
def test_autocast_mixed_policy_on_cpu(name, dtype):
    assert matmul_dtype() == torch.float32
    with famp.autocast(name, device_type="cpu"):
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == dtype
        assert matmul_dtype() == dtype
    assert not torch.is_autocast_enabled("cpu")
    assert matmul_dtype() == torch.float32


def test_autocast_float32_policy_disables_autocast():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert matmul_dtype() == torch.bfloat16
        with famp.autocast("float32", device_type="cpu"):
            assert not torch.is_autocast_enabled("cpu")
            assert matmul_dtype() == torch.float32
        assert matmul_dtype() == torch.bfloat16


def test_autocast_defaults_to_the_global_policy():
    famp.set_global_policy("mixed_bfloat16")
    with famp.autocast(device_type="cpu"):
        assert matmul_dtype() == torch.bfloat16
    famp.set_global_policy("float32")
    with torch.autocast("cpu", dtype=torch.bfloat16), famp.autocast(device_type="cpu"):
        assert matmul_dtype() == torch.float32


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU default without CUDA")
def test_autocast_default_device_is_cpu_without_cuda():
    with famp.autocast("mixed_bfloat16"):
        assert matmul_dtype() == torch.bfloat16


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("name", ["mixed_bfloat16", "mixed_float16"])
def test_autocast_cuda_without_cuda_is_an_error_not_a_fallback(name):
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        with famp.autocast(name, device_type="cuda"):
            pytest.fail("entered a cuda autocast region without CUDA")
    assert not torch.is_autocast_enabled("cpu")


def test_autocast_unsupported_device_type_is_an_error():
    with pytest.raises(RuntimeError, match="meta"):
        with famp.autocast("mixed_bfloat16", device_type="meta"):
            pytest.fail("entered an autocast region on a device without autocast")


def test_autocast_restores_state_after_an_exception():
    with pytest.raises(KeyError):
        with famp.autocast("mixed_bfloat16", device_type="cpu"):
            raise KeyError("boom")
    assert not torch.is_autocast_enabled("cpu")


# --------------------------------------------------------- float32 islands


class Recorder(nn.Module):
    """A Linear that records the dtype it was given and the autocast state
    inside its forward; raises on demand."""

    def __init__(self, d_in=8, d_out=8):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)
        self.seen = []
        self.fail = False

    def forward(self, x, extra=None, index=None):
        self.seen.append({
            "x": x.dtype,
            "extra": None if extra is None else extra.dtype,
            "index": None if index is None else index.dtype,
            "autocast": torch.is_autocast_enabled("cpu"),
        })
        if self.fail:
            raise ValueError("forward failed")
        return self.lin(x)


def test_keep_float32_runs_the_module_in_float32_inside_autocast():
    island = Recorder()
    keys = list(island.state_dict())
    assert famp.keep_float32(island) is island
    assert list(island.state_dict()) == keys
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = nn.Linear(8, 8)(x)
        assert h.dtype == torch.bfloat16
        out = island(h, extra=h, index=torch.arange(4))
        assert out.dtype == torch.float32
        assert island.seen[-1] == {"x": torch.float32, "extra": torch.float32,
                                   "index": torch.int64, "autocast": False}
        # autocast is back on right after the island
        assert torch.is_autocast_enabled("cpu") and matmul_dtype() == torch.bfloat16
    out.sum().backward()
    assert island.lin.weight.grad.dtype == torch.float32


def test_keep_float32_restores_autocast_after_an_exception():
    island = famp.keep_float32(Recorder())
    island.fail = True
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(ValueError, match="forward failed"):
            island(torch.randn(2, 8))
        assert island.seen[-1]["autocast"] is False
        assert torch.is_autocast_enabled("cpu")
        assert matmul_dtype() == torch.bfloat16
        island.fail = False
        assert island(torch.randn(2, 8)).dtype == torch.float32  # and works again
    assert not torch.is_autocast_enabled("cpu")


def test_keep_float32_is_idempotent_and_nests():
    inner = famp.keep_float32(Recorder())
    famp.keep_float32(inner)
    assert len(inner._forward_pre_hooks) == 1 and len(inner._forward_hooks) == 1
    outer = famp.keep_float32(nn.Sequential(nn.Linear(8, 8), inner))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert outer(torch.randn(2, 8)).dtype == torch.float32
        assert torch.is_autocast_enabled("cpu")


# ------------------------------------------------------------ apply_policy


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.mid(self.norm(self.proj(x))))


def output_dtypes(model: nn.Module, x: torch.Tensor) -> dict:
    dtypes = {}
    hooks = [
        m.register_forward_hook(lambda mod, args, out, name=name: dtypes.__setitem__(name, out.dtype))
        for name, m in model.named_modules()
    ]
    try:
        model(x)
    finally:
        for h in hooks:
            h.remove()
    return dtypes


def test_layernorm_under_cpu_autocast_is_bf16_without_an_island():
    """The premise of the island tests: without one, these modules run in bf16."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        d = output_dtypes(Block(), torch.randn(2, 8))
    assert d == {"": torch.bfloat16, "proj": torch.bfloat16, "norm": torch.bfloat16,
                 "mid": torch.bfloat16, "head": torch.bfloat16}


def test_apply_policy_with_a_module_type_island():
    model = Block()
    keys = list(model.state_dict())
    assert famp.apply_policy(model, "mixed_bfloat16", float32_modules=[nn.LayerNorm]) is model
    assert list(model.state_dict()) == keys
    d = output_dtypes(model, torch.randn(2, 8))
    assert d["norm"] == torch.float32
    assert d["proj"] == d["mid"] == d["head"] == d[""] == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")  # only inside model(x)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_apply_policy_with_a_named_island():
    model = famp.apply_policy(Block(), "mixed_bfloat16", float32_modules=["head"])
    d = output_dtypes(model, torch.randn(2, 8))
    assert d["head"] == d[""] == torch.float32
    assert d["proj"] == d["norm"] == d["mid"] == torch.bfloat16
    model(torch.randn(2, 8)).sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


def test_apply_policy_unknown_name_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match='"tail"') as info:
        famp.apply_policy(Block(), "mixed_bfloat16", float32_modules=["tail"])
    assert "head" in str(info.value)  # and says what the model does have
    with pytest.raises(ValueError, match="valid names"):
        famp.apply_policy(Block(), "mixed_bf16")
    with pytest.raises(TypeError):
        famp.apply_policy(Block(), "mixed_bfloat16", float32_modules=[3])


def test_apply_policy_keeps_variables_in_float32():
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).to(torch.bfloat16)
    famp.apply_policy(model, "mixed_bfloat16")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(b.dtype == torch.float32 for b in model.buffers() if b.is_floating_point())
    assert model(torch.randn(4, 8)).dtype == torch.bfloat16


def test_apply_policy_again_replaces_the_policy_and_defaults_to_global():
    model = famp.apply_policy(Block(), "mixed_bfloat16")
    assert model(torch.randn(2, 8)).dtype == torch.bfloat16
    famp.apply_policy(model, "float32")
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the policy wins inside the model
        assert model(torch.randn(2, 8)).dtype == torch.float32
    famp.set_global_policy("mixed_bfloat16")
    famp.apply_policy(model)
    assert model(torch.randn(2, 8)).dtype == torch.bfloat16


def test_apply_policy_restores_autocast_after_an_exception():
    model = Block()
    famp.apply_policy(model, "mixed_bfloat16", float32_modules=["mid"])

    def boom(module, args):
        raise ValueError("bad input")

    h = model.head.register_forward_pre_hook(boom)
    with pytest.raises(ValueError, match="bad input"):
        model(torch.randn(2, 8))
    assert not torch.is_autocast_enabled("cpu")
    h.remove()
    assert model(torch.randn(2, 8)).dtype == torch.bfloat16


def test_mixed_policy_trains_with_the_grad_scaler():
    """The pieces together: apply_policy + GradScaler, a float32 head."""
    torch.manual_seed(0)
    model = famp.apply_policy(Block(), "mixed_bfloat16", float32_modules=["head"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = famp.GradScaler("cpu")
    x, y = torch.randn(64, 8), torch.randn(64, 4)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
