"""On-policy distillation against GRPO on the CPU demo: the same SFT student trained three ways on one or
more asset sets, its greedy validation accuracy followed step by step; the issue's four criteria per seed,
a table, a plot and every number.

    python -m ppo_bench.distill [--assets assets --assets /work/assets1 --assets /work/assets2] [--seeds 0 1 2]
        [--methods grpo,distill,distill_task] [--steps 50] [--test-freq 5] [--nproc 2]
        [--out outputs/distill_compare] [--overwrite] [--json] [--plot docs/distillation_curves.png]
        [--extra distill=actor.optim.lr=5e-5 ...]

An asset set is what ``make assets SEED=N ASSETS=DIR`` builds: ``DIR/sft`` (the student), ``DIR/teacher``,
``DIR/data/{train,val}.parquet`` and ``DIR/metrics.json`` (``teacher_val_accuracy``). ``--seeds`` pairs
with ``--assets`` one to one (default 0, 1, ... in order); the seed is the runs' ``trainer.seed``.

The methods, each ``train_ppo.py`` from ``DIR/sft``:

- ``grpo``: ``configs/demo_cpu_grpo.yaml`` (the task's reward, a ``low_var_kl`` loss to the SFT model);
- ``distill``: ``configs/demo_cpu_distill.yaml`` (the teacher's per-token log-probs alone, ``k3``), the
  teacher ``DIR/teacher``;
- ``distill_task``: the distill preset with ``distillation.distillation_loss.use_task_rewards=true`` and
  the GRPO preset's task settings (``TASK_KEYS``, read from its YAML): the GRPO loss plus the
  distillation loss.

Every run is ``OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=NPROC train_ppo.py --config
PRESET`` with the asset set's paths, ``trainer.seed``, ``--steps``, validation before training and every
``--test-freq`` steps, no checkpoints, into ``OUT/seed{N}/{method}/`` (its log in ``train.log``), one after
the other (they share the machine's cores); ``--extra METHOD=KEY=VALUE`` adds an override to that method's
runs. Every command is checked with ``train_ppo.py --print-config`` before the first run starts.

Columns (one row per seed and method; ``--json``: one JSON object per row, their keys in brackets, then
one per criterion):

- ``seed`` [seed], ``method`` [method];
- ``start`` [start]: greedy validation accuracy before training (step 0), the SFT model's;
- ``+0.15 at step`` [gain_step]: the first validated step whose accuracy is at least start + 0.15 (``-`` /
  null: never within the run; validation every ``--test-freq`` steps, so a multiple of it);
- ``final`` [final], ``peak`` [peak]: accuracy at the last step, and the highest of the run;
- ``max drop`` [max_drop]: the peak minus the lowest accuracy validated after it (0 when the peak is last);
- ``s/step`` [step_s]: mean seconds of a training step over steps 2.. (step 1 warms up), validation left
  out (``timing_s/step - timing_s/testing``; results.json also has it with validation);
- ``teacher s/step`` [teacher_s], ``gen s/step`` [gen_s], ``update s/step`` [update_s]: the same mean of
  the step's phases ``timing_s/teacher`` (the teacher's forward), ``timing_s/gen`` (sampling) and
  ``timing_s/update_actor``; results.json has every phase the run logs (``timing_s/ref`` too);
- ``memory GiB`` [memory_gib]: the largest ``perf/max_memory_gib`` of the run;
- ``wall s`` [wall_s]: wall seconds of the training command (torchrun start-up, loading and the
  validations included).

The accuracy is the trainer's greedy validation (``val/accuracy``: the share of ``DIR/data/val.parquet``'s
prompts, 500 in the demo, whose greedy answer the rule scores 1; ``val/greedy_accuracy`` where sampled
validation renames it, ``val/score`` where there is no rule). One standard error is about 0.013 at 0.9
with 500 prompts.

The criteria, per seed, printed as ``PASS`` / ``FAIL`` lines with their numbers (``SKIP`` where a method
they need was not run):

- (a) distill reaches start + 0.15 in at most half the steps GRPO needs (when GRPO never reaches it in
  the run, it would need more than ``--steps``: distill passes at ``--steps``/2 or fewer);
- (b) distill ends within 0.03 of the teacher's accuracy (``DIR/metrics.json``) or above GRPO's final;
- (c) distill drops no more than 0.03 after its peak;
- (d) distill_task ends at least at max(distill's final, GRPO's final) - 0.01: "at least as good as
  either alone" within the noise (0.01, below one standard error of 500 prompts near 0.9).

Writes into ``OUT`` (default ``outputs/distill_compare``): ``results.json`` (settings, commands, every
run's curve and numbers, the criteria), ``table.md`` (the table and the criteria), and the plot
(``--plot``, default ``OUT/curves.png``): a panel per seed, greedy validation accuracy against the step for
each method, the teacher's accuracy dashed.

How long it takes: measured: see docs/distillation.md.

Bad input (a missing ``DIR/sft``, ``DIR/teacher`` or data file, ``--assets`` and ``--seeds`` of different
lengths, an unknown method, a command the trainer refuses, ``OUT`` holding an earlier comparison without
``--overwrite``) stops with one line and exit code 2 before any training; a failed run stops the
comparison with its command and the last lines of its log (exit code 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import yaml

from ppo_bench.compare_offline_runs import run_logged
from ppo_bench.runs import (
    EPS,
    ROOT,
    SKIP_STEPS,
    CommandError,
    InputError,
    accuracy_curve,
    accuracy_key,
    asset_sets,
    check_command,
    check_out,
    clear_out,
    comparison_parser,
    drop_after_peak,
    mean_after_warmup,
    parquet_rows,
    parse_names,
    pyplot,
    save_figure,
    steps_to_gain,
    torchrun_command,
    train_in_turn,
    train_step_s,
    yaml_value,
)

METHODS = ("grpo", "distill", "distill_task")
"""``--methods`` names, in table order."""
PRESETS = {
    "grpo": "configs/demo_cpu_grpo.yaml",
    "distill": "configs/demo_cpu_distill.yaml",
    "distill_task": "configs/demo_cpu_distill.yaml",
}
"""Each method's ``--config``."""
TASK_KEYS = ("actor.use_kl_loss", "actor.kl_loss_type", "actor.kl_loss_coef")
"""The GRPO preset's task settings that distill_task adds to the distill preset (values read from the GRPO
preset): the rest of the task's loss (GRPO advantages, clip) is the same in both presets or a default."""
LABELS = {"grpo": "GRPO", "distill": "distillation", "distill_task": "distillation + task"}
"""Each method's name in the plot."""
COLORS = {"grpo": "tab:red", "distill": "tab:blue", "distill_task": "tab:purple"}

