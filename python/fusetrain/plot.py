"""Loss and accuracy curves of a ``fusetrain train`` run.

    python -m fusetrain.plot RUN_DIR [-o curves.png]

reads ``RUN_DIR/metrics.jsonl`` (``kind: train`` records every
``train.log_every`` steps, ``kind: eval`` records at each epoch end) and
writes a PNG (default ``RUN_DIR/curves.png``): training and test loss
against the step on the left, test accuracy on the right. matplotlib's Agg
backend draws it, so no display is needed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Tuple

__all__ = ["read_metrics", "plot_run", "main"]


def read_metrics(run_dir) -> Tuple[List[dict], List[dict]]:
    """(train records, eval records) of a run, one per step (a resumed run's
    later record of a step replaces the earlier one), each sorted by step.
    ``run_dir`` is the run directory (a path or a string); a missing
    ``run_dir/metrics.jsonl`` is a ``FileNotFoundError``, a line that is not
    JSON a ``ValueError``."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a fusetrain train run directory?")
    by_kind: Dict[str, Dict[int, dict]] = {"train": {}, "eval": {}}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not a JSON record ({e})") from None
        by_kind.setdefault(rec.get("kind", "train"), {})[int(rec["step"])] = rec
    return ([by_kind["train"][s] for s in sorted(by_kind["train"])],
            [by_kind["eval"][s] for s in sorted(by_kind["eval"])])


def plot_run(run_dir, output=None) -> Path:
    """Writes the curves of ``run_dir`` to ``output`` (default
    ``run_dir/curves.png``) and returns its path."""
    import matplotlib  # noqa: PLC0415  (imported late: the backend must be set first)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    train, evals = read_metrics(run_dir)
    if not train and not evals:
        raise ValueError(f"{run_dir}/metrics.jsonl holds no records yet")
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    if train:
        ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss", lw=1)
    if evals:
        ax_loss.plot([r["step"] for r in evals], [r["test_loss"] for r in evals], "o-", label="test loss")
        ax_acc.plot([r["step"] for r in evals], [100.0 * r["accuracy"] for r in evals], "o-", color="C2")
        best = max(evals, key=lambda r: r["accuracy"])
        ax_acc.set_title(f"test accuracy (last {100 * evals[-1]['accuracy']:.2f}%, "
                         f"best {100 * best['accuracy']:.2f}%)")
    else:
        ax_acc.set_title("test accuracy (no epoch finished yet)")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("cross-entropy")
    ax_loss.set_title("loss")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    ax_acc.set_xlabel("step")
    ax_acc.set_ylabel("accuracy (%)")
    ax_acc.grid(alpha=0.3)
    fig.suptitle(str(Path(run_dir).name))
    fig.tight_layout()
    out = Path(output) if output else Path(run_dir) / "curves.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    """The command line, ``python -m fusetrain.plot RUN_DIR [-o PNG]``:
    ``argv`` the arguments (default None: ``sys.argv[1:]``). Prints the PNG's
    path and returns 0, or prints the error and returns 1."""
    ap = argparse.ArgumentParser(prog="python -m fusetrain.plot", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a fusetrain train run directory (holds metrics.jsonl)")
    ap.add_argument("-o", "--output", help="PNG to write (default RUN_DIR/curves.png)")
    args = ap.parse_args(argv)
    try:
        out = plot_run(args.run_dir, args.output)
    except (OSError, ValueError) as e:
        print(f"fusetrain.plot: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
