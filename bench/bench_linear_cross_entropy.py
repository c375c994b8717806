"""Chunked linear + cross-entropy: fusetrain.nn.functional.linear_cross_entropy
against eager ``F.cross_entropy(F.linear(x, W), t)``, forward + backward,
side by side on the same inputs (issue 38's benchmark).

Inputs: x [N, H] and W [C, H] (no bias), both requiring grad, in the row's
dtype; x ~ N(0, 1) and W ~ N(0, 4 / H), so the logits have a standard
deviation of about 2; targets uniform over the C classes with about 2% set to
ignore_index = -100 (padding). Each timed call is ``loss.backward()`` of a
fresh forward, the gradients of x and W cleared (untimed) before every call.
The variants run interleaved call by call ("recompute" in the full CPU run
at 50257 classes only, for time):

  ours        linear_cross_entropy(x, W, t)   (gradients_in_forward=True,
              the default: three GEMMs a chunk in the forward, the backward
              only rescales)
  torch       F.cross_entropy(F.linear(x, W), t)   (eager: [N, C] logits)
  linear+fce  fusetrain.nn.functional.softmax_cross_entropy(F.linear(x, W), t)
              (fusetrain's fused cross-entropy on the whole [N, C] logits)
  recompute   linear_cross_entropy(..., options=LinearCrossEntropyOptions(
              gradients_in_forward=False))   (the backward recomputes each
              chunk's logits: four GEMMs a chunk, less held between passes)

Peak memory is what one forward + backward adds above the live inputs (the
gradients x.grad and W.grad it produces included: every variant makes them).
On the CPU each variant is measured in a fresh process of its own (this file
with ``--peak-child``): it warms the code path on a tiny problem, builds the
inputs, resets the RSS high-water mark (``5`` into /proc/self/clear_refs) and
reports VmHWM after the call minus VmRSS before it; where the reset is not
permitted it falls back to ``ru_maxrss`` (valid when the call's peak exceeds
everything before it, as it does here). The child runs with glibc's mmap
threshold fixed (``MALLOC_MMAP_THRESHOLD_``, see MMAP_THRESHOLD), so that its
RSS follows the live tensors rather than glibc's heap. On CUDA it is
``torch.cuda.max_memory_allocated`` minus the allocated memory before the call,
in this process (the caching allocator's counters are exact).

On CUDA two more rows put the figures in context: the GEMM floor (the
three GEMMs alone, timed in the same run: no variant does fewer flops, so
eager / floor is the most any of them can gain) with the memory floor under
fp32 accumulation, and a sweep of batch_chunk_size (256 ... 8192 rows, time
and peak) behind the CUDA chunk rule.

Goals (issue 38): CPU, 8192 x 768 -> 32768 / 50257, bf16 and fp32, at least
1.2x eager's time, and at 50257 at most 1/8 of eager's peak memory; CUDA,
16384 x 4096 -> 128256 bf16, at least 1.3x and at most 1/10.

    python bench/run.py --only linear_cross_entropy [--device cuda] [--quick]
    python bench/bench_linear_cross_entropy.py [--device cuda] [--quick]   # the same

The CPU run is long (one call at 50257 is ~1.9 TFLOP; ~15-20 minutes in all): 1 warm-up and 2
timed calls of each variant (median), progress on stderr. ``--quick`` runs
N=2048, 32768 classes, bf16 only (about a minute).
"""

from __future__ import annotations

import gc
import json
import os
import resource
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import fusetrain
from fusetrain.nn.functional import LinearCrossEntropyOptions, _lce_chunk_rows
from common import Context, cuda_peak_extra_mib, interleave, median, result, spread

NAME = "linear_cross_entropy"

MIB = 1 << 20
# The CPU children's glibc mmap threshold (glibc's initial one, fixed): every
# allocation above it is mmapped and unmapped when freed, so that RSS follows
# the live tensors. Left dynamic, glibc raises it to the size of the blocks
# freed (up to 32 MiB) and keeps freed chunk-sized blocks (a chunk's logits
# are ~25-30 MiB here) in its heap: the chunked variants' peaks then moved by
# +-40 MiB from run to run and a baseline could hold freed memory the call
# reused. With it fixed the figure is the live peak, as
# torch.cuda.max_memory_allocated is on CUDA. A value set by the caller wins.
MMAP_THRESHOLD = 128 << 10
IGNORE = -100
TIME_GOAL = {"cpu": 1.2, "cuda": 1.3}  # eager time / ours
MEMORY_GOAL = {"cpu": (50257, 8.0), "cuda": (128256, 10.0)}  # at C: eager peak / ours
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}

