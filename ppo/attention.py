"""Attention for packed (padding-free) rows, registered with transformers' attention interface.

A packed forward holds ``B`` sequences in one row of ``T`` tokens, with ``position_ids`` restarting at 0
per sequence, no attention mask and no KV cache. Each sequence must attend only to itself, causally.
The boundaries are computed once per micro-batch on the host (``packed_kwargs``) and passed down to
every layer as forward keyword arguments (``cu_seq_lens_q/k``, ``max_length_q/k``, which
transformers' flash_attention_2 also reads, and ``PACKED_OFFSETS``), so no layer reads them back from
the device.

- ``resolve_attn_implementation("auto")``: flash_attention_2 on CUDA where flash-attn imports, else
  ``VARLEN_FLASH`` on CUDA where torch has ``torch.nn.attention.varlen`` (torch >= 2.10: PyTorch's own
  FlashAttention-2 varlen kernel), else ``PACKED_ATTENTION``.
- ``VARLEN_FLASH`` (``varlen_flash_attention``): one varlen FlashAttention call over the whole row.
- ``PACKED_ATTENTION`` (``varlen_sdpa_attention``): causal sdpa per packed sequence, ``sum(l_i^2)``
  work, where transformers' own sdpa and eager apply a block-diagonal mask to a dense ``T x T`` score
  matrix, ``T = sum(l_i)``.
- Every call that is not a packed forward (``generate`` with left padding and a KV cache, padded
  batches) goes to transformers' sdpa, unchanged.
- Shared prefixes (``SHARED_PREFIX``, ``SharedPrefix``): a row whose groups hold a prompt once and its
  responses after it; the prompt attends causally to itself, each response to the prompt's keys and
  values and causally to its own (``ppo.packing.pack(..., share_prompts=True)`` builds such rows). Both
  packed kernels implement it; transformers' own would attend across responses, so it needs one of them.
- Sequence parallelism (``ppo.ulysses``): a forward whose kwargs carry ``ULYSSES`` runs on this rank's
  slice of a packed row; both packed kernels then exchange heads for tokens around the attention proper
  (one all-to-all before, one after) and attend over the whole row with its offsets. Without the kwarg
  nothing changes.

This module is what breaks when transformers changes its attention or mask interfaces
(``AttentionInterface``, ``AttentionMaskInterface``, ``sdpa_attention_forward``, ``sdpa_mask``); the
models load with these names once it is imported (``ppo.models`` does).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

from ppo.config import SP_ATTENTION, ConfigError

PACKED_ATTENTION = "ppo_varlen_sdpa"
"""Name of ``varlen_sdpa_attention`` in transformers' ``AttentionInterface`` (``attn_implementation``).
It contains "sdpa" on purpose: transformers then checks at load time that the model supports sdpa, which
every call that is not a packed forward falls back to."""

VARLEN_FLASH = "ppo_varlen_flash"
"""Name of ``varlen_flash_attention`` (torch's varlen FlashAttention, CUDA only)."""

PACKED_OFFSETS = "ppo_packed_offsets"
"""Forward keyword argument: the row's sequence offsets ``[0, l_0, l_0 + l_1, ..., T]`` on the host."""

ULYSSES = "ppo_ulysses"
"""Forward keyword argument of a sequence-parallel forward on one rank's token slice: the
``ppo.ulysses.UlyssesContext`` (group, slice length, the full row's packed kwargs). Set by ``ppo.ulysses``;
read here only through the context's ``scatter_heads`` / ``gather_heads`` and ``attention_kwargs``."""


SHARED_PREFIX = "ppo_shared_prefix"
"""Forward keyword argument of a shared-prefix row: its ``SharedPrefix`` (in place of ``PACKED_OFFSETS``)."""


class SharedPrefix:
    """Where the groups of a shared-prefix row are, and the index tensors its attention needs (built on
    first use, once per forward, for every layer).

    ``groups``: per group ``(a, b, e_1, ..., e_G)`` (host ints, groups back to back from 0 to ``T``): the
    shared tokens ``[a, b)`` (possibly none) and suffix ``i`` at ``[e_{i-1}, e_i)`` with ``e_0 = b``.
    Query ``t`` of suffix ``i`` attends to keys ``[a, b)`` and ``[e_{i-1}, e_{i-1} + t]``; the shared
    tokens attend causally among themselves. A plain packed row is the case ``a = b`` with one suffix.

    A plain class, not a dataclass: FSDP2's input casting rebuilds dataclasses found in forward kwargs.
    """

    __slots__ = ("groups", "device", "_cache")

    def __init__(self, groups: tuple[tuple[int, ...], ...], device: torch.device | str) -> None:
        check_shared_prefix_groups(groups)
        self.groups = groups
        self.device = torch.device(device)
        self._cache: dict[Any, Any] = {}

    @property
    def num_tokens(self) -> int:
        return self.groups[-1][-1]

    def sdpa_plan(self) -> tuple[list[tuple[int, int, int, torch.Tensor, torch.Tensor]], torch.Tensor]:
        """The calls of the sdpa path and how their outputs go back in row order: per group its shared
        span, then per distinct suffix length ``l`` one call ``(a, b, l, index [G_l, l], mask [l, P + l])``
        (``index``: the row positions of the ``G_l`` suffixes of that length; ``mask``: lower-right causal
        over the ``P`` shared keys and then the suffix's own); a shared span is the call ``(a, b, 0, ...)``
        with empty tensors. ``order [T]``: the row position of each output token in call order, inverted
        (the permutation that puts the concatenated outputs back in row order)."""
        if "sdpa" not in self._cache:
            calls: list[tuple[int, int, int, torch.Tensor, torch.Tensor]] = []
            positions = []
            empty = torch.empty(0, dtype=torch.long)
            for a, b, *ends in self.groups:
                if b > a:
                    calls.append((a, b, 0, empty, empty))
                    positions.append(torch.arange(a, b))
                lengths: dict[int, list[int]] = {}
                for s, e in zip([b, *ends[:-1]], ends, strict=True):
                    lengths.setdefault(e - s, []).append(s)
                for length, starts in lengths.items():
                    index = torch.tensor(starts)[:, None] + torch.arange(length)[None, :]
                    keys = torch.arange(b - a + length)
                    mask = keys[None, :] <= torch.arange(length)[:, None] + (b - a)
                    calls.append((a, b, length, index.to(self.device), mask.to(self.device)))
                    positions.append(index.flatten())
            order = torch.argsort(torch.cat(positions)).to(self.device)
            self._cache["sdpa"] = (calls, order)
        return self._cache["sdpa"]

    def varlen(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
        """The row as one varlen call with separate query and key lengths: ``kv_index [T_k]`` (each
        shared part's keys for itself, then the shared keys again before each suffix's own), ``cu_q``,
        ``cu_k`` (int32) and the longest query and key sequences; with bottom-right causal alignment
        query ``t`` of a sequence of ``l`` queries over ``k`` keys sees keys ``<= t + k - l``."""
        if "varlen" not in self._cache:
            kv, cu_q, cu_k = [], [0], [0]
            for a, b, *ends in self.groups:
                if b > a:
                    kv.append(torch.arange(a, b))
                    cu_q.append(b)
                    cu_k.append(cu_k[-1] + b - a)
                for s, e in zip([b, *ends[:-1]], ends, strict=True):
                    kv.extend([torch.arange(a, b), torch.arange(s, e)])
                    cu_q.append(e)
                    cu_k.append(cu_k[-1] + (b - a) + (e - s))
            longest_q = max(y - x for x, y in itertools.pairwise(cu_q))
            longest_k = max(y - x for x, y in itertools.pairwise(cu_k))
            self._cache["varlen"] = (
                torch.cat(kv).to(self.device),
                torch.tensor(cu_q, dtype=torch.int32).to(self.device),
                torch.tensor(cu_k, dtype=torch.int32).to(self.device),
                longest_q,
                longest_k,
            )
        return self._cache["varlen"]


def check_shared_prefix_groups(groups: tuple[tuple[int, ...], ...]) -> None:
    """Fail unless ``groups`` tile ``[0, T)`` in order with non-empty suffixes (``SharedPrefix``)."""
    at = 0
    for group in groups:
        a, b, *ends = group
        bounds = [b, *ends]
        if a != at or b < a or not ends or any(y <= x for x, y in itertools.pairwise(bounds)):
            raise ValueError(f"shared-prefix group {group} does not continue the row at {at}: {groups}")
        at = ends[-1]
    if not groups:
        raise ValueError("a shared-prefix row with no groups")


class MissingKernelError(ConfigError, ImportError):
    """``model.attn_implementation`` names a kernel whose package (or torch version) is missing: a config
    error (one line at start-up), and an ImportError for callers that catch a missing package."""


def packed_kwargs(offsets: list[int], device: torch.device | str) -> dict[str, Any]:
    """Forward keyword arguments that tell every attention layer where the packed sequences are.

    ``offsets``: ``[B+1]`` host list from 0 to ``T``. One host-to-device copy per micro-batch.
    """
    cu_seqlens = torch.tensor(offsets, dtype=torch.int32).to(device, non_blocking=True)
    longest = max(b - a for a, b in itertools.pairwise(offsets))
    return {
        PACKED_OFFSETS: tuple(offsets),
        "cu_seq_lens_q": cu_seqlens,
        "cu_seq_lens_k": cu_seqlens,
        "max_length_q": longest,
        "max_length_k": longest,
    }


def resolve_attn_implementation(
    name: str, device: torch.device | str, *, sequence_parallel: bool = False, shared_prefix: bool = False
) -> str:
    """The attention kernel to load with (see the module docstring for ``auto``). ``sdpa`` and ``eager``
    are transformers' own (dense block-diagonal mask on packed rows). An explicit flash_attention_2
    without flash_attn (``MissingKernelError``), or a CUDA-only kernel off CUDA (``ConfigError``), fails.

    ``sequence_parallel``: the model runs with Ulysses sequence parallelism, which only this module's
    kernels implement: ``auto`` skips flash_attention_2 (``VARLEN_FLASH`` is the same FlashAttention-2
    algorithm), and any other explicit name fails. ``shared_prefix``: the same, for rows with shared
    prompts (``actor.use_prefix_grouper``), whose two-part attention only this module's kernels know."""
    device = torch.device(device)
    for needed, key in (
        (sequence_parallel, "ulysses_sequence_parallel_size > 1"),
        (shared_prefix, "actor.use_prefix_grouper=true"),
    ):
        if needed and name not in SP_ATTENTION:
            raise ConfigError(
                f"model.attn_implementation={name} cannot run with {key}; "
                f"use auto ({VARLEN_FLASH} on CUDA, {PACKED_ATTENTION} elsewhere)"
            )
    if name == "auto":
        own = sequence_parallel or shared_prefix
        if device.type == "cuda" and _flash_attn_error() is None and not own:
            return "flash_attention_2"
        if device.type == "cuda" and _varlen_attn() is not None:
            return VARLEN_FLASH
        return PACKED_ATTENTION
    if name == "flash_attention_2":
        if (error := _flash_attn_error()) is not None:
            raise MissingKernelError(
                f"model.attn_implementation=flash_attention_2 needs the flash-attn package ({error}); "
                "pip install flash-attn, or use model.attn_implementation=auto|sdpa"
            )
        if device.type != "cuda":
            raise ConfigError(
                f"model.attn_implementation=flash_attention_2 runs on CUDA only, the device is {device}; "
                "use model.attn_implementation=auto"
            )
    if name == VARLEN_FLASH:
        if _varlen_attn() is None:
            raise MissingKernelError(
                f"model.attn_implementation={VARLEN_FLASH} needs torch >= 2.10 (torch.nn.attention.varlen); "
                f"this is torch {torch.__version__}: use model.attn_implementation=auto"
            )
        if device.type != "cuda":
            raise ConfigError(
                f"model.attn_implementation={VARLEN_FLASH} runs on CUDA only, the device is {device}; "
                "use model.attn_implementation=auto"
            )
    return name


def _varlen_attn() -> Any:
    """``torch.nn.attention.varlen.varlen_attn``, or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _flash_attn_error() -> str | None:
    """Why flash_attn cannot be used, or None. Imported, not just found: a wheel built for another
    torch is installed but fails on import (undefined symbol)."""
    if importlib.util.find_spec("flash_attn") is None:
        return "not installed"
    try:
        importlib.import_module("flash_attn")
    except Exception as err:  # ImportError, OSError: an ABI mismatch shows up as either
        return f"installed but not importable: {err}"
    return None


def varlen_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal sdpa per packed sequence; transformers' sdpa for every other call.

    A transformers attention function (``AttentionInterface``, name ``PACKED_ATTENTION``): query
    ``[b, H, q, d]``, key and value ``[b, H_kv, k, d]`` (grouped-query attention when ``H_kv < H``),
    returns ``[b, q, H, d]``. A packed forward is one row (``b = 1``) without a cache (``q = k = T``) and
    without a mask (``varlen_sdpa_mask`` returns none for it), holding the sequences that
    ``PACKED_OFFSETS`` (or else the position ids) delimit; each gets
    ``softmax(q_i k_i^T * scaling + causal) v_i`` on its own tokens, ``sum(l_i^2)`` score entries in all
    instead of the ``T^2`` of a dense block-diagonal mask. Everything else, and a row of one sequence,
    goes to ``sdpa_attention_forward`` as it is. With ``ULYSSES`` in the kwargs, see ``_ulysses_attention``.
    """
    if (context := kwargs.get(ULYSSES)) is not None:
        args = (module, query, key, value, attention_mask, dropout, scaling)
        return _ulysses_attention(varlen_sdpa_attention, context, *args, kwargs)
    if (layout := kwargs.get(SHARED_PREFIX)) is not None:
        _check_shared_prefix_call(module, query, key, attention_mask, layout, kwargs)
        return _shared_prefix_sdpa(query, key, value, layout, dropout, scaling), None
    offsets = _packed_offsets(query, key, attention_mask, kwargs)
    if offsets is None or len(offsets) == 2:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **_plain(kwargs)
        )
    _check_plain_causal(module, kwargs)
    # Grouped-query attention: sdpa broadcasts each key/value head over its query heads.
    gqa = {"enable_gqa": True} if key.shape[1] != query.shape[1] else {}
    outputs = [
        torch.nn.functional.scaled_dot_product_attention(
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            dropout_p=dropout,
            is_causal=True,
            scale=scaling,
            **gqa,
        )
        for start, end in itertools.pairwise(offsets)
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def varlen_flash_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal varlen FlashAttention over a whole packed row (``VARLEN_FLASH``, CUDA); transformers'
    sdpa for every other call.

    Shapes as ``varlen_sdpa_attention``. The kernel takes ``[T, H, d]`` tensors and ``cu_seqlens``;
    where this torch has no grouped-query support (2.10, 2.11) the key/value heads are repeated. With
    ``ULYSSES`` in the kwargs, see ``_ulysses_attention``.
    """
    if (context := kwargs.get(ULYSSES)) is not None:
        args = (module, query, key, value, attention_mask, dropout, scaling)
        return _ulysses_attention(varlen_flash_attention, context, *args, kwargs)
    if (layout := kwargs.get(SHARED_PREFIX)) is not None:
        _check_shared_prefix_call(module, query, key, attention_mask, layout, kwargs)
        if dropout:
            raise NotImplementedError(f"{VARLEN_FLASH} has no attention dropout; models load with it off")
        return _shared_prefix_varlen(query, key, value, layout, scaling), None
    offsets = _packed_offsets(query, key, attention_mask, kwargs)
    if offsets is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **_plain(kwargs)
        )
    _check_plain_causal(module, kwargs)
    if dropout:
        raise NotImplementedError(f"{VARLEN_FLASH} has no attention dropout; models load with it off")
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None:
        cu_seqlens = torch.tensor(offsets, dtype=torch.int32, device=query.device)
    longest = kwargs.get("max_length_q") or max(b - a for a, b in itertools.pairwise(offsets))
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, d]
    out = _causal_varlen(q, k, v, cu_seqlens, cu_seqlens, longest, longest, scaling)
    return out[None], None  # [1, T, H, d]


def _causal_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    longest_q: int,
    longest_k: int,
    scaling: float | None,
) -> torch.Tensor:
    """torch's causal varlen FlashAttention on ``[T, heads, d]`` tensors (bottom-right aligned where a
    sequence has more keys than queries); where this torch has no grouped-query support (2.10, 2.11)
    the key/value heads are repeated."""
    gqa = {}
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in inspect.signature(_varlen_attn()).parameters:
            gqa = {"enable_gqa": True}
        else:
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    return _varlen_attn()(
        q, k, v, cu_q, cu_k, longest_q, longest_k, scale=scaling, window_size=(-1, 0), **gqa
    )


def _shared_prefix_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: SharedPrefix,
    dropout: float,
    scaling: float | None,
) -> torch.Tensor:
    """Two-part attention of a shared-prefix row with sdpa, ``[1, T, H, d]`` (``SharedPrefix.sdpa_plan``):
    per group one causal call over its shared tokens, and per distinct suffix length one call over the
    suffixes of that length, each over ``[shared keys; its own keys]`` with the lower-right causal mask.
    A suffix's call has the same shapes whichever of its group's other suffixes share the row, so its
    result does not depend on them (tested bit for bit: a row alone and in pieces of its group), and
    runs on any layout or token budget agree."""
    gqa = {"enable_gqa": True} if key.shape[1] != query.shape[1] else {}

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **extra: Any) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, scale=scaling, **gqa, **extra
        )

    q_all, k_all, v_all = query[0], key[0], value[0]  # [heads, T, d]
    calls, order = layout.sdpa_plan()
    outputs = []  # [H, tokens, d] each, in call order
    for a, b, length, index, mask in calls:
        if not length:  # the shared tokens, causally among themselves
            outputs.append(sdpa(q_all[:, a:b], k_all[:, a:b], v_all[:, a:b], is_causal=True))
            continue
        rows = index.shape[0]
        q = q_all[:, index].transpose(0, 1)  # [G_l, H, l, d]
        k = torch.cat([k_all[None, :, a:b].expand(rows, -1, -1, -1), k_all[:, index].transpose(0, 1)], dim=2)
        v = torch.cat([v_all[None, :, a:b].expand(rows, -1, -1, -1), v_all[:, index].transpose(0, 1)], dim=2)
        outputs.append(sdpa(q, k, v, attn_mask=mask).transpose(0, 1).flatten(1, 2))
    return torch.cat(outputs, dim=1)[:, order].transpose(0, 1)[None].contiguous()


def _shared_prefix_varlen(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: SharedPrefix, scaling: float | None
) -> torch.Tensor:
    """Two-part attention of a shared-prefix row as one varlen FlashAttention call, ``[1, T, H, d]``: the
    queries are the row itself (each shared part and each suffix a sequence), the keys and values are
    gathered so that each suffix's sequence is ``[shared; its own]`` (``SharedPrefix.varlen``), and
    causal attention aligned bottom-right gives each suffix query every shared key."""
    kv_index, cu_q, cu_k, longest_q, longest_k = layout.varlen()
    q = query[0].transpose(0, 1)  # [T, heads, d]
    k = key[0].transpose(0, 1).index_select(0, kv_index)
    v = value[0].transpose(0, 1).index_select(0, kv_index)
    return _causal_varlen(q, k, v, cu_q, cu_k, longest_q, longest_k, scaling)[None]


def _check_shared_prefix_call(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    layout: SharedPrefix,
    kwargs: dict[str, Any],
) -> None:
    """A shared-prefix row is one packed row without a mask (transformers builds none for it: its
    position ids restart) and without a cache, holding exactly the layout's tokens."""
    tokens = layout.num_tokens
    if (
        attention_mask is not None
        or query.shape[0] != 1
        or query.shape[2] != tokens
        or key.shape[2] != tokens
    ):
        raise RuntimeError(
            f"a shared-prefix forward is one row of {tokens} tokens without a mask or cache; got query "
            f"{tuple(query.shape)}, key {tuple(key.shape)}, "
            f"mask {None if attention_mask is None else tuple(attention_mask.shape)}"
        )
    _check_plain_causal(module, kwargs)


def _ulysses_attention(
    attention: Callable[..., tuple[torch.Tensor, None]],
    context: Any,
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    """``attention`` over whole sequences from this rank's token slice (Ulysses sequence parallelism).

    ``query [1, H, T/sp, d]``, ``key``/``value [1, H_kv, T/sp, d]`` -> all-to-all -> ``[1, H/sp, T, d]``
    (the context repeats key/value heads where ``sp`` does not divide ``H_kv``), ``attention`` with the
    full row's offsets, output ``[1, T, H/sp, d]`` -> all-to-all -> ``[1, T/sp, H, d]``. The slice's own
    mask and position ids play no part: the full row's offsets say where every sequence is. A mask, a
    batch of rows or a cache cannot be sliced that way and fails.
    """
    local = context.local_tokens
    if attention_mask is not None or query.shape[0] != 1 or query.shape[2] != local or key.shape[2] != local:
        raise RuntimeError(
            f"a sequence-parallel forward is one packed row of {local} tokens per rank without a mask or "
            f"cache; got query {tuple(query.shape)}, key {tuple(key.shape)}, "
            f"mask {None if attention_mask is None else tuple(attention_mask.shape)}"
        )
    _check_plain_causal(module, kwargs)
    query, key, value = context.scatter_heads(query, key, value)
    inner = {k: v for k, v in kwargs.items() if k not in (ULYSSES, "position_ids", SHARED_PREFIX)}
    inner.update(context.attention_kwargs)
    out, _ = attention(module, query, key, value, None, dropout=dropout, scaling=scaling, **inner)
    return context.gather_heads(out), None


def _packed_offsets(
    query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict[str, Any]
) -> list[int] | None:
    """The row's sequence offsets ``[0, ..., T]`` for a packed forward, or None for any other call:
    from ``PACKED_OFFSETS`` when the caller passed them, else from the position ids (one device read)."""
    if attention_mask is not None or query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        return None  # a padded batch, or queries after a cached prefix (decoding)
    offsets = kwargs.get(PACKED_OFFSETS)
    if offsets is not None:
        return list(offsets)
    starts = _packed_sequence_starts(query, key, attention_mask, kwargs.get("position_ids"))
    return None if starts is None else [*starts, query.shape[2]]


def _plain(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` without the packed-row arguments, for transformers' own attention functions."""
    return {k: v for k, v in kwargs.items() if k != PACKED_OFFSETS}


def _check_plain_causal(module: nn.Module, kwargs: dict[str, Any]) -> None:
    """The packed kernels know only plain causal attention: fail rather than attend differently."""
    extras = [k for k in ("sliding_window", "softcap", "position_bias") if kwargs.get(k) is not None]
    is_causal = kwargs.get("is_causal")  # as sdpa_attention_forward reads it
    if extras or not (getattr(module, "is_causal", True) if is_causal is None else is_causal):
        raise NotImplementedError(
            f"the packed attention kernels compute plain causal attention per sequence; "
            f"{type(module).__name__} needs {extras or ['non-causal attention']}: load it with "
            "model.attn_implementation=sdpa"
        )


def _packed_sequence_starts(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
) -> list[int] | None:
    """Offsets where the sequences of a packed row start (``[0, ...]``), or None for any other call."""
    if attention_mask is not None or position_ids is None:
        return None
    if query.shape[0] != 1 or query.shape[2] != key.shape[2] or position_ids.numel() != query.shape[2]:
        return None  # a batch of rows, or queries after a cached prefix (decoding)
    positions = position_ids.reshape(-1)
    # A sequence starts wherever the position does not continue the previous one: the rule by which
    # transformers finds packed sequences (masking_utils.find_packed_sequence_indices).
    breaks = (positions[1:] - positions[:-1] != 1).nonzero().flatten() + 1
    return [0, *breaks.tolist()]


def varlen_sdpa_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    mask_function: Callable[..., torch.Tensor] = causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    use_vmap: bool = False,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The mask function of ``PACKED_ATTENTION`` (``AttentionMaskInterface``): none for a packed causal
    row, which ``varlen_sdpa_attention`` splits by its position ids instead, else ``sdpa_mask``.

    Transformers calls it once per forward with the pattern as an index function ``mask_function(b, h,
    q_idx, kv_idx) -> bool``; for a packed row (no padding mask, one row, no cache) that is causal
    within each sequence, and ``sdpa_mask`` would materialize it as a dense ``[1, 1, T, T]`` tensor.
    The pattern is recognized on two diagonals, ``O(T)``: packed causal has no entry above the diagonal
    and a gap below it at each sequence start. Anything else (a plain causal row, padding, a KV cache,
    sliding windows, bidirectional or model-specific overlays) gets exactly sdpa's mask, so
    ``generate`` and padded batches behave as with ``attn_implementation="sdpa"``.
    """
    candidate = (
        attention_mask is None
        and batch_size == 1
        and q_length == kv_length > 1
        and isinstance(q_offset, int)
        and q_offset == 0
        and kv_offset == 0
        and not use_vmap  # or/and overlays (vmap'd, maybe not index-based)
        and kwargs.get("local_size") is None  # sliding window or chunked attention
        and "allow_is_bidirectional_skip" not in kwargs  # create_bidirectional_mask
    )
    if candidate and _is_packed_causal(mask_function, q_length, kwargs.get("device", "cpu")):
        return None
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        use_vmap=use_vmap,
        **kwargs,
    )


def _is_packed_causal(
    mask_function: Callable[..., torch.Tensor], length: int, device: torch.device | str
) -> bool:
    """Whether ``mask_function`` over ``length`` tokens is causal and holds more than one sequence."""
    zero = torch.zeros((), dtype=torch.long, device=device)
    t = torch.arange(length - 1, device=device)
    above = mask_function(zero, zero, t, t + 1)  # (t, t+1): masked in any causal pattern
    below = mask_function(zero, zero, t + 1, t)  # (t+1, t): masked only where sequence t+1 starts
    return not bool(above.any()) and not bool(below.all())


def _register_packed_attention() -> None:
    """Make ``PACKED_ATTENTION`` a valid ``attn_implementation`` (idempotent; runs at import).

    Transformers looks the name up in both registries: the attention function per layer, and the mask
    function once per forward (a name without one would get no mask at all, breaking padded batches).
    """
    AttentionInterface.register(PACKED_ATTENTION, varlen_sdpa_attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, varlen_sdpa_mask)
    AttentionInterface.register(VARLEN_FLASH, varlen_flash_attention)
    AttentionMaskInterface.register(VARLEN_FLASH, varlen_sdpa_mask)


_register_packed_attention()
