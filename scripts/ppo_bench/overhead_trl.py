"""TRL's ``PPOTrainer`` beside ours, for overhead.py: TRL imported from where ``--trl-path`` says
(nothing of TRL is in the project's dependencies), then run in this process on the benchmark's models,
prompts and shapes, with a clock at the end of each of its steps. overhead.py's module docstring says
what is compared and how.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time
from pathlib import Path
from typing import Any

from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification


def import_trl(args: argparse.Namespace) -> tuple[Any, str | None]:
    """TRL's ``experimental.ppo`` module and its version, or None and why not."""
    if args.trl == "no":
        return None, "--trl no"
    if args.trl_path:
        sys.path.insert(0, args.trl_path)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    try:
        import trl
        import trl.experimental.ppo as trl_ppo
    except Exception as err:  # not installed, or a version that does not import beside ours
        if args.trl == "yes":
            raise
        return None, f"{type(err).__name__}: {err}"
    return trl_ppo, trl.__version__


def run_trl(
    trl_ppo: Any,
    args: argparse.Namespace,
    paths: dict[str, Path],
    out_dir: Path,
    *,
    num_mini_batches: int,
    freeze_gc: bool,
) -> tuple[list[float], list[float]]:
    """TRL's PPOTrainer on the same models, prompts and shapes; per-step CPU and wall seconds.

    Same work as ours: ``per_device_train_batch_size`` = all prompts, ``num_mini_batches`` (one
    micro-batch each), ``num_ppo_epochs``, no stop token (every response ``response_len`` tokens), GAE
    with the k1 KL in the reward; its critic is a copy of the policy's backbone with a score head.
    """
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    from ppo import data

    tokenizer = AutoTokenizer.from_pretrained(paths["policy"])
    tokenizer.padding_side = "left"
    records = data.load_prompts(paths["prompts"], tokenizer, max_prompt_length=32, require_ground_truth=False)
    dataset = Dataset.from_dict({"input_ids": [r.input_ids for r in records]})
    marks: list[tuple[float, float]] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_: Any, **__: Any) -> None:
            marks.append((time.process_time(), time.perf_counter()))

    config = trl_ppo.PPOConfig(
        output_dir=str(out_dir),
        per_device_train_batch_size=args.num_prompts,
        gradient_accumulation_steps=1,
        num_mini_batches=num_mini_batches,
        num_ppo_epochs=args.epochs,
        response_length=args.response_len,
        total_episodes=args.num_prompts * args.steps,
        stop_token=None,
        local_rollout_forward_batch_size=args.num_prompts,
        num_sample_generations=0,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        learning_rate=1e-6,
        seed=args.seed,
        disable_tqdm=True,
    )
    with contextlib.redirect_stdout(sys.stderr):  # TRL prints every step's metrics
        trainer = trl_ppo.PPOTrainer(
            args=config,
            processing_class=tokenizer,
            model=AutoModelForCausalLM.from_pretrained(paths["policy"]),
            ref_model=AutoModelForCausalLM.from_pretrained(paths["policy"]),
            reward_model=AutoModelForSequenceClassification.from_pretrained(paths["reward"], num_labels=1),
            value_model=AutoModelForSequenceClassification.from_pretrained(paths["policy"], num_labels=1),
            train_dataset=dataset,
            callbacks=[Clock()],
        )
        if freeze_gc:
            gc.collect()
            gc.freeze()  # what exists now is never scanned again: TRL's per-step gc.collect() is cheap
        try:
            trainer.train()
        finally:
            if freeze_gc:
                gc.unfreeze()
    kept = list(zip(marks, marks[1:], strict=False))[1:]  # the first two steps are not counted
    return [b[0] - a[0] for a, b in kept], [b[1] - a[1] for a, b in kept]
