"""End-to-end training throughput: a full training step (forward, loss,
backward, FusedAdamW step) of ResNet-50 and of a small GPT in four
precisions, side by side, with model FLOP utilisation (the headline figures).

Models (defined here):
  - ResNet-50 for 32x32 inputs: bottleneck blocks [3, 4, 6, 3], CIFAR stem
    (3x3 conv, stride 1, no max-pool), BatchNorm, 10 classes; channels_last
    on CUDA. Batch 256 on CUDA.
  - GPT: 6 pre-LN blocks, d_model 512, 8 heads, context 256, vocabulary 8192,
    causal attention through ``F.scaled_dot_product_attention``, GELU MLP
    (4x), output head tied to the token embedding. Batch 32 x 256 tokens on
    CUDA.
Precisions: "float32" (TF32 off for matmuls and cuDNN), "tf32" (TF32 on),
"mixed_float16" (``fusetrain.amp.autocast`` + ``fusetrain.amp.GradScaler``)
and "mixed_bfloat16" (autocast, no loss scaling). Every precision runs the
same eager step function on its own copy of the same initial model; the loss
is fusetrain's fused softmax cross-entropy (``F.cross_entropy`` should it
not run on the device; the notes say which); the data is one synthetic batch
generated once on the device. The TF32 flags are set before each timed
window (TF32 off except in "tf32") and restored at the end; cuDNN autotuning
(``cudnn.benchmark``) is on during the run and the autocast weight-cast
cache off (as CUDA graphs want it; every weight is cast once a step either
way), both restored at the end. An extra
variant runs the mixed_bfloat16 step through ``fusetrain.fuse_steps`` (one
CUDA graph per K steps) against the eager bf16 loop.

Timing: windows of a few steps, interleaved across the precisions (float32,
tf32, fp16, bf16, fused bf16, float32, ...) after a warm-up window each
(cuDNN autotuning, optimizer state); the fused variant first runs its
eager warm-up executions and its capture on their own (a failed capture
gives an error row for it alone). The device is synchronised before each window
(untimed) and at its end (timed), on the host's clock; per-step time is the
median window over its steps.

Rows:
  - the device's dense matmul rate (bf16 8192^3 on CUDA, best of 10): the
    reference for MFU;
  - per model and precision: samples/s (GPT: tokens/s, samples/s in the
    notes), ms/step and MFU = (training FLOPs per step / step time) / the
    measured matmul rate. FLOPs per step are counted once with
    ``torch.utils.flop_counter.FlopCounterMode`` on a float32 forward +
    backward of a copy of the model at a small batch on the same device,
    scaled linearly to the real batch (matmuls and convolutions only;
    attention counted in full through the math SDPA backend, causal masking
    not discounted; norms, activations and the optimizer not counted);
  - ratios: mixed_bfloat16 and mixed_float16 over float32 (goal >= 3x) and
    over tf32 (goal >= 1.8x), CUDA;
  - fuse_steps K over the eager mixed_bfloat16 loop (no goal).

On the CPU (``--device cpu``) the runs are tiny (ResNet-50 at batch 4, a
2-layer GPT of d_model 128 at batch 2 x 64; ``--quick``: batch 2 and a
smaller GPT) and one or two steps are timed: smoke figures for the code
path, marked in every row, with no goals. TF32 is a CUDA notion and is
skipped there; fp16 autocast runs on the CPU (slowly; not with ``--quick``).
The CPU's MFU reference is the faster of its fp32 and bf16 matmul rates.
"""

from __future__ import annotations

import copy
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import fusetrain
import fusetrain.amp
import fusetrain.optim
from bench_graph import pick_loss, timed_windows
from common import Context, error_row, guarded, measure, median, release, result, spread

NAME = "e2e"

PRECISIONS = ("float32", "tf32", "mixed_float16", "mixed_bfloat16")
CPU_PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")  # --quick: no fp16 (slow on a CPU)
FP32_GOAL = 3.0  # mixed precision at least 3x strict float32 (CUDA)
TF32_GOAL = 1.8  # and 1.8x TF32 (CUDA)
FUSED = "mixed_bfloat16 fuse_steps"
TORCH_BF16 = "torch mixed_bfloat16"  # torch.autocast + torch.optim.AdamW(fused=True), eager

