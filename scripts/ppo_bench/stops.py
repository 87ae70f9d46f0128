"""Benchmark how long the trainer waits for user code that does not answer: a multi-turn turn whose
environment steps are stuck, and a stop signal to a run whose reward workers hang.

``turn_step_timeouts``: ``ppo.multi_turn.run_turns`` over ``--stuck`` rows (each count in turn) whose
``step`` never answers (it waits for an event that is set after the timing), every row's first turn
writing ``<calc>1+1</calc>`` (a scripted generator, no model), ``rollout.multi_turn.step_timeout_s`` =
``--step-timeout-s``. The turn's calls run concurrently under one deadline, so the rollout takes about one
``step_timeout_s`` (``limit_s``) whatever the number of stuck rows; one call at a time, or one deadline
each, it would take that many times as long. ``outcome``: the step timeouts the rollout counted. Median
of ``--repeat`` rollouts. (tests/unit/test_user_code.py checks by counts that the calls run at once and
that none is waited for.)

``sigterm_hanging_reward_workers``: a GRPO run of make_tiny_assets.py's model and task on 2 ranks under
torchrun, scored in one reward worker per rank (``reward.pool_workers=1``, ``reward.timeout_s=600``) by a
function that hangs on every response after step 1's; once both ranks' first call of step 2 hangs,
SIGTERM to the launcher's process group, as Slurm sends it. ``seconds``: from the signal to torchrun's
exit; ``limit_s``: torchrun's grace between its SIGTERM to the ranks and its SIGKILL (30 s), which the
stop must fit in (scoring gives up at the next check of ``ppo.reward_pool.STOP_POLL_S``, then the run
saves step 1 and exits). ``outcome``: the run's last line about the stop. Median of ``--run-repeat``
runs. (tests/runs/test_reward_pool_runs.py checks what the run saves and logs.)

Columns: scenario, stuck (stuck calls: rows of the turn, or ranks whose reward call hangs), seconds,
limit_s, outcome.

    .venv/bin/python -m ppo_bench.stops
    .venv/bin/python -m ppo_bench.stops --stuck 1 8 64 --step-timeout-s 0.5 --json
    .venv/bin/python -m ppo_bench.stops --no-run            # the turn only (a few seconds)
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ppo_bench.common import print_rows
from ppo_bench.runs import ROOT, repo_script, run_env, run_overrides, torchrun_command

TORCHRUN_GRACE_S = 30.0
"""What torchrun waits between its SIGTERM to the ranks and its SIGKILL (``PContext.close``'s default)."""

HANGING_FUNCTION = """
import os
import time
from pathlib import Path

_calls = {"n": 0}


def compute_score(data_source, solution_str, ground_truth, extra_info=None, *, mark):
    if solution_str:  # not the start-up check's empty response
        _calls["n"] += 1
    if _calls["n"] > 4:  # a rank's 4 responses of step 1, then every call hangs
        Path(f"{mark}.{os.environ.get('RANK', '0')}").touch()
        time.sleep(3600)
    return float("7" in solution_str)
"""
"""``sigterm_hanging_reward_workers``' reward function (per worker process): it hangs on every response
after the first 4, first creating the file ``<mark>.<rank>``."""


@dataclasses.dataclass
class Row:
    scenario: str
    stuck: int
    """Stuck calls: the turn's rows, or the ranks whose reward call hangs."""
    seconds: float
    """Median wall seconds: the rollout, or from the signal to the launcher's exit."""
    limit_s: float
    """One ``step_timeout_s``, or torchrun's grace before SIGKILL."""
    outcome: str


def turn_step_timeouts(stuck: int, step_timeout_s: float, repeat: int) -> Row:
    """``run_turns`` over ``stuck`` rows whose ``step`` never answers, median wall seconds of ``repeat``."""
    import torch
    from transformers import GenerationConfig

    from ppo.data import PromptRecord
    from ppo.multi_turn import MultiTurn, run_turns

    tok = repo_script("make_tiny_assets").build_tokenizer()
    release = threading.Event()

    class Stuck:
        def reset(self, row: dict) -> None:
            pass

        def step(self, action_text: str) -> tuple[str, float, bool]:
            release.wait()
            return "", 1.0, True

    call = tok.encode("<calc>1+1</calc>", add_special_tokens=False)

    def generate_turn(prompts: list[torch.Tensor], config: GenerationConfig) -> torch.Tensor:
        row = (call + [tok.pad_token_id] * config.max_new_tokens)[: config.max_new_tokens]
        return torch.tensor([row] * len(prompts))

    prompt = tok.encode("47 + 38", add_special_tokens=False)
    records = [
        PromptRecord(input_ids=prompt, prompt_text="47 + 38", data_source="synthetic/arith", ground_truth="85",
                     extra_info={}, index=i)
        for i in range(stuck)
    ]  # fmt: skip
    settings = MultiTurn(env_class=Stuck, tokenizer=tok, max_turns=2, max_tool_response_length=32,
                         step_timeout_s=step_timeout_s, stop=["</calc>"], max_response_length=64)  # fmt: skip
    config = GenerationConfig(eos_token_id=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    times, timeouts = [], 0.0
    ppo_logger = logging.getLogger("ppo")
    level = ppo_logger.level
    ppo_logger.setLevel(logging.ERROR)  # the turn's warning about its timeouts, expected here
    try:
        for _ in range(repeat):
            start = time.perf_counter()
            rollout = run_turns(generate_turn, records, config, settings, torch.device("cpu"))
            times.append(time.perf_counter() - start)
            timeouts = rollout.turn_stats["step_timeouts"].sum().item()
    finally:
        release.set()  # the abandoned calls end
        ppo_logger.setLevel(level)
    outcome = f"{timeouts:g} step timeouts"
    return Row("turn_step_timeouts", stuck, statistics.median(times), step_timeout_s, outcome)


def sigterm_hanging_reward_workers(folder: Path, assets: Path, seed: int, threads: int) -> tuple[float, str]:
    """One run of the module docstring's ``sigterm_hanging_reward_workers`` in ``folder``: (seconds from
    the SIGTERM to torchrun's exit, the run's line about its stop)."""
    fn, mark = folder / "hanging_reward.py", folder / "hanging"
    fn.write_text(HANGING_FUNCTION)
    settings = [
        "data.max_response_length=12",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=2",
        "rollout.n=2",
        "algorithm.adv_estimator=grpo",
        f"reward.custom_function={fn}:compute_score",
        f"reward.reward_kwargs={{mark: {mark}}}",
        "reward.pool_workers=1",
        "reward.timeout_s=600",
    ]
    args = run_overrides(model=assets / "base", prompts=assets / "data" / "train.parquet", out_dir=folder / "run",
                         steps=4, seed=seed, logger="[console,jsonl]", settings=settings)  # fmt: skip
    log = folder / "stderr.txt"
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [*torchrun_command(2), str(ROOT / "train_ppo.py"), *args],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env=run_env(threads),
            start_new_session=True,  # its own process group: the signal reaches the ranks and the workers
        )
    try:
        while not all(Path(f"{mark}.{r}").exists() for r in (0, 1)):
            if proc.poll() is not None:
                raise RuntimeError(f"the run ended before its reward calls hung:\n{log.read_text()[-3000:]}")
            time.sleep(0.02)
        sent = time.perf_counter()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=300)
        waited = time.perf_counter() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    stopped = re.findall(r"stopping: saved step \d+", log.read_text())
    return waited, stopped[-1] if stopped else "no stop line"


