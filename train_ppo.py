"""KL-regularized PPO for causal language models: one SPMD program that every rank runs.

    torchrun --nproc_per_node=8 train_ppo.py --config configs/X.yaml [section.key=value ...]
    python train_ppo.py --config configs/X.yaml --print-config [--world-size 32]

A step is a straight line: 1. rollout (HF generate, parameters gathered once), 2. score (old and
reference log-probs, values, rewards), 3. advantages (KL in the reward, GAE | GRPO | RLOO), 4. update
(critic, then actor: epochs x mini-batches x token-budget micro-batches), 5. log (one cross-rank
reduction), 6. checkpoint. Every rank runs the same lines; only rank 0 writes files.
"""

from __future__ import annotations

import logging
import math
import resource
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ppo import algorithms, checkpoint, data, models, rewards
from ppo.config import ConfigError, PPOConfig, parse_cli, to_dict, to_yaml
from ppo.distributed import (
    DistInfo,
    all_gather_object,
    all_reduce_scalar,
    all_reduce_scalars,
    broadcast_object,
    destroy_distributed,
    init_distributed,
    make_mesh,
    reduce_metrics,
    setup_logging,
)
from ppo.metrics import MetricsLogger, Timer, model_flops_utilization, peak_flops, tensor_stats
from ppo.monitor import HealthMonitor
from ppo.optim import build_optimizer, clip_grad_norm
from ppo.packing import pack, packed_logprobs, packed_values, plan_micro_batches, unpack
from ppo.rollout import Rollout, generate

logger = logging.getLogger("ppo")


@dataclass(kw_only=True)
class Batch:
    """One step's sequences on this rank. Token tensors are ``[B, R]`` over response tokens."""

    rollout: Rollout
    records: list[data.PromptRecord]
    """The prompt record of each sequence (repeated ``n`` times)."""
    group_ids: torch.Tensor
    """[B] index of the prompt a sequence answers (groups never straddle ranks)."""
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    full_kl: torch.Tensor | None = None
    """[B, R] exact KL over the vocabulary (only with ``algorithm.kl_penalty=full``)."""
    values: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    token_rewards: torch.Tensor | None = None
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


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, args = parse_cli(argv, PPOConfig, description=__doc__)
        if args.print_config:
            if args.world_size is not None:
                cfg.validate(args.world_size)
            print(to_yaml(cfg), end="")
            return 0
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    info = init_distributed(cfg.trainer.device, cfg.trainer.dist_timeout_s)
    setup_logging(info.is_main)
    try:
        cfg.validate(info.world_size)
        train(cfg, info)
    except (ConfigError, data.DataError, FileNotFoundError, checkpoint.CheckpointError, TrainingError) as e:
        logger.error("%s", e)
        destroy_distributed()
        return 2
    destroy_distributed()
    return 0


