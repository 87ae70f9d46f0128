"""The configuration schema of the PPO trainer and its stages.

One tree of ``@dataclass(kw_only=True)`` sections whose section and key names follow verl, so that a
user of verl finds ``actor.ppo_mini_batch_size`` where they expect it; the defaults are sized for a tiny
CPU run and name no model and no data: ``model.path`` and ``data.train_files`` are required (``validate``
says so, one line naming the key, before any model loads), and without ``data.val_files`` a run does not
validate. ``ppo.config_loader`` builds a config from the defaults, a YAML preset and command-line
overrides::

    cfg = load_config("configs/demo_cpu.yaml", ["actor.optim.lr=1e-5", "rollout.n=4"])
    cfg.validate(world_size=2)

Checks of single values live in each section's ``__post_init__``, which raises a :class:`FieldError`
naming the field within its section; the loader re-raises it with the full key and where the value came
from. Checks that need the world size live in ``validate`` (PPO) and ``validate_stage``. Keys that are
set but do nothing in a run that still trains are no error: ``PPOConfig.warnings`` lists them.

The schema imports only the standard library (no torch): ``--help`` and ``--print-config`` answer
before torch loads, and what the machine can run is checked where the run starts. Its modules, each
importing only those before it: ``errors`` (the errors and the single-value checks), ``shared`` (the
sections every run has), ``roles`` (PPO's model sections: actor with its policy loss and LoRA, critic,
reference), ``sections`` (PPO's other sections: data, rollout, reward, algorithm, trainer),
``distillation`` (on-policy distillation's teachers and loss), ``tree`` (the
tree of PPO's sections and what it implies), ``startup_warnings`` (keys set that do nothing),
``world_size`` (what ``validate`` checks), ``root`` (``PPOConfig``: the tree with its cross-section
rules), ``stages`` (SFT, the reward model, DPO). Import every name from ``ppo.config`` itself.
"""

from ppo.config.distillation import DistillationConfig, DistillationLossConfig, TeacherModelConfig
from ppo.config.errors import ConfigError, FieldError, check_kl_kind
from ppo.config.roles import ActorConfig, CriticConfig, LoRAConfig, PolicyLossConfig, RefConfig
from ppo.config.root import SP_ATTENTION, PPOConfig
from ppo.config.sections import (
    AlgorithmConfig,
    DataConfig,
    FilterGroupsConfig,
    KLControlConfig,
    MultiTurnConfig,
    OverlongBufferConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
    ValKwargsConfig,
)
from ppo.config.shared import (
    LOGGER_SINKS,
    FSDPConfig,
    MixedPrecisionConfig,
    ModelConfig,
    OptimConfig,
    RunTrainerConfig,
    resolve_paths,
)
from ppo.config.stages import (
    BatchDataConfig,
    DPOConfig,
    PreferenceDataConfig,
    PreferenceLossConfig,
    PreferenceRefConfig,
    RewardModelConfig,
    RMLossConfig,
    SFTConfig,
    StageConfig,
    StageDataConfig,
    StageRunConfig,
    StageTrainerConfig,
    validate_stage,
)

__all__ = [
    "LOGGER_SINKS",
    "SP_ATTENTION",
    "ActorConfig",
    "AlgorithmConfig",
    "BatchDataConfig",
    "ConfigError",
    "CriticConfig",
    "DPOConfig",
    "DataConfig",
    "DistillationConfig",
    "DistillationLossConfig",
    "FSDPConfig",
    "FieldError",
    "FilterGroupsConfig",
    "KLControlConfig",
    "LoRAConfig",
    "MixedPrecisionConfig",
    "ModelConfig",
    "MultiTurnConfig",
    "OptimConfig",
    "OverlongBufferConfig",
    "PPOConfig",
    "PolicyLossConfig",
    "PreferenceDataConfig",
    "PreferenceLossConfig",
    "PreferenceRefConfig",
    "RMLossConfig",
    "RefConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "RunTrainerConfig",
    "SFTConfig",
    "StageConfig",
    "StageDataConfig",
    "StageRunConfig",
    "StageTrainerConfig",
    "TeacherModelConfig",
    "TrainerConfig",
    "ValKwargsConfig",
    "check_kl_kind",
    "resolve_paths",
    "validate_stage",
]
