"""How a PPO step's cost grows with the work: one axis at a time, the others fixed, on the real trainer.

Every point is one run of ``train_ppo.py`` (``train_ppo.main``) in a fresh process (``torchrun`` for the
2-rank points) on a tiny Llama written to a temporary folder (``--layers`` x ``--hidden``, 2 x 128, on
make_tiny_assets.py's character tokenizer), arithmetic prompts, the rule reward, GAE with a critic, one
PPO epoch of one mini-batch, and every rank's whole batch in one micro-batch
(``ppo_max_token_len_per_gpu`` above any batch here), so memory follows the tokens of a micro-batch.
Responses have exactly ``data.max_response_length`` tokens (``rollout.ignore_eos``), so the work of a
point is known before it runs. A fresh process per point gives each its own peak memory and the same
start-up for 1 and 2 ranks; each point runs ``--steps`` steps and the first ``--warmup`` are not counted.

Axes (``--axes``; fixed values: 8 prompts, ``rollout.n=1``, 32 response tokens, 1 rank):

- ``response_len``: tokens per response, 32 -> 1024 (8 prompts).
- ``batch``: prompts per step, 8 -> 128 (``data.train_batch_size``).
- ``n``: responses per prompt, 1 -> 16 (``rollout.n``; 8 prompts).
- ``ranks``: 1 -> 2 ranks (gloo, one thread each), three series: ``ranks/weak`` (the same work per rank:
  16 prompts per rank), ``ranks/strong`` (the same total work: 16 prompts in all) and the control
  ``ranks/independent``: at ``x=2`` two independent 1-rank runs of ``ranks/weak``'s per-rank work, started
  together (no process group between them: nothing is communicated), so the machine's own cost of running
  two busy processes (two cores sharing caches and memory bandwidth) shows apart from the trainer's. Their
  mean is the table's row, each one's row is printed below it (``processes`` in ``--json``); each runs
  ``PAIR_EXTRA_STEPS`` more steps and only the steps during which the other was training count
  (``overlapping_steps``); ``--quick`` leaves the pair out. ``ranks/weak`` minus ``ranks/independent`` at ``x=2``, per phase, is what the
  2-rank trainer adds: FSDP (its collectives, hooks and DTensor optimizer; a world of one runs unwrapped),
  the metric reductions.
- ``turns``: multi-turn rollouts, 1 -> 8 turns (``rollout.multi_turn``) of ``TURN_TOKENS`` generated tokens,
  each answered by ``FixedAnswer`` (scaling_turns.py) with ``OBSERVATION``. The turns are exact: the
  policy of this axis is rigged to always write the character ``FORCED_CHAR`` (``rig_forced_token``), and the
  stop string is ``TURN_TOKENS`` of them. Each turn is one ``generate`` call whose prompt is the whole
  trajectory so far (``ppo.multi_turn.run_turns``); each row's KV cache is kept from turn to turn
  (``rollout.reuse_prompt_cache``), so a turn prefills only the tokens its row gained (its observation),
  and with the cache off it prefills the prompt and every earlier turn and observation again:
  ``turn_work`` counts the prefill tokens (linear in the turns with the kept cache, quadratic without)
  and decoding steps (linear) by arithmetic, and ``profile_turns`` times them, in this process, on the trainer's
  sampler under forward hooks (``ForwardClock``, CPU time; its counts must equal the arithmetic).
  ``turn_cost_model`` turns that into CPU seconds per prefill token, per decoding step and per ``generate``
  call (everything else), printed with each point's modelled seconds (``model_s``) and the exponents of the
  rollout with and without its prefill.
- ``sp``: tokens per rank under Ulysses sequence parallelism (``actor.ulysses_sequence_parallel_size=2``,
  2 ranks, one group): 4 prompts of 128 -> 512 response tokens, each rank holding half of every sequence.

Columns, per point (medians over the counted steps): ``series``, ``x`` (the knob: response tokens,
prompts, n, ranks, turns, or response tokens under SP), ``tokens`` (prompt + response tokens per step,
``perf/total_num_tokens``), ``work`` (what the exponent is fitted against: tokens per rank per step, or
the number of ranks on the ranks axis), ``step_s``, ``gen_s``, ``score_s`` (reference + values, and old
log-probs where the trainer computes them: not with one epoch of one mini-batch, where they are the
update's own), ``train_s`` (critic + actor updates), ``other_s`` (the rest of the step: reward, advantages,
packing, metrics), ``gen_ms_per_token`` (generation time per decoded position: ``gen_s`` over the response tokens of
one sequence), ``cpu_s`` (CPU seconds per step of the process, per rank under torchrun: the on-core time of
its threads, ``process_clocks``, read when each step's line appears in ``metrics.jsonl``), ``wait_s``
(seconds of the step during which some runnable task on the machine waited for a core,
``/proc/pressure/cpu``: near 0 when the run had the cores to itself; where it is not, the wall-clock
columns measure the machine's load as much as the trainer, and ``cpu_s`` is the figure to compare),
``tokens_per_s`` (all ranks), ``mem_gib``
(the trainer's own ``perf/max_memory_gib``, maxed over ranks: on CPU the process's peak resident set
(``ru_maxrss``, a baseline of the interpreter, torch and the models included), on CUDA the peak of
``torch.cuda.max_memory_allocated``). ``--json`` writes one object per point with every ``timing_s/*``
phase, the mean response length (``response_tokens``, the trainer's ``response_length/mean``: the
policy's tokens, so the point's response budget, or ``TURN_TOKENS`` per turn on ``turns``: a check that
the work is exact), and one object per fit.

Exponents: per series and phase group, ``time = c * work^k`` fitted by least squares on log-log
(``fit_exponent``). How to read them:

- ``k ~ 1``: the cost is linear in the work (what packing gives training and scoring: no padding, and
  attention is a small share at these lengths; ``k > 1`` on long responses is attention's ``l^2``).
- ``k ~ 0``: the cost does not grow (a fixed per-step overhead; on ``ranks/weak``, perfect weak
  scaling: twice the ranks do twice the work in the same time).
- ``k ~ -1`` on ``ranks/strong``: perfect strong scaling (half the time on twice the ranks).
- generation on ``response_len``: ``k ~ 1`` means a flat cost per token (the KV cache: each decoding step
  attends to the cache instead of recomputing the prefix); ``gen_ms_per_token`` shows it directly.
  On ``batch`` and ``n`` generation's ``k < 1``: a decoding step costs about the same for 8 or 128 rows
  on a tiny model (per-step overhead, not arithmetic).
- ``turns``: with the kept cache a turn prefills only its new tokens, so generation grows with the
  tokens (``gen_s`` also holds the environment's calls); with ``rollout.reuse_prompt_cache=false`` each
  turn re-reads the trajectory so far, and generation grows faster; the profile below the tables splits
  it into prefill, decoding and the rest, and ``without_prefill_k ~ 1`` says the prefill is the excess.
- ``ranks/independent``: ``k ~ 0`` (and ``cpu_s`` as on one process) means the machine runs two busy
  processes as fast as one; ``ranks/weak`` above it is then the trainer's own 2-rank cost.
- memory: ``mem_k`` (log-log) is small on CPU because of the constant baseline; ``mem_mib_per_ktok`` is
  the slope of a straight-line fit (MiB per 1000 tokens per rank), which is what grows with the tokens
  of a micro-batch (activations, logits).

The default run (all axes, 19 trainer launches of 3 steps, the independent pair of 9 each: a few seconds of
start-up each, the longest point 1024 decoding steps; and the turns profile) takes about 4 minutes on 2
quiet CPU cores; ``--quick`` is a smoke run of
tiny points (seconds of work per point, mostly start-up).

Run:
    .venv/bin/python -m ppo_bench.scaling --png outputs/scaling.png           # table + figure
    .venv/bin/python -m ppo_bench.scaling --axes response_len,ranks --json    # machine-readable
    .venv/bin/python -m ppo_bench.scaling --quick --axes batch                # smoke run

A multi-turn preset's own rollout, call by call (what re-reading earlier turns costs at its sizes), is
multi_turn.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from ppo_bench.common import (
    add_common_args,
    add_tiny_model_args,
    print_json_lines,
    print_table,
    save_model,
    tiny_llama_config,
    write_prompts,
)
from ppo_bench.runs import (
    ROOT,
    fit_exponent,
    fit_line,
    overlapping_steps,
    pyplot,
    read_metrics,
    run_env,
    run_overrides,
    save_figure,
    step_clocks,
    torchrun_command,
    watch_step_ends,
)
from ppo_bench.scaling_turns import (
    FIXED_ANSWER,
    FORCED_CHAR,
    OBSERVATION,
    TURN_COLUMNS,
    TURN_TOKENS,
    profile_turns,
    rig_forced_token,
    turn_cost_model,
    with_model,
)

AXES = ("response_len", "batch", "n", "ranks", "turns", "sp")
PHASE_GROUPS = {
    "gen": ("gen",),
    "score": ("old_log_prob", "ref", "values"),
    "train": ("update_critic", "update_actor"),
}
"""The trainer's ``timing_s/*`` phases summed into the groups whose exponents are fitted."""
FITTED = ("step", "gen", "score", "train", "mem")
PROMPT_LEN = 32
"""``data.max_prompt_length`` (the arithmetic prompts are shorter)."""


