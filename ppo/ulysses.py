"""Ulysses sequence parallelism: groups of ``sp`` consecutive ranks split each packed row along its tokens.

For responses of 8k-32k tokens one sequence's activations no longer fit one GPU. With
``<role>.ulysses_sequence_parallel_size = sp`` (verl's key and meaning) the ranks form groups of ``sp``
consecutive ranks; the ranks of a group hold the same sequences and each runs the model on a contiguous
``1/sp`` of every packed micro-batch's tokens. Everything outside attention (embeddings, MLPs, norms,
the LM head and the log-prob kernels, the value head) is per token and runs on the slice unchanged.
Attention needs whole sequences, so around it the layout switches from sequence-sharded to head-sharded
(DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv:2309.14509)::

    q, k, v [1, H, T/sp, d]  --all-to-all-->  [1, H/sp, T, d]   every token, this rank's heads
    attention with the full row's sequence offsets (the same kernels as without SP)
    out [1, T, H/sp, d]      --all-to-all-->  [1, T/sp, H, d]   this rank's tokens, every head

- Groups: ``make_sp_groups(sp)`` (ranks ``[g*sp, (g+1)*sp)``); the data-parallel size is
  ``world / sp``. FSDP keeps sharding over all ranks.
- Slicing: ``slice_for_rank`` pads the row to a multiple of ``sp`` (padding is a sequence of its own,
  label -100, counted nowhere) and takes this rank's slice; position ids stay global, so rotary
  embeddings are those of the whole row.
- Forwards: ``ppo.packed_forward`` runs every forward on packed rows; it takes this rank's slice
  (``slice_for_rank``; the row itself with ``NO_SP``), runs the model inside ``attention_layout`` (which
  hands the attention layers the ``ULYSSES`` context) and assembles the row's per-token outputs with
  ``SPSlice.gather`` (``gather_tokens``, differentiable): the whole micro-batch's outputs on every rank
  of the group.
- Grouped-query attention: ``sp`` must divide the query heads ``H`` (``check_heads``); where it does
  not divide the key/value heads ``H_kv``, each key/value head is repeated
  ``r = sp / gcd(H_kv, sp)`` times before the exchange (``H_kv * r = lcm(H_kv, sp)`` divides ``H``, and
  each query head keeps its key/value head), at ``r`` times the key/value traffic.

Gradients. The all-to-all is a permutation of blocks between ranks, so its backward is the reverse
all-to-all. ``gather_tokens`` (an all-gather) has as backward its adjoint, a reduce-scatter: the
gradient of this rank's slice summed over the group's ranks. When every rank of a group computes the same
loss ``l`` of the gathered outputs, as the trainer does, each rank's slice thus gets ``sp`` times its
share of ``dl``, and the group's summed parameter gradient is ``sp * dl/dtheta``. That is exact with the
trainer's normalization as it is: token counts all-reduced over all ranks count each token ``sp`` times
(each rank of a group holds the group's sequences), so each rank's ``l`` is ``1/sp`` of its group's
share, and ``shard_model`` sums gradients over all ranks.

Cost, per attention layer: two all-to-alls in the forward (q, k, v together; the output) and two in the
backward (their reverses). Each rank holds ``T/sp * H * d`` elements of q and of the output
(``T/sp * H_kv * d`` of k and v) and sends ``(sp - 1)/sp`` of them; ``T`` is the padded row's length.
Per micro-batch, one all-gather of the ``[T]`` outputs (log-probs and entropy stacked; values), and a
reduce-scatter in the backward: negligible. Activation memory per rank is divided by about ``sp``:
outside attention every tensor holds ``T/sp`` tokens (the ``[T, vocab]`` logits too), and attention's own
buffers hold ``H/sp`` heads over ``T`` tokens (the same size; the per-sequence score matrices of the sdpa
path shrink by ``sp`` as well). Not divided: repeated key/value heads (``r`` times their share), the
send/receive buffers of one layer's exchange, the gathered ``[T]`` outputs. Parameters, gradients and
optimizer state are unaffected (FSDP shards them over all ranks either way). Rollout (generation) does
not use SP.

Usage (every rank; ``packed`` holds the group's micro-batch, the same on every rank of the group)::

    sp = make_sp_groups(cfg.actor.ulysses_sequence_parallel_size)   # collective, once
    check_heads(actor.config, sp.size, "actor.ulysses_sequence_parallel_size")
    logprobs, entropy = packed_forward.logprobs(actor, packed, sp, temperature=1.0, compute_entropy=True)
    values = packed_forward.values(critic, packed, sp)             # [B, R]
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import PretrainedConfig

from ppo.attention import (
    PACKED_ATTENTION,
    SHARED_PREFIX,
    ULYSSES,
    VARLEN_FLASH,
    SharedPrefix,
    packed_kwargs,
)
from ppo.config import ConfigError
from ppo.packing import PackedSequences

IGNORE_INDEX = -100
"""The label of tokens whose log-prob is not computed (prompts, the last token, SP padding)."""

# ----------------------------------------------------------------------------------------------------
# Groups
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class SPGroup:
    """This rank's sequence-parallel group: ``size`` consecutive ranks that share each micro-batch."""

    size: int
    """Ranks in the group (``ulysses_sequence_parallel_size``); 1 means no sequence parallelism."""
    rank: int
    """This rank's index in the group: it holds tokens ``[rank * T/size, (rank + 1) * T/size)``."""
    first_rank: int
    """Global rank of the group's index 0 (the source of ``broadcast``)."""
    group: dist.ProcessGroup | None
    """The process group, None when ``size == 1``."""


