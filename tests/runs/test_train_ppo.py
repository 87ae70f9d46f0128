"""End to end: the PPO loop on the tiny model, every config flag of the trainer exercised at least once,
determinism with one seed, 2 ranks equal to 1, bad input handled."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import (
    REWARD_FNS,
    ROOT,
    base_args,
    deterministic,
    excerpt,
    hf_weights,
    load_script,
    read_metrics,
    run,
    torchrun,
    train,
    write_parquet,
)

# The keys verl logs and its users look for; timing and perf keys are checked for presence only.
REQUIRED = [
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/pg_clipfrac_lower",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/grad_norm",
    "actor/lr",
    "actor/reward_kl_penalty",
    "actor/reward_kl_penalty_coeff",
    "critic/vf_loss",
    "critic/vf_clipfrac",
    "critic/vf_explained_var",
    "critic/grad_norm",
    "critic/score/mean",
    "critic/score/max",
    "critic/score/min",
    "critic/rewards/mean",
    "critic/advantages/mean",
    "critic/returns/mean",
    "critic/values/mean",
    "response_length/mean",
    "response_length/max",
    "response_length/min",
    "response_length/clip_ratio",
    "timing_s/gen",
    "timing_s/old_log_prob",
    "timing_s/ref",
    "timing_s/values",
    "timing_s/adv",
    "timing_s/update_actor",
    "timing_s/update_critic",
    "timing_s/step",
    "perf/throughput",
    "perf/total_num_tokens",
    "perf/max_memory_gib",
]
# What only a step with an actor update logs: the actor's update statistics (not the KL in the reward).
ACTOR_UPDATE_KEYS = {
    k for k in REQUIRED if k.startswith("actor/") and not k.startswith("actor/reward_kl")
} | {"timing_s/update_actor"}


# GAE, KL in the reward with the adaptive controller after one fixed step, entropy bonus, critic warm-up.
GAE_ARGS = [
    "algorithm.adv_estimator=gae",
    "algorithm.use_kl_in_reward=true",
    "algorithm.kl_penalty=kl",
    "algorithm.kl_ctrl.type=adaptive",
    "algorithm.kl_ctrl.kl_coef=0.05",
    "algorithm.kl_ctrl.target_kl=0.01",
    "algorithm.kl_ctrl.horizon=100",
    "algorithm.kl_ctrl.fixed_warmup_steps=1",
    "algorithm.gamma=0.99",
    "algorithm.lam=0.95",
    "actor.entropy_coeff=0.01",
    "trainer.critic_warmup=2",  # verl's rule: the actor's first update is at step critic_warmup
    "trainer.test_freq=3",
]


@pytest.fixture(scope="module")
def gae_run(tiny_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GAE, KL in the reward with the adaptive controller after one fixed step, entropy bonus, critic
    warm-up, validation, checkpoints, HF export."""
    out = tmp_path_factory.mktemp("gae")
    export = [
        "trainer.save_freq=3",
        "trainer.save_hf_on_end=true",
        "trainer.logger=[console,jsonl,tensorboard]",
    ]
    train(tiny_assets, out, *GAE_ARGS, *export, steps=3)
    return out


