"""Float8 training GEMMs: ``fusetrain.amp.Float8Linear`` (e4m3 forward, e5m2
gradients, ``torch._scaled_mm``) against the same ``nn.Linear`` in bf16
autocast, side by side in one process on the same data.

1. ``linear``: one layer, input 8192x4096 (bf16, requires grad), weight
   4096x4096 (fp32 master, bias), forward under
   ``torch.autocast(device, bfloat16)`` then backward with a fixed bf16
   output gradient: ``nn.Linear`` (bf16) against ``Float8Linear.from_linear``
   on the same parameters, "delayed" and "current" scaling. ms per
   forward + backward, TFLOP/s (6 M K N per forward + backward) and the
   relative error of the output and the input gradient against bf16. Then the
   forward GEMM alone: ``torch.matmul`` in bf16 against ``torch._scaled_mm``
   on operands quantised to e4m3 beforehand (scales of 1.0, bf16 out, fast
   accumulation): the float8 ceiling, goal 1.4x on CUDA.
2. ``sweep``: the same forward + backward for square layers K = N in
   {256 ... 8192} at M = 8192 and M = 2048 (``--quick``: M = 8192 alone), one
   row per size, and per M a crossover row: the smallest K = N from which
   float8 (delayed) beats bf16 at that size and every larger one. That is the
   measurement behind ``fusetrain.float8.DEFAULT_FP8_MIN_FEATURES`` (the
   row says whether they agree).
3. ``block``: a "1B-scale" pre-norm GPT block (``bench_e2e.Block``: d_model
   2048, 16 heads, causal SDPA, MLP 4x: qkv 2048->6144, proj 2048->2048, fc
   2048->8192, out 8192->2048) at batch 4 x 2048 tokens, forward + backward,
   ``apply_policy(block, "mixed_bfloat16")`` against
   ``apply_policy(block, "mixed_float8", fp8_min_features=1024, recipe=...)``
   (each on its own copy of one initial block), delayed and current.
4. ``gpt``: the small GPT of ``bench_e2e`` at d_model 1024, 4 layers, 16
   heads, context 512, vocabulary 8192 (tied head), batch 16 x 512 tokens,
   trained 50 steps with ``fusetrain.optim.FusedAdamW`` (lr 1e-3) under each
   policy from the same initial model on the same batches (a learnable
   stream: each token is a fixed random permutation of the one before, the
   first at random, so the loss falls). tokens/s and the final loss
   (mean of the last window) of each policy; float8 (fp8_min_features=1024:
   every block Linear and the head) over bf16.

Timing. Layer and block rows (1-3) use ``common.interleave`` (CUDA events,
variants interleaved call by call after a warm-up, median of repeats; the
block half as many). On CUDA each timed call is preceded, untimed, by a spin
kernel (``torch.cuda._sleep``) twice as long as the host needs to issue the
whole call, so the events measure the GPU's work rather than the host's launch
rate (a float8 Linear issues ~15 small kernels a forward + backward, which
an isolated layer would otherwise expose and a large model's step hides);
the notes give the host's issue time and the prefill. The sweep also times
every size without the prefill ("eager": host included) and reports its
crossover alongside. The GPT rows are whole training steps in windows of 5,
interleaved window by window (``bench_graph.timed_windows``: synchronised
before and after, host clock), as ``bench_e2e`` times them.

Every row's ratio is "times faster than bf16" (bf16 time / float8 time, or
float8 tokens/s over bf16's). Float8 needs CUDA compute capability >= 8.9;
on an older GPU the module prints why and has no rows.

On the CPU (no CUDA) everything runs at smoke sizes (the GEMM row through
torch's CPU ``_scaled_mm``, the layers through their fp32 CPU path; M = K = N = 64, a 64-wide block and GPT, a few calls): rows
marked "(CPU smoke)" that exercise the code paths; the figures mean nothing.

Parts can be skipped: ``bench/bench_fp8.py --skip sweep --skip gpt``
(or ``FUSETRAIN_BENCH_FP8_SKIP=sweep,gpt`` for ``bench/run.py --only fp8``);
``--gpt-steps N`` (``FUSETRAIN_BENCH_FP8_GPT_STEPS``) sets the GPT's steps.
The other flags are ``bench/run.py``'s (``--device cuda``, ``--quick``,
``--results-dir``...); the results go where that harness writes them.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn

import fusetrain
import fusetrain.amp
import fusetrain.optim
from bench_e2e import GPT, Block
from bench_graph import pick_loss, timed_windows
from common import Context, guarded, interleave, median, release, result, spread, synchronize

NAME = "fp8"

PARTS = ("linear", "sweep", "block", "gpt")
SKIP_ENV = "FUSETRAIN_BENCH_FP8_SKIP"
GPT_STEPS_ENV = "FUSETRAIN_BENCH_FP8_GPT_STEPS"
GEMM_GOAL = 1.4  # CUDA: float8 _scaled_mm at least 1.4x the bf16 matmul
RECIPES = ("delayed", "current")
BF16 = "bf16"

# Per device: the shapes of each part.
CONFIG = {
    "cuda": dict(
        linear=(8192, 4096, 4096),  # M, K, N
        sweep_sizes=(256, 512, 1024, 2048, 4096, 8192),
        sweep_ms=(8192, 2048),  # --quick: the first alone
        block=dict(d=2048, heads=16, seq=2048, batch=4, min_features=1024),
        gpt=dict(layers=4, d=1024, heads=16, ctx=512, vocab=8192),
        gpt_batch=16, gpt_steps=50, gpt_quick_steps=30, gpt_window=5, min_features=1024,
    ),
    "cpu": dict(
        linear=(64, 64, 64),
        sweep_sizes=(32, 64),
        sweep_ms=(64,),
        block=dict(d=64, heads=2, seq=32, batch=2, min_features=64),
        gpt=dict(layers=2, d=64, heads=2, ctx=32, vocab=256),
        gpt_batch=2, gpt_steps=6, gpt_quick_steps=6, gpt_window=2, min_features=64,
    ),
}
CPU_WARMUP, CPU_REPEATS = 1, 3  # smoke: a few calls
HOST_SPIN_MS = 40.0  # the spin behind which the host's issue time of a call is measured


# ----------------------------------------------------------------- options


def skipped_parts() -> set:
    raw = os.environ.get(SKIP_ENV, "")
    parts = {p.strip() for p in raw.split(",") if p.strip()}
    unknown = parts - set(PARTS)
    if unknown:
        raise ValueError(f"{SKIP_ENV}: unknown part(s) {sorted(unknown)}; the parts are {', '.join(PARTS)}")
    return parts


def gpt_steps(ctx: Context, cfg: dict) -> int:
    raw = os.environ.get(GPT_STEPS_ENV)
    if raw:
        return max(int(raw), 2 * cfg["gpt_window"])
    return cfg["gpt_quick_steps"] if ctx.quick else cfg["gpt_steps"]


def counts(ctx: Context, whole_step: bool = False):
    """(warm-up, repeats): the harness's, halved for whole-step rows; a few
    calls on the CPU (smoke)."""
    if not ctx.is_cuda:
        return CPU_WARMUP, CPU_REPEATS
    repeats = ctx.repeats
    return ctx.warmup, max(repeats // 2, 4) if whole_step else repeats


def tag(ctx: Context) -> str:
    return "" if ctx.is_cuda else " (CPU smoke)"


def kind(ctx: Context) -> str:
    return ctx.device.type if ctx.is_cuda else "cpu-smoke"


# -------------------------------------------------------------- prefill


class Prefill:
    """Untimed spin kernels that keep the GPU busy while the host issues the
    call that follows them, so the events around that call time the device
    alone. ``for_fns`` measures how long the host takes to issue each
    variant (behind a long spin, on the host clock) and returns a setup that
    spins for twice the longest of them plus 0.5 ms. On the CPU: nothing."""

    def __init__(self, ctx: Context):
        self.ctx = ctx

    def _spin_cycles(self, ms: float) -> int:
        """Cycles of ``torch.cuda._sleep`` that last at least ``ms`` at the
        clock the GPU runs at now (it counts SM clock cycles, and an idle GPU
        clocks down): calibrated on the spot, the fastest of 5 spins."""
        cycles = 1_000_000
        best = float("inf")
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end))
        return int(ms * cycles / best)

    def host_issue_ms(self, fn: Callable[[], object], setup: Optional[Callable[[], object]] = None) -> float:
        """Host milliseconds to issue ``fn`` while the GPU is busy (after one
        untimed call; best of 2). From ``HOST_SPIN_MS`` on, the host waited
        for the device."""
        best = float("inf")
        for i in range(3):
            if setup is not None:
                setup()
            synchronize(self.ctx.device)
            torch.cuda._sleep(int(HOST_SPIN_MS * 2e6))  # >= HOST_SPIN_MS at clocks up to 2 GHz
            t0 = time.perf_counter()
            fn()
            if i:
                best = min(best, (time.perf_counter() - t0) * 1e3)
            synchronize(self.ctx.device)
        return best

    def for_fns(self, fns: Dict[str, Callable[[], object]], setup: Dict[str, Callable[[], object]]):
        """``(setup with the prefill last, host issue ms by name, prefill ms)``;
        on the CPU the setup unchanged, ``{}`` and None."""
        if not self.ctx.is_cuda:
            return setup, {}, None
        host = {name: self.host_issue_ms(fn, setup.get(name)) for name, fn in fns.items()}
        if max(host.values()) > 0.8 * HOST_SPIN_MS:
            # The host waits for the device somewhere in the call: a spin cannot
            # hide that, so time the call as it is.
            return setup, host, None
        prefill_ms = 2.0 * max(host.values()) + 0.5
        cycles = self._spin_cycles(prefill_ms)

        def with_prefill(name):
            before = setup.get(name)

            def fn():
                if before is not None:
                    before()
                torch.cuda._sleep(cycles)

            return fn

        return {name: with_prefill(name) for name in fns}, host, prefill_ms


def tflops(flops: float, ms: float) -> str:
    return f"{flops / ms / 1e9:.3g}"


def millions(n: int) -> str:
    return f"{n / 1e6:.3g}M"


def prefill_note(host: dict, prefill_ms: Optional[float]) -> str:
    if not host:
        return f"CPU smoke: median of {CPU_REPEATS} calls after {CPU_WARMUP} warm-up, no prefill"
    issue = ", ".join(f"{k} {v:.2f}" for k, v in host.items())
    if prefill_ms is None:
        return f"host issue ms {issue}: the host waits on the device, no prefill (host included)"
    return f"device time (queue prefilled {prefill_ms:.1f} ms; host issue ms {issue})"


# --------------------------------------------------------------- linear


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


class LinearCase:
    """One layer's forward + backward: bf16 nn.Linear and Float8Linear
    (delayed, current) on the same parameters and data."""

    def __init__(self, ctx: Context, m: int, k: int, n: int, seed: int = 0):
        self.ctx, self.m, self.k, self.n = ctx, m, k, n
        dev = ctx.device
        g = torch.Generator(device=dev).manual_seed(seed)
        torch.manual_seed(seed)
        self.lin = nn.Linear(k, n, device=dev)
        self.x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16).requires_grad_()
        self.gy = (torch.randn(m, n, device=dev, generator=g) * 1e-2).to(torch.bfloat16)
        self.layers = {BF16: self.lin}
        for r in RECIPES:
            self.layers[r] = fusetrain.amp.Float8Linear.from_linear(self.lin, recipe=r)
        self.flops = 6 * m * k * n

    def zero(self) -> None:
        self.x.grad = None
        self.lin.weight.grad = None
        self.lin.bias.grad = None

    def step(self, name: str):
        layer = self.layers[name]

        def fn():
            with torch.autocast(self.ctx.device.type, dtype=torch.bfloat16):
                y = layer(self.x)
            y.backward(self.gy)
            return y

        return fn

    def errors(self) -> dict:
        """Relative error of each float8 variant's output and input gradient
        against bf16's (after one call each, which seeds the delayed scales)."""
        outs = {}
        for name in self.layers:
            self.zero()
            y = self.step(name)()
            outs[name] = (y.detach(), self.x.grad.detach().clone())
        self.zero()
        ref_y, ref_gx = outs[BF16]
        return {r: (rel_err(outs[r][0], ref_y), rel_err(outs[r][1], ref_gx)) for r in RECIPES}

    def time(self, prefill: Prefill, warmup: int, repeats: int, use_prefill: bool = True):
        fns = {name: self.step(name) for name in self.layers}
        setup = {name: self.zero for name in fns}
        host, prefill_ms = {}, None
        if use_prefill:
            setup, host, prefill_ms = prefill.for_fns(fns, setup)
        times = interleave(fns, self.ctx, setup=setup, warmup=warmup, repeats=repeats)
        self.zero()
        return times, host, prefill_ms


