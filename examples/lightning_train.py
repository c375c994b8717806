"""Train a small language model with PyTorch Lightning on fusetrain.

What changes against a plain Lightning script is three lines: the import,
``strategy="fusetrain_ddp"`` (fusetrain's C++ gradient reducer; the
"fusetrain" shared-memory backend on CPUs, NCCL on GPUs) and
``plugins=[FusetrainPrecision("bf16-mixed")]`` (fusetrain's mixed precision),
plus fusetrain's fused AdamW with float32 master weights in
``configure_optimizers``.

    pip install "fusetrain[lightning]"
    python examples/lightning_train.py                  # 2 CPU processes, or every GPU
    python examples/lightning_train.py --precision 16-mixed --devices 4
    torchrun --nnodes 2 --nproc-per-node 8 ... examples/lightning_train.py --num-nodes 2

Lightning starts the other processes itself (or takes them from torchrun or
SLURM). ``FUSETRAIN_EXAMPLE_TINY=1`` (or ``--tiny``) runs a few seconds' worth,
as the test suite does.
"""

from __future__ import annotations

import argparse
import math
import os

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import fusetrain.optim
from fusetrain.lightning import FusetrainPrecision  # also registers strategy="fusetrain_ddp"


class CopyTask(Dataset):
    """Sequences whose second half repeats the first: a transformer learns
    to copy, so the loss falls quickly from log(vocab)."""

    def __init__(self, size: int, length: int, vocab: int):
        g = torch.Generator().manual_seed(0)
        half = torch.randint(1, vocab, (size, length // 2), generator=g)
        self.data = torch.cat([half, half], dim=1)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


class TinyGPT(pl.LightningModule):
    def __init__(self, vocab: int, width: int, layers: int, heads: int, length: int, lr: float):
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(length, width))
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        self.mask = nn.Transformer.generate_square_subsequent_mask(length - 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.position[: tokens.shape[1]]
        h = self.blocks(h, mask=self.mask.to(h.device), is_causal=True)
        return self.head(self.norm(h))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        # One fused multi-tensor step; with "16-mixed" the scaler hands it the
        # scale as a tensor, so no step waits for the host.
        return fusetrain.optim.FusedAdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)


class LossRange(pl.Callback):
    """Prints the training loss of the first and last steps (rank 0)."""

    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))  # a host sync, for printing only

    def on_train_end(self, trainer, module):
        if trainer.is_global_zero:
            window = max(1, len(self.losses) // 10)
            first = sum(self.losses[:window]) / window
            last = sum(self.losses[-window:]) / window
            print(f"loss {first:.4f} -> {last:.4f} over {len(self.losses)} steps (log(vocab) = "
                  f"{math.log(module.hparams.vocab):.4f})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precision", default="bf16-mixed", choices=("bf16-mixed", "16-mixed", "32-true", "fp8-mixed"))
    ap.add_argument("--devices", type=int, default=None, help="processes per node (default: every GPU, or 2 CPU processes)")
    ap.add_argument("--num-nodes", type=int, default=1)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--tiny", action="store_true", help="a few seconds' worth (also FUSETRAIN_EXAMPLE_TINY=1)")
    ap.add_argument("--root", default=None, help="Lightning's default_root_dir")
    args = ap.parse_args()
    tiny = args.tiny or os.environ.get("FUSETRAIN_EXAMPLE_TINY") == "1"

    gpu = torch.cuda.is_available()
    if tiny:
        size = dict(vocab=16, width=32, layers=1, heads=2, length=16, lr=1e-2)
        steps, batch = 40, 16
    else:
        size = dict(vocab=256, width=256, layers=4, heads=4, length=128, lr=1e-3)
        steps, batch = args.steps, 32
    devices = args.devices or (torch.cuda.device_count() if gpu else 2)
    if not gpu:  # the processes of a node share its cores
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // devices))
    pl.seed_everything(0, verbose=False)
    model = TinyGPT(**size)
    data = DataLoader(CopyTask(steps * batch * 2, size["length"], size["vocab"]), batch_size=batch,
                      shuffle=True, drop_last=True)
    trainer = pl.Trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=devices,
        num_nodes=args.num_nodes,
        strategy="fusetrain_ddp",
        plugins=[FusetrainPrecision(args.precision)],
        max_steps=steps,
        gradient_clip_val=1.0,  # folded into FusedAdamW's step
        callbacks=[LossRange()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=not tiny,
        enable_model_summary=not tiny,
        default_root_dir=args.root,
    )
    trainer.fit(model, data)


if __name__ == "__main__":
    main()
