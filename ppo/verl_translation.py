"""The translation ``load_config`` applies, with the table of ``ppo.verl_keys``, to a verl command line
or YAML file::

    parts = renamed(path)                                         # verl's section names into ours
    leaves, verl_spelled = from_verl(leaves, cls, errors, notes)  # our keys; whether any was verl's
    note = verl_defaults(cfg, leaves)                             # verl's defaults this run leaves unset

``from_verl`` renames verl's keys into ours, drops with a message in ``notes`` those that change nothing
here, refuses with the reason in ``errors`` those that cannot be taken, and combines those whose meaning
here takes two (``custom_reward_function.path`` and ``.name``, ``trainer.resume_mode=resume_path`` with
``trainer.resume_from_path``, ...). Importing this module costs nothing but the standard library,
``ppo.config_keys`` and the table (the schema, ``ppo.config``, is read for types only).
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from ppo.config_keys import Leaf, all_keys, closest_keys, show
from ppo.verl_keys import (
    VERL_DEFAULTS,
    VERL_HOMONYMS,
    VERL_KEYS,
    VERL_LENGTHS,
    VERL_MAPPINGS,
    VERL_NULL_IS_DEFAULT,
    VERL_ONLY,
    VERL_SECTIONS,
    VERL_VALUES,
)
from ppo.verl_rules import TOOLS, VerlKey, renamed_to

if TYPE_CHECKING:
    from ppo.config import PPOConfig


def renamed(path: tuple[Any, ...]) -> tuple[Any, ...]:
    """A key with verl's section names (``VERL_SECTIONS``) renamed into ours."""
    if not all(isinstance(p, str) for p in path):
        return path
    dotted = ".".join(path)
    for verl, ours in VERL_SECTIONS.items():
        if dotted == verl or dotted.startswith(verl + "."):
            return tuple((ours + dotted[len(verl) :]).split("."))
    return path


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


def _value(leaves: list[Leaf], cls: type, dotted: str) -> Any:
    """The value ``dotted`` takes: its last given value, else ``cls``'s default."""
    for leaf in reversed(leaves):
        if leaf.key == dotted:
            return leaf.value
    value: Any = cls()
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def from_verl(leaves: list[Leaf], cls: type, errors: list[str], notes: list[str]) -> tuple[list[Leaf], bool]:
    """``leaves`` in our keys: verl's renamed (``VERL_KEYS``), those that change nothing here dropped
    with a message in ``notes``, those that cannot be taken dropped with one in ``errors``. Our own keys
    and unknown ones pass through (``_build`` names the unknown). Also whether any key was verl's."""
    out = []
    verl_spelled = False
    our_keys = set(all_keys(cls))
    ignored: dict[str, list[str]] = {}  # reason -> the keys it covers, for one warning each
    given = _last_given(leaves, notes)
    context = {key: _value(given, cls, key) for key in ("rollout.n", "algorithm.adv_estimator", "model.path")}
    for leaf in _combine(given, errors, notes, context):
        key = leaf.key
        rule = _verl_key(key)
        if (
            rule is not None
            and key in our_keys
            and (leaf.given == key or (rule.ours is None and key not in VERL_HOMONYMS))
        ):
            # Our key, written our way (verl's values apply to verl's spelling: rollout.top_k=-1 is an
            # error, actor_rollout_ref.rollout.top_k=-1 our 0), or ours since the table was written;
            # a homonym's row applies to verl's other spelling (reward_model.num_workers).
            rule = None
        if key in VERL_VALUES and isinstance(leaf.value, Hashable):
            leaf = dataclasses.replace(leaf, value=VERL_VALUES[key].get(leaf.value, leaf.value))
        if key in VERL_LENGTHS and leaf.value == _value(leaves, cls, VERL_LENGTHS[key]):
            continue  # verl's default: the data's length
        if leaf.parts[-1] == "_target_" or (leaf.value is None and key in VERL_NULL_IS_DEFAULT):
            # verl's dataclass to instantiate; verl's null for "derive it", which our default does.
            verl_spelled = True
            continue
        shown = f"{leaf.given}={show.repr(leaf.value)} (from {leaf.source})"
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
            if rule.reason:  # a renaming a reader could take for another key of ours
                notes.append(f"{shown} is {rule.ours} here: {rule.reason}")
            written = leaf.written if value is leaf.value else None
            out.append(Leaf(leaf.given, tuple(rule.ours.split(".")), value, leaf.source, written))
        elif rule.ignored is True or (rule.ignored and _among(value, rule.ignored)):
            ignored.setdefault(rule.reason, []).append(shown)
        else:
            errors.append(f"{shown}: {rule.reason}")
    for reason, shown_keys in ignored.items():
        notes.append(f"{', '.join(shown_keys)} {'is' if len(shown_keys) == 1 else 'are'} ignored: {reason}")
    return _last_given(out, notes), verl_spelled


