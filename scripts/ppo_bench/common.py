"""What the benchmarks share in their own process (none of them is imported by this module): the actor /
reference / critic built from one seed in one of the random models' shapes (``MODEL_CONFIGS`` of
scripts/make_shaped_model.py), random prompts, the tiny Llama on make_tiny_assets.py's character tokenizer
and the files of a trainer run (model folders, a prompt Parquet), the common command-line options, the CPU
threads and the clock of a phase over ranks, the peak memory of a call (CPU and CUDA), and the output (a
table, or one JSON object per row). Not a benchmark itself; what a run of the trainer in its own process
needs, and needs no torch for, is in runs.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, LlamaConfig, PreTrainedModel

from ppo import model_loading, sharding
from ppo.config import FSDPConfig, MixedPrecisionConfig
from ppo.distributed import (
    DistInfo,
    all_reduce_scalar,
    barrier,
    destroy_distributed,
    init_distributed,
    make_mesh,
)
from ppo_bench.shapes import MODEL_CONFIGS, model_config

T = TypeVar("T")


def fsdp_config(dtype: str) -> FSDPConfig:
    """FSDP2 with the benchmark's compute dtype (fp32 master weights, as the trainer keeps them)."""
    return FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype=dtype, reduce_dtype="float32"))


def causal_lm(args: argparse.Namespace, attn_implementation: str) -> PreTrainedModel:
    """The policy on CPU in fp32: random weights from ``--model-config`` (the same seed for every call and
    rank, since ``fully_shard`` keeps each rank's own slice), or ``--model-path``."""
    if args.model_path:
        return model_loading.load_causal_lm(
            args.model_path, attn_implementation=attn_implementation, config_key="--model-path"
        )
    torch.manual_seed(args.seed)
    return AutoModelForCausalLM.from_config(
        model_config(args.model_config), attn_implementation=attn_implementation
    )


def critic(args: argparse.Namespace, attn_implementation: str) -> PreTrainedModel:
    """A critic (backbone + 1-output token head) from the same config or checkpoint as the policy."""
    if args.model_path:
        return model_loading.load_critic(
            args.model_path, attn_implementation=attn_implementation, config_key="--model-path"
        )
    torch.manual_seed(args.seed + 1)
    config = model_config(args.model_config)
    config.num_labels = 1
    config.classifier_dropout = 0.0  # the head's dropout defaults to 0.1; PPO trains without dropout
    return AutoModelForTokenClassification.from_config(config, attn_implementation=attn_implementation)


def build_models(
    args: argparse.Namespace, info: DistInfo, attn_implementation: str
) -> dict[str, torch.nn.Module]:
    """Actor, frozen reference (the actor's weights) and critic with ``attn_implementation``, each sharded
    with FSDP2 in ``--dtype``. Random weights from ``--model-config`` (the same seed for every call and
    rank), or ``--model-path``."""
    nets = {
        "actor": causal_lm(args, attn_implementation).train(),
        "ref": causal_lm(args, attn_implementation).requires_grad_(False).eval(),
        "critic": critic(args, attn_implementation).train(),
    }
    fsdp = fsdp_config(args.dtype)
    return {
        name: sharding.shard_model(net, make_mesh(info), fsdp, device=info.device)
        for name, net in nets.items()
    }


def tiny_llama_config(tokenizer: Any, hidden: int, layers: int, max_positions: int) -> LlamaConfig:
    """A Llama of ``layers`` x ``hidden`` (4 heads, MLP 4x) over ``tokenizer``'s vocabulary and special
    tokens, untied head: the trainer-driving benchmarks' model (overhead, scaling)."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def save_model(model: PreTrainedModel, tokenizer: Any, path: Path) -> Path:
    """``model`` and ``tokenizer`` saved into the folder ``path`` (what ``model.path`` loads)."""
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_prompts(path: Path, num: int, seed: int) -> Path:
    """The first ``num`` training problems of make_tiny_assets.py's arithmetic task (split by ``seed``) as
    a prompt Parquet in verl's layout, with their ground truth for the rule reward."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ppo_bench.runs import repo_script

    make_tiny_assets = repo_script("make_tiny_assets")
    problems, _ = make_tiny_assets.split_problems(seed)
    pq.write_table(pa.Table.from_pylist(make_tiny_assets.prompt_rows(problems[:num], "train")), path)
    return path


