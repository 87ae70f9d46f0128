"""The methods of compare_offline.py and how each run is made: the six methods with their presets,
learning rates and strengths (``METHODS``), a run's torchrun command line (``training_command``), running
it with its log (``run_logged``), reading the steps it took from its own records, and step 2 of the
comparison, the evaluation of every final model under torchrun (``evaluate``). compare_offline.py's module
docstring says what the comparison does and how to run it.
"""

from __future__ import annotations

import gc
import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from ppo_bench.runs import ROOT, CommandError, read_metrics, run_env, torchrun_command

EVAL_SAMPLES = 4
"""Responses sampled per validation prompt at temperature 1 for the KL (and sample accuracy, pass@4)."""
EVAL_MAX_PROMPT_LENGTH = 16
"""Prompt tokens, as the offline data was sampled (``make_offline_data.py --max-prompt-length 16``)."""
EVAL_MAX_NEW_TOKENS = 28
"""Response tokens, as the offline data was sampled and as PPO's validation decodes."""
EVAL_SEED = 0
"""Seed of the evaluation's sampling (the same for every model)."""
LOG_TAIL_LINES = 25
"""Lines of a failed command's log printed with the error."""


@dataclass(frozen=True, kw_only=True)
class Method:
    """One trainer of the comparison: how to launch it and which key sets its strength."""

    name: str
    """``--methods`` name and folder prefix."""
    label: str
    """Its name in the table and the plot."""
    script: str
    """The entry point, relative to the repository root."""
    config: str
    """Its preset (``--config``)."""
    strength_key: str
    """The config key the three runs vary."""
    strength_name: str
    """How the table names the strength."""
    strengths: tuple[float, float, float]
    """The three values of ``strength_key``."""
    lr_key: str
    lr: float
    """The learning rate of all three runs."""
    fixed: tuple[str, ...] = ()
    """Further overrides of every run of the method."""


# One learning rate for all three (5e-5, 40 steps: every run gains at least +0.10), strengths a decade
# apart. How they were chosen (demo assets, SFT 0.654; accuracy @ KL in nats per response):
# - offline KL-PPO at its preset's lr 3e-5 moved little in 40 steps (coef 0.02, 0.1, 0.5: 0.914 @ 0.11,
#   0.914 @ 0.09, 0.890 @ 0.06); at 5e-5 the coefficient spans KL 0.06-0.32.
# - DPO at beta 0.03-0.3 sat at 0.92-0.93 @ 0.28-0.36 (beta barely mattered); beta 10 reaches the low-KL
#   end (0.822 @ 0.026). The preset's lr 1e-4 collapses DPO over 60 steps (configs/dpo_demo.yaml).
# - SimPO's beta scales the mean token log-prob margin, which is small here (chosen and rejected answers
#   differ in a few of ~22 tokens): beta 1-10 gave the same model (0.92 @ 0.38); larger beta lowers the KL
#   until the loss becomes "fix the misordered pairs" and plateaus (beta 1000, 5000, 50000: 0.968 @ 0.190,
#   0.964 @ 0.185, 0.964 @ 0.183). gamma stays at the preset's 0.5.
METHODS = {
    "ppo": Method(
        name="ppo",
        label="offline KL-PPO",
        script="train_ppo.py",
        config="configs/demo_cpu_offline.yaml",
        strength_key="actor.kl_loss_coef",
        strength_name="kl_loss_coef",
        strengths=(0.01, 0.1, 1.0),
        lr_key="actor.optim.lr",
        lr=5e-5,
    ),
    "dpo": Method(
        name="dpo",
        label="DPO",
        script="scripts/train_dpo.py",
        config="configs/dpo_demo.yaml",
        strength_key="loss.beta",
        strength_name="β",
        strengths=(0.1, 1.0, 10.0),
        lr_key="optim.lr",
        lr=5e-5,
        fixed=("loss.type=dpo",),
    ),
    "sppo": Method(
        name="sppo",
        label="offline SPPO",
        script="train_ppo.py",
        config="configs/demo_cpu_sppo_offline.yaml",
        strength_key="actor.sppo_eta",
        strength_name="eta",
        strengths=(0.3, 1.0, 3.0),
        lr_key="actor.optim.lr",
        lr=5e-5,
    ),
    "simpo": Method(
        name="simpo",
        label="SimPO",
        script="scripts/train_dpo.py",
        config="configs/dpo_demo.yaml",
        strength_key="loss.beta",
        strength_name="β",
        strengths=(5.0, 50.0, 500.0),
        lr_key="optim.lr",
        lr=5e-5,
        fixed=("loss.type=simpo", "loss.gamma=0.5"),
    ),
    # IPO as TRL's loss_type="ipo" (log-ratios as token means): the margin's target 1/(2 beta) per token, so
    # beta 0.1 asks for 5 nats a token (far from the SFT model) and beta 10 for 0.05.
    "ipo": Method(
        name="ipo",
        label="IPO",
        script="scripts/train_dpo.py",
        config="configs/dpo_demo.yaml",
        strength_key="loss.beta",
        strength_name="β",
        strengths=(0.1, 1.0, 10.0),
        lr_key="optim.lr",
        lr=5e-5,
        fixed=("loss.type=ipo",),
    ),
    # KTO on the same pairs (chosen desirable, rejected undesirable, both weighted 1), its reference point
    # the batch's KL estimate.
    "kto": Method(
        name="kto",
        label="KTO",
        script="scripts/train_dpo.py",
        config="configs/dpo_demo.yaml",
        strength_key="loss.beta",
        strength_name="β",
        strengths=(0.1, 1.0, 10.0),
        lr_key="optim.lr",
        lr=5e-5,
        fixed=("loss.type=kto",),
    ),
}
"""The trainers, in table order (``make compare-offline`` runs the first four by default;
``ppo_bench.offline_sweep`` all)."""


