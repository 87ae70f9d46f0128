"""Off-policy correction: importance weights between the policy an update starts from and the policy
that produced the responses (verl's "rollout importance sampling"), and how far apart the two are.

The responses of offline data were sampled by another policy ``μ`` (the data's ``logprobs``); PPO's
gradient assumes they come from ``π_old``, the policy at the start of the update. The truncated
importance weight ``w = min(π_old / μ, C)`` reweights each token's policy-gradient term so the batch
estimates the gradient under ``π_old`` (Ionides 2008's truncated IS; verl's ``rollout_is`` with
``rollout_is_mode=truncate``): a response the policy has moved away from (``π_old ≪ μ``) stops pushing
it further, one it now prefers counts at most ``C`` times.

Shapes: ``[B, T]`` over response tokens, ``response_mask [B, T]``.
"""

import torch

from ppo.algorithms.stats import masked_mean
from ppo.choices import ROLLOUT_IS_LEVELS


def rollout_is_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    level: str,
    threshold: float,
) -> torch.Tensor:
    """Truncated importance weights ``min(exp(d), threshold)`` (detached), 0 outside the mask.

    ``d_t = log π_old(y_t) - log μ(y_t)`` per token for ``level="token"``; for ``"sequence"`` every token
    of a sequence gets ``d = Σ_t d_t`` (the sequence's probability ratio), for ``"geometric"``
    ``d = mean_t d_t``. ``d`` is clamped to [-20, 20] before ``exp``. Rows where ``rollout_logprobs`` is
    NaN (no known behaviour policy, e.g. sampled by the policy itself) get weight 1.

    Example: ``old = [-1, -2]``, ``μ = [-2, -1]``, token level, threshold 2: ``exp(1) = 2.72`` truncated to
    2, and ``exp(-1) = 0.368``.
    """
    if level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"unknown rollout_is_level {level!r}; known: {', '.join(ROLLOUT_IS_LEVELS)}")
    mask = response_mask.bool()
    known = ~torch.isnan(rollout_logprobs)
    d = torch.where(mask & known, old_logprobs.detach() - rollout_logprobs, torch.zeros_like(old_logprobs))
    if level == "sequence":
        d = d.sum(-1, keepdim=True).expand_as(d)
    elif level == "geometric":
        d = masked_mean(d, mask, dim=-1).unsqueeze(-1).expand_as(d)
    weights = d.clamp(-20.0, 20.0).exp().clamp(max=threshold)
    weights = torch.where(known, weights, torch.ones_like(weights))
    return torch.where(mask, weights, torch.zeros_like(weights)).detach()


def mismatch_metrics(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor, threshold: float
) -> dict[str, torch.Tensor]:
    """How far the policy is from the one that produced the responses, over the masked tokens whose
    ``rollout_logprobs`` are known (verl's names, without the ``mismatch/`` prefix):

    - ``mismatch_kl`` = mean of ``log μ - log π_old`` (k1 estimate of KL(μ ‖ π_old), can be negative);
    - ``mismatch_k3_kl`` = mean of ``r - log r - 1`` with ``r = π_old / μ`` (k3, non-negative);
    - ``rollout_is_mean`` = mean token ratio ``r`` (before truncation);
    - ``rollout_is_ratio_fraction_high`` = share of tokens with ``r > threshold``.

    Detached scalar tensors (0 when no token is known).
    """
    mask = response_mask.bool() & ~torch.isnan(rollout_logprobs)
    d = torch.where(mask, old_logprobs.detach() - rollout_logprobs, torch.zeros_like(old_logprobs))
    ratio = d.clamp(-20.0, 20.0).exp()
    return {
        "mismatch_kl": masked_mean(-d, mask),
        "mismatch_k3_kl": masked_mean(ratio - d - 1.0, mask),
        "rollout_is_mean": masked_mean(ratio, mask),
        "rollout_is_ratio_fraction_high": masked_mean((ratio > threshold).float(), mask),
    }
