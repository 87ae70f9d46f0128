"""Advantage estimators: GAE with a critic, and the group baselines GRPO and RLOO.

Shapes: ``token_rewards``, ``values``, ``response_mask`` ``[B, T]``; per-sequence ``scores`` and
``group_ids`` ``[B]`` (the prompt each sequence answers).
"""

from collections.abc import Callable

import torch

from ppo.algorithms.stats import masked_whiten

ADV_ESTIMATORS = ("gae", "grpo", "rloo")
"""Advantage estimators: :func:`compute_gae` (with a critic), :func:`compute_grpo_advantages`,
:func:`compute_rloo_advantages`."""


@torch.no_grad()
def compute_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    whiten: bool = True,
    *,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al., 2016) over the masked response tokens.

    Backward over positions t = T-1 .. 0, starting from ``next_value = last_gae = 0``::

        δ_t      = r_t + γ · next_value - V_t
        gae_t    = δ_t + γ λ · last_gae
        if m_t:  next_value, last_gae = V_t, gae_t        # else both carry over unchanged
        A_t      = last_gae

    so masked-out positions (e.g. tool output inside a response) are skipped: the token before them
    bootstraps from the value after them, as in verl's masked GAE. ``returns = A + V`` before whitening;
    then, if ``whiten``, ``A`` is normalized with :func:`masked_whiten` over all valid tokens of the batch
    (unbiased variance; over every rank's tokens with ``all_reduce``, see :func:`masked_whiten`). Both outputs are 0 at masked positions (a fully masked row is all 0). No
    gradient flows through the result.

    Shapes: ``token_rewards [B, T]``, ``values [B, T]``, ``response_mask [B, T]``; returns
    ``(advantages [B, T], returns [B, T])`` in at least fp32.
    """
    dtype = torch.promote_types(torch.promote_types(token_rewards.dtype, values.dtype), torch.float32)
    rewards = token_rewards.to(dtype)
    values = values.to(dtype)
    mask = response_mask.bool()
    batch_size, horizon = rewards.shape
    next_value = torch.zeros(batch_size, dtype=dtype, device=rewards.device)
    last_gae = torch.zeros_like(next_value)
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(horizon)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        # torch.where rather than verl's v·m + (1-m)·next: same numbers for 0/1 masks, and garbage
        # (NaN, inf) at masked positions cannot leak into the valid ones.
        next_value = torch.where(mask[:, t], values[:, t], next_value)
        last_gae = torch.where(mask[:, t], gae, last_gae)
        advantages[:, t] = last_gae
    returns = advantages + values
    if whiten:
        advantages = masked_whiten(advantages, mask, all_reduce=all_reduce)
    zero = torch.zeros((), dtype=dtype, device=rewards.device)
    return torch.where(mask, advantages, zero), torch.where(mask, returns, zero)


def _group_stats(scores: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-sample group size, group mean and unbiased group std (std 0 for a group of one); all ``[B]``."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    zeros = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device)
    count = zeros.index_add(0, inverse, torch.ones_like(scores))
    mean = zeros.index_add(0, inverse, scores) / count
    sq_dev = (scores - mean[inverse]).square()
    var = zeros.index_add(0, inverse, sq_dev) / (count - 1).clamp(min=1)
    return count[inverse], mean[inverse], var.sqrt()[inverse]


@torch.no_grad()
def compute_grpo_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    response_mask: torch.Tensor,
    norm_by_std: bool = True,
) -> torch.Tensor:
    """GRPO outcome advantages (Shao et al., "DeepSeekMath", 2024), as verl's ``grpo`` estimator.

    For sample i in group g (the samples sharing ``group_ids[i]``, usually the responses to one prompt):
    ``A_i = (s_i - mean_g) / (std_g + 1e-6)`` with the unbiased std (``torch.std``), or
    ``A_i = s_i - mean_g`` when ``norm_by_std`` is False (Dr. GRPO). The scalar is broadcast over the
    response tokens and multiplied by ``response_mask``.

    Edge cases, following verl: a group of one uses mean 0 and std 1, so its advantage is
    ``s_i / (1 + 1e-6)`` (``s_i`` without std normalization); a group whose scores are all equal gets
    advantage 0. No gradient flows through the result.

    Shapes: ``scores [B]``, ``group_ids [B]`` (any integers, in any order), ``response_mask [B, T]``;
    returns ``[B, T]`` in at least fp32.
    """
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    count, mean, std = _group_stats(scores, group_ids)
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    advantages = scores - mean
    if norm_by_std:
        advantages = advantages / (std + 1e-6)
    return advantages.unsqueeze(-1) * response_mask.to(scores.dtype)


@torch.no_grad()
def compute_rloo_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    response_mask: torch.Tensor,
) -> torch.Tensor:
    """RLOO outcome advantages (Ahmadian et al., "Back to Basics", 2024), as verl's ``rloo`` estimator.

    Each sample's baseline is the mean score of the other samples of its group: for a group of size
    n > 1, ``A_i = s_i - (Σ_g s - s_i) / (n - 1) = (s_i - mean_g) · n / (n - 1)``, computed as verl does
    (``s_i · n/(n-1) - mean_g · n/(n-1)``). The scalar is broadcast over the response tokens and
    multiplied by ``response_mask``.

    Edge cases, following verl: a group of one has no other sample and keeps its raw score as advantage
    (``A_i = s_i``, no baseline); a group whose scores are all equal gets advantage 0. No gradient flows
    through the result.

    Shapes: ``scores [B]``, ``group_ids [B]`` (any integers, in any order), ``response_mask [B, T]``;
    returns ``[B, T]`` in at least fp32.
    """
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    count, mean, _ = _group_stats(scores, group_ids)
    scale = count / (count - 1).clamp(min=1)
    advantages = torch.where(count > 1, scores * scale - mean * scale, scores)
    return advantages.unsqueeze(-1) * response_mask.to(scores.dtype)
