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
- ``ranks``: 1 -> 2 ranks (gloo, one thread each), two series: ``ranks/weak`` (the same work per rank:
  16 prompts per rank) and ``ranks/strong`` (the same total work: 16 prompts in all).
- ``turns``: multi-turn rollouts, 1 -> 8 turns (``rollout.multi_turn``) of ``TURN_TOKENS`` generated
  tokens, each answered by ``FixedAnswer`` (below) with ``OBSERVATION``. The turns are exact: the policy
  of this axis is rigged to always write the character ``FORCED_CHAR`` (``rig_forced_token``), and the
  stop string is ``TURN_TOKENS`` of them.
- ``sp``: tokens per rank under Ulysses sequence parallelism (``actor.ulysses_sequence_parallel_size=2``,
  2 ranks, one group): 4 prompts of 128 -> 512 response tokens, each rank holding half of every sequence.

Columns, per point (medians over the counted steps): ``series``, ``x`` (the knob: response tokens,
prompts, n, ranks, turns, or response tokens under SP), ``tokens`` (prompt + response tokens per step,
``perf/total_num_tokens``), ``work`` (what the exponent is fitted against: tokens per rank per step, or
the number of ranks on the ranks axis), ``step_s``, ``gen_s``, ``score_s`` (reference + values, and old
log-probs where the trainer computes them: not with one epoch of one mini-batch, where they are the
update's own), ``train_s`` (critic + actor updates), ``other_s`` (the rest of the step: reward, advantages,
packing, metrics), ``gen_ms_per_token`` (generation time per decoded position: ``gen_s`` over the response tokens of
one sequence), ``tokens_per_s`` (all ranks), ``mem_gib``
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
- ``turns``: each turn re-reads the trajectory so far as a prompt (a prefill of the prefix), so
  generation grows faster than the tokens when turns are many; ``other_s`` holds the environment calls.
- memory: ``mem_k`` (log-log) is small on CPU because of the constant baseline; ``mem_mib_per_ktok`` is
  the slope of a straight-line fit (MiB per 1000 tokens per rank), which is what grows with the tokens
  of a micro-batch (activations, logits).

The default run (all axes, 18 trainer runs of 3 steps: a few seconds of start-up each, the longest
point 1024 decoding steps) takes about 4 minutes on 2 quiet CPU cores; ``--quick`` is a smoke run of
tiny points (seconds of work per point, mostly start-up).

Run:
    .venv/bin/python scripts/bench_scaling.py --png outputs/scaling.png           # table + figure
    .venv/bin/python scripts/bench_scaling.py --axes response_len,ranks --json    # machine-readable
    .venv/bin/python scripts/bench_scaling.py --quick --axes batch                # smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import print_table, tiny_llama_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
AXES = ("response_len", "batch", "n", "ranks", "turns", "sp")
PHASE_GROUPS = {
    "gen": ("gen",),
    "score": ("old_log_prob", "ref", "values"),
    "train": ("update_critic", "update_actor"),
}
"""The trainer's ``timing_s/*`` phases summed into the groups whose exponents are fitted."""
FITTED = ("step", "gen", "score", "train", "mem")
TURN_TOKENS = 8
"""Generated tokens per turn on the ``turns`` axis (the stop string is this many ``FORCED_CHAR``)."""
FORCED_CHAR = "a"
OBSERVATION = "<r>0</r>"
"""The environment's answer to every turn (8 characters: 8 tokens of the character tokenizer)."""
PROMPT_LEN = 32
"""``data.max_prompt_length`` (the arithmetic prompts are shorter)."""


class FixedAnswer:
    """The ``turns`` axis's environment: answers every turn with ``OBSERVATION`` and never ends a
    trajectory, so each has exactly ``rollout.multi_turn.max_assistant_turns`` turns."""

    def reset(self, row: dict[str, Any]) -> None:
        return None

    def step(self, action_text: str) -> tuple[str, float, bool]:
        return OBSERVATION, 0.0, False


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


