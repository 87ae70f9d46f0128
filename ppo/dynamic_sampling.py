"""DAPO's dynamic sampling (Yu et al., arXiv:2503.14476; verl's ``algorithm.filter_groups``): rounds of
sampling and scoring until enough prompt groups have responses that score unlike, then an equal share of
the first ``data.train_batch_size`` of them, in the loader's order, on every rank.

    batch, metrics = collect_filtered(cfg, loader, timer, sample_round=..., score_responses=...,
                                      between_rounds=..., device=device)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ppo import algorithms, rewards
from ppo.batch import Batch, Rollout, concat_rollouts, group_index, rollout_rows
from ppo.config import PPOConfig
from ppo.data import ShardedLoader
from ppo.distributed import all_gather_object, all_reduce_scalar, all_reduce_scalars
from ppo.metrics import Timer
from ppo.step_end import EndStep, TrainingError


@dataclass(kw_only=True)
class KeptGroup:
    """A prompt's ``n`` responses that dynamic sampling keeps, on the CPU (it may move to another rank)."""

    key: tuple[int, int, int, int]
    """``(round, loader batch in the round, rank, position in the rank's share)``: sorted, the global
    order of the prompts as the loader drew them, the same on any number of ranks."""
    record: Any
    rollout: Rollout
    """The group's ``n`` sequences."""
    raw_scores: torch.Tensor
    """``[n]`` the reward's scores, before the overlong penalty."""


