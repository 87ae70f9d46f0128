"""The run folder keeps what is not the run's own: a ``--config`` preset inside ``trainer.output_dir`` is
refused (the run would write its resolved ``config.yaml`` over it), and so is a ``trainer.output_dir`` (or
a stage's ``save_path``) inside a checkpoint or below another run's folder, before anything is created;
``trainer.max_ckpt_to_keep=null`` prunes nothing. Runs that resume are in ``tests/runs/test_resume.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ppo import checkpoint_files, run_folder
from ppo.checkpoint_files import CheckpointError
from ppo.config import SFTConfig
from ppo.config_loader import load_config, to_yaml
from tests.helpers import base_args, demo_inputs, load_script, run

CKPT = "step_00000002"


def make_run(out: Path, steps: tuple[int, ...] = (1, 2)) -> Path:
    """A run folder as a run leaves it: its config, metrics and complete checkpoints (the newest's path)."""
    root = checkpoint_files.checkpoints_dir(out)
    for step in steps:
        ckpt = root / f"step_{step:08d}"
        (ckpt / "dcp").mkdir(parents=True)
        (ckpt / "dcp" / ".metadata").write_bytes(b"")
        for name in ("config.yaml", "trainer.json", checkpoint_files.COMPLETE):
            (ckpt / name).write_text(f"{name} of step {step}")
    (root / "latest").write_text(f"step_{steps[-1]:08d}")
    (out / "config.yaml").write_text("the run's config")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    return root / f"step_{steps[-1]:08d}"


def files(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` with its text: what must stay as it was."""
    return {
        str(p.relative_to(folder)): p.read_bytes().decode() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def ppo_config(out: Path, *overrides: str) -> Any:
    return load_config(
        None, ["model.path=m", "data.train_files=[t.parquet]", f"trainer.output_dir={out}", *overrides]
    )


# ----------------------------------------------------------------------------------------------------
# No run inside a checkpoint or another run
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("inside", ["", "/sub"])
def test_output_dir_in_a_checkpoint_is_refused_before_anything_is_written(
    tmp_path: Path, inside: str
) -> None:
    """A new run in ``run/checkpoints/step_N`` rewrote that checkpoint's config.yaml (and left its
    metrics there): the run in ``run`` could no longer resume from it."""
    run_dir = tmp_path / "run"
    ckpt = make_run(run_dir)
    before = files(run_dir)
    out = f"{ckpt}{inside}"
    with pytest.raises(CheckpointError) as e:
        run_folder.claim(ppo_config(Path(out)))
    where = "lies inside" if inside else "is"
    assert str(e.value) == (
        f"trainer.output_dir={out} {where} the checkpoint {ckpt} of the run in {run_dir}: a run there would "
        f"rewrite that checkpoint's files (its config.yaml) and it could no longer be resumed; choose a "
        f"folder outside {run_dir} (to continue that run, set trainer.output_dir={run_dir}; to start from "
        f"that checkpoint, set trainer.resume_mode={ckpt} with a new trainer.output_dir)"
    )
    assert files(run_dir) == before  # no lock, no probe file, no folder made


@pytest.mark.parametrize("below", ["checkpoints", "sub/deeper"])
def test_output_dir_below_another_run_is_refused(tmp_path: Path, below: str) -> None:
    run_dir = tmp_path / "run"
    make_run(run_dir)
    before = files(run_dir)
    with pytest.raises(CheckpointError) as e:
        run_folder.claim(ppo_config(run_dir / below))
    assert str(e.value) == (
        f"trainer.output_dir={run_dir / below} lies inside the folder of another run, {run_dir}: a run there "
        f"would mix its files with that run's, which could then no longer be resumed; choose a folder outside "
        f"{run_dir} (to continue that run, set trainer.output_dir={run_dir})"
    )
    assert files(run_dir) == before and not (run_dir / "sub").exists()


def test_a_run_resumes_its_own_folder_and_verl_roots_are_not_runs(tmp_path: Path) -> None:
    """What stays allowed: resuming a run in its own folder, and a run in verl's default layout
    (``checkpoints/{project}/{experiment}``) under a folder that holds a preset and other runs' roots."""
    own = tmp_path / "own"
    make_run(own)
    assert run_folder.claim(ppo_config(own)) == own  # resume_mode=auto: its checkpoints
    run_folder.release_lock(own / run_folder.LOCK_FILE)
    project = tmp_path / "project"
    make_run(project / "checkpoints" / "proj" / "earlier")
    (project / "config.yaml").write_text("trainer: {}\n")  # a preset beside verl's root of runs
    out = project / "checkpoints" / "proj" / "exp"
    assert run_folder.claim(ppo_config(out)) == out
    run_folder.release_lock(out / run_folder.LOCK_FILE)


def test_a_stage_save_path_inside_another_run_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "other"
    make_run(other)
    cfg = load_config(
        None,
        ["model.path=m", "data.train_files=[t.parquet]", f"trainer.output_dir={tmp_path / 'sft'}"]
        + [f"trainer.save_path={other / 'hf'}"],
        SFTConfig,
    )
    with pytest.raises(CheckpointError) as e:
        run_folder.claim(cfg)
    assert str(e.value) == (
        f"trainer.save_path={other / 'hf'} lies inside the folder of another run, {other}: a run there would "
        f"mix its files with that run's, which could then no longer be resumed; choose a folder outside "
        f"{other} (to continue that run, set trainer.output_dir={other})"
    )
    assert not (tmp_path / "sft").exists()


def test_sft_into_a_checkpoint_stops_before_any_model_loads(
    tiny_assets: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The stage scripts share the run harness: SFT's entry point refuses the same way."""
    run_dir = tmp_path / "run"
    ckpt = make_run(run_dir)
    before = files(run_dir)
    args = demo_inputs(SFTConfig, tiny_assets) + [
        f"trainer.output_dir={ckpt}",
        "trainer.total_training_steps=1",
    ]
    assert load_script("train_sft").main(args) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and errors[0].startswith(f"trainer.output_dir={ckpt} is the checkpoint {ckpt} of")
    assert files(run_dir) == before


# ----------------------------------------------------------------------------------------------------
# The --config preset stays as it was
# ----------------------------------------------------------------------------------------------------

PRESET = "# my preset\ntrainer:\n  total_training_steps: 1  # one step\n"


def test_a_preset_in_the_run_folder_is_kept(
    tiny_assets: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``--config out/config.yaml`` with ``trainer.output_dir=out``: the run wrote its resolved config over
    the preset (comments and all) and exited 0. It stops before anything is written."""
    out = tmp_path / "run"
    out.mkdir()
    preset = out / "config.yaml"
    preset.write_text(PRESET)
    assert run(["--config", str(preset), *base_args(tiny_assets, out)]) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == [
        f"--config {preset} is the config.yaml of trainer.output_dir={out}, which the run replaces with its "
        f"resolved config: move the preset out of that folder or choose another trainer.output_dir"
    ]
    assert files(out) == {"config.yaml": PRESET}


def test_presets_inside_the_output_dir_or_save_path_are_refused(tmp_path: Path) -> None:
    out = tmp_path / "run"
    nested = out / "presets" / "p.yaml"
    with pytest.raises(CheckpointError) as e:
        run_folder.refuse_writing_preset(ppo_config(out), str(nested), "")
    assert str(e.value) == (
        f"--config {nested} lies inside trainer.output_dir={out}, whose files the run writes, prunes or (with "
        f"trainer.overwrite) deletes: move the preset out of that folder or choose another trainer.output_dir"
    )
    saved = tmp_path / "models" / "sft"
    cfg = load_config(None, [f"trainer.output_dir={out}", f"trainer.save_path={saved}"], SFTConfig)
    with pytest.raises(CheckpointError, match=f"lies inside trainer.save_path={saved}, whose files"):
        run_folder.refuse_writing_preset(cfg, str(saved / "sft.yaml"), "")
    beside = tmp_path / "run.yaml"  # next to the run folder, not in it
    run_folder.refuse_writing_preset(ppo_config(out), str(beside), "")


def test_a_runs_saved_config_passes_unchanged_only(tmp_path: Path) -> None:
    """Resuming a run by its own saved config.yaml: allowed when the run would write it as it is, refused
    (naming what to do) when an override would change it."""
    out = tmp_path / "run"
    make_run(out)
    cfg = ppo_config(out)
    (out / "config.yaml").write_text(to_yaml(cfg))
    run_folder.refuse_writing_preset(cfg, str(out / "config.yaml"), to_yaml(cfg))
    changed = ppo_config(out, "trainer.total_training_steps=9")
    with pytest.raises(CheckpointError) as e:
        run_folder.refuse_writing_preset(changed, str(out / "config.yaml"), to_yaml(changed))
    assert str(e.value) == (
        f"--config {out / 'config.yaml'} is the config the run in trainer.output_dir={out} saved, and this "
        f"command changes it (an override, or a key this version added): the run would replace it; copy it "
        f"out of that folder and pass the copy as --config"
    )
    assert (out / "config.yaml").read_text() == to_yaml(cfg)


# ----------------------------------------------------------------------------------------------------
# Pruning
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("keep", "left"), [(None, [1, 2, 3]), (0, [1, 2, 3]), (2, [2, 3])])
def test_max_ckpt_to_keep_null_keeps_every_checkpoint(
    tmp_path: Path, keep: int | None, left: list[int]
) -> None:
    """``trainer.max_ckpt_to_keep=null`` (verl's keep-all, translated) prunes nothing, as 0 does."""
    make_run(tmp_path, steps=(1, 2, 3))
    checkpoint_files._prune(checkpoint_files.checkpoints_dir(tmp_path), keep)
    assert [checkpoint_files.step_of(p) for p in checkpoint_files.complete_checkpoints(tmp_path)] == left
