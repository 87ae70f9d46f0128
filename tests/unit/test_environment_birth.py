"""A multi-turn environment's constructor runs under the rules of its ``reset`` and ``step``: within
``rollout.multi_turn.step_timeout_s`` and, when it blocks or raises, one line naming the class, the
prompt's row (or the start-up check) and the limit's key; in the start-up check and in a rollout, through
the trainer's entry point."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from ppo.config import MultiTurnConfig
from ppo.environments import EnvError, check_environment
from ppo.multi_turn import make_settings
from tests.helpers import base_args, run
from tests.reward_fns import EVERY_CHARACTER

ENVS = """
import time

made = {"n": 0}
END = time.monotonic() + 20


def block():
    # until 20 s after the import: a caller that waits for the constructor fails on its message, not a hang
    while time.monotonic() < END:
        time.sleep(0.05)


class Env:
    def reset(self, row):
        return None

    def step(self, text):
        return " ok", 0.0, True


class Blocks(Env):
    def __init__(self):
        block()


class BlocksAfterTheFirst(Env):
    def __init__(self):
        made["n"] += 1
        if made["n"] > 1:
            block()


class ThirdFails(Env):
    def __init__(self):
        made["n"] += 1
        if made["n"] == 3:
            raise RuntimeError("out of sandboxes")
"""


@pytest.fixture
def envs(tmp_path: Path) -> Path:
    """A file of environment classes (a fresh module, so fresh instance counts, at every load)."""
    path = tmp_path / "envs.py"
    path.write_text(ENVS)
    return path


def test_a_blocking_constructor_is_named_within_the_limit_at_start_up(tok: Any, envs: Path) -> None:
    """The trainer's start-up (``make_settings``) makes one instance: a constructor that never returns is
    named after ``step_timeout_s``, not waited for."""
    config = MultiTurnConfig(enable=True, env=f"{envs}:Blocks", stop=["</calc>"], step_timeout_s=0.5)
    with pytest.raises(EnvError) as e:
        make_settings(config, tok, 64)
    assert str(e.value) == (
        f"rollout.multi_turn.env='{envs}:Blocks': Blocks() ran longer than rollout.multi_turn.step_timeout_s=0.5 "
        "(the start-up check makes one instance with no arguments, as the turn loop makes one per trajectory; "
        "make __init__ return sooner or raise rollout.multi_turn.step_timeout_s)"
    )
    # --print-config's check (environments.check_environment) says the same, under the limit it is given.
    with pytest.raises(EnvError) as e:
        check_environment(f"{envs}:Blocks", timeout_s=0.5)
    assert "Blocks() ran longer than rollout.multi_turn.step_timeout_s=0.5 (the start-up check" in str(
        e.value
    )


def multi_turn_run(assets: Path, envs: Path, folder: Path, env: str, *overrides: str) -> None:
    """A one-step multi-turn run on ``tiny_assets`` (file order, no validation) with the environment
    ``env`` of ``envs``, every turn one token (a stop at any character); it must exit with code 2."""
    preset = folder / "turns.yaml"
    multi = {"enable": True, "env": f"{envs}:{env}", "stop": EVERY_CHARACTER}
    preset.write_text(yaml.safe_dump({"rollout": {"multi_turn": multi}}))
    args = ["--config", str(preset), *base_args(assets, folder / "out", steps=1), "data.shuffle=false",
            "trainer.val_before_train=false", *overrides]  # fmt: skip
    assert run(args) == 2


@pytest.mark.parametrize(
    ("env", "message"),
    [
        # the start-up check's instance (the 1st) blocks
        ("Blocks", "rollout.multi_turn.env='{envs}:Blocks': Blocks() ran longer than "
                   "rollout.multi_turn.step_timeout_s=1.0 (the start-up check makes one instance with no "
                   "arguments, as the turn loop makes one per trajectory; make __init__ return sooner or raise "
                   "rollout.multi_turn.step_timeout_s)"),
        # the start-up check's instance is fine; the rollout's first (prompt row 0) blocks
        ("BlocksAfterTheFirst", "BlocksAfterTheFirst() ran longer than rollout.multi_turn.step_timeout_s=1.0 "
                                "(prompt row 0)"),
        # the start-up check makes the 1st, the rollout's first trajectory (row 0) the 2nd, its second the 3rd
        ("ThirdFails", "ThirdFails() raised RuntimeError: out of sandboxes (prompt row 0)"),
    ],
)  # fmt: skip
def test_a_constructor_that_blocks_or_fails_later_is_one_line_in_a_run(
    tiny_assets: Path, envs: Path, tmp_path: Path, capsys: pytest.CaptureFixture, env: str, message: str
) -> None:
    multi_turn_run(tiny_assets, envs, tmp_path, env, "rollout.multi_turn.step_timeout_s=1")
    err = capsys.readouterr().err
    problems = [line for line in err.splitlines() if "ERROR" in line or "rror:" in line]
    assert "Traceback" not in err and len(problems) == 1, err
    assert problems[0].endswith(message.format(envs=envs)), problems[0]
