"""fusetrain's FusedAdamW inside Hugging Face's Trainer, on the CPU.

A 2-layer GPT-2 built from a config (no download) learns a counting task for
a few steps with ``optimizer_cls_and_kwargs=(FusedAdamW, ...)`` and with
``optim="adamw_torch_fused"`` side by side:

- bf16: the two runs' final weights and held-out loss agree within twice
  torch's own bf16 error (its bf16 run against its fp32 run, Note
  [Trajectory tolerance] in test_optim.py for the fp32 parts).
- fp16: Accelerate runs float32 on a CPU (no scaler, no autocast there), so
  the two runs agree to fp32 rounding; with
  ``fusetrain.integrations.use_grad_scaler`` the run is float16 with loss
  scaling, against torch's fused AdamW with torch's CPU GradScaler.
- ``hf_optimizer`` makes the Trainer's own parameter groups; folded clipping
  (``max_grad_norm``) follows the Trainer's clipping.
- ``resume_from_checkpoint`` restores FusedAdamW's state (fp32 masters of a
  bf16 model included): the resumed run ends on the uninterrupted run's bits.
- Without transformers or accelerate, fusetrain.integrations and its
  modules import, and the helpers raise one line naming the extra.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason='needs transformers: pip install "fusetrain[hf]"')
pytest.importorskip("accelerate", reason='needs accelerate: pip install "fusetrain[hf]"')

import fusetrain.optim  # noqa: E402
from fusetrain.integrations import hf_optimizer, hf_optimizer_cls_and_kwargs, use_grad_scaler  # noqa: E402

from conftest import assert_bits_equal  # noqa: E402

transformers.logging.set_verbosity_error()

VOCAB, SEQ, STEPS, LR = 64, 16, 8, 3e-3


def counting_data(n: int, seed: int) -> list:
    """Sequences start, start + 1, ... (mod VOCAB): learnable in a few steps."""
    g = torch.Generator().manual_seed(seed)
    ids = (torch.randint(0, VOCAB, (n, 1), generator=g) + torch.arange(SEQ)) % VOCAB
    return [{"input_ids": row, "labels": row} for row in ids]


def tiny_gpt2(dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config).to(dtype)


def training_args(out, **overrides):
    kw = dict(
        output_dir=str(out), per_device_train_batch_size=8, max_steps=STEPS, learning_rate=LR,
        weight_decay=0.1, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
        disable_tqdm=True, dataloader_num_workers=0,
    )
    kw.update(overrides)
    return transformers.TrainingArguments(**kw)


HELD_OUT = counting_data(32, seed=1)


@torch.no_grad()
def held_out(model) -> tuple:
    """(fp32 logits, loss) of the trained weights on data they never saw.

    Runs are compared by what the model computes, not weight by weight:
    GPT-2's key bias gets no gradient (softmax ignores a constant added to
    every key), only rounding noise that Adam normalises to full-size steps,
    so those weights differ between any two implementations by ~lr a step
    and change nothing.
    """
    model = model.float().eval()
    ids = torch.stack([d["input_ids"] for d in HELD_OUT])
    out = model(input_ids=ids, labels=ids)
    return out.logits.float(), float(out.loss)


def train(tmp_path, name: str, *, model=None, before_train=None, resume=None, **kw):
    """One Trainer run; returns (trainer, final weights as fp32 copies)."""
    cls_and_kwargs = kw.pop("cls_and_kwargs", None)
    optimizers = kw.pop("optimizers", None)
    model = tiny_gpt2() if model is None else model
    args = training_args(tmp_path / name, **kw)
    extra = {}
    if cls_and_kwargs is not None:
        extra["optimizer_cls_and_kwargs"] = cls_and_kwargs(args) if callable(cls_and_kwargs) else cls_and_kwargs
    if optimizers is not None:
        extra["optimizers"] = (optimizers(args, model), None)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=counting_data(64, seed=0), **extra)
    if before_train is not None:
        before_train(trainer)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, {k: v.detach().float().clone() for k, v in trainer.model.state_dict().items()}


def logged_losses(trainer) -> list:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def assert_within_twice_torchs_error(ours, theirs, reference, what: str) -> None:
    """ours vs torch within 2x torch's low-precision run's distance from its
    fp32 run, in the held-out logits (max |diff|) and loss."""
    (logits_o, loss_o), (logits_t, loss_t), (logits_r, loss_r) = (held_out(run[0].model)
                                                                  for run in (ours, theirs, reference))
    err = float((logits_t - logits_r).abs().max())
    assert err > 0, f"{what}: the low-precision run equals the fp32 run: nothing ran in 16 bits"
    diff = float((logits_o - logits_t).abs().max())
    assert diff <= 2 * err, f"{what}: logits {diff:.3g} from torch's, torch's own error {err:.3g}"
    assert abs(loss_o - loss_t) <= 2 * abs(loss_t - loss_r) + 1e-6 * abs(loss_r), (
        f"{what}: held-out loss {loss_o} vs torch's {loss_t} (fp32: {loss_r})"
    )
    losses = logged_losses(ours[0])
    assert len(losses) == STEPS and losses[-1] < losses[0], f"{what}: the loss did not fall: {losses}"


def assert_fp32_close(ours, theirs, what: str) -> None:
    """Two float32 runs of the same maths in different operation orders
    (ulps a step, Note [Trajectory tolerance] in test_optim.py), fed back
    through STEPS steps of training: held-out logits within 1e-5 of the
    largest one."""
    (logits_o, _), (logits_t, _) = held_out(ours[0].model), held_out(theirs[0].model)
    scale = float(logits_t.abs().max())
    torch.testing.assert_close(logits_o, logits_t, rtol=1e-5, atol=1e-5 * scale, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------- the optimizer's settings


def test_hf_optimizer_has_the_trainers_groups_and_settings(tmp_path):
    model = tiny_gpt2()
    args = training_args(tmp_path, optim="adamw_torch_fused", adam_beta1=0.8, adam_beta2=0.95,
                         adam_epsilon=1e-7, learning_rate=2e-3, weight_decay=0.05)
    theirs = transformers.Trainer(model=model, args=args, train_dataset=counting_data(8, 0)).create_optimizer()
    ours = hf_optimizer(args, model, master_weights=True)
    assert isinstance(ours, fusetrain.optim.FusedAdamW)
    assert len(ours.param_groups) == len(theirs.param_groups) == 2
    for g_ours, g_theirs in zip(ours.param_groups, theirs.param_groups):
        assert [id(p) for p in g_ours["params"]] == [id(p) for p in g_theirs["params"]]
        for key in ("lr", "betas", "eps", "weight_decay"):
            assert g_ours[key] == g_theirs[key], key
        assert g_ours["master_weights"] is True
    # GPT-2's biases and LayerNorm weights are exempt from decay, the rest not.
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay = {names[id(p)] for p in ours.param_groups[1]["params"]}
    assert "transformer.ln_f.weight" in no_decay and "transformer.h.0.attn.c_attn.bias" in no_decay
    assert "transformer.h.0.attn.c_attn.weight" not in no_decay
    cls, kwargs = hf_optimizer_cls_and_kwargs(args)
    assert cls is fusetrain.optim.FusedAdamW
    assert kwargs == dict(lr=2e-3, betas=(0.8, 0.95), eps=1e-7, master_weights=False)


def test_folded_clipping_is_refused_while_the_trainer_clips(tmp_path):
    args = training_args(tmp_path)  # max_grad_norm=1.0, the Trainer's default
    with pytest.raises(ValueError, match="max_grad_norm=0"):
        hf_optimizer(args, tiny_gpt2(), max_grad_norm=1.0)


def test_folded_clipping_follows_the_trainers_clipping(tmp_path):
    # fp32; the gradient norm here is above 1 at every step, so both clip.
    trainer_clips = train(tmp_path, "trainer", optimizers=hf_optimizer, max_grad_norm=1.0)
    step_clips = train(tmp_path, "step", optimizers=lambda a, m: hf_optimizer(a, m, max_grad_norm=1.0),
                       max_grad_norm=0.0)
    norms = [h["grad_norm"] for h in trainer_clips[0].state.log_history if "grad_norm" in h]
    assert min(norms) > 1.0, f"the test needs clipping at every step, norms {norms}"
    assert_fp32_close(step_clips, trainer_clips, "clipped in the step vs by the Trainer")


# ---------------------------------------------------------------- against adamw_torch_fused


@pytest.mark.parametrize("how", ["optimizer_cls_and_kwargs", "optimizers"])
def test_bf16_trains_like_adamw_torch_fused(tmp_path, how):
    if how == "optimizer_cls_and_kwargs":
        ours = train(tmp_path, "ours", bf16=True, cls_and_kwargs=hf_optimizer_cls_and_kwargs)
    else:
        ours = train(tmp_path, "ours", bf16=True, optimizers=hf_optimizer)
    assert isinstance(ours[0].optimizer.optimizer, fusetrain.optim.FusedAdamW)
    theirs = train(tmp_path, "theirs", bf16=True, optim="adamw_torch_fused")
    reference = train(tmp_path, "fp32", optim="adamw_torch_fused")
    assert_within_twice_torchs_error(ours, theirs, reference, "bf16")


def test_fp16_on_the_cpu_is_float32_and_matches_adamw_torch_fused(tmp_path):
    # Accelerate makes neither a scaler nor fp16 autocast on a CPU.
    ours = train(tmp_path, "ours", fp16=True, cls_and_kwargs=hf_optimizer_cls_and_kwargs)
    theirs = train(tmp_path, "theirs", fp16=True, optim="adamw_torch_fused")
    assert ours[0].accelerator.scaler is None
    assert_fp32_close(ours, theirs, "fp16 flag on the CPU")


def test_fp16_with_use_grad_scaler_trains_like_torchs_scaler_and_fused_adamw(tmp_path):
    scalers = {}

    def ours_scaler(trainer):
        scalers["ours"] = use_grad_scaler(trainer, fusetrain.amp.GradScaler("cpu", init_scale=2.0**8))

    def torch_scaler(trainer):
        scalers["theirs"] = use_grad_scaler(trainer, torch.amp.GradScaler("cpu", init_scale=2.0**8))

    ours = train(tmp_path, "ours", fp16=True, cls_and_kwargs=hf_optimizer_cls_and_kwargs, before_train=ours_scaler)
    theirs = train(tmp_path, "theirs", fp16=True, optim="adamw_torch_fused", before_train=torch_scaler)
    reference = train(tmp_path, "fp32", optim="adamw_torch_fused")
    assert ours[0].accelerator.scaler is scalers["ours"]
    assert scalers["ours"].state_dict() == scalers["theirs"].state_dict()
    assert_within_twice_torchs_error(ours, theirs, reference, "fp16 with loss scaling")


# ---------------------------------------------------------------- checkpoints


def test_resume_from_checkpoint_restores_fused_state_and_masters(tmp_path):
    # A bf16 model with fp32 masters: a resume that lost the masters would
    # restart them from the bf16 weights and end elsewhere.
    def opt(args, model):
        return hf_optimizer(args, model, master_weights=True)

    whole, w_whole = train(tmp_path, "whole", model=tiny_gpt2(torch.bfloat16), optimizers=opt, bf16=True,
                           save_strategy="steps", save_steps=STEPS // 2)
    checkpoint = tmp_path / "whole" / f"checkpoint-{STEPS // 2}"
    assert (checkpoint / "optimizer.pt").exists()
    resumed, w_resumed = train(tmp_path, "resumed", model=tiny_gpt2(torch.bfloat16), optimizers=opt, bf16=True,
                               resume=str(checkpoint))
    assert resumed.state.global_step == STEPS
    for k in w_whole:
        assert_bits_equal(w_resumed[k], w_whole[k], k)
    a, b = whole.optimizer.optimizer, resumed.optimizer.optimizer
    for pa, pb in zip(a.param_groups[0]["params"], b.param_groups[0]["params"]):
        for key in ("master_param", "exp_avg", "exp_avg_sq", "step"):
            assert_bits_equal(b.state[pb][key], a.state[pa][key], key)


# ---------------------------------------------------------------- optional libraries


@pytest.mark.parametrize("call,extra", [("hf_optimizer(None, None)", "hf"), ("use_grad_scaler(None)", "accelerate")])
def test_missing_library_is_one_line_naming_the_extra(call, extra):
    # Every module imports without the libraries (as the wheel's smoke test
    # imports every module); calling a helper names the extra.
    code = f"""
import sys
sys.modules["transformers"] = None
sys.modules["accelerate"] = None
import fusetrain, fusetrain.integrations, fusetrain.integrations.hf, fusetrain.integrations.accelerate
try:
    fusetrain.integrations.{call}
except ImportError as e:
    print(str(e))
else:
    raise SystemExit("no ImportError")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    message = out.stdout.strip()
    assert "\n" not in message and f'pip install "fusetrain[{extra}]"' in message, message
