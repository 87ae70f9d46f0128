"""Checkpoints and resume: exact resume after SIGKILL; atomic saves, in the foreground and in the background
(``trainer.async_save``: the folder is renamed into place and ``latest`` moves only once every rank's shards
are on disk, so a kill during the write leaves the previous checkpoint as ``latest``); pruning; HF export;
checkpoints that are damaged, hostile, incompatible or from another world size (an elastic restart on
fewer or more ranks continues the data order); auto-resume that falls back past a damaged checkpoint;
reruns, requeues and fresh starts that resume or refuse instead of replacing; resumes that compare the
checkpoint with the run. Stop signals, hangs and runs that stop or refuse to start are in test_stop.py."""

from __future__ import annotations

import io
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from ppo import checkpoint_files, distributed
from ppo.metrics import MetricsLogger
from tests.helpers import (
    ROOT,
    base_args,
    deterministic,
    excerpt,
    launch,
    read_metrics,
    run,
    saved_run,
    torchrun,
    train,
    wait_until,
)


def resume_args(assets: Path, out: Path) -> list[str]:
    """Four steps, a checkpoint every two, validation and an adaptive KL coefficient (state to resume)."""
    return base_args(assets, out, steps=4) + [
        "trainer.save_freq=2",
        "trainer.test_freq=2",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.horizon=100",
        "algorithm.kl_ctrl.target_kl=0.001",
    ]


@pytest.mark.slow
def test_sigkill_mid_step_then_resume_gives_identical_metrics(tiny_assets: Path, tmp_path: Path) -> None:
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    done = launch(resume_args(tiny_assets, straight))
    _, stderr = done.communicate(timeout=600)
    assert done.returncode == 0, excerpt(stderr)

    # Start the same run and SIGKILL it as soon as the step-2 checkpoint is complete: it is then inside
    # step 3, which has to be redone after the restart.
    proc = launch(resume_args(tiny_assets, killed))
    latest = killed / "checkpoints" / "latest"
    wait_until(proc, lambda: latest.exists() and latest.read_text() == "step_00000002", timeout=600)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert read_metrics(killed)[-1]["step"] <= 3  # it died before finishing the run
    resumed = launch(resume_args(tiny_assets, killed))
    _, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, excerpt(stderr)
    assert "resumed from" in stderr and "step_00000002" in stderr

    a, b = deterministic(read_metrics(straight)), deterministic(read_metrics(killed))
    assert [r["step"] for r in a] == [0, 1, 2, 3, 4]
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x == y, f"step {x['step']} differs after resume"


