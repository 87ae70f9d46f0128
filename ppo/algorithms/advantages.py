"""Advantage estimators: GAE with a critic; REINFORCE++ (discounted returns, whitened); the group
baselines GRPO (and Dr. GRPO), RLOO, REINFORCE++-baseline and OPO; DAPO's group filter.

Each estimator is a ``compute_*`` function with the arguments it needs, and a row of one signature,
``fn(AdvantageInputs, AdvantageSettings) -> Estimate``, that ``ppo.algorithms.tables``'s
``ADVANTAGE_ESTIMATORS`` lists under its ``algorithm.adv_estimator`` name (verl's ``core_algos``).

Shapes: ``token_rewards``, ``values``, ``response_mask`` ``[B, T]``; per-sequence ``scores`` and
``group_ids`` ``[B]`` (the prompt each sequence answers).
"""

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import torch

from ppo.algorithms.stats import masked_whiten


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


@torch.no_grad()
def compute_reinforce_plus_plus_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    *,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu, "REINFORCE++", arXiv:2501.03262), verl's ``reinforce_plus_plus`` estimator.

    The discounted return of the token rewards (the score on the last token minus any in-reward KL
    penalty), backward over positions t = T-1 .. 0 from ``G = 0``::

        if m_t:  G = r_t + γ · G          # else G carries over unchanged
        R_t = G · m_t

    then ``A = masked_whiten(R)`` over every valid token of the batch (over every rank's tokens with
    ``all_reduce``, see :func:`masked_whiten`), 0 outside the mask. verl zeroes the running return at a
    masked position instead of carrying it; the two agree on right-padded responses and differ only
    where a mask has holes (tool output inside a response), which carry the return here as GAE does.
    No gradient flows through the result.

    Shapes: ``token_rewards [B, T]``, ``response_mask [B, T]``; returns ``(advantages [B, T], returns
    [B, T])`` in at least fp32.
    """
    dtype = torch.promote_types(token_rewards.dtype, torch.float32)
    rewards = token_rewards.to(dtype)
    mask = response_mask.bool()
    running = torch.zeros(rewards.shape[0], dtype=dtype, device=rewards.device)
    returns = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(mask[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    zero = torch.zeros((), dtype=dtype, device=rewards.device)
    returns = torch.where(mask, returns, zero)
    advantages = masked_whiten(returns, mask, all_reduce=all_reduce)
    return torch.where(mask, advantages, zero), returns


@torch.no_grad()
def compute_reinforce_plus_plus_baseline_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """REINFORCE++-baseline (arXiv:2501.03262), verl's ``reinforce_plus_plus_baseline`` estimator.

    ``A_i = s_i - mean_g`` (a group of one has baseline 0), broadcast over the response tokens, then
    whitened with :func:`masked_whiten` over every valid token of the batch (all ranks with
    ``all_reduce``), 0 outside the mask. Unlike GRPO there is no division by the group's std: the
    batch-wide whitening sets the scale. A group whose scores are all equal gets ``-μ/σ`` after the
    whitening (the batch mean shifted out), not 0.

    Shapes: ``scores [B]``, ``group_ids [B]``, ``response_mask [B, T]``; returns ``[B, T]`` in at least
    fp32.
    """
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    count, mean, _ = _group_stats(scores, group_ids)
    centered = scores - torch.where(count > 1, mean, torch.zeros_like(mean))
    mask = response_mask.bool()
    tokens = centered.unsqueeze(-1).expand(mask.shape)
    advantages = masked_whiten(tokens, mask, all_reduce=all_reduce)
    return torch.where(mask, advantages, torch.zeros((), dtype=scores.dtype, device=scores.device))


@torch.no_grad()
def compute_opo_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    response_mask: torch.Tensor,
) -> torch.Tensor:
    """OPO (Hao et al., "On-Policy RL with Optimal Reward Baseline", arXiv:2505.23585), verl's ``opo``.

    The baseline of a group is its scores weighted by response length, ``b_g = Σ_j |y_j| s_j / Σ_j |y_j|``
    with ``|y_j|`` the valid tokens of response j (the variance-optimal baseline when the gradient norm
    grows with length); ``A_i = s_i - b_g``, broadcast over the response tokens and multiplied by the
    mask. A group of one (or whose responses are all empty) has baseline 0. No whitening, no std.

    Example: scores ``[1, 0]`` of lengths ``[2, 6]``: ``b = (2·1 + 6·0) / 8 = 0.25``, so
    ``A = [0.75, -0.25]``.

    Shapes: ``scores [B]``, ``group_ids [B]``, ``response_mask [B, T]``; returns ``[B, T]`` in at least
    fp32.
    """
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    lengths = response_mask.sum(-1).to(scores.dtype)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    zeros = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device)
    count = zeros.index_add(0, inverse, torch.ones_like(scores))[inverse]
    total_len = zeros.index_add(0, inverse, lengths)[inverse]
    weighted = zeros.index_add(0, inverse, lengths * scores)[inverse]
    baseline = torch.where((count > 1) & (total_len > 0), weighted / total_len.clamp(min=1), 0.0)
    return (scores - baseline).unsqueeze(-1) * response_mask.to(scores.dtype)


def filter_groups(values: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """DAPO's dynamic-sampling filter (Yu et al., arXiv:2503.14476; verl's ``filter_groups``): which
    rows belong to a group whose ``values`` are not all equal (a group of one is kept, as verl keeps it).

    A group of equal values carries no signal for a group baseline (every advantage 0), so DAPO drops
    it and samples more prompts. Exact equality (verl: ``std > 0``). Shapes: ``values [B]``,
    ``group_ids [B]``; returns ``[B]`` bool.
    """
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    values = values.to(torch.float64)
    high = torch.full((num_groups,), -torch.inf, dtype=values.dtype, device=values.device)
    low = torch.full((num_groups,), torch.inf, dtype=values.dtype, device=values.device)
    high = high.scatter_reduce(0, inverse, values, "amax")
    low = low.scatter_reduce(0, inverse, values, "amin")
    count = torch.zeros(num_groups, dtype=torch.long, device=values.device).index_add(
        0, inverse, torch.ones_like(inverse)
    )
    return ((high > low) | (count == 1))[inverse]


Reduce = Callable[[torch.Tensor], torch.Tensor]
"""Sums (or takes the maximum of) a tensor over every rank's rows, each row once; the identity on one."""


