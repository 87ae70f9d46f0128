"""Every model a run holds, set up as its config says: one function per model of PPO (the actor, the
reference, the critic, the reward model, SPPO's old policy, PRIME's process reward model, the
distillation teachers), each called
once by ``ppo.build``; the stages (SFT, the reward model, DPO) set theirs up with the same
``build_model`` and ``frozen_reference``; and the tokenizer.

``build_model`` is the one way a model comes up: loaded on the CPU (``ppo.model_loading``, with the
attention kernel of the device it will run on, ``ppo.attention``), its LoRA adapters applied
(``ppo.lora``), its heads checked for Ulysses sequence parallelism, in training mode with gradient
checkpointing as configured (a trained model) or frozen in eval mode, then sharded onto the device
(``ppo.sharding``)::

    actor = model_setup.actor(cfg, info, sp)                  # PPO (ppo.build), one call per model
    ref = model_setup.reference(cfg, info, actor, sp)         # None where nothing scores it
    model = model_setup.build_model(model_loading.load_causal_lm, cfg.model, cfg.fsdp, info)  # a stage

A model a run does not use is None. Every rank calls every function here (the sharding is collective).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, get_args, get_type_hints

from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ppo import attention, lora, model_loading, models, rewards, sharding, ulysses
from ppo.config import (
    ConfigError,
    FSDPConfig,
    LoRAConfig,
    ModelConfig,
    PPOConfig,
    PreferenceRefConfig,
    RefConfig,
)
from ppo.distributed import DistInfo, main_rank_logs, make_mesh
from ppo.override_config import ConfigOverride, parse_override_config

logger = logging.getLogger("ppo")


def load_tokenizer(model_cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The tokenizer of ``model.tokenizer_path`` (default ``model.path``); errors name the key used."""
    key = "model.tokenizer_path" if model_cfg.tokenizer_path else "model.path"
    logger.info("start-up: loading the tokenizer (%s=%s)", key, model_cfg.tokenizer_path or model_cfg.path)
    return model_loading.load_tokenizer(
        model_cfg.tokenizer_path or model_cfg.path, model_cfg.trust_remote_code, config_key=key
    )


# ----------------------------------------------------------------------------------------------------
# PPO's models, one function each
# ----------------------------------------------------------------------------------------------------


def actor(cfg: PPOConfig, info: DistInfo, sp: ulysses.SPGroup) -> nn.Module:
    """The actor as configured: ``model.path`` with ``actor.lora``, sharded by ``actor.fsdp``, trained;
    checked for the fused LM-head kernels with ``actor.use_fused_kernels``."""
    model = build_model(
        model_loading.load_causal_lm,
        cfg.model,
        cfg.actor.fsdp,
        info,
        sequence_parallel=sp.size,
        shared_prefix=cfg.share_prompts,
        lora_cfg=cfg.actor.lora,
        lora_key="actor.lora",
    )
    if cfg.actor.use_fused_kernels or (
        cfg.distillation.enabled and cfg.distillation.distillation_loss.use_topk
    ):
        models.check_fused_lm_head(
            model
        )  # the top-k distillation loss reads the LM head as the fused kernels do
    return model


def reference(cfg: PPOConfig, info: DistInfo, policy: nn.Module, sp: ulysses.SPGroup) -> nn.Module | None:
    """The reference policy (``frozen_reference``) where a KL term, the KL rollback or PRIME's implicit
    rewards score it (``needs_reference``), else None; under LoRA without ``ref.model_path`` it is
    ``policy`` (the actor) itself, its adapters off."""
    if not cfg.needs_reference:
        return None
    return frozen_reference(
        cfg.model,
        cfg.ref,
        cfg.actor.lora,
        info,
        policy,
        sequence_parallel=sp.size,
        shared_prefix=cfg.share_prompts,
    )


