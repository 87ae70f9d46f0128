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


def softmean(x: torch.Tensor, beta: float, dim: int = -1) -> torch.Tensor:
    """``SoftMean_β(x) = (logsumexp(β x) - log n) / β`` along ``dim`` (``n`` its size): the arithmetic
    mean at ``β = 0``, the maximum as ``β → ∞``, the minimum as ``β → -∞`` (verl's SPPO recipe)."""
    if beta == 0.0:
        return x.mean(dim=dim)
    return (torch.logsumexp(x * beta, dim=dim) - math.log(x.shape[dim])) / beta


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
