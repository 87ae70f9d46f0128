"""Offline RLHF: groups of ranked responses read from Parquet, in place of sampling.

A training file holds, per row, a prompt in verl's layout (``prompt``, ``data_source``,
``reward_model: {style, ground_truth}``, ``extra_info``; see ``ppo.data``) and a group of responses to
it, ranked by people, a reward model or a rule::

    responses   list of strings, one group of exactly ``rollout.n`` responses
    ranks       list of ints, 0 = best, ties share a rank (competition ranking, see below)
    scores      list of floats, higher = better
    logprobs    optional: per response, the sampling policy's log-prob of each of its tokens as the
                trainer tokenizes them (EOS included), as scripts/make_offline_data.py writes them

A row needs ``ranks`` or ``scores``; with both (as ``scripts/make_offline_data.py`` writes them) the
ranks must be the competition ranks of the scores. Responses are non-empty strings; the same text may
appear twice in a group (sampling a confident policy repeats itself) only with the same rank and score.
A preference file (``prompt``, ``chosen``, ``rejected``: what ``scripts/train_reward_model.py`` reads)
loads as groups of two, chosen rank 0 and rejected rank 1, so public preference sets work unchanged.

Ranks are valid when they are the competition ("1224") ranking of some order: each rank equals the
number of responses ranked strictly better, ``ranks[i] == #{j : ranks[j] < ranks[i]}``. So the best
rank is 0, and a tie of ``t`` responses at rank ``r`` is followed by rank ``r + t``: ``[0, 1, 2, 3]``,
``[0, 0, 2, 3]``, ``[2, 0, 0, 3]``, ``[0, 1, 1, 3]`` and ``[0, 0, 0, 0]`` are valid; ``[1, 2, 3, 4]``
(no best), ``[0, 0, 1, 2]`` (dense ranking) and ``[0, 2, 3, 4]`` (a gap) are not.

The trainer reads a batch of groups where it would sample (step 1); everything after is unchanged::

    groups = load_offline_groups(cfg.data.train_files, tokenizer, group_size=cfg.rollout.n, ...)
    rollout = offline_rollout(batch_groups, max_response_length=R, pad_token_id=pad, eos_token_ids=eos,
                              device=device)                     # what generate would have returned
    scores = scores_from_ranks(dataset_ranks(batch_groups, device), n, "best")   # reward.style=ranking
    scores = dataset_scores(batch_groups, device)                                # reward.style=dataset

Validation: a bad cell raises ``DataError`` naming the file, the row and the column; over-long
prompts and groups with an over-long response are dropped, counted and logged (never truncated);
preference rows with an empty or null chosen/rejected, or the two identical, are skipped and logged
as ``ppo.stage_data`` does for reward-model training.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Real
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ppo import data
from ppo.batch import Batch, Rollout, concat_rollouts, group_index
from ppo.data_files import DataError, Files, as_paths, cell_ref, parquet_columns, read_parquet, row_list
from ppo.rewards import competition_ranks
from ppo.rollout import attention_mask_from_eos

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("ppo")

PAIR_COLUMNS = ("chosen", "rejected")
"""The response columns of a preference file; such a file loads as groups of two."""


@dataclass(kw_only=True)
class OfflineGroup:
    """One prompt with its ``k`` ranked responses, tokenized as the trainer would have sampled them."""

    record: data.PromptRecord
    """The prompt, tokenized as ``data.load_prompts`` does (same data_source, ground truth, extra_info)."""
    responses: list[list[int]]
    """``k`` token lists: the text without special tokens, then the EOS (``data.encode_response``)."""
    ranks: list[int] | None
    """``[k]`` competition ranks from the data (0 = best); None when the row gave only scores."""
    scores: list[float] | None
    """``[k]`` finite scores from the data (higher = better); None when the row gave only ranks."""
    logprobs: list[list[float]] | None = None
    """Per response, the sampling policy's log-prob of each token of ``responses``; None when the data
    does not know the policy that produced it (human rankings, other models' responses)."""

    @property
    def index(self) -> int:
        """Row number over the concatenated files, counted before filtering (``record.index``)."""
        return self.record.index


def load_offline_groups(
    files: Files,
    tokenizer: PreTrainedTokenizerBase,
    *,
    group_size: int,
    prompt_key: str = "prompt",
    max_prompt_length: int,
    max_response_length: int,
    apply_chat_template: bool = True,
    require_ground_truth: bool = True,
    require_scores: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[OfflineGroup]:
    """Load offline groups (or preference pairs as groups of two); see the module docstring.

    ``group_size`` is ``rollout.n``: a group of another size is an error. A group with a response longer
    than ``max_response_length`` tokens (EOS included, as generation counts it) is dropped whole and
    counted; so is one whose prompt exceeds ``max_prompt_length``. ``require_scores`` (``reward.style=
    dataset``) makes a row without ``scores`` an error. Raises DataError on a bad cell, when a file
    has no usable group, and when all of a file's usable groups tie (nothing to learn from it).
    """
    paths = as_paths(files)
    # The prompts exactly as the sampling trainer loads them (tokens, data_source, ground truth,
    # extra_info, the dropped long prompts counted); keyed by the row number over all files.
    records = {
        r.index: r
        for r in data.load_prompts(
            paths,
            tokenizer,
            prompt_key=prompt_key,
            max_prompt_length=max_prompt_length,
            apply_chat_template=apply_chat_template,
            require_ground_truth=require_ground_truth,
            chat_template_kwargs=chat_template_kwargs,
        )
    }
    eos_id = data.encode_response("", tokenizer)[-1]  # DataError when the tokenizer has no EOS
    groups: list[OfflineGroup] = []
    offset = 0
    for path in paths:
        pairs = _is_pair_file(path)
        if pairs and group_size != 2:
            raise DataError(
                f"{path}: a preference file (prompt, chosen, rejected) loads as groups of 2, but rollout.n="
                f"{group_size}; set rollout.n=2"
            )
        if pairs and require_scores:
            raise DataError(
                f"{path}: reward.style=dataset trains on the data's scores, but a preference file has none; "
                f"use reward.style=ranking"
            )
        rows = read_parquet(path, required=PAIR_COLUMNS if pairs else ["responses"])
        skipped: list[int] = []  # preference rows with an empty or identical pair
        too_long: list[int] = []
        kept = 0
        for i, row in enumerate(rows):
            if pairs:
                texts = pair_responses(row, path, i)
                if texts is None:
                    skipped.append(i)
                    continue
                ranks, scores = [0, 1], None
            else:
                texts, ranks, scores = _ranked_group(row, path, i, group_size, require_scores)
            # Check every row, kept or not, so a bad file fails whatever the length limits.
            responses = [_encode(t, tokenizer, eos_id, path, i, j, pairs) for j, t in enumerate(texts)]
            logprobs = None if pairs else _logprobs(row.get("logprobs"), responses, path, i)
            record = records.get(offset + i)
            if record is None:  # its prompt was too long (counted by load_prompts)
                continue
            if max(len(r) for r in responses) > max_response_length:
                too_long.append(i)
                continue
            groups.append(
                OfflineGroup(
                    record=record, responses=responses, ranks=ranks, scores=scores, logprobs=logprobs
                )
            )
            kept += 1
        log_skipped_pairs(path, skipped, len(rows))
        if too_long:
            logger.info(
                "%s: dropped %d of %d groups with a response longer than data.max_response_length=%d tokens "
                "(rows %s)",
                path,
                len(too_long),
                len(rows),
                max_response_length,
                row_list(too_long),
            )
        if kept == 0:
            raise DataError(
                f"{path}: no usable group among {len(rows)} rows ({len(skipped)} empty or identical pairs, "
                f"{len(too_long)} with a response longer than data.max_response_length={max_response_length} "
                f"tokens, the rest with a prompt longer than data.max_prompt_length={max_prompt_length})"
            )
        # A group whose responses all tie has advantage 0 everywhere (ranked) and gives DPO no pair; a
        # file of only such groups is a broken ranking, not data.
        if all(_all_tie(g) for g in groups[-kept:]):
            raise DataError(
                f"{path}: no group with unequal ranks: nothing to learn (no preference pair either: all {kept} "
                f"groups tie, each ranking or scoring its responses alike); check its ranks or scores"
            )
        logger.info("%s: %d groups of %d responses", path, kept, group_size)
        offset += len(rows)
    return groups


def _all_tie(group: OfflineGroup) -> bool:
    """Whether every response of ``group`` has the same rank (or, without ranks, the same score)."""
    order = group.ranks if group.ranks is not None else group.scores
    return len(set(order)) == 1


def _is_pair_file(path: Path) -> bool:
    """Whether a file is a preference file (``chosen``/``rejected``, no ``responses``)."""
    columns = parquet_columns(path)
    if "responses" in columns:
        return False
    if all(c in columns for c in PAIR_COLUMNS):
        return True
    raise DataError(
        f"{path}: missing column 'responses' (offline groups) or 'chosen' + 'rejected' (preference pairs); "
        f"it has {columns}"
    )


def pair_responses(row: dict[str, Any], path: Path, i: int) -> list[str] | None:
    """``[chosen, rejected]`` of preference row ``i``; None for an empty or null one, or the two identical
    (such rows are skipped, as in reward-model training). DataError for a non-string cell."""
    texts = []
    for column in PAIR_COLUMNS:
        value = row[column]
        if value is not None and not isinstance(value, str):
            raise DataError(
                f"{cell_ref(path, i, column)}: expected a string response, got {type(value).__name__}"
            )
        texts.append(value or "")
    if not all(t.strip() for t in texts) or texts[0] == texts[1]:
        return None
    return texts


def log_skipped_pairs(path: Path, skipped: list[int], total: int) -> None:
    """Warn once about the preference rows ``pair_responses`` skipped, with their row numbers."""
    if skipped:
        logger.warning(
            "%s: skipped %d of %d rows with an empty or null chosen/rejected, or chosen == rejected (rows %s)",
            path,
            len(skipped),
            total,
            row_list(skipped),
        )


def _ranked_group(
    row: dict[str, Any], path: Path, i: int, group_size: int, require_scores: bool
) -> tuple[list[str], list[int] | None, list[float] | None]:
    """``(responses, ranks, scores)`` of a group row, every rule of the module docstring checked."""
    where = cell_ref(path, i, "responses")
    texts = row["responses"]
    if not isinstance(texts, list):
        raise DataError(f"{where}: expected a list of response strings, got {type(texts).__name__}")
    if len(texts) != group_size:
        raise DataError(
            f"{where}: {len(texts)} responses, but every group must have rollout.n={group_size}; "
            f"set rollout.n to the data's group size"
        )
    for j, text in enumerate(texts):
        if not isinstance(text, str):
            raise DataError(f"{where}: response {j} must be a string, got {type(text).__name__}")
        if not text.strip():
            raise DataError(f"{where}: response {j} is empty")
    ranks = _number_list(row.get("ranks"), cell_ref(path, i, "ranks"), group_size, integers=True)
    scores = _number_list(row.get("scores"), cell_ref(path, i, "scores"), group_size, integers=False)
    if ranks is None and scores is None:
        raise DataError(
            f"{path}: row {i}, columns 'ranks' and 'scores': neither is set; a group needs ranks (0 = best) "
            f"or scores (higher = better)"
        )
    if require_scores and scores is None:
        raise DataError(
            f"{cell_ref(path, i, 'scores')}: reward.style=dataset trains on the data's scores, but this "
            f"row has only ranks; use reward.style=ranking"
        )
    if scores is not None:
        bad = [s for s in scores if not math.isfinite(s)]
        if bad:
            raise DataError(f"{cell_ref(path, i, 'scores')}: scores must be finite, got {scores}")
    if ranks is not None:
        expected = _competition_ranks([-r for r in ranks])
        if ranks != expected:
            raise DataError(
                f"{cell_ref(path, i, 'ranks')}: {ranks} are not competition ranks (0 = best; each rank "
                f"is the number of responses ranked strictly better, so ties at r are followed by r + "
                f"their count): expected {expected} for this order"
            )
        if scores is not None and ranks != _competition_ranks(scores):
            raise DataError(
                f"{path}: row {i}, columns 'ranks' and 'scores': the ranks {ranks} disagree with the scores "
                f"{scores} (their competition ranks are {_competition_ranks(scores)}, higher = better); give "
                f"one of them, or make them agree"
            )
    _check_duplicates(texts, ranks, scores, path, i)
    return texts, ranks, scores


def _check_duplicates(
    texts: list[str], ranks: list[int] | None, scores: list[float] | None, path: Path, i: int
) -> None:
    """DataError for two identical responses ranked or scored differently (a contradiction); identical
    responses that agree are kept, as sampling a confident policy gives them."""
    first: dict[str, int] = {}
    for j, text in enumerate(texts):
        j0 = first.setdefault(text, j)
        for column, values in (("ranks", ranks), ("scores", scores)):
            if values is not None and values[j0] != values[j]:
                raise DataError(
                    f"{cell_ref(path, i, column)}: responses {j0} and {j} are identical ({text!r:.60}) "
                    f"but have {column} {values[j0]} and {values[j]}; one response has one {column[:-1]}"
                )


def _number_list(value: Any, where: str, size: int, *, integers: bool) -> list | None:
    """A ``ranks`` (``integers``) or ``scores`` cell as a list of ``size`` numbers; None when null."""
    if value is None:
        return None
    kind = "integers" if integers else "numbers"
    if not isinstance(value, list) or len(value) != size:
        raise DataError(f"{where}: expected a list of {size} {kind} (one per response), got {value!r:.80}")
    wanted = int if integers else Real
    if any(not isinstance(v, wanted) or isinstance(v, bool) for v in value):
        raise DataError(f"{where}: expected {kind}, got {value!r:.80}")
    return [int(v) for v in value] if integers else [float(v) for v in value]


LOGPROB_SLACK = 1e-4
"""Largest log-prob accepted above 0 (the rounding of a log-softmax of a certain token)."""


def _logprobs(value: Any, responses: list[list[int]], path: Path, i: int) -> list[list[float]] | None:
    """A ``logprobs`` cell: one list per response, a finite log-prob (<= 0) per token of the response as
    tokenized here; None when null. DataError naming the cell otherwise (a length mismatch means the data
    was tokenized differently: its log-probs would belong to other tokens)."""
    if value is None:
        return None
    where = cell_ref(path, i, "logprobs")
    if not isinstance(value, list) or len(value) != len(responses):
        raise DataError(
            f"{where}: expected a list of {len(responses)} lists (one per response), got {value!r:.80}"
        )
    out = []
    for j, (lps, tokens) in enumerate(zip(value, responses, strict=True)):
        if not isinstance(lps, list) or len(lps) != len(tokens):
            got = len(lps) if isinstance(lps, list) else type(lps).__name__
            raise DataError(
                f"{where}: response {j} has {len(tokens)} tokens (EOS included) as tokenized here, but "
                f"{got} log-probs; the data was made with another tokenizer: regenerate it or drop the column"
            )
        if any(
            not isinstance(v, Real) or isinstance(v, bool) or not math.isfinite(v) or v > LOGPROB_SLACK
            for v in lps
        ):
            raise DataError(f"{where}: response {j}'s log-probs must be finite numbers <= 0, got {lps!r:.80}")
        out.append([float(v) for v in lps])
    return out


def _competition_ranks(scores: list[float]) -> list[int]:
    """``rewards.competition_ranks`` of one group (higher = better)."""
    values = torch.tensor(scores, dtype=torch.float64)
    return competition_ranks(values, torch.zeros(len(scores), dtype=torch.long)).tolist()


def _encode(
    text: str, tokenizer: PreTrainedTokenizerBase, eos_id: int, path: Path, i: int, j: int, pairs: bool
) -> list[int]:
    """``data.encode_response``; DataError when the text itself holds the EOS token, since a response
    would end there (the rest never trained)."""
    ids = data.encode_response(text, tokenizer)
    if eos_id in ids[:-1]:
        column, name = (PAIR_COLUMNS[j], "the response") if pairs else ("responses", f"response {j}")
        raise DataError(
            f"{cell_ref(path, i, column)}: {name} contains the EOS token {tokenizer.eos_token!r} "
            f"before its end; responses end there, so remove it from the text"
        )
    return ids


# ----------------------------------------------------------------------------------------------------
# A batch of groups as a rollout, and its data rewards
# ----------------------------------------------------------------------------------------------------


def offline_rollout(
    groups: list[OfflineGroup],
    *,
    max_response_length: int,
    pad_token_id: int,
    eos_token_ids: list[int],
    device: torch.device | str,
) -> Rollout:
    """The groups' responses as the ``Rollout`` that ``ppo.rollout.generate`` returns had it sampled them.

    ``B = len(groups) * k`` sequences in group order (group ``g``'s responses are rows ``g*k .. g*k+k-1``,
    so ``group_ids = arange(B) // k`` as for sampled groups); ``prompts``: ``B`` prompt tensors ``[P_i]``
    on the CPU (each prompt repeated ``k`` times, as the trainer passes them to ``generate``);
    ``responses [B, R]`` with ``R = max_response_length``, right-padded with ``pad_token_id``;
    ``response_mask [B, R]`` True up to and including the first EOS (``attention_mask_from_eos``);
    ``truncated [B]`` False. Raises DataError (``check_eos``) when a response would end early, at an EOS
    id of ``eos_token_ids`` inside its text (e.g. one the model's generation config adds).
    """
    seqs = [(g, tokens) for g in groups for tokens in g.responses]
    responses = torch.full((len(seqs), max_response_length), pad_token_id, dtype=torch.long)
    for b, (g, tokens) in enumerate(seqs):
        if len(tokens) > max_response_length:
            raise ValueError(
                f"row {g.index}: a response of {len(tokens)} tokens exceeds max_response_length="
                f"{max_response_length}; load_offline_groups drops such groups with the same limit"
            )
        responses[b, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    responses = responses.to(device)
    response_mask, truncated = attention_mask_from_eos(responses, eos_token_ids)
    if response_mask.sum(-1).tolist() != [len(tokens) for _, tokens in seqs]:
        check_eos(groups, eos_token_ids)  # raises, naming the response
    responses = torch.where(response_mask, responses, torch.full_like(responses, pad_token_id))
    return Rollout(
        prompts=[torch.tensor(g.record.input_ids, dtype=torch.long) for g, _ in seqs],
        responses=responses,
        attention_mask=response_mask,
        truncated=truncated,
    )


def check_eos(groups: list[OfflineGroup], eos_token_ids: list[int]) -> None:
    """DataError unless every response ends with its first EOS id (any of ``eos_token_ids``).

    ``load_offline_groups`` checks the tokenizer's EOS; call this once the model's EOS ids are known
    (``model_loading.eos_token_ids``: its generation config may add more), before step 1 and on every rank.
    """
    eos = set(eos_token_ids)
    for g in groups:
        for j, tokens in enumerate(g.responses):
            early = [p for p, t in enumerate(tokens[:-1]) if t in eos]
            if early:
                raise DataError(
                    f"row {g.index}: response {j} holds an end-of-sequence token (id {tokens[early[0]]}, one "
                    f"of {eos_token_ids}) at position {early[0]} of {len(tokens)}; it would end there"
                )
            if tokens[-1] not in eos:
                raise DataError(
                    f"row {g.index}: response {j} ends with token {tokens[-1]}, none of the EOS ids "
                    f"{eos_token_ids}"
                )


def dataset_ranks(groups: list[OfflineGroup], device: torch.device | str) -> torch.Tensor:
    """``[B]`` long: the data's ranks of each response (0 = best), in ``offline_rollout``'s order; for a
    row with only scores, their competition ranks (higher score = better). Feed them to
    ``rewards.scores_from_ranks`` for ``reward.style=ranking``."""
    ranks = [r for g in groups for r in (g.ranks if g.ranks is not None else _competition_ranks(g.scores))]
    return torch.tensor(ranks, dtype=torch.long, device=device)


def dataset_scores(groups: list[OfflineGroup], device: torch.device | str) -> torch.Tensor:
    """``[B]`` float32: the data's scores of each response, in ``offline_rollout``'s order
    (``reward.style=dataset``; load with ``require_scores=True`` so every group has them)."""
    missing = [g.index for g in groups if g.scores is None]
    if missing:
        raise DataError(
            f"rows {row_list(missing)} have ranks but no scores; reward.style=dataset needs scores"
        )
    return torch.tensor([s for g in groups for s in g.scores], dtype=torch.float32, device=device)


def num_offline_groups(
    num_groups: int, offline_fraction: float, *, rank: int = 0, world_size: int = 1
) -> int:
    """How many of this rank's ``num_groups`` prompt groups of a step come from the data set.

    The fraction applies to the global batch of ``G = num_groups * world_size`` groups:
    ``K = round(G * offline_fraction)`` (halves up) are offline, spread over the ranks as evenly as
    possible (ranks below ``K mod world_size`` take one more); the rest are sampled. With 2 ranks of 4
    groups, 0.1 gives 1 offline group (on rank 0); with 2 ranks of 1 group, 0.5 gives rank 0 its group
    from the data and rank 1 a sampled one. ``PPOConfig`` refuses a fraction that rounds to no offline or
    no sampled group.
    """
    total = math.floor(num_groups * world_size * offline_fraction + 0.5)
    return min(num_groups, total // world_size + (rank < total % world_size))


def step_batch(
    groups: list[OfflineGroup],
    num_offline: int,
    sampled: Rollout | None,
    *,
    group_size: int,
    with_scores: bool,
    with_logprobs: bool,
    max_response_length: int,
    pad_token_id: int,
    eos_token_ids: list[int],
    device: torch.device | str,
) -> Batch:
    """This rank's step batch when offline groups take part (``rollout.offline_fraction > 0``): the
    responses of the first ``num_offline`` groups from the data (``offline_rollout``), then ``sampled``,
    the rollout of the other groups' prompts (each repeated ``group_size`` times; None when every group
    is offline). Rows ``[g*k, (g+1)*k)`` are group ``g``'s, offline groups first; ``data_ranks`` holds the
    data's ranks (-1 for sampled rows), ``data_scores`` its scores where ``with_scores``
    (``reward.style=dataset``), else NaN, and with ``with_logprobs`` (some group of the data set has
    them: the same on every rank) ``data_logprobs``, NaN where unknown."""
    given = groups[:num_offline]
    parts = [
        offline_rollout(
            given,
            max_response_length=max_response_length,
            pad_token_id=pad_token_id,
            eos_token_ids=eos_token_ids,
            device=device,
        )
    ]
    if sampled is not None:
        parts.append(sampled)
    records = [g.record for g in groups for _ in range(group_size)]
    num_given = len(given) * group_size
    ranks = dataset_ranks(given, device) if given else torch.zeros(0, dtype=torch.long, device=device)
    data_scores = torch.full((len(records),), float("nan"), device=device)
    if with_scores:
        data_scores[:num_given] = dataset_scores(given, device)
    return Batch(
        rollout=concat_rollouts(parts),
        records=records,
        group_ids=group_index(len(records), group_size, device),
        data_ranks=torch.cat([ranks, torch.full((len(records) - num_given,), -1, device=device)]),
        data_scores=data_scores,
        data_logprobs=dataset_logprobs(given, len(records), max_response_length, device)
        if with_logprobs
        else None,
    )


def dataset_logprobs(
    groups: list[OfflineGroup], num_rows: int, max_response_length: int, device: torch.device | str
) -> torch.Tensor:
    """``[num_rows, R]`` float32: the data's sampler log-probs of the offline responses (rows in
    ``offline_rollout``'s order first), NaN where unknown (sampled rows, groups without ``logprobs``,
    padding)."""
    out = torch.full((num_rows, max_response_length), float("nan"))
    row = 0
    for g in groups:
        for j in range(len(g.responses)):
            if g.logprobs is not None:
                lps = g.logprobs[j]
                out[row, : len(lps)] = torch.tensor(lps)
            row += 1
    return out.to(device)
