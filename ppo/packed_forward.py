"""The forwards of packed rows, in one direction: a row built once by ``ppo.packing`` (plain packed
sequences, or shared prefixes) -> this rank's part of it (``ulysses.slice_for_rank``: the row itself,
or with Ulysses sequence parallelism its token slice) -> the model with the row's attention layout
(``ulysses.attention_layout``, ``ppo.models``) -> the kernels (``ppo_kernels``) -> the row's per-token
outputs (``SPSlice.gather``: over the sequence-parallel group, the identity without) -> the ``[B, R]``
response layout (``packing.unpack``). Sequence parallelism wraps the forward at its two ends (the slice
and the gather) and in the attention layers (``ppo.attention``); nothing else here knows of it.

The row-level functions are every trainer's forwards on packed rows (PPO's scoring and updates, PRIME's
PRM, distillation's teachers, DPO, evaluation); the ``part_*`` ones return this rank's part's per-token
outputs, for other per-token quantities (the exact KL over the vocabulary).

    packed = packing.pack_rows(batch, sel)                  # [T] tokens, [B, R] map back
    logprobs, entropy = packed_forward.logprobs(actor, packed, sp, temperature=1.0, compute_entropy=True)
    values = packed_forward.values(critic, packed, sp)      # [B, R]
"""

from __future__ import annotations

import torch
from torch import nn

import ppo_kernels
from ppo import models, packing, ulysses
from ppo.packing import Packed


def part_logits(model: nn.Module, sl: ulysses.SPSlice) -> torch.Tensor:
    """Next-token logits of the slice's tokens, ``[T_local, vocab]`` in the compute dtype (collective:
    every rank of the group calls it, and runs the backward if there is one)."""
    with ulysses.attention_layout(model, sl) as offsets:
        return models.causal_lm_logits(model, sl.input_ids, sl.position_ids, offsets)


def part_logprobs(
    model: nn.Module,
    sl: ulysses.SPSlice,
    *,
    temperature: float,
    backend: str = "auto",
    compute_entropy: bool = False,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of the slice's labels, ``[T_local]`` fp32 each (0 where label is -100).

    The kernels of ``logprobs``, on the slice: ``fused`` from the final hidden states
    and the LM head weight, else from the ``[T_local, vocab]`` logits. Every rank of the group must call
    it (the attention layers exchange heads), and, with gradients, run the backward.
    """
    if sl.labels is None:
        raise ValueError("log-probs need a row with labels (ppo.packing.Packed)")
    if not fused:
        logits = part_logits(model, sl)
        return ppo_kernels.logprobs_from_logits(
            logits, sl.labels, temperature=temperature, compute_entropy=compute_entropy, backend=backend
        )
    hidden = part_hidden(model, sl)
    weight = models.lm_head_weight(model)
    return ppo_kernels.fused_linear_logprobs(
        hidden, weight, sl.labels, temperature=temperature, compute_entropy=compute_entropy, backend=backend
    )


def part_hidden(model: nn.Module, sl: ulysses.SPSlice) -> torch.Tensor:
    """The final hidden states (after the last norm) of the slice's tokens, ``[T_local, H]``, which with
    ``models.lm_head_weight(model)`` give the logits (collective, as ``part_logits``)."""
    with ulysses.attention_layout(model, sl) as offsets:
        return models.causal_lm_hidden(model, sl.input_ids, sl.position_ids, offsets)


def part_values(critic: nn.Module, sl: ulysses.SPSlice) -> torch.Tensor:
    """The critic's value at each of the slice's tokens, ``[T_local]`` fp32 (collective, as
    ``part_logprobs``)."""
    with ulysses.attention_layout(critic, sl) as offsets:
        return models.critic_values(critic, sl.input_ids, sl.position_ids, offsets)


def logprobs(
    model: nn.Module,
    packed: Packed,
    sp: ulysses.SPGroup = ulysses.NO_SP,
    *,
    temperature: float,
    backend: str = "auto",
    compute_entropy: bool = False,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of the response tokens, ``[B, R]`` fp32 each, the whole micro-batch on
    every rank of the group; temperature divides after the fp32 upcast (inside the kernels).

    ``fused`` computes them from the final hidden states and the LM head weight without building the
    ``[T, V]`` logits; otherwise from the logits (``part_logprobs``). With sequence parallelism
    ``packed`` must be the same row on every rank of the group: each rank computes its slice and one
    differentiable ``gather_tokens`` assembles the row; without it (``NO_SP``) the slice is the row.
    """
    sl = ulysses.slice_for_rank(packed, sp)
    lp, ent = part_logprobs(
        model, sl, temperature=temperature, backend=backend, compute_entropy=compute_entropy, fused=fused
    )
    if ent is None:
        return packing.unpack(sl.gather(lp), packed), None
    if sp.size > 1:
        both = sl.gather(torch.stack([lp, ent], dim=-1))  # one collective for both
        lp, ent = both[:, 0], both[:, 1]
    return packing.unpack(lp, packed), packing.unpack(ent, packed)


@torch.no_grad()
def topk(
    model: nn.Module,
    packed: Packed,
    sp: ulysses.SPGroup = ulysses.NO_SP,
    *,
    k: int,
    temperature: float = 1.0,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely next tokens at each response position and their log-probs, ``[B, R, k]``
    each (ids int64), from the final hidden states and the LM head in token chunks
    (``ppo_kernels.fused_linear_topk``: the ``[T, V]`` logits never exist whole); a teacher's top-k."""
    sl = ulysses.slice_for_rank(packed, sp)
    logprobs, ids = ppo_kernels.fused_linear_topk(
        part_hidden(model, sl), models.lm_head_weight(model), k, temperature=temperature, backend=backend
    )
    return packing.unpack(sl.gather(logprobs), packed), packing.unpack(sl.gather(ids), packed)


def logprobs_at(
    model: nn.Module,
    packed: Packed,
    ids: torch.Tensor,
    sp: ulysses.SPGroup = ulysses.NO_SP,
    *,
    temperature: float,
    backend: str = "auto",
    compute_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``logprobs`` (fused) from one forward, plus the log-probs of the tokens ``ids [B, R, K]`` at
    each response position (differentiable, ``ppo_kernels.fused_linear_gather_logprobs``, the logits
    recomputed in token chunks) and the model's own top-``K`` ids there (``[B, R, K]``, for the
    distillation overlap metrics): a student's side of the top-k distillation loss."""
    sl = ulysses.slice_for_rank(packed, sp)
    hidden = part_hidden(model, sl)
    weight = models.lm_head_weight(model)
    lp, ent = ppo_kernels.fused_linear_logprobs(
        hidden, weight, sl.labels, temperature=temperature, compute_entropy=compute_entropy, backend=backend
    )
    at, own = ppo_kernels.fused_linear_gather_logprobs(
        hidden,
        weight,
        sl.take(packing.repack(ids, packed)),
        temperature=temperature,
        return_topk=True,
        backend=backend,
    )
    out = [packing.unpack(sl.gather(x), packed) for x in (lp, at, own)]
    entropy = None if ent is None else packing.unpack(sl.gather(ent), packed)
    return out[0], entropy, out[1], out[2]


def values(critic: nn.Module, packed: Packed, sp: ulysses.SPGroup = ulysses.NO_SP) -> torch.Tensor:
    """The critic's value of the state before each response token, ``[B, R]`` fp32, on every rank of
    the group (``packed``: the same row on each)."""
    sl = ulysses.slice_for_rank(packed, sp)
    return packing.unpack(sl.gather(part_values(critic, sl)), packed)
