"""KL-regularized PPO for causal language models: one SPMD program that every rank runs.

    torchrun --nproc_per_node=8 train_ppo.py --config configs/X.yaml [section.key=value ...]
    python train_ppo.py --config configs/X.yaml --print-config [--world-size 32]

A step is a straight line: 1. rollout (HF generate, parameters gathered once), 2. score (old and
reference log-probs, values, rewards), 3. advantages (KL in the reward, GAE | GRPO | RLOO), 4. update
(critic, then actor: epochs x mini-batches x token-budget micro-batches), 5. log (one cross-rank
reduction), 6. checkpoint. Every rank runs the same lines; only rank 0 writes files. ``build`` makes
everything the loop needs once; ``train`` is the loop; the step functions follow in step order.
"""

from __future__ import annotations

import logging
import sys

import torch

import kernels
from ppo import algorithms, checkpoint, lora, offline, rewards, runner, sharding, ulysses
from ppo.build import KLController, Run, build, uses_reward_model
from ppo.checkpointer import roll_back
from ppo.config import PPOConfig
from ppo.distributed import DistInfo, agree_on_failure, all_reduce_scalar, all_reduce_sum, reduce_metrics
from ppo.metrics import Timer, batch_metrics, perf_metrics, profiled
from ppo.packing import all_rows, micro_batches, pack_rows, unpack
from ppo.rollout import Batch, decode_responses, gather_group, group_index, sample
from ppo.update import optimize
from ppo.validation import validate

logger = logging.getLogger("ppo")


def main(argv: list[str] | None = None) -> int:
    return runner.run(argv, PPOConfig, train, __doc__)


