"""Robustness: nothing lost, nothing run from a foreign file, no traceback for a user's mistake.

Checkpoints that are damaged, hostile or from another world size; resume that falls back; fresh runs that
refuse to overwrite; signals that checkpoint; non-finite rewards that stop. Most run at the checkpoint or
config layer in seconds; the end-to-end ones use the tiny model.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ppo import checkpoint_files
from tests.helpers import (
    REWARD_FNS,
    ROOT,
    base_args,
    has_metrics,
    launch,
    read_metrics,
    run,
    saved_run,
    torchrun,
    train,
    wait_until,
)


class Payload:
    """Unpickling this runs ``touch <marker>``: what a hostile checkpoint would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (os.system, (f"touch {self.marker}",))


# ----------------------------------------------------------------------------------------------------
# Hostile and damaged checkpoints
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tiny_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder with checkpoints of steps 1 and 2 (copied by each test before it damages one)."""
    out = tmp_path_factory.mktemp("saved")
    saved_run(tiny_assets, out, steps=2)
    return out


def copy_run(saved: Path, tmp_path: Path) -> Path:
    """A copy of the ``saved`` run folder, to damage."""
    out = tmp_path / "run"
    shutil.copytree(saved, out)
    return out


def resume_errors(tiny_assets: Path, out: Path, ckpt: Path, caplog: pytest.LogCaptureFixture) -> list[str]:
    """Resume the run in ``out`` from ``ckpt``, which must fail (exit code 2); the errors it logged."""
    args = base_args(tiny_assets, out, steps=3) + [
        f"trainer.resume_mode={ckpt}",
        "trainer.val_before_train=false",
    ]
    assert run(args) == 2
    return [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]


@pytest.mark.slow
@pytest.mark.parametrize("target", ["rank_file", "metadata"])
def test_pickled_payload_in_a_checkpoint_never_runs(
    tiny_assets: Path, saved: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, target: str
) -> None:
    out = copy_run(saved, tmp_path)
    ckpt = out / "checkpoints" / "step_00000002"
    marker = tmp_path / "pwned"
    path = ckpt / "rank_00000.pt" if target == "rank_file" else ckpt / "dcp" / ".metadata"
    with open(path, "wb") as f:
        pickle.dump({"rng": Payload(marker)}, f)
    errors = resume_errors(tiny_assets, out, ckpt, caplog)
    assert not marker.exists()
    assert len(errors) == 1 and "was refused" in errors[0] and str(path) in errors[0]


def test_pickled_payload_in_a_checkpoint_entry_never_runs(tmp_path: Path) -> None:
    """A non-tensor DCP entry (where optimizer hyper-parameters live) holding a payload."""
    marker = tmp_path / "pwned"
    dcp.save({"entry": Payload(marker), "w": torch.ones(2)}, checkpoint_id=str(tmp_path / "ckpt" / "dcp"))
    with pytest.raises(checkpoint_files.CheckpointError, match="entry entry was refused"):
        checkpoint_files._dcp_load({"entry": 0, "w": torch.zeros(2)}, tmp_path / "ckpt")
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated_shard", "missing_shard", "trainer_json", "rank_file"])
def test_damaged_checkpoint_names_the_file(
    tiny_assets: Path, saved: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    out = copy_run(saved, tmp_path)
    ckpt = out / "checkpoints" / "step_00000002"
    shard = next((ckpt / "dcp").glob("*.distcp"))
    if damage == "truncated_shard":
        shard.write_bytes(shard.read_bytes()[:100])
        expected = f"checkpoint shard {shard} is truncated"
    elif damage == "missing_shard":
        shard.unlink()
        expected = f"checkpoint shard {shard} is missing"
    elif damage == "trainer_json":
        (ckpt / "trainer.json").write_text('{"trainer": ')
        expected = f"{ckpt / 'trainer.json'} is missing or unreadable"
    else:
        (ckpt / "rank_00000.pt").write_bytes(b"PK\x03\x04 not really a zip")
        expected = f"{ckpt / 'rank_00000.pt'} is unreadable"
    errors = resume_errors(tiny_assets, out, ckpt, caplog)
    assert len(errors) == 1 and expected in errors[0], errors


@pytest.mark.slow
def test_auto_resume_falls_back_past_a_damaged_newest_checkpoint(
    tiny_assets: Path, saved: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = copy_run(saved, tmp_path)
    shard = next((out / "checkpoints" / "step_00000002" / "dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    saved_run(tiny_assets, out, steps=3)
    assert "cannot resume from" in caplog.text and "step_00000002" in caplog.text
    assert "resumed from" in caplog.text and "step_00000001 at step 1" in caplog.text
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]  # step 2 redone, then 3


@pytest.mark.slow
def test_resume_on_another_world_size_continues_the_data_order(tiny_assets: Path, tmp_path: Path) -> None:
    """Two steps on one rank, then two more on two ranks from its checkpoint: the same steps 3 and 4
    as a run that never stopped (greedy rollouts, so the new sampling streams do not matter)."""
    common = [
        "rollout.do_sample=false",
        "actor.ppo_mini_batch_size=4",
        "trainer.val_before_train=false",
        "data.max_prompt_length=16",
        "actor.optim.eps=1e-3",
        "critic.optim.eps=1e-3",
        "trainer.save_freq=2",
    ]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run(base_args(tiny_assets, straight, steps=4) + common) == 0
    assert run(base_args(tiny_assets, resumed, steps=2) + common) == 0
    proc = torchrun(ROOT / "train_ppo.py", *base_args(tiny_assets, resumed, steps=4), *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed a checkpoint of 1 ranks on 2 ranks" in proc.stderr
    a, b = read_metrics(straight), read_metrics(resumed)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for x, y in zip(a[2:], b[2:], strict=True):
        for key in ("critic/score/mean", "response_length/mean", "actor/pg_loss", "critic/vf_loss"):
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-5), (x["step"], key)


def test_rng_state_round_trips_as_plain_values(tmp_path: Path) -> None:
    checkpoint_files.seed_everything(7)
    state = checkpoint_files.rng_state()
    torch.save(state, tmp_path / "rng.pt")
    expected = (torch.rand(3), __import__("random").random(), __import__("numpy").random.rand())
    checkpoint_files.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    again = (torch.rand(3), __import__("random").random(), __import__("numpy").random.rand())
    assert torch.equal(expected[0], again[0]) and expected[1:] == again[1:]


# ----------------------------------------------------------------------------------------------------
# Work is never lost
# ----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_nan_reward_on_a_save_step_still_saves_and_too_many_stop_the_run(
    tiny_assets: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A scorer that always returns NaN: each step is skipped, the save of step 2 still happens, and
    ``trainer.max_skipped_steps`` in a row stop the run with exit code 2 and a message."""
    out = tmp_path / "run"
    args = base_args(tiny_assets, out, steps=5) + [
        f"reward.custom_function={REWARD_FNS}:nan_score",
        "trainer.val_before_train=false",
        "trainer.save_freq=2",
        "trainer.max_skipped_steps=3",
    ]
    assert run(args) == 2
    assert "3 steps in a row had a non-finite reward" in caplog.text
    assert (out / "checkpoints" / "latest").read_text() == "step_00000002"
    state = json.loads((out / "checkpoints" / "step_00000002" / "trainer.json").read_text())["trainer"]
    assert state["skipped_steps"] == 2 and state["step"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun_sigterm", "python_sigint"])
def test_stop_signal_inside_a_long_step_saves_the_last_step_at_once(
    tiny_assets: Path, tmp_path: Path, launcher: str
) -> None:
    """Step 2 is long (its scoring waits 6 s, then 60 updates follow): a stop request during its
    scoring is honoured at the next phase boundary, before the updates. The last complete step (1) is
    checkpointed and the run exits within seconds, well inside torchrun's 30 s grace, and resumes."""
    out = tmp_path / "run"
    extra = [
        "trainer.val_before_train=false",
        "algorithm.adv_estimator=grpo",
        "actor.ppo_epochs=30",  # 60 updates a step: the part of step 2 a stop must not wait for
        f"reward.custom_function={REWARD_FNS}:slow_after",
    ]
    nproc = 2 if launcher == "torchrun_sigterm" else 1
    # Calls before the slow one, per rank: the start-up probe, then step 1's responses.
    fast_calls = 1 + 8 // nproc
    env = {"PPO_TEST_SLOW_S": "6", "PPO_TEST_FAST_CALLS": str(fast_calls)}
    proc = launch(base_args(tiny_assets, out, steps=4) + extra, nproc=nproc, env=env)
    wait_until(proc, has_metrics(out), timeout=400)
    time.sleep(2)  # inside step 2's slow scoring
    sent = time.time()
    proc.send_signal(signal.SIGTERM if nproc == 2 else signal.SIGINT)
    _, stderr = proc.communicate(timeout=300)
    assert time.time() - sent < 25, "waited for the step's updates"
    assert "stopping: saved step 1" in stderr, stderr[-3000:]
    assert (out / "checkpoints" / "latest").read_text() == "step_00000001"
    assert [r["step"] for r in read_metrics(out)] == [1]
    # The stopped run resumes where it stopped.
    assert [r["step"] for r in train(tiny_assets, out, *extra, steps=2)] == [1, 2]


# ----------------------------------------------------------------------------------------------------
# Fresh runs and output folders
# ----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_fresh_run_refuses_an_existing_run_folder(
    tiny_assets: Path, saved: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = copy_run(saved, tmp_path)
    before = (out / "metrics.jsonl").read_text()
    args = base_args(tiny_assets, out, steps=1) + [
        "trainer.resume_mode=disable",
        "trainer.val_before_train=false",
    ]
    assert run(args) == 2
    assert f"trainer.output_dir={out} already holds a run" in caplog.text
    assert "trainer.overwrite=true" in caplog.text
    assert (out / "metrics.jsonl").read_text() == before
    assert (out / "checkpoints" / "latest").read_text() == "step_00000002"
    # With overwrite the folder starts afresh: one step, its own checkpoint only.
    assert run(args + ["trainer.overwrite=true", "trainer.save_freq=1"]) == 0
    assert [r["step"] for r in read_metrics(out)] == [1]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_00000001"]


@pytest.mark.parametrize(
    ("blocker", "message"),
    [
        ("checkpoints", "checkpoints is a file"),
        ("metrics.jsonl", "metrics.jsonl is a folder"),
        ("tensorboard", "tensorboard is a file"),
        ("hf", "hf is a file"),
    ],
)
def test_every_path_the_run_writes_is_checked_before_training(
    tiny_assets: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, blocker: str, message: str
) -> None:
    out = tmp_path / "run"
    out.mkdir()
    target = out / blocker
    if blocker == "metrics.jsonl":
        target.mkdir()
    else:
        target.write_text("in the way")
    args = base_args(tiny_assets, out, steps=1) + [
        "trainer.logger=[console,jsonl,tensorboard]",
        "trainer.save_hf_on_end=true",
        "trainer.save_freq=1",
    ]
    assert run(args) == 2
    assert message in caplog.text and "world size" not in caplog.text  # before any model loaded


def test_critic_from_a_reward_model_keeps_its_trained_head(
    tiny_assets: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The reward model's score head has a weight and no bias; the critic (token classification) wants
    both: the weight is kept, only the bias starts at zero, and the log says exactly that."""
    from safetensors.torch import load_file

    from ppo import models

    caplog.set_level(logging.INFO, logger="ppo")
    trained = load_file(tiny_assets / "base_rm" / "model.safetensors")["score.weight"]
    assert trained.abs().sum() > 0
    critic = models.load_critic(str(tiny_assets / "base_rm"))
    torch.testing.assert_close(critic.score.weight.detach(), trained)
    assert float(critic.score.bias.abs().sum()) == 0.0
    assert (
        "initialized score.bias to zero (not in the checkpoint); kept the trained score.weight" in caplog.text
    )
