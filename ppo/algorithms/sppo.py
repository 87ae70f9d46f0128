"""SPPO, self-play preference optimization (Wu et al. 2024, arXiv:2405.00675): the policy regresses
each response's log-ratio to the previous iterate onto a target set by how much the response is
preferred, instead of following a clipped policy gradient.

    p = win_rates(scores, group_ids)                          # [B], ties count 1/2
    targets = eta * (p - 0.5)                                 # the paper's form
    targets = eta * (r - softmean(r, beta))                   # verl recipe's form, r the rewards [B]
    loss, metrics = sppo_loss(logprobs, old_logprobs, targets, response_mask)

The per-response loss is ``(Σ_t log π_θ(y_t) - Σ_t log π_old(y_t) - target)²``: a response that wins
more than half of its comparisons is pushed up until its log-ratio equals its target, one that loses is
pushed down. Shapes: ``[B, T]`` over response tokens, ``targets [B]``.
"""

import math

import torch

from ppo.algorithms.advantages import AdvantageInputs, AdvantageSettings, Estimate, Reduce
from ppo.algorithms.losses import PolicyLossInputs, PolicyLossSettings


def softmean(x: torch.Tensor, beta: float, dim: int = -1) -> torch.Tensor:
    """``SoftMean_β(x) = (logsumexp(β x) - log n) / β`` along ``dim`` (``n`` its size): the arithmetic
    mean at ``β = 0``, the maximum as ``β → ∞``, the minimum as ``β → -∞`` (verl's SPPO recipe). In
    ``x``'s dtype.

    Computed in float64 as ``m + log1p(mean(expm1(β (x - m)))) / β``, with ``m`` the element that
    maximizes ``β x``: every ``expm1`` lies in ``(-1, 0]``, so nothing overflows, and at a small ``β``
    the mean keeps its ``β (x - m)`` terms to full precision, where the recipe's ``logsumexp - log n``
    cancels down to the rounding of ``log n`` and then divides that by ``β`` (in float32 its soft mean
    of ``[0, 1, 2, 5]`` at ``β = 1e-8`` is -11.9, not 2)."""
    if beta == 0.0:
        return x.mean(dim=dim)
    x64 = x.double()
    m = x64.amax(dim=dim, keepdim=True) if beta > 0 else x64.amin(dim=dim, keepdim=True)
    spread = torch.log1p(torch.expm1(beta * (x64 - m)).mean(dim=dim)) / beta
    return (m.squeeze(dim) + spread).to(x.dtype)


