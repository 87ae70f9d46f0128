"""The runs of ``offline_sweep``: where a task's files are (``TASKS``) and, in worker processes, one run
trained in process by the trainer's own ``main`` and its final model measured (``run_job``), every run
spread over the workers (``run_all``). offline_sweep.py's module docstring says what the sweep does.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ppo_bench.compare_offline_runs import (
    EVAL_MAX_PROMPT_LENGTH,
    EVAL_SEED,
    LOG_TAIL_LINES,
    METHODS,
    steps_and_loop_time,
)
from ppo_bench.runs import ROOT, CommandError, repo_script


@dataclass(frozen=True)
class Task:
    """Where a task's files are in an asset set, and its answers' length."""

    label: str
    sft: str
    train: str
    val: str
    response_length: int
    """Tokens of a response (``data.max_response_length``, the evaluation's ``max_new_tokens``)."""
    make: str
    """The ``make`` target that builds the files."""


TASKS = {
    "add": Task("two-digit sums", "sft", "offline/train.parquet", "data/val.parquet", 28, "assets"),
    "carry4": Task(
        "four-digit sums",
        "carry4/sft",
        "carry4/offline/train.parquet",
        "carry4/data/val.parquet",
        32,
        "carry4",
    ),
}
EVAL_SAMPLES = 2
"""Responses sampled per validation prompt at temperature 1 for the KL."""

# ----------------------------------------------------------------------------------------------------
# In a worker process: train a run in process, measure its model
# ----------------------------------------------------------------------------------------------------


def init_worker() -> None:
    """A worker: one intra-op thread, the repository's entry points importable, Ctrl-C left to the parent
    (which ends the workers)."""
    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    for path in (str(ROOT), str(ROOT / "scripts")):
        if path not in sys.path:
            sys.path.insert(0, path)


TRAINERS: dict[str, Any] = {}
"""The trainer modules a worker has loaded, by script."""


def trainer(script: str) -> Any:
    if script not in TRAINERS:
        TRAINERS[script] = (
            repo_script("train_dpo") if script.endswith("train_dpo.py") else __import__("train_ppo")
        )
    return TRAINERS[script]


def run_job(job: dict[str, Any], eval_prompts: int, keep_model: bool) -> dict[str, Any]:
    """Train the job's run (unless it is an SFT model's measurement), then measure the model: the job's
    numbers. CommandError with the log's last lines if the trainer fails or stops short."""
    start = time.perf_counter()
    run_dir = Path(job["dir"])
    run_dir.mkdir(parents=True)
    log = run_dir / "train.log"
    result = {k: job[k] for k in ("id", "task", "seed", "method")}
    with log.open("a") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        if job["method"] != "sft":
            code = off_main_thread(trainer(job["script"]).main, job["args"])
            steps, loop_s = steps_and_loop_time(METHODS[job["method"]], run_dir) if code == 0 else (0, 0.0)
            expected = job["steps"]
            if code != 0 or steps != expected or not (run_dir / "hf" / "config.json").is_file():
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])
                raise CommandError(
                    f"{job['id']}: exit code {code}, {steps} of {expected} steps\n{log}:\n{tail}"
                )
            result.update(strength=job["strength"], lr=job["lr"], steps=steps, loop_s=loop_s)
        model = run_dir / "hf" if job["method"] != "sft" else Path(job["sft"])
        result.update(measure(model, job, eval_prompts))
    for handler in [h for h in logging.getLogger("ppo").handlers if getattr(h, "_ppo", False)]:
        logging.getLogger("ppo").removeHandler(handler)  # its stream was the log, now closed
    if job["method"] != "sft" and not keep_model:
        shutil.rmtree(run_dir / "hf")
    result["wall_s"] = time.perf_counter() - start
    return result


def off_main_thread(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on another thread of this process, its exception re-raised here: the trainer then
    installs no stop-signal handlers (it does so on the main thread only), so a worker that the parent ends
    ends at once instead of finishing its run."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    thread = threading.Thread(target=target, name="run")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def measure(model_path: Path, job: dict[str, Any], eval_prompts: int) -> dict[str, float]:
    """Greedy accuracy and KL to the SFT model of ``model_path`` on the task's validation prompts."""
    from ppo import data, model_eval, model_loading
    from ppo.config import FSDPConfig, ModelConfig
    from ppo.distributed import destroy_distributed, init_distributed
    from ppo.model_setup import build_model

    info = init_distributed("cpu")
    try:

        def load(path: Path | str) -> Any:
            return build_model(
                model_loading.load_causal_lm, ModelConfig(path=str(path)), FSDPConfig(), info, trainable=False
            )

        tokenizer = model_loading.load_tokenizer(job["sft"])
        records = data.load_prompts([job["val"]], tokenizer, max_prompt_length=EVAL_MAX_PROMPT_LENGTH)[
            :eval_prompts
        ]
        ref = load(job["sft"])
        m = model_eval.answer_metrics(
            load(model_path),
            tokenizer,
            records,
            info,
            max_new_tokens=TASKS[job["task"]].response_length,
            num_samples=EVAL_SAMPLES,
            seed=EVAL_SEED,
            ref=ref,
        )
    finally:
        destroy_distributed()
    return {"accuracy": m["val/accuracy"], "kl": m["val/kl_to_ref"], "kl_stderr": m["val/kl_to_ref_stderr"]}


def run_all(
    jobs: list[dict[str, Any]],
    *,
    workers: int,
    eval_prompts: int,
    keep_models: bool,
    progress: TextIO,
    run: Callable[[dict[str, Any], int, bool], dict[str, Any]] = run_job,
) -> list[dict[str, Any]]:
    """Every job (``run``: ``run_job``) on ``workers`` processes, a progress line each; the results in the
    jobs' order. A job's error stops the sweep (the jobs not started are dropped, the running ones finish);
    a worker that dies (killed, out of memory) stops it with CommandError instead of a wait for its result."""
    os.environ["OMP_NUM_THREADS"] = "1"
    results = {}
    context = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=init_worker)
    finished = False
    try:
        pending = [(job, pool.submit(run, job, eval_prompts, keep_models)) for job in jobs]
        for i, (job, future) in enumerate(pending, 1):
            try:
                r = future.result()
            except BrokenProcessPool:
                raise CommandError(
                    f"{job['id']}: a worker process ended without its result (killed, or out of memory); "
                    "the runs finished before it are in their folders"
                ) from None
            results[job["id"]] = r
            what = (
                ""
                if job["method"] == "sft"
                else f" {METHODS[job['method']].strength_name}={job['strength']:g} lr {job['lr']:g}"
            )
            print(
                f"[{i}/{len(jobs)}] {job['task']} seed {job['seed']} {job['method']}{what}: accuracy "
                f"{r['accuracy']:.3f}, KL {r['kl']:.3f} ({r['wall_s']:.0f} s)",
                file=progress,
                flush=True,
            )
        finished = True
    finally:
        pool.shutdown(wait=finished, cancel_futures=True)
    return [results[job["id"]] for job in jobs]
