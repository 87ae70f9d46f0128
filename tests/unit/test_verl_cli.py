"""A verl user's command line runs here: verl's spellings resolve to our keys, what cannot apply is refused
(all of it at once, each with its reason) or accepted with a warning, and what the user sees is right.

The two command lines below are verl's own (its quick start for PPO on GSM8K, and its GRPO example for
Qwen2-7B), with ``python3 -m verl.trainer.main_ppo`` replaced by ``python train_ppo.py`` and nothing
else changed (``rollout.name=vllm`` is accepted with a warning: generation uses Hugging Face generate):
each must resolve to the config that the same command line in our own spelling gives. Also here: a short run with verl's
spellings trains exactly as the run in ours; ``--help`` answers before torch loads and keeps its
examples' lines; torchrun's failure summary names the cause; ``scripts/prepare_gsm8k.py`` takes
verl's flags with verl's meaning.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

import train_ppo
from ppo.config import ConfigError, PPOConfig
from ppo.config_keys import all_keys
from ppo.config_loader import load_config, to_dict
from ppo.verl_keys import VERL_HOMONYMS, VERL_KEYS
from tests.helpers import (
    REWARD_FNS,
    ROOT,
    base_args,
    deterministic,
    load_script,
    read_metrics,
    run,
    torchrun,
)

HOME = "/home/user"
"""What the shell expands ``$HOME`` to in verl's scripts (print-config reads no file)."""

VERL_PPO_QUICKSTART = [
    f"data.train_files={HOME}/data/gsm8k/train.parquet",
    f"data.val_files={HOME}/data/gsm8k/test.parquet",
    "data.train_batch_size=256",
    "data.max_prompt_length=512",
    "data.max_response_length=512",
    "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=64",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
    "critic.optim.lr=1e-5",
    "critic.model.path=Qwen/Qwen2.5-0.5B-Instruct",
    "critic.ppo_micro_batch_size_per_gpu=4",
    "algorithm.kl_ctrl.kl_coef=0.001",
    "trainer.logger=console",
    "trainer.val_before_train=False",
    "trainer.n_gpus_per_node=1",
    "trainer.nnodes=1",
    "trainer.save_freq=10",
    "trainer.test_freq=10",
    "trainer.total_epochs=15",
]
"""verl's docs/start/quickstart.rst (PPO, GSM8K, Qwen2.5-0.5B-Instruct, one GPU), without
``actor_rollout_ref.rollout.name=vllm`` (``VLLM``)."""

OURS_PPO_QUICKSTART = [
    f"data.train_files={HOME}/data/gsm8k/train.parquet",
    f"data.val_files={HOME}/data/gsm8k/test.parquet",
    "data.train_batch_size=256",
    "data.max_prompt_length=512",
    "data.max_response_length=512",
    "model.path=Qwen/Qwen2.5-0.5B-Instruct",
    "actor.optim.lr=1e-6",
    "actor.ppo_mini_batch_size=64",
    "actor.ppo_micro_batch_size_per_gpu=4",
    "ref.log_prob_micro_batch_size_per_gpu=4",
    "critic.optim.lr=1e-5",
    "critic.model_path=Qwen/Qwen2.5-0.5B-Instruct",
    "critic.ppo_micro_batch_size_per_gpu=4",
    "algorithm.kl_ctrl.kl_coef=0.001",
    "trainer.logger=[console]",
    "trainer.val_before_train=false",
    "trainer.n_gpus_per_node=1",
    "trainer.nnodes=1",
    "trainer.save_freq=10",
    "trainer.test_freq=10",
    "trainer.total_epochs=15",
]
"""The same run in our spelling, translated by hand."""

VERL_GRPO = [
    "algorithm.adv_estimator=grpo",
    f"data.train_files={HOME}/data/gsm8k/train.parquet",
    f"data.val_files={HOME}/data/gsm8k/test.parquet",
    "data.train_batch_size=1024",
    "data.max_prompt_length=512",
    "data.max_response_length=1024",
    "data.filter_overlong_prompts=True",
    "data.truncation=error",
    "actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.actor.ppo_mini_batch_size=256",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.actor.fsdp_config.param_offload=False",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    "actor_rollout_ref.rollout.n=5",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "algorithm.use_kl_in_reward=False",
    "trainer.critic_warmup=0",
    'trainer.logger=["console","wandb"]',
    "trainer.project_name=verl_grpo_example_gsm8k",
    "trainer.experiment_name=qwen2_7b_function_rm",
    "trainer.n_gpus_per_node=8",
    "trainer.nnodes=1",
    "trainer.save_freq=20",
    "trainer.test_freq=5",
    "trainer.total_epochs=15",
]
"""verl's examples/grpo_trainer/run_qwen2-7b.sh (8 GPUs), without ``actor_rollout_ref.rollout.name=vllm``
(``VLLM``; its shell quoting removed, as the shell removes it)."""

