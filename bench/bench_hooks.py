"""DDP communication hooks (issue 11): fusetrain's DistributedDataParallel
with torch's Python hooks, with its own C++ hooks and with ``comm_dtype``,
against torch's DDP with the same hooks, side by side in the same processes.

CPU, gloo, 2 ranks on loopback, one thread each, bench_ddp's MLP (9.45M
parameters, 37.8 MB of fp32 gradients, the default buckets: 1 MB, then
25 MB). One whole step (zero_grad, forward, cross-entropy, backward, SGD
step) of every variant, interleaved call by call, each with its own copy of
the same model fed the same batch, median of rank 0's times:

- no hook: ours and torch's DDP (the baseline of the rows below);
- bf16: torch's ``bf16_compress_hook`` through ours and through torch's DDP,
  fusetrain's C++ ``"bf16"`` hook and ``comm_dtype=torch.bfloat16``, each
  against torch's DDP with ``bf16_compress_hook``. Goal: no slower (1.0x);
- PowerSGD rank 1 and 4 (``start_powerSGD_iter`` 2, measured after it
  compresses: the warm-up is longer than that): torch's ``powerSGD_hook``
  through ours, and fusetrain's C++ ``"powersgd"`` against it.

torch's DDP with ``powerSGD_hook`` over gloo hands bucket k + 1 to the hook
while bucket k's chained allreduces are still being issued from gloo's
threads, so the ranks issue their collectives in different orders and gloo
aborts the process ("Received data size doesn't match expected size"; Note
[Communication hooks] in csrc/dist/ddp.h). It is tried in workers of its own
(one launch per rank r, a 30 s collective timeout and a deadline), so its
crash costs nothing else; the row reports what happened.

The data rows are computed, not timed: the elements each rank contributes to
the allreduces per step, from the bucket layout (``ddp.bucket_indices()``)
and torch's PowerSGD rule (each gradient viewed as ``shape[0] x -1``, n x m,
is compressed to P (n x r) and Q (m x r) when (n + m) r * min_compression_rate
< n m; the rest is allreduced as is), checked against the counters of torch's
``PowerSGDState`` after the run.
"""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from bench_ddp import CPU_BATCH, CPU_WORLD, cpu_model, error_row, launch_workers, worker_main  # noqa: E402
from common import Context, interleave, median, result, spread  # noqa: E402

NAME = "hooks"

STEP_GOAL = 1.0  # issue 11: no slower than torch's DDP with the same hook
START_POWERSGD_ITER = 2  # the smallest torch allows with error feedback
MIN_COMPRESSION_RATE = 2.0  # PowerSGDState's default
PROBE_PG_TIMEOUT_S = 30.0  # a rank left waiting by a crashed peer gives up
PROBE_DEADLINE_S = 150.0


def _powersgd_ranks(quick: bool) -> tuple:
    return (1,) if quick else (1, 4)


# ====================================================================== parent


def run(ctx: Context) -> list:
    if ctx.is_cuda:
        return []  # gloo on the CPU only: one GPU gives no second rank to talk to
    try:
        found = launch_workers(CPU_WORLD, "steps", ctx, script=Path(__file__))
    except Exception as e:  # noqa: BLE001 - a failing benchmark must not stop the suite
        return [error_row(f"ddp hooks, gloo {CPU_WORLD} ranks", f"{type(e).__name__}: {e}")]
    probes = {r: _probe(ctx, r) for r in _powersgd_ranks(ctx.quick)}
    return _rows(found, probes)


def _probe(ctx: Context, r: int) -> dict:
    """torch's DDP with torch's powerSGD_hook, rank r, beside ours with the
    same hook: their times, or how torch's run failed."""
    try:
        return launch_workers(CPU_WORLD, "probe", ctx, script=Path(__file__), deadline_s=PROBE_DEADLINE_S,
                              pg_timeout_s=PROBE_PG_TIMEOUT_S, worker_arg=str(r))
    except Exception as e:  # noqa: BLE001
        return {"failed": _failure_line(str(e))}


def _failure_line(logs: str) -> str:
    """The line of the workers' logs that says why they failed: gloo's
    enforce message if one aborted, else the first exception line."""
    for pattern in (r"Received data size doesn't match expected size[^\n]*", r"what\(\):[^\n]*",
                    r"[A-Za-z.]*Error: [^\n]*"):
        hit = re.search(pattern, logs)
        if hit:
            return " ".join(hit.group(0).split())[:200]
    return " ".join(logs.split())[-200:]


def _ms(times: list) -> float:
    return median(times) * 1e3


