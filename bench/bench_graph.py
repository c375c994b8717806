"""Step fusion: ``fusetrain.fuse_steps`` (K training steps per execution, one
CUDA graph replay on a GPU) against the same step function called in a plain
Python loop, side by side on the same batches.

The step: ``fusetrain.amp.autocast("mixed_bfloat16")`` forward, the fused
softmax cross-entropy (``fusetrain.nn.functional``), backward, a
``FusedAdamW`` step, ``zero_grad(set_to_none=False)``; bf16 needs no loss
scaling, so there is no GradScaler. The autocast weight-cast cache is off
on both sides (torch's advice for CUDA graphs; every weight is cast once a
step either way). Every variant trains its own copy of the
same initial model. The K batches are staged on the device once (static
shapes, reused), so no data loading is measured; a fused execution still
copies its K batches into the graph's static inputs, as it does in training.

1. Launch-bound: an MLP of 4 Linear layers 256 wide (256 -> 256 -> 256 ->
   256 -> 10 classes), batch 64. Per-step time of the eager loop and of
   ``fuse_steps`` with K = 1, 4, 16. Goal on CUDA: K=16 at least 3x faster
   per step than eager.
2. Device-bound: an MLP of 4 Linear layers, 1024 -> 8192 -> 8192 -> 8192 ->
   1024 classes (151M params), batch 8192: 6 x 151M x 8192 = 7.4 TFLOP a
   step, over 10 ms on an H200, against well under 1 ms of host work. K=4
   against eager; goal on CUDA: within 2% (ratio >= 0.98): a graph must cost
   nothing when the GPU, not the host, sets the pace. The CPU runs a much
   smaller MLP (width 512, batch 32).

Timing: a window of W steps (the same W for every variant of a comparison:
W/K executions of a fused variant, W calls of the eager step) is one timed
call; the device is synchronised before the window (untimed) and once at its
end (timed), and the wall clock is read on the host. CUDA events would not
do: when the variant before left work queued on the GPU, an eager window's
start event fires late while the host has already issued part of its
launches, hiding exactly the host overhead this benchmark is about. Variants
alternate window by window after their warm-up (which covers fuse_steps'
eager warm-up executions and the capture); per-step time is the median
window over W. On the CPU there are no CUDA graphs: ``fuse_steps`` runs its K
steps back to back, so ~1.0x is the expected result and these rows are smoke
figures for the code path (the goals apply to CUDA).
"""

from __future__ import annotations

import copy
import time
from typing import Callable, Dict, List, Union

import torch
import torch.nn.functional as F

import fusetrain
import fusetrain.amp
import fusetrain.nn.functional
import fusetrain.optim
from common import Context, guarded, median, release, result, spread, synchronize

NAME = "graph"

POLICY = "mixed_bfloat16"
SMALL_GOAL = 3.0  # CUDA: K=16 at least 3x the eager loop per step
LARGE_GOAL = 0.98  # CUDA: a device-bound step within 2% of eager
SMALL_KS = (1, 4, 16)
LARGE_K = 4
EAGER_WARMUP = 2  # windows

# (input features, hidden widths, classes, batch, steps per timed window)
SMALL = {"cuda": (256, [256, 256, 256], 10, 64, 64), "cpu": (256, [256, 256, 256], 10, 64, 16)}
LARGE = {"cuda": (1024, [8192, 8192, 8192], 1024, 8192, 8), "cpu": (256, [512, 512, 512], 256, 32, 4)}


# ------------------------------------------------------------------ timing


def timed_windows(
    fns: Dict[str, Callable[[], object]],
    ctx: Context,
    *,
    repeats: int,
    warmup: Union[int, Dict[str, int]] = 1,
    setup: Dict[str, Callable[[], object]] = None,
) -> Dict[str, List[float]]:
    """Wall-clock seconds of each call of each variant, interleaved call by
    call (A, B, C, A, B, C, ...). Before each call ``setup[name]`` (if any)
    runs and the device is synchronised, both untimed; the clock stops after
    a synchronisation at the end of the call, so everything the call issued
    (host work and device work) is inside it. ``warmup``: untimed calls per
    variant first (one count for all, or a dict by name)."""
    setup = setup or {}
    counts = warmup if isinstance(warmup, dict) else {name: warmup for name in fns}
    for name, fn in fns.items():
        for _ in range(counts.get(name, 0)):
            if name in setup:
                setup[name]()
            fn()
    synchronize(ctx.device)
    times: Dict[str, List[float]] = {name: [] for name in fns}
    clock = time.perf_counter
    for _ in range(repeats):
        for name, fn in fns.items():
            if name in setup:
                setup[name]()
            synchronize(ctx.device)
            t0 = clock()
            fn()
            synchronize(ctx.device)
            times[name].append(clock() - t0)
    return times


