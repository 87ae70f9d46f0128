"""Benchmark one PPO step by phase, packed (padding-free) against padded, on widely varying lengths.

One rollout is generated (``ppo.rollout.generate``, timed as ``gen``; the same for every path, since
generation does not depend on how the training forwards are laid out), then every response is cut to
a length drawn uniformly from ``[--min-response, --max-response]`` and the prompts vary in
``[--prompt-len / 2, --prompt-len]``: the spread that makes padding expensive. On that batch each path
runs the step's other phases with train_ppo's own functions (``score_logprobs``, ``score_values``,
``compute_advantages``, ``update_critic``, ``update_actor``; GAE, KL in the reward, 2 mini-batches):

- ``padded``:  every micro-batch right-padded to its longest sequence, ``[b, max_len]`` with an
  attention mask. The trainer is packed-only, so this layout lives here: ``pad_rows``,
  ``padded_logprobs`` and ``padded_values`` stand in for train_ppo's ``pack_rows``,
  ``packed_logprobs`` and ``packed_values`` while the loop itself stays the trainer's;
- ``packed``:  the trainer as it is, with the same fixed micro-batches (``--micro-batch`` sequences), so
  the only difference to ``padded`` is the padding;
- ``packed_dynamic``:  the trainer with token-budget micro-batches (``use_dynamic_bsz``, budget
  ``--micro-batch x`` the longest possible sequence): fewer, fuller forwards besides no padding;
- ``packed_dense``:  ``packed`` with the models switched to transformers' own sdpa for the step, which
  applies the block-diagonal mask to a dense ``T x T`` score matrix (the comparison for the trainer's
  per-sequence attention).

Columns: time per phase (old_log_prob, ref, values, update = critic + actor), ``train_s`` (their sum),
``computed_tokens`` (token slots fed through the models, padding included), ``pad_frac`` (padding
share of them), ``tokens_per_s`` (the batch's real tokens / train_s), ``speedup`` (padded train_s /
this train_s), ``expected`` (padded computed_tokens / this computed_tokens: what removing the
padding gives where time is proportional to tokens, as in the linear layers) and ``attn_vs_padded``
(attention score entries relative to padded). The trainer's attention
(``models.resolve_attn_implementation("auto")``: flash_attention_2 on GPU, else
``models.PACKED_ATTENTION``, sdpa per sequence) costs ``sum(l_i^2)`` per packed micro-batch, less than
padded ``b * L^2``; transformers' sdpa and eager (``packed_dense``) cost ``T^2``, ``T = sum(l_i)``, more
than padding does, and the more so the larger the micro-batch.

Each rank uses one CPU thread (``--threads``) and the CPU clock (``--clock``) by default, for the reasons
given in bench_rollout.py; sizes are per rank unless said otherwise.

Run:
    .venv/bin/python scripts/bench_step.py                         # tiny model, all four paths, table
    .venv/bin/python scripts/bench_step.py --paths padded packed --json
    .venv/bin/torchrun --standalone --nproc_per_node=2 scripts/bench_step.py
    torchrun --nproc_per_node=8 scripts/bench_step.py --model-config 0.5b --dtype bfloat16 \\
        --num-seqs 64 --prompt-len 256 --max-response 1024 --micro-batch 8
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_rollout import (  # noqa: E402
    EOS_ID,
    PAD_ID,
    build_causal_lm,
    build_critic,
    fsdp_config,
    print_table,
    random_prompts,
    resolve_clock,
    set_threads,
)

import kernels  # noqa: E402
import train_ppo  # noqa: E402
from ppo import data, models  # noqa: E402
from ppo.attention import PACKED_ATTENTION  # noqa: E402
from ppo.config import PPOConfig, load_config  # noqa: E402
from ppo.distributed import (  # noqa: E402
    DistInfo,
    all_reduce_scalar,
    all_reduce_scalars,
    barrier,
    destroy_distributed,
    init_distributed,
    make_mesh,
)
from ppo.optim import build_optimizer  # noqa: E402
from ppo.packing import Packed  # noqa: E402
from ppo.rollout import Rollout, generate  # noqa: E402

PATHS = ("padded", "packed", "packed_dynamic", "packed_dense")
VARLEN_ATTENTION = ("flash_attention_2", PACKED_ATTENTION)
"""Attention implementations that compute packed rows per sequence (``sum(l_i^2)``)."""
PHASES = ("old_log_prob", "ref", "values", "update")
T = TypeVar("T")
NUM_MINI_BATCHES = 2
"""Optimizer steps per model per PPO step (mini-batches of the rollout)."""


@dataclasses.dataclass
class Row:
    """One path's step."""

    path: str
    world_size: int
    num_seqs: int
    """Sequences over all ranks."""
    real_tokens: int
    """Prompt + response tokens of the batch, over all ranks."""
    computed_tokens: int
    """Token slots fed through the models over the step (all forwards, padding included), all ranks."""
    pad_frac: float
    """Share of computed_tokens that is padding."""
    attn_entries: int
    """Attention score entries computed over the step (all forwards, all ranks)."""
    gen_s: float
    """Rollout generation (shared by the paths: it does not depend on the training layout)."""
    old_log_prob_s: float
    ref_s: float
    values_s: float
    update_s: float
    """Critic update, then actor update (each NUM_MINI_BATCHES optimizer steps)."""
    train_s: float
    """old_log_prob + ref + values + update."""
    tokens_per_s: float
    """real_tokens / train_s."""
    speedup: float | None
    """The padded path's train_s / this path's."""
    expected: float | None
    """The padded path's computed_tokens / this path's."""
    attn_vs_padded: float | None = None
    """Attention work relative to the padded path's."""


