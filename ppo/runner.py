"""The one run harness of the four trainers: PPO (``train_ppo.py``), SFT, the reward model and DPO:
the command line, the error boundary and the run folder.

Every entry point is ``sys.exit(runner.main(argv, ConfigClass, train, __doc__))``; ``main`` parses the
command line, joins the process group and calls ``train(cfg, info)`` inside the error boundary; ``train``
claims the run folder first and writes its final numbers there last::

    def train(cfg: SFTConfig, info: DistInfo) -> None:
        out_dir = runner.prepare_run(cfg, info)    # locked, checked, the config written, every rank seeded
        ...                                        # models: ppo.model_setup; the loop: ppo.stage_loop
        runner.write_final_metrics(save_path.parent, info, {"sft_val_accuracy": accuracy})

Error boundary: an expected failure (bad config, data, model path, checkpoint, reward function, an
I/O error) ends as one line on rank 0 and exit code 2; an unexpected exception prints its traceback
once and exits with 1. Ranks other than 0 wait a moment before reporting, so that when every rank
fails alike, torchrun (which stops the others as soon as one rank exits) keeps only rank 0's report,
and when a single rank fails, its report is still printed. Under torchrun the report also goes to the
rank's error file (``ERROR_FILE``), so that torchrun's failure summary names it as the root cause
(torchrun itself then exits with 1, whatever the rank's code).

Every rank runs every function here; the ones that write files do so on rank 0 only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import transformers
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from ppo import data_files, input_paths, run_folder, user_code
from ppo.checkpoint_files import CheckpointError, checkpoints_dir, step_of
from ppo.cli import REPORT_DELAY_S, config_error, config_file, parse_cli, print_config
from ppo.config import (
    ConfigError,
    DPOConfig,
    PPOConfig,
    RewardModelConfig,
    SFTConfig,
    StageConfig,
    validate_stage,
)
from ppo.config_loader import to_yaml
from ppo.distributed import (
    WATCH,
    DistInfo,
    broadcast_object,
    destroy_distributed,
    flush_std_streams,
    init_distributed,
    is_collective_timeout,
    seed_everything,
    setup_logging,
)
from ppo.step_end import TrainingError
from ppo.trackers import check_trackers

logger = logging.getLogger("ppo")

AnyConfig = TypeVar("AnyConfig", PPOConfig, SFTConfig, RewardModelConfig, DPOConfig)
"""The config class of one of the entry points."""


EXPECTED_ERRORS = (
    ConfigError,
    data_files.DataError,
    CheckpointError,
    user_code.UserCodeError,
    TrainingError,
    OSError,  # a missing model folder (input_paths.ModelPathError), a full disk, a permission
)
"""Failures caused by the user's input or the machine: one line on rank 0, exit code 2."""


class ErrorFile(ErrorHandler):
    """This rank's torchrun error file (``TORCHELASTIC_ERROR_FILE``, which torchrun sets for each worker),
    in the format of torch.distributed.elastic's ``ErrorHandler``: torchrun's failure summary shows the
    root cause's file ("traceback : ...") instead of a link to its docs. Without torchrun nothing is
    written. ``record`` (below) writes the exceptions that escape ``main``; ``main`` writes the failures
    it reports itself with ``write``: the one-line message, or a traceback."""

    def initialize(self) -> None:
        # torch's enables faulthandler on sys.stderr, and warns when that has no file descriptor (a
        # captured stderr): only where it has one.
        with contextlib.suppress(AttributeError, OSError, ValueError):
            sys.stderr.fileno()
            super().initialize()

    def write(self, message: str, details: str | None = None) -> None:
        """Record ``message`` (and ``details``, a traceback, shown in its place) as this rank's failure."""
        path = self._get_error_file_path()
        if path:
            stamp = str(int(time.time()))
            info = {"py_callstack": details or message, "timestamp": stamp}
            self._write_error_file(path, json.dumps({"message": {"message": message, "extraInfo": info}}))


ERROR_FILE = ErrorFile()

# ----------------------------------------------------------------------------------------------------
# Entry point and error boundary
# ----------------------------------------------------------------------------------------------------


