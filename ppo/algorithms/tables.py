"""The recipes' tables: each policy loss and each advantage estimator under its config name, one
function per row (verl's ``core_algos`` registries). The trainer looks a name up here and has no branch
per recipe; a new recipe adds its math to a module of this package and its row below.

    loss, metrics = POLICY_LOSSES[cfg.actor.policy_loss.loss_mode](inputs, settings, **counts)
    advantages, returns, targets = ADVANTAGE_ESTIMATORS[name](inputs, settings)

``ppo.choices`` lists the same names for the config schema (which cannot import torch); a test checks
that the two agree.
"""

from collections.abc import Callable

import torch

from ppo.algorithms.advantages import (
    AdvantageInputs,
    AdvantageSettings,
    Estimate,
    gae_estimator,
    grpo_estimator,
    opo_estimator,
    reinforce_plus_plus_baseline_estimator,
    reinforce_plus_plus_estimator,
    rloo_estimator,
)
from ppo.algorithms.losses import (
    PolicyLossInputs,
    PolicyLossSettings,
    clip_cov_policy_loss,
    gspo_policy_loss,
    kl_cov_policy_loss,
    vanilla_policy_loss,
)
from ppo.algorithms.prime import prime_estimator
from ppo.algorithms.sppo import sppo_estimator, sppo_policy_loss

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``fn(PolicyLossInputs, PolicyLossSettings, *, num_tokens, num_seqs, loss_scale_factor) -> (scalar
loss, metrics)``: the metrics are detached scalar tensors, shares of the mini-batch's mean."""

EstimatorFn = Callable[[AdvantageInputs, AdvantageSettings], Estimate]
"""``fn(AdvantageInputs, AdvantageSettings) -> Estimate(advantages, returns, targets)``."""

POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "vanilla": vanilla_policy_loss,
    "gspo": gspo_policy_loss,
    "clip_cov": clip_cov_policy_loss,
    "kl_cov": kl_cov_policy_loss,
    "sppo": sppo_policy_loss,
}
"""``actor.policy_loss.loss_mode`` -> its loss."""

ADVANTAGE_ESTIMATORS: dict[str, EstimatorFn] = {
    "gae": gae_estimator,
    "grpo": grpo_estimator,
    "rloo": rloo_estimator,
    "reinforce_plus_plus": reinforce_plus_plus_estimator,
    "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline_estimator,
    "opo": opo_estimator,
    "prime": prime_estimator,
    "sppo": sppo_estimator,
}
"""``algorithm.adv_estimator`` -> its estimator; ``sppo``: SPPO's targets, which
``actor.policy_loss.loss_mode=sppo`` uses in place of the configured estimator."""


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
    loss_agg_mode: str,
    *,
    is_weights: torch.Tensor | None = None,
    loss_mode: str = "vanilla",
    cov_mask: torch.Tensor | None = None,
    ppo_kl_coef: float = 0.1,
    **counts: int | float | torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The token policy loss ``loss_mode`` (``POLICY_LOSSES``) called with plain arguments, as verl's
    ``compute_policy_loss``: see each loss's docstring for its formula and metrics. Shapes: ``[B, T]``;
    returns ``(scalar loss, metrics)``. ValueError for an unknown mode (and SPPO, whose input is
    per-response targets: use ``POLICY_LOSSES["sppo"]``)."""
    if loss_mode not in POLICY_LOSSES or loss_mode == "sppo":
        valid = ", ".join(m for m in POLICY_LOSSES if m != "sppo")
        raise ValueError(f"unknown loss_mode {loss_mode!r}; valid: {valid}")
    inputs = PolicyLossInputs(
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        response_mask=response_mask,
        advantages=advantages,
        is_weights=is_weights,
        cov_mask=cov_mask,
    )
    settings = PolicyLossSettings(
        loss_agg_mode=loss_agg_mode,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        ppo_kl_coef=ppo_kl_coef,
    )
    return POLICY_LOSSES[loss_mode](inputs, settings, **counts)
