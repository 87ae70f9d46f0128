"""Shared fixtures: the tiny local assets (tokenizer, models, synthetic task), built once per session."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Triton reads TRITON_INTERPRET when it is first imported, and importing transformers models imports
# triton: set it before any test module loads, wherever no GPU can run the kernels for real.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def load_script(name: str):
    """Import a file under scripts/ as a module (scripts are not a package)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: dataclasses defined in the script look it up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``scripts/make_tiny_assets.py`` output: tokenizer/, base/, base_rm/, base_critic/, data/."""
    out = tmp_path_factory.mktemp("assets")
    load_script("make_tiny_assets").build_assets(out, seed=0)
    return out
