"""The root of a PPO run's config, ``PPOConfig``, and the rules that span its sections.

``PPOConfig.__post_init__`` resolves the fallbacks (``critic.ppo_epochs`` from the actor's, ...) once,
then runs the cross-section rules below, grouped by topic, each a function of the whole config that
raises a :class:`FieldError` naming every key involved; ``warnings`` lists keys that are set but do
nothing; ``validate`` checks what the world size decides (batch divisibility, shard groups). Nothing
here looks at the machine: what it can run (CUDA, a forced kernel backend) is checked where the run
starts (``ppo.build``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from ppo.choices import GROUP_ESTIMATORS
from ppo.config.errors import ConfigError, FieldError, check_world_size
from ppo.config.sections import (
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    DataConfig,
    KLControlConfig,
    PolicyLossConfig,
    RefConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
)
from ppo.config.shared import ModelConfig, resolve_paths

SP_ATTENTION = ("auto", "ppo_varlen_sdpa", "ppo_varlen_flash")
"""The ``model.attn_implementation`` values Ulysses sequence parallelism runs with: ``ppo.attention``'s
packed kernels (``PACKED_ATTENTION``, ``VARLEN_FLASH``), the only ones that exchange heads across ranks."""


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
        _expand_user_code_paths(self)
        _resolve_fallbacks(self)
        _check_groups(self)
        _check_policy_loss(self)
        _check_overlong_buffer(self)
        _check_dynamic_sampling(self)
        _check_reward_model(self)
        _check_critic_warmup(self)
        _check_offline(self)
        _check_multi_turn(self)
        _check_sequence_parallel(self)
        _check_prime(self)

    @property
    def use_critic(self) -> bool:
        """GAE needs a value function; the group estimators and SPPO (which reads no advantages) do not."""
        return self.algorithm.adv_estimator == "gae" and self.actor.policy_loss.loss_mode != "sppo"

    @property
    def on_policy(self) -> bool:
        """One update per rollout (one epoch, one mini-batch): the ratio is exactly 1 (verl's shortcut).
        Not with SPPO's old-policy snapshot (``actor.sppo_refresh_steps > 1``): the old policy is older."""
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
            self.algorithm.use_kl_in_reward
            or self.actor.use_kl_loss
            or self.algorithm.rollback_kl > 0
            or self.algorithm.adv_estimator == "prime"
        )

    def warnings(self) -> list[str]:
        """One message per group of keys that are set but do nothing in this run, which still trains
        (the caller logs them once at start-up): the KL controller's keys without a KL penalty in the
        reward, the adaptive controller's keys with a fixed one, greedy rollouts compared within their
        group, recipe keys their recipe does not use, a critic warm-up without a critic, the reward
        function's keys without a function, a data file listed twice."""
        return [
            *_kl_controller_warnings(self),
            *_greedy_group_warnings(self),
            *_recipe_warnings(self),
            *_critic_warmup_warnings(self),
            *_reward_function_warnings(self),
            *_reward_cap_warnings(self),
            *repeated_file_warnings(self.data),
        ]

    def validate(self, world_size: int) -> None:
        """Check every batch divisibility that ``world_size`` ranks need; say which numbers to change.

        Each rank takes ``train_batch_size / world_size`` prompts and samples ``n`` responses for each;
        each mini-batch holds ``ppo_mini_batch_size * n``
        sequences split evenly over ranks, and (without dynamic batch size) each rank's share splits into
        micro-batches of ``ppo_micro_batch_size_per_gpu``.
        """
        check_world_size(world_size)
        errors = [
            *_planned_world_size_errors(self, world_size),
            *_batch_errors(self, world_size),
            *_token_budget_errors(self),
            *_shard_group_errors(self, world_size),
        ]
        if errors:
            fits = _fitting_world_sizes(self)
            if fits and world_size not in fits:
                errors.append(f"world sizes these batch sizes fit: {', '.join(map(str, fits))}")
            raise ConfigError(f"config does not fit world size {world_size}:\n  - " + "\n  - ".join(errors))


# ----------------------------------------------------------------------------------------------------
# Fallbacks: keys whose default is another key's value
# ----------------------------------------------------------------------------------------------------


