"""Prompt files as TRL and Hugging Face users keep them: JSON lines, JSON and folders written by
``datasets``' ``save_to_disk`` give the records the same rows give from Parquet, pass the same checks
and fail with the file, row (or line) and column; a missing input says how to make it.

Uses the character-level tokenizer of ``scripts/make_tiny_assets.py`` (see ``tests/unit/test_data.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import pyarrow.parquet as pq
import pytest

from ppo import model_loading
from ppo.data import load_prompts
from ppo.data_files import DataError
from ppo.input_paths import ModelPathError
from tests.helpers import arith_row, base_args, deterministic, run, train, write_parquet


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_formats(folder: Path, rows: list[dict[str, Any]]) -> dict[str, Path]:
    """``rows`` as Parquet, JSON lines, a JSON list, JSON lines named .json (``Dataset.to_json``'s
    default) and a saved dataset folder."""
    dataset = datasets.Dataset.from_list(rows)
    dataset.save_to_disk(str(folder / "saved"))
    dataset.to_json(str(folder / "to_json.json"))
    (folder / "list.json").write_text(json.dumps(rows, indent=2))
    return {
        "parquet": write_parquet(folder / "rows.parquet", rows),
        "jsonl": write_jsonl(folder / "rows.jsonl", rows),
        "json-list": folder / "list.json",
        "json-lines": folder / "to_json.json",
        "saved": folder / "saved",
    }


@pytest.mark.parametrize("fmt", ["jsonl", "json-list", "json-lines", "saved"])
def test_every_format_gives_the_records_parquet_gives(tmp_path: Path, tok: Any, fmt: str) -> None:
    rows = [arith_row(a, b) for a, b in ((17, 27), (3, 5), (40, 2))]
    rows[1]["extra_info"] = None  # a null cell, as Parquet keeps it
    files = write_formats(tmp_path, rows)
    expected = load_prompts(files["parquet"], tok, max_prompt_length=64)
    assert [r.ground_truth for r in expected] == ["44", "8", "42"] and expected[1].extra_info == {}
    assert load_prompts(files[fmt], tok, max_prompt_length=64) == expected


def test_a_trl_prompt_file_loads_with_a_reward_model_and_names_what_a_rule_needs(
    tmp_path: Path, tok: Any
) -> None:
    # TRL's prompt-only layout: a string or a conversation, nothing else (one JSON-lines file may mix them).
    path = write_jsonl(
        tmp_path / "prompts.jsonl", [{"prompt": "2 + 3"}, {"prompt": [{"role": "user", "content": "2 + 3"}]}]
    )
    records = load_prompts(path, tok, max_prompt_length=64, require_ground_truth=False)
    assert [r.ground_truth for r in records] == [None, None] and records[0].data_source == "default"
    assert records[0].input_ids == [1, *tok("2 + 3", add_special_tokens=False)["input_ids"]]  # <s> + text
    assert records[1].prompt_text.startswith("<s><|user|>")  # the chat template
    with pytest.raises(DataError) as e:
        load_prompts(path, tok, max_prompt_length=64)
    assert str(e.value).startswith(
        f"{path}: missing column(s) 'data_source', 'reward_model'; it has ['prompt']; the rule reward needs "
    )


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("a.jsonl", '{"prompt": "1 + 1"}\n{"prompt": "2 + 2"\n', "a.jsonl: line 2 is not valid JSON"),
        (
            "b.jsonl",
            '{"prompt": "1 + 1"}\n\n["2 + 2"]\n',
            "b.jsonl: line 3: expected a JSON object (one row), got list",
        ),
        ("c.json", '[{"prompt": "1 + 1"},\n {"prompt": }]', "c.json: line 2, column 13: not valid JSON"),
        (
            "d.json",
            '[{"prompt": "1 + 1"}, "2 + 2"]',
            "d.json: row 1: expected a JSON object (one row), got str",
        ),
        (
            "e.jsonl",
            '{"prompt": "1 + 1"}\n{"prompt": 7}\n',
            "e.jsonl: row 1, column 'prompt': expected a list of chat",
        ),
        (
            "f.jsonl",
            '{"prompt": "1 + 1"}\n{"question": "2 + 2"}\n',
            "f.jsonl: row 1, column 'prompt': expected",
        ),
        ("g.jsonl", '{"question": "1 + 1"}\n', "g.jsonl: missing column(s) 'prompt'; it has ['question']"),
        ("h.json", "", "no prompts in"),
    ],
)
def test_bad_json_files_name_file_and_line_or_row_and_column(
    tmp_path: Path, tok: Any, name: str, text: str, message: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(DataError) as e:
        load_prompts(path, tok, max_prompt_length=64, require_ground_truth=False)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_folders_that_are_not_one_saved_dataset(tmp_path: Path, tok: Any) -> None:
    rows = [{"prompt": "1 + 1"}]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(
        DataError, match=r"a DatasetDict folder \(splits \['train'\]\); give one split's folder"
    ):
        load_prompts(tmp_path / "dd", tok, max_prompt_length=64, require_ground_truth=False)
    assert load_prompts(tmp_path / "dd" / "train", tok, max_prompt_length=64, require_ground_truth=False)
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError, match="not one written by datasets' save_to_disk"):
        load_prompts(tmp_path / "plain", tok, max_prompt_length=64, require_ground_truth=False)


@pytest.mark.parametrize(
    ("path", "how"),
    [
        ("assets/data/not_built.parquet", "`make assets` builds the demo's data"),
        ("data/gsm8k/train.parquet", "`python scripts/prepare_gsm8k.py --out <folder>` writes GSM8K's"),
        ("prompts.jsonl", "prompt files are Parquet (.parquet), JSON lines (.jsonl), JSON (.json"),
    ],
)
def test_a_missing_file_says_how_to_make_it(
    tmp_path: Path, tok: Any, monkeypatch: pytest.MonkeyPatch, path: str, how: str
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as e:
        load_prompts(Path(path), tok, max_prompt_length=64)
    assert str(e.value).startswith(f"{path}: no such data file; ") and how in str(e.value)


@pytest.mark.slow
def test_a_missing_input_stops_the_run_with_how_to_make_it(
    tiny_assets: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # ~ is expanded in data paths; a demo model path is never taken for a hub id (which retries the hub
    # for about a minute, then blames the id).
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    args = base_args(tiny_assets, tmp_path / "run")
    assert run([*args, "data.train_files=~/data/gsm8k/train.parquet"]) == 2
    assert (
        f"{tmp_path}/data/gsm8k/train.parquet: no such data file; `python scripts/prepare_gsm8k.py"
        in caplog.text
    )
    caplog.clear()
    assert run([*args, "model.path=assets/sft"]) == 2
    assert "model.path='assets/sft': no such folder" in caplog.text
    assert "`make assets`" in caplog.text or "run from the repository's root" in caplog.text, caplog.text
    assert "hub" not in caplog.text


def test_a_demo_model_path_is_never_a_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no assets/ here: "assets/never_built" would look like the hub id org/name
    with pytest.raises(ModelPathError) as e:
        model_loading.load_tokenizer("assets/never_built", config_key="model.path")
    assert str(e.value).startswith("model.path='assets/never_built': no such folder (looked for ")
    assert str(e.value).endswith(
        "the demo's models are built by `make assets` (about 5 minutes on 2 cores), in the repository's root"
    )


# ----------------------------------------------------------------------------------------------------
# Runs on these files
# ----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_run_on_json_lines_and_a_saved_folder_trains_as_on_parquet(
    tiny_assets: Path, tmp_path: Path
) -> None:
    train_rows = pq.read_table(tiny_assets / "data" / "train.parquet").to_pylist()
    val_rows = pq.read_table(tiny_assets / "data" / "val.parquet").to_pylist()
    jsonl = write_jsonl(tmp_path / "train.jsonl", train_rows)
    datasets.Dataset.from_list(val_rows).save_to_disk(str(tmp_path / "val"))
    other = train(
        tiny_assets, tmp_path / "other", f"data.train_files={jsonl}", f"data.val_files={tmp_path / 'val'}"
    )
    parquet = train(tiny_assets, tmp_path / "parquet")
    assert len(parquet) == 3 and deterministic(other) == deterministic(parquet)


@pytest.mark.slow
def test_a_trl_prompt_file_trains_with_a_reward_model(tiny_assets: Path, tmp_path: Path) -> None:
    prompts = [{"prompt": f"{a} + {b} ="} for a in range(10, 30) for b in range(10, 12)]
    data = write_jsonl(tmp_path / "prompts.jsonl", prompts)
    rows = train(
        tiny_assets,
        tmp_path / "run",
        f"data.train_files={data}",
        f"data.val_files={data}",
        "reward.style=model",
        f"reward.model_path={tiny_assets / 'base_rm'}",
        "reward.custom_function=null",
    )
    assert "val/default/score" in rows[0] and rows[1]["critic/score/max"] != rows[1]["critic/score/min"]
