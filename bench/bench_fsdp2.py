"""FSDP2 on the CPU (and on one GPU): the optimizer step over
``fully_shard``'s DTensor parameters with fusetrain's FusedAdamW against
torch's AdamW, fused and foreach.

Issue 41: "CPU, 2 ranks, a 10M-parameter model under FSDP2: step time with
FusedAdamW vs torch.optim.AdamW(fused=True) and vs foreach (goal >= 1.0x and
>= 1.2x), in one interleaved run". The goals apply to the optimizer step
(``opt.step()``, the part that differs between the configurations); the
whole training step (``zero_grad``, forward, cross-entropy, backward, step)
is reported beside it.

Setup: 2 ranks, gloo on loopback, one intra-op thread per rank
(``torch.set_num_threads(1)``, ``OMP_NUM_THREADS=1``: the ranks share the
machine's cores, two on the reference machine). A pre-LN GPT (``--size
default``: 8 layers, d_model 256, 4 heads, MLP 1024, context 64, vocabulary
8192, untied head, no qkv bias; 10.5M float32 parameters in 94 tensors), ``fully_shard``
on every block and at the root (FSDP2's defaults: ``reshard_after_forward``,
float32), batch 8 x 64 tokens per rank. Three configurations, each with its
own model from the same seed, on the same batches:

1. ``fusetrain.optim.FusedAdamW`` (the baseline of the ratios);
2. ``torch.optim.AdamW(fused=True)``;
3. ``torch.optim.AdamW(foreach=True)``;

all with lr 1e-3, weight decay 0.01, default betas and eps. ``--size tiny``
(2 layers, d_model 64, vocabulary 512) checks that the script runs.

Method: one pair of worker processes (this file with ``--worker --rank R``)
rendezvous on a TCPStore that this process hosts on a free loopback port,
with a deadline after which they are killed. Every iteration visits every
configuration in an order rotated by one each iteration; a visit is a
``dist.barrier()`` and one training step, timed with ``perf_counter``: the
whole step, and ``opt.step()`` alone. ``--warmup`` iterations (3), then
``--steps`` timed (30). Rank 0's medians are reported, rank 1's are in the
JSON. Ratios: torch's median / FusedAdamW's (> 1: ours faster).

Correctness: FusedAdamW's and torch's fused AdamW end within 1e-5 of each
other (max |difference| of the final parameters; the two compute the update
in different operation orders, see test_optim.py's Note [Trajectory
tolerance]); checked on rank 0, printed and kept in the JSON.

CUDA (``--device cuda``; issue 41's GPU rows, run by ``make gpu-check``): one
rank (NCCL refuses two ranks on one GPU), NCCL, ``torch.cuda.set_device(0)``,
the models built on the GPU and the batches moved there before the timed
loop, ``fully_shard`` on a 1-rank mesh: the parameters are still DTensors, so
this measures what DTensor parameters cost each step (torch's foreach path
over DTensors is where the reported slowdown is), not communication. Float32
parameters, no autocast, as on the CPU; the same interleaving and rotation.
Every timed region is bracketed by ``torch.cuda.synchronize()`` (the whole
step: from a synchronize before ``zero_grad`` to one after ``opt.step()``;
``opt.step()``: from a synchronize after the backward to one after the step),
so the times are wall clock and include the host's dispatch, which CUDA
events on the current stream would hide behind the GPU's queue, and FSDP2's
own streams are covered. ``--size large`` (8 layers, d_model 1024, 16 heads,
MLP 4096, vocabulary 8192: 117M parameters) is the GPU's second size; on an
H100 either size takes well under a minute. On CUDA the forward and backward
need not be bitwise reproducible (the attention backward), so the
FusedAdamW-vs-fused-AdamW difference is printed as on the CPU but is not an
exact check there. ``FT_BENCH_FSDP2_DRYRUN=1`` runs the CUDA path's code (one
rank, the synchronizes as no-ops) on the CPU with gloo, to check it where
there is no GPU. Issue 41's goals were set for the CPU; the CUDA table shows
them for reference.

Writes ``bench/results/fsdp2-<machine>-<date>.json`` (``fsdp2-tiny-...`` for
``--size tiny``, ``fsdp2-large-...`` for ``--size large``; ``--results-dir``
elsewhere, ``--no-write`` not at all) and prints a table. ``<machine>`` is
``common.machine_slug``'s, as for every benchmark: the CPU on the CPU, the GPU
(e.g. ``nvidia-h100-80gb-hbm3``) on CUDA.

    .venv/bin/python bench/bench_fsdp2.py [--device cpu|cuda] [--size default|tiny|large]
        [--steps 30] [--warmup 3] [--results-dir DIR] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
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

WORLD = 2  # ranks on the CPU
WORLD_CUDA = 1  # ranks on CUDA: one GPU, and NCCL refuses two ranks on one GPU
THREADS = 1  # per rank, on the CPU
LR = 1e-3
WEIGHT_DECAY = 0.01
BATCH = 8  # sequences per rank
DEADLINE_S = 900.0
MATCH_TOL = 1e-5  # FusedAdamW vs torch's fused AdamW, max |difference| of the final parameters
GOALS = {"torch_fused": 1.0, "torch_foreach": 1.2}  # opt.step() ratio torch / ours

SIZES = {
    # layers, d_model, heads, MLP width, context, vocabulary
    "default": dict(layers=8, d_model=256, heads=4, hidden=1024, context=64, vocab=8192),
    "tiny": dict(layers=2, d_model=64, heads=2, hidden=128, context=16, vocab=512),
    # for the GPU: 117M parameters in 94 tensors
    "large": dict(layers=8, d_model=1024, heads=16, hidden=4096, context=64, vocab=8192),
}

CONFIGS = {
    "fusetrain": "fusetrain FusedAdamW",
    "torch_fused": "torch AdamW(fused=True)",
    "torch_foreach": "torch AdamW(foreach=True)",
}
BASELINE = "fusetrain"
DRYRUN_ENV = "FT_BENCH_FSDP2_DRYRUN"  # =1: --device cuda's code on the CPU (gloo)


def _dry_run() -> bool:
    return os.environ.get(DRYRUN_ENV) == "1"


def _world(device: str) -> int:
    return WORLD_CUDA if device == "cuda" else WORLD


def _no_sync() -> None:
    pass


def build_model(size: dict):
    """A pre-LN GPT with causal SDPA and an untied head, float32."""
    from torch import nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            d = size["d_model"]
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            # (no qkv bias: a key bias has a zero gradient, whose rounding noise
            # Adam would turn into full steps that differ between the optimizers)
            self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d)
            self.up, self.down = nn.Linear(d, size["hidden"]), nn.Linear(size["hidden"], d)

        def forward(self, x):
            b, t, d = x.shape
            h = size["heads"]
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.down(F.gelu(self.up(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            d = size["d_model"]
            self.embed = nn.Embedding(size["vocab"], d)
            self.pos = nn.Parameter(torch.zeros(size["context"], d))
            self.blocks = nn.ModuleList([Block() for _ in range(size["layers"])])
            self.ln = nn.LayerNorm(d)
            self.head = nn.Linear(d, size["vocab"])

        def forward(self, tokens):
            x = self.embed(tokens) + self.pos[: tokens.shape[1]]
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln(x))

    return GPT()


def _make(config: str, size: dict, mesh, device: torch.device):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    if device.type == "cuda":
        with torch.device(device):  # built there: no host-side init of the large size
            model = build_model(size)
    else:
        model = build_model(size)
    # The mesh named: fully_shard's default is the accelerator's (a CUDA mesh
    # under gloo when the CPU run is on a machine with a GPU).
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if config == "fusetrain":
        import fusetrain.optim

        opt = fusetrain.optim.FusedAdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                                fused=config == "torch_fused", foreach=config == "torch_foreach")
    return model, opt


def _batches(rank: int, steps: int, size: dict):
    """Rank r's batch of step k: the same in every configuration."""
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(0, size["vocab"], (BATCH, size["context"] + 1), generator=g) for _ in range(steps)]


