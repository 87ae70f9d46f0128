"""The chunked algorithm behind both fast paths (torch and Triton), written once over per-chunk primitives.

`ppo_kernels.dispatch` turns a call into an `OpConfig` whose `prims` (`Primitives`) say what a backend
computes inside one chunk (`ppo_kernels.torch_ops.TORCH`, `ppo_kernels.triton_ops.primitives()`). The argument
checks, chunk loops, buffers, GEMMs and autograd Functions are here, once, so the two paths run the
same algorithm and differ only inside a chunk.

With z = logits.float() / temperature, p = softmax(z), lse = log sum_v exp z:

    logp[t] = z[t, label[t]] - lse[t],  entropy[t] = lse[t] - sum_v p z,
    d loss / d z = g_lp (onehot - p) + g_H p (sum_v p z - z),  d loss / d logits = (d loss / d z) / temperature.

`fused_linear_logprobs(hidden [T, H], weight [V, H], labels [T])`:

- Forward (with or without grad): token chunks of `chunk_size` rows; each is one GEMM
  logits = hidden[rows] @ weight^T ([rows, V], input dtype like the naive LM head, into one reused
  buffer) followed by the from-logits statistics of those rows. Only [T] statistics are saved for
  backward: lse and, with entropy, mean_z = sum_v p z. So the forward is `logits + logprobs_from_logits`
  chunked, and gives the same values with and without grad (PPO's old and new log-probs agree).
- Backward: vocabulary chunks of `vocab_chunk_size` rows of W. For W_c = weight[v0:v1]:
  logits_c = hidden @ W_c^T ([T, n], input dtype, one GEMM), turned in place into d logits_c (input
  dtype); then grad_weight[v0:v1] = d logits_c^T @ hidden is complete in one GEMM (fp32 accumulation
  inside it, written once in the weight dtype: no cross-chunk accumulator), and
  grad_hidden += d logits_c @ W_c accumulates in one fp32 [T, H] buffer, cast once at the end.
- FLOPs: 2·T·H·V forward, 6·T·H·V backward (recompute, grad_weight, grad_hidden): 8·T·H·V in all.

Chunks come from a memory budget (`chunk_budget_bytes`: 256 MiB on CUDA, 64 MiB elsewhere) so that the
[rows, V] and [T, n] temporaries stay within it whatever T is; `fused_memory_plan` writes down what
lives at the peak. The from-logits op walks token chunks the same way (one chunk on Triton, whose kernels
stream rows). Tokens whose label is `ignore_index` give 0 and no gradient.

Run the tests with `.venv/bin/python -m pytest tests/unit/test_kernels.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

IGNORE_INDEX = -100

# Clamps of the k3 estimator (verl's `low_var_kl`): the log-ratio, then the per-token KL.
KL_LOG_RATIO_CLAMP = 20.0
KL_VALUE_CLAMP = 10.0

MIB = 1 << 20
# Chunk temporaries per op: large on CUDA so every GEMM stays large, smaller on CPU (cache, RAM).
CUDA_CHUNK_BUDGET_BYTES = 256 * MIB
CPU_CHUNK_BUDGET_BYTES = 64 * MIB
# Chunk sizes are multiples of this where they can be, so GEMM tiles are not cut in the middle.
CHUNK_ALIGN = 128
# Upper bound of what the fused op keeps per token: outputs, saved statistics, masked output
# gradients, labels and masks (a dozen fp32/int64 [T] vectors).
PER_TOKEN_BYTES = 128


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half/bf16/fp32 inputs, fp64 for fp64 (reference and gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


# ---------------------------------------------------------------------------------------------------
# Argument checks: the one place, for the references and both fast paths.
# ---------------------------------------------------------------------------------------------------


def check_logits_args(logits: Tensor, labels: Tensor, temperature: float) -> None:
    """ValueError unless logits [T, V], labels [T] and temperature > 0."""
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(
            f"expected logits [T, V] and labels [T], got {tuple(logits.shape)}, {tuple(labels.shape)}"
        )
    _check_temperature(temperature)


def check_linear_args(hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float) -> None:
    """ValueError unless hidden [T, H], weight [V, H] of the same dtype, labels [T], temperature > 0."""
    _check_hidden_weight(hidden, weight)
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"expected labels [T] = [{hidden.shape[0]}], got {tuple(labels.shape)}")
    _check_temperature(temperature)


def check_topk_args(hidden: Tensor, weight: Tensor, k: int, temperature: float) -> None:
    """ValueError unless hidden [T, H], weight [V, H] of one float dtype, 1 <= k <= V, temperature > 0."""
    _check_hidden_weight(hidden, weight)
    _check_float(hidden)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= weight.shape[0]:
        raise ValueError(f"k must be an int in [1, V] = [1, {weight.shape[0]}], got {k!r}")
    _check_temperature(temperature)


def check_gather_args(
    hidden: Tensor, weight: Tensor, ids: Tensor, temperature: float, return_topk: bool
) -> None:
    """ValueError unless hidden [T, H], weight [V, H] of one float dtype, integer ids [T, K] with K >= 1
    (K <= V when return_topk asks for the top-K), temperature > 0. The id values are not read (that would
    sync a GPU): out-of-range ids fail in the gather."""
    _check_hidden_weight(hidden, weight)
    _check_float(hidden)
    if ids.dim() != 2 or ids.shape[0] != hidden.shape[0] or ids.shape[1] < 1:
        raise ValueError(f"expected ids [T, K] with T = {hidden.shape[0]} and K >= 1, got {tuple(ids.shape)}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"ids must be an integer tensor, got {ids.dtype}")
    if return_topk and ids.shape[1] > weight.shape[0]:
        raise ValueError(f"return_topk needs K <= V, got K = {ids.shape[1]} and V = {weight.shape[0]}")
    _check_temperature(temperature)


def check_chunk_sizes(**sizes: int | None) -> None:
    """ValueError unless each chunk size is None (from the budget) or a positive int."""
    for name, size in sizes.items():
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"{name} must be None or an int >= 1, got {size!r}")


def check_kl_args(logprobs: Tensor, ref_logprobs: Tensor) -> None:
    """ValueError unless the two log-prob tensors have the same shape."""
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"shapes differ: {tuple(logprobs.shape)} vs {tuple(ref_logprobs.shape)}")


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _check_hidden_weight(hidden: Tensor, weight: Tensor) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"expected hidden [T, H] and weight [V, H], got {tuple(hidden.shape)}, {tuple(weight.shape)}"
        )
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden and weight dtypes differ: {hidden.dtype} vs {weight.dtype}")


def _check_float(hidden: Tensor) -> None:
    if not hidden.dtype.is_floating_point:
        raise ValueError(f"hidden and weight must be floating point, got {hidden.dtype}")


# ---------------------------------------------------------------------------------------------------
# What a backend provides.
# ---------------------------------------------------------------------------------------------------


class RowStats(NamedTuple):
    """Per-token results of the forward, each [T] in the compute dtype (entropy, mean_z: None without)."""

    logprobs: Tensor
    entropy: Tensor | None
    lse: Tensor
    """log sum_v exp z; what backward needs (0 or finite at ignored tokens)."""
    mean_z: Tensor | None
    """sum_v p z; what backward needs for the entropy gradient."""

    @classmethod
    def empty(cls, num_tokens: int, dtype: torch.dtype, device: torch.device, entropy: bool) -> RowStats:
        def new() -> Tensor:
            return torch.empty(num_tokens, dtype=dtype, device=device)

        return cls(new(), new() if entropy else None, new(), new() if entropy else None)

    def rows(self, rows: slice) -> RowStats:
        """Views of the rows `rows` (writes through them land in self)."""
        return RowStats(*(None if x is None else x[rows] for x in self))


class GradRows(NamedTuple):
    """What d logits of a block of rows needs besides its logits: [C] tensors and the op's scalars."""

    labels: Tensor
    lse: Tensor
    mean_z: Tensor | None
    g_lp: Tensor
    """d loss / d logprobs, compute dtype, 0 at ignored tokens."""
    g_ent: Tensor | None
    """d loss / d entropy (None when the loss does not use the entropy), 0 at ignored tokens."""
    temperature: float
    ignore_index: int

    def rows(self, rows: slice) -> GradRows:
        """The same for the rows `rows` (views)."""
        return GradRows(*(x[rows] if isinstance(x, Tensor) else x for x in self))


