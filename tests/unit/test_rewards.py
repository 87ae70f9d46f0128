"""Tests of ppo.rewards: the GSM8K rule, dispatch by data_source, user-defined scorers, ranking and the
reward model's packed scoring."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pytest
import torch

from ppo.data import PromptRecord
from ppo.rewards import (
    competition_ranks,
    rank_scores,
    reward_model_scores,
    rule_scores,
    scores_from_ranks,
)
from ppo.rule_scoring import (
    GSM8K_CLIP_CHARS,
    RULE_DATA_SOURCES,
    RewardError,
    default_compute_score,
    extract_gsm8k_answer,
    gsm8k_score,
    load_reward_function,
    make_rule_scorer,
)

FMT = 0.1  # a format score distinct from 0 and 1, so each case shows which branch it took


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("23 + 48 = 71\n#### 71", "71", 1.0),
        ("23 + 48 = 61\n#### 61", "71", FMT),  # well-formed, wrong
        ("23 + 48 = 71", "71", 0.0),  # no #### line
        ("#### 1,000", "1000", 1.0),  # commas stripped
        ("#### $1,000", "1000", 1.0),  # dollar stripped
        ("#### 1000", "1,000", 1.0),  # the ground truth is normalized too
        ("#### 72.0", "72", 1.0),  # trailing decimal zeros do not matter
        ("#### 72.50", "72.5", 1.0),
        ("#### 72.01", "72", FMT),  # no rounding
        ("#### 072", "72", 1.0),  # leading zeros do not matter
        ("The total is\n#### 72.", "72", 1.0),  # a sentence's period is not part of the number
        ("#### -5", "-5", 1.0),
        ("#### -$5", "-5", 1.0),
        ("#### $-5", "-5", 1.0),
        ("#### 5", "-5", FMT),  # sign matters
        ("#### -0", "0", 1.0),
        ("#### 72\n#### 73", "73", 1.0),  # the last answer counts
        ("#### 72\n#### 73", "72", FMT),
        ("#### 72 and then #### nothing", "72", 1.0),  # a #### without a number is not an answer
        ("####72", "72", 1.0),  # spaces after #### are optional
        ("####\n72", "72", 0.0),  # but the number is on the same line
        ("### 72", "72", 0.0),
        ("#### seventy-two", "72", 0.0),
        ("", "72", 0.0),
    ],
)
def test_gsm8k_cases(response: str, truth: str, expected: float) -> None:
    assert gsm8k_score(response, truth, format_score=FMT) == expected


def test_gsm8k_only_looks_at_the_last_300_characters() -> None:
    assert GSM8K_CLIP_CHARS == 300
    answer = "#### 72"  # 7 characters
    assert gsm8k_score(answer + "x" * 293, "72") == 1.0  # 300 characters: the whole answer is inside
    assert gsm8k_score(answer + "x" * 294, "72") == 0.0  # 301: the first '#' is cut, "### 72" is no answer
    early = "#### 72\n" + "we keep talking " * 30 + "\n#### 99"
    assert gsm8k_score(early, "99") == 1.0 and gsm8k_score(early, "72", format_score=FMT) == FMT
    assert extract_gsm8k_answer("#### 1,234.50") == "1234.5"
    assert extract_gsm8k_answer("nothing") is None


def test_default_score_dispatches_by_data_source() -> None:
    assert set(RULE_DATA_SOURCES) == {"openai/gsm8k", "gsm8k", "synthetic/arith"}
    for source in RULE_DATA_SOURCES:
        assert default_compute_score(source, "#### 71", "71") == 1.0
        assert default_compute_score(source, "#### 70", "71", {"split": "val"}, format_score=FMT) == FMT
    with pytest.raises(
        RewardError, match=r"data_source='math/unknown'; known: openai/gsm8k, gsm8k, synthetic/arith"
    ):
        default_compute_score("math/unknown", "#### 71", "71")


def test_make_rule_scorer_default_uses_format_score() -> None:
    score = make_rule_scorer(None, format_score=0.25)
    assert score("gsm8k", "#### 70", "71", {}) == (0.25, {})
    assert score("synthetic/arith", "#### 71", "71", {}) == (1.0, {})
    assert score("gsm8k", "no answer", "71", {}) == (0.0, {})


SCORER_SOURCE = textwrap.dedent(
    """
    import math

    def score(data_source, solution_str, ground_truth, extra_info):
        return float(len(solution_str)) + (100.0 if extra_info.get("bonus") else 0.0)

    def as_dict(data_source, solution_str, ground_truth, extra_info):
        return {"score": 0.5, "acc": True, "pred": "12", "length": 3}

    def compute_score(solution_str, data_source, extra_info, ground_truth, scale=1.0, offset=0.0):
        return scale * len(solution_str) + offset

    def bad_type(data_source, solution_str, ground_truth, extra_info):
        return "high"

    def not_finite(data_source, solution_str, ground_truth, extra_info):
        return math.nan

    THRESHOLD = 3
    """
)


@pytest.fixture
def scorer_file(tmp_path: Path) -> Path:
    """A user's scorer file."""
    path = tmp_path / "my_scores.py"
    path.write_text(SCORER_SOURCE)
    return path