def worker(args) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    world = _world(args.device)
    on_gpu = args.device == "cuda" and not _dry_run()
    if args.device == "cpu":
        torch.set_num_threads(THREADS)
    store = dist.TCPStore("127.0.0.1", args.port, None, False, timedelta(seconds=60))
    if on_gpu:
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
        dist.init_process_group("nccl", store=store, rank=args.rank, world_size=world,
                                timeout=timedelta(seconds=120), device_id=device)
        sync = torch.cuda.synchronize  # the whole device: the current stream and FSDP2's own
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", store=store, rank=args.rank, world_size=world,
                                timeout=timedelta(seconds=120))
        sync = _no_sync
    mesh = init_device_mesh(device.type, (world,))
    size = SIZES[args.size]
    configs = list(CONFIGS)
    # the same order on every rank: fully_shard is collective
    made = {c: _make(c, size, mesh, device) for c in configs}
    nparams = sum(p.numel() for p in made[BASELINE][0].parameters())
    ntensors = len(list(made[BASELINE][0].parameters()))
    steps = args.warmup + args.steps
    # on the device before the loop: no host-to-device copy in a timed region
    batches = [b.to(device) for b in _batches(args.rank, steps, size)]
    sync()
    whole = {c: [] for c in configs}
    opt_only = {c: [] for c in configs}
    for k in range(steps):
        r = (k - args.warmup) % len(configs)
        for config in configs[r:] + configs[:r]:
            model, opt = made[config]
            tokens = batches[k]
            if world > 1:
                dist.barrier()
            sync()  # (on CUDA: nothing of the last visit's still queued)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
            sync()
            t1 = time.perf_counter()
            opt.step()
            sync()
            t2 = time.perf_counter()
            if k >= args.warmup:
                whole[config].append(t2 - t0)
                opt_only[config].append(t2 - t1)
    full = {c: torch.cat([p.full_tensor().reshape(-1) for p in made[c][0].parameters()]) for c in configs}
    diffs = {c: float((full[c] - full[BASELINE]).abs().max()) for c in configs}
    found = {
        "rank": args.rank,
        "nparams": nparams,
        "ntensors": ntensors,
        "whole_s": whole,
        "opt_s": opt_only,
        "max_param_diff_vs_fusetrain": diffs,
        "threads": torch.get_num_threads(),
        "device": str(device),
        "world": world,
    }
    if on_gpu:
        props = torch.cuda.get_device_properties(device)
        found.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            gpu_sms=props.multi_processor_count,
            gpu_capability=f"{props.major}.{props.minor}",
            cuda_max_memory_allocated_gib=round(torch.cuda.max_memory_allocated(device) / 2**30, 2),
        )
        try:
            found["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001  (a label: not worth the measurements)
            found["nccl"] = None
    Path(args.out, f"result-rank{args.rank}.json").write_text(json.dumps(found))
    if world > 1:
        dist.barrier()
    if args.device == "cuda":
        sync()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's teardown (and, on the CPU, the process group's)