def collect_filtered(
    cfg: PPOConfig,
    loader: ShardedLoader,
    timer: Timer,
    *,
    sample_round: Callable[[list], Batch],
    score_responses: Callable[[Batch], tuple[torch.Tensor, dict[str, float]]],
    between_rounds: Callable[[], None],
    device: torch.device,
) -> tuple[Batch, dict[str, float]]:
    """DAPO's dynamic sampling (verl's ``algorithm.filter_groups``): generate and score rounds of
    ``data.gen_batch_size`` prompts, drop the groups whose responses all have the same
    ``filter_groups.metric``, until ``data.train_batch_size`` groups are kept over all ranks; the step
    trains on the first ``train_batch_size`` of them in the loader's order (``kept_group_slots``), each
    rank on an equal share, so a group may move to another rank.

    Every rank runs the same rounds: the kept count is all-reduced after each (a rank whose groups all
    tie just generates again with the others). A round draws ``gen_batch_size / train_batch_size``
    batches from the loader, so the loader's position (checkpointed) advances by what was drawn, and a
    run killed during a refill round redoes the step from its checkpoint with the same prompts. After
    ``filter_groups.max_num_gen_batches`` rounds short of a full batch the run stops with an error; a
    non-finite reward on any rank ends the step (skipped).

    ``sample_round(items)``: the batch of ``n`` responses to each of the round's loader items;
    ``score_responses(batch)``: the reward's ``[B]`` scores and metrics; ``between_rounds()``: called
    before each refill round (where a stop signal ends the step); ``device``: where the batch goes."""
    f, n, want = cfg.algorithm.filter_groups, cfg.rollout.n, cfg.data.train_batch_size
    kept: list[KeptGroup] = []
    metrics: dict[str, float] = {}
    num_kept = num_generated = 0
    rounds = 0
    while num_kept < want:
        if f.max_num_gen_batches and rounds >= f.max_num_gen_batches:
            raise TrainingError(
                f"dynamic sampling: {rounds} generation rounds of data.gen_batch_size={cfg.data.gen_batch_size} "
                f"prompts (algorithm.filter_groups.max_num_gen_batches={f.max_num_gen_batches}) kept {num_kept:.0f} "
                f"of the data.train_batch_size={want} prompt groups a step needs: only {num_kept:.0f} of "
                f"{num_generated:.0f} groups had responses whose {f.metric} differed. Raise "
                f"algorithm.filter_groups.max_num_gen_batches (0: no limit) or data.gen_batch_size, use prompts "
                f"the policy sometimes solves, a finer algorithm.filter_groups.metric (score), or "
                f"algorithm.filter_groups.enable=false"
            )
        if rounds:
            between_rounds()
        shares = [next(loader) for _ in range(cfg.data.gen_batch_size // want)]
        items = [r for share in shares for r in share]
        batch = sample_round(items)
        with timer("reward"):
            raw, reward_metrics = score_responses(batch)
        for k, v in reward_metrics.items():  # counts add up over the rounds; extras: the last round's
            metrics[k] = metrics.get(k, 0.0) + v if k in ("reward/timeouts", "reward/errors") else v
        if all_reduce_scalar(float(not torch.isfinite(raw).all()), "max"):
            raise EndStep("skip", "non-finite reward")
        if f.metric == "seq_reward":  # the score the step trains with
            values, _ = rewards.shape_scores(
                raw, batch.attention_mask, cfg.reward, max_response_length=cfg.data.max_response_length
            )
        else:
            values = (raw >= 1.0).float() if f.metric == "acc" else raw
        keep = algorithms.filter_groups(values, batch.group_ids)[::n].tolist()
        rollout = batch.rollout
        positions = [(j, p) for j, share in enumerate(shares) for p in range(len(share))]
        for g, (j, p) in enumerate(positions):
            if keep[g]:
                rows = slice(g * n, (g + 1) * n)
                kept.append(
                    KeptGroup(
                        key=(rounds, j, loader.rank, p),
                        record=items[g],
                        rollout=rollout_rows(rollout, rows, torch.device("cpu")),
                        raw_scores=raw[rows].cpu(),
                    )
                )
        kept_now, generated_now = all_reduce_scalars([float(sum(keep)), float(len(keep))], "sum")
        num_kept, num_generated, rounds = num_kept + kept_now, num_generated + generated_now, rounds + 1
    groups = exchange_kept_groups(kept, want, rank=loader.rank, world_size=loader.world_size)
    records = [g.record for g in groups for _ in range(n)]
    rollout = concat_rollouts([g.rollout for g in groups], device)
    batch = Batch(rollout=rollout, records=records, group_ids=group_index(len(records), n, device))
    raw = torch.cat([g.raw_scores for g in groups]).to(device)
    batch.scores, shaping_metrics = rewards.shape_scores(
        raw, batch.attention_mask, cfg.reward, max_response_length=cfg.data.max_response_length
    )
    metrics |= {"train/num_gen_batches": float(rounds), "train/kept_group_share": num_kept / num_generated}
    metrics.update(shaping_metrics)
    return batch, metrics


def kept_group_slots(keys: list[list[tuple]], num_groups: int, world_size: int) -> dict[tuple, int]:
    """Which rank trains each kept group: the first ``num_groups`` of every rank's ``keys`` (``keys[r]``
    are rank r's) in sorted (the loader's) order, ``num_groups / world_size`` consecutive ones per rank;
    groups past the first ``num_groups`` are dropped (absent). Example: 2 ranks, 4 groups, rank 0 kept
    ``(0,0,0,0), (0,0,0,1), (1,0,0,0)``, rank 1 kept ``(1,0,1,0)``: ranks 0, 0, 1, 1 in that order."""
    ordered = sorted(key for rank_keys in keys for key in rank_keys)[:num_groups]
    per_rank = num_groups // world_size
    return {key: i // per_rank for i, key in enumerate(ordered)}


def exchange_kept_groups(
    kept: list[KeptGroup], num_groups: int, *, rank: int, world_size: int
) -> list[KeptGroup]:
    """This rank's share of the first ``num_groups`` kept groups of all ranks (``kept_group_slots``), in
    order: the keys are all-gathered, then the groups that change rank (and only those)."""
    slots = kept_group_slots(all_gather_object([g.key for g in kept]), num_groups, world_size)
    moving = [g for g in kept if g.key in slots and slots[g.key] != rank]
    arrived = [g for part in all_gather_object(moving) for g in part if slots[g.key] == rank]
    mine = {g.key: g for g in kept + arrived if slots.get(g.key) == rank}
    return [mine[key] for key in sorted(mine)]
