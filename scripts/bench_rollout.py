"""Benchmark the rollout: our ``ppo.rollout.generate`` on an FSDP2-sharded model against plain HF generate.

Both paths decode the same prompts with the same weights in the same run, with ``ignore_eos`` so every
response is exactly ``--new-tokens`` long (equal work; generation is greedy unless ``--do-sample``):

- ``hf_generate``:  an unsharded copy of the model, ``model.generate`` on left-padded micro-batches;
- ``ppo_rollout``:  ``ppo.rollout.generate`` on the model sharded by ``ppo.sharding.shard_model``: the
  parameters are gathered once per call (``gathered_for_generation``), then the same HF generate runs
  with FSDP's forward hooks bypassed and no per-step sync between ranks. The target is >= 0.9x the
  plain path's tokens/s.
- ``ppo_compiled`` (with ``--compiled``): the trainer's compiled rollout (``rollout.compile``): the
  gathered weights copied into a persistent unsharded engine in the compute dtype
  (``ppo.rollout.make_engine``), which decodes with a static KV cache and a compiled step (CUDA graphs
  on GPU) on micro-batches padded to fixed shapes. Warmed up on the timed shapes (the first call
  compiles). Under greedy decoding its tokens must equal ``hf_generate``'s (``match``).

Both models use the trainer's attention (``models.resolve_attn_implementation("auto")``), which for
left-padded generation with a KV cache is transformers' sdpa (flash_attention_2 on GPU).

Tokens/s counts generated tokens over all ranks; a path's time is the slowest rank's, the best of
``--repeat`` runs (the two paths alternate, so load from other processes hits both alike). On CPU the
clock is the process's CPU time by default (``--clock``): on a machine shared with other jobs wall time
mostly measures the scheduler. Each rank uses one CPU thread (``--threads``), as under torchrun. With greedy
decoding the two paths' tokens are compared (``match``: the fraction of equal tokens, 1.0 expected).

The model is built from a config with random weights (``--model-config tiny|0.5b``, nothing is
downloaded) or loaded from ``--model-path``. Every rank builds the same weights (one seed).

Run:
    .venv/bin/python scripts/bench_rollout.py                        # one process, tiny model, table
    .venv/bin/python scripts/bench_rollout.py --json --num-prompts 8 --new-tokens 8
    .venv/bin/torchrun --standalone --nproc_per_node=2 scripts/bench_rollout.py
    torchrun --nproc_per_node=8 scripts/bench_rollout.py --model-config 0.5b --dtype bfloat16 \\
        --num-prompts 1024 --prompt-len 256 --new-tokens 512 --micro-batch 128
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ppo import models, rollout, sharding  # noqa: E402
from ppo.config import FSDPConfig, MixedPrecisionConfig  # noqa: E402
from ppo.distributed import (  # noqa: E402
    DistInfo,
    all_reduce_scalar,
    barrier,
    destroy_distributed,
    init_distributed,
    make_mesh,
)
from ppo.rollout import generate, generation_config  # noqa: E402

PAD_ID, EOS_ID = 0, 2
"""Token ids of the random models: prompts draw from ids >= 3."""


def _qwen2_5(
    *, hidden: int, mlp: int, layers: int, heads: int, kv_heads: int, vocab: int, tied: bool
) -> PretrainedConfig:
    """A Qwen2.5 model's architecture (its rotary base, norm epsilon and context length)."""
    return Qwen2Config(
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
    )


MODEL_CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    # A model of the CPU cost measurements in docs/platform.md: hidden 256, 4 layers, vocab 4096.
    "tiny": lambda: LlamaConfig(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=4096,
        max_position_embeddings=4096,
    ),
    # Qwen2.5-0.5B's shapes (494M parameters, tied embeddings).
    "0.5b": lambda: _qwen2_5(hidden=896, mlp=4864, layers=24, heads=14, kv_heads=2, vocab=151936, tied=True),
    # Qwen2.5-1.5B's shapes (1.54B parameters, tied embeddings).
    "1.5b": lambda: _qwen2_5(hidden=1536, mlp=8960, layers=28, heads=12, kv_heads=2, vocab=151936, tied=True),
    # Qwen2.5-7B's shapes (7.6B parameters, untied embeddings).
    "7b": lambda: _qwen2_5(hidden=3584, mlp=18944, layers=28, heads=28, kv_heads=4, vocab=152064, tied=False),
}


