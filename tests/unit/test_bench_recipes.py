"""Tests of ``scripts/ppo_bench/recipes.py`` (the recipes ranked on the four-digit task) and
``scripts/ppo_bench/sabotage.py`` (a recipe broken on purpose): a run's numbers, the ranked rows and their
spread, which recipes lie apart, the commands (each recipe's preset moved to the task; a KL loss of weight 0
only where the preset has none), bad input, the comparison's files and the ``--doc`` section, on synthetic
metrics rows: no training here (the comparison itself is ``python -m ppo_bench.recipes``)::

    pytest tests/unit/test_bench_recipes.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from ppo_bench import recipes, sabotage

from tests.helpers import close, t64


def metrics_rows(curve: list[tuple[int, float]], kl: float = 0.01) -> list[dict[str, Any]]:
    """A run's metrics.jsonl rows: ``curve`` as ``val/accuracy``, every step timed, ``actor/ref_kl`` of
    ``kl`` times the step."""
    val = dict(curve)
    rows = [{"step": 0, "val/accuracy": val[0]}]
    for step in range(1, max(val) + 1):
        row = {"step": step, "timing_s/step": 1.0, "actor/ref_kl": kl * step}
        if step in val:
            row["val/accuracy"] = val[step]
        rows.append(row)
    return rows


def test_run_numbers() -> None:
    rows = metrics_rows([(0, 0.30), (10, 0.35), (20, 0.41), (30, 0.60), (40, 0.55)])
    n = recipes.run_numbers(rows)
    assert (n["start"], n["final"], n["best"], n["gain_step"], n["steps"]) == (0.30, 0.55, 0.60, 20, 40)
    assert n["kl"] == pytest.approx(0.01 * (36 + 37 + 38 + 39 + 40) / 5)  # the last 5 steps
    assert recipes.run_numbers([{"step": 0, "val/accuracy": 0.5}])["kl"] is None


def run(entry: str, seed: int, start: float, final: float, best: float, gain_step: int | None = 10) -> dict:
    return {
        "entry": entry,
        "seed": seed,
        "start": start,
        "final": final,
        "best": best,
        "gain_step": gain_step,
        "kl": 0.002,
        "wall_s": 60.0 + seed,
    }


RUNS = [
    run("grpo", 0, 0.3, 0.70, 0.72),
    run("grpo", 1, 0.4, 0.80, 0.80),
    run("grpo", 2, 0.2, 0.75, 0.75),
    run("gspo", 0, 0.3, 0.85, 0.85),
    run("gspo", 1, 0.4, 0.90, 0.91),
    run("gspo", 2, 0.2, 0.82, 0.86),
    run("grpo_no_baseline", 0, 0.3, 0.50, 0.50, None),
    run("grpo_no_baseline", 1, 0.4, 0.60, 0.61, 20),
    run("grpo_no_baseline", 2, 0.2, 0.69, 0.69, 30),
]


def test_rows_are_ranked_with_the_seeds_spread_and_the_paired_gap() -> None:
    rows = recipes.recipe_rows(RUNS, ["grpo", "gspo", "grpo_no_baseline"])
    assert [r["recipe"] for r in rows] == ["gspo", "grpo", "grpo_no_baseline"]
    gspo = rows[0]
    assert (gspo["final_min"], gspo["final_max"]) == (0.82, 0.90)
    assert gspo["final_mean"] == pytest.approx(0.8566667) and gspo["best_mean"] == pytest.approx(0.8733333)
    assert gspo["gain_mean"] == pytest.approx((0.55 + 0.50 + 0.62) / 3)
    vs = gspo["vs_grpo"]  # 0.15, 0.10, 0.07 on the paired seeds
    assert (vs["mean"], vs["min"], vs["max"]) == pytest.approx((0.1066667, 0.07, 0.15))
    assert rows[1]["vs_grpo"] is None and rows[2]["gain_steps"] == [None, 20, 30]
    assert rows[0]["wall_mean"] == 61.0 and rows[0]["kl_mean"] == 0.002
    # GSPO's seeds 0.82-0.90 lie above GRPO's 0.70-0.80; the sabotage's 0.50-0.69 below GRPO's
    assert recipes.separated_pairs(rows) == [
        ("gspo", "grpo"),
        ("gspo", "grpo_no_baseline"),
        ("grpo", "grpo_no_baseline"),
    ]
    assert recipes.sabotage_findings(rows) == [
        "GRPO, no baseline (broken): final 0.597 (0.500-0.690) against GRPO's 0.750 (0.700-0.800): every seed "
        "below every seed of the intact recipe (seen); paired gap -0.153 (-0.200 to -0.060), below on 3 of 3 seeds"
    ]
    overlapping = [*RUNS[:6], run("grpo_no_baseline", 0, 0.3, 0.71, 0.71), *RUNS[7:]]
    rows = recipes.recipe_rows(overlapping, ["grpo", "gspo", "grpo_no_baseline"])
    assert recipes.sabotage_findings(rows)[0].endswith(
        "the ranges overlap (NOT seen); paired gap -0.083 (-0.200 to +0.010), below on 2 of 3 seeds"
    )


def test_the_commands_move_each_preset_to_the_task(tmp_path: Path) -> None:
    """Every recipe's command loads (the config check of a run) with the task's start, data and response
    length; a KL loss of weight 0 only where the preset has none; the per-recipe keys."""
    from ppo.config_loader import load_config

    assets = Path("/data/assets1")
    for name, recipe in recipes.RECIPES.items():
        args = recipes.train_args(name, assets=assets, seed=3, steps=7, test_freq=5, out_dir=tmp_path / name)
        assert args[:2] == ["--config", str(recipes.ROOT / recipe.preset)]
        cfg = load_config(args[1], args[2:])
        assert cfg.model.path == "/data/assets1/carry4/sft" and cfg.data.max_response_length == 32
        assert cfg.data.train_files == ["/data/assets1/carry4/data/train.parquet"]
        assert (cfg.trainer.seed, cfg.trainer.total_training_steps, cfg.trainer.test_freq) == (3, 7, 5)
        assert cfg.trainer.save_freq == -1 and cfg.trainer.val_before_train and cfg.needs_reference
        if recipes.has_kl_loss(recipes.ROOT / recipe.preset):
            assert not set(recipes.MEASURE_KL) & set(args) and cfg.actor.kl_loss_coef > 0
        else:
            assert set(recipes.MEASURE_KL) <= set(args) and cfg.actor.kl_loss_coef == 0.0
    measured = {n for n, r in recipes.RECIPES.items() if not recipes.has_kl_loss(recipes.ROOT / r.preset)}
    assert measured == {"gae", "reinforce_pp", "opo", "drgrpo", "dapo"}
    args = recipes.train_args("drgrpo", assets=assets, seed=0, steps=1, test_freq=1, out_dir=tmp_path)
    assert load_config(args[1], args[2:]).actor.loss_scale_factor == 32
    args = recipes.train_args("dapo", assets=assets, seed=0, steps=1, test_freq=1, out_dir=tmp_path)
    assert load_config(args[1], args[2:]).reward.overlong_buffer.len == 3
    args = recipes.train_args("rloo", assets=assets, seed=0, steps=1, test_freq=1, out_dir=tmp_path)
    assert load_config(args[1], args[2:]).algorithm.adv_estimator == "rloo"
    broken = recipes.command("grpo_no_baseline", 2, ["--config", "x"])
    assert broken[-5:] == ["-m", "ppo_bench.sabotage", "grpo_no_baseline", "--config", "x"]
    assert recipes.command("grpo", 2, ["--config", "x"])[-3:] == [
        str(recipes.ROOT / "train_ppo.py"),
        "--config",
        "x",
    ]
    assert set(recipes.SABOTAGED) == set(sabotage.SABOTAGES)


def test_the_sabotages_advantages() -> None:
    scores = t64(1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0)
    groups = torch.tensor([7, 7, 7, 7, 3, 3, 3, 3, 5, 5])
    # group 7: std of (1,0,0,0) = 0.5, mean 0.25 (GRPO: 1.5 and -0.5); group 3: equal scores; group 5: std
    # of (0,1) = 0.7071, mean 0.5 (GRPO: -0.7071 and 0.7071)
    e = 1e-6
    no_baseline = t64(1 / (0.5 + e), 0, 0, 0, 0, 0, 0, 0, 0, 1 / (0.5**0.5 + e))
    close(sabotage.grpo_without_baseline(scores, groups), no_baseline)
    a, b = 0.75 / (0.5 + e), 0.25 / (0.5 + e)
    c = 0.5 / (0.5**0.5 + e)
    close(sabotage.grpo_absolute_advantage(scores, groups), t64(a, b, b, b, 0, 0, 0, 0, c, c))
    # shifted inside each group: group 7's (1,0,0,0) -> (0,0,0,1); group 5's (0,1) -> (1,0)
    g = (1 - 0.25) / (0.5 + e)
    shifted = t64(-0.25 / (0.5 + e), -0.25 / (0.5 + e), -0.25 / (0.5 + e), g, 0, 0, 0, 0, c, -c)
    close(sabotage.grpo_shifted_scores(scores, groups), shifted)


def test_a_sabotage_replaces_only_the_grpo_row() -> None:
    from ppo import algorithms

    before = dict(algorithms.ADVANTAGE_ESTIMATORS)
    try:
        sabotage.patch_grpo(sabotage.SABOTAGES["grpo_abs_advantage"])
        patched = algorithms.ADVANTAGE_ESTIMATORS
        assert patched["grpo"] is not before["grpo"]
        assert {k: v for k, v in patched.items() if k != "grpo"} == {
            k: v for k, v in before.items() if k != "grpo"
        }
        x = algorithms.AdvantageInputs(
            token_rewards=t64([0.0, 1.0], [0.0, 0.0]).float(),
            response_mask=torch.tensor([[1, 1], [1, 0]]),
            group_ids=torch.tensor([0, 0]),
        )
        est = patched["grpo"](x, algorithms.AdvantageSettings())
        a = 0.5 / (0.5**0.5 + 1e-6)  # scores (1, 0): mean 0.5, std 0.7071; both pushed up
        close(est.advantages, t64([a, a], [a, 0.0]))
    finally:
        algorithms.ADVANTAGE_ESTIMATORS.update(before)
    assert sabotage.main(["nothing"]) == 2


# ----------------------------------------------------------------------------------------------------
# Bad input, the comparison's files, the doc
# ----------------------------------------------------------------------------------------------------


@pytest.fixture
def carry4(tmp_path: Path) -> Path:
    """An asset set with the files the comparison checks (empty: no run reads them here)."""
    root = tmp_path / "a"
    (root / "carry4" / "sft").mkdir(parents=True)
    (root / "carry4" / "sft" / "config.json").write_text("{}")
    (root / "carry4" / "data").mkdir()
    import pyarrow as pa
    import pyarrow.parquet as pq

    for split in ("train", "val"):
        pq.write_table(pa.table({"x": list(range(4))}), root / "carry4" / "data" / f"{split}.parquet")
    return root


def cli(assets: Path, out: Path, *more: str) -> list[str]:
    return [f"--assets={assets}", f"--out={out}", "--steps=40", *more]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--recipes=grpo,nope"], "unknown nope"),
        (["--recipes=grpo,grpo"], "named twice"),
        (["--recipes=gspo", "--sabotage=grpo_no_baseline"], "breaks grpo: add it to --recipes"),
        (["--seeds", "1", "2"], "one seed per asset set"),
        (["--steps=0"], "--steps 0: at least 1"),
    ],
)
def test_bad_input_is_one_line_before_any_run(
    carry4: Path, tmp_path: Path, args: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    assert recipes.main(cli(carry4, tmp_path / "cmp", *args)) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and not (tmp_path / "cmp").exists()


def test_missing_assets_and_doc_markers_are_refused(carry4: Path, tmp_path: Path) -> None:
    with pytest.raises(recipes.InputError, match=r"make carry4 ASSETS=.*nowhere"):
        recipes.check_inputs(recipes.parse_args(cli(tmp_path / "nowhere", tmp_path / "cmp")))
    doc = tmp_path / "doc.md"
    doc.write_text(f"# x\n{recipes.MARKERS[0]}\n")
    with pytest.raises(recipes.InputError, match="needs the line <!-- recipes_carry4:end --> exactly once"):
        recipes.check_inputs(recipes.parse_args(cli(carry4, tmp_path / "cmp", f"--doc={doc}")))


CURVES = {
    "grpo": [(0, 0.30), (20, 0.50), (40, 0.70)],
    "gspo": [(0, 0.30), (20, 0.60), (40, 0.80)],
    "grpo_no_baseline": [(0, 0.30), (20, 0.35), (40, 0.45)],
}


def fake_training(cmd: list[str], log: Path) -> float:
    """A ``run_logged`` that trains nothing: the entry's ``CURVES`` into the command's output folder."""
    out_dir = Path(next(a for a in cmd if a.startswith("trainer.output_dir=")).partition("=")[2])
    assert log == out_dir / "train.log" and out_dir.is_dir()
    rows = metrics_rows(CURVES[out_dir.name])
    (out_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    log.write_text(f"trained {out_dir.name}\n")
    return 30.0


def test_the_comparison_writes_its_files_and_the_doc_section(
    carry4: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(recipes, "run_logged", fake_training)
    monkeypatch.setattr(recipes, "check_command", lambda args, nproc: None)  # the commands' own test is above
    doc = tmp_path / "docs" / "results.md"
    doc.parent.mkdir()
    doc.write_text(f"# Results\nbefore\n{recipes.MARKERS[0]}\nold table\n{recipes.MARKERS[1]}\nafter\n")
    out, plot = tmp_path / "cmp", tmp_path / "docs" / "recipes.png"
    argv = cli(carry4, out, "--recipes=grpo,gspo", "--sabotage=grpo_no_baseline", f"--plot={plot}")
    argv += [f"--doc={doc}", f"--assets={carry4}", "--seeds", "0", "1"]  # two seeds: a spread to compare
    assert recipes.main(argv) == 0
    table = capsys.readouterr().out
    assert (
        "| 1 | GSPO | `demo_cpu_gspo.yaml` | 0.800 (0.800-0.800) | 0.800 (0.800-0.800) | +0.500 | +0.100"
        in table
    )
    assert "GRPO, no baseline (broken): final 0.450 (0.450-0.450) against GRPO's 0.700" in table
    results = json.loads((out / "results.json").read_text())
    assert [r["recipe"] for r in results["recipes"]] == ["gspo", "grpo", "grpo_no_baseline"]
    assert [(r["seed"], r["entry"]) for r in results["runs"]][2:4] == [(0, "grpo_no_baseline"), (1, "grpo")]
    assert results["runs"][2]["command"][-1] == "trainer.val_before_train=true"
    assert "ppo_bench.sabotage" in results["runs"][2]["command"]
    assert (
        "Recipes whose seeds do not overlap (every seed of the first above every seed of the second): GSPO > GRPO"
        in table
    )
    text = doc.read_text()
    assert text.startswith(
        f"# Results\nbefore\n{recipes.MARKERS[0]}\nGenerated by `python -m ppo_bench.recipes "
    )
    assert text.endswith(f"![The recipes on the four-digit task](recipes.png)\n{recipes.MARKERS[1]}\nafter\n")
    assert "old table" not in text and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # an earlier comparison is kept without --overwrite
    assert recipes.main(cli(carry4, out, "--recipes=grpo")) == 2
    assert "pass --overwrite" in capsys.readouterr().err and (out / "seed0" / "gspo").is_dir()


def test_reuse_copies_the_runs_of_the_same_command(
    carry4: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    trained: list[str] = []

    def counting(cmd: list[str], log: Path) -> float:
        trained.append(log.parent.name)
        return fake_training(cmd, log)

    monkeypatch.setattr(recipes, "run_logged", counting)
    monkeypatch.setattr(recipes, "check_command", lambda args, nproc: None)
    first, second = tmp_path / "first", tmp_path / "second"
    assert recipes.main(cli(carry4, first, "--recipes=grpo,gspo")) == 0
    assert trained == ["grpo", "gspo"]
    assert "One seed: no spread to tell recipes apart by" in capsys.readouterr().out
    # gspo with other steps is another command: trained again; grpo is the same: copied with its wall time
    argv = cli(carry4, second, "--recipes=grpo", "--sabotage=grpo_no_baseline", f"--reuse={first}")
    assert recipes.main(argv) == 0
    assert trained == ["grpo", "gspo", "grpo_no_baseline"]
    assert "1 of 2 runs copied from" in capsys.readouterr().out
    runs = json.loads((second / "results.json").read_text())["runs"]
    assert runs[0]["reused_from"] == str(first.resolve() / "seed0" / "grpo") and runs[0]["wall_s"] == 30.0
    assert runs[0]["final"] == 0.70 and (second / "seed0" / "grpo" / "train.log").is_file()
    assert recipes.main(cli(carry4, tmp_path / "x", f"--reuse={tmp_path / 'none'}")) == 2
    assert "no results.json" in capsys.readouterr().err


def test_help_answers_without_torch() -> None:
    code = "import sys, ppo_bench.recipes; print('torch' in sys.modules)"
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert imported.stdout.strip() == "False"
