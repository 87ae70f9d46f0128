"""Prompt files and reward functions in TRL's shape: a top-level ground_truth column, other columns
passed on, plain-string prompts with a chat template, a batched ``f(prompts, completions, **kwargs)``
(TRL's own shipped functions and lists of functions: tests/unit/test_trl_rewards.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from ppo import rewards, rule_scoring
from ppo.data import PromptRecord, load_prompts
from tests.helpers import write_parquet


class ChatTokenizer:
    """A whitespace tokenizer with a chat template (enough for load_prompts)."""

    chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    eos_token_id = 0

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [1] * len(text.split())}

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool, tokenize: bool) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def test_top_level_ground_truth_is_taken(tmp_path: Path) -> None:
    """TRL's layout: ground_truth next to the prompt, no reward_model; it was None in the reward function."""
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": "1 + 1"}],
            "ground_truth": "2",
        },
        {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "2 + 5"}], "ground_truth": 7},
    ]
    path = tmp_path / "trl.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    records = load_prompts([path], ChatTokenizer(), max_prompt_length=64)
    assert [r.ground_truth for r in records] == ["2", "7"]


def test_reward_model_ground_truth_wins_and_other_columns_reach_extra_info(tmp_path: Path) -> None:
    path = write_parquet(
        tmp_path / "both.parquet",
        [
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": "1 + 1"}],
                "reward_model": {"style": "rule", "ground_truth": "2"},
                "ground_truth": "3",
                "solution": "two",
                "extra_info": {"index": 5, "solution": "kept"},
            }
        ],
    )
    (record,) = load_prompts([path], ChatTokenizer(), max_prompt_length=64)
    assert record.ground_truth == "2"
    # the file's own extra_info wins over a top-level column of the same name
    assert record.extra_info == {"ground_truth": "3", "solution": "kept", "index": 5}


def test_string_prompts_with_a_chat_template_warn_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "strings.jsonl"
    path.write_text(
        "\n".join(json.dumps({"prompt": f"{i} + 1 =", "ground_truth": str(i + 1)}) for i in range(3))
    )
    with caplog.at_level(logging.WARNING, logger="ppo"):
        records = load_prompts([path], ChatTokenizer(), max_prompt_length=64, require_ground_truth=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert warnings[0].startswith(f"{path}: every prompt in column 'prompt' is a plain string")
    assert "[{'role': 'user', 'content': ...}]" in warnings[0]
    assert records[0].prompt_text == "0 + 1 =" and records[0].prompt == "0 + 1 ="


def test_trl_function_is_detected() -> None:
    def trl(prompts: list, completions: list, **kwargs: object) -> list[float]:
        return [0.0] * len(completions)

    def verl(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
        return 0.0

    def completions_only(completions: list, **kwargs: object) -> list[float]:  # trl.rewards.accuracy_reward's
        return [0.0] * len(completions)

    def ids_only(completion_ids: list, **kwargs: object) -> list[float]:  # get_soft_overlong_punishment's
        return [0.0] * len(completion_ids)

    def everything(**kwargs: object) -> float:  # verl's keywords, taken whole
        return 0.0

    assert rule_scoring.is_trl_function(trl) and not rule_scoring.is_trl_function(verl)
    assert rule_scoring.is_trl_function(completions_only) and rule_scoring.is_trl_function(ids_only)
    assert not rule_scoring.is_trl_function(everything)


def _record(prompt: object, truth: str, **extra: object) -> PromptRecord:
    return PromptRecord(
        input_ids=[1],
        prompt_text=str(prompt),
        data_source="trl",
        ground_truth=truth,
        extra_info=dict(extra),
        index=0,
        prompt=prompt,
    )


def test_trl_function_is_called_once_per_batch(tmp_path: Path) -> None:
    """One call with lists: prompts, completions (TRL's conversational form for chat prompts), the ground
    truths and every column; reward.reward_kwargs join them; completion_ids and trainer_state always
    come, as TRL gives them (None where the caller has none)."""
    fn_file = tmp_path / "trl_reward.py"
    fn_file.write_text(
        "CALLS = []\n"
        "def accuracy(prompts, completions, ground_truth, solution, scale, **kwargs):\n"
        "    CALLS.append((prompts, completions, ground_truth, solution, sorted(kwargs)))\n"
        "    texts = [c if isinstance(c, str) else c[0]['content'] for c in completions]\n"
        "    return [scale * float(t.strip() == g) for t, g in zip(texts, ground_truth)]\n"
    )
    scorer = rule_scoring.make_rule_scorer(f"{fn_file}:accuracy", 0.0, {"scale": 2.0})
    chat = [{"role": "user", "content": "1 + 1"}]
    records = [_record(chat, "2", solution="two"), _record("3 + 4 =", "7", solution="seven")]
    scores, metrics = rewards.rule_scores(scorer, records, [" 2", "8"])
    assert scores.tolist() == [2.0, 0.0] and metrics == {}
    import sys

    # this test's file: another test loads a trl_reward.py of its own in the same session
    module = next(m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == str(fn_file))
    (call,) = module.CALLS
    assert call == (
        [chat, "3 + 4 ="],
        [[{"role": "assistant", "content": " 2"}], "8"],
        ["2", "7"],
        ["two", "seven"],
        ["completion_ids", "data_source", "extra_info", "trainer_state"],
    )


def test_trl_function_without_kwargs_gets_what_it_names(tmp_path: Path) -> None:
    fn_file = tmp_path / "trl_plain.py"
    fn_file.write_text("def length(prompts, completions):\n    return [len(c) for c in completions]\n")
    scorer = rule_scoring.make_rule_scorer(f"{fn_file}:length", 0.0)
    scores, _ = rewards.rule_scores(scorer, [_record("a", "1", solution="x")] * 2, ["abc", "de"])
    assert scores.tolist() == [3.0, 2.0]


def test_trl_function_returning_what_is_not_a_score_is_one_clear_error(tmp_path: Path) -> None:
    fn_file = tmp_path / "trl_bad.py"
    fn_file.write_text(
        "def text(prompts, completions, **kw):\n    return ['high' for _ in completions]\n"
        "def short(prompts, completions, **kw):\n    return [1.0]\n"
    )
    label = f"reward.custom_function='{fn_file}:text'"
    scorer = rule_scoring.make_rule_scorer(f"{fn_file}:text", 0.0)
    with pytest.raises(rule_scoring.RewardError) as e:
        rewards.rule_scores(scorer, [_record("a", "1")] * 2, ["x", "y"])
    assert str(e.value) == (
        f"{label} returned ['high', 'high'] for 2 completions; expected a list of 2 numbers (or None where "
        "the function does not apply)"
    )
    with pytest.raises(rule_scoring.RewardError, match=r"returned \[1.0\] for 2 completions"):
        rewards.rule_scores(
            rule_scoring.make_rule_scorer(f"{fn_file}:short", 0.0), [_record("a", "1")] * 2, ["x", "y"]
        )
    with pytest.raises(rule_scoring.RewardError, match="set reward.pool_workers=0"):
        scorer("trl", "x", "1", {})
