"""KL-regularized PPO for causal language models: one SPMD program that every rank runs.

    torchrun --nproc_per_node=8 train_ppo.py --config configs/X.yaml [section.key=value ...]
    python train_ppo.py --config configs/X.yaml --print-config [--world-size 32]

A step is a straight line: 1. rollout (HF generate, parameters gathered once; with DAPO's dynamic
sampling, rounds until enough groups score unlike), 2. score (old and reference log-probs, the
distillation teachers' log-probs, values, rewards, the overlong penalty), 3. advantages (KL in the
reward, GAE | GRPO | RLOO | REINFORCE++ | REINFORCE++-baseline | OPO; none for distillation alone),
4. update (critic, then actor: epochs x mini-batches x token-budget micro-batches; vanilla PPO, GSPO,
Clip-Cov or KL-Cov, plus or instead of them the distillation loss), 5. log (one cross-rank reduction, validation),
6. checkpoint. Every rank runs the same lines; only rank 0 writes files.
``build`` makes everything the loop needs once; ``train`` is the loop; the step functions follow in step
order, then the ways a step ends early (stop, rollback, skip), handled in one place.
"""

from __future__ import annotations

from ppo import cli
from ppo.config import PPOConfig

if __name__ == "__main__":  # --help and --print-config answer here, before torch and transformers load
    cli.answer_early(None, __doc__, PPOConfig)

# The imports below follow the early answer on purpose:
# ruff: noqa: E402
import logging

import torch

from ppo import (
    batch_advantages,
    checkpoint_files,
    distillation,
    dynamic_sampling,
    forwards,
    lora,
    monitor,
    offline,
    prime,
    rewards,
    runner,
    sppo,
    ulysses,
)
from ppo.batch import Batch, group_index
from ppo.build import Run, build
from ppo.checkpointer import log_stopped, roll_back, save_due
from ppo.distributed import (
    DistInfo,
    all_reduce_scalar,
    exit_process,
    reduce_metrics,
)
from ppo.metrics import Timer, batch_metrics, perf_metrics, profiled
from ppo.optimize import actor_loss, cov_selection, critic_loss, optimize, rollout_rejection
from ppo.periodic_validation import validate
from ppo.rollout import gather_group, sample
from ppo.rule_scoring import TrainerProgress
from ppo.step_end import EndStep, StopRequest, TrainingError

logger = logging.getLogger("ppo")


def main(argv: list[str] | None = None) -> int:
    return runner.main(argv, PPOConfig, train, __doc__)


def train(cfg: PPOConfig, info: DistInfo) -> None:
    """Build the run, validate once before training, then step until the last step or a stop signal."""
    run = build(cfg, info)
    state = run.state
    stop = StopRequest()
    if cfg.trainer.val_before_train and state.step == 0 and run.val_records:
        val_metrics = validate(cfg, info, run, stop)
        state.best_val = val_metrics.get("val/score")
        if val_metrics:  # none when a stop signal ended it
            run.metrics_logger.log(0, val_metrics)
    stopped_first = stop.requested()  # during the validation before training: no step taken, none to save
    if stopped_first:
        logger.warning("stopping before step 1 (%s): no step was taken, nothing to save", stop.name)
    while state.step < run.total_steps and not stopped_first:
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

                # 2. score: old and reference log-probs, teachers' log-probs, values, rewards (no gradients)
                metrics.update(score(cfg, run, batch, timer, stop))
                check_scores(cfg, run, batch, metrics)
                at_boundary(stop)

                # 3. advantages: PRIME's token rewards (its PRM first learns this step's outcomes, only
                # once the step is sure to train: not on a skipped, rolled-back or stopped step), KL in
                # the reward, then GAE or a group baseline
                if run.prm is not None:
                    with timer("prm"):
                        metrics.update(prime.update_prm(cfg, run.prm, batch, run.sp))
                with timer("adv"):
                    metrics.update(batch_advantages.compute_advantages(cfg, batch, run.kl_ctrl, step))

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
    hf_dir = run.out_dir / "hf" if cfg.trainer.save_hf_on_end else None
    monitor.log_run_summary(
        run.out_dir, run.metrics_logger, steps_done=state.step, stopped=stop.name, hf_dir=hf_dir
    )