def _expand_user_code_paths(cfg: PPOConfig) -> None:
    """``~`` in the file of ``reward.custom_function`` and ``rollout.multi_turn.env``
    (``~/rewards.py:fn``), as in the run's other paths."""
    if cfg.reward.custom_function and cfg.reward.custom_function.startswith("~"):
        cfg.reward.custom_function = os.path.expanduser(cfg.reward.custom_function)
    turns = cfg.rollout.multi_turn
    if turns.env and turns.env.startswith("~"):
        turns.env = os.path.expanduser(turns.env)


def _resolve_fallbacks(cfg: PPOConfig) -> None:
    """Fill in the keys left unset whose default is another key's value, once, here, so that the trainer
    and the saved config.yaml see the values that run. A default instance is never the base of another
    build (see ``config_loader._build``), so this cannot freeze a default the user then overrides."""
    rollout, data, actor, critic = cfg.rollout, cfg.data, cfg.actor, cfg.critic
    if rollout.offline_fraction is None:  # resolved here: an override of source alone must see it
        rollout.offline_fraction = 1.0 if rollout.source == "dataset" else 0.0
    if data.gen_batch_size is None:
        data.gen_batch_size = data.train_batch_size
    if critic.ppo_mini_batch_size is None:
        critic.ppo_mini_batch_size = actor.ppo_mini_batch_size
    if critic.ppo_epochs is None:
        critic.ppo_epochs = actor.ppo_epochs
    if cfg.reward.prime.mini_batch_size is None:
        cfg.reward.prime.mini_batch_size = actor.ppo_mini_batch_size
    if actor.clip_ratio_low is None:
        actor.clip_ratio_low = actor.clip_ratio
    if actor.clip_ratio_high is None:
        actor.clip_ratio_high = actor.clip_ratio


# ----------------------------------------------------------------------------------------------------
# Rules: groups of responses, the policy loss, the reasoning-RL recipes
# ----------------------------------------------------------------------------------------------------


def _check_groups(cfg: PPOConfig) -> None:
    """A group baseline and a ranking compare the ``rollout.n`` responses to a prompt: they need two."""
    n = cfg.rollout.n
    if cfg.algorithm.adv_estimator in ("grpo", "rloo", "prime") and n < 2:
        raise FieldError(
            f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} needs rollout.n >= 2 "
            f"(a group baseline), got rollout.n={n}",
            "rollout.n",
            "algorithm.adv_estimator",
        )
    if cfg.reward.style == "ranking" and n < 2:
        raise FieldError(
            f"reward.style=ranking needs rollout.n >= 2 responses to rank, got rollout.n={n}",
            "rollout.n",
            "reward.style",
        )


def _check_policy_loss(cfg: PPOConfig) -> None:
    """KL-Cov penalizes the distance to the old policy, which an on-policy update never leaves. SPPO
    averages one loss per response, compares a group's responses (win rates), refreshes its old policy
    only between iterations over fixed data, and weighs nothing by importance."""
    a = cfg.actor
    if a.policy_loss.loss_mode == "sppo":
        if a.loss_agg_mode != "token-mean":
            raise FieldError(
                f"actor.policy_loss.loss_mode=sppo has one loss per response, averaged over responses (verl's "
                f"recipe under token-mean, the only mode it defines); got actor.loss_agg_mode={a.loss_agg_mode}",
                "actor.loss_agg_mode",
                "actor.policy_loss.loss_mode",
            )
        if cfg.algorithm.sppo_target == "win_rate" and cfg.rollout.n < 2:
            raise FieldError(
                f"algorithm.sppo_target=win_rate compares the rollout.n responses to a prompt: it needs "
                f"rollout.n >= 2, got {cfg.rollout.n}",
                "rollout.n",
                "algorithm.sppo_target",
            )
        if a.sppo_refresh_steps > 1 and cfg.rollout.offline_fraction < 1:
            raise FieldError(
                f"actor.sppo_refresh_steps={a.sppo_refresh_steps} keeps an older policy as pi_old, but sampled "
                f"responses come from the current one: use it with rollout.source=dataset (offline SPPO), or "
                f"set actor.sppo_refresh_steps=1",
                "actor.sppo_refresh_steps",
                "rollout.source",
            )
        if cfg.algorithm.rollout_is:
            raise FieldError(
                "algorithm.rollout_is weighs policy-gradient terms, which SPPO's squared log-ratio loss has "
                "not: set algorithm.rollout_is=false (the mismatch/* metrics stay)",
                "algorithm.rollout_is",
                "actor.policy_loss.loss_mode",
            )
    if cfg.actor.policy_loss.loss_mode == "kl_cov" and cfg.on_policy:
        raise FieldError(
            f"actor.policy_loss.loss_mode=kl_cov penalizes |log pi - log pi_old|, which is 0 in the one update "
            f"of an on-policy step (actor.ppo_epochs=1 and actor.ppo_mini_batch_size=data.train_batch_size="
            f"{cfg.data.train_batch_size}), so it would train as vanilla PPO without a clip: set "
            f"actor.ppo_epochs >= 2 or a smaller actor.ppo_mini_batch_size",
            "actor.policy_loss.loss_mode",
            "actor.ppo_epochs",
            "actor.ppo_mini_batch_size",
        )


