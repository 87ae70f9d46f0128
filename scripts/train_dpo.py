"""Preference optimization of a causal LM on offline pairs, without sampling: DPO, cDPO, IPO, SimPO, KTO.

    torchrun --nproc_per_node=2 scripts/train_dpo.py --config configs/dpo_demo.yaml [section.key=value ...]
    torchrun --nproc_per_node=2 scripts/train_dpo.py --config configs/dpo_demo.yaml loss.type=simpo
    python scripts/train_dpo.py --config configs/dpo_demo.yaml --print-config [--world-size 8]

Reads the files offline PPO reads (``rollout.source=dataset``, ``ppo.offline``): preference files
(``prompt``, ``chosen``, ``rejected``) or ranked groups (``responses`` with ``ranks`` or ``scores``), each
group expanded to pairs of its best response against worse ones (``data.pairs``; groups that all tie
are skipped and counted). Prompts are tokenized as the PPO trainer tokenizes them
(``data.max_prompt_length``), responses as offline PPO's (text, then EOS; ``data.max_response_length``).

Each step takes ``data.train_batch_size`` pairs over all ranks. Micro-batches hold whole pairs (both
sequences packed into one padding-free row), cut by ``data.max_token_len_per_gpu`` with the count agreed
across ranks. First the reference's log-probs of the step's pairs, without gradients (``loss.type=simpo``
is reference-free and loads no reference; under LoRA without ``ref.model_path`` the reference is the
policy with its adapters off, nothing else loaded); then the policy's forward and backward of each
micro-batch. The loss (``ppo.algorithms.preference``) is summed over pairs and divided by the step's
pair count over all ranks, plus ``loss.nll_coef`` times the chosen responses' token-mean NLL, so the
update does not depend on the number of ranks or the micro-batch budget.

Metrics, with TRL's names: ``train/loss``, ``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``,
``rewards/accuracies`` (implicit rewards ``β (log π − log π_ref)`` of the sequences; SimPO's
``β · mean token log π``), ``logps/chosen``, ``logps/rejected`` (summed log-probs), ``train/kl`` (mean
sequence log-ratio to the reference), ``train/nll_loss``, ``train/kto_kl`` (KTO's reference point), and
the same on ``data.val_files`` as ``val/*`` every ``trainer.test_freq`` steps. Checkpoints, exact resume,
stop signals and the time cap are ``ppo.stage_loop``'s. At the end the policy is saved with
``save_pretrained`` (``trainer.save_path``; under LoRA merged or as adapters, ``lora.save_merged``) and,
when ``data.eval_prompt_files`` is set, its greedy answers are scored by the rule reward:
``dpo_val_accuracy`` goes to ``metrics.json`` beside the saved folder.
"""

from __future__ import annotations

from ppo import cli
from ppo.config import DPOConfig, PreferenceLossConfig

if __name__ == "__main__":  # --help and --print-config answer here, before torch and transformers load
    cli.answer_early(None, __doc__, DPOConfig)

# The imports below follow the early answer on purpose:
# ruff: noqa: E402
import functools
import logging
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from ppo import (
    algorithms,
    data,
    lora,
    model_eval,
    model_loading,
    model_setup,
    models,
    packed_forward,
    run_folder,
    runner,
    sharding,
    stage_data,
    stage_loop,
)
from ppo.distributed import DistInfo, all_reduce_scalars, exit_process, rank_slice
from ppo.optim import with_optimizer
from ppo.packing import DUMMY_SEQUENCE, pack, plan_eval_micro_batches, plan_micro_batches

logger = logging.getLogger("ppo")

EVAL_GENERATE_BATCH = 256
"""Prompts per ``generate`` call on one rank during the final evaluation."""
PROGRESS_KEYS = {
    "train/loss": "loss",
    "rewards/accuracies": "acc",
    "rewards/margins": "margin",
    "val/loss": "val_loss",
    "val/rewards/accuracies": "val_acc",
    "train/lr": "lr",
    "train/grad_norm": "gnorm",
}
SUM_KEYS = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
    "kl",
    "nll",
    "chosen_tokens",
    "pairs",
)
"""What a pass over pairs sums on each rank and reduces once (``pair_sums``, ``pair_metrics``)."""

