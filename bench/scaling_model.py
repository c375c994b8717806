#!/usr/bin/env python
"""A model of data-parallel scaling efficiency on 2 to 256 GPUs for
fusetrain's DistributedDataParallel, from a measured (or, until the GPU box
has run ``bench_ddp``, estimated) single-GPU step, the reducer's bucket
layout and NCCL bus bandwidth. Writes the tables of bench/scaling_model.md
(two generated parts: one node and 2 nodes; multi-host, 16-256 GPUs).

    python bench/scaling_model.py                  # print the tables
    python bench/scaling_model.py --write          # and refresh scaling_model.md
    python bench/scaling_model.py --results bench/results/<machine>-<date>.json ...

The model (one step, per rank; see scaling_model.md for the reasoning):

- Buckets as the reducer builds them (``compute_bucket_assignment``): reverse
  parameter order, a ~1 MB first bucket, then ``bucket_cap_mb`` (25 MB).
- Bucket k is ready when the backward has produced its last gradient:
  ``r_k = T_f + T_b * c_k``, c_k the fraction of the backward's work done by
  then, taken as the fraction of gradient bytes produced (exact for an MLP,
  whose backward FLOPs per layer are proportional to its parameters).
- Allreduces run one after another, in bucket order (one NCCL stream):
  ``t_k = alpha + b_k * 2(n-1)/n / busbw``; ``start_k = max(r_k, end_{k-1})``.
- The backward slows by ``sigma`` while it shares the GPU with NCCL's kernels.
- ``T_n = max(T_f + T_b(1 + sigma), end_last) + T_opt``; ``T_1 = T_f + T_b + T_opt``;
  efficiency ``T_1 / T_n``; speedup ``n * T_1 / T_n`` (weak scaling: the
  per-GPU batch stays the same).

Multi-host (nodes of 8 GPUs, one 200 or 400 Gb/s NIC per GPU): each bucket's
allreduce costs what NCCL's tuner (``src/graph/tuning.cc``) says the cheapest
of ring, ring/LL, NVLS-tree and tree/LL costs: ``latency + b * 2(n-1)/n / busbw``,
the ring's latency growing with its 2(n-1) steps, the trees' with log2(nodes),
busbw bounded by the node's NICs (8 x per-NIC busbw) and by NVLink.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

HERE = Path(__file__).resolve().parent
MD = HERE / "scaling_model.md"
BEGIN, END = "<!-- BEGIN GENERATED (bench/scaling_model.py) -->", "<!-- END GENERATED -->"
BEGIN_MULTI, END_MULTI = ("<!-- BEGIN GENERATED multi-host (bench/scaling_model.py) -->",
                          "<!-- END GENERATED multi-host -->")

MB = 1 << 20
REFERENCE_SPEEDUP = {2: 2.0, 4: 3.8, 8: 7.3}  # issue 4's "commonly reported" figures

# Interconnects (bus bandwidth of a large NCCL allreduce, GB/s) and the fixed
# cost per allreduce call (alpha). Sources in scaling_model.md.
LINKS = {
    "NVLink ring": dict(busbw=370.0, alpha_us=15.0),  # nccl-tests#212: ~370 ring on NVLink4
    "NVLink NVLS": dict(busbw=475.0, alpha_us=15.0),  # nccl-tests#272: 475 peak, 8xH200
    "IB 8x400G": dict(busbw=8 * 46.0, alpha_us=40.0),  # nccl-tests#290: 46-48 GB/s per NDR NIC
    "IB 4x400G": dict(busbw=4 * 46.0, alpha_us=40.0),
    "Eth 8x100G": dict(busbw=8 * 11.5, alpha_us=60.0),
}
INTRA = ("NVLink ring", "NVLink NVLS")
INTER = ("IB 8x400G", "IB 4x400G", "Eth 8x100G")


# ------------------------------------------------------------------ the model


def bucket_assignment(sizes_bytes: List[int], first_cap: int = 1 * MB, cap: int = 25 * MB) -> List[List[int]]:
    """Mirror of fusetrain::dist::compute_bucket_assignment for one dtype:
    reverse order, a new bucket when adding would pass the cap."""
    buckets: List[List[int]] = []
    total = 0
    for k in range(len(sizes_bytes) - 1, -1, -1):
        limit = first_cap if len(buckets) == 1 else cap
        if not buckets or total + sizes_bytes[k] > limit:
            buckets.append([])
            total = 0
        buckets[-1].append(k)
        total += sizes_bytes[k]
    return buckets


@dataclass
class Workload:
    name: str
    t_fwd_ms: float
    t_bwd_ms: float
    t_opt_ms: float
    bucket_bytes: List[int]  # in reduction order
    source: str
    comm_bytes_per_grad_byte: float = 1.0  # 0.5 with comm_dtype=bf16 on fp32 grads

    @property
    def grad_bytes(self) -> int:
        return sum(self.bucket_bytes)

    @property
    def t1_ms(self) -> float:
        return self.t_fwd_ms + self.t_bwd_ms + self.t_opt_ms


@dataclass
class Estimate:
    n: int
    link: str
    t_allreduce_ms: float  # all buckets back to back, alone
    exposed_ms: float  # what the step waits for after the backward
    step_ms: float
    efficiency: float
    speedup: float


def allreduce_ms(nbytes: float, n: int, busbw_gbs: float, alpha_us: float) -> float:
    if n == 1:
        return 0.0
    return alpha_us * 1e-3 + nbytes * 2 * (n - 1) / n / (busbw_gbs * 1e9) * 1e3


def estimate(w: Workload, n: int, link: str, sigma: float = 0.0) -> Estimate:
    busbw, alpha = LINKS[link]["busbw"], LINKS[link]["alpha_us"]
    return schedule(w, n, link, lambda nbytes: allreduce_ms(nbytes, n, busbw, alpha), sigma)


def schedule(w: Workload, n: int, link: str, t_allreduce: Callable[[float], float], sigma: float = 0.0,
             overlap: bool = True) -> Estimate:
    """One step: bucket k's allreduce (``t_allreduce(bytes)`` ms) starts when the
    bucket is ready and the previous one has finished; without overlap, all of
    them start after the backward."""
    total = w.grad_bytes
    t_bwd = w.t_bwd_ms * (1 + sigma) if n > 1 and overlap else w.t_bwd_ms
    bwd_end = w.t_fwd_ms + t_bwd
    end, done, comm_alone = 0.0, 0, 0.0
    for b in w.bucket_bytes:
        done += b
        ready = w.t_fwd_ms + t_bwd * done / total if overlap else bwd_end
        t = t_allreduce(b * w.comm_bytes_per_grad_byte) if n > 1 else 0.0
        comm_alone += t
        end = max(ready, end) + t
    step = max(bwd_end, end) + w.t_opt_ms
    eff = w.t1_ms / step
    return Estimate(n, link, comm_alone, max(0.0, end - bwd_end), step, eff, n * eff)


# -------------------------------------------------------------- the workloads


def mlp_sizes(widths: List[int], dtype_bytes: int = 4) -> List[int]:
    """Parameter sizes in bytes of an MLP (weight, bias per layer), in order."""
    out = []
    for a, b in zip(widths[:-1], widths[1:]):
        out += [a * b * dtype_bytes, b * dtype_bytes]
    return out


GPU_WIDTHS = [4096] * 7 + [16]  # bench_ddp.gpu_model(): 6 x Linear(4096, 4096) + Linear(4096, 16)
GPU_BATCH = 8192
H200_BF16_DENSE_TFLOPS = 989.0
ASSUMED_MFU = 0.6  # achieved fraction of the dense peak for 4096-wide GEMMs (an assumption)
H200_HBM_TBS = 4.8


def bench_gpu_workload(results: Optional[dict]) -> Workload:
    """The GPU benchmark's model: measured when a CUDA results file has the
    row, else estimated from its FLOPs (flagged)."""
    sizes = mlp_sizes(GPU_WIDTHS)
    buckets = [sum(sizes[i] for i in b) for b in bucket_assignment(sizes)]
    row = _find_row(results, "ddp step vs torch DDP, nccl world 1") if results else None
    if row is not None:
        return Workload(
            name=f"bench MLP {row['nparams'] / 1e6:.0f}M, batch {GPU_BATCH}, bf16 ({row['gpu']})",
            t_fwd_ms=row["fwd_ms"], t_bwd_ms=row["bwd_ms"], t_opt_ms=row["opt_ms"],
            bucket_bytes=row["bucket_bytes"], source=f"measured ({results['date']}, {results['machine'].get('gpu')})",
        )
    nparams = sum(sizes) // 4
    flops_fwd = 2 * nparams * GPU_BATCH
    rate = H200_BF16_DENSE_TFLOPS * ASSUMED_MFU * 1e12
    t_fwd = flops_fwd / rate * 1e3
    # SGD with momentum, foreach: reads param, grad, momentum; writes param, momentum (fp32)
    t_opt = 5 * 4 * nparams / (H200_HBM_TBS * 1e12) * 1e3
    return Workload(
        name=f"bench MLP {nparams / 1e6:.0f}M, batch {GPU_BATCH}, bf16 (H200, estimated)",
        t_fwd_ms=t_fwd, t_bwd_ms=2 * t_fwd, t_opt_ms=t_opt, bucket_bytes=buckets,
        source=(f"ESTIMATED, not measured: FLOPs at {ASSUMED_MFU:.0%} of {H200_BF16_DENSE_TFLOPS:.0f} "
                "TFLOP/s bf16 dense; backward = 2 x forward; optimizer = 5 fp32 passes at 4.8 TB/s"),
    )


def scaled_workload(base: Workload, grad_scale: float) -> Workload:
    """The same step times with every parameter ``grad_scale`` times larger
    (more parameters per FLOP: fewer tokens per step), re-bucketed."""
    sizes = [int(b * grad_scale) for b in mlp_sizes(GPU_WIDTHS)]
    buckets = [sum(sizes[i] for i in b) for b in bucket_assignment(sizes)]
    return Workload(name=f"{base.name}, gradients x{grad_scale:g}", t_fwd_ms=base.t_fwd_ms,
                    t_bwd_ms=base.t_bwd_ms, t_opt_ms=base.t_opt_ms, bucket_bytes=buckets,
                    source=base.source)


# ---------------------------------------------------------------- multi-host
#
# A cluster of nodes of GPUS_PER_NODE GPUs (NVLink + NVSwitch inside the node),
# each GPU with its own NIC (rail-optimised: GPU i of every node on rail switch
# i), 2 to 32 nodes. An allreduce is costed as NCCL's tuner costs it
# (NVIDIA/nccl src/graph/tuning.cc, 2.19-2.21): per algorithm/protocol a
# latency from per-step hardware latencies, plus bytes over a bandwidth; NCCL
# runs the cheapest, and so does the model (per bucket).

GPUS_PER_NODE = 8
NODE_COUNTS = (2, 4, 8, 16, 32)  # 16 .. 256 GPUs
NICS_PER_NODE = 8  # one per GPU
# Effective bandwidth of one NIC in an NCCL allreduce, GB/s.
NIC_GBS = {
    "200G": 24.0,  # nccl-tests#119 (NCCL maintainer): "24GB/s is the peak performance per 200G NIC"
    "400G": 46.0,  # nccl-tests#290 (NCCL maintainer): "46-48GB/s per NIC" at NDR 400 Gb/s
}
# NCCL's LL protocol caps out far below the NICs (tuning.cc llMaxBws, Intel host: 2 nodes, more).
LL_MAX_BUSBW = {2: 39.0, "more": 20.4}
# tuning.cc latencies, us: base, per NVLink step, per network step (Simple / LL protocols).
RING_SIMPLE = dict(base=8.4, nvl=3.4, net=14.0)
RING_LL = dict(base=6.6, nvl=0.6 * 1.8, net=2.7)  # tuning.cc: intra-node LL latency x1.8 on > 1 node
TREE_LL = dict(base=6.8, nvl=0.6 * 1.8, net=5.0)
NVLS_TREE = dict(base=0.0, nvl=23.0, net=14.0)  # one NVLink-SHARP step inside the node
RING_PLATEAU = 1.4  # tuning.cc: Hopper, > 1 node, Simple ring allreduce latency x1.4 ("plateau effect of ring")


def net_busbw(nic: str) -> float:
    """Large-message busbw across nodes: each of the node's NICs carries one
    ring (or tree) channel, so the node's aggregate NIC bandwidth bounds it, as
    does NVLink inside the node."""
    return min(LINKS["NVLink ring"]["busbw"], NICS_PER_NODE * NIC_GBS[nic])


def algo_costs(n: int, nic: str) -> Dict[str, Tuple[float, float]]:
    """(latency us, busbw GB/s) of the algorithms modelled, for n GPUs on
    n / GPUS_PER_NODE nodes; time = latency + bytes * 2(n-1)/n / busbw."""
    m = n // GPUS_PER_NODE
    steps, inter = 2 * (n - 1), 2 * m  # ring allreduce: 2(n-1) steps, 2m of them between nodes
    log_m = m.bit_length() - 1  # log2(nodes), nodes a power of two
    bw = net_busbw(nic)
    ll_bw = min(LL_MAX_BUSBW[2] if m == 2 else LL_MAX_BUSBW["more"], bw / 4)

    def ring(c):
        return c["base"] + (steps - inter) * c["nvl"] + inter * c["net"]

    def tree(c):  # up the tree and down again: 2 (intra-node chain + log2(nodes) network hops)
        return c["base"] + 2 * ((GPUS_PER_NODE - 1) * c["nvl"] + log_m * c["net"])

    return {
        "ring": (ring(RING_SIMPLE) * RING_PLATEAU, bw),
        "ring/LL": (ring(RING_LL), ll_bw),
        "NVLS-tree": (NVLS_TREE["nvl"] + 2 * log_m * NVLS_TREE["net"], min(LINKS["NVLink NVLS"]["busbw"], bw)),
        "tree/LL": (tree(TREE_LL), ll_bw),
    }


MODES = {
    "NCCL's choice": ("ring", "ring/LL", "NVLS-tree", "tree/LL"),
    "ring only": ("ring", "ring/LL"),  # NCCL_ALGO=Ring
}


def multi_allreduce(nbytes: float, n: int, nic: str, mode: str = "NCCL's choice") -> Tuple[float, str, float]:
    """(ms, algorithm, latency ms) of the cheapest allreduce of nbytes among the
    mode's algorithms."""
    costs = algo_costs(n, nic)
    best = None
    for a in MODES[mode]:
        lat_us, busbw = costs[a]
        t = lat_us * 1e-3 + nbytes * 2 * (n - 1) / n / (busbw * 1e9) * 1e3
        if best is None or t < best[0]:
            best = (t, a, lat_us * 1e-3)
    return best


