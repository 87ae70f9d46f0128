"""Plain-PyTorch log-probs, entropy and low-variance KL: the naive references and the torch primitives.

- `*_reference`: the naive formula on the whole tensor (full fp32 `log_softmax`, `gather`, entropy),
  differentiated by autograd. It is the ground truth of the tests and the "naive" row of the benchmark.
- `TORCH`: the per-chunk primitives of the chunked algorithm in `ppo_kernels/chunked.py` (which owns the
  chunk loops and the autograd Functions), in plain PyTorch. It is what `ppo_kernels` runs where Triton
  cannot (CPU, or when forced with `backend="torch"`).

Shapes: packed tokens `[T]` (`cu_seqlens [B+1]`, int32, flash-attn varlen convention), logits `[T, V]`,
hidden `[T, H]`, LM-head weight `[V, H]`. With z = logits.float() / temperature:

    logp[t]    = z[t, label[t]] - lse[t],            lse[t] = log sum_v exp z[t, v]
    entropy[t] = lse[t] - sum_v p[t, v] z[t, v],      p = softmax(z)

Tokens whose label is `ignore_index` get logp = entropy = 0 and no gradient. The compute dtype is
fp32, or fp64 when the inputs are fp64 (so `torch.autograd.gradcheck` can check the backward).

Run the tests with `.venv/bin/python -m pytest tests/unit/test_kernels.py`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ppo_kernels.chunked import (
    IGNORE_INDEX,
    KL_LOG_RATIO_CLAMP,
    KL_VALUE_CLAMP,
    GradRows,
    Primitives,
    RowStats,
    check_gather_args,
    check_kl_args,
    check_linear_args,
    check_logits_args,
    check_topk_args,
    compute_dtype,
)


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
    check_logits_args(logits, labels, temperature)
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
    ignore_index: int = IGNORE_INDEX,
) -> tuple[Tensor, Tensor | None]:
    """Naive LM head + log-probs: logits = hidden @ weight^T ([T, V], input dtype), then the reference above."""
    check_linear_args(hidden, weight, labels, temperature)
    logits = hidden @ weight.T
    return logprobs_from_logits_reference(
        logits, labels, temperature=temperature, compute_entropy=compute_entropy, ignore_index=ignore_index
    )


def fused_linear_topk_reference(
    hidden: Tensor, weight: Tensor, k: int, *, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Naive top-k log-probs: z = (hidden @ weight^T) upcast / temperature ([T, V]), log_softmax(z), and
    the k largest per token, sorted descending. The ids are `torch.topk(z, k)`'s (ties in its order).

    Returns:
        logprobs [T, k] in the compute dtype (fp32; fp64 for fp64 inputs) and ids [T, k] int64; no grad.
    """
    check_topk_args(hidden, weight, k, temperature)
    with torch.no_grad():
        z = (hidden @ weight.T).to(compute_dtype(hidden.dtype)) / temperature
        ids = z.topk(k, dim=-1).indices
        return torch.log_softmax(z, dim=-1).gather(-1, ids), ids


def fused_linear_gather_logprobs_reference(
    hidden: Tensor, weight: Tensor, ids: Tensor, *, temperature: float = 1.0, return_topk: bool = False
) -> tuple[Tensor, Tensor | None]:
    """Naive log-probs at given ids: log_softmax(z).gather(ids), z = (hidden @ weight^T) upcast /
    temperature, differentiated by autograd.

    Args:
        ids: [T, K] integer vocabulary ids (valid everywhere: callers mask ignored rows afterwards).
        return_topk: also return `torch.topk(z, K)`'s ids.

    Returns:
        logprobs [T, K] in the compute dtype and the top-K ids [T, K] int64 (or None).
    """
    check_gather_args(hidden, weight, ids, temperature, return_topk)
    z = (hidden @ weight.T).to(compute_dtype(hidden.dtype)) / temperature
    logprobs = torch.log_softmax(z, dim=-1).gather(-1, ids.long())
    own_topk_ids = z.detach().topk(ids.shape[1], dim=-1).indices if return_topk else None
    return logprobs, own_topk_ids


