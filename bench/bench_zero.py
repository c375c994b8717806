"""ZeRO stages 1 and 2 on the CPU: step time and memory per rank against
unsharded DDP and against torch's ZeroRedundancyOptimizer.

Issue: "CPU gloo 2 ranks, ~10M-parameter model: step time of stage 1/2 vs
unsharded fusetrain DDP and vs torch's ZeroRedundancyOptimizer + torch DDP;
peak resident memory per rank for each". Goals: stage 1 and stage 2 faster
than torch's ZeroRedundancyOptimizer (ratio torch ZeRO / ours > 1) and within
10% of unsharded fusetrain DDP (ratio ours / unsharded <= 1.10).

Setup: 2 ranks, gloo on loopback, CPU, one intra-op thread per rank
(``torch.set_num_threads(1)``, ``OMP_NUM_THREADS=1``: the two ranks share the
machine's cores, two on the reference machine), an fp32 MLP of 9.45M
parameters (1024-2048-2048-1024-1024-10, the model of bench_ddp.py: 37.8 MB
of gradients, two 25 MB-capped buckets), batch 64 per rank, cross-entropy,
AdamW lr 1e-3 (default betas, eps, weight decay 1e-2). Seven configurations:

1. ``fusetrain DDP + FusedAdamW``: unsharded, the baseline of the ratios;
2. ``stage 1``: fusetrain DDP + ``fusetrain.optim.ZeroRedundancyOptimizer``
   (FusedAdamW over each rank's slices);
3. ``stage 2``: ``DistributedDataParallel(shard_gradients=True)`` + the same
   ZeroRedundancyOptimizer, made after the DDP;
4. ``torch ZeRO``: torch's DDP + ``torch.distributed.optim.
   ZeroRedundancyOptimizer(optimizer_class=torch.optim.AdamW)``;
5. ``torch DDP + AdamW``: torch's unsharded baseline (torch's default AdamW);
6. and 7. stage 1 and 2 with ``parameters_as_bucket_view=True`` (stage 1 also
   with DDP's ``gradient_as_bucket_view``): the all-gather lands in the
   parameters, no pack and unpack copies;
8. and 9. the same with ``overlap_all_gather=True``: ``step`` returns with
   the all-gathers in flight and each layer's forward waits for its own
   bucket (on gloo; on fusetrain's group the collectives run on the calling
   thread, so there is nothing to overlap).

Method: two passes, each in its own worker processes (this file with
``--worker NAME --rank R``) that rendezvous on a TCPStore this process hosts
on a free loopback port, have a deadline and are killed past it. A step is
``zero_grad(set_to_none=True)``, forward, loss, backward, ``opt.step()``,
timed alone with ``perf_counter`` after a ``dist.barrier()`` so that the
ranks start it aligned; rank 0's times are reported (rank 1's are in the
JSON).

a. Isolated: each configuration in its own pair of workers (``--worker
   CONFIG``), so that its memory (below) and peak resident set are its own
   and its final parameters can be checked; 3 warm-up steps, then 15 timed.
   A failed configuration becomes a row with its error and the others go on.
   These step times are kept ("isolated" in the table and the JSON) but give
   no ratio: the configurations run one after the other, and on a 2-core
   machine the load changes between them (min-max spreads of 130-370 ms were
   seen), which shows in a ratio of two such medians.
b. Interleaved (``--worker interleaved``): one pair of workers holds all the
   configurations at once, each with its own model (same seed, so the same
   initial weights), its own DDP (fusetrain's and torch's coexist in one
   process, as in bench_ddp.py) and its own optimizer, all on the default
   process group (both ranks issue their collectives in the same order, so
   they can share it). Every iteration visits every configuration, in an
   order rotated by one each iteration; a visit is a barrier, then two steps
   of that configuration, the second one timed (so an overlapped all-gather
   is waited for by the next step's forward, as in training, and not hidden
   behind the other configurations' steps); 3 warm-up iterations, then 28
   timed. The isolated pass waits for an overlapped all-gather inside the
   step (no credit for the overlap).
   A load change on the machine now hits every configuration alike, within
   ~1.5 s, so the ratios ("vs ft DDP", "vs torch ZeRO") and the goal checks
   come from this pass's medians; the table's min-max is its spread.

The load average (1 minute) is recorded before and after the whole run and
around the interleaved pass (the two workers themselves add about 2).

Memory, per rank: optimizer state (numel * element_size of the tensors of
dim > 0 in the local optimizer's state: ``opt.optim.state`` for both ZeROs,
``opt.state`` unsharded), gradients after the last backward (``p.grad`` plus,
for stage 2, the reducer's ``grad_pieces()``; DDP's own bucket copies are not
counted) and the peak RSS (``ru_maxrss``) at the end, which includes the
interpreter, torch and the batches (the same in every configuration).

Correctness: every configuration starts from the same seed and sees the same
batches (rank r's batch of step k is the same everywhere), so the final
parameters of configurations 1, 2, 3, 6 and 7 must agree within 1e-5 (the
update is elementwise; the sharded optimizers only split it). Every rank saves its flat parameters;
this process compares them (also rank 0 against rank 1, which must be equal).
The interleaved workers compare each configuration's final parameters with
unsharded fusetrain's in place (JSON ``interleaved_max_param_diff_vs_ft_ddp``).

``--backend fusetrain`` runs every configuration (torch's too) on
fusetrain's process group instead: gloo with the shared-memory collectives in
front (Note [Shared-memory allreduce] in csrc/dist/shared_memory.h), where
the reduce-scatter and the all-gather of ZeRO take the segment as DDP's
allreduce does.

Writes ``bench/results/zero-<machine>-<date>.json`` (``zero-shm-...`` with
``--backend fusetrain``).
    .venv/bin/python bench/bench_zero.py [--backend gloo|fusetrain] [--steps 15] [--warmup 3] [--interleaved-steps 28]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from common import launcher_info, load_averages, machine_slug, run_ranks, run_worker  # noqa: E402

WORLD = 2
BATCH = 64  # per rank
IN_FEATURES = 1024
CLASSES = 10
LR = 1e-3
THREADS = 1  # per rank
DEADLINE_S = 300.0  # per configuration
MATCH_TOL = 1e-5  # stage 1/2 vs unsharded fusetrain, max abs difference
SPEED_GOAL = 1.10  # stage 1/2 at most 10% slower than unsharded fusetrain DDP

# name -> label; the first is the baseline of the ratios
CONFIGS = {
    "ft_ddp": "fusetrain DDP + FusedAdamW",
    "stage1": "stage 1 (ft DDP + ft ZeRO)",
    "stage2": "stage 2 (shard_gradients + ft ZeRO)",
    "stage1_view": "stage 1, parameters_as_bucket_view",
    "stage2_view": "stage 2, parameters_as_bucket_view",
    "stage1_overlap": "stage 1, bucket view, overlap_all_gather",
    "stage2_overlap": "stage 2, bucket view, overlap_all_gather",
    "torch_zero": "torch DDP + torch ZeRO (AdamW)",
    "torch_ddp": "torch DDP + AdamW",
}
BASELINE = "ft_ddp"
BACKENDS = {"gloo": "gloo (loopback)", "fusetrain": "fusetrain (gloo + shared memory)"}
FUSETRAIN_CONFIGS = ("ft_ddp", "stage1", "stage2", "stage1_view", "stage2_view", "stage1_overlap", "stage2_overlap")
SHARDED = ("stage1", "stage2", "stage1_view", "stage2_view", "stage1_overlap", "stage2_overlap")


def build_model():
    """9.45M parameters in 5 layers of uneven sizes (bench_ddp.py's)."""
    from torch import nn

    return nn.Sequential(
        nn.Linear(IN_FEATURES, 2048), nn.ReLU(),
        nn.Linear(2048, 2048), nn.ReLU(),
        nn.Linear(2048, 1024), nn.ReLU(),
        nn.Linear(1024, 1024), nn.ReLU(),
        nn.Linear(1024, CLASSES),
    )


def _mib(nbytes) -> float:
    return nbytes / 2**20


# ====================================================================== worker


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None and t.dim() > 0)


