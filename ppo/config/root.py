"""The root of a PPO run's config, ``PPOConfig``, and the rules that span its sections.

``PPOConfig`` is the tree of sections (``ppo.config.tree``) with its checks. ``__post_init__`` resolves
the fallbacks (``critic.ppo_epochs`` from the actor's, ...) once, then runs the cross-section rules below,
grouped by topic, each a function of the whole config that raises a :class:`FieldError` naming every
key involved; ``warnings`` lists keys that are set but do nothing (``ppo.config.startup_warnings``);
``validate`` checks that the run's model and training files are set (``unset_inputs``: the defaults
name none), then what the world size decides (batch divisibility, shard groups: ``ppo.config.world_size``). Nothing here looks at the machine: what it can run (CUDA, a forced kernel
backend) is checked where the run starts (``ppo.build``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ppo.config.errors import ConfigError, FieldError, check_world_size
from ppo.config.shared import check_inputs_set, resolve_paths, unset_inputs
from ppo.config.startup_warnings import startup_warnings
from ppo.config.tree import SP_ATTENTION, PPOTree
from ppo.config.world_size import world_size_errors


@dataclass(kw_only=True)
class PPOConfig(PPOTree):
    """The whole PPO run."""

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
        _check_distillation(self)

    def warnings(self) -> list[str]:
        """One message per group of keys that are set but do nothing in this run, which still trains
        (the caller logs them once at start-up): the KL controller's keys without a KL penalty in the
        reward, the adaptive controller's keys with a fixed one, greedy rollouts compared within their
        group, recipe keys their recipe does not use, a critic warm-up without a critic, the reward
        function's keys without a function, no validation files (the run does not validate), a data file
        listed twice."""
        return startup_warnings(self)

    def unset_inputs(self) -> list[str]:
        """One message per input the run cannot start without that is not set (``model.path``,
        ``data.train_files``): the defaults name none, so a bare ``PPOConfig()`` (the defaults' view,
        ``--print-config``) is a config, and ``validate`` refuses to run it."""
        return unset_inputs(
            self.model,
            self.data,
            {
                "model.path": "the policy's save_pretrained folder or hub id",
                "data.train_files": "the Parquet files of training prompts",
            },
        )

    def validate(self, world_size: int, *, inputs: bool = True) -> None:
        """Check that the run's inputs are set (``unset_inputs``; ``inputs=False`` skips it for a config
        whose models and prompts come from elsewhere, a benchmark's random weights and synthetic batch),
        then every batch divisibility that ``world_size`` ranks need; say which numbers to change.

        Each rank takes ``train_batch_size / world_size`` prompts and samples ``n`` responses for each;
        each mini-batch holds ``ppo_mini_batch_size * n``
        sequences split evenly over ranks, and (without dynamic batch size) each rank's share splits into
        micro-batches of ``ppo_micro_batch_size_per_gpu``.
        """
        if inputs:
            check_inputs_set(self.unset_inputs())
        check_world_size(world_size)
        errors = world_size_errors(self, world_size)
        if errors:
            raise ConfigError(f"config does not fit world size {world_size}:\n  - " + "\n  - ".join(errors))


# ----------------------------------------------------------------------------------------------------
# Fallbacks: keys whose default is another key's value
# ----------------------------------------------------------------------------------------------------


def _expand_user_code_paths(cfg: PPOConfig) -> None:
    """``~`` in the file of ``reward.custom_function`` and ``rollout.multi_turn.env``
    (``~/rewards.py:fn``), as in the run's other paths."""
    fn = cfg.reward.custom_function
    if isinstance(fn, list):
        cfg.reward.custom_function = [os.path.expanduser(f) for f in fn]
    elif fn:
        cfg.reward.custom_function = os.path.expanduser(fn)
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
    # Without the task's loss (distillation alone) no advantage is computed: verl's distillation
    # scripts keep adv_estimator=grpo with rollout.n=1.
    if cfg.algorithm.adv_estimator in ("grpo", "rloo", "prime") and n < 2 and cfg.task_loss:
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
    if cfg.actor.policy_loss.loss_mode == "kl_cov" and cfg.one_update_per_rollout:
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
    if cfg.actor.use_prefix_grouper is True and cfg.model.attn_implementation not in SP_ATTENTION:
        raise FieldError(
            f"model.attn_implementation={cfg.model.attn_implementation} cannot run with "
            "actor.use_prefix_grouper=true: only the packed kernels attend each response to its shared "
            "prompt and to itself; use model.attn_implementation=auto",
            "model.attn_implementation",
            "actor.use_prefix_grouper",
        )