def axis_points(axis: str, quick: bool = False) -> list[Point]:
    """The points of ``axis`` (geometric steps; ``quick``: two tiny ones, or three for ``ranks``)."""
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
        return [
            Point("ranks/weak", 1, **one),
            Point("ranks/weak", 2, num_prompts=2 * per_rank, response_len=length, nproc=2),
            Point("ranks/strong", 1, **one),
            Point("ranks/strong", 2, num_prompts=per_rank, response_len=length, nproc=2),
        ]
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


def fit_exponent(work: list[float], values: list[float]) -> tuple[float, float]:
    """``(k, c)`` of ``value = c * work^k``, least squares on ``log value = log c + k log work``.

    ``k = cov(log w, log v) / var(log w)``; needs two distinct positive ``work`` values and positive
    ``values``.
    """
    if len(work) != len(values) or len(set(work)) < 2:
        raise ValueError("fit_exponent needs two or more distinct work values, one value each")
    if min(work) <= 0 or min(values) <= 0:
        raise ValueError("fit_exponent needs positive work and values (a log-log fit)")
    lx = [math.log(w) for w in work]
    ly = [math.log(v) for v in values]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    k = sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / sum((a - mx) ** 2 for a in lx)
    return k, math.exp(my - k * mx)


def fit_line(work: list[float], values: list[float]) -> float:
    """The slope ``b`` of ``value = a + b * work`` (least squares)."""
    mx, my = statistics.fmean(work), statistics.fmean(values)
    return sum((a - mx) * (b - my) for a, b in zip(work, values, strict=True)) / sum(
        (a - mx) ** 2 for a in work
    )


def write_assets(folder: Path, args: argparse.Namespace) -> dict[str, Path]:
    """The policy (also the critic's backbone), the ``turns`` axis's rigged policy, and a prompt Parquet."""
    import make_tiny_assets
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM

    tokenizer = make_tiny_assets.build_tokenizer()
    config = tiny_llama_config(tokenizer, args.hidden, args.layers, max_positions=2048)
    paths = {"policy": folder / "policy", "forced": folder / "forced", "prompts": folder / "prompts.parquet"}
    for name in ("policy", "forced"):
        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_config(config)
        if name == "forced":
            rig_forced_token(model, tokenizer.convert_tokens_to_ids(FORCED_CHAR))
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    problems, _ = make_tiny_assets.split_problems(args.seed)
    rows = make_tiny_assets.prompt_rows(problems[:2048], "train")
    pq.write_table(pa.Table.from_pylist(rows), paths["prompts"])
    return paths


@torch.no_grad()
def rig_forced_token(model: torch.nn.Module, token_id: int) -> None:
    """Make a Llama write ``token_id`` after any input: hidden dimension 0 of the residual stream is a
    constant 50 (every embedding's, and no layer writes to it), so after the final RMSNorm it is about
    ``sqrt(hidden)``, and only ``token_id``'s output row reads it (weight 4): a logit about
    ``4 sqrt(hidden)`` above the others, whose rows read nothing from it."""
    model.model.embed_tokens.weight[:, 0] = 50.0
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight[0].zero_()
        layer.mlp.down_proj.weight[0].zero_()
    model.lm_head.weight[:, 0] = 0.0
    model.lm_head.weight[token_id, 0] = 4.0


def overrides(point: Point, paths: dict[str, Path], out_dir: Path, args: argparse.Namespace) -> list[str]:
    """train_ppo's command line for ``point``."""
    budget = 1 << 20  # every rank's batch in one micro-batch
    cmd = [
        f"model.path={paths['forced' if point.turns else 'policy']}",
        f"data.train_files=[{paths['prompts']}]",
        "data.val_files=[]",
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
        f"trainer.total_training_steps={args.steps}",
        "trainer.logger=[jsonl]",
        "trainer.val_before_train=false",
        "trainer.resume_mode=disable",
        "trainer.save_freq=-1",
        f"trainer.seed={args.seed}",
        f"trainer.output_dir={out_dir}",
    ]
    if point.turns:
        cmd += [
            "rollout.multi_turn.enable=true",
            f"rollout.multi_turn.env={Path(__file__).resolve()}:FixedAnswer",
            f"rollout.multi_turn.stop=[{FORCED_CHAR * TURN_TOKENS}]",
            f"rollout.multi_turn.max_assistant_turns={point.turns}",
        ]
    else:
        cmd.append("rollout.ignore_eos=true")
    if point.sp > 1:
        cmd.append(f"actor.ulysses_sequence_parallel_size={point.sp}")
    return cmd


