"""What a run checkpoints and how it gets back to it: the loop's counters (``TrainerState``), everything
saved together (``Checkpointer``: models, optimizers, schedulers, the data loader, controllers, RNG), the
resume that falls back past a damaged checkpoint, and the rollback policy.

    checkpointer = make_checkpointer(cfg, info, out_dir, trained={"actor": actor},
                                     stateful={"trainer": state, "loader": loader})
    checkpointer.restore_newest(cfg.trainer.resume_mode)       # resume, if there is something to resume
    if save_due(state.step, total_steps, cfg.trainer.save_freq):
        checkpointer.save(state.step)
    roll_back(checkpointer, state, "KL exploded", lr_factor=0.5, max_rollbacks=3)

PPO (``ppo.build``) and the stages (``ppo.stage_loop``) checkpoint, schedule saves and stop alike through
these functions.

The file format (and reading untrusted files safely) is ``ppo.checkpoint_files``'s.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

from ppo.checkpoint_files import (
    CheckpointError,
    PendingSave,
    find_resume_dir,
    finish_save,
    load,
    resume_candidates,
    save,
    save_done,
)
from ppo.config import PPOConfig, StageConfig
from ppo.config_loader import to_dict, to_yaml
from ppo.distributed import WATCH, DistInfo, agree_on_failure, all_reduce_scalar, seed_everything
from ppo.optim import Trained
from ppo.run_folder import input_fingerprints

logger = logging.getLogger("ppo")


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
    keep: int | None
    """``trainer.max_ckpt_to_keep``: the newest checkpoints kept (None: all)."""
    seed: int
    """``trainer.seed``: new sampling streams derive from it when resuming on another world size."""
    models: dict[str, torch.nn.Module | None]
    optimizers: dict[str, torch.optim.Optimizer | None]
    schedulers: dict[str, Any]
    stateful: dict[str, Any]
    identity: dict[str, Any] = dataclasses.field(default_factory=dict)
    """What the run read (``run_folder.input_fingerprints``), saved with every checkpoint."""
    check: Callable[[Path], None] | None = None
    """Called with a checkpoint folder before it is restored; raises ``ResumeMismatch`` when the run
    may not continue it (``compare_runs``)."""
    after_restore: Callable[[Path], None] | None = None
    """Called with a checkpoint folder after it was restored (``apply_changes``: resume and rollback)."""
    async_group: Any = None
    """``trainer.async_save``: the process group of background saves (None: saves block)."""
    pending: PendingSave | None = None
    """The save in flight (``async_group``), completed by ``poll`` or ``wait``."""

    def save(self, step: int) -> None:
        """Write checkpoint ``step`` (collective: every rank calls it). With ``async_group`` the shards are
        written in the background and the checkpoint becomes ``latest`` when ``poll`` or ``wait`` finds
        them done; at most one save is in flight (a second waits for the first)."""
        self.wait()
        WATCH.enter("save", step)
        result = save(
            self.out_dir,
            step,
            models=self.models,
            optimizers=self.optimizers,
            schedulers=self.schedulers,
            extra={name: obj.state_dict() for name, obj in self.stateful.items()}
            | {"identity": self.identity},
            config_yaml=self.config_yaml,
            rank=self.info.rank,
            world_size=self.info.world_size,
            keep=self.keep,
            async_group=self.async_group,
        )
        self.pending = result if isinstance(result, PendingSave) else None

    def poll(self) -> None:
        """Complete the save in flight if every rank has written its shards (one all-reduce; collective)."""
        if self.pending is not None and all_reduce_scalar(float(save_done(self.pending)), "min") > 0:
            self.wait()

    def wait(self) -> None:
        """Complete the save in flight, waiting for its shards (collective; a no-op without one)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            finish_save(pending)

    def restore(self, ckpt_dir: Path, *, keep: dict[str, tuple[str, ...]] | None = None) -> None:
        """Load ``ckpt_dir`` into every model, optimizer, scheduler, stateful object and this rank's RNG.

        ``keep`` maps a stateful name to fields of it that keep their current values.
        """
        self.wait()  # a rollback to the checkpoint still being written
        config = ckpt_dir / "config.yaml"  # read after the load (apply_changes): named before it starts
        if not config.is_file():
            raise CheckpointError(f"{config} is missing: the checkpoint is damaged")
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
            try:
                if keep and name in keep:
                    obj.load_state_dict(extra[name], keep=keep[name])
                else:
                    obj.load_state_dict(extra[name])
            except (KeyError, TypeError, ValueError) as e:
                raise CheckpointError(
                    f"{ckpt_dir / 'trainer.json'}: its {name!r} state is damaged ({e})"
                ) from None
        if self.after_restore is not None:
            self.after_restore(ckpt_dir)
        if extra.get("world_size") != self.info.world_size:
            step = int(extra.get("trainer", {}).get("step", 0))
            seed_everything(self.seed * 1000 + self.info.rank + 1_000_003 * step)
            logger.warning(
                "resumed a checkpoint of %s ranks on %d ranks: models, optimizers and the data order continue "
                "exactly; the sampling RNG streams start anew from trainer.seed and the step",
                extra.get("world_size"),
                self.info.world_size,
            )

    def restore_newest(self, resume_mode: str) -> Path | None:
        """Restore the newest checkpoint that loads (``resume_candidates``); with ``auto`` a damaged one
        is skipped with a warning naming it and why. Every rank agrees on each attempt. None when there
        is nothing to resume."""
        candidates = resume_candidates(self.out_dir, resume_mode)
        for i, ckpt_dir in enumerate(candidates):
            if self.check is not None:  # a run that may not continue this checkpoint: no fallback
                agree_on_failure(lambda d=ckpt_dir: self.check(d), CheckpointError)
            try:
                agree_on_failure(lambda d=ckpt_dir: self.restore(d), CheckpointError)
                return ckpt_dir
            except CheckpointError as e:
                if i + 1 == len(candidates):
                    raise
                logger.warning("cannot resume from %s (%s); trying the next older checkpoint", ckpt_dir, e)
        return None

    def scale_learning_rates(self, factor: float) -> None:
        """Multiply every optimizer's learning rate, now and for the rest of its schedule."""
        for sched in self.schedulers.values():
            if sched is not None:
                sched.base_lrs = [lr * factor for lr in sched.base_lrs]
                for group in sched.optimizer.param_groups:
                    group["lr"] *= factor


