"""Offline KL-PPO that holds up: the sampler's log-probs carried from the data writer into the trainer,
truncated importance weights against the policy that produced the data, and their metrics."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ppo import algorithms, models, offline
from ppo.config import ConfigError
from ppo.config_loader import load_config
from ppo.data import DataError
from tests.helpers import ROOT, base_args, load_script, read_metrics, run, torchrun, write_parquet

E = math.e


# ----------------------------------------------------------------------------------------------------
# The math
# ----------------------------------------------------------------------------------------------------


def test_rollout_is_weights_by_hand() -> None:
    old = torch.tensor([[-1.0, -2.0, -3.0]])
    rollout = torch.tensor([[-2.0, -1.0, -3.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    # Token level: d = old - rollout = [1, -1, 0] -> exp = [e, 1/e, 1], truncated at 2: [2, 0.3679, 1].
    w = algorithms.rollout_is_weights(old, rollout, mask, level="token", threshold=2.0)
    assert torch.allclose(w, torch.tensor([[2.0, 1 / E, 1.0]]))
    # Sequence level: sum d = 0 -> every token exp(0) = 1; geometric: mean d = 0 -> 1.
    for level in ("sequence", "geometric"):
        assert torch.equal(
            algorithms.rollout_is_weights(old, rollout, mask, level=level, threshold=2.0), torch.ones(1, 3)
        )

    old, rollout = torch.tensor([[-1.0, -1.0, 0.0]]), torch.tensor([[-2.0, -2.0, 5.0]])
    mask = torch.tensor([[True, True, False]])  # the third token is padding: weight 0 whatever it holds
    # d = [1, 1]: token e each; sequence exp(2) = 7.389; geometric exp(mean 1) = e (threshold 10).
    expected = {"token": [E, E], "sequence": [E**2, E**2], "geometric": [E, E]}
    for level, values in expected.items():
        w = algorithms.rollout_is_weights(old, rollout, mask, level=level, threshold=10.0)
        assert torch.allclose(w, torch.tensor([[*values, 0.0]])), level
    # A row whose behaviour policy is unknown (NaN: sampled by the policy itself) weighs 1.
    w = algorithms.rollout_is_weights(old, torch.full((1, 3), math.nan), mask, level="token", threshold=2.0)
    assert torch.equal(w, torch.tensor([[1.0, 1.0, 0.0]]))
    with pytest.raises(ValueError, match="unknown rollout_is_level 'word'"):
        algorithms.rollout_is_weights(old, rollout, mask, level="word", threshold=2.0)


def test_mismatch_metrics_by_hand() -> None:
    old = torch.tensor([[-1.0, -2.0, -9.0]])
    rollout = torch.tensor([[-2.0, -2.0, math.nan]])  # the last token's behaviour is unknown: not counted
    mask = torch.ones(1, 3, dtype=torch.bool)
    m = algorithms.mismatch_metrics(old, rollout, mask, threshold=2.0)
    # d = [1, 0], r = [e, 1]: k1 KL(mu || pi) = mean(-d) = -0.5; k3 = mean(r - d - 1) = (e - 2) / 2;
    # mean ratio (e + 1) / 2; one of two ratios above 2.
    assert m["mismatch_kl"].item() == pytest.approx(-0.5)
    assert m["mismatch_k3_kl"].item() == pytest.approx((E - 2) / 2)
    assert m["rollout_is_mean"].item() == pytest.approx((E + 1) / 2)
    assert m["rollout_is_ratio_fraction_high"].item() == pytest.approx(0.5)


def test_policy_loss_weighs_each_token() -> None:
    logprobs = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    advantages = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    weights = torch.tensor([[2.0, 0.5]])
    # Ratio 1: per-token loss -A = [-1, 1]; weighted [-2, 0.5]; token-mean -0.75. Gradient of the
    # token-mean w.r.t. log pi_t is -A_t * w_t / 2 = [-1, 0.25].
    loss, _ = algorithms.policy_loss(
        logprobs, logprobs.detach(), advantages, mask, 0.2, 0.2, 3.0, "token-mean", is_weights=weights
    )
    assert loss.item() == pytest.approx(-0.75)
    loss.backward()
    assert torch.allclose(logprobs.grad, torch.tensor([[-1.0, 0.25]]))


# ----------------------------------------------------------------------------------------------------
# The data: the sampler's log-probs, written and read
# ----------------------------------------------------------------------------------------------------


def test_rollout_is_needs_offline_data_and_a_threshold() -> None:
    with pytest.raises(ConfigError, match="algorithm.rollout_is_threshold weighs responses by the policy"):
        load_config(None, ["algorithm.rollout_is_threshold=2.0"])  # online: no behaviour policy recorded
    with pytest.raises(ConfigError, match="rollout_is=true applies importance weights"):
        load_config(
            None, ["rollout.source=dataset", "algorithm.adv_estimator=grpo", "algorithm.rollout_is=true"]
        )
    cfg = load_config(
        None,
        [
            "rollout.source=dataset",
            "algorithm.adv_estimator=grpo",
            "algorithm.rollout_is_threshold=2.0",
            "algorithm.rollout_is=true",
        ],
    )
    assert cfg.algorithm.rollout_is and cfg.algorithm.rollout_is_level == "token"


@pytest.fixture(scope="module")
def sampled_groups(tiny_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Groups of 2 responses (two worked answers of each of 8 training prompts) with the ``logprobs``
    that scripts/make_offline_data.py computes for them under the tiny base model."""
    from ppo import data

    script = load_script("make_offline_data")
    tokenizer = models.load_tokenizer(str(tiny_assets / "base"))
    prompt_rows = pq.read_table(tiny_assets / "data" / "train.parquet").to_pylist()[:8]
    path = tmp_path_factory.mktemp("sampled") / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist(prompt_rows), path)
    records = data.load_prompts(path, tokenizer, max_prompt_length=16, require_ground_truth=True)
    kept = [(r, [f"#### {r.ground_truth}", f"{r.ground_truth}1"]) for r in records]
    logprobs = script.sampler_logprobs(
        models.load_causal_lm(str(tiny_assets / "base")), kept, tokenizer, 1.0, 5
    )
    rows = [
        {**row, "responses": texts, "ranks": [0, 1], "logprobs": logprobs[2 * g : 2 * g + 2]}
        for g, (row, (_, texts)) in enumerate(zip(prompt_rows, kept, strict=True))
    ]
    out = path.with_name("groups.parquet")
    pq.write_table(pa.Table.from_pylist(rows), out)
    return out


