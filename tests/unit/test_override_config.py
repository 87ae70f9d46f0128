"""Tests of ``model.override_config`` and ``critic.override_config`` (verl's ``override_config``) without
loading weights: the fields set on a Hugging Face config and the errors for a field it does not have
(``ppo.model_loading``), the attention kernel it may name and the start-up check of a run's overrides
(``ppo.model_setup``), and the resume comparison (``ppo.checkpointer``).

The model folders here hold a ``config.json`` and nothing else: every check reads that file only.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
from transformers import LlamaConfig

from ppo.checkpointer import flatten, tree_differences
from ppo.config import ConfigError
from ppo.config_loader import load_config, to_dict
from ppo.model_loading import load_config as load_model_config
from ppo.model_setup import attention_choice, check_attention_dropout, check_override_configs
from ppo.override_config import ConfigOverride, apply_override_config, merge_fields, parse_override_config
from tests.helpers import tiny_config


@pytest.fixture
def config_only(tmp_path: Path) -> Path:
    """A model folder with only its ``config.json``: a tiny Llama (max_position_embeddings 128, attention
    dropout 0.2 as saved)."""
    tiny_config(attention_dropout=0.2).save_pretrained(tmp_path)
    return tmp_path


def run_config(*overrides: str) -> Any:
    return load_config(None, list(overrides))


# ----------------------------------------------------------------------------------------------------
# The fields set on the config
# ----------------------------------------------------------------------------------------------------


def test_fields_are_set_after_dropout_is_turned_off(config_only: Path) -> None:
    plain = load_model_config(str(config_only))
    assert plain.attention_dropout == 0.0 and plain.max_position_embeddings == 128  # dropout off as saved
    config = load_model_config(
        str(config_only), override_config={"max_position_embeddings": 32768, "attention_dropout": 0.1}
    )
    assert config.max_position_embeddings == 32768
    assert config.attention_dropout == 0.1  # the user's explicit dropout is kept


def test_a_field_the_config_lacks_is_an_error_naming_it(config_only: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_model_config(str(config_only), override_config={"max_position_embedingz": 32768})
    assert str(err.value) == (
        f"model.override_config.max_position_embedingz: the model config (LlamaConfig at {config_only}) has "
        "no such field; did you mean model.override_config.max_position_embeddings?"
    )
    with pytest.raises(ConfigError) as err:
        load_model_config(
            str(config_only), override_config={"rope_theta": 1e6}, override_key="critic.override_config"
        )
    assert str(err.value) == (
        f"critic.override_config.rope_theta: the model config (LlamaConfig at {config_only}) has no such field "
        "(it is a key of rope_parameters: set critic.override_config.rope_parameters.rope_theta)"
    )


@pytest.mark.parametrize(
    "override,message",
    [
        ({"max_position_embeddings": "long"}, "expected an integer (the config holds 128), got 'long'"),
        ({"max_position_embeddings": 1.5}, "expected an integer (the config holds 128), got 1.5"),
        ({"tie_word_embeddings": 1}, "expected true or false (the config holds False), got 1"),
    ],
)
def test_a_value_of_another_type_is_an_error(override: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        apply_override_config(tiny_config(), override, "model.override_config", where="here")
    assert str(err.value) == f"model.override_config.{next(iter(override))}: {message}"


def test_a_mapping_is_merged_into_a_dict_field() -> None:
    config = tiny_config()  # rope_parameters {rope_theta: 10000.0, rope_type: default}
    # "1e6" is how YAML 1.1 (the command line's parser) reads 1e6: a float field takes it as the number.
    apply_override_config(config, {"rope_parameters": {"rope_theta": "1e6"}}, "k", where="here")
    assert config.rope_parameters == {"rope_theta": 1e6, "rope_type": "default"}
    with pytest.raises(ConfigError) as err:
        apply_override_config(config, {"rope_parameters": {"rope_theta": "big"}}, "k", where="here")
    assert (
        str(err.value)
        == "k.rope_parameters.rope_theta: expected a number (the config holds 1000000.0), got 'big'"
    )
    # verl's pre-transformers-5 spelling: rope_scaling with a legacy `type`; rope_theta stays.
    config = tiny_config()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers: rope_scaling is deprecated
        apply_override_config(
            config,
            {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}},
            "k",
            where="here",
        )
    assert config.rope_parameters["rope_type"] == "yarn"
    assert config.rope_parameters["rope_theta"] == 10000.0
    assert config.rope_parameters["factor"] == 4.0


def test_merge_fields_nests() -> None:
    current = {"full": {"rope_theta": 1.0, "rope_type": "default"}, "sliding": {"rope_theta": 2.0}}
    assert merge_fields(current, {"full": {"rope_theta": 3.0}}) == {
        "full": {"rope_theta": 3.0, "rope_type": "default"},
        "sliding": {"rope_theta": 2.0},
    }
    assert current["full"]["rope_theta"] == 1.0  # not changed in place


def test_a_mapping_for_a_sub_config_sets_its_fields() -> None:
    config = LlamaConfig()
    config.sub = tiny_config()  # stands for a composite model's text_config
    config.to_dict = lambda: {"sub": {}}  # the field list _has_field reads
    apply_override_config(
        config, {"sub": {"max_position_embeddings": 512}}, "model.override_config", where="x"
    )
    assert config.sub.max_position_embeddings == 512
    with pytest.raises(
        ConfigError, match=r"^model\.override_config\.sub\.nope: the model config \(LlamaConfig"
    ):
        apply_override_config(config, {"sub": {"nope": 1}}, "model.override_config", where="x")


# ----------------------------------------------------------------------------------------------------
# verl's layout: model_config nesting, attn_implementation
# ----------------------------------------------------------------------------------------------------


def test_parse_reads_verls_layout() -> None:
    assert parse_override_config({"max_position_embeddings": 8}, "model.override_config") == ConfigOverride(
        fields={"max_position_embeddings": 8}, key="model.override_config"
    )
    nested = parse_override_config(
        {"model_config": {"max_position_embeddings": 8}, "attn_implementation": "eager"},
        "critic.override_config",
    )
    assert nested == ConfigOverride(
        fields={"max_position_embeddings": 8},
        key="critic.override_config.model_config",
        attn_implementation="eager",
    )
    with pytest.raises(ConfigError) as err:
        parse_override_config({"model_config": {}, "rope_theta": 1.0}, "model.override_config")
    assert str(err.value) == (
        "model.override_config: rope_theta beside model_config, whose fields are the only ones verl applies; "
        "move them under model.override_config.model_config (or drop the model_config level)"
    )


def test_attention_from_the_override() -> None:
    eager = ConfigOverride(fields={}, key="model.override_config", attn_implementation="eager")
    assert attention_choice("auto", eager) == "eager"
    assert attention_choice("eager", eager) == "eager"
    assert attention_choice("sdpa", ConfigOverride(fields={}, key="k")) == "sdpa"
    with pytest.raises(ConfigError) as err:
        attention_choice("sdpa", eager)
    assert str(err.value) == (
        "model.override_config.attn_implementation=eager and model.attn_implementation=sdpa disagree: set one "
        "of them"
    )
    flash3 = ConfigOverride(fields={}, key="model.override_config", attn_implementation="flash_attention_3")
    with pytest.raises(ConfigError) as err:
        attention_choice("auto", flash3)
    assert str(err.value) == (
        "model.override_config.attn_implementation=flash_attention_3: not an attention kernel of this trainer; "
        "use one of auto, ppo_varlen_flash, ppo_varlen_sdpa, sdpa, eager, flash_attention_2"
    )


# ----------------------------------------------------------------------------------------------------
# A run's overrides at start-up, and on resume
# ----------------------------------------------------------------------------------------------------


def test_verls_dapo_key_reaches_the_actors_override() -> None:
    cfg = run_config("+actor_rollout_ref.model.override_config.max_position_embeddings=32768")
    assert cfg.model.override_config == {"max_position_embeddings": 32768}
    assert cfg.critic.override_config == {}
    cfg = run_config("+critic.model.override_config.attention_dropout=0.1")
    assert cfg.critic.override_config == {"attention_dropout": 0.1} and cfg.model.override_config == {}


def test_start_up_check_reads_config_json_only(config_only: Path, tmp_path: Path) -> None:
    model = f"model.path={config_only}"
    check_override_configs(run_config(model, "model.override_config.max_position_embeddings=512"))
    with pytest.raises(
        ConfigError, match=r"^model\.override_config\.max_position_embedingz: the model config"
    ):
        check_override_configs(run_config(model, "model.override_config.max_position_embedingz=512"))
    # The critic (GAE) is checked against its own config, with the fields its loader sets (classifier_dropout).
    gae = [model, "algorithm.adv_estimator=gae"]
    check_override_configs(run_config(*gae, "critic.override_config.classifier_dropout=0.1"))
    with pytest.raises(ConfigError, match=r"^critic\.override_config\.hidden_sizee: .*did you mean"):
        check_override_configs(run_config(*gae, "critic.override_config.hidden_sizee=1"))
    with pytest.raises(ConfigError, match=r"^model\.override_config\.attn_implementation=flex_attention: "):
        check_override_configs(run_config(model, "model.override_config.attn_implementation=flex_attention"))


def test_start_up_check_names_a_critic_override_without_a_critic(
    config_only: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = run_config(
        f"model.path={config_only}", "algorithm.adv_estimator=grpo", "critic.override_config.hidden_sizee=1"
    )
    with caplog.at_level(logging.WARNING, logger="ppo"):
        check_override_configs(cfg)  # nothing loads it, so nothing to check against
    assert caplog.messages == [
        "critic.override_config is set but this run has no critic (algorithm.adv_estimator=grpo): unused"
    ]


def test_resume_compares_overrides_field_by_field() -> None:
    saved = flatten(to_dict(run_config("model.override_config.max_position_embeddings=512")))
    same = flatten(to_dict(run_config("model.override_config.max_position_embeddings=512")))
    assert tree_differences(saved, same, ("model.override_config", "critic.override_config")) == []
    now = flatten(
        to_dict(
            run_config(
                "model.override_config.max_position_embeddings=1024",
                "critic.override_config.rope_parameters.rope_theta=1000000.0",
            )
        )
    )
    assert tree_differences(saved, now, ("model.override_config", "critic.override_config")) == [
        "critic.override_config.rope_parameters.rope_theta: (unset) -> 1000000.0",
        "model.override_config.max_position_embeddings: 512 -> 1024",
    ]
    # A checkpoint from before the key existed equals an empty override.
    old = {k: v for k, v in saved.items() if not k.startswith("model.override_config")}
    empty = flatten(to_dict(run_config()))
    assert tree_differences(old, empty, ("model.override_config",)) == []


def test_attention_dropout_needs_a_kernel_with_dropout() -> None:
    dropout = ConfigOverride(fields={"attention_dropout": 0.1}, key="model.override_config")
    check_attention_dropout("ppo_varlen_sdpa", dropout)  # sdpa per sequence passes dropout_p on
    check_attention_dropout("ppo_varlen_flash", ConfigOverride(fields={"attention_dropout": 0.0}, key="k"))
    with pytest.raises(ConfigError) as err:
        check_attention_dropout("ppo_varlen_flash", dropout)
    assert str(err.value) == (
        "model.override_config.attention_dropout=0.1: the attention kernel ppo_varlen_flash has no dropout; set "
        "model.attn_implementation=ppo_varlen_sdpa (or flash_attention_2, sdpa), or leave the dropout off"
    )
