"""PPO's validation inside the training loop, on the run's ``Run`` (unlike ``ppo.model_eval``, a bare model).

Every ``trainer.test_freq`` steps ``train_ppo.py`` asks for it: greedy (or sampled) answers to the
validation prompts from the run's own sampler, scored as the run scores (its reward model, or the rule in
its reward pool); stop signals end it between chunks and while the reward pool scores. With ``rollout.val_kwargs`` a second pass of ``n``
sampled answers per prompt measures exploration.

metrics = validate(cfg, info, run)   # val/<data_source>/score, /accuracy, val/score, val/accuracy,
                                     # and with val_kwargs: val/mean@n, val/pass@k, val/best@k, val/maj@n;
                                     # multi-turn: val/turns/mean, val/tool_calls/mean;
                                     # reward.custom_function a list: val/reward/<name>/{mean,std}

The headline ``val/score`` (what ``trainer.rollback_val_drop`` and the best score so far follow) is the
greedy pass's, or, with ``rollout.val_kwargs.do_sample``, the mean over the ``n`` sampled answers, as
verl's ``val-core/<data_source>/reward/mean@n`` is; the greedy pass is then logged as ``greedy_score``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter

import numpy as np
import torch

from ppo import rewards, rule_scoring
from ppo.algorithms import bootstrap_best, pass_at_k
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
from ppo.step_end import StopRequest

logger = logging.getLogger("ppo")


def validate(cfg: PPOConfig, info: DistInfo, run: Run, stop: StopRequest | None = None) -> dict[str, float]:
    """Generate for every validation prompt (greedy unless ``rollout.val_do_sample``) and score it.

    ``val/<data_source>/score``: the mean reward the run trains with (the reward model's score with
    ``reward.style=model``, else the rule's), also logged under verl's name
    ``val-core/<data_source>/reward/mean@1``; ``val/<data_source>/accuracy``: the share the rule scores
    1.0, where a rule exists for the source and the data has a ground truth. ``val/score`` and
    ``val/accuracy`` average over sources. With ``rollout.val_kwargs`` (``n > 1`` or ``do_sample``) also
    the ``n``-answer metrics of ``sampled_metrics``.

    With ``rollout.val_kwargs.do_sample`` the headline is sampled, as verl's (whose only validation pass
    is the ``n`` sampled answers): ``score`` and ``accuracy`` (per source and averaged) and
    ``val-core/<data_source>/reward/mean@n`` are over the ``n`` sampled answers to each prompt, and the
    greedy pass's are logged as ``val/<data_source>/greedy_score``, ``.../greedy_accuracy``,
    ``val/greedy_score``, ``val/greedy_accuracy`` (no verl name: verl has no greedy pass then).

    Generation runs in chunks of ``data.val_batch_size`` sequences (over all ranks); before each, and
    while the reward function scores (in the reward pool, or in this process, where the call running is
    abandoned: ``user_code.abandoned_on_stop``), a stop signal (``stop``) ends validation at once with no
    metrics, so a long validation never outlasts the grace period between SIGTERM and SIGKILL.

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


def _validate(cfg: PPOConfig, info: DistInfo, run: Run, stop: StopRequest | None) -> dict[str, float]:
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
    scored = rule_scores(cfg, run, mine, rollout, texts, stop)
    if scored is None:
        return {}
    rule, function_metrics = scored
    if cfg.trainer.log_val_generations:
        shown = model_scores.tolist() if model_scores is not None else rule
        log_generations(run, info, mine, texts, shown, cfg.trainer.log_val_generations)
    out = score_metrics(mine, model_scores, rule, answers_per_prompt=1) | function_metrics
    if cfg.rollout.val_kwargs.do_sample:  # the headline is the sampled pass's: the greedy one is renamed
        out = {
            f"{key.rpartition('/')[0]}/greedy_{key.rpartition('/')[2]}": value
            for key, value in out.items()
            if key.startswith("val/")
        }
    if rollout.turn_stats is not None:
        out.update(turn_metrics(rollout))
    if cfg.rollout.val_kwargs.enabled:
        sampled = sampled_metrics(cfg, run, mine, chunk, stop)
        if sampled is None:
            return {}
        out.update(sampled)
    return out


