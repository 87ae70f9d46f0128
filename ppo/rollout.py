"""Rollout: sample responses with Hugging Face ``generate`` and its KV cache.

The actor's sharded parameters are gathered once for the whole rollout and released after it
(``sharding.gathered_for_generation``), so decoding makes no collective calls; ranks whose responses end
at different lengths therefore never wait on each other. Prompts are left-padded per generation
micro-batch; responses come back right-padded ``[B, R]`` with ``R = max_new_tokens`` and a mask that is
True up to and including the first EOS (any of the EOS ids).

Each prompt is prefilled once per generation micro-batch (``ppo.prefill``): with ``rollout.n = G`` its G
copies share one prefill whose KV cache is copied to their rows, and a multi-turn rollout keeps each
row's cache from turn to turn, so a turn prefills only the tokens its row gained (the observation, the
template's tokens). ``share_prefill=False`` / ``keep_cache=False`` prefill every row's whole prompt, as
before; the compiled engine always does.

The sampler is exactly the one PPO's log-probs assume: ``generation_config`` builds every setting
explicitly from the rollout's own (temperature, top-p, top-k, lengths, EOS ids), and ``generate`` hides
the checkpoint's ``generation_config.json`` while it runs, so a repetition penalty, n-gram block, min-p
or bad-words list shipped with a model cannot change the distribution that old and reference
log-probs, the ratio and the KL are computed for.

    config = generation_config(max_new_tokens=512, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                               eos_token_ids=[151645, 151643], pad_token_id=151643)
    rollout = generate(actor, prompts, config, micro_batch_size=64)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForCausalLM, CompileConfig, GenerationConfig

from ppo import lora, models, prefill, sharding, ulysses
from ppo.batch import Batch, Rollout, group_index
from ppo.config import RolloutConfig
from ppo.data import PromptRecord
from ppo.multi_turn import MultiTurn, run_turns
from ppo.prefill import left_pad


def generation_config(
    *,
    max_new_tokens: int,
    do_sample: bool,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    eos_token_ids: list[int],
    pad_token_id: int,
    ignore_eos: bool = False,
    compile: bool = False,
) -> GenerationConfig:
    """The whole sampler configuration: softmax(logits / temperature), then top-k (0: off) and top-p
    (1: off) when sampling; argmax otherwise. Nothing else: transformers' defaults for every other
    field are neutral (no repetition penalty, no n-gram blocking, no min-p, typical-p or epsilon
    cutoffs, no forced or suppressed tokens), and the model's own generation config is not consulted
    (see ``generate``). ``ignore_eos`` forces exactly ``max_new_tokens`` tokens (benchmarks);
    ``compile`` decodes with a static KV cache and a compiled step (use it with ``generate(engine=...)``).
    """
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens if ignore_eos else None,
        do_sample=do_sample,
        num_beams=1,
        eos_token_id=list(eos_token_ids),
        pad_token_id=pad_token_id,
        use_cache=True,
    )
    if do_sample:
        config.temperature = temperature
        config.top_p = top_p
        config.top_k = top_k  # 0 disables top-k (transformers' own default would be 50)
    else:
        config.top_k = None
    if compile:  # a static KV cache whose decoding step transformers compiles (CUDA graphs on GPU)
        config.cache_implementation = "static"
        config.compile_config = CompileConfig(fullgraph=False, dynamic=False)
        config.compile_config._compile_all_devices = True  # also where transformers would not (CPU tests)
    return config


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: list[torch.Tensor],
    config: GenerationConfig,
    *,
    micro_batch_size: int = 64,
    ignore_eos: bool = False,
    engine: torch.nn.Module | None = None,
    share_prefill: bool = True,
) -> Rollout:
    """Sample one response per prompt (repeat prompts for ``n`` samples) in generation micro-batches.

    Every rank must call it, also with no prompts: gathering the shards is a collective. Sampling draws
    from torch's global RNG (seeded per rank by the trainer, restored by checkpoints).

    ``engine`` (``make_engine``): decode with this persistent unsharded copy of ``model`` instead, its
    weights refreshed in place from ``model``'s gathered ones first; with a static-cache ``config``
    (``generation_config(compile=True)``) its decoding step is compiled once and replayed (CUDA graphs),
    on micro-batches padded to fixed shapes (``micro_batch_size`` rows, prompts to a multiple of
    ``PROMPT_BUCKET``) so that it does not recompile from step to step.

    ``share_prefill``: identical prompts of a micro-batch are prefilled once (``decode``).
    """
    with generating(model, engine) as decoder:
        responses = decode(
            decoder,
            prompts,
            config,
            micro_batch_size=micro_batch_size,
            fixed_shapes=engine is not None,
            share_prefill=share_prefill,
        )
    response_mask, truncated = attention_mask_from_eos(
        responses, list(config.eos_token_id), ignore_eos=ignore_eos
    )
    responses = torch.where(response_mask, responses, torch.full_like(responses, config.pad_token_id))
    return Rollout(
        prompts=list(prompts), responses=responses, attention_mask=response_mask, truncated=truncated
    )


@contextlib.contextmanager
def generating(model: torch.nn.Module, engine: torch.nn.Module | None = None) -> Iterator[torch.nn.Module]:
    """The model to decode with, ready for any number of ``decode`` calls: ``model`` in eval mode with its
    sharded parameters gathered once and LoRA adapters merged (or ``engine`` refreshed from them), and
    without the checkpoint's generation config. A collective on entry and exit: every rank enters it."""
    decoder = engine if engine is not None else model
    with contextlib.ExitStack() as stack:
        stack.enter_context(models.evaluating(model))
        if engine is not None:
            with sharding.gathered_for_generation(model), lora.merged_for_generation(model):
                refresh_engine(engine, model)
        else:
            stack.enter_context(sharding.gathered_for_generation(model))
            stack.enter_context(lora.merged_for_generation(model))
        stack.enter_context(_checkpoint_generation_config_hidden(decoder))
        yield decoder