@dataclasses.dataclass(frozen=True)
class Primitives:
    """The per-chunk work of one backend. Signatures (all tensors on one device):

    row_stats(logits [C, V], labels [C], out: RowStats of [C] views, temperature, ignore_index,
        consume): write the rows' statistics into `out`. consume=True lets it overwrite `logits`.
    logits_grad(logits [C, n], out [C, n], rows: GradRows of the C rows, col_offset): write
        d loss / d logits of the vocabulary columns col_offset .. col_offset + n into `out` (input
        dtype). `out` may be `logits` itself (in place). Rows whose label is ignore_index come out 0.
    accumulate_matmul(c [M, N] fp32, a [M, K], b [K, N]): c += a @ b with fp32 accumulation.
    kl_forward(logprobs, ref_logprobs) -> kl (compute dtype), the clamped k3 estimate.
    kl_grad(logprobs, ref_logprobs, grad_kl) -> d loss / d x, x = ref - logp (0 where a clamp is active).
    check_inputs(*tensors): raise if this backend cannot run on them.
    """

    name: str
    row_stats: Callable[..., None]
    logits_grad: Callable[..., None]
    accumulate_matmul: Callable[[Tensor, Tensor, Tensor], None]
    kl_forward: Callable[[Tensor, Tensor], Tensor]
    kl_grad: Callable[[Tensor, Tensor, Tensor], Tensor]
    check_inputs: Callable[..., None]
    compute_temporaries: int
    """How many compute-dtype values per chunk entry row_stats and logits_grad hold at most, beyond the
    chunk's logits themselves (torch: 2, e.g. z and p; Triton: 0, its kernels keep them in registers)."""
    upcasts_weight_chunk: bool
    """accumulate_matmul copies a half-precision weight chunk [n, H] to fp32 (torch on CPU)."""


