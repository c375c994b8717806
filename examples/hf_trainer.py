"""Hugging Face Trainer with fusetrain's FusedAdamW (and, for fp16, its
GradScaler): a small GPT-2 built from a config (nothing downloaded) learns to
continue counting sequences.

    python examples/hf_trainer.py                      # bf16 autocast
    python examples/hf_trainer.py --precision fp16     # fp16 + fusetrain's loss scaler, CPU too
    python examples/hf_trainer.py --master-weights     # bf16 weights, fp32 masters in the optimizer
    torchrun --nproc_per_node 2 examples/hf_trainer.py # data parallel

The one-line version, if you set the optimizer's arguments yourself:
``Trainer(..., optimizer_cls_and_kwargs=(fusetrain.optim.FusedAdamW, {"lr": 3e-4}))``.
Needs ``pip install "fusetrain[hf]"``.
"""

import argparse
import gc
import tempfile

import torch
import transformers

from fusetrain.integrations import hf_optimizer, use_grad_scaler

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
parser.add_argument("--master-weights", action="store_true",
                    help="train a bfloat16 model; FusedAdamW keeps fp32 masters")
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--width", type=int, default=128)
parser.add_argument("--output-dir", default=None, help="checkpoints (default: a temporary folder)")
args = parser.parse_args()

VOCAB, SEQ = 128, 64


def counting_sequences(n: int, seed: int) -> list:
    """start, start + 1, ... (mod VOCAB): a task a small model learns fast."""
    g = torch.Generator().manual_seed(seed)
    ids = (torch.randint(0, VOCAB, (n, 1), generator=g) + torch.arange(SEQ)) % VOCAB
    return [{"input_ids": row, "labels": row} for row in ids]


def main(output_dir: str):
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=args.width,
                                     n_layer=args.layers, n_head=4)
    model = transformers.GPT2LMHeadModel(config)
    if args.master_weights:
        model = model.to(torch.bfloat16)
    training_args = transformers.TrainingArguments(
        output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=16,
        learning_rate=1e-3, weight_decay=0.1, warmup_steps=args.steps // 10,
        bf16=args.precision == "bf16", fp16=args.precision == "fp16",
        logging_steps=max(1, args.steps // 10), save_strategy="no", report_to=[],
        use_cpu=not torch.cuda.is_available(),
    )
    # FusedAdamW with the settings and weight-decay groups the Trainer's own
    # AdamW would get; the Trainer still clips (max_grad_norm=1.0).
    optimizer = hf_optimizer(training_args, model, master_weights=args.master_weights)
    trainer = transformers.Trainer(model=model, args=training_args, optimizers=(optimizer, None),
                                   train_dataset=counting_sequences(4096, seed=0))
    if args.precision == "fp16":
        # Accelerate trains fp16 runs of a CPU in float32; this makes them fp16
        # with fusetrain's loss scaler (on a GPU it replaces torch's scaler).
        use_grad_scaler(trainer)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if trainer.is_world_process_zero():
        print(f"hf_trainer ({args.precision}{', master weights' if args.master_weights else ''}): "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    group = torch.distributed.group.WORLD if torch.distributed.is_initialized() else None
    trainer.accelerator.end_training()  # under torchrun: ends the process group
    return group


if __name__ == "__main__":
    if args.output_dir:
        group = main(args.output_dir)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            group = main(tmp)
    # Under torchrun, torch's DDP holds the process group from C++ and lets go
    # of it with the GIL held, which deadlocks against a gloo worker that still
    # needs the GIL to drop a finished collective's tensor (pytorch/pytorch#56297).
    # Collect the Trainer's reference cycles while we still hold the group, then
    # drop the group from Python, whose release joins gloo's threads without the GIL.
    gc.collect()
    del group
