"""Reward functions of the recipe tests (``tests/unit/test_recipes.py``), loaded with
``reward.custom_function=FILE:NAME``."""

from __future__ import annotations

import os
import time
from pathlib import Path


def split_parity(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> float:
    """1 when the response holds an even number of digits, else 0: a coin flip per sampled response of
    the untrained model, so about half of the groups of two tie. Prompts whose ``extra_info.index`` is 2
    or 3 mod 4 always score 0: without shuffling, a batch of 4 prompts gives them to the second of two
    ranks, whose groups then all tie (dynamic sampling must refill from the first rank's)."""
    if (extra_info or {}).get("index", 0) % 4 >= 2:
        return 0.0
    return float(sum(c.isdigit() for c in solution_str) % 2 == 0)


_calls = {"n": 0}


def slow_split_parity(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> float:
    """``split_parity``; call number ``$RECIPE_SLOW_CALL`` of this process first writes the file
    ``$RECIPE_MARKER`` and then sleeps ``$RECIPE_SLOW_S`` seconds (a known moment to kill the run)."""
    _calls["n"] += 1
    if _calls["n"] == int(os.environ.get("RECIPE_SLOW_CALL", "0")):
        Path(os.environ["RECIPE_MARKER"]).write_text(str(_calls["n"]))
        time.sleep(float(os.environ.get("RECIPE_SLOW_S", "0")))
    return split_parity(data_source, solution_str, ground_truth, extra_info)


def one(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """1 for every response: what is left of a score is the overlong penalty."""
    return 1.0
