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
import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import kernels
from ppo import algorithms, checkpoint, data, lora, models, offline, rewards, runner, sharding, ulysses
from ppo.checkpointer import Checkpointer, TrainerState, roll_back
from ppo.config import ActorConfig, CriticConfig, PPOConfig, to_yaml
from ppo.distributed import (
    DistInfo,
    agree_on_failure,
    all_gather_object,
    all_reduce_scalar,
    all_reduce_scalars,
    all_reduce_sum,
    all_reduce_tensors,
    reduce_metrics,
)
from ppo.metrics import (
    MetricsLogger,
    Timer,
    global_stats,
    model_flops_utilization,
    peak_flops,
    profiled,
)
from ppo.monitor import HealthMonitor
from ppo.optim import build_optimizer
from ppo.packing import (
    Packed,
    pack,
    plan_micro_batches,
    unpack,
)
from ppo.rollout import Rollout, generate, generation_config

logger = logging.getLogger("ppo")

KLController = algorithms.FixedKLController | algorithms.AdaptiveKLController


@dataclass(kw_only=True)
class Batch:
    """One step's sequences on this rank. Token tensors are ``[B, R]`` over response tokens."""

    rollout: Rollout
    records: list[data.PromptRecord]
    """The prompt record of each sequence (repeated ``n`` times)."""
    group_ids: torch.Tensor
    """[B] index of the prompt a sequence answers (groups never straddle ranks)."""
    data_ranks: torch.Tensor | None = None
    """[B] the offline data set's rank of each response (0 = best), -1 for sampled ones."""
    data_scores: torch.Tensor | None = None
    """[B] the offline data set's score of each response (``reward.style=dataset``), NaN for sampled ones."""
    old_logprobs: torch.Tensor | None = None
    """[B, R] log-probs under the policy that sampled (None with the on-policy shortcut)."""
    ref_logprobs: torch.Tensor | None = None
    full_kl: torch.Tensor | None = None
    """[B, R] exact KL over the vocabulary (only with ``algorithm.kl_penalty=full``)."""
    values: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    """[B] the reward of each sequence."""
    token_rewards: torch.Tensor | None = None
    """[B, R] the score on the last response token minus the in-reward KL penalty."""
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    @property
    def response_mask(self) -> torch.Tensor:
        return self.rollout.response_mask

    @property
    def seq_lens(self) -> list[int]:
        """Packed length (prompt + valid response tokens) of each sequence."""
        resp = self.response_mask.sum(-1).tolist()
        return [p.numel() + int(r) for p, r in zip(self.rollout.prompts, resp, strict=True)]


@dataclass(kw_only=True)
class Run:
    """Everything ``build`` makes once, before step 1."""

    out_dir: Path
    device: torch.device
    tokenizer: object
    eos_ids: list[int]
    """Every token id that ends a response (tokenizer and generation config)."""
    loader: data.ShardedLoader
    val_records: list[data.PromptRecord]
    actor: torch.nn.Module
    ref: torch.nn.Module | None
    critic: torch.nn.Module | None
    reward_model: torch.nn.Module | None
    scorer: rewards.RuleScorer
    actor_opt: torch.optim.Optimizer
    actor_sched: torch.optim.lr_scheduler.LRScheduler
    critic_opt: torch.optim.Optimizer | None
    critic_sched: torch.optim.lr_scheduler.LRScheduler | None
    kl_ctrl: KLController
    checkpointer: Checkpointer
    state: TrainerState
    total_steps: int
    metrics_logger: MetricsLogger
    monitor: HealthMonitor
    num_params: int
    sp: ulysses.SPGroup
    """This rank's Ulysses sequence-parallel group (``ulysses.NO_SP`` without sequence parallelism)."""


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
        if (
            cfg.trainer.save_freq > 0
            and step % cfg.trainer.save_freq == 0
            or step == run.total_steps
            or stopping
        ):
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
# Set-up: data, models, optimizers, resume
# ----------------------------------------------------------------------------------------------------