OURS_GRPO = [
    "algorithm.adv_estimator=grpo",
    f"data.train_files={HOME}/data/gsm8k/train.parquet",
    f"data.val_files={HOME}/data/gsm8k/test.parquet",
    "data.train_batch_size=1024",
    "data.max_prompt_length=512",
    "data.max_response_length=1024",
    "model.path=Qwen/Qwen2-7B-Instruct",
    "actor.optim.lr=1e-6",
    "actor.ppo_mini_batch_size=256",
    "actor.ppo_micro_batch_size_per_gpu=40",
    "actor.use_kl_loss=true",
    "actor.kl_loss_coef=0.001",
    "actor.kl_loss_type=low_var_kl",
    "actor.entropy_coeff=0",
    "model.enable_gradient_checkpointing=true",
    "actor.fsdp.param_offload=false",
    "rollout.n=5",
    "ref.log_prob_micro_batch_size_per_gpu=40",
    "ref.fsdp.param_offload=true",
    "algorithm.use_kl_in_reward=false",
    "trainer.critic_warmup=0",
    "trainer.logger=[console,wandb]",
    "trainer.project_name=verl_grpo_example_gsm8k",
    "trainer.experiment_name=qwen2_7b_function_rm",
    "trainer.n_gpus_per_node=8",
    "trainer.nnodes=1",
    "trainer.save_freq=20",
    "trainer.test_freq=5",
    "trainer.total_epochs=15",
]

VLLM = "actor_rollout_ref.rollout.name=vllm"
"""The engine of both command lines: accepted with a warning, as generation uses Hugging Face generate."""

REFUSED = "trainer.val_only=true"
"""A verl key whose meaning this trainer cannot honour."""

REFUSED_ERROR = (
    "config error: trainer.val_only=True (from the command line): there is no validation-only mode here"
)


def print_config(*args: str) -> subprocess.CompletedProcess:
    """``python train_ppo.py --print-config --allow-missing-paths ARGS``, as a user checks a verl command
    whose model and data are elsewhere (verl's scripts name the hub's Qwen and ``$HOME/data``)."""
    cmd = [sys.executable, str(ROOT / "train_ppo.py"), "--print-config", "--allow-missing-paths", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("verl", "ours", "ignored"),
    [
        (
            VERL_PPO_QUICKSTART,
            OURS_PPO_QUICKSTART,
            [
                "log_prob_micro_batch_size_per_gpu=8",
                "tensor_model_parallel_size=1",
                "gpu_memory_utilization=0.4",
            ],
        ),
        (
            VERL_GRPO,
            OURS_GRPO,
            [
                "log_prob_micro_batch_size_per_gpu=40",
                "tensor_model_parallel_size=2",
                "gpu_memory_utilization=0.6",
            ],
        ),
    ],
    ids=["ppo-quickstart", "grpo-qwen2-7b"],
)
def test_verl_command_line_resolves_to_ours(verl: list[str], ours: list[str], ignored: list[str]) -> None:
    # With verl's rollout engine: accepted, and the warning says what it means here.
    out = print_config(*verl, VLLM)
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout) == to_dict(load_config(None, ours))
    assert (
        "warning: actor_rollout_ref.rollout.name='vllm' (from the command line) is ignored: verl's inference "
        "engine; this trainer samples with Hugging Face generate"
    ) in out.stderr, out.stderr
    # Without it: validated for trainer.nnodes x trainer.n_gpus_per_node, and the config of our spelling.
    out = print_config(*verl)
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout) == to_dict(load_config(None, ours))
    warnings = [line for line in out.stderr.splitlines() if line.startswith("warning: ")]
    assert all(f"actor_rollout_ref.rollout.{key} (from the command line)" in out.stderr for key in ignored)
    (defaults,) = [w for w in warnings if w.startswith("warning: verl's defaults differ")]
    assert "weight_decay=0.0 (verl: 0.01)" in defaults
    assert ("rollout.n=4 (verl: 1)" in defaults) == ("rollout.n=5" not in ours), "set keys are not listed"