def train(cfg: PPOConfig, info: DistInfo) -> None:
    run = build(cfg, info)
    state = run.state
    if cfg.trainer.val_before_train and state.step == 0 and run.val_records:
        val_metrics = validate(cfg, info, run)
        state.best_val = val_metrics.get("val/score")
        run.metrics_logger.log(0, val_metrics)
    stop = runner.StopRequest()
    on_policy = cfg.actor.ppo_epochs == 1 and cfg.actor.ppo_mini_batch_size == cfg.data.train_batch_size
    while state.step < run.total_steps:
        start = step_start(run)
        state.step += 1
        step = state.step
        timer = Timer()
        metrics: dict[str, float] = {}
        with profiled(cfg.trainer.profile_steps, step, run.out_dir), timer("step"):
            # 1. rollout: n responses per prompt, sampled by each rank for its own prompts, or read from
            # the offline data set (rollout.source, rollout.offline_fraction)
            batch = collect(cfg, run, next(run.loader), timer)
            if run.sp.size > 1:  # the ranks of a sequence-parallel group score and train the same batch
                batch = gather_group(batch, run.sp, run.tokenizer.pad_token_id, cfg.rollout.n)
            if stop.requested():  # nothing updated yet: undo the step, save the last complete one
                abandon_step(cfg, run, start, stop.name)
                break

            # 2. score: old and reference log-probs, values, rewards (all without gradients)
            if needs_old_logprobs(cfg, on_policy):
                with timer("old_log_prob"):
                    batch.old_logprobs = score_logprobs(
                        cfg, run.actor, batch, cfg.actor.ppo_micro_batch_size_per_gpu, run.sp
                    )
            if run.ref is not None:
                with timer("ref"):
                    with lora.adapters_disabled(run.ref):  # a no-op for a separately loaded reference
                        batch.ref_logprobs = score_logprobs(
                            cfg, run.ref, batch, cfg.ref.log_prob_micro_batch_size_per_gpu, run.sp
                        )
                    if cfg.algorithm.use_kl_in_reward and cfg.algorithm.kl_penalty == "full":
                        batch.full_kl = score_full_kl(cfg, run.actor, run.ref, batch, run.sp)
                    if run.ref is not run.actor:  # the actor's root stays gathered for its next forward
                        sharding.release(run.ref)
                if batch.old_logprobs is not None:
                    metrics["actor/ref_kl"] = ref_kl(
                        batch.old_logprobs, batch.ref_logprobs, batch.response_mask
                    )
                # KL explosion: go back to the last good checkpoint with a smaller learning rate.
                if cfg.algorithm.rollback_kl > 0 and all_reduce_scalar(metrics["actor/ref_kl"], "mean") > (
                    cfg.algorithm.rollback_kl
                ):
                    reason = f"KL to the reference above algorithm.rollback_kl={cfg.algorithm.rollback_kl}"
                    rollback_and_log(cfg, run, reason)
                    continue
            if run.critic is not None:
                with timer("values"):
                    batch.values = score_values(cfg, run.critic, batch, run.sp)
            with timer("reward"):
                batch.scores = compute_scores(cfg, run, batch)
            # A NaN or infinite reward anywhere skips the step on every rank: nothing is updated.
            if all_reduce_scalar(float(not torch.isfinite(batch.scores).all()), "max"):
                skip_step(cfg, run)
                continue
            state.consecutive_skipped_steps = 0
            if stop.requested():
                abandon_step(cfg, run, start, stop.name)
                break

            # 3. advantages: KL in the reward, then GAE or a group baseline
            with timer("adv"):
                metrics.update(compute_advantages(cfg, batch, run.kl_ctrl, step))

            # 4. update: the critic first (it learns the new returns), then the actor
            if run.critic is not None:
                with timer("update_critic"):
                    metrics.update(update_critic(cfg, run, batch))
            if step >= cfg.trainer.critic_warmup:  # verl's rule: the actor starts at step critic_warmup
                with timer("update_actor"):
                    metrics.update(update_actor(cfg, run, batch, on_policy))

            # 5. log: one cross-rank reduction per step, then validation and health warnings
            global_metrics = batch_metrics(cfg, batch)
            metrics = reduce_metrics(metrics)
            metrics.update(global_metrics)
            if cfg.trainer.test_freq > 0 and (step % cfg.trainer.test_freq == 0 or step == run.total_steps):
                if run.val_records:
                    with timer("testing"):
                        metrics.update(validate(cfg, info, run))
        metrics.update(perf_metrics(cfg, run, batch, metrics, timer.times, info))
        metrics["trainer/skipped_steps"] = float(state.skipped_steps)
        metrics["trainer/rollbacks"] = float(state.rollbacks)
        if validation_dropped(cfg, run, metrics):
            continue
        metrics.update(run.monitor.check(step, metrics))
        run.metrics_logger.log(step, metrics)

        # 6. checkpoint: sharded, atomic, resumable; also when asked to stop (SIGTERM from Slurm or
        # torchrun, Ctrl-C), so that a preempted job resumes from this step.
        stopping = stop.requested()
        if save_due(cfg, run) or stopping:
            save(cfg, run)
        if stopping:
            logger.warning(
                "stopping: saved step %d (%s); resume with trainer.resume_mode=auto", step, stop.name
            )
            break

    if cfg.trainer.save_hf_on_end:
        lora.save_hf(
            run.actor,
            run.tokenizer,
            run.out_dir / "hf",
            is_main=info.is_main,
            merged=cfg.actor.lora.save_merged,
        )
    run.metrics_logger.close()


# ----------------------------------------------------------------------------------------------------
# Steps that do not run to the end: shortcut, stop, rollback, skip
# ----------------------------------------------------------------------------------------------------


def needs_old_logprobs(cfg: PPOConfig, on_policy: bool) -> bool:
    """On-policy (one epoch, one mini-batch) the ratio is exactly 1, so the update uses its own
    detached log-probs as the old ones (verl's shortcut) and the scoring forward is needed only for
    the KL in the reward and the rollback check."""
    return not on_policy or cfg.algorithm.use_kl_in_reward or cfg.algorithm.rollback_kl > 0


def step_start(run: Run) -> dict[str, object]:
    """What a step changes before its first update: the data position and this rank's RNG streams."""
    return {"loader": run.loader.state_dict(), "rng": checkpoint.rng_state()}