# Per device and quick: model sizes, batches, steps per timed window, timed
# windows per precision (after one warm-up window).
CONFIG = {
    ("cuda", False): dict(resnet_batch=256, gpt=dict(layers=6, d=512, heads=8, ctx=256, vocab=8192),
                          gpt_batch=32, window=5, repeats=3),
    ("cuda", True): dict(resnet_batch=256, gpt=dict(layers=6, d=512, heads=8, ctx=256, vocab=8192),
                         gpt_batch=32, window=4, repeats=2),
    ("cpu", False): dict(resnet_batch=4, gpt=dict(layers=2, d=128, heads=4, ctx=64, vocab=1024),
                         gpt_batch=2, window=1, repeats=2),
    ("cpu", True): dict(resnet_batch=2, gpt=dict(layers=2, d=64, heads=2, ctx=32, vocab=512),
                        gpt_batch=2, window=1, repeats=1),
}


# ------------------------------------------------------------------ models


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int):
        super().__init__()
        cout = planes * self.expansion
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + (x if self.shortcut is None else self.shortcut(x)))


class ResNet50(nn.Module):
    """ResNet-50 for 32x32 inputs (CIFAR stem: 3x3 conv, stride 1, no max-pool)."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        blocks, cin = [], 64
        for planes, count, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(count):
                blocks.append(Bottleneck(cin, planes, stride if i == 0 else 1))
                cin = planes * Bottleneck.expansion
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class Block(nn.Module):
    """Pre-LN transformer block: causal self-attention, then a GELU MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """A small decoder-only language model; the head shares the token embedding."""

    def __init__(self, layers: int, d: int, heads: int, ctx: int, vocab: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(ctx, d))
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        return self.head(self.ln_f(self.blocks(x)))


# ---------------------------------------------------------------- pieces


