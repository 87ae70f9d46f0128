"""PRIME: process rewards from an implicit process reward model (Cui et al., 2025, arXiv:2502.01456).

The implicit PRM is a causal LM ``π_φ`` trained only on outcome labels; its per-token log-ratio to the
reference ``π_ref`` is a dense process reward. Three pure functions, as verl's PRIME recipe computes them:

    q = prm_logprobs - ref_logprobs                                      # the recipe's q (beta 1)
    loss = prime_ce_loss(q, acc, response_mask, beta)                    # trains the PRM
    token_rewards = prime_token_rewards(prm_logprobs, ref_logprobs, response_mask, beta)
    advantages, returns = compute_prime_advantages(token_rewards, scores, group_ids, response_mask,
                                                   reward_dpo_coef=5.0, reward_gt_coef=5.0)

Shapes ``[B, T]`` over response tokens, ``response_mask`` bool or 0/1.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ppo.algorithms.advantages import AdvantageInputs, AdvantageSettings, Estimate
from ppo.algorithms.stats import masked_mean, masked_whiten


def prime_token_rewards(
    prm_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, response_mask: torch.Tensor, beta: float
) -> torch.Tensor:
    """Implicit process rewards ``r_t = beta * (log π_φ(y_t) - log π_ref(y_t))`` on the response tokens,
    0 elsewhere. ``[B, T]`` in at least fp32.

    verl's recipe (``prime_granularity=token``) leaves the last response token's reward at 0; here every
    response token keeps its own (the outcome reward lands on the last one as well)."""
    diff = prm_logprobs.float() - ref_logprobs.float()
    return torch.where(response_mask.bool(), beta * diff, torch.zeros_like(diff))


def prime_ce_loss(
    token_rewards: torch.Tensor, acc: torch.Tensor, response_mask: torch.Tensor, beta: float
) -> torch.Tensor:
    """The PRM's cross-entropy loss (the recipe's ``compute_ce_dpo_loss_rm``): the sequence's implicit
    outcome reward ``beta * Σ_t r_t`` read as the logit that the response is correct,
    ``mean_i BCE(σ(beta * Σ_t r_it), acc_i)``.

    ``token_rewards [B, T]`` are the log-ratios *before* ``beta`` (``log π_φ - log π_ref``, the recipe's
    ``q``, which it passes here, scaling by ``beta`` inside); ``acc [B]`` the outcome labels in
    ``[0, 1]``. Computed from the logit (``binary_cross_entropy_with_logits``): the same value as the
    recipe's ``sigmoid`` then ``binary_cross_entropy`` wherever that one does not saturate. Scalar."""
    logits = beta * torch.where(response_mask.bool(), token_rewards, torch.zeros_like(token_rewards)).sum(-1)
    return F.binary_cross_entropy_with_logits(logits.float(), acc.to(torch.float32))


def _masked_rloo(rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """The recipe's ``masked_rloo``: each sequence's mean reward over its masked tokens is its value;
    every masked token becomes ``r_t * n/(n-1) - Σ_group mean / (n-1)``, so a token's baseline is the mean
    of the group's other sequences' values. 0 outside the mask. Groups of one keep their rewards."""
    mask = mask.bool()
    seq_values = masked_mean(rewards, mask, dim=-1)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    group_sum = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device)
    group_sum.index_add_(0, inverse, seq_values)
    count = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device)
    count.index_add_(0, inverse, torch.ones_like(seq_values))
    n, total = count[inverse][:, None], group_sum[inverse][:, None]
    out = torch.where(n > 1, rewards * n / (n - 1).clamp(min=1) - total / (n - 1).clamp(min=1), rewards)
    return torch.where(mask, out, torch.zeros_like(out))


