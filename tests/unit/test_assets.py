"""Tests of scripts/make_tiny_assets.py: the assets load back with from_pretrained, are deterministic in the
seed, the synthetic task has the flaw and the splits that docs/demo.md describes, and the distillation
teacher is a larger model of the student's tokenizer with demonstrations free of the flaw."""

from __future__ import annotations

import collections
from pathlib import Path
from types import ModuleType
from typing import Any

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
)

from ppo.config_loader import load_config
from ppo.data import load_prompts
from ppo.environments import load_environment
from ppo.rule_scoring import RULE_DATA_SOURCES, default_compute_score, gsm8k_score
from ppo.stage_data import load_preference_pairs, load_sft_examples
from tests.helpers import ROOT, load_script

DATA_FILES = (
    "train",
    "val",
    "sft_train",
    "sft_val",
    "pref_train",
    "pref_val",
    "sft_tools_train",
    "sft_tools_val",
    "teacher_sft_train",
    "teacher_sft_val",
)


@pytest.fixture(scope="module")
def assets() -> ModuleType:
    """The asset builder module."""
    return load_script("make_tiny_assets")


@pytest.fixture(scope="module")
def built(assets: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One full build with seed 0, shared by the tests of this file."""
    out = tmp_path_factory.mktemp("assets")
    assets.build_assets(out, seed=0)
    return out


@pytest.fixture(scope="module")
def task(assets: ModuleType) -> dict[str, list[dict[str, Any]]]:
    """The task's rows for seed 0, without I/O."""
    return assets.make_task(0)


def test_cli_builds_everything_deterministically(
    assets: ModuleType, built: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assets.main(["--out", str(tmp_path), "--seed", "0"])
    printed = capsys.readouterr().out
    assert "813,696 params" in printed and "(4096 rows)" in printed and "= 10 tokens" in printed
    assert "base_teacher  (2,400,576 params)" in printed
    for name in DATA_FILES:
        a, b = built / "data" / f"{name}.parquet", tmp_path / "data" / f"{name}.parquet"
        assert pq.read_table(a).equals(pq.read_table(b)), name
        assert a.read_bytes() == b.read_bytes(), name
    for folder in ("base", "base_rm", "base_critic", "base_teacher"):
        first = load_file(built / folder / "model.safetensors")
        second = load_file(tmp_path / folder / "model.safetensors")
        assert first.keys() == second.keys()
        assert all(torch.equal(first[k], second[k]) for k in first), folder


def test_other_seed_gives_other_data_and_weights(assets: ModuleType, built: Path, tmp_path: Path) -> None:
    assets.write_task(tmp_path, seed=1)
    assert not pq.read_table(built / "data" / "train.parquet").equals(
        pq.read_table(tmp_path / "train.parquet")
    )
    assets.build_models(tmp_path, assets.build_tokenizer(), seed=1)
    w0 = load_file(built / "base" / "model.safetensors")["model.embed_tokens.weight"]
    w1 = load_file(tmp_path / "base" / "model.safetensors")["model.embed_tokens.weight"]
    assert not torch.equal(w0, w1)
    assets.build_teacher(tmp_path, assets.build_tokenizer(), seed=1)
    w0 = load_file(built / "base_teacher" / "model.safetensors")["model.embed_tokens.weight"]
    w1 = load_file(tmp_path / "base_teacher" / "model.safetensors")["model.embed_tokens.weight"]
    assert not torch.equal(w0, w1)


def test_teacher_only_writes_the_teachers_files_as_the_full_build(
    assets: ModuleType, built: Path, tmp_path: Path
) -> None:
    """``--teacher-only`` (``make teacher``) adds the teacher to assets built before it: exactly the files a
    full build writes for it, and nothing else."""
    assets.main(["--out", str(tmp_path), "--seed", "0", "--teacher-only"])
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert written == sorted(
        [f"base_teacher/{p.name}" for p in (built / "base_teacher").iterdir()]
        + ["data/teacher_sft_train.parquet", "data/teacher_sft_val.parquet"]
    )
    for name in written:
        assert (tmp_path / name).read_bytes() == (built / name).read_bytes(), name


def test_carry4_only_writes_the_second_tasks_files_as_the_full_build(
    assets: ModuleType, built: Path, tmp_path: Path
) -> None:
    """``--carry4-only`` (``make carry4``) adds the four-digit task to assets built before it: exactly the
    files a full build writes for it, and nothing else."""
    assets.main(["--out", str(tmp_path), "--seed", "0", "--carry4-only"])
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert written == sorted(f"carry4/data/{name}.parquet" for name in assets.CARRY4_FILES)
    for name in written:
        assert (tmp_path / name).read_bytes() == (built / name).read_bytes(), name
    with pytest.raises(SystemExit):
        assets.main(["--out", str(tmp_path), "--teacher-only", "--carry4-only"])


def test_tokenizer_loads_back_with_chat_template(built: Path) -> None:
    for folder in ("tokenizer", "base", "base_rm", "base_critic", "base_teacher"):
        tok = AutoTokenizer.from_pretrained(built / folder)
        assert len(tok) == 103  # 7 special tokens + 10 digits + 52 letters + space + 32 punctuation + newline
        assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "23 + 48"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<s><|user|>23 + 48<|assistant|>"
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert ids[:2] == [1, 5] and ids[-1] == 6 and len(ids) == 10  # each marker is one token
    answer = "23 + 48 = 71\n#### 71"
    answer_ids = tok(answer, add_special_tokens=False)["input_ids"]
    assert len(answer_ids) == 20 and tok.decode(answer_ids) == answer
    assert tok("ab")["input_ids"] == [1, tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids("b")]
    assert tok.decode([1, *ids[2:], 2], skip_special_tokens=True) == "23 + 48"


def test_models_load_back_and_run(built: Path) -> None:
    ids = torch.tensor([[1, 5, 11, 12, 6]])
    lm = AutoModelForCausalLM.from_pretrained(built / "base")
    cfg = lm.config
    assert sum(p.numel() for p in lm.parameters()) == 813_696  # ~0.8M, as in demo.md
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (128, 3, 4)
    assert (cfg.vocab_size, cfg.max_position_embeddings, cfg.tie_word_embeddings) == (103, 256, False)
    assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (0, 1, 2)
    with torch.no_grad():
        logits = lm(ids).logits
        rm = AutoModelForSequenceClassification.from_pretrained(built / "base_rm")
        reward = rm(ids).logits
        critic = AutoModelForTokenClassification.from_pretrained(built / "base_critic")
        values = critic(ids).logits
    assert logits.shape == (1, 5, 103) and torch.isfinite(logits).all()
    assert rm.config.num_labels == 1 and rm.config.pad_token_id == 0 and reward.shape == (1, 1)
    assert critic.config.num_labels == 1 and values.shape == (1, 5, 1)
    # The reward model and the critic share the causal LM's backbone; only the heads are new.
    assert torch.equal(rm.model.embed_tokens.weight, lm.model.embed_tokens.weight)
    assert torch.equal(critic.model.layers[2].mlp.up_proj.weight, lm.model.layers[2].mlp.up_proj.weight)


def test_teacher_is_larger_with_the_students_tokenizer(built: Path) -> None:
    """On-policy distillation scores the student's tokens with the teacher: same vocabulary, same special
    tokens and chat template (the tokenizer files byte for byte), same context; a larger model."""
    student = AutoModelForCausalLM.from_pretrained(built / "base")
    teacher = AutoModelForCausalLM.from_pretrained(built / "base_teacher")
    s, t = student.config, teacher.config
    # embeddings and head 2 * 103 * 192 = 39,552, four layers of attention 4 * 192^2 = 147,456, MLP
    # 3 * 192 * 768 = 442,368 and two norms 384, the final norm 192: 2,400,576 (~3x the student's 813,696)
    assert sum(p.numel() for p in teacher.parameters()) == 2_400_576
    assert (t.hidden_size, t.intermediate_size, t.num_hidden_layers, t.num_attention_heads) == (
        192,
        768,
        4,
        6,
    )
    assert t.hidden_size > s.hidden_size and t.num_hidden_layers > s.num_hidden_layers
    for key in ("vocab_size", "max_position_embeddings", "tie_word_embeddings", "pad_token_id"):
        assert getattr(t, key) == getattr(s, key), key
    assert (t.bos_token_id, t.eos_token_id) == (s.bos_token_id, s.eos_token_id)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (built / "base_teacher" / name).read_bytes() == (built / "base" / name).read_bytes(), name
    ids = torch.tensor([[1, 5, 11, 12, 6]])
    with torch.no_grad():
        logits = teacher(ids).logits
    assert logits.shape == (1, 5, 103) and torch.isfinite(logits).all()


def test_data_files_load_with_ppo_data(built: Path) -> None:
    tok = AutoTokenizer.from_pretrained(built / "tokenizer")
    data = built / "data"
    train = load_prompts(data / "train.parquet", tok, max_prompt_length=64)
    assert len(train) == 4096 and len(load_prompts(data / "val.parquet", tok, max_prompt_length=64)) == 500
    assert max(len(r.input_ids) for r in train) == 10  # "<s><|user|>ab + cd<|assistant|>"
    assert train[0].data_source == "synthetic/arith" and train[0].extra_info == {
        "ability": "math",
        "split": "train",
        "index": 0,
    }  # ability: a top-level column
    sft = load_sft_examples(data / "sft_val.parquet", tok, max_length=64)
    assert len(sft) == 500
    # "ab + cd = r\n#### r" + EOS: 7 + 3 + 6 characters + 2 * len(r) + 1 = 21 (r = 71) or 23 (r = 128).
    assert all(sum(ex.loss_mask) == 17 + 2 * len(ex.extra["ground_truth"]) for ex in sft)
    pairs = load_preference_pairs(data / "pref_val.parquet", tok, max_length=64)
    assert len(pairs) == 500 and set(pairs[0].extra) == {"mistake", "ground_truth", "data_source"}


def test_sizes_and_val_disjoint_from_training(task: dict[str, list[dict[str, Any]]]) -> None:
    sizes = {name: len(rows) for name, rows in task.items()}
    assert sizes == {
        "train": 4096,
        "val": 500,
        "sft_train": 7600,
        "sft_val": 500,
        "pref_train": 4096,
        "pref_val": 500,
        "sft_tools_train": 7600,
        "sft_tools_val": 500,
        "teacher_sft_train": 7600,
        "teacher_sft_val": 500,
    }

    def problems(name: str) -> set[str]:
        return {row["prompt"][0]["content"] for row in task[name]}

    val = problems("val")
    assert len(val) == 500 and problems("sft_val") == val and problems("pref_val") == val
    for name in ("train", "sft_train", "pref_train"):
        assert not val & problems(name), name
    # 90 * 90 = 8100 ordered pairs; the 7600 not in validation are the SFT pool, 4096 of them RL prompts.
    assert len(problems("train")) == 4096 and len(problems("sft_train")) == 7600


def test_sft_train_forgets_60_percent_of_carries(
    assets: ModuleType, task: dict[str, list[dict[str, Any]]]
) -> None:
    carry, flawed_carry, flawed_other = 0, 0, 0
    for row in task["sft_train"]:
        a, b = (int(x) for x in row["prompt"][0]["content"].split(" + "))
        shown = int(row["answer"].rpartition("#### ")[2])
        assert row["answer"] == f"{a} + {b} = {shown}\n#### {shown}"
        assert shown == (a + b - 10 if row["flawed"] else a + b)  # a forgotten carry is off by ten
        if assets.needs_carry(a, b):
            carry += 1
            flawed_carry += row["flawed"]
        else:
            flawed_other += row["flawed"]
    assert flawed_other == 0
    assert abs(carry / 7600 - 0.45) < 0.02  # 45 of the 100 unit-digit pairs carry
    assert flawed_carry == round(0.6 * carry)
    assert all(
        not row["flawed"] and row["answer"].endswith(f"#### {row['ground_truth']}") for row in task["sft_val"]
    )


def test_teacher_demonstrations_are_the_students_problems_all_right(
    task: dict[str, list[dict[str, Any]]],
) -> None:
    for split in ("train", "val"):
        teacher, student = task[f"teacher_sft_{split}"], task[f"sft_{split}"]
        assert [r["prompt"] for r in teacher] == [r["prompt"] for r in student]  # same problems, same order
        for row in teacher:
            a, b = (int(x) for x in row["prompt"][0]["content"].split(" + "))
            assert not row["flawed"] and row["ground_truth"] == str(a + b)
            assert row["answer"] == f"{a} + {b} = {a + b}\n#### {a + b}"
    # The student's training file differs exactly on its forgotten carries: 60% of the 3430 carries of
    # seed 0's training pool, round(2058.0) = 2058.
    pairs = zip(task["teacher_sft_train"], task["sft_train"], strict=True)
    differ = [s["flawed"] for t, s in pairs if t["answer"] != s["answer"]]
    assert len(differ) == 2058 and all(differ)


def test_tool_demonstrations_call_the_calculator_in_40_percent(
    assets: ModuleType, task: dict[str, list[dict[str, Any]]]
) -> None:
    calculator = load_environment(f"{ROOT / 'configs' / 'calculator.py'}:Calculator")
    for plain, row in zip(task["sft_train"], task["sft_tools_train"], strict=True):
        assert row["prompt"] == plain["prompt"]
        if not row["tool"]:
            assert row["answer"] == plain["answer"] and row["flawed"] == plain["flawed"]
            continue
        a, b = (int(x) for x in row["prompt"][0]["content"].split(" + "))
        assert row["answer"] == f"<calc>{a}+{b}</calc><result>{a + b}</result>\n#### {a + b}"
        assert not row["flawed"]
        # What the demonstration shows after </calc> is exactly what the calculator answers.
        env = calculator()
        env.reset(row)
        action = row["answer"].partition("</calc>")[0] + "</calc>"
        assert env.step(action) == (f"<result>{a + b}</result>", 0.0, False)
    assert sum(r["tool"] for r in task["sft_tools_train"]) == round(0.4 * 7600)
    assert sum(r["tool"] for r in task["sft_tools_val"]) == 200


def test_preference_mistakes_even_and_scored_as_labelled(
    assets: ModuleType, task: dict[str, list[dict[str, Any]]]
) -> None:
    assert assets.DATA_SOURCE in RULE_DATA_SOURCES
    for name, per_kind in (("pref_train", 1024), ("pref_val", 125)):
        rows = task[name]
        assert collections.Counter(r["mistake"] for r in rows) == dict.fromkeys(
            assets.MISTAKE_KINDS, per_kind
        )
        for r in rows:
            truth = r["ground_truth"]
            assert default_compute_score(r["data_source"], r["chosen"], truth) == 1.0
            # Every rejected answer fails the rule; only broken_format has no readable answer at all.
            expected = 0.0 if r["mistake"] == "broken_format" else 0.5
            assert gsm8k_score(r["rejected"], truth, format_score=0.5) == expected, r
            worked = r["rejected"].split("\n")[0]
            if r["mistake"] == "slipped_carry":
                assert abs(int(worked.rpartition("= ")[2]) - int(truth)) == 10
            elif r["mistake"] == "wrong_final_line":
                assert (
                    worked.endswith(f"= {truth}")
                    and 1 <= abs(int(r["rejected"][-3:].strip("# ")) - int(truth)) <= 9
                )
            elif r["mistake"] == "far_off":
                assert abs(int(worked.rpartition("= ")[2]) - int(truth)) > 10


def test_make_assets_writes_the_offline_data_the_offline_demo_reads() -> None:
    """The ``assets`` target samples the groups configs/demo_cpu_offline.yaml trains on, with its group
    size and length limits (a longer response in the file would drop its whole group), in the folder
    ``ASSETS`` names by default."""
    makefile = ROOT.joinpath("Makefile").read_text()
    assert "\nASSETS ?= assets\n" in makefile and "\nA := $(ASSETS)\n" in makefile
    recipe = makefile.split("\nassets:")[1].split("\n\n")[0].replace("$(A)", "assets")
    lines = recipe.split("scripts/make_offline_data.py")[1].split("\n")
    end = next(i for i, line in enumerate(lines) if not line.rstrip().endswith("\\"))  # its last line
    command = " ".join(line.rstrip().removesuffix("\\") for line in lines[: end + 1]).split()
    options = dict(zip(command[::2], command[1::2], strict=True))
    cfg = load_config(ROOT / "configs" / "demo_cpu_offline.yaml")
    assert "rm -rf assets/runs assets/metrics.json assets/offline" in recipe  # no stale shards resumed
    assert options["--out"] in cfg.data.train_files and options["--model"] == cfg.model.path
    assert (cfg.rollout.source, cfg.rollout.offline_fraction, int(options["--k"])) == (
        "dataset",
        1.0,
        cfg.rollout.n,
    )
    assert int(options["--max-prompt-length"]) == cfg.data.max_prompt_length
    assert int(options["--max-response-length"]) == cfg.data.max_response_length
    assert options["--data"] == "assets/data/train.parquet" and "--reward-model" not in options  # the rule


def test_the_four_digit_task_forgets_half_of_each_carry(assets: ModuleType, built: Path) -> None:
    """The second task (``carry4/data``): 500 validation problems disjoint from the SFT pool, 4096 of its
    problems the RL prompts; each carry of a demonstration forgotten with chance 0.5, which makes the
    answer 10, 100 or 1000 too small per forgotten place; validation answers always right."""
    task = assets.make_carry4_task(0)
    assert {name: len(rows) for name, rows in task.items()} == {
        "train": 4096,
        "val": 500,
        "sft_train": 19498,  # 20000 draws of 81M pairs, 2 repeats dropped, 500 to validation
        "sft_val": 500,
    }
    for name in assets.CARRY4_FILES:  # what make_tiny_assets.py wrote is make_carry4_task(0)
        assert pq.read_table(built / "carry4" / "data" / f"{name}.parquet").to_pylist() == task[name], name

    def problems(name: str) -> set[str]:
        return {row["prompt"][0]["content"] for row in task[name]}

    assert not problems("val") & problems("sft_train") and problems("sft_val") == problems("val")
    assert problems("train") <= problems("sft_train")
    assert assets.carries(1999, 1) == [True, True, True] and assets.carries(1234, 4321) == [False] * 3
    assert assets.carries(1050, 1050) == [False, True, False]  # 5 + 5 in the tens: the hundreds get it
    places, forgotten = collections.Counter(), collections.Counter()
    for row in task["sft_train"]:
        a, b = (int(x) for x in row["prompt"][0]["content"].split(" + "))
        shown = int(row["answer"].rpartition("#### ")[2])
        assert 1000 <= a <= 9999 and 1000 <= b <= 9999
        assert row["answer"] == f"{a} + {b} = {shown}\n#### {shown}"
        missing = a + b - shown  # a sum of distinct powers of ten, one per forgotten carry
        digits = [int(d) for d in str(missing).zfill(4)[::-1]][1:]  # tens, hundreds, thousands
        assert set(digits) <= {0, 1} and missing % 10 == 0 and sum(digits) == row["forgotten"]
        for place, carried in enumerate(assets.carries(a, b)):
            places[place] += carried
            forgotten[place] += carried and digits[place]
            assert carried or not digits[place]  # only a carry can be forgotten
    for place in range(3):
        assert abs(forgotten[place] / places[place] - 0.5) < 0.02, place
    assert all(row["forgotten"] == 0 for row in task["sft_val"])
    # Greedy decoding that forgets every carry gets only the problems without one right: 0.164.
    no_carry = sum(not any(assets.carries(*map(int, p.split(" + ")))) for p in problems("val"))
    assert no_carry == 82
