"""PPO math: KL penalties and controllers, advantage estimators, losses and their aggregation.

Pure torch, no distributed calls, no model code: every function maps tensors to tensors and can be
tested on CPU by hand. Names and modes follow verl's ``core_algos`` so that a user switching from verl
gets the same numbers for the same inputs; where verl leaves a corner undefined (empty masks, groups of
one) the behaviour chosen here is written in the docstring.

Shapes are over response tokens: ``[B, T]`` with ``response_mask [B, T]`` (bool or 0/1, True = the
token is trained). Losses aggregate with :func:`agg_loss`, whose optional global counts (``num_tokens``,
``num_seqs``) make gradient accumulation and data parallelism exact: summing the per-micro-batch losses
of a mini-batch (over all micro-batches and ranks) gives the loss of the whole mini-batch at once.

Typical use in the PPO loop::

    kl = kl_penalty(old_logprobs, ref_logprobs, "kl")
    token_rewards = token_scores - kl_ctrl.value * kl
    advantages, returns = compute_gae(token_rewards, values, response_mask, gamma=1.0, lam=0.95)
    loss, metrics = policy_loss(logprobs, old_logprobs, advantages, response_mask, 0.2, 0.28, 3.0,
                                "token-mean", num_tokens=num_tokens_in_mini_batch)

The package's modules, each pure torch: ``stats`` (masked mean and whitening; pass@k and verl's
bootstrapped best@k), ``kl`` (KL estimators,
exact KL, controllers), ``advantages`` (GAE, GRPO, RLOO, REINFORCE++ and its baseline
variant, OPO; DAPO's group filter), ``losses`` (aggregation; the vanilla, GSPO, Clip-Cov and KL-Cov
policy losses and the covariance token selections; the value loss), ``tables`` (every policy loss and
advantage estimator under its config name: ``POLICY_LOSSES``, ``ADVANTAGE_ESTIMATORS``), ``correction`` (off-policy
importance weights), ``preference`` (the DPO family's per-pair losses: DPO/cDPO, IPO, SimPO, KTO), ``sppo`` (SPPO's win
rates, soft mean and squared log-ratio loss), ``prime`` (PRIME's implicit process rewards, its PRM
loss and advantages), ``distillation`` (on-policy distillation's per-token losses, reverse-KL estimators and
the teacher's top-k forward KL, their aggregation, policy-gradient advantages and metrics).
Users import every name from ``ppo.algorithms`` itself; the lists of allowed names (``ADV_ESTIMATORS``,
``KL_KINDS``, ...) live in the dependency-free ``ppo.choices``, which the config schema reads too.
"""

from ppo.algorithms.advantages import (
    AdvantageInputs,
    AdvantageSettings,
    Estimate,
    compute_gae,
    compute_grpo_advantages,
    compute_opo_advantages,
    compute_reinforce_plus_plus_advantages,
    compute_reinforce_plus_plus_baseline_advantages,
    compute_rloo_advantages,
    filter_groups,
)
from ppo.algorithms.correction import mismatch_metrics, rollout_is_weights
from ppo.algorithms.distillation import (
    distillation_loss,
    distillation_metrics,
    distillation_pg_advantages,
    distillation_token_losses,
    distillation_topk_metrics,
    forward_kl_topk,
    topk_overlap,
)
from ppo.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    entropy_from_logits,
    full_kl,
    kl_penalty,
)
from ppo.algorithms.losses import (
    PolicyLossInputs,
    PolicyLossSettings,
    agg_loss,
    clip_cov_selection,
    kl_cov_selection,
    token_covariance,
    value_loss,
)
from ppo.algorithms.preference import dpo_loss, ipo_loss, kto_loss, simpo_loss
from ppo.algorithms.prime import (
    accuracy_filter,
    compute_prime_advantages,
    dpo_abs_accuracy,
    dpo_accuracy,
    kept_groups,
    prime_ce_loss,
    prime_max_abs_return,
    prime_norm,
    prime_token_rewards,
)
from ppo.algorithms.sppo import global_softmean, softmean, sppo_loss, win_rates
from ppo.algorithms.stats import bootstrap_best, masked_mean, masked_whiten, pass_at_k
from ppo.algorithms.tables import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, policy_loss
from ppo.choices import (
    ADV_ESTIMATORS,
    DISTILLATION_LOSS_MODES,
    GROUP_ESTIMATORS,
    KL_KINDS,
    LOSS_AGG_MODES,
    POLICY_LOSS_MODES,
    PREFERENCE_LOSSES,
    ROLLOUT_IS_LEVELS,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ADV_ESTIMATORS",
    "DISTILLATION_LOSS_MODES",
    "GROUP_ESTIMATORS",
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "POLICY_LOSS_MODES",
    "PREFERENCE_LOSSES",
    "ROLLOUT_IS_LEVELS",
    "AdaptiveKLController",
    "AdvantageInputs",
    "AdvantageSettings",
    "Estimate",
    "FixedKLController",
    "PolicyLossInputs",
    "PolicyLossSettings",
    "accuracy_filter",
    "agg_loss",
    "bootstrap_best",
    "clip_cov_selection",
    "compute_gae",
    "compute_grpo_advantages",
    "compute_opo_advantages",
    "compute_prime_advantages",
    "compute_reinforce_plus_plus_advantages",
    "compute_reinforce_plus_plus_baseline_advantages",
    "compute_rloo_advantages",
    "distillation_loss",
    "distillation_metrics",
    "distillation_pg_advantages",
    "distillation_token_losses",
    "distillation_topk_metrics",
    "dpo_abs_accuracy",
    "dpo_accuracy",
    "dpo_loss",
    "entropy_from_logits",
    "filter_groups",
    "forward_kl_topk",
    "full_kl",
    "global_softmean",
    "ipo_loss",
    "kept_groups",
    "kl_cov_selection",
    "kl_penalty",
    "kto_loss",
    "masked_mean",
    "masked_whiten",
    "mismatch_metrics",
    "pass_at_k",
    "policy_loss",
    "prime_ce_loss",
    "prime_max_abs_return",
    "prime_norm",
    "prime_token_rewards",
    "rollout_is_weights",
    "simpo_loss",
    "softmean",
    "sppo_loss",
    "token_covariance",
    "topk_overlap",
    "value_loss",
    "win_rates",
]
