"""Sharded, atomic, exactly-resumable checkpoints.

Layout of ``<output_dir>/checkpoints``::

    step_00000040/            one complete checkpoint
        dcp/                  models and optimizers, sharded (torch.distributed.checkpoint)
        rank_00000.pt ...     per rank: RNG states (torch, cuda, python, numpy), LR schedulers
        trainer.json          step counters, data-loader position, KL controller
        config.yaml           the resolved config of the run that wrote it
        COMPLETE              written last, before the rename
    latest                    the name of the newest complete checkpoint, replaced atomically

A checkpoint is written to ``step_N.tmp`` and renamed into place only when every rank has finished, so a
crash while saving leaves the previous checkpoint and ``latest`` intact. Resuming needs the world size
that wrote the checkpoint (per-rank RNG streams and data shares); a different one fails at start.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from ppo.distributed import DistInfo, barrier, broadcast_object

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


def find_resume_dir(out_dir: Path, resume_mode: str) -> Path | None:
    """The checkpoint to resume from: ``disable`` -> none; ``auto`` -> the latest complete one in the
    run folder (none if there is none); otherwise ``resume_mode`` is a checkpoint path."""
    if resume_mode == "disable":
        return None
    if resume_mode == "auto":
        root = checkpoints_dir(out_dir)
        latest = root / "latest"
        if latest.is_file():
            path = root / latest.read_text().strip()
            if is_complete(path):
                return path
            logger.warning("checkpoint %s named by %s is incomplete; looking for an older one", path, latest)
        candidates = sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
        complete = [p for p in candidates if is_complete(p)]
        return complete[-1] if complete else None
    path = Path(resume_mode)
    if not path.is_dir():
        raise CheckpointError(f"trainer.resume_mode={resume_mode}: no such checkpoint folder")
    if not is_complete(path):
        raise CheckpointError(
            f"trainer.resume_mode={resume_mode}: the checkpoint is incomplete or corrupted (no {COMPLETE} "
            f"marker or DCP metadata); pick an older one or use trainer.resume_mode=auto"
        )
    return path


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (checkpoints then save and restore these streams per rank)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _present(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


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
    keep: int,
) -> Path:
    """Write checkpoint ``step`` (collective: every rank calls it) and point ``latest`` at it."""
    root = checkpoints_dir(out_dir)
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    barrier()
    state = {}
    for name, model in _present(models).items():
        model_sd, optim_sd = get_state_dict(model, optimizers[name], options=TRAINABLE_ONLY)
        state[f"{name}.model"] = model_sd
        state[f"{name}.optim"] = optim_sd
    dcp.save(state, checkpoint_id=str(tmp / "dcp"))
    torch.save(
        {
            "rng": rng_state(),
            "schedulers": {k: v.state_dict() for k, v in _present(schedulers).items()},
            "world_size": world_size,
        },
        tmp / f"rank_{rank:05d}.pt",
    )
    barrier()
    if rank == 0:
        (tmp / "trainer.json").write_text(json.dumps({**extra, "world_size": world_size}, indent=1))
        (tmp / "config.yaml").write_text(config_yaml)
        (tmp / COMPLETE).write_text(str(step))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        latest_tmp = root / "latest.tmp"
        latest_tmp.write_text(final.name)
        os.replace(latest_tmp, root / "latest")
        _prune(root, keep)
        logger.info("saved checkpoint %s", final)
    barrier()
    return final


def _prune(root: Path, keep: int) -> None:
    if keep <= 0:
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
    try:
        dcp.load(state, checkpoint_id=str(ckpt_dir / "dcp"))
    except (Exception, CheckpointException) as e:
        raise CheckpointError(
            f"checkpoint {ckpt_dir} does not fit the models (different shapes?): {_dcp_error(e)}"
        ) from None
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
    """Restore models, optimizers, schedulers and this rank's RNG; return ``trainer.json``'s content."""
    meta = json.loads((ckpt_dir / "trainer.json").read_text())
    if meta["world_size"] != world_size:
        raise CheckpointError(
            f"checkpoint {ckpt_dir} was written by {meta['world_size']} ranks and this run has {world_size}: "
            f"resume with the same world size (per-rank RNG streams and data shares must match), or start "
            f"fresh with trainer.resume_mode=disable"
        )
    state = {}
    for name, model in _present(models).items():
        model_sd, optim_sd = get_state_dict(model, optimizers[name], options=TRAINABLE_ONLY)
        state[f"{name}.model"] = model_sd
        state[f"{name}.optim"] = optim_sd
    try:
        dcp.load(state, checkpoint_id=str(ckpt_dir / "dcp"))
    except (Exception, CheckpointException) as e:
        raise CheckpointError(
            f"checkpoint {ckpt_dir} does not fit this run's models (different model shapes or config?): "
            f"{_dcp_error(e)}"
        ) from None
    for name, model in _present(models).items():
        set_state_dict(
            model,
            optimizers[name],
            model_state_dict=state[f"{name}.model"],
            optim_state_dict=state[f"{name}.optim"],
            options=TRAINABLE_ONLY_LOAD,
        )
    local = torch.load(ckpt_dir / f"rank_{rank:05d}.pt", weights_only=False)
    for name, sched in _present(schedulers).items():
        sched.load_state_dict(local["schedulers"][name])
    set_rng_state(local["rng"])
    return broadcast_object(meta)


# ----------------------------------------------------------------------------------------------------
# What a run checkpoints, and going back to it
# ----------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class TrainerState:
    """The loop's counters: saved in every checkpoint, restored on resume and (partly) on rollback."""

    step: int = 0
    """Steps completed."""
    skipped_steps: int = 0
    """Steps skipped for a non-finite reward, in all."""
    consecutive_skipped_steps: int = 0
    """Of those, in a row up to now (``trainer.max_skipped_steps`` stops the run)."""
    best_val: float | None = None
    """Best validation score so far (``trainer.rollback_val_drop``)."""
    rollbacks: int = 0
    """Rollbacks so far."""
    consecutive_rollbacks: int = 0
    """Rollbacks since the last new checkpoint (``algorithm.max_rollbacks`` stops the run)."""
    lr_scale: float = 1.0
    """Learning-rate multiplier from rollbacks (``algorithm.rollback_lr_factor`` each)."""

    ROLLBACK_FIELDS = ("rollbacks", "consecutive_rollbacks", "lr_scale")
    """What a rollback keeps from before it (the rest comes from the checkpoint)."""

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any], *, keep: tuple[str, ...] = ()) -> None:
        """Set every field from ``state`` except those in ``keep``; unknown keys are an error."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = set(state) - names
        if unknown:
            raise CheckpointError(f"trainer state has unknown fields {sorted(unknown)}")
        for name in names - set(keep):
            if name in state:
                setattr(self, name, state[name])


@dataclass(kw_only=True)
class Checkpointer:
    """Everything a run checkpoints, saved and restored in one place (resume and rollback).

    ``stateful`` holds the other objects with ``state_dict``/``load_state_dict`` (the data loader, the
    KL controller, the ``TrainerState``); their states go to ``trainer.json`` under their names.
    """

    out_dir: Path
    info: DistInfo
    config_yaml: str
    keep: int
    models: dict[str, torch.nn.Module | None]
    optimizers: dict[str, torch.optim.Optimizer | None]
    schedulers: dict[str, Any]
    stateful: dict[str, Any]

    def save(self, step: int) -> Path:
        """Write checkpoint ``step`` (collective: every rank calls it)."""
        return save(
            self.out_dir,
            step,
            models=self.models,
            optimizers=self.optimizers,
            schedulers=self.schedulers,
            extra={name: obj.state_dict() for name, obj in self.stateful.items()},
            config_yaml=self.config_yaml,
            rank=self.info.rank,
            world_size=self.info.world_size,
            keep=self.keep,
        )

    def restore(self, ckpt_dir: Path, *, keep: dict[str, tuple[str, ...]] | None = None) -> None:
        """Load ``ckpt_dir`` into every model, optimizer, scheduler, stateful object and this rank's RNG.

        ``keep`` maps a stateful name to fields of it that keep their current values.
        """
        extra = load(
            ckpt_dir,
            models=self.models,
            optimizers=self.optimizers,
            schedulers=self.schedulers,
            rank=self.info.rank,
            world_size=self.info.world_size,
        )
        for name, obj in self.stateful.items():
            if name not in extra:
                raise CheckpointError(
                    f"checkpoint {ckpt_dir} has no {name!r} state (written by another trainer?)"
                )
            if keep and name in keep:
                obj.load_state_dict(extra[name], keep=keep[name])
            else:
                obj.load_state_dict(extra[name])

    def scale_learning_rates(self, factor: float) -> None:
        """Multiply every optimizer's learning rate, now and for the rest of its schedule."""
        for sched in self.schedulers.values():
            if sched is not None:
                sched.base_lrs = [lr * factor for lr in sched.base_lrs]
                for group in sched.optimizer.param_groups:
                    group["lr"] *= factor


