"""Load, run and save the four models of PPO: actor, reference, critic and reward model.

- Loading: ``load_causal_lm`` (actor, reference), ``load_critic`` (backbone + token-level value head),
  ``load_reward_model`` (backbone + sequence score read at the last token), ``load_tokenizer``. All go
  through ``from_pretrained`` and come back with dropout off (PPO compares train-mode forwards with
  the log-probs of the rollout; dropout would make the first ratio differ from 1).
- Packed forwards: the tokens of ``B`` sequences concatenated into one row ``[total_tokens]`` with
  ``position_ids`` restarting at 0 per sequence and ``cu_seqlens [B+1]`` marking the boundaries. No
  attention mask and ``use_cache=False`` (with the cache on, the packing is silently ignored); the
  attention kernel for such rows lives in ``ppo.attention``, the FSDP2 sharding in ``ppo.sharding``.
- Saving: ``save_hf`` writes a ``save_pretrained`` folder from a sharded or plain model.

Every helper runs the model's own top-level ``forward`` (never ``model.model(...)``): FSDP2 gathers the
root's parameters (embeddings, final norm, head) in the root's forward pre-hook, so calling a
submodule of a sharded root would compute with the root's *shards*. Intermediate results (the final
hidden states, the per-token reward scores) are read with forward hooks instead.

Usage::

    model = load_causal_lm(cfg.model.path, dtype=cfg.model.dtype, device="cpu")
    model = sharding.shard_model(model, make_mesh(info, fsdp.fsdp_size), fsdp, device=info.device)
    logits = causal_lm_logits(model, input_ids, position_ids)  # [total_tokens, vocab]
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from ppo.attention import PACKED_ATTENTION, VARLEN_FLASH, packed_kwargs, resolve_attn_implementation
from ppo.input_paths import ModelPathError
from ppo.input_paths import check_model_path as _check_path
from ppo.input_paths import where as _where
from ppo.sharding import full_state_dict, torch_dtype

logger = logging.getLogger("ppo")

_RESOLVED = (PACKED_ATTENTION, VARLEN_FLASH, "flash_attention_2", "sdpa", "eager")
"""Attention names used as given: the caller resolved ``auto`` for the device the model will run on
(``runner.build_model`` loads on the CPU for a GPU run)."""


class ModelFileError(OSError):
    """A file of a model or tokenizer folder is missing, unreadable, truncated or malformed, or the
    tokenizer and the model do not fit together; the message names the file (or folder) and the key."""


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)
"""Files ``save_pretrained`` of a tokenizer writes (fast, sentencepiece, BPE and WordPiece tokenizers);
a local folder with none of them holds no tokenizer."""


# ----------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _explain_missing(path: str, config_key: str) -> Iterator[None]:
    """Turn transformers' OSError for an unknown hub id into a ModelPathError naming the config key."""
    try:
        yield
    except OSError as err:
        if os.path.isdir(path) or isinstance(err, ModelPathError):
            raise
        raise ModelPathError(
            f"{config_key}={path!r} is not a local folder (none at {_where(path)}) and could not be loaded "
            f"as a hub id ({err}). Set {config_key} to a save_pretrained folder."
        ) from err


def load_tokenizer(
    path: str, trust_remote_code: bool = False, *, config_key: str = "model.tokenizer_path"
) -> PreTrainedTokenizerBase:
    """``AutoTokenizer.from_pretrained(path)``; a tokenizer without a pad token pads with eos.

    The padding side is left as saved: rollout sets left padding on its own copy for generation. A local
    folder without tokenizer files, one whose files do not load, and a tokenizer with neither a pad nor
    an EOS token raise ModelFileError naming ``config_key``.
    """
    path = _check_path(path, config_key)
    local = os.path.isdir(path)
    if local and not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        raise ModelFileError(
            f"{config_key}={path!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): save the "
            f"tokenizer there (tokenizer.save_pretrained), or set model.tokenizer_path to a folder that has one"
        )
    with _explain_missing(path, config_key):
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        except Exception as err:
            if not local or isinstance(err, OSError):
                raise
            # A local folder's files are the user's input: any failure to read them is theirs to fix.
            raise ModelFileError(
                f"{config_key}={path!r}: the tokenizer files do not load ({type(err).__name__}: "
                f"{_first_line(err)})"
            ) from err
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelFileError(
                f"the tokenizer of {config_key}={path!r} has neither a pad nor an EOS token: responses could "
                f"not end, nor batches be padded; give it an eos_token (and a pad_token) and save it again"
            )
        # Padded positions are masked out everywhere, so reusing eos is safe.
        tokenizer.pad_token = tokenizer.eos_token
        logger.info("tokenizer %s has no pad token; using eos %r as pad", path, tokenizer.eos_token)
    return tokenizer


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


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
    dtype: str = "float32",
    attn_implementation: str = "auto",
    trust_remote_code: bool = False,
    device: torch.device | str = "cpu",
    config_key: str,
    **config_overrides: Any,
) -> tuple[PreTrainedModel, dict[str, Any]]:
    path = _check_path(path, config_key)
    if os.path.isdir(path):
        _check_weights(path, config_key)
    with _explain_missing(path, config_key):
        config = _load_config(path, trust_remote_code, **config_overrides)
        model, info = auto_cls.from_pretrained(
            path,
            config=config,
            dtype=torch_dtype(dtype),
            attn_implementation=attn_implementation
            if attn_implementation in _RESOLVED
            else resolve_attn_implementation(attn_implementation, device),
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
        )
    return model.to(device), info


