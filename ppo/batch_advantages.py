"""Step 3: token rewards (the outcome score on the last generated token, a multi-turn environment's step
rewards, minus the in-reward KL penalty) and the advantages of ``algorithm.adv_estimator``, into the batch.

    metrics = compute_advantages(cfg, batch, kl_ctrl, step)   # batch.token_rewards, .advantages, .returns
"""

from __future__ import annotations

import math

import torch

import ppo_kernels
from ppo import algorithms
from ppo.batch import Batch
from ppo.config import PPOConfig
from ppo.distributed import all_reduce_scalar, all_reduce_scalars, all_reduce_sum


def compute_advantages(
    cfg: PPOConfig,
    batch: Batch,
    kl_ctrl: algorithms.FixedKLController | algorithms.AdaptiveKLController,
    step: int,
) -> dict[str, float]:
    """Token rewards (score on the last generated token, plus a multi-turn environment's step rewards,
    minus the in-reward KL penalty) and advantages, over the loss mask (the generated tokens).

    The group estimators (GRPO, RLOO, REINFORCE++-baseline, OPO) take each sequence's summed token
    rewards, as verl does (``token_level_rewards.sum(-1)``): with KL in the reward, a sequence that
    drifted from the reference earns less than its score. GAE, REINFORCE++ and REINFORCE++-baseline
    whiten over every valid token of the global batch (one all-reduce pattern for the three).
    """
    mask = batch.loss_mask
    token_rewards = batch.rollout.step_rewards.float().clone()
    token_rewards[batch.rows(), last_true(mask)] += batch.scores
    metrics: dict[str, float] = {}
    if cfg.algorithm.use_kl_in_reward:
        kind = cfg.algorithm.kl_penalty
        if kind == "full":
            kl = batch.full_kl
        else:
            kl = kl_estimate(batch.old_logprobs, batch.ref_logprobs, kind, cfg.actor.kernels)
        kl = torch.where(mask, kl, torch.zeros_like(kl))
        beta = kl_ctrl.value
        token_rewards = token_rewards - beta * kl
        # The controller sees the batch's mean per-sequence KL over all ranks.
        seq_kl = algorithms.masked_mean(kl, mask, dim=-1).mean().item()
        metrics["actor/reward_kl_penalty"] = seq_kl
        metrics["actor/reward_kl_penalty_coeff"] = beta  # the coefficient used on this batch
        current_kl = all_reduce_scalar(seq_kl, "mean")
        if step > cfg.algorithm.kl_ctrl.fixed_warmup_steps:
            kl_ctrl.update(current_kl, n_steps=cfg.data.train_batch_size * cfg.rollout.n)
    batch.token_rewards = token_rewards
    estimate(cfg, batch)
    return metrics


def estimate(cfg: PPOConfig, batch: Batch) -> None:
    """``batch.advantages`` and ``batch.returns`` from ``batch.token_rewards`` by
    ``algorithm.adv_estimator``; the group estimators' returns are their advantages. SPPO
    (``actor.policy_loss.loss_mode=sppo``) has targets instead (``sppo_targets``)."""
    est, alg = cfg.algorithm.adv_estimator, cfg.algorithm
    token_rewards, mask = batch.token_rewards, batch.loss_mask
    sp_size = cfg.actor.ulysses_sequence_parallel_size
    if cfg.actor.policy_loss.loss_mode == "sppo":
        # The target on every position of its row: the loss reads column 0, the batch metrics the masked mean.
        targets = sppo_targets(cfg, batch)
        batch.advantages = targets[:, None].expand_as(token_rewards).clone()
        batch.returns = batch.advantages
        return

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        # The ranks of a sequence-parallel group hold the same tokens: count them once.
        return all_reduce_sum(t).div_(sp_size)

    if est == "gae":
        batch.advantages, batch.returns = algorithms.compute_gae(
            token_rewards, batch.values, mask, alg.gamma, alg.lam, all_reduce=all_reduce
        )
        return
    if est == "reinforce_plus_plus":
        batch.advantages, batch.returns = algorithms.compute_reinforce_plus_plus_advantages(
            token_rewards, mask, alg.gamma, all_reduce=all_reduce
        )
        return
    seq_rewards, groups = token_rewards.sum(-1), batch.group_ids
    if est == "prime":  # RLOO over the implicit PRM's token rewards and over the outcome, whitened
        batch.advantages, batch.returns = algorithms.compute_prime_advantages(
            batch.prm_rewards,
            seq_rewards,
            groups,
            mask,
            alg.reward_dpo_coef,
            alg.reward_gt_coef,
            all_reduce=all_reduce,
        )
        return
    if est == "grpo":
        batch.advantages = algorithms.compute_grpo_advantages(
            seq_rewards, groups, mask, norm_by_std=alg.norm_adv_by_std_in_grpo
        )
    elif est == "rloo":
        batch.advantages = algorithms.compute_rloo_advantages(seq_rewards, groups, mask)
    elif est == "reinforce_plus_plus_baseline":
        batch.advantages = algorithms.compute_reinforce_plus_plus_baseline_advantages(
            seq_rewards, groups, mask, all_reduce=all_reduce
        )
    else:
        batch.advantages = algorithms.compute_opo_advantages(seq_rewards, groups, mask)
    batch.returns = batch.advantages