def estimate_multi(w: Workload, n: int, nic: str, mode: str = "NCCL's choice", sigma: float = 0.0,
                   overlap: bool = True) -> Estimate:
    return schedule(w, n, f"{n // GPUS_PER_NODE} nodes, {nic}",
                    lambda nbytes: multi_allreduce(nbytes, n, nic, mode)[0], sigma, overlap)


def batch_scaled_workload(base: Workload, per_gpu_batch: int) -> Workload:
    """The benchmark model at another per-GPU batch: forward and backward scale
    with the batch (the MFU held: optimistic for small batches), the optimizer
    and the gradients do not."""
    f = per_gpu_batch / GPU_BATCH
    return Workload(name=f"{base.name}, batch {per_gpu_batch}", t_fwd_ms=base.t_fwd_ms * f,
                    t_bwd_ms=base.t_bwd_ms * f, t_opt_ms=base.t_opt_ms, bucket_bytes=base.bucket_bytes,
                    source=base.source)


# Failures (assumptions, see scaling_model.md): Llama 3's 54-day snapshot on
# 16,384 H100s (2,048 nodes of 8) had 419 unexpected interruptions.
NODE_FAILURES_PER_HOUR = 419 / (2048 * 54 * 24)
RESTART_S = 600.0  # re-queue, start, NCCL init, reload the checkpoint (assumption)


