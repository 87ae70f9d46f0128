"""The JSON-lines logs of a run and the trackers ``trainer.logger`` names, as verl 0.9.1's
``verl.utils.tracking`` sets them up (wandb, mlflow, swanlab, trackio, clearml) and its ``file`` logger
(``{"step": ..., "data": {...}}`` lines). A tracker's package is an extra of the same name
(``pip install 'ppo-rlhf[mlflow]'``); ``check_trackers`` stops the run at start-up without it. Each
tracker is an object with ``log(metrics, step)`` and ``finish()``, started on rank 0 by
``ppo.metrics.MetricsLogger``. The JSON-lines files are strict JSON (``finite_or_none``)."""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Any

from ppo.config import ConfigError

logger = logging.getLogger("ppo")


def finite_or_none(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with NaN and infinite floats as None (JSON ``null``: ``NaN`` is not JSON, and strict
    parsers, ``jq`` and most dashboards reject the line)."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}


def truncate_after(path: Path, step: int) -> None:
    """Drop the lines of steps after ``step`` (logged by a run that died before its next checkpoint), so
    a resumed run's file reads as if it had never stopped."""
    lines = path.read_text().splitlines(keepends=True)
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (json.JSONDecodeError, KeyError):
            continue  # a line cut short by the kill
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)


def open_log(path: Path, resume_step: int | None) -> Any:
    """A JSON-lines log of the run: a fresh run starts a fresh file, a resumed one continues it after
    dropping the lines of steps past its checkpoint (``truncate_after``)."""
    if resume_step is None:
        return open(path, "w")
    if path.exists():
        truncate_after(path, resume_step)
    return open(path, "a")


TRACKERS = ("wandb", "mlflow", "swanlab", "trackio", "clearml")
"""The trackers ``trainer.logger`` may name: each the name of the module it imports and of the extra in
pyproject.toml that installs it."""


def check_trackers(sinks: list[str]) -> None:
    """Raise ConfigError (one line naming the extra) when a tracker in ``sinks`` does not import here:
    called as the run starts, before any model loads, and again where the trackers start."""
    for name in sinks:
        if name not in TRACKERS:
            continue
        try:
            importlib.import_module(name)
        except ImportError as e:
            missing = isinstance(e, ModuleNotFoundError) and e.name == name
            why = "is not installed" if missing else f"does not import ({' '.join(str(e).split())})"
            raise ConfigError(
                f"trainer.logger names {name} but {name} {why}: pip install 'ppo-rlhf[{name}]'"
            ) from None


def start_tracker(
    name: str, project: str, run_name: str, config: dict, out: Path, resume_step: int | None
) -> Any:
    """The tracker ``name`` started for this run (rank 0): an object with ``log(metrics, step)`` and
    ``finish()``. ``project`` is ``trainer.project_name``, ``run_name`` ``trainer.experiment_name``."""
    if name == "wandb":
        return WandbTracker(project, run_name, config, out)
    if name == "mlflow":
        return MlflowTracker(project, run_name, config)
    if name == "swanlab":
        return SwanlabTracker(project, run_name, config)
    if name == "trackio":
        return TrackioTracker(project, run_name, config)
    if name == "clearml":
        return ClearmlTracker(project, run_name, config)
    if name == "file":
        return FileTracker(project, run_name, resume_step)
    raise ValueError(f"no tracker {name!r}")


class WandbTracker:
    """A wandb run: project, name and config; its files under the run folder (``wandb/``); the entity from
    ``WANDB_ENTITY`` (wandb reads it, as verl passes it)."""

    def __init__(self, project: str, run_name: str, config: dict, out: Path) -> None:
        import wandb

        self.run = wandb.init(project=project, name=run_name, config=config, dir=str(out))

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self) -> None:
        self.run.finish()


MLFLOW_DEFAULT_URI = "sqlite:////tmp/mlruns.db"
"""verl's tracking URI when ``MLFLOW_TRACKING_URI`` is unset."""


class MlflowTracker:
    """An MLflow run in the experiment ``project`` named ``run_name`` (``MLFLOW_RUN_ID`` set: that run,
    continued), at ``MLFLOW_TRACKING_URI`` (verl's default ``sqlite:////tmp/mlruns.db``). The config goes
    in as params with verl's flat names (``trainer/project_name``; a list's items ``.../0``, ``.../1`` and
    its ``.../list_len``); metric names MLflow refuses are rewritten as verl does (``mlflow_key``)."""

    def __init__(self, project: str, run_name: str, config: dict) -> None:
        import mlflow

        uri = os.environ.get("MLFLOW_TRACKING_URI", MLFLOW_DEFAULT_URI)
        logger.info("mlflow: tracking URI %s", uri)
        mlflow.set_tracking_uri(uri)
        run_id = os.environ.get("MLFLOW_RUN_ID")  # set by hosted platforms (Azure ML, Databricks)
        if run_id:
            self.run = mlflow.start_run(run_id=run_id)
        else:
            experiment = mlflow.set_experiment(project)
            self.run = mlflow.start_run(experiment_id=experiment.experiment_id, run_name=run_name)
        mlflow.log_params(mlflow_params(config))
        self.mlflow = mlflow

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics({mlflow_key(k): v for k, v in metrics.items()}, step=step)

    def finish(self) -> None:
        if self.mlflow.active_run() is not None:
            self.mlflow.end_run()


