"""Rule rewards in worker processes (``reward.pool_workers``): a function that hangs, raises, returns text
or kills its process scores ``reward.error_score`` and is counted; the run goes on, on every rank, and
stops only when every response failed. Workers import neither torch nor the trainer, a timed-out one is
replaced without holding up the others, ``reward.total_timeout_s`` caps a call and a stop request ends
one at once."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ppo.config import ConfigError
from ppo.config_loader import load_config
from ppo.data import PromptRecord
from ppo.reward_pool import RewardPool
from ppo.rewards import check_rule_coverage, rule_scores
from ppo.rule_scoring import RewardError, Score, make_rule_scorer
from tests.helpers import REWARD_FNS, ROOT, demo_inputs

TIMEOUT_S = 3.0


def records(n: int) -> list[PromptRecord]:
    return [
        PromptRecord(
            input_ids=[1], prompt_text="p", data_source="d", ground_truth="g", extra_info={}, index=100 + i
        )
        for i in range(n)
    ]


def make_pool(
    function: str,
    num_workers: int = 2,
    error_score: float = -1.0,
    *,
    timeout_s: float = TIMEOUT_S,
    total_timeout_s: float | None = None,
    fn_file: Path = REWARD_FNS,
) -> RewardPool:
    return RewardPool(
        custom_function=f"{fn_file}:{function}",
        format_score=0.0,
        reward_kwargs={},
        num_workers=num_workers,
        timeout_s=timeout_s,
        error_score=error_score,
        total_timeout_s=total_timeout_s,
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
    out = hanging_pool.score(records(3), ["1", "9", "35"])
    assert (out.scored[2], out.timeouts, out.errors) == (None, 0, 1)
    assert out.first is not None and out.first.startswith("prompt row 102 (d): ")
    assert "raised ValueError: no threes" in out.first


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
        out = pool.score(records(3), ["1", "2", "ab"])
    finally:
        pool.close()
    assert [s if s is None else s.value for s in out.scored] == [None, 1.0, 0.0]
    assert (out.timeouts, out.errors) == (0, 1)
    assert out.first == "prompt row 100 (d): the reward worker died"


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


# ----------------------------------------------------------------------------------------------------
# Workers: what they import, how they are replaced, the cap on a call, a stop request
# ----------------------------------------------------------------------------------------------------

PROBE = """
import sys


def probe(data_source, solution_str, ground_truth, extra_info=None):
    print("a user's print goes to stderr, not into the protocol")
    main = sys.modules["__main__"]
    return {
        "score": 1.0,
        "torch": float("torch" in sys.modules),
        "ppo_rewards": float("ppo.rewards" in sys.modules),
        "worker_main": float(getattr(main.__spec__, "name", None) == "ppo.reward_worker"),
    }
"""


def write_fn(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "user_rewards.py"
    path.write_text(text)
    return path


def test_a_worker_imports_neither_torch_nor_the_trainer(tmp_path: Path) -> None:
    """The worker's ``__main__`` is ``ppo.reward_worker`` (not the trainer's script, as under ``spawn``),
    torch and ``ppo.rewards`` are not loaded, and the function's print does not break the protocol."""
    pool = make_pool("probe", num_workers=1, fn_file=write_fn(tmp_path, PROBE))
    try:
        out = pool.score(records(1), ["x"])
    finally:
        pool.close()
    assert out.scored == [Score(1.0, {"torch": 0.0, "ppo_rewards": 0.0, "worker_main": 1.0})]


