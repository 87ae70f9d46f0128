"""Tests of offline RLHF data: ``ppo/offline.py`` (loading ranked groups and preference pairs, the rollout
they stand for) and ``scripts/make_offline_data.py`` (sampling, ranking, resuming, converting pairs).

The script runs on a tiny Llama whose weights are set so that it samples short strings of digits,
spaces and ``#`` and ends about one response in seven tokens (so groups fill quickly and a few
responses are empty or never end); its rule is ``tests/reward_fns.py:digit_score``::

    pytest tests/test_offline.py                 # about a minute on 2 cores
    pytest tests/test_offline.py -m "not slow"   # without the script's shared 1-rank run and its 2-rank run
"""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GenerationConfig,
    LlamaForCausalLM,
)

from ppo import data, models
from ppo.data import DataError, PromptRecord, encode_response, load_prompts
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
from ppo.rollout import generate, generation_config, response_mask_from_eos
from tests.helpers import ROOT, arith_row, load_script, torchrun, write_parquet
from tests.reward_fns import digit_score

make_offline_data = load_script("make_offline_data")

EOS = 2
PAD = 0


pytestmark = pytest.mark.usefixtures("one_thread")


def group_row(a: int, b: int, **extra: Any) -> dict[str, Any]:
    """A valid group of 4: the right answer best, a forgotten carry and two broken ones tied last."""
    r = a + b
    responses = [f"{a} + {b} = {r}\n#### {r}", f"#### {r - 10}", f"{r}", "no idea"]
    return arith_row(a, b, responses=responses, ranks=[0, 1, 2, 2], scores=None) | extra


# ----------------------------------------------------------------------------------------------------
# Loading groups
# ----------------------------------------------------------------------------------------------------


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


def test_repeated_responses_that_agree_are_kept(tok: Any, tmp_path: Path) -> None:
    # A confident policy samples the same answer twice; the rule gives both the same score and rank.
    row = group_row(23, 48, responses=["#### 71", "#### 61", "#### 71", "#### 61"], ranks=[0, 2, 0, 2])
    path = write_parquet(tmp_path / "g.parquet", [row | {"scores": [1.0, 0.0, 1.0, 0.0]}])
    (group,) = load_offline_groups(path, tok, group_size=4, max_prompt_length=16, max_response_length=32)
    assert group.responses[0] == group.responses[2] and group.ranks == [0, 2, 0, 2]


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


