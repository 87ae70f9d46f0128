"""Tests of ppo.data (with the readers of ppo.data_files): Parquet loading, validation errors, the
per-rank prompt loader and its resume.

Uses the character-level tokenizer of ``scripts/make_tiny_assets.py`` (ids: 0 pad, 1 <s>, 2 </s>,
3 unk, 4 <|system|>, 5 <|user|>, 6 <|assistant|>, then one per character), so token counts are
character counts: ``<s><|user|>23 + 48<|assistant|>`` is 3 special tokens + 7 characters = 10.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ppo.data import PromptRecord, ShardedLoader, load_prompts
from ppo.data_files import DataError
from ppo.stage_data import load_preference_pairs, load_sft_examples
from tests.helpers import load_script, write_parquet

BOS, EOS, USER, ASSISTANT = 1, 2, 5, 6


def prompt_row(prompt: Any, truth: Any = "71", **extra: Any) -> dict[str, Any]:
    """One row in verl's layout."""
    row = {
        "prompt": prompt,
        "data_source": "synthetic/arith",
        "reward_model": {"style": "rule", "ground_truth": truth},
    }
    row.update(extra)
    return row


def user(text: str) -> list[dict[str, str]]:
    """A one-message chat prompt."""
    return [{"role": "user", "content": text}]


