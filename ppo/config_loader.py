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

verl's spellings: a PPO config also takes the keys of verl's ``ppo_trainer.yaml`` (``VERL_KEYS``), so a
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
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml

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
        parts = _renamed(path) if verl else path
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
# verl's spellings
# ----------------------------------------------------------------------------------------------------

VERL_SECTIONS = {
    "actor_rollout_ref.actor": "actor",
    "actor_rollout_ref.rollout": "rollout",
    "actor_rollout_ref.ref": "ref",
    "actor_rollout_ref.model": "model",
    "reward_model": "reward",
}
"""verl's sections and ours of the same meaning: a key under one is first renamed into the other, then
looked up in ``VERL_KEYS`` (so ``actor.fsdp_config.param_offload``, half verl's, works too)."""


def _renamed(path: tuple[Any, ...]) -> tuple[Any, ...]:
    """A key with verl's section names (``VERL_SECTIONS``) renamed into ours."""
    if not all(isinstance(p, str) for p in path):
        return path
    dotted = ".".join(path)
    for verl, ours in VERL_SECTIONS.items():
        if dotted == verl or dotted.startswith(verl + "."):
            return tuple((ours + dotted[len(verl) :]).split("."))
    return path


@dataclasses.dataclass(frozen=True)
class VerlKey:
    """What one of verl's keys (or, ending in ``.*``, every key of a verl section) means here.

    A value in ``harmless`` states what this trainer does anyway and is accepted silently; otherwise
    the key is renamed to ``ours`` (through ``values``), or accepted and ignored with a start-up warning
    (``ignored``: True for every value, or the values it covers), or refused with ``reason``."""

    ours: str | None = None
    """Our key of the same meaning."""
    values: Mapping[Any, Any] = dataclasses.field(default_factory=dict)
    """verl's values that we spell differently (its -1 for "no top-k" is our 0)."""
    reason: str = ""
    """Why the key does not apply here (for an ignored or a refused value)."""
    harmless: tuple[Any, ...] = ()
    """Values that state what this trainer does anyway (``multi_turn.enable=false``)."""
    ignored: bool | tuple[Any, ...] = False
    """Accepted with a warning, because it changes nothing here (a vLLM memory fraction)."""


def _ours(key: str, values: Mapping[Any, Any] | None = None, harmless: tuple[Any, ...] = ()) -> VerlKey:
    return VerlKey(ours=key, values=values or {}, harmless=harmless)


def _ignored(reason: str, harmless: tuple[Any, ...] = ()) -> VerlKey:
    return VerlKey(reason=reason, ignored=True, harmless=harmless)


def _refused(reason: str, harmless: tuple[Any, ...] = (None,)) -> VerlKey:
    return VerlKey(reason=reason, harmless=harmless)


ENGINE = (
    "a setting of verl's inference engine (vLLM, SGLang); this trainer samples with Hugging Face generate "
    "on the actor's own weights, in the training processes"
)
RAY = "a Ray setting; this trainer is one SPMD program under torchrun, without Ray"
PROFILER = "verl's profiler; this trainer's is trainer.profile_steps (the torch profiler)"
PACKED = "sequences are always packed without padding here"
COMPILE = "it compiles verl's log-prob computation; here the chunked kernels (actor.kernels) compute it"
ENTROPY = "the entropy is always computed in chunks here, without the full logits (actor.kernels)"
SEEDED = "everything is seeded from trainer.seed here"
STRATEGY = "this trainer shards with FSDP2 (fully_shard per decoder layer)"
DTYPES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
"""verl's short dtype names."""


def _global_micro(ours: str) -> VerlKey:
    return _refused(
        f"verl's deprecated global micro-batch size; give {ours} (sequences per GPU) = it / the number of GPUs"
    )


def _optim(role: str) -> dict[str, VerlKey]:
    """``<role>.optim``'s keys that verl has and we spell otherwise (lr, betas, weight_decay,
    lr_warmup_steps, lr_warmup_steps_ratio and min_lr_ratio match)."""
    p = f"{role}.optim"
    adamw = "the optimizer is torch.optim.AdamW here"
    return {
        f"{p}.warmup_style": _ours(f"{p}.lr_scheduler"),
        f"{p}.lr_scheduler_type": _ours(f"{p}.lr_scheduler"),
        f"{p}.clip_grad": _ours(f"{role}.grad_clip"),
        f"{p}.total_training_steps": _ignored(
            "verl fills it in from the run's length; here the schedule follows trainer.total_training_steps"
        ),
        f"{p}.num_cycles": _refused("the cosine schedule is half a cycle here (num_cycles=0.5)", (0.5,)),
        f"{p}.optimizer": _refused(adamw, ("AdamW", "adamw")),
        f"{p}.optimizer_impl": _refused(adamw, ("torch.optim",)),
        f"{p}.override_optimizer_config": _refused(f"the optimizer takes {p}.* alone here", (None, {})),
    }


