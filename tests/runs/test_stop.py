"""Stops that lose nothing: SIGTERM, SIGHUP and a stop signal inside a long step checkpoint the current step;
a second Ctrl-C exits at once; validation stops between chunks; a hang names its phase and the ranks that
did not arrive; KL rollback and non-finite rewards that stop the run; one run per folder (a busy folder is
refused, a dead run's lock taken over); outputs that never replace an input or another run's model;
every path the run writes checked before training; leftover rank variables. Checkpoints and resume are in
test_resume.py."""

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
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from ppo import run_folder
from ppo.distributed import Watch
from tests.helpers import (
    REWARD_FNS,
    ROOT,
    base_args,
    excerpt,
    has_metrics,
    launch,
    load_script,
    read_metrics,
    run,
    saved_run,
    torchrun,
    train,
    wait_until,
)


def test_kl_rollback_then_stop(tiny_assets: Path, tmp_path: Path) -> None:
    """A KL limit the policy must cross after its first update: every later step rolls back to the
    step-0 checkpoint with a smaller learning rate, until max_rollbacks in a row stops the run."""
    out = tmp_path / "run"
    args = base_args(tiny_assets, out, steps=6) + [
        "algorithm.rollback_kl=1e-7",
        "algorithm.rollback_lr_factor=0.5",
        "algorithm.max_rollbacks=2",
        "trainer.val_before_train=false",
        "actor.optim.lr=1e-2",
    ]
    assert run(args) == 2  # TrainingError: stopped with a message
    rows = read_metrics(out)
    rollbacks = [r for r in rows if "trainer/lr_scale" in r]
    assert [r["trainer/rollbacks"] for r in rollbacks] == [1.0, 2.0]
    assert [r["trainer/lr_scale"] for r in rollbacks] == [0.5, 0.25]
    # Each rollback returns to step 0 and redoes step 1 with the learning rate scaled down.
    step1_lrs = [r["actor/lr"] for r in rows if r["step"] == 1 and "actor/lr" in r]
    assert step1_lrs == pytest.approx([1e-2, 5e-3, 2.5e-3])
    assert (out / "checkpoints" / "step_00000000").is_dir()  # the start, saved to roll back to


