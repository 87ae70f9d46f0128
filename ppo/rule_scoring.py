"""Rule rewards: score a decoded response against the row's ground truth, chosen by ``data_source``.

This module imports only the standard library, so a reward worker (``ppo.reward_worker``) builds its
scorer without loading torch or the trainer. A scorer takes verl's ``(data_source, solution_str,
ground_truth, extra_info)`` and returns a ``Score`` (the number, and the other number-valued keys of a
dict result)::

    score_fn = make_rule_scorer(cfg.reward.custom_function, cfg.reward.format_score, cfg.reward.reward_kwargs)
    scores = [score_fn(r.data_source, text, r.ground_truth, r.extra_info).value for r, text in ...]

The built-in scorer handles GSM8K-style answers (``#### <number>`` at the end), which the synthetic
task of ``scripts/make_tiny_assets.py`` (``data_source="synthetic/arith"``) also uses. A user's scorer
is given as ``reward.custom_function=module.path:function`` or ``path/to/file.py:function`` (``:function``
left out: ``compute_score``) and called by keyword, as verl calls it (``VerlScorer``). A function whose
parameters name one of TRL's arguments (``completions``, ``prompts``, ``completion_ids``,
``trainer_state``) is TRL's kind, called once per batch (``TRLScorer``). A list of functions (TRL's
``reward_funcs``, with ``reward.weights``, TRL's ``reward_weights``) is a ``RewardFunctions``: each
function called its own way, the score their weighted sum, None ("does not apply", TRL's) left out::

    scorer = make_rule_scorer(["a.py:f", "b.py:g"], 0.0, weights=[1.0, 0.5])
    scored = scorer.score_batch(records, texts, completion_ids, TrainerProgress.after(step, total, per_epoch))

With ``reward.pool_workers`` the batch
is scored in worker processes with a time limit (``ppo.reward_pool``); without, ``reward.timeout_s`` holds
in the trainer's process too (``make_rule_scorer(..., timeout_s=)``): a call past it stops the run. In
the trainer's process a function that raises or calls ``sys.exit()`` stops every rank with one line
naming it, the rank and the prompt's row (``ppo.rewards.rule_scores``); ``os._exit()`` (or a crash of
the interpreter) cannot be caught there and ends the rank: a function that may do that belongs in
workers (``reward.pool_workers > 0``), where it is a counted error. A stop signal abandons the call running
in the trainer's process and every later one (``user_code.abandoned_on_stop``).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from numbers import Real
from typing import TYPE_CHECKING, Any, NamedTuple

from ppo.user_code import (
    CallTimedOut,
    StoppedInUserCode,
    UserCodeError,
    abandoned_on_stop,
    load_user_object,
    time_limit,
)

if TYPE_CHECKING:
    from ppo.data import PromptRecord

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


class RewardError(UserCodeError):
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


def load_reward_function(spec: str, key: str = "reward.custom_function") -> Callable[..., Any]:
    """The function of ``reward.custom_function`` (``user_code.load_user_object``; without ``:name``, verl's
    ``compute_score``); RewardError naming ``key`` (``reward.custom_function[1]`` for a list's second) when
    it cannot be loaded."""
    return load_user_object(spec, key=key, default_name=DEFAULT_FUNCTION_NAME, error=RewardError)


def scorer_name(custom_function: str | list[str] | None) -> str:
    """What a rule scorer's failures are blamed on: ``reward.custom_function='r.py:score'`` (or the whole
    list), or the built-in rule."""
    return f"reward.custom_function={custom_function!r}" if custom_function else "the built-in rule reward"


def function_keys(custom_function: str | list[str]) -> list[str]:
    """The config key of each function: ``reward.custom_function`` for one, ``reward.custom_function[1]``
    for a list's second."""
    if isinstance(custom_function, str):
        return ["reward.custom_function"]
    return [f"reward.custom_function[{i}]" for i in range(len(custom_function))]


