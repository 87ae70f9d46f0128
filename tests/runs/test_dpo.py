"""Tests of the DPO family: the losses (``ppo/algorithms/preference.py``) by hand, pairs from ranked groups
(``ppo.stage_data.load_dpo_pairs``), and ``scripts/train_dpo.py`` through its entry point: the first
step's loss at initialization, what is loaded as the reference, exact resume, and 2 gloo ranks or
another micro-batch budget against one rank.

The runs use the untrained tiny Llama of ``tiny_assets`` on a hand-written file of ranked groups of the
synthetic task; what is checked is the plumbing, exactly::

    pytest tests/runs/test_dpo.py
    pytest tests/runs/test_dpo.py -m "not slow"
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaForCausalLM

from ppo import algorithms, data, model_loading, stage_data
from ppo.config import ConfigError, DPOConfig, PreferenceLossConfig, validate_stage
from ppo.config_loader import load_config
from ppo.data_files import DataError
from tests.helpers import (
    ROOT,
    arith_row,
    demo_inputs,
    excerpt,
    load_script,
    max_diff,
    tiny_config,
    torchrun,
    write_parquet,
)

dpo = load_script("train_dpo")

LN2 = math.log(2.0)

# peft 0.21 asks transformers 5 for the deprecated is_gradient_checkpointing when it wraps a model.
pytestmark = [
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
    pytest.mark.usefixtures("one_thread"),
]


def answers(a: int, b: int) -> list[str]:
    """Four answers to ``a + b``, from right to worst: right, a slipped carry, a wrong final line, none."""
    return [
        f"{a} + {b} = {a + b}\n#### {a + b}",
        f"{a} + {b} = {a + b - 10}\n#### {a + b - 10}",
        f"{a} + {b} = {a + b}\n#### {a + b + 1}",
        "no idea",
    ]


RANKINGS = [[0, 1, 2, 3], [2, 0, 0, 3], [0, 0, 2, 2], [0, 0, 0, 0], [3, 0, 1, 2], [0, 1, 1, 1]]
"""Ranks of the training groups, in turn: pairs best_vs_rest 3, 2, 2, 0 (all tie), 3, 3 = 13 per 6 rows."""


@pytest.fixture(scope="module")
def files(tiny_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``groups``: 12 ranked groups of 4 (2 of them all tied: 26 pairs best_vs_rest); ``eval``: 8 prompts."""
    d = tmp_path_factory.mktemp("dpo_data")
    problems = [(12, 39), (25, 17), (48, 33), (61, 29), (14, 22), (57, 35)] * 2
    rows = [
        arith_row(a, b, responses=answers(a, b), ranks=RANKINGS[i % len(RANKINGS)])
        for i, (a, b) in enumerate(problems)
    ]
    return {
        "groups": write_parquet(d / "groups.parquet", rows),
        "eval": write_parquet(
            d / "eval.parquet", pq.read_table(tiny_assets / "data" / "val.parquet").to_pylist()[:8]
        ),
    }


def dpo_args(tiny_assets: Path, files: dict[str, Path], out: Path, *extra: str) -> list[str]:
    """Command-line overrides of a short fp32 run on the tiny model (4 pairs a step, one micro-batch)."""
    return [
        f"model.path={tiny_assets / 'base'}",
        f"data.train_files=[{files['groups']}]",
        "data.max_prompt_length=32",
        "data.max_response_length=24",
        "data.train_batch_size=4",
        "data.max_token_len_per_gpu=1024",
        "optim.lr=1e-3",
        "trainer.device=cpu",
        "trainer.seed=3",
        "trainer.total_training_steps=3",
        "trainer.test_freq=-1",
        "trainer.logger=[jsonl]",
        f"trainer.output_dir={out}",
        *extra,
    ]