def _check_overlong_buffer(cfg: PPOConfig) -> None:
    """DAPO's overlong buffer must fit in the response."""
    o, max_len = cfg.reward.overlong_buffer, cfg.data.max_response_length
    if o.enable and not 0 < o.len <= max_len:
        raise FieldError(
            f"reward.overlong_buffer.len={o.len} must be in (0, data.max_response_length={max_len}]: "
            f"responses longer than max_response_length - len are penalized",
            "reward.overlong_buffer.len",
            "data.max_response_length",
        )


def _check_dynamic_sampling(cfg: PPOConfig) -> None:
    """DAPO's dynamic sampling needs sampled groups of several responses to filter, whole batches per
    generation round, and a metric the reward has."""
    d, f = cfg.data, cfg.algorithm.filter_groups
    if not f.enable:
        return
    if cfg.rollout.n < 2:
        raise FieldError(
            f"algorithm.filter_groups.enable=true drops groups whose responses all score alike, but with "
            f"rollout.n={cfg.rollout.n} every group has one response (always kept): use rollout.n >= 2",
            "algorithm.filter_groups.enable",
            "rollout.n",
        )
    if cfg.rollout.offline_fraction > 0:
        raise FieldError(
            "algorithm.filter_groups.enable=true generates more prompts until the batch is full, which offline "
            "groups (rollout.source=dataset or rollout.offline_fraction > 0) cannot: turn one of them off",
            "algorithm.filter_groups.enable",
            "rollout.offline_fraction",
        )
    if not cfg.rollout.do_sample and not f.max_num_gen_batches:
        raise FieldError(
            f"algorithm.filter_groups.enable=true with rollout.do_sample=false: greedy decoding gives the "
            f"rollout.n={cfg.rollout.n} responses to a prompt the same tokens and score, so every group is "
            f"dropped and with algorithm.filter_groups.max_num_gen_batches=0 (no limit) generation never "
            f"ends: set rollout.do_sample=true",
            "algorithm.filter_groups.enable",
            "rollout.do_sample",
            "algorithm.filter_groups.max_num_gen_batches",
        )
    if d.gen_batch_size % d.train_batch_size:
        raise FieldError(
            f"data.gen_batch_size={d.gen_batch_size} must be a multiple of data.train_batch_size="
            f"{d.train_batch_size}: each generation round draws whole batches from the prompt loader",
            "data.gen_batch_size",
            "data.train_batch_size",
        )
    if f.metric == "acc" and cfg.reward.style == "model":
        raise FieldError(
            "algorithm.filter_groups.metric=acc is the rule's verdict (score >= 1), which a reward model's "
            "scores do not have: use algorithm.filter_groups.metric=score",
            "algorithm.filter_groups.metric",
            "reward.style",
        )


# ----------------------------------------------------------------------------------------------------
# Rules: the reward model, the critic warm-up
# ----------------------------------------------------------------------------------------------------


