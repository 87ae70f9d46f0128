"""Tests of ``scripts/ppo_bench/distill.py`` (on-policy distillation against GRPO): the numbers of a run
from its metrics rows (the accuracy curve, the step of +0.15, the drop after the peak, the time means), the
issue's four criteria, the commands (distill_task is the GRPO preset plus distillation), bad input (one
line, exit code 2, before any training), a failed run (exit code 1), and the comparison's files, on
synthetic metrics rows: no training here (the comparison itself is ``python -m ppo_bench.distill``)::

    pytest tests/unit/test_bench_distill.py              # about 15 s on 2 cores (train_ppo --print-config)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from ppo_bench import distill, runs
from ppo_bench.compare_offline_runs import CommandError

# ----------------------------------------------------------------------------------------------------
# Synthetic runs
# ----------------------------------------------------------------------------------------------------


def metrics_rows(curve: list[tuple[int, float]], steps: int | None = None) -> list[dict[str, Any]]:
    """A run's metrics.jsonl rows with ``curve`` as ``val/accuracy`` (step 0: before training) and every
    step 1..``steps`` timed: ``timing_s/step`` 2 (with 1 more at validated steps, ``timing_s/testing``),
    ``gen`` 0.5, ``update_actor`` 1, memory 0.5 GiB."""
    steps = max(s for s, _ in curve) if steps is None else steps
    val = dict(curve)
    rows = [{"step": 0, "val/accuracy": val[0]}] if 0 in val else []
    for step in range(1, steps + 1):
        row = {"step": step, "timing_s/step": 2.0, "timing_s/gen": 0.5, "timing_s/update_actor": 1.0}
        row["perf/max_memory_gib"] = 0.5
        if step in val:
            row.update({"val/accuracy": val[step], "timing_s/testing": 1.0, "timing_s/step": 3.0})
        rows.append(row)
    return rows


def run(curve: list[tuple[int, float]]) -> dict[str, Any]:
    """``run_numbers`` of a run with ``curve``."""
    return distill.run_numbers(metrics_rows(curve))


def by_name(found: list[distill.Criterion]) -> dict[str, distill.Criterion]:
    return {c.name: c for c in found}


# ----------------------------------------------------------------------------------------------------
# A run's numbers
# ----------------------------------------------------------------------------------------------------


def test_steps_to_gain_is_the_first_validated_step_at_start_plus_015() -> None:
    # start 0.60: 0.749 misses 0.75, 0.75 reaches it (at step 15), and a later drop changes nothing
    curve = [(0, 0.60), (5, 0.70), (10, 0.749), (15, 0.75), (20, 0.90), (25, 0.6)]
    assert runs.steps_to_gain(curve, distill.GAIN) == 15
    assert runs.steps_to_gain(curve, 0.2) == 20
    assert runs.steps_to_gain([(0, 0.60), (5, 0.70), (10, 0.749)], distill.GAIN) is None
    assert (
        runs.steps_to_gain([], distill.GAIN) is None and runs.steps_to_gain([(0, 0.5)], distill.GAIN) is None
    )
    # 66/500 + 0.15 is 0.28200000000000003 in floats, above 141/500 = 0.282: still reached
    assert 66 / 500 + 0.15 > 141 / 500
    assert runs.steps_to_gain([(0, 66 / 500), (5, 141 / 500)], distill.GAIN) == 5


def test_drop_after_peak() -> None:
    # peak 0.90 at step 5, then 0.85, 0.88, 0.87: the lowest after it is 0.85, a drop of 0.05
    assert runs.drop_after_peak([(0, 0.6), (5, 0.9), (10, 0.85), (15, 0.88), (20, 0.87)]) == pytest.approx(
        0.05
    )
    # a dip before the peak is no drop after it; a peak at the end leaves 0
    assert runs.drop_after_peak([(0, 0.6), (5, 0.5), (10, 0.9)]) == 0.0
    # the peak reached twice: counted from its first time (0.9 - 0.8)
    assert runs.drop_after_peak([(0, 0.6), (5, 0.9), (10, 0.8), (15, 0.9)]) == pytest.approx(0.1)
    assert runs.drop_after_peak([]) == 0.0


def test_run_numbers_by_hand() -> None:
    rows = [
        {"step": 0, "val/accuracy": 0.5},
        {
            "step": 1,
            "timing_s/step": 10.0,
            "timing_s/gen": 5.0,
            "perf/max_memory_gib": 0.7,
        },  # warm-up: left out
        {
            "step": 2,
            "timing_s/step": 4.0,
            "timing_s/testing": 1.0,
            "timing_s/gen": 1.0,
            "timing_s/teacher": 0.5,
            "timing_s/update_actor": 2.0,
            "perf/max_memory_gib": 0.9,
            "val/accuracy": 0.7,
        },
        {
            "step": 3,
            "timing_s/step": 2.0,
            "timing_s/gen": 1.5,
            "timing_s/teacher": 0.5,
            "timing_s/update_actor": 1.0,
            "perf/max_memory_gib": 0.8,
            "val/accuracy": 0.66,
        },
    ]
    n = distill.run_numbers(rows)
    assert n["curve"] == [[0, 0.5], [2, 0.7], [3, 0.66]] and n["accuracy_key"] == "val/accuracy"
    assert (n["start"], n["final"], n["peak"], n["peak_step"]) == (0.5, 0.66, 0.7, 2)
    assert n["max_drop"] == pytest.approx(0.04) and n["gain_step"] == 2  # 0.7 >= 0.5 + 0.15
    assert n["steps"] == 3
    # steps 2 and 3: (4 - 1 testing + 2) / 2 = 2.5 without validation, (4 + 2) / 2 = 3 with it
    assert n["step_s"] == pytest.approx(2.5) and n["step_with_val_s"] == pytest.approx(3.0)
    # gen (1 + 1.5) / 2, teacher 0.5, update (2 + 1) / 2; no ref logged, so none reported
    assert n["phase_s"] == pytest.approx({"gen": 1.25, "teacher": 0.5, "update_actor": 1.5})
    assert n["memory_gib"] == 0.9


def test_the_greedy_accuracy_is_read_first() -> None:
    # with sampled validation, val/accuracy is the sampled pass's and the greedy one is val/greedy_accuracy
    rows = [{"step": 0, "val/accuracy": 0.3, "val/greedy_accuracy": 0.5, "val/score": 0.1}]
    assert runs.accuracy_curve(rows) == [(0, 0.5)]
    assert runs.accuracy_curve([{"step": 0, "val/score": 0.25}]) == [(0, 0.25)]  # no rule: the score
    assert runs.accuracy_curve([{"step": 1, "timing_s/step": 1.0}]) == []
    n = distill.run_numbers([{"step": 1, "timing_s/step": 1.0}])
    assert n["start"] is None and n["max_drop"] is None and n["gain_step"] is None


# ----------------------------------------------------------------------------------------------------
# The criteria
# ----------------------------------------------------------------------------------------------------


def test_criterion_a_compares_the_steps_to_gain() -> None:
    grpo = run([(0, 0.6), (10, 0.7), (20, 0.75), (50, 0.8)])  # +0.15 at step 20
    fast = run([(0, 0.6), (10, 0.75), (20, 0.8), (50, 0.85)])  # at 10 = 20/2
    slow = run([(0, 0.6), (10, 0.7), (15, 0.76), (50, 0.85)])  # at 15 > 20/2
    a = by_name(distill.criteria(0, {"grpo": grpo, "distill": fast}, teacher=None, steps=50))["a"]
    assert a.status == "PASS" and "step 10, GRPO at step 20: 10 <= 20/2" in a.detail
    a = by_name(distill.criteria(0, {"grpo": grpo, "distill": slow}, teacher=None, steps=50))["a"]
    assert a.status == "FAIL" and "15 > 20/2" in a.detail


def test_criterion_a_when_grpo_never_gains() -> None:
    grpo = run([(0, 0.6), (25, 0.7), (50, 0.74)])
    early = run([(0, 0.6), (25, 0.8), (50, 0.85)])  # at 25 = 50/2: GRPO needs more than 50
    late = run([(0, 0.6), (25, 0.7), (50, 0.8)])  # at 50: no longer half of something known
    never = run([(0, 0.6), (25, 0.7), (50, 0.7)])
    a = by_name(distill.criteria(0, {"grpo": grpo, "distill": early}, teacher=None, steps=50))["a"]
    assert a.status == "PASS" and "GRPO does not within the run's 50 steps" in a.detail
    a = by_name(distill.criteria(0, {"grpo": grpo, "distill": late}, teacher=None, steps=50))["a"]
    assert a.status == "FAIL" and "50 > 50/2 (not shown)" in a.detail
    a = by_name(distill.criteria(0, {"grpo": grpo, "distill": never}, teacher=None, steps=50))["a"]
    assert a.status == "FAIL" and "distill never reaches" in a.detail and "GRPO: never" in a.detail


def test_criterion_b_teacher_or_grpo() -> None:
    grpo = run([(0, 0.6), (50, 0.87)])
    near = run(
        [(0, 0.6), (50, 0.89)]
    )  # teacher 0.92: 0.89 >= 0.92 - 0.03 (the float sum is 0.8900000000000001)
    below = run([(0, 0.6), (50, 0.86)])
    found = by_name(distill.criteria(0, {"grpo": grpo, "distill": near}, teacher=0.92, steps=50))
    assert found["b"].status == "PASS" and "within 0.03: yes" in found["b"].detail
    found = by_name(distill.criteria(0, {"grpo": grpo, "distill": below}, teacher=0.92, steps=50))
    assert found["b"].status == "FAIL" and "above it: no" in found["b"].detail
    # without the teacher's accuracy, above GRPO's final is enough: 0.89 > 0.87
    found = by_name(distill.criteria(0, {"grpo": grpo, "distill": near}, teacher=None, steps=50))
    assert found["b"].status == "PASS" and "teacher's accuracy unknown" in found["b"].detail
    # far from the teacher but above GRPO
    found = by_name(distill.criteria(0, {"grpo": grpo, "distill": near}, teacher=0.99, steps=50))
    assert found["b"].status == "PASS" and "within 0.03: no" in found["b"].detail


def test_criterion_c_drop_after_the_peak() -> None:
    # 0.93 - 0.90 is 0.030000000000000027 in floats: a drop of 0.03 passes
    ok = run([(0, 0.6), (20, 0.93), (30, 0.90), (50, 0.92)])
    bad = run([(0, 0.6), (20, 0.93), (30, 0.89), (50, 0.92)])
    c = by_name(distill.criteria(0, {"distill": ok}, teacher=0.9, steps=50))["c"]
    assert c.status == "PASS" and "peaks at 0.930 (step 20), drops 0.030" in c.detail
    c = by_name(distill.criteria(0, {"distill": bad}, teacher=0.9, steps=50))["c"]
    assert c.status == "FAIL" and "drops 0.040" in c.detail and "> 0.03" in c.detail


def test_criterion_d_both_at_least_as_good_as_either() -> None:
    grpo, dist = run([(0, 0.6), (50, 0.85)]), run([(0, 0.6), (50, 0.90)])
    # max(0.90, 0.85) - 0.01 = 0.89: 0.89 passes, 0.888 does not
    for final, status in ((0.89, "PASS"), (0.888, "FAIL"), (0.95, "PASS")):
        both = run([(0, 0.6), (50, final)])
        runs = {"grpo": grpo, "distill": dist, "distill_task": both}
        d = by_name(distill.criteria(0, runs, teacher=0.9, steps=50, num_prompts=500))["d"]
        assert d.status == status, (final, d)
    # the tolerance and the noise it sits under are in the line: sqrt(0.9 * 0.1 / 500) = 0.0134
    assert "= 0.890 (tolerance 0.01; one standard error at 0.900 over 500 prompts: 0.013)" in d.detail


def test_criteria_that_need_a_method_not_run_are_skipped() -> None:
    found = distill.criteria(3, {"grpo": run([(0, 0.6), (5, 0.7)])}, teacher=0.9, steps=5)
    assert [(c.name, c.status) for c in found] == [("a", "SKIP"), ("b", "SKIP"), ("c", "SKIP"), ("d", "SKIP")]
    assert found[0].line() == "seed 3 (a) SKIP: needs grpo and distill"


# ----------------------------------------------------------------------------------------------------
# Commands and bad input
# ----------------------------------------------------------------------------------------------------


@pytest.fixture
def assets(tmp_path: Path) -> Path:
    """An asset set as the script checks it (the files exist; the models are empty configs: train_ppo's
    --print-config accepts them, nothing loads them here)."""
    root = tmp_path / "assets"
    for model in ("sft", "teacher"):
        (root / model).mkdir(parents=True)
        (root / model / "config.json").write_text("{}")
    (root / "data").mkdir()
    for split in ("train", "val"):
        (root / "data" / f"{split}.parquet").write_bytes(b"")
    (root / "metrics.json").write_text(json.dumps({"sft_val_accuracy": 0.6, "teacher_val_accuracy": 0.92}))
    return root


def cli(assets: Path, out: Path, *extra: str) -> list[str]:
    return [f"--assets={assets}", f"--out={out}", "--steps=3", "--test-freq=1", *extra]


@pytest.mark.parametrize(
    "change, message",
    [
        ("no_sft", "student"),
        ("no_teacher", "teacher"),
        ("no_train", "train.parquet"),
        ("no_val", "val.parquet"),
        ("lengths", "--seeds has 2 value(s)"),
        ("bad_method", "--methods"),
        ("earlier", "earlier comparison"),
        ("extra_method", "--extra"),
        ("extra_key", "unknown config key 'actor.kl_los_coef'"),
        ("nproc", "does not fit world size 3"),
        ("steps", "--steps"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2_before_training(
    assets: Path, tmp_path: Path, change: str, message: str, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "cmp"
    extra: list[str] = []
    if change == "no_sft":
        (assets / "sft" / "config.json").unlink()
    elif change == "no_teacher":
        (assets / "teacher" / "config.json").unlink()
    elif change == "no_train":
        (assets / "data" / "train.parquet").unlink()
    elif change == "no_val":
        (assets / "data" / "val.parquet").unlink()
    elif change == "lengths":
        extra = ["--seeds", "0", "1"]
    elif change == "bad_method":
        extra = ["--methods=grpo,opd"]
    elif change == "earlier":
        (out / "seed0").mkdir(parents=True)
    elif change == "extra_method":
        extra = ["--methods=grpo,distill", "--extra", "distill_task=actor.optim.lr=1e-5"]
    elif change == "extra_key":  # found by the trainer's own check of the command
        extra = ["--extra", "distill=actor.kl_los_coef=0.1"]
    elif change == "nproc":
        extra = ["--nproc=3"]
    elif change == "steps":
        extra = ["--steps=0"]
    assert distill.main(cli(assets, out, *extra)) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distill: error:") and message in lines[0], lines
    assert captured.out == "" and not list(out.glob("seed*/*"))  # nothing started
    if change in ("no_sft", "no_teacher", "no_train"):
        assert f"make assets ASSETS={assets}" in lines[0]


def test_grpo_alone_needs_no_teacher_and_overwrite_accepts_an_earlier_comparison(
    assets: Path, tmp_path: Path
) -> None:
    out = tmp_path / "cmp"
    out.mkdir()
    (out / "results.json").write_text("{}")
    (assets / "teacher" / "config.json").unlink()
    plan = distill.check_inputs(distill.parse_args(cli(assets, out, "--methods=grpo", "--overwrite")))
    assert plan.methods == ["grpo"] and plan.seeds == [0] and plan.assets == [assets.resolve()]


def test_seeds_pair_with_asset_sets(assets: Path, tmp_path: Path) -> None:
    args = ["--assets", str(assets), "--assets", str(assets), "--out", str(tmp_path / "cmp")]
    assert distill.check_inputs(distill.parse_args(args)).seeds == [0, 1]  # default: 0, 1, ...
    assert distill.check_inputs(distill.parse_args([*args, "--seeds", "4", "7"])).seeds == [4, 7]
    with pytest.raises(distill.InputError, match="each seed once"):
        distill.check_inputs(distill.parse_args([*args, "--seeds", "4", "4"]))
    extra = distill.parse_extra(["distill=a.b=1", "distill=c=[x]", "grpo=d=e=f"], ["grpo", "distill"])
    assert extra == {"grpo": ["d=e=f"], "distill": ["a.b=1", "c=[x]"]}
    with pytest.raises(distill.InputError, match="METHOD=KEY=VALUE"):
        distill.parse_extra(["distill=lr"], ["distill"])


def resolved(args: list[str]) -> dict[str, Any]:
    """train_ppo.py's resolved config of ``args`` for 2 ranks, flattened to ``{dotted key: value}``."""
    cmd = [sys.executable, str(distill.ROOT / "train_ppo.py"), *args, "--print-config", "--world-size", "2"]
    tree = yaml.safe_load(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)

    def flat(node: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(
                flat(value, f"{prefix}{key}.") if isinstance(value, dict) and value else {prefix + key: value}
            )
        return out

    return flat(tree)


def test_distill_task_is_the_grpo_preset_plus_distillation(assets: Path, tmp_path: Path) -> None:
    """The three commands resolve; distill_task differs from GRPO only in the distillation section, the
    distill preset's optimizer schedule (and its experiment name), and from distill only in the task's
    loss."""
    configs = {
        m: resolved(
            distill.train_args(m, assets=assets, seed=2, steps=7, test_freq=3, out_dir=tmp_path / "run")
        )
        for m in distill.METHODS
    }

    def diff(a: str, b: str) -> set[str]:
        x, y = configs[a], configs[b]
        return {k for k in x.keys() | y.keys() if x.get(k, "absent") != y.get(k, "absent")}

    assert {k for k in diff("grpo", "distill_task") if not k.startswith("distillation.")} <= {
        "trainer.experiment_name",
        "actor.optim.lr",
        "actor.optim.lr_warmup_steps",
        "actor.optim.lr_scheduler",
        "actor.optim.min_lr_ratio",
    }
    assert diff("distill", "distill_task") <= {
        "distillation.distillation_loss.use_task_rewards",
        *distill.TASK_KEYS,
    }
    task = configs["distill_task"]
    assert task["distillation.enabled"] and task["distillation.distillation_loss.use_task_rewards"]
    assert task["distillation.teacher_models.teacher_model.model_path"] == str(assets / "teacher")
    assert distill.task_settings() == [
        "actor.use_kl_loss=true",
        "actor.kl_loss_type=low_var_kl",
        "actor.kl_loss_coef=0.05",
    ]  # configs/demo_cpu_grpo.yaml's
    for c in configs.values():  # the run's bookkeeping in every command
        assert c["model.path"] == str(assets / "sft") and c["data.val_files"] == [
            str(assets / "data" / "val.parquet")
        ]
        assert (c["trainer.seed"], c["trainer.total_training_steps"], c["trainer.test_freq"]) == (2, 7, 3)
        assert (
            c["trainer.save_freq"] == -1
            and c["trainer.logger"] == ["jsonl"]
            and c["trainer.val_before_train"]
        )
        assert c["trainer.overwrite"] and c["trainer.output_dir"] == str(tmp_path / "run")
    assert not configs["grpo"]["distillation.enabled"]


# ----------------------------------------------------------------------------------------------------
# The comparison on synthetic runs
# ----------------------------------------------------------------------------------------------------

CURVES = {
    "grpo": [(0, 0.60), (1, 0.70), (2, 0.76), (3, 0.80)],  # +0.15 at step 2
    "distill": [(0, 0.60), (1, 0.78), (2, 0.90), (3, 0.89)],  # at step 1; ends 0.89, teacher 0.92
    "distill_task": [(0, 0.60), (1, 0.77), (2, 0.88), (3, 0.885)],  # >= 0.89 - 0.01
}


def fake_training(steps: dict[str, int]) -> Any:
    """A ``run_logged`` that trains nothing: it writes ``metrics_rows`` of the method's ``CURVES`` (for
    ``steps[method]`` steps) into the command's ``trainer.output_dir`` and takes 12.5 s."""

    def run_logged(cmd: list[str], log: Path) -> float:
        out_dir = Path(next(a for a in cmd if a.startswith("trainer.output_dir=")).partition("=")[2])
        assert log == out_dir / "train.log" and out_dir.is_dir()
        rows = metrics_rows(CURVES[out_dir.name], steps=steps[out_dir.name])
        (out_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return 12.5

    return run_logged


def test_the_comparison_writes_its_files(
    assets: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(distill, "run_logged", fake_training(dict.fromkeys(CURVES, 3)))
    out, plot = tmp_path / "cmp", tmp_path / "docs" / "curves.png"
    assert distill.main(cli(assets, out, "--seeds=5", f"--plot={plot}", "--json")) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    runs = [r for r in lines if r["kind"] == "run"]
    assert [r["method"] for r in runs] == list(distill.METHODS) and {r["seed"] for r in runs} == {5}
    assert set(runs[0]) == {"kind", *(key for key, _ in distill.COLUMNS)}
    grpo = runs[0]
    # step 1 left out; steps 2 and 3 validated: 3 s each with 1 s of testing -> 2 s a step
    assert (grpo["start"], grpo["gain_step"], grpo["final"], grpo["peak"]) == (0.6, 2, 0.8, 0.8)
    assert (
        grpo["step_s"] == 2.0
        and grpo["gen_s"] == 0.5
        and grpo["teacher_s"] is None
        and grpo["wall_s"] == 12.5
    )
    statuses = {c["name"]: c["status"] for c in lines if c["kind"] == "criterion"}
    assert statuses == {"a": "PASS", "b": "PASS", "c": "PASS", "d": "PASS"}  # 1 <= 2/2; 0.89 >= 0.89; ...

    results = json.loads((out / "results.json").read_text())
    assert results["asset_sets"] == [
        {"seed": 5, "assets": str(assets), "teacher_accuracy": 0.92, "sft_accuracy": 0.6, "val_prompts": None}
    ]
    dist = results["runs"][1]
    assert dist["curve"] == [list(p) for p in CURVES["distill"]] and dist["max_drop"] == pytest.approx(0.01)
    assert dist["command"][-1] == "trainer.val_before_train=true" and dist["dir"] == str(
        out.resolve() / "seed5/distill"
    )
    assert results["settings"]["task_settings"] == distill.task_settings()
    table = (out / "table.md").read_text().splitlines()
    assert table[0].startswith("| seed | method | start | +0.15 at step | final | peak | max drop | s/step")
    assert table[2] == "| 5 | grpo | 0.6 | 2 | 0.8 | 0.8 | 0 | 2 | - | 0.5 | 1 | 0.5 | 12.5 |"
    assert "- seed 5 (d) PASS: distill_task ends at 0.885; max(distill 0.890, GRPO 0.800) - 0.01 = 0.880" in (
        "\n".join(table)
    )
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (out / "curves.png").exists()

    # again without --overwrite: refused; with it: replaced
    assert distill.main(cli(assets, out, "--seeds=5", "--methods=grpo")) == 2
    assert distill.main(cli(assets, out, "--seeds=5", "--methods=grpo", "--overwrite")) == 0
    assert sorted(p.name for p in (out / "seed5").iterdir()) == ["grpo"]
    assert (out / "curves.png").is_file()
    table = capsys.readouterr().out
    assert "+0.15 at step" in table and "seed 5 (a) SKIP: needs grpo and distill" in table


def test_a_run_that_stops_short_is_exit_code_1(
    assets: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(distill, "run_logged", fake_training({"grpo": 3, "distill": 2}))
    assert distill.main(cli(assets, tmp_path / "cmp", "--methods=grpo,distill")) == 1
    err = capsys.readouterr().err
    assert "seed 0 distill logged 2 of 3 steps" in err and "train.log" in err


def test_a_failed_command_reports_its_last_lines(
    assets: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    def failing(cmd: list[str], log: Path) -> float:
        raise CommandError(f"failed (exit code 1) after 3 s: {' '.join(cmd)}\nlast lines of {log}:\nboom")

    monkeypatch.setattr(distill, "run_logged", failing)
    assert distill.main(cli(assets, tmp_path / "cmp", "--methods=distill")) == 1
    err = capsys.readouterr().err
    assert "distill: error: failed (exit code 1)" in err and "train_ppo.py --config" in err and "boom" in err


def test_help_answers_without_torch() -> None:
    code = "import sys, ppo_bench.distill; print('torch' in sys.modules)"
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert imported.stdout.strip() == "False"  # bad input is refused at once, before torch loads
    proc = subprocess.run(
        [sys.executable, "-m", "ppo_bench.distill", "--help"], capture_output=True, text=True, check=True
    )
    assert "--assets" in proc.stdout and "+0.15 at step" in proc.stdout