def _state_bytes(state) -> int:
    if state is None:
        return 0
    return _tensor_bytes(v for s in state.values() for v in s.values() if isinstance(v, torch.Tensor))


def _make(config: str, model):
    """(wrapped model, optimizer, the optimizer whose .state is this rank's)."""
    if config in FUSETRAIN_CONFIGS:
        import fusetrain
        import fusetrain.optim
        import fusetrain.parallel

        view = config.endswith(("_view", "_overlap"))
        ddp = fusetrain.parallel.DistributedDataParallel(
            model, shard_gradients=config.startswith("stage2"), gradient_as_bucket_view=view and config.startswith("stage1"))
        if config == "ft_ddp":
            opt = fusetrain.optim.FusedAdamW(model.parameters(), lr=LR)
            return ddp, opt, opt
        opt = fusetrain.optim.ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=fusetrain.optim.FusedAdamW, lr=LR,
            parameters_as_bucket_view=view, overlap_all_gather=config.endswith("_overlap"),
        )
        return ddp, opt, opt.optim
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    ddp = TorchDDP(model)
    if config == "torch_zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
        return ddp, opt, opt.optim
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    return ddp, opt, opt


def _batches(rank: int, steps: int):
    """Rank r's batch of step k: the same in every configuration and pass."""
    g = torch.Generator().manual_seed(1000 + rank)
    return [
        (torch.randn(BATCH, IN_FEATURES, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g))
        for _ in range(steps)
    ]