@torch.no_grad()
def decode(
    decoder: torch.nn.Module,
    prompts: list[torch.Tensor],
    config: GenerationConfig,
    *,
    micro_batch_size: int,
    fixed_shapes: bool = False,
    tokenizer: Any = None,
    share_prefill: bool = True,
    kept: prefill.KeptCaches | None = None,
) -> torch.Tensor:
    """``[B, max_new_tokens]`` generated tokens of each prompt (right-padded with the pad id; a row may hold
    tokens after its end: ``attention_mask_from_eos`` or the caller cuts them), inside ``generating``.
    ``fixed_shapes``: pad micro-batches to ``micro_batch_size`` rows and prompts to ``PROMPT_BUCKET``
    (the compiled engine). ``tokenizer``: for ``config.stop_strings``.

    ``share_prefill``: each distinct prompt of a micro-batch (by tokens) is prefilled once and its KV cache
    copied to the rows that repeat it (``prefill.generate_with_cache``). Micro-batches are the same
    consecutive slices as without it (so rows, padding and RNG draws are too); a group of identical
    prompts that straddles two micro-batches is prefilled once in each (none does when
    ``micro_batch_size`` is a multiple of ``rollout.n``); a micro-batch without a repeated prompt (and
    without ``kept``) decodes with plain ``generate``. ``kept``: reuse the rows' caches that the
    previous call with the same ``kept`` left (each prompt extending a kept row's input prefills only the
    rest), and keep this call's for the next. Both need ``prefill.reusable(decoder)`` and no
    ``fixed_shapes`` (the compiled engine's static cache); otherwise, and with neither, every row's whole
    prompt is prefilled by plain ``generate`` as before.
    """
    device = next(decoder.parameters()).device
    max_new_tokens = int(config.max_new_tokens)
    reuse = (share_prefill or kept is not None) and not fixed_shapes and prefill.reusable(decoder)
    if reuse and kept is not None:
        kept.start_call()
    chunks = []
    for start in range(0, len(prompts), micro_batch_size):
        batch = prompts[start : start + micro_batch_size]
        rows = len(batch)
        seqs = [p.tolist() for p in batch] if reuse else []
        # Without a kept cache and without a repeated prompt there is nothing to reuse: plain generate.
        if reuse and (kept is not None or len({tuple(q) for q in seqs}) < rows):
            resp, cached = prefill.generate_with_cache(
                decoder,
                seqs,
                config,
                past=kept.match(seqs) if kept is not None else None,
                share=share_prefill,
                keep=kept is not None,
                tokenizer=tokenizer,
            )
            if kept is not None:
                kept.fresh += cached
        else:
            if fixed_shapes:  # one compiled graph for every step
                batch = batch + [batch[-1]] * (micro_batch_size - rows)
            bucket = PROMPT_BUCKET if fixed_shapes else 1
            input_ids, attention_mask = left_pad(batch, config.pad_token_id, device, multiple_of=bucket)
            extra = {"tokenizer": tokenizer} if tokenizer is not None else {}
            out = decoder.generate(
                input_ids=input_ids, attention_mask=attention_mask, generation_config=config, **extra
            )
            resp = out[:rows, input_ids.shape[1] :]
        chunks.append(
            torch.nn.functional.pad(resp, (0, max_new_tokens - resp.shape[1]), value=config.pad_token_id)
        )
    return torch.cat(chunks) if chunks else torch.empty(0, max_new_tokens, dtype=torch.long, device=device)


