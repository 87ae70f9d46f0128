"""Rule rewards in worker processes with a time limit: a user's reward function that hangs, crashes or
returns something that is not a number can no longer stall or stop a multi-node job.

With ``reward.pool_workers > 0`` each rank scores its responses in that many worker processes, one call
at a time each; a call that runs longer than ``reward.timeout_s`` (its worker is killed and replaced),
raises, or returns a non-number is a failure: ``rewards.rule_scores`` scores it ``reward.error_score``,
counts it (``reward/timeouts``, ``reward/errors``) and stops the run only when every response of a call on
every rank failed; the first failing row is logged once::

    pool = RewardPool(functools.partial(make_rule_scorer, "my_rewards.py:score", 0.0, {}), name="...",
                      num_workers=4, timeout_s=10.0, error_score=0.0)
    scored, timeouts, errors, first = pool.score(records, texts)    # scored[i] None where the call failed
    pool.close()

Workers start with the ``spawn`` method (a clean interpreter: no copy of the trainer's threads, process
group or CUDA state) and build the scorer once (``make_scorer``, a picklable function of no arguments).
``reward.pool_workers=0`` (the default) scores in the trainer's own process, where a failing function stops
the run at once.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from ppo.data import PromptRecord

STARTUP_TIMEOUT_S = 300
"""How long a new worker may take to start and import the reward function."""


def _serve(conn: Connection, make_scorer: Callable[[], Callable[..., Any]]) -> None:
    """A worker: build the scorer once, then score one ``(data_source, text, truth, extra)`` at a time,
    answering ``("ok", result)`` or ``("error", message)``; ``None`` ends it."""
    scorer = make_scorer()
    conn.send(("ready", None))
    while (job := conn.recv()) is not None:
        try:
            answer = ("ok", scorer(*job))
        except Exception as e:  # the user's function: any failure becomes a counted error score
            answer = ("error", str(e)[:300])
        except SystemExit as e:  # sys.exit() in the function, if the scorer let it through
            answer = ("error", f"the reward function called sys.exit({e.code!r})")
        conn.send(answer)


class RewardPool:
    """``num_workers`` processes scoring responses with the rule reward, each call limited to
    ``timeout_s`` seconds (see the module docstring)."""

    def __init__(
        self,
        make_scorer: Callable[[], Callable[..., Any]],
        *,
        name: str,
        num_workers: int,
        timeout_s: float,
        error_score: float,
    ) -> None:
        self.make_scorer = make_scorer
        self.name = name
        """What failures are blamed on (``reward.custom_function='r.py:score'``)."""
        self.timeout_s = timeout_s
        self.error_score = error_score
        self.context = multiprocessing.get_context("spawn")
        self.workers = [self._start() for _ in range(num_workers)]
        self.logged = False
        """Whether a failure has been logged (``rewards.rule_scores`` logs the first of the run)."""

    def _start(self) -> tuple[Any, Connection]:
        """A worker that has imported the reward function (a call's time limit starts after that)."""
        mine, theirs = self.context.Pipe()
        proc = self.context.Process(target=_serve, args=(theirs, self.make_scorer), daemon=True)
        proc.start()
        theirs.close()
        try:
            ready = mine.poll(STARTUP_TIMEOUT_S) and mine.recv() == ("ready", None)
        except EOFError:  # it died while importing
            ready = False
        if not ready:
            proc.kill()
            raise RuntimeError(f"a reward worker for {self.name} did not start within {STARTUP_TIMEOUT_S} s")
        return proc, mine

    def score(self, records: list[PromptRecord], texts: list[str]) -> tuple[list[Any], int, int, str | None]:
        """The scorer's result for each of ``texts`` against its record (None where the call failed),
        this rank's numbers of timeouts and errors, and its first failing row (None without failures)."""
        todo = list(range(len(texts)))[::-1]
        results: dict[int, tuple[str, Any]] = {}
        busy: dict[int, tuple[int, float]] = {}  # worker -> (row, start time)
        while todo or busy:
            for w in range(len(self.workers)):
                if w not in busy and todo:
                    row = todo.pop()
                    r = records[row]
                    self.workers[w][1].send((r.data_source, texts[row], r.ground_truth, r.extra_info))
                    busy[w] = (row, time.monotonic())
            oldest = min(start for _, start in busy.values())
            ready = wait(
                [self.workers[w][1] for w in busy],
                timeout=max(0.0, oldest + self.timeout_s - time.monotonic()),
            )
            for w in list(busy):
                row, start = busy[w]
                conn = self.workers[w][1]
                if conn in ready:
                    try:
                        results[row] = conn.recv()
                    except EOFError:  # the worker died (the function crashed the interpreter)
                        results[row] = ("error", "the reward worker died")
                        self._replace(w)
                    del busy[w]
                elif time.monotonic() - start >= self.timeout_s:
                    results[row] = ("timeout", f"ran longer than reward.timeout_s={self.timeout_s}")
                    self._replace(w)
                    del busy[w]
        scored: list[Any] = []
        timeouts = errors = 0
        first = None
        for row in range(len(texts)):
            status, value = results[row]
            if status == "ok":
                scored.append(value)  # NaN and inf pass through: the trainer skips such a step
                continue
            timeouts, errors = (timeouts + 1, errors) if status == "timeout" else (timeouts, errors + 1)
            scored.append(None)
            first = first or f"prompt row {records[row].index} ({records[row].data_source}): {value}"
        return scored, timeouts, errors, first

    def _replace(self, w: int) -> None:
        """Kill worker ``w`` (stuck in a call, or dead) and start a fresh one in its place."""
        proc, conn = self.workers[w]
        proc.kill()
        proc.join(timeout=5)
        conn.close()
        self.workers[w] = self._start()

    def close(self) -> None:
        for proc, conn in self.workers:
            try:
                conn.send(None)
            except OSError:
                pass
            proc.join(timeout=1)
            if proc.is_alive():
                proc.kill()
