"""A step's rewards: rule scores of decoded responses (the scorer itself is ``ppo.rule_scoring``; in
worker processes with ``reward.pool_workers``, ``ppo.reward_pool``), reward-model scores, ranking, and
DAPO's overlong penalty.

    scores, metrics = rule_scores(scorer, records, texts, pool)      # [B] float32, reward/* metrics

Learned reward models (``reward.style=model``) are scored by ``reward_model_scores``; ranking
(``reward.style=ranking``) turns the rule's or the model's scores of a group into competition ranks
(``competition_ranks``: 0 = best, ties share the better rank) and ranks into scores (``rank_scores``
for sampled groups, ``scores_from_ranks`` for the ranks of offline data). All give the same
per-sequence ``scores [B]``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from ppo import models, sharding
from ppo.batch import Batch, Rollout, decode_responses
from ppo.config import RewardConfig
from ppo.data import PromptRecord
from ppo.distributed import agree_on_failure, all_gather_object
from ppo.packing import DUMMY_SEQUENCE, pack_sequences, plan_eval_micro_batches
from ppo.reward_pool import PoolScores, RewardPool
from ppo.rule_scoring import (
    RULE_DATA_SOURCES,
    RewardError,
    RewardFunctions,
    RuleScorer,
    Score,
    TrainerProgress,
    WeightedScore,
    has_rule,
    score_rows,
    warn_if_not_finite,
)
from ppo.user_code import StoppedInUserCode

logger = logging.getLogger("ppo")


RankScoreMode = Literal["best", "linear"]
RANK_SCORE_MODES: tuple[str, ...] = ("best", "linear")
"""How ranks become scores (``reward.rank_scores``): ``best`` 1 for rank 0 and 0 for the rest, ``linear``
``1 - rank / (k - 1)`` in a group of ``k``."""


def competition_ranks(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Rank of each sequence within its group, 0 = best (highest score), ties sharing the better rank.

    Competition ("1224") ranking: ``rank_i = #{j in the group of i : scores_j > scores_i}``, so scores
    ``[5, 9, 9, 1]`` rank ``[2, 0, 0, 3]``. ``scores``, ``group_ids``: ``[B]``; returns ``[B]`` long.
    A non-finite score gets some rank (``rank_scores`` makes its whole group NaN).
    """
    num = scores.numel()
    pos = torch.arange(num, device=scores.device)
    if num == 0:
        return pos
    # Order by group, then by descending score: two stable sorts, the second on the primary key.
    order = torch.sort(scores, descending=True, stable=True).indices
    order = order[torch.sort(group_ids[order], stable=True).indices]
    s, g = scores[order], group_ids[order]
    new_group = torch.ones(num, dtype=torch.bool, device=scores.device)
    new_group[1:] = g[1:] != g[:-1]
    new_value = new_group.clone()
    new_value[1:] |= s[1:] != s[:-1]
    # A sequence's rank is where its run of equal scores starts, counted from its group's start.
    group_start = torch.cummax(torch.where(new_group, pos, 0), 0).values
    value_start = torch.cummax(torch.where(new_value, pos, 0), 0).values
    ranks = torch.empty_like(pos)
    ranks[order] = value_start - group_start
    return ranks


def _scores_of_ranks(ranks: torch.Tensor, group_sizes: torch.Tensor, mode: str) -> torch.Tensor:
    """``best``: ``rank == 0``; ``linear``: ``1 - rank / (k - 1)`` (1 in a group of one). Float32 ``[B]``."""
    if mode == "best":
        return (ranks == 0).float()
    if mode == "linear":
        return 1.0 - ranks.float() / (group_sizes - 1).clamp(min=1).float()
    raise ValueError(f"unknown rank score mode {mode!r}; known: {', '.join(RANK_SCORE_MODES)}")


