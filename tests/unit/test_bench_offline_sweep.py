"""Tests of ``scripts/ppo_bench/offline_sweep.py`` (every offline method tuned for itself): the KL bands, the
configurations over seeds, each method's best per band, what the table says about offline KL-PPO and
offline SPPO against the baselines' frontier, the runs' command lines, bad input, and one small sweep end to
end (two methods, one worker process)::

    pytest tests/unit/test_bench_offline_sweep.py
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from ppo_bench import offline_sweep as sweep
from ppo_bench import offline_sweep_runs
from ppo_bench.compare_offline_runs import METHODS
from ppo_bench.runs import CommandError

from tests.helpers import write_parquet


def test_kl_bands() -> None:
    assert [sweep.band_of(kl) for kl in (-0.01, 0.05, 0.051, 0.2, 0.3, 0.5, 0.6, 20.0)] == [
        0,
        0,
        1,
        1,
        2,
        2,
        3,
        3,
    ]
    assert [sweep.band_name(i) for i in range(4)] == [
        "KL ≤ 0.05",
        "0.05 < KL ≤ 0.2",
        "0.2 < KL ≤ 0.5",
        "KL > 0.5",
    ]


def run(
    method: str, strength: float, lr: float, seed: int, accuracy: float, kl: float, task: str = "add"
) -> dict:
    return {
        "task": task,
        "seed": seed,
        "method": method,
        "strength": strength,
        "lr": lr,
        "accuracy": accuracy,
        "kl": kl,
    }


# Two seeds. In the band 0.05-0.2 DPO (0.85 at 0.10) beats PPO's best there (0.80 at 0.15) on both counts;
# SPPO's best there (0.90 at 0.12) no baseline beats. At low KL PPO (0.70 at 0.02) beats DPO's 0.60 at
# 0.04 but not KTO (0.72 at 0.01).
RUNS = [
    *[run("ppo", 0.1, 1e-4, s, a, k) for s, a, k in ((0, 0.78, 0.14), (1, 0.82, 0.16))],
    *[run("ppo", 1.0, 1e-4, s, a, k) for s, a, k in ((0, 0.70, 0.02), (1, 0.70, 0.02))],
    *[run("ppo", 0.1, 1e-3, s, a, k) for s, a, k in ((0, 0.30, 5.0), (1, 0.20, 7.0))],
    *[run("sppo", 1.0, 1e-4, s, a, k) for s, a, k in ((0, 0.88, 0.11), (1, 0.92, 0.13))],
    *[run("dpo", 1.0, 1e-4, s, a, k) for s, a, k in ((0, 0.84, 0.09), (1, 0.86, 0.11))],
    *[run("dpo", 10.0, 1e-4, s, a, k) for s, a, k in ((0, 0.60, 0.03), (1, 0.60, 0.05))],
    *[run("kto", 1.0, 1e-5, s, a, k) for s, a, k in ((0, 0.71, 0.01), (1, 0.73, 0.01))],
    run("dpo", 1.0, 1e-4, 0, 0.5, 0.5, task="carry4"),  # another task: never mixed in
]


def test_configurations_average_the_seeds() -> None:
    rows = sweep.configurations(RUNS)
    assert len(rows) == 8
    ppo = next(r for r in rows if (r["method"], r["strength"], r["lr"]) == ("ppo", 0.1, 1e-4))
    assert ppo["seeds"] == [0, 1] and ppo["accuracies"] == [0.78, 0.82]
    assert ppo["accuracy"] == pytest.approx(0.80) and ppo["kl"] == pytest.approx(0.15) and ppo["band"] == 1
    assert (ppo["accuracy_min"], ppo["accuracy_max"]) == (0.78, 0.82)
    best = sweep.best_per_band(rows, "add", "ppo")
    assert {b: (r["strength"], r["lr"]) for b, r in best.items()} == {
        0: (1.0, 1e-4),
        1: (0.1, 1e-4),
        3: (0.1, 1e-3),
    }
    assert set(sweep.best_per_band(rows, "carry4", "dpo")) == {2}


def test_verdicts_hold_ppo_and_sppo_against_the_tuned_baselines() -> None:
    grid = {
        "ppo": (0.01, 0.1, 1.0),
        "sppo": (0.3, 1.0, 3.0),
        "dpo": (0.1, 1.0, 10.0),
        "kto": (1.0, 10.0, 100.0),
    }
    lines = sweep.verdicts(sweep.configurations(RUNS), "add", (1e-5, 1e-4, 1e-3), grid)
    assert lines[0] == (
        "- offline KL-PPO in KL ≤ 0.05 (kl_loss_coef=1, lr 0.0001: 0.700 at KL 0.020): below the baselines' "
        "frontier: KTO β=1, lr 1e-05: 0.720 at KL 0.010; against the band's best baseline, KTO β=1, lr 1e-05: "
        "0.720 at KL 0.010: -0.020 (seeds -0.030 to -0.010)"
    )
    assert lines[1].startswith(
        "- offline KL-PPO in 0.05 < KL ≤ 0.2 (kl_loss_coef=0.1, lr 0.0001: 0.800 at KL 0.150)"
    )
    assert "below the baselines' frontier: DPO β=1, lr 0.0001: 0.850 at KL 0.100" in lines[1]
    assert lines[1].endswith("-0.050 (seeds -0.060 to -0.040)")
    assert "offline KL-PPO in KL > 0.5" in lines[2] and "below the baselines' frontier" in lines[2]
    assert lines[3].startswith(
        "- offline SPPO in 0.05 < KL ≤ 0.2 (eta=1, lr 0.0001: 0.900 at KL 0.120): on the"
    )
    assert lines[3].endswith("+0.050 (seeds +0.040 to +0.060)")
    # PPO's best (0.80) took its middle strength and lr, SPPO's and DPO's their middle lr and strength; KTO's
    # its smallest lr and strength
    assert lines[-1] == (
        "- the most accurate configuration at an edge of its grid (a wider grid might do better): "
        "KTO (lr 1e-05, β=1)"
    )


def results(runs: list[dict]) -> dict[str, Any]:
    return {
        "settings": {
            "tasks": ["add"],
            "methods": ["ppo", "sppo", "dpo", "kto"],
            "strengths": {
                m: sweep.STRENGTHS.get(m, METHODS[m].strengths) for m in ("ppo", "sppo", "dpo", "kto")
            },
            "lrs": [1e-5, 1e-4, 1e-3],
            "seeds": [0, 1],
            "steps": 20,
            "batch": 16,
            "prompts": 512,
            "eval_prompts": 300,
            "command": "python -m ppo_bench.offline_sweep",
            "total_wall_s": 120.0,
            "machine": "2 cores",
            "workers": 2,
        },
        "sft": [{"task": "add", "seed": 0, "accuracy": 0.65}, {"task": "add", "seed": 1, "accuracy": 0.61}],
        "runs": runs,
        "configurations": sweep.configurations(runs),
    }


def test_table_doc_and_figure(tmp_path: Path) -> None:
    res = results([r for r in RUNS if r["task"] == "add"])
    table = sweep.table_markdown(res)
    assert "**two-digit sums** (`add`): the SFT models 0.630 (0.650, 0.610)" in table
    assert "| method | KL ≤ 0.05 | 0.05 < KL ≤ 0.2 | 0.2 < KL ≤ 0.5 | KL > 0.5 |" in table
    assert (
        "| offline KL-PPO | 0.700 (0.700-0.700) kl_loss_coef=1 lr 0.0001 KL 0.020 | 0.800 (0.780-0.820) "
        "kl_loss_coef=0.1 lr 0.0001 KL 0.150 | - | 0.250 (0.200-0.300) kl_loss_coef=0.1 lr 0.001 KL 6.000 |"
    ) in table
    assert "| KTO | 0.720 (0.710-0.730) β=1 lr 1e-05 KL 0.010 | - | - | - |" in table
    assert "one standard error of one seed's accuracy about ±0.029 at 0.5" in table
    doc = tmp_path / "results.md"
    doc.write_text("# Results\nbefore\n" + "\n".join(sweep.MARKERS) + "\nafter\n")
    section = sweep.doc_section(res, table, tmp_path / "fig.png", doc)
    sweep.write_doc(doc, section, sweep.MARKERS)
    text = doc.read_text()
    assert text.startswith(
        "# Results\nbefore\n<!-- offline_sweep:begin -->\nGenerated by `python -m ppo_bench"
    )
    assert "(14 runs in 2 minutes on 2 cores, 2 worker processes)" in text
    assert text.endswith(
        "![The offline methods tuned for themselves](fig.png)\n<!-- offline_sweep:end -->\nafter\n"
    )
    sweep.plot(res, tmp_path / "fig.png")
    assert (tmp_path / "fig.png").stat().st_size > 10_000


# ----------------------------------------------------------------------------------------------------
# Inputs and commands
# ----------------------------------------------------------------------------------------------------

RESPONSES = ["12 + 30 = 42\n#### 42", "#### 7", "4 + 4 = 8\n#### 8", "no idea"]


@pytest.fixture(scope="module")
def asset_set(tiny_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An asset set with the two-digit task only: the tiny base model as its SFT model, its validation
    prompts, and 8 ranked groups of the four ``RESPONSES`` (rotated; log-probs of -1 a token)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("asset_set")
    shutil.copytree(tiny_assets / "base", root / "sft")
    (root / "data").mkdir()
    shutil.copy(tiny_assets / "data" / "val.parquet", root / "data" / "val.parquet")
    tok = AutoTokenizer.from_pretrained(root / "sft")
    rows = pq.read_table(tiny_assets / "data" / "train.parquet").to_pylist()[:8]
    for i, row in enumerate(rows):
        responses = [RESPONSES[(i + j) % 4] for j in range(4)]
        row.update(
            responses=responses,
            scores=[1.0, 0.0, 0.0, 0.0],
            ranks=[0, 1, 1, 1],
            logprobs=[[-1.0] * (len(tok(t, add_special_tokens=False).input_ids) + 1) for t in responses],
        )
    (root / "offline").mkdir()
    write_parquet(root / "offline" / "train.parquet", rows)
    return root


def cli(asset_set: Path, out: Path, *extra: str) -> list[str]:
    return ["--assets", str(asset_set), "--tasks", "add", "--out", str(out), *extra]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--tasks", "carry4"],
            "--assets {root}: SFT model {root}/carry4/sft/config.json not found: run `make carry4",
        ),
        (["--methods", "ppo,orpo"], "--methods 'ppo,orpo': unknown orpo"),
        (["--lrs", "1e-4,x"], "--lrs 1e-4,x: not a comma-separated list of numbers"),
        (["--lrs", "1e-4,1e-4"], "--lrs 1e-4,1e-4: positive values, each once"),
        (
            ["--methods", "dpo", "--strengths", "kto=1"],
            "--strengths kto=1: 'kto' is not one of the methods run",
        ),
        (["--batch", "0"], "--batch: at least 1"),
        (["--doc", "{root}/none.md"], "--doc {root}/none.md: cannot read it"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(
    asset_set: Path, tmp_path: Path, capsys: pytest.CaptureFixture, extra: list[str], message: str
) -> None:
    extra = [e.replace("{root}", str(asset_set)) for e in extra]
    assert sweep.main(cli(asset_set, tmp_path / "out", *extra)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message.replace("{root}", str(asset_set)) in err
    assert not (tmp_path / "out").exists()


def test_an_earlier_sweep_needs_overwrite(
    asset_set: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "out" / "add").mkdir(parents=True)
    assert sweep.main(cli(asset_set, tmp_path / "out")) == 2
    assert "holds an earlier comparison (add): pass --overwrite" in capsys.readouterr().err


def test_jobs_and_their_commands(asset_set: Path, tmp_path: Path) -> None:
    """One job per SFT model and per (method, strength, lr); PPO's first; every method's command line
    resolves for one process, with the sweep's batch, response length, seed, strength and lr in it."""
    args = sweep.parse_args(cli(asset_set, tmp_path / "out", "--seeds", "3", "--methods", "dpo,ppo,simpo"))
    plan = sweep.check_inputs(args)
    jobs = sweep.make_jobs(plan, args, tmp_path / "out")
    assert len(jobs) == 1 + 3 * 3 * 3
    assert [j["method"] for j in jobs[:9]] == ["ppo"] * 9 and jobs[9]["method"] == "sft"
    ppo = next(j for j in jobs if j["id"] == "add/seed3/ppo_1_lr0.001")
    for key in (
        "data.train_batch_size=16",
        "actor.ppo_mini_batch_size=16",
        "data.max_response_length=28",
        "trainer.seed=3",
        "trainer.total_training_steps=20",
        f"data.train_files=[{tmp_path / 'out' / 'add' / 'seed3' / 'train.parquet'}]",
    ):
        assert key in ppo["args"], key
    assert ppo["args"][-2:] == ["actor.kl_loss_coef=1", "actor.optim.lr=0.001"]
    simpo = next(j for j in jobs if j["id"] == "add/seed3/simpo_5000_lr1e-05")  # the sweep's strengths
    assert simpo["args"][-4:] == ["loss.type=simpo", "loss.gamma=0.5", "loss.beta=5000", "optim.lr=1e-05"]
    for name in ("ppo", "dpo"):  # as check_command asks before the first run, here in this process
        job = next(j for j in jobs if j["method"] == name)
        flags = ["--print-config", "--allow-missing-paths", "--world-size", "1"]
        assert offline_sweep_runs.trainer(METHODS[name].script).main(job["args"] + flags) == 0


