"""Runs with ``actor.use_prefix_grouper=true`` (the default ``auto`` on these models) train what the
same runs train with ``false``: GRPO over 5
steps (sampled responses, shuffled mini-batches, several micro-batches), GAE with its critic on 2 FSDP
ranks, LoRA, and Ulysses sequence parallelism on 2 ranks; and verl's spelling of the key turns it on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, base_args, excerpt, hf_weights, read_metrics, run, torchrun

EXACT = [
    "trainer.val_before_train=false",
    "trainer.save_hf_on_end=true",
    "data.max_prompt_length=16",
    # Adam's first steps move a weight by ~lr * g / (|g| + eps): a larger eps keeps the comparison about
    # the gradients, not about the rounding of tiny ones (the sums run in another order).
    "actor.optim.eps=1e-3",
    "critic.optim.eps=1e-3",
]
PLAIN = "actor.use_prefix_grouper=false"
COMPARED = ("actor/pg_loss", "actor/entropy", "critic/score/mean", "response_length/mean")


def assert_same_training(a: Path, b: Path, keys: tuple[str, ...] = COMPARED) -> None:
    """The two runs end with the same weights (the tolerance of the 1-rank = 2-rank test) and logged the
    same losses at every step."""
    wa, wb = hf_weights(a), hf_weights(b)
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], atol=1e-6, rtol=1e-5, msg=key)
    rows_a, rows_b = read_metrics(a), read_metrics(b)
    assert len(rows_a) == len(rows_b) > 0
    for x, y in zip(rows_a, rows_b, strict=True):
        for k in keys:
            assert x[k] == pytest.approx(y[k], rel=1e-4, abs=1e-5), k


@pytest.mark.slow
def test_grpo_five_steps_equal_the_plain_layout(tiny_assets: Path, tmp_path: Path) -> None:
    """Sampled groups of 4, two shuffled mini-batches a step (groups split between them), a KL loss and
    a token budget that cuts several micro-batches: the shared layout trains the same weights and logs the
    same losses as the plain one, with fewer tokens."""
    common = [
        *EXACT,
        "algorithm.adv_estimator=grpo",
        "actor.use_kl_loss=true",
        "rollout.n=4",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=2",
        "actor.ppo_max_token_len_per_gpu=48",
    ]
    plain, shared = tmp_path / "plain", tmp_path / "shared"
    assert run(base_args(tiny_assets, plain, steps=5) + common + [PLAIN]) == 0
    assert run(base_args(tiny_assets, shared, steps=5) + common + ["actor.use_prefix_grouper=true"]) == 0
    assert_same_training(plain, shared, (*COMPARED, "actor/kl_loss", "actor/ppo_kl"))


@pytest.mark.slow
def test_gae_on_two_ranks_and_sequence_parallel_equal_one_plain_rank(
    tiny_assets: Path, tmp_path: Path
) -> None:
    """GAE with its critic on 2 FSDP ranks, and GRPO under Ulysses sequence parallelism on 2 ranks, both
    with shared prompts, train what one rank trains without them (greedy rollouts: the same batch on any
    layout)."""
    greedy = [*EXACT, "rollout.do_sample=false", "actor.ppo_mini_batch_size=4", "data.train_batch_size=4"]
    gae = [*greedy, "actor.ppo_max_token_len_per_gpu=40", "critic.ppo_max_token_len_per_gpu=40"]
    sp = [
        *greedy,
        "algorithm.adv_estimator=grpo",
        "actor.use_kl_loss=true",
        "actor.entropy_coeff=0.01",  # greedy samples of a group are equal: the entropy gives the gradient
        "actor.ppo_max_token_len_per_gpu=24",
    ]
    for name, common, extra in (
        ("gae", gae, []),
        ("sp", sp, ["actor.ulysses_sequence_parallel_size=2"]),
    ):
        one, two = tmp_path / f"{name}_one", tmp_path / f"{name}_two"
        one_args = common + (["actor.ppo_max_token_len_per_gpu=48"] if name == "sp" else [])
        assert run(base_args(tiny_assets, one) + one_args + [PLAIN]) == 0
        proc = torchrun(
            ROOT / "train_ppo.py",
            *base_args(tiny_assets, two),
            *common,
            *extra,
            "actor.use_prefix_grouper=true",
            "trainer.dist_timeout_s=120",
        )
        assert proc.returncode == 0, excerpt(proc.stderr)
        keys = (*COMPARED, "critic/vf_loss", "critic/values/mean") if name == "gae" else COMPARED
        assert_same_training(one, two, keys)


@pytest.mark.slow
def test_lora_equals_the_plain_layout(tiny_assets: Path, tmp_path: Path) -> None:
    """LoRA (the reference is the actor with its adapters off) in verl's spelling of the key."""
    common = [
        *EXACT,
        "algorithm.adv_estimator=grpo",
        "actor.use_kl_loss=true",
        "actor.lora.rank=4",
        "actor.optim.lr=1e-2",
        "rollout.n=4",
    ]
    plain, shared = tmp_path / "plain", tmp_path / "shared"
    assert run(base_args(tiny_assets, plain, steps=3) + common + [PLAIN]) == 0
    verl = "actor_rollout_ref.actor.use_prefix_grouper=true"
    assert run(base_args(tiny_assets, shared, steps=3) + common + [verl]) == 0
    assert_same_training(plain, shared, (*COMPARED, "actor/kl_loss"))