def rank_scores(scores: torch.Tensor, group_ids: torch.Tensor, mode: RankScoreMode = "best") -> torch.Tensor:
    """Ranking reward of sampled groups (the ``n`` responses to one prompt), from their scores.

    The scores are ranked within each group (``competition_ranks``: higher is better, ties share the
    better rank) and the ranks turned into scores by ``mode`` (``scores_from_ranks``), with ``k`` the
    group's size. ``best``: every response tied for the group's best gets 1, the others 0 (a group whose
    responses all score the same gets all ones, and a group-baseline advantage of zero). ``linear``:
    ``1 - rank / (k - 1)``, e.g. scores ``[3, 1, 3, 0]`` rank ``[0, 2, 0, 3]`` and score
    ``[1, 1/3, 1, 0]``. A group with a NaN or infinite score gets NaN throughout, so the trainer skips
    the step as it does for a non-finite rule or model score. ``scores``, ``group_ids``: ``[B]``.
    """
    if scores.numel() == 0:
        return scores.clone()
    ranks = competition_ranks(scores, group_ids)
    counts = torch.bincount(group_ids)
    out = _scores_of_ranks(ranks, counts[group_ids], mode).to(scores.dtype)
    bad = ~torch.isfinite(scores)
    if bool(bad.any()):
        bad_group = torch.zeros(counts.numel(), dtype=torch.bool, device=scores.device)
        bad_group[group_ids[bad]] = True
        out[bad_group[group_ids]] = math.nan
    return out


def scores_from_ranks(ranks: torch.Tensor, group_size: int, mode: RankScoreMode) -> torch.Tensor:
    """Scores ``[B]`` (float32) of given ranks (0 = best) in groups of ``group_size`` (offline data).

    ``best``: 1 for rank 0, else 0; ``linear``: ``1 - rank / (group_size - 1)``, so ranks ``[0, 0, 2, 3]``
    of a group of 4 score ``[1, 1, 1/3, 0]``. Raises ValueError for a rank outside ``[0, group_size)``.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if ranks.numel() and bool(((ranks < 0) | (ranks >= group_size)).any()):
        raise ValueError(f"ranks must lie in [0, {group_size}); got {ranks.tolist()}")
    return _scores_of_ranks(ranks, torch.full_like(ranks, group_size), mode)


@torch.no_grad()
def reward_model_scores(
    reward_model: torch.nn.Module,
    seqs: Sequence[Sequence[int]],
    *,
    micro_batch_size: int,
    device: torch.device | str,
) -> torch.Tensor:
    """The reward model's score of each whole sequence (prompt + response tokens), ``[B]`` float32 on CPU.

    Sequences are packed ``micro_batch_size`` at a time and scored at their last token
    (``models.reward_scores``). Every rank must call it: ranks may hold different numbers of sequences,
    so the micro-batch count is agreed and a rank out of sequences forwards a dummy one (each forward of
    a sharded model is a collective). The gathered parameters are released afterwards.
    """
    out = torch.zeros(len(seqs))
    groups = plan_eval_micro_batches(
        [len(s) for s in seqs], use_dynamic_bsz=False, max_tokens=0, micro_batch_size=micro_batch_size
    )
    for group in groups:
        packed = pack_sequences([seqs[i] for i in group] or [DUMMY_SEQUENCE], device)
        scores = models.reward_scores(
            reward_model, packed.input_ids, packed.position_ids, packed.cu_seqlens, packed.offsets
        )
        if group:
            out[torch.tensor(group)] = scores.float().cpu()
    sharding.release(reward_model)
    return out


def rollout_reward_model_scores(
    reward_model: torch.nn.Module, rollout: Rollout, *, micro_batch_size: int
) -> torch.Tensor:
    """The reward model's score of each sequence ``[B]`` (CPU), read at its last token."""
    lengths = rollout.attention_mask.sum(-1).tolist()
    seqs = [
        p.tolist() + r[: int(n)]
        for p, r, n in zip(rollout.prompts, rollout.responses.tolist(), lengths, strict=True)
    ]
    with torch.no_grad():
        return reward_model_scores(
            reward_model,
            seqs,
            micro_batch_size=micro_batch_size,
            device=rollout.responses.device,
        )


# ----------------------------------------------------------------------------------------------------
# A run's reward: what it needs, and a step's scores
# ----------------------------------------------------------------------------------------------------


