"""SPPO's math (``ppo.algorithms.sppo``) against verl's SPPO recipe and by hand, its targets
(the ``sppo`` row of ``algorithms.ADVANTAGE_ESTIMATORS``, through step 3's ``estimate``) and its config rules.

The reference bodies below are copied from verl-recipe (github.com/verl-project/verl-recipe) at commit
48ea0a797fa29867ea0ad92aff7d284eec7d4be3: ``sppo/dp_actor.py::compute_sppo_loss`` and
``sppo/sppo_ray_trainer.py::softmean`` / ``compute_advantage``, with ``verl_F.masked_mean`` inlined
(``(x * m).sum() / (m.sum() + 1e-8)``, verl's ``torch_functional.masked_mean``).
"""

from __future__ import annotations

import math

import pytest
import torch

from ppo.algorithms import global_softmean, softmean, sppo_loss, win_rates
from ppo.batch import Batch, Rollout, group_index
from ppo.batch_advantages import estimate
from ppo.config import ConfigError, PPOConfig
from ppo.config_loader import load_config

# ----------------------------------------------------------------------------------------------------
# verl recipe's reference bodies (commit 48ea0a7, see the module docstring)
# ----------------------------------------------------------------------------------------------------


def recipe_softmean(x: torch.Tensor, beta: float, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    if beta == 0.0:
        return x.mean(dim=dim, keepdim=keepdim)
    beta_t = x.new_tensor(beta)
    lse = torch.logsumexp(x * beta_t, dim=dim, keepdim=keepdim)
    n = x.size(dim)
    log_n = x.new_tensor(n).log()
    return (lse - log_n) / beta_t


def recipe_seq_level_rewards(token_level_rewards: torch.Tensor, beta: float) -> torch.Tensor:
    rewards = token_level_rewards.sum(axis=-1)
    s_mean = recipe_softmean(rewards, beta, keepdim=True)
    return rewards - s_mean


def recipe_compute_sppo_loss(
    old_log_prob, log_prob, rewards, response_mask, eta=1.0, loss_agg_mode="token-mean"
):
    log_prob_sum = (log_prob * response_mask).sum(dim=1)
    old_log_prob_sum = (old_log_prob * response_mask).sum(dim=1)
    log_ratios = log_prob_sum - old_log_prob_sum
    scaled_rewards = eta * (rewards)
    loss_vec = (log_ratios - scaled_rewards) ** 2
    if loss_agg_mode == "token-mean":
        sample_mask = response_mask.any(dim=1).float()
        loss = (loss_vec * sample_mask).sum() / (sample_mask.sum() + 1e-8)
    return loss, log_ratios, scaled_rewards


# ----------------------------------------------------------------------------------------------------
# Against the recipe, on random inputs
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0, 5.0, -2.0])
def test_softmean_is_the_recipes(beta: float) -> None:
    x = torch.randn(3, 17, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    torch.testing.assert_close(softmean(x, beta), recipe_softmean(x, beta), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        softmean(x, beta, dim=0), recipe_softmean(x, beta, dim=0), rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize("eta", [1.0, 0.3])
def test_loss_and_gradient_are_the_recipes(eta: float) -> None:
    g = torch.Generator().manual_seed(1)
    B, T = 6, 9
    logprobs = (-torch.rand(B, T, generator=g, dtype=torch.float64)).requires_grad_()
    old = -torch.rand(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[2] = False  # an empty response counts for nothing
    token_rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    r = recipe_seq_level_rewards(token_rewards, beta=1.0)
    want, log_ratios, scaled = recipe_compute_sppo_loss(old, logprobs, r, mask.double(), eta=eta)
    (want_grad,) = torch.autograd.grad(want, logprobs)
    loss, metrics = sppo_loss(logprobs, old, eta * r, mask)
    (grad,) = torch.autograd.grad(loss, logprobs)
    torch.testing.assert_close(loss, want, rtol=1e-7, atol=0)  # the recipe's 1e-8 in the denominator
    torch.testing.assert_close(grad, want_grad, rtol=1e-7, atol=1e-12)
    present = mask.any(-1)
    torch.testing.assert_close(metrics["log_ratio_mean"], log_ratios[present].mean().detach())
    torch.testing.assert_close(metrics["preference_mean"], scaled[present].mean())


def test_micro_batches_with_global_counts_sum_to_the_batch_loss() -> None:
    """Split over two micro-batches with the batch's count, the losses add up to the batch's loss."""
    g = torch.Generator().manual_seed(2)
    logprobs, old = -torch.rand(8, 5, generator=g), -torch.rand(8, 5, generator=g)
    mask, targets = torch.rand(8, 5, generator=g) > 0.2, torch.randn(8, generator=g)
    whole, _ = sppo_loss(logprobs, old, targets, mask)
    n = float(mask.any(-1).sum())
    parts = [
        sppo_loss(logprobs[s], old[s], targets[s], mask[s], num_seqs=n)[0] for s in (slice(0, 3), slice(3, 8))
    ]
    torch.testing.assert_close(sum(parts), whole)


# ----------------------------------------------------------------------------------------------------
# By hand
# ----------------------------------------------------------------------------------------------------


def test_loss_by_hand() -> None:
    # Row 0: log-ratio (-1 - -2) + (-1 - -1) = 1, target 0.5 -> (0.5)^2 = 0.25.
    # Row 1: one valid token, log-ratio -0.5 - -0.25 = -0.25, target -0.25 -> 0.
    # Row 2: no valid token: not counted (a NaN there never reaches the loss).
    # Loss (0.25 + 0) / 2 = 0.125; log_ratio_mean (1 - 0.25) / 2 = 0.375; preference_mean 0.125.
    logprobs = torch.tensor([[-1.0, -1.0], [-0.5, float("nan")], [float("nan"), 0.0]])
    old = torch.tensor([[-2.0, -1.0], [-0.25, 0.0], [0.0, 0.0]])
    mask = torch.tensor([[True, True], [True, False], [False, False]])
    loss, metrics = sppo_loss(logprobs, old, torch.tensor([0.5, -0.25, 9.0]), mask)
    assert loss.item() == pytest.approx(0.125)
    assert metrics["log_ratio_mean"].item() == pytest.approx(0.375)
    assert metrics["preference_mean"].item() == pytest.approx(0.125)


def test_softmean_by_hand() -> None:
    x = torch.tensor([0.0, 1.0])
    assert softmean(x, 0.0).item() == pytest.approx(0.5)  # the mean
    # beta = 1: log((e^0 + e^1) / 2) = log(1.859141) = 0.620115
    assert softmean(x, 1.0).item() == pytest.approx(math.log((1 + math.e) / 2))
    assert softmean(x, 1.0).item() == pytest.approx(0.620115, abs=1e-6)
    assert softmean(x, 200.0).item() == pytest.approx(1.0, abs=0.004)  # towards the max: 1 - log 2 / 200


def test_softmean_at_small_beta_by_hand() -> None:
    """At a small beta the soft mean is its cumulant series, (1/β) log E[exp(β x)] = κ1 + β κ2 / 2 +
    β² κ3 / 6 + ...; for x = [0, 1, 2, 5]: κ1 = 2, deviations -2, -1, 0, 3, κ2 = (4 + 1 + 0 + 9) / 4 = 3.5,
    κ3 = (-8 - 1 + 0 + 27) / 4 = 4.5 (the β³ term is below float64's resolution at 2 for β <= 1e-6).
    The recipe's logsumexp(β x) - log n cancels to the rounding of log 4 and divides it by β: in float32 at
    β = 1e-8 it gave -11.92, and in float64 it was off by 4e-11 (β = 1e-6) and 7e-10 (β = 1e-8)."""
    x = torch.tensor([0.0, 1.0, 2.0, 5.0], dtype=torch.float64)
    for beta in (1e-6, 1e-8):
        want = 2.0 + beta * 3.5 / 2 + beta**2 * 4.5 / 6  # 2.00000175000075, 2.0000000175
        assert softmean(x, beta).item() == pytest.approx(want, rel=0, abs=1e-15)
        assert global_softmean(x, beta, None, None) == pytest.approx(want, rel=0, abs=1e-15)
        # float32 in, float32 out: the nearest float32 to the value (2.0000017 at 1e-6, 2.0 at 1e-8).
        assert softmean(x.float(), beta).item() == torch.tensor(want, dtype=torch.float32).item()
    # No overflow at a large beta: 5 + log((e^-5000 + e^-4000 + e^-3000 + 1) / 4) / 1000 = 5 - log(4) / 1000.
    assert softmean(x.float(), 1e3).item() == pytest.approx(5 - math.log(4) / 1e3, abs=1e-6)
    assert global_softmean(x.float(), 1e3, None, None) == pytest.approx(5 - math.log(4) / 1e3, abs=1e-12)


def test_win_rates_by_hand() -> None:
    # Group 0 scores [1, 0, 0, 1]: a 1 beats both 0s and ties the other 1 -> (2 + 0.5) / 3 = 5/6;
    # a 0 ties the other 0 and loses twice -> 0.5 / 3 = 1/6. Group 1 [3, 3]: a tie -> 1/2 each.
    # Group 2, one response: nothing to compare -> 1/2.
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 3.0, -7.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    torch.testing.assert_close(
        win_rates(scores, groups), torch.tensor([5 / 6, 1 / 6, 1 / 6, 5 / 6, 0.5, 0.5, 0.5])
    )
    # Ranks 0 < 1 < 2 (best first) as scores -rank: 1, 1/2, 0 of the others beaten.
    torch.testing.assert_close(
        win_rates(-torch.tensor([2.0, 0.0, 1.0]), torch.zeros(3)), torch.tensor([0.0, 1.0, 0.5])
    )


# ----------------------------------------------------------------------------------------------------
# Targets from a batch, and the config
# ----------------------------------------------------------------------------------------------------


def sppo_cfg(*overrides: str):
    return load_config(
        None,
        [
            "actor.policy_loss.loss_mode=sppo",
            "rollout.n=2",
            "data.train_batch_size=2",
            "actor.ppo_mini_batch_size=2",
        ]
        + list(overrides),
    )


def batch_of(scores: list[float], n: int, ranks: list[int] | None = None) -> Batch:
    B, R = len(scores), 3
    rollout = Rollout(
        prompts=[torch.tensor([1])] * B,
        responses=torch.zeros(B, R, dtype=torch.long),
        attention_mask=torch.ones(B, R, dtype=torch.bool),
        truncated=torch.zeros(B, dtype=torch.bool),
    )
    batch = Batch(rollout=rollout, records=[None] * B, group_ids=group_index(B, n, torch.device("cpu")))
    token_rewards = torch.zeros(B, R)
    token_rewards[:, -1] = torch.tensor(scores)
    batch.token_rewards = token_rewards
    if ranks is not None:
        batch.data_ranks = torch.tensor(ranks)
    return batch


def sppo_targets(cfg: PPOConfig, batch: Batch) -> torch.Tensor:
    """``batch.targets`` after step 3's ``estimate`` (the ``sppo`` row of the estimator table)."""
    estimate(cfg, batch)
    return batch.targets


def test_targets_win_rate_softmean_and_ranks() -> None:
    # Win rates of groups [1, 0], [0, 0]: 1, 0, 1/2, 1/2 -> eta (P - 1/2) with eta 2: 1, -1, 0, 0.
    batch = batch_of([1.0, 0.0, 0.0, 0.0], n=2)
    torch.testing.assert_close(
        sppo_targets(sppo_cfg("actor.sppo_eta=2.0"), batch), torch.tensor([1.0, -1.0, 0.0, 0.0])
    )
    # softmean over the whole batch, beta 0: the mean 0.25 -> r - 0.25 = 0.75, -0.25, -0.25, -0.25.
    cfg = sppo_cfg("algorithm.sppo_target=softmean", "algorithm.sppo_beta=0")
    torch.testing.assert_close(sppo_targets(cfg, batch), torch.tensor([0.75, -0.25, -0.25, -0.25]))
    cfg = sppo_cfg("algorithm.sppo_target=softmean", "algorithm.sppo_beta=1.5", "actor.sppo_eta=0.5")
    want = 0.5 * recipe_seq_level_rewards(batch.token_rewards, 1.5)
    torch.testing.assert_close(sppo_targets(cfg, batch), want)
    assert global_softmean(torch.tensor([0.0, 1.0]), 1.0, None, None) == pytest.approx(
        math.log((1 + math.e) / 2)
    )
    # Offline groups under reward.style=ranking: P from the data's ranks [0, 1, 2] (scores would tie).
    ranked = batch_of([1.0, 1.0, 1.0], n=3, ranks=[1, 0, 2])
    cfg = sppo_cfg("reward.style=ranking", "rollout.n=3", "rollout.source=dataset")
    torch.testing.assert_close(sppo_targets(cfg, ranked), torch.tensor([0.0, 0.5, -0.5]))
    # estimate() also puts each target on every position of its row's advantages; there is no critic.
    estimate(sppo_cfg("actor.sppo_eta=2.0"), batch)
    torch.testing.assert_close(batch.targets, torch.tensor([1.0, -1.0, 0.0, 0.0]))
    torch.testing.assert_close(batch.advantages[:, 0], torch.tensor([1.0, -1.0, 0.0, 0.0]))
    torch.testing.assert_close(batch.advantages[:, 2], batch.advantages[:, 0])
    assert not sppo_cfg().use_critic


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["actor.loss_agg_mode=seq-mean-token-mean"], "actor.loss_agg_mode"),
        (["rollout.n=1"], "rollout.n >= 2"),
        (["actor.sppo_refresh_steps=4"], "rollout.source=dataset"),
        (["actor.sppo_refresh_steps=0"], "sppo_refresh_steps"),
    ],
)
def test_refused_combinations(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        sppo_cfg(*overrides)


def test_snapshot_only_offline_and_not_on_policy() -> None:
    cfg = sppo_cfg("actor.sppo_refresh_steps=4", "rollout.source=dataset", "reward.style=ranking")
    assert cfg.sppo_snapshot and not cfg.one_update_per_rollout
    assert sppo_cfg().one_update_per_rollout and not sppo_cfg().sppo_snapshot


def test_sppo_keys_without_sppo_warn() -> None:
    cfg = load_config(None, ["actor.sppo_eta=3.0", "algorithm.adv_estimator=grpo"])
    assert any("actor.sppo_eta=3.0" in w for w in cfg.warnings())


def test_verl_recipe_keys() -> None:
    """verl's SPPO recipe spells the step size actor_rollout_ref.actor.sppo_eta and the soft mean's beta
    algorithm.sppo_eta."""
    cfg = sppo_cfg(
        "actor_rollout_ref.actor.sppo_eta=0.5", "algorithm.sppo_eta=3.0", "algorithm.sppo_target=softmean"
    )
    assert (cfg.actor.sppo_eta, cfg.algorithm.sppo_beta) == (0.5, 3.0)
