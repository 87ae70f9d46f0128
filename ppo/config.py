"""The configuration schema of the PPO trainer and its stages.

One tree of ``@dataclass(kw_only=True)`` sections whose section and key names follow verl, so that a
user of verl finds ``actor.ppo_mini_batch_size`` where they expect it; the defaults are a runnable tiny
CPU setup. ``ppo.config_loader`` builds a config from the defaults, a YAML preset and command-line
overrides::

    cfg = load_config("configs/demo_cpu.yaml", ["actor.optim.lr=1e-5", "rollout.n=4"])
    cfg.validate(world_size=2)

Checks of single values live in each section's ``__post_init__``, which raises a :class:`FieldError`
naming the field within its section; the loader re-raises it with the full key and where the value came
from. Checks that need the world size live in ``validate`` (PPO) and ``validate_stage``. Keys that are
set but do nothing in a run that still trains are no error: ``PPOConfig.warnings`` lists them.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from kernels.dispatch import backend_unavailable
from ppo.algorithms import (
    ADV_ESTIMATORS,
    GROUP_ESTIMATORS,
    KL_KINDS,
    LOSS_AGG_MODES,
    POLICY_LOSS_MODES,
    PREFERENCE_LOSSES,
)


class ConfigError(ValueError):
    """A config value or key is wrong; the message names the key and what to do."""


class FieldError(ConfigError):
    """A section's ``__post_init__`` check failed. The message starts with the field's key relative to
    the section (``lr must be > 0``); ``keys`` are the fields involved, the first being the one the
    message starts with. The loader knows the section's dotted prefix and where each value came from,
    and re-raises it as a ConfigError naming the full key (``critic.optim.lr``) and its source."""

    def __init__(self, message: str, *keys: str) -> None:
        super().__init__(message)
        self.keys = keys


LOGGER_SINKS = ("console", "jsonl", "tensorboard", "wandb")
"""Metric sinks ``trainer.logger`` may name."""

SP_ATTENTION = ("auto", "ppo_varlen_sdpa", "ppo_varlen_flash")
"""The ``model.attn_implementation`` values Ulysses sequence parallelism runs with: ``ppo.attention``'s
packed kernels (``PACKED_ATTENTION``, ``VARLEN_FLASH``), the only ones that exchange heads across ranks."""


def _satisfies(value: float, rule: str) -> bool:
    """Whether ``value`` meets ``rule``: ``"> 0"``, ``">= -1"``, an interval ``"[0, 1)"``, a number
    (``"-1"``: equal to it), or alternatives joined by ``" or "`` (``"-1 or > 0"``)."""
    for part in rule.split(" or "):
        if part[0] in "[(":
            lo, hi = (float(x) for x in part[1:-1].split(","))
            above = lo <= value if part[0] == "[" else lo < value
            below = value <= hi if part[-1] == "]" else value < hi
            ok = above and below
        elif part.startswith(">="):
            ok = value >= float(part[2:])
        elif part.startswith(">"):
            ok = value > float(part[1:])
        else:
            ok = value == float(part)
        if ok:
            return True
    return False


def _require(section: Any, rule: str, *keys: str) -> None:
    """Raise a FieldError for the first of ``keys`` of ``section`` whose value breaks ``rule`` (see
    :func:`_satisfies`). A list is checked element by element; None (an optional left unset) passes;
    NaN and ±inf never do."""
    for key in keys:
        value = getattr(section, key)
        items = list(enumerate(value)) if isinstance(value, list) else [(None, value)]
        for i, v in items:
            if v is None:
                continue
            if (isinstance(v, float) and not math.isfinite(v)) or not _satisfies(v, rule):
                name = key if i is None else f"{key}[{i}]"
                within = "in " if rule[0] in "[(" else ""
                raise FieldError(f"{name} must be {within}{rule}, got {v!r}", name)


# ----------------------------------------------------------------------------------------------------
# Sections shared by the stages
# ----------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class RunTrainerConfig:
    """The ``trainer`` keys every run has (PPO and the stages): where it writes, how it resumes, saves,
    validates and logs."""

    project_name: str = "ppo"
    """Groups runs (used by wandb)."""
    experiment_name: str = "run"
    """Name of this run."""
    output_dir: str | None = None
    """Run folder: resolved config, metrics.jsonl, TensorBoard events, checkpoints. Default
    ``outputs/{project_name}/{experiment_name}`` (verl's ``checkpoints/{project}/{experiment}``): a new
    experiment name is a new folder, never the continuation of another experiment. ``~`` is expanded."""
    overwrite: bool = False
    """A fresh run (trainer.resume_mode=disable) refuses an output_dir that already holds a run
    (config.yaml, metrics.jsonl or checkpoints); true replaces it."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """``auto``: CUDA when available (nccl), else CPU (gloo)."""
    dist_timeout_s: int = 600
    """Process-group timeout: how long a rank waits on a collective before failing (verl's 600 s; the
    failure names the phase each rank was in and the ranks that did not arrive)."""
    seed: int = 1
    """Seed of data order, sampling and initialization."""
    total_epochs: int = 1
    """Passes over the training data."""
    total_training_steps: int | None = None
    """Stop after this many steps (default: ``total_epochs`` passes)."""
    save_freq: int = -1
    """Checkpoint every this many steps (0 or -1 disables periodic saves)."""
    test_freq: int = -1
    """Validate every this many steps (0 or -1 disables periodic validation)."""
    resume_mode: str = "auto"
    """``auto`` (latest checkpoint in ``output_dir``), ``disable``, or a checkpoint path."""
    max_ckpt_to_keep: int = 2
    """Keep this many newest checkpoints (0 keeps all)."""
    async_save: bool = False
    """Write checkpoints in the background (torch.distributed.checkpoint's async save): the weights and
    optimizer states are copied to host memory, training goes on while a thread writes them, and the
    checkpoint becomes ``latest`` once every rank's shards are on disk (checked each step). At most one
    save is in flight; costs a host copy of the state."""
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    """Metric sinks: console, jsonl, tensorboard, wandb."""

    def __post_init__(self) -> None:
        bad = [x for x in self.logger if x not in LOGGER_SINKS]
        if bad:
            raise FieldError(f"logger has unknown sinks {bad}; valid: {list(LOGGER_SINKS)}", "logger")
        if not self.resume_mode.strip():
            raise FieldError(
                f"resume_mode={self.resume_mode!r} is empty: use auto, disable or a checkpoint path",
                "resume_mode",
            )
        _require(self, "> 0", "dist_timeout_s", "total_epochs", "total_training_steps")
        _require(self, ">= 0", "seed", "max_ckpt_to_keep")
        _require(self, ">= -1", "save_freq", "test_freq")


@dataclass(kw_only=True)
class ModelConfig:
    path: str = "assets/sft"
    """Local folder or hub id of the policy (actor and reference start from it), loaded with
    ``from_pretrained``."""
    tokenizer_path: str | None = None
    """Tokenizer folder or hub id; default: ``path``."""
    attn_implementation: Literal[
        "auto", "ppo_varlen_flash", "ppo_varlen_sdpa", "sdpa", "eager", "flash_attention_2"
    ] = "auto"
    """Attention kernel of packed rows: ``auto`` picks the fastest available: flash_attention_2 on CUDA
    where flash-attn imports, else ``ppo_varlen_flash`` on CUDA (torch's own varlen FlashAttention,
    torch >= 2.10), else ``ppo_varlen_sdpa`` (sdpa per packed sequence: work grows with the sum of
    squared lengths, not the square of the sum). ``sdpa``/``eager``: transformers' dense masked
    attention. The start-up log line names the choice."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype the weights are loaded in (the master copy the optimizer updates)."""
    enable_gradient_checkpointing: bool = False
    """Recompute activations in the backward to save memory."""
    trust_remote_code: bool = False
    """Passed to ``from_pretrained`` for models with custom code."""


@dataclass(kw_only=True)
class MixedPrecisionConfig:
    param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the all-gathered parameters used in forward and backward (bf16 on GPU)."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the gradient reduce-scatter."""


@dataclass(kw_only=True)
class FSDPConfig:
    fsdp_size: int = -1
    """Ranks per shard group; -1 shards over all ranks. With ``0 < fsdp_size < world_size`` the mesh is
    2-D: replicate across groups, shard within (hybrid sharding)."""
    param_offload: bool = False
    """Keep sharded parameters (and gradients, optimizer state) on CPU between uses."""
    reshard_after_forward: bool = True
    """Free gathered parameters after the forward (ZeRO-3); False keeps them until the backward."""
    forward_prefetch: bool = False
    """Prefetch the next layers' all-gather during forward and backward so communication overlaps."""
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)
    """FSDP2 mixed-precision policy."""

    def __post_init__(self) -> None:
        _require(self, "-1 or >= 1", "fsdp_size")


@dataclass(kw_only=True)
class OptimConfig:
    lr: float = 1e-5
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas, each in [0, 1)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    lr_warmup_steps: int = 0
    """Linear warm-up from 0 to ``lr`` over this many optimizer steps (-1: use the ratio)."""
    lr_warmup_steps_ratio: float = 0.0
    """Warm-up as a fraction of the total optimizer steps, used when ``lr_warmup_steps`` is -1."""
    lr_scheduler: Literal["constant", "cosine"] = "constant"
    """Schedule after warm-up."""
    min_lr_ratio: float = 0.0
    """Cosine decays to ``lr * min_lr_ratio``."""

    def __post_init__(self) -> None:
        if len(self.betas) != 2:
            raise FieldError(f"betas must have two values, got {self.betas}", "betas")
        _require(self, "> 0", "lr", "eps")
        _require(self, ">= 0", "weight_decay")
        _require(self, "[0, 1)", "betas")
        _require(self, ">= -1", "lr_warmup_steps")
        _require(self, "[0, 1]", "lr_warmup_steps_ratio", "min_lr_ratio")


# ----------------------------------------------------------------------------------------------------
# PPO sections
# ----------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class DataConfig:
    train_files: list[str] = field(default_factory=lambda: ["assets/data/train.parquet"])
    """Parquet files of prompts in verl's layout (``prompt``, ``data_source``, ``reward_model``,
    ``extra_info``)."""
    val_files: list[str] = field(default_factory=lambda: ["assets/data/val.parquet"])
    """Parquet files for validation (greedy generation, scored by the rule reward)."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a list of chat messages or a string."""
    max_prompt_length: int = 64
    """Prompts longer than this (in tokens, after the chat template) are dropped and counted."""
    max_response_length: int = 32
    """Most tokens generated per response."""
    train_batch_size: int = 32
    """Prompts per PPO step, over all ranks."""
    gen_batch_size: int | None = None
    """Prompts per generation round of dynamic sampling (``algorithm.filter_groups``; verl's key),
    over all ranks: a multiple of ``train_batch_size`` (each round draws ``gen_batch_size /
    train_batch_size`` batches from the loader). Default: ``train_batch_size``."""
    val_batch_size: int = 256
    """Prompts per validation generation batch, over all ranks; the whole val set is scored."""
    max_val_samples: int = -1
    """Use at most this many validation prompts (-1: all)."""
    shuffle: bool = True
    """Shuffle the training prompts each epoch (deterministic in ``trainer.seed`` and the epoch)."""
    apply_chat_template: bool = True
    """Render chat-message prompts with the tokenizer's chat template (string prompts are used as
    they are)."""

    def __post_init__(self) -> None:
        if not self.train_files:
            raise FieldError("train_files is empty: give at least one Parquet file", "train_files")
        _require(
            self,
            "> 0",
            "max_prompt_length",
            "max_response_length",
            "train_batch_size",
            "gen_batch_size",
            "val_batch_size",
        )
        _require(self, "-1 or > 0", "max_val_samples")


@dataclass(kw_only=True)
class LoRAConfig:
    rank: int = 0
    """LoRA rank r of the adapters (0: off, every weight trains)."""
    alpha: float = 16.0
    """Adapter scale numerator: a layer computes ``W x + (alpha / rank) * B A x``."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training (0 keeps the on-policy ratio exactly 1)."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Names (or name suffixes) of the linear layers that get adapters; ``all-linear``: every linear
    layer of the decoder (not the LM head or the value head)."""
    base_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Dtype of the frozen base weights (default ``model.dtype``); adapters (and a critic's value head)
    keep ``model.dtype`` as their master copy."""
    save_merged: bool = True
    """Exports (``trainer.save_hf_on_end``, ``scripts/export_hf.py``) write the merged model, which loads
    in plain transformers; false writes the adapter folder, which loads with peft."""

    def __post_init__(self) -> None:
        _require(self, ">= 0", "rank")
        _require(self, "> 0", "alpha")
        _require(self, "[0, 1)", "dropout")
        if not self.target_modules:
            raise FieldError(
                "lora.target_modules is empty: name the layers that get adapters", "target_modules"
            )


@dataclass(kw_only=True)
class PolicyLossConfig:
    """Which policy loss the actor minimizes (verl's ``actor.policy_loss`` section)."""

    loss_mode: Literal[POLICY_LOSS_MODES] = "vanilla"
    """``vanilla``: PPO's clipped ratio with dual clip; ``gspo``: one clipped ratio per sequence, the
    geometric mean of its token ratios (Zheng et al. 2025); ``clip_cov``: PPO without dual clip whose
    loss is cut on a random share of the tokens of highest advantage-log-prob covariance; ``kl_cov``: no
    clip, a KL penalty on the tokens of highest covariance (both Cui et al. 2025)."""
    clip_cov_ratio: float = 0.0002
    """``clip_cov``: share of the mini-batch's valid tokens whose gradient is cut, in (0, 1]."""
    clip_cov_lb: float = 1.0
    """``clip_cov``: tokens are drawn among those with covariance above this ..."""
    clip_cov_ub: float = 5.0
    """... and below this."""
    kl_cov_ratio: float = 0.0002
    """``kl_cov``: share of the mini-batch's valid tokens, those of largest covariance, that get the KL
    penalty, in (0, 1]."""
    ppo_kl_coef: float = 0.1
    """``kl_cov``: weight of the penalty ``|log pi - log pi_old|`` on those tokens."""

    def __post_init__(self) -> None:
        _require(self, "(0, 1]", "clip_cov_ratio", "kl_cov_ratio")
        _require(self, ">= 0", "ppo_kl_coef")
        for key in ("clip_cov_lb", "clip_cov_ub"):
            if not math.isfinite(getattr(self, key)):
                raise FieldError(f"{key} must be finite, got {getattr(self, key)!r}", key)
        if not self.clip_cov_lb < self.clip_cov_ub:
            raise FieldError(
                f"clip_cov_lb={self.clip_cov_lb} must be below clip_cov_ub={self.clip_cov_ub}: no covariance "
                f"lies between them",
                "clip_cov_lb",
                "clip_cov_ub",
            )


@dataclass(kw_only=True)
class ActorConfig:
    ppo_mini_batch_size: int = 16
    """Prompts per optimizer step over all ranks (each brings ``rollout.n`` responses)."""
    ppo_micro_batch_size_per_gpu: int = 8
    """Sequences per forward/backward on one rank (ignored with ``use_dynamic_bsz``)."""
    use_dynamic_bsz: bool = True
    """Cut micro-batches by a token budget (balanced by length) instead of a fixed sequence count."""
    ppo_max_token_len_per_gpu: int = 4096
    """Token budget of one micro-batch on one rank with ``use_dynamic_bsz``."""
    ppo_epochs: int = 1
    """Passes over the rollout batch per step."""
    shuffle: bool = True
    """Shuffle sequences into mini-batches each epoch."""
    clip_ratio: float = 0.2
    """PPO clip range epsilon (both sides unless ``clip_ratio_low/high`` are set)."""
    clip_ratio_low: float | None = None
    """Lower clip: ratio >= 1 - clip_ratio_low; default: ``clip_ratio`` (filled in when the config is
    built)."""
    clip_ratio_high: float | None = None
    """Upper clip: ratio <= 1 + clip_ratio_high; default: ``clip_ratio`` (filled in when the config is
    built)."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound on the loss for negative advantages (must be > 1)."""
    entropy_coeff: float = 0.0
    """Entropy bonus: loss -= entropy_coeff * entropy."""
    use_kl_loss: bool = False
    """Add a KL-to-reference term to the actor loss (GRPO style)."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator of the loss: kl|k1, abs, mse|k2, low_var_kl|k3, each optionally with a ``+``."""
    loss_agg_mode: Literal[LOSS_AGG_MODES] = "token-mean"
    """How token losses become one number: ``token-mean`` (over the mini-batch's valid tokens),
    ``seq-mean-token-sum``, ``seq-mean-token-mean`` (over its sequences), ``seq-mean-token-sum-norm``
    (Dr. GRPO: the sum of every sequence's token sum divided by ``loss_scale_factor``)."""
    loss_scale_factor: int | None = None
    """The constant divisor of ``loss_agg_mode=seq-mean-token-sum-norm`` (verl's key; Dr. GRPO's
    MAX_TOKENS); null: ``data.max_response_length``, the width responses are padded to."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """The policy loss (``loss_mode``) and its parameters."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables)."""
    early_stop_kl: float = 0.0
    """Skip the step's remaining updates once a mini-batch's mean ppo_kl exceeds this (0 disables)."""
    kernels: Literal["auto", "triton", "torch", "reference"] = "auto"
    """Log-prob/entropy kernel backend: auto picks Triton on CUDA and chunked PyTorch elsewhere."""
    use_fused_kernels: bool = False
    """Compute log-probs from the final hidden states and the LM head without building full logits."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Optimizer and learning-rate schedule."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """Sharding of the actor."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapters: with ``lora.rank > 0`` only they train, and the reference (unless
    ``ref.model_path`` is set) is the actor with its adapters switched off."""
    ulysses_sequence_parallel_size: int = 1
    """Ulysses sequence parallelism: groups of this many consecutive ranks split each packed micro-batch
    along the tokens and exchange heads around attention (for responses too long for one GPU)."""

    def __post_init__(self) -> None:
        _require(
            self,
            "> 0",
            "ppo_mini_batch_size",
            "ppo_micro_batch_size_per_gpu",
            "ppo_max_token_len_per_gpu",
            "ppo_epochs",
            "clip_ratio",
            "clip_ratio_low",
            "clip_ratio_high",
        )
        _require(self, "> 1", "clip_ratio_c")
        _require(self, ">= 0", "kl_loss_coef", "grad_clip", "early_stop_kl")
        _require(self, ">= 1", "ulysses_sequence_parallel_size")
        _require(self, "> 0", "loss_scale_factor")
        check_kl_kind(self.kl_loss_type, "kl_loss_type")


@dataclass(kw_only=True)
class CriticConfig:
    model_path: str | None = None
    """Where the critic starts; default: the actor's weights (``model.path``) with a fresh value head."""
    ppo_mini_batch_size: int | None = None
    """Prompts per critic optimizer step; default: ``actor.ppo_mini_batch_size`` (filled in when the
    config is built)."""
    ppo_micro_batch_size_per_gpu: int = 8
    """Sequences per critic forward/backward on one rank (ignored with ``use_dynamic_bsz``)."""
    use_dynamic_bsz: bool = True
    """Token-budget micro-batches for the critic."""
    ppo_max_token_len_per_gpu: int = 4096
    """Token budget of one critic micro-batch on one rank."""
    ppo_epochs: int | None = None
    """Passes over the batch per step; default: ``actor.ppo_epochs`` (filled in when the config is
    built)."""
    cliprange_value: float = 0.5
    """Value clipping: predictions move at most this far from the old values per update."""
    loss_agg_mode: Literal[LOSS_AGG_MODES] = "token-mean"
    """How token value losses become one number."""
    grad_clip: float = 1.0
    """Clip the critic's global gradient norm to this (0 disables)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Critic optimizer and schedule."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """Sharding of the critic."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapters of the critic's backbone (its value head always trains)."""
    ulysses_sequence_parallel_size: int | None = None
    """Ulysses sequence parallelism of the critic; default: the actor's (filled in when the config is
    built). The actor, critic and reference share one data layout, so the three must be equal."""

    def __post_init__(self) -> None:
        _require(
            self,
            "> 0",
            "ppo_mini_batch_size",
            "ppo_micro_batch_size_per_gpu",
            "ppo_max_token_len_per_gpu",
            "ppo_epochs",
            "cliprange_value",
        )
        _require(self, ">= 0", "grad_clip")
        _require(self, ">= 1", "ulysses_sequence_parallel_size")


@dataclass(kw_only=True)
class RefConfig:
    log_prob_micro_batch_size_per_gpu: int = 16
    """Sequences per reference forward on one rank (ignored with ``actor.use_dynamic_bsz``)."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """Sharding of the frozen reference (``param_offload`` keeps it on CPU)."""
    model_path: str | None = None
    """Where the reference comes from; default: ``model.path`` (with actor LoRA: the actor itself with
    its adapters switched off, so no second copy is loaded)."""
    ulysses_sequence_parallel_size: int | None = None
    """Ulysses sequence parallelism of the reference; default: the actor's (filled in when the config is
    built)."""

    def __post_init__(self) -> None:
        _require(self, "> 0", "log_prob_micro_batch_size_per_gpu")
        _require(self, ">= 1", "ulysses_sequence_parallel_size")


@dataclass(kw_only=True)
class ValKwargsConfig:
    """Sampling of the validation pass that measures exploration (verl's ``rollout.val_kwargs``)."""

    n: int = 1
    """Answers per validation prompt; with ``n > 1`` or ``do_sample`` the validation also logs
    ``val/mean@n``, ``val/best@k`` (unbiased pass@k, k = 1, 2, 4, ..., n) and ``val/maj@n``."""
    do_sample: bool = False
    """Sample those answers (else greedy: n identical answers)."""
    temperature: float = 1.0
    """Their sampling temperature."""
    top_p: float = 1.0
    """Their nucleus threshold (1 disables)."""
    top_k: int = 0
    """Their top-k (0 disables; verl's vLLM value -1 is 0 here)."""

    def __post_init__(self) -> None:
        _require(self, ">= 1", "n")
        _require(self, "> 0", "temperature")
        _require(self, "(0, 1]", "top_p")
        _require(self, ">= 0", "top_k")

    @property
    def enabled(self) -> bool:
        """Whether validation runs the n-answer pass (beside the greedy one)."""
        return self.n > 1 or self.do_sample


@dataclass(kw_only=True)
class MultiTurnConfig:
    """Multi-turn rollouts: the model writes, the user's environment answers, the model writes again
    (``ppo.multi_turn``; verl's ``rollout.multi_turn`` where it has the key)."""

    enable: bool = False
    """Run the turn loop for training rollouts and validation."""
    env: str | None = None
    """The environment class, ``path/to/file.py:Class`` or ``module:Class``, with ``reset(row)`` and
    ``step(action_text) -> (observation, reward, done)``; one instance per trajectory."""
    stop: list[str] = field(default_factory=list)
    """Strings that end a turn (e.g. ``</calc>``): the turn's text goes to ``step``. An EOS ends the
    trajectory."""
    max_assistant_turns: int | None = None
    """Most model turns per trajectory (None: as many as ``data.max_response_length`` allows)."""
    max_tool_response_length: int = 256
    """Most tokens of one observation; longer ones are cut and counted."""
    step_timeout_s: float = 30.0
    """A ``step`` call that runs longer ends its trajectory with reward 0 (counted)."""

    def __post_init__(self) -> None:
        _require(self, ">= 1", "max_assistant_turns", "max_tool_response_length")
        _require(self, "> 0", "step_timeout_s")
        if self.enable and not self.env:
            raise FieldError(
                "enable=true needs the environment class: set rollout.multi_turn.env=path/to/file.py:Class",
                "env",
            )
        if any(not isinstance(x, str) or not x for x in self.stop):
            raise FieldError(f"stop={self.stop!r}: expected non-empty strings", "stop")


@dataclass(kw_only=True)
class RolloutConfig:
    n: int = 4
    """Responses sampled per prompt."""
    temperature: float = 1.0
    """Sampling temperature; also divides the logits when log-probs are scored."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1 disables)."""
    top_k: int = 0
    """Top-k sampling (0 disables)."""
    do_sample: bool = True
    """Sample (True) or decode greedily (False) during training rollouts."""
    ignore_eos: bool = False
    """Always generate ``data.max_response_length`` tokens (for benchmarks)."""
    micro_batch_size_per_gpu: int = 64
    """Sequences per ``generate`` call on one rank."""
    val_do_sample: bool = False
    """Validation decodes greedily unless this is set."""
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)
    """A second validation pass of ``n`` answers per prompt (verl's key), for pass@k and majority vote."""
    source: Literal["generate", "dataset"] = "generate"
    """Where each step's responses come from: sampled from the actor, or read from the training file's
    ``responses`` column (offline RLHF: no sampling in the loop; validation still generates)."""
    offline_fraction: float | None = None
    """Share of each step's prompt groups whose responses come from the data set; the rest are sampled.
    Default: 1 with ``source=dataset``, 0 with ``source=generate``."""
    compile: bool | Literal["auto"] = "auto"
    """Decode with a static KV cache and a compiled decoding step (CUDA graphs): ``auto`` on CUDA."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn rollouts with a user's environment or tool."""

    def __post_init__(self) -> None:
        _require(self, "[0, 1]", "offline_fraction")
        if self.source == "dataset" and self.offline_fraction not in (None, 1.0):
            raise FieldError(
                f"source=dataset reads every group from the data set, but rollout.offline_fraction="
                f"{self.offline_fraction}: to mix sampled and offline groups use rollout.source=generate "
                f"with rollout.offline_fraction in (0, 1)",
                "offline_fraction",
            )
        _require(self, "> 0", "n", "temperature", "micro_batch_size_per_gpu")
        _require(self, "(0, 1]", "top_p")
        _require(self, ">= 0", "top_k")


@dataclass(kw_only=True)
class OverlongBufferConfig:
    """DAPO's soft overlong punishment (Yu et al. 2025; verl's ``reward_model.overlong_buffer``)."""

    enable: bool = False
    """Add ``overlong_penalty`` to every response's score."""
    len: int = 0
    """The buffer: a response longer than ``data.max_response_length - len`` tokens (EOS included) is
    penalized, linearly more up to ``-penalty_factor`` at ``data.max_response_length``."""
    penalty_factor: float = 1.0
    """The penalty at the maximum length (verl's yaml default is 0.0; its DAPO recipes use 1.0)."""

    def __post_init__(self) -> None:
        _require(self, ">= 0", "len", "penalty_factor")


@dataclass(kw_only=True)
class RewardConfig:
    style: Literal["rule", "model", "ranking", "dataset"] = "rule"
    """``rule``: scorer chosen by ``data_source``; ``model``: a trained reward model; ``ranking``: scores
    from the ranks of the ``rollout.n`` responses to a prompt (``rank_scores``), ranked by the data's
    ``ranks`` column for offline groups and by ``ranking_by`` for sampled ones; ``dataset``: the
    offline data's ``scores`` column."""
    model_path: str | None = None
    """Reward model folder for ``style=model`` (or ``ranking_by=model``)."""
    custom_function: str | None = None
    """A user's scorer ``module.path:function`` or ``file.py:function`` (``:function`` may be left out: it
    is then ``compute_score``, as verl's), called by keyword as verl calls it,
    ``fn(data_source=, solution_str=, ground_truth=, extra_info=, **reward_kwargs)``, returning a number
    or a dict with a ``"score"`` number (its other number-valued keys are logged as ``reward/extra/<key>``)."""
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of ``custom_function`` (verl's ``custom_reward_function.reward_kwargs``)."""
    format_score: float = 0.0
    """GSM8K scorer: score of a well-formed but wrong answer."""
    ranking_by: Literal["rule", "model"] = "rule"
    """What ``style=ranking`` ranks sampled responses by."""
    rank_scores: Literal["best", "linear"] = "best"
    """``style=ranking``: ``best`` scores 1 for the best response of a group (ties share it) and 0 for
    the others; ``linear`` scores ``1 - rank / (k - 1)`` for rank 0 (best) to k - 1."""
    micro_batch_size_per_gpu: int = 16
    """Sequences per reward-model forward on one rank."""
    num_workers: int = 0
    """Score the rule reward in this many worker processes per rank, each call limited to ``timeout_s``
    (0: in the trainer's own process, where a failing function stops the run at once)."""
    timeout_s: float = 60.0
    """With ``num_workers > 0``: a call that runs longer is abandoned (its worker replaced) and scored
    ``error_score``, counted in ``reward/timeouts``."""
    error_score: float = 0.0
    """With ``num_workers > 0``: the score of a response whose call timed out, raised or returned no
    number (``reward/timeouts``, ``reward/errors``); a step whose every call failed stops the run."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO's length penalty near ``data.max_response_length``, added to every score."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """Sharding of the reward model (``style=model`` or ``ranking_by=model``); ``param_offload`` keeps it
    on CPU."""

    def __post_init__(self) -> None:
        _require(self, "> 0", "micro_batch_size_per_gpu", "timeout_s")
        _require(self, ">= 0", "num_workers")


@dataclass(kw_only=True)
class KLControlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"
    """Fixed coefficient, or adaptive toward ``target_kl`` (Ziegler et al. 2019)."""
    kl_coef: float = 0.001
    """(Initial) KL coefficient."""
    target_kl: float = 0.1
    """Adaptive: the KL per sequence the controller steers to."""
    horizon: int = 10000
    """Adaptive: steps (in samples) over which the error is corrected."""
    fixed_warmup_steps: int = 0
    """Adaptive: keep the coefficient fixed for this many steps, then adapt."""

    def __post_init__(self) -> None:
        _require(self, ">= 0", "kl_coef", "fixed_warmup_steps")
        _require(self, "> 0", "target_kl", "horizon")


@dataclass(kw_only=True)
class FilterGroupsConfig:
    """DAPO's dynamic sampling (Yu et al. 2025; verl's ``algorithm.filter_groups``): groups whose responses
    all score alike carry no signal for a group baseline; they are dropped and more prompts generated."""

    enable: bool = False
    """Drop such groups and generate ``data.gen_batch_size`` more prompts a round until
    ``data.train_batch_size`` groups are left."""
    metric: Literal["acc", "score", "seq_reward"] = "acc"
    """What must differ within a group: ``acc`` (the rule's verdict, score >= 1), ``score`` (the score
    before the overlong penalty) or ``seq_reward`` (the score with it)."""
    max_num_gen_batches: int = 0
    """Give up with an error after this many generation rounds in one step (0: no limit)."""

    def __post_init__(self) -> None:
        _require(self, ">= 0", "max_num_gen_batches")


@dataclass(kw_only=True)
class AlgorithmConfig:
    adv_estimator: Literal[ADV_ESTIMATORS] = "gae"
    """Advantages: ``gae`` with a critic; ``reinforce_plus_plus`` (discounted returns whitened over the
    batch); the group baselines ``grpo``, ``rloo``, ``reinforce_plus_plus_baseline`` (minus the group
    mean, whitened over the batch) and ``opo`` (minus the length-weighted group mean)."""
    gamma: float = 1.0
    """Discount factor of GAE and REINFORCE++."""
    lam: float = 1.0
    """GAE lambda."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide by the group's standard deviation."""
    use_kl_in_reward: bool = False
    """Subtract kl_coef * KL(actor || ref) from every token's reward."""
    kl_penalty: str = "kl"
    """KL estimator in the reward: kl|k1, abs, mse|k2, low_var_kl|k3, full."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """Controller of the in-reward KL coefficient."""
    rollback_kl: float = 0.0
    """Restore the last checkpoint when the step's KL to the reference exceeds this (0 disables)."""
    rollback_lr_factor: float = 0.5
    """Multiply the learning rates by this after a rollback."""
    max_rollbacks: int = 3
    """Stop after this many rollbacks in a row."""
    rollout_is_threshold: float | None = None
    """Importance weights between the policy an update starts from and the one that sampled the
    responses (verl's key): for offline groups whose data has the sampler's ``logprobs``. A number
    turns on their computation and ``mismatch/*`` metrics, and is the truncation ``C`` of the weights
    ``min(pi_old / pi_data, C)``; null: off."""
    rollout_is: bool = False
    """Multiply each token's policy-gradient loss by its truncated weight (needs
    ``rollout_is_threshold``); false computes the metrics only."""
    rollout_is_level: Literal["token", "sequence", "geometric"] = "token"
    """Weights per token, per sequence (the product of its token ratios), or their geometric mean."""
    rollout_is_mode: Literal["truncate"] = "truncate"
    """How weights above the threshold are bounded: truncated to it (verl's ``truncate``)."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO's dynamic sampling."""

    def __post_init__(self) -> None:
        if self.kl_penalty != "full":
            check_kl_kind(self.kl_penalty, "kl_penalty")
        _require(self, "> 1", "rollout_is_threshold")
        if self.rollout_is and self.rollout_is_threshold is None:
            raise FieldError(
                "rollout_is=true applies importance weights, whose truncation rollout_is_threshold is unset "
                "(e.g. 2.0)",
                "rollout_is",
                "rollout_is_threshold",
            )
        _require(self, "[0, 1]", "gamma", "lam")
        _require(self, ">= 0", "rollback_kl", "max_rollbacks")
        _require(self, "(0, 1]", "rollback_lr_factor")


@dataclass(kw_only=True)
class TrainerConfig(RunTrainerConfig):
    """PPO's ``trainer`` section: the keys every run has, and PPO's own."""

    n_gpus_per_node: int | None = None
    """Ranks per node the preset is sized for (verl's key). With ``nnodes``, a run on another number of
    ranks stops at start-up, and ``--print-config`` validates for ``nnodes * n_gpus_per_node``; unset:
    any world size (torchrun's decides)."""
    nnodes: int | None = None
    """Nodes the preset is sized for (verl's key); see ``n_gpus_per_node``."""
    critic_warmup: int = 0
    """Steps at the start that train only the critic (the actor is frozen)."""
    val_before_train: bool = True
    """Validate once before the first step."""
    log_val_generations: int = 0
    """Write this many (prompt, response, score) rows of each validation, the first validation prompts
    (the same ones every time), to ``output_dir/generations.jsonl`` and TensorBoard's text tab (verl's key)."""
    save_hf_on_end: bool = False
    """Export the final actor with ``save_pretrained`` to ``output_dir/hf``."""
    profile_steps: list[int] = field(default_factory=list)
    """Steps to record with the torch profiler (counted from 1)."""
    warn_entropy_below: float = 0.0
    """Warn when the policy entropy falls below this (0 disables)."""
    rollback_val_drop: float = 0.0
    """Roll back when the validation score falls this much (relative) below the best (0 disables)."""
    max_skipped_steps: int = 3
    """Stop with an error after this many steps in a row skipped for a non-finite reward."""

    @property
    def planned_world_size(self) -> int | None:
        """``nnodes * n_gpus_per_node`` when either is set (the other counts as 1), else None."""
        if self.nnodes is None and self.n_gpus_per_node is None:
            return None
        return (self.nnodes or 1) * (self.n_gpus_per_node or 1)

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self, "> 0", "n_gpus_per_node", "nnodes", "profile_steps")
        _require(self, ">= 0", "critic_warmup", "warn_entropy_below", "log_val_generations")
        _require(self, "[0, 1)", "rollback_val_drop")
        _require(self, ">= 1", "max_skipped_steps")


