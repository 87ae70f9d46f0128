"""Metrics: verl-style names, one cross-rank reduction per step, sinks on rank 0.

Keys follow verl (``actor/pg_loss``, ``critic/score/mean``, ``timing_s/gen``, ``perf/throughput``) so
dashboards carry over. ``MetricsLogger`` writes ``metrics.jsonl`` and TensorBoard events in the run
folder, prints one console line per step and draws a progress bar (``make_metrics_logger`` makes it as
the config says; the stages' shorter console line is ``Progress``). The trackers verl names in
``trainer.logger`` (wandb, mlflow, swanlab, trackio, clearml, file; ``ppo.trackers``) get the same metrics
with the step and the resolved config. ``metrics.jsonl``, ``generations.jsonl`` and the ``file`` sink are strict JSON: a NaN or infinite value (a
skipped step's reward, a reward function's NaN extra) is written as ``null``; TensorBoard and the
trackers keep the NaN.
"""

from __future__ import annotations

import json
import logging
import math
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ppo import models
from ppo.batch import Batch
from ppo.config import PPOConfig, StageConfig
from ppo.config_loader import to_dict
from ppo.distributed import WATCH, DistInfo, all_reduce_scalar, all_reduce_scalars, all_reduce_tensors
from ppo.trackers import TRACKERS, check_trackers, finite_or_none, open_log, start_tracker

logger = logging.getLogger("ppo")

# The keys of the one-line console summary, in order, with short labels (docs/console.md).
CONSOLE_KEYS = {
    "critic/score/mean": "score",
    "val/score": "val",
    "actor/pg_loss": "pg",
    "actor/ppo_kl": "ppo_kl",
    "actor/grad_norm": "gn",
    "actor/reward_kl_penalty": "kl",
    "actor/kl_loss": "kl_loss",
    "actor/entropy": "ent",
    "critic/vf_loss": "vf",
    "response_length/mean": "len",
    "timing_s/step": "s",
}

CONSOLE_LEGEND = (
    "columns: score = mean reward of the step's responses | val = validation score | pg = policy loss "
    "(about 0 on-policy: the ratio is 1 and the loss is the advantage mean; the gradient is not 0, see gn; "
    "'warmup' while the critic warms up) | ppo_kl = KL of the updated to the sampling policy | gn = actor "
    "gradient norm | kl = KL penalty in the reward | kl_loss = actor KL loss to the reference | ent = "
    "entropy | vf = value loss | len = mean response tokens | s = seconds per step (docs/console.md)"
)
"""The line logged before the first step line: what each label of ``CONSOLE_KEYS`` means."""


def console_line(metrics: dict[str, float]) -> str:
    """The step's console fields: ``label=value`` for each ``CONSOLE_KEYS`` key present, ``pg=warmup`` on
    a step that updated the critic only (``trainer.critic_warmup``), then the ``val/*/accuracy`` keys."""
    parts = []
    for key, label in CONSOLE_KEYS.items():
        if key in metrics:
            parts.append(f"{label}={_fmt(metrics[key])}")
        elif key == "actor/pg_loss" and "critic/vf_loss" in metrics:
            parts.append(f"{label}=warmup")
    val = [f"{k}={_fmt(v)}" for k, v in metrics.items() if k.startswith("val/") and k.endswith("/accuracy")]
    return " ".join(parts + val)


def global_stats(values: dict[str, torch.Tensor], *, copies: int = 1) -> dict[str, dict[str, float]]:
    """Mean, max, min and unbiased variance of each 1-D tensor over the elements of every rank.

    Token-level quantities (advantages, values) have a different count on each rank, so the global mean
    is the token-weighted one, not the mean of the ranks' means. ``copies``: how many ranks hold each
    element (the ranks of a sequence-parallel group hold the same batch), so each counts once. Three
    collectives for any number of tensors. An empty tensor on every rank gives zeros.
    """
    names = sorted(values)
    sums, maxes, mins = {}, {}, {}
    for name in names:
        x = values[name].detach().to(torch.float64).reshape(-1)
        sums[f"{name}/n"] = torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device)
        sums[f"{name}/sum"] = x.sum()
        sums[f"{name}/sumsq"] = x.square().sum()
        maxes[name] = x.max() if x.numel() else torch.tensor(-math.inf, dtype=torch.float64, device=x.device)
        mins[name] = x.min() if x.numel() else torch.tensor(math.inf, dtype=torch.float64, device=x.device)
    sums = {k: v / copies for k, v in all_reduce_tensors(sums, "sum").items()}
    maxes = all_reduce_tensors(maxes, "max")
    mins = all_reduce_tensors(mins, "min")
    out = {}
    for name in names:
        n, total, sq = sums[f"{name}/n"], sums[f"{name}/sum"], sums[f"{name}/sumsq"]
        mean = total / n if n else 0.0
        var = max(sq - n * mean * mean, 0.0) / (n - 1) if n > 1 else 0.0
        out[name] = {
            "mean": mean,
            "max": maxes[name] if n else 0.0,
            "min": mins[name] if n else 0.0,
            "var": var,
        }
    return out