def test_first_key_of_a_verl_command_line_is_taken() -> None:
    # The bug: "unknown config key 'actor_rollout_ref'; did you mean actor.kl_loss_coef?"
    assert load_config(None, ["actor_rollout_ref.actor.optim.lr=1e-6"]).actor.optim.lr == 1e-6


def test_every_key_that_cannot_be_taken_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(
            None,
            [
                "actor_rollout_ref.rollout.name=trtllm",
                "actor_rollout_ref.actor.kl_coef=0.1",  # a typo under verl's section
                "trainer.val_only=true",
                "actor_rollout_ref.actor.ppo_micro_batch_size=64",  # verl's deprecated global micro-batch
                "rollout.n=two",
                "actor_rollout_ref.rollout.multi_turn.enable=true",
                "trainer.default_local_dir=checkpoints/${trainer.project_name}",
            ],
        )
    lines = str(e.value).splitlines()
    assert lines[0] == "7 problems:", lines
    expected = [
        "actor_rollout_ref.rollout.name='trtllm' (from the command line): verl's inference engine; this trainer "
        "samples with Hugging Face generate",
        "unknown config key 'actor.kl_coef' (from the command line, as actor_rollout_ref.actor.kl_coef); did "
        "you mean actor.kl_loss_coef",
        "trainer.val_only=True (from the command line): there is no validation-only mode here",
        "actor_rollout_ref.actor.ppo_micro_batch_size=64 (from the command line): verl's deprecated global "
        "micro-batch size; give actor.ppo_micro_batch_size_per_gpu",
        "rollout.n='two' (from the command line) is not a valid int",
        "actor_rollout_ref.rollout.multi_turn.enable=True (from the command line): verl's tools, interactions "
        "and agent loop do not run here, and without them the run would be single-turn; here a multi-turn "
        "rollout talks to an environment class: write rollout.multi_turn.enable=true "
        "rollout.multi_turn.env=path/to/file.py:Class",
        "(from the command line): an OmegaConf interpolation",
    ]
    for fragment in expected:
        assert sum(fragment in line for line in lines[1:]) == 1, (fragment, lines)


def test_what_changes_nothing_is_accepted_with_one_warning_per_reason() -> None:
    notes: list[str] = []
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
            "actor_rollout_ref.rollout.enforce_eager=True",
            "actor_rollout_ref.rollout.max_num_seqs=128",
            "ray_kwargs.ray_init.num_cpus=8",
            "actor_rollout_ref.rollout.multi_turn.enable=false",  # says what we do: no word
            "actor_rollout_ref.model.use_remove_padding=true",  # likewise
        ],
        notes=notes,
    )
    assert cfg == load_config(None, [])  # nothing changed
    engine = [n for n in notes if "verl's inference engine" in n]
    assert len(engine) == 2  # enforce_eager has its own reason (ours: rollout.compile)
    assert "gpu_memory_utilization=0.4" in engine[0] and "max_num_seqs=128" in engine[0]
    assert any(n.startswith("ray_kwargs.ray_init.num_cpus=8") and "without Ray" in n for n in notes)
    assert not any("multi_turn" in n or "use_remove_padding" in n for n in notes)


