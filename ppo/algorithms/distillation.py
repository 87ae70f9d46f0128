"""On-policy distillation: the student samples, a teacher scores the student's tokens, and the student is
trained to lower a divergence from the teacher on its own samples (verl 0.9.1's ``distillation``).

Two kinds of per-token loss, ``[B, T]`` over response tokens:

- an estimator of the reverse KL(π_student ‖ π_teacher) from the sampled token's two log-probs
  (``kl``/``k1``, ``abs``, ``mse``/``k2``, ``low_var_kl``/``k3``; :func:`distillation_token_losses`);
- the forward KL(π_teacher ‖ π_student) restricted to the teacher's top-k tokens (``forward_kl_topk``;
  :func:`forward_kl_topk`), with the teacher/student top-k overlap as diagnostics (:func:`topk_overlap`).

The per-token losses are then either aggregated and backpropagated as a supervised loss
(:func:`distillation_loss`, Gu et al. arXiv:2306.13649), or used as a negative reward in the clipped
policy gradient (:func:`distillation_pg_advantages` into ``POLICY_LOSSES["vanilla"]``; Thinking Machines'
"On-Policy Distillation", 2025)::

    token_losses = distillation_token_losses(logprobs, teacher_logprobs, "k3")
    loss = distillation_loss(token_losses, response_mask, "token-mean", loss_max_clamp=10.0,
                             num_tokens=num_tokens_in_mini_batch)
    means, extremes = distillation_metrics(token_losses, response_mask)

Metrics are returned without verl's ``distillation/`` prefix, in two dicts: means as ``(sum, count)``
pairs (the mean of a mini-batch is ``Σ sum / Σ count`` over its micro-batches and ranks) and extremes
(``*_min`` reduced with min, ``*_max`` with max). Shapes: ``[B, T]`` (any leading shape works),
top-k inputs ``[B, T, K]``.
"""

import torch

from ppo.algorithms.kl import kl_penalty
from ppo.algorithms.losses import agg_loss
from ppo.choices import DISTILLATION_LOSS_MODES

# The loss modes of distillation_token_losses: the single-sample reverse-KL estimators.
_ESTIMATOR_MODES = tuple(m for m in DISTILLATION_LOSS_MODES if m != "forward_kl_topk")


def _float(x: torch.Tensor) -> torch.Tensor:
    """``x`` detached, in at least fp32 (fp64 stays fp64)."""
    return x.detach().to(torch.promote_types(x.dtype, torch.float32))


def distillation_token_losses(
    student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, loss_mode: str
) -> torch.Tensor:
    """Per-token reverse-KL estimate of KL(π_student ‖ π_teacher) on the sampled tokens (verl's
    ``kl_penalty(logprob=student, ref_logprob=teacher, kl_penalty=loss_mode)``).

    With ``d = student_logprobs - teacher_logprobs``: ``kl``/``k1`` ``d``; ``abs`` ``|d|``;
    ``mse``/``k2`` ``½ d²``; ``low_var_kl``/``k3`` ``eˣ - x - 1`` with ``x = clamp(-d, ±20)``, clamped to
    ``[-10, 10]`` (:func:`ppo.algorithms.kl.kl_penalty`). The gradient flows to ``student_logprobs``;
    ``k1``'s gradient does not depend on the teacher, which is why verl refuses ``k1`` as a supervised
    loss and takes it only as a policy-gradient reward.

    Shapes: ``[B, T]`` both; returns ``[B, T]``. Raises ValueError for any other mode (``forward_kl_topk``
    included: it needs the teacher's top-k, :func:`forward_kl_topk`; ``+`` suffixes are not modes here).
    """
    if loss_mode not in _ESTIMATOR_MODES:
        hint = " (forward_kl_topk is computed by forward_kl_topk())" if loss_mode == "forward_kl_topk" else ""
        raise ValueError(
            f"unknown distillation estimator {loss_mode!r}{hint}; valid modes: {', '.join(_ESTIMATOR_MODES)}"
        )
    return kl_penalty(student_logprobs, teacher_logprobs, loss_mode)


