"""Health warnings: the signs of a run going wrong that users of RLHF trainers learn to watch for.

Each warning fires once per occurrence (when its condition becomes true, not on every step while it
holds), in the log and as a ``warn/<name>`` metric equal to 1 on that step:

- ``warn/low_entropy``: ``actor/entropy`` below ``trainer.warn_entropy_below`` (mode collapse);
- ``warn/kl_above_target``: the in-reward KL above the adaptive controller's target for
  ``KL_PATIENCE`` steps in a row (the coefficient cannot hold the policy);
- ``warn/reward_swing``: ``critic/score/mean`` more than 25% (relative) away from its recent average
  (a sign of reward hacking or instability; one batch's noise against the previous batch fired too
  often on small batches);
- ``warn/length_pinned``: the mean response length at the maximum (responses never end);
- ``warn/zero_rewards``: every response of the first ``ZERO_REWARD_STEPS`` steps scored exactly 0 (the
  reward function never matches: a wrong ground-truth column, an answer format the model does not
  write); with all scores equal every advantage is 0 and nothing is learned.

``run_summary`` is the run's last console lines: steps done, wall time, the final validation score (or,
when none ran at the end, the last one and its step) and where the last checkpoint and the exported
model are.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from ppo.checkpoint_files import checkpoints_dir
from ppo.config import PPOConfig
from ppo.metrics import MetricsLogger

logger = logging.getLogger("ppo")

KL_PATIENCE = 5
"""Steps in a row above target before ``warn/kl_above_target`` fires."""
REWARD_SWING = 0.25
"""Relative distance of the mean score from its recent average that counts as a swing."""
SWING_MEMORY = 0.7
"""The recent average: ``avg <- SWING_MEMORY * avg + (1 - SWING_MEMORY) * score`` (about 3 steps)."""
SWING_WARMUP = 5
"""Steps of history before the swing warning can fire (a single batch's score is noisy)."""
ZERO_REWARD_STEPS = 3
"""Steps from the start with every score exactly 0 before ``warn/zero_rewards`` fires."""


@dataclass(kw_only=True)
class HealthMonitor:
    """Watches each step's reduced metrics; ``check`` returns the warnings that fire now."""

    cfg: PPOConfig
    active: set[str] = field(default_factory=set)
    kl_steps_above: int = 0
    score_avg: float | None = None
    score_steps: int = 0
    zero_score_steps: int = 0
    """Steps from the start whose scores were all 0; -1 once a step scored anything else."""

    def check(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        conditions = {
            "zero_rewards": self._zero_rewards(metrics),
            "low_entropy": self.cfg.trainer.warn_entropy_below > 0
            and metrics.get("actor/entropy", float("inf")) < self.cfg.trainer.warn_entropy_below,
            "kl_above_target": self._kl_above_target(metrics),
            "reward_swing": self._reward_swing(metrics),
            "length_pinned": metrics.get("response_length/mean", 0.0) >= self.cfg.data.max_response_length,
        }
        fired = {}
        for name, on in conditions.items():
            if on and name not in self.active:
                fired[f"warn/{name}"] = 1.0
                logger.warning("step %d: %s", step, _MESSAGES[name])
            if on:
                self.active.add(name)
            else:
                self.active.discard(name)
        return fired

    def state_dict(self) -> dict[str, object]:
        """What the warnings remember between steps (checkpointed, so a resumed run warns alike)."""
        return {
            "active": sorted(self.active),
            "kl_steps_above": self.kl_steps_above,
            "score_avg": self.score_avg,
            "score_steps": self.score_steps,
            "zero_score_steps": self.zero_score_steps,
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.active = set(state["active"])
        self.kl_steps_above = int(state["kl_steps_above"])
        self.score_avg = state["score_avg"]
        self.score_steps = int(state["score_steps"])
        # absent from checkpoints written before the warning existed: those runs are past their start
        self.zero_score_steps = int(state.get("zero_score_steps", -1))

    def _zero_rewards(self, metrics: dict[str, float]) -> bool:
        low, high = metrics.get("critic/score/min"), metrics.get("critic/score/max")
        if low is None or high is None or self.zero_score_steps < 0:
            return False
        if low != 0.0 or high != 0.0:
            self.zero_score_steps = -1
            return False
        self.zero_score_steps += 1
        return self.zero_score_steps == ZERO_REWARD_STEPS

    def _kl_above_target(self, metrics: dict[str, float]) -> bool:
        kl = metrics.get("actor/reward_kl_penalty")
        if kl is None or self.cfg.algorithm.kl_ctrl.type != "adaptive":
            return False
        self.kl_steps_above = self.kl_steps_above + 1 if kl > self.cfg.algorithm.kl_ctrl.target_kl else 0
        return self.kl_steps_above >= KL_PATIENCE

    def _reward_swing(self, metrics: dict[str, float]) -> bool:
        score = metrics.get("critic/score/mean")
        if score is None:
            return False
        avg = self.score_avg
        swing = (
            self.score_steps >= SWING_WARMUP
            and avg is not None
            and abs(avg) > 1e-8
            and abs(score - avg) > REWARD_SWING * abs(avg)
        )
        self.score_avg = score if avg is None else SWING_MEMORY * avg + (1 - SWING_MEMORY) * score
        self.score_steps += 1
        return swing


_MESSAGES = {
    "low_entropy": "policy entropy fell below trainer.warn_entropy_below: the policy may be collapsing",
    "kl_above_target": f"the in-reward KL stayed above algorithm.kl_ctrl.target_kl for {KL_PATIENCE} steps: "
    "raise kl_coef or lower the learning rate",
    "reward_swing": f"the mean score is more than {REWARD_SWING:.0%} away from its recent average: check "
    "for reward hacking or instability",
    "length_pinned": "the mean response length is at data.max_response_length: responses do not end",
    "zero_rewards": f"every response of the first {ZERO_REWARD_STEPS} steps scored 0: the reward function "
    "never matches (check the ground truth it gets and the answer format it expects); equal scores give "
    "zero advantages and nothing is learned",
}


def run_summary(
    *,
    steps_done: int,
    total_steps: int,
    steps_this_run: int,
    wall_s: float,
    metrics: dict[str, float],
    checkpoint: Path | None,
    hf_dir: Path | None,
    stopped: str | None = None,
    val_step: int | None = None,
) -> list[str]:
    """The end-of-run lines (rank 0 logs them): steps done of planned (and this process's share), wall
    time, why it stopped early if it did, the last validation score (``val/score``, or the validation
    metrics a stage logs: ``metrics``, logged at step ``val_step``; None: at the end), said to be from an
    earlier step when no validation ran at the end, and where the last checkpoint and the exported model
    are."""
    state = f"stopped early ({stopped})" if stopped else "done"
    lines = [
        f"run {state}: step {steps_done} of {total_steps} ({steps_this_run} in this process, "
        f"{_duration(wall_s)})"
    ]
    val = {k: v for k, v in sorted(metrics.items()) if k == "val/score" or k.startswith(("val/", "rm/val"))}
    if "val/score" in val:
        val = {"val/score": val["val/score"]}
    scores = " ".join(f"{k}={v:.4g}" for k, v in list(val.items())[:4])
    if val and (val_step is None or val_step == steps_done):
        lines.append(f"final validation: {scores}")
    elif val:
        lines.append(
            f"final validation: none ran at step {steps_done}; the last, at step {val_step}: {scores}"
        )
    lines.append(f"last checkpoint: {checkpoint if checkpoint is not None else 'none written'}")
    if hf_dir is not None:
        lines.append(f"exported model (save_pretrained): {hf_dir}")
    return lines


def _duration(seconds: float) -> str:
    """``1h02m`` / ``3m05s`` / ``12s``."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def log_run_summary(
    out_dir: Path,
    metrics_logger: MetricsLogger,
    *,
    steps_done: int,
    stopped: str | None,
    hf_dir: Path | None,
) -> None:
    """Log ``run_summary``'s lines on rank 0 at the end of a run: ``steps_done`` of the run's total, of
    which this process did those after ``metrics_logger``'s resume step, the time since the logger opened
    (the training loop), the last ``val/*`` numbers of ``metrics.jsonl``, the checkpoint that
    ``checkpoints/latest`` names and ``hf_dir`` when it was written."""
    if not metrics_logger.is_main:
        return
    rows = _metric_rows(out_dir / "metrics.jsonl")
    last_val: dict[str, float] = {}
    val_step = None
    for row in rows:
        val = {k: v for k, v in row.items() if k.startswith("val/") and isinstance(v, (int, float))}
        if val:
            last_val, val_step = val, row.get("step")
    latest = checkpoints_dir(out_dir) / "latest"
    checkpoint = latest.parent / latest.read_text().strip() if latest.is_file() else None
    lines = run_summary(
        steps_done=steps_done,
        total_steps=metrics_logger.total_steps,
        steps_this_run=max(steps_done - metrics_logger.first_step, 0),
        wall_s=time.perf_counter() - metrics_logger.start,
        metrics=last_val,
        checkpoint=checkpoint,
        hf_dir=hf_dir if hf_dir is not None and hf_dir.is_dir() else None,
        stopped=stopped,
        val_step=val_step,
    )
    for line in lines:
        logger.info("%s", line)


def _metric_rows(path: Path) -> list[dict[str, float]]:
    """The rows of a ``metrics.jsonl`` ([] when absent; a torn last line is skipped)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            rows.append(json.loads(line))
    return rows
