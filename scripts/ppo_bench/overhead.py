"""Benchmark the trainer's fixed per-step CPU cost on a tiny model against TRL's PPOTrainer.

The real trainer runs in one process: a Llama of ``--layers`` x ``--hidden`` (2 x 128) on the tiny
character tokenizer of make_tiny_assets.py, actor and critic from that backbone, a reward model;
``--num-prompts`` (16) prompts x ``--response-len`` (32) tokens (``rollout.ignore_eos``, so every
response has that length), GAE with KL in the reward, ``--epochs`` (2) epochs of 2 mini-batches. The
models and a prompt Parquet are written to a temporary folder, then ``train_ppo.main`` runs ``--steps``
steps; a step's time is the CPU time between the trainer's consecutive step log lines (read by a logging
handler), its phases come from ``metrics.jsonl`` (``timing_s/*``, wall clock). Steps 1 and 2 are not
counted.

Where TRL is importable (``--trl-path`` adds a private install to ``sys.path``; nothing of TRL is in the
project's dependencies), TRL's ``PPOTrainer`` runs the same shapes in the same process: ``trl`` as
shipped, and ``trl_gc_frozen`` with ``gc.freeze()`` before training, which takes the per-step
``gc.collect()`` of its loop out of the timing. The runs alternate ``--rounds`` times so that load from
other processes hits all alike; medians over all counted steps, with min and max.

Columns: ``trainer``, ``steps`` (counted), ``step_cpu_s`` (median), ``step_cpu_min_s``,
``step_cpu_max_s``, ``step_wall_s``, the phases of our step (``gen_s``, ``old_log_prob_s``, ``ref_s``,
``values_s``, ``reward_s``, ``adv_s``, ``update_critic_s``, ``update_actor_s``: median wall seconds) and
``vs_trl`` (``trl_gc_frozen``'s step_cpu_s / this one's: the target is >= 1.5). Without TRL the summary
line compares ours with a reference TRL step time (``TRL_REFERENCE_S``) instead.

One process, one torch thread (``--threads``), the CPU clock: on a machine shared with other jobs wall
time mostly measures the scheduler (see rollout.py).

Where the rest of our step goes, phase by phase against the bare calls it consists of, is
overhead_floor.py.

Run:
    .venv/bin/python -m ppo_bench.overhead                       # ours only (TRL not installed)
    pip install --no-deps --target /tmp/trl trl==1.12.0              # TRL beside, not into, the venv
    .venv/bin/python -m ppo_bench.overhead --trl-path /tmp/trl   # TRL side by side
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import statistics
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from ppo_bench.common import (
    add_common_args,
    add_tiny_model_args,
    print_rows,
    save_model,
    set_threads,
    tiny_llama_config,
    write_prompts,
)
from ppo_bench.overhead_trl import import_trl, run_trl
from ppo_bench.runs import StepClock, read_metrics, run_overrides

NUM_MINI_BATCHES = 2
"""Optimizer steps per model per PPO epoch (mini-batches of the rollout)."""
OUR_PHASES = ("gen", "old_log_prob", "ref", "values", "reward", "adv", "update_critic", "update_actor")
TRL_REFERENCE_S = 0.21
"""TRL 1.12's step on this configuration with its gc.collect frozen out, measured on another machine
(docs/cpu_step_profile.md): what ours is compared with where TRL cannot run beside it."""


@dataclasses.dataclass
class OverheadRow:
    """One trainer's per-step time."""

    trainer: str
    """``ours`` (train_ppo), ``trl`` (PPOTrainer as shipped), ``trl_gc_frozen`` (gc.freeze() first)."""
    steps: int
    """Steps counted (all rounds; the first two of each run are not)."""
    step_cpu_s: float
    """Median CPU seconds per step (one step's end to the next's)."""
    step_cpu_min_s: float
    step_cpu_max_s: float
    step_wall_s: float
    """Median wall seconds per step (on a shared machine, mostly the scheduler)."""
    gen_s: float | None = None
    """Phases of our step (median wall seconds, ``metrics.jsonl``'s ``timing_s/*``)."""
    old_log_prob_s: float | None = None
    ref_s: float | None = None
    values_s: float | None = None
    reward_s: float | None = None
    adv_s: float | None = None
    update_critic_s: float | None = None
    update_actor_s: float | None = None
    vs_trl: float | None = None
    """trl_gc_frozen's step_cpu_s / this row's (the target for ours: >= 1.5)."""


