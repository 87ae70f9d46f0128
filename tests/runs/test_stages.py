"""Tests of the stages before PPO: ``scripts/train_sft.py``, ``scripts/train_reward_model.py`` and
the run harness they share, ``ppo/runner.py``.

Runs on a tiny Llama (hidden 32, 2 layers) with the character tokenizer and a few rows of the synthetic
task of ``scripts/make_tiny_assets.py``; the scripts run in this process as one rank, and under
``torch.distributed.run`` as 2 gloo ranks for the comparison with one rank::

    pytest tests/runs/test_stages.py                 # about a minute on 2 cores
    pytest tests/runs/test_stages.py -m "not slow"   # one rank only, seconds (the 2-rank comparison is slow)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from ppo import data, model_loading, models, rule_scoring, runner, stage_data
from ppo.distributed import DistInfo, rank_slice
from ppo.packing import pack_sequences, plan_eval_micro_batches
from tests.helpers import (
    ROOT,
    deterministic,
    excerpt,
    load_script,
    read_metrics,
    tiny_config,
    torchrun,
    write_parquet,
)

sft = load_script("train_sft")
rm = load_script("train_reward_model")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with the character tokenizer in ``base/``, and small data files in ``data/``."""
    assets = load_script("make_tiny_assets")
    root = tmp_path_factory.mktemp("tiny_stages")
    tokenizer = assets.build_tokenizer()
    # Half tiny_config's width and context: these tests take dozens of optimizer steps.
    sizes = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, max_position_embeddings=64)
    config = tiny_config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **sizes)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    task = assets.make_task(0)
    d = root / "data"
    d.mkdir()
    write_parquet(d / "sft_train.parquet", task["sft_train"][:128])
    write_parquet(d / "sft_val.parquet", task["sft_val"][:24])
    write_parquet(d / "val.parquet", task["val"][:8])
    pref = task["pref_train"][:64]
    bad = [
        {**pref[0], "chosen": ""},  # empty chosen
        {**pref[1], "rejected": pref[1]["chosen"]},  # identical
    ]
    write_parquet(d / "pref_train.parquet", pref[:10] + bad + pref[10:])
    write_parquet(d / "pref_val.parquet", task["pref_val"][:24])
    return root


def stage_args(tiny: Path, out: Path, data_name: str, *extra: str) -> list[str]:
    """Command-line overrides of a short fp32 run of a stage on the tiny assets' ``<data_name>_train``
    and ``<data_name>_val`` files, 16 examples a step, metrics in ``out``, the model in ``out/model``."""
    d = tiny / "data"
    return [
        f"model.path={tiny / 'base'}",
        f"data.train_files={d / f'{data_name}_train.parquet'}",
        f"data.val_files={d / f'{data_name}_val.parquet'}",
        "data.max_length=40",
        "data.train_batch_size=16",
        "trainer.device=cpu",
        "trainer.logger=[jsonl]",
        f"trainer.output_dir={out}",
        f"trainer.save_path={out / 'model'}",
        *extra,
    ]


def sft_args(tiny: Path, out: Path, *extra: str) -> list[str]:
    """A short SFT run: lr 1e-2 without warm-up, validation only when asked for."""
    sft_only = ["data.max_token_len_per_gpu=160", "optim.lr=1e-2", "optim.lr_warmup_steps=0"]
    return stage_args(tiny, out, "sft", *sft_only, "trainer.seed=3", "trainer.test_freq=100", *extra)


# ----------------------------------------------------------------------------------------------------
# Losses by hand
# ----------------------------------------------------------------------------------------------------


def test_bradley_terry_loss_and_accuracy_by_hand() -> None:
    chosen = torch.tensor([2.0, 0.0, 1.0])
    rejected = torch.tensor([0.0, 0.0, 3.0])
    # differences 2, 0, -2: -log sigmoid(d) = log(1 + e^-d) = log(1 + e^-2) = 0.126928,
    # log 2 = 0.693147, log(1 + e^2) = 2.126928
    loss = rm.bradley_terry_loss(chosen, rejected)
    torch.testing.assert_close(loss, torch.tensor([0.126928, 0.693147, 2.126928]), atol=1e-6, rtol=0)
    # margin 1 shifts the differences to 1, -1, -3: log(1 + e^-1) = 0.313262, log(1 + e) = 1.313262,
    # log(1 + e^3) = 3.048587
    loss = rm.bradley_terry_loss(chosen, rejected, margin=1.0)
    torch.testing.assert_close(loss, torch.tensor([0.313262, 1.313262, 3.048587]), atol=1e-6, rtol=0)
    # a tie is not a win: accuracy 1/3
    assert rm.pair_accuracy(chosen, rejected).tolist() == [1.0, 0.0, 0.0]
    # the gradient pushes the chosen score up by sigmoid(-d): for d = 0 that is 1/2
    scores = torch.zeros(2, requires_grad=True)
    rm.bradley_terry_loss(scores[:1], scores[1:]).sum().backward()
    assert scores.grad.tolist() == [-0.5, 0.5]