def abandon_step(cfg: PPOConfig, run: Run, start: dict[str, object], reason: str) -> None:
    """Stop inside a step before anything was updated: undo the step (data position and RNG back to its
    start) and checkpoint the last complete one, so a resumed run redoes this step exactly."""
    run.loader.load_state_dict(start["loader"])
    checkpoint.set_rng_state(start["rng"])
    run.state.step -= 1
    latest = checkpoint.checkpoints_dir(run.out_dir) / "latest"
    if not (latest.is_file() and latest.read_text() == f"step_{run.state.step:08d}"):
        save(cfg, run)
    logger.warning(
        "stopping: saved step %d (%s); resume with trainer.resume_mode=auto", run.state.step, reason
    )


def save_due(cfg: PPOConfig, run: Run) -> bool:
    """A periodic checkpoint is due: every ``trainer.save_freq`` steps and after the last (verl's rule;
    ``save_freq <= 0`` saves only when asked to stop)."""
    step = run.state.step
    return cfg.trainer.save_freq > 0 and (step % cfg.trainer.save_freq == 0 or step == run.total_steps)


def save(cfg: PPOConfig, run: Run) -> None:
    """Checkpoint the step just done. Reaching a new checkpoint is progress: the rollbacks "in a row"
    counted against ``algorithm.max_rollbacks`` start again from 0."""
    run.state.consecutive_rollbacks = 0
    run.checkpointer.save(run.state.step)


def rollback_and_log(cfg: PPOConfig, run: Run, reason: str) -> None:
    """Restore the last checkpoint with smaller learning rates (``checkpointer.roll_back``) and log it."""
    a = cfg.algorithm
    step = run.state.step
    roll_back(
        run.checkpointer, run.state, reason, lr_factor=a.rollback_lr_factor, max_rollbacks=a.max_rollbacks
    )
    run.metrics_logger.log(
        step, {"trainer/rollbacks": run.state.rollbacks, "trainer/lr_scale": run.state.lr_scale}
    )


def skip_step(cfg: PPOConfig, run: Run) -> None:
    """A non-finite reward: nothing is updated, the step still counts (and is checkpointed when due, so
    the previous updates are never lost); too many in a row stop the run."""
    state = run.state
    state.skipped_steps += 1
    state.consecutive_skipped_steps += 1
    logger.warning(
        "step %d: non-finite reward; the step is skipped (%d so far)", state.step, state.skipped_steps
    )
    run.metrics_logger.log(state.step, {"trainer/skipped_steps": float(state.skipped_steps)})
    if save_due(cfg, run):
        save(cfg, run)
    if state.consecutive_skipped_steps >= cfg.trainer.max_skipped_steps:
        raise runner.TrainingError(
            f"step {state.step}: {state.consecutive_skipped_steps} steps in a row had a non-finite reward "
            f"(trainer.max_skipped_steps={cfg.trainer.max_skipped_steps}); check the reward function or model"
        )


def validation_dropped(cfg: PPOConfig, run: Run, metrics: dict[str, float]) -> bool:
    """Roll back when the validation score fell more than ``trainer.rollback_val_drop`` below the best;
    otherwise remember a new best. True when it rolled back."""
    score, best = metrics.get("val/score"), run.state.best_val
    drop = cfg.trainer.rollback_val_drop
    if score is None:
        return False
    if drop > 0 and best is not None and score < best * (1 - drop):
        run.metrics_logger.log(run.state.step, metrics)
        rollback_and_log(
            cfg, run, f"validation score {score:.4f} fell more than {drop:.0%} below the best {best:.4f}"
        )
        return True
    if best is None or score > best:
        run.state.best_val = score
    return False


# ----------------------------------------------------------------------------------------------------
# 1. rollout
# ----------------------------------------------------------------------------------------------------