@pytest.mark.slow
def test_a_small_sweep_end_to_end(asset_set: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Two methods, one strength and learning rate each, 2 steps, one worker process: every run trains the
    steps asked, is measured and its model deleted; the SFT model is measured with them."""
    out = tmp_path / "out"
    argv = cli(asset_set, out, "--methods", "ppo,dpo", "--strengths", "ppo=0.1", "--strengths", "dpo=1")
    argv += ["--lrs", "1e-3", "--steps", "2", "--batch", "2", "--prompts", "8", "--eval-prompts", "4"]
    assert sweep.main([*argv, "--workers", "1", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["method"], r["strength"], r["lr"]) for r in lines] == [("ppo", 0.1, 1e-3), ("dpo", 1.0, 1e-3)]
    res = json.loads((out / "results.json").read_text())
    assert [r["steps"] for r in res["runs"]] == [2, 2]
    assert len(res["sft"]) == 1 and res["sft"][0]["kl"] == 0.0  # the SFT model against itself
    assert pq.read_metadata(out / "add" / "seed0" / "train.parquet").num_rows == 8
    for name in ("ppo_0.1_lr0.001", "dpo_1_lr0.001"):
        run_dir = out / "add" / "seed0" / name
        assert (run_dir / "train.log").is_file() and not (run_dir / "hf").exists()
    assert (out / "table.md").is_file() and (out / "frontier.png").is_file()


def worker_dies(job: dict, eval_prompts: int, keep_model: bool) -> dict:
    """A job whose worker process ends without a result, as the kernel's OOM killer ends one."""
    import os

    os._exit(9)


def run_fails(job: dict, eval_prompts: int, keep_model: bool) -> dict:
    """A job whose run fails, as ``run_job`` reports a trainer's error."""
    raise CommandError(f"{job['id']}: exit code 1, 0 of 2 steps")


@pytest.mark.slow
def test_a_failed_run_or_a_dead_worker_stops_the_sweep_with_one_error() -> None:
    """Neither waits for a result that never comes: a run's error comes back as it was, a worker that died
    becomes a CommandError naming the job, and the jobs not yet started are dropped."""
    jobs = [{"id": f"add/seed0/dpo_{i}", "task": "add", "seed": 0, "method": "dpo"} for i in range(3)]
    common = dict(workers=1, eval_prompts=1, keep_models=False, progress=io.StringIO())
    with pytest.raises(CommandError, match=r"^add/seed0/dpo_0: exit code 1, 0 of 2 steps$"):
        offline_sweep_runs.run_all(jobs, **common, run=run_fails)
    with pytest.raises(CommandError, match=r"^add/seed0/dpo_0: a worker process ended without its result"):
        offline_sweep_runs.run_all(jobs, **common, run=worker_dies)
