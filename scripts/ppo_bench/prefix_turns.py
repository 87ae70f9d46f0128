"""The multi-turn part of prefix.py: a multi-turn preset's rollout with each row's KV cache kept from turn to
turn (``rollout.reuse_prompt_cache``) and without (every turn's ``generate`` prefills the whole trajectory
again), on scaling.py's ``turns`` axis's exact work: ``FixedAnswer`` answers every turn with ``OBSERVATION``
and the rigged policy writes ``TURN_TOKENS`` of ``FORCED_CHAR`` (the stop string) a turn, so a trajectory of
``t`` turns holds exactly ``t * PER_TURN`` response tokens. Here: its overrides, the fits of the rollout's
seconds against the turns (``fit_exponent``, ``fit_line``), the check, and the figure's panel. prefix.py's
docstring says how to run it.

Without the kept cache turn ``t`` re-reads the prompt and the ``t`` earlier turns, so the rollout reads
``t * prompt + t^2 * PER_TURN / 2`` prefill tokens per row beside its ``t * TURN_TOKENS`` decoding steps:
``gen_k`` above 1 where the prefill is a visible share (many rows: a prefill costs per row, a decoding step
of a small model nearly does not). With it only the new tokens are prefilled and a turn costs the same
whatever came before: linear in the turns, ``gen_k`` near 1. The exponent of a line with an intercept is
below 1, so the preset keeps the rollout's fixed part small (short prompts: the first prefill is short;
``intercept_s`` shows what is left, the gather of the actor's weights and the like).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from ppo_bench.runs import fit_exponent, fit_line
from ppo_bench.scaling_turns import FIXED_ANSWER, FORCED_CHAR, OBSERVATION, TURN_TOKENS

PER_TURN = TURN_TOKENS + len(OBSERVATION)
"""Response tokens of one turn: the policy's and the environment's answer."""
TURN_MODES = ("off", "rollout_only")
"""The multi-turn runs' modes (prefix.py's ``MODES``): the rollout re-prefilled and the kept cache."""
TURNS_K_TOLERANCE = 0.2
"""The kept cache's rollout is linear in turns when its exponent is within this of 1."""
FIT_COLUMNS = ["mode", "gen_k", "s_per_turn", "intercept_s"]


def turn_settings(turns: int) -> list[str]:
    """train_ppo's multi-turn overrides for ``turns`` exact turns (scaling.py's ``turns`` axis's)."""
    return [
        "rollout.multi_turn.enable=true",
        f"rollout.multi_turn.env={FIXED_ANSWER}",
        f"rollout.multi_turn.stop=[{FORCED_CHAR * TURN_TOKENS}]",
        f"rollout.multi_turn.max_assistant_turns={turns}",
    ]


def turn_fits(rows: list[dict]) -> list[dict]:
    """Per mode of the multi-turn rows (``turns > 0``) with two or more turn counts: the rollout's seconds
    against the turns, ``gen_s = c * turns^k`` (``gen_k``, least squares on log-log) and ``gen_s = a + b *
    turns`` (``s_per_turn`` b, ``intercept_s`` a)."""
    out = []
    for mode in TURN_MODES:
        sel = sorted((r for r in rows if r["turns"] and r["mode"] == mode), key=lambda r: r["turns"])
        turns, gen = [float(r["turns"]) for r in sel], [r["gen_s"] for r in sel]
        if len(set(turns)) < 2:
            continue
        slope = fit_line(turns, gen)
        out.append(
            {
                "mode": mode,
                "prompt_len": sel[0]["prompt_len"],
                "n": sel[0]["n"],
                "turns": [r["turns"] for r in sel],
                "gen_k": fit_exponent(turns, gen)[0] if min(gen) > 0 else None,
                "s_per_turn": slope,
                "intercept_s": statistics.fmean(gen) - slope * statistics.fmean(turns),
            }
        )
    return out


def check(text: str, value: float | None, target: float, ok: Callable[[float], bool]) -> dict[str, Any]:
    """A target's line (prefix.py's and this module's): ``check`` (what), ``value``, ``target`` and ``pass``
    (``ok(value)``; None where the value was not measured)."""
    return {"check": text, "value": value, "target": target, "pass": None if value is None else ok(value)}


def turns_check(fits: list[dict]) -> dict[str, Any]:
    """The check line of the kept cache's exponent (``pass`` None where it was not fitted)."""
    kept = next((f for f in fits if f["mode"] == "rollout_only"), None)
    text = f"multi-turn rollout time linear in turns with the kept cache (|k - 1| <= {TURNS_K_TOLERANCE:g})"
    return check(text, kept["gen_k"] if kept else None, 1.0, lambda k: abs(k - 1.0) <= TURNS_K_TOLERANCE)


def plot_turns(ax: Any, rows: list[dict], fits: list[dict]) -> None:
    """The rollout's seconds per step against the turns, a line per mode, its exponent in the legend."""
    by_mode = {f["mode"]: f for f in fits}
    for mode in TURN_MODES:
        sel = sorted((r for r in rows if r["turns"] and r["mode"] == mode), key=lambda r: r["turns"])
        if not sel:
            continue
        k = by_mode.get(mode, {}).get("gen_k")
        name = f"{mode} ({'kept cache' if mode == 'rollout_only' else 're-prefilled'})"
        ax.plot([r["turns"] for r in sel], [r["gen_s"] for r in sel], marker="o",
                label=name + (f", k={k:.2f}" if k is not None else ""))  # fmt: skip
    ax.set_title("multi-turn rollout")
    ax.set_xlabel("assistant turns")
    ax.set_ylabel("rollout seconds per step")
    ax.legend(fontsize=7)