def compute_prime_advantages(
    token_rewards: torch.Tensor,
    outcome_scores: torch.Tensor,
    group_ids: torch.Tensor,
    response_mask: torch.Tensor,
    reward_dpo_coef: float,
    reward_gt_coef: float,
    *,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PRIME's advantages (the recipe's ``compute_rloo_advantage_return``): RLOO on each reward source
    separately, then summed, returned as reverse cumulative sums, whitened.

        dense_t   = RLOO over the group of the implicit process rewards (per-sequence mean as the value)
        outcome_t = RLOO over the group of the outcome score, on the last response token only
        returns_t = Σ_{s >= t} (reward_dpo_coef * dense_s + reward_gt_coef * outcome_s)
        A         = masked_whiten(returns)   (over every rank's tokens with ``all_reduce``, a sum)

    ``token_rewards [B, T]`` (``prime_token_rewards``, after any normalization), ``outcome_scores [B]``,
    ``group_ids [B]`` (groups of n > 1 responses), ``response_mask [B, T]``. Returns ``(advantages,
    returns)``, ``[B, T]`` fp32, 0 outside the mask. No gradient flows through them."""
    with torch.no_grad():
        mask = response_mask.bool()
        token_rewards = token_rewards.float()
        dense = _masked_rloo(token_rewards, mask, group_ids)
        positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
        last = torch.where(mask, positions, -1).amax(-1)
        last_mask = (positions == last[:, None]) & mask
        outcome = torch.where(last_mask, outcome_scores.float()[:, None], torch.zeros_like(token_rewards))
        total = reward_dpo_coef * dense + reward_gt_coef * _masked_rloo(outcome, last_mask, group_ids)
        returns = torch.where(mask, total, torch.zeros_like(total)).flip(-1).cumsum(-1).flip(-1)
        advantages = masked_whiten(returns, mask, all_reduce=all_reduce)
        zero = torch.zeros_like(returns)
        return torch.where(mask, advantages, zero), torch.where(mask, returns, zero)


def prime_norm(token_rewards: torch.Tensor, max_abs_return: torch.Tensor | float) -> torch.Tensor:
    """The recipe's ``prime_norm=batch_norm``: the token rewards divided by the batch's largest absolute
    reverse cumulative sum (``max_abs_return``, from ``prime_max_abs_return`` over every rank) plus 1e-6."""
    return token_rewards / (max_abs_return + 1e-6)


def prime_max_abs_return(token_rewards: torch.Tensor) -> torch.Tensor:
    """``max |Σ_{s >= t} r_s|`` over the rows and positions of ``token_rewards [B, T]`` (a scalar)."""
    return (
        token_rewards.flip(-1).cumsum(-1).flip(-1).abs().amax() if token_rewards.numel() else torch.zeros(())
    )


def dpo_accuracy(seq_rewards: torch.Tensor, acc: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """The recipe's ``compute_dpo_accuracy`` (``reward_model/dpo_acc``): within each group, over the pairs
    whose outcome labels differ, the share ordered by the implicit reward as by the label (each pair
    weighted by its label difference); a group without such a pair counts 0.5. Mean over groups.
    ``seq_rewards [B]`` (``Σ_t r_t``), ``acc [B]``, ``group_ids [B]``; scalar."""
    values = []
    for g in torch.unique(group_ids):
        rows = group_ids == g
        s, a = seq_rewards[rows].float(), acc[rows].float()
        upper = torch.triu(torch.ones(len(s), len(s), dtype=torch.bool, device=s.device), diagonal=1)
        ds, da = (s[:, None] - s[None, :])[upper], (a[:, None] - a[None, :])[upper]
        weight = da.abs().sum()
        if weight == 0:
            values.append(torch.tensor(0.5, device=s.device))
        else:
            values.append((((ds > 0) == (da > 0)).float() * da.abs()).sum() / weight)
    return torch.stack(values).mean() if values else torch.tensor(0.5)


def dpo_abs_accuracy(seq_rewards: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """The recipe's ``compute_dpo_abs_accuracy`` (``reward_model/dpo_acc_abs``): the share of responses
    whose implicit reward has the sign of ``2 * acc - 1``. Scalar."""
    return (torch.sign(seq_rewards.float()) == torch.sign(acc.float() * 2 - 1)).float().mean()


def accuracy_filter(acc: torch.Tensor, group_size: int, lower: float, upper: float) -> torch.Tensor:
    """The recipe's accuracy filter (``data.filter_accuracy``): ``[G]`` True for each group of
    ``group_size`` consecutive rows whose mean ``acc`` lies within ``[lower, upper]``."""
    group_acc = acc.float().view(-1, group_size).mean(-1)
    return (group_acc >= lower) & (group_acc <= upper)


def kept_groups(passed: list[bool], num_kept: int) -> list[int]:
    """The recipe's downsampling after the accuracy filter: the indices of the first ``num_kept`` groups
    once the passing ones are moved to the front, each kind in its own order (``passed [G]``, from
    :func:`accuracy_filter`; the recipe's stable sort of the filter mask, descending)."""
    return sorted(range(len(passed)), key=lambda g: (not passed[g], g))[:num_kept]


def prime_estimator(x: AdvantageInputs, s: AdvantageSettings) -> Estimate:
    """``prime``: :func:`compute_prime_advantages`, RLOO over the implicit PRM's token rewards
    (``x.prm_rewards``) and over the outcome (the summed token rewards), whitened."""
    return Estimate(
        *compute_prime_advantages(
            x.prm_rewards,
            x.token_rewards.sum(-1),
            x.group_ids,
            x.response_mask,
            s.reward_dpo_coef,
            s.reward_gt_coef,
            all_reduce=x.all_reduce,
        )
    )