def score_metrics(
    records: list[PromptRecord],
    model_scores: torch.Tensor | None,
    rule: list[float | None],
    *,
    answers_per_prompt: int,
) -> dict[str, float]:
    """Mean score and share right of a validation pass, per source and averaged over sources (over every
    rank's answers): ``val/<source>/score`` (the reward model's score where there is one, else the
    rule's), verl's ``val-core/<source>/reward/mean@<answers_per_prompt>``, ``val/<source>/accuracy`` (the
    share the rule scores 1.0, where it scores), ``val/score``, ``val/accuracy``. ``records`` holds each
    prompt ``answers_per_prompt`` times; every prompt has that many answers, so the mean over answers is
    verl's mean over prompts of each prompt's mean."""
    sums: dict[str, list[float]] = {}  # source -> [score sum, count, right, rule count]
    for i, r in enumerate(records):
        s = sums.setdefault(r.data_source, [0.0, 0.0, 0.0, 0.0])
        if model_scores is not None:
            s[0] += float(model_scores[i])
        elif rule[i] is not None:
            s[0] += rule[i]
        if model_scores is not None or rule[i] is not None:  # a row the rule leaves out counts nowhere
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
        out[f"val-core/{source}/reward/mean@{answers_per_prompt}"] = score / count
        if ruled:
            out[f"val/{source}/accuracy"] = right / ruled
    if scored:
        out["val/score"] = float(np.mean([out[f"val/{s}/score"] for s in scored]))
    accuracies = [out[f"val/{s}/accuracy"] for s in scored if f"val/{s}/accuracy" in out]
    if accuracies:
        out["val/accuracy"] = float(np.mean(accuracies))
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
    cfg: PPOConfig, run: Run, mine: list[PromptRecord], chunk: int, stop: StopRequest | None
) -> dict[str, float] | None:
    """``n = rollout.val_kwargs.n`` answers to each validation prompt, sampled with the ``val_kwargs``'
    temperature, top-p and top-k (verl's ``val_kwargs``), judged by the rule (an answer is right when it
    scores >= 1), per source and averaged over sources:

    - ``val/<source>/mean@n``: the share of right answers (mean over prompts of ``c / n``);
    - ``val/<source>/pass@k`` for ``k = 1, 2, 4, ..., n`` (``k_values``): the unbiased pass@k
      (``pass_at_k``), the chance that at least one of k answers drawn without replacement from the n is
      right; pass@1 is mean@n and pass@n is the share of prompts with a right answer;
    - ``val/<source>/best@k`` for ``k = 2, 4, ..., n`` (verl's k): verl's best@k (``bootstrap_best``), the
      best rule score among k answers drawn *with replacement*, averaged over 1000 draws from a NumPy
      RandomState seeded 42 for each k (the same draws for every prompt, as verl's reseeding gives); it
      sits below pass@k (one right answer of 8: best@8 = 0.651, pass@8 = 1). Also under verl's names
      ``val-core/<source>/reward/best@n/mean`` and ``val-aux/<source>/reward/best@k/mean`` (k < n), each
      with its ``/std`` over the draws;
    - ``val/<source>/maj@n``: the share of prompts whose most frequent final answer (``prediction``) is
      right (``majority_correct``), over all n answers (verl bootstraps it too).

    With ``do_sample`` the pass is also the headline (``score_metrics`` over the n answers, scored as the
    run scores: ``val/score``, ``val/accuracy``, ``val-core/<source>/reward/mean@n``). Prompts without a
    rule or ground truth are left out of the n-answer metrics. None when a stop signal came."""
    v = cfg.rollout.val_kwargs
    settings = dataclasses.replace(cfg.rollout, temperature=v.temperature, top_p=v.top_p, top_k=v.top_k)
    sampler = dataclasses.replace(run.sampler, settings=settings)
    records = [r for r in mine for _ in range(v.n)]
    rollout = generate(sampler, records, chunk, do_sample=v.do_sample, stop=stop)
    if rollout is None:
        return None
    texts = decode_responses(run.tokenizer, rollout)
    scored = rule_scores(cfg, run, records, rollout, texts, stop)
    if scored is None:
        return None
    rule, function_metrics = scored
    out: dict[str, float] = {}
    if v.do_sample:
        model_scores = (
            rewards.rollout_reward_model_scores(
                run.reward_model, rollout, micro_batch_size=cfg.reward.micro_batch_size_per_gpu
            )
            if run.reward_model is not None
            else None
        )
        out.update(score_metrics(records, model_scores, rule, answers_per_prompt=v.n) | function_metrics)
    ks = k_values(v.n)
    best_ks = ks[1:]  # verl's best@k starts at k = 2
    draws = bootstrap_draws(v.n, best_ks)
    # source -> [prompts, mean@n sum, pass@k sums..., best@k mean sums..., best@k std sums..., maj@n sum]
    sums: dict[str, list[float]] = {}
    for i, r in enumerate(mine):
        scores = rule[i * v.n : (i + 1) * v.n]
        if scores[0] is None:
            continue
        right = [s >= 1.0 for s in scores]
        preds = [prediction(r.data_source, t) for t in texts[i * v.n : (i + 1) * v.n]]
        best = [bootstrap_best(torch.tensor(scores, dtype=torch.float64), draws[k]) for k in best_ks]
        row = [1.0, sum(right) / v.n, *(pass_at_k(v.n, sum(right), k) for k in ks)]
        row += (
            [float(m) for m, _ in best]
            + [float(sd) for _, sd in best]
            + [float(majority_correct(preds, right))]
        )
        s = sums.setdefault(r.data_source, [0.0] * len(row))
        for j, x in enumerate(row):
            s[j] += x
    totals = sum_over_ranks(sums)
    nk, nb = len(ks), len(best_ks)
    for source in sorted(totals):
        t = [x / totals[source][0] for x in totals[source]]
        out[f"val/{source}/mean@{v.n}"] = t[1]
        for j, k in enumerate(ks):
            out[f"val/{source}/pass@{k}"] = t[2 + j]
        for j, k in enumerate(best_ks):
            out[f"val/{source}/best@{k}"] = t[2 + nk + j]
            section = "val-core" if k == v.n else "val-aux"
            out[f"{section}/{source}/reward/best@{k}/mean"] = t[2 + nk + j]
            out[f"{section}/{source}/reward/best@{k}/std"] = t[2 + nk + nb + j]
        out[f"val/{source}/maj@{v.n}"] = t[-1]
    names = [f"mean@{v.n}", *(f"pass@{k}" for k in ks), *(f"best@{k}" for k in best_ks), f"maj@{v.n}"]
    for name in names if totals else []:
        out[f"val/{name}"] = float(np.mean([out[f"val/{s}/{name}"] for s in totals]))
    return out