def critic(cfg: PPOConfig, info: DistInfo, sp: ulysses.SPGroup) -> nn.Module | None:
    """The critic where the estimator uses one (``use_critic``: GAE), else None: ``critic.model_path`` (default
    ``model.path``) with a token-level value head (``model_loading.load_critic``) that trains whole under
    ``critic.lora``, sharded by ``critic.fsdp``, its config set by ``critic.override_config`` (never the
    actor's ``model.override_config``)."""
    if not cfg.use_critic:
        return None
    return build_model(
        model_loading.load_critic,
        cfg.model,
        cfg.critic.fsdp,
        info,
        path=cfg.critic.model_path or cfg.model.path,
        path_key="critic.model_path" if cfg.critic.model_path else "model.path",
        sequence_parallel=sp.size,
        shared_prefix=cfg.share_prompts,
        sp_key="critic.ulysses_sequence_parallel_size",
        lora_cfg=cfg.critic.lora,
        lora_key="critic.lora",
        trainable_head="score",
        override_config=cfg.critic.override_config,
        override_key="critic.override_config",
    )


def reward_model(cfg: PPOConfig, info: DistInfo) -> nn.Module | None:
    """The frozen reward model ``reward.model_path`` where it scores (``rewards.uses_reward_model``), else
    None."""
    if not rewards.uses_reward_model(cfg.reward):
        return None
    return build_model(
        model_loading.load_reward_model,
        cfg.model,
        cfg.reward.fsdp,
        info,
        path=cfg.reward.model_path,
        path_key="reward.model_path",
        trainable=False,
        override_config={},
    )


def sppo_old_policy(cfg: PPOConfig, info: DistInfo, sp: ulysses.SPGroup) -> nn.Module | None:
    """SPPO's old-policy snapshot (``actor.sppo_refresh_steps > 1``), else None: a second ``actor``, so
    that its shards match the actor's one for one and the checkpoint holds what the actor's holds (its
    trainable weights)."""
    if not cfg.sppo_snapshot:
        return None
    return actor(cfg, info, sp)


def prm(cfg: PPOConfig, info: DistInfo) -> nn.Module | None:
    """PRIME's implicit PRM (``algorithm.adv_estimator=prime``): a trainable copy of the reference model
    (``ref.model_path``, else ``model.path`` with ``model.override_config``), so that its log-ratio to the
    reference starts at 0, sharded by ``reward.prime.fsdp``; with the actor's LoRA adapters when the actor has them. None for other
    estimators."""
    if cfg.algorithm.adv_estimator != "prime":
        return None
    return build_model(
        model_loading.load_causal_lm,
        cfg.model,
        cfg.reward.prime.fsdp,
        info,
        path=cfg.ref.model_path or cfg.model.path,
        path_key="ref.model_path" if cfg.ref.model_path else "model.path",
        lora_cfg=cfg.actor.lora,
        lora_key="actor.lora",
        shared_prefix=cfg.share_prompts,
        override_config={} if cfg.ref.model_path else cfg.model.override_config,
    )


def teachers(cfg: PPOConfig, info: DistInfo, sp: ulysses.SPGroup) -> dict[str, nn.Module]:
    """The teachers of on-policy distillation by name (``distillation.teacher_models``), {} without
    ``distillation.enabled``: each loaded once, frozen, sharded by ``ref.fsdp`` (its ``param_offload``
    included) like the reference. The top-k loss reads their final hidden states and LM head, which is
    checked here (as for the fused kernels)."""
    d = cfg.distillation
    if not d.enabled:
        return {}
    out = {}
    for name, teacher in d.teacher_models.items():
        model = build_model(
            model_loading.load_causal_lm,
            cfg.model,
            cfg.ref.fsdp,
            info,
            path=teacher.model_path,
            path_key=f"distillation.teacher_models.{name}.model_path",
            trainable=False,
            sequence_parallel=sp.size,
            shared_prefix=cfg.share_prompts,
            override_config={},
        )
        if d.distillation_loss.use_topk:
            models.check_fused_lm_head(model)
        out[name] = model
    return out


# ----------------------------------------------------------------------------------------------------
# How every model comes up
# ----------------------------------------------------------------------------------------------------


