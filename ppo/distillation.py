"""On-policy distillation's glue (verl 0.9.1's ``distillation.*``): which teacher scores each row, the
teachers' forwards of step 2, and the distillation part of the actor's loss in step 4. The math is
``ppo.algorithms.distillation``; the teachers load in ``ppo.model_setup.teachers``.

    check_routing(cfg, records)                          # start-up: every row has a teacher
    forward_teachers(cfg, teachers, batch, sp)           # step 2: batch.teacher_logprobs (or top-k)
    loss, parts = student_loss(cfg, batch, sel, student, counts)   # step 4, inside the actor's loss

A teacher is frozen and sharded like the reference; its log-probs are at temperature 1 (a forward over
existing tokens, as verl's teacher servers compute them), the student's at the rollout temperature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ppo import algorithms, models, packed_forward, sharding, ulysses
from ppo.batch import Batch
from ppo.config import PPOConfig
from ppo.data_files import DataError
from ppo.metrics import extreme_part, ratio_parts
from ppo.packing import pack_rows, plan_eval_micro_batches


def routing_value(record: Any, field: str) -> Any:
    """The value of ``distillation.teacher_key`` of a row: its ``data_source``, or its ``extra_info``'s
    field of that name (None where the row has none)."""
    if field == "data_source":
        return record.data_source
    return (record.extra_info or {}).get(field)


def route(cfg: PPOConfig, records: list[Any], where: str) -> list[str]:
    """The name of each row's teacher (``distillation.teacher_models``); a ``DataError`` naming the row and
    its value where no teacher has that key (one teacher takes every row)."""
    d = cfg.distillation
    if len(d.teacher_models) == 1:
        return list(d.teacher_models) * len(records)
    by_key = {t.key: name for name, t in d.teacher_models.items()}
    out = []
    for record in records:
        value = routing_value(record, d.teacher_key)
        if value not in by_key:
            raise DataError(
                f"{where}: row {record.index} has {d.teacher_key}={value!r}, which no teacher's key is "
                f"(distillation.teacher_models keys: {', '.join(sorted(map(str, by_key)))}); add a teacher "
                f"with that key or drop the row"
            )
        out.append(by_key[value])
    return out


def check_routing(cfg: PPOConfig, records: list[Any]) -> None:
    """Before any model loads: every training row has a teacher."""
    if cfg.distillation.enabled:
        route(cfg, records, "data.train_files")


@torch.no_grad()
def forward_teachers(
    cfg: PPOConfig, teachers: dict[str, torch.nn.Module], batch: Batch, sp: ulysses.SPGroup
) -> None:
    """Each row's teacher's log-probs into ``batch``: of the sampled tokens (``teacher_logprobs [B, R]``)
    or, for ``forward_kl_topk``, its top-k (``teacher_topk_logprobs``, ``teacher_topk_ids [B, R, K]``).

    Every rank runs every teacher's forwards the same number of times (each is a collective over the
    shards): a teacher's rows are split into micro-batches whose count is agreed across ranks, and a rank
    with fewer forwards a row of its own for the others' sake and drops the result."""
    loss = cfg.distillation.distillation_loss
    names = route(cfg, batch.records, "the step's rows")
    shape = tuple(batch.attention_mask.shape)
    device = batch.attention_mask.device
    if loss.use_topk:
        batch.teacher_topk_logprobs = torch.zeros((*shape, loss.topk), device=device)
        batch.teacher_topk_ids = torch.zeros((*shape, loss.topk), dtype=torch.long, device=device)
    else:
        batch.teacher_logprobs = torch.zeros(shape, device=device)
    lengths = batch.seq_lens
    a = cfg.actor
    for name, teacher in teachers.items():  # the same order on every rank
        rows = [i for i, n in enumerate(names) if n == name]
        groups = plan_eval_micro_batches(
            [lengths[i] for i in rows],
            use_dynamic_bsz=a.use_dynamic_bsz,
            max_tokens=a.ppo_max_token_len_per_gpu * a.ulysses_sequence_parallel_size,
            micro_batch_size=cfg.ref.log_prob_micro_batch_size_per_gpu or a.ppo_micro_batch_size_per_gpu,
        )
        with models.evaluating(teacher):
            for group in groups:
                sel = torch.tensor([rows[i] for i in group] or [0], device=device)
                packed = pack_rows(batch, sel)
                if loss.use_topk:
                    logprobs, ids = packed_forward.topk(
                        teacher, packed, sp, k=loss.topk, backend=a.kernel_backend
                    )
                    if group:
                        batch.teacher_topk_logprobs[sel], batch.teacher_topk_ids[sel] = logprobs, ids
                else:
                    logprobs, _ = packed_forward.logprobs(
                        teacher,
                        packed,
                        sp,
                        temperature=1.0,
                        backend=a.kernel_backend,
                        fused=a.use_fused_kernels,
                    )
                    if group:
                        batch.teacher_logprobs[sel] = logprobs
        sharding.release(teacher)


