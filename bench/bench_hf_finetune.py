"""Fine-tuning a Hugging Face Llama three ways, tokens/s side by side:
``fusetrain train`` (the CLI, model.pretrained=<HF folder>) against
transformers' ``Trainer`` and against a plain PyTorch loop, on the same model,
token data and recipe. Goal: fusetrain >= 1.5x the HF Trainer.

Model: ``LlamaForCausalLM(LlamaConfig(...))`` from a fixed seed, written once
with ``save_pretrained`` (float32 safetensors); every variant starts from that
folder. Default size: hidden 512, 8 layers, 8 heads, 4 key/value heads
(grouped-query attention), MLP 1408, vocabulary 8192, context 256, untied head
(transformers' default): 32.0M parameters. ``--quick``: hidden 64, 2 layers,
vocabulary 512, context 32 (a smoke test: its figures mean nothing).
``use_cache`` is off in the saved config (a training run has no use for the
KV cache; fusetrain ignores the key).

Data: a flat uint16 token file of random "phrases" (1024 fixed random token
sequences of 8-32 tokens, concatenated in random order), so the loss falls
as the model learns them; a separate validation file of a few windows keeps
fusetrain from holding out part of the training stream. Every step is a
batch of B windows of T input tokens and their T next-token targets, drawn at
random offsets of the stream: fusetrain draws its own (its sampler); the two
Python variants draw one seeded set of windows of T + 1 tokens and feed
``input_ids = w[:, :T]``, ``labels = shift_labels = w[:, 1:]``
(transformers' loss then takes the targets as given, not shifted again, so
all three run T tokens forward and score T predictions a window).

Recipe, the same everywhere: AdamW (lr 3e-4, weight decay 0.1 on the weight
matrices and embeddings only, not the RMS norms: transformers' Trainer's
grouping and fusetrain's; betas (0.9, 0.999), eps 1e-8), constant learning
rate (no warm-up, no decay), global-norm gradient clipping at 1.0 (the
Trainer's default; ``--clip 0`` turns it off everywhere), no dropout, batch
B = 8, bf16 autocast where the CPU has bf16 in oneDNN
(``torch.ops.mkldnn._is_mkldnn_bf16_supported()``; else float32 everywhere),
the same intra-op thread count (``--threads``, default ``os.cpu_count()``).

  (a) fusetrain: ``build/fusetrain train --set model.name=llama --set
      model.pretrained=DIR --set data.name=tokens ... --set
      precision.policy=mixed_bfloat16 --nproc 1`` (the full command is
      printed and kept in the JSON; fusetrain's defaults otherwise, e.g.
      its float32 head + fused linear cross-entropy: ``--float32-head
      false`` runs the head in bf16 as autocast does in the other two).
      ``train.log_every=1``; evaluation (one batch) and the final checkpoint
      come after the last step.
  (b) ``transformers.Trainer`` on ``LlamaForCausalLM.from_pretrained(DIR)``,
      ``TrainingArguments(optim="adamw_torch_fused", bf16=..., use_cpu=True,
      lr_scheduler_type="constant", max_grad_norm=..., logging_strategy="no",
      save_strategy="no", report_to=[], dataloader_num_workers=0)``.
  (c) a plain loop over the same model: ``torch.optim.AdamW(fused=True)``
      with the same two groups, ``torch.autocast("cpu", torch.bfloat16)``,
      ``model(input_ids, labels=..., shift_labels=...).loss``, backward,
      ``clip_grad_norm_``, step, ``zero_grad(set_to_none=True)``.

Method: each variant runs in a process of its own (this file with
``--worker``, or fusetrain's binary), one after the other (``--repeats R``:
R rounds of the three, medians reported), with ``OMP_NUM_THREADS`` and
``torch.set_num_threads`` at the same count. Each runs ``--warmup`` steps
(5) then ``--steps`` timed steps (30). tokens/s = timed steps x B x T / the
wall time from the end of the last warm-up step to the end of the last
step, so everything between steps (data, logging, callbacks) counts:
fusetrain: the ``time_s`` stamps of its per-step ``metrics.jsonl`` records;
Trainer: ``on_step_end`` stamps of a ``TrainerCallback``; plain loop:
``perf_counter`` after each step. The JSON also has every step's time and
each side's narrower figure (fusetrain: its own ``samples_per_s``, the time
between its host synchronisations; Trainer: ``on_step_begin`` to
``on_step_end``, no data loading). Start-up, loading and the final
evaluation/checkpoint are outside the timing; the process's wall time is
reported beside it. Peak RSS: ``ru_maxrss`` of each process (``os.wait4``).
The losses (first step, mean of the last five) are printed as a check that
all three train.

Writes ``bench/results/hf_finetune-<machine>-<date>.json``
(``hf_finetune-quick-...`` with ``--quick``; ``--results-dir`` elsewhere,
``--no-write`` not at all) and prints a markdown table.

    .venv/bin/python bench/bench_hf_finetune.py [--quick] [--steps 30] [--warmup 5]
        [--threads N] [--batch 8] [--seq-len 256] [--hidden 512] [--layers 8]
        [--heads 8] [--kv-heads 4] [--intermediate 1408] [--vocab 8192]
        [--precision auto|bf16|fp32] [--repeats 1] [--only fusetrain,hf,plain]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.append(str(ROOT / "python"))  # after the environment's own fusetrain (e.g. a TORCH_VERSION build's)

from common import load_averages, machine_info, machine_slug, result, table  # noqa: E402

BIN = Path(os.environ.get("FUSETRAIN_BUILD_DIR", ROOT / "build")) / "fusetrain"
GOAL = 1.5  # fusetrain train >= 1.5x the HF Trainer's tokens/s
VARIANTS = ("fusetrain", "hf", "plain")
LABELS = {"fusetrain": "fusetrain train (CLI)", "hf": "HF Trainer", "plain": "plain PyTorch loop"}
LAST = 5  # the final loss: mean over the last LAST steps


# ------------------------------------------------------------------ data


def make_tokens(n: int, vocab: int, seed: int, phrases: int = 1024) -> np.ndarray:
    """A stream of n token ids: fixed random phrases (8-32 tokens) in random order."""
    rng = np.random.default_rng(seed)
    table = [rng.integers(0, vocab, int(rng.integers(8, 33)), dtype=np.int64) for _ in range(phrases)]
    out, filled = [], 0
    while filled < n:
        for i in rng.integers(0, phrases, 4096):
            out.append(table[i])
            filled += table[i].size
    return np.concatenate(out)[:n].astype(np.uint16)


def windows(stream: np.ndarray, count: int, t: int, seed: int) -> torch.Tensor:
    """count windows of t + 1 tokens at seeded random offsets, as int64 [count, t + 1]."""
    starts = np.random.default_rng(seed).integers(0, stream.size - t - 1 + 1, count)
    idx = starts[:, None] + np.arange(t + 1)[None, :]
    return torch.from_numpy(stream[idx].astype(np.int64))


# --------------------------------------------------------------- workers


def _load_model(spec: dict, seen: dict):
    """The model from the folder, float32, in training mode; seen["matmul_dtype"]
    gets the output dtype of the first layer's q_proj in the first training
    forward (bfloat16: autocast was on, wherever the caller entered it)."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model = transformers.LlamaForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    model.to(spec.get("device", "cpu")).train()

    def hook(module, inputs, output):
        if module.training and "matmul_dtype" not in seen:
            seen["matmul_dtype"] = str(output.dtype)
            seen["threads_in_step"] = torch.get_num_threads()

    model.model.layers[0].self_attn.q_proj.register_forward_hook(hook)
    return model


