"""TRL's reward functions as they are, and lists of reward functions with weights (TRL's ``reward_funcs``
and ``reward_weights``): every argument TRL gives (``completion_ids``, ``trainer_state``), None ("does not
apply"), the weighted sum and the ``reward/<name>/mean`` metrics, failures named by the function, lists in
reward workers. The functions of tests/reward_fns.py run everywhere; TRL's own shipped ones
(``trl.rewards``) where TRL is importable: the project does not depend on TRL, and ``make trl-env`` (which
``make test`` runs) installs it beside the project, in ``.trl_side/``.

(end to end through ``train_ppo.py``: tests/runs/test_trl_rewards.py)."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch

from ppo.config_loader import load_config
from ppo.data import PromptRecord
from ppo.input_paths import input_problems
from ppo.periodic_validation import score_metrics
from ppo.reward_pool import RewardPool
from ppo.rewards import rule_scores
from ppo.rule_scoring import (
    RewardError,
    RewardFunctions,
    TrainerProgress,
    WeightedScore,
    make_rule_scorer,
    metric_names,
)
from tests.helpers import REWARD_FNS, trl_rewards

CHAT = [{"role": "user", "content": "1 + 1"}]


def records(n: int, prompt: object = "p", **columns: list) -> list[PromptRecord]:
    """``n`` prompt rows (index 40, 41, ...) of data source ``d``; ``columns``: a value per row each."""
    return [
        PromptRecord(
            input_ids=[1],
            prompt_text=str(prompt),
            data_source="d",
            ground_truth="g",
            extra_info={k: v[i] for k, v in columns.items()},
            index=40 + i,
            prompt=prompt,
        )
        for i in range(n)
    ]


def fns(*names: str) -> list[str]:
    return [f"{REWARD_FNS}:{name}" for name in names]


def test_a_weighted_list_mixes_verl_and_trl_functions_and_logs_each() -> None:
    """char_count (verl's kind, per response) and token_count (TRL's, on completion_ids) weighed 1 and
    0.5: texts of 2, 4, 0 characters with 3, 5, 1 tokens score 2 + 1.5, 4 + 2.5, 0 + 0.5."""
    scorer = make_rule_scorer(fns("char_count", "token_count"), 0.0, weights=[1.0, 0.5])
    assert isinstance(scorer, RewardFunctions) and scorer.names == ["char_count", "token_count"]
    ids = [[7, 8, 2], [7, 8, 9, 10, 2], [2]]
    scores, metrics = rule_scores(scorer, records(3), ["ab", "abcd", ""], completion_ids=ids)
    assert scores.tolist() == [3.5, 6.5, 0.5]
    # means 2 and 3; stds sqrt(((2-2)^2 + (4-2)^2 + (0-2)^2) / 2) = 2 and the same for 3, 5, 1
    assert metrics == {
        "reward/char_count/mean": 2.0,
        "reward/char_count/std": 2.0,
        "reward/token_count/mean": 3.0,
        "reward/token_count/std": 2.0,
    }


def test_trainer_state_says_how_far_training_is() -> None:
    """6 steps done of 40, 4 steps an epoch: global_step 6, epoch 1.5, max_steps 40 (epochs_done returns
    epoch + 1000 max_steps); weighed 1 and 0, the score is steps_done's."""
    state = TrainerProgress.after(6, 40, 4)
    assert state == TrainerProgress(global_step=6, max_steps=40, epoch=1.5)
    scorer = make_rule_scorer(fns("steps_done", "epochs_done"), 0.0, weights=[1.0, 0.0])
    scores, metrics = rule_scores(scorer, records(2, CHAT), ["a", "b"], trainer_state=state)
    assert scores.tolist() == [6.0, 6.0]
    assert metrics["reward/steps_done/mean"] == 6.0 and metrics["reward/epochs_done/mean"] == 40001.5
    scores, _ = rule_scores(scorer, records(2), ["a", "b"], trainer_state=TrainerProgress.after(7, 40, 4))
    assert scores.tolist() == [7.0, 7.0]