@dataclasses.dataclass
class Row:
    """One measured path."""

    path: str
    device: str
    clock: str
    dtype: str
    world_size: int
    model: str
    params_m: float
    num_prompts: int
    prompt_len: int
    new_tokens: int
    micro_batch: int
    time_s: float
    tokens_per_s: float
    ratio: float
    """tokens/s over the hf_generate row's."""
    match: float | None
    """Fraction of generated tokens equal to hf_generate's (greedy only)."""
    gather_s: float | None
    """Of ppo_rollout's time: gathering the parameters and releasing them (once per call)."""
    decode_ms: float
    """Milliseconds per decoding step: time_s / (new_tokens x micro-batches per rank)."""


# ----------------------------------------------------------------------------------------------------
# Shared with the other benchmarks: models from a config, the device, prompts
# ----------------------------------------------------------------------------------------------------


def model_config(name: str) -> PretrainedConfig:
    """The config of ``--model-config`` with PPO's token ids and dropout off."""
    if name not in MODEL_CONFIGS:
        raise SystemExit(f"--model-config must be one of {', '.join(MODEL_CONFIGS)}, got {name!r}")
    config = MODEL_CONFIGS[name]()
    config.pad_token_id, config.eos_token_id, config.bos_token_id = PAD_ID, EOS_ID, 1
    return config


def build_causal_lm(args: argparse.Namespace, device: torch.device) -> PreTrainedModel:
    """The policy on CPU in fp32: random weights from ``--model-config`` (same seed on every rank, since
    ``fully_shard`` keeps each rank's own slice), or ``--model-path``."""
    attn = models.resolve_attn_implementation("auto", device)
    if args.model_path:
        return models.load_causal_lm(args.model_path, attn_implementation=attn, config_key="--model-path")
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(model_config(args.model_config), attn_implementation=attn)
    return model.eval()


def build_critic(args: argparse.Namespace, device: torch.device) -> PreTrainedModel:
    """A critic (backbone + 1-output token head) from the same config or checkpoint as the policy."""
    attn = models.resolve_attn_implementation("auto", device)
    if args.model_path:
        return models.load_critic(args.model_path, attn_implementation=attn, config_key="--model-path")
    torch.manual_seed(args.seed + 1)
    config = model_config(args.model_config)
    config.num_labels = 1
    config.classifier_dropout = 0.0  # the head's dropout defaults to 0.1; PPO trains without dropout
    return AutoModelForTokenClassification.from_config(config, attn_implementation=attn)


def fsdp_config(dtype: str) -> FSDPConfig:
    """FSDP2 with the benchmark's compute dtype (fp32 master weights, as the trainer keeps them)."""
    return FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype=dtype, reduce_dtype="float32"))


def random_prompts(num: int, max_len: int, vocab_size: int, seed: int) -> list[torch.Tensor]:
    """``num`` prompts of random tokens, lengths uniform in ``[max_len // 2, max_len]`` (so left
    padding matters), the same on every rank for a given seed."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, max_len // 2), max_len + 1, (num,), generator=gen)
    return [torch.randint(3, vocab_size, (int(n),), generator=gen) for n in lengths]


def rank_share(items: list, info: DistInfo) -> list:
    """This rank's contiguous share of a global list (sizes differ by at most one)."""
    per, extra = divmod(len(items), info.world_size)
    start = info.rank * per + min(info.rank, extra)
    return items[start : start + per + (info.rank < extra)]


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


# ----------------------------------------------------------------------------------------------------
# The two paths
# ----------------------------------------------------------------------------------------------------


