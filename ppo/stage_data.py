"""The data of the stages before PPO: preference pairs (reward model, DPO) and SFT demonstrations.

Preference files have ``prompt``, ``chosen``, ``rejected`` (any other column is kept in ``extra``);
SFT files have ``prompt`` + ``answer``, or a ``messages`` column of whole conversations. Prompts become
tokens as in ``ppo.data`` (``encode_prompt``); responses are tokenized apart from the prompt and get
the EOS appended (``encode_response``). Over-long rows are dropped and counted, never truncated; bad
input raises ``DataError`` naming the file, the row and the column.

DPO reads the files the offline PPO path reads (``ppo.offline.load_offline_groups``: prompts exactly as
``data.load_prompts`` tokenizes them, over-long prompts and groups dropped and counted): preference
files, one pair a row, or ranked groups, each expanded to pairs of its best response against worse
ones (``load_dpo_pairs``).

    pairs = load_preference_pairs(cfg.data.train_files, tokenizer, max_length=cfg.data.max_length)
    examples = load_sft_examples(cfg.data.train_files, tokenizer, max_length=cfg.data.max_length)
    dpo = load_dpo_pairs(cfg.data.train_files, tokenizer, pairs="best_vs_rest", max_prompt_length=64,
                         max_response_length=64)          # dpo.pairs, dpo.num_tied_groups
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.parquet as pq

from ppo import offline
from ppo.data import check_messages, encode_prompt, encode_response, render_messages
from ppo.data_files import (
    DataError,
    Files,
    as_paths,
    cell_ref,
    log_dropped,
    parquet_columns,
    read_parquet,
    row_list,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("ppo")


@dataclass(kw_only=True)
class PreferencePair:
    """A prompt with a chosen and a rejected response, both as whole token sequences."""

    chosen_ids: list[int]
    """Prompt tokens + chosen response tokens + EOS."""
    rejected_ids: list[int]
    """Prompt tokens + rejected response tokens + EOS."""
    prompt_length: int
    """Number of leading prompt tokens shared by both sequences."""
    extra: dict[str, Any]
    """Every other column of the row (e.g. ``mistake``), for per-kind metrics."""
    index: int
    """Row number over the concatenated files, counted before filtering."""


@dataclass(kw_only=True)
class SFTExample:
    """A tokenized demonstration with the tokens to train on."""

    input_ids: list[int]
    """Prompt and answer tokens."""
    loss_mask: list[bool]
    """True on the answer tokens (assistant turns) including their final EOS; False on the prompt."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Every other column of the row."""
    index: int = 0
    """Row number over the concatenated files, counted before filtering."""


def load_preference_pairs(
    files: Files,
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_length: int,
    apply_chat_template: bool = True,
) -> list[PreferencePair]:
    """Load ``prompt``/``chosen``/``rejected`` rows as token sequences for reward-model training.

    Rows whose chosen or rejected is empty (or null), or where the two are identical, are skipped and
    logged with their row numbers; pairs where either sequence exceeds ``max_length`` tokens are
    dropped and counted. A file with no usable row raises DataError.
    """
    pairs: list[PreferencePair] = []
    offset = 0
    for path in as_paths(files):
        rows = read_parquet(path, required=["prompt", "chosen", "rejected"])
        skipped: list[int] = []
        too_long = 0
        for i, row in enumerate(rows):
            chosen = _response_text(row["chosen"], cell_ref(path, i, "chosen"))
            rejected = _response_text(row["rejected"], cell_ref(path, i, "rejected"))
            if not chosen.strip() or not rejected.strip() or chosen == rejected:
                skipped.append(i)
                continue
            _, prompt_ids = encode_prompt(
                row["prompt"],
                tokenizer,
                apply_chat_template=apply_chat_template,
                where=cell_ref(path, i, "prompt"),
            )
            chosen_ids = prompt_ids + encode_response(chosen, tokenizer)
            rejected_ids = prompt_ids + encode_response(rejected, tokenizer)
            if max(len(chosen_ids), len(rejected_ids)) > max_length:
                too_long += 1
                continue
            extra = {k: v for k, v in row.items() if k not in ("prompt", "chosen", "rejected")}
            pairs.append(
                PreferencePair(
                    chosen_ids=chosen_ids,
                    rejected_ids=rejected_ids,
                    prompt_length=len(prompt_ids),
                    extra=extra,
                    index=offset + i,
                )
            )
        if skipped:
            logger.warning(
                "%s: skipped %d of %d rows with an empty or null chosen/rejected, or chosen == rejected "
                "(rows %s)",
                path,
                len(skipped),
                len(rows),
                row_list(skipped),
            )
        log_dropped(path, "preference pairs", too_long, len(rows), "max_length", max_length)
        usable = len(rows) - len(skipped) - too_long
        if usable == 0:
            raise DataError(
                f"{path}: no usable preference pair among {len(rows)} rows ({len(skipped)} empty or identical, "
                f"{too_long} longer than max_length={max_length} tokens)"
            )
        offset += len(rows)
    return pairs


