"""Step 4's machinery: mini-batches, global counts, the one optimize loop the actor and the critic share,
and their loss closures (``actor_loss``, ``critic_loss``): they differ only in the closure. PRIME's
implicit PRM trains through the same loop at the start of step 3 (``ppo.prime.update_prm``).

    loss_fn = actor_loss(cfg, actor.model, batch, sp)   # (sel, counts) -> (loss, {"actor/pg_loss": ...})
    metrics = optimize(cfg.actor, "actor", actor, batch, loss_fn,
                       num_mini=bsz // mini, shuffle=True, sp=sp, early_stop_kl=0.05)

A new policy loss lands in ``ppo.algorithms`` (its math and its row of ``POLICY_LOSSES``); ``actor_loss``
looks the name up. Clip-Cov and KL-Cov also pick their tokens once per mini-batch (``cov_selection``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import numpy as np
import torch

from ppo import algorithms, packed_forward, ulysses
from ppo.algorithms.correction import mismatch_sums, rollout_rs_mask
from ppo.batch import Batch
from ppo.config import ActorConfig, CriticConfig, PPOConfig
from ppo.distillation import StudentForward, student_loss
from ppo.distributed import (
    all_gather_object,
    all_reduce_scalars,
    all_reduce_sum,
    all_reduce_tensors,
)
from ppo.metrics import combine_parts, metric_kind, ratio_parts, resolve_ratios
from ppo.optim import Trained, optimizer_step
from ppo.packing import micro_batches, pack_rows
from ppo.token_kl import kl_estimate

logger = logging.getLogger("ppo")


LossFn = Callable[[torch.Tensor, dict[str, float]], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``(micro-batch row indices, global counts) -> (loss, metric contributions)``: the loss is this
micro-batch's share of the mini-batch's global loss; each metric is its share of the mini-batch value,
a ``ratio_parts`` pair (a sum and a count) for a mean over some of the tokens, or an ``extreme_part``
(a minimum or maximum over them); ``ppo.metrics`` has the helpers."""

MiniBatchHook = Callable[[torch.Tensor, int], None]
"""``(mini-batch row indices, mini-batch index) -> None``, run on every rank before a mini-batch's
micro-batches (it may run collectives): to decide, once per mini-batch and over all ranks, what its
loss closure then reads (Clip-Cov's and KL-Cov's tokens). The mini-batch index counts the call's
mini-batches (its optimizer steps) over its epochs from 0."""


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
    return global_counts_of([mask])[0]


