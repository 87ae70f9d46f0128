"""Offline KL-PPO, DPO, offline SPPO and SimPO on the same ranked file, from the same SFT model, for the
same number of optimizer steps, each at three strengths; every final model measured the same way; a
table and a plot.

    make compare-offline       # on the demo assets (make assets first): 6 min on 2 quiet cores, 12-16 loaded
    python -m ppo_bench.compare_offline [--sft assets/sft] [--train-file assets/offline/train.parquet]
        [--val-file assets/data/val.parquet] [--out outputs/compare_offline] [--steps 40] [--nproc 2]
        [--methods ppo,dpo,sppo,simpo (also ipo, kto)] [--lr dpo=5e-5] [--strengths dpo=0.05,0.1,0.3] [--overwrite]

What it does, in order:

1. Trains ``3 × len(--methods)`` models, one after the other, each with
   ``OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=NPROC`` into its own folder
   ``OUT/runs/<method>_<strength>/`` (its log in ``train.log``, its final model in ``hf/``), no validation
   inside the runs:

   - ``ppo``: ``train_ppo.py --config configs/demo_cpu_offline.yaml`` (GRPO on the file's groups, a
     ``low_var_kl`` loss, truncated importance weights against the data's sampler), strength
     ``actor.kl_loss_coef``;
   - ``dpo``: ``scripts/train_dpo.py --config configs/dpo_demo.yaml loss.type=dpo``, strength ``loss.beta``;
   - ``sppo``: ``train_ppo.py --config configs/demo_cpu_sppo_offline.yaml`` (SPPO on the file's ranks, the
     old policy refreshed every 8 steps, a ``low_var_kl`` loss), strength ``actor.sppo_eta`` (its step
     size: larger moves further from the SFT model);
   - ``simpo``: the same with ``loss.type=simpo`` (reference-free, ``loss.gamma`` 0.5), strength ``loss.beta``.

   Each method keeps its preset's batch (PPO 64 groups of 4 responses a step, DPO/SimPO 64 pairs), its
   schedule and its own learning rate (``METHODS``; the same across its three strengths), and all run
   ``--steps`` optimizer steps.
2. One ``torchrun`` of this module's ``--evaluate`` mode on all final models and the SFT model (start-up
   paid once): ``ppo.model_eval.answer_metrics`` on the ``--val-file`` prompts (500 in the demo), with
   the SFT model as the reference.
3. Writes into ``OUT``: ``table.md``, ``frontier.png``, ``results.json`` (every number, the settings and
   the commands), and prints the table.

Columns of ``table.md``:

- ``method``, ``strength``: the trainer and the value of its strength key (``actor.kl_loss_coef`` for
  offline KL-PPO, ``β`` for DPO and SimPO); ``lr`` its learning rate;
- ``steps``: optimizer steps the run took;
- ``accuracy``: the share of validation prompts whose greedy answer (at most 28 tokens) the rule reward
  scores 1 (one standard error is about ±0.013 at 0.9 with 500 prompts);
- ``gain``: accuracy minus the SFT model's, measured here the same way;
- ``KL``: ``KL(π ‖ π_SFT)`` in nats per response: the mean of ``Σ_t log π − log π_SFT`` over
  ``EVAL_SAMPLES`` responses per prompt sampled from the model at temperature 1, ± its standard error
  (unbiased on the model's own samples: ``ppo.model_eval``);
- ``train time``: wall seconds of the training command (torchrun start-up, loading and saving
  included; ``results.json`` also has ``loop_s``, the seconds in the training steps).

The frontier: a run is on it when no other run (of any method) is at least as accurate with at most its
KL; ``table.md`` says which runs are, and which runs of offline KL-PPO another method beats on both.

Bad input (a missing SFT model or data file, an unknown method, an output folder that holds an earlier
comparison without ``--overwrite``) stops with one line and exit code 2 before any training; a failed
training stops the comparison with its command and the last lines of its log (exit code 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from ppo_bench.compare_offline_runs import (
    EVAL_MAX_NEW_TOKENS,
    EVAL_MAX_PROMPT_LENGTH,
    EVAL_SAMPLES,
    EVAL_SEED,
    METHODS,
    CommandError,
    Method,
    evaluate,
    run_id,
    run_logged,
    steps_and_loop_time,
    training_command,
)
from ppo_bench.runs import pyplot, save_figure, torchrun_command

OUTPUTS = ("plan.json", "eval.json", "results.json", "table.md", "frontier.png", "runs")
"""What a comparison writes into its folder (``--overwrite`` deletes these and nothing else)."""
COMPARED = ("ppo", "dpo", "sppo", "simpo")
"""The methods ``--methods`` names by default."""
COLORS = {
    "ppo": "tab:red",
    "dpo": "tab:blue",
    "sppo": "tab:purple",
    "simpo": "tab:green",
    "ipo": "tab:orange",
    "kto": "tab:brown",
}
"""A colour per method in ``frontier.png``."""


class InputError(ValueError):
    """Bad input found before any training: one line, exit code 2."""


# ----------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--sft", default="assets/sft", help="the SFT model every run starts from (and the reference)"
    )
    p.add_argument(
        "--train-file", default="assets/offline/train.parquet", help="ranked groups (with logprobs)"
    )
    p.add_argument(
        "--val-file", default="assets/data/val.parquet", help="validation prompts with ground truth"
    )
    p.add_argument("--out", default="outputs/compare_offline", help="the comparison's folder")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps of every run")
    p.add_argument("--nproc", type=int, default=2, help="ranks of every torchrun")
    p.add_argument(
        "--methods", default=",".join(COMPARED), help="a comma-separated subset of " + ",".join(METHODS)
    )
    p.add_argument("--lr", action="append", default=[], metavar="METHOD=LR", help="another learning rate")
    p.add_argument(
        "--strengths", action="append", default=[], metavar="METHOD=A,B,C", help="other strengths (three)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an earlier comparison in --out")
    p.add_argument("--evaluate", action="store_true", help=argparse.SUPPRESS)  # the torchrun of step 2
    return p.parse_args(argv)


def resolve_methods(args: argparse.Namespace) -> list[Method]:
    """The methods to run, with ``--lr`` and ``--strengths`` applied; InputError names a bad value."""
    names = [n.strip() for n in args.methods.split(",") if n.strip()]
    unknown = [n for n in names if n not in METHODS]
    if unknown or not names:
        raise InputError(
            f"--methods {args.methods!r}: unknown {', '.join(unknown) or '(none given)'}; "
            f"choose from {', '.join(METHODS)}"
        )
    methods = {n: METHODS[n] for n in names}
    for option, values in (("--lr", args.lr), ("--strengths", args.strengths)):
        for item in values:
            name, _, value = item.partition("=")
            if name not in methods:
                raise InputError(
                    f"{option} {item}: {name!r} is not one of the methods run ({', '.join(methods)})"
                )
            try:
                numbers = tuple(float(v) for v in value.split(","))
            except ValueError:
                raise InputError(f"{option} {item}: not a number") from None
            if option == "--lr":
                if len(numbers) != 1 or numbers[0] <= 0:
                    raise InputError(f"--lr {item}: one positive learning rate")
                methods[name] = dataclasses.replace(methods[name], lr=numbers[0])
            else:
                if len(set(numbers)) != 3 or min(numbers) <= 0:
                    raise InputError(f"--strengths {item}: three different positive values")
                methods[name] = dataclasses.replace(methods[name], strengths=numbers)
    return list(methods.values())


def check_inputs(args: argparse.Namespace) -> None:
    """Everything that can be checked before training; InputError with one line otherwise."""
    sft = Path(args.sft)
    if not (sft / "config.json").is_file():
        raise InputError(f"SFT model {sft} not found (no {sft / 'config.json'}): run `make assets` first")
    for option, path in (("--train-file", args.train_file), ("--val-file", args.val_file)):
        if not Path(path).is_file():
            raise InputError(f"{option} {path} does not exist: run `make assets` first, or pass another file")
    if args.steps < 1:
        raise InputError(f"--steps {args.steps}: at least 1")
    if args.nproc < 1:
        raise InputError(f"--nproc {args.nproc}: at least 1")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file")
    earlier = [name for name in OUTPUTS if (out / name).exists()]
    if earlier and not args.overwrite:
        raise InputError(
            f"--out {out} holds an earlier comparison ({', '.join(earlier)}): pass --overwrite to replace it, "
            f"or choose another --out"
        )


# ----------------------------------------------------------------------------------------------------
# 3. Table, frontier, plot
# ----------------------------------------------------------------------------------------------------


def dominates(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """``a`` is at least as accurate as ``b`` with at most its KL, and better in one of the two."""
    return (
        a["accuracy"] >= b["accuracy"]
        and a["kl"] <= b["kl"]
        and (a["accuracy"] > b["accuracy"] or a["kl"] < b["kl"])
    )


def frontier_lines(results: dict[str, Any]) -> list[str]:
    """What the frontier says, as Markdown bullet lines: the runs on it, and each offline KL-PPO run
    that a run of another method beats on both accuracy and KL (with the best such run)."""
    runs = results["runs"]
    on = [r for r in runs if not any(dominates(o, r) for o in runs)]
    lines = [
        "- on the frontier (no other run at least as accurate with at most its KL): "
        + (", ".join(f"{r['label']} {r['strength_name']}={r['strength']:g}" for r in on) or "none")
    ]
    ppo = [r for r in runs if r["method"] == "ppo"]
    others = [r for r in runs if r["method"] != "ppo"]
    if ppo and others:
        for r in ppo:
            beaten = [o for o in others if dominates(o, r)]
            what = f"offline KL-PPO kl_loss_coef={r['strength']:g} (accuracy {r['accuracy']:.3f}, KL {r['kl']:.3f})"
            if beaten:
                best = max(beaten, key=lambda o: (o["accuracy"], -o["kl"]))
                lines.append(
                    f"- {what}: below the others' frontier, beaten by {len(beaten)} run(s), e.g. {best['label']} "
                    f"{best['strength_name']}={best['strength']:g} (accuracy {best['accuracy']:.3f}, KL {best['kl']:.3f})"
                )
            else:
                lines.append(
                    f"- {what}: on or above the others' frontier (no run of another method beats it on both)"
                )
    return lines


def table_markdown(results: dict[str, Any]) -> str:
    """``table.md``: one row for the SFT model, one per run, then the frontier's lines."""
    sft = results["sft"]
    header = (
        "| method | strength | lr | steps | accuracy | gain | KL (nats/seq) | train time (s) |\n"
        "|---|---|---|---|---|---|---|---|\n"
    )
    rows = [f"| SFT (reference) | | | 0 | {sft['accuracy']:.3f} | | 0 | |"]
    for r in results["runs"]:
        rows.append(
            f"| {r['label']} | {r['strength_name']}={r['strength']:g} | {r['lr']:g} | {r['steps']} | "
            f"{r['accuracy']:.3f} | {r['accuracy'] - sft['accuracy']:+.3f} | {r['kl']:.3f} ± {r['kl_stderr']:.3f} | "
            f"{r['train_wall_s']:.0f} |"
        )
    s = results["settings"]
    notes = (
        f"\nGreedy accuracy on {s['eval_prompts']} validation prompts (one standard error about "
        f"±{math.sqrt(0.9 * 0.1 / max(s['eval_prompts'], 1)):.3f} at 0.9); KL(π ‖ π_SFT) = mean of "
        f"Σ_t log π − log π_SFT over {s['eval_samples']} samples per prompt from π at temperature 1, "
        f"± its standard error. Train time: wall seconds of the training command (start-up included).\n\n"
    )
    return header + "\n".join(rows) + "\n" + notes + "\n".join(frontier_lines(results)) + "\n"