@dataclass(kw_only=True)
class PPOConfig:
    """The whole PPO run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy checkpoint and how it is loaded."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt files, lengths and batch size."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Policy update: PPO loss, batch sizes, optimizer, sharding."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """Value model (used by GAE)."""
    ref: RefConfig = field(default_factory=RefConfig)
    """Frozen reference policy for the KL terms."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling of responses."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Where scores come from."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages, KL in the reward, rollback."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Run length, logging, checkpoints, validation."""

    def __post_init__(self) -> None:
        resolve_paths(self.trainer, self.data)
        if self.algorithm.adv_estimator in ("grpo", "rloo") and self.rollout.n < 2:
            raise FieldError(
                f"algorithm.adv_estimator={self.algorithm.adv_estimator} needs rollout.n >= 2 "
                f"(a group baseline), got rollout.n={self.rollout.n}",
                "rollout.n",
                "algorithm.adv_estimator",
            )
        if self.reward.style == "ranking" and self.rollout.n < 2:
            raise FieldError(
                f"reward.style=ranking needs rollout.n >= 2 responses to rank, got rollout.n={self.rollout.n}",
                "rollout.n",
                "reward.style",
            )
        self._check_recipes()
        needs_rm = self.reward.style == "model" or (
            self.reward.style == "ranking" and self.reward.ranking_by == "model"
        )
        if needs_rm and not self.reward.model_path:
            raise FieldError(
                "reward.model_path is required with reward.style=model (or ranking_by=model)",
                "reward.model_path",
                "reward.style",
            )
        if self.reward.model_path and not needs_rm:
            style = f"reward.style={self.reward.style}"
            if self.reward.style == "ranking":
                style += f" with reward.ranking_by={self.reward.ranking_by}"
            raise FieldError(
                f"reward.model_path={self.reward.model_path!r} is set, but {style} never loads a reward model: "
                f"score with it (reward.style=model, or reward.style=ranking with reward.ranking_by=model), or "
                f"set reward.model_path=null",
                "reward.model_path",
                "reward.style",
            )
        t = self.trainer
        if t.total_training_steps is not None and t.critic_warmup > t.total_training_steps:
            # The actor first updates at step critic_warmup (steps count from 1; train_ppo.update).
            raise FieldError(
                f"trainer.critic_warmup={t.critic_warmup} is past the last step (trainer.total_training_steps="
                f"{t.total_training_steps}): the actor would never train; lower trainer.critic_warmup",
                "trainer.critic_warmup",
                "trainer.total_training_steps",
            )
        if self.rollout.offline_fraction is None:  # resolved here: an override of source alone must see it
            self.rollout.offline_fraction = 1.0 if self.rollout.source == "dataset" else 0.0
        fraction, groups = self.rollout.offline_fraction, self.data.train_batch_size
        offline_groups = math.floor(groups * fraction + 0.5)  # the rounding of offline.num_offline_groups
        if 0 < fraction < 1 and offline_groups in (0, groups):
            if offline_groups == 0:
                fix = f"use at least {1 / groups:.4g} (one group), or 0"
            else:
                fix = (
                    f"use at most {(groups - 1) / groups:.4g} (one sampled group), or rollout.source=dataset"
                )
            raise FieldError(
                f"rollout.offline_fraction={fraction} of data.train_batch_size={groups} prompt groups gives "
                f"{offline_groups} offline groups a step: {fix}",
                "rollout.offline_fraction",
                "data.train_batch_size",
            )
        if self.rollout.offline_fraction > 0 and self.algorithm.adv_estimator == "gae":
            raise FieldError(
                "algorithm.adv_estimator=gae with offline groups (rollout.source=dataset or "
                "rollout.offline_fraction > 0): the critic would learn the values of the policy that wrote the "
                "data, not the actor's; use a group baseline: algorithm.adv_estimator=grpo or rloo",
                "algorithm.adv_estimator",
                "rollout.offline_fraction",
            )
        if self.algorithm.rollout_is_threshold is not None and self.rollout.offline_fraction == 0:
            raise FieldError(
                "algorithm.rollout_is_threshold weighs responses by the policy that sampled them, which only "
                "offline data records here (rollout.source=dataset or rollout.offline_fraction > 0)",
                "algorithm.rollout_is_threshold",
                "rollout.offline_fraction",
            )
        if self.reward.style == "dataset" and self.rollout.offline_fraction < 1.0:
            raise FieldError(
                "reward.style=dataset reads the offline data's scores, which sampled responses do not have: "
                "use it with rollout.source=dataset",
                "reward.style",
                "rollout.source",
            )
        self._check_multi_turn()
        # Fallbacks resolved once, here, so that the trainer and the saved config.yaml see the values
        # that run. A default instance is never the base of another build (see _build), so this cannot
        # freeze a default the user then overrides.
        if self.critic.ppo_mini_batch_size is None:
            self.critic.ppo_mini_batch_size = self.actor.ppo_mini_batch_size
        if self.critic.ppo_epochs is None:
            self.critic.ppo_epochs = self.actor.ppo_epochs
        if self.actor.clip_ratio_low is None:
            self.actor.clip_ratio_low = self.actor.clip_ratio
        if self.actor.clip_ratio_high is None:
            self.actor.clip_ratio_high = self.actor.clip_ratio
        sp = self.actor.ulysses_sequence_parallel_size
        for role in ("critic", "ref"):
            section = getattr(self, role)
            if section.ulysses_sequence_parallel_size is None:
                section.ulysses_sequence_parallel_size = sp
            elif section.ulysses_sequence_parallel_size != sp:
                raise FieldError(
                    f"{role}.ulysses_sequence_parallel_size={section.ulysses_sequence_parallel_size} differs from "
                    f"actor.ulysses_sequence_parallel_size={sp}: actor, critic and reference share one "
                    f"sequence-parallel layout; set them equal (or leave {role}'s unset)",
                    f"{role}.ulysses_sequence_parallel_size",
                    "actor.ulysses_sequence_parallel_size",
                )
        if sp > 1 and self.model.attn_implementation not in SP_ATTENTION:
            raise FieldError(
                f"model.attn_implementation={self.model.attn_implementation} cannot run with "
                f"actor.ulysses_sequence_parallel_size={sp}: only the packed kernels exchange heads across the "
                f"ranks of a sequence-parallel group; use model.attn_implementation=auto",
                "model.attn_implementation",
                "actor.ulysses_sequence_parallel_size",
            )

    def _check_multi_turn(self) -> None:
        """The combinations a multi-turn rollout cannot run with."""
        m = self.rollout.multi_turn
        if not m.enable:
            return
        if self.rollout.offline_fraction > 0:
            raise FieldError(
                "rollout.multi_turn.enable=true runs the environment between the model's turns, but offline groups "
                "(rollout.source=dataset or rollout.offline_fraction > 0) are single-turn responses read from the "
                "data: turn one of them off",
                "rollout.multi_turn.enable",
                "rollout.offline_fraction",
            )
        if self.rollout.compile is True:
            raise FieldError(
                "rollout.multi_turn.enable=true decodes each turn with the eager KV cache; rollout.compile=true is "
                "not available with it: set rollout.compile=auto or false",
                "rollout.multi_turn.enable",
                "rollout.compile",
            )
        if self.rollout.ignore_eos:
            raise FieldError(
                "rollout.multi_turn.enable=true ends turns at stop strings and trajectories at an EOS; "
                "rollout.ignore_eos=true would never end either: turn one of them off",
                "rollout.multi_turn.enable",
                "rollout.ignore_eos",
            )

    def _check_recipes(self) -> None:
        """The reasoning-RL recipes' keys against the rest: KL-Cov needs an update that is not on-policy,
        dynamic sampling needs sampled groups to filter, the overlong buffer must fit the response."""
        d, f, o = self.data, self.algorithm.filter_groups, self.reward.overlong_buffer
        if self.actor.policy_loss.loss_mode == "kl_cov" and self.on_policy:
            raise FieldError(
                f"actor.policy_loss.loss_mode=kl_cov penalizes |log pi - log pi_old|, which is 0 in the one update "
                f"of an on-policy step (actor.ppo_epochs=1 and actor.ppo_mini_batch_size=data.train_batch_size="
                f"{d.train_batch_size}), so it would train as vanilla PPO without a clip: set actor.ppo_epochs >= 2 "
                f"or a smaller actor.ppo_mini_batch_size",
                "actor.policy_loss.loss_mode",
                "actor.ppo_epochs",
                "actor.ppo_mini_batch_size",
            )
        if d.gen_batch_size is None:  # resolved here, like the other fallbacks
            d.gen_batch_size = d.train_batch_size
        if o.enable and not 0 < o.len <= d.max_response_length:
            raise FieldError(
                f"reward.overlong_buffer.len={o.len} must be in (0, data.max_response_length={d.max_response_length}]: "
                f"responses longer than max_response_length - len are penalized",
                "reward.overlong_buffer.len",
                "data.max_response_length",
            )
        if not f.enable:
            return
        if self.rollout.n < 2:
            raise FieldError(
                f"algorithm.filter_groups.enable=true drops groups whose responses all score alike, but with "
                f"rollout.n={self.rollout.n} every group has one response (always kept): use rollout.n >= 2",
                "algorithm.filter_groups.enable",
                "rollout.n",
            )
        if (self.rollout.offline_fraction or 0) > 0 or self.rollout.source == "dataset":
            raise FieldError(
                "algorithm.filter_groups.enable=true generates more prompts until the batch is full, which offline "
                "groups (rollout.source=dataset or rollout.offline_fraction > 0) cannot: turn one of them off",
                "algorithm.filter_groups.enable",
                "rollout.offline_fraction",
            )
        if d.gen_batch_size % d.train_batch_size:
            raise FieldError(
                f"data.gen_batch_size={d.gen_batch_size} must be a multiple of data.train_batch_size="
                f"{d.train_batch_size}: each generation round draws whole batches from the prompt loader",
                "data.gen_batch_size",
                "data.train_batch_size",
            )
        if f.metric == "acc" and self.reward.style == "model":
            raise FieldError(
                "algorithm.filter_groups.metric=acc is the rule's verdict (score >= 1), which a reward model's "
                "scores do not have: use algorithm.filter_groups.metric=score",
                "algorithm.filter_groups.metric",
                "reward.style",
            )

    @property
    def use_critic(self) -> bool:
        """GAE needs a value function; the group estimators do not."""
        return self.algorithm.adv_estimator == "gae"

    @property
    def on_policy(self) -> bool:
        """One update per rollout (one epoch, one mini-batch): the ratio is exactly 1 (verl's shortcut)."""
        return self.actor.ppo_epochs == 1 and self.actor.ppo_mini_batch_size == self.data.train_batch_size

    @property
    def needs_reference(self) -> bool:
        """A reference policy is scored when a KL term or the KL rollback uses it."""
        return self.algorithm.use_kl_in_reward or self.actor.use_kl_loss or self.algorithm.rollback_kl > 0

    def warnings(self) -> list[str]:
        """One message per group of keys that are set but do nothing in this run, which still trains
        (the caller logs them once at start-up): the KL controller's keys without a KL penalty in the
        reward, the adaptive controller's keys with a fixed one, greedy rollouts compared within their
        group, a critic warm-up without a critic."""
        out = []
        k, default = self.algorithm.kl_ctrl, KLControlConfig()
        changed = [
            name
            for name in ("type", "kl_coef", "target_kl", "horizon", "fixed_warmup_steps")
            if getattr(k, name) != getattr(default, name)
        ]
        adaptive_only = [name for name in changed if name in ("target_kl", "horizon", "fixed_warmup_steps")]
        if not self.algorithm.use_kl_in_reward and changed:
            hint = " (the KL loss's weight is actor.kl_loss_coef)" if self.actor.use_kl_loss else ""
            out.append(
                f"algorithm.use_kl_in_reward=false: the reward has no KL penalty, so {_shown(k, changed)} "
                f"{'is' if len(changed) == 1 else 'are'} ignored{hint}"
            )
        elif k.type == "fixed" and adaptive_only:
            out.append(
                f"algorithm.kl_ctrl.type=fixed keeps the KL coefficient at algorithm.kl_ctrl.kl_coef={k.kl_coef}: "
                f"{_shown(k, adaptive_only)} only steer{'s' if len(adaptive_only) == 1 else ''} "
                f"algorithm.kl_ctrl.type=adaptive and {'is' if len(adaptive_only) == 1 else 'are'} ignored"
            )
        if not self.rollout.do_sample and self.rollout.offline_fraction < 1.0:
            # Greedy decoding gives every response to a prompt the same tokens: a baseline or a ranking
            # within the group then sees no difference (an entropy bonus still trains, and tests use that).
            group = None
            if self.algorithm.adv_estimator in GROUP_ESTIMATORS:
                group = f"algorithm.adv_estimator={self.algorithm.adv_estimator}"
            elif self.reward.style == "ranking":
                group = "reward.style=ranking"
            if group is not None:
                out.append(
                    f"rollout.do_sample=false decodes greedily, so the rollout.n={self.rollout.n} sampled "
                    f"responses to a prompt are identical and {group} compares them within their group: every "
                    f"advantage is 0; set rollout.do_sample=true"
                )
        out.extend(self._recipe_warnings())
        warmup = self.trainer.critic_warmup
        if warmup > 1 and not self.use_critic:
            out.append(
                f"trainer.critic_warmup={warmup} with algorithm.adv_estimator={self.algorithm.adv_estimator}, "
                f"which has no critic: steps 1 to {warmup - 1} train nothing; set trainer.critic_warmup=0"
            )
        return out

    def _recipe_warnings(self) -> list[str]:
        """Recipe keys set where they do nothing (see ``warnings``)."""
        out = []
        a, d, alg = self.actor, self.data, self.algorithm
        mode, loss = a.policy_loss.loss_mode, a.policy_loss
        if mode == "gspo" and a.loss_agg_mode != "seq-mean-token-mean":
            out.append(
                f"actor.policy_loss.loss_mode=gspo aggregates its loss seq-mean-token-mean (as verl); "
                f"actor.loss_agg_mode={a.loss_agg_mode} applies to the entropy bonus and the KL loss only"
            )
        default = PolicyLossConfig()
        used = {
            "clip_cov": ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"),
            "kl_cov": ("kl_cov_ratio", "ppo_kl_coef"),
        }
        unused = [
            f"actor.policy_loss.{k}={getattr(loss, k)}"
            for k in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")
            if getattr(loss, k) != getattr(default, k) and k not in used.get(mode, ())
        ]
        if unused:
            out.append(f"actor.policy_loss.loss_mode={mode} does not use {', '.join(unused)}")
        if a.loss_scale_factor is not None and a.loss_agg_mode != "seq-mean-token-sum-norm":
            out.append(
                f"actor.loss_scale_factor={a.loss_scale_factor} divides only loss_agg_mode=seq-mean-token-sum-norm, "
                f"not actor.loss_agg_mode={a.loss_agg_mode}: it is ignored"
            )
        f, o = alg.filter_groups, self.reward.overlong_buffer
        if not f.enable and (d.gen_batch_size != d.train_batch_size or f.max_num_gen_batches):
            out.append(
                "algorithm.filter_groups.enable=false: data.gen_batch_size and "
                "algorithm.filter_groups.max_num_gen_batches are used by dynamic sampling only and are ignored"
            )
        if not o.enable and o.len:
            out.append(f"reward.overlong_buffer.enable=false: reward.overlong_buffer.len={o.len} is ignored")
        if alg.adv_estimator in ("reinforce_plus_plus_baseline", "opo") and self.rollout.n == 1:
            out.append(
                f"algorithm.adv_estimator={alg.adv_estimator} with rollout.n=1: a group of one has baseline 0, so "
                f"each advantage is the response's own score"
            )
        v = self.rollout.val_kwargs
        if v.n > 1 and not v.do_sample:
            out.append(
                f"rollout.val_kwargs.n={v.n} with rollout.val_kwargs.do_sample=false: the {v.n} greedy answers to a "
                f"prompt are identical, so best@k and maj@n equal the greedy accuracy; set do_sample=true"
            )
        return out

    def validate(self, world_size: int) -> None:
        """Check every batch divisibility that ``world_size`` ranks need; say which numbers to change.

        Each rank takes ``train_batch_size / world_size`` prompts and samples ``n`` responses for each;
        each mini-batch holds ``ppo_mini_batch_size * n``
        sequences split evenly over ranks, and (without dynamic batch size) each rank's share splits into
        micro-batches of ``ppo_micro_batch_size_per_gpu``.

        Inside a launched run (the process group is up) it also checks this machine: that the forced
        ``actor.kernels`` backend can run on its device.
        """
        _check_world_size(world_size)
        errors: list[str] = []
        planned = self.trainer.planned_world_size
        if planned is not None and planned != world_size:
            errors.append(
                f"trainer.nnodes={self.trainer.nnodes} x trainer.n_gpus_per_node={self.trainer.n_gpus_per_node} "
                f"= {planned} ranks, but {world_size} run: the preset's batch sizes are sized for {planned}; "
                f"set trainer.nnodes and trainer.n_gpus_per_node to what you launch (or null)"
            )
        n = self.rollout.n
        bsz = self.data.train_batch_size
        sp = self.actor.ulysses_sequence_parallel_size
        if bsz % world_size:
            # Each rank samples all n responses of its own prompts, so groups (GRPO, RLOO, ranking)
            # never straddle ranks.
            errors.append(
                f"data.train_batch_size={bsz} prompts must divide evenly over {world_size} ranks: "
                f"make it a multiple of {world_size}"
            )
        roles = [
            (
                "actor",
                self.actor.ppo_mini_batch_size,
                self.actor.use_dynamic_bsz,
                self.actor.ppo_micro_batch_size_per_gpu,
            )
        ]
        if self.use_critic:
            c = self.critic
            roles.append(("critic", c.ppo_mini_batch_size, c.use_dynamic_bsz, c.ppo_micro_batch_size_per_gpu))
        for role, mini, dynamic, micro in roles:
            if bsz % mini:
                errors.append(
                    f"{role}.ppo_mini_batch_size={mini} must divide data.train_batch_size={bsz}: "
                    f"change one of them"
                )
                continue
            if (mini * n) % world_size:
                errors.append(
                    f"{role}.ppo_mini_batch_size * rollout.n = {mini * n} sequences must divide evenly over "
                    f"{world_size} ranks: change {role}.ppo_mini_batch_size or rollout.n"
                )
                continue
            # With sequence parallelism a group of sp ranks shares its members' sequences.
            per_group = mini * n * sp // world_size
            if not dynamic and per_group % micro:
                where = "rank" if sp == 1 else f"sequence-parallel group of {sp} ranks"
                errors.append(
                    f"{role}: {per_group} sequences per {where} per mini-batch must be a multiple of "
                    f"{role}.ppo_micro_batch_size_per_gpu={micro}: change it to a divisor of {per_group}, "
                    f"or set {role}.use_dynamic_bsz=true"
                )
        max_len = self.data.max_prompt_length + self.data.max_response_length
        for role, cfg in (("actor", self.actor), ("critic", self.critic)):
            if cfg.use_dynamic_bsz and cfg.ppo_max_token_len_per_gpu * sp < max_len:
                errors.append(
                    f"{role}.ppo_max_token_len_per_gpu={cfg.ppo_max_token_len_per_gpu} (x {sp} sequence-parallel "
                    f"ranks) is below the longest sequence (max_prompt_length + max_response_length = "
                    f"{max_len}): raise it"
                    if sp > 1
                    else f"{role}.ppo_max_token_len_per_gpu={cfg.ppo_max_token_len_per_gpu} is below the longest "
                    f"sequence (max_prompt_length + max_response_length = {max_len}): raise it"
                )
        for role in ("actor", "critic", "ref"):
            sp = getattr(self, role).ulysses_sequence_parallel_size
            if world_size % sp:
                errors.append(
                    f"{role}.ulysses_sequence_parallel_size={sp} must divide the world size {world_size}"
                )
        for role in ("actor", "critic", "ref", "reward"):
            fsdp = getattr(self, role).fsdp
            if fsdp.fsdp_size > 0 and world_size % fsdp.fsdp_size:
                errors.append(
                    f"{role}.fsdp.fsdp_size={fsdp.fsdp_size} must divide the world size {world_size}"
                )
        if errors:
            raise ConfigError(f"config does not fit world size {world_size}:\n  - " + "\n  - ".join(errors))
        if dist.is_initialized():
            # A launched run (runner.main validates once it joined the process group) runs on this
            # machine; ``--print-config --world-size`` validates a preset for another one and skips this.
            device = "cuda" if self.trainer.device != "cpu" and torch.cuda.is_available() else "cpu"
            reason = backend_unavailable(self.actor.kernels, device)
            if reason is not None:
                raise ConfigError(
                    f"actor.kernels={self.actor.kernels} cannot run here: {reason}; use actor.kernels=auto"
                )


# ----------------------------------------------------------------------------------------------------
# The stages before PPO: supervised fine-tuning and the reward model
# ----------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class BatchDataConfig:
    """The ``data`` keys SFT, the reward model and DPO share: files, batch size, micro-batches."""

    train_files: list[str] = field(default_factory=lambda: ["assets/data/sft_train.parquet"])
    """Parquet files: ``prompt`` + ``answer`` (or ``messages``) for SFT; ``prompt``, ``chosen``,
    ``rejected`` for the reward model; pairs or ranked groups for DPO."""
    val_files: list[str] = field(default_factory=lambda: ["assets/data/sft_val.parquet"])
    """Held-out files in the same layout (validation loss, reward-model accuracy, DPO's pair metrics)."""
    eval_prompt_files: list[str] = field(default_factory=list)
    """SFT and DPO: prompt files in verl's layout whose greedy answers are scored by the rule reward at
    the end (``sft_val_accuracy``, ``dpo_val_accuracy``)."""
    train_batch_size: int = 64
    """Examples (pairs for the reward model and DPO) per optimizer step, over all ranks."""
    use_dynamic_bsz: bool = True
    """Cut micro-batches by a token budget instead of a fixed example count."""
    max_token_len_per_gpu: int = 8192
    """Token budget of one micro-batch on one rank with ``use_dynamic_bsz``."""
    micro_batch_size_per_gpu: int = 16
    """Examples per forward/backward on one rank (without ``use_dynamic_bsz``)."""
    apply_chat_template: bool = True
    """Render chat-message prompts with the tokenizer's chat template."""
    shuffle: bool = True
    """Shuffle the training examples each epoch."""

    def __post_init__(self) -> None:
        if not self.train_files:
            raise FieldError("train_files is empty: give at least one Parquet file", "train_files")
        _require(self, "> 0", "train_batch_size", "max_token_len_per_gpu", "micro_batch_size_per_gpu")


@dataclass(kw_only=True)
class StageDataConfig(BatchDataConfig):
    """The data of SFT and the reward model."""

    max_length: int = 128
    """Examples longer than this many tokens (prompt + answer) are dropped and counted."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self, "> 0", "max_length")


@dataclass(kw_only=True)
class StageTrainerConfig(RunTrainerConfig):
    """The ``trainer`` section of SFT, the reward model and DPO: the keys every run has, and theirs."""

    experiment_name: str = "stage"
    """Name of this run."""
    output_dir: str = "outputs/stage"
    """Run folder: resolved config, metrics.jsonl, TensorBoard events, checkpoints; the model is saved in
    ``hf/`` unless ``save_path`` is set."""
    test_freq: int = 50
    """Validate every this many steps (and at the end; 0 or -1 validates only at the end)."""
    save_path: str | None = None
    """Where the final ``save_pretrained`` folder goes (default ``output_dir/hf``)."""
    max_time_s: float = 0.0
    """Stop after this many seconds of training (0: no limit); the schedule still assumes the full run."""
    grad_clip: float = 1.0
    """Clip the global gradient norm (0 disables)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self, ">= 0", "max_time_s", "grad_clip")