@dataclasses.dataclass(frozen=True)
class Point:
    """One run: the series it belongs to, its knob value and the trainer's settings."""

    series: str
    x: int
    num_prompts: int
    n: int = 1
    response_len: int = 32
    nproc: int = 1
    sp: int = 1
    turns: int = 0
    """Assistant turns (0: a single-turn rollout)."""
    copies: int = 1
    """Independent 1-rank runs of the point started together (``ranks/independent``): the same work per
    process as ``ranks/weak``'s ranks, no process group between them."""


def axis_points(axis: str, quick: bool = False) -> list[Point]:
    """The points of ``axis`` (geometric steps; ``quick``: two tiny ones, or four for ``ranks``, without the
    independent pair: quick steps take tens of milliseconds, so whether two processes started together
    train at the same time depends on how fast each starts, not on anything the benchmark controls)."""
    if axis == "response_len":
        return [
            Point("response_len", r, num_prompts=8, response_len=r)
            for r in ((8, 16) if quick else (32, 128, 512, 1024))
        ]
    if axis == "batch":
        length = 8 if quick else 32
        return [
            Point("batch", b, num_prompts=b, response_len=length) for b in ((2, 4) if quick else (8, 32, 128))
        ]
    if axis == "n":
        length = 8 if quick else 32
        return [
            Point("n", n, num_prompts=8, n=n, response_len=length) for n in ((1, 2) if quick else (1, 4, 16))
        ]
    if axis == "ranks":
        per_rank, length = (2, 8) if quick else (16, 32)
        one = dict(num_prompts=per_rank, response_len=length)
        points = [
            Point("ranks/weak", 1, **one),
            Point("ranks/weak", 2, num_prompts=2 * per_rank, response_len=length, nproc=2),
            Point("ranks/strong", 1, **one),
            Point("ranks/strong", 2, num_prompts=per_rank, response_len=length, nproc=2),
        ]
        if quick:
            return points
        return [*points, Point("ranks/independent", 1, **one), Point("ranks/independent", 2, **one, copies=2)]
    if axis == "turns":
        per_turn = TURN_TOKENS + len(OBSERVATION)
        return [
            Point("turns", t, num_prompts=8, response_len=t * per_turn, turns=t)
            for t in ((1, 2) if quick else (1, 2, 4, 8))
        ]
    if axis == "sp":
        return [
            Point("sp", r, num_prompts=2 if quick else 4, response_len=r, nproc=2, sp=2)
            for r in ((16, 32) if quick else (128, 256, 512))
        ]
    raise ValueError(f"unknown axis {axis!r}; expected one of {', '.join(AXES)}")


