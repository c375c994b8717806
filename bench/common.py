"""Timing and reporting helpers shared by the benchmark modules.

Every comparison is made side by side in one process on the same data:
variants are interleaved call by call (ours, torch, ours, torch, ...) so that
frequency changes, a neighbour's load or a warming cache hit each variant
alike; each variant is warmed up first and reported as the median of its
repeats, with the ratio of the fastest calls alongside (it resists a busy
machine). Untimed per-call setup (resetting state so every timed call does the
same work, or flushing the cache) runs outside the clock. On CUDA each call is
timed with events on the current stream, so host-side synchronisation is not
counted.
"""

from __future__ import annotations

import gc
import os
import platform
import re
import socket
import statistics
import subprocess
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch


# ----------------------------------------------------------------- context


@dataclass
class Context:
    """What the harness hands every benchmark module's ``run``."""

    device: torch.device
    quick: bool
    threads: int
    warmup: int
    repeats: int
    _flush_buf: Optional[torch.Tensor] = field(default=None, repr=False)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def flush_cache(self) -> None:
        """Evicts the last-level cache (and the GPU's L2) by reading a buffer
        several times its size; a read, so that nothing dirty is left to be
        written back during the next timed call. That call then starts cold,
        as a pass over the gradients of a model larger than the cache does."""
        if self._flush_buf is None:
            nbytes = (512 if self.is_cuda else 128) << 20
            self._flush_buf = torch.ones(nbytes // 4, device=self.device)
        self._flush_buf.sum()


def copy_variant(ctx: Context, numel: int, dtype: torch.dtype):
    """``(fn, nbytes)``: ``dst.copy_(src)`` over ``numel`` elements of ``dtype``
    on the context's device and the bytes it reads plus writes: the practical
    ceiling of a memory-bound kernel moving as many bytes. Time it in the same
    ``interleave`` call as the kernels it bounds, so that it sees the same
    conditions (cache state, a busy neighbour, the GPU's clocks)."""
    src = torch.randn(numel, device=ctx.device).to(dtype)
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), 2 * numel * src.element_size()


def inplace_variant(ctx: Context, numel: int, dtype: torch.dtype):
    """``(fn, nbytes)``: torch's in-place ``x.mul_(s)`` over one contiguous
    buffer of ``numel`` elements, ``s`` alternating 0.5 and 2.0 (exact, no
    drift). On a CPU this read-modify-write is the ceiling for in-place
    kernels: a copy to a cold destination also pays the destination's
    read-for-ownership and is slower than the in-place pass it should bound."""
    buf = torch.randn(numel, device=ctx.device).to(dtype)
    state = {"k": 0}

    def fn():
        state["k"] ^= 1
        buf.mul_(0.5 if state["k"] else 2.0)

    return fn, 2 * numel * buf.element_size()


# ------------------------------------------------------------------ timing


def cuda_peak_extra_mib(ctx: "Context", fn) -> float:
    """Peak CUDA memory (MiB) one call of fn allocates beyond what was live
    before it (garbage collected and the cache emptied first)."""
    torch.cuda.synchronize(ctx.device)
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(ctx.device)
    torch.cuda.reset_peak_memory_stats(ctx.device)
    fn()
    torch.cuda.synchronize(ctx.device)
    return (torch.cuda.max_memory_allocated(ctx.device) - base) / (1 << 20)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    fn: Callable[[], object],
    ctx: Context,
    *,
    setup: Optional[Callable[[], object]] = None,
    warmup: Optional[int] = None,
    repeats: Optional[int] = None,
) -> List[float]:
    """Seconds per call of ``fn`` (one entry per repeat, warm-up dropped);
    ``setup`` runs untimed before each call."""
    return interleave({"fn": fn}, ctx, setup=setup, warmup=warmup, repeats=repeats)["fn"]


def interleave(
    fns: Dict[str, Callable[[], object]],
    ctx: Context,
    *,
    setup=None,
    warmup: Optional[int] = None,
    repeats: Optional[int] = None,
    cold: bool = False,
) -> Dict[str, List[float]]:
    """Times several variants of the same work call by call in turn; returns
    seconds per call for each. ``setup`` (untimed) runs before every call: one
    callable for all variants, or a dict with one per variant name; it resets
    state so that every timed call does the same work. ``cold``: the cache is
    flushed (untimed) before every call, so no variant profits from the data
    the one before it left in cache."""
    warmup = ctx.warmup if warmup is None else warmup
    repeats = ctx.repeats if repeats is None else repeats
    names = list(fns)
    if setup is None or callable(setup):
        setup = {name: setup for name in names}
    if cold:
        setup = {name: _then_flush(setup[name], ctx) for name in names}
    for _ in range(warmup):
        for name in names:
            if setup[name] is not None:
                setup[name]()
            fns[name]()
    synchronize(ctx.device)

    times: Dict[str, List[float]] = {name: [] for name in names}
    if ctx.is_cuda:
        events = {name: [] for name in names}
        for _ in range(repeats):
            for name in names:
                if setup[name] is not None:
                    setup[name]()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fns[name]()
                end.record()
                events[name].append((start, end))
        torch.cuda.synchronize(ctx.device)
        for name in names:
            times[name] = [s.elapsed_time(e) / 1e3 for s, e in events[name]]
    else:
        clock = time.perf_counter
        for _ in range(repeats):
            for name in names:
                if setup[name] is not None:
                    setup[name]()
                t0 = clock()
                fns[name]()
                times[name].append(clock() - t0)
    return times


