"""`fusetrain train/eval/export` on Hugging Face's model families gpt2 and
llama (trainer/hf_models.cpp): a model folder written by transformers'
save_pretrained (single or sharded safetensors) loads through
model.pretrained, trains, and `export --hf` writes a folder that
transformers.AutoModelForCausalLM loads back.

The reference is transformers itself, on tiny random models it makes in the
test (no downloads): with optimizer.lr=0 the weights a run checkpoints are
the folder's, so `eval --predictions` must give transformers' logits of the
folder on the same windows; after real training, transformers' logits of the
exported folder must equal fusetrain's logits of the final checkpoint.

The random models get weights far from transformers' N(0, 0.02) init (see
randomize): at that scale every attention score is ~0, the attention uniform
and the norms the identity, so a wrong rotary base, a missing bias or a
swapped norm weight would move the logits by less than float32 rounding.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from trainer_cli import BIN, ok, records, run  # noqa: E402

pytestmark = pytest.mark.skipif(not BIN.exists(), reason=f"{BIN} is missing: build it first (make build)")

USAGE = 2
VOCAB = 96
SEQ = 32  # every model's n_positions / max_position_embeddings is 64

# One process, one thread, no curves: every run here is a second or two.
SMALL = ("--nproc", "1", "--threads", "1", "--set", "output.curves=false", "--set", "data.name=tokens",
         "--set", f"model.seq_len={SEQ}", "--set", "data.batch_size=8", "--set", "data.eval_batch_size=64",
         "--set", "train.seed=0")
FROZEN = ("--set", "optimizer.lr=0", "--set", "optimizer.weight_decay=0", "--set", "train.max_steps=1",
          "--set", "precision.policy=float32")


# ---------------------------------------------------------------- fixtures


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights of O(1) effect: matrices N(0, 0.3^2) (scores, logits and
    activations of order 1 at width 32, where 0.02 leaves them ~0), biases
    N(0, 0.1^2), norm weights 1 + N(0, 0.2^2) and norm biases N(0, 0.1^2)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name or ".ln_" in name:
                p.copy_(1 + 0.2 * noise if name.endswith("weight") else 0.1 * noise)
            elif p.dim() == 1:
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.3 * noise)


def make_folder(kind: str, out: Path) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    llama = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=VOCAB, rope_theta=5000.0, max_position_embeddings=64,
                 rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None)
    shard, dtype = None, torch.float32
    if kind in ("gpt2", "gpt2_hub_names"):  # tied head (GPT-2 always ties)
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=64,
                                           bos_token_id=None, eos_token_id=None))
    elif kind == "llama_gqa":  # 4 query heads on 2 key/value heads, separate head
        model = LlamaForCausalLM(LlamaConfig(**llama, tie_word_embeddings=False))
    elif kind == "llama_tied":  # MHA, the head is the embedding
        model = LlamaForCausalLM(LlamaConfig(**{**llama, "num_key_value_heads": 4}, tie_word_embeddings=True))
    elif kind == "llama_bias":  # biases on q/k/v/o and on the MLP
        model = LlamaForCausalLM(LlamaConfig(**llama, attention_bias=True, mlp_bias=True,
                                             tie_word_embeddings=False))
    elif kind == "llama_sharded":  # model.safetensors.index.json and its shards
        model = LlamaForCausalLM(LlamaConfig(**llama, tie_word_embeddings=False))
        shard = "20KB"
    elif kind == "llama_bf16":  # weights stored in bfloat16, as most hub models are
        model = LlamaForCausalLM(LlamaConfig(**llama, tie_word_embeddings=False))
        dtype = torch.bfloat16
    else:
        raise ValueError(kind)
    randomize(model, seed=sum(map(ord, kind)))
    model.to(dtype)
    if shard:
        model.save_pretrained(out, max_shard_size=shard)
        assert (out / "model.safetensors.index.json").exists() and len(list(out.glob("*.safetensors"))) > 2
    else:
        model.save_pretrained(out)
        assert (out / "model.safetensors").exists()
    if kind == "gpt2_hub_names":
        # openai-community/gpt2's own file: names without "transformer.",
        # and each block's causal mask "h.N.attn.bias" (a buffer, not a
        # parameter: to be ignored).
        t = safetensors_torch.load_file(out / "model.safetensors")
        t = {k.removeprefix("transformer."): v for k, v in t.items()}
        for i in range(model.config.n_layer):
            t[f"h.{i}.attn.bias"] = torch.tril(torch.ones(64, 64)).view(1, 1, 64, 64)
        safetensors_torch.save_file(t, out / "model.safetensors", metadata={"format": "pt"})
    if dtype != torch.float32:
        assert all(v.dtype == dtype for v in safetensors_torch.load_file(out / "model.safetensors").values())
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """folder(kind): a saved random model of that kind, made once per module."""
    root = tmp_path_factory.mktemp("hf")
    made = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = make_folder(kind, root / kind)
        return made[kind]

    return get


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    """20000 uint16 ids below VOCAB with something to learn: each id is
    5 x the previous + one of 0..3 (mod VOCAB), so 2 bits of entropy against
    log2(96) = 6.6 for a model that has not learnt the rule."""
    rng = np.random.default_rng(0)
    step = rng.integers(0, 4, 20000)
    ids = np.empty(20000, dtype=np.int64)
    ids[0] = 0
    for i in range(1, len(ids)):
        ids[i] = (5 * ids[i - 1] + step[i]) % VOCAB
    assert ids.max() == VOCAB - 1
    path = tmp_path_factory.mktemp("tokens") / "tokens.bin"
    ids.astype(np.uint16).tofile(path)
    return path


# ---------------------------------------------------------------- helpers


def train(run_dir: Path, name: str, data: Path, *args, **kw):
    return run("train", "--run-dir", run_dir, *SMALL, "--set", f"model.name={name}",
               "--set", f"data.path={data}", *args, **kw)


def last_checkpoint(run_dir: Path) -> Path:
    return sorted((run_dir / "checkpoints").glob("step_*.pt"))[-1]


def predictions(checkpoint: Path, out: Path, *args) -> dict:
    ok(run("eval", "--checkpoint", checkpoint, "--predictions", out, *args))
    p = torch.load(out, map_location="cpu", weights_only=True)
    inputs, targets = p["inputs"], p["targets"]
    assert inputs.dtype == torch.int64 and inputs.dim() == 2 and inputs.shape[1] == SEQ
    # The windows are consecutive tokens, each target the next input.
    assert torch.equal(targets[:, :-1], inputs[:, 1:])
    logits = p["logits"]
    assert logits.dtype == torch.float32
    return {"inputs": inputs, "targets": targets, "logits": logits.reshape(*inputs.shape, -1)}


def load_hf(path: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    return model.eval()


def assert_logits_match(ours: torch.Tensor, model, inputs: torch.Tensor, what: str) -> None:
    """ours (fusetrain's float32 logits) against transformers' `model` on the
    same inputs.

    The tolerance comes from transformers itself rather than a fixed number:
    the exact logits are taken as transformers' forward in float64 (the same
    function: rotary angles in float32 in both), and transformers' own
    float32 forward's error err_hf = max |hf32 - hf64| measures what float32
    rounding costs through this depth and these magnitudes. fusetrain's
    float32 forward evaluates the same sums in other orders (SDPA instead of
    explicit softmax(QK^T)V, addmm instead of mm + add, a fused GQA); the
    classical forward-error bound of a float32 sum (gamma_n times the sum of
    the magnitudes) does not depend on the order, so a correct implementation
    has an error of the same order as transformers': C = 4 covers the
    variation of the realised maximum between orders. The floor of 8 float32
    ULPs of the largest logit covers a run where err_hf happens to be tiny.
    Observed: err_ours ~ err_hf ~ 1e-5 on logits up to ~9 (bound ~1e-4),
    while the smallest wrong detail tried (rotary base 5001 for 5000, norm
    epsilon 1e-6 for 1e-5, exact GELU for tanh) moves them by 7e-4 to 5e-3,
    12x to 80x the bound.
    """
    with torch.no_grad():
        hf32 = model.float()(inputs).logits
        hf64 = copy.deepcopy(model).double()(inputs).logits
    assert ours.shape == hf32.shape, (what, ours.shape, hf32.shape)
    err_hf = (hf32.double() - hf64).abs().max().item()
    err_ours = (ours.double() - hf64).abs().max().item()
    ulp = torch.finfo(torch.float32).eps * hf64.abs().max().item()
    bound = 4 * err_hf + 8 * ulp
    assert err_ours <= bound, (f"{what}: max |fusetrain - float64| = {err_ours:.3g} > {bound:.3g} "
                               f"(transformers float32: {err_hf:.3g}; max |logit| {hf64.abs().max().item():.3g})")


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return torch.nn.functional.cross_entropy(logits.double().flatten(0, 1), targets.flatten()).item()


# ---------------------------------------------------------------- 1: pretrained parity


@pytest.mark.parametrize("kind", ["gpt2", "gpt2_hub_names", "llama_gqa", "llama_tied", "llama_bias",
                                  "llama_sharded", "llama_bf16"])
def test_pretrained_logits_equal_transformers(tmp_path, folder, tokens, kind):
    """model.pretrained loads the folder's weights: with lr 0 the checkpoint's
    logits are transformers' logits of the folder."""
    src = folder(kind)
    name = kind.split("_")[0]
    run_dir = tmp_path / "run"
    p = ok(train(run_dir, name, tokens, "--set", f"model.pretrained={src}", *FROZEN))
    assert f"model {name}" in p.stdout, p.stdout
    ckpt = last_checkpoint(run_dir)
    # The checkpoint holds the folder's tensors under Hugging Face's names,
    # unchanged by the lr-0 step.
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    ref = load_hf(src)
    ref_state = ref.state_dict()
    for k, v in state.items():
        if k.startswith("model."):
            assert v.dtype == torch.float32 and torch.equal(v, ref_state[k[len("model."):]].float()), k
    pred = predictions(ckpt, tmp_path / "pred.pt")
    assert_logits_match(pred["logits"], ref, pred["inputs"], kind)
    # The run's evaluation loss is the cross-entropy of those logits.
    assert records(run_dir, "eval")[-1]["test_loss"] == pytest.approx(
        cross_entropy(pred["logits"], pred["targets"]), rel=1e-5)