PROMPT_BUCKET = 64
"""With the compiled rollout, prompts are left-padded to a multiple of this many tokens, so a handful of
static-cache shapes serve every step."""


def make_engine(model: torch.nn.Module, dtype: torch.dtype, device: torch.device | str) -> torch.nn.Module:
    """An empty unsharded copy of ``model``'s architecture in ``dtype`` on ``device``, for
    ``generate(engine=...)``: built on the meta device (no weights materialized on the host), its
    parameters and buffers filled by ``refresh_engine`` before each rollout. Memory: one copy of the
    weights in ``dtype`` per rank (the price of decoding with fixed buffers and CUDA graphs)."""
    with torch.device("meta"):
        engine = AutoModelForCausalLM.from_config(model.config, attn_implementation="sdpa", dtype=dtype)
    engine = engine.to_empty(device=device).eval().requires_grad_(False)
    engine.generation_config = model.generation_config
    return engine


@torch.no_grad()
def refresh_engine(engine: torch.nn.Module, model: torch.nn.Module) -> None:
    """Copy ``model``'s gathered parameters and buffers into ``engine`` in place (same names, cast to the
    engine's dtype), so compiled graphs keep their buffers."""
    mine = dict(engine.named_parameters()) | dict(engine.named_buffers())
    theirs = dict(model.named_parameters()) | dict(model.named_buffers())
    missing = sorted(set(mine) - set(theirs))
    if missing:
        raise RuntimeError(f"the rollout engine has tensors the actor lacks: {missing[:5]}")
    for name, tensor in mine.items():
        tensor.copy_(theirs[name].detach())


@contextlib.contextmanager
def _checkpoint_generation_config_hidden(model: torch.nn.Module) -> Iterator[None]:
    """Give the model a default ``GenerationConfig`` while it generates.

    ``generate(generation_config=c)`` fills every field that ``c`` leaves unset from
    ``model.generation_config``, i.e. from the checkpoint's ``generation_config.json``; with a default
    one in its place only transformers' neutral defaults remain.
    """
    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


def attention_mask_from_eos(
    responses: torch.Tensor, eos_ids: list[int], *, ignore_eos: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, R]`` mask True up to and including the first EOS, and ``[B]`` "no EOS" flags.

    A response without an EOS keeps all ``R`` tokens and is flagged truncated (it never ended).
    """
    if ignore_eos:
        full = torch.ones_like(responses, dtype=torch.bool)
        return full, torch.ones(responses.shape[0], dtype=torch.bool, device=responses.device)
    is_eos = torch.isin(responses, torch.tensor(eos_ids, device=responses.device))
    # Number of EOS tokens strictly before position j; position j is valid while none came before.
    eos_before = torch.cumsum(is_eos.long(), dim=-1) - is_eos.long()
    mask = eos_before == 0
    return mask, ~is_eos.any(dim=-1)


# ----------------------------------------------------------------------------------------------------
# The trainer's sampler
# ----------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class Sampler:
    """What a run samples with: the actor (and its compiled decoding copy), the rollout settings and
    the ids that end and pad a response."""

    actor: torch.nn.Module
    engine: torch.nn.Module | None
    """The compiled rollout's decoding copy of the actor (``rollout.compile``, ``make_engine``), or None."""
    settings: RolloutConfig
    max_response_length: int
    eos_ids: list[int]
    """Every token id that ends a response (tokenizer and generation config)."""
    pad_token_id: int
    multi_turn: MultiTurn | None = None
    """The turn loop's settings (``rollout.multi_turn.enable``), or None: one generation per response."""