@pytest.mark.slow
def test_crash_while_saving_keeps_previous_checkpoint(tiny_assets: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    saved_run(tiny_assets, out, steps=2)
    root = out / "checkpoints"
    assert (root / "latest").read_text() == "step_00000002"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000001", "step_00000002"]
    # A crash during the next save leaves a .tmp folder (and maybe a half-written step folder): the
    # latest complete checkpoint is still the one found.
    (root / "step_00000003.tmp" / "dcp").mkdir(parents=True)
    (root / "step_00000004").mkdir()
    (root / "latest").write_text("step_00000004")  # even a marker pointing at a broken one
    assert checkpoint_files.find_resume_dir(out, "auto") == root / "step_00000002"
    with pytest.raises(checkpoint_files.CheckpointError, match="incomplete or corrupted"):
        checkpoint_files.find_resume_dir(out, str(root / "step_00000004"))
    assert checkpoint_files.find_resume_dir(out, "disable") is None


@pytest.mark.slow
def test_max_ckpt_to_keep_prunes(tiny_assets: Path, tmp_path: Path) -> None:
    saved_run(tiny_assets, tmp_path, "trainer.max_ckpt_to_keep=1", steps=3)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000003"]


@pytest.mark.slow
def test_export_hf_matches_trained_model(tiny_assets: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    saved_run(tiny_assets, out, "trainer.save_hf_on_end=true")
    export = tmp_path / "export"
    script = ROOT / "scripts" / "export_hf.py"
    proc = subprocess.run(
        [sys.executable, str(script), str(out), str(export), "--critic"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, excerpt(proc.stderr)
    trained = AutoModelForCausalLM.from_pretrained(out / "hf")
    exported = AutoModelForCausalLM.from_pretrained(export)
    base = AutoModelForCausalLM.from_pretrained(tiny_assets / "base")
    ids = torch.tensor([[1, 5, 20, 21, 22, 6]])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, trained(ids).logits, atol=1e-6, rtol=0)
        assert not torch.allclose(exported(ids).logits, base(ids).logits)  # it is the trained model
    assert (export / "critic" / "config.json").is_file() and (export / "tokenizer_config.json").is_file()


@pytest.mark.slow
def test_incompatible_checkpoint_fails_clearly(
    tiny_assets: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "run"
    saved_run(tiny_assets, out)
    # A model of another shape, resumed from the same run folder.
    other = tmp_path / "wide"
    cfg = LlamaConfig.from_pretrained(tiny_assets / "base")
    cfg.intermediate_size = 256
    LlamaForCausalLM(cfg).save_pretrained(other)
    AutoTokenizer.from_pretrained(tiny_assets / "base").save_pretrained(other)
    assert run(base_args(tiny_assets, out, steps=2) + [f"model.path={other}"]) == 2
    # Found before anything of the checkpoint is loaded: the run names another model than the checkpoint.
    assert f"model.path: '{tiny_assets / 'base'}' -> '{other}'" in caplog.text
    assert "what must stay the same to continue it" in caplog.text


KILLED_DURING_SAVE = textwrap.dedent(
    """
    import os, sys, torch
    from pathlib import Path
    from ppo.checkpointer import Checkpointer, TrainerState
    from ppo.distributed import init_distributed, DistInfo
    import torch.distributed as dist

    out = Path(sys.argv[1])
    info = init_distributed("cpu")
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])  # 34 MB with Adam
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    state = TrainerState()
    ckpt = Checkpointer(
        out_dir=out, info=info, config_yaml="{}", keep=0, seed=0, models={"m": model},
        optimizers={"m": opt}, schedulers={}, stateful={"trainer": state},
        async_group=dist.new_group(backend="gloo"),
    )
    state.step = 1
    ckpt.save(1)
    ckpt.wait()
    state.step = 2
    ckpt.save(2)  # the shards of step 2 are being written in the background ...
    os._exit(9)   # ... when the process dies
    """
)


@pytest.mark.slow
def test_a_kill_during_a_background_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_DURING_SAVE, str(out)], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 9, excerpt(proc.stderr)
    root = checkpoint_files.checkpoints_dir(out)
    assert (root / "latest").read_text() == "step_00000001"
    assert (root / "step_00000002.tmp").is_dir() and not (root / "step_00000002").exists()
    assert checkpoint_files.resume_candidates(out, "auto") == [root / "step_00000001"]


@pytest.mark.slow
def test_background_saves_train_and_resume_as_blocking_ones(tiny_assets: Path, tmp_path: Path) -> None:
    common = ["trainer.save_freq=1", "trainer.val_before_train=false"]
    blocking = train(tiny_assets, tmp_path / "blocking", *common, steps=3)
    background = train(tiny_assets, tmp_path / "background", *common, "trainer.async_save=true", steps=3)
    assert deterministic(background) == deterministic(blocking)
    root = checkpoint_files.checkpoints_dir(tmp_path / "background")
    assert (root / "latest").read_text() == "step_00000003"  # the last one completed before the run ended
    assert not list(root.glob("*.tmp"))
    # Resumed from the background save, the run continues as the blocking run does.
    resumed = train(tiny_assets, tmp_path / "background", *common, "trainer.async_save=true", steps=4)
    straight = train(tiny_assets, tmp_path / "blocking", *common, steps=4)
    assert deterministic(resumed)[-1] == deterministic(straight)[-1]
    assert [r["step"] for r in read_metrics(tmp_path / "background")] == [1, 2, 3, 4]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 4])
def test_a_two_rank_checkpoint_continues_on_another_world_size(
    tiny_assets: Path, tmp_path: Path, nproc: int
) -> None:
    """Two steps on 2 ranks, then (as an elastic restart would) steps 3 and 4 on 1 or on 4 ranks from the
    same checkpoint: the run continues, in the same data order."""
    common = ["trainer.save_freq=1", "trainer.val_before_train=false", "trainer.dist_timeout_s=120"]
    first = tmp_path / "first"
    proc = torchrun(ROOT / "train_ppo.py", *base_args(tiny_assets, first, steps=2), *common)
    assert proc.returncode == 0, excerpt(proc.stderr)
    out = tmp_path / f"on_{nproc}"
    shutil.copytree(first, out)
    args = base_args(tiny_assets, out, steps=4) + common
    if nproc == 1:
        assert run(args) == 0
    else:
        proc = torchrun(ROOT / "train_ppo.py", *args, nproc=nproc, timeout=600)
        assert proc.returncode == 0, excerpt(proc.stderr)
        assert f"resumed a checkpoint of 2 ranks on {nproc} ranks" in proc.stderr
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[:2] == read_metrics(first)  # the first two steps' rows kept as they were


class Payload:
    """Unpickling this runs ``touch <marker>``: what a hostile checkpoint would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def saved(tiny_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder with checkpoints of steps 1 and 2 (copied by each test before it damages one)."""
    out = tmp_path_factory.mktemp("saved")
    saved_run(tiny_assets, out, steps=2)
    return out


def copy_run(saved: Path, tmp_path: Path) -> Path:
    """A copy of the ``saved`` run folder, to damage."""
    out = tmp_path / "run"
    shutil.copytree(saved, out)
    return out


def resume_errors(tiny_assets: Path, out: Path, ckpt: Path, caplog: pytest.LogCaptureFixture) -> list[str]:
    """Resume the run in ``out`` from ``ckpt``, which must fail (exit code 2); the errors it logged."""
    args = base_args(tiny_assets, out, steps=3) + [
        f"trainer.resume_mode={ckpt}",
        "trainer.val_before_train=false",
    ]
    assert run(args) == 2
    return [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]


@pytest.mark.slow
@pytest.mark.parametrize("target", ["rank_file", "metadata"])
def test_pickled_payload_in_a_checkpoint_never_runs(
    tiny_assets: Path, saved: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, target: str
) -> None:
    out = copy_run(saved, tmp_path)
    ckpt = out / "checkpoints" / "step_00000002"
    marker = tmp_path / "pwned"
    path = ckpt / "rank_00000.pt" if target == "rank_file" else ckpt / "dcp" / ".metadata"
    with open(path, "wb") as f:
        pickle.dump({"rng": Payload(marker)}, f)
    errors = resume_errors(tiny_assets, out, ckpt, caplog)
    assert not marker.exists()
    assert len(errors) == 1 and "was refused" in errors[0] and str(path) in errors[0]


def test_pickled_payload_in_a_checkpoint_entry_never_runs(tmp_path: Path) -> None:
    """A non-tensor DCP entry (where optimizer hyper-parameters live) holding a payload."""
    marker = tmp_path / "pwned"
    dcp.save({"entry": Payload(marker), "w": torch.ones(2)}, checkpoint_id=str(tmp_path / "ckpt" / "dcp"))
    with pytest.raises(checkpoint_files.CheckpointError, match="entry entry was refused"):
        checkpoint_files._dcp_load({"entry": 0, "w": torch.zeros(2)}, tmp_path / "ckpt")
    assert not marker.exists()


def test_checkpoint_metadata_with_paths_of_any_python_loads() -> None:
    """DCP's ``.metadata`` holds paths; Python 3.13 pickles them as ``pathlib._local.PosixPath`` (it was
    refused as "not checkpoint metadata", so no checkpoint written on 3.13 resumed), older ones as
    ``pathlib.PosixPath``: both load, on any Python."""
    for module in ("pathlib", "pathlib._local"):
        data = f"c{module}\nPosixPath\n(V/ckpt/dcp\ntR.".encode()  # pickle protocol 0: PosixPath('/ckpt/dcp')
        assert checkpoint_files._MetadataUnpickler(io.BytesIO(data)).load() == Path("/ckpt/dcp")
    with pytest.raises(pickle.UnpicklingError, match="refusing pathlib._local.Path"):
        checkpoint_files._MetadataUnpickler(io.BytesIO(b"cpathlib._local\nPath\n(V/x\ntR.")).load()


@pytest.mark.slow
@pytest.mark.parametrize(
    "damage", ["truncated_shard", "missing_shard", "trainer_json", "rank_file", "config_yaml"]
)
def test_damaged_checkpoint_names_the_file(
    tiny_assets: Path, saved: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    out = copy_run(saved, tmp_path)
    ckpt = out / "checkpoints" / "step_00000002"
    shard = next((ckpt / "dcp").glob("*.distcp"))
    if damage == "truncated_shard":
        shard.write_bytes(shard.read_bytes()[:100])
        expected = f"checkpoint shard {shard} is truncated"
    elif damage == "missing_shard":
        shard.unlink()
        expected = f"checkpoint shard {shard} is missing"
    elif damage == "trainer_json":
        (ckpt / "trainer.json").write_text('{"trainer": ')
        expected = f"{ckpt / 'trainer.json'} is missing or unreadable"
    elif damage == "rank_file":
        (ckpt / "rank_00000.pt").write_bytes(b"PK\x03\x04 not really a zip")
        expected = f"{ckpt / 'rank_00000.pt'} is unreadable"
    else:  # it was "No such file or directory", after the models had loaded
        (ckpt / "config.yaml").unlink()
        expected = f"{ckpt / 'config.yaml'} is missing: the checkpoint is damaged"
    errors = resume_errors(tiny_assets, out, ckpt, caplog)
    assert len(errors) == 1 and expected in errors[0], errors


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated_shard", "config_yaml"])
def test_auto_resume_falls_back_past_a_damaged_newest_checkpoint(
    tiny_assets: Path, saved: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    out = copy_run(saved, tmp_path)
    newest = out / "checkpoints" / "step_00000002"
    if damage == "truncated_shard":
        shard = next((newest / "dcp").glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:100])
    else:  # it stopped the run with "No such file or directory"
        (newest / "config.yaml").unlink()
    saved_run(tiny_assets, out, steps=3)
    assert "cannot resume from" in caplog.text and "step_00000002" in caplog.text
    if damage == "config_yaml":
        why = f"{newest / 'config.yaml'} is missing: the checkpoint is damaged"
        assert f"cannot resume from {newest} ({why}); trying the next older checkpoint" in caplog.messages
    assert "resumed from" in caplog.text and "step_00000001 at step 1" in caplog.text
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]  # step 2 redone, then 3


@pytest.mark.slow
def test_resume_on_another_world_size_continues_the_data_order(tiny_assets: Path, tmp_path: Path) -> None:
    """Two steps on one rank, then two more on two ranks from its checkpoint: the same steps 3 and 4
    as a run that never stopped (greedy rollouts, so the new sampling streams do not matter)."""
    common = [
        "rollout.do_sample=false",
        "actor.ppo_mini_batch_size=4",
        "trainer.val_before_train=false",
        "data.max_prompt_length=16",
        "actor.optim.eps=1e-3",
        "critic.optim.eps=1e-3",
        "trainer.save_freq=2",
    ]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run(base_args(tiny_assets, straight, steps=4) + common) == 0
    assert run(base_args(tiny_assets, resumed, steps=2) + common) == 0
    proc = torchrun(ROOT / "train_ppo.py", *base_args(tiny_assets, resumed, steps=4), *common)
    assert proc.returncode == 0, excerpt(proc.stderr)
    assert "resumed a checkpoint of 1 ranks on 2 ranks" in proc.stderr
    a, b = read_metrics(straight), read_metrics(resumed)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for x, y in zip(a[2:], b[2:], strict=True):
        for key in ("critic/score/mean", "response_length/mean", "actor/pg_loss", "critic/vf_loss"):
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-5), (x["step"], key)