def _check_reward_model(cfg: PPOConfig) -> None:
    """``reward.model_path`` is set exactly when the reward scores with a model."""
    r = cfg.reward
    needs_rm = r.style == "model" or (r.style == "ranking" and r.ranking_by == "model")
    if needs_rm and not r.model_path:
        raise FieldError(
            "reward.model_path is required with reward.style=model (or ranking_by=model)",
            "reward.model_path",
            "reward.style",
        )
    if r.model_path and not needs_rm:
        style = f"reward.style={r.style}"
        if r.style == "ranking":
            style += f" with reward.ranking_by={r.ranking_by}"
        raise FieldError(
            f"reward.model_path={r.model_path!r} is set, but {style} never loads a reward model: "
            f"score with it (reward.style=model, or reward.style=ranking with reward.ranking_by=model), or "
            f"set reward.model_path=null",
            "reward.model_path",
            "reward.style",
        )


def _check_critic_warmup(cfg: PPOConfig) -> None:
    """The actor must train at least once."""
    t = cfg.trainer
    if t.total_training_steps is not None and t.critic_warmup > t.total_training_steps:
        # The actor first updates at step critic_warmup (steps count from 1; train_ppo.update).
        raise FieldError(
            f"trainer.critic_warmup={t.critic_warmup} is past the last step (trainer.total_training_steps="
            f"{t.total_training_steps}): the actor would never train; lower trainer.critic_warmup",
            "trainer.critic_warmup",
            "trainer.total_training_steps",
        )


# ----------------------------------------------------------------------------------------------------
# Rules: offline groups, multi-turn rollouts, sequence parallelism
# ----------------------------------------------------------------------------------------------------


def _check_offline(cfg: PPOConfig) -> None:
    """Offline groups: a share that gives at least one offline and one sampled group, and the keys that
    need them (importance weights, scores from the data) or cannot use them (a critic)."""
    fraction, groups = cfg.rollout.offline_fraction, cfg.data.train_batch_size
    offline_groups = math.floor(groups * fraction + 0.5)  # the rounding of offline.num_offline_groups
    if 0 < fraction < 1 and offline_groups in (0, groups):
        if offline_groups == 0:
            fix = f"use at least {1 / groups:.4g} (one group), or 0"
        else:
            fix = f"use at most {(groups - 1) / groups:.4g} (one sampled group), or rollout.source=dataset"
        raise FieldError(
            f"rollout.offline_fraction={fraction} of data.train_batch_size={groups} prompt groups gives "
            f"{offline_groups} offline groups a step: {fix}",
            "rollout.offline_fraction",
            "data.train_batch_size",
        )
    if fraction > 0 and cfg.use_critic:
        raise FieldError(
            "algorithm.adv_estimator=gae with offline groups (rollout.source=dataset or "
            "rollout.offline_fraction > 0): the critic would learn the values of the policy that wrote the "
            "data, not the actor's; use a group baseline: algorithm.adv_estimator=grpo or rloo",
            "algorithm.adv_estimator",
            "rollout.offline_fraction",
        )
    if cfg.algorithm.rollout_is_threshold is not None and fraction == 0:
        raise FieldError(
            "algorithm.rollout_is_threshold weighs responses by the policy that sampled them, which only "
            "offline data records here (rollout.source=dataset or rollout.offline_fraction > 0)",
            "algorithm.rollout_is_threshold",
            "rollout.offline_fraction",
        )
    if cfg.algorithm.rollout_rs is not None and fraction == 0:
        raise FieldError(
            "algorithm.rollout_rs rejects tokens by their divergence from the policy that sampled them, which "
            "only offline data records here (rollout.source=dataset or rollout.offline_fraction > 0)",
            "algorithm.rollout_rs",
            "rollout.offline_fraction",
        )
    if cfg.reward.style == "dataset" and fraction < 1.0:
        raise FieldError(
            "reward.style=dataset reads the offline data's scores, which sampled responses do not have: "
            "use it with rollout.source=dataset",
            "reward.style",
            "rollout.source",
        )


