"""LoRA adapters (peft) for the actor and the critic; with them the reference is the actor itself.

With ``actor.lora.rank > 0`` only low-rank adapters ``W x + (alpha / r) * B A x`` on the decoder's linear
layers train; the base weights are frozen. The reference policy then costs nothing: it is the actor with
its adapters switched off (``adapters_disabled``), so one copy of the base weights serves actor,
reference and rollout. The critic takes adapters the same way; its value head ``score`` trains whole.

    load_path = lora.base_model_path(cfg.model.path, config_key="model.path")
    model = model_loading.load_causal_lm(
        load_path, dtype=lora.load_dtype(cfg.actor.lora, cfg.model.dtype), ...
    )
    model = lora.apply_lora(
        model, cfg.actor.lora, model_dtype=cfg.model.dtype, config_key="actor.lora", init_from=cfg.model.path
    )
    model = sharding.shard_model(model, mesh, cfg.actor.fsdp, device=device)  # as without LoRA
    with lora.adapters_disabled(model):
        ref_logits = models.causal_lm_logits(model, input_ids, position_ids)
    lora.save_hf(model, tokenizer, out_dir, is_main=info.is_main, merged=cfg.actor.lora.save_merged)

How it is built, and why:

- In place. ``peft.inject_adapter_in_model`` replaces each targeted ``nn.Linear`` of the decoder layers by
  a peft ``lora.Linear`` (``base_layer`` + ``lora_A`` / ``lora_B``) inside the transformers model; the model
  is not wrapped in a ``PeftModel``. It stays a ``PreTrainedModel``, so everything written for one works
  unchanged: the packed forwards of ``ppo.models`` (top-level forward, the ``base_model`` hook of
  ``causal_lm_hidden``, ``logits_to_keep``, ``get_output_embeddings`` for the fused LM head),
  ``generate``, ``sharding.decoder_layers``, gradient checkpointing and ``save_pretrained``. (A
  ``PeftModel`` would hide the backbone behind ``base_model.model`` and break ``causal_lm_hidden`` and
  ``decoder_layers``.) transformers loads a saved adapter folder the same way, in place.
- Adapters only in the decoder layers: the LM head and embeddings stay frozen (the fused LM-head kernels
  read ``lm_head.weight`` directly), and each layer's adapters are sharded with its base weights by
  ``sharding.shard_model`` (``fully_shard`` per decoder layer, then the root).
- dtypes. Frozen base weights may be held in ``lora.base_dtype`` (bf16) while the adapters and the value
  head keep ``model.dtype`` (fp32) master weights. FSDP2 accepts such a mixed group (measured, torch 2.13,
  1 and 2 gloo ranks): ``fully_shard`` requires one dtype among the *trainable* parameters of a group
  (``FSDP expects uniform original parameter dtype``, checked over ``requires_grad`` parameters only) and
  one reduce dtype; frozen parameters may differ. With ``MixedPrecisionPolicy(param_dtype=...)`` every
  parameter is gathered in ``param_dtype`` (bf16 base weights are upcast when it is fp32; fp32 adapters
  are cast down when it is bf16); without one, FSDP2 all-gathers a mixed group through a uint8 buffer.
  Gradients exist only for the fp32 adapters (and head) and are reduced in ``reduce_dtype``. No separate
  ``fully_shard`` for the adapters and no casting of our own is needed. Unsharded (no process group),
  ``base_dtype`` must equal ``model.dtype`` for a critic (its fp32 head would meet bf16 hidden states).
- Same weights on every rank: ``fully_shard`` keeps each rank's own slice and does not broadcast, so the
  adapters are initialized from a fixed seed (``A`` uniform in +-1/sqrt(fan_in), as peft's Kaiming
  default; ``B = 0``, so the adapted model starts equal to the reference), not from the global RNG.
- Reference: ``adapters_disabled`` sets peft's per-layer switch directly. peft's own
  ``enable_adapters(False)`` also flips ``requires_grad`` of the adapters, which FSDP2 has copied into its
  unsharded parameters when it first gathered them: toggling it back and forth behind FSDP2 is avoided.
- Rollout: ``merged_for_generation`` (inside ``sharding.gathered_for_generation``) adds ``(alpha / r) B A``
  into the gathered fp32 base weights, which are temporary all-gather outputs: resharding frees them and
  the sharded masters never see the merge, so nothing is unmerged (no ``W + d - d`` rounding drift).
  Greedy tokens equal those with the adapters active, and decoding costs what the base model costs
  (1.4x faster than active adapters on the CPU demo). Gathered in bf16 (GPU mixed precision) the
  adapters stay active: a merge into bf16 weights would round most of a small update away. An
  unsharded model also keeps them active.
- Checkpoints hold only trainable state (``checkpoint.TRAINABLE_ONLY``): adapters (+ value head) and their
  optimizer state; the frozen base comes from ``model.path`` again.
- A saved adapter folder (peft ``save_pretrained`` output) as ``model.path`` / ``critic.model_path``: the
  model is loaded from the base it names (``base_model_path``, which first checks that the adapters fit
  that base) and ``apply_lora(..., init_from=path)`` merges the folder's adapters into the base weights.
  The run then starts from that policy, the reference is that policy, and fresh adapters (if
  ``rank > 0``) train on top.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils.other import ModulesToSaveWrapper
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerBase

from ppo import models, sharding
from ppo.config import ConfigError, LoRAConfig

logger = logging.getLogger("ppo")

ADAPTER = "default"
"""peft's adapter name; a model here carries one adapter."""

