"""Every offline method tuned for itself: offline KL-PPO, offline SPPO, DPO, IPO, SimPO and KTO, each at three
strengths (``STRENGTHS``, else ``compare_offline_runs.METHODS``') and every learning rate of ``--lrs`` (three a
decade apart), on both tasks' ranked files, from each asset set's SFT model; each method's best configuration
per KL band, and whether offline KL-PPO and offline SPPO sit on the accuracy-KL frontier of the tuned baselines.

    python -m ppo_bench.offline_sweep [--assets assets --assets /work/assets1 --assets /work/assets2]
        [--seeds 0 1 2] [--tasks add,carry4] [--methods ppo,sppo,dpo,ipo,simpo,kto] [--lrs 1e-5,1e-4,1e-3]
        [--strengths dpo=1,10,100] [--steps 20] [--batch 16] [--prompts 512] [--eval-prompts 300]
        [--workers 2] [--out outputs/offline_sweep] [--overwrite] [--keep-models] [--json]
        [--plot docs/offline_sweep.png] [--doc docs/results.md]

An asset set is what ``make assets SEED=N ASSETS=DIR`` builds (``make carry4 SEED=N ASSETS=DIR`` adds the
four-digit task, its offline file included, to an older one). Per task (``TASKS``) it holds the SFT model, the
ranked file (4 responses of that SFT model per training prompt, ranked by the rule, with their log-probs) and
the validation prompts. ``--seeds`` pairs with ``--assets`` (default 0, 1, ...) and is the runs' ``trainer.seed``.

A run is one method at one strength and one learning rate, the method's preset (``compare_offline_runs``:
``configs/demo_cpu_offline.yaml``, ``configs/demo_cpu_sppo_offline.yaml``, ``configs/dpo_demo.yaml`` with
``loss.type``) with its schedule (warm-up, cosine decay) and these keys: the first ``--prompts`` groups of the
ranked file (written once per task and seed into ``OUT/<task>/seed<N>/train.parquet``), ``--steps`` optimizer
steps of ``--batch`` groups (PPO, SPPO: ``batch × 4`` responses, one update a step) or pairs (the DPO
family), the task's response length, no validation and no checkpoints. Smaller than ``make compare-offline``'s
runs (40 steps of 64) so that the grid fits: 6 methods × 3 strengths × 3 learning rates × 2 tasks × 3 seeds is
324 runs. Each run's final model is measured the way ``compare_offline`` measures it
(``ppo.model_eval.answer_metrics``): greedy accuracy on the first ``--eval-prompts`` validation prompts, and
``KL(π ‖ π_SFT)`` in nats per response on ``EVAL_SAMPLES`` samples per prompt from the model at temperature 1.

The runs go to ``--workers`` processes (one intra-op thread each), which call the trainers' ``main`` in
process (``train_ppo.py``, ``scripts/train_dpo.py``: the command line a user runs, without torchrun's
start-up), then measure the model and delete it (``--keep-models`` keeps ``hf/``). Each run's folder
``OUT/<task>/seed<N>/<method>_<strength>_lr<lr>/`` keeps its ``train.log``, ``config.yaml`` and metrics.

A configuration (task, method, strength, learning rate) has the seeds' mean accuracy and mean KL. Its KL
band is one of ``KL_BANDS``. Per task, a method's best configuration in a band is its most accurate one
there: that is the method tuned for itself at that KL. A configuration of offline KL-PPO or offline SPPO is
below the baselines' frontier when a configuration of DPO, IPO, SimPO or KTO is at least as accurate with at
most its KL (and better in one); the table says so for each band's best, with the gap to the best baseline
in the band, its per-seed range, and where a method's most accurate configuration is at an edge of its grid
(the smallest or largest learning rate or strength).

Writes into ``OUT`` (default ``outputs/offline_sweep``): ``plan.json``, ``results.json`` (settings, every run,
every configuration, the verdicts), ``table.md`` and the figure (``--plot``, default ``OUT/frontier.png``).
``--doc FILE`` also puts the table, the figure and the command between ``<!-- offline_sweep:begin -->`` and
``<!-- offline_sweep:end -->`` in FILE. ``--json``: one JSON line per configuration instead of the table.

Bad input (a missing asset file, an unknown task or method, a bad grid, ``OUT`` holding an earlier sweep
without ``--overwrite``, a ``--doc`` without its marker lines, a command the trainer refuses) stops with one
line and exit code 2 before any training; a failed run stops the sweep with its log's last lines (exit 1).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ppo_bench.compare_offline import COLORS, dominates
from ppo_bench.compare_offline_runs import METHODS, Method, training_args
from ppo_bench.offline_sweep_runs import EVAL_SAMPLES, TASKS, Task, run_all
from ppo_bench.runs import (
    CommandError,
    InputError,
    asset_sets,
    check_command,
    check_doc,
    check_out,
    clear_out,
    doc_link,
    machine,
    parse_names,
    pyplot,
    save_figure,
    write_doc,
)

LRS = (1e-5, 1e-4, 1e-3)
"""The learning rates of every method and strength (``--lrs``)."""
KL_BANDS = (0.05, 0.2, 0.5)
"""The bands' upper edges in nats per response: KL ≤ 0.05, 0.05-0.2, 0.2-0.5 and above 0.5."""
STRENGTHS = {
    "dpo": (1.0, 10.0, 100.0),
    "ipo": (1.0, 10.0, 100.0),
    "kto": (1.0, 10.0, 100.0),
    "simpo": (50.0, 500.0, 5000.0),
}
"""Strengths of the DPO family a decade above ``make compare-offline``'s (the others' are its own): in 20 steps
of 16 pairs at lr 1e-4 their β=0.1 (SimPO's 5) went furthest from the SFT model and was below β=1 and β=10
on both tasks, while β=10 (SimPO's 500), the largest, was each one's best."""
BASELINES = ("dpo", "ipo", "simpo", "kto")
"""The methods whose frontier offline KL-PPO and offline SPPO are held against."""
MARKERS = ("<!-- offline_sweep:begin -->", "<!-- offline_sweep:end -->")
OUTPUTS = ("plan.json", "results.json", "table.md", "frontier.png", *TASKS)
"""What a sweep writes into ``OUT`` (``--overwrite`` deletes these and nothing else)."""