@pytest.mark.slow
def test_gae_run_logs_verl_metrics(gae_run: Path) -> None:
    rows = read_metrics(gae_run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # validation before training, then 3 steps
    assert "val/synthetic/arith/accuracy" in rows[0] and "val/score" in rows[0]
    for row in rows[1:]:
        warmup = row["step"] == 1  # the critic warm-up step has no actor update
        missing = [k for k in REQUIRED if k not in row and not (warmup and k in ACTOR_UPDATE_KEYS)]
        assert not missing, f"step {row['step']} lacks {missing}"
        assert all(math.isfinite(v) for v in row.values())
    # Critic warm-up 2: step 1 trains only the critic, the actor starts at step 2 (as verl counts).
    assert "actor/pg_loss" not in rows[1] and "actor/pg_loss" in rows[2]
    assert rows[1]["critic/vf_loss"] > 0
    # The adaptive coefficient stays 0.05 through the fixed warm-up step, then moves.
    assert rows[1]["actor/reward_kl_penalty_coeff"] == pytest.approx(0.05)
    assert rows[3]["actor/reward_kl_penalty_coeff"] != pytest.approx(0.05)
    assert "val/accuracy" in rows[3]
    assert (gae_run / "tensorboard").is_dir() and any((gae_run / "tensorboard").iterdir())
    assert (gae_run / "config.yaml").is_file()
    assert (gae_run / "checkpoints" / "latest").read_text() == "step_00000003"


@pytest.mark.slow
def test_hf_export_loads_with_from_pretrained(gae_run: Path, tiny_assets: Path) -> None:
    """``from_pretrained`` loads the export whole (no weight missing or freshly initialized), and it is
    the trained actor: other weights and other logits than the base model's, the base's tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(gae_run / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    saved, base = hf_weights(gae_run), load_file(tiny_assets / "base" / "model.safetensors")
    assert saved.keys() == base.keys()
    state = model.state_dict()
    assert all(torch.equal(state[k], saved[k]) for k in saved)
    assert any(not torch.equal(saved[k], base[k]) for k in saved), "the export is the base model"
    tok, base_tok = (AutoTokenizer.from_pretrained(p) for p in (gae_run / "hf", tiny_assets / "base"))
    ids = tok("12 + 34", return_tensors="pt").input_ids
    assert ids.tolist() == base_tok("12 + 34", return_tensors="pt").input_ids.tolist()
    base_model = AutoModelForCausalLM.from_pretrained(tiny_assets / "base")
    with torch.no_grad():
        assert not torch.allclose(model(ids).logits, base_model(ids).logits)


@pytest.mark.slow
def test_same_seed_same_metrics(gae_run: Path, tiny_assets: Path, tmp_path: Path) -> None:
    second = train(tiny_assets, tmp_path, *GAE_ARGS, steps=3)
    assert deterministic(read_metrics(gae_run)) == deterministic(second)


@pytest.mark.slow
def test_grpo_kl_loss_ranking_fixed_micro_batches(tiny_assets: Path, tmp_path: Path) -> None:
    """GRPO with low_var_kl as a loss, ranking reward, fixed micro-batches, asymmetric and dual clip,
    several epochs with early stop."""
    rows = train(
        tiny_assets,
        tmp_path,
        "algorithm.adv_estimator=grpo",
        "algorithm.norm_adv_by_std_in_grpo=false",
        "actor.use_kl_loss=true",
        "actor.kl_loss_type=low_var_kl",
        "actor.kl_loss_coef=0.1",
        "reward.style=ranking",
        "reward.ranking_by=rule",
        "actor.use_dynamic_bsz=false",
        "actor.ppo_micro_batch_size_per_gpu=2",
        "actor.clip_ratio_low=0.1",
        "actor.clip_ratio_high=0.3",
        "actor.clip_ratio_c=2.0",
        "actor.ppo_epochs=3",
        "actor.early_stop_kl=1e-9",
        "actor.loss_agg_mode=seq-mean-token-mean",
        "rollout.top_k=20",
        "rollout.top_p=0.9",
        "rollout.temperature=0.8",
        "rollout.micro_batch_size_per_gpu=3",  # generation in micro-batches of 3, 8 sequences
        "ref.fsdp.param_offload=true",
        "trainer.val_before_train=false",
    )
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert "actor/kl_loss" in row and "critic/vf_loss" not in row  # no critic with GRPO
        assert set(
            torch.tensor(0.0).new_tensor([row["critic/score/min"], row["critic/score/max"]]).tolist()
        ) <= {0.0, 1.0}
    # Step 1 is on-policy (ppo_kl 0 on the first mini-batch); by step 2 the second mini-batch has moved
    # the policy, so the tiny early_stop_kl trips and cuts the 3 epochs x 2 mini-batches short.
    assert rows[-1]["actor/early_stopped"] == 1.0
    assert rows[-1]["actor/num_updates"] < 6


@pytest.mark.slow
def test_rloo_reward_model_full_kl_fused_kernels(tiny_assets: Path, tmp_path: Path) -> None:
    """RLOO with a reward model, the exact full-vocabulary KL in the reward, the fused LM-head
    log-prob path, reference kernels and the Dr. GRPO aggregation."""
    rows = train(
        tiny_assets,
        tmp_path,
        "algorithm.adv_estimator=rloo",
        "reward.style=model",
        f"reward.model_path={tiny_assets / 'base_rm'}",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_penalty=full",
        "actor.use_fused_kernels=true",
        "actor.kernel_backend=reference",
        "actor.loss_agg_mode=seq-mean-token-sum-norm",
        "model.enable_gradient_checkpointing=true",
        "actor.fsdp.forward_prefetch=true",
        "trainer.profile_steps=[2]",
        "trainer.val_before_train=false",
    )
    assert len(rows) == 2
    # Step 1 samples from the reference itself: the full KL of equal distributions is 0; after the
    # first update it is not.
    assert rows[0]["actor/reward_kl_penalty"] == pytest.approx(0.0, abs=1e-7)
    assert rows[1]["actor/reward_kl_penalty"] > 1e-6
    for row in rows:
        assert row["critic/score/max"] != row["critic/score/min"]  # model scores vary per response
        # RLOO on pairs: A = r_i - r_j for each, so the batch's largest advantage is minus its smallest.
        assert row["critic/advantages/max"] == pytest.approx(-row["critic/advantages/min"], rel=1e-5)
        assert row["critic/advantages/max"] > 0
    assert any((tmp_path / "profile").iterdir())  # the profiled step's trace


@pytest.mark.slow
def test_nan_reward_skips_the_step(tiny_assets: Path, tmp_path: Path) -> None:
    nan_reward = f"reward.custom_function={REWARD_FNS}:nan_score"
    rows = train(
        tiny_assets, tmp_path, nan_reward, "trainer.val_before_train=false", "trainer.save_hf_on_end=true"
    )
    assert [r["trainer/skipped_steps"] for r in rows] == [1.0, 2.0]
    before, after = load_file(tiny_assets / "base" / "model.safetensors"), hf_weights(tmp_path)
    for key, value in before.items():
        assert torch.equal(value, after[key]), f"{key} changed although every step was skipped"


@pytest.mark.parametrize(
    "case", ["missing_data_file", "missing_model", "bad_row", "batch_split", "unknown_key", "bad_value"]
)
def test_bad_config_and_data_fail_clearly(
    tiny_assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture, case: str
) -> None:
    """Exit code 2 and one error line naming the file, row or key to fix; no traceback."""
    bad_rows = tmp_path / "bad.parquet"
    override, message = {
        "missing_data_file": (
            "data.train_files=/nonexistent/train.parquet",
            "ERROR /nonexistent/train.parquet: no such data file",
        ),
        "missing_model": (
            f"model.path={tmp_path / 'no_model'}",
            f"ERROR model.path='{tmp_path / 'no_model'}': no such folder",
        ),
        "bad_row": (
            f"data.train_files={bad_rows}",
            f"ERROR {bad_rows}: row 3, column 'prompt': empty prompt",
        ),
        # A step batch that does not split over the ranks is refused before any work.
        "batch_split": (
            "actor.ppo_mini_batch_size=3",
            "actor.ppo_mini_batch_size=3 must divide data.train_batch_size=4",
        ),
        "unknown_key": (
            "actor.ppo_mini_batchsize=2",
            "config error: unknown config key 'actor.ppo_mini_batchsize' (from the command line); "
            "did you mean actor.ppo_mini_batch_size",
        ),
        "bad_value": (
            "data.max_response_length=abc",
            "config error: data.max_response_length='abc' (from the command line) is not a valid int",
        ),
    }[case]
    rows = pq.read_table(tiny_assets / "data" / "train.parquet").to_pylist()[:8]
    rows[3]["prompt"] = []  # an empty list of chat messages
    write_parquet(bad_rows, rows)
    assert run(base_args(tiny_assets, tmp_path / "run") + [override]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if " ERROR " in line or line.startswith("config error")]
    assert len(errors) == 1 and message in errors[0], err
    assert "Traceback" not in err


@pytest.mark.slow
def test_two_ranks_equal_one_rank(tiny_assets: Path, tmp_path: Path) -> None:
    """The same global batch on 1 rank, on 2 gloo ranks (1 x 2 sharding), on 2 ranks as 2 x 1 hybrid
    sharding and on 2 ranks with Ulysses sequence parallelism gives the same parameters after 2 steps.

    Greedy rollouts (identical on any rank layout), one mini-batch per step (so shuffling cannot differ)
    and a reward that varies per prompt so GAE has a signal.
    """
    common = [
        "rollout.do_sample=false",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4",
        "trainer.val_before_train=false",
        "trainer.save_hf_on_end=true",
        "data.max_prompt_length=16",
        "actor.ppo_max_token_len_per_gpu=40",  # several micro-batches per rank
        "critic.ppo_max_token_len_per_gpu=40",
        # Adam's first steps move a weight by ~lr * g / (|g| + eps) whatever |g| is, so with the default
        # eps=1e-8 a gradient of 1e-9 that differs in its last bits (the sum order differs between rank
        # layouts) moves the weight by a different fraction of lr. A larger eps keeps the comparison
        # about the gradients, not about rounding noise.
        "actor.optim.eps=1e-3",
        "critic.optim.eps=1e-3",
    ]
    one, two, hybrid, sp = tmp_path / "one", tmp_path / "two", tmp_path / "hybrid", tmp_path / "sp"
    assert run(base_args(tiny_assets, one) + common) == 0
    # 1 x 2 (shard over both ranks), 2 x 1 (hybrid: replicate across 2 groups of 1 rank each), and
    # Ulysses sequence parallelism over both ranks (one data-parallel group whose micro-batches are split
    # along the tokens; greedy rollouts, so the group's batch is the one-rank batch, in the same order).
    hsdp = ["actor.fsdp.fsdp_size=1", "critic.fsdp.fsdp_size=1", "ref.fsdp.fsdp_size=1"]
    for out, extra in ((two, []), (hybrid, hsdp), (sp, ["actor.ulysses_sequence_parallel_size=2"])):
        proc = torchrun(
            ROOT / "train_ppo.py", *base_args(tiny_assets, out), *common, *extra, "trainer.dist_timeout_s=120"
        )
        assert proc.returncode == 0, excerpt(proc.stderr)
    a = hf_weights(one)
    base = load_file(tiny_assets / "base" / "model.safetensors")
    assert any(not torch.equal(a[k], base[k]) for k in a), "the update changed nothing"
    for other in (two, hybrid, sp):
        b = hf_weights(other)
        for key in a:
            torch.testing.assert_close(
                a[key], b[key], atol=1e-6, rtol=1e-5, msg=f"{other.name}: {key} differs"
            )
        for x, y in zip(read_metrics(one), read_metrics(other), strict=True):
            # Token-level statistics are token-weighted over all ranks (not means of the ranks' means).
            for k in (
                "critic/score/mean",
                "actor/pg_loss",
                "critic/vf_loss",
                "response_length/mean",
                "critic/advantages/mean",
                "critic/values/mean",
                "critic/vf_explained_var",
                "actor/entropy",
            ):
                assert x[k] == pytest.approx(y[k], rel=1e-4, abs=1e-4), f"{other.name}: {k}"


@pytest.mark.slow
def test_sequence_parallel_grpo_equals_one_rank(tiny_assets: Path, tmp_path: Path) -> None:
    """GRPO with a KL loss, two mini-batches of several micro-batches: 2 ranks with Ulysses sequence
    parallelism (each micro-batch split along its tokens) train the parameters one rank trains."""
    common = [
        "algorithm.adv_estimator=grpo",
        "actor.use_kl_loss=true",
        "rollout.do_sample=false",
        "trainer.val_before_train=false",
        "trainer.save_hf_on_end=true",
        "data.max_prompt_length=16",
        "actor.shuffle=false",
        "actor.ppo_max_token_len_per_gpu=24",  # several micro-batches, boundaries inside the slices
        "actor.optim.eps=1e-3",
        # Greedy samples of a group are equal (zero advantages): the entropy bonus gives the gradient.
        "actor.entropy_coeff=0.01",
    ]
    one, sp = tmp_path / "one", tmp_path / "sp"
    assert run(base_args(tiny_assets, one) + common + ["actor.ppo_max_token_len_per_gpu=48"]) == 0
    proc = torchrun(
        ROOT / "train_ppo.py",
        *base_args(tiny_assets, sp),
        *common,
        "actor.ulysses_sequence_parallel_size=2",
        "trainer.dist_timeout_s=120",
    )
    assert proc.returncode == 0, excerpt(proc.stderr)
    a, b = hf_weights(one), hf_weights(sp)
    base = load_file(tiny_assets / "base" / "model.safetensors")
    assert any(not torch.equal(a[k], base[k]) for k in a), "the update changed nothing"
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=1e-5, msg=key)
    for x, y in zip(read_metrics(one), read_metrics(sp), strict=True):
        for k in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "critic/advantages/mean"):
            assert x[k] == pytest.approx(y[k], rel=1e-4, abs=1e-5), k


@pytest.mark.slow
def test_plot_run_writes_png(gae_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "curves.png"
    assert load_script("plot_run").main([str(gae_run), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert load_script("plot_run").main([str(tmp_path / "missing")]) == 2


def test_plot_run_draws_several_runs_side_by_side(tmp_path: Path) -> None:
    """Two run folders: one line per run in each panel that either has, --out required, the panel
    count what the runs logged (validation accuracy; tool calls and pass@4 in one of them)."""
    script = load_script("plot_run")
    for name, rows in {
        "tools": [
            {
                "step": 0,
                "val/accuracy": 0.7,
                "val/tool_calls/mean": 0.3,
                "val/best@2": 0.8,
                "val/best@4": 0.9,
            },
            {"step": 1, "val/accuracy": 0.9},
        ],
        "plain": [{"step": 0, "val/accuracy": 0.6}, {"step": 1, "val/accuracy": 0.8}],
    }.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs = {name: script.read_rows(tmp_path / name) for name in ("tools", "plain")}
    assert script.plot(runs, tmp_path / "x.png", "t") == 3  # and pass@n for the largest n only
    out = tmp_path / "both.png"
    assert script.main([str(tmp_path / "tools"), str(tmp_path / "plain"), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert script.main([str(tmp_path / "tools"), str(tmp_path / "plain")]) == 2
