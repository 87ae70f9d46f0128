"""PPO's validation inside the training loop, on the run's ``Run`` (unlike ``ppo.model_eval``, a bare model).

Every ``trainer.test_freq`` steps ``train_ppo.py`` asks for it: greedy (or sampled) answers to the
validation prompts from the run's own sampler, scored as the run scores (its reward model, or the rule in
its reward pool); stop signals end it between chunks. With ``rollout.val_kwargs`` a second pass of ``n``
sampled answers per prompt measures exploration.

metrics = validate(cfg, info, run)   # val/<data_source>/score, /accuracy, val/score, val/accuracy,
                                     # and with val_kwargs: val/mean@n, val/best@k, val/maj@n;
                                     # multi-turn: val/turns/mean, val/tool_calls/mean
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import Counter

import numpy as np
import torch

from ppo import rewards, runner
from ppo.batch import Rollout, concat_rollouts, decode_responses
from ppo.build import Run
from ppo.config import PPOConfig
from ppo.data import PromptRecord
from ppo.distributed import (
    DistInfo,
    all_gather_object,
    all_reduce_scalar,
    all_reduce_scalars,
)
from ppo.rollout import Sampler, sample

logger = logging.getLogger("ppo")


def validate(
    cfg: PPOConfig, info: DistInfo, run: Run, stop: runner.StopRequest | None = None
) -> dict[str, float]:
    """Generate for every validation prompt (greedy unless ``rollout.val_do_sample``) and score it.

    ``val/<data_source>/score``: the mean reward the run trains with (the reward model's score with
    ``reward.style=model``, else the rule's), also logged under verl's name
    ``val-core/<data_source>/reward/mean@1``; ``val/<data_source>/accuracy``: the share the rule scores
    1.0, where a rule exists for the source and the data has a ground truth. ``val/score`` and
    ``val/accuracy`` average over sources. With ``rollout.val_kwargs`` (``n > 1`` or ``do_sample``) also
    the ``n``-answer metrics of ``sampled_metrics``.

    Generation runs in chunks of ``data.val_batch_size`` sequences (over all ranks); before each, a stop
    signal (``stop``) ends validation at once with no metrics, so a long validation never outlasts the
    grace period between SIGTERM and SIGKILL.

    Sampled answers draw from an RNG of their own, seeded by (``trainer.seed``, step, rank): validating,
    and how often, never changes what training samples (the global RNG is left as it was), and a
    validation's samples are the same whatever ran before it.
    """
    devices = [info.device] if info.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(
            (cfg.trainer.seed * 1_000_003 + run.state.step) * 1_000_003 + VAL_STREAM + info.rank
        )
        return _validate(cfg, info, run, stop)


VAL_STREAM = 7919
"""Offsets validation's RNG seed from every other stream derived from (seed, step)."""


def _validate(cfg: PPOConfig, info: DistInfo, run: Run, stop: runner.StopRequest | None) -> dict[str, float]:
    """``validate`` under its own RNG."""
    mine = run.val_records[info.rank :: info.world_size]
    chunk = max(1, cfg.data.val_batch_size // info.world_size)
    rollout = generate(run.sampler, mine, chunk, do_sample=cfg.rollout.val_do_sample, stop=stop)
    if rollout is None:
        return {}
    texts = decode_responses(run.tokenizer, rollout)
    model_scores = (
        rewards.rollout_reward_model_scores(
            run.reward_model, rollout, micro_batch_size=cfg.reward.micro_batch_size_per_gpu
        )
        if run.reward_model is not None
        else None
    )
    rule = rule_scores(cfg, run, mine, texts)
    if cfg.trainer.log_val_generations:
        shown = model_scores.tolist() if model_scores is not None else rule
        log_generations(run, info, mine, texts, shown, cfg.trainer.log_val_generations)
    sums: dict[str, list[float]] = {}  # source -> [score sum, count, right, rule count]
    for i, r in enumerate(mine):
        s = sums.setdefault(r.data_source, [0.0, 0.0, 0.0, 0.0])
        if model_scores is not None:
            s[0] += float(model_scores[i])
        elif rule[i] is not None:
            s[0] += rule[i]
        s[1] += 1
        if rule[i] is not None:
            s[2] += float(rule[i] >= 1.0)
            s[3] += 1
    totals = sum_over_ranks(sums)
    out: dict[str, float] = {}
    scored = [s for s, t in totals.items() if model_scores is not None or t[3] > 0]
    for source in sorted(scored):
        score, count, right, ruled = totals[source]
        out[f"val/{source}/score"] = score / count
        out[f"val-core/{source}/reward/mean@1"] = score / count
        if ruled:
            out[f"val/{source}/accuracy"] = right / ruled
    if scored:
        out["val/score"] = float(np.mean([out[f"val/{s}/score"] for s in scored]))
    accuracies = [out[f"val/{s}/accuracy"] for s in scored if f"val/{s}/accuracy" in out]
    if accuracies:
        out["val/accuracy"] = float(np.mean(accuracies))
    if rollout.turn_stats is not None:
        out.update(turn_metrics(rollout))
    if cfg.rollout.val_kwargs.enabled:
        sampled = sampled_metrics(cfg, run, mine, chunk, stop)
        if sampled is None:
            return {}
        out.update(sampled)
    return out


def log_generations(
    run: Run, info: DistInfo, mine: list[PromptRecord], texts: list[str], scores: list, num: int
) -> None:
    """The first ``num`` validation prompts' answers (``trainer.log_val_generations``), gathered from the
    ranks that answered them (rank ``r`` holds prompts ``r, r + world_size, ...``) and written by rank 0
    in the prompts' order: ``generations.jsonl`` and TensorBoard's text tab."""
    rows = [
        (info.rank + i * info.world_size, {"prompt": r.prompt_text, "response": t, "score": s})
        for i, (r, t, s) in enumerate(zip(mine, texts, scores, strict=True))
        if info.rank + i * info.world_size < num
    ]
    gathered = sorted((row for rank in all_gather_object(rows) for row in rank), key=lambda row: row[0])
    run.metrics_logger.log_generations(run.state.step, [row for _, row in gathered])


def sampled_metrics(
    cfg: PPOConfig, run: Run, mine: list[PromptRecord], chunk: int, stop: runner.StopRequest | None
) -> dict[str, float] | None:
    """``n = rollout.val_kwargs.n`` answers to each validation prompt, sampled with the ``val_kwargs``'
    temperature, top-p and top-k (verl's ``val_kwargs``), judged by the rule (an answer is right when it
    scores >= 1), per source and averaged over sources:

    - ``val/<source>/mean@n``: the share of right answers (mean over prompts of ``c / n``);
    - ``val/<source>/best@k`` for ``k = 1, 2, 4, ..., n`` (``k_values``): the unbiased pass@k
      (``pass_at_k``), the chance that at least one of k answers drawn from the n is right;
    - ``val/<source>/maj@n``: the share of prompts whose most frequent final answer (``prediction``) is
      right (``majority_correct``).

    verl estimates best@k and maj@n by bootstrap resampling; the closed form here has no sampling noise
    of its own. Prompts without a rule or ground truth are left out. None when a stop signal came."""
    v = cfg.rollout.val_kwargs
    settings = dataclasses.replace(cfg.rollout, temperature=v.temperature, top_p=v.top_p, top_k=v.top_k)
    sampler = dataclasses.replace(run.sampler, settings=settings)
    records = [r for r in mine for _ in range(v.n)]
    rollout = generate(sampler, records, chunk, do_sample=v.do_sample, stop=stop)
    if rollout is None:
        return None
    texts = decode_responses(run.tokenizer, rollout)
    rule = rule_scores(cfg, run, records, texts)
    ks = k_values(v.n)
    sums: dict[str, list[float]] = {}  # source -> [prompts, mean@n sum, best@k sums..., maj@n sum]
    for i, r in enumerate(mine):
        scores = rule[i * v.n : (i + 1) * v.n]
        if scores[0] is None:
            continue
        right = [s >= 1.0 for s in scores]
        preds = [prediction(r.data_source, t) for t in texts[i * v.n : (i + 1) * v.n]]
        s = sums.setdefault(r.data_source, [0.0] * (len(ks) + 3))
        s[0] += 1
        s[1] += sum(right) / v.n
        for j, k in enumerate(ks):
            s[2 + j] += pass_at_k(v.n, sum(right), k)
        s[-1] += float(majority_correct(preds, right))
    totals = sum_over_ranks(sums)
    out: dict[str, float] = {}
    for source in sorted(totals):
        t = totals[source]
        out[f"val/{source}/mean@{v.n}"] = t[1] / t[0]
        for j, k in enumerate(ks):
            out[f"val/{source}/best@{k}"] = t[2 + j] / t[0]
        out[f"val/{source}/maj@{v.n}"] = t[-1] / t[0]
    names = [f"mean@{v.n}", *(f"best@{k}" for k in ks), f"maj@{v.n}"]
    for name in names if totals else []:
        out[f"val/{name}"] = float(np.mean([out[f"val/{s}/{name}"] for s in totals]))
    return out


def generate(
    sampler: Sampler,
    records: list[PromptRecord],
    chunk: int,
    *,
    do_sample: bool,
    stop: runner.StopRequest | None,
) -> Rollout | None:
    """One answer per record, ``chunk`` sequences a generate call, the same number of calls on every rank;
    None when a stop signal came before a call."""
    num_chunks = int(all_reduce_scalar(float(-(-len(records) // chunk)), "max"))  # the same on every rank
    parts = []
    for c in range(num_chunks):
        if stop is not None and stop.requested():
            logger.warning("validation stopped after %d of %d chunks (%s)", c, num_chunks, stop.name)
            return None
        batch = records[c * chunk : (c + 1) * chunk]
        parts.append(sample(sampler, batch, do_sample=do_sample, micro_batch_size=chunk, ignore_eos=False))
    return concat_rollouts(parts) if parts else sample(sampler, [], do_sample=False)


def rule_scores(
    cfg: PPOConfig, run: Run, records: list[PromptRecord], texts: list[str]
) -> list[float | None]:
    """The rule's score of each text, None where the source has no rule or the record no ground truth
    (``rewards.rule_scores``, in ``run.reward_pool`` where there is one); a reward function that fails on
    any rank stops every rank."""
    fn = cfg.reward.custom_function
    rows = [
        i
        for i, r in enumerate(records)
        if rewards.has_rule(r.data_source, fn) and (r.ground_truth is not None or fn is not None)
    ]
    scores, _ = rewards.rule_scores(
        run.scorer, [records[i] for i in rows], [texts[i] for i in rows], run.reward_pool
    )
    out: list[float | None] = [None] * len(records)
    for i, score in zip(rows, scores.tolist(), strict=True):
        out[i] = score
    return out


def turn_metrics(rollout: Rollout) -> dict[str, float]:
    """A multi-turn validation's ``val/turns/mean`` and ``val/tool_calls/mean`` over every rank's answers."""
    stats = rollout.turn_stats
    rows, turns, calls = all_reduce_scalars(
        [float(len(rollout.prompts)), float(stats["turns"].sum()), float(stats["tool_calls"].sum())], "sum"
    )
    return {"val/turns/mean": turns / max(rows, 1.0), "val/tool_calls/mean": calls / max(rows, 1.0)}


def sum_over_ranks(sums: dict[str, list[float]]) -> dict[str, list[float]]:
    """Per-source lists of sums, added element-wise over every rank's (sources any rank has)."""
    totals: dict[str, list[float]] = {}
    for part in all_gather_object(sums):
        for source, s in part.items():
            t = totals.setdefault(source, [0.0] * len(s))
            for i, x in enumerate(s):
                t[i] += x
    return totals


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` answers of which ``c`` are right (Chen et al. 2021, "Evaluating Large
    Language Models Trained on Code"): ``1 - C(n - c, k) / C(n, k)``, the chance that ``k`` answers
    drawn without replacement from the ``n`` hold a right one. ``pass_at_k(8, 2, 4) = 1 - 15/70 =
    0.785714``; ``pass_at_k(n, c, 1) = c / n``. Raises ValueError unless ``0 <= c <= n`` and
    ``1 <= k <= n``."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def k_values(n: int) -> list[int]:
    """The k of ``best@k``: 1, 2, 4, ... below ``n``, then ``n`` (``k_values(6) = [1, 2, 4, 6]``)."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n]


def prediction(data_source: str, text: str) -> str | None:
    """The final answer a majority vote counts: the normalized ``#### N`` number for the GSM8K-style
    sources (None without one), else the whole stripped response."""
    if data_source in rewards.RULE_DATA_SOURCES:
        return rewards.extract_gsm8k_answer(text)
    return text.strip()


def majority_correct(preds: list[str | None], right: list[bool]) -> bool:
    """Whether the most frequent of ``preds`` is right (judged by its first answer, as verl); ties go to
    the answer that came first. ``majority_correct(["7", "8", "8", "7"], [True, False, False, True])``
    is True (7 and 8 tie, 7 came first)."""
    counts = Counter(preds)
    best = max(counts.values())
    winner = next(p for p in preds if counts[p] == best)
    return right[preds.index(winner)]