def main(
    argv: list[str] | None,
    cls: type[AnyConfig],
    train: Callable[[AnyConfig, DistInfo], None],
    description: str,
) -> int:
    """Parse the command line, join the process group and call ``train(cfg, info)``; the exit code.

    ``--print-config`` prints the resolved config and exits (validated for ``--world-size`` if given).
    """
    return record(_main, error_handler=ERROR_FILE)(argv, cls, train, description)


def _main(
    argv: list[str] | None,
    cls: type[AnyConfig],
    train: Callable[[AnyConfig, DistInfo], None],
    description: str,
) -> int:
    if threading.current_thread() is threading.main_thread():  # answer_early's quiet exit held for imports
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        cfg, args = parse_cli(argv, cls, description=description)
    except ConfigError as e:
        ERROR_FILE.write(f"config error: {one_line(e)}", f"config error: {e}")  # a list stays a list
        return config_error(e)
    if args.print_config:
        return print_config(cfg, args)
    try:
        info = init_distributed(cfg.trainer.device, cfg.trainer.dist_timeout_s)
    except RuntimeError as e:  # trainer.device=cuda without a GPU, ranks that never join
        print(f"error: {one_line(e)}", file=sys.stderr)
        ERROR_FILE.write(one_line(e))
        return 2
    setup_logging(info.is_main)
    quiet_other_ranks(info)
    try:
        validate_config(cfg, info.world_size)
        keep_preset(cfg, config_file(args), info)
        if info.is_main:
            for warning in [*args.notes, *cfg.warnings()]:
                logger.warning("%s", warning)
        train(cfg, info)
    except EXPECTED_ERRORS as e:
        message = one_line(e)
        report(info, lambda: failed(message))
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C: out at once, no traceback
        if info.is_main:
            logger.warning("%s", interrupted(Path(cfg.trainer.output_dir)))
        return 130
    except Exception as e:
        if is_collective_timeout(e):  # where every rank was, not gloo's or NCCL's internals
            message = WATCH.describe_timeout(info.world_size, e)
            report(info, lambda: failed(message))
            return 1
        text = traceback.format_exc()
        report(info, lambda: failed(f"unexpected error on rank {info.rank}", text))
        return 1
    finally:
        if info.is_main:
            run_folder.release_lock(Path(cfg.trainer.output_dir) / run_folder.LOCK_FILE)
        destroy_distributed()
        # Our last line is out, whole, before torchrun (which reads nothing of ours) prints its summary.
        flush_std_streams()
    return 0


def interrupted(out_dir: Path) -> str:
    """The last line of a run that Ctrl-C ended at once: what is left to resume in ``out_dir``."""
    latest = checkpoints_dir(out_dir) / "latest"
    if latest.is_file():
        step = step_of(Path(latest.read_text().strip()))
        return f"interrupted: the last complete checkpoint, step {step}, is intact (trainer.resume_mode=auto resumes it)"
    return f"interrupted before the first checkpoint was saved: {out_dir} holds nothing to resume"


def validate_config(cfg: PPOConfig | StageConfig, world_size: int) -> None:
    """The world-size checks of the config (batch divisibility, shard groups), after the launcher's, and
    that every tracker of ``trainer.logger`` imports (before the run folder is made or a model loads)."""
    check_launcher(cfg, world_size, os.environ, script=os.path.basename(sys.argv[0]) or "train_ppo.py")
    check_trackers(cfg.trainer.logger)
    if isinstance(cfg, PPOConfig):
        cfg.validate(world_size)
    else:
        validate_stage(cfg, world_size)


def check_launcher(
    cfg: PPOConfig | StageConfig, world_size: int, environ: Mapping[str, str], *, script: str
) -> None:
    """A preset sized for several ranks (``trainer.nnodes x trainer.n_gpus_per_node``) started as one
    plain ``python`` process (no ``WORLD_SIZE``): a ConfigError with the torchrun command that launches
    it, instead of the batch-size errors a world of one would give."""
    t = cfg.trainer
    planned = getattr(t, "planned_world_size", None)
    if world_size != 1 or "WORLD_SIZE" in environ or planned is None or planned <= 1:
        return
    nodes = f"--nnodes={t.nnodes} " if (t.nnodes or 1) > 1 else ""
    raise ConfigError(
        f"trainer.nnodes={t.nnodes} x trainer.n_gpus_per_node={t.n_gpus_per_node} plans {planned} ranks, but "
        f"this is one process started without torchrun (WORLD_SIZE is not set): launch it with "
        f"`torchrun {nodes}--nproc_per_node={t.n_gpus_per_node or 1} {script} ...` (several nodes: "
        "scripts/slurm/), or set trainer.n_gpus_per_node=null trainer.nnodes=null to run as one process"
    )


