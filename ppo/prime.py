"""PRIME's glue (verl's PRIME recipe; its math is ``ppo.algorithms.prime``, its advantage estimator the
``prime`` row of ``algorithms.ADVANTAGE_ESTIMATORS``, its config ``reward.prime`` and ``data.filter_accuracy``):

- step 1, the accuracy filter (``data.filter_accuracy``): sample more prompts than a step trains on,
  score them, and keep first the prompts whose group accuracy lies within
  ``[data.accuracy_lower_bound, data.accuracy_upper_bound]`` (neither always solved nor never);
- step 3, the implicit PRM's update on the step's responses and its token rewards (``update_prm``),
  through the same optimize loop as the actor.

    batch, metrics = collect_accuracy_filtered(cfg, loader, timer, sample_round=..., score_responses=...)
    metrics = update_prm(cfg, run.prm, batch, run.sp)     # batch.prm_rewards

The recipe draws ``oversample_factor`` times the batch and keeps the first ``1/oversample_factor`` after
moving the passing groups to the front; here ``data.gen_batch_size / data.train_batch_size`` is that
factor, and each rank keeps its own share (its passing groups first, in the loader's order), so the
ranks stay balanced without moving groups between them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ppo import algorithms, forwards, packed_forward, rewards, ulysses
from ppo.batch import Batch, concat_rollouts, group_index, rollout_rows
from ppo.config import PPOConfig
from ppo.data import ShardedLoader
from ppo.distributed import all_reduce_scalar, all_reduce_scalars
from ppo.metrics import Timer
from ppo.optim import Trained
from ppo.optimize import LossFn, optimize
from ppo.packing import pack_rows


def collect_accuracy_filtered(
    cfg: PPOConfig,
    loader: ShardedLoader,
    timer: Timer,
    *,
    sample_round: Callable[[list], Batch],
    score_responses: Callable[[Batch], tuple[torch.Tensor, dict[str, float]]],
) -> tuple[Batch, dict[str, float]]:
    """Sample ``n`` responses to ``gen_batch_size / train_batch_size`` loader batches of prompts, score
    them (``score_responses``), keep this rank's ``train_batch_size / world_size`` groups, passing ones
    first (``algorithms.accuracy_filter`` on ``score >= 1``), and return them scored (overlong penalty
    included) with the metrics ``prime/filter_keep_rate`` (the share of sampled groups that passed, over
    all ranks) and ``prime/acc`` (the sampled responses' accuracy, before the filter)."""
    d, n = cfg.data, cfg.rollout.n
    shares = [next(loader) for _ in range(d.gen_batch_size // d.train_batch_size)]
    items = [r for share in shares for r in share]
    batch = sample_round(items)
    with timer("reward"):
        raw, metrics = score_responses(batch)
    acc = (raw >= 1.0).float()
    passed = algorithms.accuracy_filter(acc, n, d.accuracy_lower_bound, d.accuracy_upper_bound).tolist()
    # Passing groups first, each kind in the loader's order; the step trains on one batch's share.
    kept = algorithms.kept_groups(passed, len(shares[0]))
    rows = torch.cat([torch.arange(g * n, (g + 1) * n) for g in kept]).to(raw.device)
    device = batch.attention_mask.device
    rollout = concat_rollouts([rollout_rows(batch.rollout, slice(g * n, (g + 1) * n), device) for g in kept])
    records = [items[g] for g in kept for _ in range(n)]
    out = Batch(rollout=rollout, records=records, group_ids=group_index(len(records), n, device))
    out.scores, shaping_metrics = rewards.shape_scores(
        raw[rows], out.attention_mask, cfg.reward, max_response_length=d.max_response_length
    )
    num_passed, num_groups, num_correct, num_responses = all_reduce_scalars(
        [float(sum(passed)), float(len(passed)), float(acc.sum()), float(acc.numel())], "sum"
    )
    metrics |= {"prime/filter_keep_rate": num_passed / num_groups, "prime/acc": num_correct / num_responses}
    metrics.update(shaping_metrics)
    return out, metrics


def prime_labels(scores: torch.Tensor) -> torch.Tensor:
    """``[B]`` PRIME's outcome labels: each response's score clipped to ``[0, 1]`` (the rule's 0/1
    verdict; a format score in between is a soft label). A reward model's unbounded scores are refused
    at start-up; what is clipped here (an overlong penalty below 0, a custom function's 2 for right) is
    counted by :func:`label_clip_rate`."""
    return scores.float().clamp(0.0, 1.0)


def label_clip_rate(scores: torch.Tensor) -> float:
    """The share of ``scores [B]`` outside ``[0, 1]``, which :func:`prime_labels` clips: logged each step as
    ``prime/label_clip_rate``, so that a score the PRM cannot take as it is never changes silently."""
    return float(((scores < 0) | (scores > 1)).float().mean()) if scores.numel() else 0.0


def prm_loss(
    cfg: PPOConfig,
    prm: torch.nn.Module,
    batch: Batch,
    sp: ulysses.SPGroup,
    *,
    prm_logprobs: torch.Tensor | None = None,
) -> LossFn:
    """The implicit PRM's share of a mini-batch's cross-entropy loss (``algorithms.prime_ce_loss``) on
    the rows ``sel``: the PRM's log-probs minus the reference's, summed over the response and scaled by
    ``reward.prime.beta_train``, against the outcome labels (``prime_labels``). Each row weighs
    ``1 / num_seqs`` of the mini-batch (all ranks), as the recipe's mean over the mini-batch. With
    ``prm_logprobs [B, R]`` the forward's log-probs (detached) are written there (``update=after``)."""
    p = cfg.reward.prime
    acc = prime_labels(batch.scores)

    def loss_fn(sel: torch.Tensor, counts: dict[str, float]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logprobs, _ = packed_forward.logprobs(
            prm,
            pack_rows(batch, sel),
            sp,
            temperature=cfg.rollout.temperature,
            backend=cfg.actor.kernel_backend,
            fused=cfg.actor.use_fused_kernels,
        )
        if prm_logprobs is not None:
            prm_logprobs[sel] = logprobs.detach()
        log_ratios = logprobs - batch.ref_logprobs[sel]
        ce = algorithms.prime_ce_loss(log_ratios, acc[sel], batch.response_mask[sel], p.beta_train)
        loss = ce * (len(sel) / counts["num_seqs"])
        return loss, {"reward_model/dpo_loss": loss}

    return loss_fn


def update_prm(cfg: PPOConfig, prm: Trained, batch: Batch, sp: ulysses.SPGroup) -> dict[str, float]:
    """PRIME's implicit PRM on this step's responses (verl recipe's ``update_rm`` and
    ``compute_rm_score``): one epoch of ``prm_loss`` in mini-batches of ``reward.prime.mini_batch_size``
    prompts (in order), micro-batched as the actor, then the token rewards ``batch.prm_rewards``
    (``algorithms.prime_token_rewards``) from a forward of the updated PRM (``update=before``) or from
    the training forwards (``update=after``), divided by the batch's largest absolute return over all
    ranks with ``prime_norm=batch_norm``. Needs ``batch.scores`` and ``batch.ref_logprobs``.

    Metrics: ``prime/label_clip_rate`` (the share of scores clipped into the labels' ``[0, 1]``), and by
    the recipe's names ``rm/lr`` (the rate this step's updates used), ``reward_model/dpo_loss``, ``reward_model/grad_norm``, ``reward_model/reward`` and ``raw_reward`` (of
    the rewards used), ``reward_model/dpo_acc_before`` and ``dpo_acc_abs_before`` (of the training
    forwards, before each mini-batch's update), and with ``update=before`` ``reward_model/dpo_acc`` and
    ``dpo_acc_abs`` (of the updated PRM)."""
    p = cfg.reward.prime
    role = dataclasses.replace(cfg.actor, ppo_epochs=1, grad_clip=p.grad_clip)
    lr = prm.optimizer.param_groups[0]["lr"]  # the rate this step's updates use
    mask = batch.response_mask
    acc = prime_labels(batch.scores)
    trained_logprobs = torch.zeros_like(mask, dtype=torch.float32)
    out = optimize(
        role,
        "reward_model",
        prm,
        batch,
        prm_loss(cfg, prm.model, batch, sp, prm_logprobs=trained_logprobs),
        num_mini=cfg.data.train_batch_size // p.mini_batch_size,
        shuffle=False,
        sp=sp,
    )
    prm.scheduler.step()
    out["rm/lr"] = lr
    out["prime/label_clip_rate"] = label_clip_rate(batch.scores)
    before = algorithms.prime_token_rewards(trained_logprobs, batch.ref_logprobs, mask, p.beta_train).sum(-1)
    out["reward_model/dpo_acc_before"] = algorithms.dpo_accuracy(before, acc, batch.group_ids).item()
    out["reward_model/dpo_acc_abs_before"] = algorithms.dpo_abs_accuracy(before, acc).item()
    prm_logprobs = trained_logprobs
    if p.update == "before":
        mb = cfg.actor.ppo_micro_batch_size_per_gpu
        prm_logprobs = forwards.forward_logprobs(cfg, prm.model, batch, mb, sp)
    token_rewards = algorithms.prime_token_rewards(prm_logprobs, batch.ref_logprobs, mask, p.beta_train)
    if p.update == "before":
        seq_rewards = token_rewards.sum(-1)
        out["reward_model/dpo_acc"] = algorithms.dpo_accuracy(seq_rewards, acc, batch.group_ids).item()
        out["reward_model/dpo_acc_abs"] = algorithms.dpo_abs_accuracy(seq_rewards, acc).item()
    if p.prime_norm == "batch_norm":
        largest = all_reduce_scalar(float(algorithms.prime_max_abs_return(token_rewards)), "max")
        token_rewards = algorithms.prime_norm(token_rewards, largest)
    batch.prm_rewards = token_rewards
    out["reward_model/reward"] = token_rewards.sum(-1).mean().item()
    log_ratios = torch.where(mask, prm_logprobs - batch.ref_logprobs, torch.zeros_like(prm_logprobs))
    out["reward_model/raw_reward"] = log_ratios.sum(-1).mean().item()
    return out
