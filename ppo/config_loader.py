"""Loading a config: the dataclass defaults, then ``--config X.yaml``, then ``section.key=value``
overrides from the command line, into the schema of ``ppo.config``::

    cfg = load_config("configs/demo_cpu.yaml", ["actor.optim.lr=1e-5", "rollout.n=4"])
    cfg, args = parse_cli(sys.argv[1:], PPOConfig)          # what every entry point does
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

Importing this module costs only argparse and PyYAML: ``ppo.config`` (and with it torch) loads with the
first config, so an entry point answers ``--help`` before its heavy imports (``answer_early``).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import reprlib
import sys
import types
import typing
from collections.abc import Hashable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml

from ppo.verl_keys import (
    VERL_DEFAULTS,
    VERL_KEYS,
    VERL_MAPPINGS,
    VERL_ONLY,
    VERL_PARENTS,
    VerlKey,
    renamed,
    renamed_to,
)

if TYPE_CHECKING:
    from ppo.config import ConfigError, PPOConfig

# repr for error messages, cut short so that a huge value (a YAML alias bomb) stays one short line.
_show = reprlib.Repr()
_show.maxstring = _show.maxother = 80

C = typing.TypeVar("C")
COMMAND_LINE = "the command line"


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
    # ppo.config imports torch: loaded here, with the first config, not when this module is imported.
    from ppo.config import ConfigError, PPOConfig

    cls = cls or PPOConfig
    verl = cls is PPOConfig  # verl's keys are those of its PPO trainer
    descend = _sections(cls) | (VERL_PARENTS if verl else frozenset())
    leaves: list[_Leaf] = []
    errors: list[str] = []
    if path is not None:
        path = Path(path)
        try:
            loaded = _read_yaml(path)
        except _Invalid as e:
            raise ConfigError(str(e)) from None
        if loaded is None:
            loaded = {}  # an empty file or only comments
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"{path}: the top level must be a mapping of sections, got {type(loaded).__name__}"
            )
        leaves += _leaves(loaded, str(path), descend, verl)
    for item in overrides or []:
        try:
            parts, value = _parse_override(item)
        except _Invalid as e:
            errors.append(str(e))
            continue
        for part in reversed(parts[1:]):
            value = {part: value}
        leaves += _leaves({parts[0]: value}, COMMAND_LINE, descend, verl, spelled=len(parts))
    notes = notes if notes is not None else []
    verl_spelled = False
    if verl:
        leaves, verl_spelled = _from_verl(leaves, cls, errors, notes)
    tree: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for leaf in leaves:
        _merge(tree, leaf.nested(), sources, leaf.label, "", cls, errors)
    cfg = _build(cls, tree, sources, prefix="", errors=errors)
    if errors:
        raise ConfigError(_problems(errors))
    if verl_spelled and (note := _verl_defaults(cfg, leaves)):
        notes.append(note)
    return cfg


def _problems(errors: list[str]) -> str:
    """One problem as its line; several as a list, one line each."""
    errors = list(dict.fromkeys(errors))  # the same problem reached twice is reported once
    if len(errors) == 1:
        return errors[0]
    return f"{len(errors)} problems:\n  - " + "\n  - ".join(errors)


def _parse_override(item: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a", "b", "c"], value parsed as YAML). Hydra's ``+key=`` and ``++key=``
    (add or force a key, as verl's examples write some) mean the same as ``key=`` here."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if key.startswith("~"):
        raise _Invalid(f"{item!r} (from {COMMAND_LINE}): Hydra's ~key deletes a key; leave it out instead")
    key = key.removeprefix("++").removeprefix("+")
    parts = key.split(".")
    if not sep or not all(parts):
        raise _Invalid(f"command-line override {item!r} must look like section.key=value")
    try:
        value: Any = _parse_yaml(raw) if raw.strip() else ""
    except _YAMLProblem as e:
        col = f" at column {e.column}" if e.column else ""
        raise _Invalid(f"{key}={raw!r} (from {COMMAND_LINE}) is not valid YAML{col}: {e}") from None
    return parts, value


@dataclasses.dataclass
class _Leaf:
    """One value as given: a leaf key of the file or the command line, or a whole value under a key
    that is no section."""

    given: str
    """The dotted key as written (verl's spelling, or ours)."""
    parts: tuple[Any, ...]
    """The key in this trainer's names (verl's section names renamed); parts of a YAML key may be any
    scalar."""
    value: Any
    source: str
    """The YAML file, or the command line."""

    @property
    def key(self) -> str:
        return ".".join(map(str, self.parts))

    @property
    def label(self) -> str:
        """Where the value came from, with the spelling it was given in when that was another."""
        return self.source if self.given == self.key else f"{self.source}, as {self.given}"

    def nested(self) -> dict[Any, Any]:
        value = self.value
        for part in reversed(self.parts[1:]):
            value = {part: value}
        return {self.parts[0]: value}


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
) -> list[_Leaf]:
    """The leaves of a mapping from ``source``. Only the keys in ``descend`` (sections, and with
    ``verl`` the sections of verl's keys) and the first ``spelled`` levels (an override's dotted key)
    are walked into; any other value, a leaf or an unknown key, is taken whole for ``_build`` to check,
    so a self-referencing YAML anchor cannot recurse without end."""
    out = []
    for key, value in tree.items():
        path = (*given, key)
        parts = renamed(path) if verl else path
        dotted = ".".join(map(str, parts))
        if isinstance(value, dict) and (len(path) < spelled or dotted in descend):
            out += _leaves(value, source, descend, verl, path, spelled)
        else:
            out.append(_Leaf(".".join(map(str, path)), parts, value, source))
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that fails on a key given twice in one mapping (PyYAML keeps the last)."""

    def construct_document(self, node: yaml.Node) -> Any:
        self._document = node  # where construct_mapping looks up the dotted key of a duplicate
        return super().construct_document(node)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor` merges may be overridden by the mapping's own keys
            key = self.construct_object(key_node, deep=True)
            try:
                line = first_line.get(key)
            except TypeError:
                continue  # an unhashable key: the base class reports it
            if line is not None:
                path = _node_path(self._document, node)
                dotted = f"{path}.{key}" if path else str(key)
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {dotted!r} (first set on line {line})", key_node.start_mark
                )
            first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def _node_path(root: yaml.Node, target: yaml.Node) -> str:
    """The dotted key of the mapping ``target`` within the composed YAML document ``root``."""
    stack: list[tuple[yaml.Node, str]] = [(root, "")]
    seen: set[int] = set()
    while stack:
        node, path = stack.pop()
        if node is target:
            return path
        if id(node) in seen:
            continue  # an alias of a node already walked
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            stack.extend((v, f"{path}.{k.value}" if path else str(k.value)) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node.value))
    return ""


def _read_yaml(path: Path) -> Any:
    """The YAML document in the file at ``path``; any problem with it is a one-line ConfigError."""
    if path.is_dir():
        raise _Invalid(f"config file {path} is a directory, not a YAML file")
    if not path.is_file():
        raise _Invalid(f"config file {path} does not exist")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise _Invalid(f"config file {path} cannot be read: {e.strerror}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise _Invalid(
            f"{path}, line {line}: not UTF-8 text (byte {raw[e.start]:#04x}); save the file as UTF-8"
        ) from None
    try:
        return _parse_yaml(text)
    except _YAMLProblem as e:
        at = f", line {e.line}" + (f", column {e.column}" if e.column else "") if e.line else ""
        raise _Invalid(f"{path}{at}: {e}") from None


class _YAMLProblem(Exception):
    """Why a text is not valid YAML, and where (1-based line and column, or None)."""

    def __init__(self, problem: str, line: int | None = None, column: int | None = None) -> None:
        super().__init__(problem)
        self.line, self.column = line, column


def _parse_yaml(text: str) -> Any:
    """``text`` parsed by :class:`_UniqueKeyLoader`; any problem (syntax, tabs, a duplicate key, a
    character YAML forbids, nesting deep enough to exhaust the stack) is a :class:`_YAMLProblem`."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        problem = e.problem or e.context or "invalid YAML"
        if "'\\t'" in problem:
            problem += " (indent with spaces, not tabs)"
        elif e.context and e.problem:
            problem = f"{e.problem} ({e.context})"
        raise _YAMLProblem(problem, *((mark.line + 1, mark.column + 1) if mark else ())) from None
    except yaml.reader.ReaderError as e:
        line = text.count("\n", 0, e.position) + 1
        raise _YAMLProblem(f"character #x{e.character:04x} is not allowed in YAML", line) from None
    except yaml.YAMLError as e:
        raise _YAMLProblem(" ".join(str(e).split())) from None
    except RecursionError:
        raise _YAMLProblem("nested too deeply") from None
    except (ValueError, OverflowError) as e:  # a scalar the constructor rejects (an int of 5000 digits)
        raise _YAMLProblem(" ".join(str(e).split())) from None


