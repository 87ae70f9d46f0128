"""Prefill once: HF ``generate`` on a KV cache prepared before the call, so that no token is prefilled twice.

Two reuses, both by token content (never by row position):

- Shared prompts. With ``rollout.n = G`` a rollout's prompt list holds each prompt G times; a plain
  ``generate`` call prefills every copy. ``generate_with_cache`` prefills each distinct token sequence of
  its micro-batch once and copies its keys and values to the rows that repeat it (any rows, consecutive
  or not) before decoding.
- Kept caches (multi-turn). Each turn's ``generate`` call reads the whole trajectory so far as its
  prompt. With a ``KeptCaches`` the rows' caches outlive the call (its input and every generated token
  the call fed back, i.e. all but the last); the next call reuses, for each prompt, the cache of the
  previous call's row whose input the prompt starts with, cropped to the longest common prefix of that
  row's cached tokens and the prompt (a turn cut at its stop string or by the budget, and a row that
  decoded on after its end while others finished, keep exactly the tokens the prompt repeats), and
  prefills only the rest: the tokens of the turn's observation, the chat template's tokens and the
  turn's last generated token. Rows not seen again (finished trajectories) leave the cache.

How a call runs (``generate_with_cache``): every row's tokens are ``kept prefix + new tokens`` (the
prefix from a kept cache, else empty); the prefixes are gathered from their caches into one
left-padded block of ``C`` columns, the new tokens follow in a block of ``N`` columns, each row's
right-aligned (left-padded inside the block). One forward prefills the unique rows' new tokens except
the last column (``[U, N - 1]`` on top of the prefixes), the cache is expanded to the micro-batch's rows
(``DynamicCache.batch_select_indices``), and ``generate`` runs with it, the rows' full tokens
left-padded to ``C + N`` as ``input_ids`` and the attention mask of the cache's layout (the padding of
both blocks masked). ``generate`` then feeds exactly one token per row, each row's last, and samples
from its logits: its decoding loop, its stopping criteria (stop strings read the tail of
``input_ids``, which holds the row's real tokens) and its RNG draws are those of a plain call on the
left-padded rows, which it equals: position ids come from the mask (``cumsum - 1``), so a row's
positions and visible tokens are the same whatever padding lies in between.

Exactness. The same tokens at the same positions under the same mask give the same keys, values and
logits; what differs is only how the batched matmuls and attention are grouped (``[U, N-1]`` then
``[B, 1]`` instead of one ``[B, C + N]`` forward), i.e. floating-point rounding. Greedy tokens and
sampled tokens with the same seed (the loop draws the same ``[B, V]`` rows in the same order) are
identical unless a logit rounding difference flips an argmax or moves a draw across a cumulative
probability boundary (tested token for token on tiny models).

Where it applies (``reusable``): a transformers decoder whose cache is a ``DynamicCache`` of plain
full-attention layers (``DynamicLayer``: Llama, Qwen2/2.5/3, Mistral without a sliding window) and
whose forward takes ``cache`` (``past_key_values`` in earlier releases) and ``logits_to_keep``.
Sliding-window, hybrid or linear-attention caches, and the compiled engine's static cache
(``rollout.compile``: fixed shapes, one compiled graph), decode as before: ``ppo.rollout.decode`` calls
plain ``generate``.

Memory. Shared prefill needs none beyond the micro-batch's cache. Kept caches hold every active row's
keys and values between calls (a plain rollout holds one micro-batch's at a time): ``rows x tokens x
layers x 2 x kv_heads x head_dim`` elements; ``keep_cache=False`` (``ppo.rollout.sample``) re-prefills
instead.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig
from transformers.cache_utils import DynamicLayer


def reusable(decoder: torch.nn.Module) -> bool:
    """Whether ``generate_with_cache`` can run on ``decoder``: a transformers model with ``generate``,
    a forward taking a cache (``_cache_keyword``) and ``logits_to_keep``, and a ``DynamicCache`` of ``DynamicLayer`` layers
    (plain full attention, keys and values ``[B, H_kv, T, D]`` per layer)."""
    config = getattr(decoder, "config", None)
    if config is None or not callable(getattr(decoder, "generate", None)):
        return False
    params = inspect.signature(decoder.forward).parameters
    if _cache_keyword(decoder) is None or "logits_to_keep" not in params:
        return False
    layers = DynamicCache(config=config.get_text_config(decoder=True)).layers
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def _cache_keyword(decoder: torch.nn.Module) -> str | None:
    """The keyword the decoder's forward (and so its ``generate``) takes a KV cache by: ``cache``
    (transformers 5.25), ``past_key_values`` (earlier releases), or None."""
    params = inspect.signature(decoder.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in params), None)


def left_pad(
    seqs: list[torch.Tensor], pad_token_id: int, device: torch.device, *, multiple_of: int = 1, width: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token tensors to ``[B, width]`` with the matching attention mask; ``width`` is at least
    the longest, rounded up to a multiple of ``multiple_of``."""
    width = max(width, -(-max(s.numel() for s in seqs) // multiple_of) * multiple_of)
    ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(seqs), width), dtype=torch.long, device=device)
    for i, s in enumerate(seqs):
        if s.numel():
            ids[i, width - s.numel() :] = s.to(device)
            mask[i, width - s.numel() :] = 1
    return ids, mask