@dataclasses.dataclass(kw_only=True)
class AdvantageInputs:
    """What an estimator reads from the step's batch. Shapes: ``[B, T]`` over response tokens, ``[B]``
    per response; a field an estimator does not use may be None."""

    token_rewards: torch.Tensor
    """Rewards per token (the outcome score on the last trained token, step rewards, KL penalty)."""
    response_mask: torch.Tensor
    """True on the tokens trained."""
    group_ids: torch.Tensor
    """``[B]`` the prompt each response answers."""
    values: torch.Tensor | None = None
    """The critic's values (GAE)."""
    prm_rewards: torch.Tensor | None = None
    """PRIME's implicit process rewards."""
    data_ranks: torch.Tensor | None = None
    """``[B]`` offline responses' ranks in their group (-1 for sampled rows), where ranks are the reward."""
    all_reduce: Reduce | None = None
    """Sum over ranks (batch statistics over every rank's tokens)."""
    all_reduce_max: Reduce | None = None
    """Maximum over ranks."""


@dataclasses.dataclass(kw_only=True)
class AdvantageSettings:
    """The estimators' options (verl's ``algorithm.*`` names; SPPO's ``actor.sppo_eta``)."""

    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    reward_dpo_coef: float = 5.0
    reward_gt_coef: float = 5.0
    sppo_target: str = "win_rate"
    sppo_eta: float = 1.0
    sppo_beta: float = 1.0


class Estimate(NamedTuple):
    """An estimator's output: ``advantages`` and ``returns`` ``[B, T]``, and for a loss that regresses each
    response onto one number (SPPO), its ``targets [B]`` (SPPO's advantages are each row's target on
    every position; every other estimator's are 0 outside the mask)."""

    advantages: torch.Tensor
    returns: torch.Tensor
    targets: torch.Tensor | None = None


def gae_estimator(x: AdvantageInputs, s: AdvantageSettings) -> Estimate:
    """``gae``: :func:`compute_gae` with the critic's values."""
    return Estimate(
        *compute_gae(x.token_rewards, x.values, x.response_mask, s.gamma, s.lam, all_reduce=x.all_reduce)
    )


def reinforce_plus_plus_estimator(x: AdvantageInputs, s: AdvantageSettings) -> Estimate:
    """``reinforce_plus_plus``: :func:`compute_reinforce_plus_plus_advantages`."""
    return Estimate(
        *compute_reinforce_plus_plus_advantages(
            x.token_rewards, x.response_mask, s.gamma, all_reduce=x.all_reduce
        )
    )


def _group_estimate(advantages: torch.Tensor) -> Estimate:
    """A group estimator's returns are its advantages (verl)."""
    return Estimate(advantages, advantages)


def grpo_estimator(x: AdvantageInputs, s: AdvantageSettings) -> Estimate:
    """``grpo``: :func:`compute_grpo_advantages` of each response's summed token rewards (verl's
    ``token_level_rewards.sum(-1)``: with KL in the reward, a response that drifted earns less)."""
    return _group_estimate(
        compute_grpo_advantages(
            x.token_rewards.sum(-1), x.group_ids, x.response_mask, norm_by_std=s.norm_adv_by_std_in_grpo
        )
    )


def rloo_estimator(x: AdvantageInputs, s: AdvantageSettings) -> Estimate:
    """``rloo``: :func:`compute_rloo_advantages` of the summed token rewards."""
    return _group_estimate(compute_rloo_advantages(x.token_rewards.sum(-1), x.group_ids, x.response_mask))


def reinforce_plus_plus_baseline_estimator(x: AdvantageInputs, s: AdvantageSettings) -> Estimate:
    """``reinforce_plus_plus_baseline``: :func:`compute_reinforce_plus_plus_baseline_advantages`."""
    return _group_estimate(
        compute_reinforce_plus_plus_baseline_advantages(
            x.token_rewards.sum(-1), x.group_ids, x.response_mask, all_reduce=x.all_reduce
        )
    )


def opo_estimator(x: AdvantageInputs, s: AdvantageSettings) -> Estimate:
    """``opo``: :func:`compute_opo_advantages` of the summed token rewards."""
    return _group_estimate(compute_opo_advantages(x.token_rewards.sum(-1), x.group_ids, x.response_mask))
