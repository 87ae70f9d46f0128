"""Backend choice for the kernels ops: Triton on CUDA, chunked PyTorch elsewhere, or forced by name.

`backend` is what the trainer's config `actor.kernels` holds, passed straight through:

- "auto": Triton when the input is on CUDA in fp16/bf16/fp32 and triton imports (and is not in
  interpreter mode), else the chunked PyTorch path.
- "triton": the Triton kernels; on CPU only under the interpreter (TRITON_INTERPRET=1 set before
  import), else RuntimeError at the first call (`backend_unavailable` says so up front, for a start-up
  check). Needs the triton package, which is imported lazily so that importing `ppo_kernels` works without it.
- "torch": the chunked PyTorch path. "reference": the naive full-tensor formulas.

`fused_linear_topk` and `fused_linear_gather_logprobs` have no Triton kernel (`ppo_kernels/topk.py`
says why): every backend but "reference" runs their chunked PyTorch code.

Beyond the names, `backend` may be a `ppo_kernels.chunked.Primitives` instance: the chunked algorithm on
those primitives (tests use Triton with narrow blocks, `ppo_kernels.triton_ops.primitives(block_v=256)`).
"""

from __future__ import annotations

import functools
import types

import torch
from torch import Tensor

from ppo_kernels import chunked, topk, torch_ops
from ppo_kernels.chunked import IGNORE_INDEX

BACKENDS = ("auto", "triton", "torch", "reference")


@functools.cache
def _import_triton_ops() -> types.ModuleType | ImportError:
    """`ppo_kernels.triton_ops`, or the ImportError that importing it raised (cached either way)."""
    try:
        from ppo_kernels import triton_ops
    except ImportError as exc:
        return exc
    return triton_ops


def _triton_ops() -> types.ModuleType:
    """The Triton module for a forced backend="triton", or a RuntimeError that says why not."""
    module = _import_triton_ops()
    if isinstance(module, ImportError):
        raise RuntimeError(f"backend='triton' needs the triton package ({module}); use backend='torch'")
    return module


def backend_unavailable(backend: str, device: torch.device | str) -> str | None:
    """Why a forced `backend` cannot run the ops on `device`, or None when it can ("auto", "torch" and
    "reference" run everywhere). For a start-up check: the ops themselves fail only at their first call."""
    if backend != "triton":
        return None
    module = _import_triton_ops()
    if isinstance(module, ImportError):
        return f"the Triton kernels need the triton package ({module})"
    if torch.device(device).type != "cuda" and not module.INTERPRETED:
        return (
            f"the Triton kernels need CUDA, and the device is {torch.device(device).type} (on CPU they run only "
            "under the Triton interpreter: TRITON_INTERPRET=1 in the environment, for tests)"
        )
    return None


def resolve_backend(backend: str, x: Tensor) -> str:
    """The concrete backend ("triton", "torch" or "reference") that runs an op on input `x`."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernels backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    if x.device.type != "cuda" or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return "torch"
    module = _import_triton_ops()
    # Interpreter mode on a CUDA tensor would run but crawl: the chunked torch path is faster.
    return "triton" if not isinstance(module, ImportError) and not module.INTERPRETED else "torch"


def _primitives(backend: str | chunked.Primitives, x: Tensor) -> chunked.Primitives | None:
    """The per-chunk primitives that run an op on input `x`; None for the reference."""
    if isinstance(backend, chunked.Primitives):
        return backend
    name = resolve_backend(backend, x)
    if name == "reference":
        return None
    return torch_ops.TORCH if name == "torch" else _triton_ops().primitives()


def logprobs_from_logits(
    logits: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    chunk_size: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    backend: str | chunked.Primitives = "auto",
) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs of `labels` and entropy under softmax(logits / temperature).

    logp[t] = z[t, label[t]] - logsumexp(z[t]),  entropy[t] = logsumexp(z[t]) - sum_v p z,
    z = logits.float() / temperature. Ignored tokens (label == ignore_index) give 0 and no gradient.
    Differentiable in logits through both outputs; under no_grad nothing is saved.

    Args:
        logits: [T, V] fp16/bf16/fp32 (fp64 runs on the torch paths).
        labels: [T] int (see `next_token_labels`).
        chunk_size: tokens per chunk of the torch path (default: 64 MiB of temporaries on CPU).

    Returns:
        logprobs [T] fp32 and entropy [T] fp32, or None when compute_entropy is False.
    """
    prims = _primitives(backend, logits)
    if prims is None:
        return torch_ops.logprobs_from_logits_reference(
            logits,
            labels,
            temperature=temperature,
            compute_entropy=compute_entropy,
            ignore_index=ignore_index,
        )
    config = chunked.OpConfig(prims, float(temperature), compute_entropy, ignore_index, chunk_size)
    return chunked.logprobs_from_logits(logits, labels, config)


