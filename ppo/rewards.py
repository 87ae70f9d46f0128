"""Rule rewards: score a decoded response against the row's ground truth, chosen by ``data_source``.

A scorer has verl's signature ``(data_source, solution_str, ground_truth, extra_info) -> float``::

    score_fn = make_rule_scorer(cfg.reward.custom_function, cfg.reward.format_score)
    scores = [score_fn(r.data_source, text, r.ground_truth, r.extra_info) for r, text in ...]

The built-in scorer handles GSM8K-style answers (``#### <number>`` at the end), which the synthetic
task of ``scripts/make_tiny_assets.py`` (``data_source="synthetic/arith"``) also uses. A user's scorer
is given as ``reward.custom_function=module.path:function`` or ``path/to/file.py:function``.

Learned reward models (``reward.style=model``) are scored by ``reward_model_scores``; ranking
(``reward.style=ranking``) turns the rule's or the model's scores of a group into competition ranks
(``competition_ranks``: 0 = best, ties share the better rank) and ranks into scores (``rank_scores``
for sampled groups, ``scores_from_ranks`` for the ranks of offline data). All give the same
per-sequence ``scores [B]``.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
import logging
import math
import re
import sys
from collections.abc import Callable, Sequence
from numbers import Real
from pathlib import Path
from typing import Any, Literal

import torch

from ppo import models, sharding
from ppo.batch import Batch, Rollout, decode_responses
from ppo.config import RewardConfig
from ppo.data import PromptRecord
from ppo.distributed import agree_on_failure
from ppo.packing import DUMMY_SEQUENCE, pack_sequences, plan_eval_micro_batches

logger = logging.getLogger("ppo")

RuleScorer = Callable[[str, str, str | None, dict], float]
"""``(data_source, solution_str, ground_truth, extra_info) -> score`` (ground truth None where the data
has none)."""

GSM8K_CLIP_CHARS = 300
"""Only the last this many characters of a response are searched for the answer (as verl does), so a
long response cannot win by listing many ``####`` lines early on."""

# "#### 1,234.5", "#### $72", "#### -$5", "####  -3". The number must start with a digit; a trailing
# sentence period is not part of it. Spaces or tabs may follow ####, a newline may not.
_GSM8K_ANSWER = re.compile(r"####[ \t]*(-?\$?|\$-)[ \t]*([0-9][0-9,]*(?:\.[0-9]+)?)")
_NUMBER = re.compile(r"(-?\$?|\$-)[ \t]*([0-9][0-9,]*(?:\.[0-9]+)?)")


class RewardError(ValueError):
    """A reward function cannot be found or used; the message says which and why."""


def normalize_number(sign: str, digits: str) -> str:
    """Canonical text of a number: commas and ``$`` removed, leading zeros and trailing decimal zeros
    dropped, ``-0`` as ``0``. So ``"1,000"``, ``"$1000"`` and ``"1000.00"`` all give ``"1000"``, and
    ``"72.50"`` gives ``"72.5"``."""
    digits = digits.replace(",", "")
    whole, _, frac = digits.partition(".")
    whole = whole.lstrip("0") or "0"
    frac = frac.rstrip("0")
    text = f"{whole}.{frac}" if frac else whole
    negative = "-" in sign and text != "0"
    return f"-{text}" if negative else text


def extract_gsm8k_answer(solution_str: str) -> str | None:
    """The normalized number after the last ``####`` in the last ``GSM8K_CLIP_CHARS`` characters, or
    None when there is none."""
    matches = _GSM8K_ANSWER.findall(solution_str[-GSM8K_CLIP_CHARS:])
    if not matches:
        return None
    sign, digits = matches[-1]
    return normalize_number(sign, digits)


def _normalize_truth(ground_truth: str) -> str:
    """A ground truth that is a number is normalized like an answer; other text is only stripped."""
    text = str(ground_truth).strip()
    m = _NUMBER.fullmatch(text)
    return normalize_number(*m.groups()) if m else text


