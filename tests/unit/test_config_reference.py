"""docs/configuration.md is generated from the schema (scripts/config_reference.py): it must match what
the schema would generate now, so that a field, default or docstring changed in ppo/config/ changes
the reference with it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_generator():
    spec = importlib.util.spec_from_file_location(
        "config_reference", ROOT / "scripts" / "config_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_config_reference_is_up_to_date():
    gen = load_generator()
    text = gen.render()
    written = gen.OUT.read_text() if gen.OUT.exists() else ""
    assert written == text, f"docs/configuration.md is stale: regenerate it with `{gen.REGENERATE}`"


def test_every_key_of_every_schema_has_a_row():
    import ppo.config
    from ppo.config_keys import all_keys

    gen = load_generator()
    text = gen.render()
    for _, schema in gen.SCHEMAS:
        cls = getattr(ppo.config, schema)
        sections = {k for k in all_keys(cls) if any(j.startswith(k + ".") for j in all_keys(cls))}
        for key in set(all_keys(cls)) - sections:
            assert f"| `{key}` |" in text, f"{schema}: no row for {key}"


def test_verl_spellings_are_verl_keys_inverted():
    gen = load_generator()
    spellings = gen.verl_spellings()
    # VERL_KEYS["actor.optim.clip_grad"] renames to actor.grad_clip; verl's section is actor_rollout_ref.actor
    assert "actor_rollout_ref.actor.optim.clip_grad" in spellings["actor.grad_clip"]
    # the value table travels with it: verl's top_k=-1 is our 0
    assert any(s.startswith("actor_rollout_ref.rollout.top_k (-1 → 0") for s in spellings["rollout.top_k"])
