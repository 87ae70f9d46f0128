"""The Slurm launchers: syntax, and the srun + torchrun command they build for 1 and 4 nodes.

Each script runs under bash with fake ``srun``, ``scontrol`` and ``python`` executables first on PATH
(they write their argv to files and exit) and fake ``SLURM_*`` variables, so no cluster is needed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "scripts" / "slurm"
SCRIPTS = sorted(SLURM.glob("*.sbatch"))
JOB_ID = 4242
PPO_CONFIG = "configs/qwen2_5_7b_gsm8k.yaml"
STAGE_CONFIG = "configs/sft_demo.yaml"

# Each fake appends its argv (one argument per line, then a separator) to $FAKE_LOG/<name>.
FAKE_SRUN = """#!/usr/bin/env bash
printf '%s\\n' "$@" >> "$FAKE_LOG/srun"; echo --- >> "$FAKE_LOG/srun"
echo "$TORCH_NCCL_TRACE_BUFFER_SIZE $TORCH_NCCL_DUMP_ON_TIMEOUT ${TORCH_NCCL_DEBUG_INFO_TEMP_FILE:-}" > "$FAKE_LOG/srun_env"
# Like a real job step, run until the job is requeued (the fake scontrol touches the marker), for at
# most $FAKE_SRUN_WAIT ticks of 50 ms.
if [[ -n ${FAKE_SRUN_WAIT:-} ]]; then
    for _ in $(seq "$FAKE_SRUN_WAIT"); do [[ -e $FAKE_LOG/requeued ]] && exit 143; sleep 0.05; done
    exit 1
fi
exit "${FAKE_SRUN_RC:-0}"
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
printf '%s\\n' "$@" >> "$FAKE_LOG/scontrol"; echo --- >> "$FAKE_LOG/scontrol"
if [[ $1 == show && $2 == hostnames ]]; then printf '%s\\n' $FAKE_HOSTS; fi
# A real requeue takes a moment, in which Slurm may already have ended the step.
if [[ $1 == requeue ]]; then touch "$FAKE_LOG/requeued"; sleep "${FAKE_SCONTROL_SLEEP:-0}"; fi
"""
FAKE_PYTHON = """#!/usr/bin/env bash
printf '%s\\n' "$@" >> "$FAKE_LOG/python"; echo --- >> "$FAKE_LOG/python"
# --print-config without --world-size resolves the run folder; a world size in $FAKE_PYTHON_BAD fails.
if [[ " $* " != *" --world-size "* ]]; then printf 'trainer:\\n  output_dir: %s\\n' "$FAKE_LOG/run"; fi
for ws in ${FAKE_PYTHON_BAD:-}; do
    if [[ " $* " == *" --world-size $ws "* ]]; then echo "config error: $ws ranks do not fit" >&2; exit 2; fi
done
if [[ ${FAKE_PYTHON_RC:-0} != 0 ]]; then echo "config error: fake" >&2; fi
exit "${FAKE_PYTHON_RC:-0}"
"""


@pytest.fixture
def fakes(tmp_path: Path) -> Path:
    """A bin/ folder with the fake executables and an empty log/ folder beside it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("python", FAKE_PYTHON)):
        path = bin_dir / name
        path.write_text(text)
        path.chmod(0o755)
    (tmp_path / "log").mkdir()
    return tmp_path


def slurm_env(fakes: Path, nnodes: int, **extra: str) -> dict[str, str]:
    """The environment of a batch script in a job of ``nnodes`` nodes with 8 GPUs each."""
    hosts = [f"gpu-{i:03d}" for i in range(7, 7 + nnodes)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "PPO_"))}
    env.pop("GPUS_PER_NODE", None)
    env.update(
        PATH=f"{fakes / 'bin'}:{env['PATH']}",
        FAKE_LOG=str(fakes / "log"),
        FAKE_HOSTS=" ".join(hosts),
        PYTHON=str(fakes / "bin" / "python"),
        TORCHRUN="torchrun",
        SLURM_JOB_ID=str(JOB_ID),
        SLURM_JOB_NAME="ppo",
        SLURM_NNODES=str(nnodes),
        SLURM_JOB_NODELIST=f"gpu-[{7:03d}-{6 + nnodes:03d}]",
        SLURM_GPUS_ON_NODE="8",
        SLURM_SUBMIT_DIR=str(ROOT),
        SLURM_CPUS_ON_NODE="96",
    )
    env.update(extra)
    return env


def calls(fakes: Path, name: str) -> list[list[str]]:
    """The argv of every call of a fake, in order."""
    path = fakes / "log" / name
    if not path.exists():
        return []
    out, cur = [], []
    for line in path.read_text().splitlines():
        if line == "---":
            out.append(cur)
            cur = []
        else:
            cur.append(line)
    return out