def chars(tok: Any, text: str) -> list[int]:
    """Token ids of plain text without special tokens (one per character)."""
    return tok(text, add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------------------------------
# load_prompts
# ----------------------------------------------------------------------------------------------------


def test_messages_prompt_rendered_with_template_and_one_bos(tmp_path: Path, tok: Any) -> None:
    f = write_parquet(
        tmp_path / "p.parquet", [prompt_row(user("23 + 48"), extra_info={"split": "train", "index": 7})]
    )
    (rec,) = load_prompts(f, tok, max_prompt_length=64)
    assert rec.prompt_text == "<s><|user|>23 + 48<|assistant|>"
    # <s> <|user|> 2 3 ' ' + ' ' 4 8 <|assistant|>: 10 tokens, BOS once (the template's), not twice.
    assert rec.input_ids == [BOS, USER, *chars(tok, "23 + 48"), ASSISTANT]
    assert len(rec.input_ids) == 10 and rec.input_ids.count(BOS) == 1
    assert rec.data_source == "synthetic/arith" and rec.ground_truth == "71"
    assert rec.extra_info == {"split": "train", "index": 7} and rec.index == 0


def test_string_prompt_used_as_is(tmp_path: Path, tok: Any) -> None:
    f = write_parquet(tmp_path / "p.parquet", [prompt_row("23 + 48")])
    for apply in (True, False):
        (rec,) = load_prompts(f, tok, max_prompt_length=64, apply_chat_template=apply)
        # No template for strings: the tokenizer's own BOS + 7 characters.
        assert rec.prompt_text == "23 + 48"
        assert rec.input_ids == [BOS, *chars(tok, "23 + 48")]


def test_messages_without_template_join_contents(tmp_path: Path, tok: Any) -> None:
    msgs = [{"role": "system", "content": "add"}, {"role": "user", "content": "1 + 2"}]
    f = write_parquet(tmp_path / "p.parquet", [prompt_row(msgs)])
    (rec,) = load_prompts(f, tok, max_prompt_length=64, apply_chat_template=False)
    assert rec.prompt_text == "add\n1 + 2"
    assert rec.input_ids == [BOS, *chars(tok, "add\n1 + 2")]


def test_numeric_ground_truth_missing_extra_info_and_index_over_files(tmp_path: Path, tok: Any) -> None:
    a = write_parquet(tmp_path / "a.parquet", [prompt_row(user("1 + 1"), 2), prompt_row(user("2 + 2"), 4)])
    b = write_parquet(tmp_path / "b.parquet", [prompt_row(user("3 + 3"), 6)])
    recs = load_prompts([str(a), b], tok, max_prompt_length=64)
    assert [r.ground_truth for r in recs] == ["2", "4", "6"]
    assert [r.index for r in recs] == [0, 1, 2]
    assert all(r.extra_info == {} for r in recs)


def test_custom_prompt_key(tmp_path: Path, tok: Any) -> None:
    row = prompt_row(None)
    row["question"] = row.pop("prompt") or user("5 + 5")
    f = write_parquet(tmp_path / "p.parquet", [row])
    (rec,) = load_prompts(f, tok, prompt_key="question", max_prompt_length=64)
    assert rec.prompt_text == "<s><|user|>5 + 5<|assistant|>"


def conversation(*turns: str) -> list[dict[str, str]]:
    """A chat whose messages alternate user, assistant, user, ... with the contents ``turns``."""
    return [{"role": ("user", "assistant")[j % 2], "content": t} for j, t in enumerate(turns)]


def test_sft_conversations_as_rl_prompts_are_refused(tmp_path: Path, tok: Any) -> None:
    """A chat whose last message is the assistant's holds its answer: refused, naming the file, the first
    such row, the key and what to do; earlier assistant turns (a multi-turn prompt) load."""
    rows = [prompt_row(None, messages=m) for m in (
        conversation("1 + 2", "3", "3 + 4"),      # ends with the user: a prompt
        conversation("23 + 48", "#### 71"),       # an SFT example: its answer is the last message
        conversation("1 + 2", "3", "3 + 4", "#### 7"),
    )]  # fmt: skip
    f = write_parquet(tmp_path / "sft.parquet", rows)
    with pytest.raises(DataError) as e:
        load_prompts(f, tok, prompt_key="messages", max_prompt_length=64)
    assert str(e.value) == (
        f"{f}: row 1, column 'messages': the chat ends with an assistant message (message 1), so as an RL "
        "prompt it holds its own answer (2 of 3 rows end so): drop each row's last assistant message to use "
        "the file as prompts (earlier assistant turns may stay), or train on these conversations with the "
        "SFT stage (scripts/train_sft.py)"
    )
    # Without the template the answer would be in the joined text just the same.
    with pytest.raises(DataError, match=r"row 1, column 'messages': the chat ends with an assistant message"):
        load_prompts(f, tok, prompt_key="messages", max_prompt_length=64, apply_chat_template=False)
    # The multi-turn prompt alone loads, its earlier assistant turn rendered as context.
    (rec,) = load_prompts(write_parquet(tmp_path / "p.parquet", rows[:1]), tok, prompt_key="messages",
                          max_prompt_length=64)  # fmt: skip
    assert rec.prompt_text == "<s><|user|>1 + 2<|assistant|>3</s><|user|>3 + 4<|assistant|>"


def test_sft_conversations_as_rl_prompts_stop_the_run_in_one_line(
    tiny_assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from tests.helpers import base_args, run

    rows = [prompt_row(None, messages=conversation(f"{i} + 1", f"#### {i + 1}")) for i in range(4)]
    f = write_parquet(tmp_path / "sft.parquet", rows)
    assert run([*base_args(tiny_assets, tmp_path / "out", steps=1), f"data.train_files={f}",
                f"data.val_files={f}", "data.prompt_key=messages"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    problems = [line for line in err.splitlines() if "ERROR" in line or "rror:" in line]
    assert "Traceback" not in err and len(problems) == 1, err
    assert problems[0].endswith(
        f"{f}: row 0, column 'messages': the chat ends with an assistant message (message 1), so as an RL "
        "prompt it holds its own answer (4 of 4 rows end so): drop each row's last assistant message to use "
        "the file as prompts (earlier assistant turns may stay), or train on these conversations with the "
        "SFT stage (scripts/train_sft.py)"
    ), problems[0]


def test_over_long_prompts_dropped_and_counted(
    tmp_path: Path, tok: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # Template lengths: 3 + len(text) tokens -> "1 + 2": 8, "23 + 48": 10 (kept at the limit), "123 + 456": 12.
    f = write_parquet(
        tmp_path / "p.parquet", [prompt_row(user(t)) for t in ("1 + 2", "23 + 48", "123 + 456")]
    )
    with caplog.at_level(logging.INFO, logger="ppo"):
        recs = load_prompts(f, tok, max_prompt_length=10)
    assert [len(r.input_ids) for r in recs] == [8, 10]
    assert [r.index for r in recs] == [0, 1]
    assert f"{f}: dropped 1 of 3 prompts longer than data.max_prompt_length=10 tokens" in caplog.text


def test_everything_dropped_is_an_error(tmp_path: Path, tok: Any) -> None:
    f = write_parquet(tmp_path / "p.parquet", [prompt_row(user("123 + 456")), prompt_row(user("23 + 48"))])
    with pytest.raises(
        DataError, match=r"2 of 2 were longer than data.max_prompt_length=9 .*raise data.max_prompt_length"
    ):
        load_prompts(f, tok, max_prompt_length=9)


GOOD = prompt_row(user("1 + 1"))


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([prompt_row("1 + 1"), prompt_row("   ")], r"row 1, column 'prompt': empty prompt"),
        ([prompt_row([])], r"row 0, column 'prompt': empty prompt \(an empty list"),
        ([GOOD, prompt_row(user(" "))], r"row 1, column 'prompt': empty prompt \(every message"),
        ([{**GOOD, "prompt": 5}], r"row 0, column 'prompt': expected a list of chat messages .* got int"),
        (
            [{**GOOD, "prompt": ["hi"]}],
            r"row 0, column 'prompt': message 0 must be a dict with string 'role'",
        ),
        (
            [GOOD, prompt_row([{"role": "user", "content": None}])],
            r"row 1, column 'prompt': message 0 must be a dict with string 'role' and 'content'",
        ),
        ([GOOD, {**GOOD, "data_source": ""}], r"row 1, column 'data_source': expected a non-empty string"),
        ([GOOD, prompt_row(user("2 + 2"), truth=None)], r"row 1, column 'reward_model': expected a struct"),
        (
            [{**GOOD, "extra_info": "x"}],
            r"row 0, column 'extra_info': expected a struct/dict or null, got str",
        ),
        (
            [{k: v for k, v in GOOD.items() if k != "data_source"}],
            r"missing column\(s\) 'data_source'; it has",
        ),
        (
            [{"question": "x"}],
            r"missing column\(s\) 'prompt', 'data_source', 'reward_model'.*data.prompt_key",
        ),
    ],
)
def test_bad_prompt_files_name_file_row_and_column(
    tmp_path: Path, tok: Any, rows: list, message: str
) -> None:
    f = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(DataError, match=message) as info:
        load_prompts(f, tok, max_prompt_length=64)
    assert str(f) in str(info.value)


def test_missing_unreadable_and_no_files(tmp_path: Path, tok: Any) -> None:
    with pytest.raises(DataError, match=r"nope.parquet: no such data file"):
        load_prompts(tmp_path / "nope.parquet", tok, max_prompt_length=64)
    (tmp_path / "text.parquet").write_text("not parquet")
    with pytest.raises(DataError, match=r"text.parquet: cannot be read as Parquet"):
        load_prompts(tmp_path / "text.parquet", tok, max_prompt_length=64)
    with pytest.raises(DataError, match="no data files given"):
        load_prompts([], tok, max_prompt_length=64)
    empty = write_parquet(tmp_path / "empty.parquet", [])
    pq.write_table(
        pa.table({"prompt": pa.array([], pa.string()), "data_source": [], "reward_model": []}), empty
    )
    with pytest.raises(DataError, match="the files have no rows"):
        load_prompts(empty, tok, max_prompt_length=64)


def test_messages_need_a_chat_template(tmp_path: Path) -> None:
    tok = load_script("make_tiny_assets").build_tokenizer()
    tok.chat_template = None
    f = write_parquet(tmp_path / "p.parquet", [prompt_row(user("1 + 1"))])
    with pytest.raises(
        DataError, match=r"row 0, column 'prompt': .*no chat template.*data.apply_chat_template=false"
    ):
        load_prompts(f, tok, max_prompt_length=64)
    assert len(load_prompts(f, tok, max_prompt_length=64, apply_chat_template=False)) == 1


# ----------------------------------------------------------------------------------------------------
# ShardedLoader
# ----------------------------------------------------------------------------------------------------


def fake_records(n: int) -> list[PromptRecord]:
    """Records whose ``index`` is their position."""
    return [
        PromptRecord(
            input_ids=[i], prompt_text=str(i), data_source="d", ground_truth="0", extra_info={}, index=i
        )
        for i in range(n)
    ]


def take(loader: ShardedLoader, steps: int) -> list[list[int]]:
    """Indices of the next ``steps`` batches."""
    return [[r.index for r in next(loader)] for _ in range(steps)]


def test_loader_order_is_the_seeded_permutation_per_epoch() -> None:
    loader = ShardedLoader(fake_records(10), batch_size=4, rank=0, world_size=1, seed=0)
    assert loader.steps_per_epoch == 2  # 10 // 4, the last 2 prompts of each epoch are dropped
    batches = take(loader, 4)
    perm0 = np.random.default_rng([0, 0]).permutation(10).tolist()
    perm1 = np.random.default_rng([0, 1]).permutation(10).tolist()
    assert batches == [perm0[:4], perm0[4:8], perm1[:4], perm1[4:8]]
    # Pinned: numpy's PCG64 stream for seed [0, 0].
    assert perm0[:4] == [4, 6, 2, 7]
    assert perm0 != perm1
    assert len(set(batches[0] + batches[1])) == 8
    assert (loader.epoch, loader.batch_in_epoch) == (1, 2)
    again = ShardedLoader(fake_records(10), batch_size=4, rank=0, world_size=1, seed=0)
    assert take(again, 4) == batches
    other = ShardedLoader(fake_records(10), batch_size=4, rank=0, world_size=1, seed=1)
    assert take(other, 4) != batches


def test_loader_without_shuffle_keeps_file_order() -> None:
    loader = ShardedLoader(fake_records(10), batch_size=4, rank=0, world_size=1, seed=0, shuffle=False)
    assert take(loader, 3) == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]


def test_rank_shares_are_disjoint_and_cover_the_global_batch() -> None:
    single = take(ShardedLoader(fake_records(50), batch_size=12, rank=0, world_size=1, seed=3), 6)
    shares = [
        take(ShardedLoader(fake_records(50), batch_size=12, rank=r, world_size=3, seed=3), 6)
        for r in range(3)
    ]
    for step in range(6):
        per_rank = [shares[r][step] for r in range(3)]
        assert all(len(s) == 4 for s in per_rank)
        assert per_rank[0] + per_rank[1] + per_rank[2] == single[step]  # contiguous, in rank order


def test_state_dict_resumes_at_the_next_batch_mid_epoch() -> None:
    records = fake_records(50)
    run = ShardedLoader(records, batch_size=8, rank=0, world_size=1, seed=7)
    assert run.steps_per_epoch == 6
    take(run, 9)  # epoch 1, batch 3 of 6 done
    state = run.state_dict()
    assert (state["epoch"], state["batch_in_epoch"]) == (1, 3)
    expected = take(run, 5)  # crosses into epoch 2
    resumed = ShardedLoader(records, batch_size=8, rank=0, world_size=1, seed=7)
    resumed.load_state_dict(state)
    assert take(resumed, 5) == expected
    # The global order does not depend on the world size: resume on 2 ranks.
    halves = []
    for r in range(2):
        loader = ShardedLoader(records, batch_size=8, rank=r, world_size=2, seed=7)
        loader.load_state_dict(state)
        halves.append(take(loader, 5))
    assert [a + b for a, b in zip(*halves, strict=True)] == expected


def test_state_dict_from_other_data_is_refused() -> None:
    state = ShardedLoader(fake_records(50), batch_size=8, rank=0, world_size=1, seed=7).state_dict()
    loader = ShardedLoader(fake_records(50), batch_size=8, rank=0, world_size=1, seed=8)
    with pytest.raises(DataError, match=r"seed: checkpoint 7, now 8.*trainer.seed"):
        loader.load_state_dict(state)
    loader = ShardedLoader(fake_records(40), batch_size=8, rank=0, world_size=1, seed=7)
    with pytest.raises(DataError, match=r"num_records: checkpoint 50, now 40"):
        loader.load_state_dict(state)


def test_loader_without_drop_last_covers_every_record() -> None:
    loaders = [
        ShardedLoader(fake_records(10), batch_size=4, rank=r, world_size=2, seed=0, drop_last=False)
        for r in range(2)
    ]
    assert loaders[0].steps_per_epoch == 3
    shares = [take(loader, 3) for loader in loaders]
    assert [len(b) for b in shares[0]] == [2, 2, 1] and [len(b) for b in shares[1]] == [2, 2, 1]
    seen = sorted(i for rank in shares for batch in rank for i in batch)
    assert seen == list(range(10))
    small = ShardedLoader(fake_records(3), batch_size=4, rank=1, world_size=2, seed=0, drop_last=False)
    assert small.steps_per_epoch == 1 and len(next(small)) == 1  # 3 prompts split 2 + 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 5, "world_size": 2}, r"5 prompts must divide evenly over 2 ranks.*multiple of 2"),
        ({"batch_size": 16}, r"has 10 prompts, fewer than one global batch of 16"),
        ({"rank": 2, "world_size": 2}, r"rank 2 is outside \[0, 2\)"),
    ],
)
def test_loader_errors(kwargs: dict, message: str) -> None:
    args = {"batch_size": 4, "rank": 0, "world_size": 1, "seed": 0} | kwargs
    with pytest.raises(DataError, match=message):
        ShardedLoader(fake_records(10), **args)