def test_none_is_left_out_of_the_sum_and_of_the_function_mean() -> None:
    """odd_lengths_only (weight 2) returns None for "ab": that row scores char_count's 2 alone (TRL's
    nansum); its mean is over the 2 rows it scored."""
    scorer = make_rule_scorer(fns("odd_lengths_only", "char_count"), 0.0, weights=[2.0, 1.0])
    scored = scorer.score_batch(records(3), ["a", "ab", "abc"])
    assert scored[1] == WeightedScore(2.0, {}, (None, 2.0)) and not scored[1].declined
    scores, metrics = rule_scores(scorer, records(3), ["a", "ab", "abc"])
    assert scores.tolist() == [3.0, 2.0, 5.0]  # 2*1 + 1, 0 + 2, 2*1 + 3
    assert metrics["reward/odd_lengths_only/mean"] == 1.0 and metrics["reward/odd_lengths_only/std"] == 0.0
    assert metrics["reward/char_count/mean"] == 2.0 and metrics["reward/char_count/std"] == 1.0


def test_a_response_every_function_declines_scores_its_groups_mean(caplog: pytest.LogCaptureFixture) -> None:
    """One TRL-style function, None for even lengths, groups of 2: a declined row scores the other row's
    score (its advantage under a group baseline is 0, as TRL's); a group that all declined scores 0.
    Warned once a run; a single function logs no reward/<name>/* (as before lists)."""
    scorer = make_rule_scorer(f"{REWARD_FNS}:odd_lengths_only", 0.0)
    texts = ["a", "ab", "abc", "abcd", "xx", "yyyy"]
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    with caplog.at_level(logging.WARNING, logger="ppo"):
        scores, metrics = rule_scores(scorer, records(6), texts, group_ids=groups)
        assert scores.tolist() == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0] and metrics == {}
        rule_scores(scorer, records(6), texts, group_ids=groups)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith(
        "every reward function returned None for 4 of 6 responses (e.g. rank 0, prompt row 41), TRL's "
        "'does not apply': such a response scores its group's mean in training"
    )
    # without groups the batch is one: the declined rows score the mean of 1, 1
    assert rule_scores(scorer, records(6), texts)[0].tolist() == [1.0] * 6


def test_names_are_made_unique_in_the_lists_order() -> None:
    assert metric_names(["f", "f", "g", "f", "f_1", "extra"]) == ["f", "f_1", "g", "f_2", "f_1_1", "extra_1"]
    scorer = make_rule_scorer(fns("char_count", "char_count"), 0.0)
    _, metrics = rule_scores(scorer, records(1), ["ab"])
    assert sorted(metrics) == [
        "reward/char_count/mean",
        "reward/char_count/std",
        "reward/char_count_1/mean",
        "reward/char_count_1/std",
    ]
    assert math.isnan(metrics["reward/char_count/std"])  # one value: no spread (TRL's nanstd)


def test_a_single_verl_function_with_a_weight_is_scaled() -> None:
    scorer = make_rule_scorer(f"{REWARD_FNS}:char_count", 0.0, weights=[0.5])
    scores, metrics = rule_scores(scorer, records(2), ["ab", "abcd"])
    assert scores.tolist() == [1.0, 2.0] and metrics == {}


@pytest.mark.parametrize(
    ("names", "texts", "ids", "message"),
    [
        (
            ("char_count", "raises"),
            ["ab"],
            None,
            "reward.custom_function[1]='{fns[1]}' raised ZeroDivisionError: division by zero (data_source='d', "
            "response 'ab'); prompt row 40",
        ),
        (
            ("char_count", "returns_none"),
            ["ab"],
            None,
            "reward.custom_function[1]='{fns[1]}' returned None for data_source='d', response 'ab'; expected "
            "a number or a dict with a 'score' number; prompt row 40",
        ),
        (
            ("char_count", "token_count"),
            ["ab", "c"],
            None,  # no completion_ids: token_count fails on the batch
            "reward.custom_function[1]='{fns[1]}' raised TypeError: 'NoneType' object is not iterable (a "
            "batch of 2)",
        ),
    ],
)
def test_a_failing_function_of_a_list_is_named_by_its_index(
    names: tuple[str, ...], texts: list[str], ids: list | None, message: str
) -> None:
    specs = fns(*names)
    with pytest.raises(RewardError) as e:
        rule_scores(make_rule_scorer(specs, 0.0), records(len(texts)), texts, completion_ids=ids)
    assert str(e.value) == message.format(fns=specs)


