"""The console: the step line's fields (``metrics.console_line``), its one-line legend, the health
warning for rewards that are all 0, and the end-of-run summary (``monitor.run_summary``)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from ppo.config import PPOConfig
from ppo.metrics import CONSOLE_KEYS, CONSOLE_LEGEND, MetricsLogger, console_line
from ppo.monitor import ZERO_REWARD_STEPS, HealthMonitor, log_run_summary, run_summary
from tests.helpers import ROOT


def test_critic_warmup_step_says_warmup() -> None:
    """A step that trained the critic only has no actor/pg_loss: pg=warmup, not a missing field."""
    line = console_line({"critic/score/mean": 0.5, "critic/vf_loss": 0.25, "timing_s/step": 2.0})
    assert line == "score=0.5 pg=warmup vf=0.25 s=2"


def test_kl_loss_and_grad_norm_are_shown() -> None:
    """GRPO with actor.use_kl_loss: its KL loss is on the line, and the actor's gradient norm."""
    line = console_line(
        {"actor/pg_loss": 1e-8, "actor/ppo_kl": 0.0, "actor/grad_norm": 0.75, "actor/kl_loss": 0.002}
    )
    assert line == "pg=1e-08 ppo_kl=0 gn=0.75 kl_loss=0.002"


def test_legend_names_every_label() -> None:
    for label in CONSOLE_KEYS.values():
        assert f" {label} = " in f" {CONSOLE_LEGEND}" or CONSOLE_LEGEND.startswith(f"columns: {label} = ")
    assert "warmup" in CONSOLE_LEGEND and "docs/console.md" in CONSOLE_LEGEND
    doc = (ROOT / "docs" / "console.md").read_text()
    for label in CONSOLE_KEYS.values():
        assert f"`{label}`" in doc


def test_legend_precedes_the_first_step_line_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    log = MetricsLogger(tmp_path, ["console"], is_main=True, total_steps=2)
    with caplog.at_level(logging.INFO, logger="ppo"):
        log.log(1, {"critic/score/mean": 1.0})
        log.log(2, {"critic/score/mean": 0.0})
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == CONSOLE_LEGEND
    assert lines[1].endswith("score=1") and lines[2].endswith("score=0") and len(lines) == 3


def test_zero_rewards_warn_once_after_the_first_steps(caplog: pytest.LogCaptureFixture) -> None:
    monitor = HealthMonitor(cfg=PPOConfig())
    zero = {"critic/score/min": 0.0, "critic/score/max": 0.0, "critic/score/mean": 0.0}
    fired = [monitor.check(step, dict(zero)) for step in range(1, ZERO_REWARD_STEPS + 3)]
    # steps 1..K-1 quiet, step K fires, later steps quiet (once)
    assert [bool(f.get("warn/zero_rewards")) for f in fired] == [False] * (ZERO_REWARD_STEPS - 1) + [
        True,
        False,
        False,
    ]
    assert sum("scored 0: the reward function never matches" in r.getMessage() for r in caplog.records) == 1


def test_zero_rewards_stay_quiet_after_a_nonzero_step() -> None:
    monitor = HealthMonitor(cfg=PPOConfig())
    monitor.check(1, {"critic/score/min": 0.0, "critic/score/max": 1.0})
    fired = [monitor.check(s, {"critic/score/min": 0.0, "critic/score/max": 0.0}) for s in range(2, 8)]
    assert not any("warn/zero_rewards" in f for f in fired)


def test_monitor_state_of_an_older_checkpoint_loads() -> None:
    """A checkpoint written before the zero-reward warning has no zero_score_steps: it loads, and the
    resumed run (past its start) never fires it."""
    monitor = HealthMonitor(cfg=PPOConfig())
    monitor.load_state_dict({"active": [], "kl_steps_above": 0, "score_avg": None, "score_steps": 4})
    assert monitor.zero_score_steps == -1


def test_run_summary_lines(tmp_path: Path) -> None:
    lines = run_summary(
        steps_done=40,
        total_steps=40,
        steps_this_run=10,
        wall_s=125.0,
        metrics={"val/score": 0.8125, "val/synthetic/arith/accuracy": 0.8},
        checkpoint=tmp_path / "checkpoints" / "step_00000040",
        hf_dir=tmp_path / "hf",
    )
    assert lines == [
        "run done: step 40 of 40 (10 in this process, 2m05s)",
        "final validation: val/score=0.8125",
        f"last checkpoint: {tmp_path / 'checkpoints' / 'step_00000040'}",
        f"exported model (save_pretrained): {tmp_path / 'hf'}",
    ]
    stopped = run_summary(
        steps_done=3,
        total_steps=40,
        steps_this_run=3,
        wall_s=9,
        metrics={},
        checkpoint=None,
        hf_dir=None,
        stopped="SIGTERM",
    )
    assert stopped == [
        "run stopped early (SIGTERM): step 3 of 40 (3 in this process, 9s)",
        "last checkpoint: none written",
    ]


def test_final_validation_names_an_earlier_step(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A run that validated at step 0 and at step 2 but not at its last step (3): the summary says no
    validation ran at the end and gives the last one with its step (it showed it as the final one)."""
    rows = [
        '{"step": 0, "val/score": 0.5}',
        '{"step": 1, "critic/score/mean": 0.25}',
        '{"step": 2, "critic/score/mean": 0.5, "val/score": 0.625}',
        '{"step": 3, "critic/score/mean": 0.75}',
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    logger = SimpleNamespace(is_main=True, total_steps=3, first_step=0, start=time.perf_counter())
    with caplog.at_level(logging.INFO, logger="ppo"):
        log_run_summary(tmp_path, logger, steps_done=3, stopped=None, hf_dir=None)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[1] == "final validation: none ran at step 3; the last, at step 2: val/score=0.625"
    # validated at the end: the final one
    common = {"total_steps": 3, "steps_this_run": 3, "wall_s": 1, "checkpoint": None, "hf_dir": None}
    end = run_summary(steps_done=3, metrics={"val/score": 0.75}, val_step=3, **common)
    assert end[1] == "final validation: val/score=0.75"


def test_critic_load_report_is_held_only_for_the_expected_head() -> None:
    from ppo.model_loading import _only_head_differs

    assert _only_head_differs(
        {
            "missing_keys": ["score.weight", "score.bias"],
            "unexpected_keys": ["lm_head.weight"],
            "mismatched_keys": [],
        }
    )
    assert not _only_head_differs({"missing_keys": ["score.weight", "model.layers.0.mlp.up_proj.weight"]})
    assert not _only_head_differs({"missing_keys": [], "unexpected_keys": ["model.extra.weight"]})
