"""Benchmark what scoring rule rewards in worker processes costs (``reward.pool_workers``,
``reward.timeout_s``) against scoring in the trainer's process, per 1000 responses.

The responses are worked answers of the synthetic task (``scripts/make_tiny_assets.py``), scored by the
built-in GSM8K rule (``--custom-function`` for another); the same texts every way. Each way scores
``--responses`` texts ``--repeat`` times (the pool is started once, before timing: a run pays its start-up
once). Columns: way, median seconds per 1000 responses, relative to in-process.

    .venv/bin/python scripts/bench_rewards.py
    .venv/bin/python scripts/bench_rewards.py --workers 1 2 4 --responses 4000 --json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ppo import rewards  # noqa: E402
from ppo.data import PromptRecord  # noqa: E402
from ppo.reward_pool import RewardPool  # noqa: E402


def responses(n: int) -> tuple[list[PromptRecord], list[str]]:
    """``n`` prompt records of two-digit additions and worked answers, half of them right."""
    records, texts = [], []
    for i in range(n):
        a, b = 10 + i % 90, 10 + (i * 7) % 90
        answer = a + b if i % 2 == 0 else a + b - 10
        record = PromptRecord(
            index=i, input_ids=[1], prompt_text=f"{a} + {b}", data_source="synthetic/arith",
            ground_truth=str(a + b), extra_info={},
        )  # fmt: skip
        records.append(record)
        texts.append(f"{a} + {b} = {answer}\n#### {answer}")
    return records, texts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--responses", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--custom-function", default=None, help="module:function or file.py:function")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    records, texts = responses(args.responses)
    scorer = rewards.make_rule_scorer(args.custom_function, 0.0)
    rows = []
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        rewards.rule_scores(scorer, records, texts)
        times.append(time.perf_counter() - start)
    rows.append({"way": "in-process", "s_per_1000": 1000 * statistics.median(times) / args.responses})
    for workers in args.workers:
        pool = RewardPool(
            functools.partial(rewards.make_rule_scorer, args.custom_function, 0.0),
            name="bench",
            num_workers=workers,
            timeout_s=60,
            error_score=0.0,
        )
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            rewards.rule_scores(scorer, records, texts, pool)
            times.append(time.perf_counter() - start)
        pool.close()
        rows.append(
            {"way": f"{workers} worker(s)", "s_per_1000": 1000 * statistics.median(times) / args.responses}
        )
    for row in rows:
        row["vs_in_process"] = row["s_per_1000"] / rows[0]["s_per_1000"]
    if args.json:
        print(json.dumps({"responses": args.responses, "rows": rows}))
        return 0
    print(f"{args.responses} responses, median of {args.repeat}")
    print(f"{'way':<14} {'s per 1000':>11} {'vs in-process':>14}")
    for r in rows:
        print(f"{r['way']:<14} {r['s_per_1000']:>11.4f} {r['vs_in_process']:>14.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
