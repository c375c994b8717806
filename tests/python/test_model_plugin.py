"""C++ model plugins for `fusetrain train` (issue 51): examples/cpp/model_plugin
built by the main build (build/model_plugin/libresidual_mlp.so) and, as a user
builds it, against an installed fusetrain with find_package(fusetrain) and
fusetrain_add_model_plugin. The plugin trains through the CLI (loss falls,
every registered parameter is trained), resumes, evaluates, exports, runs
under DDP and mixed precision, and each bad input is a clear usage error.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from trainer_cli import BIN, ROOT, ok, run

PLUGIN_DIR = ROOT / "examples" / "cpp" / "model_plugin"
CONFIG = PLUGIN_DIR / "train.yaml"
BUILD = BIN.parent
LIBRARY = BUILD / "model_plugin" / "libresidual_mlp.so"
USAGE = 2

pytestmark = pytest.mark.skipif(not BIN.exists() or not LIBRARY.exists(),
                                reason=f"{BIN} or {LIBRARY} is missing: make build")


def train(run_dir: Path, *args, **kw) -> subprocess.CompletedProcess:
    # The plugin of the build under test (train.yaml names build/'s, which
    # another torch's build refuses: a plugin loads only into its own).
    return run("train", "--config", CONFIG, "--run-dir", run_dir, "--set", f"model.library={LIBRARY}", *args, **kw)


def checkpoints(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "checkpoints").glob("step_*.pt"))


def model_state(path: Path) -> dict[str, torch.Tensor]:
    return {k[6:]: v for k, v in torch.load(path).items() if k.startswith("model.")}


def train_losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"]


def usage_error(p: subprocess.CompletedProcess, *words: str) -> str:
    assert p.returncode == USAGE, f"exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
    for w in words:
        assert w in p.stderr, f"{w!r} not in:\n{p.stderr}"
    return p.stderr


# The plugin's own parameters, by the names its modules register.
EXPECTED = {"stem.weight": (64, 3072), "stem.bias": (64,), "head.weight": (10, 64), "head.bias": (10,)}
for _b in range(2):
    EXPECTED |= {f"blocks.{_b}.norm.weight": (64,), f"blocks.{_b}.norm.bias": (64,),
                 f"blocks.{_b}.up.weight": (128, 64), f"blocks.{_b}.up.bias": (128,),
                 f"blocks.{_b}.down.weight": (64, 128), f"blocks.{_b}.down.bias": (64,)}


def test_plugin_trains_every_parameter(tmp_path):
    """The example trains through the CLI: the loss falls, the checkpoint holds
    exactly the plugin's parameters, and every one of them moved from where the
    same seed starts it (a run of one step at lr 0 keeps the initial values):
    a trainer that left one out of the optimizer fails here."""
    ok(train(tmp_path / "init", "--set", "optimizer.lr=0", "--set", "optimizer.weight_decay=0",
             "--set", "train.max_steps=1"))
    out = ok(train(tmp_path / "run")).stdout
    assert "residual_mlp" in out
    init = model_state(checkpoints(tmp_path / "init")[-1])
    final = model_state(checkpoints(tmp_path / "run")[-1])
    assert {k: tuple(v.shape) for k, v in final.items()} == EXPECTED
    unchanged = [k for k in final if torch.equal(final[k], init[k])]
    assert not unchanged, f"never trained: {unchanged}"
    losses = train_losses(tmp_path / "run")
    assert losses[-1] < 0.5 * losses[0], losses


def test_plugin_keys_reach_the_factory(tmp_path):
    """model.block_width and model.blocks (keys the trainer does not know) size the
    model; the resolved config keeps them, so a resume rebuilds the same one."""
    ok(train(tmp_path, "--set", "model.block_width=32", "--set", "model.blocks=1", "--set", "train.max_steps=2"))
    state = model_state(checkpoints(tmp_path)[-1])
    assert state["stem.weight"].shape == (32, 3072)
    assert not any(k.startswith("blocks.1.") for k in state)
    resolved = (tmp_path / "config.yaml").read_text()
    assert "block_width: 32" in resolved and "blocks: 1" in resolved


def test_plugin_resume_eval_export(tmp_path):
    """Resume continues from the checkpoint bit for bit, eval reads it, and the
    state-dict export holds the plugin's names."""
    # A constant learning rate: the schedule then does not depend on max_steps.
    const = ("--set", "schedule.decay=none", "--set", "output.checkpoint_every=6")
    ok(train(tmp_path / "full", "--set", "train.max_steps=12", *const))
    ok(train(tmp_path / "half", "--set", "train.max_steps=6", *const))
    ok(train(tmp_path / "half", "--set", "train.max_steps=12", *const,
             "--resume", checkpoints(tmp_path / "half")[-1]))
    full, resumed = model_state(checkpoints(tmp_path / "full")[-1]), model_state(checkpoints(tmp_path / "half")[-1])
    assert all(torch.equal(full[k], resumed[k]) for k in full)
    ckpt = checkpoints(tmp_path / "full")[-1]
    assert "test loss" in ok(run("eval", "--checkpoint", ckpt)).stdout
    ok(run("export", "--checkpoint", ckpt, "--state-dict", tmp_path / "sd.pt"))
    sd = torch.load(tmp_path / "sd.pt")
    assert set(sd) == set(EXPECTED)