@dataclass(frozen=True, eq=False)
class CachedRow:
    """One row's keys and values after a ``generate_with_cache`` call: its ``tokens`` sit in row ``row``
    of ``cache``, the kept prefix in columns ``[prefix_start, prefix_end)`` and the rest from column
    ``rest_start`` on (the call's layout), in order."""

    cache: DynamicCache
    row: int
    prefix_start: int
    prefix_end: int
    rest_start: int
    tokens: list[int]
    """The call's input for this row, then the generated tokens the call fed back (all but the last)."""
    input_len: int
    """How many of ``tokens`` were the call's input: a later prompt that starts with them reuses this row."""


@dataclass
class KeptCaches:
    """The rows' caches of the last ``decode`` call that kept them (``ppo.rollout.decode(kept=...)``), in
    that call's row order; each call matches its prompts to them in order (``match``) and keeps its own.

    One per rollout (the multi-turn loop's turns are its calls); rows must keep their relative order
    from call to call (rows may drop out), which ``ppo.multi_turn.run_turns`` does. A prompt that matches
    no kept row is prefilled whole."""

    rows: list[CachedRow | None] = field(default_factory=list)
    """The previous call's rows; an entry is released (None) once a prompt has passed it."""
    fresh: list[CachedRow] = field(default_factory=list)
    """This call's rows so far."""
    cursor: int = 0

    def start_call(self) -> None:
        """Begin a call: the last call's rows become the ones to match."""
        self.rows, self.fresh, self.cursor = list(self.fresh), [], 0

    def match(self, prompts: list[list[int]]) -> list[CachedRow | None]:
        """For each prompt in order, the next kept row whose input the prompt starts with (rows before it,
        never matched, are released), or None."""
        out: list[CachedRow | None] = []
        for prompt in prompts:
            i = self.cursor
            while i < len(self.rows) and not _extends(prompt, self.rows[i]):
                i += 1
            if i == len(self.rows):
                out.append(None)
                continue
            out.append(self.rows[i])
            self.rows[self.cursor : i + 1] = [None] * (i + 1 - self.cursor)
            self.cursor = i + 1
        return out


def _extends(prompt: list[int], row: CachedRow | None) -> bool:
    """``prompt`` starts with ``row``'s input (its last token compared first: a cheap rejection)."""
    n = row.input_len if row is not None else 0
    return n > 0 and len(prompt) >= n and prompt[n - 1] == row.tokens[n - 1] and prompt[:n] == row.tokens[:n]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if a[:mid] == b[:mid] else (lo, mid)
    return lo


