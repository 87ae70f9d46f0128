"""scripts/bench_scaling.py end to end at its ``--quick`` sizes (each point a train_ppo run in its own
process), and bench_overhead.py's ``--floor`` table beside a short trainer run."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))
import bench_overhead  # noqa: E402
import bench_scaling  # noqa: E402


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[list[dict], list[dict]]:
    assert bench_scaling.main(["--quick", "--json", *argv]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    return [x for x in lines if x["kind"] == "point"], [x for x in lines if x["kind"] == "fit"]


@pytest.mark.slow
def test_quick_batch_axis(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "scaling.png"
    points, fits = run_json(capsys, "--axes", "batch", "--png", str(png))
    assert [(p["series"], p["x"], p["steps"]) for p in points] == [("batch", 2, 1), ("batch", 4, 1)]
    # ignore_eos: every response has the point's 8 tokens, so the work is what the point set.
    assert [p["response_tokens"] for p in points] == [8.0, 8.0]
    assert [p["work"] for p in points] == [p["tokens"] for p in points]  # one rank: tokens per rank
    for p in points:
        assert {"gen", "ref", "values", "update_actor", "update_critic", "step"} <= set(p["timing_s"])
        assert math.isclose(p["step_s"], p["timing_s"]["step"])
        assert math.isclose(p["gen_s"] + p["score_s"] + p["train_s"] + p["other_s"], p["step_s"])
    assert [f["series"] for f in fits] == ["batch"]
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_quick_turns_axis_has_exact_turns(capsys: pytest.CaptureFixture[str]) -> None:
    """The rigged policy writes 8 forced characters per turn (the stop string), so a trajectory of t
    turns has exactly 8 t generated tokens (the trainer's response length counts the policy's tokens,
    not the environment's 8-token answers)."""
    points, _ = run_json(capsys, "--axes", "turns")
    assert [(p["x"], p["response_tokens"]) for p in points] == [(1, 8.0), (2, 16.0)]


@pytest.mark.slow
def test_overhead_floor_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--trl", "no", "--floor", "--floor-reps", "1", "--steps", "3", "--rounds", "1"]
    assert bench_overhead.main([*argv, "--num-prompts", "4", "--response-len", "8", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    ours, floor = lines[0], lines[1:]
    assert ours["trainer"] == "ours"
    assert [r["phase"] for r in floor] == [*bench_overhead.OUR_PHASES, "sum"]
    for r in floor[:-1]:
        assert r["trainer_s"] == ours[f"{r['phase']}_s"]
        assert math.isclose(r["gap_s"], r["trainer_s"] - r["floor_s"])
    assert math.isclose(floor[-1]["floor_s"], sum(r["floor_s"] for r in floor[:-1]))