ALL_LINEAR = "all-linear"
"""``target_modules`` entry that means every linear layer of the decoder layers."""

INIT_SEED = 0
"""Seed of the adapters' initial ``A`` (the same on every rank and in every run)."""

_STATE_ATTR = "_ppo_lora"


@dataclass(kw_only=True)
class _LoRAState:
    """What ``apply_lora`` decided, kept on the model for ``save_hf``."""

    peft_config: LoraConfig
    saved_targets: list[str]
    """``target_modules`` of an exported adapter_config.json."""
    head: str | None
    """Name of the module that trains whole (the critic's ``score``)."""
    base_path: str
    """Where the base weights come from (``config._name_or_path``)."""
    merged_at_load: str | None
    """The adapter folder merged into the base at load (``init_from``), if any."""


def uses_lora(lora_cfg: LoRAConfig) -> bool:
    """Whether the config asks for adapters (``rank > 0``)."""
    return lora_cfg.rank > 0


def load_dtype(lora_cfg: LoRAConfig, model_dtype: str) -> str:
    """The dtype to load a model in: ``lora.base_dtype`` with LoRA (the frozen weights stay in it and
    ``apply_lora`` upcasts only the adapters and the head), else ``model.dtype``. Loading a 7B base in
    bf16 rather than fp32 halves each rank's host memory while the model is built."""
    if uses_lora(lora_cfg) and lora_cfg.base_dtype is not None:
        return lora_cfg.base_dtype
    return model_dtype


# ----------------------------------------------------------------------------------------------------
# Building
# ----------------------------------------------------------------------------------------------------