def train(cfg: PPOConfig, info: DistInfo) -> None:
    out_dir = Path(cfg.trainer.output_dir)
    problem = None
    if info.is_main:
        try:
            checkpoint.ensure_writable(out_dir)
            (out_dir / "config.yaml").write_text(to_yaml(cfg))
        except checkpoint.CheckpointError as e:
            problem = str(e)
    # Every rank stops on rank 0's I/O error, instead of waiting for it in the next collective.
    problem = broadcast_object(problem)
    if problem:
        raise checkpoint.CheckpointError(problem)
    # The same seed on every rank while models are built, so fresh heads start identical everywhere.
    checkpoint.seed_everything(cfg.trainer.seed)
    device = info.device
    tokenizer = models.load_tokenizer(cfg.model.tokenizer_path or cfg.model.path, cfg.model.trust_remote_code)

    # ---- data -------------------------------------------------------------------------------------
    load = dict(
        tokenizer=tokenizer,
        prompt_key=cfg.data.prompt_key,
        max_prompt_length=cfg.data.max_prompt_length,
        apply_chat_template=cfg.data.apply_chat_template,
    )
    train_records = data.load_prompts(cfg.data.train_files, **load)
    val_records = data.load_prompts(cfg.data.val_files, **load) if cfg.data.val_files else []
    if cfg.data.max_val_samples > 0:
        val_records = val_records[: cfg.data.max_val_samples]
    loader = data.PromptLoader(
        train_records,
        batch_size=cfg.data.train_batch_size,
        rank=info.rank,
        world_size=info.world_size,
        seed=cfg.trainer.seed,
        shuffle=cfg.data.shuffle,
    )
    total_steps = cfg.trainer.total_training_steps or loader.steps_per_epoch * cfg.trainer.total_epochs

    # ---- models -----------------------------------------------------------------------------------
    # Weights load on CPU and move to the device shard by shard inside fully_shard, so no rank ever holds
    # a whole model on the accelerator; the attention kernel is picked for the device they run on.
    model_kw = dict(
        dtype=cfg.model.dtype,
        attn_implementation=models.resolve_attn_implementation(cfg.model.attn_implementation, device),
        trust_remote_code=cfg.model.trust_remote_code,
        device="cpu",
    )
    actor = models.load_causal_lm(cfg.model.path, **model_kw)
    if cfg.model.enable_gradient_checkpointing:
        models.enable_gradient_checkpointing(actor)
    actor = models.shard_model(
        actor, make_mesh(info, cfg.actor.fsdp.fsdp_size), cfg.actor.fsdp, device=device
    )
    needs_ref = cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss or cfg.algorithm.rollback_kl > 0
    ref = None
    if needs_ref:
        ref = models.load_causal_lm(cfg.model.path, **model_kw)
        ref.requires_grad_(False)
        ref = models.shard_model(ref, make_mesh(info, cfg.ref.fsdp.fsdp_size), cfg.ref.fsdp, device=device)
    critic = None
    if cfg.use_critic:
        critic = models.load_critic(cfg.critic.model_path or cfg.model.path, **model_kw)
        if cfg.model.enable_gradient_checkpointing:
            models.enable_gradient_checkpointing(critic)
        critic = models.shard_model(
            critic, make_mesh(info, cfg.critic.fsdp.fsdp_size), cfg.critic.fsdp, device=device
        )
    reward_model = None
    if cfg.reward.style == "model" or (cfg.reward.style == "ranking" and cfg.reward.ranking_by == "model"):
        reward_model = models.load_reward_model(cfg.reward.model_path, **model_kw)
        reward_model.requires_grad_(False)
        reward_model = models.shard_model(
            reward_model, make_mesh(info, cfg.ref.fsdp.fsdp_size), cfg.ref.fsdp, device=device
        )
    scorer = rewards.make_rule_scorer(cfg.reward.custom_function, cfg.reward.format_score)

    num_mini = cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size
    actor_opt, actor_sched = build_optimizer(
        actor, cfg.actor.optim, total_steps * cfg.actor.ppo_epochs * num_mini
    )
    critic_opt = critic_sched = None
    if critic is not None:
        c_mini = cfg.data.train_batch_size // (
            cfg.critic.ppo_mini_batch_size or cfg.actor.ppo_mini_batch_size
        )
        c_epochs = cfg.critic.ppo_epochs or cfg.actor.ppo_epochs
        critic_opt, critic_sched = build_optimizer(critic, cfg.critic.optim, total_steps * c_epochs * c_mini)
    kl_ctrl = make_kl_controller(cfg)

    # ---- resume -----------------------------------------------------------------------------------
    ckpt = Checkpointing(
        cfg=cfg,
        info=info,
        out_dir=out_dir,
        models={"actor": actor, "critic": critic},
        optimizers={"actor": actor_opt, "critic": critic_opt},
        schedulers={"actor": actor_sched, "critic": critic_sched},
        loader=loader,
        kl_ctrl=kl_ctrl,
    )
    state = {"step": 0, "skipped_steps": 0, "best_val": None}
    guard = {"rollbacks": 0, "consecutive_rollbacks": 0, "lr_scale": 1.0}
    resume_dir = checkpoint.find_resume_dir(out_dir, cfg.trainer.resume_mode)
    if resume_dir is not None:
        ckpt.restore(resume_dir, state, guard, rollback=False)
        logger.info("resumed from %s at step %d", resume_dir, state["step"])
    else:
        # Sampling differs per rank from here on; checkpoints restore these streams exactly.
        checkpoint.seed_everything(cfg.trainer.seed * 1000 + info.rank)
        if cfg.algorithm.rollback_kl > 0 or cfg.trainer.rollback_val_drop > 0:
            ckpt.save(0, state, guard)  # something to roll back to before the first good step

    metrics_logger = MetricsLogger(
        out_dir,
        cfg.trainer.logger,
        is_main=info.is_main,
        total_steps=total_steps,
        project=cfg.trainer.project_name,
        run_name=cfg.trainer.experiment_name,
        config=to_dict(cfg),
        resume_step=state["step"] if resume_dir is not None else None,
    )
    monitor = HealthMonitor(cfg=cfg)
    peak = peak_flops(device)  # for MFU on GPUs with a known peak
    actor_params = models.count_parameters(actor)
    logger.info(
        "world size %d on %s; %d train prompts (%d steps), %d val prompts; actor %.2fM parameters",
        info.world_size,
        device,
        len(train_records),
        total_steps,
        len(val_records),
        actor_params / 1e6,
    )
    if cfg.trainer.val_before_train and state["step"] == 0 and val_records:
        val_metrics = validate(cfg, info, actor, tokenizer, val_records, scorer)
        state["best_val"] = val_metrics.get("val/score")
        metrics_logger.log(0, val_metrics)

    stop_requested = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop_requested.set())
    while state["step"] < total_steps:
        state["step"] += 1
        step = state["step"]
        timer = Timer()
        metrics: dict[str, float] = {}
        step_start = time.perf_counter()
        profiler = start_profiler(cfg, step, out_dir)

        # 1. rollout: n samples per prompt, all ranks sampling their own prompts
        records = [r for r in next(loader) for _ in range(cfg.rollout.n)]
        group_ids = torch.arange(len(records), device=device) // cfg.rollout.n
        with timer("gen"):
            rollout = sample(cfg, actor, tokenizer, records, do_sample=cfg.rollout.do_sample)
        batch = Batch(rollout=rollout, records=records, group_ids=group_ids)

        # 2. score: old and reference log-probs, values, rewards (all without gradients)
        with timer("old_log_prob"):
            batch.old_logprobs, _ = score_logprobs(cfg, actor, batch)
        if ref is not None:
            with timer("ref"):
                batch.ref_logprobs, _ = score_logprobs(cfg, ref, batch, ref=True)
                if cfg.algorithm.use_kl_in_reward and cfg.algorithm.kl_penalty == "full":
                    batch.full_kl = score_full_kl(cfg, actor, ref, batch)
            metrics["actor/ref_kl"] = ref_kl(batch)
            # KL explosion: go back to the last good checkpoint with a smaller learning rate.
            if (
                cfg.algorithm.rollback_kl > 0
                and all_reduce_scalar(metrics["actor/ref_kl"], "mean") > cfg.algorithm.rollback_kl
            ):
                ckpt.rollback(
                    state,
                    guard,
                    f"KL to the reference above algorithm.rollback_kl={cfg.algorithm.rollback_kl}",
                )
                metrics_logger.log(
                    step, {"trainer/rollbacks": guard["rollbacks"], "trainer/lr_scale": guard["lr_scale"]}
                )
                stop_profiler(profiler)
                continue
        if critic is not None:
            with timer("values"):
                batch.values = score_values(cfg, critic, batch)
        with timer("reward"):
            batch.scores = compute_scores(cfg, batch, tokenizer, scorer, reward_model)
        # A NaN or infinite reward anywhere skips the step on every rank: nothing is updated.
        if all_reduce_scalar(float(not torch.isfinite(batch.scores).all()), "max"):
            state["skipped_steps"] += 1
            logger.warning(
                "step %d: non-finite reward; the step is skipped (%d so far)", step, state["skipped_steps"]
            )
            metrics_logger.log(step, {"trainer/skipped_steps": state["skipped_steps"]})
            stop_profiler(profiler)
            continue

        # 3. advantages: KL in the reward, then GAE or a group baseline
        with timer("adv"):
            metrics.update(compute_advantages(cfg, batch, kl_ctrl, step))

        # 4. update: the critic first (it learns the new returns), then the actor
        if critic is not None:
            with timer("update_critic"):
                metrics.update(update_critic(cfg, critic, critic_opt, critic_sched, batch, info))
        if step > cfg.trainer.critic_warmup:
            with timer("update_actor"):
                metrics.update(update_actor(cfg, actor, actor_opt, actor_sched, batch, info))

        # 5. log: one cross-rank reduction per step, then validation and health warnings
        metrics.update(batch_metrics(batch, cfg))
        timer.times["timing_s/step"] = time.perf_counter() - step_start
        metrics.update(timer.times)
        num_tokens = float(sum(batch.seq_lens))
        metrics["perf/total_num_tokens"] = num_tokens
        metrics["perf/throughput"] = num_tokens / timer.times["timing_s/step"]
        metrics["perf/max_memory_gib"] = max_memory_gib(device)
        if "timing_s/update_actor" in timer.times and peak is not None:
            # Tokens the actor update trained on: every sequence, once per epoch (all updates ran).
            trained = num_tokens * metrics["actor/num_updates"] / num_mini
            mfu = model_flops_utilization(actor_params, trained, timer.times["timing_s/update_actor"], peak)
            metrics["perf/mfu/actor"] = mfu
        metrics["trainer/skipped_steps"] = float(state["skipped_steps"])
        metrics = reduce_metrics(metrics)
        metrics["actor/reward_kl_penalty_coeff"] = kl_ctrl.value
        metrics["trainer/rollbacks"] = float(guard["rollbacks"])
        stop_profiler(profiler)
        if (
            cfg.trainer.test_freq > 0
            and (step % cfg.trainer.test_freq == 0 or step == total_steps)
            and val_records
        ):
            with timer("testing"):
                metrics.update(validate(cfg, info, actor, tokenizer, val_records, scorer))
            score, best = metrics.get("val/score"), state["best_val"]
            drop = cfg.trainer.rollback_val_drop
            if drop > 0 and score is not None and best is not None and score < best * (1 - drop):
                metrics_logger.log(step, metrics)
                ckpt.rollback(
                    state,
                    guard,
                    f"validation score {score:.4f} fell more than {drop:.0%} below the best {best:.4f}",
                )
                continue
            if score is not None and (best is None or score > best):
                state["best_val"] = score
        metrics.update(monitor.check(step, metrics))
        metrics_logger.log(step, metrics)

        # 6. checkpoint: sharded, atomic, resumable; also when asked to stop (SIGTERM from Slurm or
        # torchrun), so that a preempted job resumes from this step. Ranks agree on the signal first.
        stopping = all_reduce_scalar(float(stop_requested.is_set()), "max") > 0
        if (
            cfg.trainer.save_freq > 0 and (step % cfg.trainer.save_freq == 0 or step == total_steps)
        ) or stopping:
            ckpt.save(step, state, guard)
        if stopping:
            logger.warning("stopping after step %d on SIGTERM; resume with trainer.resume_mode=auto", step)
            break

    if cfg.trainer.save_hf_on_end:
        models.save_hf(actor, tokenizer, out_dir / "hf", is_main=info.is_main)
    metrics_logger.close()


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. KL exploded again after every rollback); the message says why."""


@dataclass(kw_only=True)
class Checkpointing:
    """Everything a checkpoint holds, saved and restored in one place (resume and rollback)."""

    cfg: PPOConfig
    info: DistInfo
    out_dir: Path
    models: dict
    optimizers: dict
    schedulers: dict
    loader: data.PromptLoader
    kl_ctrl: algorithms.FixedKLController | algorithms.AdaptiveKLController

    def save(self, step: int, state: dict, guard: dict) -> None:
        """Write checkpoint ``step``. Reaching a new checkpoint is progress: the rollbacks "in a row"
        counted against ``algorithm.max_rollbacks`` start again from 0."""
        guard["consecutive_rollbacks"] = 0
        checkpoint.save(
            self.out_dir,
            step,
            models=self.models,
            optimizers=self.optimizers,
            schedulers=self.schedulers,
            extra={
                "trainer": dict(state),
                "guard": dict(guard),
                "loader": self.loader.state_dict(),
                "kl_ctrl": self.kl_ctrl.state_dict(),
            },
            config_yaml=to_yaml(self.cfg),
            rank=self.info.rank,
            world_size=self.info.world_size,
            keep=self.cfg.trainer.max_ckpt_to_keep,
        )

    def restore(self, ckpt_dir: Path, state: dict, guard: dict, *, rollback: bool) -> None:
        """Load ``ckpt_dir`` into the models, optimizers, schedulers, loader, controller, RNG and
        ``state``. On resume ``guard`` (rollback counters, lr scale) comes from the checkpoint too; on a
        rollback it is kept, and the learning rates are rescaled to ``guard["lr_scale"]``."""
        extra = checkpoint.load(
            ckpt_dir,
            models=self.models,
            optimizers=self.optimizers,
            schedulers=self.schedulers,
            rank=self.info.rank,
            world_size=self.info.world_size,
        )
        state.clear()
        state.update(extra["trainer"])
        self.loader.load_state_dict(extra["loader"])
        self.kl_ctrl.load_state_dict(extra["kl_ctrl"])
        saved_scale = extra["guard"]["lr_scale"]
        if not rollback:
            guard.update(extra["guard"])
            return
        # The checkpoint's schedulers carry the lr scale they were saved with; apply the newer one.
        ratio = guard["lr_scale"] / saved_scale
        for sched in self.schedulers.values():
            if sched is not None:
                sched.base_lrs = [lr * ratio for lr in sched.base_lrs]
                for group, lr in zip(sched.optimizer.param_groups, sched.get_last_lr(), strict=True):
                    group["lr"] = lr * ratio

    def rollback(self, state: dict, guard: dict, reason: str) -> None:
        """Restore the last checkpoint with the learning rates times ``rollback_lr_factor``; give up
        after ``max_rollbacks`` in a row."""
        a = self.cfg.algorithm
        guard["rollbacks"] += 1
        guard["consecutive_rollbacks"] += 1
        if guard["consecutive_rollbacks"] > a.max_rollbacks:
            raise TrainingError(
                f"step {state['step']}: {reason}, after {a.max_rollbacks} rollbacks in a row "
                f"(algorithm.max_rollbacks). Lower actor.optim.lr, raise the KL coefficient or "
                f"algorithm.rollback_kl, then resume."
            )
        ckpt_dir = checkpoint.find_resume_dir(self.out_dir, "auto")
        if ckpt_dir is None:
            raise TrainingError(f"step {state['step']}: {reason}, and there is no checkpoint to roll back to")
        guard["lr_scale"] *= a.rollback_lr_factor
        failed_step = state["step"]
        self.restore(ckpt_dir, state, guard, rollback=True)
        logger.warning(
            "step %d: %s; rolled back to %s (step %d) with learning rates x%.3g (rollback %d in a row)",
            failed_step,
            reason,
            ckpt_dir.name,
            state["step"],
            guard["lr_scale"],
            guard["consecutive_rollbacks"],
        )


def start_profiler(cfg: PPOConfig, step: int, out_dir: Path) -> torch.profiler.profile | None:
    """A torch profiler for the steps in ``trainer.profile_steps`` (traces in ``out_dir/profile``, for
    TensorBoard or Perfetto)."""
    if step not in cfg.trainer.profile_steps:
        return None
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(
        activities=activities,
        record_shapes=True,
        profile_memory=True,
        on_trace_ready=torch.profiler.tensorboard_trace_handler(str(out_dir / "profile")),
    )
    profiler.start()
    return profiler


def stop_profiler(profiler: torch.profiler.profile | None) -> None:
    if profiler is not None:
        profiler.stop()


def ref_kl(batch: Batch) -> float:
    """Mean over sequences of the per-token ``log pi - log pi_ref`` (k1) of the sampled tokens: how far the
    policy has moved from the reference, whatever KL terms the run uses."""
    mask = batch.response_mask
    d = torch.where(mask, batch.old_logprobs - batch.ref_logprobs, torch.zeros_like(batch.old_logprobs))
    return (d.sum(-1) / mask.sum(-1).clamp(min=1)).mean().item()


def sample(
    cfg: PPOConfig,
    actor: torch.nn.Module,
    tokenizer,
    records: list[data.PromptRecord],
    *,
    do_sample: bool,
    micro_batch_size: int | None = None,
    ignore_eos: bool | None = None,
) -> Rollout:
    """One response per record with the rollout settings (temperature, top-p/k, lengths)."""
    return generate(
        actor,
        [torch.tensor(r.input_ids, dtype=torch.long) for r in records],
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        max_new_tokens=cfg.data.max_response_length,
        do_sample=do_sample,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        ignore_eos=cfg.rollout.ignore_eos if ignore_eos is None else ignore_eos,
        micro_batch_size=micro_batch_size or cfg.rollout.micro_batch_size_per_gpu,
    )


def make_kl_controller(cfg: PPOConfig) -> algorithms.FixedKLController | algorithms.AdaptiveKLController:
    k = cfg.algorithm.kl_ctrl
    if k.type == "fixed":
        return algorithms.FixedKLController(k.kl_coef)
    return algorithms.AdaptiveKLController(k.kl_coef, k.target_kl, k.horizon)


# ----------------------------------------------------------------------------------------------------
# 2. scoring
# ----------------------------------------------------------------------------------------------------


def micro_batches(
    cfg: PPOConfig, batch: Batch, idx: torch.Tensor, *, critic: bool = False, ref: bool = False
) -> list[torch.Tensor]:
    """Micro-batches (index tensors into the batch) of the sequences ``idx``, agreed across ranks.

    The actor's (or critic's) token budget with dynamic batch size; otherwise its fixed micro-batch
    size, or ``ref.log_prob_micro_batch_size_per_gpu`` for the reference (no backward: larger fits).
    """
    role = cfg.critic if critic else cfg.actor
    lens = batch.seq_lens
    groups = plan_micro_batches(
        [lens[i] for i in idx.tolist()],
        use_dynamic_bsz=role.use_dynamic_bsz,
        max_tokens=role.ppo_max_token_len_per_gpu,
        micro_batch_size=cfg.ref.log_prob_micro_batch_size_per_gpu
        if ref
        else role.ppo_micro_batch_size_per_gpu,
    )
    return [idx[torch.tensor(g, dtype=torch.long)] for g in groups]


def pack_rows(batch: Batch, sel: torch.Tensor):
    return pack(
        [batch.rollout.prompts[i] for i in sel.tolist()],
        batch.rollout.responses[sel],
        batch.response_mask[sel],
    )


@torch.no_grad()
def score_logprobs(
    cfg: PPOConfig, model: torch.nn.Module, batch: Batch, *, ref: bool = False
) -> tuple[torch.Tensor, None]:
    """Log-probs ``[B, R]`` of the sampled tokens under ``model`` at the rollout temperature."""
    out = torch.zeros_like(batch.response_mask, dtype=torch.float32)
    all_idx = torch.arange(len(batch.records), device=out.device)
    for sel in micro_batches(cfg, batch, all_idx, ref=ref):
        lp, _ = packed_logprobs(
            model,
            pack_rows(batch, sel),
            temperature=cfg.rollout.temperature,
            backend=cfg.actor.kernels,
            fused=cfg.actor.use_fused_kernels,
        )
        out[sel] = lp
    if ref:
        release(model)
    return out, None


@torch.no_grad()
def score_full_kl(cfg: PPOConfig, actor: torch.nn.Module, ref: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Exact ``KL(actor || ref)`` over the vocabulary at every response token, ``[B, R]``.

    Needs both models' logits of a micro-batch at once: the costliest estimator, for small vocabularies
    or diagnostics.
    """
    out = torch.zeros_like(batch.response_mask, dtype=torch.float32)
    all_idx = torch.arange(len(batch.records), device=out.device)
    tau = cfg.rollout.temperature
    for sel in micro_batches(cfg, batch, all_idx):
        packed = pack_rows(batch, sel)
        logits = models.causal_lm_logits(actor, packed.input_ids, packed.position_ids).float() / tau
        ref_logits = models.causal_lm_logits(ref, packed.input_ids, packed.position_ids).float() / tau
        kl = algorithms.full_kl(logits[None], ref_logits[None], (packed.labels != -100)[None])[0]
        out[sel] = unpack(kl, packed)
    release(ref)
    return out