def _merge(
    dst: dict, src: dict, sources: dict[str, str], source: str, prefix: str, cls: type, errors: list[str]
) -> None:
    """Merge ``src`` into ``dst`` key by key, recording each dotted key's source. Only the sections of
    ``cls`` are descended into (and must be mappings); any other value is taken whole for ``_build``."""
    hints = typing.get_type_hints(cls)
    for key, value in src.items():
        dotted = f"{prefix}{key}"
        section = hints.get(key) if isinstance(key, str) else None
        sources[dotted] = source
        if typing.get_origin(section) is dict and isinstance(value, dict) and isinstance(dst.get(key), dict):
            dst[key] = {**dst[key], **value}  # a mapping key (reward.reward_kwargs) set key by key
            continue
        if not dataclasses.is_dataclass(section):
            dst[key] = value
            continue
        if not isinstance(value, dict):
            errors.append(
                f"{dotted} is a section; got {_show.repr(value)} (from {source}): set its keys, "
                f"e.g. {dotted}.<key>=value"
            )
            continue
        _merge(dst.setdefault(key, {}), value, sources, source, dotted + ".", section, errors)


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


def all_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of a config class, sections included."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        dotted = f"{prefix}{f.name}"
        keys.append(dotted)
        if dataclasses.is_dataclass(hints[f.name]):
            keys.extend(all_keys(hints[f.name], dotted + "."))
    return keys


