"""The user tools (``scripts/export_hf.py``, ``plot_run.py``, ``make_offline_data.py``) on the inputs and
folders users hand them: a full disk, a read-only folder, another stage's run folder, a damaged metrics
file, an ``--out`` of the wrong kind. Each ends in one line naming the file or folder and what to do (exit
code 2) or in the documented behaviour, never in a traceback, and leaves nothing half-written."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest
import transformers.modeling_utils

from ppo import checkpoint_files
from ppo.config import DPOConfig, RewardModelConfig, SFTConfig
from ppo.config_loader import load_config, to_yaml
from tests.helpers import load_script, write_parquet

export_hf = load_script("export_hf")
plot_run = load_script("plot_run")
make_offline_data = load_script("make_offline_data")


def error_messages(err: str) -> list[str]:
    """The messages of the ``HH:MM:SS ERROR message`` lines the scripts' logging writes."""
    return [line.split(" ERROR ", 1)[1] for line in err.splitlines() if " ERROR " in line]


# ----------------------------------------------------------------------------------------------------
# scripts/export_hf.py: a folder it cannot fill is left as it was
# ----------------------------------------------------------------------------------------------------


@pytest.fixture
def ppo_checkpoint(tiny_assets: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A PPO checkpoint folder whose weights are the base model's: what is written, and where, does not
    depend on the values, so ``load_models`` (DCP) leaves the freshly built model as it is."""
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000001"
    ckpt.mkdir(parents=True)
    cfg = load_config(None, [f"model.path={tiny_assets / 'base'}"])
    (ckpt / "config.yaml").write_text(to_yaml(cfg))
    monkeypatch.setattr(checkpoint_files, "load_models", lambda ckpt_dir, models: None)
    return ckpt


def test_export_to_a_full_disk_leaves_nothing(
    ppo_checkpoint: Path, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # save_pretrained writes config.json, then the weights through safetensors' save_file: the disk
    # fills there, after the configs are on disk (what used to be left behind without weights).
    def full_disk(tensors: Any, filename: str, metadata: Any = None) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full_disk)
    out = tmp_path / "exports" / "hf"  # exports/ does not exist: the command makes it, and removes it
    assert export_hf.main([str(ppo_checkpoint), str(out)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert error_messages(err) == [
        f"cannot write the export to {out}: No space left on device; nothing was left there: free space "
        "there or export to another disk"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]

    empty = tmp_path / "empty"  # a folder the user made stays, empty
    empty.mkdir()
    assert export_hf.main([str(ppo_checkpoint), str(empty)]) == 2
    assert list(empty.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["empty", "run"]


def test_export_to_a_read_only_folder(ppo_checkpoint: Path, tmp_path: Path, capsys: Any) -> None:
    parent = tmp_path / "read_only"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        if os.access(parent, os.W_OK):
            pytest.skip("running as root: chmod does not stop this process writing")
        out = parent / "hf"
        assert export_hf.main([str(ppo_checkpoint), str(out)]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert error_messages(err) == [
            f"cannot write the export to {out}: Permission denied; nothing was left there: choose a folder "
            "you can write to"
        ]
        assert list(parent.iterdir()) == []
    finally:
        parent.chmod(0o755)


def test_export_moves_the_whole_folder_into_place(ppo_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "a" / "hf"
    assert export_hf.main([str(ppo_checkpoint), str(out)]) == 0
    assert sorted(p.name for p in out.parent.iterdir()) == ["hf"]  # no staging folder left beside it
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    # --overwrite: the export's files replace theirs, weights of another sharding go, the user's file stays
    (out / "model-00001-of-00002.safetensors").write_bytes(b"an earlier, sharded export")
    (out / "README.md").write_text("my notes")
    assert export_hf.main([str(ppo_checkpoint), str(out), "--overwrite"]) == 0
    names = {p.name for p in out.iterdir()}
    assert "model-00001-of-00002.safetensors" not in names and "model.safetensors" in names
    assert (out / "README.md").read_text() == "my notes"
    assert sorted(p.name for p in out.parent.iterdir()) == ["hf"]


# ----------------------------------------------------------------------------------------------------
# scripts/export_hf.py on the run folder of SFT, the reward model or DPO
# ----------------------------------------------------------------------------------------------------

STAGE_CASES = {
    "sft": (SFTConfig, "an SFT run (scripts/train_sft.py)", "model.path of a PPO run"),
    "rm": (
        RewardModelConfig,
        "a reward-model run (scripts/train_reward_model.py)",
        "reward.model_path of a PPO run",
    ),
    "dpo": (DPOConfig, "a DPO run (scripts/train_dpo.py)", "model.path of a PPO run"),
}


@pytest.mark.parametrize("stage", sorted(STAGE_CASES))
def test_export_of_a_stage_run_folder(stage: str, tiny_assets: Path, tmp_path: Path, capsys: Any) -> None:
    config_class, what, use = STAGE_CASES[stage]
    run = tmp_path / stage
    run.mkdir()
    cfg = load_config(None, [f"model.path={tiny_assets / 'base'}", f"trainer.output_dir={run}"], config_class)
    (run / "config.yaml").write_text(to_yaml(cfg))
    out = tmp_path / "hf"
    # The run has not saved its model yet (stopped, or still running).
    assert export_hf.main([str(run), str(out)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert error_messages(err) == [
        f"{run} is the folder of {what}, not of a PPO run: its model goes to {run / 'hf'} "
        f"(trainer.save_path) when the run ends and is not there yet: resume the run (the same "
        f"{what.split('(')[1][:-1]} command) to finish and save it; export_hf.py exports PPO checkpoints"
    ]
    # The run has saved it: that folder is the export.
    (run / "hf").mkdir()
    (run / "hf" / "config.json").write_text("{}")
    assert export_hf.main([str(run), str(out)]) == 2
    assert error_messages(capsys.readouterr().err) == [
        f"{run} is the folder of {what}, not of a PPO run: its model is already a Hugging Face folder, "
        f"{run / 'hf'} (trainer.save_path): use that folder (from_pretrained, or {use}); export_hf.py "
        "exports PPO checkpoints"
    ]
    assert not out.exists()


def test_export_of_a_stage_checkpoint_names_its_save_path(
    tiny_assets: Path, tmp_path: Path, capsys: Any
) -> None:
    run, saved = tmp_path / "sft", tmp_path / "models" / "sft"
    ckpt = run / "checkpoints" / "step_00000004"
    ckpt.mkdir(parents=True)
    overrides = [
        f"model.path={tiny_assets / 'base'}",
        f"trainer.output_dir={run}",
        f"trainer.save_path={saved}",
    ]
    (ckpt / "config.yaml").write_text(to_yaml(load_config(None, overrides, SFTConfig)))
    assert export_hf.main([str(ckpt), str(tmp_path / "hf")]) == 2
    assert error_messages(capsys.readouterr().err) == [
        f"{ckpt} is the folder of an SFT run (scripts/train_sft.py), not of a PPO run: its model goes to "
        f"{saved} (trainer.save_path) when the run ends and is not there yet: resume the run (the same "
        "scripts/train_sft.py command) to finish and save it; export_hf.py exports PPO checkpoints"
    ]


# ----------------------------------------------------------------------------------------------------
# scripts/plot_run.py: one bad line costs that line, never the plot
# ----------------------------------------------------------------------------------------------------

GOOD = [b'{"step": 1, "critic/score/mean": 0.5}', b'{"step": 2, "critic/score/mean": 0.75}']

BAD_LINES = {
    "json_list": (b"[1, 2, 3]", "is a list, not a JSON object of metrics"),
    "no_step": (b'{"critic/score/mean": 0.1}', 'has no numeric "step"'),
    # 0xff never occurs in UTF-8; it follows the 12 + 21 bytes of `{"step": 3, ` and the key: column 34
    "bad_byte": (b'{"step": 3, "critic/score/mean": \xff}', "is not UTF-8 text (byte 0xff at column 34)"),
    "cut_short": (b'{"step": 3, "critic/sco', "is not complete JSON (cut short?)"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_plot_run_skips_a_bad_line(case: str, tmp_path: Path, capsys: Any) -> None:
    line, problem = BAD_LINES[case]
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"\n".join([GOOD[0], line, GOOD[1]]) + b"\n")
    assert plot_run.main([str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.err == f"warning: {path}, line 2 {problem}; skipped\n"
    assert captured.out == f"wrote {tmp_path / 'curves.png'} (1 panels, 1 run(s), up to 2 rows)\n"
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert plot_run.read_rows(tmp_path) == [
        {"step": 1, "critic/score/mean": 0.5},
        {"step": 2, "critic/score/mean": 0.75},
    ]


def test_plot_run_leaves_text_values_out(tmp_path: Path, capsys: Any) -> None:
    rows = [
        {"step": 1, "critic/score/mean": 0.5, "actor/entropy": "n/a"},
        {"step": 2, "critic/score/mean": 0.75, "actor/entropy": 1.25},
        {"step": 3, "critic/score/mean": 1.0, "actor/entropy": "n/a"},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plot_run.main([str(tmp_path)]) == 0
    assert capsys.readouterr().err == (
        f"note: {path}, line 1: 'actor/entropy' is 'n/a' (not a number); its values that are not numbers "
        "are not plotted\n"
    )  # once for the key, not once per line
    assert [r.get("actor/entropy") for r in plot_run.read_rows(tmp_path)] == [None, 1.25, None]


def test_plot_run_out_names_the_file_it_writes(tmp_path: Path, capsys: Any) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_bytes(b"\n".join(GOOD) + b"\n")
    folder = tmp_path / "plots"
    folder.mkdir()
    assert plot_run.main([str(run), "--out", str(folder)]) == 0  # a folder: curves.png inside it
    assert capsys.readouterr().out == f"wrote {folder / 'curves.png'} (1 panels, 1 run(s), up to 2 rows)\n"
    assert [p.name for p in folder.iterdir()] == ["curves.png"]
    assert plot_run.main([str(run), "--out", str(tmp_path / "curves")]) == 0  # no suffix: .png added
    assert capsys.readouterr().out == f"wrote {tmp_path / 'curves.png'} (1 panels, 1 run(s), up to 2 rows)\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png", "plots", "run"]
    assert plot_run.main([str(run), "--out", str(tmp_path / "missing" / "c.png")]) == 2
    assert capsys.readouterr().err == (
        f"error: --out {tmp_path / 'missing' / 'c.png'}: the folder {tmp_path / 'missing'} does not exist; "
        "create it or choose another\n"
    )


# ----------------------------------------------------------------------------------------------------
# scripts/make_offline_data.py: --out is the Parquet file the trainer reads
# ----------------------------------------------------------------------------------------------------


def test_make_offline_data_refuses_an_out_that_is_not_parquet(tmp_path: Path, capsys: Any) -> None:
    prefs = write_parquet(
        tmp_path / "prefs.parquet",
        [{"prompt": [{"role": "user", "content": "2 + 3?"}], "chosen": "5", "rejected": "6"}],
    )
    out = tmp_path / "groups.jsonl"
    assert make_offline_data.main(["--from-pairs", str(prefs), "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"error: --out {out}: the groups are written as Parquet, the only format the trainer reads groups "
        "from (rollout.source=dataset, rollout.offline_fraction); name the file groups.parquet\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prefs.parquet"]
