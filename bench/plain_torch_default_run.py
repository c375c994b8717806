"""The default run (configs/fashion_mnist.yaml) written in plain PyTorch, the
baseline of bench_trainer's end-to-end row (issue 14): the same CNN
(model.channels, model.convs_per_block and model.hidden read from that
config: 3x3 conv + batch norm + ReLU layers, 2x2 max pooling a block, then
the dense layers), Fashion-MNIST normalised by
the training set's mean and std, 2 processes of torch DistributedDataParallel
over gloo, a global batch of 128 (64 per process), torch.optim.AdamW
(fused=True) at the config's optimizer.lr with its weight decay on weight
matrices only, a linear warm-up over schedule.warmup_steps then cosine decay
to 0 (batch, rates, warm-up and epochs read from the config too), the data order
a per-epoch permutation from the seed, torch.autocast when the precision is
mixed (F.cross_entropy in float32 either way, as the trainer's float32 head
and loss), intra-op threads = cores / processes. Prints one JSON line:
{"precision", "accuracy", "test_loss", "wall_s", "train_s"}.

    python bench/plain_torch_default_run.py [--precision float32|mixed_bfloat16] [--epochs N]
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python"))

FASHION = Path(os.environ.get("FUSETRAIN_FASHION_MNIST", "/usr/share/datasets/fashion-mnist"))


def default_config() -> dict:
    import yaml

    return yaml.safe_load((HERE.parent / "configs" / "fashion_mnist.yaml").read_text())


# The recipe's numbers, read from the trainer's default config.
_CFG = default_config()
BATCH, LR, WD = _CFG["data"]["batch_size"], _CFG["optimizer"]["lr"], _CFG["optimizer"]["weight_decay"]
WARMUP, WORLD = _CFG["schedule"]["warmup_steps"], _CFG["runtime"]["nproc"]


def default_cnn() -> torch.nn.Module:
    """The default run's CNN as a plain nn.Module, built from the model section
    of configs/fashion_mnist.yaml by fusetrain.load_checkpoint (the trainer's
    models rebuilt in Python)."""
    from fusetrain.load_checkpoint import build_model

    return build_model(_CFG)


def idx(name: str) -> torch.Tensor:
    raw = gzip.open(FASHION / name).read()
    ndim = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return torch.from_numpy(np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).copy()).view(*shape)


def data():
    train = idx("train-images-idx3-ubyte.gz").double().div_(255)
    mean, std = train.mean().item(), train.std().item()
    norm = lambda x: ((x.double().div(255) - mean) / std).float().unsqueeze(1)  # noqa: E731
    return (norm(idx("train-images-idx3-ubyte.gz")), idx("train-labels-idx1-ubyte.gz").long(),
            norm(idx("t10k-images-idx3-ubyte.gz")), idx("t10k-labels-idx1-ubyte.gz").long())


def worker(rank: int, init: str, precision: str, epochs: int, out: str) -> None:

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // WORLD))
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    x, y, xt, yt = data()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(default_cnn())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}],
                            lr=LR, fused=True)
    steps_per_epoch = x.shape[0] // BATCH
    total = epochs * steps_per_epoch
    mixed = precision == "mixed_bfloat16"
    dist.barrier()
    t0 = time.perf_counter()
    step = 0
    for epoch in range(epochs):
        perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(epoch))
        for s in range(steps_per_epoch):
            lr = LR * (step + 1) / WARMUP if step < WARMUP else \
                LR * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - WARMUP) / max(1, total - WARMUP))))
            for g in opt.param_groups:
                g["lr"] = lr
            idx_ = perm[s * BATCH + rank * (BATCH // WORLD): s * BATCH + (rank + 1) * (BATCH // WORLD)]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
                logits = model(x[idx_])
            loss = F.cross_entropy(logits.float(), y[idx_])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
    train_s = time.perf_counter() - t0
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
        half = xt.shape[0] // WORLD
        lo, hi = rank * half, (rank + 1) * half
        logits = model.module(xt[lo:hi]).float()
        sums = torch.tensor([F.cross_entropy(logits, yt[lo:hi], reduction="sum").item(),
                             (logits.argmax(1) == yt[lo:hi]).sum().item(), hi - lo], dtype=torch.float64)
    dist.all_reduce(sums)
    if rank == 0:
        Path(out).write_text(json.dumps({"accuracy": sums[1].item() / sums[2].item(),
                                         "test_loss": sums[0].item() / sums[2].item(), "train_s": train_s}))
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precision", default="float32", choices=("float32", "mixed_bfloat16"))
    ap.add_argument("--epochs", type=int, default=_CFG["train"]["epochs"])
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        t0 = time.perf_counter()
        mp.spawn(worker, args=(f"file://{tmp}/rendezvous", args.precision, args.epochs, out), nprocs=WORLD)
        wall = time.perf_counter() - t0
        r = json.loads(Path(out).read_text())
    print(json.dumps({"precision": args.precision, **r, "wall_s": wall}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
