"""Reward workers (``reward.pool_workers``) in whole training runs on 2 ranks: a function that hangs or
kills its worker on one rank is counted and the run goes on; a stop signal while every reward call
hangs, in a step or in its validation, saves the last complete step at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import (
    REWARD_FNS,
    ROOT,
    base_args,
    excerpt,
    read_metrics,
    torchrun,
    wait_until,
)

TIMEOUT_S = 3.0


def hanging_run(
    assets: Path, out: Path, extra: list[str], ready: Callable[[], bool], settle_s: float, **env: str
) -> str:
    """A 4-step GRPO run in ``out`` under torchrun on 2 ranks, scored by ``slow_after`` in one reward
    worker per rank (``reward.timeout_s=600``, no cap; ``extra`` overrides and ``env`` added): once
    ``ready()`` holds and ``settle_s`` more seconds have passed, SIGTERM to the launcher's process group,
    as Slurm sends it (it may reach the reward workers too). torchrun's stderr (``communicate``'s 120 s
    only keeps a run that never exits from hanging the test; ``python -m ppo_bench.stops`` measures
    the seconds from the signal to the exit)."""
    args = base_args(assets, out, steps=4) + [
        "trainer.val_before_train=false",
        "algorithm.adv_estimator=grpo",
        f"reward.custom_function={REWARD_FNS}:slow_after",
        "reward.pool_workers=1",
        "reward.timeout_s=600",
        *extra,
    ]
    run_env = {**os.environ, "OMP_NUM_THREADS": "1", "PPO_TEST_SLOW_S": "3600", **env}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.Popen(
        [*cmd, str(ROOT / "train_ppo.py"), *args],
        stderr=subprocess.PIPE,
        text=True,
        env=run_env,
        start_new_session=True,
    )
    try:
        wait_until(proc, ready, timeout=400)
        time.sleep(settle_s)
        os.killpg(proc.pid, signal.SIGTERM)
        return proc.communicate(timeout=120)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


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
    assert proc.returncode == 0, excerpt(proc.stderr)
    rows = [r for r in read_metrics(out) if "reward/timeouts" in r]
    counted = "reward/timeouts" if how == "hang" else "reward/errors"
    other = "reward/errors" if how == "hang" else "reward/timeouts"
    assert [(r["step"], r[counted], r[other]) for r in rows] == [(1, 1.0, 0.0), (2, 0.0, 0.0)]
    warnings = [line for line in proc.stderr.splitlines() if "failed (scored 0.0; logged once)" in line]
    assert len(warnings) == 1, excerpt(proc.stderr)
    reason = "ran longer than reward.timeout_s=3.0" if how == "hang" else "the reward worker died"
    assert warnings[0].endswith(reason)
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 2


@pytest.mark.slow
def test_a_stop_signal_while_every_reward_call_hangs_saves_the_last_step(
    tiny_assets: Path, tmp_path: Path
) -> None:
    """Both ranks' reward calls of step 2 hang (reward.timeout_s=600, no cap); SIGTERM to the launcher's
    process group, as Slurm sends it (it may reach the reward workers too): scoring gives up at once, the
    run saves step 1 and logs that it stopped, with no traceback but torchrun's own SignalException.
    The scoring used to wait out its 600 s time limit, so torchrun's SIGKILL (30 s after its SIGTERM)
    ended the ranks before they logged a stop; had scoring finished, step 2 would have been logged and
    saved."""
    out, mark = tmp_path / "run", tmp_path / "slow"
    # A worker's calls before the slow one: the start-up probe, then its rank's 4 responses of step 1; the
    # signal goes once both ranks' first call of step 2 has begun to hang.
    slow = lambda: all(Path(f"{mark}.{r}").exists() for r in (0, 1))  # noqa: E731 (both ranks hang)
    env = {"PPO_TEST_FAST_CALLS": "5", "PPO_TEST_SLOW_MARK": str(mark)}
    stderr = hanging_run(tiny_assets, out, [], slow, 1, **env)
    assert "stopping: saved step 1" in stderr, excerpt(stderr)
    assert "did not start" not in stderr and "the reward worker died" not in stderr, excerpt(stderr)
    signalled = "torch.distributed.elastic.multiprocessing.api.SignalException: Process"
    assert stderr.count("Traceback") == stderr.count(signalled), excerpt(stderr)  # torchrun's own only
    assert (out / "checkpoints" / "latest").read_text() == "step_00000001"
    assert [r["step"] for r in read_metrics(out)] == [1]


@pytest.mark.slow
def test_a_stop_signal_while_validation_scoring_hangs_saves_the_step(
    tiny_assets: Path, tmp_path: Path
) -> None:
    """Step 1's validation (trainer.test_freq=1) hangs in the reward workers on both ranks; SIGTERM to the
    process group: the validation gives up at once, step 1 is logged without validation metrics and
    saved. The validation used to score the hanging call that the signal killed as a failure and log a
    validation score with it (0.625 here); a signal that reaches the trainer alone waited out
    reward.timeout_s (600 s) per hanging call."""
    out, mark = tmp_path / "run", tmp_path / "slow"
    # A worker's calls before the slow one: the start-up probe, then its rank's 4 responses of step 1.
    slow = lambda: all(Path(f"{mark}.{r}").exists() for r in (0, 1))  # noqa: E731 (both ranks hang)
    env = {"PPO_TEST_FAST_CALLS": "5", "PPO_TEST_SLOW_MARK": str(mark)}
    stderr = hanging_run(tiny_assets, out, ["trainer.test_freq=1"], slow, 1, **env)
    assert "validation stopped while scoring (SIGTERM)" in stderr, excerpt(stderr)
    assert "stopping: saved step 1" in stderr, excerpt(stderr)
    assert (out / "checkpoints" / "latest").read_text() == "step_00000001"
    (row,) = read_metrics(out)
    assert row["step"] == 1 and not any(k.startswith("val") for k in row)
