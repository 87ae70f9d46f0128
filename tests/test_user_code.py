"""User code and user folders that hang, exit or lie: each case ends in one line naming what to fix,
and nothing a user had is replaced without an explicit request that says what it replaces."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ppo.config_loader import load_config, to_yaml
from tests.conftest import load_script

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
