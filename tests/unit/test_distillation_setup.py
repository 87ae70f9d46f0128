"""On-policy distillation's set-up (``distillation.*``, verl 0.9.1's keys): the defaults and a verl command
line, teachers merged key by key, the config errors (one line each, through ``--print-config`` too), the
teacher folders checked against the student's before any model loads, routing rows to teachers, the
start-up warnings, the checkpoint's input fingerprints and the min/max metric parts the loss logs. The
loss's math is ``test_distillation.py``; a verl distillation command line trains in
``test_verl_examples.py``.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from ppo import cli, distillation
from ppo.algorithms import DISTILLATION_LOSS_MODES
from ppo.config import ConfigError, DistillationLossConfig, PPOConfig, TeacherModelConfig
from ppo.config_loader import load_config
from ppo.data import PromptRecord
from ppo.data_files import DataError
from ppo.input_paths import teacher_problems
from ppo.metrics import combine_parts, extreme_part, metric_kind
from ppo.run_folder import fingerprint, input_fingerprints
from tests.helpers import REWARD_FNS, VERL_SIDE, demo_inputs, override_error

ON = "distillation.enabled=true"
TEACHER = "distillation.teacher_models.teacher_model.model_path=/models/teacher"
LOSS = "distillation.distillation_loss."
ALONE = LOSS + "use_task_rewards=false"
"""The distillation loss alone (no task loss): verl's distillation examples' setting."""


def print_config(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """What ``train_ppo.py --print-config ARGV`` does (``cli.answer_early``), in this process."""
    try:
        cfg, args = cli.parse_cli(["--print-config", *argv], PPOConfig)
    except ConfigError as e:
        code = cli.config_error(e)
    else:
        code = cli.print_config(cfg, args)
    out = capsys.readouterr()
    return code, out.out, out.err


# ----------------------------------------------------------------------------------------------------
# verl 0.9.1's keys mean the same
# ----------------------------------------------------------------------------------------------------

VERL_LOSS_DEFAULTS = {
    "loss_mode": "k3",
    "topk": 32,
    "use_task_rewards": True,
    "distillation_loss_coef": 1.0,
    "loss_max_clamp": None,
    "log_prob_min_clamp": None,
    "use_policy_gradient": False,
    "policy_loss_mode": "vanilla",
    "clip_ratio": 0.2,
    "clip_ratio_low": 0.2,
    "clip_ratio_high": 0.2,
}
"""``distillation.distillation_loss`` of verl 0.9.1's ``trainer/config/distillation/distillation.yaml``."""


def test_defaults_are_verls() -> None:
    d = PPOConfig().distillation
    assert (d.enabled, d.teacher_models, d.teacher_key) == (False, {}, "data_source")
    assert {k: getattr(d.distillation_loss, k) for k in VERL_LOSS_DEFAULTS} == VERL_LOSS_DEFAULTS
    assert not DistillationLossConfig().use_topk  # k3 needs the sampled token's log-prob only
    # Against verl's own file where the parity side is built (make parity-env): every loss key there.
    path = VERL_SIDE / "verl" / "trainer" / "config" / "distillation" / "distillation.yaml"
    if path.is_file():
        verl = yaml.safe_load(path.read_text())
        assert (verl["enabled"], verl["teacher_key"]) == (d.enabled, d.teacher_key)
        loss = {k: v for k, v in verl["distillation_loss"].items() if k != "_target_"}
        assert loss == VERL_LOSS_DEFAULTS


def test_a_verl_command_line_loads_and_names_what_it_ignores() -> None:
    notes: list[str] = []
    cfg = load_config(
        None,
        [
            *demo_inputs(),
            "distillation.enabled=True",
            "distillation.teacher_models.teacher_model.model_path=Qwen/Qwen2.5-7B-Instruct",
            "distillation.teacher_models.teacher_model.inference.name=vllm",
            "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=2",
            "distillation.teacher_models.teacher_model.num_replicas=1",
            "distillation.n_gpus_per_node=8",
            "distillation.nnodes=1",
            "distillation.distillation_loss.use_chunked_topk=True",
            "distillation.distillation_loss.loss_mode=k3",
            "distillation.distillation_loss.use_task_rewards=False",
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.rollout.n=1",
        ],
        notes=notes,
    )
    d = cfg.distillation
    assert d.enabled and not d.distillation_loss.use_task_rewards and cfg.rollout.n == 1
    assert d.teacher_models == {
        "teacher_model": TeacherModelConfig(key=None, model_path="Qwen/Qwen2.5-7B-Instruct")
    }
    assert notes[:2] == [
        "distillation.n_gpus_per_node=8 (from the command line), distillation.nnodes=1 (from the command line) "
        "are ignored: teachers are models of this run, sharded over all its ranks like the reference (no "
        "resource pool)",
        "distillation.distillation_loss.use_chunked_topk=True (from the command line) is ignored: the top-k "
        "log-probs are always computed in chunks of tokens here, without the [tokens, vocab] logits",
    ]
    assert cfg.warnings() == [
        "distillation.teacher_models.teacher_model.inference, distillation.teacher_models.teacher_model."
        "num_replicas: verl's serving settings of a teacher mean nothing here (teachers are sharded over this "
        "run's ranks like the reference) and are ignored"
    ]


