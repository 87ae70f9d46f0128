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
- ``turns``: multi-turn rollouts, 1 -> 8 turns (``rollout.multi_turn``) of ``TURN_TOKENS`` generated
  tokens, each answered by ``FixedAnswer`` (below) with ``OBSERVATION``. The turns are exact: the policy
  of this axis is rigged to always write the character ``FORCED_CHAR`` (``rig_forced_token``), and the
  stop string is ``TURN_TOKENS`` of them. Each turn is one ``generate`` call whose prompt is the whole
  trajectory so far (``ppo.multi_turn.run_turns``), so its first forward prefills the prompt and every
  earlier turn and observation again: ``turn_work`` counts the prefill tokens (quadratic in the turns) and
  decoding steps (linear) by arithmetic, and ``profile_turns`` times them, in this process, on the
  trainer's sampler under forward hooks (``ForwardClock``, CPU time; its counts must equal the
  arithmetic). ``turn_cost_model`` turns that into CPU seconds per prefill token, per decoding step and per
  ``generate`` call (everything else), printed with each point's modelled seconds (``model_s``) and the
  exponents of the rollout with and without its prefill.
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
- ``turns``: each turn re-reads the trajectory so far as a prompt (a prefill of the prefix), so
  generation grows faster than the tokens when turns are many (``gen_s`` also holds the environment's
  calls); the profile below the tables splits it into prefill, decoding and the rest, and
  ``without_prefill_k ~ 1`` says the prefill is the whole excess.
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
    .venv/bin/python scripts/bench_scaling.py --png outputs/scaling.png           # table + figure
    .venv/bin/python scripts/bench_scaling.py --axes response_len,ranks --json    # machine-readable
    .venv/bin/python scripts/bench_scaling.py --quick --axes batch                # smoke run
    .venv/bin/python scripts/bench_scaling.py --turns-preset configs/demo_cpu_tools.yaml  # a preset's turns

``--turns-preset`` runs only ``profile_preset``: a multi-turn preset's rollout on one rank (its share of
the prompts, its model, sampler and environment) under forward hooks, each ``generate`` call's rows, padded
width, prefill seconds and decoding steps and seconds: what re-reading earlier turns costs at its sizes.
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
import time
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


def turn_work(prompt_lens: list[int], turns: int) -> dict[str, int]:
    """What generation does on the ``turns`` axis, by arithmetic: turn ``t`` (0-based) is one ``generate``
    call on every row's prompt and its ``t`` earlier turns (``TURN_TOKENS`` generated + ``OBSERVATION``'s
    tokens each), left-padded to the widest row; its first forward (the prefill) reads all of them and
    writes the first token, then ``TURN_TOKENS - 1`` decoding forwards of one token per row follow.

    Returns ``generate_calls``, ``prefill_tokens`` (rows x padded width, summed over turns: quadratic in
    ``turns``), ``decode_steps`` (linear) and ``generated_tokens``."""
    rows, width, per_turn = len(prompt_lens), max(prompt_lens), TURN_TOKENS + len(OBSERVATION)
    return {
        "generate_calls": turns,
        "prefill_tokens": sum(rows * (width + t * per_turn) for t in range(turns)),
        "decode_steps": turns * (TURN_TOKENS - 1),
        "generated_tokens": rows * turns * TURN_TOKENS,
    }


