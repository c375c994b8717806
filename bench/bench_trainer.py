"""The standalone trainer (`fusetrain train`, issue 5) against the equivalent
Python loop, and the default run's mixed_bfloat16 vs float32 accuracy.

1. Throughput, always: the default CNN (configs/fashion_mnist.yaml's model)
   on Fashion-MNIST, one process, same batch size, same intra-op threads,
   same fusetrain components on both sides (FusedAdamW with the same
   decay/no-decay groups, GradScaler, autocast policy, a float32 head and
   loss) and the same warm-up + cosine schedule; the Python loop indexes the
   same in-memory normalised tensors. samples/s of the trainer (its
   metrics.jsonl, first window dropped as warm-up) over samples/s of the
   Python loop (median over windows of the same size), in float32 and in
   mixed_bfloat16. Trainer and Python runs alternate. Goal: at least 1.0x.
2. The background loader (data.prefetch, issue 13): the same trainer runs
   with the loader thread (data.prefetch=2, the default on CUDA: batches
   gathered on a thread of their own, through pinned memory and a copy stream)
   against data.prefetch=0 (the default on a CPU: each step gathers its batch
   itself, from data on the device), on the CNN and on the character GPT of
   configs/gpt_text.yaml.
   Step time = 1 / steps per second from metrics.jsonl. On the GPU box, the
   loader's host-to-device path against device-resident data, eager and with
   CUDA graphs.
3. Accuracy, opt-in (about 15-20 minutes on 2 cores): the default run
   (`fusetrain train --config configs/fashion_mnist.yaml`, 2 processes) in
   mixed_bfloat16 and in float32 with the same seed: test accuracies (goal:
   within 0.5 points) and the speed ratio. Enable it with
   FUSETRAIN_BENCH_ACCURACY=1 in the environment, or run this file directly:
   ``python bench/bench_trainer.py --accuracy``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.append(str(ROOT / "python"))  # after the environment's own fusetrain (e.g. a TORCH_VERSION build's)

from common import Context, result  # noqa: E402

NAME = "trainer"

BIN = Path(os.environ.get("FUSETRAIN_BUILD_DIR", ROOT / "build")) / "fusetrain"
DEFAULT_CONFIG = ROOT / "configs" / "fashion_mnist.yaml"
# The throughput rows compare the trainer's step with a Python loop over the
# CNN 16/32/128 (one conv a block): the architecture is pinned, whatever the
# default config's is.
BENCH_CNN = ("--set", "model.channels=[16,32]", "--set", "model.convs_per_block=1")
FASHION = Path(os.environ.get("FUSETRAIN_FASHION_MNIST", "/usr/share/datasets/fashion-mnist"))
SPEED_GOAL = 1.0  # issue 5: the trainer at least as fast as the Python loop
ACCURACY_POINTS = 0.5  # issue 5: bf16 within 0.5 points of fp32

BATCH = 128
LR = 2e-3
WEIGHT_DECAY = 0.05
WARMUP = 20


def _idx(name: str) -> torch.Tensor:
    raw = gzip.open(FASHION / name).read()
    ndim = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return torch.from_numpy(np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).copy()).view(*shape)


def fashion_train(n: int):
    """The trainer's normalisation: statistics of the whole training set."""
    images = _idx("train-images-idx3-ubyte.gz")
    labels = _idx("train-labels-idx1-ubyte.gz").long()
    x = images.double() / 255.0
    mean, std = x.mean().item(), x.std().item()
    x = ((images[:n].float() / 255.0 - mean) / std).unsqueeze(1).contiguous()
    return x, labels[:n].contiguous()


def trainer_rate(policy: str, steps: int, samples: int, threads: int, window: int, workdir: Path,
                 extra=(), config: Path = DEFAULT_CONFIG) -> float:
    run_dir = workdir / f"trainer-{policy}-{time.monotonic_ns()}"
    cmd = [str(BIN), "train", "--config", str(config), "--nproc", "1", "--threads", str(threads),
           "--precision", policy, "--run-dir", str(run_dir), "--set", f"data.train_samples={samples}",
           "--set", "data.test_samples=1000", "--set", f"train.max_steps={steps}",
           "--set", f"train.log_every={window}", "--set", f"schedule.warmup_steps={WARMUP}",
           "--set", f"optimizer.lr={LR}", "--set", f"optimizer.weight_decay={WEIGHT_DECAY}",
           "--set", f"data.batch_size={BATCH}", "--set", "output.checkpoint_every=0",
           "--set", "output.progress=lines", "--set", "output.curves=false", "--set", f"data.path={FASHION}",
           *(BENCH_CNN if config == DEFAULT_CONFIG else ()), *extra]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"fusetrain train failed ({p.returncode}):\n{p.stderr[-2000:]}")
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["samples_per_s"] for r in recs if r["kind"] == "train"][1:]  # first window: warm-up
    return statistics.median(rates)


