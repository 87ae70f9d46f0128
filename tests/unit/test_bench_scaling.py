"""The pure parts of ppo_bench.scaling (the points of each axis, a row from a run's metrics, the table
and JSON output), of its turns axis in ppo_bench.scaling_turns (the work by arithmetic and the trainer's
sampler counted against it, the cost model, the rigged policy), of ppo_bench.multi_turn's call clock, of
the run harness in ppo_bench.runs that they drive (the exponent fit, the clocks of a run's steps) and
ppo_bench.overhead_floor's table. The end-to-end runs are in tests/runs/test_bench_scaling.py."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from ppo_bench import multi_turn, overhead, overhead_floor, runs, scaling, scaling_turns
from ppo_bench.scaling import Point


@pytest.mark.parametrize("k", [1.0, 0.0, -1.0, 1.7])
def test_fit_exponent_recovers_a_power_law(k: float) -> None:
    # value = 3 * work^k exactly, so the log-log least squares line has slope k and intercept log 3.
    work = [32.0, 128.0, 512.0, 1024.0]
    got_k, got_c = runs.fit_exponent(work, [3.0 * w**k for w in work])
    assert abs(got_k - k) < 1e-6
    assert abs(got_c - 3.0) < 1e-6


def test_fit_exponent_of_noisy_points_is_the_least_squares_slope() -> None:
    # log2 work = 0, 1, 2 and log2 value = 0, 1, 3: slope = cov / var = (0*-4/3 + ... ) by hand:
    # x mean 1, y mean 4/3; sum (x - 1)(y - 4/3) = (-1)(-4/3) + 0 + (1)(5/3) = 3; sum (x - 1)^2 = 2: k = 1.5.
    k, _ = runs.fit_exponent([1.0, 2.0, 4.0], [1.0, 2.0, 8.0])
    assert abs(k - 1.5) < 1e-12


def test_fit_exponent_refuses_what_has_no_log_log_line() -> None:
    with pytest.raises(ValueError, match="distinct"):
        runs.fit_exponent([2.0, 2.0], [1.0, 3.0])
    with pytest.raises(ValueError, match="positive"):
        runs.fit_exponent([1.0, 2.0], [0.0, 3.0])


def test_fit_line_slope() -> None:
    # value = 5 + 0.25 * work exactly.
    assert abs(runs.fit_line([0.0, 4.0, 8.0], [5.0, 6.0, 7.0]) - 0.25) < 1e-12


def test_axis_points() -> None:
    xs = {axis: [p.x for p in scaling.axis_points(axis)] for axis in scaling.AXES}
    assert xs == {
        "response_len": [32, 128, 512, 1024],
        "batch": [8, 32, 128],
        "n": [1, 4, 16],
        "ranks": [1, 2, 1, 2, 1, 2],
        "turns": [1, 2, 4, 8],
        "sp": [128, 256, 512],
    }
    ranks = scaling.axis_points("ranks")
    # Weak scaling: the same 16 prompts per rank; strong: the same 16 prompts in all.
    assert [(p.series, p.nproc, p.num_prompts) for p in ranks] == [
        ("ranks/weak", 1, 16),
        ("ranks/weak", 2, 32),
        ("ranks/strong", 1, 16),
        ("ranks/strong", 2, 16),
        ("ranks/independent", 1, 16),
        ("ranks/independent", 1, 16),
    ]
    # The control: two 1-rank processes of ranks/weak's per-rank work, started together.
    assert [p.copies for p in ranks] == [1, 1, 1, 1, 1, 2]
    # A turn is 8 generated tokens and an 8-token observation: the response budget holds exactly t turns.
    assert [p.response_len for p in scaling.axis_points("turns")] == [16, 32, 64, 128]
    assert all(p.nproc == 2 and p.sp == 2 for p in scaling.axis_points("sp"))
    assert [p.response_len for p in scaling.axis_points("response_len")] == [32, 128, 512, 1024]
    assert [p.x for p in scaling.axis_points("batch", quick=True)] == [2, 4]
    # A quick run leaves the independent pair out: its steps are too short to be sure the two overlap.
    assert [p.series for p in scaling.axis_points("ranks", quick=True)] == [p.series for p in ranks[:4]]
    with pytest.raises(ValueError, match="unknown axis"):
        scaling.axis_points("depth")


def test_overrides_of_single_and_multi_turn_points() -> None:
    paths = {"policy": Path("/p"), "forced": Path("/f"), "prompts": Path("/d.parquet")}
    args = scaling.parse_args(["--steps", "3"])
    single = scaling.overrides(Point("n", 4, num_prompts=8, n=4), paths, Path("/o"), args)
    assert {"model.path=/p", "rollout.n=4", "rollout.ignore_eos=true", "data.train_batch_size=8"} <= set(
        single
    )
    assert not any(o.startswith("rollout.multi_turn") for o in single)
    turns = scaling.overrides(
        Point("turns", 2, num_prompts=8, response_len=32, turns=2), paths, Path("/o"), args
    )
    assert "model.path=/f" in turns and "rollout.ignore_eos=true" not in turns
    assert {"rollout.multi_turn.stop=[aaaaaaaa]", "rollout.multi_turn.max_assistant_turns=2"} <= set(turns)
    sp = scaling.overrides(
        Point("sp", 128, num_prompts=4, response_len=128, nproc=2, sp=2), paths, Path("/o"), args
    )
    assert "actor.ulysses_sequence_parallel_size=2" in sp


def test_overlapping_steps_keeps_what_ran_while_the_other_trained() -> None:
    # Process 0's steps end at 1, 2, ..., 6 s; process 1 started later: its steps end at 2.5, 3.5, ..., 7.5.
    # Process 0's step s runs from s - 1 to s: kept when it lies within [2.5, 7.5] (the other's first and
    # last step ends): steps 4 (3-4), 5, 6. Process 1's step s runs from 1.5 + (s - 1) to 1.5 + s: kept
    # within [1, 6]: steps 2 (2.5-3.5), 3 (3.5-4.5), 4 (4.5-5.5); step 5 ends at 6.5.
    ends = [[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [2.5, 3.5, 4.5, 5.5, 6.5, 7.5]]
    assert runs.overlapping_steps(ends) == [{4, 5, 6}, {2, 3, 4}]
    # One process: every step but the first (whose start is not seen).
    assert runs.overlapping_steps([[1.0, 2.0, 3.0]]) == [{2, 3}]


def test_step_clocks_are_differences_between_step_ends() -> None:
    end = runs.StepEnd
    # Steps 1-2 ended at 1.0 and 1.5 CPU s (the machine waited 0.1 s in all by then, 0.3 s after step 2);
    # steps 3 and 4 were seen in one poll (their clocks cannot be told apart), step 5 on its own.
    ends = [end(0.0, 1.0, 0.1, 1), end(0.0, 1.5, 0.3, 1), end(0.0, 2.5, 0.3, 2), end(0.0, 2.75, 0.5, 1)]
    assert runs.step_clocks(ends) == {2: (0.5, 0.19999999999999998), 5: (0.25, 0.2)}
    # Off Linux the clocks are None: no step gets any.
    assert runs.step_clocks([end(0.0, None, None, 1), end(1.0, None, None, 1)]) == {}


def test_process_clocks_of_this_process() -> None:
    import os
    import time

    before, waited = runs.process_clocks(os.getpid())
    if before is None:
        pytest.skip("no /proc/<pid>/task/*/sched or /proc/pressure/cpu here")
    start = time.thread_time()
    while time.thread_time() - start < 0.2:  # 0.2 s of this thread's CPU
        pass
    busy = time.thread_time() - start
    after, waited_after = runs.process_clocks(os.getpid())
    # The scheduler's on-core time of this process's threads grew by this thread's CPU time (the others
    # idle; exited threads are not counted, so the totals are compared as differences).
    assert abs((after - before) - busy) < 0.03
    assert waited_after >= waited >= 0.0


def test_combine_averages_times_and_sums_work() -> None:
    a = {"step_s": 1.0, "gen_s": 0.4, "score_s": 0.2, "train_s": 0.3, "other_s": 0.1, "gen_ms_per_token": 4.0,
         "response_tokens": 32.0, "tokens": 100.0, "tokens_per_s": 100.0, "mem_gib": 0.5, "steps": 4,
         "timing_s": {"gen": 0.4, "step": 1.0}, "series": "ranks/independent", "x": 2, "work": 2.0,
         "point": {}}  # fmt: skip
    b = {**a, "step_s": 2.0, "gen_s": 0.8, "tokens_per_s": 50.0, "mem_gib": 0.7, "steps": 3,
         "timing_s": {"gen": 0.8, "step": 2.0}}  # fmt: skip
    row = scaling.combine([a, b])
    assert (row["step_s"], row["gen_s"], row["score_s"]) == (1.5, 0.6000000000000001, 0.2)
    assert row["timing_s"] == {"gen": 0.6000000000000001, "step": 1.5}
    assert (row["tokens"], row["tokens_per_s"], row["mem_gib"], row["steps"]) == (200.0, 150.0, 0.7, 3)
    assert [p["step_s"] for p in row["processes"]] == [1.0, 2.0]
    assert scaling.combine([a]) is a


def test_turn_work_by_arithmetic() -> None:
    # 3 rows, prompts of 10, 12, 9 tokens: each turn is left-padded to 12 + 16 t (8 generated + the
    # 8-token observation per earlier turn); 3 rows x 3 turns x 8 tokens generated.
    assert len(scaling_turns.OBSERVATION) == scaling_turns.TURN_TOKENS == 8
    work = functools.partial(scaling_turns.turn_work, [10, 12, 9], 3)
    # Plain generate: 3 x (12 + 28 + 44) = 252 prefill tokens; 7 decoding steps a turn (the prefill writes
    # the first of 8 tokens).
    assert work(keep_cache=False, share_prefill=False) == {
        "generate_calls": 3,
        "prefill_tokens": 252,
        "decode_steps": 21,
        "generated_tokens": 72,
    }
    # Without the kept cache the rows' distinct prompts share nothing: plain generate, whatever
    # share_prefill says (a micro-batch without a repeated prompt decodes plainly).
    assert work(keep_cache=False) == work(keep_cache=False, share_prefill=False)
    # Kept caches (the default): turn 0 prefills 3 x 11; turns 1 and 2 only the 8 observation tokens a row
    # (the last generated token, never fed back, is the one generate reads): 33 + 2 x 24 = 81.
    assert work() == {"generate_calls": 3, "prefill_tokens": 81, "decode_steps": 24, "generated_tokens": 72}


@pytest.mark.parametrize(("keep_cache", "share_prefill"), [(True, True), (False, True), (False, False)])
def test_the_sampler_forwards_are_turn_work(tok: Any, keep_cache: bool, share_prefill: bool) -> None:
    """The trainer's sampler on the axis's rigged policy and environment, 3 turns of 3 rows: its forwards,
    sorted by a ``ForwardClock``, are exactly ``turn_work``'s (profile_turns checks this on every point)."""
    from transformers import AutoModelForCausalLM

    from ppo import rollout
    from ppo.data import PromptRecord
    from tests.helpers import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(vocab_size=len(tok), pad_token_id=0))
    scaling_turns.rig_forced_token(model, tok.convert_tokens_to_ids(scaling_turns.FORCED_CHAR))
    texts = ["1 + 2 = ?", "33 + 44 =", "5 + 6 + 7 = ?"]
    records = [PromptRecord(input_ids=tok.encode(t, add_special_tokens=False), prompt_text=t, data_source="s",
                            ground_truth="0", extra_info={}, index=i) for i, t in enumerate(texts)]  # fmt: skip
    sampler = scaling_turns.turn_sampler(model, tok, 3, len(records))
    clock = scaling_turns.ForwardClock(model)
    result = rollout.sample(
        sampler, records, do_sample=True, keep_cache=keep_cache, share_prefill=share_prefill
    )
    clock.remove()
    work = scaling_turns.turn_work(
        [len(r.input_ids) for r in records], 3, keep_cache=keep_cache, share_prefill=share_prefill
    )
    counted = (clock.prefill_tokens, clock.decode_steps, int(result.response_mask.sum()))
    assert counted == (work["prefill_tokens"], work["decode_steps"], work["generated_tokens"])


