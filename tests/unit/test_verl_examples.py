"""verl's example scripts run here with only model paths, data paths and sizes appended, as a user appends
them through the scripts' ``$@``: GAE with dynamic batch size, GRPO (and with LoRA), REINFORCE++, RLOO,
GSPO, DAPO, KL-Cov, PPO with a reward model, on-policy distillation from a teacher (the distillation loss
alone, one response per prompt); the multi-turn GSM8K tool example is refused with one line that says
what to write instead. Their key=value lines are transcribed in ``tests/unit/verl_examples.yaml``.

Also here, what such a command line relies on: the last value of a key decides (Hydra's rule, so ``$@``
overrides work), a key given in two spellings is named in a warning, verl's warm-up default, metrics kept
on disk whatever ``trainer.logger`` lists, and ``configs/verl_base.yaml`` holding verl 0.9.1's defaults.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import yaml

from ppo import cli
from ppo.config import ConfigError, PPOConfig
from ppo.config_loader import load_config
from ppo.optim import warmup_steps
from tests.helpers import REWARD_FNS, ROOT, excerpt, read_metrics, torchrun

EXAMPLES = yaml.safe_load((Path(__file__).parent / "verl_examples.yaml").read_text())
RUNS = [name for name in EXAMPLES if not name.startswith("multi_turn")]
DISTILLATION = "on_policy_distillation"
"""The example without the task's loss: its own run test checks what it logs."""

SIZES = [
    "data.train_batch_size=4",
    "data.max_prompt_length=64",
    "data.max_response_length=12",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=256",
    "critic.ppo_micro_batch_size_per_gpu=2",
    "critic.ppo_max_token_len_per_gpu=256",
    "actor_rollout_ref.rollout.n=2",
    "trainer.n_gpus_per_node=2",
    "trainer.nnodes=1",
    "reward_model.overlong_buffer.len=4",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1",
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size=1",
]
"""Sizes for 2 CPU ranks (the scripts' are for 8 to 128 GPUs)."""


def paths(assets: Path, out: Path, name: str = "") -> list[str]:
    """The model and data paths a user appends, in verl's spelling (and the reward function, or for the
    reward-model example the reward model; for the distillation example the teacher, here the student's
    own tiny model: it has the student's tokenizer)."""
    if name == "reward_model":
        reward = [f"reward_model.model.path={assets / 'base_rm'}"]
    else:
        reward = [f"custom_reward_function.path={REWARD_FNS}", "custom_reward_function.name=digit_score"]
    teacher = []
    if name == DISTILLATION:
        teacher = [f"distillation.teacher_models.teacher_model.model_path={assets / 'base'}"]
    return [
        f"actor_rollout_ref.model.path={assets / 'base'}",
        f"critic.model.path={assets / 'base_critic'}",
        f"data.train_files={assets / 'data' / 'train.parquet'}",
        f"data.val_files={assets / 'data' / 'val.parquet'}",
        f"trainer.default_local_dir={out}",
        *reward,
        *teacher,
    ]