# ----------------------------------------------------------------------------------------------------
# 1. rollout
# ----------------------------------------------------------------------------------------------------


def collect(cfg: PPOConfig, run: Run, timer: Timer, stop: StopRequest) -> tuple[Batch, dict[str, float]]:
    """This rank's step batch and the rollout's metrics: one round of the next prompts
    (``collect_round``), or with ``algorithm.filter_groups`` as many rounds as it takes
    (``dynamic_sampling.collect_filtered``). The ranks of a sequence-parallel group then gather their
    batches: they score and train them together."""
    metrics: dict[str, float] = {}
    if cfg.algorithm.filter_groups.enable:
        batch, metrics = dynamic_sampling.collect_filtered(
            cfg,
            run.loader,
            timer,
            sample_round=lambda items: collect_round(cfg, run, items, timer),
            score_responses=lambda b: score_responses(cfg, run, b, stop),
            between_rounds=lambda: at_boundary(stop),
            device=run.device,
        )
    elif cfg.data.filter_accuracy:  # PRIME's: oversample, then prompts neither always nor never solved
        batch, metrics = prime.collect_accuracy_filtered(
            cfg,
            run.loader,
            timer,
            sample_round=lambda items: collect_round(cfg, run, items, timer),
            score_responses=lambda b: score_responses(cfg, run, b, stop),
        )
    else:
        batch = collect_round(cfg, run, next(run.loader), timer)
    if run.sp.size > 1:
        scores = batch.scores
        batch = gather_group(batch, run.sp, run.tokenizer.pad_token_id, cfg.rollout.n)
        if scores is not None:
            batch.scores = ulysses.all_gather_rows(scores, run.sp)
    batch.share_prompts = cfg.share_prompts  # every forward of the step: each prompt once
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
        with_logprobs=cfg.algorithm.reads_data_logprobs,
        max_response_length=cfg.data.max_response_length,
        pad_token_id=run.tokenizer.pad_token_id,
        eos_token_ids=run.sampler.eos_ids,
        device=run.device,
    )


# ----------------------------------------------------------------------------------------------------
# 2. score
# ----------------------------------------------------------------------------------------------------


def score(cfg: PPOConfig, run: Run, batch: Batch, timer: Timer, stop: StopRequest) -> dict[str, float]:
    """Old log-probs (unless the on-policy shortcut makes them the update's own), reference log-probs
    (and ``actor/ref_kl``), the distillation teachers' log-probs, values and scores, into ``batch``; a
    stop signal is honoured between them."""
    metrics: dict[str, float] = {}
    if forwards.needs_old_logprobs(cfg):
        with timer("old_log_prob"):  # the actor's, or SPPO's snapshot of it (refreshed every N steps)
            actor, snapshot = run.actor.model, run.sppo_old
            sppo.refresh_snapshot(snapshot, actor, run.state.step, cfg.actor.sppo_refresh_steps)
            batch.old_logprobs = forwards.forward_old_logprobs(cfg, actor, snapshot, batch, run.sp)
        at_boundary(stop)
    if run.ref is not None:
        with timer("ref"):
            forwards.forward_reference(cfg, run.actor.model, run.ref, batch, run.sp)
        if batch.old_logprobs is not None:
            metrics["actor/ref_kl"] = forwards.ref_kl(
                batch.old_logprobs, batch.ref_logprobs, batch.response_mask
            )
        at_boundary(stop)
    if run.teachers:
        with timer("teacher"):  # each row's teacher's log-probs (or top-k), for the distillation loss
            distillation.forward_teachers(cfg, run.teachers, batch, run.sp)
        at_boundary(stop)
    if run.critic is not None:
        with timer("values"):
            batch.values = forwards.forward_values(cfg, run.critic.model, batch, run.sp)
        at_boundary(stop)
    with timer("reward"):
        if batch.scores is None:  # dynamic sampling and the accuracy filter scored their rounds already
            raw, reward_metrics = score_responses(cfg, run, batch, stop)
            batch.scores, shaping_metrics = rewards.shape_scores(
                raw, batch.attention_mask, cfg.reward, max_response_length=cfg.data.max_response_length
            )
            metrics.update(reward_metrics)
            metrics.update(shaping_metrics)
    return metrics