def global_counts_of(masks: list[torch.Tensor]) -> list[dict[str, float]]:
    """``global_counts`` of each of several mini-batches (an epoch's, before its first), with one host sync
    and one collective for all of them."""
    local = torch.stack([torch.stack([m.sum(), (m.sum(-1) > 0).sum()]) for m in masks]).tolist()
    sums = all_reduce_scalars([float(x) for pair in local for x in pair], "sum")
    return [
        {"num_tokens": max(tokens, 1.0), "num_seqs": max(seqs, 1.0)}
        for tokens, seqs in zip(sums[0::2], sums[1::2], strict=True)
    ]


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
    response_mask: torch.Tensor | None = None,
) -> dict[str, float]:
    """``role.ppo_epochs`` passes over the batch in ``num_mini`` mini-batches; per mini-batch, gradient
    accumulation over token-budget micro-batches, then one optimizer step.

    Each rank's loss is its share of the mini-batch's global loss (normalized by counts over all ranks)
    and ``shard_model`` makes FSDP sum gradients over ranks, so the reduced gradient is exactly the
    global mini-batch's. The metrics of a mini-batch are reduced once, so the early-stop decision (on
    ``<prefix>/ppo_kl``) is the same on every rank. A non-finite gradient norm skips that update.
    ``before_mini_batch`` (``MiniBatchHook``) runs before each mini-batch's micro-batches, so that what
    it decides cannot depend on how the mini-batch is split. ``response_mask [B, R]``: the tokens trained and
    counted, when not ``batch.response_mask`` (the actor's after rejection sampling, ``rollout_rejection``).
    """
    response_mask = batch.response_mask if response_mask is None else response_mask
    sums: dict[str, float] = {}
    grad_norms: list[float] = []
    updates = skipped = 0
    early_stopped = False
    for _ in range(role.ppo_epochs):
        device = batch.attention_mask.device
        epoch = [idx.to(device) for idx in mini_batches(len(batch.records), num_mini, shuffle, sp)]
        # The generated tokens (what is trained) of every mini-batch of the epoch, counted in one collective.
        for idx, counts in zip(epoch, global_counts_of([response_mask[idx] for idx in epoch]), strict=True):
            if before_mini_batch is not None:
                before_mini_batch(idx, updates)
            contributions: dict[str, torch.Tensor] = {}
            for sel in micro_batches(batch, idx, role):
                loss, parts = loss_fn(sel, counts)
                loss.backward()
                for key, value in parts.items():
                    contributions[key] = combine_parts(contributions.get(key), value.detach(), key)
            by_kind: dict[str, dict[str, torch.Tensor]] = {}
            for key, value in contributions.items():
                by_kind.setdefault(metric_kind(key), {})[key] = value
            reduced = {}
            for op in ("sum", "min", "max"):  # a collective each, only for the kinds there are
                if op in by_kind:
                    reduced |= all_reduce_tensors(by_kind[op], op)
            grad_norm, was_skipped = optimizer_step(trained.model, trained.optimizer, role.grad_clip)
            grad_norms.append(grad_norm)
            updates += 1
            skipped += was_skipped
            for key, value in reduced.items():
                sums[key] = combine_parts(sums.get(key), value, key)
            # (no ppo_kl without the task's loss: distillation alone never stops early)
            if early_stop_kl > 0 and reduced.get(f"{prefix}/ppo_kl", 0.0) > early_stop_kl:
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
    out = resolve_ratios({k: v / updates for k, v in sums.items() if metric_kind(k) == "sum"})
    out |= {
        k[: k.rfind("#")]: v if math.isfinite(v) else 0.0 for k, v in sums.items() if metric_kind(k) != "sum"
    }
    out[f"{prefix}/grad_norm"] = float(np.mean(grad_norms))
    out[f"{prefix}/num_updates"] = float(updates)
    out[f"{prefix}/skipped_updates"] = float(skipped)
    if early_stop_kl > 0:
        out[f"{prefix}/early_stopped"] = float(early_stopped)
    return out


