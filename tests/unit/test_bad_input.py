"""Bad input ends as one clear line and exit code 2 (or, where the run still trains, a start-up warning):
never a traceback, never a run that cannot train accepted silently.

One test per case, through the entry point a user calls (``train_ppo.main``, the scripts' ``main``) where
there is one. Most stop at the config or before any model loads, in seconds; the ones that need two
ranks or a fresh interpreter (no ``TRITON_INTERPRET``, no network) are marked slow.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from ppo import model_loading, ulysses
from ppo.config import ConfigError, DPOConfig, PPOConfig, RewardModelConfig, SFTConfig, validate_stage
from ppo.config_loader import load_config, to_yaml
from ppo.data_files import DataError
from ppo.offline import load_offline_groups
from ppo_kernels import dispatch
from tests.helpers import (
    ROOT,
    arith_row,
    base_args,
    demo_inputs,
    excerpt,
    load_script,
    run,
    tiny_config,
    torchrun,
    write_parquet,
)

pytestmark = pytest.mark.usefixtures("one_thread")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
"""The tokenizer's files in ``tiny_assets/base`` (``make_tiny_assets``)."""


def one_error(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``train_ppo`` with ``args`` in this process; it must exit with 2 and report exactly one error
    line (a config error before the process group, or the error boundary's), and no traceback."""
    assert run(args) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if " ERROR " in line or line.startswith("config error")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def model_copy(tiny_assets: Path, dest: Path, *, skip: tuple[str, ...] = ()) -> Path:
    """A copy of the tiny base model's folder without the files in ``skip``."""
    shutil.copytree(tiny_assets / "base", dest, ignore=lambda _dir, names: [n for n in names if n in skip])
    return dest


# ----------------------------------------------------------------------------------------------------
# Inputs not set: the defaults name no model and no data
# ----------------------------------------------------------------------------------------------------

UNSET = {
    (PPOConfig, "model.path"): "model.path is not set: give the policy's save_pretrained folder or hub id",
    (
        PPOConfig,
        "data.train_files",
    ): "data.train_files is not set: give the Parquet files of training prompts",
    (SFTConfig, "model.path"): (
        "model.path is not set: give the save_pretrained folder or hub id of the model to fine-tune"
    ),
    (SFTConfig, "data.train_files"): (
        "data.train_files is not set: give the Parquet files of prompt/answer pairs (or messages)"
    ),
    (RewardModelConfig, "data.train_files"): (
        "data.train_files is not set: give the Parquet files of preference pairs (prompt, chosen, rejected)"
    ),
    (DPOConfig, "model.path"): "model.path is not set: give the policy's save_pretrained folder or hub id",
}
"""The one line a run gets without each required key, per entry point."""


@pytest.mark.parametrize(("cls", "key"), list(UNSET), ids=[f"{c.__name__}:{k}" for c, k in UNSET])
def test_a_run_without_its_model_or_training_files(
    cls: type, key: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The demo's other inputs named (they need not exist: the run stops before it looks at them).
    args = [a for a in demo_inputs(cls) if not a.startswith(f"{key}=")] + [
        f"trainer.output_dir={tmp_path / 'out'}"
    ]
    main = run if cls is PPOConfig else load_script(ENTRY_SCRIPTS[cls]).main
    assert main(args) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if " ERROR " in line or line.startswith("config error")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].endswith(f" ERROR {UNSET[cls, key]}"), errors[0]
    assert not (tmp_path / "out").exists()  # stopped before the run folder, before any model loads


ENTRY_SCRIPTS = {SFTConfig: "train_sft", RewardModelConfig: "train_reward_model", DPOConfig: "train_dpo"}


def test_neither_model_nor_training_files_is_one_line_naming_both() -> None:
    with pytest.raises(ConfigError) as e:
        PPOConfig().validate(1)
    assert str(e.value) == (
        "model.path is not set: give the policy's save_pretrained folder or hub id; "
        "data.train_files is not set: give the Parquet files of training prompts"
    )
    # inputs=False: the world-size checks alone (a benchmark's config of random weights and a synthetic batch).
    PPOConfig().validate(1, inputs=False)
    validate_stage(SFTConfig(), 1, inputs=False)
    with pytest.raises(
        ConfigError, match=r"^model.path is not set: give the save_pretrained folder or hub id of"
    ):
        validate_stage(SFTConfig(), 1)
    # An empty list is no files: the same line, from a file or the command line.
    with pytest.raises(
        ConfigError, match=r"^data.train_files is not set: give the Parquet files of training"
    ):
        load_config(None, ["model.path=m", "data.train_files=[]"]).validate(1)


def test_the_defaults_name_no_file() -> None:
    # A bare config is a config (--print-config shows it, verl's keys are read against it): it names no
    # model and no data, so a run trains on what its command names and nothing else.
    for cls in (PPOConfig, SFTConfig, RewardModelConfig, DPOConfig):
        cfg = cls()
        assert (cfg.model.path, cfg.data.train_files, cfg.data.val_files) == (None, [], []), cls
        assert "assets" not in to_yaml(cfg), cls
    assert PPOConfig().distillation.teacher_models == {} and PPOConfig().reward.model_path is None


def test_no_validation_files_is_said_once_with_the_keys_it_idles() -> None:
    def warnings(*overrides: str, cls: type = PPOConfig) -> list[str]:
        inputs = [a for a in demo_inputs(cls) if not a.startswith("data.val_files=")]
        return [w for w in load_config(None, [*inputs, *overrides], cls).warnings() if "val_files" in w]

    assert warnings() == [
        "data.val_files is not set, so this run does not validate: trainer.val_before_train=true does nothing"
    ]
    assert warnings(
        "trainer.test_freq=5", "trainer.rollback_val_drop=0.2", "trainer.log_val_generations=4"
    ) == [
        "data.val_files is not set, so this run does not validate: trainer.test_freq=5, "
        "trainer.val_before_train=true, trainer.log_val_generations=4, trainer.rollback_val_drop=0.2 do nothing"
    ]
    assert warnings("trainer.val_before_train=false") == [
        "data.val_files is not set, so this run does not validate"
    ]
    assert warnings(cls=SFTConfig) == [
        "data.val_files is not set, so this run does not validate: trainer.test_freq=50 does nothing"
    ]
    assert warnings("data.val_files=[v.parquet]") == []


def test_a_run_without_validation_files_trains_and_never_validates(
    tiny_assets: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    args = [a for a in base_args(tiny_assets, tmp_path, steps=2) if not a.startswith("data.val_files=")]
    assert run([*args, "trainer.test_freq=1"]) == 0  # would validate before step 1 and after each step
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and not [k for r in rows for k in r if k.startswith("val/")]
    said = [r.getMessage() for r in caplog.records if "data.val_files" in r.getMessage()]
    assert said == [
        "data.val_files is not set, so this run does not validate: trainer.test_freq=1, "
        "trainer.val_before_train=true do nothing"
    ]


# ----------------------------------------------------------------------------------------------------
# Settings that cannot train, or do nothing (the config)
# ----------------------------------------------------------------------------------------------------


def test_critic_warmup_past_the_last_step(tiny_assets: Path, tmp_path: Path, capsys: Any) -> None:
    # The actor first updates at step trainer.critic_warmup (steps count from 1): 3 > 2 steps never comes.
    line = one_error(base_args(tiny_assets, tmp_path, steps=2) + ["trainer.critic_warmup=3"], capsys)
    assert re.search(
        r"config error: trainer.critic_warmup=3 is past the last step \(trainer.total_training_steps=2\): "
        r"the actor would never train",
        line,
    )
    # At the last step the actor still updates once; without total_training_steps the length is unknown.
    load_config(None, ["trainer.critic_warmup=2", "trainer.total_training_steps=2"])
    load_config(None, ["trainer.critic_warmup=100"])


@pytest.mark.parametrize("style", ["rule", "ranking", "dataset"])
def test_reward_model_path_that_is_never_loaded(
    tiny_assets: Path, tmp_path: Path, capsys: Any, style: str
) -> None:
    extra = {
        "rule": [],
        "ranking": ["reward.style=ranking"],  # ranking_by=rule
        "dataset": ["reward.style=dataset", "rollout.source=dataset", "algorithm.adv_estimator=grpo"],
    }[style]
    args = base_args(tiny_assets, tmp_path) + extra + [f"reward.model_path={tiny_assets / 'base_rm'}"]
    line = one_error(args, capsys)
    assert re.search(rf"config error: reward.model_path='.*base_rm' is set, but reward.style={style}", line)
    assert "never loads a reward model" in line and "reward.model_path=null" in line


def test_kl_controller_keys_that_do_nothing_warn() -> None:
    def warnings(*overrides: str) -> list[str]:
        return load_config(None, [*demo_inputs(), *overrides]).warnings()

    # Without a KL penalty in the reward the whole controller is unused.
    (msg,) = warnings("algorithm.kl_ctrl.kl_coef=0.05")
    assert (
        msg.startswith("algorithm.use_kl_in_reward=false")
        and "algorithm.kl_ctrl.kl_coef=0.05 is ignored" in msg
    )
    (msg,) = warnings(
        "algorithm.kl_ctrl.kl_coef=0.05", "algorithm.kl_ctrl.target_kl=0.5", "actor.use_kl_loss=true"
    )
    assert "kl_coef=0.05, algorithm.kl_ctrl.target_kl=0.5 are ignored" in msg and "actor.kl_loss_coef" in msg
    # A fixed controller never reads the adaptive one's target and horizon.
    (msg,) = warnings("algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.target_kl=0.5")
    assert (
        msg.startswith("algorithm.kl_ctrl.type=fixed")
        and "algorithm.kl_ctrl.target_kl=0.5 only steers" in msg
    )
    (msg,) = warnings("algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.horizon=500")
    assert "algorithm.kl_ctrl.horizon=500 only steers algorithm.kl_ctrl.type=adaptive" in msg
    # Used as set: no warning.
    assert warnings() == []
    assert warnings("algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=0.05") == []
    adaptive = ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive"]
    assert warnings(*adaptive, "algorithm.kl_ctrl.target_kl=0.5", "algorithm.kl_ctrl.horizon=500") == []
    # A critic warm-up without a critic: the first steps train nothing.
    (msg,) = warnings("algorithm.adv_estimator=grpo", "trainer.critic_warmup=3")
    assert (
        msg.startswith("trainer.critic_warmup=3 with algorithm.adv_estimator=grpo") and "steps 1 to 2" in msg
    )
    # The PPO presets set nothing in vain.
    for preset in [*(ROOT / "configs").glob("demo_cpu*.yaml"), *(ROOT / "configs").glob("qwen*.yaml")]:
        assert load_config(preset, [], PPOConfig).warnings() == [], preset


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_greedy_rollouts_with_a_group_baseline(estimator: str) -> None:
    """Greedy rollouts give every response to a prompt the same tokens: a group baseline sees no
    difference. A start-up warning names the keys (an entropy bonus still trains, so it is not refused)."""
    cfg = load_config(None, ["rollout.do_sample=false", f"algorithm.adv_estimator={estimator}"])
    (warning,) = [w for w in cfg.warnings() if w.startswith("rollout.do_sample")]
    assert re.search(
        rf"rollout.do_sample=false decodes greedily, so the rollout.n=\d+ sampled responses .* "
        rf"algorithm.adv_estimator={estimator} .* every advantage is 0; set rollout.do_sample=true",
        warning,
    )
    mixed = ["rollout.do_sample=false", "algorithm.adv_estimator=grpo", "rollout.offline_fraction=0.5"]
    assert any(w.startswith("rollout.do_sample") for w in load_config(None, mixed).warnings())
    # Greedy is fine where no group compares sampled responses: GAE, or offline groups only.
    for fine in (["algorithm.adv_estimator=gae"], ["algorithm.adv_estimator=grpo", "rollout.source=dataset"]):
        assert not any(
            w.startswith("rollout.do_sample")
            for w in load_config(None, ["rollout.do_sample=false", *fine]).warnings()
        )


def test_sequence_parallel_with_transformers_attention(
    tiny_assets: Path, tmp_path: Path, capsys: Any
) -> None:
    args = base_args(tiny_assets, tmp_path) + [
        "actor.ulysses_sequence_parallel_size=2",
        "model.attn_implementation=sdpa",
    ]
    line = one_error(args, capsys)
    assert re.search(
        r"config error: model.attn_implementation=sdpa cannot run with actor.ulysses_sequence_parallel_size=2"
        r".*use model.attn_implementation=auto",
        line,
    )


def test_sequence_parallel_heads_check_is_a_config_error() -> None:
    config = tiny_config(hidden_size=96, num_attention_heads=3, num_key_value_heads=1)
    config._attn_implementation = "ppo_varlen_sdpa"
    with pytest.raises(ConfigError, match=r"actor.ulysses_sequence_parallel_size=2 must divide .*=3"):
        ulysses.check_heads(config, 2, "actor.ulysses_sequence_parallel_size")


@pytest.mark.slow
def test_sequence_parallel_heads_on_two_ranks(tiny_assets: Path, tmp_path: Path) -> None:
    """2 ranks, SP 2, a model with 3 attention heads: one line from rank 0, exit code 2, before step 1."""
    from transformers import LlamaForCausalLM

    path = model_copy(tiny_assets, tmp_path / "heads3", skip=("model.safetensors", "config.json"))
    torch.manual_seed(0)
    config = tiny_config(hidden_size=96, num_attention_heads=3, num_key_value_heads=1, vocab_size=103)
    LlamaForCausalLM(config).save_pretrained(path)
    out = tmp_path / "run"
    args = base_args(tiny_assets, out) + [f"model.path={path}", "actor.ulysses_sequence_parallel_size=2"]
    proc = torchrun(ROOT / "train_ppo.py", *args)
    err = proc.stderr
    errors = [line for line in err.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "exitcode: 2" in err, err[-4000:]
    assert re.search(
        r"actor.ulysses_sequence_parallel_size=2 must divide the model's \(.*heads3\) num_attention_heads=3",
        errors[0],
    )
    # torchrun reports a failed worker with a traceback of its own; the workers print none.
    assert err.count("Traceback") == err.count("ChildFailedError:"), err[-4000:]
    assert not (out / "metrics.jsonl").exists()


def test_triton_kernels_without_cuda(
    tiny_assets: Path, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # This process may run Triton's interpreter (conftest sets TRITON_INTERPRET without a GPU): stand in a
    # Triton module that compiles for a GPU, as on a CPU machine without the variable.
    monkeypatch.setattr(dispatch, "_import_triton_ops", lambda: types.SimpleNamespace(INTERPRETED=False))
    line = one_error(base_args(tiny_assets, tmp_path) + ["actor.kernel_backend=triton"], capsys)
    assert re.search(r"ERROR actor.kernel_backend=triton cannot run here: the Triton kernels need CUDA", line)
    assert "use actor.kernel_backend=auto" in line
    assert not (tmp_path / "metrics.jsonl").exists()  # at start-up: nothing ran


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_triton_kernels_without_cuda_end_to_end(tiny_assets: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"OMP_NUM_THREADS": "1"}
    args = base_args(tiny_assets, tmp_path) + ["actor.kernel_backend=triton"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train_ppo.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, excerpt(proc.stderr)
    assert "actor.kernel_backend=triton cannot run here" in errors[0]


# ----------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------


def test_offline_groups_that_all_tie(tiny_assets: Path, tmp_path: Path, capsys: Any) -> None:
    def group(a: int, b: int, ranks: list[int]) -> dict[str, Any]:
        return arith_row(a, b, responses=[f"#### {a + b}", f"#### {a + b - 10}"], ranks=ranks)

    # One global batch of 4 groups, so that nothing but the ties stops the run.
    rows = [group(a, b, [0, 0]) for a, b in [(23, 48), (31, 12), (45, 27), (18, 66)]]
    tied = write_parquet(tmp_path / "tied.parquet", rows)
    args = base_args(tiny_assets, tmp_path / "run") + [
        f"data.train_files={tied}",
        "rollout.source=dataset",
        "reward.style=ranking",
        "algorithm.adv_estimator=grpo",
    ]
    line = one_error(args, capsys)
    assert re.search(rf"ERROR {re.escape(str(tied))}: no group with unequal ranks: nothing to learn", line)
    # One group with a preference is enough; so are groups ranked by scores, ties included.
    tok = model_loading.load_tokenizer(str(tiny_assets / "base"))
    load = dict(group_size=2, max_prompt_length=64, max_response_length=32)
    mixed = write_parquet(tmp_path / "mixed.parquet", [group(23, 48, [0, 0]), group(31, 12, [0, 1])])
    assert len(load_offline_groups(mixed, tok, **load)) == 2
    scored = [group(23, 48, [0, 0]) | {"ranks": None, "scores": [1.0, 1.0]}]
    with pytest.raises(DataError, match="no group with unequal ranks"):
        load_offline_groups(write_parquet(tmp_path / "scored.parquet", scored), tok, **load)


# ----------------------------------------------------------------------------------------------------
# Model and tokenizer folders
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["no_files", "broken_file"])
def test_model_folder_without_a_tokenizer(tiny_assets: Path, tmp_path: Path, capsys: Any, case: str) -> None:
    path = model_copy(tiny_assets, tmp_path / "model", skip=TOKENIZER_FILES)
    if case == "broken_file":
        (path / "tokenizer.json").write_text("{not json")
    line = one_error(base_args(tiny_assets, tmp_path / "run") + [f"model.path={path}"], capsys)
    message = {
        "no_files": "holds no tokenizer (none of tokenizer.json, tokenizer_config.json",
        "broken_file": "the tokenizer files do not load",
    }[case]
    assert re.search(rf"ERROR model.path='{re.escape(str(path))}':? {re.escape(message)}", line), line


def test_tokenizer_without_pad_or_eos(tiny_assets: Path, tmp_path: Path, capsys: Any) -> None:
    path = model_copy(tiny_assets, tmp_path / "model")
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    del tokenizer_config["eos_token"], tokenizer_config["pad_token"]
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    line = one_error(base_args(tiny_assets, tmp_path / "run") + [f"model.path={path}"], capsys)
    assert re.search(
        rf"ERROR the tokenizer of model.path='{re.escape(str(path))}' has neither a pad nor an EOS token",
        line,
    )


def test_truncated_weights(tiny_assets: Path, tmp_path: Path, capsys: Any) -> None:
    path = model_copy(tiny_assets, tmp_path / "model")
    weights = path / "model.safetensors"
    size = weights.stat().st_size
    os.truncate(weights, 100_000)
    line = one_error(base_args(tiny_assets, tmp_path / "run") + [f"model.path={path}"], capsys)
    assert f"ERROR model.path: {weights} is truncated (100000 of {size} bytes)" in line


def test_unreadable_weights(
    tiny_assets: Path, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = model_copy(tiny_assets, tmp_path / "model")
    weights = path / "model.safetensors"
    # As root (CI containers) chmod 000 reads anyway: refuse the file where ppo.model_loading opens it.
    real_open = open

    def no_permission(file: Any, *args: Any, **kwargs: Any) -> Any:
        if Path(file) == weights:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(model_loading, "open", no_permission, raising=False)
    line = one_error(base_args(tiny_assets, tmp_path / "run") + [f"model.path={path}"], capsys)
    assert f"ERROR model.path: {weights} exists but cannot be read (Permission denied)" in line
    assert "No such file" not in line


def test_model_vocabulary_smaller_than_the_tokenizer(tiny_assets: Path, tmp_path: Path, capsys: Any) -> None:
    from transformers import AutoModelForCausalLM

    path = model_copy(tiny_assets, tmp_path / "model", skip=("model.safetensors", "config.json"))
    model = AutoModelForCausalLM.from_pretrained(tiny_assets / "base")
    model.resize_token_embeddings(90)  # the tokenizer has 103 ids
    model.save_pretrained(path)
    out = tmp_path / "run"
    line = one_error(base_args(tiny_assets, out) + [f"model.path={path}"], capsys)
    assert re.search(
        rf"ERROR the model {re.escape(str(path))} embeds 90 token ids but its tokenizer has 103 \(ids 90 to 102",
        line,
    )
    assert not (out / "metrics.jsonl").exists()  # before validation and step 1


def test_relative_model_path_names_the_working_directory(
    tiny_assets: Path, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    line = one_error(base_args(tiny_assets, tmp_path / "run") + ["model.path=./models/base"], capsys)
    assert (
        f"ERROR model.path='./models/base': no such folder (looked for {tmp_path / 'models' / 'base'}, "
        f"relative to the working directory {tmp_path})" in line
    )


# ----------------------------------------------------------------------------------------------------
# Scripts
# ----------------------------------------------------------------------------------------------------

prepare_gsm8k = load_script("prepare_gsm8k")
export_hf = load_script("export_hf")

GSM8K_ROW = {"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}


@pytest.mark.parametrize("case", ["not_parquet", "missing_column", "not_an_object", "not_utf8"])
def test_prepare_gsm8k_bad_local_file(tmp_path: Path, capsys: Any, case: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    write_parquet(src / "test.parquet", [GSM8K_ROW])
    if case == "not_parquet":
        (src / "train.parquet").write_text("question,answer\n")
    elif case == "missing_column":
        write_parquet(src / "train.parquet", [{"q": "What is 2 + 3?", "answer": "#### 5"}])
    elif case == "not_an_object":
        (src / "train.jsonl").write_text(json.dumps(GSM8K_ROW) + "\n5\n")
    else:
        (src / "train.jsonl").write_bytes(b"\xff\xfe{}\n")
    train = next(src.glob("train.*"))
    assert prepare_gsm8k.main(["--local-dir", str(src), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    message = {
        "not_parquet": "not a readable Parquet file",
        "missing_column": "missing column 'question'; it has ['q', 'answer']",
        "not_an_object": "row 1: expected an object with 'question' and 'answer', got 5",
        "not_utf8": "not UTF-8 text",
    }[case]
    assert err.startswith(f"error: {train}: {message}"), err
    assert not (tmp_path / "out").exists()


def test_prepare_gsm8k_without_network(tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def unreachable(*_args: Any, **_kwargs: Any) -> None:
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=unreachable))
    assert prepare_gsm8k.main(["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(
        "error: could not load openai/gsm8k (main) from the Hugging Face hub (ConnectionError"
    )
    assert "pass --local-dir" in err


@pytest.mark.slow
def test_prepare_gsm8k_offline_end_to_end(tmp_path: Path) -> None:
    """The real datasets library with the hub unreachable (offline mode: the same failure, no waiting)."""
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "prepare_gsm8k.py"), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, excerpt(proc.stderr)
    assert "error: could not load openai/gsm8k (main) from the Hugging Face hub" in proc.stderr


def test_export_critic_of_a_run_without_one(tiny_assets: Path, tmp_path: Path, capsys: Any) -> None:
    # What the checkpoint's config.yaml says decides: a GRPO run never had a critic.
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000001"
    ckpt.mkdir(parents=True)
    cfg = load_config(None, [f"model.path={tiny_assets / 'base'}", "algorithm.adv_estimator=grpo"])
    (ckpt / "config.yaml").write_text(to_yaml(cfg))
    assert export_hf.main([str(ckpt), str(tmp_path / "hf"), "--critic"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert re.search(
        r"ERROR --critic: the run of .*step_00000001 has no critic \(algorithm.adv_estimator=grpo uses a group "
        r"baseline\): export the actor without --critic",
        errors[0],
    )
    assert not (tmp_path / "hf").exists()