def test_rng_state_round_trips_as_plain_values(tmp_path: Path) -> None:
    distributed.seed_everything(7)
    state = checkpoint_files.rng_state()
    torch.save(state, tmp_path / "rng.pt")
    expected = (torch.rand(3), __import__("random").random(), __import__("numpy").random.rand())
    checkpoint_files.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    again = (torch.rand(3), __import__("random").random(), __import__("numpy").random.rand())
    assert torch.equal(expected[0], again[0]) and expected[1:] == again[1:]


@pytest.mark.slow
def test_fresh_run_refuses_an_existing_run_folder(
    tiny_assets: Path, saved: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = copy_run(saved, tmp_path)
    before = (out / "metrics.jsonl").read_text()
    args = base_args(tiny_assets, out, steps=1) + [
        "trainer.resume_mode=disable",
        "trainer.val_before_train=false",
    ]
    assert run(args) == 2
    assert f"trainer.output_dir={out} already holds a run" in caplog.text
    assert "trainer.overwrite=true" in caplog.text
    assert (out / "metrics.jsonl").read_text() == before
    assert (out / "checkpoints" / "latest").read_text() == "step_00000002"
    # With overwrite the folder starts afresh: one step, its own checkpoint only.
    assert run(args + ["trainer.overwrite=true", "trainer.save_freq=1"]) == 0
    assert [r["step"] for r in read_metrics(out)] == [1]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_00000001"]


def test_critic_from_a_reward_model_keeps_its_trained_head(
    tiny_assets: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The reward model's score head has a weight and no bias; the critic (token classification) wants
    both: the weight is kept, only the bias starts at zero, and the log says exactly that."""
    from safetensors.torch import load_file

    from ppo import model_loading

    caplog.set_level(logging.INFO, logger="ppo")
    trained = load_file(tiny_assets / "base_rm" / "model.safetensors")["score.weight"]
    assert trained.abs().sum() > 0
    critic = model_loading.load_critic(str(tiny_assets / "base_rm"))
    torch.testing.assert_close(critic.score.weight.detach(), trained)
    assert float(critic.score.bias.abs().sum()) == 0.0
    assert (
        "initialized score.bias to zero (not in the checkpoint); kept the trained score.weight" in caplog.text
    )


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


def test_resume_refuses_a_changed_override_config(
    tiny_assets: Path, checkpointed: Path, tmp_path: Path, caplog: Any
) -> None:
    """The Hugging Face config fields the models were built with must stay as they were, field by field
    (one added to a checkpoint that had none, here), as a model path must."""
    out = resume_into(checkpointed, tmp_path)
    args = base_args(tiny_assets, out, steps=2) + RESUMABLE
    changed = [
        "model.override_config.max_position_embeddings=512",
        "critic.override_config.attention_dropout=0.1",
    ]
    assert run(args + changed) == 2
    assert (
        "the run differs from it in what must stay the same to continue it: "
        "critic.override_config.attention_dropout: (unset) -> 0.1; "
        "model.override_config.max_position_embeddings: (unset) -> 512. Restore those settings"
    ) in caplog.text
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


def test_resume_takes_the_same_files_spelled_relative(
    tiny_assets: Path, checkpointed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """The checkpoint names the model and data absolute; the resume names them relative to the working
    folder: the same files, so it resumes (it was refused as another model.path and data.train_files)."""
    out = resume_into(checkpointed, tmp_path)
    monkeypatch.chdir(tiny_assets)
    args = base_args(tiny_assets, out, steps=2) + RESUMABLE
    args += ["model.path=base", "data.train_files=[data/train.parquet]"]
    assert run(args) == 0
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    assert "model.path changed" not in caplog.text and "data.train_files changed" not in caplog.text


def test_output_dir_in_a_checkpoint_never_starts(
    tiny_assets: Path, checkpointed: Path, tmp_path: Path, caplog: Any
) -> None:
    """A run started with trainer.output_dir=<run>/checkpoints/step_1 rewrote that checkpoint's config.yaml
    (and left its metrics there): the run could no longer resume. It stops before anything is written."""
    out = resume_into(checkpointed, tmp_path)
    ckpt = out / "checkpoints" / "step_00000001"
    before = {p.name: p.read_bytes() for p in ckpt.iterdir() if p.is_file()}
    assert run(base_args(tiny_assets, ckpt, steps=1) + RESUMABLE) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1
    assert errors[0].startswith(f"trainer.output_dir={ckpt} is the checkpoint {ckpt} of the run in {out}: ")
    assert {p.name: p.read_bytes() for p in ckpt.iterdir() if p.is_file()} == before


@pytest.mark.slow
def test_a_run_resumes_by_its_saved_config(tiny_assets: Path, tmp_path: Path, caplog: Any) -> None:
    """``--config <run>/config.yaml`` and nothing else resumes the run (the run writes the same file);
    with an override that changes it, the run stops and the file stays as it was."""
    out = tmp_path / "run"
    saved_run(tiny_assets, out, steps=2)
    root = out / "checkpoints"
    shutil.rmtree(root / "step_00000002")  # killed after step 1's checkpoint
    (root / "latest").write_text("step_00000001")
    saved = (out / "config.yaml").read_text()
    assert run(["--config", str(out / "config.yaml")]) == 0
    assert "step_00000001 at step 1" in caplog.text
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    assert (out / "config.yaml").read_text() == saved
    caplog.clear()
    assert run(["--config", str(out / "config.yaml"), "trainer.total_training_steps=3"]) == 2
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
        f"--config {out / 'config.yaml'} is the config the run in trainer.output_dir={out} saved, and this "
        "command changes it (an override, or a key this version added): the run would replace it; copy it "
        "out of that folder and pass the copy as --config"
    ]
    assert (out / "config.yaml").read_text() == saved


SPPO_OFFLINE = [
    "actor.policy_loss.loss_mode=sppo",
    "rollout.source=dataset",
    "reward.style=ranking",
    "rollout.n=4",
    "model.path=m",
    "data.train_files=[groups.parquet]",
]


@pytest.mark.parametrize(("before", "after"), [(1, 4), (2, 1)])
def test_a_changed_sppo_refresh_is_named_not_blamed_on_shapes(
    tmp_path: Path, before: int, after: int
) -> None:
    """SPPO's old-policy snapshot is checkpointed only with actor.sppo_refresh_steps > 1: resuming across
    that line failed as "does not fit this run's models (different model shapes or config?)". The resume
    check names the key instead, before anything loads."""
    from ppo.checkpointer import ResumeMismatch, compare_runs
    from ppo.config_loader import load_config, to_yaml

    ckpt = tmp_path / "step_00000001"
    ckpt.mkdir()
    saved = load_config(None, [*SPPO_OFFLINE, f"actor.sppo_refresh_steps={before}"])
    (ckpt / "config.yaml").write_text(to_yaml(saved))
    (ckpt / "trainer.json").write_text('{"identity": {}}')
    has = "holds no SPPO old-policy snapshot" if before == 1 else "holds SPPO's old-policy snapshot"
    with pytest.raises(ResumeMismatch) as e:
        compare_runs(ckpt, load_config(None, [*SPPO_OFFLINE, f"actor.sppo_refresh_steps={after}"]), {})
    assert str(e.value) == (
        f"cannot resume {ckpt}: the run differs from it in what must stay the same to continue it: "
        f"actor.sppo_refresh_steps: {before} -> {after} (the checkpoint {has}, which is saved only with "
        f"actor.policy_loss.loss_mode=sppo and actor.sppo_refresh_steps > 1). Restore those settings, or start "
        f"a new run in another trainer.output_dir"
    )
    # 2 -> 4 keeps the snapshot: the resume goes on (with the change logged).
    if before > 1:
        changed = compare_runs(ckpt, load_config(None, [*SPPO_OFFLINE, "actor.sppo_refresh_steps=4"]), {})
        assert changed["actor.sppo_refresh_steps"] == (2, 4)
