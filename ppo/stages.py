"""What the stages before PPO share: supervised fine-tuning and reward-model training.

``scripts/train_sft.py`` and ``scripts/train_reward_model.py`` are two loops over the same parts, kept
here so they are written once: the entry point (CLI, process group, one clean error per failure),
the run folder, loading and sharding a model, the per-rank data loader, packing token sequences into
padding-free micro-batches agreed across ranks, the optimizer step (clip, skip a non-finite step),
the progress line, saving, and merging final numbers into ``metrics.json``::

    def train(cfg: SFTConfig, info: DistInfo) -> None:
        out_dir = stages.prepare_run(cfg, info)
        model = stages.build_model(models.load_causal_lm, cfg, info)
        loader = stages.make_loader(examples, cfg, info)
        ...

    if __name__ == "__main__":
        sys.exit(stages.run(None, SFTConfig, train, __doc__))

Every rank runs every function here; the ones that write files do so on rank 0 only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import transformers
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ppo import checkpoint, data, models
from ppo.checkpoint import CheckpointError, ensure_writable
from ppo.config import (
    ConfigError,
    RewardModelConfig,
    SFTConfig,
    StageDataConfig,
    parse_cli,
    to_dict,
    to_yaml,
    validate_stage,
)
from ppo.distributed import (
    DistInfo,
    all_reduce_scalar,
    broadcast_object,
    destroy_distributed,
    init_distributed,
    make_mesh,
    setup_logging,
)
from ppo.metrics import MetricsLogger
from ppo.optim import clip_grad_norm
from ppo.packing import balanced_partition, min_micro_batches, plan_micro_batches

logger = logging.getLogger("ppo")

StageConfig = TypeVar("StageConfig", SFTConfig, RewardModelConfig)

EXPECTED_ERRORS = (ConfigError, data.DataError, FileNotFoundError, CheckpointError)
"""Errors caused by the user's input: logged once as one line, exit code 2, no traceback."""

METRICS_FILE = "metrics.json"
"""Final numbers of every stage, merged into one file beside the saved model folders."""


# ----------------------------------------------------------------------------------------------------
# Entry point and setup
# ----------------------------------------------------------------------------------------------------


def run(
    argv: list[str] | None,
    cls: type[StageConfig],
    train: Callable[[StageConfig, DistInfo], None],
    description: str,
) -> int:
    """Parse the command line (as ``train_ppo.py`` does), join the process group and call ``train``.

    ``--print-config`` prints the resolved config and exits (validated for ``--world-size`` if given).
    A bad config, data file or model path is reported once, by rank 0, as a single line, and the
    process exits with code 2 on every rank: the error is raised on every rank alike (they all read
    the same files), so there is nobody left waiting in a collective.
    """
    try:
        cfg, args = parse_cli(argv, cls, description=description)
        if args.print_config:
            if args.world_size is not None:
                validate_stage(cfg, args.world_size)
            print(to_yaml(cfg), end="")
            return 0
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    info = init_distributed(cfg.trainer.device, cfg.trainer.dist_timeout_s)
    setup_logging(info.is_main)
    # Loading and saving reports (and progress bars) once, from rank 0; a tiny model needs no bars.
    transformers.utils.logging.disable_progress_bar()
    if not info.is_main:
        transformers.utils.logging.set_verbosity_error()
    try:
        validate_stage(cfg, info.world_size)
        train(cfg, info)
    except EXPECTED_ERRORS as e:
        if info.is_main:
            logger.error("%s", e)
        destroy_distributed()
        return 2
    destroy_distributed()
    return 0


def prepare_run(cfg: SFTConfig | RewardModelConfig, info: DistInfo) -> Path:
    """Create the run folder, write the resolved config into it (rank 0), seed every rank alike.

    Raises CheckpointError on every rank when rank 0 cannot write the folder.
    """
    out_dir = Path(cfg.trainer.output_dir)
    error = None
    if info.is_main:
        try:
            ensure_writable(out_dir)
            (out_dir / "config.yaml").write_text(to_yaml(cfg))
        except (CheckpointError, OSError) as e:
            error = str(e)
    # Only rank 0 writes, but every rank must stop if it cannot, or the others wait in a collective.
    error = broadcast_object(error)
    if error is not None:
        raise CheckpointError(error)
    checkpoint.seed_everything(cfg.trainer.seed)  # the same on every rank while models are built
    return out_dir


def save_path(cfg: SFTConfig | RewardModelConfig) -> Path:
    """Where the final ``save_pretrained`` folder goes: ``trainer.save_path`` or ``output_dir/hf``."""
    return Path(cfg.trainer.save_path or Path(cfg.trainer.output_dir) / "hf")


