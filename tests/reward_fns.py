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