@torch.no_grad()
def score_values(cfg: PPOConfig, critic: torch.nn.Module, batch: Batch) -> torch.Tensor:
    out = torch.zeros_like(batch.response_mask, dtype=torch.float32)
    all_idx = torch.arange(len(batch.records), device=out.device)
    for sel in micro_batches(cfg, batch, all_idx, critic=True):
        out[sel] = packed_values(critic, pack_rows(batch, sel))
    return out


def compute_scores(
    cfg: PPOConfig,
    batch: Batch,
    tokenizer,
    scorer,
    reward_model: torch.nn.Module | None,
) -> torch.Tensor:
    """Per-sequence scores ``[B]``: rule, reward model, or the ranking of each prompt's ``n`` responses."""
    texts = decode_responses(tokenizer, batch.rollout)
    rule = torch.tensor(
        [
            scorer(r.data_source, t, r.ground_truth, r.extra_info)
            for r, t in zip(batch.records, texts, strict=True)
        ],
        dtype=torch.float32,
    )
    if reward_model is not None:
        by_model = torch.zeros(len(batch.records))
        idx = torch.arange(len(batch.records))
        with torch.no_grad():
            for start in range(0, len(idx), cfg.reward.micro_batch_size_per_gpu):
                sel = idx[start : start + cfg.reward.micro_batch_size_per_gpu]
                packed = pack_rows(batch, sel.to(batch.response_mask.device))
                by_model[sel] = models.reward_scores(
                    reward_model, packed.input_ids, packed.position_ids, packed.cu_seqlens
                ).cpu()
        release(reward_model)
    if cfg.reward.style == "rule":
        scores = rule
    elif cfg.reward.style == "model":
        scores = by_model
    else:
        scores = rewards.rank_scores(
            rule if cfg.reward.ranking_by == "rule" else by_model, batch.group_ids.cpu()
        )
    return scores.to(batch.response_mask.device)


