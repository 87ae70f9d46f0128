"""Plain-PyTorch log-probs, entropy and low-variance KL: the naive references and the chunked CPU path.

Every op exists twice here:

- `*_reference`: the naive formula on the whole tensor (full fp32 `log_softmax`, `gather`, entropy),
  differentiated by autograd. It is the ground truth of the tests and the "naive" row of the benchmark.
- `*_torch`: the same maths as a `torch.autograd.Function` that walks over chunks of tokens, so only a
  `[chunk, V]` block of fp32 temporaries exists at a time, and that saves only `[T]`-sized statistics
  for backward. It is what `kernels` runs where Triton cannot (CPU, or when forced with
  `backend="torch"`).

Shapes: packed tokens `[T]` (`cu_seqlens [B+1]`, int32, flash-attn varlen convention), logits `[T, V]`,
hidden `[T, H]`, LM-head weight `[V, H]`. With z = logits.float() / temperature:

    logp[t]    = z[t, label[t]] - lse[t],            lse[t] = log sum_v exp z[t, v]
    entropy[t] = lse[t] - sum_v p[t, v] z[t, v],      p = softmax(z)

Tokens whose label is `ignore_index` get logp = entropy = 0 and no gradient. The compute dtype is
fp32, or fp64 when the inputs are fp64 (so `torch.autograd.gradcheck` can check the backward).

Run the tests with `.venv/bin/python -m pytest tests/test_kernels.py`.
"""

from __future__ import annotations

import torch
from torch import Tensor

IGNORE_INDEX = -100

# Clamps of the k3 estimator (verl's `low_var_kl`): the log-ratio, then the per-token KL.
KL_LOG_RATIO_CLAMP = 20.0
KL_VALUE_CLAMP = 10.0

# Default chunk of the CPU path: about 2**22 fp32 elements (16 MiB) per [chunk, V] temporary.
_CHUNK_ELEMENTS = 1 << 22


