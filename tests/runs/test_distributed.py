"""Process-group setup and the metric reductions, on one rank and on 2 gloo ranks."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ppo.distributed import destroy_distributed, init_distributed, reduce_metrics
from tests.helpers import CRASH_MARKERS, ROOT, excerpt, torchrun

WORKER = textwrap.dedent(
    """
    import json, sys
    from ppo.distributed import (all_reduce_scalars, broadcast_object, destroy_distributed, init_distributed,
                                 make_mesh, reduce_metrics)
    info = init_distributed("cpu", timeout_s=60)
    r = info.rank
    out = {
        "world": info.world_size,
        "metrics": reduce_metrics({"a/mean": float(r), "a/max": float(r), "a/min": float(r) + 5,
                                   "n_sum": 1.0 + r, "perf/total_num_tokens": 10.0}),
        "scalars": all_reduce_scalars([1.0, 2.0 * r], "sum"),
        "obj": broadcast_object({"from": r}),
        "mesh_1d": list(make_mesh(info, -1).shape),
        "mesh_2d": list(make_mesh(info, 1).shape),
    }
    with open(sys.argv[1] + f".{r}", "w") as f:
        json.dump(out, f)
    destroy_distributed()
    """
)


def test_single_rank_without_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    info = init_distributed("cpu")
    assert (info.rank, info.world_size, info.is_main) == (0, 1, True)
    assert reduce_metrics({"x": 1.5}) == {"x": 1.5}
    destroy_distributed()  # leave no process group behind for the tests that follow


@pytest.mark.slow
def test_two_gloo_ranks(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    proc = torchrun(script, out, timeout=180)
    assert proc.returncode == 0, excerpt(proc.stderr)
    results = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    for res in results:
        assert res["world"] == 2
        # ranks 0 and 1: mean of 0,1 = 0.5; max 1; min of 5,6 = 5; sums 1+2 = 3 and 10+10 = 20
        assert res["metrics"] == {
            "a/mean": 0.5,
            "a/max": 1.0,
            "a/min": 5.0,
            "n_sum": 3.0,
            "perf/total_num_tokens": 20.0,
        }
        assert res["scalars"] == [2.0, 2.0]  # 1+1, 0+2
        assert res["obj"] == {"from": 0}
        assert res["mesh_1d"] == [2]
        assert res["mesh_2d"] == [2, 1]  # fsdp_size=1: replicate over 2 groups of 1


RACE_WORKER = textwrap.dedent(
    """
    import sys, time
    import torch
    import torch.distributed as dist
    from ppo.distributed import destroy_distributed, exit_process, init_distributed

    init_distributed("cpu", timeout_s=60)
    group = dist.group.WORLD  # kept past destroy_process_group, as DTensor's caches keep a mesh's group
    destroy_distributed()
    # The race, every time: the main thread keeps the GIL (no hand-over) while gloo's worker finishes an
    # all-reduce of a tensor that Python holds; the worker then waits for the GIL to drop its reference.
    t = torch.ones(4)
    seen = t.numpy()  # the same memory, read without releasing the GIL
    sys.setswitchinterval(1000.0)
    group.allreduce([t])  # asynchronous, its work object dropped at once: the worker holds the last reference
    while seen[0] != 2.0:
        pass
    end = time.perf_counter() + 0.05
    while time.perf_counter() < end:
        pass
    exit_process(3) if sys.argv[1] == "exit_process" else sys.exit(3)
    """
)


@pytest.mark.slow
def test_exit_process_ends_ranks_whose_gloo_worker_waits_for_the_gil(tmp_path: Path) -> None:
    """``exit_process`` ends a rank with its code while gloo's worker thread is still to drop a
    collective's tensors: with ``sys.exit`` the interpreter's teardown ends that thread inside a
    destructor and the process aborts (SIGABRT, "terminate called without an active exception"), which
    this worker shows every time on torch 2.13 (``sys.exit`` in its last line)."""
    script = tmp_path / "worker.py"
    script.write_text(RACE_WORKER)
    for _ in range(2):
        proc = torchrun(script, "exit_process", timeout=120)
        assert not any(marker in proc.stderr for marker in CRASH_MARKERS), excerpt(proc.stderr)
        assert "exitcode  : 3 " in proc.stderr and "SIGABRT" not in proc.stderr, excerpt(proc.stderr)


def test_exit_process_keeps_what_sys_exit_keeps(tmp_path: Path) -> None:
    """Non-daemon threads finish, ``atexit`` handlers run and buffered output is written, as with
    ``sys.exit``; the code is the process's exit status."""
    script = tmp_path / "ends.py"
    script.write_text(
        textwrap.dedent(
            """
            import atexit, sys, threading, time
            from pathlib import Path
            from ppo.distributed import exit_process

            out = Path(sys.argv[1])
            atexit.register(lambda: (out / "atexit").write_text("ran"))
            threading.Thread(target=lambda: (time.sleep(0.2), (out / "thread").write_text("ran"))).start()
            print("buffered", end="")  # stdout is a pipe: block-buffered
            exit_process(3)
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert (proc.returncode, proc.stdout) == (3, "buffered"), proc.stderr
    assert (tmp_path / "atexit").read_text() == "ran" and (tmp_path / "thread").read_text() == "ran"


JOINS_A_GROUP = ("init_distributed(", "runner.main(", "on_every_rank(", "build_run(")
"""What an entry point calls when its process joins a process group (directly or through the harness)."""


def test_entry_points_that_join_a_group_end_with_exit_process() -> None:
    """Every script whose process joins a process group ends through ``exit_process`` (a process that
    ends with ``sys.exit`` can abort after its run succeeded), and the others keep ``sys.exit``."""
    ends = {}
    for path in [ROOT / "train_ppo.py", *sorted((ROOT / "scripts").glob("*.py"))]:
        text = path.read_text()
        if 'if __name__ == "__main__":\n' not in text:
            continue
        main_block = text.rsplit('if __name__ == "__main__":\n', 1)[1]
        joins = any(call in text for call in JOINS_A_GROUP)
        ends[path.name] = (joins, "exit_process(main())" in main_block)
    assert ends["train_ppo.py"] == (True, True) and ends["train_sft.py"] == (True, True)
    assert ends["config_reference.py"] == (False, False)
    assert not [name for name, (joins, exits) in ends.items() if joins and not exits]
