"""The sections every run has, PPO and the stages before it: the trainer's common keys, the model, its
sharding and its optimizer; and ``resolve_paths``, which the roots call once."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

from ppo.config.errors import ConfigError, FieldError, _require

LOGGER_SINKS = ("console", "jsonl", "tensorboard", "wandb", "mlflow", "swanlab", "trackio", "clearml", "file")
"""Metric sinks ``trainer.logger`` may name."""


@dataclass(kw_only=True)
class RunTrainerConfig:
    """The ``trainer`` keys every run has (PPO and the stages): where it writes, how it resumes, saves,
    validates and logs."""

    project_name: str = "ppo"
    """Groups runs: the trackers' project (wandb, swanlab, trackio, clearml; MLflow's experiment) and the
    run folder's parent."""
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
    max_ckpt_to_keep: int | None = 2
    """Keep this many newest checkpoints, deleting older ones as each new one is saved; null (or 0) keeps
    all. verl's ``trainer.max_actor_ckpt_to_keep`` / ``max_critic_ckpt_to_keep`` are taken here, with
    their values as verl reads them: null (verl's default), 0 or a negative number keeps all."""
    async_save: bool = False
    """Write checkpoints in the background (torch.distributed.checkpoint's async save): the weights and
    optimizer states are copied to host memory, training goes on while a thread writes them, and the
    checkpoint becomes ``latest`` once every rank's shards are on disk (checked each step). At most one
    save is in flight; costs a host copy of the state."""
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    """Metric sinks: console, jsonl, tensorboard, wandb, mlflow, swanlab, trackio, clearml, file (verl's
    names; each tracker is an optional extra). ``metrics.jsonl`` is written whatever the list
    says, and TensorBoard events unless ``tensorboard`` is false, so a verl list (``[console,wandb]``)
    adds wandb and still leaves the run's metrics on disk."""
    tensorboard: bool = True
    """Write TensorBoard events (``tensorboard/`` in the run folder) whatever ``logger`` lists; false
    writes them only when ``logger`` names ``tensorboard``."""

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
        _require(self, ">= 0", "seed")
        if self.max_ckpt_to_keep is not None and self.max_ckpt_to_keep < 0:
            raise FieldError(
                f"max_ckpt_to_keep must be >= 0, got {self.max_ckpt_to_keep}: null or 0 keeps every checkpoint",
                "max_ckpt_to_keep",
            )
        _require(self, ">= -1", "save_freq", "test_freq")


@dataclass(kw_only=True)
class ModelConfig:
    path: str | None = None
    """Local folder or hub id of the policy (actor and reference start from it), loaded with
    ``from_pretrained``. Required: a run without it stops before any model loads."""
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
    override_config: dict[str, Any] = field(default_factory=dict)
    """Fields of the Hugging Face model config set before the weights load (verl's
    ``actor_rollout_ref.model.override_config``), e.g. ``max_position_embeddings``, ``rope_parameters``
    (or verl's ``rope_scaling``: a mapping is merged into the field's dict), ``attention_dropout``;
    applies to the actor, and to the reference, SPPO's old policy and PRIME's PRM where they load
    ``model.path``. Checked against config.json at start-up: a field the config does not have is an error
    naming it. Its ``attn_implementation`` picks the attention kernel as ``model.attn_implementation``
    does. Dropout is off at load unless set here. A resume with another value is refused."""


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
    lr_warmup_steps: int = -1
    """Linear warm-up from 0 to ``lr`` over this many optimizer steps; -1 (verl's default): use
    ``lr_warmup_steps_ratio``."""
    lr_warmup_steps_ratio: float = 0.0
    """Warm-up as a fraction of the total optimizer steps, used when ``lr_warmup_steps`` is -1 (0: no
    warm-up)."""
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


def unset_inputs(model: ModelConfig, data: Any, what: dict[str, str]) -> list[str]:
    """One message per input a run cannot start without that is not set: ``model.path`` and
    ``data.train_files``, whose defaults name nothing (a run trains on the model and files it names,
    never on a demo's). ``what``: for each of the two keys, what to give, as the message says it."""
    unset = {"model.path": not model.path, "data.train_files": not getattr(data, "train_files", None)}
    return [f"{key} is not set: give {what[key]}" for key, missing in unset.items() if missing]


def check_inputs_set(unset: list[str]) -> None:
    """ConfigError on one line naming every key of ``unset`` (``unset_inputs``), before the run's other
    checks: where a run starts (``validate``), before any model loads."""
    if unset:
        raise ConfigError("; ".join(unset))