def write_assets(folder: Path, args: argparse.Namespace) -> dict[str, Path]:
    """The policy (also the critic's backbone), the ``turns`` axis's rigged policy, and a prompt Parquet."""
    from transformers import AutoModelForCausalLM

    from ppo_bench.runs import repo_script

    make_tiny_assets = repo_script("make_tiny_assets")
    tokenizer = make_tiny_assets.build_tokenizer()
    config = tiny_llama_config(tokenizer, args.hidden, args.layers, max_positions=2048)
    paths = {"policy": folder / "policy", "forced": folder / "forced", "prompts": folder / "prompts.parquet"}
    for name in ("policy", "forced"):
        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_config(config)
        if name == "forced":
            rig_forced_token(model, tokenizer.convert_tokens_to_ids(FORCED_CHAR))
        save_model(model, tokenizer, paths[name])
    write_prompts(paths["prompts"], 2048, args.seed)
    return paths


def overrides(
    point: Point, paths: dict[str, Path], out_dir: Path, args: argparse.Namespace, steps: int | None = None
) -> list[str]:
    """train_ppo's command line for ``point`` (``steps``: ``--steps`` unless given)."""
    budget = 1 << 20  # every rank's batch in one micro-batch
    settings = [
        f"data.max_prompt_length={PROMPT_LEN}",
        f"data.max_response_length={point.response_len}",
        f"data.train_batch_size={point.num_prompts}",
        f"rollout.n={point.n}",
        f"rollout.micro_batch_size_per_gpu={point.num_prompts * point.n}",
        f"actor.ppo_mini_batch_size={point.num_prompts}",
        "actor.ppo_epochs=1",
        f"actor.ppo_max_token_len_per_gpu={budget}",
        f"critic.ppo_max_token_len_per_gpu={budget}",
        "actor.optim.lr=1e-6",
        "critic.optim.lr=1e-6",
        "algorithm.adv_estimator=gae",
        "algorithm.use_kl_in_reward=true",  # the reference's forward is part of the step
    ]
    cmd = run_overrides(
        model=paths["forced" if point.turns else "policy"],
        prompts=paths["prompts"],
        out_dir=out_dir,
        steps=steps or args.steps,
        seed=args.seed,
        logger="[jsonl]",
        settings=settings,
    )
    if point.turns:
        cmd += [
            "rollout.multi_turn.enable=true",
            f"rollout.multi_turn.env={FIXED_ANSWER}",
            f"rollout.multi_turn.stop=[{FORCED_CHAR * TURN_TOKENS}]",
            f"rollout.multi_turn.max_assistant_turns={point.turns}",
        ]
    else:
        cmd.append("rollout.ignore_eos=true")
    if point.sp > 1:
        cmd.append(f"actor.ulysses_sequence_parallel_size={point.sp}")
    return cmd


