"""Step time across hosts (issue 12): the same `fusetrain train` run as one
host x 2 processes (loopback) and as 2 hosts x 1 process (network namespaces
joined by a veth bridge, scripts/netns-hosts.sh), then with host 1's link
shaped: 1% loss at 50 Mbit/s (tbf + nftables), and 100 ms latency with 1%
loss where the kernel has netem.

The step time is the median over metrics.jsonl windows (log_every steps
each; windows holding an evaluation are outliers the median ignores) of the
run's steps; variants run interleaved, `--repeats` times each, and the
median run is reported with its ratio to one host. Every shaped run is also
checked to end with the unshaped run's parameters bit for bit.

Needs root (network namespaces); writes bench/results/multihost-<machine>-<date>.json.

    sudo .venv/bin/python bench/bench_multihost.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests" / "python"))
sys.path.insert(0, str(HERE))

from common import machine_info, machine_slug  # noqa: E402
from netns_hosts import netns_check, netns_hosts_up  # noqa: E402

BIN = Path(os.environ.get("FUSETRAIN_BUILD_DIR", ROOT / "build")) / "fusetrain"
MODELS = {
    # configs/tiny.yaml's CNN: 26 K parameters, latency-bound allreduces.
    "cnn-tiny": [],
    # The same with a 1024-wide hidden layer: 0.8 M parameters, 3.3 MB of
    # gradients per step, so the link's bandwidth shows.
    "cnn-wide": ["--set", "model.hidden=1024"],
}
_DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def env() -> Dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _DIST_VARS}


def step_time(run_dir: Path) -> float:
    records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    per_step = [(b["time_s"] - a["time_s"]) / (b["step"] - a["step"]) for a, b in zip(train, train[1:])]
    return statistics.median(per_step)


def final(run_dir: Path) -> Dict[str, torch.Tensor]:
    state = torch.load(sorted((run_dir / "checkpoints").glob("step_*.pt"))[-1])
    return {k: v for k, v in state.items() if k.startswith(("model.", "optim."))}


def run_variant(hosts, variant: str, model_args: List[str], run_dir: Path, port: int) -> None:
    common = ["train", "--config", str(ROOT / "configs" / "tiny.yaml"), "--run-dir", str(run_dir),
              "--set", "output.checkpoint_every=0", "--set", "train.log_every=2", *model_args]
    if variant == "1 host x 2":
        subprocess.run([str(BIN), *common, "--nproc", "2"], check=True, capture_output=True,
                       env=env(), timeout=600)
        return
    procs = [hosts.popen(i, [str(BIN), *common, "--nnodes", "2", "--node-rank", str(i),
                             "--master-addr", hosts.addr(0), "--master-port", str(port)],
                         env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for i in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=900)
        if p.returncode != 0:
            raise RuntimeError(f"{variant} failed:\n{err.decode()[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    reason = netns_check()
    if reason:
        sys.exit(f"bench_multihost needs network namespaces: {reason}")
    variants = ["1 host x 2", "2 hosts x 1", "2 hosts x 1, 1% loss, 50 Mbit/s",
                "2 hosts x 1, 100 ms, 1% loss (netem)"]
    times: Dict[str, Dict[str, List[float]]] = {m: {v: [] for v in variants} for m in MODELS}
    notes: Dict[str, str] = {}
    port = 29810
    with netns_hosts_up(2) as hosts, tempfile.TemporaryDirectory() as tmp:
        for model, model_args in MODELS.items():
            for rep in range(args.repeats):
                reference = None
                for variant in variants:
                    if "loss" in variant:
                        ok = (hosts.shape(1, loss_pct=1, rate_mbit=50) if "netem" not in variant
                              else hosts.shape(1, delay_ms=100, loss_pct=1))
                        if not ok:
                            notes[variant] = "not run: this kernel has no netem (CONFIG_NET_SCH_NETEM)"
                            continue
                    run_dir = Path(tmp) / f"{model}-{rep}-{variants.index(variant)}"
                    port += 1
                    try:
                        run_variant(hosts, variant, model_args, run_dir, port)
                    finally:
                        hosts.unshape(1)
                    times[model][variant].append(step_time(run_dir))
                    state = final(run_dir)
                    if reference is None:
                        reference = state
                    elif any(not torch.equal(state[k], reference[k]) for k in reference):
                        raise SystemExit(f"{model}, {variant}: parameters differ from one host's")
                    print(f"{model:9s} {variant:40s} rep {rep}: {1e3 * times[model][variant][-1]:.2f} ms/step",
                          flush=True)

    info = machine_info(torch.device("cpu"), 1)
    rows = []
    for model in MODELS:
        base = statistics.median(times[model]["1 host x 2"])
        for variant in variants:
            ts = times[model][variant]
            row = {"model": model, "variant": variant}
            if ts:
                row.update(ms_per_step=1e3 * statistics.median(ts), ratio=statistics.median(ts) / base,
                           runs_ms=[1e3 * t for t in ts], bit_identical=True)
            else:
                row["note"] = notes.get(variant, "not run")
            rows.append(row)
    out = HERE / "results" / f"multihost-{machine_slug(info)}-{datetime.date.today().isoformat()}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"machine": info, "repeats": args.repeats, "rows": rows}, indent=1) + "\n")
    print(f"\n{info.get('cpu_model', '')}; median of {args.repeats} runs, written to {out.relative_to(ROOT)}\n")
    print("| model | placement | ms/step | vs 1 host |\n|---|---|---|---|")
    for r in rows:
        if "ms_per_step" in r:
            print(f"| {r['model']} | {r['variant']} | {r['ms_per_step']:.2f} | {r['ratio']:.2f}x |")
        else:
            print(f"| {r['model']} | {r['variant']} | {r['note']} | |")


if __name__ == "__main__":
    main()
