"""Our PPO step at its arithmetic floor: each phase of the trainer's step against the bare calls it consists
of, on the tiny model and shapes of overhead.py (its ``--num-prompts``, ``--response-len``, ``--layers``,
``--hidden``, ``--epochs``): where the step's time above the arithmetic goes.

The floor of a phase: the bare calls it consists of on the same models and shapes, called directly with no
trainer around them (plain ``transformers`` models, no FSDP; the ``--num-prompts`` prompts left-padded into
one batch, responses of ``--response-len`` tokens): ``gen`` one ``generate``; ``old_log_prob`` and ``ref`` a
forward and the log-softmax gather of the response tokens; ``values`` the critic's forward; ``reward`` the
reward model's; ``adv`` the k1 KL and GAE (``ppo.algorithms``); ``update_actor`` and ``update_critic``
``--epochs`` x 2 mini-batches of forward, the loss, backward, gradient clipping and a fused AdamW step (the
actor's loss as the trainer's: log-probs and entropy from the logits with
``ppo_kernels.logprobs_from_logits``, the clipped ``policy_loss``, the entropy's mean; the critic's the
squared values).

The trainer's side, by default: ``--rounds`` runs of ``train_ppo.main`` for ``--steps`` steps as overhead.py
starts them, each phase's median wall seconds (``metrics.jsonl``'s ``timing_s/<phase>``, steps 1 and 2 not
counted); after each run, ``--floor-reps`` repeats of the bare calls, each after one warm-up: the halves
alternate, so that a machine whose speed drifts serves both alike.

``--interleave`` measures the same table without whole runs: the trainer's own step functions
(``trainer_calls``: ``train_ppo.collect``, ``forwards.*``, ``score_responses``, ``compute_advantages``,
``update_critic``, ``update_actor`` on a Run built at world 1) and the bare calls alternate phase by
phase, each trainer call followed at once by its bare one, for ``--floor-reps`` steps after one not
counted; ``trainer_s`` is then the median of those calls. Runs minutes apart can differ by more than the
gap (the machine's speed drifts); calls a fraction of a second apart cannot.

``--profile N`` (with ``--interleave``) also runs the trainer's calls under ``cProfile`` and prints the ``N``
functions of the project (``ppo/``, ``ppo_kernels/``, ``train_ppo.py``) with the most time per step, what
they call included (``ProfileRow``): where the trainer's time above the floor goes, function by function.
The profiler slows Python-heavy functions more than the arithmetic, and the table's trainer column with
them: take the gaps from a run without it.

Columns (a row per phase, then their ``sum``): ``phase``, ``trainer_s`` (the trainer's median wall
seconds), ``floor_s`` (the bare calls' median wall seconds), ``gap_s`` and ``gap_pct`` (the trainer's time
above the floor, in % of the trainer's): where the rest of the step goes. The floor's padded batch holds a
few % more tokens than the trainer's packed rows (prompt padding), so a small negative gap is possible.

One process, one torch thread (``--threads``).

Run:
    .venv/bin/python -m ppo_bench.overhead_floor                              # runs, then bare calls
    .venv/bin/python -m ppo_bench.overhead_floor --interleave --floor-reps 20  # phase by phase
    .venv/bin/python -m ppo_bench.overhead_floor --interleave --floor-reps 20 --profile 30  # and by function
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from ppo_bench.common import add_common_args, print_rows, set_threads
from ppo_bench.overhead import (
    NUM_MINI_BATCHES,
    OUR_PHASES,
    add_step_args,
    check_step_args,
    one_process,
    ppo_overrides,
    run_ours,
    write_assets,
)


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


@dataclasses.dataclass
class ProfileRow:
    """One of the project's functions in the trainer's step, under ``cProfile`` (``--profile``)."""

    function: str
    """``path:line(name)``, the path from the repository's root."""
    calls_per_step: float
    cumulative_ms: float
    """Milliseconds per step in the function and what it calls (wall clock, under the profiler)."""
    own_ms: float
    """Milliseconds per step in the function's own lines."""


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
    from ppo import batch_advantages, forwards
    from ppo.build import build
    from ppo.config_loader import load_config
    from ppo.distributed import init_distributed
    from ppo.metrics import Timer
    from ppo.step_end import StopRequest

    cfg = load_config(None, ppo_overrides(args, paths, out_dir))
    run = build(cfg, init_distributed("cpu"))
    stop = StopRequest()
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
    args: argparse.Namespace, paths: dict[str, Path], out_dir: Path, profiler: cProfile.Profile | None = None
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """``--interleave``: the wall seconds of each phase, the trainer's function (``trainer_calls``) and
    its bare calls (``floor_calls``) one right after the other, phase by phase in step order, for
    ``--floor-reps`` steps after one not counted: whatever the machine's speed does, it does to both
    within a fraction of a second. ``profiler``: enabled around the trainer's counted calls."""
    from ppo.distributed import destroy_distributed

    ours, _ = trainer_calls(args, paths, out_dir)
    try:
        bare = floor_calls(args, paths)
        times: tuple[dict[str, list[float]], dict[str, list[float]]] = ({}, {})
        for rep in range(args.floor_reps + 1):
            for phase in OUR_PHASES:
                for calls, out in zip((ours, bare), times, strict=True):
                    profiled = profiler is not None and rep > 0 and calls is ours
                    start = time.perf_counter()
                    if profiled:
                        profiler.enable()
                    calls[phase]()
                    if profiled:
                        profiler.disable()
                    if rep:
                        out.setdefault(phase, []).append(time.perf_counter() - start)
        return times
    finally:
        destroy_distributed()