# ---------------------------------------------------------------- 2: train, export, reload


@pytest.mark.parametrize("kind,policy", [("gpt2", "float32"), ("llama_gqa", "float32"),
                                         ("llama_gqa", "mixed_bfloat16")])
def test_trained_export_loads_in_transformers(tmp_path, folder, tokens, kind, policy):
    """30 AdamW steps from a pretrained folder: the loss falls, and the
    exported folder's logits in transformers are the final checkpoint's."""
    name = "gpt2" if kind == "gpt2" else "llama"
    run_dir = tmp_path / "run"
    ok(train(run_dir, name, tokens, "--set", f"model.pretrained={folder(kind)}", "--set", "train.max_steps=30",
             "--set", "optimizer.lr=1e-2", "--set", "train.log_every=1", "--set", f"precision.policy={policy}"))
    # Per-step losses of batches of 256 tokens are noisy: the means of the
    # first and last 5 steps (observed: 5.9 -> 5.6, from weights of O(1)).
    losses = [r["loss"] for r in records(run_dir, "train")]
    assert [r["step"] for r in records(run_dir, "train")] == list(range(1, 31))
    assert all(math.isfinite(x) for x in losses)
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.1, losses
    ckpt = last_checkpoint(run_dir)
    assert ckpt.name == "step_00000030.pt"
    out = tmp_path / "exported"
    p = ok(run("export", "--checkpoint", ckpt, "--hf", out))
    assert str(out) in p.stdout
    hf = load_hf(out)
    assert hf.config.model_type == name
    # The trained weights went out, not the folder's.
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    exported = safetensors_torch.load_file(out / "model.safetensors")
    assert sorted(exported) == sorted(k[len("model."):] for k in state if k.startswith("model."))
    for k, v in exported.items():
        assert v.dtype == torch.float32 and torch.equal(v, state["model." + k].float()), k
    # float32 evaluation of the (float32) weights, whatever the run's policy.
    pred = predictions(ckpt, tmp_path / "pred.pt", "--precision", "float32")
    assert_logits_match(pred["logits"], hf, pred["inputs"], f"{kind} {policy}")