def _build(
    cls: type[C],
    tree: dict[str, Any],
    sources: dict[str, str],
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
    from ppo.config import FieldError  # loaded already: cls is one of its classes

    root = root or cls
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    before = len(errors)
    for key in tree:
        if key not in fields:
            dotted = f"{prefix}{key}"
            close = closest_keys(dotted, all_keys(root))
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            errors.append(f"unknown config key {dotted!r} (from {_source(sources, dotted)}){hint}")
    kwargs: dict[str, Any] = {}
    for key, value in tree.items():
        if key not in fields:
            continue
        dotted = f"{prefix}{key}"
        typ = hints[key]
        if dataclasses.is_dataclass(typ):  # _merge made sure that value is a dict
            inner = getattr(base, key) if base is not None else _field_default(fields[key])
            kwargs[key] = _build(typ, value, sources, dotted + ".", inner, root, errors=errors)
        elif isinstance(value, dict) and typing.get_origin(typ) is not dict:
            errors.append(
                f"{dotted} is not a section (it takes {_type_name(typ)}); got {_show.repr(value)} "
                f"(from {_source(sources, dotted)})"
            )
        else:
            try:
                kwargs[key] = _coerce(value, typ, dotted, sources)
            except _Invalid as e:
                errors.append(str(e))
    if len(errors) > before:
        return None
    try:
        return cls(**kwargs) if base is None else dataclasses.replace(base, **kwargs)
    except FieldError as e:
        keys = [f"{prefix}{k}" for k in e.keys]
        errors.append(f"{prefix}{e} ({_where(keys, sources)})")
        return None


def _field_default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def closest_keys(dotted: str, keys: list[str], n: int = 3) -> list[str]:
    """Valid keys closest to a wrong one: by the whole dotted name, then by its last part alone
    (``actor.kl_coef`` finds ``actor.kl_loss_coef`` and ``algorithm.kl_ctrl.kl_coef``)."""
    close = difflib.get_close_matches(dotted, keys, n=n, cutoff=0.6)
    leaf = dotted.rpartition(".")[2]
    by_leaf = {k.rpartition(".")[2]: [] for k in keys}
    for k in keys:
        by_leaf[k.rpartition(".")[2]].append(k)
    for name in difflib.get_close_matches(leaf, list(by_leaf), n=n, cutoff=0.75):
        close += [k for k in by_leaf[name] if k not in close]
    return close[: n + 1]


def _coerce(value: Any, typ: Any, dotted: str, sources: dict[str, str]) -> Any:
    """Convert ``value`` to ``typ`` (bool, int, float, str, Literal, Optional, list) or fail clearly.
    A float must be finite: NaN and ±inf are rejected for every float key."""

    def fail() -> typing.NoReturn:
        raise _Invalid(
            f"{dotted}={_show.repr(value)} (from {_source(sources, dotted)}) is not a valid {_type_name(typ)}"
        )

    origin = typing.get_origin(typ)
    args = typing.get_args(typ)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:  # an optional: the error of its one type says more (e.g. "not finite")
            return _coerce(value, rest[0], dotted, sources)
        for a in rest:
            try:
                return _coerce(value, a, dotted, sources)
            except _Invalid:
                pass
        fail()
    if origin is Literal:
        if value in args:
            return value
        raise _Invalid(
            f"{dotted}={_show.repr(value)} (from {_source(sources, dotted)}) must be one of "
            f"{', '.join(map(str, args))}"
        )
    if origin is dict:
        if value is None:
            return {}
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            fail()
        return {k: _coerce(v, args[1], f"{dotted}.{k}", sources) for k, v in value.items()}
    if origin is list:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            value = [value]  # a single file or number where a list is expected
        if not isinstance(value, list):
            fail()
        return [_coerce(v, args[0], f"{dotted}[{i}]", sources) for i, v in enumerate(value)]
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
                f"{dotted}={_show.repr(value)} (from {_source(sources, dotted)}) must be a finite number"
            )
        return number
    if typ is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        fail()
    if typ is Any:
        return value
    fail()


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


