"""The stages before and beside PPO: supervised fine-tuning (``SFTConfig``), the reward model
(``RewardModelConfig``) and DPO-family preference optimization (``DPOConfig``), run by
``ppo.stage_loop``. The three share one base, ``StageRunConfig``: the model, its optimizer and sharding,
the trainer section and the data's batch keys; ``validate_stage`` checks what the world size decides.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ppo.choices import PREFERENCE_LOSSES
from ppo.config.errors import ConfigError, FieldError, _require, check_world_size
from ppo.config.roles import LoRAConfig
from ppo.config.shared import (
    FSDPConfig,
    ModelConfig,
    OptimConfig,
    RunTrainerConfig,
    check_inputs_set,
    resolve_paths,
    unset_inputs,
)
from ppo.config.startup_warnings import no_validation_warnings, repeated_file_warnings


@dataclass(kw_only=True)
class BatchDataConfig:
    """The ``data`` keys SFT, the reward model and DPO share: files, batch size, micro-batches."""

    train_files: list[str] = field(default_factory=list)
    """Parquet files: ``prompt`` + ``answer`` (or ``messages``) for SFT; ``prompt``, ``chosen``,
    ``rejected`` for the reward model; pairs or ranked groups for DPO. Required: a run without them stops
    before any model loads."""
    val_files: list[str] = field(default_factory=list)
    """Held-out files in the same layout (validation loss, reward-model accuracy, DPO's pair metrics).
    Unset: the run does not validate, and says so once at start-up."""
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
class SFTTrainerConfig(StageTrainerConfig):
    """SFT's ``trainer`` section: the stages' keys, and the prefix of its final numbers."""

    metrics_prefix: str = "sft"
    """Prefix of the run's final numbers in the ``metrics.json`` beside its saved model (``sft_steps``,
    ``sft_val_accuracy``, ...): another name keeps two SFT runs that save into one folder apart (``make
    assets``' teacher writes ``teacher_*`` beside the student's ``sft_*``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.metrics_prefix.isidentifier():
            raise FieldError(
                f"metrics_prefix must be a name of letters, digits and underscores, got {self.metrics_prefix!r}",
                "metrics_prefix",
            )


@dataclass(kw_only=True)
class StageRunConfig:
    """What every stage has: a model to train with its optimizer and sharding, batches of examples, a
    trainer section. Each stage sets its own defaults and adds its sections after these."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model to train: fine-tuned by SFT; where the reward model starts (a causal LM gets a fresh
    score head); the policy of DPO."""
    data: BatchDataConfig = field(default_factory=BatchDataConfig)
    """Training and validation files, lengths, batch sizes."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4, lr_scheduler="cosine"))
    """AdamW with warm-up and (cosine) decay."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """Sharding of the trained model."""
    trainer: StageTrainerConfig = field(default_factory=StageTrainerConfig)
    """Run length, logging, output."""

    def __post_init__(self) -> None:
        resolve_paths(self.trainer, self.data)

    def unset_inputs(self) -> list[str]:
        """One message per input the run cannot start without that is not set (``model.path``,
        ``data.train_files``): the defaults name none; ``validate_stage`` refuses to run without them."""
        return unset_inputs(self.model, self.data, STAGE_INPUTS[type(self).__name__])

    def warnings(self) -> list[str]:
        """One message per group of keys that are set but do nothing in this run, which still trains
        (logged once at start-up): no validation files (the run does not validate), a data file listed
        twice."""
        return no_validation_warnings(self.data, self.trainer) + repeated_file_warnings(self.data)


@dataclass(kw_only=True)
class SFTConfig(StageRunConfig):
    """Supervised fine-tuning on prompt/answer pairs (loss on answer tokens only)."""

    data: StageDataConfig = field(default_factory=StageDataConfig)
    """Training and validation files, lengths, batch sizes."""
    trainer: SFTTrainerConfig = field(default_factory=lambda: SFTTrainerConfig(output_dir="outputs/sft"))
    """Run length, logging, output (default folder ``outputs/sft``), the prefix of the final numbers."""


@dataclass(kw_only=True)
class RMLossConfig:
    margin: float = 0.0
    """Bradley-Terry with margin: ``-log sigmoid(r_chosen - r_rejected - margin)``; >= 0 (a negative
    margin would reward ranking the rejected answer above the chosen one)."""

    def __post_init__(self) -> None:
        _require(self, ">= 0", "margin")


@dataclass(kw_only=True)
class RewardModelConfig(StageRunConfig):
    """A sequence-scoring reward model trained on preference pairs (Bradley-Terry)."""

    data: StageDataConfig = field(default_factory=StageDataConfig)
    """Preference files (``prompt``, ``chosen``, ``rejected``), lengths, batch sizes."""
    trainer: StageTrainerConfig = field(default_factory=lambda: StageTrainerConfig(output_dir="outputs/rm"))
    """Run length, logging, output (default folder ``outputs/rm``)."""
    loss: RMLossConfig = field(default_factory=RMLossConfig)
    """The pairwise loss."""


@dataclass(kw_only=True)
class PreferenceDataConfig(BatchDataConfig):
    """DPO's data: preference pairs, or the ranked groups the offline PPO path reads, expanded to pairs."""

    train_files: list[str] = field(default_factory=list)
    """Parquet files of ``prompt``, ``chosen``, ``rejected`` (preference pairs) or of ranked groups
    (``responses`` with ``ranks`` or ``scores``, as ``rollout.source=dataset`` reads them). Required."""
    val_files: list[str] = field(default_factory=list)
    """Held-out files in the same layout: the loss, reward margins and accuracies on them (unset: the
    run does not validate, and says so once at start-up)."""
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
    """``dpo`` (Rafailov et al. 2023; with ``label_smoothing``: cDPO), ``ipo`` (Azar et al. 2023, as TRL's
    ``loss_type="ipo"``: log-ratios averaged over each response's tokens), ``ipo_sum`` (IPO on log-ratios
    summed over the response, the paper's form),
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
class DPOConfig(StageRunConfig):
    """DPO-family preference optimization on pairs (or ranked groups) without sampling."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy to train."""
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    """Pairs or ranked groups, lengths, batch sizes (``train_batch_size`` counts pairs)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """AdamW with warm-up and decay."""
    trainer: StageTrainerConfig = field(default_factory=lambda: StageTrainerConfig(output_dir="outputs/dpo"))
    """Run length, logging, output (default folder ``outputs/dpo``)."""
    ref: PreferenceRefConfig = field(default_factory=PreferenceRefConfig)
    """The frozen reference (not loaded for SimPO)."""
    loss: PreferenceLossConfig = field(default_factory=PreferenceLossConfig)
    """The preference loss and its parameters."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Adapters on the policy (rank 0: off); the reference is then the model with adapters off."""

    def warnings(self) -> list[str]:
        """The stage's warnings, and the loss keys its ``loss.type`` does not use: ``gamma`` is SimPO's
        margin; ``label_smoothing`` is cDPO's (``dpo`` only)."""
        out, loss, default = super().warnings(), self.loss, PreferenceLossConfig()
        if loss.type != "simpo" and loss.gamma != default.gamma:
            out.append(
                f"loss.type={loss.type}: loss.gamma={loss.gamma} is SimPO's target margin and is ignored"
            )
        if loss.type != "dpo" and loss.label_smoothing != default.label_smoothing:
            out.append(
                f"loss.type={loss.type}: loss.label_smoothing={loss.label_smoothing} smooths the DPO loss only "
                f"(cDPO) and is ignored"
            )
        return out


StageConfig = SFTConfig | RewardModelConfig | DPOConfig
"""The config of a stage run (``ppo.stage_loop``)."""

STAGE_INPUTS = {
    "SFTConfig": {
        "model.path": "the save_pretrained folder or hub id of the model to fine-tune",
        "data.train_files": "the Parquet files of prompt/answer pairs (or messages)",
    },
    "RewardModelConfig": {
        "model.path": "the save_pretrained folder or hub id the reward model starts from",
        "data.train_files": "the Parquet files of preference pairs (prompt, chosen, rejected)",
    },
    "DPOConfig": {
        "model.path": "the policy's save_pretrained folder or hub id",
        "data.train_files": "the Parquet files of preference pairs or ranked groups",
    },
}
"""What the message of each stage's unset ``model.path`` or ``data.train_files`` asks for
(``StageRunConfig.unset_inputs``)."""


def validate_stage(cfg: StageConfig, world_size: int, *, inputs: bool = True) -> None:
    """That the run's inputs are set (``unset_inputs``; ``inputs=False`` skips it, as
    ``PPOConfig.validate``), then the batch divisibility and token budget an SFT, reward-model or DPO run
    needs on ``world_size`` ranks."""
    if inputs:
        check_inputs_set(cfg.unset_inputs())
    check_world_size(world_size)
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
    if isinstance(cfg, DPOConfig) and cfg.loss.type == "kto" and d.train_batch_size // world_size < 2:
        errors.append(  # its KL reference point pairs each prompt with another pair's response on the rank
            f"loss.type=kto needs 2 pairs per rank at least (data.train_batch_size / world size = "
            f"{d.train_batch_size} / {world_size}): with one, KL is estimated from the pair's own chosen response"
        )
    if errors:
        raise ConfigError(f"config does not fit world size {world_size}:\n  - " + "\n  - ".join(errors))
