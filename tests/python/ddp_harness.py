"""Multi-process test runs for the DDP tests (gloo on loopback).

A test file defines scenarios ``sc_NAME(pg, rank, world) -> data`` grouped in
suites, and runs as a script for its workers (``worker_main(argv, SUITES)``
under ``if __name__ == "__main__"``). ``launch`` starts one process per rank
on that script; every rank runs the suite's scenarios in order, each on a
fresh gloo group, and saves what each found after every scenario; the pytest
tests then assert on ``findings``, one test per scenario, so a launch (a few
seconds of process start-up) serves many tests.

Never a hang: the ranks rendezvous through a TCPStore that the test process
hosts on port 0 (the kernel picks a free port); every process group has a
PG_TIMEOUT_S timeout; the launch has a deadline after which every rank is
killed and the test fails with each rank's log (a rank prints its Python
stacks just before). A rank that exits with an unexpected code, left no
results, skipped a scenario or raised in it fails the test.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Callable, Dict, List, Optional

import pytest
import torch

PG_TIMEOUT_S = 10.0  # every process group's timeout in the workers
LAUNCH_TIMEOUT_S = 180.0  # deadline for a whole launch (process start-up included, on a busy 2-core CI box)


def worker_main(argv, suites: Dict[str, List[Callable]], no_final_barrier=()) -> None:
    """A rank's process: runs the scenarios of ``--worker SUITE`` and saves
    their findings to ``--out``/rank{RANK}.pt after each."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", required=True, choices=sorted(suites))
    ap.add_argument("--out", required=True)
    ap.add_argument("--backend", default="gloo")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    import torch.distributed as dist

    if args.backend == "fusetrain":
        import fusetrain.parallel  # noqa: F401 - registers the backend with torch.distributed

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timedelta(seconds=PG_TIMEOUT_S)
    store = dist.TCPStore(
        "127.0.0.1", int(os.environ["FT_STORE_PORT"]), is_master=False, timeout=timedelta(seconds=60)
    )
    dist.init_process_group(args.backend, store=store, rank=rank, world_size=world, timeout=timeout)
    out_path = Path(args.out) / f"rank{rank}.pt"
    # A rank still running near the launch deadline prints every thread's
    # Python stack before the launcher kills it.
    faulthandler.dump_traceback_later(float(os.environ.get("FT_DDP_DEADLINE_S", LAUNCH_TIMEOUT_S)) - 10, exit=True)
    only = os.environ.get("FT_DDP_ONLY")  # debugging: a comma-separated subset
    results = {}
    for scenario in suites[args.worker]:
        name = scenario.__name__[3:]
        if only and name not in only.split(","):
            continue
        fresh = args.backend in ("gloo", "fusetrain")
        pg = dist.new_group(backend=args.backend, timeout=timeout) if fresh else None
        t0 = time.monotonic()
        try:
            results[name] = {"ok": True, "data": scenario(pg, rank, world)}
        except Exception:
            results[name] = {"ok": False, "error": traceback.format_exc()}
        results[name]["seconds"] = time.monotonic() - t0
        torch.save(results, out_path)
    sys.stdout.flush()
    sys.stderr.flush()
    if args.worker not in no_final_barrier and args.backend in ("gloo", "fusetrain"):
        dist.barrier()
    # Skip interpreter teardown (gloo's destructors after a dead peer).
    os._exit(0)


def launch(script: Path, world: int, suite: str, workdir: Path, backend: str = "gloo",
           expected_exit: Optional[dict] = None, deadline_s: float = LAUNCH_TIMEOUT_S):
    """Runs ``suite`` of ``script`` on ``world`` processes; returns each
    rank's findings (None for a rank that saved none). Fails (killing every
    rank first) past the deadline or when a rank's exit code is not the
    expected one (0 unless ``expected_exit[rank]`` says)."""
    import torch.distributed as dist

    expected_exit = expected_exit or {}
    workdir.mkdir(parents=True, exist_ok=True)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False)
    env_base = dict(os.environ)
    env_base.update(
        WORLD_SIZE=str(world),
        FT_STORE_PORT=str(store.port),
        FT_DDP_DEADLINE_S=str(deadline_s),
        MASTER_ADDR="127.0.0.1",
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
    )
    procs, logs = [], []
    for rank in range(world):
        log = open(workdir / f"rank{rank}.log", "w")
        logs.append(log)
        env = dict(env_base, RANK=str(rank), LOCAL_RANK=str(rank))
        procs.append(
            subprocess.Popen(
                [sys.executable, str(Path(script).resolve()), "--worker", suite, "--out", str(workdir),
                 "--backend", backend],
                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(workdir),
            )
        )
    deadline = time.monotonic() + deadline_s
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        hung = [r for r, p in enumerate(procs) if p.poll() is None]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait(timeout=30)
        for log in logs:
            log.close()
        del store

    def tail(r):
        text = (workdir / f"rank{r}.log").read_text(errors="replace")
        return f"--- rank {r} (exit {procs[r].returncode}) log tail:\n{text[-3000:]}"

    if hung:
        pytest.fail(f"ranks {hung} still running after {deadline_s:.0f} s (killed)\n"
                    + "\n".join(tail(r) for r in range(world)))
    bad = [r for r, p in enumerate(procs) if p.returncode != expected_exit.get(r, 0)]
    if bad:
        pytest.fail(f"ranks {bad} exited with unexpected codes "
                    f"{[procs[r].returncode for r in bad]}\n" + "\n".join(tail(r) for r in bad))
    results = []
    for r in range(world):
        path = workdir / f"rank{r}.pt"
        results.append(torch.load(path, weights_only=False) if path.exists() else None)
    return results


def findings(results, name, dies=()):
    """The scenario's data, one entry per rank (rank order) of the ranks not
    in ``dies`` (those meant to die in it, whose results it skips); fails
    where a rank left no results, did not run the scenario, or raised in it
    (with the rank's traceback)."""
    out = []
    for rank, res in enumerate(results):
        if rank in dies:
            continue
        assert res is not None, f"rank {rank} left no results file (it ran no scenario)"
        assert name in res, f"rank {rank} did not run {name} (it ran {sorted(res)})"
        entry = res[name]
        assert entry["ok"], f"{name} raised on rank {rank}:\n{entry['error']}"
        out.append(entry["data"])
    assert len(out) == len(results) - len(dies), (name, len(out), len(results), dies)
    return out