def run_point(
    point: Point, paths: dict[str, Path], out_dir: Path, args: argparse.Namespace
) -> list[list[dict]]:
    """``train_ppo.py`` for ``point`` in a fresh process (torchrun for 2 ranks; ``copies`` processes started
    together for ``ranks/independent``): each process's ``metrics.jsonl`` lines (one list for torchrun, whose
    timings are rank 0's). Of independent processes only the steps that ran entirely while every other
    process was in its training loop are kept (``overlapping_steps``)."""
    launch = torchrun_command(point.nproc) if point.nproc > 1 else [sys.executable]
    env = run_env(args.threads)
    dirs = [out_dir] if point.copies == 1 else [out_dir / f"process_{i}" for i in range(point.copies)]
    steps = args.steps + (
        (QUICK_PAIR_EXTRA_STEPS if args.quick else PAIR_EXTRA_STEPS) if point.copies > 1 else 0
    )
    procs = []
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        script = [str(ROOT / "train_ppo.py"), *overrides(point, paths, d, args, steps=steps)]
        with open(d / "stdout.txt", "w") as out, open(d / "stderr.txt", "w") as err:
            procs.append(subprocess.Popen([*launch, *script], stdout=out, stderr=err, env=env, cwd=ROOT))
    ends = watch_step_ends(procs, [d / "metrics.jsonl" for d in dirs])
    for proc, d in zip(procs, dirs, strict=True):
        if proc.wait() != 0:
            for other in procs:
                other.kill()
            raise RuntimeError(
                f"{point} failed ({proc.returncode}):\n{(d / 'stderr.txt').read_text()[-4000:]}"
            )
    runs = [read_metrics(d) for d in dirs]
    for run, process_ends in zip(runs, ends, strict=True):
        clocks = step_clocks(process_ends)
        for m in run:  # CPU per rank: a torchrun tree's is its ranks' and its agent's (next to none)
            cpu, wait = clocks.get(m["step"], (None, None))
            m["bench/cpu_s"] = None if cpu is None else cpu / point.nproc
            m["bench/wait_s"] = wait  # the machine's, not the process's
    if point.copies > 1:
        walls = [[e.wall_s for e in process_ends for _ in range(e.lines)] for process_ends in ends]
        kept = overlapping_steps(walls)
        if not all(k - set(range(args.warmup + 1)) for k in kept):
            raise RuntimeError(
                f"{point}: no counted step of every process ran while the others trained (start-ups too far "
                f"apart for {steps} steps); the steps' ends: {walls}"
            )
        runs = [[m for m in run if m["step"] in keep] for run, keep in zip(runs, kept, strict=True)]
    return runs