def gsm8k_score(solution_str: str, ground_truth: str, *, format_score: float = 0.0) -> float:
    """GSM8K rule: 1.0 if the last ``#### <number>`` near the end equals the ground truth, else
    ``format_score`` if there is such an answer, else 0.0.

    Both sides are compared as normalized number strings (``normalize_number``): commas and ``$`` are
    ignored and ``72.0`` equals ``72``, but no rounding happens (``72.01`` is wrong).
    """
    answer = extract_gsm8k_answer(solution_str)
    if answer is None:
        return 0.0
    return 1.0 if answer == _normalize_truth(ground_truth) else format_score


_GSM8K_SOURCES = ("openai/gsm8k", "gsm8k", "synthetic/arith")
RULE_DATA_SOURCES: tuple[str, ...] = _GSM8K_SOURCES
"""Data sources the built-in rule scorer knows."""


def default_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    *,
    format_score: float = 0.0,
) -> float:
    """Score one response with the built-in rule for its ``data_source``.

    Raises RewardError for a data source without a built-in rule (use ``reward.custom_function``).
    """
    if data_source in _GSM8K_SOURCES:
        return gsm8k_score(solution_str, ground_truth, format_score=format_score)
    raise RewardError(
        f"no rule reward for data_source={data_source!r}; known: {', '.join(RULE_DATA_SOURCES)}. "
        f"Score other data with reward.custom_function=module.path:function or file.py:function"
    )


def load_custom_function(spec: str, key: str = "reward.custom_function") -> Callable[..., Any]:
    """Import ``module.path:function`` or ``path/to/file.py:function`` and return the function (or class:
    ``rollout.multi_turn.env``); errors name ``key``.

    Raises RewardError for a malformed spec, a missing file or module, a missing attribute (with the
    closest names) or an attribute that is not callable. Errors raised by the module's own code while
    it is imported propagate unchanged.
    """
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise RewardError(
            f"{key}={spec!r} must look like module.path:function or path/to/file.py:function"
        )
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target)
        if not path.is_file():
            raise RewardError(f"{key}={spec!r}: file {path} does not exist")
        # A name that is the same in every process, so objects from the module unpickle on any rank.
        module_name = "ppo_custom_reward_" + re.sub(r"\W", "_", str(path.resolve()))
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        if module_spec is None or module_spec.loader is None:
            raise RewardError(f"{key}={spec!r}: cannot import {path} as a Python file")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module  # so pickling and dataclasses inside it work
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[module_name]
            raise RewardError(
                f"{key}={spec!r}: importing {path} raised {type(e).__name__}: {e}"
            ) from e
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            if e.name is None or not (target == e.name or target.startswith(e.name + ".")):
                raise  # the module exists but one of its own imports is missing
            raise RewardError(
                f"{key}={spec!r}: no module named {e.name!r} (is it on PYTHONPATH?)"
            ) from e
        except Exception as e:
            raise RewardError(
                f"{key}={spec!r}: importing {target} raised {type(e).__name__}: {e}"
            ) from e
    if not hasattr(module, name):
        public = [k for k in vars(module) if not k.startswith("_") and callable(getattr(module, k))]
        close = difflib.get_close_matches(name, public, n=3)
        hint = f"; did you mean {' or '.join(close)}?" if close else f"; it defines {sorted(public)}"
        raise RewardError(f"{key}={spec!r}: {target} has no attribute {name!r}{hint}")
    fn = getattr(module, name)
    if not callable(fn):
        raise RewardError(
            f"{key}={spec!r}: {target}.{name} is a {type(fn).__name__}, not a function"
        )
    return fn


def make_rule_scorer(custom_function: str | None, format_score: float) -> RuleScorer:
    """The rule scorer of a run: the user's function if given, else ``default_compute_score``.

    A custom function is called as ``fn(data_source, solution_str, ground_truth, extra_info)`` and must
    return a number or a dict with a ``"score"`` number (verl's convention); ``format_score`` applies to
    the built-in scorer only.
    """
    if custom_function is None:
        return functools.partial(default_compute_score, format_score=format_score)
    fn = load_custom_function(custom_function)

    def score(data_source: str, solution_str: str, ground_truth: str | None, extra_info: dict) -> float:
        try:
            result = fn(data_source, solution_str, ground_truth, extra_info)
        except Exception as e:
            raise RewardError(
                f"reward.custom_function={custom_function!r} raised {type(e).__name__}: {e} "
                f"(data_source={data_source!r}, response {solution_str[:60]!r})"
            ) from e
        value = result.get("score") if isinstance(result, dict) else result
        if not isinstance(value, Real) or isinstance(value, bool):
            raise RewardError(
                f"reward.custom_function={custom_function!r} returned {result!r:.80} for "
                f"data_source={data_source!r}; expected a number or a dict with a 'score' number"
            )
        # NaN and inf pass through: the trainer skips such a step on every rank and counts it.
        return float(value)

    return score