# ----------------------------------------------------------------------------------------------------
# verl's spellings (the table is ppo.verl_keys)
# ----------------------------------------------------------------------------------------------------


def _verl_key(key: str) -> VerlKey | None:
    """The entry of ``VERL_KEYS`` for ``key``: its own, or that of the deepest entry over it (a
    ``section.*``, or a key whose value is a mapping: ``model.override_config``)."""
    if key in VERL_KEYS:
        return VERL_KEYS[key]
    parts = key.split(".")
    for n in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:n])
        over = VERL_KEYS.get(prefix)
        if prefix + ".*" in VERL_KEYS:
            return VERL_KEYS[prefix + ".*"]
        if over is not None and over.ours is None:
            return over
        if over is not None and prefix in VERL_MAPPINGS:  # a key inside a renamed mapping
            return renamed_to(over.ours + key[len(prefix) :])
    return VERL_KEYS.get(key + ".*")


def _among(value: Any, values: tuple[Any, ...]) -> bool:
    """``value in values`` where True is not 1 and False is not 0."""
    return any(type(value) is type(v) and value == v for v in values) or (
        isinstance(value, float) and any(type(v) is int and value == v for v in values)
    )


def _optional(cls: type, dotted: str) -> bool:
    """Whether the field at ``dotted`` in ``cls`` takes null."""
    typ: Any = cls
    for part in dotted.split("."):
        typ = typing.get_type_hints(typ)[part]
    return type(None) in typing.get_args(typ)


