"""The pure parts of ppo_bench.prefix (the prompt once per group, off against on): the grid and the runs it
plans, the exact-length prompts, the trainer's overrides per mode, a row from a run's metrics, the speedups,
the multi-turn fits (ppo_bench.prefix_turns), the target checks, the table, JSON and figure, and the summary
line gpu_summary.py makes of the GPU stage's JSON. No run is timed here."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from ppo_bench import prefix, prefix_turns, runs
from ppo_bench.prefix import Point

from tests.helpers import load_script

HEADLINE = Point(1024, 32, 8)
DEMO = prefix.FULL.demo


def test_plan_of_the_default_run() -> None:
    points = prefix.plan(list(prefix.DEFAULT_PARTS), prefix.FULL, prompts_per_rank=1)
    grid = [p for p in points if p.estimator == "grpo" and not p.turns]
    assert [(p.prompt_len, p.response_len, p.n) for p in grid] == [
        (length, response, g) for length in (16, 256, 1024) for response in (32, 256) for g in (1, 4, 8, 16)
    ]
    # The headline point holds the toggles (each key alone); every other grid point runs off and on.
    modes = {(p.prompt_len, p.response_len, p.n): p.modes for p in grid}
    assert modes.pop((1024, 32, 8)) == ("off", "on", "rollout_only", "train_only")
    assert set(modes.values()) == {("off", "on")}
    assert {p.prompts_per_rank for p in grid} == {1} and {p.steps for p in grid} == {0}  # 0: --steps
    gae, demo = [p for p in points if p.estimator == "gae"]
    assert gae == Point(1024, 32, 8, "gae")
    # configs/demo_cpu.yaml's shapes: 32 prompts on 2 ranks, n 8, 16-token prompts, 28 response tokens.
    assert demo == Point(16, 28, 8, "gae", prompts_per_rank=16, steps=3, repeats=2)
    # A turn is 8 generated tokens and the 8-token observation: the response budget holds exactly t turns.
    assert [
        (p.turns, p.response_len, p.prompt_len, p.n, p.prompts_per_rank, p.modes) for p in points if p.turns
    ] == [(t, 16 * t, 16, 4, 4, ("off", "rollout_only")) for t in (2, 4, 8)]
    # 24 grid points x 2 + 2 toggles + 2 GAE + 2 modes x 2 repeats at the demo + 3 x 2 multi-turn = 62 runs.
    assert sum(len(prefix.run_order(p)) for p in points) == 62


def test_plan_merges_points_and_selects_parts() -> None:
    quick = prefix.plan(["grid", "gae", "demo", "turns"], prefix.QUICK, prompts_per_rank=1)
    # A quick run's demo point is its GAE point: the same runs, once.
    assert [(p.estimator, p.prompt_len, p.response_len, p.n, p.turns) for p in quick] == [
        ("grpo", 32, 8, 4, 0), ("gae", 32, 8, 4, 0), ("grpo", 16, 16, 2, 1), ("grpo", 16, 32, 2, 2),
    ]  # fmt: skip
    assert prefix.plan(["headline", "demo"], prefix.FULL, prompts_per_rank=8) == [
        Point(1024, 32, 8, prompts_per_rank=8),
        DEMO,
    ]
    # The headline point and its toggles: one point, the union of the modes in MODES' order.
    (head,) = prefix.plan(["toggles", "headline"], prefix.FULL, prompts_per_rank=1)
    assert head.modes == ("off", "on", "rollout_only", "train_only")
    assert prefix.run_order(DEMO) == ["off", "on", "off", "on"]  # interleaved: a load change falls on both
    assert prefix.run_order(head) == ["off", "on", "rollout_only", "train_only"]


def test_parse_args_parts() -> None:
    assert prefix.parse_args([]).parts == ["grid", "toggles", "gae", "demo", "turns"]
    assert prefix.parse_args(["--quick"]).parts == ["grid", "gae", "demo", "turns"]  # toggles: 2 more runs
    assert prefix.parse_args(["--parts", "headline, demo"]).parts == ["headline", "demo"]
    with pytest.raises(SystemExit):
        prefix.parse_args(["--parts", "depth"])
    with pytest.raises(SystemExit):
        prefix.parse_args(["--steps", "1"])  # nothing after the warm-up step


def test_prompts_have_exactly_the_point_s_tokens() -> None:
    tokenizer = runs.repo_script("make_tiny_assets").build_tokenizer()
    for length in (16, 1024):
        rows = prefix.prompt_rows(5, length, seed=0, data_source="synthetic/arith")
        prefix.check_prompt_lengths(rows, tokenizer, length)  # raises on any other length
        # length - 1 characters, one token each, and the BOS the tokenizer adds to plain text.
        assert len(rows[0]["prompt"]) == length - 1
        assert len(tokenizer(rows[0]["prompt"])["input_ids"]) == length
        assert len({r["prompt"] for r in rows}) == 5  # distinct prompts: nothing shared across groups
        # Never the multi-turn part's forced character: generate matches its stop string across the prompt.
        assert not any("a" in r["prompt"] for r in rows)
    assert prefix.prompt_rows(2, 16, 0, "x") == prefix.prompt_rows(2, 16, 0, "x")
    assert prefix.prompt_rows(2, 16, 0, "x") != prefix.prompt_rows(2, 16, 1, "x")
    with pytest.raises(SystemExit, match="encodes to 17 tokens"):
        prefix.check_prompt_lengths(prefix.prompt_rows(1, 17, 0, "x"), tokenizer, 16)


PATHS = {
    "policy": Path("/p"),
    "forced": Path("/f"),
    "prompts_1024": Path("/d.parquet"),
    "prompts_256": Path("/e"),
}


def test_overrides_per_mode() -> None:
    args = prefix.parse_args(["--set", "trainer.device=cpu"])  # 2 ranks
    off = prefix.overrides(HEADLINE, "off", PATHS, Path("/o"), args)
    assert {
        "model.path=/p", "data.train_files=[/d.parquet]", "data.max_prompt_length=1024",
        "data.max_response_length=32", "rollout.n=8", "rollout.ignore_eos=true",
        "data.train_batch_size=2", "actor.ppo_mini_batch_size=2",  # one group on each of 2 ranks
        "rollout.micro_batch_size_per_gpu=8",  # a rank's 8 rows in one generate call
        "algorithm.adv_estimator=grpo", "actor.use_kl_loss=true", "algorithm.use_kl_in_reward=false",
        "actor.use_prefix_grouper=false", "rollout.reuse_prompt_cache=false",
    } <= set(off)  # fmt: skip
    assert off[-1] == "trainer.device=cpu"  # --set wins over the benchmark's settings
    for mode, grouper, cache in (("on", "true", "true"), ("rollout_only", "false", "true"),
                                 ("train_only", "true", "false")):  # fmt: skip
        cmd = prefix.overrides(HEADLINE, mode, PATHS, Path("/o"), args)
        assert {f"actor.use_prefix_grouper={grouper}", f"rollout.reuse_prompt_cache={cache}"} <= set(cmd)
    gae = prefix.overrides(Point(1024, 32, 8, "gae"), "on", PATHS, Path("/o"), args)
    assert {
        "algorithm.adv_estimator=gae",
        "actor.use_kl_loss=false",
        "algorithm.use_kl_in_reward=true",
    } <= set(gae)
    turns = prefix.overrides(
        Point(256, 64, 4, prompts_per_rank=2, turns=4), "rollout_only", PATHS, Path("/o"), args
    )
    assert "model.path=/f" in turns and "rollout.ignore_eos=true" not in turns
    assert {
        "rollout.multi_turn.max_assistant_turns=4", "rollout.multi_turn.stop=[aaaaaaaa]",
        "rollout.multi_turn.env=ppo_bench.scaling_turns:FixedAnswer", "data.train_batch_size=4",
        "rollout.micro_batch_size_per_gpu=8", "actor.use_kl_loss=false", "algorithm.use_kl_in_reward=false",
        "rollout.reuse_prompt_cache=true", "actor.use_prefix_grouper=false",
    } <= set(turns)  # fmt: skip


def metrics_line(step: int, gen: float, cpu: float | None = None) -> dict:
    return {
        "step": step,
        "timing_s/step": 12.0,
        "timing_s/gen": gen,
        "timing_s/old_log_prob": 0.25,
        "timing_s/ref": 1.0,
        "timing_s/values": 0.5,
        "timing_s/update_actor": 3.0,
        "timing_s/update_critic": 2.0,
        "timing_s/reward": 0.25,
        "response_length/mean": 28.0,
        "bench/cpu_s": cpu,
        "bench/wait_s": None,
    }


def test_summarize_pools_the_runs_of_a_mode_after_their_warm_up() -> None:
    # Two runs of 3 steps (repeats=2): steps 1 of each are warm-up; counted gens 2, 4 and 3, 5: median 3.5.
    metrics = [metrics_line(1, 100.0), metrics_line(2, 2.0, 1.0), metrics_line(3, 4.0)]
    metrics += [metrics_line(1, 50.0), metrics_line(2, 3.0, 2.0), metrics_line(3, 5.0, 3.0)]
    row = prefix.summarize(DEMO, "on", metrics, 30.0, warmup=1)
    # score = old log-probs + reference + values = 1.75; update = actor + critic = 5; other = 12 - 10.25.
    assert (row["gen_s"], row["score_s"], row["update_s"], row["step_s"]) == (3.5, 1.75, 5.0, 12.0)
    assert row["other_s"] == 1.75
    assert (row["cpu_s"], row["wait_s"]) == (2.0, None)  # median of the steps that have a clock: 1, 2, 3
    assert (row["steps"], row["run_s"], row["response_tokens"], row["mode"]) == (4, 30.0, 28.0, "on")
    assert (row["estimator"], row["prompt_len"], row["n"], row["prompts_per_rank"]) == ("gae", 16, 8, 16)
    assert row["timing_s"]["reward"] == 0.25
    with pytest.raises(ValueError, match="no step after"):
        prefix.summarize(DEMO, "on", metrics[:1], 1.0, warmup=1)


def row(point: Point, mode: str, gen: float, score: float, update: float, step: float) -> dict:
    return {
        "estimator": point.estimator, "prompt_len": point.prompt_len, "response_len": point.response_len,
        "n": point.n, "turns": point.turns, "prompts_per_rank": point.prompts_per_rank, "mode": mode,
        "gen_s": gen, "score_s": score, "update_s": update, "other_s": step - gen - score - update,
        "step_s": step, "response_tokens": float(point.turns * 8 or point.response_len), "cpu_s": None, "wait_s": 0.0,
        "steps": 2, "run_s": 10.0, "timing_s": {"step": step},
    }  # fmt: skip


def test_speedups_against_off_at_the_same_point() -> None:
    rows = prefix.with_speedups(
        [
            row(HEADLINE, "off", 2.0, 1.0, 4.0, 8.0),
            row(HEADLINE, "on", 1.0, 0.25, 1.0, 4.0),
            row(Point(16, 32, 8), "on", 1.0, 1.0, 1.0, 4.0),  # no off run of its point
            row(Point(256, 32, 4, turns=2), "off", 1.0, 0.0, 1.0, 2.0),  # no scoring forward
            row(Point(256, 32, 4, turns=2), "rollout_only", 0.5, 0.0, 1.0, 1.5),
        ]
    )
    speedups = [tuple(r[f"{p}_x"] for p in ("gen", "score", "update", "step")) for r in rows]
    assert speedups == [
        (1.0, 1.0, 1.0, 1.0),
        (2.0, 4.0, 4.0, 2.0),  # off's seconds over on's
        (None, None, None, None),
        (1.0, None, 1.0, 1.0),
        (2.0, None, 1.0, 2.0 / 1.5),
    ]


def turn_rows(gen: dict[str, list[float]]) -> list[dict]:
    return [
        row(Point(256, 16 * t, 4, turns=t), mode, g, 0.0, 1.0, 2.0 + g)
        for mode, values in gen.items()
        for t, g in zip((2, 4, 8), values, strict=True)
    ]


def test_turn_fits_and_check() -> None:
    # Kept cache: 0.25 s a turn exactly (k = 1, no intercept). Off: 0.1 t^2 (k = 2); its straight line by
    # hand: mean t 14/3, mean gen 2.8; sum dt dgen = (8/3)(2.4) + (2/3)(1.2) + (10/3)(3.6) = 19.2, sum dt^2 =
    # 168/9: slope 19.2 * 9 / 168 = 1.0285714, intercept 2.8 - slope * 14/3 = -2.0.
    fits = prefix_turns.turn_fits(turn_rows({"off": [0.4, 1.6, 6.4], "rollout_only": [0.5, 1.0, 2.0]}))
    assert [f["mode"] for f in fits] == ["off", "rollout_only"]
    off, kept = fits
    assert math.isclose(off["gen_k"], 2.0) and math.isclose(off["s_per_turn"], 172.8 / 168)
    assert math.isclose(off["intercept_s"], -2.0)
    assert math.isclose(kept["gen_k"], 1.0) and math.isclose(kept["s_per_turn"], 0.25)
    assert abs(kept["intercept_s"]) < 1e-12 and kept["turns"] == [2, 4, 8]
    assert list(kept)[:2] == ["mode", "prompt_len"] and set(prefix_turns.FIT_COLUMNS) <= set(kept)
    check = prefix_turns.turns_check(fits)
    assert (check["pass"], check["value"]) == (True, kept["gen_k"])
    # 0.5, 1.25, 3.2: log-log slope (log 6.4) / (log 4) = 1.339 > 1.2.
    steep = prefix_turns.turn_fits(turn_rows({"rollout_only": [0.5, 1.25, 3.2]}))
    assert abs(steep[0]["gen_k"] - math.log(6.4) / math.log(4)) < 1e-12
    assert prefix_turns.turns_check(steep)["pass"] is False
    assert prefix_turns.turns_check([])["pass"] is None  # not measured
    assert prefix_turns.turn_fits(turn_rows({"off": [1.0, 2.0, 4.0]})[:1]) == []  # one turn count: no fit


def checked_rows() -> tuple[list[dict], list[dict]]:
    rows = [
        row(HEADLINE, "off", 2.6, 3.0, 9.0, 15.0),
        row(HEADLINE, "on", 2.0, 1.0, 3.0, 6.6),  # 1.3x, 3x, 3x: each exactly at its target
        row(Point(1024, 32, 8, "gae"), "off", 2.6, 3.0, 9.0, 15.0),  # GAE's on run missing
        row(DEMO, "off", 1.0, 2.0, 4.0, 8.0),
        row(DEMO, "on", 1.03, 2.1, 3.0, 8.0),  # 3% slower (the bound), 5% slower, faster, the same
        *turn_rows({"off": [0.4, 1.6, 6.4], "rollout_only": [0.5, 1.0, 2.0]}),
    ]
    rows = prefix.with_speedups(rows)
    return rows, prefix_turns.turn_fits(rows)


def test_checks_against_the_targets() -> None:
    rows, fits = checked_rows()
    checks = prefix.checks(rows, fits, prefix.FULL, prompts_per_rank=1)
    assert [(c["value"], c["pass"]) for c in checks] == [
        (3.0, True), (3.0, True), (1.3, True),  # GRPO headline: score, update, gen
        (None, None), (None, None), (None, None),  # GAE headline: not measured
        (1.03, True), (1.05, False), (0.75, True), (1.0, True),  # demo: gen, score, update, step on/off
        (pytest.approx(1.0), True),  # the kept cache's exponent
        (0.0, True),  # no run's responses off their point's length
    ]  # fmt: skip
    lines = [prefix.verdict_line(c) for c in checks]
    assert lines[0] == "PASS  grpo p1024 r32 g8: score speedup on/off >= 3: 3"
    assert lines[3] == "SKIP  gae p1024 r32 g8: score speedup on/off >= 3: not measured"
    assert lines[7] == "FAIL  demo gae p16 r28 g8: score time on/off <= 1.03: 1.05"
    assert lines[-2].startswith("PASS  multi-turn rollout time linear in turns with the kept cache")
    # A response cut short (a stop string matched across the prompt), or a turn more or less: FAIL.
    rows[-1] = {**rows[-1], "response_tokens": 8.5 * rows[-1]["turns"]}
    rows[0] = {**rows[0], "response_tokens": 31.0}
    assert prefix.verdict_line(prefix.checks(rows, fits, prefix.FULL, 1)[-1]) == (
        "FAIL  every run's responses had exactly the point's tokens: 2"
    )


def test_report_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    rows, fits = checked_rows()
    checks = prefix.checks(rows, fits, prefix.FULL, prompts_per_rank=1)
    prefix.print_report(rows, fits, checks, as_json=True, quick=False)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["kind"] for line in lines] == ["point"] * 11 + ["fit"] * 2 + ["check"] * 12
    assert lines[1]["mode"] == "on" and lines[1]["score_x"] == 3.0 and lines[1]["timing_s"] == {"step": 6.6}
    prefix.print_report(rows, fits, checks, as_json=False, quick=True)
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == prefix.TABLE_COLUMNS
    assert out[2].split()[:11] == ["grpo", "1024", "32", "8", "0", "on", "2", "1", "3", "0.6", "6.6"]
    assert out[2].split()[11:15] == ["1.3", "3", "3", "2.273"]  # 15 / 6.6
    assert out[14].split() == prefix_turns.FIT_COLUMNS
    assert "quick" in out[18] and sum(line.startswith(("PASS", "FAIL", "SKIP")) for line in out) == 12


def test_plot_writes_a_png(tmp_path: Path) -> None:
    rows, fits = checked_rows()
    rows += prefix.with_speedups([row(Point(16, 256, 4), "off", 2.0, 1.0, 2.0, 6.0),
                                  row(Point(16, 256, 4), "on", 1.5, 0.8, 1.6, 4.0)])  # fmt: skip
    path = tmp_path / "figs" / "prefix.png"
    prefix.plot(rows, fits, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gpu_summary_reads_the_prefix_stage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gpu_summary = load_script("gpu_summary")
    assert gpu_summary.prefix(tmp_path) == {}  # the stage did not run: no rows, no error
    rows, fits = checked_rows()
    prefix.print_report(rows, fits, prefix.checks(rows, fits, prefix.FULL, 1), as_json=True, quick=False)
    (tmp_path / "prefix.jsonl").write_text(capsys.readouterr().out)
    summary = gpu_summary.summarize(tmp_path)["prefix"]
    assert summary["grpo_p1024_r32_g8/on"] == {
        "gen_s": 2.0, "score_s": 1.0, "update_s": 3.0, "step_s": 6.6,
        "gen_x": 1.3, "score_x": 3.0, "update_x": 3.0, "step_x": 15.0 / 6.6,
    }  # fmt: skip
    assert summary["gae_p1024_r32_g8/off"]["step_x"] == 1.0
    assert summary["grpo_p256_r32_g4_t2/rollout_only"]["gen_s"] == 0.5
    checks = summary["checks"]
    assert checks["grpo p1024 r32 g8: gen speedup on/off >= 1.3"] is True
    assert checks["gae p1024 r32 g8: gen speedup on/off >= 1.3"] is None
    assert checks["demo gae p16 r28 g8: score time on/off <= 1.03"] is False
    assert len(summary) == 11 + 1  # every run's row and the checks