# ----------------------------------------------------------------------------------------------------
# The padded layout (the trainer is packed-only; this is the baseline)
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True)
class Padded:
    """``b`` sequences (prompt + valid response) right-padded to the longest, ``[b, L]``."""

    input_ids: torch.Tensor
    """[b, L] token ids, ``PAD_ID`` after each sequence's end."""
    attention_mask: torch.Tensor
    """[b, L] 1 on real tokens, 0 on padding."""
    labels: torch.Tensor
    """[b, L] the next token where it is a response token, -100 elsewhere."""
    response_index: torch.Tensor
    """[b, R] position in the row whose next-token prediction is response token j (0 at padding)."""
    response_mask: torch.Tensor
    """[b, R] bool, True on valid response tokens."""
    num_real_tokens: int
    """Tokens that are not padding."""

    @property
    def num_tokens(self) -> int:
        """Token slots, padding included."""
        return int(self.input_ids.numel())


@dataclasses.dataclass
class TokenCounter:
    """Token slots fed through the models (``computed``) and the real tokens among them."""

    computed: int = 0
    real: int = 0
    attn: int = 0
    """Attention score entries (query x key pairs a kernel computes) summed over the forwards."""


def pad_rows(batch: train_ppo.Batch, sel: torch.Tensor) -> Padded:
    """The padded counterpart of ``train_ppo.pack_rows``: sequences ``sel`` as ``[b, max_len]``."""
    prompts = [batch.rollout.prompts[i] for i in sel.tolist()]
    responses = batch.rollout.responses[sel]
    mask = batch.response_mask[sel]
    device = responses.device
    lens = [p.numel() + int(n) for p, n in zip(prompts, mask.sum(-1).tolist(), strict=True)]
    b, width = len(prompts), max(lens)
    input_ids = torch.full((b, width), PAD_ID, dtype=torch.long, device=device)
    attention_mask = torch.zeros((b, width), dtype=torch.long, device=device)
    labels = torch.full((b, width), -100, dtype=torch.long, device=device)
    j = torch.arange(responses.shape[1], device=device)
    response_index = torch.zeros_like(responses)
    for i, (prompt, n) in enumerate(zip(prompts, lens, strict=True)):
        p = prompt.numel()
        input_ids[i, :n] = torch.cat([prompt.to(device), responses[i, : n - p]])
        attention_mask[i, :n] = 1
        # Response token j is predicted at position p - 1 + j (as in ppo.packing.pack).
        response_index[i] = torch.where(mask[i], p - 1 + j, torch.zeros_like(j))
        labels[i, response_index[i][mask[i]]] = responses[i][mask[i]]
    return Padded(
        input_ids=input_ids,
        attention_mask=attention_mask,
        labels=labels,
        response_index=response_index,
        response_mask=mask.bool(),
        num_real_tokens=sum(lens),
    )


