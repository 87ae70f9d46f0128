"""How runs end and rerun, through the entry points: the end-of-run summary, the legend before the first
step line, a stage stopped early saying so in its final numbers, a finished stage rerun saying it has
nothing to train, and a TRL-shaped prompt file with a TRL-style batched reward function."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from ppo.metrics import CONSOLE_LEGEND
from tests.helpers import base_args, load_script, read_metrics, run

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def test_ppo_run_ends_with_a_summary_and_a_rerun_says_so(
    tiny_assets: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "run"
    args = base_args(tiny_assets, out, steps=1) + [
        "trainer.val_before_train=false",
        "trainer.save_hf_on_end=true",
        "trainer.save_freq=1",
        "trainer.test_freq=1",
    ]
    with caplog.at_level(logging.INFO, logger="ppo"):
        assert run(args) == 0
    lines = messages(caplog)
    first_step = next(i for i, m in enumerate(lines) if "] step 1/1 " in m)
    assert lines[first_step - 1] == CONSOLE_LEGEND
    # start-up phases say what they do; the critic's expected missing head is one line, not a report
    phases = [m.split(" ", 2)[1] for m in lines if m.startswith("start-up")]
    assert phases[:4] == ["loading", "tokenizing", "tokenizing", "loading"]  # tokenizer, train, val, actor
    assert "start-up done: training from step 1 (a step: rollout, score, update)" in lines
    assert not any("LOAD REPORT" in m for m in lines)
    assert any("initialized score.bias, score.weight to zero" in m for m in lines)
    end = lines.index(next(m for m in lines if m.startswith("run done: ")))
    assert lines[end].startswith("run done: step 1 of 1 (1 in this process, ")
    assert lines[end + 1].startswith("final validation: val/score=")  # the last step validates
    assert lines[end + 2] == f"last checkpoint: {out / 'checkpoints' / 'step_00000001'}"
    assert lines[end + 3] == f"exported model (save_pretrained): {out / 'hf'}"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ppo"):
        assert run(args) == 0  # finished: resumes at its last step, trains nothing, says so twice
    lines = messages(caplog)
    assert any("resumed at step 1, and the run ends at step 1: nothing to train" in m for m in lines)
    assert any(m.startswith("run done: step 1 of 1 (0 in this process, ") for m in lines)


def test_stage_stopped_early_says_so_and_a_finished_rerun_warns(
    tiny_assets: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sft = load_script("train_sft")
    out = tmp_path / "sft"
    d = tiny_assets / "data"
    args = [
        f"model.path={tiny_assets / 'base'}",
        f"data.train_files={d / 'sft_train.parquet'}",
        f"data.val_files={d / 'sft_val.parquet'}",
        "data.train_batch_size=16",
        "data.max_length=40",
        "trainer.device=cpu",
        "trainer.logger=[jsonl]",
        f"trainer.output_dir={out}",
        "trainer.total_training_steps=3",
        "trainer.save_freq=1",
    ]
    with caplog.at_level(logging.INFO, logger="ppo"):
        assert sft.main([*args, "trainer.max_time_s=1e-9"]) == 0  # stops after its first step
    final = json.loads((out / "metrics.json").read_text())
    assert (final["sft_stopped_early"], final["sft_steps"], final["sft_steps_planned"]) == (True, 1, 3)
    assert any(
        m.startswith("run stopped early (trainer.max_time_s=1e-09): step 1 of 3") for m in messages(caplog)
    )
    assert sft.main([*args, "trainer.resume_mode=auto"]) == 0
    final = json.loads((out / "metrics.json").read_text())
    assert (final["sft_stopped_early"], final["sft_steps"], final["sft_steps_planned"]) == (False, 3, 3)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ppo"):
        assert sft.main([*args, "trainer.resume_mode=auto"]) == 0
    lines = messages(caplog)
    assert any("resumed at step 3, and the run ends at step 3: nothing to train" in m for m in lines)
    assert any(m.startswith("run done: step 3 of 3 (0 in this process, ") for m in lines)


TRL_REWARD = '''
import json


def accuracy(prompts, completions, ground_truth, solution, log, **kwargs):
    """TRL's shape: lists in, a list of floats out; every call logged."""
    with open(log, "a") as f:
        f.write(json.dumps({"n": len(completions), "ground_truth": ground_truth, "solution": solution}) + "\\n")
    return [0.0 for _ in completions]
'''


def test_trl_prompt_file_and_batched_reward_function(
    tiny_assets: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A JSON-lines file with prompt, ground_truth and solution (no data_source, no reward_model) and
    ``f(prompts, completions, ground_truth, solution, **kwargs)``: one call per step with the 8 responses
    and their rows' columns; rewards that stay 0 warn once at step 3."""
    rows = [
        {
            "prompt": [{"role": "user", "content": f"{a} + {a + 1}"}],
            "ground_truth": str(2 * a + 1),
            "solution": f"s{a}",
        }
        for a in range(8)
    ]
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(json.dumps(r) for r in rows))
    fn, log = tmp_path / "trl_reward.py", tmp_path / "calls.jsonl"
    fn.write_text(TRL_REWARD)
    out = tmp_path / "run"
    args = base_args(tiny_assets, out, steps=3) + [
        f"data.train_files={train}",
        "data.val_files=[]",
        "trainer.val_before_train=false",
        f"reward.custom_function={fn}:accuracy",
        f"reward.reward_kwargs={{log: {log}}}",
        "data.shuffle=false",
    ]
    with caplog.at_level(logging.WARNING, logger="ppo"):
        assert run(args) == 0
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    # the start-up check (one row, an empty response), then one call per step: 4 prompts x 2 responses
    assert [c["n"] for c in calls] == [1, 8, 8, 8]
    assert calls[1]["ground_truth"] == ["1", "1", "3", "3", "5", "5", "7", "7"]
    assert calls[1]["solution"] == ["s0", "s0", "s1", "s1", "s2", "s2", "s3", "s3"]
    metrics = read_metrics(out)
    assert [r.get("warn/zero_rewards") for r in metrics] == [None, None, 1.0]
    assert sum("scored 0: the reward function never matches" in m for m in messages(caplog)) == 1