def fused_linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    backend: str | chunked.Primitives = "auto",
) -> tuple[Tensor, Tensor | None]:
    """`logprobs_from_logits(hidden @ weight.T, ...)` without ever holding the [T, V] logits.

    The forward computes the logits `chunk_size` tokens at a time (one GEMM each, in the input dtype
    like the naive LM head) and keeps [T] statistics; the backward walks `vocab_chunk_size` rows of the
    weight at a time, so grad_weight is written once per chunk and grad_hidden accumulates in fp32.
    Both chunks default to 256 MiB of temporaries on CUDA, 64 MiB elsewhere; `ppo_kernels.chunked`
    documents the algorithm and its peak memory (`fused_memory_plan`). The GEMMs are torch matmuls
    (cuBLAS): fp32 inputs follow torch's fp32 matmul precision (TF32 only if enabled).

    Args:
        hidden: [T, H] final hidden states (after the last norm).
        weight: [V, H] LM-head weight, same dtype as hidden.
        labels: [T] int.
        chunk_size: tokens per forward chunk. vocab_chunk_size: vocabulary rows per backward chunk.

    Returns:
        logprobs [T] fp32 and entropy [T] fp32 or None; gradients flow to hidden and weight.
    """
    prims = _primitives(backend, hidden)
    if prims is None:
        return torch_ops.fused_linear_logprobs_reference(
            hidden,
            weight,
            labels,
            temperature=temperature,
            compute_entropy=compute_entropy,
            ignore_index=ignore_index,
        )
    config = chunked.OpConfig(
        prims, float(temperature), compute_entropy, ignore_index, chunk_size, vocab_chunk_size
    )
    return chunked.fused_linear_logprobs(hidden, weight, labels, config)


def _topk_reference(backend: str | chunked.Primitives, x: Tensor) -> bool:
    """Whether a top-k op runs its reference (else its chunked torch code, whatever the fast backend)."""
    return not isinstance(backend, chunked.Primitives) and resolve_backend(backend, x) == "reference"


def fused_linear_topk(
    hidden: Tensor,
    weight: Tensor,
    k: int,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    backend: str | chunked.Primitives = "auto",
) -> tuple[Tensor, Tensor]:
    """Top-k log-probs per token of softmax(z), z = (hidden @ weight^T).float() / temperature, without
    ever holding the [T, V] logits. For on-policy distillation: the teacher's top-k, the student's own.

    logprobs[t, j] = z[t, ids[t, j]] - logsumexp(z[t]) over the k largest z[t], sorted descending like
    `torch.topk` (ids are torch.topk's on the fp32 z; `ppo_kernels.topk` says how ties are ordered).
    Computed `chunk_size` tokens at a time, one GEMM per chunk in the input dtype. No gradient: the
    outputs are detached. There is no Triton kernel: every backend but "reference" runs the chunked
    PyTorch path (the GEMMs are cuBLAS either way; `ppo_kernels.topk` has the peak memory).

    Args:
        hidden: [T, H] final hidden states. weight: [V, H] LM-head weight, same dtype.
        k: 1 <= k <= V.
        chunk_size: tokens per chunk (default: [chunk, V] temporaries within 256 MiB on CUDA, 64 MiB else).

    Returns:
        logprobs [T, k] fp32 (fp64 for fp64 inputs) and ids [T, k] int64.
    """
    if _topk_reference(backend, hidden):
        return torch_ops.fused_linear_topk_reference(hidden, weight, k, temperature=temperature)
    return topk.fused_linear_topk(hidden, weight, k, temperature=temperature, chunk_size=chunk_size)


def fused_linear_gather_logprobs(
    hidden: Tensor,
    weight: Tensor,
    ids: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    return_topk: bool = False,
    backend: str | chunked.Primitives = "auto",
) -> tuple[Tensor, Tensor | None]:
    """Log-probs at given ids, logprobs[t, j] = z[t, ids[t, j]] - logsumexp(z[t]), z = (hidden @
    weight^T).float() / temperature, differentiable in hidden and weight, without holding [T, V].

    d loss / d z = scatter_add(g at ids) - (sum_j g[t, j]) softmax(z[t]), g = d loss / d logprobs. The
    forward keeps only [T] logsumexp; the backward recomputes the logits `vocab_chunk_size` vocabulary
    rows at a time, like `fused_linear_logprobs` (peak memory: `ppo_kernels.topk`). There is no Triton
    kernel: every backend but "reference" runs the chunked PyTorch path.

    Args:
        hidden: [T, H] final hidden states. weight: [V, H] LM-head weight, same dtype.
        ids: [T, K] integer vocabulary ids, valid everywhere (pass 0 on ignored rows and mask the result).
        chunk_size: tokens per forward chunk. vocab_chunk_size: vocabulary rows per backward chunk.
        return_topk: also return the student's own top-K ids, found in the same forward chunks.

    Returns:
        logprobs [T, K] fp32 (fp64 for fp64 inputs) and own top-K ids [T, K] int64 (or None).
    """
    if _topk_reference(backend, hidden):
        return torch_ops.fused_linear_gather_logprobs_reference(
            hidden, weight, ids, temperature=temperature, return_topk=return_topk
        )
    return topk.fused_linear_gather_logprobs(
        hidden,
        weight,
        ids,
        temperature=temperature,
        chunk_size=chunk_size,
        vocab_chunk_size=vocab_chunk_size,
        return_topk=return_topk,
    )


def low_var_kl(logprobs: Tensor, ref_logprobs: Tensor, backend: str | chunked.Primitives = "auto") -> Tensor:
    """Per-token k3 KL estimate: x = clamp(ref - logp, -20, 20), kl = clamp(e^x - x - 1, -10, 10).

    Equals `ppo.algorithms.kl_penalty(logprobs, ref_logprobs, "low_var_kl")` in value and gradient
    (fp32 inputs). The gradient is zero where either clamp is active. Shapes: any, equal (usually
    [T]); fp32 output (fp64 for fp64 inputs on the torch paths).
    """
    prims = _primitives(backend, logprobs)
    if prims is None:
        return torch_ops.low_var_kl_reference(logprobs, ref_logprobs)
    return chunked.low_var_kl(logprobs, ref_logprobs, prims)