def next_token_labels(input_ids: Tensor, cu_seqlens: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Labels for next-token prediction on packed sequences.

    labels[t] = input_ids[t + 1] inside each sequence; the last position of every sequence (and any
    position past cu_seqlens[-1]) is `ignore_index`, so no token predicts the next sequence's first.

    Args:
        input_ids: [T] token ids of B packed sequences.
        cu_seqlens: [B+1] int32 offsets, cu_seqlens[0] = 0, non-decreasing (empty sequences allowed).
        ignore_index: label of positions that predict nothing.

    Returns:
        [T] int64 labels.
    """
    if input_ids.dim() != 1 or cu_seqlens.dim() != 1:
        raise ValueError(
            f"expected input_ids [T] and cu_seqlens [B+1], got {tuple(input_ids.shape)}, {tuple(cu_seqlens.shape)}"
        )
    labels = torch.full_like(input_ids, ignore_index, dtype=torch.long)
    if input_ids.numel() > 1:
        labels[:-1] = input_ids[1:]
    starts, ends = cu_seqlens[:-1].long(), cu_seqlens[1:].long()
    # ends - 1 of an empty sequence points into the previous one (or wraps to -1): skip those.
    last = (ends - 1)[ends > starts]
    labels[last] = ignore_index
    labels[int(cu_seqlens[-1]) :] = ignore_index
    return labels


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half/bf16/fp32 inputs, fp64 for fp64 (reference and gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def default_chunk_size(vocab_size: int) -> int:
    """Tokens per chunk of the CPU path: a [chunk, V] fp32 block of about 16 MiB, at least 8 tokens."""
    return max(8, _CHUNK_ELEMENTS // max(vocab_size, 1))


def _check_logits_args(logits: Tensor, labels: Tensor, temperature: float) -> None:
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(
            f"expected logits [T, V] and labels [T], got {tuple(logits.shape)}, {tuple(labels.shape)}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _check_linear_args(hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"expected hidden [T, H] and weight [V, H], got {tuple(hidden.shape)}, {tuple(weight.shape)}"
        )
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"expected labels [T] = [{hidden.shape[0]}], got {tuple(labels.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden and weight dtypes differ: {hidden.dtype} vs {weight.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


# ---------------------------------------------------------------------------------------------------
# References: the naive full-tensor formulas, differentiated by autograd.
# ---------------------------------------------------------------------------------------------------


def logprobs_from_logits_reference(
    logits: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[Tensor, Tensor | None]:
    """Naive log-probs and entropy: full fp32 log_softmax of [T, V], gather, -sum p log p.

    Args:
        logits: [T, V] any float dtype; upcast to fp32 (fp64 stays fp64) before dividing by temperature.
        labels: [T] int, `ignore_index` where no log-prob is wanted.

    Returns:
        logprobs [T] and entropy [T] (None if not compute_entropy), in the compute dtype; 0 at ignored
        tokens.
    """
    _check_logits_args(logits, labels, temperature)
    z = logits.to(compute_dtype(logits.dtype)) / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    valid = labels != ignore_index
    safe_labels = torch.where(valid, labels, 0).long()
    logprobs = torch.where(valid, logp_all.gather(-1, safe_labels[:, None]).squeeze(-1), 0.0)
    entropy = None
    if compute_entropy:
        entropy = torch.where(valid, -(logp_all.exp() * logp_all).sum(-1), 0.0)
    return logprobs, entropy


def fused_linear_logprobs_reference(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    chunk_size: int | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[Tensor, Tensor | None]:
    """Naive LM head + log-probs: logits = hidden @ weight^T ([T, V], input dtype), then the reference above.

    `chunk_size` is accepted for a signature identical to the fast paths and ignored.
    """
    del chunk_size
    _check_linear_args(hidden, weight, labels, temperature)
    logits = hidden @ weight.T
    return logprobs_from_logits_reference(
        logits, labels, temperature=temperature, compute_entropy=compute_entropy, ignore_index=ignore_index
    )


def low_var_kl_reference(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 estimator of KL(pi || pi_ref) per token (Schulman, "Approximating KL divergence", 2020).

    x = clamp(ref_logprobs - logprobs, -20, 20);  kl = clamp(e^x - x - 1, -10, 10). Autograd's clamp
    passes no gradient where a clamp is active (it passes it at the boundary itself).

    Args:
        logprobs, ref_logprobs: [T] (any equal shape).

    Returns:
        kl of the same shape, in the compute dtype (fp32, or fp64 for fp64 inputs).
    """
    dtype = compute_dtype(torch.promote_types(logprobs.dtype, ref_logprobs.dtype))
    x = (ref_logprobs.to(dtype) - logprobs.to(dtype)).clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
    return (x.exp() - x - 1).clamp(-KL_VALUE_CLAMP, KL_VALUE_CLAMP)


# ---------------------------------------------------------------------------------------------------
# Chunked path. The per-chunk helpers are shared by the from-logits and the fused-linear ops.
# ---------------------------------------------------------------------------------------------------


def _chunk_forward(
    z: Tensor, labels: Tensor, valid: Tensor, compute_entropy: bool
) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
    """Statistics of one [C, V] block of temperature-scaled logits z.

    Entropy is computed relative to the row max m, H = log s - sum e (z - m) / s with e = exp(z - m) and
    s = sum e: the same value as lse - sum p z, without cancelling two large numbers when logits are big.

    Returns:
        logprobs [C], entropy [C] or None, lse [C], mean_z [C] = sum_v p z (None without entropy); the
        last two are what backward needs.
    """
    m = z.amax(dim=-1, keepdim=True)
    zs = z - m
    e = zs.exp()
    s = e.sum(-1)
    log_s = s.log()
    lse = m.squeeze(-1) + log_s
    target = z.gather(-1, torch.where(valid, labels, 0).long()[:, None]).squeeze(-1)
    logprobs = torch.where(valid, target - lse, 0.0)
    if not compute_entropy:
        return logprobs, None, lse, None
    # Row-wise dot product through bmm: no third [C, V] temporary for e * zs.
    mean_zs = torch.bmm(e[:, None, :], zs[:, :, None]).view(-1) / s
    entropy = torch.where(valid, log_s - mean_zs, 0.0)
    return logprobs, entropy, lse, m.squeeze(-1) + mean_zs


def _chunk_grad(
    z: Tensor,
    safe_labels: Tensor,
    lse: Tensor,
    mean_z: Tensor | None,
    grad_logprobs: Tensor,
    grad_entropy: Tensor | None,
    temperature: float,
) -> Tensor:
    """d loss / d logits of one [C, V] block (fp32), the gradients of ignored tokens already zeroed.

    With p = exp(z - lse): dz = g_lp (onehot - p) + g_H p (sum p z - z), and d/dlogits = dz / temperature.
    """
    p = (z - lse[:, None]).exp_()
    if grad_entropy is None:
        dz = p.mul_(-grad_logprobs[:, None])
    else:
        coef = (z - mean_z[:, None]).mul_(grad_entropy[:, None]).add_(grad_logprobs[:, None])
        dz = p.mul_(coef).neg_()
    # Ignored tokens point at column 0 with a zero gradient, so the scatter adds nothing there.
    dz.scatter_add_(-1, safe_labels[:, None], grad_logprobs[:, None])
    if temperature != 1.0:
        dz.div_(temperature)
    return dz


def _scaled(logits: Tensor, temperature: float) -> Tensor:
    """z = logits upcast to the compute dtype, then divided by temperature (never in place on the input)."""
    z = logits.to(compute_dtype(logits.dtype))
    return z / temperature if temperature != 1.0 else z


def _masked_grads(
    grad_logprobs: Tensor | None, grad_entropy: Tensor | None, valid: Tensor, like: Tensor
) -> tuple[Tensor, Tensor | None]:
    """Gradients of the outputs with ignored tokens zeroed; a missing logprobs gradient becomes zeros."""
    if grad_logprobs is None:
        grad_logprobs = torch.zeros_like(like)
    grad_logprobs = torch.where(valid, grad_logprobs.to(like.dtype), 0.0)
    if grad_entropy is not None:
        grad_entropy = torch.where(valid, grad_entropy.to(like.dtype), 0.0)
    return grad_logprobs, grad_entropy


def _logits_forward(
    logits: Tensor,
    labels: Tensor,
    temperature: float,
    compute_entropy: bool,
    chunk_size: int,
    ignore_index: int,
) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
    """Chunked forward over [T, V] logits; returns (logprobs, entropy, lse, mean_z), each [T]."""
    num_tokens, dtype = logits.shape[0], compute_dtype(logits.dtype)
    valid = labels != ignore_index
    logprobs = torch.empty(num_tokens, dtype=dtype, device=logits.device)
    lse = torch.empty_like(logprobs)
    entropy = torch.empty_like(logprobs) if compute_entropy else None
    mean_z = torch.empty_like(logprobs) if compute_entropy else None
    for start in range(0, num_tokens, chunk_size):
        rows = slice(start, start + chunk_size)
        z = _scaled(logits[rows], temperature)
        lp, ent, ls, mz = _chunk_forward(z, labels[rows], valid[rows], compute_entropy)
        logprobs[rows], lse[rows] = lp, ls
        if compute_entropy:
            entropy[rows], mean_z[rows] = ent, mz
    return logprobs, entropy, lse, mean_z


class _LogprobsFromLogits(torch.autograd.Function):
    """Chunked log-probs/entropy from logits; saves logits (a reference, not a copy) and [T] stats."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        logits: Tensor,
        labels: Tensor,
        temperature: float,
        compute_entropy: bool,
        chunk_size: int,
        ignore_index: int,
    ) -> tuple[Tensor, Tensor | None]:
        logprobs, entropy, lse, mean_z = _logits_forward(
            logits, labels, temperature, compute_entropy, chunk_size, ignore_index
        )
        ctx.save_for_backward(logits, labels, lse, mean_z)
        ctx.temperature, ctx.chunk_size, ctx.ignore_index = temperature, chunk_size, ignore_index
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_logprobs: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        logits, labels, lse, mean_z = ctx.saved_tensors
        valid = labels != ctx.ignore_index
        safe_labels = torch.where(valid, labels, 0).long()
        g_lp, g_ent = _masked_grads(grad_logprobs, grad_entropy, valid, lse)
        # A new buffer: the caller's logits may still be read by someone else.
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            z = _scaled(logits[rows], ctx.temperature)
            mz = None if g_ent is None else mean_z[rows]
            ge = None if g_ent is None else g_ent[rows]
            grad_logits[rows] = _chunk_grad(
                z, safe_labels[rows], lse[rows], mz, g_lp[rows], ge, ctx.temperature
            )
        return grad_logits, None, None, None, None, None


def logprobs_from_logits_torch(
    logits: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    chunk_size: int | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[Tensor, Tensor | None]:
    """Chunked-PyTorch log-probs and entropy from logits [T, V]; same contract as the reference.

    Peak extra memory is a few [chunk_size, V] fp32 blocks plus, in backward, grad_logits [T, V] in the
    logits dtype. Without grad nothing is saved.
    """
    _check_logits_args(logits, labels, temperature)
    chunk_size = chunk_size or default_chunk_size(logits.shape[1])
    if not (torch.is_grad_enabled() and logits.requires_grad):
        logprobs, entropy, _, _ = _logits_forward(
            logits, labels, temperature, compute_entropy, chunk_size, ignore_index
        )
        return logprobs, entropy
    return _LogprobsFromLogits.apply(logits, labels, temperature, compute_entropy, chunk_size, ignore_index)


def _linear_forward(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    temperature: float,
    compute_entropy: bool,
    chunk_size: int,
    ignore_index: int,
) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
    """Chunked LM head + forward stats: only [chunk_size, V] of logits at a time."""
    num_tokens, dtype = hidden.shape[0], compute_dtype(hidden.dtype)
    valid = labels != ignore_index
    logprobs = torch.empty(num_tokens, dtype=dtype, device=hidden.device)
    lse = torch.empty_like(logprobs)
    entropy = torch.empty_like(logprobs) if compute_entropy else None
    mean_z = torch.empty_like(logprobs) if compute_entropy else None
    for start in range(0, num_tokens, chunk_size):
        rows = slice(start, start + chunk_size)
        z = _scaled(hidden[rows] @ weight.T, temperature)
        lp, ent, ls, mz = _chunk_forward(z, labels[rows], valid[rows], compute_entropy)
        logprobs[rows], lse[rows] = lp, ls
        if compute_entropy:
            entropy[rows], mean_z[rows] = ent, mz
    return logprobs, entropy, lse, mean_z


class _FusedLinearLogprobs(torch.autograd.Function):
    """Chunked LM head + log-probs; backward recomputes each chunk's logits with the forward's code."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        temperature: float,
        compute_entropy: bool,
        chunk_size: int,
        ignore_index: int,
    ) -> tuple[Tensor, Tensor | None]:
        logprobs, entropy, lse, mean_z = _linear_forward(
            hidden, weight, labels, temperature, compute_entropy, chunk_size, ignore_index
        )
        ctx.save_for_backward(hidden, weight, labels, lse, mean_z)
        ctx.temperature, ctx.chunk_size, ctx.ignore_index = temperature, chunk_size, ignore_index
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_logprobs: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        hidden, weight, labels, lse, mean_z = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        valid = labels != ctx.ignore_index
        safe_labels = torch.where(valid, labels, 0).long()
        g_lp, g_ent = _masked_grads(grad_logprobs, grad_entropy, valid, lse)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # grad_weight sums over all chunks: accumulate in the compute dtype, cast once at the end.
        grad_weight = torch.zeros_like(weight, dtype=lse.dtype) if need_weight else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            z = _scaled(hidden[rows] @ weight.T, ctx.temperature)
            mz = None if g_ent is None else mean_z[rows]
            ge = None if g_ent is None else g_ent[rows]
            dz = _chunk_grad(z, safe_labels[rows], lse[rows], mz, g_lp[rows], ge, ctx.temperature)
            del z
            if need_hidden:
                grad_hidden[rows] = dz.to(weight.dtype) @ weight
            if need_weight:
                grad_weight.addmm_(dz.T, hidden[rows].to(dz.dtype))
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def fused_linear_logprobs_torch(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    chunk_size: int | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[Tensor, Tensor | None]:
    """Chunked-PyTorch LM head + log-probs: [T, V] logits never exist whole.

    Each chunk of `chunk_size` tokens computes logits = hidden_c @ weight^T in the input dtype (as the
    naive path does), upcasts, and reduces them to [chunk] statistics; backward recomputes them.
    Peak extra memory: a few [chunk_size, V] fp32 blocks, plus grad_weight [V, H] in backward.
    """
    _check_linear_args(hidden, weight, labels, temperature)
    chunk_size = chunk_size or default_chunk_size(weight.shape[0])
    needs_grad = hidden.requires_grad or weight.requires_grad
    if not (torch.is_grad_enabled() and needs_grad):
        logprobs, entropy, _, _ = _linear_forward(
            hidden, weight, labels, temperature, compute_entropy, chunk_size, ignore_index
        )
        return logprobs, entropy
    return _FusedLinearLogprobs.apply(
        hidden, weight, labels, temperature, compute_entropy, chunk_size, ignore_index
    )


def _low_var_kl_parts(logprobs: Tensor, ref_logprobs: Tensor) -> tuple[Tensor, Tensor]:
    """(x, unclamped kl) in the compute dtype, x = clamp(ref - logp, -20, 20) and kl = e^x - x - 1."""
    dtype = compute_dtype(torch.promote_types(logprobs.dtype, ref_logprobs.dtype))
    x = (ref_logprobs.to(dtype) - logprobs.to(dtype)).clamp_(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
    return x, x.exp() - x - 1


class _LowVarKL(torch.autograd.Function):
    """k3 with a hand-written backward that saves the two inputs only (no intermediates)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
        ctx.save_for_backward(logprobs, ref_logprobs)
        _, kl = _low_var_kl_parts(logprobs, ref_logprobs)
        return kl.clamp_(-KL_VALUE_CLAMP, KL_VALUE_CLAMP)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_kl: Tensor) -> tuple[Tensor | None, ...]:
        logprobs, ref_logprobs = ctx.saved_tensors
        dtype = compute_dtype(torch.promote_types(logprobs.dtype, ref_logprobs.dtype))
        raw = ref_logprobs.to(dtype) - logprobs.to(dtype)
        x, kl = _low_var_kl_parts(logprobs, ref_logprobs)
        # d kl / dx = e^x - 1, zero where either clamp is active (inclusive bounds, like torch.clamp).
        live = (raw.abs() <= KL_LOG_RATIO_CLAMP) & (kl.abs() <= KL_VALUE_CLAMP)
        grad_x = torch.where(live, grad_kl * x.expm1(), 0.0)
        grad_logprobs = (-grad_x).to(logprobs.dtype) if ctx.needs_input_grad[0] else None
        grad_ref = grad_x.to(ref_logprobs.dtype) if ctx.needs_input_grad[1] else None
        return grad_logprobs, grad_ref


def low_var_kl_torch(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 KL per token (see `low_var_kl_reference`), with a backward that saves only the inputs."""
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"shapes differ: {tuple(logprobs.shape)} vs {tuple(ref_logprobs.shape)}")
    needs_grad = logprobs.requires_grad or ref_logprobs.requires_grad
    if not (torch.is_grad_enabled() and needs_grad):
        _, kl = _low_var_kl_parts(logprobs, ref_logprobs)
        return kl.clamp_(-KL_VALUE_CLAMP, KL_VALUE_CLAMP)
    return _LowVarKL.apply(logprobs, ref_logprobs)
