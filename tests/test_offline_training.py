"""Offline RLHF in the trainer: ``rollout.source=dataset`` reads each step's groups from the file instead
of sampling, and everything after step 1 is the online code.

The files here are written by hand: prompts of the synthetic task with two (or four) responses each,
ranked and scored. The model is the untrained tiny Llama; what is checked is the plumbing, exactly.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

import train_ppo
from ppo import models, offline
from tests.helpers import (
    ROOT,
    base_args,
    deterministic,
    hf_weights,
    read_metrics,
    run,
    torchrun,
    write_parquet,
)
from tests.reward_fns import digit_score

# Every test here runs the trainer end to end.
pytestmark = pytest.mark.slow

RESPONSES = ["12 + 30 = 42\n#### 42", "#### 7", "4 + 4 = 8\n#### 8", "no idea"]


@pytest.fixture(scope="module")
def groups_file(tiny_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Eight prompts with two of ``RESPONSES`` each, scored by ``digit_score`` and ranked by the scores."""
    rows = pq.read_table(tiny_assets / "data" / "train.parquet").to_pylist()[:8]
    for i, row in enumerate(rows):
        pair = [RESPONSES[i % 4], RESPONSES[(i + 1) % 4]]
        scores = [digit_score("", t, "") for t in pair]
        row["responses"] = pair
        row["scores"] = scores
        row["ranks"] = [sum(o > s for o in scores) for s in scores]
    return write_parquet(tmp_path_factory.mktemp("offline") / "groups.parquet", rows)


def offline_args(tiny_assets: Path, groups: Path, out: Path, steps: int = 2) -> list[str]:
    """GRPO with a KL loss on the groups of ``groups``, one prompt a mini-batch, 2 prompts a step."""
    return base_args(tiny_assets, out, steps=steps) + [
        f"data.train_files={groups}",
        "data.max_response_length=24",
        "data.train_batch_size=2",
        "actor.ppo_mini_batch_size=1",
        "algorithm.adv_estimator=grpo",
        "actor.use_kl_loss=true",
        "trainer.val_before_train=false",
        "trainer.save_hf_on_end=true",
        "rollout.source=dataset",
    ]


