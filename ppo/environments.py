"""The user's multi-turn environment class (``rollout.multi_turn.env``): loaded and checked without torch,
so ``--print-config`` and the trainer's start-up (``multi_turn.make_settings``) refuse the same classes in
the same words::

    env_class = check_environment("my_env.py:Calc")   # EnvError: one line naming the key

A class must have ``reset(row)`` and ``step(action_text)`` methods and be instantiable with no arguments
(one instance per trajectory; ``reset`` gets the prompt's row).
"""

from __future__ import annotations

from ppo.user_code import UserCodeError, load_user_object


class EnvError(UserCodeError):
    """The environment class cannot be loaded, or a call returned something the loop cannot use."""


def load_environment(spec: str) -> type:
    """The environment class of ``rollout.multi_turn.env`` (``file.py:Class`` or ``module:Class``), checked
    for ``reset`` and ``step`` methods; EnvError (one line naming the key) otherwise."""
    cls = load_user_object(spec, key="rollout.multi_turn.env", default_name=None, error=EnvError)
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if not isinstance(cls, type) or missing:
        raise EnvError(
            f"rollout.multi_turn.env={spec!r} must be a class with reset(row) and step(action_text) methods"
            + (f"; it has no {', '.join(missing)}" if missing else "")
        )
    return cls


def check_environment(spec: str) -> type:
    """``load_environment``, and one instance made with no arguments, as the turn loop makes one per
    trajectory: an ``__init__`` that raises or needs arguments is an EnvError naming it."""
    env_class = load_environment(spec)
    try:
        env_class()
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # one instance per trajectory, made with no arguments
        raise EnvError(
            f"rollout.multi_turn.env={spec!r}: {env_class.__name__}() raised {type(e).__name__}: {e} "
            "(the class is instantiated with no arguments, one per trajectory; reset(row) gets the row)"
        ) from None
    return env_class