def test_writer_stores_the_trainers_log_probs(sampled_groups: Path, tiny_assets: Path) -> None:
    """Each response's ``logprobs`` are the log-probs the trainer computes for the same tokens with the
    same policy (so the importance ratio of the sampler against itself is exactly 1)."""
    from ppo import ulysses
    from ppo.packing import pack

    tokenizer = models.load_tokenizer(str(tiny_assets / "base"))
    groups = offline.load_offline_groups(
        sampled_groups, tokenizer, group_size=2, max_prompt_length=16, max_response_length=12,
        require_ground_truth=False,
    )  # fmt: skip
    assert groups and all(g.logprobs is not None for g in groups)
    rollout = offline.offline_rollout(
        groups, max_response_length=12, pad_token_id=tokenizer.pad_token_id, eos_token_ids=[2], device="cpu"
    )
    model = models.load_causal_lm(str(tiny_assets / "base"))
    with torch.no_grad():
        lp, _ = ulysses.packed_logprobs(
            model, pack(rollout.prompts, rollout.responses, rollout.response_mask), temperature=1.0
        )
    stored = offline.dataset_logprobs(groups, len(rollout.prompts), 12, "cpu")
    mask = rollout.response_mask
    assert torch.equal(torch.isnan(stored), ~mask)  # known exactly on the response tokens
    assert (stored[mask] - lp[mask]).abs().max() < 1e-5