# ----------------------------------------------------------------------------------------------------
# Preference pairs
# ----------------------------------------------------------------------------------------------------


def pref_row(chosen: Any, rejected: Any, prompt: Any = None, mistake: str = "far_off") -> dict[str, Any]:
    """One preference row."""
    return {"prompt": prompt or user("23 + 48"), "chosen": chosen, "rejected": rejected, "mistake": mistake}


def test_preference_pairs_tokens_skips_and_extra(
    tmp_path: Path, tok: Any, caplog: pytest.LogCaptureFixture
) -> None:
    good = "23 + 48 = 71\n#### 71"
    rows = [
        pref_row(good, "23 + 48 = 61\n#### 61", mistake="slipped_carry"),
        pref_row("", "x"),  # empty chosen
        pref_row(good, good),  # identical
        pref_row(good, None),  # null rejected counts as empty
        pref_row(good, "9" * 40),  # 10 + 41 = 51 tokens > 40
    ]
    f = write_parquet(tmp_path / "pref.parquet", rows)
    g = write_parquet(tmp_path / "strings.parquet", [pref_row("7", "8", prompt="1 + 6")])  # a string prompt
    with caplog.at_level(logging.INFO, logger="ppo"):
        pairs = load_preference_pairs([f, g], tok, max_length=40)
    assert [p.index for p in pairs] == [0, 5]
    first = pairs[0]
    prompt = [BOS, USER, *chars(tok, "23 + 48"), ASSISTANT]
    assert first.prompt_length == 10
    assert first.chosen_ids == prompt + chars(tok, good) + [EOS]  # 10 + 20 + 1 = 31 tokens
    assert len(first.chosen_ids) == 31
    assert first.rejected_ids == prompt + chars(tok, "23 + 48 = 61\n#### 61") + [EOS]
    assert first.extra == {"mistake": "slipped_carry"}
    assert pairs[1].chosen_ids == [BOS, *chars(tok, "1 + 6"), *chars(tok, "7"), EOS]
    assert pairs[1].prompt_length == 6
    assert (
        "skipped 3 of 5 rows with an empty or null chosen/rejected, or chosen == rejected (rows 1, 2, 3)"
        in caplog.text
    )
    assert "dropped 1 of 5 preference pairs longer than max_length=40 tokens" in caplog.text