def _fsdp(verl: str, ours: str, sp_key: str | None, dtype_key: str | None) -> dict[str, VerlKey]:
    """A role's ``fsdp_config`` (``verl``) as our ``fsdp`` section (``ours``); ``sp_key``: the role's
    sequence-parallel size; ``dtype_key``: where its ``model_dtype`` goes (None: every model loads in
    model.dtype)."""
    rules = {
        f"{verl}.{k}": _ours(f"{ours}.{k}")
        for k in ("param_offload", "reshard_after_forward", "fsdp_size", "forward_prefetch")
    }
    only_with_params = (
        f"the optimizer state is offloaded with the parameters here: set {ours}.param_offload=true "
        "(it keeps parameters, gradients and optimizer state on CPU)"
    )
    same_dtype = "every model loads in model.dtype here"
    rules |= {
        # FSDP2's CPUOffloadPolicy, which is what our param_offload is.
        f"{verl}.offload_policy": _ours(f"{ours}.param_offload", harmless=(False,)),
        # Accepted with param_offload=true (see _combine), refused alone; a frozen model has neither.
        **{
            f"{verl}.{k}": _refused(only_with_params, (False, None))
            if ours.split(".")[0] in ("actor", "critic")
            else _ignored("this model is frozen: it has no optimizer state or gradients", (False, None))
            for k in ("optimizer_offload", "grad_offload")
        },
        f"{verl}.wrap_policy.*": _ignored("FSDP2 shards each decoder layer, then the root, here"),
        f"{verl}.dtype": _ours(f"{ours}.mixed_precision.param_dtype", DTYPES),
        f"{verl}.mixed_precision.param_dtype": _ours(f"{ours}.mixed_precision.param_dtype", DTYPES),
        f"{verl}.mixed_precision.reduce_dtype": _ours(f"{ours}.mixed_precision.reduce_dtype", DTYPES),
        f"{verl}.mixed_precision.buffer_dtype": _ignored("buffers keep the model's dtype here"),
        f"{verl}.model_dtype": _ours(dtype_key, DTYPES)
        if dtype_key
        else _refused(same_dtype, ("fp32", "float32", None)),
        f"{verl}.use_orig_params": _ignored("FSDP2 has no flat parameters"),
        f"{verl}.seed": _ignored(SEEDED),
        f"{verl}.full_determinism": _refused("not available here", (False,)),
        f"{verl}.entropy_from_logits_with_chunking": _ignored(ENTROPY),
        f"{verl}.entropy_checkpointing": _ignored(ENTROPY),
        f"{verl}.use_torch_compile": _ignored(COMPILE),
        f"{verl}.forward_only": _ignored("verl sets it for each role"),
        f"{verl}.strategy": _refused(STRATEGY, ("fsdp", "fsdp2")),
    }
    rules[f"{verl}.ulysses_sequence_parallel_size"] = (
        _ours(sp_key) if sp_key else _refused("this model runs without sequence parallelism here", (1,))
    )
    return rules


