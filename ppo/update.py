"""Step 4's machinery: mini-batches, global counts, and the one optimize loop the actor and the critic
share (they differ only in their loss closure).

    loss_fn = lambda sel, counts: (loss, {"actor/pg_loss": pg_loss, ...})   # a micro-batch's share
    metrics = optimize(cfg.actor, "actor", run.actor, batch, loss_fn,
                       num_mini=bsz // mini, shuffle=True, sp=sp, early_stop_kl=0.05)
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from ppo import runner, ulysses
from ppo.batch import Batch
from ppo.config import ActorConfig, CriticConfig
from ppo.distributed import all_reduce_scalars, all_reduce_tensors
from ppo.optim import Trained
from ppo.packing import micro_batches

logger = logging.getLogger("ppo")


LossFn = Callable[[torch.Tensor, dict[str, float]], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``(micro-batch row indices, global counts) -> (loss, metric contributions)``: the loss is this
micro-batch's share of the mini-batch's global loss; each metric is its share of the mini-batch value."""

MiniBatchHook = Callable[[torch.Tensor, int], None]
"""``(mini-batch row indices, update number) -> None``, run on every rank before a mini-batch's
micro-batches (it may run collectives): to decide, once per mini-batch and over all ranks, what its
loss closure then reads (Clip-Cov's and KL-Cov's tokens). The update number counts the call's
mini-batches over its epochs from 0."""


def mini_batches(num_seqs: int, num_mini: int, shuffle: bool, sp: ulysses.SPGroup) -> list[torch.Tensor]:
    """Split this rank's sequences into ``num_mini`` equal mini-batches, shuffled by the rank's RNG
    (seeded per rank and restored by checkpoints, so runs and resumes repeat); the ranks of a
    sequence-parallel group take their first rank's order."""
    order = torch.randperm(num_seqs) if shuffle else torch.arange(num_seqs)
    if shuffle and sp.size > 1:
        device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
        order = ulysses.broadcast(order.to(device), sp).cpu()
    return list(order.chunk(num_mini))


def global_counts(mask: torch.Tensor) -> dict[str, float]:
    """Valid tokens and non-empty sequences of a mini-batch summed over ranks (exact normalization)."""
    tokens, seqs = all_reduce_scalars([float(mask.sum()), float((mask.sum(-1) > 0).sum())], "sum")
    return {"num_tokens": max(tokens, 1.0), "num_seqs": max(seqs, 1.0)}


def optimize(
    role: ActorConfig | CriticConfig,
    prefix: str,
    trained: Trained,
    batch: Batch,
    loss_fn: LossFn,
    *,
    num_mini: int,
    shuffle: bool,
    sp: ulysses.SPGroup,
    early_stop_kl: float = 0.0,
    before_mini_batch: MiniBatchHook | None = None,
) -> dict[str, float]:
    """``role.ppo_epochs`` passes over the batch in ``num_mini`` mini-batches; per mini-batch, gradient
    accumulation over token-budget micro-batches, then one optimizer step.

    Each rank's loss is its share of the mini-batch's global loss (normalized by counts over all ranks)
    and ``shard_model`` makes FSDP sum gradients over ranks, so the reduced gradient is exactly the
    global mini-batch's. The metrics of a mini-batch are reduced once, so the early-stop decision (on
    ``<prefix>/ppo_kl``) is the same on every rank. A non-finite gradient norm skips that update.
    ``before_mini_batch`` (``MiniBatchHook``) runs before each mini-batch's micro-batches, so that what
    it decides cannot depend on how the mini-batch is split.
    """
    sums: dict[str, float] = {}
    grad_norms: list[float] = []
    updates = skipped = 0
    early_stopped = False
    for _ in range(role.ppo_epochs):
        for idx in mini_batches(len(batch.records), num_mini, shuffle, sp):
            idx = idx.to(batch.response_mask.device)
            counts = global_counts(batch.loss_mask[idx])  # the generated tokens: what is trained
            if before_mini_batch is not None:
                before_mini_batch(idx, updates)
            contributions: dict[str, torch.Tensor] = {}
            for sel in micro_batches(batch, idx, role):
                loss, parts = loss_fn(sel, counts)
                loss.backward()
                for key, value in parts.items():
                    contributions[key] = contributions.get(key, 0.0) + value.detach()
            reduced = all_reduce_tensors(contributions, "sum")
            grad_norm, was_skipped = runner.optimizer_step(trained.model, trained.optimizer, role.grad_clip)
            grad_norms.append(grad_norm)
            updates += 1
            skipped += was_skipped
            for key, value in reduced.items():
                sums[key] = sums.get(key, 0.0) + value
            if early_stop_kl > 0 and reduced[f"{prefix}/ppo_kl"] > early_stop_kl:
                early_stopped = True
                logger.info(
                    "%s: ppo_kl %.4f > early_stop_kl; the step's remaining updates are skipped",
                    prefix,
                    reduced[f"{prefix}/ppo_kl"],
                )
                break
        if early_stopped:
            break
    # Every rank holds the same global values; the step's mean reduction over ranks keeps them.
    out = {k: v / updates for k, v in sums.items()}
    out[f"{prefix}/grad_norm"] = float(np.mean(grad_norms))
    out[f"{prefix}/num_updates"] = float(updates)
    out[f"{prefix}/skipped_updates"] = float(skipped)
    if early_stop_kl > 0:
        out[f"{prefix}/early_stopped"] = float(early_stopped)
    return out
