"""The user's multi-turn environment class (``rollout.multi_turn.env``): loaded and checked without torch,
so ``--print-config`` and the trainer's start-up (``multi_turn.make_settings``) refuse the same classes in
the same words, and every call into it (``__init__``, ``reset``, ``step``) runs under the same time limit::

    env_class = check_environment("my_env.py:Calc", timeout_s=30.0)   # EnvError: one line naming the key
    envs = make_environments(env_class, rows=[0, 1], timeout_s=30.0)  # one instance per trajectory

A class must have ``reset(row)`` and ``step(action_text)`` methods and be instantiable with no arguments
(one instance per trajectory; ``reset`` gets the prompt's row). A call into the class runs on a daemon
thread (``call_all``) that the caller waits for at most ``rollout.multi_turn.step_timeout_s``: a stuck
``__init__`` is named rather than hanging the start-up check or the run, and the stuck call is abandoned.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from ppo.user_code import UserCodeError, load_user_object

TIMEOUT_KEY = "rollout.multi_turn.step_timeout_s"
"""The key of the time limit on every call into the environment (its constructor, ``reset``, ``step``)."""


class EnvError(UserCodeError):
    """The environment class cannot be loaded, or a call returned something the loop cannot use."""


def load_environment(spec: str) -> type:
    """The environment class of ``rollout.multi_turn.env`` (``file.py:Class`` or ``module:Class``), checked
    for ``reset`` and ``step`` methods; EnvError (one line naming the key) otherwise."""
    cls = load_user_object(spec, key="rollout.multi_turn.env", default_name=None, error=EnvError)
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if not isinstance(cls, type) or missing:
        raise EnvError(
            f"rollout.multi_turn.env={spec!r} must be a class with reset(row) and step(action_text) methods"
            + (f"; it has no {', '.join(missing)}" if missing else "")
        )
    return cls


def check_environment(spec: str, timeout_s: float) -> type:
    """``load_environment``, and one instance made with no arguments within ``timeout_s``
    (``rollout.multi_turn.step_timeout_s``), as the turn loop makes one per trajectory: an ``__init__`` that
    raises, needs arguments or runs longer is an EnvError naming it (a stuck one is abandoned, never a
    hang)."""
    env_class = load_environment(spec)
    name = env_class.__name__
    status, error = call_all([env_class], timeout_s)[0]
    if status == "timeout":
        raise EnvError(
            f"rollout.multi_turn.env={spec!r}: {name}() ran longer than {TIMEOUT_KEY}={timeout_s} (the start-up "
            f"check makes one instance with no arguments, as the turn loop makes one per trajectory; make "
            f"__init__ return sooner or raise {TIMEOUT_KEY})"
        )
    if status == "error":
        raise EnvError(
            f"rollout.multi_turn.env={spec!r}: {name}() raised {type(error).__name__}: {error} "
            "(the class is instantiated with no arguments, one per trajectory; reset(row) gets the row)"
        )
    return env_class


def make_environments(env_class: type, rows: list[int], timeout_s: float) -> list[Any]:
    """One instance of ``env_class`` per trajectory, made with no arguments, one after another (a class
    that counts or shares its instances sees them in row order), each within ``timeout_s``; ``rows`` are
    the trajectories' prompt rows, for messages. An instance that raises (``sys.exit`` included) or runs
    longer is an EnvError naming the class and the row, as ``reset`` and ``step`` are."""
    name = env_class.__name__
    envs = []
    for row in rows:
        status, result = call_all([env_class], timeout_s)[0]
        if status == "timeout":
            raise EnvError(f"{name}() ran longer than {TIMEOUT_KEY}={timeout_s} (prompt row {row})")
        if status == "error":
            raise EnvError(f"{name}() raised {type(result).__name__}: {result} (prompt row {row})")
        envs.append(result)
    return envs


def call_all(calls: list[Callable[[], Any]], timeout_s: float) -> list[tuple[str, Any]]:
    """Run the user's ``calls`` concurrently, one daemon thread each (a stuck call runs on, abandoned, and
    does not keep the process alive), under one deadline ``timeout_s`` from now: ``("ok", result)``,
    ``("error", exception)`` (anything raised, ``SystemExit`` included) or ``("timeout", None)`` each."""
    answers: list[queue.Queue] = [queue.Queue(maxsize=1) for _ in calls]

    def run(fn: Callable[[], Any], answer: queue.Queue) -> None:
        try:
            answer.put(("ok", fn()))
        except BaseException as e:  # handed to the caller, which names the class and the row
            answer.put(("error", e))

    for fn, answer in zip(calls, answers, strict=True):
        threading.Thread(target=run, args=(fn, answer), daemon=True, name="multi_turn.env").start()
    deadline = time.monotonic() + timeout_s
    results = []
    for answer in answers:
        try:
            results.append(answer.get(timeout=max(0.0, deadline - time.monotonic())))
        except queue.Empty:
            results.append(("timeout", None))
    return results
