"""Load the four models of PPO (actor, reference, critic, reward model) and their tokenizer, with the
checks that turn a bad model folder into one error line naming the file and the config key.

- ``load_causal_lm`` (actor, reference), ``load_critic`` (backbone + token-level value head, set to zero
  where the checkpoint has none), ``load_reward_model`` (backbone + sequence score head),
  ``load_tokenizer`` (pads with EOS where it has no pad token). All go through ``from_pretrained`` and
  come back with dropout off (PPO compares train-mode forwards with the log-probs of the rollout;
  dropout would make the first ratio differ from 1).
- ``override_config`` (verl's ``override_config``: ``model.override_config``, ``critic.override_config``)
  sets fields of the Hugging Face config before the weights load, after dropout is turned off (an
  explicit dropout there is kept); a field the config does not have is a ``ConfigError`` naming it
  (``ppo.override_config.apply_override_config``). ``load_config`` does this without the weights, for
  checks at start-up.
- Before ``from_pretrained`` reads a local folder, its weight files are checked by their headers only
  (``_check_weights``): a truncated or unreadable file, or a shard its index lists and the folder lacks,
  is a ``ModelFileError`` naming the file; a path that is neither a folder nor a hub id is a
  ``ModelPathError`` (``ppo.input_paths``).
- Once the tokenizer and the model are both loaded, ``eos_token_ids`` checks that they fit together
  (``check_vocab``) and lists every id that ends a response.

How a run sets each model up from its config (LoRA, training or eval mode, sharding) is
``ppo.model_setup``, which loads through these; the forwards of the loaded models (packed rows, values,
scores) and saving are in ``ppo.models``; the sharding in ``ppo.sharding``.

Usage::

    tokenizer = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path)
    model = load_causal_lm(cfg.model.path, dtype=cfg.model.dtype, device="cpu",
                           override_config={"max_position_embeddings": 32768})
    eos_ids = eos_token_ids(tokenizer, model)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
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

from ppo.attention import PACKED_ATTENTION, VARLEN_FLASH, resolve_attn_implementation
from ppo.input_paths import ModelPathError
from ppo.input_paths import check_model_path as _check_path
from ppo.input_paths import where as _where
from ppo.override_config import apply_override_config
from ppo.sharding import torch_dtype

logger = logging.getLogger("ppo")

_RESOLVED = (PACKED_ATTENTION, VARLEN_FLASH, "flash_attention_2", "sdpa", "eager")
"""Attention names used as given: the caller resolved ``auto`` for the device the model will run on
(``model_setup.build_model`` loads on the CPU for a GPU run)."""


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


def load_config(
    path: str,
    trust_remote_code: bool = False,
    *,
    override_config: Mapping[str, Any] | None = None,
    override_key: str = "model.override_config",
    **overrides: Any,
) -> PretrainedConfig:
    """The checkpoint's config (``config.json`` only, no weights) with every dropout probability set to 0,
    then the loader's own ``overrides`` (a critic's ``num_labels``), then the user's ``override_config``
    (``apply_override_config``; checked field by field, errors name ``override_key``). The user's fields
    come last, so an explicit dropout there is what the model runs with."""
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
    apply_override_config(config, override_config or {}, override_key, where=path)
    return config


def read_config(
    path: str, *, config_key: str, trust_remote_code: bool = False, **load: Any
) -> PretrainedConfig:
    """``load_config`` of a model path as the loaders read it (``load``: ``override_config``,
    ``override_key`` and the loader's own fields), with their errors for a path that is neither a folder
    nor a hub id: the checks a run makes at start-up before any weights load."""
    path = _check_path(path, config_key)
    with _explain_missing(path, config_key):
        return load_config(path, trust_remote_code, **load)


def _from_pretrained(
    auto_cls: type,
    path: str,
    *,
    dtype: str = "float32",
    attn_implementation: str = "auto",
    trust_remote_code: bool = False,
    device: torch.device | str = "cpu",
    config_key: str,
    override_config: Mapping[str, Any] | None = None,
    override_key: str = "model.override_config",
    **config_overrides: Any,
) -> tuple[PreTrainedModel, dict[str, Any]]:
    path = _check_path(path, config_key)
    if os.path.isdir(path):
        _check_weights(path, config_key)
    with _explain_missing(path, config_key):
        config = load_config(
            path,
            trust_remote_code,
            override_config=override_config,
            override_key=override_key,
            **config_overrides,
        )
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
    would not fit large models), ``override_config`` (config fields set before the weights load, named
    ``override_key`` in errors; ``apply_override_config``). ``config_key`` names the config key in error
    messages.
    """
    model, _ = _from_pretrained(AutoModelForCausalLM, path, config_key=config_key, **load)
    return model


CRITIC_CONFIG = {"num_labels": 1, "classifier_dropout": 0.0}
"""Config fields ``load_critic`` sets: one value per token, no dropout in the value head."""


def load_critic(path: str, *, config_key: str = "critic.model_path", **load: Any) -> PreTrainedModel:
    """Critic: ``AutoModelForTokenClassification.from_pretrained(path, num_labels=1)``, one value per token.

    From a causal-LM checkpoint this is the backbone (the LM head is dropped) plus a fresh ``score``
    head, which is set to zero (weight and bias; from a reward model only the bias it lacks): the critic
    then predicts 0 for every token, so the
    first advantages are the rewards themselves and not noise from a random projection of hidden
    states whose norm grows like sqrt(hidden). The head's own dropout (``classifier_dropout``) is off
    unless ``override_config`` sets it. A saved critic loads its trained head as it is.
    """
    with _held_load_report() as held:
        model, info = _from_pretrained(
            AutoModelForTokenClassification,
            path,
            config_key=config_key,
            **CRITIC_CONFIG,
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
            f"score.{n}" for n, _ in score_head(model).named_parameters() if f"score.{n}" not in fresh
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
        for name, param in score_head(model).named_parameters()
        if f"score.{name}" in missing
    }


def score_head(model: nn.Module) -> nn.Module:
    """The ``score`` head of a critic or reward model (ValueError for an architecture without one)."""
    head = getattr(model, "score", None)
    if not isinstance(head, nn.Module):
        raise ValueError(
            f"{type(model).__name__} has no `score` head; critic and reward model need a decoder-only "
            "architecture whose *ForTokenClassification / *ForSequenceClassification head is `score`"
        )
    return head


# ----------------------------------------------------------------------------------------------------
# The tokenizer and the model together
# ----------------------------------------------------------------------------------------------------


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