def turn_profile_points() -> list[dict]:
    # prefill 2 us per token, decoding 1 ms per step, 5 ms per call, exactly.
    points = []
    for turns in (1, 2, 4):
        work = scaling_turns.turn_work([10] * 8, turns, keep_cache=False, share_prefill=False)
        prefill, decode, rest = 2e-6 * work["prefill_tokens"], 1e-3 * work["decode_steps"], 5e-3 * turns
        points.append({"turns": turns, **work, "gen_cpu_s": prefill + decode + rest, "prefill_s": prefill,
                       "decode_s": decode, "rest_s": rest})  # fmt: skip
    return points


def test_turn_cost_model_recovers_the_unit_costs() -> None:
    points = turn_profile_points()
    model = scaling_turns.turn_cost_model(points)
    assert math.isclose(model["prefill_ms_per_ktok"], 2.0)
    assert math.isclose(model["decode_ms_per_step"], 1.0)
    assert math.isclose(model["rest_ms_per_call"], 5.0)
    # Without the prefill the cost is 12 ms per turn: linear in the generated tokens.
    assert math.isclose(model["without_prefill_k"], 1.0)
    # The prefill grows faster: 8 x (10 + 26 + ...) = 80, 288, 1088 tokens for 64, 128, 256 generated;
    # log2 of those: 6.3219, 8.1699, 10.0875 at log2 work 6, 7, 8, a slope of (10.0875 - 6.3219) / 2.
    assert abs(model["prefill_k"] - 1.8828) < 1e-3
    for p in scaling_turns.with_model(points, model):
        assert math.isclose(p["model_s"], p["gen_cpu_s"])