def test_preference_file_without_usable_rows_fails(tmp_path: Path, tok: Any) -> None:
    f = write_parquet(tmp_path / "pref.parquet", [pref_row("a", "a"), pref_row("", "b")])
    with pytest.raises(
        DataError, match=r"pref.parquet: no usable preference pair among 2 rows \(2 empty or identical"
    ):
        load_preference_pairs(f, tok, max_length=64)
    bad = write_parquet(tmp_path / "bad.parquet", [pref_row("a", "b"), pref_row("a", "b", prompt=user(""))])
    with pytest.raises(DataError, match=r"bad.parquet: row 1, column 'prompt': empty prompt"):
        load_preference_pairs(bad, tok, max_length=64)
    wrong = write_parquet(tmp_path / "wrong.parquet", [{"prompt": "p", "chosen": 1, "rejected": 2}])
    with pytest.raises(
        DataError, match=r"wrong.parquet: row 0, column 'chosen': expected a string response, got int"
    ):
        load_preference_pairs(wrong, tok, max_length=64)
    missing = write_parquet(tmp_path / "missing.parquet", [{"prompt": "p", "chosen": "a"}])
    with pytest.raises(DataError, match=r"missing column\(s\) 'rejected'"):
        load_preference_pairs(missing, tok, max_length=64)