def frozen_reference(
    model_cfg: ModelConfig,
    ref: RefConfig | PreferenceRefConfig,
    lora_cfg: LoRAConfig,
    info: DistInfo,
    policy: nn.Module,
    *,
    sequence_parallel: int = 1,
    shared_prefix: bool = False,
) -> nn.Module:
    """The frozen reference of ``policy`` (PPO's actor, DPO's policy): ``policy`` itself under LoRA
    without ``ref.model_path`` (every reference forward then runs in ``lora.adapters_disabled``: no second
    copy is loaded), else ``ref.model_path`` (default ``model.path``, with ``model.override_config`` as
    the policy has it) loaded, sharded by ``ref.fsdp`` and frozen."""
    if lora.uses_lora(lora_cfg) and ref.model_path is None:
        return policy
    return build_model(
        model_loading.load_causal_lm,
        model_cfg,
        ref.fsdp,
        info,
        path=ref.model_path or model_cfg.path,
        path_key="ref.model_path" if ref.model_path else "model.path",
        trainable=False,
        sequence_parallel=sequence_parallel,
        shared_prefix=shared_prefix,
        override_config={} if ref.model_path else model_cfg.override_config,
    )


def build_model(
    load: Callable[..., PreTrainedModel],
    model_cfg: ModelConfig,
    fsdp: FSDPConfig,
    info: DistInfo,
    *,
    path: str | None = None,
    path_key: str = "model.path",
    trainable: bool = True,
    sequence_parallel: int = 1,
    sp_key: str = "actor.ulysses_sequence_parallel_size",
    shared_prefix: bool = False,
    lora_cfg: LoRAConfig | None = None,
    lora_key: str = "",
    trainable_head: str | None = None,
    override_config: Mapping[str, Any] | None = None,
    override_key: str = "model.override_config",
) -> nn.Module:
    """Load a model on the CPU with ``load`` (a ``model_loading.load_*``), then shard it onto the device.

    Weights load on CPU and move to the device shard by shard inside ``fully_shard``, so no rank ever
    holds a whole model on the accelerator; the attention kernel is picked for the device it will run
    on (and for Ulysses sequence parallelism, ``sequence_parallel`` ranks per group, whose heads are
    checked; ``shared_prefix``: for rows with shared prompts, ``actor.use_prefix_grouper``). A model
    that trains is put in training mode (dropout is off from loading; transformers recomputes
    checkpointed layers only in training mode) with gradient checkpointing as configured; a frozen one
    gets ``requires_grad=False`` and eval mode.

    ``override_config`` (named ``override_key`` in errors) sets fields of the model's Hugging Face config
    before its weights load (``ppo.override_config.parse_override_config``; its ``attn_implementation``, if
    any, is the attention kernel: ``attention_choice``). Default: ``model_cfg.override_config`` where the
    model is ``model_cfg.path`` (no ``path`` given), none where it is another model.
    """
    if override_config is None:
        override_config = model_cfg.override_config if path is None else {}
    override = parse_override_config(override_config, override_key)
    attn = attention.resolve_attn_implementation(
        attention_choice(model_cfg.attn_implementation, override),
        info.device,
        sequence_parallel=sequence_parallel > 1,
        shared_prefix=shared_prefix,
    )
    check_attention_dropout(attn, override)
    path = path or model_cfg.path
    lora_cfg = lora_cfg or LoRAConfig()  # rank 0: no adapters (a saved adapter folder is still merged)
    logger.info("start-up: loading %s=%s (%s)", path_key, path, "trained" if trainable else "frozen")
    with main_rank_logs(info):  # e.g. "fresh score head" once, not once per rank
        model = load(
            lora.base_model_path(path, config_key=path_key),
            dtype=lora.load_dtype(lora_cfg, model_cfg.dtype),
            attn_implementation=attn,
            trust_remote_code=model_cfg.trust_remote_code,
            device="cpu",
            config_key=path_key,
            override_config=override.fields,
            override_key=override.key,
        )
        model = lora.apply_lora(
            model,
            lora_cfg,
            model_dtype=model_cfg.dtype,
            trainable_head=trainable_head,
            config_key=lora_key,
            init_from=path,
        )
    logger.info("%s (%s): attention %s", path or model_cfg.path, type(model).__name__, attn)
    if sequence_parallel > 1:
        ulysses.check_heads(model.config, sequence_parallel, sp_key)
    if trainable:
        if model_cfg.enable_gradient_checkpointing:
            models.enable_gradient_checkpointing(model)
        model.train()
    else:
        model.requires_grad_(False)
        model.eval()
    if (
        info.world_size == 1
        and not fsdp.param_offload
        and fsdp.mixed_precision.param_dtype == model_cfg.dtype
    ):
        # Nothing to shard, offload or cast: FSDP's hooks and its collectives on a world of one would
        # only cost time (a third of a tiny model's step on CPU, scripts/ppo_bench/overhead.py).
        return model.to(info.device)
    logger.info("start-up: sharding %s over %d ranks (FSDP2) onto %s", path, info.world_size, info.device)
    return sharding.shard_model(model, make_mesh(info, fsdp.fsdp_size), fsdp, device=info.device)