def mlflow_params(config: dict, prefix: str = "") -> dict[str, Any]:
    """``config`` flattened as verl logs it to MLflow: nested keys joined by ``/``, a list as a dict of its
    items by index plus ``list_len``; an empty dict or list is kept as the value itself."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, list):
            value = {"list_len": len(value)} | {str(i): v for i, v in enumerate(value)}
        if isinstance(value, dict) and value:
            out |= mlflow_params(value, name + "/")
        else:
            out[name] = value
    return out


def mlflow_key(key: str) -> str:
    """A metric name MLflow accepts, made as verl makes it: ``@`` -> ``_at_``, runs of ``/`` -> one,
    other characters outside letters, digits, ``_ / . - :`` and space -> ``_``."""
    key = re.sub(r"/+", "/", key.replace("@", "_at_"))
    return re.sub(r"[^/\w.\- :]", "_", key)


class SwanlabTracker:
    """A SwanLab experiment ``run_name`` in ``project`` with the config, as verl sets it up:
    ``SWANLAB_MODE`` (verl's default ``cloud``; ``local`` or ``offline`` keep it on this machine),
    ``SWANLAB_LOG_DIR`` (default ``swanlog`` in the working folder), ``SWANLAB_API_KEY`` to log in."""

    def __init__(self, project: str, run_name: str, config: dict) -> None:
        import swanlab

        api_key = os.environ.get("SWANLAB_API_KEY")
        if api_key:
            swanlab.login(api_key)
        swanlab.init(
            project=project,
            experiment_name=run_name,
            config=config,
            logdir=os.environ.get("SWANLAB_LOG_DIR", "swanlog"),
            mode=os.environ.get("SWANLAB_MODE", "cloud"),
        )
        self.swanlab = swanlab

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.swanlab.log(metrics, step=step)

    def finish(self) -> None:
        self.swanlab.finish()


class TrackioTracker:
    """A trackio run ``run_name`` in ``project`` with the config (local by default: trackio's database in
    ``TRACKIO_DIR``; ``trackio show`` opens it); a run already started in this process is continued, as
    verl does."""

    def __init__(self, project: str, run_name: str, config: dict) -> None:
        import trackio
        from trackio import context_vars

        if context_vars.current_run.get() is None:
            trackio.init(project=project, name=run_name, config=config)
        self.trackio = trackio
        self.context_vars = context_vars

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.trackio.log(metrics, step=step)

    def finish(self) -> None:
        if self.context_vars.current_run.get() is not None:
            self.trackio.finish()


class ClearmlTracker:
    """A ClearML task ``run_name`` in the project ``project`` (the last one of that name continued, no
    model upload, as verl), the config as its ``Hyperparameters`` configuration, each metric
    ``title/series`` as a scalar of title ``title`` and series ``series``. ClearML's own TensorBoard
    capture is off: the run's TensorBoard events would report every scalar a second time."""

    def __init__(self, project: str, run_name: str, config: dict) -> None:
        import clearml

        self.task = clearml.Task.init(
            project_name=project,
            task_name=run_name,
            continue_last_task=True,
            output_uri=False,
            auto_connect_frameworks={"tensorboard": False},
        )
        self.task.connect_configuration(config, name="Hyperparameters")

    def log(self, metrics: dict[str, float], step: int) -> None:
        report = self.task.get_logger()
        for key, value in metrics.items():
            title, _, series = key.partition("/")
            report.report_scalar(title=title, series=series or title, value=value, iteration=step)

    def finish(self) -> None:
        self.task.close()


class FileTracker:
    """verl's ``file`` logger: one JSON line ``{"step": s, "data": {metric: value}}`` per step, at
    ``VERL_FILE_LOGGER_PATH``, else ``{VERL_FILE_LOGGER_ROOT or .}/{project}/{run_name}.jsonl``. A resumed
    run continues the file after dropping the steps past its checkpoint (verl's starts it afresh)."""

    def __init__(self, project: str, run_name: str, resume_step: int | None) -> None:
        path = os.environ.get("VERL_FILE_LOGGER_PATH")
        if path is None:
            root = os.path.expanduser(os.environ.get("VERL_FILE_LOGGER_ROOT", "."))
            path = os.path.join(root, project, f"{run_name}.jsonl")
        self.path = Path(path).absolute()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        logger.info("file logger: %s", self.path)
        self.fp = open_log(self.path, resume_step)

    def log(self, metrics: dict[str, float], step: int) -> None:
        row = {"step": step, "data": finite_or_none(metrics)}
        self.fp.write(json.dumps(row, allow_nan=False) + "\n")
        self.fp.flush()

    def finish(self) -> None:
        self.fp.close()
