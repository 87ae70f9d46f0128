"""Supervised fine-tuning of a causal LM on prompt/answer demonstrations (loss on answer tokens only).

    torchrun --nproc_per_node=2 scripts/train_sft.py --config configs/sft_demo.yaml [section.key=value ...]
    python scripts/train_sft.py --config configs/sft_demo.yaml --print-config [--world-size 8]

Reads Parquet rows with ``prompt`` + ``answer`` (or ``messages``), packs each rank's share of a global
batch into padding-free micro-batches, and minimizes the token-mean cross-entropy of the answer tokens
over the whole global batch. FSDP2, AdamW with warm-up and cosine decay, gradient clipping; periodic
``val/loss``; metrics to ``metrics.jsonl`` and TensorBoard in ``trainer.output_dir``; checkpoints every
``trainer.save_freq`` steps and on SIGTERM/Ctrl-C, resumed with ``trainer.resume_mode=auto``. At the end the
model is saved with ``save_pretrained`` (``trainer.save_path``, the PPO actor's ``model.path``) and,
when ``data.eval_prompt_files`` is set, its greedy and sampled answers are scored by the rule reward:
``sft_val_accuracy`` and ``sft_sample_accuracy`` go to ``metrics.json`` beside the saved folder
(``trainer.metrics_prefix`` names them otherwise: ``teacher_val_accuracy``).
"""

from __future__ import annotations

from ppo import cli
from ppo.config import SFTConfig

if __name__ == "__main__":  # --help and --print-config answer here, before torch and transformers load
    cli.answer_early(None, __doc__, SFTConfig)

# The imports below follow the early answer on purpose:
# ruff: noqa: E402
import functools
import logging

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

import ppo_kernels
from ppo import (
    data,
    model_eval,
    model_loading,
    model_setup,
    models,
    run_folder,
    runner,
    stage_data,
    stage_loop,
)
from ppo.distributed import DistInfo, all_reduce_scalars, exit_process, rank_slice
from ppo.optim import with_optimizer
from ppo.packing import (
    DUMMY_SEQUENCE,
    PackedSequences,
    pack_sequences,
    plan_eval_micro_batches,
    plan_micro_batches,
)

logger = logging.getLogger("ppo")

NUM_EVAL_SAMPLES = 4
"""Answers sampled per evaluation prompt at temperature 1 (PPO's rollout setting) for
``sft_sample_accuracy`` (mean over samples) and ``sft_pass_at_k`` (any of them right)."""
EVAL_GENERATE_BATCH = 256
"""Prompts per ``generate`` call on one rank during the final evaluation."""
PROGRESS_KEYS = {"train/loss": "loss", "val/loss": "val_loss", "train/lr": "lr", "train/grad_norm": "gnorm"}


def main(argv: list[str] | None = None) -> int:
    return runner.main(argv, SFTConfig, train, __doc__)


def train(cfg: SFTConfig, info: DistInfo) -> None:
    """The SFT run: data, model, the loop (resumable), the saved model and its final evaluation."""
    start = stage_loop.start_stage(
        cfg,
        info,
        functools.partial(
            stage_data.load_sft_examples,
            max_length=cfg.data.max_length,
            apply_chat_template=cfg.data.apply_chat_template,
        ),
    )
    val_examples = start.val or []
    model = model_setup.build_model(model_loading.load_causal_lm, cfg.model, cfg.fsdp, info)
    trained = with_optimizer(model, cfg.optim, start.num_steps)
    logger.info(
        "SFT: world size %d on %s; %d train examples (%d steps of %d), %d val examples; %.2fM parameters",
        info.world_size,
        info.device,
        len(start.train),
        start.num_steps,
        cfg.data.train_batch_size,
        len(val_examples),
        models.count_parameters(model) / 1e6,
    )

    def sft_step(examples: list[stage_data.SFTExample]) -> tuple[dict[str, float], float]:
        """Token-mean cross-entropy of the answer tokens of the whole global batch (its gradient)."""
        groups = plan_micro_batches(
            [len(ex.input_ids) for ex in examples],
            use_dynamic_bsz=cfg.data.use_dynamic_bsz,
            max_tokens=cfg.data.max_token_len_per_gpu,
            micro_batch_size=cfg.data.micro_batch_size_per_gpu,
        )
        answer_tokens, tokens = all_reduce_scalars(
            [
                float(sum(sum(ex.loss_mask) for ex in examples)),
                float(sum(len(ex.input_ids) for ex in examples)),
            ],
            "sum",
        )
        loss_sum = 0.0
        for group in groups:
            nll = answer_nll_sum(model, [examples[i] for i in group], info.device)
            (nll / answer_tokens).backward()
            loss_sum += nll.item()
        (loss_sum,) = all_reduce_scalars([loss_sum], "sum")
        return {"train/loss": loss_sum / answer_tokens, "train/num_answer_tokens": answer_tokens}, tokens

    result = stage_loop.train_stage(
        cfg,
        info,
        start.out_dir,
        trained=trained,
        loader=start.loader,
        num_steps=start.num_steps,
        step=sft_step,
        validate=(lambda: {"val/loss": validation_loss(model, val_examples, cfg, info)})
        if val_examples
        else None,
        progress_keys=PROGRESS_KEYS,
    )
    if result.stopped:
        result.metrics_logger.close()
        return

    # Save the model (the PPO actor's starting point), then score its answers.
    saved = models.save_model(model, start.tokenizer, run_folder.stage_save_path(cfg), info)
    final = {"steps": result.steps, "train_time_s": round(result.train_time_s, 1)}
    if "val/loss" in result.metrics:
        final["val_loss"] = round(result.metrics["val/loss"], 4)
    if cfg.data.eval_prompt_files:
        answers = evaluate_answers(model, start.tokenizer, cfg, info)
        result.metrics_logger.log(result.steps, answers)
        final.update(
            val_accuracy=round(answers["val/accuracy"], 4),
            sample_accuracy=round(answers["val/sample_accuracy"], 4),
            pass_at_k=round(answers["val/pass_at_k"], 4),
            eval_prompts=int(answers["val/num_prompts"]),
            eval_samples_per_prompt=NUM_EVAL_SAMPLES,
        )
    result.metrics_logger.close()
    prefix = cfg.trainer.metrics_prefix
    runner.write_final_metrics(saved.parent, info, {f"{prefix}_{k}": v for k, v in final.items()})