def _from_verl(
    leaves: list[_Leaf], cls: type, errors: list[str], notes: list[str]
) -> tuple[list[_Leaf], bool]:
    """``leaves`` in our keys: verl's renamed (``VERL_KEYS``), those that change nothing here dropped
    with a message in ``notes``, those that cannot be taken dropped with one in ``errors``. Our own keys
    and unknown ones pass through (``_build`` names the unknown). Also whether any key was verl's."""
    out = []
    verl_spelled = False
    our_keys = set(all_keys(cls))
    ignored: dict[str, list[str]] = {}  # reason -> the keys it covers, for one warning each
    for leaf in _combine(leaves, errors, notes):
        key = leaf.key
        rule = _verl_key(key)
        if rule is not None and key in our_keys and (rule.ours is None or leaf.given == key):
            # Our key, written our way (verl's values apply to verl's spelling: rollout.top_k=-1 is an
            # error, actor_rollout_ref.rollout.top_k=-1 our 0), or ours since the table was written.
            rule = None
        shown = f"{leaf.given}={_show.repr(leaf.value)} (from {leaf.source})"
        if isinstance(leaf.value, str) and "${" in leaf.value:  # any key: verl's YAML files have them
            errors.append(f"{shown}: an OmegaConf interpolation, which is not resolved here; give the value")
            continue
        if rule is None:
            if leaf.parts[0] in VERL_ONLY:
                close = closest_keys(key, list(VERL_KEYS) + all_keys(cls))
                hint = f"; did you mean {' or '.join(close)}?" if close else ""
                errors.append(
                    f"unknown config key {leaf.given!r} (from {leaf.source}): not a key of verl's{hint}"
                )
            else:
                out.append(leaf)
            continue
        verl_spelled |= rule.ours != key or leaf.given != key
        value = leaf.value
        if _among(value, rule.harmless):
            continue
        elif rule.ours is not None:
            value = rule.values.get(value, value) if isinstance(value, Hashable) else value
            if value is None and not _optional(cls, rule.ours):
                continue  # verl's null: "derive it"; here the field's default does
            out.append(_Leaf(leaf.given, tuple(rule.ours.split(".")), value, leaf.source))
        elif rule.ignored is True or (rule.ignored and _among(value, rule.ignored)):
            ignored.setdefault(rule.reason, []).append(shown)
        else:
            errors.append(f"{shown}: {rule.reason}")
    for reason, shown_keys in ignored.items():
        notes.append(f"{', '.join(shown_keys)} {'is' if len(shown_keys) == 1 else 'are'} ignored: {reason}")
    return out, verl_spelled


def _verl_defaults(cfg: PPOConfig, leaves: list[_Leaf]) -> str | None:
    """The warning that names the keys of ``VERL_DEFAULTS`` that this run uses, leaves unset and has
    another default than verl's; None when there are none."""
    given = {".".join(map(str, leaf.parts[:n])) for leaf in leaves for n in range(1, len(leaf.parts) + 1)}
    unused = {"critic": not cfg.use_critic, "ref": not cfg.needs_reference}
    defaults = type(cfg)()
    differ = []
    for key, verl_value in VERL_DEFAULTS.items():
        mine: Any = defaults
        for part in key.split("."):
            mine = getattr(mine, part)
        if key not in given and mine != verl_value and not unused.get(key.partition(".")[0]):
            differ.append(f"{key}={mine} (verl: {verl_value})")
    if not differ:
        return None
    return (
        "verl's defaults differ from this trainer's for keys this config leaves unset: "
        + ", ".join(differ)
        + "; set them to train as verl would"
    )