NO_SP = SPGroup(size=1, rank=0, first_rank=0, group=None)
"""The group of a run without sequence parallelism: every function here is then a no-op."""


def make_sp_groups(sp_size: int) -> SPGroup:
    """This rank's group of ``sp_size`` consecutive ranks (``rank // sp_size``), created once.

    Collective the first time for a size: every rank creates every group (``new_group`` needs all ranks,
    in the same order), later calls return the cached group. ``sp_size == 1`` is ``NO_SP`` and creates
    nothing, with or without a process group.
    """
    if sp_size == 1:
        return NO_SP
    if sp_size < 1:
        raise ValueError(f"ulysses_sequence_parallel_size must be >= 1, got {sp_size}")
    if not dist.is_initialized():
        raise RuntimeError(
            f"ulysses_sequence_parallel_size={sp_size} needs a process group of >= {sp_size} ranks"
        )
    world = dist.get_world_size()
    if world % sp_size:
        raise ValueError(f"ulysses_sequence_parallel_size={sp_size} must divide the world size {world}")
    return _sp_group(sp_size, dist.group.WORLD)


@functools.lru_cache(maxsize=8)
def _sp_group(sp_size: int, world_group: dist.ProcessGroup) -> SPGroup:
    # Keyed by the world group too: a new process group (tests that init and destroy) gets new groups.
    rank = dist.get_rank()
    mine = None
    for first in range(0, dist.get_world_size(), sp_size):
        group = dist.new_group(list(range(first, first + sp_size)))
        if first <= rank < first + sp_size:
            mine = SPGroup(size=sp_size, rank=rank - first, first_rank=first, group=group)
    assert mine is not None
    return mine


def check_heads(model_config: PretrainedConfig, sp_size: int, key: str) -> None:
    """Fail unless a model loaded with ``model_config`` can run with ``sp_size``-way sequence parallelism:
    ``sp_size`` divides the number of attention heads (key/value heads are repeated where needed), and
    the model attends with one of ``ppo.attention``'s packed kernels (only they exchange heads; load with
    ``resolve_attn_implementation(..., sequence_parallel=True)``). ``key`` names the config key; a
    ConfigError (one line at start-up) otherwise."""
    if sp_size == 1:
        return
    config = model_config.get_text_config()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % sp_size:
        path = getattr(model_config, "_name_or_path", "")
        raise ConfigError(
            f"{key}={sp_size} must divide the model's{f' ({path})' if path else ''} num_attention_heads={heads} "
            f"(num_key_value_heads={kv_heads}): use a divisor of {heads}"
        )
    impl = getattr(model_config, "_attn_implementation", None)
    if impl not in (PACKED_ATTENTION, VARLEN_FLASH):
        raise ConfigError(
            f"{key}={sp_size} needs model.attn_implementation=auto ({PACKED_ATTENTION} or {VARLEN_FLASH}); "
            f"the model attends with {impl}, which does not exchange heads across ranks"
        )


