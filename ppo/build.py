"""Everything a PPO run is made of (``Run``) and how it is built before step 1 (``build``): the data,
the models (actor, reference, critic, reward model), optimizers and schedules, the KL controller, the
checkpointer, and the resume. Everything that can fail on the user's input fails here.

    run = build(cfg, info)      # then train_ppo.train runs the steps
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ppo import algorithms, data, lora, models, offline, rewards, rollout, runner, sharding, ulysses
from ppo.checkpoint import seed_everything
from ppo.checkpointer import Checkpointer, TrainerState
from ppo.config import ConfigError, PPOConfig, to_yaml
from ppo.distributed import DistInfo
from ppo.metrics import MetricsLogger
from ppo.monitor import HealthMonitor
from ppo.optim import build_optimizer

logger = logging.getLogger("ppo")


KLController = algorithms.FixedKLController | algorithms.AdaptiveKLController


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
    engine: torch.nn.Module | None
    """The compiled rollout's decoding copy of the actor (``rollout.compile``), or None."""
    sp: ulysses.SPGroup
    """This rank's Ulysses sequence-parallel group (``ulysses.NO_SP`` without sequence parallelism)."""


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
        seed_everything(cfg.trainer.seed * 1000 + info.rank)
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
        engine=make_engine(cfg, actor, info),
        sp=sp,
    )


def make_engine(cfg: PPOConfig, actor: torch.nn.Module, info: DistInfo) -> torch.nn.Module | None:
    """The compiled rollout (``rollout.compile``, ``auto``: on CUDA): a persistent unsharded copy of the
    actor in its compute dtype that decodes with a static KV cache and a compiled step
    (``rollout.generate``). Not with LoRA adapters (the copy has the base architecture)."""
    wanted = cfg.rollout.compile
    use_lora = lora.uses_lora(cfg.actor.lora)
    if wanted == "auto":
        wanted = info.device.type == "cuda" and not use_lora
    if not wanted:
        return None
    if use_lora:
        raise ConfigError(
            "rollout.compile=true cannot run with actor.lora (the compiled copy has no adapters)"
        )
    dtype = sharding.torch_dtype(cfg.actor.fsdp.mixed_precision.param_dtype)
    logger.info("rollout: a %s copy of the actor decodes with a static cache and a compiled step", dtype)
    return rollout.make_engine(actor, dtype, info.device)


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
