"""On-policy distillation through ``train_ppo.main`` on the tiny assets: a teacher equal to the student
gives a loss of 0 (estimator and top-k; k3's gradient is 0 there too), a coefficient of 0 trains exactly
as the task alone, a LoRA student learns from the teacher (not from its own
adapters-off base), an offloaded teacher scores as a resident one, resume with a teacher is exact and refuses a replaced teacher; and on 2 ranks
(this file is the worker) two teachers each score their own rows, whatever mix of rows a rank holds."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import (
    Checks,
    assert_check,
    base_args,
    deterministic,
    hf_weights,
    max_diff,
    read_metrics,
    run,
    worker_results,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def teacher(tiny_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny base model with every weight moved by seeded noise: another model of the same tokenizer."""
    out = tmp_path_factory.mktemp("teacher") / "teacher"
    shutil.copytree(tiny_assets / "base", out)
    weights = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(7)
    save_file(
        {k: v + 0.05 * torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in weights.items()},
        out / "model.safetensors",
    )
    return out


def distill_args(assets: Path, out: Path, teacher: Path, *extra: str, steps: int = 2) -> list[str]:
    """GRPO's shape (4 prompts x 2 samples, one on-policy update a step) with one teacher."""
    return base_args(assets, out, steps=steps) + [
        "algorithm.adv_estimator=grpo",
        "actor.ppo_mini_batch_size=4",
        "trainer.val_before_train=false",
        "distillation.enabled=true",
        f"distillation.teacher_models.teacher_model.model_path={teacher}",
        *extra,
    ]


@pytest.mark.parametrize("mode", ["k3", "forward_kl_topk"], ids=["k3", "forward_kl_topk"])
def test_a_teacher_equal_to_the_student_gives_a_zero_loss(
    tiny_assets: Path, tmp_path: Path, mode: str
) -> None:
    """Student and teacher are the same weights at step 1: every token's loss is 0 (top-k: the KL over
    the teacher's 8 most likely tokens, both from the same hidden states); so is k3's gradient."""
    out = tmp_path / mode
    args = distill_args(
        tiny_assets,
        out,
        tiny_assets / "base",
        f"distillation.distillation_loss.loss_mode={mode}",
        "distillation.distillation_loss.topk=8",
        "distillation.distillation_loss.use_task_rewards=false",
        "rollout.n=1",  # without the task's loss grpo's groups of two are not needed
        steps=1,
    )
    assert run(args) == 0
    row = read_metrics(out)[0]
    assert abs(row["distillation/loss"]) < 1e-6 and abs(row["distillation/loss_max"]) < 1e-6
    assert "actor/pg_loss" not in row and "critic/advantages/mean" not in row  # no task loss, no advantages
    if mode == "forward_kl_topk":
        assert row["distillation/overlap_ratio"] == 1.0  # the same top-8 ids
        assert abs(row["distillation/student_mass"] - row["distillation/teacher_mass"]) < 1e-6
        # The truncated KL's gradient is -p_t at equality: it still moves mass onto the teacher's top 8.
        assert row["actor/grad_norm"] > 0.1
    else:
        assert abs(row["distillation/abs_loss"]) < 1e-6
        assert row["actor/grad_norm"] < 1e-5  # k3's gradient is 1 - e^(t - s) = 0 at equality


def test_a_zero_coefficient_trains_as_the_task_alone(
    tiny_assets: Path, teacher: Path, tmp_path: Path
) -> None:
    """``use_task_rewards`` with ``distillation_loss_coef=0``: the same samples and the same update as the
    GRPO run without a teacher (loading the teacher draws nothing from the seeded generators)."""
    plain, distilled = tmp_path / "plain", tmp_path / "distilled"
    grpo = ["algorithm.adv_estimator=grpo", "actor.ppo_mini_batch_size=4", "trainer.val_before_train=false"]
    assert run(base_args(tiny_assets, plain) + grpo + ["trainer.save_hf_on_end=true"]) == 0
    args = distill_args(
        tiny_assets,
        distilled,
        teacher,
        "distillation.distillation_loss.distillation_loss_coef=0",
        "trainer.save_hf_on_end=true",
    )
    assert run(args) == 0
    a, b = hf_weights(plain), hf_weights(distilled)
    assert max(max_diff(a[k], b[k]) for k in a) == 0.0
    rows = read_metrics(distilled)
    assert all(r["distillation/loss"] > 0 for r in rows)  # computed and logged, weighed 0
    assert [r["actor/pg_loss"] for r in rows] == [r["actor/pg_loss"] for r in read_metrics(plain)]


