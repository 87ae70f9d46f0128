"""Process group, device mesh and the few collectives the loop needs; each rank's start-up (its logging,
its seeds) and its share of a list.

Every rank runs the same program. Under ``torchrun`` the rank and world size come from the environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``); a plain ``python script.py``
runs as a single rank (a one-process group over an in-memory store). nccl on CUDA, gloo on CPU. All collectives of the
trainer go through the helpers here, so that every rank makes the same calls in the same order.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import random
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

logger = logging.getLogger("ppo")

T = TypeVar("T")


@dataclass(kw_only=True)
class DistInfo:
    """Where this process sits: rank, world size, its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0 does the I/O (logs, metrics, config files)."""
        return self.rank == 0


def init_distributed(device: str = "auto", timeout_s: int = 1800) -> DistInfo:
    """Join torchrun's process group, or run as one rank when launched without it.

    ``device``: ``auto`` picks CUDA (nccl) when available, else CPU (gloo). A short ``timeout_s`` makes
    a rank that waits on a collective its peers never reach fail instead of hanging.
    """
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but CUDA is not available; use trainer.device=auto or cpu")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        kwargs = {}
        if "RANK" not in os.environ:
            # Launched without torchrun: a one-rank group over an in-memory store, so FSDP2, device
            # meshes and distributed checkpoints run the same code as on many ranks.
            kwargs = {"store": dist.HashStore(), "rank": 0, "world_size": 1}
        elif "TORCHELASTIC_RUN_ID" not in os.environ and world_size > 1:
            # RANK and WORLD_SIZE from the environment, not from torchrun (another launcher, or left over
            # in the shell): wait a bounded time for the other ranks, not the whole collective timeout.
            wait_s = min(timeout_s, RENDEZVOUS_TIMEOUT_S)
            kwargs = {"store": _rendezvous(rank, world_size, wait_s), "rank": rank, "world_size": world_size}
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=dev if use_cuda else None,
            **kwargs,
        )
    if world_size > 1:
        WATCH.rank = rank
        with contextlib.suppress(Exception):
            WATCH.store = dist.distributed_c10d._get_default_store()
        WATCH.enter("start-up")
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=dev)


RENDEZVOUS_TIMEOUT_S = 120
"""How long a rank launched without torchrun waits for the others to join (at most; shorter when the
collective timeout, ``trainer.dist_timeout_s``, is)."""


def _rendezvous(rank: int, world_size: int, wait_s: int) -> dist.Store:
    """The TCP store of ``MASTER_ADDR:MASTER_PORT`` once all ``world_size`` ranks have joined, or a
    RuntimeError that says which variables made this process wait for others."""
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    try:
        return dist.TCPStore(
            host,
            port,
            world_size,
            is_master=rank == 0,
            timeout=datetime.timedelta(seconds=wait_s),
            wait_for_workers=True,
        )
    except (RuntimeError, OSError) as e:
        raise RuntimeError(
            f"RANK={rank} and WORLD_SIZE={world_size} are set in the environment (not by torchrun), but the "
            f"other ranks did not join at {host}:{port} within {wait_s} s ({str(e)[:120]}): "
            f"unset RANK and WORLD_SIZE to run as one process, or launch with torchrun"
        ) from None


def destroy_distributed() -> None:
    """Leave the process group (a no-op for a single rank)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End the process of an entry point that joined a process group, with ``code``: what ``sys.exit``
    does, less the interpreter's teardown. Python threads are joined, the ``atexit`` handlers run
    (logging's flush, multiprocessing's children, ``weakref.finalize``), the standard streams are
    flushed, then ``os._exit(code)``.

    Why: gloo's worker threads outlive ``destroy_process_group`` (DTensor's caches keep the device mesh,
    and through it the group, until exit), and a worker that drops a finished collective's tensors takes
    the GIL to do it, a moment after the caller's ``wait`` has returned. If that moment falls in the
    interpreter's teardown, CPython ends the thread inside a destructor that may not throw and the C++
    runtime aborts the process ("terminate called without an active exception", SIGABRT): a run that had
    finished reported a crashed rank (measured: 5 of 7 two-rank runs of a 2-step benchmark point, 3 of 8
    of the same command in a loop). Without the teardown nothing races the worker. An entry point calls
    it as ``exit_process(main())`` under ``if __name__ == "__main__"``; ``main()`` itself returns, so
    code that calls it in-process keeps its interpreter.
    """
    for thread in threading.enumerate():  # as the interpreter would: non-daemon threads finish first
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    flush_std_streams()
    os._exit(code)


def flush_std_streams() -> None:
    """Write out what ``sys.stdout`` and ``sys.stderr`` hold (a closed or broken stream is skipped)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()