@torch.no_grad()
def hf_generate(
    model: PreTrainedModel,
    prompts: list[torch.Tensor],
    *,
    new_tokens: int,
    micro_batch: int,
    do_sample: bool,
    device: torch.device,
) -> torch.Tensor:
    """Plain HF generate, left-padded micro-batches, exactly ``new_tokens`` each: ``[B, new_tokens]``."""
    out = []
    for start in range(0, len(prompts), micro_batch):
        chunk = prompts[start : start + micro_batch]
        width = max(p.numel() for p in chunk)
        ids = torch.full((len(chunk), width), PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, p in enumerate(chunk):
            ids[i, width - p.numel() :] = p
            mask[i, width - p.numel() :] = 1
        gen = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # ignore EOS: equal work in both paths
            do_sample=do_sample,
            pad_token_id=PAD_ID,
            eos_token_id=EOS_ID,
            use_cache=True,
            **({} if do_sample else {"temperature": None, "top_p": None, "top_k": None}),
        )
        out.append(gen[:, width:])
    return torch.cat(out)


def ppo_rollout(
    model: torch.nn.Module,
    prompts: list[torch.Tensor],
    *,
    new_tokens: int,
    micro_batch: int,
    do_sample: bool,
    engine: torch.nn.Module | None = None,
) -> torch.Tensor:
    """Our rollout on the sharded model, or with ``engine`` the compiled one (``rollout.compile``):
    ``[B, new_tokens]``."""
    config = generation_config(
        max_new_tokens=new_tokens,
        do_sample=do_sample,
        eos_token_ids=[EOS_ID],
        pad_token_id=PAD_ID,
        ignore_eos=True,
        compile=engine is not None,
    )
    return generate(
        model, prompts, config, micro_batch_size=micro_batch, ignore_eos=True, engine=engine
    ).responses


def timed(fn: Callable[[], torch.Tensor], device: torch.device, clock: str) -> tuple[float, torch.Tensor]:
    """Seconds of ``fn()`` on the slowest rank (every rank starts together), and its result.

    ``clock``: ``wall`` (perf_counter), or ``cpu`` (this process's CPU time: on a CPU shared with other
    processes it counts only the work done, not the time the scheduler gave to others).
    """
    barrier()
    now = time.process_time if clock == "cpu" else time.perf_counter
    start = now()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = now() - start
    return all_reduce_scalar(elapsed, "max"), out