def plot_frontier(results: dict[str, Any], path: Path) -> None:
    """``frontier.png``: accuracy against KL, one colour per method, one marker per run (the value of its
    strength beside it, error bars of one standard error), the SFT model at KL 0."""
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    sft = results["sft"]
    n = max(results["settings"]["eval_prompts"], 1)
    ax.plot([0.0], [sft["accuracy"]], marker="*", markersize=14, color="black", linestyle="none", label="SFT")
    for name in METHODS:
        runs = sorted((r for r in results["runs"] if r["method"] == name), key=lambda r: r["kl"])
        if not runs:
            continue
        kl = [r["kl"] for r in runs]
        acc = [r["accuracy"] for r in runs]
        ax.errorbar(
            kl,
            acc,
            xerr=[r["kl_stderr"] for r in runs],
            yerr=[math.sqrt(a * (1 - a) / n) for a in acc],
            marker="o",
            linestyle="-",
            linewidth=0.8,
            capsize=2,
            color=COLORS[name],
            label=f"{runs[0]['label']} ({runs[0]['strength_name']})",
        )
        for i, r in enumerate(runs):  # the strength beside each marker, above and below in turn
            ax.annotate(
                f"{r['strength']:g}",
                (r["kl"], r["accuracy"]),
                textcoords="offset points",
                xytext=(4, 6 if i % 2 else -11),
                fontsize=7,
                color=COLORS[name],
            )
    ax.set_xlabel("KL(π ‖ π_SFT), nats per response (sampled at T=1)")
    ax.set_ylabel("greedy validation accuracy")
    ax.set_title(f"offline preference data, {results['settings']['steps']} steps each")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    save_figure(fig, path)