# ----------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m ppo_bench.offline_sweep",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--assets", action="append", default=None, metavar="DIR", help="an asset set (repeat)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="trainer.seed per asset set")
    p.add_argument("--tasks", default=",".join(TASKS), help="a comma-separated subset of " + ",".join(TASKS))
    p.add_argument("--methods", default=",".join(METHODS), help="a subset of " + ",".join(METHODS))
    p.add_argument("--lrs", default=",".join(f"{lr:g}" for lr in LRS), help="learning rates, comma-separated")
    p.add_argument(
        "--strengths", action="append", default=[], metavar="METHOD=A,B,...", help="other strengths"
    )
    p.add_argument("--steps", type=int, default=20, help="optimizer steps of every run")
    p.add_argument("--batch", type=int, default=16, help="groups (PPO, SPPO) or pairs a step")
    p.add_argument("--prompts", type=int, default=512, help="the ranked file's first N groups")
    p.add_argument("--eval-prompts", type=int, default=300, help="the validation file's first N prompts")
    p.add_argument("--workers", type=int, default=2, help="processes, one thread each")
    p.add_argument("--out", default="outputs/offline_sweep", help="the sweep's folder")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier sweep in --out")
    p.add_argument("--keep-models", action="store_true", help="keep each run's final model (hf/)")
    p.add_argument("--json", action="store_true", help="JSON lines instead of the table")
    p.add_argument("--plot", default=None, help="the figure's path (default OUT/frontier.png)")
    p.add_argument("--doc", default=None, help="a Markdown file whose marked section gets the table")
    return p.parse_args(argv)


