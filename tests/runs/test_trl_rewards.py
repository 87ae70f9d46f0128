"""Training runs scored by a weighted list of reward functions (TRL's ``reward_funcs`` with
``reward_weights``): verl-style and TRL-style functions mixed, each one's mean logged as
``reward/<name>/mean`` per step and in validation, ``trainer_state`` following the steps; and TRL's own
shipped functions, unchanged, where TRL is importable (``make trl-env`` installs it beside the
project)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import REWARD_FNS, train, trl_rewards

pytestmark = pytest.mark.slow

STEPS_PER_EPOCH = 4096 // 4
"""The tiny assets' 4096 training prompts in batches of 4 (``base_args``)."""


def test_a_weighted_list_trains_and_logs_each_function(tiny_assets: Path, tmp_path: Path) -> None:
    """char_count (verl's kind) + 0.5 x token_count (TRL's, on completion_ids), with steps_done and
    epochs_done (TRL's, on trainer_state) weighed 0: the step's score is the weighted sum of the logged
    means; steps_done sees the steps done before the step (0, 1, 2) and the validation after it (the
    step itself)."""
    names = ["char_count", "token_count", "steps_done", "epochs_done"]
    rows = train(
        tiny_assets,
        tmp_path / "run",
        f"reward.custom_function=[{','.join(f'{REWARD_FNS}:{n}' for n in names)}]",
        "reward.weights=[1.0,0.5,0.0,0.0]",
        "algorithm.adv_estimator=grpo",
        "trainer.test_freq=2",
        steps=3,
    )
    steps = {row["step"]: row for row in rows if "critic/score/mean" in row}
    assert sorted(steps) == [1, 2, 3]
    for step, row in steps.items():
        chars, tokens = row["reward/char_count/mean"], row["reward/token_count/mean"]
        assert row["critic/score/mean"] == pytest.approx(chars + 0.5 * tokens, rel=1e-5)
        assert 0 < chars <= tokens <= 12  # a token a character, plus the EOS and special tokens
        assert row["reward/steps_done/mean"] == step - 1 and row["reward/steps_done/std"] == 0.0
        assert row["reward/epochs_done/mean"] == pytest.approx((step - 1) / STEPS_PER_EPOCH + 3000.0)
    validated = {row["step"]: row["val/reward/steps_done/mean"] for row in rows if "val/score" in row}
    assert validated == {0: 0.0, 2: 2.0, 3: 3.0}
    assert all("val/reward/char_count/mean" in row for row in rows if "val/score" in row)


def test_trls_soft_overlong_punishment_equals_the_dapo_buffer(tiny_assets: Path, tmp_path: Path) -> None:
    """TRL's think_format_reward and get_soft_overlong_punishment(12, 4), imported from TRL in the user's
    file, score the first step's responses; the same responses (the same seed, nothing trained yet) get
    the same mean penalty from reward.overlong_buffer (len 4): TRL's function counts the same tokens
    (EOS included) as the trainer."""
    trl_rewards()
    path = tmp_path / "trl_rewards.py"
    path.write_text(
        "from trl.rewards import get_soft_overlong_punishment, think_format_reward\n"
        "overlong = get_soft_overlong_punishment(max_completion_len=12, soft_punish_cache=4)\n"
    )
    common = ("trainer.val_before_train=false", "algorithm.adv_estimator=grpo")
    (trl,) = train(
        tiny_assets,
        tmp_path / "trl",
        f"reward.custom_function=[{path}:think_format_reward,{path}:overlong]",
        *common,
        steps=1,
    )
    (dapo,) = train(
        tiny_assets,
        tmp_path / "dapo",
        f"reward.custom_function={path}:think_format_reward",
        "reward.overlong_buffer.enable=true",
        "reward.overlong_buffer.len=4",
        "reward.overlong_buffer.penalty_factor=1.0",
        *common,
        steps=1,
    )
    penalty = trl["reward/soft_overlong_punishment_reward/mean"]
    assert penalty < 0  # some of the untrained model's responses run into the last 4 tokens
    assert penalty == pytest.approx(dapo["reward/overlong_penalty"], abs=1e-6)
    assert trl["critic/score/mean"] == pytest.approx(dapo["critic/score/mean"], abs=1e-6)
    assert trl["reward/think_format_reward/mean"] == pytest.approx(
        dapo["critic/score/mean"] - penalty, abs=1e-6
    )