class ForwardClock:
    """Forward hooks on a model that sort its forwards into prefills (more than one new token per row: the
    first forward of a ``generate`` call) and decoding steps (one), with their CPU seconds and tokens."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.prefill_s = self.decode_s = 0.0
        self.prefill_tokens = self.decode_steps = 0
        self._start = 0.0
        self._shape: tuple[int, ...] = ()
        self._handles = [
            model.register_forward_pre_hook(self._pre, with_kwargs=True),
            model.register_forward_hook(self._post, with_kwargs=True),
        ]

    def _pre(self, _module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._shape = tuple(ids.shape)
        self._start = time.process_time()

    def _post(self, _module: torch.nn.Module, _args: tuple, _kwargs: dict[str, Any], _out: Any) -> None:
        seconds = time.process_time() - self._start
        rows, new = self._shape
        if new > 1:
            self.prefill_s += seconds
            self.prefill_tokens += rows * new
        else:
            self.decode_s += seconds
            self.decode_steps += 1

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def profile_turns(paths: dict[str, Path], args: argparse.Namespace, turns: list[int]) -> list[dict]:
    """Where generation goes on the ``turns`` axis, in this process: the trainer's sampler
    (``ppo.rollout.sample`` with the same multi-turn settings, model, prompts and one torch thread) runs
    each point's rollout ``TURN_REPEATS`` times under a ``ForwardClock``; the run of median CPU time. Per
    point: ``turn_work``'s counts (and the clock's, which must equal them), ``gen_cpu_s`` (the whole
    rollout), ``prefill_s`` and ``decode_s`` (the model's forwards) and ``rest_s`` (the rest: ``generate``'s
    per-step machinery, stop strings, the turn loop and the environment)."""
    from transformers import AutoTokenizer

    from ppo import data, models, multi_turn, rollout
    from ppo.attention import PACKED_ATTENTION
    from ppo.config.sections import MultiTurnConfig, RolloutConfig

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(paths["forced"])
    model = models.load_causal_lm(str(paths["forced"]), attn_implementation=PACKED_ATTENTION).train()
    records = data.load_prompts(
        paths["prompts"], tokenizer, max_prompt_length=PROMPT_LEN, require_ground_truth=False
    )
    records = records[:TURN_PROFILE_PROMPTS]
    per_turn = TURN_TOKENS + len(OBSERVATION)
    out = []
    try:
        for t in turns:
            mt = MultiTurnConfig(
                enable=True,
                env=f"{Path(__file__).resolve()}:FixedAnswer",
                stop=[FORCED_CHAR * TURN_TOKENS],
                max_assistant_turns=t,
            )
            sampler = rollout.Sampler(
                actor=model,
                engine=None,
                settings=RolloutConfig(
                    n=1, micro_batch_size_per_gpu=len(records), compile=False, multi_turn=mt
                ),
                max_response_length=t * per_turn,
                eos_ids=[tokenizer.eos_token_id],
                pad_token_id=tokenizer.pad_token_id,
                multi_turn=multi_turn.make_settings(mt, tokenizer, t * per_turn),
            )
            samples = []
            for _ in range(TURN_REPEATS):
                clock = ForwardClock(model)
                start = time.process_time()
                result = rollout.sample(sampler, records, do_sample=True)
                total = time.process_time() - start
                clock.remove()
                generated = int(result.loss_mask.sum())
                samples.append((total, clock, generated))
            work = turn_work([len(r.input_ids) for r in records], t)
            total, clock, generated = sorted(samples, key=lambda x: x[0])[len(samples) // 2]  # the median run
            counted = {
                "prefill_tokens": clock.prefill_tokens,
                "decode_steps": clock.decode_steps,
                "generated_tokens": generated,
            }
            med = {
                "gen_cpu_s": total,
                "prefill_s": clock.prefill_s,
                "decode_s": clock.decode_s,
                "rest_s": total - clock.prefill_s - clock.decode_s,
            }
            if any(counted[k] != work[k] for k in counted):
                raise RuntimeError(f"turns={t}: the forwards counted {counted}, the arithmetic says {work}")
            out.append({"turns": t, **work, **med})
    finally:
        torch.set_num_threads(threads)
    return out


class CallClock(ForwardClock):
    """A ``ForwardClock`` that also keeps each ``generate`` call's prefill (rows, width, seconds) and its
    decoding steps and seconds."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.calls: list[dict[str, float]] = []

    def _post(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], out: Any) -> None:
        prefill_s, decode_s = self.prefill_s, self.decode_s
        super()._post(module, args, kwargs, out)
        rows, new = self._shape
        if new > 1:
            self.calls.append({"rows": rows, "width": new, "prefill_s": self.prefill_s - prefill_s,
                               "decode_steps": 0, "decode_s": 0.0})  # fmt: skip
        else:
            self.calls[-1]["decode_steps"] += 1
            self.calls[-1]["decode_s"] += self.decode_s - decode_s