def run_script(script: str, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SLURM / script), *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )


def parse_torchrun(argv: list[str], entry: str) -> tuple[list[str], dict[str, str], list[str]]:
    """Split srun's argv into (srun options, torchrun --key=value options, the entry's arguments)."""
    i = argv.index("torchrun")
    j = argv.index(entry)
    opts = dict(a.removeprefix("--").split("=", 1) for a in argv[i + 1 : j])
    return argv[:i], opts, argv[j + 1 :]


def sbatch_headers(script: Path) -> list[str]:
    return [line.split(None, 1)[1] for line in script.read_text().splitlines() if line.startswith("#SBATCH")]


def test_found_all_scripts() -> None:
    assert {p.name for p in SCRIPTS} == {"ppo.sbatch", "sft.sbatch", "reward_model.sbatch", "dpo.sbatch"}


@pytest.mark.parametrize("script", [*SCRIPTS, SLURM / "launch.sh"], ids=lambda p: p.name)
def test_bash_syntax(script: Path) -> None:
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "set -euo pipefail" in script.read_text()


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_sbatch_headers(script: Path) -> None:
    headers = sbatch_headers(script)
    assert "--output=logs/%x-%j.out" in headers
    assert "--gpus-per-node=8" in headers and "--ntasks-per-node=1" in headers
    assert "--requeue" in headers
    # Every entry resumes from its checkpoints, so every job requeues itself before the time limit.
    assert any(h.startswith("--signal=B:USR1@") for h in headers)


@pytest.mark.parametrize("nnodes", [1, 4])
def test_ppo_command(fakes: Path, nnodes: int) -> None:
    overrides = ["actor.optim.lr=2e-6", "trainer.save_freq=10"]
    result = run_script("ppo.sbatch", [PPO_CONFIG, *overrides], slurm_env(fakes, nnodes))
    assert result.returncode == 0, result.stderr

    assert calls(fakes, "scontrol") == [["show", "hostnames", f"gpu-[007-{6 + nnodes:03d}]"]]
    [srun] = calls(fakes, "srun")
    srun_opts, torchrun, args = parse_torchrun(srun, "train_ppo.py")
    assert f"--nodes={nnodes}" in srun_opts and "--ntasks-per-node=1" in srun_opts
    assert "--cpus-per-task=96" in srun_opts
    port = 20000 + JOB_ID % 10000
    assert torchrun == {
        "nnodes": str(nnodes),
        "nproc_per_node": "8",
        "rdzv_id": str(JOB_ID),
        "rdzv_backend": "c10d",
        "rdzv_endpoint": f"gpu-007:{port}",  # the first host of the allocation
        "max-restarts": "3",
    }
    # resume_mode=auto before the user's overrides (they may pin a checkpoint), the node layout after.
    assert args == [
        "--config",
        PPO_CONFIG,
        "trainer.resume_mode=auto",
        *overrides,
        f"trainer.nnodes={nnodes}",
        "trainer.n_gpus_per_node=8",
    ]
    # The config was validated for the job's world size before any rank started, then its run folder
    # resolved: the NCCL flight recorder dumps there.
    check, folder = calls(fakes, "python")
    check_args = ["train_ppo.py", "--config", PPO_CONFIG, "--print-config", "--allow-missing-paths"]
    assert check[:6] == [*check_args, "--world-size"]
    assert check[6] == str(8 * nnodes) and check[7:] == args[2:]
    assert folder == [*check_args, *args[2:]]
    trace = (fakes / "log" / "srun_env").read_text().split()
    assert trace == ["2000", "1", str(fakes / "log" / "run" / "nccl_trace" / "rank_")]


@pytest.mark.parametrize(
    ("script", "entry"),
    [
        ("sft.sbatch", "scripts/train_sft.py"),
        ("reward_model.sbatch", "scripts/train_reward_model.py"),
        ("dpo.sbatch", "scripts/train_dpo.py"),
    ],
)
def test_stage_commands(fakes: Path, script: str, entry: str) -> None:
    env = slurm_env(fakes, 4, MASTER_PORT="31337")
    result = run_script(script, [STAGE_CONFIG, "trainer.seed=3"], env)
    assert result.returncode == 0, result.stderr
    [srun] = calls(fakes, "srun")
    _, torchrun, args = parse_torchrun(srun, entry)
    assert torchrun["nnodes"] == "4" and torchrun["nproc_per_node"] == "8"
    assert torchrun["rdzv_endpoint"] == "gpu-007:31337"
    assert torchrun["max-restarts"] == "3"  # the stages checkpoint and resume like PPO
    # resume_mode=auto before the user's overrides; the stage configs have no trainer.nnodes keys.
    assert args == ["--config", STAGE_CONFIG, "trainer.resume_mode=auto", "trainer.seed=3"]


