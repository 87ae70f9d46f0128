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

import math

import torch

from ppo.algorithms.stats import masked_mean
from ppo.choices import ROLLOUT_IS_LEVELS, rollout_rs_bounds


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


def mismatch_sums(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    threshold: float,
    *,
    level: str = "token",
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The ``mismatch_metrics`` of these rows as ``(sum, count)`` pairs (detached scalar tensors), so that
    micro-batches and ranks add up to the batch's mean ``Σ sum / Σ count``: the count is the masked
    tokens with known ``rollout_logprobs`` (for ``rollout_is_ratio_fraction_high`` at sequence or
    geometric level: the sequences with one), not every token of the rows."""
    if level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"unknown rollout_is_level {level!r}; known: {', '.join(ROLLOUT_IS_LEVELS)}")
    mask = response_mask.bool() & ~torch.isnan(rollout_logprobs)
    d = torch.where(mask, old_logprobs.detach() - rollout_logprobs, torch.zeros_like(old_logprobs))
    ratio = d.clamp(-20.0, 20.0).exp()
    weights = rollout_is_weights(old_logprobs, rollout_logprobs, mask, level=level, threshold=threshold)
    num_tokens = mask.sum().to(d.dtype)

    def token_sum(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.where(mask, x, torch.zeros_like(x)).sum(), num_tokens

    if level == "token":
        high = token_sum((ratio > threshold).to(d.dtype))
    else:  # one log-ratio per sequence, unclamped, compared in log space (as verl)
        rows = mask.any(-1)
        seq_d = d.sum(-1) if level == "sequence" else masked_mean(d, mask, dim=-1)
        high = ((rows & (seq_d > math.log(threshold))).sum().to(d.dtype), rows.sum().to(d.dtype))
    return {
        "mismatch_kl": token_sum(-d),
        "mismatch_k3_kl": token_sum(ratio - d - 1.0),
        "rollout_is_mean": token_sum(weights),
        "rollout_is_ratio_fraction_high": high,
    }


def mismatch_metrics(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    threshold: float,
    *,
    level: str = "token",
) -> dict[str, torch.Tensor]:
    """How far the policy is from the one that produced the responses, over the masked tokens whose
    ``rollout_logprobs`` are known (verl 0.9.1's ``rollout_corr/*`` names, without the ``mismatch/``
    prefix), with ``r = π_old / μ`` per token:

    - ``mismatch_kl`` = mean of ``log μ - log π_old`` (k1 estimate of KL(μ ‖ π_old), can be negative);
    - ``mismatch_k3_kl`` = mean of ``r - log r - 1`` (k3, non-negative);
    - ``rollout_is_mean`` = token mean of the truncated weights of ``level`` (``rollout_is_weights``: at
      sequence level every token carries its sequence's weight);
    - ``rollout_is_ratio_fraction_high`` = share of tokens with ``r > threshold`` (``level="token"``), or
      of sequences whose ratio of ``level`` (``exp Σ_t log r_t``, geometric: ``exp mean_t log r_t``) is.

    Detached scalar tensors (0 when no token is known). Example: one sequence, ``log r = [1, -0.5]``,
    threshold 2: token level ``rollout_is_mean = (2 + e^-0.5) / 2 = 1.303`` and fraction high 1/2;
    sequence level the weight ``e^0.5 = 1.649`` on both tokens, and fraction high 0 (1.649 <= 2).
    """
    sums = mismatch_sums(old_logprobs, rollout_logprobs, response_mask, threshold, level=level)
    return {k: total / count.clamp(min=1) for k, (total, count) in sums.items()}


def rollout_rs_mask(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    options: str,
    thresholds: str | float,
) -> torch.Tensor:
    """Rejection sampling of off-policy tokens (verl 0.9.1's ``rollout_rs``): ``response_mask`` with the
    tokens, or whole sequences, whose divergence from the sampler breaks a bound set to False.

    ``options``: comma-separated criteria of ``choices.ROLLOUT_RS_OPTIONS`` (all must pass); ``thresholds``: one
    bound for all of them, or one per criterion, comma-separated (see ``choices.rollout_rs_bounds``). With
    ``d = log π_old - log μ`` clamped to [-20, 20]: ``k1 = -d``, ``k2 = d^2 / 2``, ``k3 = exp(d) - 1 - d``;
    a ``seq_sum``/``seq_mean``/``seq_max`` criterion compares the masked sum/mean/max of a sequence's
    values and keeps or drops all its tokens. Rows whose ``rollout_logprobs`` are NaN (sampled by the
    policy itself) are kept.

    Example: ``old = [-1, -1]``, ``μ = [-1, -3]`` (d = [0, 2]), ``token_k2`` with bound 1: k2 = [0, 2], the
    second token is dropped; ``seq_mean_k2`` with bound 1: the mean 1 passes (bounds are inclusive).
    """
    bounds = rollout_rs_bounds(options, thresholds)
    mask = response_mask.bool()
    known = ~torch.isnan(rollout_logprobs)
    d = torch.where(mask & known, old_logprobs.detach() - rollout_logprobs, torch.zeros_like(old_logprobs))
    d = d.clamp(-20.0, 20.0)
    divergence = {"k1": -d, "k2": 0.5 * d**2, "k3": d.exp() - 1.0 - d}
    weight = mask.to(d.dtype)
    count = weight.sum(-1)
    keep = torch.ones_like(mask)
    for name, lower, upper in bounds:
        values = divergence[name[-2:]]
        if name.startswith("seq_sum"):
            values = (values * weight).sum(-1, keepdim=True)
        elif name.startswith("seq_mean"):
            values = ((values * weight).sum(-1) / count.clamp(min=1)).unsqueeze(-1)
        elif name.startswith("seq_max"):
            values = values.masked_fill(~mask, float("-inf")).amax(-1, keepdim=True)
            values = torch.where(count[:, None] > 0, values, torch.zeros_like(values))
        passed = values <= upper
        if lower is not None:
            passed &= values >= lower
        keep &= passed.expand_as(mask)
    keep |= ~(known & mask).any(-1, keepdim=True).expand_as(mask)  # no known sampler: nothing to reject
    return mask & keep