def profile_rows(profiler: cProfile.Profile, steps: int, top: int) -> list[ProfileRow]:
    """The ``top`` functions of the project's code (``ppo/``, ``ppo_kernels/``, ``train_ppo.py``) by time
    per step with what they call, from ``profiler`` over ``steps`` steps."""
    import ppo

    root = Path(ppo.__file__).resolve().parents[1]  # where the project's packages are
    ours = (root / "ppo", root / "ppo_kernels", root / "train_ppo.py")
    rows = []
    for (path, line, name), (_, calls, own, cumulative, _) in pstats.Stats(profiler).stats.items():
        file = Path(path).resolve()
        if any(file == d or d in file.parents for d in ours):
            rows.append(
                ProfileRow(
                    function=f"{file.relative_to(root)}:{line}({name})",
                    calls_per_step=calls / steps,
                    cumulative_ms=1e3 * cumulative / steps,
                    own_ms=1e3 * own / steps,
                )
            )
    return sorted(rows, key=lambda r: -r.cumulative_ms)[:top]


def floor_rows(trainer: dict[str, float | None], floor: dict[str, float]) -> list[FloorRow]:
    """Each phase's trainer time (``trainer``: seconds per phase, None where it did not run) next to its
    floor, and their sum."""
    rows = []
    for phase in OUR_PHASES:
        floor_s = floor[phase]
        trainer_s = trainer[phase]
        gap = None if trainer_s is None else trainer_s - floor_s
        pct = None if gap is None or trainer_s == 0 else 100 * gap / trainer_s
        rows.append(FloorRow(phase=phase, trainer_s=trainer_s, floor_s=floor_s, gap_s=gap, gap_pct=pct))
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


def run_floor(args: argparse.Namespace) -> list[FloorRow]:
    """``--rounds`` runs of ours, each followed by ``--floor-reps`` repeats of the bare calls; the floor
    table of their medians. ``train_ppo.main`` joins and leaves the process group itself."""
    one_process()
    phases: dict[str, list[float]] = {p: [] for p in OUR_PHASES}
    floor: dict[str, list[float]] = {p: [] for p in OUR_PHASES}
    with tempfile.TemporaryDirectory(prefix="overhead_floor_") as tmp:
        folder = Path(tmp)
        paths = write_assets(folder, args)
        for r in range(args.rounds):
            _, _, ph = run_ours(args, paths, folder / f"ours_{r}")
            for p in OUR_PHASES:
                phases[p].extend(ph[p])
            for p, t in floor_times(args, paths).items():  # right after ours: the machine's speed alike
                floor[p].extend(t)
    trainer = {p: statistics.median(t) if t else None for p, t in phases.items()}
    return floor_rows(trainer, {p: statistics.median(t) for p, t in floor.items()})


def run_interleaved(args: argparse.Namespace) -> tuple[list[FloorRow], list[ProfileRow]]:
    """``--interleave``: the floor table of ``interleaved_times`` (medians), the trainer's column from its
    own step functions instead of a run's ``timing_s``; with ``--profile``, the profile's rows."""
    one_process()
    profiler = cProfile.Profile() if args.profile else None
    with tempfile.TemporaryDirectory(prefix="overhead_floor_") as tmp:
        paths = write_assets(Path(tmp), args)
        ours, bare = interleaved_times(args, paths, Path(tmp) / "ours", profiler)
    trainer: dict[str, float | None] = {p: statistics.median(ours[p]) for p in OUR_PHASES}
    rows = floor_rows(trainer, {p: statistics.median(t) for p, t in bare.items()})
    return rows, profile_rows(profiler, args.floor_reps, args.profile) if profiler is not None else []


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_step_args(parser)
    parser.add_argument("--floor-reps", type=int, default=5, help="counted repeats of the bare calls")
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="the trainer's step functions and the bare calls alternating phase by phase, instead of runs",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="with --interleave: the N functions of the project with the most time per step (cProfile)",
    )
    add_common_args(parser)
    args = parser.parse_args(argv)
    check_step_args(parser, args)
    if args.floor_reps < 1:
        parser.error("need --floor-reps >= 1")
    if args.profile and not args.interleave:
        parser.error("--profile needs --interleave")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    rows, profile = run_interleaved(args) if args.interleave else (run_floor(args), [])
    if not args.json:
        if args.interleave:
            print("our phases at their floor, interleaved phase by phase (wall seconds, medians):")
        else:
            print("our phases at their floor (bare calls, same shapes; wall seconds):")
    print_rows(rows, args.json)
    if profile:
        if not args.json:
            print("the trainer's functions under cProfile (milliseconds per step):")
        print_rows(profile, args.json)
    return 0


if __name__ == "__main__":
    from ppo.distributed import exit_process  # this process joins a process group (train_ppo.main, build)

    exit_process(main())
