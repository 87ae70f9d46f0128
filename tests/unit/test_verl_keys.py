"""Every key of verl 0.9.1's PPO trainer has a decided fate here: translated to ours, accepted with a
warning that says why it changes nothing, or refused with the reason, and refused only when it turns on
what this trainer lacks (its default is never refused).

The keys and defaults are those of the installed release's ``_generated_ppo_trainer.yaml`` (``make
parity-env`` installs verl 0.9.1 without its dependencies into ``.verl091/``), its interpolations resolved
by the OmegaConf of that folder, in a subprocess so that nothing of it is imported here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ppo.config import ConfigError, PPOConfig
from ppo.config_loader import load_config
from tests.helpers import VERL_SIDE

SIDE = VERL_SIDE
GENERATED = SIDE / "verl" / "trainer" / "config" / "_generated_ppo_trainer.yaml"

pytestmark = pytest.mark.skipif(
    not GENERATED.is_file() or not (SIDE / "omegaconf").is_dir(),
    reason="verl 0.9.1 side environment absent: run `make parity-env`",
)


def verl_defaults() -> dict:
    """verl 0.9.1's PPO trainer config with its interpolations resolved."""
    code = (
        "import json, sys; from omegaconf import OmegaConf; "
        "print(json.dumps(OmegaConf.to_container(OmegaConf.load(sys.argv[1]), resolve=True)))"
    )
    env = {**os.environ, "PYTHONPATH": str(SIDE)}
    out = subprocess.run(
        [sys.executable, "-c", code, str(GENERATED)], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(out.stdout)


def leaves(tree: dict, prefix: str = "") -> list[tuple[str, object]]:
    """(dotted key, value) of every leaf; an empty mapping is a leaf."""
    out = []
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out += leaves(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


def override(key: str, value: object) -> str:
    """``key=value`` as a verl user writes it on the command line (the value in YAML's flow style)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9).strip()
    return f"{key}={text.removesuffix('...').strip()}"


@pytest.fixture(scope="module")
def verl_leaves() -> list[tuple[str, object]]:
    return leaves(verl_defaults())


def test_every_default_of_verl_is_taken_alone(verl_leaves: list[tuple[str, object]]) -> None:
    # verl derives its engine's lengths from the data's (an interpolation): give the data's alongside.
    config = verl_defaults()["data"]
    lengths = [override(f"data.{k}", config[k]) for k in ("max_prompt_length", "max_response_length")]
    problems = []
    for key, value in verl_leaves:
        try:
            load_config(None, [*lengths, override(key, value)], notes=[])
        except ConfigError as e:  # unknown, or refused although it is verl's default
            problems.append(str(e))
    assert len(verl_leaves) > 700  # the walk covers the release's keys, not an empty file
    assert problems == []


def test_verl_defaults_as_one_command_line_and_as_a_file(
    verl_leaves: list[tuple[str, object]], tmp_path: Path
) -> None:
    notes: list[str] = []
    cfg = load_config(None, [override(k, v) for k, v in verl_leaves], notes=notes)
    path = tmp_path / "verl.yaml"
    path.write_text(yaml.safe_dump(verl_defaults(), sort_keys=False))
    assert load_config(path, []) == cfg
    # verl's values of keys we share become ours; the engine name is a warning, not a refusal.
    assert (cfg.rollout.n, cfg.algorithm.kl_ctrl.kl_coef, cfg.actor.clip_ratio) == (1, 0.001, 0.2)
    assert not any(n.startswith("actor_rollout_ref.rollout.name=") for n in notes), "'???' is verl's unset"


@pytest.mark.parametrize(
    ("override_", "fragment"),
    [
        ("distillation.enabled=true", "distillation.enabled=true needs a teacher"),
        ("actor_rollout_ref.actor.qat.enable=true", "quantization-aware training is not available here"),
        ("actor_rollout_ref.actor.fsdp_config.qat.enable=true", "quantization-aware training"),
        ("skip.rollout.enable=true", "rollouts are always generated here"),
        ("trainer.v1.trainer_mode=separate_async", "training here is synchronous"),
        ("actor_rollout_ref.model.lora.rank=8", "takes lora_rank, which is actor.lora.rank here"),
        ("actor_rollout_ref.rollout.mtp.enable=true", "multi-token prediction"),
        ("actor_rollout_ref.actor.optim.zero_indexed_step=false", "counts steps from 0 here"),
        ("trainer.checkpoint_callback_class=my.Callback", "no callback runs after a checkpoint here"),
        ("actor_rollout_ref.rollout.prompt_length=100", "ours is data.max_prompt_length"),
    ],
)
def test_a_refused_feature_is_refused_when_turned_on(override_: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        load_config(None, [override_])


def test_verl_091_reward_section_translates() -> None:
    notes: list[str] = []
    cfg = load_config(
        None,
        [
            "reward.reward_model.enable=true",
            "reward.reward_model.model_path=/models/rm",
            "reward.reward_model.rollout.gpu_memory_utilization=0.8",
            "reward.custom_reward_function.path=/code/score.py",
            "reward.custom_reward_function.name=my_score",
            "reward_model.num_workers=8",
            "algorithm.filter_groups.metric=reward",
        ],
        notes=notes,
    )
    assert (cfg.reward.style, cfg.reward.model_path) == ("model", "/models/rm")
    assert cfg.reward.custom_function == "/code/score.py:my_score"
    # verl's reward-worker count is Ray's, not a process pool per rank (with 8, the reward model hung).
    assert cfg.reward.pool_workers == 0
    assert any(n.startswith("reward_model.num_workers=8") for n in notes)
    # verl's "reward" metric: the score with the overlong penalty, before KL.
    assert cfg.algorithm.filter_groups.metric == "seq_reward"
    assert isinstance(cfg, PPOConfig)


def test_verl_091_rollout_correction_is_ours() -> None:
    # 0.9.1's spellings set the fields of 0.6.0's (algorithm.rollout_is*), which stay ours.
    offline = ["algorithm.adv_estimator=grpo", "rollout.offline_fraction=0.5"]
    section = "algorithm.rollout_correction"
    cfg = load_config(
        None, [*offline, f"{section}.rollout_is=sequence", f"{section}.rollout_is_threshold=3.0"]
    )
    alg = cfg.algorithm
    assert (alg.rollout_is, alg.rollout_is_level, alg.rollout_is_threshold) == (True, "sequence", 3.0)
    alg = load_config(None, [*offline, f"{section}.rollout_is=token"]).algorithm
    assert (alg.rollout_is, alg.rollout_is_level, alg.rollout_is_threshold) == (
        True,
        "token",
        2.0,
    )  # verl's 2.0
    # verl's defaults (rollout_is null, threshold 2.0, bypass off) switch nothing on.
    defaults = [
        f"{section}.rollout_is=null",
        f"{section}.rollout_is_threshold=2.0",
        f"{section}.bypass_mode=false",
    ]
    assert (
        load_config(None, [*defaults, f"{section}.rollout_rs=null"]).algorithm
        == load_config(None, []).algorithm
    )
    # Rejection sampling: verl's criteria and bounds are ours (a YAML number reads as its string).
    alg = load_config(
        None,
        [
            *offline,
            f"{section}.rollout_rs=token_k2,seq_mean_k1",
            f"{section}.rollout_rs_threshold=0.05,0.5_2",
        ],
    ).algorithm
    assert (alg.rollout_rs, alg.rollout_rs_threshold, alg.rollout_is_threshold) == (
        "token_k2,seq_mean_k1",
        "0.05,0.5_2",
        None,
    )
    assert load_config(
        None, [*offline, "algorithm.rollout_rs=seq_max_k3", "algorithm.rollout_rs_threshold=0.1"]
    )
    for wrong, fragment in [
        (f"{section}.rollout_rs=token_k4", "known are token_k1"),
        (f"{section}.rollout_rs_threshold=0.1_0.2", "one upper bound > 0"),  # k2 takes no ratio pair
        ("rollout.offline_fraction=0", "only offline data records"),
    ]:
        args = [*offline, f"{section}.rollout_rs=token_k2", f"{section}.rollout_rs_threshold=0.1", wrong]
        with pytest.raises(ConfigError, match=fragment):
            load_config(None, args)
    with pytest.raises(ConfigError, match="rollout_rs_threshold must give"):
        load_config(None, [*offline, f"{section}.rollout_rs=token_k2"])
    for refused, fragment in [
        (f"{section}.rollout_is_threshold=0.5_2.0", "IcePop"),
        (f"{section}.bypass_mode=true", "verl's decoupled mode"),
        (f"{section}.rollout_is=geometric", "must be null, token or sequence"),
    ]:
        with pytest.raises(ConfigError, match=fragment):
            load_config(None, [*offline, f"{section}.rollout_is=token", refused])


def test_a_default_is_named_as_the_default_beside_a_set_key_of_its_section() -> None:
    # The bug: a section's source was its last key's, so the default adv_estimator was "from the command
    # line, as algorithm.rollout_correction.rollout_is".
    with pytest.raises(ConfigError) as e:
        load_config(None, ["algorithm.rollout_correction.rollout_is=token", "rollout.offline_fraction=0.5"])
    assert (
        "(algorithm.adv_estimator from the defaults; rollout.offline_fraction from the command line)"
        in str(e.value)
    )


def test_verl_reward_num_workers_starts_no_pool() -> None:
    """verl 0.9.1's reward.num_workers (its Ray reward workers, default 8) was once our per-rank scoring
    pool: a verl config that set it started 8 processes per rank. It is verl's key, in either spelling:
    ignored with a note that names the pool's key, reward.pool_workers, and it starts nothing."""
    from ppo.build import make_reward_pool

    function = "reward.custom_function=tests/reward_fns.py:digit_score"
    for spelling in ("reward.num_workers=8", "reward_model.num_workers=8"):
        notes: list[str] = []
        cfg = load_config(None, [spelling, function], notes=notes)
        assert cfg.reward.pool_workers == 0
        assert make_reward_pool(cfg) is None
        (note,) = [n for n in notes if "num_workers" in n]
        assert note.startswith(f"{spelling} (from the command line)") and "reward.pool_workers" in note, note
    both = load_config(None, ["reward.num_workers=8", "reward.pool_workers=2", function], notes=[])
    assert both.reward.pool_workers == 2
