"""Padding-free sequences and token-budget micro-batches, for every trainer (PPO, SFT, reward model).

Every training and scoring forward runs on packed sequences: the tokens of ``B`` sequences are
concatenated into one row of ``T`` tokens, position ids restart at 0 for each sequence,
``cu_seqlens [B+1]`` marks the boundaries, and the model runs with no attention mask and
``use_cache=False`` (with a cache, transformers silently ignores the packing; see
``docs/platform.md``). The packed attention kernels (``ppo.attention``) read the boundaries from the
host-side offsets; transformers' plain sdpa and eager attend through a dense block-diagonal mask. PPO's
token quantities come back as ``[B, R]`` over response tokens (``unpack``), the layout of
``ppo.algorithms``; the forwards on packed rows are ``ppo.ulysses``'s (with or without sequence
parallelism).

Shared prefixes (``actor.use_prefix_grouper``): with ``share_prompts`` the rows of one prompt (its
``rollout.n`` responses) are packed as the prompt without its last token, once, then per response a
suffix of the prompt's last token and the response (positions continuing the prompt's). Each suffix
attends to the shared tokens and causally to itself (``ppo.attention.SharedPrefix``), so every token
sees exactly what it sees in its own sequence and the results equal the plain layout's; repeating the
last prompt token keeps one label per position, so the same kernels compute log-probs, entropy and
values, and the shared tokens' gradient is the sum over the responses. A group of ``G`` responses to a
prompt of ``P`` tokens takes ``P - 1 + G`` tokens of prompt instead of ``G P``.

Micro-batches are cut by a token budget and balanced by length (longest-first greedy partition, the
classic LPT heuristic), with their count agreed across ranks so every rank makes the same number of
forward/backward calls. With shared prefixes the budget counts the shared layout's tokens and keeps a
prompt's responses together, splitting them (the prompt then repeated in each piece) only where one
prompt's group exceeds the budget or a rank needs more micro-batches than it has prompts.

    packed = pack_sequences([[1, 2, 3], [4, 5]], device)        # SFT / reward model
    packed = pack(prompts, responses, response_mask)            # PPO: prompt + response
    logprobs, entropy = packed_forward.logprobs(actor, packed, ulysses.NO_SP, temperature=1.0)  # [B, R]
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ppo.attention import SharedPrefix
from ppo.batch import Batch, Rollout
from ppo.config import ActorConfig, CriticConfig
from ppo.distributed import all_reduce_scalar


@dataclass(kw_only=True)
class PackedSequences:
    """``B`` token sequences as one padding-free row."""

    input_ids: torch.Tensor
    """[T] token ids of all sequences back to back."""
    position_ids: torch.Tensor
    """[T] positions, restarting at 0 for each sequence."""
    cu_seqlens: torch.Tensor
    """[B+1] int32 offsets of the sequences in the row."""
    offsets: list[int]
    """``cu_seqlens`` on the host (the attention layers read it without a device sync)."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


@dataclass(kw_only=True)
class Packed(PackedSequences):
    """PPO's ``B`` sequences (prompt + the response's valid tokens) as one row, with the map back to the
    ``[B, R]`` response layout."""

    labels: torch.Tensor
    """[T] the next token where it is a response token, -100 elsewhere (prompt, last token)."""
    response_index: torch.Tensor
    """[B, R] packed position whose next-token prediction is response token j (0 at padding)."""
    attention_mask: torch.Tensor
    """[B, R] bool, True on the response tokens that exist (packed)."""
    shared: SharedPrefix | None = None
    """The shared-prefix layout of the row (``pack(..., share_prompts=True)``), None for plain packed
    sequences (``offsets``)."""

    @property
    def layout(self) -> list[int] | SharedPrefix:
        """What the attention layers need to know of the row (``ppo.models.Layout``)."""
        return self.offsets if self.shared is None else self.shared


def pack_sequences(seqs: Sequence[Sequence[int]], device: torch.device | str) -> PackedSequences:
    """Concatenate token lists into ``[T]`` with restarting position ids and ``cu_seqlens [B+1]``.

    Built on the host and copied to ``device`` once per tensor.
    """
    lengths = [len(s) for s in seqs]
    if not lengths or min(lengths) == 0:
        raise ValueError(f"cannot pack an empty sequence (lengths {lengths})")
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    positions = np.arange(offsets[-1]) - np.repeat(offsets[:-1], lengths)
    return PackedSequences(
        input_ids=torch.tensor([t for s in seqs for t in s], dtype=torch.long).to(device),
        position_ids=torch.from_numpy(positions).to(device),
        cu_seqlens=torch.from_numpy(offsets.astype(np.int32)).to(device),
        offsets=offsets.tolist(),
    )