def _sync(spec: dict) -> None:
    """A step's end on the GPU is when its kernels finish."""
    if spec.get("device", "cpu") == "cuda":
        torch.cuda.synchronize()


def _check_loss(model, ids: torch.Tensor) -> float:
    """|model(..., labels=y, shift_labels=y).loss - cross_entropy(logits, y)| on two windows, float32:
    the targets are taken as given (not shifted a second time)."""
    device = next(model.parameters()).device
    x, y = ids[:2, :-1].contiguous().to(device), ids[:2, 1:].contiguous().to(device)
    with torch.no_grad():
        model.eval()
        out = model(input_ids=x, labels=y, shift_labels=y)
        model.train()
        ref = torch.nn.functional.cross_entropy(out.logits.float().flatten(0, 1), y.flatten())
    return abs(out.loss.item() - ref.item())


def _prepare(spec: dict):
    """Both Python variants' start: the model, the step's windows, the loss check."""
    seen = {}
    model = _load_model(spec, seen)
    ids = windows(np.fromfile(spec["tokens"], dtype=np.uint16), spec["batch"] * spec["total"], spec["seq_len"],
                  spec["seed"])
    return seen, model, ids, _check_loss(model, ids)


def worker_hf(spec: dict) -> dict:
    import transformers

    seen, model, ids, loss_check = _prepare(spec)
    data = [{"input_ids": w[:-1], "labels": w[1:], "shift_labels": w[1:]} for w in ids]
    losses = []

    class Clock(transformers.TrainerCallback):
        def __init__(self):
            self.begin, self.end = [], []

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            _sync(spec)
            self.end.append(time.perf_counter())

    class Trainer(transformers.Trainer):
        def compute_loss(self, model, inputs, *a, **k):
            loss = super().compute_loss(model, inputs, *a, **k)
            losses.append((loss[0] if isinstance(loss, tuple) else loss).detach())
            return loss

    clock = Clock()
    args = transformers.TrainingArguments(
        output_dir=spec["scratch"], max_steps=spec["total"], per_device_train_batch_size=spec["batch"],
        learning_rate=spec["lr"], weight_decay=spec["weight_decay"], adam_beta1=0.9, adam_beta2=0.999,
        adam_epsilon=1e-8, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=spec["clip"],
        optim="adamw_torch_fused", bf16=spec["bf16"], use_cpu=spec.get("device", "cpu") == "cpu", logging_strategy="no",
        save_strategy="no", eval_strategy="no", report_to=[], dataloader_num_workers=0, disable_tqdm=True,
        remove_unused_columns=False, seed=spec["seed"], data_seed=spec["seed"],
    )
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[clock])
    trainer.train()
    opt = trainer.optimizer
    inner = getattr(opt, "optimizer", opt)  # accelerate's wrapper
    groups = [{"params": sum(p.numel() for p in g["params"]), "weight_decay": g["weight_decay"]}
              for g in inner.param_groups]
    return {
        "step_end_s": clock.end, "step_begin_s": clock.begin,
        "losses": [x.item() for x in losses],
        "optimizer": type(inner).__name__, "fused": bool(inner.defaults.get("fused")), "groups": groups,
        "loss_check_abs_diff": loss_check, "transformers": transformers.__version__, **seen,
    }