def function_labels(custom_function: str | list[str]) -> list[str]:
    """What each function's failures are blamed on: ``reward.custom_function='r.py:score'`` for one,
    ``reward.custom_function[1]='b.py:g'`` for a list's second."""
    specs = [custom_function] if isinstance(custom_function, str) else custom_function
    return [f"{key}={spec!r}" for key, spec in zip(function_keys(custom_function), specs, strict=True)]


def callable_name(fn: Callable[..., Any]) -> str:
    """A reward function's name as TRL logs it (``rewards/<name>/mean``): its ``__name__`` (a
    ``functools.partial``'s function's), or its class's for a callable object without one."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", type(fn).__name__)


RESERVED_NAMES = ("extra",)
"""Names a function's metrics cannot take: ``reward/extra/<key>`` holds the dict results' extras."""


def metric_names(names: Sequence[str]) -> list[str]:
    """The functions' names made unique in the list's order: a name taken already (or reserved) gets the
    first free ``_1``, ``_2``, ... suffix, so ``[f, f, g, f]`` gives ``[f, f_1, g, f_2]``."""
    taken = set(RESERVED_NAMES)
    out = []
    for name in names:
        unique, k = name, 0
        while unique in taken:
            k += 1
            unique = f"{name}_{k}"
        taken.add(unique)
        out.append(unique)
    return out


@dataclass(frozen=True)
class TrainerProgress:
    """What a TRL-style reward function gets as ``trainer_state``: the fields of Hugging Face's
    ``TrainerState`` that say how far training is (TRL passes its trainer's state so that a reward can
    change over training)."""

    global_step: int
    """Steps completed: 0 while the first step's responses are scored (TRL's: the optimizer steps done
    before the batch); validation after step ``s`` sees ``s``."""
    max_steps: int
    """The run's number of steps (``trainer.total_training_steps``, or epochs times steps per epoch)."""
    epoch: float
    """Passes over the training prompts completed, fractional: ``global_step / steps per epoch``."""

    @classmethod
    def after(cls, steps_done: int, max_steps: int, steps_per_epoch: int) -> TrainerProgress:
        """The progress after ``steps_done`` steps of ``max_steps``, ``steps_per_epoch`` steps a pass."""
        return cls(global_step=steps_done, max_steps=max_steps, epoch=steps_done / max(steps_per_epoch, 1))


class VerlScorer:
    """A verl-style function, called once per response by keyword, as verl calls it: ``fn(data_source=,
    solution_str=, ground_truth=, extra_info=, **reward_kwargs)``; it must return a number or a dict with
    a ``"score"`` number, or (an ``async def``) a coroutine that gives one, run to completion here (verl's
    convention; the dict's other number-valued keys become ``Score.extras``). A call that raises or
    returns anything else is a RewardError naming the function (``label``), the data source and the
    response. ``timeout_s`` (the trainer's process, where ``reward.timeout_s`` would otherwise do
    nothing): a call that runs longer is interrupted (SIGALRM, main thread only) and is a RewardError;
    code that hangs in C holding the GIL cannot be interrupted there, only in workers
    (``reward.pool_workers``)."""

    def __init__(
        self, fn: Callable[..., Any], label: str, kwargs: dict[str, Any], timeout_s: float | None
    ) -> None:
        self.fn, self.label, self.kwargs, self.timeout_s = fn, label, kwargs, timeout_s
        self.name = callable_name(fn)
        self.dropped: set[str] = set()  # dict keys whose non-number values were not logged (warned once each)

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: str | None, extra_info: dict
    ) -> Score:
        name, timeout_s = self.label, self.timeout_s
        try:
            with abandoned_on_stop(), time_limit(timeout_s):
                result = self.fn(
                    data_source=data_source,
                    solution_str=solution_str,
                    ground_truth=ground_truth,
                    extra_info=extra_info,
                    **self.kwargs,
                )
                if inspect.isawaitable(result):  # an async def compute_score: await it here
                    result = _await(result)
        except CallTimedOut:
            raise RewardError(
                f"{name} ran longer than reward.timeout_s={timeout_s} (data_source={data_source!r}, response "
                f"{solution_str[:60]!r}); to score such calls reward.error_score and train on, set "
                "reward.pool_workers=1 or more"
            ) from None
        except (KeyboardInterrupt, StoppedInUserCode):  # the trainer's own stop, not the function's
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
                if k != "score" and not isinstance(v, Real) and str(k) not in self.dropped:
                    self.dropped.add(str(k))
                    logger.warning(
                        "%s returned %.60r for key %r, not a number: it is not logged as reward/extra/%s "
                        "(warned once)",
                        name,
                        v,
                        str(k),
                        k,
                    )
        return Score(float(value), extras)