def numbers(option: str, text: str) -> tuple[float, ...]:
    """Comma-separated positive, different numbers; InputError otherwise."""
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise InputError(f"{option} {text}: not a comma-separated list of numbers") from None
    if min(values) <= 0 or len(set(values)) != len(values):
        raise InputError(f"{option} {text}: positive values, each once")
    return values


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What the command line asks for, checked."""

    assets: list[Path]
    seeds: list[int]
    tasks: list[str]
    methods: list[Method]
    strengths: dict[str, tuple[float, ...]]
    lrs: tuple[float, ...]


def check_inputs(args: argparse.Namespace) -> Plan:
    """Everything that can be checked before training without the trainer; InputError with one line."""
    tasks = parse_names("--tasks", args.tasks, TASKS, "task")
    names = parse_names("--methods", args.methods, METHODS, "method")
    strengths = {n: STRENGTHS.get(n, METHODS[n].strengths) for n in names}
    for item in args.strengths:
        name, _, value = item.partition("=")
        if name not in strengths:
            raise InputError(
                f"--strengths {item}: {name!r} is not one of the methods run ({', '.join(names)})"
            )
        strengths[name] = numbers("--strengths", value)
    lrs = numbers("--lrs", args.lrs)
    assets, seeds = asset_sets(args)
    for option in ("--batch", "--prompts", "--eval-prompts", "--workers"):
        if getattr(args, option[2:].replace("-", "_")) < 1:
            raise InputError(f"{option}: at least 1")
    for root in assets:
        for name in tasks:
            task = TASKS[name]
            for what, rel in (
                ("SFT model", f"{task.sft}/config.json"),
                ("file", task.train),
                ("file", task.val),
            ):
                if not (root / rel).is_file():
                    raise InputError(
                        f"--assets {root}: {what} {root / rel} not found: run `make {task.make} ASSETS={root} "
                        "SEED=<its seed>` first"
                    )
    if args.doc:
        check_doc(Path(args.doc), MARKERS)
    check_out(Path(args.out), OUTPUTS, args.overwrite)
    return Plan(
        assets=[a.resolve() for a in assets],
        seeds=seeds,
        tasks=tasks,
        methods=[METHODS[n] for n in names],
        strengths=strengths,
        lrs=lrs,
    )


def run_keys(method: Method, task: Task, batch: int) -> tuple[str, ...]:
    """The sweep's keys of a run besides the comparison's: the batch, one update a step, the response length."""
    keys = [f"data.train_batch_size={batch}", f"data.max_response_length={task.response_length}"]
    if method.script == "train_ppo.py":
        keys.append(f"actor.ppo_mini_batch_size={batch}")
    return tuple(keys)


def make_jobs(plan: Plan, args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    """One job per SFT model (its measurement) and per run, the slower trainer's runs first."""
    jobs = []
    for name in plan.tasks:
        task = TASKS[name]
        for root, seed in zip(plan.assets, plan.seeds, strict=True):
            cell = out / name / f"seed{seed}"
            common = {"task": name, "seed": seed, "sft": str(root / task.sft), "val": str(root / task.val)}
            jobs.append({**common, "id": f"{name}/seed{seed}/sft", "dir": str(cell / "sft"), "method": "sft"})
            for method in plan.methods:
                for strength in plan.strengths[method.name]:
                    for lr in plan.lrs:
                        run_dir = cell / f"{method.name}_{strength:g}_lr{lr:g}"
                        targs = training_args(
                            method,
                            strength,
                            lr,
                            sft=root / task.sft,
                            train_file=cell / "train.parquet",
                            steps=args.steps,
                            out_dir=run_dir,
                            extra=(f"trainer.seed={seed}", *run_keys(method, task, args.batch)),
                        )
                        jobs.append(
                            {
                                **common,
                                "id": f"{name}/seed{seed}/{run_dir.name}",
                                "dir": str(run_dir),
                                "method": method.name,
                                "strength": strength,
                                "lr": lr,
                                "steps": args.steps,
                                "script": method.script,
                                "args": targs,
                            }
                        )
    return sorted(jobs, key=lambda j: j.get("script") != "train_ppo.py")


def write_train_files(plan: Plan, prompts: int, out: Path) -> None:
    """``OUT/<task>/seed<N>/train.parquet``: the first ``prompts`` groups of each ranked file."""
    import pyarrow.parquet as pq

    for name in plan.tasks:
        for root, seed in zip(plan.assets, plan.seeds, strict=True):
            cell = out / name / f"seed{seed}"
            cell.mkdir(parents=True, exist_ok=True)
            table = pq.read_table(root / TASKS[name].train)
            pq.write_table(table.slice(0, prompts), cell / "train.parquet")