def test_gpus_per_node_with_a_type(fakes: Path) -> None:
    env = slurm_env(fakes, 2, SLURM_GPUS_PER_NODE="h100:4")
    del env["SLURM_GPUS_ON_NODE"]
    assert run_script("ppo.sbatch", [PPO_CONFIG], env).returncode == 0
    [srun] = calls(fakes, "srun")
    _, torchrun, args = parse_torchrun(srun, "train_ppo.py")
    assert torchrun["nproc_per_node"] == "4" and args[-1] == "trainer.n_gpus_per_node=4"


def test_precheck_failure_starts_nothing(fakes: Path) -> None:
    result = run_script("ppo.sbatch", [PPO_CONFIG], slurm_env(fakes, 4, FAKE_PYTHON_RC="2"))
    assert result.returncode == 2
    assert (
        "does not fit 32 ranks (4 node(s)) of 8 GPU(s) a node; nothing was started: config error: fake"
        in result.stderr
    )
    assert calls(fakes, "srun") == []


def test_elastic_range_is_checked_for_every_world_size(fakes: Path) -> None:
    """MIN_NODES=2 of 4 allocated nodes: torchrun may restart on 2, 3 or 4 nodes; every such world size
    is validated before any rank starts, and the ones that do not fit are listed in one line."""
    env = slurm_env(fakes, 4, MIN_NODES="2")
    assert run_script("ppo.sbatch", [PPO_CONFIG], env).returncode == 0
    [srun] = calls(fakes, "srun")
    _, torchrun, args = parse_torchrun(srun, "train_ppo.py")
    assert torchrun["nnodes"] == "2:4"
    assert args[-2:] == ["trainer.nnodes=null", "trainer.n_gpus_per_node=null"]  # no fixed layout
    checked = [
        call[call.index("--world-size") + 1] for call in calls(fakes, "python") if "--world-size" in call
    ]
    assert checked == ["16", "24", "32"]

    (fakes / "log" / "python").unlink()
    result = run_script("ppo.sbatch", [PPO_CONFIG], {**env, "FAKE_PYTHON_BAD": "24 32"})
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "does not fit 24 ranks (3 node(s)),32 ranks (4 node(s)) of 8 GPU(s) a node" in result.stderr
    assert "config error: 24 ranks do not fit" in result.stderr
    assert len(calls(fakes, "srun")) == 1  # the first job's only


def test_missing_config_and_usage(fakes: Path) -> None:
    result = run_script("ppo.sbatch", ["configs/nope.yaml"], slurm_env(fakes, 1))
    assert result.returncode == 2 and "configs/nope.yaml not found" in result.stderr
    result = run_script("ppo.sbatch", [], slurm_env(fakes, 1))
    assert result.returncode == 2 and "usage:" in result.stderr
    assert calls(fakes, "srun") == []


def test_srun_failure_is_the_exit_code(fakes: Path) -> None:
    result = run_script("ppo.sbatch", [PPO_CONFIG], slurm_env(fakes, 1, FAKE_SRUN_RC="7"))
    assert result.returncode == 7


def test_usr1_requeues_the_job(fakes: Path) -> None:
    """Slurm's USR1 before the time limit makes the batch shell run `scontrol requeue <job id>`.

    The fake requeue outlasts the step (srun ends while the trap still runs), and the shell still exits
    with the step's status, not with the 128 + 10 of the interrupted `wait`.
    """
    env = slurm_env(fakes, 2, FAKE_SRUN_WAIT="400", SLURM_RESTART_COUNT="1", FAKE_SCONTROL_SLEEP="0.5")
    proc = subprocess.Popen(
        ["bash", str(SLURM / "ppo.sbatch"), PPO_CONFIG],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # The trap is set before srun starts: wait for srun's first log line, then signal.
        deadline = time.monotonic() + 20
        while not calls(fakes, "srun") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert calls(fakes, "srun"), "srun never started"
        proc.send_signal(signal.SIGUSR1)
        _, stderr = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert ["requeue", str(JOB_ID)] in calls(fakes, "scontrol"), stderr
    assert "requeueing job 4242 (restart 2)" in stderr
    assert proc.returncode == 143  # the step's exit status once the requeue ended it


def test_usr1_stops_requeueing_after_max(fakes: Path) -> None:
    env = slurm_env(fakes, 1, FAKE_SRUN_WAIT="20", SLURM_RESTART_COUNT="5", MAX_REQUEUES="5")
    proc = subprocess.Popen(
        ["bash", str(SLURM / "ppo.sbatch"), PPO_CONFIG], env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 20
        while not calls(fakes, "srun") and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR1)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert not any(c[0] == "requeue" for c in calls(fakes, "scontrol"))
    assert "not requeueing" in stderr