def make_checkpointer(
    cfg: PPOConfig | StageConfig,
    info: DistInfo,
    out_dir: Path,
    *,
    trained: dict[str, Trained | None],
    stateful: dict[str, Any],
    frozen: dict[str, torch.nn.Module | None] | None = None,
) -> Checkpointer:
    """The run's checkpointer: the models of ``trained`` (None: the run has no such model) with their
    optimizers and schedules under the same names, ``frozen`` models that change without an optimizer
    (SPPO's old-policy snapshot: its trainable weights, no optimizer state), ``stateful`` objects, ``trainer.max_ckpt_to_keep``
    and ``trainer.seed``; what the run read is saved with each checkpoint, and a checkpoint is compared
    with the run before it is restored (``compare_runs``)."""
    identity = input_fingerprints(cfg)
    # Background saves run DCP's collectives in a thread: on a process group of their own, so they never
    # interleave with the training step's.
    async_group = dist.new_group(backend="gloo") if cfg.trainer.async_save and dist.is_initialized() else None
    return Checkpointer(
        async_group=async_group,
        identity=identity,
        check=lambda ckpt_dir: compare_runs(ckpt_dir, cfg, identity),
        after_restore=lambda ckpt_dir: apply_changes(ckpt_dir, cfg, trained, stateful.get("kl_ctrl")),
        out_dir=out_dir,
        info=info,
        config_yaml=to_yaml(cfg),
        keep=cfg.trainer.max_ckpt_to_keep,
        seed=cfg.trainer.seed,
        models={name: t.model if t else None for name, t in trained.items()} | (frozen or {}),
        # No optimizer: an empty tuple saves and restores an empty optimizer state.
        optimizers={name: t.optimizer if t else None for name, t in trained.items()}
        | {name: () for name in frozen or {}},
        schedulers={name: t.scheduler if t else None for name, t in trained.items()},
        stateful=stateful,
    )


def save_due(step: int, total_steps: int, save_freq: int) -> bool:
    """A periodic checkpoint is due: every ``trainer.save_freq`` steps and after the last (verl's rule;
    ``save_freq <= 0`` saves only when asked to stop)."""
    return save_freq > 0 and (step % save_freq == 0 or step == total_steps)