def apply_lora(
    model: nn.Module,
    lora_cfg: LoRAConfig,
    *,
    model_dtype: str,
    trainable_head: str | None = None,
    config_key: str,
    init_from: str | None = None,
) -> nn.Module:
    """Add LoRA adapters to a CPU-loaded transformers model before sharding; returns the same model.

    - Adapters on the ``nn.Linear`` layers inside the decoder layers whose name equals or ends with an
      entry of ``lora_cfg.target_modules`` (``all-linear``: all of them). Everything else is frozen
      except ``trainable_head`` (the critic's ``score``), which trains whole.
    - Frozen weights in ``lora_cfg.base_dtype`` (default: as loaded); adapters and head in
      ``model_dtype``. Buffers (rotary frequencies) keep their dtype.
    - ``init_from``: the configured model path. When it is a saved adapter folder (the model was loaded
      from ``base_model_path(init_from)``), its adapters are merged into the base weights first (and its
      saved head, if any, loaded): the run starts from that policy, which is also the reference. With
      ``rank == 0`` that merge is all that happens, and every weight trains.

    ``config_key``: the config section, e.g. ``actor.lora``; errors (``ConfigError``, one line) name it.
    """
    adapter_dir = init_from if init_from is not None and is_adapter_folder(init_from) else None
    if adapter_dir is not None:
        if uses_lora(lora_cfg) and not lora_cfg.save_merged:
            raise ConfigError(
                f"{config_key}.save_merged=false, but the model path {init_from!r} is an adapter folder: its "
                "adapters are merged into the base at load and that merged base exists nowhere on disk, so "
                "new adapters could not be exported on their own; set save_merged=true"
            )
        _merge_adapter_folder(model, adapter_dir)
    if not uses_lora(lora_cfg):
        if adapter_dir is not None:
            model.requires_grad_(True)
        return model
    targets = resolve_targets(model, lora_cfg, config_key=config_key, head=trainable_head)
    peft_config = LoraConfig(
        r=lora_cfg.rank,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=targets,
        bias="none",
    )
    inject_adapter_in_model(peft_config, model, adapter_name=ADAPTER)
    model.__dict__.pop("peft_config", None)  # peft's copy on the model; ours is kept for save_hf
    model.requires_grad_(False)
    dtype = sharding.torch_dtype(model_dtype)
    layers = dict(lora_layers(model))
    generator = torch.Generator().manual_seed(INIT_SEED)
    for name in targets:
        a, b = layers[name].lora_A[ADAPTER], layers[name].lora_B[ADAPTER]
        a.to(dtype).requires_grad_(True)
        b.to(dtype).requires_grad_(True)
        bound = 1.0 / math.sqrt(a.in_features)  # peft's (and nn.Linear's) Kaiming-uniform default
        with torch.no_grad():
            a.weight.copy_((torch.rand(a.weight.shape, generator=generator) * 2 - 1) * bound)
            b.weight.zero_()
    if trainable_head is not None:
        head = getattr(model, trainable_head, None)
        if not isinstance(head, nn.Module):
            raise ValueError(f"{type(model).__name__} has no head module {trainable_head!r}")
        head.to(dtype).requires_grad_(True)
    if lora_cfg.base_dtype is not None:
        base_dtype = sharding.torch_dtype(lora_cfg.base_dtype)
        for param in model.parameters():  # not model.to(): buffers such as inv_freq keep fp32
            if not param.requires_grad and param.is_floating_point():
                param.data = param.data.to(base_dtype)
    setattr(
        model,
        _STATE_ATTR,
        _LoRAState(
            peft_config=peft_config,
            saved_targets=_saved_targets(model, targets),
            head=trainable_head,
            base_path=_absolute(str(getattr(model.config, "_name_or_path", ""))),
            merged_at_load=adapter_dir,
        ),
    )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    logger.info(
        "%s: rank %d, alpha %g on %d linear layers; %.3fM of %.2fM parameters train",
        config_key,
        lora_cfg.rank,
        lora_cfg.alpha,
        len(targets),
        trainable / 1e6,
        total / 1e6,
    )
    return model


