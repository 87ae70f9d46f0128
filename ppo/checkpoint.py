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

import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from ppo.distributed import barrier, broadcast_object

logger = logging.getLogger("ppo")

COMPLETE = "COMPLETE"


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
        model_sd, optim_sd = get_state_dict(model, optimizers[name])
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
    state = {f"{name}.model": get_model_state_dict(model) for name, model in _present(models).items()}
    try:
        dcp.load(state, checkpoint_id=str(ckpt_dir / "dcp"))
    except (Exception, CheckpointException) as e:
        raise CheckpointError(
            f"checkpoint {ckpt_dir} does not fit the models (different shapes?): {_dcp_error(e)}"
        ) from None
    for name, model in _present(models).items():
        set_model_state_dict(model, state[f"{name}.model"])


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
        model_sd, optim_sd = get_state_dict(model, optimizers[name])
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
        )
    local = torch.load(ckpt_dir / f"rank_{rank:05d}.pt", weights_only=False)
    for name, sched in _present(schedulers).items():
        sched.load_state_dict(local["schedulers"][name])
    set_rng_state(local["rng"])
    return broadcast_object(meta)