def _response_text(value: Any, where: str) -> str:
    """A response cell as a string; null counts as empty (the caller skips it)."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise DataError(f"{where}: expected a string response, got {type(value).__name__}")
    return value


@dataclass(kw_only=True)
class DPOData:
    """DPO's preference pairs, and the groups that gave none."""

    pairs: list[PreferencePair]
    """Pairs in file order: the groups' order, then the order of the worse responses in a group."""
    num_groups: int
    """Groups loaded (a preference row is a group of two), after over-long ones were dropped."""
    num_tied_groups: int
    """Of those, groups whose responses all tie: no pair, skipped."""


def load_dpo_pairs(
    files: Files,
    tokenizer: PreTrainedTokenizerBase,
    *,
    pairs: str,
    max_prompt_length: int,
    max_response_length: int,
    apply_chat_template: bool = True,
) -> DPOData:
    """Preference pairs from preference files (``prompt``, ``chosen``, ``rejected``) or ranked groups
    (``responses`` with ``ranks`` or ``scores``), the files ``rollout.source=dataset`` reads.

    Each file goes through ``offline.load_offline_groups`` (a preference file as groups of two; no
    ground truth needed), so prompts and responses are the tokens the offline PPO path trains on and
    bad cells fail naming file, row and column. A group's pairs put its best response (the first with
    the best rank; a row with only ``scores`` is ranked by them, higher = better) against

    - ``best_vs_rest``: each strictly worse response (``k - t`` pairs when ``t`` share the best rank);
    - ``best_vs_worst``: the worst one (the first with the worst rank), one pair.

    A group whose responses all tie gives no pair: it is skipped, counted and logged. ``PreferencePair
    .index`` is the group's row over the concatenated files; ``extra`` holds the two ranks.
    """
    if pairs not in ("best_vs_rest", "best_vs_worst"):
        raise ValueError(f"pairs={pairs!r}: expected best_vs_rest or best_vs_worst")
    out = DPOData(pairs=[], num_groups=0, num_tied_groups=0)
    offset = 0
    paths = as_paths(files)
    for path in paths:
        groups = offline.load_offline_groups(
            path,
            tokenizer,
            group_size=_group_size(path),
            max_prompt_length=max_prompt_length,
            max_response_length=max_response_length,
            apply_chat_template=apply_chat_template,
            require_ground_truth=False,
        )
        tied: list[int] = []
        for g in groups:
            ranks = offline.dataset_ranks([g], "cpu").tolist()
            best = ranks.index(min(ranks))
            worse = [j for j, r in enumerate(ranks) if r > ranks[best]]
            if not worse:
                tied.append(g.index)
                continue
            if pairs == "best_vs_worst":
                worse = [ranks.index(max(ranks))]
            prompt = g.record.input_ids
            for j in worse:
                out.pairs.append(
                    PreferencePair(
                        chosen_ids=prompt + g.responses[best],
                        rejected_ids=prompt + g.responses[j],
                        prompt_length=len(prompt),
                        extra={"chosen_rank": ranks[best], "rejected_rank": ranks[j]},
                        index=offset + g.index,
                    )
                )
        if tied:
            logger.info(
                "%s: skipped %d of %d groups whose responses all tie (no preference pair; rows %s)",
                path,
                len(tied),
                len(groups),
                row_list(tied),
            )
        out.num_groups += len(groups)
        out.num_tied_groups += len(tied)
        offset += pq.read_metadata(path).num_rows
    if not out.pairs:
        raise DataError(
            f"no preference pair in {', '.join(map(str, paths))}: all {out.num_groups} groups tie (every "
            f"response ranked or scored alike)"
        )
    return out


def _group_size(path: Path) -> int:
    """Responses per group of a file: 2 for a preference file, else the size of its ``responses`` lists,
    which must be one size (DataError naming the first row of another)."""
    if "responses" not in parquet_columns(path):
        return 2  # a preference file (load_offline_groups names the columns when it is neither)
    cells = pq.read_table(path, columns=["responses"]).column("responses").to_pylist()
    sizes = [(i, len(c)) for i, c in enumerate(cells) if isinstance(c, list)]
    for i, size in sizes:
        if size != sizes[0][1]:
            raise DataError(
                f"{cell_ref(path, i, 'responses')}: {size} responses, but row {sizes[0][0]} has {sizes[0][1]}; "
                f"the groups of one file must have one size (split the file by group size)"
            )
    return sizes[0][1] if sizes else 2