def test_answer_labels_mask_prompt_tokens_and_sequence_boundaries() -> None:
    a = stage_data.SFTExample(input_ids=[10, 11, 12, 13, 14], loss_mask=[False, False, True, True, True])
    b = stage_data.SFTExample(input_ids=[20, 21, 22], loss_mask=[False, True, True])
    packed = pack_sequences([a.input_ids, b.input_ids], torch.device("cpu"))
    assert packed.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert packed.cu_seqlens.tolist() == [0, 5, 8]
    labels = sft.answer_labels(packed, [a, b])
    # position t predicts token t + 1: only answer tokens are targets, and the last token of ``a``
    # does not predict the first of ``b``
    assert labels.tolist() == [-100, 12, 13, 14, -100, 21, 22, -100]
    assert int((labels != -100).sum()) == sum(a.loss_mask) + sum(b.loss_mask)


def test_no_loss_on_prompt_tokens(tiny: Path) -> None:
    model = model_loading.load_causal_lm(str(tiny / "base"))
    tok = model_loading.load_tokenizer(str(tiny / "base"))
    examples = stage_data.load_sft_examples(tiny / "data" / "sft_val.parquet", tok, max_length=40)[:3]
    packed = pack_sequences([ex.input_ids for ex in examples], torch.device("cpu"))
    labels = sft.answer_labels(packed, examples)
    logits = models.causal_lm_logits(model, packed.input_ids, packed.position_ids).detach().requires_grad_()
    logprobs, _ = sft.ppo_kernels.logprobs_from_logits(logits, labels, compute_entropy=False)
    (-logprobs.sum()).backward()
    grad_rows = logits.grad.abs().sum(-1)
    trained = labels != -100
    assert bool((grad_rows[~trained] == 0).all())  # prompt positions (and sequence ends): no gradient
    assert bool((grad_rows[trained] > 0).all())
    # the summed NLL equals a plain fp32 cross-entropy over the answer targets
    ce = torch.nn.functional.cross_entropy(logits.detach().float(), labels, reduction="sum")
    torch.testing.assert_close(sft.answer_nll_sum(model, examples, torch.device("cpu")).detach(), ce)


def test_eval_micro_batches_pad_to_the_agreed_count() -> None:
    budget = dict(use_dynamic_bsz=True, max_tokens=10, micro_batch_size=16)
    groups = plan_eval_micro_batches([4, 4, 4, 4], **budget)  # one rank: 16 tokens in groups of <= 10
    assert sorted(i for g in groups for i in g) == [0, 1, 2, 3] and len(groups) == 2
    assert plan_eval_micro_batches([], **budget) == []
    info = DistInfo(rank=1, world_size=3, local_rank=1, device=torch.device("cpu"))
    assert rank_slice(list(range(7)), info) == [2, 3, 4]  # bounds 0, 2, 5, 7 (rounded 2.33, 4.67)


def test_merge_metrics_keeps_other_keys(tmp_path: Path) -> None:
    path = tmp_path / "metrics.json"
    runner.merge_metrics(path, {"sft_val_accuracy": 0.5, "shared": 1})
    merged = runner.merge_metrics(path, {"rm_val_accuracy": 0.9, "shared": 2})
    assert merged == {"sft_val_accuracy": 0.5, "rm_val_accuracy": 0.9, "shared": 2}
    assert json.loads(path.read_text()) == merged


# ----------------------------------------------------------------------------------------------------
# The scripts in this process (one rank)
# ----------------------------------------------------------------------------------------------------


