"""What a user does first with an installed fusetrain wheel, run by
test_packaging.py inside a fresh virtual environment that holds only torch
and the wheel (so this file needs nothing else: no pytest, no numpy).

    python -I wheel_smoke.py            # all checks; exit 0 when every one passed

1. Every module of the package imports (``pkgutil.walk_packages``; the names
   are printed for the test to compare with the source tree), from this
   environment, and every shared library mapped from a site-packages folder
   is this environment's (none from the venv the wheel was built in).
2. One GradScaler-scaled FusedAdamW step (loss through fusetrain's
   cross-entropy) equals torch's GradScaler + AdamW step on the same model.
3. One 2-rank gloo DistributedDataParallel step on loopback: each rank's
   averaged gradients equal the single-process full-batch gradients. The
   ranks meet at a TCPStore on a free port that this process hosts; every
   wait has a timeout, and ranks still running at the deadline are killed.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

WORLD = 2
PG_TIMEOUT = timedelta(seconds=30)
DDP_DEADLINE_S = 120.0
TOL = 1e-6


def check_imports() -> None:
    import fusetrain

    # Every module pkgutil finds imports: the C++ core (fusetrain/lib, not a
    # package) is not among them, as it once was beside the modules.
    names = sorted(m.name for m in pkgutil.walk_packages(fusetrain.__path__, "fusetrain."))
    assert not any("libfusetrain" in n for n in names), names
    # The integrations need their optional libraries, which this venv lacks:
    # they must say which extra to install, in one line.
    imported, optional = [], []
    for name in names:
        try:
            importlib.import_module(name)
            imported.append(name)
        except ImportError as e:
            if 'pip install "fusetrain[' not in str(e) or "\n" in str(e):
                raise
            optional.append(name)
    print("modules:", " ".join(imported))
    print("optional:", " ".join(optional))

    prefix = os.path.realpath(sys.prefix)
    here = os.path.realpath(fusetrain.__file__)
    assert here.startswith(prefix + os.sep), f"fusetrain imported from {here}, not from {prefix}"
    with open("/proc/self/maps") as f:
        mapped = {m for m in re.findall(r"\s(/\S+)$", f.read(), re.M) if "site-packages" in m}
    foreign = sorted(p for p in mapped if not os.path.realpath(p).startswith(prefix + os.sep))
    assert not foreign, f"libraries mapped from another environment: {foreign}"
    print("imports: ok")


def check_scaled_step() -> None:
    import fusetrain
    from fusetrain.nn.functional import softmax_cross_entropy

    torch.manual_seed(0)
    ours = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 3))
    ref = copy.deepcopy(ours)
    before = [p.detach().clone() for p in ours.parameters()]
    x, y = torch.randn(16, 12), torch.randint(0, 3, (16,))

    opt = fusetrain.optim.FusedAdamW(ours.parameters(), lr=1e-2)
    scaler = fusetrain.amp.GradScaler("cpu")
    scaler.scale(softmax_cross_entropy(ours(x), y)).backward()
    scaler.step(opt)
    scaler.update()

    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_scaler = torch.amp.GradScaler("cpu")
    ref_scaler.scale(F.cross_entropy(ref(x), y)).backward()
    ref_scaler.step(ref_opt)
    ref_scaler.update()

    assert not scaler.step_was_skipped(), "the scaled step was skipped"
    assert scaler.get_scale() == ref_scaler.get_scale(), (scaler.get_scale(), ref_scaler.get_scale())
    for p, q, p0 in zip(ours.parameters(), ref.parameters(), before):
        assert not torch.equal(p, p0), "FusedAdamW left a parameter unchanged"
        err = (p - q).abs().max().item()
        assert err <= TOL, f"FusedAdamW differs from torch.optim.AdamW by {err:g}"
    print("scaled step: ok")


def ddp_rank(rank: int, port: int) -> None:
    """One rank's DDP step; raises on any mismatch."""
    import fusetrain

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=PG_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=PG_TIMEOUT)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 3))
        ref = copy.deepcopy(model)
        x, y = torch.randn(8, 6), torch.randn(8, 3)  # the same full batch on every rank
        ddp = fusetrain.parallel.DistributedDataParallel(model)
        half = slice(rank * 4, rank * 4 + 4)
        F.mse_loss(ddp(x[half]), y[half]).backward()  # gradients averaged across ranks here
        F.mse_loss(ref(x), y).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            err = (p.grad - q.grad).abs().max().item()
            assert err <= TOL, f"rank {rank}: {name}.grad differs from the full-batch gradient by {err:g}"
    finally:
        dist.destroy_process_group()


def check_ddp() -> None:
    store = dist.TCPStore("127.0.0.1", 0, WORLD, True, PG_TIMEOUT, wait_for_workers=False)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        logs = [open(Path(tmp) / f"rank{r}.log", "w+") for r in range(WORLD)]
        procs = [
            subprocess.Popen(
                [sys.executable, "-I", __file__, "--rank", str(r), "--port", str(store.port)],
                env=env, stdout=logs[r], stderr=subprocess.STDOUT,
            )
            for r in range(WORLD)
        ]
        deadline = time.monotonic() + DDP_DEADLINE_S
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        hung = [r for r, p in enumerate(procs) if p.poll() is None]
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
        failed = [r for r, p in enumerate(procs) if p.returncode != 0]
        if hung or failed:
            report = []
            for r, log in enumerate(logs):
                log.seek(0)
                report.append(f"--- rank {r} (exit {procs[r].returncode}):\n{log.read()[-3000:]}")
            raise AssertionError(
                f"DDP step: ranks {hung} still running after {DDP_DEADLINE_S:.0f} s (killed), "
                f"ranks {failed} failed\n" + "\n".join(report))
    print("ddp step: ok")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int)
    parser.add_argument("--port", type=int)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.rank is not None:
        ddp_rank(args.rank, args.port)
        return
    check_imports()
    check_scaled_step()
    check_ddp()


if __name__ == "__main__":
    main()