def test_custom_function_from_file_and_module(scorer_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from_file = load_reward_function(f"{scorer_file}:score")
    assert from_file("d", "abcd", "x", {}) == 4.0
    monkeypatch.syspath_prepend(str(scorer_file.parent))
    from_module = load_reward_function("my_scores:score")
    assert from_module("d", "abc", "x", {"bonus": 1}) == 103.0
    scorer = make_rule_scorer(f"{scorer_file}:score", format_score=FMT)
    assert scorer("unknown/source", "abcdef", "x", {}).value == 6.0  # no data_source restriction
    # a dict's other number keys (True counts as 1) are the extras; text is left out
    assert make_rule_scorer("my_scores:as_dict", format_score=0.0)("d", "s", "g", {}) == (
        0.5,
        {"acc": 1.0, "length": 3.0},
    )


def test_custom_function_is_called_by_keyword_with_reward_kwargs(scorer_file: Path) -> None:
    """verl calls compute_score(data_source=, solution_str=, ground_truth=, extra_info=) by keyword: a
    function with another argument order binds by name; ``:name`` left out is compute_score; reward_kwargs
    are passed as keywords."""
    scorer = make_rule_scorer(str(scorer_file), 0.0, {"scale": 2.0, "offset": 0.5})
    assert scorer("d", "abcd", "g", {}) == (8.5, {})
    assert make_rule_scorer(f"{scorer_file}:compute_score", 0.0)("d", "abc", "g", {}).value == 3.0
    with pytest.raises(RewardError, match=r"raised TypeError: .*unexpected keyword argument 'sacle'"):
        make_rule_scorer(str(scorer_file), 0.0, {"sacle": 2.0})("d", "abc", "g", {})


def test_a_failing_function_names_function_row_and_value(scorer_file: Path) -> None:
    record = PromptRecord(
        input_ids=[1], prompt_text="p", data_source="d", ground_truth="g", extra_info={}, index=41
    )
    scorer = make_rule_scorer(f"{scorer_file}:bad_type", 0.0)
    with pytest.raises(RewardError) as e:
        rule_scores(scorer, [record], ["an answer"])
    message = str(e.value)
    assert "\n" not in message
    assert f"reward.custom_function='{scorer_file}:bad_type' returned 'high'" in message
    assert "response 'an answer'" in message and message.endswith("; prompt row 41")


def test_rule_scores_average_the_extras_over_the_rows_that_have_them(tmp_path: Path) -> None:
    path = tmp_path / "extras.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
        "    out = {'score': float(len(solution_str)), 'twice': 2.0 * len(solution_str)}\n"
        "    return out | ({'odd': 1.0} if len(solution_str) % 2 else {})\n"
    )
    record = PromptRecord(
        input_ids=[1], prompt_text="p", data_source="d", ground_truth="g", extra_info={}, index=0
    )
    scores, metrics = rule_scores(make_rule_scorer(str(path), 0.0), [record] * 3, ["a", "bb", "ccc"])
    assert scores.tolist() == [1.0, 2.0, 3.0]
    assert metrics == {"reward/extra/twice": 4.0, "reward/extra/odd": 1.0}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "no_such_module_here",
            r"no module named 'no_such_module_here'",
        ),  # no_such_module_here:compute_score
        (":score", r"must look like module.path:function or path/to/file.py:function"),
        ("math", r"math has no attribute 'compute_score'"),
        ("missing/file.py:score", r"file missing/file.py does not exist"),
        ("no_such_module_xyz.sub:score", r"no module named 'no_such_module_xyz' \(is it on PYTHONPATH\?\)"),
        ("{file}:scroe", r"has no attribute 'scroe'; did you mean score\?"),
        ("{file}:THRESHOLD", r"my_scores.py.THRESHOLD is a int, not a function"),
        ("math:no_such_function_anywhere", r"math has no attribute 'no_such_function_anywhere'; it defines"),
    ],
)
def test_custom_function_errors(scorer_file: Path, spec: str, message: str) -> None:
    with pytest.raises(RewardError, match=message):
        load_reward_function(spec.format(file=scorer_file))


