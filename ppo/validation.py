"""Validation: greedy (or sampled) answers to the validation prompts, scored as the run scores.

metrics = validate(cfg, info, run)   # val/<data_source>/score, /accuracy, val/score, val/accuracy
"""

from __future__ import annotations

import logging

import numpy as np

from ppo import rewards, runner
from ppo.batch import concat_rollouts, decode_responses
from ppo.build import Run
from ppo.config import PPOConfig
from ppo.distributed import DistInfo, agree_on_failure, all_gather_object, all_reduce_scalar
from ppo.rollout import sample

logger = logging.getLogger("ppo")


def validate(
    cfg: PPOConfig, info: DistInfo, run: Run, stop: runner.StopRequest | None = None
) -> dict[str, float]:
    """Generate for every validation prompt (greedy unless ``rollout.val_do_sample``) and score it.

    ``val/<data_source>/score``: the mean reward the run trains with (the reward model's score with
    ``reward.style=model``, else the rule's), also logged under verl's name
    ``val-core/<data_source>/reward/mean@1``; ``val/<data_source>/accuracy``: the share the rule scores
    1.0, where a rule exists for the source and the data has a ground truth. ``val/score`` and
    ``val/accuracy`` average over sources.

    Generation runs in chunks of ``data.val_batch_size`` prompts (over all ranks); before each, a stop
    signal (``stop``) ends validation at once with no metrics, so a long validation never outlasts the
    grace period between SIGTERM and SIGKILL.
    """
    mine = run.val_records[info.rank :: info.world_size]
    chunk = max(1, cfg.data.val_batch_size // info.world_size)
    num_chunks = int(all_reduce_scalar(float(-(-len(mine) // chunk)), "max"))  # the same on every rank
    parts = []
    for c in range(num_chunks):
        if stop is not None and stop.requested():
            logger.warning("validation stopped after %d of %d chunks (%s)", c, num_chunks, stop.name)
            return {}
        records = mine[c * chunk : (c + 1) * chunk]
        parts.append(
            sample(
                run.sampler,
                records,
                do_sample=cfg.rollout.val_do_sample,
                micro_batch_size=chunk,
                ignore_eos=False,
            )
        )
    rollout = concat_rollouts(parts) if parts else sample(run.sampler, [], do_sample=False)
    texts = decode_responses(run.tokenizer, rollout)
    model_scores = (
        rewards.rollout_reward_model_scores(
            run.reward_model, rollout, micro_batch_size=cfg.reward.micro_batch_size_per_gpu
        )
        if run.reward_model is not None
        else None
    )

    def rule_scores() -> list[float | None]:
        return [
            run.scorer(r.data_source, t, r.ground_truth, r.extra_info)
            if rewards.has_rule(r.data_source, cfg.reward.custom_function)
            and (r.ground_truth is not None or cfg.reward.custom_function is not None)
            else None
            for r, t in zip(mine, texts, strict=True)
        ]

    rule = agree_on_failure(rule_scores, rewards.RewardError)
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
    totals: dict[str, list[float]] = {}
    for part in all_gather_object(sums):
        for source, s in part.items():
            t = totals.setdefault(source, [0.0, 0.0, 0.0, 0.0])
            for i in range(4):
                t[i] += s[i]
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
    return out