def release(model: torch.nn.Module) -> None:
    """Reshard a frozen model's root after its no-grad forwards: FSDP2 keeps the root (embeddings, head)
    gathered after a forward for the backward that a frozen model never runs."""
    for module in models.fsdp_modules(model):
        module.reshard()


def decode_responses(tokenizer, rollout: Rollout) -> list[str]:
    """Response texts up to (not including) their EOS."""
    texts = []
    for tokens, mask in zip(rollout.responses.tolist(), rollout.response_mask.tolist(), strict=True):
        texts.append(
            tokenizer.decode([t for t, m in zip(tokens, mask, strict=True) if m], skip_special_tokens=True)
        )
    return texts


# ----------------------------------------------------------------------------------------------------
# 3. advantages
# ----------------------------------------------------------------------------------------------------


def compute_advantages(
    cfg: PPOConfig,
    batch: Batch,
    kl_ctrl: algorithms.FixedKLController | algorithms.AdaptiveKLController,
    step: int,
) -> dict[str, float]:
    """Token rewards (score on the last response token, minus the KL penalty) and advantages."""
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
            kl = algorithms.kl_penalty(batch.old_logprobs, batch.ref_logprobs, kind)
        kl = torch.where(mask, kl, torch.zeros_like(kl))
        token_rewards = token_rewards - kl_ctrl.value * kl
        # The controller sees the batch's mean per-sequence KL over all ranks.
        seq_kl = (kl.sum(-1) / mask.sum(-1).clamp(min=1)).mean().item()
        current_kl = all_reduce_scalar(seq_kl, "mean")
        metrics["actor/reward_kl_penalty"] = seq_kl
        if step > cfg.algorithm.kl_ctrl.fixed_warmup_steps:
            kl_ctrl.update(current_kl, n_steps=cfg.data.train_batch_size * cfg.rollout.n)
    batch.token_rewards = token_rewards
    est = cfg.algorithm.adv_estimator
    if est == "gae":
        advantages, batch.returns = algorithms.compute_gae(
            token_rewards, batch.values, mask, cfg.algorithm.gamma, cfg.algorithm.lam, whiten=False
        )
        batch.advantages = whiten_over_ranks(advantages, mask)
    elif est == "grpo":
        batch.advantages = algorithms.compute_grpo_advantages(
            batch.scores, batch.group_ids, mask, norm_by_std=cfg.algorithm.norm_adv_by_std_in_grpo
        )
        batch.returns = batch.advantages
    else:
        batch.advantages = algorithms.compute_rloo_advantages(batch.scores, batch.group_ids, mask)
        batch.returns = batch.advantages
    return metrics