# ----------------------------------------------------------------------------------------------------
# Differentiable collectives
# ----------------------------------------------------------------------------------------------------


def _all_to_all_blocks(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """``x [sp, ...]``: block ``i`` goes to group rank ``i``; block ``j`` of the result came from rank ``j``.
    A permutation of blocks between ranks: the backward is the same exchange of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_to_all_blocks(x.contiguous(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_to_all_blocks(grad.contiguous(), ctx.group), None


def all_to_all(x: torch.Tensor, sp: SPGroup) -> torch.Tensor:
    """Differentiable all-to-all of ``x [sp, ...]`` in the group: block ``i`` to rank ``i``, block ``j`` of
    the result from rank ``j``. The identity for ``sp.size == 1``."""
    if sp.size == 1:
        return x
    if x.shape[0] != sp.size:
        raise ValueError(f"all_to_all needs [sp={sp.size}, ...] blocks, got {tuple(x.shape)}")
    return _AllToAll.apply(x, sp.group)


def gather_seq_scatter_heads(*xs: torch.Tensor, sp: SPGroup) -> tuple[torch.Tensor, ...]:
    """Sequence-sharded to head-sharded: each ``x [1, H_x, T/sp, d]`` -> ``[1, H_x/sp, T, d]``.

    Rank ``i`` keeps heads ``[i H_x/sp, (i+1) H_x/sp)`` of every rank's tokens, in rank (token) order.
    Tensors with one dtype and head size (q, k, v) travel in one all-to-all. Differentiable.
    """
    if sp.size == 1:
        return xs
    n = sp.size
    for x in xs:
        if x.dim() != 4 or x.shape[0] != 1 or x.shape[1] % n:
            raise ValueError(
                f"expected [1, heads, tokens, d] with heads divisible by {n}, got {tuple(x.shape)}"
            )
    if len({(x.dtype, x.shape[2], x.shape[3]) for x in xs}) > 1:
        return tuple(out for x in xs for out in gather_seq_scatter_heads(x, sp=sp))
    local, d = xs[0].shape[2], xs[0].shape[3]
    heads = [x.shape[1] // n for x in xs]
    # Block i (for rank i): this rank's tokens of head group i of every tensor.
    send = torch.cat([x[0].reshape(n, h, local, d) for x, h in zip(xs, heads, strict=True)], dim=1)
    recv = all_to_all(send, sp)  # [n (source rank = token block), sum(heads), local, d]
    full = recv.transpose(0, 1).reshape(sum(heads), n * local, d)
    return tuple(t[None] for t in full.split(heads, dim=0))


def gather_heads_scatter_seq(x: torch.Tensor, sp: SPGroup) -> torch.Tensor:
    """Head-sharded to sequence-sharded, in the attention output layout: ``[1, T, H/sp, d]`` ->
    ``[1, T/sp, H, d]`` (the inverse of ``gather_seq_scatter_heads``). Differentiable."""
    if sp.size == 1:
        return x
    n = sp.size
    if x.dim() != 4 or x.shape[0] != 1 or x.shape[1] % n:
        raise ValueError(f"expected [1, tokens, heads, d] with tokens divisible by {n}, got {tuple(x.shape)}")
    _, total, h, d = x.shape
    recv = all_to_all(x[0].reshape(n, total // n, h, d), sp)  # [n (source rank = head group), T/n, h, d]
    return recv.transpose(0, 1).reshape(total // n, n * h, d)[None]


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0; backward: reduce-scatter (sum over the group's ranks, this rank's slice)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sp: SPGroup) -> torch.Tensor:
        ctx.sp = sp
        x = x.contiguous()
        out = x.new_empty((sp.size * x.shape[0], *x.shape[1:]))
        _all_gather_single(out, x, sp.group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // ctx.sp.size, *grad.shape[1:]))
        _reduce_scatter_single(out, grad, ctx.sp.group)
        return out, None


def gather_tokens(x_local: torch.Tensor, sp: SPGroup) -> torch.Tensor:
    """Every rank's slice concatenated in rank order: ``[T/sp, ...] -> [T, ...]`` on every rank.

    Differentiable; the backward is the adjoint of the all-gather, a reduce-scatter: rank ``i`` gets
    slice ``i`` of the gradient summed over the group's ranks (``sp`` times its slice of the gradient
    when every rank computes the same loss; see the module docstring for why that is what the trainer
    needs). The identity for ``sp.size == 1``.
    """
    if sp.size == 1:
        return x_local
    return _GatherTokens.apply(x_local, sp)


def _all_gather_single(out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup) -> None:
    # torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, x, group=group)


def _reduce_scatter_single(out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, x, group=group)


# ----------------------------------------------------------------------------------------------------
# Gathering the group's sequences (data, not differentiable)
# ----------------------------------------------------------------------------------------------------


def all_gather_object(obj: object, sp: SPGroup) -> list[object]:
    """Every group rank's picklable object, in group order (``[obj]`` for ``sp.size == 1``)."""
    if sp.size == 1:
        return [obj]
    out: list[object] = [None] * sp.size
    dist.all_gather_object(out, obj, group=sp.group)
    return out


