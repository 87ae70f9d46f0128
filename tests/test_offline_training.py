"""Offline RLHF in the trainer (issue 13): ``rollout.source=dataset`` reads each step's groups from the
file instead of sampling, and everything after step 1 is the online code.

The file here is written by hand: eight prompts of the synthetic task, two responses each, ranked and
scored. The model is the untrained tiny Llama; what is checked is the plumbing, exactly.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

import train_ppo
from ppo import models, offline
from tests.conftest import torchrun
from tests.reward_fns import digit_score
from tests.test_train_ppo import base_args, read_metrics, run

ROOT = Path(__file__).resolve().parents[1]
RESPONSES = ["12 + 30 = 42\n#### 42", "#### 7", "4 + 4 = 8\n#### 8", "no idea"]


@pytest.fixture(scope="module")
def groups_file(tiny_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    rows = pq.read_table(tiny_assets / "data" / "train.parquet").to_pylist()[:8]
    for i, row in enumerate(rows):
        pair = [RESPONSES[i % 4], RESPONSES[(i + 1) % 4]]
        scores = [digit_score("", t, "") for t in pair]
        row["responses"] = pair
        row["scores"] = scores
        row["ranks"] = [sum(o > s for o in scores) for s in scores]
    path = tmp_path_factory.mktemp("offline") / "groups.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def offline_args(tiny_assets: Path, groups: Path, out: Path, steps: int = 2) -> list[str]:
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
    a = load_file(out_offline / "hf" / "model.safetensors")
    b = load_file(out_online / "hf" / "model.safetensors")
    base = load_file(tiny_assets / "base" / "model.safetensors")
    assert any(not torch.equal(a[k], base[k]) for k in a), "the update changed nothing"
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = read_metrics(out_offline)
    assert all(r["timing_s/gen"] == 0.0 for r in rows)
    assert [r["critic/score/mean"] for r in rows] == [
        r["critic/score/mean"] for r in read_metrics(out_online)
    ]


@pytest.mark.parametrize(
    ("style", "expected"),
    [
        # Ranks of each group are [0, 1] or [1, 0]: best gets 1, the other 0; linear the same for k = 2.
        (["reward.style=ranking", "reward.rank_scores=best"], {0.0, 1.0}),
        (["reward.style=dataset"], {digit_score("", t, "") for t in RESPONSES}),
    ],
)
def test_offline_rewards_from_the_data(
    tiny_assets: Path, groups_file: Path, tmp_path: Path, style: list[str], expected: set[float]
) -> None:
    out = tmp_path / "run"
    args = offline_args(tiny_assets, groups_file, out, steps=4) + style + ["reward.custom_function=null"]
    assert run(args) == 0
    seen = set()
    for row in read_metrics(out):
        seen |= {round(row["critic/score/min"], 5), round(row["critic/score/max"], 5)}
    assert seen <= {round(v, 5) for v in expected} and len(seen) > 1


def test_offline_resume_mid_epoch_is_exact(tiny_assets: Path, groups_file: Path, tmp_path: Path) -> None:
    """Four steps per pass over the file: stopping after step 2 and resuming gives step 3 exactly."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run(offline_args(tiny_assets, groups_file, straight, steps=3)) == 0
    assert run(offline_args(tiny_assets, groups_file, resumed, steps=2) + ["trainer.save_freq=2"]) == 0
    assert run(offline_args(tiny_assets, groups_file, resumed, steps=3) + ["trainer.save_freq=2"]) == 0
    keep = ("timing_s/", "perf/")
    a = [{k: v for k, v in r.items() if not k.startswith(keep)} for r in read_metrics(straight)]
    b = [{k: v for k, v in r.items() if not k.startswith(keep)} for r in read_metrics(resumed)]
    assert a == b


@pytest.mark.slow
def test_offline_two_ranks_equal_one_rank(tiny_assets: Path, groups_file: Path, tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    common = ["actor.optim.eps=1e-3", "actor.ppo_mini_batch_size=2"]
    assert run(offline_args(tiny_assets, groups_file, one) + common) == 0
    proc = torchrun(ROOT / "train_ppo.py", *offline_args(tiny_assets, groups_file, two), *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a = load_file(one / "hf" / "model.safetensors")
    b = load_file(two / "hf" / "model.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=1e-5, msg=key)