def log_stopped(step: int, signal_name: str | None) -> None:
    """The last line of a run that a stop signal ended (after its checkpoint)."""
    logger.warning("stopping: saved step %d (%s); resume with trainer.resume_mode=auto", step, signal_name)


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
    checkpointer.wait()  # the newest checkpoint may still be being written
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


# ----------------------------------------------------------------------------------------------------
# Resuming with changed settings
# ----------------------------------------------------------------------------------------------------


class ResumeMismatch(CheckpointError):
    """The run differs from the checkpoint in what must stay the same to continue it."""


MUST_MATCH = (
    "model.path",
    "actor.lora.rank",
    "critic.lora.rank",
    "ref.model_path",
    "critic.model_path",
    "algorithm.adv_estimator",
    "rollout.n",
    "rollout.source",
    "rollout.offline_fraction",
    "data.train_files",
    "data.train_batch_size",
    "data.shuffle",
    "data.prompt_key",
    "data.max_prompt_length",
    "data.max_response_length",
    "data.max_length",
    "data.pairs",
    "lora.rank",
    "loss.type",
    "trainer.seed",
)
"""Keys a resumed run must share with its checkpoint (those its config has): the models (and, through
the fingerprints, their content), whether adapters and a critic train, and every input of the data
order. A difference stops the run, listing every one."""

MUST_MATCH_TREES = ("model.override_config", "critic.override_config")
"""Mappings a resumed run must share with its checkpoint field by field: the Hugging Face config fields
the models were built with (a field added, removed or changed stops the run, as a changed model path
does). An empty mapping and one a checkpoint never recorded are the same."""

APPLIED_ON_RESUME = {
    "actor.optim.lr": "the actor's learning rate",
    "critic.optim.lr": "the critic's learning rate",
    "optim.lr": "the learning rate",
    "algorithm.kl_ctrl.kl_coef": "the in-reward KL coefficient",
}
"""Settings that live in the checkpoint's state too (optimizer schedules, the KL controller): a change
on resume is applied to that state (``apply_changes``). Every other difference (steps, frequencies,
logging, loss coefficients, ...) takes effect by itself and is logged."""


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config dicts as ``{"a.b.c": value}``."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def compare_runs(ckpt_dir: Path, cfg: PPOConfig | StageConfig, identity: dict[str, Any]) -> dict[str, tuple]:
    """Compare a checkpoint with the run about to continue it; every rank calls it.

    Raises ``ResumeMismatch`` listing each ``MUST_MATCH`` key that differs and each input whose
    fingerprint changed (same path, other content: a replaced model folder or data file); returns the
    other differences ``{key: (old, new)}``, after logging them. A checkpoint written before the
    fingerprints were recorded is compared on its config alone.
    """
    try:
        saved = flatten(yaml.safe_load((ckpt_dir / "config.yaml").read_text()) or {})
        saved_identity = json.loads((ckpt_dir / "trainer.json").read_text()).get("identity", {})
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        return {}  # a damaged checkpoint: restoring it names the file (and auto falls back past it)
    now = flatten(to_dict(cfg))
    differ = [
        key for key in MUST_MATCH if key in now and key in saved and not same(key, saved[key], now[key])
    ]
    problems = [f"{key}: {saved[key]!r} -> {now[key]!r}" for key in differ]
    problems += tree_differences(saved, now, MUST_MATCH_TREES)
    problems += snapshot_difference(saved, now)
    problems += [  # same path, other content (a path that changed is reported above)
        f"{key}: its content changed since the checkpoint (fingerprint {saved_identity[key]} -> {value})"
        for key, value in identity.items()
        if key.split("[")[0] not in differ
        and key in saved_identity
        and value is not None
        and saved_identity[key] not in (None, value)
    ]
    if problems:
        raise ResumeMismatch(
            f"cannot resume {ckpt_dir}: the run differs from it in what must stay the same to continue it: "
            f"{'; '.join(problems)}. Restore those settings, or start a new run in another trainer.output_dir"
        )
    changed = {
        key: (saved[key], value)
        for key, value in now.items()
        if key in saved and not same(key, saved[key], value) and key != "trainer.resume_mode"
    }
    for key, (old, new) in changed.items():
        what = APPLIED_ON_RESUME.get(key)
        logger.warning(
            "resuming with %s changed: %r -> %r%s",
            key,
            old,
            new,
            f" ({what}, applied to the restored state)" if what else "",
        )
    return changed