def checkpoint_overhead(nodes: int, write_s: float) -> Tuple[float, float, float]:
    """(job MTBF h, checkpoint interval h, fraction of time lost) with
    Young/Daly's interval sqrt(2 C M) and, to first order, the loss
    C/tau + (tau/2 + R)/M: writing checkpoints, redoing half an interval and
    restarting per failure."""
    mtbf_s = 3600.0 / (nodes * NODE_FAILURES_PER_HOUR)
    tau = math.sqrt(2 * write_s * mtbf_s)
    return mtbf_s / 3600, tau / 3600, write_s / tau + (tau / 2 + RESTART_S) / mtbf_s


# ---------------------------------------------------------------- validation


def cpu_validation(results: Optional[dict]) -> Optional[dict]:
    """The one multi-rank setup this project can measure, CPU gloo 2 ranks:
    the model's backward+sync against the measured one."""
    row = _find_row(results, "ddp overlap (hidden comm), gloo 2 ranks") if results else None
    if row is None:
        return None
    o = row["overlap"]
    sizes = row["bucket_bytes"]
    total = sum(sizes)
    t_b, comm = o["bwd_ms"], o["comm_ms"]
    end, done = 0.0, 0
    for b in sizes:
        done += b
        end = max(t_b * done / total, end) + comm * b / total
    predicted = max(t_b, end) + o["copies_ms"]
    return {
        "date": results["date"],
        "machine": f"{results['machine']['cpu_model']}, {results['machine']['cpu_cores']} cores",
        "bwd_ms": t_b, "comm_ms": comm, "copies_ms": o["copies_ms"],
        "bucket_mb": [round(b / 1e6, 2) for b in sizes],
        "predicted_ms": predicted, "measured_ours_ms": o["ours"]["bwd_ddp_ms"],
        "measured_torch_ms": o["torch"]["bwd_ddp_ms"],
        # the row's own load average: a results file merges runs, its machine block is the last run's
        "load": tuple(row.get("loadavg") or (results["machine"].get("loadavg_start"),
                                             results["machine"].get("loadavg_end"))),
    }


