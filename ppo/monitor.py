"""Health warnings: the signs of a run going wrong that users of RLHF trainers learn to watch for.

Each warning fires once per occurrence (when its condition becomes true, not on every step while it
holds), in the log and as a ``warn/<name>`` metric equal to 1 on that step:

- ``warn/low_entropy``: ``actor/entropy`` below ``trainer.warn_entropy_below`` (mode collapse);
- ``warn/kl_above_target``: the in-reward KL above the adaptive controller's target for
  ``KL_PATIENCE`` steps in a row (the coefficient cannot hold the policy);
- ``warn/reward_swing``: ``critic/score/mean`` more than 25% (relative) away from its recent average
  (a sign of reward hacking or instability; one batch's noise against the previous batch fired too
  often on small batches);
- ``warn/length_pinned``: the mean response length at the maximum (responses never end).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ppo.config import PPOConfig

logger = logging.getLogger("ppo")

KL_PATIENCE = 5
"""Steps in a row above target before ``warn/kl_above_target`` fires."""
REWARD_SWING = 0.25
"""Relative distance of the mean score from its recent average that counts as a swing."""
SWING_MEMORY = 0.7
"""The recent average: ``avg <- SWING_MEMORY * avg + (1 - SWING_MEMORY) * score`` (about 3 steps)."""
SWING_WARMUP = 5
"""Steps of history before the swing warning can fire (a single batch's score is noisy)."""


@dataclass(kw_only=True)
class HealthMonitor:
    """Watches each step's reduced metrics; ``check`` returns the warnings that fire now."""

    cfg: PPOConfig
    active: set[str] = field(default_factory=set)
    kl_steps_above: int = 0
    score_avg: float | None = None
    score_steps: int = 0

    def check(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        conditions = {
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
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.active = set(state["active"])
        self.kl_steps_above = int(state["kl_steps_above"])
        self.score_avg = state["score_avg"]
        self.score_steps = int(state["score_steps"])

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
}
