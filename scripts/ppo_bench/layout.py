"""Benchmark one PPO step's training phases with the trainer's packed rows against right-padded ones.

One rollout is generated (``ppo.rollout.generate``, timed as ``gen``; the same for every path, since
generation does not depend on how the training forwards are laid out), then every response is cut to a
length drawn uniformly from ``[--min-response, --max-response]`` and the prompts vary in
``[--prompt-len / 2, --prompt-len]``: the spread that makes padding expensive. On that batch (a
``ppo.batch.Batch`` with a random score per sequence) every path runs phases 2-4 of the trainer's step
(``run_step``): the scoring forwards of the actor (``old_log_prob``), the frozen reference (``ref``) and
the critic (``values``); advantages (``ppo.batch_advantages.compute_advantages``: GAE with the k1 KL in
the reward); then the critic's and the actor's updates (``update``: ``ppo.optimize.optimize``,
``NUM_MINI_BATCHES`` mini-batches of one epoch each, AdamW from ``ppo.optim.with_optimizer``). Every
setting comes from a ``PPOConfig`` (``ppo.config_loader.load_config``, see ``path_config``):
micro-batches, token budget, mini-batches, clipping, learning rate.

- ``packed``: the trainer's own functions (``TRAINER``): ``ppo.forwards.forward_logprobs``,
  ``forward_values``, and ``optimize`` with ``ppo.optimize.critic_loss`` and ``actor_loss``; fixed
  micro-batches of ``--micro-batch`` sequences (``use_dynamic_bsz=false``);
- ``packed_dynamic``: ``packed`` with token-budget micro-batches (``use_dynamic_bsz=true``, budget
  ``--micro-batch x`` the longest possible sequence): fewer, fuller forwards besides no padding;
- ``packed_dense``: ``packed`` on models loaded with transformers' own sdpa
  (``model.attn_implementation=sdpa``), which applies the block-diagonal mask to a dense ``T x T`` score
  matrix (the comparison for the trainer's per-sequence attention);
- ``padded``: the baseline (``PADDED``). The trainer is packed-only, so this layout is the benchmark's
  own: every micro-batch right-padded to its longest sequence, ``[b, max_len]`` with an attention mask.
  It scores and trains through the same loops (the micro-batch plan of ``ppo.packing.micro_batches``,
  ``optimize``) with loss closures of the same math (``ppo.algorithms.policy_loss``, ``value_loss``,
  ``agg_loss``), so it differs from ``packed`` only in the padding.

Every path gets its own models built from the same seed (identical weights) and fresh optimizers, is
warmed up on a slice of the batch, then timed ``--repeat`` times (median per phase). The mini-batch
shuffle is seeded alike for every path, so all paths compute the same losses up to rounding.

Columns: time per phase (old_log_prob, ref, values, update = critic + actor), ``train_s`` (their sum),
``computed_tokens`` (token slots fed through the models, padding included), ``pad_frac`` (padding
share of them), ``tokens_per_s`` (the batch's real tokens / train_s), ``speedup`` (padded train_s /
this train_s), ``expected`` (padded computed_tokens / this computed_tokens: what removing the
padding gives where time is proportional to tokens, as in the linear layers), ``attn_vs_padded``
(attention score entries relative to padded), and ``pg_loss``, ``vf_loss``, ``actor_grad_norm``,
``critic_grad_norm`` (the first timed step's means of ``optimize``'s metrics: equal on every path up to
rounding, which shows that the padded baseline computes the trainer's step). The trainer's attention
(``resolve_attn_implementation("auto")``: flash_attention_2 or torch's varlen flash on GPU, else
``PACKED_ATTENTION``, sdpa per sequence) costs ``sum(l_i^2)`` per packed micro-batch, less than
padded ``b * L^2``; transformers' sdpa and eager (``packed_dense``) cost ``T^2``, ``T = sum(l_i)``, more
than padding does, and the more so the larger the micro-batch.

Each rank uses one CPU thread (``--threads``) and the CPU clock (``--clock``) by default, for the reasons
given in rollout.py; sizes are per rank unless said otherwise.

Run:
    .venv/bin/python -m ppo_bench.layout                         # tiny model, all four paths, table
    .venv/bin/python -m ppo_bench.layout --paths padded packed --json
    .venv/bin/torchrun --standalone --nproc_per_node=2 -m ppo_bench.layout
    torchrun --nproc_per_node=8 -m ppo_bench.layout --model-config 0.5b --dtype bfloat16 \\
        --num-seqs 64 --prompt-len 256 --max-response 1024 --micro-batch 8
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections.abc import Callable

import torch
from torch import nn

from ppo import sharding
from ppo.attention import PACKED_ATTENTION, VARLEN_FLASH, resolve_attn_implementation
from ppo.batch import Batch, Rollout, group_index
from ppo.batch_advantages import compute_advantages
from ppo.build import make_kl_controller
from ppo.config import PPOConfig
from ppo.config_loader import load_config
from ppo.data import PromptRecord
from ppo.distributed import DistInfo, all_reduce_scalars, exit_process
from ppo.forwards import forward_logprobs, forward_values
from ppo.optim import Trained, with_optimizer
from ppo.optimize import LossFn, actor_loss, critic_loss, optimize
from ppo.packing import micro_batches
from ppo.rollout import generate, generation_config
from ppo.ulysses import NO_SP, SPGroup
from ppo_bench.common import (
    add_common_args,
    add_model_args,
    build_models,
    on_every_rank,
    print_rows,
    random_prompts,
    resolve_clock,
    timed,
)
from ppo_bench.layout_padded import (
    padded_actor_loss,
    padded_critic_loss,
    padded_forward_logprobs,
    padded_forward_values,
)
from ppo_bench.shapes import EOS_ID, PAD_ID

PATHS = ("padded", "packed", "packed_dynamic", "packed_dense")
VARLEN_ATTENTION = ("flash_attention_2", VARLEN_FLASH, PACKED_ATTENTION)
"""Attention implementations that compute packed rows per sequence (``sum(l_i^2)``)."""
PHASES = ("old_log_prob", "ref", "values", "update")
NUM_MINI_BATCHES = 2
"""Optimizer steps per model per PPO step (mini-batches of the rollout, one epoch)."""


# ----------------------------------------------------------------------------------------------------
# The step (phases 2-4 of train_ppo's step, with the layout as a parameter)
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """How a path feeds the models: its scoring forwards and its update's loss closures, each with the
    signature of the trainer's function of the same name."""

    padded: bool
    forward_logprobs: Callable[[PPOConfig, nn.Module, Batch, int, SPGroup], torch.Tensor]
    forward_values: Callable[[PPOConfig, nn.Module, Batch, SPGroup], torch.Tensor]
    actor_loss: Callable[[PPOConfig, nn.Module, Batch, SPGroup], LossFn]
    critic_loss: Callable[[PPOConfig, nn.Module, Batch, SPGroup], LossFn]


