"""KL-regularized PPO for causal language models: one SPMD program that every rank runs.

    torchrun --nproc_per_node=8 train_ppo.py --config configs/X.yaml [section.key=value ...]
    python train_ppo.py --config configs/X.yaml --print-config [--world-size 32]

A step is a straight line: 1. rollout (HF generate, parameters gathered once; with DAPO's dynamic
sampling, rounds until enough groups score unlike), 2. score (old and reference log-probs, values,
rewards, the overlong penalty), 3. advantages (KL in the reward, GAE | GRPO | RLOO | REINFORCE++ |
REINFORCE++-baseline | OPO), 4. update (critic, then actor: epochs x mini-batches x token-budget
micro-batches; vanilla PPO, GSPO, Clip-Cov or KL-Cov), 5. log (one cross-rank reduction, validation),
6. checkpoint. Every rank runs the same lines; only rank 0 writes files.
``build`` makes everything the loop needs once; ``train`` is the loop; the step functions follow in step
order, then the ways a step ends early (stop, rollback, skip), handled in one place.
"""

from __future__ import annotations

from ppo import cli

if __name__ == "__main__":  # --help and --print-config answer here, before torch and transformers load
    cli.answer_early(None, __doc__, "PPOConfig")

# The imports below follow the early answer on purpose:
# ruff: noqa: E402
import logging
import sys
from dataclasses import dataclass
from typing import Any, Literal

import torch

import kernels
from ppo import algorithms, checkpoint_files, lora, models, offline, rewards, runner, sharding, ulysses
from ppo.batch import Batch, Rollout, concat_rollouts, group_index, rollout_rows
from ppo.build import KLController, Run, build
from ppo.checkpointer import log_stopped, roll_back, save_due
from ppo.config import PPOConfig
from ppo.distributed import (
    DistInfo,
    all_gather_object,
    all_reduce_scalar,
    all_reduce_scalars,
    all_reduce_sum,
    reduce_metrics,
)
from ppo.metrics import Timer, batch_metrics, perf_metrics, profiled
from ppo.packing import micro_batches, pack_rows, unpack
from ppo.periodic_validation import validate
from ppo.rollout import gather_group, sample
from ppo.update import LossFn, MiniBatchHook, optimize

logger = logging.getLogger("ppo")


def main(argv: list[str] | None = None) -> int:
    return runner.main(argv, PPOConfig, train, __doc__)


def train(cfg: PPOConfig, info: DistInfo) -> None:
    """Build the run, validate once before training, then step until the last step or a stop signal."""
    run = build(cfg, info)
    state = run.state
    if cfg.trainer.val_before_train and state.step == 0 and run.val_records:
        val_metrics = validate(cfg, info, run)
        state.best_val = val_metrics.get("val/score")
        run.metrics_logger.log(0, val_metrics)
    stop = runner.StopRequest()
    while state.step < run.total_steps:
        start = step_start(run)
        state.step += 1
        step, timer, metrics = state.step, Timer(state.step), {}
        try:
            with profiled(cfg.trainer.profile_steps, step, run.out_dir), timer("step"):
                # 1. rollout: n responses per prompt, sampled by each rank for its own prompts, or read
                # from the offline data set (rollout.source, rollout.offline_fraction); with dynamic
                # sampling, more rounds until enough groups have responses that score unlike
                batch, rollout_metrics = collect(cfg, run, timer, stop)
                metrics.update(rollout_metrics)
                at_boundary(stop)

                # 2. score: old and reference log-probs, values, rewards (all without gradients)
                metrics.update(score(cfg, run, batch, timer, stop))
                check_scores(cfg, run, batch, metrics)
                at_boundary(stop)

                # 3. advantages: KL in the reward, then GAE or a group baseline
                with timer("adv"):
                    metrics.update(compute_advantages(cfg, batch, run.kl_ctrl, step))

                # 4. update: the critic first (it learns the new returns), then the actor
                metrics.update(update(cfg, run, batch, timer))

                # 5. log: one cross-rank reduction, the batch's statistics, validation when it is due
                metrics = batch_metrics(cfg, batch) | reduce_metrics(metrics)
                if validation_due(cfg, run):
                    with timer("testing"):
                        metrics.update(validate(cfg, info, run, stop))
            metrics.update(perf_metrics(cfg, batch, metrics, timer.times, info, actor=run.actor.model))
            metrics.update(log_step(cfg, run, metrics))
        except EndStep as end:
            if end_step(cfg, run, start, end):
                break
            continue

        # 6. checkpoint: sharded, atomic, resumable; also when asked to stop (SIGTERM from Slurm or
        # torchrun, Ctrl-C), so that a preempted job resumes from this step.
        stopping = stop.requested()
        if save_due(step, run.total_steps, cfg.trainer.save_freq) or stopping:
            save(run)
        else:
            run.checkpointer.poll()  # a background save (trainer.async_save) becomes latest once written
        if stopping:
            log_stopped(step, stop.name)
            break
    run.checkpointer.wait()
    if cfg.trainer.save_hf_on_end:
        hf_dir = run.out_dir / "hf"
        lora.save_hf(
            run.actor.model, run.tokenizer, hf_dir, is_main=info.is_main, merged=cfg.actor.lora.save_merged
        )
    run.metrics_logger.close()
    if run.reward_pool is not None:
        run.reward_pool.close()


# ----------------------------------------------------------------------------------------------------
# 1. rollout
# ----------------------------------------------------------------------------------------------------


