"""PyTorch Lightning (issue 39): a LightningModule trained by
``strategy="fusetrain_ddp"`` + ``FusetrainPrecision("bf16-mixed")`` +
``fusetrain.optim.FusedAdamW`` against Lightning's own ``strategy="ddp"`` +
``precision="bf16-mixed"`` + ``torch.optim.AdamW``, side by side in the same
processes on the same model and data.

CPU (``--device cpu``): 2 ranks on loopback, one thread each; GPU
(``--device cuda``): one rank (NCCL refuses two ranks on one GPU), the same
rows. The model is an MLP (1024-1024-1024-1024-10 on the CPU, 3.16M
parameters; 4096 wide on a GPU), batch 64 a rank (1024 on a GPU),
cross-entropy. Each variant runs whole ``Trainer.fit`` calls (its own
Trainer, a fresh copy of the same initial model, the same batches), in
alternating order, round after round: a fit's first steps are warm-up, then
a callback on rank 0 times a window of steps (from one
``on_train_batch_end`` to another: data, forward, backward, reduction,
optimizer step and Lightning's own hooks). Per-step time = median window /
window length; the ratio is steps/s ours over Lightning's (goal: 1.1x).

Both variants keep the default process group (gloo on the CPU) for
Lightning's own collectives and reduce their gradients over a group of
their own made once: "fusetrain" (shared memory) for ours, gloo for
Lightning's (its default on the CPU), NCCL on a GPU; they reach the
strategies as DDP's ``process_group`` argument.

    .venv/bin/python bench/run.py --only lightning            # ~1-2 min on 2 cores
    .venv/bin/python bench/run.py --only lightning --quick    # smoke size
"""

from __future__ import annotations

import copy
import logging
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from bench_ddp import error_row, launch_workers, worker_main  # noqa: E402
from common import Context, _cpu_model, result  # noqa: E402

NAME = "lightning"

STEP_GOAL = 1.1  # issue 39: fusetrain_ddp + FusetrainPrecision >= 1.1x Lightning's ddp + bf16-mixed
LR = 1e-3


def _sizes(device: str, quick: bool) -> dict:
    if device == "cuda":
        return dict(width=4096, depth=4, batch=1024, warmup=5, window=20, rounds=3 if quick else 6)
    if quick:
        return dict(width=256, depth=3, batch=32, warmup=2, window=4, rounds=2)
    return dict(width=1024, depth=4, batch=64, warmup=3, window=10, rounds=6)


# ====================================================================== parent


def run(ctx: Context) -> list:
    world = 1 if ctx.is_cuda else 2
    name = f"lightning step, fusetrain_ddp vs ddp, bf16-mixed, {world} rank(s)"
    try:
        import lightning  # noqa: F401
    except ImportError:
        return [error_row(name, 'PyTorch Lightning is not installed: pip install "fusetrain[lightning]"', unit="steps/s")]
    mode = "gpu" if ctx.is_cuda else "cpu"
    try:
        found = launch_workers(world, mode, ctx, script=Path(__file__), deadline_s=600.0)
    except Exception as e:  # noqa: BLE001 - a failing benchmark must not stop the suite
        return [error_row(name, f"{type(e).__name__}: {e}", unit="steps/s")]
    ours, theirs = found["step_s"]["ours"], found["step_s"]["lightning"]
    s = found["sizes"]
    where = found["gpu"] or f"{_cpu_model()}, {world} ranks x {found['threads_per_rank']} thread(s)"
    notes = (
        f"MLP {s['width']}x{s['depth']} ({found['nparams'] / 1e6:.2f}M params), batch {s['batch']}/rank, "
        f"{where}; ours FusedAdamW + fusetrain DDP over {found['backend']}, Lightning torch AdamW + torch DDP "
        f"over {found['lightning_backend']}; median of {s['rounds']} windows of {s['window']} steps after "
        f"{s['warmup']} warm-up each, variants alternating; final loss ours {found['loss']['ours']:.4f}, "
        f"Lightning {found['loss']['lightning']:.4f}"
    )
    return [
        result(
            name,
            ours=1.0 / statistics.median(ours),
            torch_=1.0 / statistics.median(theirs),
            unit="steps/s",
            higher_is_better=True,
            goal=STEP_GOAL,
            notes=notes,
            times={"ours": ours, "torch": theirs},
            world=world,
            threads_per_rank=found["threads_per_rank"],
            step_s=found["step_s"],
        )
    ]


