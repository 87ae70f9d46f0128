"""The reasoning-RL recipes ranked on the four-digit task (``carry4``, docs/demo.md): each recipe's CPU preset
from the same SFT model, the same step budget, on several seeds; the mean and spread of the final and best
greedy validation accuracy, the steps to +0.1, the KL to the start and the wall time, in one table and one
figure.

    python -m ppo_bench.recipes [--assets assets --assets /work/assets1 --assets /work/assets2] [--seeds 0 1 2]
        [--recipes gae,grpo,...] [--sabotage grpo_no_baseline] [--steps 50] [--test-freq 10] [--nproc 2]
        [--out outputs/recipes_carry4] [--overwrite] [--json] [--plot docs/recipes_carry4.png]
        [--doc docs/results.md] [--reuse DIR]

An asset set is what ``make assets SEED=N ASSETS=DIR`` builds (``make carry4 SEED=N ASSETS=DIR`` adds the
four-digit task to an older one): ``DIR/carry4/sft`` (the start), ``DIR/carry4/data/{train,val}.parquet``.
``--seeds`` pairs with ``--assets`` one to one (default 0, 1, ... in order); the seed is the runs'
``trainer.seed``.

Each recipe is its preset (``RECIPES``: the file ``configs/demo_cpu_<name>.yaml`` that the two-digit demo
runs, with the settings it has there) moved to the four-digit task by ``TASK_KEYS`` (the start, the data,
``data.max_response_length=32``: an answer is 29 tokens with EOS) and, where a preset's value was sized for
the two-digit answers, one more key, listed in ``RECIPES`` (Dr. GRPO's ``actor.loss_scale_factor`` is the
response length; DAPO's overlong buffer starts past the longest right answer). Then the run's own keys:
``trainer.seed``, ``--steps``, validation before training and every ``--test-freq`` steps, no checkpoints,
and, where the preset has no KL loss, ``MEASURE_KL``: a KL loss of weight 0, which loads the SFT model as
the reference so that ``actor/ref_kl`` is logged (the loss and its gradients do not change; the step pays
the reference's forward). Every run is ``OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=NPROC train_ppo.py
--config PRESET ...`` into ``OUT/seed{N}/{recipe}/`` (its log in ``train.log``), one after the other; every
command is checked with ``train_ppo.py --print-config`` before the first run starts.

``--sabotage NAME`` adds a broken recipe (``ppo_bench.sabotage``: ``grpo_no_baseline`` is GRPO with the
group mean left in its advantage, ``grpo_abs_advantage`` GRPO whose advantage lost its sign,
``grpo_shifted_scores`` GRPO whose scores are off by one inside each group) run the same way from ``python -m ppo_bench.sabotage NAME``; the table says whether its seeds' range lies apart from the
intact recipe's. ``--reuse DIR`` copies each run that an earlier comparison in ``DIR`` trained with the same
command (its folder aside) instead of training it again: to add a recipe or a sabotage to a ranking.

Columns (one row per recipe, ranked by the mean final accuracy; ``--json``: one object per recipe, its keys
in brackets, then one per run):

- ``final`` [final_mean, final_min, final_max]: greedy validation accuracy at the last step, the seeds' mean
  and (min-max);
- ``best`` [best_mean, best_min, best_max]: the highest validated accuracy of each run, the same way;
- ``gain`` [gain_mean]: final minus the start (the SFT model's accuracy, step 0), the seeds' mean;
- ``vs GRPO`` [vs_grpo]: the final minus GRPO's final on the same seed, mean and (min-max) over the seeds
  (the seeds pair: same start, same seed); ``-`` without GRPO in the run;
- ``+0.1 at step`` [gain_steps]: per seed, the first validated step at the start + 0.1 (``-``: not within the
  run; a multiple of ``--test-freq``);
- ``KL`` [kl_mean]: ``actor/ref_kl`` (mean per-token ``log π − log π_SFT`` of the step's samples, nats) over
  the last ``KL_LAST_STEPS`` steps, the seeds' mean;
- ``wall s`` [wall_mean]: wall seconds of the training command (start-up and validations included), mean.

Two recipes "differ beyond the seeds' spread" when their seeds' final accuracies do not overlap (every seed
of one below every seed of the other); ``table.md`` lists those pairs among the top and bottom of the table,
and for a sabotage, whether its range lies below its recipe's.

Writes into ``OUT`` (default ``outputs/recipes_carry4``): ``plan.json``, ``results.json`` (settings, commands,
every run's curve and numbers, the table), ``table.md`` and the figure (``--plot``, default
``OUT/curves.png``): the seeds' mean accuracy against the step for each recipe, and each seed's final accuracy
per recipe. ``--doc FILE`` also puts the table, the figure's link and the command into FILE between the
lines ``<!-- recipes_carry4:begin -->`` and ``<!-- recipes_carry4:end -->`` (nothing else of FILE changes).

Bad input (a missing asset file, an unknown recipe or sabotage, ``OUT`` holding an earlier comparison
without ``--overwrite``, a ``--doc`` without its two marker lines, a command the trainer refuses) stops with
one line and exit code 2 before any training; a failed run stops with its command and the last lines of its
log (exit code 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import yaml

from ppo_bench.compare_offline_runs import run_logged
from ppo_bench.runs import (
    ROOT,
    CommandError,
    InputError,
    accuracy_curve,
    asset_sets,
    check_command,
    check_doc,
    check_out,
    clear_out,
    comparison_parser,
    doc_link,
    machine,
    parquet_rows,
    parse_names,
    pyplot,
    reuse_earlier,
    save_figure,
    steps_to_gain,
    torchrun_command,
    train_in_turn,
    write_doc,
)


@dataclass(frozen=True)
class Recipe:
    """A recipe: its preset, the keys that move it to the four-digit task beyond ``TASK_KEYS``, its name
    in the table."""

    preset: str
    task: tuple[str, ...]
    label: str


RESPONSE_LENGTH = 32
"""``data.max_response_length`` on the four-digit task ('1234 + 5678 = 6912\\n#### 6912' and EOS: 29)."""
RECIPES: dict[str, Recipe] = {
    "gae": Recipe("configs/demo_cpu.yaml", (), "PPO (GAE, critic)"),
    "grpo": Recipe("configs/demo_cpu_grpo.yaml", (), "GRPO"),
    "rloo": Recipe("configs/demo_cpu_grpo.yaml", ("algorithm.adv_estimator=rloo",), "RLOO"),
    "reinforce_pp": Recipe("configs/demo_cpu_reinforce_pp.yaml", (), "REINFORCE++"),
    "reinforce_pp_baseline": Recipe(
        "configs/demo_cpu_reinforce_pp_baseline.yaml", (), "REINFORCE++-baseline"
    ),
    "opo": Recipe("configs/demo_cpu_opo.yaml", (), "OPO"),
    "drgrpo": Recipe(
        "configs/demo_cpu_drgrpo.yaml", (f"actor.loss_scale_factor={RESPONSE_LENGTH}",), "Dr. GRPO"
    ),
    "gspo": Recipe("configs/demo_cpu_gspo.yaml", (), "GSPO"),
    "dapo": Recipe(
        "configs/demo_cpu_dapo.yaml", ("reward.overlong_buffer.len=3",), "DAPO"
    ),  # the penalty from 30 tokens on: a right answer (29) keeps its point
    "clip_cov": Recipe("configs/demo_cpu_clip_cov.yaml", (), "Clip-Cov"),
    "kl_cov": Recipe("configs/demo_cpu_kl_cov.yaml", (), "KL-Cov"),
    "sppo": Recipe("configs/demo_cpu_sppo.yaml", (), "SPPO"),
    "prime": Recipe("configs/demo_cpu_prime.yaml", (), "PRIME"),
}
"""``--recipes`` names, in their default order."""
SABOTAGED = {
    "grpo_no_baseline": ("grpo", "GRPO, no baseline (broken)"),
    "grpo_abs_advantage": ("grpo", "GRPO, |advantage| (broken)"),
    "grpo_shifted_scores": ("grpo", "GRPO, scores off by one (broken)"),
}
"""A sabotage's name -> (the recipe it breaks, its name in the table)."""
GAIN = 0.1
"""The gain over the start that ``+0.1 at step`` times."""
KL_LAST_STEPS = 5
"""Steps at the end whose ``actor/ref_kl`` the KL column averages."""
MARKERS = ("<!-- recipes_carry4:begin -->", "<!-- recipes_carry4:end -->")
"""The lines of ``--doc``'s file between which the table goes."""
OUTPUTS = ("plan.json", "results.json", "table.md", "curves.png")
"""What a comparison writes into ``OUT`` besides its ``seed*`` folders (``--overwrite`` deletes these)."""


