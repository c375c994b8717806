"""A user's data-parallel training script, as torchrun runs it (issue 12).

fusetrain's three drop-ins with one changed import each:
``fusetrain.parallel.DistributedDataParallel``, ``fusetrain.amp.GradScaler``
and ``fusetrain.optim.FusedAdamW``, in bfloat16 autocast on the CPU over
gloo. Every rank takes its slice of a global batch that depends only on the
step, so any placement of the same world size (one host or several) must
end with the same parameters bit for bit; rank 0 saves them to ``--out``.

    torchrun --nproc-per-node 2 --standalone multihost_train.py --out final.pt
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from fusetrain.amp import GradScaler
from fusetrain.optim import FusedAdamW
from fusetrain.parallel import DistributedDataParallel

GLOBAL_BATCH = 32
FEATURES, CLASSES = 24, 5


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert GLOBAL_BATCH % world == 0, "the world size must divide the global batch"
    per_rank = GLOBAL_BATCH // world

    torch.manual_seed(0)  # the same initial model everywhere (DDP broadcasts rank 0's anyway)
    model = nn.Sequential(nn.Linear(FEATURES, 48), nn.GELU(), nn.Linear(48, CLASSES))
    ddp = DistributedDataParallel(model)
    opt = FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    data = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        x = torch.randn(GLOBAL_BATCH, FEATURES, generator=data)
        y = torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=data)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(ddp(x[mine]), y[mine])
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "scaler": scaler.state_dict(), "world": world,
                    "hosts": os.environ.get("GROUP_WORLD_SIZE")}, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
