"""The trackers of ``trainer.logger`` (ppo/trackers.py): each writes the step's metrics and the resolved
config where verl 0.9.1's tracking puts them, read back here with the tracker's own API or files; a
tracker whose package is missing stops the run with one line naming its extra.

The trackers run in one subprocess (``offline_run``) with their offline modes set and every HTTP request sent to
a closed local port, so that nothing reaches the network and no tracker's hooks (stdout capture, atexit,
signal handlers) stay in the test process. A tracker that is not installed skips with the extra that
installs it (mlflow, swanlab and clearml are in locks/; trackio, which pulls a web server, is not).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from ppo.config import ConfigError, SFTConfig
from ppo.config_loader import load_config, to_dict
from ppo.metrics import MetricsLogger, make_metrics_logger
from ppo.trackers import TRACKERS, check_trackers, mlflow_key
from tests.helpers import demo_inputs, load_script, run

ROOT = Path(__file__).resolve().parents[2]

STEPS = {
    1: {"actor/pg_loss": 0.5, "critic/score/mean": 0.25, "val/gsm8k/pass@2": 0.75},
    2: {"actor/pg_loss": -0.125, "critic/score/mean": 1.0, "val/gsm8k/pass@2": 0.5},
}
"""Two steps' metrics, as the trainer hands them to the sinks."""
KEYS = set(STEPS[1])

OVERRIDES = ["trainer.project_name=proj", "trainer.experiment_name=exp", "actor.optim.lr=3e-06"]
"""The config of every run here: the project and run names the trackers take, and a nested value."""

WRITER = """
import json, sys, types
from pathlib import Path
from ppo.config_loader import load_config
from ppo.metrics import make_metrics_logger

out, overrides, steps = Path(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
cfg = load_config(None, overrides)
log = make_metrics_logger(cfg, types.SimpleNamespace(is_main=True), out, len(steps), console=False)
for step, metrics in steps.items():
    log.log(int(step), metrics)
log.close()
"""
"""A run's sinks through the trainer's own path: the config from overrides, ``make_metrics_logger``, two
steps, ``close``."""

OFFLINE = {
    "HTTP_PROXY": "http://127.0.0.1:9",
    "HTTPS_PROXY": "http://127.0.0.1:9",
    "http_proxy": "http://127.0.0.1:9",
    "https_proxy": "http://127.0.0.1:9",
    "NO_PROXY": "",
    "no_proxy": "",
    "HF_HUB_OFFLINE": "1",
    "CLEARML_OFFLINE_MODE": "1",
    "SWANLAB_MODE": "offline",
    "WANDB_MODE": "offline",
}
"""Every tracker offline, and any HTTP request it still makes refused at once (port 9, nothing listens)."""


