"""PRIME through ``train_ppo.main``: the implicit PRM trains and its metrics are logged, a resumed run
continues exactly, the accuracy filter keeps its share, and 2 ranks train what 1 rank trains."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.helpers import (
    REWARD_FNS,
    ROOT,
    base_args,
    deterministic,
    excerpt,
    hf_weights,
    read_metrics,
    run,
    torchrun,
    train,
    write_parquet,
)
from tests.reward_fns import digit_score

PRIME = [
    "algorithm.adv_estimator=prime",
    "reward.prime.optim.lr=1e-3",
    "reward.prime.beta_train=0.5",
    "trainer.val_before_train=false",
]
PRM_METRICS = (
    "reward_model/dpo_loss",
    "reward_model/grad_norm",
    "rm/lr",
    "reward_model/reward",
    "reward_model/raw_reward",
    "reward_model/dpo_acc_before",
    "reward_model/dpo_acc_abs_before",
    "reward_model/dpo_acc",
    "reward_model/dpo_acc_abs",
)
"""The recipe's names; ``dpo_acc`` and ``dpo_acc_abs`` (of the updated PRM) with ``update=before`` only."""


def prm_weights(ckpt: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The PRM's parameters in checkpoint ``ckpt`` (its ``prm.model`` entries), by parameter name."""
    dcp_to_torch_save(ckpt / "dcp", tmp / "state.pt")
    state = torch.load(tmp / "state.pt", weights_only=False)
    flat: dict[str, torch.Tensor] = {}

    def walk(tree: object, prefix: str) -> None:
        if isinstance(tree, dict):
            for k, v in tree.items():
                walk(v, f"{prefix}{k}.")
        elif isinstance(tree, torch.Tensor):
            flat[prefix[:-1]] = tree

    walk(state, "")
    return {k.removeprefix("prm.model."): v for k, v in flat.items() if k.startswith("prm.model.")}


def test_prime_trains_the_prm_and_logs_it(tiny_assets: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    rows = train(tiny_assets, out, *PRIME, "trainer.save_freq=2", steps=2)
    for key in PRM_METRICS:
        assert all(key in r for r in rows), key
    assert rows[0]["reward_model/num_updates"] == 2.0  # train_batch_size 4 / mini-batch 2
    assert rows[0]["rm/lr"] == 1e-3
    prm = prm_weights(out / "checkpoints" / "step_00000002", tmp_path)
    base = load_file(tiny_assets / "base" / "model.safetensors")
    assert prm, "the checkpoint holds no PRM"
    shared = [k for k in prm if k in base]
    assert shared and any(not torch.equal(prm[k].float(), base[k].float()) for k in shared)
    # The actor trains on the PRIME advantages: whitened over the batch's tokens, so mean 0.
    assert all(abs(r["critic/advantages/mean"]) < 1e-5 for r in rows)


def test_a_resumed_prime_run_continues_exactly(tiny_assets: Path, tmp_path: Path) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    args = [*PRIME, "trainer.save_freq=1", "reward.prime.update=after"]
    whole = train(tiny_assets, straight, *args, steps=3)
    train(tiny_assets, resumed, *args, steps=2)
    part = train(tiny_assets, resumed, *args, "trainer.resume_mode=auto", steps=3)
    assert deterministic(part)[-1] == deterministic(whole)[-1]
    assert part[-1]["step"] == 3


def test_a_skipped_step_leaves_the_prm_untrained(tiny_assets: Path, tmp_path: Path) -> None:
    """Step 1's rewards are NaN: the step is skipped, and its PRM update with it (the PRM trained on the
    broken labels before the check). Saving after the skipped step, before any optimizer has stepped,
    changes nothing either: the checkpoint's optimizer state had ``step`` = 1 there, so every later
    update's bias correction differed from a run that saves later."""
    rows = {}
    for save_freq in (1, 3):
        out = tmp_path / f"save_every_{save_freq}"
        rows[save_freq] = train(
            tiny_assets,
            out,
            *PRIME,
            f"trainer.save_freq={save_freq}",
            f"reward.custom_function={REWARD_FNS}:nan_at_first",
            f"reward.reward_kwargs={{log: {tmp_path / f'calls_{save_freq}.txt'}}}",
            steps=3,
        )
        assert [r["step"] for r in rows[save_freq] if "reward_model/dpo_loss" in r] == [2, 3]
        assert rows[save_freq][0]["trainer/skipped_steps"] == 1
        dcp_to_torch_save(out / "checkpoints" / "step_00000003" / "dcp", tmp_path / "state.pt")
        state = torch.load(tmp_path / "state.pt", weights_only=False)
        for role, updates in (("prm", 4.0), ("actor", 4.0)):  # 2 mini-batches on each of steps 2 and 3
            assert {float(p["step"]) for p in state[f"{role}.optim"]["state"].values()} == {updates}
    assert deterministic(rows[1])[-1] == deterministic(rows[3])[-1]


@pytest.fixture(scope="module")
def groups_file(tiny_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Eight prompts with four fixed responses each, scored by ``digit_score``: the same data on any
    number of ranks (sampling differs per rank)."""
    responses = ["12 + 30 = 42\n#### 42", "#### 7", "4 + 4 = 8\n#### 8", "no idea"]
    rows = pq.read_table(tiny_assets / "data" / "train.parquet").to_pylist()[:8]
    for i, row in enumerate(rows):
        row["responses"] = [responses[(i + j) % 4] for j in range(4)]
        row["scores"] = [digit_score("", t, "") for t in row["responses"]]
    return write_parquet(tmp_path_factory.mktemp("prime") / "groups.parquet", rows)


@pytest.mark.slow
def test_two_ranks_train_what_one_rank_trains(tiny_assets: Path, groups_file: Path, tmp_path: Path) -> None:
    """One mini-batch a step (each rank's mini-batches are chunks of its own rows, so only one is the
    same batch on any layout): the PRM's loss, the batch-wide reward normalization and whitening, and
    the trained actor are those of one rank holding every row."""
    common = base_args(tiny_assets, tmp_path / "unused") + [
        *PRIME,
        f"data.train_files={groups_file}",
        "rollout.source=dataset",
        "reward.style=dataset",
        "rollout.n=4",
        "data.max_prompt_length=16",
        "data.max_response_length=24",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4",
        "trainer.save_hf_on_end=true",
        "actor.optim.eps=1e-3",
        "reward.prime.optim.eps=1e-3",
        "actor.ppo_max_token_len_per_gpu=40",
    ]
    one, two = tmp_path / "one", tmp_path / "two"
    assert run([*common, f"trainer.output_dir={one}"]) == 0
    proc = torchrun(ROOT / "train_ppo.py", *common, f"trainer.output_dir={two}", "trainer.dist_timeout_s=120")
    assert proc.returncode == 0, excerpt(proc.stderr)
    for x, y in zip(read_metrics(one), read_metrics(two), strict=True):
        for key in (*PRM_METRICS, "actor/pg_loss", "critic/advantages/max", "critic/returns/mean"):
            assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-6), (key, x["step"])
    for name, w in hf_weights(two).items():
        torch.testing.assert_close(w, hf_weights(one)[name], atol=1e-6, rtol=1e-5, msg=name)
    assert read_metrics(one)[-1]["reward_model/dpo_loss"] > 0


FILTER_SCORES = """
import json

SCORES = [
    [1, 0, 0, 0],  # 0.25: on the lower bound, passes
    [0, 0, 0, 0],
    [1, 1, 1, 0],  # 0.75: on the upper bound, passes
    [1, 1, 1, 1],
    [0, 0, 0, 0],
    [1, 0, 0, 0],  # passes
    [0, 0, 0, 0],
    [1, 1, 1, 0],  # passes
]


def by_position(data_source, solution_str, ground_truth, extra_info=None, *, log):
    if not solution_str:  # the start-up check's empty response
        return 0.0
    with open(log, "a+") as f:
        f.seek(0)
        k = len(f.read().splitlines())
        f.write("call\\n")
    return float(SCORES[k // 4][k % 4])
"""
"""A reward function that scores the k-th response it is called with (8 groups of 4, in the batch's
order) by ``SCORES``: 4 groups on the bounds [0.25, 0.75], 4 outside them."""


def test_the_accuracy_filter_keeps_a_batch(tiny_assets: Path, tmp_path: Path) -> None:
    """8 prompts sampled, 4 trained on: the 4 groups on the bounds pass (the bounds are inclusive) and
    are the ones kept (passing groups first)."""
    fn = tmp_path / "by_position.py"
    fn.write_text(FILTER_SCORES)
    metrics = train(
        tiny_assets,
        tmp_path / "run",
        *PRIME,
        f"reward.custom_function={fn}:by_position",
        f"reward.reward_kwargs={{log: {tmp_path / 'calls.txt'}}}",
        "rollout.n=4",
        "data.filter_accuracy=true",
        "data.gen_batch_size=8",
        "data.accuracy_lower_bound=0.25",
        "data.accuracy_upper_bound=0.75",
        steps=1,
    )
    # 4 of the 8 groups pass; 12 of the 32 responses are right (before the filter).
    assert metrics[0]["prime/filter_keep_rate"] == 0.5
    assert metrics[0]["prime/acc"] == 12 / 32
    # The step trains on the passing groups: mean score (0.25 + 0.75 + 0.25 + 0.75) / 4 = 0.5 (the
    # failing ones, 0, 1, 0, 0, would give 0.25).
    assert metrics[0]["critic/score/mean"] == 0.5
    assert metrics[0]["reward_model/num_updates"] == 2.0  # 4 prompts in mini-batches of 2


def test_prime_with_lora_trains_the_prms_adapters(tiny_assets: Path, tmp_path: Path) -> None:
    """Under the actor's LoRA the PRM gets adapters too, and the reference is the actor without its
    adapters: the PRM's log-ratio starts at exactly 0 (its adapters' B matrices start at 0)."""
    rows = train(
        tiny_assets,
        tmp_path / "run",
        *PRIME,
        "actor.lora.rank=4",
        "reward.prime.update=after",
        "reward.prime.mini_batch_size=4",
        steps=2,
    )
    assert rows[0]["reward_model/raw_reward"] == 0.0  # one mini-batch: step 1 scores with the untrained PRM
    # update=after: the recipe's accuracies of the training forwards, no second PRM forward
    assert "reward_model/dpo_acc_before" in rows[0] and "reward_model/dpo_acc" not in rows[0]
    assert rows[1]["reward_model/raw_reward"] != 0.0
    assert rows[1]["reward_model/grad_norm"] > 0