def test_timed_out_workers_are_replaced_and_their_replacements_take_the_rest() -> None:
    """2 workers, timeout 1 s, a hang at rows 0 and 4: both workers hang by row 5; each is replaced and its
    replacement scores rows after it. (How long such a call takes: ``python -m ppo_bench.rewards``.)"""
    pool = make_pool("hangs_on_seven", timeout_s=1.0)
    try:
        first_pids = {w.proc.pid for w in pool.workers}
        texts = ["x7", "12", "4", "ab1", "7", "22", "1a", "9"]  # hangs_on_seven: digit share, 7 hangs
        out = pool.score(records(len(texts)), texts)
        values = [s if s is None else s.value for s in out.scored]
        assert values == [None, 1.0, 1.0, 1 / 3, None, 1.0, 0.5, 1.0]
        assert (out.timeouts, out.errors, out.abandoned, out.capped) == (2, 0, 0, 0)
        assert out.first == "prompt row 100 (d): ran longer than reward.timeout_s=1.0"
        assert not first_pids & {w.proc.pid for w in pool.workers}  # both replaced
    finally:
        pool.close()


# A reward function that writes what its worker does to the file $PPO_TEST_EVENTS ("<pid> <event>" lines,
# appended in the order they happen), so a test can assert who scored what and in which order: "hang"
# hangs, anything else scores 1. With $PPO_TEST_GATE set, a worker started after the pool's first two (a
# replacement) finishes importing the function, and so reports ready, only once some worker was called
# on "after".
EVENTS_FN = """
import os
import time
from pathlib import Path

EVENTS = Path(os.environ["PPO_TEST_EVENTS"])


def log(event):
    with EVENTS.open("a") as f:
        f.write(f"{os.getpid()} {event}\\n")


def logged():
    return [line.split(" ", 1)[1] for line in EVENTS.read_text().splitlines()] if EVENTS.exists() else []


replacement = logged().count("import") >= 2
log("import")
if replacement and os.environ.get("PPO_TEST_GATE"):
    deadline = time.monotonic() + 60  # only where the pool waits for this worker; then the test fails
    while "call after" not in logged() and time.monotonic() < deadline:
        time.sleep(0.01)
    log("ready")


def score(data_source, solution_str, ground_truth, extra_info=None):
    log(f"call {solution_str}")
    if solution_str == "hang":
        time.sleep(3600)
    return 1.0
"""


def read_events(path: Path) -> list[tuple[int, str]]:
    """The ``(pid, event)`` lines ``EVENTS_FN`` wrote, in order."""
    if not path.exists():
        return []
    return [
        (int(pid), event) for pid, event in (line.split(" ", 1) for line in path.read_text().splitlines())
    ]


def wait_until(condition: Callable[[], bool], limit_s: float = 60.0) -> None:
    """Wait for what a worker does after a call returned; the limit only ends a wait for something that
    never happens (the assertion after it fails then), it is not measured."""
    deadline = time.monotonic() + limit_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.fixture
def events_fn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``EVENTS_FN``'s file; its events go to ``tmp_path / "events"``, beside it."""
    monkeypatch.setenv("PPO_TEST_EVENTS", str(tmp_path / "events"))
    return write_fn(tmp_path, EVENTS_FN)