def _check_multi_turn(cfg: PPOConfig) -> None:
    """The combinations a multi-turn rollout cannot run with."""
    r = cfg.rollout
    if not r.multi_turn.enable:
        return
    if r.offline_fraction > 0:
        raise FieldError(
            "rollout.multi_turn.enable=true runs the environment between the model's turns, but offline groups "
            "(rollout.source=dataset or rollout.offline_fraction > 0) are single-turn responses read from the "
            "data: turn one of them off",
            "rollout.multi_turn.enable",
            "rollout.offline_fraction",
        )
    if r.compile is True:
        raise FieldError(
            "rollout.multi_turn.enable=true decodes each turn with the eager KV cache; rollout.compile=true is "
            "not available with it: set rollout.compile=auto or false",
            "rollout.multi_turn.enable",
            "rollout.compile",
        )
    if r.ignore_eos:
        raise FieldError(
            "rollout.multi_turn.enable=true ends turns at stop strings and trajectories at an EOS; "
            "rollout.ignore_eos=true would never end either: turn one of them off",
            "rollout.multi_turn.enable",
            "rollout.ignore_eos",
        )


def _check_sequence_parallel(cfg: PPOConfig) -> None:
    """Actor, critic and reference share one sequence-parallel size (the critic's and the reference's
    default to the actor's), and it runs with the packed attention kernels only."""
    sp = cfg.actor.ulysses_sequence_parallel_size
    for role in ("critic", "ref"):
        section = getattr(cfg, role)
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
    if sp > 1 and cfg.model.attn_implementation not in SP_ATTENTION:
        raise FieldError(
            f"model.attn_implementation={cfg.model.attn_implementation} cannot run with "
            f"actor.ulysses_sequence_parallel_size={sp}: only the packed kernels exchange heads across the "
            f"ranks of a sequence-parallel group; use model.attn_implementation=auto",
            "model.attn_implementation",
            "actor.ulysses_sequence_parallel_size",
        )


def _check_prime(cfg: PPOConfig) -> None:
    """PRIME makes its own token rewards (the implicit PRM's, and the outcome score's), on one
    sequence-parallel layout; the accuracy filter draws whole batches and is the only filter."""
    alg, d = cfg.algorithm, cfg.data
    if alg.adv_estimator == "prime":
        if alg.use_kl_in_reward:
            raise FieldError(
                "algorithm.adv_estimator=prime takes its token rewards from the implicit PRM and the outcome "
                "score (verl's PRIME trainer never subtracts a KL from them): set algorithm.use_kl_in_reward="
                "false and, for a KL term, actor.use_kl_loss=true",
                "algorithm.adv_estimator",
                "algorithm.use_kl_in_reward",
            )
        if cfg.actor.ulysses_sequence_parallel_size > 1:
            raise FieldError(
                "algorithm.adv_estimator=prime: the implicit PRM runs without sequence parallelism; set "
                "actor.ulysses_sequence_parallel_size=1",
                "algorithm.adv_estimator",
                "actor.ulysses_sequence_parallel_size",
            )
    if d.filter_accuracy:
        if alg.filter_groups.enable:
            raise FieldError(
                "data.filter_accuracy=true and algorithm.filter_groups.enable=true are two sampling filters; "
                "turn one of them off",
                "data.filter_accuracy",
                "algorithm.filter_groups.enable",
            )
        if cfg.rollout.offline_fraction > 0 or cfg.rollout.n < 2:
            raise FieldError(
                "data.filter_accuracy=true filters groups of sampled responses: it needs rollout.n >= 2 and "
                "no offline groups (rollout.offline_fraction=0)",
                "data.filter_accuracy",
                "rollout.n",
            )
        if d.gen_batch_size % d.train_batch_size:
            raise FieldError(
                f"data.gen_batch_size={d.gen_batch_size} must be a multiple of data.train_batch_size="
                f"{d.train_batch_size}: the accuracy filter samples gen_batch_size / train_batch_size whole "
                f"batches (verl recipe's data.oversample_factor) and keeps one",
                "data.gen_batch_size",
                "data.train_batch_size",
            )
        if d.accuracy_lower_bound > d.accuracy_upper_bound:
            raise FieldError(
                f"data.accuracy_lower_bound={d.accuracy_lower_bound} is above data.accuracy_upper_bound="
                f"{d.accuracy_upper_bound}: no group can pass",
                "data.accuracy_lower_bound",
                "data.accuracy_upper_bound",
            )


# ----------------------------------------------------------------------------------------------------
# Warnings: keys that are set but do nothing in this run
# ----------------------------------------------------------------------------------------------------


