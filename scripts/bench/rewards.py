"""Benchmark what scoring rule rewards in worker processes costs (``reward.pool_workers``,
``reward.timeout_s``) against scoring in the trainer's process, per 1000 responses.

The responses are worked answers of the synthetic task (``scripts/make_tiny_assets.py``), scored by the
built-in GSM8K rule (``--custom-function`` for another); the same texts every way. Each way scores
``--responses`` texts ``--repeat`` times (the pool is started once, before timing: a run pays its start-up
once). Columns: way, median seconds per 1000 responses, relative to in-process.

With ``--hang-every K`` every K-th response hangs (a function that sleeps an hour on it, otherwise the
GSM8K rule): each call of the pool waits ``--timeout-s`` for them and replaces their workers. Columns:
way, median seconds per call of ``--responses`` responses, timeouts per call.

    .venv/bin/python -m scripts.bench.rewards
    .venv/bin/python -m scripts.bench.rewards --workers 1 2 4 --responses 4000 --json
    .venv/bin/python -m scripts.bench.rewards --hang-every 4 --responses 16 --workers 4 --timeout-s 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from ppo import rewards, rule_scoring
from ppo.data import PromptRecord
from ppo.reward_pool import RewardPool

HANGING_FUNCTION = """
import time

from ppo.rule_scoring import gsm8k_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info.get("hang"):
        time.sleep(3600)
    return gsm8k_score(solution_str, ground_truth)
"""
"""``--hang-every``'s reward function: it hangs on the rows marked ``extra_info["hang"]``."""


def responses(n: int, hang_every: int = 0) -> tuple[list[PromptRecord], list[str]]:
    """``n`` prompt records of two-digit additions and worked answers, half of them right; with
    ``hang_every`` K, every K-th one (the K-th, the 2K-th, ...) is marked to hang."""
    records, texts = [], []
    for i in range(n):
        a, b = 10 + i % 90, 10 + (i * 7) % 90
        answer = a + b if i % 2 == 0 else a + b - 10
        hang = hang_every > 0 and (i + 1) % hang_every == 0
        record = PromptRecord(
            index=i, input_ids=[1], prompt_text=f"{a} + {b}", data_source="synthetic/arith",
            ground_truth=str(a + b), extra_info={"hang": True} if hang else {},
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
    parser.add_argument("--hang-every", type=int, default=0, help="every K-th response hangs (0: none)")
    parser.add_argument("--timeout-s", type=float, default=1.0, help="reward.timeout_s with --hang-every")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.hang_every:
        return hanging(args)
    records, texts = responses(args.responses)
    scorer = rule_scoring.make_rule_scorer(args.custom_function, 0.0)
    rows = []
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        rewards.rule_scores(scorer, records, texts)
        times.append(time.perf_counter() - start)
    rows.append({"way": "in-process", "s_per_1000": 1000 * statistics.median(times) / args.responses})
    for workers in args.workers:
        pool = RewardPool(
            custom_function=args.custom_function,
            format_score=0.0,
            reward_kwargs={},
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


def hanging(args: argparse.Namespace) -> int:
    """``--hang-every``: seconds per call of the pool when every K-th response hangs."""
    records, texts = responses(args.responses, args.hang_every)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        fn = Path(tmp) / "hanging_reward.py"
        fn.write_text(HANGING_FUNCTION)
        for workers in args.workers:
            pool = RewardPool(
                custom_function=f"{fn}:compute_score",
                format_score=0.0,
                reward_kwargs={},
                num_workers=workers,
                timeout_s=args.timeout_s,
                error_score=0.0,
            )
            times, timeouts = [], []
            for _ in range(args.repeat):
                start = time.perf_counter()
                out = pool.score(records, texts)
                times.append(time.perf_counter() - start)
                timeouts.append(out.timeouts)
            pool.close()
            rows.append(
                {
                    "way": f"{workers} worker(s)",
                    "s_per_call": statistics.median(times),
                    "timeouts": timeouts[0],
                }
            )
    if args.json:
        print(
            json.dumps(
                {
                    "responses": args.responses,
                    "hang_every": args.hang_every,
                    "timeout_s": args.timeout_s,
                    "rows": rows,
                }
            )
        )
        return 0
    print(
        f"{args.responses} responses, every {args.hang_every}th hanging, reward.timeout_s={args.timeout_s:g}, "
        f"median of {args.repeat}"
    )
    print(f"{'way':<14} {'s per call':>11} {'timeouts':>9}")
    for r in rows:
        print(f"{r['way']:<14} {r['s_per_call']:>11.2f} {r['timeouts']:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
