"""KL(π ‖ π_ref): per-token estimators from sampled log-probs, the exact KL (and entropy) over the
vocabulary from logits, and the fixed and adaptive controllers of the KL coefficient in the reward.

Shapes: ``[B, T]`` over response tokens; logits ``[B, T, V]``.
"""

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from ppo.choices import KL_KINDS


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


def entropy_from_logits(logits: torch.Tensor, *, chunk_tokens: int | None = None) -> torch.Tensor:
    """Entropy of the categorical distribution ``softmax(logits)`` over the last dimension.

    ``H = -Σ_v p_v log p_v`` with ``log p = log_softmax(logits)`` computed in fp32 (fp64 inputs stay
    fp64), which is stable for large logits (no ``logsumexp - Σ p·z`` cancellation). Like
    :func:`full_kl`, tokens are processed ``chunk_tokens`` at a time so no full-size fp32 copy of the
    logits is made, with or without a gradient. Logits must be finite.

    Shapes: ``logits [..., V]``; returns ``[...]`` in fp32 (or fp64).
    """
    return _map_token_chunks(_entropy_rows, (logits,), chunk_tokens)
