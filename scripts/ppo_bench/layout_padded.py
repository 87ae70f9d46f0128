"""The padded baseline of layout.py: the trainer's scoring and loss functions on right-padded rows.

Each function here has the signature of the trainer's function of the same role (``ppo.forwards.
forward_logprobs`` and ``forward_values``, ``ppo.optimize.actor_loss`` and ``critic_loss``) and the same
math (``ppo_kernels.logprobs_from_logits``, ``ppo.algorithms.policy_loss``, ``value_loss``, ``agg_loss``)
on the same micro-batch plan (``ppo.packing.micro_batches``); only the layout differs: every micro-batch
right-padded to its longest sequence, ``[b, max_len]`` with an attention mask, where the trainer packs.
layout.py's module docstring says what it is compared with.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

import ppo_kernels
from ppo import algorithms
from ppo.batch import Batch
from ppo.config import PPOConfig
from ppo.optimize import LossFn
from ppo.packing import micro_batches
from ppo.ulysses import SPGroup
from ppo_bench.shapes import PAD_ID


@dataclasses.dataclass(kw_only=True)
class PaddedRows:
    """``b`` sequences (prompt + valid response) right-padded to the longest, ``[b, L]``."""

    input_ids: torch.Tensor
    """[b, L] token ids, ``PAD_ID`` after each sequence's end."""
    attention_mask: torch.Tensor
    """[b, L] 1 on real tokens, 0 on padding."""
    labels: torch.Tensor
    """[b, L] the next token where it is a response token, -100 elsewhere."""
    response_index: torch.Tensor
    """[b, R] position in the row whose next-token prediction is response token j (0 at padding)."""
    response_mask: torch.Tensor
    """[b, R] bool, True on valid response tokens."""


def pad_rows(batch: Batch, sel: torch.Tensor) -> PaddedRows:
    """The sequences ``sel`` of ``batch`` right-padded: the padded counterpart of ``ppo.packing.pack_rows``."""
    prompts = [batch.rollout.prompts[i] for i in sel.tolist()]
    responses, mask = batch.rollout.responses[sel], batch.attention_mask[sel].bool()
    device = responses.device
    lens = [p.numel() + int(n) for p, n in zip(prompts, mask.sum(-1).tolist(), strict=True)]
    b, width = len(prompts), max(lens)
    input_ids = torch.full((b, width), PAD_ID, dtype=torch.long, device=device)
    attention_mask = torch.zeros((b, width), dtype=torch.long, device=device)
    labels = torch.full((b, width), -100, dtype=torch.long, device=device)
    j = torch.arange(responses.shape[1], device=device)
    response_index = torch.zeros_like(responses)
    for i, (prompt, n) in enumerate(zip(prompts, lens, strict=True)):
        p = prompt.numel()
        input_ids[i, :n] = torch.cat([prompt.to(device), responses[i, : n - p]])
        attention_mask[i, :n] = 1
        # Response token j is predicted at position p - 1 + j (as in ppo.packing.pack).
        response_index[i] = torch.where(mask[i], p - 1 + j, torch.zeros_like(j))
        labels[i, response_index[i][mask[i]]] = responses[i][mask[i]]
    return PaddedRows(
        input_ids=input_ids,
        attention_mask=attention_mask,
        labels=labels,
        response_index=response_index,
        response_mask=mask,
    )


def padded_forward(model: nn.Module, rows: PaddedRows) -> torch.Tensor:
    """The model's ``[b, L, ...]`` logits on padded rows."""
    # Right padding: positions 0.. are right for every real token; the mask hides the padding.
    return model(input_ids=rows.input_ids, attention_mask=rows.attention_mask, use_cache=False).logits


def at_responses(x: torch.Tensor, rows: PaddedRows) -> torch.Tensor:
    """``[b, L]`` per-position values -> ``[b, R]`` at the response tokens (0 at padding)."""
    out = x.gather(1, rows.response_index)
    return torch.where(rows.response_mask, out, torch.zeros_like(out))