def scripted_cnn(path: Path) -> Path:
    """The built-in CNN's architecture as a TorchScript file (model.name=torchscript)."""
    from fusetrain.load_checkpoint import Cnn

    torch.manual_seed(0)
    torch.jit.script(Cnn([1, 28, 28], [16, 32], [128], 0.0, 10)).save(str(path))
    return path


def python_rate(policy: str, steps: int, x: torch.Tensor, y: torch.Tensor, window: int,
                float32_head: bool = True) -> float:
    """The trainer's step in Python with the same fusetrain components."""
    import fusetrain.amp
    import fusetrain.optim
    from fusetrain.load_checkpoint import Cnn

    torch.manual_seed(0)
    model = Cnn([1, 28, 28], [16, 32], [128], 0.0, 10)
    if float32_head:
        fusetrain.amp.keep_float32(model.head)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = fusetrain.optim.FusedAdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=LR)
    scaler = fusetrain.amp.GradScaler("cpu", enabled=policy == "mixed_float16")
    steps_per_epoch = x.shape[0] // BATCH
    perm = torch.randperm(x.shape[0])
    times, t0 = [], time.perf_counter()
    for step in range(steps):
        lr = LR * (step + 1) / WARMUP if step < WARMUP else \
            LR * 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / max(1, steps - WARMUP)))
        for g in opt.param_groups:
            g["lr"] = lr
        b = step % steps_per_epoch
        if b == 0 and step > 0:
            perm = torch.randperm(x.shape[0])
        idx = perm[b * BATCH:(b + 1) * BATCH]
        xb, yb = x.index_select(0, idx), y.index_select(0, idx)
        opt.zero_grad(set_to_none=True)
        with fusetrain.amp.autocast(policy, device_type="cpu"):
            logits = model(xb)
        with torch.autocast("cpu", enabled=False):
            loss = F.cross_entropy(logits.float(), yb)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if (step + 1) % window == 0:
            loss.item()  # the trainer reads the loss once per window too
            now = time.perf_counter()
            times.append(now - t0)
            t0 = now
    return statistics.median(BATCH * window / t for t in times[1:])


def throughput_rows(ctx: Context) -> list:
    steps, window, repeats = (60, 10, 1) if ctx.quick else (160, 20, 2)
    samples = BATCH * steps  # one epoch: the permutation is drawn once on both sides
    x, y = fashion_train(samples)
    rows = []
    policies = ["float32"] if ctx.quick else ["float32", "mixed_bfloat16"]
    with tempfile.TemporaryDirectory(prefix="bench_trainer_") as tmp:
        # The built-in CNN, and (issue 13) the same CNN scripted in Python and
        # trained with model.name=torchscript against the eager module: no
        # float32 head on either side of that one.
        module = scripted_cnn(Path(tmp) / "cnn.pt")
        variants = [
            ("cnn", [], True,
             f"Fashion-MNIST cnn 16/32/128, batch {BATCH}, {ctx.threads} thread(s), {steps} steps, "
             f"median of {window}-step windows; 'torch' = the same step in Python with "
             f"fusetrain.optim.FusedAdamW + fusetrain.amp"),
            ("TorchScript cnn", ["--set", "model.name=torchscript", "--set", f"model.path={module}"], False,
             f"the cnn 16/32/128 scripted (torch.jit.script) and trained with model.name=torchscript, "
             f"batch {BATCH}, {ctx.threads} thread(s), {steps} steps; 'torch' = the eager module in "
             f"the same Python loop (no float32 head on either side)"),
        ]
        for label, extra, float32_head, notes in variants:
            for policy in policies:
                ours, theirs = [], []
                for _ in range(repeats):
                    ours.append(trainer_rate(policy, steps, samples, ctx.threads, window, Path(tmp), extra))
                    theirs.append(python_rate(policy, steps, x, y, window, float32_head=float32_head))
                rows.append(result(
                    f"trainer vs Python loop, {label} {policy}",
                    ours=statistics.median(ours), torch_=statistics.median(theirs), unit="samples/s",
                    higher_is_better=True, goal=SPEED_GOAL, notes=notes,
                    trainer_runs=ours, python_runs=theirs))
    return rows


