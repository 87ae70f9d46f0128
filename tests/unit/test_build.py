"""What ``ppo.build`` loads in the trainer's process before step 1, and what it leaves to others: with
``reward.pool_workers > 0`` the user's reward function is imported by the reward workers only, so its
import-time side effects and failures happen where it runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import base_args, run

REWARD_FILE = """\
import os
with open({marker!r}, "a") as f:  # who imported this file
    f.write(f"{{os.getpid()}}\\n")
{extra}
def score(data_source, solution_str, ground_truth, extra_info, **kwargs):
    return float(len(solution_str) % 2)
"""


def reward_file(tmp_path: Path, extra: str = "") -> tuple[Path, Path]:
    """A reward function file that appends its importer's pid to a marker file (then runs ``extra``)."""
    marker = tmp_path / "imported_by.txt"
    path = tmp_path / "rewards_with_side_effect.py"
    path.write_text(REWARD_FILE.format(marker=str(marker), extra=extra))
    return path, marker


def pool_run_args(assets: Path, out: Path, fn_file: Path) -> list[str]:
    """A 1-step GRPO run on the tiny assets, its rule reward scored by one worker process."""
    args = [a for a in base_args(assets, out, steps=1) if not a.startswith("reward.custom_function")]
    return [
        *args,
        "algorithm.adv_estimator=grpo",
        "trainer.val_before_train=false",
        f"reward.custom_function={fn_file}:score",
        "reward.pool_workers=1",
    ]


@pytest.mark.slow
def test_the_trainer_leaves_the_reward_function_to_its_workers(tiny_assets: Path, tmp_path: Path) -> None:
    """reward.pool_workers=1: the run trains, its worker imported the function, the trainer (this
    process) never did. With reward.pool_workers=0 the trainer imports it itself."""
    fn_file, marker = reward_file(tmp_path)
    assert run(pool_run_args(tiny_assets, tmp_path / "pool", fn_file)) == 0
    importers = {int(line) for line in marker.read_text().split()}
    assert importers and os.getpid() not in importers  # only the worker (a process of its own)

    marker.unlink()
    in_process = pool_run_args(tiny_assets, tmp_path / "in_process", fn_file) + ["reward.pool_workers=0"]
    assert run(in_process) == 0
    assert {int(line) for line in marker.read_text().split()} == {os.getpid()}


def test_a_reward_file_that_fails_on_import_is_one_line_before_any_model_loads(
    tiny_assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The worker imports the file and reports its failure: exit 2, one error line naming the function
    and the error, no traceback, and no model loaded (the trainer never runs the file's code)."""
    fn_file, marker = reward_file(tmp_path, extra='raise RuntimeError("no GPU here")')
    assert run(pool_run_args(tiny_assets, tmp_path / "run", fn_file)) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].endswith(
        f"a reward worker could not start: reward.custom_function='{fn_file}:score': importing {fn_file} "
        "raised RuntimeError: no GPU here"
    )
    assert "loading model.path" not in err
    assert os.getpid() not in {int(line) for line in marker.read_text().split()}
