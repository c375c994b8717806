"""fusetrain's linear_cross_entropy against torch 2.13+'s own
``F.linear_cross_entropy`` and eager ``F.cross_entropy(F.linear(...))``,
forward + backward, time and peak memory, side by side (issue 50).

Rows per shape (x [N, H], W [C, H], no bias; inputs and peaks as
bench_linear_cross_entropy.py: the variants interleaved call by call, each
peak from a fresh process):

  ours        fusetrain, options=None (eager's precision: 16-bit GEMMs; fp16
              on the CPU in fp32)
  eager       F.cross_entropy(F.linear(x, W), t)
  ours_opts   fusetrain with LinearCrossEntropyOptions() (torch's default
              options: "accurate" for 16-bit on the CPU)
  torch_own   F.linear_cross_entropy(..., options=torch.nn.LinearCrossEntropyOptions())

Goals: ours_opts >= 1.3x torch_own at no more memory; ours >= 1.2x eager and
never slower than eager. And float16 gradient error: x [N, H], W [C, H]
float32 leaves under CPU float16 autocast, loss x 65536 (a GradScaler's
initial scale) backward and unscaled, relative L2 error of x.grad and W.grad
against a float64 reference, for ours and eager (goal: ours no worse).

    python bench/bench_lce_vs_torch.py [--quick] [--shapes=0,2,...]

Writes bench/results/lce_vs_torch-<date>.json.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_linear_cross_entropy as lce_bench  # noqa: E402
from common import _cpu_model  # noqa: E402

import fusetrain.nn.functional as FF  # noqa: E402

SHAPES = [(8192, 768, 50257, "bf16"), (8192, 768, 50257, "fp32"), (4096, 256, 50257, "fp32"),
          (8192, 768, 32768, "fp16"), (8192, 768, 32768, "bf16"), (8192, 768, 32768, "fp32")]
QUICK_SHAPES = [(2048, 768, 32768, "bf16"), (4096, 256, 50257, "fp32")]
FP16_ERROR_SHAPE = (4096, 32, 32768)


def time_shape(n, h, c, dname, repeats=2):
    dtype = lce_bench.DTYPES[dname]
    fns = lce_bench.loss_fns()
    # float16 eager GEMMs on a CPU take minutes (no hardware path): not timed.
    variants = ["ours", "ours_opts", "torch_own"] + ([] if dname == "fp16" else ["eager"])
    fns["eager"] = fns["torch"]
    x, w, t = lce_bench.make_inputs(torch.device("cpu"), n, h, c, dtype)
    times = {v: [] for v in variants}
    for i in range(repeats + 1):  # the first round warms up
        for v in variants:
            x.grad = w.grad = None
            s = time.perf_counter()
            fns[v](x, w, t).backward()
            if i:
                times[v].append(time.perf_counter() - s)
            print(f"  [lce_vs_torch] {n}x{h}->{c} {dname} {v}: {time.perf_counter() - s:.2f} s",
                  file=sys.stderr, flush=True)
    x.grad = w.grad = None
    peak = {}
    ctx = type("Ctx", (), {"threads": torch.get_num_threads()})()
    for v in variants:
        peak[v], _ = lce_bench.peak_cpu(ctx, "torch" if v == "eager" else v, n, h, c, dname)
    med = {v: sorted(ts)[len(ts) // 2] for v, ts in times.items()}
    return {"shape": f"{n}x{h}->{c} {dname}", "median_s": med, "times_s": times, "peak_mib": peak}


def fp16_error(n, h, c):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, h, generator=g)
    w = torch.randn(c, h, generator=g) * (2.0 / h**0.5)
    t = torch.randint(0, c, (n,), generator=g)
    # The reference: the same float16-rounded operands (what autocast's
    # GEMMs take), in float64.
    x64 = x.half().double().requires_grad_()
    w64 = w.half().double().requires_grad_()
    F.cross_entropy(x64 @ w64.T, t).backward()
    out = {}
    scale = 65536.0
    for name, fn in {"ours": lambda a, b: FF.linear_cross_entropy(a, b, t),
                     "eager": lambda a, b: F.cross_entropy(F.linear(a, b), t)}.items():
        a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
        s = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = fn(a, b)
        (loss * scale).backward()
        secs = time.perf_counter() - s

        def rel(got, ref):
            return float((got.double() / scale - ref).norm() / ref.norm())

        out[name] = {"x_grad_rel_err": rel(a.grad, x64.grad), "w_grad_rel_err": rel(b.grad, w64.grad),
                     "seconds": secs}
        print(f"  [lce_vs_torch] fp16 {name}: {out[name]}", file=sys.stderr, flush=True)
    return {"shape": f"{n}x{h}->{c} fp16 autocast, loss scale 65536", **out}


def main(argv):
    quick = "--quick" in argv
    shapes = QUICK_SHAPES if quick else SHAPES
    report = {"date": datetime.date.today().isoformat(), "cpu": _cpu_model(), "threads": torch.get_num_threads(),
              "torch": torch.__version__, "rows": [], "fp16_error": None}
    only = [a for a in argv if a.startswith("--shapes=")]
    if only:  # --shapes=0,2: a subset of SHAPES by index
        shapes = [shapes[int(i)] for i in only[0].split("=", 1)[1].split(",")]
    for shape in shapes:
        row = time_shape(*shape)
        m, p = row["median_s"], row["peak_mib"]
        row["ratios"] = {
            "ours_opts_vs_torch_own_time": m["torch_own"] / m["ours_opts"],
            "ours_opts_vs_torch_own_memory": (p["torch_own"] / p["ours_opts"]
                                              if p.get("torch_own") and p.get("ours_opts") else None),
        }
        if "eager" in m:
            row["ratios"]["ours_vs_eager_time"] = m["eager"] / m["ours"]
            row["ratios"]["ours_vs_eager_memory"] = p["eager"] / p["ours"] if p.get("eager") and p.get("ours") else None
        print(json.dumps({k: row[k] for k in ("shape", "median_s", "peak_mib", "ratios")}), flush=True)
        report["rows"].append(row)
    report["fp16_error"] = fp16_error(*((1024, 32, 8192) if quick else FP16_ERROR_SHAPE))
    print(json.dumps(report["fp16_error"]), flush=True)
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    path = os.path.join(os.path.dirname(__file__), "results",
                        f"lce_vs_torch-{report['date']}{'-quick' if quick else ''}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--peak-child":
        sys.exit(lce_bench._peak_child(sys.argv[2]))
    sys.exit(main(sys.argv[1:]))