SAFETENSORS_INDEX = "model.safetensors.index.json"
"""A sharded checkpoint's index: ``weight_map`` names the shard file of each tensor."""


def _check_weights(folder: str, config_key: str) -> None:
    """ModelFileError, naming the file and ``config_key``, for a weights file of ``folder`` that cannot be
    read, a safetensors file that is cut short or whose header is not one, or a shard its index lists
    that is missing. Reads each file's header only (a few KB), before transformers loads the weights,
    whose own errors do not name the file (truncated) or call an unreadable file missing."""
    files = [
        name
        for name in (
            "model.safetensors",
            "pytorch_model.bin",
            SAFETENSORS_INDEX,
            "pytorch_model.bin.index.json",
        )
        if os.path.isfile(os.path.join(folder, name))
    ]
    if SAFETENSORS_INDEX in files:
        index = os.path.join(folder, SAFETENSORS_INDEX)
        try:
            with open(index, "rb") as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except OSError as err:
            raise _unreadable(index, config_key, err) from err
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ModelFileError(
                f"{config_key}: {index} is not a safetensors index (a JSON object with a weight_map)"
            ) from err
        for shard in shards:
            if not os.path.isfile(os.path.join(folder, shard)):
                raise ModelFileError(
                    f"{config_key}: {os.path.join(folder, shard)} is missing ({SAFETENSORS_INDEX} lists it): "
                    f"copy or download the checkpoint again"
                )
        files += shards
    for name in files:
        file = os.path.join(folder, name)
        try:
            with open(file, "rb") as f:
                if name.endswith(".safetensors"):
                    _check_safetensors(f, os.fstat(f.fileno()).st_size, file, config_key)
                else:
                    f.read(1)
        except ModelFileError:
            raise
        except OSError as err:
            raise _unreadable(file, config_key, err) from err


def _unreadable(file: str, config_key: str, err: OSError) -> ModelFileError:
    hint = ": check its permissions" if isinstance(err, PermissionError) else ""
    return ModelFileError(f"{config_key}: {file} exists but cannot be read ({err.strerror or err}){hint}")