def run_workers(args) -> list:
    """The workers (two on the CPU, one on CUDA); their findings (raises with
    the logs' tails on failure)."""
    import torch.distributed as dist

    world = _world(args.device)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="fusetrain_bench_fsdp2_") as tmp:
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
        if args.device == "cpu":
            env["OMP_NUM_THREADS"] = str(THREADS)
        cmds = [[sys.executable, str(Path(__file__).resolve()), "--worker", "--rank", str(rank),
                 "--port", str(store.port), "--out", tmp, "--steps", str(args.steps),
                 "--warmup", str(args.warmup), "--size", args.size, "--device", args.device]
                for rank in range(world)]
        logs_text = run_ranks(cmds, [env] * world, tmp, args.deadline, HERE)
        outs = [Path(tmp) / f"result-rank{r}.json" for r in range(world)]
        if not all(o.exists() for o in outs):
            raise RuntimeError(f"workers wrote no results:\n{logs_text}")
        return [json.loads(o.read_text()) for o in outs]


def _ms(xs):
    return [x * 1e3 for x in xs]


def main(argv) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cpu: 2 ranks on gloo (default); cuda: 1 rank on NCCL, GPU 0")
    ap.add_argument("--size", choices=sorted(SIZES), default="default",
                    help="the model: the ~10M-parameter GPT (default), a tiny one that checks the script runs, "
                         "or a 117M-parameter one (large, meant for --device cuda)")
    ap.add_argument("--steps", type=int, default=30, help="timed iterations (every configuration once each)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--deadline", type=float, default=DEADLINE_S,
                    help="seconds after which the workers are killed (default %(default)g)")
    ap.add_argument("--results-dir", type=Path, default=HERE / "results", help="where the JSON goes")
    ap.add_argument("--no-write", action="store_true", help="print the table only")
    args = ap.parse_args(argv)
    if args.worker:
        run_worker(worker, args)
        return

    cuda = args.device == "cuda"
    dry = cuda and _dry_run()
    if cuda and not dry:
        import torch.distributed as dist

        # (in this process only the runtime's device count: the GPU itself is the worker's)
        if not torch.cuda.is_available():
            print(f"bench_fsdp2: --device cuda but torch {torch.__version__} sees no GPU "
                  f"(built with CUDA {torch.version.cuda})", file=sys.stderr)
            sys.exit(2)
        if not dist.is_nccl_available():
            print(f"bench_fsdp2: --device cuda but torch {torch.__version__} has no NCCL", file=sys.stderr)
            sys.exit(2)
    world = _world(args.device)
    info = {
        **launcher_info(THREADS),
        "device": args.device,
        "world": world,
        "backend": ("gloo (dry run of the CUDA path)" if dry else "nccl") if cuda else "gloo (loopback)",
    }
    size = SIZES[args.size]
    if cuda:
        print(f"bench_fsdp2: {world} rank on {'the CPU (DRY RUN of the CUDA path, gloo)' if dry else 'GPU 0, NCCL'}, "
              f"GPT {size} under fully_shard (per block + root) on a {world}-rank mesh (DTensor parameters), "
              f"batch {BATCH}x{size['context']} tokens; {args.warmup} warm-up + {args.steps} timed iterations of "
              f"the {len(CONFIGS)} configurations interleaved, synchronize() around each timed region", flush=True)
    else:
        print(f"bench_fsdp2: {WORLD} ranks x {THREADS} thread(s) on {info['cpu_cores']} cores ({info['cpu_model']}), "
              f"gloo, GPT {size} under fully_shard (per block + root), batch {BATCH}x{size['context']} tokens/rank; "
              f"{args.warmup} warm-up + {args.steps} timed iterations of the {len(CONFIGS)} configurations "
              f"interleaved; load average {info['loadavg_start']:.2f}", flush=True)
    t0 = time.monotonic()
    ranks = run_workers(args)
    load_end = load_averages()
    info["loadavg_end"] = load_end[0]
    info["loadavg_1_5_15_end"] = load_end
    r0 = ranks[0]
    if cuda:
        info["threads_per_rank"] = r0["threads"]
        info["torch_cuda"] = torch.version.cuda
        for k in ("gpu", "gpu_memory_gib", "gpu_sms", "gpu_capability", "nccl", "cuda_max_memory_allocated_gib"):
            if k in r0:
                info[k] = r0[k]
    where = f" on {r0['gpu']}" if r0.get("gpu") else ""
    print(f"  done in {time.monotonic() - t0:.0f} s{where}", flush=True)

    base_opt = statistics.median(r0["opt_s"][BASELINE])
    base_whole = statistics.median(r0["whole_s"][BASELINE])
    rows = []
    for config, label in CONFIGS.items():
        opt_ms, whole_ms = _ms(r0["opt_s"][config]), _ms(r0["whole_s"][config])
        row = {
            "config": config,
            "label": label,
            "opt_step_median_ms": statistics.median(opt_ms),
            "opt_step_min_ms": min(opt_ms),
            "opt_step_max_ms": max(opt_ms),
            "whole_step_median_ms": statistics.median(whole_ms),
            "whole_step_min_ms": min(whole_ms),
            "whole_step_max_ms": max(whole_ms),
            "opt_step_ms_per_rank": [_ms(r["opt_s"][config]) for r in ranks],
            "whole_step_ms_per_rank": [_ms(r["whole_s"][config]) for r in ranks],
            "max_param_diff_vs_fusetrain": r0["max_param_diff_vs_fusetrain"][config],
        }
        if config != BASELINE:
            row["opt_step_speedup"] = statistics.median(r0["opt_s"][config]) / base_opt
            row["opt_step_best_of_speedup"] = min(r0["opt_s"][config]) / min(r0["opt_s"][BASELINE])
            row["whole_step_speedup"] = statistics.median(r0["whole_s"][config]) / base_whole
            row["goal"] = GOALS[config]
            row["meets_goal"] = row["opt_step_speedup"] >= GOALS[config]
        rows.append(row)

    print()
    print(f"{r0['nparams'] / 1e6:.2f}M parameters in {r0['ntensors']} tensors; rank 0's medians (min-max) over "
          f"{args.steps} iterations" + (f" on {args.device}" if cuda else ""))
    print("| optimizer | opt.step() ms | whole step ms | opt.step() ours faster | best-of | whole step | goal |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        fmt = (f"{row['opt_step_median_ms']:.2f} ({row['opt_step_min_ms']:.2f}-{row['opt_step_max_ms']:.2f})",
               f"{row['whole_step_median_ms']:.1f} ({row['whole_step_min_ms']:.1f}-{row['whole_step_max_ms']:.1f})")
        if row["config"] == BASELINE:
            print(f"| {row['label']} | {fmt[0]} | {fmt[1]} | (baseline) | | | |")
        else:
            met = "met" if row["meets_goal"] else "NOT met"
            print(f"| {row['label']} | {fmt[0]} | {fmt[1]} | {row['opt_step_speedup']:.2f}x | "
                  f"{row['opt_step_best_of_speedup']:.2f}x | {row['whole_step_speedup']:.2f}x | "
                  f">= {row['goal']:.1f}x {met} |")
    diff = r0["max_param_diff_vs_fusetrain"]["torch_fused"]
    print(f"\nfinal parameters, FusedAdamW vs torch's fused AdamW: max |difference| {diff:.2e} "
          f"({'ok' if diff <= MATCH_TOL else 'OVER'} the {MATCH_TOL:g} bound)")
    cores = info["cpu_cores"]
    if cores and info["loadavg_start"] > cores / 2:
        print(f"WARNING: load average {info['loadavg_start']:.2f} on {cores} cores before the run: the machine was busy")
    if cuda and "cuda_max_memory_allocated_gib" in r0:
        print(f"peak CUDA memory allocated: {r0['cuda_max_memory_allocated_gib']:.2f} GiB (the three configurations)")
    if args.no_write:
        return

    out_dir = args.results_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    sized = f"-{args.size}" if args.size != "default" else ""
    dryrun = "-dryrun" if dry else ""
    # machine_slug names the GPU where there is one, as for every benchmark's CUDA results
    slug = machine_slug(dict(info, gpu=r0.get("gpu")))
    out = out_dir / f"fsdp2{sized}{dryrun}-{slug}-{datetime.date.today().isoformat()}.json"
    if cuda:
        timing = ("one process (1 rank, NCCL, GPU 0) holds all three configurations; every iteration visits each "
                  "(order rotated by one per iteration): torch.cuda.synchronize(), then one training step timed "
                  "whole (to a synchronize after opt.step()) and opt.step() alone (between a synchronize after the "
                  "backward and one after the step), perf_counter wall clock; medians; *_speedup: torch's median "
                  "/ FusedAdamW's")
    else:
        timing = ("one pair of processes holds all three configurations; every iteration visits each (order "
                  "rotated by one per iteration): a barrier, then one training step timed whole and opt.step() "
                  "alone; medians of rank 0; *_speedup: torch's median / FusedAdamW's")
    placement = f", on {args.device}, fully_shard on a {world}-rank mesh" if cuda else ""
    payload = {
        "benchmark": "fsdp2",
        "device": args.device,
        "machine": info,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "model": f"GPT {size}, float32, fully_shard per block and at the root{placement}, cross-entropy",
        "nparams": r0["nparams"],
        "ntensors": r0["ntensors"],
        "batch_per_rank": [BATCH, size["context"]],
        "lr": LR,
        "weight_decay": WEIGHT_DECAY,
        "warmup": args.warmup,
        "steps": args.steps,
        "timing": timing,
        "goals": {f"opt_step_speedup {c}": f">= {g}" for c, g in GOALS.items()},
        "max_param_diff_bound": MATCH_TOL,
        "rows": rows,
    }
    if cuda:
        payload["goals_note"] = "issue 41 set the goals for the CPU (2 ranks); shown on CUDA for reference"
        payload["max_param_diff_note"] = ("on CUDA the forward and backward need not be bitwise reproducible "
                                          "(the attention backward): the bound is not an exact check there")
    if dry:
        payload["dry_run"] = f"{DRYRUN_ENV}=1: the CUDA path's code on the CPU with gloo; not a CUDA measurement"
    out.write_text(json.dumps(payload, indent=1) + "\n")
    try:
        shown = out.relative_to(HERE.parent)
    except ValueError:
        shown = out
    print(f"\nwrote {shown}")


if __name__ == "__main__":
    main(sys.argv[1:])
