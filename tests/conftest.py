"""Shared fixtures: the tiny local assets (tokenizer, models, synthetic task), built once per session."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str):
    """Import a file under scripts/ as a module (scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``scripts/make_tiny_assets.py`` output: tokenizer/, base/, base_rm/, base_critic/, data/."""
    out = tmp_path_factory.mktemp("assets")
    load_script("make_tiny_assets").build_assets(out, seed=0)
    return out
