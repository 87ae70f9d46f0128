"""The Makefile's demo targets: ``make demo`` uses assets that exist, ``make demo-resume`` continues the
PPO demo, ``make assets``' summary says when a stage stopped before its planned steps, and ``make assets``
and ``make teacher`` train the distillation teacher alike."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from ppo.config import SFTConfig
from ppo.config_loader import load_config
from tests.helpers import ROOT, load_script

MAKEFILE = (ROOT / "Makefile").read_text()


def recipe(target: str) -> str:
    return MAKEFILE.split(f"\n{target}:")[1].split("\n\n")[0]


def variable(name: str) -> str:
    """The value of ``name := value`` (continued lines joined with one space)."""
    value = MAKEFILE.split(f"\n{name} := ")[1]
    lines = [value.split("\n")[0]]
    while lines[-1].endswith("\\"):
        value = value.split("\n", 1)[1]
        lines[-1] = lines[-1].removesuffix("\\").rstrip()
        lines.append(value.split("\n")[0].strip())
    return " ".join(lines)


def expand(text: str) -> str:
    """``text`` with the Makefile's ``$(NAME)`` variables of ``:=`` replaced by their values, recursively;
    ``$(A)`` (the assets folder) stays."""

    def value(m: re.Match) -> str:
        return expand(variable(m[1])) if m[1] != "A" and f"\n{m[1]} := " in MAKEFILE else m[0]

    return re.sub(r"\$\((\w+)\)", value, text)


def config_and_overrides(command: str) -> tuple[str, dict[str, str]]:
    """A recipe line's ``--config`` file and its ``key=value`` overrides, the Makefile's variables expanded."""
    words = expand(command).split()
    overrides = dict(word.split("=", 1) for word in words if "=" in word and not word.startswith("--"))
    return words[words.index("--config") + 1], overrides


def test_demo_does_not_rebuild_existing_assets() -> None:
    assert recipe("demo").splitlines()[0].split() == ["check-assets"]
    check = recipe("check-assets")
    assert (
        "test -d $(A)/sft -a -d $(A)/rm -a -d $(A)/teacher -a -d $(A)/carry4/sft -a -f $(A)/metrics.json"
        in check
    )
    assert "$(MAKE) assets" in check
    assert "trainer.resume_mode=auto" in recipe("demo-resume") and "overwrite" not in recipe("demo-resume")


def summary(tmp_path: Path, metrics: dict, target: str = "assets") -> str:
    """Run the summary (the python -c line) of ``make assets`` or ``make teacher`` on ``metrics`` as
    assets/metrics.json."""
    code = recipe(target).split('-c "', 1)[1].rsplit('"', 1)[0].replace("\\\n\t", "\n").replace("\\\n", "\n")
    code = expand(code).replace("$(A)", str(tmp_path))
    (tmp_path / "metrics.json").write_text(json.dumps(metrics))
    (tmp_path / "carry4").mkdir(exist_ok=True)  # the second task's SFT numbers (the same keys)
    (tmp_path / "carry4" / "metrics.json").write_text(json.dumps(metrics | {"sft_val_accuracy": 0.3}))
    # the recipe's lines end with "; " before a line break: one statement per line either way
    lines = [line.strip().removesuffix(";").strip() for line in code.splitlines()]
    return subprocess.run(
        [sys.executable, "-c", "\n".join(lines)], capture_output=True, text=True, check=True
    ).stdout


METRICS = {
    "sft_val_accuracy": 0.5,
    "sft_sample_accuracy": 0.4,
    "sft_eval_samples_per_prompt": 4,
    "sft_pass_at_k": 0.7,
    "sft_eval_prompts": 100,
    "sft_steps": 12,
    "sft_steps_planned": 40,
    "sft_stopped_early": True,
    "sft_train_time_s": 30.0,
    "rm_val_accuracy": 0.9,
    "rm_val_margin": 1.5,
    "rm_steps": 20,
    "rm_steps_planned": 20,
    "rm_stopped_early": False,
    "rm_train_time_s": 10.0,
    "rm_val_accuracy_by_mistake": {"carry": 0.8},
    "offline_groups": 2048,
    "offline_group_size": 4,
    "offline_prompts": 2048,
    "offline_mean_score": 0.5,
    "offline_unequal_share": 0.6,
    "offline_time_s": 60.0,
    "teacher_val_accuracy": 0.98,
    "teacher_sample_accuracy": 0.9,
    "teacher_eval_samples_per_prompt": 4,
    "teacher_pass_at_k": 0.99,
    "teacher_eval_prompts": 100,
    "teacher_steps": 650,
    "teacher_steps_planned": 650,
    "teacher_stopped_early": False,
    "teacher_train_time_s": 130.0,
}


def test_assets_summary_names_a_stage_stopped_early(tmp_path: Path) -> None:
    out = summary(tmp_path, METRICS).splitlines()
    assert out[0].endswith(
        "(100 val problems; 12 steps in 30 s; STOPPED EARLY after 12 of 40 steps: resume it with "
        "trainer.resume_mode=auto)"
    )
    assert out[1].endswith("(20 steps in 10 s)")
    older = {k: v for k, v in METRICS.items() if "planned" not in k and "early" not in k}
    assert summary(tmp_path, older).splitlines()[0].endswith("(100 val problems; 12 steps in 30 s)")


def test_assets_summary_and_make_teacher_print_the_teacher(tmp_path: Path) -> None:
    line = (
        f"teacher model {tmp_path}/teacher: greedy accuracy 0.980, one sample at T=1 0.900, pass@4 0.990 "
        "(100 val problems; 650 steps in 130 s)"
    )
    out = summary(tmp_path, METRICS).splitlines()
    assert out[-4:] == [
        line,
        f"four-digit SFT {tmp_path}/carry4/sft: greedy accuracy 0.300, one sample at T=1 0.400, pass@4 0.700 "
        "(12 steps in 30 s; STOPPED EARLY after 12 of 40 steps: resume it with trainer.resume_mode=auto)",
        f"four-digit offline data {tmp_path}/carry4/offline: 2048 groups of 4, mean rule score 0.500, "
        "0.60 of groups with unequal scores (60 s)",
        f"all numbers: {tmp_path}/metrics.json, {tmp_path}/carry4/metrics.json",
    ]
    assert summary(tmp_path, METRICS, "teacher").splitlines() == [line]
    stopped = METRICS | {"teacher_steps": 300, "teacher_stopped_early": True}
    assert summary(tmp_path, stopped, "teacher").endswith(
        "300 steps in 130 s; STOPPED EARLY after 300 of 650 steps: resume it with trainer.resume_mode=auto)\n"
    )


def test_make_assets_and_make_teacher_train_the_teacher_alike() -> None:
    """Both train configs/sft_teacher_demo.yaml on the files make_tiny_assets.py writes for it, into the
    folder check-assets requires, with the assets' seed; its numbers go to teacher_* keys, never over the
    student's sft_* in the same metrics.json."""
    assets_lines = [line.strip() for line in recipe("assets").splitlines()]
    teacher_lines = [line.strip() for line in recipe("teacher").splitlines()]
    student = next(i for i, line in enumerate(assets_lines) if "configs/sft_demo.yaml" in line)
    assert assets_lines[student + 1] == "$(TRAIN_TEACHER)"  # after the student's SFT
    assert teacher_lines[1:4] == [
        "rm -rf $(A)/runs/teacher",
        "$(PY) scripts/make_tiny_assets.py --out $(A) --seed $(SEED) --teacher-only",
        "$(TRAIN_TEACHER)",
    ]
    config, overrides = config_and_overrides(variable("TRAIN_TEACHER"))
    assert config == "configs/sft_teacher_demo.yaml"
    assert overrides == {
        "model.path": "$(A)/base_teacher",
        "data.train_files": "[$(A)/data/teacher_sft_train.parquet]",
        "data.val_files": "[$(A)/data/teacher_sft_val.parquet]",
        "data.eval_prompt_files": "[$(A)/data/val.parquet]",
        "trainer.output_dir": "$(A)/runs/teacher",
        "trainer.save_path": "$(A)/teacher",
        "trainer.seed": "$(SEED)",
    }
    assert set(load_script("make_tiny_assets").TEACHER_FILES) == {"teacher_sft_train", "teacher_sft_val"}
    cfg = load_config(ROOT / "configs" / "sft_teacher_demo.yaml", [], SFTConfig)
    assert cfg.trainer.metrics_prefix == "teacher"  # the save folder's parent holds the student's too
    assert cfg.model.path == "assets/base_teacher" and cfg.trainer.save_path == "assets/teacher"


