"""scripts/prepare_gsm8k.py on small local copies in GSM8K's formats (no download)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ppo.data import load_prompts
from ppo.model_loading import load_tokenizer
from ppo.rule_scoring import gsm8k_score
from tests.helpers import load_script

prepare = load_script("prepare_gsm8k")

# GSM8K's answer format: worked steps with <<calculator>> notes, then "#### <number>".
TRAIN = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
        "clips in May. How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
        "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72",
    },
    {
        "question": "A house costs $1,250 a month. What does it cost in a year?",
        "answer": "12 * 1,250 = <<12*1250=15000>>15,000\n#### 15,000",
    },
    {
        "question": "A loan of 1,000,000 dollars is paid back over 4 years. How much is paid per year?",
        "answer": "1,000,000 / 4 = 250,000\n#### 250,000",
    },
]
TEST = [
    {
        "question": "The temperature was 5 degrees and fell 8 degrees. What is it now?",
        "answer": "5 - 8 = -3\n#### -3",
    },
    {"question": "What is 2.5 doubled?", "answer": "2.5 * 2 = 5.0\n#### 5"},
]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_hf_parquet(path: Path, rows: list[dict]) -> None:
    """The Hugging Face repository's layout: two string columns."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


@pytest.fixture
def jsonl_copy(tmp_path: Path) -> Path:
    src = tmp_path / "gsm8k_src"
    write_jsonl(src / "train.jsonl", TRAIN)
    write_jsonl(src / "test.jsonl", TEST)
    return src


def test_jsonl_copy_to_verl_layout(jsonl_copy: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert prepare.main(["--local-dir", str(jsonl_copy), "--out", str(out)]) == 0
    train = pq.read_table(out / "train.parquet").to_pylist()
    assert len(train) == len(TRAIN)
    row = train[1]
    assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
    assert row["prompt"] == [
        {
            "role": "user",
            "content": TRAIN[1]["question"]
            + ' Let\'s think step by step and output the final answer after "####".',
        }
    ]
    # "#### 15,000" -> "15000": commas are stripped from the ground truth.
    assert row["reward_model"] == {"style": "rule", "ground_truth": "15000"}
    assert row["extra_info"] == {
        "split": "train",
        "index": 1,
        "answer": TRAIN[1]["answer"],
        "question": TRAIN[1]["question"],
    }
    assert [r["reward_model"]["ground_truth"] for r in train] == ["72", "15000", "250000"]
    test = pq.read_table(out / "test.parquet").to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in test] == ["-3", "5"]
    assert [r["extra_info"]["split"] for r in test] == ["test", "test"]


def test_output_loads_and_ground_truth_scores_one(
    jsonl_copy: Path, tmp_path: Path, tiny_assets: Path
) -> None:
    """The trainer reads the files, and the original worked answer scores 1.0 against the ground truth."""
    out = tmp_path / "out"
    assert prepare.main(["--local-dir", str(jsonl_copy), "--out", str(out)]) == 0
    tokenizer = load_tokenizer(str(tiny_assets / "tokenizer"))
    for split, source in (("train", TRAIN), ("test", TEST)):
        records = load_prompts(out / f"{split}.parquet", tokenizer, max_prompt_length=4096)
        assert len(records) == len(source)
        for record, original in zip(records, source, strict=True):
            assert record.data_source == "openai/gsm8k"
            assert record.extra_info["question"] == original["question"]
            assert gsm8k_score(original["answer"], record.ground_truth) == 1.0
            assert gsm8k_score(original["answer"] + " and 1 more\n#### 999999", record.ground_truth) == 0.0


def test_hf_parquet_layout(tmp_path: Path) -> None:
    """The hub repository's files: main/train-00000-of-00001.parquet beside a socratic/ subset."""
    src = tmp_path / "hf"
    write_hf_parquet(src / "main" / "train-00000-of-00001.parquet", TRAIN)
    write_hf_parquet(src / "main" / "test-00000-of-00001.parquet", TEST)
    write_hf_parquet(src / "socratic" / "train-00000-of-00001.parquet", TRAIN[:1])
    write_hf_parquet(src / "socratic" / "test-00000-of-00001.parquet", TEST[:1])
    out = tmp_path / "out"
    assert prepare.main(["--local-dir", str(src), "--out", str(out)]) == 0
    assert pq.read_table(out / "train.parquet").num_rows == len(TRAIN)
    assert prepare.main(["--local-dir", str(src), "--subset", "socratic", "--out", str(tmp_path / "s")]) == 0
    assert pq.read_table(tmp_path / "s" / "train.parquet").num_rows == 1


def test_row_without_final_answer_fails_naming_file_and_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "bad"
    broken = [*TRAIN[:2], {"question": "What is 1 + 1?", "answer": "1 + 1 = 2, so the answer is 2."}]
    write_jsonl(src / "train.jsonl", broken)
    write_jsonl(src / "test.jsonl", TEST)
    out = tmp_path / "out"
    assert prepare.main(["--local-dir", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{src / 'train.jsonl'}: row 2:" in err and "'#### <number>'" in err
    assert not out.exists()  # nothing written when any split fails


def test_missing_split_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_jsonl(tmp_path / "only" / "train.jsonl", TRAIN)
    assert prepare.main(["--local-dir", str(tmp_path / "only"), "--out", str(tmp_path / "o")]) == 2
    assert "no test*.parquet or test*.jsonl" in capsys.readouterr().err
