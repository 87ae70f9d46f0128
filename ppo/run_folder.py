"""The run folder and every other path a run writes: what it holds, who may write it, what may be
replaced. Checked by rank 0 before any model loads (``runner.prepare_run``):

- **One run per folder at a time**: a lock file (``.lock``: host, pid, command) is created in
  ``trainer.output_dir``; a second run into the folder stops at once, naming the first. A lock whose
  process is gone (same host, pid not running: a killed job, a torchrun restart) is taken over; one from
  another host is refused, with the file to delete if that run is gone.
- **Nothing replaced without ``trainer.overwrite``**: a folder that holds a run (``RUN_FOLDER``) is
  resumed from its newest checkpoint (``resume_mode=auto``, ``overwrite`` or not: a requeued job never
  wipes itself), refused when there is no checkpoint to resume or the run is started fresh
  (``resume_mode=disable``), and replaced only with ``trainer.overwrite=true`` when there is nothing to
  resume. A stage's ``trainer.save_path`` that already holds a model is refused the same way.
- **Nothing a run reads is written**: an output path (the run folder, a stage's ``save_path``) that is,
  contains or lies inside an input (``model.path`` and the other model paths, the data files) is refused
  even with ``overwrite``.
- **Kinds and permissions**: a path the run writes as a folder that exists as a file (or the reverse) is
  an error; the run folder must accept a new file (a probe file is created and removed).
- **No run inside another**: ``trainer.output_dir`` (and a stage's ``save_path``) that is or lies inside a
  checkpoint (``.../checkpoints/step_N``), or lies below another run's folder, is refused: the new run
  would rewrite that checkpoint's ``config.yaml`` or mix its files with the other run's, which could then
  no longer resume.
- **The preset stays**: a ``--config`` file inside ``trainer.output_dir`` (or a stage's ``save_path``) is
  refused (``refuse_writing_preset``), since the run writes its resolved ``config.yaml`` there and prunes
  or deletes what it holds; the one exception is the run folder's own ``config.yaml`` when this run would
  write it unchanged (a rerun that resumes by its saved config).

    out_dir = claim(cfg)                      # rank 0; CheckpointError with one line otherwise
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from ppo import checkpoint_files
from ppo.checkpoint_files import CheckpointError
from ppo.config import DPOConfig, PPOConfig, StageConfig

logger = logging.getLogger("ppo")

RUN_FOLDER = {
    "checkpoints": "dir",
    "metrics.jsonl": "file",
    "generations.jsonl": "file",
    "tensorboard": "dir",
    "hf": "dir",
    "profile": "dir",
}
"""What a run that has started training may leave in ``trainer.output_dir``, beside its ``config.yaml``
(a ``config.yaml`` alone is what a run that failed at start-up left), and whether each is a folder or a
file: checkpoints, metrics, validation generations (``trainer.log_val_generations``), TensorBoard events, the ``save_pretrained`` export (PPO's
``trainer.save_hf_on_end``; a stage's model without ``trainer.save_path``) and profiler traces
(``trainer.profile_steps``). ``trainer.overwrite`` replaces them when there is nothing to resume."""

METRICS_FILE = "metrics.json"
"""Final numbers of every stage, merged into one file beside the saved model folders."""

LOCK_FILE = ".lock"
"""The lock of a run folder (JSON: host, pid, start time, command)."""


def run_paths(cfg: PPOConfig | StageConfig) -> dict[Path, str]:
    """Every path a run will write and its kind (``"dir"`` or ``"file"``): the parts of ``RUN_FOLDER``
    it uses and, for a stage, its saved model and the ``metrics.json`` beside it."""
    out = Path(cfg.trainer.output_dir)
    names = ["checkpoints", "metrics.jsonl", "tensorboard"]
    paths: dict[Path, str] = {}
    if isinstance(cfg, PPOConfig):
        names += ["hf"] * cfg.trainer.save_hf_on_end + ["profile"] * bool(cfg.trainer.profile_steps)
        names += ["generations.jsonl"] * bool(cfg.trainer.log_val_generations)
    else:
        saved = stage_save_path(cfg)
        paths = {saved: "dir", saved.parent / METRICS_FILE: "file"}
    return {out / name: RUN_FOLDER[name] for name in names} | paths


def stage_save_path(cfg: StageConfig) -> Path:
    """Where a stage saves its model: ``trainer.save_path``, or ``output_dir/hf``."""
    return Path(cfg.trainer.save_path or Path(cfg.trainer.output_dir) / "hf")


def run_inputs(cfg: PPOConfig | StageConfig) -> dict[str, Path]:
    """What a run reads and must never write, by config key: model folders and data files."""
    models: dict[str, str | None] = {
        "model.path": cfg.model.path,
        "model.tokenizer_path": cfg.model.tokenizer_path,
    }
    if isinstance(cfg, PPOConfig):
        models |= {
            "ref.model_path": cfg.ref.model_path,
            "critic.model_path": cfg.critic.model_path,
            "reward.model_path": cfg.reward.model_path,
        }
    elif isinstance(cfg, DPOConfig):
        models["ref.model_path"] = cfg.ref.model_path
    inputs = {key: Path(path) for key, path in models.items() if path and Path(path).exists()}
    files = list(cfg.data.train_files) + list(cfg.data.val_files or [])
    inputs |= {f"data file {f}": Path(f) for f in files if Path(f).exists()}
    return inputs


# ----------------------------------------------------------------------------------------------------
# The lock
# ----------------------------------------------------------------------------------------------------


def acquire_lock(out_dir: Path) -> Path:
    """Create ``out_dir/.lock`` for this process (released at exit), or raise CheckpointError naming the
    run that holds it. A lock left by a process that no longer runs on this host is taken over."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / LOCK_FILE
    mine = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.time(),
        "command": " ".join(sys.argv),
    }
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read_lock(path)
            if holder is not None and not _is_stale(holder):
                started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
                raise CheckpointError(
                    f"{out_dir} is in use by another run (pid {holder.get('pid')} on {holder.get('host')}, "
                    f"started {started}: {holder.get('command', '?')[:120]}); wait for it to end or choose "
                    f"another trainer.output_dir (if that run is gone, delete {path})"
                ) from None
            logger.warning(
                "%s: taking over the lock of a run that is no longer running (%s)", out_dir, holder
            )
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(mine, f)
        atexit.register(release_lock, path)
        return path
    raise CheckpointError(f"{path}: could not take the run folder's lock (another run keeps taking it)")


