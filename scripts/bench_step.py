"""Benchmark one PPO step: the packed layout against a padded one (``--mode layout``), and the trainer's
fixed per-step cost against TRL's PPOTrainer on a tiny model (``--mode overhead``, issue 12).

``--mode layout`` (default): one rollout is generated (``ppo.rollout.generate``, timed as ``gen``; the same
for every path, since generation does not depend on how the training forwards are laid out), then every
response is cut to a length drawn uniformly from ``[--min-response, --max-response]`` and the prompts vary
in ``[--prompt-len / 2, --prompt-len]``: the spread that makes padding expensive. On that batch each path
runs the step's training phases, the same work for every path (``run_step``, with the layout as a
parameter): scoring forwards of the actor (``old_log_prob``), the frozen reference (``ref``) and the
critic (``values``), GAE, then ``NUM_MINI_BATCHES`` forward+backward updates of the critic and of the
actor (clipped value and policy losses of ``ppo.algorithms``, AdamW from ``ppo.optim``, the trainer's
``runner.optimizer_step``) over the same micro-batch plan (``ppo.packing.plan_micro_batches``):

- ``padded``:  every micro-batch right-padded to its longest sequence, ``[b, max_len]`` with an attention
  mask. The trainer is packed-only, so this layout is the benchmark's own (``PaddedLayout``);
- ``packed``:  the library as the trainer uses it (``PackedLayout``: ``ppo.packing.pack``,
  ``packed_logprobs``, ``packed_values``) with the same fixed micro-batches (``--micro-batch``
  sequences), so the only difference to ``padded`` is the padding;
- ``packed_dynamic``:  ``packed`` with token-budget micro-batches (``use_dynamic_bsz``, budget
  ``--micro-batch x`` the longest possible sequence): fewer, fuller forwards besides no padding;
- ``packed_dense``:  ``packed`` on models loaded with transformers' own sdpa, which applies the
  block-diagonal mask to a dense ``T x T`` score matrix (the comparison for the trainer's per-sequence
  attention).

Every path gets its own models built from the same seed (identical weights) and fresh optimizers, is
warmed up on a slice of the batch, then timed ``--repeat`` times (median per phase).

Columns: time per phase (old_log_prob, ref, values, update = critic + actor), ``train_s`` (their sum),
``computed_tokens`` (token slots fed through the models, padding included), ``pad_frac`` (padding
share of them), ``tokens_per_s`` (the batch's real tokens / train_s), ``speedup`` (padded train_s /
this train_s), ``expected`` (padded computed_tokens / this computed_tokens: what removing the
padding gives where time is proportional to tokens, as in the linear layers) and ``attn_vs_padded``
(attention score entries relative to padded). The trainer's attention
(``models.resolve_attn_implementation("auto")``: flash_attention_2 or torch's varlen flash on GPU, else
``PACKED_ATTENTION``, sdpa per sequence) costs ``sum(l_i^2)`` per packed micro-batch, less than
padded ``b * L^2``; transformers' sdpa and eager (``packed_dense``) cost ``T^2``, ``T = sum(l_i)``, more
than padding does, and the more so the larger the micro-batch.

``--mode overhead``: issue 12's configuration through the real trainer, one process: a Llama of
``--layers`` x ``--hidden`` (2 x 128) on the tiny character tokenizer of make_tiny_assets.py, actor and
critic from that backbone, a reward model; ``--num-prompts`` (16) prompts x ``--response-len`` (32)
tokens (``rollout.ignore_eos``, so every response has that length), GAE with KL in the reward, 2 epochs of
2 mini-batches. The models and a prompt Parquet are written to a temporary folder, then
``train_ppo.main`` runs ``--steps`` steps; a step's time is the CPU time between the trainer's
consecutive step log lines (read by a logging handler), its phases come from ``metrics.jsonl``
(``timing_s/*``, wall clock). Steps 1 and 2 are not counted. Where TRL is importable
(``--trl-path`` adds a private install to ``sys.path``; nothing of TRL is in the project's
dependencies), TRL's ``PPOTrainer`` runs the same shapes in the same process: ``trl`` as shipped, and
``trl_gc_frozen`` with ``gc.freeze()`` before training, which takes the per-step ``gc.collect()`` of its
loop out of the timing (the issue's 0.21 s figure). The runs alternate ``--rounds`` times so that load
from other processes hits all alike; medians over all counted steps, with min and max. Columns:
``step_cpu_s`` (median), ``step_cpu_min_s``, ``step_cpu_max_s``, ``step_wall_s``, the phases (ours, wall
seconds) and ``vs_trl`` (``trl_gc_frozen``'s step_cpu_s / this one's: the target is >= 1.5).

``--sp N`` (``--mode sp``): the memory Ulysses sequence parallelism saves on one long sequence
(``--seq-len`` tokens, 16384 by default, random tokens after a ``--prompt-len`` prompt) with the
trainer's functions (``ppo.ulysses.packed_logprobs`` / ``packed_values``): per phase, ``actor``
(log-probs and entropy, a PPO-like loss, backward), ``critic`` (values, squared error, backward) and
``ref`` (log-probs without gradients), once with groups of 1 (every rank the whole sequence) and once
with groups of ``N`` (each rank ``1/N`` of its tokens). Columns: ``peak_mib`` (the phase's peak
allocation beyond what existed before it, largest over ranks: activations, gradients and temporaries,
FSDP's gathered parameters included; measured as bench_kernels.py does), ``time_s``, ``vs_sp1``
(``peak_mib`` over the SP=1 row's; the target for ``--sp 2`` is <= 0.6) and ``max_abs_diff`` (the
outputs against SP=1's: the same numbers, split differently). ``--fused-kernels`` takes the fused LM
head (no ``[T, vocab]`` logits). Run it on ``N`` ranks or a multiple.

Each rank uses one CPU thread (``--threads``) and the CPU clock (``--clock``) by default, for the reasons
given in bench_rollout.py; sizes are per rank unless said otherwise.

Run:
    .venv/bin/python scripts/bench_step.py                         # tiny model, all four paths, table
    .venv/bin/python scripts/bench_step.py --paths padded packed --json
    .venv/bin/torchrun --standalone --nproc_per_node=2 scripts/bench_step.py
    torchrun --nproc_per_node=8 scripts/bench_step.py --model-config 0.5b --dtype bfloat16 \\
        --num-seqs 64 --prompt-len 256 --max-response 1024 --micro-batch 8
    pip install --no-deps --target /tmp/trl trl==1.12.0              # TRL beside, not into, the venv
    .venv/bin/python scripts/bench_step.py --mode overhead --trl-path /tmp/trl
    .venv/bin/torchrun --standalone --nproc_per_node=2 scripts/bench_step.py --sp 2 --seq-len 16384
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import itertools
import json
import logging
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    LlamaConfig,
    PreTrainedModel,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_kernels import cpu_peak_bytes, cuda_peak_bytes  # noqa: E402
from bench_rollout import (  # noqa: E402
    EOS_ID,
    PAD_ID,
    fsdp_config,
    model_config,
    print_table,
    random_prompts,
    resolve_clock,
    set_threads,
)

import kernels  # noqa: E402
from ppo import algorithms, models, runner, sharding, ulysses  # noqa: E402
from ppo.attention import PACKED_ATTENTION, VARLEN_FLASH  # noqa: E402
from ppo.config import OptimConfig  # noqa: E402
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
from ppo.packing import pack, packed_logprobs, packed_values, plan_micro_batches  # noqa: E402
from ppo.rollout import generate, generation_config  # noqa: E402

PATHS = ("padded", "packed", "packed_dynamic", "packed_dense")
VARLEN_ATTENTION = ("flash_attention_2", VARLEN_FLASH, PACKED_ATTENTION)
"""Attention implementations that compute packed rows per sequence (``sum(l_i^2)``)."""
PHASES = ("old_log_prob", "ref", "values", "update")
T = TypeVar("T")
NUM_MINI_BATCHES = 2
"""Optimizer steps per model per PPO step (mini-batches of the rollout)."""
TEMPERATURE = 1.0
CLIP_RATIO = 0.2
CLIP_RATIO_C = 3.0
CLIPRANGE_VALUE = 0.5
KL_COEF = 0.001
GRAD_CLIP = 1.0


# ----------------------------------------------------------------------------------------------------
# The batch and the two layouts
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True)
class StepBatch:
    """This rank's sequences and what the step computes about them; token tensors ``[B, R]``."""

    prompts: list[torch.Tensor]
    """``B`` prompts ``[P_i]``."""
    responses: torch.Tensor
    """[B, R] response tokens, ``PAD_ID`` after each response's end."""
    response_mask: torch.Tensor
    """[B, R] bool, True on valid response tokens."""
    scores: torch.Tensor
    """[B] a random score per sequence (the reward is not what is measured)."""
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    @property
    def seq_lens(self) -> list[int]:
        """Prompt + valid response tokens of each sequence."""
        resp = self.response_mask.sum(-1).tolist()
        return [p.numel() + int(r) for p, r in zip(self.prompts, resp, strict=True)]

    def rows(self, sel: list[int]) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """Prompts, responses and mask of the sequences ``sel``."""
        idx = torch.tensor(sel, dtype=torch.long, device=self.responses.device)
        return [self.prompts[i] for i in sel], self.responses[idx], self.response_mask[idx]