def _combine(leaves: list[_Leaf], errors: list[str], notes: list[str]) -> list[_Leaf]:
    """verl's keys whose meaning here takes two of them, as ours: ``custom_reward_function.path`` and
    ``.name`` make ``reward.custom_function=path:name``; ``trainer.resume_mode=resume_path`` with
    ``trainer.resume_from_path=P`` makes ``trainer.resume_mode=P``; ``max_actor_ckpt_to_keep`` and
    ``max_critic_ckpt_to_keep`` make ``trainer.max_ckpt_to_keep``; ``optimizer_offload=true`` (or
    ``grad_offload``) is what ``param_offload=true`` does here, so it is accepted beside it."""
    last = {leaf.key: leaf for leaf in leaves}  # a later value of a key wins, as for every key
    taken = {
        "custom_reward_function.path",
        "custom_reward_function.name",
        "trainer.resume_from_path",
        "trainer.max_actor_ckpt_to_keep",
        "trainer.max_critic_ckpt_to_keep",
    }
    out = []
    for leaf in leaves:
        key = leaf.key
        if key.endswith((".optimizer_offload", ".grad_offload")) and leaf.value is True:
            fsdp = key.rpartition(".")[0]
            role = fsdp.removesuffix(".fsdp_config").removesuffix(".model")
            offload = [
                last[k].value
                for k in (f"{fsdp}.param_offload", f"{fsdp}.offload_policy", f"{role}.fsdp.param_offload")
                if k in last
            ]
            if True in offload:
                continue
        if key == "trainer.resume_mode" and leaf.value == "resume_path":
            path = last.get("trainer.resume_from_path")
            if path is None or path.value is None:
                errors.append(
                    f"trainer.resume_mode=resume_path (from {leaf.source}) needs trainer.resume_from_path "
                    f"(or give the checkpoint's path as trainer.resume_mode)"
                )
                continue
            leaf = _Leaf(
                "trainer.resume_mode and trainer.resume_from_path", leaf.parts, path.value, path.source
            )
        if key not in taken:
            out.append(leaf)
    path, name = last.get("custom_reward_function.path"), last.get("custom_reward_function.name")
    if path is not None and path.value is not None:
        function = name.value if name is not None and name.value is not None else "compute_score"
        given = "custom_reward_function.path" + (" and .name" if name is not None else "")
        spec = f"{os.path.expanduser(str(path.value))}:{function}"
        out.append(_Leaf(given, ("reward", "custom_function"), spec, path.source))
    elif name is not None and name.value not in (None, "compute_score"):
        notes.append(
            f"custom_reward_function.name={name.value!r} (from {name.source}) is ignored: no "
            f"custom_reward_function.path names the file it is in"
        )
    resume_from = last.get("trainer.resume_from_path")
    resume_mode = last.get("trainer.resume_mode")
    if (
        resume_from is not None
        and resume_from.value is not None
        and (resume_mode is None or resume_mode.value != "resume_path")
    ):
        notes.append(
            f"trainer.resume_from_path={resume_from.value!r} (from {resume_from.source}) is ignored: as in verl, "
            f"it is read only with trainer.resume_mode=resume_path"
        )
    keep = [
        last[k] for k in ("trainer.max_actor_ckpt_to_keep", "trainer.max_critic_ckpt_to_keep") if k in last
    ]
    keep = [leaf for leaf in keep if leaf.value is not None]
    if len({repr(leaf.value) for leaf in keep}) > 1:
        errors.append(
            "trainer.max_actor_ckpt_to_keep and trainer.max_critic_ckpt_to_keep differ "
            f"({keep[0].value} and {keep[1].value}): one checkpoint holds both here; set trainer.max_ckpt_to_keep"
        )
    elif keep:
        out.append(_Leaf(keep[0].given, ("trainer", "max_ckpt_to_keep"), keep[0].value, keep[0].source))
    return out


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain nested dicts (for YAML and logging)."""
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Any) -> str:
    """The resolved config as YAML that ``load_config`` reads back to an equal config."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


