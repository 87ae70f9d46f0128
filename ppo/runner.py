"""The one run harness of the four trainers: PPO (``train_ppo.py``), SFT, the reward model and DPO.

Every entry point is ``sys.exit(runner.main(argv, ConfigClass, train, __doc__))``; ``main`` parses the
command line, joins the process group and calls ``train(cfg, info)`` inside the error boundary. The
pieces every ``train`` shares live here too, so they are written once::

    def train(cfg: SFTConfig, info: DistInfo) -> None:
        out_dir = runner.prepare_run(cfg, info)
        tokenizer = runner.load_tokenizer(cfg.model)
        model = runner.build_model(
            model_loading.load_causal_lm, cfg.model, cfg.fsdp, info, path_key="model.path"
        )
        trained = with_optimizer(model, cfg.optim, num_steps)
        ...
        grad_norm, skipped = optimizer_step(model, trained.optimizer, cfg.trainer.grad_clip)  # ppo.optim

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
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import transformers
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ppo import (
    attention,
    checkpoint_files,
    data,
    data_files,
    input_paths,
    lora,
    model_loading,
    models,
    rule_scoring,
    run_folder,
    sharding,
    ulysses,
)
from ppo.checkpoint_files import CheckpointError
from ppo.cli import REPORT_DELAY_S, config_error, parse_cli, print_config
from ppo.config import (
    ConfigError,
    DPOConfig,
    FSDPConfig,
    LoRAConfig,
    ModelConfig,
    PPOConfig,
    PreferenceRefConfig,
    RefConfig,
    RewardModelConfig,
    SFTConfig,
    StageConfig,
    validate_stage,
)
from ppo.config_loader import to_dict, to_yaml
from ppo.distributed import (
    WATCH,
    DistInfo,
    all_reduce_scalar,
    broadcast_object,
    destroy_distributed,
    flush_std_streams,
    init_distributed,
    is_collective_timeout,
    make_mesh,
    setup_logging,
)
from ppo.metrics import MetricsLogger
from ppo.step_end import TrainingError

logger = logging.getLogger("ppo")

AnyConfig = TypeVar("AnyConfig", PPOConfig, SFTConfig, RewardModelConfig, DPOConfig)
"""The config class of one of the entry points."""


EXPECTED_ERRORS = (
    ConfigError,
    data_files.DataError,
    CheckpointError,
    rule_scoring.RewardError,
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
# Entry point and set-up
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
            logger.warning("interrupted; the last complete checkpoint is intact (trainer.resume_mode=auto)")
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


def validate_config(cfg: PPOConfig | StageConfig, world_size: int) -> None:
    """The world-size checks of the config (batch divisibility, shard groups), after the launcher's."""
    check_launcher(cfg, world_size, os.environ, script=os.path.basename(sys.argv[0]) or "train_ppo.py")
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
    checkpoint_files.seed_everything(cfg.trainer.seed)  # the same on every rank while models are built
    return Path(cfg.trainer.output_dir)