def linear_rows(ctx: Context, prefill: Prefill) -> list:
    cfg = CONFIG[ctx.device.type]
    m, k, n = cfg["linear"]
    warmup, repeats = counts(ctx)
    case = LinearCase(ctx, m, k, n)
    errs = case.errors()
    times, host, prefill_ms = case.time(prefill, warmup, repeats)
    shape = f"{m}x{k}x{n}"
    bf16_ms = median(times[BF16]) * 1e3
    rows = []
    for r in RECIPES:
        ms = median(times[r]) * 1e3
        fwd_err, grad_err = errs[r]
        rows.append(result(
            f"fp8 linear fwd+bwd {shape}, {r} vs bf16{tag(ctx)}", ours=ms, torch_=bf16_ms, unit="ms",
            higher_is_better=False,
            notes=(f"{tflops(case.flops, ms)} vs {tflops(case.flops, bf16_ms)} TFLOP/s (6MKN); "
                   f"rel err vs bf16: out {fwd_err:.2g}, grad_in {grad_err:.2g}; Float8Linear.from_linear, "
                   f"{r} scaling, vs nn.Linear under bf16 autocast; input {m}x{k} bf16, weight {n}x{k} fp32 + "
                   f"bias; {prefill_note(host, prefill_ms)}"),
            times={"ours": times[r], "torch": times[BF16]}, m=m, k=k, n=n, recipe=r,
            tflops_fp8=case.flops / ms / 1e9, tflops_bf16=case.flops / bf16_ms / 1e9,
            spread_ours=spread(times[r]), spread_torch=spread(times[BF16]), rel_err_out=fwd_err,
            rel_err_grad_input=grad_err, host_issue_ms=host or None, prefill_ms=prefill_ms,
            repeats=repeats, warmup=warmup, device_kind=kind(ctx)))
    del case
    release(ctx)
    rows.append(gemm_row(ctx, m, k, n, warmup, repeats))
    return rows


