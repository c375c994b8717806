"""The trainer's background batch loader (data.prefetch, issue 13).

The reference is the inline path: with data.prefetch=0 each step gathers its
own batch on the training thread from the same sampler. A loader that hands
a step another step's batch, another micro-batch's samples or another rank's
share trains other bits, so every check compares the whole final state
(parameters, optimizer moments) bit for bit.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trainer_cli import BIN, ROOT, assert_same_state, final_state, ok, run

TINY = ROOT / "configs" / "tiny.yaml"
GPT = ROOT / "configs" / "gpt_tiny.yaml"
FASHION = Path(os.environ.get("FUSETRAIN_FASHION_MNIST", "/usr/share/datasets/fashion-mnist"))
TEXT = Path("/usr/share/common-licenses/GPL-3")
USAGE = 2

pytestmark = pytest.mark.skipif(not BIN.exists(), reason=f"{BIN} is missing: build it first (make build)")
needs_fashion = pytest.mark.skipif(not (FASHION / "train-images-idx3-ubyte.gz").exists(),
                                   reason="Fashion-MNIST is not installed (scripts/install-deps.sh)")

SMALL_GPT = ("--set", "model.d_model=32", "--set", "model.n_layer=1", "--set", "model.n_head=2",
             "--set", "model.seq_len=32", "--set", "train.max_steps=10", "--set", "train.log_every=5")


def with_and_without(tmp_path, *args, prefetch=3):
    """Trains twice, the loader off and on; returns both final states."""
    off = tmp_path / "off"
    on = tmp_path / "on"
    ok(run("train", *args, "--set", "data.prefetch=0", "--set", f"output.run_dir={off}"))
    p = ok(run("train", *args, "--set", f"data.prefetch={prefetch}", "--set", f"output.run_dir={on}"))
    assert f"for the loader thread ({prefetch} steps ahead)" in p.stdout
    return final_state(off), final_state(on)


@needs_fashion
@pytest.mark.parametrize("variant", [
    ("--set", "train.grad_accum=2"),
    ("--set", "train.steps_per_execution=3", "--set", "data.batch_size=32"),
], ids=["grad_accum", "steps_per_execution"])
def test_loader_trains_the_inline_bits_on_images(tmp_path, variant):
    off, on = with_and_without(tmp_path, "--config", TINY, *variant)
    assert_same_state(off, on)


def test_loader_trains_the_inline_bits_on_text_windows(tmp_path):
    # Random windows of a byte stream: the loader draws each step's windows
    # from the same (seed, epoch, step) generator as the inline sampler.
    args = ("--config", GPT, "--set", "data.name=text", "--set", f"data.path={TEXT}",
            "--set", "train.grad_accum=2", *SMALL_GPT)
    off, on = with_and_without(tmp_path, *args, prefetch=1)
    assert_same_state(off, on)


@needs_fashion
def test_loader_gives_each_rank_its_share(tmp_path):
    args = ("--config", TINY, "--nproc", "2", "--set", "train.epochs=1")
    off, on = with_and_without(tmp_path, *args)
    assert_same_state(off, on)


@needs_fashion
def test_resume_with_the_loader_starts_it_at_the_checkpoint(tmp_path):
    whole = tmp_path / "whole"
    ok(run("train", "--config", TINY, "--set", "data.prefetch=0", "--set", f"output.run_dir={whole}"))
    first = tmp_path / "first"
    ok(run("train", "--config", TINY, "--set", "train.max_steps=32", "--set", "output.checkpoint_every=8",
           "--set", f"output.run_dir={first}"))
    # Resume the 32-step run from its step-8 checkpoint with the loader on.
    ckpt = first / "checkpoints" / "step_00000008.pt"
    resumed = tmp_path / "resumed"
    ok(run("train", "--config", TINY, "--resume", ckpt, "--set", f"output.run_dir={resumed}"))
    assert_same_state(final_state(whole), final_state(resumed))


def test_negative_prefetch_is_a_usage_error(tmp_path):
    p = run("train", "--config", TINY, "--set", "data.prefetch=-2", "--set",
            f"output.run_dir={tmp_path / 'run'}")
    assert p.returncode == USAGE, p.stdout + p.stderr
    assert "data.prefetch" in p.stderr
    assert not (tmp_path / "run").exists()


@needs_fashion
@pytest.mark.cuda
@pytest.mark.parametrize("k", [1, 8], ids=["eager", "cuda_graph"])
def test_loader_on_cuda_trains_the_inline_bits(tmp_path, k):
    # The loader's batches come through pinned memory and a copy stream the
    # step's stream waits on; a missing wait or a reused buffer trains on
    # stale or partial batches. Same kernels on the same inputs: same bits
    # (as test_cuda_graph_steps_match_eager_steps relies on).
    args = ("--config", TINY, "--device", "cuda", "--epochs", "3", "--steps-per-execution", str(k))
    off, on = with_and_without(tmp_path, *args)
    assert_same_state(off, on)