@pytest.mark.parametrize(("change", "message"), BAD_GROUPS, ids=[m[:40] for _, m in BAD_GROUPS])
def test_bad_group_fails_naming_file_row_and_column(
    tok: Any, tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    path = write_parquet(tmp_path / "bad.parquet", [group_row(23, 48), group_row(11, 12) | change])
    with pytest.raises(DataError, match=message) as e:
        load_offline_groups(path, tok, group_size=4, max_prompt_length=16, max_response_length=32)
    assert str(e.value).startswith(f"{path}: row 1, column") and "\n" not in str(e.value)


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
        assert g.record.data_source == "synthetic/arith" and g.record.ground_truth is None
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


# ----------------------------------------------------------------------------------------------------
# The rollout a batch of groups stands for
# ----------------------------------------------------------------------------------------------------


def make_group(prompt: list[int], responses: list[list[int]], index: int = 0) -> OfflineGroup:
    record = PromptRecord(
        input_ids=prompt, prompt_text="", data_source="d", ground_truth=None, extra_info={}, index=index
    )
    return OfflineGroup(record=record, responses=responses, ranks=list(range(len(responses))), scores=None)


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
    assert rollout.response_mask.tolist() == [
        [True, True, True, False, False],
        [True, True, False, False, False],
        [True, True, True, True, True],  # fills R exactly and still ended: not truncated
        [True, False, False, False, False],
    ]
    assert rollout.truncated.tolist() == [False] * 4
    assert [p.tolist() for p in rollout.prompts] == [[1, 5, 6], [1, 5, 6], [1, 7], [1, 7]]
    mask, truncated = response_mask_from_eos(expected, [EOS])
    assert torch.equal(rollout.response_mask, mask) and torch.equal(rollout.truncated, truncated)


def test_offline_rollout_of_loaded_text(tok: Any, tmp_path: Path) -> None:
    # A text that tokenizes without any EOS: its only EOS is the appended one, which ends the mask.
    path = write_parquet(tmp_path / "g.parquet", [group_row(23, 48)])
    groups = load_offline_groups(path, tok, group_size=4, max_prompt_length=16, max_response_length=24)
    rollout = offline_rollout(
        groups, max_response_length=24, pad_token_id=PAD, eos_token_ids=[EOS], device="cpu"
    )
    texts = group_row(23, 48)["responses"]
    assert rollout.response_mask.sum(-1).tolist() == [len(t) + 1 for t in texts]  # characters + EOS
    first = tok(texts[0], add_special_tokens=False)["input_ids"]
    assert EOS not in first and rollout.responses[0, :21].tolist() == first + [EOS]
    assert rollout.responses[0, 21:].tolist() == [PAD] * 3 and not rollout.truncated.any()
    decoded = tok.decode(rollout.responses[0][rollout.response_mask[0]].tolist(), skip_special_tokens=True)
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
    assert both.response_mask.sum(-1).tolist() == [2, 2, 3, 1]
    # 16 groups on a rank: 0.25 -> 4 offline; 0.5 of 3 -> 1.5 rounds up to 2; the ends are exact
    assert [num_offline_groups(16, 0.25), num_offline_groups(3, 0.5), num_offline_groups(5, 0.0)] == [4, 2, 0]
    assert num_offline_groups(5, 1.0) == 5


# ----------------------------------------------------------------------------------------------------
# scripts/make_offline_data.py
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def policy(tiny_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama of ``tiny_assets`` set to sample strings of digits, spaces and ``#`` that end about
    one response in seven tokens; with a reward model beside it (``rm/``).

    Its embeddings carry a large constant in dimension 0, so after the final norm that dimension is
    about sqrt(hidden) at every position and the LM head's column 0 sets fixed logits: 0 for the 12
    allowed characters, 0.75 for EOS (p = e^0.75 / (e^0.75 + 12) = 0.15), about -23 for the rest.
    """
    root = tmp_path_factory.mktemp("offline_policy")
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets / "tokenizer")
    model = LlamaForCausalLM.from_pretrained(tiny_assets / "base")
    hidden = model.config.hidden_size
    allowed = tokenizer.convert_tokens_to_ids(list("0123456789 #"))
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 10.0
        head = model.lm_head.weight
        head.zero_()
        head[:, 0] = -2.0
        head[allowed, 0] = 0.0
        head[EOS, 0] = 0.75 / hidden**0.5
    model.save_pretrained(root / "lm")
    tokenizer.save_pretrained(root / "lm")
    torch.manual_seed(1)
    rm = AutoModelForSequenceClassification.from_pretrained(root / "lm", num_labels=1)
    with torch.no_grad():
        rm.score.weight.normal_(0, 1.0)
    rm.save_pretrained(root / "rm")
    tokenizer.save_pretrained(root / "rm")
    return root


@pytest.fixture(scope="module")
def prompts(tiny_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six training prompts of the synthetic task (with an ``ability`` column the output must keep)."""
    rows = pq.read_table(tiny_assets / "data" / "train.parquet").to_pylist()[:6]
    return write_parquet(tmp_path_factory.mktemp("offline_prompts") / "prompts.parquet", rows)


def script_args(policy: Path, prompts: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--model", str(policy / "lm"),
        "--data", str(prompts),
        "--out", str(out),
        "--k", "3",
        "--max-prompt-length", "16",
        "--max-response-length", "16",
        "--shard-size", "2",
        "--micro-batch", "8",
        "--seed", "5",
        "--custom-function", f"{ROOT / 'tests' / 'reward_fns.py'}:digit_score",
        *extra,
    ]  # fmt: skip


def competition(values: list[float]) -> list[int]:
    """Competition ranks by hand: the number of strictly better (higher) values."""
    return [sum(w > v for w in values) for v in values]


@pytest.fixture(scope="module")
def one_rank_groups(policy: Path, prompts: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("one_rank_groups") / "groups.parquet"
    assert (
        make_offline_data.main(script_args(policy, prompts, out, "--metrics", str(out.parent / "m.json")))
        == 0
    )
    return out


def check_groups(out: Path, prompts: Path, tok: Any, k: int = 3) -> list[dict[str, Any]]:
    """The written groups: non-empty ended responses, rule scores, competition ranks, the input's columns;
    they load back whole with the same limits."""
    rows = pq.read_table(out).to_pylist()
    inputs = pq.read_table(prompts).to_pylist()
    by_prompt = {repr(r["prompt"]): r for r in inputs}
    assert len(rows) >= 5  # a prompt drops only when 4 rounds leave it short of 3 usable samples
    for row in rows:
        source = by_prompt[repr(row["prompt"])]
        assert {
            key: row[key] for key in source
        } == source  # every input column kept (ability, extra_info, ...)
        texts = row["responses"]
        assert len(texts) == k and all(t.strip() for t in texts)
        assert all(set(t) <= set("0123456789 #") for t in texts)
        assert row["scores"] == [digit_score("", t, "") for t in texts]
        assert row["ranks"] == competition(row["scores"])
    order = [inputs.index(by_prompt[repr(r["prompt"])]) for r in rows]
    assert order == sorted(order)  # prompt order
    groups = load_offline_groups(out, tok, group_size=k, max_prompt_length=16, max_response_length=16)
    assert len(groups) == len(rows)
    return rows


@pytest.mark.slow
def test_script_samples_scores_and_ranks(one_rank_groups: Path, prompts: Path, tok: Any) -> None:
    rows = check_groups(one_rank_groups, prompts, tok)
    final = json.loads((one_rank_groups.parent / "m.json").read_text())
    unequal = sum(len(set(r["scores"])) > 1 for r in rows) / len(rows)
    assert final["offline_unequal_share"] == pytest.approx(unequal) and unequal > 0  # a ranking signal
    mean = sum(sum(r["scores"]) for r in rows) / (3 * len(rows))
    assert final["offline_mean_score"] == pytest.approx(mean)
    assert (final["offline_groups"], final["offline_prompts"], final["offline_group_size"]) == (
        len(rows),
        6,
        3,
    )
    shards = sorted(
        p.name for p in one_rank_groups.with_name(one_rank_groups.name + ".shards").glob("shard_*.parquet")
    )
    assert shards == ["shard_00000.parquet", "shard_00001.parquet", "shard_00002.parquet"]


@pytest.mark.slow
def test_script_reads_json_lines_prompts_as_parquet(
    one_rank_groups: Path, policy: Path, prompts: Path, tmp_path: Path
) -> None:
    """The same prompts as JSON lines give the same groups, the input's columns kept."""
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in pq.read_table(prompts).to_pylist()))
    out = tmp_path / "groups.parquet"
    assert make_offline_data.main(script_args(policy, jsonl, out)) == 0
    assert pq.read_table(out).to_pylist() == pq.read_table(one_rank_groups).to_pylist()


@pytest.mark.slow
def test_script_is_deterministic_and_resumes_per_shard(
    one_rank_groups: Path, policy: Path, prompts: Path, tmp_path: Path, capfd: Any
) -> None:
    out = tmp_path / "groups.parquet"
    shards = tmp_path / "groups.parquet.shards"
    shutil.copytree(one_rank_groups.with_name(one_rank_groups.name + ".shards"), shards)
    # Shard 1 is gone (the run was killed), shard 0 is marked so its reuse shows in the output.
    (shards / "shard_00001.parquet").unlink()
    marked = pq.read_table(shards / "shard_00000.parquet").to_pylist()
    marked[0]["scores"] = [9.0, 8.0, 7.0]
    write_parquet(shards / "shard_00000.parquet", marked)
    assert make_offline_data.main(script_args(policy, prompts, out)) == 0
    assert "6 prompts in 3 shards of 2 (2 already written)" in capfd.readouterr().err
    resumed, first = pq.read_table(out).to_pylist(), pq.read_table(one_rank_groups).to_pylist()
    assert resumed[0]["scores"] == [9.0, 8.0, 7.0]  # the shard on disk was reused, not resampled
    assert resumed[1:] == first[1:]  # shard 1 resampled exactly as the first run sampled it
    # A finished output is not replaced without --overwrite; shards made with other options never mix in.
    assert make_offline_data.main(script_args(policy, prompts, out, "--temperature", "0.7")) == 2
    assert f"--out {out} already exists" in capfd.readouterr().err
    out.unlink()
    assert make_offline_data.main(script_args(policy, prompts, out, "--temperature", "0.7")) == 2
    err = capfd.readouterr().err
    assert f"{shards} holds shards made with other options (temperature differ)" in err
    assert "Traceback" not in err


def test_script_ranks_by_a_reward_model(policy: Path, prompts: Path, tok: Any, tmp_path: Path) -> None:
    out = tmp_path / "rm.parquet"
    args = script_args(policy, prompts, out, "--reward-model", str(policy / "rm"), "--max-prompts", "3")
    args.remove(next(a for a in args if a.endswith("digit_score")))
    args.remove("--custom-function")
    assert make_offline_data.main(args) == 0
    rows = pq.read_table(out).to_pylist()
    assert 2 <= len(rows) <= 3
    rm = models.load_reward_model(str(policy / "rm"))
    records = {tuple(r.input_ids): r for r in load_prompts(prompts, tok, max_prompt_length=16)}
    for row in rows:
        ids = data.encode_prompt(row["prompt"], tok, apply_chat_template=True, where="")[1]
        assert tuple(ids) in records
        with torch.no_grad():  # prompt + response + EOS, scored at its last token
            expected = [rm(input_ids=torch.tensor([ids + encode_response(t, tok)])).logits[0, 0].item()
                        for t in row["responses"]]  # fmt: skip
        torch.testing.assert_close(torch.tensor(row["scores"]), torch.tensor(expected), atol=1e-4, rtol=1e-4)
        assert row["ranks"] == competition(row["scores"])


def test_script_drops_prompts_short_of_usable_samples(
    policy: Path, prompts: Path, tmp_path: Path, capfd: Any
) -> None:
    # One round of 3 samples: a prompt keeps its group only if none of the 3 is empty or unended.
    out = tmp_path / "short.parquet"
    assert (
        make_offline_data.main(
            script_args(policy, prompts, out, "--max-rounds", "1", "--metrics", str(tmp_path / "m.json"))
        )
        == 0
    )
    err = capfd.readouterr().err
    dropped = [
        int(m) for m in re.findall(r"groups, (\d+) prompts dropped \(fewer than 3 usable samples\)", err)
    ]
    rows = pq.read_table(out).to_pylist()
    assert len(dropped) == 3 and sum(dropped) == 6 - len(rows) > 0
    assert f"from 6 prompts ({6 - len(rows)} dropped)" in err
    assert json.loads((tmp_path / "m.json").read_text())["offline_groups"] == len(rows)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--k", "1"], "error: --k=1 must be >= 2"),
        (["--top-p", "0"], r"error: --top-p=0.0 must be in \(0, 1\]"),
        (["--shard-size", "0"], "error: --shard-size=0 must be > 0"),
        (["--model", "/nonexistent/model"], "/nonexistent/model"),
        (["--data", "/nonexistent/prompts.parquet"], "/nonexistent/prompts.parquet: no such data file"),
        (
            ["--from-pairs", "x.parquet"],
            "error: --from-pairs converts a preference file; it takes no --model",
        ),
        (["--reward-model", "x"], "error: rank by --reward-model or by the rule"),
    ],
)
def test_script_bad_input_is_one_line_and_exit_2(
    policy: Path, prompts: Path, tmp_path: Path, capfd: Any, extra: list[str], message: str
) -> None:
    assert make_offline_data.main(script_args(policy, prompts, tmp_path / "o.parquet", *extra)) == 2
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert re.search(message, lines[0]), lines[0]