# ---------------------------------------------------------------- 3: from scratch


SCRATCH = {
    "gpt2": ("--set", "model.d_model=32", "--set", "model.n_layer=2", "--set", "model.n_head=4",
             "--set", "model.d_ff=48", "--set", "model.norm_eps=1e-6"),
    "llama": ("--set", "model.d_model=32", "--set", "model.n_layer=2", "--set", "model.n_head=4",
              "--set", "model.n_kv_head=2", "--set", "model.tie_embeddings=false",
              "--set", "model.rope_theta=5000", "--set", "model.norm_eps=1e-6"),
}
EXPECTED_CONFIG = {
    "gpt2": {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "n_inner": 48, "n_positions": SEQ,
             "vocab_size": VOCAB, "layer_norm_epsilon": 1e-6, "activation_function": "gelu_new",
             "tie_word_embeddings": True},
    "llama": {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 128,  # 8/3 x 32 -> 64-multiple
              "max_position_embeddings": SEQ, "vocab_size": VOCAB, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": False, "hidden_act": "silu"},
}


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_from_scratch_exports_what_it_trained(tmp_path, tokens, name):
    run_dir = tmp_path / "run"
    ok(train(run_dir, name, tokens, *SCRATCH[name], "--set", "train.max_steps=30", "--set", "optimizer.lr=1e-2",
             "--set", "train.log_every=5", "--set", "precision.policy=float32"))
    losses = [r["loss"] for r in records(run_dir, "train")]
    assert losses[-1] < losses[0], losses
    ckpt = last_checkpoint(run_dir)
    out = tmp_path / "exported"
    ok(run("export", "--checkpoint", ckpt, "--hf", out))
    cfg = json.loads((out / "config.json").read_text())
    for key, value in EXPECTED_CONFIG[name].items():
        assert cfg.get(key) == value, (key, cfg.get(key), value)
    hf = load_hf(out)
    if name == "llama":
        # transformers read the rotary base from config.json.
        assert hf.config.rope_parameters["rope_theta"] == 5000.0
        assert hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr()
        assert not torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight)
    else:
        assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()
    n_params = sum(t.numel() for t in safetensors_torch.load_file(out / "model.safetensors").values())
    assert n_params == sum(p.numel() for p in hf.parameters())
    pred = predictions(ckpt, tmp_path / "pred.pt")
    assert_logits_match(pred["logits"], hf, pred["inputs"], f"{name} from scratch")