def test_plugin_two_ranks_bf16(tmp_path):
    """DDP over two processes with mixed_bfloat16 and the float32 head."""
    p = ok(train(tmp_path, "--nproc", "2", "--set", "precision.policy=mixed_bfloat16",
                 "--set", "train.max_steps=8", timeout=300))
    assert "mixed_bfloat16" in p.stdout
    state = model_state(checkpoints(tmp_path)[-1])
    assert state["head.weight"].dtype == torch.float32


def test_plugin_under_zero_and_step_fusion(tmp_path):
    """ZeRO stage 2 over two ranks and two steps per execution: the same
    parameters trained as one rank runs them (float32, so only the order of
    the allreduce's sums differs)."""
    const = ("--set", "train.max_steps=8", "--set", "schedule.decay=none")
    ok(train(tmp_path / "one", *const))
    ok(train(tmp_path / "zero", *const, "--nproc", "2", "--set", "parallel.shard=gradients",
             "--steps-per-execution", "2", timeout=300))
    one, zero = model_state(checkpoints(tmp_path / "one")[-1]), model_state(checkpoints(tmp_path / "zero")[-1])
    assert set(one) == set(zero) == set(EXPECTED)
    for k in one:
        torch.testing.assert_close(zero[k], one[k], rtol=1e-4, atol=1e-5, msg=k)


def test_missing_library(tmp_path):
    usage_error(train(tmp_path, "--set", f"model.library={tmp_path / 'nope.so'}"),
                "model.library", "no such file")


def test_library_without_the_model(tmp_path):
    usage_error(train(tmp_path, "--set", "model.name=transformer_xl"),
                'registers no model named "transformer_xl"', "residual_mlp")


def test_not_a_plugin(tmp_path):
    """A file that is not a shared library: the loader's reason."""
    fake = tmp_path / "libfake.so"
    fake.write_text("not an ELF file")
    usage_error(train(tmp_path / "run", "--set", f"model.library={fake}"), "cannot be loaded", "libfake.so")


def test_plugin_key_of_the_wrong_type(tmp_path):
    usage_error(train(tmp_path, "--set", "model.block_width=wide"), "model.block_width=wide", "--set",
                "the model reads an integer")


def test_plugin_keys_need_a_library(tmp_path):
    """Without model.library, an unknown model key is still a typo."""
    p = run("train", "--config", ROOT / "configs" / "tiny.yaml", "--run-dir", tmp_path,
            "--set", "model.chanels=8,16")
    usage_error(p, 'unknown key "model.chanels"', "channels")


def test_unknown_model_name_without_library(tmp_path):
    p = run("train", "--config", ROOT / "configs" / "tiny.yaml", "--run-dir", tmp_path,
            "--set", "model.name=residual_mlp")
    usage_error(p, "model.name=residual_mlp", "is not accepted", "model.library")


# ------------------------------------------------------------ as a user builds it


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """`cmake --install` of the main build: fusetrain's package as users get it."""
    if shutil.which("cmake") is None or not (BUILD / "CMakeCache.txt").exists():
        pytest.skip("needs cmake and the main build")
    prefix = tmp_path_factory.mktemp("install") / "prefix"
    subprocess.run(["cmake", "--install", BUILD, "--prefix", prefix], check=True, capture_output=True,
                   timeout=300)
    return prefix


def build_plugin(prefix: Path, out: Path, extra_include: Path | None = None) -> Path:
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    flags = [f"-DCMAKE_CXX_FLAGS=-I{extra_include}"] if extra_include else []
    cmake_prefix = f"{prefix};{torch.utils.cmake_prefix_path}"
    for cmd in (["cmake", "-S", PLUGIN_DIR, "-B", out, *generator, f"-DCMAKE_PREFIX_PATH={cmake_prefix}", *flags],
                ["cmake", "--build", out, "-j", "2"]):
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, f"{cmd}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return out / "libresidual_mlp.so"


def test_plugin_built_with_find_package_trains(installed, tmp_path):
    library = build_plugin(installed, tmp_path / "build")
    ok(train(tmp_path / "run", "--set", f"model.library={library}", "--set", "train.max_steps=8"))


def test_plugin_built_against_another_fusetrain(installed, tmp_path):
    """A plugin compiled with another fusetrain's headers (its version header
    says 0.0.1) is refused by name, not run with a mismatched interface."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "fusetrain_version.h").write_text('#pragma once\n#define FUSETRAIN_VERSION_STRING "0.0.1"\n')
    library = build_plugin(installed, tmp_path / "build", extra_include=other)
    usage_error(train(tmp_path / "run", "--set", f"model.library={library}"),
                "built against fusetrain 0.0.1", "rebuild the plugin")
