"""PPO's losses and their aggregation: the clipped policy loss (with dual clip), the clipped value
loss, and ``agg_loss``, whose optional global counts make gradient accumulation and data parallelism
exact.

Shapes: ``[B, T]`` over response tokens with ``response_mask [B, T]``.
"""

import torch

from ppo.algorithms.stats import masked_mean

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
"""Names of the loss aggregation modes of :func:`agg_loss`."""


def _denominator(count: int | float | torch.Tensor | None, default: torch.Tensor) -> torch.Tensor | float:
    """``count`` (or ``default`` when None), floored at 1 so that an empty batch gives 0, not NaN."""
    if count is None:
        return default.clamp(min=1)
    if isinstance(count, torch.Tensor):
        return count.clamp(min=1)
    return max(float(count), 1.0)


def agg_loss(
    loss_mat: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str,
    num_tokens: int | float | torch.Tensor | None = None,
    num_seqs: int | float | torch.Tensor | None = None,
    *,
    loss_scale_factor: int | float | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss into a scalar, as verl's ``agg_loss``.

    With ``m`` the mask and ``S_b = Σ_t loss[b, t] · m[b, t]`` the token sum of row b:

    - ``"token-mean"``: ``Σ_b S_b / num_tokens``; ``num_tokens`` defaults to ``Σ m``;
    - ``"seq-mean-token-sum"``: ``Σ_b S_b / num_seqs``;
    - ``"seq-mean-token-mean"``: ``Σ_b (S_b / max(Σ_t m[b, t], 1)) / num_seqs``;
    - ``"seq-mean-token-sum-norm"`` (Dr. GRPO's constant normalizer):
      ``Σ_b (S_b / loss_scale_factor) / num_seqs``, with ``loss_scale_factor`` defaulting to ``T``
      (``loss_mat.shape[-1]``, the padded response length), as in current verl.

    ``num_seqs`` defaults to the number of rows with at least one valid token, so a fully masked row
    contributes 0 and is not counted. Denominators below 1 are taken as 1: an all-masked batch gives 0.
    Masked-out entries are selected away, so a NaN there cannot leak into the loss or its gradient.

    Exact accumulation: pass ``num_tokens`` / ``num_seqs`` counted over the whole mini-batch (all
    micro-batches on all ranks); then the sum of this function over the micro-batches equals its value
    on the mini-batch at once, for every mode. For ``"seq-mean-token-sum-norm"`` with micro-batches
    padded to different lengths, also pass a fixed ``loss_scale_factor`` (e.g. the max response length)
    so that every micro-batch divides by the same T.

    Shapes: ``loss_mat [B, T]``, ``response_mask [B, T]``; returns a scalar tensor.
    """
    mask = response_mask.bool()
    zero = torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device)
    token_sums = torch.where(mask, loss_mat, zero).sum(dim=-1)  # S_b, [B]
    if mode == "token-mean":
        return token_sums.sum() / _denominator(num_tokens, mask.sum())
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; valid modes: {', '.join(LOSS_AGG_MODES)}")
    tokens_per_seq = mask.sum(dim=-1)
    seqs = _denominator(num_seqs, (tokens_per_seq > 0).sum())
    if mode == "seq-mean-token-sum":
        return token_sums.sum() / seqs
    if mode == "seq-mean-token-mean":
        return (token_sums / tokens_per_seq.clamp(min=1)).sum() / seqs
    scale = float(loss_mat.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return (token_sums / scale).sum() / seqs


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
    loss_agg_mode: str,
    *,
    is_weights: torch.Tensor | None = None,
    **counts: int | float | torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate loss with asymmetric clipping and dual clip (verl's ``vanilla`` loss).

    ``ρ = exp(clamp(logprobs - old_logprobs, -20, 20))`` and, per token::

        l1 = -A · ρ
        l2 = -A · clamp(ρ, 1 - clip_ratio_low, 1 + clip_ratio_high)     # Schulman et al., 2017
        l  = max(l1, l2)
        l  = min(l, -A · clip_ratio_c)   where A < 0                    # dual clip, Ye et al., 2020

    then ``loss = agg_loss(w · l, response_mask, loss_agg_mode, **counts)``; ``counts`` are agg_loss's
    ``num_tokens``, ``num_seqs`` and ``loss_scale_factor``; ``w`` the detached off-policy weights
    ``is_weights [B, T]`` (``correction.rollout_is_weights``), 1 when None.

    Metrics (detached scalar tensors, masked means over this call's tokens):
    ``pg_clipfrac`` = fraction with ``l2 > l1``; ``pg_clipfrac_lower`` = fraction with ``A < 0`` and
    ``max(l1, l2) > -A · clip_ratio_c``; ``ppo_kl`` = mean of ``-(clamped log-ratio)``, i.e. the k1
    estimate of KL(π_old ‖ π).

    Shapes: ``logprobs``, ``old_logprobs``, ``advantages``, ``response_mask`` all ``[B, T]``; returns
    ``(scalar loss, {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"})``. Raises ValueError unless
    ``clip_ratio_c > 1``.
    """
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip bound) must be > 1, got {clip_ratio_c}")
    log_ratio = torch.clamp(logprobs - old_logprobs, min=-20.0, max=20.0)
    ratio = log_ratio.exp()
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clip_pg_losses = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(clip_pg_losses, pg_losses3), clip_pg_losses)
    if is_weights is not None:
        pg_losses = pg_losses * is_weights
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **counts)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((pg_losses2 > pg_losses1).float(), response_mask),
            "pg_clipfrac_lower": masked_mean(
                ((clip_pg_losses > pg_losses3) & negative).float(), response_mask
            ),
            "ppo_kl": masked_mean(-log_ratio, response_mask),
        }
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str,
    **counts: int | float | torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss (verl's ``compute_value_loss``).

    ``V_clip = clamp(values, old_values - c, old_values + c)`` (= ``old + clamp(values - old, ±c)``),
    ``l = ½ · max((values - returns)², (V_clip - returns)²)`` per token, then
    ``loss = agg_loss(l, response_mask, loss_agg_mode, **counts)`` (``num_tokens``, ``num_seqs``,
    ``loss_scale_factor``).

    Metric (detached scalar tensor): ``vf_clipfrac`` = masked mean of
    ``(V_clip - returns)² > (values - returns)²``.

    Shapes: ``values``, ``old_values``, ``returns``, ``response_mask`` all ``[B, T]``; returns
    ``(scalar loss, {"vf_clipfrac"})``.
    """
    values_clipped = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    vf_losses1 = (values - returns).square()
    vf_losses2 = (values_clipped - returns).square()
    loss = 0.5 * agg_loss(torch.maximum(vf_losses1, vf_losses2), response_mask, loss_agg_mode, **counts)
    with torch.no_grad():
        metrics = {"vf_clipfrac": masked_mean((vf_losses2 > vf_losses1).float(), response_mask)}
    return loss, metrics