# ----------------------------------------------------------------------------------------------------
# The command line every entry point shares
# ----------------------------------------------------------------------------------------------------

OVERRIDES_HELP = """\
overrides: section.key=value, values parsed as YAML (true, [1,5], null, 1e-6); they win over --config.
PPO also takes verl's spellings: actor_rollout_ref.actor.optim.lr=1e-6 is actor.optim.lr, and a verl
key that changes nothing here (rollout.gpu_memory_utilization) is named in a start-up warning."""


def command_line(description: str) -> argparse.ArgumentParser:
    """The parser of every entry point: ``--config X.yaml``, ``key.sub=value`` overrides,
    ``--print-config`` and ``--world-size N``; ``description`` (the script's docstring, examples
    included) is shown as written."""
    parser = argparse.ArgumentParser(
        description=description,
        epilog=OVERRIDES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", default=None, help="YAML preset over the defaults")
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config (validated) and exit"
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="with --print-config: validate for this many ranks (default: trainer.nnodes x "
        "trainer.n_gpus_per_node where a preset sets them)",
    )
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides (see below)")
    return parser


def parse_cli(
    argv: list[str] | None, cls: type[C] | None = None, description: str = ""
) -> tuple[C, argparse.Namespace]:
    """The command line every entry point shares (``command_line``), loaded into ``cls`` (default
    ``PPOConfig``). ``args.notes`` lists the keys that were accepted but do nothing here, for the caller
    to log once."""
    from ppo.config import ConfigError

    args = command_line(description).parse_args(argv)
    if args.world_size is not None and args.world_size < 1:
        raise ConfigError(f"--world-size must be >= 1, got {args.world_size} (from {COMMAND_LINE})")
    args.notes = []
    return load_config(args.config, args.overrides, cls, notes=args.notes), args


def print_config(cfg: Any, args: argparse.Namespace) -> int:
    """``--print-config``: validate ``cfg`` for ``--world-size`` (a PPO preset's planned world size when
    not given), print it as YAML and the start-up warnings a run would log (on stderr); the exit code
    (0, or 2 with the problems on stderr)."""
    from ppo.config import ConfigError, PPOConfig, validate_stage

    try:
        world_size = args.world_size
        if world_size is None and isinstance(cfg, PPOConfig):
            world_size = cfg.trainer.planned_world_size
        if world_size is not None:
            cfg.validate(world_size) if isinstance(cfg, PPOConfig) else validate_stage(cfg, world_size)
    except ConfigError as e:
        return config_error(e)
    print(to_yaml(cfg), end="")
    if _is_main():
        for warning in [*args.notes, *(cfg.warnings() if isinstance(cfg, PPOConfig) else [])]:
            print(f"warning: {warning}", file=sys.stderr)
    return 0


def config_error(error: ConfigError) -> int:
    """Report a config error (on rank 0: under torchrun every rank parses alike); exit code 2."""
    if _is_main():
        print(f"config error: {error}", file=sys.stderr)
    return 2


def _is_main() -> bool:
    return os.environ.get("RANK", "0") == "0"


def answer_early(argv: list[str], description: str, schema: str) -> None:
    """``--help`` and ``--print-config``, answered before an entry point imports torch and transformers
    (seconds); exits when it answered, else returns and the run goes on. ``schema``: the name of the
    entry point's config class in ``ppo.config``, which ``--print-config`` loads.

    An entry point calls it first thing::

        if __name__ == "__main__":
            config_loader.answer_early(sys.argv[1:], __doc__, "PPOConfig")
    """
    args = command_line(description).parse_args(argv)  # --help, or a malformed command line, exits here
    if not args.print_config:
        return
    import ppo.config

    try:
        cfg, args = parse_cli(argv, getattr(ppo.config, schema), description)
    except ppo.config.ConfigError as e:
        sys.exit(config_error(e))
    sys.exit(print_config(cfg, args))