def collect(
    cfg: PPOConfig, run: Run, timer: Timer, stop: runner.StopRequest
) -> tuple[Batch, dict[str, float]]:
    """This rank's step batch and the rollout's metrics: one round of the next prompts
    (``collect_round``), or with ``algorithm.filter_groups`` as many rounds as it takes
    (``collect_filtered``). The ranks of a sequence-parallel group then gather their batches: they
    score and train them together."""
    metrics: dict[str, float] = {}
    if cfg.algorithm.filter_groups.enable:
        batch, metrics = collect_filtered(cfg, run, timer, stop)
    else:
        batch = collect_round(cfg, run, next(run.loader), timer)
    if run.sp.size > 1:
        scores = batch.scores
        batch = gather_group(batch, run.sp, run.tokenizer.pad_token_id, cfg.rollout.n)
        if scores is not None:
            batch.scores = ulysses.all_gather_rows(scores, run.sp)
    return batch, metrics


def collect_round(cfg: PPOConfig, run: Run, items: list, timer: Timer) -> Batch:
    """``n`` responses to each of this rank's prompts, sampled (``items`` are prompt records) or, for
    ``rollout.offline_fraction`` of the groups, the offline data set's responses (``items`` are
    ``offline.OfflineGroup``; ``offline.step_batch``)."""
    n = cfg.rollout.n
    fraction = cfg.rollout.offline_fraction
    if fraction == 0:
        records = [r for r in items for _ in range(n)]
        with timer("gen"):
            rollout = sample(run.sampler, records, do_sample=cfg.rollout.do_sample)
        return Batch(rollout=rollout, records=records, group_ids=group_index(len(records), n, run.device))
    num_offline = offline.num_offline_groups(
        len(items), fraction, rank=run.loader.rank, world_size=run.loader.world_size
    )
    sampled = None
    timer.times["timing_s/gen"] = 0.0  # nothing sampled in the loop when every group is offline
    if fraction < 1:  # every rank has the same number of sampled groups: all join the generation
        with timer("gen"):
            prompts = [g.record for g in items[num_offline:] for _ in range(n)]
            sampled = sample(run.sampler, prompts, do_sample=cfg.rollout.do_sample)
    return offline.step_batch(
        items,
        num_offline,
        sampled,
        group_size=n,
        with_scores=cfg.reward.style == "dataset",
        with_logprobs=cfg.algorithm.rollout_is_threshold is not None,
        max_response_length=cfg.data.max_response_length,
        pad_token_id=run.tokenizer.pad_token_id,
        eos_token_ids=run.sampler.eos_ids,
        device=run.device,
    )


@dataclass(kw_only=True)
class KeptGroup:
    """A prompt's ``n`` responses that dynamic sampling keeps, on the CPU (it may move to another rank)."""

    key: tuple[int, int, int, int]
    """``(round, loader batch in the round, rank, position in the rank's share)``: sorted, the global
    order of the prompts as the loader drew them, the same on any number of ranks."""
    record: Any
    rollout: Rollout
    """The group's ``n`` sequences."""
    raw_scores: torch.Tensor
    """``[n]`` the reward's scores, before the overlong penalty."""
    penalties: torch.Tensor
    """``[n]`` the overlong penalties (0 without ``reward.overlong_buffer``)."""


