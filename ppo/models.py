"""Load, shard, run and save the four models of PPO: actor, reference, critic and reward model.

- Loading: ``load_causal_lm`` (actor, reference), ``load_critic`` (backbone + token-level value head),
  ``load_reward_model`` (backbone + sequence score read at the last token), ``load_tokenizer``. All go
  through ``from_pretrained`` and come back with dropout off (PPO compares train-mode forwards with
  the log-probs of the rollout; dropout would make the first ratio differ from 1).
- Packed forwards: the tokens of ``B`` sequences concatenated into one row ``[total_tokens]`` with
  ``position_ids`` restarting at 0 per sequence and ``cu_seqlens [B+1]`` marking the boundaries. No
  attention mask and ``use_cache=False`` (with the cache on, the packing is silently ignored).
- Attention: ``resolve_attn_implementation("auto")`` is flash_attention_2 on CUDA with flash_attn, which
  reads the boundaries from the position ids, else ``ppo_varlen_sdpa`` (``varlen_sdpa_attention``):
  causal sdpa per packed sequence, ``sum(l_i^2)`` work, where transformers' own sdpa and eager apply a
  block-diagonal mask to a dense ``T x T`` score matrix, ``T = sum(l_i)``. Every other call
  (``generate`` with left padding and a KV cache, padded batches) is transformers' sdpa, unchanged.
- Sharding: ``shard_model`` applies FSDP2 ``fully_shard`` per decoder layer, then the root;
  ``gathered_for_generation`` gathers the parameters once for a whole ``generate`` call and bypasses
  FSDP's per-module forward hooks meanwhile;
  ``full_state_dict`` / ``save_hf`` export a ``save_pretrained`` folder from the shards.

Every helper runs the model's own top-level ``forward`` (never ``model.model(...)``): FSDP2 gathers the
root's parameters (embeddings, final norm, head) in the root's forward pre-hook, so calling a
submodule of a sharded root would compute with the root's *shards*. Intermediate results (the final
hidden states, the per-token reward scores) are read with forward hooks instead.

Usage::

    model = load_causal_lm(cfg.model.path, dtype=cfg.model.dtype, device=info.device)
    model = shard_model(model, make_mesh(info, fsdp.fsdp_size), fsdp, device=info.device)
    logits = causal_lm_logits(model, input_ids, position_ids)  # [total_tokens, vocab]
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import itertools
import logging
import os
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
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle
from transformers import (
    AttentionInterface,
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

from ppo.config import FSDPConfig

logger = logging.getLogger("ppo")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Attribute that ``shard_model`` sets on each FSDP module, so that ``gathered_for_generation`` can
# restore the configured ``reshard_after_forward`` (FSDP2 has no public getter for it).
_RESHARD_ATTR = "_ppo_reshard_after_forward"

PACKED_ATTENTION = "ppo_varlen_sdpa"
"""Name of ``varlen_sdpa_attention`` in transformers' ``AttentionInterface`` (``attn_implementation``).
It contains "sdpa" on purpose: transformers then checks at load time that the model supports sdpa, which
every call that is not a packed forward falls back to."""


class ModelPathError(FileNotFoundError):
    """A model or tokenizer path is neither a local folder nor a loadable hub id."""


# ----------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config name (``float32``, ``bfloat16``, ``float16``)."""
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def _looks_local(path: str) -> bool:
    # A hub id is ``name`` or ``org/name``: anything with a leading ./ ../ / ~, or more than one
    # separator, can only mean a folder on disk.
    if os.sep != "/" and os.sep in path:
        return True
    return path.startswith(("/", "./", "../", "~", ".")) or path.count("/") > 1


def _check_path(path: str, config_key: str) -> str:
    """Expand ``~``; fail now, naming the config key, when a local-looking path does not exist."""
    expanded = os.path.expanduser(str(path))
    if os.path.exists(expanded):
        if not os.path.isdir(expanded):
            raise ModelPathError(f"{config_key}={path!r} is a file; it must be a save_pretrained folder")
        return expanded
    if _looks_local(str(path)):
        raise ModelPathError(
            f"{config_key}={path!r}: no such folder (looked for {os.path.abspath(expanded)}). "
            f"Set {config_key} to a save_pretrained folder or a hub id."
        )
    return expanded