def build(cfg: PPOConfig, info: DistInfo) -> Run:
    """Load the data and the models, build the optimizers and controllers, resume if there is a
    checkpoint. Everything that can fail on the user's input fails here, before step 1."""
    out_dir = runner.prepare_run(cfg, info, writes=run_paths(cfg))
    tokenizer = runner.load_tokenizer(cfg.model)
    scorer = rewards.make_rule_scorer(cfg.reward.custom_function, cfg.reward.format_score)

    # ---- data ----
    load = dict(
        prompt_key=cfg.data.prompt_key,
        max_prompt_length=cfg.data.max_prompt_length,
        apply_chat_template=cfg.data.apply_chat_template,
    )
    with runner.main_rank_logs(info):
        if cfg.rollout.offline_fraction > 0:  # prompt groups with their responses (offline RLHF)
            items = offline.load_offline_groups(
                cfg.data.train_files,
                tokenizer,
                group_size=cfg.rollout.n,
                max_response_length=cfg.data.max_response_length,
                require_ground_truth=needs_ground_truth(cfg),
                require_scores=cfg.reward.style == "dataset",
                **load,
            )
            train_records = [g.record for g in items]
        else:
            items = train_records = data.load_prompts(
                cfg.data.train_files, tokenizer, require_ground_truth=needs_ground_truth(cfg), **load
            )
        val_records = (
            data.load_prompts(cfg.data.val_files, tokenizer, require_ground_truth=False, **load)
            if cfg.data.val_files
            else []
        )
    if cfg.data.max_val_samples > 0:
        val_records = val_records[: cfg.data.max_val_samples]
    if needs_rule_scores(cfg):
        check_rule_coverage(cfg, train_records)
        first = train_records[0]
        rewards.check_scorer(scorer, first.data_source, first.ground_truth, first.extra_info)
    loader = runner.make_loader(items, cfg, info)
    total_steps = runner.total_steps(cfg, loader)

    # ---- models ----
    sp = ulysses.make_sp_groups(cfg.actor.ulysses_sequence_parallel_size)
    actor = runner.build_model(
        models.load_causal_lm,
        cfg.model,
        cfg.actor.fsdp,
        info,
        sequence_parallel=sp.size,
        lora_cfg=cfg.actor.lora,
        lora_key="actor.lora",
    )
    if cfg.actor.use_fused_kernels:
        models.check_fused_lm_head(actor)
    eos_ids = models.eos_token_ids(tokenizer, actor)
    if cfg.rollout.offline_fraction > 0:
        offline.check_eos(items, eos_ids)  # the model's generation config may add EOS ids
    ref = critic = reward_model = None
    if cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss or cfg.algorithm.rollback_kl > 0:
        if lora.uses_lora(cfg.actor.lora) and cfg.ref.model_path is None:
            ref = actor  # the actor with its adapters off: every reference forward is in adapters_disabled
        else:
            ref = runner.build_model(
                models.load_causal_lm,
                cfg.model,
                cfg.ref.fsdp,
                info,
                path=cfg.ref.model_path or cfg.model.path,
                path_key="ref.model_path" if cfg.ref.model_path else "model.path",
                trainable=False,
                sequence_parallel=sp.size,
            )
    if cfg.use_critic:
        critic = runner.build_model(
            models.load_critic,
            cfg.model,
            cfg.critic.fsdp,
            info,
            path=cfg.critic.model_path or cfg.model.path,
            path_key="critic.model_path" if cfg.critic.model_path else "model.path",
            sequence_parallel=sp.size,
            sp_key="critic.ulysses_sequence_parallel_size",
            lora_cfg=cfg.critic.lora,
            lora_key="critic.lora",
            trainable_head="score",
        )
    if uses_reward_model(cfg):
        reward_model = runner.build_model(
            models.load_reward_model,
            cfg.model,
            cfg.reward.fsdp,
            info,
            path=cfg.reward.model_path,
            path_key="reward.model_path",
            trainable=False,
        )

    # ---- optimizers: one learning-rate step per training step, as verl ----
    actor_opt, actor_sched = build_optimizer(actor, cfg.actor.optim, total_steps)
    critic_opt = critic_sched = None
    if critic is not None:
        critic_opt, critic_sched = build_optimizer(critic, cfg.critic.optim, total_steps)
    kl_ctrl = make_kl_controller(cfg)

    # ---- resume ----
    state = TrainerState()
    monitor = HealthMonitor(cfg=cfg)
    checkpointer = Checkpointer(
        out_dir=out_dir,
        info=info,
        config_yaml=to_yaml(cfg),
        keep=cfg.trainer.max_ckpt_to_keep,
        seed=cfg.trainer.seed,
        models={"actor": actor, "critic": critic},
        optimizers={"actor": actor_opt, "critic": critic_opt},
        schedulers={"actor": actor_sched, "critic": critic_sched},
        stateful={"trainer": state, "loader": loader, "kl_ctrl": kl_ctrl, "monitor": monitor},
    )
    resume_dir = checkpointer.restore_newest(cfg.trainer.resume_mode)
    if resume_dir is not None:
        logger.info("resumed from %s at step %d", resume_dir, state.step)
    else:
        # Sampling differs per rank from here on; checkpoints restore these streams exactly.
        checkpoint.seed_everything(cfg.trainer.seed * 1000 + info.rank)
        if cfg.algorithm.rollback_kl > 0 or cfg.trainer.rollback_val_drop > 0:
            checkpointer.save(0)  # something to roll back to before the first good step

    num_params = models.count_parameters(actor)
    logger.info(
        "world size %d on %s; %d train prompts (%d steps), %d val prompts; actor %.2fM parameters",
        info.world_size,
        info.device,
        len(train_records),
        total_steps,
        len(val_records),
        num_params / 1e6,
    )
    return Run(
        out_dir=out_dir,
        device=info.device,
        tokenizer=tokenizer,
        eos_ids=eos_ids,
        loader=loader,
        val_records=val_records,
        actor=actor,
        ref=ref,
        critic=critic,
        reward_model=reward_model,
        scorer=scorer,
        actor_opt=actor_opt,
        actor_sched=actor_sched,
        critic_opt=critic_opt,
        critic_sched=critic_sched,
        kl_ctrl=kl_ctrl,
        checkpointer=checkpointer,
        state=state,
        total_steps=total_steps,
        metrics_logger=runner.make_metrics_logger(
            cfg,
            info,
            out_dir,
            total_steps,
            console=True,
            resume_step=state.step if resume_dir is not None else None,
        ),
        monitor=monitor,
        num_params=num_params,
        sp=sp,
    )