def _kl_controller_warnings(cfg: PPOConfig) -> list[str]:
    """The KL controller's keys without a KL penalty in the reward; the adaptive controller's keys with
    a fixed one."""
    k, default = cfg.algorithm.kl_ctrl, KLControlConfig()
    changed = [
        name
        for name in ("type", "kl_coef", "target_kl", "horizon", "fixed_warmup_steps")
        if getattr(k, name) != getattr(default, name)
    ]
    adaptive_only = [name for name in changed if name in ("target_kl", "horizon", "fixed_warmup_steps")]
    if not cfg.algorithm.use_kl_in_reward and changed:
        hint = " (the KL loss's weight is actor.kl_loss_coef)" if cfg.actor.use_kl_loss else ""
        return [
            f"algorithm.use_kl_in_reward=false: the reward has no KL penalty, so {_shown(k, changed)} "
            f"{'is' if len(changed) == 1 else 'are'} ignored{hint}"
        ]
    if k.type == "fixed" and adaptive_only:
        return [
            f"algorithm.kl_ctrl.type=fixed keeps the KL coefficient at algorithm.kl_ctrl.kl_coef={k.kl_coef}: "
            f"{_shown(k, adaptive_only)} only steer{'s' if len(adaptive_only) == 1 else ''} "
            f"algorithm.kl_ctrl.type=adaptive and {'is' if len(adaptive_only) == 1 else 'are'} ignored"
        ]
    return []


def _shown(kl_ctrl: KLControlConfig, names: list[str]) -> str:
    """``algorithm.kl_ctrl.<name>=<value>`` of each name, for a message."""
    return ", ".join(f"algorithm.kl_ctrl.{name}={getattr(kl_ctrl, name)}" for name in names)


def _greedy_group_warnings(cfg: PPOConfig) -> list[str]:
    """Greedy rollouts compared within their group."""
    if cfg.rollout.do_sample or cfg.rollout.offline_fraction >= 1.0:
        return []
    # Greedy decoding gives every response to a prompt the same tokens: a baseline or a ranking
    # within the group then sees no difference (an entropy bonus still trains, and tests use that).
    if cfg.algorithm.adv_estimator in GROUP_ESTIMATORS:
        group = f"algorithm.adv_estimator={cfg.algorithm.adv_estimator}"
    elif cfg.reward.style == "ranking":
        group = "reward.style=ranking"
    else:
        return []
    return [
        f"rollout.do_sample=false decodes greedily, so the rollout.n={cfg.rollout.n} sampled "
        f"responses to a prompt are identical and {group} compares them within their group: every "
        f"advantage is 0; set rollout.do_sample=true"
    ]


def _recipe_warnings(cfg: PPOConfig) -> list[str]:
    """Recipe keys set where they do nothing."""
    out = []
    a, d, alg = cfg.actor, cfg.data, cfg.algorithm
    mode, loss = a.policy_loss.loss_mode, a.policy_loss
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
    sppo_keys = {
        "actor.sppo_eta": (a.sppo_eta, ActorConfig().sppo_eta),
        "actor.sppo_refresh_steps": (a.sppo_refresh_steps, ActorConfig().sppo_refresh_steps),
        "algorithm.sppo_target": (alg.sppo_target, AlgorithmConfig().sppo_target),
        "algorithm.sppo_beta": (alg.sppo_beta, AlgorithmConfig().sppo_beta),
    }
    if mode != "sppo" and any(value != default for value, default in sppo_keys.values()):
        given = ", ".join(f"{k}={v}" for k, (v, d) in sppo_keys.items() if v != d)
        out.append(f"actor.policy_loss.loss_mode={mode} does not use {given} (SPPO's keys)")
    if mode == "sppo" and alg.sppo_target == "win_rate" and alg.sppo_beta != AlgorithmConfig().sppo_beta:
        out.append(f"algorithm.sppo_target=win_rate does not use algorithm.sppo_beta={alg.sppo_beta}")
    if a.loss_scale_factor is not None and a.loss_agg_mode != "seq-mean-token-sum-norm":
        out.append(
            f"actor.loss_scale_factor={a.loss_scale_factor} divides only loss_agg_mode=seq-mean-token-sum-norm, "
            f"not actor.loss_agg_mode={a.loss_agg_mode}: it is ignored"
        )
    f, o = alg.filter_groups, cfg.reward.overlong_buffer
    if not f.enable and (
        (d.gen_batch_size != d.train_batch_size and not d.filter_accuracy) or f.max_num_gen_batches
    ):
        out.append(
            "algorithm.filter_groups.enable=false: data.gen_batch_size and "
            "algorithm.filter_groups.max_num_gen_batches are used by dynamic sampling only and are ignored"
        )
    if not o.enable and o.len:
        out.append(f"reward.overlong_buffer.enable=false: reward.overlong_buffer.len={o.len} is ignored")
    if alg.adv_estimator in ("reinforce_plus_plus_baseline", "opo") and cfg.rollout.n == 1:
        out.append(
            f"algorithm.adv_estimator={alg.adv_estimator} with rollout.n=1: a group of one has baseline 0, so "
            f"each advantage is the response's own score"
        )
    v = cfg.rollout.val_kwargs
    if v.n > 1 and not v.do_sample:
        out.append(
            f"rollout.val_kwargs.n={v.n} with rollout.val_kwargs.do_sample=false: the {v.n} greedy answers to a "
            f"prompt are identical, so best@k and maj@n equal the greedy accuracy; set do_sample=true"
        )
    return out


