"""One reward worker of ``ppo.reward_pool.RewardPool``, started as ``python -m ppo.reward_worker``.

It imports only the standard library and ``ppo.rule_scoring``: no torch and no trainer (a spawned
``multiprocessing`` child would import both, and run the trainer's ``__main__`` again), so a fresh one is
ready in well under a second. It reads its scorer's description from stdin, builds the scorer once, then
scores one response at a time. Messages both ways are length-prefixed pickles (``write_message``,
``read_message``)::

    parent -> worker   {"sys_path", "custom_function", "format_score", "reward_kwargs", "parent_pid"},
                       then (function, data_source, solution_str, ground_truth, extra_info) per call,
                       ``function`` the index of one of a list's functions (0 for one); None ends it
    worker -> parent   ("ready", the functions' __name__s) or ("failed", reason), then ("ok", Score) or
                       ("error", reason)

The protocol has the worker's stdout to itself: fd 1 is pointed at stderr before the user's code loads, so
the function's prints land in the trainer's stderr. A worker ignores SIGINT (a Ctrl-C in the terminal
reaches the whole process group; the trainer closes its workers) and exits with its parent: on EOF on
stdin, and, while a call hangs, when a watcher thread sees the parent gone (a SIGKILLed trainer).
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import sys
import threading
import time
from typing import Any, BinaryIO

from ppo.rule_scoring import RewardError, TRLScorer, load_functions, make_rule_scorer, scorer_name

PARENT_POLL_S = 1.0
"""How often a worker checks that the process that started it is still there."""

_HEADER = struct.Struct("!I")


def write_message(stream: BinaryIO, message: Any) -> None:
    """Write ``message`` as a 4-byte big-endian length and its pickle, in one write."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def read_message(stream: BinaryIO) -> Any:
    """The next message of ``stream``; EOFError when it ends (its writer exited or closed it)."""
    (size,) = _HEADER.unpack(_read_exactly(stream, _HEADER.size))
    return pickle.loads(_read_exactly(stream, size))


def _read_exactly(stream: BinaryIO, size: int) -> bytes:
    chunks = []
    while size:
        chunk = stream.read(size)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _exit_with_parent(parent_pid: int) -> None:
    """End this process once its parent is gone, even while the main thread hangs in the user's call."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    protocol = os.fdopen(os.dup(1), "wb")  # the messages' own copy of stdout
    os.dup2(2, 1)  # fd 1 (print, C code) now writes to stderr
    requests = sys.stdin.buffer
    try:
        setup = read_message(requests)
    except EOFError:
        return 0
    sys.path[:0] = [p for p in setup["sys_path"] if p not in sys.path]  # the trainer's module search path
    threading.Thread(target=_exit_with_parent, args=(setup["parent_pid"],), daemon=True).start()
    spec = setup["custom_function"]
    try:
        functions = (
            load_functions(spec, setup["reward_kwargs"])
            if spec is not None
            else [make_rule_scorer(None, setup["format_score"])]
        )
        batched = [f for f in functions if isinstance(f, TRLScorer)]
        if batched:
            raise batched[0].not_per_response()
    except RewardError as e:  # names the function and what went wrong
        write_message(protocol, ("failed", str(e)))
        return 1
    except BaseException as e:  # the user's module, while it is imported: any failure, sys.exit() too
        write_message(
            protocol, ("failed", f"{scorer_name(spec)}: importing it raised {type(e).__name__}: {e}")
        )
        return 1
    write_message(protocol, ("ready", [f.name for f in functions] if spec is not None else []))
    while True:
        try:
            job = read_message(requests)
        except EOFError:
            return 0
        if job is None:
            return 0
        fn, *row = job
        try:
            answer = ("ok", functions[fn](*row))
        except Exception as e:  # the user's function: any failure becomes a counted error score
            answer = ("error", str(e)[:300])
        except SystemExit as e:  # sys.exit() in the function, if the scorer let it through
            answer = ("error", f"the reward function called sys.exit({e.code!r})")
        write_message(protocol, answer)


if __name__ == "__main__":
    sys.exit(main())