PAIR_EXTRA_STEPS = 6
"""Steps added to each independent process of ``ranks/independent``: their start-ups end up to a few
hundred milliseconds apart, so the first and last steps of one may run while the other is not training;
those are dropped (``overlapping_steps``) and the extra steps leave enough that overlap."""
QUICK_PAIR_EXTRA_STEPS = 40
"""The same for ``--quick``, whose steps take tens of milliseconds: 40 of them span the start-ups' spread."""


def summarize(point: Point, metrics: list[dict], warmup: int) -> dict[str, Any]:
    """One row of the table from a run's per-step metrics (medians over steps after ``warmup``)."""
    counted = [m for m in metrics if m["step"] > warmup]
    if not counted:
        raise ValueError(f"{point}: no step after the {warmup} warm-up step(s)")
    phases = sorted({k[len("timing_s/") :] for m in counted for k in m if k.startswith("timing_s/")})
    med = {p: statistics.median(m.get(f"timing_s/{p}", 0.0) for m in counted) for p in phases}
    tokens = statistics.median(m["perf/total_num_tokens"] for m in counted)
    groups = {g: sum(med.get(p, 0.0) for p in names) for g, names in PHASE_GROUPS.items()}
    step = med["step"]
    tokens_per_rank = tokens / point.nproc  # SP: each rank of a group holds 1/sp of every sequence
    clocks = {
        name: [m[f"bench/{name}"] for m in counted if m.get(f"bench/{name}") is not None]
        for name in ("cpu_s", "wait_s")
    }
    return {
        "series": point.series,
        "x": point.x,
        "tokens": tokens,
        "work": float(point.x) if point.series.startswith("ranks/") else tokens_per_rank,
        "step_s": step,
        "gen_s": groups["gen"],
        "score_s": groups["score"],
        "train_s": groups["train"],
        "other_s": step - sum(groups.values()),
        "cpu_s": statistics.median(clocks["cpu_s"]) if clocks["cpu_s"] else None,
        "wait_s": statistics.median(clocks["wait_s"]) if clocks["wait_s"] else None,
        "gen_ms_per_token": 1000 * groups["gen"] / point.response_len,
        "tokens_per_s": tokens / step,
        "mem_gib": max(m["perf/max_memory_gib"] for m in counted),
        # The mean response length, to check that the point did the work it set (ignore_eos, exact turns).
        "response_tokens": statistics.median(m["response_length/mean"] for m in counted),
        "steps": len(counted),
        "point": dataclasses.asdict(point),
        "timing_s": med,
    }