def _init_group(args):
    import torch.distributed as dist

    torch.set_num_threads(THREADS)
    if args.backend == "fusetrain":
        import fusetrain.parallel  # noqa: F401 - registers the backend (and serves the torch rows too)
    store = dist.TCPStore("127.0.0.1", args.port, None, False, timedelta(seconds=60))
    dist.init_process_group(args.backend, store=store, rank=args.rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))


def _ft_version():
    # (only where the configuration imported it: the torch rows run without fusetrain)
    return getattr(sys.modules["fusetrain"], "__version__", None) if "fusetrain" in sys.modules else None


def _finish() -> None:
    import torch.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the process group's teardown


def worker(args) -> None:
    """One configuration alone (the isolated pass)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    _init_group(args)
    rank = args.rank
    torch.manual_seed(0)
    model = build_model()
    nparams = sum(p.numel() for p in model.parameters())
    steps = args.warmup + args.steps
    batches = _batches(rank, steps)
    ddp, opt, local = _make(args.worker, model)

    def step(k):
        x, y = batches[k]
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        # Alone, one step after a barrier: the all-gather is waited for here
        # (the isolated pass gives overlap_all_gather no credit; the
        # interleaved pass measures it).
        if hasattr(opt, "finish_all_gather"):
            opt.finish_all_gather()
        return loss

    for k in range(args.warmup):
        step(k)
    times = []
    for k in range(args.warmup, steps):
        dist.barrier()
        t0 = time.perf_counter()
        loss = step(k)
        times.append(time.perf_counter() - t0)

    # The last backward's gradients are still there (zero_grad comes first in a step).
    params = list(model.parameters())
    grad_bytes = _tensor_bytes(p.grad for p in params)
    pieces_bytes = 0
    if args.worker.startswith("stage2"):
        pieces_bytes = _tensor_bytes(ddp.reducer.grad_pieces())
    state_bytes = _state_bytes(local.state if local is not None else None)
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    torch.save(flat, Path(args.out, f"params-rank{rank}.pt"))
    found = {
        "rank": rank,
        "nparams": nparams,
        "steps_timed": args.steps,
        "warmup": args.warmup,
        "step_s": times,
        "final_loss": float(loss.detach()),
        "param_grad_bytes": grad_bytes,
        "grad_pieces_bytes": pieces_bytes,
        "grad_bytes": grad_bytes + pieces_bytes,
        "state_bytes": state_bytes,
        "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "threads": torch.get_num_threads(),
        "fusetrain": _ft_version(),
    }
    Path(args.out, f"result-rank{rank}.json").write_text(json.dumps(found))
    _finish()


def interleaved_worker(args) -> None:
    """All the configurations in one process, one step of each per iteration
    in a rotated order (the interleaved pass)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    _init_group(args)
    rank = args.rank
    configs = args.only or list(CONFIGS)
    steps = args.warmup + args.steps
    batches = _batches(rank, 2 * steps)
    made = {}
    for config in configs:  # the same order on both ranks: the constructors are collectives
        torch.manual_seed(0)
        model = build_model()
        ddp, opt, _ = _make(config, model)
        made[config] = (model, ddp, opt)

    def step(config, k):
        _, ddp, opt = made[config]
        x, y = batches[k]
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        return loss

    n = len(configs)
    times = {c: [] for c in configs}
    losses = {}
    orders = []
    for k in range(steps):
        r = (k - args.warmup) % n  # timed iteration i starts with configs[i % n]
        order = configs[r:] + configs[:r]
        if k >= args.warmup:
            orders.append(order)
        for config in order:
            # Two steps a visit, the second timed, no barrier between them: a
            # step's forward then waits only for its predecessor's pending
            # all-gather (overlap_all_gather), as in training, not for
            # communication the other configurations' steps would have hidden.
            # (A barrier would wait for it: gloo's waits for all prior work.)
            dist.barrier()
            step(config, 2 * k)
            t0 = time.perf_counter()
            loss = step(config, 2 * k + 1)
            dt = time.perf_counter() - t0
            if k >= args.warmup:
                times[config].append(dt)
            losses[config] = float(loss.detach())

    flats = {c: torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for c, (m, _, _) in made.items()}
    diffs = {}
    if BASELINE in flats:
        diffs = {c: float((f - flats[BASELINE]).abs().max()) for c, f in flats.items()}
    found = {
        "rank": rank,
        "configs": configs,
        "steps_timed": args.steps,
        "warmup": args.warmup,
        "orders": orders,
        "step_s": times,
        "final_loss": losses,
        "max_param_diff_vs_ft_ddp": diffs,
        "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "threads": torch.get_num_threads(),
        "fusetrain": _ft_version(),
    }
    Path(args.out, f"result-rank{rank}.json").write_text(json.dumps(found))
    _finish()