def pack(
    prompts: list[torch.Tensor],
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    share_prompts: bool = False,
) -> Packed:
    """Pack prompts ``[P_i]`` and right-padded responses ``[B, R]`` (valid where ``response_mask``).

    Response token ``j`` of sequence ``i`` is predicted at packed position ``start_i + P_i - 1 + j``:
    logits there give its log-prob and the critic's value there is the value of the state before it.
    ``share_prompts``: identical prompts once (see the module docstring); response token ``j`` is then
    predicted at its suffix's start ``+ j``. A prompt with one response has the plain sequence's tokens
    and positions, and its attention is computed in the same two parts as a group's, so that a row's
    results do not depend on which of its group's rows share its micro-batch.
    """
    if share_prompts:
        return _pack_shared(prompts, responses, response_mask, prompt_groups(prompts))
    device = responses.device
    mask = response_mask.bool()
    resp_lens = mask.sum(dim=-1).tolist()
    rows = responses.tolist()
    seqs = [p.tolist() + row[: int(n)] for p, row, n in zip(prompts, rows, resp_lens, strict=True)]
    base = pack_sequences(seqs, device)
    prompt_lens = torch.tensor([p.numel() for p in prompts], device=device)
    j = torch.arange(responses.shape[1], device=device)
    response_index = (base.cu_seqlens[:-1].long() + prompt_lens - 1)[:, None] + j[None, :]
    response_index = torch.where(mask, response_index, torch.zeros_like(response_index))
    labels = torch.full_like(base.input_ids, -100)
    labels[response_index[mask]] = responses[mask]
    return Packed(
        input_ids=base.input_ids,
        position_ids=base.position_ids,
        cu_seqlens=base.cu_seqlens,
        offsets=base.offsets,
        labels=labels,
        response_index=response_index,
        attention_mask=mask,
    )


def prompt_groups(prompts: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of identical prompts (by their tokens), grouped in the order of first appearance."""
    return _groups_of([tuple(p.tolist()) for p in prompts])


def _groups_of(keys: Sequence[tuple[int, ...]]) -> list[list[int]]:
    """``prompt_groups`` of prompts given by their tokens as tuples."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def _pack_shared(
    prompts: list[torch.Tensor], responses: torch.Tensor, response_mask: torch.Tensor, groups: list[list[int]]
) -> Packed:
    """``pack(..., share_prompts=True)`` for ``groups`` of identical prompts (``prompt_groups``)."""
    device = responses.device
    mask = response_mask.bool()
    resp_lens = [int(n) for n in mask.sum(dim=-1).tolist()]
    rows = responses.tolist()
    ids: list[int] = []
    positions: list[int] = []
    first = [0] * len(prompts)  # packed position that predicts each row's response token 0
    bounds: list[tuple[int, ...]] = []
    for group in groups:
        prompt = prompts[group[0]].tolist()
        length = len(prompt)
        start = len(ids)
        ids += prompt[:-1]
        positions += range(length - 1)
        ends = []
        for i in group:
            first[i] = len(ids)
            ids += prompt[-1:] + rows[i][: resp_lens[i]]
            positions += range(length - 1, length + resp_lens[i])
            ends.append(len(ids))
        bounds.append((start, start + length - 1, *ends))
    offsets = sorted({0, *(x for b in bounds for x in b)})
    j = torch.arange(responses.shape[1], device=device)
    response_index = torch.tensor(first, device=device)[:, None] + j[None, :]
    response_index = torch.where(mask, response_index, torch.zeros_like(response_index))
    input_ids = torch.tensor(ids, dtype=torch.long).to(device)
    labels = torch.full_like(input_ids, -100)
    labels[response_index[mask]] = responses[mask]
    return Packed(
        input_ids=input_ids,
        position_ids=torch.tensor(positions, dtype=torch.long).to(device),
        cu_seqlens=torch.tensor(offsets, dtype=torch.int32).to(device),
        offsets=offsets,
        labels=labels,
        response_index=response_index,
        attention_mask=mask,
        shared=SharedPrefix(tuple(bounds), device),
    )


def unpack(x: torch.Tensor, packed: Packed) -> torch.Tensor:
    """Gather a per-token quantity ``[T, ...]`` into the response layout ``[B, R, ...]`` (0 at padding)."""
    out = x[packed.response_index]
    mask = packed.attention_mask.view(*packed.attention_mask.shape, *([1] * (x.dim() - 1)))
    return torch.where(mask, out, torch.zeros_like(out))