TRL_RESERVED = ("prompts", "completions", "completion_ids", "trainer_state")
"""The arguments TRL's trainers give a reward function themselves (no data column takes their names)."""


def is_trl_function(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is a TRL-style batched reward function: one of its parameters is named as an
    argument TRL's trainers give (``TRL_RESERVED``): ``f(completions, **kwargs)``, ``f(prompts,
    completions, **kwargs)``, ``f(completion_ids, **kwargs)`` (TRL's ``get_soft_overlong_punishment``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return any(name in params for name in TRL_RESERVED)


class TRLScorer:
    """A TRL-style reward function called once per batch, as TRL's GRPO and RLOO trainers call it:
    ``fn(prompts=[...], completions=[...], completion_ids=[...], trainer_state=..., ground_truth=[...],
    data_source=[...], extra_info=[...], <column>=[...], **reward.reward_kwargs) -> list[float | None]``.
    ``prompts`` are the prompt cells as the file holds them (strings or chat messages); ``completions`` are
    strings, or ``[{"role": "assistant", "content": text}]`` where the prompt is chat messages (TRL's
    conversational format); ``completion_ids`` each response's token ids up to and including its EOS (no
    padding); ``trainer_state`` a ``TrainerProgress``; every other column of the file comes as a list
    (``ground_truth`` also from ``reward_model.ground_truth``). A function without ``**kwargs`` gets only
    the arguments it names. None for a response is TRL's "does not apply". ``reward.timeout_s`` holds for
    the whole call. Called in the trainer's process only: a reward worker refuses it at start-up."""

    def __init__(
        self, fn: Callable[..., Any], label: str, kwargs: dict[str, Any], timeout_s: float | None
    ) -> None:
        self.fn, self.label, self.kwargs, self.timeout_s = fn, label, kwargs, timeout_s
        self.name = callable_name(fn)
        params = inspect.signature(fn).parameters.values()
        self.any_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        self.names = {p.name for p in params}

    def values(
        self,
        records: Sequence[PromptRecord],
        texts: Sequence[str],
        completion_ids: Sequence[list[int]] | None = None,
        trainer_state: TrainerProgress | None = None,
    ) -> list[float | None]:
        """One call for the responses ``texts`` (token ids ``completion_ids``) to ``records`` (the same
        length): a number each, None where the function returned None."""
        prompts = [r.prompt if r.prompt is not None else r.prompt_text for r in records]
        columns: dict[str, Any] = {
            "prompts": prompts,
            "completions": [
                t if isinstance(p, str) else [{"role": "assistant", "content": t}]
                for p, t in zip(prompts, texts, strict=True)
            ],
            "completion_ids": completion_ids,
            "trainer_state": trainer_state,
            "data_source": [r.data_source for r in records],
            "ground_truth": [r.ground_truth for r in records],
            "extra_info": [r.extra_info for r in records],
        }
        for key in dict.fromkeys(k for r in records for k in r.extra_info):
            if key not in columns:
                columns[key] = [r.extra_info.get(key) for r in records]
        columns |= self.kwargs
        if not self.any_kwargs:
            columns = {k: v for k, v in columns.items() if k in self.names}
        try:
            with abandoned_on_stop(), time_limit(self.timeout_s):
                result = self.fn(**columns)
                if inspect.isawaitable(result):
                    result = _await(result)
        except CallTimedOut:
            raise RewardError(
                f"{self.label} ran longer than reward.timeout_s={self.timeout_s} on a batch"
            ) from None
        except (KeyboardInterrupt, StoppedInUserCode):
            raise
        except BaseException as e:
            raise RewardError(f"{self.label} raised {type(e).__name__}: {e} (a batch of {len(texts)})") from e
        values = result.tolist() if hasattr(result, "tolist") else result
        if (
            not isinstance(values, (list, tuple))
            or len(values) != len(texts)
            or not all(v is None or _is_number(v) for v in values)
        ):
            raise RewardError(
                f"{self.label} returned {result!r:.80} for {len(texts)} completions; expected a list of "
                f"{len(texts)} numbers (or None where the function does not apply)"
            )
        return [None if v is None else float(v) for v in values]

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: str | None, extra_info: dict
    ) -> Score:
        """A single row without its prompt: what reward workers do; a batched function cannot run there."""
        raise self.not_per_response()

    def not_per_response(self) -> RewardError:
        """The error of calling it once per response (in a reward worker)."""
        return RewardError(
            f"{self.label} is a TRL-style batched function (prompts, completions): it runs in the trainer's "
            "process; set reward.pool_workers=0"
        )


