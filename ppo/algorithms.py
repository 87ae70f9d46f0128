"""PPO math: KL penalties and controllers, advantage estimators, losses and their aggregation.

Pure torch, no distributed calls, no model code: every function maps tensors to tensors and can be
tested on CPU by hand. Names and modes follow verl's ``core_algos`` so that a user switching from verl
gets the same numbers for the same inputs; where verl leaves a corner undefined (empty masks, groups of
one) the behaviour chosen here is written in the docstring.

Shapes are over response tokens: ``[B, T]`` with ``response_mask [B, T]`` (bool or 0/1, True = the
token is trained). Losses aggregate with :func:`agg_loss`, whose optional global counts (``num_tokens``,
``num_seqs``) make gradient accumulation and data parallelism exact: summing the per-micro-batch losses
of a mini-batch (over all micro-batches and ranks) gives the loss of the whole mini-batch at once.

Typical use in the PPO loop::

    kl = kl_penalty(old_logprobs, ref_logprobs, "kl")
    token_rewards = token_scores - kl_ctrl.value * kl
    advantages, returns = compute_gae(token_rewards, values, response_mask, gamma=1.0, lam=0.95)
    loss, metrics = policy_loss(logprobs, old_logprobs, advantages, response_mask, 0.2, 0.28, 3.0,
                                "token-mean", num_tokens=num_tokens_in_mini_batch)
"""

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

# ---------------------------------------------------------------------------------------------------
# Masked statistics
# ---------------------------------------------------------------------------------------------------


def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None
) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is set.

    ``mean = Σ x·m / max(Σ m, 1)`` over ``dim`` (all dimensions when None). ``mask`` is bool or 0/1 and
    broadcastable to ``x``. Masked-out entries are selected away with ``torch.where``, so a NaN or inf
    there cannot leak into the result; an empty mask gives 0, never NaN.

    Shapes: ``x [...]``, ``mask`` broadcastable to ``x``; returns a scalar (``dim=None``) or ``x`` reduced
    over ``dim``.
    """
    mask = mask.expand_as(x).bool()
    total = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    if dim is None:
        return total.sum() / mask.sum().clamp(min=1)
    return total.sum(dim=dim) / mask.sum(dim=dim).clamp(min=1)


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    *,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Normalize ``x`` to zero mean and unit variance over the masked positions (verl's ``masked_whiten``).

    ``μ = masked_mean(x)``, ``σ² = masked_mean((x - μ)²) · n / (n - 1)`` (unbiased, Bessel-corrected, with
    ``n = Σ m``), ``out = (x - μ) / sqrt(σ² + 1e-8)``; with ``shift_mean=False`` the mean is added back:
    ``out + μ``. Statistics are over all masked elements of the tensor (the whole batch), and every
    position, masked or not, is transformed with them: callers that want zeros outside the mask multiply
    by it.

    ``all_reduce``: a function that sums a tensor over data-parallel ranks in place of the identity
    (e.g. ``torch.distributed.all_reduce``); the statistics are then those of the whole batch on all
    ranks, computed in two passes (mean, then the squared deviations) as on one rank, so any number of
    ranks whitens exactly as one process holding every row.

    Where verl raises (``n < 2``), the Bessel factor is taken as 1: a single valid element whitens to 0
    and an empty mask gives ``x / 1e-4`` (μ = σ = 0), both finite.

    Shapes: ``x [...]``, ``mask`` broadcastable to ``x``; returns ``[...]`` like ``x``.
    """
    reduce = all_reduce or (lambda t: t)
    mask = mask.expand_as(x).bool()
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    total, n = reduce(torch.stack([torch.where(mask, x, zero).sum(), mask.sum().to(x.dtype)]))
    mean = total / n.clamp(min=1)
    centered = x - mean
    sq_dev = reduce(torch.where(mask, centered.square(), zero).sum())
    var = sq_dev / (n - 1).clamp(min=1)
    whitened = centered * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


# ---------------------------------------------------------------------------------------------------
# KL penalties and controllers
# ---------------------------------------------------------------------------------------------------

KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
"""Names of the per-token KL estimators of :func:`kl_penalty` (each may carry a ``+`` suffix)."""


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from the sampled tokens' log-probs (Schulman, "Approximating KL
    divergence", 2020).

    With ``d = logprobs - ref_logprobs``:

    - ``"kl"`` | ``"k1"``: ``d`` (unbiased, high variance, can be negative);
    - ``"abs"``: ``|d|``;
    - ``"mse"`` | ``"k2"``: ``½ d²``;
    - ``"low_var_kl"`` | ``"k3"``: ``eˣ - x - 1`` with ``x = clamp(-d, -20, 20)``, the result clamped to
      ``[-10, 10]`` (unbiased, non-negative, low variance).

    A ``"+"`` suffix (``"k3+"``, ``"low_var_kl+"``, ``"kl+"``, ...) keeps the named estimator's value but
    takes the gradient of k2, whose expectation is the true gradient of the KL (straight-through:
    ``k2 - k2.detach() + est.detach()``). ``"k2+"`` and ``"mse+"`` equal plain k2.

    Shapes: ``logprobs [B, T]``, ``ref_logprobs [B, T]`` (any matching shape); returns ``[B, T]``.
    Raises ValueError for an unknown kind.
    """
    straight_through = kind.endswith("+")
    base = kind[:-1] if straight_through else kind
    if base not in KL_KINDS:
        valid = ", ".join(f"{k}, {k}+" for k in KL_KINDS)
        raise ValueError(
            f"unknown KL penalty kind {kind!r}; valid kinds: {valid} (use full_kl() for the exact KL)"
        )
    d = logprobs - ref_logprobs
    if base in ("kl", "k1"):
        est = d
    elif base == "abs":
        est = d.abs()
    elif base in ("mse", "k2"):
        est = 0.5 * d.square()
    else:
        # The log-ratio is clamped before exp so that a token the reference finds far likelier than the
        # policy cannot overflow; the result clamp bounds the penalty of any single token.
        x = torch.clamp(-d, min=-20.0, max=20.0)
        est = torch.clamp(x.exp() - x - 1, min=-10.0, max=10.0)
    if not straight_through or base in ("mse", "k2"):
        return est
    k2 = 0.5 * d.square()
    return k2 - k2.detach() + est.detach()


def _kl_rows(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """``Σ_v p (log p - log q)`` for ``p = softmax(logits)``, ``q = softmax(ref_logits)``; ``[N, V] -> [N]``,
    computed in at least fp32."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    logp = torch.log_softmax(logits.to(dtype), dim=-1)
    logq = torch.log_softmax(ref_logits.to(dtype), dim=-1)
    return (logp.exp() * (logp - logq)).sum(dim=-1)


def _entropy_rows(logits: torch.Tensor) -> torch.Tensor:
    """``-Σ_v p log p`` for ``p = softmax(logits)``; ``[N, V] -> [N]``, computed in at least fp32."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    logp = torch.log_softmax(logits.to(dtype), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def _map_token_chunks(
    fn: Callable[..., torch.Tensor], tensors: tuple[torch.Tensor, ...], chunk_tokens: int | None
) -> torch.Tensor:
    """Apply ``fn`` (rows ``[N, V]`` -> ``[N]``) to ``tensors [..., V]`` a chunk of tokens at a time.

    Chunks are views of the inputs, so only one chunk's fp32 temporaries exist at a time. When a gradient
    is needed each chunk runs under activation checkpointing: autograd keeps the (view) inputs instead of
    the chunk's fp32 softmax, and backward recomputes it chunk by chunk. Returns ``[...]``.
    """
    vocab = tensors[0].shape[-1]
    lead_shape = tensors[0].shape[:-1]
    rows = [t.reshape(-1, vocab) for t in tensors]
    num_rows = rows[0].shape[0]
    if chunk_tokens is None:
        # About 2**26 fp32 elements (256 MiB) per input chunk: large enough to keep the matmul-free
        # softmax memory bound, small enough to fit next to the model's activations.
        chunk_tokens = max(1, 2**26 // max(vocab, 1))
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    parts = []
    for start in range(0, num_rows, chunk_tokens):
        chunk = [r[start : start + chunk_tokens] for r in rows]
        if needs_grad:
            parts.append(checkpoint(fn, *chunk, use_reentrant=False, preserve_rng_state=False))
        else:
            parts.append(fn(*chunk))
    if not parts:
        dtype = torch.promote_types(tensors[0].dtype, torch.float32)
        return torch.zeros(lead_shape, dtype=dtype, device=tensors[0].device)
    return torch.cat(parts).reshape(lead_shape)


def full_kl(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Exact per-token KL(π ‖ π_ref) over the vocabulary from two sets of logits.

    ``KL_t = Σ_v p_v (log p_v - log q_v)`` with ``p = softmax(logits_t)``, ``q = softmax(ref_logits_t)``,
    computed with log-softmax in fp32 (fp64 inputs stay fp64). The token dimension is processed
    ``chunk_tokens`` tokens at a time (default: about 2**26 / V), so no full-size fp32 copy of either
    logits tensor is made, with or without a gradient (chunks are checkpointed and recomputed in
    backward). Positions outside ``response_mask`` are 0 and get no gradient.

    Shapes: ``logits [B, T, V]``, ``ref_logits [B, T, V]``, ``response_mask [B, T]``; returns ``[B, T]``
    in fp32 (or fp64).
    """
    kl = _map_token_chunks(_kl_rows, (logits, ref_logits), chunk_tokens)
    return torch.where(response_mask.bool(), kl, torch.zeros((), dtype=kl.dtype, device=kl.device))