def cuda_graph_rows(ctx: Context) -> list:
    """The trainer on one GPU: 16 steps per CUDA graph against eager steps
    (steps_per_execution 1), same run otherwise. A small CNN at batch 128 is
    launch-bound on an H200: what step fusion is for."""
    steps, window, k = (320, 64, 16) if ctx.quick else (960, 64, 16)
    samples = min(60000, BATCH * steps)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_trainer_cuda_") as tmp:
        for policy in ("float32", "mixed_bfloat16"):
            cuda = ["--device", "cuda", "--set", "runtime.nproc=1"]
            eager = trainer_rate(policy, steps, samples, ctx.threads, window, Path(tmp), cuda)
            fused = trainer_rate(policy, steps, samples, ctx.threads, window, Path(tmp),
                                 [*cuda, "--steps-per-execution", str(k)])
            rows.append(result(
                f"trainer CUDA graphs K={k} vs eager, cnn {policy}", ours=fused, torch_=eager,
                unit="samples/s", higher_is_better=True,
                notes=(f"fusetrain train on {torch.cuda.get_device_name(0)}, Fashion-MNIST cnn 16/32/128, "
                       f"batch {BATCH}, {steps} steps, median of {window}-step windows; baseline = the "
                       "same trainer with --steps-per-execution 1")))
    return rows


GPT_TEXT = ROOT / "configs" / "gpt_text.yaml"
KJV = ROOT / "data" / "kjv.txt"  # scripts/install-deps.sh writes it (Debian's bible-kjv-text)


def loader_rows(ctx: Context) -> list:
    """Step time with the loader thread (data.prefetch=2) over without it
    (data.prefetch=0), same trainer, alternating runs; ratio > 1: the loader
    is faster."""
    cuda = ctx.is_cuda
    repeats = 1 if ctx.quick else 3
    steps, window = ((320, 64) if ctx.quick else (960, 64)) if cuda else ((60, 10) if ctx.quick else (120, 20))
    corpus = KJV if KJV.exists() else Path("/usr/share/common-licenses/GPL-3")
    device = ["--device", "cuda"] if cuda else []
    variants = [("cnn float32", DEFAULT_CONFIG, ["--set", "data.test_samples=1000"]),
                ("gpt_text float32", GPT_TEXT, ["--set", f"data.path={corpus}", "--set", "train.eval_every=0",
                                                "--set", "data.test_samples=64", "--set", "data.batch_size=32"])]
    if cuda:
        variants.append(("cnn float32, CUDA graphs K=16", DEFAULT_CONFIG,
                         ["--set", "data.test_samples=1000", "--steps-per-execution", "16"]))
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_trainer_loader_") as tmp:
        for label, config, extra in variants:
            on, off = [], []
            for _ in range(repeats):
                for prefetch, out in ((2, on), (0, off)):
                    rate = trainer_rate("float32", steps, BATCH * steps, ctx.threads, window, Path(tmp),
                                        [*device, *extra, "--set", f"data.prefetch={prefetch}"], config=config)
                    out.append(rate)
            batch = BATCH if config == DEFAULT_CONFIG else 32
            step_on = 1e3 * batch / statistics.median(on)
            step_off = 1e3 * batch / statistics.median(off)
            where = torch.cuda.get_device_name(0) if cuda else f"{ctx.threads} thread(s)"
            rows.append(result(
                f"trainer step with the loader thread vs without, {label}{' cuda' if cuda else ''}",
                ours=step_on, torch_=step_off, unit="ms/step", higher_is_better=False,
                notes=(f"fusetrain train, {where}, {steps} steps, median of {window}-step windows over "
                       f"{repeats} run(s) each; ours = data.prefetch=2 (host data, a loader thread"
                       f"{', pinned memory + copy stream' if cuda else ''}), baseline = data.prefetch=0 "
                       f"(data on the device, gathered in the step)"
                       + (f"; corpus {corpus}" if config == GPT_TEXT else "")),
                loader_runs=on, inline_runs=off))
    return rows


def default_run(policy: str, workdir: Path) -> dict:
    """`fusetrain train` with the default config at `policy`: accuracy, wall time."""
    run_dir = workdir / f"default-{policy}"
    t0 = time.perf_counter()
    p = subprocess.run([str(BIN), "train", "--config", str(DEFAULT_CONFIG), "--precision", policy,
                        "--run-dir", str(run_dir), "--set", "output.progress=lines"],
                       capture_output=True, text=True, timeout=7200)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"default run ({policy}) failed:\n{p.stderr[-2000:]}")
    import yaml

    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())["precision"]["policy"]
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if r["kind"] == "eval"]
    out = dict(policy=resolved, accuracy=evals[-1]["accuracy"], wall_s=wall,
               samples_per_s=statistics.mean(r["samples_per_s"] for r in evals))
    print(f"  default run {policy} ({resolved}): accuracy {100 * out['accuracy']:.2f}%, "
          f"{out['samples_per_s']:.0f} samples/s, {wall:.0f} s", file=sys.stderr, flush=True)
    return out