def win_rates(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """``[B]`` the share of the other responses of its group (same ``group_ids``) that each response
    beats by score, a tie counting 1/2: the estimate of ``P(y ≻ π | x)`` from the group's samples.

    A response alone in its group has nothing to beat or lose to: 1/2 (its SPPO target is then 0).
    ``scores [B]`` (higher = better; for ranks pass ``-ranks``), ``group_ids [B]``.
    """
    same = group_ids[:, None] == group_ids[None, :]
    others = same & ~torch.eye(len(scores), dtype=torch.bool, device=scores.device)
    s = scores.float()
    beats = (s[:, None] > s[None, :]).float() + 0.5 * (s[:, None] == s[None, :]).float()
    num_others = others.sum(-1)
    wins = (beats * others).sum(-1)
    return torch.where(num_others > 0, wins / num_others.clamp(min=1), torch.full_like(wins, 0.5))


def sppo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    targets: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    num_tokens: int | float | torch.Tensor | None = None,
    num_seqs: int | float | torch.Tensor | None = None,
    *,
    loss_scale_factor: int | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SPPO's squared regression of each response's log-ratio onto its target, averaged over responses.

    ``log_ratio_b = Σ_t log π_θ[b, t] m[b, t] - Σ_t log π_old[b, t] m[b, t]``,
    ``loss = Σ_b (log_ratio_b - targets_b)² / num_seqs`` over the responses with a valid token.

    The loss is one number per response, so the only aggregation is a mean over responses: that is
    what verl's recipe does under ``token-mean`` (a masked mean over non-empty responses), the only
    mode it defines; any other ``loss_agg_mode`` is refused. ``num_seqs`` counted over the whole
    mini-batch (all micro-batches and ranks) makes accumulation exact; it defaults to this batch's
    non-empty responses. ``num_tokens`` and ``loss_scale_factor`` are accepted for a uniform call and
    not used. Metrics (shares of the mini-batch mean, like the loss; verl recipe's names):
    ``log_ratio_mean``, ``preference_mean`` (the targets' mean). Shapes: ``[B, T]``, ``targets [B]``; returns a scalar loss.
    """
    del num_tokens, loss_scale_factor
    if loss_agg_mode != "token-mean":
        raise ValueError(
            f"sppo_loss averages one loss per response (verl's recipe defines only loss_agg_mode=token-mean), "
            f"got {loss_agg_mode!r}"
        )
    mask = response_mask.bool()
    # Masked entries are selected away (not multiplied), so a NaN there cannot reach the loss.
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_ratios = torch.where(mask, logprobs, zero).sum(-1) - torch.where(mask, old_logprobs, zero).sum(-1)
    present = mask.any(-1)
    if num_seqs is None:
        denominator = present.sum().clamp(min=1)
    elif isinstance(num_seqs, torch.Tensor):
        denominator = num_seqs.clamp(min=1)
    else:
        denominator = max(float(num_seqs), 1.0)
    targets = targets.to(logprobs.dtype)
    losses = torch.where(present, (log_ratios - targets) ** 2, zero)
    loss = losses.sum() / denominator
    metrics = {
        "log_ratio_mean": torch.where(present, log_ratios.detach(), zero).sum() / denominator,
        "preference_mean": torch.where(present, targets, zero).sum() / denominator,
    }
    return loss, metrics


def sppo_policy_loss(
    x: PolicyLossInputs, s: PolicyLossSettings, **counts: int | float | torch.Tensor | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``sppo`` in the policy-loss table: :func:`sppo_loss` on ``x.targets`` (importance weights and the
    clip settings do not apply: the loss is a regression per response)."""
    return sppo_loss(x.logprobs, x.old_logprobs, x.targets, x.response_mask, s.loss_agg_mode, **counts)


def global_softmean(
    x: torch.Tensor, beta: float, all_reduce: Reduce | None, all_reduce_max: Reduce | None
) -> float:
    """:func:`softmean` of ``x [B]`` over every rank's rows (``all_reduce`` sums over ranks,
    ``all_reduce_max`` takes the maximum; None on one rank): ``m + log1p(Σ expm1(β (x - m)) / n) / β``
    with ``m`` the global element that maximizes ``β x``, in float64; the mean when ``β`` is 0. Every
    ``expm1`` lies in ``(-1, 0]`` (nothing overflows at a large ``β``), and at a small ``β`` nothing
    cancels (see :func:`softmean`)."""
    total_of = all_reduce or (lambda t: t)
    max_of = all_reduce_max or (lambda t: t)
    x = x.double()

    def sums(total: float) -> tuple[float, float]:
        reduced = total_of(torch.tensor([total, float(x.numel())], dtype=torch.float64, device=x.device))
        return float(reduced[0]), float(reduced[1])

    if beta == 0.0:
        total, count = sums(float(x.sum()))
        return total / count
    sign = 1.0 if beta > 0 else -1.0
    m = sign * float(max_of(torch.tensor([float((sign * x).max())], dtype=torch.float64, device=x.device))[0])
    total, count = sums(float(torch.expm1(beta * (x - m)).sum()))
    return m + math.log1p(total / count) / beta


def sppo_estimator(x: AdvantageInputs, s: AdvantageSettings) -> Estimate:
    """SPPO's targets (``actor.policy_loss.loss_mode=sppo`` uses them in place of an estimator), each
    ``sppo_eta`` times:

    - ``win_rate``: ``P - 1/2``, with ``P`` the share of the group's other responses it beats
      (:func:`win_rates`, ties 1/2) by summed token rewards, or, for offline rows with ``data_ranks``
      (``>= 0``; ranks are the reward), by the data's ranks themselves (ties in rank are ties);
    - ``softmean``: ``r - softmean_beta(r)`` with ``r`` the summed token rewards and the soft mean over
      the whole batch on all ranks (:func:`global_softmean`; verl's recipe takes it over the driver's
      whole batch).

    The advantages (and returns) hold each response's target on each of its trained tokens: what the
    batch's ``critic/advantages/*`` metrics describe."""
    seq_rewards = x.token_rewards.sum(-1)
    if s.sppo_target == "softmean":
        targets = s.sppo_eta * (
            seq_rewards - global_softmean(seq_rewards, s.sppo_beta, x.all_reduce, x.all_reduce_max)
        )
    else:
        keys = seq_rewards
        if x.data_ranks is not None:
            offline_rows = x.data_ranks >= 0  # groups are all offline or all sampled
            keys = torch.where(offline_rows, -x.data_ranks.to(seq_rewards.dtype), seq_rewards)
        targets = s.sppo_eta * (win_rates(keys, x.group_ids) - 0.5)
    advantages = targets[:, None].expand_as(x.token_rewards).clone()
    return Estimate(advantages, advantages, targets)