Sequence = tuple[list[int], list[int]]
"""A prompt's tokens and a response's tokens (EOS included)."""


def main(argv: list[str] | None = None) -> int:
    return runner.main(argv, DPOConfig, train, __doc__)


def train(cfg: DPOConfig, info: DistInfo) -> None:
    """The DPO run: pairs, policy and reference, the loop (resumable), the saved model, its accuracy."""
    start = stage_loop.start_stage(
        cfg,
        info,
        functools.partial(
            stage_data.load_dpo_pairs,
            pairs=cfg.data.pairs,
            max_prompt_length=cfg.data.max_prompt_length,
            max_response_length=cfg.data.max_response_length,
            apply_chat_template=cfg.data.apply_chat_template,
        ),
        examples=lambda loaded: loaded.pairs,
    )
    val_pairs = start.val.pairs if start.val is not None else []
    model = model_setup.build_model(
        model_loading.load_causal_lm, cfg.model, cfg.fsdp, info, lora_cfg=cfg.lora, lora_key="lora"
    )
    ref = load_reference(cfg, info, model)
    trained = with_optimizer(model, cfg.optim, start.num_steps)
    logger.info(
        "%s: world size %d on %s; %d train pairs (%s) from %d groups, %d tied groups skipped; %d val pairs; "
        "%d steps of %d pairs; reference: %s; %.2fM parameters, %.2fM trained",
        cfg.loss.type,
        info.world_size,
        info.device,
        len(start.train.pairs),
        cfg.data.pairs,
        start.train.num_groups,
        start.train.num_tied_groups,
        len(val_pairs),
        start.num_steps,
        cfg.data.train_batch_size,
        describe_reference(cfg, ref, model),
        models.count_parameters(model) / 1e6,
        models.count_parameters(model, trainable_only=True) / 1e6,
    )
    budget = dict(
        use_dynamic_bsz=cfg.data.use_dynamic_bsz,
        max_tokens=cfg.data.max_token_len_per_gpu,
        micro_batch_size=cfg.data.micro_batch_size_per_gpu,
    )

    def dpo_step(pairs: list[stage_data.PreferencePair]) -> tuple[dict[str, float], float]:
        """The loss of the step's pairs over all ranks, its gradient; the metrics reduced once."""
        groups = plan_micro_batches([pair_length(p) for p in pairs], **budget)
        num_pairs, chosen_tokens, tokens = all_reduce_scalars(
            [
                float(len(pairs)),
                float(sum(len(p.chosen_ids) - p.prompt_length for p in pairs)),
                float(sum(pair_length(p) for p in pairs)),
            ],
            "sum",
        )
        # 1. The reference's log-probs of every pair (and KTO's reference point), without gradients.
        kl_seqs = kl_sequences(pairs) if cfg.loss.type == "kto" else []
        refs: list[PairLogps | None] = []
        kl_sum = 0.0
        with torch.no_grad():
            for group in groups:
                batch = [pairs[i] for i in group]
                extra = [kl_seqs[i] for i in group] if kl_seqs else []
                ref_logps, ref_kl = (
                    scored(ref, batch, extra, info.device) if ref is not None else (None, None)
                )
                refs.append(ref_logps)
                if kl_seqs:
                    policy_kl, _ = sequence_logps(model, extra, info.device)
                    kl_sum += (policy_kl - ref_kl).sum().item()
        if ref is not None and ref is not model:
            sharding.release(ref)  # a frozen model's root stays gathered after a forward
        kl = all_reduce_scalars([kl_sum], "sum")[0] / num_pairs if kl_seqs else 0.0

        # 2. The policy's forward and backward, micro-batch by micro-batch.
        sums = dict.fromkeys(SUM_KEYS, 0.0)
        for group, ref_logps in zip(groups, refs, strict=True):
            policy = pair_logps(model, [pairs[i] for i in group], info.device)
            losses, chosen_rewards, rejected_rewards = pair_losses(cfg.loss, policy, ref_logps, kl)
            loss = losses.sum() / num_pairs
            if cfg.loss.nll_coef > 0:
                loss = loss - cfg.loss.nll_coef * policy.chosen.sum() / chosen_tokens
            loss.backward()
            add_sums(sums, losses, chosen_rewards, rejected_rewards, policy, ref_logps)
        metrics = pair_metrics(sums, cfg.loss, prefix="train/", has_ref=ref is not None)
        if cfg.loss.type == "kto":
            metrics["train/kto_kl"] = max(kl, 0.0)
        return metrics, tokens

    result = stage_loop.train_stage(
        cfg,
        info,
        start.out_dir,
        trained=trained,
        loader=start.loader,
        num_steps=start.num_steps,
        step=dpo_step,
        validate=(lambda: evaluate_pairs(model, ref, val_pairs, cfg, info)) if val_pairs else None,
        progress_keys=PROGRESS_KEYS,
    )
    if result.stopped:
        result.metrics_logger.close()
        return

    # Save the policy, then score its answers.
    path = run_folder.stage_save_path(cfg)
    if lora.uses_lora(cfg.lora):
        lora.save_hf(model, start.tokenizer, path, is_main=info.is_main, merged=cfg.lora.save_merged)
        logger.info("saved %s (%s)", path, "merged" if cfg.lora.save_merged else "adapters")
    else:
        models.save_model(model, start.tokenizer, path, info)
    final: dict[str, object] = {
        "dpo_loss_type": cfg.loss.type,
        "dpo_steps": result.steps,
        "dpo_train_time_s": round(result.train_time_s, 1),
        "dpo_train_pairs": len(start.train.pairs),
        "dpo_train_groups": start.train.num_groups,
        "dpo_train_tied_groups": start.train.num_tied_groups,
    }
    if start.val is not None and "val/loss" in result.metrics:
        final.update(
            dpo_val_tied_groups=start.val.num_tied_groups,
            dpo_val_loss=round(result.metrics["val/loss"], 4),
            dpo_val_rewards_accuracy=round(result.metrics["val/rewards/accuracies"], 4),
            dpo_val_rewards_margin=round(result.metrics["val/rewards/margins"], 4),
        )
    if cfg.data.eval_prompt_files:
        answers = evaluate_answers(model, start.tokenizer, cfg, info)
        result.metrics_logger.log(result.steps, answers)
        final.update(
            dpo_val_accuracy=round(answers["val/accuracy"], 4),
            dpo_eval_prompts=int(answers["val/num_prompts"]),
        )
    result.metrics_logger.close()
    runner.write_final_metrics(path.parent, info, final)