def metrics_line(step: int, gen: float, scale: float = 1.0) -> dict[str, float]:
    return {
        "step": step,
        "timing_s/step": 10.0 * scale,
        "timing_s/gen": gen,
        "timing_s/ref": 1.0 * scale,
        "timing_s/values": 0.5 * scale,
        "timing_s/update_actor": 3.0 * scale,
        "timing_s/update_critic": 2.0 * scale,
        "timing_s/reward": 0.25 * scale,
        "perf/total_num_tokens": 400.0,
        "perf/max_memory_gib": 0.5 + step,
        "response_length/mean": 40.0,
    }


def test_summarize_takes_medians_after_the_warm_up() -> None:
    point = Point("ranks/weak", 2, num_prompts=32, response_len=40, nproc=2)
    lines = [metrics_line(1, 100.0), metrics_line(2, 2.0), metrics_line(3, 4.0), metrics_line(4, 3.0)]
    row = scaling.summarize(point, lines, warmup=1)
    # Steps 2-4 counted: gen median 3; score = ref + values = 1.5; train = 5; other = 10 - 3 - 1.5 - 5.
    assert (row["step_s"], row["gen_s"], row["score_s"], row["train_s"]) == (10.0, 3.0, 1.5, 5.0)
    assert row["other_s"] == 0.5
    assert row["gen_ms_per_token"] == 1000 * 3.0 / 40
    assert row["tokens_per_s"] == 40.0 and row["tokens"] == 400.0
    assert row["work"] == 2.0  # the ranks axis is fitted against the number of ranks
    assert row["mem_gib"] == 4.5 and row["steps"] == 3 and row["response_tokens"] == 40.0
    # On the other axes the work is tokens per rank (SP: each of the 2 ranks holds half of every sequence).
    assert scaling.summarize(Point("sp", 8, 2, nproc=2, sp=2), lines, 1)["work"] == 200.0
    assert scaling.summarize(Point("batch", 8, 8), lines, 1)["work"] == 400.0
    with pytest.raises(ValueError, match="no step after"):
        scaling.summarize(point, lines[:1], warmup=1)