def _last_given(leaves: list[Leaf], notes: list[str]) -> list[Leaf]:
    """Each key's last value only, as in Hydra: a later value replaces an earlier one (even one that
    would be refused), so a verl script's ``$@`` overrides work. A key given in two spellings with
    different values is named in ``notes``. A mapping's value (``reward.reward_kwargs``) is merged key by
    key instead, so it is kept."""
    last = {leaf.key: i for i, leaf in enumerate(leaves) if not isinstance(leaf.value, dict)}
    out = []
    for i, leaf in enumerate(leaves):
        later = leaves[last.get(leaf.key, i)]
        if later is leaf:
            out.append(leaf)
        elif later.given != leaf.given and repr(later.value) != repr(leaf.value):
            notes.append(
                f"{leaf.given}={show.repr(leaf.value)} (from {leaf.source}) and {later.given}="
                f"{show.repr(later.value)} (from {later.source}) set one key, {leaf.key}: the last given "
                f"({later.given}) is taken"
            )
    return out


def verl_defaults(cfg: PPOConfig, leaves: list[Leaf]) -> str | None:
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


def _combine(leaves: list[Leaf], errors: list[str], notes: list[str], context: dict[str, Any]) -> list[Leaf]:
    """verl's keys whose meaning here takes two of them, as ours: ``custom_reward_function.path`` and
    ``.name`` make ``reward.custom_function=path:name``; ``trainer.resume_mode=resume_path`` with
    ``trainer.resume_from_path=P`` makes ``trainer.resume_mode=P``; ``max_actor_ckpt_to_keep`` and
    ``max_critic_ckpt_to_keep`` make ``trainer.max_ckpt_to_keep`` (verl's keep-all values, null, 0 or
    negative, our null); ``optimizer_offload=true`` (or
    ``grad_offload``) is what ``param_offload=true`` does here, so it is accepted beside it; the PRIME
    recipe's reward-model keys read with ``rollout.n`` and ``algorithm.adv_estimator`` (``_prime``).
    ``context``: the values the run takes for ``rollout.n``, ``algorithm.adv_estimator`` and
    ``model.path`` (given, else our defaults)."""
    last = {leaf.key: leaf for leaf in leaves}  # a later value of a key wins, as for every key
    taken = {
        "custom_reward_function.path",
        "custom_reward_function.name",
        "trainer.resume_from_path",
        "trainer.max_actor_ckpt_to_keep",
        "trainer.max_critic_ckpt_to_keep",
        "algorithm.rollout_correction.rollout_is",
        "algorithm.rollout_correction.rollout_is_threshold",
    }
    path, name = last.get("custom_reward_function.path"), last.get("custom_reward_function.name")
    function_at = function = None
    if path is not None and isinstance(path.value, (list, tuple)):
        errors.append(
            f"{path.given}={show.repr(path.value)} (from {path.source}): verl's path names one file; several "
            "functions are reward.custom_function=[file.py:fn,...] here, with reward.weights (TRL's reward_funcs)"
        )
        path = None
    if path is not None and path.value is not None:
        spec = f"{os.path.expanduser(str(path.value))}:"
        spec += name.value if name is not None and name.value is not None else "compute_score"
        given = "custom_reward_function.path" + (" and .name" if name is not None else "")
        function = Leaf(given, ("reward", "custom_function"), spec, path.source)
        position = {id(leaf): i for i, leaf in enumerate(leaves)}
        function_at = max((p for p in (path, name) if p is not None), key=lambda p: position[id(p)])
    dropped = _without_turns(last, errors)
    dropped += _prime(last, errors, context)
    mini = last.get("reward.mini_batch_size")
    if mini is not None and mini.value is not None:
        dropped.append(mini)
        n = context["rollout.n"]
        if isinstance(mini.value, int) and isinstance(n, int) and n > 0 and mini.value % n == 0:
            leaves = [
                *leaves,
                Leaf(
                    mini.given,
                    ("reward", "prime", "mini_batch_size"),
                    prm_mini_batch(mini.value, n),
                    mini.source,
                ),
            ]
        else:
            errors.append(
                f"{mini.given}={show.repr(mini.value)} (from {mini.source}): the PRIME recipe's PRM mini-batch "
                f"counts responses, and reward.prime.mini_batch_size here counts prompts: give a multiple of "
                f"rollout.n={n}"
            )
    out = []
    for leaf in leaves:
        key = leaf.key
        if any(leaf is d for d in dropped):
            continue
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
            leaf = Leaf(
                "trainer.resume_mode and trainer.resume_from_path", leaf.parts, path.value, path.source
            )
        if key not in taken:
            out.append(leaf)
        elif leaf is function_at:  # where it was given, so that a later reward.custom_function wins
            out.append(function)
        elif key == "algorithm.rollout_correction.rollout_is":
            out += _rollout_is(leaf, last.get("algorithm.rollout_correction.rollout_is_threshold"), errors)
    if function is None and name is not None and name.value not in (None, "compute_score"):
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
        dataclasses.replace(last[k], value=_verl_keep(last[k].value))
        for k in ("trainer.max_actor_ckpt_to_keep", "trainer.max_critic_ckpt_to_keep")
        if k in last
    ]
    if len({repr(leaf.value) for leaf in keep}) > 1:
        shown = ["null" if leaf.value is None else show.repr(leaf.value) for leaf in keep]  # as verl reads it
        errors.append(
            f"trainer.max_actor_ckpt_to_keep and trainer.max_critic_ckpt_to_keep differ ({shown[0]} and "
            f"{shown[1]}): one checkpoint holds both here; set trainer.max_ckpt_to_keep (null keeps all)"
        )
    elif keep:
        out.append(Leaf(keep[0].given, ("trainer", "max_ckpt_to_keep"), keep[0].value, keep[0].source))
    return out