@dataclass(kw_only=True)
class SFTConfig:
    """Supervised fine-tuning on prompt/answer pairs (loss on answer tokens only)."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig(path="assets/base"))
    """The model to fine-tune."""
    data: StageDataConfig = field(default_factory=StageDataConfig)
    """Training and validation files, lengths, batch sizes."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4, lr_scheduler="cosine"))
    """AdamW with warm-up and cosine decay."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """Sharding of the model."""
    trainer: StageTrainerConfig = field(default_factory=lambda: StageTrainerConfig(output_dir="outputs/sft"))
    """Run length, logging, output."""

    def __post_init__(self) -> None:
        resolve_paths(self.trainer, self.data)


@dataclass(kw_only=True)
class RMLossConfig:
    margin: float = 0.0
    """Bradley-Terry with margin: ``-log sigmoid(r_chosen - r_rejected - margin)``; >= 0 (a negative
    margin would reward ranking the rejected answer above the chosen one)."""

    def __post_init__(self) -> None:
        _require(self, ">= 0", "margin")


@dataclass(kw_only=True)
class RewardModelConfig:
    """A sequence-scoring reward model trained on preference pairs (Bradley-Terry)."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig(path="assets/base"))
    """Where the reward model starts (a causal LM gets a fresh score head)."""
    data: StageDataConfig = field(
        default_factory=lambda: StageDataConfig(
            train_files=["assets/data/pref_train.parquet"], val_files=["assets/data/pref_val.parquet"]
        )
    )
    """Preference files (``prompt``, ``chosen``, ``rejected``), lengths, batch sizes."""
    loss: RMLossConfig = field(default_factory=RMLossConfig)
    """The pairwise loss."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4, lr_scheduler="cosine"))
    """AdamW with warm-up and cosine decay."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """Sharding of the model."""
    trainer: StageTrainerConfig = field(default_factory=lambda: StageTrainerConfig(output_dir="outputs/rm"))
    """Run length, logging, output."""

    def __post_init__(self) -> None:
        resolve_paths(self.trainer, self.data)


@dataclass(kw_only=True)
class PreferenceDataConfig(BatchDataConfig):
    """DPO's data: preference pairs, or the ranked groups the offline PPO path reads, expanded to pairs."""

    train_files: list[str] = field(default_factory=lambda: ["assets/offline/train.parquet"])
    """Parquet files of ``prompt``, ``chosen``, ``rejected`` (preference pairs) or of ranked groups
    (``responses`` with ``ranks`` or ``scores``, as ``rollout.source=dataset`` reads them)."""
    val_files: list[str] = field(default_factory=list)
    """Held-out files in the same layout: the loss, reward margins and accuracies on them."""
    pairs: Literal["best_vs_rest", "best_vs_worst"] = "best_vs_rest"
    """How a ranked group becomes pairs: the best response against each strictly worse one, or against
    the worst only. Groups whose responses all tie give no pair (skipped and counted)."""
    max_prompt_length: int = 64
    """Prompts longer than this many tokens are dropped and counted (as PPO's ``data.max_prompt_length``)."""
    max_response_length: int = 64
    """Responses longer than this many tokens (EOS included) drop their group (as PPO's)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self, "> 0", "max_prompt_length", "max_response_length")


@dataclass(kw_only=True)
class PreferenceLossConfig:
    type: Literal[PREFERENCE_LOSSES] = "dpo"
    """``dpo`` (Rafailov et al. 2023; with ``label_smoothing``: cDPO), ``ipo`` (Azar et al. 2023),
    ``simpo`` (Meng et al. 2024: length-normalized, reference-free: no reference model is loaded) or
    ``kto`` (Ethayarajh et al. 2024, on the pairs' chosen and rejected responses)."""
    beta: float = 0.1
    """Scale of the implicit reward ``beta * (log pi - log pi_ref)`` (SimPO: of the mean token log-prob)."""
    gamma: float = 0.5
    """SimPO's target reward margin."""
    label_smoothing: float = 0.0
    """cDPO: the assumed share of pairs whose labels are flipped, in [0, 0.5)."""
    nll_coef: float = 0.0
    """Weight of an SFT term, the chosen response's token-mean negative log-likelihood (0: off)."""

    def __post_init__(self) -> None:
        _require(self, "> 0", "beta")
        _require(self, ">= 0", "gamma", "nll_coef")
        _require(self, "[0, 0.5)", "label_smoothing")


@dataclass(kw_only=True)
class PreferenceRefConfig:
    model_path: str | None = None
    """The reference policy (default ``model.path``; under LoRA, the model with its adapters off)."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """Sharding of the reference model."""


@dataclass(kw_only=True)
class DPOConfig:
    """DPO-family preference optimization on pairs (or ranked groups) without sampling."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy to train (default: the demo's SFT model)."""
    ref: PreferenceRefConfig = field(default_factory=PreferenceRefConfig)
    """The frozen reference (not loaded for SimPO)."""
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    """Pairs or ranked groups, lengths, batch sizes (``train_batch_size`` counts pairs)."""
    loss: PreferenceLossConfig = field(default_factory=PreferenceLossConfig)
    """The preference loss and its parameters."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Adapters on the policy (rank 0: off); the reference is then the model with adapters off."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """AdamW with warm-up and decay."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """Sharding of the policy."""
    trainer: StageTrainerConfig = field(default_factory=lambda: StageTrainerConfig(output_dir="outputs/dpo"))
    """Run length, logging, output."""

    def __post_init__(self) -> None:
        resolve_paths(self.trainer, self.data)


StageConfig = SFTConfig | RewardModelConfig | DPOConfig


def resolve_paths(trainer: RunTrainerConfig, data: Any) -> None:
    """Resolve a run's paths once, on the whole config (a section's default instance is the base of
    overrides, so it must not freeze a value derived from keys the user may still set): the default
    ``output_dir`` from project and experiment; ``~`` expanded in it, ``save_path`` and the data files."""
    for key in ("train_files", "val_files", "eval_prompt_files"):
        if getattr(data, key, None):
            setattr(data, key, [os.path.expanduser(f) for f in getattr(data, key)])
    if trainer.output_dir is None:
        trainer.output_dir = f"outputs/{trainer.project_name}/{trainer.experiment_name}"
    trainer.output_dir = os.path.expanduser(trainer.output_dir)
    if getattr(trainer, "save_path", None):
        trainer.save_path = os.path.expanduser(trainer.save_path)


"""The config of a stage run (``ppo.stage_loop``)."""


def validate_stage(cfg: StageConfig, world_size: int) -> None:
    """The batch divisibility and token budget an SFT, reward-model or DPO run needs on ``world_size``
    ranks."""
    _check_world_size(world_size)
    d = cfg.data
    errors = []
    if d.train_batch_size % world_size:
        errors.append(
            f"data.train_batch_size={d.train_batch_size} must be a multiple of the world size {world_size}"
        )
    elif not d.use_dynamic_bsz and (d.train_batch_size // world_size) % d.micro_batch_size_per_gpu:
        errors.append(
            f"{d.train_batch_size // world_size} examples per rank must be a multiple of "
            f"data.micro_batch_size_per_gpu={d.micro_batch_size_per_gpu}, or set data.use_dynamic_bsz=true"
        )
    if isinstance(d, PreferenceDataConfig):  # a pair's two sequences share one micro-batch
        longest, what = (
            2 * (d.max_prompt_length + d.max_response_length),
            "2 x (max_prompt_length + max_response_length)",
        )
    else:
        longest, what = d.max_length, "data.max_length"
    if d.use_dynamic_bsz and d.max_token_len_per_gpu < longest:
        errors.append(
            f"data.max_token_len_per_gpu={d.max_token_len_per_gpu} is below the longest example ({what} = "
            f"{longest} tokens)"
        )
    if cfg.fsdp.fsdp_size > 0 and world_size % cfg.fsdp.fsdp_size:
        errors.append(f"fsdp.fsdp_size={cfg.fsdp.fsdp_size} must divide the world size {world_size}")
    if errors:
        raise ConfigError(f"config does not fit world size {world_size}:\n  - " + "\n  - ".join(errors))


def _check_world_size(world_size: int) -> None:
    if world_size < 1:
        raise ConfigError(f"the world size must be >= 1, got {world_size}")


def _shown(kl_ctrl: KLControlConfig, names: list[str]) -> str:
    """``algorithm.kl_ctrl.<name>=<value>`` of each name, for a message."""
    return ", ".join(f"algorithm.kl_ctrl.{name}={getattr(kl_ctrl, name)}" for name in names)


def check_kl_kind(kind: str, key: str) -> None:
    """Fail unless ``kind`` is a KL estimator name, optionally with the ``+`` (k2 gradient) suffix."""
    if kind.removesuffix("+") not in KL_KINDS:
        raise FieldError(
            f"{key}={kind!r} is not a KL estimator; valid: {', '.join(KL_KINDS)} (optionally with '+')", key
        )
