"""How the stages before PPO (SFT, the reward model, DPO) start and loop: one batch, one optimizer step.

Every stage starts alike (``start_stage``: the run folder, the tokenizer, the training and validation
data, the loader and the step count) and differs only in how a batch becomes a loss (``step``) and in
what validation measures (``validate``); the loop around them is this one: resume from the newest
checkpoint, the per-step optimizer step and schedule, validation every ``trainer.test_freq`` steps,
metrics, progress, checkpoints every ``trainer.save_freq`` steps and on a stop signal, the time cap, and the end-of-run
summary. A run that stops before its planned steps (a stop signal, ``trainer.max_time_s``) says so in
the stage's final numbers (``<stage>_stopped_early``, ``<stage>_steps_planned`` in the ``metrics.json``
next to its model, ``metrics_prefix``). A stage run killed or preempted resumes exactly, like a PPO run::

    start = start_stage(cfg, info, functools.partial(load_sft_examples, max_length=cfg.data.max_length))
    result = train_stage(cfg, info, start.out_dir, trained=trained, loader=start.loader,
                         num_steps=start.num_steps, step=sft_step, validate=val_loss,
                         progress_keys={"train/loss": "loss"})
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ppo import model_setup, monitor, run_folder, runner
from ppo.checkpointer import TrainerState, log_stopped, make_checkpointer, save_due
from ppo.config import DPOConfig, RewardModelConfig, SFTConfig, StageConfig
from ppo.data import ShardedLoader, make_loader, total_steps
from ppo.data_files import Files
from ppo.distributed import DistInfo, main_rank_logs
from ppo.metrics import MetricsLogger, Progress, Timer, make_metrics_logger
from ppo.optim import Trained, optimizer_step
from ppo.step_end import StopRequest, out_of_time

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("ppo")

Loaded = TypeVar("Loaded")
"""What a stage's data loader returns for a list of files (its examples, or a record that holds them)."""


@dataclass(kw_only=True)
class StageStart(Generic[Loaded]):
    """What every stage run starts from (``start_stage``)."""

    out_dir: Path
    """The run folder, claimed (``runner.prepare_run``)."""
    tokenizer: PreTrainedTokenizerBase
    """``model.tokenizer_path``'s (default ``model.path``'s)."""
    train: Loaded
    """``load(data.train_files)``."""
    val: Loaded | None
    """``load(data.val_files)``; None without ``data.val_files``."""
    loader: ShardedLoader
    """This rank's share of each global batch of the training examples."""
    num_steps: int
    """``trainer.total_training_steps``, or ``total_epochs`` passes over the training examples."""


def start_stage(
    cfg: StageConfig,
    info: DistInfo,
    load: Callable[[Files, PreTrainedTokenizerBase], Loaded],
    examples: Callable[[Loaded], list[Any]] | None = None,
) -> StageStart[Loaded]:
    """Claim the run folder, load the tokenizer, then the training and validation data with
    ``load(files, tokenizer)`` (its warnings from rank 0 only), and the loader over the training examples
    (``examples(train)``, or what ``load`` returned when it is the list itself)."""
    out_dir = runner.prepare_run(cfg, info)
    tokenizer = model_setup.load_tokenizer(cfg.model)
    with main_rank_logs(info):  # data warnings once, not once per rank
        train = load(cfg.data.train_files, tokenizer)
        val = load(cfg.data.val_files, tokenizer) if cfg.data.val_files else None
    loader = make_loader(examples(train) if examples is not None else train, cfg, info)
    return StageStart(
        out_dir=out_dir,
        tokenizer=tokenizer,
        train=train,
        val=val,
        loader=loader,
        num_steps=total_steps(cfg, loader),
    )


StepFn = Callable[[list[Any]], tuple[dict[str, float], float]]
"""``(this rank's examples of the step) -> (metrics, tokens over all ranks)``: runs the forward and
backward passes of the step (the gradient of the global batch's loss); the loop steps the optimizer."""


@dataclass(kw_only=True)
class StageResult:
    steps: int
    """Steps done (all of them unless stopped or out of time)."""
    train_time_s: float
    """Seconds spent in the loop by this process (a resumed run counts its own part)."""
    metrics: dict[str, float]
    """The last step's metrics (with its validation, if it had one)."""
    stopped: bool
    """A stop signal ended the run early (it saved a checkpoint; the model is not final)."""
    num_steps: int
    """The steps planned (``trainer.total_training_steps`` or the epochs' steps)."""
    timed_out: bool = False
    """``trainer.max_time_s`` ended the run before ``num_steps`` (the model is saved as it is)."""
    metrics_logger: MetricsLogger
    """The run's sinks, still open for the stage's final numbers."""