def load_tokenizer(cfg: SFTConfig | RewardModelConfig) -> PreTrainedTokenizerBase:
    """The tokenizer of ``model.tokenizer_path`` (default ``model.path``)."""
    key = "model.tokenizer_path" if cfg.model.tokenizer_path else "model.path"
    return models.load_tokenizer(
        cfg.model.tokenizer_path or cfg.model.path, cfg.model.trust_remote_code, config_key=key
    )


def build_model(
    load: Callable[..., PreTrainedModel], cfg: SFTConfig | RewardModelConfig, info: DistInfo
) -> nn.Module:
    """Load with ``load`` (``models.load_causal_lm`` or ``models.load_reward_model``), then shard.

    One process without a process group gets no mesh: ``shard_model`` then leaves the model whole.
    """
    with main_rank_logs(info):  # e.g. "fresh score head" once, not once per rank
        model = load(
            cfg.model.path,
            dtype=cfg.model.dtype,
            attn_implementation=cfg.model.attn_implementation,
            trust_remote_code=cfg.model.trust_remote_code,
            device=info.device,
            config_key="model.path",
        )
    if cfg.model.enable_gradient_checkpointing:
        models.enable_gradient_checkpointing(model)
    model.train()
    mesh = make_mesh(info, cfg.fsdp.fsdp_size) if torch.distributed.is_initialized() else None
    return models.shard_model(model, mesh, cfg.fsdp, device=info.device)


def make_loader(
    records: Sequence[Any], cfg: SFTConfig | RewardModelConfig, info: DistInfo
) -> data.PromptLoader:
    """This rank's contiguous share of each global batch, from a permutation seeded by
    ``(trainer.seed, epoch)``: the loader of ``train_ppo.py``, which only indexes its records."""
    return data.PromptLoader(
        records,
        batch_size=cfg.data.train_batch_size,
        rank=info.rank,
        world_size=info.world_size,
        seed=cfg.trainer.seed,
        shuffle=cfg.data.shuffle,
    )


def total_steps(cfg: SFTConfig | RewardModelConfig, loader: data.PromptLoader) -> int:
    """``trainer.total_training_steps``, or ``total_epochs`` passes over the training data."""
    return cfg.trainer.total_training_steps or loader.steps_per_epoch * cfg.trainer.total_epochs


def make_metrics_logger(
    cfg: SFTConfig | RewardModelConfig, info: DistInfo, out_dir: Path, num_steps: int
) -> MetricsLogger:
    """JSONL, TensorBoard (and wandb) sinks; the console line is ``Progress``'s, not the PPO one."""
    return MetricsLogger(
        out_dir,
        [s for s in cfg.trainer.logger if s != "console"],
        is_main=info.is_main,
        total_steps=num_steps,
        project=cfg.trainer.project_name,
        run_name=cfg.trainer.experiment_name,
        config=to_dict(cfg),
    )


def my_share(items: Sequence[Any], info: DistInfo) -> list[Any]:
    """This rank's contiguous slice of an evaluation set (sizes differ by at most one)."""
    bounds = np.linspace(0, len(items), info.world_size + 1).round().astype(int)
    return list(items[bounds[info.rank] : bounds[info.rank + 1]])


# ----------------------------------------------------------------------------------------------------
# Packing and micro-batches
# ----------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class PackedSequences:
    """``B`` token sequences as one padding-free row (see ``ppo.packing``)."""

    input_ids: torch.Tensor
    """[T] token ids of all sequences back to back."""
    position_ids: torch.Tensor
    """[T] positions, restarting at 0 for each sequence."""
    cu_seqlens: torch.Tensor
    """[B+1] int32 offsets of the sequences in the row."""


def pack_sequences(seqs: Sequence[Sequence[int]], device: torch.device) -> PackedSequences:
    """Concatenate token lists into ``[T]`` with restarting position ids and ``cu_seqlens [B+1]``."""
    lengths = [len(s) for s in seqs]
    if not lengths or min(lengths) == 0:
        raise ValueError(f"cannot pack an empty sequence (lengths {lengths})")
    input_ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=device)
    position_ids = torch.cat([torch.arange(n, device=device) for n in lengths])
    cu_seqlens = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32, device=device)
    return PackedSequences(input_ids=input_ids, position_ids=position_ids, cu_seqlens=cu_seqlens)