# ====================================================================== parent


def run_config(config: str, args, steps: int = None, only=None) -> dict:
    """Runs two workers (one configuration's, or ``"interleaved"``: those of
    ``only``); returns both ranks' findings and their flat parameters where
    they saved them (raises with the logs' tails on failure)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix=f"fusetrain_bench_zero_{config}_") as tmp:
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS=str(THREADS))
        cmds = []
        for rank in range(WORLD):
            cmd = [
                sys.executable, str(Path(__file__).resolve()), "--worker", config, "--rank", str(rank),
                "--port", str(store.port), "--out", tmp, "--steps", str(args.steps if steps is None else steps),
                "--warmup", str(args.warmup), "--backend", args.backend,
            ]
            cmds.append(cmd + (["--only", *only] if only else []))
        logs_text = run_ranks(cmds, [env] * WORLD, tmp, args.deadline, HERE)
        outs = [Path(tmp) / f"result-rank{r}.json" for r in range(WORLD)]
        if not all(o.exists() for o in outs):
            raise RuntimeError(f"workers wrote no results:\n{logs_text}")
        ranks = [json.loads(o.read_text()) for o in outs]
        flats = [torch.load(p) for p in (Path(tmp) / f"params-rank{r}.pt" for r in range(WORLD)) if p.exists()]
    del store
    return {"ranks": ranks, "flats": flats, "log_tail": logs_text[-1500:]}


def _fmt(x, spec=".1f", none="-"):
    return none if x is None else format(x, spec)


def _ms(seconds):
    return [t * 1e3 for t in seconds]


def main(argv) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=sorted(CONFIGS) + ["interleaved"])
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--out", default="")
    ap.add_argument("--steps", type=int, default=15, help="timed steps of each isolated configuration")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--interleaved-steps", type=int, default=28,
                    help="timed iterations of the interleaved pass (a multiple of the number of "
                         "configurations puts each one in each position equally often)")
    ap.add_argument("--deadline", type=float, default=DEADLINE_S)
    ap.add_argument("--only", nargs="*", choices=sorted(CONFIGS), help="a subset of the configurations")
    ap.add_argument("--backend", choices=["gloo", "fusetrain"], default="gloo",
                    help="the process group of every configuration: gloo over loopback, or fusetrain's "
                         "(gloo with the shared-memory collectives in front, Note [Shared-memory allreduce])")
    args = ap.parse_args(argv)
    if args.worker:
        run_worker(interleaved_worker if args.worker == "interleaved" else worker, args)
        return

    info = {**launcher_info(THREADS), "world": WORLD, "backend": BACKENDS[args.backend]}
    configs = args.only or list(CONFIGS)
    print(
        f"bench_zero: {WORLD} ranks x {THREADS} thread(s) on {info['cpu_cores']} cores ({info['cpu_model']}), "
        f"{BACKENDS[args.backend]}, "
        f"batch {BATCH}/rank, AdamW lr {LR}; isolated: {args.warmup} warm-up + {args.steps} timed steps per "
        f"configuration; interleaved: {args.warmup} warm-up + {args.interleaved_steps} timed iterations of all "
        f"{len(configs)}; load average {info['loadavg_start']:.2f}",
        flush=True,
    )
    found, errors = {}, {}
    t_start = time.monotonic()
    for config in configs:
        t0 = time.monotonic()
        try:
            found[config] = run_config(config, args)
            print(f"  {CONFIGS[config]}: done in {time.monotonic() - t0:.0f} s", flush=True)
        except Exception as e:  # noqa: BLE001 - one failing configuration must not cost the others
            errors[config] = f"{type(e).__name__}: {e}"
            print(f"  {CONFIGS[config]}: FAILED after {time.monotonic() - t0:.0f} s\n{errors[config]}", flush=True)

    # The interleaved pass: every configuration in one pair of processes.
    inter, inter_error = None, None
    load_inter_start = load_averages()
    t0 = time.monotonic()
    try:
        inter = run_config("interleaved", args, steps=args.interleaved_steps, only=configs)
        print(f"  interleaved pass ({len(configs)} configurations): done in {time.monotonic() - t0:.0f} s",
              flush=True)
    except Exception as e:  # noqa: BLE001 - the isolated results still get written
        inter_error = f"{type(e).__name__}: {e}"
        print(f"  interleaved pass: FAILED after {time.monotonic() - t0:.0f} s\n{inter_error}", flush=True)
    load_inter_end = load_averages()
    load_end = load_averages()
    info["loadavg_interleaved_start"] = load_inter_start[0]
    info["loadavg_interleaved_end"] = load_inter_end[0]
    info["loadavg_end"] = load_end[0]
    info["loadavg_1_5_15_end"] = load_end
    info["interleaved_wall_s"] = round(time.monotonic() - t0, 1)
    info["wall_s"] = round(time.monotonic() - t_start, 1)

    nparams = next((f["ranks"][0]["nparams"] for f in found.values()), None)
    info["nparams"] = nparams
    versions = [f["ranks"][0]["fusetrain"] for f in found.values()] + ([inter["ranks"][0]["fusetrain"]] if inter else [])
    info["fusetrain"] = next((v for v in versions if v), None)
    iso_med = {c: statistics.median(f["ranks"][0]["step_s"]) * 1e3 for c, f in found.items()}
    int_med = {}
    if inter is not None:
        int_med = {c: statistics.median(t) * 1e3 for c, t in inter["ranks"][0]["step_s"].items()}
    base_ms = int_med.get(BASELINE)
    iso_base_ms = iso_med.get(BASELINE)
    base_flat = found[BASELINE]["flats"][0] if BASELINE in found else None

    rows = []
    for config in configs:
        row = {"config": config, "label": CONFIGS[config]}
        if inter is not None:
            ms0 = _ms(inter["ranks"][0]["step_s"][config])
            ms1 = _ms(inter["ranks"][1]["step_s"][config])
            row.update(
                median_ms=int_med[config],
                min_ms=min(ms0),
                max_ms=max(ms0),
                median_ms_rank1=statistics.median(ms1),
                step_ms_rank0=ms0,
                step_ms_rank1=ms1,
                ratio_vs_ft_ddp=(int_med[config] / base_ms) if base_ms else None,
                interleaved_final_loss=inter["ranks"][0]["final_loss"][config],
                interleaved_max_param_diff_vs_ft_ddp=[
                    r["max_param_diff_vs_ft_ddp"].get(config) for r in inter["ranks"]],
            )
            if "torch_zero" in int_med:
                row["speedup_vs_torch_zero"] = int_med["torch_zero"] / int_med[config]
        if config in found:
            f = found[config]
            r0 = f["ranks"][0]
            ms = _ms(r0["step_s"])
            row.update(
                isolated_median_ms=iso_med[config],
                isolated_min_ms=min(ms),
                isolated_max_ms=max(ms),
                isolated_step_ms_rank0=ms,
                isolated_step_ms_rank1=_ms(f["ranks"][1]["step_s"]),
                isolated_median_ms_rank1=statistics.median(f["ranks"][1]["step_s"]) * 1e3,
                isolated_ratio_vs_ft_ddp=(iso_med[config] / iso_base_ms) if iso_base_ms else None,
                state_bytes=[r["state_bytes"] for r in f["ranks"]],
                grad_bytes=[r["grad_bytes"] for r in f["ranks"]],
                param_grad_bytes=[r["param_grad_bytes"] for r in f["ranks"]],
                grad_pieces_bytes=[r["grad_pieces_bytes"] for r in f["ranks"]],
                peak_rss_mib=[r["peak_rss_kib"] / 1024 for r in f["ranks"]],
                final_loss=r0["final_loss"],
                ranks_identical=bool(torch.equal(f["flats"][0], f["flats"][1])),
            )
            if "torch_zero" in iso_med:
                row["isolated_speedup_vs_torch_zero"] = iso_med["torch_zero"] / iso_med[config]
            if base_flat is not None:
                row["max_param_diff_vs_ft_ddp"] = float((f["flats"][0] - base_flat).abs().max())
        else:
            row["error"] = errors[config][-6000:]
        if config in SHARDED:
            # the goals: from the interleaved medians only
            if "speedup_vs_torch_zero" in row:
                row["meets_torch_zero_goal"] = row["speedup_vs_torch_zero"] > 1.0
            if row.get("ratio_vs_ft_ddp") is not None:
                row["meets_ddp_goal"] = row["ratio_vs_ft_ddp"] <= SPEED_GOAL
            if "max_param_diff_vs_ft_ddp" in row:
                row["params_match"] = row["max_param_diff_vs_ft_ddp"] <= MATCH_TOL
        rows.append(row)

    # ------------------------------------------------------------- table
    print()
    print(
        f"MLP {nparams / 1e6:.2f}M params fp32, batch {BATCH}/rank, {WORLD} ranks x {THREADS} thread on "
        f"{info['cpu_cores']} cores ({info['cpu_model']}), torch {torch.__version__}; rank 0's step times: interleaved pass "
        f"{args.interleaved_steps} iterations (all configurations, rotated order), isolated {args.steps} steps "
        f"per configuration"
        if nparams else "no configuration ran"
    )
    print(f"load average (1 min): {info['loadavg_start']:.2f} at the start, {info['loadavg_interleaved_start']:.2f} "
          f"-> {info['loadavg_interleaved_end']:.2f} around the interleaved pass, {info['loadavg_end']:.2f} at the end "
          f"(the {WORLD} workers themselves add about {WORLD * THREADS})")
    if inter_error:
        print(f"INTERLEAVED PASS FAILED (no ratios, no goal checks): {' '.join(inter_error.split())[:300]}")
    print()
    print("| config | median ms | min-max ms | isolated median (min-max) ms | vs ft DDP | vs torch ZeRO "
          "| state MiB/rank | grad MiB/rank | peak RSS MiB/rank | max param diff vs ft DDP |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        if "median_ms" in row:
            med_s, spread = f"{row['median_ms']:.1f}", f"{row['min_ms']:.1f}-{row['max_ms']:.1f}"
        else:
            med_s, spread = "-", "-"
        vs_tz = f"{row['speedup_vs_torch_zero']:.2f}x" if "speedup_vs_torch_zero" in row else ""
        vs_ddp = _fmt(row.get("ratio_vs_ft_ddp"), ".3f")
        if "error" in row:
            first = " ".join(row["error"].split())[:160]
            print(f"| {row['label']} | {med_s} | {spread} | ERROR | {vs_ddp} | {vs_tz} | {first} | | | |")
            continue
        print(
            f"| {row['label']} | {med_s} | {spread} "
            f"| {row['isolated_median_ms']:.1f} ({row['isolated_min_ms']:.1f}-{row['isolated_max_ms']:.1f}) "
            f"| {vs_ddp} | {vs_tz} "
            f"| {' / '.join(f'{_mib(b):.1f}' for b in row['state_bytes'])} "
            f"| {' / '.join(f'{_mib(b):.1f}' for b in row['grad_bytes'])} "
            f"| {' / '.join(f'{m:.0f}' for m in row['peak_rss_mib'])} "
            f"| {_fmt(row.get('max_param_diff_vs_ft_ddp'), '.2e')} |"
        )
    print()
    print("median, min-max: the interleaved pass (every configuration in one pair of processes, one step of each per "
          "iteration, order rotated); isolated: each configuration alone in its own processes, one after the other "
          "(memory and the parameter check come from these runs; their medians give no ratio, the load changes "
          "between them). Per-rank columns are rank 0 / rank 1. vs ft DDP: interleaved median / unsharded fusetrain "
          f"DDP's (goal for stage 1/2: <= {SPEED_GOAL:.2f}); vs torch ZeRO: torch ZeRO's interleaved median / ours "
          "(> 1: ours faster). grad: p.grad (+ the reducer's grad_pieces() for stage 2), DDP's bucket copies not "
          "counted. Param diff: max |final flat parameters - unsharded fusetrain's| on rank 0 after the isolated "
          f"runs (stage 1/2 must be <= {MATCH_TOL:g}; the torch rows use torch's AdamW, so differ by rounding).")
    for row in rows:
        if "error" not in row and not row["ranks_identical"]:
            print(f"WARNING: {row['label']}: rank 0 and rank 1 end with different parameters")
        if row.get("params_match") is False:
            print(f"WARNING: {row['label']}: parameters differ from unsharded fusetrain by "
                  f"{row['max_param_diff_vs_ft_ddp']:.2e} > {MATCH_TOL:g}")
        inter_diff = [d for d in row.get("interleaved_max_param_diff_vs_ft_ddp") or [] if d is not None]
        if row["config"] in SHARDED and inter_diff and max(inter_diff) > MATCH_TOL:
            print(f"WARNING: {row['label']}: in the interleaved pass, parameters differ from unsharded fusetrain by "
                  f"{max(inter_diff):.2e} > {MATCH_TOL:g}")
    # (only the start's: during the run the two workers themselves load the machine by about 2)
    cores = info["cpu_cores"]
    if cores and info["loadavg_start"] > cores / 2:
        print(f"WARNING: load average {info['loadavg_start']:.2f} on {cores} cores before the run: the machine "
              "was busy")

    # ------------------------------------------------------------- JSON
    out_dir = HERE / "results"
    out_dir.mkdir(exist_ok=True)
    shm = "-shm" if args.backend == "fusetrain" else ""
    out = out_dir / (f"zero{shm}-{machine_slug(info)}-"
                     f"{datetime.date.today().isoformat()}.json")
    payload = {
        "benchmark": "zero",
        "machine": info,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "model": "MLP 1024-2048-2048-1024-1024-10 fp32, cross-entropy",
        "nparams": nparams,
        "batch_per_rank": BATCH,
        "lr": LR,
        "warmup": args.warmup,
        "steps": args.steps,
        "interleaved_steps": args.interleaved_steps,
        "timing": ("median_ms/min_ms/max_ms/step_ms_*, ratio_vs_ft_ddp, speedup_vs_torch_zero and the goal checks: "
                   "the interleaved pass (all configurations in one pair of processes, one step of each per "
                   "iteration, order rotated by one every iteration, a barrier before every step); isolated_*: "
                   "each configuration alone in its own processes, run one after the other"),
        "interleaved_orders_rank0": inter["ranks"][0]["orders"] if inter else None,
        "interleaved_peak_rss_mib": [r["peak_rss_kib"] / 1024 for r in inter["ranks"]] if inter else None,
        "interleaved_error": inter_error[-6000:] if inter_error else None,
        "goals": {"speedup_vs_torch_zero": "> 1", "ratio_vs_ft_ddp": f"<= {SPEED_GOAL}",
                  "max_param_diff_vs_ft_ddp": f"<= {MATCH_TOL}"},
        "rows": rows,
    }
    out.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"\nwrote {out.relative_to(HERE.parent)}")


if __name__ == "__main__":
    main(sys.argv[1:])