def _rows(f: dict, probes: dict) -> list:
    t = f["times"]
    base = (
        f"MLP {f['nparams'] / 1e6:.2f}M params, batch {CPU_BATCH}/rank, {CPU_WORLD} ranks x "
        f"{f['threads_per_rank']} thread(s), buckets {f['bucket_mb']} MB; median of {f['repeats']} steps "
        f"after {f['warmup']} warm-up"
    )
    data = f["data"]
    fp32 = data["allreduce"]
    none_ms = _ms(t["ours"])

    def pair(ours_key: str, torch_key: str) -> dict:
        return {"ours": t[ours_key], "torch": t[torch_key]}

    def vs_none(key: str) -> str:
        return f"speed vs ours without a hook {none_ms / _ms(t[key]):.2f}x"

    def kb(key: str) -> str:
        return f"{data[key] / 1e3:.1f} kB/rank/step sent ({fp32 / data[key]:.1f}x less than fp32)"

    def agree(key: str) -> str:
        return f"params vs {f['agree'][key]['against']} after {f['steps']} steps: {f['agree'][key]['text']}"

    def spreads(*keys: str) -> str:
        return "spread " + ", ".join(f"{k} {f['spread'][k]:.0%}" for k in keys)

    rows = [
        result(
            f"ddp hooks: no hook, ours vs torch DDP, gloo {CPU_WORLD} ranks",
            ours=none_ms, torch_=_ms(t["torch"]), unit="ms", higher_is_better=False, goal=STEP_GOAL,
            times=pair("ours", "torch"),
            notes=f"{base}; {fp32 / 1e6:.1f} MB/rank/step sent; {agree('ours')}; {spreads('ours', 'torch')}",
        )
    ]
    for key, label in (
        ("ours_py_bf16", "torch's bf16_compress_hook (Python) in ours"),
        ("ours_bf16", 'builtin "bf16" (C++)'),
        ("ours_comm_bf16", "comm_dtype=torch.bfloat16"),
    ):
        rows.append(
            result(
                f"ddp hooks: {label} vs torch DDP + bf16_compress_hook",
                ours=_ms(t[key]), torch_=_ms(t["torch_bf16"]), unit="ms", higher_is_better=False,
                goal=STEP_GOAL, times=pair(key, "torch_bf16"),
                notes=f"{kb('bf16')}; {vs_none(key)}, torch's DDP with the hook vs without "
                f"{_ms(t['torch']) / _ms(t['torch_bf16']):.2f}x; {agree(key)}; "
                f"{spreads(key, 'torch_bf16')}",
            )
        )
    for r, probe in probes.items():
        py, cc = f"ours_py_psgd{r}", f"ours_psgd{r}"
        counted = f["powersgd_counted"][str(r)]
        check = "matches" if counted == data[f"powersgd{r}"] else f"DIFFERS: PowerSGDState counts {counted:.0f} B"
        if "failed" in probe:
            torch_ms, times = None, None
            torch_note = (
                f"torch DDP + powerSGD_hook rank {r} not measurable on gloo: it crashed ({probe['failed']}): "
                "torch's reducer hands bucket k+1 to the hook before bucket k's chained allreduces are "
                "issued, so the ranks' collectives mismatch; ours waits for bucket k's future"
            )
            ours_ms = _ms(t[py])
        else:
            # both sides from the probe's own interleaved run
            times = {"ours": probe["times"]["ours"], "torch": probe["times"]["torch"]}
            ours_ms, torch_ms = _ms(times["ours"]), _ms(times["torch"])
            d = probe["max_abs_diff"]
            torch_note = (
                f"torch DDP + powerSGD_hook survived {probe['steps']} steps this time (it often crashes on "
                "gloo: collectives issued out of order); both sides from that separate run; params vs ours: "
                + ("bit-identical" if d == 0 else f"max |diff| {d:.1e} (with this hook the two differ by "
                   "~1e-6 on 1 rank too, where no collective can be misordered)")
            )
        rows.append(
            result(
                f"ddp hooks: torch's powerSGD_hook rank {r} (Python), ours vs torch DDP",
                ours=ours_ms, torch_=torch_ms, unit="ms", higher_is_better=False, goal=STEP_GOAL,
                times=times,
                notes=f"{torch_note}; {kb(f'powersgd{r}')} ({check} torch's PowerSGDState counters); "
                f"{vs_none(py)}, vs torch DDP without a hook {_ms(t['torch']) / _ms(t[py]):.2f}x; "
                f"start_powerSGD_iter {START_POWERSGD_ITER}, warm-up {f['warmup']} steps; {spreads(py)}",
            )
        )
        rows.append(
            result(
                f'ddp hooks: builtin "powersgd" rank {r} (C++) vs torch\'s powerSGD_hook in ours',
                ours=_ms(t[cc]), torch_=_ms(t[py]), unit="ms", higher_is_better=False,
                times=pair(cc, py),
                notes=f"{kb(f'powersgd{r}')}; {vs_none(cc)}, vs torch DDP without a hook "
                f"{_ms(t['torch']) / _ms(t[cc]):.2f}x; {agree(cc)}; {spreads(cc, py)}",
            )
        )
    note = (
        "elements each rank contributes to the allreduces per step x their size (the payload, not gloo's "
        f"wire traffic), from the buckets {data['bucket_numel']} (numel)"
    )
    for key, label in [("bf16", "bf16/fp16 compression (hook or comm_dtype)")] + [
        (f"powersgd{r}", f"PowerSGD rank {r}") for r in probes
    ]:
        rows.append(
            result(
                f"ddp hooks: data sent/rank/step, {label}",
                ours=data[key] / 1e3, torch_=fp32 / 1e3, unit="kB", higher_is_better=False,
                notes=f"vs fp32 allreduce ({fp32} B); {data[key]} B; {note}",
                bytes_per_step=data[key],
            )
        )
    for row in rows:
        row.update(world=CPU_WORLD, threads_per_rank=f["threads_per_rank"], warmup=f["warmup"],
                   repeats=f["repeats"])
    rows[0]["data_bytes_per_step"] = data
    rows[0]["step_ms"] = {k: _ms(v) for k, v in t.items()}
    rows[0]["best_ms"] = {k: min(v) * 1e3 for k, v in t.items()}
    for r, probe in probes.items():
        if "times" in probe:
            rows[0][f"probe_powersgd{r}_ms"] = {k: _ms(v) for k, v in probe["times"].items()}
    return rows