def load_sft_examples(
    files: Files,
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_length: int,
    apply_chat_template: bool = True,
) -> list[SFTExample]:
    """Load demonstrations with a loss mask on the answer tokens.

    Two layouts: ``prompt`` + ``answer`` columns (the answer and its EOS are trained), or a ``messages``
    column of whole conversations (every assistant turn as the chat template renders it is trained;
    needs ``apply_chat_template``). Examples over ``max_length`` tokens are dropped and logged.
    """
    examples: list[SFTExample] = []
    offset = 0
    for path in as_paths(files):
        use_messages, rows = _sft_layout(path)
        too_long = 0
        for i, row in enumerate(rows):
            if use_messages:
                ids, mask = _encode_conversation(
                    row["messages"], tokenizer, apply_chat_template, cell_ref(path, i, "messages")
                )
                used = ("messages",)
            else:
                _, prompt_ids = encode_prompt(
                    row["prompt"],
                    tokenizer,
                    apply_chat_template=apply_chat_template,
                    where=cell_ref(path, i, "prompt"),
                )
                answer = row["answer"]
                if not isinstance(answer, str) or not answer.strip():
                    raise DataError(
                        f"{cell_ref(path, i, 'answer')}: expected a non-empty string, got {answer!r:.80}"
                    )
                answer_ids = encode_response(answer, tokenizer)
                ids = prompt_ids + answer_ids
                mask = [False] * len(prompt_ids) + [True] * len(answer_ids)
                used = ("prompt", "answer")
            if len(ids) > max_length:
                too_long += 1
                continue
            extra = {k: v for k, v in row.items() if k not in used}
            examples.append(SFTExample(input_ids=ids, loss_mask=mask, extra=extra, index=offset + i))
        log_dropped(path, "SFT examples", too_long, len(rows), "max_length", max_length)
        if too_long == len(rows):
            raise DataError(
                f"{path}: no usable SFT example among {len(rows)} rows ({too_long} longer than "
                f"max_length={max_length} tokens): raise max_length"
            )
        offset += len(rows)
    return examples


def _sft_layout(path: Path) -> tuple[bool, list[dict[str, Any]]]:
    """Whether an SFT file uses the ``messages`` layout, and its rows."""
    columns = parquet_columns(path)
    use_messages = "messages" in columns and "answer" not in columns
    rows = read_parquet(
        path,
        required=["messages"] if use_messages else ["prompt", "answer"],
        hints={"answer": "an SFT file needs 'prompt' + 'answer' columns, or a 'messages' column"},
    )
    if not rows:
        raise DataError(f"{path}: the file has no rows")
    return use_messages, rows


def _encode_conversation(
    value: Any, tokenizer: PreTrainedTokenizerBase, apply_chat_template: bool, where: str
) -> tuple[list[int], list[bool]]:
    """Tokens and loss mask of a whole conversation; assistant turns are trained.

    The conversation is rendered once; the text of assistant turn ``i`` is what rendering
    ``messages[: i + 1]`` adds to rendering ``messages[:i]`` with the generation prompt. The pieces are
    tokenized separately (no special tokens added) so the mask boundaries are exact.
    """
    if not apply_chat_template:
        raise DataError(f"{where}: a 'messages' column needs the chat template; set apply_chat_template=true")
    messages = check_messages(value, where)
    full = render_messages(messages, tokenizer, add_generation_prompt=False, where=where)
    cuts: list[tuple[int, int]] = []  # [start, end) character spans of assistant turns
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if i == 0:
            raise DataError(f"{where}: the conversation starts with an assistant turn; it needs a prompt")
        start = len(render_messages(messages[:i], tokenizer, add_generation_prompt=True, where=where))
        end_text = render_messages(messages[: i + 1], tokenizer, add_generation_prompt=False, where=where)
        if not full.startswith(end_text) or start > len(end_text) or (cuts and start < cuts[-1][1]):
            raise DataError(
                f"{where}: the chat template does not render the conversation turn by turn (a prefix of it "
                f"renders differently), so assistant turns cannot be located; use prompt + answer columns"
            )
        cuts.append((start, len(end_text)))
    if not cuts:
        raise DataError(f"{where}: no assistant turn to train on")
    ids: list[int] = []
    mask: list[bool] = []
    pos = 0
    for start, end in cuts:
        for lo, hi, trained in ((pos, start, False), (start, end, True)):
            piece = list(tokenizer(full[lo:hi], add_special_tokens=False)["input_ids"]) if hi > lo else []
            ids += piece
            mask += [trained] * len(piece)
        pos = end
    tail = list(tokenizer(full[pos:], add_special_tokens=False)["input_ids"]) if pos < len(full) else []
    return ids + tail, mask + [False] * len(tail)