@dataclasses.dataclass
class Work:
    """What a layout fed through the models: token slots, the real tokens among them, attention
    score entries (query x key pairs a kernel computes), summed over forwards."""

    computed: int = 0
    real: int = 0
    attn: int = 0


class PackedLayout:
    """The trainer's layout: ``ppo.packing.pack`` then ``packed_logprobs`` / ``packed_values``.

    ``varlen_attention``: whether the models' attention computes each packed sequence on its own
    (``sum(l_i^2)`` score entries) or a dense block-diagonal mask (``T^2``); it counts, not decides.
    """

    name = "packed"

    def __init__(self, varlen_attention: bool) -> None:
        self.varlen_attention = varlen_attention

    def prepare(
        self, prompts: list[torch.Tensor], responses: torch.Tensor, mask: torch.Tensor, work: Work
    ) -> Any:
        packed = pack(prompts, responses, mask)
        lens = [b - a for a, b in itertools.pairwise(packed.offsets)]
        work.computed += packed.num_tokens
        work.real += packed.num_tokens
        work.attn += sum(n * n for n in lens) if self.varlen_attention else packed.num_tokens**2
        return packed

    def logprobs(
        self, model: torch.nn.Module, inputs: Any, *, compute_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return packed_logprobs(model, inputs, temperature=TEMPERATURE, compute_entropy=compute_entropy)

    def values(self, critic: torch.nn.Module, inputs: Any) -> torch.Tensor:
        return packed_values(critic, inputs)


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


class PaddedLayout:
    """The baseline: right-padded ``[b, max_len]`` rows with an attention mask, as a padded trainer runs."""

    name = "padded"

    def prepare(
        self, prompts: list[torch.Tensor], responses: torch.Tensor, mask: torch.Tensor, work: Work
    ) -> Padded:
        device = responses.device
        mask = mask.bool()
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
        work.computed += b * width
        work.real += sum(lens)
        work.attn += b * width * width
        return Padded(
            input_ids=input_ids,
            attention_mask=attention_mask,
            labels=labels,
            response_index=response_index,
            response_mask=mask,
        )

    def logprobs(
        self, model: torch.nn.Module, inputs: Padded, *, compute_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = self._forward(model, inputs)
        b, width, vocab = logits.shape
        lp, ent = kernels.logprobs_from_logits(
            logits.reshape(b * width, vocab),
            inputs.labels.reshape(-1),
            temperature=TEMPERATURE,
            compute_entropy=compute_entropy,
        )
        lp = self._gather(lp.view(b, width), inputs)
        return lp, (self._gather(ent.view(b, width), inputs) if ent is not None else None)

    def values(self, critic: torch.nn.Module, inputs: Padded) -> torch.Tensor:
        return self._gather(self._forward(critic, inputs)[..., 0].float(), inputs)

    @staticmethod
    def _forward(model: torch.nn.Module, inputs: Padded) -> torch.Tensor:
        # Right padding: positions 0.. are right for every real token; the mask hides the padding.
        return model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask, use_cache=False).logits

    @staticmethod
    def _gather(x: torch.Tensor, inputs: Padded) -> torch.Tensor:
        """``[b, L]`` per-position values -> ``[b, R]`` at the response tokens (0 at padding)."""
        out = x.gather(1, inputs.response_index)
        return torch.where(inputs.response_mask, out, torch.zeros_like(out))


Layout = PackedLayout | PaddedLayout


# ----------------------------------------------------------------------------------------------------
# The step (phases 2-4 of train_ppo's step, with the layout as a parameter)
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """How sequences are cut into micro-batches (``ppo.packing.plan_micro_batches``'s parameters)."""

    use_dynamic_bsz: bool
    max_tokens: int
    micro_batch_size: int

    def groups(self, batch: StepBatch, idx: list[int]) -> list[list[int]]:
        """Micro-batches (lists of row indices) of the sequences ``idx``."""
        lens = batch.seq_lens
        plan = plan_micro_batches(
            [lens[i] for i in idx],
            use_dynamic_bsz=self.use_dynamic_bsz,
            max_tokens=self.max_tokens,
            micro_batch_size=self.micro_batch_size,
        )
        return [[idx[j] for j in group] for group in plan]


@torch.no_grad()
def score(
    layout: Layout, model: torch.nn.Module, batch: StepBatch, plan: Plan, work: Work, *, critic: bool = False
) -> torch.Tensor:
    """Log-probs (or the critic's values) of every response token, ``[B, R]`` fp32."""
    out = torch.zeros_like(batch.response_mask, dtype=torch.float32)
    for sel in plan.groups(batch, list(range(len(batch.prompts)))):
        inputs = layout.prepare(*batch.rows(sel), work)
        idx = torch.tensor(sel, dtype=torch.long, device=out.device)
        out[idx] = layout.values(model, inputs) if critic else layout.logprobs(model, inputs)[0]
    return out


def compute_advantages(batch: StepBatch) -> None:
    """The score on the last response token minus the k1 KL to the reference, then GAE (gamma = lam = 1)."""
    mask = batch.response_mask
    rows = torch.arange(mask.shape[0], device=mask.device)
    token_rewards = torch.zeros_like(mask, dtype=torch.float32)
    token_rewards[rows, (mask.sum(-1) - 1).clamp(min=0)] = batch.scores
    kl = torch.where(mask, batch.old_logprobs - batch.ref_logprobs, torch.zeros_like(token_rewards))
    batch.advantages, batch.returns = algorithms.compute_gae(
        token_rewards - KL_COEF * kl, batch.values, mask, 1.0, 1.0
    )


def update(
    layout: Layout,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: StepBatch,
    plan: Plan,
    work: Work,
    *,
    critic: bool,
    seed: int,
) -> None:
    """``NUM_MINI_BATCHES`` optimizer steps, each accumulating the micro-batches of a mini-batch
    (token-mean losses normalized by the mini-batch's valid tokens over all ranks)."""
    order = torch.randperm(len(batch.prompts), generator=torch.Generator().manual_seed(seed)).tolist()
    size = len(order) // NUM_MINI_BATCHES
    for m in range(NUM_MINI_BATCHES):
        mini = sorted(order[m * size : (m + 1) * size])
        num_tokens = max(all_reduce_scalar(float(batch.response_mask[mini].sum()), "sum"), 1.0)
        for sel in plan.groups(batch, mini):
            inputs = layout.prepare(*batch.rows(sel), work)
            idx = torch.tensor(sel, dtype=torch.long, device=batch.response_mask.device)
            mask = batch.response_mask[idx]
            if critic:
                values = layout.values(model, inputs)
                loss, _ = algorithms.value_loss(
                    values, batch.values[idx], batch.returns[idx], mask, CLIPRANGE_VALUE, "token-mean",
                    num_tokens=num_tokens,
                )  # fmt: skip
            else:
                logprobs, _ = layout.logprobs(model, inputs, compute_entropy=True)
                loss, _ = algorithms.policy_loss(
                    logprobs, batch.old_logprobs[idx], batch.advantages[idx], mask, CLIP_RATIO, CLIP_RATIO,
                    CLIP_RATIO_C, "token-mean", num_tokens=num_tokens,
                )  # fmt: skip
            loss.backward()
        runner.optimizer_step(model, optimizer, GRAD_CLIP)


def run_step(
    layout: Layout,
    nets: dict[str, torch.nn.Module],
    optims: dict[str, torch.optim.Optimizer],
    batch: StepBatch,
    plan: Plan,
    info: DistInfo,
    clock: str,
    seed: int,
) -> tuple[dict[str, float], Work]:
    """Score (old log-probs, reference log-probs, values), advantages, then update the critic and the
    actor; seconds per phase on the slowest rank, and the work the layout fed through the models."""
    work = Work()
    times: dict[str, float] = {}
    times["old_log_prob"], batch.old_logprobs = timed(
        lambda: score(layout, nets["actor"], batch, plan, work), info, clock
    )
    times["ref"], batch.ref_logprobs = timed(
        lambda: score(layout, nets["ref"], batch, plan, work), info, clock
    )
    times["values"], batch.values = timed(
        lambda: score(layout, nets["critic"], batch, plan, work, critic=True), info, clock
    )
    compute_advantages(batch)

    def both() -> None:
        update(layout, nets["critic"], optims["critic"], batch, plan, work, critic=True, seed=seed)
        update(layout, nets["actor"], optims["actor"], batch, plan, work, critic=False, seed=seed)

    times["update"], _ = timed(both, info, clock)
    return times, work


def timed(fn: Callable[[], T], info: DistInfo, clock: str) -> tuple[float, T]:
    """(seconds of ``fn()`` on the slowest rank by ``clock``, its result); ranks start together."""
    barrier()
    now = time.process_time if clock == "cpu" else time.perf_counter
    start = now()
    out = fn()
    if info.device.type == "cuda":
        torch.cuda.synchronize(info.device)
    return all_reduce_scalar(now() - start, "max"), out


# ----------------------------------------------------------------------------------------------------
# Models, batch, paths
# ----------------------------------------------------------------------------------------------------


def build_models(
    args: argparse.Namespace, info: DistInfo, attn_implementation: str
) -> dict[str, torch.nn.Module]:
    """Actor, frozen reference (the actor's weights) and critic with ``attn_implementation``, each sharded
    with FSDP2. Random weights from ``--model-config`` (the same seed for every call and rank), or
    ``--model-path``."""
    device = info.device

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
        config.classifier_dropout = 0.0
        return AutoModelForTokenClassification.from_config(config, attn_implementation=attn_implementation)

    nets = {
        "actor": causal_lm().train(),
        "ref": causal_lm().requires_grad_(False).eval(),
        "critic": critic().train(),
    }
    fsdp = fsdp_config(args.dtype)
    return {
        name: sharding.shard_model(net, make_mesh(info), fsdp, device=device) for name, net in nets.items()
    }


def make_batch(args: argparse.Namespace, info: DistInfo, actor: torch.nn.Module) -> tuple[StepBatch, float]:
    """This rank's rollout, cut to widely varying response lengths; returns (batch, gen seconds)."""
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
        lambda: generate(actor, prompts, config, micro_batch_size=args.num_seqs, ignore_eos=True),
        info,
        args.clock,
    )
    gen = torch.Generator().manual_seed(args.seed + 7 + info.rank)
    lengths = torch.randint(args.min_response, args.max_response + 1, (args.num_seqs,), generator=gen)
    mask = (torch.arange(args.max_response)[None, :] < lengths[:, None]).to(rollout.responses.device)
    responses = torch.where(mask, rollout.responses, torch.full_like(rollout.responses, PAD_ID))
    scores = torch.rand(args.num_seqs, generator=gen).to(info.device)
    return StepBatch(prompts=prompts, responses=responses, response_mask=mask, scores=scores), gen_s