def read_jsonl(path: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def train_rows(out: Path) -> list[dict[str, float]]:
    return [r for r in read_jsonl(out / "metrics.jsonl") if "train/loss" in r]


# ----------------------------------------------------------------------------------------------------
# Losses by hand
# ----------------------------------------------------------------------------------------------------


def test_dpo_and_ipo_at_initialization() -> None:
    zero = torch.zeros(3)  # π = π_ref: every log-ratio is 0
    # h = 0: -log σ(0) = log 2, and with smoothing -(1 - ε) log σ(0) - ε log σ(0) = log 2 too
    torch.testing.assert_close(algorithms.dpo_loss(zero, zero, beta=0.1), torch.full((3,), LN2))
    torch.testing.assert_close(
        algorithms.dpo_loss(zero, zero, beta=0.1, label_smoothing=0.3), torch.full((3,), LN2)
    )
    # IPO: (0 - 1/(2β))² = (1/0.2)² = 25 at β = 0.1
    torch.testing.assert_close(algorithms.ipo_loss(zero, zero, beta=0.1), torch.full((3,), 25.0))
    # KTO: z = 0, (1 - σ(0)) + (1 - σ(0)) = 1, halved: 0.5
    torch.testing.assert_close(algorithms.kto_loss(zero, zero, 0.0, beta=0.1), torch.full((3,), 0.5))


def test_dpo_gradient_at_initialization_on_log_prob_leaves() -> None:
    # dL/dh = -σ(-h) = -1/2 at h = 0 and h = β (logr_w - logr_l): dL/dlogπ_w = -β/2, dL/dlogπ_l = +β/2
    beta = 0.1
    policy = torch.tensor([-3.0, -5.0], requires_grad=True)  # log π(y_w), log π(y_l)
    ref = policy.detach().clone()
    algorithms.dpo_loss(policy[:1] - ref[:1], policy[1:] - ref[1:], beta=beta).sum().backward()
    torch.testing.assert_close(policy.grad, torch.tensor([-beta / 2, beta / 2]))


def test_dpo_gradient_at_initialization_on_a_model() -> None:
    """Through the script's packed forward: ∇L = -β/2 (∇log π(y_w) - ∇log π(y_l)) when π = π_ref."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config())
    pair = stage_data.PreferencePair(
        chosen_ids=[1, 5, 6, 7, 8, 9, 2],
        rejected_ids=[1, 5, 6, 7, 20, 21, 22, 2],
        prompt_length=4,
        extra={},
        index=0,
    )
    cpu = torch.device("cpu")
    beta = 0.25
    with torch.no_grad():
        ref = dpo.pair_logps(model, [pair], cpu)
    policy = dpo.pair_logps(model, [pair], cpu)
    losses, _, _ = dpo.pair_losses(PreferenceLossConfig(type="dpo", beta=beta), policy, ref, 0.0)
    assert losses.item() == pytest.approx(LN2, abs=1e-6)
    losses.sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    policy = dpo.pair_logps(model, [pair], cpu)
    (policy.chosen - policy.rejected).sum().backward()
    for name, p in model.named_parameters():
        expected = -beta / 2 * p.grad
        assert max_diff(got[name], expected) <= 1e-5 * max(expected.abs().max().item(), 1e-6), name
    # and the summed log-prob is that of plain transformers on the whole sequence
    with torch.no_grad():
        logits = model(torch.tensor([pair.chosen_ids])).logits[0].log_softmax(-1)
    by_hand = sum(logits[t - 1, pair.chosen_ids[t]] for t in range(4, len(pair.chosen_ids)))
    assert ref.chosen.item() == pytest.approx(by_hand.item(), abs=1e-5)


def test_simpo_and_cdpo_by_hand() -> None:
    """SimPO, β = 2, γ = 1, token-mean log-probs of the chosen and rejected responses:

    - -0.5 and -1.5: h = 2 · 1.0 - 1 = 1, loss = -log σ(1) = log(1 + e^-1) = 0.313262;
    - -1.0 and -1.0: h = 0 - 1 = -1, loss = log(1 + e) = 1.313262.

    cDPO, β = 0.5, ε = 0.2, log-ratios 1 and -1: h = 0.5 · 2 = 1,
    loss = -0.8 log σ(1) - 0.2 log σ(-1) = 0.8 · 0.313262 + 0.2 · 1.313262 = 0.250610 + 0.262652 = 0.513262.
    """
    simpo = algorithms.simpo_loss(torch.tensor([-0.5, -1.0]), torch.tensor([-1.5, -1.0]), beta=2.0, gamma=1.0)
    torch.testing.assert_close(simpo, torch.tensor([0.313262, 1.313262]), atol=1e-6, rtol=0)
    cdpo = algorithms.dpo_loss(torch.tensor([1.0]), torch.tensor([-1.0]), beta=0.5, label_smoothing=0.2)
    torch.testing.assert_close(cdpo, torch.tensor([0.513262]), atol=1e-6, rtol=0)
    # The script's SimPO takes token means of summed log-probs: sums -1 over 2 tokens and -3 over 2
    policy = dpo.PairLogps(
        chosen=torch.tensor([-1.0]),
        rejected=torch.tensor([-3.0]),
        chosen_tokens=torch.tensor([2.0]),
        rejected_tokens=torch.tensor([2.0]),
    )
    losses, chosen_rewards, rejected_rewards = dpo.pair_losses(
        PreferenceLossConfig(type="simpo", beta=2.0, gamma=1.0), policy, None, 0.0
    )
    torch.testing.assert_close(losses, torch.tensor([0.313262]), atol=1e-6, rtol=0)
    assert (chosen_rewards.item(), rejected_rewards.item()) == (-1.0, -3.0)  # β · mean log-prob


def test_kto_by_hand() -> None:
    # β = 1, log-ratios 2 and -2, batch KL 1: desirable 1 - σ(2 - 1) = 0.268941, undesirable
    # 1 - σ(1 - (-2)) = 1 - σ(3) = 0.047426; their mean 0.158184
    loss = algorithms.kto_loss(torch.tensor([2.0]), torch.tensor([-2.0]), 1.0, beta=1.0)
    torch.testing.assert_close(loss, torch.tensor([0.158184]), atol=1e-6, rtol=0)
    # a negative KL estimate clamps to 0: with log-ratios 2 and -2, z = 0 gives 1 - σ(2) = 0.119203 for
    # both responses; unclamped, z = -5 would give (1 - σ(7) + 1 - σ(-3)) / 2 = 0.476743
    clamped = algorithms.kto_loss(torch.tensor([2.0]), torch.tensor([-2.0]), -5.0, beta=1.0)
    torch.testing.assert_close(clamped, torch.tensor([0.119203]), atol=1e-6, rtol=0)


def test_ipo_is_trls_token_means_and_ipo_sum_the_sums() -> None:
    """``ipo`` (TRL's) takes the margin of log-ratios averaged over each response's tokens, ``ipo_sum``
    of their sums: sums that differ from the means (2 and 4 tokens) at a margin away from 0."""
    policy = dpo.PairLogps(
        chosen=torch.tensor([-2.0]),
        rejected=torch.tensor([-8.0]),
        chosen_tokens=torch.tensor([2.0]),
        rejected_tokens=torch.tensor([4.0]),
    )
    ref = dpo.PairLogps(
        chosen=torch.tensor([-3.0]),
        rejected=torch.tensor([-6.0]),
        chosen_tokens=torch.tensor([2.0]),
        rejected_tokens=torch.tensor([4.0]),
    )
    losses, _, _ = dpo.pair_losses(PreferenceLossConfig(type="ipo_sum", beta=0.25), policy, ref, 0.0)
    # log-ratios 1 and -2, margin 3, target 1/(2 · 0.25) = 2: (3 - 2)² = 1; with token means the margin
    # would be 1/2 - (-2/4) = 1 and the loss (1 - 2)² = 1 too, so also check another β:
    torch.testing.assert_close(losses, torch.tensor([1.0]))
    losses, _, _ = dpo.pair_losses(PreferenceLossConfig(type="ipo_sum", beta=0.5), policy, ref, 0.0)
    # target 1: (3 - 1)² = 4 (token means: (1 - 1)² = 0)
    torch.testing.assert_close(losses, torch.tensor([4.0]))
    # TRL's ipo: token-mean log-ratios 1/2 and -2/4, margin 1; β = 0.5: (1 - 1)² = 0; β = 0.1: (1 - 5)² = 16
    losses, chosen, rejected = dpo.pair_losses(PreferenceLossConfig(type="ipo", beta=0.5), policy, ref, 0.0)
    torch.testing.assert_close(losses, torch.tensor([0.0]))
    torch.testing.assert_close((chosen, rejected), (torch.tensor([0.25]), torch.tensor([-0.25])))  # β · mean
    losses, _, _ = dpo.pair_losses(PreferenceLossConfig(type="ipo", beta=0.1), policy, ref, 0.0)
    torch.testing.assert_close(losses, torch.tensor([16.0]))


def test_kto_with_one_pair_per_rank_is_refused() -> None:
    """KTO's reference point pairs each prompt with another pair's response on the same rank: one pair
    per rank would estimate it from the pair's own chosen response, so start-up refuses it."""
    one = ["loss.type=kto", "data.train_batch_size=2", "data.micro_batch_size_per_gpu=1"]
    with pytest.raises(
        ConfigError,
        match=r"loss.type=kto needs 2 pairs per rank .*data.train_batch_size / world size = 2 / 2",
    ):
        validate_stage(load_config(None, [*demo_inputs(DPOConfig), *one], DPOConfig), 2)
    validate_stage(load_config(None, [*demo_inputs(DPOConfig), *one], DPOConfig), 1)  # 2 pairs on one rank
    plain = [*demo_inputs(DPOConfig), *one[1:], "loss.type=dpo"]
    validate_stage(load_config(None, plain, DPOConfig), 2)  # DPO needs no partner


# ----------------------------------------------------------------------------------------------------
# Pairs from groups
# ----------------------------------------------------------------------------------------------------


def test_groups_expand_to_pairs(
    tok: Any, files: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    load = dict(max_prompt_length=32, max_response_length=24)
    with caplog.at_level(logging.INFO, logger="ppo"):
        rest = stage_data.load_dpo_pairs(files["groups"], tok, pairs="best_vs_rest", **load)
    # Per 6 rows: [0,1,2,3] 3 pairs; [2,0,0,3] best = response 1 (first of rank 0) against 0 and 3;
    # [0,0,2,2] response 0 against 2 and 3; [0,0,0,0] none; [3,0,1,2] 1 against 2, 3, 0; [0,1,1,1] 3.
    expected = [
        (0, 1),
        (0, 2),
        (0, 3),
        (1, 0),
        (1, 3),
        (0, 2),
        (0, 3),
        (1, 0),
        (1, 2),
        (1, 3),
        (0, 1),
        (0, 2),
        (0, 3),
    ]
    assert len(rest.pairs) == 26 and (rest.num_groups, rest.num_tied_groups) == (12, 2)
    assert "skipped 2 of 12 groups whose responses all tie" in caplog.text and "rows 3, 9" in caplog.text
    rows = pq.read_table(files["groups"]).to_pylist()
    prompts = data.load_prompts(files["groups"], tok, max_prompt_length=32)
    got = []
    for p in rest.pairs:
        prompt = prompts[p.index].input_ids
        assert p.chosen_ids[: p.prompt_length] == prompt == p.rejected_ids[: p.prompt_length]
        texts = rows[p.index]["responses"]
        best = [j for j, t in enumerate(texts) if prompt + data.encode_response(t, tok) == p.chosen_ids]
        worse = [j for j, t in enumerate(texts) if prompt + data.encode_response(t, tok) == p.rejected_ids]
        got.append((best[0], worse[0]))
        assert p.extra == {
            "chosen_rank": rows[p.index]["ranks"][best[0]],
            "rejected_rank": rows[p.index]["ranks"][worse[0]],
        }
    assert got == expected * 2
    assert [p.index for p in rest.pairs][:13] == [0, 0, 0, 1, 1, 2, 2, 4, 4, 4, 5, 5, 5]
    # best_vs_worst: one pair per untied group, the best against the first of the worst rank
    worst = stage_data.load_dpo_pairs(files["groups"], tok, pairs="best_vs_worst", **load)
    assert len(worst.pairs) == 10 and worst.num_tied_groups == 2
    assert [p.extra["rejected_rank"] for p in worst.pairs[:5]] == [3, 3, 2, 3, 1]
    assert worst.pairs[2].rejected_ids == rest.pairs[5].rejected_ids  # [0,0,2,2]: response 2, not 3
    # Scores only: ranked by them (higher = better), ties included
    scored = write_parquet(
        tmp_path / "scores.parquet",
        [
            arith_row(12, 39, responses=answers(12, 39), scores=[0.5, 1.0, 1.0, 0.0]),
            arith_row(1, 2, responses=answers(1, 2), scores=[1.0] * 4),
        ],
    )
    by_score = stage_data.load_dpo_pairs(scored, tok, pairs="best_vs_rest", **load)
    assert [(p.extra["chosen_rank"], p.extra["rejected_rank"]) for p in by_score.pairs] == [(0, 2), (0, 3)]
    assert by_score.num_tied_groups == 1


def test_preference_files_and_bad_cells(tok: Any, tmp_path: Path) -> None:
    load = dict(pairs="best_vs_rest", max_prompt_length=32, max_response_length=24)
    pref = write_parquet(
        tmp_path / "pref.parquet",
        [
            {"prompt": "1 + 2", "chosen": "3", "rejected": "4"},
            {"prompt": "2 + 2", "chosen": "4", "rejected": "4"},  # identical: skipped by ppo.offline
            {"prompt": "5 + 2", "chosen": "7", "rejected": "8"},
        ],
    )
    loaded = stage_data.load_dpo_pairs(pref, tok, **load)
    assert [p.index for p in loaded.pairs] == [0, 2] and loaded.num_tied_groups == 0
    assert loaded.pairs[0].chosen_ids == data.encode_prompt("1 + 2", tok, apply_chat_template=True, where="")[
        1
    ] + data.encode_response("3", tok)
    bad = write_parquet(
        tmp_path / "bad.parquet",
        [
            arith_row(1, 2, responses=answers(1, 2), ranks=[0, 1, 2, 3]),
            arith_row(1, 3, responses=answers(1, 3), ranks=[0, 0, 1, 2]),
        ],
    )
    with pytest.raises(DataError, match=rf"{bad}: row 1, column 'ranks'.*not competition ranks"):
        stage_data.load_dpo_pairs(bad, tok, **load)
    sizes = write_parquet(
        tmp_path / "sizes.parquet",
        [
            arith_row(1, 2, responses=answers(1, 2), ranks=[0, 1, 2, 3]),
            arith_row(1, 3, responses=answers(1, 3)[:2], ranks=[0, 1]),
        ],
    )
    with pytest.raises(DataError, match=rf"{sizes}: row 1, column 'responses': 2 responses, but row 0 has 4"):
        stage_data.load_dpo_pairs(sizes, tok, **load)
    ties = write_parquet(
        tmp_path / "ties.parquet", [arith_row(1, 2, responses=answers(1, 2), ranks=[0, 0, 0, 0])]
    )
    with pytest.raises(DataError, match="no preference pair .* all 1 groups tie"):
        stage_data.load_dpo_pairs(ties, tok, **load)


# ----------------------------------------------------------------------------------------------------
# The script (one rank, in this process)
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("loss", "expected"), [("dpo", LN2), ("ipo", 25.0), ("kto", 0.5)], ids=["dpo", "ipo", "kto"]
)
def test_first_step_loss_at_initialization(
    tiny_assets: Path, files: dict[str, Path], tmp_path: Path, loss: str, expected: float
) -> None:
    """The policy starts as the reference: the first step's loss is the one at initialization (β = 0.1)."""
    out = tmp_path / loss
    args = dpo_args(
        tiny_assets, files, out, f"loss.type={loss}", "loss.beta=0.1", "trainer.total_training_steps=2"
    )
    assert dpo.main(args) == 0
    first, second = train_rows(out)
    assert first["train/loss"] == pytest.approx(expected, abs=1e-5)
    assert first["train/kl"] == pytest.approx(0.0, abs=1e-5) and first["rewards/margins"] == pytest.approx(
        0.0, abs=1e-6
    )
    assert second["train/loss"] != pytest.approx(expected, abs=1e-5)  # it trained
    if loss == "kto":
        assert first["train/kto_kl"] == pytest.approx(0.0, abs=1e-6)


def test_end_to_end_with_validation_and_final_accuracy(
    tiny_assets: Path, files: dict[str, Path], tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    out = tmp_path / "dpo"
    args = dpo_args(
        tiny_assets,
        files,
        out,
        f"data.val_files=[{files['groups']}]",
        f"data.eval_prompt_files=[{files['eval']}]",
        "loss.nll_coef=0.5",
        "trainer.test_freq=2",
        "trainer.logger=[console,jsonl]",
    )
    assert dpo.main(args) == 0
    err = capfd.readouterr().err
    assert "26 train pairs (best_vs_rest) from 12 groups, 2 tied groups skipped" in err
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows if "val/loss" in r] == [2, 3]
    train = [r for r in rows if "train/loss" in r]
    # the loss with the SFT term: DPO's part + 0.5 · the chosen responses' token-mean NLL
    assert train[0]["train/loss"] == pytest.approx(LN2 + 0.5 * train[0]["train/nll_loss"], abs=1e-5)
    for key in (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "rewards/accuracies",
        "logps/chosen",
        "logps/rejected",
        "train/kl",
        "train/grad_norm",
        "train/lr",
    ):
        assert key in train[-1], key
    last = rows[-2]  # the last step's row; the final evaluation is logged after it
    assert last["rewards/margins"] == pytest.approx(
        last["rewards/chosen"] - last["rewards/rejected"], abs=1e-6
    )
    assert rows[-1]["val/num_prompts"] == 8 and 0.0 <= rows[-1]["val/accuracy"] <= 1.0
    final = json.loads((out / "metrics.json").read_text())  # beside the saved folder (output_dir/hf)
    assert final["dpo_steps"] == 3 and final["dpo_train_tied_groups"] == 2 and final["dpo_eval_prompts"] == 8
    assert final["dpo_val_accuracy"] == round(rows[-1]["val/accuracy"], 4)
    assert final["dpo_val_rewards_accuracy"] == round(rows[-2]["val/rewards/accuracies"], 4)
    assert isinstance(model_loading.load_causal_lm(str(out / "hf")), LlamaForCausalLM)


@pytest.fixture
def count_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every causal LM the script loads (the policy, a reference), by path."""
    loaded: list[str] = []
    real = model_loading.load_causal_lm

    def counting(path: str, *args: Any, **kwargs: Any) -> Any:
        loaded.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(model_loading, "load_causal_lm", counting)
    return loaded


def test_simpo_loads_no_reference(
    tiny_assets: Path,
    files: dict[str, Path],
    tmp_path: Path,
    count_loads: list[str],
    capfd: pytest.CaptureFixture,
) -> None:
    args = dpo_args(
        tiny_assets,
        files,
        tmp_path / "simpo",
        "loss.type=simpo",
        "loss.beta=2.0",
        "loss.gamma=0.5",
        "trainer.total_training_steps=1",
        "trainer.logger=[console,jsonl]",
    )
    assert dpo.main(args) == 0
    assert count_loads == [str(tiny_assets / "base")]  # the policy only
    assert "reference: none (simpo is reference-free)" in capfd.readouterr().err
    (row,) = train_rows(tmp_path / "simpo")
    assert "train/kl" not in row  # no reference, no log-ratio to it
    # SimPO's implicit reward is β = 2 times the mean token log-prob: above 2 · the summed log-prob
    assert 2.0 * row["logps/chosen"] < row["rewards/chosen"] < 0
    count_loads.clear()
    assert dpo.main(dpo_args(tiny_assets, files, tmp_path / "dpo", "trainer.total_training_steps=1")) == 0
    assert count_loads == [str(tiny_assets / "base")] * 2  # policy and reference


def test_lora_reference_is_the_model_with_adapters_off(
    tiny_assets: Path, files: dict[str, Path], tmp_path: Path, count_loads: list[str]
) -> None:
    """Under LoRA no reference is loaded, and the reference log-probs are the base model's: those of a
    full fine-tuning run with the same data order (whose reference is the base model loaded again),
    step after step, while the two policies move apart."""
    beta = 0.1
    lora_out, full_out = tmp_path / "lora", tmp_path / "full"
    assert (
        dpo.main(dpo_args(tiny_assets, files, lora_out, "lora.rank=4", "lora.alpha=8", "optim.lr=1e-2")) == 0
    )
    assert count_loads == [str(tiny_assets / "base")]
    assert dpo.main(dpo_args(tiny_assets, files, full_out)) == 0
    a, b = train_rows(lora_out), train_rows(full_out)
    for key in ("chosen", "rejected"):
        # log π_ref = log π - reward / β
        ref_a = [r[f"logps/{key}"] - r[f"rewards/{key}"] / beta for r in a]
        ref_b = [r[f"logps/{key}"] - r[f"rewards/{key}"] / beta for r in b]
        assert ref_a == pytest.approx(ref_b, abs=1e-4)
    assert a[0]["train/kl"] == pytest.approx(0.0, abs=1e-6)  # B = 0: the adapted model starts as the base
    assert abs(a[-1]["train/kl"]) > 1e-3 and a[-1]["logps/chosen"] != pytest.approx(
        b[-1]["logps/chosen"], abs=1e-3
    )
    # the saved model is the merged one, loadable without peft
    assert isinstance(model_loading.load_causal_lm(str(lora_out / "hf")), LlamaForCausalLM)


def test_stop_and_resume_is_exact(
    tiny_assets: Path, files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run stopped by SIGTERM during its second step (it checkpoints that step and exits) and started
    again with the same command equals a run that never stopped: every logged number and the model."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = ["trainer.total_training_steps=4", "loss.type=kto", "optim.lr_scheduler=cosine"]
    assert dpo.main(dpo_args(tiny_assets, files, straight, *common)) == 0
    # the run installs its own handlers of these signals: put pytest's back afterwards
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    real, calls = dpo.pair_losses, []

    def terminated_in_step_2(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:  # one micro-batch a step: this is step 2's
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(dpo, "pair_losses", terminated_in_step_2)
    try:
        assert dpo.main(dpo_args(tiny_assets, files, resumed, *common)) == 0
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert len(train_rows(resumed)) == 2 and not (resumed / "hf").exists()
    assert (resumed / "checkpoints" / "step_00000002").is_dir()
    monkeypatch.setattr(dpo, "pair_losses", real)
    assert dpo.main(dpo_args(tiny_assets, files, resumed, *common)) == 0
    keep = ("timing_s/", "perf/")
    a, b = (
        [{k: v for k, v in r.items() if not k.startswith(keep)} for r in train_rows(o)]
        for o in (straight, resumed)
    )
    assert len(a) == 4 and a == b
    x, y = load_file(straight / "hf" / "model.safetensors"), load_file(resumed / "hf" / "model.safetensors")
    assert all(torch.equal(x[k], y[k]) for k in x)


# ----------------------------------------------------------------------------------------------------
# Two gloo ranks, and another micro-batch budget, against one rank
# ----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_ranks_and_another_budget_train_the_same_model(
    tiny_assets: Path, files: dict[str, Path], tmp_path: Path
) -> None:
    # The loss is divided by the step's pair count over all ranks, so splitting the same global batch of
    # 4 pairs over 2 ranks, or into micro-batches of a pair or two (a budget of 112 tokens: the longest
    # possible pair, 2 x (32 + 24), the least the config accepts),
    # gives the same gradient: the parameters agree to fp32 rounding. KTO's batch KL is included.
    extra = [
        "trainer.total_training_steps=3",
        "loss.type=kto",
        "loss.nll_coef=0.3",
        "trainer.dist_timeout_s=120",
    ]
    runs = {"one": [], "small": ["data.max_token_len_per_gpu=112"]}
    for name, more in runs.items():
        assert dpo.main(dpo_args(tiny_assets, files, tmp_path / name, *extra, *more)) == 0
    proc = torchrun(
        ROOT / "scripts" / "train_dpo.py",
        *dpo_args(tiny_assets, files, tmp_path / "two", *extra),
        timeout=240,
    )
    assert proc.returncode == 0, excerpt(proc.stderr)
    # any 4 pairs take more than 112 tokens: the small budget cuts every step into micro-batches
    tok = AutoTokenizer.from_pretrained(tiny_assets / "tokenizer")
    pairs = stage_data.load_dpo_pairs(
        files["groups"], tok, pairs="best_vs_rest", max_prompt_length=32, max_response_length=24
    ).pairs
    assert sum(sorted(dpo.pair_length(p) for p in pairs)[:4]) > 112
    start = load_file(tiny_assets / "base" / "model.safetensors")
    a = load_file(tmp_path / "one" / "hf" / "model.safetensors")
    for name in ("small", "two"):
        b = load_file(tmp_path / name / "hf" / "model.safetensors")
        assert a.keys() == b.keys()
        for key in a:
            assert not torch.equal(a[key], start[key]), key
            torch.testing.assert_close(a[key], b[key], atol=2e-5, rtol=1e-4, msg=f"{name}: {key}")
        for key in ("train/loss", "train/grad_norm", "train/kto_kl", "rewards/margins"):
            x, y = ([r[key] for r in train_rows(tmp_path / run)] for run in ("one", name))
            assert x == pytest.approx(y, abs=1e-5, rel=1e-5), f"{name}: {key}"