def resolve_targets(
    model: nn.Module, lora_cfg: LoRAConfig, *, config_key: str, head: str | None = None
) -> list[str]:
    """Full names of the decoder's linear layers that ``lora_cfg.target_modules`` selects, in model order.

    Raises ``ConfigError`` for an entry that matches nothing (listing the layer names that exist), one
    that names a layer outside the decoder layers (LM head, value head), or a rank above the smaller
    dimension of a selected layer (``B A`` could not have that rank).
    """
    layer_ids = {id(m) for m in sharding.decoder_layers(model)}
    prefixes = tuple(f"{n}." for n, m in model.named_modules() if id(m) in layer_ids)
    linear = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    candidates = {n: m for n, m in linear.items() if n.startswith(prefixes)}
    leaf_names = sorted({n.rsplit(".", 1)[-1] for n in candidates})
    key = f"{config_key}.target_modules"
    selected: set[str] = set()
    for target in lora_cfg.target_modules:
        if target == ALL_LINEAR:
            matched = set(candidates)
        else:
            matched = {n for n in candidates if n == target or n.endswith("." + target)}
        if not matched:
            if target == head or any(n == target or n.endswith("." + target) for n in linear):
                raise ConfigError(
                    f"{key}: {target!r} is outside the decoder layers of {type(model).__name__}; adapters go "
                    f"on their linear layers only (the LM head stays frozen, a critic's value head trains "
                    f"whole): choose from {leaf_names} or {ALL_LINEAR!r}"
                )
            raise ConfigError(
                f"{key}={lora_cfg.target_modules}: {target!r} matches no linear layer of "
                f"{type(model).__name__}; its decoder layers have {leaf_names or 'no nn.Linear layers'} "
                f"({ALL_LINEAR!r} takes them all)"
            )
        selected |= matched
    targets = [n for n in candidates if n in selected]
    smallest = min(targets, key=lambda n: min(candidates[n].in_features, candidates[n].out_features))
    layer = candidates[smallest]
    limit = min(layer.in_features, layer.out_features)
    if lora_cfg.rank > limit:
        raise ConfigError(
            f"{config_key}.rank={lora_cfg.rank} is larger than the smaller dimension of {smallest} "
            f"({layer.in_features} -> {layer.out_features}): use a rank of at most {limit}"
        )
    return targets


def _saved_targets(model: nn.Module, targets: list[str]) -> list[str]:
    """``target_modules`` for the exported adapter_config.json: leaf names (``q_proj``) when they select
    exactly these layers in peft's suffix matching, else the full names."""
    leaves = sorted({t.rsplit(".", 1)[-1] for t in targets})
    by_leaf = {
        n
        for n, m in model.named_modules()
        if isinstance(m, LoraLayer | nn.Linear) and n.rsplit(".", 1)[-1] in leaves
    }
    return leaves if by_leaf == set(targets) else list(targets)


def _absolute(path: str) -> str:
    """A local folder as an absolute path (an adapter folder must find its base from anywhere)."""
    expanded = os.path.expanduser(path)
    return os.path.abspath(expanded) if path and os.path.isdir(expanded) else path


def lora_layers(model: nn.Module) -> Iterator[tuple[str, LoraLayer]]:
    """``(name, layer)`` of every peft LoRA layer of ``model``."""
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


# ----------------------------------------------------------------------------------------------------
# Starting from a saved adapter folder
# ----------------------------------------------------------------------------------------------------


def is_adapter_folder(path: str) -> bool:
    """Whether ``path`` is a peft ``save_pretrained`` folder (``adapter_config.json``)."""
    return (Path(os.path.expanduser(path)) / "adapter_config.json").is_file()


def base_model_path(path: str, *, config_key: str) -> str:
    """Where to load the weights of ``path`` from: ``path`` itself, or for a saved adapter folder the base
    model its ``adapter_config.json`` names, after checking that the adapters fit that base.

    Raises ``ConfigError`` (one line, naming ``config_key``) for an adapter folder that is not LoRA, names
    no base, names a base that cannot be found, or whose adapters were trained on another base model
    (a layer it adapts is missing or has other dimensions). transformers would otherwise fail deep in
    ``from_pretrained`` with a size-mismatch report. Reads only shapes: the adapter file's header and the
    base built on the meta device from its config.
    """
    if not is_adapter_folder(path):
        return path
    folder = Path(os.path.expanduser(path))
    adapter_cfg = json.loads((folder / "adapter_config.json").read_text())
    where = f"{config_key}={path!r} is an adapter folder"
    if adapter_cfg.get("peft_type") != "LORA":
        raise ConfigError(f"{where} of type {adapter_cfg.get('peft_type')}; only LoRA adapters load here")
    base = adapter_cfg.get("base_model_name_or_path")
    if not base:
        raise ConfigError(f"{where} whose adapter_config.json names no base_model_name_or_path: set it")
    base = os.path.expanduser(base)
    try:
        base_config = AutoConfig.from_pretrained(base)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(base_config)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where} whose base model {base!r} cannot be loaded ({_first_line(e)})") from None
    modules = dict(skeleton.named_modules())
    for key, shape in _adapter_shapes(folder, where).items():
        found = re.fullmatch(r"base_model\.model\.(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
        if found is None:
            continue  # a saved head (modules_to_save) or a bias
        name, which = found.groups()
        layer = modules.get(name)
        if not isinstance(layer, nn.Linear):
            raise ConfigError(
                f"{where} trained on another base model than the {base!r} it names: that model has no "
                f"linear layer {name}"
            )
        expected = [shape[0], layer.in_features] if which == "A" else [layer.out_features, shape[1]]
        if shape != expected:
            raise ConfigError(
                f"{where} trained on another base model than the {base!r} it names: {key} is {shape}, but "
                f"{name} there maps {layer.in_features} -> {layer.out_features}"
            )
    return base


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]