def _model(p: str, lora: str | None) -> dict[str, VerlKey]:
    """The model keys verl has for the actor (``actor_rollout_ref.model``), the critic and the reward
    model (``<role>.model``), in ``p``; ``lora``: the section their LoRA keys go to."""
    rules = {
        f"{p}.use_shm": _ignored("models load from the file system here"),
        f"{p}.external_lib": _refused(
            "no module is imported for the model here (model.trust_remote_code=true runs a checkpoint's own code)"
        ),
        f"{p}.override_config": _refused("the model's config is used as saved", (None, {})),
        f"{p}.enable_activation_offload": _refused(
            "activation offload is not available here; model.enable_gradient_checkpointing=true saves activations",
            (False, None),
        ),
        f"{p}.use_remove_padding": _ignored(PACKED, (True,)),
        f"{p}.tiled_mlp.enabled": _refused("tiled MLPs are not available here", (False,)),
        f"{p}.tiled_mlp.num_shards": _ignored("used only with tiled_mlp.enabled=true"),
        f"{p}.use_liger": _ignored("Liger's kernels: this trainer's are actor.kernels", (False,)),
        f"{p}.use_fused_kernels": _ours("actor.use_fused_kernels")
        if p == "model"
        else _ignored("fused kernels: actor.use_fused_kernels here"),
    }
    if lora:
        rules |= {
            f"{p}.lora_rank": _ours(f"{lora}.rank"),
            f"{p}.lora_alpha": _ours(f"{lora}.alpha"),
            f"{p}.target_modules": _ours(f"{lora}.target_modules"),
            f"{p}.exclude_modules": _refused(f"name the layers to adapt in {lora}.target_modules"),
        }
    return rules