def test_verls_two_teacher_form_with_plus_keys() -> None:
    # verl's docstring example. verl pops `teacher_model` once a second entry exists (it documents this
    # as a pitfall); here a configured `teacher_model` is kept beside the others.
    cfg = load_config(
        None,
        [
            *demo_inputs(),
            ON,
            "distillation.teacher_models.teacher_model.key=openai/gsm8k",
            "distillation.teacher_models.teacher_model.model_path=Qwen/Qwen3-4B",
            "+distillation.teacher_models.teacher_model2.key=hiyouga/geometry3k",
            "+distillation.teacher_models.teacher_model2.model_path=Qwen/Qwen3-VL-4B-Instruct",
            "+distillation.teacher_models.teacher_model2.inference.tensor_model_parallel_size=1",
            "+distillation.teacher_models.teacher_model2.num_replicas=1",
        ],
    )
    assert cfg.distillation.teacher_models == {
        "teacher_model": TeacherModelConfig(key="openai/gsm8k", model_path="Qwen/Qwen3-4B"),
        "teacher_model2": TeacherModelConfig(
            key="hiyouga/geometry3k", model_path="Qwen/Qwen3-VL-4B-Instruct"
        ),
    }
    (warning,) = cfg.warnings()
    assert warning.startswith(
        "distillation.teacher_models.teacher_model2.inference, distillation.teacher_models.teacher_model2."
        "num_replicas: verl's serving settings"
    )


def test_two_teachers_given_key_by_key_merge(tmp_path: Path) -> None:
    # Four overrides, a field each, plus a nested serving key given in two more: two teachers.
    overrides = [
        ON,
        "+distillation.teacher_models.a.key=x",
        "+distillation.teacher_models.b.key=y",
        "+distillation.teacher_models.a.model_path=p",
        "+distillation.teacher_models.a.inference.name=vllm",
        "+distillation.teacher_models.a.inference.tensor_model_parallel_size=2",
        "+distillation.teacher_models.b.model_path=q",
    ]
    cfg = load_config(None, overrides)
    assert cfg.distillation.teacher_models == {
        "a": TeacherModelConfig(key="x", model_path="p"),
        "b": TeacherModelConfig(key="y", model_path="q"),
    }
    # A YAML file's teacher completed by the command line.
    path = tmp_path / "d.yaml"
    path.write_text(
        "distillation:\n  enabled: true\n  teacher_models:\n    a: {key: x}\n    b: {key: y, model_path: q}\n"
    )
    cfg = load_config(path, ["distillation.teacher_models.a.model_path=p"])
    assert cfg.distillation.teacher_models["a"] == TeacherModelConfig(key="x", model_path="p")
    assert cfg.distillation.teacher_models["b"] == TeacherModelConfig(key="y", model_path="q")


def test_verls_placeholder_teacher_is_dropped(tmp_path: Path) -> None:
    # verl's full default yaml holds `teacher_model` with key and model_path null and its serving settings.
    placeholder = {
        "_target_": "verl.workers.config.DistillationTeacherModelConfig",
        "key": None,
        "model_path": None,
        "num_replicas": 0,
        "inference": {
            "_target_": "verl.workers.config.RolloutConfig",
            "name": None,
            "tensor_model_parallel_size": 2,
        },
    }
    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump({"distillation": {"teacher_models": {"teacher_model": placeholder}}}))
    assert load_config(path, []).distillation.teacher_models == {}
    cfg = load_config(path, [ON, "+distillation.teacher_models.gsm8k.model_path=/models/t"])
    assert cfg.distillation.teacher_models == {"gsm8k": TeacherModelConfig(key=None, model_path="/models/t")}
    # Enabled with the placeholder alone: no teacher.
    with pytest.raises(ConfigError, match=r"^distillation.enabled=true needs a teacher: "):
        load_config(path, [ON])