def sppo_targets(cfg: PPOConfig, batch: Batch) -> torch.Tensor:
    """``[B]`` SPPO's target of each response (``algorithm.sppo_target``), ``actor.sppo_eta`` times:

    - ``win_rate``: ``P - 1/2``, with ``P`` the share of the group's other responses it beats
      (``algorithms.win_rates``, ties 1/2) by summed token rewards, or, for offline groups under
      ``reward.style=ranking``, by the data's ranks themselves (ties in rank are ties);
    - ``softmean``: ``r - softmean_beta(r)`` with ``r`` the summed token rewards and the soft mean over
      the whole batch on all ranks (verl's recipe takes it over the driver's whole batch).
    """
    alg = cfg.algorithm
    seq_rewards = batch.token_rewards.sum(-1)
    if alg.sppo_target == "softmean":
        return cfg.actor.sppo_eta * (seq_rewards - global_softmean(seq_rewards, alg.sppo_beta))
    keys = seq_rewards
    if cfg.reward.style == "ranking" and batch.data_ranks is not None:
        offline_rows = batch.data_ranks >= 0  # groups are all offline or all sampled
        keys = torch.where(offline_rows, -batch.data_ranks.to(seq_rewards.dtype), seq_rewards)
    return cfg.actor.sppo_eta * (algorithms.win_rates(keys, batch.group_ids) - 0.5)


def global_softmean(x: torch.Tensor, beta: float) -> float:
    """``algorithms.softmean`` of ``x [B]`` over every rank's rows (each row once under sequence
    parallelism): ``m + log(Σ exp(beta (x - m)) / n) / beta`` with ``m`` the global maximum, in float64."""
    # Sequence-parallel ranks hold the same rows: the sums and the count count each row sp times alike,
    # so their ratio is the batch's.
    x = x.double()
    if beta == 0.0:
        total, count = all_reduce_scalars([float(x.sum()), float(x.numel())], "sum")
        return total / count
    # The shift by the extreme value that dominates keeps every exp() at most 1.
    m = all_reduce_scalar(float((x * beta).max()), "max") / beta
    total, count = all_reduce_scalars([float(torch.exp(beta * (x - m)).sum()), float(x.numel())], "sum")
    return m + (math.log(total) - math.log(count)) / beta


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str, backend: str) -> torch.Tensor:
    """Per-token KL estimate ``[B, R]`` (``algorithms.kl_penalty``) for the KL in the reward and the KL
    loss; k3 runs on the ``ppo_kernels`` low-variance KL op (Triton on GPU), which computes the same values
    and gradients."""
    if kind in ("low_var_kl", "k3"):
        return ppo_kernels.low_var_kl(logprobs, ref_logprobs, backend=backend)
    return algorithms.kl_penalty(logprobs, ref_logprobs, kind)


def last_true(mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` the position of the last True of each row of ``mask [B, R]`` (0 for a row with none): where
    the outcome reward lands (the final generated token; observation tokens after it are not trained)."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, 0).amax(-1)
