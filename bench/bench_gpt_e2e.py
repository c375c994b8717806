"""`fusetrain train` on the character GPTs against the same model and recipe
written in plain PyTorch (issue 52), back to back on one machine: tokens/s
and the training loss after the same steps.

Configs: configs/gpt_text.yaml (4 layers, d_model 128) and
configs/gpt_wide.yaml (4 layers, d_model 512), on data/kjv.txt (or the GPL
text where it is missing). The trainer runs with model.fused_block_ops on
(the default) and off; the plain loop is a pre-norm GPT of the same shapes
(token + position embeddings, LayerNorm, qkv / proj, SDPA causal, fc + GELU +
fc_proj, final LayerNorm, head), torch.optim.AdamW(fused=True) with the
config's lr, betas, weight decay, clipping and warm-up + cosine schedule,
under the precision the trainer resolved ("auto": mixed_bfloat16 on a CPU
with native bf16, else float32) through torch.autocast. Both read random
windows of the same bytes. Throughput: the trainer's samples/s from
metrics.jsonl (the first window dropped as warm-up), the plain loop's over
the same steps after the same warm-up; intra-op threads set equal. Goal:
1.5x.

    python bench/run.py --only gpt_e2e [--quick]
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from common import Context, result

NAME = "gpt_e2e"
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BIN = ROOT / "build" / "fusetrain"
KJV = ROOT / "data" / "kjv.txt"
CONFIGS = {"gpt_text": ROOT / "configs" / "gpt_text.yaml", "gpt_wide": ROOT / "configs" / "gpt_wide.yaml"}
GOAL = 1.5


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc, self.fc_proj = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x))))


class Gpt(torch.nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab)

        # The trainer's (GPT-2's) initialisation: N(0, 0.02) weights, zero
        # biases, the residual projections scaled by 1 / sqrt(2 layers).
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "ln" in name or name == "pos":
                    continue
                if name.endswith(".bias"):
                    p.zero_()
                elif "proj.weight" in name:
                    p.normal_(0.0, 0.02 / math.sqrt(2 * layers))
                else:
                    p.normal_(0.0, 0.02)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.size(1)]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def plain_run(cfg: dict, policy: str, data: torch.Tensor, steps: int, warmup_steps: int, threads: int) -> dict:
    """The plain loop: samples/s over `steps` after `warmup_steps`, and the
    loss of its last step."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    m, d, o, s, t = cfg["model"], cfg["data"], cfg["optimizer"], cfg.get("schedule", {}), cfg["train"]
    seq, batch = m["seq_len"], d["batch_size"]
    model = Gpt(256, m["d_model"], m["n_layer"], m["n_head"], seq)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "pos" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "pos" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.get("weight_decay", 0.0)},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=o["lr"], betas=(0.9, o.get("beta2", 0.999)), fused=True)
    total = t["max_steps"]
    warm = s.get("warmup_steps", 0)
    floor = s.get("min_lr_ratio", 0.0)

    def lr_at(step):
        if step < warm:
            return (step + 1) / warm
        p = (step - warm) / max(1, total - warm)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    g = torch.Generator().manual_seed(0)
    bf16 = policy == "mixed_bfloat16"
    loss = None
    t0 = None
    for step in range(warmup_steps + steps):
        if step == warmup_steps:
            t0 = time.perf_counter()
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
        window = torch.stack([data[i: i + seq + 1] for i in starts.tolist()]).long()
        x, y = window[:, :-1], window[:, 1:]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.get("clip_grad_norm", 1e9))
        opt.step()
        sched.step()
    elapsed = time.perf_counter() - t0
    return {"samples_per_s": batch * steps / elapsed, "loss": loss.item()}


def trainer_run(config: Path, corpus: Path, steps: int, window: int, threads: int, workdir: Path,
                fused: bool) -> dict:
    run_dir = workdir / f"{config.stem}-{fused}"
    p = subprocess.run(
        [str(BIN), "train", "--config", str(config), "--run-dir", str(run_dir), "--threads", str(threads),
         "--set", f"data.path={corpus}", "--set", f"train.max_steps={steps}", "--set", f"train.log_every={window}",
         "--set", "train.eval_every=0", "--set", "train.max_time_s=0", "--set", "output.checkpoint_every=0",
         "--set", "output.curves=false", "--set", "data.test_samples=64",
         "--set", f"model.fused_block_ops={'true' if fused else 'false'}"],
        capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        raise RuntimeError(f"fusetrain train failed:\n{p.stderr[-2000:]}")
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["kind"] == "train"]
    rates = [r["samples_per_s"] for r in train][1:]
    policy = yaml.safe_load((run_dir / "config.yaml").read_text())["precision"]["policy"]
    return {"samples_per_s": sum(rates) / len(rates), "loss": train[-1]["loss"], "policy": policy}


def run(ctx: Context) -> list:
    if ctx.is_cuda or not BIN.exists():
        return []
    corpus = KJV if KJV.exists() else Path("/usr/share/common-licenses/GPL-3")
    data = torch.frombuffer(bytearray(corpus.read_bytes()), dtype=torch.uint8)
    steps, window = (40, 10) if ctx.quick else (120, 20)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_gpt_e2e_") as tmp:
        for name, config in CONFIGS.items():
            cfg = yaml.safe_load(config.read_text())
            cfg["train"]["max_steps"] = steps
            fused = trainer_run(config, corpus, steps, window, ctx.threads, Path(tmp), True)
            unfused = trainer_run(config, corpus, steps, window, ctx.threads, Path(tmp), False)
            plain = plain_run(cfg, fused["policy"], data, steps - window, window, ctx.threads)
            tokens = cfg["model"]["seq_len"]
            for label, ours in (("fused block ops", fused), ("model.fused_block_ops=false", unfused)):
                rows.append(result(
                    f"fusetrain train {name} ({label}) vs plain PyTorch, {fused['policy']}",
                    ours=ours["samples_per_s"] * tokens, torch_=plain["samples_per_s"] * tokens,
                    unit="tokens/s", higher_is_better=True, goal=GOAL,
                    notes=(f"{ctx.threads} threads, {steps} steps (first {window} warm-up); loss at the last "
                           f"step: ours {ours['loss']:.3f}, plain {plain['loss']:.3f}")))
    return rows


if __name__ == "__main__":
    import run as harness

    sys.exit(harness.main(["--only", NAME] + sys.argv[1:]))