def _verl_keys() -> dict[str, VerlKey]:
    """Every key of verl's PPO trainer (``verl/trainer/config/ppo_trainer.yaml`` and the files it
    composes, plus the older spellings its examples still use) that is not ours as it is, in our
    section names (``VERL_SECTIONS``)."""
    keys: dict[str, VerlKey] = {
        # ---------------------------------------------------------------- actor_rollout_ref.actor
        "actor.strategy": _refused(STRATEGY, ("fsdp", "fsdp2")),
        "actor.ppo_micro_batch_size": _global_micro("actor.ppo_micro_batch_size_per_gpu"),
        "actor.rollout_n": _ignored("verl fills it in from rollout.n"),
        "actor.use_remove_padding": _ignored(PACKED, (True,)),
        "actor.use_torch_compile": _ignored(COMPILE),
        "actor.entropy_from_logits_with_chunking": _ignored(ENTROPY),
        "actor.entropy_checkpointing": _ignored(ENTROPY),
        "actor.calculate_entropy": _ignored("the entropy is always computed and logged here (actor/entropy)"),
        "actor.tau_pos": _ignored("a parameter of verl's SAPO loss, which this trainer does not have"),
        "actor.tau_neg": _ignored("a parameter of verl's SAPO loss, which this trainer does not have"),
        "actor.use_prefix_grouper": _refused("not available here", (False,)),
        "actor.calculate_sum_pi_squared": _refused("not available here", (False,)),
        "actor.sum_pi_squared_checkpointing": _ignored("used only with calculate_sum_pi_squared"),
        "actor.freeze_vision_tower": _refused("vision-language models are not supported here", (False,)),
        "actor.data_loader_seed": _ignored(SEEDED),
        "actor.checkpoint.async_save": _ours("trainer.async_save"),
        "actor.checkpoint.*": _ignored("a checkpoint holds every model, optimizer and loader state here"),
        "actor.profiler.*": _ignored(PROFILER),
        "actor.router_replay.mode": _refused("MoE router replay is not available here", ("disabled",)),
        "actor.router_replay.*": _ignored("used only with router_replay.mode"),
        # ---------------------------------------------------------------- actor_rollout_ref.ref
        "ref.log_prob_micro_batch_size": _global_micro("ref.log_prob_micro_batch_size_per_gpu"),
        "ref.log_prob_use_dynamic_bsz": _ignored(
            "the reference's forward uses actor.use_dynamic_bsz here (memory and speed only)"
        ),
        "ref.log_prob_max_token_len_per_gpu": _ignored(
            "the reference's forward uses actor.ppo_max_token_len_per_gpu here (memory and speed only)"
        ),
        "ref.model": _refused("the reference's weights are ref.model_path here"),
        "ref.model.path": _ours("ref.model_path"),
        "ref.strategy": _refused(STRATEGY, ("fsdp", "fsdp2")),
        "ref.rollout_n": _ignored("verl fills it in from rollout.n"),
        "ref.use_torch_compile": _ignored(COMPILE),
        "ref.entropy_from_logits_with_chunking": _ignored(ENTROPY),
        "ref.entropy_checkpointing": _ignored(ENTROPY),
        "ref.profiler.*": _ignored(PROFILER),
        "ref.router_replay.*": _ignored("MoE router replay is not available here"),
        # ---------------------------------------------------------------- actor_rollout_ref.rollout
        "rollout.name": _refused(
            "this trainer generates with Hugging Face generate; remove the key", ("hf",)
        ),
        "rollout.mode": _ignored(
            "verl's sync or async engine; generation runs in the training processes here"
        ),
        "rollout.top_k": _ours("rollout.top_k", {-1: 0}),
        "rollout.prompt_length": _refused("ours is data.max_prompt_length"),
        "rollout.response_length": _refused("ours is data.max_response_length"),
        "rollout.dtype": _ignored(
            "the rollout runs on the actor's weights, in actor.fsdp.mixed_precision.param_dtype"
        ),
        "rollout.enforce_eager": _ignored(f"{ENGINE}; compiled decoding is rollout.compile"),
        "rollout.micro_batch_size": _ignored(
            f"{ENGINE}; sequences per generate call on one rank are rollout.micro_batch_size_per_gpu"
        ),
        "rollout.log_prob_micro_batch_size": _ignored(
            "the old log-probs are scored in the actor's micro-batches here (memory and speed only)"
        ),
        "rollout.log_prob_micro_batch_size_per_gpu": _ignored(
            "the old log-probs are scored in the actor's micro-batches here (memory and speed only)"
        ),
        "rollout.log_prob_use_dynamic_bsz": _ignored("the old log-probs use actor.use_dynamic_bsz here"),
        "rollout.log_prob_max_token_len_per_gpu": _ignored(
            "the old log-probs use actor.ppo_max_token_len_per_gpu here"
        ),
        "rollout.over_sample_rate": _refused("there is no over-sampling here", (0, 0.0)),
        "rollout.calculate_log_probs": _ignored(
            "the sampler is the actor itself here; the trainer scores the old log-probs"
        ),
        # verl's 0 is greedy (ours: val_kwargs.do_sample=false, the default); its top_k -1 is our 0.
        "rollout.val_kwargs.temperature": _ours("rollout.val_kwargs.temperature", harmless=(0, 0.0)),
        "rollout.val_kwargs.top_k": _ours("rollout.val_kwargs.top_k", {-1: 0}),
        "rollout.multi_turn.enable": _ours("rollout.multi_turn.enable"),
        "rollout.multi_turn.max_assistant_turns": _ours("rollout.multi_turn.max_assistant_turns"),
        "rollout.multi_turn.max_tool_response_length": _ours("rollout.multi_turn.max_tool_response_length"),
        "rollout.multi_turn.*": _ignored(
            "verl's tool and agent-loop settings; here the environment is a class with reset and step "
            "(rollout.multi_turn.env) and turns end at rollout.multi_turn.stop"
        ),
        "rollout.skip_rollout": _refused("rollouts are always generated here", (False,)),
        "rollout.skip_dump_dir": _ignored("used only with rollout.skip_rollout=true"),
        "rollout.enable_rollout_routing_replay": _refused(
            "MoE routing replay is not available here", (False,)
        ),
        "rollout.quantization": _refused("the rollout runs on the actor's own (unquantized) weights"),
        "rollout.quantization_config_file": _refused(
            "the rollout runs on the actor's own (unquantized) weights"
        ),
        "rollout.mtp": _refused("multi-token prediction is not available here"),
        "rollout.profiler.*": _ignored(PROFILER),
        **{
            f"rollout.{k}": _ignored(ENGINE)
            for k in (
                "gpu_memory_utilization",
                "cudagraph_capture_sizes",
                "free_cache_engine",
                "tensor_model_parallel_size",
                "data_parallel_size",
                "expert_parallel_size",
                "pipeline_model_parallel_size",
                "max_num_batched_tokens",
                "max_model_len",
                "max_num_seqs",
                "enable_chunked_prefill",
                "enable_prefix_caching",
                "logprobs_mode",
                "scheduling_policy",
                "load_format",
                "disable_log_stats",
                "engine_kwargs.*",
                "multi_stage_wake_up",
                "layered_summon",
                "update_weights_bucket_megabytes",
                "checkpoint_engine.*",
                "skip_tokenizer_init",
                "prometheus.*",
                "agent.*",
                "trace.*",
            )
        },
        # ---------------------------------------------------------------- actor_rollout_ref.model
        "model.hf_config_path": _refused("the model's config is read from model.path"),
        "model.custom_chat_template": _refused(
            "prompts are rendered with the tokenizer's chat template: save yours in the tokenizer "
            "(tokenizer.chat_template) and point model.tokenizer_path at it"
        ),
        "model.lora_adapter_path": _refused(
            "point model.path at the adapter folder (its base model is read from adapter_config.json)"
        ),
        "model.fused_kernel_options.impl_backend": _ours("actor.kernels"),
        "model.mtp.enable": _refused("multi-token prediction is not available here", (False,)),
        "model.mtp.*": _ignored("used only with model.mtp.enable=true"),
        **_model("model", "actor.lora"),
        "actor_rollout_ref.hybrid_engine": _refused(
            "the actor and the rollout always share weights here", (True,)
        ),
        "actor_rollout_ref.nccl_timeout": _ours("trainer.dist_timeout_s"),
        # ---------------------------------------------------------------- critic
        "critic.model.path": _ours("critic.model_path"),
        "critic.model.tokenizer_path": _ignored(
            "the critic reads the policy's tokens (model.tokenizer_path)"
        ),
        "critic.model.trust_remote_code": _refused(
            "model.trust_remote_code applies to every model here", (False, None)
        ),
        "critic.model.enable_gradient_checkpointing": _ignored(
            "the critic follows model.enable_gradient_checkpointing here (memory and speed only)"
        ),
        **_model("critic.model", "critic.lora"),
        "critic.strategy": _refused(STRATEGY, ("fsdp", "fsdp2")),
        "critic.enable": _refused("the critic is used exactly when algorithm.adv_estimator=gae here"),
        "critic.rollout_n": _ignored("verl fills it in from rollout.n"),
        "critic.ppo_micro_batch_size": _global_micro("critic.ppo_micro_batch_size_per_gpu"),
        "critic.forward_micro_batch_size": _ignored(
            "the values' forward uses the critic's micro-batches here (memory and speed only)"
        ),
        "critic.forward_micro_batch_size_per_gpu": _ignored(
            "the values' forward uses the critic's micro-batches here (memory and speed only)"
        ),
        "critic.forward_max_token_len_per_gpu": _ignored(
            "the values' forward uses critic.ppo_max_token_len_per_gpu here (memory and speed only)"
        ),
        "critic.shuffle": _ignored("the critic's mini-batches are shuffled as actor.shuffle says"),
        "critic.data_loader_seed": _ignored(SEEDED),
        "critic.checkpoint.async_save": _ours("trainer.async_save"),
        "critic.checkpoint.*": _ignored("a checkpoint holds every model, optimizer and loader state here"),
        "critic.profiler.*": _ignored(PROFILER),
        # ---------------------------------------------------------------- reward_model
        "reward.enable": _ours("reward.style", {True: "model"}, harmless=(False, None)),
        "reward.model.path": _ours("reward.model_path"),
        "reward.model.input_tokenizer": _refused(
            "the reward model scores the policy's tokens: it must share the policy's tokenizer"
        ),
        "reward.model.trust_remote_code": _refused(
            "model.trust_remote_code applies to every model here", (False, None)
        ),
        **_model("reward.model", None),
        "reward.micro_batch_size": _global_micro("reward.micro_batch_size_per_gpu"),
        "reward.max_length": _refused(
            "the reward model scores whole sequences here (data.max_prompt_length + data.max_response_length)"
        ),
        "reward.use_dynamic_bsz": _ignored("the reward model's forward uses reward.micro_batch_size_per_gpu"),
        "reward.forward_max_token_len_per_gpu": _ignored(
            "the reward model's forward uses reward.micro_batch_size_per_gpu"
        ),
        # dapo: naive's scores plus the overlong penalty, which reward.overlong_buffer adds here.
        "reward.reward_manager": _refused(
            "only verl's naive and dapo reward managers (one score per response) exist here",
            ("naive", "dapo"),
        ),
        "reward.launch_reward_fn_async": _ignored("the reward function runs in the training processes here"),
        "reward.sandbox_fusion.url": _refused("no sandbox runs code here"),
        "reward.sandbox_fusion.*": _ignored("used only with reward_model.sandbox_fusion.url"),
        "reward.strategy": _refused(STRATEGY, ("fsdp", "fsdp2")),
        "reward.profiler.*": _ignored(PROFILER),
        "reward.reward_loop_module_path": _refused("verl's reward loops do not exist here"),
        "reward.reward_loop_class_name": _refused("verl's reward loops do not exist here"),
        **{
            f"reward.{k}": _ignored("verl's reward workers; the reward model is sharded over every rank here")
            for k in (
                "use_reward_loop",
                "reward_loop_source",
                "enable_resource_pool",
                "n_gpus_per_node",
                "nnodes",
                "rollout.*",
            )
        },
        # ---------------------------------------------------------------- custom_reward_function (see _combine)
        "custom_reward_function.reward_kwargs": _ours("reward.reward_kwargs"),
        "reward_manager.source": _refused(
            "only verl's naive and dapo reward managers exist here", ("register",)
        ),
        "reward_manager.name": _refused(
            "only verl's naive and dapo reward managers exist here", ("naive", "dapo", None)
        ),
        "reward_manager.module.path": _refused("only verl's naive and dapo reward managers exist here"),
        "reward_manager.module.name": _ignored("used only with reward_manager.module.path"),
        # ---------------------------------------------------------------- algorithm
        "algorithm.use_pf_ppo": _refused("preference-feedback PPO is not available here", (False,)),
        "algorithm.pf_ppo.*": _ignored("used only with algorithm.use_pf_ppo=true"),
        "algorithm.rollout_correction.rollout_is": _refused(
            "verl corrects a vLLM sampler's mismatch with the trainer; here the actor samples itself. For "
            "offline data: algorithm.rollout_is_threshold, algorithm.rollout_is, algorithm.rollout_is_level"
        ),
        "algorithm.rollout_correction.rollout_rs": _refused("rejection sampling is not available here"),
        "algorithm.rollout_correction.*": _ignored("used only with algorithm.rollout_correction.rollout_is"),
        # ---------------------------------------------------------------- data
        "data.tokenizer": _refused("ours is model.tokenizer_path"),
        "data.use_shm": _ignored("data loads from the file system here"),
        "data.train_max_samples": _refused("every training prompt is used here; cut the file", (-1, None)),
        "data.val_max_samples": _ours("data.max_val_samples"),
        "data.reward_fn_key": _refused(
            "the rule scorer is chosen by the data_source column here", ("data_source",)
        ),
        "data.tool_config_path": _refused("tools are not supported here"),
        "data.return_raw_input_ids": _ignored("prompts are rendered and tokenized once, at start-up, here"),
        "data.return_raw_chat": _ignored("prompts are rendered and tokenized once, at start-up, here"),
        "data.return_full_prompt": _ignored("prompts are rendered and tokenized once, at start-up, here"),
        "data.seed": _refused("ours is trainer.seed (which also seeds sampling and initialization)"),
        "data.dataloader_num_workers": _ignored("prompts are tokenized once, at start-up, here"),
        "data.validation_shuffle": _ignored("the whole validation set is scored here"),
        "data.filter_overlong_prompts": _ignored(
            "over-long prompts are always dropped and counted here, never truncated", (True,)
        ),
        "data.filter_overlong_prompts_workers": _ignored("prompts are tokenized once, at start-up, here"),
        "data.truncation": _refused(
            "prompts are never truncated here: those over data.max_prompt_length are dropped and counted",
            ("error",),
        ),
        "data.trust_remote_code": _refused("model.trust_remote_code loads the tokenizer here", (False, None)),
        "data.image_key": _refused("vision-language data is not supported here", ("images",)),
        "data.video_key": _refused("vision-language data is not supported here", ("videos",)),
        "data.image_patch_size": _ignored("vision-language data is not supported here"),
        "data.return_multi_modal_inputs": _ignored("vision-language data is not supported here"),
        "data.custom_cls.path": _refused(
            "prompts load from Parquet, JSON lines or a saved dataset folder here"
        ),
        "data.custom_cls.name": _ignored("used only with data.custom_cls.path"),
        "data.sampler.class_path": _refused("curriculum samplers are not available here"),
        "data.sampler.class_name": _ignored("used only with data.sampler.class_path"),
        "data.datagen.path": _refused("dynamic data generation is not available here"),
        "data.datagen.name": _ignored("used only with data.datagen.path"),
        "data.apply_chat_template_kwargs": _refused(
            "the chat template is applied with its defaults here", (None, {})
        ),
        # ---------------------------------------------------------------- trainer (see _combine)
        "trainer.default_local_dir": _ours("trainer.output_dir"),
        "trainer.balance_batch": _ignored(
            "each rank trains on the responses it sampled here; micro-batches are balanced by length"
        ),
        "trainer.rollout_data_dir": _refused("rollouts are not written to files here"),
        "trainer.validation_data_dir": _refused("validation generations are not written to files here"),
        "trainer.esi_redundant_time": _ignored(
            "on a stop signal (SIGTERM, as Slurm sends before a job's time ends) a checkpoint is saved here"
        ),
        "trainer.val_only": _refused("there is no validation-only mode here", (False,)),
        "trainer.default_hdfs_dir": _refused(
            "nothing is copied to HDFS here; copy trainer.output_dir yourself"
        ),
        "trainer.del_local_ckpt_after_load": _refused("checkpoints are kept here", (False,)),
        "trainer.ray_wait_register_center_timeout": _ignored(RAY),
        "trainer.use_legacy_worker_impl": _ignored(
            "verl's worker implementations; there are no workers here"
        ),
        "trainer.npu_profile.*": _ignored(PROFILER),
        # ---------------------------------------------------------------- the rest of verl
        "global_profiler.*": _ignored(PROFILER),
        "ray_kwargs.*": _ignored(RAY),
        "ray_init.*": _ignored(RAY),
        "transfer_queue.*": _ignored("verl's transfer queue (Ray); there is none here"),
    }
    keys |= _optim("actor") | _optim("critic")
    keys |= _fsdp("actor.fsdp_config", "actor.fsdp", "actor.ulysses_sequence_parallel_size", "model.dtype")
    keys |= _fsdp("ref.fsdp_config", "ref.fsdp", "ref.ulysses_sequence_parallel_size", None)
    keys |= _fsdp("critic.model.fsdp_config", "critic.fsdp", "critic.ulysses_sequence_parallel_size", None)
    keys |= _fsdp("reward.model.fsdp_config", "reward.fsdp", None, None)
    keys["reward.ulysses_sequence_parallel_size"] = _refused(
        "the reward model runs without sequence parallelism here", (1,)
    )
    return keys