def release_lock(path: Path) -> None:
    """Remove the lock if this process holds it."""
    holder = _read_lock(path)
    if holder is not None and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        path.unlink(missing_ok=True)


def _read_lock(path: Path) -> dict | None:
    """The lock's content; None when it vanished; ``{}`` when it cannot be read (cut short by a kill)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _is_stale(holder: dict) -> bool:
    """A lock is stale when its content is unreadable or its process no longer runs on this host; a
    lock of another host cannot be checked from here and counts as held."""
    if "pid" not in holder or "host" not in holder:
        return True
    if holder["host"] != socket.gethostname():
        return False
    if int(holder["pid"]) == os.getpid():  # an earlier run of this process (in-process runs, tests)
        return True
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


# ----------------------------------------------------------------------------------------------------
# Claiming the folder
# ----------------------------------------------------------------------------------------------------


def claim(cfg: PPOConfig | StageConfig) -> Path:
    """Lock the run folder and check every path the run writes (see the module docstring); rank 0 only,
    before any model loads. Returns the run folder."""
    out_dir = Path(cfg.trainer.output_dir)
    _refuse_nesting(cfg)
    _refuse_writing_inputs(cfg)
    for path, kind in run_paths(cfg).items():
        if kind == "dir" and path.exists() and not path.is_dir():
            raise CheckpointError(f"{path} is a file: the run writes a folder there; move it away")
        if kind == "file" and path.is_dir():
            raise CheckpointError(f"{path} is a folder: the run writes a file there; move it away")
    checkpoint_files.ensure_writable(out_dir)
    acquire_lock(out_dir)
    _claim_run_folder(cfg, out_dir)
    if not isinstance(cfg, PPOConfig):
        _claim_save_path(cfg, out_dir)
    return out_dir


def _overlaps(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` are the same path or one lies inside the other."""
    a, b = a.resolve(), b.resolve()
    return a == b or a in b.parents or b in a.parents


