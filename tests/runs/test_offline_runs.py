"""Offline RLHF end to end: ``scripts/make_offline_data.py`` (sampling, ranking, resuming, converting pairs;
its rule is ``tests/reward_fns.py:digit_score``) on a tiny Llama whose weights are set so that it samples
short strings of digits, spaces and ``#`` and ends about one response in seven tokens (so groups fill
quickly and a few responses are empty or never end); the sampler's log-probs carried from the data writer
into the trainer; the trainer with ``rollout.source=dataset``, which reads each step's groups from a file
instead of sampling (everything after step 1 is the online code), on hand-written files of ranked, scored
groups. The loaders and the importance-weight math are in tests/unit/test_offline.py."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaForCausalLM,
)

import train_ppo
from ppo import data, model_loading, offline
from ppo.data import encode_response, load_prompts
from ppo.data_files import DataError
from ppo.offline import (
    load_offline_groups,
)
from tests.helpers import (
    ROOT,
    base_args,
    deterministic,
    excerpt,
    hf_weights,
    load_script,
    read_metrics,
    run,
    torchrun,
    write_parquet,
)
from tests.reward_fns import digit_score

make_offline_data = load_script("make_offline_data")


EOS = 2


@pytest.fixture(scope="module")
def policy(tiny_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama of ``tiny_assets`` set to sample strings of digits, spaces and ``#`` that end about
    one response in seven tokens; with a reward model beside it (``rm/``).

    Its embeddings carry a large constant in dimension 0, so after the final norm that dimension is
    about sqrt(hidden) at every position and the LM head's column 0 sets fixed logits: 0 for the 12
    allowed characters, 0.75 for EOS (p = e^0.75 / (e^0.75 + 12) = 0.15), about -23 for the rest.
    """
    root = tmp_path_factory.mktemp("offline_policy")
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets / "tokenizer")
    model = LlamaForCausalLM.from_pretrained(tiny_assets / "base")
    hidden = model.config.hidden_size
    allowed = tokenizer.convert_tokens_to_ids(list("0123456789 #"))
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 10.0
        head = model.lm_head.weight
        head.zero_()
        head[:, 0] = -2.0
        head[allowed, 0] = 0.0
        head[EOS, 0] = 0.75 / hidden**0.5
    model.save_pretrained(root / "lm")
    tokenizer.save_pretrained(root / "lm")
    torch.manual_seed(1)
    rm = AutoModelForSequenceClassification.from_pretrained(root / "lm", num_labels=1)
    with torch.no_grad():
        rm.score.weight.normal_(0, 1.0)
    rm.save_pretrained(root / "rm")
    tokenizer.save_pretrained(root / "rm")
    return root


