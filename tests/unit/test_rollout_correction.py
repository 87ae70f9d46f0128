"""Rollout correction in the actor's update (``ppo.optimize``): the ``mismatch/*`` metrics of a step that
mixes offline groups (whose sampler's log-probs the data records) with sampled ones, at each weight
level, and rejection sampling (``algorithm.rollout_rs``) in the loss closure and its counts. A tiny
random Llama on one process; the old and the data's log-probs are set by hand, so every value below is
derived in a comment."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from ppo import ulysses
from ppo.batch import Batch, Rollout, group_index
from ppo.config_loader import load_config
from ppo.data import PromptRecord
from ppo.optim import Trained
from ppo.optimize import actor_loss, global_counts, optimize, rollout_rejection
from tests.helpers import tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS, WIDTH = 8, 10
# Offline rows 0-3: each token's log-ratio log(pi_old / mu) is log 0.5, log 1, log 1.5, log 3 (the same on
# the row's 10 tokens); rows 4-7 were sampled by the actor: no data log-probs (NaN).
RATIOS = [0.5, 1.0, 1.5, 3.0]


def config(*overrides: str) -> Any:
    return load_config(
        None,
        [
            "data.train_batch_size=4",
            "rollout.n=2",
            "algorithm.adv_estimator=grpo",
            "rollout.offline_fraction=0.5",
            "data.max_response_length=10",
            "algorithm.rollout_is_threshold=2.0",
            "actor.ppo_epochs=2",  # not the on-policy shortcut: the closure reads batch.old_logprobs
            "actor.use_dynamic_bsz=false",
            "actor.ppo_micro_batch_size_per_gpu=4",  # micro-batches rows 0-3 (offline) and 4-7 (sampled)
            "actor.shuffle=false",
            "actor.optim.lr=1e-9",
            *overrides,
        ],
    )


def mixed_batch() -> Batch:
    gen = torch.Generator().manual_seed(0)
    rollout = Rollout(
        prompts=[torch.randint(7, 100, (3,), generator=gen) for _ in range(ROWS)],
        responses=torch.randint(7, 100, (ROWS, WIDTH), generator=gen),
        attention_mask=torch.ones(ROWS, WIDTH, dtype=torch.bool),
        truncated=torch.zeros(ROWS, dtype=torch.bool),
    )
    records = [
        PromptRecord(
            input_ids=p.tolist(), prompt_text="", data_source="t", ground_truth=None, extra_info={}, index=i
        )
        for i, p in enumerate(rollout.prompts)
    ]
    batch = Batch(rollout=rollout, records=records, group_ids=group_index(ROWS, 2, torch.device("cpu")))
    batch.old_logprobs = -torch.rand(ROWS, WIDTH, generator=gen) - 0.5
    log_ratio = torch.tensor([math.log(r) for r in RATIOS])[:, None].expand(4, WIDTH)
    batch.data_logprobs = torch.full((ROWS, WIDTH), float("nan"))
    batch.data_logprobs[:4] = batch.old_logprobs[:4] - log_ratio
    batch.advantages = torch.randn(ROWS, WIDTH, generator=gen)
    return batch


def tiny_actor() -> Trained:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config())
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-9)
    return Trained(
        model=model, optimizer=optimizer, scheduler=torch.optim.lr_scheduler.ConstantLR(optimizer, 1.0)
    )


def update(cfg: Any, batch: Batch, **kwargs: Any) -> dict[str, float]:
    actor = tiny_actor()
    loss_fn = actor_loss(cfg, actor.model, batch, ulysses.NO_SP, **kwargs)
    return optimize(cfg.actor, "actor", actor, batch, loss_fn, num_mini=1, shuffle=False, sp=ulysses.NO_SP,
                    **kwargs)  # fmt: skip


@pytest.mark.parametrize(
    ("level", "is_mean", "fraction_high"),
    [
        # truncated at 2: (0.5 + 1 + 1.5 + 2) / 4 = 1.25; one of 4 rows' tokens has ratio 3 > 2
        ("token", 1.25, 0.25),
        # each row's 10 equal log-ratios: the geometric mean is the token ratio
        ("geometric", 1.25, 0.25),
        # the product of 10 ratios: 0.5^10 = 0.000977, 1, 1.5^10 = 57.7 and 3^10, truncated at 2; two of
        # the four sequences above 2
        ("sequence", (0.5**10 + 1 + 2 + 2) / 4, 0.5),
    ],
)
def test_mismatch_metrics_of_a_mixed_batch(
    one_rank: Any, level: str, is_mean: float, fraction_high: float
) -> None:
    """Rows 0-3 offline, rows 4-7 sampled, micro-batches of 4 rows: each metric is the mean over the 40
    tokens (or 4 sequences) with data log-probs. Weighting micro-batch means by all 80 tokens halved them
    (rollout_is_mean 0.625 at token level), and the sequence level's were token-level."""
    out = update(config(f"algorithm.rollout_is_level={level}"), mixed_batch())
    # mismatch_kl: mean of -log r = -(log 0.5 + log 1 + log 1.5 + log 3) / 4 = -log(2.25) / 4
    assert out["mismatch/mismatch_kl"] == pytest.approx(-math.log(2.25) / 4, abs=1e-6)
    # k3: mean of r - 1 - log r over the 4 ratios
    k3 = sum(r - 1 - math.log(r) for r in RATIOS) / 4
    assert out["mismatch/mismatch_k3_kl"] == pytest.approx(k3, abs=1e-6)
    assert out["mismatch/rollout_is_mean"] == pytest.approx(is_mean, abs=1e-6)
    assert out["mismatch/rollout_is_ratio_fraction_high"] == pytest.approx(fraction_high, abs=1e-6)
    assert not any("#" in k for k in out)


def test_rejection_sampling_trains_the_kept_tokens_only(one_rank: Any) -> None:
    """``token_k2`` with bound 0.1: k2 = (log r)^2 / 2 is 0.240, 0, 0.082 and 0.603 on rows 0-3, so rows 0
    and 3 are rejected (20 of the 40 tokens with data log-probs, 2 of 4 responses); the sampled rows 4-7
    have no sampler's log-probs and are kept. The loss closure and its counts are then exactly those of
    a batch whose loss mask leaves rows 0 and 3 out, as verl's multiplied response_mask."""
    cfg = config(
        "algorithm.rollout_rs=token_k2", "algorithm.rollout_rs_threshold=0.1", "actor.entropy_coeff=0.01"
    )
    batch = mixed_batch()
    kept, metrics = rollout_rejection(cfg, batch)
    assert kept.all(-1).tolist() == [False, True, True, False, True, True, True, True]
    assert not kept[[0, 3]].any()
    assert metrics == {
        "mismatch/rollout_rs_masked_fraction": 0.5,
        "mismatch/rollout_rs_seq_masked_fraction": 0.5,
    }
    counts = global_counts(kept)
    assert counts == {"num_tokens": 60.0, "num_seqs": 6.0}

    actor = tiny_actor().model
    sel = batch.rows()
    loss, parts = actor_loss(cfg, actor, batch, ulysses.NO_SP, response_mask=kept)(sel, counts)
    without = mixed_batch()
    without.rollout.response_mask = kept.clone()  # the same tokens left out by hand
    by_hand, by_hand_parts = actor_loss(cfg, actor, without, ulysses.NO_SP)(sel, counts)
    torch.testing.assert_close(loss, by_hand, rtol=0, atol=1e-7)
    torch.testing.assert_close(parts["actor/entropy"], by_hand_parts["actor/entropy"], rtol=0, atol=1e-7)
    full, _ = actor_loss(cfg, actor, mixed_batch(), ulysses.NO_SP)(sel, global_counts(batch.response_mask))
    assert abs(float((full - loss).detach())) > 1e-3, "the rejected rows change the loss"
    # the importance metrics stay over every token with data log-probs (verl computes them before rejection)
    assert parts["mismatch/mismatch_kl#count"] == 40.0

    # Through the update: the rejection fractions are the step's, the mismatch metrics unchanged.
    out = update(cfg, mixed_batch(), response_mask=kept)
    assert out["mismatch/mismatch_kl"] == pytest.approx(-math.log(2.25) / 4, abs=1e-6)