def path_setup(args: argparse.Namespace, path: str, device: torch.device) -> tuple[Layout, str, Plan]:
    """The layout, the models' attention implementation and the micro-batch plan of a path."""
    auto = models.resolve_attn_implementation("auto", device)
    attn = "sdpa" if path == "packed_dense" else auto
    layout = PaddedLayout() if path == "padded" else PackedLayout(varlen_attention=attn in VARLEN_ATTENTION)
    plan = Plan(
        use_dynamic_bsz=path == "packed_dynamic",
        max_tokens=args.micro_batch * (args.prompt_len + args.max_response),
        micro_batch_size=args.micro_batch,
    )
    return layout, attn, plan


def slice_batch(batch: StepBatch, n: int) -> StepBatch:
    """The first ``n`` sequences (the warm-up batch)."""
    return StepBatch(
        prompts=batch.prompts[:n],
        responses=batch.responses[:n],
        response_mask=batch.response_mask[:n],
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


def run_layouts(args: argparse.Namespace, info: DistInfo) -> list[Row]:
    """Generate the batch once, then per path: build, warm up, time ``--repeat`` steps."""
    args.clock = resolve_clock(args.clock, info.device)
    batch = gen_s = None
    rows: list[Row] = []
    for path in args.paths:
        layout, attn, plan = path_setup(args, path, info.device)
        nets = build_models(args, info, attn)
        if batch is None:
            batch, gen_s = make_batch(args, info, nets["actor"])
        optims = {
            name: build_optimizer(nets[name], OptimConfig(lr=1e-6), 1 + args.repeat)[0]
            for name in ("actor", "critic")
        }
        # Warm-up on a slice: lazy FSDP initialization, AdamW state, allocator.
        run_step(
            layout, nets, optims, slice_batch(batch, 2 * NUM_MINI_BATCHES), plan, info, args.clock, args.seed
        )
        steps = [
            run_step(layout, nets, optims, batch, plan, info, args.clock, args.seed)
            for _ in range(args.repeat)
        ]
        times = {p: statistics.median(t[p] for t, _ in steps) for p in PHASES}
        work = steps[0][1]
        computed, real, attn_entries, real_tokens = all_reduce_scalars(
            [float(work.computed), float(work.real), float(work.attn), float(sum(batch.seq_lens))], "sum"
        )
        train_s = sum(times.values())
        rows.append(
            Row(
                path=path,
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
            )
        )
        del nets, optims
    padded = next((r for r in rows if r.path == "padded"), None)
    if padded is not None:
        for r in rows:
            r.speedup = padded.train_s / r.train_s
            r.expected = padded.computed_tokens / r.computed_tokens
            r.attn_vs_padded = r.attn_entries / padded.attn_entries
    return rows


# ----------------------------------------------------------------------------------------------------
# --sp N: peak memory per rank of one long sequence with Ulysses sequence parallelism
# ----------------------------------------------------------------------------------------------------


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
    gradients and temporaries, FSDP's gathered parameters included (``bench_kernels.cpu_peak_bytes``:
    torch's CPU allocations and frees, or ``cuda_peak_bytes``: CUDA's allocator statistics)."""
    time_s: float
    """The phase without the memory tracking, slowest rank."""
    vs_sp1: float | None = None
    """peak_mib / the SP=1 row's (the target for ``--sp 2``: <= 0.6)."""
    max_abs_diff: float | None = None
    """Largest difference of this row's outputs (log-probs, values) to SP=1's on the same sequence."""