def run_rows(repeat: int, seed: int, threads: int) -> Row:
    """``sigterm_hanging_reward_workers``, median of ``repeat`` runs (assets built once)."""

    with tempfile.TemporaryDirectory() as tmp:
        assets = Path(tmp) / "assets"
        repo_script("make_tiny_assets").build_assets(assets, seed)
        times, outcome = [], ""
        for i in range(repeat):
            folder = Path(tmp) / f"run_{i}"
            folder.mkdir()
            waited, outcome = sigterm_hanging_reward_workers(folder, assets, seed, threads)
            times.append(waited)
    return Row("sigterm_hanging_reward_workers", 2, statistics.median(times), TORCHRUN_GRACE_S, outcome)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stuck", type=int, nargs="+", default=[1, 6, 32], help="stuck rows of a turn")
    parser.add_argument("--step-timeout-s", type=float, default=1.0, help="rollout.multi_turn.step_timeout_s")
    parser.add_argument("--repeat", type=int, default=3, help="rollouts per turn row")
    parser.add_argument("--run-repeat", type=int, default=1, help="runs for the SIGTERM row")
    parser.add_argument("--no-run", action="store_true", help="skip the SIGTERM row (2-rank runs)")
    parser.add_argument("--threads", type=int, default=1, help="OpenMP threads per rank of the runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="one JSON object per row instead of a table")
    args = parser.parse_args(argv)
    rows: list[Any] = [turn_step_timeouts(n, args.step_timeout_s, args.repeat) for n in args.stuck]
    if not args.no_run:
        rows.append(run_rows(args.run_repeat, args.seed, args.threads))
    print_rows(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