def run(args: argparse.Namespace, info: DistInfo) -> list[Row]:
    """Build both models, warm both paths up, then time them alternately ``--repeat`` times."""
    device = info.device
    clock = resolve_clock(args.clock, device)
    model = build_causal_lm(args, device)
    # The unsharded copy in the compute dtype: what FSDP's mixed precision computes in, too.
    plain = copy.deepcopy(model).to(device=device, dtype=sharding.torch_dtype(args.dtype)).eval()
    sharded = sharding.shard_model(model, make_mesh(info), fsdp_config(args.dtype), device=device)
    vocab = plain.config.get_text_config().vocab_size
    prompts = rank_share(random_prompts(args.num_prompts, args.prompt_len, vocab, args.seed), info)

    def run_hf(n: int = args.new_tokens, p: list[torch.Tensor] = prompts) -> torch.Tensor:
        if args.do_sample:
            torch.manual_seed(args.seed + info.rank)
        return hf_generate(
            plain, p, new_tokens=n, micro_batch=args.micro_batch, do_sample=args.do_sample, device=device
        )

    def run_ours(n: int = args.new_tokens, p: list[torch.Tensor] = prompts) -> torch.Tensor:
        if args.do_sample:
            torch.manual_seed(args.seed + info.rank)
        return ppo_rollout(sharded, p, new_tokens=n, micro_batch=args.micro_batch, do_sample=args.do_sample)

    engine = rollout.make_engine(sharded, sharding.torch_dtype(args.dtype), device) if args.compiled else None

    def run_compiled() -> torch.Tensor:
        if args.do_sample:
            torch.manual_seed(args.seed + info.rank)
        return ppo_rollout(
            sharded,
            prompts,
            new_tokens=args.new_tokens,
            micro_batch=args.micro_batch,
            do_sample=args.do_sample,
            engine=engine,
        )

    # Warm-up: first calls pay for lazy initialization (FSDP, kernels, allocator) on both paths; the
    # compiled path compiles for the timed shapes.
    run_hf(4, prompts[:2])
    run_ours(4, prompts[:2])
    paths = [("hf_generate", run_hf), ("ppo_rollout", run_ours)]
    if engine is not None:
        run_compiled()
        paths.append(("ppo_compiled", run_compiled))

    def gather_only() -> torch.Tensor:
        with sharding.gathered_for_generation(sharded):
            pass
        return torch.empty(0)

    best = {name: float("inf") for name, _ in [*paths, ("gather", None)]}
    outputs: dict[str, torch.Tensor] = {}
    for _ in range(args.repeat):
        for name, fn in [*paths, ("gather", gather_only)]:
            seconds, outputs[name] = timed(fn, device, clock)
            best[name] = min(best[name], seconds)

    def match(name: str) -> float | None:
        if args.do_sample or name == "hf_generate":
            return None
        equal = (outputs[name].cpu() == outputs["hf_generate"].cpu()).float()
        return all_reduce_scalar(float(equal.sum()), "sum") / (args.num_prompts * args.new_tokens)

    total_tokens = args.num_prompts * args.new_tokens
    base_tps = total_tokens / best["hf_generate"]
    decoding_steps = args.new_tokens * max(1, -(-len(prompts) // args.micro_batch))
    rows = []
    for name, _ in paths:
        seconds = best[name]
        rows.append(
            Row(
                path=name,
                device=device.type,
                clock=clock,
                dtype=args.dtype,
                world_size=info.world_size,
                model=args.model_path or args.model_config,
                params_m=round(models.count_parameters(plain) / 1e6, 2),
                num_prompts=args.num_prompts,
                prompt_len=args.prompt_len,
                new_tokens=args.new_tokens,
                micro_batch=args.micro_batch,
                time_s=seconds,
                tokens_per_s=total_tokens / seconds,
                ratio=total_tokens / seconds / base_tps,
                match=match(name),
                gather_s=best["gather"] if name == "ppo_rollout" else None,
                decode_ms=1000 * seconds / decoding_steps,
            )
        )
    return rows


def resolve_clock(clock: str, device: torch.device) -> str:
    """``auto``: CPU time on a CPU device (robust to other processes on a shared machine), else wall."""
    if clock == "auto":
        return "cpu" if device.type == "cpu" else "wall"
    return clock


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-config", default="tiny", help=f"one of {', '.join(MODEL_CONFIGS)}")
    parser.add_argument("--model-path", default=None, help="a save_pretrained folder instead")
    parser.add_argument("--num-prompts", type=int, default=32, help="prompts over all ranks")
    parser.add_argument("--prompt-len", type=int, default=32, help="longest prompt (shortest: half)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt")
    parser.add_argument("--micro-batch", type=int, default=32, help="prompts per generate call per rank")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--compiled", action="store_true", help="add the compiled rollout (ppo_compiled)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per path (best is kept)")
    parser.add_argument(
        "--clock", default="auto", choices=["auto", "wall", "cpu"], help="auto: cpu time on CPU, else wall"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads per rank (0: torch's default)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="one JSON object per row instead of a table")
    return parser.parse_args(argv)


def set_threads(threads: int) -> None:
    """One CPU thread per rank by default, as torchrun sets: on a CPU shared with other processes an
    OpenMP pool of several threads spins at every barrier and runs many times slower (measured 40x on
    2 loaded cores), which would swamp what is being compared."""
    if threads > 0:
        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    info = init_distributed(args.device, timeout_s=600)
    try:
        rows = run(args, info)
    finally:
        destroy_distributed()
    if info.is_main:
        dicts = [dataclasses.asdict(r) for r in rows]
        if args.json:
            for d in dicts:
                print(json.dumps(d))
        else:
            print_table(dicts, [f.name for f in dataclasses.fields(Row)])
            ratio = rows[1].ratio
            verdict = "meets" if ratio >= 0.9 else "misses"
            print(f"ppo_rollout / hf_generate = {ratio:.3f}x tokens/s ({verdict} the 0.9x target)")
            if len(rows) > 2:
                print(f"ppo_compiled / hf_generate = {rows[2].ratio:.3f}x tokens/s, match {rows[2].match}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