@dataclasses.dataclass(frozen=True)
class OpConfig:
    """One call of an op: the backend's primitives, the op's scalars and its chunk sizes."""

    prims: Primitives
    temperature: float
    compute_entropy: bool
    ignore_index: int
    chunk_size: int | None = None
    """Tokens per forward chunk (None: from the memory budget)."""
    vocab_chunk_size: int | None = None
    """Vocabulary rows per backward chunk of the fused op (None: from the memory budget)."""


# ---------------------------------------------------------------------------------------------------
# Chunk sizes and the peak-memory accounting.
# ---------------------------------------------------------------------------------------------------


def chunk_budget_bytes(device: torch.device) -> int:
    """Default budget of one op's chunk temporaries: 256 MiB on CUDA, 64 MiB elsewhere."""
    return CUDA_CHUNK_BUDGET_BYTES if device.type == "cuda" else CPU_CHUNK_BUDGET_BYTES


def _fit(budget_bytes: int, bytes_per_unit: int, limit: int) -> int:
    """Most units (rows) whose bytes fit the budget: a multiple of CHUNK_ALIGN if >= it, >= 1, <= limit."""
    if bytes_per_unit <= 0:
        return max(limit, 1)
    units = budget_bytes // bytes_per_unit
    if units >= CHUNK_ALIGN:
        units -= units % CHUNK_ALIGN
    return max(1, min(units, limit))


def entry_bytes(prims: Primitives, dtype: torch.dtype, fused: bool) -> int:
    """Bytes of temporaries per entry of a chunk: the logits buffer (fused ops) + the backend's values."""
    buffer = dtype.itemsize if fused else 0
    return buffer + prims.compute_temporaries * compute_dtype(dtype).itemsize


def token_chunk_rows(
    prims: Primitives, vocab_size: int, dtype: torch.dtype, budget_bytes: int, fused: bool
) -> int:
    """Tokens per forward chunk: [rows, V] temporaries within the budget (all tokens when none)."""
    return _fit(budget_bytes, vocab_size * entry_bytes(prims, dtype, fused), limit=1 << 62)


