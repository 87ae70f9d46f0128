"""What the test files share: the tiny local assets (tokenizer, models, synthetic task), built once per
session; launching a script on 2 gloo ranks; comparing tensors; a tiny Llama config.

The files that torchrun runs as workers import these as ``tests.conftest`` (the repository root is on
their ``PYTHONPATH``), as the test files do.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

if TYPE_CHECKING:
    from transformers import LlamaConfig

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


# ----------------------------------------------------------------------------------------------------
# Several ranks
# ----------------------------------------------------------------------------------------------------


def torchrun(
    script: Path | str, *args: object, nproc: int = 2, timeout: float = 600
) -> subprocess.CompletedProcess:
    """``script args`` on ``nproc`` gloo ranks under ``torch.distributed.run``, one CPU thread each, from
    the repository root with the repository importable; stdout and stderr captured."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [*cmd, str(script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def worker_results(script: Path | str, *args: object, out: Path, timeout: float = 240) -> dict[str, Any]:
    """Run a test file as a 2-rank worker (``script args``) and read the results JSON its rank 0 wrote to
    ``out`` (one of ``args``): ``{check: {"ok", "detail"}}``, plus ``_log``, the end of the workers'
    output (also when they timed out), for the message of a check that never ran."""
    try:
        proc = torchrun(script, *args, timeout=timeout)
        log = proc.stdout[-4000:] + proc.stderr[-8000:]
    except subprocess.TimeoutExpired as err:
        log = f"worker timed out: {err}"
    results = json.loads(out.read_text()) if out.is_file() else {}
    results["_log"] = log
    return results


def assert_check(results: dict[str, Any], check: str) -> None:
    """One check of ``worker_results``: it ran (else the workers' error and log) and passed."""
    if check not in results:
        error = results.get("_error", {}).get("detail", "")
        pytest.fail(f"worker did not reach {check}:\n{error}\n{results['_log']}")
    assert results[check]["ok"], f"{check}: {results[check]['detail']}"


# ----------------------------------------------------------------------------------------------------
# Comparing tensors
# ----------------------------------------------------------------------------------------------------

GRAD_RTOL = 1e-5
"""Gradients span orders of magnitude across parameters (1e-7 to 1e-2 in the tiny models), so an absolute
tolerance would pass a small gradient off by 2x: compare each parameter's error with its own largest
gradient (``rel_diff``; fp32 summation-order noise is ~1e-6 of it)."""


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a - b|`` in fp32."""
    return (a.float() - b.float()).abs().max().item()


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a - b| / max|b|``."""
    return max_diff(a, b) / max(b.abs().max().item(), 1e-30)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) parameter or gradient gathered whole (a collective); plain tensors as they are."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def grad_rel_diff(sharded: torch.nn.Module, ref: torch.nn.Module) -> float:
    """The largest ``rel_diff`` of a (sharded) model's gradients to a reference model's, parameter by
    parameter. A collective with DTensor gradients: every rank walks the parameters in the same order."""
    ref_grads = dict(ref.named_parameters())
    return max(rel_diff(full_tensor(p.grad), ref_grads[n].grad) for n, p in sharded.named_parameters())


# ----------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------

VOCAB = 128
"""Vocabulary of ``tiny_config``."""


def tiny_config(**overrides: Any) -> LlamaConfig:
    """A 2-layer Llama small enough for CPU tests (GQA: 4 query heads over 2 key/value heads, both
    divisible by a sequence-parallel size of 2); eos id 2, bos id 1, no pad token."""
    from transformers import LlamaConfig  # not at import: TRITON_INTERPRET is set above first

    kwargs = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)
