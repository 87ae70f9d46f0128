"""A recipe broken on purpose, to show that a comparison sees a subtle error: the trainer's own
``train_ppo.main`` with one row of its recipe tables (``ppo.algorithms.ADVANTAGE_ESTIMATORS``) replaced.

    torchrun --standalone --nproc_per_node=2 -m ppo_bench.sabotage NAME --config configs/X.yaml [key=value ...]

Every argument after ``NAME`` is train_ppo.py's. ``recipes.py --sabotage NAME`` runs it beside the intact
recipes. The sabotages (``SABOTAGES``):

- ``grpo_no_baseline``: GRPO without its group baseline, ``A_i = s_i / (std_g + 1e-6)`` in place of
  ``(s_i - mean_g) / (std_g + 1e-6)``; a group whose scores are all equal still gets 0, as in GRPO. With 0/1
  scores the right answers are pushed up and the wrong ones are never pushed down: the kind of error that
  still "works", and only a task that does not saturate can tell apart.

Nothing of this is in the trainer: the replacement lives here, for the benchmark's runs only.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch


def grpo_without_baseline(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """``[B]`` advantages ``s_i / (std_g + 1e-6)`` (unbiased std of the group's scores) where the group's
    scores differ, else 0: GRPO's advantage with the group mean left in."""
    scores = scores.double()
    _, index = torch.unique(group_ids, return_inverse=True)
    groups = int(index.max()) + 1 if index.numel() else 0
    count = torch.zeros(groups, dtype=scores.dtype).index_add_(0, index, torch.ones_like(scores))
    mean = torch.zeros(groups, dtype=scores.dtype).index_add_(0, index, scores) / count
    squares = torch.zeros(groups, dtype=scores.dtype).index_add_(0, index, (scores - mean[index]) ** 2)
    std = (squares / (count - 1).clamp(min=1)).sqrt()[index]
    return torch.where(std > 0, scores / (std + 1e-6), torch.zeros_like(scores))


def patch_grpo_no_baseline() -> None:
    """Replace the ``grpo`` estimator by :func:`grpo_without_baseline` of the summed token rewards."""
    from ppo import algorithms

    def estimator(x: algorithms.AdvantageInputs, s: algorithms.AdvantageSettings) -> algorithms.Estimate:
        scores = x.token_rewards.sum(-1)
        advantages = grpo_without_baseline(scores, x.group_ids).to(torch.float32)
        advantages = advantages.unsqueeze(-1) * x.response_mask.to(torch.float32)
        return algorithms.Estimate(advantages, advantages)

    algorithms.ADVANTAGE_ESTIMATORS["grpo"] = estimator


SABOTAGES: dict[str, Callable[[], None]] = {"grpo_no_baseline": patch_grpo_no_baseline}
"""``NAME`` -> the function that breaks the recipe in this process."""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in SABOTAGES:
        print(
            f"sabotage: error: give a sabotage first ({', '.join(SABOTAGES)}), then train_ppo.py's arguments",
            file=sys.stderr,
        )
        return 2
    SABOTAGES[args[0]]()
    import train_ppo  # the repository root is on PYTHONPATH (runs.run_env)

    return train_ppo.main(args[1:])


if __name__ == "__main__":
    from ppo.distributed import exit_process  # as train_ppo.py ends: no interpreter teardown under gloo

    exit_process(main())