def vocab_chunk_rows(
    prims: Primitives,
    num_tokens: int,
    hidden_size: int,
    vocab_size: int,
    dtype: torch.dtype,
    budget_bytes: int,
) -> int:
    """Vocabulary rows per backward chunk of the fused op: [T, n] temporaries within the budget."""
    per_row = num_tokens * entry_bytes(prims, dtype, fused=True)
    if prims.upcasts_weight_chunk and dtype != compute_dtype(dtype):
        per_row += hidden_size * compute_dtype(dtype).itemsize
    return _fit(budget_bytes, per_row, limit=vocab_size)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes the fused op allocates beyond its inputs, by phase: what lives at each phase's peak."""

    token_chunk: int
    vocab_chunk: int
    forward: dict[str, int]
    """Inside the forward's chunk loop."""
    backward: dict[str, int]
    """Inside the backward's vocabulary loop."""
    end: dict[str, int]
    """After the loop, while grad_hidden is cast to the input dtype."""

    @property
    def peak_bytes(self) -> int:
        return max(sum(self.forward.values()), sum(self.backward.values()), sum(self.end.values()))


def fused_memory_plan(
    prims: Primitives,
    num_tokens: int,
    hidden_size: int,
    vocab_size: int,
    dtype: torch.dtype,
    budget_bytes: int = CUDA_CHUNK_BUDGET_BYTES,
    *,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
) -> MemoryPlan:
    """Peak extra memory of `fused_linear_logprobs` forward + backward (gradients of hidden and weight).

    Triton path, bf16, T=16384, H=4096, V=152064, budget 256 MiB (token chunk 768, vocab chunk 8192):

    - forward: logits chunk [768, V] bf16 = 233,570,304 B (223 MiB) + per-token vectors 2 MiB.
    - backward, at its peak (inside the vocabulary loop):
        grad_weight [V, H] bf16 (the output, each chunk's rows written once)  1,245,708,288 B (1.160 GiB)
        grad_hidden accumulator [T, H] fp32                                     268,435,456 B (0.250 GiB)
        logits / d logits chunk [T, 8192] bf16 (one buffer, in place)           268,435,456 B (0.250 GiB)
        per-token vectors (128 B x T)                                             2,097,152 B
        total                                                                   1,784,676,352 B (1.662 GiB)
    - end: grad_weight + fp32 grad_hidden + its bf16 copy [T, H] (134,217,728 B): 1.537 GiB.

    (The token-chunked backward this replaces held a 1 GiB d-logits chunk, a 2.3 GiB fp32 grad_weight
    accumulator and its 1.2 GiB bf16 copy: 4.59 GiB measured on an H200.)

    Same path, T=4096, H=4096: vocab chunk 32768; 1.160 + 0.0625 + 0.25 GiB + 0.5 MiB = 1.473 GiB.
    T=16384, H=896: grad_weight 0.254 GiB + grad_hidden 0.055 GiB + chunk 0.25 GiB + 2 MiB = 0.560 GiB.
    The chunk term is at most the budget for any T (until T alone exceeds it: one vocab row, T x 2 B).
    The torch path adds 2 fp32 values per chunk entry (z and p), and on half inputs an fp32 copy of the
    weight chunk, inside the same budget.
    """
    itemsize, acc_size = dtype.itemsize, compute_dtype(dtype).itemsize
    token_chunk = min(
        chunk_size or token_chunk_rows(prims, vocab_size, dtype, budget_bytes, True), num_tokens
    )
    vocab_chunk = vocab_chunk_size or vocab_chunk_rows(
        prims, num_tokens, hidden_size, vocab_size, dtype, budget_bytes
    )
    vocab_chunk = min(vocab_chunk, vocab_size)
    per_token = PER_TOKEN_BYTES * num_tokens
    chunk = num_tokens * vocab_chunk * entry_bytes(prims, dtype, fused=True)
    if prims.upcasts_weight_chunk and dtype != compute_dtype(dtype):
        chunk += vocab_chunk * hidden_size * acc_size
    grad_weight = vocab_size * hidden_size * itemsize
    grad_hidden_acc = num_tokens * hidden_size * acc_size
    end = {"grad_weight": grad_weight, "grad_hidden_acc": grad_hidden_acc, "per_token": per_token}
    if dtype != compute_dtype(dtype):
        end["grad_hidden"] = num_tokens * hidden_size * itemsize
    return MemoryPlan(
        token_chunk=token_chunk,
        vocab_chunk=vocab_chunk,
        forward={
            "token_chunk": token_chunk * vocab_size * entry_bytes(prims, dtype, fused=True),
            "per_token": per_token,
        },
        backward={
            "grad_weight": grad_weight,
            "grad_hidden_acc": grad_hidden_acc,
            "vocab_chunk": chunk,
            "per_token": per_token,
        },
        end=end,
    )