# ----------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------


def load_reference(cfg: DPOConfig, info: DistInfo, model: nn.Module) -> nn.Module | None:
    """The frozen reference policy: None for SimPO (reference-free: nothing is loaded); ``model`` itself
    under LoRA without ``ref.model_path`` (its reference forwards run with the adapters off, ``scored``);
    else ``ref.model_path`` (default ``model.path``) loaded, sharded by ``ref.fsdp`` and frozen."""
    if cfg.loss.type == "simpo":
        if cfg.ref.model_path is not None:
            logger.warning("ref.model_path=%s is not loaded: simpo is reference-free", cfg.ref.model_path)
        return None
    return model_setup.frozen_reference(cfg.model, cfg.ref, cfg.lora, info, model)


def describe_reference(cfg: DPOConfig, ref: nn.Module | None, model: nn.Module) -> str:
    """What the reference is, for the start-up log line."""
    if ref is None:
        return "none (simpo is reference-free)"
    if ref is model:
        return "the policy with its LoRA adapters off (no model loaded)"
    return str(cfg.ref.model_path or cfg.model.path)


# ----------------------------------------------------------------------------------------------------
# Log-probs of pairs
# ----------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class PairLogps:
    """One model's sequence log-probs of ``P`` pairs, each ``[P]`` fp32."""

    chosen: torch.Tensor
    """``log π(y_w | x)``: summed over the chosen response's tokens, EOS included."""
    rejected: torch.Tensor
    """``log π(y_l | x)``."""
    chosen_tokens: torch.Tensor
    """``|y_w|``: tokens of the chosen response."""
    rejected_tokens: torch.Tensor
    """``|y_l|``."""


