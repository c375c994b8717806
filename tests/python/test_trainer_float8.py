"""`fusetrain train --precision mixed_float8`: the built-in models' large
linear layers run their GEMMs in float8 (amp::Float8Linear), their scaling
state is checkpointed and resumed exactly, and a float8 checkpoint evaluates
and loads under other policies and in Python."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from test_trainer import (ROOT, TINY, assert_same_state, checkpoints, load, ok,  # noqa: F401
                          pytestmark, records, run, train)

# The GPT of configs/gpt_tiny.yaml (bytes of the GPL) at width 64, 2 layers.
GPT = ("--config", ROOT / "configs" / "gpt_tiny.yaml", "--set", "model.d_model=64",
       "--set", "model.n_layer=2", "--set", "model.seq_len=32", "--set", "train.max_steps=24",
       "--set", "output.checkpoint_every=12", "--set", "train.log_every=4",
       "--set", "schedule.warmup_steps=2", "--set", "optimizer.lr=0.003",
       "--set", "runtime.threads=1")
FP8 = ("--precision", "mixed_float8", "--set", "precision.fp8_min_features=16")


def gpt(run_dir, *args):
    return run("train", *GPT, "--run-dir", run_dir, *args)


def test_gpt_trains_in_float8_close_to_bf16(tmp_path):
    ok(gpt(tmp_path / "fp8", *FP8))
    ok(gpt(tmp_path / "bf16", "--precision", "mixed_bfloat16"))
    state = load(checkpoints(tmp_path / "fp8")[-1])
    # Every projection of both blocks ran in float8 and kept its scaling state.
    for block in range(2):
        for layer in ("qkv", "proj", "fc", "fc_proj"):
            scale = state[f"model.blocks.{block}.{layer}.fp8_scale"]
            history = state[f"model.blocks.{block}.{layer}.fp8_amax_history"]
            assert scale.shape == (3,) and history.shape == (3, 16)
            assert (history[:, 0] > 0).all() and (scale != 1).all()
    assert not any(k.startswith("model.head.fp8") for k in state)  # the float32 head
    fp8 = [r["loss"] for r in records(tmp_path / "fp8", "train")]
    bf16 = [r["loss"] for r in records(tmp_path / "bf16", "train")]
    assert fp8[-1] < 0.8 * fp8[0]
    # Same seed and data: float8 ends within 5% of bf16's training loss
    # (measured: 0.01%).
    assert abs(fp8[-1] - bf16[-1]) <= 0.05 * bf16[-1]


def test_float8_resume_equals_uninterrupted(tmp_path):
    ok(gpt(tmp_path / "full", *FP8))
    full = checkpoints(tmp_path / "full")
    assert full[0].name == "step_00000012.pt"
    ok(gpt(tmp_path / "resumed", *FP8, "--resume", full[0]))
    a, b = load(full[-1]), load(checkpoints(tmp_path / "resumed")[-1])
    assert_same_state(a, b)  # weights, optimizer and the float8 scaling state, bit for bit
    assert any("fp8_amax_history" in k for k in a)


def test_cnn_float8_checkpoint_evaluates_in_float32_and_loads_in_python(tmp_path):
    from fusetrain.load_checkpoint import load_model

    ok(train(tmp_path / "run", *FP8, "--set", "train.epochs=1"))
    ckpt = checkpoints(tmp_path / "run")[-1]
    assert "model.classifier.1.fp8_scale" in load(ckpt)  # the 784 -> 32 hidden layer
    assert records(tmp_path / "run", "eval")[-1]["accuracy"] > 0.5
    preds = tmp_path / "preds.pt"
    ok(run("eval", "--checkpoint", ckpt, "--predictions", preds, "--set", "precision.policy=float32"))
    saved = load(preds)
    model = load_model(str(ckpt))
    with torch.no_grad():
        logits = model(saved["inputs"])
    torch.testing.assert_close(logits, saved["logits"], rtol=1e-4, atol=1e-4)
    # Exports are float32: a plain state dict and a TorchScript module of aten ops.
    ok(run("export", "--checkpoint", ckpt, "--state-dict", tmp_path / "sd.pt",
           "--torchscript", tmp_path / "ts.pt"))
    state = load(tmp_path / "sd.pt")
    assert not any("fp8_" in k for k in state)
    model.load_state_dict(state)
    script = torch.jit.load(str(tmp_path / "ts.pt"))
    graph = str(script.inlined_graph)
    assert "fusetrain::" not in graph and "_scaled_mm" not in graph
    with torch.no_grad():
        torch.testing.assert_close(script(saved["inputs"]), saved["logits"], rtol=1e-4, atol=1e-4)


def test_float8_default_threshold_keeps_small_layers_in_bf16(tmp_path):
    ok(gpt(tmp_path / "run", "--precision", "mixed_float8", "--set", "train.max_steps=2"))
    state = load(checkpoints(tmp_path / "run")[-1])
    assert not any("fp8_" in k for k in state)  # every layer is below 1024 features


def test_float8_with_a_torchscript_model_is_a_config_error(tmp_path):
    p = train(tmp_path / "run", "--precision", "mixed_float8", "--set", "model.name=torchscript",
              "--set", f"model.path={tmp_path / 'm.pt'}")
    assert p.returncode != 0
    assert "precision.policy" in p.stderr and "mixed_float8" in p.stderr
