"""SPPO through ``train_ppo.main`` on the tiny assets: online (sampled groups, win rates from the rule's
scores) and offline (ranked groups read from Parquet, the old-policy snapshot refreshed every N steps),
what the loss changes, resume through a snapshot, and 2 ranks against 1."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import ROOT, base_args, excerpt, hf_weights, read_metrics, run, torchrun, write_parquet
from tests.reward_fns import digit_score

RESPONSES = ["12 + 30 = 42\n#### 42", "#### 7", "4 + 4 = 8\n#### 8", "no idea"]


@pytest.fixture(scope="module")
def ranked_groups(tiny_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Eight prompts with the four ``RESPONSES`` each (rotated), scored by ``digit_score`` and ranked by
    the scores (0 = best): fixed responses, the same on any rank layout."""
    rows = pq.read_table(tiny_assets / "data" / "train.parquet").to_pylist()[:8]
    for i, row in enumerate(rows):
        responses = [RESPONSES[(i + j) % 4] for j in range(4)]
        scores = [digit_score("", t, "") for t in responses]
        row["responses"] = responses
        row["scores"] = scores
        row["ranks"] = [sum(o > s for o in scores) for s in scores]
    return write_parquet(tmp_path_factory.mktemp("sppo") / "groups.parquet", rows)


def online_args(tiny_assets: Path, out: Path, *extra: str) -> list[str]:
    """4 prompts x 2 samples a step in one on-policy update, no validation, the actor exported."""
    return base_args(tiny_assets, out) + [
        "actor.ppo_mini_batch_size=4",
        "trainer.val_before_train=false",
        "trainer.save_hf_on_end=true",
        *extra,
    ]


def offline_args(groups: Path, tiny_assets: Path, out: Path, steps: int, *extra: str) -> list[str]:
    """Offline SPPO on ``groups``: 2 groups of 4 a step in 2 mini-batches, win rates from the data's
    ranks, the old policy refreshed every 2 steps, a checkpoint every step."""
    return base_args(tiny_assets, out, steps=steps) + [
        f"data.train_files={groups}",
        "rollout.source=dataset",
        "reward.style=ranking",
        "rollout.n=4",
        "data.max_prompt_length=16",
        "data.max_response_length=24",
        "data.train_batch_size=2",
        "actor.ppo_mini_batch_size=1",
        "actor.policy_loss.loss_mode=sppo",
        "actor.sppo_eta=2.0",
        "actor.sppo_refresh_steps=2",
        "trainer.val_before_train=false",
        "trainer.save_hf_on_end=true",
        "trainer.save_freq=1",
        *extra,
    ]


def test_online_sppo_trains_on_win_rates(tiny_assets: Path, tmp_path: Path) -> None:
    """Online SPPO samples every step and regresses onto eta (P - 1/2): with 2 samples a prompt each
    group's targets are (+eta/2, -eta/2) when the scores differ and (0, 0) when they tie, so the
    on-policy loss (log-ratio 0) is eta^2/4 times the share of decided groups, a multiple of
    eta^2/16 with 4 groups, and the targets average to 0. It trains other weights than GRPO's
    vanilla loss on the same samples."""
    sppo, vanilla = tmp_path / "sppo", tmp_path / "vanilla"
    eta = 2.0
    assert (
        run(online_args(tiny_assets, sppo, "actor.policy_loss.loss_mode=sppo", f"actor.sppo_eta={eta}")) == 0
    )
    assert run(online_args(tiny_assets, vanilla, "algorithm.adv_estimator=grpo")) == 0
    rows = read_metrics(sppo)
    assert len(rows) == 2
    decided = 0
    for row in rows:
        assert row["actor/log_ratio_mean"] == 0.0  # one update: pi_old is the policy itself
        assert row["actor/preference_mean"] == pytest.approx(0.0, abs=1e-7)
        groups = row["actor/pg_loss"] / (eta**2 / 16)
        assert groups == pytest.approx(round(groups), abs=1e-5) and 0 <= round(groups) <= 4
        decided += round(groups)
        assert row["critic/advantages/max"] in (0.0, pytest.approx(eta / 2))
        assert "critic/vf_loss" not in row  # no critic
    assert decided > 0, "every group tied: the test saw no SPPO gradient"
    a, b = hf_weights(sppo), hf_weights(vanilla)
    base = load_file(tiny_assets / "base" / "model.safetensors")
    assert any(not torch.equal(a[k], base[k]) for k in a), "SPPO changed nothing"
    assert any(not torch.allclose(a[k], b[k]) for k in a), "SPPO trained what vanilla GRPO trains"