@dataclass(kw_only=True)
class StudentForward:
    """The student's side of a micro-batch, from the actor loss's one forward."""

    logprobs: torch.Tensor
    """[b, R] log-probs of the sampled tokens (with gradient)."""
    old_logprobs: torch.Tensor
    """[b, R] the old policy's (``use_policy_gradient``'s ratio)."""
    topk_logprobs: torch.Tensor | None = None
    """[b, R, K] log-probs at the teacher's top-k ids (with gradient), for ``forward_kl_topk``."""
    topk_ids: torch.Tensor | None = None
    """[b, R, K] the student's own top-k ids (the overlap metrics)."""
    is_weights: torch.Tensor | None = None
    """[b, R] off-policy importance weights of the policy-gradient loss, as the task's."""


def student_loss(
    cfg: PPOConfig,
    batch: Batch,
    sel: torch.Tensor,
    mask: torch.Tensor,
    student: StudentForward,
    counts: dict[str, float],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's share of the distillation loss and its metrics (``distillation/*``, verl's names).

    Per token, the estimator ``loss_mode`` of the student's and teacher's log-probs of the sampled token,
    or the top-k forward KL; clamped to ``loss_max_clamp``; then aggregated with ``actor.loss_agg_mode``,
    or (``use_policy_gradient``) its negative, detached, is the advantage of a clipped policy-gradient
    loss (``clip_ratio_low/high`` of the distillation loss, dual clip 3 as verl)."""
    loss_cfg = cfg.distillation.distillation_loss
    if loss_cfg.use_topk:
        teacher_lp, clamp = batch.teacher_topk_logprobs[sel], loss_cfg.log_prob_min_clamp
        token_losses, student_mass, teacher_mass = algorithms.forward_kl_topk(
            student.topk_logprobs, teacher_lp, clamp
        )
        overlap, advantage = algorithms.topk_overlap(
            batch.teacher_topk_ids[sel], student.topk_ids, teacher_lp, student.topk_logprobs, clamp
        )
        means, extremes = algorithms.distillation_topk_metrics(
            student_mass, teacher_mass, mask, overlap, advantage, loss_cfg.topk
        )
        _, loss_extremes = algorithms.distillation_metrics(token_losses, mask)
        extremes |= loss_extremes  # verl logs abs_loss for the estimator modes only
    else:
        token_losses = algorithms.distillation_token_losses(
            student.logprobs, batch.teacher_logprobs[sel], loss_cfg.loss_mode
        )
        means, extremes = algorithms.distillation_metrics(token_losses, mask)
    parts: dict[str, torch.Tensor] = {}
    for key, (total, count) in means.items():
        parts |= ratio_parts(f"distillation/{key}", total, count)
    for key, value in extremes.items():
        parts |= extreme_part(f"distillation/{key}", value, "min" if key.endswith("_min") else "max")
    if loss_cfg.use_policy_gradient:
        inputs = algorithms.PolicyLossInputs(
            logprobs=student.logprobs,
            old_logprobs=student.old_logprobs,
            response_mask=mask,
            advantages=algorithms.distillation_pg_advantages(token_losses, loss_cfg.loss_max_clamp),
            is_weights=student.is_weights,
        )
        settings = algorithms.PolicyLossSettings(
            loss_agg_mode=cfg.actor.loss_agg_mode,
            clip_ratio_low=loss_cfg.clip_ratio_low,
            clip_ratio_high=loss_cfg.clip_ratio_high,
            clip_ratio_c=3.0,
        )
        loss, pg_metrics = algorithms.POLICY_LOSSES[loss_cfg.policy_loss_mode](inputs, settings, **counts)
        parts |= {f"distillation/{k}": v for k, v in pg_metrics.items()}
    else:
        loss = algorithms.distillation_loss(
            token_losses, mask, cfg.actor.loss_agg_mode, loss_cfg.loss_max_clamp, **counts
        )
    parts["distillation/loss"] = loss.detach()
    return loss, parts
