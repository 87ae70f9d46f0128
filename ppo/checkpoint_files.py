"""The files of a checkpoint: sharded, atomic, exactly resumable, safe to read from anywhere. What a run
puts in them, and how it resumes and rolls back, is ``ppo.checkpointer``'s.

Layout of ``<output_dir>/checkpoints``::

    step_00000040/            one complete checkpoint
        dcp/                  models and optimizers, sharded (torch.distributed.checkpoint)
        rank_00000.pt ...     per rank: RNG states (torch, cuda, python, numpy), LR schedulers
        trainer.json          step counters, data-loader position, KL controller
        config.yaml           the resolved config of the run that wrote it
        COMPLETE              written last, before the rename
    latest                    the name of the newest complete checkpoint, replaced atomically

A checkpoint is written to ``step_N.tmp`` and renamed into place only when every rank has finished, so a
crash (or a full disk) while saving leaves the previous checkpoint and ``latest`` intact.

Resuming on another number of ranks works: DCP reshards models and optimizers, the data position is
global; the sampling RNG streams are then derived from ``trainer.seed`` and the step instead of
restored (the run continues in the same data order, but not bit-identically).

Reading never runs code from the files: rank files hold only tensors and plain types and load with
``torch.load(weights_only=True)``; DCP's pickled metadata is read with an unpickler that admits only
DCP's own metadata classes, and its non-tensor entries (optimizer hyper-parameters) with
``weights_only=True``. A checkpoint from a shared file system or a download cannot execute anything.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import pickle
import random
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from ppo.distributed import barrier, broadcast_object

logger = logging.getLogger("ppo")

COMPLETE = "COMPLETE"

TRAINABLE_ONLY = StateDictOptions(ignore_frozen_params=True)
"""Checkpoints hold what trains: with LoRA the frozen base weights come from ``model.path`` again, so a
checkpoint is the adapters (and value head) and their optimizer state."""

TRAINABLE_ONLY_LOAD = StateDictOptions(ignore_frozen_params=True, strict=False)
"""Loading them: ``load_state_dict(strict=True)`` would ask for the frozen weights a checkpoint does not
hold. Nothing trainable can go missing: ``dcp.load`` has already failed for any requested tensor that the
checkpoint lacks."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or resumed; the message says what to fix."""


def checkpoints_dir(out_dir: Path) -> Path:
    return Path(out_dir) / "checkpoints"


def ensure_writable(out_dir: Path) -> None:
    """Create the run folder and prove it is writable before any work is done."""
    try:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        probe = Path(out_dir) / ".write_test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise CheckpointError(
            f"trainer.output_dir={out_dir} is not writable ({e.strerror}); choose another folder"
        ) from None


def is_complete(path: Path) -> bool:
    return (path / COMPLETE).is_file() and (path / "dcp" / ".metadata").is_file()


def complete_checkpoints(out_dir: Path) -> list[Path]:
    """The run folder's complete checkpoints, oldest first (no warning about incomplete ones)."""
    root = checkpoints_dir(out_dir)
    return sorted(
        p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp") and is_complete(p)
    )


def step_of(path: Path) -> int:
    """The step of a checkpoint folder ``step_00000042`` (42)."""
    return int(path.name.removeprefix("step_"))


def find_resume_dir(out_dir: Path, resume_mode: str) -> Path | None:
    """The checkpoint to resume from: ``disable`` -> none; ``auto`` -> the newest complete one in the
    run folder (none if there is none); otherwise ``resume_mode`` is a checkpoint path."""
    candidates = resume_candidates(out_dir, resume_mode)
    return candidates[0] if candidates else None