# ====================================================================== worker


def _powersgd_state(r: int):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    return powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=r,
                                  start_powerSGD_iter=START_POWERSGD_ITER,
                                  min_compression_rate=MIN_COMPRESSION_RATE)


def _hooked(cls, hook, state=None, **kwargs):
    """Wraps a model in ``cls`` (ours or torch's DDP) with ``hook``; state
    None: the default process group."""
    def wrap(model):
        ddp = cls(model, **kwargs)
        ddp.register_comm_hook(state, hook)
        return ddp
    return wrap


def _builtin(name: str, **options):
    """Wraps a model in ours with one of fusetrain's C++ hooks."""
    from fusetrain.parallel import DistributedDataParallel as DDP

    def wrap(model):
        ddp = DDP(model)
        ddp.register_builtin_comm_hook(name, **options)
        return ddp
    return wrap


def _variants(quick: bool, states: dict) -> dict:
    """name -> how to wrap a model; the PowerSGDState of each variant with
    torch's powerSGD_hook is ``states[name]``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from fusetrain.parallel import DistributedDataParallel as DDP

    v = {
        "ours": DDP,
        "torch": TorchDDP,
        "ours_py_bf16": _hooked(DDP, default_hooks.bf16_compress_hook),
        "ours_bf16": _builtin("bf16"),
        "ours_comm_bf16": lambda m: DDP(m, comm_dtype=torch.bfloat16),
        "torch_bf16": _hooked(TorchDDP, default_hooks.bf16_compress_hook),
    }
    for r in _powersgd_ranks(quick):
        states[f"ours_py_psgd{r}"] = _powersgd_state(r)
        v[f"ours_py_psgd{r}"] = _hooked(DDP, powersgd.powerSGD_hook, states[f"ours_py_psgd{r}"])
        v[f"ours_psgd{r}"] = _builtin("powersgd", matrix_approximation_rank=r,
                                      start_powerSGD_iter=START_POWERSGD_ITER,
                                      min_compression_rate=MIN_COMPRESSION_RATE)
    return v


def _probe_variants(r: int) -> dict:
    """torch's powerSGD_hook, rank r, through ours ("ours") and torch's DDP."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from fusetrain.parallel import DistributedDataParallel as DDP

    return {"ours": _hooked(DDP, powersgd.powerSGD_hook, _powersgd_state(r)),
            "torch": _hooked(TorchDDP, powersgd.powerSGD_hook, _powersgd_state(r))}