def test_custom_function_missing_dependency_is_not_hidden(tmp_path: Path) -> None:
    path = tmp_path / "needs_dep.py"
    path.write_text("import not_installed_dependency_xyz\n\ndef score(*args):\n    return 1.0\n")
    # The module's own missing import is named (not reported as a missing reward module), as one line.
    with pytest.raises(
        RewardError, match="importing .*needs_dep.py raised ModuleNotFoundError: .*not_installed_dep"
    ):
        load_reward_function(f"{path}:score")


def test_custom_function_bad_results(scorer_file: Path) -> None:
    scorer = make_rule_scorer(f"{scorer_file}:bad_type", format_score=0.0)
    with pytest.raises(
        RewardError, match=r"returned 'high' .* expected a number or a dict with a 'score' number"
    ):
        scorer("d", "s", "g", {})
    # NaN passes through: the trainer skips the step on every rank and counts it.
    assert math.isnan(
        make_rule_scorer(f"{scorer_file}:not_finite", format_score=0.0)("d", "s", "g", {}).value
    )
    assert not math.isnan(make_rule_scorer(None, 0.0)("gsm8k", "s", "g", {}).value)


def test_rank_scores_best_of_each_group_gets_one() -> None:
    scores = torch.tensor([0.2, 0.9, 0.5, 1.0, 1.0, 0.0, 3.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2])
    # group 0: best 0.9 -> [0, 1, 0]; group 1: 1.0 twice, both tied for best -> [1, 1, 0]; group of one -> 1
    assert rank_scores(scores, groups).tolist() == [0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0]


def test_rank_scores_best_is_the_default_and_explicit() -> None:
    scores = torch.tensor([0.2, 0.9, 0.5, 1.0, 1.0, 0.0, 3.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2])
    assert torch.equal(rank_scores(scores, groups, "best"), rank_scores(scores, groups))