def all_gather_rows(t: torch.Tensor, sp: SPGroup, pad_value: float | bool = 0) -> torch.Tensor:
    """The group's rows stacked in group order: ``[B, ...]`` on each rank -> ``[sp * B, ...]``, dim 1 (if
    any) right-padded with ``pad_value`` to the group's longest. Every rank must hold ``B`` rows."""
    if sp.size == 1:
        return t
    if t.dim() >= 2:
        width = torch.tensor([t.shape[1]], device=t.device)
        dist.all_reduce(width, op=dist.ReduceOp.MAX, group=sp.group)
        if (extra := int(width) - t.shape[1]) > 0:
            pad = t.new_full((t.shape[0], extra, *t.shape[2:]), pad_value)
            t = torch.cat([t, pad], dim=1)
    out = t.new_empty((sp.size * t.shape[0], *t.shape[1:]))
    _all_gather_single(out, t.contiguous(), sp.group)
    return out


def broadcast(t: torch.Tensor, sp: SPGroup) -> torch.Tensor:
    """``t`` of the group's first rank, in place on every rank of the group (e.g. a mini-batch shuffle,
    which must be the same on all of them). Returns ``t``."""
    if sp.size > 1:
        dist.broadcast(t, src=sp.first_rank, group=sp.group)
    return t


# ----------------------------------------------------------------------------------------------------
# Slices and forwards
# ----------------------------------------------------------------------------------------------------


