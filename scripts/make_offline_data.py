"""Write offline RLHF groups: sample k responses per prompt, rank them by a rule or a reward model.

    torchrun --nproc_per_node=2 scripts/make_offline_data.py --model assets/sft \\
        --data assets/data/train.parquet --out assets/offline/train.parquet --k 4 [--reward-model assets/rm]
    python scripts/make_offline_data.py --from-pairs prefs.parquet --out groups.parquet

Output: the prompt rows of ``--data`` (every column kept) plus ``responses`` (k strings),
``scores`` (the rule's, or the reward model's, per response), ``ranks`` (their competition ranks
within the group: 0 = best, ties share the better rank) and ``logprobs`` (per response, the sampling
policy's log-prob of each of its tokens as the trainer tokenizes it, EOS included, at ``--temperature``:
what the trainer's importance weights and data-policy metrics compare with), the layout ``ppo.offline``
loads for ``rollout.source=dataset``. Prompts longer than ``--max-prompt-length`` tokens are dropped
and counted.

Sampling is the trainer's (``ppo.rollout.generate``, softmax at ``--temperature``, top-p), from the
model sharded over the ranks, each rank sampling its contiguous share of a shard's prompts. A group
holds k non-empty responses that ended with an EOS within ``--max-response-length`` tokens (repeats
are kept, as on-policy groups have them): a sample that is empty or never ended is replaced by a new
one (up to ``--max-rounds`` rounds), and a prompt still short of k is dropped and counted.

Resumable per shard: shard ``i`` (``--shard-size`` prompts, in prompt order) is written atomically to
``<out>.shards/shard_<i>.parquet``; a restart with the same options skips the shards that exist (other
options are refused: delete the folder). At the end rank 0 concatenates the shards into ``--out``.
Deterministic given ``--seed`` and the number of ranks (each shard's sampling is seeded by seed, shard
and rank).

``--from-pairs`` converts a preference file (``prompt``, ``chosen``, ``rejected``, the layout of
``scripts/train_reward_model.py``) into groups of two (chosen rank 0, rejected rank 1) without a
model; rows with an empty or identical pair are skipped and counted. (``ppo.offline`` also reads a
preference file directly.)

Bad input (a missing model or data file, k < 2, ...) ends with one line and exit code 2; an ``--out`` not
named ``.parquet`` (the only format the trainer reads groups from) is refused before any work.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from transformers import PreTrainedTokenizerBase

from ppo import (
    data,
    data_files,
    model_loading,
    offline,
    packed_forward,
    rewards,
    rule_scoring,
    runner,
    sharding,
)
from ppo.config import FSDPConfig, ModelConfig
from ppo.distributed import (
    DistInfo,
    agree_on_failure,
    all_gather_object,
    all_reduce_scalar,
    barrier,
    broadcast_object,
    destroy_distributed,
    exit_process,
    init_distributed,
    main_rank_logs,
    rank_slice,
    setup_logging,
)
from ppo.model_setup import build_model
from ppo.packing import DUMMY_SEQUENCE, pack, plan_eval_micro_batches
from ppo.rollout import generate, generation_config

logger = logging.getLogger("ppo")

GROUP_COLUMNS = ("responses", "scores", "ranks", "logprobs")
"""The columns a sampled group adds to its prompt row."""

META_FILE = "meta.json"
"""The options a shard folder was made with; a resume must match them."""


class UsageError(ValueError):
    """A bad command-line value; the message says which and why."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="the Parquet file to write (.parquet)")
    parser.add_argument("--from-pairs", type=Path, help="convert this preference file (no model needed)")
    parser.add_argument("--model", help="policy folder (save_pretrained) to sample from")
    parser.add_argument(
        "--data",
        type=Path,
        nargs="+",
        help="prompt files in verl's layout (Parquet, JSON lines, JSON or a saved dataset)",
    )
    parser.add_argument("--prompt-key", default="prompt", help="column of the prompts (default: prompt)")
    parser.add_argument("--k", type=int, default=4, help="responses per prompt, >= 2 (rollout.n)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (1: off)")
    parser.add_argument("--max-prompt-length", type=int, default=1024, help="longer prompts are dropped")
    parser.add_argument(
        "--max-response-length", type=int, default=512, help="tokens per response, EOS included"
    )
    parser.add_argument("--micro-batch", type=int, default=64, help="sequences per generate/forward call")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (with the shard and rank)")
    parser.add_argument("--shard-size", type=int, default=256, help="prompts per resumable shard")
    parser.add_argument("--max-prompts", type=int, default=0, help="use the first N prompts (0: all)")
    parser.add_argument("--max-rounds", type=int, default=4, help="rounds to replace unusable samples")
    parser.add_argument("--reward-model", help="rank by this reward model folder instead of the rule")
    parser.add_argument("--custom-function", help="rule scorer module:function or file.py:function")
    parser.add_argument(
        "--format-score", type=float, default=0.0, help="built-in rule: well-formed but wrong"
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument(
        "--metrics", type=Path, help="merge the final numbers (offline_*) into this JSON file"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """UsageError for a missing or out-of-range option, and for an ``--out`` that would replace a file:
    an input (never) or an earlier output (only with ``--overwrite``)."""
    check_out(args)
    if args.from_pairs is not None:
        if args.model or args.data or args.reward_model:
            raise UsageError(
                "--from-pairs converts a preference file; it takes no --model, --data or --reward-model"
            )
        return
    if not args.model or not args.data:
        raise UsageError(
            "give --model and --data (prompt files) to sample from, or --from-pairs PREFS.parquet"
        )
    if args.reward_model and args.custom_function:
        raise UsageError("rank by --reward-model or by the rule (--custom-function), not both")
    checks = [
        ("--k", args.k >= 2, "must be >= 2 (a group needs responses to rank)"),
        ("--temperature", args.temperature > 0, "must be > 0"),
        ("--top-p", 0 < args.top_p <= 1, "must be in (0, 1]"),
        ("--max-prompt-length", args.max_prompt_length > 0, "must be > 0"),
        ("--max-response-length", args.max_response_length > 0, "must be > 0"),
        ("--micro-batch", args.micro_batch > 0, "must be > 0"),
        ("--shard-size", args.shard_size > 0, "must be > 0"),
        ("--max-prompts", args.max_prompts >= 0, "must be >= 0"),
        ("--max-rounds", args.max_rounds > 0, "must be > 0"),
    ]
    for name, ok, rule in checks:
        if not ok:
            raise UsageError(f"{name}={getattr(args, name[2:].replace('-', '_'))} {rule}")


def check_out(args: argparse.Namespace) -> None:
    """``--out`` is a ``.parquet`` file (the only format ``ppo.offline`` reads groups from), none of the
    inputs (the prompt files, the preference file, a model folder), and an existing one is replaced only
    with ``--overwrite``."""
    if args.out.suffix.lower() != ".parquet":
        raise UsageError(
            f"--out {args.out}: the groups are written as Parquet, the only format the trainer reads "
            "groups from (rollout.source=dataset, rollout.offline_fraction); name the file "
            f"{args.out.with_suffix('.parquet').name}"
        )
    out = args.out.resolve()
    inputs = {"--from-pairs": [args.from_pairs], "--data": args.data or [], "--model": [args.model],
              "--reward-model": [args.reward_model]}  # fmt: skip
    for flag, paths in inputs.items():
        for path in paths:
            if path is not None and (Path(path).resolve() == out or Path(path).resolve() in out.parents):
                raise UsageError(
                    f"--out {args.out} would write over {flag} {path}: write the groups elsewhere"
                )
    if args.out.exists() and not args.overwrite:
        raise UsageError(
            f"--out {args.out} already exists: choose another file, or pass --overwrite to replace it"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_args(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.from_pairs is not None:
        setup_logging(True)
        try:
            convert_pairs(args.from_pairs, args.out, args.prompt_key)
        except (data_files.DataError, OSError) as e:
            logger.error("%s", runner.one_line(e))
            return 2
        return 0
    info = init_distributed("auto")
    setup_logging(info.is_main)
    runner.quiet_other_ranks(info)
    try:
        make_groups(args, info)
    except runner.EXPECTED_ERRORS as e:
        message = runner.one_line(e)
        runner.report(info, lambda: logger.error("%s", message))
        return 2
    except Exception:
        text = traceback.format_exc()
        runner.report(info, lambda: logger.error("unexpected error on rank %d:\n%s", info.rank, text))
        return 1
    finally:
        destroy_distributed()
    return 0


# ----------------------------------------------------------------------------------------------------
# Sampling and ranking
# ----------------------------------------------------------------------------------------------------


def make_groups(args: argparse.Namespace, info: DistInfo) -> None:
    """Sample, score and rank every shard not yet written, then concatenate the shards (rank 0)."""
    start = time.perf_counter()
    tokenizer = model_loading.load_tokenizer(args.model, False, config_key="--model")
    use_rule = args.reward_model is None
    with main_rank_logs(info):
        records = data.load_prompts(
            args.data,
            tokenizer,
            prompt_key=args.prompt_key,
            max_prompt_length=args.max_prompt_length,
            require_ground_truth=use_rule and args.custom_function is None,
        )
    if args.max_prompts:
        records = records[: args.max_prompts]
    scorer = rule_scoring.make_rule_scorer(args.custom_function, args.format_score)
    if use_rule:
        unknown = sorted(
            {r.data_source for r in records if not rule_scoring.has_rule(r.data_source, args.custom_function)}
        )
        if unknown:
            raise rule_scoring.RewardError(
                f"no rule reward for data_source {', '.join(map(repr, unknown))}; known: "
                f"{', '.join(rule_scoring.RULE_DATA_SOURCES)}. Pass --custom-function module:function or "
                f"--reward-model PATH"
            )
        rule_scoring.check_scorer(
            scorer, records[0].data_source, records[0].ground_truth, records[0].extra_info
        )
    shard_dir = args.out.with_name(args.out.name + ".shards")
    num_shards = math.ceil(len(records) / args.shard_size)
    done = prepare_shard_dir(shard_dir, args, info)
    todo = [s for s in range(num_shards) if s not in done]
    logger.info(
        "%d prompts in %d shards of %d (%d already written) on %d ranks; k=%d responses each",
        len(records),
        num_shards,
        args.shard_size,
        num_shards - len(todo),
        info.world_size,
        args.k,
    )
    reward_model = None
    if todo:
        model_cfg = ModelConfig(path=args.model, dtype=args.dtype)
        policy = build_model(
            model_loading.load_causal_lm, model_cfg, FSDPConfig(), info, path_key="--model", trainable=False
        )
        if not use_rule:
            reward_model = build_model(
                model_loading.load_reward_model,
                model_cfg,
                FSDPConfig(),
                info,
                path=args.reward_model,
                path_key="--reward-model",
                trainable=False,
            )
        eos_ids = model_loading.eos_token_ids(tokenizer, policy)
        config = generation_config(
            max_new_tokens=args.max_response_length,
            do_sample=True,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=0,
            eos_token_ids=eos_ids,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0],
        )
    for shard in todo:
        t0 = time.perf_counter()
        mine = rank_slice(records[shard * args.shard_size : (shard + 1) * args.shard_size], info)
        torch.manual_seed(int(np.random.SeedSequence([args.seed, shard, info.rank]).generate_state(1)[0]))
        found = sample_groups(policy, mine, config, tokenizer, args)
        kept = [(r, texts) for r, texts in zip(mine, found, strict=True) if len(texts) == args.k]
        if reward_model is None:
            scores = agree_on_failure(lambda kept=kept: rule_scores(scorer, kept), rule_scoring.RewardError)
        else:
            scores = model_scores(reward_model, kept, tokenizer, args.micro_batch, info.device)
        logprobs = sampler_logprobs(policy, kept, tokenizer, args.temperature, args.micro_batch)
        rows = group_rows(kept, scores, logprobs, args.k)
        parts = all_gather_object((rows, len(mine) - len(kept)))
        if info.is_main:
            all_rows = [row for part, _ in parts for row in part]
            dropped = sum(n for _, n in parts)
            write_atomic(pa.Table.from_pylist(all_rows), shard_path(shard_dir, shard))
            logger.info(
                "shard %d/%d: %d groups, %d prompts dropped (fewer than %d usable samples) in %.1f s",
                shard + 1,
                num_shards,
                len(all_rows),
                dropped,
                args.k,
                time.perf_counter() - t0,
            )
    if info.is_main:
        final = concatenate_shards(shard_dir, num_shards, args.out, len(records), time.perf_counter() - start)
        if args.metrics is not None:
            runner.merge_metrics(args.metrics, final)
    # The other ranks wait: one leaving the process group while rank 0 still writes aborts it (gloo).
    barrier()


def sample_groups(
    model: torch.nn.Module,
    records: list[data.PromptRecord],
    config: Any,
    tokenizer: PreTrainedTokenizerBase,
    args: argparse.Namespace,
) -> list[list[str]]:
    """Up to ``k`` usable response texts per record: ``k`` samples each, then, for at most
    ``max_rounds - 1`` more rounds, as many new samples as a record lacks. A sample is usable when it
    ended with an EOS, is not empty, and re-tokenizes (``data.encode_response``, as ``ppo.offline``
    will) within the length limit without an EOS inside; repeats are kept (they are what the policy
    samples). Every rank runs the same number of rounds (``generate`` gathers the shards)."""
    found: list[list[str]] = [[] for _ in records]
    for _ in range(args.max_rounds):
        need = [i for i, texts in enumerate(found) for _ in range(args.k - len(texts))]
        if all_reduce_scalar(float(len(need)), "max") == 0:
            break
        prompts = [torch.tensor(records[i].input_ids, dtype=torch.long) for i in need]
        rollout = generate(model, prompts, config, micro_batch_size=args.micro_batch)
        rows = zip(
            need,
            rollout.responses.tolist(),
            rollout.attention_mask.tolist(),
            rollout.truncated.tolist(),
            strict=True,
        )
        for i, tokens, mask, truncated in rows:
            if truncated:
                continue
            text = tokenizer.decode(
                [t for t, m in zip(tokens, mask, strict=True) if m], skip_special_tokens=True
            )
            ids = data.encode_response(text, tokenizer)
            if text.strip() and len(ids) <= args.max_response_length and ids[-1] not in ids[:-1]:
                found[i].append(text)
    return found


def rule_scores(
    scorer: rule_scoring.RuleScorer, kept: list[tuple[data.PromptRecord, list[str]]]
) -> torch.Tensor:
    """The rule's score of every response, ``[num groups * k]`` float64; RewardError on a non-finite one."""
    scores = torch.tensor(
        [scorer(r.data_source, t, r.ground_truth, r.extra_info).value for r, texts in kept for t in texts],
        dtype=torch.float64,
    )
    check_finite(kept, scores)
    return scores


def model_scores(
    reward_model: torch.nn.Module,
    kept: list[tuple[data.PromptRecord, list[str]]],
    tokenizer: PreTrainedTokenizerBase,
    micro_batch_size: int,
    device: torch.device,
) -> torch.Tensor:
    """The reward model's score of every response (prompt + response tokens + EOS, as ``ppo.offline``
    will tokenize them), ``[num groups * k]`` float64; RewardError on every rank for a non-finite one."""
    seqs = [r.input_ids + data.encode_response(t, tokenizer) for r, texts in kept for t in texts]
    scores = rewards.reward_model_scores(
        reward_model, seqs, micro_batch_size=micro_batch_size, device=device
    ).double()
    agree_on_failure(lambda: check_finite(kept, scores), rule_scoring.RewardError)
    return scores


def check_finite(kept: list[tuple[data.PromptRecord, list[str]]], scores: torch.Tensor) -> None:
    """RewardError naming the prompt row of the first NaN or infinite score (it cannot be ranked)."""
    bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
    if bad:
        k = len(kept[0][1])
        record, texts = kept[bad[0] // k]
        raise rule_scoring.RewardError(
            f"score {scores[bad[0]].item()} for prompt row {record.index}, response "
            f"{texts[bad[0] % k]!r:.60}: a group with a non-finite score cannot be ranked"
        )


def sampler_logprobs(
    policy: torch.nn.Module,
    kept: list[tuple[data.PromptRecord, list[str]]],
    tokenizer: PreTrainedTokenizerBase,
    temperature: float,
    micro_batch_size: int,
) -> list[list[float]]:
    """The sampling policy's log-prob of every response token, ``log softmax(logits / temperature)``, on
    the tokens ``ppo.offline`` will train on (the text re-encoded, then EOS): one list per response, in
    ``kept``'s order. The scoring forward the trainer itself runs (``packed_forward.logprobs``), so a
    policy identical to the sampler gives ratios of exactly 1. Every rank must call it (the forwards of a
    sharded model are collectives; a rank out of groups forwards a dummy sequence)."""
    prompts = [torch.tensor(r.input_ids, dtype=torch.long) for r, texts in kept for _ in texts]
    responses = [data.encode_response(t, tokenizer) for _, texts in kept for t in texts]
    out: list[list[float]] = [[] for _ in responses]
    groups = plan_eval_micro_batches(
        [p.numel() + len(r) for p, r in zip(prompts, responses, strict=True)],
        use_dynamic_bsz=False,
        max_tokens=0,
        micro_batch_size=micro_batch_size,
    )
    with torch.no_grad():
        for group in groups:
            rows = group or [None]
            seqs = [responses[i] if i is not None else [0] for i in rows]
            width = max(len(r) for r in seqs)
            ids = torch.tensor([r + [0] * (width - len(r)) for r in seqs])
            mask = torch.arange(width)[None, :] < torch.tensor([len(r) for r in seqs])[:, None]
            heads = [prompts[i] if i is not None else torch.tensor(DUMMY_SEQUENCE) for i in rows]
            packed = pack(heads, ids, mask)
            lp, _ = packed_forward.logprobs(policy, packed, temperature=temperature)
            for j, i in enumerate(group):
                out[i] = lp[j, : len(responses[i])].tolist()
    sharding.release(policy)
    return out


def group_rows(
    kept: list[tuple[data.PromptRecord, list[str]]], scores: torch.Tensor, logprobs: list[list[float]], k: int
) -> list[dict[str, Any]]:
    """One output row per group: the prompt's ``index`` (to find its input row) plus ``responses``,
    ``scores``, ``ranks`` (competition ranks of the scores within the group) and ``logprobs`` (the
    sampler's token log-probs of each response, ``sampler_logprobs``)."""
    group_ids = torch.arange(len(kept) * k) // k
    ranks = rewards.competition_ranks(scores, group_ids).tolist()
    values = scores.tolist()
    return [
        {
            "index": r.index,
            "responses": texts,
            "scores": values[g * k : (g + 1) * k],
            "ranks": ranks[g * k : (g + 1) * k],
            "logprobs": logprobs[g * k : (g + 1) * k],
        }
        for g, (r, texts) in enumerate(kept)
    ]


# ----------------------------------------------------------------------------------------------------
# Shards and files
# ----------------------------------------------------------------------------------------------------


def shard_path(shard_dir: Path, shard: int) -> Path:
    return shard_dir / f"shard_{shard:05d}.parquet"


def write_atomic(table: pa.Table, path: Path) -> None:
    """Write to a temporary file beside ``path``, then rename: a reader (or a resume) never sees half a
    file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)


def prepare_shard_dir(shard_dir: Path, args: argparse.Namespace, info: DistInfo) -> set[int]:
    """Create the shard folder with the run's options (rank 0) and return the shards already written.

    A folder made with other options is refused on every rank (its shards would mix two data sets).
    """
    meta = {
        key: str(value) if isinstance(value, Path) else value
        for key, value in vars(args).items()
        if key not in ("out", "micro_batch", "metrics")  # speed and reporting, not what is sampled
    }
    meta["data"] = [str(p) for p in args.data]
    meta["columns"] = list(GROUP_COLUMNS)  # shards of an older layout (no logprobs) are not mixed in
    result: tuple[str | None, list[int]] = (None, [])
    if info.is_main:
        try:
            result = (None, _shards_written(shard_dir, meta))
        except (OSError, data_files.DataError) as e:
            result = (runner.one_line(e), [])
    error, done = broadcast_object(result)
    if error is not None:
        raise data_files.DataError(error)
    return set(done)


def _shards_written(shard_dir: Path, meta: dict[str, Any]) -> list[int]:
    meta_path = shard_dir / META_FILE
    if meta_path.is_file():
        saved = json.loads(meta_path.read_text())
        changed = sorted(k for k in set(saved) | set(meta) if saved.get(k) != meta.get(k))
        if changed:
            raise data_files.DataError(
                f"{shard_dir} holds shards made with other options ({', '.join(changed)} differ); "
                f"delete it to start afresh, or resume with the same options"
            )
    else:
        shard_dir.mkdir(parents=True, exist_ok=True)
        meta_path.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return sorted(int(p.stem.split("_")[1]) for p in shard_dir.glob("shard_*.parquet"))


def concatenate_shards(
    shard_dir: Path, num_shards: int, out: Path, num_prompts: int, elapsed_s: float
) -> dict[str, float]:
    """Join the shards in prompt order with the input rows' columns and write ``out`` (rank 0); returns
    the final numbers (``offline_*``)."""
    tables = [pq.read_table(shard_path(shard_dir, s)) for s in range(num_shards)]
    groups = [row for t in tables for row in t.to_pylist()]
    meta = json.loads((shard_dir / META_FILE).read_text())
    if not groups:
        raise data_files.DataError(
            f"no prompt got {meta['k']} usable samples (not empty, ended within --max-response-length="
            f"{meta['max_response_length']}); raise --max-response-length or --max-rounds"
        )
    inputs = [row for path in meta["data"] for row in data_files.read_rows(Path(path), required=[])]
    rows = [{**inputs[g.pop("index")], **g} for g in groups]
    write_atomic(pa.Table.from_pylist(rows), out)
    scores = np.array([r["scores"] for r in rows])
    final = {
        "offline_groups": len(rows),
        "offline_prompts": num_prompts,
        "offline_group_size": scores.shape[1],
        "offline_mean_score": float(scores.mean()),
        "offline_unequal_share": float(np.mean(scores.max(1) > scores.min(1))),
        "offline_time_s": round(elapsed_s, 1),
    }
    logger.info(
        "wrote %s: %d groups of %d responses from %d prompts (%d dropped); mean score %.3f, groups with "
        "unequal scores %.0f%%; %.1f s",
        out,
        len(rows),
        scores.shape[1],
        num_prompts,
        num_prompts - len(rows),
        final["offline_mean_score"],
        100 * final["offline_unequal_share"],
        elapsed_s,
    )
    return final


def convert_pairs(src: Path, out: Path, prompt_key: str) -> None:
    """A preference file as groups of two (``responses = [chosen, rejected]``, ``ranks = [0, 1]``)."""
    rows = data_files.read_parquet(src, required=[prompt_key, *offline.PAIR_COLUMNS])
    groups, skipped = [], []
    for i, row in enumerate(rows):
        texts = offline.pair_responses(row, src, i)
        if texts is None:
            skipped.append(i)
            continue
        rest = {k: v for k, v in row.items() if k not in offline.PAIR_COLUMNS}
        groups.append({**rest, "responses": texts, "ranks": [0, 1]})
    offline.log_skipped_pairs(src, skipped, len(rows))
    if not groups:
        raise data_files.DataError(f"{src}: no usable preference pair among {len(rows)} rows")
    write_atomic(pa.Table.from_pylist(groups), out)
    logger.info("wrote %s: %d groups of 2 from %d preference rows", out, len(groups), len(rows))


if __name__ == "__main__":
    exit_process(main())
