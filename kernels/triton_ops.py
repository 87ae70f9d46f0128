"""Triton kernels for log-probs, entropy and low-variance KL, forward and backward.

Three ops, each a `torch.autograd.Function` over one or two kernels:

- From logits [T, V]: one program per token streams the vocabulary in BLOCK_V blocks and keeps an
  online log-sum-exp in fp32 (running max m, s = sum e^(z-m), and t = sum e^(z-m) (z-m) for the entropy)
  in the same pass. Backward writes d logits into a new buffer.
- Fused with the LM head, hidden [T, H] and weight [V, H]: a [BLOCK_T, BLOCK_V] logits tile is a tiled
  matmul with fp32 accumulation that lives in registers only. The forward grid is
  (token blocks, vocab splits); each program folds its split's tiles into per-row partials
  (max, sum-exp, entropy term, target logit) that a small torch epilogue merges. The backward recomputes
  every tile with the same `_logits_tile` code and block sizes, writes d logits for one chunk of tokens
  ([chunk, V], input dtype; never [T, V]), then grad_hidden = dz @ W (cuBLAS) and
  grad_weight += dz^T @ hidden (a Triton kernel accumulating in an fp32 [V, H] buffer across chunks,
  deterministic: each output tile has one owner, no atomics).
- Low-variance KL (k3): elementwise forward and backward.

Conventions: z = logits.float() / temperature; ignored tokens (label == ignore_index) give 0 and no
gradient; vocab lanes past V are -inf; program ids are cast to int64 before multiplying by strides.

On CPU these kernels run only under the Triton interpreter: `TRITON_INTERPRET=1` must be in the
environment before this module is imported (the `@triton.jit` decorators read it). The interpreter gets
bf16 arithmetic and bf16 `tl.dot` wrong, so tiles are upcast to fp32 before `tl.dot` there (`UPCAST`),
and it cannot autotune over several configs, so it uses one.

Run the tests with `.venv/bin/python -m pytest tests/test_kernels.py` (CPU + interpreter, or CUDA).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.torch_ops import (
    IGNORE_INDEX,
    KL_LOG_RATIO_CLAMP,
    KL_VALUE_CLAMP,
    _check_linear_args,
    _check_logits_args,
)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Finite start of the running max: (m - m_new) * s is then 0 * finite before the first block, where
# -inf would give nan. Logits are assumed to be far above -1e30.
_NEG_BIG = tl.constexpr(-1.0e30)


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Tile shape of the fused LM-head kernels (forward and backward must use the same one)."""

    block_t: int
    """Tokens per tile."""
    block_v: int
    """Vocabulary entries per tile."""
    block_h: int
    """Hidden features per step of the matmul's inner loop."""
    num_warps: int = 4
    num_stages: int = 3


# One config under the interpreter (autotune over several fails there); a few on GPU.
_INTERPRETER_TILE = TileConfig(block_t=32, block_v=256, block_h=64, num_warps=4, num_stages=1)
_GPU_TILES = (
    TileConfig(block_t=64, block_v=128, block_h=64, num_warps=4, num_stages=3),
    TileConfig(block_t=128, block_v=128, block_h=64, num_warps=8, num_stages=3),
    TileConfig(block_t=64, block_v=256, block_h=64, num_warps=8, num_stages=3),
    TileConfig(block_t=128, block_v=256, block_h=64, num_warps=8, num_stages=3),
)
# grad_weight accumulation ([V, H] output) launch parameters: fixed, because autotuning a kernel that
# does c += a @ b would add once more on every trial. fp32 tiles use 2 stages to fit A100's shared memory.
_ACC_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}
_ACC_CONFIG_FP32 = {**_ACC_CONFIG, "num_stages": 2}
_ACC_CONFIG_INTERPRETER = {"BLOCK_M": 256, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1}
# Backward d-logits chunk on GPU: about 1 GiB, so the fp32 grad_weight read-modify-write per chunk
# stays small next to the chunk's matmul.
_GPU_DZ_BYTES = 1 << 30