@pytest.mark.parametrize(
    ("verl", "ours"),
    [
        # Two of verl's keys make one of ours.
        (
            ["custom_reward_function.path=~/rewards.py"],
            {"reward.custom_function": f"{Path.home()}/rewards.py:compute_score"},
        ),
        (
            ["custom_reward_function.path=r.py", "custom_reward_function.name=my_score"],
            {"reward.custom_function": "r.py:my_score"},
        ),
        (
            ["trainer.resume_mode=resume_path", "trainer.resume_from_path=ckpt/global_step_40"],
            {"trainer.resume_mode": "ckpt/global_step_40"},
        ),
        (
            ["trainer.max_actor_ckpt_to_keep=3", "trainer.max_critic_ckpt_to_keep=3"],
            {"trainer.max_ckpt_to_keep": 3},
        ),
        # verl's values, ours spelled otherwise.
        (["actor_rollout_ref.rollout.top_k=-1"], {"rollout.top_k": 0}),
        (["actor_rollout_ref.actor.optim.warmup_style=cosine"], {"actor.optim.lr_scheduler": "cosine"}),
        (["actor.optim.warmup_style=cosine"], {"actor.optim.lr_scheduler": "cosine"}),
        (["actor_rollout_ref.actor.fsdp_config.model_dtype=bf16"], {"model.dtype": "bfloat16"}),
        (["critic.model.fsdp_config.param_offload=true"], {"critic.fsdp.param_offload": True}),
        (["trainer.default_local_dir=~/ckpt"], {"trainer.output_dir": f"{Path.home()}/ckpt"}),
        (["reward_model.enable=true", "reward_model.model.path=rm"], {"reward.style": "model"}),
        (["actor_rollout_ref.nccl_timeout=600"], {"trainer.dist_timeout_s": 600}),
        # verl's docs profile chosen steps so; its steps count from 1, as ours.
        (["global_profiler.steps=[1,5,10]"], {"trainer.profile_steps": [1, 5, 10]}),
        (["global_profiler.tool=torch", "global_profiler.steps=[2]"], {"trainer.profile_steps": [2]}),
        (["+trainer.val_before_train=False"], {"trainer.val_before_train": False}),  # Hydra's +key
        # Offloading the optimizer state is what our param_offload does with the parameters.
        (
            [
                "actor_rollout_ref.actor.fsdp_config.param_offload=true",
                "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
            ],
            {"actor.fsdp.param_offload": True},
        ),
    ],
)
def test_verl_settings_resolve_to_ours(verl: list[str], ours: dict[str, object]) -> None:
    cfg = to_dict(load_config(None, verl))
    for key, value in ours.items():
        node = cfg
        for part in key.split("."):
            node = node[part]
        assert node == value, key


@pytest.mark.parametrize(
    ("verl", "fragment"),
    [
        (["actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"], "set actor.fsdp.param_offload=true"),
        (["trainer.resume_mode=resume_path"], "needs trainer.resume_from_path"),
        (
            ["trainer.max_actor_ckpt_to_keep=2", "trainer.max_critic_ckpt_to_keep=5"],
            "set trainer.max_ckpt_to_keep",
        ),
        (["~trainer.logger"], "Hydra's ~key deletes a key"),
        (["actor_rollout_ref.foo=1"], "unknown config key 'actor_rollout_ref.foo' (from the command line)"),
        (["rollout.top_k=-1"], "rollout.top_k must be >= 0"),  # verl's -1 only in verl's spelling
        (
            ["custom_reward_function.path=[a.py,b.py]"],
            "verl's path names one file; several functions are reward.custom_function=[file.py:fn,...]",
        ),
    ],
)
def test_verl_settings_that_cannot_be_taken(verl: list[str], fragment: str) -> None:
    with pytest.raises(ConfigError, match=None) as e:
        load_config(None, verl)
    assert fragment in str(e.value), str(e.value)


def test_a_verl_yaml_file_reads_as_its_command_line(tmp_path: Path) -> None:
    path = tmp_path / "verl.yaml"
    path.write_text(
        "actor_rollout_ref:\n"
        "  model: {path: Qwen/Qwen2.5-0.5B-Instruct, use_remove_padding: true}\n"
        "  actor:\n    optim: {lr: 1.0e-6, warmup_style: cosine}\n    fsdp_config: {param_offload: true}\n"
        "  rollout: {n: 5, gpu_memory_utilization: 0.5}\n"
        "critic:\n  model: {path: Qwen/Qwen2.5-0.5B-Instruct}\n"
        "custom_reward_function: {path: r.py, name: score}\n"
    )
    notes: list[str] = []
    from_file = load_config(path, [], notes=notes)
    assert from_file == load_config(
        None,
        [
            "model.path=Qwen/Qwen2.5-0.5B-Instruct",
            "actor.optim.lr=1e-6",
            "actor.optim.lr_scheduler=cosine",
            "actor.fsdp.param_offload=true",
            "rollout.n=5",
            "critic.model_path=Qwen/Qwen2.5-0.5B-Instruct",
            "reward.custom_function=r.py:score",
        ],
    )
    assert any(n.startswith("actor_rollout_ref.rollout.gpu_memory_utilization=0.5 (from ") for n in notes)
    # A value from the file that cannot be taken names the file and verl's spelling.
    path.write_text("actor_rollout_ref:\n  actor:\n    optim: {lr: -1}\n")
    with pytest.raises(ConfigError, match=rf"lr must be > 0, got -1.0 \(from {path}, as actor_rollout_ref"):
        load_config(path, [])


