"""Run and save the models of PPO: the packed (padding-free) forwards of actor, reference, critic and
reward model, the LM head for the fused log-prob kernels, training mode and ``save_pretrained``.

- Packed forwards: the tokens of ``B`` sequences concatenated into one row ``[total_tokens]`` with
  ``position_ids`` restarting at 0 per sequence and ``cu_seqlens [B+1]`` marking the boundaries. No
  attention mask and ``use_cache=False`` (with the cache on, the packing is silently ignored); the
  attention kernel for such rows lives in ``ppo.attention``, the FSDP2 sharding in ``ppo.sharding``.
- Saving: ``save_hf`` writes a ``save_pretrained`` folder from a sharded or plain model (``save_model``:
  the stages' final model, logged).

The models come from ``ppo.model_loading`` (``load_causal_lm``, ``load_critic``, ``load_reward_model``).

Every helper runs the model's own top-level ``forward`` (never ``model.model(...)``): FSDP2 gathers the
root's parameters (embeddings, final norm, head) in the root's forward pre-hook, so calling a
submodule of a sharded root would compute with the root's *shards*. Intermediate results (the final
hidden states, the per-token reward scores) are read with forward hooks instead.

Usage::

    model = load_causal_lm(cfg.model.path, dtype=cfg.model.dtype, device="cpu")  # ppo.model_loading
    model = sharding.shard_model(model, make_mesh(info, fsdp.fsdp_size), fsdp, device=info.device)
    logits = causal_lm_logits(model, input_ids, position_ids)  # [total_tokens, vocab]
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ppo.attention import SHARED_PREFIX, SharedPrefix, packed_kwargs
from ppo.distributed import DistInfo
from ppo.model_loading import score_head
from ppo.sharding import full_state_dict

logger = logging.getLogger("ppo")

# ----------------------------------------------------------------------------------------------------
# Packed (padding-free) forwards
# ----------------------------------------------------------------------------------------------------


Layout = list[int] | SharedPrefix | None
"""Where a packed row's sequences are, for its attention layers: the offsets ``[0, ..., T]`` of plain
packed sequences, a shared-prefix row's ``SharedPrefix``, or None (the layers find the sequences from
the position ids)."""


def _packed_inputs(input_ids: torch.Tensor, position_ids: torch.Tensor, offsets: Layout) -> dict[str, Any]:
    if input_ids.dim() != 1 or input_ids.shape != position_ids.shape:
        raise ValueError(
            f"packed input_ids and position_ids must both be [total_tokens]; got {tuple(input_ids.shape)} "
            f"and {tuple(position_ids.shape)}"
        )
    # No attention mask and no cache: with position ids restarting at 0 per sequence, transformers
    # attends block-diagonally (the ppo.attention kernels: per sequence); a cache would make it ignore
    # the packing (silently). ``offsets`` (host list) spare each layer finding the boundaries itself.
    inputs = {"input_ids": input_ids[None], "position_ids": position_ids[None], "use_cache": False}
    if isinstance(offsets, SharedPrefix):
        inputs[SHARED_PREFIX] = offsets
    elif offsets is not None:
        inputs.update(packed_kwargs(offsets, input_ids.device))
    return inputs


def causal_lm_logits(
    model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, offsets: Layout = None
) -> torch.Tensor:
    """Next-token logits of packed sequences: ``[total_tokens] -> [total_tokens, vocab]``.

    In the compute dtype (bf16 under bf16 mixed precision); upcast where it matters.
    """
    return model(**_packed_inputs(input_ids, position_ids, offsets)).logits[0]


def causal_lm_hidden(
    model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, offsets: Layout = None
) -> torch.Tensor:
    """Final (normed) hidden states of packed sequences: ``[total_tokens] -> [total_tokens, hidden]``.

    For the fused LM-head log-prob kernels, with ``lm_head_weight(model)``: the ``[tokens, vocab]``
    logits are never built. Runs the model's own forward (so FSDP2's root hooks gather and later
    reduce the root's parameters) with ``logits_to_keep=1``, and reads the backbone's output with a
    forward hook.
    """
    backbone = model.base_model
    # The head then runs on one token only; a model without logits_to_keep builds full logits.
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    captured: list[torch.Tensor] = []

    def grab(_module: nn.Module, _args: Any, output: Any) -> None:
        captured.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

    handle = backbone.register_forward_hook(grab)
    try:
        model(**_packed_inputs(input_ids, position_ids, offsets), **keep)
    finally:
        handle.remove()
    if len(captured) != 1:
        raise RuntimeError(f"expected one backbone output from {type(model).__name__}, got {len(captured)}")
    return captured[0][0]


def check_fused_lm_head(model: PreTrainedModel) -> None:
    """Fail unless the logits are exactly ``hidden @ lm_head.weight^T``, which the fused LM-head
    kernels compute: no logit soft-capping (Gemma 2), no logit scaling (Cohere, Granite), no LM-head
    bias."""
    config = model.config.get_text_config()
    reasons = []
    for key in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        value = getattr(config, key, None)
        if value not in (None, 1.0, 1):
            reasons.append(f"{key}={value}")
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        reasons.append("an LM-head bias")
    if reasons:
        raise ValueError(
            f"actor.use_fused_kernels=true computes logits as hidden @ lm_head.weight, but "
            f"{type(model).__name__} has {', '.join(reasons)}: set actor.use_fused_kernels=false"
        )


def lm_head_weight(model: nn.Module) -> torch.Tensor:
    """The LM head's weight ``[vocab, hidden]`` as the forward used it (gathered, compute dtype).

    Call it after ``causal_lm_hidden`` in the same step: ``shard_model`` keeps the root FSDP group
    (embeddings, final norm, head) gathered from the forward until the backward, and the gradient that
    flows into this tensor is reduce-scattered with the root's others at the end of the backward.
    """
    weight = model.get_output_embeddings().weight
    if isinstance(weight, DTensor):
        raise RuntimeError(
            "the LM head weight is still sharded: call lm_head_weight(model) after a forward of the "
            "sharded model (causal_lm_hidden) and before its backward"
        )
    return weight


def critic_values(
    critic: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, offsets: Layout = None
) -> torch.Tensor:
    """Token values of packed sequences: ``[total_tokens] -> [total_tokens]`` fp32.

    ``values[t]`` is the critic's estimate at token ``t`` (the state after reading tokens ``<= t``).
    """
    return critic(**_packed_inputs(input_ids, position_ids, offsets)).logits[0, :, 0].float()


def reward_scores(
    reward_model: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    offsets: list[int] | None = None,
) -> torch.Tensor:
    """One score per packed sequence, read at its last token: ``[total_tokens] -> [B]`` fp32.

    ``cu_seqlens [B+1]``: sequence ``i`` is tokens ``cu_seqlens[i]:cu_seqlens[i+1]`` (``offsets``: the
    same on the host, passed to the attention layers when given). The per-token
    scores are taken from the ``score`` head with a forward hook, so HF's pooling (which searches for
    the last non-pad token of each row) plays no part.
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or int(cu_seqlens[-1]) != input_ids.numel():
        raise ValueError(
            f"cu_seqlens must be [B+1] from 0 to total_tokens={input_ids.numel()}; got {cu_seqlens.tolist()}"
        )
    if bool((cu_seqlens[1:] <= cu_seqlens[:-1]).any()):
        raise ValueError(
            f"cu_seqlens must be strictly increasing (no empty sequence); got {cu_seqlens.tolist()}"
        )
    captured: list[torch.Tensor] = []

    def grab(_module: nn.Module, _args: Any, output: torch.Tensor) -> None:
        captured.append(output)

    handle = score_head(reward_model).register_forward_hook(grab)
    try:
        reward_model(**_packed_inputs(input_ids, position_ids, offsets))
    finally:
        handle.remove()
    token_scores = captured[0][0, :, 0]  # [total_tokens]
    last = (cu_seqlens[1:] - 1).to(device=token_scores.device, dtype=torch.long)
    return token_scores[last].float()


