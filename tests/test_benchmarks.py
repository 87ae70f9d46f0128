"""Smoke tests of scripts/bench_rollout.py and scripts/bench_step.py at tiny sizes, in-process.

The rows must parse as JSON and hold the expected columns; the padded baseline of bench_step must give
the same log-probs and values as the trainer's packed forwards (else its timings compare different
work), and so must the packed forwards with transformers' dense-mask sdpa (``packed_dense``). The
overhead mode (issue 12) runs the real trainer for a few steps, without TRL.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# Imported by name (not by path): bench_step imports bench_rollout, and the dataclasses of both need
# their modules in sys.modules.
sys.path.insert(0, str(ROOT / "scripts"))
import bench_rollout  # noqa: E402
import bench_step  # noqa: E402

ROLLOUT_COLUMNS = {
    "path",
    "world_size",
    "num_prompts",
    "new_tokens",
    "time_s",
    "tokens_per_s",
    "ratio",
    "match",
    "gather_s",
}
STEP_COLUMNS = {
    "path",
    "pad_frac",
    "real_tokens",
    "computed_tokens",
    "attn_entries",
    "gen_s",
    "old_log_prob_s",
    "ref_s",
    "values_s",
    "update_s",
    "train_s",
    "tokens_per_s",
    "speedup",
    "expected",
}


@pytest.fixture(autouse=True)
def single_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Run as one rank without torchrun, and restore torch's thread count afterwards."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def json_rows(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_bench_rollout_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--json", "--num-prompts", "4", "--prompt-len", "8", "--new-tokens", "4"]
    assert bench_rollout.main([*argv, "--micro-batch", "2", "--repeat", "1"]) == 0
    rows = json_rows(capsys.readouterr().out)
    assert [r["path"] for r in rows] == ["hf_generate", "ppo_rollout"]
    for row in rows:
        assert ROLLOUT_COLUMNS <= set(row), ROLLOUT_COLUMNS - set(row)
        assert row["tokens_per_s"] > 0 and row["num_prompts"] * row["new_tokens"] == 16
    assert rows[0]["ratio"] == 1.0 and rows[1]["ratio"] > 0
    # Greedy decoding of the same weights: our rollout on the sharded model makes the same tokens.
    assert rows[1]["match"] == 1.0


def test_bench_rollout_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--num-prompts", "2", "--prompt-len", "4", "--new-tokens", "2", "--repeat", "1"]
    assert bench_rollout.main(argv) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:2] == ["path", "device"]
    assert "ppo_rollout / hf_generate =" in out


def test_bench_step_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--json", "--num-seqs", "8", "--prompt-len", "8", "--min-response", "1", "--max-response", "12"]
    assert bench_step.main([*argv, "--micro-batch", "2", "--repeat", "1"]) == 0
    rows = json_rows(capsys.readouterr().out)
    assert [r["path"] for r in rows] == list(bench_step.PATHS)
    for row in rows:
        assert STEP_COLUMNS <= set(row), STEP_COLUMNS - set(row)
        assert all(math.isfinite(row[k]) and row[k] >= 0 for k in STEP_COLUMNS - {"path"})
    padded, packed = rows[0], rows[1]
    assert padded["pad_frac"] > 0 and packed["pad_frac"] == 0
    # Same sequences, same micro-batches: the packed path feeds exactly the real tokens.
    assert packed["computed_tokens"] == 5 * packed["real_tokens"]  # old, ref, values, critic, actor
    assert padded["computed_tokens"] > packed["computed_tokens"]
    assert padded["speedup"] == 1.0 and packed["expected"] > 1.0
    # Per-sequence attention (the trainer's) against transformers' dense T x T mask: sum(l_i^2) < T^2.
    dense = rows[bench_step.PATHS.index("packed_dense")]
    assert packed["attn_entries"] < dense["attn_entries"]
    assert dense["computed_tokens"] == packed["computed_tokens"]


def test_padded_forwards_match_packed() -> None:
    """The padded baseline and the dense-mask packed path compute what the trainer's packed path does,
    so their timings compare the same work."""
    from ppo.distributed import destroy_distributed, init_distributed

    args = bench_step.parse_args(
        ["--num-seqs", "4", "--prompt-len", "10", "--max-response", "8", "--micro-batch", "2"]
    )
    bench_rollout.set_threads(args.threads)
    info = init_distributed("cpu")
    try:
        args.clock = "cpu"
        results = {}
        batch = None
        for path in ("packed", "padded", "packed_dense"):
            layout, attn, plan = bench_step.path_setup(args, path, info.device)
            nets = bench_step.build_models(args, info, attn)
            # Each path loads its models with its own attention (a parameter, nothing patched).
            assert {net.config._attn_implementation for net in nets.values()} == {attn}
            if batch is None:
                batch, _ = bench_step.make_batch(args, info, nets["actor"])
                assert len(set(batch.seq_lens)) > 1  # lengths differ, so there is padding to get wrong
            work = bench_step.Work()
            logprobs = bench_step.score(layout, nets["actor"], batch, plan, work)
            values = bench_step.score(layout, nets["critic"], batch, plan, work, critic=True)
            assert work.real == 2 * sum(batch.seq_lens)
            assert (work.computed > work.real) == (path == "padded")
            results[path] = (logprobs, values)
        mask = batch.response_mask
        for path in ("padded", "packed_dense"):
            for got, want in zip(results[path], results["packed"], strict=True):
                torch.testing.assert_close(got[mask], want[mask], atol=2e-5, rtol=1e-5)
        assert results["packed"][0][mask].abs().sum() > 0 and (results["packed"][0][~mask] == 0).all()
    finally:
        destroy_distributed()


def test_step_clock_counts_step_lines_only() -> None:
    """The overhead mode's step clock reads the trainer's progress lines, not warnings about a step."""
    import logging

    clock = bench_step.StepClock()
    for message in (
        "[##--] step 1/4 0s",
        "step 2: the mean score moved",
        "[###-] step 2/4 1s",
        "[####] step 3/4",
    ):
        clock.emit(logging.LogRecord("ppo", logging.INFO, __file__, 0, message, None, None))
    assert [m[0] for m in clock.marks] == [1, 2, 3]
    cpu, wall = clock.step_times(skip=2)
    assert len(cpu) == len(wall) == 1 and cpu[0] >= 0 and wall[0] >= 0  # step 3 only


def test_bench_step_overhead_json(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 12's mode runs the real trainer (train_ppo.main) and reads its metrics; TRL left out."""
    argv = ["--mode", "overhead", "--json", "--trl", "no", "--num-prompts", "4", "--response-len", "4"]
    assert bench_step.main([*argv, "--steps", "4", "--rounds", "1"]) == 0
    rows = json_rows(capsys.readouterr().out)
    assert [r["trainer"] for r in rows] == ["ours"]
    row = rows[0]
    assert row["steps"] == 2  # steps 3 and 4
    assert 0 < row["step_cpu_min_s"] <= row["step_cpu_s"] <= row["step_cpu_max_s"]
    for phase in bench_step.OUR_PHASES:
        assert row[f"{phase}_s"] is not None and row[f"{phase}_s"] >= 0, phase
    # Updates ran: 2 epochs x 2 mini-batches for critic and actor, timed inside the step.
    assert 0 < row["update_actor_s"] < row["step_wall_s"] and row["vs_trl"] is None