def test_unwritable_output_and_vanished_data(
    tiny_assets: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    assert run(base_args(tiny_assets, blocker / "run", steps=1)) == 2
    assert "is not writable" in caplog.text and not (blocker / "run").exists()

    # A data file that vanished between the first run and its resume: a clear error, nothing written.
    data = tmp_path / "train.parquet"
    data.write_bytes((tiny_assets / "data" / "train.parquet").read_bytes())
    out = tmp_path / "run"
    saved_run(tiny_assets, out, f"data.train_files={data}")
    data.unlink()
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    caplog.clear()
    common = [f"data.train_files={data}", "trainer.save_freq=1", "trainer.val_before_train=false"]
    assert run(base_args(tiny_assets, out, steps=2) + common) == 2
    assert f"{data}: no such data file" in caplog.text
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before
    assert read_metrics(out)[-1]["step"] == 1


@pytest.mark.slow
def test_sigterm_checkpoints_the_current_step_and_exits(tiny_assets: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = launch(
        base_args(tiny_assets, out, steps=50) + ["trainer.val_before_train=false"]
    )  # no periodic saves
    wait_until(proc, has_metrics(out))
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, excerpt(stderr)
    assert "stopping: saved step" in stderr
    step = read_metrics(out)[-1]["step"]
    assert 1 <= step < 50
    assert (out / "checkpoints" / "latest").read_text() == f"step_{step:08d}"


@pytest.mark.slow
def test_a_hang_names_its_phase_and_the_rank_that_did_not_arrive(tiny_assets: Path, tmp_path: Path) -> None:
    """Rank 1's reward function hangs in step 2 (60 s) with trainer.dist_timeout_s=10: rank 0's error
    says it waited in phase 'reward' of step 2 and that rank 1 did not arrive, in one line (it was a gloo
    traceback naming neither, after 75 s)."""
    args = base_args(tiny_assets, tmp_path / "run", steps=3) + [
        "trainer.val_before_train=false",
        "algorithm.adv_estimator=grpo",
        f"reward.custom_function={REWARD_FNS}:slow_after",
        "trainer.dist_timeout_s=10",
    ]
    env = {"PPO_TEST_SLOW_S": "60", "PPO_TEST_FAST_CALLS": str(1 + 4), "PPO_TEST_SLOW_RANK": "1"}
    proc = torchrun(ROOT / "train_ppo.py", *args, timeout=300, env=env)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "a collective timed out" in line]
    assert lines, excerpt(proc.stderr)
    assert "rank 0 waited in phase 'reward' of step 2" in lines[0]
    assert "did not arrive: rank 1 (in phase 'reward' of step 2" in lines[0]
    assert "Traceback" not in proc.stderr.split("a collective timed out")[0][-2000:]


@pytest.mark.slow
def test_watch_describes_ranks_behind_without_a_store() -> None:
    """Without a store (one rank) the description still names this rank's phase."""
    watch = Watch(rank=0, phase="update_actor", step=7, collectives=12)
    text = watch.describe_timeout(1, RuntimeError("Timed out waiting 10000ms for recv"))
    assert "rank 0 waited in phase 'update_actor' of step 7 (collective #12)" in text
    assert "no report from rank(s) [0]" in text


@pytest.mark.slow
def test_nan_reward_on_a_save_step_still_saves_and_too_many_stop_the_run(
    tiny_assets: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A scorer that always returns NaN: each step is skipped, the save of step 2 still happens, and
    ``trainer.max_skipped_steps`` in a row stop the run with exit code 2 and a message."""
    out = tmp_path / "run"
    args = base_args(tiny_assets, out, steps=5) + [
        f"reward.custom_function={REWARD_FNS}:nan_score",
        "trainer.val_before_train=false",
        "trainer.save_freq=2",
        "trainer.max_skipped_steps=3",
    ]
    assert run(args) == 2
    assert "3 steps in a row had a non-finite reward" in caplog.text
    assert (out / "checkpoints" / "latest").read_text() == "step_00000002"
    state = json.loads((out / "checkpoints" / "step_00000002" / "trainer.json").read_text())["trainer"]
    assert state["skipped_steps"] == 2 and state["step"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun_sigterm", "python_sigint"])
def test_stop_signal_inside_a_long_step_saves_the_last_step_at_once(
    tiny_assets: Path, tmp_path: Path, launcher: str
) -> None:
    """Step 2 is long (a call of its in-process reward function sleeps an hour, then 60 updates would
    follow): a stop signal abandons the call (``user_code.abandoned_on_stop``) and is honoured at the next
    phase boundary, before the updates. The last complete step (1) is checkpointed with step 1's 60
    optimizer steps only, and the run resumes. (Before, the stop waited for every call of the batch.)"""
    out, mark = tmp_path / "run", tmp_path / "slow"
    extra = [
        "trainer.val_before_train=false",
        "algorithm.adv_estimator=grpo",
        "actor.ppo_epochs=30",  # 60 updates a step: the part of step 2 a stop must not wait for
        f"reward.custom_function={REWARD_FNS}:slow_after",
    ]
    nproc = 2 if launcher == "torchrun_sigterm" else 1
    # Calls before the slow one, per rank: the start-up probe, then step 1's responses.
    fast_calls = 1 + 8 // nproc
    env = {"PPO_TEST_SLOW_S": "3600", "PPO_TEST_FAST_CALLS": str(fast_calls), "PPO_TEST_SLOW_MARK": str(mark)}
    proc = launch(base_args(tiny_assets, out, steps=4) + extra, nproc=nproc, env=env)
    # Every rank inside step 2's slow scoring.
    wait_until(proc, lambda: all(Path(f"{mark}.{r}").exists() for r in range(nproc)), timeout=400)
    proc.send_signal(signal.SIGTERM if nproc == 2 else signal.SIGINT)
    _, stderr = proc.communicate(timeout=300)
    assert "stopping: saved step 1" in stderr, excerpt(stderr)
    assert (out / "checkpoints" / "latest").read_text() == "step_00000001"
    assert [r["step"] for r in read_metrics(out)] == [1]
    # Saved at the stop, after step 2's scoring: the actor's optimizer took step 1's 60 steps, none of
    # step 2's (30 epochs x 2 mini-batches a step).
    dcp_to_torch_save(out / "checkpoints" / "step_00000001" / "dcp", tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=False)
    assert {float(p["step"]) for p in state["actor.optim"]["state"].values()} == {60.0}
    # The stopped run resumes where it stopped.
    assert [r["step"] for r in train(tiny_assets, out, *extra, steps=2)] == [1, 2]


@pytest.mark.parametrize("before_training", [False, True])
def test_a_stop_abandons_a_reward_function_in_validation(
    tiny_assets: Path, tmp_path: Path, before_training: bool
) -> None:
    """A validation call of the in-process reward function sleeps an hour: SIGTERM abandons it. After
    step 1 the validation ends with no metrics and step 1 (its update kept) is saved; before training
    nothing was taken and nothing is saved. (Before, the stop waited for every call of the validation,
    past the 30 s Slurm and torchrun grant, and the finished step was lost.)"""
    out, mark = tmp_path / "run", tmp_path / "slow"
    extra = [
        f"trainer.val_before_train={str(before_training).lower()}",
        "trainer.test_freq=1",
        "algorithm.adv_estimator=grpo",
        f"reward.custom_function={REWARD_FNS}:slow_after",
    ]
    # Calls before the slow one: the start-up probe, then (after step 1) its 8 responses.
    fast_calls = 1 if before_training else 1 + 8
    env = {"PPO_TEST_SLOW_S": "3600", "PPO_TEST_FAST_CALLS": str(fast_calls), "PPO_TEST_SLOW_MARK": str(mark)}
    proc = launch(base_args(tiny_assets, out, steps=3) + extra, env=env)
    wait_until(proc, lambda: Path(f"{mark}.0").exists(), timeout=400)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, excerpt(stderr)
    if before_training:
        assert "stopping before step 1 (SIGTERM): no step was taken, nothing to save" in stderr, excerpt(
            stderr
        )
        assert not (out / "checkpoints" / "latest").exists()
        assert not (out / "metrics.jsonl").exists() or read_metrics(out) == []
        return
    assert "stopping: saved step 1" in stderr, excerpt(stderr)
    assert (out / "checkpoints" / "latest").read_text() == "step_00000001"
    [row] = read_metrics(out)
    assert row["step"] == 1 and not any(k.startswith("val") for k in row)


@pytest.mark.parametrize(
    ("blocker", "message"),
    [
        ("checkpoints", "checkpoints is a file"),
        ("metrics.jsonl", "metrics.jsonl is a folder"),
        ("tensorboard", "tensorboard is a file"),
        ("hf", "hf is a file"),
    ],
)
def test_every_path_the_run_writes_is_checked_before_training(
    tiny_assets: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, blocker: str, message: str
) -> None:
    out = tmp_path / "run"
    out.mkdir()
    target = out / blocker
    if blocker == "metrics.jsonl":
        target.mkdir()
    else:
        target.write_text("in the way")
    args = base_args(tiny_assets, out, steps=1) + [
        "trainer.logger=[console,jsonl,tensorboard]",
        "trainer.save_hf_on_end=true",
        "trainer.save_freq=1",
    ]
    assert run(args) == 2
    assert message in caplog.text and "world size" not in caplog.text  # before any model loaded


def write_lock(out: Path, **holder: Any) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / run_folder.LOCK_FILE
    path.write_text(json.dumps({"started": time.time(), "command": "train_ppo.py ...", **holder}))
    return path


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


def sft_args(assets: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--config", str(ROOT / "configs" / "sft_demo.yaml"),
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


SLOW_SCORING = """
import time


def slow_ninth(data_source, solution_str, ground_truth, extra_info=None, *, log, slow_s, stubborn=False, at=8):
    if not solution_str:  # the start-up check's empty response
        return 0.0
    with open(log, "a+") as f:
        f.seek(0)
        calls = len(f.read().splitlines())
        f.write("call\\n")
    if calls == at:
        try:
            time.sleep(slow_s)
        except KeyboardInterrupt:
            raise
        except BaseException:  # the trainer abandoned the call: a stop signal
            with open(log, "a") as f:
                f.write("slow call interrupted\\n")
            if not stubborn:
                raise
            time.sleep(slow_s)  # code that goes on regardless (as code blocked in C would)
        with open(log, "a") as f:
            f.write("slow call returned\\n")
    return float("7" in solution_str)
"""
"""A reward function whose 9th call (step 2's first: a step has 8 responses) sleeps ``slow_s`` seconds;
``log`` gets a line when a call starts, one when the slow call is interrupted and one when it returns;
``stubborn``: it sleeps on when interrupted; ``at``: the calls before the slow one (8: step 1's)."""


def signalled_run(
    tiny_assets: Path, out: Path, slow_s: int, *signals: signal.Signals, stubborn: bool = False, at: int = 8
) -> tuple[subprocess.Popen, str, list[str]]:
    """Start a run whose step 2 scoring waits ``slow_s`` seconds (``stubborn``: even when interrupted),
    send ``signals`` (0.5 s apart) once the wait has begun; the process, its stderr and the reward
    function's log."""
    fn, log = out.parent / "slow_scoring.py", out.parent / "calls.txt"
    fn.write_text(SLOW_SCORING)
    args = [
        "trainer.val_before_train=false",
        "algorithm.adv_estimator=grpo",
        "trainer.save_freq=1",
        f"reward.custom_function={fn}:slow_ninth",
        f"reward.reward_kwargs={{log: {log}, slow_s: {slow_s}, stubborn: {str(stubborn).lower()}, at: {at}}}",
    ]
    proc = launch(base_args(tiny_assets, out, steps=4) + args)
    wait_until(proc, lambda: log.is_file() and len(log.read_text().splitlines()) > at, timeout=400)
    for i, signum in enumerate(signals):
        if i:
            time.sleep(0.5)
        proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=300)
    return proc, stderr, log.read_text().splitlines()


@pytest.mark.slow
def test_sighup_is_a_stop_signal(tiny_assets: Path, tmp_path: Path) -> None:
    """A closed terminal (SIGHUP) stops the run at the next boundary, with its last step saved (it used to
    kill it at once); the slow scoring call is interrupted, and no later call is made."""
    out = tmp_path / "run"
    proc, stderr, calls = signalled_run(tiny_assets, out, 600, signal.SIGHUP)
    assert proc.returncode == 0, excerpt(stderr)
    assert "SIGHUP received" in stderr and "stopping: saved step 1 (SIGHUP)" in stderr
    assert calls == ["call"] * 9 + ["slow call interrupted"]
    assert (out / "checkpoints" / "latest").read_text() == "step_00000001"


@pytest.mark.slow
def test_one_ctrl_c_under_torchrun_saves_and_stops(tiny_assets: Path, tmp_path: Path) -> None:
    """Under torchrun one Ctrl-C reaches the rank twice: from the terminal, then forwarded by torchrun.
    The copy is not a second Ctrl-C: the rank still saves step 1 at the next boundary (it used to exit
    at once with 130, "interrupted")."""
    out = tmp_path / "run"
    fn, log = tmp_path / "slow_scoring.py", tmp_path / "calls.txt"
    fn.write_text(SLOW_SCORING)
    args = base_args(tiny_assets, out, steps=4) + [
        "trainer.val_before_train=false",
        "algorithm.adv_estimator=grpo",
        "trainer.save_freq=1",
        f"reward.custom_function={fn}:slow_ninth",
        f"reward.reward_kwargs={{log: {log}, slow_s: 6}}",
    ]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [*cmd, str(ROOT / "train_ppo.py"), *args], stderr=subprocess.PIPE, text=True, env=env
    )
    wait_until(proc, lambda: log.is_file() and len(log.read_text().splitlines()) >= 9, timeout=400)
    (worker,) = map(int, Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split())
    os.kill(worker, signal.SIGINT)  # the terminal's copy (it signals the whole process group)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)  # torchrun's: it forwards the SIGINT to its worker
    _, stderr = proc.communicate(timeout=300)
    assert "stopping: saved step 1 (SIGINT)" in stderr, excerpt(stderr)
    assert "interrupted" not in stderr
    assert (out / "checkpoints" / "latest").read_text() == "step_00000001"


@pytest.mark.slow
def test_a_second_ctrl_c_exits_at_once_quietly(tiny_assets: Path, tmp_path: Path) -> None:
    """The second Ctrl-C ends the run inside a slow scoring call (30 s) that goes on when the first
    interrupts it; it never returns."""
    out = tmp_path / "run"
    proc, stderr, calls = signalled_run(tiny_assets, out, 30, signal.SIGINT, signal.SIGINT, stubborn=True)
    assert calls == ["call"] * 9 + ["slow call interrupted"]  # not "slow call returned", nor a later call
    assert proc.returncode == 130 and "Traceback" not in stderr, excerpt(stderr)
    assert (
        "interrupted: the last complete checkpoint, step 1, is intact (trainer.resume_mode=auto resumes it)"
        in stderr
    )
    assert (out / "checkpoints" / "latest").read_text() == "step_00000001"


def test_a_second_ctrl_c_before_the_first_checkpoint_says_there_is_none(
    tiny_assets: Path, tmp_path: Path
) -> None:
    """In step 1 there is no checkpoint yet: the line says so (it used to call "the last complete
    checkpoint" intact and advise resume_mode=auto)."""
    out = tmp_path / "run"
    proc, stderr, calls = signalled_run(
        tiny_assets, out, 30, signal.SIGINT, signal.SIGINT, stubborn=True, at=0
    )
    assert calls == ["call", "slow call interrupted"]
    assert proc.returncode == 130 and "Traceback" not in stderr, excerpt(stderr)
    assert f"interrupted before the first checkpoint was saved: {out} holds nothing to resume" in stderr
    assert "intact" not in stderr and not (out / "checkpoints" / "latest").exists()


def test_ctrl_c_while_torch_imports_is_one_line(tiny_assets: Path, tmp_path: Path) -> None:
    """Ctrl-C during the start-up imports (after the early answer, while torch loads): one line and exit
    code 130, not the traceback of the import it interrupted."""
    proc = launch(base_args(tiny_assets, tmp_path / "run", steps=1))
    maps = Path(f"/proc/{proc.pid}/maps")
    wait_until(proc, lambda: "libtorch" in maps.read_text(), timeout=120)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, excerpt(stderr)
    assert stderr.strip() == "interrupted during start-up: nothing was started or saved"


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
    """RANK and WORLD_SIZE left in the shell of a plain ``python`` run: one line after the rendezvous
    wait, which is trainer.dist_timeout_s=5 here (not RENDEZVOUS_TIMEOUT_S, 120 s), instead of waiting
    silently for the 30-minute timeout. The subprocess's 120 s only keeps a run that waits from hanging
    the test."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29613"}
    env.pop("TORCHELASTIC_RUN_ID", None)
    args = base_args(tiny_assets, tmp_path / "run", steps=1) + ["trainer.dist_timeout_s=5"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train_ppo.py"), *args],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, excerpt(proc.stderr)
    assert "RANK=0 and WORLD_SIZE=2 are set in the environment (not by torchrun)" in proc.stderr
    assert "other ranks did not join at 127.0.0.1:29613 within 5 s" in proc.stderr
    assert "Traceback" not in proc.stderr
