"""Benchmark the memory Ulysses sequence parallelism saves on one long sequence.

One sequence of ``--seq-len`` tokens (16384 by default: random tokens after a ``--prompt-len`` prompt,
the same on every rank) goes through the trainer's packed forwards (``ppo.packed_forward.logprobs`` /
``values``) phase by phase: ``actor`` (log-probs and entropy, a PPO-like loss, backward),
``critic`` (values, squared error, backward) and ``ref`` (log-probs without gradients). Each phase runs
once with groups of 1 (every rank the whole sequence) and once with groups of ``--sp N`` (each rank
``1/N`` of its tokens). The models load with the trainer's attention for sequence parallelism
(``resolve_attn_implementation("auto", sequence_parallel=True)``) and are sharded with FSDP2. Run it on
``N`` ranks or a multiple.

Columns: ``sp``, ``phase``, ``seq_len``, ``peak_mib`` (the phase's peak allocation beyond what existed
before it, largest over ranks: activations, gradients and temporaries, FSDP's gathered parameters
included; measured as kernels.py does), ``time_s`` (the phase without the memory tracking, slowest
rank), ``vs_sp1`` (``peak_mib`` over the SP=1 row's; the target for ``--sp 2`` is <= 0.6) and
``max_abs_diff`` (the outputs against SP=1's: the same numbers, split differently). ``--fused-kernels``
takes the fused LM head (no ``[T, vocab]`` logits).

Each rank uses one CPU thread (``--threads``) and the CPU clock (``--clock``) by default, for the reasons
given in rollout.py.

Run:
    .venv/bin/torchrun --standalone --nproc_per_node=2 -m ppo_bench.sp --sp 2 --seq-len 16384
    .venv/bin/torchrun --standalone --nproc_per_node=2 -m ppo_bench.sp --seq-len 1024 --json
    torchrun --nproc_per_node=8 -m ppo_bench.sp --sp 8 --model-config 0.5b --dtype bfloat16 \\
        --seq-len 65536 --fused-kernels
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
from typing import Any

import torch

from ppo import packed_forward, ulysses
from ppo.attention import resolve_attn_implementation
from ppo.distributed import (
    DistInfo,
    all_reduce_scalar,
    barrier,
    exit_process,
)
from ppo.packing import Packed, pack
from ppo_bench.common import (
    add_common_args,
    add_model_args,
    build_models,
    cpu_peak_bytes,
    cuda_peak_bytes,
    on_every_rank,
    print_rows,
    resolve_clock,
    timed,
)

PHASES = ("actor", "critic", "ref")
TEMPERATURE = 1.0


@dataclasses.dataclass
class SPRow:
    """One phase on one sequence, with or without sequence parallelism."""

    sp: int
    phase: str
    """``actor`` (log-probs + entropy, PPO-like loss, backward), ``critic`` (values, squared error,
    backward) or ``ref`` (log-probs without gradients)."""
    seq_len: int
    """Tokens of the sequence (each rank of a group holds ``seq_len / sp`` of them)."""
    peak_mib: float
    """Peak memory the phase allocates beyond what existed before it, largest over ranks: activations,
    gradients and temporaries, FSDP's gathered parameters included (``common.cpu_peak_bytes``:
    torch's CPU allocations and frees, or ``cuda_peak_bytes``: CUDA's allocator statistics)."""
    time_s: float
    """The phase without the memory tracking, slowest rank."""
    vs_sp1: float | None = None
    """peak_mib / the SP=1 row's (the target for ``--sp 2``: <= 0.6)."""
    max_abs_diff: float | None = None
    """Largest difference of this row's outputs (log-probs, values) to SP=1's on the same sequence."""


def sp_phase(
    phase: str, nets: dict[str, torch.nn.Module], packed: Packed, sp: ulysses.SPGroup, fused: bool
) -> torch.Tensor:
    """One phase on the packed sequence; returns its detached ``[1, R]`` output."""
    if phase == "critic":
        values = packed_forward.values(nets["critic"], packed, sp)
        ((values - 1.0).square().mean()).backward()
        return values.detach()
    grad = phase == "actor"
    with torch.set_grad_enabled(grad):
        logprobs, entropy = packed_forward.logprobs(
            nets[phase], packed, sp, temperature=TEMPERATURE, compute_entropy=grad, fused=fused
        )
    if grad:
        # The clipped PPO loss on fresh log-probs is -A * ratio; an entropy bonus besides.
        (-(logprobs.exp() * 0.5).mean() - 0.01 * entropy.mean()).backward()
    return logprobs.detach()