def collect(cfg: PPOConfig, run: Run, items: list, timer: Timer) -> Batch:
    """This rank's step batch: ``n`` responses to each of its prompts, sampled (``items`` are prompt
    records) or, for ``rollout.offline_fraction`` of the groups, the offline data set's responses
    (``items`` are ``offline.OfflineGroup``), exactly as ``generate`` would have returned them. Groups
    are rows ``[g*n, (g+1)*n)``: offline groups first."""
    n = cfg.rollout.n
    fraction = cfg.rollout.offline_fraction
    if fraction == 0:
        records = [r for r in items for _ in range(n)]
        with timer("gen"):
            rollout = sample(cfg, run, records, do_sample=cfg.rollout.do_sample)
        return Batch(rollout=rollout, records=records, group_ids=group_index(len(records), n, run.device))
    given = items[: offline.num_offline_groups(len(items), fraction)]
    parts = [
        offline.offline_rollout(
            given,
            max_response_length=cfg.data.max_response_length,
            pad_token_id=run.tokenizer.pad_token_id,
            eos_token_ids=run.eos_ids,
            device=run.device,
        )
    ]
    if fraction < 1:  # every rank has the same number of sampled groups: all join the generation
        with timer("gen"):
            prompts = [g.record for g in items[len(given) :] for _ in range(n)]
            parts.append(sample(cfg, run, prompts, do_sample=cfg.rollout.do_sample))
    else:
        timer.times["timing_s/gen"] = 0.0  # nothing sampled in the loop
    records = [g.record for g in items for _ in range(n)]
    sampled = len(records) - len(given) * n
    ranks = offline.dataset_ranks(given, run.device) if given else torch.zeros(0, dtype=torch.long)
    data_scores = torch.full((len(records),), float("nan"), device=run.device)
    if cfg.reward.style == "dataset":
        data_scores[: len(given) * n] = offline.dataset_scores(given, run.device)
    return Batch(
        rollout=offline.concat_rollouts(parts),
        records=records,
        group_ids=group_index(len(records), n, run.device),
        data_ranks=torch.cat([ranks.to(run.device), torch.full((sampled,), -1, device=run.device)]),
        data_scores=data_scores,
    )


# ----------------------------------------------------------------------------------------------------
# 2. score
# ----------------------------------------------------------------------------------------------------


@torch.no_grad()
def score_logprobs(
    cfg: PPOConfig, model: torch.nn.Module, batch: Batch, micro_batch_size: int, sp: ulysses.SPGroup
) -> torch.Tensor:
    """Log-probs ``[B, R]`` of the sampled tokens under ``model`` at the rollout temperature."""
    out = torch.zeros_like(batch.response_mask, dtype=torch.float32)
    for sel in micro_batches(batch, all_rows(batch), cfg.actor, micro_batch_size):
        out[sel], _ = ulysses.packed_logprobs(
            model,
            pack_rows(batch, sel),
            sp,
            temperature=cfg.rollout.temperature,
            backend=cfg.actor.kernels,
            fused=cfg.actor.use_fused_kernels,
        )
    return out


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
    for sel in micro_batches(batch, all_rows(batch), cfg.actor):
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
    for sel in micro_batches(batch, all_rows(batch), cfg.critic):
        out[sel] = ulysses.packed_values(critic, pack_rows(batch, sel), sp)
    return out


