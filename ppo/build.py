"""Everything a PPO run is made of (``Run``) and how it is built before step 1 (``build``): the data,
the models (actor, reference, critic, reward model, SPPO's old policy, PRIME's PRM: one
``ppo.model_setup`` call each), optimizers and schedules, the KL controller, the checkpointer, and the
resume. Everything that can fail on the user's input fails here.

    run = build(cfg, info)      # then train_ppo.train runs the steps

``Run`` is the top of the library: only ``train_ppo.py`` and ``ppo.periodic_validation`` take it; every function
below takes what it uses as arguments.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ppo import (
    algorithms,
    chat_template,
    checkpointer,
    data,
    data_files,
    distillation,
    input_paths,
    lora,
    model_loading,
    model_setup,
    models,
    multi_turn,
    offline,
    rewards,
    rollout,
    rule_scoring,
    runner,
    sharding,
    ulysses,
)
from ppo.checkpointer import Checkpointer, TrainerState
from ppo.config import ConfigError, PPOConfig
from ppo.distributed import DistInfo, main_rank_logs, seed_everything
from ppo.metrics import MetricsLogger, make_metrics_logger
from ppo.monitor import HealthMonitor
from ppo.optim import Trained, with_optimizer
from ppo.reward_pool import RewardPool
from ppo_kernels.dispatch import backend_unavailable

logger = logging.getLogger("ppo")


KLController = algorithms.FixedKLController | algorithms.AdaptiveKLController


@dataclass(kw_only=True)
class Run:
    """Everything ``build`` makes once, before step 1."""

    out_dir: Path
    device: torch.device
    tokenizer: Any
    sampler: rollout.Sampler
    """The actor, its compiled decoding copy (``rollout.compile``), the rollout settings and EOS ids."""
    loader: data.ShardedLoader
    """This rank's prompts (or offline groups) of each step."""
    val_records: list[data.PromptRecord]
    actor: Trained
    critic: Trained | None
    prm: Trained | None
    """PRIME's implicit process reward model (``algorithm.adv_estimator=prime``), else None."""
    ref: torch.nn.Module | None
    """The reference policy; the actor's own module under LoRA (adapters off); None without KL terms."""
    teachers: dict[str, torch.nn.Module]
    """On-policy distillation's frozen teachers by name (``distillation.teacher_models``); {} without."""
    sppo_old: torch.nn.Module | None
    """SPPO's old policy with ``actor.sppo_refresh_steps > 1``: a snapshot of the actor, loaded and
    sharded as the actor is, refreshed every that many steps and checkpointed; None otherwise."""
    reward_model: torch.nn.Module | None
    scorer: rule_scoring.RuleScorer | rule_scoring.RewardFunctions | None
    """The rule reward in this process; None where ``reward_pool`` scores (``make_scorer``)."""
    reward_pool: RewardPool | None
    """The rule reward's worker processes (``reward.pool_workers > 0``); None scores in this process."""
    kl_ctrl: KLController
    checkpointer: Checkpointer
    state: TrainerState
    total_steps: int
    metrics_logger: MetricsLogger
    monitor: HealthMonitor
    sp: ulysses.SPGroup
    """This rank's Ulysses sequence-parallel group (``ulysses.NO_SP`` without sequence parallelism)."""