def train_stage(
    cfg: StageConfig,
    info: DistInfo,
    out_dir: Path,
    *,
    trained: Trained,
    loader: ShardedLoader,
    num_steps: int,
    step: StepFn,
    validate: Callable[[], dict[str, float]] | None,
    progress_keys: dict[str, str],
) -> StageResult:
    """Run (or resume) the stage's steps; see the module docstring."""
    t = cfg.trainer
    state = TrainerState()
    checkpointer = make_checkpointer(
        cfg, info, out_dir, trained={"model": trained}, stateful={"trainer": state, "loader": loader}
    )
    resumed = checkpointer.restore_newest(t.resume_mode)
    if resumed is not None:
        logger.info("resumed from %s at step %d", resumed, state.step)
        if state.step >= num_steps:
            how = "trainer.total_training_steps" if t.total_training_steps else "trainer.total_epochs"
            logger.warning(
                "resumed at step %d, and the run ends at step %d: nothing to train (the model is saved again "
                "from the checkpoint); raise %s to train on",
                state.step,
                num_steps,
                how,
            )
    metrics_logger = make_metrics_logger(
        cfg, info, out_dir, num_steps, console=False, resume_step=state.step if resumed else None
    )
    progress = Progress(num_steps, progress_keys, enabled="console" in t.logger, first_step=state.step)
    stop = StopRequest()
    start = time.perf_counter()
    metrics: dict[str, float] = {}
    stopped = False
    timed_out = False
    while state.step < num_steps and not (stopped or timed_out):
        state.step += 1
        timer = Timer(state.step)
        with timer("step"):
            with timer("update"):
                metrics, tokens = step(next(loader))
            lr = trained.optimizer.param_groups[0]["lr"]
            with timer("optimizer"):
                grad_norm, skipped = optimizer_step(trained.model, trained.optimizer, t.grad_clip)
                trained.scheduler.step()
            metrics.update(
                {
                    "train/lr": lr,
                    "train/grad_norm": grad_norm,
                    "train/skipped_step": float(skipped),
                    "train/epoch": float(loader.epoch),
                }
            )
            # Stop signals and the time cap are asked after the step, so a run always makes progress.
            stopped = stop.requested()
            timed_out = not stopped and out_of_time(start, t.max_time_s)
            due = t.test_freq > 0 and state.step % t.test_freq == 0
            if validate is not None and not stopped and (due or state.step == num_steps):
                with timer("testing"):
                    metrics.update(validate())
        metrics.update(timer.times)
        metrics["perf/throughput"] = tokens / info.world_size / timer.times["timing_s/step"]
        metrics_logger.log(state.step, metrics)
        progress.update(state.step, metrics, force=any(k.startswith(("val/", "rm/")) for k in metrics))
        if save_due(state.step, num_steps, t.save_freq) or stopped or timed_out:
            checkpointer.save(state.step)
        else:
            checkpointer.poll()
    checkpointer.wait()
    if stopped:
        log_stopped(state.step, stop.name)
    elif timed_out:
        if validate is not None:  # the final numbers of a run cut short (not logged: not a step's)
            metrics.update(validate())
        logger.warning(
            "trainer.max_time_s=%s reached after %d of %d steps: saved step %d; the model is saved as it is "
            "(resume with trainer.resume_mode=auto to finish the schedule)",
            t.max_time_s,
            state.step,
            num_steps,
            state.step,
        )
    early = stopped or timed_out
    prefix = metrics_prefix(cfg)
    if prefix is not None:
        save_path = run_folder.stage_save_path(cfg)
        runner.write_final_metrics(
            save_path.parent,
            info,
            {
                f"{prefix}_stopped_early": early,
                f"{prefix}_steps_planned": num_steps,
                f"{prefix}_steps": state.step,
            },
        )
    monitor.log_run_summary(
        out_dir,
        metrics_logger,
        steps_done=state.step,
        stopped=(stop.name or "stop signal")
        if stopped
        else f"trainer.max_time_s={t.max_time_s}"
        if timed_out
        else None,
        hf_dir=None,
    )
    if not stopped and info.is_main:
        logger.info("the model goes to %s", run_folder.stage_save_path(cfg))
    return StageResult(
        steps=state.step,
        train_time_s=time.perf_counter() - start,
        metrics=metrics,
        stopped=stopped,
        metrics_logger=metrics_logger,
        num_steps=num_steps,
        timed_out=timed_out,
    )


STAGE_PREFIX: dict[type, str] = {SFTConfig: "sft", RewardModelConfig: "rm", DPOConfig: "dpo"}
"""The prefix of a stage's keys in the ``metrics.json`` next to its model (``sft_steps``, ...)."""


def metrics_prefix(cfg: StageConfig) -> str | None:
    """The prefix of the run's keys in the ``metrics.json`` next to its model: SFT's
    ``trainer.metrics_prefix``, the stage's ``STAGE_PREFIX`` otherwise."""
    if isinstance(cfg, SFTConfig):
        return cfg.trainer.metrics_prefix
    return STAGE_PREFIX.get(type(cfg))
