"""Masked statistics over response tokens: the mean and the whitening every estimator and loss uses.

Shapes: ``x [...]`` with ``mask`` broadcastable to it (bool or 0/1, True = the token counts).
"""

from collections.abc import Callable

import torch


def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None
) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is set.

    ``mean = Σ x·m / max(Σ m, 1)`` over ``dim`` (all dimensions when None). ``mask`` is bool or 0/1 and
    broadcastable to ``x``. Masked-out entries are selected away with ``torch.where``, so a NaN or inf
    there cannot leak into the result; an empty mask gives 0, never NaN.

    Shapes: ``x [...]``, ``mask`` broadcastable to ``x``; returns a scalar (``dim=None``) or ``x`` reduced
    over ``dim``.
    """
    mask = mask.expand_as(x).bool()
    total = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    if dim is None:
        return total.sum() / mask.sum().clamp(min=1)
    return total.sum(dim=dim) / mask.sum(dim=dim).clamp(min=1)


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    *,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Normalize ``x`` to zero mean and unit variance over the masked positions (verl's ``masked_whiten``).

    ``μ = masked_mean(x)``, ``σ² = masked_mean((x - μ)²) · n / (n - 1)`` (unbiased, Bessel-corrected, with
    ``n = Σ m``), ``out = (x - μ) / sqrt(σ² + 1e-8)``; with ``shift_mean=False`` the mean is added back:
    ``out + μ``. Statistics are over all masked elements of the tensor (the whole batch), and every
    position, masked or not, is transformed with them: callers that want zeros outside the mask multiply
    by it.

    ``all_reduce``: a function that sums a tensor over data-parallel ranks in place of the identity
    (e.g. ``torch.distributed.all_reduce``); the statistics are then those of the whole batch on all
    ranks, computed in two passes (mean, then the squared deviations) as on one rank, so any number of
    ranks whitens exactly as one process holding every row.

    Where verl raises (``n < 2``), the Bessel factor is taken as 1: a single valid element whitens to 0
    and an empty mask gives ``x / 1e-4`` (μ = σ = 0), both finite.

    Shapes: ``x [...]``, ``mask`` broadcastable to ``x``; returns ``[...]`` like ``x``.
    """
    reduce = all_reduce or (lambda t: t)
    mask = mask.expand_as(x).bool()
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    total, n = reduce(torch.stack([torch.where(mask, x, zero).sum(), mask.sum().to(x.dtype)]))
    mean = total / n.clamp(min=1)
    centered = x - mean
    sq_dev = reduce(torch.where(mask, centered.square(), zero).sum())
    var = sq_dev / (n - 1).clamp(min=1)
    whitened = centered * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened
