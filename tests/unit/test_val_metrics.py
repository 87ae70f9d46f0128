"""Validation's n-answer estimators: verl's bootstrapped best@k (``bootstrap_best`` over
``bootstrap_draws``) against the unbiased pass@k, by hand and against verl 0.9.1's
``process_validation_metrics`` where ``.verl091/`` is built (``make parity``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ppo.algorithms import bootstrap_best, pass_at_k
from ppo.periodic_validation import bootstrap_draws, k_values
from tests.helpers import import_verl, verl_side_ready


def test_best_at_k_is_verls_bootstrap_not_pass_at_k() -> None:
    # one right answer among 8: pass@8 = 1 (8 draws without replacement take it), while 8 draws with
    # replacement miss it with probability (7/8)^8 = 0.344, so best@8 ≈ 0.656; verl's 1000 draws
    # seeded 42 give exactly 651 rows that hold index 0
    scores = torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0])
    draws = bootstrap_draws(8, [2, 4, 8])
    mean, std = bootstrap_best(scores, draws[8])
    assert mean.item() == pytest.approx(0.651, abs=1e-12)
    assert std.item() == pytest.approx((0.651 * 0.349) ** 0.5, abs=1e-12)  # Bernoulli: sqrt(p (1 - p))
    assert pass_at_k(8, 1, 8) == 1.0
    # the draws are the same for every prompt: the right answer elsewhere changes the value
    assert bootstrap_best(torch.roll(scores, 3), draws[8])[0].item() != mean.item()
    # the best is the max of the scores drawn, not a 0/1 hit: scores 0.5 and 1 at k = 2
    half = torch.tensor([0.5, 1.0])
    hits = (draws_2 := bootstrap_draws(2, [2])[2]).eq(1).any(dim=1).double().mean().item()
    assert bootstrap_best(half, draws_2)[0].item() == pytest.approx(1.0 * hits + 0.5 * (1 - hits))


def test_bootstrap_draws_are_numpys_seed_42() -> None:
    np.random.seed(42)  # verl's procedure: reseed the global RNG, then draw
    expected = np.random.choice(4, size=(1000, 2), replace=True)
    assert torch.equal(bootstrap_draws(4, [2])[2], torch.from_numpy(expected))
    assert set(bootstrap_draws(8, k_values(8)[1:])) == {2, 4, 8}  # verl's k: 2, 4, ..., n


@pytest.mark.skipif(
    not verl_side_ready(),
    reason="verl 0.9.1 side environment absent (or for another Python): run `make parity`",
)
def test_best_at_k_matches_verl_process_validation_metrics() -> None:
    (metric_utils,) = import_verl("verl.trainer.ppo.metric_utils")
    gen = torch.Generator().manual_seed(0)
    n, prompts = 6, 5
    scores = (torch.rand(prompts, n, generator=gen) < 0.3).double()
    scores[0, 2] = 0.5  # a partial score: verl's best is the max of the scores drawn
    got = metric_utils.process_validation_metrics(
        ["src"] * (prompts * n),
        [f"p{i // n}" for i in range(prompts * n)],
        {"reward": scores.flatten().tolist()},
    )["src"]["reward"]
    draws = bootstrap_draws(n, k_values(n)[1:])
    for k, d in draws.items():
        ours = [bootstrap_best(row, d) for row in scores]
        assert sum(m.item() for m, _ in ours) / prompts == pytest.approx(got[f"best@{k}/mean"], abs=1e-12)
        assert sum(s.item() for _, s in ours) / prompts == pytest.approx(got[f"best@{k}/std"], abs=1e-12)
    assert set(k for k in got if k.startswith("best@") and k.endswith("/mean")) == {
        f"best@{k}/mean" for k in draws
    }
