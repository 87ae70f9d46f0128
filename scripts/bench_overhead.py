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
time mostly measures the scheduler (see bench_rollout.py).

``--floor`` adds a second table, our step at its arithmetic floor: for each phase, the bare calls it
consists of on the same models and shapes, called directly with no trainer around them (plain
``transformers`` models, no FSDP; the ``--num-prompts`` prompts left-padded into one batch, responses of
``--response-len`` tokens): ``gen`` one ``generate``; ``old_log_prob`` and ``ref`` a forward and the
log-softmax gather of the response tokens; ``values`` the critic's forward; ``reward`` the reward model's;
``adv`` the k1 KL and GAE (``ppo.algorithms``); ``update_actor`` and ``update_critic`` ``--epochs`` x 2
mini-batches of forward, the loss, backward, gradient clipping and a fused AdamW step (the actor's loss as the
trainer's: log-probs and entropy from the logits with ``ppo_kernels.logprobs_from_logits``, the clipped
``policy_loss``, the entropy's mean; the critic's the squared values). Columns: ``phase``, ``trainer_s`` (the trainer's
median wall seconds, as above), ``floor_s`` (median wall seconds of ``--floor-reps`` repeats after each
of the ``--rounds`` runs of ours, each after one warm-up: the halves alternate, so that a machine whose
speed drifts serves both alike), ``gap_s`` and ``gap_pct`` (the trainer's time above the floor, in % of the trainer's): where
the rest of the step goes. The floor's padded batch holds a few % more tokens than the trainer's packed
rows (prompt padding), so a small negative gap is possible.

