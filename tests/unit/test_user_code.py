"""User code and user folders that hang, exit or lie: each case ends in one line naming what to fix,
and nothing a user had is replaced without an explicit request that says what it replaces."""

from __future__ import annotations

import errno
import json
import math
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import GenerationConfig

from ppo import checkpoint_files, run_folder
from ppo.checkpoint_files import CheckpointError
from ppo.config import ConfigError, MultiTurnConfig, RolloutConfig
from ppo.config_loader import load_config, to_yaml
from ppo.data import PromptRecord
from ppo.environments import EnvError
from ppo.metrics import MetricsLogger
from ppo.multi_turn import MultiTurn, make_settings
from ppo.reward_pool import RewardPool
from ppo.rewards import rule_scores
from ppo.rollout import Sampler, sample
from ppo.rule_scoring import RewardError, make_rule_scorer
from tests.helpers import REWARD_FNS, load_script, waiting_env

export_hf = load_script("export_hf")


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if " ERROR " in line]


# ----------------------------------------------------------------------------------------------------
# scripts/export_hf.py never writes over a folder that holds files without --overwrite
# ----------------------------------------------------------------------------------------------------


def fake_checkpoint(tiny_assets: Path, tmp_path: Path) -> Path:
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000001"
    ckpt.mkdir(parents=True)
    cfg = load_config(None, [f"model.path={tiny_assets / 'base'}"])
    (ckpt / "config.yaml").write_text(to_yaml(cfg))
    return ckpt


def test_export_refuses_a_folder_holding_a_model(tiny_assets: Path, tmp_path: Path, capsys: Any) -> None:
    ckpt = fake_checkpoint(tiny_assets, tmp_path)
    other = tmp_path / "other_model"
    other.mkdir()
    (other / "model.safetensors").write_bytes(b"weights of another model")
    (other / "config.json").write_text('{"model_type": "other"}')
    assert export_hf.main([str(ckpt), str(other)]) == 2
    errors = error_lines(capsys.readouterr().err)
    assert len(errors) == 1, errors
    assert f"{other} already holds files (config.json, model.safetensors)" in errors[0]
    assert "pass --overwrite" in errors[0]
    assert (other / "model.safetensors").read_bytes() == b"weights of another model"
    assert (other / "config.json").read_text() == '{"model_type": "other"}'