def _check_safetensors(f: Any, size: int, file: str, config_key: str) -> None:
    """A safetensors file is ``u64 header length n | n bytes of JSON header | data``; the header gives
    each tensor's ``data_offsets`` into the data, so the file's full size is known from its start."""
    head = f.read(8)
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if n < 0 or 8 + n > size:
        raise ModelFileError(
            f"{config_key}: {file} is truncated or not a safetensors file ({size} bytes, too short for its "
            f"header): copy or download it again"
        )
    try:
        header = json.loads(f.read(n))
        data_end = max(
            (int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0
        )
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
        raise ModelFileError(
            f"{config_key}: {file} is not a safetensors file (its header does not parse): copy or download "
            f"it again"
        ) from err
    if size < 8 + n + data_end:
        raise ModelFileError(
            f"{config_key}: {file} is truncated ({size} of {8 + n + data_end} bytes): copy or download it "
            f"again"
        )


def load_causal_lm(path: str, *, config_key: str = "model.path", **load: Any) -> PreTrainedModel:
    """Actor or reference: ``AutoModelForCausalLM.from_pretrained(path)`` in ``dtype``, dropout off.

    ``load``: ``dtype`` (default float32), ``attn_implementation`` (default auto),
    ``trust_remote_code``, ``device`` (where the weights go; default the CPU: to shard, load on the CPU
    and let ``shard_model`` move each rank's shard to the accelerator, since a full copy per accelerator
    would not fit large models). ``config_key`` names the config key in error messages.
    """
    model, _ = _from_pretrained(AutoModelForCausalLM, path, config_key=config_key, **load)
    return model


def load_critic(path: str, *, config_key: str = "critic.model_path", **load: Any) -> PreTrainedModel:
    """Critic: ``AutoModelForTokenClassification.from_pretrained(path, num_labels=1)``, one value per token.

    From a causal-LM checkpoint this is the backbone (the LM head is dropped) plus a fresh ``score``
    head, which is set to zero (weight and bias; from a reward model only the bias it lacks): the critic
    then predicts 0 for every token, so the
    first advantages are the rewards themselves and not noise from a random projection of hidden
    states whose norm grows like sqrt(hidden). The head's own dropout (``classifier_dropout``) is off.
    A saved critic loads its trained head as it is.
    """
    with _held_load_report() as held:
        model, info = _from_pretrained(
            AutoModelForTokenClassification,
            path,
            config_key=config_key,
            num_labels=1,
            classifier_dropout=0.0,
            **load,
        )
    if not _only_head_differs(info):  # the expected difference is said in one line below
        held.release()
    fresh = _fresh_head_params(model, info)
    if fresh:
        with torch.no_grad():
            for param in fresh.values():
                param.zero_()
        kept = sorted(
            f"score.{n}" for n, _ in _score_head(model).named_parameters() if f"score.{n}" not in fresh
        )
        logger.info(
            "critic from %s: initialized %s to zero (not in the checkpoint)%s",
            path,
            ", ".join(sorted(fresh)),
            f"; kept the trained {', '.join(kept)}" if kept else "",
        )
    return model


class _HeldReports(logging.Filter):
    """Holds transformers' ``LOAD REPORT`` warnings back (``release`` logs them after all)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if "LOAD REPORT" in str(record.msg):
            self.records.append(record)
            return False
        return True

    def release(self) -> None:
        for record in self.records:
            logging.getLogger(record.name).handle(record)


@contextlib.contextmanager
def _held_load_report() -> Iterator[_HeldReports]:
    """transformers' ten-line ``LOAD REPORT`` (with raw terminal colour codes) held back while a model
    loads: the caller releases it unless the only difference is the one it expects."""
    held = _HeldReports()
    source = logging.getLogger("transformers.modeling_utils")
    source.addFilter(held)
    try:
        yield held
    finally:
        source.removeFilter(held)


def _only_head_differs(info: dict[str, Any]) -> bool:
    """A causal LM loaded as a critic: the value head (``score.*``) is missing and at most the LM head
    (``lm_head.*``) is left over; nothing mismatched."""
    return (
        all(k.startswith("score.") for k in info.get("missing_keys", ()))
        and all(k.startswith("lm_head.") for k in info.get("unexpected_keys", ()))
        and not info.get("mismatched_keys")
        and not info.get("error_msgs")
    )


def load_reward_model(path: str, *, config_key: str = "reward.model_path", **load: Any) -> PreTrainedModel:
    """Reward model: ``AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)``.

    A checkpoint without a ``score`` head (a plain causal LM) gets a fresh one, drawn from a fixed
    seed with std ``initializer_range``: every rank must hold the same weights before sharding
    (``fully_shard`` keeps each rank's own slice, it does not broadcast), and transformers' random
    init differs per process. Scores are then meaningless until trained, so it logs a warning.
    """
    model, info = _from_pretrained(
        AutoModelForSequenceClassification, path, config_key=config_key, num_labels=1, **load
    )
    fresh = _fresh_head_params(model, info)
    if fresh:
        std = getattr(model.config.get_text_config(), "initializer_range", 0.02)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for _, param in sorted(fresh.items()):
                param.copy_(torch.randn(param.shape, generator=generator) * std if param.dim() > 1 else 0.0)
        logger.warning(
            "reward model %s has no trained score head (%s initialized); its scores are random",
            path,
            ", ".join(sorted(fresh)),
        )
    return model


def _fresh_head_params(model: nn.Module, info: dict[str, Any]) -> dict[str, nn.Parameter]:
    """The ``score`` head's parameters that the checkpoint did not hold (transformers initialized them
    at random), by their names in the checkpoint (``score.weight``)."""
    missing = set(info["missing_keys"])
    return {
        f"score.{name}": param
        for name, param in _score_head(model).named_parameters()
        if f"score.{name}" in missing
    }


def _score_head(model: nn.Module) -> nn.Module:
    head = getattr(model, "score", None)
    if not isinstance(head, nn.Module):
        raise ValueError(
            f"{type(model).__name__} has no `score` head; critic and reward model need a decoder-only "
            "architecture whose *ForTokenClassification / *ForSequenceClassification head is `score`"
        )
    return head


# ----------------------------------------------------------------------------------------------------
# Packed (padding-free) forwards
# ----------------------------------------------------------------------------------------------------


def _packed_inputs(
    input_ids: torch.Tensor, position_ids: torch.Tensor, offsets: list[int] | None
) -> dict[str, Any]:
    if input_ids.dim() != 1 or input_ids.shape != position_ids.shape:
        raise ValueError(
            f"packed input_ids and position_ids must both be [total_tokens]; got {tuple(input_ids.shape)} "
            f"and {tuple(position_ids.shape)}"
        )
    # No attention mask and no cache: with position ids restarting at 0 per sequence, transformers
    # attends block-diagonally (the ppo.attention kernels: per sequence); a cache would make it ignore
    # the packing (silently). ``offsets`` (host list) spare each layer finding the boundaries itself.
    inputs = {"input_ids": input_ids[None], "position_ids": position_ids[None], "use_cache": False}
    if offsets is not None:
        inputs.update(packed_kwargs(offsets, input_ids.device))
    return inputs


def causal_lm_logits(
    model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, offsets: list[int] | None = None
) -> torch.Tensor:
    """Next-token logits of packed sequences: ``[total_tokens] -> [total_tokens, vocab]``.

    In the compute dtype (bf16 under bf16 mixed precision); upcast where it matters.
    """
    return model(**_packed_inputs(input_ids, position_ids, offsets)).logits[0]


def causal_lm_hidden(
    model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, offsets: list[int] | None = None
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


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> list[int]:
    """Every id that ends a response: the tokenizer's EOS and each EOS the model's generation config
    lists (Qwen2.5-Instruct: ``<|im_end|>`` and ``<|endoftext|>``), in that order, without repeats.

    The first place every caller holds both the tokenizer and the loaded model, so it checks that they
    fit first (``check_vocab``)."""
    check_vocab(tokenizer, model)
    ids: list[int] = []
    configured = getattr(model.generation_config, "eos_token_id", None)
    configured = configured if isinstance(configured, list) else [configured]
    for token in [tokenizer.eos_token_id, *configured]:
        if token is not None and int(token) not in ids:
            ids.append(int(token))
    if not ids:
        raise ModelFileError(
            f"neither the tokenizer nor the generation config of {model.name_or_path} names an EOS token: "
            f"responses could not end; give the tokenizer an eos_token"
        )
    return ids


def check_vocab(tokenizer: PreTrainedTokenizerBase, model: nn.Module) -> None:
    """ModelFileError unless the model has an embedding row for every id of the tokenizer: an id past
    the rows fails (CPU) or corrupts memory (CUDA) in the first forward that meets it. Rows beyond the
    tokenizer (vocabularies padded to a multiple of 64) are fine."""
    weight = model.get_input_embeddings().weight  # a DTensor's shape is the whole tensor's
    rows, size = weight.shape[0], len(tokenizer)
    if size > rows:
        name = getattr(model, "name_or_path", "") or type(model).__name__
        raise ModelFileError(
            f"the model {name} embeds {rows} token ids but its tokenizer has {size} (ids {rows} to {size - 1} "
            f"cannot be embedded): use the tokenizer the model was trained with (model.tokenizer_path), or "
            f"resize the model's embeddings to the tokenizer (resize_token_embeddings(len(tokenizer)), then "
            f"save_pretrained)"
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
    critic: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, offsets: list[int] | None = None
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

    handle = _score_head(reward_model).register_forward_hook(grab)
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


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameters (full sizes, also when sharded; tied weights counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode inside (dropout off, e.g. LoRA's adapter dropout), its mode restored after:
    the no-gradient passes (generation, scoring old and reference log-probs, values) see the
    deterministic policy, so two scorings of the same tokens agree exactly."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)