def _find_row(results: dict, benchmark: str) -> Optional[dict]:
    rows = [r for r in results.get("results", []) if r.get("benchmark") == benchmark and r.get("ours") is not None]
    return rows[-1] if rows else None


def _latest(pattern_device: str) -> Optional[dict]:
    best = None
    for path in sorted((HERE / "results").glob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if doc.get("device") == pattern_device and any(r.get("module") == "ddp" for r in doc.get("results", [])):
            if best is None or doc.get("date", "") >= best.get("date", ""):
                best = doc
    return best


# -------------------------------------------------------------------- tables


def fmt_table(headers, rows) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def workload_table(w: Workload, sigma: float) -> str:
    rows = []
    for n in (2, 4, 8):
        for link in INTRA:
            e = estimate(w, n, link, sigma)
            ref = REFERENCE_SPEEDUP.get(n)
            rows.append([n, link, f"{e.t_allreduce_ms:.2f}", f"{e.exposed_ms:.2f}", f"{e.step_ms:.2f}",
                         f"{e.efficiency:.1%}", f"{e.speedup:.2f}x", f"{ref}x" if ref else ""])
    for link in INTER:
        e = estimate(w, 16, link, sigma)
        rows.append([16, f"2 nodes, {link}", f"{e.t_allreduce_ms:.2f}", f"{e.exposed_ms:.2f}",
                     f"{e.step_ms:.2f}", f"{e.efficiency:.1%}", f"{e.speedup:.2f}x", ""])
    return fmt_table(["GPUs", "link", "allreduce alone ms", "exposed ms", "step ms", "efficiency",
                      "speedup", "reference"], rows)


def sensitivity_table(base: Workload) -> str:
    """Efficiency at 8 GPUs (NVLink ring) and 16 (2 nodes, IB 8x400G) as the
    gradient bytes per unit of backward time grow."""
    rows = []
    for scale in (1, 4, 16, 64):
        w = scaled_workload(base, scale)
        ratio = allreduce_ms(w.grad_bytes, 8, LINKS["NVLink ring"]["busbw"], 0) / w.t_bwd_ms
        cells = [f"x{scale} ({w.grad_bytes / 1e9:.2f} GB)", f"{ratio:.2f}"]
        for n, link in ((8, "NVLink ring"), (16, "IB 8x400G"), (16, "Eth 8x100G")):
            for sigma in (0.0, 0.1):
                cells.append(f"{estimate(w, n, link, sigma).efficiency:.1%}")
        rows.append(cells)
    return fmt_table(
        ["gradients", "t_ar(8, NVLink) / T_b", "8 NVLink", "8 NVLink, sigma 10%", "16 IB", "16 IB, sigma 10%",
         "16 Eth", "16 Eth, sigma 10%"], rows)


def expected_max_normal(n: int) -> float:
    """E[max of n iid standard normals] (numerical integration)."""
    import math

    if n == 1:
        return 0.0
    h, total = 1e-3, 0.0
    x = -10.0
    while x < 10.0:
        pdf = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        total += x * n * pdf * cdf ** (n - 1) * h
        x += h
    return total


def straggler_table(w: Workload) -> str:
    """A synchronous step waits for the slowest rank: with per-rank step times
    jittering by a coefficient of variation cv, the step grows by about
    T_1 * cv * E[max of n standard normals]."""
    rows = []
    for n, link in ((2, "NVLink ring"), (4, "NVLink ring"), (8, "NVLink ring"), (16, "IB 8x400G")):
        e = estimate(w, n, link)
        em = expected_max_normal(n)
        cells = [n, link, f"{em:.2f}"]
        for cv in (0.01, 0.02, 0.05):
            step = e.step_ms + w.t1_ms * cv * em
            cells.append(f"{w.t1_ms / step:.1%} ({n * w.t1_ms / step:.2f}x)")
        rows.append(cells)
    return fmt_table(["GPUs", "link", "E[max of n N(0,1)]", "cv 1%", "cv 2%", "cv 5%"], rows)


# --------------------------------------------------------- multi-host tables


def _cell(e: Estimate) -> str:
    return f"{e.efficiency:.1%} ({e.speedup:.1f}x)"


def multi_inputs_table() -> str:
    rows = []
    for m in NODE_COUNTS:
        n = m * GPUS_PER_NODE
        c = algo_costs(n, "400G")
        rows.append([n, m, f"{n * GPU_BATCH:,}"] + [f"{c[a][0]:.0f}" for a in MODES["NCCL's choice"]])
    return fmt_table(["GPUs", "nodes", "global batch", "ring us", "ring/LL us", "NVLS-tree us", "tree/LL us"], rows)


def message_size_table(w: Workload, nic: str = "400G") -> str:
    """One allreduce, NCCL's choice, by message size (the benchmark model's
    bucket sizes): time, algorithm, and the share of the time that is latency."""
    weight = max(w.bucket_bytes)
    sizes = [(min(w.bucket_bytes), "a bias"), (w.bucket_bytes[0], "the first bucket"),
             (25 * MB, "the 25 MiB cap"), (weight, "a 4096 x 4096 weight"), (4 * weight, "the same, x4")]
    ns = (16, 64, 256)
    rows = []
    for b, what in sizes:
        cells = [f"{b / 1e3:.0f} KB ({what})" if b < 1e5 else f"{b / 1e6:.1f} MB ({what})"]
        for n in ns:
            t, a, lat = multi_allreduce(b, n, nic)
            cells.append(f"{t * 1e3:,.0f} us, {a}, {lat / t:.0%}")
        t, a, lat = multi_allreduce(b, 256, nic, "ring only")
        cells.append(f"{t * 1e3:,.0f} us, {a}, {lat / t:.0%}")
        rows.append(cells)
    return fmt_table(["message"] + [f"{n} GPUs" for n in ns] + ["256 GPUs, ring only"], rows)


def multi_workload_table(w: Workload, sigma: float) -> str:
    biggest = max(w.bucket_bytes)
    rows = []
    for m in NODE_COUNTS:
        n = m * GPUS_PER_NODE
        cells = [n, m]
        for nic in NIC_GBS:
            cells.append(f"{multi_allreduce(biggest * w.comm_bytes_per_grad_byte, n, nic)[0]:.2f}")
        for nic in NIC_GBS:
            cells.append(_cell(estimate_multi(w, n, nic, sigma=sigma)))
            cells.append(_cell(estimate_multi(w, n, nic, sigma=sigma, overlap=False)))
        rows.append(cells)
    return fmt_table(["GPUs", "nodes", "largest bucket ms, 200G", "400G", "200G, overlapped", "200G, not overlapped",
                      "400G, overlapped", "400G, not overlapped"], rows)


def ring_only_table(w: Workload, sigma: float) -> str:
    rows = []
    for m in NODE_COUNTS:
        n = m * GPUS_PER_NODE
        cells = [n, f"{algo_costs(n, '400G')['ring'][0] / 1e3:.2f}"]
        for nic in NIC_GBS:
            r = estimate_multi(w, n, nic, "ring only", sigma)
            cells += [f"{r.exposed_ms:.2f}", _cell(r), _cell(estimate_multi(w, n, nic, sigma=sigma))]
        rows.append(cells)
    return fmt_table(["GPUs", "ring latency per call, ms", "200G ring only: exposed ms", "efficiency",
                      "200G NCCL's choice", "400G ring only: exposed ms", "efficiency", "400G NCCL's choice"], rows)


STRONG_GLOBAL_BATCH = 8 * GPU_BATCH  # the one-node configuration's global batch, held


def strong_scaling_table(base: Workload, sigma: float) -> str:
    """The global batch held at STRONG_GLOBAL_BATCH: each GPU's share shrinks
    as n grows. Speedup against one GPU running the whole global batch."""
    t1 = (base.t_fwd_ms + base.t_bwd_ms) * STRONG_GLOBAL_BATCH / GPU_BATCH + base.t_opt_ms
    rows = []
    for n in (8,) + tuple(m * GPUS_PER_NODE for m in NODE_COUNTS):
        w = batch_scaled_workload(base, STRONG_GLOBAL_BATCH // n)
        cells = [n, STRONG_GLOBAL_BATCH // n, f"{w.t_bwd_ms:.2f}"]
        for nic in NIC_GBS:
            e = estimate(w, n, "NVLink ring", sigma) if n == 8 else estimate_multi(w, n, nic, sigma=sigma)
            cells += [f"{e.step_ms:.2f}", f"{t1 / e.step_ms:.1f}x ({t1 / e.step_ms / n:.0%})"]
        rows.append(cells)
    return fmt_table(["GPUs", "per-GPU batch", "T_b ms", "200G: step ms", "speedup (efficiency)", "400G: step ms",
                      "speedup (efficiency)"], rows)


def multi_straggler_table(w: Workload, nic: str = "400G") -> str:
    rows = []
    for m in NODE_COUNTS:
        n = m * GPUS_PER_NODE
        e = estimate_multi(w, n, nic)
        em = expected_max_normal(n)
        cells = [n, f"{em:.2f}", f"{math.sqrt(2 * math.log(n)):.2f}", f"{e.efficiency:.1%}"]
        for cv in (0.01, 0.02, 0.05):
            step = e.step_ms + w.t1_ms * cv * em
            cells.append(f"{w.t1_ms / step:.1%} ({n * w.t1_ms / step:.1f}x)")
        rows.append(cells)
    return fmt_table(["GPUs", "E[max of n N(0,1)]", "sqrt(2 ln n)", "cv 0", "cv 1%", "cv 2%", "cv 5%"], rows)


def failure_table() -> str:
    rows = []
    for m in NODE_COUNTS + (2048,):
        mtbf, tau_a, loss_a = checkpoint_overhead(m, 10.0)
        _, tau_b, loss_b = checkpoint_overhead(m, 300.0)
        days = f" ({mtbf / 24:.1f} d)" if mtbf >= 48 else ""
        rows.append([f"{m * GPUS_PER_NODE:,}", f"{m:,}", f"{mtbf:,.0f} h{days}", f"{tau_a * 60:.0f} min",
                     f"{loss_a:.2%}", f"{tau_b:.1f} h", f"{loss_b:.2%}"])
    return fmt_table(["GPUs", "nodes", "job MTBF", "checkpoint 10 s: interval", "time lost",
                      "checkpoint 5 min: interval", "time lost"], rows)


def generate_multi(gpu_results: Optional[dict], sigma: float) -> str:
    w = bench_gpu_workload(gpu_results)
    lines = [
        "_Generated by `python bench/scaling_model.py --write`, from the same workload as the tables above._",
        "",
        "### Multi-host inputs",
        "",
        f"- Nodes of {GPUS_PER_NODE} GPUs, {NICS_PER_NODE} NICs a node (one per GPU); large-message busbw across "
        "nodes = min(NVLink ring busbw, NICs x NIC busbw): "
        + "; ".join(f"{k} NICs: {NICS_PER_NODE} x {v:.0f} = {net_busbw(k):.0f} GB/s" for k, v in NIC_GBS.items())
        + f"; the LL protocol (small messages) {LL_MAX_BUSBW[2]:g} GB/s on 2 nodes, "
        f"{LL_MAX_BUSBW['more']:g} on more, whatever the NICs.",
        f"- sigma = {sigma:.0%}. Efficiency is T_1 / T_n; speedup n T_1 / T_n (weak scaling, {GPU_BATCH} samples "
        "per GPU).",
        "- Latency per allreduce call (NCCL's tuner, 400G and 200G alike):",
        "",
        multi_inputs_table(),
        "",
        "### One allreduce by message size, 400G: time, the algorithm NCCL's tuner picks, latency's share",
        "",
        message_size_table(w),
        "",
    ]
    models = [(w, f"benchmark model ({w.grad_bytes / 1e6:.0f} MB of gradients)")]
    for scale in (4, 16):
        s = scaled_workload(w, scale)
        models.append((s, f"gradients x{scale} ({s.grad_bytes / 1e9:.2f} GB), same step times"))
    for mw, title in models:
        lines += [f"### Efficiency (speedup), {title}", "", multi_workload_table(mw, sigma), ""]
    lines += [
        "### Ring only (`NCCL_ALGO=Ring`) against NCCL's choice, benchmark model, overlapped",
        "",
        ring_only_table(w, sigma),
        "",
        f"### Strong scaling: the global batch held at {STRONG_GLOBAL_BATCH:,} (benchmark model, overlapped)",
        "",
        strong_scaling_table(w, sigma),
        "",
        "### Stragglers at scale (benchmark model, 400G, overlapped, sigma 0)",
        "",
        multi_straggler_table(w),
        "",
        f"### Failures and checkpoints (assumed {NODE_FAILURES_PER_HOUR * 1e4:.2f} failures per 10,000 node-hours, "
        f"restart {RESTART_S / 60:.0f} min; the last row, Llama 3's scale, for comparison)",
        "",
        failure_table(),
    ]
    return "\n".join(lines)


def generate(gpu_results: Optional[dict], cpu_results: Optional[dict], sigma: float) -> str:
    w = bench_gpu_workload(gpu_results)
    gpu_inputs = (f"the GPU step measured ({gpu_results['date']})" if w.source.startswith("measured")
                  else "the GPU step estimated (no CUDA `bench_ddp` results yet)")
    cpu_inputs = f"CPU results of {cpu_results['date']}" if cpu_results else "no CPU results"
    lines = [
        f"_Generated by `python bench/scaling_model.py --write` from {gpu_inputs} and {cpu_inputs}._",
        "",
        "### Inputs",
        "",
        f"- Workload: {w.name}. Source: {w.source}.",
        f"- T_f = {w.t_fwd_ms:.2f} ms, T_b = {w.t_bwd_ms:.2f} ms, T_opt = {w.t_opt_ms:.2f} ms "
        f"(T_1 = {w.t1_ms:.2f} ms per step on one GPU).",
        f"- Gradients {w.grad_bytes / 1e6:.1f} MB fp32 in {len(w.bucket_bytes)} buckets (reduction order, MB): "
        + ", ".join(f"{b / 1e6:.1f}" for b in w.bucket_bytes) + ".",
        "- Links (busbw GB/s, alpha us): "
        + "; ".join(f"{k} {v['busbw']:.0f}, {v['alpha_us']:.0f}" for k, v in LINKS.items()) + ".",
        f"- sigma (backward slowdown while NCCL runs beside it) = {sigma:.0%} in the first table.",
        "",
        "### Efficiency of the benchmark model",
        "",
        workload_table(w, sigma),
        "",
        "### Sensitivity: more gradient bytes per millisecond of backward",
        "",
        "Same step times, gradients scaled (a model with proportionally more parameters per FLOP, e.g. fewer "
        "tokens per step). Column 2 is the whole allreduce on 8 GPUs (NVLink ring, no overlap) over T_b.",
        "",
        sensitivity_table(w),
        "",
        "### Stragglers: per-rank step-time jitter (benchmark model, sigma 0)",
        "",
        straggler_table(w),
        "",
        "### Validation: CPU, gloo, 2 ranks (the only multi-rank setup measured here)",
        "",
    ]
    v = cpu_validation(cpu_results)
    if v is None:
        lines.append("No CPU `bench_ddp` results found (run `python bench/run.py --only ddp`).")
    else:
        lines += [
            f"From `bench/results` ({v['date']}, {v['machine']}, load average {v['load'][0]} -> {v['load'][1]}): "
            f"backward alone {v['bwd_ms']:.1f} ms, the same buckets ({', '.join(map(str, v['bucket_mb']))} MB) "
            f"allreduced alone {v['comm_ms']:.1f} ms, bucket copies {v['copies_ms']:.1f} ms.",
            "",
            fmt_table(["", "backward + sync, ms"], [
                ["model (comm on its own resources)", f"{v['predicted_ms']:.1f}"],
                ["measured, fusetrain DDP", f"{v['measured_ours_ms']:.1f}"],
                ["measured, torch DDP", f"{v['measured_torch_ms']:.1f}"],
                ["no overlap at all (backward + copies + comm)", f"{v['bwd_ms'] + v['copies_ms'] + v['comm_ms']:.1f}"],
            ]),
        ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, action="append", default=[],
                    help="bench results JSON (default: the newest with ddp rows, per device)")
    ap.add_argument("--sigma", type=float, default=0.0, help="backward slowdown while overlapped (0.1 = 10%%)")
    ap.add_argument("--write", action="store_true", help=f"replace the generated part of {MD.name}")
    args = ap.parse_args(argv)
    gpu = cpu = None
    for p in args.results:
        doc = json.loads(p.read_text())
        if doc.get("device") == "cuda":
            gpu = doc
        else:
            cpu = doc
    gpu = gpu or _latest("cuda")
    cpu = cpu or _latest("cpu")
    blocks = [(BEGIN, END, generate(gpu, cpu, args.sigma)), (BEGIN_MULTI, END_MULTI, generate_multi(gpu, args.sigma))]
    print("\n\n".join(text for _, _, text in blocks))
    if args.write:
        md = MD.read_text()
        for begin, end, text in blocks:
            if begin not in md or end not in md:
                print(f"{MD}: markers {begin!r} / {end!r} missing", file=sys.stderr)
                return 1
            head, rest = md.split(begin, 1)
            _, tail = rest.split(end, 1)
            md = f"{head}{begin}\n{text}\n{end}{tail}"
        MD.write_text(md)
        print(f"wrote {MD.relative_to(HERE.parent)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