def synthetic_rows() -> list[dict]:
    # Times exactly c * work^k: step k=1, gen k=0.5, score k=1, train k=2; memory 0.5 GiB + 1 MiB per token.
    rows = []
    for work in (100.0, 400.0, 1600.0):
        rows.append(
            {
                "series": "batch",
                "x": int(work / 50),
                "tokens": work,
                "work": work,
                "step_s": 0.01 * work,
                "gen_s": 0.1 * work**0.5,
                "score_s": 0.002 * work,
                "train_s": 1e-6 * work**2,
                "other_s": 0.0,
                "cpu_s": 0.01 * work,
                "wait_s": 0.0,
                "gen_ms_per_token": 1.0,
                "tokens_per_s": 100.0,
                "mem_gib": 0.5 + work / 1024,
            }
        )
    return rows


def test_fits_per_series() -> None:
    (fit,) = scaling.fits(synthetic_rows())
    assert fit["series"] == "batch"
    for name, k in (("step", 1.0), ("gen", 0.5), ("score", 1.0), ("train", 2.0)):
        assert abs(fit[f"{name}_k"] - k) < 1e-9, name
    # 1/1024 GiB per token = 1 MiB per token = 1000 MiB per 1000 tokens.
    assert abs(fit["mem_mib_per_ktok"] - 1000.0) < 1e-6
    assert list(fit) == scaling.FIT_COLUMNS


