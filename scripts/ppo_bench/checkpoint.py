"""Benchmark how long a checkpoint stops training: a blocking save against a background one
(``trainer.async_save``), through the trainer's own ``Checkpointer``.

A model of ``--params`` million fp32 parameters (a stack of square linear layers) with AdamW state (3x the
weights on disk) is checkpointed ``--repeat`` times each way into a temporary folder. ``stall_s`` is what
training waits for: the whole write for a blocking save; for a background save, the copy to host memory
and the start of the write (``save`` returning), plus, at the next save or the end, whatever of the write
is not done yet (here none: the benchmark "trains" for ``--gap-s`` seconds between saves, as a run does
between checkpoints). ``write_s`` is the time until the checkpoint is complete (renamed, ``latest``
moved). Columns: mode, checkpoint size, stall (median), write (median), stall relative to blocking.

    .venv/bin/python -m ppo_bench.checkpoint                       # 200M parameters, table
    .venv/bin/python -m ppo_bench.checkpoint --params 50 --json
    .venv/bin/torchrun --standalone --nproc_per_node=2 -m ppo_bench.checkpoint --params 100
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ppo.checkpointer import Checkpointer, TrainerState
from ppo.distributed import (
    DistInfo,
    barrier,
    broadcast_object,
    destroy_distributed,
    exit_process,
    init_distributed,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=200, help="millions of fp32 parameters")
    parser.add_argument("--repeat", type=int, default=3, help="saves per mode")
    parser.add_argument("--gap-s", type=float, default=5.0, help="seconds of 'training' between saves")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    return parser.parse_args(argv)


def make_model(params_m: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Square 2048-wide linear layers adding up to about ``params_m`` million parameters, with a stepped
    AdamW (so its two moment buffers exist)."""
    width = 2048
    layers = max(1, round(params_m * 1e6 / (width * width + width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    return model, optimizer


def measure(
    info: DistInfo,
    out: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    background: bool,
    repeat: int,
    gap_s: float,
) -> dict[str, float]:
    """Median stall and write time of ``repeat`` saves, blocking or in the background."""
    state = TrainerState()
    ckpt = Checkpointer(
        out_dir=out,
        info=info,
        config_yaml="{}",
        keep=1,
        seed=0,
        models={"model": model},
        optimizers={"model": optimizer},
        schedulers={},
        stateful={"trainer": state},
        async_group=dist.new_group(backend="gloo") if background else None,
    )
    stalls, writes = [], []
    for step in range(1, repeat + 1):
        state.step = step
        barrier()
        start = time.perf_counter()
        ckpt.save(step)
        stall = time.perf_counter() - start
        if background:  # training goes on; then the next save (or the end) waits for what is left
            while ckpt.pending is not None and time.perf_counter() - start < gap_s:
                time.sleep(0.05)
                ckpt.poll()
            waited = time.perf_counter()
            ckpt.wait()
            stall += time.perf_counter() - waited
        writes.append(time.perf_counter() - start)
        stalls.append(stall)
    size = sum(f.stat().st_size for f in (out / "checkpoints").rglob("*") if f.is_file())
    return {
        "stall_s": statistics.median(stalls),
        "write_s": statistics.median(writes),
        "size_gib": size / 2**30,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info = init_distributed("cpu")
    torch.manual_seed(0)
    model, optimizer = make_model(args.params)
    # The ranks write one checkpoint together: rank 0's temporary folder, on every rank.
    root = Path(broadcast_object(tempfile.mkdtemp(dir=args.dir) if info.is_main else None))
    rows = []
    try:
        for mode in ("blocking", "background"):
            background = mode == "background"
            timing = measure(
                info,
                root / mode,
                model,
                optimizer,
                background=background,
                repeat=args.repeat,
                gap_s=args.gap_s,
            )
            rows.append({"mode": mode, **timing})
    finally:
        barrier()
        if info.is_main:
            shutil.rmtree(root, ignore_errors=True)
        destroy_distributed()
    if not info.is_main:
        return 0
    for row in rows:
        row["stall_vs_blocking"] = row["stall_s"] / rows[0]["stall_s"]
    params = sum(p.numel() for p in model.parameters())
    if args.json:
        print(json.dumps({"params": params, "rows": rows}))
        return 0
    print(
        f"{params / 1e6:.0f}M fp32 parameters with AdamW state, {info.world_size} rank(s), median of {args.repeat}"
    )
    print(f"{'mode':<11} {'size GiB':>9} {'stall s':>9} {'write s':>9} {'stall vs blocking':>18}")
    for r in rows:
        print(
            f"{r['mode']:<11} {r['size_gib']:>9.2f} {r['stall_s']:>9.3f} {r['write_s']:>9.3f} {r['stall_vs_blocking']:>18.3f}"
        )
    return 0


if __name__ == "__main__":
    exit_process(main())
