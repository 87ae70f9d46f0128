"""How a PPO step, or the whole run, ends before its time: the two exceptions the loop's phases raise,
the stop signal the loop asks at its phase boundaries, and the time cap.

``EndStep("skip", "non-finite reward")`` ends one step (``train_ppo.end_step`` handles every kind);
``TrainingError("KL exploded again after every rollback")`` ends the run (exit code 2, one line on rank 0);
``StopRequest().requested()`` and ``out_of_time(start, trainer.max_time_s)`` end it after a checkpoint.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Literal

from ppo.distributed import all_reduce_scalar
from ppo.user_code import stop_signal_came, user_calls_allowed

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
    rollout, between the scoring forwards, between validation chunks and at the end of the step. A reward
    function running in the trainer's process is abandoned at once (``user_code.abandoned_on_stop``): the
    step's scores are not used, and the step ends at the next boundary. It
    saves the last complete step before it exits, within the seconds torchrun and Slurm grant between
    SIGTERM and SIGKILL (30 s by default), and the rank exits 0. A second Ctrl-C stops at once
    (``runner.main`` exits quietly with 130; the last checkpoint is intact: saves are atomic).

    Under torchrun one Ctrl-C reaches a rank twice: from the terminal (the whole foreground process
    group) and from torchrun, which forwards the SIGINT it got to its workers at once. A SIGINT within
    ``duplicate_s`` of the first is that copy, not a second Ctrl-C (``torchrun_duplicate_s``).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    """Slurm's preemption and torchrun's shutdown, Ctrl-C, a closed terminal or dropped ssh session."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.duplicate_s = torchrun_duplicate_s()
        """Seconds after the first stop signal in which a SIGINT is taken as its copy."""
        self.first_at = 0.0
        user_calls_allowed()
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                signal.signal(signum, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        if self.name is not None:
            if signum == signal.SIGINT and time.monotonic() - self.first_at >= self.duplicate_s:
                raise KeyboardInterrupt
            return  # a copy of the first (torchrun's forward), or another stop signal: already stopping
        self.first_at = time.monotonic()
        self.name = signal.Signals(signum).name
        logger.warning("%s received: stopping at the next phase boundary, after a checkpoint", self.name)
        stop_signal_came()  # a reward function running in this process now is abandoned

    def requested(self) -> bool:
        """Whether any rank received a stop signal (collective)."""
        return all_reduce_scalar(float(self.name is not None), "max") > 0


def torchrun_duplicate_s() -> float:
    """2 s under torchrun (``TORCHELASTIC_RUN_ID`` set), whose forward of the terminal's SIGINT follows
    it within milliseconds; 0 otherwise, where each Ctrl-C arrives once."""
    return 2.0 if "TORCHELASTIC_RUN_ID" in os.environ else 0.0


def out_of_time(start: float, max_time_s: float) -> bool:
    """Whether ``trainer.max_time_s`` has passed on any rank (all ranks agree; no-op when 0)."""
    if max_time_s <= 0:
        return False
    return bool(all_reduce_scalar(float(time.perf_counter() - start > max_time_s), "max"))