@pytest.fixture(scope="module")
def prompts(tiny_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six training prompts of the synthetic task (with an ``ability`` column the output must keep)."""
    rows = pq.read_table(tiny_assets / "data" / "train.parquet").to_pylist()[:6]
    return write_parquet(tmp_path_factory.mktemp("offline_prompts") / "prompts.parquet", rows)


def script_args(policy: Path, prompts: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--model", str(policy / "lm"),
        "--data", str(prompts),
        "--out", str(out),
        "--k", "3",
        "--max-prompt-length", "16",
        "--max-response-length", "16",
        "--shard-size", "2",
        "--micro-batch", "8",
        "--seed", "5",
        "--custom-function", f"{ROOT / 'tests' / 'reward_fns.py'}:digit_score",
        *extra,
    ]  # fmt: skip


def competition(values: list[float]) -> list[int]:
    """Competition ranks by hand: the number of strictly better (higher) values."""
    return [sum(w > v for w in values) for v in values]


@pytest.fixture(scope="module")
def one_rank_groups(policy: Path, prompts: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("one_rank_groups") / "groups.parquet"
    assert (
        make_offline_data.main(script_args(policy, prompts, out, "--metrics", str(out.parent / "m.json")))
        == 0
    )
    return out


def check_groups(out: Path, prompts: Path, tok: Any, k: int = 3) -> list[dict[str, Any]]:
    """The written groups: non-empty ended responses, rule scores, competition ranks, the input's columns;
    they load back whole with the same limits."""
    rows = pq.read_table(out).to_pylist()
    inputs = pq.read_table(prompts).to_pylist()
    by_prompt = {repr(r["prompt"]): r for r in inputs}
    assert len(rows) >= 5  # a prompt drops only when 4 rounds leave it short of 3 usable samples
    for row in rows:
        source = by_prompt[repr(row["prompt"])]
        assert {
            key: row[key] for key in source
        } == source  # every input column kept (ability, extra_info, ...)
        texts = row["responses"]
        assert len(texts) == k and all(t.strip() for t in texts)
        assert all(set(t) <= set("0123456789 #") for t in texts)
        assert row["scores"] == [digit_score("", t, "") for t in texts]
        assert row["ranks"] == competition(row["scores"])
    order = [inputs.index(by_prompt[repr(r["prompt"])]) for r in rows]
    assert order == sorted(order)  # prompt order
    groups = load_offline_groups(out, tok, group_size=k, max_prompt_length=16, max_response_length=16)
    assert len(groups) == len(rows)
    return rows


@pytest.mark.usefixtures("one_thread")
@pytest.mark.slow
def test_script_samples_scores_and_ranks(one_rank_groups: Path, prompts: Path, tok: Any) -> None:
    rows = check_groups(one_rank_groups, prompts, tok)
    final = json.loads((one_rank_groups.parent / "m.json").read_text())
    unequal = sum(len(set(r["scores"])) > 1 for r in rows) / len(rows)
    assert final["offline_unequal_share"] == pytest.approx(unequal) and unequal > 0  # a ranking signal
    mean = sum(sum(r["scores"]) for r in rows) / (3 * len(rows))
    assert final["offline_mean_score"] == pytest.approx(mean)
    assert (final["offline_groups"], final["offline_prompts"], final["offline_group_size"]) == (
        len(rows),
        6,
        3,
    )
    shards = sorted(
        p.name for p in one_rank_groups.with_name(one_rank_groups.name + ".shards").glob("shard_*.parquet")
    )
    assert shards == ["shard_00000.parquet", "shard_00001.parquet", "shard_00002.parquet"]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.slow
def test_script_reads_json_lines_prompts_as_parquet(
    one_rank_groups: Path, policy: Path, prompts: Path, tmp_path: Path
) -> None:
    """The same prompts as JSON lines give the same groups, the input's columns kept."""
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in pq.read_table(prompts).to_pylist()))
    out = tmp_path / "groups.parquet"
    assert make_offline_data.main(script_args(policy, jsonl, out)) == 0
    assert pq.read_table(out).to_pylist() == pq.read_table(one_rank_groups).to_pylist()


@pytest.mark.usefixtures("one_thread")
@pytest.mark.slow
def test_script_is_deterministic_and_resumes_per_shard(
    one_rank_groups: Path, policy: Path, prompts: Path, tmp_path: Path, capfd: Any
) -> None:
    out = tmp_path / "groups.parquet"
    shards = tmp_path / "groups.parquet.shards"
    shutil.copytree(one_rank_groups.with_name(one_rank_groups.name + ".shards"), shards)
    # Shard 1 is gone (the run was killed), shard 0 is marked so its reuse shows in the output.
    (shards / "shard_00001.parquet").unlink()
    marked = pq.read_table(shards / "shard_00000.parquet").to_pylist()
    marked[0]["scores"] = [9.0, 8.0, 7.0]
    write_parquet(shards / "shard_00000.parquet", marked)
    assert make_offline_data.main(script_args(policy, prompts, out)) == 0
    assert "6 prompts in 3 shards of 2 (2 already written)" in capfd.readouterr().err
    resumed, first = pq.read_table(out).to_pylist(), pq.read_table(one_rank_groups).to_pylist()
    assert resumed[0]["scores"] == [9.0, 8.0, 7.0]  # the shard on disk was reused, not resampled
    assert resumed[1:] == first[1:]  # shard 1 resampled exactly as the first run sampled it
    # A finished output is not replaced without --overwrite; shards made with other options never mix in.
    assert make_offline_data.main(script_args(policy, prompts, out, "--temperature", "0.7")) == 2
    assert f"--out {out} already exists" in capfd.readouterr().err
    out.unlink()
    assert make_offline_data.main(script_args(policy, prompts, out, "--temperature", "0.7")) == 2
    err = capfd.readouterr().err
    assert f"{shards} holds shards made with other options (temperature differ)" in err
    assert "Traceback" not in err


