"""A world-size error lists the world sizes that fit; a multi-rank preset under plain python names the
torchrun command."""

from __future__ import annotations

import pytest

from ppo import runner
from ppo.config import ConfigError, PPOConfig
from ppo.config_loader import load_config
from tests.helpers import demo_inputs


def config(*overrides: str) -> PPOConfig:
    return load_config(None, [*demo_inputs(), *overrides], PPOConfig)


def test_world_size_error_lists_the_sizes_that_fit() -> None:
    # 12 prompts, mini-batch 6 x n=2 = 12 sequences, micro-batch 2: ranks must divide 12 prompts and
    # 12 sequences, and 12 / w sequences per rank must be a multiple of 2: w in {1, 2, 3, 6}
    cfg = config(
        "data.train_batch_size=12",
        "actor.ppo_mini_batch_size=6",
        "critic.ppo_mini_batch_size=6",
        "rollout.n=2",
        "actor.ppo_micro_batch_size_per_gpu=2",
        "critic.ppo_micro_batch_size_per_gpu=2",
        "actor.use_dynamic_bsz=false",
        "critic.use_dynamic_bsz=false",
    )
    with pytest.raises(ConfigError) as error:
        cfg.validate(4)
    assert str(error.value).endswith("\n  - world sizes these batch sizes fit: 1, 2, 3, 6")
    cfg.validate(3)


def test_a_fitting_world_size_is_not_listed_for_a_planned_size_mismatch() -> None:
    cfg = config("trainer.n_gpus_per_node=8", "data.train_batch_size=16", "actor.ppo_mini_batch_size=16")
    with pytest.raises(ConfigError) as error:
        cfg.validate(2)
    assert "world sizes these batch sizes fit" not in str(error.value)


def test_planned_ranks_under_plain_python_say_torchrun() -> None:
    cfg = config("trainer.n_gpus_per_node=8")
    with pytest.raises(ConfigError) as error:
        runner.check_launcher(cfg, 1, {}, script="train_ppo.py")
    assert "launch it with `torchrun --nproc_per_node=8 train_ppo.py ...`" in str(error.value)
    cfg = config("trainer.n_gpus_per_node=8", "trainer.nnodes=2")
    with pytest.raises(ConfigError, match=r"`torchrun --nnodes=2 --nproc_per_node=8 train_ppo.py ...`"):
        runner.check_launcher(cfg, 1, {}, script="train_ppo.py")
    runner.check_launcher(cfg, 1, {"WORLD_SIZE": "1"}, script="train_ppo.py")  # torchrun with one rank
    runner.check_launcher(config(), 1, {}, script="train_ppo.py")  # no plan: one process is fine