def test_make_assets_and_make_carry4_train_the_second_task_on_the_files_they_write(tmp_path: Path) -> None:
    """The four-digit task's SFT (configs/sft_carry4_demo.yaml) reads the files make_tiny_assets.py writes
    under carry4/data and saves where configs/demo_cpu_carry4.yaml starts and check-assets looks; its
    numbers go to carry4/metrics.json, not over the first task's. ``make carry4`` writes only those files
    and trains the same way."""
    from ppo.config import PPOConfig

    assets_lines = [line.strip() for line in recipe("assets").splitlines()]
    assert "$(TRAIN_CARRY4)" in assets_lines
    assert assets_lines.index("$(OFFLINE_CARRY4)") > assets_lines.index("$(TRAIN_CARRY4)")
    assert "$(A)/carry4/offline" in recipe("assets").split("$(PY)")[0]  # removed before a rebuild
    assert [line.strip() for line in recipe("carry4").splitlines()][1:5] == [
        "rm -rf $(A)/carry4/runs $(A)/carry4/metrics.json $(A)/carry4/offline",
        "$(PY) scripts/make_tiny_assets.py --out $(A) --seed $(SEED) --carry4-only",
        "$(TRAIN_CARRY4)",
        "$(OFFLINE_CARRY4)",
    ]
    assert summary(tmp_path, METRICS, "carry4").splitlines() == [
        f"four-digit SFT {tmp_path}/carry4/sft: greedy accuracy 0.300, one sample at T=1 0.400, pass@4 0.700 "
        "(12 steps in 30 s; STOPPED EARLY after 12 of 40 steps: resume it with trainer.resume_mode=auto)",
        f"four-digit offline data {tmp_path}/carry4/offline: 2048 groups of 4, mean rule score 0.500, "
        "0.60 of groups with unequal scores (60 s)",
    ]
    offline = variable("OFFLINE_CARRY4")  # the four-digit SFT model's samples of its own training prompts
    for option in (
        "--model $(A)/carry4/sft",
        "--data $(A)/carry4/data/train.parquet",
        "--out $(A)/carry4/offline/train.parquet",
        "--max-response-length 32",
        "--seed $(SEED)",
        "--metrics $(A)/carry4/metrics.json",
    ):
        assert option in " ".join(offline.split()), option
    config, overrides = config_and_overrides(variable("TRAIN_CARRY4"))
    assert config == "configs/sft_carry4_demo.yaml"
    assert overrides == {
        "model.path": "$(A)/base",
        "data.train_files": "[$(A)/carry4/data/sft_train.parquet]",
        "data.val_files": "[$(A)/carry4/data/sft_val.parquet]",
        "data.eval_prompt_files": "[$(A)/carry4/data/val.parquet]",
        "trainer.output_dir": "$(A)/carry4/runs/sft",
        "trainer.save_path": "$(A)/carry4/sft",
        "trainer.seed": "$(SEED)",
    }
    assert set(load_script("make_tiny_assets").CARRY4_FILES) == {"train", "val", "sft_train", "sft_val"}
    sft = load_config(ROOT / "configs" / "sft_carry4_demo.yaml", [], SFTConfig)
    ppo = load_config(ROOT / "configs" / "demo_cpu_carry4.yaml", [], PPOConfig)
    assert (sft.trainer.save_path, ppo.model.path) == ("assets/carry4/sft", "assets/carry4/sft")
    assert ppo.data.train_files == ["assets/carry4/data/train.parquet"]
    assert "$(A)/carry4/sft" in recipe("check-assets")