# ---------------------------------------------------------------- 4: bad input


def copy_folder(src: Path, dst: Path, config_edit=None, tensors_edit=None) -> Path:
    shutil.copytree(src, dst)
    if config_edit:
        cfg = json.loads((dst / "config.json").read_text())
        config_edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors_edit:
        t = safetensors_torch.load_file(dst / "model.safetensors")
        tensors_edit(t)
        safetensors_torch.save_file(t, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def assert_usage_error(p, *needles) -> None:
    assert p.returncode == USAGE, f"exit {p.returncode}\nstdout:\n{p.stdout[-2000:]}\nstderr:\n{p.stderr[-2000:]}"
    for needle in needles:
        assert str(needle) in p.stderr, (needle, p.stderr)


def bad_folders(root: Path, folder) -> dict:
    """case -> (model.name, folder, extra args, words the message must hold)."""
    gpt2, llama = folder("gpt2"), folder("llama_tied")  # both single-file
    root.mkdir()
    empty = root / "no_config"
    empty.mkdir()
    shutil.copy(gpt2 / "model.safetensors", empty / "model.safetensors")

    def set_(key, value):
        return lambda cfg: cfg.__setitem__(key, value)

    def drop(name):
        return lambda t: t.pop(name)

    def transpose(name):
        return lambda t: t.__setitem__(name, t[name].t().contiguous())

    k_proj = "model.layers.1.self_attn.k_proj.weight"
    c_fc = "transformer.h.0.mlp.c_fc.weight"
    no_weights = copy_folder(gpt2, root / "no_weights")
    (no_weights / "model.safetensors").unlink()
    return {
        "no folder": ("llama", root / "nope", (), ("model.pretrained", "nope", "no such folder")),
        "no config.json": ("gpt2", empty, (), (empty, "config.json")),
        "no weights": ("gpt2", no_weights, (), (no_weights, "model.safetensors")),
        "bert": ("llama", copy_folder(llama, root / "bert", set_("model_type", "bert")), (),
                 ("config.json", '"bert"', "model.name=llama", "gpt2 and llama")),
        "gpt2 as llama": ("llama", gpt2, (), (gpt2 / "config.json", '"gpt2"', "set model.name=gpt2")),
        "llama as gpt2": ("gpt2", llama, (), (llama / "config.json", '"llama"', "set model.name=llama")),
        "missing tensor": ("llama", copy_folder(llama, root / "missing", tensors_edit=drop(k_proj)), (),
                           (root / "missing", f'"{k_proj}"', "missing")),
        "wrong shape": ("gpt2", copy_folder(gpt2, root / "shape", tensors_edit=transpose(c_fc)), (),
                        (root / "shape" / "model.safetensors", f'"{c_fc}"', "[128, 32]", "[32, 128]")),
        "activation": ("gpt2", copy_folder(gpt2, root / "relu", set_("activation_function", "relu")), (),
                       ("activation_function", "relu")),
        "rope scaling": ("llama", copy_folder(llama, root / "yarn", set_(
            "rope_parameters", {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 2.0})), (),
                         ("rope_parameters", "yarn")),
        "seq_len > n_positions": ("gpt2", gpt2, ("--set", "model.seq_len=128"),
                                  ("model.seq_len", "n_positions", "64")),
    }


def test_bad_folders_are_usage_errors(tmp_path, folder, tokens):
    for case, (name, src, extra, needles) in bad_folders(tmp_path / "folders", folder).items():
        run_dir = tmp_path / f"run-{case.replace(' ', '_')}"
        p = train(run_dir, name, tokens, "--set", f"model.pretrained={src}", *FROZEN, *extra)
        assert p.returncode == USAGE, (case, p.returncode, p.stdout[-1000:], p.stderr[-2000:])
        for needle in needles:
            assert str(needle) in p.stderr, (case, needle, p.stderr)
        assert not run_dir.exists(), f"{case}: {run_dir} was written"


def test_token_ids_beyond_the_vocabulary(tmp_path, folder):
    src = folder("llama_gqa")
    ids = np.arange(3000, dtype=np.uint16) % VOCAB
    ids[1234] = VOCAB + 3
    path = tmp_path / "big.bin"
    ids.tofile(path)
    p = train(tmp_path / "run", "llama", path, "--set", f"model.pretrained={src}", *FROZEN)
    assert_usage_error(p, "data.path=", f"token id {VOCAB + 3}", src / "config.json", f'"vocab_size": {VOCAB}')
    assert not (tmp_path / "run").exists()
    # From scratch the vocabulary is the data's: the same file trains.
    ok(train(tmp_path / "scratch", "llama", path, *SCRATCH["llama"], *FROZEN))
    out = tmp_path / "out"
    ok(run("export", "--checkpoint", last_checkpoint(tmp_path / "scratch"), "--hf", out))
    assert json.loads((out / "config.json").read_text())["vocab_size"] == VOCAB + 4


def test_export_hf_refuses_other_models_and_other_folders(tmp_path, tokens, folder):
    # A run of fusetrain's own gpt: no Hugging Face layout to write.
    gpt_run = tmp_path / "gpt"
    ok(train(gpt_run, "gpt", tokens, "--set", "model.d_model=16", "--set", "model.n_layer=1",
             "--set", "model.n_head=2", *FROZEN))
    out = tmp_path / "out"
    p = run("export", "--checkpoint", last_checkpoint(gpt_run), "--hf", out)
    assert_usage_error(p, last_checkpoint(gpt_run), "not a gpt2 or llama run")
    assert not out.exists()

    hf_run = tmp_path / "llama"
    ok(train(hf_run, "llama", tokens, "--set", f"model.pretrained={folder('llama_tied')}", *FROZEN))
    ckpt = last_checkpoint(hf_run)
    # A folder of other files is never replaced.
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "notes.txt").write_text("mine")
    p = run("export", "--checkpoint", ckpt, "--hf", keep)
    assert_usage_error(p, keep, "not an earlier export")
    assert sorted(x.name for x in keep.iterdir()) == ["notes.txt"] and (keep / "notes.txt").read_text() == "mine"
    # Nor a file.
    (tmp_path / "file").write_text("x")
    assert_usage_error(run("export", "--checkpoint", ckpt, "--hf", tmp_path / "file"), "--hf")
    assert (tmp_path / "file").read_text() == "x"
    # A previous export is replaced.
    ok(run("export", "--checkpoint", ckpt, "--hf", out))
    (out / "model.safetensors").write_bytes(b"stale")
    ok(run("export", "--checkpoint", ckpt, "--hf", out))
    load_hf(out)
    # No temporary folders left beside the targets.
    assert sorted(x.name for x in tmp_path.iterdir()) == ["file", "gpt", "keep", "llama", "out"]