def worker_plain(spec: dict) -> dict:
    seen, model, ids, loss_check = _prepare(spec)
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": spec["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=spec["lr"], betas=(0.9, 0.999), eps=1e-8, fused=True)
    b, losses, ends = spec["batch"], [], []
    for step in range(spec["total"]):
        w = ids[step * b:(step + 1) * b]
        x, y = (w[:, :-1].contiguous().to(spec.get("device", "cpu")),
                w[:, 1:].contiguous().to(spec.get("device", "cpu")))
        with torch.autocast(spec.get("device", "cpu"), dtype=torch.bfloat16, enabled=spec["bf16"]):
            loss = model(input_ids=x, labels=y, shift_labels=y).loss
        loss.backward()
        if spec["clip"] > 0:
            torch.nn.utils.clip_grad_norm_(params, spec["clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        _sync(spec)
        ends.append(time.perf_counter())
    groups = [{"params": sum(p.numel() for p in g["params"]), "weight_decay": g["weight_decay"]}
              for g in opt.param_groups]
    return {"step_end_s": ends, "losses": [x.item() for x in losses], "optimizer": "AdamW", "fused": True,
            "groups": groups, "loss_check_abs_diff": loss_check, **seen}


def worker_main(kind: str, spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    out = (worker_hf if kind == "hf" else worker_plain)(spec)
    out["threads"] = torch.get_num_threads()
    Path(spec["out"]).write_text(json.dumps(out))
    return 0


# ---------------------------------------------------------------- launch


def _env(threads: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                            "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1",
               TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")
    return env


def run_process(cmd: list, env: dict, log: Path, timeout: float) -> dict:
    """Runs cmd to its end (output to log); its exit status, wall time and
    peak RSS (ru_maxrss of it and its waited-for children, from wait4)."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=str(ROOT))
        deadline = t0 + timeout
        while True:
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                p.kill()
                pid, status, usage = os.wait4(p.pid, 0)
                break
            time.sleep(0.05)
        p.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    return {"rc": p.returncode, "wall_s": wall, "peak_rss_mib": usage.ru_maxrss / 1024.0,
            "timed_out": wall > timeout}


def fusetrain_cmd(cfg: dict, work: Path, run_dir: Path) -> list:
    sets = {
        "model.name": "llama", "model.pretrained": work / "model", "model.seq_len": cfg["seq_len"],
        "model.dropout": 0, "data.name": "tokens", "data.path": work / "tokens.bin",
        "data.val_path": work / "val.bin", "data.token_dtype": "uint16", "data.batch_size": cfg["batch"],
        "data.test_samples": cfg["batch"], "data.eval_batch_size": cfg["batch"], "data.seed": cfg["seed"],
        "optimizer.name": "adamw", "optimizer.lr": cfg["lr"], "optimizer.weight_decay": cfg["weight_decay"],
        "optimizer.beta1": 0.9, "optimizer.beta2": 0.999, "optimizer.eps": 1e-8,
        # fusetrain's default config (configs/fashion_mnist.yaml) has a warm-up
        # and checkpoints every 1000 steps: both off, explicitly.
        "schedule.warmup_steps": 0, "schedule.decay": "none", "train.clip_grad_norm": cfg["clip"],
        "train.max_steps": cfg["total"], "train.log_every": 1, "train.eval_every": 0, "train.seed": cfg["seed"],
        "precision.policy": "mixed_bfloat16" if cfg["bf16"] else "float32",
        "precision.float32_head": str(cfg["float32_head"]).lower(),
        "runtime.threads": cfg["threads"], "runtime.device": cfg["device"], "output.checkpoint_every": 0, "output.curves": "false",
        "output.progress": "lines",
    }
    for item in cfg.get("fusetrain_set", []):
        k, _, v = item.partition("=")
        sets[k] = v
    cmd = [str(BIN), "train"]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    return cmd + ["--nproc", "1", "--run-dir", str(run_dir)]


def span(ends: list, warmup: int, steps: int) -> float:
    """Seconds from the end of step `warmup` to the end of step `warmup + steps` (stamps of steps 1..)."""
    return ends[warmup + steps - 1] - ends[warmup - 1]


def run_fusetrain(cfg: dict, work: Path, tag: str) -> dict:
    run_dir = work / f"run-{tag}"
    cmd = fusetrain_cmd(cfg, work, run_dir)
    proc = run_process(cmd, _env(cfg["threads"]), work / f"fusetrain-{tag}.log", cfg["timeout"])
    log = (work / f"fusetrain-{tag}.log").read_text(errors="replace")
    if proc["rc"] != 0:
        raise RuntimeError(f"fusetrain train failed (exit {proc['rc']}):\n  {' '.join(cmd)}\n{log[-3000:]}")
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = {r["step"]: r for r in recs if r["kind"] == "train"}
    w, n = cfg["warmup"], cfg["steps"]
    missing = [s for s in range(w, w + n + 1) if s not in train]
    if missing:
        raise RuntimeError(f"fusetrain's metrics.jsonl lacks train records for steps {missing[:5]}...")
    ends = [train[s]["time_s"] for s in range(1, w + n + 1)]
    own = [cfg["batch"] / train[s]["samples_per_s"] for s in range(w + 1, w + n + 1)]  # between host syncs
    m = re.search(r"model llama \((\d+) parameters\)", log)
    resolved = (run_dir / "config.yaml").read_text()
    policy = re.search(r"^\s*policy:\s*\"?(\w+)", resolved, re.M)
    return {**proc, "cmd": cmd, "step_end_s": ends, "span_s": span(ends, w, n),
            "step_s": [b - a for a, b in zip(ends[w - 1:], ends[w:])], "own_step_s": own,
            "losses": [train[s]["loss"] for s in range(1, w + n + 1)],
            "params": int(m.group(1)) if m else None, "policy": policy.group(1) if policy else None,
            "threads": cfg["threads"], "log_tail": log[-1500:]}


def run_python(kind: str, cfg: dict, work: Path, tag: str) -> dict:
    spec = dict(cfg, model_dir=str(work / "model"), tokens=str(work / "tokens.bin"),
                out=str(work / f"{kind}-{tag}.json"), scratch=str(work / f"scratch-{kind}-{tag}"))
    spec_path = work / f"spec-{kind}-{tag}.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--spec", str(spec_path)]
    proc = run_process(cmd, _env(cfg["threads"]), work / f"{kind}-{tag}.log", cfg["timeout"])
    log = (work / f"{kind}-{tag}.log").read_text(errors="replace")
    if proc["rc"] != 0 or not Path(spec["out"]).exists():
        raise RuntimeError(f"{LABELS[kind]} worker failed (exit {proc['rc']}):\n{log[-3000:]}")
    out = json.loads(Path(spec["out"]).read_text())
    ends, w, n = out["step_end_s"], cfg["warmup"], cfg["steps"]
    if len(ends) < w + n:
        raise RuntimeError(f"{LABELS[kind]}: {len(ends)} step stamps, expected {w + n}")
    out.update(proc, span_s=span(ends, w, n), step_s=[b - a for a, b in zip(ends[w - 1:], ends[w:])])
    if kind == "hf":
        out["own_step_s"] = [e - b for b, e in zip(out["step_begin_s"][w:], ends[w:])]
    out["log_tail"] = log[-1500:]
    return out


# ------------------------------------------------------------------ main


def sizes(args) -> dict:
    if args.quick:
        base = dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=176, vocab=512, seq_len=32, batch=4,
                    steps=6, warmup=2)
    elif args.large:
        # The GPU's size: about 200M parameters, windows of 1024 tokens.
        base = dict(hidden=1024, layers=16, heads=16, kv_heads=8, intermediate=2816, vocab=32000, seq_len=1024,
                    batch=8, steps=30, warmup=5)
    else:
        base = dict(hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1408, vocab=8192, seq_len=256,
                    batch=8, steps=30, warmup=5)
    for k in base:
        v = getattr(args, k, None)
        if v is not None:
            base[k] = v
    return base


def bf16_supported() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def write_model(cfg: dict, path: Path) -> int:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(cfg["seed"])
    config = transformers.LlamaConfig(
        vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"], num_key_value_heads=cfg["kv_heads"],
        intermediate_size=cfg["intermediate"], max_position_embeddings=max(cfg["seq_len"], 256),
        attention_dropout=0.0, tie_word_embeddings=cfg["tie"], use_cache=False)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(str(path))
    return sum(p.numel() for p in model.parameters())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=("hf", "plain"), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="a tiny model, 2 + 6 steps: checks that it runs")
    ap.add_argument("--steps", type=int, help="timed steps per variant (default 30; --quick 6)")
    ap.add_argument("--warmup", type=int, help="untimed steps first (default 5; --quick 2)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="intra-op threads (default: the cores)")
    ap.add_argument("--batch", type=int, help="windows per step (default 8)")
    ap.add_argument("--seq-len", dest="seq_len", type=int, help="tokens per window (default 256)")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--kv-heads", dest="kv_heads", type=int)
    ap.add_argument("--intermediate", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--tie", action="store_true", help="tie the head to the embedding (default: untied)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--weight-decay", dest="weight_decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip (0: off), all variants")
    ap.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                    help="auto: bf16 autocast where oneDNN has bf16 on this CPU, else float32")
    ap.add_argument("--float32-head", dest="float32_head", choices=("true", "false"), default="true",
                    help="fusetrain's precision.float32_head (its default true; HF's head runs in bf16)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where all three train (cuda: bf16 autocast; fusetrain with its CUDA defaults)")
    ap.add_argument("--large", action="store_true",
                    help="a ~200M-parameter Llama with 1024-token windows (the GPU check's size)")
    ap.add_argument("--tag", default="", help="a word for the results file's name (hf_finetune-TAG-...)")
    ap.add_argument("--fusetrain-set", dest="fusetrain_set", action="append", default=[], metavar="KEY=VALUE",
                    help="another --set for fusetrain's run (repeatable), e.g. precision.master_weights=true")
    ap.add_argument("--repeats", type=int, default=1, help="rounds of the three variants (medians)")
    ap.add_argument("--only", default=",".join(VARIANTS), help="comma-separated subset of fusetrain,hf,plain")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per variant process")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (model, data, logs, run dirs)")
    ap.add_argument("--results-dir", type=Path, default=HERE / "results", help="where the JSON goes")
    ap.add_argument("--no-write", action="store_true", help="print the table only")
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.spec)

    only = [v for v in args.only.split(",") if v]
    if any(v not in VARIANTS for v in only):
        ap.error(f"--only takes {','.join(VARIANTS)}")
    if "fusetrain" in only and not BIN.exists():
        print(f"bench_hf_finetune: {BIN} is missing; build it first (make build)", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("bench_hf_finetune: --device cuda, and torch sees no GPU", file=sys.stderr)
        return 2
    bf16 = {"bf16": True, "fp32": False}.get(args.precision, True if cuda else bf16_supported())
    cfg = dict(sizes(args), tie=args.tie, lr=args.lr, weight_decay=args.weight_decay, clip=args.clip,
               bf16=bf16, float32_head=args.float32_head == "true", threads=args.threads, seed=args.seed,
               timeout=args.timeout, fusetrain_set=args.fusetrain_set, device=args.device)
    cfg["total"] = cfg["warmup"] + cfg["steps"]
    if cfg["warmup"] < 1 or cfg["steps"] < 1:
        ap.error("--warmup and --steps must be at least 1")
    t, b = cfg["seq_len"], cfg["batch"]

    info = machine_info(torch.device(args.device), args.threads)
    import transformers

    info["transformers"] = transformers.__version__
    work = Path(tempfile.mkdtemp(prefix="bench_hf_finetune_"))
    try:
        params = write_model(cfg, work / "model")
        # fusetrain's epoch is (tokens - 1) / T windows / B steps: one epoch
        # holds every step, so no end-of-epoch evaluation falls inside them.
        n_train = (cfg["total"] * b + 2) * t + 1
        make_tokens(n_train, cfg["vocab"], cfg["seed"]).tofile(work / "tokens.bin")
        make_tokens(b * t + 1, cfg["vocab"], cfg["seed"] + 1).tofile(work / "val.bin")
        prec = "bf16 autocast" if bf16 else "float32"
        model_desc = (f"Llama {params / 1e6:.1f}M params (hidden {cfg['hidden']}, {cfg['layers']} layers, "
                      f"{cfg['heads']} heads / {cfg['kv_heads']} kv, MLP {cfg['intermediate']}, vocab {cfg['vocab']}, "
                      f"{'tied' if cfg['tie'] else 'untied'} head)")
        print(f"# bench_hf_finetune: {model_desc}, batch {b} x {t} tokens, {prec}, {args.threads} thread(s) on "
              f"{info['cpu_cores']} cores ({info['cpu_model']}, {info.get('cpu_isa')}), torch {torch.__version__}, "
              f"transformers {transformers.__version__}; {cfg['warmup']} warm-up + {cfg['steps']} timed steps"
              f"{', quick' if args.quick else ''}; load average {info['loadavg_start']}", flush=True)
        if info["loadavg_start"] is not None and info["loadavg_start"] > 0.5 * info["cpu_cores"]:
            print(f"warning: load average {info['loadavg_start']} on {info['cpu_cores']} cores: something else "
                  "is running; the figures will be noisy", file=sys.stderr)
        t0 = time.perf_counter()
        runs = {v: [] for v in only}
        for rep in range(args.repeats):
            for v in only:
                tag = f"r{rep}"
                print(f"  [{rep + 1}/{args.repeats}] {LABELS[v]} ...", end="", flush=True, file=sys.stderr)
                r = run_fusetrain(cfg, work, tag) if v == "fusetrain" else run_python(v, cfg, work, tag)
                r["tokens_per_s"] = cfg["steps"] * b * t / r["span_s"]
                runs[v].append(r)
                print(f" {r['tokens_per_s']:.0f} tokens/s, {statistics.median(r['step_s']) * 1e3:.0f} ms/step, "
                      f"peak RSS {r['peak_rss_mib']:.0f} MiB, process {r['wall_s']:.1f} s", file=sys.stderr,
                      flush=True)
        elapsed = time.perf_counter() - t0
    finally:
        if args.keep:
            print(f"work directory kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)

    # ------------------------------------------------------------ report
    summary = {}
    for v, rs in runs.items():
        last = rs[-1]
        losses = last["losses"]
        summary[v] = {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
            "tokens_per_s_runs": [r["tokens_per_s"] for r in rs],
            "median_step_ms": statistics.median(s for r in rs for s in r["step_s"]) * 1e3,
            "best_step_ms": min(s for r in rs for s in r["step_s"]) * 1e3,
            "own_median_step_ms": (statistics.median(s for r in rs for s in r["own_step_s"]) * 1e3
                                   if "own_step_s" in last else None),
            "peak_rss_mib": max(r["peak_rss_mib"] for r in rs),
            "process_wall_s": statistics.median(r["wall_s"] for r in rs),
            "first_loss": losses[0],
            "final_loss": statistics.fmean(losses[-LAST:]),
            "threads": last.get("threads"),
        }
    print()
    print("| variant | tokens/s | ms/step (median, best) | peak RSS | process wall | loss: step 1 -> last 5 | "
          "threads |")
    print("|---|---|---|---|---|---|---|")
    for v, s in summary.items():
        print(f"| {LABELS[v]} | {s['tokens_per_s']:.0f} | {s['median_step_ms']:.0f}, {s['best_step_ms']:.0f} | "
              f"{s['peak_rss_mib']:.0f} MiB | {s['process_wall_s']:.1f} s | {s['first_loss']:.3f} -> "
              f"{s['final_loss']:.3f} | {s['threads']} |")

    checks = []
    if "fusetrain" in runs:
        ft = runs["fusetrain"][-1]
        if ft["params"] is not None and ft["params"] != params:
            checks.append(f"fusetrain built {ft['params']} parameters, transformers {params}")
        want = "mixed_bfloat16" if bf16 else "float32"
        if ft["policy"] != want:
            checks.append(f"fusetrain resolved precision.policy={ft['policy']}, wanted {want}")
    if "hf" in runs:
        hf = runs["hf"][-1]
        if not hf["fused"] or hf["optimizer"] != "AdamW":
            checks.append(f"HF Trainer's optimizer: {hf['optimizer']} fused={hf['fused']}")
    for v in ("hf", "plain"):
        want = "torch.bfloat16" if bf16 else "torch.float32"
        if v in runs and runs[v][-1].get("matmul_dtype") != want:
            checks.append(f"{LABELS[v]}: the first q_proj ran in {runs[v][-1].get('matmul_dtype')}, wanted {want}")
        if v in runs and runs[v][-1]["loss_check_abs_diff"] > 1e-4:
            checks.append(f"{LABELS[v]}: shift_labels loss differs from cross_entropy by "
                          f"{runs[v][-1]['loss_check_abs_diff']:.2e}")
        if v in runs and runs[v][-1].get("threads_in_step") != args.threads:
            checks.append(f"{LABELS[v]}: {runs[v][-1].get('threads_in_step')} threads in the step, "
                          f"wanted {args.threads}")
    for v, s in summary.items():
        if not s["final_loss"] < s["first_loss"]:
            checks.append(f"{LABELS[v]}: the loss did not fall ({s['first_loss']:.3f} -> {s['final_loss']:.3f})")

    common_notes = (f"{model_desc}, batch {b}x{t}, {prec}, {args.threads} thread(s), {cfg['steps']} steps after "
                    f"{cfg['warmup']} warm-up" + (f", median of {args.repeats} runs" if args.repeats > 1 else ""))
    rows = []
    pairs = [("fusetrain", "hf", GOAL), ("fusetrain", "plain", None), ("plain", "hf", None)]
    for ours, theirs, goal in pairs:
        if ours in summary and theirs in summary:
            o, h = summary[ours], summary[theirs]
            rows.append(result(
                f"llama fine-tune, {LABELS[ours]} vs {LABELS[theirs]}", ours=o["tokens_per_s"],
                torch_=h["tokens_per_s"], unit="tokens/s", higher_is_better=True, goal=goal,
                notes=(f"best step {h['best_step_ms'] / o['best_step_ms']:.2f}x; peak RSS {o['peak_rss_mib']:.0f} vs "
                       f"{h['peak_rss_mib']:.0f} MiB; " + common_notes),
                ours_variant=ours, baseline_variant=theirs,
                best_step_ratio=h["best_step_ms"] / o["best_step_ms"]))
    if rows:
        print()
        print(table(rows, baseline="baseline"))
    print("\ntokens/s: timed steps x batch x seq_len / wall time from the end of the last warm-up step to the end "
          "of the last step (fusetrain: metrics.jsonl time_s of its per-step records; HF: on_step_end stamps; "
          "plain: perf_counter after each step)")
    if "fusetrain" in summary and summary["fusetrain"]["own_median_step_ms"]:
        print(f"fusetrain's own samples_per_s (between host syncs): median "
              f"{summary['fusetrain']['own_median_step_ms']:.0f} ms/step; HF on_step_begin->on_step_end: "
              + (f"{summary['hf']['own_median_step_ms']:.0f} ms/step" if "hf" in summary else "n/a"))
    if "fusetrain" in summary and "hf" in summary:
        ratio = summary["fusetrain"]["tokens_per_s"] / summary["hf"]["tokens_per_s"]
        print(f"goal: fusetrain >= {GOAL}x HF Trainer: {ratio:.2f}x ({'met' if ratio >= GOAL else 'NOT met'})"
              + (" [--quick: a smoke test, the figures mean nothing]" if args.quick else ""))
    for c in checks:
        print(f"CHECK FAILED: {c}")
    load_end = load_averages()
    info["loadavg_end"] = load_end[0]
    info["loadavg_1_5_15_end"] = load_end
    if info["loadavg_start"] is not None and info["loadavg_start"] > 0.5 * info["cpu_cores"]:
        print(f"WARNING: load average {info['loadavg_start']} on {info['cpu_cores']} cores before the run: "
              "the machine was busy")
    if args.no_write:
        return 1 if checks else 0

    payload = {
        "benchmark": "hf_finetune",
        "date": datetime.date.today().isoformat(),
        "quick": args.quick,
        "machine": info,
        "command": " ".join([Path(sys.executable).name, *(sys.argv if argv is None else [sys.argv[0], *argv])]),
        "config": {k: v for k, v in cfg.items() if k != "timeout"},
        "params": params,
        "precision": prec,
        "elapsed_s": round(elapsed, 1),
        "timing": ("tokens/s = steps x batch x seq_len / (end of step warmup+steps - end of step warmup); "
                   "fusetrain: time_s of its metrics.jsonl train records (train.log_every=1); HF Trainer: "
                   "TrainerCallback.on_step_end perf_counter stamps; plain: perf_counter after each step. "
                   "own_step_s: fusetrain's samples_per_s (time between host syncs), HF's on_step_begin -> "
                   "on_step_end (no data loading)"),
        "goal": f"fusetrain tokens/s >= {GOAL}x HF Trainer's",
        "checks_failed": checks,
        "summary": summary,
        "rows": rows,
        "runs": {v: [{k: x for k, x in r.items() if k not in ("step_begin_s",)} for r in rs] for v, rs in runs.items()},
    }
    out_dir = args.results_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    size = ('-quick' if args.quick else '-large' if args.large else '') + (f"-{args.tag}" if args.tag else "")
    out = out_dir / f"hf_finetune{size}-{machine_slug(info)}-{payload['date']}.json"
    out.write_text(json.dumps(payload, indent=1) + "\n")
    env_out = os.environ.get("OUT")
    if env_out and Path(env_out).is_dir():
        Path(env_out, out.name).write_text(out.read_text())
    try:
        shown = out.relative_to(ROOT)
    except ValueError:
        shown = out
    print(f"\nwrote {shown}")
    return 1 if checks else 0


if __name__ == "__main__":
    sys.exit(main())
