#!/usr/bin/env python
"""fusetrain's benchmark harness: runs every ``bench/bench_*.py`` module
(each defines ``NAME`` and ``run(ctx) -> list of rows``), prints a markdown
table and writes ``bench/results/<machine>-<YYYY-MM-DD>.json``.

    python bench/run.py [--device cpu|cuda] [--quick] [--only NAME] [--threads N]

Rows from an earlier run of the same machine and day are kept unless this run
measured the same benchmark with the same thread count and CPU path again, so ``--only``
refreshes a part of the file and a ``--threads 1`` run sits beside the default.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from common import Context, loadavg, machine_info, machine_slug, table  # noqa: E402


def discover() -> list:
    """The modules run() drives. bench_fsdp2, bench_zero and bench_multihost
    launch processes of their own and run as scripts (bench/README.md)."""
    return sorted(p.stem for p in HERE.glob("bench_*.py") if "\ndef run(ctx" in p.read_text())


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--quick", action="store_true", help="fewer repeats, fewer variants (~30 s)")
    ap.add_argument(
        "--only",
        action="append",
        metavar="NAME",
        help="run only the module NAME (e.g. amp); repeatable",
    )
    ap.add_argument(
        "--threads", type=int, default=None, help="intra-op threads (default: torch's: one a core)"
    )
    ap.add_argument(
        "--repeats", type=int, default=None, help="timed calls per variant (median reported)"
    )
    ap.add_argument(
        "--results-dir", type=Path, default=HERE / "results", help="where the JSON goes"
    )
    ap.add_argument("--no-write", action="store_true", help="print the table only")
    return ap.parse_args(argv)


def save(args, info: dict, now: datetime.datetime, command: str, ctx: Context, rows: list,
         elapsed: float) -> Path:
    """Writes this run's rows into the machine's file of the day (replacing
    earlier rows of the same benchmark, thread count, CPU path and torch) and a
    copy under $OUT when set; returns the file's path."""
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / f"{machine_slug(info)}-{now:%Y-%m-%d}.json"
    for r in rows:  # runs on several torches sit side by side
        r["torch_version"] = info["torch"]
    kept = []
    if path.exists():
        try:
            old = json.loads(path.read_text())
            for r in old.get("results", []):
                # Rows written before rows carried their torch: the file's,
                # which the last run to write it set.
                r.setdefault("torch_version", old.get("machine", {}).get("torch"))
            key = lambda r: (r["benchmark"], r.get("threads"), r.get("cpu_path"),  # noqa: E731
                             r["torch_version"])
            fresh = {key(r) for r in rows}
            kept = [r for r in old.get("results", []) if key(r) not in fresh]
        except (json.JSONDecodeError, KeyError):
            kept = []
    for r in rows:  # each row says which run it came from: the file may hold several
        r["time"] = f"{now:%Y-%m-%dT%H:%M:%S}"
        r["command"] = command
        r["loadavg"] = [info["loadavg_start"], info.get("loadavg_end")]
        r["git"] = info.get("git")
    doc = {
        "machine": info,
        "date": f"{now:%Y-%m-%d}",
        "command": command,
        "device": args.device,
        "threads": ctx.threads,
        "repeats": ctx.repeats,
        "warmup": ctx.warmup,
        "elapsed_s": round(elapsed, 1),
        "results": kept + rows,
    }
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)  # atomic: a run killed mid-write leaves the last whole file
    out = os.environ.get("OUT")
    if out and Path(out).is_dir():
        Path(out, path.name).write_text(path.read_text())
    return path


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench: --device cuda but torch sees no GPU", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()

    modules = discover()
    if args.only:
        unknown = [n for n in args.only if f"bench_{n}" not in modules]
        if unknown:
            print(f"bench: no module {unknown}; have {[m[6:] for m in modules]}", file=sys.stderr)
            return 2
        modules = [m for m in modules if m[6:] in args.only]

    ctx = Context(
        device=device,
        quick=args.quick,
        threads=threads,
        warmup=2 if args.quick else 5,
        repeats=args.repeats or (10 if args.quick else 40),
    )
    info = machine_info(device, threads)
    now = datetime.datetime.now()
    print(
        f"# fusetrain benchmarks: {info['gpu'] or info['cpu_model']}, {info['cpu_cores']} cores, "
        f"{threads} threads, torch {info['torch']}, {args.device}{', quick' if args.quick else ''}"
        f" ({now:%Y-%m-%d %H:%M})",
        flush=True,
    )
    if info["loadavg_start"] is not None and info["loadavg_start"] > 0.5 * info["cpu_cores"]:
        print(
            f"warning: load average {info['loadavg_start']} on {info['cpu_cores']} cores: "
            "something else is running; CPU ratios will be noisy",
            file=sys.stderr,
        )

    rows = []
    t_start = time.perf_counter()
    failed = []
    args_given = sys.argv[1:] if argv is None else list(argv)
    command = " ".join([os.path.relpath(sys.argv[0])] + args_given)
    for mod_name in modules:
        t0 = time.perf_counter()
        mod_rows = []
        try:
            mod = importlib.import_module(mod_name)
            for row in mod.run(ctx):
                row["module"] = mod.NAME
                row["quick"] = args.quick
                row["threads"] = threads
                row["cpu_path"] = info.get("cpu_path")  # FUSETRAIN_CPU_PATH runs sit beside the default
                mod_rows.append(row)
        except Exception:  # one broken module must not cost the others' figures
            traceback.print_exc()
            failed.append(mod_name[6:])
        rows += mod_rows
        print(f"  {mod_name[6:]}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        # Each module's rows are printed and saved as soon as it ends: a run
        # stopped by a time limit keeps what it measured.
        if mod_rows:
            print(table(mod_rows) + "\n", flush=True)
        if not args.no_write:
            save(args, info, now, command, ctx, rows, time.perf_counter() - t_start)
    info["loadavg_end"] = loadavg()
    elapsed = time.perf_counter() - t_start

    print()
    print(table(rows))
    print(
        f"\nratio: how many times better ours is (rates ours/torch, times torch/ours); "
        f"median of {ctx.repeats} interleaved calls after {ctx.warmup} warm-up; {elapsed:.0f} s"
    )
    if not args.no_write:
        path = save(args, info, now, command, ctx, rows, elapsed)
        print(f"wrote {os.path.relpath(path)}")
    if failed:
        print(f"bench: failed modules: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
