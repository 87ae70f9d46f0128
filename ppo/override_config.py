"""``override_config`` (``model.override_config``, ``critic.override_config``; verl's
``actor_rollout_ref.model.override_config``): fields of a Hugging Face model config set before the weights
load, read and applied as verl's ``HFModelConfig`` and ``update_model_config`` do, each field checked
against the config (a field it lacks, or a value of another type, is a ConfigError naming it).
``ppo.model_loading`` applies them at load; ``ppo.model_setup`` checks them from ``config.json`` at
start-up and picks the attention kernel an override names."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from transformers import PretrainedConfig

from ppo.config import ConfigError


@dataclass(frozen=True)
class ConfigOverride:
    """A ``model.override_config`` (or ``critic.override_config``) read as verl reads it."""

    fields: Mapping[str, Any]
    """Fields set on the Hugging Face config (``apply_override_config``)."""
    key: str
    """The config key of ``fields``, for messages: ``model.override_config`` (with ``.model_config``
    under verl's Megatron-style nesting)."""
    attn_implementation: str | None = None
    """verl's ``override_config.attn_implementation``: the attention kernel of this model, if given."""


def parse_override_config(override: Mapping[str, Any], key: str) -> ConfigOverride:
    """Split an ``override_config`` as verl's ``HFModelConfig`` does: ``attn_implementation`` picks the
    attention kernel; a ``model_config`` mapping, when present, holds the config fields (verl then reads
    nothing else beside it, so another key there is an error naming it); otherwise every key is a field."""
    fields = {k: v for k, v in override.items() if k != "attn_implementation"}
    attn = override.get("attn_implementation")
    if attn is not None and not isinstance(attn, str):
        raise ConfigError(f"{key}.attn_implementation: expected a kernel name, got {attn!r}")
    if "model_config" not in fields:
        return ConfigOverride(fields=fields, key=key, attn_implementation=attn)
    nested = fields.pop("model_config")
    if fields:
        raise ConfigError(
            f"{key}: {', '.join(sorted(fields))} beside model_config, whose fields are the only ones verl "
            f"applies; move them under {key}.model_config (or drop the model_config level)"
        )
    if not isinstance(nested, Mapping):
        raise ConfigError(f"{key}.model_config: expected a mapping of config fields, got {nested!r:.80}")
    return ConfigOverride(fields=dict(nested), key=f"{key}.model_config", attn_implementation=attn)


def apply_override_config(
    config: PretrainedConfig, override: Mapping[str, Any], key: str, *, where: str
) -> None:
    """Set each field of ``override`` on ``config``, as verl's ``update_model_config`` does: a mapping given
    for a sub-config (``text_config``) sets its fields one by one, a mapping given for a dict-valued field
    (``rope_parameters``, ``rope_scaling``) is merged into the current dict, anything else replaces the
    value. A field the config does not have, or a value of another type than the field's (an int for an
    int field, a number for a float), is a ConfigError naming ``key.field`` and the config (``where``)."""
    for name, value in override.items():
        field_key = f"{key}.{name}"
        if not _has_field(config, name):
            raise ConfigError(
                f"{field_key}: the model config ({type(config).__name__} at {where}) has no such field"
                f"{_field_hint(config, name, key)}"
            )
        current = getattr(config, name)
        if isinstance(current, PretrainedConfig) and isinstance(value, Mapping):
            apply_override_config(current, value, field_key, where=where)
        elif isinstance(current, dict) and isinstance(value, Mapping):
            setattr(config, name, merge_fields(current, value, field_key))
        else:
            setattr(config, name, _checked_value(current, value, field_key))


def _has_field(config: PretrainedConfig, name: str) -> bool:
    """A public field of the config (one ``to_dict`` writes) or a settable property (``rope_scaling``)."""
    if name.startswith("_"):
        return False
    attr = getattr(type(config), name, None)
    return name in config.to_dict() or (isinstance(attr, property) and attr.fset is not None)


def _field_hint(config: PretrainedConfig, name: str, key: str) -> str:
    """Where the field is after all: a close name, a key of a dict-valued field (``rope_theta`` lives in
    ``rope_parameters`` since transformers 5), or a field of the text sub-config."""
    fields = [f for f in config.to_dict() if not f.startswith("_")]
    close = difflib.get_close_matches(name, fields, n=1)
    if close:
        return f"; did you mean {key}.{close[0]}?"
    for field_name in fields:
        value = getattr(config, field_name, None)
        if isinstance(value, dict) and name in value:
            return f" (it is a key of {field_name}: set {key}.{field_name}.{name})"
    text_config = config.get_text_config()
    if text_config is not config and _has_field(text_config, name):
        return f" (its text_config has it: set {key}.text_config.{name})"
    return ""


def merge_fields(current: Mapping[str, Any], new: Mapping[str, Any], key: str = "") -> dict[str, Any]:
    """``current`` updated with ``new``, nested mappings merged key by key, a value replacing one of another
    type an error naming ``key.name`` (``_checked_value``). A legacy ``type`` (the RoPE type of
    ``rope_scaling`` before transformers 5) replaces the current ``rope_type``, so that
    ``{type: yarn, factor: 4.0}`` turns a default RoPE into YaRN instead of being ignored beside it."""
    out = dict(current)
    for name, value in new.items():
        old = out.get(name)
        if isinstance(old, Mapping) and isinstance(value, Mapping):
            out[name] = merge_fields(old, value, f"{key}.{name}")
        else:
            out[name] = _checked_value(old, value, f"{key}.{name}")
    if "type" in new and "rope_type" in current and "rope_type" not in new:
        out["rope_type"] = new["type"]
    return out


def _number(value: Any) -> Any:
    """A string that spells a float (``1e6``, which YAML 1.1 reads as a string) as that float; anything
    else as it is."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _checked_value(current: Any, value: Any, key: str) -> Any:
    """``value`` for a field now holding ``current``: bool for a bool, int for an int, a number (as float,
    ``"1e6"`` included) for a float, str for a str; anything where the field is None or of another kind."""
    if current is None or value is None:
        return value
    if isinstance(current, bool):
        ok, kind = isinstance(value, bool), "true or false"
    elif isinstance(current, int):
        ok, kind = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif isinstance(current, float):
        value = _number(value)
        ok, kind = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
        value = float(value) if ok else value
    elif isinstance(current, str):
        ok, kind = isinstance(value, str), "a string"
    else:
        return value
    if not ok:
        raise ConfigError(f"{key}: expected {kind} (the config holds {current!r}), got {value!r:.80}")
    return value
