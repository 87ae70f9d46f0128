"""FSDP2 sharding of the models, and gathering the shards for generation and export.

- ``shard_model``: ``fully_shard`` per decoder layer, then the root; gradients summed over ranks.
- ``gathered_for_generation``: all shards gathered once for a whole ``generate`` call, FSDP's
  per-module hooks bypassed meanwhile.
- ``release``: reshard a frozen model's root after its no-grad forwards.
- ``full_state_dict``: the unsharded weights on rank 0 (export).

This module is what breaks when FSDP2 changes: it uses ``fully_shard``'s public API and, in
``_fsdp_forward_hooks_bypassed``, FSDP2's private hook handles (torch 2.10-2.14).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.utils.hooks import RemovableHandle

from ppo.config import FSDPConfig

logger = logging.getLogger("ppo")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config name (``float32``, ``bfloat16``, ``float16``)."""
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


_RESHARD_ATTR = "_ppo_reshard_after_forward"


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The list of transformer blocks: ``model.layers`` (Llama, Qwen2, Mistral), ``transformer.h``
    (GPT-2), ``gpt_neox.layers``, ``model.decoder.layers`` (OPT), ..."""
    base = getattr(model, "base_model", model)
    for owner in (base, getattr(base, "decoder", None)):
        for name in ("layers", "h", "blocks"):
            layers = getattr(owner, name, None) if owner is not None else None
            if isinstance(layers, nn.ModuleList) and len(layers) > 0:
                return layers
    raise ValueError(
        f"cannot find the decoder layers of {type(model).__name__} (looked for layers, h, blocks under "
        f"{type(base).__name__} and its decoder); extend ppo.sharding.decoder_layers for this architecture"
    )


def _silence_view_output_warning() -> None:
    """torch >= 2.13 warns at every forward of an FSDP root whose output is a view of another tensor (an
    in-place op on it would skip the pre-backward all-gather). transformers' heads return views (a
    Linear's output reshaped: the critic's and reward model's ``[1, T, 1]`` logits), and nothing in this
    project modifies a model's output in place (outputs are indexed, cast and combined out of place; the
    sharded gradient tests compare with unsharded models), so it would be noise on every critic step.
    Installed when a model is sharded (a filter added at import would not survive pytest's per-test
    warning state); adding the same filter again replaces it."""
    warnings.filterwarnings(
        "ignore", message=r"FSDP2-wrapped module .* returned a view tensor", category=UserWarning
    )


def shard_model(
    model: nn.Module, mesh: DeviceMesh | None, fsdp: FSDPConfig, *, device: torch.device | str
) -> nn.Module:
    """Apply FSDP2 ``fully_shard`` to each decoder layer, then to the root; returns the same model.

    - ``mesh``: 1-D ``("shard",)`` or 2-D ``("replicate", "shard")`` (hybrid sharding, passed through).
      A 1-rank mesh takes the same code path. ``None`` (one process without a process group) leaves
      the model as it is, with no mixed precision: there is nothing to shard.
    - Mixed precision from ``fsdp.mixed_precision`` (params gathered in ``param_dtype``, gradients
      reduced in ``reduce_dtype``); ``fsdp.param_offload`` keeps shards, grads and optimizer state on
      CPU (pinned only where CUDA exists: pinning needs an accelerator).
    - Layers reshard after forward as configured. The root never does (FSDP2's own default for the
      root): its embeddings and head are needed first thing in the backward, and the fused LM-head
      path reads ``lm_head_weight`` between forward and backward. The price: the root's parameters
      (embeddings, head: ~2 x vocab x hidden) stay gathered after a no-grad forward, until the next
      backward or ``gathered_for_generation`` reshards them.
    - Gradients are **summed** over data-parallel ranks, not averaged: with losses normalized by the
      global token count (all ranks, all micro-batches), the summed gradient is exactly the gradient of
      the global batch, whatever each rank holds.
    - ``fsdp.forward_prefetch``: layer i prefetches layer i+1's all-gather in forward and layer i-1's
      in backward.
    """
    if mesh is None:
        logger.info("no device mesh: %s stays unsharded", type(model).__name__)
        return model
    _silence_view_output_warning()
    device = torch.device(device)
    if mesh.device_type != device.type:
        raise ValueError(f"mesh is on {mesh.device_type} but the device is {device}")
    mp_policy = MixedPrecisionPolicy(
        param_dtype=torch_dtype(fsdp.mixed_precision.param_dtype),
        reduce_dtype=torch_dtype(fsdp.mixed_precision.reduce_dtype),
    )
    offload_policy = (
        CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if fsdp.param_offload else OffloadPolicy()
    )
    layers = list(decoder_layers(model))
    for layer in layers:
        fully_shard(
            layer,
            mesh=mesh,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            reshard_after_forward=fsdp.reshard_after_forward,
        )
        setattr(layer, _RESHARD_ATTR, fsdp.reshard_after_forward)
    fully_shard(
        model, mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy, reshard_after_forward=False
    )
    setattr(model, _RESHARD_ATTR, False)
    for module in fsdp_modules(model):
        # SUM on every backend: a divide factor of 1 alone would use PREMUL_SUM, which gloo lacks.
        module.set_force_sum_reduction_for_comms(True)
        module.set_gradient_divide_factor(1.0)
    if fsdp.forward_prefetch:
        for i, layer in enumerate(layers):
            if i + 1 < len(layers):
                layer.set_modules_to_forward_prefetch([layers[i + 1]])
            if i > 0:
                layer.set_modules_to_backward_prefetch([layers[i - 1]])
    return model


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    """Every module of ``model`` that ``fully_shard`` was applied to (root last)."""
    return [m for m in reversed(list(model.modules())) if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered_for_generation(model: nn.Module) -> Iterator[nn.Module]:
    """Gather all sharded parameters once, for a whole ``generate`` call; reshard on exit.

    Without it, FSDP2 all-gathers every layer at every decode step. Inside, no collective runs (ranks
    may stop generating at different steps) and decoding runs at the speed of the unsharded model
    (python -m ppo_bench.rollout):

    - ``generate`` makes no per-step all-reduce (``_fsdp_marker_hidden``), which transformers adds
      for a model it sees as FSDP-managed.
    - Entered with gradients off (``torch.no_grad``, as ``rollout.generate`` does), FSDP's per-module
      forward hooks are bypassed (``_fsdp_forward_hooks_bypassed``): with everything gathered they
      only re-check state and cast inputs, at every module call of every decode step. With gradients
      on they stay, since they also set up the backward.

    A no-op for an unsharded model. Every rank must enter it (the gathers are collectives). Memory:
    one full copy of the parameters in ``param_dtype``.
    """
    modules = fsdp_modules(model)
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
    for module in modules:
        module.unshard()  # not recursive: each FSDP module gathers its own group
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_fsdp_marker_hidden(model))
            if not torch.is_grad_enabled():
                stack.enter_context(_fsdp_forward_hooks_bypassed(modules))
            yield model
    finally:
        for module in modules:
            module.reshard()
            module.set_reshard_after_forward(getattr(module, _RESHARD_ATTR, True), recurse=False)


@contextlib.contextmanager
def _fsdp_marker_hidden(model: nn.Module) -> Iterator[None]:
    """Let transformers' ``generate`` treat the gathered model as unsharded: no per-step all-reduce.

    ``generate`` defaults to ``synced_gpus=True`` (an all-reduce at every decode step, so that ranks
    keep calling forward until all are done) for a model it finds FSDP-managed: one whose
    ``_is_fsdp_managed_module`` attribute, set by ``fully_shard`` for Dynamo, is True. With the
    parameters gathered no forward makes a collective, so that sync only costs (~10% of decoding the
    tiny model on 2 ranks). The root's attribute is False until exit; passing ``synced_gpus=False`` to
    ``generate`` has the same effect for one call.
    """
    if not getattr(model, "_is_fsdp_managed_module", False):
        yield
        return
    model._is_fsdp_managed_module = False
    try:
        yield
    finally:
        model._is_fsdp_managed_module = True


@contextlib.contextmanager
def _fsdp_forward_hooks_bypassed(modules: list[FSDPModule]) -> Iterator[None]:
    """Replace the forward pre- and post-hook of each FSDP module with a no-op; restore them on exit.

    Only for no-grad forwards of modules whose parameters are all unsharded with reshard-after-forward
    off (``gathered_for_generation``). There FSDP2's hooks would find the parameters gathered, reshard
    nothing and, without autograd, register no backward hooks; what remains is casting floating-point
    inputs to ``param_dtype``, which changes nothing either: generate feeds token ids, and the layers
    get hidden states from embeddings already in ``param_dtype``.

    FSDP2 has no public switch for its hooks, so this uses its private state (torch 2.13):
    ``FSDPState._pre_forward_hook_handle`` / ``_post_forward_hook_handle``, the ``RemovableHandle`` of
    ``register_forward_pre_hook`` / ``register_forward_hook`` on the module. Each hook is swapped in
    place in the module's hook dict (so the hooks keep their order) and put back in ``finally``. A
    module whose handles do not look like that (another torch version, grouped ``fully_shard``) keeps
    its hooks: slower, still correct.
    """
    swapped: list[tuple[dict[int, Callable[..., Any]], int, Callable[..., Any]]] = []
    try:
        for module in modules:
            state = module._get_fsdp_state()
            handles = [
                getattr(state, name, None)
                for name in ("_pre_forward_hook_handle", "_post_forward_hook_handle")
            ]
            hook_dicts = [h.hooks_dict_ref() if isinstance(h, RemovableHandle) else None for h in handles]
            if any(d is None or h.id not in d for h, d in zip(handles, hook_dicts, strict=True)):
                logger.debug("FSDP hooks of %s not found; generating with them", type(module).__name__)
                continue
            for handle, hooks in zip(handles, hook_dicts, strict=True):
                swapped.append((hooks, handle.id, hooks[handle.id]))
                hooks[handle.id] = _no_op_hook
        yield
    finally:
        for hooks, hook_id, hook in swapped:
            hooks[hook_id] = hook


def _no_op_hook(*_: Any) -> None:
    """A forward (pre-)hook that changes nothing: returning None keeps the inputs / output."""
    return None


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The full (unsharded) state dict on CPU on rank 0, ``None`` elsewhere. Collective: all ranks call.

    An unsharded model in a single process returns its own state dict (on CPU).
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state_dict = get_model_state_dict(model, options=options)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    return state_dict


def release(model: nn.Module) -> None:
    """Reshard a frozen model's root after its no-grad forwards: FSDP2 keeps the root (embeddings, head)
    gathered after a forward for the backward that a frozen model never runs."""
    for module in fsdp_modules(model):
        module.reshard()