@contextlib.contextmanager
def _explain_missing(path: str, config_key: str) -> Iterator[None]:
    """Turn transformers' OSError for an unknown hub id into a ModelPathError naming the config key."""
    try:
        yield
    except OSError as err:
        if os.path.isdir(path) or isinstance(err, ModelPathError):
            raise
        raise ModelPathError(
            f"{config_key}={path!r} is not a local folder and could not be loaded as a hub id ({err}). "
            f"Set {config_key} to a save_pretrained folder."
        ) from err


def load_tokenizer(
    path: str, trust_remote_code: bool = False, *, config_key: str = "model.tokenizer_path"
) -> PreTrainedTokenizerBase:
    """``AutoTokenizer.from_pretrained(path)``; a tokenizer without a pad token pads with eos.

    The padding side is left as saved: rollout sets left padding on its own copy for generation.
    """
    path = _check_path(path, config_key)
    with _explain_missing(path, config_key):
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer at {path} has neither a pad nor an eos token; add a pad token")
        # Padded positions are masked out everywhere, so reusing eos is safe.
        tokenizer.pad_token = tokenizer.eos_token
        logger.info("tokenizer %s has no pad token; using eos %r as pad", path, tokenizer.eos_token)
    return tokenizer


def resolve_attn_implementation(name: str, device: torch.device | str) -> str:
    """The attention kernel to load with: ``auto`` is flash_attention_2 on CUDA with flash_attn
    installed, else ``PACKED_ATTENTION`` (sdpa per packed sequence, see ``varlen_sdpa_attention``).
    ``sdpa`` and ``eager`` are transformers' own (dense block-diagonal mask on packed rows). An explicit
    flash_attention_2 without flash_attn (or off CUDA) fails."""
    device = torch.device(device)
    if name == "auto":
        if device.type == "cuda" and _flash_attn_error() is None:
            return "flash_attention_2"
        return PACKED_ATTENTION
    if name == "flash_attention_2":
        if (error := _flash_attn_error()) is not None:
            raise ImportError(
                f"model.attn_implementation=flash_attention_2 needs the flash-attn package ({error}); "
                "pip install flash-attn, or use model.attn_implementation=auto|sdpa"
            )
        if device.type != "cuda":
            raise ValueError(f"flash_attention_2 runs on CUDA only, the device is {device}; use sdpa")
    return name


def _flash_attn_error() -> str | None:
    """Why flash_attn cannot be used, or None. Imported, not just found: a wheel built for another
    torch is installed but fails on import (undefined symbol)."""
    if importlib.util.find_spec("flash_attn") is None:
        return "not installed"
    try:
        importlib.import_module("flash_attn")
    except Exception as err:  # ImportError, OSError: an ABI mismatch shows up as either
        return f"installed but not importable: {err}"
    return None


