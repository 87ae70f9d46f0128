"""Benchmark what scoring rule rewards in worker processes costs (``reward.pool_workers``,
``reward.timeout_s``) against scoring in the trainer's process, per 1000 responses, and how long the
pool's calls take when its functions hang.

The responses are worked answers of the synthetic task (``scripts/make_tiny_assets.py``), scored by the
built-in GSM8K rule (``--custom-function`` for another); the same texts every way. Each way scores
``--responses`` texts ``--repeat`` times (the pool is started once, before timing: a run pays its start-up
once). Columns: way, median seconds per 1000 responses, relative to in-process.

Then three calls of a pool whose function hangs (it sleeps an hour on the rows it is told to), each
``--repeat`` times, median wall seconds of the call (``s_per_call``) next to ``limit_s``, the time the
pool is meant to wait (tests/unit/test_reward_pool.py checks what happens in them, by counts and order):

- ``timeout_replace``: 2 workers, ``reward.timeout_s=1``, 8 responses, the 1st and the 5th hang: each
  hung worker is replaced without waiting for its replacement, so the call takes the timeout plus a
  bare interpreter's start (``limit_s``: the timeout). Replacing it synchronously with a ``spawn``ed
  child that imported torch and the trainer took 11.2 s on the 2-core development machine.
- ``total_timeout``: 2 workers, ``reward.timeout_s=5``, ``reward.total_timeout_s=1.5``, 8 responses that
  all hang: the cap cuts the call (``limit_s``: 1.5), where the per-call timeouts alone take 20 s.
- ``stop``: 2 workers, ``reward.timeout_s=30``, 4 responses of which the 2nd and 3rd hang, a stop request
  0.5 s into the call: the call returns at the next check of ``stop`` (every
  ``ppo.reward_pool.STOP_POLL_S``; ``limit_s``: 0.5 s plus that), not at the hung calls' timeout.

Columns: scenario, ``s_per_call``, ``limit_s``, ``timeouts`` and ``abandoned`` (rows per call).

With ``--hang-every K`` every K-th response hangs instead (a function that sleeps an hour on it, otherwise
the GSM8K rule): each call of the pool waits ``--timeout-s`` for them and replaces their workers.
Columns: way, median seconds per call of ``--responses`` responses, timeouts per call.

    .venv/bin/python -m ppo_bench.rewards
    .venv/bin/python -m ppo_bench.rewards --workers 1 2 4 --responses 4000 --json
    .venv/bin/python -m ppo_bench.rewards --hang-every 4 --responses 16 --workers 4 --timeout-s 1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ppo import rewards, rule_scoring
from ppo.data import PromptRecord
from ppo.reward_pool import STOP_POLL_S, RewardPool

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


@dataclasses.dataclass(frozen=True)
class HangScenario:
    """A call of a pool whose function hangs on some rows (the module docstring says what each shows)."""

    name: str
    timeout_s: float
    """``reward.timeout_s``."""
    responses: int
    hanging: tuple[int, ...]
    """The 0-based rows whose call hangs."""
    limit_s: float
    """How long the call is meant to wait: the timeout, the cap, or the stop request plus one poll."""
    total_timeout_s: float | None = None
    stop_after_s: float | None = None
    """A stop request this long into the call."""
    workers: int = 2


HANG_SCENARIOS = [
    HangScenario(name="timeout_replace", timeout_s=1.0, responses=8, hanging=(0, 4), limit_s=1.0),
    HangScenario(
        name="total_timeout",
        timeout_s=5.0,
        total_timeout_s=1.5,
        responses=8,
        hanging=tuple(range(8)),
        limit_s=1.5,
    ),
    HangScenario(
        name="stop", timeout_s=30.0, stop_after_s=0.5, responses=4, hanging=(1, 2), limit_s=0.5 + STOP_POLL_S
    ),
]


def stop_after(seconds: float | None) -> Callable[[], bool] | None:
    """A stop request that turns true ``seconds`` from now (None: never asked)."""
    if seconds is None:
        return None
    at = time.perf_counter() + seconds
    return lambda: time.perf_counter() > at


def hang_scenarios(repeat: int) -> list[dict]:
    """Each of ``HANG_SCENARIOS``: median wall seconds of ``repeat`` calls (one pool, started before
    timing), next to ``limit_s``, with the timeouts and abandoned rows of a call."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        fn = Path(tmp) / "hanging_reward.py"
        fn.write_text(HANGING_FUNCTION)
        for s in HANG_SCENARIOS:
            records, texts = responses(s.responses)
            for row in s.hanging:
                records[row].extra_info["hang"] = True
            pool = RewardPool(
                custom_function=f"{fn}:compute_score",
                format_score=0.0,
                reward_kwargs={},
                num_workers=s.workers,
                timeout_s=s.timeout_s,
                error_score=0.0,
                total_timeout_s=s.total_timeout_s,
            )
            times = []
            try:
                for _ in range(repeat):
                    start = time.perf_counter()
                    out = pool.score(records, texts, stop=stop_after(s.stop_after_s))
                    times.append(time.perf_counter() - start)
            finally:
                pool.close()
            rows.append({
                "scenario": s.name, "s_per_call": statistics.median(times), "limit_s": s.limit_s,
                "timeouts": out.timeouts, "abandoned": out.abandoned,
            })  # fmt: skip
    return rows


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
    scenarios = hang_scenarios(args.repeat)
    if args.json:
        print(json.dumps({"responses": args.responses, "rows": rows, "scenarios": scenarios}))
        return 0
    print(f"{args.responses} responses, median of {args.repeat}")
    print(f"{'way':<14} {'s per 1000':>11} {'vs in-process':>14}")
    for r in rows:
        print(f"{r['way']:<14} {r['s_per_1000']:>11.4f} {r['vs_in_process']:>14.1f}")
    print(f"\na function that hangs, median of {args.repeat} calls")
    print(f"{'scenario':<16} {'s per call':>11} {'limit s':>8} {'timeouts':>9} {'abandoned':>10}")
    for r in scenarios:
        print(
            f"{r['scenario']:<16} {r['s_per_call']:>11.2f} {r['limit_s']:>8.2f} {r['timeouts']:>9} "
            f"{r['abandoned']:>10}"
        )
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