def _adapter_shapes(folder: Path, where: str) -> dict[str, list[int]]:
    safetensors_file = folder / "adapter_model.safetensors"
    if safetensors_file.is_file():
        with safe_open(str(safetensors_file), framework="pt") as f:
            return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    bin_file = folder / "adapter_model.bin"
    if bin_file.is_file():
        state = torch.load(bin_file, map_location="meta", weights_only=True)
        return {k: list(v.shape) for k, v in state.items()}
    raise ConfigError(f"{where} without adapter_model.safetensors or adapter_model.bin")


def _merge_adapter_folder(model: nn.Module, folder: str) -> None:
    """Load a saved adapter folder into ``model`` with peft and fold it into the base weights; a saved
    head (``modules_to_save``, e.g. a critic's ``score``) replaces the model's own."""
    path = Path(os.path.expanduser(folder))
    peft_config = LoraConfig.from_pretrained(str(path))
    peft_config.inference_mode = True
    name = "loaded"
    inject_adapter_in_model(peft_config, model, adapter_name=name)
    state_file = path / "adapter_model.safetensors"
    state = (
        load_file(str(state_file))
        if state_file.is_file()
        else torch.load(path / "adapter_model.bin", map_location="cpu", weights_only=True)
    )
    # Keys as the model names them (peft saves them under a PeftModel's ``base_model.model.``).
    state = {k.removeprefix("base_model.model."): v for k, v in state.items()}
    result = set_peft_model_state_dict(model, state, adapter_name=name)
    missing = [k for k in result.missing_keys if f".{name}." in k]
    if missing:
        raise ConfigError(
            f"adapter folder {folder!r} lacks weights of {len(missing)} adapters, e.g. {missing[0]}"
        )
    with torch.no_grad():
        for module_name, module in list(model.named_modules()):
            if isinstance(module, BaseTunerLayer | ModulesToSaveWrapper):
                parent_name, _, child = module_name.rpartition(".")
                if isinstance(module, ModulesToSaveWrapper):
                    replacement = module.modules_to_save[name]
                else:
                    module.merge(adapter_names=[name])
                    replacement = module.get_base_layer()
                setattr(model.get_submodule(parent_name), child, replacement)
    model.__dict__.pop("peft_config", None)
    logger.info("merged the adapters of %s into its base model", folder)