def gemm_row(ctx: Context, m: int, k: int, n: int, warmup: int, repeats: int) -> dict:
    """The forward GEMM alone: bf16 torch.matmul(x, W^T) against
    torch._scaled_mm on e4m3 operands quantised beforehand (scales 1.0)."""
    dev = ctx.device
    g = torch.Generator(device=dev).manual_seed(1)
    a = torch.randn(m, k, device=dev, generator=g)
    w = torch.randn(n, k, device=dev, generator=g)
    a16, w16 = a.to(torch.bfloat16), w.to(torch.bfloat16)
    a8 = a.to(torch.float8_e4m3fn)
    b8 = w.to(torch.float8_e4m3fn).t()  # [k, n], column-major as _scaled_mm wants
    one = torch.ones((), device=dev, dtype=torch.float32)
    del a, w
    fns = {
        "ours": lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                         use_fast_accum=True),
        "torch": lambda: torch.matmul(a16, w16.t()),
    }
    err = rel_err(fns["ours"](), torch.matmul(a8.to(torch.bfloat16), b8.to(torch.bfloat16)))
    times = interleave(fns, ctx, warmup=warmup, repeats=repeats)
    flops = 2 * m * k * n
    rate = {name: flops / median(t) / 1e12 for name, t in times.items()}
    cpu_note = "; CPU smoke: no goal" if not ctx.is_cuda else ""
    row = result(
        f"fp8 GEMM {m}x{k}x{n}, _scaled_mm e4m3 vs bf16 matmul{tag(ctx)}", ours=rate["ours"],
        torch_=rate["torch"], unit="TFLOP/s", higher_is_better=True, goal=GEMM_GOAL if ctx.is_cuda else None,
        notes=(f"{median(times['ours']) * 1e3:.3f} vs {median(times['torch']) * 1e3:.3f} ms; the forward GEMM alone, "
               f"operands pre-quantised to e4m3 (scales 1.0, bf16 out, fast accumulation) vs torch.matmul in bf16; "
               f"vs the same product in bf16 of the e4m3 values: rel err {err:.1g}{cpu_note}"),
        times=times, m=m, k=k, n=n, ms_fp8=median(times["ours"]) * 1e3, ms_bf16=median(times["torch"]) * 1e3,
        rel_err=err, repeats=repeats, warmup=warmup, device_kind=kind(ctx))
    del a8, b8, a16, w16
    release(ctx)
    return row