def combine(rows: list[dict]) -> dict[str, Any]:
    """One row for processes that ran at once, from each one's row: the mean of their times (every phase,
    ``gen_ms_per_token``), their tokens and throughputs summed, the largest memory; each process's own row
    under ``processes``. A single row is returned as it is."""
    if len(rows) == 1:
        return rows[0]
    out = dict(rows[0])
    for column in ("step_s", "gen_s", "score_s", "train_s", "other_s", "gen_ms_per_token", "response_tokens"):
        out[column] = statistics.fmean(r[column] for r in rows)
    for column in ("cpu_s", "wait_s"):
        values = [r[column] for r in rows if r.get(column) is not None]
        out[column] = statistics.fmean(values) if values else None
    out["timing_s"] = {
        p: statistics.fmean(r["timing_s"].get(p, 0.0) for r in rows) for p in rows[0]["timing_s"]
    }
    out["tokens"] = sum(r["tokens"] for r in rows)
    out["tokens_per_s"] = sum(r["tokens_per_s"] for r in rows)
    out["mem_gib"] = max(r["mem_gib"] for r in rows)
    out["steps"] = min(r["steps"] for r in rows)
    out["processes"] = [{k: v for k, v in r.items() if k != "point"} for r in rows]
    return out


TABLE_COLUMNS = [
    "series", "x", "tokens", "work", "step_s", "gen_s", "score_s", "train_s", "other_s", "cpu_s", "wait_s",
    "gen_ms_per_token", "tokens_per_s", "mem_gib",
]  # fmt: skip


def fits(rows: list[dict]) -> list[dict]:
    """Per series: the exponent ``k`` of each phase group and of memory against ``work``, and memory's
    straight-line slope (MiB per 1000 tokens per rank)."""
    out = []
    for series in dict.fromkeys(r["series"] for r in rows):
        sel = [r for r in rows if r["series"] == series]
        work = [r["work"] for r in sel]
        if len(set(work)) < 2:
            continue
        fit: dict[str, Any] = {"series": series}
        for name in FITTED:
            values = [r["mem_gib" if name == "mem" else f"{name}_s"] for r in sel]
            fit[f"{name}_k"] = fit_exponent(work, values)[0] if min(values) > 0 else None
        slope = fit_line(work, [r["mem_gib"] for r in sel])
        fit["mem_mib_per_ktok"] = None if series.startswith("ranks/") else slope * 1024 * 1000
        out.append(fit)
    return out


FIT_COLUMNS = ["series", *(f"{n}_k" for n in FITTED), "mem_mib_per_ktok"]


def print_report(
    rows: list[dict], fitted: list[dict], as_json: bool, turn_profile: list[dict] | None = None
) -> None:
    """The points, the exponents, each independent process's row and the turns profile: tables, or one
    JSON object per line (``kind``: point | fit | turn_profile | turn_model)."""
    model = turn_cost_model(turn_profile) if turn_profile else None
    if as_json:
        print_json_lines(rows, "point")
        print_json_lines(fitted, "fit")
        if model is not None:
            print_json_lines(with_model(turn_profile, model), "turn_profile")
            print_json_lines([model], "turn_model")
        return
    print_table(rows, TABLE_COLUMNS)
    print()
    print("exponents k of time = c * work^k (least squares on log-log; work = tokens per rank, or ranks)")
    print_table(fitted, FIT_COLUMNS)
    each = [
        {**proc, "series": f"{r['series']} #{i}", "x": r["x"]}
        for r in rows
        for i, proc in enumerate(r.get("processes", []))
    ]
    if each:
        print()
        print("independent processes run together, each one's row (the table above holds their mean)")
        print_table(each, TABLE_COLUMNS)
    if model is not None:
        print()
        print(
            "turns: where the rollout's CPU time goes (in this process, the trainer's sampler, the median run)"
        )
        print_table(with_model(turn_profile, model), TURN_COLUMNS)
        print(
            "cost model: "
            + ", ".join(f"{k} {v:.4g}" for k, v in model.items())
            + " (model_s = prefill tokens x prefill cost + decoding steps x step cost + calls x call cost)"
        )