def _critic_warmup_warnings(cfg: PPOConfig) -> list[str]:
    """A critic warm-up without a critic."""
    warmup = cfg.trainer.critic_warmup
    if warmup > 1 and not cfg.use_critic:
        return [
            f"trainer.critic_warmup={warmup} with algorithm.adv_estimator={cfg.algorithm.adv_estimator}, "
            f"which has no critic: steps 1 to {warmup - 1} train nothing; set trainer.critic_warmup=0"
        ]
    return []


def _reward_cap_warnings(cfg: PPOConfig) -> list[str]:
    """``reward.total_timeout_s`` caps the reward workers' scoring: without workers it does nothing."""
    r = cfg.reward
    if r.total_timeout_s is None or r.pool_workers > 0:
        return []
    return [
        f"reward.total_timeout_s={r.total_timeout_s} caps the scoring in reward workers and is ignored with "
        "reward.pool_workers=0 (the trainer's process limits each call to reward.timeout_s)"
    ]


def _reward_function_warnings(cfg: PPOConfig) -> list[str]:
    """The reward function's keys without a function: ``reward_kwargs`` go to ``reward.custom_function``
    only; ``timeout_s`` and ``error_score`` limit a function's calls (``error_score``: in reward workers).
    With a function, ``reward.num_workers`` (verl's Ray reward workers, and the pool's key before
    ``reward.pool_workers``) starts no pool: said once, for configs written for the old key."""
    r, default = cfg.reward, RewardConfig()
    if r.custom_function is not None:
        if r.num_workers and r.pool_workers == 0:
            return [
                f"reward.num_workers={r.num_workers} is verl's count of Ray reward workers and starts nothing "
                "here: the reward function's per-rank process pool is now reward.pool_workers"
            ]
        return []
    unused = [f"reward.reward_kwargs={r.reward_kwargs}"] if r.reward_kwargs else []
    if r.pool_workers == 0:
        unused += [
            f"reward.{name}={getattr(r, name)}"
            for name in ("timeout_s", "error_score")
            if getattr(r, name) != getattr(default, name)
        ]
    if not unused:
        return []
    return [
        f"reward.custom_function is not set (the built-in rule scores): {', '.join(unused)} "
        f"{'is' if len(unused) == 1 else 'are'} ignored"
    ]


def repeated_file_warnings(data: object) -> list[str]:
    """A file listed twice in one of ``data``'s file lists: its rows would count twice."""
    out = []
    for key in ("train_files", "val_files", "eval_prompt_files"):
        seen: set[str] = set()
        for path in getattr(data, key, None) or []:
            normal = os.path.normpath(os.path.abspath(path))
            if normal in seen:
                out.append(f"data.{key} lists {path} twice: its rows are read (and weigh) twice")
            seen.add(normal)
    return out