@pytest.mark.usefixtures("one_thread")
def test_script_ranks_by_a_reward_model(policy: Path, prompts: Path, tok: Any, tmp_path: Path) -> None:
    out = tmp_path / "rm.parquet"
    args = script_args(policy, prompts, out, "--reward-model", str(policy / "rm"), "--max-prompts", "3")
    args.remove(next(a for a in args if a.endswith("digit_score")))
    args.remove("--custom-function")
    assert make_offline_data.main(args) == 0
    rows = pq.read_table(out).to_pylist()
    assert 2 <= len(rows) <= 3
    rm = model_loading.load_reward_model(str(policy / "rm"))
    records = {tuple(r.input_ids): r for r in load_prompts(prompts, tok, max_prompt_length=16)}
    for row in rows:
        ids = data.encode_prompt(row["prompt"], tok, apply_chat_template=True, where="")[1]
        assert tuple(ids) in records
        with torch.no_grad():  # prompt + response + EOS, scored at its last token
            expected = [rm(input_ids=torch.tensor([ids + encode_response(t, tok)])).logits[0, 0].item()
                        for t in row["responses"]]  # fmt: skip
        torch.testing.assert_close(torch.tensor(row["scores"]), torch.tensor(expected), atol=1e-4, rtol=1e-4)
        assert row["ranks"] == competition(row["scores"])


@pytest.mark.usefixtures("one_thread")
def test_script_drops_prompts_short_of_usable_samples(
    policy: Path, prompts: Path, tmp_path: Path, capfd: Any
) -> None:
    # One round of 3 samples: a prompt keeps its group only if none of the 3 is empty or unended.
    out = tmp_path / "short.parquet"
    assert (
        make_offline_data.main(
            script_args(policy, prompts, out, "--max-rounds", "1", "--metrics", str(tmp_path / "m.json"))
        )
        == 0
    )
    err = capfd.readouterr().err
    dropped = [
        int(m) for m in re.findall(r"groups, (\d+) prompts dropped \(fewer than 3 usable samples\)", err)
    ]
    rows = pq.read_table(out).to_pylist()
    assert len(dropped) == 3 and sum(dropped) == 6 - len(rows) > 0
    assert f"from 6 prompts ({6 - len(rows)} dropped)" in err
    assert json.loads((tmp_path / "m.json").read_text())["offline_groups"] == len(rows)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--k", "1"], "error: --k=1 must be >= 2"),
        (["--top-p", "0"], r"error: --top-p=0.0 must be in \(0, 1\]"),
        (["--shard-size", "0"], "error: --shard-size=0 must be > 0"),
        (["--model", "/nonexistent/model"], "/nonexistent/model"),
        (["--data", "/nonexistent/prompts.parquet"], "/nonexistent/prompts.parquet: no such data file"),
        (
            ["--from-pairs", "x.parquet"],
            "error: --from-pairs converts a preference file; it takes no --model",
        ),
        (["--reward-model", "x"], "error: rank by --reward-model or by the rule"),
    ],
)
def test_script_bad_input_is_one_line_and_exit_2(
    policy: Path, prompts: Path, tmp_path: Path, capfd: Any, extra: list[str], message: str
) -> None:
    assert make_offline_data.main(script_args(policy, prompts, tmp_path / "o.parquet", *extra)) == 2
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert re.search(message, lines[0]), lines[0]


