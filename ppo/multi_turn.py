"""Multi-turn rollouts: the model writes, a user's environment or tool answers, the model writes again,
and the reward comes at the end (or per turn), on the same one-program step.

The environment is a class in the user's file (``rollout.multi_turn.env=my_env.py:Calc``), one instance
per trajectory::

    class Calc:
        def reset(self, row: dict) -> str | None:        # the prompt's record (ground truth included);
            ...                                          # text returned here is appended to the prompt
        def step(self, action_text: str) -> tuple[str, float, bool]:   # (observation, reward, done)
            ...

Each rank runs its own turn loop over its rows (``rollout.sample`` calls ``run_turns`` inside one
``rollout.generating`` session: the actor's parameters are gathered once): generate for the rows still going; a turn ends at an EOS (the trajectory is
done), at one of ``rollout.multi_turn.stop`` (the turn's text goes to ``step``) or at the response budget;
``step``'s observation is tokenized and appended (truncated to ``max_tool_response_length`` tokens);
rows whose ``step`` said done, or that ran out of turns or of ``data.max_response_length`` tokens (which
counts generated and observation tokens together, as in verl), drop out. Generation has no collectives,
so ranks may take different numbers of turns and the phase still ends together.

Each turn's prompt is the whole trajectory so far, but it is not prefilled again: the sampler keeps each
row's KV cache from one turn's ``generate`` call to the next (``rollout.sample(keep_cache=True)``,
``ppo.prefill.KeptCaches``), matched to the next turn's prompts by their tokens and cropped where the turn
was cut (a stop string, the budget), so a turn prefills only the tokens its row gained: the turn's last
generated token, the observation, the template's tokens. The rows go to ``generate_turn`` in the same
relative order every turn (finished rows drop out), which that matching relies on.

Tokens, not text: generated ids are kept exactly as generated (a turn is cut right after the token that
completes its stop string, found by decoding prefixes), observation ids come from the tokenizer. The
``Rollout`` has two masks: ``attention_mask`` (the token exists: packing and forwards) and
``response_mask`` (the policy generated it: every loss, KL, entropy, whitening and count), ``env_rewards`` with each
``step`` reward on the last generated token of its turn, and per-row ``turn_stats`` (``TURN_STATS``). A ``step`` that raises or returns the wrong types
is an error naming the class; one that runs longer than ``rollout.multi_turn.step_timeout_s`` ends its
trajectory with reward 0 and is counted (the stuck call is abandoned on a daemon thread: never a hang).
A turn's ``step`` calls run concurrently, one thread each, under one deadline (stuck calls cost one
``step_timeout_s`` a turn, not one each), and the turn's timeouts are logged. ``reset`` runs inside the
same boundary; a call that raises anything (``sys.exit`` included) or returns a non-finite reward is an
error naming the class and the prompt's row. The instances are made the same way
(``environments.make_environments``: one after another, in row order, each on a daemon thread within
``step_timeout_s``): an ``__init__`` that raises or runs longer is an error naming the class and the row,
as a ``reset`` that runs longer is. The class is also instantiated once at start-up (``make_settings``,
before any model loads, under the same limit), so an ``__init__`` that needs arguments or blocks fails
there. An observation is cut to a number of characters that surely holds ``max_tool_response_length``
tokens before it is tokenized.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

import torch
from transformers import GenerationConfig

from ppo.batch import Rollout
from ppo.config import MultiTurnConfig
from ppo.data import PromptRecord
from ppo.environments import EnvError, call_all, check_environment, make_environments

logger = logging.getLogger("ppo")


def record_row(record: PromptRecord) -> dict[str, Any]:
    """What ``reset`` receives: the prompt's record as a dict (verl's row fields)."""
    return {
        "index": record.index,
        "prompt": record.prompt_text,
        "data_source": record.data_source,
        "ground_truth": record.ground_truth,
        "extra_info": record.extra_info,
    }


@dataclass
class Trajectory:
    """One row's response so far."""

    env: Any
    prompt: list[int]
    row: int
    """The prompt's row (``PromptRecord.index``), for messages."""
    tokens: list[int] = field(default_factory=list)
    generated: list[bool] = field(default_factory=list)
    rewards: dict[int, float] = field(default_factory=dict)
    done: bool = False
    ended: bool = False
    """Ended with an EOS (else it was cut by the budget, the turn cap or a done from ``step``)."""
    turns: int = 0
    tool_calls: int = 0
    step_timeouts: int = 0
    observation_truncations: int = 0


TURN_STATS = ("turns", "tool_calls", "step_timeouts", "observation_truncations")
"""Per-row counts a multi-turn ``Rollout`` carries in ``turn_stats`` (the ``rollout/*`` metrics)."""


