"""Values are read as the strings the user typed unless the key's type says otherwise: YAML 1.1's rewrites
(``010`` -> 8, ``12:30`` -> 750, ``1.10`` -> 1.1, ``0x1F`` -> 31, ``off`` -> false, dates) do not reach a key
that takes a string, and what the shell or a paste leaves half-done (an empty value, ``{lr}``, a ``#``,
Hydra's comma list, two presets, a preset without ``--config``, dotted keys and pasted command lines in a
YAML file) is one line naming the key, or taken as documented."""

from __future__ import annotations

from pathlib import Path

import pytest

from ppo.cli import parse_cli
from ppo.config import ConfigError
from ppo.config_loader import load_config, to_yaml
from tests.helpers import load_error


@pytest.mark.parametrize(
    "typed, yaml_reads",
    [
        ("010", 8),
        ("12:30", 750),
        ("1.10", 1.1),
        ("0x1F", 31),
        ("2026-12-05", "2026-12-05"),
        ("off", False),
        ("1e3", "1e3"),
    ],
)
def test_a_string_key_gets_what_was_typed(tmp_path: Path, typed: str, yaml_reads: object) -> None:
    import yaml

    assert yaml.safe_load(typed) == yaml_reads or typed == "2026-12-05"  # what YAML 1.1 makes of it
    cfg = load_config(None, [f"trainer.experiment_name={typed}"])
    assert cfg.trainer.experiment_name == typed
    preset = tmp_path / "p.yaml"
    preset.write_text(f"trainer:\n  experiment_name: {typed}\n  project_name: [{typed}]\n")
    with pytest.raises(ConfigError):  # project_name takes one string: a list stays an error
        load_config(preset)
    preset.write_text(f"trainer:\n  experiment_name: {typed}\ndata:\n  val_files: [{typed}, b.parquet]\n")
    cfg = load_config(preset)
    assert cfg.trainer.experiment_name == typed
    assert cfg.data.val_files == [typed, "b.parquet"]
    # the resolved config.yaml reads back to the same strings
    written = tmp_path / "config.yaml"
    written.write_text(to_yaml(cfg))
    assert load_config(written).trainer.experiment_name == typed


def test_number_and_boolean_keys_still_read_yaml_values() -> None:
    cfg = load_config(
        None, ["trainer.total_training_steps=0x10", "rollout.do_sample=off", "actor.optim.lr=1.10e-5"]
    )
    assert cfg.trainer.total_training_steps == 16
    assert cfg.rollout.do_sample is False
    assert cfg.actor.optim.lr == pytest.approx(1.1e-5)


def test_a_hash_on_the_command_line_is_part_of_the_value() -> None:
    # YAML cut "outputs/run #2" at " #": runs #1 and #2 shared a folder.
    one = load_config(None, ["trainer.output_dir=outputs/run #1"])
    two = load_config(None, ["trainer.output_dir=outputs/run #2"])
    assert (one.trainer.output_dir, two.trainer.output_dir) == ("outputs/run #1", "outputs/run #2")
    assert load_error(None, ["data.train_files=[a.parquet] # the old ones"]) == (
        "data.train_files='[a.parquet] # the old ones' (from the command line): ' #' starts a YAML comment, "
        "which would drop the rest; quote the value"
    )
    assert load_error(None, ["trainer.total_training_steps=5 # five"]).startswith(
        "trainer.total_training_steps='5 # five' (from the command line) is not a valid int"
    )


@pytest.mark.parametrize(
    "key", ["trainer.output_dir", "model.path", "reward.custom_function", "actor.optim.lr"]
)
def test_an_empty_value_is_refused(key: str) -> None:
    assert load_error(None, [f"{key}="]) == (
        f"{key}= (from the command line) has no value (an unset shell variable?): give one, null for none, "
        f"or {key}=\"''\" for an empty string"
    )


def test_an_empty_string_and_null_are_still_given_explicitly() -> None:
    cfg = load_config(None, ["trainer.experiment_name=''", "trainer.total_training_steps=null"])
    assert (cfg.trainer.experiment_name, cfg.trainer.total_training_steps) == ("", None)


@pytest.mark.parametrize("value", ["{lr}", "outputs/{name}", "{model_path}/actor"])
def test_an_unfilled_placeholder_is_refused_where_the_preset_sets_the_key_too(
    tmp_path: Path, value: str
) -> None:
    preset = tmp_path / "p.yaml"
    preset.write_text("actor:\n  optim:\n    lr: 1.0e-6\ntrainer:\n  output_dir: outputs/x\n")
    for key in ("actor.optim.lr", "trainer.output_dir"):
        placeholder = value[value.index("{") : value.index("}") + 1]
        assert load_error(preset, [f"{key}={value}"]) == (
            f"{key}={value!r} (from the command line): {placeholder} is an unfilled placeholder (a shell or "
            "f-string variable that was not substituted): give the value"
        )