def has_rule(data_source: str, custom_function: str | None) -> bool:
    """Whether the rule reward can score ``data_source``: a custom function scores every source."""
    return custom_function is not None or data_source in RULE_DATA_SOURCES


def check_scorer(scorer: RuleScorer, data_source: str, ground_truth: str | None, extra_info: dict) -> None:
    """Call ``scorer`` once on an empty response before any model loads, so a broken reward function
    (it raises, returns no number) fails in seconds and not at the first scoring. A non-finite score
    only warns: the trainer skips such steps."""
    value = scorer(data_source, "", ground_truth, extra_info)
    if not math.isfinite(value):
        logger.warning("the rule reward returned %s for an empty response; such steps are skipped", value)


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
    lengths = rollout.response_mask.sum(-1).tolist()
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


def check_rule_coverage(scorer: RuleScorer, records: list[PromptRecord], custom_function: str | None) -> None:
    """Every training prompt's ``data_source`` has a rule scorer, and the scorer runs on the first one
    (``check_scorer``): found now, not at the first step."""
    unknown = sorted({r.data_source for r in records if not has_rule(r.data_source, custom_function)})
    if unknown:
        raise RewardError(
            f"no rule reward for data_source {', '.join(map(repr, unknown))} in data.train_files; known: "
            f"{', '.join(RULE_DATA_SOURCES)}. Set reward.custom_function=module:function or "
            f"file.py:function, or use a reward model (reward.style=model)"
        )
    first = records[0]
    check_scorer(scorer, first.data_source, first.ground_truth, first.extra_info)


def batch_scores(
    batch: Batch,
    reward: RewardConfig,
    *,
    group_size: int,
    scorer: RuleScorer,
    tokenizer: Any,
    reward_model: torch.nn.Module | None,
) -> torch.Tensor:
    """Per-sequence scores ``[B]`` of a step's batch, on its device: the rule or the reward model; with
    ``reward.style=ranking`` scores from each group's ranks (the data set's for offline groups, by the
    rule or the reward model for sampled ones); with ``reward.style=dataset`` the data set's scores. A
    reward function that fails on any rank stops every rank."""
    if reward.style == "dataset":
        return batch.data_scores
    offline_rows = batch.data_ranks >= 0 if batch.data_ranks is not None else None
    data_only = reward.style == "ranking" and offline_rows is not None and bool(offline_rows.all())
    if data_only:
        scores = torch.zeros(len(batch.records))
    elif uses_reward_model(reward):
        scores = rollout_reward_model_scores(
            reward_model, batch.rollout, micro_batch_size=reward.micro_batch_size_per_gpu
        )
    else:
        scores = rule_scores(scorer, batch.records, decode_responses(tokenizer, batch.rollout))
    if reward.style == "ranking":
        scores = rank_scores(scores, batch.group_ids.cpu(), reward.rank_scores)
        if offline_rows is not None and bool(offline_rows.any()):
            rows = offline_rows.cpu()
            scores[rows] = scores_from_ranks(
                batch.data_ranks[offline_rows].cpu(), group_size, reward.rank_scores
            )
    return scores.to(batch.response_mask.device)


def rule_scores(scorer: RuleScorer, records: list[PromptRecord], texts: list[str]) -> torch.Tensor:
    """``[B]`` float32 (CPU): the rule's score of each response text against its record; a reward
    function that fails on any rank stops every rank (``agree_on_failure``)."""

    def score_all() -> torch.Tensor:
        return torch.tensor(
            [
                scorer(r.data_source, t, r.ground_truth, r.extra_info)
                for r, t in zip(records, texts, strict=True)
            ],
            dtype=torch.float32,
        )

    return agree_on_failure(score_all, RewardError)


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
