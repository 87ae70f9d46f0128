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

``--out`` names the image (its suffix picks the format: ``.png``, ``.svg``, ``.pdf``; no suffix gets
``.png``); an existing folder gets ``curves.png`` inside it. The image is written whole or not at all, and
the ``wrote`` line names the file written.

A bad line of ``metrics.jsonl`` (cut short, not UTF-8, not a JSON object, no numeric ``step``) is skipped
with one warning naming the file and line; the other lines are plotted. A metric whose value is not a
number (text such as ``"n/a"``) is left out of its curve at those steps, with one note per key.
"""

from __future__ import annotations

import argparse
import json
import math
import os
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


JSON_KINDS = {list: "a list", str: "a string", int: "a number", float: "a number", bool: "true/false"}
"""What a JSON value that is not an object is, for the warning that skips its line."""


def is_number(value: object) -> bool:
    """A value a curve can plot: an int or float (JSON true/false are not metrics)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_rows(run_dir: Path) -> list[dict[str, float]]:
    """The rows of ``run_dir/metrics.jsonl`` that can be plotted, each with a numeric ``step``.

    A line that cannot be (cut short, not UTF-8, not a JSON object, no numeric ``step``) is skipped with one
    warning naming the file and line; a value that is not a number is dropped with one note per key;
    null (a NaN or infinite value, a skipped step's) becomes NaN, a gap in the curve.
    """
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a run folder with the jsonl logger?")
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise ValueError(f"{path} cannot be read: {e.strerror}") from e
    rows = []
    noted: set[str] = set()  # keys with a value that is not a number, noted once each
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        problem, row = None, None
        try:
            row = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:  # one bad byte costs its line, not the plot
            problem = f"is not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
        except json.JSONDecodeError:  # the last line of a run killed while writing it
            problem = "is not complete JSON (cut short?)"
        if problem is None and not isinstance(row, dict):
            problem = f"is {JSON_KINDS.get(type(row), 'null')}, not a JSON object of metrics"
        elif problem is None and not is_number(row.get("step")):
            problem = 'has no numeric "step"'
        if problem is not None or not isinstance(row, dict):
            print(f"warning: {path}, line {number} {problem}; skipped", file=sys.stderr)
            continue
        kept = {}
        for key, value in row.items():
            if value is None:
                kept[key] = math.nan
            elif is_number(value):
                kept[key] = value
            elif key not in noted:
                noted.add(key)
                print(
                    f"note: {path}, line {number}: {key!r} is {value!r:.40} (not a number); its values that "
                    "are not numbers are not plotted",
                    file=sys.stderr,
                )
        rows.append(kept)
    return rows


def out_path(out: Path | None, first_run: Path) -> Path:
    """The image file to write: ``--out`` as given, ``curves.png`` inside it when it is a folder, with
    ``.png`` added when it has no suffix (matplotlib's default), ``RUN_DIR/curves.png`` without it.
    ValueError for a missing folder or a format matplotlib cannot write (before any file is read)."""
    if out is None:
        return first_run / "curves.png"
    if out.is_dir():
        return out / "curves.png"
    if not out.parent.is_dir():
        raise ValueError(f"--out {out}: the folder {out.parent} does not exist; create it or choose another")
    if not out.suffix:
        return out.with_name(out.name + ".png")
    formats = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    if out.suffix[1:].lower() not in formats:
        raise ValueError(
            f"--out {out}: matplotlib cannot write {out.suffix} images; use one of "
            f"{', '.join('.' + f for f in sorted(formats))}"
        )
    return out


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
    # Written beside ``out`` and renamed: a full disk or a kill never leaves half an image.
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, dpi=110, format=out.suffix[1:].lower() or "png")
        tmp.replace(out)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
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
        help="image path, or a folder for curves.png (default RUN_DIR/curves.png; required with several "
        "runs)",
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
        out = out_path(args.out, args.run_dirs[0])
        runs = {name: read_rows(d) for name, d in zip(names, args.run_dirs, strict=True)}
        n = plot(runs, out, title=args.title or ", ".join(names))
    except (FileNotFoundError, ValueError) as e:  # no metrics.jsonl, a bad --out, no known metrics
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the image's folder is read-only or full
        print(f"error: cannot write {out}: {e.strerror or e}", file=sys.stderr)
        return 2
    steps = max(len(rows) for rows in runs.values())
    print(f"wrote {out} ({n} panels, {len(runs)} run(s), up to {steps} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
