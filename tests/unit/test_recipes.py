"""The reasoning-RL recipes with verl's keys: REINFORCE++ (and its baseline variant), OPO, Dr. GRPO, GSPO,
Clip-Cov and KL-Cov, DAPO's dynamic sampling and overlong penalty, pass@k validation.

Hand-worked values next to each assertion; cross-rank reductions checked with threads standing in for
ranks (``Ranks``); then end to end on the tiny model: every estimator and loss gives the same
parameters on 1 rank (two token budgets), 2 ranks and 2 ranks of sequence parallelism; dynamic
sampling when one rank's groups always tie, and across a kill -9 in a refill round.

    pytest tests/unit/test_recipes.py -m "not slow"     # the math and the config, seconds
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from ppo.algorithms import (
    ADV_ESTIMATORS,
    POLICY_LOSS_MODES,
    agg_loss,
    clip_cov_selection,
    compute_grpo_advantages,
    compute_opo_advantages,
    compute_reinforce_plus_plus_advantages,
    compute_reinforce_plus_plus_baseline_advantages,
    compute_rloo_advantages,
    filter_groups,
    kl_cov_selection,
    pass_at_k,
    policy_loss,
    token_covariance,
)
from ppo.config import ConfigError
from ppo.config_loader import load_config
from ppo.dynamic_sampling import kept_group_slots
from ppo.periodic_validation import k_values, majority_correct, prediction
from ppo.rewards import overlong_penalty
from tests.helpers import (
    ROOT,
    base_args,
    close,
    demo_inputs,
    deterministic,
    excerpt,
    hf_weights,
    read_metrics,
    run,
    t64,
    torchrun,
    train,
    wait_until,
    write_parquet,
)
from tests.reward_fns import digit_score

RECIPE_FNS = ROOT / "tests" / "recipe_rewards.py"


class Ranks:
    """Threads standing in for ranks: ``all_reduce(rank)`` and ``all_gather(rank)`` are that rank's
    collectives (a sum, a concatenation in rank order), each blocking until every rank made the call."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size)
        self.slots: list[Any] = [None] * size

    def _exchange(self, rank: int, t: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = t.clone()
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()
        return parts

    def all_reduce(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def reduce(t: torch.Tensor) -> torch.Tensor:
            parts = self._exchange(rank, t)
            return t.copy_(sum(parts[1:], parts[0]))

        return reduce

    def all_gather(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda t: torch.cat(self._exchange(rank, t))

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        """``fn(rank)`` on every rank at once; the results in rank order."""
        out: list[Any] = [None] * self.size
        errors: list[BaseException] = []

        def target(rank: int) -> None:
            try:
                out[rank] = fn(rank)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.size)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if errors:
            raise errors[0]
        return out


# ----------------------------------------------------------------------------------------------------
# Advantage estimators
# ----------------------------------------------------------------------------------------------------


def test_group_baselines_by_hand() -> None:
    scores, groups, mask = t64([1.0, 0.0, 0.0, 0.0]), torch.zeros(4, dtype=torch.long), torch.ones(4, 1)
    # GRPO: mean 0.25, unbiased std sqrt((0.75² + 3 · 0.25²) / 3) = sqrt(0.25) = 0.5:
    # (1 - 0.25) / 0.5 = 1.5, (0 - 0.25) / 0.5 = -0.5
    close(compute_grpo_advantages(scores, groups, mask)[:, 0], [1.5, -0.5, -0.5, -0.5], atol=1e-5)
    # Dr. GRPO (no division by the std): 1 - 0.25 = 0.75, 0 - 0.25 = -0.25
    drgrpo = compute_grpo_advantages(scores, groups, mask, norm_by_std=False)
    close(drgrpo[:, 0], [0.75, -0.25, -0.25, -0.25])
    # RLOO: each minus the mean of the other three: 1 - 0 = 1, 0 - 1/3 = -1/3
    close(compute_rloo_advantages(scores, groups, mask)[:, 0], [1.0, -1 / 3, -1 / 3, -1 / 3])


def test_opo_weights_the_baseline_by_length() -> None:
    scores, groups = t64([1.0, 0.0, 5.0]), torch.tensor([0, 0, 1])
    mask = torch.zeros(3, 6, dtype=torch.bool)
    mask[0, :2] = mask[1, :6] = mask[2, :3] = True  # lengths 2, 6 and 3
    adv = compute_opo_advantages(scores, groups, mask)
    # b = (2 · 1 + 6 · 0) / (2 + 6) = 0.25: 1 - 0.25 = 0.75 on row 0's two tokens, -0.25 on row 1's six
    close(adv[0], [0.75, 0.75, 0, 0, 0, 0])
    close(adv[1], [-0.25] * 6)
    # a group of one has baseline 0: its score, 5, on its 3 tokens
    close(adv[2], [5.0, 5.0, 5.0, 0, 0, 0])
    # the unweighted mean (GRPO's, Dr. GRPO) would give 1 - 0.5 = 0.5: the length weighting matters
    assert not torch.allclose(
        adv[0, 0], compute_grpo_advantages(scores, groups, mask, norm_by_std=False)[0, 0]
    )


def test_reinforce_plus_plus_carries_the_return_over_masked_tokens() -> None:
    rewards = t64([[0.0, 0.0, 1.0], [0.0, 7.0, 2.0]])
    mask = torch.tensor([[True, True, True], [True, False, True]])  # row 1: a hole at t = 1
    adv, returns = compute_reinforce_plus_plus_advantages(rewards, mask, gamma=0.5)
    # row 0: G_2 = 1, G_1 = 0 + 0.5 · 1 = 0.5, G_0 = 0.25
    # row 1: G_2 = 2; t = 1 is masked: its reward 7 is ignored and G carries over (return 0 there);
    # G_0 = 0 + 0.5 · 2 = 1 (verl's reset to 0 at the hole would give 0)
    close(returns, [[0.25, 0.5, 1.0], [1.0, 0.0, 2.0]])
    # whitened over the 5 valid returns 0.25, 0.5, 1, 1, 2: mean 0.95, squared deviations
    # 0.49 + 0.2025 + 0.0025 + 0.0025 + 1.1025 = 1.8, unbiased var 1.8 / 4 = 0.45, std 0.670820
    s = math.sqrt(0.45 + 1e-8)
    close(adv, [[-0.7 / s, -0.45 / s, 0.05 / s], [0.05 / s, 0.0, 1.05 / s]])


def test_reinforce_plus_plus_baseline_by_hand() -> None:
    scores, groups = t64([1.0, 0.0, 0.0, 0.0, 3.0]), torch.tensor([0, 0, 0, 0, 1])
    mask = torch.tensor([[1, 1], [1, 0], [1, 0], [1, 0], [1, 0]], dtype=torch.bool)
    adv = compute_reinforce_plus_plus_baseline_advantages(scores, groups, mask)
    # minus the group mean 0.25 (no std): 0.75 (2 tokens), -0.25 (3 x 1 token); the group of one keeps
    # 3 (baseline 0). Token values 0.75, 0.75, -0.25, -0.25, -0.25, 3: mean 3.75 / 6 = 0.625, squared
    # deviations 2 · 0.015625 + 3 · 0.765625 + 5.640625 = 7.96875, unbiased var 1.59375
    s = math.sqrt(1.59375 + 1e-8)
    expected = [[0.125 / s, 0.125 / s], [-0.875 / s, 0], [-0.875 / s, 0], [-0.875 / s, 0], [2.375 / s, 0]]
    close(adv, expected)


@pytest.mark.parametrize("estimator", ["rpp", "rpp_baseline"])
def test_whitening_over_ranks_equals_one_batch(estimator: str) -> None:
    """Two ranks, each with half the rows (and a different number of valid tokens), whiten with the
    whole batch's statistics: the concatenated result is the one-batch result."""
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    mask = torch.arange(5)[None, :] < torch.tensor([5, 1, 3, 4, 2, 5])[:, None]
    scores, groups = rewards.sum(-1), torch.tensor([0, 0, 0, 1, 1, 1])

    def compute(rows: slice, all_reduce: Callable | None) -> torch.Tensor:
        if estimator == "rpp":
            return compute_reinforce_plus_plus_advantages(
                rewards[rows], mask[rows], 0.9, all_reduce=all_reduce
            )[0]
        return compute_reinforce_plus_plus_baseline_advantages(
            scores[rows], groups[rows], mask[rows], all_reduce=all_reduce
        )

    whole = compute(slice(None), None)
    ranks = Ranks(2)
    parts = ranks.run(lambda r: compute(slice(3 * r, 3 * r + 3), ranks.all_reduce(r)))
    torch.testing.assert_close(torch.cat(parts), whole, rtol=0, atol=1e-12)
    # without the reduction each half whitens by its own statistics: different numbers
    assert not torch.allclose(torch.cat([compute(slice(0, 3), None), compute(slice(3, 6), None)]), whole)


def test_filter_groups_keeps_groups_that_differ() -> None:
    values = t64([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    # group 0 ties (1, 1), group 1 differs, group 2 ties (0, 0), group 3 is one response (kept, as verl)
    assert filter_groups(values, groups).tolist() == [False, False, True, True, False, False, True]


# ----------------------------------------------------------------------------------------------------
# Loss aggregation and policy losses
# ----------------------------------------------------------------------------------------------------


def test_seq_mean_token_sum_norm_is_the_sequence_mean_over_the_scale_factor() -> None:
    loss_mat = t64([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])  # token sums 6 and 9
    # (6 + 9) / 2 sequences / T with T = 3 = 2.5 (verl 0.9.1's agg_loss; the empty row is no sequence)
    close(agg_loss(loss_mat, mask, "seq-mean-token-sum-norm"), 2.5)
    # loss_scale_factor = 5 (actor.loss_scale_factor), 6 sequences counted over the mini-batch:
    # 15 / 6 / 5 = 0.5
    close(agg_loss(loss_mat, mask, "seq-mean-token-sum-norm", num_seqs=6, loss_scale_factor=5), 0.5)
    # two micro-batches of the same T with the global count (2) add up to the whole batch's loss
    halves = sum(
        agg_loss(loss_mat[rows], mask[rows], "seq-mean-token-sum-norm", num_seqs=2)
        for rows in (slice(0, 1), slice(1, 3))
    )
    close(halves, 2.5)


def gspo_batch() -> dict[str, torch.Tensor]:
    """Three rows: a small log-ratio (inside the clip), a large one with A > 0 (clipped) and with A < 0."""
    old = t64([[-1.2, -1.9, 0.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    logprobs = old + t64([[0.2, -0.1, 0.0], [0.6, 0.4, 0.5], [0.6, 0.4, 0.5]])
    return {
        "logprobs": logprobs.requires_grad_(),
        "old": old,
        "adv": t64([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]]),
        "mask": torch.tensor([[True, True, False], [True, True, True], [True, True, True]]),
    }


def test_gspo_by_hand() -> None:
    b = gspo_batch()
    loss, metrics = policy_loss(
        b["logprobs"], b["old"], b["adv"], b["mask"], 0.2, 0.28, 3.0, "token-mean", loss_mode="gspo"
    )
    # s_0 = exp(mean(0.2, -0.1)) = e^0.05 = 1.051271 inside [0.8, 1.28]: -A · s = -1.051271 per token;
    # s_1 = s_2 = e^0.5 = 1.648721. Row 1 (A = 1): max(-1.648721, -1.28) = -1.28 (clipped, no gradient);
    # row 2 (A = -1): max(1.648721, 1.28) = 1.648721 (GSPO has no dual clip).
    # token-mean over the 8 tokens (loss_agg_mode, as verl 0.9.1):
    # (2 · -1.051271 + 3 · -1.28 + 3 · 1.648721) / 8 = -0.124502
    close(loss, (-2 * math.exp(0.05) - 3 * 1.28 + 3 * math.exp(0.5)) / 8)
    loss.backward()
    # d/d log π_t of -A · sg(s) · π_t / sg(π_t) is -A · s, then / 8 tokens
    g = b["logprobs"].grad
    close(g[0], [-math.exp(0.05) / 8, -math.exp(0.05) / 8, 0.0])
    close(g[1], [0.0, 0.0, 0.0])
    close(g[2], [math.exp(0.5) / 8] * 3)
    # seq-mean-token-mean (the paper's aggregation): (-1.051271 - 1.28 + 1.648721) / 3 = -0.227517
    seq_loss, _ = policy_loss(
        b["logprobs"], b["old"], b["adv"], b["mask"], 0.2, 0.28, 3.0, "seq-mean-token-mean", loss_mode="gspo"
    )
    close(seq_loss, (-math.exp(0.05) - 1.28 + math.exp(0.5)) / 3)
    close(metrics["pg_clipfrac"], 3 / 8)  # row 1's three tokens of 8
    close(metrics["pg_clipfrac_lower"], 0.0)
    # the log of the sequence ratio is clamped at 10: a mean log-ratio of 11 gives e^10, not e^11
    huge, _ = policy_loss(
        b["old"][:1] + 11.0,
        b["old"][:1],
        b["adv"][:1],
        b["mask"][:1],
        1e9,
        1e9,
        3.0,
        "token-mean",
        loss_mode="gspo",
    )
    close(huge, -math.exp(10.0), atol=1e-3)


def test_gspo_on_policy_gradient_is_vanillas() -> None:
    """On policy, GSPO's ratio is 1 and its gradient is vanilla's under the same loss_agg_mode; the two
    aggregations differ (the check can fail)."""
    gen = torch.Generator().manual_seed(3)
    mask = torch.arange(6)[None, :] < torch.tensor([6, 2, 4, 1])[:, None]
    adv = torch.randn(4, 1, generator=gen, dtype=torch.float64).expand(4, 6)
    grads = {}
    for mode, agg in (
        ("gspo", "token-mean"),
        ("vanilla", "token-mean"),
        ("gspo", "seq-mean-token-mean"),
        ("vanilla", "seq-mean-token-mean"),
    ):
        logprobs = (
            -torch.rand(4, 6, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
        ).requires_grad_()
        loss, _ = policy_loss(logprobs, logprobs.detach(), adv, mask, 0.2, 0.28, 3.0, agg, loss_mode=mode)
        loss.backward()
        grads[mode, agg] = (loss.detach(), logprobs.grad)
    for agg in ("token-mean", "seq-mean-token-mean"):
        torch.testing.assert_close(grads["gspo", agg], grads["vanilla", agg], rtol=0, atol=1e-12)
    # token-mean weights long sequences more than seq-mean-token-mean
    assert not torch.allclose(grads["gspo", "token-mean"][1], grads["gspo", "seq-mean-token-mean"][1])


def cov_batch() -> dict[str, torch.Tensor]:
    """One row of 4 tokens: A = [1, 1, -1, -1], old log π = [-1, -3, -1, -3]; means 0 and -2, so the
    covariances (A - 0)(log π - (-2)) are [1, -1, -1, 1]."""
    return {
        "adv": t64([[1.0, 1.0, -1.0, -1.0]]),
        "old": t64([[-1.0, -3.0, -1.0, -3.0]]),
        "mask": torch.ones(1, 4, dtype=torch.bool),
        "ids": torch.arange(4)[None, :],
    }


def test_token_covariance_by_hand() -> None:
    b = cov_batch()
    close(token_covariance(b["adv"], b["old"], b["mask"]), [[1.0, -1.0, -1.0, 1.0]])


def test_clip_cov_by_hand() -> None:
    b = cov_batch()
    cov = token_covariance(b["adv"], b["old"], b["mask"])

    def select(ratio: float, seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return clip_cov_selection(cov, b["mask"], b["ids"], ratio=ratio, lb=0.0, ub=5.0, generator=gen)

    # candidates: cov in (0, 5) = tokens 0 and 3. ratio 0.25 of 4 tokens = 1 token, drawn from the two
    picks = {tuple(select(0.25, seed)[0].nonzero().flatten().tolist()) for seed in range(20)}
    assert picks == {(0,), (3,)}  # one of the two candidates, either one depending on the draw
    assert torch.equal(select(0.25, 7), select(0.25, 7))  # the same generator state, the same token
    # ratio 1: max(int(4 · 1), 1) = 4 wanted, only 2 candidates: both
    chosen = select(1.0, 0)
    assert chosen.tolist() == [[True, False, False, True]]
    # The loss. log π = old + [0, 0, 0, -0.5]: token 3's ratio e^-0.5 = 0.6065 < 0.8 with A = -1, so the
    # clip has cut it already (l2 = 0.8 > l1 = 0.6065): Clip-Cov leaves it. Token 0 (ratio 1) is zeroed.
    # Per token: 0, -A · 1 = -1, -A · 1 = 1, 0.8; token-mean 0.8 / 4 = 0.2
    logprobs = (b["old"] + t64([[0.0, 0.0, 0.0, -0.5]])).requires_grad_()
    loss, metrics = policy_loss(
        logprobs,
        b["old"],
        b["adv"],
        b["mask"],
        0.2,
        0.2,
        3.0,
        "token-mean",
        loss_mode="clip_cov",
        cov_mask=chosen,
    )
    close(loss, 0.2)
    loss.backward()
    # gradient -A · ρ / 4 on tokens 1 and 2; 0 on the detached token 0 and the clipped token 3
    close(logprobs.grad, [[0.0, -0.25, 0.25, 0.0]])
    close(metrics["pg_covfrac"], 0.25)
    close(metrics["pg_clipfrac"], 0.25)


def test_kl_cov_by_hand() -> None:
    b = cov_batch()
    cov = token_covariance(b["adv"], b["old"], b["mask"])
    # ratio 0.25: the 1 token of largest covariance; tokens 0 and 3 tie at 1, the smaller id wins
    chosen = kl_cov_selection(cov, b["mask"], b["ids"], ratio=0.25)
    assert chosen.tolist() == [[True, False, False, False]]
    assert kl_cov_selection(cov, b["mask"], b["ids"], ratio=0.5).tolist() == [[True, False, False, True]]
    # log π - old = [0.2, 0, 0, -0.4], κ = 0.5, no clip:
    # token 0: -1 · e^0.2 + 0.5 · 0.2 = -1.121403; tokens 1, 2: -1, 1; token 3: e^-0.4 = 0.670320
    logprobs = b["old"] + t64([[0.2, 0.0, 0.0, -0.4]])
    loss, metrics = policy_loss(
        logprobs, b["old"], b["adv"], b["mask"], 0.2, 0.2, 3.0, "token-mean",
        loss_mode="kl_cov", cov_mask=chosen, ppo_kl_coef=0.5,
    )  # fmt: skip
    close(loss, (-math.exp(0.2) + 0.1 - 1.0 + 1.0 + math.exp(-0.4)) / 4)
    close(metrics["pg_covfrac"], 0.25)
    close(metrics["pg_clipfrac"], 0.0)
    # ratio 0.5 also penalizes token 3, whose log-ratio is negative: e^-0.4 + 0.5 · |-0.4| = 0.870320
    # (without the absolute value it would be 0.470320)
    both = kl_cov_selection(cov, b["mask"], b["ids"], ratio=0.5)
    loss, _ = policy_loss(
        logprobs, b["old"], b["adv"], b["mask"], 0.2, 0.2, 3.0, "token-mean",
        loss_mode="kl_cov", cov_mask=both, ppo_kl_coef=0.5,
    )  # fmt: skip
    close(loss, (-math.exp(0.2) + 0.1 - 1.0 + 1.0 + math.exp(-0.4) + 0.2) / 4)
    with pytest.raises(ValueError, match="needs cov_mask"):
        policy_loss(logprobs, b["old"], b["adv"], b["mask"], 0.2, 0.2, 3.0, "token-mean", loss_mode="kl_cov")


@pytest.mark.parametrize("mode", ["clip_cov", "kl_cov"])
def test_cov_selection_over_ranks_equals_one_batch(mode: str) -> None:
    """Two ranks with half the rows each pick exactly the tokens one process picks from the whole batch
    (the same covariance means, the same count, the same draw or top)."""
    gen = torch.Generator().manual_seed(1)
    adv = torch.randn(6, 8, generator=gen, dtype=torch.float64)
    old = -torch.rand(6, 8, generator=gen, dtype=torch.float64) * 4
    mask = torch.arange(8)[None, :] < torch.tensor([8, 3, 5, 8, 1, 6])[:, None]
    ids = torch.arange(48).reshape(6, 8)

    def pick(rows: slice, all_reduce: Callable | None, all_gather: Callable | None) -> torch.Tensor:
        cov = token_covariance(adv[rows], old[rows], mask[rows], all_reduce=all_reduce)
        kw = dict(all_reduce=all_reduce, all_gather=all_gather)
        if mode == "kl_cov":
            return kl_cov_selection(cov, mask[rows], ids[rows], ratio=0.2, **kw)
        gen = torch.Generator().manual_seed(5)
        return clip_cov_selection(cov, mask[rows], ids[rows], ratio=0.2, lb=-0.5, ub=2.0, generator=gen, **kw)

    whole = pick(slice(None), None, None)
    assert 1 < whole.sum() < mask.sum()  # a real choice: some tokens, not all
    ranks = Ranks(2)
    parts = ranks.run(lambda r: pick(slice(3 * r, 3 * r + 3), ranks.all_reduce(r), ranks.all_gather(r)))
    assert torch.equal(torch.cat(parts), whole)


# ----------------------------------------------------------------------------------------------------
# DAPO's overlong penalty and dynamic sampling's bookkeeping; pass@k
# ----------------------------------------------------------------------------------------------------


def test_overlong_penalty_by_hand() -> None:
    # maximum 8, buffer 4: free up to 8 - 4 = 4 tokens, then -(L - 4) / 4 · 1
    got = overlong_penalty(
        torch.tensor([3, 4, 5, 6, 8]), max_response_length=8, buffer_len=4, penalty_factor=1.0
    )
    close(got, [0.0, 0.0, -0.25, -0.5, -1.0])
    got = overlong_penalty(torch.tensor([6]), max_response_length=8, buffer_len=4, penalty_factor=0.5)
    close(got, [-0.25])  # -(6 - 4) / 4 · 0.5


def test_kept_groups_go_to_ranks_in_the_loaders_order() -> None:
    # keys (round, loader batch, rank, position). Rank 0 kept three groups, rank 1 one (in round 1):
    # sorted they are rank 0's two of round 0, rank 0's and rank 1's of round 1: 2 per rank
    keys = [[(0, 0, 0, 0), (0, 0, 0, 1), (1, 0, 0, 0)], [(1, 0, 1, 0)]]
    slots = kept_group_slots(keys, num_groups=4, world_size=2)
    assert slots == {(0, 0, 0, 0): 0, (0, 0, 0, 1): 0, (1, 0, 0, 0): 1, (1, 0, 1, 0): 1}
    # a surplus past the batch is dropped: rank 1's (0, 0, 1, 1) comes before round 1
    keys = [[(0, 0, 0, 0), (0, 0, 0, 1), (1, 0, 0, 0)], [(0, 0, 1, 1), (1, 0, 1, 0)]]
    slots = kept_group_slots(keys, num_groups=4, world_size=2)
    assert slots == {(0, 0, 0, 0): 0, (0, 0, 0, 1): 0, (0, 0, 1, 1): 1, (1, 0, 0, 0): 1}
    # one rank: the same first four in order
    one = kept_group_slots([sorted(k for part in keys for k in part)], num_groups=4, world_size=1)
    assert list(one) == list(slots) and set(one.values()) == {0}


def test_pass_at_k_by_hand() -> None:
    # 1 - C(6, 4) / C(8, 4) = 1 - 15 / 70 = 0.785714
    assert pass_at_k(8, 2, 4) == pytest.approx(0.785714, abs=1e-6)
    assert pass_at_k(8, 2, 1) == pytest.approx(2 / 8)  # pass@1 is the share right
    assert pass_at_k(8, 0, 8) == 0.0 and pass_at_k(8, 1, 8) == 1.0
    assert pass_at_k(4, 3, 2) == 1.0  # fewer wrong answers (1) than draws (2): a right one is drawn
    assert k_values(8) == [1, 2, 4, 8] and k_values(6) == [1, 2, 4, 6] and k_values(1) == [1]
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)


def test_majority_vote() -> None:
    # "8" twice, "7" once: the majority "8" is wrong
    assert not majority_correct(["7", "8", "8"], [True, False, False])
    # "7" and "8" tie: the first to come, "7", is right
    assert majority_correct(["7", "8", "8", "7"], [True, False, False, True])
    assert prediction("synthetic/arith", "3 + 4 = 7\n#### 7") == "7"
    assert prediction("synthetic/arith", "no answer") is None
    assert prediction("my/source", " yes \n") == "yes"


# ----------------------------------------------------------------------------------------------------
# Config: verl's keys, and what is refused
# ----------------------------------------------------------------------------------------------------

VERL_KEYS = [
    "algorithm.adv_estimator=reinforce_plus_plus",
    "algorithm.adv_estimator=reinforce_plus_plus_baseline",
    "algorithm.adv_estimator=opo",
    "actor.loss_scale_factor=4096",
    "actor.policy_loss.loss_mode=gspo",
    "actor.policy_loss.clip_cov_ratio=0.0002",
    "actor.policy_loss.clip_cov_lb=1.0",
    "actor.policy_loss.clip_cov_ub=5.0",
    "actor.policy_loss.kl_cov_ratio=0.002",
    "actor.policy_loss.ppo_kl_coef=1.0",
    "algorithm.filter_groups.enable=true",
    "algorithm.filter_groups.metric=seq_reward",
    "algorithm.filter_groups.max_num_gen_batches=10",
    "data.gen_batch_size=96",
    "reward.overlong_buffer.len=16",
    "reward.overlong_buffer.penalty_factor=1.0",
    "rollout.val_kwargs.n=8",
    "rollout.val_kwargs.do_sample=true",
    "rollout.val_kwargs.temperature=0.6",
    "rollout.val_kwargs.top_p=0.95",
    "rollout.val_kwargs.top_k=20",
]


@pytest.mark.parametrize("override", VERL_KEYS)
def test_verl_keys_load(override: str) -> None:
    # the overlong buffer's length is checked only when it is on: on, with the key under test
    cfg = load_config(None, [override, "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=16"])
    node: Any = cfg
    key, _, value = override.partition("=")
    for part in key.split("."):
        node = getattr(node, part)
    assert str(node).lower() == value.lower() or float(node) == float(value)


def test_allowed_names_come_from_algorithms() -> None:
    assert {"reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo"} <= set(ADV_ESTIMATORS)
    assert POLICY_LOSS_MODES == ("vanilla", "gspo", "clip_cov", "kl_cov", "sppo")


REFUSED = [
    # kl_cov's penalty |log π - log π_old| is 0 in the one on-policy update
    (
        ["actor.policy_loss.loss_mode=kl_cov", "actor.ppo_mini_batch_size=32"],
        "actor.policy_loss.loss_mode=kl_cov",
    ),
    (["algorithm.filter_groups.enable=true", "rollout.n=1"], "with rollout.n=1 every group has one response"),
    (
        ["algorithm.filter_groups.enable=true", "data.gen_batch_size=48"],
        "data.gen_batch_size=48 must be a multiple",
    ),
    (
        ["algorithm.filter_groups.enable=true", "rollout.source=dataset", "algorithm.adv_estimator=grpo"],
        "offline groups",
    ),
    (
        ["reward.overlong_buffer.enable=true"],
        "reward.overlong_buffer.len=0 must be in (0, data.max_response_length",
    ),
    (
        ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=33"],
        "reward.overlong_buffer.len=33",
    ),
    (["actor.loss_scale_factor=0"], "actor.loss_scale_factor must be > 0"),
    (["actor.policy_loss.clip_cov_ratio=0"], "clip_cov_ratio must be in (0, 1]"),
    (["actor.policy_loss.clip_cov_lb=5", "actor.policy_loss.clip_cov_ub=1"], "clip_cov_lb=5.0 must be below"),
    (["rollout.val_kwargs.n=0"], "rollout.val_kwargs.n must be >= 1"),
    (["rollout.val_kwargs.top_k=-2"], "rollout.val_kwargs.top_k"),
    (["algorithm.filter_groups.max_num_gen_batches=-1"], "max_num_gen_batches must be >= 0"),
]


@pytest.mark.parametrize(("overrides", "message"), REFUSED, ids=[r[1][:40] for r in REFUSED])
def test_refused_combinations_name_the_keys(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value), str(err.value)


def test_start_up_warnings_for_keys_that_do_nothing() -> None:
    warned = "\n".join(
        load_config(
            None,
            [
                *demo_inputs(),
                "actor.policy_loss.loss_mode=gspo",
                "actor.policy_loss.kl_cov_ratio=0.01",
                "actor.loss_scale_factor=64",
                "data.gen_batch_size=64",
                "rollout.val_kwargs.n=4",
            ],
        ).warnings()
    )
    assert "does not use actor.policy_loss.kl_cov_ratio=0.01" in warned
    assert "actor.loss_scale_factor=64 divides only" in warned
    assert "data.gen_batch_size and algorithm.filter_groups.max_num_gen_batches are used by dynamic" in warned
    assert "greedy answers to a prompt are identical" in warned
    # GSPO aggregates its loss with actor.loss_agg_mode, as verl 0.9.1 does: any mode is quiet.
    quiet = load_config(
        None, [*demo_inputs(), "actor.policy_loss.loss_mode=gspo", "actor.loss_agg_mode=token-mean"]
    ).warnings()
    assert not quiet


# ----------------------------------------------------------------------------------------------------
# End to end: the same parameters on every rank layout and token budget
# ----------------------------------------------------------------------------------------------------

RESPONSES = ["12 + 30 = 42\n#### 42", "#### 7", "4 + 4 = 8\n#### 8", "no idea"]


@pytest.fixture(scope="module")
def groups_file(tiny_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Eight prompts with the four ``RESPONSES`` each (rotated), scored by ``digit_score``: fixed responses
    of different lengths and scores, the same on any rank layout (sampling is not)."""
    rows = pq.read_table(tiny_assets / "data" / "train.parquet").to_pylist()[:8]
    for i, row in enumerate(rows):
        responses = [RESPONSES[(i + j) % 4] for j in range(4)]
        row["responses"] = responses
        row["scores"] = [digit_score("", t, "") for t in responses]
    return write_parquet(tmp_path_factory.mktemp("recipes") / "groups.parquet", rows)


COMBOS = {
    # REINFORCE++ with a k3 KL in the reward and a discount, GSPO
    "rpp_gspo": [
        "algorithm.adv_estimator=reinforce_plus_plus",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_penalty=low_var_kl",
        "algorithm.kl_ctrl.kl_coef=0.1",
        "algorithm.gamma=0.9",
        "actor.policy_loss.loss_mode=gspo",
        "actor.loss_agg_mode=seq-mean-token-mean",
    ],
    # REINFORCE++-baseline, Clip-Cov drawing 20% of the tokens among those with covariance in (0, 100)
    "rppb_clip_cov": [
        "algorithm.adv_estimator=reinforce_plus_plus_baseline",
        "actor.policy_loss.loss_mode=clip_cov",
        "actor.policy_loss.clip_cov_ratio=0.2",
        "actor.policy_loss.clip_cov_lb=0.0",
        "actor.policy_loss.clip_cov_ub=100.0",
    ],
    # OPO, KL-Cov on the 20% of tokens of largest covariance
    "opo_kl_cov": [
        "algorithm.adv_estimator=opo",
        "actor.policy_loss.loss_mode=kl_cov",
        "actor.policy_loss.kl_cov_ratio=0.2",
        "actor.policy_loss.ppo_kl_coef=1.0",
    ],
    # Dr. GRPO: no std, the constant normalizer, with a KL loss aggregated the same way
    "drgrpo": [
        "algorithm.adv_estimator=grpo",
        "algorithm.norm_adv_by_std_in_grpo=false",
        "actor.loss_agg_mode=seq-mean-token-sum-norm",
        "actor.loss_scale_factor=16",
        "actor.use_kl_loss=true",
    ],
}
COMPARED = [
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/entropy",
    "actor/ppo_kl",
    "actor/pg_clipfrac",
    "actor/pg_covfrac",
    "actor/kl_loss",
    "critic/advantages/mean",
    "critic/advantages/max",
    "critic/returns/mean",
]


def layout_args(tiny_assets: Path, groups: Path, out: Path) -> list[str]:
    """Offline groups scored by the data, 4 prompts x 4 responses a step in one mini-batch, two epochs
    (the second is off-policy: GSPO's clip, Clip-Cov's old log-probs and KL-Cov's penalty all act)."""
    return base_args(tiny_assets, out) + [
        f"data.train_files={groups}",
        "rollout.source=dataset",
        "reward.style=dataset",
        "rollout.n=4",
        "data.max_prompt_length=16",
        "data.max_response_length=24",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4",
        "actor.ppo_epochs=2",
        "actor.clip_ratio_high=0.28",
        "trainer.val_before_train=false",
        "trainer.save_hf_on_end=true",
        "actor.optim.eps=1e-3",  # as test_two_ranks_equal_one_rank: compare gradients, not Adam's rounding
    ]


@pytest.mark.slow
@pytest.mark.parametrize("combo", sorted(COMBOS))
def test_same_parameters_on_any_layout_and_budget(
    combo: str, tiny_assets: Path, groups_file: Path, tmp_path: Path
) -> None:
    """1 rank with a 40-token budget (several micro-batches) is the reference; 1 rank with one
    micro-batch, 2 ranks (2 x 1) and 2 ranks as one sequence-parallel group (1 x 2) train the same
    parameters and log the same losses, gradient norms and advantages."""
    common = layout_args(tiny_assets, groups_file, tmp_path / "unused") + COMBOS[combo]
    runs = {name: tmp_path / name for name in ("one", "one_budget", "two", "sp")}

    def args(name: str, *extra: str) -> list[str]:
        return [*common, f"trainer.output_dir={runs[name]}", *extra]

    assert run(args("one", "actor.ppo_max_token_len_per_gpu=40")) == 0
    assert run(args("one_budget", "actor.ppo_max_token_len_per_gpu=4096")) == 0
    for name, extra in (("two", []), ("sp", ["actor.ulysses_sequence_parallel_size=2"])):
        proc = torchrun(
            ROOT / "train_ppo.py",
            *args(name, "actor.ppo_max_token_len_per_gpu=40", *extra),
            "trainer.dist_timeout_s=120",
        )
        assert proc.returncode == 0, excerpt(proc.stderr)
    reference = hf_weights(runs["one"])
    base = load_file(tiny_assets / "base" / "model.safetensors")
    assert any(not torch.equal(reference[k], base[k]) for k in reference), "the update changed nothing"
    rows = read_metrics(runs["one"])
    assert rows[-1]["critic/advantages/max"] > 0.1  # the estimator gave a signal
    if combo in ("rppb_clip_cov", "opo_kl_cov"):
        assert all(r["actor/pg_covfrac"] > 0 for r in rows)  # tokens were picked
    for name in ("one_budget", "two", "sp"):
        weights = hf_weights(runs[name])
        for key in reference:
            torch.testing.assert_close(
                weights[key], reference[key], atol=1e-6, rtol=1e-5, msg=f"{name}: {key} differs"
            )
        for x, y in zip(rows, read_metrics(runs[name]), strict=True):
            for k in COMPARED:
                if k in x:
                    assert y[k] == pytest.approx(x[k], rel=1e-5, abs=1e-6), f"{name}: {k} at step {x['step']}"


# ----------------------------------------------------------------------------------------------------
# End to end: DAPO, validation with n answers
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def indexed_prompts(tiny_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """64 prompts of the task in file order, ``extra_info.index`` = the row (``split_parity`` reads it)."""
    rows = pq.read_table(tiny_assets / "data" / "train.parquet").to_pylist()[:64]
    for i, row in enumerate(rows):
        row["extra_info"] = {"index": i}
    return write_parquet(tmp_path_factory.mktemp("indexed") / "prompts.parquet", rows)


def dapo_args(
    tiny_assets: Path, prompts: Path, out: Path, steps: int, reward: str = "split_parity"
) -> list[str]:
    """GRPO with dynamic sampling over ``prompts`` in file order: 4 prompts x 2 responses a step."""
    return base_args(tiny_assets, out, steps=steps) + [
        f"data.train_files={prompts}",
        "data.shuffle=false",
        "algorithm.adv_estimator=grpo",
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=score",
        f"reward.custom_function={RECIPE_FNS}:{reward}",
        "trainer.val_before_train=false",
    ]


@pytest.mark.slow
def test_dynamic_sampling_refills_when_one_rank_always_ties(
    tiny_assets: Path, indexed_prompts: Path, tmp_path: Path
) -> None:
    """The second rank's groups always tie (``split_parity``): it keeps nothing, generates the same rounds
    as the first (no hang), and trains on groups the first rank kept."""
    proc = torchrun(ROOT / "train_ppo.py", *dapo_args(tiny_assets, indexed_prompts, tmp_path, steps=2),
                    "trainer.dist_timeout_s=120", timeout=300)  # fmt: skip
    assert proc.returncode == 0, excerpt(proc.stderr)
    for row in read_metrics(tmp_path):
        # at most the first rank's 2 groups a round are kept, 4 are needed: >= 2 rounds
        assert row["train/num_gen_batches"] >= 2
        assert row["train/kept_group_share"] <= 0.5
        # every trained group of two scores 0 and 1: score mean 0.5; GRPO gives ±(0.5 / 0.7071) = ±0.7071
        assert row["critic/score/mean"] == pytest.approx(0.5)
        assert row["critic/advantages/max"] == pytest.approx(0.5 / math.sqrt(0.5), rel=1e-5)
        assert row["critic/advantages/min"] == pytest.approx(-0.5 / math.sqrt(0.5), rel=1e-5)


@pytest.mark.slow
def test_kill_during_a_refill_round_resumes_the_same_data(
    tiny_assets: Path, indexed_prompts: Path, tmp_path: Path
) -> None:
    """SIGKILL while a step is in its second generation round; the resumed run (from the last step's
    checkpoint) draws the same prompts, so every metric and the final weights equal a run never killed."""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    common = ["trainer.save_freq=1", "trainer.save_hf_on_end=true"]
    args = dapo_args(tiny_assets, indexed_prompts, straight, steps=3, reward="slow_split_parity") + common
    assert run(args) == 0
    rounds = [int(r["train/num_gen_batches"]) for r in read_metrics(straight)]
    # a step after the first that refilled: step i + 1, resumed from the checkpoint of step i
    i = next(i for i, r in enumerate(rounds) if r >= 2 and i > 0)
    calls_per_round = 4 * 2  # 4 prompts x 2 responses scored a round on the one rank
    marker = tmp_path / "in_refill"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        # the third call of that step's second round
        "RECIPE_SLOW_CALL": str((sum(rounds[:i]) + 1) * calls_per_round + 3),
        "RECIPE_MARKER": str(marker),
        "RECIPE_SLOW_S": "600",
    }
    killed_args = (
        dapo_args(tiny_assets, indexed_prompts, killed, steps=3, reward="slow_split_parity") + common
    )
    proc = subprocess.Popen([sys.executable, str(ROOT / "train_ppo.py"), *killed_args], env=env,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    wait_until(proc, marker.exists, timeout=300)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert (killed / "checkpoints" / "latest").read_text() == f"step_{i:08d}"
    resumed = subprocess.run([sys.executable, str(ROOT / "train_ppo.py"), *killed_args],
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert resumed.returncode == 0, excerpt(resumed.stderr)
    assert deterministic(read_metrics(killed)) == deterministic(read_metrics(straight))
    a, b = hf_weights(straight), hf_weights(killed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_dynamic_sampling_gives_up_naming_the_keys(
    tiny_assets: Path, indexed_prompts: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Every response scores 1 (``one``): every group ties; after max_num_gen_batches rounds the run stops
    with exit code 2 and one line that says what to change."""
    args = dapo_args(tiny_assets, indexed_prompts, tmp_path, steps=1, reward="one")
    assert run([*args, "algorithm.filter_groups.max_num_gen_batches=2"]) == 2
    err = capsys.readouterr().err
    assert "2 generation rounds" in err and "kept 0 of the data.train_batch_size=4" in err
    assert "Raise algorithm.filter_groups.max_num_gen_batches" in err and "Traceback" not in err


def test_overlong_penalty_lands_in_the_scores(tiny_assets: Path, tmp_path: Path) -> None:
    """Every response scores 1 before the penalty (``one``). With a maximum of 12 tokens, a buffer of 8
    and factor 0.5, a response of L >= 4 tokens gets -(L - 4) / 8 · 0.5, linear in L: the score mean is
    1 - (mean L - 4) / 16 (the untrained model's responses are all longer than 4 tokens)."""
    rows = train_ppo_rows(tiny_assets, tmp_path, [
        f"reward.custom_function={RECIPE_FNS}:one", "reward.overlong_buffer.enable=true",
        "reward.overlong_buffer.len=8", "reward.overlong_buffer.penalty_factor=0.5",
        "algorithm.adv_estimator=grpo", "trainer.val_before_train=false",
    ])  # fmt: skip
    for row in rows:
        assert row["response_length/min"] > 4 and row["reward/overlong_ratio"] == 1.0
        expected = 1.0 - (row["response_length/mean"] - 4) / 16
        assert row["critic/score/mean"] == pytest.approx(expected, abs=1e-6)
        assert row["critic/score/mean"] == pytest.approx(1.0 + row["reward/overlong_penalty"], abs=1e-6)
        # the longest response (12 tokens, the maximum) gets the whole -0.5
        assert row["critic/score/min"] == pytest.approx(1.0 - (row["response_length/max"] - 4) / 16)


def test_validation_with_n_answers(tiny_assets: Path, tmp_path: Path) -> None:
    """``rollout.val_kwargs``: 4 sampled answers a prompt beside the greedy one; pass@1 is the share right,
    pass@k grows with k, a right majority means one right answer at least; verl's best@k (draws with
    replacement) stays at or below pass@k; sampling makes the sampled pass the headline, as verl's."""
    rows = train_ppo_rows(tiny_assets, tmp_path, [
        f"reward.custom_function={RECIPE_FNS}:split_parity", "rollout.val_kwargs.n=4",
        "rollout.val_kwargs.do_sample=true", "rollout.val_kwargs.temperature=1.0", "data.max_val_samples=16",
    ], steps=1)  # fmt: skip
    first = rows[0]
    assert "val/greedy_accuracy" in first and "val/synthetic/arith/greedy_score" in first  # greedy pass kept
    assert first["val/pass@1"] == pytest.approx(first["val/mean@4"])
    assert first["val/mean@4"] <= first["val/pass@2"] <= first["val/pass@4"]
    assert first["val/pass@2"] > first["val/pass@1"]  # answers differ: more draws find more
    assert first["val/maj@4"] <= first["val/pass@4"]
    assert first["val/synthetic/arith/pass@4"] == first["val/pass@4"]
    # verl's best@k for k = 2, 4: draws with replacement repeat answers, so it never exceeds pass@k
    assert "val/best@1" not in first
    assert first["val/best@2"] <= first["val/pass@2"] and first["val/best@4"] <= first["val/pass@4"]
    assert first["val/best@4"] < first["val/pass@4"]  # some prompt has 1-3 right of 4 at this pass@2 > pass@1
    assert first["val-core/synthetic/arith/reward/best@4/mean"] == first["val/synthetic/arith/best@4"]
    assert first["val-aux/synthetic/arith/reward/best@2/mean"] == first["val/synthetic/arith/best@2"]
    # the headline is the sampled pass: split_parity scores 0 or 1, so its mean score is mean@4
    assert first["val/score"] == pytest.approx(first["val/mean@4"])
    assert first["val/accuracy"] == pytest.approx(first["val/mean@4"])
    assert first["val-core/synthetic/arith/reward/mean@4"] == first["val/synthetic/arith/score"]
    assert "val-core/synthetic/arith/reward/mean@1" not in first


def train_ppo_rows(
    tiny_assets: Path, out: Path, overrides: list[str], steps: int = 2
) -> list[dict[str, Any]]:
    assert run(base_args(tiny_assets, out, steps=steps) + overrides) == 0
    return read_metrics(out)


def test_sampled_validation_leaves_training_as_it_was(tiny_assets: Path, tmp_path: Path) -> None:
    """Validation samples from its own RNG: a run that validates with 4 sampled answers a prompt before
    and after every step trains exactly as one that validates greedily (it used to draw from the
    training stream, so turning on val_kwargs changed the run)."""
    common = ["trainer.test_freq=1", "algorithm.adv_estimator=grpo", "rollout.n=2"]
    plain = train(tiny_assets, tmp_path / "plain", *common)
    sampled = train(
        tiny_assets,
        tmp_path / "sampled",
        *common,
        "rollout.val_kwargs.n=4",
        "rollout.val_kwargs.do_sample=true",
    )
    assert any("val/best@4" in r for r in sampled)
    drop = lambda rows: [{k: v for k, v in r.items() if not k.startswith("val")} for r in deterministic(rows)]  # noqa: E731
    assert drop(plain) == drop(sampled)
