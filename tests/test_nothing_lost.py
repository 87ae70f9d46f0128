"""Nothing lost, nothing silently reused: one run per folder, reruns and requeues that resume instead of
replacing, outputs that never replace an input or another run's model, resumes that compare the
checkpoint with the run, and stop signals honoured at every long phase."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

from ppo import run_folder
from ppo.metrics import MetricsLogger
from tests.helpers import (
    REWARD_FNS,
    base_args,
    has_metrics,
    launch,
    load_script,
    read_metrics,
    run,
    train,
    wait_until,
)


def write_lock(out: Path, **holder: Any) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / run_folder.LOCK_FILE
    path.write_text(json.dumps({"started": time.time(), "command": "train_ppo.py ...", **holder}))
    return path


# ----------------------------------------------------------------------------------------------------
# One run per folder
# ----------------------------------------------------------------------------------------------------


def test_a_second_run_into_a_busy_folder_is_refused(tiny_assets: Path, tmp_path: Path, caplog: Any) -> None:
    out = tmp_path / "run"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_lock(out, host=socket.gethostname(), pid=other.pid)
        assert run(base_args(tiny_assets, out, steps=1)) == 2
    finally:
        other.kill()
    assert f"is in use by another run (pid {other.pid} on {socket.gethostname()}" in caplog.text
    assert not (out / "metrics.jsonl").exists() and "world size" not in caplog.text  # nothing loaded
    # A run on another host cannot be checked from here: refused too, naming the file to delete.
    lock = write_lock(out, host="other-node", pid=1)
    assert run(base_args(tiny_assets, out, steps=1)) == 2
    assert f"if that run is gone, delete {lock}" in caplog.text


@pytest.mark.slow
def test_the_lock_of_a_dead_run_is_taken_over_and_released(tiny_assets: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid runs no more: a killed job, a torchrun restart
    write_lock(out, host=socket.gethostname(), pid=gone.pid)
    assert [r["step"] for r in train(tiny_assets, out, "trainer.val_before_train=false", steps=1)] == [1]
    assert not (out / run_folder.LOCK_FILE).exists()  # released when the run ended


# ----------------------------------------------------------------------------------------------------
# Reruns and requeues
# ----------------------------------------------------------------------------------------------------


def test_a_rerun_with_nothing_to_resume_keeps_the_first_runs_files(
    tiny_assets: Path, tmp_path: Path, caplog: Any
) -> None:
    """The same command twice (resume_mode=auto, no checkpoint: save_freq defaults to off): the second
    would replace the first's metrics; it stops instead, naming the way out."""
    out = tmp_path / "run"
    args = base_args(tiny_assets, out, steps=1) + ["trainer.logger=[console,jsonl,tensorboard]"]
    assert run(args) == 0
    before = (out / "metrics.jsonl").read_text()
    events = sorted(p.name for p in (out / "tensorboard").iterdir())
    assert run(args) == 2
    assert (
        "already holds a run (metrics.jsonl, tensorboard) and it has no checkpoint to resume" in caplog.text
    )
    assert (out / "metrics.jsonl").read_text() == before
    assert sorted(p.name for p in (out / "tensorboard").iterdir()) == events


@pytest.mark.slow
def test_overwrite_with_auto_resumes_and_never_deletes(
    tiny_assets: Path, tmp_path: Path, caplog: Any
) -> None:
    """What `make demo` passes (overwrite) with what the Slurm launcher passes (auto): a requeued job
    resumes its checkpoints instead of wiping them."""
    out = tmp_path / "run"
    common = ["trainer.save_freq=1", "trainer.val_before_train=false", "trainer.overwrite=true"]
    train(tiny_assets, out, *common, steps=2)
    rows = train(tiny_assets, out, *common, "trainer.resume_mode=auto", steps=3)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert "trainer.overwrite=true is not applied" in caplog.text
    assert (out / "checkpoints" / "latest").read_text() == "step_00000003"


