"""Long runs on clusters: a hang names its phase and the ranks that did not arrive; a checkpoint resumes
on fewer or more ranks (an elastic restart); the Slurm launcher's elastic range is in test_slurm.py and
background checkpoints in test_async_save.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ppo.distributed import Watch
from tests.helpers import REWARD_FNS, ROOT, base_args, read_metrics, run, torchrun

pytestmark = pytest.mark.slow


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
    assert lines, proc.stderr[-3000:]
    assert "rank 0 waited in phase 'reward' of step 2" in lines[0]
    assert "did not arrive: rank 1 (in phase 'reward' of step 2" in lines[0]
    assert "Traceback" not in proc.stderr.split("a collective timed out")[0][-2000:]


def test_watch_describes_ranks_behind_without_a_store() -> None:
    """Without a store (one rank) the description still names this rank's phase."""
    watch = Watch(rank=0, phase="update_actor", step=7, collectives=12)
    text = watch.describe_timeout(1, RuntimeError("Timed out waiting 10000ms for recv"))
    assert "rank 0 waited in phase 'update_actor' of step 7 (collective #12)" in text
    assert "no report from rank(s) [0]" in text


@pytest.mark.parametrize("nproc", [1, 4])
def test_a_two_rank_checkpoint_continues_on_another_world_size(
    tiny_assets: Path, tmp_path: Path, nproc: int
) -> None:
    """Two steps on 2 ranks, then (as an elastic restart would) steps 3 and 4 on 1 or on 4 ranks from the
    same checkpoint: the run continues, in the same data order."""
    common = ["trainer.save_freq=1", "trainer.val_before_train=false", "trainer.dist_timeout_s=120"]
    first = tmp_path / "first"
    proc = torchrun(ROOT / "train_ppo.py", *base_args(tiny_assets, first, steps=2), *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / f"on_{nproc}"
    shutil.copytree(first, out)
    args = base_args(tiny_assets, out, steps=4) + common
    if nproc == 1:
        assert run(args) == 0
    else:
        proc = torchrun(ROOT / "train_ppo.py", *args, nproc=nproc, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"resumed a checkpoint of 2 ranks on {nproc} ranks" in proc.stderr
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[:2] == read_metrics(first)  # the first two steps' rows kept as they were
