"""The tree of a PPO run's sections, ``PPOTree``, and what they imply together: which models run
(``use_critic``, ``needs_reference``) and whether an update is on-policy. ``PPOConfig``
(``ppo.config.root``) is this tree with its checks; the tree sits below them so that the start-up
warnings (``ppo.config.startup_warnings``) and the world-size checks (``ppo.config.world_size``) can
take it without importing the root that calls them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ppo.config.distillation import DistillationConfig
from ppo.config.roles import ActorConfig, CriticConfig, RefConfig
from ppo.config.sections import (
    AlgorithmConfig,
    DataConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
)
from ppo.config.shared import ModelConfig

SP_ATTENTION = ("auto", "ppo_varlen_sdpa", "ppo_varlen_flash")
"""The ``model.attn_implementation`` values that run ``ppo.attention``'s packed kernels
(``PACKED_ATTENTION``, ``VARLEN_FLASH``): the only ones that exchange heads across ranks (Ulysses
sequence parallelism) and attend a shared prompt's responses to it and to themselves."""


@dataclass(kw_only=True)
class PPOTree:
    """The sections of a PPO run and the facts they decide together; ``PPOConfig`` adds the checks."""

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
    distillation: DistillationConfig = field(default_factory=DistillationConfig)
    """On-policy distillation from teacher models."""

    @property
    def task_loss(self) -> bool:
        """The task's policy loss trains the actor: always, except in a distillation run without
        ``distillation.distillation_loss.use_task_rewards`` (its loss is the distillation loss alone, so
        no advantages are computed)."""
        d = self.distillation
        return not d.enabled or d.distillation_loss.use_task_rewards

    @property
    def share_prompts(self) -> bool:
        """Every forward of the step packs each prompt once with its responses after it
        (``actor.use_prefix_grouper``): ``auto`` where a prompt has several responses (``rollout.n > 1``)
        and the model attends with the packed kernels (``model.attn_implementation`` in
        ``SP_ATTENTION``), which give the same results either way."""
        value = self.actor.use_prefix_grouper
        if value == "auto":
            return self.rollout.n > 1 and self.model.attn_implementation in SP_ATTENTION
        return value

    @property
    def use_critic(self) -> bool:
        """GAE needs a value function; the group estimators and SPPO (which reads no advantages) do not."""
        return self.algorithm.adv_estimator == "gae" and self.actor.policy_loss.loss_mode != "sppo"

    @property
    def advantage_estimator(self) -> str:
        """The row of ``algorithms.ADVANTAGE_ESTIMATORS`` step 3 uses: ``algorithm.adv_estimator``, or
        ``sppo`` (SPPO's targets) with ``actor.policy_loss.loss_mode=sppo``, which reads no advantages."""
        return "sppo" if self.actor.policy_loss.loss_mode == "sppo" else self.algorithm.adv_estimator

    @property
    def one_update_per_rollout(self) -> bool:
        """One update per rollout (one epoch, one mini-batch): the old log-probs are the update's own
        forward, detached, and the ratio is exactly 1 (verl's on-policy shortcut). Not with SPPO's
        old-policy snapshot (``actor.sppo_refresh_steps > 1``): the old policy is older."""
        a = self.actor
        if a.policy_loss.loss_mode == "sppo" and a.sppo_refresh_steps > 1:
            return False
        return a.ppo_epochs == 1 and a.ppo_mini_batch_size == self.data.train_batch_size

    @property
    def sppo_snapshot(self) -> bool:
        """SPPO's old policy is a frozen snapshot of the actor, refreshed every ``actor.sppo_refresh_steps``."""
        return self.actor.policy_loss.loss_mode == "sppo" and self.actor.sppo_refresh_steps > 1

    @property
    def needs_reference(self) -> bool:
        """A reference policy is scored when a KL term, the KL rollback or PRIME's implicit rewards use it."""
        return (
            (self.task_loss and (self.algorithm.use_kl_in_reward or self.actor.use_kl_loss))
            or self.algorithm.rollback_kl > 0
            or self.algorithm.adv_estimator == "prime"
        )
