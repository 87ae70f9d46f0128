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
"""verl 0.9.1's rejection criteria (``rollout_rs``): a divergence per token (``token_*``) or its sum, mean
or maximum over the sequence (``seq_*``); ``k1 = -log r``, ``k2 = (log r)^2 / 2``, ``k3 = r - 1 - log r``
with ``r = π_old / μ``."""


def _rs_bounds(option: str, spec: str) -> tuple[float | None, float]:
    """(lower, upper) bounds of one criterion: for ``*_k1`` ratio bounds ``lower_upper`` (one number is the
    upper, its reciprocal the lower), compared in log space; else a single positive upper bound."""
    if option.endswith("k1"):
        lower, _, upper = spec.partition("_") if "_" in spec else (str(1.0 / float(spec)), "", spec)
        low, high = float(lower), float(upper)
        if not 0 < low <= high:
            raise ValueError(f"{option}: ratio bounds {spec!r} must satisfy 0 < lower <= upper")
        return math.log(low), math.log(high)
    if "_" in spec or float(spec) <= 0:
        raise ValueError(f"{option}: threshold {spec!r} must be one positive upper bound")
    return None, float(spec)


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

    ``options``: comma-separated criteria of ``ROLLOUT_RS_OPTIONS`` (all must pass); ``thresholds``: one
    bound for all of them, or one per criterion, comma-separated (see ``_rs_bounds``). With
    ``d = log π_old - log μ`` clamped to [-20, 20]: ``k1 = -d``, ``k2 = d^2 / 2``, ``k3 = exp(d) - 1 - d``;
    a ``seq_sum``/``seq_mean``/``seq_max`` criterion compares the masked sum/mean/max of a sequence's
    values and keeps or drops all its tokens. Rows whose ``rollout_logprobs`` are NaN (sampled by the
    policy itself) are kept.

    Example: ``old = [-1, -1]``, ``μ = [-1, -3]`` (d = [0, 2]), ``token_k2`` with bound 1: k2 = [0, 2], the
    second token is dropped; ``seq_mean_k2`` with bound 1: the mean 1 passes (bounds are inclusive).
    """
    names = list(dict.fromkeys(o.strip() for o in options.split(",") if o.strip()))
    unknown = [o for o in names if o not in ROLLOUT_RS_OPTIONS]
    if not names or unknown:
        raise ValueError(f"rollout_rs options {options!r}: known are {', '.join(ROLLOUT_RS_OPTIONS)}")
    specs = [s.strip() for s in str(thresholds).split(",") if s.strip()]
    if len(specs) not in (1, len(names)):
        raise ValueError(f"rollout_rs_threshold {thresholds!r}: give one bound, or one per option of {names}")
    specs = specs * len(names) if len(specs) == 1 else specs
    mask = response_mask.bool()
    known = ~torch.isnan(rollout_logprobs)
    d = torch.where(mask & known, old_logprobs.detach() - rollout_logprobs, torch.zeros_like(old_logprobs))
    d = d.clamp(-20.0, 20.0)
    divergence = {"k1": -d, "k2": 0.5 * d**2, "k3": d.exp() - 1.0 - d}
    weight = mask.to(d.dtype)
    count = weight.sum(-1)
    keep = torch.ones_like(mask)
    for name, spec in zip(names, specs, strict=True):
        lower, upper = _rs_bounds(name, spec)
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
