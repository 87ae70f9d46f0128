"""The ``turns`` axis of scaling.py: the environment and the rigged policy that make a multi-turn rollout's
work exact, that work by arithmetic (``turn_work``), its profile in this process on the trainer's sampler
under forward hooks (``ForwardClock``, ``profile_turns``) and the cost model fitted to the profile
(``turn_cost_model``). scaling.py's module docstring says what the axis measures and how to read it;
multi_turn.py profiles a multi-turn preset's rollout call by call with the same clock. The sampler keeps
each row's KV cache from turn to turn (``ppo.prefill``), so a turn prefills only its new tokens;
``profile_turns(keep_cache=False, share_prefill=False)`` profiles the re-prefilling path beside it.

The axis's runs name ``FixedAnswer`` in this module as their ``rollout.multi_turn.env`` (``FIXED_ANSWER``),
so every trainer process imports it: at the top it imports only torch and runs.py.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from ppo_bench.runs import fit_exponent

TURN_TOKENS = 8
"""Generated tokens per turn on the ``turns`` axis (the stop string is this many ``FORCED_CHAR``)."""
FORCED_CHAR = "a"
OBSERVATION = "<r>0</r>"
"""The environment's answer to every turn (8 characters: 8 tokens of the character tokenizer)."""
FIXED_ANSWER = "ppo_bench.scaling_turns:FixedAnswer"
"""``rollout.multi_turn.env`` of the ``turns`` axis: ``FixedAnswer`` in this module (imported by name from the
installed ``ppo_bench`` package)."""
TURN_PROFILE_PROMPTS = 8
"""Rows of ``profile_turns`` (the ``turns`` axis's 8 prompts)."""
TURN_REPEATS = 3


class FixedAnswer:
    """The ``turns`` axis's environment: answers every turn with ``OBSERVATION`` and never ends a
    trajectory, so each has exactly ``rollout.multi_turn.max_assistant_turns`` turns."""

    def reset(self, row: dict[str, Any]) -> None:
        return None

    def step(self, action_text: str) -> tuple[str, float, bool]:
        return OBSERVATION, 0.0, False


@torch.no_grad()
def rig_forced_token(model: torch.nn.Module, token_id: int) -> None:
    """Make a Llama write ``token_id`` after any input: hidden dimension 0 of the residual stream is a
    constant 50 (every embedding's, and no layer writes to it), so after the final RMSNorm it is about
    ``sqrt(hidden)``, and only ``token_id``'s output row reads it (weight 4): a logit about
    ``4 sqrt(hidden)`` above the others, whose rows read nothing from it."""
    model.model.embed_tokens.weight[:, 0] = 50.0
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight[0].zero_()
        layer.mlp.down_proj.weight[0].zero_()
    model.lm_head.weight[:, 0] = 0.0
    model.lm_head.weight[token_id, 0] = 4.0


def turn_work(
    prompt_lens: list[int], turns: int, *, keep_cache: bool = True, share_prefill: bool = True
) -> dict[str, int]:
    """What generation does on the ``turns`` axis, by arithmetic (the rows' prompts distinct): turn ``t``
    (0-based) is one ``generate`` call on every row's prompt and its ``t`` earlier turns
    (``TURN_TOKENS`` generated + ``OBSERVATION``'s tokens each), left-padded to the widest row.

    - With ``keep_cache`` (the trainer's sampler, ``ppo.prefill``): a prefill forward reads each row's
      new tokens but the last, then ``generate`` makes ``TURN_TOKENS`` forwards of one token per row (the
      first reads the last new token and writes the first generated one). Turn 0's new tokens are the
      prompt: ``width - 1`` per row. Each row's cache holds its trajectory up to the turn's 7th generated
      token (the 8th is never fed back), so a later turn reads that token and the observation:
      ``len(OBSERVATION)`` per row in the prefill forward, linear in ``turns``.
    - Without it (plain ``generate``: the rows' distinct prompts give ``share_prefill`` nothing to
      share): the prefill reads the whole padded prompt, ``width + t * 16`` per row, quadratic, and
      writes the first token; ``TURN_TOKENS - 1`` decoding forwards follow.

    Returns ``generate_calls``, ``prefill_tokens`` (rows x prefill width, summed over turns),
    ``decode_steps`` (one-token forwards) and ``generated_tokens``."""
    rows, width, per_turn = len(prompt_lens), max(prompt_lens), TURN_TOKENS + len(OBSERVATION)
    plain = not keep_cache

    def prefill_width(t: int) -> int:
        if plain:
            return width + t * per_turn
        return width - 1 if t == 0 else len(OBSERVATION)

    return {
        "generate_calls": turns,
        "prefill_tokens": rows * sum(prefill_width(t) for t in range(turns)),
        "decode_steps": turns * (TURN_TOKENS - 1 if plain else TURN_TOKENS),
        "generated_tokens": rows * turns * TURN_TOKENS,
    }