def answer_labels(packed: PackedSequences, examples: list[stage_data.SFTExample]) -> torch.Tensor:
    """Next-token labels that are -100 except where the next token is an answer token: ``[T]``.

    ``labels[t] = input_ids[t + 1]`` when token ``t + 1`` is in the same sequence and its loss mask
    is True, so prompt tokens (and the step from one packed sequence into the next) carry no loss.
    """
    labels = ppo_kernels.next_token_labels(packed.input_ids, packed.cu_seqlens)
    trained = torch.tensor(
        [m for ex in examples for m in ex.loss_mask], dtype=torch.bool, device=labels.device
    )
    next_trained = torch.zeros_like(trained)
    next_trained[:-1] = trained[1:]
    return labels.masked_fill(~next_trained, ppo_kernels.IGNORE_INDEX)


def answer_nll_sum(
    model: nn.Module, examples: list[stage_data.SFTExample], device: torch.device
) -> torch.Tensor:
    """Summed negative log-likelihood of the answer tokens of ``examples``, packed into one row.

    A scalar (fp32); the log-softmax runs in fp32 whatever the compute dtype. Divide by the global
    number of answer tokens for the token-mean.
    """
    packed = pack_sequences([ex.input_ids for ex in examples], device)
    labels = answer_labels(packed, examples)
    logits = models.causal_lm_logits(model, packed.input_ids, packed.position_ids, packed.offsets)
    logprobs, _ = ppo_kernels.logprobs_from_logits(logits, labels, compute_entropy=False)
    return -logprobs.sum()


@torch.no_grad()
def validation_loss(
    model: nn.Module, examples: list[stage_data.SFTExample], cfg: SFTConfig, info: DistInfo
) -> float:
    """Token-mean answer loss over all held-out examples (every rank scores its share)."""
    mine = rank_slice(examples, info)
    nll = tokens = 0.0
    groups = plan_eval_micro_batches(
        [len(ex.input_ids) for ex in mine],
        use_dynamic_bsz=cfg.data.use_dynamic_bsz,
        max_tokens=cfg.data.max_token_len_per_gpu,
        micro_batch_size=cfg.data.micro_batch_size_per_gpu,
    )
    for group in groups:
        if not group:  # this rank is out of examples, but the forward is a collective: join it
            dummy = stage_data.SFTExample(input_ids=DUMMY_SEQUENCE, loss_mask=[False])
            answer_nll_sum(model, [dummy], info.device)
            continue
        batch = [mine[i] for i in group]
        nll += answer_nll_sum(model, batch, info.device).item()
        tokens += sum(sum(ex.loss_mask) for ex in batch)
    nll, tokens = all_reduce_scalars([nll, tokens], "sum")
    return nll / max(tokens, 1.0)


def evaluate_answers(
    model: nn.Module, tokenizer: PreTrainedTokenizerBase, cfg: SFTConfig, info: DistInfo
) -> dict[str, float]:
    """Rule-reward accuracy of greedy answers, and of ``NUM_EVAL_SAMPLES`` samples at temperature 1
    (``ppo.model_eval.answer_metrics``), each answer cut where the longest prompt reaches
    ``data.max_length``.

    ``val/accuracy``: greedy answers right; ``val/sample_accuracy``: the chance that one sample is right
    (what PPO's rollouts start from); ``val/pass_at_k``: prompts with a right one among the samples.
    """
    records = data.load_prompts(
        cfg.data.eval_prompt_files,
        tokenizer,
        max_prompt_length=cfg.data.max_length,
        apply_chat_template=cfg.data.apply_chat_template,
    )
    mine = rank_slice(records, info)
    longest = int(all_reduce_scalars([max((len(r.input_ids) for r in mine), default=0)], "max")[0])
    return model_eval.answer_metrics(
        model,
        tokenizer,
        records,
        info,
        max_new_tokens=cfg.data.max_length - longest,
        num_samples=NUM_EVAL_SAMPLES,
        seed=cfg.trainer.seed,
        micro_batch_size=EVAL_GENERATE_BATCH,
    )


if __name__ == "__main__":
    exit_process(main())