def _then_flush(fn, ctx: Context):
    def run():
        if fn is not None:
            fn()
        ctx.flush_cache()

    return run


def median(xs: List[float]) -> float:
    return statistics.median(xs)


def spread(xs: List[float]) -> float:
    """Interquartile range over the median: how noisy a measurement was."""
    if len(xs) < 4:
        return 0.0
    q = statistics.quantiles(xs, n=4)
    return (q[2] - q[0]) / statistics.median(xs)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


# ----------------------------------------------------------------- results


def result(
    benchmark: str,
    *,
    ours: float,
    torch_: Optional[float],
    unit: str,
    higher_is_better: bool,
    goal: Optional[float] = None,
    notes: str = "",
    times: Optional[Dict[str, List[float]]] = None,
    **extra,
) -> dict:
    """One table row. ``ratio`` is always "how many times better ours is":
    ours/torch for rates, torch/ours for times, from the medians. With
    ``times`` (seconds per call of "ours" and "torch") the row also carries
    ``best_ratio``, the same ratio from each side's fastest call, which
    resists a busy machine far better than the median; the notes lead with it."""
    ratio = None
    if torch_ is not None and ours > 0 and torch_ > 0:
        ratio = ours / torch_ if higher_is_better else torch_ / ours
    best_ratio = None
    if times is not None and times.get("torch") and times.get("ours"):
        best_ratio = min(times["torch"]) / min(times["ours"])
        notes = f"best-of {best_ratio:.2f}x; {notes}" if notes else f"best-of {best_ratio:.2f}x"
    row = {
        "benchmark": benchmark,
        "ours": ours,
        "torch": torch_,
        "unit": unit,
        "ratio": ratio,
        "higher_is_better": higher_is_better,
        "goal": goal,
        "meets_goal": None if (goal is None or ratio is None) else ratio >= goal,
        "best_ratio": best_ratio,
        "notes": notes,
    }
    row.update(extra)
    return row


# ----------------------------------------------------------------- machine


def fmt(x, unit) -> str:
    if x is None:
        return "n/a"
    return f"{x:.1f} {unit}" if x >= 10 else f"{x:.2f} {unit}"