def test_export_hf_path_with_a_trailing_slash(tmp_path, tokens, folder):
    hf_run = tmp_path / "llama"
    ok(train(hf_run, "llama", tokens, "--set", f"model.pretrained={folder('llama_tied')}", *FROZEN))
    ckpt = last_checkpoint(hf_run)
    out = tmp_path / "out"
    ok(run("export", "--checkpoint", ckpt, "--hf", f"{out}/"))
    ok(run("export", "--checkpoint", ckpt, "--hf", f"{out}/"))
    load_hf(out)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["llama", "out"]


def test_export_hf_never_replaces_the_pretrained_folder(tmp_path, tokens, folder):
    """The model folder a run started from (its generation_config.json, a
    tokenizer) is not an export: exporting onto it is refused, and it stays."""
    src = folder("llama_tied")
    hf_run = tmp_path / "llama"
    ok(train(hf_run, "llama", tokens, "--set", f"model.pretrained={src}", *FROZEN))
    before = sorted(x.name for x in Path(src).iterdir())
    assert_usage_error(run("export", "--checkpoint", last_checkpoint(hf_run), "--hf", src), "not an earlier export")
    assert sorted(x.name for x in Path(src).iterdir()) == before


# ---------------------------------------------------------------- 5: resume


def test_resume_continues_bit_for_bit(tmp_path, folder, tokens):
    """A run resumed from its step-10 checkpoint reaches the uninterrupted
    run's step-20 state exactly (weights, AdamW moments)."""
    args = ("--set", f"model.pretrained={folder('llama_gqa')}", "--set", "train.max_steps=20",
            "--set", "output.checkpoint_every=10", "--set", "train.log_every=5",
            "--set", "precision.policy=float32", "--set", "optimizer.lr=1e-3")
    full = tmp_path / "full"
    ok(train(full, "llama", tokens, *args))
    ckpts = sorted((full / "checkpoints").glob("step_*.pt"))
    assert [c.name for c in ckpts] == ["step_00000010.pt", "step_00000020.pt"]
    resumed = tmp_path / "resumed"
    ok(train(resumed, "llama", tokens, *args, "--resume", ckpts[0]))
    assert [r["step"] for r in records(resumed, "train")] == [15, 20]
    a = torch.load(ckpts[1], map_location="cpu", weights_only=True)
    b = torch.load(last_checkpoint(resumed), map_location="cpu", weights_only=True)
    assert int(b["trainer.step"]) == 20
    keys = [k for k in a if k.startswith(("model.", "optim."))]
    assert keys and sorted(keys) == sorted(k for k in b if k.startswith(("model.", "optim.")))
    differ = [k for k in keys if not torch.equal(a[k], b[k])]
    assert not differ, differ[:5]