OFFLINE_TRACKERS = ["mlflow", "swanlab", "trackio", "clearml"]
"""The trackers ``offline_run`` writes to, those of them installed here."""


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One run of ``WRITER`` with ``trainer.logger=[console,<every installed tracker>]`` (one process: torch
    imports once), in a folder that is its working folder and HOME; the folder and the resolved config."""
    folder = tmp_path_factory.mktemp("trackers")
    # ClearML's reporter in threads, not in a process it forks: on a busy machine the fork (from a process
    # that already runs threads) can leave Task.close waiting for it for ever.
    (folder / "clearml.conf").write_text("sdk { development { report_use_subprocess: false } }\n")
    installed = [name for name in OFFLINE_TRACKERS if importlib.util.find_spec(name) is not None]
    overrides = [
        *OVERRIDES,
        f"trainer.logger=[console,{','.join(installed)}]",
        f"trainer.output_dir={folder}/run",
    ]
    env = {
        **os.environ,
        **OFFLINE,
        "HOME": str(folder),
        "PYTHONPATH": str(ROOT),
        "MLFLOW_TRACKING_URI": f"file:{folder}/mlruns",
        "MLFLOW_ALLOW_FILE_STORE": "true",  # the file store, for tests: sqlite's set-up takes 15 s
        "SWANLAB_LOG_DIR": str(folder / "swanlog"),
        "TRACKIO_DIR": str(folder / "trackio"),
        "CLEARML_CACHE_DIR": str(folder / "clearml"),
        "CLEARML_CONFIG_FILE": str(folder / "clearml.conf"),
    }
    proc = subprocess.run(
        [sys.executable, "-c", WRITER, str(folder / "run"), json.dumps(overrides), json.dumps(STEPS)],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return folder, to_dict(load_config(None, overrides))


def need(module: str) -> None:
    pytest.importorskip(module, reason=f"{module} is not installed (pip install 'ppo-rlhf[{module}]')")


# ----------------------------------------------------------------------------------------------------
# A missing package stops the run with one line naming the extra
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TRACKERS))
def test_a_missing_tracker_names_its_extra(
    name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, name, None)  # `import <name>` now fails as if not installed
    message = f"trainer.logger names {name} but {name} is not installed: pip install 'ppo-rlhf[{name}]'"
    with pytest.raises(ConfigError) as err:
        check_trackers(["console", name])
    assert str(err.value) == message
    # The sinks themselves refuse it too, before writing anything.
    with pytest.raises(ConfigError, match="pip install"):
        MetricsLogger(tmp_path / "run", ["jsonl", name], is_main=True, total_steps=1)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("entry", ["train_ppo", "train_sft"])
def test_the_run_stops_before_anything_loads(
    entry: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Through the entry points a user calls: one line naming the extra, exit code 2, no run folder (so no
    # model loaded); the model and data it names need not exist, the run stops before it looks.
    monkeypatch.setitem(sys.modules, "swanlab", None)
    cls = None if entry == "train_ppo" else SFTConfig
    args = [*demo_inputs(cls), "trainer.logger=[console,swanlab]", f"trainer.output_dir={tmp_path / 'out'}"]
    main = run if entry == "train_ppo" else load_script(entry).main
    assert main(args) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].endswith(
        " ERROR trainer.logger names swanlab but swanlab is not installed: pip install 'ppo-rlhf[swanlab]'"
    )
    assert not (tmp_path / "out").exists()


def test_only_trackers_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in TRACKERS:
        monkeypatch.setitem(sys.modules, name, None)
    check_trackers(["console", "jsonl", "tensorboard", "file"])  # no package needed: no error


def test_other_ranks_start_no_tracker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    log = MetricsLogger(tmp_path, ["file", "jsonl"], is_main=False, total_steps=1)
    log.log(1, STEPS[1])
    log.close()
    assert log.trackers == {} and list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------------------------------
# file: verl's FileLogger lines
# ----------------------------------------------------------------------------------------------------


def test_file_writes_verls_lines_at_verls_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH", raising=False)
    monkeypatch.delenv("VERL_FILE_LOGGER_ROOT", raising=False)
    cfg = load_config(None, [*OVERRIDES, "trainer.logger=[console,file]"])
    log = make_metrics_logger(cfg, types.SimpleNamespace(is_main=True), tmp_path / "run", 3, console=False)
    for step, metrics in STEPS.items():
        log.log(step, metrics)
    log.log(
        3, {"critic/score/mean": float("nan")}
    )  # a skipped step's score: null, as verl's orjson writes it
    log.close()
    # verl's default path: ./{project_name}/{experiment_name}.jsonl in the working folder.
    lines = (tmp_path / "proj" / "exp.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "data": {"actor/pg_loss": 0.5, "critic/score/mean": 0.25, "val/gsm8k/pass@2": 0.75}},
        {"step": 2, "data": {"actor/pg_loss": -0.125, "critic/score/mean": 1.0, "val/gsm8k/pass@2": 0.5}},
        {"step": 3, "data": {"critic/score/mean": None}},
    ]


def test_file_path_from_verls_variables_and_resume(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(tmp_path / "root"))
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH", raising=False)
    log = MetricsLogger(tmp_path / "a", ["file"], is_main=True, total_steps=1, project="p", run_name="r")
    log.log(1, {"x/y": 1.0})
    log.close()
    assert (tmp_path / "root" / "p" / "r.jsonl").read_text() == '{"step": 1, "data": {"x/y": 1.0}}\n'

    path = tmp_path / "logs" / "mine.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))  # wins over the root
    log = MetricsLogger(tmp_path / "b", ["file"], is_main=True, total_steps=3)
    for step in (1, 2, 3):
        log.log(step, {"x/y": float(step)})
    log.close()
    # A run resumed from its step-1 checkpoint drops the steps it redoes and continues the file.
    log = MetricsLogger(tmp_path / "b", ["file"], is_main=True, total_steps=3, resume_step=1)
    log.log(2, {"x/y": 20.0})
    log.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": 1, "data": {"x/y": 1.0}},
        {"step": 2, "data": {"x/y": 20.0}},
    ]
    assert not (tmp_path / "root" / "p" / "b.jsonl").exists()


# ----------------------------------------------------------------------------------------------------
# mlflow, swanlab, trackio, clearml: the real packages, offline
# ----------------------------------------------------------------------------------------------------


def test_mlflow_names_as_verl() -> None:
    assert mlflow_key("val/gsm8k/pass@2") == "val/gsm8k/pass_at_2"
    assert mlflow_key("a//b(c)") == "a/b_c_"
    assert mlflow_key("timing_s/update_actor") == "timing_s/update_actor"


@pytest.mark.slow
def test_mlflow_run_holds_metrics_and_config(monkeypatch: pytest.MonkeyPatch, offline_run: Any) -> None:
    need("mlflow")
    from mlflow.tracking import MlflowClient

    folder, config = offline_run
    uri = f"file:{folder}/mlruns"
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("proj")  # trainer.project_name is MLflow's experiment
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "exp" and run.info.status == "FINISHED"
    history = {
        key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        for key in ("actor/pg_loss", "critic/score/mean", "val/gsm8k/pass_at_2")
    }
    assert history == {
        "actor/pg_loss": [(1, 0.5), (2, -0.125)],
        "critic/score/mean": [(1, 0.25), (2, 1.0)],
        "val/gsm8k/pass_at_2": [(1, 0.75), (2, 0.5)],
    }
    params = run.data.params
    assert params["trainer/project_name"] == "proj" and params["actor/optim/lr"] == "3e-06"
    # Lists as verl flattens them: their length and each item by index.
    logger = config["trainer"]["logger"]
    assert params["trainer/logger/list_len"] == str(len(logger)) and logger[0] == "console"
    assert [params[f"trainer/logger/{i}"] for i in range(len(logger))] == logger
    assert params["actor/clip_ratio"] == str(config["actor"]["clip_ratio"])


@pytest.mark.slow
def test_swanlab_run_holds_metrics_and_config(offline_run: Any) -> None:
    need("swanlab")
    import yaml
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    folder, config = offline_run
    (run_dir,) = (folder / "swanlog").glob("run-*")
    reader = DataStoreReader()
    reader.open(next(run_dir.glob("*.swanlab")))
    records = []
    for data in reader:
        record = Record()
        record.ParseFromString(data)
        records.append(record)
    reader.close()
    start = next(r.start for r in records if r.HasField("start"))
    assert (start.project, start.name) == ("proj", "exp")
    scalars = sorted(  # swanlab's own system metrics (__swanlab__.cpu.pct, ...) left out
        (r.scalar.key, r.scalar.step, r.scalar.value.number)
        for r in records
        if r.HasField("scalar") and r.scalar.key in KEYS
    )
    assert scalars == sorted((k, s, v) for s, metrics in STEPS.items() for k, v in metrics.items())
    assert any(r.HasField("finish") for r in records)
    logged = yaml.safe_load((run_dir / "files" / "config.yaml").read_text())
    assert {key: logged[key]["value"] for key in config} == config


@pytest.mark.slow
def test_trackio_run_holds_metrics_and_config(offline_run: Any) -> None:
    need("trackio")
    folder, config = offline_run
    # trackio reads TRACKIO_DIR as it is imported: read it back in a process of its own too.
    reader = """