def test_bad_logprobs_cell_names_the_row(sampled_groups: Path, tiny_assets: Path, tmp_path: Path) -> None:
    rows = pq.read_table(sampled_groups).to_pylist()
    tokenizer = models.load_tokenizer(str(tiny_assets / "base"))
    cases = {
        "short": (lambda lps: [lps[0][:-1], lps[1]], r"row 1, column 'logprobs': response 0 has \d+ tokens .* but \d+ log-probs"),
        "positive": (lambda lps: [[0.5] * len(lps[0]), lps[1]], "row 1, column 'logprobs': response 0's log-probs must be finite numbers <= 0"),
        "one_list": (lambda lps: [lps[0]], "row 1, column 'logprobs': expected a list of 2 lists"),
    }  # fmt: skip
    for name, (change, message) in cases.items():
        bad = [dict(r) for r in rows]
        bad[1]["logprobs"] = change(bad[1]["logprobs"])
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(bad), path)
        with pytest.raises(DataError, match=message):
            offline.load_offline_groups(
                path, tokenizer, group_size=2, max_prompt_length=16, max_response_length=12,
                require_ground_truth=False,
            )  # fmt: skip


# ----------------------------------------------------------------------------------------------------
# The trainer
# ----------------------------------------------------------------------------------------------------


def offline_args(assets: Path, groups: Path, out: Path, *extra: str, steps: int = 2) -> list[str]:
    """GRPO with a KL loss on ``groups`` (2 prompts x 2 responses a step), importance weights on."""
    return base_args(assets, out, steps=steps) + [
        f"data.train_files={groups}",
        "data.max_prompt_length=16",
        "data.train_batch_size=2",
        "actor.ppo_mini_batch_size=2",
        "algorithm.adv_estimator=grpo",
        "actor.use_kl_loss=true",
        "trainer.val_before_train=false",
        "rollout.source=dataset",
        "reward.style=ranking",
        "algorithm.rollout_is_threshold=2.0",
        "algorithm.rollout_is=true",
        *extra,
    ]