class FixedKLController:
    """Constant KL coefficient β (verl's ``FixedKLController``); ``update`` is a no-op.

    Checkpointable: ``state_dict() == {"value": β}`` as a plain python float.
    """

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        """Keep β unchanged (the signature matches :class:`AdaptiveKLController`)."""

    def state_dict(self) -> dict[str, float]:
        """The coefficient as ``{"value": float}``."""
        return {"value": self.value}

    def load_state_dict(self, state_dict: dict[str, float]) -> None:
        """Restore the coefficient written by :meth:`state_dict`; other keys are an error."""
        _check_keys(state_dict, {"value"})
        self.value = float(state_dict["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al., "Fine-Tuning Language Models from Human Preferences"
    (2019), as in verl.

    Each update moves β toward keeping the measured KL at ``target_kl``:
    ``e = clip(current_kl / target_kl - 1, -0.2, 0.2)``, ``β ← β · (1 + e · n_steps / horizon)``, where
    ``n_steps`` is the number of samples (or steps) since the last update.

    Checkpointable: ``state_dict() == {"value": β}`` as a plain python float; ``target_kl`` and
    ``horizon`` come from the config, so a resumed run may change them.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        """Multiply β by ``1 + clip(current_kl / target_kl - 1, ±0.2) · n_steps / horizon``."""
        error = min(max(float(current_kl) / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        """The coefficient as ``{"value": float}``."""
        return {"value": self.value}

    def load_state_dict(self, state_dict: dict[str, float]) -> None:
        """Restore the coefficient written by :meth:`state_dict`; other keys are an error."""
        _check_keys(state_dict, {"value"})
        self.value = float(state_dict["value"])


def _check_keys(state_dict: dict[str, float], expected: set[str]) -> None:
    """Raise ValueError unless ``state_dict`` has exactly the ``expected`` keys."""
    if set(state_dict) != expected:
        raise ValueError(f"KL controller state must have keys {sorted(expected)}, got {sorted(state_dict)}")


# ---------------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------------------

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
"""Names of the loss aggregation modes of :func:`agg_loss`."""

ADV_ESTIMATORS = ("gae", "grpo", "rloo")
"""Advantage estimators: :func:`compute_gae` (with a critic), :func:`compute_grpo_advantages`,
:func:`compute_rloo_advantages`."""


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
    **counts: int | float | torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate loss with asymmetric clipping and dual clip (verl's ``vanilla`` loss).

    ``ρ = exp(clamp(logprobs - old_logprobs, -20, 20))`` and, per token::

        l1 = -A · ρ
        l2 = -A · clamp(ρ, 1 - clip_ratio_low, 1 + clip_ratio_high)     # Schulman et al., 2017
        l  = max(l1, l2)
        l  = min(l, -A · clip_ratio_c)   where A < 0                    # dual clip, Ye et al., 2020

    then ``loss = agg_loss(l, response_mask, loss_agg_mode, **counts)``; ``counts`` are agg_loss's
    ``num_tokens``, ``num_seqs`` and ``loss_scale_factor``.

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


def entropy_from_logits(logits: torch.Tensor, *, chunk_tokens: int | None = None) -> torch.Tensor:
    """Entropy of the categorical distribution ``softmax(logits)`` over the last dimension.

    ``H = -Σ_v p_v log p_v`` with ``log p = log_softmax(logits)`` computed in fp32 (fp64 inputs stay
    fp64), which is stable for large logits (no ``logsumexp - Σ p·z`` cancellation). Like
    :func:`full_kl`, tokens are processed ``chunk_tokens`` at a time so no full-size fp32 copy of the
    logits is made, with or without a gradient. Logits must be finite.

    Shapes: ``logits [..., V]``; returns ``[...]`` in fp32 (or fp64).
    """
    return _map_token_chunks(_entropy_rows, (logits,), chunk_tokens)