# ----------------------------------------------------------------------------------------------------
# SFT examples
# ----------------------------------------------------------------------------------------------------


def test_sft_prompt_answer_mask_only_on_answer_and_eos(
    tmp_path: Path, tok: Any, caplog: pytest.LogCaptureFixture
) -> None:
    rows = [
        {"prompt": user("23 + 48"), "answer": "23 + 48 = 61\n#### 61", "flawed": True},
        {"prompt": user("1 + 1"), "answer": "1" * 60, "flawed": False},  # 8 + 61 tokens > 64
    ]
    f = write_parquet(tmp_path / "sft.parquet", rows)
    with caplog.at_level(logging.INFO, logger="ppo"):
        (ex,) = load_sft_examples(f, tok, max_length=64)
    assert ex.input_ids == [
        BOS,
        USER,
        *chars(tok, "23 + 48"),
        ASSISTANT,
        *chars(tok, "23 + 48 = 61\n#### 61"),
        EOS,
    ]
    assert ex.loss_mask == [False] * 10 + [True] * 21  # no loss on the 10 prompt tokens; 20 chars + EOS
    assert ex.extra == {"flawed": True} and ex.index == 0
    assert "dropped 1 of 2 SFT examples longer than max_length=64 tokens" in caplog.text


def test_sft_messages_equal_prompt_answer_and_multi_turn_masks(tmp_path: Path, tok: Any) -> None:
    conv = [{"role": "user", "content": "23 + 48"}, {"role": "assistant", "content": "71"}]
    a = write_parquet(tmp_path / "a.parquet", [{"prompt": conv[:1], "answer": "71"}])
    m = write_parquet(tmp_path / "m.parquet", [{"messages": conv}])
    (from_answer,) = load_sft_examples(a, tok, max_length=64)
    (from_messages,) = load_sft_examples(m, tok, max_length=64)
    assert from_messages.input_ids == from_answer.input_ids
    assert from_messages.loss_mask == from_answer.loss_mask

    turns = conv + [{"role": "user", "content": "1 + 2"}, {"role": "assistant", "content": "3"}]
    (ex,) = load_sft_examples(
        write_parquet(tmp_path / "t.parquet", [{"messages": turns}]), tok, max_length=64
    )
    # <s><|user|>23 + 48<|assistant|> | 7 1 </s> | <|user|>1 + 2<|assistant|> | 3 </s>
    first = [BOS, USER, *chars(tok, "23 + 48"), ASSISTANT, *chars(tok, "71"), EOS]
    second = [USER, *chars(tok, "1 + 2"), ASSISTANT, *chars(tok, "3"), EOS]
    assert ex.input_ids == first + second
    assert ex.loss_mask == [False] * 10 + [True] * 3 + [False] * 7 + [True] * 2


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"prompt": "p", "answer": ""}], r"row 0, column 'answer': expected a non-empty string"),
        (
            [{"prompt": "p", "answer": "a"}, {"prompt": "", "answer": "a"}],
            r"row 1, column 'prompt': empty prompt",
        ),
        (
            [{"prompt": "p", "reply": "a"}],
            r"missing column\(s\) 'answer'.*'prompt' \+ 'answer' columns, or a 'messages'",
        ),
        (
            [{"messages": [{"role": "assistant", "content": "hi"}]}],
            r"row 0, column 'messages': .*starts with an assistant",
        ),
        ([{"messages": [{"role": "user", "content": "hi"}]}], r"row 0, column 'messages': no assistant turn"),
        (
            [{"prompt": "p", "answer": "a" * 80}],
            r"no usable SFT example among 1 rows \(1 longer than max_length=64",
        ),
    ],
)
def test_bad_sft_files(tmp_path: Path, tok: Any, rows: list, message: str) -> None:
    f = write_parquet(tmp_path / "sft.parquet", rows)
    with pytest.raises(DataError, match=message) as info:
        load_sft_examples(f, tok, max_length=64)
    assert str(f) in str(info.value)