# ---------------------------------------------------------------- sweep


def crossover(sizes: List[int], ratios: Dict[int, float]) -> Optional[int]:
    """The smallest size from which float8 wins (ratio > 1) at that size and
    every larger one in the sweep; None when it loses at the largest."""
    best = None
    for s in sorted(sizes, reverse=True):
        if ratios[s] > 1.0:
            best = s
        else:
            break
    return best


def sweep_rows(ctx: Context, prefill: Prefill) -> list:
    from fusetrain.float8 import DEFAULT_FP8_MIN_FEATURES

    cfg = CONFIG[ctx.device.type]
    warmup, repeats = counts(ctx)
    sizes = cfg["sweep_sizes"]
    ms_list = cfg["sweep_ms"][:1] if ctx.quick else cfg["sweep_ms"]
    rows = []
    for m in ms_list:
        ratio = {r: {} for r in RECIPES}
        eager_ratio = {r: {} for r in RECIPES}
        for s in sizes:
            case = LinearCase(ctx, m, s, s, seed=s)
            dev_t, host, prefill_ms = case.time(prefill, warmup, repeats)
            eager_t = case.time(prefill, warmup, repeats, use_prefill=False)[0] if ctx.is_cuda else dev_t
            flops = case.flops
            del case
            release(ctx)
            b = median(dev_t[BF16])
            for r in RECIPES:
                ratio[r][s] = b / median(dev_t[r])
                eager_ratio[r][s] = median(eager_t[BF16]) / median(eager_t[r])
            ms_ = {name: median(t) * 1e3 for name, t in dev_t.items()}
            eager_ms = {name: median(t) * 1e3 for name, t in eager_t.items()}
            rows.append(result(
                f"fp8 sweep M={m} K=N={s}, delayed vs bf16{tag(ctx)}", ours=ms_["delayed"], torch_=ms_[BF16],
                unit="ms", higher_is_better=False,
                notes=(f"current {ratio['current'][s]:.2f}x; eager (host included): delayed "
                       f"{eager_ratio['delayed'][s]:.2f}x, current {eager_ratio['current'][s]:.2f}x; "
                       f"{tflops(flops, ms_['delayed'])} vs {tflops(flops, ms_[BF16])} TFLOP/s; "
                       f"{prefill_note(host, prefill_ms)}"),
                times={"ours": dev_t["delayed"], "torch": dev_t[BF16]}, m=m, k=s, n=s,
                ms=ms_, eager_ms=eager_ms, ratio_delayed=ratio["delayed"][s], ratio_current=ratio["current"][s],
                eager_ratio_delayed=eager_ratio["delayed"][s], eager_ratio_current=eager_ratio["current"][s],
                host_issue_ms=host or None, prefill_ms=prefill_ms, repeats=repeats, warmup=warmup,
                device_kind=kind(ctx)))
        cross = {r: crossover(sizes, ratio[r]) for r in RECIPES}
        eager_cross = {r: crossover(sizes, eager_ratio[r]) for r in RECIPES}

        def says(c):
            return "never" if c is None else f"K=N >= {c}"

        agree = "n/a on the CPU"
        if ctx.is_cuda:
            agree = ("agrees" if cross["delayed"] == DEFAULT_FP8_MIN_FEATURES else
                     f"DIFFERS from DEFAULT_FP8_MIN_FEATURES = {DEFAULT_FP8_MIN_FEATURES}")
        line = (f"fp8 crossover at M={m}: delayed wins from {says(cross['delayed'])}, current from "
                f"{says(cross['current'])} (device time); eager, host included: delayed "
                f"{says(eager_cross['delayed'])}, current {says(eager_cross['current'])}; "
                f"DEFAULT_FP8_MIN_FEATURES = {DEFAULT_FP8_MIN_FEATURES} ({agree})")
        print(line, flush=True)
        listing = ", ".join(f"{s}: {ratio['delayed'][s]:.2f}x" for s in sizes)
        rows.append(result(
            f"fp8 crossover M={m}, smallest K=N where delayed beats bf16{tag(ctx)}",
            ours=None if cross["delayed"] is None else float(cross["delayed"]), torch_=None, unit="features",
            higher_is_better=False,
            notes=(f"{says(cross['delayed'])} (delayed, device time; current {says(cross['current'])}; eager "
                   f"delayed {says(eager_cross['delayed'])}); DEFAULT_FP8_MIN_FEATURES {DEFAULT_FP8_MIN_FEATURES}: "
                   f"{agree}; ratio by K=N: {listing}"),
            m=m, sizes=list(sizes), crossover=cross, eager_crossover=eager_cross,
            ratios={r: {str(s): v for s, v in ratio[r].items()} for r in RECIPES},
            eager_ratios={r: {str(s): v for s, v in eager_ratio[r].items()} for r in RECIPES},
            default_fp8_min_features=DEFAULT_FP8_MIN_FEATURES, device_kind=kind(ctx)))
    return rows


