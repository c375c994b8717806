"""Drop-in: a plain PyTorch AMP + DDP training script whose torch classes
become fusetrain's by one switch. The imports below are the only lines that
differ; the training loop is the one every torch AMP tutorial writes.

    torchrun --nproc_per_node 2 examples/python/drop_in.py              # torch
    torchrun --nproc_per_node 2 examples/python/drop_in.py --fusetrain  # fusetrain
    python examples/python/drop_in.py --fusetrain                       # one process

CPU ranks talk through gloo, or with --fusetrain through the "fusetrain"
backend (gloo plus a shared-memory allreduce between ranks on one host);
CUDA ranks through NCCL. An MLP learns labels made by a fixed random
teacher; each rank draws its own batches.
"""

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--fusetrain", action="store_true", help="use fusetrain's classes instead of torch's")
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--batch", type=int, default=128, help="per rank")
parser.add_argument("--width", type=int, default=512)
parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16",
                    help="autocast dtype; the GradScaler is on for float16")
args = parser.parse_args()

if args.fusetrain:
    from fusetrain.amp import GradScaler
    from fusetrain.nn.functional import cross_entropy
    from fusetrain.optim import FusedAdamW as AdamW
    from fusetrain.parallel import DistributedDataParallel
    from fusetrain.utils import clip_grad_norm_

    CPU_BACKEND = "fusetrain"  # registered by importing fusetrain.parallel
else:
    from torch.amp import GradScaler
    from torch.nn.functional import cross_entropy
    from torch.nn.parallel import DistributedDataParallel
    from torch.nn.utils import clip_grad_norm_
    from torch.optim import AdamW

    CPU_BACKEND = "gloo"


def main() -> None:
    distributed = "RANK" in os.environ  # set by torchrun
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if distributed:
        dist.init_process_group("nccl" if device.type == "cuda" else CPU_BACKEND)
    rank = dist.get_rank() if distributed else 0
    dtype = getattr(torch, args.dtype)

    torch.manual_seed(0)  # the same model and teacher on every rank
    teacher = torch.randn(64, 10, device=device)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, args.width), torch.nn.ReLU(),
        torch.nn.Linear(args.width, args.width), torch.nn.ReLU(),
        torch.nn.Linear(args.width, 10),
    ).to(device)
    if distributed:
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = GradScaler(device.type, enabled=dtype == torch.float16)
    data = torch.Generator(device).manual_seed(1 + rank)

    losses, start = [], time.perf_counter()
    for step in range(args.steps):
        x = torch.randn(args.batch, 64, device=device, generator=data)
        y = (x @ teacher).argmax(1)
        with torch.autocast(device.type, dtype=dtype):
            loss = cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    seconds = time.perf_counter() - start

    # Rank-averaged losses of the first and last tenth of the run.
    tenth = max(1, args.steps // 10)
    summary = torch.stack([torch.stack(losses[:tenth]).mean(), torch.stack(losses[-tenth:]).mean()]).float()
    if distributed:
        dist.all_reduce(summary)
        summary /= dist.get_world_size()
    if rank == 0:
        first, last = summary.tolist()
        which = "fusetrain" if args.fusetrain else "torch"
        print(f"{which}: loss {first:.4f} -> {last:.4f}, {args.steps / seconds:.1f} steps/s, "
              f"scale {scaler.get_scale():g}")
    if distributed:
        # The DDP model holds the group: let it go first, while the group is
        # still registered. Left to the interpreter's exit, torch's DDP frees
        # it with the GIL held and a gloo worker that needs the GIL to drop the
        # all_reduce's tensor aborts the process (pytorch/pytorch#56297).
        del model
        gc.collect()  # DDP sits in reference cycles
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
