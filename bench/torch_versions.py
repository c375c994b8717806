#!/usr/bin/env python
"""The same benchmarks on two torch releases, side by side: each row's ratio
(ours against that torch's own implementation) on either torch, from the rows
bench/run.py wrote into a results file (run.py keeps rows of different torches
apart: each carries ``torch_version``).

    python bench/torch_versions.py bench/results/<machine>-<date>.json [--old 2.11 --new 2.15]

Run bench/run.py once with each torch first, on the same machine, back to back:

    .venv/bin/python bench/run.py --quick
    .venv-torch2.11.0/bin/python bench/run.py --quick
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def rows_by_torch(doc: dict) -> dict:
    """{torch minor: {(benchmark, threads, quick): row}}."""
    file_torch = doc.get("machine", {}).get("torch", "?")
    out: dict = {}
    for r in doc.get("results", []):
        key = (r["benchmark"], r.get("threads"), r.get("quick"))
        out.setdefault(minor(r.get("torch_version", file_torch)), {})[key] = r
    return out


def fmt_ratio(r) -> str:
    return "n/a" if r is None or r.get("ratio") is None else f"{r['ratio']:.2f}x"


def table(doc: dict, old: str, new: str) -> str:
    by = rows_by_torch(doc)
    missing = [v for v in (old, new) if v not in by]
    if missing:
        raise SystemExit(f"torch_versions: no rows of torch {', '.join(missing)} here (have {sorted(by)})")
    keys = [k for k in by[new] if k in by[old]]
    lines = [f"| benchmark | ours vs torch {old} | ours vs torch {new} | torch's own speed, {new} over {old} |",
             "|---|---|---|---|"]
    for key in keys:
        a, b = by[old][key], by[new][key]
        # torch's own figure on each release: a time (smaller is better) or a rate.
        change = "n/a"
        if a.get("torch") and b.get("torch"):
            higher = b.get("higher_is_better", False)
            faster = b["torch"] / a["torch"] if higher else a["torch"] / b["torch"]
            change = f"{faster:.2f}x"
        lines.append(f"| {key[0]} | {fmt_ratio(a)} | {fmt_ratio(b)} | {change} |")
    only = sorted({k[0] for k in by[new]} ^ {k[0] for k in by[old]})
    if only:
        lines.append(f"\nmeasured on one torch only: {', '.join(only)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path)
    ap.add_argument("--old", default="2.11")
    ap.add_argument("--new", default="2.15")
    args = ap.parse_args(argv)
    print(table(json.loads(args.results.read_text()), args.old, args.new))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