def _verl_keep(value: Any) -> Any:
    """verl's ``max_actor_ckpt_to_keep`` as our ``trainer.max_ckpt_to_keep``: verl 0.9.1 prunes only for a
    positive int (``checkpoint_manager.register_checkpoint``); null (its default), 0 or a negative number
    keeps every checkpoint, which is our null. Other values pass as given, for the schema to check."""
    if value is None or (type(value) is int and value <= 0):
        return None
    return value


def _without_turns(last: dict[str, Leaf], errors: list[str]) -> list[Leaf]:
    """verl's multi-turn keys (its tools, ``multi_turn.enable`` in verl's spelling) without our
    ``rollout.multi_turn.env``: one error that says what to write instead (the run would otherwise train
    single-turn without a word); returns those leaves, which are then left out."""
    env = last.get("rollout.multi_turn.env")
    if env is not None and env.value is not None:
        return []
    keys = (
        "data.tool_config_path",
        "data.function_tool_path",
        "rollout.multi_turn.tool_config_path",
        "rollout.multi_turn.function_tool_path",
        "rollout.multi_turn.interaction_config_path",
    )
    turns = [last[k] for k in keys if k in last and last[k].value is not None]
    enable = last.get("rollout.multi_turn.enable")
    if enable is not None and enable.given != enable.key and _among(enable.value, (True, "true", "True")):
        turns.insert(0, enable)
    if turns:
        given = ", ".join(f"{leaf.given}={show.repr(leaf.value)} (from {leaf.source})" for leaf in turns)
        errors.append(f"{given}: {TOOLS}")
    return turns


def prm_mini_batch(responses: int, n: int) -> int:
    """The PRIME recipe's ``reward_model.mini_batch_size`` (responses per PRM optimizer step, over all
    ranks) as ``reward.prime.mini_batch_size`` (prompts): ``responses / n``, ``n = rollout.n``."""
    return responses // n


def _prime(last: dict[str, Leaf], errors: list[str], context: dict[str, Any]) -> list[Leaf]:
    """The PRIME recipe's ``reward_model.enable=True`` and ``reward_model.model.path=P`` with
    ``algorithm.adv_estimator=prime``: there they turn on the implicit PRM and name its starting weights,
    not an outcome reward model. Here the PRM always runs with ``prime`` and starts from the reference
    model (``ref.model_path``, else ``model.path``): ``enable`` is dropped, and so is the path when it is
    the reference's; another path is refused, with what to write. Returns the leaves dropped."""
    if context["algorithm.adv_estimator"] != "prime":
        return []
    dropped = [last[k] for k in ("reward.enable", "reward.model.enable") if k in last]
    path = last.get("reward.model.path") or last.get("reward.model.model_path")  # 0.9.1's spelling
    if path is None or path.value is None:
        return dropped
    ref = next((last[k] for k in ("ref.model_path", "ref.model.path") if k in last), None)
    start = ref.value if ref is not None and ref.value is not None else context["model.path"]
    if path.value != start:
        errors.append(
            f"{path.given}={show.repr(path.value)} (from {path.source}): in verl's PRIME recipe the PRM's "
            f"starting weights; here the PRM starts from the reference model's ({start!r}, ref.model_path, "
            f"else model.path): set ref.model_path={path.value} to start the PRM (and the reference) there, "
            "or leave the key out"
        )
    return [*dropped, path]


def _rollout_is(level: Leaf, threshold: Leaf | None, errors: list[str]) -> list[Leaf]:
    """verl 0.9.1's ``algorithm.rollout_correction.rollout_is`` (null, token or sequence) with its
    ``rollout_is_threshold`` (verl's default 2.0; a number truncates the weights, verl's TIS) as our
    ``algorithm.rollout_is``, ``rollout_is_level`` and ``rollout_is_threshold``. Alone, the threshold is
    verl's default of a switched-off correction: nothing."""
    if level.value is None:
        return []
    if level.value not in ("token", "sequence"):
        errors.append(
            f"{level.given}={show.repr(level.value)} (from {level.source}) must be null, token or sequence"
        )
        return []
    bound: Any = 2.0 if threshold is None else threshold.value  # verl's default
    if isinstance(bound, str) and "_" in bound:
        errors.append(
            f"{threshold.given}={show.repr(bound)} (from {threshold.source}): a lower_upper pair is verl's "
            "IcePop (weights outside the bounds zeroed); here the weights are truncated at one upper bound"
        )
        return []
    source = threshold or level
    return [
        Leaf(level.given, ("algorithm", "rollout_is"), True, level.source),
        Leaf(level.given, ("algorithm", "rollout_is_level"), level.value, level.source),
        Leaf(source.given, ("algorithm", "rollout_is_threshold"), bound, source.source),
    ]