def test_competition_ranks_share_the_better_rank() -> None:
    # group 0: [5, 9, 9, 1] -> 9 and 9 tie for best (0), 5 has two better (2), 1 has three (3);
    # group 1: [2, 2] -> both best; group 2: one response -> 0
    scores = torch.tensor([5.0, 9.0, 9.0, 1.0, 2.0, 2.0, 7.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    assert competition_ranks(scores, groups).tolist() == [2, 0, 0, 3, 0, 0, 0]
    # groups need not be contiguous: group 0 = [5, 5] (rows 1, 3), group 1 = [1, 3] (rows 0, 2)
    interleaved = competition_ranks(torch.tensor([1.0, 5.0, 3.0, 5.0]), torch.tensor([1, 0, 1, 0]))
    assert interleaved.tolist() == [1, 0, 0, 0]
    assert competition_ranks(torch.tensor([]), torch.tensor([], dtype=torch.long)).tolist() == []


def test_rank_scores_linear() -> None:
    scores = torch.tensor([3.0, 1.0, 3.0, 0.0, 0.5, 0.2, 4.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    # group 0 (k=4): ranks [0, 2, 0, 3] -> 1 - r/3 = [1, 1/3, 1, 0]; group 1 (k=2): ranks [0, 1] -> [1, 0];
    # a group of one: rank 0 -> 1
    expected = torch.tensor([1.0, 1 / 3, 1.0, 0.0, 1.0, 0.0, 1.0])
    torch.testing.assert_close(rank_scores(scores, groups, "linear"), expected)
    with pytest.raises(ValueError, match="unknown rank score mode 'top'; known: best, linear"):
        rank_scores(scores, groups, "top")


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_rank_scores_non_finite_poisons_its_group(bad: float) -> None:
    # Ranking must not hide a broken score: the trainer skips a step with a non-finite score.
    scores = torch.tensor([1.0, bad, 0.0, 2.0, 1.0])
    groups = torch.tensor([0, 0, 0, 1, 1])
    for mode in ("best", "linear"):
        out = rank_scores(scores, groups, mode)
        assert torch.isnan(out[:3]).all() and out[3:].tolist() == [1.0, 0.0], mode


def test_scores_from_ranks() -> None:
    ranks = torch.tensor([0, 0, 2, 3, 1, 0, 3, 2])
    # best: 1 for rank 0 only; linear (k=4): 1 - r/3
    assert scores_from_ranks(ranks, 4, "best").tolist() == [1, 1, 0, 0, 0, 1, 0, 0]
    expected = torch.tensor([1.0, 1.0, 1 / 3, 0.0, 2 / 3, 1.0, 0.0, 1 / 3])
    torch.testing.assert_close(scores_from_ranks(ranks, 4, "linear"), expected)
    assert scores_from_ranks(torch.tensor([0, 1]), 2, "linear").tolist() == [1.0, 0.0]  # a preference pair
    with pytest.raises(ValueError, match=r"ranks must lie in \[0, 4\); got \[0, 4\]"):
        scores_from_ranks(torch.tensor([0, 4]), 4, "best")


def test_ranking_sampled_and_offline_groups_agree() -> None:
    # The ranks of the data and the ranks the rule gives sampled groups score alike.
    scores = torch.tensor([0.0, 1.0, 1.0, 0.5, 0.0, 0.0, 0.0, 1.0])
    groups = torch.arange(8) // 4
    ranks = competition_ranks(scores, groups)
    assert ranks.tolist() == [3, 0, 0, 2, 1, 1, 1, 0]
    for mode in ("best", "linear"):
        assert torch.equal(rank_scores(scores, groups, mode), scores_from_ranks(ranks, 4, mode))


def test_reward_model_scores_equal_one_sequence_at_a_time(tiny_assets: Path) -> None:
    from ppo import model_loading

    rm = model_loading.load_reward_model(str(tiny_assets / "base_rm"))
    seqs = [[1, 5, 20, 21, 6, 30, 2], [1, 5, 22, 6, 2], [1, 5, 23, 24, 25, 6, 31, 32, 2]]
    scores = reward_model_scores(rm, seqs, micro_batch_size=2, device="cpu")  # packs [0, 1], then [2]
    with torch.no_grad():
        alone = [rm(input_ids=torch.tensor([s])).logits[0, 0].item() for s in seqs]  # HF pools the last token
    assert scores.dtype == torch.float32 and scores.shape == (3,)
    torch.testing.assert_close(scores, torch.tensor(alone), atol=1e-5, rtol=1e-5)
    assert len(set(scores.tolist())) == 3


@pytest.mark.parametrize("style", ["verl", "trl"])
def test_a_stop_signal_abandons_an_in_process_reward_function(tmp_path: Path, style: str) -> None:
    """A SIGTERM during the 2nd call (which would sleep an hour) interrupts it, no later call is made, and
    the batch's placeholder scores come back at once, for the step to end at its next boundary."""
    import signal

    from ppo.step_end import StopRequest

    path = tmp_path / "slow.py"
    calls = tmp_path / "calls"
    if style == "verl":
        path.write_text(
            "import os, signal, time\n"
            "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
            f"    with open({str(calls)!r}, 'a') as f:\n"
            "        f.write(solution_str + '\\n')\n"
            "    if solution_str == 'b':\n"
            "        os.kill(os.getpid(), signal.SIGTERM)\n"
            "        time.sleep(3600)\n"
            "    return 1.0\n"
        )
    else:  # one call for the batch: the signal comes inside it
        path.write_text(
            "import os, signal, time\n"
            "def compute_score(completions, **kwargs):\n"
            f"    open({str(calls)!r}, 'a').write('batch\\n')\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    time.sleep(3600)\n"
        )
    record = PromptRecord(
        input_ids=[1], prompt_text="p", data_source="d", ground_truth="g", extra_info={}, index=0
    )
    previous = {s: signal.getsignal(s) for s in StopRequest.SIGNALS}
    try:
        stop = StopRequest()
        scores, _ = rule_scores(
            make_rule_scorer(f"{path}:compute_score", 0.0), [record] * 4, ["a", "b", "c", "d"]
        )
        assert stop.name == "SIGTERM"
        assert scores.tolist() == [0.0] * 4
        assert calls.read_text().split() == (["a", "b"] if style == "verl" else ["batch"])
        # Later batches are not scored either: no call starts once the stop came.
        rule_scores(make_rule_scorer(f"{path}:compute_score", 0.0), [record], ["e"])
        assert calls.read_text().split() == (["a", "b"] if style == "verl" else ["batch"])
        StopRequest()  # a new run in this process: calls are made again
        if style == "verl":
            assert rule_scores(make_rule_scorer(f"{path}:compute_score", 0.0), [record], ["e"])[
                0
            ].tolist() == [1.0]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
