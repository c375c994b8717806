"""precision "auto" (issue 14): fusetrain.amp.best_policy / Policy("auto"),
the trainer's default precision.policy, and the CPU features both read.

The reference for the CPU's features is the kernel's own reading of cpuid,
/proc/cpuinfo's flags; the rule is the documented one (bf16 where the CPU
has AMX-BF16; with AVX512-BF16 alone, where the probe of Note [bfloat16
probe] finds bf16 1.2x faster, checked here against a timing of our own;
else float32 on a CPU).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fusetrain
import fusetrain.amp as famp
from fusetrain import _C

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("FUSETRAIN_BUILD_DIR", ROOT / "build")) / "fusetrain"
FASHION = Path(os.environ.get("FUSETRAIN_FASHION_MNIST", "/usr/share/datasets/fashion-mnist"))


def cpuinfo_flags() -> set:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    pytest.skip("/proc/cpuinfo has no flags line (not x86?)")


def expected_cpu_policy() -> str:
    f = cpuinfo_flags()
    if {"amx_bf16", "amx_tile"} <= f:
        return "mixed_bfloat16"
    if "avx512_bf16" in f:
        # The probe's verdict (checked against our own timing in
        # test_the_bf16_probe_agrees_with_a_timing_of_our_own).
        return _C.best_policy("cpu")[0]
    return "float32"


def _bf16_speed() -> float:
    """float32 time / bf16 time of a 3x3 convolution and a matmul on one
    thread, the dtypes alternating, best of 7 each: our own timing, in
    Python, of what the probe times."""
    import time

    torch.manual_seed(0)
    x = torch.randn(32, 24, 28, 28).contiguous(memory_format=torch.channels_last)
    w = torch.randn(24, 24, 3, 3).contiguous(memory_format=torch.channels_last)
    a, b = torch.randn(384, 384), torch.randn(384, 384)
    operands = {dtype: (x.to(dtype), w.to(dtype), a.to(dtype), b.to(dtype))
                for dtype in (torch.float32, torch.bfloat16)}

    def once(dtype):
        xd, wd, ad, bd = operands[dtype]
        t0 = time.perf_counter()
        torch.nn.functional.conv2d(xd, wd, padding=1)
        ad @ bd
        return time.perf_counter() - t0

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            for dtype in operands:
                once(dtype)  # warm-up: oneDNN builds its kernels on the first call
            best = dict.fromkeys(operands, float("inf"))
            for _ in range(7):
                for dtype in operands:
                    best[dtype] = min(best[dtype], once(dtype))
    finally:
        torch.set_num_threads(threads)
    return best[torch.float32] / best[torch.bfloat16]


def test_the_bf16_probe_agrees_with_a_timing_of_our_own():
    f = cpuinfo_flags()
    if not ("avx512_bf16" in f and not {"amx_bf16", "amx_tile"} <= f):
        pytest.skip("the probe runs on CPUs with AVX512-BF16 and no AMX-BF16")
    import re

    name, reason = _C.best_policy("cpu")
    m = re.search(r"a probe ran bf16 convolutions and matmuls at ([0-9.]+)x float32's speed", reason)
    assert m, reason
    assert (name == "mixed_bfloat16") == (float(m.group(1)) >= 1.2), reason
    # A fresh probe and our timing, back to back, agree where ours is clear
    # (timings on a shared 2-core VM move by 10-20%).
    ours = _bf16_speed()
    threads = torch.get_num_threads()
    probe = _C.cpu_bf16_speed()
    assert torch.get_num_threads() == threads  # the probe's one thread is given back
    if ours >= 1.5:
        assert probe >= 1.2, (ours, probe)
    elif ours <= 1.0:
        assert probe < 1.2, (ours, probe)


def test_cpu_features_match_proc_cpuinfo():
    f = cpuinfo_flags()
    got = _C.cpu_features()
    assert got["avx2"] == ({"avx2", "fma", "f16c"} <= f)
    assert got["avx512"] == (got["avx2"] and {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= f)
    assert got["avx512_bf16"] == (got["avx512"] and "avx512_bf16" in f)
    assert got["amx_bf16"] == ({"amx_bf16", "amx_tile"} <= f)
    best = "avx512" if got["avx512"] else "avx2" if got["avx2"] else "scalar"
    if not os.environ.get("FUSETRAIN_CPU_PATH") and not os.environ.get("ATEN_CPU_CAPABILITY"):
        assert got["path"] == best


def test_best_policy_on_the_cpu_follows_its_bf16_instructions():
    p = famp.best_policy("cpu")
    assert p.name == expected_cpu_policy()
    assert p.reason and any(w in p.reason for w in ("natively", "emulated", "a probe ran"))
    assert famp.best_policy(torch.device("cpu")) == p


def test_policy_auto_resolves_to_the_default_device():
    auto = famp.Policy("auto")
    expected = famp.best_policy("cuda" if torch.cuda.is_available() else "cpu")
    assert auto == expected and auto.name in ("float32", "mixed_float16", "mixed_bfloat16")
    assert auto.reason == expected.reason
    assert famp.Policy("float32").reason is None
    assert famp.Policy(auto).reason == auto.reason
    with pytest.raises(ValueError, match='and "auto"'):
        famp.Policy("automatic")
    with pytest.raises(ValueError, match="no policy for device type"):
        famp.best_policy("meta")


@pytest.mark.cuda
def test_best_policy_on_cuda():
    p = famp.best_policy("cuda")
    major = torch.cuda.get_device_capability()[0]
    assert p.name == ("mixed_bfloat16" if major >= 8 else "mixed_float16")


def run_python(code: str, **env):
    full = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full,
                          timeout=120)


def test_forced_cpu_path():
    code = "from fusetrain import _C; print(_C.cpu_features()['path'])"
    p = run_python(code, FUSETRAIN_CPU_PATH="scalar")
    assert p.returncode == 0 and p.stdout.strip() == "scalar", p.stderr
    p = run_python(code, FUSETRAIN_CPU_PATH="sse9")
    assert p.returncode != 0 and "FUSETRAIN_CPU_PATH=sse9: expected generic, scalar, avx2 or avx512" in p.stderr
    if not _C.cpu_features()["avx512"]:
        p = run_python(code, FUSETRAIN_CPU_PATH="avx512")
        assert p.returncode != 0 and "runs at most the" in p.stderr, p.stderr


# ------------------------------------------------------------------ the trainer

needs_cli = pytest.mark.skipif(not BIN.exists(), reason=f"{BIN} is missing: build it first")


@needs_cli
def test_trainer_default_policy_is_auto_and_resolved():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    p = subprocess.run([str(BIN), "train", "--print-config"], capture_output=True, text=True, env=env,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    import yaml

    assert yaml.safe_load(p.stdout)["precision"]["policy"] == expected_cpu_policy()
    p = subprocess.run([str(BIN), "info"], capture_output=True, text=True, env=env, timeout=60)
    assert f"precision.policy auto on cpu: {expected_cpu_policy()} (" in p.stdout, p.stdout


@needs_cli
@pytest.mark.skipif(not (FASHION / "train-images-idx3-ubyte.gz").exists(), reason="no Fashion-MNIST")
def test_trainer_run_says_and_records_the_resolved_policy(tmp_path):
    import yaml

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    run_dir = tmp_path / "run"
    p = subprocess.run([str(BIN), "train", "--config", "tiny", "--precision", "auto", "--epochs", "1",
                        "--set", "data.train_samples=256", "--run-dir", str(run_dir)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    expected = expected_cpu_policy()
    assert f"precision.policy auto -> {expected}: " in p.stdout, p.stdout
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["precision"]["policy"] == expected