def forward_kl_topk(
    student_topk_logprobs: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    log_prob_min_clamp: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward KL(π_teacher ‖ π_student) over the teacher's top-k tokens, per token (verl's
    ``fsdp.losses.compute_forward_kl_topk`` followed by its ``clamp_min(0)``).

    With ``t_k`` the teacher's top-k log-probs and ``s_k`` the student's log-probs at the same token
    ids, both first clamped below at ``log_prob_min_clamp`` when given (in their own dtype, as verl)::

        loss = max(Σ_k exp(t_k) (t_k - s_k), 0)                     in fp32 (as verl, fp64 too)
        student_mass = Σ_k exp(s_k),  teacher_mass = Σ_k exp(t_k)   unclamped, in at least fp32

    The top-k masses are below 1, so the sum can be negative (the student puts more mass than the
    teacher on those ids): the clamp at 0 keeps the loss a divergence. The gradient flows to
    ``student_topk_logprobs`` only: ``∂loss/∂s_k = -exp(t_k)`` where the loss is positive and ``s_k``
    is above the clamp, 0 elsewhere. The masses are detached (diagnostics).

    Shapes: ``[..., K]`` both (``[B, T, K]``); returns three ``[...]`` tensors
    ``(losses, student_mass, teacher_mass)``.
    """
    with torch.no_grad():
        student_mass = _float(student_topk_logprobs).exp().sum(-1)
        teacher_mass = _float(teacher_topk_logprobs).exp().sum(-1)
    s, t = student_topk_logprobs, teacher_topk_logprobs.detach()
    if log_prob_min_clamp is not None:
        s, t = s.clamp_min(log_prob_min_clamp), t.clamp_min(log_prob_min_clamp)
    s, t = s.float(), t.float()
    losses = (t.exp() * (t - s)).sum(-1).clamp_min(0.0)
    return losses, student_mass, teacher_mass


@torch.no_grad()
def topk_overlap(
    teacher_ids: torch.Tensor,
    student_topk_ids: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    student_topk_logprobs: torch.Tensor,
    log_prob_min_clamp: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """How much the teacher's and the student's top-k agree, per token (verl's diagnostics after
    "Rethinking On-Policy Distillation of Large Language Models", arXiv:2604.13016).

    ``o_k = [teacher_ids_k ∈ student_topk_ids]`` (the student's own top-k ids), ``count = Σ_k o_k``,
    ``advantage = Σ_k o_k · (-exp(t_k) (t_k - s_k)) / count`` (0 where ``count = 0``): the mean
    negative teacher-weighted KL term over the overlapped ids. ``t_k``, ``s_k`` as in
    :func:`forward_kl_topk` (``student_topk_logprobs`` is the student's log-probs at the TEACHER's ids),
    clamped below at ``log_prob_min_clamp`` when given: verl computes the advantage from the clamped
    log-probs, so pass the loss's clamp to match it. Computed in at least fp32, without gradient.

    Shapes: ``teacher_ids [..., K]``, ``student_topk_ids [..., K']``, the log-probs ``[..., K]``;
    returns ``(overlap_count [...] int64, overlap_token_advantage [...])``.
    """
    overlap = (teacher_ids.unsqueeze(-1) == student_topk_ids.unsqueeze(-2)).any(-1)
    count = overlap.sum(-1)
    s, t = student_topk_logprobs, teacher_topk_logprobs
    if log_prob_min_clamp is not None:
        s, t = s.clamp_min(log_prob_min_clamp), t.clamp_min(log_prob_min_clamp)
    s, t = _float(s), _float(t)
    terms = torch.where(overlap, -t.exp() * (t - s), torch.zeros((), dtype=t.dtype, device=t.device))
    advantage = torch.where(count > 0, terms.sum(-1) / count.clamp(min=1), torch.zeros_like(terms[..., 0]))
    return count, advantage


def _clamp(token_losses: torch.Tensor, loss_max_clamp: float | None) -> torch.Tensor:
    """``clamp(token_losses, -loss_max_clamp, loss_max_clamp)``, or unchanged when None (the lower bound
    is for k1, which can be negative)."""
    if loss_max_clamp is None:
        return token_losses
    return token_losses.clamp(min=-loss_max_clamp, max=loss_max_clamp)


def distillation_loss(
    token_losses: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    loss_max_clamp: float | None = None,
    **counts: int | float | torch.Tensor | None,
) -> torch.Tensor:
    """The supervised distillation loss (verl's ``distillation_loss`` with ``use_policy_gradient=False``):
    ``agg_loss(clamp(token_losses, ±loss_max_clamp), response_mask, loss_agg_mode, **counts)``.

    ``counts`` (``num_tokens``, ``num_seqs``, ``loss_scale_factor``) go to :func:`agg_loss` unchanged:
    counted over the whole mini-batch they make the sum over micro-batches and ranks equal the
    mini-batch's loss. The gradient of a clamped token is 0. Shapes: ``[B, T]``; returns a scalar.
    """
    return agg_loss(_clamp(token_losses, loss_max_clamp), response_mask, loss_agg_mode, **counts)


def distillation_pg_advantages(
    token_losses: torch.Tensor, loss_max_clamp: float | None = None
) -> torch.Tensor:
    """Per-token advantages of the policy-gradient form (verl's ``use_policy_gradient=True``): the
    negative (clamped, as :func:`distillation_loss`) per-token loss, detached,
    ``A = -clamp(token_losses, ±loss_max_clamp)``. The loss itself is the clipped policy loss
    ``POLICY_LOSSES["vanilla"]`` with these advantages. Shapes: ``[B, T]``; returns ``[B, T]``."""
    return -_clamp(token_losses.detach(), loss_max_clamp)


def _masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum()


def _extremes(name: str, x: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{name_min, name_max}`` of ``x`` over ``mask``; ``+inf`` / ``-inf`` (the identities of min and
    max) where the mask is empty."""
    inf = torch.tensor(float("inf"), dtype=x.dtype, device=x.device)
    return {
        f"{name}_min": torch.where(mask, x, inf).min() if x.numel() else inf,
        f"{name}_max": torch.where(mask, x, -inf).max() if x.numel() else -inf,
    }


def distillation_metrics(
    token_losses: torch.Tensor, response_mask: torch.Tensor
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]]:
    """verl's per-token loss metrics of a micro-batch, without the ``distillation/`` prefix:

    - means as ``(sum, count)`` pairs: ``abs_loss`` = ``(Σ_masked |loss|, #masked)``;
    - extremes: ``loss_min``, ``loss_max`` over the masked tokens.

    Pass the losses BEFORE ``loss_max_clamp`` (as verl logs them), i.e. the output of
    :func:`distillation_token_losses` or the first output of :func:`forward_kl_topk` (already clamped at
    0 there, as verl). verl logs ``abs_loss`` for the estimator modes only (for ``forward_kl_topk`` it
    equals the mean loss). Over micro-batches and ranks: the mean is ``Σ sum / Σ count`` (0 if the count
    is 0), ``*_min`` reduce with min and ``*_max`` with max. An empty mask gives ``(0, 0)`` for the mean
    and ``+inf`` / ``-inf`` for ``loss_min`` / ``loss_max``, never NaN; a mini-batch whose every token is
    masked therefore ends at ``±inf``, which the caller reports as it chooses.

    Detached fp32 (or fp64) scalars. Shapes: ``[B, T]`` both.
    """
    mask = response_mask.bool()
    x = _float(token_losses)
    count = mask.sum().to(x.dtype)
    return {"abs_loss": (_masked_sum(x.abs(), mask), count)}, _extremes("loss", x, mask)


def distillation_topk_metrics(
    student_mass: torch.Tensor,
    teacher_mass: torch.Tensor,
    response_mask: torch.Tensor,
    overlap_count: torch.Tensor | None = None,
    overlap_token_advantage: torch.Tensor | None = None,
    topk: int | None = None,
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]]:
    """verl's ``forward_kl_topk`` metrics of a micro-batch, without the ``distillation/`` prefix, from the
    outputs of :func:`forward_kl_topk` and :func:`topk_overlap`:

    - means as ``(sum, count)``: ``student_mass``, ``teacher_mass`` (over masked tokens);
      ``overlap_ratio`` = ``(Σ_masked overlap_count / topk, #masked)``; ``overlap_token_advantage`` =
      ``(Σ overlap_token_advantage, #tokens)`` over the masked tokens with ``overlap_count > 0``;
    - extremes: ``student_mass_min``, ``student_mass_max``, ``teacher_mass_min``, ``teacher_mass_max``.

    The overlap metrics are present only when ``overlap_count``, ``overlap_token_advantage`` and
    ``topk`` are given. Reduction and empty masks as :func:`distillation_metrics`: a mean with count 0 is
    0 (verl's ``overlap_token_advantage`` with no overlapped token is 0 too), an empty ``*_min`` is
    ``+inf`` and ``*_max`` ``-inf``. Detached fp32 (or fp64) scalars. Shapes: ``[B, T]`` all.
    """
    mask = response_mask.bool()
    student, teacher = _float(student_mass), _float(teacher_mass)
    count = mask.sum().to(student.dtype)
    means = {
        "student_mass": (_masked_sum(student, mask), count),
        "teacher_mass": (_masked_sum(teacher, mask), count),
    }
    extremes = {**_extremes("student_mass", student, mask), **_extremes("teacher_mass", teacher, mask)}
    if overlap_count is not None and overlap_token_advantage is not None and topk is not None:
        means["overlap_ratio"] = (_masked_sum(_float(overlap_count) / topk, mask), count)
        overlapped = mask & (overlap_count > 0)
        advantage = _float(overlap_token_advantage)
        means["overlap_token_advantage"] = (
            _masked_sum(advantage, overlapped),
            overlapped.sum().to(advantage.dtype),
        )
    return means, extremes