# ----------------------------------------------------------------------------------------------------
# Training mode, saving
# ----------------------------------------------------------------------------------------------------


def enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each decoder layer's activations in the backward (non-reentrant checkpointing).

    Uses ``activation_checkpointing_enable`` where transformers has it (5.x deprecates the old name
    with a FutureWarning), else ``gradient_checkpointing_enable``. Works before or after sharding.
    """
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def save_hf(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase | None,
    out_dir: str | os.PathLike[str],
    *,
    is_main: bool,
) -> None:
    """Write ``save_pretrained`` folder (config, safetensors, tokenizer) from a sharded or plain model.

    Collective: every rank calls it (the parameters are gathered); only ``is_main`` writes. Works for
    the actor, critic and reward model alike; ``from_pretrained`` of the folder gives the same model.
    """
    state_dict = full_state_dict(model)
    if is_main:
        if state_dict is None:
            raise RuntimeError("save_hf: is_main must be rank 0, which receives the gathered state dict")
        os.makedirs(out_dir, exist_ok=True)
        model.save_pretrained(out_dir, state_dict=state_dict)
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
    if dist.is_initialized():
        dist.barrier()  # the folder is complete on every rank's return


def save_model(model: nn.Module, tokenizer: PreTrainedTokenizerBase, path: Path, info: DistInfo) -> Path:
    """Write the ``save_pretrained`` folder (weights, config, tokenizer) at ``path``; every rank calls it."""
    save_hf(model, tokenizer, str(path), is_main=info.is_main)
    logger.info("saved %s", path)
    return path


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameters (full sizes, also when sharded; tied weights counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode inside (dropout off, e.g. LoRA's adapter dropout), its mode restored after:
    the no-gradient passes (generation, scoring old and reference log-probs, values) see the
    deterministic policy, so two scorings of the same tokens agree exactly.

    A model already in eval everywhere (the frozen reference, a reward model, a teacher) is left as it is:
    switching walks every submodule twice. A training model is switched by ``nn.Module.train`` (the
    submodules' own ``train`` still run, e.g. peft's DoRA layers'), without transformers'
    ``PreTrainedModel.train`` on top, which re-kernelizes the model (Hugging Face ``kernels``, on by
    default where the package is installed) at every change of mode: a switch and back took 0.9-1.2 ms
    with it and 0.2 ms without on the benchmark's tiny Llama (``docs/cpu_step_profile.md``), and on a GPU
    it would swap inference-only kernels in for the scoring forwards, so that old log-probs came from
    other kernels than the update's. The training-mode kernels run forwards without gradients as well."""
    if not any(m.training for m in model.modules()):
        try:
            yield model
        finally:
            if any(m.training for m in model.modules()):  # the body switched it: back to eval
                model.train(False)
        return
    was_training = model.training
    nn.Module.train(model, False)
    try:
        yield model
    finally:
        nn.Module.train(model, was_training)