def score_responses(
    cfg: PPOConfig, run: Run, batch: Batch, stop: StopRequest
) -> tuple[torch.Tensor, dict[str, float]]:
    """``[B]`` the reward's score of each response (``rewards.batch_scores``), before any shaping, and
    the rule's metrics (``reward/extra/*``; a list of functions: ``reward/<name>/{mean,std}``; with
    ``reward.pool_workers``, ``reward/{timeouts,errors}``). TRL-style functions see the steps done before
    this one as ``trainer_state.global_step``. Reward workers give up at once on this rank's stop signal;
    the step ends at the next boundary."""
    return rewards.batch_scores(
        batch,
        cfg.reward,
        group_size=cfg.rollout.n,
        scorer=run.scorer,
        tokenizer=run.tokenizer,
        reward_model=run.reward_model,
        pool=run.reward_pool,
        stop=lambda: stop.name is not None,
        trainer_state=TrainerProgress.after(run.state.step - 1, run.total_steps, run.loader.steps_per_epoch),
    )


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
    loss_fn = critic_loss(cfg, critic.model, batch, run.sp)
    num_mini = cfg.data.train_batch_size // c.ppo_mini_batch_size
    out = optimize(
        c, "critic", critic, batch, loss_fn, num_mini=num_mini, shuffle=cfg.actor.shuffle, sp=run.sp
    )
    critic.scheduler.step()
    out["critic/lr"] = critic.optimizer.param_groups[0]["lr"]  # verl's: the rate after the scheduler step
    return out


def update_actor(cfg: PPOConfig, run: Run, batch: Batch) -> dict[str, float]:
    """The policy loss (``actor.policy_loss.loss_mode``) on the advantages, with the entropy bonus and
    the KL loss (``optimize`` with ``actor_loss``); stops early once a mini-batch's ``ppo_kl`` exceeds
    ``actor.early_stop_kl``. Clip-Cov and KL-Cov pick their tokens once per mini-batch
    (``cov_selection``), before its micro-batches run."""
    a, actor = cfg.actor, run.actor
    cov_mask, hook = None, None
    if a.policy_loss.loss_mode in ("clip_cov", "kl_cov"):
        cov_mask = torch.zeros_like(batch.attention_mask)
        dp_rank = run.loader.rank // run.sp.size
        hook = cov_selection(cfg, batch, cov_mask, run.sp, dp_rank=dp_rank, step=run.state.step)
    kept, rejection_metrics = rollout_rejection(cfg, batch)  # algorithm.rollout_rs's tokens, else None
    out = optimize(
        a,
        "actor",
        actor,
        batch,
        actor_loss(cfg, actor.model, batch, run.sp, cov_mask=cov_mask, response_mask=kept),
        num_mini=cfg.data.train_batch_size // a.ppo_mini_batch_size,
        shuffle=a.shuffle,
        sp=run.sp,
        early_stop_kl=a.early_stop_kl,
        before_mini_batch=hook,
        response_mask=kept,
    )
    out.update(rejection_metrics)
    actor.scheduler.step()
    out["actor/lr"] = actor.optimizer.param_groups[0]["lr"]  # verl's: the rate after the scheduler step
    out.setdefault("actor/early_stopped", 0.0)
    if a.use_kl_loss:
        out["actor/kl_coef"] = a.kl_loss_coef
    return out


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


def at_boundary(stop: StopRequest) -> None:
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
        raise TrainingError(
            f"step {state.step}: {state.consecutive_skipped_steps} steps in a row had a non-finite reward "
            f"(trainer.max_skipped_steps={cfg.trainer.max_skipped_steps}); check the reward function or model"
        )
    return False


if __name__ == "__main__":
    exit_process(main())
