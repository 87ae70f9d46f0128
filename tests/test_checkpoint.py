"""Checkpoints: exact resume after SIGKILL, atomic saves, HF export, KL rollback, bad input."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from ppo import checkpoint_files
from tests.helpers import (
    ROOT,
    base_args,
    deterministic,
    has_metrics,
    launch,
    read_metrics,
    run,
    saved_run,
    wait_until,
)


def resume_args(assets: Path, out: Path) -> list[str]:
    """Four steps, a checkpoint every two, validation and an adaptive KL coefficient (state to resume)."""
    return base_args(assets, out, steps=4) + [
        "trainer.save_freq=2",
        "trainer.test_freq=2",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.horizon=100",
        "algorithm.kl_ctrl.target_kl=0.001",
    ]


@pytest.mark.slow
def test_sigkill_mid_step_then_resume_gives_identical_metrics(tiny_assets: Path, tmp_path: Path) -> None:
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    done = launch(resume_args(tiny_assets, straight))
    _, stderr = done.communicate(timeout=600)
    assert done.returncode == 0, stderr[-3000:]

    # Start the same run and SIGKILL it as soon as the step-2 checkpoint is complete: it is then inside
    # step 3, which has to be redone after the restart.
    proc = launch(resume_args(tiny_assets, killed))
    latest = killed / "checkpoints" / "latest"
    wait_until(proc, lambda: latest.exists() and latest.read_text() == "step_00000002", timeout=600)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert read_metrics(killed)[-1]["step"] <= 3  # it died before finishing the run
    resumed = launch(resume_args(tiny_assets, killed))
    _, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, stderr[-3000:]
    assert "resumed from" in stderr and "step_00000002" in stderr

    a, b = deterministic(read_metrics(straight)), deterministic(read_metrics(killed))
    assert [r["step"] for r in a] == [0, 1, 2, 3, 4]
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x == y, f"step {x['step']} differs after resume"


@pytest.mark.slow
def test_crash_while_saving_keeps_previous_checkpoint(tiny_assets: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    saved_run(tiny_assets, out, steps=2)
    root = out / "checkpoints"
    assert (root / "latest").read_text() == "step_00000002"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000001", "step_00000002"]
    # A crash during the next save leaves a .tmp folder (and maybe a half-written step folder): the
    # latest complete checkpoint is still the one found.
    (root / "step_00000003.tmp" / "dcp").mkdir(parents=True)
    (root / "step_00000004").mkdir()
    (root / "latest").write_text("step_00000004")  # even a marker pointing at a broken one
    assert checkpoint_files.find_resume_dir(out, "auto") == root / "step_00000002"
    with pytest.raises(checkpoint_files.CheckpointError, match="incomplete or corrupted"):
        checkpoint_files.find_resume_dir(out, str(root / "step_00000004"))
    assert checkpoint_files.find_resume_dir(out, "disable") is None


@pytest.mark.slow
def test_max_ckpt_to_keep_prunes(tiny_assets: Path, tmp_path: Path) -> None:
    saved_run(tiny_assets, tmp_path, "trainer.max_ckpt_to_keep=1", steps=3)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000003"]


@pytest.mark.slow
def test_export_hf_matches_trained_model(tiny_assets: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    saved_run(tiny_assets, out, "trainer.save_hf_on_end=true")
    export = tmp_path / "export"
    script = ROOT / "scripts" / "export_hf.py"
    proc = subprocess.run(
        [sys.executable, str(script), str(out), str(export), "--critic"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    trained = AutoModelForCausalLM.from_pretrained(out / "hf")
    exported = AutoModelForCausalLM.from_pretrained(export)
    base = AutoModelForCausalLM.from_pretrained(tiny_assets / "base")
    ids = torch.tensor([[1, 5, 20, 21, 22, 6]])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, trained(ids).logits, atol=1e-6, rtol=0)
        assert not torch.allclose(exported(ids).logits, base(ids).logits)  # it is the trained model
    assert (export / "critic" / "config.json").is_file() and (export / "tokenizer_config.json").is_file()


def test_kl_rollback_then_stop(tiny_assets: Path, tmp_path: Path) -> None:
    """A KL limit the policy must cross after its first update: every later step rolls back to the
    step-0 checkpoint with a smaller learning rate, until max_rollbacks in a row stops the run."""
    out = tmp_path / "run"
    args = base_args(tiny_assets, out, steps=6) + [
        "algorithm.rollback_kl=1e-7",
        "algorithm.rollback_lr_factor=0.5",
        "algorithm.max_rollbacks=2",
        "trainer.val_before_train=false",
        "actor.optim.lr=1e-2",
    ]
    assert run(args) == 2  # TrainingError: stopped with a message
    rows = read_metrics(out)
    rollbacks = [r for r in rows if "trainer/lr_scale" in r]
    assert [r["trainer/rollbacks"] for r in rollbacks] == [1.0, 2.0]
    assert [r["trainer/lr_scale"] for r in rollbacks] == [0.5, 0.25]
    # Each rollback returns to step 0 and redoes step 1 with the learning rate scaled down.
    step1_lrs = [r["actor/lr"] for r in rows if r["step"] == 1 and "actor/lr" in r]
    assert step1_lrs == pytest.approx([1e-2, 5e-3, 2.5e-3])
    assert (out / "checkpoints" / "step_00000000").is_dir()  # the start, saved to roll back to


@pytest.mark.slow
def test_incompatible_checkpoint_fails_clearly(
    tiny_assets: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "run"
    saved_run(tiny_assets, out)
    # A model of another shape, resumed from the same run folder.
    other = tmp_path / "wide"
    cfg = LlamaConfig.from_pretrained(tiny_assets / "base")
    cfg.intermediate_size = 256
    LlamaForCausalLM(cfg).save_pretrained(other)
    AutoTokenizer.from_pretrained(tiny_assets / "base").save_pretrained(other)
    assert run(base_args(tiny_assets, out, steps=2) + [f"model.path={other}"]) == 2
    # Found before anything of the checkpoint is loaded: the run names another model than the checkpoint.
    assert f"model.path: '{tiny_assets / 'base'}' -> '{other}'" in caplog.text
    assert "what must stay the same to continue it" in caplog.text


def test_unwritable_output_and_vanished_data(
    tiny_assets: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    assert run(base_args(tiny_assets, blocker / "run", steps=1)) == 2
    assert "is not writable" in caplog.text and not (blocker / "run").exists()

    # A data file that vanished between the first run and its resume: a clear error, nothing written.
    data = tmp_path / "train.parquet"
    data.write_bytes((tiny_assets / "data" / "train.parquet").read_bytes())
    out = tmp_path / "run"
    saved_run(tiny_assets, out, f"data.train_files={data}")
    data.unlink()
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    caplog.clear()
    common = [f"data.train_files={data}", "trainer.save_freq=1", "trainer.val_before_train=false"]
    assert run(base_args(tiny_assets, out, steps=2) + common) == 2
    assert f"{data}: no such data file" in caplog.text
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before
    assert read_metrics(out)[-1]["step"] == 1


@pytest.mark.slow
def test_sigterm_checkpoints_the_current_step_and_exits(tiny_assets: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = launch(
        base_args(tiny_assets, out, steps=50) + ["trainer.val_before_train=false"]
    )  # no periodic saves
    wait_until(proc, has_metrics(out))
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert "stopping: saved step" in stderr
    step = read_metrics(out)[-1]["step"]
    assert 1 <= step < 50
    assert (out / "checkpoints" / "latest").read_text() == f"step_{step:08d}"
