"""The prompt once per group (verl's ``use_prefix_grouper``): a PPO step's time by phase with the shared prefix
and without it, side by side, on the real trainer.

Two keys make the shared prefix: ``actor.use_prefix_grouper`` (old log-probs, reference, values and the actor's
and critic's updates hold each group's prompt once, its ``G`` responses after it) and
``rollout.reuse_prompt_cache`` (the rollout prefills each distinct prompt once and copies its KV cache to its
``G`` samples; a multi-turn rollout keeps each row's cache from turn to turn). Each point runs in ``MODES``
``off`` (both false) and ``on`` (both true), the headline point also with each key alone (``rollout_only``,
``train_only``). Every run is one ``train_ppo.py`` in a fresh process: torchrun of ``--nproc`` ranks (2 gloo
ranks of one thread on CPU, as scaling.py's 2-rank points; ``--nproc 1``: plain python, one GPU where there is
one), on random weights of a ``ppo_bench.shapes`` shape (``--model-config``, default ``tiny``: hidden 256, 4
layers, where the linear layers dominate; scripts/make_shaped_model.py with make_tiny_assets.py's character
tokenizer) or ``--model-path``. Prompts are exactly ``P`` tokens (``P - 1`` random characters and the BOS,
checked with ``ppo.data.encode_prompt``; ``data.max_prompt_length=P``), responses exactly ``R``
(``rollout.ignore_eos``); one epoch of one mini-batch, a rank's batch in one micro-batch and one ``generate``
call. GRPO trains with the KL loss (a reference forward), GAE with a critic and the KL in the reward.

Parts (``--parts``; default all but ``headline``, which ``grid`` holds):

- ``grid``: GRPO, prompts 16 / 256 / 1024 x responses 32 / 256 x ``G = rollout.n`` 1 / 4 / 8 / 16,
  ``--prompts-per-rank`` groups per rank.
- ``headline``: the targets' point (prompt 1024, response 32, G 8); ``toggles``: it with each key alone.
- ``gae``: the headline shape with GAE (values and the critic's update).
- ``demo``: configs/demo_cpu.yaml's shapes (prompt 16, response 28, G 8, GAE, 16 prompts per rank),
  ``DEMO_STEPS`` steps, off and on interleaved ``DEMO_REPEATS`` times (``--repeats``).
- ``turns``: a multi-turn preset of 2 / 4 / 8 turns (prefix_turns.py: scaling.py's exact turns), 16-token
  prompts, G 4, 4 prompts per rank, ``off`` against ``rollout_only`` (the kept cache), and per mode the fit
  of the rollout's seconds in turns: exponent ``gen_k``, ``s_per_turn`` and ``intercept_s``.

Columns (medians over each run's steps after ``--warmup``): ``gen_s`` (the rollout), ``score_s`` (old
log-probs + reference + values; no old log-probs with one epoch of one mini-batch: the update's own),
``update_s`` (actor + critic), ``other_s`` (reward, advantages, metrics), ``step_s``; ``gen_x`` ...
``step_x``: the mode's speedup against ``off`` at its point (off's seconds / the mode's); ``response_tokens``
(the trainer's mean response length: ``R``, or ``TURN_TOKENS`` a turn: the work was exact); ``cpu_s`` (CPU
seconds per step and rank); ``wait_s`` (seconds of the step during which a runnable task waited for a core,
``/proc/pressure/cpu``: near 0 on quiet cores; where not, the wall-clock columns measure the load too).
Then the fits and PASS/FAIL lines: at the headline point (GRPO, GAE) scoring and updates at least 3x faster
and the rollout 1.3x; at the demo's shapes no phase (nor the step) over 3% slower than ``off``; the kept
cache's rollout linear in turns (``|k - 1| <= 0.2``). ``--quick`` checks the same at its tiny shapes (there
they exercise the code, not the targets).

The default run (2 CPU ranks) is 62 trainer launches: the grid's 24 points x 2, the 2 toggles, 2 GAE, 4 demo
and 6 multi-turn runs. One group per rank and ``--steps 3`` (one warm-up, two counted) keep it at about 23
minutes on 2 quiet cores (a cost model calibrated on the headline and demo points, whose CPU seconds per step
were 8.1 and 12 with ``off``): ~7 minutes of start-ups (~6.5 s a launch), ~12 of the grid's steps (most of
it the 1024-token prompts with ``off`` and the 256-token rollouts' decoding), ~2 of the demo's, ~2 of the
rest. A loaded machine stretches it (``wait_s``); the seconds in runs are printed at the end.

Run:
    python -m ppo_bench.prefix --figure outputs/prefix.png              # the whole comparison (~23 min)
    python -m ppo_bench.prefix --json > outputs/prefix.jsonl           # one object per run, fit and check
    python -m ppo_bench.prefix --quick                                 # smoke run (~2 min)
    python -m ppo_bench.prefix --model-path /tmp/qwen05b --nproc 1 --parts headline,demo --repeats 1 \\
        --config configs/qwen2_5_0_5b_gsm8k.yaml --prompts-per-rank 8 --max-tokens 16384  # one GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ppo_bench import prefix_turns, runs
from ppo_bench.prefix_turns import PER_TURN, TURN_MODES
from ppo_bench.scaling_turns import FORCED_CHAR, TURN_TOKENS

MODES = {
    "off": (False, False),
    "on": (True, True),
    "rollout_only": (False, True),
    "train_only": (True, False),
}
"""Mode -> (``actor.use_prefix_grouper``, ``rollout.reuse_prompt_cache``), in the tables' order."""
PHASES = {
    "gen": ("gen",),
    "score": ("old_log_prob", "ref", "values"),
    "update": ("update_actor", "update_critic"),
}
"""The trainer's ``timing_s/*`` phases summed into the table's columns."""
PART_NAMES = ("grid", "headline", "toggles", "gae", "demo", "turns")
DEFAULT_PARTS = ("grid", "toggles", "gae", "demo", "turns")
DEMO_STEPS = 3
DEMO_REPEATS = 2
"""The demo point's runs: its 3% bound needs more than two counted steps, and off and on interleaved (two
runs of 3 steps each, 4 counted) so that a change of the machine's load falls on both."""
TARGET_SPEEDUP = {"score": 3.0, "update": 3.0, "gen": 1.3}
"""At the headline point: the least speedup of each phase, on against off."""
DEMO_SLOWER = 1.03
"""At the demo's shapes: the most any phase (and the step) may take, on against off."""