# ---------------------------------------------------------------------------------------------------
# Autograd, shared by both ops.
# ---------------------------------------------------------------------------------------------------


def _save(
    ctx: torch.autograd.function.FunctionCtx, config: OpConfig, stats: RowStats, *tensors: Tensor
) -> tuple[Tensor, Tensor | None]:
    """Save the inputs (references) and lse, mean_z for backward; return the op's outputs."""
    ctx.save_for_backward(*tensors, stats.lse, stats.mean_z)
    ctx.config = config
    ctx.set_materialize_grads(False)
    return stats.logprobs, stats.entropy


def _grad_rows(
    ctx: torch.autograd.function.FunctionCtx, grad_logprobs: Tensor | None, grad_entropy: Tensor | None
) -> tuple[list[Tensor], GradRows]:
    """(the saved inputs, GradRows of all tokens): output gradients in the compute dtype, 0 at ignored
    tokens (a missing logprobs gradient is 0; a missing entropy gradient stays None)."""
    *inputs, labels, lse, mean_z = ctx.saved_tensors
    config: OpConfig = ctx.config
    valid = labels != config.ignore_index
    g_lp = torch.zeros_like(lse) if grad_logprobs is None else grad_logprobs.to(lse.dtype)
    g_lp = torch.where(valid, g_lp, 0.0)
    g_ent = None if grad_entropy is None else torch.where(valid, grad_entropy.to(lse.dtype), 0.0)
    return inputs, GradRows(labels, lse, mean_z, g_lp, g_ent, config.temperature, config.ignore_index)


# ---------------------------------------------------------------------------------------------------
# From logits.
# ---------------------------------------------------------------------------------------------------


def _logits_stats(config: OpConfig, logits: Tensor, labels: Tensor) -> RowStats:
    num_tokens, step = logits.shape[0], config.chunk_size
    stats = RowStats.empty(num_tokens, compute_dtype(logits.dtype), logits.device, config.compute_entropy)
    for start in range(0, num_tokens, step):
        rows = slice(start, start + step)
        config.prims.row_stats(
            logits[rows], labels[rows], stats.rows(rows), config.temperature, config.ignore_index, False
        )
    return stats


