"""`fusetrain train --set parallel.shard=optimizer|gradients` (ZeRO stage 1
and 2 in the trainer) on 2 ranks against the unsharded run, and resumes
across shard settings and world sizes.

The update is elementwise and on 2 ranks each reduced gradient element is
one commutative sum whether allreduced or reduce-scattered, so sharding
changes no bit: the runs must be equal. The one sum taken in another order
is the clipping norm (shard norms, then an allreduce): with clipping the
parameters differ by float32 roundings, checked in float32 (atol 1e-6 on
parameters of ~0.1, as test_trainer.py's two-process test). Under float16
compute such a rounding moves activations across float16 rounding
boundaries and grows to float16's resolution within a few steps, so the
float16 runs are compared without clipping, bit for bit.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from trainer_cli import BIN, ROOT, ok, run

TINY = ROOT / "configs" / "tiny.yaml"
FASHION = Path(os.environ.get("FUSETRAIN_FASHION_MNIST", "/usr/share/datasets/fashion-mnist"))

pytestmark = pytest.mark.skipif(not BIN.exists(), reason=f"{BIN} is missing: build it first")

# fp16 loss scaling, master weights and accumulation (no_sync).
ARGS = ("--set", "model.name=mlp", "--set", "model.hidden=32", "--epochs", "2",
        "--precision", "mixed_float16", "--set", "precision.master_weights=true",
        "--set", "train.grad_accum=2")


def train(run_dir, *args):
    if "FUSETRAIN_FASHION_MNIST" in os.environ:
        args = ("--set", f"data.path={FASHION}", *args)
    return ok(run("train", "--config", TINY, "--run-dir", run_dir, *args))


def checkpoints(run_dir):
    return sorted((Path(run_dir) / "checkpoints").glob("step_*.pt"))


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_close_state(a, b, atol=0.0):
    keys = sorted(k for k in a if k.startswith(("model.", "optim.")))
    assert keys == sorted(k for k in b if k.startswith(("model.", "optim."))), "checkpoint formats differ"
    for k in keys:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        if atol and a[k].is_floating_point():
            torch.testing.assert_close(b[k], a[k], rtol=0, atol=atol, msg=k)
        else:
            assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("none")
    train(run_dir, "--nproc", "2", *ARGS)
    return run_dir


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_sharded_run_equals_unsharded(tmp_path, unsharded, shard):
    p = train(tmp_path, "--nproc", "2", *ARGS, "--set", f"parallel.shard={shard}")
    assert "2 ranks" in p.stdout
    # The checkpoint holds the unsharded state: the same keys and shapes.
    assert_close_state(load(checkpoints(unsharded)[-1]), load(checkpoints(tmp_path)[-1]))


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_clipping_from_shard_norms(tmp_path, shard):
    args = ("--nproc", "2", "--set", "model.name=mlp", "--set", "model.hidden=32", "--epochs", "1",
            "--precision", "float32", "--set", "train.clip_grad_norm=0.5")
    train(tmp_path / "none", *args)
    train(tmp_path / shard, *args, "--set", f"parallel.shard={shard}")
    a, b = load(checkpoints(tmp_path / "none")[-1]), load(checkpoints(tmp_path / shard)[-1])
    assert_close_state(a, b, atol=1e-6)


def test_resume_across_shard_settings_and_world_sizes(tmp_path, unsharded):
    middle = checkpoints(unsharded)[len(checkpoints(unsharded)) // 2 - 1]
    # Unsharded checkpoint -> stage 2; its checkpoint -> one process, unsharded.
    train(tmp_path / "sharded", "--nproc", "2", *ARGS, "--set", "parallel.shard=gradients", "--resume", middle)
    assert_close_state(load(checkpoints(unsharded)[-1]), load(checkpoints(tmp_path / "sharded")[-1]))
    # A stage-2 checkpoint resumed by one unsharded process equals the
    # unsharded checkpoint of the same step resumed so (one process does not
    # sum as two ranks do, so the full 2-rank run is no reference here).
    stage2 = checkpoints(tmp_path / "sharded")[0]
    same_step = checkpoints(unsharded)[[c.name for c in checkpoints(unsharded)].index(stage2.name)]
    train(tmp_path / "single_from_sharded", *ARGS, "--resume", stage2)
    train(tmp_path / "single_from_unsharded", *ARGS, "--resume", same_step)
    assert_close_state(load(checkpoints(tmp_path / "single_from_unsharded")[-1]),
                       load(checkpoints(tmp_path / "single_from_sharded")[-1]))


def test_gradients_shard_refuses_a_comm_hook(tmp_path):
    p = run("train", "--config", TINY, "--run-dir", tmp_path, "--nproc", "2", "--set", "parallel.shard=gradients",
            "--set", "parallel.comm_hook=bf16")
    assert p.returncode != 0 and "parallel.shard" in (p.stderr + p.stdout)