def train_micro_batches(lengths: list[int], data_cfg: StageDataConfig) -> list[list[int]]:
    """Index groups of this rank's share of a training batch; ``lengths`` in tokens per example.

    Every rank holds ``train_batch_size / world_size`` examples, so the group count agreed by
    ``plan_micro_batches`` (max over ranks) fits every rank.
    """
    return plan_micro_batches(
        lengths,
        use_dynamic_bsz=data_cfg.use_dynamic_bsz,
        max_tokens=data_cfg.max_token_len_per_gpu,
        micro_batch_size=data_cfg.micro_batch_size_per_gpu,
    )


def eval_micro_batches(lengths: list[int], data_cfg: StageDataConfig) -> list[list[int]]:
    """Index groups of this rank's evaluation examples, the same number of groups on every rank.

    Evaluation shares differ in size (and may be empty), so ranks that need fewer groups get empty
    ones at the end; the caller runs a dummy forward for those (each forward of a sharded model is a
    collective every rank must join).
    """
    if data_cfg.use_dynamic_bsz:
        needed = min_micro_batches(lengths, data_cfg.max_token_len_per_gpu) if lengths else 0
    else:
        needed = -(-len(lengths) // data_cfg.micro_batch_size_per_gpu)
    count = int(all_reduce_scalar(float(needed), "max"))
    if not lengths:
        return [[] for _ in range(count)]
    if data_cfg.use_dynamic_bsz:
        groups = balanced_partition(lengths, min(count, len(lengths)))
    else:
        step = data_cfg.micro_batch_size_per_gpu
        groups = [list(range(i, min(i + step, len(lengths)))) for i in range(0, len(lengths), step)]
    return groups + [[] for _ in range(count - len(groups))]


DUMMY_SEQUENCE = [0]
"""The one-token sequence a rank with an empty evaluation group forwards (and ignores)."""


# ----------------------------------------------------------------------------------------------------
# Update, progress, saving
# ----------------------------------------------------------------------------------------------------


def backward(loss: torch.Tensor, info: DistInfo) -> None:
    """Backward of this rank's part of a globally normalized loss.

    The loss is already divided by a count over all ranks and micro-batches, so the gradient of the
    global batch is the *sum* of the ranks' gradients, which is what ``models.shard_model`` makes FSDP2
    reduce (as in ``train_ppo.py``).
    """
    loss.backward()


def optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    grad_clip: float,
) -> tuple[float, bool]:
    """Clip the global gradient norm, step (unless it is not finite), advance the schedule.

    Returns ``(grad_norm before clipping, skipped)``. The norm is reduced over ranks, so every rank
    makes the same skip decision; the schedule advances either way so the step count stays the plan.
    """
    grad_norm = clip_grad_norm(model, grad_clip)
    skipped = not math.isfinite(grad_norm)
    if skipped:
        logger.warning("non-finite gradient norm (%s): this step is skipped on every rank", grad_norm)
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return grad_norm, skipped


def out_of_time(start: float, max_time_s: float) -> bool:
    """Whether ``trainer.max_time_s`` has passed on any rank (all ranks agree; no-op when 0)."""
    if max_time_s <= 0:
        return False
    return bool(all_reduce_scalar(float(time.perf_counter() - start > max_time_s), "max"))


class Progress:
    """One console line about every twentieth step, at validation and at the end (rank 0)."""

    def __init__(self, total: int, keys: dict[str, str], *, enabled: bool) -> None:
        self.total = total
        self.keys = keys
        self.enabled = enabled
        self.every = max(1, total // 20)
        self.start = time.perf_counter()

    def update(self, step: int, metrics: dict[str, float], *, force: bool = False) -> None:
        """Log ``step`` if it is due; ``keys`` maps a metric name to its short label."""
        if not self.enabled or not (force or step % self.every == 0 or step == self.total):
            return
        elapsed = time.perf_counter() - self.start
        eta = elapsed / step * (self.total - step)
        shown = " ".join(f"{label}={metrics[k]:.4g}" for k, label in self.keys.items() if k in metrics)
        logger.info("step %d/%d %s | %.0fs elapsed, eta %.0fs", step, self.total, shown, elapsed, eta)


def save_model(
    model: nn.Module, tokenizer: PreTrainedTokenizerBase, cfg: SFTConfig | RewardModelConfig, info: DistInfo
) -> Path:
    """Write the ``save_pretrained`` folder (weights, config, tokenizer); every rank calls it."""
    path = save_path(cfg)
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


def write_final_metrics(cfg: SFTConfig | RewardModelConfig, info: DistInfo, updates: dict[str, Any]) -> None:
    """Merge a stage's final numbers into ``metrics.json`` beside its saved model folder (rank 0)."""
    if info.is_main:
        path = save_path(cfg).parent / METRICS_FILE
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