class WeightedScore(NamedTuple):
    """What ``RewardFunctions`` (several functions, or one TRL-style one) give one response."""

    value: float
    """The weighted sum of the functions' scores, leaving out those that returned None (TRL's ``nansum``
    over functions); NaN where every function returned None (``declined``). A NaN or inf that a function
    returned stays in it (the trainer skips such a step)."""
    extras: dict[str, float]
    """The verl-style functions' dict extras (a key that two of them return: the first one's value)."""
    parts: tuple[float | None, ...]
    """Each function's own score, in the list's order; None where a TRL-style function returned None."""

    @property
    def declined(self) -> bool:
        """Whether every function returned None for the response (TRL's "does not apply" throughout)."""
        return all(p is None for p in self.parts)


def weighted_score(results: Sequence[Score | None], weights: Sequence[float]) -> WeightedScore:
    """The functions' ``results`` for one response (None: the function returned None), weighed:
    ``sum(w_i * s_i)`` over the functions that scored it, as TRL's ``(rewards_per_func * weights).nansum()``."""
    scored = [(w, s) for w, s in zip(weights, results, strict=True) if s is not None]
    extras: dict[str, float] = {}
    for _, s in scored:
        for k, v in s.extras.items():
            extras.setdefault(k, v)
    value = sum(w * s.value for w, s in scored) if scored else math.nan
    return WeightedScore(float(value), extras, tuple(None if s is None else s.value for s in results))


def score_rows(scorer: RuleScorer, records: Sequence[PromptRecord], texts: Sequence[str]) -> list[Score]:
    """A per-response ``scorer`` on each of ``texts``; its RewardError names the prompt's row."""
    out = []
    for record, text in zip(records, texts, strict=True):
        try:
            out.append(scorer(record.data_source, text, record.ground_truth, record.extra_info))
        except RewardError as e:
            raise RewardError(f"{e}; prompt row {record.index}") from e
    return out