@contextmanager
def profiled(steps: list[int], step: int, out_dir: Path) -> Iterator[None]:
    """Record ``step`` with the torch profiler when it is in ``steps`` (``trainer.profile_steps``); the
    trace goes to ``out_dir/profile`` (TensorBoard's profiler plugin or Perfetto). The profiler stops
    however the step ends (a skipped step, a rollback, an error)."""
    if step not in steps:
        yield
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(
        activities=activities,
        record_shapes=True,
        profile_memory=True,
        on_trace_ready=torch.profiler.tensorboard_trace_handler(str(out_dir / "profile")),
    ):
        yield


# Dense bf16 tensor-core peak FLOP/s per GPU, for MFU. Matched by substring of the device name.
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
}


def peak_flops(device: torch.device) -> float | None:
    """Peak dense bf16 FLOP/s of ``device`` when it is a GPU this table knows, else None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def model_flops_utilization(
    num_params: int, num_tokens: float, seconds: float, peak: float | None
) -> float | None:
    """MFU of a training pass: ``6 * params * tokens`` FLOPs (forward + backward, the standard estimate
    that ignores attention) over ``seconds * peak``."""
    if peak is None or seconds <= 0:
        return None
    return 6.0 * num_params * num_tokens / (seconds * peak)


def verl_training_flops(config: Any, seq_lens_sum: float, seq_lens_sq_sum: float) -> float:
    """FLOPs of a forward + backward pass over sequences, as verl's flops counter estimates them for
    Llama/Qwen2-style models: ``6 * N_dense * tokens + 6 * sum(l_i^2) * head_dim * heads * layers``, with
    ``N_dense = layers * (3 * hidden * intermediate + hidden * (q + k + v + o)) + 2 * vocab * hidden``
    (embeddings counted as a matmul, attention scores and values by the squared lengths).

    ``config``: the model's (text) config; ``seq_lens_sum``, ``seq_lens_sq_sum``: ``sum(l_i)`` and
    ``sum(l_i^2)`` over the sequences.
    """
    c = config.get_text_config()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q = c.num_attention_heads * head_dim
    kv = c.num_key_value_heads * head_dim
    per_layer = 3 * c.hidden_size * c.intermediate_size + c.hidden_size * (2 * q + 2 * kv)
    dense = c.num_hidden_layers * per_layer + 2 * c.vocab_size * c.hidden_size
    attention = 6 * seq_lens_sq_sum * head_dim * c.num_attention_heads * c.num_hidden_layers
    return 6 * dense * seq_lens_sum + attention


class Timer:
    """Accumulates wall-clock seconds per phase as ``timing_s/<name>``, and tells ``distributed.WATCH``
    which phase (of step ``step``) this rank is in, for the error of a collective that times out."""

    def __init__(self, step: int | None = None) -> None:
        self.times: dict[str, float] = {}
        self.step = step

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        WATCH.enter(name, self.step)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.times[f"timing_s/{name}"] = (
                self.times.get(f"timing_s/{name}", 0.0) + time.perf_counter() - start
            )


class MetricsLogger:
    """Writes a step's metrics to the sinks named in ``trainer.logger`` (rank 0 only)."""

    def __init__(
        self,
        output_dir: str | Path,
        sinks: list[str],
        *,
        is_main: bool,
        total_steps: int,
        project: str = "ppo",
        run_name: str = "run",
        config: dict | None = None,
        resume_step: int | None = None,
        generations: bool = False,
    ) -> None:
        self.is_main = is_main
        self.sinks = set(sinks)
        self.total_steps = total_steps
        self.jsonl = None
        self.generations = None
        self.tb = None
        self.trackers: dict[str, Any] = {}
        """The trackers of ``trainer.logger`` by name (``TRACKERS`` and ``file``), rank 0 only."""
        self.start = time.perf_counter()
        # The step this process started after (a resumed run's checkpoint): the ETA uses its own rate.
        self.first_step = resume_step or 0
        self.legend_shown = False
        if not is_main:
            return
        check_trackers(sinks)  # before any file is written
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        if "jsonl" in self.sinks:
            self.jsonl = open_log(out / "metrics.jsonl", resume_step)
        if generations:
            self.generations = open_log(out / "generations.jsonl", resume_step)
        if "tensorboard" in self.sinks:
            from torch.utils.tensorboard import SummaryWriter

            # A resumed run continues the events; steps after its checkpoint, logged before the stop, are
            # hidden (purged) so they are not drawn twice.
            purge = None if resume_step is None else resume_step + 1
            self.tb = SummaryWriter(log_dir=str(out / "tensorboard"), purge_step=purge)
        for name in sorted(self.sinks & {*TRACKERS, "file"}):
            self.trackers[name] = start_tracker(name, project, run_name, config or {}, out, resume_step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record one step's (already reduced) metrics."""
        if not self.is_main:
            return
        clean = {k: float(v) for k, v in sorted(metrics.items())}
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, **finite_or_none(clean)}, allow_nan=False) + "\n")
            self.jsonl.flush()
        if self.tb is not None:
            for key, value in clean.items():
                self.tb.add_scalar(key, value, step)
            self.tb.flush()
        for tracker in self.trackers.values():
            tracker.log(clean, step)
        if "console" in self.sinks:
            if not self.legend_shown:
                logger.info("%s", CONSOLE_LEGEND)
                self.legend_shown = True
            logger.info("%s %s", self._progress(step), console_line(clean))

    def log_generations(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Record validation answers ``{"prompt", "response", "score"}``: one JSON line each in
        ``generations.jsonl`` (with the step), and one markdown table per step in TensorBoard's text tab."""
        if not self.is_main or not rows:
            return
        if self.generations is not None:
            for row in rows:
                self.generations.write(
                    json.dumps({"step": step, **finite_or_none(row)}, allow_nan=False) + "\n"
                )
            self.generations.flush()
        if self.tb is not None:
            table = ["| prompt | response | score |", "|---|---|---|"]
            table += [f"| {_cell(r['prompt'])} | {_cell(r['response'])} | {r['score']} |" for r in rows]
            self.tb.add_text("val/generations", "\n".join(table), step)
            self.tb.flush()

    def _progress(self, step: int) -> str:
        """``[#####-----] step 12/40 eta 1m05s``: the progress bar heading each console line."""
        width = 20
        done = min(step, self.total_steps) / max(self.total_steps, 1)
        elapsed = time.perf_counter() - self.start
        bar = "#" * int(width * done) + "-" * (width - int(width * done))
        done_here = step - self.first_step
        remaining = max(self.total_steps - step, 0)
        eta = f" eta {_duration(elapsed / done_here * remaining)}" if done_here > 0 and remaining else ""
        return f"[{bar}] step {step}/{self.total_steps} {_duration(elapsed)}{eta}"

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.generations is not None:
            self.generations.close()
        if self.tb is not None:
            self.tb.close()
        for tracker in self.trackers.values():
            tracker.finish()
        self.trackers = {}


def make_metrics_logger(
    cfg: PPOConfig | StageConfig,
    info: DistInfo,
    out_dir: Path,
    num_steps: int,
    *,
    console: bool,
    resume_step: int | None = None,
) -> MetricsLogger:
    """JSONL, TensorBoard and the trackers of ``trainer.logger``, and with ``console`` the per-step console
    line."""
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


class Progress:
    """One console line about every twentieth step, at validation and at the end (rank 0): the stages'
    progress, where ``MetricsLogger`` writes no console line."""

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


def _cell(text: Any) -> str:
    """Text as one cell of a markdown table (pipes escaped, line breaks as <br>)."""
    return str(text).replace("|", "\\|").replace("\n", "<br>")


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _fmt(x: float) -> str:
    if math.isnan(x) or math.isinf(x):
        return str(x)
    return f"{x:.4g}"


# ----------------------------------------------------------------------------------------------------
# A PPO step's data and performance metrics
# ----------------------------------------------------------------------------------------------------


def batch_metrics(cfg: PPOConfig, batch: Batch) -> dict[str, float]:
    """verl's data metrics over the whole batch on all ranks (token-weighted where per token):
    ``critic/{score,rewards,advantages,returns,values}/{mean,max,min}``, ``critic/vf_explained_var``
    (``1 - Var(returns - values) / (Var(returns) + 1e-5)``, unbiased), ``response_length/*`` and
    ``prompt_length/*`` with ``clip_ratio`` the share at the length limit; with offline groups
    ``rollout/offline_fraction``, the share of the step's responses read from the data set. Over the
    generated tokens (the response mask): a multi-turn response's length counts what the model wrote, its
    ``clip_ratio`` the share that filled the budget (observations included), and it adds
    ``rollout/{turns,tool_calls,observation_tokens}/mean`` and the step's ``rollout/step_timeouts`` and
    ``rollout/observation_truncations``."""
    mask = batch.response_mask
    resp_len = mask.sum(-1).float()
    full_len = batch.attention_mask.sum(-1).float()
    prompt_len = torch.tensor([float(p.numel()) for p in batch.rollout.prompts], device=mask.device)
    values = {
        "critic/score": batch.scores,
        "critic/rewards": batch.token_rewards.sum(-1),
        "response_length": resp_len,
        "response_length/clip": (full_len == cfg.data.max_response_length).float(),
        "prompt_length": prompt_len,
        "prompt_length/clip": (prompt_len == cfg.data.max_prompt_length).float(),
    }
    if batch.advantages is not None:  # none without the task's loss (distillation alone)
        values["critic/advantages"] = batch.advantages[mask]
        values["critic/returns"] = batch.returns[mask]
    if batch.values is not None:
        values["critic/values"] = batch.values[mask]
        values["critic/return_error"] = (batch.returns - batch.values)[mask]
    if batch.data_ranks is not None:
        values["rollout/offline_fraction"] = (batch.data_ranks >= 0).float()
    turn_stats = batch.rollout.turn_stats
    if turn_stats is not None:
        values |= {f"rollout/{k}": v.float() for k, v in turn_stats.items()}
        values["rollout/observation_tokens"] = full_len - resp_len
    stats = global_stats(values, copies=cfg.actor.ulysses_sequence_parallel_size)
    out: dict[str, float] = {}
    for name in (
        "critic/score",
        "critic/rewards",
        "critic/advantages",
        "critic/returns",
        "response_length",
        "prompt_length",
    ):
        if name in stats:
            out.update({f"{name}/{k}": stats[name][k] for k in ("mean", "max", "min")})
    out["response_length/clip_ratio"] = stats["response_length/clip"]["mean"]
    out["prompt_length/clip_ratio"] = stats["prompt_length/clip"]["mean"]
    if batch.data_ranks is not None:
        out["rollout/offline_fraction"] = stats["rollout/offline_fraction"]["mean"]
    if turn_stats is not None:
        rows = cfg.data.train_batch_size * cfg.rollout.n  # the step's responses on all ranks
        for name in ("turns", "tool_calls", "observation_tokens"):
            out[f"rollout/{name}/mean"] = stats[f"rollout/{name}"]["mean"]
        for name in ("step_timeouts", "observation_truncations"):
            out[f"rollout/{name}"] = float(round(stats[f"rollout/{name}"]["mean"] * rows))
    if batch.values is not None:
        out.update({f"critic/values/{k}": stats["critic/values"][k] for k in ("mean", "max", "min")})
        out["critic/vf_explained_var"] = 1.0 - stats["critic/return_error"]["var"] / (
            stats["critic/returns"]["var"] + 1e-5
        )
    return out


def perf_metrics(
    cfg: PPOConfig,
    batch: Batch,
    metrics: dict[str, float],
    times: dict[str, float],
    info: DistInfo,
    *,
    actor: torch.nn.Module,
) -> dict[str, float]:
    """Timings, tokens, throughput, memory and the actor's model FLOPs utilization (GPUs we know).

    Rank-local values reduced here (tokens summed, memory maxed); the timings are rank 0's.
    """
    out = dict(times)
    # The ranks of a sequence-parallel group hold the same sequences: each counts its share.
    copies = cfg.actor.ulysses_sequence_parallel_size
    local_tokens = float(sum(batch.seq_lens)) / copies
    num_tokens = all_reduce_scalar(local_tokens, "sum")
    memory = all_reduce_scalar(max_memory_gib(info.device), "max")
    out["perf/total_num_tokens"] = num_tokens
    out["perf/throughput"] = num_tokens / info.world_size / times["timing_s/step"]  # per GPU, as verl
    out["perf/max_memory_gib"] = memory
    out["perf/max_memory_allocated_gb"] = memory  # verl's name
    peak = peak_flops(info.device)
    if "timing_s/update_actor" in times and peak is not None:
        # Tokens this rank trained on: a mini-batch's share per update (all updates ran unless stopped).
        num_mini = cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size
        passes = metrics["actor/num_updates"] / num_mini
        seconds = times["timing_s/update_actor"]
        num_params = models.count_parameters(actor)
        out["perf/mfu/actor"] = model_flops_utilization(num_params, local_tokens * passes, seconds, peak)
        # verl's figure: its flops counter (attention included) over the global batch, per GPU.
        lens = torch.tensor(batch.seq_lens, dtype=torch.float64)
        total, squares = all_reduce_scalars([float(lens.sum()), float(lens.square().sum())])
        flops = verl_training_flops(actor.config, total / copies, squares / copies) * passes
        out["perf/mfu/actor_verl"] = flops / (seconds * peak * info.world_size)
    return out


def max_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


# ----------------------------------------------------------------------------------------------------
# The metric parts of a loss: summed over micro-batches, ranks and mini-batches by ppo.optimize
# ----------------------------------------------------------------------------------------------------


RATIO_SUM, RATIO_COUNT = "#sum", "#count"
"""Suffixes of a ratio metric's two parts (``ratio_parts``), summed separately over micro-batches, ranks
and mini-batches and divided once at the end of ``ppo.optimize.optimize``."""


def ratio_parts(key: str, total: torch.Tensor, count: torch.Tensor) -> dict[str, torch.Tensor]:
    """A metric that is a mean over the rows or tokens it concerns (not over every token of the
    mini-batch): its sum and its count on this micro-batch, which ``ppo.optimize.optimize`` reduces and divides."""
    return {key + RATIO_SUM: total, key + RATIO_COUNT: count}


EXTREMES = {"#min": "min", "#max": "max"}
"""Suffixes of a metric that is a minimum or maximum over the tokens it concerns (``extreme_part``):
taken over micro-batches, ranks and mini-batches instead of summed."""


def extreme_part(key: str, value: torch.Tensor, kind: str) -> dict[str, torch.Tensor]:
    """A metric that is the ``kind`` (``min`` or ``max``) over the tokens it concerns: this micro-batch's
    ``value`` (``+inf`` for a min, ``-inf`` for a max where it has none), which ``ppo.optimize.optimize``
    reduces with ``kind`` over micro-batches, ranks and mini-batches (0 where no token had any)."""
    return {f"{key}#{kind}": value.detach()}


def metric_kind(key: str) -> str:
    """How a metric part combines over micro-batches, ranks and mini-batches: ``sum``, ``min`` or ``max``."""
    return EXTREMES.get(key[key.rfind("#") :], "sum") if "#" in key else "sum"


def combine_parts(
    old: torch.Tensor | float | None, new: torch.Tensor | float, key: str
) -> torch.Tensor | float:
    """A metric part of another micro-batch or mini-batch added to ``old``: summed, or its min or max."""
    if old is None:
        return new
    kind = metric_kind(key)
    if kind == "sum":
        return old + new
    if isinstance(new, torch.Tensor):
        return torch.minimum(old, new) if kind == "min" else torch.maximum(old, new)
    return min(old, new) if kind == "min" else max(old, new)


def resolve_ratios(metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` with each ``ratio_parts`` pair replaced by ``sum / count`` (0 with nothing counted)."""
    out = {k: v for k, v in metrics.items() if not k.endswith((RATIO_SUM, RATIO_COUNT))}
    for key in metrics:
        if key.endswith(RATIO_SUM):
            name = key.removesuffix(RATIO_SUM)
            count = metrics[name + RATIO_COUNT]
            out[name] = metrics[key] / count if count > 0 else 0.0
    return out