# ----------------------------------------------------------------------------------------------------
# The task's loss, groups and the reference
# ----------------------------------------------------------------------------------------------------


def test_one_response_per_prompt_with_grpo_needs_the_distillation_loss_alone() -> None:
    grpo_n1 = [ON, TEACHER, "algorithm.adv_estimator=grpo", "rollout.n=1"]
    cfg = load_config(None, [*grpo_n1, ALONE])  # verl's distillation examples: no advantage is computed
    assert cfg.rollout.n == 1 and not cfg.task_loss
    assert override_error(*grpo_n1) == (
        "algorithm.adv_estimator=grpo needs rollout.n >= 2 (a group baseline), got rollout.n=1 (from the "
        "command line)"
    )
    # Without distillation (the same use_task_rewards=false does nothing then) the rule holds too.
    assert override_error("algorithm.adv_estimator=grpo", "rollout.n=1", ALONE).startswith(
        "algorithm.adv_estimator=grpo needs rollout.n >= 2"
    )


@pytest.mark.parametrize(
    ("overrides", "task_loss", "needs_reference"),
    [
        ([], True, False),
        (["actor.use_kl_loss=true"], True, True),
        ([ON, TEACHER, "actor.use_kl_loss=true"], True, True),
        ([ON, TEACHER, "algorithm.use_kl_in_reward=true"], True, True),
        # The distillation loss alone: no KL loss or KL penalty, so no reference ...
        ([ON, TEACHER, ALONE, "actor.use_kl_loss=true", "algorithm.use_kl_in_reward=true"], False, False),
        # ... except for the KL rollback, which compares the policy with it after the update.
        ([ON, TEACHER, ALONE, "actor.use_kl_loss=true", "algorithm.rollback_kl=0.1"], False, True),
        # use_task_rewards=false without enabled is no distillation run: the task loss trains.
        ([ALONE, "actor.use_kl_loss=true"], True, True),
    ],
)
def test_task_loss_and_reference(overrides: list[str], task_loss: bool, needs_reference: bool) -> None:
    cfg = load_config(None, ["algorithm.adv_estimator=grpo", *overrides])
    assert (cfg.task_loss, cfg.needs_reference) == (task_loss, needs_reference)


# ----------------------------------------------------------------------------------------------------
# Bad input: one clear line each, from loading and from --print-config
# ----------------------------------------------------------------------------------------------------

BAD = [
    (
        "enabled without a teacher",
        [ON],
        "distillation.enabled=true needs a teacher: set distillation.teacher_models.teacher_model.model_path="
        "<folder> (distillation.enabled from the command line; distillation.teacher_models from the defaults)",
    ),
    (
        "a teacher without model_path",
        [ON, "+distillation.teacher_models.a.key=x"],
        "distillation.teacher_models.a has no model_path (from the command line)",
    ),
    (
        "two teachers without keys",
        [ON, "+distillation.teacher_models.a.model_path=p", "+distillation.teacher_models.b.model_path=q"],
        "distillation.teacher_models.a has no key: with several teachers each one names the data_source value "
        "of the rows it scores (from the command line)",
    ),
    (
        "with teacher_key=task the message names that field",
        [
            ON,
            "distillation.teacher_key=task",
            "+distillation.teacher_models.a.model_path=p",
            "+distillation.teacher_models.a.key=x",
            "+distillation.teacher_models.b.model_path=q",
        ],
        "distillation.teacher_models.b has no key: with several teachers each one names the task value of the "
        "rows it scores (from the command line)",
    ),
    (
        "an unknown teacher entry key",
        [ON, TEACHER, "distillation.teacher_models.teacher_model.path=/models/t"],
        "distillation.teacher_models.teacher_model.path is not a teacher key (a teacher takes key and "
        "model_path) (from the command line)",
    ),
    (
        "a model_path that is no string",
        [ON, "distillation.teacher_models.teacher_model.model_path=3"],
        "distillation.teacher_models.teacher_model.model_path must be a string, got 3 (from the command line)",
    ),
    (
        "an unknown loss_mode",
        [ON, TEACHER, LOSS + "loss_mode=jsd"],
        f"distillation.distillation_loss.loss_mode='jsd' is not a distillation loss; valid: "
        f"{', '.join(DISTILLATION_LOSS_MODES)} (from the command line)",
    ),
    (
        "topk=0",
        [ON, TEACHER, LOSS + "topk=0"],
        "distillation.distillation_loss.topk must be > 0, got 0 (from the command line)",
    ),
    (
        "k1 backpropagated",
        [ON, TEACHER, LOSS + "loss_mode=k1"],
        "distillation.distillation_loss.loss_mode=k1 backpropagated directly does not learn from the teacher "
        "(the gradient of log q_s - log p_t does not depend on p_t): set use_policy_gradient=true, or "
        "loss_mode=k3 or forward_kl_topk (distillation.distillation_loss.loss_mode from the command line; "
        "distillation.distillation_loss.use_policy_gradient from the defaults)",
    ),
    (
        "the distillation loss alone with GAE",
        [ON, TEACHER, ALONE, "algorithm.adv_estimator=gae"],
        "distillation.distillation_loss.use_task_rewards=false trains on the distillation loss alone, so "
        "algorithm.adv_estimator=gae would train a critic whose values nothing uses (with use_policy_gradient "
        "the advantages are the distillation losses): set algorithm.adv_estimator=grpo as verl's distillation "
        "examples do (from the command line)",
    ),
    (
        "SPPO",
        [ON, TEACHER, "actor.policy_loss.loss_mode=sppo"],
        "distillation.enabled=true is not combined with actor.policy_loss.loss_mode=sppo here (from the command line)",
    ),
    (
        "PRIME",
        [ON, TEACHER, "algorithm.adv_estimator=prime"],
        "distillation.enabled=true is not combined with algorithm.adv_estimator=prime here (from the command line)",
    ),
]