PATH_KEYS = ("model.path", "ref.model_path", "critic.model_path", "data.train_files")
"""Keys of ``MUST_MATCH`` that name files: the same file spelled relative or absolute (or through a link)
is the same."""


def same(key: str, saved: Any, now: Any) -> bool:
    """Whether a key's value in the checkpoint's config and in this run's is the same: equal, or for a
    path of ``PATH_KEYS`` (each path of a list) the same existing file or folder here, however spelled
    (``data/x.parquet`` and ``/home/me/data/x.parquet``). A hub id stays compared by name."""
    if saved == now:
        return True
    if key not in PATH_KEYS:
        return False
    olds, news = (saved, now) if isinstance(saved, list) and isinstance(now, list) else ([saved], [now])
    return len(olds) == len(news) and all(_same_file(a, b) for a, b in zip(olds, news, strict=True))


def _same_file(a: Any, b: Any) -> bool:
    """Whether two paths name the same existing file or folder here (or are the same text)."""
    if a == b:
        return True
    if not isinstance(a, str) or not isinstance(b, str) or not a or not b:
        return False
    pa, pb = Path(os.path.expanduser(a)), Path(os.path.expanduser(b))
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def snapshot_difference(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``"actor.sppo_refresh_steps: 1 -> 4 (...)"`` when the checkpoint and this run differ in whether they
    keep SPPO's old-policy snapshot, which a checkpoint holds only when ``actor.policy_loss.loss_mode=sppo``
    and ``actor.sppo_refresh_steps > 1``: without this, the load would fail on the snapshot's weights, as
    if the model's shapes had changed."""
    keys = ("actor.policy_loss.loss_mode", "actor.sppo_refresh_steps")
    if not all(key in saved and key in now for key in keys):
        return []

    def keeps(flat: dict[str, Any]) -> bool:
        return flat[keys[0]] == "sppo" and isinstance(flat[keys[1]], int) and flat[keys[1]] > 1

    if keeps(saved) == keeps(now):
        return []
    has = "holds SPPO's old-policy snapshot" if keeps(saved) else "holds no SPPO old-policy snapshot"
    changed = [f"{key}: {saved[key]!r} -> {now[key]!r}" for key in keys if saved[key] != now[key]]
    return [
        f"{'; '.join(changed)} (the checkpoint {has}, which is saved only with actor.policy_loss.loss_mode=sppo "
        f"and actor.sppo_refresh_steps > 1)"
    ]


def tree_differences(saved: dict[str, Any], now: dict[str, Any], trees: tuple[str, ...]) -> list[str]:
    """``"key: old -> new"`` for each flattened key under one of ``trees`` that differs between ``saved``
    and ``now``; a key only one of them has shows ``(unset)`` on the other side."""
    prefixes = tuple(f"{tree}." for tree in trees)
    keys = sorted(k for k in saved.keys() | now.keys() if k.startswith(prefixes))
    return [
        f"{key}: {_shown(saved, key)} -> {_shown(now, key)}"
        for key in keys
        if (key in saved) != (key in now) or saved.get(key) != now.get(key)
    ]


def _shown(flat: dict[str, Any], key: str) -> str:
    return repr(flat[key]) if key in flat else "(unset)"


def apply_changes(
    ckpt_dir: Path, cfg: PPOConfig | StageConfig, trained: dict[str, Trained | None], kl_ctrl: Any = None
) -> None:
    """After restoring ``ckpt_dir``: a learning rate or in-reward KL coefficient set differently now than
    in the checkpoint's config replaces the restored one for the rest of the schedule
    (``APPLIED_ON_RESUME``); a learning rate keeps the checkpoint's rollback scale."""
    saved = flatten(yaml.safe_load((ckpt_dir / "config.yaml").read_text()) or {})
    now = flatten(to_dict(cfg))
    lr_scale = _saved_lr_scale(ckpt_dir)
    for name, t in trained.items():
        key = f"{name}.optim.lr" if f"{name}.optim.lr" in now else "optim.lr"
        if t is not None and key in saved and saved[key] != now[key]:
            sched = t.scheduler
            sched.base_lrs = [now[key] * lr_scale for _ in sched.base_lrs]
            for group, base, factor in zip(
                sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas, strict=True
            ):
                group["lr"] = base * factor(sched.last_epoch)
    key = "algorithm.kl_ctrl.kl_coef"
    if kl_ctrl is not None and key in saved and saved[key] != now[key]:
        kl_ctrl.value = float(now[key])