# ----------------------------------------------------------------------------------------------------
# Reference and rollout
# ----------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Run ``model`` as its base model (the reference policy): every LoRA layer computes ``W x`` only.

    A no-op for a model without adapters (a separately loaded reference), so the trainer can wrap every
    reference forward in it. Sets peft's per-layer ``_disable_adapters`` flag directly: peft's own
    ``enable_adapters`` would also flip ``requires_grad`` of the adapter weights (see the module doc).
    Local to this process: no collective; every rank must do the same, as for any forward.
    """
    layers = [m for _, m in lora_layers(model)]
    saved = [m._disable_adapters for m in layers]
    if any(m.merged for m in layers):
        raise RuntimeError("adapters_disabled: the adapters are merged; leave merged_for_generation first")
    for m in layers:
        m._disable_adapters = True
    try:
        yield model
    finally:
        for m, flag in zip(layers, saved, strict=True):
            m._disable_adapters = flag


@contextlib.contextmanager
def merged_for_generation(model: nn.Module) -> Iterator[nn.Module]:
    """Inside ``sharding.gathered_for_generation``: fold each adapter into its gathered fp32 base weight,
    ``W <- W + (alpha / r) B A``, for the whole ``generate`` call. A no-op without adapters.

    - Why: each adapted layer is one matmul again, without peft's per-call dispatch (two more matmuls,
      a scale and an add per layer and decode step). Demo model (hidden 128, 3 layers), rank 16 on every
      linear layer, 64 prompts x 32 greedy tokens, 1 rank, on a loaded 2-core CPU: base model 0.96 s,
      adapters active 1.31 s, merged 0.95 s (merge included): the adapters' cost is gone; same tokens.
    - No unmerge: the gathered weights are FSDP2's temporary all-gather outputs (also on one rank, with
      CPU offload, with ``reshard_after_forward=False``: measured), which the reshard on leaving
      ``gathered_for_generation`` frees; the sharded masters never change, so nothing is subtracted
      back (no ``W + d - d`` rounding drift). The exit only resets peft's bookkeeping.
    - Only fp32: merged into bf16 (or fp16) weights, every entry of ``(alpha / r) B A`` below half a ulp
      of ``W`` rounds away (with ``|W| ~ 0.02`` and update entries ~1e-5, 70% of the update is lost):
      the rollout would sample from a policy close to the reference instead of the actor. Under bf16
      mixed precision the adapters therefore stay active, as they do for an unsharded model (whose
      weights are its masters).
    """
    layers = [m for _, m in lora_layers(model)]
    if not layers or not sharding.fsdp_modules(model):
        yield model
        return
    if any(isinstance(m.base_layer.weight, DTensor) for m in layers):
        raise RuntimeError("merged_for_generation must run inside sharding.gathered_for_generation")
    if any(m.base_layer.weight.dtype != torch.float32 for m in layers):
        yield model
        return
    try:
        with torch.no_grad():
            for m in layers:
                m.merge()
        yield model
    finally:
        for m in layers:
            m.merged_adapters.clear()  # the merged buffers are freed by the reshard that follows


# ----------------------------------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------------------------------


def save_hf(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase | None,
    out_dir: str | os.PathLike[str],
    *,
    is_main: bool,
    merged: bool,
) -> None:
    """Write a LoRA model as a Hugging Face folder; collective (every rank calls it, ``is_main`` writes).

    - ``merged``: a plain ``save_pretrained`` folder with ``W + (alpha / r) B A`` in place of each adapted
      layer; it loads with ``AutoModelForCausalLM`` (or ``load_critic``) without peft. A base held in
      bf16 (``lora.base_dtype``) is written in the adapters' fp32, config included: rounded to bf16, every
      entry of the update below half a ulp of ``W`` would be lost (most of a PPO run's update, see
      ``merged_for_generation``). The adapter folder is the compact faithful export.
    - else the adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``, peft's layout,
      ``base_model_name_or_path`` = the base's path); it loads with ``PeftModel.from_pretrained(base,
      out_dir)`` or ``AutoModelForCausalLM.from_pretrained(out_dir)``. A critic's head is saved as
      ``modules_to_save``. Only the trainable tensors are gathered.

    A model without adapters is saved by ``models.save_hf`` whatever ``merged`` says.
    """
    state: _LoRAState | None = getattr(model, _STATE_ATTR, None)
    if state is None:
        models.save_hf(model, tokenizer, out_dir, is_main=is_main)
        return
    if not merged and state.merged_at_load:
        # Every rank raises alike, before any collective.
        raise ConfigError(
            f"cannot write an adapter folder: the run started from the adapter folder {state.merged_at_load}, "
            "whose adapters were merged into the base at load, and that merged base exists nowhere on disk; "
            "export the merged model (lora.save_merged=true / export_hf.py --merged)"
        )
    scalings = {name: layer.scaling[ADAPTER] for name, layer in lora_layers(model)}
    if merged:
        full = sharding.full_state_dict(model)
    else:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        full = get_model_state_dict(model, options=options)
    if is_main:
        if full is None:
            raise RuntimeError("save_hf: is_main must be rank 0, which receives the gathered state dict")
        os.makedirs(out_dir, exist_ok=True)
        if merged:
            _save_merged(model, merged_state_dict(full, scalings), out_dir)
        else:
            _write_adapter_folder(full, state, Path(out_dir))
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
    if dist.is_initialized():
        dist.barrier()  # the folder is complete on every rank's return


def merged_state_dict(
    state_dict: dict[str, torch.Tensor], scalings: dict[str, float]
) -> dict[str, torch.Tensor]:
    """A LoRA model's full state dict with every adapted layer folded back into a plain ``nn.Linear``.

    ``scalings``: ``alpha / r`` per adapted layer name. ``P.base_layer.weight`` ``[out, in]`` plus
    ``scaling * P.lora_B.default.weight [out, r] @ P.lora_A.default.weight [r, in]`` (computed in fp32,
    stored in the wider of the base's and the adapters' dtypes) becomes ``P.weight``;
    ``P.base_layer.bias`` becomes ``P.bias``.
    """
    out = dict(state_dict)
    for name, scaling in scalings.items():
        base = out.pop(f"{name}.base_layer.weight")
        a = out.pop(f"{name}.lora_A.{ADAPTER}.weight")
        b = out.pop(f"{name}.lora_B.{ADAPTER}.weight")
        dtype = torch.promote_types(base.dtype, a.dtype)
        out[f"{name}.weight"] = (base.float() + scaling * (b.float() @ a.float())).to(dtype)
        if f"{name}.base_layer.bias" in out:
            out[f"{name}.bias"] = out.pop(f"{name}.base_layer.bias")
    leftover = [k for k in out if ".lora_" in k or ".base_layer." in k]
    if leftover:
        raise RuntimeError(f"merged_state_dict: adapter tensors of unknown layers left: {leftover[:4]}")
    return out


def _save_merged(
    model: nn.Module, state_dict: dict[str, torch.Tensor], out_dir: str | os.PathLike[str]
) -> None:
    """``save_pretrained`` with every floating tensor in the widest dtype present, and the config's
    ``dtype`` saying so (transformers loads a folder in its config's dtype by default)."""
    dtypes = {v.dtype for v in state_dict.values() if v.is_floating_point()}
    widest = max(dtypes, key=lambda d: torch.finfo(d).bits)
    state_dict = {k: v.to(widest) if v.is_floating_point() else v for k, v in state_dict.items()}
    model.save_pretrained(out_dir, state_dict=state_dict)
    # save_pretrained writes the dtype of the model's own (bf16 base) parameters into config.json.
    config = copy.deepcopy(model.config)
    config.dtype = widest
    config.save_pretrained(out_dir)


def _write_adapter_folder(trainable: dict[str, torch.Tensor], state: _LoRAState, out_dir: Path) -> None:
    """peft's adapter layout: ``base_model.model.<layer>.lora_A.weight`` (no adapter name) and, for a
    module trained whole, ``base_model.model.<module>.<param>`` with that module in ``modules_to_save``."""
    tensors = {}
    for key, value in trainable.items():
        key = key.replace(f".lora_A.{ADAPTER}.", ".lora_A.").replace(f".lora_B.{ADAPTER}.", ".lora_B.")
        tensors[f"base_model.model.{key}"] = value.contiguous()
    config = LoraConfig(
        r=state.peft_config.r,
        lora_alpha=state.peft_config.lora_alpha,
        lora_dropout=state.peft_config.lora_dropout,
        target_modules=state.saved_targets,
        bias="none",
        modules_to_save=[state.head] if state.head else None,
        task_type="TOKEN_CLS" if state.head else "CAUSAL_LM",
        base_model_name_or_path=state.base_path,
    )
    config.save_pretrained(str(out_dir))
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