# ====================================================================== worker


def _model(width: int, depth: int) -> nn.Module:
    layers, d = [], width
    for _ in range(depth - 1):
        layers += [nn.Linear(d, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def _worker(ctx: Context, rank: int, world: int, arg: str) -> dict:
    import warnings

    import lightning.pytorch as pl
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    import fusetrain.optim
    from fusetrain.lightning import FusetrainDDPStrategy, FusetrainPrecision

    warnings.filterwarnings("ignore", message=r".*(num_workers|does not have many workers|LeafSpec).*")
    for logger in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(logger).setLevel(logging.ERROR)
    sizes = _sizes(ctx.device.type, ctx.quick)
    gpu = ctx.device.type == "cuda"
    backends = {"ours": "nccl" if gpu else "fusetrain", "lightning": "nccl" if gpu else "gloo"}
    groups = {k: dist.new_group(backend=b) for k, b in backends.items()}

    torch.manual_seed(0)
    base = _model(sizes["width"], sizes["depth"])
    steps = sizes["warmup"] + sizes["window"]
    g = torch.Generator().manual_seed(1)
    n = steps * sizes["batch"] * world
    x = torch.randn(n, sizes["width"], generator=g)
    y = torch.randint(0, 10, (n,), generator=g)

    class Module(pl.LightningModule):
        def __init__(self, fused: bool):
            super().__init__()
            self.net = copy.deepcopy(base)
            self.fused = fused
            self.last_loss = None

        def training_step(self, batch, batch_idx):
            loss = F.cross_entropy(self.net(batch[0]), batch[1])
            self.last_loss = loss.detach()
            return loss

        def configure_optimizers(self):
            if self.fused:
                return fusetrain.optim.FusedAdamW(self.parameters(), lr=LR)
            return torch.optim.AdamW(self.parameters(), lr=LR)

    class Window(pl.Callback):
        """Times the steps after the warm-up (host clock; the device is
        synchronised at both ends on a GPU)."""

        def __init__(self):
            self.t0 = self.seconds = None

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx + 1 in (sizes["warmup"], steps):
                if gpu:
                    torch.cuda.synchronize()
                now = time.perf_counter()
                if batch_idx + 1 == sizes["warmup"]:
                    self.t0 = now
                else:
                    self.seconds = (now - self.t0) / sizes["window"]

    def fit(variant: str):
        ours = variant == "ours"
        window = Window()
        if ours:
            strategy = FusetrainDDPStrategy(process_group=groups["ours"])
            extra = dict(plugins=[FusetrainPrecision("bf16-mixed")])
        else:
            strategy = pl.strategies.DDPStrategy(process_group=groups["lightning"])
            extra = dict(precision="bf16-mixed")
        trainer = pl.Trainer(
            accelerator="gpu" if gpu else "cpu", devices=world, strategy=strategy, max_steps=steps,
            callbacks=[window], logger=False, enable_progress_bar=False, enable_model_summary=False,
            enable_checkpointing=False, num_sanity_val_steps=0, **extra,
        )
        module = Module(fused=ours)
        loader = DataLoader(TensorDataset(x, y), batch_size=sizes["batch"], shuffle=False)
        trainer.fit(module, loader)
        return window.seconds, float(module.last_loss)

    times = {"ours": [], "lightning": []}
    losses = {}
    for r in range(sizes["rounds"]):
        order = ("ours", "lightning") if r % 2 == 0 else ("lightning", "ours")
        for variant in order:
            seconds, losses[variant] = fit(variant)
            times[variant].append(seconds)
    return {
        "step_s": times,
        "loss": losses,
        "sizes": sizes,
        "nparams": sum(p.numel() for p in base.parameters()),
        "backend": dist.get_backend(groups["ours"]),
        "lightning_backend": dist.get_backend(groups["lightning"]),
        "gpu": torch.cuda.get_device_name() if gpu else None,
    }


WORKERS = {"cpu": _worker, "gpu": _worker}

if __name__ == "__main__":
    worker_main(sys.argv[1:], WORKERS)