def test_a_function_of_a_list_past_its_timeout_is_named() -> None:
    specs = fns("char_count", "hangs_on_seven")  # sleeps an hour on a response with a 7
    with pytest.raises(RewardError) as e:
        rule_scores(make_rule_scorer(specs, 0.0, timeout_s=0.5), records(2), ["12", "x7"])
    assert str(e.value).startswith(
        f"reward.custom_function[1]='{specs[1]}' ran longer than reward.timeout_s=0.5 (data_source='d', "
        "response 'x7')"
    )
    assert str(e.value).endswith("; prompt row 41")


def test_a_nan_from_a_function_of_a_list_is_named(caplog: pytest.LogCaptureFixture) -> None:
    """A NaN stays a NaN (the trainer skips the step), whichever kind returned it, and the warning says
    which function and row gave it."""
    specs = fns("char_count", "nan_score")
    with caplog.at_level(logging.WARNING, logger="ppo"):
        scores, metrics = rule_scores(make_rule_scorer(specs, 0.0), records(2), ["ab", "c"])
    assert math.isnan(scores[0]) and math.isnan(metrics["reward/nan_score/mean"])
    assert [r.getMessage() for r in caplog.records] == [
        f"reward.custom_function[1]='{specs[1]}' returned nan for prompt row 40 (rank 0): the response's "
        "score is not finite"
    ]


def test_a_list_is_checked_for_missing_files_by_index(tmp_path: Path) -> None:
    overrides = [
        f"model.path={tmp_path}",
        f"reward.custom_function=[{REWARD_FNS}:char_count,missing/rewards.py:f]",
    ]
    cfg = load_config(None, overrides)
    assert "reward.custom_function[1]='missing/rewards.py:f': file missing/rewards.py does not exist" in (
        input_problems(cfg)
    )


# ----------------------------------------------------------------------------------------------------
# Lists in reward workers (reward.pool_workers): a call per response and function
# ----------------------------------------------------------------------------------------------------


def pool_of(specs: list[str], weights: list[float] | None = None, timeout_s: float = 30.0) -> RewardPool:
    return RewardPool(
        custom_function=specs,
        format_score=0.0,
        reward_kwargs={},
        num_workers=2,
        timeout_s=timeout_s,
        error_score=-1.0,
        weights=weights,
    )


def test_a_list_in_reward_workers_is_weighed_and_logged() -> None:
    """char_count and digit_score weighed 1 and 2: "12" scores 2 + 2 x 1, "ab1" 3 + 2 / 3."""
    pool = pool_of(fns("char_count", "digit_score"), weights=[1.0, 2.0])
    try:
        scores, metrics = rule_scores(None, records(2), ["12", "ab1"], pool)
    finally:
        pool.close()
    assert pool.names == ["char_count", "digit_score"]
    assert scores.tolist() == pytest.approx([4.0, 3.0 + 2 / 3])
    assert metrics["reward/char_count/mean"] == 2.5
    assert metrics["reward/digit_score/mean"] == pytest.approx((1.0 + 1 / 3) / 2)
    assert (metrics["reward/timeouts"], metrics["reward/errors"]) == (0.0, 0.0)


def test_a_function_of_a_list_that_hangs_in_a_worker_is_named() -> None:
    """hangs_on_seven times out on "x7" and raises on "3": each row fails, named by its function; the
    other row scores 2 + 1 (default weights 1, 1)."""
    specs = fns("char_count", "hangs_on_seven")
    pool = pool_of(specs, timeout_s=1.0)
    try:
        out = pool.score(records(3), ["12", "x7", "3"])
    finally:
        pool.close()
    assert out.scored == [WeightedScore(3.0, {}, (2.0, 1.0)), None, None]
    assert (out.timeouts, out.errors) == (1, 1)
    assert (
        out.first
        == f"prompt row 41 (d): reward.custom_function[1]='{specs[1]}' ran longer than reward.timeout_s=1.0"
    )