VERL_KEYS = _verl_keys()
"""verl's keys (in our section names, ``VERL_SECTIONS``) that are not ours as they are: renamed,
accepted and ignored, or refused. Keys verl shares with us (``data.train_batch_size``,
``actor.ppo_mini_batch_size``, ``algorithm.kl_ctrl.kl_coef``, ...) are not listed."""

VERL_PARENTS = frozenset(
    ".".join(parts[:n])
    for key in VERL_KEYS
    for parts in [key.removesuffix(".*").split(".")]
    for n in range(1, len(parts) + (key.endswith(".*")))
) | frozenset({"custom_reward_function", "trainer", "actor_rollout_ref"})
"""The sections of verl's keys that a nested YAML mapping or section value is walked into."""

VERL_ONLY = ("actor_rollout_ref", "custom_reward_function", "reward_manager", "global_profiler", "ray_kwargs")
"""Top-level names only verl has (after ``VERL_SECTIONS``): a key under one that is not in
``VERL_KEYS`` is unknown."""

VERL_DEFAULTS = {
    "rollout.n": 1,
    "actor.optim.lr": 1e-6,
    "actor.optim.weight_decay": 0.01,
    "critic.optim.weight_decay": 0.01,
    "actor.use_dynamic_bsz": False,
    "critic.use_dynamic_bsz": False,
    "actor.fsdp.mixed_precision.param_dtype": "bfloat16",
    "critic.fsdp.mixed_precision.param_dtype": "bfloat16",
    "ref.fsdp.mixed_precision.param_dtype": "bfloat16",
    "data.train_batch_size": 1024,
    "data.max_prompt_length": 512,
    "data.max_response_length": 512,
    "actor.ppo_mini_batch_size": 256,
    "trainer.total_epochs": 30,
}
"""verl's defaults of the keys that change what a run trains (or, for the batch sizes, its memory);
when a config uses verl's spellings, those of them that differ from ours and that it leaves unset are
named in one start-up warning."""


VERL_MAPPINGS = frozenset({"custom_reward_function.reward_kwargs"})
"""verl's renamed keys whose value is a mapping, set key by key (``+custom_reward_function.reward_kwargs.a=1``)."""


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
            return _ours(over.ours + key[len(prefix) :])
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
        if isinstance(value, str) and "${" in value:
            errors.append(f"{shown}: an OmegaConf interpolation, which is not resolved here; give the value")
        elif _among(value, rule.harmless):
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