def test_sft_steps_lower_the_loss_and_save_a_loadable_model(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "sft"
    args = sft_args(
        tiny, out, "trainer.total_training_steps=12", f"data.eval_prompt_files={tiny / 'data/val.parquet'}"
    )
    assert sft.main(args) == 0
    rows = [r for r in read_metrics(out) if "train/loss" in r]
    losses = [r["train/loss"] for r in rows]
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3  # a random model starts near log(103) = 4.6
    assert rows[-1]["train/lr"] < rows[0]["train/lr"]  # cosine decay (the default schedule)
    assert "val/loss" in rows[-1] and math.isfinite(rows[-1]["val/loss"])
    assert (out / "config.yaml").is_file()
    reloaded = model_loading.load_causal_lm(str(out / "model"))
    assert isinstance(reloaded, LlamaForCausalLM)
    assert model_loading.load_tokenizer(str(out / "model")).chat_template is not None
    final = json.loads((out / "metrics.json").read_text())  # beside the saved folder
    assert final["sft_steps"] == 12 and final["sft_eval_prompts"] == 8
    # The greedy accuracy is that of the saved model's own greedy answers, scored by the rule.
    tok = model_loading.load_tokenizer(str(out / "model"))
    right = 0
    records = data.load_prompts(tiny / "data" / "val.parquet", tok, max_prompt_length=40)
    longest = max(len(r.input_ids) for r in records)
    for r in records:
        ids = torch.tensor([r.input_ids])
        answer = reloaded.generate(
            ids, max_new_tokens=40 - longest, do_sample=False, pad_token_id=tok.pad_token_id
        )
        text = tok.decode(answer[0, ids.shape[1] :], skip_special_tokens=True)
        right += rule_scoring.gsm8k_score(text, r.ground_truth) >= 1.0
    assert final["sft_val_accuracy"] == right / 8
    assert final["sft_sample_accuracy"] * 8 * sft.NUM_EVAL_SAMPLES == pytest.approx(
        round(final["sft_sample_accuracy"] * 8 * sft.NUM_EVAL_SAMPLES)
    )  # a count of right samples
    assert final["sft_pass_at_k"] >= final["sft_sample_accuracy"] - 1e-9


def test_sft_metrics_prefix_keeps_the_keys_of_another_run(tiny: Path, tmp_path: Path) -> None:
    """Two SFT runs that save their models into one folder (``make assets``' student and teacher): the
    second's ``trainer.metrics_prefix`` names its final numbers, and the first run's stay as they were."""
    student = {"sft_steps": 1600, "sft_steps_planned": 1600, "sft_stopped_early": False, "sft_val_loss": 0.5}
    (tmp_path / "metrics.json").write_text(json.dumps(student))
    args = sft_args(
        tiny,
        tmp_path / "runs" / "teacher",
        "trainer.total_training_steps=2",
        f"trainer.save_path={tmp_path / 'teacher'}",
        "trainer.metrics_prefix=teacher",
    )
    assert sft.main(args) == 0
    final = json.loads((tmp_path / "metrics.json").read_text())
    assert {k: final[k] for k in student} == student
    assert (final["teacher_steps"], final["teacher_steps_planned"], final["teacher_stopped_early"]) == (
        2,
        2,
        False,
    )
    assert set(final) == set(student) | {
        "teacher_steps",
        "teacher_steps_planned",
        "teacher_stopped_early",
        "teacher_train_time_s",
        "teacher_val_loss",
    }


def test_sft_resumes_exactly(tiny: Path, tmp_path: Path) -> None:
    """Six steps, a checkpoint, then the next six from it: the model and every logged number of a run
    that never stopped."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert sft.main(sft_args(tiny, straight, "trainer.total_training_steps=12")) == 0
    common = ["trainer.save_freq=6", "trainer.total_training_steps=12"]
    assert sft.main(sft_args(tiny, resumed, *common, "trainer.max_time_s=1e-9")) == 0  # stops after a step
    assert sft.main(sft_args(tiny, resumed, *common)) == 0
    drop = ("timing_s/", "perf/")
    assert deterministic(read_metrics(straight), drop) == deterministic(read_metrics(resumed), drop)
    x, y = (
        load_file(straight / "model" / "model.safetensors"),
        load_file(resumed / "model" / "model.safetensors"),
    )
    assert all(torch.equal(x[k], y[k]) for k in x)


def test_print_config_and_bad_override(capsys: pytest.CaptureFixture) -> None:
    preset = ["--config", str(ROOT / "configs/sft_demo.yaml")]  # it names assets/, which `make assets` writes
    assert sft.main([*preset, "--print-config", "--allow-missing-paths", "optim.lr=5e-4"]) == 0
    printed = capsys.readouterr().out
    assert "lr: 0.0005" in printed and "eval_prompt_files" in printed
    assert rm.main(["--print-config", "loss.margn=1"]) == 2
    assert "did you mean loss.margin" in capsys.readouterr().err


def rm_args(tiny: Path, out: Path, *extra: str) -> list[str]:
    """A 6-step reward-model run, validated every 3 steps."""
    rm_only = ["data.max_token_len_per_gpu=320", "optim.lr=2e-3", "trainer.total_training_steps=6"]
    return stage_args(tiny, out, "pref", *rm_only, "trainer.test_freq=3", *extra)


def test_reward_model_end_to_end_with_bad_rows_skipped(
    tiny: Path, tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    out = tmp_path / "rm"
    assert rm.main(rm_args(tiny, out, "loss.margin=0.5")) == 0
    err = capfd.readouterr().err
    assert "skipped 2 of 66 rows" in err and "64 train pairs (2 rows skipped)" in err
    final = json.loads((out / "metrics.json").read_text())
    assert final["rm_train_rows_skipped"] == 2 and final["rm_val_rows_skipped"] == 0
    # The held-out accuracy is the saved model's: the share of pairs whose chosen answer scores higher.
    tok = model_loading.load_tokenizer(str(out / "model"))
    saved_rm = model_loading.load_reward_model(str(out / "model"))
    val = stage_data.load_preference_pairs(tiny / "data" / "pref_val.parquet", tok, max_length=40)
    with torch.no_grad():
        right = sum(
            float(
                saved_rm(torch.tensor([p.chosen_ids])).logits[0, 0]
                > saved_rm(torch.tensor([p.rejected_ids])).logits[0, 0]
            )
            for p in val
        )
    assert final["rm_val_accuracy"] == pytest.approx(right / len(val), abs=1e-4)
    kinds = ("broken_format", "far_off", "slipped_carry", "wrong_final_line")
    assert sorted(final["rm_val_accuracy_by_mistake"]) == list(kinds)
    rows = read_metrics(out)
    assert [r["step"] for r in rows if "rm/accuracy" in r] == [3, 6]
    assert all(f"rm/accuracy/{k}" in rows[-1] for k in kinds)
    # the saved head is the trained one: reloading gives the same scores, with no fresh head
    reloaded = model_loading.load_reward_model(str(out / "model"))
    saved = load_file(out / "model" / "model.safetensors")
    torch.testing.assert_close(reloaded.score.weight, saved["score.weight"])
    assert not torch.equal(
        saved["score.weight"], model_loading.load_reward_model(str(tiny / "base")).score.weight
    )


def test_no_usable_rows_fails_with_one_clear_message(
    tiny: Path, tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    rows = [
        {"prompt": "1 + 1", "chosen": "2", "rejected": "2"},
        {"prompt": "1 + 2", "chosen": "", "rejected": "4"},
    ]
    bad = write_parquet(tmp_path / "all_bad.parquet", rows)
    assert rm.main(rm_args(tiny, tmp_path / "rm", f"data.train_files={bad}")) == 2
    err = capfd.readouterr().err
    assert f"{bad}: no usable preference pair among 2 rows" in err
    assert "Traceback" not in err


# ----------------------------------------------------------------------------------------------------
# Two gloo ranks against one
# ----------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("fsdp_size", [-1, 1], ids=["sharded", "replicated"])
def test_two_ranks_train_the_same_model_as_one(tiny: Path, tmp_path: Path, fsdp_size: int) -> None:
    # The same global batches (seeded order, 16 examples) cut into other micro-batches: with the loss
    # normalized by the global number of answer tokens, the parameters must agree to fp32 rounding.
    # fsdp_size=1 replicates the model on each rank (hybrid sharding), as the demo configs do.
    extra = ("trainer.total_training_steps=4", "trainer.dist_timeout_s=120", f"fsdp.fsdp_size={fsdp_size}")
    one = sft.main(sft_args(tiny, tmp_path / "one", *extra))
    assert one == 0
    two = torchrun(ROOT / "scripts" / "train_sft.py", *sft_args(tiny, tmp_path / "two", *extra), timeout=240)
    assert two.returncode == 0, excerpt(two.stderr)
    a = load_file(tmp_path / "one" / "model" / "model.safetensors")
    b = load_file(tmp_path / "two" / "model" / "model.safetensors")
    start = load_file(tiny / "base" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert not torch.equal(a[key], start[key]), key  # every tensor moved
        torch.testing.assert_close(a[key], b[key], atol=2e-5, rtol=1e-4, msg=key)
    # Adam hides a gradient that is off by a constant factor (e.g. a missing world-size scale) from
    # the parameters; the logged norm before clipping shows it.
    for key in ("train/loss", "train/grad_norm"):
        one_run, two_run = (
            torch.tensor([r[key] for r in read_metrics(tmp_path / run) if key in r]) for run in ("one", "two")
        )
        torch.testing.assert_close(one_run, two_run, atol=1e-5, rtol=1e-5, msg=key)