def test_tensorboard_hides_the_steps_a_resume_redoes() -> None:
    """A resumed run's events purge the steps after its checkpoint (logged before the stop)."""
    import tempfile

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with tempfile.TemporaryDirectory() as tmp:
        first = MetricsLogger(tmp, ["tensorboard"], is_main=True, total_steps=4)
        for step in (1, 2, 3):
            first.log(step, {"x": float(step)})
        first.close()
        second = MetricsLogger(tmp, ["tensorboard"], is_main=True, total_steps=4, resume_step=2)
        for step in (3, 4):
            second.log(step, {"x": 10.0 * step})
        second.close()
        acc = EventAccumulator(str(Path(tmp) / "tensorboard"))
        acc.Reload()
        assert [(e.step, e.value) for e in acc.Scalars("x")] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def test_eta_counts_the_steps_this_process_did() -> None:
    """Resumed at step 8 of 10, one step in 10 s: the last step takes about 10 s more (it said ~1 s:
    elapsed over every step done, resumed ones included)."""
    logger = MetricsLogger(".", [], is_main=True, total_steps=10, resume_step=8)
    logger.start = time.perf_counter() - 10.0
    assert logger._progress(9).endswith("eta 10s")


# ----------------------------------------------------------------------------------------------------
# Outputs never replace inputs or another run's model
# ----------------------------------------------------------------------------------------------------


def sft_args(assets: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--config", str(Path(__file__).resolve().parents[1] / "configs" / "sft_demo.yaml"),
        f"model.path={assets / 'base'}", f"data.train_files=[{assets / 'data' / 'sft_train.parquet'}]",
        f"data.val_files=[{assets / 'data' / 'sft_val.parquet'}]", "data.eval_prompt_files=[]",
        f"trainer.output_dir={out}", "trainer.total_training_steps=2", "trainer.logger=[console]", *extra,
    ]  # fmt: skip


def test_an_sft_smoke_run_cannot_replace_a_saved_model(
    tiny_assets: Path, tmp_path: Path, caplog: Any
) -> None:
    """An SFT run into a new folder whose trainer.save_path already holds a model (the model every
    preset starts from) stops before training; its own input model cannot be a save_path at all."""
    sft = load_script("train_sft")
    saved = tmp_path / "sft"
    shutil.copytree(tiny_assets / "base", saved)
    (tmp_path / "metrics.json").write_text('{"sft_val_accuracy": 0.65}')
    weights = (saved / "model.safetensors").read_bytes()
    assert sft.main(sft_args(tiny_assets, tmp_path / "new", f"trainer.save_path={saved}")) == 2
    assert f"trainer.save_path={saved} already holds a model and this run starts fresh" in caplog.text
    assert (saved / "model.safetensors").read_bytes() == weights
    assert json.loads((tmp_path / "metrics.json").read_text()) == {"sft_val_accuracy": 0.65}
    model_path = tiny_assets / "base"
    code = sft.main(
        sft_args(tiny_assets, tmp_path / "other", f"trainer.save_path={model_path}", "trainer.overwrite=true")
    )
    assert code == 2
    assert f"trainer.save_path={model_path} would write over model.path={model_path}" in caplog.text


def test_offline_data_never_replaces_its_input_or_another_output(
    tiny_assets: Path, tmp_path: Path, capfd: Any
) -> None:
    script = load_script("make_offline_data")
    prefs = tmp_path / "prefs.parquet"
    shutil.copy(tiny_assets / "data" / "pref_train.parquet", prefs)
    before = prefs.read_bytes()
    assert script.main(["--from-pairs", str(prefs), "--out", str(prefs)]) == 2
    assert f"--out {prefs} would write over --from-pairs {prefs}" in capfd.readouterr().err
    assert prefs.read_bytes() == before
    out = tmp_path / "groups.parquet"
    assert script.main(["--from-pairs", str(prefs), "--out", str(out)]) == 0
    assert script.main(["--from-pairs", str(prefs), "--out", str(out)]) == 2
    assert f"--out {out} already exists: choose another file, or pass --overwrite" in capfd.readouterr().err
    assert script.main(["--from-pairs", str(prefs), "--out", str(out), "--overwrite"]) == 0