def run_paths(cfg: PPOConfig) -> dict[Path, str]:
    """Every path in the run folder the run will write, and whether it is a folder or a file."""
    out = Path(cfg.trainer.output_dir)
    paths = {out / "checkpoints": "dir", out / "metrics.jsonl": "file", out / "tensorboard": "dir"}
    if cfg.trainer.save_hf_on_end:
        paths[out / "hf"] = "dir"
    if cfg.trainer.profile_steps:
        paths[out / "profile"] = "dir"
    return paths


def uses_reward_model(cfg: PPOConfig) -> bool:
    return cfg.reward.style == "model" or (cfg.reward.style == "ranking" and cfg.reward.ranking_by == "model")


def needs_rule_scores(cfg: PPOConfig) -> bool:
    """Whether training responses are scored by the rule: not with a reward model, and not when every
    group comes from the data set with its own ranks or scores."""
    from_data = cfg.rollout.offline_fraction == 1.0 and cfg.reward.style in ("ranking", "dataset")
    return not uses_reward_model(cfg) and not from_data


def needs_ground_truth(cfg: PPOConfig) -> bool:
    """The built-in rule scorers compare with a ground truth; a reward model or a custom function
    (which gets None) does not need one."""
    return needs_rule_scores(cfg) and cfg.reward.custom_function is None