def _gather_responses(x: torch.Tensor, padded: Padded) -> torch.Tensor:
    """``[b, L]`` per-position values -> ``[b, R]`` at the response tokens (0 at padding)."""
    out = x.gather(1, padded.response_index)
    return torch.where(padded.response_mask, out, torch.zeros_like(out))


def _forward_padded(model: torch.nn.Module, padded: Padded) -> torch.Tensor:
    """The model's output logits over the padded rows, ``[b, L, V]`` (or ``[b, L, 1]`` for a critic)."""
    # Right padding: positions 0.. are correct for every real token; the mask hides the padding.
    return model(input_ids=padded.input_ids, attention_mask=padded.attention_mask, use_cache=False).logits


def padded_logprobs(
    model: torch.nn.Module,
    padded: Padded,
    *,
    temperature: float,
    backend: str = "auto",
    compute_entropy: bool = False,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The padded counterpart of ``ppo.packing.packed_logprobs``: ``[b, R]`` log-probs (and entropy),
    computed over every position of ``[b, L]`` as a padded trainer does."""
    if fused:
        raise ValueError(
            "the padded baseline has no fused LM-head path; run with actor.use_fused_kernels=false"
        )
    logits = _forward_padded(model, padded)
    b, width, vocab = logits.shape
    lp, ent = kernels.logprobs_from_logits(
        logits.reshape(b * width, vocab),
        padded.labels.reshape(-1),
        temperature=temperature,
        compute_entropy=compute_entropy,
        backend=backend,
    )
    lp = _gather_responses(lp.view(b, width), padded)
    return lp, (_gather_responses(ent.view(b, width), padded) if ent is not None else None)


def padded_values(critic: torch.nn.Module, padded: Padded) -> torch.Tensor:
    """The padded counterpart of ``ppo.packing.packed_values``: ``[b, R]`` fp32."""
    return _gather_responses(_forward_padded(critic, padded)[..., 0].float(), padded)


@contextlib.contextmanager
def layout(path: str, counter: TokenCounter, *, varlen_attention: bool) -> Iterator[None]:
    """Run train_ppo's loop with the padded forwards (``padded``) or its own packed ones, counting the
    tokens of every micro-batch into ``counter``.

    Attention work: padded ``b * L^2``; packed ``sum(l_i^2)`` with per-sequence attention
    (``VARLEN_ATTENTION``), else ``T^2``: sdpa and eager apply the block-diagonal mask to a dense
    ``T x T`` score matrix.
    """
    names = ("pack_rows", "packed_logprobs", "packed_values")
    saved = {n: getattr(train_ppo, n) for n in names}

    def count_padded(batch: train_ppo.Batch, sel: torch.Tensor) -> Padded:
        padded = pad_rows(batch, sel)
        counter.computed += padded.num_tokens
        counter.real += padded.num_real_tokens
        counter.attn += padded.num_tokens * padded.input_ids.shape[1]
        return padded

    def count_packed(batch: train_ppo.Batch, sel: torch.Tensor) -> Packed:
        packed = saved["pack_rows"](batch, sel)
        counter.computed += packed.num_tokens
        counter.real += packed.num_tokens
        lens = packed.cu_seqlens.diff().long()
        counter.attn += int(lens.square().sum()) if varlen_attention else packed.num_tokens**2
        return packed

    if path == "padded":
        replacements = {
            "pack_rows": count_padded,
            "packed_logprobs": padded_logprobs,
            "packed_values": padded_values,
        }
    else:
        replacements = {"pack_rows": count_packed}
    try:
        for name, fn in replacements.items():
            setattr(train_ppo, name, fn)
        yield
    finally:
        for name, fn in saved.items():
            setattr(train_ppo, name, fn)


@contextlib.contextmanager
def attention(nets: dict[str, torch.nn.Module], name: str | None) -> Iterator[None]:
    """Switch every model to the attention implementation ``name`` for the duration (``None``: keep)."""
    if name is None:
        yield
        return
    saved = {key: net.config._attn_implementation for key, net in nets.items()}
    try:
        for net in nets.values():
            net.set_attn_implementation(name)
        yield
    finally:
        for key, net in nets.items():
            net.set_attn_implementation(saved[key])


# ----------------------------------------------------------------------------------------------------
# The step
# ----------------------------------------------------------------------------------------------------


def make_config(args: argparse.Namespace, path: str, world_size: int) -> PPOConfig:
    """The trainer's config for one path: GAE with a critic, KL in the reward, fixed or dynamic
    micro-batches of the same memory bound."""
    num_seqs = args.num_seqs * world_size
    dynamic = path == "packed_dynamic"
    max_len = args.prompt_len + args.max_response
    overrides = [
        f"data.train_batch_size={num_seqs}",
        f"data.max_prompt_length={args.prompt_len}",
        f"data.max_response_length={args.max_response}",
        f"actor.ppo_mini_batch_size={num_seqs // NUM_MINI_BATCHES}",
        f"actor.use_dynamic_bsz={str(dynamic).lower()}",
        f"actor.ppo_micro_batch_size_per_gpu={args.micro_batch}",
        f"actor.ppo_max_token_len_per_gpu={args.micro_batch * max_len}",
        f"critic.use_dynamic_bsz={str(dynamic).lower()}",
        f"critic.ppo_micro_batch_size_per_gpu={args.micro_batch}",
        f"critic.ppo_max_token_len_per_gpu={args.micro_batch * max_len}",
        "actor.use_fused_kernels=false",
        "actor.optim.lr=1e-6",
        "critic.optim.lr=1e-6",
        "rollout.n=1",
        "algorithm.adv_estimator=gae",
        "algorithm.use_kl_in_reward=true",
    ]
    cfg = load_config(None, overrides)
    cfg.validate(world_size)
    return cfg


def make_batch(
    args: argparse.Namespace, info: DistInfo, actor: torch.nn.Module, vocab: int
) -> tuple[train_ppo.Batch, float]:
    """This rank's rollout, cut to widely varying response lengths; returns (batch, gen seconds)."""
    prompts = random_prompts(args.num_seqs, args.prompt_len, vocab, args.seed + 1000 * info.rank)
    torch.manual_seed(args.seed + info.rank)
    gen_s, rollout = timed(
        lambda: generate(
            actor,
            prompts,
            pad_token_id=PAD_ID,
            eos_token_id=EOS_ID,
            max_new_tokens=args.max_response,
            do_sample=True,
            ignore_eos=True,
            micro_batch_size=args.num_seqs,
        ),
        info,
        args.clock,
    )
    gen = torch.Generator().manual_seed(args.seed + 7 + info.rank)
    lengths = torch.randint(args.min_response, args.max_response + 1, (args.num_seqs,), generator=gen)
    mask = torch.arange(args.max_response)[None, :] < lengths[:, None]
    mask = mask.to(rollout.responses.device)
    responses = torch.where(mask, rollout.responses, torch.full_like(rollout.responses, PAD_ID))
    cut = Rollout(prompts=rollout.prompts, responses=responses, response_mask=mask, truncated=~mask[:, -1])
    records = [
        data.PromptRecord(
            input_ids=p.tolist(), prompt_text="", data_source="bench", ground_truth="", extra_info={}, index=i
        )
        for i, p in enumerate(prompts)
    ]
    batch = train_ppo.Batch(rollout=cut, records=records, group_ids=torch.arange(len(records)))
    return batch, gen_s


def timed(fn: Callable[[], T], info: DistInfo, clock: str) -> tuple[float, T]:
    """(seconds of ``fn()`` on the slowest rank by ``clock``, its result); ranks start together."""
    barrier()
    now = time.process_time if clock == "cpu" else time.perf_counter
    start = now()
    out = fn()
    if info.device.type == "cuda":
        torch.cuda.synchronize(info.device)
    return all_reduce_scalar(now() - start, "max"), out


def run_step(
    cfg: PPOConfig,
    info: DistInfo,
    batch: train_ppo.Batch,
    scores: torch.Tensor,
    nets: dict[str, torch.nn.Module],
    optims: dict[str, tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]],
    clock: str,
    seed: int,
) -> dict[str, float]:
    """Phases 2-4 of a PPO step on ``batch`` with train_ppo's functions; seconds per phase."""
    torch.manual_seed(seed)  # the same mini-batch shuffles for every path
    times: dict[str, float] = {}
    times["old_log_prob"], (batch.old_logprobs, _) = timed(
        lambda: train_ppo.score_logprobs(cfg, nets["actor"], batch), info, clock
    )
    times["ref"], (batch.ref_logprobs, _) = timed(
        lambda: train_ppo.score_logprobs(cfg, nets["ref"], batch), info, clock
    )
    times["values"], batch.values = timed(
        lambda: train_ppo.score_values(cfg, nets["critic"], batch), info, clock
    )
    batch.scores = scores
    train_ppo.compute_advantages(cfg, batch, train_ppo.make_kl_controller(cfg), step=1)

    def update() -> None:
        train_ppo.update_critic(cfg, nets["critic"], *optims["critic"], batch, info)
        train_ppo.update_actor(cfg, nets["actor"], *optims["actor"], batch, info)

    times["update"], _ = timed(update, info, clock)
    return times