def sp_phase(
    phase: str, nets: dict[str, torch.nn.Module], packed: Any, sp: Any, args: argparse.Namespace
) -> torch.Tensor:
    """One phase on the packed sequence; returns its detached ``[1, R]`` output."""
    if phase == "critic":
        values = ulysses.packed_values(nets["critic"], packed, sp)
        ((values - 1.0).square().mean()).backward()
        return values.detach()
    grad = phase == "actor"
    with torch.set_grad_enabled(grad):
        logprobs, entropy = ulysses.packed_logprobs(
            nets[phase],
            packed,
            sp,
            temperature=TEMPERATURE,
            compute_entropy=grad,
            fused=args.fused_kernels,
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
    args.clock = resolve_clock(args.clock, info.device)
    attn = models.resolve_attn_implementation("auto", info.device, sequence_parallel=True)
    nets = build_models(args, info, attn)
    for name, net in nets.items():
        ulysses.check_heads(net.config, args.sp, f"--sp ({name})")
    vocab = nets["actor"].config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    prompt_len = min(args.prompt_len, args.seq_len - 1)

    def sequence(length: int) -> Any:
        tokens = torch.randint(3, vocab, (length,), generator=gen).to(info.device)
        response = tokens[None, prompt_len:]
        return pack([tokens[:prompt_len]], response, torch.ones_like(response, dtype=torch.bool))

    packed, warm = sequence(args.seq_len), sequence(min(args.seq_len, 4 * prompt_len))
    rows: list[SPRow] = []
    outputs: dict[tuple[int, str], torch.Tensor] = {}
    for sp_size in (1, args.sp):
        sp = ulysses.make_sp_groups(sp_size)
        for phase in ("actor", "critic", "ref"):
            sp_phase(phase, nets, warm, sp, args)  # lazy initialization, allocator warm-up
            for net in nets.values():
                net.zero_grad(set_to_none=True)
            gc.collect()
            barrier()

            def tracked(phase: str = phase, sp: Any = sp) -> None:
                outputs[sp.size, phase] = sp_phase(phase, nets, packed, sp, args)

            peak = cuda_peak_bytes(tracked) if info.device.type == "cuda" else cpu_peak_bytes(tracked)
            for net in nets.values():
                net.zero_grad(set_to_none=True)
            time_s, _ = timed(functools.partial(sp_phase, phase, nets, packed, sp, args), info, args.clock)
            for net in nets.values():
                net.zero_grad(set_to_none=True)
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


# ----------------------------------------------------------------------------------------------------
# --mode overhead: issue 12's configuration through train_ppo, and TRL's PPOTrainer beside it
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class OverheadRow:
    """One trainer's per-step time on issue 12's configuration."""

    trainer: str
    """``ours`` (train_ppo), ``trl`` (PPOTrainer as shipped), ``trl_gc_frozen`` (gc.freeze() first)."""
    steps: int
    """Steps counted (all rounds; the first two of each run are not)."""
    step_cpu_s: float
    """Median CPU seconds per step (one step's end to the next's)."""
    step_cpu_min_s: float
    step_cpu_max_s: float
    step_wall_s: float
    """Median wall seconds per step (on a shared machine, mostly the scheduler)."""
    gen_s: float | None = None
    """Phases of our step (median wall seconds, ``metrics.jsonl``'s ``timing_s/*``)."""
    old_log_prob_s: float | None = None
    ref_s: float | None = None
    values_s: float | None = None
    reward_s: float | None = None
    adv_s: float | None = None
    update_critic_s: float | None = None
    update_actor_s: float | None = None
    vs_trl: float | None = None
    """trl_gc_frozen's step_cpu_s / this row's (the issue's target for ours: >= 1.5)."""


OUR_PHASES = ("gen", "old_log_prob", "ref", "values", "reward", "adv", "update_critic", "update_actor")
TRL_REFERENCE_S = 0.21
"""Issue 12's TRL 1.12 step with its gc.collect frozen out (on the issue's machine)."""
STEP_LINE = re.compile(r"\bstep (\d+)/(\d+)\b")
"""The trainer's per-step console line (``MetricsLogger``'s progress prefix)."""


def write_overhead_assets(folder: Path, args: argparse.Namespace) -> dict[str, Path]:
    """Policy (also the critic's backbone), reward model and prompt Parquet of issue 12's shapes."""
    import make_tiny_assets
    import pyarrow as pa
    import pyarrow.parquet as pq

    tokenizer = make_tiny_assets.build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    paths = {"policy": folder / "policy", "reward": folder / "reward", "prompts": folder / "prompts.parquet"}
    torch.manual_seed(args.seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(paths["policy"])
    tokenizer.save_pretrained(paths["policy"])
    torch.manual_seed(args.seed + 1)
    config.num_labels = 1
    AutoModelForSequenceClassification.from_config(config).save_pretrained(paths["reward"])
    tokenizer.save_pretrained(paths["reward"])
    problems, _ = make_tiny_assets.split_problems(args.seed)
    rows = make_tiny_assets.prompt_rows(problems[: args.num_prompts * (args.steps + 1)], "train")
    pq.write_table(pa.Table.from_pylist(rows), paths["prompts"])
    return paths


class StepClock(logging.Handler):
    """Records the CPU and wall clocks at each of the trainer's step lines (logging's public API)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.marks: list[tuple[int, float, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        match = STEP_LINE.search(record.getMessage())
        if match:
            self.marks.append((int(match.group(1)), time.process_time(), time.perf_counter()))

    def step_times(self, skip: int = 2) -> tuple[list[float], list[float]]:
        """(CPU, wall) seconds of each step after the first ``skip``."""
        pairs = zip(self.marks, self.marks[1:], strict=False)
        kept = [(b[1] - a[1], b[2] - a[2]) for a, b in pairs if b[0] > skip]
        return [c for c, _ in kept], [w for _, w in kept]


def ppo_overrides(args: argparse.Namespace, paths: dict[str, Path], out_dir: Path) -> list[str]:
    """train_ppo's command line for issue 12's configuration."""
    return [
        f"model.path={paths['policy']}",
        f"data.train_files=[{paths['prompts']}]",
        "data.val_files=[]",
        "data.max_prompt_length=32",
        f"data.max_response_length={args.response_len}",
        f"data.train_batch_size={args.num_prompts}",
        "rollout.n=1",
        "rollout.ignore_eos=true",  # every response response_len tokens, as TRL without a stop token
        f"actor.ppo_mini_batch_size={args.num_prompts // NUM_MINI_BATCHES}",
        f"actor.ppo_epochs={args.epochs}",
        "actor.optim.lr=1e-6",
        "critic.optim.lr=1e-6",
        "reward.style=model",
        f"reward.model_path={paths['reward']}",
        "algorithm.adv_estimator=gae",
        "algorithm.use_kl_in_reward=true",
        f"trainer.total_training_steps={args.steps}",
        "trainer.logger=[console,jsonl]",
        "trainer.val_before_train=false",
        "trainer.resume_mode=disable",
        "trainer.save_freq=-1",
        f"trainer.seed={args.seed}",
        f"trainer.output_dir={out_dir}",
    ]


def run_ours(
    args: argparse.Namespace, paths: dict[str, Path], out_dir: Path
) -> tuple[list[float], list[float], dict[str, list[float]]]:
    """``train_ppo.main`` for ``--steps`` steps: per-step CPU and wall seconds, and the phase timings."""
    import train_ppo

    clock = StepClock()
    log = logging.getLogger("ppo")
    log.addHandler(clock)
    try:
        code = train_ppo.main(ppo_overrides(args, paths, out_dir))
    finally:
        log.removeHandler(clock)
    if code != 0:
        raise RuntimeError(f"train_ppo exited with {code}")
    lines = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    phases = {
        p: [r[f"timing_s/{p}"] for r in lines if r["step"] > 2 and f"timing_s/{p}" in r] for p in OUR_PHASES
    }
    cpu, wall = clock.step_times()
    return cpu, wall, phases


def import_trl(args: argparse.Namespace) -> tuple[Any, str | None]:
    """TRL's ``experimental.ppo`` module, or None and why not."""
    if args.trl == "no":
        return None, "--trl no"
    if args.trl_path:
        sys.path.insert(0, args.trl_path)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    try:
        import trl
        import trl.experimental.ppo as trl_ppo
    except Exception as err:  # not installed, or a version that does not import beside ours
        if args.trl == "yes":
            raise
        return None, f"{type(err).__name__}: {err}"
    return trl_ppo, trl.__version__


def run_trl(
    trl_ppo: Any, args: argparse.Namespace, paths: dict[str, Path], out_dir: Path, *, freeze_gc: bool
) -> tuple[list[float], list[float]]:
    """TRL's PPOTrainer on the same models, prompts and shapes; per-step CPU and wall seconds.

    Same work as ours: ``per_device_train_batch_size`` = all prompts, ``num_mini_batches=2`` (one
    micro-batch each), ``num_ppo_epochs``, no stop token (every response ``response_len`` tokens), GAE
    with the k1 KL in the reward; its critic is a copy of the policy's backbone with a score head.
    """
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    from ppo import data

    tokenizer = AutoTokenizer.from_pretrained(paths["policy"])
    tokenizer.padding_side = "left"
    records = data.load_prompts(paths["prompts"], tokenizer, max_prompt_length=32, require_ground_truth=False)
    dataset = Dataset.from_dict({"input_ids": [r.input_ids for r in records]})
    marks: list[tuple[float, float]] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_: Any, **__: Any) -> None:
            marks.append((time.process_time(), time.perf_counter()))

    config = trl_ppo.PPOConfig(
        output_dir=str(out_dir),
        per_device_train_batch_size=args.num_prompts,
        gradient_accumulation_steps=1,
        num_mini_batches=NUM_MINI_BATCHES,
        num_ppo_epochs=args.epochs,
        response_length=args.response_len,
        total_episodes=args.num_prompts * args.steps,
        stop_token=None,
        local_rollout_forward_batch_size=args.num_prompts,
        num_sample_generations=0,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        learning_rate=1e-6,
        seed=args.seed,
        disable_tqdm=True,
    )
    with contextlib.redirect_stdout(sys.stderr):  # TRL prints every step's metrics
        trainer = trl_ppo.PPOTrainer(
            args=config,
            processing_class=tokenizer,
            model=AutoModelForCausalLM.from_pretrained(paths["policy"]),
            ref_model=AutoModelForCausalLM.from_pretrained(paths["policy"]),
            reward_model=AutoModelForSequenceClassification.from_pretrained(paths["reward"], num_labels=1),
            value_model=AutoModelForSequenceClassification.from_pretrained(paths["policy"], num_labels=1),
            train_dataset=dataset,
            callbacks=[Clock()],
        )
        if freeze_gc:
            gc.collect()
            gc.freeze()  # what exists now is never scanned again: TRL's per-step gc.collect() is cheap
        try:
            trainer.train()
        finally:
            if freeze_gc:
                gc.unfreeze()
    kept = list(zip(marks, marks[1:], strict=False))[1:]  # the first two steps are not counted
    return [b[0] - a[0] for a, b in kept], [b[1] - a[1] for a, b in kept]


def run_overhead(args: argparse.Namespace) -> tuple[list[OverheadRow], str | None]:
    """Ours, then TRL as shipped and with gc frozen, ``--rounds`` times; rows and TRL's version (or
    why it did not run). ``train_ppo.main`` joins and leaves the process group itself."""
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise SystemExit(
            "--mode overhead runs one process (issue 12's measurement); start it without torchrun"
        )
    trl_ppo, trl_note = import_trl(args)
    cpu: dict[str, list[float]] = {}
    wall: dict[str, list[float]] = {}
    phases: dict[str, list[float]] = {p: [] for p in OUR_PHASES}
    with tempfile.TemporaryDirectory(prefix="bench_step_") as tmp:
        folder = Path(tmp)
        paths = write_overhead_assets(folder, args)
        for r in range(args.rounds):
            c, w, ph = run_ours(args, paths, folder / f"ours_{r}")
            cpu.setdefault("ours", []).extend(c)
            wall.setdefault("ours", []).extend(w)
            for p in OUR_PHASES:
                phases[p].extend(ph[p])
            if trl_ppo is None:
                continue
            for name, freeze in (("trl", False), ("trl_gc_frozen", True)):
                c, w = run_trl(trl_ppo, args, paths, folder / f"{name}_{r}", freeze_gc=freeze)
                cpu.setdefault(name, []).extend(c)
                wall.setdefault(name, []).extend(w)
    rows = []
    for name in cpu:
        row = OverheadRow(
            trainer=name,
            steps=len(cpu[name]),
            step_cpu_s=statistics.median(cpu[name]),
            step_cpu_min_s=min(cpu[name]),
            step_cpu_max_s=max(cpu[name]),
            step_wall_s=statistics.median(wall[name]),
        )
        if name == "ours":
            for p in OUR_PHASES:
                setattr(row, f"{p}_s", statistics.median(phases[p]) if phases[p] else None)
        rows.append(row)
    trl = next((r for r in rows if r.trainer == "trl_gc_frozen"), None)
    for row in rows:
        row.vs_trl = trl.step_cpu_s / row.step_cpu_s if trl is not None else None
    return rows, trl_note


# ----------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", default="layout", choices=["layout", "overhead", "sp"])
    layout = parser.add_argument_group("--mode layout")
    layout.add_argument("--model-config", default="tiny", help="tiny or 0.5b (random weights)")
    layout.add_argument("--model-path", default=None, help="a save_pretrained folder instead")
    layout.add_argument("--num-seqs", type=int, default=32, help="sequences per rank")
    layout.add_argument("--prompt-len", type=int, default=48, help="longest prompt (shortest: half)")
    layout.add_argument("--min-response", type=int, default=8, help="shortest response")
    layout.add_argument("--max-response", type=int, default=160, help="longest response (generated length)")
    layout.add_argument("--micro-batch", type=int, default=8, help="sequences per forward (fixed paths)")
    layout.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    layout.add_argument("--repeat", type=int, default=3, help="timed steps per path (medians)")
    layout.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    overhead = parser.add_argument_group("--mode overhead (issue 12's configuration)")
    overhead.add_argument("--num-prompts", type=int, default=16, help="prompts per step")
    overhead.add_argument("--response-len", type=int, default=32, help="tokens per response")
    overhead.add_argument("--layers", type=int, default=2, help="decoder layers of the Llama")
    overhead.add_argument("--hidden", type=int, default=128, help="hidden size (MLP: 4x)")
    overhead.add_argument("--epochs", type=int, default=2, help="PPO epochs over the 2 mini-batches")
    overhead.add_argument("--steps", type=int, default=10, help="steps per run (the first two not counted)")
    overhead.add_argument("--rounds", type=int, default=2, help="alternating runs of each trainer")
    overhead.add_argument("--trl", default="auto", choices=["auto", "yes", "no"], help="run TRL beside ours")
    overhead.add_argument("--trl-path", default=None, help="a folder holding TRL (pip install --target)")
    sp = parser.add_argument_group("--mode sp (implied by --sp): memory of one long sequence")
    sp.add_argument("--sp", type=int, default=None, help="sequence-parallel size to compare with 1")
    sp.add_argument("--seq-len", type=int, default=16384, help="tokens of the sequence")
    sp.add_argument("--fused-kernels", action="store_true", help="log-probs without [T, vocab] logits")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--clock", default="auto", choices=["auto", "wall", "cpu"])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank (0: default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="one JSON object per row instead of a table")
    args = parser.parse_args(argv)
    if args.sp is not None:
        args.mode = "sp"
    elif args.mode == "sp":
        args.sp = 2
    if args.mode == "sp" and (args.sp < 1 or args.seq_len < 2):
        parser.error("need --sp >= 1 and --seq-len >= 2")
    if args.num_seqs % (2 * NUM_MINI_BATCHES) or args.num_seqs < 2 * NUM_MINI_BATCHES:
        parser.error(f"--num-seqs must be a positive multiple of {2 * NUM_MINI_BATCHES}")
    if not 1 <= args.min_response <= args.max_response:
        parser.error("need 1 <= --min-response <= --max-response")
    if args.num_prompts % NUM_MINI_BATCHES or args.steps < 3 or args.repeat < 1 or args.rounds < 1:
        parser.error(
            f"need --num-prompts a multiple of {NUM_MINI_BATCHES}, --steps >= 3, --repeat/--rounds >= 1"
        )
    return args


def print_rows(rows: list[Any], as_json: bool) -> None:
    dicts = [dataclasses.asdict(r) for r in rows]
    if as_json:
        for d in dicts:
            print(json.dumps(d))
    else:
        print_table(dicts, [f.name for f in dataclasses.fields(type(rows[0]))])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    if args.mode == "overhead":
        rows, trl_note = run_overhead(args)
        print_rows(rows, args.json)
        if not args.json:
            ours = rows[0]
            trl = next((r for r in rows if r.trainer == "trl_gc_frozen"), None)
            if trl is not None:
                print(
                    f"ours {ours.step_cpu_s:.3f} s/step (CPU), TRL {trl_note} with gc frozen {trl.step_cpu_s:.3f} s: "
                    f"{ours.vs_trl:.2f}x ({'meets' if ours.vs_trl >= 1.5 else 'misses'} the 1.5x target)"
                )
            else:
                print(
                    f"TRL did not run ({trl_note}); ours {ours.step_cpu_s:.3f} s/step (CPU) against the issue's "
                    f"{TRL_REFERENCE_S} s for TRL (its machine): target <= {TRL_REFERENCE_S / 1.5:.2f} s"
                )
        return 0
    info = init_distributed(args.device, timeout_s=600)
    try:
        rows = run_sp(args, info) if args.mode == "sp" else run_layouts(args, info)
    finally:
        destroy_distributed()
    if info.is_main and args.mode == "sp":
        print_rows(rows, args.json)
        if not args.json:
            for r in rows:
                if r.sp > 1:
                    print(
                        f"{r.phase}: SP={r.sp} peaks at {r.vs_sp1:.2f}x SP=1's memory per rank "
                        f"({r.peak_mib:.0f} vs {r.peak_mib / r.vs_sp1:.0f} MiB) on {r.seq_len} tokens"
                    )
        return 0
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
    sys.exit(main())