# ----------------------------------------------------------------------------------------------------
# override_config, checked before any model loads
# ----------------------------------------------------------------------------------------------------


def attention_choice(configured: str, override: ConfigOverride) -> str:
    """The attention kernel of one model: ``model.attn_implementation``, or verl's
    ``override_config.attn_implementation`` where that is given (then ``model.attn_implementation`` must be
    ``auto`` or the same name; a name the trainer does not run is a ConfigError listing those it does)."""
    name = override.attn_implementation
    if name is None:
        return configured
    choices = get_args(get_type_hints(ModelConfig)["attn_implementation"])
    if name not in choices:
        raise ConfigError(
            f"{override.key}.attn_implementation={name}: not an attention kernel of this trainer; use one of "
            f"{', '.join(choices)}"
        )
    if configured not in ("auto", name):
        raise ConfigError(
            f"{override.key}.attn_implementation={name} and model.attn_implementation={configured} disagree: "
            f"set one of them"
        )
    return name


ATTENTION_DROPOUT_FIELDS = ("attention_dropout", "attn_pdrop")
"""Config fields of the dropout on attention probabilities (Llama, Qwen, Mistral; GPT-2)."""


def check_attention_dropout(attn: str, override: ConfigOverride) -> None:
    """ConfigError where ``override_config`` turns attention dropout on for a kernel that has none
    (``ppo_varlen_flash``, ``auto``'s choice on CUDA without flash-attn): it would fail in the first
    training forward. Raised before the weights load."""
    if attn != attention.VARLEN_FLASH:
        return
    for name, value in override.fields.items():
        if name in ATTENTION_DROPOUT_FIELDS and isinstance(value, (int, float)) and value > 0:
            raise ConfigError(
                f"{override.key}.{name}={value}: the attention kernel {attn} has no dropout; set "
                f"model.attn_implementation=ppo_varlen_sdpa (or flash_attention_2, sdpa), or leave the dropout off"
            )


def check_override_configs(cfg: PPOConfig) -> None:
    """Check ``model.override_config`` and ``critic.override_config`` against the configs of the models
    they set (``config.json`` only: no weights are read), so that a misspelt field stops the run before
    any model loads; a ``critic.override_config`` of a run without a critic is logged as unused. The
    reference, SPPO's old policy and PRIME's PRM load ``model.path`` with the actor's override, so the
    actor's check covers them."""
    if cfg.critic.override_config and not cfg.use_critic:
        logger.warning(
            "critic.override_config is set but this run has no critic (algorithm.adv_estimator=%s): unused",
            cfg.algorithm.adv_estimator,
        )
    if cfg.model.override_config:
        _check_override(
            cfg.model, cfg.model.path, "model.path", cfg.model.override_config, "model.override_config"
        )
    if cfg.use_critic and cfg.critic.override_config:
        _check_override(
            cfg.model,
            cfg.critic.model_path or cfg.model.path,
            "critic.model_path" if cfg.critic.model_path else "model.path",
            cfg.critic.override_config,
            "critic.override_config",
            **model_loading.CRITIC_CONFIG,
        )


def _check_override(
    model_cfg: ModelConfig,
    path: str,
    path_key: str,
    override_config: Mapping[str, Any],
    key: str,
    **loader_fields: Any,
) -> None:
    """Raise the ConfigError that loading ``path`` with ``override_config`` would raise (``loader_fields``:
    the fields the loader sets itself, which the override may set again)."""
    override = parse_override_config(override_config, key)
    attention_choice(model_cfg.attn_implementation, override)
    model_loading.read_config(
        lora.base_model_path(path, config_key=path_key),
        config_key=path_key,
        trust_remote_code=model_cfg.trust_remote_code,
        override_config=override.fields,
        override_key=override.key,
        **loader_fields,
    )
