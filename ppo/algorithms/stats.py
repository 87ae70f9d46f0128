"""Masked statistics over response tokens: the mean and the whitening every estimator and loss uses;
the validation estimators over a prompt's ``n`` sampled answers (unbiased pass@k, verl's bootstrapped
best@k).

Shapes: ``x [...]`` with ``mask`` broadcastable to it (bool or 0/1, True = the token counts).
"""

import math
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


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` answers of which ``c`` are right (Chen et al. 2021, "Evaluating Large
    Language Models Trained on Code"): ``1 - C(n - c, k) / C(n, k)``, the chance that ``k`` answers
    drawn without replacement from the ``n`` hold a right one. ``pass_at_k(8, 2, 4) = 1 - 15/70 =
    0.785714``; ``pass_at_k(n, c, 1) = c / n``. Raises ValueError unless ``0 <= c <= n`` and
    ``1 <= k <= n``."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def bootstrap_best(scores: torch.Tensor, draws: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``best@k``: the best score among ``k`` answers drawn *with replacement* from a prompt's
    ``n``, averaged over the draws (verl's ``bootstrap_metric`` with ``np.max``).

    ``scores [n]`` (one prompt's answers), ``draws [num_draws, k]`` (indices into ``scores``; the caller
    draws them: verl takes ``num_draws = 1000`` rows from a NumPy RandomState seeded 42 anew for every
    ``k``). Returns ``(mean, std)`` over the draws of ``max(scores[draws[b]])``, in float64, std with no
    Bessel correction (``np.std``). Drawing with replacement repeats answers, so for 0/1 scores the
    value sits below the unbiased ``pass_at_k``: with one right answer among ``n`` it tends to
    ``1 - (1 - 1/n)^k`` (0.656 for ``n = k = 8``) where pass@8 is 1.
    """
    best = scores.double()[draws].amax(dim=-1)
    return best.mean(), best.std(correction=0)
