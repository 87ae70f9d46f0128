"""The trainer means what verl means: each test here pins a meaning verl gives a key or a metric, and
fails where the trainer once meant something else.

Group advantages on KL-penalized rewards, gradient checkpointing that really recomputes, a sampler built
only from ``rollout.*``, reward-model runs without rule scorers, verl's critic warm-up, learning-rate
schedule, KL coefficient and metric definitions, the on-policy shortcut, and the fused LM head refusing
models whose logits it cannot compute.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.utils import GenerationMixin
from transformers.models.llama.modeling_llama import LlamaMLP

import ppo_kernels.chunked
from ppo import algorithms, batch_advantages, forwards, model_loading, models, rollout
from ppo.batch import Batch, Rollout
from ppo.build import build
from ppo.config_loader import load_config
from ppo.metrics import batch_metrics
from tests.helpers import (
    REWARD_FNS,
    ROOT,
    base_args,
    excerpt,
    load_script,
    run,
    torchrun,
    train,
    write_parquet,
)


def fake_batch(mask: torch.Tensor, prompt_lens: list[int], max_response: int | None = None) -> Batch:
    """A Batch of ``mask.shape[0]`` sequences with the given response masks and prompt lengths."""
    b, r = mask.shape
    out = Rollout(
        prompts=[torch.ones(n, dtype=torch.long) for n in prompt_lens],
        responses=torch.ones(b, r, dtype=torch.long),
        attention_mask=mask.bool(),
        truncated=torch.zeros(b, dtype=torch.bool),
    )
    return Batch(rollout=out, records=[None] * b, group_ids=torch.zeros(b, dtype=torch.long))


# ----------------------------------------------------------------------------------------------------
# Bugs
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_group_advantages_take_the_kl_penalized_rewards(estimator: str) -> None:
    """One group of two: sequence 0 is right (score 1) but drifted from the reference by 0.5 nats per
    token over 4 tokens, sequence 1 is wrong (score 0) and did not drift. Its summed reward is
    1 - beta * 4 * 0.5: with beta = 10 that is -19 < 0, so it must get the negative advantage, as verl's
    ``token_level_rewards.sum(-1)`` gives; the raw scores alone would rank it first."""
    cfg = load_config(
        None,
        [
            f"algorithm.adv_estimator={estimator}",
            "algorithm.use_kl_in_reward=true",
            "algorithm.kl_penalty=kl",
            "rollout.n=2",
        ],
    )
    for beta, sign in ((0.0, 1.0), (10.0, -1.0)):
        batch = fake_batch(torch.ones(2, 4), [3, 3])
        batch.scores = torch.tensor([1.0, 0.0])
        batch.old_logprobs = torch.full((2, 4), -1.0)
        batch.ref_logprobs = torch.tensor([[-1.5] * 4, [-1.0] * 4])
        batch_advantages.compute_advantages(cfg, batch, algorithms.FixedKLController(beta), step=1)
        rewards = batch.token_rewards.sum(-1)
        assert rewards.tolist() == pytest.approx([1.0 - beta * 2.0, 0.0])
        assert math.copysign(1.0, float(batch.advantages[0, 0])) == sign
        assert math.copysign(1.0, float(batch.advantages[1, 0])) == -sign


@pytest.mark.slow
def test_gradient_checkpointing_recomputes_layers_in_a_trainer_run(
    tiny_assets: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """With model.enable_gradient_checkpointing the backward recomputes every decoder layer of every
    update micro-batch: the run calls the layers exactly 3 layers x 2 micro-batches more often than the
    same run without it (transformers checkpoints only models in training mode)."""
    calls = {"n": 0}

    def counting(module: torch.nn.Module, _args: object) -> None:
        if isinstance(module, LlamaMLP):
            calls["n"] += 1

    # A global hook on every module call. transformers checkpoints a layer's forward (its own hooks stay
    # outside), so the recomputation shows in the calls of the layer's MLP, one per layer.
    handle = torch.nn.modules.module.register_module_forward_pre_hook(counting)
    request.addfinalizer(handle.remove)
    counts = {}
    for checkpointing in (False, True):
        calls["n"] = 0
        train(
            tiny_assets,
            tmp_path / str(checkpointing),
            "algorithm.adv_estimator=grpo",  # actor only: no critic, no reference
            "trainer.val_before_train=false",
            f"model.enable_gradient_checkpointing={str(checkpointing).lower()}",
            steps=1,
        )
        counts[checkpointing] = calls["n"]
    # 4 prompts x 2 samples in 2 mini-batches of 4 sequences, one token-budget micro-batch each.
    assert counts[True] - counts[False] == 3 * 2


def model_with_generation_config(src: Path, dst: Path, **fields: object) -> Path:
    shutil.copytree(src, dst)
    GenerationConfig(**fields).save_pretrained(dst)
    return dst


@pytest.mark.slow
def test_rollout_ignores_the_checkpoint_generation_config_and_stops_at_every_eos(
    tiny_assets: Path, tmp_path: Path, one_rank, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint whose generation_config.json sets a repetition penalty, an n-gram block and an extra
    EOS: the sampler applies exactly rollout's temperature and top-k, and stops at the extra EOS."""
    base_cfg = load_config(
        None, base_args(tiny_assets, tmp_path / "plain") + ["trainer.val_before_train=false"]
    )
    plain = build(base_cfg, one_rank)
    records = plain.loader.records[:4]
    greedy = rollout.sample(plain.sampler, records, do_sample=False)
    first = greedy.responses[0][greedy.attention_mask[0]].tolist()
    # An extra EOS: the first token of the greedy answer that is neither its first token nor an EOS.
    position, extra = next((j, t) for j, t in enumerate(first) if j > 0 and t not in (first[0], 2))

    folder = model_with_generation_config(
        tiny_assets / "base",
        tmp_path / "model",
        eos_token_id=[2, extra],
        do_sample=True,
        repetition_penalty=1.5,
        no_repeat_ngram_size=2,
        top_k=3,
    )
    seen: list[list[str]] = []
    original = GenerationMixin._get_logits_processor

    def recording(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        processors = original(self, *args, **kwargs)
        seen.append([type(p).__name__ for p in processors])
        return processors

    monkeypatch.setattr(GenerationMixin, "_get_logits_processor", recording)
    cfg = load_config(
        None,
        base_args(tiny_assets, tmp_path / "run")
        + [
            f"model.path={folder}",
            "trainer.val_before_train=false",
            "rollout.temperature=0.7",
            "rollout.top_k=5",
        ],
    )
    run_ = build(cfg, one_rank)
    assert run_.sampler.eos_ids == [2, extra]
    rollout.sample(run_.sampler, records, do_sample=True)
    assert seen[-1] == ["TemperatureLogitsWarper", "TopKLogitsWarper"]
    stopped = rollout.sample(run_.sampler, records, do_sample=False)
    assert seen[-1] == []  # greedy: no processor at all
    assert int(stopped.attention_mask[0].sum()) == position + 1  # up to and including the extra EOS
    assert int(stopped.responses[0, position]) == extra


@pytest.mark.slow
def test_rollout_logprobs_equal_scoring_logprobs(tiny_assets: Path, tmp_path: Path, one_rank) -> None:
    """What the sampler drew from (left padding, KV cache, temperature) is what scoring computes on the
    packed sequences: softmax(logits / T) of the same tokens, to float rounding."""
    cfg = load_config(None, base_args(tiny_assets, tmp_path) + ["rollout.temperature=0.7"])
    run_ = build(cfg, one_rank)
    records = run_.loader.records[:6]
    # Prompts of different lengths (cut from the front): left padding inside one generation batch.
    prompts = [torch.tensor(r.input_ids[i:]) for i, r in enumerate(records)]
    assert len({p.numel() for p in prompts}) == 6
    config = rollout.generation_config(
        max_new_tokens=cfg.data.max_response_length,
        do_sample=True,
        temperature=0.7,
        eos_token_ids=run_.sampler.eos_ids,
        pad_token_id=run_.tokenizer.pad_token_id,
    )
    ids, attention = rollout.left_pad(prompts, run_.tokenizer.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        out = run_.actor.model.generate(
            input_ids=ids,
            attention_mask=attention,
            generation_config=config,
            output_logits=True,
            return_dict_in_generate=True,
        )
    responses = out.sequences[:, ids.shape[1] :]
    sampled_logprobs = torch.stack(
        [
            torch.log_softmax(step.float() / 0.7, -1).gather(-1, responses[:, j, None])[:, 0]
            for j, step in enumerate(out.logits)
        ],
        dim=1,
    )
    mask, truncated = rollout.attention_mask_from_eos(responses, run_.sampler.eos_ids)
    width = cfg.data.max_response_length
    pad = width - responses.shape[1]
    batch = Batch(
        rollout=Rollout(
            prompts=prompts,
            responses=torch.nn.functional.pad(responses, (0, pad)),
            attention_mask=torch.nn.functional.pad(mask, (0, pad)),
            truncated=truncated,
        ),
        records=records,
        group_ids=torch.arange(len(records)),
    )
    scored = forwards.forward_logprobs(
        cfg, run_.actor.model, batch, cfg.actor.ppo_micro_batch_size_per_gpu, run_.sp
    )
    torch.testing.assert_close(
        scored[:, : responses.shape[1]][mask], sampled_logprobs[mask], atol=2e-5, rtol=0
    )


@pytest.mark.slow
def test_reward_model_run_on_prompt_only_data(tiny_assets: Path, tmp_path: Path) -> None:
    """A TRL-style prompt file (only a ``prompt`` column, no data_source, no ground truth) with a reward
    model: no rule scorer runs, training and validation report the model's score, no accuracy."""
    prompts = [{"prompt": f"{a} + {b} ="} for a in range(10, 30) for b in range(10, 12)]
    data = write_parquet(tmp_path / "prompts.parquet", prompts)
    rows = train(
        tiny_assets,
        tmp_path / "run",
        f"data.train_files={data}",
        f"data.val_files={data}",
        "reward.style=model",
        f"reward.model_path={tiny_assets / 'base_rm'}",
        "reward.custom_function=null",
        "trainer.test_freq=2",
    )
    assert (
        rows[0]["step"] == 0 and "val/default/score" in rows[0] and "val/default/reward/mean@1" not in rows[0]
    )
    assert rows[0]["val-core/default/reward/mean@1"] == rows[0]["val/default/score"]
    assert not any("accuracy" in k for r in rows for k in r)
    assert rows[1]["critic/score/max"] != rows[1]["critic/score/min"]  # model scores vary per response


def test_rule_reward_for_an_unknown_data_source_fails_before_models_load(
    tiny_assets: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = tmp_path / "other.parquet"
    table = pq.read_table(tiny_assets / "data" / "train.parquet")
    pq.write_table(
        table.set_column(
            table.schema.get_field_index("data_source"), "data_source", pa.array(["my/task"] * len(table))
        ),
        data,
    )
    args = base_args(tiny_assets, tmp_path / "run") + [
        f"data.train_files={data}",
        "reward.custom_function=null",
    ]
    assert run(args) == 2
    assert "no rule reward for data_source 'my/task'" in caplog.text
    assert "world size" not in caplog.text  # stopped before the models were built


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("raises", "raised ZeroDivisionError"),
        ("returns_text", "expected a number"),
        ("missing_function", "has no attribute 'missing_function'"),
    ],
)
def test_reward_function_failures_are_one_line(
    tiny_assets: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, function: str, message: str
) -> None:
    args = base_args(tiny_assets, tmp_path / "run") + [f"reward.custom_function={REWARD_FNS}:{function}"]
    assert run(args) == 2
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and message in errors[0].getMessage() and "Traceback" not in caplog.text


# ----------------------------------------------------------------------------------------------------
# verl's meaning of keys and metrics
# ----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_lr_warms_up_from_zero_once_per_training_step(tiny_assets: Path, tmp_path: Path) -> None:
    """verl's schedule: one step per training step whatever the number of mini-batches, warm-up from 0
    (``step / warmup``: the updates of steps 1-3 use 0, 5e-4, 1e-3); ``actor/lr`` is verl 0.9.1's, the
    rate after the step's scheduler step (the next step's). Two mini-batches per step."""
    warmup = ["actor.optim.lr=1e-3", "actor.optim.lr_warmup_steps=2", "algorithm.adv_estimator=grpo"]
    rows = train(tiny_assets, tmp_path, *warmup, "trainer.val_before_train=false", steps=3)
    assert [r["actor/lr"] for r in rows] == pytest.approx([5e-4, 1e-3, 1e-3])


@pytest.mark.slow
def test_kl_coefficient_logged_is_the_one_applied(tiny_assets: Path, tmp_path: Path) -> None:
    """``actor/reward_kl_penalty_coeff`` is the beta of this batch's rewards; the adaptive update that
    follows is ``beta * (1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon)`` with the logged KL."""
    rows = train(
        tiny_assets,
        tmp_path,
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.kl_coef=0.2",
        "algorithm.kl_ctrl.target_kl=0.001",
        "algorithm.kl_ctrl.horizon=40",
        "trainer.val_before_train=false",
        steps=3,
    )
    assert rows[0]["actor/reward_kl_penalty_coeff"] == 0.2
    n = 4 * 2  # prompts x samples per step
    for before, after in zip(rows, rows[1:], strict=False):
        error = min(max(before["actor/reward_kl_penalty"] / 0.001 - 1.0, -0.2), 0.2)
        expected = before["actor/reward_kl_penalty_coeff"] * (1 + error * n / 40)
        assert after["actor/reward_kl_penalty_coeff"] == pytest.approx(expected, rel=1e-9)


@pytest.mark.slow
def test_on_policy_update_uses_its_own_logprobs(tiny_assets: Path, tmp_path: Path) -> None:
    """One epoch, one mini-batch: no old-log-prob forward, the ratio is exactly 1 (no clipping, zero
    ppo_kl), and the KL to the reference comes from the training forward."""
    one_update = ["algorithm.adv_estimator=grpo", "actor.ppo_mini_batch_size=4", "actor.use_kl_loss=true"]
    for row in train(tiny_assets, tmp_path, *one_update, "trainer.val_before_train=false"):
        assert "timing_s/old_log_prob" not in row
        assert row["actor/ppo_kl"] == 0.0 and row["actor/pg_clipfrac"] == 0.0
        assert "actor/ref_kl" in row and row["actor/kl_coef"] == 0.001


def test_metric_definitions_follow_verl() -> None:
    """vf_explained_var = 1 - Var(returns - values) / (Var(returns) + 1e-5) (unbiased) over all valid
    tokens; response_length/clip_ratio counts responses at the length limit (even one ending in EOS);
    prompt_length/* from the prompts; token means weighted by tokens."""
    cfg = load_config(None, ["data.max_response_length=3", "data.max_prompt_length=4"])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    batch = fake_batch(mask, [4, 2])
    batch.rollout.truncated = torch.tensor([False, False])  # both ended with EOS
    batch.scores = torch.tensor([1.0, 0.0])
    batch.token_rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    batch.returns = torch.tensor([[1.0, 2.0, 3.0], [5.0, 0.0, 0.0]])
    batch.values = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    batch.advantages = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    m = batch_metrics(cfg, batch)
    r = torch.tensor([1.0, 2.0, 3.0, 5.0])
    d = torch.tensor([0.0, 1.0, 2.0, 4.0])
    assert m["critic/vf_explained_var"] == pytest.approx(1 - float(d.var()) / (float(r.var()) + 1e-5))
    assert m["critic/advantages/mean"] == pytest.approx(7.0 / 4)  # token-weighted: (1 + 1 + 1 + 4) / 4
    assert m["response_length/clip_ratio"] == 0.5 and m["response_length/mean"] == 2.0
    assert m["prompt_length/clip_ratio"] == 0.5 and m["prompt_length/max"] == 4.0
    assert m["prompt_length/min"] == 2.0 and m["critic/rewards/mean"] == 0.5


@pytest.mark.slow
def test_verl_metric_names(tiny_assets: Path, tmp_path: Path) -> None:
    gae = ["algorithm.adv_estimator=gae", "trainer.test_freq=2", "trainer.critic_warmup=0"]
    last = train(tiny_assets, tmp_path, *gae)[-1]
    for key in (
        "critic/vpred_mean",
        "critic/skipped_updates",
        "prompt_length/mean",
        "prompt_length/clip_ratio",
        "perf/max_memory_allocated_gb",
        "timing_s/testing",
        "val-core/synthetic/arith/reward/mean@1",
    ):
        assert key in last, key
    assert last["timing_s/testing"] > 0 and last["timing_s/step"] > last["timing_s/testing"]


@pytest.mark.slow
def test_critic_counts_its_skipped_updates(tiny_assets: Path, tmp_path: Path) -> None:
    """A reward of 1e30 overflows the critic's squared error: every critic update is skipped and
    counted, as the actor's are."""
    rows = train(
        tiny_assets,
        tmp_path,
        "algorithm.adv_estimator=gae",
        f"reward.custom_function={REWARD_FNS}:huge_score",
        "trainer.val_before_train=false",
        steps=1,
    )
    row = rows[-1]
    assert row["critic/skipped_updates"] == row["critic/num_updates"] == 2.0


@pytest.mark.slow
def test_entropy_gets_no_gradient_without_a_bonus(
    tiny_assets: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With entropy_coeff=0 the entropy is only logged: the kernels' backward receives no entropy
    gradient (and does no work for it); with a bonus it does."""
    seen: list[bool] = []
    original = ppo_kernels.chunked._grad_rows

    def recording(ctx, grad_logprobs, grad_entropy):  # noqa: ANN001, ANN202
        seen.append(grad_entropy is not None)
        return original(ctx, grad_logprobs, grad_entropy)

    monkeypatch.setattr(ppo_kernels.chunked, "_grad_rows", recording)
    for coeff, expected in ((0.0, False), (0.01, True)):
        seen.clear()
        train(
            tiny_assets,
            tmp_path / str(coeff),
            "algorithm.adv_estimator=grpo",
            f"actor.entropy_coeff={coeff}",
            "trainer.val_before_train=false",
            steps=1,
        )
        assert seen and set(seen) == {expected}


def test_fused_lm_head_refuses_logit_softcapping(tiny_assets: Path, tmp_path: Path) -> None:
    model = model_loading.load_causal_lm(str(tiny_assets / "base"))
    models.check_fused_lm_head(model)  # a plain Llama head is fine
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0.*use_fused_kernels=false"):
        models.check_fused_lm_head(model)


def test_bad_model_path_names_model_path(
    tiny_assets: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = tmp_path / "no_model"
    assert run(base_args(tiny_assets, tmp_path / "run") + [f"model.path={missing}"]) == 2
    assert f"model.path='{missing}': no such folder" in caplog.text
    assert "tokenizer_path" not in caplog.text


@pytest.mark.slow
def test_a_fatal_error_is_reported_once_on_two_ranks(tiny_assets: Path, tmp_path: Path) -> None:
    args = base_args(tiny_assets, tmp_path / "run") + [f"data.train_files={tmp_path / 'missing.parquet'}"]
    proc = torchrun(ROOT / "train_ppo.py", *args, "trainer.dist_timeout_s=60", timeout=300)
    assert proc.returncode != 0
    # Once from rank 0 (the start-up check's one line, before torch loads), once as the root cause in
    # torchrun's summary (from the rank's error file); never once per rank.
    logged = [
        line
        for line in proc.stderr.splitlines()
        if line.startswith("error: ") and "missing.parquet: no such data file" in line
    ]
    summary = [
        line for line in proc.stderr.splitlines() if "traceback :" in line and "missing.parquet" in line
    ]
    assert (len(logged), len(summary)) == (1, 1), excerpt(proc.stderr)
    assert 'train_ppo.py", line' not in proc.stderr  # no traceback through the trainer (torchrun has its own)


def test_verl_flops_formula_by_hand() -> None:
    """Qwen2.5-0.5B's shapes: hidden 896, 24 layers, 14 heads (64 dims), 2 KV heads, intermediate 4864,
    vocab 151936. Per layer 3*896*4864 + 896*(2*896 + 2*128) = 14,909,440; dense N = 24 layers of that
    + 2*151936*896 = 630,095,872. Two sequences of 100 and 300 tokens: 6*N*400 + 6*(100^2 + 300^2)*64*14*24."""
    from ppo.metrics import verl_training_flops

    config = load_script("make_shaped_model").model_config("0.5b")  # the benchmarks' Qwen2.5-0.5B shapes
    heads = (config.num_attention_heads, config.num_key_value_heads)
    assert (config.hidden_size, config.num_hidden_layers, *heads) == (896, 24, 14, 2)
    assert (config.intermediate_size, config.vocab_size) == (4864, 151936)
    expected = 6 * 630_095_872 * 400 + 6 * 100_000 * 64 * 14 * 24
    assert verl_training_flops(config, 400.0, 100_000.0) == expected


@pytest.mark.slow
def test_token_sum_is_the_token_mean_times_the_tokens(tiny_assets: Path, tmp_path: Path) -> None:
    """verl's loss_agg_mode=token-sum, in verl's spelling, through the trainer: with one update a step, step
    1 (the same samples in both runs) logs the policy and value losses of token-mean times the step's
    response tokens (8 responses x response_length/mean), the sum over every token of the mini-batch."""
    common = ["algorithm.adv_estimator=gae", "actor.ppo_mini_batch_size=4", "trainer.val_before_train=false"]
    rows = {}
    for mode in ("token-mean", "token-sum"):
        rows[mode] = train(
            tiny_assets,
            tmp_path / mode,
            *common,
            f"actor_rollout_ref.actor.loss_agg_mode={mode}",
            f"critic.loss_agg_mode={mode}",
            steps=1,
        )[0]
    mean, total = rows["token-mean"], rows["token-sum"]
    tokens = 8 * mean["response_length/mean"]
    assert total["response_length/mean"] == mean["response_length/mean"]
    assert total["actor/pg_loss"] == pytest.approx(mean["actor/pg_loss"] * tokens, rel=1e-4)
    assert total["critic/vf_loss"] == pytest.approx(mean["critic/vf_loss"] * tokens, rel=1e-4)