def resume_candidates(out_dir: Path, resume_mode: str) -> list[Path]:
    """Checkpoints to try, best first: ``auto`` lists the complete ones of the run folder newest first
    (``latest``'s first), so a newest one that fails to load falls back to the next; a checkpoint path
    lists itself, and a run folder, its ``checkpoints/`` folder or its ``latest`` file (what
    ``scripts/export_hf.py`` takes) lists that run's as ``auto`` does; ``disable`` none."""
    if resume_mode == "disable":
        return []
    if resume_mode == "auto":
        return _newest_first(checkpoints_dir(out_dir))
    path = Path(resume_mode)
    if path.is_file() and path.name == "latest":  # <run>/checkpoints/latest names the newest step folder
        path = path.parent / path.read_text().strip()
    if path.is_dir() and not is_complete(path):
        root = (
            checkpoints_dir(path) if checkpoints_dir(path).is_dir() else path
        )  # a run folder or its checkpoints/
        if (root / "latest").is_file() or any(root.glob("step_*")):
            candidates = _newest_first(root)
            if not candidates:
                raise CheckpointError(
                    f"trainer.resume_mode={resume_mode}: {root} holds no complete checkpoint (step_N folder "
                    f"with a {COMPLETE} marker and DCP metadata)"
                )
            return candidates
    if not path.is_dir():
        raise CheckpointError(
            f"trainer.resume_mode={resume_mode}: no such checkpoint folder; pass a checkpoint (run/checkpoints/"
            f"step_N), a run folder (its newest checkpoint), auto or disable"
        )
    if not is_complete(path):
        raise CheckpointError(
            f"trainer.resume_mode={resume_mode}: the checkpoint is incomplete or corrupted (no {COMPLETE} "
            f"marker or DCP metadata); pick an older one or use trainer.resume_mode=auto"
        )
    return [path]


def _newest_first(root: Path) -> list[Path]:
    """The complete checkpoints of a ``checkpoints/`` folder, newest first (``latest``'s first); the
    incomplete ones are skipped with a warning."""
    candidates = sorted(
        (p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")), reverse=True
    )
    latest = root / "latest"
    named = root / latest.read_text().strip() if latest.is_file() else None
    if named is not None and named in candidates:
        candidates.remove(named)
        candidates.insert(0, named)
    complete = [p for p in candidates if is_complete(p)]
    for path in candidates:
        if path not in complete:
            logger.warning(
                "checkpoint %s is incomplete (no %s marker or DCP metadata); skipped", path, COMPLETE
            )
    return complete


def rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors and plain types (loadable with ``weights_only=True``)."""
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": [version, list(mt), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _present(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


@dataclass(kw_only=True)
class PendingSave:
    """A checkpoint whose sharded part is being written in the background (``save(..., async_group=...)``);
    ``finish_save`` completes it."""

    out_dir: Path
    step: int
    future: Any
    """What ``dcp.async_save`` returned: done when every shard of this rank is on disk."""
    trainer_json: str
    config_yaml: str
    rank: int
    keep: int | None


def init_optimizer_state(optimizer: torch.optim.Optimizer | None) -> None:
    """Give every trainable parameter of an AdamW that has not stepped yet the state its first step
    creates: ``step`` 0 and zero moments (``exp_avg``, ``exp_avg_sq``; ``max_exp_avg_sq`` with amsgrad).

    ``get_state_dict`` would otherwise create the state by a step with zero gradients at lr 0, which
    leaves ``step`` = 1: every later update's bias correction ``1 - beta^t`` then counts one step too
    many, so a run that saves before its optimizer's first update (a skipped first step, the actor
    during ``trainer.critic_warmup``) would train differently from the same run without the save. With
    this state the first real step is what it would have been (torch's AdamW increments ``step``, then
    updates the moments from zero)."""
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) or optimizer.state:
        return  # none (a model saved without one: SPPO's snapshot), or one that has stepped
    for group in optimizer.param_groups:
        on_device = bool(group.get("fused") or group.get("capturable"))  # torch keeps such a step beside p
        scalar = torch.float32 if on_device else torch.get_default_dtype()
        for p in group["params"]:
            if not p.requires_grad:
                continue
            state = {
                "step": torch.zeros((), dtype=scalar, device=p.device if on_device else "cpu"),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            optimizer.state[p] = state


def save(
    out_dir: Path,
    step: int,
    *,
    models: dict[str, torch.nn.Module | None],
    optimizers: dict[str, torch.optim.Optimizer | None],
    schedulers: dict[str, Any],
    extra: dict[str, Any],
    config_yaml: str,
    rank: int,
    world_size: int,
    keep: int | None,
    async_group: Any = None,
) -> Path | PendingSave:
    """Write checkpoint ``step`` (collective: every rank calls it) and point ``latest`` at it.

    With ``async_group`` (a process group of its own, ``dist.new_group(backend="gloo")``) the models and
    optimizers are copied to host memory and written by a background thread (``dcp.async_save``) while
    training goes on; the returned ``PendingSave`` is completed by ``finish_save``, which renames the
    folder into place and moves ``latest`` only then. Either way a crash (or a full disk) before that
    leaves the previous checkpoint and ``latest`` intact, and a failure raises CheckpointError naming the
    folder.
    """
    with _failures_named(out_dir, step):
        root = checkpoints_dir(out_dir)
        tmp = root / f"step_{step:08d}.tmp"
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        barrier()
        state = {}
        for name, model in _present(models).items():
            init_optimizer_state(optimizers[name])
            model_sd, optim_sd = get_state_dict(model, optimizers[name], options=TRAINABLE_ONLY)
            state[f"{name}.model"] = model_sd
            state[f"{name}.optim"] = optim_sd
        torch.save(
            {
                "rng": rng_state(),
                "schedulers": {k: v.state_dict() for k, v in _present(schedulers).items()},
                "world_size": world_size,
            },
            tmp / f"rank_{rank:05d}.pt",
        )
        pending = PendingSave(
            out_dir=out_dir,
            step=step,
            future=None,
            trainer_json=json.dumps({**extra, "world_size": world_size}, indent=1),
            config_yaml=config_yaml,
            rank=rank,
            keep=keep,
        )
        if async_group is None:
            dcp.save(state, checkpoint_id=str(tmp / "dcp"))
            return finish_save(pending)
        pending.future = dcp.async_save(state, checkpoint_id=str(tmp / "dcp"), process_group=async_group)
        return pending


def save_done(pending: PendingSave) -> bool:
    """Whether this rank's shards of ``pending`` are written (no collective)."""
    return pending.future is None or pending.future.done()