def one_line(error: BaseException) -> str:
    """An error's message on one line (the ones from the config may list several problems)."""
    text = str(error) or type(error).__name__
    if isinstance(error, OSError) and not isinstance(error, input_paths.ModelPathError) and error.filename:
        text = f"{error.strerror or text}: {error.filename}"
    return " | ".join(part.strip() for part in text.splitlines() if part.strip())


def failed(message: str, details: str | None = None) -> None:
    """Log a fatal error (``details``, a traceback, after ``message``) and record it in torchrun's error
    file."""
    logger.error("%s", message if details is None else f"{message}:\n{details}")
    ERROR_FILE.write(message, details)


def report(info: DistInfo, log: Callable[[], None]) -> None:
    """Log a fatal error on rank 0 at once, elsewhere after ``REPORT_DELAY_S`` (see the module doc)."""
    if not info.is_main:
        time.sleep(REPORT_DELAY_S)
    log()


def quiet_other_ranks(info: DistInfo) -> None:
    """Loading reports and progress bars once, from rank 0; a tiny model needs no bars anyway."""
    transformers.utils.logging.disable_progress_bar()
    if not info.is_main:
        transformers.utils.logging.set_verbosity_error()


# ----------------------------------------------------------------------------------------------------
# The run folder
# ----------------------------------------------------------------------------------------------------


def prepare_run(cfg: PPOConfig | StageConfig, info: DistInfo) -> Path:
    """Lock and check the run folder and every path the run will write (``run_folder.claim``: one run
    per folder, nothing replaced without ``trainer.overwrite``, no input written, kinds and permissions),
    write the resolved config (rank 0), and seed every rank alike. Raises CheckpointError on every rank
    when rank 0 finds a problem; nothing has loaded yet."""
    error = None
    if info.is_main:
        try:
            out_dir = run_folder.claim(cfg)
            (out_dir / "config.yaml").write_text(to_yaml(cfg))
        except (CheckpointError, OSError) as e:
            error = one_line(e)
    # Only rank 0 writes, but every rank must stop if it cannot, or the others wait in a collective.
    error = broadcast_object(error)
    if error is not None:
        raise CheckpointError(error)
    seed_everything(cfg.trainer.seed)  # the same on every rank while models are built
    return Path(cfg.trainer.output_dir)


def keep_preset(cfg: PPOConfig | StageConfig, preset: str | None, info: DistInfo) -> None:
    """Refuse a ``--config`` file that the run would write over or delete (``run_folder.refuse_writing_preset``:
    one inside ``trainer.output_dir``), before anything is written. Checked on rank 0, raised on every
    rank."""
    error = None
    if info.is_main:
        try:
            run_folder.refuse_writing_preset(cfg, preset, to_yaml(cfg))
        except (CheckpointError, OSError) as e:
            error = one_line(e)
    error = broadcast_object(error)
    if error is not None:
        raise CheckpointError(error)


def merge_metrics(path: Path, updates: dict[str, Any]) -> dict[str, Any]:
    """Merge ``updates`` into the JSON object at ``path`` (created if missing) and return the result.

    Keys of other stages are kept. Written to a temporary file and renamed, so a reader never sees
    half a file.
    """
    merged: dict[str, Any] = {}
    if path.is_file():
        try:
            merged = json.loads(path.read_text())
        except json.JSONDecodeError:
            logger.warning("%s is not valid JSON; starting it afresh", path)
        if not isinstance(merged, dict):
            merged = {}
    merged.update(updates)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return merged


def write_final_metrics(folder: Path, info: DistInfo, updates: dict[str, Any]) -> None:
    """Merge a stage's final numbers into ``folder/metrics.json`` (rank 0)."""
    if info.is_main:
        path = folder / run_folder.METRICS_FILE
        merge_metrics(path, updates)
        logger.info("final: %s -> %s", json.dumps(updates, sort_keys=True), path)