@dataclass(kw_only=True)
class MultiTurn:
    """The settings of a multi-turn rollout (``rollout.multi_turn.*``)."""

    env_class: type
    tokenizer: Any
    max_turns: int
    max_tool_response_length: int
    step_timeout_s: float
    stop: list[str]
    max_response_length: int
    max_token_chars: int = 64
    """The longest token's text in characters (an upper bound): an observation longer than
    ``(max_tool_response_length + 1) * max_token_chars`` characters is cut to that before tokenizing."""


def make_settings(config: MultiTurnConfig, tokenizer: Any, max_response_length: int) -> MultiTurn:
    """The turn loop's settings from ``rollout.multi_turn`` (the environment class loaded, checked and
    instantiated once within ``step_timeout_s``: a bad ``env`` fails here, at start-up, before any model
    loads; ``environments.check_environment``). Without ``max_assistant_turns`` the budget bounds the turns
    (every turn generates at least one token)."""
    env_class = check_environment(config.env, timeout_s=config.step_timeout_s)
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return MultiTurn(
        env_class=env_class,
        tokenizer=tokenizer,
        max_turns=config.max_assistant_turns or max_response_length,
        max_tool_response_length=config.max_tool_response_length,
        step_timeout_s=config.step_timeout_s,
        stop=list(config.stop),
        max_response_length=max_response_length,
        max_token_chars=max((len(piece) for piece in vocab), default=64),
    )


TurnGenerator = Callable[[list[torch.Tensor], GenerationConfig], torch.Tensor]
"""``(prompts, config) -> [B, config.max_new_tokens]`` generated tokens (``rollout.decode`` in a
``rollout.generating`` session, which may keep the rows' KV caches between calls: prompts come in the same
relative order every turn)."""


def run_turns(
    generate_turn: TurnGenerator,
    records: list[PromptRecord],
    config: GenerationConfig,
    settings: MultiTurn,
    device: torch.device,
) -> Rollout:
    """Run the turn loop of the module docstring for every record and return the ``Rollout``
    (``R = max_response_length``) on ``device``, with both masks, the step rewards and ``turn_stats``."""
    tok = settings.tokenizer
    name = settings.env_class.__name__
    envs = make_environments(settings.env_class, [r.index for r in records], settings.step_timeout_s)
    resets = [
        functools.partial(env.reset, record_row(record)) for env, record in zip(envs, records, strict=True)
    ]
    trajectories = []
    for env, record, answer in zip(envs, records, call_all(resets, settings.step_timeout_s), strict=True):
        status, extra = answer
        if status == "timeout":
            raise EnvError(
                f"{name}.reset ran longer than rollout.multi_turn.step_timeout_s={settings.step_timeout_s} "
                f"(prompt row {record.index})"
            )
        if status == "error":
            raise EnvError(
                f"{name}.reset raised {type(extra).__name__}: {extra} (prompt row {record.index})"
            ) from None
        if extra is not None and not isinstance(extra, str):
            raise EnvError(
                f"{name}.reset returned {extra!r:.60}; expected text or None (prompt row {record.index})"
            )
        prompt = list(record.input_ids) + (tok.encode(extra, add_special_tokens=False) if extra else [])
        trajectories.append(Trajectory(env=env, prompt=prompt, row=record.index))
    eos = set(config.eos_token_id)
    budget = settings.max_response_length
    for _ in range(settings.max_turns):
        active = [t for t in trajectories if not t.done]
        if not active:
            break
        turn_config = GenerationConfig.from_dict(
            {**config.to_dict(), "max_new_tokens": max(budget - len(t.tokens) for t in active)}
        )
        turn_config.stop_strings = list(settings.stop) or None
        out = generate_turn(
            [torch.tensor(t.prompt + t.tokens, dtype=torch.long) for t in active], turn_config
        )
        calling: list[tuple[Trajectory, str]] = []
        for t, row in zip(active, out.tolist(), strict=True):
            new, how = _cut_turn(row[: budget - len(t.tokens)], eos, settings.stop, tok)
            t.tokens += new
            t.generated += [True] * len(new)
            t.turns += 1
            if how != "stop":  # an EOS ends the trajectory; so does running out of tokens
                t.done, t.ended = True, how == "eos"
                continue
            t.tool_calls += 1
            calling.append((t, tok.decode(new, skip_special_tokens=True)))
        for (t, _), (observation, reward, done) in zip(calling, _step_all(calling, settings), strict=True):
            t.rewards[len(t.tokens) - 1] = t.rewards.get(len(t.tokens) - 1, 0.0) + reward
            limit = (settings.max_tool_response_length + 1) * settings.max_token_chars
            obs = tok.encode(observation[:limit], add_special_tokens=False) if observation else []
            if len(obs) > settings.max_tool_response_length:
                obs = obs[: settings.max_tool_response_length]
                t.observation_truncations += 1
            obs = obs[: budget - len(t.tokens)]
            t.tokens += obs
            t.generated += [False] * len(obs)
            t.done = done or len(t.tokens) >= budget
    return _as_rollout(trajectories, budget, config.pad_token_id, device)


