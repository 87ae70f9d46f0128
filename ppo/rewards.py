"""Rule rewards: score a decoded response against the row's ground truth, chosen by ``data_source``.

A scorer takes verl's ``(data_source, solution_str, ground_truth, extra_info)`` and returns a ``Score``
(the number, and the other number-valued keys of a dict result)::

    score_fn = make_rule_scorer(cfg.reward.custom_function, cfg.reward.format_score, cfg.reward.reward_kwargs)
    scores = [score_fn(r.data_source, text, r.ground_truth, r.extra_info).value for r, text in ...]

The built-in scorer handles GSM8K-style answers (``#### <number>`` at the end), which the synthetic
task of ``scripts/make_tiny_assets.py`` (``data_source="synthetic/arith"``) also uses. A user's scorer
is given as ``reward.custom_function=module.path:function`` or ``path/to/file.py:function`` (``:function``
left out: ``compute_score``) and called by keyword, as verl calls it. With ``reward.pool_workers`` the batch
is scored in worker processes with a time limit (``ppo.reward_pool``); without, ``reward.timeout_s`` holds
in the trainer's process too (``make_rule_scorer(..., timeout_s=)``): a call past it stops the run. In
the trainer's process a function that raises or calls ``sys.exit()`` stops every rank with one line
naming it, the rank and the prompt's row; ``os._exit()`` (or a crash of the interpreter) cannot be
caught there and ends the rank: a function that may do that belongs in workers
(``reward.pool_workers > 0``), where it is a counted error.

Learned reward models (``reward.style=model``) are scored by ``reward_model_scores``; ranking
(``reward.style=ranking``) turns the rule's or the model's scores of a group into competition ranks
(``competition_ranks``: 0 = best, ties share the better rank) and ranks into scores (``rank_scores``
for sampled groups, ``scores_from_ranks`` for the ranks of offline data). All give the same
per-sequence ``scores [B]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import functools
import importlib
import importlib.util
import inspect
import logging
import math
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from numbers import Real
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch

from ppo import models, sharding
from ppo.batch import Batch, Rollout, decode_responses
from ppo.config import OverlongBufferConfig, RewardConfig
from ppo.data import PromptRecord
from ppo.distributed import agree_on_failure, all_gather_object
from ppo.packing import DUMMY_SEQUENCE, pack_sequences, plan_eval_micro_batches
from ppo.reward_pool import RewardPool

logger = logging.getLogger("ppo")


class Score(NamedTuple):
    """What a rule scorer returns for one response."""

    value: float
    """The score (NaN and inf pass through: the trainer skips such a step on every rank)."""
    extras: dict[str, float]
    """A dict result's other number-valued keys (verl's ``reward_extra_info``), logged as metrics."""


RuleScorer = Callable[[str, str, str | None, dict], Score]
"""``(data_source, solution_str, ground_truth, extra_info) -> Score`` (ground truth None where the data
has none)."""

DEFAULT_FUNCTION_NAME = "compute_score"
"""The function of ``reward.custom_function=file.py`` without ``:name``, as verl's."""

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


