"""Plot a run's main curves from its metrics.jsonl into one PNG, or several runs side by side.

    python scripts/plot_run.py outputs/run              # writes outputs/run/curves.png
    python scripts/plot_run.py outputs/run --out x.png
    python scripts/plot_run.py outputs/a outputs/b --out ab.png     # one line per run in every panel

Panels: validation accuracy, training score, KL to the reference (and its coefficient), response
length, policy loss and clip fraction, entropy, for multi-turn runs the tool calls per trajectory, and
with ``rollout.val_kwargs`` the share right, pass@n, verl's best@n and majority vote of the n sampled
answers;
a panel is skipped when no run has any of its keys. With several runs each line is labelled with the
run folder's name (and the key, where a panel has several).
"""

from __future__ import annotations

import argparse
import json
import math
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
    ("tool calls per trajectory", ["rollout/tool_calls/mean", "val/tool_calls/mean"]),
]


SAMPLED = {
    "mean": "share right of {n} (mean@{n})",
    "pass": "pass@{n} (unbiased)",
    "best": "verl's best@{n} (bootstrap)",
    "maj": "majority of {n} (maj@{n})",
}
"""The panels of ``rollout.val_kwargs`` validation, for the largest ``n`` the runs logged."""


def read_rows(run_dir: Path) -> list[dict[str, float]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a run folder with the jsonl logger?")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # the last line of a run killed while writing it
            print(
                f"warning: {path}, line {number} is not complete JSON (cut short?); skipped", file=sys.stderr
            )
            continue
        # null is a NaN or infinite value (a skipped step's): a gap in the curve
        rows.append({k: math.nan if v is None else v for k, v in row.items()})
    return rows


def plot(runs: dict[str, list[dict[str, float]]], out: Path, title: str) -> int:
    """Draw the panels that have data, one line per run and key; returns how many were drawn."""
    every = [r for rows in runs.values() for r in rows]
    n = max(
        (int(k.rpartition("@")[2]) for r in every for k in r if k.startswith(("val/pass@", "val/best@"))),
        default=0,
    )
    sampled = [(SAMPLED[kind].format(n=n), [f"val/{kind}@{n}"]) for kind in SAMPLED]
    panels = [(name, [k for k in keys if any(k in r for r in every)]) for name, keys in PANELS + sampled]
    panels = [(name, keys) for name, keys in panels if keys]
    if not panels:
        raise ValueError("no known metrics in the run")
    cols = 3
    rows_n = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.2 * rows_n), squeeze=False)
    for ax, (name, keys) in zip(axes.flat, panels, strict=False):
        lines = 0
        for r_index, (run, rows) in enumerate(runs.items()):
            for k_index, key in enumerate(keys):
                pts = [(r["step"], r[key]) for r in rows if key in r]
                if not pts:
                    continue
                label = key if len(runs) == 1 else run if len(keys) == 1 else f"{run}: {key}"
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    # one colour per run (per key with one run), one line style per key
                    color=f"C{(r_index if len(runs) > 1 else k_index) % 10}",
                    linestyle=("-", "--", ":")[k_index % 3] if len(runs) > 1 else "-",
                    marker="o" if len(pts) < 30 else None,
                    ms=3,
                    label=label,
                )
                lines += 1
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if lines > 1:
            ax.legend(fontsize=6)
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
    parser.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="PNG path (default RUN_DIR/curves.png; required with several runs)",
    )
    parser.add_argument("--title", default=None, help="figure title (default: the run folder)")
    args = parser.parse_args(argv)
    if len(args.run_dirs) > 1 and args.out is None:
        print("error: --out is required with several run folders", file=sys.stderr)
        return 2
    names = [d.name for d in args.run_dirs]
    if len(set(names)) < len(names):
        names = [str(d) for d in args.run_dirs]  # same folder names: label them by path
    try:
        runs = {name: read_rows(d) for name, d in zip(names, args.run_dirs, strict=True)}
        out = args.out or args.run_dirs[0] / "curves.png"
        n = plot(runs, out, title=args.title or ", ".join(names))
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    steps = max(len(rows) for rows in runs.values())
    print(f"wrote {out} ({n} panels, {len(runs)} run(s), up to {steps} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