def build(cfg: PPOConfig, info: DistInfo) -> Run:
    """Load the data and the models, build the optimizers and controllers, resume if there is a
    checkpoint. Everything that can fail on the user's input fails here, before step 1."""
    check_machine(cfg, info.device)
    out_dir = runner.prepare_run(cfg, info)
    tokenizer = model_setup.load_tokenizer(cfg.model)
    model_setup.check_override_configs(cfg)  # config.json only: a misspelt field fails before any model loads
    chat_template.check_chat_template_kwargs(
        tokenizer, cfg.data.apply_chat_template_kwargs, apply_chat_template=cfg.data.apply_chat_template
    )
    scorer = make_scorer(cfg)
    pool = make_reward_pool(cfg)
    items, val_records = load_data(cfg, info, tokenizer)
    turns = (  # the environment class loads (or fails) before any model does
        multi_turn.make_settings(cfg.rollout.multi_turn, tokenizer, cfg.data.max_response_length)
        if cfg.rollout.multi_turn.enable
        else None
    )
    check_teachers(cfg, items)
    loader = data.make_loader(items, cfg, info)
    total_steps = data.total_steps(cfg, loader)
    check_reward(cfg, items, val_records, scorer, pool, total_steps, loader.steps_per_epoch)
    sp = ulysses.make_sp_groups(cfg.actor.ulysses_sequence_parallel_size)
    # One call per model, None where the run has no use for it (in this order: loading may draw from the
    # seeded RNG, a fresh head or LoRA's initialisation).
    actor = model_setup.actor(cfg, info, sp)
    ref = model_setup.reference(cfg, info, actor, sp)
    teachers = model_setup.teachers(cfg, info, sp)
    critic = model_setup.critic(cfg, info, sp)
    reward_model = model_setup.reward_model(cfg, info)
    sppo_old = model_setup.sppo_old_policy(cfg, info, sp)
    sampler = make_sampler(cfg, info, actor, tokenizer, items, turns)
    # One learning-rate step per training step, as verl.
    trained_actor = with_optimizer(actor, cfg.actor.optim, total_steps)
    trained_critic = with_optimizer(critic, cfg.critic.optim, total_steps) if critic is not None else None
    prm = model_setup.prm(cfg, info)
    trained_prm = with_optimizer(prm, cfg.reward.prime.optim, total_steps) if prm is not None else None
    kl_ctrl = make_kl_controller(cfg)
    state, monitor = TrainerState(), HealthMonitor(cfg=cfg)
    ckpt = checkpointer.make_checkpointer(
        cfg,
        info,
        out_dir,
        trained={"actor": trained_actor, "critic": trained_critic, "prm": trained_prm},
        stateful={"trainer": state, "loader": loader, "kl_ctrl": kl_ctrl, "monitor": monitor},
        frozen={"sppo_old": sppo_old},
    )
    resumed = resume(cfg, info, ckpt, state)
    if resumed and state.step >= total_steps:
        note_finished(cfg, out_dir, state.step, total_steps)
    logger.info(
        "world size %d on %s; %d train prompts (%d steps), %d val prompts; actor %.2fM parameters",
        info.world_size,
        info.device,
        len(items),
        total_steps,
        len(val_records),
        models.count_parameters(actor) / 1e6,
    )
    metrics_logger = make_metrics_logger(
        cfg, info, out_dir, total_steps, console=True, resume_step=state.step if resumed else None
    )
    return Run(
        out_dir=out_dir,
        device=info.device,
        tokenizer=tokenizer,
        sampler=sampler,
        loader=loader,
        val_records=val_records,
        actor=trained_actor,
        critic=trained_critic,
        prm=trained_prm,
        ref=ref,
        teachers=teachers,
        sppo_old=sppo_old,
        reward_model=reward_model,
        scorer=scorer,
        reward_pool=pool,
        kl_ctrl=kl_ctrl,
        checkpointer=ckpt,
        state=state,
        total_steps=total_steps,
        metrics_logger=metrics_logger,
        monitor=monitor,
        sp=sp,
    )


def check_machine(cfg: PPOConfig, device: torch.device) -> None:
    """What the config asks of this machine, checked as the run starts (the schema imports no torch;
    ``--print-config --world-size`` validates a preset for another machine): a forced ``actor.kernel_backend``
    backend must run on ``device``."""
    reason = backend_unavailable(cfg.actor.kernel_backend, device)
    if reason is not None:
        raise ConfigError(
            f"actor.kernel_backend={cfg.actor.kernel_backend} cannot run here: {reason}; use actor.kernel_backend=auto"
        )


def check_teachers(cfg: PPOConfig, items: list[Any]) -> None:
    """Before any model loads, what distilling into this student needs: teachers whose files match the
    student's tokenizer and vocabulary (``input_paths.teacher_problems``), and a teacher for every
    training row (``distillation.check_routing``)."""
    if not cfg.distillation.enabled:
        return
    problems = input_paths.teacher_problems(cfg)
    if problems:
        raise ConfigError(problems[0])
    records = [getattr(item, "record", item) for item in items]  # an offline group's prompt
    distillation.check_routing(cfg, records)


def make_scorer(cfg: PPOConfig) -> rule_scoring.RuleScorer | rule_scoring.RewardFunctions | None:
    """The rule scorer of this process (``reward.timeout_s`` holds here too; a list of functions, or a
    TRL-style one, is a ``RewardFunctions`` weighed by ``reward.weights``) where this process scores the
    rule reward; None with ``reward.pool_workers > 0``: the workers score, each imports
    ``reward.custom_function`` itself (a bad file fails their start-up in one line), and this process
    never imports it, so the user's code runs only where it scores."""
    r = cfg.reward
    if r.pool_workers > 0:
        return None
    return rule_scoring.make_rule_scorer(
        r.custom_function, r.format_score, r.reward_kwargs, timeout_s=r.timeout_s, weights=r.weights
    )