``--interleave`` measures the same table without whole runs: the trainer's own step functions
(``trainer_calls``: ``train_ppo.collect``, ``forwards.*``, ``score_responses``, ``compute_advantages``,
``update_critic``, ``update_actor`` on a Run built at world 1) and the bare calls alternate phase by
phase, each trainer call followed at once by its bare one, for ``--floor-reps`` steps after one not
counted; ``trainer_s`` is then the median of those calls. Runs minutes apart can differ by more than the
gap (the machine's speed drifts); calls a fraction of a second apart cannot.

Run:
    .venv/bin/python scripts/bench_overhead.py                       # ours only (TRL not installed)
    pip install --no-deps --target /tmp/trl trl==1.12.0              # TRL beside, not into, the venv
    .venv/bin/python scripts/bench_overhead.py --trl-path /tmp/trl   # TRL side by side
    .venv/bin/python scripts/bench_overhead.py --trl no --floor      # ours against the bare calls
    .venv/bin/python scripts/bench_overhead.py --interleave --floor-reps 20   # the same, phase by phase
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import (  # noqa: E402
    add_common_args,
    add_tiny_model_args,
    print_rows,
    save_model,
    set_threads,
    tiny_llama_config,
    write_prompts,
)
from bench_overhead_trl import import_trl, run_trl  # noqa: E402
from bench_runs import StepClock, read_metrics, run_overrides  # noqa: E402

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


@dataclasses.dataclass
class FloorRow:
    """One phase of our step against the bare calls it consists of."""

    phase: str
    trainer_s: float | None
    """The trainer's median wall seconds (``timing_s/<phase>``)."""
    floor_s: float
    """Median wall seconds of the phase's bare calls (same models and shapes, no trainer)."""
    gap_s: float | None
    gap_pct: float | None
    """``(trainer_s - floor_s) / trainer_s``, in %."""


def write_assets(folder: Path, args: argparse.Namespace) -> dict[str, Path]:
    """Policy (also the critic's backbone), reward model and prompt Parquet of the benchmark's shapes."""
    import make_tiny_assets

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


def floor_calls(args: argparse.Namespace, paths: dict[str, Path]) -> dict[str, Any]:
    """Each phase of our step as the bare calls it consists of (the module docstring's ``--floor``), as
    closures over one shared state; the responses of ``gen`` feed the phases after it."""
    from transformers import AutoTokenizer

    import ppo_kernels
    from ppo import data, model_loading
    from ppo.algorithms import agg_loss, compute_gae, kl_penalty, policy_loss

    tokenizer = AutoTokenizer.from_pretrained(paths["policy"])
    records = data.load_prompts(paths["prompts"], tokenizer, max_prompt_length=32, require_ground_truth=False)
    prompts = [r.input_ids for r in records[: args.num_prompts]]
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id
    prompt_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    prompt_mask = prompt_ids != pad
    torch.manual_seed(args.seed)
    actor = AutoModelForCausalLM.from_pretrained(paths["policy"]).train()
    ref = AutoModelForCausalLM.from_pretrained(paths["policy"]).requires_grad_(False).eval()
    critic = model_loading.load_critic(
        str(paths["policy"]), attn_implementation="sdpa", config_key="model.path"
    ).train()
    reward = AutoModelForSequenceClassification.from_pretrained(paths["reward"], num_labels=1).eval()
    nets = {"actor": actor, "critic": critic}
    # Fused AdamW, as the trainer steps (ppo.optim.with_optimizer).
    optimizers = {
        name: torch.optim.AdamW(net.parameters(), lr=1e-6, fused=True) for name, net in nets.items()
    }
    length = args.response_len
    state: dict[str, torch.Tensor] = {}

    def gen() -> None:
        with torch.no_grad():
            state["ids"] = actor.generate(
                input_ids=prompt_ids,
                attention_mask=prompt_mask,
                max_new_tokens=length,
                min_new_tokens=length,
                do_sample=True,
                top_k=0,
                top_p=1.0,
                pad_token_id=pad,
            )
        state["mask"] = torch.cat([prompt_mask, torch.ones(len(prompts), length, dtype=torch.bool)], dim=1)

    def logprobs(model: torch.nn.Module, rows: slice = slice(None)) -> torch.Tensor:
        ids, mask = state["ids"][rows], state["mask"][rows]
        logits = model(input_ids=ids, attention_mask=mask).logits[:, -length - 1 : -1].float()
        return logits.log_softmax(-1).gather(-1, ids[:, -length:, None]).squeeze(-1)

    def values(rows: slice = slice(None)) -> torch.Tensor:
        out = critic(input_ids=state["ids"][rows], attention_mask=state["mask"][rows]).logits
        return out[:, -length - 1 : -1, 0]

    def no_grad(fn: Any) -> Any:
        def call() -> None:
            with torch.no_grad():
                fn()

        return call

    def adv() -> None:
        rewards = -kl_penalty(state["old"], state["ref"], "kl")
        rewards[:, -1] += state["score"]
        response_mask = torch.ones_like(rewards, dtype=torch.bool)
        state["adv"], _ = compute_gae(rewards, state["values"], response_mask, gamma=1.0, lam=1.0)

    def ppo_loss(rows: slice) -> torch.Tensor:
        # The actor's loss as the trainer computes it: log-probs and entropy from the logits (kernels),
        # the clipped policy loss, the entropy's token mean (a metric).
        ids, mask = state["ids"][rows], state["mask"][rows]
        logits = actor(input_ids=ids, attention_mask=mask).logits[:, -length - 1 : -1]
        lp, entropy = ppo_kernels.logprobs_from_logits(
            logits.reshape(-1, logits.shape[-1]), ids[:, -length:].reshape(-1), compute_entropy=True
        )
        lp, entropy = lp.view(-1, length), entropy.view(-1, length)
        response_mask = torch.ones_like(lp, dtype=torch.bool)
        loss, _ = policy_loss(
            lp, state["old"][rows], state["adv"][rows], response_mask, 0.2, 0.2, 3.0, "token-mean"
        )
        agg_loss(entropy.detach(), response_mask, "token-mean")
        return loss

    def update(name: str, loss_of: Any) -> None:
        half = len(prompts) // NUM_MINI_BATCHES
        for _ in range(args.epochs):
            for m in range(NUM_MINI_BATCHES):
                loss_of(slice(m * half, (m + 1) * half)).mean().backward()
                torch.nn.utils.clip_grad_norm_(nets[name].parameters(), 1.0)  # as the trainer clips
                optimizers[name].step()
                optimizers[name].zero_grad(set_to_none=True)

    return {
        "gen": gen,
        "old_log_prob": no_grad(lambda: state.__setitem__("old", logprobs(actor))),
        "ref": no_grad(lambda: state.__setitem__("ref", logprobs(ref))),
        "values": no_grad(lambda: state.__setitem__("values", values())),
        "reward": no_grad(
            lambda: state.__setitem__(
                "score", reward(input_ids=state["ids"], attention_mask=state["mask"]).logits[:, 0]
            )
        ),
        "adv": no_grad(adv),
        "update_critic": lambda: update("critic", lambda rows: values(rows).square()),
        "update_actor": lambda: update("actor", ppo_loss),
    }


def floor_times(args: argparse.Namespace, paths: dict[str, Path]) -> dict[str, list[float]]:
    """The wall seconds of each phase's bare calls: ``--floor-reps`` repeats of the whole sequence, after
    one not counted."""
    calls = floor_calls(args, paths)
    times: dict[str, list[float]] = {p: [] for p in calls}
    for rep in range(args.floor_reps + 1):
        for phase, call in calls.items():  # in step order: each phase reads what the ones before wrote
            start = time.perf_counter()
            call()
            if rep:
                times[phase].append(time.perf_counter() - start)
    return times


def trainer_calls(
    args: argparse.Namespace, paths: dict[str, Path], out_dir: Path
) -> tuple[dict[str, Any], Any]:
    """Each phase of our step as the trainer's own function (``train_ppo``'s step functions on the Run of
    ``ppo.build.build``, world of one: the same models, packing, kernels and losses as a run), as
    closures over one batch in step order (``gen`` collects the next prompts' responses, the phases after
    it read and fill that batch), and the Run. Joins a one-process group: ``destroy_distributed`` after."""
    import train_ppo
    from ppo import batch_advantages, forwards, runner
    from ppo.build import build
    from ppo.config_loader import load_config
    from ppo.distributed import init_distributed
    from ppo.metrics import Timer

    cfg = load_config(None, ppo_overrides(args, paths, out_dir))
    run = build(cfg, init_distributed("cpu"))
    stop = runner.StopRequest()
    state: dict[str, Any] = {}

    def gen() -> None:
        state["batch"], _ = train_ppo.collect(cfg, run, Timer(), stop)

    def old_log_prob() -> None:
        b = state["batch"]
        b.old_logprobs = forwards.forward_old_logprobs(cfg, run.actor.model, run.sppo_old, b, run.sp)

    def values() -> None:
        state["batch"].values = forwards.forward_values(cfg, run.critic.model, state["batch"], run.sp)

    def reward() -> None:
        state["batch"].scores, _ = train_ppo.score_responses(cfg, run, state["batch"], stop)

    def adv() -> None:
        run.state.step += 1
        batch_advantages.compute_advantages(cfg, state["batch"], run.kl_ctrl, run.state.step)

    calls = {
        "gen": gen,
        "old_log_prob": old_log_prob,
        "ref": lambda: forwards.forward_reference(cfg, run.actor.model, run.ref, state["batch"], run.sp),
        "values": values,
        "reward": reward,
        "adv": adv,
        "update_critic": lambda: train_ppo.update_critic(cfg, run, state["batch"]),
        "update_actor": lambda: train_ppo.update_actor(cfg, run, state["batch"]),
    }
    return calls, run


def interleaved_times(
    args: argparse.Namespace, paths: dict[str, Path], out_dir: Path
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """``--interleave``: the wall seconds of each phase, the trainer's function (``trainer_calls``) and
    its bare calls (``floor_calls``) one right after the other, phase by phase in step order, for
    ``--floor-reps`` steps after one not counted: whatever the machine's speed does, it does to both
    within a fraction of a second."""
    from ppo.distributed import destroy_distributed

    ours, _ = trainer_calls(args, paths, out_dir)
    try:
        bare = floor_calls(args, paths)
        times: tuple[dict[str, list[float]], dict[str, list[float]]] = ({}, {})
        for rep in range(args.floor_reps + 1):
            for phase in OUR_PHASES:
                for calls, out in zip((ours, bare), times, strict=True):
                    start = time.perf_counter()
                    calls[phase]()
                    if rep:
                        out.setdefault(phase, []).append(time.perf_counter() - start)
        return times
    finally:
        destroy_distributed()


def floor_rows(ours: OverheadRow, floor: dict[str, float]) -> list[FloorRow]:
    """Each phase's trainer time (from ``ours``) next to its floor, and their sum."""
    rows = []
    for phase in OUR_PHASES:
        floor_s = floor[phase]
        trainer = getattr(ours, f"{phase}_s")
        gap = None if trainer is None else trainer - floor_s
        pct = None if gap is None or trainer == 0 else 100 * gap / trainer
        rows.append(FloorRow(phase=phase, trainer_s=trainer, floor_s=floor_s, gap_s=gap, gap_pct=pct))
    total_trainer = sum(r.trainer_s or 0.0 for r in rows)
    total_floor = sum(r.floor_s for r in rows)
    gap = total_trainer - total_floor
    rows.append(
        FloorRow(
            phase="sum",
            trainer_s=total_trainer,
            floor_s=total_floor,
            gap_s=gap,
            gap_pct=100 * gap / total_trainer if total_trainer else None,
        )
    )
    return rows


def run_overhead(args: argparse.Namespace) -> tuple[list[OverheadRow], str | None, list[FloorRow]]:
    """Ours, then TRL as shipped and with gc frozen, ``--rounds`` times; rows, TRL's version (or why it
    did not run), and with ``--floor`` our phases against their bare calls (else an empty list).
    ``train_ppo.main`` joins and leaves the process group itself."""
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise SystemExit("bench_overhead.py measures one process; start it without torchrun")
    trl_ppo, trl_note = import_trl(args)
    cpu: dict[str, list[float]] = {}
    wall: dict[str, list[float]] = {}
    phases: dict[str, list[float]] = {p: [] for p in OUR_PHASES}
    floor_samples: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_overhead_") as tmp:
        folder = Path(tmp)
        paths = write_assets(folder, args)
        for r in range(args.rounds):
            c, w, ph = run_ours(args, paths, folder / f"ours_{r}")
            cpu.setdefault("ours", []).extend(c)
            wall.setdefault("ours", []).extend(w)
            for p in OUR_PHASES:
                phases[p].extend(ph[p])
            if args.floor:  # after each round of ours, so that the machine's speed is alike for both
                for p, t in floor_times(args, paths).items():
                    floor_samples.setdefault(p, []).extend(t)
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
        floor = {p: statistics.median(t) for p, t in floor_samples.items()} if args.floor else None
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
    return rows, trl_note, floor_rows(rows[0], floor) if floor is not None else []


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--response-len", type=int, default=32, help="tokens per response")
    add_tiny_model_args(parser)
    parser.add_argument("--epochs", type=int, default=2, help="PPO epochs over the 2 mini-batches")
    parser.add_argument("--steps", type=int, default=10, help="steps per run (the first two not counted)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs of each trainer")
    parser.add_argument("--trl", default="auto", choices=["auto", "yes", "no"], help="run TRL beside ours")
    parser.add_argument("--trl-path", default=None, help="a folder holding TRL (pip install --target)")
    parser.add_argument("--floor", action="store_true", help="our phases against their bare calls")
    parser.add_argument("--floor-reps", type=int, default=5, help="counted repeats of the bare calls")
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="the floor table from the trainer's step functions and the bare calls alternating phase by phase",
    )
    add_common_args(parser)
    args = parser.parse_args(argv)
    if args.num_prompts % NUM_MINI_BATCHES or args.steps < 3 or args.rounds < 1 or args.floor_reps < 1:
        parser.error(
            f"need --num-prompts a multiple of {NUM_MINI_BATCHES}, --steps >= 3, --rounds >= 1, --floor-reps >= 1"
        )
    return args


def run_interleaved(args: argparse.Namespace) -> list[FloorRow]:
    """``--interleave``: the floor table of ``interleaved_times`` (medians), the trainer's column from its
    own step functions instead of a run's ``timing_s``."""
    with tempfile.TemporaryDirectory(prefix="bench_overhead_") as tmp:
        paths = write_assets(Path(tmp), args)
        ours, bare = interleaved_times(args, paths, Path(tmp) / "ours")
    row = OverheadRow(
        trainer="ours",
        steps=args.floor_reps,
        step_cpu_s=0.0,
        step_cpu_min_s=0.0,
        step_cpu_max_s=0.0,
        step_wall_s=0.0,
    )
    for phase in OUR_PHASES:
        setattr(row, f"{phase}_s", statistics.median(ours[phase]))
    return floor_rows(row, {p: statistics.median(t) for p, t in bare.items()})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    if args.interleave:
        floor = run_interleaved(args)
        if not args.json:
            print("our phases at their floor, interleaved phase by phase (wall seconds, medians):")
        print_rows(floor, args.json)
        return 0
    rows, trl_note, floor = run_overhead(args)
    print_rows(rows, args.json)
    if floor:
        if not args.json:
            print("\nour phases at their floor (bare calls, same shapes; wall seconds):")
        print_rows(floor, args.json)
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
    from ppo.distributed import exit_process  # this process joins a process group (build_run)

    exit_process(main())
