"""Step 2's forward passes, all without gradients: the actor's old log-probs, the reference's log-probs
(and the exact KL over the vocabulary), the critic's values, over token-budget micro-batches of packed
sequences. The rewards (``scores``, one per sequence) are ``ppo.rewards``'.

    batch.old_logprobs = forward_logprobs(cfg, actor, batch, cfg.actor.ppo_micro_batch_size_per_gpu, sp)
    forward_reference(cfg, actor, ref, batch, sp)      # batch.ref_logprobs (and batch.full_kl)
    batch.values = forward_values(cfg, critic, batch, sp)
    batch.old_logprobs = forward_old_logprobs(cfg, actor, old_policy, batch, sp)   # a kept old policy's
"""

from __future__ import annotations

import torch

from ppo import algorithms, lora, models, packed_forward, sharding, ulysses
from ppo.batch import Batch
from ppo.config import PPOConfig
from ppo.packing import micro_batches, pack_rows, unpack


def needs_old_logprobs(cfg: PPOConfig) -> bool:
    """On-policy (one epoch, one mini-batch) the ratio is exactly 1, so the update uses its own
    detached log-probs as the old ones (verl's shortcut) and the scoring forward is needed only for
    the KL in the reward, the rollback check, and Clip-Cov's choice of tokens and rejection sampling's
    (made before the update's forwards, from the old log-probs)."""
    clip_cov = cfg.actor.policy_loss.loss_mode == "clip_cov"  # picks its tokens by the old log-probs
    alg = cfg.algorithm
    return (
        not cfg.one_update_per_rollout
        or alg.use_kl_in_reward
        or alg.rollback_kl > 0
        or clip_cov
        or alg.rollout_rs is not None
    )


@torch.no_grad()
def forward_logprobs(
    cfg: PPOConfig, model: torch.nn.Module, batch: Batch, micro_batch_size: int, sp: ulysses.SPGroup
) -> torch.Tensor:
    """Log-probs ``[B, R]`` of the sampled tokens under ``model`` at the rollout temperature."""
    out = torch.zeros_like(batch.attention_mask, dtype=torch.float32)
    with models.evaluating(model):  # adapter dropout off: the policy that sampled, deterministically
        for sel in micro_batches(batch, batch.rows(), cfg.actor, micro_batch_size):
            out[sel], _ = packed_forward.logprobs(
                model,
                pack_rows(batch, sel),
                sp,
                temperature=cfg.rollout.temperature,
                backend=cfg.actor.kernel_backend,
                fused=cfg.actor.use_fused_kernels,
            )
    return out


def forward_old_logprobs(
    cfg: PPOConfig,
    actor: torch.nn.Module,
    old_policy: torch.nn.Module | None,
    batch: Batch,
    sp: ulysses.SPGroup,
) -> torch.Tensor:
    """Old log-probs ``[B, R]``: the actor's, or where the run keeps an older policy (SPPO's snapshot,
    ``ppo.sppo``) that one's, released after its forward as a separate reference is."""
    mb = cfg.actor.ppo_micro_batch_size_per_gpu
    if old_policy is None:
        return forward_logprobs(cfg, actor, batch, mb, sp)
    out = forward_logprobs(cfg, old_policy, batch, mb, sp)
    sharding.release(old_policy)
    return out


def forward_reference(
    cfg: PPOConfig, actor: torch.nn.Module, ref: torch.nn.Module, batch: Batch, sp: ulysses.SPGroup
) -> None:
    """Reference log-probs (and the exact KL with ``algorithm.kl_penalty=full``) into ``batch``. Under
    LoRA the reference is the actor with its adapters off; a separate reference is released after."""
    with lora.adapters_disabled(ref):  # a no-op for a separately loaded reference
        mb = cfg.ref.log_prob_micro_batch_size_per_gpu
        batch.ref_logprobs = forward_logprobs(cfg, ref, batch, mb, sp)
    if cfg.algorithm.use_kl_in_reward and cfg.algorithm.kl_penalty == "full":
        batch.full_kl = forward_full_kl(cfg, actor, ref, batch, sp)
    if ref is not actor:  # the actor's root stays gathered for its next forward
        sharding.release(ref)


@torch.no_grad()
def forward_full_kl(
    cfg: PPOConfig, actor: torch.nn.Module, ref: torch.nn.Module, batch: Batch, sp: ulysses.SPGroup
) -> torch.Tensor:
    """Exact ``KL(actor || ref)`` over the vocabulary at every response token, ``[B, R]``.

    Needs both models' logits of a micro-batch at once: the costliest estimator, for small vocabularies
    or diagnostics. With sequence parallelism each rank computes its slice's tokens.
    """
    out = torch.zeros_like(batch.attention_mask, dtype=torch.float32)
    tau = cfg.rollout.temperature
    with models.evaluating(actor), models.evaluating(ref):
        for sel in micro_batches(batch, batch.rows(), cfg.actor):
            packed = pack_rows(batch, sel)
            part = ulysses.slice_for_rank(packed, sp)  # the whole row without sequence parallelism
            logits = packed_forward.part_logits(actor, part).float() / tau
            with lora.adapters_disabled(ref):  # the reference may be the actor itself (LoRA)
                ref_logits = packed_forward.part_logits(ref, part).float() / tau
            kl = algorithms.full_kl(logits[None], ref_logits[None], (part.labels != -100)[None])[0]
            out[sel] = unpack(part.gather(kl), packed)
    return out


@torch.no_grad()
def forward_values(
    cfg: PPOConfig, critic: torch.nn.Module, batch: Batch, sp: ulysses.SPGroup
) -> torch.Tensor:
    """The critic's values ``[B, R]`` of the response tokens."""
    out = torch.zeros_like(batch.attention_mask, dtype=torch.float32)
    with models.evaluating(critic):
        for sel in micro_batches(batch, batch.rows(), cfg.critic):
            out[sel] = packed_forward.values(critic, pack_rows(batch, sel), sp)
    return out


def ref_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over sequences of the per-token ``log pi - log pi_ref`` (k1) of the sampled tokens: how far the
    policy has moved from the reference, whatever KL terms the run uses."""
    return algorithms.masked_mean(logprobs - ref_logprobs, mask, dim=-1).mean().item()
