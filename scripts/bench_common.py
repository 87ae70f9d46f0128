"""What bench_layout.py, bench_overhead.py and bench_sp.py share: their common command-line options, the
actor / reference / critic they build from one seed, the clock of a phase over ranks, and the output
(a table, or one JSON object per row). Not a benchmark itself; the models' configs, prompts and table
printing come from bench_rollout.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, PreTrainedModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_rollout import fsdp_config, model_config, print_table  # noqa: E402

from ppo import models, sharding  # noqa: E402
from ppo.distributed import DistInfo, all_reduce_scalar, barrier, make_mesh  # noqa: E402

T = TypeVar("T")


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """``--threads``, ``--seed`` and ``--json``, which every benchmark takes."""
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank (0: default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="one JSON object per row instead of a table")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The models ``build_models`` makes, where they run, and the clock that times them."""
    parser.add_argument("--model-config", default="tiny", help="tiny or 0.5b (random weights)")
    parser.add_argument("--model-path", default=None, help="a save_pretrained folder instead")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument(
        "--clock", default="auto", choices=["auto", "wall", "cpu"], help="auto: cpu time on CPU, else wall"
    )


def build_models(
    args: argparse.Namespace, info: DistInfo, attn_implementation: str
) -> dict[str, torch.nn.Module]:
    """Actor, frozen reference (the actor's weights) and critic with ``attn_implementation``, each sharded
    with FSDP2 in ``--dtype``. Random weights from ``--model-config`` (the same seed for every call and
    rank), or ``--model-path``."""

    def causal_lm() -> PreTrainedModel:
        if args.model_path:
            return models.load_causal_lm(
                args.model_path, attn_implementation=attn_implementation, config_key="--model-path"
            )
        torch.manual_seed(args.seed)
        config = model_config(args.model_config)
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)

    def critic() -> PreTrainedModel:
        if args.model_path:
            return models.load_critic(
                args.model_path, attn_implementation=attn_implementation, config_key="--model-path"
            )
        torch.manual_seed(args.seed + 1)
        config = model_config(args.model_config)
        config.num_labels = 1
        config.classifier_dropout = 0.0  # the head's dropout defaults to 0.1; PPO trains without dropout
        return AutoModelForTokenClassification.from_config(config, attn_implementation=attn_implementation)

    nets = {
        "actor": causal_lm().train(),
        "ref": causal_lm().requires_grad_(False).eval(),
        "critic": critic().train(),
    }
    fsdp = fsdp_config(args.dtype)
    return {
        name: sharding.shard_model(net, make_mesh(info), fsdp, device=info.device)
        for name, net in nets.items()
    }


def timed(fn: Callable[[], T], info: DistInfo, clock: str) -> tuple[float, T]:
    """(seconds of ``fn()`` on the slowest rank by ``clock``, its result); ranks start together."""
    barrier()
    now = time.process_time if clock == "cpu" else time.perf_counter
    start = now()
    out = fn()
    if info.device.type == "cuda":
        torch.cuda.synchronize(info.device)
    return all_reduce_scalar(now() - start, "max"), out


def print_rows(rows: list[Any], as_json: bool) -> None:
    """Dataclass rows as a table with a column per field, or one JSON object per row."""
    dicts = [dataclasses.asdict(r) for r in rows]
    if as_json:
        for d in dicts:
            print(json.dumps(d))
    else:
        print_table(dicts, [f.name for f in dataclasses.fields(type(rows[0]))])
