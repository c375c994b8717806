"""The benchmark harness and the step-fusion / end-to-end modules run (CPU
smoke sizes), so code that only the GPU box times does not rot unseen. No
figure is checked: speed is the benchmarks' business, not the tests'."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_step_fusion_and_e2e_benchmarks_run_on_the_cpu(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--only", "graph", "--only", "e2e",
                        "--quick", "--results-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for row in ("fuse_steps K=16 vs eager loop", "e2e resnet50 mixed_bfloat16", "e2e gpt float32",
                "dense matmul rate"):
        assert row in p.stdout, row
    assert "ERROR" not in p.stdout
    assert len(list(tmp_path.glob("*.json"))) == 1


def test_ddp_hooks_benchmark_runs_on_the_cpu(tmp_path):
    """bench_hooks (two gloo ranks: hooks, compression, PowerSGD, and torch's
    DDP + PowerSGD, whose gloo crash is a note, not an error row)."""
    import json

    p = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--only", "hooks", "--quick",
                        "--results-dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for row in ("ddp hooks: no hook", 'builtin "bf16" (C++)', "comm_dtype=torch.bfloat16",
                "powerSGD_hook rank 1 (Python)", 'builtin "powersgd" rank 1', "data sent/rank/step, PowerSGD rank 1"):
        assert row in p.stdout, row
    rows = json.loads(next(tmp_path.glob("*.json")).read_text())["results"]
    assert not [r["benchmark"] for r in rows if r.get("error")]


def test_fp8_benchmark_runs_on_the_cpu(tmp_path):
    """bench_fp8 at its CPU smoke sizes (torch's CPU _scaled_mm): every part's
    rows, no error row, the crossover line printed, one results file."""
    import json

    p = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_fp8.py"), "--results-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for row in ("fp8 linear fwd+bwd 64x64x64, delayed vs bf16 (CPU smoke)", "fp8 GEMM 64x64x64",
                "fp8 sweep M=64 K=N=64", "fp8 crossover M=64", "fp8 GPT block fwd+bwd d64, mixed_float8 current",
                "fp8 gpt train, mixed_float8 delayed vs mixed_bfloat16 (CPU smoke)"):
        assert row in p.stdout, row
    assert "fp8 crossover at M=64:" in p.stdout
    assert "ERROR" not in p.stdout
    rows = json.loads(next(tmp_path.glob("*.json")).read_text())["results"]
    assert not [r["benchmark"] for r in rows if r.get("error")]
    gpt = {r["policy"]: r for r in rows if r["benchmark"].startswith("fp8 gpt train mixed")}
    assert set(gpt) == {"mixed_bfloat16", "mixed_float8 delayed", "mixed_float8 current"}
    assert all(r["steps"] == len(r["losses"]) for r in gpt.values())


def test_fp8_benchmark_parts_can_be_skipped():
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_fp8.py"), "--skip", "sweep", "--skip", "block",
                        "--skip", "gpt", "--no-write"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "fp8 linear fwd+bwd" in p.stdout
    for absent in ("fp8 sweep", "fp8 GPT block", "fp8 gpt train"):
        assert absent not in p.stdout, absent


def test_linear_cross_entropy_cuda_rows_run_on_the_cpu(monkeypatch):
    """bench_linear_cross_entropy's CUDA-only rows (the GEMM floor and the
    chunk sweep) at a tiny size on the CPU, CUDA's peak-memory counter
    replaced by a stand-in: the code the GPU box runs once a GPU is lent."""
    import torch

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import bench_linear_cross_entropy as B
    import common

    monkeypatch.setattr(B, "peak_cuda", lambda ctx, setup, fn: (setup(), fn(), 100.0)[2])
    ctx = common.Context(device=torch.device("cpu"), quick=True, threads=1, warmup=1, repeats=2)
    n, h, c = 600, 16, 300
    x, w, t = B.make_inputs(ctx.device, n, h, c, torch.bfloat16)
    rows = B.cuda_floor_and_sweep(ctx, x, w, t, "smoke", {"ours": 0.01, "torch": 0.02},
                                  {"ours": 50.0, "torch": 400.0}, 512, {"n": n})
    floor, sweep = rows
    assert floor["benchmark"] == "linear+CE vs its GEMM floor, smoke"
    assert set(floor["gemm_ms"]) == {"z = x W^T", "dx = g W", "dW = g^T x"}
    # bf16: the gradients (N H + C H) x 2 bytes and the fp32 accumulator C H x 4.
    assert floor["memory_floor_mib"] == ((n * h + c * h) * 2 + c * h * 4) / (1 << 20)
    assert set(sweep["sweep_ms"]) == {"256 rows", "512 rows"}  # the sizes below N
    assert x.grad is None and w.grad is None


def test_hf_finetune_benchmark_runs_on_the_cpu(tmp_path):
    """bench_hf_finetune --quick: the CLI, the HF Trainer and the plain loop
    each fine-tune the same tiny Llama folder; its own checks (parameter
    counts, fused AdamW, autocast on, the loss falls) pass."""
    import pytest

    pytest.importorskip("transformers")
    if not (ROOT / "build" / "fusetrain").exists():
        pytest.skip("build/fusetrain is missing (make build)")
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_hf_finetune.py"), "--quick",
                        "--results-dir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for row in ("fusetrain train (CLI)", "HF Trainer", "plain PyTorch loop"):
        assert row in p.stdout, row
    assert "CHECK FAILED" not in p.stdout
    assert len(list(tmp_path.glob("hf_finetune-quick-*.json"))) == 1
