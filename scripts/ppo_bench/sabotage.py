"""A recipe broken on purpose, to show that a comparison sees a subtle error: the trainer's own
``train_ppo.main`` with one row of its recipe tables (``ppo.algorithms.ADVANTAGE_ESTIMATORS``) replaced.

    torchrun --standalone --nproc_per_node=2 -m ppo_bench.sabotage NAME --config configs/X.yaml [key=value ...]

Every argument after ``NAME`` is train_ppo.py's. ``recipes.py --sabotage NAME`` runs it beside the intact
recipes. The sabotages (``SABOTAGES``):

- ``grpo_no_baseline``: GRPO without its group baseline, ``A_i = s_i / (std_g + 1e-6)`` in place of
  ``(s_i - mean_g) / (std_g + 1e-6)``; a group whose scores are all equal still gets 0, as in GRPO. With 0/1
  scores the right answers are pushed up and the wrong ones are never pushed down: the kind of error that
  still "works", and only a task that does not saturate can tell apart.

- ``grpo_abs_advantage``: GRPO whose advantage loses its sign, ``A_i = |s_i - mean_g| / (std_g + 1e-6)``:
  a wrong answer in a group that has a right one is pushed up as if it were right, with the weight the
  right ones get where the group is mostly wrong. Unlike the missing baseline this changes the expected
  gradient: a prompt's accuracy p moves as ``p (1 - p) (1 - 2p)``, up below one half and down above it.

- ``grpo_shifted_scores``: GRPO whose scores are off by one inside each group (response ``i`` gets the
  score of the next response to the same prompt, the last one the first's): the kind of slip a reorder
  of the batch makes. The advantage no longer belongs to the response it pushes.

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
    _, std = group_mean_std(scores, group_ids)
    return torch.where(std > 0, scores / (std + 1e-6), torch.zeros_like(scores))


def grpo_absolute_advantage(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """``[B]`` advantages ``|s_i - mean_g| / (std_g + 1e-6)`` (unbiased std of the group's scores): GRPO's
    advantage without its sign; a group of equal scores gets 0, as in GRPO."""
    scores = scores.double()
    mean, std = group_mean_std(scores, group_ids)
    return (scores - mean).abs() / (std + 1e-6)


def grpo_shifted_scores(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """``[B]`` GRPO's advantages ``(s'_i - mean_g) / (std_g + 1e-6)`` of the scores shifted by one inside
    each group: ``s'_i`` is the score of the next response of ``i``'s group in batch order (the last one's
    is the first's)."""
    scores = scores.double()
    shifted = scores.clone()
    for g in torch.unique(group_ids):
        members = (group_ids == g).nonzero().flatten()
        shifted[members] = scores[members.roll(-1)]
    mean, std = group_mean_std(shifted, group_ids)
    return (shifted - mean) / (std + 1e-6)


def group_mean_std(scores: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each score's group mean and unbiased std (1 sample: std 0), ``group_ids`` any integers."""
    _, index = torch.unique(group_ids, return_inverse=True)
    groups = int(index.max()) + 1 if index.numel() else 0
    count = torch.zeros(groups, dtype=scores.dtype).index_add_(0, index, torch.ones_like(scores))
    mean = torch.zeros(groups, dtype=scores.dtype).index_add_(0, index, scores) / count
    squares = torch.zeros(groups, dtype=scores.dtype).index_add_(0, index, (scores - mean[index]) ** 2)
    return mean[index], (squares / (count - 1).clamp(min=1)).sqrt()[index]


def patch_grpo(advantage: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """Replace the ``grpo`` estimator by ``advantage(summed token rewards, group ids)`` on every token."""
    from ppo import algorithms

    def estimator(x: algorithms.AdvantageInputs, s: algorithms.AdvantageSettings) -> algorithms.Estimate:
        advantages = advantage(x.token_rewards.sum(-1), x.group_ids).to(torch.float32)
        advantages = advantages.unsqueeze(-1) * x.response_mask.to(torch.float32)
        return algorithms.Estimate(advantages, advantages)

    algorithms.ADVANTAGE_ESTIMATORS["grpo"] = estimator


SABOTAGES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "grpo_no_baseline": grpo_without_baseline,
    "grpo_abs_advantage": grpo_absolute_advantage,
    "grpo_shifted_scores": grpo_shifted_scores,
}
"""``NAME`` -> the advantage that replaces GRPO's (``patch_grpo``)."""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in SABOTAGES:
        print(
            f"sabotage: error: give a sabotage first ({', '.join(SABOTAGES)}), then train_ppo.py's arguments",
            file=sys.stderr,
        )
        return 2
    patch_grpo(SABOTAGES[args[0]])
    import train_ppo  # the repository root is on PYTHONPATH (runs.run_env)

    return train_ppo.main(args[1:])


if __name__ == "__main__":
    from ppo.distributed import exit_process  # as train_ppo.py ends: no interpreter teardown under gloo

    exit_process(main())
