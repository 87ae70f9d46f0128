"""PRIME's accuracy filter (verl recipe's ``data.filter_accuracy``): sample more prompts than a step
trains on, score them, and keep first the prompts whose group accuracy lies within
``[data.accuracy_lower_bound, data.accuracy_upper_bound]`` (neither always solved nor never).

    batch, metrics = collect_accuracy_filtered(cfg, loader, timer, sample_round=..., score_responses=...)

The recipe draws ``oversample_factor`` times the batch and keeps the first ``1/oversample_factor`` after
moving the passing groups to the front; here ``data.gen_batch_size / data.train_batch_size`` is that
factor, and each rank keeps its own share (its passing groups first, in the loader's order), so the
ranks stay balanced without moving groups between them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ppo import algorithms, rewards
from ppo.batch import Batch, concat_rollouts, group_index, rollout_rows
from ppo.config import PPOConfig
from ppo.data import ShardedLoader
from ppo.distributed import all_reduce_scalars
from ppo.metrics import Timer


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
    penalties = rewards.overlong_penalties(
        batch.response_mask, cfg.reward.overlong_buffer, max_response_length=d.max_response_length
    )
    acc = (raw >= 1.0).float()
    passed = algorithms.accuracy_filter(acc, n, d.accuracy_lower_bound, d.accuracy_upper_bound).tolist()
    # Passing groups first, each kind in the loader's order; the step trains on one batch's share.
    kept = sorted(range(len(items)), key=lambda g: (not passed[g], g))[: len(shares[0])]
    rows = torch.cat([torch.arange(g * n, (g + 1) * n) for g in kept]).to(raw.device)
    device = batch.response_mask.device
    rollout = concat_rollouts([rollout_rows(batch.rollout, slice(g * n, (g + 1) * n), device) for g in kept])
    records = [items[g] for g in kept for _ in range(n)]
    out = Batch(rollout=rollout, records=records, group_ids=group_index(len(records), n, device))
    out.scores = raw[rows] + penalties[rows]
    num_passed, num_groups, num_correct, num_responses = all_reduce_scalars(
        [float(sum(passed)), float(len(passed)), float(acc.sum()), float(acc.numel())], "sum"
    )
    metrics |= {"prime/filter_keep_rate": num_passed / num_groups, "prime/acc": num_correct / num_responses}
    if cfg.reward.overlong_buffer.enable:
        metrics.update(rewards.overlong_metrics(penalties[rows]))
    return out, metrics
