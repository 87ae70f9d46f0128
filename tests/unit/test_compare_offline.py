"""Tests of ``ppo/model_eval.py`` (answer accuracy and the KL to a reference on the policy's own samples)
and of ``scripts/ppo_bench/compare_offline.py`` (inputs, table, frontier, plot) with its runs in
``scripts/ppo_bench/compare_offline_runs.py`` (commands, a failed command).

The KL is checked on policies built by hand whose next-token distribution is the same at every position,
so the sequence KL is a number worked out on paper; the orchestrator's trainings are not run here (the
comparison itself is ``make compare-offline``)::

    pytest tests/unit/test_compare_offline.py                 # about 20 s on 2 cores, the 2-rank checks included
    pytest tests/unit/test_compare_offline.py -m "not slow"
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from ppo_bench import compare_offline as compare
from ppo_bench import compare_offline_runs as compare_runs
from transformers import AutoTokenizer, LlamaForCausalLM

from ppo import data, model_eval, model_loading, rule_scoring
from ppo.distributed import DistInfo
from ppo.rollout import generate, generation_config
from tests.helpers import Checks, assert_check, load_script, tiny_config, worker_results

pytestmark = pytest.mark.usefixtures("one_thread")

LN = math.log
RESPONSE_TOKENS = 8
"""Responses of the hand-built policies: they never sample EOS, so every response has exactly this many."""
P_FIRST = 0.75
"""The policy's probability of the first of its two tokens (the reference's is 1/2)."""
KL_PER_TOKEN = 0.75 * LN(0.75 / 0.5) + 0.25 * LN(0.25 / 0.5)
"""KL(p ‖ q) for p = (3/4, 1/4), q = (1/2, 1/2): ¾ ln 1.5 + ¼ ln 0.5 = 0.304099 − 0.173287 = 0.130812."""
KL_PER_SEQUENCE = RESPONSE_TOKENS * KL_PER_TOKEN
"""Tokens are independent and identically distributed, so the sequence KL is 8 × 0.130812 = 1.046496."""
KL_STD_PER_SEQUENCE = math.sqrt(RESPONSE_TOKENS * 0.75 * 0.25) * LN(3.0)
"""One token's log-ratio is ln 1.5 or ln 0.5 (they differ by ln 3) with probabilities ¾, ¼: variance
¾·¼·(ln 3)² = 0.226303; a sequence's, 8 times that: standard deviation 1.345521."""
NUM_SAMPLES = 64
"""Samples per prompt: 8 prompts × 64 = 512 sequences, a standard error of 1.345521 / √512 = 0.0595."""


# ----------------------------------------------------------------------------------------------------
# Policies built by hand
# ----------------------------------------------------------------------------------------------------