def test_a_lora_student_learns_from_the_teacher_not_its_base(
    tiny_assets: Path, teacher: Path, tmp_path: Path
) -> None:
    """Under LoRA the reference is the adapters-off actor, but a teacher is its own model: at step 1
    (adapters start at 0, so the student is the base) the loss is the same as without LoRA, and not 0."""
    full, adapted = tmp_path / "full", tmp_path / "lora"
    common = ("distillation.distillation_loss.use_task_rewards=false",)
    assert run(distill_args(tiny_assets, full, teacher, *common, steps=1)) == 0
    lora = distill_args(
        tiny_assets, adapted, teacher, *common, "actor.lora.rank=4", "actor.lora.alpha=8", steps=1
    )
    assert run(lora) == 0
    a, b = read_metrics(full)[0], read_metrics(adapted)[0]
    assert a["distillation/loss"] > 0.01
    assert abs(a["distillation/loss"] - b["distillation/loss"]) < 1e-6


def test_an_offloaded_teacher_scores_as_a_resident_one(
    tiny_assets: Path, teacher: Path, tmp_path: Path
) -> None:
    """``ref.fsdp.param_offload`` shards the teacher with its parameters on the CPU between forwards
    (FSDP2's offload policy): the same teacher log-probs, so the same step-1 loss, as the resident one."""
    resident, offloaded = tmp_path / "resident", tmp_path / "offloaded"
    common = ("distillation.distillation_loss.use_task_rewards=false", "rollout.n=1")
    assert run(distill_args(tiny_assets, resident, teacher, *common, steps=1)) == 0
    assert (
        run(distill_args(tiny_assets, offloaded, teacher, *common, "ref.fsdp.param_offload=true", steps=1))
        == 0
    )
    a, b = read_metrics(resident)[0], read_metrics(offloaded)[0]
    assert a["distillation/loss"] > 0.01
    assert abs(a["distillation/loss"] - b["distillation/loss"]) < 1e-6


@pytest.mark.slow
def test_resume_with_a_teacher_is_exact_and_refuses_a_replaced_one(
    tiny_assets: Path, teacher: Path, tmp_path: Path, caplog: Any
) -> None:
    """Teachers are not in the checkpoint: a resumed run loads them again and continues exactly; a
    teacher folder whose content changed since the checkpoint stops the resume, naming its key."""
    mine = tmp_path / "teacher"
    shutil.copytree(teacher, mine)
    extra = ("trainer.save_freq=2", "distillation.distillation_loss.loss_mode=forward_kl_topk")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run(distill_args(tiny_assets, straight, mine, *extra, steps=4)) == 0
    assert run(distill_args(tiny_assets, resumed, mine, *extra, steps=2)) == 0
    assert run(distill_args(tiny_assets, resumed, mine, *extra, "trainer.resume_mode=auto", steps=4)) == 0
    a, b = deterministic(read_metrics(straight)), deterministic(read_metrics(resumed))
    assert [r["step"] for r in b] == [1, 2, 3, 4] and a == b

    weights = load_file(mine / "model.safetensors")
    save_file({k: v * 1.01 for k, v in weights.items()}, mine / "model.safetensors")
    args = distill_args(tiny_assets, resumed, mine, *extra, "trainer.resume_mode=auto", steps=6)
    assert run(args) == 2
    assert (
        "distillation.teacher_models.teacher_model.model_path: its content changed since the checkpoint"
        in caplog.text
    )


# ----------------------------------------------------------------------------------------------------
# Two teachers on two gloo ranks (this file is the worker; see _worker below)
# ----------------------------------------------------------------------------------------------------

SOURCES = {0: ["src_a", "src_a", "src_a"], 1: ["src_a", "src_b", "src_b"]}
"""Each rank's rows' ``data_source``: rank 0 has none for teacher B, so it joins B's forwards with a row
of its own and drops the result."""