@pytest.mark.usefixtures("one_thread")
def test_script_converts_preference_pairs(tiny_assets: Path, tok: Any, tmp_path: Path, capfd: Any) -> None:
    pairs = pq.read_table(tiny_assets / "data" / "pref_val.parquet").to_pylist()[:5]
    rows = pairs[:2] + [{**pairs[2], "rejected": pairs[2]["chosen"]}] + pairs[3:]
    src = write_parquet(tmp_path / "pairs.parquet", rows)
    out = tmp_path / "groups.parquet"
    assert make_offline_data.main(["--from-pairs", str(src), "--out", str(out)]) == 0
    err = capfd.readouterr().err
    assert "skipped 1 of 5 rows" in err and "(rows 2)" in err and f"wrote {out}: 4 groups of 2" in err
    written = pq.read_table(out).to_pylist()
    kept = [r for i, r in enumerate(rows) if i != 2]
    assert [w["responses"] for w in written] == [[r["chosen"], r["rejected"]] for r in kept]
    assert all(w["ranks"] == [0, 1] for w in written)
    assert [w["mistake"] for w in written] == [r["mistake"] for r in kept] and "chosen" not in written[0]
    # The converted file loads as the same groups as the preference file itself.
    load = dict(group_size=2, max_prompt_length=16, max_response_length=32, require_ground_truth=False)
    direct, converted = load_offline_groups(src, tok, **load), load_offline_groups(out, tok, **load)
    assert [g.responses for g in direct] == [g.responses for g in converted]
    assert [g.record.input_ids for g in direct] == [g.record.input_ids for g in converted]
    assert make_offline_data.main(["--from-pairs", str(tmp_path / "none.parquet"), "--out", str(out)]) == 2


@pytest.mark.usefixtures("one_thread")
@pytest.mark.slow
def test_script_on_two_ranks(policy: Path, prompts: Path, tok: Any, tmp_path: Path) -> None:
    out = tmp_path / "two.parquet"
    proc = torchrun(
        ROOT / "scripts" / "make_offline_data.py", *script_args(policy, prompts, out), timeout=240
    )
    assert proc.returncode == 0, excerpt(proc.stderr)
    check_groups(out, prompts, tok)
    assert (
        "shard 3/3" in proc.stderr
        and "6 prompts in 3 shards of 2 (0 already written) on 2 ranks" in proc.stderr
    )