# ---------------------------------------------------------------- block


def block_rows(ctx: Context, prefill: Prefill) -> list:
    cfg = CONFIG[ctx.device.type]["block"]
    d, heads, seq, batch, min_features = cfg["d"], cfg["heads"], cfg["seq"], cfg["batch"], cfg["min_features"]
    warmup, repeats = counts(ctx, whole_step=True)
    dev = ctx.device
    torch.manual_seed(0)
    base = Block(d, heads).to(dev)
    models = {BF16: fusetrain.amp.apply_policy(copy.deepcopy(base), "mixed_bfloat16")}
    for r in RECIPES:
        models[r] = fusetrain.amp.apply_policy(copy.deepcopy(base), "mixed_float8", fp8_min_features=min_features,
                                               recipe=r)
    swapped = models["delayed"].fusetrain_float8_modules
    del base
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(batch, seq, d, device=dev, generator=g).requires_grad_()  # the fp32 residual stream
    gy = torch.randn(batch, seq, d, device=dev, generator=g) * 1e-2

    def zero(model):
        def fn():
            x.grad = None
            for p in model.parameters():
                p.grad = None

        return fn

    def step(model):
        def fn():
            model(x).backward(gy)

        return fn

    fns = {name: step(model) for name, model in models.items()}
    setup = {name: zero(model) for name, model in models.items()}
    setup, host, prefill_ms = prefill.for_fns(fns, setup)
    times = interleave(fns, ctx, setup=setup, warmup=warmup, repeats=repeats)
    params = sum(p.numel() for p in models[BF16].parameters())
    tokens = batch * seq
    # Matmul FLOPs: the four Linears (6 x params x tokens, forward + backward)
    # and causal attention (QK^T and PV, half the square, x3 for the backward).
    lin_params = sum(m.weight.numel() for m in models[BF16].modules() if isinstance(m, nn.Linear))
    flops = 6 * lin_params * tokens + 3 * 2 * 2 * batch * seq * seq * d // 2
    bf16_ms = median(times[BF16]) * 1e3
    describe = (f"pre-norm GPT block d{d} {heads}h MLP 4x ({millions(params)} params), batch {batch} x {seq} "
                f"tokens, causal SDPA; float8: {len(swapped)} Linears ({', '.join(swapped)}), "
                f"fp8_min_features={min_features}")
    rows = []
    for r in RECIPES:
        ms = median(times[r]) * 1e3
        rows.append(result(
            f"fp8 GPT block fwd+bwd d{d}, mixed_float8 {r} vs mixed_bfloat16{tag(ctx)}", ours=ms, torch_=bf16_ms,
            unit="ms", higher_is_better=False,
            notes=(f"{tflops(flops, ms)} vs {tflops(flops, bf16_ms)} TFLOP/s (matmuls); {describe}; "
                   f"{prefill_note(host, prefill_ms)}"),
            times={"ours": times[r], "torch": times[BF16]}, recipe=r, d_model=d, heads=heads, seq=seq,
            batch=batch, params=params, float8_modules=list(swapped), flops=flops,
            spread_ours=spread(times[r]), spread_torch=spread(times[BF16]), host_issue_ms=host or None,
            prefill_ms=prefill_ms, repeats=repeats, warmup=warmup, device_kind=kind(ctx)))
    del models, x, gy, fns, setup
    release(ctx)
    return rows