@torch.no_grad()
def generate_with_cache(
    decoder: torch.nn.Module,
    prompts: list[list[int]],
    config: GenerationConfig,
    *,
    past: list[CachedRow | None] | None = None,
    share: bool = True,
    keep: bool = False,
    tokenizer: Any = None,
) -> tuple[torch.Tensor, list[CachedRow]]:
    """``generate`` for ``prompts`` (one row each, every prompt at least one token) on a cache prepared as
    in the module docstring: ``([B, S]`` generated tokens, as ``generate`` returns them after the input
    (``S <= config.max_new_tokens``), and with ``keep`` each row's ``CachedRow``, else ``[]``).

    ``past``: per row a kept cache to reuse (``KeptCaches.match``) or None. ``share``: prefill identical
    rows (same tokens, nothing reused) once. ``tokenizer``: for ``config.stop_strings``.
    """
    device = next(decoder.parameters()).device
    text_config = decoder.config.get_text_config(decoder=True)
    b = len(prompts)
    past = past if past is not None else [None] * b
    kept = [
        0 if p is None else min(_common_prefix(p.tokens, s), len(s) - 1)
        for p, s in zip(past, prompts, strict=True)
    ]
    news = [s[k:] for s, k in zip(prompts, kept, strict=True)]
    c, n = max(kept), max(len(x) for x in news)
    # The rows to prefill: one per distinct prompt among rows that reuse nothing (``share``); each other
    # row is its own. ``inverse[j]``: the prefilled row whose cache row j gets.
    firsts: dict[Any, int] = {}
    inverse, reps = [], []
    for j, (s, k) in enumerate(zip(prompts, kept, strict=True)):
        key = tuple(s) if share and k == 0 else ("row", j)
        if key not in firsts:
            firsts[key] = len(reps)
            reps.append(j)
        inverse.append(firsts[key])
    cache = _gather([past[j] for j in reps], [kept[j] for j in reps], c, text_config, device)
    prefix_mask = (torch.arange(c, device=device) >= c - torch.tensor(kept, device=device)[:, None]).long()
    block_ids, block_mask = left_pad(
        [torch.tensor(x, dtype=torch.long) for x in news], config.pad_token_id, device
    )
    mask = torch.cat([prefix_mask, block_mask], dim=1)  # [B, C + N]: the cache's layout
    if n > 1:  # prefill each unique row's new tokens but the last, on top of its prefix
        rep_index = torch.tensor(reps, device=device)
        rep_mask = mask[rep_index, : c + n - 1]
        positions = (rep_mask.cumsum(-1) - 1).masked_fill(rep_mask == 0, 0)[:, c:]
        decoder(
            input_ids=block_ids[rep_index, : n - 1],
            attention_mask=rep_mask,
            position_ids=positions,
            **{_cache_keyword(decoder): cache},
            use_cache=True,
            logits_to_keep=1,
        )
    if inverse != list(range(b)):
        cache.batch_select_indices(torch.tensor(inverse, device=device))
    input_ids, _ = left_pad(
        [torch.tensor(s, dtype=torch.long) for s in prompts], config.pad_token_id, device, width=c + n
    )
    extra = {"tokenizer": tokenizer} if tokenizer is not None else {}
    out = decoder.generate(
        input_ids=input_ids,
        attention_mask=mask,
        generation_config=config,
        **{_cache_keyword(decoder): cache},
        **extra,
    )
    generated = out[:, c + n :]
    if not keep:
        return generated, []
    fed_back = cache.get_seq_length() - (c + n)  # generated tokens in the cache: all but the last
    if not 0 <= fed_back <= generated.shape[1]:
        raise RuntimeError(f"generate left {cache.get_seq_length()} cache columns for {c + n} input columns")
    tail = generated[:, :fed_back].tolist()
    rows = [
        CachedRow(cache=cache, row=j, prefix_start=c - kept[j], prefix_end=c, rest_start=c + n - len(news[j]),
                  tokens=prompts[j] + tail[j], input_len=len(prompts[j]))
        for j in range(b)
    ]  # fmt: skip
    return generated, rows


def _gather(
    rows: list[CachedRow | None], lengths: list[int], width: int, text_config: Any, device: torch.device
) -> DynamicCache:
    """A ``DynamicCache`` of ``len(rows)`` rows and ``width`` columns holding each row's first
    ``lengths[i]`` cached tokens right-aligned (left-padded with zeros, which the mask hides), gathered
    from the rows' own caches (one indexing per layer and source cache)."""
    if width == 0:
        return DynamicCache(config=text_config)
    by_source: dict[int, list[int]] = {}
    for i, (row, length) in enumerate(zip(rows, lengths, strict=True)):
        if row is not None and length > 0:
            by_source.setdefault(id(row.cache), []).append(i)
    some = rows[next(iter(by_source.values()))[0]].cache
    num_layers = len(some.layers)
    shape = (len(rows), some.layers[0].keys.shape[1], width, some.layers[0].keys.shape[3])
    keys = [torch.zeros(shape, dtype=some.layers[0].keys.dtype, device=device) for _ in range(num_layers)]
    values = [torch.zeros_like(k) for k in keys]
    columns = torch.arange(width, device=device)
    for targets in by_source.values():
        source = rows[targets[0]].cache
        picked = [rows[i] for i in targets]
        length = torch.tensor([lengths[i] for i in targets], device=device)[:, None]
        start = torch.tensor([r.prefix_start for r in picked], device=device)[:, None]
        prefix = torch.tensor([r.prefix_end - r.prefix_start for r in picked], device=device)[:, None]
        rest = torch.tensor([r.rest_start for r in picked], device=device)[:, None]
        k = columns - (width - length)  # [m, width]: which of the row's cached tokens each column holds
        index = torch.where(k < prefix, start + k, rest + k - prefix).clamp(min=0)
        valid = (k >= 0)[:, None, :, None]
        src_rows = torch.tensor([r.row for r in picked], device=device)[:, None]
        dst = torch.tensor(targets, device=device)
        for layer in range(num_layers):
            for out, src in ((keys, source.layers[layer].keys), (values, source.layers[layer].values)):
                # [m, width, H, D] -> [m, H, width, D], zero where the row has no token
                out[layer][dst] = src[src_rows, :, index].transpose(1, 2).masked_fill(~valid, 0)
    return DynamicCache(ddp_cache_data=list(zip(keys, values, strict=True)), config=text_config)