def _load_config(path: str, trust_remote_code: bool, **overrides: Any) -> PretrainedConfig:
    """The checkpoint's config with every dropout probability set to 0 and ``overrides`` applied."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    configs = [config]
    text_config = config.get_text_config()
    if text_config is not config:
        configs.append(text_config)
    for cfg in configs:
        for key, value in cfg.to_dict().items():
            # Llama: attention_dropout; GPT-2: resid_pdrop, embd_pdrop, attn_pdrop; others: *_dropout.
            if ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float) and value > 0:
                setattr(cfg, key, 0.0)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _from_pretrained(
    auto_cls: type,
    path: str,
    *,
    dtype: str,
    attn_implementation: str,
    trust_remote_code: bool,
    device: torch.device | str,
    config_key: str,
    **config_overrides: Any,
) -> tuple[PreTrainedModel, dict[str, Any]]:
    path = _check_path(path, config_key)
    with _explain_missing(path, config_key):
        config = _load_config(path, trust_remote_code, **config_overrides)
        model, info = auto_cls.from_pretrained(
            path,
            config=config,
            dtype=torch_dtype(dtype),
            attn_implementation=resolve_attn_implementation(attn_implementation, device),
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
        )
    return model.to(device), info


def load_causal_lm(
    path: str,
    *,
    dtype: str = "float32",
    attn_implementation: str = "auto",
    trust_remote_code: bool = False,
    device: torch.device | str = "cpu",
    config_key: str = "model.path",
) -> PreTrainedModel:
    """Actor or reference: ``AutoModelForCausalLM.from_pretrained(path)`` in ``dtype``, dropout off.

    ``device``: where the weights go. To shard, load on CPU and let ``shard_model`` move each rank's
    shard to the accelerator (a full copy per accelerator would not fit for large models).
    """
    model, _ = _from_pretrained(
        AutoModelForCausalLM,
        path,
        dtype=dtype,
        attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code,
        device=device,
        config_key=config_key,
    )
    return model


def load_critic(
    path: str,
    *,
    dtype: str = "float32",
    attn_implementation: str = "auto",
    trust_remote_code: bool = False,
    device: torch.device | str = "cpu",
    config_key: str = "critic.model_path",
) -> PreTrainedModel:
    """Critic: ``AutoModelForTokenClassification.from_pretrained(path, num_labels=1)``, one value per token.

    From a causal-LM checkpoint this is the backbone (the LM head is dropped) plus a fresh ``score``
    head, which is set to zero (weight and bias): the critic then predicts 0 for every token, so the
    first advantages are the rewards themselves and not noise from a random projection of hidden
    states whose norm grows like sqrt(hidden). The head's own dropout (``classifier_dropout``) is off.
    A saved critic loads its trained head as it is.
    """
    model, info = _from_pretrained(
        AutoModelForTokenClassification,
        path,
        dtype=dtype,
        attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code,
        device=device,
        config_key=config_key,
        num_labels=1,
        classifier_dropout=0.0,
    )
    head = _score_head(model)
    fresh = [k for k in info["missing_keys"] if k.startswith("score.")]
    if fresh:
        with torch.no_grad():
            for param in head.parameters():
                param.zero_()
        logger.info("critic from %s: fresh value head %s, initialized to zero", path, fresh)
    return model


def load_reward_model(
    path: str,
    *,
    dtype: str = "float32",
    attn_implementation: str = "auto",
    trust_remote_code: bool = False,
    device: torch.device | str = "cpu",
    config_key: str = "reward.model_path",
) -> PreTrainedModel:
    """Reward model: ``AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)``.

    A checkpoint without a ``score`` head (a plain causal LM) gets a fresh one, drawn from a fixed
    seed with std ``initializer_range``: every rank must hold the same weights before sharding
    (``fully_shard`` keeps each rank's own slice, it does not broadcast), and transformers' random
    init differs per process. Scores are then meaningless until trained, so it logs a warning.
    """
    model, info = _from_pretrained(
        AutoModelForSequenceClassification,
        path,
        dtype=dtype,
        attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code,
        device=device,
        config_key=config_key,
        num_labels=1,
    )
    head = _score_head(model)
    fresh = [k for k in info["missing_keys"] if k.startswith("score.")]
    if fresh:
        std = getattr(model.config.get_text_config(), "initializer_range", 0.02)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for param in head.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * std if param.dim() > 1 else 0.0)
        logger.warning("reward model %s has no trained score head (%s); its scores are random", path, fresh)
    return model


def _score_head(model: nn.Module) -> nn.Module:
    head = getattr(model, "score", None)
    if not isinstance(head, nn.Module):
        raise ValueError(
            f"{type(model).__name__} has no `score` head; critic and reward model need a decoder-only "
            "architecture whose *ForTokenClassification / *ForSequenceClassification head is `score`"
        )
    return head


# ----------------------------------------------------------------------------------------------------
# Attention for packed rows
# ----------------------------------------------------------------------------------------------------


def varlen_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal sdpa per packed sequence; transformers' sdpa for every other call.

    A transformers attention function (``AttentionInterface``, name ``PACKED_ATTENTION``): query
    ``[b, H, q, d]``, key and value ``[b, H_kv, k, d]`` (grouped-query attention when ``H_kv < H``),
    returns ``[b, q, H, d]``. A packed forward is one row (``b = 1``) without a cache (``q = k = T``) and
    without a mask (``varlen_sdpa_mask`` returns none for it), holding the sequences that
    ``position_ids`` delimit; each gets ``softmax(q_i k_i^T * scaling + causal) v_i`` on its own tokens,
    ``sum(l_i^2)`` score entries in all instead of the ``T^2`` of a dense block-diagonal mask.
    Everything else, and a row of one sequence, goes to ``sdpa_attention_forward`` as it is.
    """
    starts = _packed_sequence_starts(query, key, attention_mask, kwargs.get("position_ids"))
    if starts is None or len(starts) == 1:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    # varlen_sdpa_mask dropped the mask of this row, so it must be computed here, and this function
    # only knows the plain causal pattern: fail rather than attend differently from sdpa.
    extras = [k for k in ("sliding_window", "softcap", "position_bias") if kwargs.get(k) is not None]
    is_causal = kwargs.get("is_causal")  # as sdpa_attention_forward reads it
    if extras or not (getattr(module, "is_causal", True) if is_causal is None else is_causal):
        raise NotImplementedError(
            f"{PACKED_ATTENTION} computes plain causal attention per packed sequence; "
            f"{type(module).__name__} needs {extras or ['non-causal attention']}: load it with "
            "attn_implementation=sdpa"
        )
    # Grouped-query attention: sdpa broadcasts each key/value head over its query heads.
    gqa = {"enable_gqa": True} if key.shape[1] != query.shape[1] else {}
    outputs = [
        torch.nn.functional.scaled_dot_product_attention(
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            dropout_p=dropout,
            is_causal=True,
            scale=scaling,
            **gqa,
        )
        for start, end in itertools.pairwise([*starts, query.shape[2]])
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def _packed_sequence_starts(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
) -> list[int] | None:
    """Offsets where the sequences of a packed row start (``[0, ...]``), or None for any other call."""
    if attention_mask is not None or position_ids is None:
        return None
    if query.shape[0] != 1 or query.shape[2] != key.shape[2] or position_ids.numel() != query.shape[2]:
        return None  # a batch of rows, or queries after a cached prefix (decoding)
    positions = position_ids.reshape(-1)
    # A sequence starts wherever the position does not continue the previous one: the rule by which
    # transformers finds packed sequences (masking_utils.find_packed_sequence_indices).
    breaks = (positions[1:] - positions[:-1] != 1).nonzero().flatten() + 1
    return [0, *breaks.tolist()]


def varlen_sdpa_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    mask_function: Callable[..., torch.Tensor] = causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    use_vmap: bool = False,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The mask function of ``PACKED_ATTENTION`` (``AttentionMaskInterface``): none for a packed causal
    row, which ``varlen_sdpa_attention`` splits by its position ids instead, else ``sdpa_mask``.

    Transformers calls it once per forward with the pattern as an index function ``mask_function(b, h,
    q_idx, kv_idx) -> bool``; for a packed row (no padding mask, one row, no cache) that is causal
    within each sequence, and ``sdpa_mask`` would materialize it as a dense ``[1, 1, T, T]`` tensor.
    The pattern is recognized on two diagonals, ``O(T)``: packed causal has no entry above the diagonal
    and a gap below it at each sequence start. Anything else (a plain causal row, padding, a KV cache,
    sliding windows, bidirectional or model-specific overlays) gets exactly sdpa's mask, so
    ``generate`` and padded batches behave as with ``attn_implementation="sdpa"``.
    """
    candidate = (
        attention_mask is None
        and batch_size == 1
        and q_length == kv_length > 1
        and isinstance(q_offset, int)
        and q_offset == 0
        and kv_offset == 0
        and not use_vmap  # or/and overlays (vmap'd, maybe not index-based)
        and kwargs.get("local_size") is None  # sliding window or chunked attention
        and "allow_is_bidirectional_skip" not in kwargs  # create_bidirectional_mask
    )
    if candidate and _is_packed_causal(mask_function, q_length, kwargs.get("device", "cpu")):
        return None
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        use_vmap=use_vmap,
        **kwargs,
    )


def _is_packed_causal(
    mask_function: Callable[..., torch.Tensor], length: int, device: torch.device | str
) -> bool:
    """Whether ``mask_function`` over ``length`` tokens is causal and holds more than one sequence."""
    zero = torch.zeros((), dtype=torch.long, device=device)
    t = torch.arange(length - 1, device=device)
    above = mask_function(zero, zero, t, t + 1)  # (t, t+1): masked in any causal pattern
    below = mask_function(zero, zero, t + 1, t)  # (t+1, t): masked only where sequence t+1 starts
    return not bool(above.any()) and not bool(below.all())


def _register_packed_attention() -> None:
    """Make ``PACKED_ATTENTION`` a valid ``attn_implementation`` (idempotent; runs at import).

    Transformers looks the name up in both registries: the attention function per layer, and the mask
    function once per forward (a name without one would get no mask at all, breaking padded batches).
    """
    AttentionInterface.register(PACKED_ATTENTION, varlen_sdpa_attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, varlen_sdpa_mask)


_register_packed_attention()


# ----------------------------------------------------------------------------------------------------
# Packed (padding-free) forwards
# ----------------------------------------------------------------------------------------------------


def _packed_inputs(input_ids: torch.Tensor, position_ids: torch.Tensor) -> dict[str, Any]:
    if input_ids.dim() != 1 or input_ids.shape != position_ids.shape:
        raise ValueError(
            f"packed input_ids and position_ids must both be [total_tokens]; got {tuple(input_ids.shape)} "
            f"and {tuple(position_ids.shape)}"
        )
    # No attention mask and no cache: with position ids restarting at 0 per sequence, transformers
    # attends block-diagonally (PACKED_ATTENTION: per sequence); a cache would make it ignore the
    # packing (silently).
    return {"input_ids": input_ids[None], "position_ids": position_ids[None], "use_cache": False}


def causal_lm_logits(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Next-token logits of packed sequences: ``[total_tokens] -> [total_tokens, vocab]``.

    In the compute dtype (bf16 under bf16 mixed precision); upcast where it matters.
    """
    return model(**_packed_inputs(input_ids, position_ids)).logits[0]


def causal_lm_hidden(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
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
        model(**_packed_inputs(input_ids, position_ids), **keep)
    finally:
        handle.remove()
    if len(captured) != 1:
        raise RuntimeError(f"expected one backbone output from {type(model).__name__}, got {len(captured)}")
    return captured[0][0]


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


def critic_values(critic: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Token values of packed sequences: ``[total_tokens] -> [total_tokens]`` fp32.

    ``values[t]`` is the critic's estimate at token ``t`` (the state after reading tokens ``<= t``).
    """
    return critic(**_packed_inputs(input_ids, position_ids)).logits[0, :, 0].float()


def reward_scores(
    reward_model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor
) -> torch.Tensor:
    """One score per packed sequence, read at its last token: ``[total_tokens] -> [B]`` fp32.

    ``cu_seqlens [B+1]``: sequence ``i`` is tokens ``cu_seqlens[i]:cu_seqlens[i+1]``. The per-token
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

    handle = _score_head(reward_model).register_forward_hook(grab)
    try:
        reward_model(**_packed_inputs(input_ids, position_ids))
    finally:
        handle.remove()
    token_scores = captured[0][0, :, 0]  # [total_tokens]
    last = (cu_seqlens[1:] - 1).to(device=token_scores.device, dtype=torch.long)
    return token_scores[last].float()


# ----------------------------------------------------------------------------------------------------
# Sharding, checkpointing, generation
# ----------------------------------------------------------------------------------------------------


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
        f"{type(base).__name__} and its decoder); extend ppo.models.decoder_layers for this architecture"
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


@contextlib.contextmanager
def gathered_for_generation(model: nn.Module) -> Iterator[nn.Module]:
    """Gather all sharded parameters once, for a whole ``generate`` call; reshard on exit.

    Without it, FSDP2 all-gathers every layer at every decode step. Inside, no collective runs (ranks
    may stop generating at different steps) and decoding runs at the speed of the unsharded model
    (scripts/bench_rollout.py):

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


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameters (full sizes, also when sharded; tied weights counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