def repack(x: torch.Tensor, packed: Packed) -> torch.Tensor:
    """The inverse of ``unpack``: a quantity ``[B, R, ...]`` of the response tokens placed at the packed
    positions that predict them, ``[T, ...]`` (0 elsewhere)."""
    out = x.new_zeros((packed.num_tokens, *x.shape[2:]))
    mask = packed.attention_mask
    out[packed.response_index[mask]] = x[mask]
    return out


# ----------------------------------------------------------------------------------------------------
# Micro-batches
# ----------------------------------------------------------------------------------------------------


def balanced_partition(lengths: list[int], k: int) -> list[list[int]]:
    """Split indices into ``k`` non-empty groups with near-equal total length.

    Longest-first greedy: each sequence, longest first, goes to the group with the smallest total
    (ties to the lower group index, so the result is deterministic). Needs ``k <= len(lengths)``.
    Indices inside each group are sorted; groups are ordered by their first index.
    """
    if not 1 <= k <= len(lengths):
        raise ValueError(f"cannot split {len(lengths)} sequences into {k} micro-batches")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    heap = [(0, g) for g in range(k)]
    groups: list[list[int]] = [[] for _ in range(k)]
    for i in order:
        total, g = heapq.heappop(heap)
        groups[g].append(i)
        heapq.heappush(heap, (total + lengths[i], g))
    return sorted((sorted(g) for g in groups), key=lambda g: g[0])


