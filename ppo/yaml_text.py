"""Reading YAML as the user wrote it: a config file or one command-line value, parsed into plain values
together with the text each scalar was written as, so that a key that takes a string gets what was typed::

    value, written = parse("010")        # (8, "010"): YAML 1.1 reads 010 as octal; experiment_name wants "010"
    value, written = read_yaml(path)     # the file's mapping, and a mirror of it holding each scalar's text

YAML 1.1 (PyYAML's) rewrites words and numbers: ``010`` is 8, ``12:30`` is 750, ``1.10`` is 1.1, ``0x1F`` is
31, ``off`` is false. The values stay as YAML reads them (a key that takes a number or a boolean gets
that), and ``written`` keeps the source text for the keys whose type is a string. Dates are not read as
dates: ``2026-12-05`` stays the string it is (no config key takes a date).

Problems are one line with file, line and column: syntax, tabs, encoding, a key given twice in one
mapping, and lines of a shell command (``actor_rollout_ref.actor.optim.lr=1e-6 \\``) pasted into a YAML
file, which YAML would otherwise fold into the value of the key above them. Standard library and PyYAML
only.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from ppo.config import ConfigError


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that fails on a key given twice in one mapping (PyYAML keeps the last), and reads
    no dates (``2026-12-05`` stays a string)."""

    yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

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


class YAMLProblem(Exception):
    """Why a text is not valid YAML, and where (1-based line and column, or None)."""

    def __init__(self, problem: str, line: int | None = None, column: int | None = None) -> None:
        super().__init__(problem)
        self.line, self.column = line, column


OVERRIDE = re.compile(r"(?:^|(?<=\s))\+{0,2}[A-Za-z_][\w-]*(?:\.[\w-]+)+=\S*")
"""A command-line override (``section.key=value``, Hydra's ``+key=``) inside YAML text."""

PASTED_LINE = re.compile(r"^\s*\+{0,2}[A-Za-z_][\w-]*(?:\.[\w-]+)+=")
"""A line of a shell command's overrides, as verl's example scripts write them one a line."""


def parse(text: str) -> tuple[Any, Any]:
    """``text`` parsed by :class:`UniqueKeyLoader`: ``(value, written)``, where ``written`` mirrors
    ``value`` with each scalar's source text (mappings keyed by their keys' text; None where a value
    has no text of its own, e.g. a merged ``<<: *anchor``). Any problem (syntax, tabs, a duplicate key, a
    character YAML forbids, nesting deep enough to exhaust the stack) is a :class:`YAMLProblem`."""
    loader = None
    try:
        loader = UniqueKeyLoader(text)
        node = loader.get_single_node()
        value = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        problem = e.problem or e.context or "invalid YAML"
        if "'\\t'" in problem:
            problem += " (indent with spaces, not tabs)"
        elif e.context and e.problem:
            problem = f"{e.problem} ({e.context})"
        raise YAMLProblem(problem, *((mark.line + 1, mark.column + 1) if mark else ())) from None
    except yaml.reader.ReaderError as e:
        line = text.count("\n", 0, e.position) + 1
        raise YAMLProblem(f"character #x{e.character:04x} is not allowed in YAML", line) from None
    except yaml.YAMLError as e:
        raise YAMLProblem(" ".join(str(e).split())) from None
    except RecursionError:
        raise YAMLProblem("nested too deeply") from None
    except (ValueError, OverflowError) as e:  # a scalar the constructor rejects (an int of 5000 digits)
        raise YAMLProblem(" ".join(str(e).split())) from None
    finally:
        if loader is not None:
            loader.dispose()
    return value, _written(node, set())


def _written(node: yaml.Node | None, path: set[int]) -> Any:
    """The source text of each scalar of ``node``, in the shape of its value (see ``parse``)."""
    if node is None or id(node) in path:  # nothing, or an alias of an enclosing node
        return None
    if isinstance(node, yaml.ScalarNode):
        return node.value
    path = path | {id(node)}
    if isinstance(node, yaml.SequenceNode):
        return [_written(item, path) for item in node.value]
    if isinstance(node, yaml.MappingNode):
        return {
            k.value: _written(v, path)
            for k, v in node.value
            if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge"
        }
    return None


def trailing_comment(text: str) -> bool:
    """Whether the one-line YAML ``text`` (a command-line value) ends in a ``#`` comment that YAML drops:
    ``outputs/run #2`` is ``outputs/run`` to YAML."""
    try:
        tokens = list(yaml.scan(text))
    except yaml.YAMLError:
        return False
    ends = [t.end_mark.index for t in tokens if not isinstance(t, yaml.StreamEndToken)]
    rest = text[max(ends, default=0) :]
    return rest.strip().startswith("#")


def read_yaml(path: Path) -> tuple[Any, Any]:
    """The YAML document in the file at ``path`` and its written texts (``parse``); any problem with it,
    a line of a shell command pasted into it included, is a one-line ConfigError naming the file and line."""
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory, not a YAML file")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(
            f"{path}, line {line}: not UTF-8 text (byte {raw[e.start]:#04x}); save the file as UTF-8"
        ) from None
    try:
        value, written = parse(text)
    except YAMLProblem as e:
        pasted = _pasted_lines(text, until=e.line)
        if pasted:
            raise ConfigError(_pasted(path, *pasted[0])) from None
        at = f", line {e.line}" + (f", column {e.column}" if e.column else "") if e.line else ""
        raise ConfigError(f"{path}{at}: {e}") from None
    found = _overrides_in_scalars(text)
    if found:
        raise ConfigError(_pasted(path, *found))
    return value, written


def _pasted(path: Path, line: int, override: str) -> str:
    key, _, value = override.lstrip("+").partition("=")
    return (
        f"{path}, line {line}: {override!r} is a command-line override (key=value), not YAML: in a YAML file "
        f"write '{key}: {value}' (or nest it under its sections), or pass it on the command line"
    )


def _pasted_lines(text: str, until: int | None) -> list[tuple[int, str]]:
    """The lines up to ``until`` (1-based) that look like a shell command's overrides, with their numbers."""
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        if until is not None and number > until:
            break
        if PASTED_LINE.match(line):
            out.append((number, line.strip().split()[0]))
    return out


def _overrides_in_scalars(text: str) -> tuple[int, str] | None:
    """The first ``key=value`` override inside a plain (unquoted, not block) scalar, a key or a value,
    with its line: a pasted shell line that YAML folded into the value above it. Quoted and block
    scalars (a chat template, a script) may hold anything."""
    loader = UniqueKeyLoader(text)
    try:
        root = loader.get_single_node()
    finally:
        loader.dispose()
    stack, seen, found = [root], set(), []
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            match = OVERRIDE.search(node.value) if node.style is None else None
            if match:
                at = text.find(match.group(), node.start_mark.index, node.end_mark.index)
                line = text.count("\n", 0, at) + 1 if at >= 0 else node.start_mark.line + 1
                found.append((line, match.group()))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
        elif isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                stack.extend((k, v))
    return min(found, default=None)