# ----------------------------------------------------------------------------------------------------
# World size: what validate checks
# ----------------------------------------------------------------------------------------------------


def _fitting_world_sizes(cfg: PPOConfig) -> list[int]:
    """The numbers of ranks (up to ``data.train_batch_size``) that the batch sizes and shard groups divide
    evenly: what a world-size error offers instead."""
    return [
        w
        for w in range(1, cfg.data.train_batch_size + 1)
        if not _batch_errors(cfg, w) and not _shard_group_errors(cfg, w)
    ]


def _planned_world_size_errors(cfg: PPOConfig, world_size: int) -> list[str]:
    """A preset sized for ``trainer.nnodes x trainer.n_gpus_per_node`` ranks runs on that many."""
    t, planned = cfg.trainer, cfg.trainer.planned_world_size
    if planned is None or planned == world_size:
        return []
    return [
        f"trainer.nnodes={t.nnodes} x trainer.n_gpus_per_node={t.n_gpus_per_node} "
        f"= {planned} ranks, but {world_size} run: the preset's batch sizes are sized for {planned}; "
        f"set trainer.nnodes and trainer.n_gpus_per_node to what you launch (or null)"
    ]


def _batch_errors(cfg: PPOConfig, world_size: int) -> list[str]:
    """Prompts, mini-batches and micro-batches divide evenly over the ranks."""
    errors = []
    n = cfg.rollout.n
    bsz = cfg.data.train_batch_size
    sp = cfg.actor.ulysses_sequence_parallel_size
    if bsz % world_size:
        # Each rank samples all n responses of its own prompts, so groups (GRPO, RLOO, ranking)
        # never straddle ranks.
        errors.append(
            f"data.train_batch_size={bsz} prompts must divide evenly over {world_size} ranks: "
            f"make it a multiple of {world_size}"
        )
    a = cfg.actor
    roles = [("actor", a.ppo_mini_batch_size, a.use_dynamic_bsz, a.ppo_micro_batch_size_per_gpu)]
    if cfg.use_critic:
        c = cfg.critic
        roles.append(("critic", c.ppo_mini_batch_size, c.use_dynamic_bsz, c.ppo_micro_batch_size_per_gpu))
    if cfg.algorithm.adv_estimator == "prime":  # the PRM micro-batches as the actor does
        mini = cfg.reward.prime.mini_batch_size
        roles.append(("reward.prime", mini, a.use_dynamic_bsz, a.ppo_micro_batch_size_per_gpu))
    for role, mini, dynamic, micro in roles:
        if bsz % mini:
            errors.append(
                f"{role}.ppo_mini_batch_size={mini} must divide data.train_batch_size={bsz}: change one of them"
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
    return errors


def _token_budget_errors(cfg: PPOConfig) -> list[str]:
    """A token-budget micro-batch (with its sequence-parallel ranks) holds the longest sequence."""
    errors = []
    sp = cfg.actor.ulysses_sequence_parallel_size
    max_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    for role, section in (("actor", cfg.actor), ("critic", cfg.critic)):
        budget = section.ppo_max_token_len_per_gpu
        if section.use_dynamic_bsz and budget * sp < max_len:
            ranks = f" (x {sp} sequence-parallel ranks)" if sp > 1 else ""
            errors.append(
                f"{role}.ppo_max_token_len_per_gpu={budget}{ranks} is below the longest sequence "
                f"(max_prompt_length + max_response_length = {max_len}): raise it"
            )
    return errors


def _shard_group_errors(cfg: PPOConfig, world_size: int) -> list[str]:
    """Sequence-parallel and FSDP shard groups divide the world size."""
    errors = []
    for role in ("actor", "critic", "ref"):
        sp = getattr(cfg, role).ulysses_sequence_parallel_size
        if world_size % sp:
            errors.append(
                f"{role}.ulysses_sequence_parallel_size={sp} must divide the world size {world_size}"
            )
    for role in ("actor", "critic", "ref", "reward"):
        fsdp = getattr(cfg, role).fsdp
        if fsdp.fsdp_size > 0 and world_size % fsdp.fsdp_size:
            errors.append(f"{role}.fsdp.fsdp_size={fsdp.fsdp_size} must divide the world size {world_size}")
    return errors
