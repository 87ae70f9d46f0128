"""Rule rewards in worker processes with a time limit: a user's reward function that hangs, crashes or
returns something that is not a number can no longer stall or stop a multi-node job.

With ``reward.pool_workers > 0`` each rank scores its responses in that many worker processes, one call
at a time each; a call that runs longer than ``reward.timeout_s`` (its worker is killed and replaced),
raises, or returns a non-number is a failure: ``rewards.rule_scores`` scores it ``reward.error_score``;
``report_call`` (on every rank's results of a call) counts it (``reward/timeouts``, ``reward/errors``),
logs the run's first failing row once, and stops the run only when every response of a call on every
rank failed. ``reward.total_timeout_s`` caps a whole call:
past it, the calls still running are abandoned and the rows not scored yet count as timeouts::

    pool = RewardPool(custom_function="my_rewards.py:score", format_score=0.0, reward_kwargs={},
                      num_workers=4, timeout_s=10.0, error_score=0.0, total_timeout_s=60.0)
    out = pool.score(records, texts, stop=lambda: stop_request.name is not None)
    out.scored                                  # a Score per text, None where the call failed
    metrics = pool.report_call(all_gather_object(out))   # every rank's calls: counts, logs, errors
    pool.close()

A worker is ``python -m ppo.reward_worker`` (see there): a fresh interpreter that imports only the
standard library and ``ppo.rule_scoring``, never torch or the trainer's ``__main__``, so it is ready in a
fraction of a second; it builds the scorer once from plain data (the function's spec, ``format_score``,
``reward_kwargs``). With ``reward.custom_function`` a list, each function of each response is a call of
its own (its own time limit, its failures named ``reward.custom_function[i]=...``), and a response's score
is the ``weighted_score`` of its calls (``reward.weights``); a response with a failed call failed. TRL-style
(batched) functions cannot run here: a worker refuses them at start-up. A worker killed on a timeout is
replaced without waiting: the new one joins when it reports ready, and the other workers go on scoring meanwhile. ``stop`` (checked every ``STOP_POLL_S``)
ends a call at once, its unscored rows abandoned (not failures): the trainer then stops at its next phase
boundary. ``reward.pool_workers=0`` (the default) scores in the trainer's own process, where a failing
function stops the run at once.

16 responses, every 4th hanging, 4 workers, ``reward.timeout_s=1`` (``python -m
ppo_bench.rewards --hang-every 4 --responses 16 --workers 4 --timeout-s 1``): 1.0 s a call, where replacing each timed-out
worker synchronously with a ``spawn``ed child (which imported torch and the trainer's modules) took
24.4 s on the same 2-core machine.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ppo.reward_worker import read_message, write_message
from ppo.rule_scoring import (
    RewardError,
    Score,
    WeightedScore,
    function_labels,
    metric_names,
    scorer_name,
    weighted_score,
)

logger = logging.getLogger("ppo")

if TYPE_CHECKING:
    from ppo.data import PromptRecord

STARTUP_TIMEOUT_S = 300.0
"""How long a new worker may take to start and import the reward function."""
STOP_POLL_S = 0.5
"""How often a call checks ``stop`` while it waits for its workers."""
CLOSE_GRACE_S = 1.0
"""How long ``close`` lets idle workers exit on their own before it kills them."""
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])


@dataclass
class _Worker:
    proc: subprocess.Popen[bytes]
    started: float
    """``time.monotonic()`` when it was started (its start-up limit counts from there)."""
    ready: bool = False
    """Whether it has built its scorer and takes calls."""
    job: tuple[int, int] | None = None
    """The (row, function) it is scoring, None when idle."""
    since: float = 0.0
    """When that call was sent."""


@dataclass
class PoolScores:
    """What ``RewardPool.score`` returns for one call."""

    scored: list[Score | WeightedScore | None]
    """The scorer's result per text (with a list of functions, their ``weighted_score``); None where a
    call failed or was abandoned."""
    timeouts: int = 0
    """Rows whose call ran past ``timeout_s``, or that ``total_timeout_s`` cut (``capped``)."""
    errors: int = 0
    """Rows whose call raised, returned no number, or whose worker died."""
    abandoned: int = 0
    """Rows left unscored because ``stop`` turned true (not failures)."""
    capped: int = 0
    """Of ``timeouts``, the rows ``total_timeout_s`` cut."""
    first: str | None = None
    """The first failing row and why (None without failures)."""


class RewardPool:
    """``num_workers`` processes scoring responses with the rule reward, each call limited to
    ``timeout_s`` seconds and a whole ``score`` call to ``total_timeout_s`` (see the module docstring)."""

    def __init__(
        self,
        *,
        custom_function: str | list[str] | None,
        format_score: float,
        reward_kwargs: dict[str, Any] | None,
        num_workers: int,
        timeout_s: float,
        error_score: float,
        total_timeout_s: float | None = None,
        weights: list[float] | None = None,
    ) -> None:
        self.name = scorer_name(custom_function)
        """What failures are blamed on (``reward.custom_function='r.py:score'``)."""
        self.labels = function_labels(custom_function) if custom_function else [self.name]
        """Each function's own name in failures (``reward.custom_function[1]='b.py:g'`` in a list)."""
        self.listed = isinstance(custom_function, list)
        self.weights = weights if weights is not None else [1.0] * len(self.labels) if self.listed else None
        """The functions' weights where their scores are combined (a list, or ``reward.weights``)."""
        self.names: list[str] = []
        """With a list: each function's metric name (``reward/<name>/mean``), from its ``__name__`` as the
        first worker reports it (this process never imports the functions)."""
        self.timeout_s = timeout_s
        self.total_timeout_s = total_timeout_s
        self.error_score = error_score
        self.setup = {
            "sys_path": list(sys.path),
            "custom_function": custom_function,
            "format_score": format_score,
            "reward_kwargs": dict(reward_kwargs or {}),
            "parent_pid": os.getpid(),
        }
        self.workers: list[_Worker] = []
        self.dying: list[subprocess.Popen[bytes]] = []
        """Killed workers not reaped yet (reaped without waiting, so a kill never blocks a call)."""
        self._failure_logged = False  # the first failure of the run is logged, once
        self._cap_logged = False  # total_timeout_s cutting a call is logged, once
        try:
            self.workers = [self._launch() for _ in range(num_workers)]
            while not all(w.ready for w in self.workers):  # all start together; a call waits for none
                self._wait_and_receive(STARTUP_TIMEOUT_S, {}, None)
        except BaseException:
            self.close()
            raise

    def _launch(self) -> _Worker:
        """Start a worker; it joins the pool when it reports ready (``_receive``)."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([_PACKAGE_ROOT, *filter(None, [env.get("PYTHONPATH")])])
        proc = subprocess.Popen(
            [sys.executable, "-m", "ppo.reward_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            env=env,
        )
        worker = _Worker(proc=proc, started=time.monotonic())
        try:
            write_message(proc.stdin, self.setup)  # type: ignore[arg-type]
        except OSError:  # it died at once: _receive reads its EOF
            pass
        return worker

    def score(
        self, records: list[PromptRecord], texts: list[str], stop: Callable[[], bool] | None = None
    ) -> PoolScores:
        """The scorer's result for each of ``texts`` against its record, with this rank's counts of
        timeouts, errors and abandoned rows. ``stop`` (local: this rank's stop request) is checked every
        ``STOP_POLL_S``; when it turns true the call returns at once, its unscored rows abandoned."""
        cap = time.monotonic() + self.total_timeout_s if self.total_timeout_s is not None else math.inf
        # One call per (response, function): each function's call has its own time limit and blame.
        todo = deque((row, fn) for row in range(len(texts)) for fn in range(len(self.labels)))
        results: dict[tuple[int, int], tuple[str, Any]] = {}
        while todo or any(w.job is not None for w in self.workers):
            for w in self.workers:
                if w.ready and w.job is None and todo:
                    self._send(w, todo.popleft(), records, texts, todo)
            now = time.monotonic()
            deadlines = [cap] + [w.since + self.timeout_s for w in self.workers if w.job is not None]
            wait_s = max(0.0, min(deadlines) - now)
            if stop is not None:
                wait_s = min(wait_s, STOP_POLL_S)
            self._wait_and_receive(wait_s, results, stop)
            now = time.monotonic()
            for w in self.workers:
                if w.job is not None and now - w.since >= self.timeout_s:
                    who = f"{self.labels[w.job[1]]} " if self.listed else ""
                    results[w.job] = ("timeout", f"{who}ran longer than reward.timeout_s={self.timeout_s}")
                    self._replace(w)
            if stop is not None and stop():
                self._abandon(todo, results, "abandoned", "the run is stopping")
                break
            if now >= cap:
                self._abandon(
                    todo, results, "capped", f"cut by reward.total_timeout_s={self.total_timeout_s}"
                )
                break
        self._reap()
        return self._summary(records, results, len(texts))

    def _send(
        self,
        w: _Worker,
        job: tuple[int, int],
        records: list[PromptRecord],
        texts: list[str],
        todo: deque[tuple[int, int]],
    ) -> None:
        (row, fn), r = job, records[job[0]]
        try:
            write_message(w.proc.stdin, (fn, r.data_source, texts[row], r.ground_truth, r.extra_info))  # type: ignore[arg-type]
        except OSError:  # it died while idle: the job goes to another worker
            todo.appendleft(job)
            self._replace(w)
            return
        w.job, w.since = job, time.monotonic()

    def _wait_and_receive(
        self, wait_s: float, results: dict[tuple[int, int], tuple[str, Any]], stop: Callable[[], bool] | None
    ) -> None:
        """Wait up to ``wait_s`` for any worker's message or exit and take it in; a worker that is not
        ready by its start-up limit, or fails to start, is a RewardError."""
        by_pipe = {w.proc.stdout: w for w in self.workers}
        now = time.monotonic()
        starting = [w.started + STARTUP_TIMEOUT_S for w in self.workers if not w.ready]
        wait_s = min([wait_s, *(max(0.0, t - now) for t in starting)])
        for pipe in wait(list(by_pipe), timeout=wait_s):
            self._receive(by_pipe[pipe], results, stop)  # type: ignore[index]
        now = time.monotonic()
        for w in self.workers:
            if not w.ready and now - w.started >= STARTUP_TIMEOUT_S:
                raise RewardError(
                    f"a reward worker for {self.name} did not start within {STARTUP_TIMEOUT_S:g} s "
                    "(importing the function took that long)"
                )

    def _receive(
        self, w: _Worker, results: dict[tuple[int, int], tuple[str, Any]], stop: Callable[[], bool] | None
    ) -> None:
        try:
            message = read_message(w.proc.stdout)  # type: ignore[arg-type]
        except EOFError:  # it exited: crashed in the function, killed by a signal, or failed to start
            stopping = stop is not None and stop()
            if not w.ready and not stopping:
                reason = self._exit_reason(w)
                raise RewardError(f"a reward worker for {self.name} did not start: {reason}") from None
            if w.job is not None:
                died = "the reward worker died" + (f" in {self.labels[w.job[1]]}" if self.listed else "")
                results[w.job] = ("abandoned", "") if stopping else ("error", died)
            self._replace(w)
            return
        kind, value = message
        if kind == "failed":
            raise RewardError(f"a reward worker could not start: {value}")
        if kind == "ready":
            w.ready = True
            if self.listed and not self.names:
                self.names = metric_names(value)
        elif w.job is not None:
            results[w.job] = message
            w.job = None

    def _exit_reason(self, w: _Worker) -> str:
        try:
            code = w.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "it closed its output"
        if code < 0:
            return f"it was killed by {signal.Signals(-code).name}"
        return f"it exited with code {code} while importing the function (its output is above)"

    def _abandon(
        self,
        todo: deque[tuple[int, int]],
        results: dict[tuple[int, int], tuple[str, Any]],
        status: str,
        reason: str,
    ) -> None:
        """Give up the rows not scored yet: the calls still running (their workers replaced) and ``todo``."""
        for w in self.workers:
            if w.job is not None:
                results[w.job] = (status, reason)
                self._replace(w)
        while todo:
            results[todo.popleft()] = (status, reason)

    def _replace(self, w: _Worker) -> None:
        """Kill worker ``w`` (stuck in a call, or dead) and start a fresh one in its place, without
        waiting for either."""
        w.proc.kill()
        for pipe in (w.proc.stdin, w.proc.stdout):
            if pipe is not None:
                pipe.close()
        self.dying.append(w.proc)
        self.workers[self.workers.index(w)] = self._launch()

    def _reap(self) -> None:
        self.dying = [p for p in self.dying if p.poll() is None]

    def _summary(
        self, records: list[PromptRecord], results: dict[tuple[int, int], tuple[str, Any]], n: int
    ) -> PoolScores:
        """Each row's result from its functions' calls (their ``weighted_score`` with several); a row
        with a failed call failed, as the first failed call says (abandoned if any call was)."""
        out = PoolScores(scored=[])
        for row in range(n):
            calls = [results[(row, fn)] for fn in range(len(self.labels))]
            failed = [call for call in calls if call[0] != "ok"]
            if not failed:  # NaN and inf pass: the trainer skips the step
                parts = [value for _, value in calls]
                out.scored.append(
                    weighted_score(parts, self.weights) if self.weights is not None else parts[0]
                )
                continue
            out.scored.append(None)
            status, value = next((call for call in failed if call[0] == "abandoned"), failed[0])
            if status == "capped":
                out.capped += 1
                status = "timeout"
            if status == "abandoned":
                out.abandoned += 1
                continue
            if status == "timeout":
                out.timeouts += 1
            else:
                out.errors += 1
            out.first = out.first or f"prompt row {records[row].index} ({records[row].data_source}): {value}"
        return out

    def report_call(self, calls: list[PoolScores]) -> dict[str, float]:
        """What one scoring call on every rank (``calls[r]``: rank r's ``score`` result) comes to: the
        first failure of the run and the first call ``total_timeout_s`` cut are logged (once each), and
        ``reward/timeouts``, ``reward/errors`` are returned (sums over ranks). A call in which every row
        of every rank failed, with none abandoned to a stop request, is a RewardError: nothing to train on.
        """
        timeouts, errors, abandoned, capped = (
            sum(getattr(c, key) for c in calls) for key in ("timeouts", "errors", "abandoned", "capped")
        )
        rows = sum(len(c.scored) for c in calls)
        failures = [f"rank {i}, {c.first}" for i, c in enumerate(calls) if c.first is not None]
        if failures and not self._failure_logged:
            logger.warning("%s failed (scored %s; logged once): %s", self.name, self.error_score, failures[0])
            self._failure_logged = True
        if capped and not self._cap_logged:
            logger.warning(
                "reward.total_timeout_s=%s cut a scoring call (a step's, a validation's or the start-up "
                "check's): %d of its %d responses were not scored in time (scored %s, counted in "
                "reward/timeouts; logged once)",
                self.total_timeout_s,
                capped,
                rows,
                self.error_score,
            )
            self._cap_logged = True
        if rows and not abandoned and timeouts + errors == rows:
            raise RewardError(
                f"{self.name} failed on every one of the {rows} responses on all ranks (e.g. {failures[0]}); "
                "nothing to train on"
            )
        return {"reward/timeouts": float(timeouts), "reward/errors": float(errors)}

    def close(self) -> None:
        """End every worker: idle ones get EOF and ``CLOSE_GRACE_S`` to exit, the rest are killed; never
        waits on a hung call."""
        for w in self.workers:
            if w.job is not None or not w.ready:
                w.proc.kill()
            if w.proc.stdin is not None:
                try:
                    w.proc.stdin.close()
                except OSError:
                    pass
        deadline = time.monotonic() + CLOSE_GRACE_S
        for proc in [w.proc for w in self.workers] + self.dying:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                try:
                    proc.wait(timeout=CLOSE_GRACE_S)
                except subprocess.TimeoutExpired:
                    pass
            if proc.stdout is not None:
                proc.stdout.close()
        self.workers, self.dying = [], []