def test_a_mapping_value_is_still_a_mapping() -> None:
    cfg = load_config(None, ["model.override_config={attention_dropout: 0.1}"])
    assert cfg.model.override_config == {"attention_dropout": 0.1}


def test_hydras_comma_list_says_how_to_write_a_list() -> None:
    assert load_error(None, ["data.train_files=a.parquet,b.parquet"]) == (
        "data.train_files='a.parquet,b.parquet' (from the command line) is one string, not a list: write "
        "[a.parquet,b.parquet] (Hydra reads a,b as a sweep, which is not run here); one name that holds a "
        "comma: \"data.train_files=['a.parquet,b.parquet']\""
    )
    cfg = load_config(None, ["data.train_files=[a.parquet,b.parquet]", "data.val_files=['x,y.parquet']"])
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]
    assert cfg.data.val_files == ["x,y.parquet"]


def test_two_presets_are_refused_and_a_bare_preset_names_config(tmp_path: Path) -> None:
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("rollout:\n  n: 4\n")
    b.write_text("rollout:\n  n: 8\n")
    with pytest.raises(ConfigError) as e:
        parse_cli(["--config", str(a), "--config", str(b)])
    assert str(e.value) == (
        f"--config is given 2 times ({a}, {b}): a run takes one preset; give the keys of the others as "
        "key=value overrides (from the command line)"
    )
    cfg, args = parse_cli(["--config", str(a), "rollout.temperature=0.5"])
    assert (cfg.rollout.n, args.config) == (4, str(a))
    assert load_error(None, ["configs/grpo.yaml"]) == (
        "'configs/grpo.yaml' (from the command line) looks like a preset file: give it as --config configs/grpo.yaml"
    )


def test_a_presets_dotted_key_is_the_nested_one(tmp_path: Path) -> None:
    preset = tmp_path / "p.yaml"
    preset.write_text(
        "algorithm.adv_estimator: grpo\nactor_rollout_ref.rollout.n: 4\ntrainer:\n  experiment_name: x\n"
        "model.override_config.attention_dropout: 0.1\n"
    )
    cfg = load_config(preset)
    assert (cfg.algorithm.adv_estimator, cfg.rollout.n, cfg.trainer.experiment_name) == ("grpo", 4, "x")
    assert cfg.model.override_config == {"attention_dropout": 0.1}
    preset.write_text("algorithm.adv_estimator: grpo\nalgorithm:\n  adv_estimator: rloo\n")
    assert (
        load_error(preset)
        == f"{preset}: algorithm.adv_estimator is set twice (once as a dotted key, once nested): keep one"
    )


@pytest.mark.parametrize(
    "text, line",
    [
        # folded by YAML into the value of the key above: it was blamed on trainer.total_epochs
        (
            "trainer:\n  total_epochs: 2\n    actor_rollout_ref.actor.optim.lr=1e-6 \\\n    data.train_batch_size=8\n",
            3,
        ),
        # at the top level, where it breaks the YAML further down
        ("trainer:\n  total_epochs: 2\nactor_rollout_ref.actor.optim.lr=1e-6 \\\n  x: [\n", 3),
        ("actor_rollout_ref.actor.optim.lr=1e-6\n", 1),
    ],
)
def test_pasted_command_line_overrides_in_a_preset_name_their_line(
    tmp_path: Path, text: str, line: int
) -> None:
    preset = tmp_path / "p.yaml"
    preset.write_text(text)
    assert load_error(preset) == (
        f"{preset}, line {line}: 'actor_rollout_ref.actor.optim.lr=1e-6' is a command-line override (key=value), "
        "not YAML: in a YAML file write 'actor_rollout_ref.actor.optim.lr: 1e-6' (or nest it under its "
        "sections), or pass it on the command line"
    )


def test_quoted_and_block_text_may_hold_overrides(tmp_path: Path) -> None:
    preset = tmp_path / "p.yaml"
    preset.write_text(
        "trainer:\n  experiment_name: 'lr=1e-6 a.b=2'\ndata:\n  apply_chat_template_kwargs:\n    note: |\n"
        "      x.y=1\n"
    )
    cfg = load_config(preset)
    assert cfg.trainer.experiment_name == "lr=1e-6 a.b=2"
