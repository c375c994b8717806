"""The TPU path (issue 17) without a TPU: fusetrain's device handling against
a stand-in torch_tpu, and step fusion through torch.compile on the CPU.

No TPU is reachable here and CI installs nothing new, so the stand-in is a
package named ``torch_tpu`` written to a temporary directory: importing it
does what torch_tpu's import does to torch (PrivateUse1 renamed "tpu", a
``torch.tpu`` module whose autocast runs bfloat16 only), without kernels or
memory, so no tensor lives on it. Each stand-in check runs in a subprocess
(a rename cannot be undone). Where a real torch_tpu is installed the
no-torch_tpu tests skip.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import fusetrain
from fusetrain.amp import GradScaler, Policy, autocast, best_policy
from fusetrain.graph import _compile_backend

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("FUSETRAIN_BUILD_DIR", ROOT / "build")) / "fusetrain"
HAS_TORCH_TPU = importlib.util.find_spec("torch_tpu") is not None

STAND_IN = '''
"""Stand-in for torch_tpu's registration (tests/python/test_tpu.py)."""
import torch

torch.utils.rename_privateuse1_backend("tpu")


class _Tpu:
    @staticmethod
    def get_amp_supported_dtype():
        return [torch.bfloat16]

    @staticmethod
    def is_available():
        return True

    @staticmethod
    def device_count():
        return 2