def test_the_table_keeps_step_with_the_schema() -> None:
    """Every verl key renames to one of ours, and none of ours is shadowed by an entry that ignores or
    refuses it (a key verl has that the schema gained since: remove its entry, and its row in docs/coming_from_verl.md)."""
    ours = set(all_keys(PPOConfig))
    assert not [k for k, rule in VERL_KEYS.items() if rule.ours and rule.ours not in ours]
    # A section's ``.*`` entry (verl's other rollout.multi_turn.* keys) never catches our own keys in it.
    shadowed = [
        k for k, rule in VERL_KEYS.items() if rule.ours is None and k in ours and k not in VERL_HOMONYMS
    ]
    assert not shadowed, f"entries of VERL_KEYS for keys we now have: {shadowed}"
    notes: list[str] = []
    section = "actor_rollout_ref.rollout.multi_turn"
    cfg = load_config(
        None,
        [
            f"{section}.enable=true",
            f"{section}.env=env.py:Env",
            f"{section}.stop=[</tool_call>]",
            f"{section}.tool_config_path=tools.yaml",
        ],
        notes=notes,
    )
    assert (cfg.rollout.multi_turn.enable, cfg.rollout.multi_turn.env) == (True, "env.py:Env")
    assert [n for n in notes if "multi_turn" in n] == [
        f"{section}.tool_config_path='tools.yaml' (from the command line) is ignored: verl's tool and "
        "interaction settings; the environment of rollout.multi_turn.env answers the turns here"
    ]
    assert all(rule.reason for rule in VERL_KEYS.values() if rule.ours is None), "every refusal says why"


# ----------------------------------------------------------------------------------------------------
# A run in verl's spelling
# ----------------------------------------------------------------------------------------------------


def verl_args(assets: Path, out: Path) -> list[str]:
    """``conftest.base_args`` in verl's spelling, with keys that change nothing here."""
    return [
        f"actor_rollout_ref.model.path={assets / 'base'}",
        f"data.train_files={assets / 'data' / 'train.parquet'}",
        f"data.val_files={assets / 'data' / 'val.parquet'}",
        "data.val_max_samples=8",
        "data.max_response_length=12",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.rollout.n=2",
        "trainer.total_training_steps=2",
        f"trainer.default_local_dir={out}",
        "trainer.logger=['console','jsonl']",
        f"custom_reward_function.path={REWARD_FNS}",
        "custom_reward_function.name=digit_score",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "critic.optim.lr=1e-3",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.model.use_remove_padding=True",
        "data.filter_overlong_prompts=True",
    ]


