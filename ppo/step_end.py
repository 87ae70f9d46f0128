"""How a PPO step, or the whole run, ends before its time: the two exceptions the loop's phases raise.

``EndStep("skip", "non-finite reward")`` ends one step (``train_ppo.end_step`` handles every kind);
``TrainingError("KL exploded again after every rollback")`` ends the run (exit code 2, one line on rank 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. KL exploded again after every rollback); the message says why."""


@dataclass
class EndStep(Exception):
    """Raised at a boundary of a step that cannot or must not go on; ``train_ppo.end_step`` handles every
    kind: ``stop`` (a stop signal), ``rollback`` (back to the last checkpoint), ``skip`` (nothing updated)."""

    kind: Literal["stop", "rollback", "skip"]
    reason: str