class RewardFunctions:
    """``reward.custom_function`` as a list (TRL's ``reward_funcs``), or a single TRL-style function: each
    function called its own way (a ``VerlScorer`` per response, a ``TRLScorer`` once per batch), their
    scores summed with ``weights`` (``weighted_score``). ``names``: each function's metric name
    (``reward/<name>/mean``; ``metric_names`` of their ``__name__``s), for a list only."""

    def __init__(
        self, functions: list[VerlScorer | TRLScorer], weights: Sequence[float], *, listed: bool
    ) -> None:
        self.functions, self.weights, self.listed = functions, list(weights), listed
        self.labels = [f.label for f in functions]
        self.names = metric_names([f.name for f in functions]) if listed else []
        self.declined_warned = False
        """Whether the run has said once that every function returned None for a response."""

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: str | None, extra_info: dict
    ) -> WeightedScore:
        """One response (verl-style functions only: a TRL-style one raises, as in a reward worker)."""
        row = (data_source, solution_str, ground_truth, extra_info)
        return weighted_score([f(*row) for f in self.functions], self.weights)

    def score_batch(
        self,
        records: Sequence[PromptRecord],
        texts: Sequence[str],
        completion_ids: Sequence[list[int]] | None = None,
        trainer_state: TrainerProgress | None = None,
    ) -> list[WeightedScore]:
        """Every function on the responses ``texts`` to ``records``; a ``WeightedScore`` each."""
        columns: list[list[Score | None]] = []
        for f in self.functions:
            if isinstance(f, TRLScorer):
                values = f.values(records, texts, completion_ids, trainer_state)
                columns.append([None if v is None else Score(v, {}) for v in values])
            else:
                columns.append(score_rows(f, records, texts))
        return [weighted_score(row, self.weights) for row in zip(*columns, strict=True)]


def load_functions(
    custom_function: str | list[str],
    reward_kwargs: dict[str, Any] | None = None,
    timeout_s: float | None = None,
) -> list[VerlScorer | TRLScorer]:
    """Each function of ``reward.custom_function``, loaded and wrapped for its kind: ``TRLScorer`` where
    ``is_trl_function``, else ``VerlScorer``; every one gets ``reward_kwargs``."""
    specs = [custom_function] if isinstance(custom_function, str) else custom_function
    keys, labels = function_keys(custom_function), function_labels(custom_function)
    out: list[VerlScorer | TRLScorer] = []
    for spec, key, label in zip(specs, keys, labels, strict=True):
        fn = load_reward_function(spec, key=key)
        kind = TRLScorer if is_trl_function(fn) else VerlScorer
        out.append(kind(fn, label, dict(reward_kwargs or {}), timeout_s))
    return out


def make_rule_scorer(
    custom_function: str | list[str] | None,
    format_score: float,
    reward_kwargs: dict[str, Any] | None = None,
    *,
    timeout_s: float | None = None,
    weights: Sequence[float] | None = None,
) -> RuleScorer | RewardFunctions:
    """The rule scorer of a run: the user's function if given (``VerlScorer``), a ``RewardFunctions`` for
    a list of them, a TRL-style one or ``weights`` (default 1 each), else ``default_compute_score``.
    ``format_score`` applies to the built-in scorer only; ``timeout_s`` holds for each call of a function
    in this process (``VerlScorer``, ``TRLScorer``)."""
    if custom_function is None:
        builtin = functools.partial(default_compute_score, format_score=format_score)
        return lambda *row: Score(builtin(*row), {})
    functions = load_functions(custom_function, reward_kwargs, timeout_s)
    listed = isinstance(custom_function, list)
    if not listed and weights is None and isinstance(functions[0], VerlScorer):
        return functions[0]
    return RewardFunctions(functions, weights or [1.0] * len(functions), listed=listed)


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


_EXIT_HINT = "; a reward function must return a score, not exit the process"


def _is_number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def has_rule(data_source: str, custom_function: str | list[str] | None) -> bool:
    """Whether the rule reward can score ``data_source``: a custom function (or list) scores every source."""
    return custom_function is not None or data_source in RULE_DATA_SOURCES


def check_scorer(scorer: RuleScorer, data_source: str, ground_truth: str | None, extra_info: dict) -> None:
    """Call ``scorer`` once on an empty response before any model loads, so a broken reward function
    (it raises, returns no number) fails in seconds and not at the first scoring. A non-finite score
    only warns: the trainer skips such steps."""
    warn_if_not_finite(scorer(data_source, "", ground_truth, extra_info).value)


def warn_if_not_finite(value: float) -> None:
    """The start-up check's warning: a non-finite score of the empty response (such steps are skipped)."""
    if not math.isfinite(value):
        logger.warning("the rule reward returned %s for an empty response; such steps are skipped", value)