def write_assets(folder: Path, args: argparse.Namespace) -> dict[str, Path]:
    """Policy (also the critic's backbone), reward model and prompt Parquet of the benchmark's shapes."""
    from ppo_bench.runs import repo_script

    make_tiny_assets = repo_script("make_tiny_assets")
    tokenizer = make_tiny_assets.build_tokenizer()
    config = tiny_llama_config(tokenizer, args.hidden, args.layers, max_positions=256)
    paths = {"policy": folder / "policy", "reward": folder / "reward", "prompts": folder / "prompts.parquet"}
    torch.manual_seed(args.seed)
    save_model(AutoModelForCausalLM.from_config(config), tokenizer, paths["policy"])
    torch.manual_seed(args.seed + 1)
    config.num_labels = 1
    save_model(AutoModelForSequenceClassification.from_config(config), tokenizer, paths["reward"])
    write_prompts(paths["prompts"], args.num_prompts * (args.steps + 1), args.seed)
    return paths


def ppo_overrides(args: argparse.Namespace, paths: dict[str, Path], out_dir: Path) -> list[str]:
    """train_ppo's command line for the benchmark's configuration."""
    settings = [
        "data.max_prompt_length=32",
        f"data.max_response_length={args.response_len}",
        f"data.train_batch_size={args.num_prompts}",
        "rollout.n=1",
        "rollout.ignore_eos=true",  # every response response_len tokens, as TRL without a stop token
        f"actor.ppo_mini_batch_size={args.num_prompts // NUM_MINI_BATCHES}",
        f"actor.ppo_epochs={args.epochs}",
        "actor.optim.lr=1e-6",
        "critic.optim.lr=1e-6",
        "reward.style=model",
        f"reward.model_path={paths['reward']}",
        "algorithm.adv_estimator=gae",
        "algorithm.use_kl_in_reward=true",
    ]
    return run_overrides(
        model=paths["policy"],
        prompts=paths["prompts"],
        out_dir=out_dir,
        steps=args.steps,
        seed=args.seed,
        logger="[console,jsonl]",
        settings=settings,
    )


def run_ours(
    args: argparse.Namespace, paths: dict[str, Path], out_dir: Path
) -> tuple[list[float], list[float], dict[str, list[float]]]:
    """``train_ppo.main`` for ``--steps`` steps: per-step CPU and wall seconds, and the phase timings."""
    import train_ppo

    clock = StepClock()
    log = logging.getLogger("ppo")
    log.addHandler(clock)
    try:
        code = train_ppo.main(ppo_overrides(args, paths, out_dir))
    finally:
        log.removeHandler(clock)
    if code != 0:
        raise RuntimeError(f"train_ppo exited with {code}")
    lines = read_metrics(out_dir)
    phases = {
        p: [r[f"timing_s/{p}"] for r in lines if r["step"] > 2 and f"timing_s/{p}" in r] for p in OUR_PHASES
    }
    cpu, wall = clock.step_times()
    return cpu, wall, phases


def one_process() -> None:
    """Refuse a start under torchrun: the benchmark measures one process."""
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise SystemExit("the overhead benchmarks measure one process; start them without torchrun")


