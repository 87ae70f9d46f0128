"""Custom reward functions the end-to-end tests load with ``reward.custom_function=FILE:NAME``."""

from __future__ import annotations

import math


def digit_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> float:
    """A dense, deterministic signal for an untrained model: the share of digits in the response."""
    return sum(c.isdigit() for c in solution_str) / max(1, len(solution_str))


def nan_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> float:
    """A broken scorer: NaN for every response (the step must be skipped, nothing updated)."""
    return math.nan


def huge_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> float:
    """Finite but so large that the critic's squared error overflows fp32 (its updates are skipped)."""
    return 1e30


def raises(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """A scorer with a bug: it raises on every response."""
    return 1 / 0


def returns_text(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> str:
    """A scorer that returns a string instead of a number."""
    return "high"


_calls = {"n": 0}


def slow_after(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> float:
    """``digit_score``, but the call after the first ``$PPO_TEST_FAST_CALLS`` of this process sleeps
    ``$PPO_TEST_SLOW_S`` seconds: a step made slow from a known point on (signal tests); with
    ``$PPO_TEST_SLOW_RANK``, on that rank only (a reward function that hangs on one rank)."""
    import os
    import time

    _calls["n"] += 1
    rank = os.environ.get("RANK", "0")
    if os.environ.get("PPO_TEST_SLOW_RANK", rank) != rank:
        return digit_score(data_source, solution_str, ground_truth, extra_info)
    if _calls["n"] == int(os.environ.get("PPO_TEST_FAST_CALLS", "0")) + 1:
        time.sleep(float(os.environ.get("PPO_TEST_SLOW_S", "0")))
    return digit_score(data_source, solution_str, ground_truth, extra_info)


def hangs_on_seven(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """``digit_score``, but a response that contains a 7 hangs forever, one with a 3 raises, and one with
    a 5 returns text: a reward function with every failure a worker pool must survive."""
    import time

    if "7" in solution_str:
        time.sleep(3600)
    if "3" in solution_str:
        raise ValueError("no threes")
    if "5" in solution_str:
        return "five"  # type: ignore[return-value]
    return digit_score(data_source, solution_str, ground_truth, extra_info)