def min_micro_batches(lengths: list[int], max_tokens: int) -> int:
    """The fewest balanced groups whose every total fits ``max_tokens`` (a lone longer sequence
    gets a group of its own)."""
    k = max(1, -(-sum(lengths) // max_tokens))
    while (
        k < len(lengths)
        and max(sum(lengths[i] for i in g) for g in balanced_partition(lengths, k)) > max_tokens
    ):
        k += 1
    return min(k, len(lengths))


def plan_micro_batches(
    lengths: list[int], *, use_dynamic_bsz: bool, max_tokens: int, micro_batch_size: int
) -> list[list[int]]:
    """Index groups for the micro-batches of one mini-batch on this rank.

    Dynamic: the fewest token-budget groups any rank needs, maxed over ranks (one all-reduce, so all
    ranks run the same number of forward/backward passes), then balanced by length. Fixed: consecutive
    groups of ``micro_batch_size`` sequences (the same count on every rank, by the config's
    ``validate``: every rank holds the same number of sequences).
    """
    if not lengths:
        raise ValueError("a mini-batch with no sequences")
    if not use_dynamic_bsz:
        return [
            list(range(i, min(i + micro_batch_size, len(lengths))))
            for i in range(0, len(lengths), micro_batch_size)
        ]
    k = int(all_reduce_scalar(min_micro_batches(lengths, max_tokens), "max"))
    return balanced_partition(lengths, min(k, len(lengths)))


def plan_eval_micro_batches(
    lengths: list[int], *, use_dynamic_bsz: bool, max_tokens: int, micro_batch_size: int
) -> list[list[int]]:
    """Index groups of this rank's evaluation examples, the same number of groups on every rank.

    Evaluation shares differ in size (and may be empty), so ranks that need fewer groups get empty
    ones at the end; the caller runs a forward of ``DUMMY_SEQUENCE`` for those (each forward of a
    sharded model is a collective every rank must join).
    """
    if use_dynamic_bsz:
        needed = min_micro_batches(lengths, max_tokens) if lengths else 0
    else:
        needed = -(-len(lengths) // micro_batch_size)
    count = int(all_reduce_scalar(float(needed), "max"))
    if not lengths:
        return [[] for _ in range(count)]
    if use_dynamic_bsz:
        groups = balanced_partition(lengths, min(count, len(lengths)))
    else:
        groups = [
            list(range(i, min(i + micro_batch_size, len(lengths))))
            for i in range(0, len(lengths), micro_batch_size)
        ]
    return groups + [[] for _ in range(count - len(groups))]


DUMMY_SEQUENCE = [0]
"""The one-token sequence a rank with an empty evaluation group forwards (and ignores)."""


# ----------------------------------------------------------------------------------------------------
# A step batch's micro-batches
# ----------------------------------------------------------------------------------------------------


def shared_tokens(prompt_len: int, response_lens: Sequence[int]) -> int:
    """Tokens of one prompt's responses packed with the prompt once: ``P - 1 + sum(1 + n_i)``, or
    ``P + n`` for a single response (a plain sequence)."""
    if len(response_lens) == 1:
        return prompt_len + response_lens[0]
    return prompt_len - 1 + sum(1 + n for n in response_lens)


def plan_shared_micro_batches(
    prompt_lens: list[int],
    response_lens: list[int],
    groups: list[list[int]],
    *,
    use_dynamic_bsz: bool,
    max_tokens: int,
    micro_batch_size: int,
) -> list[list[int]]:
    """``plan_micro_batches`` for rows packed with shared prompts: ``groups`` are the indices of rows with
    identical prompts (``prompt_groups``).

    Fixed: the rows in group order, ``micro_batch_size`` at a time (the plain plan's count). Dynamic: each
    group is one unit of ``shared_tokens``, cut into consecutive pieces where it exceeds ``max_tokens``
    (each piece repeats the prompt; a lone longer response is a piece of its own); the fewest
    micro-batches any rank needs, maxed over ranks (one all-reduce), and where this rank has fewer
    units than that, its unit of most rows is halved until it has as many (every rank holds the same
    number of rows, so it can); then the units are balanced by tokens (``balanced_partition``).
    """
    if not prompt_lens:
        raise ValueError("a mini-batch with no sequences")
    if not use_dynamic_bsz:
        order = [i for g in groups for i in g]
        return [sorted(order[i : i + micro_batch_size]) for i in range(0, len(order), micro_batch_size)]

    def tokens(unit: list[int]) -> int:
        return shared_tokens(prompt_lens[unit[0]], [response_lens[i] for i in unit])

    units: list[list[int]] = []
    for group in groups:
        piece: list[int] = []
        for i in group:
            if piece and tokens([*piece, i]) > max_tokens:
                units.append(piece)
                piece = []
            piece.append(i)
        units.append(piece)
    k = int(all_reduce_scalar(min_micro_batches([tokens(u) for u in units], max_tokens), "max"))
    while len(units) < k:
        widest = max(range(len(units)), key=lambda u: (len(units[u]), tokens(units[u]), -u))
        unit = units[widest]
        if len(unit) == 1:  # fewer rows than micro-batches: the ranks hold different numbers of rows
            raise ValueError(f"{len(prompt_lens)} rows cannot fill the {k} micro-batches other ranks need")
        units[widest : widest + 1] = [unit[: len(unit) // 2], unit[len(unit) // 2 :]]
    parts = balanced_partition([tokens(u) for u in units], k)
    return [sorted(i for u in part for i in units[u]) for part in parts]


def micro_batches(
    batch: Batch, idx: torch.Tensor, role: ActorConfig | CriticConfig, micro_batch_size: int | None = None
) -> list[torch.Tensor]:
    """Micro-batches (index tensors into the batch) of the sequences ``idx``, agreed across ranks: the
    role's token budget with dynamic batch size, else ``micro_batch_size`` (default the role's); with
    ``batch.share_prompts`` by ``plan_shared_micro_batches``. The lengths come from the step's
    ``PackCache`` (read to the host once per step)."""
    plan = {
        "use_dynamic_bsz": role.use_dynamic_bsz,
        # A sequence-parallel group splits each micro-batch over its ranks: its budget is theirs together.
        "max_tokens": role.ppo_max_token_len_per_gpu * role.ulysses_sequence_parallel_size,
        "micro_batch_size": micro_batch_size or role.ppo_micro_batch_size_per_gpu,
    }
    rows = idx.tolist()
    cache = pack_cache(batch)
    if batch.share_prompts:
        groups = plan_shared_micro_batches(
            [cache.prompt_lens[i] for i in rows],
            [cache.response_lens[i] for i in rows],
            _groups_of(cache.prompt_keys(rows)),
            **plan,
        )
    else:
        groups = plan_micro_batches([cache.lengths[i] for i in rows], **plan)
    return [idx[torch.tensor(g, dtype=torch.long, device=idx.device)] for g in groups]


def pack_rows(batch: Batch, sel: torch.Tensor) -> Packed:
    """The rows ``sel`` of ``batch`` packed, each prompt once with ``batch.share_prompts``: built once per
    step for a selection (``PackCache``; the same ``Packed`` again for the same rows in the same order),
    equal to ``pack`` of those rows."""
    rows = sel.tolist()
    cache = pack_cache(batch)
    key = (batch.share_prompts, tuple(rows))
    packed = cache.packed.get(key)
    if packed is not None:
        return packed
    if not rows:  # nothing to pack: pack's error
        return pack(
            [], batch.rollout.responses[sel], batch.attention_mask[sel], share_prompts=batch.share_prompts
        )
    if batch.share_prompts:
        packed = _pack_shared(
            [batch.rollout.prompts[i] for i in rows],
            batch.rollout.responses[sel],
            batch.attention_mask[sel],
            _groups_of(cache.prompt_keys(rows)),
        )
    else:
        packed = cache.gather(sel, rows)
    cache.packed[key] = packed
    return packed


@dataclass(kw_only=True)
class PackCache:
    """A step batch's packing, kept on the batch for the step (``Batch.pack_cache``; ``pack_cache``).

    The scoring forwards (old and reference log-probs, values, teachers) pack the same micro-batches one
    after another, and every update packs rows packed before in another order. Per row, the lengths and
    the prompt's tokens are read to the host once; the batch's rows are packed plainly once (``rows``,
    on first use), and a selection's plain row is gathered from it on the device (``gather``: no token
    lists on the host, an index and the offsets copied to the device); each selection's ``Packed`` is
    kept (``packed``, keyed by ``batch.share_prompts`` and the rows in order), so a repeated selection
    costs a dictionary look-up. What it holds (about 32 bytes per packed token and selection: the token
    ids, positions, labels and response index) goes with the batch at the step's end.
    """

    rollout: Rollout
    """The rollout the cache was built from: a batch given another one gets a new cache."""
    prompt_lens: list[int]
    """[B] prompt tokens of each row."""
    response_lens: list[int]
    """[B] valid response tokens of each row (``batch.attention_mask``)."""
    lengths: list[int]
    """[B] packed length of each row (prompt + valid response tokens; ``Batch.seq_lens``)."""
    packed: dict[tuple[bool, tuple[int, ...]], Packed] = field(default_factory=dict)
    """Each selection's packed row, by ``(share_prompts, rows)``."""
    rows: Packed | None = None
    """Every row of the batch plainly packed, in order (built by the first ``gather``)."""
    tokens: torch.Tensor | None = None
    """[3, T] ``rows``' input ids, position ids and labels, gathered in one indexing."""
    keys: list[tuple[int, ...]] | None = None
    """Each row's prompt tokens as a tuple (built by the first ``prompt_keys``)."""

    @classmethod
    def build(cls, batch: Batch) -> PackCache:
        """The cache of ``batch``'s rollout, with its rows' lengths (one read of the mask to the host)."""
        rollout = batch.rollout
        prompt_lens = [p.numel() for p in rollout.prompts]
        response_lens = [int(n) for n in batch.attention_mask.sum(-1).tolist()]
        return cls(
            rollout=rollout,
            prompt_lens=prompt_lens,
            response_lens=response_lens,
            lengths=[p + n for p, n in zip(prompt_lens, response_lens, strict=True)],
        )

    def prompt_keys(self, rows: list[int]) -> list[tuple[int, ...]]:
        """The prompt tokens of ``rows`` as tuples (``prompt_groups``' keys), read once per step."""
        if self.keys is None:
            self.keys = [tuple(p.tolist()) for p in self.rollout.prompts]
        return [self.keys[i] for i in rows]

    def gather(self, sel: torch.Tensor, rows: list[int]) -> Packed:
        """The rows ``sel`` (``rows`` on the host, not empty) plainly packed, from every row packed once:
        ``pack`` of those rows, value for value."""
        if self.rows is None:
            r = self.rollout
            self.rows = pack(r.prompts, r.responses, r.attention_mask)
            self.tokens = torch.stack([self.rows.input_ids, self.rows.position_ids, self.rows.labels])
        full = self.rows
        lengths = np.array([self.lengths[i] for i in rows], dtype=np.int64)
        starts = np.array([full.offsets[i] for i in rows], dtype=np.int64)
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        # Token t of the selection is token t - offsets[i] + starts[i] of the full row, for its row i.
        source = np.arange(offsets[-1]) + np.repeat(starts - offsets[:-1], lengths)
        device = full.input_ids.device
        input_ids, position_ids, labels = self.tokens[:, torch.from_numpy(source).to(device)]
        shift = torch.from_numpy(offsets[:-1] - starts).to(device)
        mask = full.attention_mask[sel]
        response_index = full.response_index[sel] + shift[:, None]
        return Packed(
            input_ids=input_ids,
            position_ids=position_ids,
            cu_seqlens=torch.from_numpy(offsets.astype(np.int32)).to(device),
            offsets=offsets.tolist(),
            labels=labels,
            response_index=torch.where(mask, response_index, torch.zeros_like(response_index)),
            attention_mask=mask,
        )


def pack_cache(batch: Batch) -> PackCache:
    """The step's ``PackCache`` of ``batch``, built on first use (and again if the batch's rollout was
    replaced)."""
    cache = batch.pack_cache
    if not isinstance(cache, PackCache) or cache.rollout is not batch.rollout:
        cache = batch.pack_cache = PackCache.build(batch)
    return cache