def _check_prime(cfg: PPOConfig) -> None:
    """PRIME makes its own token rewards (the implicit PRM's, and the outcome score's), on one
    sequence-parallel layout, from outcome labels in [0, 1] (a verdict, not a reward model's unbounded
    score), and with at least one of them weighed; the accuracy filter draws more prompts than a step
    trains on and is the only filter."""
    alg, d = cfg.algorithm, cfg.data
    if (alg.adv_estimator == "prime" or d.filter_accuracy) and cfg.reward.style == "model":
        # verl's PRIME recipe scores the outcome with its rule verifier (PrimeRewardManager.verify, 0/1);
        # a reward model's scalar head is unbounded, and clipping it to [0, 1] would train the PRM on
        # something else than correctness.
        if alg.adv_estimator == "prime":
            key, value, use = "algorithm.adv_estimator", "prime", "the PRM's outcome label, clipped to [0, 1]"
        else:
            key, value, use = "data.filter_accuracy", "true", "right when it is >= 1"
        raise FieldError(
            f"{key}={value} reads each response's score as a 0/1 verdict ({use}; verl's PRIME recipe "
            "scores with its rule verifier), but reward.style=model scores with a reward model, whose scores "
            "are unbounded: score with the rule or a reward.custom_function returning 0/1, or rank with the "
            "reward model (reward.style=ranking reward.ranking_by=model: scores in [0, 1])",
            key,
            "reward.style",
        )
    if alg.adv_estimator == "prime":
        if alg.reward_dpo_coef == 0 and alg.reward_gt_coef == 0:
            raise FieldError(
                "algorithm.reward_dpo_coef=0 and algorithm.reward_gt_coef=0 weigh PRIME's process and "
                "outcome returns by 0, so every advantage is 0 and the actor does not train: set either "
                "above 0 (verl's PRIME recipe: 5 and 5)",
                "algorithm.reward_dpo_coef",
                "algorithm.reward_gt_coef",
            )
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
        if d.gen_batch_size == d.train_batch_size:
            raise FieldError(
                f"data.filter_accuracy=true samples data.gen_batch_size={d.gen_batch_size} prompts a step and "
                f"keeps data.train_batch_size={d.train_batch_size} of them, so it keeps every group and "
                f"filters nothing: set data.gen_batch_size to a larger multiple of data.train_batch_size "
                f"(verl's PRIME recipe samples 4 times the batch, data.oversample_factor=4: "
                f"data.gen_batch_size={4 * d.train_batch_size})",
                "data.filter_accuracy",
                "data.gen_batch_size",
            )
        if d.accuracy_lower_bound > d.accuracy_upper_bound:
            raise FieldError(
                f"data.accuracy_lower_bound={d.accuracy_lower_bound} is above data.accuracy_upper_bound="
                f"{d.accuracy_upper_bound}: no group can pass",
                "data.accuracy_lower_bound",
                "data.accuracy_upper_bound",
            )


def _check_distillation(cfg: PPOConfig) -> None:
    """On-policy distillation trains the actor (the student) on the teachers' log-probs of its samples;
    without the task's loss the estimator computes nothing, so one with a critic would train it for
    nothing; SPPO's loss and PRIME's process rewards are not combined with it here."""
    d = cfg.distillation
    if not d.enabled:
        return
    loss = d.distillation_loss
    if not loss.use_task_rewards and cfg.algorithm.adv_estimator == "gae":
        raise FieldError(
            "distillation.distillation_loss.use_task_rewards=false trains on the distillation loss alone, so "
            "algorithm.adv_estimator=gae would train a critic whose values nothing uses (with "
            "use_policy_gradient the advantages are the distillation losses): set algorithm.adv_estimator=grpo "
            "as verl's distillation examples do",
            "distillation.distillation_loss.use_task_rewards",
            "algorithm.adv_estimator",
        )
    for key, value, refused in (
        ("actor.policy_loss.loss_mode", cfg.actor.policy_loss.loss_mode, "sppo"),
        ("algorithm.adv_estimator", cfg.algorithm.adv_estimator, "prime"),
    ):
        if value == refused:
            raise FieldError(
                f"distillation.enabled=true is not combined with {key}={refused} here",
                "distillation.enabled",
                key,
            )