def low_var_kl_reference(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 estimator of KL(pi || pi_ref) per token (Schulman, "Approximating KL divergence", 2020).

    x = clamp(ref_logprobs - logprobs, -20, 20);  kl = clamp(e^x - x - 1, -10, 10). Autograd's clamp
    passes no gradient where a clamp is active (it passes it at the boundary itself).

    Args:
        logprobs, ref_logprobs: [T] (any equal shape).

    Returns:
        kl of the same shape, in the compute dtype (fp32, or fp64 for fp64 inputs).
    """
    check_kl_args(logprobs, ref_logprobs)
    dtype = compute_dtype(torch.promote_types(logprobs.dtype, ref_logprobs.dtype))
    x = (ref_logprobs.to(dtype) - logprobs.to(dtype)).clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
    return (x.exp() - x - 1).clamp(-KL_VALUE_CLAMP, KL_VALUE_CLAMP)


# ---------------------------------------------------------------------------------------------------
# Primitives of the chunked path (see `Primitives` in ppo_kernels/chunked.py for the contracts).
# ---------------------------------------------------------------------------------------------------


def _scaled(logits: Tensor, temperature: float, consume: bool) -> Tensor:
    """z = logits in the compute dtype / temperature, as a tensor this code may overwrite.

    With consume=False it is always a new tensor (the caller's logits are never written); with
    consume=True it may be `logits` itself.
    """
    z = logits.to(compute_dtype(logits.dtype), copy=not consume)
    return z.div_(temperature) if temperature != 1.0 else z


def _row_stats(
    logits: Tensor, labels: Tensor, out: RowStats, temperature: float, ignore_index: int, consume: bool
) -> None:
    """Statistics of one [C, V] block, relative to the row max m (no cancellation of large numbers).

    With e = exp(z - m) and s = sum e: lse = m + log s, entropy = log s - sum e (z - m) / s (the same
    value as lse - sum p z), mean_z = m + sum e (z - m) / s. Holds z and e: 2 compute-dtype values per
    entry.
    """
    valid = labels != ignore_index
    z = _scaled(logits, temperature, consume)
    target = z.gather(-1, torch.where(valid, labels, 0).long()[:, None]).squeeze(-1)
    m = z.amax(dim=-1, keepdim=True)
    zs = z.sub_(m)
    e = zs.exp()
    s = e.sum(-1)
    log_s = s.log()
    lse = m.squeeze(-1) + log_s
    out.logprobs.copy_(torch.where(valid, target - lse, 0.0))
    out.lse.copy_(lse)
    if out.entropy is not None:
        # Row-wise dot product through bmm: no third [C, V] temporary for e * zs.
        mean_zs = torch.bmm(e[:, None, :], zs[:, :, None]).view(-1) / s
        out.entropy.copy_(torch.where(valid, log_s - mean_zs, 0.0))
        out.mean_z.copy_(m.squeeze(-1) + mean_zs)


def _logits_grad(logits: Tensor, out: Tensor, rows: GradRows, col_offset: int) -> None:
    """d logits of vocabulary columns col_offset .. col_offset + n of one [C, n] block, into `out`.

    With p = exp(z - lse): dz = g_lp (onehot - p) + g_H p (mean_z - z), d logits = dz / temperature.
    Holds z and p: 2 compute-dtype values per entry (z is `logits` itself when fp32 and in place).
    """
    labels, lse, mean_z, g_lp, g_ent, temperature, ignore_index = rows
    z = _scaled(logits, temperature, consume=out is logits)
    valid = labels != ignore_index
    # Ignored rows: p = 0, so they come out 0 whatever their statistics and gradients hold.
    p = (z - torch.where(valid, lse, torch.inf)[:, None]).exp_()
    if g_ent is None:
        dz = p.mul_(-g_lp[:, None])
    else:
        coef = z.sub_(mean_z[:, None]).mul_(g_ent[:, None]).add_(g_lp[:, None])
        dz = p.mul_(coef).neg_()
    del z
    column = labels.long() - col_offset
    hit = valid & (column >= 0) & (column < out.shape[1])
    # Rows whose label is outside this block point at column 0 with a zero gradient: nothing is added.
    dz.scatter_add_(-1, torch.where(hit, column, 0)[:, None], torch.where(hit, g_lp, 0.0)[:, None])
    if temperature != 1.0:
        dz.div_(temperature)
    out.copy_(dz)


def _accumulate_matmul(c: Tensor, a: Tensor, b: Tensor) -> None:
    """c += a @ b in c's dtype (half inputs are upcast first: CPU matmuls need one dtype)."""
    c.addmm_(a.to(c.dtype), b.to(c.dtype))


def _low_var_kl_parts(logprobs: Tensor, ref_logprobs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(raw, x, unclamped kl) in the compute dtype: raw = ref - logp, x = clamp(raw, +-20), e^x - x - 1."""
    dtype = compute_dtype(torch.promote_types(logprobs.dtype, ref_logprobs.dtype))
    raw = ref_logprobs.to(dtype) - logprobs.to(dtype)
    x = raw.clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
    return raw, x, x.exp() - x - 1


def _kl_forward(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return _low_var_kl_parts(logprobs, ref_logprobs)[2].clamp_(-KL_VALUE_CLAMP, KL_VALUE_CLAMP)


def _kl_grad(logprobs: Tensor, ref_logprobs: Tensor, grad_kl: Tensor) -> Tensor:
    """d kl / dx = e^x - 1, zero where either clamp is active (inclusive bounds, like torch.clamp)."""
    raw, x, kl = _low_var_kl_parts(logprobs, ref_logprobs)
    live = (raw.abs() <= KL_LOG_RATIO_CLAMP) & (kl.abs() <= KL_VALUE_CLAMP)
    return torch.where(live, grad_kl * x.expm1(), 0.0)


def _accept_any(*tensors: Tensor) -> None:
    """The torch path runs on any device and float dtype."""


TORCH = Primitives(
    name="torch",
    row_stats=_row_stats,
    logits_grad=_logits_grad,
    accumulate_matmul=_accumulate_matmul,
    kl_forward=_kl_forward,
    kl_grad=_kl_grad,
    check_inputs=_accept_any,
    compute_temporaries=2,
    upcasts_weight_chunk=True,
)
"""The chunked path in plain PyTorch (CPU, or any device with backend="torch")."""