def test_reward_workers_refuse_a_trl_function_at_start_up() -> None:
    specs = fns("char_count", "token_count")
    with pytest.raises(RewardError) as e:
        pool_of(specs)
    assert str(e.value) == (
        f"a reward worker could not start: reward.custom_function[1]='{specs[1]}' is a TRL-style batched "
        "function (prompts, completions): it runs in the trainer's process; set reward.pool_workers=0"
    )


# ----------------------------------------------------------------------------------------------------
# TRL's own reward functions (trl.rewards), unchanged
# ----------------------------------------------------------------------------------------------------


def trl_file(tmp_path: Path, text: str = "") -> Path:
    """A user's reward file that takes TRL's functions from TRL (skips where TRL is not importable)."""
    trl_rewards()
    path = tmp_path / "trl_user_rewards.py"
    path.write_text(
        "from trl.rewards import accuracy_reward, get_soft_overlong_punishment, think_format_reward\n"
        "overlong = get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)\n" + text
    )
    return path


def test_trls_think_format_and_soft_overlong_rewards(tmp_path: Path) -> None:
    """think_format_reward reads conversational completions; the soft overlong punishment counts
    completion_ids: 6 tokens 0, 8 tokens (8 - 6) / 4 = -0.5, 11 tokens -1. Its metric name is TRL's
    (``soft_overlong_punishment_reward``, the callable's __name__)."""
    path = trl_file(tmp_path)
    scorer = make_rule_scorer([f"{path}:think_format_reward", f"{path}:overlong"], 0.0, weights=[1.0, 1.0])
    texts = ["<think>\nsum\n</think>\n2", "2", "<think>2"]
    ids = [[5] * 6, [5] * 8, [5] * 11]
    scores, metrics = rule_scores(scorer, records(3, CHAT), texts, completion_ids=ids)
    assert scores.tolist() == [1.0, -0.5, -1.0]
    assert metrics["reward/think_format_reward/mean"] == pytest.approx(1 / 3)
    assert metrics["reward/soft_overlong_punishment_reward/mean"] == pytest.approx(-0.5)


def test_trls_accuracy_reward_and_its_none(tmp_path: Path) -> None:
    """accuracy_reward (math_verify) gets the file's ``solution`` column; a solution it cannot parse is
    None: with the format reward beside it, that row scores the format reward alone."""
    path = trl_file(tmp_path)
    pytest.importorskip("math_verify", reason="math-verify is not installed (`make trl-env` puts it beside)")
    scorer = make_rule_scorer(
        [f"{path}:accuracy_reward", f"{path}:think_format_reward"], 0.0, weights=[2.0, 1.0]
    )
    solutions = [r"\frac{1}{3}", r"\frac{1}{3}", "no math here ???"]
    rows = records(3, CHAT, solution=solutions)
    texts = [r"<think>a</think>\boxed{\frac{1}{3}}", r"\boxed{\frac{1}{2}}", "<think>b</think>c"]
    scored = scorer.score_batch(rows, texts)
    assert [s.parts for s in scored] == [(1.0, 1.0), (0.0, 0.0), (None, 1.0)]
    scores, metrics = rule_scores(scorer, rows, texts)
    assert scores.tolist() == [3.0, 0.0, 1.0]
    assert metrics["reward/accuracy_reward/mean"] == 0.5  # over the 2 rows it scored


def test_validation_leaves_a_declined_response_out_of_its_scores() -> None:
    """A response every function declined is None in validation's rule scores: out of the source's mean
    score and its accuracy (TRL's eval reward is the mean over the scored ones), 1.0 over one row."""
    rows = records(2)
    assert score_metrics(rows, None, [1.0, None], answers_per_prompt=1) == {
        "val/d/score": 1.0,
        "val-core/d/reward/mean@1": 1.0,
        "val/d/accuracy": 1.0,
        "val/score": 1.0,
        "val/accuracy": 1.0,
    }