def print_config(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """What ``train_ppo.py --print-config ARGV`` does (``cli.answer_early``), in this process."""
    try:
        cfg, args = cli.parse_cli(argv, PPOConfig)
    except ConfigError as e:
        code = cli.config_error(e)
    else:
        code = cli.print_config(cfg, args)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("name", RUNS)
def test_a_verl_example_is_taken_with_paths_and_sizes_appended(
    name: str, tiny_assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--print-config", *EXAMPLES[name], *paths(tiny_assets, tmp_path, name), *SIZES]
    code, out, err = print_config(argv, capsys)
    assert code == 0, err
    cfg = yaml.safe_load(out)
    # The appended values won over the script's (the last value of a key decides).
    assert (cfg["data"]["train_batch_size"], cfg["rollout"]["n"], cfg["trainer"]["n_gpus_per_node"]) == (
        4,
        2,
        2,
    )
    if "actor_rollout_ref.rollout.name=vllm" in EXAMPLES[name]:
        assert "warning: actor_rollout_ref.rollout.name='vllm' (from the command line) is ignored" in err
    assert cfg["reward"]["pool_workers"] == 0  # verl's reward workers start no process pool here
    assert cfg["trainer"]["logger"] == ["console", "wandb"] and cfg["trainer"]["tensorboard"] is True


def test_the_multi_turn_example_is_refused_with_what_to_write(
    tiny_assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "config"
    folder.mkdir()
    (folder / "gsm8k_multiturn_grpo.yaml").write_text(yaml.safe_dump(EXAMPLES["multi_turn_gsm8k_config"]))
    script = [
        "--config-path",
        str(folder),
        "--config-name",
        "gsm8k_multiturn_grpo",
        *EXAMPLES["multi_turn_gsm8k"],
    ]
    code, out, err = print_config([*script, *paths(tiny_assets, tmp_path), *SIZES], capsys)
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err  # one line: the turns are never dropped silently
    line = lines[0]
    assert line.startswith(
        f"config error: actor_rollout_ref.rollout.multi_turn.enable=True (from {folder / 'gsm8k_multiturn_grpo.yaml'}), "
        "actor_rollout_ref.rollout.multi_turn.tool_config_path='examples/sglang_multiturn/config/tool_config/"
    ), line
    assert (
        "write rollout.multi_turn.enable=true rollout.multi_turn.env=path/to/file.py:Class (reset(row)"
        in line
    )
    # With an environment of ours and its stop strings, verl's tool settings are accepted with a warning.
    env = f"rollout.multi_turn.env={ROOT / 'tests' / 'reward_fns.py'}:TurnsByRow"
    stop = "rollout.multi_turn.stop=[</tool_call>]"
    code, out, err = print_config([*script, *paths(tiny_assets, tmp_path), *SIZES, env, stop], capsys)
    assert code == 0, err
    assert yaml.safe_load(out)["rollout"]["multi_turn"]["max_assistant_turns"] == 5
    assert "multi_turn.tool_config_path=" in err and "is ignored: verl's tool and interaction settings" in err


# ----------------------------------------------------------------------------------------------------
# What a verl command line relies on
# ----------------------------------------------------------------------------------------------------


def test_the_last_value_of_a_key_decides() -> None:
    # A refused value replaced later (a script's `$@`) is not refused.
    cfg = load_config(None, ["actor_rollout_ref.rollout.name=trtllm", "actor_rollout_ref.rollout.name=hf"])
    assert cfg.rollout.n == PPOConfig().rollout.n
    notes: list[str] = []
    cfg = load_config(None, ["actor_rollout_ref.actor.optim.lr=1e-5", "actor.optim.lr=2e-5"], notes=notes)
    assert cfg.actor.optim.lr == 2e-5
    assert notes == [
        "actor_rollout_ref.actor.optim.lr='1e-5' (from the command line) and actor.optim.lr='2e-5' (from the "
        "command line) set one key, actor.optim.lr: the last given (actor.optim.lr) is taken"
    ]
    # verl's and our spelling of the overlong buffer and of the reward function: the last one decides.
    verl_len, ours_len = (
        "reward_model.reward_kwargs.overlong_buffer_cfg.len=4",
        "reward.overlong_buffer.len=8",
    )
    assert load_config(None, [verl_len, ours_len]).reward.overlong_buffer.len == 8
    assert load_config(None, [ours_len, verl_len]).reward.overlong_buffer.len == 4
    verl_fn, ours_fn = "custom_reward_function.path=a.py", "reward.custom_function=b.py:f"
    assert load_config(None, [verl_fn, ours_fn]).reward.custom_function == "b.py:f"
    notes = []
    assert load_config(None, [ours_fn, verl_fn], notes=notes).reward.custom_function == "a.py:compute_score"
    assert len(notes) == 1 and "the last given (custom_reward_function.path) is taken" in notes[0]


def test_warm_up_follows_verls_ratio() -> None:
    # verl's lr_warmup_steps defaults to -1 ("use the ratio"); ours was 0, and the ratio did nothing.
    cfg = load_config(None, ["actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1"])
    assert warmup_steps(cfg.actor.optim, total_steps=100) == 10  # 0.1 x 100 optimizer steps
    assert warmup_steps(PPOConfig().actor.optim, total_steps=100) == 0  # no ratio: no warm-up


def test_metrics_stay_on_disk_whatever_the_logger_list(tmp_path: Path) -> None:
    from ppo.metrics import make_metrics_logger

    info = types.SimpleNamespace(is_main=True)
    for logger, tensorboard, written in [
        ("[console,wandb]", "true", {"metrics.jsonl", "tensorboard"}),
        ("[console]", "false", {"metrics.jsonl"}),
        ("[console,tensorboard]", "false", {"metrics.jsonl", "tensorboard"}),
    ]:
        out = tmp_path / f"{logger}-{tensorboard}"
        cfg = load_config(None, [f"trainer.logger={logger}", f"trainer.tensorboard={tensorboard}"])
        cfg.trainer.logger = [s for s in cfg.trainer.logger if s != "wandb"]  # not installed in tests
        log = make_metrics_logger(cfg, info, out, 1, console=False)
        log.log(1, {"actor/pg_loss": 0.5})
        log.close()
        assert {p.name for p in out.iterdir()} == written, logger
        assert read_metrics(out) == [{"step": 1, "actor/pg_loss": 0.5}]


def test_verl_base_holds_verls_defaults() -> None:
    # The keys whose defaults differ from verl 0.9.1's in what a run trains, and verl's values.
    cfg = load_config(ROOT / "configs" / "verl_base.yaml", [])
    assert (cfg.rollout.n, cfg.trainer.total_epochs, cfg.trainer.critic_warmup) == (1, 30, 0)
    assert (cfg.data.train_batch_size, cfg.data.max_prompt_length, cfg.data.max_response_length) == (
        1024,
        512,
        512,
    )
    assert (cfg.actor.ppo_mini_batch_size, cfg.actor.use_dynamic_bsz, cfg.actor.shuffle) == (
        256,
        False,
        False,
    )
    assert (cfg.actor.optim.lr, cfg.actor.optim.weight_decay, cfg.actor.optim.lr_warmup_steps) == (
        1e-6,
        0.01,
        -1,
    )
    assert (cfg.critic.optim.lr, cfg.critic.optim.weight_decay, cfg.critic.use_dynamic_bsz) == (
        1e-5,
        0.01,
        False,
    )
    assert (cfg.algorithm.kl_ctrl.type, cfg.algorithm.kl_ctrl.kl_coef) == ("fixed", 0.001)
    assert cfg.actor.fsdp.mixed_precision.param_dtype == "bfloat16"
    assert cfg.model.enable_gradient_checkpointing is True
    notes: list[str] = []
    load_config(ROOT / "configs" / "verl_base.yaml", ["actor_rollout_ref.rollout.n=5"], notes=notes)
    assert not [n for n in notes if n.startswith("verl's defaults differ")], "nothing left to warn of"


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in RUNS if name != DISTILLATION])
def test_a_verl_example_trains_two_steps_on_two_ranks(name: str, tiny_assets: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    steps = ["trainer.total_training_steps=2", "trainer.val_before_train=false", "trainer.test_freq=-1"]
    args = [*EXAMPLES[name], *paths(tiny_assets, out, name), *SIZES, *steps, "trainer.logger=[console]"]
    result = torchrun(ROOT / "train_ppo.py", *args, nproc=2, timeout=900)
    assert result.returncode == 0, excerpt(result.stderr)
    rows = read_metrics(out)
    assert [row["step"] for row in rows] == [1, 2]
    assert all("actor/pg_loss" in row for row in rows)
    assert ("critic/vf_loss" in rows[0]) == (name in ("gae_dynamic_bsz", "reward_model"))  # GAE's critic


# ----------------------------------------------------------------------------------------------------
# On-policy distillation: the distillation loss alone, one response per prompt
# ----------------------------------------------------------------------------------------------------


def test_the_distillation_example_samples_once_per_prompt(
    tiny_assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # verl's distillation examples keep adv_estimator=grpo with rollout.n=1: without the task's loss no
    # group baseline is computed, so the example's n=1 is taken here too (SIZES' n=2 replaced).
    argv = ["--print-config", *EXAMPLES[DISTILLATION], *paths(tiny_assets, tmp_path, DISTILLATION), *SIZES]
    code, out, err = print_config([*argv, "actor_rollout_ref.rollout.n=1"], capsys)
    assert code == 0, err
    cfg = yaml.safe_load(out)
    assert (cfg["rollout"]["n"], cfg["algorithm"]["adv_estimator"]) == (1, "grpo")
    assert cfg["distillation"]["enabled"] is True
    assert cfg["distillation"]["teacher_models"] == {
        "teacher_model": {"key": None, "model_path": str(tiny_assets / "base")}
    }
    loss = cfg["distillation"]["distillation_loss"]
    assert (loss["loss_mode"], loss["use_task_rewards"], loss["use_policy_gradient"]) == ("k3", False, False)
    # verl's teacher resource pool and serving settings are named as ignored, and so is what the reward
    # function's scores do without the task's loss.
    warnings = err.splitlines()
    assert (
        "warning: distillation.n_gpus_per_node=1 (from the command line), distillation.nnodes=1 (from the "
        "command line) are ignored: teachers are models of this run, sharded over all its ranks like the "
        "reference (no resource pool)"
    ) in warnings
    assert (
        "warning: distillation.teacher_models.teacher_model.inference, distillation.teacher_models."
        "teacher_model.num_replicas: verl's serving settings of a teacher mean nothing here (teachers are "
        "sharded over this run's ranks like the reference) and are ignored"
    ) in warnings
    assert (
        f"warning: distillation.distillation_loss.use_task_rewards=false: the scores of "
        f"reward.custom_function={REWARD_FNS}:digit_score do not train the student (they are logged as "
        f"critic/score/*, and validation uses them)"
    ) in warnings
    # With the task's loss as well, GRPO needs its group again.
    task_too = [
        *argv,
        "actor_rollout_ref.rollout.n=1",
        "distillation.distillation_loss.use_task_rewards=True",
    ]
    code, out, err = print_config(task_too, capsys)
    assert (code, out) == (2, "")
    assert err == (
        "config error: algorithm.adv_estimator=grpo needs rollout.n >= 2 (a group baseline), got "
        "rollout.n=1 (rollout.n from the command line, as actor_rollout_ref.rollout.n; "
        "algorithm.adv_estimator from the command line)\n"
    )


@pytest.mark.slow
def test_the_distillation_example_trains_on_the_distillation_loss_alone(
    tiny_assets: Path, tmp_path: Path
) -> None:
    """verl's distillation command line on 2 ranks, 4 prompts with one response each, 12 response tokens:
    the student learns from the teacher's log-probs alone (no policy-gradient, KL or value loss)."""

    def run(out: Path, steps: int, *extra: str) -> list[dict[str, float]]:
        args = [
            *EXAMPLES[DISTILLATION],
            *paths(tiny_assets, out, DISTILLATION),
            *SIZES,
            "actor_rollout_ref.rollout.n=1",  # the example's own n
            f"trainer.total_training_steps={steps}",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            "trainer.logger=[console]",
            *extra,
        ]
        result = torchrun(ROOT / "train_ppo.py", *args, nproc=2, timeout=900)
        assert result.returncode == 0, excerpt(result.stderr)
        return read_metrics(out)

    # The teacher is the student's own starting point (paths() appends base): k3 of equal log-probs is 0,
    # so the first step's loss and gradient are 0.
    rows = run(tmp_path / "same", 2)
    assert [row["step"] for row in rows] == [1, 2]
    distilled = {
        "distillation/loss",
        "distillation/abs_loss",
        "distillation/loss_min",
        "distillation/loss_max",
    }
    for row in rows:
        assert distilled <= set(row), sorted(row)
        # The distillation loss alone: no task loss, no advantages, no KL to a reference, no critic.
        assert not [
            k for k in row if k.startswith(("actor/pg_", "actor/kl_", "actor/ppo_kl", "critic/advantages"))
        ]
        assert "critic/vf_loss" not in row and "actor/ref_kl" not in row
        assert "critic/score/mean" in row  # the reward is still scored and logged
    first = rows[0]
    assert first["distillation/loss"] == pytest.approx(0.0, abs=1e-6)
    assert first["distillation/abs_loss"] == pytest.approx(0.0, abs=1e-6)
    assert first["actor/grad_norm"] == pytest.approx(0.0, abs=1e-2)
    # Another teacher (the larger tiny Llama, same tokenizer): its log-probs differ, the loss is positive
    # and the student gets a gradient; the token mean lies between the token extremes.
    teacher = f"distillation.teacher_models.teacher_model.model_path={tiny_assets / 'base_teacher'}"
    (row,) = run(tmp_path / "other", 1, teacher)
    assert row["distillation/abs_loss"] > 0.01 and row["actor/grad_norm"] > 0.1
    assert 0.0 <= row["distillation/loss_min"] <= row["distillation/abs_loss"] <= row["distillation/loss_max"]
    assert "actor/pg_loss" not in row