def accuracy_rows(workdir: Path) -> list:
    """The default run end to end (issue 14): precision auto, float32 and
    mixed_bfloat16 with the same seed, and the same run in plain PyTorch
    (bench/plain_torch_default_run.py) at the precision auto chose. Wall
    times include start-up and data loading on both sides."""
    out = {"auto": default_run("auto", workdir)}
    for policy in ("float32", "mixed_bfloat16"):
        out[policy] = out["auto"] if out["auto"]["policy"] == policy else default_run(policy, workdir)
    auto = out["auto"]
    p = subprocess.run([sys.executable, str(HERE / "plain_torch_default_run.py"), "--precision", auto["policy"]],
                       capture_output=True, text=True, timeout=7200)
    if p.returncode != 0:
        raise RuntimeError(f"plain PyTorch default run failed:\n{p.stderr[-2000:]}")
    plain = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"  plain PyTorch {auto['policy']}: accuracy {100 * plain['accuracy']:.2f}%, {plain['wall_s']:.0f} s",
          file=sys.stderr, flush=True)
    bf16, fp32 = out["mixed_bfloat16"], out["float32"]
    points = 100 * (bf16["accuracy"] - fp32["accuracy"])
    return [
        result("default run accuracy, mixed_bfloat16 vs float32", ours=100 * bf16["accuracy"],
               torch_=100 * fp32["accuracy"], unit="%", higher_is_better=True,
               notes=(f"configs/fashion_mnist.yaml, 2 processes, same seed: {points:+.2f} points "
                      f"({'within' if abs(points) <= ACCURACY_POINTS else 'outside'} the "
                      f"{ACCURACY_POINTS} goal); wall {bf16['wall_s']:.0f} s vs {fp32['wall_s']:.0f} s"),
               accuracy_points=points, meets_accuracy_goal=abs(points) <= ACCURACY_POINTS),
        result("default run speed, mixed_bfloat16 vs float32", ours=bf16["samples_per_s"],
               torch_=fp32["samples_per_s"], unit="samples/s", higher_is_better=True,
               notes="2 processes; bf16 is faster only where the CPU computes it natively (AMX-BF16, AVX512-BF16)"),
        result(f"default run, fusetrain train (auto -> {auto['policy']}) vs plain PyTorch", ours=auto["wall_s"],
               torch_=plain["wall_s"], unit="s", higher_is_better=False, goal=1.25,
               notes=(f"wall time of the whole run, 2 processes on gloo; accuracy {100 * auto['accuracy']:.2f}% vs "
                      f"{100 * plain['accuracy']:.2f}%; plain PyTorch = torch DDP + "
                      f"{'autocast + ' if auto['policy'] != 'float32' else ''}AdamW(fused=True), same model, "
                      "data, schedule and batch (bench/plain_torch_default_run.py)"),
               fusetrain_accuracy=auto["accuracy"], torch_accuracy=plain["accuracy"]),
    ]


def run(ctx: Context) -> list:
    if not BIN.exists():
        print(f"  trainer: {BIN} is missing; build it first", file=sys.stderr)
        return []
    if not (FASHION / "train-images-idx3-ubyte.gz").exists():
        print("  trainer: Fashion-MNIST is missing (apt-get install dataset-fashion-mnist)", file=sys.stderr)
        return []
    if ctx.is_cuda:
        return cuda_graph_rows(ctx) + loader_rows(ctx)
    rows = throughput_rows(ctx) + loader_rows(ctx)
    if os.environ.get("FUSETRAIN_BENCH_ACCURACY") == "1":
        with tempfile.TemporaryDirectory(prefix="bench_trainer_acc_") as tmp:
            rows += accuracy_rows(Path(tmp))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--accuracy", action="store_true", help="also the default run's bf16 vs fp32 accuracy (long)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.accuracy:
        os.environ["FUSETRAIN_BENCH_ACCURACY"] = "1"
    ctx = Context(device=torch.device("cpu"), quick=args.quick, threads=torch.get_num_threads(), warmup=1, repeats=1)
    for row in run(ctx):
        ratio = "n/a" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        print(f"{row['benchmark']}: ours {row['ours']:.2f} {row['unit']}, baseline {row['torch']:.2f}, "
              f"ratio {ratio}; {row['notes']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