def set_tf32(on: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on


def make_step(model: nn.Module, loss_fn, precision: str, device_type: str, set_to_none: bool = True):
    """One full training step in ``precision``; returns the detached loss."""
    opt = fusetrain.optim.FusedAdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    policy = precision if precision.startswith("mixed_") else "float32"
    scaler = fusetrain.amp.GradScaler(device_type, enabled=precision == "mixed_float16")

    def step(x, y):
        with fusetrain.amp.autocast(policy, device_type=device_type):
            out = model(x)
            loss = loss_fn(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=set_to_none)
        return loss.detach()

    return step


def make_torch_step(model: nn.Module, device_type: str):
    """The same bf16 step with torch's own tools: torch.autocast,
    F.cross_entropy and torch.optim.AdamW(fused=True)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)

    def step(x, y):
        with torch.autocast(device_type, dtype=torch.bfloat16):
            out = model(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def count_flops(model: nn.Module, batch_fn, n: int, scale: float) -> float:
    """Training FLOPs (forward + backward) of ``model`` on a batch of ``n``,
    counted in float32 on a copy, times ``scale``. The math SDPA backend makes
    attention visible to the counter as matmuls on every device."""
    m = copy.deepcopy(model).float()
    x, y = batch_fn(n)
    with torch.autocast(x.device.type, enabled=False), sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False) as counter:
            out = m(x)
            F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1)).backward()
    del m
    return counter.get_total_flops() * scale


def matmul_rate(ctx: Context) -> dict:
    """Dense matmul rate (FLOP/s), best of several: bf16 8192^3 on CUDA; on
    the CPU fp32 and bf16 at 512^3, the faster being the reference."""
    n = 8192 if ctx.is_cuda else 512
    dtypes = (torch.bfloat16,) if ctx.is_cuda else (torch.float32, torch.bfloat16)
    rates = {}
    for dt in dtypes:
        g = torch.Generator(device=ctx.device).manual_seed(0)
        a = torch.randn(n, n, device=ctx.device, generator=g).to(dt)
        b = torch.randn(n, n, device=ctx.device, generator=g).to(dt)
        c = torch.empty(n, n, device=ctx.device, dtype=dt)
        # (torch's CPU bf16 mm can be ~100x slower than fp32 without native
        # bf16 instructions: few repeats of it there.)
        repeats = 10 if ctx.is_cuda else (20 if dt == torch.float32 else 3)
        times = measure(lambda: torch.mm(a, b, out=c), ctx, warmup=3 if ctx.is_cuda else 1, repeats=repeats)
        rates[dt] = 2 * n**3 / min(times)
    best = max(rates, key=rates.get)
    return dict(n=n, rates=rates, dtype=best, rate=rates[best])


# ------------------------------------------------------------------ runs


def fused_row(ctx: Context, name: str, window: int, tag: str, describe: str, rate: dict, steps: dict,
              extra: dict, unit: str) -> dict:
    """The bf16 step through fuse_steps (K = the window) against the eager bf16 loop."""
    how = f"one CUDA graph replay per {window} steps" if ctx.is_cuda else "no CUDA graph on the CPU"
    return result(
        f"e2e {name} mixed_bfloat16 fuse_steps K={window} vs eager{tag}", ours=rate[FUSED],
        torch_=rate["mixed_bfloat16"], unit=unit, higher_is_better=True,
        notes=(f"{extra['ms_per_step']:.2f} vs {median(steps['mixed_bfloat16']) * 1e3:.2f} ms/step, "
               f"MFU {extra['mfu']:.1%}; {how}; {describe}"),
        times={"ours": steps[FUSED], "torch": steps["mixed_bfloat16"]}, steps_per_execution=window, **extra)


def bench_model(ctx: Context, name: str, model: nn.Module, batch_fn, batch: int, tokens: int,
                count_n: int, loss_fn, loss_name: str, mm: dict, describe: str) -> list:
    cfg = CONFIG[(ctx.device.type, ctx.quick)]
    window, repeats = cfg["window"], cfg["repeats"]
    dev = ctx.device.type
    cpu = not ctx.is_cuda
    tag = " (CPU smoke)" if cpu else ""
    precisions = PRECISIONS
    if cpu:
        precisions = tuple(p for p in CPU_PRECISIONS if not (ctx.quick and p == "mixed_float16"))

    flops = count_flops(model, batch_fn, count_n, batch / count_n)
    x, y = batch_fn(batch)

    fns, setup, last = {}, {}, {}
    for prec in precisions:
        step = make_step(copy.deepcopy(model), loss_fn, prec, dev)

        def run_eager(step=step, prec=prec):
            for _ in range(window):
                last[prec] = step(x, y)

        fns[prec] = run_eager
        setup[prec] = (lambda on=(prec == "tf32"): set_tf32(on)) if ctx.is_cuda else None
    torch_step = make_torch_step(copy.deepcopy(model), dev)

    def run_torch():
        for _ in range(window):
            last[TORCH_BF16] = torch_step(x, y)

    fns[TORCH_BF16] = run_torch
    setup[TORCH_BF16] = setup["mixed_bfloat16"]
    # The bf16 step through fuse_steps: K = the window, one execution a window.
    fused = fusetrain.fuse_steps(make_step(copy.deepcopy(model), loss_fn, "mixed_bfloat16", dev, set_to_none=False),
                                 (x, y), steps_per_execution=window)

    def run_fused():
        last[FUSED] = fused([(x, y)] * window)[-1]

    setup[FUSED] = setup["mixed_bfloat16"]
    setup = {k: v for k, v in setup.items() if v is not None}
    # The fused variant's eager warm-up executions and its capture come first,
    # on their own: should the capture fail, the precision rows still stand.
    fused_error = None
    try:
        for _ in range(fused.warmup_executions + 1 if ctx.is_cuda else 0):
            if FUSED in setup:
                setup[FUSED]()
            run_fused()
        if ctx.is_cuda and not fused.captured:
            raise RuntimeError("fuse_steps did not capture a CUDA graph in its warm-up")
        fns[FUSED] = run_fused
    except Exception as e:  # noqa: BLE001  (an error row instead)
        traceback.print_exc()
        fused_error = error_row(f"e2e {name} mixed_bfloat16 fuse_steps K={window} vs eager{tag}", e)
    # Then one warm-up window each (cuDNN autotuning, optimizer state).
    times = timed_windows(fns, ctx, repeats=repeats, warmup=1, setup=setup)
    losses = {k: float(v.float()) for k, v in last.items()}

    steps = {k: [t / window for t in v] for k, v in times.items()}
    sps = {k: batch / median(v) for k, v in steps.items()}
    unit = "tokens/s" if tokens > 1 else "samples/s"
    rate = {k: s * tokens for k, s in sps.items()}
    mm_label = f"{str(mm['dtype']).replace('torch.', '')} matmul {mm['n']}^3"

    def common_extra(k):
        return dict(model=name, precision=k, batch=batch, tokens_per_sample=tokens,
                    ms_per_step=median(steps[k]) * 1e3, best_ms_per_step=min(steps[k]) * 1e3,
                    spread=spread(steps[k]), samples_per_s=sps[k],
                    tokens_per_s=sps[k] * tokens if tokens > 1 else None,
                    flops_per_step=flops, mfu=flops / median(steps[k]) / mm["rate"],
                    matmul_tflops=mm["rate"] / 1e12, final_loss=losses.get(k),
                    steps_timed=window * repeats, window_steps=window, device_kind="cpu-smoke" if cpu else dev)

    rows = []
    for prec in precisions:
        e = common_extra(prec)
        per_s = f"{sps[prec]:.1f} samples/s, " if tokens > 1 else ""
        rows.append(result(
            f"e2e {name} {prec}{tag}", ours=rate[prec], torch_=None, unit=unit, higher_is_better=True,
            notes=(f"{per_s}{e['ms_per_step']:.2f} ms/step, MFU {e['mfu']:.1%} ({flops / 1e12:.3g} TFLOP/step "
                   f"/ {mm_label} {mm['rate'] / 1e12:.3g} TFLOP/s); {describe}; {loss_name}; "
                   f"{window * repeats} step(s) timed ({repeats} window(s) of {window}); "
                   f"last loss {losses.get(prec, float('nan')):.3g}"),
            **e))
    if fused_error is not None:
        rows.append(fused_error)
    else:
        rows.append(fused_row(ctx, name, window, tag, describe, rate, steps, common_extra(FUSED), unit))
    # fusetrain against torch's own mixed precision, eager and with step fusion.
    for ours in ("mixed_bfloat16", FUSED):
        if ours not in rate:
            continue
        rows.append(result(
            f"e2e {name} {ours} vs torch autocast + AdamW(fused){tag}", ours=rate[ours], torch_=rate[TORCH_BF16],
            unit=unit, higher_is_better=True,
            notes=(f"{median(steps[ours]) * 1e3:.2f} vs {median(steps[TORCH_BF16]) * 1e3:.2f} ms/step; 'torch' = "
                   f"torch.autocast(bfloat16) + F.cross_entropy + torch.optim.AdamW(fused=True), eager; {describe}"),
            times={"ours": steps[ours], "torch": steps[TORCH_BF16]}, model=name, precision=ours,
            baseline=TORCH_BF16, batch=batch, device_kind="cpu-smoke" if cpu else dev))
    for low in ("mixed_bfloat16", "mixed_float16"):
        for base, goal in (("float32", FP32_GOAL), ("tf32", TF32_GOAL)):
            if low not in sps or base not in sps:
                continue
            rows.append(result(
                f"e2e {name} {low} vs {base}{tag}", ours=rate[low], torch_=rate[base], unit=unit,
                higher_is_better=True, goal=None if cpu else goal,
                notes=(f"{median(steps[low]) * 1e3:.2f} vs {median(steps[base]) * 1e3:.2f} ms/step; {describe}"
                       + ("; CPU smoke: no goal" if cpu else "")),
                times={"ours": steps[low], "torch": steps[base]}, model=name, precision=low, baseline=base,
                batch=batch, device_kind="cpu-smoke" if cpu else dev))
    return rows  # the models, graphs and batches go with this frame


def bench_resnet(ctx: Context, loss_fn, loss_name: str, mm: dict) -> list:
    cfg = CONFIG[(ctx.device.type, ctx.quick)]
    torch.manual_seed(0)
    model = ResNet50().to(ctx.device)
    fmt = torch.channels_last if ctx.is_cuda else torch.contiguous_format
    model = model.to(memory_format=fmt)

    def batch_fn(n):
        g = torch.Generator(device=ctx.device).manual_seed(n)
        x = torch.randn(n, 3, 32, 32, device=ctx.device, generator=g).contiguous(memory_format=fmt)
        return x, torch.randint(0, 10, (n,), device=ctx.device, generator=g)

    params = sum(p.numel() for p in model.parameters())
    describe = (f"ResNet-50 32x32 ({params / 1e6:.1f}M params), batch {cfg['resnet_batch']}"
                f"{', channels_last' if ctx.is_cuda else ''}")
    rows = bench_model(ctx, "resnet50", model, batch_fn, cfg["resnet_batch"], 1, 2, loss_fn, loss_name, mm, describe)
    del model
    release(ctx)
    return rows


def bench_gpt(ctx: Context, loss_fn, loss_name: str, mm: dict) -> list:
    cfg = CONFIG[(ctx.device.type, ctx.quick)]
    g_cfg = cfg["gpt"]
    torch.manual_seed(0)
    model = GPT(**g_cfg).to(ctx.device)

    def batch_fn(n):
        g = torch.Generator(device=ctx.device).manual_seed(n)
        seq = torch.randint(0, g_cfg["vocab"], (n, g_cfg["ctx"] + 1), device=ctx.device, generator=g)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    params = sum(p.numel() for p in model.parameters())
    describe = (f"GPT {g_cfg['layers']}L d{g_cfg['d']} {g_cfg['heads']}h ctx {g_cfg['ctx']} vocab {g_cfg['vocab']} "
                f"({params / 1e6:.1f}M params, tied head), batch {cfg['gpt_batch']} x {g_cfg['ctx']} tokens")
    rows = bench_model(ctx, "gpt", model, batch_fn, cfg["gpt_batch"], g_cfg["ctx"], 1, loss_fn, loss_name, mm,
                       describe)
    del model
    release(ctx)
    return rows


def matmul_row(ctx: Context, mm: dict) -> dict:
    label = f"{str(mm['dtype']).replace('torch.', '')} {mm['n']}^3"
    others = ", ".join(f"{str(dt).replace('torch.', '')} {r / 1e12:.3g} TFLOP/s" for dt, r in mm["rates"].items())
    where = (torch.cuda.get_device_name(ctx.device) if ctx.is_cuda
             else "CPU smoke: the faster of fp32 and bf16 torch.mm is the MFU reference")
    return result(
        f"dense matmul rate, MFU reference ({label}){' (CPU smoke)' if not ctx.is_cuda else ''}",
        ours=mm["rate"] / 1e12, torch_=None, unit="TFLOP/s", higher_is_better=True,
        notes=f"torch.mm, best call; {others}; {where}",
        matmul_tflops=mm["rate"] / 1e12, matmul_n=mm["n"],
        matmul_rates={str(dt): r / 1e12 for dt, r in mm["rates"].items()})


def run(ctx: Context) -> list:
    loss_fn, loss_name = pick_loss(ctx.device)
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark,
             torch.is_autocast_cache_enabled())
    rows = []
    try:
        torch.backends.cudnn.benchmark = True
        torch.set_autocast_cache_enabled(False)  # as for CUDA graphs; one cast per weight a step anyway
        set_tf32(False)
        mm = matmul_rate(ctx)
        rows.append(matmul_row(ctx, mm))
        rows += guarded(ctx, "e2e resnet50", bench_resnet, loss_fn, loss_name, mm)
        rows += guarded(ctx, "e2e gpt", bench_gpt, loss_fn, loss_name, mm)
    finally:
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark,
         cache) = saved
        torch.set_autocast_cache_enabled(cache)
        release(ctx)
    return rows
