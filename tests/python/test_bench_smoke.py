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
