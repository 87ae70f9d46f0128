"""Inputs that would train nothing, never end, or be ignored are named at start-up, in one line: an error
(exit 2) for what cannot train, a warning for a key or row that a run which still trains ignores."""

from __future__ import annotations

import http.server
import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ppo.config import ConfigError, DPOConfig, PPOConfig, SFTConfig
from ppo.config_loader import load_config
from ppo.data import load_prompts
from ppo.input_paths import hub_problem
from tests.helpers import REWARD_FNS, ROOT, arith_row, base_args, demo_inputs, load_script, run, write_parquet


def one_error(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``train_ppo`` with ``args``: exit 2 and exactly one error line, no traceback."""
    assert run(args) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if " ERROR " in line or line.startswith("config error")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def config_error(*overrides: str, cls: type = PPOConfig) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(None, list(overrides), cls)
    return str(e.value)


# ----------------------------------------------------------------------------------------------------
# Dynamic sampling that never ends
# ----------------------------------------------------------------------------------------------------


def test_dynamic_sampling_with_greedy_rollouts_and_no_round_limit_is_refused() -> None:
    dapo = ["algorithm.filter_groups.enable=true", "algorithm.adv_estimator=grpo", "rollout.do_sample=false"]
    msg = config_error(*dapo)
    assert msg.startswith("algorithm.filter_groups.enable=true with rollout.do_sample=false")
    assert "max_num_gen_batches=0 (no limit) generation never ends" in msg and "rollout.do_sample=true" in msg
    # A round limit ends it (with an error after that many rounds), so it is allowed and warned about.
    cfg = load_config(None, [*dapo, "algorithm.filter_groups.max_num_gen_batches=3"])
    assert any(w.startswith("rollout.do_sample=false decodes greedily") for w in cfg.warnings())


# ----------------------------------------------------------------------------------------------------
# Keys that do nothing
# ----------------------------------------------------------------------------------------------------


def test_reward_function_keys_without_a_function_warn() -> None:
    def warnings(*overrides: str) -> list[str]:
        return load_config(None, [*demo_inputs(), *overrides]).warnings()

    (msg,) = warnings("reward.error_score=-1", "reward.reward_kwargs={scale: 2}")
    assert msg == (
        "reward.custom_function is not set (the built-in rule scores): reward.reward_kwargs={'scale': 2}, "
        "reward.error_score=-1.0 are ignored"
    )
    (msg,) = warnings("reward.timeout_s=5")
    assert msg.endswith("reward.timeout_s=5.0 is ignored")
    # reward_kwargs go to a custom function only, even with workers scoring the built-in rule.
    (msg,) = warnings("reward.pool_workers=2", "reward.reward_kwargs={scale: 2}", "reward.timeout_s=5")
    assert msg.endswith("reward.reward_kwargs={'scale': 2} is ignored")
    # Used as set: no warning.
    assert (
        warnings(f"reward.custom_function={REWARD_FNS}:digit_score", "reward.reward_kwargs={scale: 2}") == []
    )
    assert warnings("reward.pool_workers=2", "reward.timeout_s=5", "reward.error_score=-1") == []


@pytest.mark.parametrize("loss", ["dpo", "ipo", "simpo", "kto"])
def test_preference_loss_keys_its_loss_does_not_use_warn(loss: str) -> None:
    demo = [*demo_inputs(DPOConfig), "data.val_files=[assets/data/pref_val.parquet]"]  # validates
    cfg = load_config(
        None, [*demo, f"loss.type={loss}", "loss.gamma=1.0", "loss.label_smoothing=0.1"], DPOConfig
    )
    expected = []
    if loss != "simpo":
        expected.append(f"loss.type={loss}: loss.gamma=1.0 is SimPO's target margin and is ignored")
    if loss != "dpo":
        expected.append(
            f"loss.type={loss}: loss.label_smoothing=0.1 smooths the DPO loss only (cDPO) and is ignored"
        )
    assert cfg.warnings() == expected
    assert load_config(None, [*demo, f"loss.type={loss}"], DPOConfig).warnings() == []


def test_a_data_file_listed_twice_warns(tmp_path: Path) -> None:
    f = str(tmp_path / "a.parquet")
    same = os.path.join(os.path.relpath(tmp_path), ".", "a.parquet")  # another spelling of the same file
    cfg = load_config(None, [f"data.train_files=[{f}, {same}]", f"data.val_files=[{f}]"])
    assert cfg.warnings() == [f"data.train_files lists {same} twice: its rows are read (and weigh) twice"]
    cfg = load_config(None, [f"data.val_files=[{f}, {f}]"], SFTConfig)
    assert cfg.warnings() == [f"data.val_files lists {f} twice: its rows are read (and weigh) twice"]


def test_a_prompt_file_mixing_strings_and_chat_messages_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tok = load_script("make_tiny_assets").build_tokenizer()
    rows = [arith_row(i, 1) for i in range(4)]
    rows[2]["prompt"] = "2 + 1"  # row 2 is a plain string, rows 0, 1, 3 chat messages
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level(logging.WARNING, logger="ppo"):
        load_prompts(path, tok, max_prompt_length=64)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning == (
        f"{path}: column 'prompt' mixes plain strings (first: row 2), used as they are, and chat messages "
        f"(first: row 0), rendered with the chat template: give every row the same kind"
    )
    # Without the chat template both kinds are plain text: nothing to warn about.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ppo"):
        load_prompts(path, tok, max_prompt_length=64, apply_chat_template=False)
    assert not caplog.records


# ----------------------------------------------------------------------------------------------------
# YAML booleans where a word was meant
# ----------------------------------------------------------------------------------------------------


def test_a_word_yaml_reads_as_a_boolean_is_the_word_where_a_string_is_expected() -> None:
    # YAML 1.1 reads off and NO as false: a key that takes a string gets the word as typed.
    assert load_config(None, ["trainer.experiment_name=off"]).trainer.experiment_name == "off"
    cfg = load_config(None, ["rollout.multi_turn.stop=[NO, '</call>']"])
    assert cfg.rollout.multi_turn.stop == ["NO", "</call>"]
    msg = config_error("trainer.resume_mode=false")
    assert msg == (
        "trainer.resume_mode=False (from the command line) is not a valid str: YAML read the word as the boolean "
        "false (off, no, false; on, yes, true); quote it: 'off' in a YAML file, \"trainer.resume_mode='off'\" "
        "on the command line; trainer.resume_mode takes auto, disable or a checkpoint folder"
    )
    assert load_config(None, ["trainer.experiment_name='off'"]).trainer.experiment_name == "off"
    # A boolean for a number is no quoting matter.
    assert config_error("rollout.n=yes") == "rollout.n=True (from the command line) is not a valid int"


# ----------------------------------------------------------------------------------------------------
# ~ in the paths of user code
# ----------------------------------------------------------------------------------------------------


def test_home_is_expanded_in_user_code_paths(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(
        None,
        [
            "reward.custom_function=~/rewards.py:score",
            "rollout.multi_turn.enable=true",
            "rollout.multi_turn.env=~/env.py:Calculator",
            "rollout.multi_turn.stop=[</calc>]",
        ],
    )
    assert cfg.reward.custom_function == f"{tmp_path}/rewards.py:score"
    assert cfg.rollout.multi_turn.env == f"{tmp_path}/env.py:Calculator"


# ----------------------------------------------------------------------------------------------------
# Validation prompts nothing scores
# ----------------------------------------------------------------------------------------------------


def test_validation_source_without_a_rule_is_refused(
    tiny_assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    val = write_parquet(tmp_path / "val.parquet", [arith_row(1, 2), arith_row(3, 4, data_source="math")])
    args = [a for a in base_args(tiny_assets, tmp_path / "run") if not a.startswith("reward.custom_function")]
    line = one_error([*args, f"data.val_files={val}"], capsys)
    assert line.endswith(
        "no rule reward for data_source 'math' in data.val_files; known: openai/gsm8k, gsm8k, synthetic/arith. "
        "Set reward.custom_function=module:function or file.py:function, use a reward model "
        "(reward.style=model), or drop those rows"
    )
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ----------------------------------------------------------------------------------------------------
# Resuming from a run folder; a run already past its last step
# ----------------------------------------------------------------------------------------------------


def fake_checkpoint(folder: Path, *, complete: bool = True) -> Path:
    """A checkpoint folder with (or without) the marker and the DCP metadata ``is_complete`` asks for."""
    (folder / "dcp").mkdir(parents=True)
    if complete:
        (folder / "COMPLETE").write_text("")
        (folder / "dcp" / ".metadata").write_text("")
    return folder


def test_resume_mode_takes_a_run_folder_its_checkpoints_or_latest(tmp_path: Path) -> None:
    from ppo.checkpoint_files import CheckpointError, resume_candidates

    run = tmp_path / "run"
    old, new = fake_checkpoint(run / "checkpoints" / "step_00000002"), run / "checkpoints" / "step_00000004"
    fake_checkpoint(new)
    (run / "checkpoints" / "latest").write_text("step_00000004\n")
    here = tmp_path / "other"
    for given in (run, run / "checkpoints"):  # the run's newest first, an older one if it fails to load
        assert resume_candidates(here, str(given)) == [new, old], given
    assert resume_candidates(here, str(run / "checkpoints" / "latest")) == [new]
    assert resume_candidates(here, str(old)) == [old]
    # A run folder without a complete checkpoint, and a path that is none of these, say what to pass.
    fake_checkpoint(tmp_path / "empty" / "checkpoints" / "step_00000001", complete=False)
    with pytest.raises(CheckpointError) as e:
        resume_candidates(here, str(tmp_path / "empty"))
    assert str(e.value) == (
        f"trainer.resume_mode={tmp_path / 'empty'}: {tmp_path / 'empty' / 'checkpoints'} holds no complete "
        f"checkpoint (step_N folder with a COMPLETE marker and DCP metadata)"
    )
    with pytest.raises(CheckpointError) as e:
        resume_candidates(here, str(tmp_path / "nothing"))
    assert str(e.value).endswith(
        "no such checkpoint folder; pass a checkpoint (run/checkpoints/step_N), a run folder (its newest "
        "checkpoint), auto or disable"
    )


def test_resuming_a_finished_run_says_so_and_keeps_its_export(
    tiny_assets: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from tests.helpers import saved_run

    out = tmp_path / "run"
    saved_run(tiny_assets, out, "trainer.save_hf_on_end=true")
    weights = out / "hf" / "model.safetensors"
    before = weights.stat().st_mtime_ns
    rows = (out / "metrics.jsonl").read_text()
    args = [*base_args(tiny_assets, out, steps=1), "trainer.save_hf_on_end=true"]
    with caplog.at_level(logging.WARNING, logger="ppo"):
        assert run(args) == 0
    (line,) = [r.getMessage() for r in caplog.records if "nothing to train" in r.getMessage()]
    assert line == (
        f"resumed at step 1, and the run ends at step 1: nothing to train ({out / 'hf'} is kept as it is); "
        f"raise trainer.total_training_steps to train on"
    )
    assert weights.stat().st_mtime_ns == before and (out / "metrics.jsonl").read_text() == rows


# ----------------------------------------------------------------------------------------------------
# Missing inputs, found before torch loads
# ----------------------------------------------------------------------------------------------------

EARLY = """\
import sys
from ppo import cli, config
try:
    cli.answer_early(sys.argv[2:], "", getattr(config, sys.argv[1]))
except SystemExit as e:
    print(e.code, "torch" in sys.modules)
"""


def answer_early(schema: str, *args: str, cwd: Path) -> tuple[str, str]:
    """``cli.answer_early`` in a fresh interpreter: stdout (exit code, whether torch was imported) and
    stderr."""
    import subprocess
    import sys

    from tests.helpers import ROOT

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", EARLY, schema, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=120,
    )
    return out.stdout.strip(), out.stderr.strip()


def test_unset_inputs_end_the_run_before_torch_loads(tmp_path: Path) -> None:
    # The defaults name no model and no data: a command without them stops at once, naming both keys.
    stdout, stderr = answer_early("PPOConfig", cwd=tmp_path)
    assert stdout == "2 False", stderr
    assert stderr == (
        "error: model.path is not set: give the policy's save_pretrained folder or hub id | "
        "data.train_files is not set: give the Parquet files of training prompts"
    )
    stdout, stderr = answer_early("SFTConfig", "model.path=models/base", cwd=tmp_path)
    assert (stdout, stderr) == (
        "2 False",
        "error: data.train_files is not set: give the Parquet files of prompt/answer pairs (or messages)",
    )
    # --print-config prints the config, then names them as errors (exit 2).
    stdout, stderr = answer_early("PPOConfig", "--print-config", "data.train_files=[t.parquet]", cwd=tmp_path)
    assert stdout.endswith("\n2 False") and "path: null" in stdout
    assert (
        "error: model.path is not set: give the policy's save_pretrained folder or hub id"
        in stderr.splitlines()
    )


def test_missing_inputs_end_the_run_before_torch_loads(tiny_assets: Path, tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    data = tiny_assets / "data" / "train.parquet"
    ok = [f"model.path={tiny_assets / 'base'}", f"data.train_files={data}", f"data.val_files={data}"]
    # A local-looking model folder that does not exist (its parent exists, so it is no hub id).
    stdout, stderr = answer_early("PPOConfig", *ok, "model.path=models/my-sft", cwd=tmp_path)
    assert stdout == "2 False", stderr
    assert stderr == (
        f"error: model.path='models/my-sft': no such folder (looked for {tmp_path}/models/my-sft, relative "
        f"to the working directory {tmp_path}). Set model.path to a save_pretrained folder or a hub id."
    )
    # A missing data file and reward file: one line naming both.
    stdout, stderr = answer_early(
        "PPOConfig",
        *ok,
        "data.val_files=[nope.parquet]",
        "reward.custom_function=~/no_such_rewards.py:score",
        cwd=tmp_path,
    )
    assert stdout == "2 False"
    (line,) = stderr.splitlines()
    home = os.path.expanduser("~")
    assert line.startswith("error: data.val_files: nope.parquet: no such data file; ")
    assert line.endswith(
        f" | reward.custom_function='{home}/no_such_rewards.py:score': file {home}/no_such_rewards.py does "
        f"not exist"
    )
    stdout, stderr = answer_early(
        "PPOConfig", *ok, "reward.custom_function=no_such_module:score", cwd=tmp_path
    )
    assert stderr == (
        "error: reward.custom_function='no_such_module:score': no module named 'no_such_module' "
        "(is it on PYTHONPATH?)"
    )
    # The stages too; and every input present, the run goes on (answer_early returns).
    stdout, stderr = answer_early("SFTConfig", "model.path=./sft", f"data.train_files={data}", cwd=tmp_path)
    assert stdout == "2 False" and stderr.startswith("error: model.path='./sft': no such folder")
    stdout, stderr = answer_early("PPOConfig", *ok, cwd=tmp_path)
    assert (stdout, stderr) == ("", "")


class FakeHub(http.server.BaseHTTPRequestHandler):
    """The hub's model API: ``org/good`` exists, ``org/private`` needs a token, nothing else exists."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = self.path.removeprefix("/api/models/")
        if path == "org/private":
            code = 200 if self.headers.get("Authorization") == "Bearer t0k" else 401
        else:
            code = 200 if path == "org/good" else 404
        self.send_response(code)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[str]:
    """``FakeHub`` at ``HF_ENDPOINT``, online, with an empty cache and no token."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "TRANSFORMERS_CACHE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.chdir(tmp_path)
    yield endpoint
    server.shutdown()


def test_a_model_id_that_is_no_folder_is_asked_of_the_hub_before_torch_loads(
    hub: str, tmp_path: Path
) -> None:
    """``models/my-sft`` run from a directory without ``models/`` reads as the hub id org/name: it fails at
    start-up with the key, in seconds, instead of after transformers' retries of the hub."""
    cache = tmp_path / "hf" / "hub"
    head = (
        f"model.path='models/my-sft': no such folder (looked for {tmp_path}/models/my-sft, relative to the "
        f"working directory {tmp_path}), not in the Hugging Face cache ({cache})"
    )
    assert hub_problem("models/my-sft", "model.path") == (
        f"{head}, and {hub} has no model 'models/my-sft' (HTTP 404; a private or gated model needs "
        f"HF_TOKEN). Set model.path to a save_pretrained folder or a hub id."
    )
    assert hub_problem("org/good", "model.path") is None  # the hub has it
    assert hub_problem("org/private", "model.path").startswith("model.path='org/private': no such folder")
    os.environ["HF_TOKEN"] = "t0k"
    try:
        assert hub_problem("org/private", "model.path") is None  # with the token, it is there
    finally:
        del os.environ["HF_TOKEN"]
    # In the cache: no question to the hub (the cache answers offline too).
    (cache / "models--models--my-sft" / "snapshots").mkdir(parents=True)
    assert hub_problem("models/my-sft", "model.path") is None
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        assert hub_problem("models/my-sft", "model.path") is None
        assert hub_problem("org/good", "model.path") == (
            f"model.path='org/good': no such folder (looked for {tmp_path}/org/good, relative to the working "
            f"directory {tmp_path}), not in the Hugging Face cache ({cache}), and the hub is off "
            f"(HF_HUB_OFFLINE). Set model.path to a save_pretrained folder."
        )
    finally:
        del os.environ["HF_HUB_OFFLINE"]
    # A hub that cannot be reached.
    os.environ["HF_ENDPOINT"] = "http://127.0.0.1:9"  # discard port: nothing listens
    assert hub_problem("org/good", "model.path").endswith(
        "and http://127.0.0.1:9 could not be reached ([Errno 111] Connection refused). "
        "Set model.path to a save_pretrained folder, or download the model first."
    )


def test_a_missing_model_id_ends_the_run_in_one_line(hub: str, tiny_assets: Path, tmp_path: Path) -> None:
    data = tiny_assets / "data" / "train.parquet"
    ok = [f"model.path={tiny_assets / 'base'}", f"data.train_files={data}", f"data.val_files={data}"]
    stdout, stderr = answer_early("PPOConfig", *ok, "model.path=models/my-sft", cwd=tmp_path)  # hub's env
    assert stdout == "2 False"
    assert stderr.startswith("error: model.path='models/my-sft': no such folder (looked for ")
    assert stderr.endswith(
        f"and {hub} has no model 'models/my-sft' (HTTP 404; a private or gated model "
        "needs HF_TOKEN). Set model.path to a save_pretrained folder or a hub id."
    )


def test_print_config_checks_the_environment_class(
    tiny_assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--print-config`` imports the multi-turn environment and makes one instance, as the trainer's
    start-up does: a class that cannot serve the run is an error in the trainer's words, exit 2 (a
    warning with ``--allow-missing-paths``)."""
    from ppo.cli import answer_early as early

    envs = tmp_path / "envs.py"
    envs.write_text(
        "class NeedsArgs:\n    def __init__(self, tools):\n        pass\n"
        "    def reset(self, row):\n        return None\n    def step(self, text):\n        return '', 0.0, True\n"
    )
    data = tiny_assets / "data" / "train.parquet"
    args = [
        f"model.path={tiny_assets / 'base'}",
        f"data.train_files={data}",
        f"data.val_files={data}",
        "rollout.multi_turn.enable=true",
        "rollout.multi_turn.stop=[</calc>]",
    ]

    def problems(env: str, *flags: str, code: int = 2) -> list[str]:
        with pytest.raises(SystemExit) as e:
            early(["--print-config", *flags, *args, f"rollout.multi_turn.env={env}"], "", PPOConfig)
        assert e.value.code == code
        err = capsys.readouterr().err
        prefixes = ("error: rollout.multi_turn.env", "warning: rollout.multi_turn.env")
        return [line for line in err.splitlines() if line.startswith(prefixes)]

    assert problems(f"{envs}:NeedsArgs") == [
        f"error: rollout.multi_turn.env='{envs}:NeedsArgs': NeedsArgs() raised TypeError: NeedsArgs.__init__() "
        "missing 1 required positional argument: 'tools' (the class is instantiated with no arguments, one per "
        "trajectory; reset(row) gets the row)"
    ]
    assert problems(f"{envs}:Calc") == [
        f"error: rollout.multi_turn.env='{envs}:Calc': {envs} has no attribute 'Calc'; it defines ['NeedsArgs']"
    ]
    assert problems(f"{envs}:Calc", "--allow-missing-paths", code=0) == [
        f"warning: rollout.multi_turn.env='{envs}:Calc': {envs} has no attribute 'Calc'; it defines ['NeedsArgs']"
    ]
    assert problems(f"{ROOT / 'configs' / 'calculator.py'}:Calculator", code=0) == []


def test_print_config_names_missing_inputs(
    tiny_assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ppo.cli import answer_early as early

    data = tiny_assets / "data" / "train.parquet"
    args = [f"model.path={tmp_path}/gone", f"data.train_files={data}", f"data.val_files={tmp_path}/val.jsonl"]
    missing = [
        f"model.path='{tmp_path}/gone': no such folder (looked for {tmp_path}/gone). "
        f"Set model.path to a save_pretrained folder or a hub id.",
        f"data.val_files: {tmp_path}/val.jsonl: no such data file",
    ]

    def printed(*flags: str, code: int) -> tuple[str, list[str]]:
        with pytest.raises(SystemExit) as e:
            early(["--print-config", *flags, *args], "", PPOConfig)
        assert e.value.code == code
        out, err = capsys.readouterr()
        return out, [line for line in err.splitlines() if line.startswith(("warning: ", "error: "))]

    # The check before sbatch (`--print-config && sbatch ...`) stops on a missing input: exit 2, one line each.
    out, lines = printed(code=2)
    assert "  path: " in out  # the resolved config is printed all the same
    assert lines[0] == f"error: {missing[0]}"
    assert lines[1].startswith(f"error: {missing[1]}")
    assert lines[2] == (
        "error: --print-config found missing inputs (exit 2); --allow-missing-paths checks the rest on a "
        "machine that cannot see them"
    )
    assert len(lines) == 3
    # A preset checked on a login node that cannot see the compute nodes' files: the same lines, warnings.
    _, lines = printed("--allow-missing-paths", code=0)
    assert lines[0] == f"warning: {missing[0]}"
    assert lines[1].startswith(f"warning: {missing[1]}")
    assert len(lines) == 2