torch._register_device_module("tpu", _Tpu)
'''


@pytest.fixture
def stand_in(tmp_path):
    """A directory holding the stand-in torch_tpu 0.0.1 (for PYTHONPATH)."""
    package = tmp_path / "site" / "torch_tpu"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(STAND_IN)
    info = tmp_path / "site" / "torch_tpu-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch-tpu\nVersion: 0.0.1\n")
    return tmp_path / "site"


def run_with(site: Path, script: str) -> None:
    """Runs `script` in a fresh interpreter that finds the stand-in and
    fusetrain; its assertion errors fail the test with its stderr."""
    env = dict(os.environ)
    paths = [str(site), env.get("PYTHONPATH", ""), str(Path(fusetrain.__file__).parent.parent)]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-4000:]
    assert p.stdout.strip().endswith("ok"), p.stdout


# ------------------------------------------------------------- no torch_tpu


@pytest.mark.skipif(HAS_TORCH_TPU, reason="torch_tpu is installed here")
@pytest.mark.parametrize("call", [
    lambda: autocast("mixed_bfloat16", "tpu"),
    lambda: autocast("float32", device_type="tpu:0"),
    lambda: Policy("mixed_bfloat16", device_type="tpu"),
    lambda: Policy("auto", device_type="tpu"),
    lambda: best_policy("tpu"),
    lambda: GradScaler("tpu"),
], ids=["autocast", "autocast-float32", "Policy", "Policy-auto", "best_policy", "GradScaler"])
def test_a_tpu_without_torch_tpu_says_how_to_install_it(call):
    with pytest.raises(RuntimeError, match=r'needs torch_tpu.*pip install "fusetrain\[tpu\]"'):
        call()


@pytest.mark.skipif(HAS_TORCH_TPU, reason="torch_tpu is installed here")
def test_devices_lists_what_torch_sees():
    found = fusetrain.devices()
    assert found[0] == torch.device("cpu")
    assert [d for d in found if d.type == "cuda"] == [
        torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    assert not any(d.type == "tpu" for d in found)
    assert fusetrain.tpu_available() is False


def test_best_policy_names_the_devices_it_knows():
    with pytest.raises(ValueError, match="cpu, cuda or tpu"):
        best_policy("meta")


def test_policy_made_for_a_device_is_checked_there_and_autocast_defaults_to_it():
    policy = Policy("mixed_bfloat16", device_type="cpu")
    assert policy.device_type == "cpu" and Policy("mixed_bfloat16").device_type is None
    assert Policy("auto", device_type="cpu") == best_policy("cpu")
    assert best_policy("cpu").device_type == "cpu"
    with autocast(policy):
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")


# ------------------------------------------------------ the stand-in torch_tpu


def test_stand_in_tpu_devices_policies_and_errors(stand_in):
    run_with(stand_in, """
        import sys
        import torch, fusetrain
        from fusetrain.amp import Policy, autocast, best_policy
        assert "torch_tpu" not in sys.modules
        # fusetrain imports torch_tpu on first need, which registers "tpu".
        assert fusetrain.devices() == [torch.device("cpu")] + [
            torch.device("cuda", i) for i in range(torch.cuda.device_count())] + [
            torch.device("tpu", 0), torch.device("tpu", 1)]
        assert "torch_tpu" in sys.modules and fusetrain.tpu_available()

        chosen = best_policy("tpu")
        assert chosen.name == "mixed_bfloat16" and "TPU" in chosen.reason
        assert chosen.device_type == "tpu"
        assert Policy("auto", device_type="tpu:1") == chosen
        # float16 is not in the backend's get_amp_supported_dtype: an error
        # naming what it supports, at construction.
        for make in (lambda: Policy("mixed_float16", device_type="tpu"),
                     lambda: autocast("mixed_float16", "tpu")):
            try:
                make()
            except RuntimeError as e:
                assert str(e) == ('autocast on "tpu" supports bfloat16, not float16; '
                                  'use Policy("mixed_bfloat16")'), e
            else:
                raise AssertionError("float16 autocast on the tpu was accepted")
        # The scaler parses the device in C++ too (no tensor until scale()).
        scaler = fusetrain.amp.GradScaler("tpu")
        assert scaler.is_enabled() and scaler.get_scale() == 2.0**16
        print("ok")
    """)


def test_stand_in_tpu_autocast_and_float32_islands(stand_in):
    run_with(stand_in, """
        import torch, fusetrain
        from torch import nn
        from fusetrain.amp import Policy, autocast, keep_float32
        import torch_tpu  # noqa: F401  (as a user script would)

        policy = Policy("mixed_bfloat16", device_type="tpu")
        with autocast(policy):  # the policy's device
            assert torch.is_autocast_enabled("tpu")
            assert torch.get_autocast_dtype("tpu") == torch.bfloat16
            assert not torch.is_autocast_enabled("cpu")
            with autocast("float32", "tpu"):
                assert not torch.is_autocast_enabled("tpu")
            assert torch.is_autocast_enabled("tpu")
        assert not torch.is_autocast_enabled("tpu")

        # A float32 island switches the tpu's autocast off inside, back after.
        seen = []
        class Probe(nn.Module):
            def forward(self, x):
                seen.append((torch.is_autocast_enabled("tpu"), torch.is_autocast_enabled("cpu"),
                             x.dtype))
                return x
        island = keep_float32(Probe())
        with autocast("mixed_bfloat16", "tpu"), autocast("mixed_bfloat16", "cpu"):
            island(torch.ones(2, dtype=torch.bfloat16))
            assert torch.is_autocast_enabled("tpu") and torch.is_autocast_enabled("cpu")
        assert seen == [(False, False, torch.float32)], seen
        print("ok")
    """)


@pytest.mark.skipif(not BIN.exists(), reason="the fusetrain binary is not built")
def test_fusetrain_info_reports_torch_tpu(stand_in):
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    plain = subprocess.run([str(BIN), "info"], capture_output=True, text=True, timeout=60, env=env)
    assert plain.returncode == 0, plain.stderr
    if not HAS_TORCH_TPU:
        assert 'TPU: no (torch_tpu not installed beside torch: pip install "fusetrain[tpu]")' in plain.stdout
    env["PYTHONPATH"] = str(stand_in)
    p = subprocess.run([str(BIN), "info"], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0, p.stderr
    assert f"TPU: torch_tpu 0.0.1 at {stand_in / 'torch_tpu'} (" in p.stdout, p.stdout


# ------------------------------------------------------- fuse_steps compiled


def test_compile_backend_prefers_one_named_after_the_device(stand_in):
    assert _compile_backend("aot_eager", "tpu") == "aot_eager"
    assert _compile_backend(None, "cpu") == "inductor"
    run_with(stand_in, """
        from torch._dynamo import register_backend
        from fusetrain.graph import _compile_backend

        assert _compile_backend(None, "tpu") == "inductor"
        @register_backend(name="tpu")
        def tpu_backend(gm, example_inputs):
            return gm.forward
        assert _compile_backend(None, "tpu") == "tpu"
        print("ok")
    """)


def _trainer(policy: str, device="cpu"):
    """A small classifier on ``device`` trained through fusetrain's scaler,
    fused AdamW and cross-entropy; returns (model, step function, scaler)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 5)).to(device)
    opt = fusetrain.optim.FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scaler = GradScaler(str(device), init_scale=2.0**10, growth_interval=3)

    def step(x, y):
        with autocast(policy, torch.device(device).type):
            loss = fusetrain.nn.functional.softmax_cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=False)
        return loss.detach()

    return model, step, scaler


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_fuse_steps_compiled_equals_the_steps_run_eagerly(policy):
    """use_compile=True (a TPU's default) on the CPU with the aot_eager
    backend: the same kernels in the same order, so the losses, weights and
    scaler state equal K eager steps bit for bit."""
    torch.manual_seed(1)
    batches = [(torch.randn(16, 12), torch.randint(0, 5, (16,))) for _ in range(12)]
    results = []
    for compiled in (False, True):
        model, step, scaler = _trainer(policy)
        fused = fusetrain.fuse_steps(step, batches[0], 4, warmup_executions=1,
                                     use_compile=compiled, compile_backend="aot_eager")
        assert fused.use_compile is compiled
        losses = torch.cat([fused(batches[i : i + 4]) for i in range(0, 12, 4)])
        assert fused.captured is compiled
        results.append((losses, [p.detach().clone() for p in model.parameters()], scaler.get_scale()))
    (eager_losses, eager_params, eager_scale), (losses, params, scale) = results
    assert torch.equal(losses, eager_losses)
    assert all(torch.equal(a, b) for a, b in zip(params, eager_params))
    assert scale == eager_scale


def test_fuse_steps_compiles_by_default_only_on_a_tpu(stand_in):
    _, step, _ = _trainer("float32")
    sample = (torch.randn(16, 12), torch.randint(0, 5, (16,)))
    assert fusetrain.fuse_steps(step, sample, 2).use_compile is False
    assert fusetrain.fuse_steps(step, sample, 2, use_compile=True).use_compile is True
    # A batch on the stand-in's tpu: a wrapper tensor that holds no memory.
    run_with(stand_in, """
        import torch, fusetrain
        import torch_tpu  # noqa: F401

        class OnTpu(torch.Tensor):
            @staticmethod
            def __new__(cls):
                return torch.Tensor._make_wrapper_subclass(cls, (4,), device=torch.device("tpu", 0))

            @classmethod
            def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
                raise NotImplementedError(func)

        sample = OnTpu()
        assert sample.device.type == "tpu"
        assert fusetrain.fuse_steps(lambda x: x, sample, 2).use_compile is True
        assert fusetrain.fuse_steps(lambda x: x, sample, 2, use_compile=False).use_compile is False
        print("ok")
    """)


# ------------------------------------------------------------ a real TPU


@pytest.mark.skipif(not HAS_TORCH_TPU, reason="torch_tpu is not installed (CI installs nothing new)")
def test_a_real_tpu_trains_through_the_generic_ops_and_fused_steps():
    """Where torch_tpu and a TPU are present: the scaler, FusedAdamW and the
    cross-entropy run on the TPU (fusetrain's device-generic kernels) and
    train as on the CPU; fuse_steps compiles there by default. Not run where
    fusetrain is developed (no TPU)."""
    if not fusetrain.tpu_available():
        pytest.skip("torch_tpu is installed but sees no TPU")
    tpu = torch.device("tpu", 0)
    torch.manual_seed(1)
    batches = [(torch.randn(16, 12), torch.randint(0, 5, (16,))) for _ in range(8)]
    finals = {}
    for device in ("cpu", tpu):
        model, step, _ = _trainer("float32", device)
        on_device = [(x.to(device), y.to(device)) for x, y in batches]
        fused = fusetrain.fuse_steps(step, on_device[0], 4, warmup_executions=1)
        assert fused.use_compile is (device != "cpu")
        losses = torch.cat([fused(on_device[i : i + 4]) for i in range(0, 8, 4)]).cpu()
        finals[str(device)] = (losses, [p.detach().cpu() for p in model.parameters()])
    (cpu_losses, cpu_params), (tpu_losses, tpu_params) = finals["cpu"], finals[str(tpu)]
    # float32 matmuls on a TPU may run in bf16 passes: agreement to 1e-2.
    torch.testing.assert_close(tpu_losses, cpu_losses, rtol=1e-2, atol=1e-2)
    for a, b in zip(tpu_params, cpu_params):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
