"""Checkpoints written in the background (``trainer.async_save``): the run goes on while the shards are
written; the folder is renamed into place and ``latest`` moves only once every rank's shards are on
disk, so a kill during the write leaves the previous checkpoint as ``latest``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ppo import checkpoint_files
from tests.helpers import ROOT, deterministic, read_metrics, train

pytestmark = pytest.mark.slow

KILLED_DURING_SAVE = textwrap.dedent(
    """
    import os, sys, torch
    from pathlib import Path
    from ppo.checkpointer import Checkpointer, TrainerState
    from ppo.distributed import init_distributed, DistInfo
    import torch.distributed as dist

    out = Path(sys.argv[1])
    info = init_distributed("cpu")
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])  # 34 MB with Adam
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    state = TrainerState()
    ckpt = Checkpointer(
        out_dir=out, info=info, config_yaml="{}", keep=0, seed=0, models={"m": model},
        optimizers={"m": opt}, schedulers={}, stateful={"trainer": state},
        async_group=dist.new_group(backend="gloo"),
    )
    state.step = 1
    ckpt.save(1)
    ckpt.wait()
    state.step = 2
    ckpt.save(2)  # the shards of step 2 are being written in the background ...
    os._exit(9)   # ... when the process dies
    """
)


def test_a_kill_during_a_background_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_DURING_SAVE, str(out)], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 9, proc.stderr[-2000:]
    root = checkpoint_files.checkpoints_dir(out)
    assert (root / "latest").read_text() == "step_00000001"
    assert (root / "step_00000002.tmp").is_dir() and not (root / "step_00000002").exists()
    assert checkpoint_files.resume_candidates(out, "auto") == [root / "step_00000001"]


def test_background_saves_train_and_resume_as_blocking_ones(tiny_assets: Path, tmp_path: Path) -> None:
    common = ["trainer.save_freq=1", "trainer.val_before_train=false"]
    blocking = train(tiny_assets, tmp_path / "blocking", *common, steps=3)
    background = train(tiny_assets, tmp_path / "background", *common, "trainer.async_save=true", steps=3)
    assert deterministic(background) == deterministic(blocking)
    root = checkpoint_files.checkpoints_dir(tmp_path / "background")
    assert (root / "latest").read_text() == "step_00000003"  # the last one completed before the run ended
    assert not list(root.glob("*.tmp"))
    # Resumed from the background save, the run continues as the blocking run does.
    resumed = train(tiny_assets, tmp_path / "background", *common, "trainer.async_save=true", steps=4)
    straight = train(tiny_assets, tmp_path / "blocking", *common, steps=4)
    assert deterministic(resumed)[-1] == deterministic(straight)[-1]
    assert [r["step"] for r in read_metrics(tmp_path / "background")] == [1, 2, 3, 4]
