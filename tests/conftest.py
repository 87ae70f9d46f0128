"""Fixtures for both rooms of tests (``tests/unit``, ``tests/runs``): the tiny local assets (tokenizer,
models, synthetic task), built once per session; their tokenizer; one intra-op thread; a one-process
group. Shared helpers (runs, metrics readers, torchrun launch, tiny configs, Parquet rows) are in
``tests/helpers.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from tests.helpers import load_script  # first: sets TRITON_INTERPRET before any test module loads

if TYPE_CHECKING:
    from ppo.distributed import DistInfo


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``scripts/make_tiny_assets.py`` output: tokenizer/, base/, base_rm/, base_critic/, data/."""
    out = tmp_path_factory.mktemp("assets")
    load_script("make_tiny_assets").build_assets(out, seed=0)
    return out


@pytest.fixture(scope="module")
def tok() -> Any:
    """The tiny character-level tokenizer with its chat template (``make_tiny_assets``; the one saved in
    ``tiny_assets/tokenizer``). Ids: 0 pad, 1 <s>, 2 </s>, 3 unk, 4 <|system|>, 5 <|user|>,
    6 <|assistant|>, then one per character."""
    return load_script("make_tiny_assets").build_tokenizer()


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread, as torchrun gives each rank: on a busy 2-core machine two OpenMP threads spin
    against each other and make tiny matmuls 10-50x slower. A module opts in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def one_rank() -> Iterator[DistInfo]:
    """A one-process group for calling the trainer's ``build`` and step functions directly."""
    from ppo.distributed import destroy_distributed, init_distributed

    info = init_distributed("cpu")
    yield info
    destroy_distributed()