def check_rule_coverage(cfg: PPOConfig, records: list[data.PromptRecord]) -> None:
    """Every training prompt's ``data_source`` has a rule scorer (found now, not at the first step)."""
    unknown = sorted(
        {r.data_source for r in records if not rewards.has_rule(r.data_source, cfg.reward.custom_function)}
    )
    if unknown:
        raise rewards.RewardError(
            f"no rule reward for data_source {', '.join(map(repr, unknown))} in data.train_files; known: "
            f"{', '.join(rewards.RULE_DATA_SOURCES)}. Set reward.custom_function=module:function or "
            f"file.py:function, or use a reward model (reward.style=model)"
        )


def make_kl_controller(cfg: PPOConfig) -> KLController:
    k = cfg.algorithm.kl_ctrl
    if k.type == "fixed":
        return algorithms.FixedKLController(k.kl_coef)
    return algorithms.AdaptiveKLController(k.kl_coef, k.target_kl, k.horizon)


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
    if cfg.trainer.save_freq > 0 and state.step % cfg.trainer.save_freq == 0 or state.step == run.total_steps:
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


def sample(
    cfg: PPOConfig,
    run: Run,
    records: list[data.PromptRecord],
    *,
    do_sample: bool,
    micro_batch_size: int | None = None,
    ignore_eos: bool | None = None,
) -> Rollout:
    """One response per record with the rollout settings (temperature, top-p/k, lengths, EOS ids)."""
    ignore_eos = cfg.rollout.ignore_eos if ignore_eos is None else ignore_eos
    config = generation_config(
        max_new_tokens=cfg.data.max_response_length,
        do_sample=do_sample,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        eos_token_ids=run.eos_ids,
        pad_token_id=run.tokenizer.pad_token_id,
        ignore_eos=ignore_eos,
    )
    return generate(
        run.actor,
        [torch.tensor(r.input_ids, dtype=torch.long) for r in records],
        config,
        micro_batch_size=micro_batch_size or cfg.rollout.micro_batch_size_per_gpu,
        ignore_eos=ignore_eos,
    )


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


def group_index(num_rows: int, n: int, device: torch.device) -> torch.Tensor:
    """``[B]`` the group (prompt) of each row: rows ``[g*n, (g+1)*n)`` answer prompt ``g``."""
    return torch.arange(num_rows, device=device) // n


def gather_group(batch: Batch, sp: ulysses.SPGroup, pad_token_id: int, n: int) -> Batch:
    """The batches of every rank of a sequence-parallel group, in group order: the group scores and
    trains them together, each rank on its slice of every micro-batch's tokens."""
    rollout = batch.rollout
    parts = ulysses.all_gather_object(([p.tolist() for p in rollout.prompts], batch.records), sp)
    device = rollout.responses.device
    gathered = Rollout(
        prompts=[torch.tensor(p, dtype=torch.long) for part in parts for p in part[0]],
        responses=ulysses.all_gather_rows(rollout.responses, sp, pad_token_id),
        response_mask=ulysses.all_gather_rows(rollout.response_mask, sp, False),
        truncated=ulysses.all_gather_rows(rollout.truncated.to(device), sp, False),
    )
    records = [r for part in parts for r in part[1]]
    out = Batch(rollout=gathered, records=records, group_ids=group_index(len(records), n, device))
    if batch.data_ranks is not None:
        out.data_ranks = ulysses.all_gather_rows(batch.data_ranks, sp)
        out.data_scores = ulysses.all_gather_rows(batch.data_scores, sp)
    return out


def decode_responses(tokenizer, rollout: Rollout) -> list[str]:
    """Response texts up to (not including) their EOS."""
    texts = []
    for tokens, mask in zip(rollout.responses.tolist(), rollout.response_mask.tolist(), strict=True):
        texts.append(
            tokenizer.decode([t for t, m in zip(tokens, mask, strict=True) if m], skip_special_tokens=True)
        )
    return texts


# ----------------------------------------------------------------------------------------------------
# 2. score
# ----------------------------------------------------------------------------------------------------