TRAINER = Layout(
    padded=False,
    forward_logprobs=forward_logprobs,
    forward_values=forward_values,
    actor_loss=actor_loss,
    critic_loss=critic_loss,
)
PADDED = Layout(
    padded=True,
    forward_logprobs=padded_forward_logprobs,
    forward_values=padded_forward_values,
    actor_loss=padded_actor_loss,
    critic_loss=padded_critic_loss,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchPath:
    """One measured path: its config, its layout and the attention its models load with."""

    name: str
    cfg: PPOConfig
    layout: Layout
    attn: str
    """The models' ``attn_implementation`` (from ``model.attn_implementation``)."""


@dataclasses.dataclass(kw_only=True)
class Models:
    """A path's models: the actor and the critic with their optimizers, the frozen reference."""

    actor: Trained
    critic: Trained
    ref: nn.Module


@dataclasses.dataclass
class Work:
    """What a layout fed through the models: token slots, the real tokens among them, attention
    score entries (query x key pairs a kernel computes), summed over forwards."""

    computed: int = 0
    real: int = 0
    attn: int = 0


def count_work(path: BenchPath, batch: Batch, forwards: list[torch.Tensor]) -> Work:
    """The work of ``forwards`` (each a forward's row indices into ``batch``) in the path's layout."""
    lens = batch.seq_lens
    work = Work()
    for sel in forwards:
        n = [lens[i] for i in sel.tolist()]
        work.real += sum(n)
        if path.layout.padded:
            work.computed += len(n) * max(n)
            work.attn += len(n) * max(n) ** 2
        else:
            work.computed += sum(n)
            work.attn += sum(k * k for k in n) if path.attn in VARLEN_ATTENTION else sum(n) ** 2
    return work


def scoring_forwards(cfg: PPOConfig, batch: Batch) -> list[torch.Tensor]:
    """The micro-batches of the three scoring passes: the plans ``forward_logprobs`` (actor, reference)
    and ``forward_values`` make (``ppo.packing.micro_batches``)."""
    rows = batch.rows()
    return [
        *micro_batches(batch, rows, cfg.actor, cfg.actor.ppo_micro_batch_size_per_gpu),
        *micro_batches(batch, rows, cfg.actor, cfg.ref.log_prob_micro_batch_size_per_gpu),
        *micro_batches(batch, rows, cfg.critic),
    ]


def update(path: BenchPath, models: Models, batch: Batch, forwards: list[torch.Tensor]) -> dict[str, float]:
    """The critic's update, then the actor's, as ``train_ppo.update_critic`` / ``update_actor`` run them:
    ``optimize`` with the layout's loss closures, then a scheduler step. Each micro-batch's rows are
    appended to ``forwards``."""
    cfg, layout = path.cfg, path.layout

    def recorded(loss_fn: LossFn) -> LossFn:
        def fn(sel: torch.Tensor, counts: dict[str, float]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            forwards.append(sel)
            return loss_fn(sel, counts)

        return fn

    c, a = cfg.critic, cfg.actor
    metrics = optimize(
        c,
        "critic",
        models.critic,
        batch,
        recorded(layout.critic_loss(cfg, models.critic.model, batch, NO_SP)),
        num_mini=cfg.data.train_batch_size // c.ppo_mini_batch_size,
        shuffle=a.shuffle,
        sp=NO_SP,
    )
    models.critic.scheduler.step()
    metrics |= optimize(
        a,
        "actor",
        models.actor,
        batch,
        recorded(layout.actor_loss(cfg, models.actor.model, batch, NO_SP)),
        num_mini=cfg.data.train_batch_size // a.ppo_mini_batch_size,
        shuffle=a.shuffle,
        sp=NO_SP,
        early_stop_kl=a.early_stop_kl,
    )
    models.actor.scheduler.step()
    return metrics


def run_step(
    path: BenchPath, models: Models, batch: Batch, info: DistInfo, clock: str, seed: int
) -> tuple[dict[str, float], Work, dict[str, float]]:
    """Score (old log-probs, reference log-probs, values), advantages, then update the critic and the
    actor; seconds per phase on the slowest rank, the work the layout fed through the models, and the
    update's metrics (``optimize``'s, reduced over ranks)."""
    cfg, layout = path.cfg, path.layout
    times: dict[str, float] = {}
    times["old_log_prob"], batch.old_logprobs = timed(
        lambda: layout.forward_logprobs(
            cfg, models.actor.model, batch, cfg.actor.ppo_micro_batch_size_per_gpu, NO_SP
        ),
        info,
        clock,
    )

    def reference() -> torch.Tensor:
        out = layout.forward_logprobs(
            cfg, models.ref, batch, cfg.ref.log_prob_micro_batch_size_per_gpu, NO_SP
        )
        sharding.release(models.ref)  # as ppo.forwards.forward_reference does
        return out

    times["ref"], batch.ref_logprobs = timed(reference, info, clock)
    times["values"], batch.values = timed(
        lambda: layout.forward_values(cfg, models.critic.model, batch, NO_SP), info, clock
    )
    compute_advantages(cfg, batch, make_kl_controller(cfg), step=1)
    torch.manual_seed(seed + info.rank)  # the same mini-batches on every path
    updated: list[torch.Tensor] = []
    times["update"], metrics = timed(lambda: update(path, models, batch, updated), info, clock)
    return times, count_work(path, batch, scoring_forwards(cfg, batch) + updated), metrics


# ----------------------------------------------------------------------------------------------------
# Config, batch, paths
# ----------------------------------------------------------------------------------------------------


def path_config(args: argparse.Namespace, path: str, world_size: int) -> PPOConfig:
    """The trainer's config of a path: one response per prompt, ``NUM_MINI_BATCHES`` mini-batches of one
    epoch, fixed micro-batches of ``--micro-batch`` sequences or (``packed_dynamic``) a token budget of
    ``--micro-batch`` longest sequences, GAE with the k1 KL in the reward, the defaults' clipping."""
    num_seqs = args.num_seqs * world_size
    dynamic = str(path == "packed_dynamic").lower()
    budget = args.micro_batch * (args.prompt_len + args.max_response)
    overrides = [
        "rollout.n=1",
        f"data.train_batch_size={num_seqs}",
        f"data.max_prompt_length={args.prompt_len}",
        f"data.max_response_length={args.max_response}",
        f"actor.ppo_mini_batch_size={num_seqs // NUM_MINI_BATCHES}",
        "actor.ppo_epochs=1",
        f"ref.log_prob_micro_batch_size_per_gpu={args.micro_batch}",
        "algorithm.adv_estimator=gae",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_penalty=kl",
        f"model.attn_implementation={'sdpa' if path == 'packed_dense' else 'auto'}",
    ]
    for role in ("actor", "critic"):
        overrides += [
            f"{role}.use_dynamic_bsz={dynamic}",
            f"{role}.ppo_micro_batch_size_per_gpu={args.micro_batch}",
            f"{role}.ppo_max_token_len_per_gpu={budget}",
            f"{role}.optim.lr=1e-6",
        ]
    cfg = load_config(None, overrides)
    cfg.validate(world_size, inputs=False)  # the models are --model-config's, the batch synthetic
    return cfg


def make_path(args: argparse.Namespace, name: str, info: DistInfo) -> BenchPath:
    cfg = path_config(args, name, info.world_size)
    return BenchPath(
        name=name,
        cfg=cfg,
        layout=PADDED if name == "padded" else TRAINER,
        attn=resolve_attn_implementation(cfg.model.attn_implementation, info.device),
    )


def make_batch(args: argparse.Namespace, info: DistInfo, actor: nn.Module, clock: str) -> tuple[Batch, float]:
    """This rank's rollout, cut to widely varying response lengths, with a random score per sequence;
    returns (batch, gen seconds)."""
    vocab = actor.config.get_text_config().vocab_size
    prompts = random_prompts(args.num_seqs, args.prompt_len, vocab, args.seed + 1000 * info.rank)
    prompts = [p.to(info.device) for p in prompts]
    torch.manual_seed(args.seed + info.rank)
    config = generation_config(
        max_new_tokens=args.max_response,
        do_sample=True,
        eos_token_ids=[EOS_ID],
        pad_token_id=PAD_ID,
        ignore_eos=True,
    )
    gen_s, rollout = timed(
        lambda: generate(actor, prompts, config, micro_batch_size=args.num_seqs, ignore_eos=True), info, clock
    )
    gen = torch.Generator().manual_seed(args.seed + 7 + info.rank)
    lengths = torch.randint(args.min_response, args.max_response + 1, (args.num_seqs,), generator=gen)
    mask = (torch.arange(args.max_response)[None, :] < lengths[:, None]).to(rollout.responses.device)
    responses = torch.where(mask, rollout.responses, torch.full_like(rollout.responses, PAD_ID))
    records = [
        PromptRecord(
            input_ids=p.tolist(),
            prompt_text="",
            data_source="random",
            ground_truth=None,
            extra_info={},
            index=i,
        )
        for i, p in enumerate(prompts)
    ]
    batch = Batch(
        rollout=Rollout(
            prompts=prompts, responses=responses, attention_mask=mask, truncated=rollout.truncated
        ),
        records=records,
        group_ids=group_index(args.num_seqs, 1, info.device),
        scores=torch.rand(args.num_seqs, generator=gen).to(info.device),
    )
    return batch, gen_s


def slice_batch(batch: Batch, n: int) -> Batch:
    """The first ``n`` sequences (the warm-up batch)."""
    r = batch.rollout
    return Batch(
        rollout=Rollout(
            prompts=r.prompts[:n],
            responses=r.responses[:n],
            attention_mask=r.attention_mask[:n],
            truncated=r.truncated[:n],
        ),
        records=batch.records[:n],
        group_ids=batch.group_ids[:n],
        scores=batch.scores[:n],
    )


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
    """old_log_prob + ref + values + update (medians over --repeat)."""
    tokens_per_s: float
    """real_tokens / train_s."""
    speedup: float | None
    """The padded path's train_s / this path's."""
    expected: float | None
    """The padded path's computed_tokens / this path's."""
    attn_vs_padded: float | None = None
    """Attention work relative to the padded path's."""
    pg_loss: float | None = None
    """The first timed step's mean ``actor/pg_loss`` over its updates (the same on every path)."""
    vf_loss: float | None = None
    """The first timed step's mean ``critic/vf_loss`` over its updates (the same on every path)."""
    actor_grad_norm: float | None = None
    """The first timed step's mean ``actor/grad_norm`` (before clipping): the gradient of the whole
    loss, every term of it (the same on every path)."""
    critic_grad_norm: float | None = None
    """The first timed step's mean ``critic/grad_norm`` (the same on every path)."""


def run_layouts(args: argparse.Namespace, info: DistInfo) -> list[Row]:
    """Generate the batch once, then per path: build, warm up, time ``--repeat`` steps."""
    clock = resolve_clock(args.clock, info.device)
    batch = gen_s = None
    rows: list[Row] = []
    for name in args.paths:
        path = make_path(args, name, info)
        nets = build_models(args, info, path.attn)
        if batch is None:
            batch, gen_s = make_batch(args, info, nets["actor"], clock)
        total_steps = 1 + args.repeat
        models = Models(
            actor=with_optimizer(nets["actor"], path.cfg.actor.optim, total_steps),
            critic=with_optimizer(nets["critic"], path.cfg.critic.optim, total_steps),
            ref=nets["ref"],
        )
        # Warm-up on a slice: lazy FSDP initialization, AdamW state, allocator.
        run_step(path, models, slice_batch(batch, 2 * NUM_MINI_BATCHES), info, clock, args.seed)
        steps = [run_step(path, models, batch, info, clock, args.seed) for _ in range(args.repeat)]
        times = {p: statistics.median(t[p] for t, _, _ in steps) for p in PHASES}
        _, work, metrics = steps[0]
        computed, real, attn_entries, real_tokens = all_reduce_scalars(
            [float(work.computed), float(work.real), float(work.attn), float(sum(batch.seq_lens))], "sum"
        )
        train_s = sum(times.values())
        rows.append(
            Row(
                path=name,
                world_size=info.world_size,
                num_seqs=args.num_seqs * info.world_size,
                real_tokens=int(real_tokens),
                computed_tokens=int(computed),
                pad_frac=1.0 - real / computed,
                attn_entries=int(attn_entries),
                gen_s=gen_s,
                old_log_prob_s=times["old_log_prob"],
                ref_s=times["ref"],
                values_s=times["values"],
                update_s=times["update"],
                train_s=train_s,
                tokens_per_s=real_tokens / train_s,
                speedup=None,
                expected=None,
                pg_loss=metrics["actor/pg_loss"],
                vf_loss=metrics["critic/vf_loss"],
                actor_grad_norm=metrics["actor/grad_norm"],
                critic_grad_norm=metrics["critic/grad_norm"],
            )
        )
        del nets, models
    padded = next((r for r in rows if r.path == "padded"), None)
    if padded is not None:
        for r in rows:
            r.speedup = padded.train_s / r.train_s
            r.expected = padded.computed_tokens / r.computed_tokens
            r.attn_vs_padded = r.attn_entries / padded.attn_entries
    return rows


# ----------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-seqs", type=int, default=32, help="sequences per rank")
    parser.add_argument("--prompt-len", type=int, default=48, help="longest prompt (shortest: half)")
    parser.add_argument("--min-response", type=int, default=8, help="shortest response")
    parser.add_argument("--max-response", type=int, default=160, help="longest response (generated length)")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per forward (fixed paths)")
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    parser.add_argument("--repeat", type=int, default=3, help="timed steps per path (medians)")
    add_model_args(parser)
    add_common_args(parser)
    args = parser.parse_args(argv)
    per_mini, rest = divmod(args.num_seqs, NUM_MINI_BATCHES)
    if rest or per_mini < 2 or args.micro_batch < 1 or per_mini % args.micro_batch:
        parser.error(
            f"--num-seqs must split into {NUM_MINI_BATCHES} mini-batches of at least 2 sequences, each a "
            f"multiple of --micro-batch (as the trainer's config requires)"
        )
    if not 1 <= args.min_response <= args.max_response:
        parser.error("need 1 <= --min-response <= --max-response")
    if args.repeat < 1:
        parser.error("need --repeat >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows, info = on_every_rank(args, run_layouts)
    if info.is_main:
        print_rows(rows, args.json)
        padded = next((r for r in rows if r.path == "padded"), None)
        if not args.json and padded is not None:
            for r in rows:
                if r is not padded:
                    print(
                        f"{r.path}: {r.speedup:.2f}x the padded step's speed; padding was {padded.pad_frac:.0%} "
                        f"of the padded path's tokens, so {r.expected:.2f}x is expected from token counts; "
                        f"its attention work is {r.attn_vs_padded:.2f}x the padded path's"
                    )
    return 0


if __name__ == "__main__":
    exit_process(main())