def test_export_overwrite_names_what_it_replaces(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "hf"
    (out / "critic").mkdir(parents=True)
    (out / "model.safetensors").write_bytes(b"x")
    (out / "critic" / "config.json").write_text("{}")
    export_hf.claim_out_dir(tmp_path / "empty", with_critic=True, overwrite=False)  # nothing there: fine
    with caplog.at_level("WARNING", logger="ppo"):
        export_hf.claim_out_dir(out, with_critic=True, overwrite=True)
    assert caplog.messages == [
        f"--overwrite: the export writes over model.safetensors, critic/config.json in {out}"
    ]


# ----------------------------------------------------------------------------------------------------
# A run folder with checkpoints: the advice that loses nothing comes first; what overwrite deletes is named
# ----------------------------------------------------------------------------------------------------


def run_folder_with_checkpoints(out: Path, steps: tuple[int, ...] = (2, 4)) -> None:
    for step in steps:
        ckpt = checkpoint_files.checkpoints_dir(out) / f"step_{step:08d}"
        (ckpt / "dcp").mkdir(parents=True)
        (ckpt / "dcp" / ".metadata").write_bytes(b"")
        (ckpt / checkpoint_files.COMPLETE).write_text("")
    (checkpoint_files.checkpoints_dir(out) / "latest").write_text(f"step_{steps[-1]:08d}")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')


def folder_config(tiny_assets: Path, out: Path, *overrides: str) -> Any:
    return load_config(None, [f"model.path={tiny_assets / 'base'}", f"trainer.output_dir={out}", *overrides])


def test_a_fresh_start_on_checkpoints_offers_resume_first(tiny_assets: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    run_folder_with_checkpoints(out)
    with pytest.raises(CheckpointError) as e:
        run_folder.claim(folder_config(tiny_assets, out, "trainer.resume_mode=disable"))
    assert str(e.value) == (
        f"trainer.output_dir={out} already holds a run with 2 checkpoints (steps 2, 4) and "
        "trainer.resume_mode=disable does not resume them: set trainer.resume_mode=auto to resume from step 4, "
        "or choose another trainer.output_dir (trainer.overwrite=true would delete those checkpoints and "
        "metrics.jsonl)"
    )
    assert len(checkpoint_files.complete_checkpoints(out)) == 2


def test_overwrite_names_the_checkpoints_before_deleting_them(
    tiny_assets: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    run_folder_with_checkpoints(out, steps=(3,))
    warned_first = []
    rmtree = run_folder.shutil.rmtree
    monkeypatch.setattr(
        run_folder.shutil, "rmtree", lambda path: (warned_first.append(bool(caplog.messages)), rmtree(path))
    )
    cfg = folder_config(tiny_assets, out, "trainer.resume_mode=disable", "trainer.overwrite=true")
    with caplog.at_level("WARNING", logger="ppo"):
        run_folder.claim(cfg)
    assert caplog.messages == [
        f"trainer.overwrite=true: deleting the earlier run's 1 checkpoint (step 3), metrics.jsonl in {out}"
    ]
    assert warned_first == [True] and not (out / "checkpoints").exists()


def test_a_failed_save_names_the_intact_checkpoint_and_resume_mode(tmp_path: Path) -> None:
    run_folder_with_checkpoints(tmp_path, steps=(2,))
    with pytest.raises(CheckpointError) as e, checkpoint_files._failures_named(tmp_path, 3):
        raise OSError(errno.ENOSPC, "No space left on device")
    assert str(e.value).endswith(
        "the previous checkpoint (step 2) is intact: free space or fix the folder, then rerun with "
        "trainer.resume_mode=auto to resume from it"
    )


# ----------------------------------------------------------------------------------------------------
# A reward function that exits: one line naming the function and the row, in process and in workers
# ----------------------------------------------------------------------------------------------------


def rows(n: int) -> list[PromptRecord]:
    return [
        PromptRecord(
            input_ids=[1], prompt_text="p", data_source="d", ground_truth="g", extra_info={}, index=40 + i
        )
        for i in range(n)
    ]


def test_a_reward_function_calling_sys_exit_is_a_reward_error() -> None:
    spec = f"{REWARD_FNS}:exits"
    with pytest.raises(RewardError) as e:
        rule_scores(make_rule_scorer(spec, 0.0), rows(2), ["", "an answer"])
    assert str(e.value) == (
        f"reward.custom_function={spec!r} raised SystemExit: 0 (data_source='d', response 'an answer'); a "
        "reward function must return a score, not exit the process; prompt row 41"
    )


def test_a_reward_worker_calling_sys_exit_is_a_counted_error() -> None:
    spec = f"{REWARD_FNS}:exits"
    pool = RewardPool(
        custom_function=spec,
        format_score=0.0,
        reward_kwargs={},
        num_workers=1,
        timeout_s=30.0,
        error_score=-1.0,
    )
    try:
        out = pool.score(rows(2), ["", "an answer"])
    finally:
        pool.close()
    assert (out.scored[1], out.timeouts, out.errors) == (None, 0, 1)
    assert out.first is not None and out.first.startswith(
        f"prompt row 41 (d): reward.custom_function={spec!r} raised SystemExit: 0"
    )


# ----------------------------------------------------------------------------------------------------
# reward.timeout_s holds in the trainer's process too
# ----------------------------------------------------------------------------------------------------


def test_an_in_process_reward_call_past_its_timeout_stops_with_one_line() -> None:
    spec = f"{REWARD_FNS}:hangs_on_seven"  # sleeps an hour on a response with a 7
    scorer = make_rule_scorer(spec, 0.0, timeout_s=0.5)
    with pytest.raises(RewardError) as e:
        rule_scores(scorer, rows(2), ["12", "x7"])
    assert str(e.value) == (
        f"reward.custom_function={spec!r} ran longer than reward.timeout_s=0.5 (data_source='d', response "
        "'x7'); to score such calls reward.error_score and train on, set reward.pool_workers=1 or more; "
        "prompt row 41"
    )
    # the limit is per call and is lifted after it: a later call and a later sleep are not cut short
    assert rule_scores(scorer, rows(1), ["12"])[0].tolist() == [1.0]
    time.sleep(0.7)


# ----------------------------------------------------------------------------------------------------
# Multi-turn environments: concurrent steps under one deadline, exits and NaN named, cheap observations,
# the class checked at start-up
# ----------------------------------------------------------------------------------------------------

EOS, PAD = 2, 0


class OneCall(torch.nn.Module):
    """A "model" whose every turn writes ``<calc>1+1</calc>`` for every row (the turn loop without sampling)."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.ids = tokenizer.encode("<calc>1+1</calc>", add_special_tokens=False)
        self.generation_config = GenerationConfig()

    def generate(self, input_ids: torch.Tensor, generation_config: Any, **_: Any) -> torch.Tensor:
        new = torch.tensor([self.ids[: generation_config.max_new_tokens]] * input_ids.shape[0])
        return torch.cat([input_ids, new], dim=1)


class Env:
    def reset(self, row: dict) -> None:
        pass

    def step(self, action: str) -> tuple[str, float, bool]:
        return " ok", 0.5, True


def meeting_env(meeting: threading.Barrier) -> type[Env]:
    """An environment whose ``step`` answers once ``meeting.parties`` calls are inside ``step`` together
    (a ``BrokenBarrierError`` after the barrier's timeout)."""

    class Meets(Env):
        def step(self, action: str) -> tuple[str, float, bool]:
            meeting.wait()
            return " ok", 0.5, True

    return Meets


class Exits(Env):
    def step(self, action: str) -> tuple[str, float, bool]:
        sys.exit(3)


class NanReward(Env):
    def step(self, action: str) -> tuple[str, float, bool]:
        return " ok", math.nan, False


class Huge(Env):
    def step(self, action: str) -> tuple[str, float, bool]:
        return "1 " * 2_500_000, 0.0, True  # 5 MB


class BadReset(Env):
    def reset(self, row: dict) -> None:
        raise ValueError("no such task")


class CountingTokenizer:
    """The tiny tokenizer, recording the length of every text it encodes."""

    def __init__(self, tok: Any) -> None:
        self.tok, self.encoded = tok, []

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        self.encoded.append(len(text))
        return self.tok.encode(text, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tok, name)


def turn_settings(tok: Any, env: type, **over: Any) -> MultiTurn:
    values = dict(env_class=env, tokenizer=tok, max_turns=2, max_tool_response_length=32, step_timeout_s=5.0,
                  stop=["</calc>"], max_response_length=64)  # fmt: skip
    return MultiTurn(**{**values, **over})


def turns(tok: Any, settings: MultiTurn, n: int = 1) -> dict[str, float]:
    ids = tok.encode("47 + 38", add_special_tokens=False)
    recs = [PromptRecord(input_ids=ids, prompt_text="47 + 38", data_source="synthetic/arith", ground_truth="85",
                         extra_info={}, index=i) for i in range(n)]  # fmt: skip
    sampler = Sampler(actor=OneCall(tok), engine=None, settings=RolloutConfig(), eos_ids=[EOS], pad_token_id=PAD,
                      max_response_length=settings.max_response_length, multi_turn=settings)  # fmt: skip
    rollout = sample(sampler, recs, do_sample=False, micro_batch_size=8)
    return {k: v.sum().item() for k, v in rollout.turn_stats.items()}


def test_stuck_steps_time_out_and_are_logged(tok: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Six steps that never answer: the turn ends with none of them returned (it waited for none), each
    counted as a timeout, and one warning names the rows."""
    calls: list[str] = []
    release = threading.Event()
    try:
        with caplog.at_level("WARNING", logger="ppo"):
            counts = turns(
                tok, turn_settings(tok, waiting_env(Env, calls, release, done=True), step_timeout_s=1.0), n=6
            )
        assert "end" not in calls
    finally:
        release.set()  # the abandoned calls end
    assert counts["step_timeouts"] == 6.0
    assert caplog.messages == [
        "6 of 6 environment steps ran longer than rollout.multi_turn.step_timeout_s=1.0 (prompt rows 0, 1, 2, "
        "3, 4, 5); their trajectories end with reward 0"
    ]


def test_a_turns_steps_run_at_once(tok: Any) -> None:
    """Each of the turn's six steps answers only once all six are inside ``step``: run one at a time, the
    first would wait for the others until the barrier broke (an error) or its step_timeout_s ran out (a
    timeout). So a turn's stuck steps cost one deadline, not one each; the seconds are measured by
    ``python -m ppo_bench.stops``."""
    meeting = threading.Barrier(6, timeout=30)  # only so that steps run one at a time fail, not hang
    counts = turns(tok, turn_settings(tok, meeting_env(meeting), step_timeout_s=30.0), n=6)
    assert counts["step_timeouts"] == 0.0 and counts["tool_calls"] == 6.0


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (Exits, "Exits.step raised SystemExit: 3 (prompt row 0, action '<calc>1+1</calc>')"),
        (NanReward, "NanReward.step returned reward nan; rewards must be finite numbers (prompt row 0, action "
                    "'<calc>1+1</calc>')"),
        (BadReset, "BadReset.reset raised ValueError: no such task (prompt row 0)"),
    ],
)  # fmt: skip
def test_an_environment_that_exits_or_lies_is_named_with_its_row(tok: Any, env: type, message: str) -> None:
    with pytest.raises(EnvError) as e:
        turns(tok, turn_settings(tok, env))
    assert str(e.value) == message


def test_a_huge_observation_is_cut_before_it_is_tokenized(tok: Any) -> None:
    counting = CountingTokenizer(tok)
    settings = turn_settings(counting, Huge, max_token_chars=16)
    counts = turns(tok, settings)
    assert max(counting.encoded) == (32 + 1) * 16  # not 5,000,000 characters
    assert counts["observation_truncations"] == 1.0


def test_an_environment_class_is_checked_at_start_up(tok: Any, tmp_path: Path) -> None:
    path = tmp_path / "envs.py"
    path.write_text(
        "class NeedsArgs:\n    def __init__(self, tools):\n        self.tools = tools\n"
        "    def reset(self, row):\n        return None\n    def step(self, text):\n        return '', 0.0, True\n"
    )
    config = MultiTurnConfig(enable=True, env=f"{path}:NeedsArgs", stop=["</calc>"])
    with pytest.raises(EnvError) as e:
        make_settings(config, tok, 64)
    assert str(e.value) == (
        f"rollout.multi_turn.env='{path}:NeedsArgs': NeedsArgs() raised TypeError: NeedsArgs.__init__() missing 1 "
        "required positional argument: 'tools' (the class is instantiated with no arguments, one per trajectory; "
        "reset(row) gets the row)"
    )
    # No stop strings: the environment would never be called; refused with the config, before start-up.
    with pytest.raises(ConfigError, match=r"^enable=true with no stop strings: a turn ends at a stop string"):
        MultiTurnConfig(enable=True, env=f"{path}:NeedsArgs")


# ----------------------------------------------------------------------------------------------------
# metrics.jsonl is strict JSON; a reward dict's text is named once; a torn last line is skipped
# ----------------------------------------------------------------------------------------------------


def test_nan_metrics_are_written_as_null(tmp_path: Path) -> None:
    log = MetricsLogger(tmp_path, ["jsonl"], is_main=True, total_steps=2, generations=True)
    log.log(1, {"reward/extra/acc": math.nan, "critic/score/mean": 0.5, "x": math.inf})
    log.log_generations(1, [{"prompt": "p", "response": "r", "score": math.nan}])
    log.close()

    def strict(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line, parse_constant=strict) for line in lines] == [
        {"step": 1, "critic/score/mean": 0.5, "reward/extra/acc": None, "x": None}
    ]
    generations = (tmp_path / "generations.jsonl").read_text().splitlines()
    assert json.loads(generations[0], parse_constant=strict) == {
        "step": 1, "prompt": "p", "response": "r", "score": None
    }  # fmt: skip


def test_a_text_field_of_a_reward_dict_is_named_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spec = f"{REWARD_FNS}:keyword_order"  # {"score", "digits", "long": bool, "note": "text is not logged"}
    scorer = make_rule_scorer(spec, 0.0)
    with caplog.at_level("WARNING", logger="ppo"):
        _, metrics = rule_scores(scorer, rows(3), ["12", "1234567", "ab"])
        rule_scores(scorer, rows(1), ["9"])
    assert caplog.messages == [
        f"reward.custom_function={spec!r} returned 'text is not logged' for key 'note', not a number: it is "
        "not logged as reward/extra/note (warned once)"
    ]
    assert metrics == {
        "reward/extra/digits": pytest.approx((1.0 + 1.0 + 0.0) / 3),
        "reward/extra/long": 1 / 3,
    }


def test_plot_run_skips_a_torn_last_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows_written = [{"step": s, "critic/score/mean": 0.1 * s, "val/accuracy": None} for s in (1, 2)]
    text = "".join(json.dumps(r) + "\n" for r in rows_written) + '{"step": 3, "critic/sco'
    (tmp_path / "metrics.jsonl").write_text(text)
    plot_run = load_script("plot_run")
    assert plot_run.main([str(tmp_path), "--out", str(tmp_path / "c.png")]) == 0
    err = capsys.readouterr().err
    assert (
        err == f"warning: {tmp_path / 'metrics.jsonl'}, line 3 is not complete JSON (cut short?); skipped\n"
    )
    assert (tmp_path / "c.png").stat().st_size > 0
    read = plot_run.read_rows(tmp_path)
    assert [r["step"] for r in read] == [1, 2] and all(math.isnan(r["val/accuracy"]) for r in read)
