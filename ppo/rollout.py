"""Rollout: sample responses with Hugging Face ``generate`` and its KV cache.

The actor's sharded parameters are gathered once for the whole rollout and released after it
(``models.gathered_for_generation``), so decoding makes no collective calls; ranks whose responses end
at different lengths therefore never wait on each other. Prompts are left-padded per generation
micro-batch; responses come back right-padded ``[B, R]`` with ``R = max_response_length`` and a mask
that is True up to and including the first EOS.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ppo import models


@dataclass(kw_only=True)
class Rollout:
    """This rank's sampled sequences."""

    prompts: list[torch.Tensor]
    """``B`` prompt token tensors ``[P_i]`` (unpadded)."""
    responses: torch.Tensor
    """[B, R] response tokens, padded with the pad id after the end."""
    response_mask: torch.Tensor
    """[B, R] bool: True on generated tokens up to and including the first EOS."""
    truncated: torch.Tensor
    """[B] bool: the response hit ``max_response_length`` without an EOS (clipped)."""


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: list[torch.Tensor],
    *,
    pad_token_id: int,
    eos_token_id: int | list[int],
    max_new_tokens: int,
    do_sample: bool,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    ignore_eos: bool = False,
    micro_batch_size: int = 64,
    generator_seed: int | None = None,
) -> Rollout:
    """Sample one response per prompt (repeat prompts for ``n`` samples) in generation micro-batches.

    ``ignore_eos`` forces exactly ``max_new_tokens`` tokens (equal work for benchmarks). Sampling is
    seeded by ``generator_seed`` when given (pass one that differs per rank and step).
    """
    device = next(model.parameters()).device
    eos_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if generator_seed is not None:
        torch.manual_seed(generator_seed)
    gen_kwargs = dict(
        max_new_tokens=max_new_tokens,
        do_sample=do_sample,
        pad_token_id=pad_token_id,
        eos_token_id=eos_ids,
        use_cache=True,
    )
    if do_sample:
        # top_k=0 disables top-k; HF's own default would be 50.
        gen_kwargs.update(temperature=temperature, top_p=top_p, top_k=top_k or None)
    else:
        gen_kwargs.update(temperature=None, top_p=None, top_k=None)
    if ignore_eos:
        gen_kwargs["min_new_tokens"] = max_new_tokens
    chunks = []
    was_training = model.training
    model.eval()
    with models.gathered_for_generation(model):
        for start in range(0, len(prompts), micro_batch_size):
            batch = prompts[start : start + micro_batch_size]
            input_ids, attention_mask = left_pad(batch, pad_token_id, device)
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, **gen_kwargs)
            resp = out[:, input_ids.shape[1] :]
            chunks.append(
                torch.nn.functional.pad(resp, (0, max_new_tokens - resp.shape[1]), value=pad_token_id)
            )
    model.train(was_training)
    responses = (
        torch.cat(chunks) if chunks else torch.empty(0, max_new_tokens, dtype=torch.long, device=device)
    )
    response_mask, truncated = response_mask_from_eos(responses, eos_ids, ignore_eos=ignore_eos)
    responses = torch.where(response_mask, responses, torch.full_like(responses, pad_token_id))
    return Rollout(
        prompts=list(prompts), responses=responses, response_mask=response_mask, truncated=truncated
    )


def left_pad(
    seqs: list[torch.Tensor], pad_token_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token tensors to ``[B, max_len]`` with the matching attention mask."""
    width = max(s.numel() for s in seqs)
    ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(seqs), width), dtype=torch.long, device=device)
    for i, s in enumerate(seqs):
        ids[i, width - s.numel() :] = s.to(device)
        mask[i, width - s.numel() :] = 1
    return ids, mask


def response_mask_from_eos(
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
