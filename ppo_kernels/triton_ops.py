"""Triton primitives of the chunked log-prob algorithm (ppo_kernels/chunked.py), and the low-variance KL.

The chunk loops, GEMMs and autograd Functions live in `ppo_kernels/chunked.py`; this module supplies what
runs inside one chunk (`primitives()`), in Triton, with cuBLAS (torch.mm) doing the large GEMMs:

- `_logits_fwd_kernel`, statistics of logit rows: one program per token streams the row in BLOCK_V
  blocks with an online log-sum-exp in fp32 (running max m, s = sum e^(z-m), and t = sum e^(z-m) (z-m)
  for the entropy) in one pass, and writes logp, entropy, lse and mean_z = sum p z.
- `_logits_bwd_kernel`, d logits of a [rows, n] block of logits (a token chunk of the from-logits op,
  or a vocabulary chunk of the fused op, then in place): elementwise over [BLOCK_T, BLOCK_V] tiles.
- `_matmul_acc_kernel`, c (fp32) += a @ b for half-precision a and b: the fused backward's
  grad_hidden accumulation across vocabulary chunks, in place, with no [T, H] partial product (torch's
  addmm_ needs one dtype; its CUDA-only `out_dtype` variant changed its checks across releases and is
  not relied on). fp32 inputs use torch's addmm_ (cuBLAS).
- Low-variance KL (k3): elementwise forward and gradient.

Conventions: z = logits.float() / temperature; ignored tokens (label == ignore_index) give 0 and no
gradient; vocab lanes past V are -inf; program ids are cast to int64 before multiplying by strides.

On CPU these kernels run only under the Triton interpreter: `TRITON_INTERPRET=1` must be in the
environment before this module is imported (the `@triton.jit` decorators read it). The interpreter gets
bf16 arithmetic and bf16 `tl.dot` wrong, so tiles are upcast to fp32 before `tl.dot` there (`UPCAST`).

Run the tests with `.venv/bin/python -m pytest tests/unit/test_kernels.py` (CPU + interpreter, or CUDA).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from ppo_kernels.chunked import KL_LOG_RATIO_CLAMP, KL_VALUE_CLAMP, GradRows, Primitives, RowStats

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Finite start of the running max: (m - m_new) * s is then 0 * finite before the first block, where
# -inf would give nan. Logits are assumed to be far above -1e30.
_NEG_BIG = tl.constexpr(-1.0e30)

# d-logits tiles: ~8k elements per program on GPU; larger under the interpreter (~9 ms a program).
_GRAD_TILE = {"BLOCK_T": 16, "BLOCK_V": 512, "num_warps": 8}
_GRAD_TILE_INTERPRETER = {"BLOCK_T": 32, "BLOCK_V": 512, "num_warps": 4}
# grad_hidden accumulation (c += a @ b) launch parameters: fixed, because autotuning a kernel that
# does c += a @ b would add once more on every trial.
_ACC_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}
_ACC_CONFIG_INTERPRETER = {"BLOCK_M": 256, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1}
_KL_BLOCK = 1024


# ---------------------------------------------------------------------------------------------------
# Kernels.
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _logits_fwd_kernel(
    logits_ptr,
    labels_ptr,
    logprobs_ptr,
    entropy_ptr,
    lse_ptr,
    mean_z_ptr,
    V,
    stride_logits,
    temperature,
    ignore_index,
    COMPUTE_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One token per program: online log-sum-exp (and entropy) over BLOCK_V-wide blocks of the row."""
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(labels_ptr + row).to(tl.int64)
    valid = label != ignore_index
    row_ptr = logits_ptr + row * stride_logits
    m = _NEG_BIG
    s = 0.0
    t = 0.0
    # Ignored tokens (prompt tokens are often half of a batch) skip the vocabulary loop entirely.
    num_cols = tl.where(valid, V, 0)
    for start in range(0, num_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        in_vocab = cols < V
        z = tl.load(row_ptr + cols, mask=in_vocab, other=float("-inf")).to(tl.float32) / temperature
        m_new = tl.maximum(m, tl.max(z, axis=0))
        alpha = tl.exp(m - m_new)
        zs = z - m_new
        e = tl.exp(zs)
        if COMPUTE_ENTROPY:
            # t is relative to the running max: rescale it and shift it by (m - m_new) per unit of s.
            # Lanes past V: e = 0 and zs = -inf; zero zs first so 0 * -inf never makes a nan.
            t = alpha * (t + (m - m_new) * s) + tl.sum(e * tl.where(in_vocab, zs, 0.0), axis=0)
        s = alpha * s + tl.sum(e, axis=0)
        m = m_new
    s = tl.where(valid, s, 1.0)  # ignored rows: keep log and division finite, results are masked
    log_s = tl.log(s)
    lse = m + log_s
    target = tl.load(row_ptr + label, mask=valid, other=0.0).to(tl.float32) / temperature
    tl.store(logprobs_ptr + row, tl.where(valid, target - lse, 0.0))
    tl.store(lse_ptr + row, tl.where(valid, lse, 0.0))
    if COMPUTE_ENTROPY:
        mean_zs = t / s
        tl.store(entropy_ptr + row, tl.where(valid, log_s - mean_zs, 0.0))
        tl.store(mean_z_ptr + row, tl.where(valid, m + mean_zs, 0.0))


@triton.jit
def _logits_bwd_kernel(
    logits_ptr,
    grad_logits_ptr,
    labels_ptr,
    lse_ptr,
    mean_z_ptr,
    grad_logprobs_ptr,
    grad_entropy_ptr,
    T,
    V,
    stride_logits,
    stride_grad,
    col_offset,
    temperature,
    ignore_index,
    HAS_GRAD_ENTROPY: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """d logits = (g_lp (onehot - p) + g_H p (mean_z - z)) / temperature on one [BLOCK_T, BLOCK_V] tile.

    The block holds vocabulary columns col_offset .. col_offset + V of the full logits, so the one-hot
    column of a row is label - col_offset. Each program reads its tile before writing it, so
    grad_logits may be logits itself. Ignored rows come out 0.
    """
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < T
    col_ok = cols < V
    label = tl.load(labels_ptr + rows, mask=row_ok, other=ignore_index).to(tl.int64)
    valid = row_ok & (label != ignore_index)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    g_lp = tl.load(grad_logprobs_ptr + rows, mask=row_ok, other=0.0)
    tile = row_ok[:, None] & col_ok[None, :]
    z = tl.load(logits_ptr + rows[:, None] * stride_logits + cols[None, :], mask=tile, other=0.0)
    z = z.to(tl.float32) / temperature
    # Ignored rows (whose lse may be 0) and lanes past V: exp(-inf) = 0, every term finite.
    live = valid[:, None] & col_ok[None, :]
    p = tl.exp(tl.where(live, z - lse[:, None], float("-inf")))
    if HAS_GRAD_ENTROPY:
        g_ent = tl.load(grad_entropy_ptr + rows, mask=row_ok, other=0.0)
        mean_z = tl.load(mean_z_ptr + rows, mask=row_ok, other=0.0)
        coef = g_lp[:, None] + g_ent[:, None] * (z - mean_z[:, None])
    else:
        coef = g_lp[:, None]
    onehot = live & (cols[None, :] + col_offset == label[:, None])
    dz = tl.where(onehot, g_lp[:, None], 0.0) - p * coef
    out = (dz / temperature).to(grad_logits_ptr.dtype.element_ty)
    tl.store(grad_logits_ptr + rows[:, None] * stride_grad + cols[None, :], out, mask=tile)


@triton.jit
def _matmul_acc_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """c[M, N] (fp32) += a[M, K] @ b[K, N]; one program owns one c tile (deterministic, no atomics)."""
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)  # offs_k * stride_bk can pass 2**31
        a = tl.load(
            a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
            mask=(offs_m[:, None] < M) & (offs_k[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
            mask=(offs_k[:, None] < K) & (offs_n[None, :] < N),
            other=0.0,
        )
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptrs, tl.load(c_ptrs, mask=mask, other=0.0) + acc, mask=mask)


@triton.jit
def _low_var_kl_terms(logprobs_ptr, ref_ptr, offs, mask, LOG_RATIO_CLAMP):
    """(raw, x, e^x) of one block: raw = ref - logp, x = clamp(raw, +-LOG_RATIO_CLAMP), in fp32."""
    raw = tl.load(ref_ptr + offs, mask=mask, other=0.0).to(tl.float32) - tl.load(
        logprobs_ptr + offs, mask=mask, other=0.0
    ).to(tl.float32)
    x = tl.minimum(tl.maximum(raw, -LOG_RATIO_CLAMP), LOG_RATIO_CLAMP)
    return raw, x, tl.exp(x)


@triton.jit
def _low_var_kl_fwd_kernel(
    logprobs_ptr, ref_ptr, kl_ptr, n, LOG_RATIO_CLAMP, VALUE_CLAMP, BLOCK: tl.constexpr
):
    """kl = clamp(e^x - x - 1, -VALUE_CLAMP, VALUE_CLAMP), x = clamp(ref - logp, +-LOG_RATIO_CLAMP)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    _, x, ex = _low_var_kl_terms(logprobs_ptr, ref_ptr, offs, mask, LOG_RATIO_CLAMP)
    # e^x - 1 by exp, not expm1: libdevice calls raise under the interpreter; the fp32 cancellation
    # near x = 0 costs ~1e-7 absolute, far below anything the loss can see.
    kl = ex - x - 1.0
    tl.store(kl_ptr + offs, tl.minimum(tl.maximum(kl, -VALUE_CLAMP), VALUE_CLAMP), mask=mask)


@triton.jit
def _low_var_kl_grad_kernel(
    logprobs_ptr, ref_ptr, grad_kl_ptr, grad_x_ptr, n, LOG_RATIO_CLAMP, VALUE_CLAMP, BLOCK: tl.constexpr
):
    """d kl / dx = e^x - 1 (x = ref - logp), zero where either clamp is active (bounds included)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    raw, x, ex = _low_var_kl_terms(logprobs_ptr, ref_ptr, offs, mask, LOG_RATIO_CLAMP)
    kl = ex - x - 1.0
    live = (tl.abs(raw) <= LOG_RATIO_CLAMP) & (tl.abs(kl) <= VALUE_CLAMP)
    g = tl.load(grad_kl_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(grad_x_ptr + offs, tl.where(live, g * (ex - 1.0), 0.0), mask=mask)


# ---------------------------------------------------------------------------------------------------
# Primitives (contracts: `Primitives` in ppo_kernels/chunked.py).
# ---------------------------------------------------------------------------------------------------


def _logits_block(vocab_size: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) of the row-statistics kernel: whole row up to 4096 lanes per step."""
    block_v = min(4096, triton.next_power_of_2(vocab_size))
    return block_v, 8 if block_v >= 2048 else 4


def _check_inputs(*tensors: Tensor) -> None:
    for x in tensors:
        if x.dtype.is_floating_point and x.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"Triton kernels take fp16/bf16/fp32 inputs, got {x.dtype}")
        if x.device.type == "cpu" and not INTERPRETED:
            raise RuntimeError(
                "Triton kernels on CPU need the interpreter: set TRITON_INTERPRET=1 in the environment "
                "before importing kernels (or use backend='torch')"
            )


def _row_stats(
    logits: Tensor,
    labels: Tensor,
    out: RowStats,
    temperature: float,
    ignore_index: int,
    consume: bool,
    block_v: int | None = None,
) -> None:
    """Row statistics of [C, V] logits (row-contiguous) into `out`; never writes logits (`consume` unused)."""
    del consume
    num_rows, vocab_size = logits.shape
    if num_rows == 0:
        return
    default_block, num_warps = _logits_block(vocab_size)
    entropy = out.entropy is not None
    _logits_fwd_kernel[(num_rows,)](
        logits,
        labels,
        out.logprobs,
        out.entropy if entropy else out.logprobs,  # unused pointer when not computing entropy
        out.lse,
        out.mean_z if entropy else out.lse,
        vocab_size,
        logits.stride(0),
        temperature,
        ignore_index,
        COMPUTE_ENTROPY=entropy,
        BLOCK_V=block_v or default_block,
        num_warps=num_warps,
    )


def _logits_grad(logits: Tensor, out: Tensor, rows: GradRows, col_offset: int) -> None:
    """d logits of a [C, n] block into `out` (may be `logits`), in one launch over its tiles."""
    num_rows, num_cols = logits.shape
    if num_rows == 0 or num_cols == 0:
        return
    tile = _GRAD_TILE_INTERPRETER if INTERPRETED else _GRAD_TILE
    grid = (triton.cdiv(num_rows, tile["BLOCK_T"]), triton.cdiv(num_cols, tile["BLOCK_V"]))
    _logits_bwd_kernel[grid](
        logits,
        out,
        rows.labels,
        rows.lse,
        rows.lse if rows.g_ent is None else rows.mean_z,  # unused pointers without entropy gradient
        rows.g_lp,
        rows.g_lp if rows.g_ent is None else rows.g_ent,
        num_rows,
        num_cols,
        logits.stride(0),
        out.stride(0),
        col_offset,
        rows.temperature,
        rows.ignore_index,
        HAS_GRAD_ENTROPY=rows.g_ent is not None,
        **tile,
    )


def _accumulate_matmul(c: Tensor, a: Tensor, b: Tensor) -> None:
    """c (fp32) += a @ b: cuBLAS when a and b are fp32, else the Triton kernel (fp32 accumulator)."""
    if a.dtype == c.dtype:
        c.addmm_(a, b)
        return
    (m, k), n = a.shape, b.shape[1]
    if m == 0 or n == 0:
        return
    config = _ACC_CONFIG_INTERPRETER if INTERPRETED else _ACC_CONFIG
    grid = (triton.cdiv(m, config["BLOCK_M"]), triton.cdiv(n, config["BLOCK_N"]))
    _matmul_acc_kernel[grid](
        a,
        b,
        c,
        m,
        n,
        k,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        c.stride(1),
        UPCAST=INTERPRETED,  # the interpreter's half-precision tl.dot is silently wrong
        **config,
    )


def _kl_forward(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    kl = torch.empty(logprobs.shape, dtype=torch.float32, device=logprobs.device)
    n = logprobs.numel()
    if n > 0:
        _low_var_kl_fwd_kernel[(triton.cdiv(n, _KL_BLOCK),)](
            logprobs, ref_logprobs, kl, n, KL_LOG_RATIO_CLAMP, KL_VALUE_CLAMP, BLOCK=_KL_BLOCK
        )
    return kl


def _kl_grad(logprobs: Tensor, ref_logprobs: Tensor, grad_kl: Tensor) -> Tensor:
    grad_x = torch.empty(logprobs.shape, dtype=torch.float32, device=logprobs.device)
    n = logprobs.numel()
    if n > 0:
        _low_var_kl_grad_kernel[(triton.cdiv(n, _KL_BLOCK),)](
            logprobs, ref_logprobs, grad_kl, grad_x, n, KL_LOG_RATIO_CLAMP, KL_VALUE_CLAMP, BLOCK=_KL_BLOCK
        )
    return grad_x


@functools.cache
def primitives(block_v: int | None = None) -> Primitives:
    """The Triton primitives; `block_v` (a power of two) overrides the row kernel's block, for tests."""
    return Primitives(
        name="triton",
        row_stats=functools.partial(_row_stats, block_v=block_v),
        logits_grad=_logits_grad,
        accumulate_matmul=_accumulate_matmul,
        kl_forward=_kl_forward,
        kl_grad=_kl_grad,
        check_inputs=_check_inputs,
        compute_temporaries=0,
        upcasts_weight_chunk=False,
    )


# What the decorators above actually built: the interpreter's function type, or a compiled JITFunction.
INTERPRETED: bool = not isinstance(_low_var_kl_fwd_kernel, triton.runtime.JITFunction)
