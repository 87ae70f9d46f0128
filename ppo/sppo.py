"""SPPO's glue (the SPPO recipe of verl; its math is ``ppo.algorithms.sppo``, its loss and its targets the
``sppo`` rows of ``algorithms.POLICY_LOSSES`` and ``ADVANTAGE_ESTIMATORS``, its config
``actor.policy_loss.loss_mode=sppo``, ``actor.sppo_*``, ``algorithm.sppo_*``): the iterations of the
old policy. With ``actor.sppo_refresh_steps = N > 1`` the run keeps a frozen snapshot of the actor (built
by the model room like the actor) that is the old policy of N steps:

    refresh_snapshot(run.sppo_old, actor, step, cfg.actor.sppo_refresh_steps)
    batch.old_logprobs = forwards.forward_old_logprobs(cfg, actor, run.sppo_old, batch, sp)
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict


@torch.no_grad()
def refresh_snapshot(
    snapshot: torch.nn.Module | None, actor: torch.nn.Module, step: int, refresh_steps: int
) -> None:
    """SPPO's iterations: at the start of steps ``1, N + 1, 2N + 1, ...`` (``N = refresh_steps``) the
    snapshot takes the actor's weights, so steps ``kN + 1 .. (k+1)N`` regress onto the log-ratio to the
    actor after step ``kN``. Shard for shard (both are built alike); a no-op without a snapshot. A
    resumed run gets the snapshot from its checkpoint, and the next refresh from the actor itself."""
    if snapshot is None or (step - 1) % refresh_steps:
        return
    set_model_state_dict(snapshot, get_model_state_dict(actor))
