"""DistributedDataParallel (issue 4): fusetrain's against torch's, side by
side in the same processes on the same data.

CPU (``--device cpu``), gloo, 2 ranks on loopback, an MLP with 9.45M
parameters (37.8 MB of fp32 gradients, the default 25 MB buckets):

1. ``ddp step``: zero_grad, forward, cross-entropy, backward, SGD step, ours
   and torch's DDP interleaved call by call (each with its own copy of the
   same model, fed the same batch, so they stay bit-identical: checked),
   median of rank 0's times. Goal: no slower than torch (1.0x).
2. ``ddp overlap``: how much of the communication the backward hides,
   measured, not assumed. Three times, interleaved: backward alone of an
   unwrapped copy (``t_bwd``), backward through each DDP (``t_ddp``: includes
   waiting for the last allreduce), and the same buckets allreduced alone,
   launched back to back and then awaited, as the reducer does (``t_comm``).
   exposed = t_ddp - t_bwd; hidden fraction = 1 - exposed / t_comm. The
   reducer's own figure (time from the last gradient ready to the end of the
   allreduces, ``last_exposed_comm_seconds``) is reported beside it.

GPU (``--device cuda``), NCCL, world size 1 (one GPU: NCCL refuses two
ranks on one device): a step of an MLP with ~101M parameters under bf16
autocast, batch 8192, through ours (default and gradient_as_bucket_view),
through torch's DDP, and unwrapped. Goal: DDP costs at most 2% (ratio
no-DDP / DDP >= 0.98). The row also records the forward, backward and
optimizer times and the bucket sizes that ``bench/scaling_model.py`` turns
into a multi-GPU estimate.

Every measurement runs in worker processes started here (this file with
``--worker``), rendezvousing on a TCPStore this process hosts on a free
loopback port; they have a deadline and are killed past it. Any failure
becomes a row whose notes say what went wrong; the suite goes on.
``launch_workers`` and ``worker_main`` are that machinery; bench_hooks.py
starts its own workers through them.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from common import Context, interleave, median, result, run_ranks, run_worker, spread  # noqa: E402

NAME = "ddp"

STEP_GOAL = 1.0  # issue 4: no slower than torch's DDP
OVERHEAD_GOAL = 0.98  # issue 4: at most 2% over no DDP (world size 1)
WORKER_DEADLINE_S = 900.0
CPU_WORLD = 2
CPU_BATCH = 64  # per rank
GPU_BATCH = 8192


def cpu_model() -> nn.Module:
    """9.45M parameters in 5 layers of uneven sizes."""
    return nn.Sequential(
        nn.Linear(1024, 2048), nn.ReLU(),
        nn.Linear(2048, 2048), nn.ReLU(),
        nn.Linear(2048, 1024), nn.ReLU(),
        nn.Linear(1024, 1024), nn.ReLU(),
        nn.Linear(1024, 10),
    )


def gpu_model(width: int = 4096) -> nn.Module:
    """~101M parameters: 6 layers of 4096 x 4096."""
    layers = []
    for _ in range(6):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 16))


def _nparams(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def error_row(benchmark: str, message: str, unit: str = "ms") -> dict:
    """A row that reports a failure instead of aborting the suite."""
    return {
        "benchmark": benchmark,
        "ours": None,
        "torch": None,
        "unit": unit,
        "ratio": None,
        "higher_is_better": False,
        "goal": None,
        "meets_goal": None,
        "notes": "error: " + " ".join(message.split())[:300],
        "error": message[-4000:],
    }


# ====================================================================== parent


def run(ctx: Context) -> list:
    if ctx.is_cuda:
        name = "ddp world-1 overhead, nccl"
        try:
            return _gpu_rows(ctx, launch_workers(1, "gpu", ctx))
        except Exception as e:  # noqa: BLE001 - a failing benchmark must not stop the suite
            return [error_row(name, f"{type(e).__name__}: {e}")]
    name = f"ddp step, gloo {CPU_WORLD} ranks"
    try:
        return _cpu_rows(ctx, launch_workers(CPU_WORLD, "cpu", ctx))
    except Exception as e:  # noqa: BLE001
        return [error_row(name, f"{type(e).__name__}: {e}")]


def launch_workers(
    world: int,
    mode: str,
    ctx: Context,
    *,
    script: Optional[Path] = None,
    deadline_s: float = WORKER_DEADLINE_S,
    pg_timeout_s: float = 300.0,
    worker_arg: str = "",
) -> dict:
    """Runs ``world`` workers (``script --worker mode``, this file by default,
    whose ``__main__`` calls ``worker_main``); returns rank 0's findings
    (raises with the logs' tails on failure or past ``deadline_s``).
    ``pg_timeout_s`` bounds each collective; ``worker_arg`` reaches the
    worker function as its last argument."""
    import torch.distributed as dist

    script = Path(__file__).resolve() if script is None else Path(script).resolve()

    # On the CPU the ranks share the cores: one thread each on 2 cores.
    threads = ctx.threads if mode == "gpu" else max(1, (os.cpu_count() or 2) // world)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=120), wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix=f"fusetrain_bench_{script.stem}_") as tmp:
        env = dict(os.environ)
        env.update(
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            FT_STORE_PORT=str(store.port),
            GLOO_SOCKET_IFNAME="lo",
            OMP_NUM_THREADS=str(threads),
            # the harness's import path (fusetrain may be importable only through it)
            PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
        )
        cmd = [
            sys.executable, str(script), "--worker", mode, "--out", tmp,
            "--threads", str(threads), "--warmup", str(ctx.warmup), "--repeats", str(ctx.repeats),
            "--pg-timeout", str(pg_timeout_s), "--arg", worker_arg,
        ] + (["--quick"] if ctx.quick else [])
        logs_text = run_ranks([cmd] * world, [dict(env, RANK=str(r), LOCAL_RANK=str(r)) for r in range(world)],
                              tmp, deadline_s, HERE, tail_chars=2000)
        out = Path(tmp) / "result.json"
        if not out.exists():
            raise RuntimeError(f"workers wrote no result:\n{logs_text}")
        found = json.loads(out.read_text())
    del store
    found["threads_per_rank"] = threads
    return found


def _cpu_rows(ctx: Context, f: dict) -> list:
    rows = []
    base = (
        f"MLP {f['nparams'] / 1e6:.2f}M params, batch {CPU_BATCH}/rank, {CPU_WORLD} ranks x "
        f"{f['threads_per_rank']} thread(s), buckets {f['bucket_mb']} MB"
    )
    ours, ref = f["step_ms"]["ours"], f["step_ms"]["torch"]
    rows.append(
        result(
            f"ddp step, gloo {CPU_WORLD} ranks",
            ours=ours,
            torch_=ref,
            unit="ms",
            higher_is_better=False,
            goal=STEP_GOAL,
            notes=f"{base}; no DDP {f['step_ms']['plain']:.1f} ms; params after {f['steps']} steps: "
            + ("bit-identical" if f["identical"] else "DIFFER")
            + f"; spread ours {f['step_spread']['ours']:.0%}, torch {f['step_spread']['torch']:.0%}",
            world=CPU_WORLD,
            threads_per_rank=f["threads_per_rank"],
            step_ms=f["step_ms"],
        )
    )
    o = f["overlap"]
    rows.append(
        result(
            f"ddp overlap (hidden comm), gloo {CPU_WORLD} ranks",
            ours=100.0 * o["ours"]["hidden"],
            torch_=100.0 * o["torch"]["hidden"],
            unit="%",
            higher_is_better=True,
            notes=(
                f"backward alone {o['bwd_ms']:.1f} ms, allreduce of the same buckets alone "
                f"{o['comm_ms']:.1f} ms, bucket copies {o['copies_ms']:.1f} ms; backward+sync ours "
                f"{o['ours']['bwd_ddp_ms']:.1f} ms (exposed comm {o['ours']['exposed_ms']:.1f} ms, "
                f"hidden {o['ours']['hidden_raw']:+.0%} unclamped; the reducer's own wait after the "
                f"last gradient: {o['ours']['reducer_exposed_ms']:.1f} ms), torch "
                f"{o['torch']['bwd_ddp_ms']:.1f} ms (exposed {o['torch']['exposed_ms']:.1f} ms, "
                f"{o['torch']['hidden_raw']:+.0%}); {f['threads_per_rank']} thread(s)/rank on "
                f"{os.cpu_count()} cores"
            ),
            overlap=o,
            bucket_bytes=f["bucket_bytes"],
        )
    )
    return rows


def _gpu_rows(ctx: Context, f: dict) -> list:
    rows = []
    plain = f["step_ms"]["plain"]
    base = f"MLP {f['nparams'] / 1e6:.1f}M params, batch {f['batch']}, bf16 autocast, {f['gpu']}"
    for key, label in (("ours", "ours"), ("ours_view", "ours, gradient_as_bucket_view"), ("torch", "torch DDP")):
        ms = f["step_ms"][key]
        rows.append(
            result(
                f"ddp world-1 overhead, nccl ({label})",
                ours=ms,
                torch_=plain,
                unit="ms",
                higher_is_better=False,
                goal=OVERHEAD_GOAL,
                notes=f"vs no DDP ({plain:.2f} ms): overhead {ms / plain - 1:+.1%}; {base}",
                step_ms=f["step_ms"],
            )
        )
    rows.append(
        result(
            "ddp step vs torch DDP, nccl world 1",
            ours=f["step_ms"]["ours"],
            torch_=f["step_ms"]["torch"],
            unit="ms",
            higher_is_better=False,
            goal=STEP_GOAL,
            notes=(
                f"{base}; fwd {f['fwd_ms']:.2f} ms, bwd {f['bwd_ms']:.2f} ms, opt {f['opt_ms']:.2f} ms "
                "(inputs of bench/scaling_model.py)"
            ),
            fwd_ms=f["fwd_ms"],
            bwd_ms=f["bwd_ms"],
            opt_ms=f["opt_ms"],
            grad_bytes=f["grad_bytes"],
            bucket_bytes=f["bucket_bytes"],
            gpu=f["gpu"],
            nparams=f["nparams"],
        )
    )
    return rows


# ====================================================================== worker


def worker_main(argv, workers: dict) -> None:
    """A worker process's life: joins the process group (gloo, or NCCL for
    mode "gpu"), runs ``workers[mode](ctx, rank, world, arg)``, has rank 0
    write what it returns (a JSON-able dict) for ``launch_workers`` and exits,
    0 or, after printing the traceback, 1."""
    run_worker(_worker, argv, workers)


def _worker(argv, workers: dict) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", choices=sorted(workers), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--pg-timeout", type=float, default=300.0)
    ap.add_argument("--arg", default="")
    args = ap.parse_args(argv)
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore("127.0.0.1", int(os.environ["FT_STORE_PORT"]), is_master=False,
                          timeout=timedelta(seconds=120))
    # FT_BENCH_DDP_DRYRUN=1 runs the GPU worker's code on the CPU (gloo, a
    # small model) to check it where there is no GPU.
    dry = os.environ.get("FT_BENCH_DDP_DRYRUN") == "1"
    backend = "nccl" if args.worker == "gpu" and not dry else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=args.pg_timeout))
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    ctx = Context(device=device, quick=args.quick, threads=args.threads, warmup=args.warmup,
                  repeats=args.repeats)
    found = workers[args.worker](ctx, rank, world, args.arg)
    if rank == 0:
        Path(args.out, "result.json").write_text(json.dumps(found))
    if world > 1:
        dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # skip the process group's teardown


def _bucket_bytes(ddp, params) -> list:
    return [sum(params[i].numel() * params[i].element_size() for i in b) for b in ddp.bucket_indices()]


def _cpu_worker(ctx: Context, rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from fusetrain.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    base = cpu_model()
    models = {k: copy.deepcopy(base) for k in ("ours", "torch", "plain")}
    wrapped = {"ours": DDP(models["ours"]), "torch": TorchDDP(models["torch"]), "plain": models["plain"]}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(CPU_BATCH, 1024, generator=g)
    y = torch.randint(0, 10, (CPU_BATCH,), generator=g)
    barrier = dist.barrier

    def step(k):
        opts[k].zero_grad(set_to_none=True)
        F.cross_entropy(wrapped[k](x), y).backward()
        opts[k].step()

    # 1. Whole steps: ours and torch's DDP interleaved (plain alongside for reference).
    steps_times = interleave({k: (lambda k=k: step(k)) for k in ("ours", "torch", "plain")}, ctx,
                             setup=barrier)
    identical = all(torch.equal(a, b) for a, b in zip(models["ours"].parameters(), models["torch"].parameters()))
    steps = ctx.warmup + ctx.repeats

    # 2. Overlap: forward untimed, then the backward timed; the allreduces of
    # the same buckets alone, launched in order then awaited.
    params = list(models["ours"].parameters())
    bucket_bytes = _bucket_bytes(wrapped["ours"], params)
    bucket_tensors = [torch.zeros(n // 4) for n in bucket_bytes]
    losses = {}
    reducer_exposed = []

    def forward(k):
        def fn():
            barrier()
            models[k].zero_grad(set_to_none=True)
            losses[k] = F.cross_entropy(wrapped[k](x), y)
        return fn

    def backward(k):
        def fn():
            losses[k].backward()
            if k == "ours":
                reducer_exposed.append(wrapped["ours"].last_exposed_comm_seconds())
        return fn

    def comm():
        works = [dist.all_reduce(t, async_op=True) for t in bucket_tensors]
        for w in works:
            w.wait()

    # The reducer's local work, not communication: each gradient copied into
    # its bucket slot divided by the world size, and back into param.grad.
    grads = [torch.randn_like(p) for p in params]
    slots = []
    for b, layout in zip(bucket_tensors, wrapped["ours"].bucket_indices()):
        offset = 0
        for i in layout:
            slots.append((grads[i], b[offset : offset + params[i].numel()].view_as(params[i])))
            offset += params[i].numel()

    def copies():
        for g_, view in slots:
            torch.mul(g_, 1.0 / world, out=view)
        for g_, view in slots:
            g_.copy_(view)

    fns = {k: backward(k) for k in ("plain", "ours", "torch")}
    fns["comm"] = comm
    fns["copies"] = copies
    setups = {k: forward(k) for k in ("plain", "ours", "torch")}
    setups["comm"] = barrier
    setups["copies"] = barrier
    t = interleave(fns, ctx, setup=setups)
    bwd, comm_t, copy_t = median(t["plain"]), median(t["comm"]), median(t["copies"])
    overlap = {"bwd_ms": bwd * 1e3, "comm_ms": comm_t * 1e3, "copies_ms": copy_t * 1e3}
    for k in ("ours", "torch"):
        ddp_t = median(t[k])
        # exposed communication: what DDP adds to the backward beyond its
        # local copies (an upper bound: contention slowing the backward counts too)
        exposed = ddp_t - bwd - copy_t
        overlap[k] = {
            "bwd_ddp_ms": ddp_t * 1e3,
            "exposed_ms": exposed * 1e3,
            "hidden": min(1.0, max(0.0, 1.0 - exposed / comm_t)),
            "hidden_raw": 1.0 - exposed / comm_t,
        }
    overlap["ours"]["reducer_exposed_ms"] = median(reducer_exposed[-ctx.repeats:]) * 1e3
    return {
        "nparams": _nparams(base),
        "bucket_mb": 25,
        "bucket_bytes": bucket_bytes,
        "step_ms": {k: median(v) * 1e3 for k, v in steps_times.items()},
        "step_spread": {k: spread(v) for k, v in steps_times.items()},
        "identical": identical,
        "steps": steps,
        "overlap": overlap,
    }


def _gpu_worker(ctx: Context) -> dict:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from fusetrain.parallel import DistributedDataParallel as DDP

    dev = ctx.device
    cuda = dev.type == "cuda"
    # The CPU dry run only checks the code: a small model, a small batch.
    batch, width = (GPU_BATCH, 4096) if cuda else (64, 256)
    torch.manual_seed(0)
    base = gpu_model(width).to(dev)
    kinds = ("plain", "ours", "ours_view", "torch")
    models = {k: copy.deepcopy(base) for k in kinds}
    ids = [dev.index] if cuda else None
    wrapped = {
        "plain": models["plain"],
        "ours": DDP(models["ours"], device_ids=ids),
        "ours_view": DDP(models["ours_view"], device_ids=ids, gradient_as_bucket_view=True),
        "torch": TorchDDP(models["torch"], device_ids=ids),
    }
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-4, momentum=0.9, foreach=True) for k, m in models.items()}
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(batch, width, device=dev, generator=g)
    y = torch.randint(0, 16, (batch,), device=dev, generator=g)

    def loss_of(k):
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            return F.cross_entropy(wrapped[k](x), y)

    def step(k):
        opts[k].zero_grad(set_to_none=True)
        loss_of(k).backward()
        opts[k].step()

    times = interleave({k: (lambda k=k: step(k)) for k in kinds}, ctx)

    # The scaling model's inputs, from the unwrapped model: forward, backward
    # and optimizer step timed separately (each call's other parts untimed).
    losses = {}

    def fwd():
        losses["plain"] = loss_of("plain")

    def bwd():
        losses["plain"].backward()

    def before_bwd():
        models["plain"].zero_grad(set_to_none=True)
        fwd()

    def opt_step():
        opts["plain"].step()

    def before_opt():
        models["plain"].zero_grad(set_to_none=True)
        loss_of("plain").backward()

    parts = interleave({"fwd": fwd, "bwd": bwd, "opt": opt_step}, ctx,
                       setup={"fwd": None, "bwd": before_bwd, "opt": before_opt})
    params = list(models["ours"].parameters())
    return {
        "gpu": torch.cuda.get_device_name(dev) if cuda else "CPU dry run",
        "batch": batch,
        "nparams": _nparams(base),
        "grad_bytes": sum(p.numel() * p.element_size() for p in params),
        "bucket_bytes": _bucket_bytes(wrapped["ours"], params),
        "step_ms": {k: median(v) * 1e3 for k, v in times.items()},
        "fwd_ms": median(parts["fwd"]) * 1e3,
        "bwd_ms": median(parts["bwd"]) * 1e3,
        "opt_ms": median(parts["opt"]) * 1e3,
    }


WORKERS = {
    "cpu": lambda ctx, rank, world, arg: _cpu_worker(ctx, rank, world),
    "gpu": lambda ctx, rank, world, arg: _gpu_worker(ctx),
}


if __name__ == "__main__":
    worker_main(sys.argv[1:], WORKERS)