def finish_save(pending: PendingSave) -> Path:
    """Wait for ``pending``'s shards, then (rank 0, after every rank) write its metadata, rename it into
    place, point ``latest`` at it and prune the oldest (collective)."""
    with _failures_named(pending.out_dir, pending.step):
        if pending.future is not None:
            pending.future.result()
        barrier()
        root = checkpoints_dir(pending.out_dir)
        tmp = root / f"step_{pending.step:08d}.tmp"
        final = root / f"step_{pending.step:08d}"
        if pending.rank == 0:
            (tmp / "trainer.json").write_text(pending.trainer_json)
            (tmp / "config.yaml").write_text(pending.config_yaml)
            (tmp / COMPLETE).write_text(str(pending.step))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            latest_tmp = root / "latest.tmp"
            latest_tmp.write_text(final.name)
            os.replace(latest_tmp, root / "latest")
            _prune(root, pending.keep)
            logger.info("saved checkpoint %s", final)
        barrier()
        return final


@contextlib.contextmanager
def _failures_named(out_dir: Path, step: int) -> Iterator[None]:
    """A failed save as one CheckpointError naming the folder (the previous checkpoint is intact)."""
    try:
        yield
    except (OSError, CheckpointException) as e:
        saved = complete_checkpoints(out_dir)
        then = (
            f"the previous checkpoint (step {step_of(saved[-1])}) is intact: free space or fix the folder, "
            "then rerun with trainer.resume_mode=auto to resume from it"
            if saved
            else "there is no earlier checkpoint: free space or fix the folder, then rerun"
        )
        raise CheckpointError(
            f"saving checkpoint step {step} in {checkpoints_dir(out_dir)} failed ({_dcp_error(e)}); {then}"
        ) from None


def _prune(root: Path, keep: int | None) -> None:
    """Delete all but the ``keep`` newest complete checkpoints (``trainer.max_ckpt_to_keep``; None or 0:
    keep all)."""
    if not keep:
        return
    done = sorted(
        p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp") and is_complete(p)
    )
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _dcp_error(e: BaseException) -> str:
    """The first rank's underlying error of a DCP failure (its own message says only "ranks: [0]")."""
    failures = getattr(e, "failures", None)
    if failures:
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else inner
        return f"{type(inner).__name__}: {str(inner)[:300]}"
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def load_models(ckpt_dir: Path, models: dict[str, torch.nn.Module | None]) -> None:
    """Load only the model weights of a checkpoint (any world size: DCP reshards), e.g. for export."""
    if not is_complete(ckpt_dir):
        raise CheckpointError(
            f"{ckpt_dir} is not a complete checkpoint (no {COMPLETE} marker or DCP metadata)"
        )
    state = {
        f"{name}.model": get_model_state_dict(model, options=TRAINABLE_ONLY)
        for name, model in _present(models).items()
    }
    _dcp_load(state, ckpt_dir)
    for name, model in _present(models).items():
        set_model_state_dict(model, state[f"{name}.model"], options=TRAINABLE_ONLY_LOAD)