@dataclasses.dataclass(frozen=True)
class Point:
    """One shape of the comparison, run once in each of its ``modes``."""

    prompt_len: int
    response_len: int
    n: int
    """``rollout.n``: responses per prompt (the group)."""
    estimator: str = "grpo"
    prompts_per_rank: int = 1
    turns: int = 0
    """Assistant turns (0: a single-turn rollout, exactly ``response_len`` tokens)."""
    steps: int = 0
    """Trainer steps of each run (0: ``--steps``)."""
    repeats: int = 1
    """Runs of each mode, interleaved (off, on, off, on): a row pools their counted steps."""
    modes: tuple[str, ...] = ("off", "on")

    def key(self) -> tuple:
        """What makes two points the same runs (their modes and steps aside)."""
        return (self.prompt_len, self.response_len, self.n, self.estimator, self.prompts_per_rank, self.turns)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The shapes of a run (the default or ``--quick``'s)."""

    prompt_lens: tuple[int, ...]
    response_lens: tuple[int, ...]
    group_sizes: tuple[int, ...]
    headline: tuple[int, int, int]
    """(prompt, response, G) of the targets, with ``--prompts-per-rank`` groups per rank as the grid."""
    demo: Point
    turns: tuple[int, ...]
    turn_point: Point
    """The multi-turn preset (its ``turns`` and response length set per turn count)."""


FULL = Sizes(
    prompt_lens=(16, 256, 1024),
    response_lens=(32, 256),
    group_sizes=(1, 4, 8, 16),
    headline=(1024, 32, 8),
    # configs/demo_cpu.yaml: GAE, 32 prompts on 2 ranks, n 8, prompts of up to 16 tokens, 28 response tokens
    demo=Point(16, 28, 8, "gae", prompts_per_rank=16, steps=DEMO_STEPS, repeats=DEMO_REPEATS),
    turns=(2, 4, 8),
    # configs/demo_cpu_tools.yaml's prompts (up to 16 tokens), G 4; 16 rows per rank: the re-prefill's growth
    # with the turns is a share of the rollout that shows (prefill is per row, a decoding step nearly not)
    turn_point=Point(16, 0, 4, prompts_per_rank=4, modes=TURN_MODES),
)
QUICK = Sizes(
    prompt_lens=(32,),
    response_lens=(8,),
    group_sizes=(4,),
    headline=(32, 8, 4),
    demo=Point(32, 8, 4, "gae"),  # the GAE point's runs (one group per rank): the demo's bound on them
    turns=(1, 2),
    turn_point=Point(16, 0, 2, modes=TURN_MODES),
)


def headline_point(sizes: Sizes, prompts_per_rank: int, estimator: str = "grpo") -> Point:
    return Point(*sizes.headline, estimator=estimator, prompts_per_rank=prompts_per_rank)


def run_order(point: Point) -> list[str]:
    """The modes of ``point``'s runs in the order they run: its modes, ``repeats`` times (interleaved, so a
    change of the machine's load falls on every mode)."""
    return [mode for _ in range(point.repeats) for mode in point.modes]


def plan(parts: list[str], sizes: Sizes, prompts_per_rank: int) -> list[Point]:
    """The points of ``parts``; points with the same shape are run once, with the union of their modes."""
    points = []
    if "grid" in parts:
        points += [
            Point(p, r, g, prompts_per_rank=prompts_per_rank)
            for p in sizes.prompt_lens
            for r in sizes.response_lens
            for g in sizes.group_sizes
        ]
    head = headline_point(sizes, prompts_per_rank)
    if "headline" in parts:
        points.append(head)
    if "toggles" in parts:
        points.append(dataclasses.replace(head, modes=("off", "rollout_only", "train_only")))
    if "gae" in parts:
        points.append(headline_point(sizes, prompts_per_rank, "gae"))
    if "demo" in parts:
        points.append(sizes.demo)
    if "turns" in parts:
        points += [
            dataclasses.replace(sizes.turn_point, turns=t, response_len=t * PER_TURN) for t in sizes.turns
        ]
    merged: dict[tuple, Point] = {}
    for p in points:
        if p.key() in merged:
            q = merged[p.key()]
            modes = [m for m in MODES if m in q.modes or m in p.modes]
            p = dataclasses.replace(
                q, modes=tuple(modes), steps=max(p.steps, q.steps), repeats=max(p.repeats, q.repeats)
            )
        merged[p.key()] = p
    return list(merged.values())


# ----------------------------------------------------------------------------------------------------
# The runs
# ----------------------------------------------------------------------------------------------------

PROMPT_CHARS = "0123456789bcdefghijklmnopqrstuvwxyz"
"""The prompts' characters: not ``FORCED_CHAR``, whose run of ``TURN_TOKENS`` is the multi-turn part's stop
string (``generate`` matches stop strings across the prompt's end: a prompt ending in "a" would cut a turn)."""


def prompt_rows(num: int, prompt_len: int, seed: int, data_source: str) -> list[dict[str, Any]]:
    """``num`` prompt rows in verl's layout, each prompt a plain string of ``prompt_len - 1`` random characters
    (one token each with the character tokenizer, which adds a BOS: ``prompt_len`` tokens), the rule reward's
    ``data_source`` and a ground truth ("0") that random responses do not write."""
    rng = random.Random(f"{seed}-{prompt_len}")
    return [
        {
            "data_source": data_source,
            "prompt": "".join(rng.choices(PROMPT_CHARS, k=prompt_len - 1)),
            "reward_model": {"style": "rule", "ground_truth": "0"},
        }
        for _ in range(num)
    ]


def check_prompt_lengths(rows: list[dict[str, Any]], tokenizer: Any, prompt_len: int) -> None:
    """Raise unless every row's prompt is ``prompt_len`` tokens as the trainer encodes it."""
    from ppo.data import encode_prompt

    for i, row in enumerate(rows):
        _, ids = encode_prompt(row["prompt"], tokenizer, apply_chat_template=True, where=f"row {i}")
        if len(ids) != prompt_len:
            raise SystemExit(
                f"a {prompt_len}-token prompt encodes to {len(ids)} tokens with this tokenizer: the benchmark's "
                "prompts need a character tokenizer (make_tiny_assets.py's) that adds one BOS"
            )


def write_assets(folder: Path, points: list[Point], args: argparse.Namespace) -> dict[str, Path]:
    """The policy (``--model-path``, or a ``--model-config`` shape with random weights), the rigged policy of
    the ``turns`` part, and a Parquet of exact-length prompts per prompt length (``prompts_<P>``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ppo_bench.common import save_model
    from ppo_bench.scaling_turns import rig_forced_token

    make_tiny_assets = runs.repo_script("make_tiny_assets")
    paths = {"policy": args.model_path}
    if args.model_path is None:
        make_tiny_assets.build_tokenizer().save_pretrained(folder / "tokenizer")
        make_shaped_model = runs.repo_script("make_shaped_model").make_shaped_model
        paths["policy"] = make_shaped_model(
            args.model_config,
            folder / "tokenizer",
            folder / "policy",
            dtype="float32",
            device="cpu",
            seed=args.seed,
        )
    tokenizer = AutoTokenizer.from_pretrained(paths["policy"])
    if any(p.turns for p in points):
        model = AutoModelForCausalLM.from_pretrained(paths["policy"])
        rig_forced_token(model, tokenizer.convert_tokens_to_ids(FORCED_CHAR))
        paths["forced"] = save_model(model, tokenizer, folder / "forced")
    # Every step's prompts distinct (each rank's G samples share a prompt, nothing else does).
    num = 2 * args.nproc * max((p.steps or args.steps) * p.prompts_per_rank for p in points)
    for length in sorted({p.prompt_len for p in points}):
        rows = prompt_rows(num, length, args.seed, make_tiny_assets.DATA_SOURCE)
        check_prompt_lengths(rows, tokenizer, length)
        paths[f"prompts_{length}"] = folder / f"prompts_{length}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), paths[f"prompts_{length}"])
    return paths


def overrides(
    point: Point, mode: str, paths: dict[str, Path], out_dir: Path, args: argparse.Namespace
) -> list[str]:
    """train_ppo's command line for ``point`` in ``mode``."""
    grouper, cache = MODES[mode]
    groups = point.prompts_per_rank * args.nproc
    kl = point.turns == 0  # the multi-turn part times the rollout: no reference forward
    settings = [
        f"data.max_prompt_length={point.prompt_len}",
        f"data.max_response_length={point.response_len}",
        f"data.train_batch_size={groups}",
        f"rollout.n={point.n}",
        f"rollout.micro_batch_size_per_gpu={point.prompts_per_rank * point.n}",  # one generate call
        f"actor.ppo_mini_batch_size={groups}",
        "actor.ppo_epochs=1",
        f"actor.ppo_max_token_len_per_gpu={args.max_tokens}",
        f"critic.ppo_max_token_len_per_gpu={args.max_tokens}",
        "actor.optim.lr=1e-6",
        "critic.optim.lr=1e-6",
        # GRPO needs groups: its G = 1 points run REINFORCE++ (the same phases: no critic, a KL loss).
        f"algorithm.adv_estimator={'reinforce_plus_plus' if point.estimator == 'grpo' and point.n == 1 else point.estimator}",
        f"actor.use_kl_loss={str(kl and point.estimator != 'gae').lower()}",
        f"algorithm.use_kl_in_reward={str(kl and point.estimator == 'gae').lower()}",
        f"actor.use_prefix_grouper={str(grouper).lower()}",
        f"rollout.reuse_prompt_cache={str(cache).lower()}",
    ]
    cmd = runs.run_overrides(
        model=paths["forced" if point.turns else "policy"],
        prompts=paths[f"prompts_{point.prompt_len}"],
        out_dir=out_dir,
        steps=point.steps or args.steps,
        seed=args.seed,
        logger="[jsonl]",
        settings=settings,
    )
    cmd += prefix_turns.turn_settings(point.turns) if point.turns else ["rollout.ignore_eos=true"]
    return cmd + args.set


def launch(
    point: Point, mode: str, paths: dict[str, Path], out_dir: Path, args: argparse.Namespace
) -> tuple[list[dict], float]:
    """``train_ppo.py`` for ``point`` in ``mode`` in a fresh process (torchrun for several ranks): its
    ``metrics.jsonl`` lines (rank 0's timings) with ``bench/cpu_s`` (per rank) and ``bench/wait_s`` per step,
    and the run's wall seconds, start-up included."""
    launcher = runs.torchrun_command(args.nproc) if args.nproc > 1 else [sys.executable]
    preset = ["--config", str(args.config)] if args.config else []
    script = [str(runs.ROOT / "train_ppo.py"), *preset, *overrides(point, mode, paths, out_dir, args)]
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(out_dir / "stdout.txt", "w") as out, open(out_dir / "stderr.txt", "w") as err:
        proc = subprocess.Popen(
            [*launcher, *script], stdout=out, stderr=err, env=runs.run_env(args.threads), cwd=runs.ROOT
        )
    try:
        (ends,) = runs.watch_step_ends([proc], [out_dir / "metrics.jsonl"])
    finally:  # stopped from outside (a time limit's SIGTERM, main's handler): the run stops with it
        if proc.poll() is None:
            proc.terminate()  # torchrun passes it to its ranks
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
    if proc.wait() != 0:
        raise RuntimeError(
            f"{label(point)} {mode} failed ({proc.returncode}):\n{(out_dir / 'stderr.txt').read_text()[-4000:]}"
        )
    run_s = time.perf_counter() - start
    metrics = runs.read_metrics(out_dir)
    clocks = runs.step_clocks(ends)
    for m in metrics:
        cpu, wait = clocks.get(m["step"], (None, None))
        m["bench/cpu_s"] = None if cpu is None else cpu / args.nproc
        m["bench/wait_s"] = wait  # the machine's, not the process's
    return metrics, run_s


# ----------------------------------------------------------------------------------------------------
# Rows, speedups, fits and checks (pure)
# ----------------------------------------------------------------------------------------------------


def label(point: Point) -> str:
    turns = f" t{point.turns}" if point.turns else ""
    return f"{point.estimator} p{point.prompt_len} r{point.response_len} g{point.n}{turns}"


def summarize(point: Point, mode: str, metrics: list[dict], run_s: float, *, warmup: int) -> dict[str, Any]:
    """One row of the table from the per-step metrics of the mode's runs (one or ``repeats``, each numbering
    its steps from 1): medians over each run's steps after ``warmup``; ``run_s`` their wall seconds."""
    counted = [m for m in metrics if m["step"] > warmup]
    if not counted:
        raise ValueError(f"{label(point)} {mode}: no step after the {warmup} warm-up step(s)")
    names = sorted({k[len("timing_s/") :] for m in counted for k in m if k.startswith("timing_s/")})
    med = {p: statistics.median(m.get(f"timing_s/{p}", 0.0) for m in counted) for p in names}
    groups = {g: sum(med.get(p, 0.0) for p in phases) for g, phases in PHASES.items()}
    clocks = {
        name: [m[f"bench/{name}"] for m in counted if m.get(f"bench/{name}") is not None]
        for name in ("cpu_s", "wait_s")
    }
    return {
        "estimator": point.estimator,
        "prompt_len": point.prompt_len,
        "response_len": point.response_len,
        "n": point.n,
        "turns": point.turns,
        "prompts_per_rank": point.prompts_per_rank,
        "mode": mode,
        "gen_s": groups["gen"],
        "score_s": groups["score"],
        "update_s": groups["update"],
        "other_s": med["step"] - sum(groups.values()),
        "step_s": med["step"],
        "response_tokens": statistics.median(m["response_length/mean"] for m in counted),
        "cpu_s": statistics.median(clocks["cpu_s"]) if clocks["cpu_s"] else None,
        "wait_s": statistics.median(clocks["wait_s"]) if clocks["wait_s"] else None,
        "steps": len(counted),
        "run_s": run_s,
        "timing_s": med,
    }


ROW_KEY = ("estimator", "prompt_len", "response_len", "n", "turns", "prompts_per_rank")
SPEEDUPS = ("gen", "score", "update", "step")


def speedup(off_s: float, on_s: float) -> float | None:
    """``off_s / on_s`` (above 1: the mode is faster), None where either is not a positive time."""
    return off_s / on_s if off_s > 0 and on_s > 0 else None


def with_speedups(rows: list[dict]) -> list[dict]:
    """Each row with ``<phase>_x``: the speedup of its mode against ``off`` at the same point (None without
    an ``off`` row)."""
    off = {tuple(r[k] for k in ROW_KEY): r for r in rows if r["mode"] == "off"}
    out = []
    for r in rows:
        base = off.get(tuple(r[k] for k in ROW_KEY))
        out.append(
            {**r, **{f"{p}_x": speedup(base[f"{p}_s"], r[f"{p}_s"]) if base else None for p in SPEEDUPS}}
        )
    return out


def find(rows: list[dict], point: Point, mode: str) -> dict | None:
    """The row of ``point`` in ``mode``, or None."""
    want = (
        point.estimator,
        point.prompt_len,
        point.response_len,
        point.n,
        point.turns,
        point.prompts_per_rank,
    )
    return next((r for r in rows if r["mode"] == mode and tuple(r[k] for k in ROW_KEY) == want), None)


def checks(rows: list[dict], fits: list[dict], sizes: Sizes, prompts_per_rank: int) -> list[dict]:
    """The targets as lines: ``check`` (what), ``value``, ``target``, ``pass`` (None: not measured). ``rows``
    carry their speedups (``with_speedups``)."""
    check = prefix_turns.check
    out = []
    for estimator in ("grpo", "gae"):
        point = headline_point(sizes, prompts_per_rank, estimator)
        on = find(rows, point, "on")
        for phase, target in TARGET_SPEEDUP.items():
            text = f"{label(point)}: {phase} speedup on/off >= {target:g}"
            out.append(check(text, on[f"{phase}_x"] if on else None, target, lambda x, t=target: x >= t))
    on, off = find(rows, sizes.demo, "on"), find(rows, sizes.demo, "off")
    for phase in SPEEDUPS:
        value = on[f"{phase}_s"] / off[f"{phase}_s"] if on and off and off[f"{phase}_s"] > 0 else None
        text = f"demo {label(sizes.demo)}: {phase} time on/off <= {DEMO_SLOWER:g}"
        out.append(check(text, value, DEMO_SLOWER, lambda x: x <= DEMO_SLOWER))
    out.append(prefix_turns.turns_check(fits))
    # The work each point set: R tokens a response (ignore_eos), or TURN_TOKENS of the policy's a turn.
    inexact = [r for r in rows if r["response_tokens"] != (r["turns"] * TURN_TOKENS or r["response_len"])]
    text = "every run's responses had exactly the point's tokens"
    out.append(check(text, float(len(inexact)) if rows else None, 0.0, lambda x: x == 0))
    return out


def verdict_line(check: dict) -> str:
    """``PASS  <check>: <value>``, ``FAIL ...``, or ``SKIP  <check>: not measured``."""
    if check["pass"] is None:
        return f"SKIP  {check['check']}: not measured"
    return f"{'PASS' if check['pass'] else 'FAIL'}  {check['check']}: {check['value']:.3g}"


# ----------------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------------

TABLE_COLUMNS = [
    "estimator", "prompt_len", "response_len", "n", "turns", "mode", "gen_s", "score_s", "update_s",
    "other_s", "step_s", "gen_x", "score_x", "update_x", "step_x", "response_tokens", "cpu_s", "wait_s",
]  # fmt: skip


def print_report(
    rows: list[dict], fits: list[dict], verdicts: list[dict], as_json: bool, quick: bool
) -> None:
    """The runs, the multi-turn fits and the checks: tables and PASS/FAIL lines, or one JSON object per line
    (``kind``: point | fit | check; ``main`` prints the points' lines as each point ends and passes none)."""
    from ppo_bench.common import print_json_lines, print_table

    if as_json:
        print_json_lines(rows, "point")
        print_json_lines(fits, "fit")
        print_json_lines(verdicts, "check")
        return
    print_table(rows, TABLE_COLUMNS)
    if fits:
        print()
        print(
            "multi-turn rollout seconds against turns: gen_s = c * turns^gen_k, and = intercept_s + s_per_turn * turns"
        )
        print_table(fits, prefix_turns.FIT_COLUMNS)
    print()
    if quick:
        print("(quick: the checks below run at the quick shapes, not at the targets' shapes)")
    for check in verdicts:
        print(verdict_line(check))


def plot(rows: list[dict], fits: list[dict], path: Path) -> None:
    """One panel per prompt length of the GRPO rows in mode ``on``: each phase's speedup against G (solid:
    the shortest response, dashed: the longer); and the multi-turn rollout's seconds against turns per mode."""
    plt = runs.pyplot()
    single = [r for r in rows if not r["turns"] and r["estimator"] == "grpo" and r["mode"] == "on"]
    prompt_lens = sorted({r["prompt_len"] for r in single})
    multi = [r for r in rows if r["turns"]]
    panels = len(prompt_lens) + bool(multi)
    fig, axes = plt.subplots(1, max(panels, 1), figsize=(4.6 * max(panels, 1), 3.8), squeeze=False)
    colors = {"gen": "C0", "score": "C1", "update": "C2", "step": "C3"}
    for ax, length in zip(axes.flat, prompt_lens, strict=False):
        sel = [r for r in single if r["prompt_len"] == length]
        for i, response in enumerate(sorted({r["response_len"] for r in sel})):
            line = sorted((r for r in sel if r["response_len"] == response), key=lambda r: r["n"])
            for phase, color in colors.items():
                pts = [(r["n"], r[f"{phase}_x"]) for r in line if r[f"{phase}_x"] is not None]
                if pts:
                    xs, ys = zip(*pts, strict=True)
                    style = "-" if i == 0 else "--"
                    ax.plot(xs, ys, color=color, linestyle=style, marker="o", label=f"{phase} r{response}")
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"prompt {length} tokens: speedup on/off")
        ax.set_xlabel("G (rollout.n)")
        ax.set_ylabel("off seconds / on seconds")
        ax.legend(fontsize=7)
    if multi:
        prefix_turns.plot_turns(axes.flat[len(prompt_lens)], rows, fits)
    runs.save_figure(fig, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from ppo_bench.common import add_common_args

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parts = f"comma-separated, of {', '.join(PART_NAMES)} (default: {','.join(DEFAULT_PARTS)}; --quick: no toggles)"
    parser.add_argument("--parts", default=None, help=parts)
    parser.add_argument("--quick", action="store_true", help="a handful of tiny points: a smoke run (~2 min)")
    parser.add_argument("--steps", type=int, default=3, help="trainer steps of a run")
    parser.add_argument("--warmup", type=int, default=1, help="first steps of a run not counted")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per run (torchrun above 1)")
    parser.add_argument(
        "--prompts-per-rank", type=int, default=1, help="groups per rank: grid, headline, gae"
    )
    parser.add_argument("--repeats", type=int, default=None, help="interleaved runs per mode at the demo's")
    parser.add_argument("--model-config", default="tiny", help="a ppo_bench.shapes shape (random weights)")
    parser.add_argument("--model-path", type=Path, default=None, help="a model folder (character tokenizer)")
    parser.add_argument("--config", type=Path, default=None, help="a trainer preset under the settings")
    parser.add_argument("--max-tokens", type=int, default=1 << 20, help="a micro-batch's tokens per rank")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="trainer overrides")
    parser.add_argument("--figure", type=Path, default=None, help="write the speedups and turns (PNG) here")
    add_common_args(
        parser, threads_help="torch CPU threads per rank", json_help="one object per run, fit, check"
    )
    args = parser.parse_args(argv)
    if args.parts is None:
        args.parts = ",".join(p for p in DEFAULT_PARTS if not (args.quick and p == "toggles"))
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in args.parts if p not in PART_NAMES]
    if unknown or not args.parts:
        parser.error(f"--parts: unknown {unknown}; expected some of {', '.join(PART_NAMES)}")
    if args.steps <= args.warmup:
        parser.error("--steps must be larger than --warmup")
    if min(args.nproc, args.prompts_per_rank, args.repeats or 1) < 1:
        parser.error("--nproc, --prompts-per-rank and --repeats must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = QUICK if args.quick else FULL
    if args.repeats is not None:
        sizes = dataclasses.replace(sizes, demo=dataclasses.replace(sizes.demo, repeats=args.repeats))
    points = plan(args.parts, sizes, args.prompts_per_rank)
    total = sum(len(p.modes) * p.repeats for p in points)
    rows, done = [], 0
    start, (_, waited) = time.perf_counter(), runs.process_clocks(os.getpid())
    with tempfile.TemporaryDirectory(prefix="prefix_") as tmp:
        folder = Path(tmp)
        paths = write_assets(folder, points, args)
        for point in points:
            by_mode: dict[str, tuple[list[dict], float]] = {mode: ([], 0.0) for mode in point.modes}
            for mode in run_order(point):
                metrics, run_s = launch(point, mode, paths, folder / f"run_{done}", args)
                by_mode[mode] = (by_mode[mode][0] + metrics, by_mode[mode][1] + run_s)
                done += 1
                print(
                    f"[{done}/{total}] {label(point)} {mode}: run {run_s:.3g} s", file=sys.stderr, flush=True
                )
            done_rows = with_speedups(
                [summarize(point, m, *by_mode[m], warmup=args.warmup) for m in point.modes]
            )
            rows += done_rows
            if args.json:  # as each point ends: what a time limit cuts short keeps the points before it
                print_report(done_rows, [], [], as_json=True, quick=args.quick)
                sys.stdout.flush()
    fits = prefix_turns.turn_fits(rows)
    verdicts = checks(rows, fits, sizes, args.prompts_per_rank)
    print_report([] if args.json else rows, fits, verdicts, args.json, args.quick)
    _, waited_after = runs.process_clocks(os.getpid())
    wait = (
        f"; the machine had a task waiting for a core {waited_after - waited:.0f} s"
        if waited is not None
        else ""
    )
    print(f"{total} runs, {sum(r['run_s'] for r in rows):.0f} s in runs, {time.perf_counter() - start:.0f} s in all{wait}",
          file=sys.stderr)  # fmt: skip
    if args.figure is not None:
        plot(rows, fits, args.figure)
        print(f"wrote {args.figure}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a time limit: launch() ends its run too
    sys.exit(main())