# ----------------------------------------------------------------------------------------------------
# Command line and commands
# ----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = comparison_parser("recipes", __doc__, out="outputs/recipes_carry4", test_freq=10)
    p.add_argument(
        "--recipes", default=",".join(RECIPES), help="a comma-separated subset of " + ",".join(RECIPES)
    )
    p.add_argument(
        "--sabotage",
        action="append",
        default=[],
        choices=list(SABOTAGED),
        help="add a recipe broken on purpose (repeat for several)",
    )
    p.add_argument("--doc", default=None, help="a Markdown file whose marked section gets the table")
    p.add_argument(
        "--reuse",
        default=None,
        metavar="DIR",
        help="copy each run that the comparison in DIR trained with the same command, instead of training it",
    )
    return p.parse_args(argv)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What the command line asks for, checked."""

    assets: list[Path]
    """The asset sets, absolute."""
    seeds: list[int]
    entries: list[str]
    """The rows: recipe names, then sabotage names."""


def check_inputs(args: argparse.Namespace) -> Plan:
    """Everything that can be checked before training without the trainer; InputError with one line."""
    recipes = parse_names("--recipes", args.recipes, RECIPES, "recipe")
    sabotages = list(dict.fromkeys(args.sabotage))
    for name in sabotages:
        if SABOTAGED[name][0] not in recipes:
            raise InputError(f"--sabotage {name} breaks {SABOTAGED[name][0]}: add it to --recipes to compare")
    assets, seeds = asset_sets(args)
    for root in assets:
        for what, path in (
            ("start", root / "carry4" / "sft" / "config.json"),
            ("data file", root / "carry4" / "data" / "train.parquet"),
            ("data file", root / "carry4" / "data" / "val.parquet"),
        ):
            if not path.is_file():
                raise InputError(
                    f"--assets {root}: {what} {path} not found: run `make carry4 ASSETS={root} SEED=<its seed>` "
                    "(or `make assets`) first"
                )
    if args.doc:
        check_doc(Path(args.doc), MARKERS)
    check_out(Path(args.out), OUTPUTS, args.overwrite)
    if args.reuse:
        reuse = Path(args.reuse)
        if not (reuse / "results.json").is_file():
            raise InputError(f"--reuse {reuse}: no results.json of a finished comparison there")
        if reuse.resolve() == Path(args.out).resolve():
            raise InputError(f"--reuse {reuse} is --out: give the earlier comparison another folder")
    return Plan(assets=[a.resolve() for a in assets], seeds=seeds, entries=recipes + sabotages)


def has_kl_loss(preset: Path) -> bool:
    """Whether the preset trains with a KL loss (``actor.use_kl_loss``)."""
    return bool((yaml.safe_load(preset.read_text()).get("actor") or {}).get("use_kl_loss"))


MEASURE_KL = ("actor.use_kl_loss=true", "actor.kl_loss_coef=0.0")
"""What a run of a preset without a KL loss adds: a KL loss of weight 0, so the SFT model is loaded as the
reference and ``actor/ref_kl`` is logged, while the loss and its gradients stay what they were."""


def recipe_of(entry: str) -> str:
    """The recipe a row runs: itself, or the one a sabotage breaks."""
    return SABOTAGED[entry][0] if entry in SABOTAGED else entry


def label_of(entry: str) -> str:
    return SABOTAGED[entry][1] if entry in SABOTAGED else RECIPES[entry].label


def train_args(
    entry: str, *, assets: Path, seed: int, steps: int, test_freq: int, out_dir: Path
) -> list[str]:
    """train_ppo.py's arguments for one run (after the script's path, or ``ppo_bench.sabotage NAME``)."""
    recipe = RECIPES[recipe_of(entry)]
    preset = ROOT / recipe.preset
    data = assets / "carry4" / "data"
    args = [
        "--config",
        str(preset),
        f"model.path={assets / 'carry4' / 'sft'}",
        f"data.train_files=[{data / 'train.parquet'}]",
        f"data.val_files=[{data / 'val.parquet'}]",
        f"data.max_response_length={RESPONSE_LENGTH}",
        *recipe.task,
    ]
    if not has_kl_loss(preset):
        args += MEASURE_KL
    return [
        *args,
        f"trainer.seed={seed}",
        f"trainer.total_training_steps={steps}",
        f"trainer.test_freq={test_freq}",
        "trainer.save_freq=-1",
        "trainer.logger=[jsonl]",
        f"trainer.output_dir={out_dir}",
        "trainer.overwrite=true",
        "trainer.resume_mode=disable",
        "trainer.val_before_train=true",
    ]


def command(entry: str, nproc: int, targs: list[str]) -> list[str]:
    """The run's whole command: torchrun of train_ppo.py, or of ``ppo_bench.sabotage NAME``."""
    if entry in SABOTAGED:
        return [*torchrun_command(nproc), "-m", "ppo_bench.sabotage", entry, *targs]
    return [*torchrun_command(nproc), str(ROOT / "train_ppo.py"), *targs]


