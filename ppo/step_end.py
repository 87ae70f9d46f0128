"""How a PPO step, or the whole run, ends before its time: the two exceptions the loop's phases raise,
the stop signal the loop asks at its phase boundaries, and the time cap.

``EndStep("skip", "non-finite reward")`` ends one step (``train_ppo.end_step`` handles every kind);
``TrainingError("KL exploded again after every rollback")`` ends the run (exit code 2, one line on rank 0);
``StopRequest().requested()`` and ``out_of_time(start, trainer.max_time_s)`` end it after a checkpoint.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass
from typing import Literal

from ppo.distributed import all_reduce_scalar

logger = logging.getLogger("ppo")


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. KL exploded again after every rollback); the message says why."""


@dataclass
class EndStep(Exception):
    """Raised at a boundary of a step that cannot or must not go on; ``train_ppo.end_step`` handles every
    kind: ``stop`` (a stop signal), ``rollback`` (back to the last checkpoint), ``skip`` (nothing updated)."""

    kind: Literal["stop", "rollback", "skip"]
    reason: str


class StopRequest:
    """SIGTERM (Slurm preemption, torchrun's shutdown), SIGINT (Ctrl-C) and SIGHUP (a closed terminal)
    ask the run to stop.

    The loop asks ``requested()`` at its phase boundaries (all ranks agree: one all-reduce): after the
    rollout, between the scoring forwards, between validation chunks and at the end of the step; it
    saves the last complete step before it exits, within the seconds torchrun and Slurm grant between
    SIGTERM and SIGKILL (30 s by default). A second Ctrl-C stops at once (``runner.main`` exits quietly
    with 130; the last checkpoint is intact: saves are atomic).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    """Slurm's preemption and torchrun's shutdown, Ctrl-C, a closed terminal or dropped ssh session."""

    def __init__(self) -> None:
        self.name: str | None = None
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                signal.signal(signum, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        if signum == signal.SIGINT and self.name is not None:
            raise KeyboardInterrupt
        self.name = signal.Signals(signum).name
        logger.warning("%s received: stopping at the next phase boundary, after a checkpoint", self.name)

    def requested(self) -> bool:
        """Whether any rank received a stop signal (collective)."""
        return all_reduce_scalar(float(self.name is not None), "max") > 0


def out_of_time(start: float, max_time_s: float) -> bool:
    """Whether ``trainer.max_time_s`` has passed on any rank (all ranks agree; no-op when 0)."""
    if max_time_s <= 0:
        return False
    return bool(all_reduce_scalar(float(time.perf_counter() - start > max_time_s), "max"))
