"""A multi-turn preset's rollout, call by call: where re-reading earlier turns goes at the preset's sizes.

``profile_preset`` runs the preset's rollout on one rank in this process (one torch thread, ``--threads``):
its share of the prompts (the first ``data.train_batch_size / --preset-ranks``, each ``rollout.n`` times),
its model, its sampler settings and its environment, through ``ppo.rollout.sample``, three times, under
forward hooks (``CallClock``: scaling_turns.py's ``ForwardClock``, which sorts the model's forwards into
prefills and decoding steps, kept per ``generate`` call). The sampler keeps each row's KV cache from turn
to turn (``ppo.prefill``): a call after the first prefills only what each row gained since (its last
generated token, the observation); with ``--re-prefill`` (``keep_cache=False, share_prefill=False``)
each ``generate`` call reads the whole trajectory so far as its prompt, so its prefill grows with the
turns before it.

Output per rollout: its trajectories, CPU seconds (``gen_cpu_s``) and mean tool calls per trajectory, then
a row per ``generate`` call: ``rows`` and ``width`` (its prefill forward's rows and tokens per row: the
distinct rows' new tokens but the last, or the whole padded prompt with ``--re-prefill``; 0 without one),
``prefill_s``, ``decode_steps`` and ``decode_s`` (CPU seconds). ``--json``: one object per rollout
(``kind``: ``preset_rollout``) with its calls under ``calls``. The preset's paths must exist (e.g. after
``make assets``).

Run:
    .venv/bin/python -m ppo_bench.multi_turn --turns-preset configs/demo_cpu_tools.yaml
    .venv/bin/python -m ppo_bench.multi_turn --turns-preset configs/demo_cpu_tools.yaml --re-prefill
    .venv/bin/python -m ppo_bench.multi_turn --turns-preset configs/demo_cpu_tools.yaml --json
"""

from __future__ import annotations

import argparse
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import torch

from ppo_bench.common import add_common_args, print_json_lines, print_table
from ppo_bench.scaling_turns import ForwardClock


class CallClock(ForwardClock):
    """A ``ForwardClock`` that also keeps each ``generate`` call's prefill (rows, width, seconds) and its
    decoding steps and seconds. A call is the forwards on one KV cache: ``generate``'s own, and the
    rollout's prefill forward on the cache it then hands to ``generate`` (``ppo.prefill``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.calls: list[dict[str, float]] = []
        self._cache: weakref.ref | None = None

    def _post(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], out: Any) -> None:
        prefill_s, decode_s = self.prefill_s, self.decode_s
        super()._post(module, args, kwargs, out)
        rows, new = self._shape
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # transformers 5.25, earlier
        if not self.calls or cache is None or self._cache is None or self._cache() is not cache:
            self.calls.append(
                {"rows": rows, "width": 0, "prefill_s": 0.0, "decode_steps": 0, "decode_s": 0.0}
            )
            self._cache = weakref.ref(cache) if cache is not None else None
        call = self.calls[-1]
        if new > 1:
            call.update(rows=rows, width=new, prefill_s=call["prefill_s"] + self.prefill_s - prefill_s)
        else:
            call["decode_steps"] += 1
            call["decode_s"] += self.decode_s - decode_s


def profile_preset(config: Path, ranks: int, repeats: int = 3, *, re_prefill: bool = False) -> list[dict]:
    """A multi-turn preset's rollout on one rank, in this process (one torch thread): its model, its first
    ``data.train_batch_size / ranks`` prompts x ``rollout.n``, its sampler settings and environment, run by
    ``rollout.sample`` ``repeats`` times under a ``CallClock``: per rollout its CPU seconds, the turn
    counts, and each ``generate`` call's prefill and decoding (the preset's paths must exist, e.g. after
    ``make assets``). ``re_prefill``: without the shared prefill and the kept caches (every call prefills
    each row's whole trajectory)."""
    from transformers import AutoTokenizer

    from ppo import data, model_loading, multi_turn, rollout
    from ppo.attention import PACKED_ATTENTION
    from ppo.config_loader import load_config

    cfg = load_config(config)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    model = model_loading.load_causal_lm(cfg.model.path, attn_implementation=PACKED_ATTENTION).train()
    prompts = data.load_prompts(
        cfg.data.train_files,
        tokenizer,
        max_prompt_length=cfg.data.max_prompt_length,
        require_ground_truth=False,
    )[: cfg.data.train_batch_size // ranks]
    records = [r for r in prompts for _ in range(cfg.rollout.n)]
    sampler = rollout.Sampler(
        actor=model,
        engine=None,
        settings=cfg.rollout,
        max_response_length=cfg.data.max_response_length,
        eos_ids=model_loading.eos_token_ids(tokenizer, model),
        pad_token_id=tokenizer.pad_token_id,
        multi_turn=multi_turn.make_settings(cfg.rollout.multi_turn, tokenizer, cfg.data.max_response_length),
    )
    torch.manual_seed(0)
    out = []
    for _ in range(repeats):
        clock = CallClock(model)
        start = time.process_time()
        result = rollout.sample(
            sampler,
            records,
            do_sample=cfg.rollout.do_sample,
            keep_cache=not re_prefill,
            share_prefill=not re_prefill,
        )
        total = time.process_time() - start
        clock.remove()
        out.append({
            "trajectories": len(records),
            "gen_cpu_s": total,
            "tool_calls_mean": float(result.turn_stats["tool_calls"].mean()),
            "calls": clock.calls,
        })  # fmt: skip
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--turns-preset",
        type=Path,
        required=True,
        help="the multi-turn preset whose rollout is profiled (e.g. configs/demo_cpu_tools.yaml)",
    )
    parser.add_argument("--preset-ranks", type=int, default=2, help="ranks the preset is sized for")
    parser.add_argument(
        "--re-prefill",
        action="store_true",
        help="prefill each row's whole trajectory every turn (no shared prefill, no kept caches)",
    )
    add_common_args(parser, threads_help="torch CPU threads", json_help="one JSON object per rollout")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    for i, run in enumerate(profile_preset(args.turns_preset, args.preset_ranks, re_prefill=args.re_prefill)):
        if args.json:
            print_json_lines([run], "preset_rollout")
            continue
        print(
            f"rollout {i}: {run['trajectories']} trajectories, {run['gen_cpu_s']:.3f} CPU s, "
            f"{run['tool_calls_mean']:.2f} tool calls per trajectory"
        )
        print_table(run["calls"], ["rows", "width", "prefill_s", "decode_steps", "decode_s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