def micro_batches(
    batch: Batch, idx: torch.Tensor, role: ActorConfig | CriticConfig, micro_batch_size: int | None = None
) -> list[torch.Tensor]:
    """Micro-batches (index tensors into the batch) of the sequences ``idx``, agreed across ranks: the
    role's token budget with dynamic batch size, else ``micro_batch_size`` (default the role's)."""
    lens = batch.seq_lens
    groups = plan_micro_batches(
        [lens[i] for i in idx.tolist()],
        use_dynamic_bsz=role.use_dynamic_bsz,
        # A sequence-parallel group splits each micro-batch over its ranks: its budget is theirs together.
        max_tokens=role.ppo_max_token_len_per_gpu * role.ulysses_sequence_parallel_size,
        micro_batch_size=micro_batch_size or role.ppo_micro_batch_size_per_gpu,
    )
    return [idx[torch.tensor(g, dtype=torch.long, device=idx.device)] for g in groups]


def pack_rows(batch: Batch, sel: torch.Tensor) -> Packed:
    return pack(
        [batch.rollout.prompts[i] for i in sel.tolist()],
        batch.rollout.responses[sel],
        batch.response_mask[sel],
    )


def all_rows(batch: Batch) -> torch.Tensor:
    return torch.arange(len(batch.records), device=batch.response_mask.device)


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
        return reward_model_scores(cfg, run.reward_model, batch.rollout)
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


def reward_model_scores(cfg: PPOConfig, reward_model: torch.nn.Module, rollout: Rollout) -> torch.Tensor:
    """The reward model's score of each sequence ``[B]`` (CPU), read at its last token."""
    lengths = rollout.response_mask.sum(-1).tolist()
    seqs = [
        p.tolist() + r[: int(n)]
        for p, r, n in zip(rollout.prompts, rollout.responses.tolist(), lengths, strict=True)
    ]
    with torch.no_grad():
        return rewards.reward_model_scores(
            reward_model,
            seqs,
            micro_batch_size=cfg.reward.micro_batch_size_per_gpu,
            device=rollout.responses.device,
        )


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