# ----------------------------------------------------------------------------------------------------
# The numbers: one run's, then one recipe's over the seeds
# ----------------------------------------------------------------------------------------------------


def run_numbers(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's numbers from its metrics rows: the accuracy curve, start, final, best, the step of +0.1,
    the KL at the end (``actor/ref_kl`` over the last ``KL_LAST_STEPS`` logged steps; None without it)."""
    curve = accuracy_curve(rows)
    values = [acc for _, acc in curve]
    kl = [r["actor/ref_kl"] for r in sorted(rows, key=lambda r: r["step"]) if "actor/ref_kl" in r]
    return {
        "curve": [[step, acc] for step, acc in curve],
        "steps": sum(1 for r in rows if "timing_s/step" in r),
        "start": values[0] if values else None,
        "final": values[-1] if values else None,
        "best": max(values) if values else None,
        "gain_step": steps_to_gain(curve, GAIN),
        "kl": statistics.fmean(kl[-KL_LAST_STEPS:]) if kl else None,
    }


def spread(values: list[float]) -> dict[str, float]:
    """``{"mean", "min", "max"}`` of ``values`` (one per seed)."""
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def apart(a: list[float], b: list[float]) -> bool:
    """Whether two recipes' seeds do not overlap: every value of one below every value of the other."""
    return max(a) < min(b) or max(b) < min(a)


def recipe_rows(runs: list[dict[str, Any]], entries: list[str]) -> list[dict[str, Any]]:
    """One row per recipe (``entries``), ranked by the mean final accuracy (best first): the seeds' final,
    best, gain, paired gap to GRPO, steps to +0.1, KL and wall time."""
    by_entry = {e: sorted((r for r in runs if r["entry"] == e), key=lambda r: r["seed"]) for e in entries}
    grpo = {r["seed"]: r["final"] for r in by_entry.get("grpo", [])}
    rows = []
    for entry, mine in by_entry.items():
        final = spread([r["final"] for r in mine])
        best = spread([r["best"] for r in mine])
        gaps = [r["final"] - grpo[r["seed"]] for r in mine if r["seed"] in grpo]
        kls = [r["kl"] for r in mine if r["kl"] is not None]
        rows.append(
            {
                "recipe": entry,
                "label": label_of(entry),
                "preset": RECIPES[recipe_of(entry)].preset,
                "seeds": [r["seed"] for r in mine],
                "finals": [r["final"] for r in mine],
                "final_mean": final["mean"],
                "final_min": final["min"],
                "final_max": final["max"],
                "best_mean": best["mean"],
                "best_min": best["min"],
                "best_max": best["max"],
                "gain_mean": statistics.fmean(r["final"] - r["start"] for r in mine),
                "vs_grpo": spread(gaps) if gaps and entry != "grpo" else None,
                "gain_steps": [r["gain_step"] for r in mine],
                "kl_mean": statistics.fmean(kls) if len(kls) == len(mine) else None,
                "wall_mean": statistics.fmean(r["wall_s"] for r in mine),
            }
        )
    return sorted(rows, key=lambda r: -r["final_mean"])


def separated_pairs(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(better, worse) recipe pairs whose seeds' final accuracies do not overlap, ``rows`` in rank order."""
    return [
        (a["recipe"], b["recipe"])
        for i, a in enumerate(rows)
        for b in rows[i + 1 :]
        if apart(a["finals"], b["finals"])
    ]


def sabotage_findings(rows: list[dict[str, Any]]) -> list[str]:
    """A line per sabotage: its seeds' final accuracies against its recipe's, whether they lie apart (seen),
    and the paired gap (the sabotage's final minus the recipe's on the same seed) with how many seeds it is
    below on."""
    by_name = {r["recipe"]: r for r in rows}
    lines = []
    for entry in (r["recipe"] for r in rows if r["recipe"] in SABOTAGED):
        broken, intact = by_name[entry], by_name.get(recipe_of(entry))
        if intact is None:
            continue
        theirs = dict(zip(intact["seeds"], intact["finals"], strict=True))
        gaps = [
            f - theirs[seed]
            for seed, f in zip(broken["seeds"], broken["finals"], strict=True)
            if seed in theirs
        ]
        outside = broken["final_max"] < intact["final_min"]
        lines.append(
            f"{broken['label']}: final {fmt_spread(broken, 'final')} against {intact['label']}'s "
            f"{fmt_spread(intact, 'final')}: "
            + (
                "every seed below every seed of the intact recipe (seen)"
                if outside
                else "the ranges overlap (NOT seen)"
            )
            + f"; paired gap {statistics.fmean(gaps):+.3f} ({min(gaps):+.3f} to {max(gaps):+.3f}), below on "
            f"{sum(g < 0 for g in gaps)} of {len(gaps)} seeds"
        )
    return lines


# ----------------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------------


def fmt_spread(row: dict[str, Any], key: str) -> str:
    return f"{row[key + '_mean']:.3f} ({row[key + '_min']:.3f}-{row[key + '_max']:.3f})"


def table_markdown(results: dict[str, Any]) -> str:
    """The ranked table, the separated pairs and the sabotages' lines, as Markdown."""
    s = results["settings"]
    rows = results["recipes"]
    lines = [
        "| rank | recipe | preset | final | best | gain | vs GRPO | +0.1 at step | KL | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rank, r in enumerate(rows, 1):
        vs = r["vs_grpo"]
        lines.append(
            f"| {rank} | {r['label']} | `{Path(r['preset']).name}` | {fmt_spread(r, 'final')} | "
            f"{fmt_spread(r, 'best')} | {r['gain_mean']:+.3f} | "
            + ("-" if vs is None else f"{vs['mean']:+.3f} ({vs['min']:+.3f} to {vs['max']:+.3f})")
            + " | "
            + ", ".join("-" if g is None else str(g) for g in r["gain_steps"])
            + " | "
            + ("-" if r["kl_mean"] is None else f"{r['kl_mean']:.4f}")
            + f" | {r['wall_mean']:.0f} |"
        )
    starts = ", ".join(f"seed {a['seed']} {a['start']:.3f}" for a in results["asset_sets"])
    lines += [
        "",
        f"{len(results['asset_sets'])} seeds, {s['steps']} steps each, greedy accuracy on the "
        f"{results['asset_sets'][0]['val_prompts']} validation problems every {s['test_freq']} steps; starts: "
        f"{starts}. final, best: the seeds' mean (min-max); vs GRPO: the final minus GRPO's on the same seed; "
        f"+0.1 at step: per seed; KL: actor/ref_kl over the last {KL_LAST_STEPS} steps (nats per token); "
        f"wall: the training command, on {s['nproc']} ranks.",
        "",
    ]
    pairs = separated_pairs([r for r in rows if r["recipe"] not in SABOTAGED])
    labels = {r["recipe"]: r["label"] for r in rows}
    if len(results["asset_sets"]) < 2:
        lines.append("One seed: no spread to tell recipes apart by; run on several asset sets.")
        return "\n".join(lines) + "\n"
    if pairs:
        lines.append(
            "Recipes whose seeds do not overlap (every seed of the first above every seed of the second): "
            + "; ".join(f"{labels[a]} > {labels[b]}" for a, b in pairs)
            + "."
        )
    else:
        lines.append("No two intact recipes are apart: every pair's seeds overlap.")
    lines += [f"\n{line}." for line in sabotage_findings(rows)]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    """Left: the seeds' mean greedy accuracy against the step, a line per recipe; right: each seed's final
    accuracy per recipe (dots) and their mean (bar), in rank order."""
    rows = results["recipes"]
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(13, 5))
    cmap = pyplot().get_cmap("tab20")
    for i, r in enumerate(rows):
        curves = [run["curve"] for run in results["runs"] if run["entry"] == r["recipe"]]
        steps = [p[0] for p in curves[0]]
        mean = [statistics.fmean(c[j][1] for c in curves) for j in range(len(steps))]
        style = "--" if r["recipe"] in SABOTAGED else "-"
        left.plot(steps, mean, style, marker="o", markersize=3, color=cmap(i % 20), label=r["label"])
        y = len(rows) - 1 - i
        right.barh(y, r["final_mean"], color=cmap(i % 20), alpha=0.35)
        right.plot(r["finals"], [y] * len(r["finals"]), "o", color=cmap(i % 20), markersize=5)
    left.set_xlabel("step")
    left.set_ylabel("greedy validation accuracy (mean of the seeds)")
    left.grid(alpha=0.3)
    left.legend(fontsize=7, ncol=2, loc="lower right")
    right.set_yticks(range(len(rows)))
    right.set_yticklabels([r["label"] for r in reversed(rows)], fontsize=8)
    lo = min(min(r["finals"]) for r in rows)
    right.set_xlim(max(0.0, lo - 0.05), min(1.0, max(max(r["finals"]) for r in rows) + 0.03))
    right.set_xlabel(f"final accuracy at step {results['settings']['steps']} (dots: seeds; bar: mean)")
    right.grid(axis="x", alpha=0.3)
    save_figure(fig, path)


def doc_section(results: dict[str, Any], table: str, plot_path: Path, doc: Path) -> str:
    """The text between ``--doc``'s markers: the command, the table, the figure."""
    s = results["settings"]
    reused = sum(1 for r in results["runs"] if r.get("reused_from"))
    copied = (
        f"; {reused} of the {len(results['runs'])} runs were copied from an earlier comparison that ran the same "
        "commands, their wall times with them"
        if reused
        else ""
    )
    return (
        f"Generated by `{s['command']}` ({s['total_wall_s'] / 60:.0f} minutes on {s['machine']}{copied}).\n\n"
        + table
        + f"\n![The recipes on the four-digit task]({doc_link(plot_path, doc)})\n"
    )


def print_results(results: dict[str, Any], table: str, as_json: bool) -> None:
    """The table, or JSON lines (``"kind": "recipe"``, then ``"run"``)."""
    from ppo_bench.common import print_json_lines  # torch: only once the runs are done

    if as_json:
        print_json_lines(results["recipes"], kind="recipe")
        print_json_lines(
            [{k: v for k, v in r.items() if k != "command"} for r in results["runs"]], kind="run"
        )
        return
    print(table)


# ----------------------------------------------------------------------------------------------------
# The comparison
# ----------------------------------------------------------------------------------------------------


def compare(args: argparse.Namespace, plan: Plan, argv: list[str], progress: TextIO) -> dict[str, Any]:
    """Check each row's command, train every run one after the other, write results.json, table.md, the
    figure and ``--doc``'s section (inputs already checked)."""
    start = time.perf_counter()
    out = Path(args.out).resolve()
    runs = []
    for assets, seed in zip(plan.assets, plan.seeds, strict=True):
        for entry in plan.entries:
            run_dir = out / f"seed{seed}" / entry
            targs = train_args(
                entry, assets=assets, seed=seed, steps=args.steps, test_freq=args.test_freq, out_dir=run_dir
            )
            runs.append(
                {
                    "seed": seed,
                    "entry": entry,
                    "assets": str(assets),
                    "dir": str(run_dir),
                    "train_args": targs,
                    "command": command(entry, args.nproc, targs),
                }
            )
    for entry in plan.entries:  # the asset sets differ only in paths
        check_command(next(r["train_args"] for r in runs if r["entry"] == entry), args.nproc)
    clear_out(out, OUTPUTS)
    settings = {
        "command": "python -m ppo_bench.recipes " + " ".join(argv),
        "machine": machine(),
        "steps": args.steps,
        "test_freq": args.test_freq,
        "nproc": args.nproc,
        "env": {"OMP_NUM_THREADS": "1"},
        "entries": plan.entries,
        "response_length": RESPONSE_LENGTH,
        "gain": GAIN,
        "kl_last_steps": KL_LAST_STEPS,
    }
    (out / "plan.json").write_text(json.dumps({"settings": settings, "runs": runs}, indent=1))

    left = reuse_earlier(runs, Path(args.reuse), run_numbers) if args.reuse else runs
    if len(left) < len(runs):
        print(f"{len(runs) - len(left)} of {len(runs)} runs copied from {args.reuse}", file=progress)
    train_in_turn(
        left, steps=args.steps, name="entry", numbers=run_numbers, run_logged=run_logged, progress=progress
    )

    set_rows = [
        {
            "seed": seed,
            "assets": str(assets),
            "start": next(r["start"] for r in runs if r["seed"] == seed),
            "val_prompts": parquet_rows(assets / "carry4" / "data" / "val.parquet"),
        }
        for assets, seed in zip(plan.assets, plan.seeds, strict=True)
    ]
    settings["total_wall_s"] = time.perf_counter() - start
    results = {
        "settings": settings,
        "asset_sets": set_rows,
        "recipes": recipe_rows(runs, plan.entries),
        "runs": runs,
    }
    table = table_markdown(results)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "table.md").write_text(table)
    plot_path = Path(args.plot) if args.plot else out / "curves.png"
    plot(results, plot_path)
    if args.doc:
        write_doc(Path(args.doc), doc_section(results, table, plot_path, Path(args.doc)), MARKERS)
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    progress = sys.stderr if args.json else sys.stdout
    try:
        plan = check_inputs(args)
        results = compare(args, plan, argv, progress)
    except InputError as e:
        print(f"recipes: error: {e}", file=sys.stderr)
        return 2
    except CommandError as e:
        print(f"\nrecipes: error: {e}", file=sys.stderr)
        return 1
    print(file=progress)
    print_results(results, table_markdown(results), args.json)
    out = Path(args.out)
    print(
        f"\n{out / 'table.md'}, {Path(args.plot) if args.plot else out / 'curves.png'}, {out / 'results.json'}"
        + (f", {args.doc}" if args.doc else "")
        + f"; {results['settings']['total_wall_s'] / 60:.1f} minutes in all",
        file=progress,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
