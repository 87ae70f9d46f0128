"""AdamW with linear warm-up and constant or cosine decay: the one optimizer every stage uses, and the
gradient clipping and the skip of a non-finite update that make its step.

    actor = with_optimizer(model, cfg.actor.optim, total_steps)    # .model, .optimizer, .scheduler
    grad_norm, skipped = optimizer_step(actor.model, actor.optimizer, cfg.actor.grad_clip)
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from ppo.config import OptimConfig

logger = logging.getLogger("ppo")


def warmup_steps(cfg: OptimConfig, total_steps: int) -> int:
    """``lr_warmup_steps``, or ``lr_warmup_steps_ratio * total_steps`` when it is -1."""
    if cfg.lr_warmup_steps >= 0:
        return cfg.lr_warmup_steps
    return int(cfg.lr_warmup_steps_ratio * total_steps)


def lr_factor(step: int, *, warmup: int, total: int, schedule: str, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr after ``step`` optimizer steps.

    Warm-up from 0, as verl (and transformers' schedules): ``step / warmup`` for ``step < warmup``,
    so the first step's rate is 0. Then constant 1, or cosine ``m + (1 - m) * (1 + cos(pi * p)) / 2``
    with ``p = (step - warmup) / (total - warmup)`` clamped to [0, 1] and ``m = min_lr_ratio``.
    ``step`` counts scheduler steps: PPO takes one per training step, the stages one per optimizer step.
    """
    if step < warmup:
        return step / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(kw_only=True)
class Trained:
    """A model that trains, with its optimizer and learning-rate schedule."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


def with_optimizer(model: torch.nn.Module, cfg: OptimConfig, total_steps: int) -> Trained:
    """``model`` with fused AdamW over its trainable parameters and the schedule (``total_steps``
    scheduler steps)."""
    params = [p for p in model.parameters() if p.requires_grad]
    # The fused kernel updates every parameter in one pass (CPU and CUDA): 9x faster optimizer steps on
    # CPU, equal to the loop implementation to rounding.
    optimizer = torch.optim.AdamW(
        params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay, fused=True
    )
    warmup = warmup_steps(cfg, total_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(
            step, warmup=warmup, total=total_steps, schedule=cfg.lr_scheduler, min_lr_ratio=cfg.min_lr_ratio
        ),
    )
    return Trained(model=model, optimizer=optimizer, scheduler=scheduler)


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Global gradient norm over all ranks (DTensor-aware), clipped to ``max_norm`` when > 0.

    Returns the norm before clipping; a non-finite norm is returned as is and nothing is clipped, so
    the caller can skip the step on every rank (they all see the same reduced norm).
    """
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    norm_value = float(norm)
    coef = max_norm / (norm_value + 1e-6)
    if max_norm > 0 and math.isfinite(norm_value) and coef < 1.0:
        for p in params:  # a Python scalar multiplies plain and DTensor gradients alike
            p.grad.mul_(coef)
    return norm_value


def optimizer_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float
) -> tuple[float, bool]:
    """Clip the global gradient norm, step unless it is not finite, zero the gradients.

    Returns ``(grad_norm before clipping, skipped)``. The norm is reduced over ranks, so every rank
    makes the same skip decision. The learning-rate schedule is the caller's (PPO advances it once per
    training step, whatever the number of optimizer steps in it).
    """
    grad_norm = clip_grad_norm(model, grad_clip)
    skipped = not math.isfinite(grad_norm)
    if skipped:
        logger.warning("non-finite gradient norm (%s): this update is skipped on every rank", grad_norm)
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, skipped
