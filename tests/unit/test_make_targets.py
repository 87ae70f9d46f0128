"""The Makefile's demo targets: ``make demo`` uses assets that exist, ``make demo-resume`` continues the
PPO demo, and ``make assets``' summary says when a stage stopped before its planned steps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT

MAKEFILE = (ROOT / "Makefile").read_text()


def recipe(target: str) -> str:
    return MAKEFILE.split(f"\n{target}:")[1].split("\n\n")[0]


def test_demo_does_not_rebuild_existing_assets() -> None:
    assert recipe("demo").splitlines()[0].split() == ["check-assets"]
    check = recipe("check-assets")
    assert "test -d $(A)/sft -a -d $(A)/rm -a -f $(A)/metrics.json" in check and "$(MAKE) assets" in check
    assert "trainer.resume_mode=auto" in recipe("demo-resume") and "overwrite" not in recipe("demo-resume")


def summary(tmp_path: Path, metrics: dict) -> str:
    """Run ``make assets``' summary (its python -c line) on ``metrics`` as assets/metrics.json."""
    code = (
        recipe("assets").split('-c "', 1)[1].rsplit('"', 1)[0].replace("\\\n\t", "\n").replace("\\\n", "\n")
    )
    code = code.replace("$(A)", str(tmp_path))
    (tmp_path / "metrics.json").write_text(json.dumps(metrics))
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