def actor_loss(
    cfg: PPOConfig,
    actor: torch.nn.Module,
    batch: Batch,
    sp: ulysses.SPGroup,
    *,
    cov_mask: torch.Tensor | None = None,
    response_mask: torch.Tensor | None = None,
) -> LossFn:
    """The actor's share of a mini-batch's loss on the rows ``sel`` of ``batch``: the policy loss named
    ``actor.policy_loss.loss_mode`` (``algorithms.POLICY_LOSSES``), minus the entropy bonus, plus the KL
    loss (the task's loss, ``PPOConfig.task_loss``), plus ``distillation_loss_coef`` times the
    distillation loss (``ppo.distillation.student_loss``; alone with ``use_task_rewards=false``, as
    verl); with one update per rollout the old log-probs are the forward's own, detached. ``cov_mask
    [B, R]``: Clip-Cov's or KL-Cov's tokens of the current mini-batch (``cov_selection`` fills it before
    the mini-batch). ``response_mask [B, R]``: the tokens trained, when not ``batch.response_mask``
    (``rollout_rejection``'s: the importance weights and ``mismatch/*`` stay over every generated token,
    as verl's)."""
    a = cfg.actor
    reuse_forward = cfg.one_update_per_rollout
    scale = sum_norm_scale(cfg, a.loss_scale_factor)
    replicas = token_sum_replicas(a.loss_agg_mode, sp)
    response_mask = batch.response_mask if response_mask is None else response_mask
    loss_of = algorithms.POLICY_LOSSES[a.policy_loss.loss_mode]
    settings = algorithms.PolicyLossSettings(
        loss_agg_mode=a.loss_agg_mode,
        clip_ratio_low=a.clip_ratio_low,
        clip_ratio_high=a.clip_ratio_high,
        clip_ratio_c=a.clip_ratio_c,
        ppo_kl_coef=a.policy_loss.ppo_kl_coef,
    )

    distill = cfg.distillation.distillation_loss if cfg.distillation.enabled else None

    def rows(t: torch.Tensor | None, sel: torch.Tensor) -> torch.Tensor | None:
        return None if t is None else t[sel]

    def loss_fn(sel: torch.Tensor, counts: dict[str, float]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        counts = {**counts, "loss_scale_factor": scale, **replicas}
        mask = response_mask[sel]
        packed = pack_rows(batch, sel)
        topk_lp = topk_ids = None
        if distill is not None and distill.use_topk:  # one forward for both: the student's top-k side too
            logprobs, entropy, topk_lp, topk_ids = packed_forward.logprobs_at(
                actor,
                packed,
                batch.teacher_topk_ids[sel],
                sp,
                temperature=cfg.rollout.temperature,
                backend=a.kernel_backend,
                compute_entropy=True,
            )
        else:
            logprobs, entropy = packed_forward.logprobs(
                actor,
                packed,
                sp,
                temperature=cfg.rollout.temperature,
                backend=a.kernel_backend,
                compute_entropy=True,  # logged every step; its gradient only with an entropy bonus
                fused=a.use_fused_kernels,
            )
        old_logprobs = logprobs.detach() if reuse_forward else batch.old_logprobs[sel]
        is_weights, mismatch = off_policy_weights(cfg, old_logprobs, batch, sel)
        if not a.entropy_coeff or not cfg.task_loss:
            entropy = entropy.detach()
        # The metric is the mean token entropy whatever the aggregation (a sum under token-sum modes).
        mean_entropy = algorithms.agg_loss(entropy.detach(), mask, "token-mean", counts["num_tokens"])
        parts = {"actor/entropy": mean_entropy}
        loss = logprobs.new_zeros(())
        if cfg.task_loss:
            loss = task_loss(sel, counts, mask, logprobs, old_logprobs, entropy, is_weights, parts)
        if distill is not None:
            student = StudentForward(
                logprobs=logprobs,
                old_logprobs=old_logprobs,
                topk_logprobs=topk_lp,
                topk_ids=topk_ids,
                is_weights=is_weights,
            )
            distill_loss, distill_parts = student_loss(cfg, batch, sel, mask, student, counts)
            coef = distill.distillation_loss_coef if cfg.task_loss else 1.0
            loss = loss + coef * distill_loss
            parts.update(distill_parts)
        parts.update(mismatch)
        if reuse_forward and batch.old_logprobs is None and batch.ref_logprobs is not None:
            # The scoring forward was skipped: the step's KL to the reference from this forward.
            seq_kl = algorithms.masked_mean(logprobs.detach() - batch.ref_logprobs[sel], mask, dim=-1)
            parts["actor/ref_kl"] = seq_kl.sum() / counts["num_seqs"]
        return loss, parts

    def task_loss(
        sel: torch.Tensor,
        counts: dict[str, float],
        mask: torch.Tensor,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        entropy: torch.Tensor,
        is_weights: torch.Tensor | None,
        parts: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """The policy loss on the advantages, minus the entropy bonus, plus the KL loss; metrics into
        ``parts``."""
        inputs = algorithms.PolicyLossInputs(
            logprobs=logprobs,
            old_logprobs=old_logprobs,
            response_mask=mask,
            advantages=rows(batch.advantages, sel),
            targets=rows(batch.targets, sel),
            is_weights=is_weights,
            cov_mask=rows(cov_mask, sel),
        )
        pg_loss, pg_metrics = loss_of(inputs, settings, **counts)  # metrics: this micro-batch's shares
        loss = pg_loss
        if a.entropy_coeff:
            loss = loss - a.entropy_coeff * algorithms.agg_loss(entropy, mask, a.loss_agg_mode, **counts)
        parts["actor/pg_loss"] = pg_loss
        parts.update({f"actor/{k}": v for k, v in pg_metrics.items()})
        if a.use_kl_loss:
            kl = kl_estimate(logprobs, batch.ref_logprobs[sel], a.kl_loss_type, a.kernel_backend)
            kl_loss = algorithms.agg_loss(kl, mask, a.loss_agg_mode, **counts)
            loss = loss + a.kl_loss_coef * kl_loss
            parts["actor/kl_loss"] = kl_loss
        return loss

    return loss_fn


def critic_loss(cfg: PPOConfig, critic: torch.nn.Module, batch: Batch, sp: ulysses.SPGroup) -> LossFn:
    """The critic's share of a mini-batch's clipped value loss on the rows ``sel`` of ``batch``."""
    c = cfg.critic
    scale = sum_norm_scale(cfg, None)
    replicas = token_sum_replicas(c.loss_agg_mode, sp)

    def loss_fn(sel: torch.Tensor, counts: dict[str, float]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        counts = {**counts, "loss_scale_factor": scale, **replicas}
        mask = batch.response_mask[sel]
        values = packed_forward.values(critic, pack_rows(batch, sel), sp)
        vf_loss, vf_metrics = algorithms.value_loss(
            values, batch.values[sel], batch.returns[sel], mask, c.cliprange_value, c.loss_agg_mode, **counts
        )
        weight = mask.sum() / counts["num_tokens"]
        return vf_loss, {
            "critic/vf_loss": vf_loss,
            "critic/vf_clipfrac": vf_metrics["vf_clipfrac"] * weight,
            "critic/vpred_mean": algorithms.masked_mean(values.detach(), mask) * weight,
        }

    return loss_fn


def sum_norm_scale(cfg: PPOConfig, loss_scale_factor: int | None) -> float:
    """What ``seq-mean-token-sum-norm`` divides its sequence mean by: ``loss_scale_factor`` (default
    ``data.max_response_length``, the width responses are padded to). Sequence parallelism needs nothing
    more: the ranks of a group each hold the group's whole rows, so the global ``num_seqs`` counts every
    row ``sp`` times and each rank's loss is already ``1/sp`` of the row's."""
    return float(loss_scale_factor or cfg.data.max_response_length)


def token_sum_replicas(loss_agg_mode: str, sp: ulysses.SPGroup) -> dict[str, int]:
    """``{"num_replicas": sp.size}`` under ``loss_agg_mode=token-sum`` (else nothing): the ranks of a
    sequence-parallel group each compute the loss on the group's whole rows, so each takes ``1/sp`` of
    their token sum (the other modes get that from counts that hold every row ``sp`` times)."""
    return {"num_replicas": sp.size} if loss_agg_mode == "token-sum" else {}


def cov_selection(
    cfg: PPOConfig, batch: Batch, cov_mask: torch.Tensor, sp: ulysses.SPGroup, *, dp_rank: int, step: int
) -> MiniBatchHook:
    """The hook that fills ``cov_mask [B, R]`` with Clip-Cov's or KL-Cov's tokens of each mini-batch
    (``algorithms.clip_cov_selection`` / ``kl_cov_selection``), over all ranks, before its micro-batches.

    verl picks them in each micro-batch from that micro-batch's current log-probs, so its result changes
    with the micro-batch split and the number of ranks. Here the pick is once per mini-batch, from what
    does not change within it: the covariance of the advantages and the *old* log-probs, means over the
    whole mini-batch on every rank; tokens are named by their place in the global batch (``dp_rank``: the
    index of this rank's data-parallel group), so 1 rank, 2 ranks and sequence parallelism pick the same.
    Clip-Cov's random draw comes from a generator seeded by ``(trainer.seed, step, mini-batch index)``,
    which the checkpoint holds: a resumed or rolled-back step draws the same tokens."""
    p = cfg.actor.policy_loss
    num_rows, width = batch.attention_mask.shape
    rows = dp_rank * num_rows + torch.arange(num_rows, device=cov_mask.device)
    token_ids = rows[:, None] * width + torch.arange(width, device=cov_mask.device)[None, :]

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(t).div_(sp.size)  # the ranks of a sequence-parallel group hold the same rows

    def all_gather(t: torch.Tensor) -> torch.Tensor:
        return torch.cat(all_gather_object(t.cpu() if sp.rank == 0 else t[:0].cpu()))  # each row once

    def hook(idx: torch.Tensor, mini_batch_index: int) -> None:
        mask = batch.response_mask[idx]
        cov = algorithms.token_covariance(
            batch.advantages[idx], batch.old_logprobs[idx], mask, all_reduce=all_reduce
        )
        if p.loss_mode == "clip_cov":
            seed = (cfg.trainer.seed * 1_000_003 + step) * 1_000_003 + mini_batch_index
            chosen = algorithms.clip_cov_selection(
                cov,
                mask,
                token_ids[idx],
                ratio=p.clip_cov_ratio,
                lb=p.clip_cov_lb,
                ub=p.clip_cov_ub,
                generator=torch.Generator().manual_seed(seed % 2**63),
                all_reduce=all_reduce,
                all_gather=all_gather,
            )
        else:
            chosen = algorithms.kl_cov_selection(
                cov, mask, token_ids[idx], ratio=p.kl_cov_ratio, all_reduce=all_reduce, all_gather=all_gather
            )
        cov_mask.zero_()
        cov_mask[idx] = chosen

    return hook


def off_policy_weights(
    cfg: PPOConfig, old_logprobs: torch.Tensor, batch: Batch, sel: torch.Tensor
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """With ``algorithm.rollout_is_threshold``: the truncated importance weights of the rows ``sel``
    against the policy that sampled the offline responses (applied with ``algorithm.rollout_is``) and
    the ``mismatch/*`` metrics as ``ratio_parts`` (means over the tokens, or sequences, whose sampler's
    log-probs are known: sampled rows of a mixed batch do not dilute them); else ``(None, {})``."""
    alg = cfg.algorithm
    if alg.rollout_is_threshold is None:
        return None, {}
    rollout_logprobs, mask = batch.data_logprobs[sel], batch.response_mask[sel]
    sums = mismatch_sums(
        old_logprobs, rollout_logprobs, mask, alg.rollout_is_threshold, level=alg.rollout_is_level
    )
    metrics: dict[str, torch.Tensor] = {}
    for key, (total, count) in sums.items():
        metrics.update(ratio_parts(f"mismatch/{key}", total, count))
    if not alg.rollout_is:
        return None, metrics
    weights = algorithms.rollout_is_weights(
        old_logprobs, rollout_logprobs, mask, level=alg.rollout_is_level, threshold=alg.rollout_is_threshold
    )
    # Over every trained token: a sampled row's weight is 1.
    metrics.update(ratio_parts("mismatch/rollout_is_weight_mean", (weights * mask).sum(), mask.sum().float()))
    return weights, metrics


def rollout_rejection(cfg: PPOConfig, batch: Batch) -> tuple[torch.Tensor | None, dict[str, float]]:
    """Rejection sampling (``algorithm.rollout_rs``, verl 0.9.1's): ``[B, R]`` the tokens the actor
    trains, ``batch.response_mask`` without those whose divergence from the sampler of their offline response
    breaks a bound (``rollout_rs_mask``, from the old log-probs; responses without the sampler's
    log-probs are kept), and over all ranks ``mismatch/rollout_rs_masked_fraction`` (the share of those
    responses' tokens rejected) and ``mismatch/rollout_rs_seq_masked_fraction`` (the share of them with a
    rejected token). As verl's modified ``response_mask``, the kept tokens are the policy loss's, the
    entropy's and the KL loss's, and their counts normalize them; the importance weights and the other
    ``mismatch/*`` metrics stay over every generated token. ``(None, {})`` without ``rollout_rs``."""
    alg = cfg.algorithm
    if alg.rollout_rs is None:
        return None, {}
    mask = batch.response_mask
    if batch.data_logprobs is None:  # no response of this rank's batch has them: nothing to reject
        known = torch.zeros_like(mask)
        kept = mask
    else:
        known = mask & ~torch.isnan(batch.data_logprobs)
        kept = rollout_rs_mask(
            batch.old_logprobs,
            batch.data_logprobs,
            mask,
            options=alg.rollout_rs,
            thresholds=alg.rollout_rs_threshold,
        )
    rejected = known & ~kept
    rows = known.any(-1)
    # The ranks of a sequence-parallel group hold the same rows: each sum counts them sp times, the shares
    # stay exact.
    tokens, rejected_tokens, seqs, rejected_seqs = all_reduce_scalars(
        [float(known.sum()), float(rejected.sum()), float(rows.sum()), float(rejected.any(-1).sum())], "sum"
    )
    return kept, {
        "mismatch/rollout_rs_masked_fraction": rejected_tokens / tokens if tokens else 0.0,
        "mismatch/rollout_rs_seq_masked_fraction": rejected_seqs / seqs if seqs else 0.0,
    }