def constant_policy(tok: Any, logits: dict[int, float]) -> LlamaForCausalLM:
    """A one-layer Llama whose next-token distribution is ``softmax(logits)`` at every position, whatever
    the context: the attention and MLP output projections are zero (the layer adds nothing to the
    residual stream), every token embeds to the all-ones vector (RMS-normalized, all ones again), and
    the LM head's first column holds the logits (-30 for every other token: probability ~1e-14, so EOS
    is never sampled)."""
    config = tiny_config(
        vocab_size=len(tok),
        num_hidden_layers=1,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        rms_norm_eps=1e-12,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.fill_(1.0)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = model.lm_head.weight
        head.zero_()
        head[:, 0] = -30.0
        for token, logit in logits.items():
            head[token, 0] = logit
    return model.eval()


@pytest.fixture(scope="module")
def two_tokens(tok: Any) -> tuple[int, int]:
    """The hand-built policies' two tokens: the characters ``7`` and ``3``."""
    return tok.convert_tokens_to_ids("7"), tok.convert_tokens_to_ids("3")


@pytest.fixture(scope="module")
def policies(tok: Any, two_tokens: tuple[int, int]) -> dict[str, LlamaForCausalLM]:
    """``p``: ``7`` with probability 3/4, ``3`` with 1/4; ``q``, the reference: 1/2 each."""
    a, b = two_tokens
    return {
        "p": constant_policy(tok, {a: LN(3.0), b: 0.0}),
        "q": constant_policy(tok, {a: 0.0, b: 0.0}),
    }


@pytest.fixture(scope="module")
def records(tiny_assets: Path, tok: Any) -> list[data.PromptRecord]:
    """The first 8 validation prompts, the first 5 with ground truth ``7``, the last 3 with ``3``
    (for ``first_char_scorer``)."""
    loaded = data.load_prompts(tiny_assets / "data" / "val.parquet", tok, max_prompt_length=64)[:8]
    return [dataclasses.replace(r, ground_truth="7" if i < 5 else "3") for i, r in enumerate(loaded)]


def first_char_scorer(data_source: str, text: str, ground_truth: str, extra_info: dict) -> rule_scoring.Score:
    """1 when the response starts with the ground truth: the hand-built policies' answers are single
    characters repeated, which no ``#### N`` rule would ever score."""
    return rule_scoring.Score(float(text[:1] == ground_truth), {})


ONE_RANK = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


# ----------------------------------------------------------------------------------------------------
# The estimator by hand
# ----------------------------------------------------------------------------------------------------


def test_sequence_log_ratio_by_hand() -> None:
    logprobs = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -0.2, 0.0]])
    ref_logprobs = torch.tensor([[-1.0, -1.0, -1.0], [-0.3, -0.1, -5.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    # row 0: 0.5 + 0 - 1.0 = -0.5 (one sample may be negative); row 1: 0.2 - 0.1 = 0.1, padding ignored
    assert model_eval.sequence_log_ratio(logprobs, ref_logprobs, mask) == pytest.approx([-0.5, 0.1], abs=1e-7)


def test_log_probs_of_the_hand_built_policies_are_exact(
    tok: Any, two_tokens: tuple[int, int], policies: dict[str, LlamaForCausalLM], records: list
) -> None:
    """A response with ``n_7`` sevens and ``n_3`` threes has the log-ratio ``n_7 ln 1.5 + n_3 ln 0.5``."""
    a, b = two_tokens
    torch.manual_seed(0)
    prompts = [torch.tensor(r.input_ids) for r in records] * 4
    config = generation_config(
        max_new_tokens=RESPONSE_TOKENS,
        do_sample=True,
        eos_token_ids=[tok.eos_token_id],
        pad_token_id=tok.pad_token_id,
    )
    rollout = generate(policies["p"], prompts, config)
    assert rollout.attention_mask.all()  # never EOS: 8 tokens each
    assert set(rollout.responses.unique().tolist()) == {a, b}
    ratio = model_eval.sequence_log_ratio(
        model_eval.response_logprobs(policies["p"], rollout),
        model_eval.response_logprobs(policies["q"], rollout),
        rollout.attention_mask,
    )
    sevens = (rollout.responses == a).sum(-1).double()
    expected = sevens * LN(1.5) + (RESPONSE_TOKENS - sevens) * LN(0.5)
    assert torch.allclose(ratio.double(), expected, atol=1e-5)
    # a token budget of one sequence's length: one forward per sequence, the same log-probs
    one_by_one = model_eval.response_logprobs(
        policies["p"], rollout, max_tokens=len(prompts[0]) + RESPONSE_TOKENS
    )
    assert torch.allclose(one_by_one, model_eval.response_logprobs(policies["p"], rollout), atol=1e-6)


def test_answer_metrics_kl_and_accuracy_match_the_hand_values(
    tok: Any, policies: dict[str, LlamaForCausalLM], records: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rule_scoring, "make_rule_scorer", lambda *args: first_char_scorer)
    m = model_eval.answer_metrics(
        policies["p"],
        tok,
        records,
        ONE_RANK,
        max_new_tokens=RESPONSE_TOKENS,
        num_samples=NUM_SAMPLES,
        seed=0,
        ref=policies["q"],
    )
    assert m["val/num_prompts"] == 8 and m["val/response_tokens"] == RESPONSE_TOKENS
    # greedy answers are all sevens: right for the 5 prompts whose truth is 7
    assert m["val/accuracy"] == 5 / 8
    # one sample is right with 3/4 on those 5, 1/4 on the other 3: (5·¾ + 3·¼) / 8 = 0.5625, and the
    # standard error of 512 samples is √(3/16 / 512) = 0.019
    assert m["val/sample_accuracy"] == pytest.approx(0.5625, abs=4 * 0.019)
    assert m["val/pass_at_k"] == 1.0  # 64 samples: all wrong with (3/4)^64 ≈ 1e-8 at most
    stderr = KL_STD_PER_SEQUENCE / math.sqrt(8 * NUM_SAMPLES)
    assert m["val/kl_to_ref"] == pytest.approx(KL_PER_SEQUENCE, abs=4 * stderr)
    assert m["val/kl_to_ref_stderr"] == pytest.approx(stderr, rel=0.15)


def test_a_model_equal_to_its_reference_has_kl_exactly_zero(
    tiny_assets: Path, tok: Any, records: list
) -> None:
    model = model_loading.load_causal_lm(str(tiny_assets / "base"))
    copy = model_loading.load_causal_lm(str(tiny_assets / "base"))
    for ref in (model, copy):  # the same module, and the same weights loaded twice
        m = model_eval.answer_metrics(
            model, tok, records, ONE_RANK, max_new_tokens=12, num_samples=2, seed=0, ref=ref
        )
        assert m["val/kl_to_ref"] == 0.0 and m["val/kl_to_ref_stderr"] == 0.0
    torch.manual_seed(0)
    with torch.no_grad():  # and a reference that differs: the same check now sees a KL
        for p in copy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    m = model_eval.answer_metrics(
        model, tok, records, ONE_RANK, max_new_tokens=12, num_samples=2, seed=0, ref=copy
    )
    assert m["val/kl_to_ref"] > 0.0


def test_greedy_answers_are_plain_generate_ones(
    tiny_assets: Path, tok: Any, records: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the scorer is given: the untrained tiny model's greedy answers, as plain ``generate`` writes
    them; without samples nothing else is reported."""
    seen: list[tuple[str, str]] = []

    def scorer(data_source: str, text: str, ground_truth: str, extra_info: dict) -> rule_scoring.Score:
        seen.append((ground_truth, text))
        return rule_scoring.Score(float(len(seen) % 2), {})  # every other answer right: 4 of 8

    monkeypatch.setattr(rule_scoring, "make_rule_scorer", lambda *args: scorer)
    model = model_loading.load_causal_lm(str(tiny_assets / "base"))
    m = model_eval.answer_metrics(model, tok, records, ONE_RANK, max_new_tokens=10, seed=0)
    assert m == {"val/accuracy": 0.5, "val/num_prompts": 8}
    for r, (truth, text) in zip(records, seen, strict=True):
        ids = torch.tensor([r.input_ids])
        out = model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=tok.pad_token_id)
        assert truth == r.ground_truth
        assert text == tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_kl_needs_samples(tok: Any, policies: dict[str, LlamaForCausalLM], records: list) -> None:
    with pytest.raises(ValueError, match="num_samples"):
        model_eval.answer_metrics(
            policies["p"], tok, records, ONE_RANK, max_new_tokens=4, seed=0, ref=policies["q"]
        )


# ----------------------------------------------------------------------------------------------------
# Two ranks, sharded models
# ----------------------------------------------------------------------------------------------------

DIST_CHECKS = [
    "greedy_accuracy",
    "num_prompts",
    "kl_equal_models",
    "kl_hand_value",
    "sample_accuracy",
    "greedy_accuracy_uneven",
    "uneven_forwards_exact",
]


@pytest.fixture(scope="module")
def two_rank_results(
    tiny_assets: Path, tok: Any, policies: dict[str, LlamaForCausalLM], records: list, tmp_path_factory: Any
) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("evaluation_2ranks")
    for name, model in policies.items():  # saved here: the ranks would race to write
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    (root / "val.parquet").write_bytes((tiny_assets / "data" / "val.parquet").read_bytes())
    out = root / "results.json"
    return worker_results(__file__, root, out, out=out)


@pytest.mark.slow
@pytest.mark.parametrize("check", DIST_CHECKS)
def test_two_ranks(two_rank_results: dict[str, Any], check: str) -> None:
    """The same numbers from FSDP-sharded models on 2 gloo ranks, each rank scoring 4 of the 8 prompts."""
    assert_check(two_rank_results, check)


def _worker(root: Path, out: Path) -> None:
    from ppo.config import FSDPConfig, ModelConfig
    from ppo.distributed import destroy_distributed, init_distributed
    from ppo.model_setup import build_model

    info = init_distributed(device="cpu", timeout_s=60)
    record = Checks(out, info.is_main, agree=True).record
    rule_scoring.make_rule_scorer = lambda *args: first_char_scorer  # this process only
    try:
        tokenizer = AutoTokenizer.from_pretrained(root / "p")
        loaded = data.load_prompts(root / "val.parquet", tokenizer, max_prompt_length=64)[:8]
        recs = [dataclasses.replace(r, ground_truth="7" if i < 5 else "3") for i, r in enumerate(loaded)]
        p, q = (
            build_model(
                model_loading.load_causal_lm,
                ModelConfig(path=str(root / n)),
                FSDPConfig(),
                info,
                trainable=False,
            )
            for n in ("p", "q")
        )
        measure = dict(max_new_tokens=RESPONSE_TOKENS, num_samples=NUM_SAMPLES, seed=0)
        same = model_eval.answer_metrics(p, tokenizer, recs, info, **measure, ref=p)
        record("kl_equal_models", same["val/kl_to_ref"] == 0.0, same)
        m = model_eval.answer_metrics(p, tokenizer, recs, info, **measure, ref=q)
        record("greedy_accuracy", m["val/accuracy"] == 5 / 8, m)
        record("num_prompts", m["val/num_prompts"] == 8, m)
        stderr = KL_STD_PER_SEQUENCE / math.sqrt(8 * NUM_SAMPLES)
        record("kl_hand_value", abs(m["val/kl_to_ref"] - KL_PER_SEQUENCE) < 4 * stderr, m)
        record("sample_accuracy", abs(m["val/sample_accuracy"] - 0.5625) < 4 * 0.019, m)
        # Uneven shares: 7 prompts, 4 on rank 0 and 3 on rank 1 (greedy: 5 of 7 right) ...
        m = model_eval.answer_metrics(p, tokenizer, recs[:7], info, **measure, ref=q)
        record("greedy_accuracy_uneven", m["val/accuracy"] == 5 / 7 and m["val/num_prompts"] == 7, m)
        # ... and one forward per sequence, 3 on rank 0 and 1 on rank 1: rank 1 joins two more forwards
        # with the dummy sequence, and every log-ratio is still n_7 ln 1.5 + n_3 ln 0.5.
        a = tokenizer.convert_tokens_to_ids("7")
        torch.manual_seed(info.rank)
        prompts = [torch.tensor(r.input_ids) for r in recs[: 3 if info.rank == 0 else 1]]
        config = generation_config(
            max_new_tokens=RESPONSE_TOKENS,
            do_sample=True,
            eos_token_ids=[tokenizer.eos_token_id],
            pad_token_id=tokenizer.pad_token_id,
        )
        rollout = generate(p, prompts, config)
        budget = max(len(t) for t in prompts) + RESPONSE_TOKENS
        ratio = model_eval.sequence_log_ratio(
            model_eval.response_logprobs(p, rollout, max_tokens=budget),
            model_eval.response_logprobs(q, rollout, max_tokens=budget),
            rollout.attention_mask,
        )
        sevens = (rollout.responses == a).sum(-1).double()
        expected = sevens * LN(1.5) + (RESPONSE_TOKENS - sevens) * LN(0.5)
        record(
            "uneven_forwards_exact", torch.allclose(ratio.double(), expected, atol=1e-5), (ratio, expected)
        )
    finally:
        destroy_distributed()


# ----------------------------------------------------------------------------------------------------
# The orchestrator: inputs, commands
# ----------------------------------------------------------------------------------------------------


@pytest.fixture
def inputs(tmp_path: Path) -> dict[str, Path]:
    """Stand-ins that pass the checks: an SFT folder with a config.json, two data files."""
    sft = tmp_path / "sft"
    sft.mkdir()
    (sft / "config.json").write_text("{}")
    train, val = tmp_path / "train.parquet", tmp_path / "val.parquet"
    train.write_bytes(b"")
    val.write_bytes(b"")
    return {"sft": sft, "train": train, "val": val, "out": tmp_path / "cmp"}


def cli(inputs: dict[str, Path], *extra: str) -> list[str]:
    return [
        f"--sft={inputs['sft']}",
        f"--train-file={inputs['train']}",
        f"--val-file={inputs['val']}",
        f"--out={inputs['out']}",
        *extra,
    ]


@pytest.mark.parametrize(
    "change, message",
    [
        ("no_sft", "SFT model"),
        ("no_train", "--train-file"),
        ("no_val", "--val-file"),
        ("bad_method", "--methods"),
        ("bad_lr", "--lr"),
        ("earlier", "earlier comparison"),
        ("steps", "--steps"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2_before_training(
    inputs: dict[str, Path], change: str, message: str, capsys: pytest.CaptureFixture
) -> None:
    extra: list[str] = []
    if change == "no_sft":
        (inputs["sft"] / "config.json").unlink()
    elif change == "no_train":
        inputs["train"].unlink()
    elif change == "no_val":
        inputs["val"].unlink()
    elif change == "bad_method":
        extra = ["--methods=ppo,orpo"]
    elif change == "bad_lr":
        extra = ["--methods=dpo", "--lr=ppo=1e-5"]
    elif change == "earlier":
        inputs["out"].mkdir()
        (inputs["out"] / "results.json").write_text("{}")
    elif change == "steps":
        extra = ["--steps=0"]
    assert compare.main(cli(inputs, *extra)) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("compare_offline: error:") and message in lines[0], lines
    assert not (inputs["out"] / "runs").exists() and captured.out == ""  # nothing started
    if change in ("no_sft", "no_train"):
        assert "make assets" in lines[0]


def test_overwrite_accepts_an_earlier_comparison(inputs: dict[str, Path]) -> None:
    inputs["out"].mkdir()
    (inputs["out"] / "table.md").write_text("old")
    compare.check_inputs(compare.parse_args(cli(inputs, "--overwrite")))  # no InputError


def test_methods_lr_and_strengths_options(inputs: dict[str, Path]) -> None:
    args = compare.parse_args(cli(inputs, "--methods=simpo,dpo", "--lr=dpo=2e-5", "--strengths=simpo=1,3,9"))
    dpo, simpo = sorted(compare.resolve_methods(args), key=lambda m: m.name)
    assert (dpo.lr, dpo.strengths) == (2e-5, compare_runs.METHODS["dpo"].strengths)
    assert (simpo.lr, simpo.strengths) == (compare_runs.METHODS["simpo"].lr, (1.0, 3.0, 9.0))


def test_a_failed_command_reports_its_last_lines(tmp_path: Path) -> None:
    cmd = [sys.executable, "-c", "print('\\n'.join(f'line {i}' for i in range(40))); raise SystemExit(3)"]
    with pytest.raises(compare_runs.CommandError) as err:
        compare_runs.run_logged(cmd, tmp_path / "train.log")
    text = str(err.value)
    assert "exit code 3" in text and "line 39" in text and "line 14" not in text  # the last 25 lines


@pytest.mark.parametrize("name", list(compare_runs.METHODS))
def test_training_commands_are_valid_configs(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Each run's command line resolves (every key exists, every value parses) for 2 ranks, with the
    strength, the learning rate, the step count and no validation in it."""
    method = compare_runs.METHODS[name]
    cmd = compare_runs.training_command(
        method,
        method.strengths[1],
        sft=Path("assets/sft"),
        train_file=Path("assets/offline/train.parquet"),
        steps=7,
        nproc=2,
        out_dir=tmp_path / "run",
    )
    script = cmd.index(str(compare_runs.ROOT / method.script))
    assert cmd[:script] == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
    ]
    args = cmd[script + 1 :] + ["--print-config", "--allow-missing-paths", "--world-size", "2"]
    if method.script == "train_ppo.py":
        import train_ppo

        assert train_ppo.main(args) == 0
    else:
        assert load_script("train_dpo").main(args) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)

    def value(dotted: str) -> Any:
        node = resolved
        for part in dotted.split("."):
            node = node[part]
        return node

    assert value("trainer.total_training_steps") == 7 and value("trainer.test_freq") == -1
    assert value(method.strength_key) == method.strengths[1] and value(method.lr_key) == method.lr
    assert value("model.path") == "assets/sft" and value("trainer.output_dir") == str(tmp_path / "run")
    if method.script == "train_ppo.py":
        assert value("trainer.val_before_train") is False and value("trainer.save_hf_on_end") is True
    else:
        assert value("data.eval_prompt_files") == [] and value("loss.type") == name


# ----------------------------------------------------------------------------------------------------
# Table, frontier, plot on made-up numbers
# ----------------------------------------------------------------------------------------------------


FAKE_STRENGTHS = {"dpo": (0.03, 0.1, 0.3), "simpo": (1.0, 2.0, 4.0), "ppo": (0.01, 0.05, 0.2)}


def fake_results(ppo_points: list[tuple[float, float]]) -> dict[str, Any]:
    """SFT at 0.65; DPO and SimPO at fixed (accuracy, KL) points; offline KL-PPO at ``ppo_points``; the
    strengths of ``FAKE_STRENGTHS``, lr 5e-5."""
    points = {
        "dpo": [(0.80, 0.20), (0.88, 0.40), (0.90, 0.80)],
        "simpo": [(0.78, 0.30), (0.86, 0.60), (0.89, 1.00)],
        "ppo": ppo_points,
    }
    runs = []
    for name, pts in points.items():
        m = compare_runs.METHODS[name]
        for strength, (acc, kl) in zip(FAKE_STRENGTHS[name], pts, strict=True):
            runs.append(
                {
                    "id": compare_runs.run_id(m, strength),
                    "method": name,
                    "label": m.label,
                    "strength_name": m.strength_name,
                    "strength": strength,
                    "lr": 5e-5,
                    "steps": 40,
                    "accuracy": acc,
                    "gain": acc - 0.65,
                    "kl": kl,
                    "kl_stderr": 0.02,
                    "train_wall_s": 50.0,
                }
            )
    return {
        "settings": {"steps": 40, "eval_prompts": 500, "eval_samples": 4},
        "sft": {"accuracy": 0.65, "kl": 0.0},
        "runs": runs,
    }


def test_table_rows_and_gain() -> None:
    text = compare.table_markdown(fake_results([(0.85, 0.10), (0.90, 0.30), (0.92, 0.50)]))
    lines = text.splitlines()
    assert lines[0].startswith("| method | strength | lr | steps | accuracy | gain | KL")
    assert lines[2] == "| SFT (reference) | | | 0 | 0.650 | | 0 | |"
    assert "| DPO | β=0.1 | 5e-05 | 40 | 0.880 | +0.230 | 0.400 ± 0.020 | 50 |" in lines
    assert sum(line.startswith("| offline KL-PPO | kl_loss_coef=") for line in lines) == 3


def test_frontier_says_when_offline_ppo_is_on_or_below_the_others() -> None:
    # above: each PPO point beats every other run that has at most its KL
    above = "\n".join(compare.frontier_lines(fake_results([(0.85, 0.10), (0.90, 0.30), (0.92, 0.50)])))
    assert above.count("on or above the others' frontier") == 3 and "below" not in above
    # below: (0.79, 0.25) loses to DPO (0.88, 0.40)? no, that has more KL; to DPO (0.80, 0.20): yes
    below = compare.frontier_lines(fake_results([(0.79, 0.25), (0.90, 0.30), (0.85, 0.90)]))
    text = "\n".join(below)
    assert (
        "kl_loss_coef=0.01 (accuracy 0.790, KL 0.250): below the others' frontier, beaten by 1 run(s), e.g. DPO β=0.03"
        in text
    )
    # (0.85, 0.90) loses to DPO (0.88, 0.40), DPO (0.90, 0.80) and SimPO (0.86, 0.60); the best is DPO β=0.3
    assert "beaten by 3 run(s), e.g. DPO β=0.3" in text
    assert below[0].startswith("- on the frontier") and "offline KL-PPO kl_loss_coef=0.05" in below[0]


def test_plot_is_a_png(tmp_path: Path) -> None:
    path = tmp_path / "frontier.png"
    compare.plot_frontier(fake_results([(0.85, 0.10), (0.90, 0.30), (0.92, 0.50)]), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_results_merge_training_and_evaluation() -> None:
    plan = {
        "sft": "sft",
        "settings": {"steps": 3},
        "runs": [{"id": "dpo_0.1", "method": "dpo", "strength": 0.1}],
    }
    metrics = {
        "val/accuracy": 0.7,
        "val/sample_accuracy": 0.6,
        "val/pass_at_k": 0.9,
        "val/kl_to_ref": 0.5,
        "val/kl_to_ref_stderr": 0.1,
        "val/response_tokens": 20.0,
        "val/num_prompts": 500.0,
        "eval_s": 3.0,
    }
    evals = {"sft": {**metrics, "val/accuracy": 0.6, "val/kl_to_ref": 0.0}, "dpo_0.1": metrics}
    trained = {"dpo_0.1": {"steps": 3, "train_wall_s": 10.0, "loop_s": 4.0}}
    results = compare.collect_results(plan, trained, evals)
    run = results["runs"][0]
    assert run["gain"] == pytest.approx(0.1) and run["kl"] == 0.5 and run["steps"] == 3
    assert results["settings"] == {"steps": 3, "eval_prompts": 500}
    json.dumps(results)  # every number is JSON


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), Path(sys.argv[2]))