def test_offline_is_the_online_step_fed_the_same_responses(
    tiny_assets: Path, groups_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same two steps, once reading the groups and once "sampling" them (a sampler that returns the
    file's responses for the prompts it is given): identical parameters, bit for bit, and no
    generation time offline."""
    out_offline, out_online = tmp_path / "offline", tmp_path / "online"
    args = offline_args(tiny_assets, groups_file, out_offline)
    assert run(args) == 0
    tokenizer = models.load_tokenizer(str(tiny_assets / "base"))
    groups = offline.load_offline_groups(
        groups_file, tokenizer, group_size=2, max_prompt_length=64, max_response_length=24
    )
    by_row = {g.index: g for g in groups}

    def sample_from_file(sampler, records, *, do_sample, **_):  # noqa: ANN001, ANN202
        chosen = [by_row[r.index] for r in records[:: sampler.settings.n]]
        return offline.offline_rollout(
            chosen,
            max_response_length=sampler.max_response_length,
            pad_token_id=sampler.pad_token_id,
            eos_token_ids=sampler.eos_ids,
            device="cpu",
        )

    monkeypatch.setattr(train_ppo, "sample", sample_from_file)
    online = [
        a for a in offline_args(tiny_assets, groups_file, out_online) if not a.startswith("rollout.source")
    ]
    assert run(online) == 0
    a, b = hf_weights(out_offline), hf_weights(out_online)
    base = load_file(tiny_assets / "base" / "model.safetensors")
    assert any(not torch.equal(a[k], base[k]) for k in a), "the update changed nothing"
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = read_metrics(out_offline)
    assert all(r["timing_s/gen"] == 0.0 for r in rows)
    assert [r["critic/score/mean"] for r in rows] == [
        r["critic/score/mean"] for r in read_metrics(out_online)
    ]


# Four prompts, the four RESPONSES each (rotated), with scores chosen by hand and their competition ranks.
RANKED_SCORES = [
    [1.0, 0.5, 0.5, 0.0],
    [0.25, 0.25, 0.25, 0.75],
    [0.0, 2.0, 0.0, -1.0],
    [0.75, 0.75, 0.25, -0.5],
]
RANKS = [[0, 1, 1, 3], [1, 1, 1, 0], [1, 0, 1, 3], [0, 0, 2, 3]]


@pytest.fixture(scope="module")
def ranked_groups_file(tiny_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``RANKED_SCORES`` and ``RANKS`` as groups of four responses to the first four training prompts."""
    rows = pq.read_table(tiny_assets / "data" / "train.parquet").to_pylist()[:4]
    for i, row in enumerate(rows):
        row.update(responses=RESPONSES[i:] + RESPONSES[:i], scores=RANKED_SCORES[i], ranks=RANKS[i])
    return write_parquet(tmp_path_factory.mktemp("ranked") / "groups.parquet", rows)


@pytest.mark.parametrize(
    ("style", "expected"),
    [
        # best: 1 for rank 0. Step 1 (rows 0, 1): [1, 0, 0, 0] + [0, 0, 0, 1] -> mean 2/8; step 2
        # (rows 2, 3): [0, 1, 0, 0] + [1, 1, 0, 0] -> 3/8.
        (["reward.style=ranking", "reward.rank_scores=best"], [(2 / 8, 1.0, 0.0), (3 / 8, 1.0, 0.0)]),
        # linear: 1 - rank / 3. Step 1: [1, 2/3, 2/3, 0] + [2/3, 2/3, 2/3, 1] = 7/3 + 3 -> mean 2/3;
        # step 2: [2/3, 1, 2/3, 0] + [1, 1, 1/3, 0] = 7/3 + 7/3 -> mean 7/12.
        (["reward.style=ranking", "reward.rank_scores=linear"], [(2 / 3, 1.0, 0.0), (7 / 12, 1.0, 0.0)]),
        # dataset: the scores themselves. Step 1: (2 + 1.5) / 8; step 2: (1 + 1.25) / 8, max 2, min -1.
        (["reward.style=dataset"], [(3.5 / 8, 1.0, 0.0), (2.25 / 8, 2.0, -1.0)]),
    ],
    ids=["ranking_best", "ranking_linear", "dataset"],
)
def test_offline_rewards_from_the_data(
    tiny_assets: Path,
    ranked_groups_file: Path,
    tmp_path: Path,
    style: list[str],
    expected: list[tuple[float, float, float]],
) -> None:
    """The scores each step trains on are the data's (ranks turned into scores by ``rank_scores``, or
    the scores column), for the step's own groups: file order, two groups a step."""
    args = offline_args(tiny_assets, ranked_groups_file, tmp_path, steps=2) + [
        "rollout.n=4",
        "data.shuffle=false",
        "reward.custom_function=null",  # no rule scorer to fall back on: the scores are the file's
        *style,
    ]
    assert run(args) == 0
    got = [
        (r["critic/score/mean"], r["critic/score/max"], r["critic/score/min"]) for r in read_metrics(tmp_path)
    ]
    for step, (row, want) in enumerate(zip(got, expected, strict=True), 1):
        assert row == pytest.approx(want, rel=1e-6), f"step {step}"


def test_offline_resume_mid_epoch_is_exact(tiny_assets: Path, groups_file: Path, tmp_path: Path) -> None:
    """Four steps per pass over the file: stopping after step 2 and resuming gives step 3 exactly."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run(offline_args(tiny_assets, groups_file, straight, steps=3)) == 0
    assert run(offline_args(tiny_assets, groups_file, resumed, steps=2) + ["trainer.save_freq=2"]) == 0
    assert run(offline_args(tiny_assets, groups_file, resumed, steps=3) + ["trainer.save_freq=2"]) == 0
    drop = ("timing_s/", "perf/")
    assert deterministic(read_metrics(straight), drop) == deterministic(read_metrics(resumed), drop)


def test_offline_two_ranks_equal_one_rank(tiny_assets: Path, groups_file: Path, tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    common = ["actor.optim.eps=1e-3", "actor.ppo_mini_batch_size=2"]
    assert run(offline_args(tiny_assets, groups_file, one) + common) == 0
    proc = torchrun(ROOT / "train_ppo.py", *offline_args(tiny_assets, groups_file, two), *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = hf_weights(one), hf_weights(two)
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=1e-5, msg=key)
