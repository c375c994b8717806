"""Hugging Face Accelerate with fusetrain's FusedAdamW: an MLP learns labels
made by a fixed random teacher, with mixed precision, clipping and a
checkpoint saved and restored through Accelerate.

    python examples/accelerate_train.py                            # one process
    accelerate launch examples/accelerate_train.py                 # the GPUs of `accelerate config`
    torchrun --nproc_per_node 2 examples/accelerate_train.py --cpu # 2 CPU processes
    python examples/accelerate_train.py --precision fp16           # fp16 + fusetrain's loss scaler, CPU too

Needs ``pip install "fusetrain[accelerate]"``.
"""

import argparse
import gc

import torch
import torch.nn.functional as F
from accelerate import Accelerator

import fusetrain
from fusetrain.integrations import use_grad_scaler

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--precision", choices=["bf16", "fp16", "no"], default="bf16")
parser.add_argument("--cpu", action="store_true", help="train on the CPU even where a GPU is visible")
parser.add_argument("--steps", type=int, default=300, help="per process")
parser.add_argument("--width", type=int, default=512)
parser.add_argument("--output-dir", default="accelerate_checkpoint", help="where save_state writes (shared by the ranks)")
args = parser.parse_args()


def main(checkpoint: str):
    accelerator = Accelerator(mixed_precision=args.precision, cpu=args.cpu)
    if args.precision == "fp16":
        # Accelerate trains fp16 runs of a CPU in float32; this makes them fp16
        # with fusetrain's loss scaler (on a GPU it replaces torch's scaler).
        use_grad_scaler(accelerator)

    torch.manual_seed(0)
    x = torch.randn(args.steps * 32 * accelerator.num_processes, 64)  # `steps` batches a process
    y = (x @ torch.randn(64, 10)).argmax(1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, args.width), torch.nn.ReLU(),
        torch.nn.Linear(args.width, args.width), torch.nn.ReLU(),
        torch.nn.Linear(args.width, 10),
    )
    optimizer = fusetrain.optim.FusedAdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    losses = []
    for xb, yb in loader:
        loss = F.cross_entropy(model(xb), yb)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()  # the scaler, if any, hands FusedAdamW the scale: no host sync
        optimizer.zero_grad()
        losses.append(loss.detach())
    accelerator.save_state(checkpoint)  # model, FusedAdamW's state, scaler, RNGs
    accelerator.wait_for_everyone()     # rank 0 writes the model and optimizer files
    accelerator.load_state(checkpoint)

    tenth = max(1, len(losses) // 10)
    first = accelerator.reduce(torch.stack(losses[:tenth]).mean(), "mean")
    last = accelerator.reduce(torch.stack(losses[-tenth:]).mean(), "mean")
    accelerator.print(f"accelerate ({args.precision}, {accelerator.num_processes} processes): "
                      f"loss {float(first):.4f} -> {float(last):.4f}")
    group = torch.distributed.group.WORLD  # None in a single process
    accelerator.end_training()
    return group


if __name__ == "__main__":
    group = main(args.output_dir)
    # torch's DDP holds the process group from C++ and lets go of it with the
    # GIL held; a gloo worker still dropping a finished collective's tensor
    # needs the GIL, so the group's last release must not happen there, nor in
    # the interpreter's exit (pytorch/pytorch#190489). The prepared model sits
    # in reference cycles: collect it while we still hold the group, then drop
    # the group from Python, whose release joins gloo's threads without the GIL.
    gc.collect()
    del group