# ------------------------------------------------------------------ gpt


def permutation_batches(steps: int, batch: int, ctx_len: int, vocab: int, device, seed: int = 0):
    """``steps`` batches of (input, target), each token the image of the one
    before under a fixed random permutation of the vocabulary (the first at
    random): a pattern the model can learn from the first step on."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(vocab, generator=g).to(device)
    seq = torch.empty(steps * batch, ctx_len + 1, dtype=torch.long, device=device)
    seq[:, 0] = torch.randint(0, vocab, (steps * batch,), generator=g).to(device)
    for t in range(ctx_len):
        seq[:, t + 1] = perm[seq[:, t]]
    seq = seq.view(steps, batch, ctx_len + 1)
    return [(s[:, :-1].contiguous(), s[:, 1:].contiguous()) for s in seq.unbind(0)]


def gpt_rows(ctx: Context, prefill: Prefill) -> list:
    del prefill  # whole steps are timed on the host clock, host included
    cfg = CONFIG[ctx.device.type]
    g_cfg, batch, window, min_features = cfg["gpt"], cfg["gpt_batch"], cfg["gpt_window"], cfg["min_features"]
    steps = gpt_steps(ctx, cfg)
    windows = steps // window  # the first is the warm-up (it trains too)
    steps = windows * window
    dev = ctx.device
    loss_fn, loss_name = pick_loss(dev)
    torch.manual_seed(0)
    base = GPT(**g_cfg).to(dev)
    data = permutation_batches(steps, batch, g_cfg["ctx"], g_cfg["vocab"], dev)
    policies = {"mixed_bfloat16": {}}
    for r in RECIPES:
        policies[f"mixed_float8 {r}"] = dict(fp8_min_features=min_features, recipe=r)
    models, opts, losses, pos = {}, {}, {}, {}
    for name, kw in policies.items():
        m = fusetrain.amp.apply_policy(copy.deepcopy(base), name.split()[0], **kw)
        models[name] = m
        opts[name] = fusetrain.optim.FusedAdamW(m.parameters(), lr=1e-3, weight_decay=0.01)
        losses[name], pos[name] = [], 0
    swapped = models["mixed_float8 delayed"].fusetrain_float8_modules
    params = sum(p.numel() for p in base.parameters())
    del base

    def train_window(name):
        model, opt, vocab = models[name], opts[name], g_cfg["vocab"]

        def fn():
            for _ in range(window):
                x, y = data[pos[name]]
                pos[name] += 1
                out = model(x)
                with torch.autocast(dev.type, dtype=torch.bfloat16):
                    loss = loss_fn(out.reshape(-1, vocab), y.reshape(-1))
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses[name].append(loss.detach())

        return fn

    times = timed_windows({name: train_window(name) for name in models}, ctx, repeats=windows - 1, warmup=1)
    tokens = batch * g_cfg["ctx"]
    per_step = {name: [t / window for t in ts] for name, ts in times.items()}
    rate = {name: tokens / median(ts) for name, ts in per_step.items()}
    final = {name: float(torch.stack(ls[-window:]).float().mean()) for name, ls in losses.items()}
    first = {name: float(ls[0].float()) for name, ls in losses.items()}
    describe = (f"GPT {g_cfg['layers']}L d{g_cfg['d']} {g_cfg['heads']}h ctx {g_cfg['ctx']} vocab {g_cfg['vocab']} "
                f"({millions(params)} params, tied head), batch {batch} x {g_cfg['ctx']} tokens, {steps} steps "
                f"FusedAdamW lr 1e-3 from one initial model on the same permutation-stream batches; {loss_name}")
    rows = []
    for name in models:
        rows.append(result(
            f"fp8 gpt train {name}{tag(ctx)}", ours=rate[name], torch_=None, unit="tokens/s", higher_is_better=True,
            notes=(f"{median(per_step[name]) * 1e3:.2f} ms/step; loss {first[name]:.3f} -> {final[name]:.4f} "
                   f"(mean of the last {window} steps); {describe}"),
            policy=name, ms_per_step=median(per_step[name]) * 1e3, best_ms_per_step=min(per_step[name]) * 1e3,
            spread=spread(per_step[name]), tokens_per_step=tokens, steps=steps, first_loss=first[name],
            final_loss=final[name], losses=[float(v) for v in torch.stack(losses[name]).float().tolist()],
            device_kind=kind(ctx)))
    for r in RECIPES:
        name = f"mixed_float8 {r}"
        rows.append(result(
            f"fp8 gpt train, mixed_float8 {r} vs mixed_bfloat16{tag(ctx)}", ours=rate[name],
            torch_=rate["mixed_bfloat16"], unit="tokens/s", higher_is_better=True,
            notes=(f"{median(per_step[name]) * 1e3:.2f} vs {median(per_step['mixed_bfloat16']) * 1e3:.2f} ms/step; "
                   f"final loss {final[name]:.4f} vs {final['mixed_bfloat16']:.4f} "
                   f"({final[name] - final['mixed_bfloat16']:+.4f}); float8: {len(swapped)} Linears "
                   f"(fp8_min_features={min_features}); {describe}"),
            times={"ours": per_step[name], "torch": per_step["mixed_bfloat16"]}, policy=name,
            baseline="mixed_bfloat16", final_loss=final[name], final_loss_bf16=final["mixed_bfloat16"],
            float8_modules=list(swapped), steps=steps, device_kind=kind(ctx)))
    print(f"fp8 gpt: final loss after {steps} steps: "
          + ", ".join(f"{name} {final[name]:.4f}" for name in models), flush=True)
    del models, opts, data
    release(ctx)
    return rows


# ------------------------------------------------------------------ run


def run(ctx: Context) -> list:
    skip = skipped_parts()
    if ctx.is_cuda:
        cap = torch.cuda.get_device_capability(ctx.device)
        if cap < (8, 9):
            print(f"  fp8: {torch.cuda.get_device_name(ctx.device)} is sm_{cap[0]}{cap[1]}; float8 GEMMs need "
                  "compute capability >= 8.9: no rows", file=sys.stderr)
            return []
    prefill = Prefill(ctx)
    parts = {"linear": linear_rows, "sweep": sweep_rows, "block": block_rows, "gpt": gpt_rows}
    rows = []
    for part, fn in parts.items():
        if part in skip:
            continue
        t0 = time.perf_counter()
        rows += guarded(ctx, f"fp8 {part}{tag(ctx)}", fn, prefill)
        print(f"  fp8 {part}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return rows


def main(argv: List[str]) -> int:
    """``bench/bench_fp8.py [--skip PART]... [--gpt-steps N] [run.py's flags]``."""
    import argparse

    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--skip", action="append", default=[], choices=PARTS)
    ap.add_argument("--gpt-steps", type=int, default=None)
    ap.add_argument("-h", "--help", action="store_true")
    args, rest = ap.parse_known_args(argv)
    if args.help:
        print(__doc__)
        print(f"flags: --skip {{{','.join(PARTS)}}} (repeatable), --gpt-steps N, and bench/run.py's "
              "(--device, --quick, --repeats, --threads, --results-dir, --no-write)")
        return 0
    if args.skip:
        os.environ[SKIP_ENV] = ",".join(args.skip)
    if args.gpt_steps is not None:
        os.environ[GPT_STEPS_ENV] = str(args.gpt_steps)
    import run as harness

    return harness.main(["--only", NAME] + rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
