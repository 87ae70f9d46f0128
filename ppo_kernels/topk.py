"""Top-k log-probs and log-probs at given ids from hidden states and the LM head, never holding [T, V].

On-policy distillation compares the student with the teacher on the teacher's top-k tokens: the
teacher's top-k log-probs and ids per token (`fused_linear_topk`, no gradient), then the student's
log-probs at those ids, differentiable (`fused_linear_gather_logprobs`, which can also return the
student's own top-k ids from the same pass). With z = (hidden @ weight^T).float() / temperature,
p = softmax(z) and lse = log sum_v exp z:

    topk:    logprobs[t, j] = z[t, i_j] - lse[t] for the k largest z[t, i] (i_1 first), ids[t, j] = i_j
    gather:  logprobs[t, j] = z[t, ids[t, j]] - lse[t]
             d logprobs[t, j] / d z[t, v] = 1[v = ids[t, j]] - p[t, v], so with g = d loss / d logprobs:
             d loss / d z[t] = scatter_add(g[t] at ids[t]) - (sum_j g[t, j]) p[t]
             d loss / d logits = (d loss / d z) / temperature,
             grad_hidden = d logits @ W, grad_weight = d logits^T @ hidden

Algorithm (the same as `ppo_kernels.chunked.fused_linear_logprobs`, whose chunk-size helpers it uses):

- Forward: token chunks of `chunk_size` rows; each is one GEMM logits = hidden[rows] @ weight^T into a
  reused [rows, V] buffer in the input dtype, upcast and divided by the temperature (in place for fp32
  inputs), then the gather at ids and/or `torch.topk`, then lse (in place). Only [T] lse and the ids
  are saved for backward.
- Backward (`chunked.vocab_chunk_grads`): vocabulary chunks of `vocab_chunk_size` rows of W; per chunk
  the [T, n] logits are recomputed and turned in place into d logits (formula above), grad_weight's rows
  are written once, grad_hidden accumulates in fp32 and is cast once at the end.
- FLOPs: 2·T·H·V forward, 6·T·H·V backward, like `fused_linear_logprobs`.

Ids: those of `torch.topk` on each chunk's fp32 z rows, sorted descending. Among exactly equal z the
order is torch.topk's: on CPU it depends on the row only, so it equals `torch.topk` of the whole
[T, V] z (tested); elsewhere torch does not specify it. Tied ids have equal log-probs, so the values
never depend on it.

There is no Triton kernel for these two ops: backend "triton" (and "auto" on CUDA) runs this PyTorch
code. That is fine because the time is in the GEMMs (cuBLAS either way, as in the Triton path of
`fused_linear_logprobs`), the memory bound comes from the chunking, and what a kernel could fuse (the
exp/sum and top-k passes over a [rows, V] chunk already in memory) is a few memory passes next to a
2·rows·H·V-FLOP GEMM; `torch.topk` is itself a tuned kernel.

Peak extra memory in bytes (`topk_memory_plan`; s = the input dtype's size, c = 4, 8 for fp64 inputs;
K ids per token, n = vocab_chunk_size):

- forward: chunk_size · V · (s + 2c) + T · (128 + 56 K); the chunk term is within
  `chunked.chunk_budget_bytes` (256 MiB on CUDA, 64 MiB elsewhere) when chunk_size is None.
- backward: V · H · s (grad_weight) + T · H · c (grad_hidden accumulator) + T · n · (s + 2c) (the
  [T, n] chunk and its fp32 temporaries; + n · H · c for half inputs, whose weight chunk the fp32
  grad_hidden matmul upcasts) + T · (128 + 56 K); the chunk term within the budget by default.

Tests: `.venv/bin/python -m pytest tests/unit/test_topk_kernels.py`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import torch
from torch import Tensor

from ppo_kernels import chunked
from ppo_kernels.chunked import MemoryPlan, compute_dtype
from ppo_kernels.torch_ops import TORCH

# Bytes per token and id beyond fused_linear_logprobs' per-token vectors: the output log-probs (4), the
# int64 ids (8), the output gradient in fp32 (4), the backward's per-chunk column, mask and scatter
# index/value temporaries (8 + 1 + 8 + 4), the top-k values and ids (4 + 8): 49, rounded up.
PER_ID_BYTES = 56


@dataclasses.dataclass(frozen=True)
class TopkConfig:
    """One call of a top-k op: its scalars and chunk sizes (resolved from the budget)."""

    temperature: float
    chunk_size: int
    """Tokens per forward chunk."""
    vocab_chunk_size: int
    """Vocabulary rows per backward chunk."""


def topk_memory_plan(
    num_tokens: int,
    hidden_size: int,
    vocab_size: int,
    num_ids: int,
    dtype: torch.dtype,
    budget_bytes: int = chunked.CUDA_CHUNK_BUDGET_BYTES,
    *,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
) -> MemoryPlan:
    """Peak extra memory of `fused_linear_gather_logprobs` forward + backward with K = num_ids (the
    forward phase alone is `fused_linear_topk`'s, k = num_ids), and the chunk sizes the ops use.

    It is `chunked.fused_memory_plan` on the torch primitives (2 fp32 temporaries per chunk entry: an
    upper bound here, where the forward holds at most one and the backward one) plus PER_ID_BYTES per
    token and id. Example, bf16, T=16384, H=4096, V=152064, K=32, budget 256 MiB: token chunk 128,
    forward 186 MiB chunk + 30 MiB per token; vocab chunk 1408, backward 1188 MiB grad_weight + 256 MiB
    fp32 grad_hidden + 242 MiB chunk (220 MiB [T, n] at 10 B per entry, 22 MiB fp32 weight-chunk copy)
    + 30 MiB per token = 1.676 GiB.
    """
    plan = chunked.fused_memory_plan(
        TORCH,
        num_tokens,
        hidden_size,
        vocab_size,
        dtype,
        budget_bytes,
        chunk_size=chunk_size,
        vocab_chunk_size=vocab_chunk_size,
    )
    ids = PER_ID_BYTES * num_tokens * num_ids
    return dataclasses.replace(
        plan,
        forward={**plan.forward, "ids": ids},
        backward={**plan.backward, "ids": ids},
        end={**plan.end, "ids": ids},
    )


def _config(
    hidden: Tensor,
    weight: Tensor,
    num_ids: int,
    temperature: float,
    chunk_size: int | None,
    vocab_chunk_size: int | None,
) -> TopkConfig:
    chunked.check_chunk_sizes(chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size)
    plan = topk_memory_plan(
        hidden.shape[0],
        hidden.shape[1],
        weight.shape[0],
        num_ids,
        hidden.dtype,
        chunked.chunk_budget_bytes(hidden.device),
        chunk_size=chunk_size,
        vocab_chunk_size=vocab_chunk_size,
    )
    return TopkConfig(float(temperature), max(1, plan.token_chunk), max(1, plan.vocab_chunk))


class _Forward(NamedTuple):
    """What the chunked forward computes, for all T tokens."""

    logprobs: Tensor
    """[T, K] compute dtype: at the given ids, or the top-k's when no ids were given."""
    lse: Tensor
    """[T] compute dtype, log sum_v exp z; what backward needs."""
    topk_ids: Tensor | None
    """[T, k] int64, sorted by descending z, or None when not asked for."""


def _forward(
    config: TopkConfig, hidden: Tensor, weight: Tensor, ids: Tensor | None, k: int | None
) -> _Forward:
    """Per token chunk: one GEMM into a reused [rows, V] buffer, z in fp32 (in place for fp32 inputs),
    the gather at `ids` and/or the top `k`, then lse (consuming z). No grad is recorded."""
    (num_tokens, _), vocab_size, step = hidden.shape, weight.shape[0], config.chunk_size
    acc_dtype, device = compute_dtype(hidden.dtype), hidden.device
    num_out = ids.shape[1] if ids is not None else k
    logprobs = torch.empty(num_tokens, num_out, dtype=acc_dtype, device=device)
    lse = torch.empty(num_tokens, dtype=acc_dtype, device=device)
    topk_ids = None if k is None else torch.empty(num_tokens, k, dtype=torch.long, device=device)
    buffer = hidden.new_empty(min(step, num_tokens) * vocab_size)
    with torch.no_grad():
        for start in range(0, num_tokens, step):
            rows = slice(start, min(start + step, num_tokens))
            logits = buffer[: (rows.stop - start) * vocab_size].view(-1, vocab_size)
            torch.mm(hidden[rows], weight.T, out=logits)
            z = logits.to(acc_dtype, copy=False)  # the buffer itself for fp32 inputs
            if config.temperature != 1.0:
                z.div_(config.temperature)
            picked = None if ids is None else z.gather(-1, ids[rows])
            if k is not None:
                top = z.topk(k, dim=-1)
                topk_ids[rows] = top.indices
                picked = top.values if picked is None else picked
            # lse relative to the row max (no overflow), consuming z: z - m, then exp in place.
            m = z.amax(dim=-1, keepdim=True)
            row_lse = m.squeeze(-1) + z.sub_(m).exp_().sum(-1).log_()
            lse[rows] = row_lse
            torch.sub(picked, row_lse[:, None], out=logprobs[rows])
    return _Forward(logprobs, lse, topk_ids)


def _gather_logits_grad(
    dlogits: Tensor,
    col_offset: int,
    *,
    ids: Tensor,
    g: Tensor,
    g_sum: Tensor,
    lse: Tensor,
    temperature: float,
) -> None:
    """d logits of vocabulary columns col_offset .. col_offset + n of a [T, n] logits block, in place.

    dz = scatter_add(g at the ids in this block) - g_sum p, p = exp(z - lse); d logits = dz / temperature.
    Holds one compute-dtype value per entry (none beyond the block for fp32 inputs).
    """
    z = dlogits.to(lse.dtype, copy=False)
    if temperature != 1.0:
        z.div_(temperature)
    dz = z.sub_(lse[:, None]).exp_().mul_(-g_sum[:, None])  # -g_sum p
    column = ids - col_offset
    hit = (column >= 0) & (column < dz.shape[1])
    # Ids outside this block point at column 0 with a zero gradient: nothing is added. Repeated ids in
    # a row add up, as the derivative of the sum over j does.
    dz.scatter_add_(-1, torch.where(hit, column, 0), torch.where(hit, g, 0.0))
    if temperature != 1.0:
        dz.div_(temperature)
    if dz is not dlogits:
        dlogits.copy_(dz)


class _GatherLogprobs(torch.autograd.Function):
    """LM head + log-probs at ids; saves hidden, weight, ids (references) and [T] lse, nothing [T, V]."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: Tensor,
        weight: Tensor,
        ids: Tensor,
        config: TopkConfig,
        return_topk: bool,
    ) -> tuple[Tensor, Tensor | None]:
        out = _forward(config, hidden, weight, ids, ids.shape[1] if return_topk else None)
        ctx.save_for_backward(hidden, weight, ids, out.lse)
        ctx.config = config
        ctx.set_materialize_grads(False)
        if out.topk_ids is not None:
            ctx.mark_non_differentiable(out.topk_ids)
        return out.logprobs, out.topk_ids

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_logprobs: Tensor | None, _grad_topk_ids: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        if grad_logprobs is None:
            return None, None, None, None, None
        hidden, weight, ids, lse = ctx.saved_tensors
        config: TopkConfig = ctx.config
        g = grad_logprobs.to(lse.dtype).contiguous()
        logits_grad = functools.partial(
            _gather_logits_grad, ids=ids, g=g, g_sum=g.sum(-1), lse=lse, temperature=config.temperature
        )
        grads = chunked.vocab_chunk_grads(
            hidden,
            weight,
            config.vocab_chunk_size,
            logits_grad,
            TORCH.accumulate_matmul,
            *ctx.needs_input_grad[:2],
        )
        return *grads, None, None, None


def fused_linear_topk(
    hidden: Tensor, weight: Tensor, k: int, *, temperature: float = 1.0, chunk_size: int | None = None
) -> tuple[Tensor, Tensor]:
    """Top-k log-probs of softmax((hidden @ weight^T).float() / temperature) per token, chunked; see
    `ppo_kernels.fused_linear_topk`. Returns (logprobs [T, k] compute dtype, ids [T, k] int64), detached."""
    chunked.check_topk_args(hidden, weight, k, temperature)
    config = _config(hidden, weight, k, temperature, chunk_size, None)
    out = _forward(config, hidden.detach(), weight.detach(), None, k)
    return out.logprobs, out.topk_ids


def fused_linear_gather_logprobs(
    hidden: Tensor,
    weight: Tensor,
    ids: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    return_topk: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs at `ids` [T, K], chunked and differentiable in hidden and weight; see
    `ppo_kernels.fused_linear_gather_logprobs`. Under no_grad (or with no input requiring grad) nothing
    is saved."""
    chunked.check_gather_args(hidden, weight, ids, temperature, return_topk)
    config = _config(hidden, weight, ids.shape[1], temperature, chunk_size, vocab_chunk_size)
    ids = ids.long().contiguous()
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        out = _forward(config, hidden, weight, ids, ids.shape[1] if return_topk else None)
        return out.logprobs, out.topk_ids
    return _GatherLogprobs.apply(hidden, weight, ids, config, return_topk)