def whiten_over_ranks(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``algorithms.masked_whiten`` with the statistics of the whole batch over all ranks.

    Two passes (mean, then the unbiased variance of the deviations) as in the one-process version, so
    any number of ranks gives the advantages one process would; 0 outside the mask.
    """
    count, total = all_reduce_scalars([float(mask.sum()), float(x[mask].sum())], "sum")
    mean = total / max(count, 1.0)
    sq_dev = all_reduce_scalar(float((x[mask] - mean).square().sum()), "sum")
    var = sq_dev / (count - 1) if count > 1 else sq_dev
    out = (x - mean) * torch.rsqrt(torch.tensor(var + 1e-8, dtype=x.dtype))
    return torch.where(mask, out, torch.zeros_like(out))


# ----------------------------------------------------------------------------------------------------
# 4. update
# ----------------------------------------------------------------------------------------------------


def mini_batches(num_seqs: int, num_mini: int, shuffle: bool) -> list[torch.Tensor]:
    """Split this rank's sequences into ``num_mini`` equal mini-batches, shuffled by the rank's RNG
    (seeded per rank and restored by checkpoints, so runs and resumes repeat)."""
    order = torch.randperm(num_seqs) if shuffle else torch.arange(num_seqs)
    return list(order.chunk(num_mini))


def global_counts(mask: torch.Tensor) -> dict[str, float]:
    """Valid tokens and non-empty sequences of a mini-batch summed over ranks (exact normalization)."""
    tokens, seqs = all_reduce_scalars([float(mask.sum()), float((mask.sum(-1) > 0).sum())], "sum")
    return {"num_tokens": max(tokens, 1.0), "num_seqs": max(seqs, 1.0)}


def update_actor(cfg, actor, optimizer, scheduler, batch: Batch, info: DistInfo) -> dict[str, float]:
    """``ppo_epochs`` passes of clipped-PPO updates with gradient accumulation over micro-batches.

    Each rank's loss is its share of the mini-batch's global mean (normalized by the counts over all
    ranks); ``shard_model`` makes FSDP sum gradients over ranks, so the reduced gradient is exactly the
    global mini-batch's.
    """
    a = cfg.actor
    device = batch.response_mask.device
    num_mini = cfg.data.train_batch_size // a.ppo_mini_batch_size
    sums: dict[str, float] = {}
    updates = 0
    early_stopped = 0.0
    grad_norms: list[float] = []
    skipped = 0
    compute_entropy = True  # logged every step; its gradient only matters with entropy_coeff
    for _ in range(a.ppo_epochs):
        for idx in mini_batches(len(batch.records), num_mini, a.shuffle):
            idx = idx.to(device)
            counts = global_counts(batch.response_mask[idx])
            mb_sums: dict[str, float] = {}
            for sel in micro_batches(cfg, batch, idx):
                mask = batch.response_mask[sel]
                logprobs, entropy = packed_logprobs(
                    actor,
                    pack_rows(batch, sel),
                    temperature=cfg.rollout.temperature,
                    backend=a.kernels,
                    compute_entropy=compute_entropy,
                    fused=a.use_fused_kernels,
                )
                pg_loss, pg_metrics = algorithms.policy_loss(
                    logprobs,
                    batch.old_logprobs[sel],
                    batch.advantages[sel],
                    mask,
                    a.clip_ratio_low if a.clip_ratio_low is not None else a.clip_ratio,
                    a.clip_ratio_high if a.clip_ratio_high is not None else a.clip_ratio,
                    a.clip_ratio_c,
                    a.loss_agg_mode,
                    **counts,
                )
                loss = pg_loss
                ent_loss = algorithms.agg_loss(entropy, mask, a.loss_agg_mode, **counts)
                if a.entropy_coeff:
                    loss = loss - a.entropy_coeff * ent_loss
                if a.use_kl_loss:
                    kl = algorithms.kl_penalty(logprobs, batch.ref_logprobs[sel], a.kl_loss_type)
                    kl_loss = algorithms.agg_loss(kl, mask, a.loss_agg_mode, **counts)
                    loss = loss + a.kl_loss_coef * kl_loss
                    _add(mb_sums, "actor/kl_loss", kl_loss.item())
                loss.backward()
                # Token-mean metrics of the micro-batch, weighted into the mini-batch's global mean.
                weight = float(mask.sum()) / counts["num_tokens"]
                _add(mb_sums, "actor/pg_loss", pg_loss.item())
                _add(mb_sums, "actor/entropy", ent_loss.item())
                for key, value in pg_metrics.items():
                    _add(mb_sums, f"actor/{key}", float(value) * weight)
            # One reduction per mini-batch: the early-stop decision must be the same on every rank.
            keys = sorted(mb_sums)
            reduced = dict(zip(keys, all_reduce_scalars([mb_sums[k] for k in keys], "sum"), strict=True))
            grad_norm = clip_grad_norm(actor, a.grad_clip)
            if math.isfinite(grad_norm):
                optimizer.step()
            else:
                skipped += 1
                logger.warning("actor: non-finite grad norm; this update is skipped on every rank")
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            grad_norms.append(grad_norm)
            updates += 1
            for key, value in reduced.items():
                _add(sums, key, value)
            if a.early_stop_kl > 0 and reduced["actor/ppo_kl"] > a.early_stop_kl:
                early_stopped = 1.0
                logger.info(
                    "actor: ppo_kl %.4f > early_stop_kl; the step's remaining updates are skipped",
                    reduced["actor/ppo_kl"],
                )
                break
        if early_stopped:
            break
    # Each rank reports the global values / world size so that the step's mean reduction restores them.
    out = {k: v / updates for k, v in sums.items()}  # already global (summed over ranks), so equal on all
    out["actor/grad_norm"] = float(np.mean(grad_norms))
    out["actor/lr"] = scheduler.get_last_lr()[0]
    out["actor/early_stopped"] = early_stopped
    out["actor/num_updates"] = float(updates)
    out["actor/skipped_updates"] = float(skipped)
    return out


def update_critic(cfg, critic, optimizer, scheduler, batch: Batch, info: DistInfo) -> dict[str, float]:
    """Clipped value regression on the returns, with the same batching as the actor."""
    c = cfg.critic
    device = batch.response_mask.device
    num_mini = cfg.data.train_batch_size // (c.ppo_mini_batch_size or cfg.actor.ppo_mini_batch_size)
    sums: dict[str, float] = {}
    grad_norms: list[float] = []
    updates = 0
    for _ in range(c.ppo_epochs or cfg.actor.ppo_epochs):
        for idx in mini_batches(len(batch.records), num_mini, cfg.actor.shuffle):
            idx = idx.to(device)
            counts = global_counts(batch.response_mask[idx])
            mb_sums: dict[str, float] = {}
            for sel in micro_batches(cfg, batch, idx, critic=True):
                mask = batch.response_mask[sel]
                values = packed_values(critic, pack_rows(batch, sel))
                vf_loss, vf_metrics = algorithms.value_loss(
                    values,
                    batch.values[sel],
                    batch.returns[sel],
                    mask,
                    c.cliprange_value,
                    c.loss_agg_mode,
                    **counts,
                )
                vf_loss.backward()
                weight = float(mask.sum()) / counts["num_tokens"]
                _add(mb_sums, "critic/vf_loss", vf_loss.item())
                _add(mb_sums, "critic/vf_clipfrac", float(vf_metrics["vf_clipfrac"]) * weight)
            keys = sorted(mb_sums)
            reduced = dict(zip(keys, all_reduce_scalars([mb_sums[k] for k in keys], "sum"), strict=True))
            grad_norm = clip_grad_norm(critic, c.grad_clip)
            if math.isfinite(grad_norm):
                optimizer.step()
            else:
                logger.warning("critic: non-finite grad norm; this update is skipped on every rank")
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            grad_norms.append(grad_norm)
            updates += 1
            for key, value in reduced.items():
                _add(sums, key, value)
    out = {k: v / updates for k, v in sums.items()}
    out["critic/grad_norm"] = float(np.mean(grad_norms))
    out["critic/lr"] = scheduler.get_last_lr()[0]
    return out


def _add(d: dict[str, float], key: str, value: float) -> None:
    d[key] = d.get(key, 0.0) + value


# ----------------------------------------------------------------------------------------------------
# 5. metrics and validation
# ----------------------------------------------------------------------------------------------------


def batch_metrics(batch: Batch, cfg: PPOConfig) -> dict[str, float]:
    """Score, reward, advantage, return, value and length statistics of this rank's batch."""
    mask = batch.response_mask
    m: dict[str, float] = {}
    m.update(tensor_stats("critic/score", batch.scores))
    m.update(tensor_stats("critic/rewards", batch.token_rewards.sum(-1)))
    m.update(tensor_stats("critic/advantages", batch.advantages, mask))
    m.update(tensor_stats("critic/returns", batch.returns, mask))
    if batch.values is not None:
        m.update(tensor_stats("critic/values", batch.values, mask))
        m["critic/vf_explained_var"] = explained_variance(batch.values, batch.returns, mask)
    lengths = mask.sum(-1).float()
    m.update(tensor_stats("response_length", lengths))
    m["response_length/clip_ratio"] = batch.rollout.truncated.float().mean().item()
    m.update(tensor_stats("prompt_length", torch.tensor([float(p.numel()) for p in batch.rollout.prompts])))
    return m


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(returns - values) / Var(returns)`` over valid tokens (1 is a perfect critic)."""
    r = returns[mask]
    v = values[mask]
    var = r.var(unbiased=False)
    if r.numel() < 2 or var == 0:
        return 0.0
    return float(1 - (r - v).var(unbiased=False) / var)


def max_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def validate(cfg: PPOConfig, info: DistInfo, actor, tokenizer, val_records, scorer) -> dict[str, float]:
    """Generate for every validation prompt (greedy unless ``rollout.val_do_sample``) and score it.

    Reports ``val/<data_source>/score`` (mean score), ``val/<data_source>/accuracy`` (fraction scored
    1.0) and their averages over sources as ``val/score`` and ``val/accuracy``.
    """
    # Every rank calls generate, even with no prompts: it joins the parameter gather inside.
    mine = val_records[info.rank :: info.world_size]
    sums: dict[str, list[float]] = {}
    rollout = sample(
        cfg,
        actor,
        tokenizer,
        mine,
        do_sample=cfg.rollout.val_do_sample,
        micro_batch_size=max(1, cfg.data.val_batch_size // info.world_size),
        ignore_eos=False,
    )
    for r, text in zip(mine, decode_responses(tokenizer, rollout), strict=True):
        score = scorer(r.data_source, text, r.ground_truth, r.extra_info)
        s = sums.setdefault(r.data_source, [0.0, 0.0, 0.0])
        s[0] += score
        s[1] += float(score >= 1.0)
        s[2] += 1
    totals: dict[str, list[float]] = {}
    for part in all_gather_object(sums):
        for source, s in part.items():
            t = totals.setdefault(source, [0.0, 0.0, 0.0])
            for i in range(3):
                t[i] += s[i]
    out: dict[str, float] = {}
    for source, (score, correct, count) in sorted(totals.items()):
        out[f"val/{source}/score"] = score / count
        out[f"val/{source}/accuracy"] = correct / count
    if totals:
        out["val/score"] = float(np.mean([out[f"val/{s}/score"] for s in totals]))
        out["val/accuracy"] = float(np.mean([out[f"val/{s}/accuracy"] for s in totals]))
    return out


if __name__ == "__main__":
    sys.exit(main())
