"""An ``async def compute_score`` is awaited: in the trainer's process (``make_rule_scorer``) and in
reward workers (``RewardPool``), where it used to fail with "returned <coroutine ...>"."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ppo.data import PromptRecord
from ppo.reward_pool import RewardPool
from ppo.rule_scoring import RewardError, Score, make_rule_scorer

ASYNC_FN = """
import asyncio


async def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    await asyncio.sleep(0)
    if solution_str == "boom":
        raise ValueError("no score for boom")
    return {"score": float(solution_str == ground_truth) + bonus, "length": float(len(solution_str))}
"""


@pytest.fixture
def async_fn(tmp_path: Path) -> str:
    path = tmp_path / "async_rewards.py"
    path.write_text(ASYNC_FN)
    return f"{path}:compute_score"


def test_async_compute_score_in_process(async_fn: str) -> None:
    score = make_rule_scorer(async_fn, 0.0, {"bonus": 0.25})
    assert score("src", "42", "42", {}) == Score(1.25, {"length": 2.0})  # 1 (right) + 0.25
    assert score("src", "7", "42", {}) == Score(0.25, {"length": 1.0})
    with pytest.raises(RewardError, match="raised ValueError: no score for boom"):
        score("src", "boom", "42", {})

    async def inside_a_running_loop() -> Score:  # a caller that runs an event loop itself
        return score("src", "42", "42", {})

    assert asyncio.run(inside_a_running_loop()) == Score(1.25, {"length": 2.0})


def test_async_compute_score_in_reward_workers(async_fn: str) -> None:
    pool = RewardPool(
        custom_function=async_fn,
        format_score=0.0,
        reward_kwargs={},
        num_workers=1,
        timeout_s=60.0,
        error_score=0.0,
    )
    try:
        row = PromptRecord(
            input_ids=[1], prompt_text="q", data_source="src", ground_truth="42", extra_info={}, index=0
        )
        records = [row, row]
        out = pool.score(records, ["42", "7"])
    finally:
        pool.close()
    assert (out.timeouts, out.errors, out.first) == (0, 0, None)
    assert out.scored == [Score(1.0, {"length": 2.0}), Score(0.0, {"length": 1.0})]
