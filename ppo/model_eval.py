"""A bare model measured outside any run (unlike ``ppo.periodic_validation``, PPO's in-loop validation).

How good a policy's answers are, and how far it moved from a reference: greedy and sampled accuracy by
the rule reward, pass@k, and KL(π ‖ π_ref) on the policy's own samples. It takes a model, a tokenizer and
prompt records, nothing of a training run: HF ``generate`` on the model itself, the rule reward only.

    metrics = answer_metrics(model, tokenizer, records, info, max_new_tokens=28, num_samples=4, seed=0,
                             ref=sft_model)
    # val/accuracy, val/sample_accuracy, val/pass_at_k, val/kl_to_ref, val/kl_to_ref_stderr, ...

Every rank calls it with the same records and takes its share (``rank_slice``); generation gathers
sharded parameters once per ``generate`` call and each log-prob forward of a sharded model is a
collective, so the number of forwards is agreed across ranks first (``plan_eval_micro_batches``). The
SFT and DPO stages' final evaluations and ``scripts/ppo_bench/compare_offline.py`` all measure with this module.

KL estimator: responses ``y ~ π(· | x)`` sampled at ``temperature`` (1: the policy itself), and the
sequence log-ratio ``k1(y) = Σ_t log π(y_t | x, y_<t) − log π_ref(y_t | x, y_<t)`` over the response's
tokens (EOS included), averaged over prompts and samples, in nats per sequence. By the chain rule the sum
is ``log π(y|x) − log π_ref(y|x)``, and ``E_{y~π}[log π(y|x)/π_ref(y|x)]`` is the definition of
``KL(π(·|x) ‖ π_ref(·|x))``: the sample mean is unbiased because the responses are drawn from ``π``
itself. One sample can be negative; the mean cannot be, in expectation. (On responses that ``π`` did not
sample, such as an offline data set's, the same average estimates nothing in particular and can go
negative: the reason for sampling here.) A response cut at ``max_new_tokens`` counts the tokens it has,
so what is estimated is the KL of the response distributions truncated at that length. With
``temperature != 1`` both models' log-probs are taken at that temperature: the KL of the two tempered
samplers.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from ppo import algorithms, model_loading, models, packed_forward, rule_scoring, sharding
from ppo.batch import Rollout, decode_responses
from ppo.data import PromptRecord
from ppo.distributed import DistInfo, all_reduce_scalars, rank_slice
from ppo.packing import DUMMY_SEQUENCE, pack, plan_eval_micro_batches
from ppo.rollout import generate, generation_config

FORWARD_MAX_TOKENS = 16384
"""Packed tokens per log-prob forward on one rank (the KL's scoring passes)."""


def sequence_log_ratio(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """``Σ_t (log π − log π_ref)`` over each response's valid tokens: ``[B]`` from ``[B, R]`` inputs.

    The k1 estimator (``algorithms.kl_penalty(..., "k1")``) summed over the sequence: for responses
    sampled from ``π`` its mean is an unbiased estimate of the sequence-level ``KL(π ‖ π_ref)``.
    """
    per_token = algorithms.kl_penalty(logprobs, ref_logprobs, "k1")
    return torch.where(response_mask.bool(), per_token, torch.zeros_like(per_token)).sum(-1)


@torch.no_grad()
def response_logprobs(
    model: nn.Module, rollout: Rollout, *, temperature: float = 1.0, max_tokens: int = FORWARD_MAX_TOKENS
) -> torch.Tensor:
    """``model``'s log-probs of the rollout's response tokens, ``[B, R]`` fp32 (0 at padding), from
    packed padding-free forwards of at most ``max_tokens`` tokens (``packed_forward.logprobs``).

    Every rank must call it: the number of forwards is agreed across ranks, and a rank with fewer
    sequences forwards ``DUMMY_SEQUENCE`` for the rest (each forward of a sharded model is a collective).
    """
    device = rollout.responses.device
    lengths = [
        p.numel() + int(n)
        for p, n in zip(rollout.prompts, rollout.attention_mask.sum(-1).tolist(), strict=True)
    ]
    groups = plan_eval_micro_batches(lengths, use_dynamic_bsz=True, max_tokens=max_tokens, micro_batch_size=1)
    out = torch.zeros(rollout.responses.shape, dtype=torch.float32, device=device)
    with models.evaluating(model):
        for group in groups:
            if not group:
                dummy = pack(
                    [torch.tensor(DUMMY_SEQUENCE, dtype=torch.long)],
                    torch.zeros(1, 1, dtype=torch.long, device=device),
                    torch.zeros(1, 1, dtype=torch.bool, device=device),
                )
                packed_forward.logprobs(model, dummy, temperature=temperature)
                continue
            idx = torch.tensor(group, dtype=torch.long, device=device)
            packed = pack(
                [rollout.prompts[i] for i in group], rollout.responses[idx], rollout.attention_mask[idx]
            )
            out[idx] = packed_forward.logprobs(model, packed, temperature=temperature)[0]
    sharding.release(model)  # without a backward, FSDP2 keeps the root gathered after a forward
    return out


@torch.no_grad()
def answer_metrics(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    records: list[PromptRecord],
    info: DistInfo,
    *,
    max_new_tokens: int,
    num_samples: int = 0,
    seed: int,
    ref: nn.Module | None = None,
    temperature: float = 1.0,
    micro_batch_size: int = 256,
) -> dict[str, float]:
    """Rule-reward accuracy of ``model``'s answers to ``records`` and, with ``ref``, its KL to ``ref``.

    - ``val/accuracy``: the share of prompts whose greedy answer the rule scores 1;
    - with ``num_samples = k > 0``, ``k`` answers per prompt sampled at ``temperature``:
      ``val/sample_accuracy`` (the chance that one sample is right) and ``val/pass_at_k`` (prompts with a
      right one among the ``k``: ``pass_at_k(k, c, k)``);
    - with ``ref`` (needs ``num_samples > 0``): ``val/kl_to_ref``, the mean sequence log-ratio
      ``Σ_t log π − log π_ref`` of those samples (nats per sequence; the module docstring says why it is
      unbiased), ``val/kl_to_ref_stderr`` (its standard error over the samples) and
      ``val/response_tokens`` (mean sampled response length, EOS included);
    - ``val/num_prompts``.

    Every rank calls it with the same ``records`` and scores its share. Responses have at most
    ``max_new_tokens`` tokens; ``micro_batch_size`` prompts go into one ``generate`` call. Sampling
    draws from torch's global RNG seeded with ``seed * 1000 + rank`` (restored on return), after the
    greedy pass, so the numbers repeat for a given world size.
    """
    if ref is not None and num_samples < 1:
        raise ValueError("the KL to the reference is estimated on samples: pass num_samples >= 1 with ref")
    scorer = rule_scoring.make_rule_scorer(None, 0.0)
    mine = rank_slice(records, info)
    prompts = [torch.tensor(r.input_ids, dtype=torch.long) for r in mine]
    common = dict(
        max_new_tokens=max_new_tokens,
        eos_token_ids=model_loading.eos_token_ids(tokenizer, model),
        pad_token_id=tokenizer.pad_token_id,
    )
    # Every rank calls generate, even with no prompts: it joins the parameter gather inside.
    greedy = generate(
        model, prompts, generation_config(do_sample=False, **common), micro_batch_size=micro_batch_size
    )
    sums = [float(sum(right_answers(tokenizer, greedy, mine, scorer, 1))), float(len(mine))]
    names = ["val/accuracy", "val/num_prompts"]
    if num_samples > 0:
        with torch.random.fork_rng(devices=[info.device] if info.device.type == "cuda" else []):
            torch.manual_seed(seed * 1000 + info.rank)
            sampled = generate(
                model,
                [p for p in prompts for _ in range(num_samples)],
                generation_config(do_sample=True, temperature=temperature, **common),
                micro_batch_size=micro_batch_size,
            )
        right = right_answers(tokenizer, sampled, mine, scorer, num_samples)
        per_prompt = [right[i : i + num_samples] for i in range(0, len(right), num_samples)]
        passed = sum(
            algorithms.pass_at_k(num_samples, sum(p), num_samples) for p in per_prompt
        )  # 1 if any is right
        sums += [float(sum(right)), float(passed)]
        names += ["right_samples", "prompts_passed"]
        if ref is not None:
            log_ratio = sequence_log_ratio(
                response_logprobs(model, sampled, temperature=temperature),
                response_logprobs(ref, sampled, temperature=temperature),
                sampled.attention_mask,
            ).double()
            sums += [
                log_ratio.sum().item(),
                log_ratio.square().sum().item(),
                float(sampled.attention_mask.sum().item()),
            ]
            names += ["kl_sum", "kl_square_sum", "response_tokens"]
    total = dict(zip(names, all_reduce_scalars(sums, "sum"), strict=True))
    n = max(total["val/num_prompts"], 1.0)
    out = {"val/accuracy": total["val/accuracy"] / n, "val/num_prompts": total["val/num_prompts"]}
    if num_samples > 0:
        out["val/sample_accuracy"] = total["right_samples"] / (n * num_samples)
        out["val/pass_at_k"] = total["prompts_passed"] / n
    if ref is not None:
        m = max(total["val/num_prompts"] * num_samples, 1.0)
        mean = total["kl_sum"] / m
        variance = max(total["kl_square_sum"] / m - mean * mean, 0.0) * m / max(m - 1.0, 1.0)
        out["val/kl_to_ref"] = mean
        out["val/kl_to_ref_stderr"] = math.sqrt(variance / m)
        out["val/response_tokens"] = total["response_tokens"] / m
    return out


def right_answers(
    tokenizer: PreTrainedTokenizerBase,
    rollout: Rollout,
    records: list[PromptRecord],
    scorer: rule_scoring.RuleScorer,
    repeats: int,
) -> list[bool]:
    """Whether the rule scores each response 1; response ``i`` answers ``records[i // repeats]``."""
    answered = [records[i // repeats] for i in range(len(rollout.prompts))]
    return [
        scorer(r.data_source, text, r.ground_truth, r.extra_info).value >= 1.0
        for r, text in zip(answered, decode_responses(tokenizer, rollout), strict=True)
    ]