class ForwardClock:
    """Forward hooks on a model that sort its forwards into prefills (more than one new token per row: the
    first forward of a plain ``generate`` call, or the rollout's own prefill forward before one,
    ``ppo.prefill``) and decoding steps (one), with their CPU seconds and tokens."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.prefill_s = self.decode_s = 0.0
        self.prefill_tokens = self.decode_steps = 0
        self._start = 0.0
        self._shape: tuple[int, ...] = ()
        self._handles = [
            model.register_forward_pre_hook(self._pre, with_kwargs=True),
            model.register_forward_hook(self._post, with_kwargs=True),
        ]

    def _pre(self, _module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._shape = tuple(ids.shape)
        self._start = time.process_time()

    def _post(self, _module: torch.nn.Module, _args: tuple, _kwargs: dict[str, Any], _out: Any) -> None:
        seconds = time.process_time() - self._start
        rows, new = self._shape
        if new > 1:
            self.prefill_s += seconds
            self.prefill_tokens += rows * new
        else:
            self.decode_s += seconds
            self.decode_steps += 1

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def turn_sampler(model: torch.nn.Module, tokenizer: Any, turns: int, num_rows: int) -> Any:
    """The trainer's sampler (``ppo.rollout.Sampler``) of a ``turns``-turn point: ``FixedAnswer``, the stop
    string of ``TURN_TOKENS`` ``FORCED_CHAR``, a response budget of exactly ``turns`` turns, all
    ``num_rows`` rows in one generation micro-batch."""
    from ppo import multi_turn, rollout
    from ppo.config.sections import MultiTurnConfig, RolloutConfig

    budget = turns * (TURN_TOKENS + len(OBSERVATION))
    mt = MultiTurnConfig(
        enable=True, env=FIXED_ANSWER, stop=[FORCED_CHAR * TURN_TOKENS], max_assistant_turns=turns
    )
    return rollout.Sampler(
        actor=model,
        engine=None,
        settings=RolloutConfig(n=1, micro_batch_size_per_gpu=num_rows, compile=False, multi_turn=mt),
        max_response_length=budget,
        eos_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        multi_turn=multi_turn.make_settings(mt, tokenizer, budget),
    )


def profile_turns(
    paths: dict[str, Path],
    turns: list[int],
    *,
    threads: int,
    max_prompt_length: int,
    keep_cache: bool = True,
    share_prefill: bool = True,
) -> list[dict]:
    """Where generation goes on the ``turns`` axis, in this process: the trainer's sampler
    (``ppo.rollout.sample`` with the same multi-turn settings, model, prompts and one torch thread;
    ``keep_cache`` and ``share_prefill`` passed to it) runs each point's rollout ``TURN_REPEATS`` times
    under a ``ForwardClock``; the run of median CPU time. Per point: ``turn_work``'s counts (and the
    clock's, which must equal them), ``gen_cpu_s`` (the whole rollout), ``prefill_s`` and ``decode_s``
    (the model's forwards) and ``rest_s`` (the rest: ``generate``'s per-step machinery, stop strings, the
    turn loop and the environment)."""
    from transformers import AutoTokenizer

    from ppo import data, model_loading, rollout
    from ppo.attention import PACKED_ATTENTION

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(paths["forced"])
    model = model_loading.load_causal_lm(str(paths["forced"]), attn_implementation=PACKED_ATTENTION).train()
    records = data.load_prompts(
        paths["prompts"], tokenizer, max_prompt_length=max_prompt_length, require_ground_truth=False
    )
    records = records[:TURN_PROFILE_PROMPTS]
    reuse = {"keep_cache": keep_cache, "share_prefill": share_prefill}
    out = []
    try:
        for t in turns:
            sampler = turn_sampler(model, tokenizer, t, len(records))
            samples = []
            for _ in range(TURN_REPEATS):
                clock = ForwardClock(model)
                start = time.process_time()
                result = rollout.sample(sampler, records, do_sample=True, **reuse)
                total = time.process_time() - start
                clock.remove()
                generated = int(result.response_mask.sum())
                samples.append((total, clock, generated))
            work = turn_work([len(r.input_ids) for r in records], t, **reuse)
            total, clock, generated = sorted(samples, key=lambda x: x[0])[len(samples) // 2]  # the median run
            counted = {
                "prefill_tokens": clock.prefill_tokens,
                "decode_steps": clock.decode_steps,
                "generated_tokens": generated,
            }
            med = {
                "gen_cpu_s": total,
                "prefill_s": clock.prefill_s,
                "decode_s": clock.decode_s,
                "rest_s": total - clock.prefill_s - clock.decode_s,
            }
            if any(counted[k] != work[k] for k in counted):
                raise RuntimeError(f"turns={t}: the forwards counted {counted}, the arithmetic says {work}")
            out.append({"turns": t, **work, **med})
    finally:
        torch.set_num_threads(before)
    return out


def turn_cost_model(profile: list[dict]) -> dict[str, Any]:
    """The cost model of multi-turn generation from ``profile_turns``'s points: CPU seconds per prefill
    token, per decoding step and per ``generate`` call (of everything else), each the ratio of its summed
    seconds to its summed count over the points, and the exponents ``k`` (against the generated tokens) of
    the whole rollout, of its prefill, and of the rollout without the prefill."""
    tokens = [float(p["generated_tokens"]) for p in profile]
    model: dict[str, Any] = {
        "prefill_ms_per_ktok": 1e6
        * sum(p["prefill_s"] for p in profile)
        / sum(p["prefill_tokens"] for p in profile),
        "decode_ms_per_step": 1e3
        * sum(p["decode_s"] for p in profile)
        / sum(p["decode_steps"] for p in profile),
        "rest_ms_per_call": 1e3
        * sum(p["rest_s"] for p in profile)
        / sum(p["generate_calls"] for p in profile),
    }
    if len(set(tokens)) > 1:
        model["gen_k"] = fit_exponent(tokens, [p["gen_cpu_s"] for p in profile])[0]
        model["prefill_k"] = fit_exponent(tokens, [p["prefill_s"] for p in profile])[0]
        model["without_prefill_k"] = fit_exponent(tokens, [p["gen_cpu_s"] - p["prefill_s"] for p in profile])[
            0
        ]
    return model


TURN_COLUMNS = [
    "turns", "generate_calls", "prefill_tokens", "decode_steps", "generated_tokens",
    "gen_cpu_s", "prefill_s", "decode_s", "rest_s", "model_s",
]  # fmt: skip


def with_model(profile: list[dict], model: dict[str, Any]) -> list[dict]:
    """``profile``'s points with ``model_s``, the cost model's CPU seconds for each."""
    return [
        {
            **p,
            "model_s": p["prefill_tokens"] * model["prefill_ms_per_ktok"] / 1e6
            + p["decode_steps"] * model["decode_ms_per_step"] / 1e3
            + p["generate_calls"] * model["rest_ms_per_call"] / 1e3,
        }
        for p in profile
    ]
