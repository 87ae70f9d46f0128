"""Config: precedence, coercion, clear errors, world-size validation, the --print-config CLI.

Every loading error is one line naming the full dotted key and its source (the YAML file and line, or
the command line); the tables below cover each duplicate-key shape, malformed file, bad override and
out-of-range field, and the rule that an override changes its key and nothing else.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import random
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

import train_ppo
from ppo.algorithms import ADV_ESTIMATORS, KL_KINDS, LOSS_AGG_MODES
from ppo.cli import parse_cli
from ppo.config import (
    ActorConfig,
    AlgorithmConfig,
    ConfigError,
    CriticConfig,
    DistillationLossConfig,
    DPOConfig,
    FSDPConfig,
    OptimConfig,
    PolicyLossConfig,
    PPOConfig,
    RewardConfig,
    RewardModelConfig,
    SFTConfig,
    StageTrainerConfig,
    TrainerConfig,
    check_kl_kind,
    validate_stage,
)
from ppo.config_keys import all_keys
from ppo.config_loader import load_config, to_dict, to_yaml
from tests.helpers import demo_inputs, load_error, load_script

ROOT = Path(__file__).resolve().parents[2]


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
        ("trainer.logger=[console,neptune]", "trainer.logger has unknown sinks"),
        ("reward.weights=[1.0]", "reward.weights is set but custom_function is not"),
        ("reward.custom_function=[a.py:f,b.py:g] reward.weights=[1.0]", "reward.weights has 1 values for 2"),
        ("reward.custom_function=[]", "reward.custom_function is an empty list"),
    ],
)
def test_value_checks(override: str, expected: str | None) -> None:
    if expected is None:
        load_config(None, override.split())
        return
    with pytest.raises(ConfigError, match=expected):
        load_config(None, override.split())


def test_group_estimators_need_several_samples() -> None:
    with pytest.raises(ConfigError, match="needs rollout.n >= 2"):
        load_config(None, ["algorithm.adv_estimator=grpo", "rollout.n=1"])
    assert not load_config(None, ["algorithm.adv_estimator=grpo"]).use_critic


def demo(*overrides: str) -> PPOConfig:
    """The defaults with the demo's model and data named (a run needs them) and ``overrides``."""
    return load_config(None, [*demo_inputs(), *overrides])


def test_validate_world_size_names_what_to_change() -> None:
    cfg = demo("data.train_batch_size=30", "actor.ppo_mini_batch_size=15")
    cfg.validate(1)
    cfg.validate(2)
    with pytest.raises(ConfigError) as e:
        cfg.validate(4)  # 30 prompts do not split over 4 ranks
    assert "data.train_batch_size=30" in str(e.value) and "multiple of 4" in str(e.value)

    cfg = demo("data.train_batch_size=32", "actor.ppo_mini_batch_size=12")
    with pytest.raises(
        ConfigError, match=r"actor.ppo_mini_batch_size=12 must divide data.train_batch_size=32"
    ):
        cfg.validate(2)

    # 16 prompts x 4 samples / 2 ranks = 32 sequences per rank; micro-batches of 5 do not fit.
    cfg = demo("actor.use_dynamic_bsz=false", "actor.ppo_micro_batch_size_per_gpu=5")
    with pytest.raises(ConfigError, match=r"32 sequences per rank .* actor.ppo_micro_batch_size_per_gpu=5"):
        cfg.validate(2)
    demo("actor.use_dynamic_bsz=false", "actor.ppo_micro_batch_size_per_gpu=8").validate(2)

    cfg = demo("actor.ppo_max_token_len_per_gpu=50")  # below 64 + 32
    with pytest.raises(ConfigError, match="actor.ppo_max_token_len_per_gpu=50 is below the longest"):
        cfg.validate(1)

    with pytest.raises(ConfigError, match="actor.fsdp.fsdp_size=3 must divide the world size 4"):
        demo("actor.fsdp.fsdp_size=3").validate(4)


def test_nnodes_and_gpus_per_node_hold_the_run_to_its_size() -> None:
    # verl's keys: a preset sized for 1 x 8 ranks refuses a launch of 4 ranks; unset, any size runs.
    sized = demo("trainer.nnodes=1", "trainer.n_gpus_per_node=8")
    assert sized.trainer.planned_world_size == 8
    sized.validate(8)
    with pytest.raises(
        ConfigError, match=r"trainer.nnodes=1 x trainer.n_gpus_per_node=8 = 8 ranks, but 4 run"
    ):
        sized.validate(4)
    assert demo().trainer.planned_world_size is None
    demo().validate(4)
    assert load_config(None, ["trainer.nnodes=2"]).trainer.planned_world_size == 2


def test_yaml_round_trip(tmp_path: Path) -> None:
    cfg = load_config(None, ["rollout.n=3", "actor.optim.lr=3e-5", "critic.model_path=/x"])
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path, []) == cfg


def test_every_field_has_a_docstring() -> None:
    # A docstring under each field is how users learn the keys: each annotated field in a class body
    # must be followed by a string statement.
    classes = [
        node
        for path in sorted((ROOT / "ppo" / "config").glob("*.py"))
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.ClassDef)
    ]
    assert {"PPOConfig", "ActorConfig", "SFTConfig", "StageRunConfig"} <= {c.name for c in classes}
    missing = []
    for cls in classes:
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


@pytest.mark.slow
def test_print_config_cli(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "rollout:\n  n: 2\n")
    out = run_cli(
        "--config",
        str(path),
        *demo_inputs(),
        "actor.clip_ratio=0.25",
        "--print-config",
        "--allow-missing-paths",
    )
    assert out.returncode == 0, out.stderr
    resolved = yaml.safe_load(out.stdout)
    assert resolved["rollout"]["n"] == 2 and resolved["actor"]["clip_ratio"] == 0.25

    out = run_cli("--print-config", "--world-size", "3", *demo_inputs())
    assert out.returncode != 0 and "multiple of 3" in out.stderr

    out = run_cli("--print-config", "rollout.nn=2")
    assert out.returncode != 0 and "rollout.n" in out.stderr and "Traceback" not in out.stderr


# ----------------------------------------------------------------------------------------------------
# Robust loading: every problem is one line naming the full key and where the value came from
# ----------------------------------------------------------------------------------------------------

CLASSES = [PPOConfig, SFTConfig, RewardModelConfig, DPOConfig]