GAIN = 0.15
"""The gain over the start that criterion (a) times."""
TEACHER_TOLERANCE = 0.03
"""Criterion (b): how far below the teacher distill may end."""
DROP_TOLERANCE = 0.03
"""Criterion (c): the largest drop after distill's peak."""
BOTH_TOLERANCE = 0.01
"""Criterion (d): how far below the better of distill and GRPO distill_task may end (one standard error of
500 prompts is 0.013 at 0.9)."""
PHASES = ("gen", "ref", "teacher", "update_actor")
"""The step's main phases (``timing_s/<name>``), where a run logs them."""
OUTPUTS = ("plan.json", "results.json", "table.md", "curves.png")
"""What a comparison writes into ``OUT`` besides its ``seed*`` folders (``--overwrite`` deletes these)."""
COLUMNS = (
    ("seed", "seed"),
    ("method", "method"),
    ("start", "start"),
    ("gain_step", "+0.15 at step"),
    ("final", "final"),
    ("peak", "peak"),
    ("max_drop", "max drop"),
    ("step_s", "s/step"),
    ("teacher_s", "teacher s/step"),
    ("gen_s", "gen s/step"),
    ("update_s", "update s/step"),
    ("memory_gib", "memory GiB"),
    ("wall_s", "wall s"),
)
"""(JSON key, table header) of each column."""


# ----------------------------------------------------------------------------------------------------
# Command line and commands
# ----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = comparison_parser("distill", __doc__, out="outputs/distill_compare", test_freq=5)
    p.add_argument(
        "--methods", default=",".join(METHODS), help="a comma-separated subset of " + ",".join(METHODS)
    )
    p.add_argument(
        "--extra",
        nargs="+",
        action="extend",
        default=[],
        metavar="METHOD=KEY=VALUE",
        help="another override of one method's runs, e.g. distill=actor.optim.lr=5e-5",
    )
    return p.parse_args(argv)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What the command line asks for, checked."""

    assets: list[Path]
    """The asset sets, absolute."""
    seeds: list[int]
    """``trainer.seed`` of each asset set's runs."""
    methods: list[str]
    extra: dict[str, list[str]]
    """Further overrides per method."""