def make_reward_pool(cfg: PPOConfig) -> RewardPool | None:
    """Worker processes for the rule reward (training and validation) with ``reward.pool_workers > 0``,
    else None."""
    r = cfg.reward
    if r.pool_workers == 0:
        return None
    return RewardPool(
        custom_function=r.custom_function,
        format_score=r.format_score,
        reward_kwargs=r.reward_kwargs,
        num_workers=r.pool_workers,
        timeout_s=r.timeout_s,
        error_score=r.error_score,
        total_timeout_s=r.total_timeout_s,
        weights=r.weights,
    )


def load_data(
    cfg: PPOConfig, info: DistInfo, tokenizer: Any
) -> tuple[list[data.PromptRecord] | list[offline.OfflineGroup], list[data.PromptRecord]]:
    """The training items (prompt records, or offline groups with ``rollout.offline_fraction``) and the
    validation prompts."""
    load = dict(
        prompt_key=cfg.data.prompt_key,
        max_prompt_length=cfg.data.max_prompt_length,
        apply_chat_template=cfg.data.apply_chat_template,
        chat_template_kwargs=cfg.data.apply_chat_template_kwargs,
    )
    require_ground_truth = rewards.needs_ground_truth(cfg.reward, cfg.rollout.offline_fraction)
    with main_rank_logs(info):
        if cfg.rollout.offline_fraction > 0:  # prompt groups with their responses (offline RLHF)
            items = offline.load_offline_groups(
                cfg.data.train_files,
                tokenizer,
                group_size=cfg.rollout.n,
                max_response_length=cfg.data.max_response_length,
                require_ground_truth=require_ground_truth,
                require_scores=cfg.reward.style == "dataset",
                **load,
            )
            alg = cfg.algorithm
            if alg.reads_data_logprobs and all(g.logprobs is None for g in items):
                key = "rollout_is_threshold" if alg.rollout_is_threshold is not None else "rollout_rs"
                raise data_files.DataError(
                    f"algorithm.{key} compares the offline responses with the policy that sampled them, but "
                    "no group of data.train_files has a 'logprobs' column (scripts/make_offline_data.py "
                    f"writes it); set algorithm.{key}=null"
                )
        else:
            items = data.load_prompts(
                cfg.data.train_files, tokenizer, require_ground_truth=require_ground_truth, **load
            )
        val_records = (
            data.load_prompts(cfg.data.val_files, tokenizer, require_ground_truth=False, **load)
            if cfg.data.val_files
            else []
        )
    if cfg.data.max_val_samples > 0:
        val_records = val_records[: cfg.data.max_val_samples]
    return items, val_records


def check_reward(
    cfg: PPOConfig,
    items: list[data.PromptRecord] | list[offline.OfflineGroup],
    val_records: list[data.PromptRecord],
    scorer: rule_scoring.RuleScorer | rule_scoring.RewardFunctions | None,
    pool: RewardPool | None,
    total_steps: int,
    steps_per_epoch: int,
) -> None:
    """Before any model loads: the rule scorer covers the training prompts' sources and runs on the first
    one (in ``pool`` where there is one; ``scorer`` is None then; a TRL-style function sees the first
    step's ``trainer_state``), and covers the validation prompts' sources."""
    if rewards.needs_rule_scores(cfg.reward, cfg.rollout.offline_fraction):
        records = [getattr(item, "record", item) for item in items]  # an offline group's prompt
        progress = rule_scoring.TrainerProgress.after(0, total_steps, steps_per_epoch)
        rewards.check_rule_coverage(scorer, records, cfg.reward.custom_function, pool, progress)
    if not rewards.uses_reward_model(cfg.reward):  # validation answers are scored by the rule
        check_val_sources(val_records, cfg.reward.custom_function)


