"""Custom reward functions and multi-turn environments the end-to-end tests load with
``reward.custom_function=FILE:NAME`` and ``rollout.multi_turn.env=FILE:CLASS``."""

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
    ``$PPO_TEST_SLOW_RANK``, on that rank only (a reward function that hangs on one rank); with
    ``$PPO_TEST_SLOW_MARK``, the slow call first creates the file ``<mark>.<rank>``."""
    import os
    import time

    _calls["n"] += 1
    rank = os.environ.get("RANK", "0")
    if os.environ.get("PPO_TEST_SLOW_RANK", rank) != rank:
        return digit_score(data_source, solution_str, ground_truth, extra_info)
    if _calls["n"] == int(os.environ.get("PPO_TEST_FAST_CALLS", "0")) + 1:
        if mark := os.environ.get("PPO_TEST_SLOW_MARK"):  # a file that says the slow call has begun
            open(f"{mark}.{rank}", "w").close()
        time.sleep(float(os.environ.get("PPO_TEST_SLOW_S", "0")))
    return digit_score(data_source, solution_str, ground_truth, extra_info)


def hangs_on_seven(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> float:
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


def fails_once(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> float:
    """``digit_score``, but the first call for a response (not the start-up check's empty one) on rank
    ``$PPO_TEST_FAIL_RANK`` (of all its worker processes: the file ``$PPO_TEST_FAIL_MARKER`` marks it
    done) fails as ``$PPO_TEST_FAIL`` says: ``hang`` (sleeps an hour), ``exit`` (kills its process),
    ``raise`` or ``text`` (returns a string)."""
    import os
    import time
    from pathlib import Path

    marker = Path(os.environ["PPO_TEST_FAIL_MARKER"])
    if (
        solution_str
        and os.environ.get("RANK", "0") == os.environ["PPO_TEST_FAIL_RANK"]
        and not marker.exists()
    ):
        marker.write_text("failed")
        how = os.environ["PPO_TEST_FAIL"]
        if how == "hang":
            time.sleep(3600)
        if how == "exit":
            os._exit(3)
        if how == "raise":
            raise ValueError("a bug")
        return "text"  # type: ignore[return-value]
    return digit_score(data_source, solution_str, ground_truth, extra_info)


def keyword_order(
    solution_str: str, ground_truth: str, data_source: str, extra_info: dict | None = None, scale: float = 1.0
) -> dict:
    """verl's calling convention: arguments by keyword (in another order than verl's), ``scale`` from
    ``reward.reward_kwargs``; a dict with extra keys (logged as ``reward/extra/*``)."""
    digits = digit_score(data_source, solution_str, ground_truth)
    return {
        "score": scale * digits,
        "digits": digits,
        "long": len(solution_str) > 6,
        "note": "text is not logged",
    }


EVERY_CHARACTER = [chr(c) for c in range(33, 127)]
"""Stop strings that end a turn at its first printable character: with these, every turn of
``TurnsByRow`` is one generated token, whatever the (random) model writes."""


class TurnsByRow:
    """A stateless environment whose trajectories take a number of tool calls fixed by the prompt's row:
    1 call for ``extra_info.index % 4`` in (0, 1), 3 for 2 and 3 (so with 4 prompts a step over 2 ranks,
    rank 0's rows take 1 call and rank 1's take 3). Each call answers ``" ok"`` with reward 0.25; the
    last ends the trajectory. Call number ``$PPO_TEST_ENV_SLOW_CALL`` of this process first writes the
    file ``$PPO_TEST_ENV_MARKER`` and then sleeps ``$PPO_TEST_ENV_SLOW_S`` seconds (a known moment to
    kill a run)."""

    def reset(self, row: dict) -> None:
        self.left = 1 if row["extra_info"]["index"] % 4 < 2 else 3

    def step(self, action_text: str) -> tuple[str, float, bool]:
        import os
        import time
        from pathlib import Path

        _env_calls["n"] += 1
        if _env_calls["n"] == int(os.environ.get("PPO_TEST_ENV_SLOW_CALL", "0")):
            Path(os.environ["PPO_TEST_ENV_MARKER"]).write_text(str(_env_calls["n"]))
            time.sleep(float(os.environ.get("PPO_TEST_ENV_SLOW_S", "0")))
        self.left -= 1
        return " ok", 0.25, self.left == 0


_env_calls = {"n": 0}


def exits(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """A scorer that ends its process on a response (not the start-up check's empty one) on rank
    ``$PPO_TEST_EXIT_RANK`` (default 0): ``sys.exit(0)``, or ``os._exit(0)`` with ``$PPO_TEST_HARD_EXIT``."""
    import os
    import sys

    if solution_str and os.environ.get("RANK", "0") == os.environ.get("PPO_TEST_EXIT_RANK", "0"):
        if os.environ.get("PPO_TEST_HARD_EXIT"):
            os._exit(0)
        sys.exit(0)
    return digit_score(data_source, solution_str, ground_truth, extra_info)


def hangs(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """A scorer that hangs (an hour) on every response but the start-up check's empty one."""
    import time

    if solution_str:
        time.sleep(3600)
    return 0.0


class ExitsInStep:
    """An environment whose ``step`` calls ``sys.exit(3)`` (it was counted as a timeout, silently)."""

    def reset(self, row: dict) -> None:
        pass

    def step(self, action_text: str) -> tuple[str, float, bool]:
        import sys

        sys.exit(3)


def nan_at_first(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None, *, log: str
) -> float:
    """NaN for the first 8 responses (the first step's, with 4 prompts x 2), then ``digit_score``;
    ``log`` is a file that counts the calls (one line each), so each run counts its own. The start-up
    check's empty response scores 0 and is not counted."""
    if not solution_str:
        return 0.0
    with open(log, "a+") as f:
        f.write("x\n")
        f.seek(0)
        calls = len(f.readlines())
    return math.nan if calls <= 8 else digit_score(data_source, solution_str, ground_truth)


# ----------------------------------------------------------------------------------------------------
# TRL-style functions (called once per batch with lists), and a verl-style one to mix with them
# ----------------------------------------------------------------------------------------------------


def char_count(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> float:
    """verl's kind: the response's length in characters (the tiny assets' tokenizer gives a character a
    token, so this is its token count less the EOS and any special token)."""
    return float(len(solution_str))


def token_count(completion_ids: list[list[int]], **kwargs: object) -> list[float]:
    """TRL's kind, in the shape of TRL's ``get_soft_overlong_punishment``: each response's number of tokens
    (EOS included)."""
    return [float(len(ids)) for ids in completion_ids]


def steps_done(completions: list, trainer_state: object, **kwargs: object) -> list[float]:
    """TRL's kind: ``trainer_state.global_step`` for every response (the steps done before it)."""
    return [float(trainer_state.global_step)] * len(completions)  # type: ignore[attr-defined]


def epochs_done(completions: list, trainer_state: object, **kwargs: object) -> list[float]:
    """TRL's kind: ``trainer_state.epoch`` plus 1000 x ``trainer_state.max_steps`` for every response."""
    state = trainer_state
    return [state.epoch + 1000.0 * state.max_steps] * len(completions)  # type: ignore[attr-defined]


def odd_lengths_only(prompts: list, completions: list, **kwargs: object) -> list[float | None]:
    """TRL's kind with its "does not apply": 1.0 for a response of odd length, None for an even one."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [1.0 if len(t) % 2 else None for t in texts]


def returns_none(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> float | None:
    """verl's kind returning None, which only TRL's kind may (an error naming the function)."""
    return None
