"""Step 3: token rewards (the outcome score on the last generated token, a multi-turn environment's step
rewards, minus the in-reward KL penalty) and the advantages of ``algorithm.adv_estimator``, into the batch.

    metrics = compute_advantages(cfg, batch, kl_ctrl, step)   # batch.token_rewards, .advantages, .returns
"""

from __future__ import annotations

import torch

from ppo import algorithms
from ppo.batch import Batch
from ppo.config import PPOConfig
from ppo.distributed import all_reduce_scalar, all_reduce_sum
from ppo.token_kl import kl_estimate


def compute_advantages(
    cfg: PPOConfig,
    batch: Batch,
    kl_ctrl: algorithms.FixedKLController | algorithms.AdaptiveKLController,
    step: int,
) -> dict[str, float]:
    """Token rewards (score on the last generated token, plus a multi-turn environment's step rewards,
    minus the in-reward KL penalty) and advantages, over the response mask (the generated tokens).

    The group estimators (GRPO, RLOO, REINFORCE++-baseline, OPO) take each sequence's summed token
    rewards, as verl does (``token_level_rewards.sum(-1)``): with KL in the reward, a sequence that
    drifted from the reference earns less than its score. GAE, REINFORCE++ and REINFORCE++-baseline
    whiten over every valid token of the global batch (one all-reduce pattern for the three). Without the
    task's loss (``PPOConfig.task_loss``: distillation alone) only the token rewards are set.
    """
    mask = batch.response_mask
    token_rewards = batch.rollout.step_rewards.float().clone()
    token_rewards[batch.rows(), last_true(mask)] += batch.scores
    metrics: dict[str, float] = {}
    if not cfg.task_loss:  # distillation alone: the rewards are logged, no advantage is trained on
        batch.token_rewards = token_rewards
        return metrics
    if cfg.algorithm.use_kl_in_reward:
        kind = cfg.algorithm.kl_penalty
        if kind == "full":
            kl = batch.full_kl
        else:
            kl = kl_estimate(batch.old_logprobs, batch.ref_logprobs, kind, cfg.actor.kernel_backend)
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
    """``batch.advantages``, ``batch.returns`` (and ``batch.targets``) from ``batch.token_rewards`` by the
    estimator named ``cfg.advantage_estimator`` (``algorithms.ADVANTAGE_ESTIMATORS``)."""
    alg = cfg.algorithm
    sp_size = cfg.actor.ulysses_sequence_parallel_size

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        # The ranks of a sequence-parallel group hold the same tokens: count them once.
        return all_reduce_sum(t).div_(sp_size)

    def all_reduce_max(t: torch.Tensor) -> torch.Tensor:  # one number
        return t.new_tensor([all_reduce_scalar(float(t[0]), "max")])

    inputs = algorithms.AdvantageInputs(
        token_rewards=batch.token_rewards,
        response_mask=batch.response_mask,
        group_ids=batch.group_ids,
        values=batch.values,
        prm_rewards=batch.prm_rewards,
        data_ranks=batch.data_ranks if cfg.reward.style == "ranking" else None,
        all_reduce=all_reduce,
        all_reduce_max=all_reduce_max,
    )
    settings = algorithms.AdvantageSettings(
        gamma=alg.gamma,
        lam=alg.lam,
        norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
        reward_dpo_coef=alg.reward_dpo_coef,
        reward_gt_coef=alg.reward_gt_coef,
        sppo_target=alg.sppo_target,
        sppo_eta=cfg.actor.sppo_eta,
        sppo_beta=alg.sppo_beta,
    )
    batch.advantages, batch.returns, batch.targets = algorithms.ADVANTAGE_ESTIMATORS[cfg.advantage_estimator](
        inputs, settings
    )


def last_true(mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` the position of the last True of each row of ``mask [B, R]`` (0 for a row with none): where
    the outcome reward lands (the final generated token; observation tokens after it are not trained)."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, 0).amax(-1)