def roll_back(
    checkpointer: Checkpointer,
    state: TrainerState,
    reason: str,
    *,
    lr_factor: float,
    max_rollbacks: int,
) -> None:
    """Restore the last checkpoint with the learning rates times ``lr_factor``.

    The restored checkpoint's optimizers carry the lr scale they were saved with; the rollback
    counters and the new scale are kept from before. Raises ``RollbackExhausted`` after
    ``max_rollbacks`` rollbacks without reaching a new checkpoint, or when there is none to go to.
    """
    state.rollbacks += 1
    state.consecutive_rollbacks += 1
    if state.consecutive_rollbacks > max_rollbacks:
        raise RollbackExhausted(
            f"step {state.step}: {reason}, after {max_rollbacks} rollbacks in a row "
            f"(algorithm.max_rollbacks). Lower actor.optim.lr, raise the KL coefficient or "
            f"algorithm.rollback_kl, then resume."
        )
    ckpt_dir = find_resume_dir(checkpointer.out_dir, "auto")
    if ckpt_dir is None:
        raise RollbackExhausted(f"step {state.step}: {reason}, and there is no checkpoint to roll back to")
    state.lr_scale *= lr_factor
    failed_step, scale = state.step, state.lr_scale
    checkpointer.restore(ckpt_dir, keep={"trainer": TrainerState.ROLLBACK_FIELDS})
    saved_scale = _saved_lr_scale(ckpt_dir)
    checkpointer.scale_learning_rates(scale / saved_scale)
    logger.warning(
        "step %d: %s; rolled back to %s (step %d) with learning rates x%.3g (rollback %d in a row)",
        failed_step,
        reason,
        ckpt_dir.name,
        state.step,
        scale,
        state.consecutive_rollbacks,
    )


def _saved_lr_scale(ckpt_dir: Path) -> float:
    return float(json.loads((ckpt_dir / "trainer.json").read_text())["trainer"]["lr_scale"])


class RollbackExhausted(CheckpointError):
    """KL or validation went wrong again after ``algorithm.max_rollbacks`` rollbacks, or with nothing
    to roll back to."""