def parse_extra(items: list[str], methods: list[str]) -> dict[str, list[str]]:
    """``--extra METHOD=KEY=VALUE`` items as ``{method: ["KEY=VALUE", ...]}``."""
    extra: dict[str, list[str]] = {m: [] for m in methods}
    for item in items:
        method, _, override = item.partition("=")
        if method not in methods:
            raise InputError(
                f"--extra {item}: {method!r} is not one of the methods run ({', '.join(methods)})"
            )
        if "=" not in override or override.startswith("="):
            raise InputError(f"--extra {item}: expected METHOD=KEY=VALUE, e.g. distill=actor.optim.lr=5e-5")
        extra[method].append(override)
    return extra


def check_inputs(args: argparse.Namespace) -> Plan:
    """Everything that can be checked before training without the trainer; InputError with one line."""
    methods = parse_names("--methods", args.methods, METHODS, "method")
    assets, seeds = asset_sets(args)
    needs_teacher = any(m != "grpo" for m in methods)
    for root in assets:
        wanted = [("student", root / "sft" / "config.json")]
        if needs_teacher:
            wanted.append(("teacher", root / "teacher" / "config.json"))
        wanted += [("data file", root / "data" / f"{split}.parquet") for split in ("train", "val")]
        for what, path in wanted:
            if not path.is_file():
                raise InputError(
                    f"--assets {root}: {what} {path} not found: run `make assets ASSETS={root}` first"
                )
    extra = parse_extra(args.extra, methods)
    check_out(Path(args.out), OUTPUTS, args.overwrite)
    return Plan(assets=[a.resolve() for a in assets], seeds=seeds, methods=methods, extra=extra)


def task_settings() -> list[str]:
    """``TASK_KEYS`` with their values in the GRPO preset, as overrides."""
    preset = yaml.safe_load((ROOT / PRESETS["grpo"]).read_text())
    out = []
    for key in TASK_KEYS:
        node = preset
        for part in key.split("."):
            node = node[part]
        out.append(f"{key}={yaml_value(node)}")
    return out


def train_args(
    method: str,
    *,
    assets: Path,
    seed: int,
    steps: int,
    test_freq: int,
    out_dir: Path,
    extra: Sequence[str] = (),
) -> list[str]:
    """train_ppo.py's arguments for one run (after the script's path)."""
    args = ["--config", str(ROOT / PRESETS[method])]
    if method == "distill_task":
        args += ["distillation.distillation_loss.use_task_rewards=true", *task_settings()]
    args += [
        f"model.path={assets / 'sft'}",
        f"data.train_files=[{assets / 'data' / 'train.parquet'}]",
        f"data.val_files=[{assets / 'data' / 'val.parquet'}]",
    ]
    if method != "grpo":
        args.append(f"distillation.teacher_models.teacher_model.model_path={assets / 'teacher'}")
    return [
        *args,
        f"trainer.seed={seed}",
        f"trainer.total_training_steps={steps}",
        f"trainer.test_freq={test_freq}",
        "trainer.save_freq=-1",
        "trainer.logger=[jsonl]",
        f"trainer.output_dir={out_dir}",
        "trainer.overwrite=true",
        "trainer.val_before_train=true",
        *extra,
    ]


# ----------------------------------------------------------------------------------------------------
# A run's numbers, from its metrics.jsonl rows
# ----------------------------------------------------------------------------------------------------


