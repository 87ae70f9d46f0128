"""Config errors and the single-value checks every section's ``__post_init__`` uses.

A section's check raises :class:`FieldError` naming the field within its section (``lr must be > 0``);
``ppo.config_loader`` re-raises it as a :class:`ConfigError` with the full dotted key and where the value
came from. ``_require(section, "> 0", "lr", "eps")`` states a range rule once for several fields.
"""

from __future__ import annotations

import math
from typing import Any

from ppo.choices import KL_KINDS


class ConfigError(ValueError):
    """A config value or key is wrong; the message names the key and what to do."""


class FieldError(ConfigError):
    """A section's ``__post_init__`` check failed. The message starts with the field's key relative to
    the section (``lr must be > 0``); ``keys`` are the fields involved, the first being the one the
    message starts with. The loader knows the section's dotted prefix and where each value came from,
    and re-raises it as a ConfigError naming the full key (``critic.optim.lr``) and its source."""

    def __init__(self, message: str, *keys: str) -> None:
        super().__init__(message)
        self.keys = keys


def _satisfies(value: float, rule: str) -> bool:
    """Whether ``value`` meets ``rule``: ``"> 0"``, ``">= -1"``, an interval ``"[0, 1)"``, a number
    (``"-1"``: equal to it), or alternatives joined by ``" or "`` (``"-1 or > 0"``)."""
    for part in rule.split(" or "):
        if part[0] in "[(":
            lo, hi = (float(x) for x in part[1:-1].split(","))
            above = lo <= value if part[0] == "[" else lo < value
            below = value <= hi if part[-1] == "]" else value < hi
            ok = above and below
        elif part.startswith(">="):
            ok = value >= float(part[2:])
        elif part.startswith(">"):
            ok = value > float(part[1:])
        else:
            ok = value == float(part)
        if ok:
            return True
    return False


def _require(section: Any, rule: str, *keys: str) -> None:
    """Raise a FieldError for the first of ``keys`` of ``section`` whose value breaks ``rule`` (see
    :func:`_satisfies`). A list is checked element by element; None (an optional left unset) passes;
    NaN and ±inf never do."""
    for key in keys:
        value = getattr(section, key)
        items = list(enumerate(value)) if isinstance(value, list) else [(None, value)]
        for i, v in items:
            if v is None:
                continue
            if (isinstance(v, float) and not math.isfinite(v)) or not _satisfies(v, rule):
                name = key if i is None else f"{key}[{i}]"
                within = "in " if rule[0] in "[(" else ""
                raise FieldError(f"{name} must be {within}{rule}, got {v!r}", name)


def check_kl_kind(kind: str, key: str) -> None:
    """Fail unless ``kind`` is a KL estimator name, optionally with the ``+`` (k2 gradient) suffix."""
    if kind.removesuffix("+") not in KL_KINDS:
        raise FieldError(
            f"{key}={kind!r} is not a KL estimator; valid: {', '.join(KL_KINDS)} (optionally with '+')", key
        )


def check_world_size(world_size: int) -> None:
    """Fail unless ``world_size`` is a number of ranks."""
    if world_size < 1:
        raise ConfigError(f"the world size must be >= 1, got {world_size}")
