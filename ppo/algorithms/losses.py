"""PPO's losses and their aggregation: the clipped policy losses (vanilla with dual clip, GSPO,
Clip-Cov, KL-Cov, and the token selections of the last two), the clipped value loss, and ``agg_loss``,
whose optional global counts make gradient accumulation and data parallelism exact.

Every policy loss has one signature, ``fn(PolicyLossInputs, PolicyLossSettings, **counts) -> (loss,
metrics)`` (verl's ``core_algos`` policy-loss functions), and one row in ``ppo.algorithms.tables``'s
``POLICY_LOSSES`` under its ``actor.policy_loss.loss_mode`` name. Its metrics are shares of the
mini-batch's mean: with ``num_tokens`` (the mini-batch's valid tokens, all ranks) each per-token mean is
multiplied by this call's share of them, so that summing over the micro-batches gives the mean.

Shapes: ``[B, T]`` over response tokens with ``response_mask [B, T]``.
"""

import dataclasses
from collections.abc import Callable

import torch

from ppo.algorithms.stats import masked_mean
from ppo.choices import LOSS_AGG_MODES


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
    num_replicas: int = 1,
) -> torch.Tensor:
    """Aggregate a per-token loss into a scalar, as verl's ``agg_loss``.

    With ``m`` the mask and ``S_b = Σ_t loss[b, t] · m[b, t]`` the token sum of row b:

    - ``"token-mean"``: ``Σ_b S_b / num_tokens``; ``num_tokens`` defaults to ``Σ m``;
    - ``"token-sum"``: ``Σ_b S_b / num_replicas``, no count used: summed over the micro-batches and
      ranks, the mini-batch's sum over every valid token (verl 0.9.1's ``masked_sum · dp_size``,
      whose gradient averaged over the data-parallel ranks is that sum; here ranks sum gradients).
      ``num_replicas``: the ranks that compute this loss on the same rows (a sequence-parallel
      group), each taking its share, as the global counts of the other modes (which count such rows
      that many times) make them do;
    - ``"seq-mean-token-sum"``: ``Σ_b S_b / num_seqs``;
    - ``"seq-mean-token-mean"``: ``Σ_b (S_b / max(Σ_t m[b, t], 1)) / num_seqs``;
    - ``"seq-mean-token-sum-norm"`` (Dr. GRPO's constant normalizer, Liu et al. arXiv:2503.20783):
      ``Σ_b S_b / num_seqs / loss_scale_factor``, with ``loss_scale_factor`` defaulting to ``T``
      (``loss_mat.shape[-1]``, the padded response length): verl 0.9.1's ``agg_loss``, the
      sequence mean of ``"seq-mean-token-sum"`` divided by a constant, so the loss's scale does not
      grow with the batch. ``num_tokens`` is not used.

    ``num_seqs`` defaults to the number of rows with at least one valid token, so a fully masked row
    contributes 0 and is not counted. Denominators below 1 are taken as 1: an all-masked batch gives 0.
    Masked-out entries are selected away, so a NaN there cannot leak into the loss or its gradient.

    Exact accumulation: pass ``num_tokens`` / ``num_seqs`` counted over the whole mini-batch (all
    micro-batches on all ranks); then the sum of this function over the micro-batches equals its value
    on the mini-batch at once, for every mode. With micro-batches padded to different lengths, pass
    ``"seq-mean-token-sum-norm"`` a fixed ``loss_scale_factor`` (e.g. the max response length) so that
    every micro-batch divides by the same T.

    Shapes: ``loss_mat [B, T]``, ``response_mask [B, T]``; returns a scalar tensor.
    """
    mask = response_mask.bool()
    zero = torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device)
    token_sums = torch.where(mask, loss_mat, zero).sum(dim=-1)  # S_b, [B]
    if mode == "token-mean":
        return token_sums.sum() / _denominator(num_tokens, mask.sum())
    if mode == "token-sum":
        return token_sums.sum() / num_replicas
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; valid modes: {', '.join(LOSS_AGG_MODES)}")
    tokens_per_seq = mask.sum(dim=-1)
    seqs = _denominator(num_seqs, (tokens_per_seq > 0).sum())
    if mode == "seq-mean-token-sum":
        return token_sums.sum() / seqs
    if mode == "seq-mean-token-sum-norm":
        scale = float(loss_mat.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        return token_sums.sum() / seqs / scale
    return (token_sums / tokens_per_seq.clamp(min=1)).sum() / seqs  # seq-mean-token-mean


@dataclasses.dataclass(kw_only=True)
class PolicyLossInputs:
    """What a policy loss reads from one micro-batch. Shapes: ``[B, T]`` over response tokens, except
    ``targets [B]``; each field a loss does not use may be None."""

    logprobs: torch.Tensor
    """The policy's log-probs (with gradient)."""
    old_logprobs: torch.Tensor
    """The log-probs of the policy that sampled (or the forward's own, detached: the on-policy shortcut)."""
    response_mask: torch.Tensor
    """True on the tokens trained."""
    advantages: torch.Tensor | None = None
    """Per-token advantages (every loss but SPPO's)."""
    targets: torch.Tensor | None = None
    """``[B]`` SPPO's regression target of each response."""
    is_weights: torch.Tensor | None = None
    """Detached off-policy importance weights (``correction.rollout_is_weights``; 1 when None)."""
    cov_mask: torch.Tensor | None = None
    """Clip-Cov's or KL-Cov's tokens (``clip_cov_selection`` / ``kl_cov_selection``)."""


@dataclasses.dataclass(kw_only=True)
class PolicyLossSettings:
    """The options of the policy losses (verl's ``actor.*`` and ``actor.policy_loss.*`` names)."""

    loss_agg_mode: str = "token-mean"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    """The dual-clip bound (vanilla; > 1)."""
    ppo_kl_coef: float = 0.1
    """KL-Cov's coefficient of ``|log-ratio|`` on its tokens."""


def _log_ratio(x: PolicyLossInputs) -> torch.Tensor:
    """``δ = clamp(logprobs - old_logprobs, -20, 20)``."""
    return torch.clamp(x.logprobs - x.old_logprobs, min=-20.0, max=20.0)


def _clip_terms(
    ratio: torch.Tensor, advantages: torch.Tensor, s: PolicyLossSettings
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(l1, max(l1, l2), l2 > l1)`` of PPO's clip: ``l1 = -A ρ``, ``l2 = -A clamp(ρ, 1 - low, 1 + high)``."""
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - s.clip_ratio_low, 1.0 + s.clip_ratio_high)
    return pg_losses1, torch.maximum(pg_losses1, pg_losses2), pg_losses2 > pg_losses1


def _finish(
    x: PolicyLossInputs,
    s: PolicyLossSettings,
    pg_losses: torch.Tensor,
    log_ratio: torch.Tensor,
    clipped: torch.Tensor,
    dual: torch.Tensor,
    metrics: dict[str, torch.Tensor],
    counts: dict[str, int | float | torch.Tensor | None],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The weighted, aggregated loss of the per-token ``pg_losses`` and the metrics every token loss
    logs (``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl``), as ``token_share``s, with ``metrics``'s."""
    if x.is_weights is not None:
        pg_losses = pg_losses * x.is_weights
    loss = agg_loss(pg_losses, x.response_mask, s.loss_agg_mode, **counts)
    mask = x.response_mask.bool()
    num_tokens = counts.get("num_tokens")
    with torch.no_grad():
        metrics["pg_clipfrac"] = masked_mean(clipped.float(), mask)
        metrics["pg_clipfrac_lower"] = masked_mean(dual.float(), mask)
        metrics["ppo_kl"] = masked_mean(-log_ratio, mask)
        if num_tokens is not None:
            weight = mask.sum() / num_tokens
            metrics = {k: v * weight for k, v in metrics.items()}
    return loss, {k: v.detach() for k, v in metrics.items()}


def vanilla_policy_loss(
    x: PolicyLossInputs, s: PolicyLossSettings, **counts: int | float | torch.Tensor | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped loss with asymmetric clip and dual clip (Schulman et al. 2017; Ye et al. 2020),
    verl's ``vanilla``. With ``δ = clamp(log π - log π_old, ±20)``, ``ρ = exp(δ)``, ``A`` the advantages
    and ``w`` the importance weights, per token::

        l1 = -A · ρ
        l2 = -A · clamp(ρ, 1 - clip_ratio_low, 1 + clip_ratio_high)
        l  = max(l1, l2);   l = min(l, -A · clip_ratio_c) where A < 0

    then ``agg_loss(w · l, mask, loss_agg_mode, **counts)``. Metrics: ``pg_clipfrac`` (share with
    ``l2 > l1``), ``pg_clipfrac_lower`` (share where the dual clip bound), ``ppo_kl`` (mean of ``-δ``,
    the k1 estimate of KL(π_old ‖ π)). Raises ValueError unless ``clip_ratio_c > 1``."""
    if not s.clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip bound) must be > 1, got {s.clip_ratio_c}")
    log_ratio = _log_ratio(x)
    _, clip_pg_losses, clipped = _clip_terms(log_ratio.exp(), x.advantages, s)
    pg_losses3 = -x.advantages * s.clip_ratio_c
    negative = x.advantages < 0
    dual = (clip_pg_losses > pg_losses3) & negative
    pg_losses = torch.where(negative, torch.minimum(clip_pg_losses, pg_losses3), clip_pg_losses)
    return _finish(x, s, pg_losses, log_ratio, clipped, dual, {}, counts)


def gspo_policy_loss(
    x: PolicyLossInputs, s: PolicyLossSettings, **counts: int | float | torch.Tensor | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al., "Group Sequence Policy Optimization", arXiv:2507.18071): one ratio per
    sequence, ``s_i = exp(mean_t δ_i,t)`` over its valid tokens, in the token form
    ``s_i,t = sg(s_i) · π_t / sg(π_t)`` (log clamped at 10), so every token of a sequence has the same
    value and the gradient ``s_i ∇log π_t``; ``l = max(-A s_i,t, -A clamp(s_i,t, 1 - low, 1 + high))``
    with no dual clip, aggregated with ``loss_agg_mode`` as every mode (verl 0.9.1; the paper's
    sequence-level aggregation is ``"seq-mean-token-mean"``). With the on-policy shortcut
    (``old_logprobs = logprobs.detach()``) ``s_i,t = 1`` and the gradient is vanilla's. The sequence
    mean needs the whole row: under sequence parallelism the trainer gathers each row's log-probs over
    the group first (``packed_forward.logprobs``). Metrics as vanilla's (``pg_clipfrac_lower`` 0)."""
    mask = x.response_mask.bool()
    zero = torch.zeros((), dtype=x.advantages.dtype, device=x.advantages.device)
    seq_log_ratio = masked_mean(torch.where(mask, x.logprobs - x.old_logprobs, zero), mask, dim=-1)
    log_seq_ratio = x.logprobs - x.logprobs.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.clamp(log_seq_ratio, max=10.0).exp()
    _, pg_losses, clipped = _clip_terms(ratio, x.advantages, s)
    return _finish(x, s, pg_losses, _log_ratio(x), clipped, torch.zeros_like(mask), {}, counts)


def clip_cov_policy_loss(
    x: PolicyLossInputs, s: PolicyLossSettings, **counts: int | float | torch.Tensor | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov (Cui et al., "The Entropy Mechanism of RL for Reasoning LMs", arXiv:2505.22617):
    vanilla's clipped ``max(l1, l2)`` without dual clip, times 0 on the tokens of ``cov_mask`` that the
    clip has not already cut (their gradient is detached; :func:`clip_cov_selection` picks them).
    Metrics as vanilla's (``pg_clipfrac_lower`` 0) and ``pg_covfrac``, the share of tokens zeroed.
    Raises ValueError without a ``cov_mask``."""
    if x.cov_mask is None:
        raise ValueError("loss_mode=clip_cov needs cov_mask (clip_cov_selection)")
    mask = x.response_mask.bool()
    zero = torch.zeros((), dtype=x.advantages.dtype, device=x.advantages.device)
    log_ratio = _log_ratio(x)
    _, clip_pg_losses, clipped = _clip_terms(log_ratio.exp(), x.advantages, s)
    detached = x.cov_mask.bool() & mask & ~clipped
    pg_losses = torch.where(detached, zero, clip_pg_losses)
    metrics = {"pg_covfrac": masked_mean(detached.float(), mask)}
    return _finish(x, s, pg_losses, log_ratio, clipped, torch.zeros_like(mask), metrics, counts)


def kl_cov_policy_loss(
    x: PolicyLossInputs, s: PolicyLossSettings, **counts: int | float | torch.Tensor | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov (same paper): no clip; ``l = -A · ρ + ppo_kl_coef · |δ|`` on the tokens of ``cov_mask``
    (:func:`kl_cov_selection`), ``-A · ρ`` elsewhere. Metrics as vanilla's (both clip fractions 0) and
    ``pg_covfrac``, the share of tokens penalized. Raises ValueError without a ``cov_mask``."""
    if x.cov_mask is None:
        raise ValueError("loss_mode=kl_cov needs cov_mask (kl_cov_selection)")
    mask = x.response_mask.bool()
    zero = torch.zeros((), dtype=x.advantages.dtype, device=x.advantages.device)
    log_ratio = _log_ratio(x)
    pg_losses1 = -x.advantages * log_ratio.exp()
    penalized = x.cov_mask.bool() & mask
    pg_losses = pg_losses1 + torch.where(penalized, s.ppo_kl_coef * log_ratio.abs(), zero)
    metrics = {"pg_covfrac": masked_mean(penalized.float(), mask)}
    none = torch.zeros_like(mask)
    return _finish(x, s, pg_losses, log_ratio, none, none, metrics, counts)


@torch.no_grad()
def token_covariance(
    advantages: torch.Tensor,
    logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Each token's contribution to the covariance of advantage and log-prob (the quantity whose sum
    drives the change of the policy's entropy, arXiv:2505.22617): ``(A_t - Ā)(log π_t - mean log π)``,
    the means over the masked tokens of the batch (of every rank's tokens with ``all_reduce``, which sums
    a tensor over ranks), 0 outside the mask.

    Example: ``A = [1, -1]``, ``log π = [-1, -3]``: means 0 and -2, covariances ``[1, 1]``.

    Shapes: ``advantages``, ``logprobs``, ``response_mask`` ``[B, T]``; returns ``[B, T]`` float64.
    """
    reduce = all_reduce or (lambda t: t)
    mask = response_mask.bool()
    a = torch.where(mask, advantages.double(), 0.0)
    lp = torch.where(mask, logprobs.double(), 0.0)
    sum_a, sum_lp, n = reduce(torch.stack([a.sum(), lp.sum(), mask.sum().double()])).unbind()
    n = n.clamp(min=1)
    cov = (a - sum_a / n) * (lp - sum_lp / n)
    return torch.where(mask, cov, 0.0)


def _global_count(response_mask: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor]) -> int:
    return int(round(float(reduce(response_mask.bool().sum().double().reshape(1))[0])))


@torch.no_grad()
def clip_cov_selection(
    cov: torch.Tensor,
    response_mask: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    ratio: float,
    lb: float,
    ub: float,
    generator: torch.Generator,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Clip-Cov's tokens (arXiv:2505.22617; verl's ``clip_cov``): ``max(int(ratio · N), 1)`` tokens drawn
    uniformly, without replacement, from the valid tokens with ``lb < cov < ub`` (all of them if fewer),
    ``N`` the number of valid tokens.

    The draw is over the whole batch of every rank and independent of how it is split: each token is
    named by its ``token_ids`` (unique, the same on any rank layout), the candidates' ids are gathered
    (``all_gather`` concatenates a 1-D tensor over ranks; ``all_reduce`` sums one) and sorted, and
    ``torch.randperm(len, generator=generator)`` picks from that list. Give every rank a generator in
    the same state.

    Shapes: ``cov``, ``response_mask``, ``token_ids`` (int64) ``[B, T]``; returns ``[B, T]`` bool.
    """
    reduce = all_reduce or (lambda t: t)
    gather = all_gather or (lambda t: t)
    mask = response_mask.bool()
    candidate = mask & (cov > lb) & (cov < ub)
    wanted = max(int(ratio * _global_count(mask, reduce)), 1)
    ids = torch.sort(gather(token_ids[candidate].cpu())).values
    chosen = ids[torch.randperm(ids.numel(), generator=generator)[:wanted]]
    return candidate & torch.isin(token_ids, chosen.to(token_ids.device))


@torch.no_grad()
def kl_cov_selection(
    cov: torch.Tensor,
    response_mask: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    ratio: float,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """KL-Cov's tokens (arXiv:2505.22617; verl's ``kl_cov``): the ``max(int(ratio · N), 1)`` valid tokens
    of largest ``cov`` (``N`` valid tokens), ties broken by the smaller ``token_ids``.

    Over the whole batch of every rank, independent of its split: each rank's own top candidates
    (``cov``, id) are gathered (``all_gather`` concatenates a 1-D tensor over ranks, ``all_reduce`` sums
    one) and the global top is taken from them.

    Shapes: ``cov``, ``response_mask``, ``token_ids`` (int64) ``[B, T]``; returns ``[B, T]`` bool.
    """
    reduce = all_reduce or (lambda t: t)
    gather = all_gather or (lambda t: t)
    mask = response_mask.bool()
    wanted = max(int(ratio * _global_count(mask, reduce)), 1)
    values, ids = cov[mask].double().cpu(), token_ids[mask].cpu()
    local = _top(values, ids, wanted)  # the global top is among the ranks' own tops
    values, ids = gather(values[local]), gather(ids[local])
    chosen = ids[_top(values, ids, wanted)]
    return mask & torch.isin(token_ids, chosen.to(token_ids.device))


def _top(values: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest ``values``, ties by the smaller id (a total order)."""
    by_id = torch.sort(ids, stable=True).indices
    by_value = torch.sort(values[by_id], descending=True, stable=True).indices
    return by_id[by_value][:k]


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