def uses_reward_model(reward: RewardConfig) -> bool:
    """Whether a reward model scores the responses (``style=model``, or ranking by the model)."""
    return reward.style == "model" or (reward.style == "ranking" and reward.ranking_by == "model")


def needs_rule_scores(reward: RewardConfig, offline_fraction: float) -> bool:
    """Whether training responses are scored by the rule: not with a reward model, and not when every
    group comes from the data set with its own ranks or scores."""
    from_data = offline_fraction == 1.0 and reward.style in ("ranking", "dataset")
    return not uses_reward_model(reward) and not from_data


def needs_ground_truth(reward: RewardConfig, offline_fraction: float) -> bool:
    """The built-in rule scorers compare with a ground truth; a reward model or a custom function
    (which gets None) does not need one."""
    return needs_rule_scores(reward, offline_fraction) and reward.custom_function is None


def check_rule_coverage(
    scorer: RuleScorer | RewardFunctions | None,
    records: list[PromptRecord],
    custom_function: str | list[str] | None,
    pool: RewardPool | None = None,
    trainer_state: TrainerProgress | None = None,
) -> None:
    """Every training prompt's ``data_source`` has a rule scorer, and the scorer runs on an empty response
    to the first one (in ``pool`` where given, so a function that hangs is stopped after its time limit;
    a TRL-style function gets ``trainer_state``): found now, not at the first step. A non-finite score
    only warns (the trainer skips such steps)."""
    unknown = sorted({r.data_source for r in records if not has_rule(r.data_source, custom_function)})
    if unknown:
        raise RewardError(
            f"no rule reward for data_source {', '.join(map(repr, unknown))} in data.train_files; known: "
            f"{', '.join(RULE_DATA_SOURCES)}. Set reward.custom_function=module:function or "
            f"file.py:function, or use a reward model (reward.style=model)"
        )
    first = records[0]
    if pool is None:
        (score,) = _score_here(scorer, [first], [""], [[]], trainer_state)
    else:
        out = pool.score([first], [""])
        if out.first is not None:
            raise RewardError(f"{pool.name} cannot score an empty response at start-up: {out.first}")
        score = out.scored[0]
    if not _declined(score):
        warn_if_not_finite(score.value)


def response_ids(rollout: Rollout) -> list[list[int]]:
    """Each response's token ids without padding, up to and including its EOS (TRL's
    ``completion_ids``): the tokens ``decode_responses`` decodes (a multi-turn rollout's observations
    too)."""
    rows = zip(rollout.responses.tolist(), rollout.attention_mask.tolist(), strict=True)
    return [[t for t, m in zip(tokens, mask, strict=True) if m] for tokens, mask in rows]