def ref_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over sequences of the per-token ``log pi - log pi_ref`` (k1) of the sampled tokens: how far the
    policy has moved from the reference, whatever KL terms the run uses."""
    d = torch.where(mask, logprobs - ref_logprobs, torch.zeros_like(logprobs))
    return (d.sum(-1) / mask.sum(-1).clamp(min=1)).mean().item()


def compute_scores(cfg: PPOConfig, run: Run, batch: Batch) -> torch.Tensor:
    """Per-sequence scores ``[B]``: the rule or the reward model; with ``reward.style=ranking`` scores
    from each group's ranks (the data set's for offline groups, by the rule or the reward model for
    sampled ones); with ``reward.style=dataset`` the data set's scores. A reward function that fails on
    any rank stops every rank."""
    style = cfg.reward.style
    if style == "dataset":
        return batch.data_scores
    offline_rows = batch.data_ranks >= 0 if batch.data_ranks is not None else None
    data_only = style == "ranking" and offline_rows is not None and bool(offline_rows.all())
    scores = torch.zeros(len(batch.records)) if data_only else raw_scores(cfg, run, batch)
    if style == "ranking":
        group_ids = batch.group_ids.cpu()
        scores = rewards.rank_scores(scores, group_ids, cfg.reward.rank_scores)
        if offline_rows is not None and bool(offline_rows.any()):
            rows = offline_rows.cpu()
            scores[rows] = rewards.scores_from_ranks(
                batch.data_ranks[offline_rows].cpu(), cfg.rollout.n, cfg.reward.rank_scores
            )
    return scores.to(batch.response_mask.device)


def raw_scores(cfg: PPOConfig, run: Run, batch: Batch) -> torch.Tensor:
    """``[B]`` (CPU) scores of the responses by the reward model or the rule."""
    if uses_reward_model(cfg):
        return rewards.rollout_reward_model_scores(
            run.reward_model, batch.rollout, micro_batch_size=cfg.reward.micro_batch_size_per_gpu
        )
    texts = decode_responses(run.tokenizer, batch.rollout)

    def rule_scores() -> torch.Tensor:
        return torch.tensor(
            [
                run.scorer(r.data_source, t, r.ground_truth, r.extra_info)
                for r, t in zip(batch.records, texts, strict=True)
            ],
            dtype=torch.float32,
        )

    return agree_on_failure(rule_scores, rewards.RewardError)


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
    """Token rewards (score on the last response token, minus the in-reward KL penalty) and advantages.

    The group estimators (GRPO, RLOO) take each sequence's summed token rewards, as verl does
    (``token_level_rewards.sum(-1)``): with KL in the reward, a sequence that drifted from the reference
    earns less than its score.
    """
    mask = batch.response_mask
    last = (mask.sum(-1) - 1).clamp(min=0)
    rows = torch.arange(mask.shape[0], device=mask.device)
    token_rewards = torch.zeros_like(mask, dtype=torch.float32)
    token_rewards[rows, last] = batch.scores
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
        seq_kl = (kl.sum(-1) / mask.sum(-1).clamp(min=1)).mean().item()
        metrics["actor/reward_kl_penalty"] = seq_kl
        metrics["actor/reward_kl_penalty_coeff"] = beta  # the coefficient used on this batch
        current_kl = all_reduce_scalar(seq_kl, "mean")
        if step > cfg.algorithm.kl_ctrl.fixed_warmup_steps:
            kl_ctrl.update(current_kl, n_steps=cfg.data.train_batch_size * cfg.rollout.n)
    batch.token_rewards = token_rewards
    est = cfg.algorithm.adv_estimator
    sp_size = cfg.actor.ulysses_sequence_parallel_size
    if est == "gae":
        batch.advantages, batch.returns = algorithms.compute_gae(
            token_rewards,
            batch.values,
            mask,
            cfg.algorithm.gamma,
            cfg.algorithm.lam,
            # The ranks of a sequence-parallel group hold the same tokens: count them once.
            all_reduce=lambda t: all_reduce_sum(t).div_(sp_size),
        )
        return metrics
    seq_rewards = token_rewards.sum(-1)
    if est == "grpo":
        batch.advantages = algorithms.compute_grpo_advantages(
            seq_rewards, batch.group_ids, mask, norm_by_std=cfg.algorithm.norm_adv_by_std_in_grpo
        )
    else:
        batch.advantages = algorithms.compute_rloo_advantages(seq_rewards, batch.group_ids, mask)
    batch.returns = batch.advantages
    return metrics


# ----------------------------------------------------------------------------------------------------
# 4. update
# ----------------------------------------------------------------------------------------------------


def update_critic(cfg: PPOConfig, run: Run, batch: Batch) -> dict[str, float]:
    """Clipped value regression on the returns (``optimize`` with the critic's loss)."""
    c = cfg.critic
    critic = run.critic

    def loss_fn(sel: torch.Tensor, counts: dict[str, float]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = batch.response_mask[sel]
        values = ulysses.packed_values(critic, pack_rows(batch, sel), run.sp)
        vf_loss, vf_metrics = algorithms.value_loss(
            values, batch.values[sel], batch.returns[sel], mask, c.cliprange_value, c.loss_agg_mode, **counts
        )
        weight = mask.sum() / counts["num_tokens"]
        return vf_loss, {
            "critic/vf_loss": vf_loss,
            "critic/vf_clipfrac": vf_metrics["vf_clipfrac"] * weight,
            "critic/vpred_mean": algorithms.masked_mean(values.detach(), mask) * weight,
        }

    lr = run.critic_opt.param_groups[0]["lr"]  # the rate this step's updates use
    out = optimize(
        c,
        "critic",
        critic,
        run.critic_opt,
        batch,
        loss_fn,
        num_mini=cfg.data.train_batch_size // c.ppo_mini_batch_size,
        shuffle=cfg.actor.shuffle,
        sp=run.sp,
    )
    run.critic_sched.step()
    out["critic/lr"] = lr
    return out


def update_actor(cfg: PPOConfig, run: Run, batch: Batch, on_policy: bool) -> dict[str, float]:
    """Clipped PPO on the advantages, with the entropy bonus and the KL loss (``optimize`` with the
    actor's loss); stops early once a mini-batch's ``ppo_kl`` exceeds ``actor.early_stop_kl``."""
    a = cfg.actor
    actor = run.actor

    def loss_fn(sel: torch.Tensor, counts: dict[str, float]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = batch.response_mask[sel]
        logprobs, entropy = ulysses.packed_logprobs(
            actor,
            pack_rows(batch, sel),
            run.sp,
            temperature=cfg.rollout.temperature,
            backend=a.kernels,
            compute_entropy=True,  # logged every step; its gradient only with an entropy bonus
            fused=a.use_fused_kernels,
        )
        old_logprobs = logprobs.detach() if on_policy else batch.old_logprobs[sel]
        pg_loss, pg_metrics = algorithms.policy_loss(
            logprobs,
            old_logprobs,
            batch.advantages[sel],
            mask,
            a.clip_ratio_low,
            a.clip_ratio_high,
            a.clip_ratio_c,
            a.loss_agg_mode,
            **counts,
        )
        if not a.entropy_coeff:
            entropy = entropy.detach()
        entropy_loss = algorithms.agg_loss(entropy, mask, a.loss_agg_mode, **counts)
        loss = pg_loss - a.entropy_coeff * entropy_loss if a.entropy_coeff else pg_loss
        weight = mask.sum() / counts["num_tokens"]
        parts = {"actor/pg_loss": pg_loss, "actor/entropy": entropy_loss}
        parts.update({f"actor/{k}": v * weight for k, v in pg_metrics.items()})
        if a.use_kl_loss:
            kl = kl_estimate(logprobs, batch.ref_logprobs[sel], a.kl_loss_type, a.kernels)
            kl_loss = algorithms.agg_loss(kl, mask, a.loss_agg_mode, **counts)
            loss = loss + a.kl_loss_coef * kl_loss
            parts["actor/kl_loss"] = kl_loss
        if on_policy and batch.old_logprobs is None and batch.ref_logprobs is not None:
            # The scoring forward was skipped: the step's KL to the reference from this forward.
            d = torch.where(mask, logprobs.detach() - batch.ref_logprobs[sel], torch.zeros_like(logprobs))
            parts["actor/ref_kl"] = (d.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / counts["num_seqs"]
        return loss, parts

    lr = run.actor_opt.param_groups[0]["lr"]
    out = optimize(
        a,
        "actor",
        actor,
        run.actor_opt,
        batch,
        loss_fn,
        num_mini=cfg.data.train_batch_size // a.ppo_mini_batch_size,
        shuffle=a.shuffle,
        sp=run.sp,
        early_stop_kl=a.early_stop_kl,
    )
    run.actor_sched.step()
    out["actor/lr"] = lr  # the rate this step's updates used
    out.setdefault("actor/early_stopped", 0.0)
    if a.use_kl_loss:
        out["actor/kl_coef"] = a.kl_loss_coef
    return out


# ----------------------------------------------------------------------------------------------------
# 5. metrics and validation
# ----------------------------------------------------------------------------------------------------


if __name__ == "__main__":
    sys.exit(main())
