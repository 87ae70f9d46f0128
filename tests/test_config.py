"""Config: precedence, coercion, clear errors, world-size validation, the --print-config CLI."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ppo.config import ConfigError, PPOConfig, all_keys, load_config, to_yaml

ROOT = Path(__file__).resolve().parents[1]


def write_yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def test_defaults_then_yaml_then_overrides(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "actor:\n  clip_ratio: 0.3\n  optim:\n    lr: 2.0e-5\nrollout:\n  n: 8\n")
    cfg = load_config(path, ["rollout.n=2", "actor.optim.lr=1e-6"])
    assert cfg.actor.clip_ratio == 0.3  # from YAML
    assert cfg.rollout.n == 2  # the command line wins over YAML
    assert cfg.actor.optim.lr == 1e-6  # "1e-6" (a YAML string, no dot) coerced to float
    assert cfg.critic.cliprange_value == PPOConfig().critic.cliprange_value  # default untouched


def test_override_types_are_coerced() -> None:
    cfg = load_config(
        None,
        [
            "actor.use_kl_loss=true",
            "data.train_files=one.parquet",
            "trainer.logger=[console,jsonl]",
            "trainer.profile_steps=[1,5]",
            "critic.model_path=null",
            "algorithm.gamma=1",
        ],
    )
    assert cfg.actor.use_kl_loss is True
    assert cfg.data.train_files == ["one.parquet"]  # a single file where a list is expected
    assert cfg.trainer.logger == ["console", "jsonl"]
    assert cfg.trainer.profile_steps == [1, 5]
    assert cfg.critic.model_path is None
    assert isinstance(cfg.algorithm.gamma, float)


def test_unknown_override_names_key_source_and_suggestions() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, ["actor.kl_coef=0.1"])
    msg = str(e.value)
    assert "'actor.kl_coef'" in msg and "command line" in msg
    assert "actor.kl_loss_coef" in msg and "algorithm.kl_ctrl.kl_coef" in msg


def test_unknown_yaml_key_names_the_file(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "rollout:\n  temprature: 0.7\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, [])
    msg = str(e.value)
    assert "'rollout.temprature'" in msg and str(path) in msg and "rollout.temperature" in msg


def test_unknown_section_suggests_section() -> None:
    with pytest.raises(ConfigError, match=r"'actr'.*did you mean actor"):
        load_config(None, ["actr.clip_ratio=0.1"])


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("rollout.n=abc", r"rollout.n='abc' \(from the command line\) is not a valid int"),
        ("actor.use_kl_loss=maybe", r"actor.use_kl_loss='maybe'.*not a valid bool"),
        ("actor.clip_ratio=[1,2]", r"actor.clip_ratio=\[1, 2\].*not a valid float"),
        ("actor.loss_agg_mode=mean", r"actor.loss_agg_mode='mean'.*must be one of token-mean"),
        ("rollout.n=2.5", r"rollout.n=2.5.*not a valid int"),
        ("actor=3", r"actor is a section"),
        ("novalue", r"must look like section.key=value"),
    ],
)
def test_wrong_type_names_key_value_and_type(override: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_config(None, [override])


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("actor.clip_ratio_c=1.0", "actor.clip_ratio_c must be > 1"),
        ("algorithm.kl_penalty=kl3", "algorithm.kl_penalty='kl3' is not a KL estimator"),
        ("actor.kl_loss_type=low_var_kl+", None),
        ("rollout.temperature=0", "rollout.temperature must be > 0"),
        ("trainer.logger=[console,mlflow]", "trainer.logger has unknown sinks"),
    ],
)
def test_value_checks(override: str, expected: str | None) -> None:
    if expected is None:
        load_config(None, [override])
        return
    with pytest.raises(ConfigError, match=expected):
        load_config(None, [override])


def test_group_estimators_need_several_samples() -> None:
    with pytest.raises(ConfigError, match="needs rollout.n >= 2"):
        load_config(None, ["algorithm.adv_estimator=grpo", "rollout.n=1"])
    assert not load_config(None, ["algorithm.adv_estimator=grpo"]).use_critic


def test_validate_world_size_names_what_to_change() -> None:
    cfg = load_config(None, ["data.train_batch_size=30", "actor.ppo_mini_batch_size=15"])
    cfg.validate(1)
    cfg.validate(2)
    with pytest.raises(ConfigError) as e:
        cfg.validate(4)  # 30 prompts do not split over 4 ranks
    assert "data.train_batch_size=30" in str(e.value) and "multiple of 4" in str(e.value)

    cfg = load_config(None, ["data.train_batch_size=32", "actor.ppo_mini_batch_size=12"])
    with pytest.raises(
        ConfigError, match=r"actor.ppo_mini_batch_size=12 must divide data.train_batch_size=32"
    ):
        cfg.validate(2)

    # 16 prompts x 4 samples / 2 ranks = 32 sequences per rank; micro-batches of 5 do not fit.
    cfg = load_config(None, ["actor.use_dynamic_bsz=false", "actor.ppo_micro_batch_size_per_gpu=5"])
    with pytest.raises(ConfigError, match=r"32 sequences per rank .* actor.ppo_micro_batch_size_per_gpu=5"):
        cfg.validate(2)
    load_config(None, ["actor.use_dynamic_bsz=false", "actor.ppo_micro_batch_size_per_gpu=8"]).validate(2)

    cfg = load_config(None, ["actor.ppo_max_token_len_per_gpu=50"])  # below 64 + 32
    with pytest.raises(ConfigError, match="actor.ppo_max_token_len_per_gpu=50 is below the longest"):
        cfg.validate(1)

    with pytest.raises(ConfigError, match="actor.fsdp.fsdp_size=3 must divide the world size 4"):
        load_config(None, ["actor.fsdp.fsdp_size=3"]).validate(4)


def test_yaml_round_trip(tmp_path: Path) -> None:
    cfg = load_config(None, ["rollout.n=3", "actor.optim.lr=3e-5", "critic.model_path=/x"])
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path, []) == cfg


def test_every_field_has_a_docstring() -> None:
    # A docstring under each field is how users learn the keys: each annotated field in a class body
    # must be followed by a string statement.
    tree = ast.parse((ROOT / "ppo" / "config.py").read_text())
    missing = []
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        body = cls.body
        for k, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                nxt = body[k + 1] if k + 1 < len(body) else None
                documented = isinstance(nxt, ast.Expr) and isinstance(
                    getattr(nxt, "value", None), ast.Constant
                )
                if not documented:
                    missing.append(f"{cls.name}.{stmt.target.id}")
    assert not missing, f"fields without a docstring: {missing}"
    assert len(all_keys(PPOConfig)) > 100  # the tree is real, not a stub


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "train_ppo.py"), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


def test_print_config_cli(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "rollout:\n  n: 2\n")
    out = run_cli("--config", str(path), "actor.clip_ratio=0.25", "--print-config")
    assert out.returncode == 0, out.stderr
    resolved = yaml.safe_load(out.stdout)
    assert resolved["rollout"]["n"] == 2 and resolved["actor"]["clip_ratio"] == 0.25

    out = run_cli("--print-config", "--world-size", "3")
    assert out.returncode != 0 and "multiple of 3" in out.stderr

    out = run_cli("--print-config", "rollout.nn=2")
    assert out.returncode != 0 and "rollout.n" in out.stderr and "Traceback" not in out.stderr