def batch_scores(
    batch: Batch,
    reward: RewardConfig,
    *,
    group_size: int,
    scorer: RuleScorer | RewardFunctions | None,
    tokenizer: Any,
    reward_model: torch.nn.Module | None,
    pool: RewardPool | None = None,
    stop: Callable[[], bool] | None = None,
    trainer_state: TrainerProgress | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-sequence scores ``[B]`` of a step's batch, on its device: the rule (in ``pool`` where given,
    which ends its call early once ``stop()``, this rank's stop request, turns true; TRL-style functions
    get ``trainer_state`` and the responses' token ids) or
    the reward model; with ``reward.style=ranking`` scores from each group's ranks (the data set's for
    offline groups, by the rule or the reward model for sampled ones); with ``reward.style=dataset`` the
    data set's scores. Also the rule's metrics (``rule_scores``; {} without the rule). A reward
    function that fails on any rank stops every rank."""
    metrics: dict[str, float] = {}
    if reward.style == "dataset":
        return batch.data_scores, metrics
    offline_rows = batch.data_ranks >= 0 if batch.data_ranks is not None else None
    data_only = reward.style == "ranking" and offline_rows is not None and bool(offline_rows.all())
    if data_only:
        scores = torch.zeros(len(batch.records))
    elif uses_reward_model(reward):
        scores = rollout_reward_model_scores(
            reward_model, batch.rollout, micro_batch_size=reward.micro_batch_size_per_gpu
        )
    else:
        texts = decode_responses(tokenizer, batch.rollout)
        scores, metrics = rule_scores(
            scorer,
            batch.records,
            texts,
            pool,
            stop,
            completion_ids=response_ids(batch.rollout),
            trainer_state=trainer_state,
            group_ids=batch.group_ids,
        )
    if reward.style == "ranking":
        scores = rank_scores(scores, batch.group_ids.cpu(), reward.rank_scores)
        if offline_rows is not None and bool(offline_rows.any()):
            rows = offline_rows.cpu()
            scores[rows] = scores_from_ranks(
                batch.data_ranks[offline_rows].cpu(), group_size, reward.rank_scores
            )
    return scores.to(batch.attention_mask.device), metrics


def rule_scores(
    scorer: RuleScorer | RewardFunctions | None,
    records: list[PromptRecord],
    texts: list[str],
    pool: RewardPool | None = None,
    stop: Callable[[], bool] | None = None,
    *,
    completion_ids: list[list[int]] | None = None,
    trainer_state: TrainerProgress | None = None,
    group_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``[B]`` float32 (CPU) scores of the response texts against their records, and the call's metrics
    over every rank (``rule_results``). A response every function returned None for (TRL's "does not
    apply") scores the mean of the other responses of its group (``group_ids [B]``; without them the
    batch is one group), 0 where none of them scored: TRL leaves such a response out of its group's
    baseline and gives it no advantage, and so does a group baseline here (its advantage is 0; the
    group's mean is unchanged, its std counts it at the mean)."""
    scored, metrics = rule_results(
        scorer, records, texts, pool, stop, completion_ids=completion_ids, trainer_state=trainer_state
    )
    values = torch.tensor([s.value for s in scored], dtype=torch.float32)
    declined = torch.tensor([_declined(s) for s in scored], dtype=torch.bool)
    if bool(declined.any()):
        groups = group_ids.cpu() if group_ids is not None else torch.zeros(len(scored), dtype=torch.long)
        kept, num_groups = ~declined, int(groups.max()) + 1
        sums = torch.zeros(num_groups).index_add_(0, groups[kept], values[kept])
        counts = torch.bincount(groups[kept], minlength=num_groups)
        means = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros(num_groups))
        values[declined] = means[groups[declined]]
    return values, metrics


@dataclasses.dataclass
class _RankScoring:
    """What one rank's scoring call tells the others (``rule_results`` gathers it)."""

    sums: dict[str, tuple[float, float, int]]
    """Metric key (``reward/extra/<key>``, ``reward/<name>``) -> sum, sum of squares and count of its values."""
    call: PoolScores
    """The call's counts (the scores themselves stay on the rank)."""
    declined: int
    """Responses every function returned None for."""
    first_declined: str | None
    """The first of them, ``prompt row N``."""
    not_finite: str | None
    """The first NaN or inf a function of a list returned, naming the function and the row."""


