"""Loading a config: the dataclass defaults, then ``--config X.yaml``, then ``section.key=value``
overrides from the command line, into the schema of ``ppo.config``::

    cfg = load_config("configs/demo_cpu.yaml", ["actor.optim.lr=1e-5", "rollout.n=4"])
    text = to_yaml(cfg)                                      # load_config reads it back to an equal config

An override changes its key and nothing else: a section is built over the default its enclosing class
gives it (SFT's ``optim`` keeps its cosine schedule when only ``optim.lr`` is set).

Every problem is one line naming the full dotted key and where the value came from (the YAML file, or
the command line): unknown keys with the closest valid names, values that do not coerce to the field's
type, values out of range (NaN and ±inf are rejected for every float), and, with file, line and column,
duplicate YAML keys and malformed YAML. All the keys and values of one load that cannot be taken are
reported together, one line each.

verl's spellings: a PPO config also takes the keys of verl's ``ppo_trainer.yaml`` (``ppo.verl_keys``), so a
verl command line runs as it is: ``actor_rollout_ref.actor.optim.lr=1e-6`` is ``actor.optim.lr``,
``critic.model.path`` is ``critic.model_path``. A verl key that changes nothing here (vLLM's memory
fraction) is accepted and named in a start-up warning (``notes``); one whose meaning this trainer cannot
honour (``rollout.name=vllm``) is refused with the reason.

Importing this module costs only PyYAML and the schema, which imports no torch, so an entry point
answers ``--help`` and ``--print-config`` before its heavy imports (``ppo.cli.answer_early``). The keys of a
schema are ``ppo.config_keys``; verl's table ``ppo.verl_keys`` and its translation ``ppo.verl_translation``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from ppo.config import ConfigError, FieldError, PPOConfig
from ppo.config_keys import COMMAND_LINE, Leaf, all_keys, closest_keys, show
from ppo.verl_keys import VERL_PARENTS
from ppo.verl_translation import from_verl, renamed, verl_defaults
from ppo.yaml_text import YAMLProblem, parse, read_yaml, trailing_comment

C = typing.TypeVar("C")


class _Invalid(Exception):
    """One key or value that cannot be taken; ``load_config`` raises them all as one ConfigError."""


# ----------------------------------------------------------------------------------------------------
# Loading: defaults, then YAML, then overrides
# ----------------------------------------------------------------------------------------------------


def load_config(
    path: str | Path | None,
    overrides: list[str] | None = None,
    cls: type[C] | None = None,
    *,
    notes: list[str] | None = None,
) -> C:
    """Build ``cls`` (default ``PPOConfig``) from its defaults, then the YAML file at ``path``, then
    ``a.b.c=value`` overrides.

    Raises ConfigError naming each dotted key that cannot be taken and where it came from (unknown keys
    with the closest valid names, refused verl keys with the reason, duplicate keys, malformed YAML,
    wrong types, values out of range): one line for one problem, a list for several. verl keys that are
    accepted but do nothing here are appended to ``notes``, one message each, for the caller to log.
    """
    cls = cls or PPOConfig
    verl = cls is PPOConfig  # verl's keys are those of its PPO trainer
    descend = _sections(cls) | (VERL_PARENTS if verl else frozenset())
    leaves: list[Leaf] = []
    errors: list[str] = []
    if path is not None:
        path = Path(path)
        loaded, written = read_yaml(path)
        if loaded is None:
            loaded = {}  # an empty file or only comments
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"{path}: the top level must be a mapping of sections, got {type(loaded).__name__}"
            )
        file_leaves = _leaves(loaded, str(path), descend, verl, written=written)
        errors += _set_twice(file_leaves, path)
        leaves += file_leaves
    for item in overrides or []:
        try:
            parts, value, written = _parse_override(item)
        except _Invalid as e:
            errors.append(str(e))
            continue
        for part in reversed(parts[1:]):
            value, written = {part: value}, {part: written}
        leaves += _leaves(
            {parts[0]: value}, COMMAND_LINE, descend, verl, spelled=len(parts), written={parts[0]: written}
        )
    notes = notes if notes is not None else []
    verl_spelled = False
    if verl:
        leaves, verl_spelled = from_verl(leaves, cls, errors, notes)
    tree: dict[str, Any] = {}
    sources: dict[str, str] = {}
    texts: dict[str, Any] = {}
    for leaf in leaves:
        _merge(tree, leaf.nested(), sources, leaf.label, "", cls, errors)
        texts[leaf.key] = leaf.written
    cfg = _build(cls, tree, _Origins(sources, texts), prefix="", errors=errors)
    if errors:
        raise ConfigError(_problems(errors))
    if verl_spelled and (note := verl_defaults(cfg, leaves)):
        notes.append(note)
    return cfg


@dataclasses.dataclass
class _Origins:
    """Where each dotted key's value came from (the YAML file, the command line), and the text it was
    written as (``Leaf.written``), for ``_build`` and ``_coerce``."""

    sources: dict[str, str]
    texts: dict[str, Any]

    def source(self, dotted: str) -> str:
        return _source(self.sources, dotted)

    def text(self, dotted: str) -> Any:
        """The written text of ``dotted`` (``a.b``, ``a.b[2]``, a mapping key's entry ``a.b.name``), or None
        where it is not known (a value that verl's translation rewrote)."""
        steps = re.findall(r"\[(\d+)\]|([^.\[\]]+)", dotted)  # (index, name) pairs
        names = []
        for index, name in steps:
            if index:
                break
            names.append(name)
        for k in range(len(names), 0, -1):
            if (key := ".".join(names[:k])) not in self.texts:
                continue
            found = self.texts[key]
            for index, name in steps[k:]:
                if index and isinstance(found, list) and int(index) < len(found):
                    found = found[int(index)]
                elif name and isinstance(found, dict):
                    found = found.get(name)
                else:
                    return None
            return found
        return None


def _set_twice(leaves: list[Leaf], path: Path) -> list[str]:
    """A key a YAML file sets twice, once dotted (``algorithm.adv_estimator: grpo``) and once nested."""
    first: dict[str, str] = {}
    out = []
    for leaf in leaves:
        if first.get(leaf.key) == leaf.given:  # a key given twice in one mapping is YAML's error already
            out.append(f"{path}: {leaf.key} is set twice (once as a dotted key, once nested): keep one")
        first.setdefault(leaf.key, leaf.given)
    return out


def _problems(errors: list[str]) -> str:
    """One problem as its line; several as a list, one line each."""
    errors = list(dict.fromkeys(errors))  # the same problem reached twice is reported once
    if len(errors) == 1:
        return errors[0]
    return f"{len(errors)} problems:\n  - " + "\n  - ".join(errors)


PLACEHOLDER = re.compile(r"(?<!\$)\{[A-Za-z_][\w.-]*\}")
"""An unfilled shell or f-string placeholder in a command-line value: ``{lr}``, ``outputs/{name}``."""


def _parse_override(item: str) -> tuple[list[str], Any, Any]:
    """``a.b.c=value`` -> (["a", "b", "c"], value parsed as YAML, its written text: ``yaml_text.parse``).
    Hydra's ``+key=`` and ``++key=`` (add or force a key, as verl's examples write some) mean the same as
    ``key=`` here. A ``#`` is part of the value (``outputs/run #2``), not a YAML comment; an empty value
    (an unset shell variable), an unfilled ``{placeholder}`` and a preset file without ``--config`` are
    errors."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if key.startswith("~"):
        raise _Invalid(f"{item!r} (from {COMMAND_LINE}): Hydra's ~key deletes a key; leave it out instead")
    key = key.removeprefix("++").removeprefix("+")
    parts = key.split(".")
    if not sep and item.endswith((".yaml", ".yml")):
        raise _Invalid(f"{item!r} (from {COMMAND_LINE}) looks like a preset file: give it as --config {item}")
    if not sep or not all(parts):
        raise _Invalid(f"command-line override {item!r} must look like section.key=value")
    if not raw.strip():
        raise _Invalid(
            f"{key}= (from {COMMAND_LINE}) has no value (an unset shell variable?): give one, null for none, "
            f"or {key}=\"''\" for an empty string"
        )
    if placeholder := PLACEHOLDER.search(raw):
        raise _Invalid(
            f"{key}={raw!r} (from {COMMAND_LINE}): {placeholder.group()} is an unfilled placeholder (a shell "
            "or f-string variable that was not substituted): give the value"
        )
    try:
        value, written = parse(raw)
    except YAMLProblem as e:
        col = f" at column {e.column}" if e.column else ""
        raise _Invalid(f"{key}={raw!r} (from {COMMAND_LINE}) is not valid YAML{col}: {e}") from None
    if trailing_comment(raw):
        if isinstance(value, (dict, list)):
            raise _Invalid(
                f"{key}={raw!r} (from {COMMAND_LINE}): ' #' starts a YAML comment, which would drop the rest; "
                "quote the value"
            )
        value = written = raw.strip()  # on a command line a # is text: runs "#1" and "#2" keep two folders
    return parts, value, written


def _sections(cls: type) -> frozenset[str]:
    """The dotted keys of ``cls`` that are sections."""
    hints = typing.get_type_hints(cls)
    out = set()
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.add(f.name)
            out |= {f"{f.name}.{k}" for k in _sections(hints[f.name])}
    return frozenset(out)


def _leaves(
    tree: dict[Any, Any],
    source: str,
    descend: frozenset[str],
    verl: bool,
    given: tuple[Any, ...] = (),
    spelled: int = 0,
    written: Any = None,
) -> list[Leaf]:
    """The leaves of a mapping from ``source``, each with its written text (``written`` mirrors ``tree``).
    Only the keys in ``descend`` (sections, and with ``verl`` the sections of verl's keys) and the first
    ``spelled`` levels (an override's dotted key) are walked into; any other value, a leaf or an unknown
    key, is taken whole for ``_build`` to check, so a self-referencing YAML anchor cannot recurse without
    end. A YAML file's dotted key (``algorithm.adv_estimator: grpo``) is the nested one it spells."""
    out = []
    written = written if isinstance(written, dict) else {}
    for key, value in tree.items():
        text = written.get(str(key))
        spelled_here = spelled
        if isinstance(key, str) and "." in key and source != COMMAND_LINE and all(key.split(".")):
            *outer, key = key.split(".")
            for part in reversed([*outer[1:], key]):
                value, text = {part: value}, {part: text}
            key = outer[0]
            spelled_here = max(spelled, len(given) + len(outer) + 1)
        path = (*given, key)
        parts = renamed(path) if verl else path
        dotted = ".".join(map(str, parts))
        if isinstance(value, dict) and (len(path) < spelled_here or dotted in descend):
            out += _leaves(value, source, descend, verl, path, spelled_here, text)
        else:
            out.append(Leaf(".".join(map(str, path)), parts, value, source, text))
    return out


def _merge(
    dst: dict, src: dict, sources: dict[str, str], source: str, prefix: str, cls: type, errors: list[str]
) -> None:
    """Merge ``src`` into ``dst`` key by key, recording each dotted key's source. Only the sections of
    ``cls`` are descended into (and must be mappings); any other value is taken whole for ``_build``."""
    hints = typing.get_type_hints(cls)
    for key, value in src.items():
        dotted = f"{prefix}{key}"
        section = hints.get(key) if isinstance(key, str) else None
        if not dataclasses.is_dataclass(section) or not isinstance(value, dict):
            sources[dotted] = source  # a section's keys record their own: the others keep "the defaults"
        if typing.get_origin(section) is dict and isinstance(value, dict) and isinstance(dst.get(key), dict):
            dst[key] = _merged(dst[key], value)  # a mapping key (reward.reward_kwargs) set key by key
            continue
        if not dataclasses.is_dataclass(section):
            dst[key] = value
            continue
        if not isinstance(value, dict):
            errors.append(
                f"{dotted} is a section; got {show.repr(value)} (from {source}): set its keys, "
                f"e.g. {dotted}.<key>=value"
            )
            continue
        _merge(dst.setdefault(key, {}), value, sources, source, dotted + ".", section, errors)


def _merged(old: dict, new: dict) -> dict:
    """``new`` over ``old`` key by key, nested mappings too (a teacher's ``model_path`` and ``key`` given
    in two overrides of ``distillation.teacher_models``)."""
    out = dict(old)
    for key, value in new.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if both else value
    return out


def _source(sources: dict[str, str], dotted: str) -> str:
    dotted = dotted.partition("[")[0]  # betas[1] came from where betas came from
    while dotted:
        if dotted in sources:
            return sources[dotted]
        dotted = dotted.rpartition(".")[0]
    return "the defaults"


def _where(keys: list[str], sources: dict[str, str]) -> str:
    """``from X`` when all ``keys`` came from one place, else ``a from X; b from Y``."""
    found = {k: _source(sources, k) for k in keys}
    if len(set(found.values())) == 1:
        return f"from {found[keys[0]]}"
    return "; ".join(f"{k} from {s}" for k, s in found.items())


def _build(
    cls: type[C],
    tree: dict[str, Any],
    origins: _Origins,
    prefix: str,
    base: Any = None,
    root: type | None = None,
    *,
    errors: list[str],
) -> C | None:
    """``cls`` with the values of ``tree`` set over ``base`` (its default where the enclosing class's
    default gave one, e.g. SFT's cosine ``optim``; the root has none and starts from its own defaults).

    A nested section's base is ``base``'s value for that field, or the enclosing class's field default:
    never a built root, whose ``__post_init__`` has already resolved fallbacks from other keys.

    Every key or value that cannot be taken is appended to ``errors`` (all sections are checked); a
    section with a problem is not built, and None is returned in its place.
    """
    root = root or cls
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    before = len(errors)
    for key in tree:
        if key not in fields:
            dotted = f"{prefix}{key}"
            close = closest_keys(dotted, all_keys(root))
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            errors.append(f"unknown config key {dotted!r} (from {origins.source(dotted)}){hint}")
    kwargs: dict[str, Any] = {}
    for key, value in tree.items():
        if key not in fields:
            continue
        dotted = f"{prefix}{key}"
        typ = hints[key]
        if dataclasses.is_dataclass(typ):  # _merge made sure that value is a dict
            inner = getattr(base, key) if base is not None else _field_default(fields[key])
            kwargs[key] = _build(typ, value, origins, dotted + ".", inner, root, errors=errors)
        elif isinstance(value, dict) and typing.get_origin(typ) is not dict:
            errors.append(
                f"{dotted} is not a section (it takes {_type_name(typ)}); got {show.repr(value)} "
                f"(from {origins.source(dotted)})"
            )
        else:
            try:
                kwargs[key] = _coerce(value, typ, dotted, origins)
            except _Invalid as e:
                errors.append(str(e))
    if len(errors) > before:
        return None
    try:
        return cls(**kwargs) if base is None else dataclasses.replace(base, **kwargs)
    except FieldError as e:
        keys = [f"{prefix}{k}" for k in e.keys]
        errors.append(f"{prefix}{e} ({_where(keys, origins.sources)})")
        return None


def _field_default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _coerce(value: Any, typ: Any, dotted: str, origins: _Origins) -> Any:
    """Convert ``value`` to ``typ`` (bool, int, float, str, Literal, Optional, list) or fail clearly.
    A float must be finite: NaN and ±inf are rejected for every float key."""

    def fail() -> typing.NoReturn:
        message = (
            f"{dotted}={show.repr(value)} (from {origins.source(dotted)}) is not a valid {_type_name(typ)}"
        )
        if isinstance(value, bool) and "str" in _type_name(typ):  # YAML 1.1 reads off and no as false
            key, _, index = dotted.partition("[")
            quoted = f"{key}=['off', ...]" if index else f"{key}='off'"
            message += (
                f": YAML read the word as the boolean {str(value).lower()} (off, no, false; on, yes, "
                f"true); quote it: 'off' in a YAML file, \"{quoted}\" on the command line"
            )
            if dotted == "trainer.resume_mode":
                message += "; trainer.resume_mode takes auto, disable or a checkpoint folder"
        raise _Invalid(message)

    origin = typing.get_origin(typ)
    args = typing.get_args(typ)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:  # an optional: the error of its one type says more (e.g. "not finite")
            return _coerce(value, rest[0], dotted, origins)
        for a in rest:
            try:
                return _coerce(value, a, dotted, origins)
            except _Invalid:
                pass
        fail()
    if origin is Literal:
        if value in args:
            return value
        raise _Invalid(
            f"{dotted}={show.repr(value)} (from {origins.source(dotted)}) must be one of "
            f"{', '.join(map(str, args))}"
        )
    if origin is dict:
        if value is None:
            return {}
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            fail()
        return {k: _coerce(v, args[1], f"{dotted}.{k}", origins) for k, v in value.items()}
    if origin is list:
        if args[0] is str and isinstance(value, str) and _comma_list(value):
            raise _Invalid(
                f"{dotted}={value!r} (from {origins.source(dotted)}) is one string, not a list: write "
                f"[{value}] (Hydra reads a,b as a sweep, which is not run here); one name that holds a "
                f"comma: \"{dotted}=['{value}']\""
            )
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            value = [value]  # a single file or number where a list is expected
        if not isinstance(value, list):
            fail()
        return [_coerce(v, args[0], f"{dotted}[{i}]", origins) for i, v in enumerate(value)]
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        fail()
    if typ is int:
        if isinstance(value, bool):
            fail()
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                f = float(value)
            except ValueError:
                fail()
            if f.is_integer():
                return int(f)
        fail()
    if typ is float:
        if isinstance(value, bool):
            fail()
        if not isinstance(value, (int, float, str)):
            fail()
        try:
            number = float(value)  # YAML 1.1 reads 1e-5 (no dot) as a string
        except (ValueError, OverflowError):  # not a number; an int beyond the float range
            fail()
        if not math.isfinite(number):
            raise _Invalid(
                f"{dotted}={show.repr(value)} (from {origins.source(dotted)}) must be a finite number"
            )
        return number
    if typ is str:
        text = origins.text(dotted)
        if isinstance(value, bool) and dotted == "trainer.resume_mode":
            fail()  # resume_mode=false means disable, not a checkpoint folder named "false"
        if isinstance(value, (bool, int, float)) and isinstance(text, str):
            return text  # as typed: YAML 1.1 reads 010 as 8, 1.10 as 1.1 and off as false
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        fail()
    if typ is Any:
        return value
    fail()


def _comma_list(value: str) -> bool:
    """Whether ``value`` reads as Hydra's comma list ``a.parquet,b.parquet``: two or more words, no spaces."""
    parts = value.split(",")
    return len(parts) > 1 and all(part and not any(c.isspace() for c in part) for part in parts)


def _type_name(typ: Any) -> str:
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(typ))
    if origin is list:
        return f"list of {_type_name(typing.get_args(typ)[0])}"
    if origin is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(typ)))
    if origin is dict:
        return "mapping of names to values"
    if typ is type(None):
        return "null"
    return getattr(typ, "__name__", str(typ))


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain nested dicts (for YAML and logging)."""
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Any) -> str:
    """The resolved config as YAML that ``load_config`` reads back to an equal config."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)