@pytest.mark.slow
def test_a_run_in_verl_spelling_trains_as_ours(
    tiny_assets: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert run(verl_args(tiny_assets, tmp_path / "verl")) == 0
    assert "tensor_model_parallel_size=1 (from the command line) are ignored" in caplog.text
    assert run(base_args(tiny_assets, tmp_path / "ours")) == 0
    verl_rows, our_rows = read_metrics(tmp_path / "verl"), read_metrics(tmp_path / "ours")
    assert len(verl_rows) == len(our_rows) == 3  # validation at step 0, then two steps
    assert deterministic(verl_rows) == deterministic(our_rows)
    configs = [yaml.safe_load((tmp_path / name / "config.yaml").read_text()) for name in ("verl", "ours")]
    for c in configs:
        c["trainer"].pop("output_dir")
    assert configs[0] == configs[1]


def test_an_interpolation_is_refused_in_any_key() -> None:
    """OmegaConf's ${...} is not resolved here: refused in our keys as in verl's, never taken literally."""
    with pytest.raises(ConfigError) as e:
        load_config(
            None, ["trainer.experiment_name=${trainer.project_name}", "trainer.default_local_dir=out/${x}"]
        )
    lines = str(e.value).splitlines()
    assert lines[0] == "2 problems:"
    assert all(
        "an OmegaConf interpolation, which is not resolved here; give the value" in line for line in lines[1:]
    )


def test_the_overlong_buffer_as_reward_manager_kwargs() -> None:
    """verl's newer DAPO scripts give the overlong buffer as the reward manager's keyword arguments: they
    turn on ours (not the reward function's kwargs); log and max_resp_len are named as ignored."""
    notes: list[str] = []
    cfg = load_config(
        None,
        [
            "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.log=False",
            "+reward_model.reward_kwargs.max_resp_len=512",
            "data.max_response_length=512",
        ],
        notes=notes,
    )
    o = cfg.reward.overlong_buffer
    assert (o.enable, o.len, o.penalty_factor, cfg.reward.reward_kwargs) == (True, 4, 0.5, {})
    ignored = [n for n in notes if "is ignored" in n]
    assert (
        len(ignored) == 2
        and "overlong_buffer_cfg.log=False" in ignored[0]
        and "max_resp_len=512" in ignored[1]
    )


def test_a_verl_reward_function_with_kwargs_and_extras(tiny_assets: Path, tmp_path: Path) -> None:
    """verl's spelling of a reward function: called by keyword (its parameters in another order), with
    ``reward_kwargs``; the dict's other number keys are logged as reward/extra/<key>, text left out."""
    out = tmp_path / "run"
    args = base_args(tiny_assets, out, steps=1) + [
        "trainer.val_before_train=false",
        "algorithm.adv_estimator=grpo",
        f"custom_reward_function.path={REWARD_FNS}",
        "custom_reward_function.name=keyword_order",
        "+custom_reward_function.reward_kwargs.scale=2",
    ]
    assert run(args) == 0
    (row,) = read_metrics(out)
    assert {k for k in row if k.startswith("reward/extra/")} == {"reward/extra/digits", "reward/extra/long"}
    # score = scale * digits on every response, so the means are in the same ratio
    assert row["critic/score/mean"] == pytest.approx(2 * row["reward/extra/digits"], rel=1e-6)
    assert 0 <= row["reward/extra/long"] <= 1 and row["reward/extra/digits"] > 0
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["reward"]["reward_kwargs"] == {"scale": 2}
    assert cfg["reward"]["custom_function"] == f"{REWARD_FNS}:keyword_order"


# ----------------------------------------------------------------------------------------------------
# What they see: --help, torchrun's summary
# ----------------------------------------------------------------------------------------------------


def test_validation_generations_are_logged_for_the_same_prompts(tiny_assets: Path, tmp_path: Path) -> None:
    """trainer.log_val_generations=3: each validation writes the first 3 validation prompts, their
    answers and the scores the run trains with to generations.jsonl, and a table to TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.reward_fns import digit_score

    out = tmp_path / "run"
    args = base_args(tiny_assets, out, steps=2) + [
        "trainer.log_val_generations=3",
        "trainer.test_freq=1",
        "trainer.logger=[jsonl,tensorboard]",
    ]
    assert run(args) == 0
    rows = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    first = [r["prompt"] for r in rows[:3]]
    assert [r["prompt"] for r in rows[3:6]] == [r["prompt"] for r in rows[6:]] == first
    val = pq.read_table(tiny_assets / "data" / "val.parquet").to_pylist()[:3]
    for text, row in zip(first, val, strict=True):
        assert row["prompt"][-1]["content"] in text  # the chat template around the row's question
    for r in rows:
        assert r["score"] == pytest.approx(digit_score("", r["response"], ""))
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    tables = events.Tensors("val/generations/text_summary")
    assert [t.step for t in tables] == [0, 1, 2]
    assert tables[0].tensor_proto.string_val[0].decode().startswith("| prompt | response | score |")


ENTRY_POINTS = [
    "train_ppo.py",
    "scripts/train_sft.py",
    "scripts/train_reward_model.py",
    "scripts/train_dpo.py",
]

HELP = """\
import runpy, sys
sys.argv = [{path!r}, "--help"]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as e:
    assert e.code in (0, None), e.code
print("modules: " + " ".join(m for m in ("torch", "transformers") if m in sys.modules), file=sys.stderr)
"""


@pytest.mark.parametrize("script", ENTRY_POINTS)
def test_help_answers_before_torch_loads_and_keeps_its_examples(script: str) -> None:
    path = ROOT / script
    out = subprocess.run(
        [sys.executable, "-c", HELP.format(path=str(path))],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip() == "modules:", out.stderr  # neither torch nor transformers was imported
    doc = load_script(path.stem).__doc__ if script != "train_ppo.py" else train_ppo.__doc__
    example = next(line for line in doc.splitlines() if line.startswith("    ") and line.strip())
    assert f"\n{example}\n" in out.stdout, "the docstring's examples keep their lines"
    assert "verl's spellings" in out.stdout
    # a user's help: the summary and examples, not the docstring's notes on the code that follow them
    internals = doc.split("\n\n")[2]  # summary, examples, then the notes
    assert not internals.startswith("    ") and internals.splitlines()[0] not in out.stdout
    assert f"every key, its default and meaning: {ROOT / 'docs' / 'configuration.md'}\n" in out.stdout
    assert ("main keys: model.path" in out.stdout) == (script == "train_ppo.py")


def test_error_file_holds_the_one_line_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    assert train_ppo.main([REFUSED]) == 2
    record = json.loads(error_file.read_text())["message"]
    assert record["message"] == REFUSED_ERROR
    assert record["extraInfo"]["py_callstack"] == record["message"]  # what torchrun's summary shows


@pytest.mark.slow
def test_torchrun_summary_names_the_root_cause(tiny_assets: Path, tmp_path: Path) -> None:
    missing = tmp_path / "prompts.parquet"
    args = [*base_args(tiny_assets, tmp_path / "run"), f"data.train_files={missing}"]
    out = torchrun(ROOT / "train_ppo.py", *args, nproc=2)
    assert out.returncode == 1  # torchrun's own code for any failed rank
    summary = out.stderr[out.stderr.index("Root Cause") :]
    assert "exitcode  : 2" in summary  # the rank's: bad input
    assert f"traceback : data.train_files: {missing}: no such data file" in summary, summary
    assert "To enable traceback" not in out.stderr


# ----------------------------------------------------------------------------------------------------
# verl's data preparation flags
# ----------------------------------------------------------------------------------------------------


def raw_gsm8k(folder: Path) -> Path:
    """A raw GSM8K copy in openai/grade-school-math's layout (train.jsonl, test.jsonl), two rows a split."""
    folder.mkdir(parents=True)
    for split in ("train", "test"):
        rows = [
            {"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in (1, 2)
        ]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.mark.parametrize("out_flag", ["--out", "--local_save_dir", "--local_dir"])
@pytest.mark.parametrize("in_flag", ["--local-dir", "--local_dataset_path"])
def test_prepare_gsm8k_takes_verls_flags_with_verls_meaning(
    tmp_path: Path, in_flag: str, out_flag: str
) -> None:
    prepare = load_script("prepare_gsm8k")
    src = raw_gsm8k(tmp_path / "raw")
    assert prepare.main([in_flag, str(src), out_flag, str(tmp_path / "out")]) == 0
    rows = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["2", "3"]


def test_prepare_gsm8k_refuses_to_write_into_its_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prepare = load_script("prepare_gsm8k")
    src = raw_gsm8k(tmp_path / "raw")
    # --local_dir (underscore) is verl's output: given the input copy, it must not write beside it.
    assert prepare.main(["--local_dir", str(src)]) == 2
    err = capsys.readouterr().err
    assert f"the output folder {src} holds a raw copy of GSM8K" in err and "--local-dir (hyphen" in err
    assert sorted(p.name for p in src.iterdir()) == ["test.jsonl", "train.jsonl"]
    assert (
        prepare.main(["--local-dir", str(src), "--out", str(tmp_path / "o"), "--hdfs_dir", "hdfs://x"]) == 2
    )
    assert "nothing is copied to HDFS here" in capsys.readouterr().err


def test_another_profiler_tool_records_the_steps_with_torchs() -> None:
    notes: list[str] = []
    cfg = load_config(
        None,
        ["global_profiler.tool=nsys", "global_profiler.steps=[3]", "global_profiler.save_path=/prof"],
        notes=notes,
    )
    assert cfg.trainer.profile_steps == [3]
    assert [n.split(" is ignored")[0] for n in notes if "profile" in n] == [
        "global_profiler.tool='nsys' (from the command line)",
        "global_profiler.save_path='/prof' (from the command line)",
    ]