def rule_results(
    scorer: RuleScorer | RewardFunctions | None,
    records: list[PromptRecord],
    texts: list[str],
    pool: RewardPool | None = None,
    stop: Callable[[], bool] | None = None,
    *,
    completion_ids: list[list[int]] | None = None,
    trainer_state: TrainerProgress | None = None,
) -> tuple[list[Score | WeightedScore], dict[str, float]]:
    """The rule's result for each response text against its record (a ``WeightedScore`` from several
    functions or a TRL-style one, with each function's part; TRL-style functions get ``completion_ids``,
    each response's token ids, and ``trainer_state``), and the call's metrics over every rank (the same on
    each): ``reward/extra/<key>`` (the mean of a dict result's other number keys, over the responses that
    had the key); for ``reward.custom_function`` as a list, ``reward/<name>/mean`` and ``/std`` of each
    function's own scores (``<name>`` its ``__name__``, made unique; NaN where it scored none), over the
    responses it scored (not those it returned None for, as TRL's ``rewards/<name>/mean``); with ``pool``,
    ``reward/timeouts`` and ``reward/errors`` (counts of failed calls, scored ``pool.error_score``).

    In process, a reward function that fails on any rank stops every rank (``agree_on_failure``), naming
    the function and the prompt's row; in ``pool`` only a call that failed on every response of every
    rank stops the run. Rows that ``reward.total_timeout_s`` cut count as timeouts (one warning a run
    names the key); rows abandoned because ``stop()`` turned true (``RewardPool.score``) score
    ``pool.error_score`` and count as nothing: the trainer stops at its next phase boundary without
    training on them. A NaN from a function of a list is named in a warning (the step is then skipped);
    responses that every function returned None for are warned about once a run.
    """
    if pool is None:
        scored = agree_on_failure(
            lambda: _score_here(scorer, records, texts, completion_ids, trainer_state), RewardError
        )
        out = PoolScores(scored=scored)  # nothing failed: a failure stopped the run above
    else:
        out = pool.score(records, texts, stop)
        scored = [Score(pool.error_score, {}) if s is None else s for s in out.scored]
    names, labels = listed_functions(scorer, pool)
    call = dataclasses.replace(out, scored=[None] * len(out.scored))
    mine = _RankScoring(sums={}, call=call, declined=0, first_declined=None, not_finite=None)
    values: dict[str, list[float]] = {f"reward/{name}": [] for name in names}
    for record, s in zip(records, scored, strict=True):
        for k, v in s.extras.items():
            values.setdefault(f"reward/extra/{k}", []).append(v)
        if _declined(s):
            mine.declined += 1
            mine.first_declined = mine.first_declined or f"prompt row {record.index}"
        if names and isinstance(s, WeightedScore):
            for name, label, v in zip(names, labels, s.parts, strict=True):
                if v is not None:
                    values[f"reward/{name}"].append(v)
                    if not math.isfinite(v) and mine.not_finite is None:
                        mine.not_finite = f"{label} returned {v} for prompt row {record.index}"
    mine.sums = {k: (sum(v), sum(x * x for x in v), len(v)) for k, v in values.items()}
    ranks: list[_RankScoring] = all_gather_object(mine)  # type: ignore[assignment]
    totals: dict[str, list[float]] = {}
    for rank in ranks:
        for k, part in rank.sums.items():
            t = totals.setdefault(k, [0.0, 0.0, 0.0])
            for i, x in enumerate(part):
                t[i] += x
    metrics: dict[str, float] = {}
    for k, (total, squares, count) in sorted(totals.items()):
        if k.startswith("reward/extra/"):
            metrics[k] = total / count
            continue
        mean = total / count if count else math.nan  # TRL's nanmean and nanstd (Bessel's correction)
        std = math.sqrt(max(squares - count * mean**2, 0.0) / (count - 1)) if count > 1 else math.nan
        metrics[f"{k}/mean"], metrics[f"{k}/std"] = mean, std
    _warn_about_parts(scorer, ranks)
    if pool is not None:
        metrics.update(pool.report_call([rank.call for rank in ranks]))
    return scored, metrics


def _score_here(
    scorer: RuleScorer | RewardFunctions | None,
    records: list[PromptRecord],
    texts: list[str],
    completion_ids: list[list[int]] | None,
    trainer_state: TrainerProgress | None,
) -> list[Score | WeightedScore]:
    """``scorer`` on the responses in this process; its RewardError names the prompt's row (where one
    response failed) and, on several ranks, the rank. A stop signal abandons the call running and the
    rest (placeholder scores of 0, which the step that asks for the stop next never uses)."""
    try:
        if isinstance(scorer, RewardFunctions):
            return scorer.score_batch(records, texts, completion_ids, trainer_state)
        return score_rows(scorer, records, texts)
    except StoppedInUserCode:
        # A stop signal abandoned the call (``user_code.abandoned_on_stop``): these scores are never trained
        # on or reported, since every caller asks for the stop at its next boundary.
        return [Score(0.0, {}) for _ in records]
    except RewardError as e:
        dist = torch.distributed
        if dist.is_initialized() and dist.get_world_size() > 1:
            raise RewardError(f"rank {dist.get_rank()}: {e}") from e
        raise