def generate(
    sampler: Sampler,
    records: list[PromptRecord],
    chunk: int,
    *,
    do_sample: bool,
    stop: StopRequest | None,
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
    cfg: PPOConfig,
    run: Run,
    records: list[PromptRecord],
    rollout: Rollout,
    texts: list[str],
    stop: StopRequest | None,
) -> tuple[list[float | None], dict[str, float]] | None:
    """The rule's score of each text (of the responses of ``rollout``), None where the source has no rule,
    the record no ground truth, or every reward function returned None (TRL's "does not apply")
    (``rewards.rule_results``, in ``run.reward_pool`` where there is one; TRL-style functions see the
    steps done as ``trainer_state.global_step``); a reward function that fails on any rank stops every
    rank. With ``reward.custom_function`` a list, also each function's ``val/reward/<name>/mean`` and
    ``/std``. None when a stop signal came: the pool's workers give up on it at once (a hanging reward
    function would otherwise hold the stop for up to ``reward.timeout_s`` a call)."""
    fn = cfg.reward.custom_function
    rows = [
        i
        for i, r in enumerate(records)
        if rule_scoring.has_rule(r.data_source, fn) and (r.ground_truth is not None or fn is not None)
    ]
    ids = rewards.response_ids(rollout)
    scored, metrics = rewards.rule_results(
        run.scorer,
        [records[i] for i in rows],
        [texts[i] for i in rows],
        run.reward_pool,
        stop=None if stop is None else lambda: stop.name is not None,
        completion_ids=[ids[i] for i in rows],
        trainer_state=rule_scoring.TrainerProgress.after(
            run.state.step, run.total_steps, run.loader.steps_per_epoch
        ),
    )
    if stop is not None and stop.requested():
        logger.warning("validation stopped while scoring (%s)", stop.name)
        return None
    out: list[float | None] = [None] * len(records)
    for i, score in zip(rows, scored, strict=True):
        out[i] = None if isinstance(score, rule_scoring.WeightedScore) and score.declined else score.value
    names, _ = rewards.listed_functions(run.scorer, run.reward_pool)
    keys = [f"reward/{name}/{stat}" for name in names for stat in ("mean", "std")]
    return out, {f"val/{key}": metrics[key] for key in keys}


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


def bootstrap_draws(n: int, ks: list[int], num_draws: int = 1000) -> dict[int, torch.Tensor]:
    """verl's bootstrap indices for ``best@k``: for each ``k``, ``[num_draws, k]`` indices into a prompt's
    ``n`` answers, drawn with replacement by a NumPy RandomState seeded 42 (verl reseeds NumPy's global
    RNG with 42 before each draw; a RandomState of its own gives the same indices and leaves the global
    one alone)."""
    return {k: torch.from_numpy(np.random.RandomState(42).choice(n, size=(num_draws, k))) for k in ks}


def k_values(n: int) -> list[int]:
    """The k of ``pass@k``: 1, 2, 4, ... below ``n``, then ``n`` (``k_values(6) = [1, 2, 4, 6]``); verl's
    ``best@k`` takes the same without 1."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n]


def prediction(data_source: str, text: str) -> str | None:
    """The final answer a majority vote counts: the normalized ``#### N`` number for the GSM8K-style
    sources (None without one), else the whole stripped response."""
    if data_source in rule_scoring.RULE_DATA_SOURCES:
        return rule_scoring.extract_gsm8k_answer(text)
    return text.strip()


def majority_correct(preds: list[str | None], right: list[bool]) -> bool:
    """Whether the most frequent of ``preds`` is right (judged by its first answer, as verl); ties go to
    the answer that came first. ``majority_correct(["7", "8", "8", "7"], [True, False, False, True])``
    is True (7 and 8 tie, 7 came first)."""
    counts = Counter(preds)
    best = max(counts.values())
    winner = next(p for p in preds if counts[p] == best)
    return right[preds.index(winner)]