def run_numbers(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Every number of one run from its metrics rows: the curve and what the table shows of it, the step's
    and its phases' mean seconds, the memory peak."""
    curve = accuracy_curve(rows)
    values = [acc for _, acc in curve]
    peak = max(values) if values else None
    memory = [r["perf/max_memory_gib"] for r in rows if "perf/max_memory_gib" in r]
    phases = {name: mean_after_warmup(rows, f"timing_s/{name}") for name in PHASES}
    return {
        "accuracy_key": accuracy_key(rows),
        "curve": [[step, acc] for step, acc in curve],
        "steps": sum(1 for r in rows if "timing_s/step" in r),
        "start": values[0] if values else None,
        "gain_step": steps_to_gain(curve, GAIN),
        "final": values[-1] if values else None,
        "peak": peak,
        "peak_step": curve[values.index(peak)][0] if values else None,
        "max_drop": drop_after_peak(curve) if values else None,
        "step_s": train_step_s(rows),
        "step_with_val_s": mean_after_warmup(rows, "timing_s/step"),
        "phase_s": {name: s for name, s in phases.items() if s is not None},
        "memory_gib": max(memory) if memory else None,
    }


def asset_accuracies(assets: Path) -> dict[str, float | None]:
    """``teacher_val_accuracy`` and ``sft_val_accuracy`` of ``DIR/metrics.json`` (None where absent)."""
    try:
        metrics = json.loads((assets / "metrics.json").read_text())
    except (OSError, ValueError):
        metrics = {}
    return {"teacher": metrics.get("teacher_val_accuracy"), "sft": metrics.get("sft_val_accuracy")}


# ----------------------------------------------------------------------------------------------------
# The criteria
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Criterion:
    """One criterion of one seed: its letter, PASS / FAIL / SKIP and the numbers behind it."""

    seed: int
    name: str
    status: str
    detail: str

    def line(self) -> str:
        return f"seed {self.seed} ({self.name}) {self.status}: {self.detail}"


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def criteria(
    seed: int,
    runs: dict[str, dict[str, Any]],
    *,
    teacher: float | None,
    steps: int,
    num_prompts: int | None = None,
) -> list[Criterion]:
    """The issue's four criteria for one seed's ``runs`` (method -> ``run_numbers``), ``teacher`` the
    teacher's accuracy, ``steps`` each run's steps."""
    grpo, distill, both = runs.get("grpo"), runs.get("distill"), runs.get("distill_task")
    out = []

    def add(name: str, passed: bool | None, detail: str) -> None:
        status = "SKIP" if passed is None else "PASS" if passed else "FAIL"
        out.append(Criterion(seed=seed, name=name, status=status, detail=detail))

    # (a) steps to +0.15: distill's at most half of GRPO's
    if grpo is None or distill is None:
        add("a", None, "needs grpo and distill")
    else:
        d, g = distill["gain_step"], grpo["gain_step"]
        target = f"start {fmt(distill['start'])} + {GAIN}"
        if d is None:
            add(
                "a",
                False,
                f"distill never reaches {target} in {steps} steps (GRPO: {g if g is not None else 'never'})",
            )
        elif g is None:
            add(
                "a",
                d <= steps / 2,
                f"distill reaches {target} at step {d}; GRPO does not within the run's {steps} steps, so it needs "
                f"more than {steps}: {d} {'<=' if d <= steps / 2 else '>'} {steps}/2"
                + ("" if d <= steps / 2 else " (not shown)"),
            )
        else:
            add(
                "a",
                d <= g / 2,
                f"distill reaches {target} at step {d}, GRPO at step {g}: {d} {'<=' if d <= g / 2 else '>'} {g}/2",
            )

    # (b) distill ends near the teacher or above GRPO
    if distill is None or (teacher is None and grpo is None):
        add("b", None, "needs distill, and the teacher's accuracy or grpo")
    else:
        final = distill["final"]
        near = teacher is not None and final >= teacher - TEACHER_TOLERANCE - EPS
        above = grpo is not None and final > grpo["final"] + EPS
        parts = [f"distill ends at {fmt(final)}"]
        if teacher is not None:
            parts.append(f"teacher {fmt(teacher)} (within {TEACHER_TOLERANCE}: {'yes' if near else 'no'})")
        else:
            parts.append("teacher's accuracy unknown (no teacher_val_accuracy)")
        if grpo is not None:
            parts.append(f"GRPO's final {fmt(grpo['final'])} (above it: {'yes' if above else 'no'})")
        add("b", near or above, ", ".join(parts))

    # (c) no drop after distill's peak
    if distill is None:
        add("c", None, "needs distill")
    else:
        drop = distill["max_drop"]
        add(
            "c",
            drop <= DROP_TOLERANCE + EPS,
            f"distill peaks at {fmt(distill['peak'])} (step {distill['peak_step']}), drops {fmt(drop)} after it "
            f"({'<=' if drop <= DROP_TOLERANCE + EPS else '>'} {DROP_TOLERANCE})",
        )

    # (d) both losses at least as good as either alone
    if both is None or distill is None or grpo is None:
        add("d", None, "needs grpo, distill and distill_task")
    else:
        best = max(distill["final"], grpo["final"])
        bar = best - BOTH_TOLERANCE
        noise = (
            f"; one standard error at {fmt(best)} over {num_prompts} prompts: {math.sqrt(best * (1 - best) / num_prompts):.3f}"
            if num_prompts
            else ""
        )
        add(
            "d",
            both["final"] >= bar - EPS,
            f"distill_task ends at {fmt(both['final'])}; max(distill {fmt(distill['final'])}, GRPO {fmt(grpo['final'])}) "
            f"- {BOTH_TOLERANCE} = {fmt(bar)} (tolerance {BOTH_TOLERANCE}{noise})",
        )
    return out


# ----------------------------------------------------------------------------------------------------
# Output: rows, table.md, plot
# ----------------------------------------------------------------------------------------------------


def table_row(run: dict[str, Any]) -> dict[str, Any]:
    """One row of the table (``COLUMNS``' JSON keys) from a run of results.json."""
    phases = run["phase_s"]
    return {
        "seed": run["seed"],
        "method": run["method"],
        "start": run["start"],
        "gain_step": run["gain_step"],
        "final": run["final"],
        "peak": run["peak"],
        "max_drop": run["max_drop"],
        "step_s": run["step_s"],
        "teacher_s": phases.get("teacher"),
        "gen_s": phases.get("gen"),
        "update_s": phases.get("update_actor"),
        "memory_gib": run["memory_gib"],
        "wall_s": run["wall_s"],
    }


def table_markdown(results: dict[str, Any]) -> str:
    """``table.md``: the table, then each seed's criteria."""

    def cell(v: Any) -> str:
        return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)

    headers = [h for _, h in COLUMNS]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for run in results["runs"]:
        row = table_row(run)
        lines.append("| " + " | ".join(cell(row[k]) for k, _ in COLUMNS) + " |")
    s = results["settings"]
    lines += [
        "",
        f"Greedy validation accuracy ({s['steps']} steps, validated every {s['test_freq']}; {s['nproc']} ranks). "
        f"Seconds: means over steps {SKIP_STEPS + 1}.., validation left out of s/step. Teacher accuracy per seed: "
        + ", ".join(f"seed {a['seed']} {fmt(a['teacher_accuracy'])}" for a in results["asset_sets"])
        + ".",
        "",
        *(f"- {Criterion(**c).line()}" for c in results["criteria"]),
    ]
    return "\n".join(lines) + "\n"