class _Steps:
    """One model, optimizer and step per variant, on one shared batch."""

    def __init__(self, rank: int, wrappers: dict):
        torch.manual_seed(0)
        base = cpu_model()
        self.nparams = sum(p.numel() for p in base.parameters())
        self.models = {k: copy.deepcopy(base) for k in wrappers}
        self.wrapped = {k: wrap(self.models[k]) for k, wrap in wrappers.items()}
        self.opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in self.models.items()}
        g = torch.Generator().manual_seed(100 + rank)
        self.x = torch.randn(CPU_BATCH, 1024, generator=g)
        self.y = torch.randint(0, 10, (CPU_BATCH,), generator=g)

    def fns(self) -> dict:
        return {k: (lambda k=k: self.step(k)) for k in self.wrapped}

    def step(self, k: str) -> None:
        self.opts[k].zero_grad(set_to_none=True)
        F.cross_entropy(self.wrapped[k](self.x), self.y).backward()
        self.opts[k].step()

    def max_diff(self, a: str, b: str) -> float:
        return max((p - q).abs().max().item()
                   for p, q in zip(self.models[a].parameters(), self.models[b].parameters()))


def _warmup(ctx: Context) -> int:
    # PowerSGD allreduces plainly for start_powerSGD_iter steps and sets up
    # its state (errors, Qs) on the first compressed one: time after that.
    return max(ctx.warmup, START_POWERSGD_ITER + 2)


def _repeats(ctx: Context) -> int:
    return max(3, ctx.repeats // 2)  # whole steps: half the harness's repeats


def _powersgd_elements(shapes: list, r: int) -> int:
    """Elements one bucket of gradients of these shapes contributes to
    powerSGD_hook's allreduces (P and Q of each compressed matrix, the
    uncompressed gradients whole), by torch's rule: the gradient viewed as
    shape[0] x -1, n x m, is compressed at rank min(n, m, r) when
    (n + m) min(n, m, r) * min_compression_rate < n m."""
    elements = 0
    for shape in shapes:
        n = shape[0]
        m = torch.Size(shape).numel() // n
        compressed = (n + m) * min(n, m, r)
        elements += compressed if compressed * MIN_COMPRESSION_RATE < n * m else n * m
    return elements


def _steps_worker(ctx: Context, rank: int, world: int, arg: str) -> dict:
    import torch.distributed as dist

    states = {}
    s = _Steps(rank, _variants(ctx.quick, states))
    warmup, repeats = _warmup(ctx), _repeats(ctx)
    times = interleave(s.fns(), ctx, setup=dist.barrier, warmup=warmup, repeats=repeats)

    params = list(s.models["ours"].parameters())
    layout = s.wrapped["ours"].bucket_indices()  # after the first backward: in ready order
    bucket_numel = [sum(params[i].numel() for i in b) for b in layout]
    n = sum(bucket_numel)
    data = {"allreduce": 4 * n, "bf16": 2 * n, "bucket_numel": bucket_numel}
    counted = {}
    for r in _powersgd_ranks(ctx.quick):
        per_bucket = [4 * _powersgd_elements([params[i].shape for i in b], r) for b in layout]
        data[f"powersgd{r}"] = sum(per_bucket)
        data[f"powersgd{r}_buckets"] = per_bucket
        # torch's own count: elements after compression, summed over the compressed steps
        st = states[f"ours_py_psgd{r}"]
        counted[str(r)] = 4 * st.total_numel_after_compression / (st.iter - START_POWERSGD_ITER)
    agree = {}
    for key, ref in (("ours", "torch"), ("ours_py_bf16", "torch_bf16"), ("ours_bf16", "torch_bf16"),
                     ("ours_comm_bf16", "torch_bf16")) + tuple(
            (f"ours_psgd{r}", f"ours_py_psgd{r}") for r in _powersgd_ranks(ctx.quick)):
        d = s.max_diff(key, ref)
        agree[key] = {"against": ref, "max_abs_diff": d,
                      "text": "bit-identical" if d == 0 else f"max |diff| {d:.1e}"}
    return {
        "nparams": s.nparams,
        "bucket_mb": 25,
        "warmup": warmup,
        "repeats": repeats,
        "steps": warmup + repeats,
        "times": times,
        "spread": {k: spread(v) for k, v in times.items()},
        "data": data,
        "powersgd_counted": counted,
        "agree": agree,
    }


def _probe_worker(ctx: Context, rank: int, world: int, arg: str) -> dict:
    import torch.distributed as dist

    s = _Steps(rank, _probe_variants(int(arg)))
    warmup, repeats = _warmup(ctx), _repeats(ctx)
    times = interleave(s.fns(), ctx, setup=dist.barrier, warmup=warmup, repeats=repeats)
    # Had torch's collectives been paired wrongly without gloo noticing, its
    # model would part from ours (the same hook on the same data).
    return {"times": times, "steps": warmup + repeats, "max_abs_diff": s.max_diff("ours", "torch")}


WORKERS = {"steps": _steps_worker, "probe": _probe_worker}


if __name__ == "__main__":
    worker_main(sys.argv[1:], WORKERS)
