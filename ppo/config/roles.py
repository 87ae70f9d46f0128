"""The sections of the models a PPO run trains and scores with: the actor (with its policy loss and
LoRA adapters), the critic and the frozen reference. Each checks its own values in ``__post_init__``;
the rules that span sections live with the root, ``ppo.config.root``. ``LoRAConfig`` is also the
stages' (``ppo.config.stages``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from ppo.choices import LOSS_AGG_MODES, POLICY_LOSS_MODES
from ppo.config.errors import FieldError, _require, check_kl_kind
from ppo.config.shared import FSDPConfig, OptimConfig


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
    ``token-sum`` (the sum over them, verl 0.9.1's), ``seq-mean-token-sum``, ``seq-mean-token-mean`` (over its sequences), ``seq-mean-token-sum-norm``
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
    kernel_backend: Literal["auto", "triton", "torch", "reference"] = "auto"
    """Log-prob/entropy kernel backend: auto picks Triton on CUDA and chunked PyTorch elsewhere."""
    use_fused_kernels: bool = False
    """Compute log-probs from the final hidden states and the LM head without building full logits."""
    use_prefix_grouper: bool | Literal["auto"] = "auto"
    """Shared prompts (verl's key): every forward and update of a step (actor, reference, critic,
    PRIME's PRM, teachers) holds each prompt once with its responses after it, each response attending
    to the prompt and to itself only; the results equal the plain layout's. ``auto``: on with
    ``rollout.n > 1`` wherever the packed attention kernels run (``model.attn_implementation=auto``)."""
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
    sppo_eta: float = 1.0
    """SPPO (``policy_loss.loss_mode=sppo``): the step size eta of the target ``eta * (P - 1/2)`` (or
    ``eta * (r - softmean(r))``) that each response's log-ratio to the old policy regresses onto, in
    nats per response (verl recipe's ``actor_rollout_ref.actor.sppo_eta``; the recipe's
    ``algorithm.sppo_eta`` is another number, the soft mean's beta: ``algorithm.sppo_beta`` here)."""
    sppo_refresh_steps: int = 1
    """SPPO: the old policy is the actor as it was at the start of every ``sppo_refresh_steps``-th
    step (a frozen snapshot, checkpointed with the run); 1: the policy before this step's update, as
    in PPO. Above 1 only with ``rollout.source=dataset`` (offline SPPO's iterations)."""

    def __post_init__(self) -> None:
        _require(self, ">= 1", "sppo_refresh_steps")
        _require(self, "> 0", "sppo_eta")
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
    override_config: dict[str, Any] = field(default_factory=dict)
    """Fields of the critic's Hugging Face model config set before its weights load (verl's
    ``critic.model.override_config``); the actor's ``model.override_config`` does not apply to it."""
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