def run_point(point: Point, paths: dict[str, Path], out_dir: Path, args: argparse.Namespace) -> list[dict]:
    """``train_ppo.py`` for ``point`` in a fresh process (torchrun for 2 ranks); its ``metrics.jsonl``."""
    script = [str(ROOT / "train_ppo.py"), *overrides(point, paths, out_dir, args)]
    if point.nproc > 1:
        launch = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={point.nproc}",
        ]
    else:
        launch = [sys.executable]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([*launch, *script], capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{point} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


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
        "gen_ms_per_token": 1000 * groups["gen"] / point.response_len,
        "tokens_per_s": tokens / step,
        "mem_gib": max(m["perf/max_memory_gib"] for m in counted),
        # The mean response length, to check that the point did the work it set (ignore_eos, exact turns).
        "response_tokens": statistics.median(m["response_length/mean"] for m in counted),
        "steps": len(counted),
        "point": dataclasses.asdict(point),
        "timing_s": med,
    }


TABLE_COLUMNS = [
    "series", "x", "tokens", "work", "step_s", "gen_s", "score_s", "train_s", "other_s",
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


def print_report(rows: list[dict], fitted: list[dict], as_json: bool) -> None:
    """The points and the exponents: two tables, or one JSON object per line (``kind``: point | fit)."""
    if as_json:
        for r in rows:
            print(json.dumps({"kind": "point", **r}))
        for f in fitted:
            print(json.dumps({"kind": "fit", **f}))
        return
    print_table(rows, TABLE_COLUMNS)
    print()
    print("exponents k of time = c * work^k (least squares on log-log; work = tokens per rank, or ranks)")
    print_table(fitted, FIT_COLUMNS)


def plot(rows: list[dict], fitted: list[dict], path: Path) -> None:
    """One log-log panel per series: each phase group's seconds (and memory, right axis) against work."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--axes", default=",".join(AXES), help=f"comma-separated, of {', '.join(AXES)}")
    parser.add_argument("--quick", action="store_true", help="tiny points: a seconds-long smoke run per axis")
    parser.add_argument("--steps", type=int, default=None, help="steps per point (default 3; --quick 2)")
    parser.add_argument("--warmup", type=int, default=1, help="first steps of a point not counted")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the Llama")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size (MLP: 4x)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="one JSON object per point and per fit")
    parser.add_argument("--png", type=Path, default=None, help="write the log-log curves here")
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
    with tempfile.TemporaryDirectory(prefix="bench_scaling_") as tmp:
        folder = Path(tmp)
        paths = write_assets(folder, args)
        done: dict[Point, dict] = {}
        for axis in args.axes:
            for point in axis_points(axis, args.quick):
                # Points with the same settings run once (the fixed point of several axes; the 1-rank point of
                # ranks/weak and ranks/strong).
                key = dataclasses.replace(point, series="", x=0)
                if key not in done:
                    out_dir = folder / f"run_{len(done)}"
                    done[key] = summarize(point, run_point(point, paths, out_dir, args), args.warmup)
                rows.append(
                    {**done[key], "series": point.series, "x": point.x, "point": dataclasses.asdict(point)}
                )
                if point.series.startswith("ranks/"):
                    rows[-1]["work"] = float(point.x)
    fitted = fits(rows)
    print_report(rows, fitted, args.json)
    if args.png is not None:
        plot(rows, fitted, args.png)
        print(f"wrote {args.png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