def make_mesh(info: DistInfo, fsdp_size: int = -1) -> DeviceMesh:
    """Device mesh for FSDP2: 1-D ``("shard",)`` over all ranks, or 2-D ``("replicate", "shard")``.

    ``fsdp_size`` in ``(0, world_size)`` shards within groups of that many ranks and replicates across
    them (hybrid sharding, HSDP); -1 or ``world_size`` shards over all ranks.
    """
    device_type = info.device.type
    ws = info.world_size
    if fsdp_size <= 0 or fsdp_size >= ws:
        return init_device_mesh(device_type, (ws,), mesh_dim_names=("shard",))
    if ws % fsdp_size:
        raise ValueError(f"fsdp_size={fsdp_size} must divide the world size {ws}")
    return init_device_mesh(device_type, (ws // fsdp_size, fsdp_size), mesh_dim_names=("replicate", "shard"))


@dataclass
class Watch:
    """Where this rank is: the phase and step it last entered and how many collectives it has reached,
    written to the process group's store at each (a few per phase), so that when a collective times out
    the error says which phase every rank was in and which ranks never arrived (``describe_timeout``)
    instead of gloo's or NCCL's "timed out waiting" alone. One per process (``WATCH``), like the process
    group it describes."""

    rank: int = 0
    phase: str = "start-up"
    step: int = 0
    collectives: int = 0
    store: Any = None
    """The default process group's store; None on one rank (nothing to watch)."""

    def enter(self, phase: str, step: int | None = None) -> None:
        self.phase = phase
        if step is not None:
            self.step = step
        self._write()

    def arrive(self) -> None:
        """This rank reached a collective of the ``ppo.distributed`` helpers."""
        self.collectives += 1
        self._write()

    def _write(self) -> None:
        if self.store is not None:
            with contextlib.suppress(Exception):  # a store that is gone must not add a second failure
                self.store.set(f"ppo/watch/{self.rank}", f"{self.phase}|{self.step}|{self.collectives}")

    def describe_timeout(self, world_size: int, error: BaseException) -> str:
        """One line on a collective that timed out: each rank's phase and step, and the ranks that did not
        arrive (fewer collectives reached than this rank)."""
        seen: dict[int, tuple[str, int, int]] = {}
        for r in range(world_size):
            with contextlib.suppress(Exception):
                key = f"ppo/watch/{r}"
                if self.store is not None and self.store.check([key]):
                    phase, step, count = self.store.get(key).decode().split("|")
                    seen[r] = (phase, int(step), int(count))
        first = str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__
        here = f"rank {self.rank} waited in phase {self.phase!r} of step {self.step} (collective #{self.collectives})"
        behind = [f"rank {r} (in phase {p!r} of step {s}, collective #{c})" for r, (p, s, c) in sorted(seen.items())
                  if c < self.collectives]  # fmt: skip
        missing = [r for r in range(world_size) if r not in seen]
        parts = [f"a collective timed out ({first}): {here}"]
        if behind:
            parts.append(f"did not arrive: {', '.join(behind)}")
        if missing:
            parts.append(f"no report from rank(s) {missing}")
        return "; ".join(parts) + " (raise trainer.dist_timeout_s if that phase is legitimately slow)"


WATCH = Watch()
"""This process's ``Watch``."""


def is_collective_timeout(error: BaseException) -> bool:
    """Whether ``error`` is a collective that timed out (gloo's and NCCL's messages)."""
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("timed out" in text or "timeout" in text)


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_scalars(
    values: list[float], op: str = "sum", device: torch.device | None = None
) -> list[float]:
    """Reduce a list of Python numbers over ranks in one collective; ``op`` in sum, mean, max, min."""
    if not _initialized():
        return [float(v) for v in values]
    WATCH.arrive()
    device = device or _collective_device()
    t = torch.tensor(values, dtype=torch.float64, device=device)
    reduce_op = {
        "sum": dist.ReduceOp.SUM,
        "mean": dist.ReduceOp.SUM,
        "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN,
    }[op]
    dist.all_reduce(t, op=reduce_op)
    if op == "mean":
        t /= dist.get_world_size()
    return t.tolist()


def all_reduce_scalar(value: float, op: str = "sum") -> float:
    """One number reduced over ranks (sum, mean, max, min)."""
    return all_reduce_scalars([value], op)[0]


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks in place and return it (the identity on one rank).

    The ``all_reduce`` that ``ppo.algorithms`` takes to compute batch statistics over all ranks.
    """
    if _initialized():
        WATCH.arrive()
        dist.all_reduce(t)
    return t


def all_reduce_tensors(values: dict[str, torch.Tensor], op: str = "sum") -> dict[str, float]:
    """Reduce a dict of scalar tensors over ranks with one collective and one host sync.

    For metrics accumulated on the device during a mini-batch: reading each with ``.item()`` would
    wait for the device once per value. Every rank must pass the same keys.
    """
    if not values:
        return {}
    keys = sorted(values)
    stacked = torch.stack([values[k].detach().to(torch.float64).reshape(()) for k in keys])
    if _initialized():
        WATCH.arrive()
        if dist.get_backend() != "nccl":
            stacked = stacked.cpu()
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        dist.all_reduce(stacked, op=reduce_op)
    return dict(zip(keys, stacked.tolist(), strict=True))


def agree_on_failure(fn: Callable[[], T], error_type: type[Exception]) -> T:
    """Run ``fn`` on every rank; if it raised ``error_type`` on any rank, raise it on every rank.

    For work that can fail on some ranks only (scoring a rank's own responses with a user's reward
    function): the failing rank alone would stop while the others wait in the next collective. Every
    rank raises ``error_type`` with the message of the lowest failing rank. One gather of a small
    object per call.
    """
    try:
        result, failure = fn(), None
    except error_type as e:
        result, failure = None, str(e)
    failures = [f for f in all_gather_object(failure) if f is not None]
    if failures:
        raise error_type(failures[0])
    return result


def reduce_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Reduce a dict of per-rank metrics in one pass per reduction kind.

    The key's last part picks the reduction: ``.../max`` takes the max over ranks, ``.../min`` the min,
    a key ending in ``_sum`` or starting with ``perf/total`` is summed, everything else averaged.
    Every rank must pass the same keys (they are sorted so the order agrees).
    """
    if not _initialized():
        return dict(metrics)
    groups: dict[str, list[str]] = {"max": [], "min": [], "sum": [], "mean": []}
    for key in sorted(metrics):
        groups[_reduction_of(key)].append(key)
    out: dict[str, float] = {}
    for op, keys in groups.items():
        if keys:
            out.update(zip(keys, all_reduce_scalars([metrics[k] for k in keys], op), strict=True))
    return out


def _reduction_of(key: str) -> str:
    last = key.rpartition("/")[2]
    if last in ("max", "min"):
        return last
    if key.endswith("_sum") or key.startswith("perf/total"):
        return "sum"
    return "mean"


def barrier() -> None:
    """Wait for all ranks (a no-op for one rank)."""
    if _initialized():
        WATCH.arrive()
        dist.barrier()


def broadcast_object(obj: object, src: int = 0) -> object:
    """Send a picklable object from ``src`` to every rank."""
    if not _initialized():
        return obj
    WATCH.arrive()
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: object) -> list[object]:
    """Every rank's picklable object, in rank order."""
    if not _initialized():
        return [obj]
    WATCH.arrive()
    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _collective_device() -> torch.device:
    backend = dist.get_backend()
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def setup_logging(is_main: bool) -> None:
    """The ``ppo`` logger: INFO on rank 0, errors only elsewhere, one console handler.

    Configures only this project's logger (not the root), so embedding programs and test harnesses keep
    their own handlers; calling it again replaces the handler instead of adding a second one.
    """
    log = logging.getLogger("ppo")
    # Other ranks would repeat rank 0's warnings (they see the same, reduced, numbers): errors only.
    log.setLevel(logging.INFO if is_main else logging.ERROR)
    for handler in [h for h in log.handlers if getattr(h, "_ppo", False)]:
        log.removeHandler(handler)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S"))
    handler._ppo = True
    log.addHandler(handler)


@contextlib.contextmanager
def main_rank_logs(info: DistInfo) -> Iterator[None]:
    """Silence warnings of the ``ppo`` logger on ranks other than 0 (e.g. data files read by every
    rank report skipped rows once, not once per rank); errors still show."""
    if info.is_main:
        yield
        return
    previous = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(previous)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (checkpoints then save and restore these streams per rank)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rank_slice(items: Sequence[Any], info: DistInfo) -> list[Any]:
    """This rank's contiguous slice of ``items`` (e.g. an evaluation set), the ranks' sizes differing by at
    most one."""
    bounds = np.linspace(0, len(items), info.world_size + 1).round().astype(int)
    return list(items[bounds[info.rank] : bounds[info.rank + 1]])