def test_a_timed_out_worker_is_replaced_without_holding_up_the_other_rows(
    events_fn: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Worker A times out on "hang" and is replaced; the replacement cannot report ready until a worker has
    been called on "after" (``PPO_TEST_GATE``). The pool does not wait for it: the call returns with the
    replacement still starting, and the next row goes to the other worker before the replacement is
    ready. A pool that waited for its replacement would have it ready first (after the function's
    60 s fallback). How long such a call takes is measured by ``python -m ppo_bench.rewards``."""
    monkeypatch.setenv("PPO_TEST_GATE", "1")
    events = events_fn.parent / "events"
    pool = make_pool("score", timeout_s=1.0, fn_file=events_fn)
    try:
        out = pool.score(records(1), ["hang"])
        assert (out.scored, out.timeouts, out.errors, out.abandoned) == ([None], 1, 0, 0)
        assert out.first == "prompt row 100 (d): ran longer than reward.timeout_s=1.0"
        (hung,) = [pid for pid, event in read_events(events) if event == "call hang"]
        starting = [w.proc.pid for w in pool.workers if not w.ready]
        assert len(starting) == 1 and hung not in starting  # replaced, and the call did not wait for it
        (other,) = [w.proc.pid for w in pool.workers if w.ready]
        assert [s.value for s in pool.score(records(1), ["after"]).scored] == [1.0]
        wait_until(lambda: (starting[0], "ready") in read_events(events))
        log = read_events(events)
        assert log.index((other, "call after")) < log.index((starting[0], "ready")), log
    finally:
        pool.close()


def test_total_timeout_cuts_a_call_and_warns_once(events_fn: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Every call hangs: 8 rows on 2 workers with timeout_s=5 would be scored 2 at a time, each pair cut at
    5 s; reward.total_timeout_s=1.5 cuts the call while the first pair runs: no third call starts, every
    row is a timeout cut by the cap, both workers are replaced. (The call's seconds: ppo_bench.rewards.)"""
    events = events_fn.parent / "events"
    name = f"reward.custom_function='{events_fn}:score'"
    pool = make_pool("score", timeout_s=5.0, total_timeout_s=1.5, fn_file=events_fn)
    try:
        first_pids = {w.proc.pid for w in pool.workers}
        out = pool.score(records(8), ["hang"] * 8)
        assert out.scored == [None] * 8
        assert (out.timeouts, out.errors, out.abandoned, out.capped) == (8, 0, 0, 8)
        assert out.first == "prompt row 100 (d): cut by reward.total_timeout_s=1.5"
        calls = [pid for pid, event in read_events(events) if event == "call hang"]
        assert sorted(calls) == sorted(first_pids)  # one call on each worker, then the cap
        assert not first_pids & {w.proc.pid for w in pool.workers}  # both replaced, not waited for
        with (
            caplog.at_level(logging.WARNING, logger="ppo"),
            pytest.raises(RewardError, match="every one of the 8"),
        ):
            rule_scores(make_rule_scorer(None, 0.0), records(8), ["hang"] * 8, pool)
    finally:
        pool.close()
    assert [r.getMessage() for r in caplog.records if "total_timeout_s" in r.getMessage()] == [
        f"{name} failed (scored -1.0; logged once): rank 0, prompt row 100 (d): cut by reward.total_timeout_s=1.5",
        "reward.total_timeout_s=1.5 cut a scoring call (a step's, a validation's or the start-up check's): "
        "8 of its 8 responses were not scored in time (scored -1.0, counted in reward/timeouts; logged once)",
    ]


def test_a_stop_request_ends_a_call_at_once(events_fn: Path) -> None:
    """A stop request once both workers hang (timeout 30 s): the call returns at its next poll, the hung
    rows and the row not sent yet abandoned (not failures: no "failed on every response" error, no
    timeout), their scores error_score; the hung workers are replaced, not waited for, and the row after
    the stop never starts. (How soon the call returns: ppo_bench.rewards.)"""
    events = events_fn.parent / "events"

    def hung(count: int) -> Callable[[], bool]:
        return lambda: sum(event == "call hang" for _, event in read_events(events)) >= count

    pool = make_pool("score", timeout_s=30.0, fn_file=events_fn)
    try:
        first_pids = {w.proc.pid for w in pool.workers}
        out = pool.score(records(4), ["1", "hang", "hang", "12"], stop=hung(2))
        assert [s if s is None else s.value for s in out.scored] == [1.0, None, None, None]
        assert (out.timeouts, out.errors, out.abandoned, out.first) == (0, 0, 3, None)
        calls = sorted(event for _, event in read_events(events) if event.startswith("call "))
        assert calls == ["call 1", "call hang", "call hang"]  # "12", the row after the stop, never started
        assert not first_pids & {w.proc.pid for w in pool.workers}
        scores, metrics = rule_scores(
            make_rule_scorer(None, 0.0), records(2), ["hang", "hang"], pool, hung(4)
        )
        assert scores.tolist() == [-1.0, -1.0]
        assert metrics == {"reward/timeouts": 0.0, "reward/errors": 0.0}
    finally:
        pool.close()


SELF_TERM = """
import os
import signal
from pathlib import Path


def term(data_source, solution_str, ground_truth, extra_info=None):
    Path(os.environ["PPO_TEST_STOP_MARKER"]).write_text("stop")  # the trainer's stop request...
    os.kill(os.getpid(), signal.SIGTERM)  # ...and the same signal reaching the worker
"""


def test_a_worker_killed_by_the_stop_signal_is_not_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "stop"
    monkeypatch.setenv("PPO_TEST_STOP_MARKER", str(marker))
    pool = make_pool("term", num_workers=1, fn_file=write_fn(tmp_path, SELF_TERM))
    try:
        out = pool.score(records(2), ["a", "b"], stop=marker.exists)
    finally:
        pool.close()
    assert (out.scored, out.timeouts, out.errors, out.abandoned, out.first) == ([None, None], 0, 0, 2, None)


ORPHAN = """
import sys
from types import SimpleNamespace

from ppo.reward_pool import RewardPool

pool = RewardPool(custom_function=sys.argv[1], format_score=0.0, reward_kwargs={}, num_workers=1, timeout_s=600,
                  error_score=0.0)
print(pool.workers[0].proc.pid, flush=True)
pool.score([SimpleNamespace(data_source="d", ground_truth="g", extra_info={}, index=0)], ["7"])  # hangs
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_worker_stuck_in_a_call_exits_when_the_trainer_is_killed() -> None:
    """SIGKILL leaves the trainer no time to close its pool, and a worker hanging in the user's call never
    reads the EOF on its stdin: its watcher thread sees the parent gone and ends it within seconds."""
    trainer = subprocess.Popen(
        [sys.executable, "-c", ORPHAN, f"{REWARD_FNS}:hangs_on_seven"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        worker = int(trainer.stdout.readline())  # type: ignore[union-attr]
        time.sleep(0.5)  # in the hanging call
        assert alive(worker)
        trainer.kill()
        trainer.wait(timeout=10)
        deadline = time.monotonic() + 10
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(worker)
    finally:
        trainer.kill()


def test_a_worker_ignores_ctrl_c() -> None:
    """Ctrl-C in a terminal reaches the whole process group: the trainer stops at a phase boundary and
    closes its workers, which must not die under it first."""
    pool = make_pool("digit_score", num_workers=1)
    try:
        pid = pool.workers[0].proc.pid
        os.kill(pid, signal.SIGINT)
        out = pool.score(records(1), ["12"])
        assert (out.scored, out.errors, pool.workers[0].proc.pid) == ([Score(1.0, {})], 0, pid)
    finally:
        pool.close()


def test_a_function_that_cannot_be_imported_is_one_line(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    path = write_fn(tmp_path, "import not_a_module_of_anyone\n\n\ndef score(**kwargs):\n    return 1.0\n")
    with pytest.raises(RewardError) as e:
        make_pool("score", fn_file=path)
    assert str(e.value) == (
        f"a reward worker could not start: reward.custom_function='{path}:score': importing {path} raised "
        "ModuleNotFoundError: No module named 'not_a_module_of_anyone'"
    )
    assert "Traceback" not in capfd.readouterr().err


def test_a_worker_that_exits_while_importing_says_so(tmp_path: Path) -> None:
    path = write_fn(tmp_path, "import os\n\nos._exit(4)\n")
    with pytest.raises(RewardError) as e:
        make_pool("score", fn_file=path)
    assert str(e.value) == (
        f"a reward worker for reward.custom_function='{path}:score' did not start: it exited with code 4 "
        "while importing the function (its output is above)"
    )


def test_total_timeout_is_checked_and_needs_workers() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, ["reward.total_timeout_s=0"])
    assert str(e.value) == "reward.total_timeout_s must be > 0, got 0.0 (from the command line)"
    assert load_config(None, [*demo_inputs(), "reward.total_timeout_s=30"]).warnings() == [
        "reward.total_timeout_s=30.0 caps the scoring in reward workers and is ignored with "
        "reward.pool_workers=0 (the trainer's process limits each call to reward.timeout_s)"
    ]
    assert (
        load_config(None, [*demo_inputs(), "reward.total_timeout_s=30", "reward.pool_workers=2"]).warnings()
        == []
    )