@pytest.fixture(scope="module")
def sampled_groups(tiny_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Groups of 2 responses (two worked answers of each of 8 training prompts) with the ``logprobs``
    that scripts/make_offline_data.py computes for them under the tiny base model."""
    from ppo import data

    script = load_script("make_offline_data")
    tokenizer = model_loading.load_tokenizer(str(tiny_assets / "base"))
    prompt_rows = pq.read_table(tiny_assets / "data" / "train.parquet").to_pylist()[:8]
    path = tmp_path_factory.mktemp("sampled") / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist(prompt_rows), path)
    records = data.load_prompts(path, tokenizer, max_prompt_length=16, require_ground_truth=True)
    kept = [(r, [f"#### {r.ground_truth}", f"{r.ground_truth}1"]) for r in records]
    logprobs = script.sampler_logprobs(
        model_loading.load_causal_lm(str(tiny_assets / "base")), kept, tokenizer, 1.0, 5
    )
    rows = [
        {**row, "responses": texts, "ranks": [0, 1], "logprobs": logprobs[2 * g : 2 * g + 2]}
        for g, (row, (_, texts)) in enumerate(zip(prompt_rows, kept, strict=True))
    ]
    out = path.with_name("groups.parquet")
    pq.write_table(pa.Table.from_pylist(rows), out)
    return out


def test_writer_stores_the_trainers_log_probs(sampled_groups: Path, tiny_assets: Path) -> None:
    """Each response's ``logprobs`` are the log-probs the trainer computes for the same tokens with the
    same policy (so the importance ratio of the sampler against itself is exactly 1)."""
    from ppo import packed_forward
    from ppo.packing import pack

    tokenizer = model_loading.load_tokenizer(str(tiny_assets / "base"))
    groups = offline.load_offline_groups(
        sampled_groups, tokenizer, group_size=2, max_prompt_length=16, max_response_length=12,
        require_ground_truth=False,
    )  # fmt: skip
    assert groups and all(g.logprobs is not None for g in groups)
    rollout = offline.offline_rollout(
        groups, max_response_length=12, pad_token_id=tokenizer.pad_token_id, eos_token_ids=[2], device="cpu"
    )
    model = model_loading.load_causal_lm(str(tiny_assets / "base"))
    with torch.no_grad():
        lp, _ = packed_forward.logprobs(
            model, pack(rollout.prompts, rollout.responses, rollout.attention_mask), temperature=1.0
        )
    stored = offline.dataset_logprobs(groups, len(rollout.prompts), 12, "cpu")
    mask = rollout.attention_mask
    assert torch.equal(torch.isnan(stored), ~mask)  # known exactly on the response tokens
    assert (stored[mask] - lp[mask]).abs().max() < 1e-5


def test_bad_logprobs_cell_names_the_row(sampled_groups: Path, tiny_assets: Path, tmp_path: Path) -> None:
    rows = pq.read_table(sampled_groups).to_pylist()
    tokenizer = model_loading.load_tokenizer(str(tiny_assets / "base"))
    cases = {
        "short": (lambda lps: [lps[0][:-1], lps[1]], r"row 1, column 'logprobs': response 0 has \d+ tokens .* but \d+ log-probs"),
        "positive": (lambda lps: [[0.5] * len(lps[0]), lps[1]], "row 1, column 'logprobs': response 0's log-probs must be finite numbers <= 0"),
        "one_list": (lambda lps: [lps[0]], "row 1, column 'logprobs': expected a list of 2 lists"),
    }  # fmt: skip
    for name, (change, message) in cases.items():
        bad = [dict(r) for r in rows]
        bad[1]["logprobs"] = change(bad[1]["logprobs"])
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(bad), path)
        with pytest.raises(DataError, match=message):
            offline.load_offline_groups(
                path, tokenizer, group_size=2, max_prompt_length=16, max_response_length=12,
                require_ground_truth=False,
            )  # fmt: skip


def weighted_args(assets: Path, groups: Path, out: Path, *extra: str, steps: int = 2) -> list[str]:
    """GRPO with a KL loss on ``groups`` (2 prompts x 2 responses a step), importance weights on."""
    return base_args(assets, out, steps=steps) + [
        f"data.train_files={groups}",
        "data.max_prompt_length=16",
        "data.train_batch_size=2",
        "actor.ppo_mini_batch_size=2",
        "algorithm.adv_estimator=grpo",
        "actor.use_kl_loss=true",
        "trainer.val_before_train=false",
        "rollout.source=dataset",
        "reward.style=ranking",
        "algorithm.rollout_is_threshold=2.0",
        "algorithm.rollout_is=true",
        *extra,
    ]


@pytest.mark.slow
def test_weights_are_one_while_the_policy_is_the_sampler(
    sampled_groups: Path, tiny_assets: Path, tmp_path: Path
) -> None:
    """Step 1 updates from the policy that wrote the data's log-probs: every importance ratio is 1 and
    the mismatch KL 0 (to float rounding), so the weights change nothing; step 2 starts from an updated
    policy, and the weights move away from 1."""
    assert run(weighted_args(tiny_assets, sampled_groups, tmp_path / "run")) == 0
    first, second = read_metrics(tmp_path / "run")
    assert first["mismatch/rollout_is_mean"] == pytest.approx(1.0, abs=1e-5)
    assert first["mismatch/rollout_is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert abs(first["mismatch/mismatch_kl"]) < 1e-5 and abs(first["mismatch/mismatch_k3_kl"]) < 1e-6
    assert abs(second["mismatch/mismatch_kl"]) > 1e-4  # lr 1e-3 moved the policy in step 1


def test_importance_weights_need_the_datas_logprobs(tiny_assets: Path, tmp_path: Path, capfd: Any) -> None:
    rows = pq.read_table(tiny_assets / "data" / "train.parquet").to_pylist()[:4]
    for row in rows:
        row["responses"], row["ranks"] = ["#### 1", "#### 2"], [0, 1]
    groups = write_parquet(tmp_path / "no_logprobs.parquet", rows)
    assert run(weighted_args(tiny_assets, groups, tmp_path / "run")) == 2
    err = capfd.readouterr().err
    assert "no group of data.train_files has a 'logprobs' column" in err and "Traceback" not in err


@pytest.mark.slow
def test_two_ranks_of_one_prompt_mix_half_and_half(
    sampled_groups: Path, tiny_assets: Path, tmp_path: Path
) -> None:
    """One prompt per rank with rollout.offline_fraction=0.5: rank 0's group comes from the file and rank
    1 samples its own, every step (before, each rank rounded 0.5 of its one group up: nothing sampled)."""
    args = base_args(tiny_assets, tmp_path / "run", steps=2) + [
        f"data.train_files={sampled_groups}",
        "data.max_prompt_length=16",
        "data.train_batch_size=2",
        "actor.ppo_mini_batch_size=2",
        "algorithm.adv_estimator=grpo",
        "trainer.val_before_train=false",
        "rollout.offline_fraction=0.5",
        "trainer.dist_timeout_s=120",
    ]
    proc = torchrun(ROOT / "train_ppo.py", *args)
    assert proc.returncode == 0, excerpt(proc.stderr)
    assert [r["rollout/offline_fraction"] for r in read_metrics(tmp_path / "run")] == [0.5, 0.5]


RESPONSES = ["12 + 30 = 42\n#### 42", "#### 7", "4 + 4 = 8\n#### 8", "no idea"]


@pytest.fixture(scope="module")
def groups_file(tiny_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Eight prompts with two of ``RESPONSES`` each, scored by ``digit_score`` and ranked by the scores."""
    rows = pq.read_table(tiny_assets / "data" / "train.parquet").to_pylist()[:8]
    for i, row in enumerate(rows):
        pair = [RESPONSES[i % 4], RESPONSES[(i + 1) % 4]]
        scores = [digit_score("", t, "") for t in pair]
        row["responses"] = pair
        row["scores"] = scores
        row["ranks"] = [sum(o > s for o in scores) for s in scores]
    return write_parquet(tmp_path_factory.mktemp("offline") / "groups.parquet", rows)


def offline_args(tiny_assets: Path, groups: Path, out: Path, steps: int = 2) -> list[str]:
    """GRPO with a KL loss on the groups of ``groups``, one prompt a mini-batch, 2 prompts a step."""
    return base_args(tiny_assets, out, steps=steps) + [
        f"data.train_files={groups}",
        "data.max_response_length=24",
        "data.train_batch_size=2",
        "actor.ppo_mini_batch_size=1",
        "algorithm.adv_estimator=grpo",
        "actor.use_kl_loss=true",
        "trainer.val_before_train=false",
        "trainer.save_hf_on_end=true",
        "rollout.source=dataset",
    ]


@pytest.mark.slow
def test_offline_is_the_online_step_fed_the_same_responses(
    tiny_assets: Path, groups_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same two steps, once reading the groups and once "sampling" them (a sampler that returns the
    file's responses for the prompts it is given): identical parameters, bit for bit, and no
    generation time offline."""
    out_offline, out_online = tmp_path / "offline", tmp_path / "online"
    args = offline_args(tiny_assets, groups_file, out_offline)
    assert run(args) == 0
    tokenizer = model_loading.load_tokenizer(str(tiny_assets / "base"))
    groups = offline.load_offline_groups(
        groups_file, tokenizer, group_size=2, max_prompt_length=64, max_response_length=24
    )
    by_row = {g.index: g for g in groups}

    def sample_from_file(sampler, records, *, do_sample, **_):  # noqa: ANN001, ANN202
        chosen = [by_row[r.index] for r in records[:: sampler.settings.n]]
        return offline.offline_rollout(
            chosen,
            max_response_length=sampler.max_response_length,
            pad_token_id=sampler.pad_token_id,
            eos_token_ids=sampler.eos_ids,
            device="cpu",
        )

    monkeypatch.setattr(train_ppo, "sample", sample_from_file)
    online = [
        a for a in offline_args(tiny_assets, groups_file, out_online) if not a.startswith("rollout.source")
    ]
    assert run(online) == 0
    a, b = hf_weights(out_offline), hf_weights(out_online)
    base = load_file(tiny_assets / "base" / "model.safetensors")
    assert any(not torch.equal(a[k], base[k]) for k in a), "the update changed nothing"
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = read_metrics(out_offline)
    assert all(r["timing_s/gen"] == 0.0 for r in rows)
    assert [r["critic/score/mean"] for r in rows] == [
        r["critic/score/mean"] for r in read_metrics(out_online)
    ]


# Four prompts, the four RESPONSES each (rotated), with scores chosen by hand and their competition ranks.
RANKED_SCORES = [
    [1.0, 0.5, 0.5, 0.0],
    [0.25, 0.25, 0.25, 0.75],
    [0.0, 2.0, 0.0, -1.0],
    [0.75, 0.75, 0.25, -0.5],
]


RANKS = [[0, 1, 1, 3], [1, 1, 1, 0], [1, 0, 1, 3], [0, 0, 2, 3]]


@pytest.fixture(scope="module")
def ranked_groups_file(tiny_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``RANKED_SCORES`` and ``RANKS`` as groups of four responses to the first four training prompts."""
    rows = pq.read_table(tiny_assets / "data" / "train.parquet").to_pylist()[:4]
    for i, row in enumerate(rows):
        row.update(responses=RESPONSES[i:] + RESPONSES[:i], scores=RANKED_SCORES[i], ranks=RANKS[i])
    return write_parquet(tmp_path_factory.mktemp("ranked") / "groups.parquet", rows)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("style", "expected"),
    [
        # best: 1 for rank 0. Step 1 (rows 0, 1): [1, 0, 0, 0] + [0, 0, 0, 1] -> mean 2/8; step 2
        # (rows 2, 3): [0, 1, 0, 0] + [1, 1, 0, 0] -> 3/8.
        (["reward.style=ranking", "reward.rank_scores=best"], [(2 / 8, 1.0, 0.0), (3 / 8, 1.0, 0.0)]),
        # linear: 1 - rank / 3. Step 1: [1, 2/3, 2/3, 0] + [2/3, 2/3, 2/3, 1] = 7/3 + 3 -> mean 2/3;
        # step 2: [2/3, 1, 2/3, 0] + [1, 1, 1/3, 0] = 7/3 + 7/3 -> mean 7/12.
        (["reward.style=ranking", "reward.rank_scores=linear"], [(2 / 3, 1.0, 0.0), (7 / 12, 1.0, 0.0)]),
        # dataset: the scores themselves. Step 1: (2 + 1.5) / 8; step 2: (1 + 1.25) / 8, max 2, min -1.
        (["reward.style=dataset"], [(3.5 / 8, 1.0, 0.0), (2.25 / 8, 2.0, -1.0)]),
    ],
    ids=["ranking_best", "ranking_linear", "dataset"],
)
def test_offline_rewards_from_the_data(
    tiny_assets: Path,
    ranked_groups_file: Path,
    tmp_path: Path,
    style: list[str],
    expected: list[tuple[float, float, float]],
) -> None:
    """The scores each step trains on are the data's (ranks turned into scores by ``rank_scores``, or
    the scores column), for the step's own groups: file order, two groups a step."""
    args = offline_args(tiny_assets, ranked_groups_file, tmp_path, steps=2) + [
        "rollout.n=4",
        "data.shuffle=false",
        "reward.custom_function=null",  # no rule scorer to fall back on: the scores are the file's
        *style,
    ]
    assert run(args) == 0
    got = [
        (r["critic/score/mean"], r["critic/score/max"], r["critic/score/min"]) for r in read_metrics(tmp_path)
    ]
    for step, (row, want) in enumerate(zip(got, expected, strict=True), 1):
        assert row == pytest.approx(want, rel=1e-6), f"step {step}"


@pytest.mark.slow
def test_offline_resume_mid_epoch_is_exact(tiny_assets: Path, groups_file: Path, tmp_path: Path) -> None:
    """Four steps per pass over the file: stopping after step 2 and resuming gives step 3 exactly."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run(offline_args(tiny_assets, groups_file, straight, steps=3)) == 0
    assert run(offline_args(tiny_assets, groups_file, resumed, steps=2) + ["trainer.save_freq=2"]) == 0
    assert run(offline_args(tiny_assets, groups_file, resumed, steps=3) + ["trainer.save_freq=2"]) == 0
    drop = ("timing_s/", "perf/")
    assert deterministic(read_metrics(straight), drop) == deterministic(read_metrics(resumed), drop)


@pytest.mark.slow
def test_offline_two_ranks_equal_one_rank(tiny_assets: Path, groups_file: Path, tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    common = ["actor.optim.eps=1e-3", "actor.ppo_mini_batch_size=2"]
    assert run(offline_args(tiny_assets, groups_file, one) + common) == 0
    proc = torchrun(ROOT / "train_ppo.py", *offline_args(tiny_assets, groups_file, two), *common)
    assert proc.returncode == 0, excerpt(proc.stderr)
    a, b = hf_weights(one), hf_weights(two)
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=1e-5, msg=key)