def collect_filtered(
    cfg: PPOConfig, run: Run, timer: Timer, stop: runner.StopRequest
) -> tuple[Batch, dict[str, float]]:
    """DAPO's dynamic sampling (verl's ``algorithm.filter_groups``): generate and score rounds of
    ``data.gen_batch_size`` prompts, drop the groups whose responses all have the same
    ``filter_groups.metric``, until ``data.train_batch_size`` groups are kept over all ranks; the step
    trains on the first ``train_batch_size`` of them in the loader's order (``kept_group_slots``), each
    rank on an equal share, so a group may move to another rank.

    Every rank runs the same rounds: the kept count is all-reduced after each (a rank whose groups all
    tie just generates again with the others). A round draws ``gen_batch_size / train_batch_size``
    batches from the loader, so the loader's position (checkpointed) advances by what was drawn, and a
    run killed during a refill round redoes the step from its checkpoint with the same prompts. After
    ``filter_groups.max_num_gen_batches`` rounds short of a full batch the run stops with an error."""
    f, n, want = cfg.algorithm.filter_groups, cfg.rollout.n, cfg.data.train_batch_size
    loader = run.loader
    kept: list[KeptGroup] = []
    metrics: dict[str, float] = {}
    num_kept = num_generated = 0
    rounds = 0
    while num_kept < want:
        if f.max_num_gen_batches and rounds >= f.max_num_gen_batches:
            raise runner.TrainingError(
                f"dynamic sampling: {rounds} generation rounds of data.gen_batch_size={cfg.data.gen_batch_size} "
                f"prompts (algorithm.filter_groups.max_num_gen_batches={f.max_num_gen_batches}) kept {num_kept:.0f} "
                f"of the data.train_batch_size={want} prompt groups a step needs: only {num_kept:.0f} of "
                f"{num_generated:.0f} groups had responses whose {f.metric} differed. Raise "
                f"algorithm.filter_groups.max_num_gen_batches (0: no limit) or data.gen_batch_size, use prompts "
                f"the policy sometimes solves, a finer algorithm.filter_groups.metric (score), or "
                f"algorithm.filter_groups.enable=false"
            )
        if rounds:
            at_boundary(stop)
        shares = [next(loader) for _ in range(cfg.data.gen_batch_size // want)]
        items = [r for share in shares for r in share]
        batch = collect_round(cfg, run, items, timer)
        with timer("reward"):
            raw, reward_metrics = score_responses(cfg, run, batch)
        for k, v in reward_metrics.items():  # counts add up over the rounds; extras: the last round's
            metrics[k] = metrics.get(k, 0.0) + v if k in ("reward/timeouts", "reward/errors") else v
        if all_reduce_scalar(float(not torch.isfinite(raw).all()), "max"):
            raise EndStep("skip", "non-finite reward")
        penalties = overlong_penalties(cfg, batch)
        values = {"acc": (raw >= 1.0).float(), "score": raw, "seq_reward": raw + penalties}[f.metric]
        keep = algorithms.filter_groups(values, batch.group_ids)[::n].tolist()
        rollout = batch.rollout
        positions = [(j, p) for j, share in enumerate(shares) for p in range(len(share))]
        for g, (j, p) in enumerate(positions):
            if keep[g]:
                rows = slice(g * n, (g + 1) * n)
                kept.append(
                    KeptGroup(
                        key=(rounds, j, loader.rank, p),
                        record=items[g],
                        rollout=rollout_rows(rollout, rows, torch.device("cpu")),
                        raw_scores=raw[rows].cpu(),
                        penalties=penalties[rows].cpu(),
                    )
                )
        kept_now, generated_now = all_reduce_scalars([float(sum(keep)), float(len(keep))], "sum")
        num_kept, num_generated, rounds = num_kept + kept_now, num_generated + generated_now, rounds + 1
    groups = exchange_kept_groups(kept, want, rank=loader.rank, world_size=loader.world_size)
    records = [g.record for g in groups for _ in range(n)]
    device = run.device
    rollout = concat_rollouts([g.rollout for g in groups], device)
    batch = Batch(rollout=rollout, records=records, group_ids=group_index(len(records), n, device))
    penalties = torch.cat([g.penalties for g in groups]).to(device)
    batch.scores = torch.cat([g.raw_scores for g in groups]).to(device) + penalties
    metrics |= {"train/num_gen_batches": float(rounds), "train/kept_group_share": num_kept / num_generated}
    if cfg.reward.overlong_buffer.enable:
        metrics.update(overlong_metrics(penalties))
    return batch, metrics


def kept_group_slots(keys: list[list[tuple]], num_groups: int, world_size: int) -> dict[tuple, int]:
    """Which rank trains each kept group: the first ``num_groups`` of every rank's ``keys`` (``keys[r]``
    are rank r's) in sorted (the loader's) order, ``num_groups / world_size`` consecutive ones per rank;
    groups past the first ``num_groups`` are dropped (absent). Example: 2 ranks, 4 groups, rank 0 kept
    ``(0,0,0,0), (0,0,0,1), (1,0,0,0)``, rank 1 kept ``(1,0,1,0)``: ranks 0, 0, 1, 1 in that order."""
    ordered = sorted(key for rank_keys in keys for key in rank_keys)[:num_groups]
    per_rank = num_groups // world_size
    return {key: i // per_rank for i, key in enumerate(ordered)}


def exchange_kept_groups(
    kept: list[KeptGroup], num_groups: int, *, rank: int, world_size: int
) -> list[KeptGroup]:
    """This rank's share of the first ``num_groups`` kept groups of all ranks (``kept_group_slots``), in
    order: the keys are all-gathered, then the groups that change rank (and only those)."""
    slots = kept_group_slots(all_gather_object([g.key for g in kept]), num_groups, world_size)
    moving = [g for g in kept if g.key in slots and slots[g.key] != rank]
    arrived = [g for part in all_gather_object(moving) for g in part if slots[g.key] == rank]
    mine = {g.key: g for g in kept + arrived if slots.get(g.key) == rank}
    return [mine[key] for key in sorted(mine)]


# ----------------------------------------------------------------------------------------------------
# 2. score
# ----------------------------------------------------------------------------------------------------


def score(cfg: PPOConfig, run: Run, batch: Batch, timer: Timer, stop: runner.StopRequest) -> dict[str, float]:
    """Old log-probs (unless the on-policy shortcut makes them the update's own), reference log-probs
    (and ``actor/ref_kl``), values and scores, into ``batch``; a stop signal is honoured between them."""
    metrics: dict[str, float] = {}
    if needs_old_logprobs(cfg):
        with timer("old_log_prob"):
            mb = cfg.actor.ppo_micro_batch_size_per_gpu
            batch.old_logprobs = score_logprobs(cfg, run.actor.model, batch, mb, run.sp)
        at_boundary(stop)
    if run.ref is not None:
        with timer("ref"):
            score_reference(cfg, run, batch)
        if batch.old_logprobs is not None:
            metrics["actor/ref_kl"] = ref_kl(batch.old_logprobs, batch.ref_logprobs, batch.loss_mask)
        at_boundary(stop)
    if run.critic is not None:
        with timer("values"):
            batch.values = score_values(cfg, run.critic.model, batch, run.sp)
        at_boundary(stop)
    with timer("reward"):
        if batch.scores is None:  # dynamic sampling scored its rounds already
            penalties = overlong_penalties(cfg, batch)
            scores, reward_metrics = score_responses(cfg, run, batch)
            batch.scores = scores + penalties
            metrics.update(reward_metrics)
            if cfg.reward.overlong_buffer.enable:
                metrics.update(overlong_metrics(penalties))
    return metrics


def score_responses(cfg: PPOConfig, run: Run, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
    """``[B]`` the reward's score of each response (``rewards.batch_scores``), before any shaping, and
    the rule's metrics (``reward/extra/*``; with ``reward.num_workers``, ``reward/{timeouts,errors}``)."""
    return rewards.batch_scores(
        batch,
        cfg.reward,
        group_size=cfg.rollout.n,
        scorer=run.scorer,
        tokenizer=run.tokenizer,
        reward_model=run.reward_model,
        pool=run.reward_pool,
    )


def overlong_penalties(cfg: PPOConfig, batch: Batch) -> torch.Tensor:
    """``[B]`` DAPO's overlong penalty of each response with ``reward.overlong_buffer.enable``
    (``rewards.overlong_penalty``), else zeros."""
    o = cfg.reward.overlong_buffer
    lengths = batch.response_mask.sum(-1)
    if not o.enable:
        return torch.zeros(lengths.shape, dtype=torch.float32, device=lengths.device)
    return rewards.overlong_penalty(
        lengths,
        max_response_length=cfg.data.max_response_length,
        buffer_len=o.len,
        penalty_factor=o.penalty_factor,
    )


def overlong_metrics(penalties: torch.Tensor) -> dict[str, float]:
    """This rank's mean overlong penalty and share of penalized responses (reduced over ranks later)."""
    return {
        "reward/overlong_penalty": penalties.float().mean().item(),
        "reward/overlong_ratio": (penalties < 0).float().mean().item(),
    }


def needs_old_logprobs(cfg: PPOConfig) -> bool:
    """On-policy (one epoch, one mini-batch) the ratio is exactly 1, so the update uses its own
    detached log-probs as the old ones (verl's shortcut) and the scoring forward is needed only for
    the KL in the reward, the rollback check and Clip-Cov's choice of tokens (made before the update's
    forwards, from the old log-probs)."""
    clip_cov = cfg.actor.policy_loss.loss_mode == "clip_cov"  # picks its tokens by the old log-probs
    return not cfg.on_policy or cfg.algorithm.use_kl_in_reward or cfg.algorithm.rollback_kl > 0 or clip_cov


@torch.no_grad()
def score_logprobs(
    cfg: PPOConfig, model: torch.nn.Module, batch: Batch, micro_batch_size: int, sp: ulysses.SPGroup
) -> torch.Tensor:
    """Log-probs ``[B, R]`` of the sampled tokens under ``model`` at the rollout temperature."""
    out = torch.zeros_like(batch.response_mask, dtype=torch.float32)
    with models.evaluating(model):  # adapter dropout off: the policy that sampled, deterministically
        for sel in micro_batches(batch, batch.rows(), cfg.actor, micro_batch_size):
            out[sel], _ = ulysses.packed_logprobs(
                model,
                pack_rows(batch, sel),
                sp,
                temperature=cfg.rollout.temperature,
                backend=cfg.actor.kernels,
                fused=cfg.actor.use_fused_kernels,
            )
    return out


def score_reference(cfg: PPOConfig, run: Run, batch: Batch) -> None:
    """Reference log-probs (and the exact KL with ``algorithm.kl_penalty=full``) into ``batch``. Under
    LoRA the reference is the actor with its adapters off; a separate reference is released after."""
    with lora.adapters_disabled(run.ref):  # a no-op for a separately loaded reference
        mb = cfg.ref.log_prob_micro_batch_size_per_gpu
        batch.ref_logprobs = score_logprobs(cfg, run.ref, batch, mb, run.sp)
    if cfg.algorithm.use_kl_in_reward and cfg.algorithm.kl_penalty == "full":
        batch.full_kl = score_full_kl(cfg, run.actor.model, run.ref, batch, run.sp)
    if run.ref is not run.actor.model:  # the actor's root stays gathered for its next forward
        sharding.release(run.ref)


@torch.no_grad()
def score_full_kl(
    cfg: PPOConfig, actor: torch.nn.Module, ref: torch.nn.Module, batch: Batch, sp: ulysses.SPGroup
) -> torch.Tensor:
    """Exact ``KL(actor || ref)`` over the vocabulary at every response token, ``[B, R]``.

    Needs both models' logits of a micro-batch at once: the costliest estimator, for small vocabularies
    or diagnostics. With sequence parallelism each rank computes its slice's tokens.
    """
    out = torch.zeros_like(batch.response_mask, dtype=torch.float32)
    tau = cfg.rollout.temperature
    with models.evaluating(actor), models.evaluating(ref):
        for sel in micro_batches(batch, batch.rows(), cfg.actor):
            packed = pack_rows(batch, sel)
            part = ulysses.slice_for_rank(packed, sp)  # the whole row without sequence parallelism
            logits = ulysses.local_logits(actor, part).float() / tau
            with lora.adapters_disabled(ref):  # the reference may be the actor itself (LoRA)
                ref_logits = ulysses.local_logits(ref, part).float() / tau
            kl = algorithms.full_kl(logits[None], ref_logits[None], (part.labels != -100)[None])[0]
            out[sel] = unpack(part.gather(kl), packed)
    return out


@torch.no_grad()
def score_values(cfg: PPOConfig, critic: torch.nn.Module, batch: Batch, sp: ulysses.SPGroup) -> torch.Tensor:
    out = torch.zeros_like(batch.response_mask, dtype=torch.float32)
    with models.evaluating(critic):
        for sel in micro_batches(batch, batch.rows(), cfg.critic):
            out[sel] = ulysses.packed_values(critic, pack_rows(batch, sel), sp)
    return out


def ref_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over sequences of the per-token ``log pi - log pi_ref`` (k1) of the sampled tokens: how far the
    policy has moved from the reference, whatever KL terms the run uses."""
    return algorithms.masked_mean(logprobs - ref_logprobs, mask, dim=-1).mean().item()


def check_scores(cfg: PPOConfig, run: Run, batch: Batch, metrics: dict[str, float]) -> None:
    """End the step before anything is updated when the KL to the reference exploded (roll back to the
    last checkpoint with a smaller learning rate) or a reward is NaN or infinite on any rank (skip)."""
    limit = cfg.algorithm.rollback_kl
    if limit > 0 and all_reduce_scalar(metrics["actor/ref_kl"], "mean") > limit:
        raise EndStep("rollback", f"KL to the reference above algorithm.rollback_kl={limit}")
    if all_reduce_scalar(float(not torch.isfinite(batch.scores).all()), "max"):
        raise EndStep("skip", "non-finite reward")
    run.state.consecutive_skipped_steps = 0


# ----------------------------------------------------------------------------------------------------
# 3. advantages
# ----------------------------------------------------------------------------------------------------


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str, backend: str) -> torch.Tensor:
    """Per-token KL estimate (``algorithms.kl_penalty``); k3 runs on the ``kernels`` low-variance KL op
    (Triton on GPU), which computes the same values and gradients."""
    if kind in ("low_var_kl", "k3"):
        return kernels.low_var_kl(logprobs, ref_logprobs, backend=backend)
    return algorithms.kl_penalty(logprobs, ref_logprobs, kind)


def compute_advantages(cfg: PPOConfig, batch: Batch, kl_ctrl: KLController, step: int) -> dict[str, float]:
    """Token rewards (score on the last generated token, plus a multi-turn environment's step rewards,
    minus the in-reward KL penalty) and advantages, over the loss mask (the generated tokens).

    The group estimators (GRPO, RLOO, REINFORCE++-baseline, OPO) take each sequence's summed token
    rewards, as verl does (``token_level_rewards.sum(-1)``): with KL in the reward, a sequence that
    drifted from the reference earns less than its score. GAE, REINFORCE++ and REINFORCE++-baseline
    whiten over every valid token of the global batch (one all-reduce pattern for the three).
    """
    mask = batch.loss_mask
    token_rewards = batch.rollout.step_rewards.float().clone()
    token_rewards[batch.rows(), last_true(mask)] += batch.scores
    metrics: dict[str, float] = {}
    if cfg.algorithm.use_kl_in_reward:
        kind = cfg.algorithm.kl_penalty
        if kind == "full":
            kl = batch.full_kl
        else:
            kl = kl_estimate(batch.old_logprobs, batch.ref_logprobs, kind, cfg.actor.kernels)
        kl = torch.where(mask, kl, torch.zeros_like(kl))
        beta = kl_ctrl.value
        token_rewards = token_rewards - beta * kl
        # The controller sees the batch's mean per-sequence KL over all ranks.
        seq_kl = algorithms.masked_mean(kl, mask, dim=-1).mean().item()
        metrics["actor/reward_kl_penalty"] = seq_kl
        metrics["actor/reward_kl_penalty_coeff"] = beta  # the coefficient used on this batch
        current_kl = all_reduce_scalar(seq_kl, "mean")
        if step > cfg.algorithm.kl_ctrl.fixed_warmup_steps:
            kl_ctrl.update(current_kl, n_steps=cfg.data.train_batch_size * cfg.rollout.n)
    batch.token_rewards = token_rewards
    est = cfg.algorithm.adv_estimator
    sp_size = cfg.actor.ulysses_sequence_parallel_size

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        # The ranks of a sequence-parallel group hold the same tokens: count them once.
        return all_reduce_sum(t).div_(sp_size)

    if est == "gae":
        batch.advantages, batch.returns = algorithms.compute_gae(
            token_rewards, batch.values, mask, cfg.algorithm.gamma, cfg.algorithm.lam, all_reduce=all_reduce
        )
        return metrics
    if est == "reinforce_plus_plus":
        batch.advantages, batch.returns = algorithms.compute_reinforce_plus_plus_advantages(
            token_rewards, mask, cfg.algorithm.gamma, all_reduce=all_reduce
        )
        return metrics
    seq_rewards, groups = token_rewards.sum(-1), batch.group_ids
    if est == "grpo":
        batch.advantages = algorithms.compute_grpo_advantages(
            seq_rewards, groups, mask, norm_by_std=cfg.algorithm.norm_adv_by_std_in_grpo
        )
    elif est == "rloo":
        batch.advantages = algorithms.compute_rloo_advantages(seq_rewards, groups, mask)
    elif est == "reinforce_plus_plus_baseline":
        batch.advantages = algorithms.compute_reinforce_plus_plus_baseline_advantages(
            seq_rewards, groups, mask, all_reduce=all_reduce
        )
    else:
        batch.advantages = algorithms.compute_opo_advantages(seq_rewards, groups, mask)
    batch.returns = batch.advantages
    return metrics


def last_true(mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` the position of the last True of each row of ``mask [B, R]`` (0 for a row with none): where
    the outcome reward lands (the final generated token; observation tokens after it are not trained)."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, 0).amax(-1)


# ----------------------------------------------------------------------------------------------------
# 4. update
# ----------------------------------------------------------------------------------------------------


def update(cfg: PPOConfig, run: Run, batch: Batch, timer: Timer) -> dict[str, float]:
    """The critic's update, then the actor's from step ``trainer.critic_warmup`` on (verl's rule)."""
    metrics: dict[str, float] = {}
    if run.critic is not None:
        with timer("update_critic"):
            metrics.update(update_critic(cfg, run, batch))
    if run.state.step >= cfg.trainer.critic_warmup:
        with timer("update_actor"):
            metrics.update(update_actor(cfg, run, batch))
    return metrics


def update_critic(cfg: PPOConfig, run: Run, batch: Batch) -> dict[str, float]:
    """Clipped value regression on the returns (``optimize`` with ``critic_loss``)."""
    c, critic = cfg.critic, run.critic
    lr = critic.optimizer.param_groups[0]["lr"]  # the rate this step's updates use
    loss_fn = critic_loss(cfg, critic.model, batch, run.sp)
    num_mini = cfg.data.train_batch_size // c.ppo_mini_batch_size
    out = optimize(
        c, "critic", critic, batch, loss_fn, num_mini=num_mini, shuffle=cfg.actor.shuffle, sp=run.sp
    )
    critic.scheduler.step()
    out["critic/lr"] = lr
    return out


def update_actor(cfg: PPOConfig, run: Run, batch: Batch) -> dict[str, float]:
    """The policy loss (``actor.policy_loss.loss_mode``) on the advantages, with the entropy bonus and
    the KL loss (``optimize`` with ``actor_loss``); stops early once a mini-batch's ``ppo_kl`` exceeds
    ``actor.early_stop_kl``. Clip-Cov and KL-Cov pick their tokens once per mini-batch
    (``cov_selection``), before its micro-batches run."""
    a, actor = cfg.actor, run.actor
    lr = actor.optimizer.param_groups[0]["lr"]  # the rate this step's updates use
    cov_mask, hook = None, None
    if a.policy_loss.loss_mode in ("clip_cov", "kl_cov"):
        cov_mask = torch.zeros_like(batch.response_mask)
        dp_rank = run.loader.rank // run.sp.size
        hook = cov_selection(cfg, batch, cov_mask, run.sp, dp_rank=dp_rank, step=run.state.step)
    out = optimize(
        a,
        "actor",
        actor,
        batch,
        actor_loss(cfg, actor.model, batch, run.sp, cov_mask=cov_mask),
        num_mini=cfg.data.train_batch_size // a.ppo_mini_batch_size,
        shuffle=a.shuffle,
        sp=run.sp,
        early_stop_kl=a.early_stop_kl,
        before_mini_batch=hook,
    )
    actor.scheduler.step()
    out["actor/lr"] = lr
    out.setdefault("actor/early_stopped", 0.0)
    if a.use_kl_loss:
        out["actor/kl_coef"] = a.kl_loss_coef
    return out


def critic_loss(cfg: PPOConfig, critic: torch.nn.Module, batch: Batch, sp: ulysses.SPGroup) -> LossFn:
    """The critic's share of a mini-batch's clipped value loss on the rows ``sel`` of ``batch``."""
    c = cfg.critic
    scale = sum_norm_scale(cfg, None, sp)

    def loss_fn(sel: torch.Tensor, counts: dict[str, float]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        counts = {**counts, "loss_scale_factor": scale}
        mask = batch.loss_mask[sel]
        values = ulysses.packed_values(critic, pack_rows(batch, sel), sp)
        vf_loss, vf_metrics = algorithms.value_loss(
            values, batch.values[sel], batch.returns[sel], mask, c.cliprange_value, c.loss_agg_mode, **counts
        )
        weight = mask.sum() / counts["num_tokens"]
        return vf_loss, {
            "critic/vf_loss": vf_loss,
            "critic/vf_clipfrac": vf_metrics["vf_clipfrac"] * weight,
            "critic/vpred_mean": algorithms.masked_mean(values.detach(), mask) * weight,
        }

    return loss_fn


def sum_norm_scale(cfg: PPOConfig, loss_scale_factor: int | None, sp: ulysses.SPGroup) -> float:
    """What each rank divides ``seq-mean-token-sum-norm``'s token sums by: ``loss_scale_factor`` (default
    ``data.max_response_length``, the width responses are padded to) times the sequence-parallel size.
    The mode has no count to normalize by, and the ranks of a sequence-parallel group each compute the
    loss of the group's whole rows: each takes ``1/sp`` of it, as the token counts (which count every
    token ``sp`` times) do for the other modes, so the ranks' losses and gradients sum to the batch's."""
    return float(loss_scale_factor or cfg.data.max_response_length) * sp.size


def actor_loss(
    cfg: PPOConfig,
    actor: torch.nn.Module,
    batch: Batch,
    sp: ulysses.SPGroup,
    *,
    cov_mask: torch.Tensor | None = None,
) -> LossFn:
    """The actor's share of a mini-batch's loss on the rows ``sel`` of ``batch``: the policy loss of
    ``actor.policy_loss.loss_mode``, minus the entropy bonus, plus the KL loss; with the on-policy
    shortcut the old log-probs are the forward's own, detached. ``cov_mask [B, R]``: Clip-Cov's or
    KL-Cov's tokens of the current mini-batch (``cov_selection`` fills it before the mini-batch)."""
    a = cfg.actor
    on_policy = cfg.on_policy
    scale = sum_norm_scale(cfg, a.loss_scale_factor, sp)

    def loss_fn(sel: torch.Tensor, counts: dict[str, float]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        counts = {**counts, "loss_scale_factor": scale}
        mask = batch.loss_mask[sel]
        logprobs, entropy = ulysses.packed_logprobs(
            actor,
            pack_rows(batch, sel),
            sp,
            temperature=cfg.rollout.temperature,
            backend=a.kernels,
            compute_entropy=True,  # logged every step; its gradient only with an entropy bonus
            fused=a.use_fused_kernels,
        )
        old_logprobs = logprobs.detach() if on_policy else batch.old_logprobs[sel]
        is_weights, mismatch = off_policy_weights(cfg, old_logprobs, batch, sel)
        pg_loss, pg_metrics = algorithms.policy_loss(
            logprobs,
            old_logprobs,
            batch.advantages[sel],
            mask,
            a.clip_ratio_low,
            a.clip_ratio_high,
            a.clip_ratio_c,
            a.loss_agg_mode,
            is_weights=is_weights,
            loss_mode=a.policy_loss.loss_mode,
            cov_mask=None if cov_mask is None else cov_mask[sel],
            ppo_kl_coef=a.policy_loss.ppo_kl_coef,
            **counts,
        )
        if not a.entropy_coeff:
            entropy = entropy.detach()
        entropy_loss = algorithms.agg_loss(entropy, mask, a.loss_agg_mode, **counts)
        loss = pg_loss - a.entropy_coeff * entropy_loss if a.entropy_coeff else pg_loss
        weight = mask.sum() / counts["num_tokens"]
        # The metric is the mean token entropy whatever the aggregation (a sum under token-sum modes).
        mean_entropy = algorithms.agg_loss(entropy.detach(), mask, "token-mean", counts["num_tokens"])
        parts = {"actor/pg_loss": pg_loss, "actor/entropy": mean_entropy}
        parts.update({f"actor/{k}": v * weight for k, v in pg_metrics.items()})
        parts.update({f"mismatch/{k}": v * weight for k, v in mismatch.items()})
        if a.use_kl_loss:
            kl = kl_estimate(logprobs, batch.ref_logprobs[sel], a.kl_loss_type, a.kernels)
            kl_loss = algorithms.agg_loss(kl, mask, a.loss_agg_mode, **counts)
            loss = loss + a.kl_loss_coef * kl_loss
            parts["actor/kl_loss"] = kl_loss
        if on_policy and batch.old_logprobs is None and batch.ref_logprobs is not None:
            # The scoring forward was skipped: the step's KL to the reference from this forward.
            seq_kl = algorithms.masked_mean(logprobs.detach() - batch.ref_logprobs[sel], mask, dim=-1)
            parts["actor/ref_kl"] = seq_kl.sum() / counts["num_seqs"]
        return loss, parts

    return loss_fn


def cov_selection(
    cfg: PPOConfig, batch: Batch, cov_mask: torch.Tensor, sp: ulysses.SPGroup, *, dp_rank: int, step: int
) -> MiniBatchHook:
    """The hook that fills ``cov_mask [B, R]`` with Clip-Cov's or KL-Cov's tokens of each mini-batch
    (``algorithms.clip_cov_selection`` / ``kl_cov_selection``), over all ranks, before its micro-batches.

    verl picks them in each micro-batch from that micro-batch's current log-probs, so its result changes
    with the micro-batch split and the number of ranks. Here the pick is once per mini-batch, from what
    does not change within it: the covariance of the advantages and the *old* log-probs, means over the
    whole mini-batch on every rank; tokens are named by their place in the global batch (``dp_rank``: the
    index of this rank's data-parallel group), so 1 rank, 2 ranks and sequence parallelism pick the same.
    Clip-Cov's random draw comes from a generator seeded by ``(trainer.seed, step, update)``, which the
    checkpoint holds: a resumed or rolled-back step draws the same tokens."""
    p = cfg.actor.policy_loss
    num_rows, width = batch.response_mask.shape
    rows = dp_rank * num_rows + torch.arange(num_rows, device=cov_mask.device)
    token_ids = rows[:, None] * width + torch.arange(width, device=cov_mask.device)[None, :]

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(t).div_(sp.size)  # the ranks of a sequence-parallel group hold the same rows

    def all_gather(t: torch.Tensor) -> torch.Tensor:
        return torch.cat(all_gather_object(t.cpu() if sp.rank == 0 else t[:0].cpu()))  # each row once

    def hook(idx: torch.Tensor, update: int) -> None:
        mask = batch.loss_mask[idx]
        cov = algorithms.token_covariance(
            batch.advantages[idx], batch.old_logprobs[idx], mask, all_reduce=all_reduce
        )
        if p.loss_mode == "clip_cov":
            seed = (cfg.trainer.seed * 1_000_003 + step) * 1_000_003 + update
            chosen = algorithms.clip_cov_selection(
                cov,
                mask,
                token_ids[idx],
                ratio=p.clip_cov_ratio,
                lb=p.clip_cov_lb,
                ub=p.clip_cov_ub,
                generator=torch.Generator().manual_seed(seed % 2**63),
                all_reduce=all_reduce,
                all_gather=all_gather,
            )
        else:
            chosen = algorithms.kl_cov_selection(
                cov, mask, token_ids[idx], ratio=p.kl_cov_ratio, all_reduce=all_reduce, all_gather=all_gather
            )
        cov_mask.zero_()
        cov_mask[idx] = chosen

    return hook


def off_policy_weights(
    cfg: PPOConfig, old_logprobs: torch.Tensor, batch: Batch, sel: torch.Tensor
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """With ``algorithm.rollout_is_threshold``: the truncated importance weights of the rows ``sel``
    against the policy that sampled the offline responses (applied with ``algorithm.rollout_is``) and
    the ``mismatch/*`` metrics; else ``(None, {})``."""
    alg = cfg.algorithm
    if alg.rollout_is_threshold is None:
        return None, {}
    rollout_logprobs, mask = batch.data_logprobs[sel], batch.loss_mask[sel]
    metrics = algorithms.mismatch_metrics(old_logprobs, rollout_logprobs, mask, alg.rollout_is_threshold)
    if not alg.rollout_is:
        return None, metrics
    weights = algorithms.rollout_is_weights(
        old_logprobs, rollout_logprobs, mask, level=alg.rollout_is_level, threshold=alg.rollout_is_threshold
    )
    metrics["rollout_is_weight_mean"] = algorithms.masked_mean(weights, mask)
    return weights, metrics


# ----------------------------------------------------------------------------------------------------
# 5. log
# ----------------------------------------------------------------------------------------------------


def validation_due(cfg: PPOConfig, run: Run) -> bool:
    """Every ``trainer.test_freq`` steps and after the last, when there are validation prompts."""
    step, freq = run.state.step, cfg.trainer.test_freq
    return bool(run.val_records) and freq > 0 and (step % freq == 0 or step == run.total_steps)


def log_step(cfg: PPOConfig, run: Run, metrics: dict[str, float]) -> dict[str, float]:
    """Record the step's metrics with the trainer's counters and the health warnings that fire now.

    A validation score more than ``trainer.rollback_val_drop`` below the best so far ends the step with a
    rollback (after its metrics are logged); a new best is remembered."""
    state = run.state
    metrics = metrics | {
        "trainer/skipped_steps": float(state.skipped_steps),
        "trainer/rollbacks": float(state.rollbacks),
    }
    score, best, drop = metrics.get("val/score"), state.best_val, cfg.trainer.rollback_val_drop
    if score is not None and drop > 0 and best is not None and score < best * (1 - drop):
        run.metrics_logger.log(state.step, metrics)
        raise EndStep(
            "rollback", f"validation score {score:.4f} fell more than {drop:.0%} below the best {best:.4f}"
        )
    if score is not None and (best is None or score > best):
        state.best_val = score
    metrics.update(run.monitor.check(state.step, metrics))
    run.metrics_logger.log(state.step, metrics)
    return metrics


# ----------------------------------------------------------------------------------------------------
# 6. checkpoint
# ----------------------------------------------------------------------------------------------------


def save(run: Run) -> None:
    """Checkpoint the step just done. Reaching a new checkpoint is progress: the rollbacks "in a row"
    counted against ``algorithm.max_rollbacks`` start again from 0."""
    run.state.consecutive_rollbacks = 0
    run.checkpointer.save(run.state.step)


# ----------------------------------------------------------------------------------------------------
# Steps that end early: stop, rollback, skip
# ----------------------------------------------------------------------------------------------------


@dataclass
class EndStep(Exception):
    """Raised at a boundary of a step that cannot or must not go on; ``end_step`` handles every kind."""

    kind: Literal["stop", "rollback", "skip"]
    reason: str


def at_boundary(stop: runner.StopRequest) -> None:
    """A phase boundary before the update: end the step if any rank was asked to stop (collective)."""
    if stop.requested():
        raise EndStep("stop", stop.name or "stop signal")


def step_start(run: Run) -> dict[str, object]:
    """What a step changes before its first update: the data position and this rank's RNG streams."""
    return {"loader": run.loader.state_dict(), "rng": checkpoint_files.rng_state()}


def end_step(cfg: PPOConfig, run: Run, start: dict[str, object], end: EndStep) -> bool:
    """Handle a step that ended early; True when the run stops.

    - ``stop``: nothing was updated: undo the step (data position and RNG back to its start), checkpoint
      the last complete one (unless it is the latest already), so a resumed run redoes this step exactly.
    - ``rollback``: restore the last checkpoint with smaller learning rates (``checkpointer.roll_back``);
      ``algorithm.max_rollbacks`` in a row without a new checkpoint stop the run with an error.
    - ``skip`` (a non-finite reward): nothing is updated, the step still counts (and is checkpointed when
      due, so earlier updates are never lost); ``trainer.max_skipped_steps`` in a row stop the run.
    """
    state = run.state
    if end.kind == "stop":
        run.loader.load_state_dict(start["loader"])
        checkpoint_files.set_rng_state(start["rng"])
        state.step -= 1
        run.checkpointer.wait()  # a background save of the last step counts
        latest = checkpoint_files.checkpoints_dir(run.out_dir) / "latest"
        if not (latest.is_file() and latest.read_text() == f"step_{state.step:08d}"):
            save(run)
        log_stopped(state.step, end.reason)
        return True
    if end.kind == "rollback":
        a = cfg.algorithm
        step = state.step
        roll_back(
            run.checkpointer, state, end.reason, lr_factor=a.rollback_lr_factor, max_rollbacks=a.max_rollbacks
        )
        run.metrics_logger.log(
            step, {"trainer/rollbacks": state.rollbacks, "trainer/lr_scale": state.lr_scale}
        )
        return False
    state.skipped_steps += 1
    state.consecutive_skipped_steps += 1
    logger.warning(
        "step %d: %s; the step is skipped (%d so far)", state.step, end.reason, state.skipped_steps
    )
    run.metrics_logger.log(state.step, {"trainer/skipped_steps": float(state.skipped_steps)})
    if save_due(state.step, run.total_steps, cfg.trainer.save_freq):
        save(run)
    if state.consecutive_skipped_steps >= cfg.trainer.max_skipped_steps:
        raise runner.TrainingError(
            f"step {state.step}: {state.consecutive_skipped_steps} steps in a row had a non-finite reward "
            f"(trainer.max_skipped_steps={cfg.trainer.max_skipped_steps}); check the reward function or model"
        )
    return False


if __name__ == "__main__":
    sys.exit(main())
