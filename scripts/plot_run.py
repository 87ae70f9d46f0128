"""Plot a run's main curves from its metrics.jsonl into one PNG.

    python scripts/plot_run.py outputs/run              # writes outputs/run/curves.png
    python scripts/plot_run.py outputs/run --out x.png

Panels: validation accuracy, training score, KL to the reference (and its coefficient), response
length, policy loss and clip fraction, entropy; a panel is skipped when the run has none of its keys.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt  # noqa: E402

PANELS = [
    ("validation accuracy", ["val/accuracy"]),
    ("training score", ["critic/score/mean"]),
    ("KL to the reference", ["actor/reward_kl_penalty", "actor/ref_kl", "actor/kl_loss"]),
    ("response length", ["response_length/mean"]),
    ("policy loss / clip fraction", ["actor/pg_loss", "actor/pg_clipfrac"]),
    ("entropy", ["actor/entropy"]),
]


def read_rows(run_dir: Path) -> list[dict[str, float]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a run folder with the jsonl logger?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot(rows: list[dict[str, float]], out: Path, title: str) -> int:
    """Draw the panels that have data; returns how many were drawn."""
    panels = [(name, [k for k in keys if any(k in r for r in rows)]) for name, keys in PANELS]
    panels = [(name, keys) for name, keys in panels if keys]
    if not panels:
        raise ValueError("no known metrics in the run")
    cols = 3
    rows_n = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.2 * rows_n), squeeze=False)
    for ax, (name, keys) in zip(axes.flat, panels, strict=False):
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if key in r]
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker="o" if len(pts) < 30 else None,
                ms=3,
                label=key,
            )
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return len(panels)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="PNG path (default RUN_DIR/curves.png)")
    args = parser.parse_args(argv)
    try:
        rows = read_rows(args.run_dir)
        out = args.out or args.run_dir / "curves.png"
        n = plot(rows, out, title=str(args.run_dir))
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({n} panels, {len(rows)} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