# ------------------------------------------------------------------- loss


def pick_loss(device: torch.device):
    """``(loss_fn, name)``: fusetrain's fused softmax cross-entropy when a
    forward + backward of it on ``device`` runs and agrees with
    ``F.cross_entropy``, else ``F.cross_entropy`` (the row notes say which)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 37, generator=g).to(device).requires_grad_()
    target = torch.randint(0, 37, (16,), generator=g).to(device)
    try:
        loss = fusetrain.nn.functional.softmax_cross_entropy(logits, target)
        loss.backward()
        ref = F.cross_entropy(logits.detach(), target)
        if torch.allclose(loss.detach().float(), ref, rtol=1e-4, atol=1e-5):
            return fusetrain.nn.functional.softmax_cross_entropy, "fusetrain fused cross-entropy"
        reason = "disagrees with F.cross_entropy"
    except Exception as e:  # noqa: BLE001  (the benchmark goes on with torch's loss)
        reason = f"{type(e).__name__}"
    return F.cross_entropy, f"F.cross_entropy (fused cross-entropy unavailable here: {reason})"


# ------------------------------------------------------------------ models


def mlp(features: int, widths: List[int], classes: int) -> torch.nn.Sequential:
    layers, d = [], features
    for w in widths:
        layers += [torch.nn.Linear(d, w), torch.nn.ReLU()]
        d = w
    layers.append(torch.nn.Linear(d, classes))
    return torch.nn.Sequential(*layers)


def make_step(model: torch.nn.Module, loss_fn, device_type: str):
    """One training step with the given model; returns the detached loss."""
    opt = fusetrain.optim.FusedAdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

    def step(x, y):
        with fusetrain.amp.autocast(POLICY, device_type=device_type):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # static gradient buffers for the graph
        return loss.detach()

    return step


def staged_batches(ctx: Context, n: int, batch: int, features: int, classes: int) -> list:
    """``n`` static-shape batches generated once on the device."""
    g = torch.Generator(device=ctx.device).manual_seed(1)
    return [
        (
            torch.randn(batch, features, device=ctx.device, generator=g),
            torch.randint(0, classes, (batch,), device=ctx.device, generator=g),
        )
        for _ in range(n)
    ]


def variants(ctx: Context, spec, ks, loss_fn, n_batches: int):
    """Window callables: "eager" and "K=k" for each k in ``ks``, each with its
    own copy of one initial model; plus the fused objects and the window."""
    features, widths, classes, batch, window = spec
    torch.manual_seed(0)
    base = mlp(features, widths, classes).to(ctx.device)
    batches = staged_batches(ctx, n_batches, batch, features, classes)
    order = [batches[i % n_batches] for i in range(window)]  # the window's steps, same for all
    dev = ctx.device.type

    eager_step = make_step(copy.deepcopy(base), loss_fn, dev)

    def eager():
        for x, y in order:
            eager_step(x, y)

    fns, fused = {"eager": eager}, {}
    for k in ks:
        assert window % k == 0
        f = fusetrain.fuse_steps(make_step(copy.deepcopy(base), loss_fn, dev), order[0], steps_per_execution=k)
        chunks = [order[i:i + k] for i in range(0, window, k)]

        def run_fused(f=f, chunks=chunks):
            for c in chunks:
                f(c)

        fns[f"K={k}"] = run_fused
        fused[f"K={k}"] = f
    params = sum(p.numel() for p in base.parameters())
    del base
    return fns, fused, window, batch, params


def warmup_windows(ctx: Context, window: int, fused) -> int:
    """Windows that take a fused variant past its eager warm-up executions
    (fuse_steps' default: at least 11 eager steps and 2 executions) and its
    capture, plus one window of replays (on CUDA; on the CPU there is nothing
    to capture and one window warms up)."""
    if not ctx.is_cuda:
        return 1
    steps = (fused.warmup_executions + 1) * fused.steps_per_execution  # + the capturing one
    return -(-steps // window) + 1


def check_captured(ctx: Context, fused: dict) -> None:
    if not ctx.is_cuda:
        return
    missing = [name for name, f in fused.items() if not f.captured]
    if missing:
        raise RuntimeError(f"fuse_steps did not capture a CUDA graph for {missing} during warm-up")


# ----------------------------------------------------------------- benches


def per_step(times: List[float], window: int) -> List[float]:
    return [t / window for t in times]


def step_row(title: str, ctx: Context, steps: Dict[str, List[float]], name: str, unit: str, goal, notes: str,
             **extra) -> dict:
    """A row of per-step times: variant ``name`` against "eager", in ``unit``
    (us or ms), lower is better."""
    scale = {"us": 1e6, "ms": 1e3}[unit]
    ours, theirs = median(steps[name]) * scale, median(steps["eager"]) * scale
    return result(
        title, ours=ours, torch_=theirs, unit=unit, higher_is_better=False, goal=goal, notes=notes,
        times={"ours": steps[name], "torch": steps["eager"]},
        best_ours=min(steps[name]) * scale, best_torch=min(steps["eager"]) * scale,
        spread_ours=spread(steps[name]), spread_torch=spread(steps["eager"]),
        policy=POLICY, cuda_graph=ctx.is_cuda, **extra,
    )


def bench_small(ctx: Context, loss_fn, loss_name: str) -> list:
    spec = SMALL[ctx.device.type]
    fns, fused, window, batch, params = variants(ctx, spec, SMALL_KS, loss_fn, max(SMALL_KS))
    warm = {name: warmup_windows(ctx, window, fused[name]) if name != "eager" else EAGER_WARMUP for name in fns}
    repeats = max(5, ctx.repeats // 2) if ctx.is_cuda else (3 if ctx.quick else 6)
    times = timed_windows(fns, ctx, repeats=repeats, warmup=warm)
    check_captured(ctx, fused)
    steps = {name: per_step(t, window) for name, t in times.items()}
    features, widths, classes = spec[0], spec[1], spec[2]
    shape = f"MLP {features}-{'-'.join(map(str, widths))}-{classes} ({params / 1e3:.0f}K params), batch {batch}"
    rows = []
    for k in SMALL_KS:
        name = f"K={k}"
        goal = SMALL_GOAL if (ctx.is_cuda and k == max(SMALL_KS)) else None
        where = (
            "CUDA graph replay per execution"
            if ctx.is_cuda
            else "CPU smoke: no CUDA graph on the CPU, the K steps run back to back (~1.0x expected; "
            f"the {SMALL_GOAL:g}x goal for K={max(SMALL_KS)} is a CUDA goal)"
        )
        rows.append(
            step_row(
                f"fuse_steps K={k} vs eager loop, small MLP {POLICY}", ctx, steps, name, "us", goal,
                (
                    f"per-step time; {shape}, FusedAdamW, {loss_name}; ours fuse_steps(K={k}), "
                    f"'torch' = the same step in a Python loop; {window}-step windows, device synced at "
                    f"each window's end, median of {repeats}; {where}"
                ),
                steps_per_execution=k, window_steps=window, batch=batch, params=params, repeats=repeats,
            )
        )
    del fns, fused
    release(ctx)
    return rows


def bench_large(ctx: Context, loss_fn, loss_name: str) -> list:
    spec = LARGE[ctx.device.type]
    fns, fused, window, batch, params = variants(ctx, spec, (LARGE_K,), loss_fn, LARGE_K)
    name = f"K={LARGE_K}"
    warm = {"eager": EAGER_WARMUP, name: warmup_windows(ctx, window, fused[name])}
    repeats = max(5, ctx.repeats // 4) if ctx.is_cuda else (3 if ctx.quick else 6)
    times = timed_windows(fns, ctx, repeats=repeats, warmup=warm)
    check_captured(ctx, fused)
    steps = {n: per_step(t, window) for n, t in times.items()}
    features, widths, classes = spec[0], spec[1], spec[2]
    shape = f"MLP {features}-{'x'.join(map(str, widths))}-{classes} ({params / 1e6:.0f}M params), batch {batch}"
    where = (
        "device-bound: goal within 2% of eager (ratio >= 0.98)"
        if ctx.is_cuda
        else "CPU smoke at a small size: no CUDA graph on the CPU (~1.0x expected; the 2% goal is a CUDA goal)"
    )
    row = step_row(
        f"fuse_steps K={LARGE_K} vs eager loop, large MLP {POLICY}", ctx, steps, name, "ms",
        LARGE_GOAL if ctx.is_cuda else None,
        (
            f"per-step time; {shape}, FusedAdamW, {loss_name}; {window}-step windows, device synced at "
            f"each window's end, median of {repeats}; {where}"
        ),
        steps_per_execution=LARGE_K, window_steps=window, batch=batch, params=params, repeats=repeats,
    )
    del fns, fused
    release(ctx)
    return [row]


def run(ctx: Context) -> list:
    loss_fn, loss_name = pick_loss(ctx.device)
    # No autocast weight-cast cache (torch's advice for CUDA graphs), on both
    # sides; each weight is cast once per step anyway.
    cache = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        rows = guarded(ctx, f"fuse_steps vs eager loop, small MLP {POLICY}", bench_small, loss_fn, loss_name)
        rows += guarded(ctx, f"fuse_steps K={LARGE_K} vs eager loop, large MLP {POLICY}", bench_large,
                        loss_fn, loss_name)
    finally:
        torch.set_autocast_cache_enabled(cache)
    return rows