class _LogprobsFromLogits(torch.autograd.Function):
    """Log-probs/entropy from logits; saves logits (a reference, not a copy) and [T] statistics."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, logits: Tensor, labels: Tensor, config: OpConfig
    ) -> tuple[Tensor, Tensor | None]:
        return _save(ctx, config, _logits_stats(config, logits, labels), logits, labels)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_logprobs: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        (logits,), grad_rows = _grad_rows(ctx, grad_logprobs, grad_entropy)
        # A new buffer: the caller's logits may still be read by someone else.
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        step = ctx.config.chunk_size
        for start in range(0, logits.shape[0], step):
            rows = slice(start, start + step)
            ctx.config.prims.logits_grad(logits[rows], grad_logits[rows], grad_rows.rows(rows), 0)
        return grad_logits, None, None


def logprobs_from_logits(logits: Tensor, labels: Tensor, config: OpConfig) -> tuple[Tensor, Tensor | None]:
    """Log-probs and entropy from logits [T, V] on config.prims; see `ppo_kernels.logprobs_from_logits`.

    Token chunks default to the budget's worth of the backend's temporaries (Triton's kernels stream
    rows and hold none: one chunk). Without grad nothing is saved.
    """
    check_logits_args(logits, labels, config.temperature)
    config.prims.check_inputs(logits)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    labels = labels.contiguous()
    budget = chunk_budget_bytes(logits.device)
    step = config.chunk_size or token_chunk_rows(config.prims, logits.shape[1], logits.dtype, budget, False)
    config = dataclasses.replace(config, chunk_size=step)
    if not (torch.is_grad_enabled() and logits.requires_grad):
        stats = _logits_stats(config, logits, labels)
        return stats.logprobs, stats.entropy
    return _LogprobsFromLogits.apply(logits, labels, config)


# ---------------------------------------------------------------------------------------------------
# Fused with the LM head.
# ---------------------------------------------------------------------------------------------------


def _linear_stats(config: OpConfig, hidden: Tensor, weight: Tensor, labels: Tensor) -> RowStats:
    """Forward: per token chunk, one GEMM into a reused [chunk, V] buffer, then the rows' statistics."""
    (num_tokens, _), vocab_size, step = hidden.shape, weight.shape[0], config.chunk_size
    stats = RowStats.empty(num_tokens, compute_dtype(hidden.dtype), hidden.device, config.compute_entropy)
    buffer = hidden.new_empty(min(step, num_tokens) * vocab_size)
    for start in range(0, num_tokens, step):
        rows = slice(start, min(start + step, num_tokens))
        logits = buffer[: (rows.stop - start) * vocab_size].view(-1, vocab_size)
        torch.mm(hidden[rows], weight.T, out=logits)
        config.prims.row_stats(
            logits, labels[rows], stats.rows(rows), config.temperature, config.ignore_index, True
        )
    return stats


def vocab_chunk_grads(
    hidden: Tensor,
    weight: Tensor,
    vocab_chunk_size: int,
    logits_grad: Callable[[Tensor, int], None],
    accumulate_matmul: Callable[[Tensor, Tensor, Tensor], None],
    need_hidden: bool,
    need_weight: bool,
) -> tuple[Tensor | None, Tensor | None]:
    """Backward of any op on logits = hidden @ weight^T over vocabulary chunks: (grad_hidden,
    grad_weight) in the input dtype (None if not needed).

    Per chunk W_c = weight[v0:v0+n]: logits_c = hidden @ W_c^T ([T, n], input dtype, one reused buffer),
    which `logits_grad(logits_c, v0)` turns in place into d loss / d logits_c; then grad_weight[v0:v0+n]
    = d logits_c^T @ hidden (complete, written once) and grad_hidden (fp32) += d logits_c @ W_c through
    `accumulate_matmul`. Shared by `fused_linear_logprobs` and `ppo_kernels.topk`.
    """
    (num_tokens, hidden_size), vocab_size, step = hidden.shape, weight.shape[0], vocab_chunk_size
    grad_weight = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device) if need_weight else None
    acc_dtype = compute_dtype(hidden.dtype)
    grad_hidden = (
        torch.zeros(num_tokens, hidden_size, dtype=acc_dtype, device=hidden.device) if need_hidden else None
    )
    buffer = hidden.new_empty(num_tokens * min(step, vocab_size))
    for v0 in range(0, vocab_size, step):
        w_chunk = weight[v0 : v0 + step]
        dlogits = buffer[: num_tokens * w_chunk.shape[0]].view(num_tokens, -1)
        torch.mm(hidden, w_chunk.T, out=dlogits)
        logits_grad(dlogits, v0)
        if need_weight:
            torch.mm(dlogits.T, hidden, out=grad_weight[v0 : v0 + step])
        if need_hidden:
            accumulate_matmul(grad_hidden, dlogits, w_chunk)
    del buffer, dlogits
    if need_hidden:
        grad_hidden = grad_hidden.to(hidden.dtype)
    return grad_hidden, grad_weight


