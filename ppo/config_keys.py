"""Dotted keys of a config schema: every key a config class takes (``all_keys``), the valid keys closest
to a mistyped one (``closest_keys``), and one value as the user gave it, in a file or on the command
line (``Leaf``). Standard library only: the loader and verl's table build on it before torch loads.
"""

from __future__ import annotations

import dataclasses
import difflib
import reprlib
import typing
from typing import Any

show = reprlib.Repr()
"""repr for error messages, cut short so that a huge value (a YAML alias bomb) stays one short line."""
show.maxstring = show.maxother = 80

COMMAND_LINE = "the command line"
"""Where an override came from, in messages."""


@dataclasses.dataclass
class Leaf:
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
    written: Any = None
    """``value``'s scalars as their source text, in its shape (``ppo.yaml_text.parse``): what a key that
    takes a string gets where YAML read a number or a word (``010``, ``off``); None where not known."""

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