def test_relative_paths_reach_every_rank(tmp_path, folder, tokens):
    """--set paths relative to the working directory name the same files in
    the two ranks, which read the resolved config from a private file
    elsewhere (they once looked for the token file beside it)."""
    shutil.copytree(folder("llama_gqa"), tmp_path / "model")
    shutil.copy(tokens, tmp_path / "tokens.bin")
    one_rank = SMALL.index("--nproc")
    two_ranks = SMALL[:one_rank] + ("--nproc", "2") + SMALL[one_rank + 2:]
    p = ok(run("train", "--run-dir", "run", *two_ranks, "--set", "model.name=llama",
               "--set", "model.pretrained=model", "--set", "data.path=tokens.bin",
               "--set", "train.max_steps=2", cwd=tmp_path, timeout=300))
    assert last_checkpoint(tmp_path / "run").exists(), p.stdout
    assert "2 ranks on cpu" in p.stdout, p.stdout
    assert str(tmp_path / "tokens.bin") in (tmp_path / "run" / "config.yaml").read_text()


def test_resume_and_eval_without_the_pretrained_folder(tmp_path, folder, tokens):
    """The checkpoint keeps the model's config.json: once the run started, the
    folder it came from may move; resume and eval build the model from the
    checkpoint and read nothing from model.pretrained."""
    src = tmp_path / "model"
    shutil.copytree(folder("llama_gqa"), src)
    args = ("--set", f"model.pretrained={src}", "--set", "output.checkpoint_every=2",
            "--set", "precision.policy=float32", "--set", "schedule.decay=none")
    run_dir = tmp_path / "run"
    ok(train(run_dir, "llama", tokens, *args, "--set", "train.max_steps=2"))
    shutil.rmtree(src)
    ok(train(run_dir, "llama", tokens, *args, "--set", "train.max_steps=4",
             "--resume", last_checkpoint(run_dir)))
    assert last_checkpoint(run_dir).name == "step_00000004.pt"
    assert "test loss" in ok(run("eval", "--checkpoint", last_checkpoint(run_dir))).stdout
