"""Hugging Face Trainer step (issue 39): ``Trainer(optimizer_cls_and_kwargs=
(FusedAdamW, ...))`` (fusetrain.integrations.hf_optimizer_cls_and_kwargs)
against ``optim="adamw_torch_fused"``, side by side in one process.

A GPT-2 built from a config (4 layers, d_model 256, 4 heads, vocabulary 8192,
context 128; ``--quick``: 2 layers, d_model 64, vocabulary 512, context 32),
batch 8, counting sequences as data, the Trainer's default clipping
(max_grad_norm=1.0) and linear schedule, in bf16 autocast and in fp32. What is
timed is the Trainer's whole step as its callbacks see it: one
``on_step_end`` to the next (data, forward, backward, clipping, optimizer,
scheduler, ``zero_grad``, logging every step); the notes add the median
time of the part fusetrain replaces, clipping + optimizer step, timed inside
the same steps. A second row per precision
runs FusedAdamW with the clipping folded into its step
(``hf_optimizer_cls_and_kwargs(args, max_grad_norm=1.0)`` with the Trainer's
own clipping off, ``TrainingArguments(max_grad_norm=0)``): the same global-norm
clip, one pass over the gradients fewer. Each variant gets a new
Trainer per window of WINDOW steps over the same initial weights; windows
alternate ours / torch, the first WARM steps of each window are dropped, and
ms per step is the median over all kept steps. Goal: ratio >= 1.0 (no
slower). The optimizer is a small part of such a step on a CPU, so expect
about 1.0x there; the GPU rows are where the fused step shows.

    .venv/bin/python bench/run.py --only hf_trainer [--quick] [--threads N]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.append(str(HERE.parent / "python"))  # after the environment's own fusetrain (e.g. a TORCH_VERSION build's)

from common import Context, error_row, median, result, spread  # noqa: E402

NAME = "hf_trainer"
GOAL = 1.0
WINDOW, WARM = 12, 2


def _sizes(quick: bool) -> dict:
    if quick:
        return dict(layers=2, width=64, vocab=512, seq=32, windows=2)
    return dict(layers=4, width=256, vocab=8192, seq=128, windows=6)


def _step_times(ctx: Context, sizes: dict, precision: str, variant: str, out: str, state: dict) -> tuple:
    """Seconds per Trainer step of one window and seconds of its clipping +
    optimizer step (the part fusetrain replaces), first WARM steps dropped."""
    import transformers

    from fusetrain.integrations import hf_optimizer_cls_and_kwargs

    def now() -> float:
        if ctx.is_cuda:
            torch.cuda.synchronize(ctx.device)
        return time.perf_counter()

    class StepClock(transformers.TrainerCallback):
        def __init__(self):
            self.stamps, self.optimizer, self.clip_started = [], [], None

        def on_pre_optimizer_step(self, args, state_, control, **kwargs):
            if variant == "ours_clip":  # no Trainer clipping: the part starts here
                self.clip_started = now()

        def on_optimizer_step(self, args, state_, control, **kwargs):
            self.optimizer.append(now() - self.clip_started)

        def on_step_end(self, args, state_, control, **kwargs):
            self.stamps.append(now())

    clock = StepClock()

    class Trainer(transformers.Trainer):
        """Stamps the start of clipping, which no callback precedes."""

        def _clip_grad_norm(self, model):
            clock.clip_started = now()
            return super()._clip_grad_norm(model)

    config = transformers.GPT2Config(vocab_size=sizes["vocab"], n_positions=sizes["seq"], n_embd=sizes["width"],
                                     n_layer=sizes["layers"], n_head=4)
    model = transformers.GPT2LMHeadModel(config)
    model.load_state_dict(state)
    g = torch.Generator().manual_seed(0)
    ids = (torch.randint(0, sizes["vocab"], (8 * WINDOW, 1), generator=g) + torch.arange(sizes["seq"])) % sizes["vocab"]
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=WINDOW, per_device_train_batch_size=8, learning_rate=1e-3, weight_decay=0.1,
        bf16=precision == "bf16", logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
        use_cpu=not ctx.is_cuda, dataloader_num_workers=0, seed=0,
        **({"optim": "adamw_torch_fused"} if variant == "torch" else {}),
        **({"max_grad_norm": 0.0} if variant == "ours_clip" else {}),
    )
    extra = {}
    if variant != "torch":
        clip = 1.0 if variant == "ours_clip" else None
        extra["optimizer_cls_and_kwargs"] = hf_optimizer_cls_and_kwargs(args, max_grad_norm=clip)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[clock], **extra)
    trainer.train()
    stamps = clock.stamps
    return [b - a for a, b in zip(stamps[WARM:], stamps[WARM + 1:])], clock.optimizer[WARM + 1:]


def _rows(ctx: Context, precision: str) -> list:
    import transformers

    transformers.logging.set_verbosity_error()
    sizes = _sizes(ctx.quick)
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=sizes["vocab"], n_positions=sizes["seq"], n_embd=sizes["width"],
                                     n_layer=sizes["layers"], n_head=4)
    model = transformers.GPT2LMHeadModel(config)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    params = sum(p.numel() for p in model.parameters())
    times = {"ours": [], "ours_clip": [], "torch": []}
    optimizer = {variant: [] for variant in times}
    with tempfile.TemporaryDirectory() as out:
        for _ in range(sizes["windows"]):
            for variant in times:
                steps, parts = _step_times(ctx, sizes, precision, variant, out, state)
                times[variant] += steps
                optimizer[variant] += parts
    theirs = median(times["torch"]) * 1e3
    rows = []
    their_part = median(optimizer["torch"]) * 1e3
    for variant, label in (("ours", "FusedAdamW"), ("ours_clip", "FusedAdamW clipping in its step")):
        pair = {"ours": times[variant], "torch": times["torch"]}
        part = median(optimizer[variant]) * 1e3
        rows.append(result(
            f"hf trainer step, {precision}, {label} vs adamw_torch_fused",
            ours=median(pair["ours"]) * 1e3, torch_=theirs, unit="ms", higher_is_better=False, goal=GOAL,
            times=pair,
            notes=(f"clipping + optimizer step {part:.2f} vs {their_part:.2f} ms ({their_part / part:.2f}x); "
                   f"GPT-2 {sizes['layers']}L d{sizes['width']} V{sizes['vocab']} T{sizes['seq']} batch 8, "
                   f"{params / 1e6:.1f}M params; spread {spread(pair['ours']):.2f}/{spread(pair['torch']):.2f}; "
                   f"transformers {transformers.__version__}"),
            steps_timed=len(pair["ours"]), optimizer_ms=part, torch_optimizer_ms=their_part,
        ))
    return rows


def run(ctx: Context) -> list:
    try:
        import transformers  # noqa: F401
    except ImportError:
        print('hf_trainer: transformers is not installed (pip install "fusetrain[hf]"); no rows', file=sys.stderr)
        return []
    rows = []
    for precision in ("bf16", "fp32"):
        try:
            rows += _rows(ctx, precision)
        except Exception as e:  # noqa: BLE001  (one failure must not cost the other row)
            rows.append(error_row(f"hf trainer step, {precision}", e))
    return rows