def test_offline_sppo_resumes_through_its_snapshot(
    ranked_groups: Path, tiny_assets: Path, tmp_path: Path
) -> None:
    """Offline SPPO with pi_old refreshed every 2 steps: step 3 takes the snapshot (the actor after step 2),
    step 4 regresses onto the log-ratio to it. A run stopped after step 3 and resumed trains step 4 exactly
    as the run that never stopped (the snapshot comes from the checkpoint: rebuilt from model.path, it
    would be the initial model and step 4 would differ)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run(offline_args(ranked_groups, tiny_assets, straight, 4)) == 0
    assert run(offline_args(ranked_groups, tiny_assets, resumed, 3)) == 0
    assert run(offline_args(ranked_groups, tiny_assets, resumed, 4, "trainer.resume_mode=auto")) == 0
    rows, again = read_metrics(straight), read_metrics(resumed)
    # Targets from ranks: each group of 4 distinct ranks gives eta (P - 1/2) = (1, 1/3, -1/3, -1): mean 0.
    assert all(r["actor/preference_mean"] == pytest.approx(0.0, abs=1e-6) for r in rows)
    assert rows[-1]["critic/advantages/max"] == pytest.approx(1.0)
    # Step 1 starts at the snapshot (log-ratio 0 in its first mini-batch); step 2 and 4 regress onto an
    # older policy: the log-ratio to it has moved.
    assert abs(rows[3]["actor/log_ratio_mean"]) > 1e-3
    last = {k: v for k, v in again[-1].items() if k.startswith("actor/") and k != "actor/lr"}
    for k, v in last.items():
        assert rows[3][k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    a, b = hf_weights(straight), hf_weights(resumed)
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=0, rtol=0, msg=k)


@pytest.mark.slow
def test_two_ranks_equal_one_rank(ranked_groups: Path, tiny_assets: Path, tmp_path: Path) -> None:
    """Offline SPPO with verl recipe's softmean target (over the whole batch: a cross-rank reduction) and a
    snapshot: 2 gloo ranks train the same weights and log the same losses as 1 process on the same
    global batch."""
    extra = [
        "algorithm.sppo_target=softmean",
        "algorithm.sppo_beta=2.0",
        # One mini-batch, two epochs: mini-batches are cut from each rank's rows, so smaller ones would
        # hold other rows on 2 ranks than on 1.
        "actor.ppo_mini_batch_size=2",
        "actor.ppo_epochs=2",
        "actor.optim.eps=1e-3",  # compare gradients, not Adam's rounding of tiny second moments
    ]
    one, two = tmp_path / "one", tmp_path / "two"
    assert run(offline_args(ranked_groups, tiny_assets, one, 3, *extra)) == 0
    proc = torchrun(
        ROOT / "train_ppo.py",
        *offline_args(ranked_groups, tiny_assets, two, 3, *extra),
        "trainer.dist_timeout_s=120",
    )
    assert proc.returncode == 0, excerpt(proc.stderr)
    a, b = hf_weights(one), hf_weights(two)
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-6, rtol=1e-5, msg=k)
    for x, y in zip(read_metrics(one), read_metrics(two), strict=True):
        for k in ("actor/pg_loss", "actor/grad_norm", "actor/preference_mean"):
            assert y[k] == pytest.approx(x[k], rel=1e-5, abs=1e-6), (k, x["step"])
        # A difference of two float32 sums of ~20 log-probs: equal to their rounding (~1e-5 each).
        assert y["actor/log_ratio_mean"] == pytest.approx(x["actor/log_ratio_mean"], abs=1e-4)