def test_report_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    rows = synthetic_rows()
    fitted = scaling.fits(rows)
    scaling.print_report(rows, fitted, as_json=True)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["kind"] for line in lines] == ["point"] * 3 + ["fit"]
    assert lines[0]["step_s"] == 1.0 and lines[0]["series"] == "batch"
    assert abs(lines[3]["train_k"] - 2.0) < 1e-9
    scaling.print_report(rows, fitted, as_json=False)
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == scaling.TABLE_COLUMNS
    assert out[1].split()[:5] == ["batch", "2", "100", "100", "1"]
    assert out[6].split() == scaling.FIT_COLUMNS
    assert out[7].split()[:5] == ["batch", "1", "0.5", "1", "2"]


def test_plot_writes_a_png(tmp_path: Path) -> None:
    rows = synthetic_rows()
    path = tmp_path / "figs" / "scaling.png"
    scaling.plot(rows, scaling.fits(rows), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rigged_policy_writes_the_forced_token() -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=50,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=1,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    scaling_turns.rig_forced_token(model, 17)
    prompts = torch.randint(3, 50, (4, 6))
    out = model.generate(prompts, max_new_tokens=12, do_sample=True, temperature=1.0, top_k=0, pad_token_id=0)
    assert (out[:, 6:] == 17).all()


def test_call_clock_sorts_each_generate_call() -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    clock = multi_turn.CallClock(model)
    for rows, width, new in ((2, 5, 4), (3, 7, 6)):
        model.generate(
            torch.randint(3, 50, (rows, width)), max_new_tokens=new, min_new_tokens=new, do_sample=False
        )
    clock.remove()
    # Each call: one prefill of rows x width tokens (it writes the first token), then new - 1 decoding steps.
    assert [(c["rows"], c["width"], c["decode_steps"]) for c in clock.calls] == [(2, 5, 3), (3, 7, 5)]
    assert (clock.prefill_tokens, clock.decode_steps) == (2 * 5 + 3 * 7, 3 + 5)
    assert math.isclose(sum(c["prefill_s"] for c in clock.calls), clock.prefill_s)
    assert math.isclose(sum(c["decode_s"] for c in clock.calls), clock.decode_s)


def test_call_clock_counts_the_rollout_prefill_with_its_generate_call() -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ppo import prefill
    from ppo.rollout import generation_config

    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    gen = generation_config(
        max_new_tokens=4, do_sample=False, eos_token_ids=[2], pad_token_id=0, ignore_eos=True
    )
    clock = multi_turn.CallClock(model)
    # Two distinct prompts (5 and 3 tokens) x 3 rows each: one prefill forward of the 2 distinct rows x 4
    # tokens (all but the last), then 4 one-token forwards of the 6 rows; then one row of 2 tokens:
    # 1 x 1 token (a one-token forward: counted as a decoding step of its call), then 4.
    prefill.generate_with_cache(model, [[5, 6, 7, 8, 9]] * 3 + [[10, 11, 12]] * 3, gen)
    prefill.generate_with_cache(model, [[13, 14]], gen)
    clock.remove()
    assert [(c["rows"], c["width"], c["decode_steps"]) for c in clock.calls] == [(2, 4, 4), (1, 0, 5)]
    assert (clock.prefill_tokens, clock.decode_steps) == (2 * 4, 4 + 5)


def test_floor_rows_gap() -> None:
    trainer = {phase: 1.0 + i for i, phase in enumerate(overhead.OUR_PHASES)}  # 1, 2, ..., 8: sum 36
    floor = {phase: 0.5 for phase in overhead.OUR_PHASES}
    rows = overhead_floor.floor_rows(trainer, floor)
    assert [r.phase for r in rows] == [*overhead.OUR_PHASES, "sum"]
    assert (rows[0].gap_s, rows[0].gap_pct) == (0.5, 50.0)  # 1 s in the trainer, 0.5 s bare
    assert (rows[3].gap_s, rows[3].gap_pct) == (3.5, 87.5)  # 4 s against 0.5 s
    # Sum: 36 s against 8 x 0.5 = 4 s: a gap of 32 s, 88.89 %.
    assert (rows[-1].trainer_s, rows[-1].floor_s, rows[-1].gap_s) == (36.0, 4.0, 32.0)
    assert math.isclose(rows[-1].gap_pct, 100 * 32 / 36)