def build_models(args: argparse.Namespace, info: DistInfo) -> dict[str, torch.nn.Module]:
    """Actor, frozen reference (the actor's copy) and critic, each sharded with FSDP2."""
    device = info.device
    fsdp = fsdp_config(args.dtype)
    actor = build_causal_lm(args, device)
    ref = copy.deepcopy(actor).requires_grad_(False)
    critic = build_critic(args, device)
    return {
        name: models.shard_model(net, make_mesh(info), fsdp, device=device)
        for name, net in (("actor", actor), ("ref", ref), ("critic", critic))
    }


def run(args: argparse.Namespace, info: DistInfo) -> list[Row]:
    """Build the models and the batch, warm up, then time each path's step."""
    clock = resolve_clock(args.clock, info.device)
    args.clock = clock
    nets = build_models(args, info)
    vocab = nets["actor"].config.get_text_config().vocab_size
    base_cfg = make_config(args, "packed", info.world_size)
    total_updates = NUM_MINI_BATCHES * (len(args.paths) + 1)
    optims = {
        "actor": build_optimizer(nets["actor"], base_cfg.actor.optim, total_updates),
        "critic": build_optimizer(nets["critic"], base_cfg.critic.optim, total_updates),
    }
    batch, gen_s = make_batch(args, info, nets["actor"], vocab)
    scores = torch.rand(args.num_seqs, generator=torch.Generator().manual_seed(args.seed + info.rank))
    scores = scores.to(info.device)
    real_tokens = int(all_reduce_scalar(float(sum(batch.seq_lens)), "sum"))

    # Warm-up on a slice: lazy FSDP initialization, first optimizer steps (AdamW state), allocator.
    warm = train_ppo.Batch(
        rollout=Rollout(
            prompts=batch.rollout.prompts[: NUM_MINI_BATCHES * 2],
            responses=batch.rollout.responses[: NUM_MINI_BATCHES * 2],
            response_mask=batch.response_mask[: NUM_MINI_BATCHES * 2],
            truncated=batch.rollout.truncated[: NUM_MINI_BATCHES * 2],
        ),
        records=batch.records[: NUM_MINI_BATCHES * 2],
        group_ids=batch.group_ids[: NUM_MINI_BATCHES * 2],
    )
    warm_cfg = load_config(
        None,
        [
            f"data.train_batch_size={NUM_MINI_BATCHES * 2 * info.world_size}",
            f"actor.ppo_mini_batch_size={2 * info.world_size}",
            "rollout.n=1",
            "algorithm.use_kl_in_reward=true",
        ],
    )
    run_step(warm_cfg, info, warm, scores[: NUM_MINI_BATCHES * 2], nets, optims, clock, args.seed)

    varlen = nets["actor"].config._attn_implementation in VARLEN_ATTENTION
    rows: list[Row] = []
    for path in args.paths:
        cfg = make_config(args, path, info.world_size)
        counter = TokenCounter()
        dense = path == "packed_dense"
        with (
            layout(path, counter, varlen_attention=varlen and not dense),
            attention(nets, "sdpa" if dense else None),
        ):
            times = run_step(cfg, info, batch, scores, nets, optims, clock, args.seed)
        computed, real, attn = all_reduce_scalars(
            [float(counter.computed), float(counter.real), float(counter.attn)], "sum"
        )
        train_s = sum(times[p] for p in PHASES)
        rows.append(
            Row(
                path=path,
                world_size=info.world_size,
                num_seqs=args.num_seqs * info.world_size,
                real_tokens=real_tokens,
                computed_tokens=int(computed),
                pad_frac=1.0 - real / computed,
                attn_entries=int(attn),
                gen_s=gen_s,
                old_log_prob_s=times["old_log_prob"],
                ref_s=times["ref"],
                values_s=times["values"],
                update_s=times["update"],
                train_s=train_s,
                tokens_per_s=real_tokens / train_s,
                speedup=None,
                expected=None,
            )
        )
    padded = next((r for r in rows if r.path == "padded"), None)
    if padded is not None:
        for r in rows:
            r.speedup = padded.train_s / r.train_s
            r.expected = padded.computed_tokens / r.computed_tokens
            r.attn_vs_padded = r.attn_entries / padded.attn_entries
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-config", default="tiny", help="tiny or 0.5b (random weights)")
    parser.add_argument("--model-path", default=None, help="a save_pretrained folder instead")
    parser.add_argument("--num-seqs", type=int, default=32, help="sequences per rank")
    parser.add_argument("--prompt-len", type=int, default=48, help="longest prompt (shortest: half)")
    parser.add_argument("--min-response", type=int, default=8, help="shortest response")
    parser.add_argument("--max-response", type=int, default=160, help="longest response (generated length)")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per forward (fixed paths)")
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--clock", default="auto", choices=["auto", "wall", "cpu"])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank (0: default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="one JSON object per row instead of a table")
    args = parser.parse_args(argv)
    if args.num_seqs % (2 * NUM_MINI_BATCHES) or args.num_seqs < 2 * NUM_MINI_BATCHES:
        parser.error(f"--num-seqs must be a positive multiple of {2 * NUM_MINI_BATCHES}")
    if not 1 <= args.min_response <= args.max_response:
        parser.error("need 1 <= --min-response <= --max-response")
    return args


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
            padded = next((r for r in rows if r.path == "padded"), None)
            for r in rows:
                if padded is not None and r is not padded:
                    print(
                        f"{r.path}: {r.speedup:.2f}x the padded step's speed; padding was {padded.pad_frac:.0%} "
                        f"of the padded path's tokens, so {r.expected:.2f}x is expected from token counts; "
                        f"its attention work is {r.attn_vs_padded:.2f}x the padded path's"
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
