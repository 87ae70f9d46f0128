"""Process-group setup and the metric reductions, on one rank and on 2 gloo ranks."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from ppo.distributed import destroy_distributed, init_distributed, reduce_metrics
from tests.helpers import excerpt, torchrun

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
