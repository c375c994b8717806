"""A LightningModule that logs with ``sync_dist=True`` as users do, run by
test_lightning.py's logging test through Lightning's own launcher:

    python lightning_logging.py STRATEGY OUT

(2 CPU processes). Rank 0 saves to OUT what Lightning logged (every
validation epoch's ``callback_metrics`` and the last step's) with torch.save.

The metrics: float losses averaged at step and epoch level, an int64 tensor
and a Python int averaged (Lightning's default reduce_fx "mean"), an int64
count summed, a float maximum, and a torchmetrics Accuracy object; in
training_step and validation_step.
"""

from __future__ import annotations

import sys

import lightning.pytorch as pl
import torch
import torchmetrics
from torch.utils.data import DataLoader, TensorDataset

import fusetrain.lightning  # noqa: F401  (registers the strategies)


class Logged(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(6, 3)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.layer(x), y)
        self.log("train_loss", loss, sync_dist=True, on_step=True, on_epoch=True)
        self.log("train_samples", torch.tensor(len(y), dtype=torch.int64), sync_dist=True, on_step=False,
                 on_epoch=True, reduce_fx="sum")
        self.log("train_max_logit", self.layer(x).detach().max(), sync_dist=True, on_epoch=True, reduce_fx="max")
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.layer(x)
        self.log("val_loss", torch.nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_correct", (logits.argmax(1) == y).sum(), sync_dist=True)  # int64, reduce_fx "mean"
        self.log("val_batch", batch_idx + 1 + self.global_rank, sync_dist=True)  # a Python int
        self.val_acc(logits, y)
        self.log("val_acc", self.val_acc)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2)


class Keep(pl.Callback):
    def __init__(self) -> None:
        self.epochs = []

    def on_train_epoch_end(self, trainer, module) -> None:
        self.epochs.append({k: v.detach().clone() for k, v in trainer.callback_metrics.items()})


def main(strategy: str, out: str) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(96, 6, generator=generator)
    y = torch.randint(0, 3, (96,), generator=generator)
    data = TensorDataset(x, y)
    keep = Keep()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=2, logger=False,
                         enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                         callbacks=[keep])
    trainer.fit(Logged(), DataLoader(data, batch_size=8), DataLoader(data, batch_size=12))
    if trainer.global_rank == 0:
        torch.save({"epochs": keep.epochs, "last": dict(trainer.callback_metrics)}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