# ---------------------------------------------------------------------------------------------------
# From logits.
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
    labels_ptr,
    lse_ptr,
    mean_z_ptr,
    grad_logprobs_ptr,
    grad_entropy_ptr,
    grad_logits_ptr,
    V,
    stride_logits,
    stride_grad,
    temperature,
    ignore_index,
    HAS_GRAD_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """d logits = (g_lp (onehot - p) + g_H p (sum p z - z)) / temperature, one token per program."""
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(labels_ptr + row).to(tl.int64)
    valid = label != ignore_index
    row_ptr = logits_ptr + row * stride_logits
    grad_row_ptr = grad_logits_ptr + row * stride_grad
    lse = tl.load(lse_ptr + row)
    g_lp = tl.load(grad_logprobs_ptr + row)
    if HAS_GRAD_ENTROPY:
        g_ent = tl.load(grad_entropy_ptr + row)
        mean_z = tl.load(mean_z_ptr + row)
    num_cols = tl.where(valid, V, 0)
    for start in range(0, num_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        in_vocab = cols < V
        z = tl.load(row_ptr + cols, mask=in_vocab, other=0.0).to(tl.float32) / temperature
        p = tl.where(in_vocab, tl.exp(z - lse), 0.0)  # lanes past V: p = 0, all terms finite
        if HAS_GRAD_ENTROPY:
            coef = g_lp + g_ent * (z - mean_z)
        else:
            coef = g_lp
        dz = tl.where(cols == label, g_lp, 0.0) - p * coef
        out = (dz / temperature).to(grad_logits_ptr.dtype.element_ty)
        tl.store(grad_row_ptr + cols, out, mask=in_vocab)
    # Ignored rows get zeros, written once (no separate memset of the whole buffer).
    for start in range(0, V - num_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        zeros = tl.zeros([BLOCK_V], dtype=tl.float32).to(grad_logits_ptr.dtype.element_ty)
        tl.store(grad_row_ptr + cols, zeros, mask=cols < V)


def _logits_block(vocab_size: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) of the from-logits kernels: whole row up to 4096 lanes per step."""
    block_v = min(4096, triton.next_power_of_2(vocab_size))
    return block_v, 8 if block_v >= 2048 else 4


def _check_device(*tensors: Tensor) -> None:
    for x in tensors:
        if x.dtype.is_floating_point and x.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"Triton kernels take fp16/bf16/fp32 inputs, got {x.dtype}")
        if x.device.type == "cpu" and not INTERPRETED:
            raise RuntimeError(
                "Triton kernels on CPU need the interpreter: set TRITON_INTERPRET=1 in the environment "
                "before importing kernels (or use backend='torch')"
            )


def _logits_forward(
    logits: Tensor, labels: Tensor, temperature: float, compute_entropy: bool, ignore_index: int, block_v: int
) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
    num_tokens = logits.shape[0]
    logprobs = torch.empty(num_tokens, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(logprobs)
    entropy = torch.empty_like(logprobs) if compute_entropy else None
    mean_z = torch.empty_like(logprobs) if compute_entropy else None
    if num_tokens > 0:
        _, num_warps = _logits_block(logits.shape[1])
        _logits_fwd_kernel[(num_tokens,)](
            logits,
            labels,
            logprobs,
            entropy if compute_entropy else logprobs,  # unused pointer when not computing entropy
            lse,
            mean_z if compute_entropy else logprobs,
            logits.shape[1],
            logits.stride(0),
            temperature,
            ignore_index,
            COMPUTE_ENTROPY=compute_entropy,
            BLOCK_V=block_v,
            num_warps=num_warps,
        )
    return logprobs, entropy, lse, mean_z


class _LogprobsFromLogits(torch.autograd.Function):
    """Triton log-probs/entropy from logits; saves logits (a reference) and [T] statistics."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        logits: Tensor,
        labels: Tensor,
        temperature: float,
        compute_entropy: bool,
        ignore_index: int,
        block_v: int,
    ) -> tuple[Tensor, Tensor | None]:
        logprobs, entropy, lse, mean_z = _logits_forward(
            logits, labels, temperature, compute_entropy, ignore_index, block_v
        )
        ctx.save_for_backward(logits, labels, lse, mean_z)
        ctx.temperature, ctx.ignore_index, ctx.block_v = temperature, ignore_index, block_v
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_logprobs: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        logits, labels, lse, mean_z = ctx.saved_tensors
        g_lp = torch.zeros_like(lse) if grad_logprobs is None else grad_logprobs.float().contiguous()
        g_ent = None if grad_entropy is None else grad_entropy.float().contiguous()
        # A new buffer, never in place over logits that autograd or the caller may still read.
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        if logits.shape[0] > 0:
            _, num_warps = _logits_block(logits.shape[1])
            _logits_bwd_kernel[(logits.shape[0],)](
                logits,
                labels,
                lse,
                lse if g_ent is None else mean_z,
                g_lp,
                g_lp if g_ent is None else g_ent,
                grad_logits,
                logits.shape[1],
                logits.stride(0),
                grad_logits.stride(0),
                ctx.temperature,
                ctx.ignore_index,
                HAS_GRAD_ENTROPY=g_ent is not None,
                BLOCK_V=ctx.block_v,
                num_warps=num_warps,
            )
        return grad_logits, None, None, None, None, None


def logprobs_from_logits_triton(
    logits: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    chunk_size: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    block_v: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Triton log-probs and entropy from logits [T, V] -> ([T] fp32, [T] fp32 | None).

    Same contract as `logprobs_from_logits_reference`. `chunk_size` is accepted for a uniform signature
    and unused (the kernel streams one row at a time); `block_v` (power of two) overrides the block width,
    for tests. Inputs fp16/bf16/fp32; outputs fp32.
    """
    del chunk_size
    _check_logits_args(logits, labels, temperature)
    _check_device(logits)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    labels = labels.contiguous()
    block_v = block_v or _logits_block(logits.shape[1])[0]
    if not (torch.is_grad_enabled() and logits.requires_grad):
        logprobs, entropy, _, _ = _logits_forward(
            logits, labels, float(temperature), compute_entropy, ignore_index, block_v
        )
        return logprobs, entropy
    return _LogprobsFromLogits.apply(
        logits, labels, float(temperature), compute_entropy, ignore_index, block_v
    )


# ---------------------------------------------------------------------------------------------------
# Fused with the LM head.
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _logits_tile(
    hidden_ptr,
    weight_ptr,
    offs_t,
    offs_v,
    T,
    V,
    H,
    stride_ht,
    stride_hh,
    stride_wv,
    stride_wh,
    temperature,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
    """z[BLOCK_T, BLOCK_V] = (hidden[offs_t] @ weight[offs_v]^T) / temperature, fp32 accumulation.

    Forward and backward both call this with the same constexprs, so the recomputed logits are the
    forward's bit for bit. Lanes past V are -inf (they vanish from every softmax sum).
    """
    acc = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
    row_ok = offs_t[:, None] < T
    col_ok = offs_v[None, :] < V
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h = tl.load(
            hidden_ptr + offs_t[:, None] * stride_ht + offs_h[None, :] * stride_hh,
            mask=row_ok & (offs_h[None, :] < H),
            other=0.0,
        )
        w = tl.load(
            weight_ptr + offs_v[None, :] * stride_wv + offs_h[:, None] * stride_wh,
            mask=col_ok & (offs_h[:, None] < H),
            other=0.0,
        )
        if UPCAST:
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        if IEEE_FP32:
            acc = tl.dot(h, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(h, w, acc)
    z = acc / temperature
    return tl.where(col_ok, z, float("-inf"))


@triton.jit
def _fused_fwd_kernel(
    hidden_ptr,
    weight_ptr,
    labels_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_ent_ptr,
    part_target_ptr,
    T,
    V,
    H,
    stride_ht,
    stride_hh,
    stride_wv,
    stride_wh,
    temperature,
    num_splits,
    COMPUTE_ENTROPY: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
    """Program (token block, vocab split): per-row partials over the split's vocabulary tiles.

    Writes, at [split, t]: max m, s = sum e^(z-m), t = sum e^(z-m) (z-m) (if COMPUTE_ENTROPY), and the
    target logit z[label] (0 when the label is outside the split, so the splits sum to it).
    """
    pid_t = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1).to(tl.int64)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = offs_t < T
    labels = tl.load(labels_ptr + offs_t, mask=row_ok, other=-1).to(tl.int64)
    tiles_per_split = tl.cdiv(tl.cdiv(V, BLOCK_V), num_splits)
    v_begin = split * tiles_per_split * BLOCK_V
    v_end = tl.minimum(v_begin + tiles_per_split * BLOCK_V, V)
    m = tl.full((BLOCK_T,), _NEG_BIG, dtype=tl.float32)
    s = tl.zeros((BLOCK_T,), dtype=tl.float32)
    t = tl.zeros((BLOCK_T,), dtype=tl.float32)
    target = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for v0 in range(v_begin, v_end, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        z = _logits_tile(
            hidden_ptr,
            weight_ptr,
            offs_t,
            offs_v,
            T,
            V,
            H,
            stride_ht,
            stride_hh,
            stride_wv,
            stride_wh,
            temperature,
            BLOCK_T,
            BLOCK_V,
            BLOCK_H,
            UPCAST,
            IEEE_FP32,
        )
        m_new = tl.maximum(m, tl.max(z, axis=1))
        alpha = tl.exp(m - m_new)
        zs = z - m_new[:, None]
        e = tl.exp(zs)
        if COMPUTE_ENTROPY:
            zs_in_vocab = tl.where(offs_v[None, :] < V, zs, 0.0)  # 0 * -inf would be nan
            t = alpha * (t + (m - m_new) * s) + tl.sum(e * zs_in_vocab, axis=1)
        s = alpha * s + tl.sum(e, axis=1)
        target += tl.sum(tl.where(offs_v[None, :] == labels[:, None], z, 0.0), axis=1)
        m = m_new
    out = split * T + offs_t
    tl.store(part_max_ptr + out, m, mask=row_ok)
    tl.store(part_sum_ptr + out, s, mask=row_ok)
    tl.store(part_target_ptr + out, target, mask=row_ok)
    if COMPUTE_ENTROPY:
        tl.store(part_ent_ptr + out, t, mask=row_ok)


@triton.jit
def _fused_bwd_kernel(
    hidden_ptr,
    weight_ptr,
    labels_ptr,
    lse_ptr,
    mean_z_ptr,
    grad_logprobs_ptr,
    grad_entropy_ptr,
    grad_logits_ptr,
    T,
    V,
    H,
    stride_ht,
    stride_hh,
    stride_wv,
    stride_wh,
    stride_gt,
    temperature,
    HAS_GRAD_ENTROPY: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
    """d logits of one [BLOCK_T, BLOCK_V] tile of a token chunk, logits recomputed as in the forward.

    The gradients of ignored tokens arrive zeroed, so their rows come out 0 without a label test.
    """
    pid_t = tl.program_id(0).to(tl.int64)
    pid_v = tl.program_id(1).to(tl.int64)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    z = _logits_tile(
        hidden_ptr,
        weight_ptr,
        offs_t,
        offs_v,
        T,
        V,
        H,
        stride_ht,
        stride_hh,
        stride_wv,
        stride_wh,
        temperature,
        BLOCK_T,
        BLOCK_V,
        BLOCK_H,
        UPCAST,
        IEEE_FP32,
    )
    row_ok = offs_t < T
    labels = tl.load(labels_ptr + offs_t, mask=row_ok, other=-1).to(tl.int64)
    lse = tl.load(lse_ptr + offs_t, mask=row_ok, other=0.0)
    g_lp = tl.load(grad_logprobs_ptr + offs_t, mask=row_ok, other=0.0)
    p = tl.exp(z - lse[:, None])
    if HAS_GRAD_ENTROPY:
        g_ent = tl.load(grad_entropy_ptr + offs_t, mask=row_ok, other=0.0)
        mean_z = tl.load(mean_z_ptr + offs_t, mask=row_ok, other=0.0)
        # Lanes past V have p = 0 but z = -inf: zero their centred logit so p * coef stays finite.
        z_centred = tl.where(offs_v[None, :] < V, z - mean_z[:, None], 0.0)
        coef = g_lp[:, None] + g_ent[:, None] * z_centred
    else:
        coef = g_lp[:, None]
    dz = tl.where(offs_v[None, :] == labels[:, None], g_lp[:, None], 0.0) - p * coef
    out = (dz / temperature).to(grad_logits_ptr.dtype.element_ty)
    mask = row_ok[:, None] & (offs_v[None, :] < V)
    tl.store(grad_logits_ptr + offs_t[:, None] * stride_gt + offs_v[None, :], out, mask=mask)


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
    IEEE_FP32: tl.constexpr,
):
    """c[M, N] (fp32) += a[M, K] @ b[K, N]; one program owns one c tile (deterministic, no atomics)."""
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
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
        if IEEE_FP32:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptrs, tl.load(c_ptrs, mask=mask, other=0.0) + acc, mask=mask)


@functools.cache
def _autotuned_fwd_kernel() -> triton.runtime.Autotuner:
    """`_fused_fwd_kernel` autotuned over `_GPU_TILES`, keyed on H, V, COMPUTE_ENTROPY and the dtypes.

    Safe to autotune: the kernel only writes its partials, so re-running a trial changes nothing.
    """
    configs = [
        triton.Config(
            {"BLOCK_T": c.block_t, "BLOCK_V": c.block_v, "BLOCK_H": c.block_h},
            num_warps=c.num_warps,
            num_stages=c.num_stages,
        )
        for c in _GPU_TILES
    ]
    return triton.autotune(configs=configs, key=["H", "V", "COMPUTE_ENTROPY"])(_fused_fwd_kernel)


def _kernel_flags(dtype: torch.dtype) -> dict[str, bool]:
    """Constexprs of the matmul kernels.

    UPCAST: fp32 tiles before tl.dot under the interpreter (its bf16 dot is silently wrong).
    IEEE_FP32: fp32 inputs get a full-precision dot, not the GPU default TF32 (10-bit mantissa).
    """
    return {"UPCAST": INTERPRETED, "IEEE_FP32": dtype == torch.float32}


def _default_num_splits(num_tokens: int, vocab_size: int, device: torch.device) -> int:
    """Vocab splits of the forward grid: enough programs to fill the GPU, 1 under the interpreter."""
    if INTERPRETED or device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    token_blocks = triton.cdiv(num_tokens, 64)
    return max(1, min(triton.cdiv(4 * sms, token_blocks), triton.cdiv(vocab_size, 1024)))


def _fused_forward(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    temperature: float,
    compute_entropy: bool,
    ignore_index: int,
    tile: TileConfig | None,
    num_splits: int,
) -> tuple[tuple[Tensor, Tensor | None, Tensor, Tensor | None], TileConfig]:
    """Forward kernel + torch epilogue. Returns ((logprobs, entropy, lse, mean_z), tile used)."""
    (num_tokens, hidden_size), vocab_size = hidden.shape, weight.shape[0]
    parts = torch.empty(4, num_splits, num_tokens, dtype=torch.float32, device=hidden.device)
    part_max, part_sum, part_ent, part_target = parts.unbind(0)
    args = (
        hidden,
        weight,
        labels,
        part_max,
        part_sum,
        part_ent,
        part_target,
        num_tokens,
        vocab_size,
        hidden_size,
        hidden.stride(0),
        hidden.stride(1),
        weight.stride(0),
        weight.stride(1),
        temperature,
        num_splits,
    )
    flags = {"COMPUTE_ENTROPY": compute_entropy, **_kernel_flags(hidden.dtype)}
    if tile is None and not INTERPRETED:
        kernel = _autotuned_fwd_kernel()
        kernel[lambda meta: (triton.cdiv(num_tokens, meta["BLOCK_T"]), num_splits)](*args, **flags)
        best = kernel.best_config
        tile = TileConfig(
            block_t=best.kwargs["BLOCK_T"],
            block_v=best.kwargs["BLOCK_V"],
            block_h=best.kwargs["BLOCK_H"],
            num_warps=best.num_warps,
            num_stages=best.num_stages,
        )
    else:
        tile = tile or _INTERPRETER_TILE
        _fused_fwd_kernel[(triton.cdiv(num_tokens, tile.block_t), num_splits)](
            *args,
            **flags,
            BLOCK_T=tile.block_t,
            BLOCK_V=tile.block_v,
            BLOCK_H=tile.block_h,
            num_warps=tile.num_warps,
            num_stages=tile.num_stages,
        )
    # Epilogue: merge the splits' partials, each relative to its own max, into per-token statistics.
    big_m = part_max.amax(0)
    scale = torch.exp(part_max - big_m)
    s = (scale * part_sum).sum(0)
    log_s = s.log()
    lse = big_m + log_s
    valid = labels != ignore_index
    logprobs = torch.where(valid, part_target.sum(0) - lse, 0.0)
    entropy = mean_z = None
    if compute_entropy:
        mean_zs = (scale * (part_ent + (part_max - big_m) * part_sum)).sum(0) / s
        entropy = torch.where(valid, log_s - mean_zs, 0.0)
        mean_z = big_m + mean_zs
    return (logprobs, entropy, lse, mean_z), tile


def _accumulate_matmul(c: Tensor, a: Tensor, b: Tensor) -> None:
    """c[M, N] fp32 += a[M, K] @ b[K, N] (any strides) with the Triton accumulation kernel."""
    (m, k), n = a.shape, b.shape[1]
    if INTERPRETED:
        config = _ACC_CONFIG_INTERPRETER
    else:
        config = _ACC_CONFIG_FP32 if a.dtype == torch.float32 else _ACC_CONFIG
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
        **_kernel_flags(a.dtype),
        **config,
    )


class _FusedLinearLogprobs(torch.autograd.Function):
    """Triton LM head + log-probs; saves hidden, weight (references) and [T] statistics."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        temperature: float,
        compute_entropy: bool,
        chunk_size: int | None,
        ignore_index: int,
        tile: TileConfig | None,
        num_splits: int,
    ) -> tuple[Tensor, Tensor | None]:
        (logprobs, entropy, lse, mean_z), tile = _fused_forward(
            hidden, weight, labels, temperature, compute_entropy, ignore_index, tile, num_splits
        )
        ctx.save_for_backward(hidden, weight, labels, lse, mean_z)
        ctx.temperature, ctx.chunk_size, ctx.ignore_index, ctx.tile = (
            temperature,
            chunk_size,
            ignore_index,
            tile,
        )
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_logprobs: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        hidden, weight, labels, lse, mean_z = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        tile: TileConfig = ctx.tile
        (num_tokens, hidden_size), vocab_size = hidden.shape, weight.shape[0]
        valid = labels != ctx.ignore_index
        # Zeroed gradients of ignored tokens make their d logits rows 0 inside the kernel.
        g_lp = (
            torch.zeros_like(lse) if grad_logprobs is None else torch.where(valid, grad_logprobs.float(), 0.0)
        )
        g_ent = None if grad_entropy is None else torch.where(valid, grad_entropy.float(), 0.0)
        chunk = _backward_chunk(ctx.chunk_size, num_tokens, vocab_size, hidden.dtype, tile, hidden.device)
        grad_logits = torch.empty(
            min(chunk, num_tokens), vocab_size, dtype=hidden.dtype, device=hidden.device
        )
        grad_hidden = (
            torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_hidden else None
        )
        # grad_weight sums over chunks: an fp32 accumulator, cast to the weight dtype once at the end.
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        )
        flags = _kernel_flags(hidden.dtype)
        for start in range(0, num_tokens, chunk):
            rows = slice(start, min(start + chunk, num_tokens))
            n = rows.stop - rows.start
            h_chunk, dz = hidden[rows], grad_logits[:n]
            _fused_bwd_kernel[(triton.cdiv(n, tile.block_t), triton.cdiv(vocab_size, tile.block_v))](
                h_chunk,
                weight,
                labels[rows],
                lse[rows],
                lse[rows] if g_ent is None else mean_z[rows],
                g_lp[rows],
                g_lp[rows] if g_ent is None else g_ent[rows],
                dz,
                n,
                vocab_size,
                hidden_size,
                h_chunk.stride(0),
                h_chunk.stride(1),
                weight.stride(0),
                weight.stride(1),
                dz.stride(0),
                ctx.temperature,
                HAS_GRAD_ENTROPY=g_ent is not None,
                BLOCK_T=tile.block_t,
                BLOCK_V=tile.block_v,
                BLOCK_H=tile.block_h,
                **flags,
                num_warps=tile.num_warps,
                num_stages=tile.num_stages,
            )
            if need_hidden:
                grad_hidden[rows] = dz @ weight
            if need_weight:
                _accumulate_matmul(grad_weight, dz.T, h_chunk)
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def _backward_chunk(
    chunk_size: int | None,
    num_tokens: int,
    vocab_size: int,
    dtype: torch.dtype,
    tile: TileConfig,
    device: torch.device,
) -> int:
    """Tokens per backward chunk: a multiple of BLOCK_T, so tiles are the forward's tiles."""
    if chunk_size is None:
        if device.type == "cuda" and not INTERPRETED:
            chunk_size = _GPU_DZ_BYTES // (vocab_size * torch.finfo(dtype).bits // 8)
        else:
            chunk_size = 1024
    chunk = max(tile.block_t, chunk_size // tile.block_t * tile.block_t)
    return min(chunk, triton.cdiv(max(num_tokens, 1), tile.block_t) * tile.block_t)


def fused_linear_logprobs_triton(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    chunk_size: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    tile: TileConfig | None = None,
    num_splits: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Triton LM head + log-probs: hidden [T, H], weight [V, H] -> ([T] fp32, [T] fp32 | None).

    Same contract as `fused_linear_logprobs_reference`; the [T, V] logits never exist. `chunk_size`
    is the backward's token chunk (rounded to a multiple of BLOCK_T; default about 1 GiB of d logits on
    GPU). `tile` and `num_splits` override the autotuned tile and the vocab split count, for tests.
    """
    _check_linear_args(hidden, weight, labels, temperature)
    _check_device(hidden, weight)
    labels = labels.contiguous()
    num_splits = num_splits or _default_num_splits(hidden.shape[0], weight.shape[0], hidden.device)
    needs_grad = hidden.requires_grad or weight.requires_grad
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty.clone() if compute_entropy else None)
    if not (torch.is_grad_enabled() and needs_grad):
        (logprobs, entropy, _, _), _ = _fused_forward(
            hidden, weight, labels, float(temperature), compute_entropy, ignore_index, tile, num_splits
        )
        return logprobs, entropy
    return _FusedLinearLogprobs.apply(
        hidden,
        weight,
        labels,
        float(temperature),
        compute_entropy,
        chunk_size,
        ignore_index,
        tile,
        num_splits,
    )


# ---------------------------------------------------------------------------------------------------
# Low-variance KL.
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _low_var_kl_fwd_kernel(
    logprobs_ptr, ref_ptr, kl_ptr, n, LOG_RATIO_CLAMP, VALUE_CLAMP, BLOCK: tl.constexpr
):
    """kl = clamp(e^x - x - 1, -VALUE_CLAMP, VALUE_CLAMP), x = clamp(ref - logp, +-LOG_RATIO_CLAMP)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(ref_ptr + offs, mask=mask, other=0.0).to(tl.float32) - tl.load(
        logprobs_ptr + offs, mask=mask, other=0.0
    ).to(tl.float32)
    x = tl.minimum(tl.maximum(x, -LOG_RATIO_CLAMP), LOG_RATIO_CLAMP)
    # e^x - 1 by exp, not expm1: libdevice calls raise under the interpreter; the fp32 cancellation
    # near x = 0 costs ~1e-7 absolute, far below anything the loss can see.
    kl = tl.exp(x) - x - 1.0
    tl.store(kl_ptr + offs, tl.minimum(tl.maximum(kl, -VALUE_CLAMP), VALUE_CLAMP), mask=mask)


@triton.jit
def _low_var_kl_bwd_kernel(
    logprobs_ptr,
    ref_ptr,
    grad_kl_ptr,
    grad_logprobs_ptr,
    grad_ref_ptr,
    n,
    LOG_RATIO_CLAMP,
    VALUE_CLAMP,
    BLOCK: tl.constexpr,
):
    """d kl / d ref = -d kl / d logp = e^x - 1, zero where either clamp is active (bounds included)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    raw = tl.load(ref_ptr + offs, mask=mask, other=0.0).to(tl.float32) - tl.load(
        logprobs_ptr + offs, mask=mask, other=0.0
    ).to(tl.float32)
    x = tl.minimum(tl.maximum(raw, -LOG_RATIO_CLAMP), LOG_RATIO_CLAMP)
    ex = tl.exp(x)
    kl = ex - x - 1.0
    live = (tl.abs(raw) <= LOG_RATIO_CLAMP) & (tl.abs(kl) <= VALUE_CLAMP)
    g = tl.load(grad_kl_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    grad_x = tl.where(live, g * (ex - 1.0), 0.0)
    tl.store(grad_logprobs_ptr + offs, (-grad_x).to(grad_logprobs_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_ref_ptr + offs, grad_x.to(grad_ref_ptr.dtype.element_ty), mask=mask)


_KL_BLOCK = 1024


def _low_var_kl_forward(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    kl = torch.empty(logprobs.shape, dtype=torch.float32, device=logprobs.device)
    n = logprobs.numel()
    if n > 0:
        _low_var_kl_fwd_kernel[(triton.cdiv(n, _KL_BLOCK),)](
            logprobs, ref_logprobs, kl, n, KL_LOG_RATIO_CLAMP, KL_VALUE_CLAMP, BLOCK=_KL_BLOCK
        )
    return kl


class _LowVarKL(torch.autograd.Function):
    """Triton k3 KL; saves the two inputs only."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
        ctx.save_for_backward(logprobs, ref_logprobs)
        return _low_var_kl_forward(logprobs, ref_logprobs)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_kl: Tensor) -> tuple[Tensor | None, ...]:
        logprobs, ref_logprobs = ctx.saved_tensors
        grad_logprobs = torch.empty_like(logprobs)
        grad_ref = torch.empty_like(ref_logprobs)
        n = logprobs.numel()
        if n > 0:
            _low_var_kl_bwd_kernel[(triton.cdiv(n, _KL_BLOCK),)](
                logprobs,
                ref_logprobs,
                grad_kl.contiguous(),
                grad_logprobs,
                grad_ref,
                n,
                KL_LOG_RATIO_CLAMP,
                KL_VALUE_CLAMP,
                BLOCK=_KL_BLOCK,
            )
        return (
            grad_logprobs if ctx.needs_input_grad[0] else None,
            grad_ref if ctx.needs_input_grad[1] else None,
        )


def low_var_kl_triton(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Triton k3 KL per token (see `low_var_kl_reference`); any equal shapes, fp32 output."""
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"shapes differ: {tuple(logprobs.shape)} vs {tuple(ref_logprobs.shape)}")
    _check_device(logprobs, ref_logprobs)
    logprobs, ref_logprobs = logprobs.contiguous(), ref_logprobs.contiguous()
    needs_grad = logprobs.requires_grad or ref_logprobs.requires_grad
    if not (torch.is_grad_enabled() and needs_grad):
        return _low_var_kl_forward(logprobs, ref_logprobs)
    return _LowVarKL.apply(logprobs, ref_logprobs)


# What the decorators above actually built: the interpreter's function type, or a compiled JITFunction.
INTERPRETED: bool = not isinstance(_low_var_kl_fwd_kernel, triton.runtime.JITFunction)