class UlyssesContext:
    """What every attention layer of a sequence-parallel forward needs, passed as the forward keyword
    argument ``ppo.attention.ULYSSES``: the group, the slice length and the full (padded) row's packed
    attention kwargs (built once per micro-batch: one host-to-device copy, not one per layer).

    A plain class, not a dataclass: FSDP2's input casting rebuilds dataclasses found in forward kwargs.
    """

    __slots__ = ("sp", "local_tokens", "attention_kwargs")

    def __init__(self, sp: SPGroup, local_tokens: int, attention_kwargs: dict[str, Any]) -> None:
        self.sp = sp
        self.local_tokens = local_tokens
        self.attention_kwargs = attention_kwargs

    def scatter_heads(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[1, H, T/sp, d]`` (key, value: ``H_kv``) -> ``[1, H/sp, T, d]``, repeating key/value heads
        ``sp / gcd(H_kv, sp)`` times where ``sp`` does not divide ``H_kv``."""
        repeat = self.sp.size // math.gcd(key.shape[1], self.sp.size)
        if repeat > 1:
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        return gather_seq_scatter_heads(query, key, value, sp=self.sp)

    def gather_heads(self, out: torch.Tensor) -> torch.Tensor:
        """Attention output ``[1, T, H/sp, d]`` -> ``[1, T/sp, H, d]``."""
        return gather_heads_scatter_seq(out, self.sp)


@dataclass(kw_only=True)
class SPSlice:
    """This rank's contiguous slice of a packed row padded to a multiple of ``sp``."""

    input_ids: torch.Tensor
    """[T_local] token ids (``T_local = ceil(T / sp)``; padding: id 0)."""
    position_ids: torch.Tensor
    """[T_local] the row's own positions (restarting per sequence; padding: 0, 1, ...)."""
    labels: torch.Tensor | None
    """[T_local] next-token labels of the row, -100 at padding; None for rows without labels."""
    start: int
    """Packed position of the slice's first token: local token ``t`` is row token ``start + t``."""
    num_tokens: int
    """``T``, the row's length without padding."""
    layout: list[int] | SharedPrefix
    """The row's layout for its attention layers without sequence parallelism: its sequence offsets
    ``[0, ..., T]`` or its shared-prefix groups (``Packed.layout``; without the padding)."""
    sp: SPGroup
    context: UlyssesContext | None
    """The attention layers' ``ULYSSES`` kwarg; None for ``sp.size == 1``."""

    @property
    def stop(self) -> int:
        """One past the packed position of the slice's last token (padding included)."""
        return self.start + self.input_ids.numel()

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a per-token quantity of the row, ``[T, ...] -> [T_local, ...]`` (0 on the
        padding)."""
        pad = self.sp.size * self.input_ids.numel() - self.num_tokens
        if pad:
            x = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])
        return x[self.start : self.stop]

    def gather(self, x_local: torch.Tensor) -> torch.Tensor:
        """A per-token output of every rank's slice, as the row's ``[T, ...]`` (padding dropped);
        differentiable (``gather_tokens``)."""
        return gather_tokens(x_local, self.sp)[: self.num_tokens]


def slice_for_rank(packed: PackedSequences, sp: SPGroup) -> SPSlice:
    """Pad a packed row to a multiple of ``sp.size`` and take this rank's contiguous token slice.

    The padding (``pad < sp`` tokens, at the end) is a sequence of its own for the attention kernels,
    with label -100, so it neither attends to nor is attended by real tokens and counts in no loss.
    Position ids are the row's: a slice that starts inside a sequence keeps that sequence's positions.
    ``labels`` come from ``packed.labels`` where the row has them (``Packed``).
    """
    total = packed.num_tokens
    size = sp.size
    padded = -(-total // size) * size
    pad = padded - total
    local = padded // size
    start = sp.rank * local
    labels = getattr(packed, "labels", None)
    input_ids, position_ids = packed.input_ids, packed.position_ids
    if pad:
        input_ids = torch.cat([input_ids, input_ids.new_zeros(pad)])
        position_ids = torch.cat([position_ids, torch.arange(pad, device=position_ids.device)])
        if labels is not None:
            labels = torch.cat([labels, labels.new_full((pad,), IGNORE_INDEX)])
    window = slice(start, start + local)
    layout = getattr(packed, "layout", packed.offsets)
    context = None
    if size > 1:
        device = packed.input_ids.device
        if isinstance(layout, SharedPrefix):  # the padding: a plain sequence of its own
            groups = layout.groups + (((total, total, padded),) if pad else ())
            attention_kwargs = {SHARED_PREFIX: SharedPrefix(groups, device)}
        else:
            attention_kwargs = packed_kwargs(list(layout) + ([padded] if pad else []), device)
        context = UlyssesContext(sp, local, attention_kwargs)
    return SPSlice(
        input_ids=input_ids[window],
        position_ids=position_ids[window],
        labels=None if labels is None else labels[window],
        start=start,
        num_tokens=total,
        layout=layout,
        sp=sp,
        context=context,
    )


@contextlib.contextmanager
def attention_layout(model: nn.Module, sl: SPSlice) -> Iterator[list[int] | SharedPrefix | None]:
    """For the forwards of ``model`` on ``sl`` inside: the layout to pass ``ppo.models``' helpers, and
    with sequence parallelism the ``ULYSSES`` kwarg added to the root's forward (the layout is then None:
    the slice's own offsets mean nothing to the attention, which reads the full row's from the
    context). Without sequence parallelism the slice is the row and its layout is the row's."""
    if sl.context is None:
        yield sl.layout
        return
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in (PACKED_ATTENTION, VARLEN_FLASH):
        # transformers' own attention would ignore the kwarg and attend within the slice only.
        raise ValueError(
            f"sequence parallelism needs {PACKED_ATTENTION} or {VARLEN_FLASH} attention; "
            f"{type(model).__name__} attends with {impl} (see ppo.ulysses.check_heads)"
        )
    context = sl.context

    def add(_module: nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        return args, {**kwargs, ULYSSES: context}

    handle = model.register_forward_pre_hook(add, with_kwargs=True)
    try:
        yield None
    finally:
        handle.remove()
