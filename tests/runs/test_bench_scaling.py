"""ppo_bench.scaling end to end at its ``--quick`` sizes (each point a train_ppo run in its own
process), and ppo_bench.overhead_floor's table beside a short trainer run and, interleaved, beside
the trainer's step functions."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from ppo_bench import overhead, overhead_floor, scaling


def run_json(
    capsys: pytest.CaptureFixture[str], *argv: str, kinds: tuple[str, ...] = ("point", "fit")
) -> tuple:
    assert scaling.main(["--quick", "--json", *argv]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    return tuple([x for x in lines if x["kind"] == kind] for kind in kinds)


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
    points, profile, (model,) = run_json(
        capsys, "--axes", "turns", kinds=("point", "turn_profile", "turn_model")
    )
    assert [(p["x"], p["response_tokens"]) for p in points] == [(1, 8.0), (2, 16.0)]
    # The profile's forwards were counted as the arithmetic says (profile_turns checks it, or raises):
    # 8 rows, 8 one-token forwards a turn (the first reads each row's last prompt token, the prompt's
    # other tokens come from the kept cache) and 8 generated tokens.
    assert [(p["turns"], p["decode_steps"], p["generated_tokens"]) for p in profile] == [
        (1, 8, 64),
        (2, 16, 128),
    ]
    for p in profile:
        assert math.isclose(p["gen_cpu_s"], p["prefill_s"] + p["decode_s"] + p["rest_s"])
    assert {"prefill_ms_per_ktok", "decode_ms_per_step", "rest_ms_per_call", "prefill_k"} <= set(model)


@pytest.mark.slow
def test_quick_ranks_axis(capsys: pytest.CaptureFixture[str]) -> None:
    """Weak and strong scaling over 2 ranks: torchrun points beside 1-rank ones, a fit per series. The
    independent pair is not in a quick run (whether two processes train at once is the machine's timing;
    its pieces, ``overlapping_steps`` and ``combine``, are tested in tests/unit/test_bench_scaling.py)."""
    points, fits = run_json(capsys, "--axes", "ranks")
    assert [(p["series"], p["x"], p["work"]) for p in points] == [
        ("ranks/weak", 1, 1.0), ("ranks/weak", 2, 2.0), ("ranks/strong", 1, 1.0), ("ranks/strong", 2, 2.0),
    ]  # fmt: skip
    assert [p["response_tokens"] for p in points] == [8.0] * 4  # ignore_eos: the point's 8 tokens each
    assert "processes" not in points[-1]
    assert [f["series"] for f in fits] == ["ranks/weak", "ranks/strong"]


@pytest.mark.slow
def test_overhead_floor_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--floor-reps", "1", "--steps", "3", "--rounds", "1", "--num-prompts", "4", "--response-len", "8"]
    assert overhead_floor.main([*argv, "--json"]) == 0
    floor = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["phase"] for r in floor] == [*overhead.OUR_PHASES, "sum"]
    for r in floor[:-1]:
        assert r["trainer_s"] is not None and r["trainer_s"] > 0 and r["floor_s"] > 0, r
        assert math.isclose(r["gap_s"], r["trainer_s"] - r["floor_s"])
    assert math.isclose(floor[-1]["trainer_s"], sum(r["trainer_s"] for r in floor[:-1]))
    assert math.isclose(floor[-1]["floor_s"], sum(r["floor_s"] for r in floor[:-1]))


@pytest.mark.slow
def test_overhead_interleaved_floor(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--interleave``: the trainer's step functions make a real step (2 epochs x 2 mini-batches: 4 AdamW
    steps of each model), and the table alternates them with the bare calls, phase by phase."""
    from ppo.distributed import destroy_distributed

    args = overhead.parse_args(["--num-prompts", "4", "--response-len", "8"])
    paths = overhead.write_assets(tmp_path, args)
    calls, run = overhead_floor.trainer_calls(args, paths, tmp_path / "ours")
    try:
        for phase in overhead.OUR_PHASES:
            calls[phase]()
        assert run.state.step == 1
        for trained in (run.actor, run.critic):
            assert {float(s["step"]) for s in trained.optimizer.state.values()} == {4.0}
    finally:
        destroy_distributed()
    argv = ["--interleave", "--floor-reps", "2", "--num-prompts", "4", "--response-len", "8", "--json"]
    assert overhead_floor.main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["phase"] for r in rows] == [*overhead.OUR_PHASES, "sum"]
    for r in rows:
        assert math.isclose(r["gap_s"], r["trainer_s"] - r["floor_s"])
    assert math.isclose(rows[-1]["trainer_s"], sum(r["trainer_s"] for r in rows[:-1]))
