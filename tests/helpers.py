"""What the test files share: the repository's paths; importing a script; Parquet files of rows; the
overrides naming a demo's model and data (``demo_inputs``: the schema's defaults name none); short PPO
runs on the tiny assets and their metrics; launching a script on 2 gloo ranks and reading its
checks; comparing tensors (``close``, ``t64``, relative gradient errors); a tiny Llama config.

Test files and the files that torchrun runs as workers import these as ``tests.helpers`` (the repository
root is on their ``PYTHONPATH``); the fixtures are in ``tests/conftest.py``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

ROOT = Path(__file__).resolve().parents[1]

VERL_SIDE = ROOT / ".verl091"
"""verl 0.9.1 installed without its dependencies (``make parity-env``): the release the parity tests
compare against; absent until built. Its ``.installed`` names the Python it was built for (its compiled
modules load in that one only)."""


def verl_side_ready() -> bool:
    """Whether ``VERL_SIDE`` is built, for this Python (CI's release lanes run the unit tests on other
    versions than the lock's, beside a side folder built for the lock's)."""
    marker = VERL_SIDE / ".installed"
    built_for = marker.read_text().strip() if marker.is_file() else ""
    return (VERL_SIDE / "verl").is_dir() and built_for == f"{sys.version_info.major}.{sys.version_info.minor}"


def import_verl(*modules: str) -> list[Any] | None:
    """verl's ``modules`` (dotted names) from ``VERL_SIDE``, or None where it is not ready
    (``verl_side_ready``).

    verl.protocol imports ray for type names only, so where ray is not installed a stand-in module with
    those names takes its place: importing the math needs no cluster."""
    if not verl_side_ready():
        return None
    if str(VERL_SIDE) not in sys.path:
        sys.path.insert(0, str(VERL_SIDE))
    if "ray" not in sys.modules:
        try:
            import ray  # noqa: F401
        except ImportError:
            import types

            stub = types.ModuleType("ray")
            stub.ObjectRef = type("ObjectRef", (), {})
            sys.modules["ray"] = stub
    return [importlib.import_module(name) for name in modules]


TRL_SIDE = ROOT / ".trl_side"
"""TRL and math-verify installed without their dependencies (``make trl-env``, which ``make test`` runs):
TRL's shipped reward functions, which the TRL tests import as a user's reward file does; absent until
built."""


def trl_rewards() -> Any:
    """``trl.rewards``, from the environment or else ``TRL_SIDE`` (appended to ``sys.path``, so the
    project's own packages stay first); the calling test skips where neither has it."""
    import pytest

    if TRL_SIDE.is_dir() and str(TRL_SIDE) not in sys.path:
        sys.path.append(str(TRL_SIDE))
    return pytest.importorskip("trl.rewards", reason="TRL is not installed (`make trl-env` puts it beside)")


REWARD_FNS = ROOT / "tests" / "reward_fns.py"
"""Reward functions the end-to-end runs load with ``reward.custom_function=FILE:NAME``."""

# Triton reads TRITON_INTERPRET when it is first imported, and importing transformers models imports
# triton: set it before any test module loads, wherever no GPU can run the kernels for real.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests never reach the Hugging Face hub: a hub id a test names (a preset's Qwen/...) is checked against the
# cache only; the tests of the hub check set their own endpoint.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def load_script(name: str) -> Any:
    """Import a file under scripts/ as a module (scripts are not a package)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: dataclasses defined in the script look it up
    spec.loader.exec_module(module)
    return module


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    """Write ``rows`` (dicts with the same keys) as a Parquet file; returns ``path``."""
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def arith_row(a: int, b: int, **extra: Any) -> dict[str, Any]:
    """A prompt row of the synthetic task in verl's layout: ``a + b``, its sum the rule's ground truth."""
    return {
        "data_source": "synthetic/arith",
        "prompt": [{"role": "user", "content": f"{a} + {b}"}],
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"index": a},
        **extra,
    }


DEMO_INPUTS = {
    "PPOConfig": ("sft", ["data/train.parquet"], ["data/val.parquet"]),
    "SFTConfig": ("base", ["data/sft_train.parquet"], ["data/sft_val.parquet"]),
    "RewardModelConfig": ("sft", ["data/pref_train.parquet"], ["data/pref_val.parquet"]),
    "DPOConfig": ("sft", ["offline/train.parquet"], []),
}
"""Each schema's demo inputs under the assets folder, as its preset names them (``configs/demo_cpu.yaml``,
``sft_demo.yaml``, ``rm_demo.yaml``, ``dpo_demo.yaml``): the model, the training files, the validation
files."""


def demo_inputs(cls: type | None = None, assets: Path | str = "assets") -> list[str]:
    """Overrides naming the demo's model and data files for ``cls`` (default ``PPOConfig``), whose defaults
    name none: ``model.path``, ``data.train_files`` and ``data.val_files`` (none for DPO) under ``assets``
    (``make assets``' folder, relative to the repository's root). A config check that never reads them names
    them all the same, as a run must."""
    model, train, val = DEMO_INPUTS[cls.__name__ if cls is not None else "PPOConfig"]
    out = [f"model.path={assets}/{model}", f"data.train_files=[{','.join(f'{assets}/{f}' for f in train)}]"]
    return out + ([f"data.val_files=[{','.join(f'{assets}/{f}' for f in val)}]"] if val else [])


def load_error(
    path: Path | str | None = None, overrides: list[str] | None = None, cls: type | None = None
) -> str:
    """The message of the ConfigError that loading the preset at ``path`` with ``overrides`` into ``cls``
    (default ``PPOConfig``) raises; it must be one line."""
    from ppo.config import ConfigError
    from ppo.config_loader import load_config

    with pytest.raises(ConfigError) as e:
        load_config(path, overrides or [], cls)
    message = str(e.value)
    assert "\n" not in message, message
    return message


def override_error(*overrides: str) -> str:
    """``load_error`` of command-line ``overrides`` alone."""
    return load_error(None, list(overrides))


# ----------------------------------------------------------------------------------------------------
# PPO runs on the tiny assets
# ----------------------------------------------------------------------------------------------------

NONDETERMINISTIC = ("timing_s/", "perf/throughput", "perf/max_memory")
"""Prefixes of the metrics that differ between two identical runs (wall-clock times and memory)."""


def base_args(assets: Path, out: Path, steps: int = 2) -> list[str]:
    """Overrides of a short PPO run on ``tiny_assets``: 4 prompts x 2 responses a step, 12 response
    tokens, ``digit_score`` as the reward, metrics in ``out/metrics.jsonl``."""
    return [
        f"model.path={assets / 'base'}",
        f"data.train_files={assets / 'data' / 'train.parquet'}",
        f"data.val_files={assets / 'data' / 'val.parquet'}",
        "data.max_val_samples=8",
        "data.max_response_length=12",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=2",
        "rollout.n=2",
        f"trainer.total_training_steps={steps}",
        f"trainer.output_dir={out}",
        "trainer.logger=[console,jsonl]",
        f"reward.custom_function={REWARD_FNS}:digit_score",
        "actor.optim.lr=1e-3",
        "critic.optim.lr=1e-3",
    ]


def run(args: list[str]) -> int:
    """``train_ppo.main(args)`` in this process (one rank); its exit code."""
    import train_ppo  # not at import: the torchrun workers import this file too

    return train_ppo.main(args)


def train(assets: Path, out: Path, *overrides: str, steps: int = 2) -> list[dict[str, float]]:
    """A run of ``base_args`` plus ``overrides`` that must succeed; its metrics rows."""
    assert run(base_args(assets, out, steps) + list(overrides)) == 0
    return read_metrics(out)


def saved_run(assets: Path, out: Path, *overrides: str, steps: int = 1) -> Path:
    """A run that checkpoints every step and validates never; the folder of its last checkpoint."""
    train(assets, out, "trainer.save_freq=1", "trainer.val_before_train=false", *overrides, steps=steps)
    return out / "checkpoints" / f"step_{steps:08d}"


def read_metrics(out: Path) -> list[dict[str, float]]:
    """The rows of a run's ``metrics.jsonl`` (PPO and the stages write the same file)."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def deterministic(
    rows: list[dict[str, float]], drop: tuple[str, ...] = NONDETERMINISTIC
) -> list[dict[str, float]]:
    """Metrics rows without the keys starting with a prefix in ``drop`` (those that vary run to run)."""
    return [{k: v for k, v in row.items() if not k.startswith(drop)} for row in rows]