import json
from trackio.api import Api
from trackio.sqlite_storage import SQLiteStorage
(run,) = list(Api().runs("proj"))
logs = SQLiteStorage.get_logs("proj", run.name)
print(json.dumps({"name": run.name, "config": run.config, "logs": logs}, default=str))
"""
    env = {**os.environ, **OFFLINE, "TRACKIO_DIR": str(folder / "trackio"), "HOME": str(folder)}
    proc = subprocess.run(
        [sys.executable, "-c", reader], env=env, cwd=folder, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["name"] == "exp"
    rows = {
        row["step"]: {k: row[k] for k in STEPS[1] if k in row}
        for row in got["logs"]
        if "actor/pg_loss" in row
    }
    assert rows == STEPS
    assert {key: got["config"][key] for key in config} == config


@pytest.mark.slow
def test_clearml_task_holds_metrics_and_config(offline_run: Any) -> None:
    need("clearml")
    from clearml.utilities.pyhocon import ConfigFactory

    folder, config = offline_run
    (session,) = [p for p in (folder / "clearml" / "offline").iterdir() if p.is_dir()]
    task = json.loads((session / "task.json").read_text())
    assert task["name"] == "exp"
    events = json.loads((session / "metrics.jsonl").read_text())
    scalars = sorted(  # ClearML's resource monitor (:monitor:...) left out
        (e["metric"] + "/" + e["variant"], e["iter"], e["value"])
        for e in events
        if e["type"] == "training_stats_scalar" and e["metric"] + "/" + e["variant"] in KEYS
    )
    assert scalars == sorted((k, s, v) for s, metrics in STEPS.items() for k, v in metrics.items())
    logged = ConfigFactory.parse_string(task["configuration"]["Hyperparameters"]["value"])
    assert logged["trainer"]["project_name"] == "proj" and logged["actor"]["optim"]["lr"] == 3e-06
    assert json.loads(json.dumps(logged.as_plain_ordered_dict())) == config