def pair_length(pair: stage_data.PreferencePair) -> int:
    """Tokens a pair takes in a packed micro-batch (its chosen and its rejected sequence)."""
    return len(pair.chosen_ids) + len(pair.rejected_ids)


def pair_sequences(pairs: list[stage_data.PreferencePair]) -> list[Sequence]:
    """``2P`` (prompt, response) sequences: chosen_0, rejected_0, chosen_1, ..."""
    return [
        (p.chosen_ids[: p.prompt_length], ids[p.prompt_length :])
        for p in pairs
        for ids in (p.chosen_ids, p.rejected_ids)
    ]


def sequence_logps(
    model: nn.Module, seqs: list[Sequence], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed response log-probs ``[B]`` (fp32, with gradients if enabled) and response lengths ``[B]``
    of ``B`` sequences, from one packed padding-free forward (``packed_forward.logprobs``)."""
    lengths = [len(response) for _, response in seqs]
    responses = torch.zeros(len(seqs), max(lengths), dtype=torch.long)
    for b, (_, response) in enumerate(seqs):
        responses[b, : len(response)] = torch.tensor(response, dtype=torch.long)
    mask = torch.arange(responses.shape[1])[None, :] < torch.tensor(lengths)[:, None]
    packed = pack(
        [torch.tensor(prompt, dtype=torch.long) for prompt, _ in seqs], responses.to(device), mask.to(device)
    )
    logprobs, _ = packed_forward.logprobs(model, packed, temperature=1.0)  # [B, R], 0 at padding
    return logprobs.sum(-1), mask.sum(-1).to(device=device, dtype=torch.float32)


def pair_logps(model: nn.Module, pairs: list[stage_data.PreferencePair], device: torch.device) -> PairLogps:
    """``model``'s log-probs of the pairs' chosen and rejected responses, both in one forward."""
    return as_pairs(*sequence_logps(model, pair_sequences(pairs), device), len(pairs))


def as_pairs(sums: torch.Tensor, lengths: torch.Tensor, num_pairs: int) -> PairLogps:
    """The first ``2 * num_pairs`` outputs of ``sequence_logps``, in ``pair_sequences``' order."""
    n = 2 * num_pairs
    return PairLogps(
        chosen=sums[0:n:2], rejected=sums[1:n:2], chosen_tokens=lengths[0:n:2], rejected_tokens=lengths[1:n:2]
    )


def scored(
    model: nn.Module, pairs: list[stage_data.PreferencePair], extra: list[Sequence], device: torch.device
) -> tuple[PairLogps, torch.Tensor]:
    """A no-gradient forward of the pairs and of ``extra`` sequences (KTO's mismatched ones) together;
    with LoRA adapters off, so a LoRA policy scores as the reference (a no-op for a plain model).
    Returns the pairs' log-probs and the summed log-probs ``[E]`` of the extra sequences."""
    with torch.no_grad(), lora.adapters_disabled(model):
        sums, lengths = sequence_logps(model, pair_sequences(pairs) + extra, device)
    return as_pairs(sums, lengths, len(pairs)), sums[2 * len(pairs) :]


def kl_sequences(pairs: list[stage_data.PreferencePair]) -> list[Sequence]:
    """KTO's mismatched sequences, one per pair: pair ``i``'s prompt with the chosen response of pair
    ``i ^ 1`` (0 with 1, 2 with 3, ...; the last of an odd count with the one before). The mean log-ratio
    of such unrelated responses estimates ``KL(π || π_ref)`` (TRL's estimate). Partners are this rank's
    consecutive pairs, so with an even number of pairs per rank the estimate does not depend on the
    number of ranks or on the micro-batches."""
    n = len(pairs)
    out = []
    for i, p in enumerate(pairs):
        j = i ^ 1 if (i ^ 1) < n else max(i - 1, 0)
        other = pairs[j]
        out.append((p.chosen_ids[: p.prompt_length], other.chosen_ids[other.prompt_length :]))
    return out


# ----------------------------------------------------------------------------------------------------
# Losses and metrics
# ----------------------------------------------------------------------------------------------------


def pair_losses(
    loss_cfg: PreferenceLossConfig, policy: PairLogps, ref: PairLogps | None, kl: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses ``[P]`` and the implicit rewards ``[P]`` of the chosen and rejected responses
    (detached): ``β (log π − log π_ref)``, for SimPO ``β · log π / |y|``, for ``ipo`` (TRL's) ``β (log π −
    log π_ref) / |y|``: TRL's IPO averages each log-ratio over the response's tokens, ``ipo_sum`` keeps
    the sums (the paper's). ``kl``: KTO's reference point."""
    beta = loss_cfg.beta
    if loss_cfg.type == "simpo":
        chosen = policy.chosen / policy.chosen_tokens
        rejected = policy.rejected / policy.rejected_tokens
        losses = algorithms.simpo_loss(chosen, rejected, beta=beta, gamma=loss_cfg.gamma)
        return losses, beta * chosen.detach(), beta * rejected.detach()
    if ref is None:
        raise ValueError(f"loss.type={loss_cfg.type} needs reference log-probs")
    chosen = policy.chosen - ref.chosen
    rejected = policy.rejected - ref.rejected
    if loss_cfg.type == "ipo":
        chosen, rejected = chosen / policy.chosen_tokens, rejected / policy.rejected_tokens
    if loss_cfg.type == "dpo":
        losses = algorithms.dpo_loss(chosen, rejected, beta=beta, label_smoothing=loss_cfg.label_smoothing)
    elif loss_cfg.type in ("ipo", "ipo_sum"):
        losses = algorithms.ipo_loss(chosen, rejected, beta=beta)
    elif loss_cfg.type == "kto":
        losses = algorithms.kto_loss(chosen, rejected, kl, beta=beta)
    else:
        raise ValueError(f"unknown loss.type={loss_cfg.type!r}")
    return losses, beta * chosen.detach(), beta * rejected.detach()


def add_sums(
    sums: dict[str, float],
    losses: torch.Tensor,
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    policy: PairLogps,
    ref: PairLogps | None,
) -> None:
    """Add a micro-batch's per-pair sums (``SUM_KEYS``) to ``sums``."""
    sums["loss"] += losses.sum().item()
    sums["rewards/chosen"] += chosen_rewards.sum().item()
    sums["rewards/rejected"] += rejected_rewards.sum().item()
    sums["rewards/accuracies"] += (chosen_rewards > rejected_rewards).sum().item()
    sums["logps/chosen"] += policy.chosen.sum().item()
    sums["logps/rejected"] += policy.rejected.sum().item()
    if ref is not None:
        sums["kl"] += 0.5 * (policy.chosen - ref.chosen + policy.rejected - ref.rejected).sum().item()
    sums["nll"] -= policy.chosen.sum().item()
    sums["chosen_tokens"] += policy.chosen_tokens.sum().item()
    sums["pairs"] += len(losses)


def pair_metrics(
    sums: dict[str, float], loss_cfg: PreferenceLossConfig, *, prefix: str, has_ref: bool
) -> dict[str, float]:
    """Reduce every rank's ``sums`` once (a collective) and return the metrics: means over pairs, the
    NLL as a token mean. ``prefix``: ``train/`` (the reward and log-prob keys keep TRL's bare names)
    or ``val/`` (every key under it)."""
    total = dict(zip(SUM_KEYS, all_reduce_scalars([sums[k] for k in SUM_KEYS], "sum"), strict=True))
    n = max(total["pairs"], 1.0)
    nll = total["nll"] / max(total["chosen_tokens"], 1.0)
    pref = "" if prefix == "train/" else prefix
    out = {
        f"{prefix}loss": total["loss"] / n + loss_cfg.nll_coef * nll,
        f"{prefix}nll_loss": nll,
        f"{pref}rewards/chosen": total["rewards/chosen"] / n,
        f"{pref}rewards/rejected": total["rewards/rejected"] / n,
        f"{pref}rewards/margins": (total["rewards/chosen"] - total["rewards/rejected"]) / n,
        f"{pref}rewards/accuracies": total["rewards/accuracies"] / n,
        f"{pref}logps/chosen": total["logps/chosen"] / n,
        f"{pref}logps/rejected": total["logps/rejected"] / n,
        f"{prefix}num_pairs": total["pairs"],
    }
    if has_ref:
        out[f"{prefix}kl"] = total["kl"] / n
    return out


# ----------------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate_pairs(
    model: nn.Module,
    ref: nn.Module | None,
    pairs: list[stage_data.PreferencePair],
    cfg: DPOConfig,
    info: DistInfo,
) -> dict[str, float]:
    """The training metrics on held-out pairs, as ``val/*`` (every rank scores its share; KTO's
    reference point is estimated on the held-out pairs themselves)."""
    mine = rank_slice(pairs, info)
    groups = plan_eval_micro_batches(
        [pair_length(p) for p in mine],
        use_dynamic_bsz=cfg.data.use_dynamic_bsz,
        max_tokens=cfg.data.max_token_len_per_gpu,
        micro_batch_size=cfg.data.micro_batch_size_per_gpu,
    )
    kto = cfg.loss.type == "kto"
    kl_seqs = kl_sequences(mine) if kto else []
    dummy = [(DUMMY_SEQUENCE, DUMMY_SEQUENCE)]
    parts: list[tuple[PairLogps, PairLogps | None]] = []
    kl_sum = 0.0
    for group in groups:
        if not group:  # this rank is out of pairs, but each forward is a collective: join them
            sequence_logps(model, dummy, info.device)
            if ref is not None:
                sequence_logps(ref, dummy, info.device)
            continue
        batch = [mine[i] for i in group]
        extra = [kl_seqs[i] for i in group] if kto else []
        sums, lengths = sequence_logps(model, pair_sequences(batch) + extra, info.device)
        policy = as_pairs(sums, lengths, len(batch))
        ref_logps, ref_kl = scored(ref, batch, extra, info.device) if ref is not None else (None, None)
        if kto:
            kl_sum += (sums[2 * len(batch) :] - ref_kl).sum().item()
        parts.append((policy, ref_logps))
    if ref is not None and ref is not model:
        sharding.release(ref)
    kl = all_reduce_scalars([kl_sum], "sum")[0] / max(len(pairs), 1) if kto else 0.0
    sums = dict.fromkeys(SUM_KEYS, 0.0)
    for policy, ref_logps in parts:
        losses, chosen_rewards, rejected_rewards = pair_losses(cfg.loss, policy, ref_logps, kl)
        add_sums(sums, losses, chosen_rewards, rejected_rewards, policy, ref_logps)
    return pair_metrics(sums, cfg.loss, prefix="val/", has_ref=ref is not None)


def evaluate_answers(
    model: nn.Module, tokenizer: PreTrainedTokenizerBase, cfg: DPOConfig, info: DistInfo
) -> dict[str, float]:
    """``val/accuracy``: the share of ``data.eval_prompt_files`` prompts whose greedy answer (at most
    ``data.max_response_length`` tokens) the rule reward scores 1; ``val/num_prompts``. The greedy part
    of ``ppo.model_eval.answer_metrics``, with PPO's prompt and response lengths."""
    records = data.load_prompts(
        cfg.data.eval_prompt_files,
        tokenizer,
        max_prompt_length=cfg.data.max_prompt_length,
        apply_chat_template=cfg.data.apply_chat_template,
    )
    return model_eval.answer_metrics(
        model,
        tokenizer,
        records,
        info,
        max_new_tokens=cfg.data.max_response_length,
        seed=cfg.trainer.seed,
        micro_batch_size=EVAL_GENERATE_BATCH,
    )


if __name__ == "__main__":
    exit_process(main())