def _declined(score: Score | WeightedScore) -> bool:
    """Whether every function returned None for the response (TRL's "does not apply")."""
    return isinstance(score, WeightedScore) and score.declined


def listed_functions(
    scorer: RuleScorer | RewardFunctions | None, pool: RewardPool | None
) -> tuple[list[str], list[str]]:
    """The metric names and the labels of the functions of ``reward.custom_function`` as a list (in
    ``pool`` where there is one); empty for one function."""
    source = pool if pool is not None else scorer
    if isinstance(source, (RewardPool, RewardFunctions)) and source.names:
        return source.names, source.labels
    return [], []


def _warn_about_parts(scorer: RuleScorer | RewardFunctions | None, ranks: list[_RankScoring]) -> None:
    """Name the function of a list that returned a NaN or inf (each call: the step is skipped), and, once
    a run, the responses that every function returned None for."""
    not_finite = [(i, r.not_finite) for i, r in enumerate(ranks) if r.not_finite is not None]
    if not_finite:
        logger.warning("%s (rank %d): the response's score is not finite", not_finite[0][1], not_finite[0][0])
    declined = sum(r.declined for r in ranks)
    if declined and isinstance(scorer, RewardFunctions) and not scorer.declined_warned:
        rank, row = next((i, r.first_declined) for i, r in enumerate(ranks) if r.first_declined is not None)
        logger.warning(
            "every reward function returned None for %d of %d responses (e.g. rank %d, %s), TRL's 'does not "
            "apply': such a response scores its group's mean in training (advantage 0 under a group "
            "baseline) and is left out of validation's scores (warned once)",
            declined,
            sum(len(r.call.scored) for r in ranks),
            rank,
            row,
        )
        scorer.declined_warned = True


def overlong_penalty(
    response_lengths: torch.Tensor, *, max_response_length: int, buffer_len: int, penalty_factor: float
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al., arXiv:2503.14476, eq. 13; verl's DAPO reward manager):
    ``min(-(L - (L_max - buffer_len)) / buffer_len · penalty_factor, 0)`` for a response of ``L`` tokens
    (EOS included), added to its score. 0 up to ``L_max - buffer_len`` tokens, then falling linearly to
    ``-penalty_factor`` at ``L_max``: with ``L_max = 8``, a buffer of 4 and factor 1, lengths 4, 5, 6, 8
    get 0, -0.25, -0.5, -1.0.

    Shapes: ``response_lengths [B]`` (any number type); returns ``[B]`` float32.
    """
    excess = response_lengths.float() - (max_response_length - buffer_len)
    return (-excess / buffer_len * penalty_factor).clamp(max=0.0)


def shape_scores(
    raw: torch.Tensor, response_mask: torch.Tensor, reward: RewardConfig, *, max_response_length: int
) -> tuple[torch.Tensor, dict[str, float]]:
    """The step's scores from the reward's ``raw [B]`` scores of the responses of ``response_mask
    [B, R]``: ``raw`` plus DAPO's overlong penalty of each response's length
    (``reward.overlong_buffer``, ``overlong_penalty``), and this rank's shaping metrics
    (``reward/overlong_penalty``, the mean penalty, and ``reward/overlong_ratio``, the share penalized;
    only with the buffer on). The one place a step's reward is shaped: the step, dynamic sampling and
    the accuracy filter call it on the rows they train."""
    buffer = reward.overlong_buffer
    if not buffer.enable:
        return raw + torch.zeros(raw.shape, dtype=torch.float32, device=raw.device), {}
    penalties = overlong_penalty(
        response_mask.sum(-1),
        max_response_length=max_response_length,
        buffer_len=buffer.len,
        penalty_factor=buffer.penalty_factor,
    )
    metrics = {
        "reward/overlong_penalty": penalties.float().mean().item(),
        "reward/overlong_ratio": (penalties < 0).float().mean().item(),
    }
    return raw + penalties, metrics