def test_script_converts_preference_pairs(tiny_assets: Path, tok: Any, tmp_path: Path, capfd: Any) -> None:
    pairs = pq.read_table(tiny_assets / "data" / "pref_val.parquet").to_pylist()[:5]
    rows = pairs[:2] + [{**pairs[2], "rejected": pairs[2]["chosen"]}] + pairs[3:]
    src = write_parquet(tmp_path / "pairs.parquet", rows)
    out = tmp_path / "groups.parquet"
    assert make_offline_data.main(["--from-pairs", str(src), "--out", str(out)]) == 0
    err = capfd.readouterr().err
    assert "skipped 1 of 5 rows" in err and "(rows 2)" in err and f"wrote {out}: 4 groups of 2" in err
    written = pq.read_table(out).to_pylist()
    kept = [r for i, r in enumerate(rows) if i != 2]
    assert [w["responses"] for w in written] == [[r["chosen"], r["rejected"]] for r in kept]
    assert all(w["ranks"] == [0, 1] for w in written)
    assert [w["mistake"] for w in written] == [r["mistake"] for r in kept] and "chosen" not in written[0]
    # The converted file loads as the same groups as the preference file itself.
    load = dict(group_size=2, max_prompt_length=16, max_response_length=32, require_ground_truth=False)
    direct, converted = load_offline_groups(src, tok, **load), load_offline_groups(out, tok, **load)
    assert [g.responses for g in direct] == [g.responses for g in converted]
    assert [g.record.input_ids for g in direct] == [g.record.input_ids for g in converted]
    assert make_offline_data.main(["--from-pairs", str(tmp_path / "none.parquet"), "--out", str(out)]) == 2


@pytest.mark.slow
def test_script_on_two_ranks(policy: Path, prompts: Path, tok: Any, tmp_path: Path) -> None:
    out = tmp_path / "two.parquet"
    proc = torchrun(
        ROOT / "scripts" / "make_offline_data.py", *script_args(policy, prompts, out), timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_groups(out, prompts, tok)
    assert (
        "shard 3/3" in proc.stderr
        and "6 prompts in 3 shards of 2 (0 already written) on 2 ranks" in proc.stderr
    )