def load_custom_function(
    spec: str, key: str = "reward.custom_function", default_name: str | None = DEFAULT_FUNCTION_NAME
) -> Callable[..., Any]:
    """Import ``module.path:function`` or ``path/to/file.py:function`` and return the function (or class:
    ``rollout.multi_turn.env``, which passes no ``default_name``); errors name ``key``. Without
    ``:function`` the name is ``default_name``.

    Raises RewardError for a malformed spec, a missing file or module, a missing attribute (with the
    closest names) or an attribute that is not callable. Errors raised by the module's own code while
    it is imported propagate unchanged.
    """
    target, sep, name = spec.rpartition(":")
    if not sep and default_name is not None:
        target, name = spec, default_name
    if not target or not name:
        shapes = "module.path:function or path/to/file.py:function"
        raise RewardError(
            f"{key}={spec!r} must look like {shapes}"
            + (f" (function default: {default_name})" if default_name else "")
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
            raise RewardError(f"{key}={spec!r}: importing {path} raised {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            if e.name is None or not (target == e.name or target.startswith(e.name + ".")):
                raise  # the module exists but one of its own imports is missing
            raise RewardError(f"{key}={spec!r}: no module named {e.name!r} (is it on PYTHONPATH?)") from e
        except Exception as e:
            raise RewardError(f"{key}={spec!r}: importing {target} raised {type(e).__name__}: {e}") from e
    if not hasattr(module, name):
        public = [k for k in vars(module) if not k.startswith("_") and callable(getattr(module, k))]
        close = difflib.get_close_matches(name, public, n=3)
        hint = f"; did you mean {' or '.join(close)}?" if close else f"; it defines {sorted(public)}"
        raise RewardError(f"{key}={spec!r}: {target} has no attribute {name!r}{hint}")
    fn = getattr(module, name)
    if not callable(fn):
        raise RewardError(f"{key}={spec!r}: {target}.{name} is a {type(fn).__name__}, not a function")
    return fn


def make_rule_scorer(
    custom_function: str | None,
    format_score: float,
    reward_kwargs: dict[str, Any] | None = None,
    *,
    timeout_s: float | None = None,
) -> RuleScorer:
    """The rule scorer of a run: the user's function if given, else ``default_compute_score``.

    A custom function is called by keyword, as verl calls it: ``fn(data_source=, solution_str=,
    ground_truth=, extra_info=, **reward_kwargs)``, and must return a number or a dict with a ``"score"``
    number, or (an ``async def``) a coroutine that gives one, run to completion here (verl's convention; the dict's other number-valued keys become ``Score.extras``). A call that
    raises or returns anything else is a RewardError naming the function, the data source and the value.
    ``format_score`` applies to the built-in scorer only. ``timeout_s`` (the trainer's process, where
    ``reward.timeout_s`` would otherwise do nothing): a call of the custom function that runs longer is
    interrupted (SIGALRM, main thread only) and is a RewardError; code that hangs in C holding the GIL
    cannot be interrupted there, only in workers (``reward.pool_workers``).
    """
    if custom_function is None:
        builtin = functools.partial(default_compute_score, format_score=format_score)
        return lambda *row: Score(builtin(*row), {})
    fn = load_custom_function(custom_function)
    kwargs = dict(reward_kwargs or {})
    name = f"reward.custom_function={custom_function!r}"
    if is_trl_function(fn):
        return TRLScorer(fn, name, kwargs, timeout_s)
    dropped: set[str] = set()  # dict keys whose non-number values were not logged (warned once each)

    def score(data_source: str, solution_str: str, ground_truth: str | None, extra_info: dict) -> Score:
        try:
            with _time_limit(timeout_s):
                result = fn(
                    data_source=data_source,
                    solution_str=solution_str,
                    ground_truth=ground_truth,
                    extra_info=extra_info,
                    **kwargs,
                )
                if inspect.isawaitable(result):  # an async def compute_score: await it here
                    result = _await(result)
        except _CallTimedOut:
            raise RewardError(
                f"{name} ran longer than reward.timeout_s={timeout_s} (data_source={data_source!r}, response "
                f"{solution_str[:60]!r}); to score such calls reward.error_score and train on, set "
                "reward.pool_workers=1 or more"
            ) from None
        except KeyboardInterrupt:  # Ctrl-C while scoring: the trainer's own stop, not the function's
            raise
        except BaseException as e:  # sys.exit() too: a scorer must return, never end the trainer
            raise RewardError(
                f"{name} raised {type(e).__name__}: {e} (data_source={data_source!r}, response "
                f"{solution_str[:60]!r})" + (_EXIT_HINT if isinstance(e, SystemExit) else "")
            ) from e
        value = result.get("score") if isinstance(result, dict) else result
        if not _is_number(value):
            raise RewardError(
                f"{name} returned {result!r:.80} for data_source={data_source!r}, response "
                f"{solution_str[:60]!r}; expected a number or a dict with a 'score' number"
            )
        extras = {}
        if isinstance(result, dict):
            extras = {str(k): float(v) for k, v in result.items() if k != "score" and isinstance(v, Real)}
            for k, v in result.items():
                if k != "score" and not isinstance(v, Real) and str(k) not in dropped:
                    dropped.add(str(k))
                    logger.warning(
                        "%s returned %.60r for key %r, not a number: it is not logged as reward/extra/%s "
                        "(warned once)",
                        name,
                        v,
                        str(k),
                        k,
                    )
        return Score(float(value), extras)

    return score


TRL_RESERVED = ("prompts", "completions", "completion_ids", "trainer_state")
"""The arguments TRL's trainers give a reward function themselves (no data column takes their names)."""


def is_trl_function(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is a TRL-style batched reward function: it has parameters named ``prompts`` and
    ``completions`` (``f(prompts, completions, **kwargs) -> list[float]``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "prompts" in params and "completions" in params


class TRLScorer:
    """A TRL-style reward function called once per batch, as TRL's GRPO and RLOO trainers call it:
    ``fn(prompts=[...], completions=[...], ground_truth=[...], data_source=[...], extra_info=[...],
    <column>=[...], **reward.reward_kwargs) -> list[float]``. ``prompts`` are the prompt cells as the file
    holds them (strings or chat messages); ``completions`` are strings, or ``[{"role": "assistant",
    "content": text}]`` where the prompt is chat messages (TRL's conversational format); every other
    column of the file comes as a list (``ground_truth`` also from ``reward_model.ground_truth``). A
    function without ``**kwargs`` gets only the lists it names. ``reward.timeout_s`` holds for the whole
    call. Called in the trainer's process only: with ``reward.pool_workers`` it stops at start-up."""

    def __init__(
        self, fn: Callable[..., Any], name: str, kwargs: dict[str, Any], timeout_s: float | None
    ) -> None:
        self.fn, self.name, self.kwargs, self.timeout_s = fn, name, kwargs, timeout_s
        params = inspect.signature(fn).parameters.values()
        self.any_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        self.names = {p.name for p in params}

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: str | None, extra_info: dict
    ) -> Score:
        """A single row without its prompt: what reward workers do; a batched function cannot run there."""
        raise RewardError(
            f"{self.name} is a TRL-style batched function (prompts, completions): it runs in the trainer's "
            "process; set reward.pool_workers=0"
        )

    def score_batch(self, records: Sequence[PromptRecord], texts: Sequence[str]) -> list[Score]:
        """One call for the responses ``texts`` to ``records`` (the same length); a Score each."""
        columns: dict[str, list[Any]] = {
            "data_source": [r.data_source for r in records],
            "ground_truth": [r.ground_truth for r in records],
            "extra_info": [r.extra_info for r in records],
        }
        for key in dict.fromkeys(k for r in records for k in r.extra_info):
            if key not in TRL_RESERVED and key not in columns:
                columns[key] = [r.extra_info.get(key) for r in records]
        columns |= self.kwargs
        if not self.any_kwargs:
            columns = {k: v for k, v in columns.items() if k in self.names}
        prompts = [r.prompt if r.prompt is not None else r.prompt_text for r in records]
        completions = [
            t if isinstance(p, str) else [{"role": "assistant", "content": t}]
            for p, t in zip(prompts, texts, strict=True)
        ]
        try:
            with _time_limit(self.timeout_s):
                result = self.fn(prompts=prompts, completions=completions, **columns)
                if inspect.isawaitable(result):
                    result = _await(result)
        except _CallTimedOut:
            raise RewardError(
                f"{self.name} ran longer than reward.timeout_s={self.timeout_s} on a batch"
            ) from None
        except KeyboardInterrupt:
            raise
        except BaseException as e:
            raise RewardError(f"{self.name} raised {type(e).__name__}: {e} (a batch of {len(texts)})") from e
        values = list(result) if isinstance(result, (list, tuple)) or hasattr(result, "tolist") else None
        if values is not None and hasattr(result, "tolist"):
            values = result.tolist()
        if values is None or len(values) != len(texts) or not all(_is_number(v) for v in values):
            raise RewardError(
                f"{self.name} returned {result!r:.80} for {len(texts)} completions; expected a list of "
                f"{len(texts)} numbers (TRL's None, 'does not apply', has no meaning for a single function)"
            )
        return [Score(float(v), {}) for v in values]


def _await(awaitable: Any) -> Any:
    """Run an awaitable to completion from synchronous code: on a fresh event loop, or, where this thread
    already runs one (a notebook), on a fresh loop in a thread of its own."""

    async def wrap() -> Any:
        return await awaitable

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(wrap())
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = asyncio.run(wrap())
        except BaseException as e:
            out["error"] = e

    thread = threading.Thread(target=run, name="reward-await")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["result"]


class _CallTimedOut(BaseException):
    """SIGALRM's exception in an in-process reward call past its time limit (not an ``Exception``, so the
    function's own ``except Exception`` cannot swallow it)."""


@contextlib.contextmanager
def _time_limit(seconds: float | None) -> Iterator[None]:
    """Raise ``_CallTimedOut`` in the block after ``seconds`` (wall clock); no limit with None, off the
    main thread (signals reach the main thread only) or where there is no SIGALRM."""
    if (
        seconds is None
        or not hasattr(signal, "setitimer")
        or threading.current_thread() is not threading.main_thread()
    ):
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise _CallTimedOut

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


_EXIT_HINT = "; a reward function must return a score, not exit the process"


def _is_number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def has_rule(data_source: str, custom_function: str | None) -> bool:
    """Whether the rule reward can score ``data_source``: a custom function scores every source."""
    return custom_function is not None or data_source in RULE_DATA_SOURCES


def check_scorer(scorer: RuleScorer, data_source: str, ground_truth: str | None, extra_info: dict) -> None:
    """Call ``scorer`` once on an empty response before any model loads, so a broken reward function
    (it raises, returns no number) fails in seconds and not at the first scoring. A non-finite score
    only warns: the trainer skips such steps."""
    _warn_if_not_finite(scorer(data_source, "", ground_truth, extra_info).value)


def _warn_if_not_finite(value: float) -> None:
    """The start-up check's warning: a non-finite score of the empty response (such steps are skipped)."""
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


def check_rule_coverage(
    scorer: RuleScorer,
    records: list[PromptRecord],
    custom_function: str | None,
    pool: RewardPool | None = None,
) -> None:
    """Every training prompt's ``data_source`` has a rule scorer, and the scorer runs on the first one
    (``check_scorer``; in ``pool`` where given, so a function that hangs is stopped after its time limit):
    found now, not at the first step."""
    unknown = sorted({r.data_source for r in records if not has_rule(r.data_source, custom_function)})
    if unknown:
        raise RewardError(
            f"no rule reward for data_source {', '.join(map(repr, unknown))} in data.train_files; known: "
            f"{', '.join(RULE_DATA_SOURCES)}. Set reward.custom_function=module:function or "
            f"file.py:function, or use a reward model (reward.style=model)"
        )
    first = records[0]
    if isinstance(scorer, TRLScorer):
        _warn_if_not_finite(scorer.score_batch([first], [""])[0].value)
    if pool is None:
        if not isinstance(scorer, TRLScorer):
            check_scorer(scorer, first.data_source, first.ground_truth, first.extra_info)
        return
    scored, _, _, failure = pool.score([first], [""])
    if failure is not None:
        raise RewardError(f"{pool.name} cannot score an empty response at start-up: {failure}")
    _warn_if_not_finite(scored[0].value)


def batch_scores(
    batch: Batch,
    reward: RewardConfig,
    *,
    group_size: int,
    scorer: RuleScorer,
    tokenizer: Any,
    reward_model: torch.nn.Module | None,
    pool: RewardPool | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-sequence scores ``[B]`` of a step's batch, on its device: the rule (in ``pool`` where given) or
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
        scores, metrics = rule_scores(scorer, batch.records, texts, pool)
    if reward.style == "ranking":
        scores = rank_scores(scores, batch.group_ids.cpu(), reward.rank_scores)
        if offline_rows is not None and bool(offline_rows.any()):
            rows = offline_rows.cpu()
            scores[rows] = scores_from_ranks(
                batch.data_ranks[offline_rows].cpu(), group_size, reward.rank_scores
            )
    return scores.to(batch.response_mask.device), metrics


def rule_scores(
    scorer: RuleScorer, records: list[PromptRecord], texts: list[str], pool: RewardPool | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """``[B]`` float32 (CPU) scores of the response texts against their records, and the call's metrics
    over every rank (the same on each): ``reward/extra/<key>`` (the mean of a dict result's other number
    keys, over the responses that had the key) and, with ``pool``, ``reward/timeouts`` and
    ``reward/errors`` (counts of failed calls, scored ``pool.error_score``).

    In process, a reward function that fails on any rank stops every rank (``agree_on_failure``), naming
    the prompt's row; in ``pool`` only a call that failed on every response of every rank stops the run.
    """
    if pool is None:
        scored = agree_on_failure(
            lambda: (
                scorer.score_batch(records, texts)
                if isinstance(scorer, TRLScorer)
                else [_score_row(scorer, r, t) for r, t in zip(records, texts, strict=True)]
            ),
            RewardError,
        )
        timeouts = errors = 0
        first = None
    else:
        results, timeouts, errors, first = pool.score(records, texts)
        scored = [Score(pool.error_score, {}) if s is None else s for s in results]
    extras: dict[str, list[float]] = {}
    for s in scored:
        for k, v in s.extras.items():
            extras.setdefault(k, []).append(v)
    mine = {
        "extras": {k: (sum(v), len(v)) for k, v in extras.items()},  # key -> (sum, count) on this rank
        "timeouts": timeouts,
        "errors": errors,
        "rows": len(texts),
        "first": first,
    }
    ranks: list[dict[str, Any]] = all_gather_object(mine)  # type: ignore[assignment]
    metrics: dict[str, float] = {}
    for k in sorted({k for rank in ranks for k in rank["extras"]}):
        parts = [rank["extras"][k] for rank in ranks if k in rank["extras"]]
        metrics[f"reward/extra/{k}"] = sum(p[0] for p in parts) / sum(p[1] for p in parts)
    if pool is not None:
        timeouts, errors = (sum(rank[key] for rank in ranks) for key in ("timeouts", "errors"))
        rows = sum(rank["rows"] for rank in ranks)
        failures = [f"rank {i}, {rank['first']}" for i, rank in enumerate(ranks) if rank["first"] is not None]
        if failures and not pool.logged:
            logger.warning("%s failed (scored %s; logged once): %s", pool.name, pool.error_score, failures[0])
            pool.logged = True
        if rows and timeouts + errors == rows:
            raise RewardError(
                f"{pool.name} failed on every one of the {rows} responses on all ranks (e.g. {failures[0]}); "
                "nothing to train on"
            )
        metrics["reward/timeouts"], metrics["reward/errors"] = float(timeouts), float(errors)
    return torch.tensor([s.value for s in scored], dtype=torch.float32), metrics


def _score_row(scorer: RuleScorer, record: PromptRecord, text: str) -> Score:
    """``scorer`` on one response; its RewardError names the prompt's row (and the rank, on several)."""
    try:
        return scorer(record.data_source, text, record.ground_truth, record.extra_info)
    except RewardError as e:
        dist = torch.distributed
        rank = f"rank {dist.get_rank()}: " if dist.is_initialized() and dist.get_world_size() > 1 else ""
        raise RewardError(f"{rank}{e}; prompt row {record.index}") from e


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


def overlong_penalties(
    response_mask: torch.Tensor, buffer: OverlongBufferConfig, *, max_response_length: int
) -> torch.Tensor:
    """``[B]`` DAPO's overlong penalty of each response of ``response_mask [B, R]`` with
    ``reward.overlong_buffer.enable`` (``overlong_penalty`` of its length), else zeros."""
    lengths = response_mask.sum(-1)
    if not buffer.enable:
        return torch.zeros(lengths.shape, dtype=torch.float32, device=lengths.device)
    return overlong_penalty(
        lengths,
        max_response_length=max_response_length,
        buffer_len=buffer.len,
        penalty_factor=buffer.penalty_factor,
    )


def overlong_metrics(penalties: torch.Tensor) -> dict[str, float]:
    """This rank's mean overlong penalty and share of penalized responses (reduced over ranks later)."""
    return {
        "reward/overlong_penalty": penalties.float().mean().item(),
        "reward/overlong_ratio": (penalties < 0).float().mean().item(),
    }