def check_val_sources(records: list[data.PromptRecord], custom_function: str | list[str] | None) -> None:
    """Every validation prompt's ``data_source`` has a rule scorer (as the training prompts'): a source
    without one would be generated for and scored by nothing."""
    unknown = sorted(
        {r.data_source for r in records if not rule_scoring.has_rule(r.data_source, custom_function)}
    )
    if unknown:
        raise rule_scoring.RewardError(
            f"no rule reward for data_source {', '.join(map(repr, unknown))} in data.val_files; known: "
            f"{', '.join(rule_scoring.RULE_DATA_SOURCES)}. Set reward.custom_function=module:function or "
            f"file.py:function, use a reward model (reward.style=model), or drop those rows"
        )


def resume(cfg: PPOConfig, info: DistInfo, ckpt: Checkpointer, state: TrainerState) -> bool:
    """Restore the newest checkpoint (``trainer.resume_mode``); a fresh run seeds each rank's sampling
    streams and, with rollback on, saves step 0 to have something to roll back to. True if resumed."""
    resume_dir = ckpt.restore_newest(cfg.trainer.resume_mode)
    if resume_dir is not None:
        logger.info("resumed from %s at step %d", resume_dir, state.step)
        return True
    # Sampling differs per rank from here on; checkpoints restore these streams exactly.
    seed_everything(cfg.trainer.seed * 1000 + info.rank)
    if cfg.algorithm.rollback_kl > 0 or cfg.trainer.rollback_val_drop > 0:
        ckpt.save(0)
    return False


def note_finished(cfg: PPOConfig, out_dir: Path, step: int, total_steps: int) -> None:
    """A run resumed at or past its last step trains nothing: say so, and keep the ``hf/`` folder it
    already exported (the loop then exports only where none exists)."""
    hf = out_dir / "hf"
    kept = cfg.trainer.save_hf_on_end and hf.is_dir() and any(hf.iterdir())
    if kept:
        cfg.trainer.save_hf_on_end = False
    how = "trainer.total_training_steps" if cfg.trainer.total_training_steps else "trainer.total_epochs"
    logger.warning(
        "resumed at step %d, and the run ends at step %d: nothing to train%s; raise %s to train on",
        step,
        total_steps,
        f" ({hf} is kept as it is)" if kept else "",
        how,
    )


def make_sampler(
    cfg: PPOConfig,
    info: DistInfo,
    actor: torch.nn.Module,
    tokenizer: Any,
    items: list,
    turns: multi_turn.MultiTurn | None = None,
) -> rollout.Sampler:
    """The rollout's sampler: the actor (and its compiled copy, ``make_engine``), the settings, every
    EOS id of the tokenizer and the model's generation config (offline responses checked against them:
    the generation config may add EOS ids that a response holds), and the multi-turn settings."""
    eos_ids = model_loading.eos_token_ids(tokenizer, actor)
    if cfg.rollout.offline_fraction > 0:
        offline.check_eos(items, eos_ids)
    return rollout.Sampler(
        actor=actor,
        engine=make_engine(cfg, actor, info),
        settings=cfg.rollout,
        max_response_length=cfg.data.max_response_length,
        eos_ids=eos_ids,
        pad_token_id=tokenizer.pad_token_id,
        multi_turn=turns,
    )


def make_engine(cfg: PPOConfig, actor: torch.nn.Module, info: DistInfo) -> torch.nn.Module | None:
    """The compiled rollout (``rollout.compile``, ``auto``: on CUDA): a persistent unsharded copy of the
    actor in its compute dtype that decodes with a static KV cache and a compiled step
    (``rollout.generate``). Not with LoRA adapters (the copy has the base architecture)."""
    wanted = cfg.rollout.compile
    use_lora = lora.uses_lora(cfg.actor.lora)
    if wanted == "auto":  # multi-turn turns decode with the eager cache (config refuses compile=true)
        wanted = info.device.type == "cuda" and not use_lora and not cfg.rollout.multi_turn.enable
    if not wanted:
        return None
    if use_lora:
        raise ConfigError(
            "rollout.compile=true cannot run with actor.lora (the compiled copy has no adapters)"
        )
    dtype = sharding.torch_dtype(cfg.actor.fsdp.mixed_precision.param_dtype)
    logger.info("rollout: a %s copy of the actor decodes with a static cache and a compiled step", dtype)
    return rollout.make_engine(actor, dtype, info.device)


def make_kl_controller(cfg: PPOConfig) -> KLController:
    k = cfg.algorithm.kl_ctrl
    if k.type == "fixed":
        return algorithms.FixedKLController(k.kl_coef)
    return algorithms.AdaptiveKLController(k.kl_coef, k.target_kl, k.horizon)