def _cut_turn(tokens: list[int], eos: set[int], stop: list[str], tokenizer: Any) -> tuple[list[int], str]:
    """A turn's tokens as generated, up to and including its end: ``(tokens, "eos" | "stop" | "budget")``.
    The end is the first EOS, or the token that completes a stop string (the shortest prefix whose text
    contains one), whichever comes first; else the whole budget."""
    end = next((i for i, t in enumerate(tokens) if t in eos), None)
    limit = end + 1 if end is not None else len(tokens)

    def stops(n: int) -> bool:  # the text of the first n tokens holds a stop string
        text = tokenizer.decode(tokens[:n], skip_special_tokens=True)
        return any(s in text for s in stop)

    if stop and stops(limit):
        # The shortest such prefix, by bisection: a prefix's text holds a stop string whenever a shorter
        # one's does, so a few decodes find it (one decode per token would be quadratic in the turn).
        lo, hi = 1, limit
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if stops(mid) else (mid + 1, hi)
        return tokens[:lo], "stop"
    if end is not None:
        return tokens[:limit], "eos"
    return tokens, "budget"


def _step_all(calling: list[tuple[Trajectory, str]], settings: MultiTurn) -> list[tuple[str, float, bool]]:
    """``env.step(action)`` of every trajectory of a turn, concurrently, within ``step_timeout_s`` of the
    turn: a late call ends its trajectory with reward 0 (counted, and logged for the turn); a call that
    raises (``sys.exit`` included), returns the wrong types or a non-finite reward is an error naming the
    class and the prompt's row."""
    answers = call_all(
        [functools.partial(t.env.step, action) for t, action in calling], settings.step_timeout_s
    )
    out: list[tuple[str, float, bool]] = []
    late = []
    for (t, action), (status, result) in zip(calling, answers, strict=True):
        name, where = type(t.env).__name__, f"prompt row {t.row}, action {action[:60]!r}"
        if status == "timeout":
            t.step_timeouts += 1
            late.append(t.row)
            out.append(("", 0.0, True))
            continue
        if status == "error":
            raise EnvError(f"{name}.step raised {type(result).__name__}: {result} ({where})") from None
        ok = (
            isinstance(result, tuple)
            and len(result) == 3
            and isinstance(result[0], str)
            and isinstance(result[1], Real)
            and isinstance(result[2], bool)
        )
        if not ok:
            raise EnvError(
                f"{name}.step returned {result!r:.80}; expected (observation: str, reward: float, done: bool) "
                f"({where})"
            )
        if not math.isfinite(result[1]):
            raise EnvError(
                f"{name}.step returned reward {result[1]}; rewards must be finite numbers ({where})"
            )
        out.append((result[0], float(result[1]), result[2]))
    if late:
        logger.warning(
            "%d of %d environment steps ran longer than rollout.multi_turn.step_timeout_s=%s (prompt rows %s); "
            "their trajectories end with reward 0",
            len(late),
            len(calling),
            settings.step_timeout_s,
            ", ".join(map(str, late[:8])) + (" ..." if len(late) > 8 else ""),
        )
    return out


def _as_rollout(trajectories: list[Trajectory], width: int, pad_id: int, device: torch.device) -> Rollout:
    """The trajectories as a ``Rollout`` of width ``width`` with both masks, the step rewards and the
    per-row counts."""
    b = len(trajectories)
    responses = torch.full((b, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(b, width, dtype=torch.bool)
    response_mask = torch.zeros(b, width, dtype=torch.bool)
    env_rewards = torch.zeros(b, width)
    for i, t in enumerate(trajectories):
        n = len(t.tokens)
        responses[i, :n] = torch.tensor(t.tokens, dtype=torch.long)
        attention_mask[i, :n] = True
        response_mask[i, :n] = torch.tensor(t.generated, dtype=torch.bool)
        for pos, r in t.rewards.items():
            env_rewards[i, pos] = r
    return Rollout(
        prompts=[torch.tensor(t.prompt, dtype=torch.long) for t in trajectories],
        responses=responses.to(device),
        attention_mask=attention_mask.to(device),
        truncated=torch.tensor([not t.ended for t in trajectories], device=device),
        response_mask=response_mask.to(device),
        env_rewards=env_rewards.to(device),
        turn_stats={
            k: torch.tensor([float(getattr(t, k)) for t in trajectories], device=device) for k in TURN_STATS
        },
    )