def hf_weights(out: Path) -> dict[str, torch.Tensor]:
    """The tensors of the model a run exported to ``out/hf`` (``trainer.save_hf_on_end``)."""
    from safetensors.torch import load_file

    return load_file(out / "hf" / "model.safetensors")


def launch(args: list[str], *, nproc: int = 1, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``train_ppo.py args`` in a new process (under ``torch.distributed.run`` when ``nproc > 1``), one
    CPU thread a rank, stderr piped as text; for the tests that signal a running trainer."""
    prefix = [sys.executable]
    if nproc > 1:
        prefix += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen(
        [*prefix, str(ROOT / "train_ppo.py"), *args], stderr=subprocess.PIPE, text=True, env=env
    )


def wait_until(proc: subprocess.Popen, done: Callable[[], bool], timeout: float = 300) -> None:
    """Poll ``done()`` until it holds; fails if ``proc`` exits first or ``timeout`` seconds pass."""
    deadline = time.time() + timeout
    while not done():
        assert proc.poll() is None, "the run ended first"
        assert time.time() < deadline, f"not done within {timeout} s"
        time.sleep(0.02)


def has_metrics(out: Path) -> Callable[[], bool]:
    """Whether the run in ``out`` has logged its first row (for ``wait_until``)."""
    path = out / "metrics.jsonl"
    return lambda: path.is_file() and bool(path.read_text().strip())


# ----------------------------------------------------------------------------------------------------
# Several ranks
# ----------------------------------------------------------------------------------------------------


def torchrun(
    script: Path | str, *args: object, nproc: int = 2, timeout: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``script args`` on ``nproc`` gloo ranks under ``torch.distributed.run``, one CPU thread each, from
    the repository root with the repository importable (and ``env`` added to the environment); stdout and
    stderr captured."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(
        [*cmd, str(script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


CRASH_MARKERS = ("Fatal Python error", "terminate called", "Segmentation fault", "*** Error in", "free(): ")
"""How a process that died in native code announces it (faulthandler; libstdc++'s std::terminate; glibc)."""


def excerpt(output: str, tail: int = 3000) -> str:
    """A process's output for an assertion message: its last ``tail`` characters, and first, where a
    process crashed in native code (``CRASH_MARKERS``), the crash report's head: the fatal error's name
    and the stacks that faulthandler prints before its list of extension modules, which a tail alone
    cuts off."""
    starts = [i for marker in CRASH_MARKERS if (i := output.find(marker)) >= 0]
    if not starts or min(starts) >= len(output) - tail:
        return output[-tail:]
    head = output[min(starts) : min(starts) + tail]
    return f"{head}\n[...]\n{output[-tail:]}"


def worker_results(script: Path | str, *args: object, out: Path, timeout: float = 240) -> dict[str, Any]:
    """Run a test file as a 2-rank worker (``script args``) and read the results JSON its rank 0 wrote to
    ``out`` (one of ``args``): ``{check: {"ok", "detail"}}``, plus ``_log``, the end of the workers'
    output (also when they timed out), for the message of a check that never ran."""
    try:
        proc = torchrun(script, *args, timeout=timeout)
        log = proc.stdout[-4000:] + excerpt(proc.stderr, 8000)
    except subprocess.TimeoutExpired as err:
        log = f"worker timed out: {err}"
    return read_results(out, log)


class Checks:
    """The worker side of ``worker_results``: each check's verdict and detail, written to ``out`` by rank 0
    after every check (a worker that dies leaves the checks it finished). With ``agree`` a verdict is the
    same on every rank (the min over ranks: a collective, so every rank records every check in order).

    ``with checks:`` around a worker's body records an exception as the ``_error`` check (its traceback,
    which ``assert_check`` shows) before it propagates, and destroys the process group either way."""

    def __init__(self, out: Path, is_main: bool, *, agree: bool = False) -> None:
        self.out, self.is_main, self.agree = out, is_main, agree
        self.results: dict[str, dict[str, Any]] = {}

    def __enter__(self) -> Checks:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: Any) -> None:
        from ppo.distributed import destroy_distributed

        if isinstance(error, Exception):  # no collective here: the other rank may be elsewhere
            trace = "".join(traceback.format_exception(kind, error, tb))
            self.results["_error"] = {"ok": False, "detail": trace}
            self._write()
        destroy_distributed()

    def record(self, name: str, ok: bool, detail: Any) -> None:
        """Check ``name`` passed (``ok``) or not; ``detail`` explains a failure."""
        if self.agree:
            from ppo.distributed import all_reduce_scalar

            ok = all_reduce_scalar(float(bool(ok)), "min") > 0
            detail = f"rank {torch.distributed.get_rank()}: {detail}"
        self.results[name] = {"ok": bool(ok), "detail": str(detail)}
        self._write()

    def _write(self) -> None:
        if self.is_main:
            self.out.write_text(json.dumps(self.results, indent=1))

    def within(self, name: str, diff: float, atol: float) -> None:
        """Check ``name``: ``diff <= atol``."""
        self.record(name, diff <= atol, f"max |diff| = {diff:.3g} (atol {atol})")


def read_results(out: Path, log: str) -> dict[str, Any]:
    """The results JSON a worker wrote to ``out`` (empty if it wrote none), with ``log`` as ``_log``."""
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


def t64(*rows: object) -> torch.Tensor:
    """A float64 tensor from nested lists (hand-derived values are checked in float64): ``t64([1, 2])``
    or ``t64([1, 2], [3, 4])``."""
    return torch.tensor(rows[0] if len(rows) == 1 else rows, dtype=torch.float64)


def close(actual: torch.Tensor, expected: object, atol: float = 1e-6) -> None:
    """``actual`` equals ``expected`` (a tensor or nested lists) within ``atol``, in ``actual``'s dtype."""
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0, atol=atol)


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


def tiny_config(config_class: type[PretrainedConfig] | None = None, **overrides: Any) -> PretrainedConfig:
    """A 2-layer Llama (or ``config_class``, e.g. ``Qwen2Config``) small enough for CPU tests (GQA: 4 query
    heads over 2 key/value heads, both divisible by a sequence-parallel size of 2); eos id 2, bos id 1,
    no pad token."""
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
    return (config_class or LlamaConfig)(**kwargs)


def waiting_env(base: type, calls: list[str], release: threading.Event, *, done: bool) -> type:
    """A subclass of the environment class ``base`` whose ``step`` appends "start" to ``calls``, waits for
    ``release`` (60 s at most, so that a turn loop that waited for it fails instead of hanging), appends
    "end" and returns ``("", 1.0, done)``: which of a turn's calls began, and whether any returned."""

    class Waiting(base):
        def step(self, action: str) -> tuple[str, float, bool]:
            calls.append("start")
            release.wait(60)
            calls.append("end")
            return "", 1.0, done

    return Waiting