def sample(
    sampler: Sampler,
    records: list[PromptRecord],
    *,
    do_sample: bool,
    micro_batch_size: int | None = None,
    ignore_eos: bool | None = None,
    share_prefill: bool | None = None,
    keep_cache: bool | None = None,
) -> Rollout:
    """One response per record with the rollout settings (temperature, top-p/k, lengths, EOS ids); with
    ``sampler.multi_turn`` each response is a multi-turn trajectory (``ppo.multi_turn.run_turns``), decoded in
    one ``generating`` session.

    ``share_prefill``: identical prompts of a micro-batch share one prefill (``decode``). ``keep_cache``
    (multi-turn): each row's KV cache is kept from turn to turn, so a turn prefills only the tokens its row
    gained since (``prefill.KeptCaches``; memory: every active row's cache at once); False re-prefills the
    whole trajectory every turn. Both default to ``rollout.reuse_prompt_cache``. Neither applies to the
    compiled engine (``rollout.compile``)."""
    r = sampler.settings
    share_prefill = r.reuse_prompt_cache if share_prefill is None else share_prefill
    keep_cache = r.reuse_prompt_cache if keep_cache is None else keep_cache
    ignore_eos = r.ignore_eos if ignore_eos is None else ignore_eos
    config = generation_config(
        max_new_tokens=sampler.max_response_length,
        do_sample=do_sample,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        eos_token_ids=sampler.eos_ids,
        pad_token_id=sampler.pad_token_id,
        ignore_eos=ignore_eos,
        compile=sampler.engine is not None,
    )
    if sampler.multi_turn is not None:
        settings = sampler.multi_turn
        kept = prefill.KeptCaches() if keep_cache else None
        with generating(sampler.actor, sampler.engine) as decoder:

            def generate_turn(prompts: list[torch.Tensor], turn_config: GenerationConfig) -> torch.Tensor:
                return decode(
                    decoder,
                    prompts,
                    turn_config,
                    micro_batch_size=micro_batch_size or r.micro_batch_size_per_gpu,
                    fixed_shapes=sampler.engine is not None,
                    tokenizer=settings.tokenizer if settings.stop else None,
                    share_prefill=share_prefill,
                    kept=kept,
                )

            device = next(sampler.actor.parameters()).device
            return run_turns(generate_turn, records, config, settings, device)
    return generate(
        sampler.actor,
        [torch.tensor(r.input_ids, dtype=torch.long) for r in records],
        config,
        micro_batch_size=micro_batch_size or r.micro_batch_size_per_gpu,
        ignore_eos=ignore_eos,
        engine=sampler.engine,
        share_prefill=share_prefill,
    )


def gather_group(batch: Batch, sp: ulysses.SPGroup, pad_token_id: int, n: int) -> Batch:
    """The batches of every rank of a sequence-parallel group, in group order: the group scores and
    trains them together, each rank on its slice of every micro-batch's tokens."""
    rollout = batch.rollout
    parts = ulysses.all_gather_object(([p.tolist() for p in rollout.prompts], batch.records), sp)
    device = rollout.responses.device
    gathered = Rollout(
        prompts=[torch.tensor(p, dtype=torch.long) for part in parts for p in part[0]],
        responses=ulysses.all_gather_rows(rollout.responses, sp, pad_token_id),
        attention_mask=ulysses.all_gather_rows(rollout.attention_mask, sp, False),
        truncated=ulysses.all_gather_rows(rollout.truncated.to(device), sp, False),
    )
    if rollout.env_rewards is not None:  # a multi-turn rollout (else every token that exists is trained)
        gathered.response_mask = ulysses.all_gather_rows(rollout.response_mask, sp, False)
        gathered.env_rewards = ulysses.all_gather_rows(rollout.env_rewards, sp, 0.0)
        gathered.turn_stats = {k: ulysses.all_gather_rows(v, sp) for k, v in rollout.turn_stats.items()}
    records = [r for part in parts for r in part[1]]
    out = Batch(rollout=gathered, records=records, group_ids=group_index(len(records), n, device))
    if batch.data_ranks is not None:
        out.data_ranks = ulysses.all_gather_rows(batch.data_ranks, sp)
        out.data_scores = ulysses.all_gather_rows(batch.data_scores, sp)
    if batch.data_logprobs is not None:
        out.data_logprobs = ulysses.all_gather_rows(batch.data_logprobs, sp)
    return out
