"""Rule rewards in worker processes (``reward.pool_workers``): a function that hangs, raises, returns text
or kills its process scores ``reward.error_score`` and is counted; the run goes on, on every rank, and
stops only when every response failed."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from ppo.data import PromptRecord
from ppo.reward_pool import RewardPool
from ppo.rewards import RewardError, check_rule_coverage, make_rule_scorer, rule_scores
from tests.helpers import REWARD_FNS, ROOT, base_args, read_metrics, torchrun

TIMEOUT_S = 3.0


def records(n: int) -> list[PromptRecord]:
    return [
        PromptRecord(
            input_ids=[1], prompt_text="p", data_source="d", ground_truth="g", extra_info={}, index=100 + i
        )
        for i in range(n)
    ]


def make_pool(function: str, num_workers: int = 2, error_score: float = -1.0) -> RewardPool:
    spec = f"{REWARD_FNS}:{function}"
    return RewardPool(
        functools.partial(make_rule_scorer, spec, 0.0, {}),
        name=f"reward.custom_function={spec!r}",
        num_workers=num_workers,
        timeout_s=TIMEOUT_S,
        error_score=error_score,
    )


@pytest.fixture(scope="module")
def hanging_pool() -> Iterator[RewardPool]:
    pool = make_pool("hangs_on_seven")
    yield pool
    pool.close()


def test_every_failure_scores_the_error_score_and_is_counted(hanging_pool: RewardPool) -> None:
    """hangs_on_seven hangs on a 7, raises on a 3, returns text on a 5: each is error_score (-1), the rest
    are scored as in the trainer's process; the counts are the metrics of the call."""
    texts = ["12", "x7", "13", "15", "a24b", "0"]
    scorer = make_rule_scorer(f"{REWARD_FNS}:digit_score", 0.0)
    expected = [scorer("d", t, "g", {}).value for t in texts]
    scores, metrics = rule_scores(scorer, records(len(texts)), texts, hanging_pool)
    assert scores.tolist() == [expected[0], -1.0, -1.0, -1.0, expected[4], expected[5]]
    assert metrics == {"reward/timeouts": 1.0, "reward/errors": 2.0}
    # the worker stuck on the 7 was replaced: the next call is served at full strength
    scores, metrics = rule_scores(scorer, records(3), ["1", "22", "4"], hanging_pool)
    assert scores.tolist() == [1.0, 1.0, 1.0]
    assert metrics == {"reward/timeouts": 0.0, "reward/errors": 0.0}


def test_the_first_failing_row_is_named_once(hanging_pool: RewardPool) -> None:
    scored, timeouts, errors, first = hanging_pool.score(records(3), ["1", "9", "35"])
    assert (scored[2], timeouts, errors) == (None, 0, 1)
    assert first is not None and first.startswith("prompt row 102 (d): ")
    assert "raised ValueError: no threes" in first


def test_a_call_where_every_response_fails_stops_the_run(hanging_pool: RewardPool) -> None:
    with pytest.raises(
        RewardError,
        match=r"failed on every one of the 2 responses on all ranks \(e.g. rank 0, prompt row 100",
    ):
        rule_scores(make_rule_scorer(None, 0.0), records(2), ["3", "53"], hanging_pool)


def test_a_worker_that_dies_is_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PPO_TEST_FAIL", "exit")
    monkeypatch.setenv("PPO_TEST_FAIL_RANK", "0")
    monkeypatch.setenv("PPO_TEST_FAIL_MARKER", str(tmp_path / "failed"))
    pool = make_pool("fails_once", num_workers=1, error_score=0.0)
    try:
        scored, timeouts, errors, first = pool.score(records(3), ["1", "2", "ab"])
    finally:
        pool.close()
    assert [s if s is None else s.value for s in scored] == [None, 1.0, 0.0]
    assert (timeouts, errors) == (0, 1)
    assert first == "prompt row 100 (d): the reward worker died"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["hang", "exit"])
def test_a_reward_function_that_fails_on_one_of_two_ranks(
    tiny_assets: Path, tmp_path: Path, how: str
) -> None:
    """Rank 1's first reward call hangs (or kills its worker): with reward.pool_workers=1 both ranks finish
    every step together, the response scores 0 and step 1 counts it; the warning names the row once."""
    out = tmp_path / "run"
    args = base_args(tiny_assets, out, steps=2) + [
        "trainer.val_before_train=false",
        "algorithm.adv_estimator=grpo",
        f"reward.custom_function={REWARD_FNS}:fails_once",
        "reward.pool_workers=1",
        f"reward.timeout_s={TIMEOUT_S}",
        "trainer.dist_timeout_s=60",
    ]
    env = {"PPO_TEST_FAIL": how, "PPO_TEST_FAIL_RANK": "1", "PPO_TEST_FAIL_MARKER": str(tmp_path / "failed")}
    proc = torchrun(ROOT / "train_ppo.py", *args, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in read_metrics(out) if "reward/timeouts" in r]
    counted = "reward/timeouts" if how == "hang" else "reward/errors"
    other = "reward/errors" if how == "hang" else "reward/timeouts"
    assert [(r["step"], r[counted], r[other]) for r in rows] == [(1, 1.0, 0.0), (2, 0.0, 0.0)]
    warnings = [line for line in proc.stderr.splitlines() if "failed (scored 0.0; logged once)" in line]
    assert len(warnings) == 1, proc.stderr[-3000:]
    reason = "ran longer than reward.timeout_s=3.0" if how == "hang" else "the reward worker died"
    assert warnings[0].endswith(reason)
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 2


def test_the_start_up_check_runs_in_the_pool() -> None:
    """A function that fails on the empty response of the start-up check fails the run before any model
    loads, through the pool (where a hang is cut at reward.timeout_s)."""
    pool = make_pool("raises", num_workers=1)
    try:
        with pytest.raises(
            RewardError, match=r"cannot score an empty response at start-up: prompt row 100 \(d\): "
        ):
            check_rule_coverage(make_rule_scorer(None, 0.0), records(1), f"{REWARD_FNS}:raises", pool)
    finally:
        pool.close()