def profile_preset(config: Path, ranks: int, repeats: int = 3) -> list[dict]:
    """A multi-turn preset's rollout on one rank, in this process (one torch thread): its model, its first
    ``data.train_batch_size / ranks`` prompts x ``rollout.n``, its sampler settings and environment, run by
    ``rollout.sample`` ``repeats`` times under a ``CallClock``: per rollout its CPU seconds, the turn
    counts, and each ``generate`` call's prefill and decoding (the preset's paths must exist, e.g. after
    ``make assets``)."""
    from transformers import AutoTokenizer

    from ppo import data, models, multi_turn, rollout
    from ppo.attention import PACKED_ATTENTION
    from ppo.config_loader import load_config

    cfg = load_config(config)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    model = models.load_causal_lm(cfg.model.path, attn_implementation=PACKED_ATTENTION).train()
    prompts = data.load_prompts(
        cfg.data.train_files,
        tokenizer,
        max_prompt_length=cfg.data.max_prompt_length,
        require_ground_truth=False,
    )[: cfg.data.train_batch_size // ranks]
    records = [r for r in prompts for _ in range(cfg.rollout.n)]
    sampler = rollout.Sampler(
        actor=model,
        engine=None,
        settings=cfg.rollout,
        max_response_length=cfg.data.max_response_length,
        eos_ids=models.eos_token_ids(tokenizer, model),
        pad_token_id=tokenizer.pad_token_id,
        multi_turn=multi_turn.make_settings(cfg.rollout.multi_turn, tokenizer, cfg.data.max_response_length),
    )
    torch.manual_seed(0)
    out = []
    for _ in range(repeats):
        clock = CallClock(model)
        start = time.process_time()
        result = rollout.sample(sampler, records, do_sample=cfg.rollout.do_sample)
        total = time.process_time() - start
        clock.remove()
        out.append({
            "trajectories": len(records),
            "gen_cpu_s": total,
            "tool_calls_mean": float(result.turn_stats["tool_calls"].mean()),
            "calls": clock.calls,
        })  # fmt: skip
    return out


TURN_PROFILE_PROMPTS = 8
"""Rows of ``profile_turns`` (the ``turns`` axis's 8 prompts)."""
TURN_REPEATS = 3


def overrides(
    point: Point, paths: dict[str, Path], out_dir: Path, args: argparse.Namespace, steps: int | None = None
) -> list[str]:
    """train_ppo's command line for ``point`` (``steps``: ``--steps`` unless given)."""
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
        f"trainer.total_training_steps={steps or args.steps}",
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


def run_point(
    point: Point, paths: dict[str, Path], out_dir: Path, args: argparse.Namespace
) -> list[list[dict]]:
    """``train_ppo.py`` for ``point`` in a fresh process (torchrun for 2 ranks; ``copies`` processes started
    together for ``ranks/independent``): each process's ``metrics.jsonl`` lines (one list for torchrun, whose
    timings are rank 0's). Of independent processes only the steps that ran entirely while every other
    process was in its training loop are kept (``overlapping_steps``)."""
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
    runs = [[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in dirs]
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


@dataclasses.dataclass
class StepEnd:
    """When one step's line appeared in a process's ``metrics.jsonl``, and the CPU clocks of the process
    (with its children: a torchrun agent's ranks) at that moment."""

    wall_s: float
    """``time.perf_counter()``."""
    cpu_s: float | None
    """Seconds its threads have run on a core (``process_clocks``; None off Linux)."""
    wait_s: float | None
    """The machine's seconds so far during which some runnable task waited for a core."""
    lines: int
    """How many new lines this poll found (more than one: the steps' clocks cannot be told apart)."""


def process_clocks(pid: int) -> tuple[float, float] | tuple[None, None]:
    """(on-core seconds of ``pid``'s threads and of every process below it, from each thread's
    ``se.sum_exec_runtime`` in ``/proc/<pid>/task/<tid>/sched``; the machine's seconds during which some
    runnable task waited for a core, ``/proc/pressure/cpu``'s ``some total``), or (None, None) where the
    files are missing (not Linux, or the process is gone)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (name)": state, ppid, ...
        except (OSError, IndexError):
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    pids, cpu_ms, seen = [pid], 0.0, False
    while pids:
        current = pids.pop()
        pids += parents.get(current, [])
        tasks = Path(f"/proc/{current}/task")
        try:
            tids = [t.name for t in tasks.iterdir()]
        except OSError:
            continue
        for tid in tids:
            try:
                text = (tasks / tid / "sched").read_text()
            except OSError:
                continue  # a thread that ended between the listing and the read
            for line in text.splitlines():
                if line.startswith("se.sum_exec_runtime"):
                    cpu_ms, seen = cpu_ms + float(line.split(":")[1]), True
    try:
        pressure = Path("/proc/pressure/cpu").read_text().split("\n")[0]
        waited_us = int(pressure.rsplit("total=", 1)[1])
    except (OSError, IndexError, ValueError):
        return None, None
    return (cpu_ms / 1e3, waited_us / 1e6) if seen else (None, None)


def watch_step_ends(
    procs: list[subprocess.Popen], files: list[Path], poll_s: float = 0.01
) -> list[list[StepEnd]]:
    """Until every process has exited: for each process, each step's end as seen by polling its
    ``metrics.jsonl`` every ``poll_s`` (the trainer writes and flushes a line at the end of a step), with
    the process tree's CPU clocks read then (``process_clocks``; only when a line appeared, so the
    polling itself costs next to nothing)."""
    ends: list[list[StepEnd]] = [[] for _ in files]
    sizes = [0 for _ in files]

    def poll() -> None:
        for i, (proc, path) in enumerate(zip(procs, files, strict=True)):
            try:
                size = path.stat().st_size
            except OSError:
                continue
            if size == sizes[i]:
                continue
            sizes[i] = size
            lines = path.read_text().count("\n")
            new = lines - sum(e.lines for e in ends[i])
            if new > 0:
                cpu, wait = process_clocks(proc.pid)
                ends[i].append(StepEnd(time.perf_counter(), cpu, wait, new))

    while any(p.poll() is None for p in procs):
        poll()
        time.sleep(poll_s)
    poll()
    return ends


def step_clocks(ends: list[StepEnd]) -> dict[int, tuple[float, float]]:
    """Step number -> (CPU seconds of the process tree, the machine's waiting seconds) during that step, for the steps
    whose start and end were both seen on their own (a poll that found one new line after one that
    did); the first step's start is not seen."""
    out = {}
    step = 0
    for prev, end in zip([None, *ends], ends, strict=False):
        step += end.lines
        ok = prev is not None and end.lines == 1 and end.cpu_s is not None and prev.cpu_s is not None
        if ok:
            out[step] = (end.cpu_s - prev.cpu_s, end.wait_s - prev.wait_s)
    return out


def overlapping_steps(ends: list[list[float]]) -> list[set[int]]:
    """Per process, the steps (1-based) that ran while every other process was training: step ``s`` runs
    from step ``s - 1``'s end to its own (step 1 is never kept: its start is not seen), and is kept when
    that lies between every other process's first and last step ends. ``ends``: per process, the wall
    time of each step's end, in order."""
    kept = []
    for i, mine in enumerate(ends):
        others = [e for j, e in enumerate(ends) if j != i]
        lo = max((e[0] for e in others), default=-math.inf)
        hi = min((e[-1] for e in others), default=math.inf)
        kept.append({s + 1 for s in range(1, len(mine)) if mine[s - 1] >= lo and mine[s] <= hi})
    return kept


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


def turn_cost_model(profile: list[dict]) -> dict[str, Any]:
    """The cost model of multi-turn generation from ``profile_turns``'s points: CPU seconds per prefill
    token, per decoding step and per ``generate`` call (of everything else), each the ratio of its summed
    seconds to its summed count over the points, and the exponents ``k`` (against the generated tokens) of
    the whole rollout, of its prefill, and of the rollout without the prefill."""
    tokens = [float(p["generated_tokens"]) for p in profile]
    model: dict[str, Any] = {
        "prefill_ms_per_ktok": 1e6
        * sum(p["prefill_s"] for p in profile)
        / sum(p["prefill_tokens"] for p in profile),
        "decode_ms_per_step": 1e3
        * sum(p["decode_s"] for p in profile)
        / sum(p["decode_steps"] for p in profile),
        "rest_ms_per_call": 1e3
        * sum(p["rest_s"] for p in profile)
        / sum(p["generate_calls"] for p in profile),
    }
    if len(set(tokens)) > 1:
        model["gen_k"] = fit_exponent(tokens, [p["gen_cpu_s"] for p in profile])[0]
        model["prefill_k"] = fit_exponent(tokens, [p["prefill_s"] for p in profile])[0]
        model["without_prefill_k"] = fit_exponent(tokens, [p["gen_cpu_s"] - p["prefill_s"] for p in profile])[
            0
        ]
    return model


TURN_COLUMNS = [
    "turns", "generate_calls", "prefill_tokens", "decode_steps", "generated_tokens",
    "gen_cpu_s", "prefill_s", "decode_s", "rest_s", "model_s",
]  # fmt: skip


def with_model(profile: list[dict], model: dict[str, Any]) -> list[dict]:
    """``profile``'s points with ``model_s``, the cost model's CPU seconds for each."""
    return [
        {
            **p,
            "model_s": p["prefill_tokens"] * model["prefill_ms_per_ktok"] / 1e6
            + p["decode_steps"] * model["decode_ms_per_step"] / 1e3
            + p["generate_calls"] * model["rest_ms_per_call"] / 1e3,
        }
        for p in profile
    ]


def print_report(
    rows: list[dict], fitted: list[dict], as_json: bool, turn_profile: list[dict] | None = None
) -> None:
    """The points, the exponents, each independent process's row and the turns profile: tables, or one
    JSON object per line (``kind``: point | fit | turn_profile | turn_model)."""
    model = turn_cost_model(turn_profile) if turn_profile else None
    if as_json:
        for r in rows:
            print(json.dumps({"kind": "point", **r}))
        for f in fitted:
            print(json.dumps({"kind": "fit", **f}))
        if model is not None:
            for p in with_model(turn_profile, model):
                print(json.dumps({"kind": "turn_profile", **p}))
            print(json.dumps({"kind": "turn_model", **model}))
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
    parser.add_argument(
        "--turns-preset",
        type=Path,
        default=None,
        help="profile this multi-turn preset's rollout on one rank instead (e.g. configs/demo_cpu_tools.yaml)",
    )
    parser.add_argument("--preset-ranks", type=int, default=2, help="ranks the preset is sized for")
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
    if args.turns_preset is not None:
        torch.set_num_threads(args.threads)
        for i, run in enumerate(profile_preset(args.turns_preset, args.preset_ranks)):
            if args.json:
                print(json.dumps({"kind": "preset_rollout", **run}))
                continue
            print(
                f"rollout {i}: {run['trajectories']} trajectories, {run['gen_cpu_s']:.3f} CPU s, "
                f"{run['tool_calls_mean']:.2f} tool calls per trajectory"
            )
            print_table(run["calls"], ["rows", "width", "prefill_s", "decode_steps", "decode_s"])
        return 0
    rows = []
    turn_profile = None
    with tempfile.TemporaryDirectory(prefix="bench_scaling_") as tmp:
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
            turn_profile = profile_turns(paths, args, [p.x for p in axis_points("turns", args.quick)])
    fitted = fits(rows)
    print_report(rows, fitted, args.json, turn_profile)
    if args.png is not None:
        plot(rows, fitted, args.png)
        print(f"wrote {args.png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