def table(rows: list, baseline: str = "torch") -> str:
    """The markdown table of result() rows; `baseline` heads the reference column."""
    lines = [f"| benchmark | ours | {baseline} | ratio | notes |", "|---|---|---|---|---|"]
    for r in rows:
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        if r.get("meets_goal") is not None:
            ratio += f" ({'meets' if r['meets_goal'] else 'below'} {r['goal']:g}x goal)"
        ours, ref = fmt(r["ours"], r["unit"]), fmt(r["torch"], r["unit"])
        lines.append(f"| {r['benchmark']} | {ours} | {ref} | {ratio} | {r['notes']} |")
    return "\n".join(lines)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: torch.device, threads: int) -> dict:
    info = {
        "hostname": socket.gethostname(),
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": threads,
        "interop_threads": torch.get_num_interop_threads(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "python": platform.python_version(),
        "device": str(device),
        "gpu": None,
        "loadavg_start": _loadavg(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["gpu_sms"] = props.multi_processor_count
    try:
        import fusetrain
        from fusetrain import _C

        info["fusetrain"] = getattr(fusetrain, "__version__", None)
        features = _C.cpu_features()
        info["cpu_path"] = features["path"]  # the path fusetrain's CPU ops take (Note [CPU paths])
        info["cpu_isa"] = "avx512" if features["avx512"] else "avx2" if features["avx2"] else "scalar"
        info["cpu_amx_bf16"] = bool(features.get("amx_bf16"))
        info["cpu_avx512_bf16"] = bool(features.get("avx512_bf16"))
    except ImportError:
        info["fusetrain"] = None
    info["git"] = _git_describe()
    return info


def _git_describe() -> Optional[str]:
    """The checkout's commit, with "-dirty" when the tree has changes."""
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=os.path.dirname(os.path.abspath(__file__)),
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _loadavg() -> Optional[float]:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def loadavg() -> Optional[float]:
    return _loadavg()


def load_averages() -> List[float]:
    """The 1-, 5- and 15-minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


def launcher_info(threads_per_rank: int) -> dict:
    """What a multi-process benchmark's launcher records of the machine (the
    CPU, its vector paths, the versions) and of its load as the run starts;
    the launcher adds its world, backend and the end load."""
    load = load_averages()
    probed = machine_info(torch.device("cpu"), threads_per_rank)  # imports fusetrain here, not in torch's workers
    keep = ("cpu_model", "cpu_cores", "cpu_isa", "cpu_amx_bf16", "cpu_avx512_bf16", "git", "fusetrain",
            "cpu_capability", "torch", "python")
    info = {k: probed[k] for k in keep if k in probed}
    info.update(threads_per_rank=threads_per_rank, loadavg_start=load[0], loadavg_1_5_15_start=load)
    return info


def machine_slug(info: dict) -> str:
    """A file-name-safe machine name: the GPU for CUDA runs, else the CPU
    model, its best vector ISA where that is AVX-512 and "amx" where it has
    AMX-BF16 (VMs of one brand string come with and without each, and they
    run at very different speeds) and the core count (host names of
    throwaway machines say nothing)."""
    if info.get("gpu"):
        name = info["gpu"]
    else:
        name = re.sub(r"\b(\d+-Core Processor|Processor|CPU|\(R\)|\(TM\))", "", info["cpu_model"])
        isa = "-avx512" if info.get("cpu_isa") == "avx512" else ""
        isa += "-amx" if info.get("cpu_amx_bf16") else ""
        name = f"{name}{isa}-{info['cpu_cores']}c"
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug or "machine"


# ------------------------------------------------------------ failures


def release(ctx: Context) -> None:
    """Frees what a benchmark left behind (and the CUDA cache) before the next."""
    gc.collect()
    if ctx.is_cuda:
        torch.cuda.synchronize(ctx.device)
        torch.cuda.empty_cache()


def error_row(name: str, err: BaseException) -> dict:
    """A row that records a benchmark's failure (its first line, and a short
    traceback in the JSON) in place of its figures."""
    first = str(err).splitlines()[0][:160] if str(err) else ""
    row = result(name, ours=0.0, torch_=None, unit="", higher_is_better=True,
                 notes=f"ERROR: {type(err).__name__}: {first}")
    row["ours"] = None
    row["error"] = traceback.format_exc(limit=4)
    return row


def guarded(ctx: Context, name: str, fn, *args) -> list:
    """``fn(ctx, *args)``'s rows, or one error row when it raises (out of
    memory, a failed capture...), so that a module's other rows survive."""
    try:
        return fn(ctx, *args)
    except Exception as e:  # noqa: BLE001  (one failure must not cost the other rows)
        traceback.print_exc()
        rows = [error_row(name, e)]
    release(ctx)  # outside the handler: the traceback no longer holds the tensors
    return rows


def run_ranks(cmds: List[List[str]], envs: List[dict], log_dir, deadline_s: float, cwd,
              tail_chars: int = 3000) -> str:
    """Runs one worker process per rank (``cmds[r]`` with ``envs[r]``, output
    to ``log_dir/rank{r}.log``) until all exit, one fails (the others would
    wait in a collective: they are killed two seconds later, once they have
    printed their own errors) or ``deadline_s`` passes. Returns the tail of
    every rank's log, for the caller's own checks of what the workers wrote;
    raises RuntimeError with those tails when a rank failed or time ran out."""
    from pathlib import Path

    log_dir = Path(log_dir)
    procs, logs = [], []
    deadline = time.monotonic() + deadline_s
    timed_out = False
    try:
        for rank, (cmd, env) in enumerate(zip(cmds, envs)):
            log = open(log_dir / f"rank{rank}.log", "w")
            logs.append(log)
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(cwd)))
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                timed_out = True
                break
            if any(p.poll() not in (None, 0) for p in procs):
                time.sleep(2.0)
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait(timeout=60)
        for log in logs:
            log.close()
    tails = "\n".join(
        f"--- rank {r} (exit {p.returncode}):\n"
        + (log_dir / f"rank{r}.log").read_text(errors="replace")[-tail_chars:]
        for r, p in enumerate(procs))
    if timed_out:
        raise RuntimeError(f"timed out after {deadline_s:.0f} s:\n{tails}")
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError(f"workers failed:\n{tails}")
    return tails


def run_worker(fn, *args) -> None:
    """A worker process's body for ``run_ranks``: ``fn(*args)``, and on an
    exception its traceback printed and the process ended at once with status
    1 (no atexit or process-group teardown that could hang on the ranks still
    waiting in a collective)."""
    try:
        fn(*args)
    except Exception:
        traceback.print_exc()
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