def plot_curves(results: dict[str, Any], path: Path) -> None:
    """A panel per seed: greedy validation accuracy against the step, a line per method, the teacher's
    accuracy dashed."""
    sets = results["asset_sets"]
    fig, axes = pyplot().subplots(1, len(sets), figsize=(4.5 * len(sets), 3.8), squeeze=False, sharey=True)
    for ax, asset_set in zip(axes[0], sets, strict=True):
        seed = asset_set["seed"]
        for run in (r for r in results["runs"] if r["seed"] == seed):
            steps = [p[0] for p in run["curve"]]
            accs = [p[1] for p in run["curve"]]
            ax.plot(
                steps,
                accs,
                marker="o",
                markersize=3,
                color=COLORS[run["method"]],
                label=LABELS[run["method"]],
            )
        if asset_set["teacher_accuracy"] is not None:
            ax.axhline(
                asset_set["teacher_accuracy"],
                color="black",
                linestyle="--",
                linewidth=1,
                label=f"teacher ({asset_set['teacher_accuracy']:.3f})",
            )
        ax.set_title(f"seed {seed} ({Path(asset_set['assets']).name})")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    axes[0][0].set_ylabel("greedy validation accuracy")
    save_figure(fig, path)


def print_results(results: dict[str, Any], as_json: bool) -> None:
    """The table and the criteria lines, or JSON lines (``"kind": "run"``, then ``"criterion"``)."""
    from ppo_bench.common import print_json_lines, print_table  # torch: only once the runs are done

    rows = [table_row(r) for r in results["runs"]]
    if as_json:
        print_json_lines(rows, kind="run")
        print_json_lines(results["criteria"], kind="criterion")
        return
    print_table([{h: row[k] for k, h in COLUMNS} for row in rows], [h for _, h in COLUMNS])
    print()
    for c in results["criteria"]:
        print(Criterion(**c).line())