def collect_results(
    plan: dict[str, Any], trained: dict[str, dict[str, Any]], evals: dict[str, Any]
) -> dict[str, Any]:
    """``results.json``: the settings, the SFT model's numbers and every run's (training and evaluation)."""

    def numbers(m: dict[str, float]) -> dict[str, float]:
        return {
            "accuracy": m["val/accuracy"],
            "sample_accuracy": m["val/sample_accuracy"],
            "pass_at_k": m["val/pass_at_k"],
            "kl": m["val/kl_to_ref"],
            "kl_stderr": m["val/kl_to_ref_stderr"],
            "response_tokens": m["val/response_tokens"],
            "eval_s": m["eval_s"],
        }

    runs = [{**r, **trained[r["id"]], **numbers(evals[r["id"]])} for r in plan["runs"]]
    for r in runs:
        r["gain"] = r["accuracy"] - evals["sft"]["val/accuracy"]
    settings = {**plan["settings"], "eval_prompts": int(evals["sft"]["val/num_prompts"])}
    return {"settings": settings, "sft": {"model": plan["sft"], **numbers(evals["sft"])}, "runs": runs}


# ----------------------------------------------------------------------------------------------------
# The comparison
# ----------------------------------------------------------------------------------------------------


def compare(args: argparse.Namespace, methods: list[Method]) -> dict[str, Any]:
    """Steps 1-3 (inputs already checked)."""
    start = time.perf_counter()
    out = Path(args.out).resolve()
    for name in OUTPUTS:  # an earlier comparison, with --overwrite (check_inputs refused it otherwise)
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    (out / "runs").mkdir(parents=True)
    sft, train_file = Path(args.sft).resolve(), Path(args.train_file).resolve()
    plan_runs = []
    for method in methods:
        for strength in method.strengths:
            run_dir = out / "runs" / run_id(method, strength)
            cmd = training_command(
                method,
                strength,
                sft=sft,
                train_file=train_file,
                steps=args.steps,
                nproc=args.nproc,
                out_dir=run_dir,
            )
            plan_runs.append(
                {
                    "id": run_id(method, strength),
                    "method": method.name,
                    "label": method.label,
                    "strength_key": method.strength_key,
                    "strength_name": method.strength_name,
                    "strength": strength,
                    "lr": method.lr,
                    "dir": str(run_dir),
                    "model": str(run_dir / "hf"),
                    "command": cmd,
                }
            )
    plan = {
        "sft": str(sft),
        "train_file": str(train_file),
        "val_file": str(Path(args.val_file).resolve()),
        "settings": {
            "steps": args.steps,
            "nproc": args.nproc,
            "eval_samples": EVAL_SAMPLES,
            "eval_max_prompt_length": EVAL_MAX_PROMPT_LENGTH,
            "eval_max_new_tokens": EVAL_MAX_NEW_TOKENS,
            "eval_seed": EVAL_SEED,
        },
        "runs": plan_runs,
    }
    (out / "plan.json").write_text(json.dumps(plan, indent=1))

    # 1. train, one run after the other (they share the machine's cores)
    trained = {}
    for i, run in enumerate(plan_runs, 1):
        run_dir = Path(run["dir"])
        run_dir.mkdir(parents=True)
        print(
            f"[{i}/{len(plan_runs)}] {run['label']} {run['strength_name']}={run['strength']:g} "
            f"(lr {run['lr']:g}, {args.steps} steps) ...",
            end=" ",
            flush=True,
        )
        wall_s = run_logged(run["command"], run_dir / "train.log")
        steps, loop_s = steps_and_loop_time(METHODS[run["method"]], run_dir)
        if steps != args.steps or not (run_dir / "hf" / "config.json").is_file():
            raise CommandError(
                f"{run['id']} took {steps} of {args.steps} steps or saved no model; see {run_dir / 'train.log'}"
            )
        trained[run["id"]] = {"steps": steps, "train_wall_s": wall_s, "loop_s": loop_s}
        print(f"{wall_s:.0f} s", flush=True)

    # 2. evaluate every model in one torchrun
    print(f"evaluating the SFT model and {len(plan_runs)} runs ...", flush=True)
    cmd = [
        *torchrun_command(args.nproc),
        "-m",
        "ppo_bench.compare_offline",
        "--evaluate",
        "--out",
        str(out),
    ]
    eval_wall_s = run_logged(cmd, out / "eval.log")
    evals = json.loads((out / "eval.json").read_text())

    # 3. table, plot, every number
    results = collect_results(plan, trained, evals)
    results["settings"]["eval_wall_s"] = eval_wall_s
    results["settings"]["total_wall_s"] = time.perf_counter() - start
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "table.md").write_text(table_markdown(results))
    plot_frontier(results, out / "frontier.png")
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.evaluate:
        return evaluate(Path(args.out))
    try:
        methods = resolve_methods(args)
        check_inputs(args)
    except InputError as e:
        print(f"compare_offline: error: {e}", file=sys.stderr)
        return 2
    try:
        results = compare(args, methods)
    except CommandError as e:
        print(f"\ncompare_offline: error: {e}", file=sys.stderr)
        return 1
    out = Path(args.out)
    print("\n" + (out / "table.md").read_text())
    print(
        f"{out / 'table.md'}, {out / 'frontier.png'}, {out / 'results.json'}; "
        f"{results['settings']['total_wall_s']:.0f} s in all"
    )
    return 0


if __name__ == "__main__":
    if "--evaluate" in sys.argv:  # a rank of step 2's torchrun, which joins a process group
        from ppo.distributed import exit_process

        exit_process(main())
    sys.exit(main())
