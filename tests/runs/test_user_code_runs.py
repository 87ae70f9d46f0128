"""Runs of the trainer with user code that exits or hangs: each ends non-zero with one line naming the
function, the rank and the prompt's row (fast cases of the same rules: tests/unit/test_user_code.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.helpers import REWARD_FNS, ROOT, base_args, excerpt, run, torchrun
from tests.reward_fns import EVERY_CHARACTER

pytestmark = pytest.mark.slow


def test_sys_exit_in_a_reward_function_on_one_of_two_ranks(tiny_assets: Path, tmp_path: Path) -> None:
    """Rank 1's reward function calls sys.exit(0): both ranks stop with rank 1's one line (the run ended
    with exit 0 and no step, and rank 0 died in a gloo traceback naming nothing)."""
    args = base_args(tiny_assets, tmp_path / "run", steps=1) + [
        "trainer.val_before_train=false",
        f"reward.custom_function={REWARD_FNS}:exits",
        "trainer.dist_timeout_s=60",
    ]
    proc = torchrun(ROOT / "train_ppo.py", *args, timeout=300, env={"PPO_TEST_EXIT_RANK": "1"})
    assert proc.returncode != 0, excerpt(proc.stderr)  # torchrun exits 1 when a rank exits 2
    # every rank logs the one line (rank 0 at once, the others after runner.REPORT_DELAY_S)
    errors = sorted({line.split(" ERROR ", 1)[1] for line in proc.stderr.splitlines() if " ERROR " in line})
    assert len(errors) == 1, excerpt(proc.stderr)
    assert errors[0].startswith(f"rank 1: reward.custom_function='{REWARD_FNS}:exits' raised SystemExit: 0")
    assert "a reward function must return a score, not exit the process; prompt row " in errors[0]
    assert "Connection closed" not in proc.stderr
    assert proc.stderr.count("Traceback") == 1 and "ChildFailedError" in proc.stderr  # torchrun's own


HANGS_ONCE = """
import time


def hangs(data_source, solution_str, ground_truth, extra_info=None, *, log):
    if not solution_str:  # the start-up check's empty response
        return 0.0
    with open(log, "a+") as f:
        f.seek(0)
        first = not f.read()
        f.write("start\\n")
    if first:
        time.sleep(120)
    with open(log, "a") as f:
        f.write("end\\n")
    return 0.0
"""
"""A reward function that hangs (120 s) on its first response and returns 0 at once on the others;
``log`` gets a line when a call starts and one when it returns."""


def test_reward_timeout_holds_without_workers(
    tiny_assets: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """reward.timeout_s=2 with reward.pool_workers=0 and a function that hangs: the hanging call is
    interrupted (it started and never returned) and the run stops at it, naming the key to set (it waited
    for ever)."""
    fn, log = tmp_path / "hangs_once.py", tmp_path / "calls.txt"
    fn.write_text(HANGS_ONCE)
    args = base_args(tiny_assets, tmp_path / "run", steps=1) + [
        "trainer.val_before_train=false",
        f"reward.custom_function={fn}:hangs",
        f"reward.reward_kwargs={{log: {log}}}",
        "reward.timeout_s=2",
    ]
    assert run(args) == 2
    assert log.read_text().splitlines() == ["start"]  # one call, cut short: no "end", no second call
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1, errors
    assert f"reward.custom_function='{fn}:hangs' ran longer than reward.timeout_s=2.0" in errors[0]
    assert "set reward.pool_workers=1 or more; prompt row " in errors[0]


def test_sys_exit_in_an_environment_step_is_one_line(
    tiny_assets: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every printable character is a stop string, so the first turn calls ``step``, which exits."""
    preset = tmp_path / "turns.yaml"
    multi = {"enable": True, "env": f"{REWARD_FNS}:ExitsInStep", "stop": EVERY_CHARACTER}
    preset.write_text(yaml.safe_dump({"rollout": {"multi_turn": multi}}))
    args = ["--config", str(preset), *base_args(tiny_assets, tmp_path / "run", steps=1)]
    assert run([*args, "trainer.val_before_train=false"]) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1, errors
    assert errors[0].startswith("ExitsInStep.step raised SystemExit: 3 (prompt row "), errors[0]