# ----------------------------------------------------------------------------------------------------
# 1. Training
# ----------------------------------------------------------------------------------------------------


def run_id(method: Method, strength: float) -> str:
    """The run's folder name: ``dpo_0.1``."""
    return f"{method.name}_{strength:g}"


def training_command(
    method: Method, strength: float, *, sft: Path, train_file: Path, steps: int, nproc: int, out_dir: Path
) -> list[str]:
    """The torchrun command line of one run (paths absolute; run from the repository root)."""
    return [
        *torchrun_command(nproc),
        str(ROOT / method.script),
        *training_args(
            method, strength, method.lr, sft=sft, train_file=train_file, steps=steps, out_dir=out_dir
        ),
    ]


def training_args(
    method: Method,
    strength: float,
    lr: float,
    *,
    sft: Path,
    train_file: Path,
    steps: int,
    out_dir: Path,
    extra: tuple[str, ...] = (),
) -> list[str]:
    """The command line of one run after the script's path: its preset, the comparison's keys, ``extra``,
    the method's fixed keys, then its strength and learning rate (last, so they win)."""
    common = [
        f"model.path={sft}",
        f"data.train_files=[{train_file}]",
        "data.val_files=[]",
        f"trainer.total_training_steps={steps}",
        f"trainer.output_dir={out_dir}",
        "trainer.logger=[console,jsonl]",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.resume_mode=disable",
    ]
    if method.script == "train_ppo.py":
        specific = ["trainer.val_before_train=false", "trainer.save_hf_on_end=true"]
    else:  # the DPO family: no final answer evaluation (done in step 2) and no time cap
        specific = ["data.eval_prompt_files=[]", "trainer.max_time_s=0"]
    return [
        "--config",
        str(ROOT / method.config),
        *common,
        *specific,
        *extra,
        *method.fixed,
        f"{method.strength_key}={strength:g}",
        f"{method.lr_key}={lr:g}",
    ]


def run_logged(cmd: list[str], log: Path) -> float:
    """Run ``cmd`` from the repository root with one intra-op thread a rank, its output in ``log``;
    the wall seconds. CommandError with the command and the log's last lines if it fails."""
    start = time.perf_counter()
    with log.open("w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=run_env(1)).returncode
    wall_s = time.perf_counter() - start
    if code != 0:
        tail = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        raise CommandError(
            f"failed (exit code {code}) after {wall_s:.0f} s: {' '.join(cmd)}\n"
            f"last lines of {log}:\n" + "\n".join(tail)
        )
    return wall_s


def steps_and_loop_time(method: Method, out_dir: Path) -> tuple[int, float]:
    """Optimizer steps a finished run took and the seconds its steps took, from its own records."""
    rows = read_metrics(out_dir)
    if method.script == "train_ppo.py":
        steps = [r for r in rows if "timing_s/step" in r]
        return (int(steps[-1]["step"]) if steps else 0), sum(r["timing_s/step"] for r in steps)
    final = json.loads((out_dir / "metrics.json").read_text())  # the stage's, beside its hf/ folder
    return int(final["dpo_steps"]), float(final["dpo_train_time_s"])


# ----------------------------------------------------------------------------------------------------
# 2. Evaluation (under torchrun: every rank runs it)
# ----------------------------------------------------------------------------------------------------


def evaluate(out: Path) -> int:
    """Measure the SFT model and every run's final model listed in ``out/plan.json``; rank 0 writes
    ``out/eval.json``: ``{"sft": metrics, run id: metrics}`` (``ppo.model_eval.answer_metrics``)."""
    import torch

    from ppo import data, model_eval, model_loading, runner
    from ppo.config import FSDPConfig, ModelConfig
    from ppo.distributed import destroy_distributed, init_distributed, main_rank_logs, setup_logging
    from ppo.model_setup import build_model

    plan = json.loads((out / "plan.json").read_text())
    info = init_distributed("auto")
    setup_logging(info.is_main)
    runner.quiet_other_ranks(info)
    try:

        def load(path: str) -> torch.nn.Module:
            return build_model(
                model_loading.load_causal_lm, ModelConfig(path=path), FSDPConfig(), info, trainable=False
            )

        tokenizer = model_loading.load_tokenizer(plan["sft"])  # every run saves the SFT model's tokenizer
        with main_rank_logs(info):
            records = data.load_prompts(
                [plan["val_file"]], tokenizer, max_prompt_length=EVAL_MAX_PROMPT_LENGTH
            )
        ref = load(plan["sft"])
        measure = dict(max_new_tokens=EVAL_MAX_NEW_TOKENS, num_samples=EVAL_SAMPLES, seed=EVAL_SEED, ref=ref)
        results = {}
        for name, path in [("sft", plan["sft"])] + [(r["id"], r["model"]) for r in plan["runs"]]:
            start = time.perf_counter()
            model = ref if name == "sft" else load(path)
            results[name] = model_eval.answer_metrics(model, tokenizer, records, info, **measure)
            results[name]["eval_s"] = time.perf_counter() - start
            if info.is_main:
                m = results[name]
                print(
                    f"evaluated {name}: accuracy {m['val/accuracy']:.3f}, KL {m['val/kl_to_ref']:.3f}",
                    flush=True,
                )
            del model
            gc.collect()
        if info.is_main:
            (out / "eval.json").write_text(json.dumps(results, indent=1))
    finally:
        destroy_distributed()
    return 0