@pytest.mark.slow
def test_weights_are_one_while_the_policy_is_the_sampler(
    sampled_groups: Path, tiny_assets: Path, tmp_path: Path
) -> None:
    """Step 1 updates from the policy that wrote the data's log-probs: every importance ratio is 1 and
    the mismatch KL 0 (to float rounding), so the weights change nothing; step 2 starts from an updated
    policy, and the weights move away from 1."""
    assert run(offline_args(tiny_assets, sampled_groups, tmp_path / "run")) == 0
    first, second = read_metrics(tmp_path / "run")
    assert first["mismatch/rollout_is_mean"] == pytest.approx(1.0, abs=1e-5)
    assert first["mismatch/rollout_is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert abs(first["mismatch/mismatch_kl"]) < 1e-5 and abs(first["mismatch/mismatch_k3_kl"]) < 1e-6
    assert abs(second["mismatch/mismatch_kl"]) > 1e-4  # lr 1e-3 moved the policy in step 1


def test_importance_weights_need_the_datas_logprobs(tiny_assets: Path, tmp_path: Path, capfd: Any) -> None:
    rows = pq.read_table(tiny_assets / "data" / "train.parquet").to_pylist()[:4]
    for row in rows:
        row["responses"], row["ranks"] = ["#### 1", "#### 2"], [0, 1]
    groups = write_parquet(tmp_path / "no_logprobs.parquet", rows)
    assert run(offline_args(tiny_assets, groups, tmp_path / "run")) == 2
    err = capfd.readouterr().err
    assert "no group of data.train_files has a 'logprobs' column" in err and "Traceback" not in err


def test_offline_fraction_applies_to_the_global_batch() -> None:
    # 2 ranks of 4 groups (8 in all), 0.1: round(0.8) = 1 offline group, on rank 0 (per rank it was 0).
    assert [offline.num_offline_groups(4, 0.1, rank=r, world_size=2) for r in (0, 1)] == [1, 0]
    # 2 ranks of 1 group, 0.5: one offline (rank 0), one sampled (rank 1); per rank it was 1 and 1.
    assert [offline.num_offline_groups(1, 0.5, rank=r, world_size=2) for r in (0, 1)] == [1, 0]
    # 4 ranks of 4 groups, 0.4: round(6.4) = 6, spread 2, 2, 1, 1.
    assert [offline.num_offline_groups(4, 0.4, rank=r, world_size=4) for r in range(4)] == [2, 2, 1, 1]
    # Fractions the batch cannot honour are refused with the nearest that works.
    base = ["rollout.offline_fraction=0.05", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8"]
    with pytest.raises(ConfigError, match=r"gives 0 offline groups a step: use at least 0.125"):
        load_config(None, [*base, "algorithm.adv_estimator=grpo"])
    with pytest.raises(ConfigError, match=r"gives 8 offline groups a step: use at most 0.875"):
        load_config(None, [*base[1:], "rollout.offline_fraction=0.97", "algorithm.adv_estimator=grpo"])


@pytest.mark.slow
def test_two_ranks_of_one_prompt_mix_half_and_half(
    sampled_groups: Path, tiny_assets: Path, tmp_path: Path
) -> None:
    """One prompt per rank with rollout.offline_fraction=0.5: rank 0's group comes from the file and rank
    1 samples its own, every step (before, each rank rounded 0.5 of its one group up: nothing sampled)."""
    args = base_args(tiny_assets, tmp_path / "run", steps=2) + [
        f"data.train_files={sampled_groups}",
        "data.max_prompt_length=16",
        "data.train_batch_size=2",
        "actor.ppo_mini_batch_size=2",
        "algorithm.adv_estimator=grpo",
        "trainer.val_before_train=false",
        "rollout.offline_fraction=0.5",
        "trainer.dist_timeout_s=120",
    ]
    proc = torchrun(ROOT / "train_ppo.py", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["rollout/offline_fraction"] for r in read_metrics(tmp_path / "run")] == [0.5, 0.5]


def test_offline_groups_refuse_gae() -> None:
    with pytest.raises(
        ConfigError,
        match=r"algorithm.adv_estimator=gae with offline groups .* algorithm.adv_estimator=grpo or rloo",
    ):
        load_config(None, ["rollout.source=dataset"])  # gae is the default estimator
    with pytest.raises(ConfigError, match="algorithm.adv_estimator=gae with offline groups"):
        load_config(None, ["rollout.offline_fraction=0.5"])


def test_lora_dropout_scores_in_eval_mode(tiny_assets: Path, tmp_path: Path, one_rank: Any) -> None:
    """With adapter dropout, old log-probs are scored with dropout off: two scorings agree exactly and
    equal the eval-mode forward (in training mode they differed by up to 0.9 nats a token)."""
    from ppo.batch import Batch, group_index
    from ppo.build import build
    from ppo.forwards import forward_logprobs
    from ppo.rollout import sample

    cfg = load_config(
        None,
        base_args(tiny_assets, tmp_path, steps=1)
        + ["actor.lora.rank=8", "actor.lora.dropout=0.5", "trainer.val_before_train=false"],
    )
    run_ = build(cfg, one_rank)
    records = run_.loader.records[:4]
    rollout = sample(run_.sampler, records, do_sample=True)
    batch = Batch(rollout=rollout, records=records, group_ids=group_index(4, 1, torch.device("cpu")))
    actor = run_.actor.model
    assert actor.training  # the actor trains with dropout on
    with torch.no_grad():  # adapters as after some training (peft starts B at 0: no effect, no noise)
        for name, p in actor.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(0))
    mb = cfg.actor.ppo_micro_batch_size_per_gpu
    first = forward_logprobs(cfg, actor, batch, mb, run_.sp)
    second = forward_logprobs(cfg, actor, batch, mb, run_.sp)
    assert actor.training  # its mode is restored
    assert torch.equal(first, second)
    actor.eval()
    assert torch.equal(forward_logprobs(cfg, actor, batch, mb, run_.sp), first)
    actor.train()
    with torch.no_grad():  # the same forward in training mode draws dropout masks: it differs
        from ppo import ulysses
        from ppo.packing import pack_rows

        noisy, _ = ulysses.packed_logprobs(actor, pack_rows(batch, batch.rows()), temperature=1.0)
    assert (noisy - first).abs().max() > 1e-3
