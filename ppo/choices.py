"""The allowed values of the config keys that name a piece of the math: estimators, KL kinds, loss
modes. Dependency-free, so that the config schema (which must not import torch) and ``ppo.algorithms``
(which implements each name) read the same lists; ``ppo.algorithms`` re-exports them."""

ADV_ESTIMATORS = (
    "gae",
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "opo",
    "prime",
)
"""Advantage estimators (verl's names): :func:`compute_gae` (with a critic), :func:`compute_grpo_advantages`,
:func:`compute_rloo_advantages`, :func:`compute_reinforce_plus_plus_advantages`,
:func:`compute_reinforce_plus_plus_baseline_advantages`, :func:`compute_opo_advantages`; ``prime``:
:func:`compute_prime_advantages` with an implicit PRM (verl's PRIME recipe, whose trainer calls it ``rloo``)."""

GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "prime")
"""The estimators whose baseline is the other responses to the same prompt."""

KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
"""Names of the per-token KL estimators of :func:`kl_penalty` (each may carry a ``+`` suffix)."""

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
"""Names of the loss aggregation modes of :func:`agg_loss`."""

POLICY_LOSS_MODES = ("vanilla", "gspo", "clip_cov", "kl_cov", "sppo")
"""The policy losses of :func:`policy_loss` (verl's ``actor.policy_loss.loss_mode`` names), and SPPO's
regression of the log-ratio onto a preference target (:func:`sppo_loss`, verl's SPPO recipe)."""

PREFERENCE_LOSSES = ("dpo", "ipo", "ipo_sum", "simpo", "kto")
"""The losses of ``ppo.algorithms.preference``: ``loss.type`` of ``scripts/train_dpo.py``. ``ipo`` is
TRL's (log-ratios averaged over the response's tokens), ``ipo_sum`` the paper's sums over tokens."""

ROLLOUT_IS_LEVELS = ("token", "sequence", "geometric")
"""How token log-ratios combine into an importance weight (``algorithm.rollout_is_level``): per token,
their sum over the sequence (the product of the ratios), or their mean (the geometric mean)."""