def _linear_grads(
    config: OpConfig,
    hidden: Tensor,
    weight: Tensor,
    grad_rows: GradRows,
    need_hidden: bool,
    need_weight: bool,
) -> tuple[Tensor | None, Tensor | None]:
    """Backward of the fused log-probs over vocabulary chunks (`vocab_chunk_grads`), each chunk's
    d logits from the backend's `logits_grad`."""

    def logits_grad(dlogits: Tensor, col_offset: int) -> None:
        config.prims.logits_grad(dlogits, dlogits, grad_rows, col_offset)

    return vocab_chunk_grads(
        hidden,
        weight,
        config.vocab_chunk_size,
        logits_grad,
        config.prims.accumulate_matmul,
        need_hidden,
        need_weight,
    )


class _FusedLinearLogprobs(torch.autograd.Function):
    """LM head + log-probs; saves hidden, weight (references) and [T] statistics, nothing [T, V]."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        config: OpConfig,
    ) -> tuple[Tensor, Tensor | None]:
        return _save(ctx, config, _linear_stats(config, hidden, weight, labels), hidden, weight, labels)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_logprobs: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        (hidden, weight), grad_rows = _grad_rows(ctx, grad_logprobs, grad_entropy)
        grads = _linear_grads(ctx.config, hidden, weight, grad_rows, *ctx.needs_input_grad[:2])
        return *grads, None, None


def fused_linear_logprobs(
    hidden: Tensor, weight: Tensor, labels: Tensor, config: OpConfig
) -> tuple[Tensor, Tensor | None]:
    """LM head + log-probs on config.prims; see `ppo_kernels.fused_linear_logprobs`.

    Chunk sizes default to `chunk_budget_bytes` of temporaries each (see `fused_memory_plan`).
    """
    check_linear_args(hidden, weight, labels, config.temperature)
    config.prims.check_inputs(hidden, weight)
    labels = labels.contiguous()
    (num_tokens, hidden_size), vocab_size = hidden.shape, weight.shape[0]
    plan = fused_memory_plan(
        config.prims,
        num_tokens,
        hidden_size,
        vocab_size,
        hidden.dtype,
        chunk_budget_bytes(hidden.device),
        chunk_size=config.chunk_size,
        vocab_chunk_size=config.vocab_chunk_size,
    )
    config = dataclasses.replace(
        config, chunk_size=max(1, plan.token_chunk), vocab_chunk_size=max(1, plan.vocab_chunk)
    )
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        stats = _linear_stats(config, hidden, weight, labels)
        return stats.logprobs, stats.entropy
    return _FusedLinearLogprobs.apply(hidden, weight, labels, config)


# ---------------------------------------------------------------------------------------------------
# Low-variance KL.
# ---------------------------------------------------------------------------------------------------


class _LowVarKL(torch.autograd.Function):
    """k3 KL; saves the two inputs only (no intermediates)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, logprobs: Tensor, ref_logprobs: Tensor, prims: Primitives
    ) -> Tensor:
        ctx.save_for_backward(logprobs, ref_logprobs)
        ctx.prims = prims
        return prims.kl_forward(logprobs, ref_logprobs)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_kl: Tensor) -> tuple[Tensor | None, ...]:
        logprobs, ref_logprobs = ctx.saved_tensors
        # x = ref - logp: d/d ref = d/dx, d/d logp = -d/dx.
        grad_x = ctx.prims.kl_grad(logprobs, ref_logprobs, grad_kl.contiguous())
        grad_logprobs = (-grad_x).to(logprobs.dtype) if ctx.needs_input_grad[0] else None
        grad_ref = grad_x.to(ref_logprobs.dtype) if ctx.needs_input_grad[1] else None
        return grad_logprobs, grad_ref, None


def low_var_kl(logprobs: Tensor, ref_logprobs: Tensor, prims: Primitives) -> Tensor:
    """k3 KL per token on `prims`; see `ppo_kernels.low_var_kl`."""
    check_kl_args(logprobs, ref_logprobs)
    prims.check_inputs(logprobs, ref_logprobs)
    logprobs, ref_logprobs = logprobs.contiguous(), ref_logprobs.contiguous()
    if not (torch.is_grad_enabled() and (logprobs.requires_grad or ref_logprobs.requires_grad)):
        return prims.kl_forward(logprobs, ref_logprobs)
    return _LowVarKL.apply(logprobs, ref_logprobs, prims)
