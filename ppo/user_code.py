"""User code: the functions and classes a run names in its config (``reward.custom_function``,
``rollout.multi_turn.env``), loaded from a module or a file, and the time limit that contains a call to
them in the trainer's process. Standard library only: a reward worker (``ppo.reward_worker``) loads the
user's function without torch.

    fn = load_user_object("my_rewards.py:score", key="reward.custom_function", default_name="compute_score")
    with time_limit(5.0):        # CallTimedOut (a BaseException) past 5 s, main thread only
        fn(...)
    with abandoned_on_stop():    # StoppedInUserCode at once when a stop signal comes during the call
        fn(...)

Every failure is a ``UserCodeError`` (or the caller's subclass: ``rule_scoring.RewardError``,
``environments.EnvError``) whose one line names the config key, the file or module and what is wrong.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib
import importlib.util
import re
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class UserCodeError(ValueError):
    """User code named by the config cannot be found, loaded or used; the message says which and why."""


def load_user_object(
    spec: str, *, key: str, default_name: str | None, error: type[UserCodeError] = UserCodeError
) -> Any:
    """Import ``module.path:name`` or ``path/to/file.py:name`` and return the function or class it names
    (``reward.custom_function``, ``rollout.multi_turn.env``); errors name ``key``. Without ``:name`` the
    name is ``default_name`` (None: the name is required).

    Raises ``error`` (a ``UserCodeError``) for a malformed spec, a missing file or module, a missing attribute (with the
    closest names) or an attribute that is not callable. Errors raised by the module's own code while
    it is imported propagate unchanged.
    """
    target, sep, name = spec.rpartition(":")
    if not sep and default_name is not None:
        target, name = spec, default_name
    if not target or not name:
        shapes = "module.path:function or path/to/file.py:function"
        raise error(
            f"{key}={spec!r} must look like {shapes}"
            + (f" (function default: {default_name})" if default_name else "")
        )
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target)
        if not path.is_file():
            raise error(f"{key}={spec!r}: file {path} does not exist")
        # A name that is the same in every process, so objects from the module unpickle on any rank.
        module_name = "ppo_user_code_" + re.sub(r"\W", "_", str(path.resolve()))
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        if module_spec is None or module_spec.loader is None:
            raise error(f"{key}={spec!r}: cannot import {path} as a Python file")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module  # so pickling and dataclasses inside it work
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[module_name]
            raise error(f"{key}={spec!r}: importing {path} raised {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            if e.name is None or not (target == e.name or target.startswith(e.name + ".")):
                raise  # the module exists but one of its own imports is missing
            raise error(f"{key}={spec!r}: no module named {e.name!r} (is it on PYTHONPATH?)") from e
        except Exception as e:
            raise error(f"{key}={spec!r}: importing {target} raised {type(e).__name__}: {e}") from e
    if not hasattr(module, name):
        public = [k for k in vars(module) if not k.startswith("_") and callable(getattr(module, k))]
        close = difflib.get_close_matches(name, public, n=3)
        hint = f"; did you mean {' or '.join(close)}?" if close else f"; it defines {sorted(public)}"
        raise error(f"{key}={spec!r}: {target} has no attribute {name!r}{hint}")
    fn = getattr(module, name)
    if not callable(fn):
        raise error(f"{key}={spec!r}: {target}.{name} is a {type(fn).__name__}, not a function")
    return fn


class CallTimedOut(BaseException):
    """SIGALRM's exception in an in-process reward call past its time limit (not an ``Exception``, so the
    function's own ``except Exception`` cannot swallow it)."""


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise ``CallTimedOut`` in the block after ``seconds`` (wall clock); no limit with None, off the
    main thread (signals reach the main thread only) or where there is no SIGALRM."""
    if (
        seconds is None
        or not hasattr(signal, "setitimer")
        or threading.current_thread() is not threading.main_thread()
    ):
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise CallTimedOut

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class StoppedInUserCode(BaseException):
    """A stop signal (SIGTERM, SIGINT, SIGHUP) came while user code ran in the trainer's process, or before
    a call that was about to start: the call is abandoned (not an ``Exception``, so the function's own
    ``except Exception`` cannot swallow it); its caller ends what it was doing, and the trainer stops at
    its next phase boundary after a checkpoint."""


@dataclasses.dataclass
class _Calls:
    """The user-code calls running in this process's main thread, and whether a stop signal came."""

    running: int = 0
    stopping: bool = False


_CALLS = _Calls()
"""Signals reach a process, not an object: the one record of this process's abandonable calls."""


@contextlib.contextmanager
def abandoned_on_stop() -> Iterator[None]:
    """A call of user code that a stop signal abandons: ``StoppedInUserCode`` at entry when a stop signal
    has come, and during the call the moment one comes (``stop_signal_came``, main thread). A function
    that takes seconds a response then delays a stop by nothing, not by the rest of the batch: Slurm and
    torchrun kill a rank 30 s after SIGTERM. Code blocked in C (not in ``time.sleep``) cannot be
    interrupted in the trainer's process; reward workers (``reward.pool_workers``) can be killed."""
    if _CALLS.stopping:
        raise StoppedInUserCode
    _CALLS.running += 1
    try:
        yield
    finally:
        _CALLS.running -= 1


def stop_signal_came() -> None:
    """Called by the trainer's stop-signal handler (``step_end.StopRequest``), in the main thread: no
    user-code call starts from now on, and one running now is abandoned (``StoppedInUserCode``)."""
    _CALLS.stopping = True
    if _CALLS.running and threading.current_thread() is threading.main_thread():
        raise StoppedInUserCode


def user_calls_allowed() -> None:
    """A new run in this process (``step_end.StopRequest``): user code may run again."""
    _CALLS.stopping = False
