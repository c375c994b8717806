"""Per-call overhead on small models (issue 14): the whole training step with
fusetrain's pieces (``fusetrain.amp.autocast``, the fused cross-entropy,
``GradScaler``, ``FusedAdamW``) against the same step with torch's own
(``torch.autocast``, ``F.cross_entropy``, ``torch.optim.AdamW(fused=True)``,
no scaler), on models small enough that the calls around the kernels show:

  - the smoke GPT of bench_e2e (2 layers, d_model 64, 2 heads, context 32,
    vocabulary 512), batch 2 x 32 tokens;
  - the Fashion-MNIST CNN of configs/fashion_mnist.yaml (16/32 channels, a
    128-unit layer), batch 128 of 1 x 28 x 28, random images.

Both steps run on copies of one initial model (fusetrain's with its
``nn.MaxPool2d`` layers swapped for ``fusetrain.nn.MaxPool2d``, as a user
swaps them in; same values and gradients), in float32 and in
mixed_bfloat16 (bfloat16 compute; no loss scaling, so fusetrain's disabled
GradScaler is in the loop as a user would leave it). Windows of 10 steps,
interleaved ours / torch, after 2 warm-up windows each; ms per step is the
median window. Goal: ratio >= 1.0 (fusetrain no slower).
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.append(str(HERE.parent / "python"))  # after the environment's own fusetrain (e.g. a TORCH_VERSION build's)

import fusetrain  # noqa: E402
import fusetrain.amp  # noqa: E402
import fusetrain.nn  # noqa: E402
import fusetrain.optim  # noqa: E402
from fusetrain.nn import functional as FF  # noqa: E402

from common import Context, median, result  # noqa: E402

NAME = "small_step"
GOAL = 1.0
WINDOW = 10


def gpt():
    from bench_e2e import GPT

    torch.manual_seed(0)
    model = GPT(2, 64, 2, 32, 512)
    x = torch.randint(0, 512, (2, 32))
    return model, x, torch.randint(0, 512, (2, 32))


def cnn():
    from fusetrain.load_checkpoint import Cnn

    torch.manual_seed(0)
    model = Cnn([1, 28, 28], [16, 32], [128], 0.0, 10)
    return model, torch.randn(128, 1, 28, 28), torch.randint(0, 10, (128,))


def with_fusetrain_pools(model):
    """``model`` with every ``nn.MaxPool2d`` replaced by ``fusetrain.nn.MaxPool2d``
    of the same arguments."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.MaxPool2d:
                setattr(parent, name, fusetrain.nn.MaxPool2d(child.kernel_size, child.stride, child.padding,
                                                             child.dilation, child.return_indices,
                                                             child.ceil_mode))
    return model


def ours_step(model, x, y, policy):
    opt = fusetrain.optim.FusedAdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    scaler = fusetrain.amp.GradScaler("cpu", enabled=False)

    def step():
        with fusetrain.amp.autocast(policy, device_type="cpu"):
            out = model(x)
            loss = FF.softmax_cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return step


def torch_step(model, x, y, policy):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    mixed = policy == "mixed_bfloat16"

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
            out = model(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def windows(fns: dict, n: int) -> dict:
    times = {k: [] for k in fns}
    for i in range(n + 2):
        for k, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(WINDOW):
                f()
            if i >= 2:
                times[k].append((time.perf_counter() - t0) / WINDOW)
    return times


def run(ctx: Context) -> list:
    if ctx.is_cuda:
        return []  # launch-bound GPU steps are bench_e2e's and bench_graph's
    rows = []
    n = 6 if ctx.quick else 15
    for label, make in (("smoke GPT 2L d64, batch 2x32", gpt), ("Fashion-MNIST CNN 16/32/128, batch 128", cnn)):
        for policy in ("float32", "mixed_bfloat16"):
            model, x, y = make()
            fns = {"ours": ours_step(with_fusetrain_pools(copy.deepcopy(model)), x, y, policy),
                   "torch": torch_step(copy.deepcopy(model), x, y, policy)}
            times = windows(fns, n)
            rows.append(result(
                f"small-model step, {label}, {policy}", ours=1e3 * median(times["ours"]),
                torch_=1e3 * median(times["torch"]), unit="ms/step", higher_is_better=False, goal=GOAL,
                times=times,
                notes=(f"{ctx.threads} thread(s), median of {n} windows of {WINDOW} steps; ours = "
                       "fusetrain.amp.autocast + fused cross-entropy + GradScaler(enabled=False) + "
                       "FusedAdamW + fusetrain.nn.MaxPool2d, torch = torch.autocast + F.cross_entropy + "
                       "AdamW(fused=True)")))
    return rows


if __name__ == "__main__":
    import run as harness

    sys.exit(harness.main(["--only", NAME] + sys.argv[1:]))