def _refuse_writing_inputs(cfg: PPOConfig | StageConfig) -> None:
    """CheckpointError when a path the run writes (or a stage's ``--overwrite`` would replace) is, holds
    or lies inside something it reads, or the run folder lies inside an input model folder."""
    out = Path(cfg.trainer.output_dir)
    written = {out / name: "trainer.output_dir" for name in [*RUN_FOLDER, "config.yaml", LOCK_FILE]}
    if not isinstance(cfg, PPOConfig):
        saved = stage_save_path(cfg)
        written |= {saved: "trainer.save_path", saved.parent / METRICS_FILE: "trainer.save_path"}
    for in_key, path in run_inputs(cfg).items():
        clash = next((key for w, key in written.items() if _overlaps(w, path)), None)
        if (
            clash is None
            and path.is_dir()
            and (out.resolve() == path.resolve() or path.resolve() in out.resolve().parents)
        ):
            clash = "trainer.output_dir"
        if clash is not None:
            value = out if clash == "trainer.output_dir" else stage_save_path(cfg)
            raise CheckpointError(
                f"{clash}={value} would write over {in_key}={path}, which the run reads: choose another "
                f"{clash} (no program of this project writes over its own inputs, overwrite or not)"
            )


def is_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` is a checkpoint (complete, being written, or damaged): a ``step_N`` folder of a
    ``checkpoints/`` folder, or one holding a checkpoint's ``COMPLETE`` marker or ``trainer.json``."""
    named = folder.parent.name == "checkpoints" and folder.name.startswith("step_")
    return named or (folder / checkpoint_files.COMPLETE).is_file() or (folder / "trainer.json").is_file()


def holds_run(folder: Path) -> bool:
    """Whether ``folder`` is a run's folder: locked by a run (a lock of ours: other tools name their locks
    ``.lock`` too), or holding the ``config.yaml`` a run writes first with its metrics or checkpoints (a
    ``checkpoints/`` folder alone is verl's root of many runs)."""
    lock = _read_lock(folder / LOCK_FILE) if (folder / LOCK_FILE).is_file() else None
    if lock is not None and {"host", "pid", "command"} <= lock.keys():
        return True
    ckpts = checkpoint_files.checkpoints_dir(folder)
    trained = (
        (folder / "metrics.jsonl").is_file() or (ckpts / "latest").is_file() or any(ckpts.glob("step_*"))
    )
    return (folder / "config.yaml").is_file() and trained


def _refuse_nesting(cfg: PPOConfig | StageConfig) -> None:
    """CheckpointError when ``trainer.output_dir`` is or lies inside a checkpoint or lies below another
    run's folder, or a stage's ``save_path`` is or lies inside a checkpoint or another run's folder (its
    own run folder aside): a run there would rewrite the checkpoint's ``config.yaml`` or mix its files
    with the other run's, which could then no longer resume. Checked before anything is created."""
    out = Path(cfg.trainer.output_dir).resolve()
    targets = {"trainer.output_dir": (Path(cfg.trainer.output_dir), out)}
    if not isinstance(cfg, PPOConfig):
        targets["trainer.save_path"] = (stage_save_path(cfg), stage_save_path(cfg).resolve())
    for key, (given, path) in targets.items():
        for folder in [path, *path.parents]:
            if key == "trainer.save_path" and folder == out:
                break  # the run's own folder; above it is checked as trainer.output_dir's
            where = "is" if folder == path else "lies inside"
            if is_checkpoint(folder):
                run = folder.parent.parent if folder.parent.name == "checkpoints" else None
                of_run = f" of the run in {run}" if run else ""
                resume = f"to continue that run, set trainer.output_dir={run}; " if run else ""
                raise CheckpointError(
                    f"{key}={given} {where} the checkpoint {folder}{of_run}: a run there would rewrite that "
                    f"checkpoint's files (its config.yaml) and it could no longer be resumed; choose a folder "
                    f"outside {run or folder} ({resume}to start from that checkpoint, set "
                    f"trainer.resume_mode={folder} with a new trainer.output_dir)"
                )
            if (folder != path or key == "trainer.save_path") and holds_run(folder):
                raise CheckpointError(
                    f"{key}={given} {where} the folder of another run, {folder}: a run there would mix its "
                    f"files with that run's, which could then no longer be resumed; choose a folder outside "
                    f"{folder} (to continue that run, set trainer.output_dir={folder})"
                )


def refuse_writing_preset(cfg: PPOConfig | StageConfig, preset: str | None, resolved: str) -> None:
    """CheckpointError when the ``--config`` file ``preset`` lies inside ``trainer.output_dir`` or a
    stage's ``save_path``: the run writes its resolved config there as ``config.yaml`` (a hand-written
    preset of that name, comments and all, would be gone) and prunes or deletes the folder's files. The
    run folder's own ``config.yaml`` passes when its text is ``resolved``, the config this run writes:
    resuming a run by its saved config, unchanged, loses nothing. Before anything is created."""
    if preset is None:
        return
    path, out = Path(preset).resolve(), Path(cfg.trainer.output_dir).resolve()
    if path == out / "config.yaml":
        if path.is_file() and path.read_text() == resolved:
            return
        if holds_run(out):
            raise CheckpointError(
                f"--config {preset} is the config the run in trainer.output_dir={cfg.trainer.output_dir} saved, "
                f"and this command changes it (an override, or a key this version added): the run would "
                f"replace it; copy it out of that folder and pass the copy as --config"
            )
        raise CheckpointError(
            f"--config {preset} is the config.yaml of trainer.output_dir={cfg.trainer.output_dir}, which the "
            f"run replaces with its resolved config: move the preset out of that folder or choose another "
            f"trainer.output_dir"
        )
    folders = {"trainer.output_dir": (cfg.trainer.output_dir, out)}
    if not isinstance(cfg, PPOConfig):
        folders["trainer.save_path"] = (str(stage_save_path(cfg)), stage_save_path(cfg).resolve())
    for key, (given, folder) in folders.items():
        if folder in path.parents:
            raise CheckpointError(
                f"--config {preset} lies inside {key}={given}, whose files the run writes, prunes or (with "
                f"trainer.overwrite) deletes: move the preset out of that folder or choose another {key}"
            )


def _claim_run_folder(cfg: PPOConfig | StageConfig, out_dir: Path) -> None:
    """Resume, refuse, or (with ``trainer.overwrite`` and nothing to resume) replace an earlier run.
    Checkpoints that would be lost are named (their steps) in the refusal, which offers
    ``trainer.resume_mode=auto`` first, and in the warning logged before ``overwrite`` deletes them."""
    t = cfg.trainer
    found = [name for name in RUN_FOLDER if (out_dir / name).exists()]
    if not found:
        return
    resumable = t.resume_mode != "disable" and bool(
        checkpoint_files.resume_candidates(out_dir, t.resume_mode)
    )
    saved = checkpoint_files.complete_checkpoints(out_dir)
    if resumable:
        if t.overwrite:
            logger.warning(
                "trainer.overwrite=true is not applied: %s holds checkpoints and trainer.resume_mode=%s "
                "resumes them (to start over and delete %s, set trainer.resume_mode=disable with "
                "trainer.overwrite=true)",
                out_dir,
                t.resume_mode,
                describe_checkpoints(saved),
            )
        return
    if t.overwrite:
        what = ", ".join(
            describe_checkpoints(saved) if name == "checkpoints" and saved else name for name in found
        )
        logger.warning("trainer.overwrite=true: deleting the earlier run's %s in %s", what, out_dir)
        for name in found:
            path = out_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        return
    if saved:
        # The checkpoints are intact: resuming is the way out that loses nothing, so it comes first.
        others = ", ".join(n for n in found if n != "checkpoints") or "nothing else"
        raise CheckpointError(
            f"trainer.output_dir={out_dir} already holds a run with {describe_checkpoints(saved)} and "
            f"trainer.resume_mode={t.resume_mode} does not resume them: set trainer.resume_mode=auto to "
            f"resume from step {checkpoint_files.step_of(saved[-1])}, or choose another trainer.output_dir "
            f"(trainer.overwrite=true would delete those checkpoints and {others})"
        )
    if t.resume_mode == "disable":
        why = "trainer.resume_mode=disable starts a fresh one"
    else:
        why = f"it has no checkpoint to resume (trainer.resume_mode={t.resume_mode}), so its files would be replaced"
    raise CheckpointError(
        f"trainer.output_dir={out_dir} already holds a run ({', '.join(found)}) and {why}: choose another "
        f"trainer.output_dir, or set trainer.overwrite=true to delete {', '.join(found)}"
    )


def describe_checkpoints(saved: list[Path]) -> str:
    """``"2 checkpoints (steps 4, 8)"``: what a run folder's complete checkpoints are, for a message."""
    steps = ", ".join(str(checkpoint_files.step_of(p)) for p in saved)
    return f"{len(saved)} checkpoint{'s' * (len(saved) != 1)} (step{'s' * (len(saved) != 1)} {steps})"


def _claim_save_path(cfg: StageConfig, out_dir: Path) -> None:
    """A stage's ``save_path`` holding a model is another run's output unless this run resumes."""
    saved = stage_save_path(cfg)
    if not (saved.is_dir() and any(saved.iterdir())) or cfg.trainer.overwrite:
        return
    if cfg.trainer.resume_mode != "disable" and checkpoint_files.resume_candidates(
        out_dir, cfg.trainer.resume_mode
    ):
        return  # this run's own model, saved when it ended (a rerun that resumes)
    raise CheckpointError(
        f"trainer.save_path={saved} already holds a model and this run starts fresh: choose another "
        f"trainer.save_path, or set trainer.overwrite=true to replace it"
    )


# ----------------------------------------------------------------------------------------------------
# Fingerprints of inputs
# ----------------------------------------------------------------------------------------------------

FINGERPRINT_BYTES = 1 << 20
"""How much of the start and of the end of each file a fingerprint reads."""

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".json", ".model", ".parquet")
"""The files of a model folder (weights, configs, tokenizer) or data that a fingerprint covers."""


def fingerprint(path: str | Path | None) -> str | None:
    """A content fingerprint of a model folder or data file, cheap at any size: sha256 over each file's
    name, size, first and last MiB (files of ``WEIGHT_SUFFIXES``, sorted; the folder itself for a
    file). Two different trainings of the same architecture differ in their first MiB of weights, so a
    replaced model folder is told from the original without reading its gigabytes. None for a path that
    does not exist here (a hub id: its name is what identifies it)."""
    if path is None:
        return None
    root = Path(path)
    if not root.exists():
        return None
    files = (
        sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
        if root.is_dir()
        else [root]
    )
    digest = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        digest.update(f"{f.relative_to(root) if root.is_dir() else f.name}:{size}".encode())
        with open(f, "rb") as handle:
            digest.update(handle.read(FINGERPRINT_BYTES))
            if size > FINGERPRINT_BYTES:
                handle.seek(max(size - FINGERPRINT_BYTES, FINGERPRINT_BYTES))
                digest.update(handle.read())
    return digest.hexdigest()[:16]


def input_fingerprints(cfg: PPOConfig | StageConfig) -> dict[str, str | None]:
    """The fingerprints a checkpoint records of what its run read: each model path (the distillation
    teachers' included) and data file."""
    models = {"model.path": cfg.model.path}
    if isinstance(cfg, PPOConfig):
        models |= {"ref.model_path": cfg.ref.model_path, "critic.model_path": cfg.critic.model_path}
        if cfg.distillation.enabled:  # teachers are not saved: named (the config) and fingerprinted
            models |= {
                f"distillation.teacher_models.{name}.model_path": t.model_path
                for name, t in cfg.distillation.teacher_models.items()
            }
    out = {key: fingerprint(path) for key, path in models.items() if path}
    out |= {f"data.train_files[{i}]": fingerprint(f) for i, f in enumerate(cfg.data.train_files)}
    return out
