"""Rejection sampling (``algorithm.rollout_rs``) end to end: ``train_ppo`` on offline groups whose data
records the sampler's log-probs, through verl 0.9.1's spelling of the keys."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ppo import model_loading
from tests.helpers import base_args, load_script, read_metrics, run


@pytest.fixture(scope="module")
def shifted_groups(tiny_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Groups of 2 (a right answer ranked first, a wrong one second) for 4 training prompts, with the
    log-probs of the tiny base model as the sampler's (``make_offline_data``'s), except that the second
    response's are 2 nats lower on every token: as if another policy had written it."""
    from ppo import data

    script = load_script("make_offline_data")
    tokenizer = model_loading.load_tokenizer(str(tiny_assets / "base"))
    prompt_rows = pq.read_table(tiny_assets / "data" / "train.parquet").to_pylist()[:4]
    path = tmp_path_factory.mktemp("shifted") / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist(prompt_rows), path)
    records = data.load_prompts(path, tokenizer, max_prompt_length=16, require_ground_truth=True)
    kept = [(r, [f"#### {r.ground_truth}", f"{r.ground_truth}1"]) for r in records]
    logprobs = script.sampler_logprobs(
        model_loading.load_causal_lm(str(tiny_assets / "base")), kept, tokenizer, 1.0, 5
    )
    rows = []
    for g, (row, (_, texts)) in enumerate(zip(prompt_rows, kept, strict=True)):
        first, second = logprobs[2 * g], [x - 2.0 for x in logprobs[2 * g + 1]]
        rows.append({**row, "responses": texts, "ranks": [0, 1], "logprobs": [first, second]})
    out = path.with_name("groups.parquet")
    pq.write_table(pa.Table.from_pylist(rows), out)
    return out


@pytest.mark.slow
def test_rejected_responses_leave_the_policy_loss(
    shifted_groups: Path, tiny_assets: Path, tmp_path: Path
) -> None:
    """Step 1 starts from the data's sampler: the first responses' log-ratio is 0 (k2 = 0), the second
    ones' 2 on every token (k2 = 2 > 0.5), so ``seq_mean_k2`` rejects every second response. GRPO's
    advantages of a group scored (1, 0) are +-0.5 / std = +-0.7071, and on-policy the ratio is 1, so the
    token-mean policy loss over the kept tokens is -0.7071 (over all tokens it would mix in +0.7071)."""
    args = base_args(tiny_assets, tmp_path / "run", steps=1) + [
        f"data.train_files={shifted_groups}",
        "data.max_prompt_length=16",
        "data.train_batch_size=2",
        "actor.ppo_mini_batch_size=2",
        "algorithm.adv_estimator=grpo",
        "trainer.val_before_train=false",
        "rollout.source=dataset",
        "reward.style=ranking",
        "algorithm.rollout_correction.rollout_rs=seq_mean_k2",  # verl 0.9.1's spelling
        "algorithm.rollout_correction.rollout_rs_threshold=0.5",
    ]
    assert run(args) == 0
    (first,) = read_metrics(tmp_path / "run")
    assert first["mismatch/rollout_rs_seq_masked_fraction"] == 0.5
    assert 0 < first["mismatch/rollout_rs_masked_fraction"] < 1
    assert first["actor/pg_loss"] == pytest.approx(-0.70710678, abs=1e-5)