def load(
    ckpt_dir: Path,
    *,
    models: dict[str, torch.nn.Module | None],
    optimizers: dict[str, torch.optim.Optimizer | None],
    schedulers: dict[str, Any],
    rank: int,
    world_size: int,
) -> dict[str, Any]:
    """Restore models, optimizers, schedulers and this rank's RNG; return ``trainer.json``'s content.

    On another world size than the checkpoint's, the RNG states are not restored (the caller derives
    new streams) and the schedulers come from rank 0's file (they are the same on every rank); the
    returned dict's ``world_size`` says which.
    """
    meta = _read_json(ckpt_dir / "trainer.json")
    state = {}
    for name, model in _present(models).items():
        init_optimizer_state(optimizers[name])
        model_sd, optim_sd = get_state_dict(model, optimizers[name], options=TRAINABLE_ONLY)
        state[f"{name}.model"] = model_sd
        state[f"{name}.optim"] = optim_sd
    _dcp_load(state, ckpt_dir)
    for name, model in _present(models).items():
        set_state_dict(
            model,
            optimizers[name],
            model_state_dict=state[f"{name}.model"],
            optim_state_dict=state[f"{name}.optim"],
            options=TRAINABLE_ONLY_LOAD,
        )
    same_layout = meta.get("world_size") == world_size
    local = _read_rank_file(ckpt_dir / f"rank_{rank if same_layout else 0:05d}.pt")
    for name, sched in _present(schedulers).items():
        if name not in local.get("schedulers", {}):
            raise CheckpointError(f"{ckpt_dir}: no learning-rate schedule of the {name} in its rank file")
        sched.load_state_dict(local["schedulers"][name])
    if same_layout:
        set_rng_state(local["rng"])
    return broadcast_object(meta)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is missing or unreadable ({e}): the checkpoint is damaged") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} is not a JSON object: the checkpoint is damaged")
    return meta


def _read_rank_file(path: Path) -> dict[str, Any]:
    """A rank file, read without running any code it might carry."""
    try:
        local = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete") from None
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else "unknown content"
        raise CheckpointError(
            f"{path} was refused: it holds more than tensors and plain values ({first[:200]}); "
            f"checkpoints are never unpickled"
        ) from None
    except Exception as e:  # a truncated or garbled file
        raise CheckpointError(f"{path} is unreadable ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(local, dict) or "rng" not in local:
        raise CheckpointError(f"{path} is not a rank file of this trainer")
    return local


def _dcp_load(state: dict[str, Any], ckpt_dir: Path) -> None:
    """``dcp.load`` with the safe reader and planner, after checking every shard file is there and long
    enough (a truncated file is named, not blamed on the model's shapes)."""
    reader = _SafeReader(str(ckpt_dir / "dcp"))
    try:
        metadata = reader.read_metadata()
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{ckpt_dir / 'dcp' / '.metadata'} is unreadable ({_dcp_error(e)})") from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = ckpt_dir / "dcp" / name
        actual = path.stat().st_size if path.is_file() else None
        if actual is None or actual < size:
            what = "missing" if actual is None else f"truncated ({actual} of {size} bytes)"
            raise CheckpointError(f"checkpoint shard {path} is {what}: the checkpoint is damaged")
    try:
        dcp.load(state, storage_reader=reader, planner=_SafePlanner())
    except (Exception, CheckpointException) as e:
        raise CheckpointError(
            f"checkpoint {ckpt_dir} does not fit this run's models (different model shapes or config?): "
            f"{_dcp_error(e)}"
        ) from None


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``, admitting only the classes DCP's metadata is made of."""

    ALLOWED = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
    }

    def find_class(self, module: str, name: str) -> Any:
        # Python >= 3.13 pickles its paths from pathlib._local: read as pathlib's on any Python
        where = "pathlib" if module == "pathlib._local" else module
        if where == "torch.distributed.checkpoint.metadata" or (where, name) in self.ALLOWED:
            return super().find_class(where, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing {module}.{name}")


class _SafeReader(FileSystemReader):
    """DCP's file reader with the metadata read by ``_MetadataUnpickler`` (torch 2.10-2.14)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            try:
                metadata = _MetadataUnpickler(stream).load()
            except pickle.UnpicklingError as e:
                raise CheckpointError(
                    f"{path} was refused: it holds objects that are not checkpoint metadata ({e}); "
                    f"checkpoints are never unpickled"
                ) from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafePlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor entries read by ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise CheckpointError(
                f"checkpoint entry {read_item.dest_index.fqn} was refused ({str(e)[:200]}): checkpoints are "
                f"never unpickled"
            ) from None
        clean = io.BytesIO()
        torch.save(obj, clean)  # what the stock planner reads is now only plain values
        clean.seek(0)
        super().load_bytes(read_item, clean)