def run_overhead(args: argparse.Namespace) -> tuple[list[OverheadRow], str | None]:
    """Ours, then TRL as shipped and with gc frozen, ``--rounds`` times; the rows, and TRL's version (or
    why it did not run). ``train_ppo.main`` joins and leaves the process group itself."""
    one_process()
    trl_ppo, trl_note = import_trl(args)
    cpu: dict[str, list[float]] = {}
    wall: dict[str, list[float]] = {}
    phases: dict[str, list[float]] = {p: [] for p in OUR_PHASES}
    with tempfile.TemporaryDirectory(prefix="overhead_") as tmp:
        folder = Path(tmp)
        paths = write_assets(folder, args)
        for r in range(args.rounds):
            c, w, ph = run_ours(args, paths, folder / f"ours_{r}")
            cpu.setdefault("ours", []).extend(c)
            wall.setdefault("ours", []).extend(w)
            for p in OUR_PHASES:
                phases[p].extend(ph[p])
            if trl_ppo is None:
                continue
            for name, freeze in (("trl", False), ("trl_gc_frozen", True)):
                c, w = run_trl(
                    trl_ppo,
                    args,
                    paths,
                    folder / f"{name}_{r}",
                    num_mini_batches=NUM_MINI_BATCHES,
                    freeze_gc=freeze,
                )
                cpu.setdefault(name, []).extend(c)
                wall.setdefault(name, []).extend(w)
    rows = []
    for name in cpu:
        row = OverheadRow(
            trainer=name,
            steps=len(cpu[name]),
            step_cpu_s=statistics.median(cpu[name]),
            step_cpu_min_s=min(cpu[name]),
            step_cpu_max_s=max(cpu[name]),
            step_wall_s=statistics.median(wall[name]),
        )
        if name == "ours":
            for p in OUR_PHASES:
                setattr(row, f"{p}_s", statistics.median(phases[p]) if phases[p] else None)
        rows.append(row)
    trl = next((r for r in rows if r.trainer == "trl_gc_frozen"), None)
    for row in rows:
        row.vs_trl = trl.step_cpu_s / row.step_cpu_s if trl is not None else None
    return rows, trl_note


def add_step_args(parser: argparse.ArgumentParser) -> None:
    """The step's shapes and the runs of ours: what overhead.py and overhead_floor.py share."""
    parser.add_argument("--num-prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--response-len", type=int, default=32, help="tokens per response")
    add_tiny_model_args(parser)
    parser.add_argument("--epochs", type=int, default=2, help="PPO epochs over the 2 mini-batches")
    parser.add_argument("--steps", type=int, default=10, help="steps per run (the first two not counted)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="runs of ours, alternating with the other side (TRL, bare calls)",
    )


def check_step_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``add_step_args``'s values that cannot run."""
    if args.num_prompts % NUM_MINI_BATCHES or args.steps < 3 or args.rounds < 1:
        parser.error(f"need --num-prompts a multiple of {NUM_MINI_BATCHES}, --steps >= 3, --rounds >= 1")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_step_args(parser)
    parser.add_argument("--trl", default="auto", choices=["auto", "yes", "no"], help="run TRL beside ours")
    parser.add_argument("--trl-path", default=None, help="a folder holding TRL (pip install --target)")
    add_common_args(parser)
    args = parser.parse_args(argv)
    check_step_args(parser, args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    rows, trl_note = run_overhead(args)
    print_rows(rows, args.json)
    if not args.json:
        ours = rows[0]
        trl = next((r for r in rows if r.trainer == "trl_gc_frozen"), None)
        if trl is not None:
            print(
                f"ours {ours.step_cpu_s:.3f} s/step (CPU), TRL {trl_note} with gc frozen {trl.step_cpu_s:.3f} s: "
                f"{ours.vs_trl:.2f}x ({'meets' if ours.vs_trl >= 1.5 else 'misses'} the 1.5x target)"
            )
        else:
            print(
                f"TRL did not run ({trl_note}); ours {ours.step_cpu_s:.3f} s/step (CPU) against "
                f"{TRL_REFERENCE_S} s for TRL (a reference machine): target <= {TRL_REFERENCE_S / 1.5:.2f} s"
            )
    return 0


if __name__ == "__main__":
    from ppo.distributed import exit_process  # this process joins a process group (train_ppo.main)

    exit_process(main())