# ----------------------------------------------------------------------------------------------------
# A resume compares the checkpoint with the run
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpointed(tiny_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One GAE step with a fixed KL coefficient in the reward, checkpointed: a run folder to resume."""
    out = tmp_path_factory.mktemp("checkpointed") / "run"
    train(tiny_assets, out, *RESUMABLE, steps=1)
    return out


RESUMABLE = [
    "trainer.save_freq=1",
    "trainer.val_before_train=false",
    "algorithm.use_kl_in_reward=true",
    "algorithm.kl_ctrl.type=fixed",
    "algorithm.kl_ctrl.kl_coef=0.05",
]


def resume_into(checkpointed: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(checkpointed, out)
    return out


def test_resume_refuses_another_model_or_estimator(
    tiny_assets: Path, checkpointed: Path, tmp_path: Path, caplog: Any
) -> None:
    out = resume_into(checkpointed, tmp_path)
    twin = tmp_path / "twin"  # the same shape (and here the same weights), another path
    shutil.copytree(tiny_assets / "base", twin)
    args = base_args(tiny_assets, out, steps=2) + RESUMABLE
    assert run(args + [f"model.path={twin}", "algorithm.adv_estimator=grpo"]) == 2
    message = caplog.text
    assert "the run differs from it in what must stay the same to continue it" in message
    assert f"model.path: '{tiny_assets / 'base'}' -> '{twin}'" in message
    assert "algorithm.adv_estimator: 'gae' -> 'grpo'" in message  # both listed at once
    assert [r["step"] for r in read_metrics(out)] == [1]  # nothing ran


@pytest.mark.slow
def test_resume_refuses_a_replaced_model_folder(tiny_assets: Path, tmp_path: Path, caplog: Any) -> None:
    """Same model.path, other weights (a base folder replaced under a LoRA run, say): refused."""
    base = tmp_path / "base"
    shutil.copytree(tiny_assets / "base", base)
    out = tmp_path / "run"
    args = base_args(tiny_assets, out, steps=1) + RESUMABLE + [f"model.path={base}"]
    assert run(args) == 0
    weights = load_file(base / "model.safetensors")
    save_file({k: v + 0.01 for k, v in weights.items()}, base / "model.safetensors")
    assert run(base_args(tiny_assets, out, steps=2) + RESUMABLE + [f"model.path={base}"]) == 2
    assert "model.path: its content changed since the checkpoint (fingerprint" in caplog.text


def test_resume_applies_a_new_learning_rate_and_kl_coefficient(
    tiny_assets: Path, checkpointed: Path, tmp_path: Path, caplog: Any
) -> None:
    """The rollback-exhausted message tells users to lower the learning rate and resume: the new rate
    (and a new in-reward KL coefficient) must be what step 2 uses, not the checkpoint's."""
    out = resume_into(checkpointed, tmp_path)
    args = base_args(tiny_assets, out, steps=2) + RESUMABLE
    changed = ["actor.optim.lr=2e-4", "critic.optim.lr=3e-4", "algorithm.kl_ctrl.kl_coef=0.2"]
    assert run([*args, *changed]) == 0
    step2 = read_metrics(out)[-1]
    assert step2["step"] == 2
    # Constant schedule, no warm-up: the logged rate is the configured one; the fixed controller's
    # coefficient is the configured one.
    assert step2["actor/lr"] == pytest.approx(2e-4) and step2["critic/lr"] == pytest.approx(3e-4)
    assert step2["actor/reward_kl_penalty_coeff"] == pytest.approx(0.2)
    assert "resuming with actor.optim.lr changed: 0.001 -> 0.0002 (the actor's learning rate" in caplog.text


# ----------------------------------------------------------------------------------------------------
# Stop signals
# ----------------------------------------------------------------------------------------------------


SLOW_STEP_2 = [
    "trainer.val_before_train=false",
    "algorithm.adv_estimator=grpo",
    "trainer.save_freq=1",
    f"reward.custom_function={REWARD_FNS}:slow_after",
]
"""Step 2's scoring waits (``slow_after``): a window to signal a running trainer in."""


def signalled_run(
    tiny_assets: Path, out: Path, slow_s: int, *signals: signal.Signals
) -> tuple[subprocess.Popen, str, float]:
    """Start a run whose step 2 scoring waits ``slow_s`` seconds, send ``signals`` (0.5 s apart) during
    that wait; the process, its stderr and the seconds from the last signal to its exit."""
    env = {"PPO_TEST_SLOW_S": str(slow_s), "PPO_TEST_FAST_CALLS": str(1 + 8)}
    proc = launch(base_args(tiny_assets, out, steps=4) + SLOW_STEP_2, env=env)
    wait_until(proc, has_metrics(out), timeout=400)
    time.sleep(1)
    for i, signum in enumerate(signals):
        if i:
            time.sleep(0.5)
        proc.send_signal(signum)
    sent = time.time()
    _, stderr = proc.communicate(timeout=300)
    return proc, stderr, time.time() - sent


@pytest.mark.slow
def test_sighup_is_a_stop_signal(tiny_assets: Path, tmp_path: Path) -> None:
    """A closed terminal (SIGHUP) stops the run at the next boundary with its last step saved; it
    used to kill it at once."""
    out = tmp_path / "run"
    proc, stderr, _ = signalled_run(tiny_assets, out, 6, signal.SIGHUP)
    assert proc.returncode == 0, stderr[-3000:]
    assert "SIGHUP received" in stderr and "stopping: saved step 1 (SIGHUP)" in stderr
    assert (out / "checkpoints" / "latest").read_text() == "step_00000001"


@pytest.mark.slow
def test_a_second_ctrl_c_exits_at_once_quietly(tiny_assets: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc, stderr, waited = signalled_run(tiny_assets, out, 30, signal.SIGINT, signal.SIGINT)
    assert waited < 15  # not the 30 s of the slow scoring
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr[-3000:]
    assert "interrupted; the last complete checkpoint is intact" in stderr
    assert (out / "checkpoints" / "latest").read_text() == "step_00000001"


@pytest.mark.slow
def test_validation_stops_between_chunks(tiny_assets: Path, tmp_path: Path, one_rank: Any) -> None:
    """A stop during a long validation ends it at the next chunk with no metrics (the step's update is
    kept and saved by step 6), instead of running on past the SIGTERM-to-SIGKILL grace period."""
    from ppo.build import build
    from ppo.config_loader import load_config
    from ppo.periodic_validation import validate

    cfg = load_config(None, base_args(tiny_assets, tmp_path, steps=1) + ["data.val_batch_size=2"])
    run_ = build(cfg, one_rank)

    class StopAfter:
        """A stop request that arrives after ``n`` boundaries."""

        def __init__(self, n: int) -> None:
            self.asked, self.n, self.name = 0, n, "SIGTERM"

        def requested(self) -> bool:
            self.asked += 1
            return self.asked > self.n

    full = validate(cfg, one_rank, run_)
    assert "val/score" in full
    stop = StopAfter(2)
    assert validate(cfg, one_rank, run_, stop) == {}
    assert stop.asked == 3  # 8 prompts in chunks of 2: stopped before the third of four


@pytest.mark.slow
def test_leftover_rank_variables_fail_fast(tiny_assets: Path, tmp_path: Path) -> None:
    """RANK and WORLD_SIZE left in the shell of a plain ``python`` run: one line within the rendezvous
    wait (here trainer.dist_timeout_s=5), instead of waiting silently for the 30-minute timeout."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29613"}
    env.pop("TORCHELASTIC_RUN_ID", None)
    args = base_args(tiny_assets, tmp_path / "run", steps=1) + ["trainer.dist_timeout_s=5"]
    start = time.time()
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve().parents[1] / "train_ppo.py"), *args],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and time.time() - start < 60
    assert "RANK=0 and WORLD_SIZE=2 are set in the environment (not by torchrun)" in proc.stderr
    assert "Traceback" not in proc.stderr
