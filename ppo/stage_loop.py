"""The training loop of the stages before PPO (SFT and the reward model): one batch, one optimizer step.

Both stages differ only in how a batch becomes a loss (``step``) and in what validation measures
(``validate``); the loop around them is this one: resume from the newest checkpoint, the per-step
optimizer step and schedule, validation every ``trainer.test_freq`` steps, metrics, progress,
checkpoints every ``trainer.save_freq`` steps and on a stop signal, the time cap. A stage run killed or
preempted resumes exactly, like a PPO run::

    result = train_stage(cfg, info, out_dir, trained=trained, loader=loader, num_steps=num_steps,
                         step=sft_step, validate=val_loss, progress_keys={"train/loss": "loss"})
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ppo import runner
from ppo.checkpointer import TrainerState, log_stopped, make_checkpointer, save_due
from ppo.config import StageConfig
from ppo.data import ShardedLoader
from ppo.distributed import DistInfo
from ppo.metrics import MetricsLogger, Timer
from ppo.optim import Trained

logger = logging.getLogger("ppo")

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
    metrics_logger = runner.make_metrics_logger(
        cfg, info, out_dir, num_steps, console=False, resume_step=state.step if resumed else None
    )
    progress = runner.Progress(num_steps, progress_keys, enabled="console" in t.logger, first_step=state.step)
    stop = runner.StopRequest()
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
                grad_norm, skipped = runner.optimizer_step(trained.model, trained.optimizer, t.grad_clip)
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
            timed_out = not stopped and runner.out_of_time(start, t.max_time_s)
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
    return StageResult(
        steps=state.step,
        train_time_s=time.perf_counter() - start,
        metrics=metrics,
        stopped=stopped,
        metrics_logger=metrics_logger,
    )