def run_sp(args: argparse.Namespace, info: DistInfo) -> list[SPRow]:
    """Per SP size (1, then ``--sp``) and phase: the peak memory of one pass over one sequence of
    ``--seq-len`` tokens (the same on every rank), then its time without tracking."""
    if info.world_size % args.sp:
        raise SystemExit(f"--sp {args.sp} must divide the world size {info.world_size}")
    clock = resolve_clock(args.clock, info.device)
    attn = resolve_attn_implementation("auto", info.device, sequence_parallel=True)
    nets = build_models(args, info, attn)
    for name, net in nets.items():
        ulysses.check_heads(net.config, args.sp, f"--sp ({name})")
    vocab = nets["actor"].config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    prompt_len = min(args.prompt_len, args.seq_len - 1)

    def sequence(length: int) -> Packed:
        tokens = torch.randint(3, vocab, (length,), generator=gen).to(info.device)
        response = tokens[None, prompt_len:]
        return pack([tokens[:prompt_len]], response, torch.ones_like(response, dtype=torch.bool))

    def zero_grads() -> None:
        for net in nets.values():
            net.zero_grad(set_to_none=True)

    packed, warm = sequence(args.seq_len), sequence(min(args.seq_len, 4 * prompt_len))
    rows: list[SPRow] = []
    outputs: dict[tuple[int, str], torch.Tensor] = {}
    for sp_size in (1, args.sp):
        sp = ulysses.make_sp_groups(sp_size)
        for phase in PHASES:
            sp_phase(phase, nets, warm, sp, args.fused_kernels)  # lazy initialization, allocator warm-up
            zero_grads()
            gc.collect()
            barrier()

            def tracked(phase: str = phase, sp: Any = sp) -> None:
                outputs[sp.size, phase] = sp_phase(phase, nets, packed, sp, args.fused_kernels)

            peak = cuda_peak_bytes(tracked) if info.device.type == "cuda" else cpu_peak_bytes(tracked)
            zero_grads()
            run = functools.partial(sp_phase, phase, nets, packed, sp, args.fused_kernels)
            time_s, _ = timed(run, info, clock)
            zero_grads()
            rows.append(
                SPRow(
                    sp=sp_size,
                    phase=phase,
                    seq_len=args.seq_len,
                    peak_mib=all_reduce_scalar(peak / 2**20, "max"),
                    time_s=time_s,
                )
            )
        if sp_size == args.sp:
            break  # --sp 1: the baseline alone
    base_rows = {r.phase: r for r in rows if r.sp == 1}
    for r in rows:
        r.vs_sp1 = r.peak_mib / base_rows[r.phase].peak_mib
        diff = (outputs[r.sp, r.phase] - outputs[1, r.phase]).abs().max().item()
        r.max_abs_diff = all_reduce_scalar(diff, "max")
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sp", type=int, default=2, help="sequence-parallel size to compare with 1")
    parser.add_argument("--seq-len", type=int, default=16384, help="tokens of the sequence")
    parser.add_argument("--prompt-len", type=int, default=48, help="prompt tokens at its start")
    parser.add_argument("--fused-kernels", action="store_true", help="log-probs without [T, vocab] logits")
    add_model_args(parser)
    add_common_args(parser)
    args = parser.parse_args(argv)
    if args.sp < 1 or args.seq_len < 2 or args.prompt_len < 1:
        parser.error("need --sp >= 1, --seq-len >= 2 and --prompt-len >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows, info = on_every_rank(args, run_sp)
    if info.is_main:
        print_rows(rows, args.json)
        if not args.json:
            for r in rows:
                if r.sp > 1:
                    print(
                        f"{r.phase}: SP={r.sp} peaks at {r.vs_sp1:.2f}x SP=1's memory per rank "
                        f"({r.peak_mib:.0f} vs {r.peak_mib / r.vs_sp1:.0f} MiB) on {r.seq_len} tokens"
                    )
    return 0


if __name__ == "__main__":
    exit_process(main())