@pytest.mark.parametrize(("case", "overrides", "expected"), BAD, ids=[c[0] for c in BAD])
def test_bad_distillation_input_is_one_line(
    case: str, overrides: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert override_error(*overrides) == expected
    code, out, err = print_config(overrides, capsys)
    assert (code, out, err) == (2, "", f"config error: {expected}\n")


def test_unknown_loss_mode_is_refused_even_when_disabled() -> None:
    # The section is checked whatever `enabled` says: a typo in a preset shows before it is switched on.
    assert override_error(LOSS + "loss_mode=reverse_kl").startswith(
        "distillation.distillation_loss.loss_mode='reverse_kl' is not a distillation loss; valid: kl, k1,"
    )


def test_two_teachers_with_one_key() -> None:
    msg = override_error(
        ON,
        "+distillation.teacher_models.a.model_path=p",
        "+distillation.teacher_models.a.key=k",
        "+distillation.teacher_models.b.model_path=q",
        "+distillation.teacher_models.b.key=k",
    )
    assert "two teachers have the key 'k'" in msg and "(from the command line)" in msg
    assert msg.startswith("distillation.teacher_models"), msg


# ----------------------------------------------------------------------------------------------------
# Teacher folders against the student's, before any model loads
# ----------------------------------------------------------------------------------------------------


def edit_json(name: str, change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    """An edit of the JSON file ``name`` of a model folder."""

    def edit(folder: Path) -> None:
        data = json.loads((folder / name).read_text())
        change(data)
        (folder / name).write_text(json.dumps(data))

    return edit


def rename_vocab_entry(tokenizer: dict[str, Any]) -> None:
    vocab = tokenizer["model"]["vocab"]
    vocab["Z"] = vocab.pop("a")  # the same id for another string: the same size, another tokenizer


def teacher_folder(assets: Path, tmp_path: Path, edit: Callable[[Path], None] | None = None) -> Path:
    """A copy of the tiny student (``base``) as a teacher, with ``edit`` applied."""
    folder = tmp_path / "teacher"
    shutil.copytree(assets / "base", folder)
    if edit is not None:
        edit(folder)
    return folder


def distilling(assets: Path, teacher: Path | str, *overrides: str) -> list[str]:
    """A valid distillation command line on the tiny assets (the student ``base``) with this teacher."""
    data = assets / "data"
    return [
        f"model.path={assets / 'base'}",
        f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'val.parquet'}",
        ON,
        f"distillation.teacher_models.teacher_model.model_path={teacher}",
        *overrides,
    ]


TEACHER_KEY = "distillation.teacher_models.teacher_model.model_path"

SHARE = "a teacher must share the student's tokenizer"
TEACHER_CASES = [
    (
        "tokenizer.json",
        edit_json("tokenizer.json", rename_vocab_entry),
        (),
        "{key}={t}: its tokenizer differs from the student's (model.path={s}): tokenizer.json is not the same "
        f"file; {SHARE}",
    ),
    (
        "eos_token",
        edit_json("tokenizer_config.json", lambda c: c.update(eos_token="<|assistant|>")),
        (),
        "{key}={t}: its special tokens differ from the student's (model.path={s}): eos_token '<|assistant|>' "
        "vs '</s>'",
    ),
    (
        "vocab_size",
        edit_json("config.json", lambda c: c.update(vocab_size=200)),
        (),
        f"{{key}}={{t}}: its vocabulary has 200 tokens and the student's (model.path) 103; {SHARE}",
    ),
    (
        "topk",
        None,
        (LOSS + "loss_mode=forward_kl_topk", LOSS + "topk=103"),  # the tiny vocabulary has 103 tokens
        "distillation.distillation_loss.topk=103 must be below the vocabulary of {key}={t} (103 tokens)",
    ),
]


@pytest.mark.parametrize(
    ("case", "edit", "overrides", "expected"), TEACHER_CASES, ids=[c[0] for c in TEACHER_CASES]
)
def test_a_teacher_that_does_not_match_the_student(
    case: str,
    edit: Callable[[Path], None] | None,
    overrides: tuple[str, ...],
    expected: str,
    tiny_assets: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    teacher = teacher_folder(tiny_assets, tmp_path, edit)
    message = expected.format(key=TEACHER_KEY, t=teacher, s=tiny_assets / "base")
    cfg = load_config(None, distilling(tiny_assets, teacher, *overrides))
    assert teacher_problems(cfg) == [message]
    # --print-config, the check before a job is queued: the config, then the problem, exit 2.
    code, out, err = print_config(distilling(tiny_assets, teacher, *overrides), capsys)
    assert code == 2 and yaml.safe_load(out)["distillation"]["enabled"] is True
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: {message}",
        "error: --print-config found missing inputs (exit 2); --allow-missing-paths checks the rest on a "
        "machine that cannot see them",
    ]
    # The run's own start-up check (build.check_teachers) refuses it with the same line.
    from ppo.build import check_teachers

    with pytest.raises(ConfigError) as e:
        check_teachers(cfg, [])
    assert str(e.value) == message


def test_a_matching_teacher_passes(
    tiny_assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    teacher = teacher_folder(tiny_assets, tmp_path)
    cfg = load_config(
        None, distilling(tiny_assets, teacher, LOSS + "loss_mode=forward_kl_topk", LOSS + "topk=102")
    )
    assert teacher_problems(cfg) == []  # topk one below the 103-token vocabulary
    # The larger tiny teacher has the student's tokenizer files and vocabulary.
    assert teacher_problems(load_config(None, distilling(tiny_assets, tiny_assets / "base_teacher"))) == []
    # A hub id is not read here (transformers checks it when it loads).
    assert teacher_problems(load_config(None, distilling(tiny_assets, "Qwen/Qwen2.5-7B-Instruct"))) == []
    # Disabled: the teacher's folder is not looked at.
    cfg = load_config(None, [*distilling(tiny_assets, tmp_path / "gone"), "distillation.enabled=false"])
    assert teacher_problems(cfg) == []
    code, _, err = print_config(distilling(tiny_assets, teacher), capsys)
    assert code == 0 and "error: " not in err, err


def test_a_missing_teacher_folder_names_its_key(
    tiny_assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gone = tmp_path / "gone"
    code, _, err = print_config(distilling(tiny_assets, gone), capsys)
    assert code == 2
    assert err.splitlines()[-2] == (
        f"error: {TEACHER_KEY}='{gone}': no such folder (looked for {gone}). Set {TEACHER_KEY} to a "
        f"save_pretrained folder or a hub id."
    )


# ----------------------------------------------------------------------------------------------------
# Routing rows to teachers
# ----------------------------------------------------------------------------------------------------


def record(index: int, data_source: str, **extra_info: Any) -> PromptRecord:
    return PromptRecord(
        input_ids=[7],
        prompt_text="",
        data_source=data_source,
        ground_truth=None,
        extra_info=extra_info,
        index=index,
    )


TWO_TEACHERS = [
    ON,
    "+distillation.teacher_models.math.key=openai/gsm8k",
    "+distillation.teacher_models.math.model_path=/models/math",
    "+distillation.teacher_models.geo.key=hiyouga/geometry3k",
    "+distillation.teacher_models.geo.model_path=/models/geo",
]


def test_one_teacher_takes_every_row() -> None:
    cfg = load_config(None, [ON, TEACHER])
    rows = [record(0, "openai/gsm8k"), record(1, "anything"), record(2, "")]
    assert distillation.route(cfg, rows, "here") == ["teacher_model"] * 3
    # Even with a key set: one teacher scores every row, as verl's single-teacher path does.
    cfg = load_config(None, [ON, TEACHER, "distillation.teacher_models.teacher_model.key=openai/gsm8k"])
    assert distillation.route(cfg, rows, "here") == ["teacher_model"] * 3


def test_two_teachers_by_data_source() -> None:
    cfg = load_config(None, TWO_TEACHERS)
    rows = [record(0, "openai/gsm8k"), record(1, "hiyouga/geometry3k"), record(2, "openai/gsm8k")]
    assert distillation.route(cfg, rows, "here") == ["math", "geo", "math"]


def test_two_teachers_by_an_extra_info_field() -> None:
    cfg = load_config(
        None,
        [
            ON,
            "distillation.teacher_key=task",
            "+distillation.teacher_models.a.key=add",
            "+distillation.teacher_models.a.model_path=/models/a",
            "+distillation.teacher_models.b.key=mul",
            "+distillation.teacher_models.b.model_path=/models/b",
        ],
    )
    # data_source says nothing here: the rows' extra_info['task'] decides.
    rows = [record(0, "openai/gsm8k", task="mul"), record(1, "openai/gsm8k", task="add")]
    assert distillation.route(cfg, rows, "here") == ["b", "a"]
    with pytest.raises(DataError) as e:
        distillation.route(cfg, [*rows, record(5, "openai/gsm8k")], "the step's rows")
    assert str(e.value) == (
        "the step's rows: row 5 has task=None, which no teacher's key is (distillation.teacher_models keys: "
        "add, mul); add a teacher with that key or drop the row"
    )


def test_a_row_no_teacher_takes_is_refused_at_start_up(tiny_assets: Path, tmp_path: Path) -> None:
    from ppo.build import check_teachers

    cfg = load_config(None, TWO_TEACHERS)
    rows = [record(0, "openai/gsm8k"), record(7, "lighteval/MATH"), record(9, "other")]
    with pytest.raises(DataError) as e:
        distillation.check_routing(cfg, rows)
    assert str(e.value) == (
        "data.train_files: row 7 has data_source='lighteval/MATH', which no teacher's key is "
        "(distillation.teacher_models keys: hiyouga/geometry3k, openai/gsm8k); add a teacher with that key "
        "or drop the row"
    )
    # Through the trainer's start-up check, with teachers whose folders exist.
    base = tiny_assets / "base"
    folders = [f"+distillation.teacher_models.{n}.model_path={base}" for n in ("math", "geo")]
    cfg = load_config(None, [f"model.path={base}", *TWO_TEACHERS, *folders])
    with pytest.raises(DataError, match=r"^data.train_files: row 7 has data_source='lighteval/MATH'"):
        check_teachers(cfg, rows)
    check_teachers(cfg, rows[:1])  # every row routed: nothing to say
    distillation.check_routing(load_config(None, TWO_TEACHERS[1:]), rows)  # disabled: not checked


# ----------------------------------------------------------------------------------------------------
# Start-up warnings
# ----------------------------------------------------------------------------------------------------

P = "distillation.distillation_loss"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([TEACHER], ["distillation.enabled=false: distillation.teacher_models (teacher_model) is ignored"]),
        ([ON, TEACHER, f"{P}.topk=16"], [f"{P}.loss_mode=k3: {P}.topk=16 is ignored"]),
        (
            [ON, TEACHER, f"{P}.topk=16", f"{P}.log_prob_min_clamp=-10"],
            [f"{P}.loss_mode=k3: {P}.topk=16, {P}.log_prob_min_clamp=-10.0 are ignored"],
        ),
        (
            [ON, TEACHER, f"{P}.clip_ratio_low=0.1", f"{P}.clip_ratio_high=0.3"],
            [f"{P}.use_policy_gradient=false: {P}.clip_ratio_low=0.1, {P}.clip_ratio_high=0.3 are ignored"],
        ),
        # The clip ratios are used with use_policy_gradient (k1), topk with forward_kl_topk: no warning.
        ([ON, TEACHER, f"{P}.loss_mode=k1", f"{P}.use_policy_gradient=true", f"{P}.clip_ratio_low=0.1"], []),
        ([ON, TEACHER, f"{P}.loss_mode=forward_kl_topk", f"{P}.topk=16", f"{P}.log_prob_min_clamp=-10"], []),
        # Without the task's loss the coefficient weighs nothing ...
        (
            [ON, TEACHER, ALONE, f"{P}.distillation_loss_coef=0.5"],
            [f"{P}.use_task_rewards=false: {P}.distillation_loss_coef=0.5 is ignored"],
        ),
        ([ON, TEACHER, f"{P}.distillation_loss_coef=0.5"], []),
        # ... and neither do the task loss's KL and entropy terms.
        (
            [ON, TEACHER, ALONE, "actor.use_kl_loss=true"],
            [
                f"{P}.use_task_rewards=false trains on the distillation loss alone: actor.use_kl_loss=True does nothing"
            ],
        ),
        (
            [
                ON,
                TEACHER,
                ALONE,
                "actor.use_kl_loss=true",
                "algorithm.use_kl_in_reward=true",
                "actor.entropy_coeff=0.01",
            ],
            [
                f"{P}.use_task_rewards=false trains on the distillation loss alone: actor.use_kl_loss=True, "
                "algorithm.use_kl_in_reward=True, actor.entropy_coeff=0.01 do nothing"
            ],
        ),
        ([ON, TEACHER, "actor.use_kl_loss=true"], []),
        (
            [ON, TEACHER, ALONE, f"reward.custom_function={REWARD_FNS}:digit_score"],
            [
                f"{P}.use_task_rewards=false: the scores of reward.custom_function={REWARD_FNS}:digit_score do "
                "not train the student (they are logged as critic/score/*, and validation uses them)"
            ],
        ),
        ([ON, TEACHER, f"reward.custom_function={REWARD_FNS}:digit_score"], []),
        ([ON, TEACHER, ALONE], []),
    ],
)
def test_startup_warnings(overrides: list[str], expected: list[str]) -> None:
    assert (
        load_config(None, [*demo_inputs(), "algorithm.adv_estimator=grpo", *overrides]).warnings() == expected
    )


# ----------------------------------------------------------------------------------------------------
# What a checkpoint records of its inputs
# ----------------------------------------------------------------------------------------------------


def test_input_fingerprints_name_the_teachers(tiny_assets: Path, tmp_path: Path) -> None:
    teacher = teacher_folder(tiny_assets, tmp_path)
    overrides = [
        f"model.path={tiny_assets / 'base'}",
        "+distillation.teacher_models.a.key=x",
        f"+distillation.teacher_models.a.model_path={teacher}",
        "+distillation.teacher_models.b.key=y",
        "+distillation.teacher_models.b.model_path=Qwen/Qwen2.5-7B-Instruct",
    ]
    prints = input_fingerprints(load_config(None, [ON, *overrides]))
    assert prints["distillation.teacher_models.a.model_path"] == fingerprint(teacher)
    assert len(prints["distillation.teacher_models.a.model_path"]) == 16
    assert prints["distillation.teacher_models.b.model_path"] is None  # a hub id: its name identifies it
    # A copy has the student's fingerprint (the same files); an edited teacher another one.
    assert prints["distillation.teacher_models.a.model_path"] == prints["model.path"]
    edit_json("config.json", lambda c: c.update(vocab_size=104))(teacher)
    assert (
        input_fingerprints(load_config(None, [ON, *overrides]))["distillation.teacher_models.a.model_path"]
        != (prints["model.path"])
    )
    disabled = input_fingerprints(load_config(None, overrides))
    assert not [k for k in disabled if k.startswith("distillation.")]
    assert disabled["model.path"] == prints["model.path"]


# ----------------------------------------------------------------------------------------------------
# Min and max metric parts (ppo.metrics), combined over micro-batches, ranks and mini-batches
# ----------------------------------------------------------------------------------------------------


def test_extreme_part() -> None:
    # A micro-batch's min or max (the identity +inf / -inf where it has no token) under its kind's suffix.
    value = torch.tensor(-2.0, requires_grad=True) * 1.0
    part = extreme_part("distillation/loss_min", value, "min")
    assert list(part) == ["distillation/loss_min#min"] and part["distillation/loss_min#min"].item() == -2.0
    assert not part["distillation/loss_min#min"].requires_grad  # a metric keeps no graph
    none = extreme_part("distillation/loss_max", torch.tensor(-math.inf), "max")
    assert none == {"distillation/loss_max#max": -math.inf}


def test_metric_kind() -> None:
    assert metric_kind("distillation/loss_min#min") == "min"
    assert metric_kind("distillation/loss_max#max") == "max"
    assert metric_kind("distillation/abs_loss#sum") == "sum"
    assert metric_kind("distillation/abs_loss#count") == "sum"
    assert metric_kind("actor/pg_loss") == "sum"
    assert metric_kind("a#b/c#max") == "max"  # the last suffix decides


def test_combine_parts() -> None:
    assert combine_parts(None, 2.0, "m#min") == 2.0  # the first part
    assert combine_parts(1.0, 2.0, "actor/pg_loss") == 3.0
    assert combine_parts(1.0, 2.0, "m#min") == 1.0
    assert combine_parts(1.0, 2.0, "m#max") == 2.0
    inf, ninf = torch.tensor(math.inf), torch.tensor(-math.inf)
    # An empty micro-batch's sentinel loses to any value, on tensors as on floats.
    assert combine_parts(inf, torch.tensor(-3.0), "m#min").item() == -3.0
    assert combine_parts(torch.tensor(-3.0), inf, "m#min").item() == -3.0
    assert combine_parts(ninf, torch.tensor(-3.0), "m#max").item() == -3.0
    assert combine_parts(math.inf, math.inf, "m#min") == math.inf  # still none: optimize logs 0
    total = combine_parts(torch.tensor([1.0, 2.0]), torch.tensor([3.0, 0.5]), "m#max")
    assert total.tolist() == [3.0, 2.0]


def test_optimize_takes_min_and_max_over_micro_batches(one_rank: Any) -> None:
    """``ppo.optimize.optimize`` with a closure that logs extremes of its micro-batch's row indices: the
    min and max are over every micro-batch, a metric no micro-batch had any value for is 0, and no part's
    suffix is left in the keys."""
    from ppo import ulysses
    from ppo.batch import Batch, Rollout, group_index
    from ppo.optim import Trained
    from ppo.optimize import optimize

    rows, width = 8, 4
    rollout = Rollout(
        prompts=[torch.tensor([7, 8]) for _ in range(rows)],
        responses=torch.full((rows, width), 9),
        attention_mask=torch.ones(rows, width, dtype=torch.bool),
        truncated=torch.zeros(rows, dtype=torch.bool),
    )
    batch = Batch(
        rollout=rollout,
        records=[record(i, "t") for i in range(rows)],
        group_ids=group_index(rows, 2, torch.device("cpu")),
    )
    cfg = load_config(
        None, ["actor.use_dynamic_bsz=false", "actor.ppo_micro_batch_size_per_gpu=2", "actor.shuffle=false"]
    )
    weight = torch.nn.Parameter(torch.zeros(()))
    model = torch.nn.Module()
    model.weight = weight
    optimizer = torch.optim.SGD([weight], lr=0.0)
    trained = Trained(
        model=model, optimizer=optimizer, scheduler=torch.optim.lr_scheduler.ConstantLR(optimizer, 1.0)
    )
    seen: list[list[int]] = []

    def extreme(values: torch.Tensor, kind: str) -> torch.Tensor:
        """The micro-batch's min or max, the kind's identity where it has no value."""
        if not values.numel():
            return torch.tensor(math.inf if kind == "min" else -math.inf, dtype=torch.float64)
        return values.min() if kind == "min" else values.max()

    def loss_fn(sel: torch.Tensor, counts: dict[str, float]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        seen.append(sel.tolist())
        index = sel.double()
        parts = {
            **extreme_part("x/row_min", extreme(index, "min"), "min"),
            **extreme_part("x/row_max", extreme(index, "max"), "max"),
            # empty in the micro-batches of rows < 5
            **extreme_part("x/late_min", extreme(index[index >= 5], "min"), "min"),
            **extreme_part("x/none_max", extreme(index[index > 100], "max"), "max"),  # empty everywhere
        }
        return weight * 0.0, parts

    out = optimize(cfg.actor, "x", trained, batch, loss_fn, num_mini=2, shuffle=False, sp=ulysses.NO_SP)
    assert sorted(i for s in seen for i in s) == list(range(rows)) and len(seen) == 4  # 2 mini x 2 micro
    # Over both mini-batches and their micro-batches: rows 0..7.
    assert out["x/row_min"] == 0.0
    assert out["x/row_max"] == 7.0
    assert out["x/late_min"] == 5.0
    assert out["x/none_max"] == 0.0  # -inf everywhere: logged as 0
    assert not [k for k in out if "#" in k]
