"""The allowed values of the config keys that name a piece of the math: estimators, KL kinds, loss
modes. Dependency-free, so that the config schema (which must not import torch) and ``ppo.algorithms``
(which implements each name) read the same lists; ``ppo.algorithms`` re-exports them."""

import math

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

DISTILLATION_LOSS_MODES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "forward_kl_topk")
"""On-policy distillation's per-token losses (verl 0.9.1's ``distillation.distillation_loss.loss_mode``):
the reverse-KL estimators of the sampled token (:func:`distillation_token_losses`, the ``KL_KINDS``
without ``+``) and the forward KL over the teacher's top-k tokens (:func:`forward_kl_topk`)."""

LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
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

ROLLOUT_RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
"""verl 0.9.1's rejection criteria (``algorithm.rollout_rs``): a divergence per token (``token_*``) or its
sum, mean or maximum over the sequence (``seq_*``); ``k1 = -log r``, ``k2 = (log r)^2 / 2``,
``k3 = r - 1 - log r`` with ``r = π_old / μ``."""


def rollout_rs_bounds(options: str, thresholds: str | float) -> list[tuple[str, float | None, float]]:
    """``(criterion, lower, upper)`` of each distinct criterion of ``options`` (comma-separated
    ``ROLLOUT_RS_OPTIONS``), with ``thresholds`` one bound for all or one per criterion, comma-separated.
    A ``*_k1`` bound is ratio bounds ``lower_upper`` (one number: the upper, its reciprocal the lower),
    returned as logs; other criteria take one positive upper bound (lower None). ValueError otherwise."""
    names = list(dict.fromkeys(o.strip() for o in options.split(",") if o.strip()))
    unknown = [o for o in names if o not in ROLLOUT_RS_OPTIONS]
    if not names or unknown:
        raise ValueError(f"rollout_rs options {options!r}: known are {', '.join(ROLLOUT_RS_OPTIONS)}")
    specs = [s.strip() for s in str(thresholds).split(",") if s.strip()]
    if len(specs) not in (1, len(names)):
        raise ValueError(f"rollout_rs_threshold {thresholds!r}: give one bound, or one per option of {names}")
    specs = specs * len(names) if len(specs) == 1 else specs
    out: list[tuple[str, float | None, float]] = []
    for name, spec in zip(names, specs, strict=True):
        try:
            if name.endswith("k1"):
                lower, _, upper = spec.partition("_") if "_" in spec else (str(1.0 / float(spec)), "", spec)
                low, high = float(lower), float(upper)
                if not 0 < low <= high:
                    raise ValueError
                out.append((name, math.log(low), math.log(high)))
            else:
                if "_" in spec or not float(spec) > 0:
                    raise ValueError
                out.append((name, None, float(spec)))
        except (ValueError, ZeroDivisionError):
            want = (
                "ratio bounds lower_upper with 0 < lower <= upper"
                if name.endswith("k1")
                else "one upper bound > 0"
            )
            raise ValueError(f"rollout_rs_threshold {spec!r} of {name}: {want}") from None
    return out
