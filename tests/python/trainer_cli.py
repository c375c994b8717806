"""Helpers for the tests that run the `fusetrain` CLI: the binary, a run of
it with the process-group variables of the test's own environment removed,
and the run directory's final state and metrics."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("FUSETRAIN_BUILD_DIR", ROOT / "build")) / "fusetrain"


def run(*args, cwd=None, timeout=300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run([str(BIN), *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout)


def ok(p: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}"
    return p


def final_state(run_dir: Path) -> dict:
    """The model and optimizer tensors of the run's newest checkpoint."""
    state = torch.load(sorted((Path(run_dir) / "checkpoints").glob("step_*.pt"))[-1])
    return {k: v for k, v in state.items() if k.startswith(("model.", "optim."))}


def assert_same_state(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, differ[:5]


def records(run_dir: Path, kind: str) -> list:
    return [r for r in map(json.loads, (Path(run_dir) / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == kind]