@pytest.mark.slow
def test_two_teachers_score_their_own_rows_on_two_ranks(
    tiny_assets: Path, teacher: Path, tmp_path: Path
) -> None:
    out = tmp_path / "results.json"
    results = worker_results(__file__, tiny_assets, teacher, out, out=out)
    for check in ("estimator_rows", "topk_rows", "unknown_key"):
        assert_check(results, check)


def _worker(assets: Path, teacher: Path, out: Path) -> None:
    """Both ranks build their batch, score it with two sharded teachers (``forward_teachers``), and compare
    each row with a forward of its own teacher loaded whole in this process."""
    from ppo import distillation, model_setup, packed_forward, ulysses
    from ppo.batch import Batch, Rollout, group_index
    from ppo.config_loader import load_config
    from ppo.data import PromptRecord
    from ppo.data_files import DataError
    from ppo.distributed import init_distributed
    from ppo.model_loading import load_causal_lm
    from ppo.packing import pack_rows

    info = init_distributed(device="cpu", timeout_s=60)
    checks = Checks(out, info.is_main, agree=True)
    with checks:
        teachers_cfg = [
            "distillation.enabled=true",
            f"+distillation.teacher_models.a.model_path={assets / 'base'}",
            "+distillation.teacher_models.a.key=src_a",
            f"+distillation.teacher_models.b.model_path={teacher}",
            "+distillation.teacher_models.b.key=src_b",
            f"model.path={assets / 'base'}",
            "ref.log_prob_micro_batch_size_per_gpu=1",
            "actor.use_dynamic_bsz=false",
        ]
        gen = torch.Generator().manual_seed(info.rank)
        sources = SOURCES[info.rank]
        records = [
            PromptRecord(
                input_ids=[1, 5, 10 + i],
                prompt_text="",
                data_source=s,
                ground_truth=None,
                extra_info={},
                index=i,
            )
            for i, s in enumerate(sources)
        ]
        responses = torch.randint(7, 40, (len(records), 5), generator=gen)
        exists = torch.ones_like(responses, dtype=torch.bool)
        exists[0, 3:] = False
        rollout = Rollout(
            prompts=[torch.tensor(r.input_ids) for r in records],
            responses=responses,
            attention_mask=exists,
            truncated=torch.zeros(len(records), dtype=torch.bool),
        )
        whole = {"src_a": load_causal_lm(str(assets / "base")), "src_b": load_causal_lm(str(teacher))}
        for mode, check in (("k3", "estimator_rows"), ("forward_kl_topk", "topk_rows")):
            cfg = load_config(
                None,
                [
                    *teachers_cfg,
                    f"distillation.distillation_loss.loss_mode={mode}",
                    "distillation.distillation_loss.topk=4",
                ],
            )
            teachers = model_setup.teachers(cfg, info, ulysses.NO_SP)
            batch = Batch(
                rollout=rollout, records=records, group_ids=group_index(len(records), 1, torch.device("cpu"))
            )
            distillation.forward_teachers(cfg, teachers, batch, ulysses.NO_SP)
            worst = 0.0
            for i, record in enumerate(records):
                packed = pack_rows(batch, torch.tensor([i]))
                model = whole[record.data_source]
                with torch.no_grad():
                    if mode == "k3":
                        expected, _ = packed_forward.logprobs(model, packed, temperature=1.0)
                        got = batch.teacher_logprobs[i : i + 1]
                    else:
                        expected, ids = packed_forward.topk(model, packed, k=4)
                        got = batch.teacher_topk_logprobs[i : i + 1]
                        worst = max(worst, float((ids != batch.teacher_topk_ids[i : i + 1]).any()))
                worst = max(worst, max_diff(got, expected))
            checks.within(check, worst, 1e-5)
        try:
            distillation.route(
                cfg,
                [
                    *records[:1],
                    PromptRecord(
                        input_ids=[1],
                        prompt_text="",
                        data_source="src_c",
                        ground_truth=None,
                        extra_info={},
                        index=41,
                    ),
                ],
                "data.train_files",
            )
            checks.record("unknown_key", False, "no error")
        except DataError as e:
            expected = (
                "data.train_files: row 41 has data_source='src_c', which no teacher's key is "
                "(distillation.teacher_models keys: src_a, src_b); add a teacher with that key or drop the row"
            )
            checks.record("unknown_key", str(e) == expected, str(e))


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