def one_problem_a_line(message: str) -> bool:
    """A config error is one line, or ``N problems:`` followed by exactly N lines ``  - ...`` (every
    problem of a file or command line reported at once)."""
    head, *rest = message.split("\n")
    if not rest:
        return True
    count = head.removeprefix("config error: ").split(" problems:")[0]
    return (
        head.endswith("problems:")
        and count.isdigit()
        and int(count) == len(rest)
        and all(line.startswith("  - ") and len(line) > 4 for line in rest)
    )


def leaf_types(cls: type, prefix: str = "") -> dict[str, tuple[type, str, Any]]:
    """Every leaf key of a config class: dotted key -> (the section class, field name, type)."""
    out = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        typ = hints[f.name]
        if dataclasses.is_dataclass(typ):
            out.update(leaf_types(typ, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = (cls, f.name, typ)
    return out


def flat(cfg: Any) -> dict[str, Any]:
    """The config as {dotted key: value}."""

    def walk(d: dict, prefix: str) -> dict[str, Any]:
        out = {}
        for k, v in d.items():
            out.update(walk(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    return walk(to_dict(cfg), "")


def nested_yaml(overrides: list[str]) -> str:
    """The YAML file that sets the same keys as ``section.key=value`` overrides."""
    tree: dict = {}
    for item in overrides:
        key, _, raw = item.partition("=")
        *sections, leaf = key.split(".")
        node = tree
        for s in sections:
            node = node.setdefault(s, {})
        node[leaf] = yaml.safe_load(raw)
    return yaml.safe_dump(tree)


@pytest.mark.parametrize(
    ("text", "key", "line"),
    [
        ("actor:\n  clip_ratio: 0.1\n  clip_ratio: 0.2\n", "actor.clip_ratio", 3),
        ("actor:\n  optim:\n    lr: 1.0e-5\n    eps: 1.0e-8\n    lr: 2.0e-5\n", "actor.optim.lr", 5),
        (
            "actor:\n  fsdp:\n    mixed_precision:\n      param_dtype: bfloat16\n      param_dtype: float32\n",
            "actor.fsdp.mixed_precision.param_dtype",
            5,
        ),
        ("actor:\n  clip_ratio: 0.1\nrollout:\n  n: 2\nactor:\n  ppo_epochs: 2\n", "actor", 5),
        (
            "actor:\n  optim:\n    lr: 1.0e-5\n  clip_ratio: 0.1\n  optim:\n    eps: 1.0e-8\n",
            "actor.optim",
            5,
        ),
        ("rollout: {n: 2, temperature: 1.0, n: 3}\n", "rollout.n", 1),
        ("trainer:\n  seed: 1\n  'seed': 2\n", "trainer.seed", 3),
    ],
    ids=["leaf", "deep-leaf", "deepest-leaf", "section", "nested-section", "flow-mapping", "quoted"],
)
def test_duplicate_yaml_key_names_file_line_and_key(tmp_path: Path, text: str, key: str, line: int) -> None:
    path = write_yaml(tmp_path, text)
    msg = load_error(path)
    assert str(path) in msg and f"line {line}" in msg and f"duplicate key {key!r}" in msg, msg


def test_yaml_merge_key_may_be_overridden(tmp_path: Path) -> None:
    # `<<: *anchor` then the same key is how YAML overrides a merged mapping: not a duplicate.
    path = write_yaml(
        tmp_path,
        "actor:\n  optim: &o {lr: 1.0e-5, eps: 1.0e-7}\ncritic:\n  optim:\n    <<: *o\n    lr: 2.0e-5\n",
    )
    cfg = load_config(path)
    assert (cfg.critic.optim.lr, cfg.critic.optim.eps) == (2e-5, 1e-7)


@pytest.mark.parametrize(
    ("content", "fragments"),
    [
        (b"actor: [\n", ["line 2", "expected the node content"]),
        (b"actor:\n\tclip_ratio: 0.1\n", ["line 2, column 1", "tabs"]),
        (b"actor:\n  clip_ratio: 0.1\n  kl_loss_type: k\xe9\n", ["line 3", "not UTF-8"]),
        (b"actor:\n  clip_ratio: 0.1\x00\n", ["line 2", "not allowed"]),
        (b"rollout:\n  n: 2\n---\nrollout:\n  n: 3\n", ["line 3", "single document"]),
        (b"[" * 1000, ["nested too deeply"]),
        (b"actor: !!python/object:os.system {}\n", ["line 1", "could not determine a constructor"]),
        (b"? [a, b]\n: 1\n", ["unhashable key"]),
        (b"rollout:\n  n: " + b"9" * 5000 + b"\n", ["digits"]),
        (b"- actor\n- rollout\n", ["top level must be a mapping"]),
        (b"actor: &a {optim: *a}\n", ["'actor.optim.optim'"]),
        (b"actor: 3\n", ["actor is a section"]),
        (b"actor:\n", ["actor is a section; got None"]),
    ],
    ids=[
        "syntax",
        "tab",
        "not-utf8",
        "control-char",
        "two-documents",
        "deep-nesting",
        "python-tag",
        "unhashable-key",
        "huge-int",
        "not-a-mapping",
        "recursive-anchor",
        "section-scalar",
        "section-null",
    ],
)
def test_malformed_file_is_one_line_naming_it(tmp_path: Path, content: bytes, fragments: list[str]) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_bytes(content)
    msg = load_error(path)
    assert str(path) in msg, msg
    for fragment in fragments:
        assert fragment in msg, msg


def test_config_path_that_is_a_directory_or_missing(tmp_path: Path) -> None:
    assert f"config file {tmp_path} is a directory" in load_error(tmp_path)
    assert "does not exist" in load_error(tmp_path / "nope.yaml")


def test_empty_file_and_bom_are_fine(tmp_path: Path) -> None:
    assert load_config(write_yaml(tmp_path, "# only a comment\n")) == PPOConfig()
    path = tmp_path / "bom.yaml"
    path.write_bytes("\ufeffrollout:\n  n: 3\n".encode())
    assert load_config(path).rollout.n == 3


@pytest.mark.parametrize("preset", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_no_file_content_escapes_as_a_traceback(tmp_path: Path, preset: Path) -> None:
    # Random corruptions of a real preset (deleted, inserted, swapped bytes): each loads or fails with
    # a one-line ConfigError, never another exception.
    rng = random.Random(preset.name)
    original = preset.read_bytes()
    alphabet = b" \t\n:-[]{}&*!|>'\"#%@`,?.0e9xa\x00\xff"
    cls = PPOConfig if preset.name.startswith(("demo", "qwen")) else SFTConfig
    cls = RewardModelConfig if preset.name.startswith("rm") else cls
    cls = DPOConfig if preset.name.startswith("dpo") else cls
    path = tmp_path / "cfg.yaml"
    for _ in range(40):
        data = bytearray(original)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(data))
            op = rng.randrange(3)
            if op == 0:
                del data[i : i + rng.randint(1, 8)]
            elif op == 1:
                data[i:i] = bytes(rng.choice(alphabet) for _ in range(rng.randint(1, 3)))
            else:
                data[i] = rng.choice(alphabet)
        path.write_bytes(bytes(data))
        try:
            load_config(path, [], cls)
        except ConfigError as e:
            assert one_problem_a_line(str(e)), str(e)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("actor.optim.lr=[1,", "actor.optim.lr"),
        ("rollout.n={", "rollout.n"),
        ("trainer.logger=[console, jsonl", "trainer.logger"),
        ("data.train_files='a.parquet", "data.train_files"),
        ("actor={clip_ratio: 0.1, clip_ratio: 0.2}", "actor"),
        ("actor.kl_loss_type=\tk1", "actor.kl_loss_type"),
    ],
)
def test_malformed_override_value_names_key_and_command_line(override: str, key: str) -> None:
    msg = load_error(overrides=[override])
    assert msg.startswith(f"{key}=") and "(from the command line)" in msg and "not valid YAML" in msg, msg


@pytest.mark.parametrize("override", ["=1", "actor..lr=1", "actor.=1", ".n=1", "rollout.n"])
def test_malformed_override_key(override: str) -> None:
    assert "must look like section.key=value" in load_error(overrides=[override])


def test_override_into_a_leaf_is_not_a_section() -> None:
    msg = load_error(overrides=["rollout.n.x=1"])
    assert "rollout.n is not a section" in msg and "(from the command line)" in msg


@pytest.mark.parametrize("world_size", ["0", "-2"])
def test_world_size_below_one_is_a_config_error(world_size: str) -> None:
    with pytest.raises(
        ConfigError, match=rf"--world-size must be >= 1, got {world_size} \(from the command line\)"
    ):
        parse_cli(["--print-config", "--world-size", world_size])
    with pytest.raises(ConfigError, match="world size must be >= 1"):
        demo().validate(int(world_size))
    with pytest.raises(ConfigError, match="world size must be >= 1"):
        validate_stage(load_config(None, demo_inputs(SFTConfig), SFTConfig), int(world_size))


# One out-of-range value for every range-checked field: (class, override, full key in the message).
RANGE_CASES = [
    (PPOConfig, "actor.ulysses_sequence_parallel_size=0", "actor.ulysses_sequence_parallel_size"),
    (PPOConfig, "critic.ulysses_sequence_parallel_size=0", "critic.ulysses_sequence_parallel_size"),
    (PPOConfig, "ref.ulysses_sequence_parallel_size=-1", "ref.ulysses_sequence_parallel_size"),
    (PPOConfig, "actor.lora.rank=-1", "actor.lora.rank"),
    (PPOConfig, "critic.lora.alpha=0", "critic.lora.alpha"),
    (PPOConfig, "actor.lora.dropout=1.0", "actor.lora.dropout"),
    (PPOConfig, "rollout.offline_fraction=1.5", "rollout.offline_fraction"),
    (PPOConfig, "algorithm.rollout_is_threshold=1.0", "algorithm.rollout_is_threshold"),
    (DPOConfig, "loss.beta=0", "loss.beta"),
    (DPOConfig, "loss.gamma=-0.5", "loss.gamma"),
    (DPOConfig, "loss.label_smoothing=0.5", "loss.label_smoothing"),
    (DPOConfig, "loss.nll_coef=-1", "loss.nll_coef"),
    (DPOConfig, "data.max_prompt_length=0", "data.max_prompt_length"),
    (DPOConfig, "data.max_response_length=0", "data.max_response_length"),
    (DPOConfig, "data.train_batch_size=0", "data.train_batch_size"),
    (DPOConfig, "data.max_token_len_per_gpu=0", "data.max_token_len_per_gpu"),
    (DPOConfig, "data.micro_batch_size_per_gpu=0", "data.micro_batch_size_per_gpu"),
    (PPOConfig, "actor.fsdp.fsdp_size=0", "actor.fsdp.fsdp_size"),
    (PPOConfig, "reward.fsdp.fsdp_size=-2", "reward.fsdp.fsdp_size"),
    (PPOConfig, "actor.optim.lr=0", "actor.optim.lr"),
    (PPOConfig, "critic.optim.lr=-1e-5", "critic.optim.lr"),
    (PPOConfig, "actor.optim.weight_decay=-0.1", "actor.optim.weight_decay"),
    (PPOConfig, "actor.optim.betas=[0.9,1.0]", "actor.optim.betas[1]"),
    (PPOConfig, "critic.optim.betas=[-0.1,0.9]", "critic.optim.betas[0]"),
    (PPOConfig, "actor.optim.betas=[0.9]", "actor.optim.betas"),
    (PPOConfig, "actor.optim.eps=0", "actor.optim.eps"),
    (PPOConfig, "actor.optim.lr_warmup_steps=-2", "actor.optim.lr_warmup_steps"),
    (PPOConfig, "actor.optim.lr_warmup_steps_ratio=1.5", "actor.optim.lr_warmup_steps_ratio"),
    (PPOConfig, "critic.optim.min_lr_ratio=-0.1", "critic.optim.min_lr_ratio"),
    (PPOConfig, "data.max_prompt_length=0", "data.max_prompt_length"),
    (PPOConfig, "data.max_response_length=-1", "data.max_response_length"),
    (PPOConfig, "data.train_batch_size=0", "data.train_batch_size"),
    (PPOConfig, "data.val_batch_size=0", "data.val_batch_size"),
    (PPOConfig, "data.max_val_samples=0", "data.max_val_samples"),
    (PPOConfig, "data.max_val_samples=-2", "data.max_val_samples"),
    (PPOConfig, "actor.ppo_mini_batch_size=0", "actor.ppo_mini_batch_size"),
    (PPOConfig, "actor.ppo_micro_batch_size_per_gpu=0", "actor.ppo_micro_batch_size_per_gpu"),
    (PPOConfig, "actor.ppo_max_token_len_per_gpu=0", "actor.ppo_max_token_len_per_gpu"),
    (PPOConfig, "actor.ppo_epochs=0", "actor.ppo_epochs"),
    (PPOConfig, "actor.clip_ratio=0", "actor.clip_ratio"),
    (PPOConfig, "actor.clip_ratio_low=0", "actor.clip_ratio_low"),
    (PPOConfig, "actor.clip_ratio_high=-0.1", "actor.clip_ratio_high"),
    (PPOConfig, "actor.clip_ratio_c=1.0", "actor.clip_ratio_c"),
    (PPOConfig, "actor.kl_loss_coef=-0.001", "actor.kl_loss_coef"),
    (PPOConfig, "actor.grad_clip=-1", "actor.grad_clip"),
    (PPOConfig, "actor.early_stop_kl=-0.1", "actor.early_stop_kl"),
    (PPOConfig, "critic.ppo_mini_batch_size=0", "critic.ppo_mini_batch_size"),
    (PPOConfig, "critic.ppo_micro_batch_size_per_gpu=0", "critic.ppo_micro_batch_size_per_gpu"),
    (PPOConfig, "critic.ppo_max_token_len_per_gpu=-8", "critic.ppo_max_token_len_per_gpu"),
    (PPOConfig, "critic.ppo_epochs=0", "critic.ppo_epochs"),
    (PPOConfig, "critic.cliprange_value=0", "critic.cliprange_value"),
    (PPOConfig, "critic.grad_clip=-0.5", "critic.grad_clip"),
    (PPOConfig, "critic.fsdp.fsdp_size=0", "critic.fsdp.fsdp_size"),
    (PPOConfig, "ref.log_prob_micro_batch_size_per_gpu=0", "ref.log_prob_micro_batch_size_per_gpu"),
    (PPOConfig, "ref.fsdp.fsdp_size=-3", "ref.fsdp.fsdp_size"),
    (PPOConfig, "rollout.n=0", "rollout.n"),
    (PPOConfig, "rollout.temperature=0", "rollout.temperature"),
    (PPOConfig, "rollout.top_p=0", "rollout.top_p"),
    (PPOConfig, "rollout.top_p=1.5", "rollout.top_p"),
    (PPOConfig, "rollout.top_k=-1", "rollout.top_k"),
    (PPOConfig, "rollout.micro_batch_size_per_gpu=0", "rollout.micro_batch_size_per_gpu"),
    (PPOConfig, "reward.micro_batch_size_per_gpu=0", "reward.micro_batch_size_per_gpu"),
    (PPOConfig, "algorithm.kl_ctrl.kl_coef=-0.1", "algorithm.kl_ctrl.kl_coef"),
    (PPOConfig, "algorithm.kl_ctrl.target_kl=0", "algorithm.kl_ctrl.target_kl"),
    (PPOConfig, "algorithm.kl_ctrl.horizon=0", "algorithm.kl_ctrl.horizon"),
    (PPOConfig, "algorithm.kl_ctrl.fixed_warmup_steps=-1", "algorithm.kl_ctrl.fixed_warmup_steps"),
    (PPOConfig, "algorithm.gamma=1.01", "algorithm.gamma"),
    (PPOConfig, "algorithm.lam=-0.1", "algorithm.lam"),
    (PPOConfig, "algorithm.rollback_kl=-1", "algorithm.rollback_kl"),
    (PPOConfig, "algorithm.rollback_lr_factor=0", "algorithm.rollback_lr_factor"),
    (PPOConfig, "algorithm.rollback_lr_factor=1.5", "algorithm.rollback_lr_factor"),
    (PPOConfig, "algorithm.max_rollbacks=-1", "algorithm.max_rollbacks"),
    (PPOConfig, "trainer.n_gpus_per_node=0", "trainer.n_gpus_per_node"),
    (PPOConfig, "trainer.nnodes=0", "trainer.nnodes"),
    (PPOConfig, "trainer.dist_timeout_s=0", "trainer.dist_timeout_s"),
    (PPOConfig, "trainer.seed=-1", "trainer.seed"),
    (PPOConfig, "trainer.total_epochs=0", "trainer.total_epochs"),
    (PPOConfig, "trainer.total_training_steps=-1", "trainer.total_training_steps"),
    (PPOConfig, "trainer.total_training_steps=0", "trainer.total_training_steps"),
    (PPOConfig, "trainer.critic_warmup=-1", "trainer.critic_warmup"),
    (PPOConfig, "trainer.save_freq=-2", "trainer.save_freq"),
    (PPOConfig, "trainer.test_freq=-2", "trainer.test_freq"),
    (PPOConfig, "trainer.max_ckpt_to_keep=-1", "trainer.max_ckpt_to_keep"),
    (PPOConfig, "trainer.profile_steps=[3,0]", "trainer.profile_steps[1]"),
    (PPOConfig, "trainer.warn_entropy_below=-0.1", "trainer.warn_entropy_below"),
    (PPOConfig, "trainer.rollback_val_drop=1.0", "trainer.rollback_val_drop"),
    (PPOConfig, "trainer.max_skipped_steps=0", "trainer.max_skipped_steps"),
    (SFTConfig, "optim.lr=0", "optim.lr"),
    (SFTConfig, "fsdp.fsdp_size=0", "fsdp.fsdp_size"),
    (SFTConfig, "data.max_length=0", "data.max_length"),
    (SFTConfig, "data.train_batch_size=0", "data.train_batch_size"),
    (SFTConfig, "data.max_token_len_per_gpu=0", "data.max_token_len_per_gpu"),
    (SFTConfig, "data.micro_batch_size_per_gpu=0", "data.micro_batch_size_per_gpu"),
    (SFTConfig, "trainer.dist_timeout_s=0", "trainer.dist_timeout_s"),
    (SFTConfig, "trainer.seed=-1", "trainer.seed"),
    (SFTConfig, "trainer.total_epochs=0", "trainer.total_epochs"),
    (SFTConfig, "trainer.total_training_steps=-1", "trainer.total_training_steps"),
    (SFTConfig, "trainer.max_time_s=-1", "trainer.max_time_s"),
    (SFTConfig, "trainer.test_freq=-2", "trainer.test_freq"),
    (SFTConfig, "trainer.save_freq=-2", "trainer.save_freq"),
    (SFTConfig, "trainer.max_ckpt_to_keep=-1", "trainer.max_ckpt_to_keep"),
    (SFTConfig, "trainer.grad_clip=-1", "trainer.grad_clip"),
    # SFT's trainer section is its own class (trainer.metrics_prefix); the other stages share the base.
    (DPOConfig, "trainer.dist_timeout_s=0", "trainer.dist_timeout_s"),
    (DPOConfig, "trainer.seed=-1", "trainer.seed"),
    (DPOConfig, "trainer.total_epochs=0", "trainer.total_epochs"),
    (DPOConfig, "trainer.total_training_steps=-1", "trainer.total_training_steps"),
    (DPOConfig, "trainer.max_time_s=-1", "trainer.max_time_s"),
    (DPOConfig, "trainer.test_freq=-2", "trainer.test_freq"),
    (DPOConfig, "trainer.max_ckpt_to_keep=-1", "trainer.max_ckpt_to_keep"),
    (DPOConfig, "trainer.grad_clip=-1", "trainer.grad_clip"),
    (PPOConfig, "data.gen_batch_size=0", "data.gen_batch_size"),
    (PPOConfig, "actor.loss_scale_factor=0", "actor.loss_scale_factor"),
    (PPOConfig, "actor.policy_loss.clip_cov_ratio=0", "actor.policy_loss.clip_cov_ratio"),
    (PPOConfig, "actor.policy_loss.kl_cov_ratio=1.5", "actor.policy_loss.kl_cov_ratio"),
    (PPOConfig, "actor.policy_loss.ppo_kl_coef=-1", "actor.policy_loss.ppo_kl_coef"),
    (PPOConfig, "rollout.val_kwargs.n=0", "rollout.val_kwargs.n"),
    (PPOConfig, "rollout.val_kwargs.temperature=-1", "rollout.val_kwargs.temperature"),
    (PPOConfig, "rollout.val_kwargs.top_p=0", "rollout.val_kwargs.top_p"),
    (PPOConfig, "rollout.val_kwargs.top_k=-2", "rollout.val_kwargs.top_k"),
    (PPOConfig, "reward.overlong_buffer.len=-1", "reward.overlong_buffer.len"),
    (PPOConfig, "reward.overlong_buffer.penalty_factor=-1", "reward.overlong_buffer.penalty_factor"),
    (
        PPOConfig,
        "algorithm.filter_groups.max_num_gen_batches=-1",
        "algorithm.filter_groups.max_num_gen_batches",
    ),
    (PPOConfig, "reward.pool_workers=-1", "reward.pool_workers"),
    (PPOConfig, "trainer.log_val_generations=-1", "trainer.log_val_generations"),
    (PPOConfig, "reward.timeout_s=0", "reward.timeout_s"),
    (PPOConfig, "reward.total_timeout_s=0", "reward.total_timeout_s"),
    (PPOConfig, "rollout.multi_turn.max_assistant_turns=0", "rollout.multi_turn.max_assistant_turns"),
    (
        PPOConfig,
        "rollout.multi_turn.max_tool_response_length=0",
        "rollout.multi_turn.max_tool_response_length",
    ),
    (PPOConfig, "rollout.multi_turn.step_timeout_s=0", "rollout.multi_turn.step_timeout_s"),
    (PPOConfig, "actor.sppo_eta=0", "actor.sppo_eta"),
    (PPOConfig, "actor.sppo_refresh_steps=0", "actor.sppo_refresh_steps"),
    (PPOConfig, "algorithm.sppo_beta=-1", "algorithm.sppo_beta"),
    (PPOConfig, "reward.prime.beta_train=0", "reward.prime.beta_train"),
    (PPOConfig, "reward.prime.mini_batch_size=0", "reward.prime.mini_batch_size"),
    (PPOConfig, "reward.prime.grad_clip=-1", "reward.prime.grad_clip"),
    (PPOConfig, "data.accuracy_lower_bound=-0.1", "data.accuracy_lower_bound"),
    (PPOConfig, "data.accuracy_upper_bound=1.5", "data.accuracy_upper_bound"),
    (PPOConfig, "distillation.distillation_loss.topk=0", "distillation.distillation_loss.topk"),
    (
        PPOConfig,
        "distillation.distillation_loss.loss_max_clamp=0",
        "distillation.distillation_loss.loss_max_clamp",
    ),
    (
        PPOConfig,
        "distillation.distillation_loss.distillation_loss_coef=-1",
        "distillation.distillation_loss.distillation_loss_coef",
    ),
    (
        PPOConfig,
        "distillation.distillation_loss.clip_ratio=-0.1",
        "distillation.distillation_loss.clip_ratio",
    ),
    (
        PPOConfig,
        "distillation.distillation_loss.clip_ratio_low=-0.1",
        "distillation.distillation_loss.clip_ratio_low",
    ),
    (
        PPOConfig,
        "distillation.distillation_loss.clip_ratio_high=-0.1",
        "distillation.distillation_loss.clip_ratio_high",
    ),
    (RewardModelConfig, "loss.margin=-0.5", "loss.margin"),
    (RewardModelConfig, "data.max_length=-1", "data.max_length"),
    (RewardModelConfig, "trainer.save_freq=-3", "trainer.save_freq"),
]
UNRANGED = {
    (ActorConfig, "entropy_coeff"),
    (RewardConfig, "format_score"),
    (RewardConfig, "error_score"),
    (RewardConfig, "weights"),
    (PolicyLossConfig, "clip_cov_lb"),
    (PolicyLossConfig, "clip_cov_ub"),
    (AlgorithmConfig, "reward_dpo_coef"),
    (AlgorithmConfig, "reward_gt_coef"),
    (DistillationLossConfig, "log_prob_min_clamp"),
}
"""Numeric fields any finite value is valid for (the Clip-Cov bounds' order is a cross-field check)."""


@pytest.mark.parametrize(("cls", "override", "key"), RANGE_CASES, ids=[c[1] for c in RANGE_CASES])
def test_out_of_range_names_full_key_and_source(cls: type, override: str, key: str, tmp_path: Path) -> None:
    msg = load_error(overrides=[override], cls=cls)
    assert msg.startswith(f"{key} ") and msg.endswith("(from the command line)"), msg
    # The same value from a file names the file.
    path = write_yaml(tmp_path, nested_yaml([override]))
    msg = load_error(path, cls=cls)
    assert msg.startswith(f"{key} ") and msg.endswith(f"(from {path})"), msg


def test_sft_metrics_prefix_is_a_name() -> None:
    msg = load_error(overrides=["trainer.metrics_prefix=my-teacher"], cls=SFTConfig)
    assert msg == (
        "trainer.metrics_prefix must be a name of letters, digits and underscores, got 'my-teacher' "
        "(from the command line)"
    )
    assert (
        load_config(None, ["trainer.metrics_prefix=teacher"], SFTConfig).trainer.metrics_prefix == "teacher"
    )


def test_every_numeric_field_has_a_range_case() -> None:
    covered = set()
    for cls, override, _ in RANGE_CASES:
        section, name, _ = leaf_types(cls)[override.partition("=")[0]]
        covered.add((section, name))
    numeric = {
        (section, name)
        for cls in CLASSES
        for section, name, typ in leaf_types(cls).values()
        if {int, float}
        & {typ, *typing.get_args(typ), *(a for t in typing.get_args(typ) for a in typing.get_args(t))}
    }
    assert not numeric - covered - UNRANGED, (
        f"numeric fields without a range case: {numeric - covered - UNRANGED}"
    )


@pytest.mark.parametrize(
    ("cls", "override", "expected"),
    [
        (PPOConfig, "actor.fsdp.fsdp_size=-1", -1),
        (PPOConfig, "actor.fsdp.fsdp_size=1", 1),
        (PPOConfig, "actor.optim.lr_warmup_steps=-1", -1),
        (PPOConfig, "actor.optim.betas=[0.0,0.5]", [0.0, 0.5]),
        (PPOConfig, "actor.optim.min_lr_ratio=1", 1.0),
        (PPOConfig, "data.max_val_samples=-1", -1),
        (PPOConfig, "data.max_val_samples=1", 1),
        (PPOConfig, "actor.clip_ratio_c=1.01", 1.01),
        (PPOConfig, "actor.entropy_coeff=-0.01", -0.01),
        (PPOConfig, "critic.ppo_epochs=null", 1),  # null: actor.ppo_epochs (default 1) fills it in
        (PPOConfig, "rollout.top_p=1", 1.0),
        (PPOConfig, "rollout.top_k=0", 0),
        (PPOConfig, "algorithm.gamma=0", 0.0),
        (PPOConfig, "algorithm.rollback_lr_factor=1", 1.0),
        (PPOConfig, "trainer.save_freq=-1", -1),
        (PPOConfig, "trainer.test_freq=0", 0),
        (PPOConfig, "trainer.seed=0", 0),
        (PPOConfig, "trainer.max_ckpt_to_keep=0", 0),
        (PPOConfig, "trainer.rollback_val_drop=0.99", 0.99),
        (PPOConfig, "trainer.max_skipped_steps=1", 1),
        (SFTConfig, "trainer.max_time_s=0", 0.0),
        (RewardModelConfig, "loss.margin=0", 0.0),
    ],
)
def test_boundary_values_are_accepted(cls: type, override: str, expected: Any) -> None:
    # The value at the edge of its range is taken as given (coerced to the field's type), not refused.
    key = override.partition("=")[0]
    value = flat(load_config(None, [override], cls))[key]
    assert value == expected and type(value) is type(expected), (value, expected)


def float_keys(cls: type) -> list[str]:
    keys = []
    for key, (_, _, typ) in leaf_types(cls).items():
        if typ is float or float in typing.get_args(typ):
            keys.append(key)
    return keys


FLOAT_KEYS = [(cls, key) for cls in CLASSES for key in float_keys(cls)]


@pytest.mark.parametrize(("cls", "key"), FLOAT_KEYS, ids=[f"{c.__name__}:{k}" for c, k in FLOAT_KEYS])
def test_non_finite_float_is_rejected(cls: type, key: str, tmp_path: Path) -> None:
    is_list = typing.get_origin(leaf_types(cls)[key][2]) is list
    for raw in (".nan", ".inf", "-.inf", "nan", "1e400"):
        value = f"[0.9,{raw}]" if is_list else raw
        dotted = f"{key}[1]" if is_list else key
        msg = load_error(overrides=[f"{key}={value}"], cls=cls)
        assert msg.startswith(f"{dotted}=") and "(from the command line) must be a finite number" in msg, msg
    path = write_yaml(tmp_path, nested_yaml([f"{key}={'[0.9, .nan]' if is_list else '.nan'}"]))
    msg = load_error(path, cls=cls)
    assert f"(from {path}) must be a finite number" in msg, msg


def section_paths(cls: type, section: type, prefix: str = "") -> list[str]:
    """Dotted paths of every occurrence of the section class ``section`` in ``cls``."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        typ = hints[f.name]
        if typ is section:
            out.append(f"{prefix}{f.name}")
        if dataclasses.is_dataclass(typ):
            out += section_paths(typ, section, f"{prefix}{f.name}.")
    return out


SHARED_SECTIONS = [
    (cls, path, override)
    for cls in CLASSES
    for section, override in (
        (OptimConfig, "lr=0"),
        (FSDPConfig, "fsdp_size=0"),
        (StageTrainerConfig, "seed=-1"),
    )
    for path in section_paths(cls, section)
]


@pytest.mark.parametrize(
    ("cls", "path", "override"), SHARED_SECTIONS, ids=[f"{c.__name__}:{p}" for c, p, _ in SHARED_SECTIONS]
)
def test_shared_section_errors_carry_the_full_key(cls: type, path: str, override: str) -> None:
    # One OptimConfig check, reached as actor.optim, critic.optim or optim: the message says which.
    key = override.partition("=")[0]
    msg = load_error(overrides=[f"{path}.{override}"], cls=cls)
    assert msg.startswith(f"{path}.{key} must be "), msg


def test_cross_key_error_names_each_source(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "algorithm:\n  adv_estimator: grpo\n")
    msg = load_error(path, ["rollout.n=1"])
    assert "needs rollout.n >= 2" in msg
    assert f"rollout.n from the command line; algorithm.adv_estimator from {path}" in msg, msg


@pytest.mark.parametrize("cls", [TrainerConfig, StageTrainerConfig])
@pytest.mark.parametrize("value", ["''", "' '"])
def test_empty_resume_mode_is_an_error(cls: type, value: str) -> None:
    root = PPOConfig if cls is TrainerConfig else SFTConfig
    msg = load_error(overrides=[f"trainer.resume_mode={value}"], cls=root)
    assert msg.startswith("trainer.resume_mode=") and "auto, disable or a checkpoint path" in msg, msg
    assert load_config(None, ["trainer.resume_mode=/ckpt/step_5"], root).trainer.resume_mode == "/ckpt/step_5"


@pytest.mark.parametrize(
    ("given", "keep"),
    [
        ([], 2),  # ours: the two newest
        (["trainer.max_ckpt_to_keep=null"], None),
        (["trainer.max_actor_ckpt_to_keep=3"], 3),
        # verl 0.9.1 prunes only for a positive int (checkpoint_manager.register_checkpoint): null (its
        # default), 0 and negative numbers keep every checkpoint, which is our null.
        (["trainer.max_actor_ckpt_to_keep=null"], None),
        (["trainer.max_actor_ckpt_to_keep=0", "trainer.max_critic_ckpt_to_keep=null"], None),
        (["trainer.max_actor_ckpt_to_keep=-1", "trainer.max_critic_ckpt_to_keep=-1"], None),
    ],
)
def test_verl_keep_all_checkpoints_is_null(given: list[str], keep: int | None) -> None:
    assert load_config(None, given).trainer.max_ckpt_to_keep == keep


def test_checkpoints_kept_refuses_a_negative_and_two_verl_counts() -> None:
    assert load_error(overrides=["trainer.max_ckpt_to_keep=-1"]) == (
        "trainer.max_ckpt_to_keep must be >= 0, got -1: null or 0 keeps every checkpoint (from the command line)"
    )
    assert load_error(
        overrides=["trainer.max_actor_ckpt_to_keep=null", "trainer.max_critic_ckpt_to_keep=3"]
    ) == (
        "trainer.max_actor_ckpt_to_keep and trainer.max_critic_ckpt_to_keep differ (null and 3): one "
        "checkpoint holds both here; set trainer.max_ckpt_to_keep (null keeps all)"
    )


def test_new_keys_and_their_defaults() -> None:
    cfg = load_config(None, ["reward.fsdp.param_offload=true", "trainer.overwrite=true"])
    assert cfg.reward.fsdp.param_offload and not cfg.ref.fsdp.param_offload
    assert cfg.trainer.overwrite and cfg.trainer.max_skipped_steps == 3
    for cls in (SFTConfig, RewardModelConfig):
        t = cls().trainer
        assert (t.save_freq, t.resume_mode, t.max_ckpt_to_keep, t.overwrite) == (-1, "auto", 2, False)
    with pytest.raises(ConfigError, match="reward.fsdp.fsdp_size=3 must divide the world size 4"):
        demo("reward.fsdp.fsdp_size=3").validate(4)


def test_allowed_names_come_from_algorithms() -> None:
    hints = typing.get_type_hints(ActorConfig)
    assert typing.get_args(hints["loss_agg_mode"]) == LOSS_AGG_MODES
    assert typing.get_args(typing.get_type_hints(CriticConfig)["loss_agg_mode"]) == LOSS_AGG_MODES
    assert typing.get_args(typing.get_type_hints(AlgorithmConfig)["adv_estimator"]) == ADV_ESTIMATORS
    for kind in KL_KINDS:
        check_kl_kind(kind, "actor.kl_loss_type")
        check_kl_kind(kind + "+", "actor.kl_loss_type")
    with pytest.raises(ConfigError, match="'k4' is not a KL estimator"):
        check_kl_kind("k4", "actor.kl_loss_type")


# ----------------------------------------------------------------------------------------------------
# Overrides change their key and nothing else; fallbacks are resolved once
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_setting_any_key_to_its_default_changes_nothing(cls: type, tmp_path: Path) -> None:
    # If building a section lost what its enclosing default set (SFT's cosine optim, its model path,
    # the reward model's preference files), setting one key to its default would change a sibling.
    default = load_config(None, [], cls)
    values = flat(default)
    for key, value in values.items():
        override = f"{key}={json.dumps(value)}"
        assert load_config(None, [override], cls) == default, override
        path = write_yaml(tmp_path, nested_yaml([override]))
        assert load_config(path, [], cls) == default, f"{override} in a file"


SIBLING_CASES = [
    (SFTConfig, "optim.lr=1.0e-3", {"optim.lr"}),
    (SFTConfig, "model.dtype=bfloat16", {"model.dtype"}),
    (SFTConfig, "trainer.seed=7", {"trainer.seed"}),
    (RewardModelConfig, "data.max_length=64", {"data.max_length"}),
    (RewardModelConfig, "optim.min_lr_ratio=0.1", {"optim.min_lr_ratio"}),
    (RewardModelConfig, "trainer.save_freq=10", {"trainer.save_freq"}),
    (PPOConfig, "actor.optim.lr=2.0e-6", {"actor.optim.lr"}),
    (
        PPOConfig,
        "actor.fsdp.mixed_precision.param_dtype=bfloat16",
        {"actor.fsdp.mixed_precision.param_dtype"},
    ),
    (PPOConfig, "algorithm.kl_ctrl.kl_coef=0.01", {"algorithm.kl_ctrl.kl_coef"}),
    (PPOConfig, "reward.fsdp.fsdp_size=1", {"reward.fsdp.fsdp_size"}),
    # Fallbacks follow the key they fall back to, unless set themselves.
    (
        PPOConfig,
        "actor.clip_ratio=0.3",
        {"actor.clip_ratio", "actor.clip_ratio_low", "actor.clip_ratio_high"},
    ),
    (PPOConfig, "actor.ppo_epochs=2", {"actor.ppo_epochs", "critic.ppo_epochs"}),
    (
        PPOConfig,
        "actor.ppo_mini_batch_size=8",
        {"actor.ppo_mini_batch_size", "critic.ppo_mini_batch_size", "reward.prime.mini_batch_size"},
    ),
]


@pytest.mark.parametrize("source", ["yaml", "cli"])
@pytest.mark.parametrize(("cls", "override", "changed"), SIBLING_CASES, ids=[c[1] for c in SIBLING_CASES])
def test_override_changes_only_its_key(
    cls: type, override: str, changed: set[str], source: str, tmp_path: Path
) -> None:
    if source == "cli":
        cfg = load_config(None, [override], cls)
    else:
        cfg = load_config(write_yaml(tmp_path, nested_yaml([override])), [], cls)
    before, after = flat(load_config(None, [], cls)), flat(cfg)
    assert {k for k in before if before[k] != after[k]} == changed


def test_sft_optim_override_keeps_the_cosine_schedule() -> None:
    # The bug this fixes: SFTConfig's optim default is OptimConfig(lr=1e-4, lr_scheduler="cosine");
    # building optim from OptimConfig's class defaults gave lr_scheduler="constant".
    cfg = load_config(None, ["optim.lr=1e-3"], SFTConfig)
    assert (cfg.optim.lr, cfg.optim.lr_scheduler) == (1e-3, "cosine")
    assert load_config(None, ["model.dtype=bfloat16"], SFTConfig).optim.lr_scheduler == "cosine"
    rm = load_config(None, ["data.max_length=64", "data.train_files=[pref.parquet]"], RewardModelConfig)
    assert rm.data.train_files == ["pref.parquet"] and rm.data.max_length == 64
    assert (
        rm.trainer.output_dir == load_config(None, ["trainer.seed=3"], RewardModelConfig).trainer.output_dir
    )


def entry_main(cls: type):
    if cls is PPOConfig:
        return train_ppo.main
    return load_script("train_sft" if cls is SFTConfig else "train_reward_model").main


PRINT_CASES = [
    (PPOConfig, "actor.optim.lr=2.0e-6", ("actor", "optim", "lr"), 2e-6, ("critic", "optim", "lr"), 1e-5),
    (PPOConfig, "actor.ppo_epochs=3", ("actor", "ppo_epochs"), 3, ("critic", "ppo_epochs"), 3),
    (SFTConfig, "optim.lr=0.001", ("optim", "lr"), 1e-3, ("optim", "lr_scheduler"), "cosine"),
    (SFTConfig, "trainer.seed=7", ("trainer", "seed"), 7, ("trainer", "output_dir"), "outputs/sft"),
    (RewardModelConfig, "optim.lr=0.001", ("optim", "lr"), 1e-3, ("optim", "lr_scheduler"), "cosine"),
    (
        RewardModelConfig,
        "data.max_length=64",
        ("data", "max_length"),
        64,
        ("data", "val_files"),
        ["assets/data/pref_val.parquet"],
    ),
]


@pytest.mark.parametrize(
    ("cls", "override", "key", "value", "sibling", "sibling_value"),
    PRINT_CASES,
    ids=[f"{c[0].__name__}:{c[1]}" for c in PRINT_CASES],
)
def test_print_config_keeps_siblings(
    cls: type,
    override: str,
    key: tuple[str, ...],
    value: Any,
    sibling: tuple[str, ...],
    sibling_value: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The demo's assets, which a fresh clone lacks: only the keys are checked here.
    assert entry_main(cls)(["--print-config", "--allow-missing-paths", *demo_inputs(cls), override]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)

    def get(keys: tuple[str, ...]) -> Any:
        node = printed
        for k in keys:
            node = node[k]
        return node

    assert get(key) == value and get(sibling) == sibling_value


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_print_config_reports_bad_override_without_traceback(
    cls: type, capsys: pytest.CaptureFixture[str]
) -> None:
    key = "optim.lr" if cls is not PPOConfig else "actor.optim.lr"
    assert entry_main(cls)(["--print-config", f"{key}=[1,"]) == 2
    err = capsys.readouterr().err
    assert f"{key}='[1,' (from the command line)" in err and "Traceback" not in err, err
    assert entry_main(cls)(["--print-config", "--world-size", "0"]) == 2
    assert "--world-size must be >= 1" in capsys.readouterr().err


SCHEMA_IMPORTS = """\
import sys
import ppo.cli, ppo.config, ppo.config_loader
from ppo.config import DPOConfig, PPOConfig
cfg = ppo.config_loader.load_config("configs/demo_cpu.yaml", ["rollout.n=4"])
cfg.validate(world_size=2)
ppo.config_loader.to_yaml(cfg), cfg.warnings()
ppo.config.validate_stage(ppo.config_loader.load_config("configs/dpo_demo.yaml", [], DPOConfig), 2)
print(" ".join(m for m in ("torch", "transformers", "ppo_kernels", "numpy") if m in sys.modules))
"""


def test_the_schema_imports_nothing_heavy() -> None:
    # --help and --print-config answer before torch loads; the machine check lives where a run starts.
    out = subprocess.run(
        [sys.executable, "-c", SCHEMA_IMPORTS], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", out.stdout  # no heavy module was imported


@pytest.mark.parametrize(
    ("cls", "sections"),
    [
        (
            PPOConfig,
            [
                "model",
                "data",
                "actor",
                "critic",
                "ref",
                "rollout",
                "reward",
                "algorithm",
                "trainer",
                "distillation",
            ],
        ),
        (SFTConfig, ["model", "data", "optim", "fsdp", "trainer"]),
        (RewardModelConfig, ["model", "data", "optim", "fsdp", "trainer", "loss"]),
        (DPOConfig, ["model", "data", "optim", "fsdp", "trainer", "ref", "loss", "lora"]),
    ],
)
def test_dumped_config_keeps_its_layout(cls: type, sections: list[str], tmp_path: Path) -> None:
    # config.yaml, written to every run folder and compared on resume: the sections in the order of
    # the schema (the stages' shared sections first), read back to the same config and the same text.
    text = to_yaml(load_config(None, [], cls))
    assert list(yaml.safe_load(text)) == sections
    assert text.startswith("model:\n  path: null\n")  # the defaults name no model: a run names its own
    path = tmp_path / "config.yaml"
    path.write_text(text)
    assert to_yaml(load_config(path, [], cls)) == text


def test_fallbacks_are_resolved_in_the_config(tmp_path: Path) -> None:
    cfg = load_config(None, ["actor.ppo_mini_batch_size=8", "actor.ppo_epochs=2", "actor.clip_ratio=0.25"])
    assert (cfg.critic.ppo_mini_batch_size, cfg.critic.ppo_epochs) == (8, 2)
    assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high) == (0.25, 0.25)
    cfg = load_config(None, ["critic.ppo_mini_batch_size=4", "actor.clip_ratio_high=0.28"])
    assert cfg.critic.ppo_mini_batch_size == 4 and cfg.actor.clip_ratio_high == 0.28
    assert cfg.actor.clip_ratio_low == cfg.actor.clip_ratio == 0.2
    # The resolved config, written and read back, is the same config.
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path) == cfg