# (N, H, C, dtype name, with the gradients_in_forward=False variant). The
# full CPU run times "recompute" at 50257 only: each variant costs its share
# of a run of ~15 minutes.
CONFIGS = {
    "cpu": [(8192, 768, 32768, "bf16", False), (8192, 768, 32768, "fp32", False),
            (8192, 768, 50257, "bf16", True), (8192, 768, 50257, "fp32", True)],
    "cpu_quick": [(2048, 768, 32768, "bf16", True)],
    "cuda": [(16384, 4096, 128256, "bf16", True)],
    "cuda_quick": [(16384, 4096, 128256, "bf16", True)],
}

VARIANTS = ("ours", "torch", "linear+fce", "recompute")
_RECOMPUTE = LinearCrossEntropyOptions(gradients_in_forward=False)


# ------------------------------------------------------------------ inputs


def make_inputs(device: torch.device, n: int, h: int, c: int, dtype: torch.dtype):
    """x [n, h], W [c, h] (leaves requiring grad) and targets [n] (int64,
    ~2% IGNORE), the same for a given size on every device."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g).to(device=device, dtype=dtype)
    w = torch.empty(c, h, dtype=dtype, device=device)
    for i in range(0, c, 8192):  # chunked: no fp32 staging copy of a large W
        rows = min(8192, c - i)
        w[i : i + rows] = (torch.randn(rows, h, generator=g) * (2.0 / h**0.5)).to(device=device, dtype=dtype)
    t = torch.randint(0, c, (n,), generator=g)
    t[torch.rand(n, generator=g) < 0.02] = IGNORE
    return x.requires_grad_(), w.requires_grad_(), t.to(device)


def loss_fns():
    """variant -> loss(x, W, t)."""
    lce = fusetrain.nn.functional.linear_cross_entropy
    fce = fusetrain.nn.functional.softmax_cross_entropy
    return {
        "ours": lambda x, w, t: lce(x, w, t),
        "torch": lambda x, w, t: F.cross_entropy(F.linear(x, w), t, ignore_index=IGNORE),
        "linear+fce": lambda x, w, t: fce(F.linear(x, w), t, ignore_index=IGNORE),
        "recompute": lambda x, w, t: lce(x, w, t, options=_RECOMPUTE),
        # torch's options (its default: acc_policy "auto", "accurate" for
        # 16-bit on the CPU), ours and torch 2.13+'s own function.
        "ours_opts": lambda x, w, t: lce(x, w, t, options=LinearCrossEntropyOptions()),
        "torch_own": lambda x, w, t: F.linear_cross_entropy(
            x, w, t, ignore_index=IGNORE, options=torch.nn.LinearCrossEntropyOptions()),
    }


def step_fn(loss_fn, x, w, t, losses: dict, name: str):
    def step():
        loss = loss_fn(x, w, t)
        loss.backward()
        losses[name] = loss.detach()

    return step


def clear_grads(x, w, progress=None):
    # Untimed: freeing the previous call's gradients (the other variant's, as
    # the calls interleave) belongs to neither variant's work.
    def clear():
        x.grad = None
        w.grad = None
        if progress is not None:
            progress()

    return clear


# ------------------------------------------------------------ peak memory


def _status_kib(field: str):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_child(spec_json: str) -> int:
    """In a fresh process: the RSS one forward + backward of a variant adds
    above its live inputs; prints one JSON line."""
    spec = json.loads(spec_json)
    torch.set_num_threads(int(spec["threads"]))
    dtype = DTYPES[spec["dtype"]]
    fn = loss_fns()[spec["variant"]]
    device = torch.device("cpu")
    # Warm the code path (libraries, the OpenMP pool, kernels' first-call
    # setup) on a tiny problem, so that none of it is counted below.
    xs, ws, ts = make_inputs(device, 128, spec["h"], 512, dtype)
    fn(xs, ws, ts).backward()
    del xs, ws, ts
    x, w, t = make_inputs(device, spec["n"], spec["h"], spec["c"], dtype)
    gc.collect()
    reset = _reset_hwm()
    base_kib = _status_kib("VmRSS")
    fn(x, w, t).backward()
    if reset and _status_kib("VmHWM") is not None:
        peak_kib, method = _status_kib("VmHWM"), "VmHWM"
    else:
        peak_kib, method = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "ru_maxrss"
    print(json.dumps({"peak_extra_mib": (peak_kib - base_kib) / 1024, "method": method,
                      "base_mib": base_kib / 1024}))
    return 0


def peak_cpu(ctx: Context, variant: str, n: int, h: int, c: int, dname: str):
    """(MiB, method) from a fresh process, or (None, error)."""
    spec = json.dumps({"variant": variant, "n": n, "h": h, "c": c, "dtype": dname, "threads": ctx.threads})
    env = dict(os.environ)
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD))
    try:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--peak-child", spec],
                             capture_output=True, text=True, timeout=900, env=env)
    except subprocess.TimeoutExpired:
        return None, "timeout"
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        err = (out.stderr.strip().splitlines() or ["?"])[-1][:120]
        return None, f"child failed ({out.returncode}): {err}"
    d = json.loads(lines[-1])
    method = d["method"]
    if env["MALLOC_MMAP_THRESHOLD_"]:
        method += f", mmap threshold {int(env['MALLOC_MMAP_THRESHOLD_']) >> 10} KiB"
    return d["peak_extra_mib"], method


def peak_cuda(ctx: Context, setup, fn) -> float:
    """Peak CUDA memory one call allocates beyond what was live before it."""
    setup()
    return cuda_peak_extra_mib(ctx, fn)


# ------------------------------------------------------------------- rows


def _log(msg: str) -> None:
    print(f"  [lce] {msg}", file=sys.stderr, flush=True)


def bench_config(ctx: Context, n: int, h: int, c: int, dname: str, with_recompute: bool) -> list:
    dtype = DTYPES[dname]
    label = f"{n}x{h}->{c} {dname}"
    variants = VARIANTS if with_recompute else tuple(v for v in VARIANTS if v != "recompute")
    if ctx.is_cuda and hasattr(F, "linear_cross_entropy"):
        # torch 2.13+'s own chunked function beside ours (issue 50; on the
        # CPU bench_lce_vs_torch.py compares them).
        variants += ("torch_own",)
    x, w, t = make_inputs(ctx.device, n, h, c, dtype)
    losses = {}
    fns = {k: step_fn(f, x, w, t, losses, k) for k, f in loss_fns().items() if k in variants}
    if ctx.is_cuda:
        warmup, repeats = ctx.warmup, max(5, ctx.repeats // 2)
        setup = {k: clear_grads(x, w) for k in fns}
    else:
        warmup, repeats = 1, 2
        count = {"k": 0}
        total = len(fns) * (warmup + repeats)
        t_start = time.perf_counter()

        def progress_for(name):
            def progress():
                count["k"] += 1
                _log(f"{label}: call {count['k']}/{total} ({name}), {time.perf_counter() - t_start:.0f} s so far")

            return progress

        setup = {k: clear_grads(x, w, progress_for(k)) for k in fns}
    _log(f"{label}: timing {len(fns)} variants x ({warmup} warm-up + {repeats}) calls")
    times = interleave(fns, ctx, setup=setup, warmup=warmup, repeats=repeats)
    med = {k: median(v) for k, v in times.items()}
    # Each loss is rounded to the linear's dtype (bf16: 2^-8 relative).
    loss_ref = losses["torch"].double().item()
    loss_diff = max(abs(losses[k].double().item() - loss_ref) / abs(loss_ref) for k in variants if k != "torch")

    # Peak memory, each variant on its own.
    peak, method, peak_errors = dict.fromkeys(VARIANTS + ("torch_own",)), None, {}
    if ctx.is_cuda:
        for k in variants:
            peak[k] = peak_cuda(ctx, setup[k], fns[k])
        method = "max_memory_allocated"
    else:
        for k in variants:
            _log(f"{label}: peak memory of {k} (fresh process)")
            peak[k], m = peak_cpu(ctx, k, n, h, c, dname)
            if peak[k] is None:
                peak_errors[k] = m
            else:
                method = m
    x.grad = w.grad = None
    del fns, setup

    chunk = _lce_chunk_rows(n, h, c, dtype, ctx.device.type)
    esize = torch.empty((), dtype=dtype).element_size()
    grads_mib = (n * h + c * h) * esize / MIB
    logits_mib = n * c * esize / MIB
    goal_c, mem_goal = MEMORY_GOAL[ctx.device.type]
    mem_ratio = peak["torch"] / peak["ours"] if peak["ours"] and peak["torch"] else None
    meets_mem = None if (mem_ratio is None or c != goal_c) else mem_ratio >= mem_goal
    time_goal = TIME_GOAL[ctx.device.type]
    ratio = med["torch"] / med["ours"]

    def mib(v):
        return "n/a" if v is None else f"{v:.0f}"

    mem_note = f"peak MiB ({method}): ours {mib(peak['ours'])}, eager {mib(peak['torch'])}"
    if mem_ratio is not None:
        mem_note += f" ({mem_ratio:.1f}x less"
        if c == goal_c:
            mem_note += f"; memory goal {mem_goal:g}x {'met' if meets_mem else 'NOT met'}"
        mem_note += ")"
    mem_note += f", linear+fce {mib(peak['linear+fce'])}"
    if with_recompute:
        mem_note += f", recompute {mib(peak['recompute'])}"
    mem_note += f" (x.grad+W.grad {grads_mib:.0f}, logits {logits_mib:.0f})"
    notes = (
        f"{label}, chunk {chunk} rows ({-(-n // chunk)} chunks), {ctx.threads} threads; "
        f"time goal {time_goal:g}x {'met' if ratio >= time_goal else 'NOT met'}; "
        f"vs linear+fusetrain CE {med['linear+fce'] * 1e3:.0f} ms ({med['linear+fce'] / med['ours']:.2f}x); "
        f"{mem_note}; loss vs eager's: {loss_diff:.1e} relative"
    )
    if "torch_own" in med:
        notes += (f"; torch's own F.linear_cross_entropy {med['torch_own'] * 1e3:.0f} ms "
                  f"({med['torch_own'] / med['ours']:.2f}x ours' time), peak {mib(peak.get('torch_own'))} MiB")
    if peak_errors:
        notes += "; peak memory failed: " + ", ".join(f"{k}: {e}" for k, e in peak_errors.items())
    common_extra = dict(n=n, h=h, c=c, dtype=dname, chunk_rows=chunk, repeats=repeats, warmup=warmup,
                        times_ms={k: [s * 1e3 for s in v] for k, v in times.items()},
                        peak_mib=peak, peak_method=method, peak_errors=peak_errors, grads_mib=grads_mib, logits_mib=logits_mib,
                        loss_eager=loss_ref, loss_max_rel_diff=loss_diff)
    rows = [result(
        f"linear+CE fwd+bwd, {label}",
        ours=med["ours"] * 1e3,
        torch_=med["torch"] * 1e3,
        unit="ms",
        higher_is_better=False,
        goal=time_goal,
        notes=notes,
        times={"ours": times["ours"], "torch": times["torch"]},
        spread_ours=spread(times["ours"]),
        spread_torch=spread(times["torch"]),
        linear_fce_ms=med["linear+fce"] * 1e3,
        memory_ratio=mem_ratio,
        memory_goal=mem_goal if c == goal_c else None,
        meets_memory_goal=meets_mem,
        **common_extra,
    )]
    if ctx.is_cuda:
        rows += cuda_floor_and_sweep(ctx, x, w, t, label, med, peak, chunk, common_extra)
    if not with_recompute:
        return rows
    rec_ratio = med["recompute"] / med["ours"]
    rec_notes = (
        f"{label}; ours column = gradients_in_forward=True (default, 3 GEMMs/chunk), torch column = "
        f"False (recompute, 4 GEMMs/chunk); ratio > 1: True is faster; "
        f"peak MiB True {mib(peak['ours'])}, False {mib(peak['recompute'])}"
    )
    rows.append(result(
        f"linear+CE gradients_in_forward True vs False, {label}",
        ours=med["ours"] * 1e3,
        torch_=med["recompute"] * 1e3,
        unit="ms",
        higher_is_better=False,
        notes=rec_notes,
        times={"ours": times["ours"], "torch": times["recompute"]},
        spread_ours=spread(times["ours"]),
        spread_torch=spread(times["recompute"]),
        time_ratio_false_over_true=rec_ratio,
        **common_extra,
    ))
    return rows


SWEEP_ROWS = (256, 512, 1024, 2048, 4096, 8192)


def cuda_floor_and_sweep(ctx: Context, x, w, t, label: str, med: dict, peak: dict, chunk: int,
                         common_extra: dict) -> list:
    """Two CUDA rows that say what the goals' figures mean:

    - the GEMM floor: the three GEMMs every variant does (z = x W^T,
      dx = g W, dW = g^T x), timed alone in this run, against ours and eager.
      No chunking and no fused loss makes fewer flops, so eager / floor bounds
      the time ratio any such implementation can reach here; and the memory
      floor under fp32 accumulation: the gradients plus the fp32 dW
      accumulator, C x H x 4 bytes (Note [Chunked linear cross-entropy]);
    - the chunk sweep: ours at batch_chunk_size 256 ... 8192 rows, time and
      peak, the data behind the CUDA chunk rule (at least 2048 rows)."""
    n, h = x.shape
    c = w.shape[0]
    esize = x.element_size()
    with torch.no_grad():
        xd, wd = x.detach(), w.detach()
        z = torch.mm(xd, wd.t())  # [N, C], held by the floor's calls
        gemms = {
            "z = x W^T": lambda: torch.mm(xd, wd.t()),
            "dx = g W": lambda: torch.mm(z, wd),
            "dW = g^T x": lambda: torch.mm(z.t(), xd),
        }
        gemm_times = interleave(gemms, ctx, warmup=ctx.warmup, repeats=max(5, ctx.repeats // 2))
        del z
    gemm_ms = {k: median(v) * 1e3 for k, v in gemm_times.items()}
    floor_ms = sum(gemm_ms.values())
    tflops = 6.0 * n * c * h / (floor_ms * 1e-3) / 1e12
    accumulator_mib = c * h * 4 / MIB if x.dtype != torch.float32 else 0.0
    memory_floor_mib = (n * h + c * h) * esize / MIB + accumulator_mib
    floor_notes = (
        f"{label}; ours column = ours, torch column = the GEMM floor (the 3 GEMMs alone: "
        + ", ".join(f"{k} {v:.1f} ms" for k, v in gemm_ms.items())
        + f"; {tflops:.0f} TFLOP/s); eager {med['torch'] * 1e3:.1f} ms = {med['torch'] * 1e3 / floor_ms:.2f}x the floor, "
        f"so no implementation of these GEMMs beats eager by more than {med['torch'] * 1e3 / floor_ms:.2f}x; "
        f"memory floor with fp32 dW accumulation {memory_floor_mib:.0f} MiB "
        f"(eager peak / floor {peak['torch'] / memory_floor_mib:.1f}x)"
    )
    rows = [result(
        f"linear+CE vs its GEMM floor, {label}",
        ours=med["ours"] * 1e3,
        torch_=floor_ms,
        unit="ms",
        higher_is_better=False,
        notes=floor_notes,
        gemm_ms=gemm_ms,
        gemm_tflops=tflops,
        eager_over_floor=med["torch"] * 1e3 / floor_ms,
        memory_floor_mib=memory_floor_mib,
        eager_peak_over_memory_floor=peak["torch"] / memory_floor_mib,
        **common_extra,
    )]

    lce = fusetrain.nn.functional.linear_cross_entropy
    sweep = [r for r in SWEEP_ROWS if r < n]
    losses = {}
    fns = {f"{r} rows": step_fn(lambda x_, w_, t_, r=r: lce(x_, w_, t_, options=LinearCrossEntropyOptions(
        batch_chunk_size=r)), x, w, t, losses, f"{r} rows") for r in sweep}
    setup = {k: clear_grads(x, w) for k in fns}
    sweep_times = interleave(fns, ctx, setup=setup, warmup=1, repeats=3)
    sweep_ms = {k: median(v) * 1e3 for k, v in sweep_times.items()}
    sweep_peak = {k: peak_cuda(ctx, setup[k], fns[k]) for k in fns}
    x.grad = w.grad = None
    best = min(sweep_ms, key=sweep_ms.get)
    sweep_notes = (
        f"{label}; ours column = the default rule's {chunk} rows ({med['ours'] * 1e3:.1f} ms), torch column = "
        f"the fastest of the sweep ({best}); ms / peak MiB: "
        + ", ".join(f"{k} {sweep_ms[k]:.1f} / {sweep_peak[k]:.0f}" for k in fns)
    )
    rows.append(result(
        f"linear+CE chunk sweep, {label}",
        ours=med["ours"] * 1e3,
        torch_=sweep_ms[best],
        unit="ms",
        higher_is_better=False,
        notes=sweep_notes,
        sweep_ms=sweep_ms,
        sweep_peak_mib=sweep_peak,
        **common_extra,
    ))
    return rows


def run(ctx: Context) -> list:
    key = ctx.device.type + ("_quick" if ctx.quick else "")
    rows = []
    for n, h, c, dname, with_recompute in CONFIGS[key]:
        rows += bench_config(ctx, n, h, c, dname, with_recompute)
        gc.collect()
        if ctx.is_cuda:
            torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--peak-child":
        sys.exit(_peak_child(sys.argv[2]))
    import run as harness

    sys.exit(harness.main(["--only", NAME] + sys.argv[1:]))