def padded_logprobs(
    model: nn.Module, rows: PaddedRows, *, temperature: float, backend: str, compute_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of the response tokens, ``[b, R]`` fp32 each: ``packed_forward.logprobs`` on
    padded rows, with the same kernel."""
    logits = padded_forward(model, rows)
    b, width, vocab = logits.shape
    lp, ent = ppo_kernels.logprobs_from_logits(
        logits.reshape(b * width, vocab),
        rows.labels.reshape(-1),
        temperature=temperature,
        compute_entropy=compute_entropy,
        backend=backend,
    )
    lp = at_responses(lp.view(b, width), rows)
    return lp, (at_responses(ent.view(b, width), rows) if ent is not None else None)


def padded_values(critic: nn.Module, rows: PaddedRows) -> torch.Tensor:
    """The critic's values before each response token, ``[b, R]`` fp32: ``packed_forward.values`` on padded rows."""
    return at_responses(padded_forward(critic, rows)[..., 0].float(), rows)


def no_sp(sp: SPGroup) -> None:
    """The padded functions take the trainer's ``sp`` argument, and only ``NO_SP``."""
    if sp.size != 1:
        raise ValueError("the padded baseline runs without sequence parallelism")


@torch.no_grad()
def padded_forward_logprobs(
    cfg: PPOConfig, model: nn.Module, batch: Batch, micro_batch_size: int, sp: SPGroup
) -> torch.Tensor:
    """``ppo.forwards.forward_logprobs`` on padded rows: log-probs ``[B, R]``."""
    no_sp(sp)
    out = torch.zeros_like(batch.attention_mask, dtype=torch.float32)
    tau, backend = cfg.rollout.temperature, cfg.actor.kernel_backend
    for sel in micro_batches(batch, batch.rows(), cfg.actor, micro_batch_size):
        out[sel], _ = padded_logprobs(model, pad_rows(batch, sel), temperature=tau, backend=backend)
    return out


@torch.no_grad()
def padded_forward_values(cfg: PPOConfig, critic: nn.Module, batch: Batch, sp: SPGroup) -> torch.Tensor:
    """``ppo.forwards.forward_values`` on padded rows: values ``[B, R]``."""
    no_sp(sp)
    out = torch.zeros_like(batch.attention_mask, dtype=torch.float32)
    for sel in micro_batches(batch, batch.rows(), cfg.critic):
        out[sel] = padded_values(critic, pad_rows(batch, sel))
    return out


def padded_critic_loss(cfg: PPOConfig, critic: nn.Module, batch: Batch, sp: SPGroup) -> LossFn:
    """``ppo.optimize.critic_loss`` on padded rows: a micro-batch's share of the clipped value loss."""
    no_sp(sp)
    c = cfg.critic

    def loss_fn(sel: torch.Tensor, counts: dict[str, float]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = batch.attention_mask[sel]
        values = padded_values(critic, pad_rows(batch, sel))
        vf_loss, _ = algorithms.value_loss(
            values, batch.values[sel], batch.returns[sel], mask, c.cliprange_value, c.loss_agg_mode, **counts
        )
        return vf_loss, {"critic/vf_loss": vf_loss}

    return loss_fn


def padded_actor_loss(cfg: PPOConfig, actor: nn.Module, batch: Batch, sp: SPGroup) -> LossFn:
    """``ppo.optimize.actor_loss`` on padded rows: a micro-batch's share of the clipped policy loss minus
    the entropy bonus. Only what layout.py's ``path_config`` turns on: no KL loss, no on-policy
    shortcut."""
    no_sp(sp)
    a = cfg.actor
    if a.use_kl_loss or cfg.one_update_per_rollout:
        raise ValueError("the padded baseline has no KL loss and no on-policy shortcut")

    def loss_fn(sel: torch.Tensor, counts: dict[str, float]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = batch.attention_mask[sel]
        logprobs, entropy = padded_logprobs(
            actor,
            pad_rows(batch, sel),
            temperature=cfg.rollout.temperature,
            backend=a.kernel_backend,
            compute_entropy=True,
        )
        pg_loss, pg_metrics = algorithms.policy_loss(
            logprobs,
            batch.old_logprobs[sel],
            batch.advantages[sel],
            mask,
            a.clip_ratio_low,
            a.clip_ratio_high,
            a.clip_ratio_c,
            a.loss_agg_mode,
            **counts,
        )
        if not a.entropy_coeff:
            entropy = entropy.detach()
        entropy_loss = algorithms.agg_loss(entropy, mask, a.loss_agg_mode, **counts)
        loss = pg_loss - a.entropy_coeff * entropy_loss if a.entropy_coeff else pg_loss
        parts = {"actor/pg_loss": pg_loss, "actor/entropy": entropy_loss}
        parts.update({f"actor/{k}": v for k, v in pg_metrics.items()})  # already this micro-batch's shares
        return loss, parts

    return loss_fn
