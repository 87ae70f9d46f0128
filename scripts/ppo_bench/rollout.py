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
- ``ppo_reprefill`` (with ``--reprefill``): ``ppo_rollout`` with ``share_prefill=False``, every row's
  prompt prefilled by plain ``generate``; beside ``ppo_rollout`` (which prefills each distinct prompt of a
  micro-batch once, ``ppo.prefill``) it measures the shared prefill. ``--n``: each prompt ``n`` times in a
  row, as ``rollout.n`` makes the trainer's prompt list.

Both models use the trainer's attention (``attention.resolve_attn_implementation("auto")``), which for
left-padded generation with a KV cache is transformers' sdpa (flash_attention_2 on GPU).

Tokens/s counts generated tokens over all ranks; a path's time is the slowest rank's, the best of
``--repeat`` runs (the two paths alternate, so load from other processes hits both alike). On CPU the
clock is the process's CPU time by default (``--clock``): on a machine shared with other jobs wall time
mostly measures the scheduler. Each rank uses one CPU thread (``--threads``), as under torchrun. With greedy
decoding the two paths' tokens are compared (``match``: the fraction of equal tokens, 1.0 expected).

The model is built from a config with random weights (``--model-config tiny|0.5b``, nothing is
downloaded) or loaded from ``--model-path``. Every rank builds the same weights (one seed).

Run:
    .venv/bin/python -m ppo_bench.rollout                        # one process, tiny model, table
    .venv/bin/python -m ppo_bench.rollout --json --num-prompts 8 --new-tokens 8
    .venv/bin/torchrun --standalone --nproc_per_node=2 -m ppo_bench.rollout
    .venv/bin/python -m ppo_bench.rollout --num-prompts 4 --n 8 --prompt-len 256 --new-tokens 32 \
        --micro-batch 32 --reprefill --do-sample
    torchrun --nproc_per_node=8 -m ppo_bench.rollout --model-config 0.5b --dtype bfloat16 \\
        --num-prompts 1024 --prompt-len 256 --new-tokens 512 --micro-batch 128
"""

from __future__ import annotations

import argparse
import copy
import dataclasses

import torch
from transformers import PreTrainedModel

from ppo import attention, models, rollout, sharding
from ppo.distributed import DistInfo, all_reduce_scalar, exit_process, make_mesh, rank_slice
from ppo.rollout import generate, generation_config
from ppo_bench.common import (
    add_common_args,
    add_model_args,
    causal_lm,
    fsdp_config,
    on_every_rank,
    print_rows,
    random_prompts,
    resolve_clock,
    timed,
)
from ppo_bench.shapes import EOS_ID, PAD_ID


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
    n: int
    """Rows per prompt (``--n``): ``num_prompts x n`` responses."""
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
    share_prefill: bool = True,
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
        model,
        prompts,
        config,
        micro_batch_size=micro_batch,
        ignore_eos=True,
        engine=engine,
        share_prefill=share_prefill,
    ).responses


def run(args: argparse.Namespace, info: DistInfo) -> list[Row]:
    """Build both models, warm both paths up, then time them alternately ``--repeat`` times."""
    device = info.device
    clock = resolve_clock(args.clock, device)
    model = causal_lm(args, attention.resolve_attn_implementation("auto", device)).eval()
    # The unsharded copy in the compute dtype: what FSDP's mixed precision computes in, too.
    plain = copy.deepcopy(model).to(device=device, dtype=sharding.torch_dtype(args.dtype)).eval()
    sharded = sharding.shard_model(model, make_mesh(info), fsdp_config(args.dtype), device=device)
    vocab = plain.config.get_text_config().vocab_size
    distinct = random_prompts(args.num_prompts, args.prompt_len, vocab, args.seed)
    prompts = rank_slice([p for p in distinct for _ in range(args.n)], info)

    def run_hf(n: int = args.new_tokens, p: list[torch.Tensor] = prompts) -> torch.Tensor:
        if args.do_sample:
            torch.manual_seed(args.seed + info.rank)
        return hf_generate(
            plain, p, new_tokens=n, micro_batch=args.micro_batch, do_sample=args.do_sample, device=device
        )

    def run_ours(
        n: int = args.new_tokens, p: list[torch.Tensor] = prompts, share_prefill: bool = True
    ) -> torch.Tensor:
        if args.do_sample:
            torch.manual_seed(args.seed + info.rank)
        return ppo_rollout(
            sharded,
            p,
            new_tokens=n,
            micro_batch=args.micro_batch,
            do_sample=args.do_sample,
            share_prefill=share_prefill,
        )

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
    if args.reprefill:
        paths.append(("ppo_reprefill", lambda: run_ours(share_prefill=False)))
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
            seconds, outputs[name] = timed(fn, info, clock)
            best[name] = min(best[name], seconds)

    def match(name: str) -> float | None:
        if args.do_sample or name == "hf_generate":
            return None
        equal = (outputs[name].cpu() == outputs["hf_generate"].cpu()).float()
        return all_reduce_scalar(float(equal.sum()), "sum") / (args.num_prompts * args.n * args.new_tokens)

    total_tokens = args.num_prompts * args.n * args.new_tokens
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
                n=args.n,
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(parser)
    add_model_args(parser)
    parser.add_argument("--num-prompts", type=int, default=32, help="distinct prompts over all ranks")
    parser.add_argument("--n", type=int, default=1, help="rows per prompt, consecutive (rollout.n)")
    parser.add_argument("--prompt-len", type=int, default=32, help="longest prompt (shortest: half)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt")
    parser.add_argument("--micro-batch", type=int, default=32, help="prompts per generate call per rank")
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--compiled", action="store_true", help="add the compiled rollout (ppo_compiled)")
    parser.add_argument(
        "--reprefill", action="store_true", help="add ppo_rollout without the shared prefill (ppo_reprefill)"
    )
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per path (best is kept)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows, info = on_every_rank(args, run)
    if info.is_main:
        print_rows(rows, args.json)
        if not args.json:
            ratio = rows[1].ratio
            verdict = "meets" if ratio >= 0.9 else "misses"
            print(f"ppo_rollout / hf_generate = {ratio:.3f}x tokens/s ({verdict} the 0.9x target)")
            for row in rows[2:]:
                print(f"{row.path} / hf_generate = {row.ratio:.3f}x tokens/s, match {row.match}")
    return 0


if __name__ == "__main__":
    exit_process(main())