# ----------------------------------------------------------------------------------------------------
# Configurations, bands, the frontier
# ----------------------------------------------------------------------------------------------------


def band_of(kl: float) -> int:
    """The index of ``kl``'s band in ``KL_BANDS`` (``len(KL_BANDS)``: above the last edge)."""
    return next((i for i, edge in enumerate(KL_BANDS) if kl <= edge), len(KL_BANDS))


def band_name(i: int) -> str:
    low = "" if i == 0 else f"{KL_BANDS[i - 1]:g}"
    if i == len(KL_BANDS):
        return f"KL > {low}"
    return f"KL ≤ {KL_BANDS[i]:g}" if i == 0 else f"{low} < KL ≤ {KL_BANDS[i]:g}"


def configurations(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (task, method, strength, lr): the seeds' accuracies and KLs (by seed), their means, the
    accuracy's min and max, and the KL band of the mean KL."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in runs:
        if r["method"] != "sft":
            groups.setdefault((r["task"], r["method"], r["strength"], r["lr"]), []).append(r)
    rows = []
    for (task, method, strength, lr), rs in groups.items():
        rs = sorted(rs, key=lambda r: r["seed"])
        acc = [r["accuracy"] for r in rs]
        kl = statistics.fmean(r["kl"] for r in rs)
        rows.append(
            {
                "task": task,
                "method": method,
                "strength": strength,
                "lr": lr,
                "seeds": [r["seed"] for r in rs],
                "accuracies": acc,
                "kls": [r["kl"] for r in rs],
                "accuracy": statistics.fmean(acc),
                "accuracy_min": min(acc),
                "accuracy_max": max(acc),
                "kl": kl,
                "band": band_of(kl),
            }
        )
    return rows


def best_per_band(rows: list[dict[str, Any]], task: str, method: str) -> dict[int, dict[str, Any]]:
    """``method``'s most accurate configuration in each KL band on ``task`` (bands it has none in are absent)."""
    best: dict[int, dict[str, Any]] = {}
    for r in rows:
        if r["task"] == task and r["method"] == method:
            if r["band"] not in best or r["accuracy"] > best[r["band"]]["accuracy"]:
                best[r["band"]] = r
    return best


def verdicts(
    rows: list[dict[str, Any]], task: str, lrs: tuple[float, ...], strengths: dict[str, tuple[float, ...]]
) -> list[str]:
    """What the sweep says on ``task``, as Markdown bullet lines: for offline KL-PPO and offline SPPO, each
    band's best against the baselines' frontier and the best baseline in the band (mean gap, per-seed
    range); then the methods whose most accurate configuration took the smallest or largest learning rate or
    strength of its grid (``strengths``: by method)."""
    base = [r for r in rows if r["task"] == task and r["method"] in BASELINES]
    lines = []
    for method in ("ppo", "sppo"):
        for band, r in sorted(best_per_band(rows, task, method).items()):
            what = f"{METHODS[method].label} in {band_name(band)} ({describe(r)})"
            beaten = [b for b in base if dominates(b, r)]
            if beaten:
                top = max(beaten, key=lambda b: (b["accuracy"], -b["kl"]))
                verdict = f"below the baselines' frontier: {METHODS[top['method']].label} {describe(top)}"
            else:
                verdict = "on the baselines' frontier (no baseline at least as accurate with at most its KL)"
            rival = max((b for b in base if b["band"] == band), key=lambda b: b["accuracy"], default=None)
            if rival is not None:
                gaps = [a - b for a, b in zip(r["accuracies"], rival["accuracies"], strict=True)]
                verdict += (
                    f"; against the band's best baseline, {METHODS[rival['method']].label} {describe(rival)}: "
                    f"{statistics.fmean(gaps):+.3f} (seeds {min(gaps):+.3f} to {max(gaps):+.3f})"
                )
            lines.append(f"- {what}: {verdict}")
    methods = list(dict.fromkeys(r["method"] for r in rows if r["task"] == task))
    edges = []
    for method in methods:
        top = max(
            (r for r in rows if r["task"] == task and r["method"] == method), key=lambda r: r["accuracy"]
        )
        grid = strengths.get(method, ())
        at = [f"lr {top['lr']:g}"] if len(lrs) > 1 and top["lr"] in (min(lrs), max(lrs)) else []
        if len(grid) > 1 and top["strength"] in (min(grid), max(grid)):
            at.append(f"{METHODS[method].strength_name}={top['strength']:g}")
        if at:
            edges.append(f"{METHODS[method].label} ({', '.join(at)})")
    if edges:
        lines.append(
            "- the most accurate configuration at an edge of its grid (a wider grid might do better): "
            + ", ".join(edges)
        )
    return lines


def describe(r: dict[str, Any]) -> str:
    """``β=1, lr 1e-4: 0.912 at KL 0.123``."""
    return (
        f"{METHODS[r['method']].strength_name}={r['strength']:g}, lr {r['lr']:g}: "
        f"{r['accuracy']:.3f} at KL {r['kl']:.3f}"
    )


# ----------------------------------------------------------------------------------------------------
# Table, figure, files
# ----------------------------------------------------------------------------------------------------


def table_markdown(results: dict[str, Any]) -> str:
    """Per task: the SFT models' accuracy, one row per method with its best configuration per KL band
    (mean accuracy, seeds' min-max, strength, lr, mean KL), then the verdicts."""
    s, rows = results["settings"], results["configurations"]
    bands = range(len(KL_BANDS) + 1)
    parts = []
    for task in s["tasks"]:
        sft = [r["accuracy"] for r in results["sft"] if r["task"] == task]
        parts.append(
            f"**{TASKS[task].label}** (`{task}`): the SFT models {statistics.fmean(sft):.3f} "
            f"({', '.join(f'{a:.3f}' for a in sft)})\n\n"
            "| method | " + " | ".join(band_name(b) for b in bands) + " |\n|---|" + "---|" * len(bands)
        )
        for method in s["methods"]:
            best = best_per_band(rows, task, method)
            cells = []
            for b in bands:
                r = best.get(b)
                cells.append(
                    "-"
                    if r is None
                    else f"{r['accuracy']:.3f} ({r['accuracy_min']:.3f}-{r['accuracy_max']:.3f}) "
                    f"{METHODS[method].strength_name}={r['strength']:g} lr {r['lr']:g} KL {r['kl']:.3f}"
                )
            parts[-1] += f"\n| {METHODS[method].label} | " + " | ".join(cells) + " |"
        parts[-1] += "\n\n" + "\n".join(verdicts(rows, task, tuple(s["lrs"]), s["strengths"])) + "\n"
    grid = "; ".join(
        f"{METHODS[m].label} {METHODS[m].strength_name} {', '.join(f'{v:g}' for v in s['strengths'][m])}"
        for m in s["methods"]
    )
    return (
        f"Each cell: the method's most accurate configuration in the band, its mean greedy accuracy over "
        f"{len(s['seeds'])} seeds (min-max), strength, learning rate and mean KL(π ‖ π_SFT) in nats per "
        f"response. {s['steps']} steps of {s['batch']} groups or pairs from the first {s['prompts']} groups of "
        f"each ranked file; {s['eval_prompts']} validation prompts (one standard error of one seed's accuracy "
        f"about ±{math.sqrt(0.25 / s['eval_prompts']):.3f} at 0.5), {EVAL_SAMPLES} samples each for the KL. "
        f"Learning rates {', '.join(f'{lr:g}' for lr in s['lrs'])}; {grid}.\n\n" + "\n\n".join(parts)
    )


def plot(results: dict[str, Any], path: Path) -> None:
    """One panel per task: every configuration's mean (KL, accuracy) as a faint dot, and each method's
    best per band joined by a line; the SFT models' mean at KL 0."""
    s, rows = results["settings"], results["configurations"]
    fig, axes = pyplot().subplots(1, len(s["tasks"]), figsize=(6.5 * len(s["tasks"]), 4.5), squeeze=False)
    for ax, task in zip(axes[0], s["tasks"], strict=True):
        sft = statistics.fmean(r["accuracy"] for r in results["sft"] if r["task"] == task)
        ax.plot([0.0], [sft], marker="*", markersize=14, color="black", linestyle="none", label="SFT")
        for method in s["methods"]:
            mine = [r for r in rows if r["task"] == task and r["method"] == method]
            color = COLORS[method]
            ax.scatter([r["kl"] for r in mine], [r["accuracy"] for r in mine], s=10, alpha=0.3, color=color)
            best = sorted(best_per_band(rows, task, method).values(), key=lambda r: r["kl"])
            ax.plot(
                [r["kl"] for r in best],
                [r["accuracy"] for r in best],
                marker="o",
                color=color,
                label=METHODS[method].label,
            )
        ax.set_xscale("symlog", linthresh=0.01)
        for edge in KL_BANDS:
            ax.axvline(edge, color="gray", linewidth=0.6, linestyle=":")
        ax.set_xlabel("KL(π ‖ π_SFT), nats per response (symlog)")
        ax.set_ylabel("greedy validation accuracy, mean of seeds")
        ax.set_title(f"{TASKS[task].label}: best per KL band, every configuration faint")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    save_figure(fig, path)


def doc_section(results: dict[str, Any], table: str, plot_path: Path, doc: Path) -> str:
    s = results["settings"]
    return (
        f"Generated by `{s['command']}` ({len(results['runs'])} runs in {s['total_wall_s'] / 60:.0f} minutes "
        f"on {s['machine']}, {s['workers']} worker processes).\n\n"
        + table
        + f"\n![The offline methods tuned for themselves]({doc_link(plot_path, doc)})\n"
    )


# ----------------------------------------------------------------------------------------------------
# The sweep
# ----------------------------------------------------------------------------------------------------


def sweep(args: argparse.Namespace, plan: Plan, argv: list[str], progress: TextIO) -> dict[str, Any]:
    """Check one command per method, train and measure every run, write the files (inputs checked)."""
    start = time.perf_counter()
    out = Path(args.out).resolve()
    jobs = make_jobs(plan, args, out)
    for method in plan.methods:  # one command per method: the others differ in values only
        job = next(j for j in jobs if j["method"] == method.name)
        check_command(job["args"], 1, method.script, files_later=True)
    clear_out(out, OUTPUTS)
    settings = {
        "command": "python -m ppo_bench.offline_sweep " + " ".join(argv),
        "machine": machine(),
        "workers": args.workers,
        "tasks": plan.tasks,
        "methods": [m.name for m in plan.methods],
        "strengths": plan.strengths,
        "lrs": list(plan.lrs),
        "seeds": plan.seeds,
        "assets": [str(a) for a in plan.assets],
        "steps": args.steps,
        "batch": args.batch,
        "prompts": args.prompts,
        "eval_prompts": args.eval_prompts,
        "eval_samples": EVAL_SAMPLES,
        "kl_bands": list(KL_BANDS),
    }
    (out / "plan.json").write_text(json.dumps({"settings": settings, "jobs": jobs}, indent=1))
    write_train_files(plan, args.prompts, out)
    done = run_all(
        jobs,
        workers=args.workers,
        eval_prompts=args.eval_prompts,
        keep_models=args.keep_models,
        progress=progress,
    )
    settings["total_wall_s"] = time.perf_counter() - start
    runs = [r for r in done if r["method"] != "sft"]
    results = {
        "settings": settings,
        "sft": [r for r in done if r["method"] == "sft"],
        "runs": runs,
        "configurations": configurations(runs),
    }
    results["verdicts"] = {
        t: verdicts(results["configurations"], t, plan.lrs, plan.strengths) for t in plan.tasks
    }
    table = table_markdown(results)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "table.md").write_text(table)
    plot_path = Path(args.plot) if args.plot else out / "frontier.png"
    plot(results, plot_path)
    if args.doc:
        write_doc(Path(args.doc), doc_section(results, table, plot_path, Path(args.doc)), MARKERS)
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        plan = check_inputs(args)
        results = sweep(args, plan, argv, sys.stderr)
    except InputError as e:
        print(f"offline_sweep: error: {e}", file=sys.stderr)
        return 2
    except CommandError as e:
        print(f"\noffline_sweep: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\noffline_sweep: interrupted: {args.out} holds the runs finished so far", file=sys.stderr)
        return 130
    if args.json:
        from ppo_bench.common import print_json_lines

        print_json_lines(results["configurations"], kind="configuration")
    else:
        print((Path(args.out) / "table.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
