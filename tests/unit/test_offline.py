"""Offline RLHF data, in process: ``ppo/offline.py`` loading ranked groups and preference pairs (the checks
that name file, row and column) and the rollout they stand for, by hand and against ``generate``; the
truncated importance weights against the policy that produced the data, their metrics and start-up rules.
The script that writes the data (``scripts/make_offline_data.py``) and the trainer on offline data are in
tests/runs/test_offline_runs.py."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import torch
from transformers import (
    GenerationConfig,
)

from ppo import algorithms, offline
from ppo.config import ConfigError
from ppo.config_loader import load_config
from ppo.data import PromptRecord, encode_response, load_prompts
from ppo.data_files import DataError
from ppo.offline import (
    OfflineGroup,
    check_eos,
    concat_rollouts,
    dataset_ranks,
    dataset_scores,
    load_offline_groups,
    num_offline_groups,
    offline_rollout,
)
from ppo.rewards import scores_from_ranks
from ppo.rollout import attention_mask_from_eos, generate, generation_config
from tests.helpers import arith_row, base_args, write_parquet

EOS = 2


PAD = 0


def group_row(a: int, b: int, **extra: Any) -> dict[str, Any]:
    """A valid group of 4: the right answer best, a forgotten carry and two broken ones tied last."""
    r = a + b
    responses = [f"{a} + {b} = {r}\n#### {r}", f"#### {r - 10}", f"{r}", "no idea"]
    return arith_row(a, b, responses=responses, ranks=[0, 1, 2, 2], scores=None) | extra


@pytest.mark.usefixtures("one_thread")
def test_groups_load_as_the_trainer_would_tokenize_them(tok: Any, tmp_path: Path, caplog: Any) -> None:
    rows = [group_row(23, 48), group_row(11, 12, ranks=None, scores=[0.5, 2.0, 2.0, -1.0])]
    path = write_parquet(tmp_path / "groups.parquet", rows)
    with caplog.at_level(logging.INFO, logger="ppo"):
        groups = load_offline_groups(path, tok, group_size=4, max_prompt_length=16, max_response_length=32)
    assert f"{path}: 2 groups of 4 responses" in caplog.text
    records = load_prompts(path, tok, max_prompt_length=16)
    assert [g.record for g in groups] == records  # same tokens, data_source, ground truth, extra_info
    assert (
        groups[0].record.input_ids
        == tok("<s><|user|>23 + 48<|assistant|>", add_special_tokens=False)["input_ids"]
    )
    assert groups[0].record.ground_truth == "71" and groups[1].record.extra_info == {"index": 11}
    for g, row in zip(groups, rows, strict=True):
        assert g.responses == [encode_response(t, tok) for t in row["responses"]]
        assert all(r[-1] == EOS and EOS not in r[:-1] for r in g.responses)
    # "23 + 48 = 71\n#### 71" is 20 characters, so 20 tokens + EOS
    assert len(groups[0].responses[0]) == 21
    assert (groups[0].ranks, groups[0].scores, groups[0].index) == ([0, 1, 2, 2], None, 0)
    assert (groups[1].ranks, groups[1].scores, groups[1].index) == (None, [0.5, 2.0, 2.0, -1.0], 1)
    # Ranks per sequence: the data's, or the competition ranks of its scores (2.0 twice ties for best).
    assert dataset_ranks(groups, "cpu").tolist() == [0, 1, 2, 2, 2, 0, 0, 3]
    with pytest.raises(DataError, match=r"rows 0 have ranks but no scores"):
        dataset_scores(groups, "cpu")
    assert dataset_scores(groups[1:], "cpu").tolist() == [0.5, 2.0, 2.0, -1.0]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(
    "ranks",
    [[0, 1, 2, 3], [3, 2, 1, 0], [0, 0, 2, 3], [2, 0, 0, 3], [0, 1, 1, 3], [0, 1, 1, 1], [0, 0, 0, 0]],
)
def test_valid_competition_ranks(tok: Any, tmp_path: Path, ranks: list[int]) -> None:
    # A second, untied group: a file whose every group ties has nothing to learn and is refused.
    rows = [group_row(23, 48, ranks=ranks), group_row(12, 30, ranks=[0, 1, 2, 3])]
    path = write_parquet(tmp_path / "g.parquet", rows)
    group, _ = load_offline_groups(path, tok, group_size=4, max_prompt_length=16, max_response_length=32)
    assert group.ranks == ranks


@pytest.mark.usefixtures("one_thread")
def test_repeated_responses_that_agree_are_kept(tok: Any, tmp_path: Path) -> None:
    # A confident policy samples the same answer twice; the rule gives both the same score and rank.
    row = group_row(23, 48, responses=["#### 71", "#### 61", "#### 71", "#### 61"], ranks=[0, 2, 0, 2])
    path = write_parquet(tmp_path / "g.parquet", [row | {"scores": [1.0, 0.0, 1.0, 0.0]}])
    (group,) = load_offline_groups(path, tok, group_size=4, max_prompt_length=16, max_response_length=32)
    assert group.responses[0] == group.responses[2] and group.ranks == [0, 2, 0, 2]


@pytest.mark.usefixtures("one_thread")
def test_ranks_and_scores_together_must_agree(tok: Any, tmp_path: Path) -> None:
    # make_offline_data.py writes both: scores [0.5, 1, 1, 0] rank [2, 0, 0, 3] (higher is better).
    path = write_parquet(
        tmp_path / "g.parquet", [group_row(23, 48, ranks=[2, 0, 0, 3], scores=[0.5, 1, 1, 0])]
    )
    (group,) = load_offline_groups(path, tok, group_size=4, max_prompt_length=16, max_response_length=32)
    assert (group.ranks, group.scores) == ([2, 0, 0, 3], [0.5, 1.0, 1.0, 0.0])
    loaded = load_offline_groups(
        path, tok, group_size=4, max_prompt_length=16, max_response_length=32, require_scores=True
    )
    assert loaded[0].scores == [0.5, 1.0, 1.0, 0.0]


BAD_GROUPS = [
    (
        {"responses": ["a", "b", "c"]},
        "column 'responses': 3 responses, but every group must have rollout.n=4",
    ),
    ({"responses": ["a", "", "c", "d"]}, "column 'responses': response 1 is empty"),
    ({"responses": ["a", "b", " \n", "d"]}, "column 'responses': response 2 is empty"),
    (
        {"responses": ["a", "b", "a", "d"]},
        r"column 'ranks': responses 0 and 2 are identical \('a'\) but have ranks 0 and 2; one response has one rank",
    ),
    (
        {"responses": ["a", "b", "c", "b"], "ranks": None, "scores": [3.0, 1.0, 2.0, 1.5]},
        r"column 'scores': responses 1 and 3 are identical \('b'\) but have scores 1.0 and 1.5",
    ),
    (
        {"responses": ["a", "b</s>c", "e", "d"]},
        "column 'responses': response 1 contains the EOS token '</s>'",
    ),
    (
        {"ranks": [1, 2, 3, 4]},
        r"column 'ranks': \[1, 2, 3, 4\] are not competition ranks .* expected \[0, 1, 2, 3\]",
    ),
    (
        {"ranks": [0, 0, 1, 2]},
        r"column 'ranks': \[0, 0, 1, 2\] are not competition ranks .* expected \[0, 0, 2, 3\]",
    ),
    ({"ranks": [0, 2, 3, 4]}, r"are not competition ranks .* expected \[0, 1, 2, 3\]"),
    ({"ranks": [0, 1]}, r"column 'ranks': expected a list of 4 integers \(one per response\)"),
    ({"ranks": None, "scores": [1.0, math.nan, 0.0, 0.0]}, r"column 'scores': scores must be finite"),
    ({"ranks": None, "scores": [1.0, 0.0, -math.inf, 0.0]}, r"column 'scores': scores must be finite"),
    ({"ranks": None, "scores": None}, r"columns 'ranks' and 'scores': neither is set"),
    (
        {"scores": [0.0, 1.0, 2.0, 3.0]},
        r"the ranks \[0, 1, 2, 2\] disagree with the scores .* \[3, 2, 1, 0\]",
    ),
]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(("change", "message"), BAD_GROUPS, ids=[m[:40] for _, m in BAD_GROUPS])
def test_bad_group_fails_naming_file_row_and_column(
    tok: Any, tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    path = write_parquet(tmp_path / "bad.parquet", [group_row(23, 48), group_row(11, 12) | change])
    with pytest.raises(DataError, match=message) as e:
        load_offline_groups(path, tok, group_size=4, max_prompt_length=16, max_response_length=32)
    assert str(e.value).startswith(f"{path}: row 1, column") and "\n" not in str(e.value)


@pytest.mark.usefixtures("one_thread")
def test_file_level_errors(tok: Any, tmp_path: Path) -> None:
    load = dict(group_size=4, max_prompt_length=16, max_response_length=32)
    only_ranks = write_parquet(tmp_path / "ranks.parquet", [group_row(23, 48)])
    with pytest.raises(DataError, match=r"row 0, column 'scores': reward.style=dataset .* only ranks"):
        load_offline_groups(only_ranks, tok, require_scores=True, **load)
    prompts = write_parquet(tmp_path / "prompts.parquet", [arith_row(23, 48)])
    with pytest.raises(
        DataError, match=r"missing column 'responses' \(offline groups\) or 'chosen' \+ 'rejected'"
    ):
        load_offline_groups(prompts, tok, **load)
    with pytest.raises(DataError, match="no such data file"):
        load_offline_groups(tmp_path / "missing.parquet", tok, **load)
    # Parquet types a whole column: these fail at their first row.
    floats = write_parquet(tmp_path / "floats.parquet", [group_row(23, 48, ranks=[0.0, 1.0, 2.0, 2.0])])
    with pytest.raises(DataError, match=rf"{floats}: row 0, column 'ranks': expected integers, got \[0.0"):
        load_offline_groups(floats, tok, **load)
    text = write_parquet(tmp_path / "text.parquet", [group_row(23, 48, responses="a b c d")])
    with pytest.raises(
        DataError, match=rf"{text}: row 0, column 'responses': expected a list of response strings"
    ):
        load_offline_groups(text, tok, **load)


@pytest.mark.usefixtures("one_thread")
def test_long_responses_and_prompts_drop_whole_groups(tok: Any, tmp_path: Path, caplog: Any) -> None:
    long_response = group_row(11, 12, responses=["x" * 12, "b", "c", "d"])  # 12 + EOS = 13 tokens
    long_prompt = group_row(11, 12, prompt=[{"role": "user", "content": "11 + 12, please"}])
    fits = group_row(11, 12, responses=["x" * 11, "b", "c", "d"])  # 12 tokens: exactly the limit
    rows = [group_row(23, 48), long_response, long_prompt, long_response, fits]
    path = write_parquet(tmp_path / "long.parquet", rows)
    with caplog.at_level(logging.INFO, logger="ppo"):
        groups = load_offline_groups(path, tok, group_size=4, max_prompt_length=10, max_response_length=12)
    # row 0's first response has 20 characters: dropped too; so are rows 1 and 3; row 2's prompt is long
    assert [g.index for g in groups] == [4]
    assert (
        f"{path}: dropped 3 of 5 groups with a response longer than data.max_response_length=12"
        in caplog.text
    )
    assert "(rows 0, 1, 3)" in caplog.text
    assert f"{path}: dropped 1 of 5 prompts longer than data.max_prompt_length=10" in caplog.text
    with pytest.raises(
        DataError, match=rf"{path}: no usable group among 5 rows \(0 empty or identical pairs, 4 with"
    ):
        load_offline_groups(path, tok, group_size=4, max_prompt_length=10, max_response_length=5)


@pytest.mark.usefixtures("one_thread")
def test_preference_pairs_load_as_groups_of_two(
    tok: Any, tiny_assets: Path, tmp_path: Path, caplog: Any
) -> None:
    pairs = pq.read_table(tiny_assets / "data" / "pref_val.parquet").to_pylist()[:6]
    rows = pairs[:1] + [{**pairs[1], "chosen": ""}, pairs[2], {**pairs[3], "rejected": pairs[3]["chosen"]}]
    rows += [{**pairs[4], "rejected": None}, pairs[5]]
    path = write_parquet(tmp_path / "pairs.parquet", rows)
    load = dict(max_prompt_length=16, max_response_length=32, require_ground_truth=False)
    with caplog.at_level(logging.INFO, logger="ppo"):
        groups = load_offline_groups(path, tok, group_size=2, **load)
    assert (
        "skipped 3 of 6 rows with an empty or null chosen/rejected, or chosen == rejected (rows 1, 3, 4)"
        in (caplog.text)
    )
    assert [g.index for g in groups] == [0, 2, 5]
    for g in groups:
        row = rows[g.index]
        assert g.responses == [encode_response(row["chosen"], tok), encode_response(row["rejected"], tok)]
        assert (g.ranks, g.scores) == ([0, 1], None)
        # The demo's preference files carry a top-level ground_truth column (TRL's layout): it is the
        # ground truth, as in a prompt file.
        assert g.record.data_source == "synthetic/arith" and g.record.ground_truth == str(row["ground_truth"])
    assert scores_from_ranks(dataset_ranks(groups, "cpu"), 2, "best").tolist() == [1, 0] * 3
    with pytest.raises(
        DataError,
        match=rf"{path}: a preference file .* loads as groups of 2, but rollout.n=4; set rollout.n=2",
    ):
        load_offline_groups(path, tok, group_size=4, **load)
    with pytest.raises(
        DataError, match="reward.style=dataset trains on the data's scores, but a preference file"
    ):
        load_offline_groups(path, tok, group_size=2, require_scores=True, **load)


def make_group(prompt: list[int], responses: list[list[int]], index: int = 0) -> OfflineGroup:
    record = PromptRecord(
        input_ids=prompt, prompt_text="", data_source="d", ground_truth=None, extra_info={}, index=index
    )
    return OfflineGroup(record=record, responses=responses, ranks=list(range(len(responses))), scores=None)


@pytest.mark.usefixtures("one_thread")
def test_offline_rollout_by_hand() -> None:
    groups = [
        make_group([1, 5, 6], [[10, 11, EOS], [12, EOS]]),
        make_group([1, 7], [[13, 14, 15, 16, EOS], [EOS]]),
    ]
    rollout = offline_rollout(
        groups, max_response_length=5, pad_token_id=PAD, eos_token_ids=[EOS], device="cpu"
    )
    expected = torch.tensor(
        [[10, 11, EOS, PAD, PAD], [12, EOS, PAD, PAD, PAD], [13, 14, 15, 16, EOS], [EOS, PAD, PAD, PAD, PAD]]
    )
    assert torch.equal(rollout.responses, expected)
    assert rollout.attention_mask.tolist() == [
        [True, True, True, False, False],
        [True, True, False, False, False],
        [True, True, True, True, True],  # fills R exactly and still ended: not truncated
        [True, False, False, False, False],
    ]
    assert rollout.truncated.tolist() == [False] * 4
    assert [p.tolist() for p in rollout.prompts] == [[1, 5, 6], [1, 5, 6], [1, 7], [1, 7]]
    mask, truncated = attention_mask_from_eos(expected, [EOS])
    assert torch.equal(rollout.attention_mask, mask) and torch.equal(rollout.truncated, truncated)


@pytest.mark.usefixtures("one_thread")
def test_offline_rollout_of_loaded_text(tok: Any, tmp_path: Path) -> None:
    # A text that tokenizes without any EOS: its only EOS is the appended one, which ends the mask.
    path = write_parquet(tmp_path / "g.parquet", [group_row(23, 48)])
    groups = load_offline_groups(path, tok, group_size=4, max_prompt_length=16, max_response_length=24)
    rollout = offline_rollout(
        groups, max_response_length=24, pad_token_id=PAD, eos_token_ids=[EOS], device="cpu"
    )
    texts = group_row(23, 48)["responses"]
    assert rollout.attention_mask.sum(-1).tolist() == [len(t) + 1 for t in texts]  # characters + EOS
    first = tok(texts[0], add_special_tokens=False)["input_ids"]
    assert EOS not in first and rollout.responses[0, :21].tolist() == first + [EOS]
    assert rollout.responses[0, 21:].tolist() == [PAD] * 3 and not rollout.truncated.any()
    decoded = tok.decode(rollout.responses[0][rollout.attention_mask[0]].tolist(), skip_special_tokens=True)
    assert decoded == texts[0]


class ScriptedLM(torch.nn.Module):
    """A stand-in for a causal LM whose ``generate`` "samples" given tokens: HF's output layout (prompt,
    then the tokens, padded after an EOS to the longest row)."""

    def __init__(self, sampled: list[list[int]]) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.generation_config = GenerationConfig()
        self.sampled = sampled

    def generate(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, generation_config: Any
    ) -> torch.Tensor:
        width = max(len(s) for s in self.sampled)
        out = torch.full((len(self.sampled), width), PAD, dtype=torch.long)
        for i, s in enumerate(self.sampled):
            out[i, : len(s)] = torch.tensor(s)
        return torch.cat([input_ids, out], dim=1)


@pytest.mark.usefixtures("one_thread")
def test_offline_rollout_equals_what_generate_returns_for_the_same_tokens() -> None:
    prompts = [[1, 5, 6], [1, 7]]
    responses = [[[10, 11, EOS], [12, EOS]], [[13, EOS], [14, 15, 16, EOS]]]
    groups = [make_group(p, r) for p, r in zip(prompts, responses, strict=True)]
    sampled = [r for group in responses for r in group]
    config = generation_config(max_new_tokens=6, do_sample=True, eos_token_ids=[EOS], pad_token_id=PAD)
    generated = generate(ScriptedLM(sampled), [torch.tensor(p) for p in prompts for _ in range(2)], config)
    offline = offline_rollout(
        groups, max_response_length=6, pad_token_id=PAD, eos_token_ids=[EOS], device="cpu"
    )
    for field in ("responses", "response_mask", "truncated"):
        assert torch.equal(getattr(offline, field), getattr(generated, field)), field
    assert [p.tolist() for p in offline.prompts] == [p.tolist() for p in generated.prompts]


@pytest.mark.usefixtures("one_thread")
def test_early_eos_of_the_model_is_refused() -> None:
    # The model's generation config may add EOS ids the tokenizer does not know (Qwen's <|endoftext|>).
    groups = [make_group([1], [[10, 99, 11, EOS], [12, EOS]], index=7)]
    check_eos(groups, [EOS])
    message = (
        r"row 7: response 0 holds an end-of-sequence token \(id 99, one of \[2, 99\]\) at position 1 of 4"
    )
    with pytest.raises(DataError, match=message):
        check_eos(groups, [EOS, 99])
    with pytest.raises(DataError, match=message):
        offline_rollout(
            groups, max_response_length=4, pad_token_id=PAD, eos_token_ids=[EOS, 99], device="cpu"
        )
    with pytest.raises(DataError, match=r"row 3: response 1 ends with token 2, none of the EOS ids \[99\]"):
        check_eos([make_group([1], [[10, 99], [11, EOS]], index=3)], [99])


@pytest.mark.usefixtures("one_thread")
def test_mixing_offline_and_sampled_groups() -> None:
    a = offline_rollout(
        [make_group([1], [[10, EOS], [11, EOS]])],
        max_response_length=3,
        pad_token_id=PAD,
        eos_token_ids=[EOS],
        device="cpu",
    )
    b = offline_rollout(
        [make_group([2], [[12, 13, EOS], [EOS]])],
        max_response_length=3,
        pad_token_id=PAD,
        eos_token_ids=[EOS],
        device="cpu",
    )
    both = concat_rollouts([a, b])
    assert both.responses.tolist() == [[10, EOS, PAD], [11, EOS, PAD], [12, 13, EOS], [EOS, PAD, PAD]]
    assert [p.tolist() for p in both.prompts] == [[1], [1], [2], [2]]
    assert both.attention_mask.sum(-1).tolist() == [2, 2, 3, 1]
    # 16 groups on a rank: 0.25 -> 4 offline; 0.5 of 3 -> 1.5 rounds up to 2; the ends are exact
    assert [num_offline_groups(16, 0.25), num_offline_groups(3, 0.5), num_offline_groups(5, 0.0)] == [4, 2, 0]
    assert num_offline_groups(5, 1.0) == 5


E = math.e


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
    # mean weight truncated at 2 (verl's) (2 + 1) / 2; one of two ratios above 2.
    assert m["mismatch_kl"].item() == pytest.approx(-0.5)
    assert m["mismatch_k3_kl"].item() == pytest.approx((E - 2) / 2)
    assert m["rollout_is_mean"].item() == pytest.approx((2 + 1) / 2)
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
        from ppo import packed_forward
        from ppo.packing import pack_rows

        noisy, _ = packed_forward.logprobs(actor, pack_rows(batch, batch.rows()), temperature=1.0)
    assert (noisy - first).abs().max() > 1e-3