def plot(rows: list[dict], fitted: list[dict], path: Path) -> None:
    """One log-log panel per series: each phase group's seconds (and memory, right axis) against work."""
    plt = pyplot()
    series = list(dict.fromkeys(r["series"] for r in rows))
    cols = min(3, len(series))
    nrows = math.ceil(len(series) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.8 * cols, 3.8 * nrows), squeeze=False)
    by_series = {f["series"]: f for f in fitted}
    for ax, name in zip(axes.flat, series, strict=False):
        sel = [r for r in rows if r["series"] == name]
        work = [r["work"] for r in sel]
        fit = by_series.get(name, {})
        for group in ("step", "gen", "score", "train"):
            k = fit.get(f"{group}_k")
            label = group + (f" (k={k:.2f})" if k is not None else "")
            ax.plot(work, [max(r[f"{group}_s"], 1e-6) for r in sel], marker="o", label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(name)
        ax.set_xlabel("ranks" if name.startswith("ranks/") else "tokens per rank per step")
        ax.set_ylabel("seconds per step")
        ax.legend(fontsize=7, loc="upper left")
        mem = ax.twinx()
        mem.plot(work, [r["mem_gib"] for r in sel], color="gray", linestyle="--", marker="x")
        mem.set_ylabel("peak memory (GiB, dashed)", color="gray")
    for ax in list(axes.flat)[len(series) :]:
        ax.axis("off")
    save_figure(fig, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--axes", default=",".join(AXES), help=f"comma-separated, of {', '.join(AXES)}")
    parser.add_argument("--quick", action="store_true", help="tiny points: a seconds-long smoke run per axis")
    parser.add_argument("--steps", type=int, default=None, help="steps per point (default 3; --quick 2)")
    parser.add_argument("--warmup", type=int, default=1, help="first steps of a point not counted")
    add_tiny_model_args(parser)
    add_common_args(
        parser, threads_help="torch CPU threads per rank", json_help="one JSON object per point and per fit"
    )
    parser.add_argument("--png", type=Path, default=None, help="write the log-log curves here")
    parser.add_argument(
        "--assets",
        type=Path,
        default=None,
        help="write the models and prompts here and keep them (policy, forced)",
    )
    args = parser.parse_args(argv)
    args.axes = [a.strip() for a in args.axes.split(",") if a.strip()]
    unknown = [a for a in args.axes if a not in AXES]
    if unknown or not args.axes:
        parser.error(f"--axes: unknown {unknown}; expected some of {', '.join(AXES)}")
    if args.steps is None:
        args.steps = 2 if args.quick else 3
    if args.steps <= args.warmup:
        parser.error("--steps must be larger than --warmup")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = []
    turn_profile = None
    with tempfile.TemporaryDirectory(prefix="scaling_") as tmp:
        folder = Path(tmp)
        if args.assets is not None:
            args.assets.mkdir(parents=True, exist_ok=True)
        paths = write_assets(args.assets or folder, args)
        done: dict[Point, dict] = {}
        for axis in args.axes:
            for point in axis_points(axis, args.quick):
                # Points with the same settings run once (the fixed point of several axes; the 1-rank point of
                # ranks/weak and ranks/strong).
                key = dataclasses.replace(point, series="", x=0)
                if key not in done:
                    out_dir = folder / f"run_{len(done)}"
                    runs = run_point(point, paths, out_dir, args)
                    done[key] = combine([summarize(point, m, args.warmup) for m in runs])
                rows.append(
                    {**done[key], "series": point.series, "x": point.x, "point": dataclasses.asdict(point)}
                )
                if point.series.startswith("ranks/"):
                    rows[-1]["work"] = float(point.x)
        if "turns" in args.axes:
            turns = [p.x for p in axis_points("turns", args.quick)]
            turn_profile = profile_turns(paths, turns, threads=args.threads, max_prompt_length=PROMPT_LEN)
    fitted = fits(rows)
    print_report(rows, fitted, args.json, turn_profile)
    if args.png is not None:
        plot(rows, fitted, args.png)
        print(f"wrote {args.png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
