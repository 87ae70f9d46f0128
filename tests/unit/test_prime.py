"""PRIME's math (ppo.algorithms.prime) against verl's PRIME recipe on random inputs and hand-computed
cases; the recipe's function bodies below are copied from verl-project/verl-recipe, prime/
prime_core_algos.py and prime/prime_dp_rm.py at commit 48ea0a7 (only the DataProto plumbing replaced
by tensors)."""

from __future__ import annotations

import math

import pytest
import torch

from ppo import algorithms, prime
from ppo.config import ConfigError
from ppo.config_loader import load_config

# ---------------------------------------------------------------------------------------------------
# verl-recipe 48ea0a7, prime/prime_core_algos.py and prime/prime_dp_rm.py (reference copies)
# ---------------------------------------------------------------------------------------------------


def _verl_masked_whiten(values, mask, shift_mean=True):  # verl.utils.torch_functional
    mean = (values * mask).sum() / mask.sum()
    centered = values - mean
    variance = (centered**2 * mask).sum() / mask.sum()
    variance = variance * mask.sum() / (mask.sum() - 1)
    whitened = (values - mean) * torch.rsqrt(variance + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


def recipe_rloo_advantage_return(rm_scores, acc, response_mask, n_samples, reward_dpo_coef, reward_gt_coef):
    def masked_rloo(reward_tensor_original, mask_tensor):
        reward_tensor = reward_tensor_original.clone()
        reward_tensor[~mask_tensor] = 0
        for start_pos in range(0, reward_tensor.shape[0], n_samples):
            cur_rewards_mean = torch.cat(
                [
                    reward_tensor[pos : pos + 1][mask_tensor[pos : pos + 1]].mean(dim=0, keepdim=True)
                    for pos in range(start_pos, start_pos + n_samples)
                ],
                dim=0,
            )
            cur_rewards_sum = cur_rewards_mean.sum()
            cur_reward_baseline = cur_rewards_sum / (n_samples - 1)
            reward_tensor[start_pos : start_pos + n_samples][
                mask_tensor[start_pos : start_pos + n_samples]
            ] = (
                reward_tensor[start_pos : start_pos + n_samples][
                    mask_tensor[start_pos : start_pos + n_samples]
                ]
                * (n_samples / (n_samples - 1))
                - cur_reward_baseline
            )
        return reward_tensor

    reward_tensors = []
    with torch.no_grad():
        if reward_dpo_coef != 0.0:
            reward_tensors.append(masked_rloo(rm_scores, response_mask.bool()) * reward_dpo_coef)
        if reward_gt_coef != 0.0:
            reward_tensor = torch.zeros_like(response_mask, dtype=torch.float32)
            reward_mask = torch.zeros_like(response_mask, dtype=torch.bool)
            valid_response_length = response_mask.sum(-1)
            rows = torch.arange(0, valid_response_length.shape[0], dtype=torch.long)
            reward_mask[rows, valid_response_length - 1] = True
            reward_tensor[rows, valid_response_length - 1] = acc
            reward_tensors.append(masked_rloo(reward_tensor, reward_mask) * reward_gt_coef)
        final_reward_tensor = sum(reward_tensors)
        returns = (final_reward_tensor * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        advantages = _verl_masked_whiten(returns.clone(), response_mask)
        return advantages, returns


def recipe_ce_dpo_loss_rm(token_level_scores, acc, response_mask, beta):
    cur_scores = ((token_level_scores * response_mask).sum(dim=1) * beta).sigmoid()
    return torch.nn.functional.binary_cross_entropy(cur_scores, acc)


def recipe_prime_norm(token_level_scores):  # prime_dp_rm.py, prime_norm == "batch_norm"
    reverse_cumsum = torch.cumsum(token_level_scores.flip(dims=[1]), dim=-1).flip(dims=[1])
    return token_level_scores / (reverse_cumsum.abs().max() + 1e-6)


def recipe_dpo_accuracy(token_level_scores, acc, response_mask, n_samples):
    dpo_acc = []
    for start_id in range(0, token_level_scores.shape[0], n_samples):
        cur_scores = (
            token_level_scores[start_id : start_id + n_samples]
            * response_mask[start_id : start_id + n_samples]
        ).sum(dim=1)

        def get_upper_triangle(tensor_x):
            diff_matrix = tensor_x.unsqueeze(1) - tensor_x.unsqueeze(0)
            upper_tri_indices = torch.triu(torch.ones_like(diff_matrix).bool(), diagonal=1)
            return diff_matrix[upper_tri_indices]

        cur_acc_diff = get_upper_triangle(acc[start_id : start_id + n_samples])
        cur_score_diff = get_upper_triangle(cur_scores)
        cur_score_prediction = (cur_score_diff > 0).float()
        if cur_acc_diff.abs().sum() == 0:
            cur_acc = torch.zeros_like(cur_score_prediction[0]) + 0.5
        else:
            cur_acc = (
                ((cur_score_diff > 0) == (cur_acc_diff > 0)).float() * cur_acc_diff.abs()
            ).sum() / cur_acc_diff.abs().sum()
        dpo_acc.append(cur_acc.unsqueeze(0))
    return torch.cat(dpo_acc, dim=0).mean()


def recipe_dpo_abs_accuracy(token_level_scores, acc, response_mask, n_samples):
    return (
        (torch.sign((token_level_scores * response_mask).sum(dim=-1)) == torch.sign(acc * 2 - 1))
        .float()
        .mean()
    )


# ---------------------------------------------------------------------------------------------------


def random_batch(seed: int, groups: int = 3, n: int = 4, width: int = 7):
    g = torch.Generator().manual_seed(seed)
    b = groups * n
    lengths = torch.randint(1, width + 1, (b,), generator=g)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    rewards = torch.randn(b, width, generator=g) * mask
    acc = torch.randint(0, 2, (b,), generator=g).float()
    return rewards, acc, mask, torch.arange(b) // n, n


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(("dpo_coef", "gt_coef"), [(5.0, 5.0), (1.0, 0.0), (0.0, 2.0)])
def test_advantages_match_the_recipe(seed: int, dpo_coef: float, gt_coef: float) -> None:
    rewards, acc, mask, groups, n = random_batch(seed)
    want_adv, want_ret = recipe_rloo_advantage_return(rewards, acc, mask, n, dpo_coef, gt_coef)
    adv, ret = algorithms.compute_prime_advantages(rewards, acc, groups, mask, dpo_coef, gt_coef)
    torch.testing.assert_close(ret[mask], want_ret[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(adv[mask], want_adv[mask], rtol=1e-5, atol=1e-5)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_advantages_by_hand() -> None:
    # One group of n=2, one token each, no process reward: outcome RLOO is acc_i - acc_other:
    # acc = [1, 0] -> [1, -1] * gt_coef 2 = [2, -2]; returns = the same (one token); whitened over
    # the two tokens: mean 0, unbiased var (4 + 4) / 1 = 8, so A = +-2 / sqrt(8) = +-1/sqrt(2).
    mask = torch.ones(2, 1, dtype=torch.bool)
    adv, ret = algorithms.compute_prime_advantages(
        torch.zeros(2, 1), torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask, 5.0, 2.0
    )
    assert ret.flatten().tolist() == [2.0, -2.0]
    torch.testing.assert_close(adv.flatten(), torch.tensor([1 / math.sqrt(2), -1 / math.sqrt(2)]))
    # Dense rewards, n=2: row 0 r = [1, 3] (mean 2), row 1 r = [4] (mean 4); group sum 6, baseline
    # 6 / 1 = 6; tokens r * 2 - 6: row 0 [-4, 0], row 1 [2]; returns (coef 1): row 0 [-4, 0], row 1 [2].
    mask = torch.tensor([[True, True], [True, False]])
    _, ret = algorithms.compute_prime_advantages(
        torch.tensor([[1.0, 3.0], [4.0, 0.0]]), torch.zeros(2), torch.tensor([0, 0]), mask, 1.0, 0.0
    )
    assert ret.tolist() == [[-4.0, 0.0], [2.0, 0.0]]


@pytest.mark.parametrize("seed", range(5))
def test_ce_loss_matches_the_recipe(seed: int) -> None:
    rewards, acc, mask, _, _ = random_batch(seed)
    for beta in (0.05, 0.5):
        want = recipe_ce_dpo_loss_rm(rewards, acc, mask.float(), beta)
        torch.testing.assert_close(algorithms.prime_ce_loss(rewards, acc, mask, beta), want)


def test_ce_loss_by_hand() -> None:
    # Sum of log-ratios 2 (the padded 9 is masked) times beta 0.5 = logit 1: label 1 costs
    # -log(sigmoid(1)) = log(1 + e^-1) = 0.3133; label 0 costs log(1 + e^1) = 1.3133; mean 0.8133.
    q = torch.tensor([[1.0, 1.0, 9.0], [1.0, 1.0, 9.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    loss = algorithms.prime_ce_loss(q, torch.tensor([1.0, 0.0]), mask, 0.5)
    expected = (math.log(1 + math.exp(-1)) + math.log(1 + math.exp(1))) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_token_rewards_and_norm_match_the_recipe() -> None:
    g = torch.Generator().manual_seed(0)
    prm, ref = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)
    mask = torch.arange(5)[None, :] < torch.tensor([5, 1, 3, 2, 4, 5])[:, None]
    rewards = algorithms.prime_token_rewards(prm, ref, mask, 0.05)
    torch.testing.assert_close(rewards, (prm - ref) * 0.05 * mask)
    normed = algorithms.prime_norm(rewards, algorithms.prime_max_abs_return(rewards))
    torch.testing.assert_close(normed, recipe_prime_norm(rewards))
    # By hand: rows [1, -3] and [2, 0]: reverse sums [-2, -3] and [2, 0]: largest |.| is 3.
    assert algorithms.prime_max_abs_return(torch.tensor([[1.0, -3.0], [2.0, 0.0]])).item() == 3.0


@pytest.mark.parametrize("seed", range(5))
def test_dpo_accuracies_match_the_recipe(seed: int) -> None:
    rewards, acc, mask, groups, n = random_batch(seed)
    seq = (rewards * mask).sum(-1)
    want = recipe_dpo_accuracy(rewards, acc, mask, n)
    torch.testing.assert_close(algorithms.dpo_accuracy(seq, acc, groups), want)
    want_abs = recipe_dpo_abs_accuracy(rewards, acc, mask, n)
    torch.testing.assert_close(algorithms.dpo_abs_accuracy(seq, acc), want_abs)


def test_accuracy_filter_by_hand() -> None:
    # Groups of 4: accuracies 0, 0.5, 1, 0.25; bounds [0.2, 0.8] keep the middle two.
    acc = torch.tensor([0, 0, 0, 0, 1, 0, 1, 0, 1, 1, 1, 1, 0, 0, 1, 0.0])
    assert algorithms.accuracy_filter(acc, 4, 0.2, 0.8).tolist() == [False, True, False, True]
    # The bounds are inclusive (the recipe drops only acc > upper or acc < lower): with [0.25, 0.5] the
    # groups at 0.5 and 0.25 sit on them and pass.
    assert algorithms.accuracy_filter(acc, 4, 0.25, 0.5).tolist() == [False, True, False, True]


def test_passing_groups_are_kept_first() -> None:
    # Groups 1 and 3 pass: they come first, then the failing ones in their order, cut at num_kept.
    passed = [False, True, False, True, False]
    assert algorithms.kept_groups(passed, 3) == [1, 3, 0]
    assert algorithms.kept_groups(passed, 5) == [1, 3, 0, 2, 4]
    assert algorithms.kept_groups([False, False], 1) == [0]


def test_prime_keys() -> None:
    cfg = load_config(
        None,
        [
            "algorithm.adv_estimator=prime",
            "reward.prime.beta_train=0.1",
            "algorithm.reward_dpo_coef=2",
            "data.filter_accuracy=true",
            "data.gen_batch_size=64",
        ],
    )
    assert cfg.needs_reference and not cfg.use_critic
    assert cfg.reward.prime.mini_batch_size == cfg.actor.ppo_mini_batch_size
    assert cfg.reward.prime.optim.lr == 1e-6 and cfg.reward.prime.update == "before"
    with pytest.raises(ConfigError, match="use_kl_in_reward"):
        load_config(None, ["algorithm.adv_estimator=prime", "algorithm.use_kl_in_reward=true"])
    with pytest.raises(ConfigError, match="multiple of data.train_batch_size"):
        load_config(None, ["data.filter_accuracy=true", "data.gen_batch_size=40"])


def test_the_recipes_keys_translate() -> None:
    """verl's PRIME recipe keys (reward_model.*, data.*) land on ours or are refused with a reason."""
    cfg = load_config(
        None,
        [
            "algorithm.adv_estimator=prime",
            "reward_model.model.beta_train=0.1",
            "reward_model.model.update=after",
            "reward_model.model.optim.lr=2e-6",
            "reward_model.model.optim.grad_clip=5.0",
            "reward_model.prime_norm=none",
            "reward_model.prime_granularity=token",
            "reward_model.mini_batch_size=8",
            "actor_rollout_ref.rollout.n=4",
            "data.oversample_factor=1",
        ],
    )
    p = cfg.reward.prime
    assert (p.beta_train, p.update, p.optim.lr, p.grad_clip, p.prime_norm) == (
        0.1,
        "after",
        2e-6,
        5.0,
        "none",
    )
    assert p.mini_batch_size == 2  # the recipe's 8 responses are 8 / rollout.n 4 = 2 prompts here
    with pytest.raises(ConfigError, match="gen_batch_size"):
        load_config(None, ["data.oversample_factor=4"])
    with pytest.raises(ConfigError, match="every response token"):
        load_config(None, ["reward_model.prime_granularity=whole"])


def test_the_recipes_script_takes_as_many_prm_steps() -> None:
    """run_prime_qwen.sh: 64 prompts x 4 responses a step, reward_model.mini_batch_size=64 (responses, split
    from the step's 256): 256 / 64 = 4 PRM optimizer steps a step. Here the mini-batch counts prompts:
    64 / 4 = 16, and 64 prompts / 16 = 4 steps (it was 64 prompts: one step)."""
    recipe = [
        "algorithm.adv_estimator=prime",
        "data.train_batch_size=64",
        "actor_rollout_ref.actor.ppo_mini_batch_size=64",
        "actor_rollout_ref.rollout.n=4",
        "reward_model.mini_batch_size=64",
    ]
    cfg = load_config(None, recipe)
    assert cfg.reward.prime.mini_batch_size == 16
    assert cfg.data.train_batch_size // cfg.reward.prime.mini_batch_size == 4
    with pytest.raises(ConfigError, match=r"reward_model\.mini_batch_size=6 .*multiple of rollout\.n=4"):
        load_config(None, [*recipe, "reward_model.mini_batch_size=6"])


def test_the_recipes_reward_model_path_is_the_prms_start() -> None:
    """With adv_estimator=prime, the recipe's reward_model.enable=True and reward_model.model.path=P turn
    on the PRM and name its starting weights: not an outcome reward model (reward.style=model, which
    they used to become). P is the PRM's start here when it is the reference's; another P is refused."""
    recipe = [
        "algorithm.adv_estimator=prime",
        "actor_rollout_ref.model.path=/m/sft",
        "reward_model.enable=True",
    ]
    cfg = load_config(None, [*recipe, "reward_model.model.path=/m/sft"])
    assert (cfg.reward.style, cfg.reward.model_path) == ("rule", None)
    cfg = load_config(
        None, [*recipe, "actor_rollout_ref.ref.model.path=/m/ref", "reward_model.model.path=/m/ref"]
    )
    assert (cfg.reward.style, cfg.ref.model_path) == ("rule", "/m/ref")
    with pytest.raises(ConfigError, match=r"reward_model\.model\.path='/m/prm' .*set ref\.model_path=/m/prm"):
        load_config(None, [*recipe, "reward_model.model.path=/m/prm"])
    with pytest.raises(ConfigError, match=r"reward\.reward_model\.model_path='/m/prm' .*PRM's starting"):
        load_config(None, [*recipe, "reward.reward_model.model_path=/m/prm"])
    # Without PRIME they name an outcome reward model, as in verl's PPO trainer.
    cfg = load_config(None, ["reward_model.enable=True", "reward_model.model.path=/m/rm"])
    assert (cfg.reward.style, cfg.reward.model_path) == ("model", "/m/rm")


def test_clipped_labels_are_counted() -> None:
    """The PRM's labels are the scores clipped to [0, 1]; the share clipped is logged
    (prime/label_clip_rate). Scores -0.3 (an overlong penalty on a wrong answer), 0, 0.5 (a format
    score), 1, 2 (a custom function's "right"): labels 0, 0, 0.5, 1, 1, and 2 of 5 clipped = 0.4."""
    scores = torch.tensor([-0.3, 0.0, 0.5, 1.0, 2.0])
    torch.testing.assert_close(prime.prime_labels(scores), torch.tensor([0.0, 0.0, 0.5, 1.0, 1.0]))
    assert prime.label_clip_rate(scores) == pytest.approx(0.4)
    assert prime.label_clip_rate(torch.tensor([0.0, 1.0])) == 0.0
    assert prime.label_clip_rate(torch.tensor([])) == 0.0