def random_prompts(num: int, max_len: int, vocab_size: int, seed: int) -> list[torch.Tensor]:
    """``num`` prompts of random tokens, lengths uniform in ``[max_len // 2, max_len]`` (so left
    padding matters), the same on every rank for a given seed."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, max_len // 2), max_len + 1, (num,), generator=gen)
    return [torch.randint(3, vocab_size, (int(n),), generator=gen) for n in lengths]


def add_common_args(
    parser: argparse.ArgumentParser,
    *,
    threads_help: str = "torch CPU threads per rank (0: default)",
    json_help: str = "one JSON object per row instead of a table",
) -> None:
    """``--threads``, ``--seed`` and ``--json``, which every benchmark takes (the help of the first and the
    last where a benchmark means more by them)."""
    parser.add_argument("--threads", type=int, default=1, help=threads_help)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help=json_help)


def add_tiny_model_args(parser: argparse.ArgumentParser) -> None:
    """``--layers`` and ``--hidden`` of ``tiny_llama_config``'s Llama."""
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the Llama")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size (MLP: 4x)")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The models ``build_models`` makes, where they run, and the clock that times them."""
    parser.add_argument(
        "--model-config", default="tiny", help=f"one of {', '.join(MODEL_CONFIGS)} (random weights)"
    )
    parser.add_argument("--model-path", default=None, help="a save_pretrained folder instead")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument(
        "--clock", default="auto", choices=["auto", "wall", "cpu"], help="auto: cpu time on CPU, else wall"
    )


def set_threads(threads: int) -> None:
    """One CPU thread per rank by default, as torchrun sets: on a CPU shared with other processes an
    OpenMP pool of several threads spins at every barrier and runs many times slower (measured 40x on
    2 loaded cores), which would swamp what is being compared."""
    if threads > 0:
        torch.set_num_threads(threads)


def on_every_rank(
    args: argparse.Namespace, run: Callable[[argparse.Namespace, DistInfo], T]
) -> tuple[T, DistInfo]:
    """``run(args, info)`` in the process group of ``--device`` (one process, or torchrun's), with
    ``--threads`` CPU threads per rank; the group is torn down after, also on an error."""
    set_threads(args.threads)
    info = init_distributed(args.device, timeout_s=600)
    try:
        return run(args, info), info
    finally:
        destroy_distributed()


def resolve_clock(clock: str, device: torch.device) -> str:
    """``auto``: CPU time on a CPU device (robust to other processes on a shared machine), else wall."""
    if clock == "auto":
        return "cpu" if device.type == "cpu" else "wall"
    return clock


def timed(fn: Callable[[], T], info: DistInfo, clock: str) -> tuple[float, T]:
    """(seconds of ``fn()`` on the slowest rank, its result); every rank starts together.

    ``clock``: ``wall`` (perf_counter), or ``cpu`` (this process's CPU time: on a CPU shared with other
    processes it counts only the work done, not the time the scheduler gave to others).
    """
    barrier()
    now = time.process_time if clock == "cpu" else time.perf_counter
    start = now()
    out = fn()
    if info.device.type == "cuda":
        torch.cuda.synchronize(info.device)
    return all_reduce_scalar(now() - start, "max"), out


class _StorageTracker(TorchDispatchMode):
    """Bytes of tensor storage allocated while active, current and peak: each op's outputs count once
    per storage until the storage is freed (a ``weakref.finalize`` on it); outputs that share an
    input's storage (views, in-place results) are not allocations."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # An output on an input's storage (a view, an in-place result) allocated nothing.
        inputs = {id(t.untyped_storage()) for t in _plain_tensors((args, kwargs))}
        for t in _plain_tensors(out):
            storage = t.untyped_storage()
            key = id(storage)  # one Python object per live storage
            if key not in self.live and key not in inputs:
                self.live[key] = storage.nbytes()
                self.current += self.live[key]
                self.peak = max(self.peak, self.current)
                weakref.finalize(storage, self._free, key)
        return out


def _plain_tensors(tree: Any) -> list[torch.Tensor]:
    """The plain tensors in a pytree; a subclass (DTensor) wraps plain tensors, which are counted."""
    return [t for t in tree_flatten(tree)[0] if type(t) is torch.Tensor and not t.is_meta]


def cpu_peak_bytes(run: Callable[[], None]) -> int:
    """Peak bytes of tensor storage allocated during run() and alive at once: every tensor an operation
    returns counts from then until its storage is freed, whichever thread frees it (outputs, temporaries,
    autograd's saved tensors, gradients); scratch memory inside one op or outside torch is not seen
    (kernels.py's docstring says why not torch's profiler, tracemalloc or RSS)."""
    with _StorageTracker() as tracker:
        run()
    return tracker.peak


def cuda_peak_bytes(run: Callable[[], None]) -> int:
    """Peak bytes allocated on the current CUDA device during run(), above what was allocated before."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def print_rows(rows: list[Any], as_json: bool) -> None:
    """Dataclass rows as a table with a column per field, or one JSON object per row."""
    dicts = [dataclasses.asdict(r) for r in rows]
    if as_json:
        print_json_lines(dicts)
    else:
        print_table(dicts, [f.name for f in dataclasses.fields(type(rows[0]))])


def print_json_lines(rows: list[dict], kind: str | None = None) -> None:
    """One JSON object per row, led by ``"kind": kind`` where given (a benchmark that prints several
    kinds of rows)."""
    for row in rows:
        print(json.dumps(row if kind is None else {"kind": kind, **row}))


def print_table(rows: list[dict], columns: list[str]) -> None:
    """A plain fixed-width table of ``rows`` (floats with 4 significant digits)."""

    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return "-" if v is None else str(v)

    cells = [[fmt(r[c]) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))