LossFn = Callable[[torch.Tensor, dict[str, float]], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``(micro-batch row indices, global counts) -> (loss, metric contributions)``: the loss is this
micro-batch's share of the mini-batch's global loss; each metric is its share of the mini-batch value."""


def mini_batches(num_seqs: int, num_mini: int, shuffle: bool, sp: ulysses.SPGroup) -> list[torch.Tensor]:
    """Split this rank's sequences into ``num_mini`` equal mini-batches, shuffled by the rank's RNG
    (seeded per rank and restored by checkpoints, so runs and resumes repeat); the ranks of a
    sequence-parallel group take their first rank's order."""
    order = torch.randperm(num_seqs) if shuffle else torch.arange(num_seqs)
    if shuffle and sp.size > 1:
        device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
        order = ulysses.broadcast(order.to(device), sp).cpu()
    return list(order.chunk(num_mini))


def global_counts(mask: torch.Tensor) -> dict[str, float]:
    """Valid tokens and non-empty sequences of a mini-batch summed over ranks (exact normalization)."""
    tokens, seqs = all_reduce_scalars([float(mask.sum()), float((mask.sum(-1) > 0).sum())], "sum")
    return {"num_tokens": max(tokens, 1.0), "num_seqs": max(seqs, 1.0)}


def optimize(
    role: ActorConfig | CriticConfig,
    prefix: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    loss_fn: LossFn,
    *,
    num_mini: int,
    shuffle: bool,
    sp: ulysses.SPGroup,
    early_stop_kl: float = 0.0,
) -> dict[str, float]:
    """``role.ppo_epochs`` passes over the batch in ``num_mini`` mini-batches; per mini-batch, gradient
    accumulation over token-budget micro-batches, then one optimizer step.

    Each rank's loss is its share of the mini-batch's global loss (normalized by counts over all ranks)
    and ``shard_model`` makes FSDP sum gradients over ranks, so the reduced gradient is exactly the
    global mini-batch's. The metrics of a mini-batch are reduced once, so the early-stop decision (on
    ``<prefix>/ppo_kl``) is the same on every rank. A non-finite gradient norm skips that update.
    """
    sums: dict[str, float] = {}
    grad_norms: list[float] = []
    updates = skipped = 0
    early_stopped = False
    for _ in range(role.ppo_epochs):
        for idx in mini_batches(len(batch.records), num_mini, shuffle, sp):
            idx = idx.to(batch.response_mask.device)
            counts = global_counts(batch.response_mask[idx])
            contributions: dict[str, torch.Tensor] = {}
            for sel in micro_batches(batch, idx, role):
                loss, parts = loss_fn(sel, counts)
                loss.backward()
                for key, value in parts.items():
                    contributions[key] = contributions.get(key, 0.0) + value.detach()
            reduced = all_reduce_tensors(contributions, "sum")
            grad_norm, was_skipped = runner.optimizer_step(model, optimizer, role.grad_clip)
            grad_norms.append(grad_norm)
            updates += 1
            skipped += was_skipped
            for key, value in reduced.items():
                sums[key] = sums.get(key, 0.0) + value
            if early_stop_kl > 0 and reduced[f"{prefix}/ppo_kl"] > early_stop_kl:
                early_stopped = True
                logger.info(
                    "%s: ppo_kl %.4f > early_stop_kl; the step's remaining updates are skipped",
                    prefix,
                    reduced[f"{prefix}/ppo_kl"],
                )
                break
        if early_stopped:
            break
    # Every rank holds the same global values; the step's mean reduction over ranks keeps them.
    out = {k: v / updates for k, v in sums.items()}
    out[f"{prefix}/grad_norm"] = float(np.mean(grad_norms))
    out[f"{prefix}/num_updates"] = float(updates)
    out[f"{prefix}/skipped_updates"] = float(skipped)
    if early_stop_kl > 0:
        out[f"{prefix}/early_stopped"] = float(early_stopped)
    return out


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


def batch_metrics(cfg: PPOConfig, batch: Batch) -> dict[str, float]:
    """verl's data metrics over the whole batch on all ranks (token-weighted where per token):
    ``critic/{score,rewards,advantages,returns,values}/{mean,max,min}``, ``critic/vf_explained_var``
    (``1 - Var(returns - values) / (Var(returns) + 1e-5)``, unbiased), ``response_length/*`` and
    ``prompt_length/*`` with ``clip_ratio`` the share at the length limit."""
    mask = batch.response_mask
    resp_len = mask.sum(-1).float()
    prompt_len = torch.tensor([float(p.numel()) for p in batch.rollout.prompts], device=mask.device)
    values = {
        "critic/score": batch.scores,
        "critic/rewards": batch.token_rewards.sum(-1),
        "critic/advantages": batch.advantages[mask],
        "critic/returns": batch.returns[mask],
        "response_length": resp_len,
        "response_length/clip": (resp_len == cfg.data.max_response_length).float(),
        "prompt_length": prompt_len,
        "prompt_length/clip": (prompt_len == cfg.data.max_prompt_length).float(),
    }
    if batch.values is not None:
        values["critic/values"] = batch.values[mask]
        values["critic/return_error"] = (batch.returns - batch.values)[mask]
    stats = global_stats(values, copies=cfg.actor.ulysses_sequence_parallel_size)
    out: dict[str, float] = {}
    for name in (
        "critic/score",
        "critic/rewards",
        "critic/advantages",
        "critic/returns",
        "response_length",
        "prompt_length",
    ):
        out.update({f"{name}/{k}": stats[name][k] for k in ("mean", "max", "min")})
    out["response_length/clip_ratio"] = stats["response_length/clip"]["mean"]
    out["prompt_length/clip_ratio"] = stats["prompt_length/clip"]["mean"]
    if batch.values is not None:
        out.update({f"critic/values/{k}": stats["critic/values"][k] for k in ("mean", "max", "min")})
        out["critic/vf_explained_var"] = 1.0 - stats["critic/return_error"]["var"] / (
            stats["critic/returns"]["var"] + 1e-5
        )
    return out


def perf_metrics(
    cfg: PPOConfig, run: Run, batch: Batch, metrics: dict[str, float], times: dict[str, float], info: DistInfo
) -> dict[str, float]:
    """Timings, tokens, throughput, memory and the actor's model FLOPs utilization (GPUs we know).

    Rank-local values reduced here (tokens summed, memory maxed); the timings are rank 0's.
    """
    out = dict(times)
    # The ranks of a sequence-parallel group hold the same sequences: each counts its share.
    local_tokens = float(sum(batch.seq_lens)) / run.sp.size
    num_tokens = all_reduce_scalar(local_tokens, "sum")
    memory = all_reduce_scalar(max_memory_gib(info.device), "max")
    out["perf/total_num_tokens"] = num_tokens
    out["perf/throughput"] = num_tokens / info.world_size / times["timing_s/step"]  # per GPU, as verl
    out["perf/max_memory_gib"] = memory
    out["perf/max_memory_allocated_gb"] = memory  # verl's name
    peak = peak_flops(info.device)
    if "timing_s/update_actor" in times and peak is not None:
        # Tokens this rank trained on: a mini-batch's share per update (all updates ran unless stopped).
        num_mini = cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size
        trained = local_tokens * metrics["actor/num_updates"] / num_mini
        out["perf/mfu/actor"] = model_flops_utilization(
            run.num_params, trained, times["timing_s/update_actor"], peak
        )
    return out


def max_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def validate(cfg: PPOConfig, info: DistInfo, run: Run) -> dict[str, float]:
    """Generate for every validation prompt (greedy unless ``rollout.val_do_sample``) and score it.

    ``val/<data_source>/score``: the mean reward the run trains with (the reward model's score with
    ``reward.style=model``, else the rule's), also logged under verl's name
    ``val-core/<data_source>/reward/mean@1``; ``val/<data_source>/accuracy``: the share the rule scores
    1.0, where a rule exists for the source and the data has a ground truth. ``val/score`` and
    ``val/accuracy`` average over sources.
    """
    mine = run.val_records[info.rank :: info.world_size]
    rollout = sample(
        cfg,
        run,
        mine,
        do_sample=cfg.rollout.val_do_sample,
        micro_batch_size=max(1, cfg.data.val_batch_size // info.world_size),
        ignore_eos=False,
    )
    texts = decode_responses(run.tokenizer, rollout)
    model_scores = (
        reward_model_scores(cfg, run.reward_model, rollout) if run.reward_model is not None else None
    )

    def rule_scores() -> list[float | None]:
        return [
            run.scorer(r.data_source, t, r.ground_truth, r.extra_info)
            if rewards.has_rule(r.data_source, cfg.reward.custom_function)
            and (r.ground_truth is not None or cfg.reward.custom_function is not None)
            else None
            for r, t in zip(mine, texts, strict=True)
        ]

    rule = agree_on_failure(rule_scores, rewards.RewardError)
    sums: dict[str, list[float]] = {}  # source -> [score sum, count, right, rule count]
    for i, r in enumerate(mine):
        s = sums.setdefault(r.data_source, [0.0, 0.0, 0.0, 0.0])
        if model_scores is not None:
            s[0] += float(model_scores[i])
        elif rule[i] is not None:
            s[0] += rule[i]
        s[1] += 1
        if rule[i] is not None:
            s[2] += float(rule[i] >= 1.0)
            s[3] += 1
    totals: dict[str, list[float]] = {}
    for part in all_gather_object(sums):
        for source, s in part.items():
            t = totals.setdefault(source, [0.0, 0.0, 0.0, 0.0])
            for i in range(4):
                t[i] += s[i]
    out: dict[str, float] = {}
    scored = [s for s, t in totals.items() if model_scores is not None or t[3] > 0]
    for source in sorted(scored):
        score, count, right, ruled = totals[source]
        out[f"val/{source}/score"] = score / count
        out[f"val-core/{source}/reward/mean@1"] = score / count
        if ruled:
            out[f"val/{source}/accuracy"] = right / ruled
    if scored:
        out["val/score"] = float(np.mean([out[f"val/{s}/score"] for s in scored]))
    accuracies = [out[f"val/{s}/accuracy"] for s in scored if f"val/{s}/accuracy" in out]
    if accuracies:
        out["val/accuracy"] = float(np.mean(accuracies))
    return out


if __name__ == "__main__":
    sys.exit(main())