def load_tokenizer(model_cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The tokenizer of ``model.tokenizer_path`` (default ``model.path``); errors name the key used."""
    key = "model.tokenizer_path" if model_cfg.tokenizer_path else "model.path"
    logger.info("start-up: loading the tokenizer (%s=%s)", key, model_cfg.tokenizer_path or model_cfg.path)
    return model_loading.load_tokenizer(
        model_cfg.tokenizer_path or model_cfg.path, model_cfg.trust_remote_code, config_key=key
    )


def build_model(
    load: Callable[..., PreTrainedModel],
    model_cfg: ModelConfig,
    fsdp: FSDPConfig,
    info: DistInfo,
    *,
    path: str | None = None,
    path_key: str = "model.path",
    trainable: bool = True,
    sequence_parallel: int = 1,
    sp_key: str = "actor.ulysses_sequence_parallel_size",
    lora_cfg: LoRAConfig | None = None,
    lora_key: str = "",
    trainable_head: str | None = None,
) -> nn.Module:
    """Load a model on the CPU with ``load`` (a ``model_loading.load_*``), then shard it onto the device.

    Weights load on CPU and move to the device shard by shard inside ``fully_shard``, so no rank ever
    holds a whole model on the accelerator; the attention kernel is picked for the device it will run
    on (and for Ulysses sequence parallelism, ``sequence_parallel`` ranks per group, whose heads are
    checked). A model that trains is put in training mode (dropout is off from loading; transformers
    recomputes checkpointed layers only in training mode) with gradient checkpointing as configured;
    a frozen one gets ``requires_grad=False`` and eval mode.
    """
    attn = attention.resolve_attn_implementation(
        model_cfg.attn_implementation, info.device, sequence_parallel=sequence_parallel > 1
    )
    path = path or model_cfg.path
    lora_cfg = lora_cfg or LoRAConfig()  # rank 0: no adapters (a saved adapter folder is still merged)
    logger.info("start-up: loading %s=%s (%s)", path_key, path, "trained" if trainable else "frozen")
    with main_rank_logs(info):  # e.g. "fresh score head" once, not once per rank
        model = load(
            lora.base_model_path(path, config_key=path_key),
            dtype=lora.load_dtype(lora_cfg, model_cfg.dtype),
            attn_implementation=attn,
            trust_remote_code=model_cfg.trust_remote_code,
            device="cpu",
            config_key=path_key,
        )
        model = lora.apply_lora(
            model,
            lora_cfg,
            model_dtype=model_cfg.dtype,
            trainable_head=trainable_head,
            config_key=lora_key,
            init_from=path,
        )
    logger.info("%s (%s): attention %s", path or model_cfg.path, type(model).__name__, attn)
    if sequence_parallel > 1:
        ulysses.check_heads(model.config, sequence_parallel, sp_key)
    if trainable:
        if model_cfg.enable_gradient_checkpointing:
            models.enable_gradient_checkpointing(model)
        model.train()
    else:
        model.requires_grad_(False)
        model.eval()
    if (
        info.world_size == 1
        and not fsdp.param_offload
        and fsdp.mixed_precision.param_dtype == model_cfg.dtype
    ):
        # Nothing to shard, offload or cast: FSDP's hooks and its collectives on a world of one would
        # only cost time (a third of a tiny model's step on CPU, scripts/bench_overhead.py).
        return model.to(info.device)
    logger.info("start-up: sharding %s over %d ranks (FSDP2) onto %s", path, info.world_size, info.device)
    return sharding.shard_model(model, make_mesh(info, fsdp.fsdp_size), fsdp, device=info.device)


def load_reference(
    model_cfg: ModelConfig,
    ref: RefConfig | PreferenceRefConfig,
    lora_cfg: LoRAConfig,
    info: DistInfo,
    policy: nn.Module,
    *,
    sequence_parallel: int = 1,
) -> nn.Module:
    """The frozen reference policy: ``policy`` itself under LoRA without ``ref.model_path`` (every
    reference forward then runs in ``lora.adapters_disabled``: no second copy is loaded), else
    ``ref.model_path`` (default ``model.path``) loaded, sharded by ``ref.fsdp`` and frozen."""
    if lora.uses_lora(lora_cfg) and ref.model_path is None:
        return policy
    return build_model(
        model_loading.load_causal_lm,
        model_cfg,
        ref.fsdp,
        info,
        path=ref.model_path or model_cfg.path,
        path_key="ref.model_path" if ref.model_path else "model.path",
        trainable=False,
        sequence_parallel=sequence_parallel,
    )


def make_loader(records: Sequence[Any], cfg: PPOConfig | StageConfig, info: DistInfo) -> data.ShardedLoader:
    """This rank's contiguous share of each global batch, from a permutation seeded by
    ``(trainer.seed, epoch)``."""
    return data.ShardedLoader(
        records,
        batch_size=cfg.data.train_batch_size,
        rank=info.rank,
        world_size=info.world_size,
        seed=cfg.trainer.seed,
        shuffle=cfg.data.shuffle,
    )


def total_steps(cfg: PPOConfig | StageConfig, loader: data.ShardedLoader) -> int:
    """``trainer.total_training_steps``, or ``total_epochs`` passes over the training data."""
    return cfg.trainer.total_training_steps or loader.steps_per_epoch * cfg.trainer.total_epochs


def make_metrics_logger(
    cfg: PPOConfig | StageConfig,
    info: DistInfo,
    out_dir: Path,
    num_steps: int,
    *,
    console: bool,
    resume_step: int | None = None,
) -> MetricsLogger:
    """JSONL, TensorBoard (and wandb) sinks, and with ``console`` the per-step console line."""
    sinks = [s for s in cfg.trainer.logger if console or s != "console"]
    if console and (resume_step or 0) < num_steps:
        logger.info(
            "start-up done: training from step %d (a step: rollout, score, update)", (resume_step or 0) + 1
        )
    sinks += ["jsonl"] + (["tensorboard"] if cfg.trainer.tensorboard else [])  # whatever verl's list says
    return MetricsLogger(
        out_dir,
        sinks,
        is_main=info.is_main,
        total_steps=num_steps,
        project=cfg.trainer.project_name,
        run_name=cfg.trainer.experiment_name,
        config=to_dict(cfg),
        resume_step=resume_step,
        generations=isinstance(cfg, PPOConfig) and cfg.trainer.log_val_generations > 0,
    )


def my_share(items: Sequence[Any], info: DistInfo) -> list[Any]:
    """This rank's contiguous slice of an evaluation set (sizes differ by at most one)."""
    bounds = np.linspace(0, len(items), info.world_size + 1).round().astype(int)
    return list(items[bounds[info.rank] : bounds[info.rank + 1]])


# ----------------------------------------------------------------------------------------------------
# Stopping, progress, saving
# ----------------------------------------------------------------------------------------------------


class StopRequest:
    """SIGTERM (Slurm preemption, torchrun's shutdown), SIGINT (Ctrl-C) and SIGHUP (a closed terminal)
    ask the run to stop.

    The loop asks ``requested()`` at its phase boundaries (all ranks agree: one all-reduce): after the
    rollout, between the scoring forwards, between validation chunks and at the end of the step; it
    saves the last complete step before it exits, within the seconds torchrun and Slurm grant between
    SIGTERM and SIGKILL (30 s by default). A second Ctrl-C stops at once (``main`` exits quietly with
    130; the last checkpoint is intact: saves are atomic).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    """Slurm's preemption and torchrun's shutdown, Ctrl-C, a closed terminal or dropped ssh session."""

    def __init__(self) -> None:
        self.name: str | None = None
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                signal.signal(signum, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        if signum == signal.SIGINT and self.name is not None:
            raise KeyboardInterrupt
        self.name = signal.Signals(signum).name
        logger.warning("%s received: stopping at the next phase boundary, after a checkpoint", self.name)

    def requested(self) -> bool:
        """Whether any rank received a stop signal (collective)."""
        return all_reduce_scalar(float(self.name is not None), "max") > 0


def out_of_time(start: float, max_time_s: float) -> bool:
    """Whether ``trainer.max_time_s`` has passed on any rank (all ranks agree; no-op when 0)."""
    if max_time_s <= 0:
        return False
    return bool(all_reduce_scalar(float(time.perf_counter() - start > max_time_s), "max"))


class Progress:
    """One console line about every twentieth step, at validation and at the end (rank 0)."""

    def __init__(self, total: int, keys: dict[str, str], *, enabled: bool, first_step: int = 0) -> None:
        self.total = total
        self.keys = keys
        self.enabled = enabled
        self.every = max(1, total // 20)
        self.first_step = first_step
        self.start = time.perf_counter()

    def update(self, step: int, metrics: dict[str, float], *, force: bool = False) -> None:
        """Log ``step`` if it is due; ``keys`` maps a metric name to its short label."""
        if not self.enabled or not (force or step % self.every == 0 or step == self.total):
            return
        elapsed = time.perf_counter() - self.start
        eta = elapsed / max(step - self.first_step, 1) * (self.total - step)
        shown = " ".join(f"{label}={metrics[k]:.4g}" for k, label in self.keys.items() if k in metrics)
        logger.info("step %d/%d %s | %.0fs elapsed, eta %.0fs", step, self.total, shown, elapsed, eta)


def save_model(model: nn.Module, tokenizer: PreTrainedTokenizerBase, path: Path, info: DistInfo) -> Path:
    """Write the ``save_pretrained`` folder (weights, config, tokenizer); every rank calls it."""
    models.save_hf(model, tokenizer, str(path), is_main=info.is_main)
    logger.info("saved %s", path)
    return path


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