# ----------------------------------------------------------------------------------------------------
# The comparison
# ----------------------------------------------------------------------------------------------------


def compare(args: argparse.Namespace, plan: Plan, progress: TextIO) -> dict[str, Any]:
    """Check each method's command, train every run one after the other, write results.json, table.md and the
    plot (inputs already checked). InputError when the trainer refuses a command (before any training)."""
    start = time.perf_counter()
    out = Path(args.out).resolve()
    runs = []
    for assets, seed in zip(plan.assets, plan.seeds, strict=True):
        for method in plan.methods:
            run_dir = out / f"seed{seed}" / method
            targs = train_args(
                method,
                assets=assets,
                seed=seed,
                steps=args.steps,
                test_freq=args.test_freq,
                out_dir=run_dir,
                extra=plan.extra[method],
            )
            runs.append(
                {
                    "seed": seed,
                    "method": method,
                    "assets": str(assets),
                    "dir": str(run_dir),
                    "train_args": targs,
                    "command": [*torchrun_command(args.nproc), str(ROOT / "train_ppo.py"), *targs],
                }
            )
    for method in plan.methods:  # the asset sets differ only in paths, checked already
        check_command(next(r["train_args"] for r in runs if r["method"] == method), args.nproc)
    clear_out(out, OUTPUTS)
    settings = {
        "steps": args.steps,
        "test_freq": args.test_freq,
        "nproc": args.nproc,
        "env": {"OMP_NUM_THREADS": "1"},  # run_logged's run_env(1), with the repository first on PYTHONPATH
        "methods": plan.methods,
        "extra": plan.extra,
        "task_settings": task_settings(),
        "gain": GAIN,
        "tolerances": {"teacher": TEACHER_TOLERANCE, "drop": DROP_TOLERANCE, "distill_task": BOTH_TOLERANCE},
    }
    (out / "plan.json").write_text(json.dumps({"settings": settings, "runs": runs}, indent=1))

    train_in_turn(
        runs, steps=args.steps, name="method", numbers=run_numbers, run_logged=run_logged, progress=progress
    )

    set_rows, all_criteria = [], []
    for assets, seed in zip(plan.assets, plan.seeds, strict=True):
        accuracies = asset_accuracies(assets)
        num_prompts = parquet_rows(assets / "data" / "val.parquet")
        set_rows.append(
            {
                "seed": seed,
                "assets": str(assets),
                "teacher_accuracy": accuracies["teacher"],
                "sft_accuracy": accuracies["sft"],
                "val_prompts": num_prompts,
            }
        )
        mine = {r["method"]: r for r in runs if r["seed"] == seed}
        for r in mine.values():
            r["teacher_accuracy"] = accuracies["teacher"]
        found = criteria(seed, mine, teacher=accuracies["teacher"], steps=args.steps, num_prompts=num_prompts)
        all_criteria += [dataclasses.asdict(c) for c in found]
    settings["total_wall_s"] = time.perf_counter() - start
    results = {"settings": settings, "asset_sets": set_rows, "runs": runs, "criteria": all_criteria}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "table.md").write_text(table_markdown(results))
    plot_curves(results, Path(args.plot) if args.plot else out / "curves.png")
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    progress = sys.stderr if args.json else sys.stdout
    try:
        plan = check_inputs(args)
        results = compare(args, plan, progress)
    except InputError as e:
        print(f"distill: error: {e}", file=sys.stderr)
        return 2
    except CommandError as e:
        print(f"\ndistill: error: {e}", file=sys.stderr)
        return 1
    print(file=progress)
    print_results(results, args.json)
    out = Path(args.out)
    plot = Path(args.plot) if args.plot else out / "curves.png"
    print(
        f"\n{out / 'table.md'}, {plot}, {out / 'results.json'}; {results['settings']['total_wall_s']:.0f} s in all",
        file=progress,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
