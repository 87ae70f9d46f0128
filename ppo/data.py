"""RL prompts in verl's layout (and TRL's), how a prompt or a response becomes tokens, and the per-rank
loader of all three trainers.

Prompt files follow verl's layout, one row per prompt, in any of ``ppo.data_files.FORMATS`` (Parquet as
verl and ``scripts/prepare_gsm8k.py`` write it; JSON lines or JSON as TRL users keep prompts; a folder
written by ``datasets``' ``save_to_disk``), read by ``ppo.data_files.read_rows`` into the same rows and
checked alike::

    prompt        list of chat messages [{"role": ..., "content": ...}] or a plain string
    data_source   str, picks the rule scorer (``ppo.rule_scoring.default_compute_score``)
    reward_model  struct {style, ground_truth}
    extra_info    struct/dict (optional column)
    ground_truth  (optional, TRL's layout) the ground truth where ``reward_model`` has none
    other columns (optional) reach the reward function inside ``extra_info``, as TRL passes its columns

Preference pairs and SFT examples (the stages before PPO) are read in ``ppo.stage_data``, offline
response groups in ``ppo.offline``, with the encoding here and the readers of ``ppo.data_files``.

How a prompt becomes tokens (one function, ``encode_prompt``, does it for every loader):

- chat messages with ``apply_chat_template=True``: the tokenizer's chat template renders them with
  ``add_generation_prompt=True`` and the keywords of ``data.apply_chat_template_kwargs`` (verl's key:
  ``enable_thinking=False`` for Qwen3; ``ppo.chat_template`` names those the template does not read);
  the text is then tokenized with ``add_special_tokens=False``, because the template already wrote the BOS token (this is what ``apply_chat_template(tokenize=True)`` does);
- a plain string: used as it is (verl applies the template only to message lists) and tokenized with
  ``add_special_tokens=True``, i.e. with whatever the tokenizer adds to plain text (a BOS for Llama);
- chat messages with ``apply_chat_template=False``: the contents joined by newlines, then as a string.

Responses (``answer``, ``chosen``, ``rejected``) are tokenized with ``add_special_tokens=False`` and get
the EOS token appended; they are tokenized apart from the prompt so the boundary is exact. Nothing is
ever truncated: over-long rows are dropped, counted and logged. Bad input raises
``ppo.data_files.DataError`` naming the file, the row and the column; an RL prompt whose chat ends with an
assistant message (an SFT conversation, its answer included) is bad input (``refuse_answered_prompts``).

Usage::

    chat_template.check_chat_template_kwargs(tokenizer, cfg.data.apply_chat_template_kwargs)  # once
    records = load_prompts(cfg.data.train_files, tokenizer, max_prompt_length=cfg.data.max_prompt_length,
                           chat_template_kwargs=cfg.data.apply_chat_template_kwargs)
    loader = make_loader(records, cfg, info)    # a ShardedLoader as the config says
    for step, batch in zip(range(total_steps(cfg, loader)), loader):  # this rank's PromptRecords
        ...
    ckpt["dataloader"] = loader.state_dict()
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ppo import chat_template
from ppo.data_files import DataError, Files, as_paths, cell_ref, check_columns, log_dropped, read_rows

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ppo.config import PPOConfig, StageConfig
    from ppo.distributed import DistInfo

logger = logging.getLogger("ppo")

DEFAULT_DATA_SOURCE = "default"
"""The ``data_source`` of prompts from a file without that column."""


# ----------------------------------------------------------------------------------------------------
# Records
# ----------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class PromptRecord:
    """One RL prompt, tokenized."""

    input_ids: list[int]
    """Prompt tokens (chat template applied), ``len <= max_prompt_length``."""
    prompt_text: str
    """The text the tokens came from (rendered template or the raw string)."""
    data_source: str
    """Picks the rule scorer."""
    ground_truth: str | None
    """``reward_model.ground_truth`` as a string; None in a file without one (see ``load_prompts``)."""
    extra_info: dict[str, Any]
    """The row's ``extra_info`` ({} when the column is absent or null)."""
    index: int
    """Row number over the concatenated files, counted before filtering (a stable id of the row)."""
    prompt: str | list[dict[str, Any]] | None = None
    """The prompt cell as the file holds it (a string or chat messages): what a TRL-style reward function
    gets as ``prompts``; None where a loader does not keep it."""


# ----------------------------------------------------------------------------------------------------
# Prompts and responses as tokens
# ----------------------------------------------------------------------------------------------------


def check_messages(value: Any, where: str) -> list[dict[str, Any]]:
    """Check a list of chat messages (dicts with str ``role`` and ``content``) and return it.

    Null fields (Parquet structs carry every key of every row) are removed from each message.
    """
    if not isinstance(value, list):
        raise DataError(
            f"{where}: expected a list of chat messages [{{'role', 'content'}}] or a string, "
            f"got {type(value).__name__}"
        )
    if not value:
        raise DataError(f"{where}: empty prompt (an empty list of messages)")
    messages = []
    for j, m in enumerate(value):
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise DataError(
                f"{where}: message {j} must be a dict with string 'role' and 'content', got {m!r:.120}"
            )
        messages.append({k: v for k, v in m.items() if v is not None})
    if not any(m["content"].strip() for m in messages):
        raise DataError(f"{where}: empty prompt (every message has empty content)")
    return messages


def render_messages(
    messages: list[dict[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    *,
    add_generation_prompt: bool,
    where: str,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """Render chat messages with the tokenizer's chat template (to text, not tokens); the template
    also reads ``chat_template_kwargs`` (``data.apply_chat_template_kwargs``)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            f"{where}: the prompt is a list of chat messages but the tokenizer has no chat template; "
            f"give a tokenizer with one, or set data.apply_chat_template=false"
        )
    return tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        **(chat_template_kwargs or {}),
    )


def encode_prompt(
    prompt: Any,
    tokenizer: PreTrainedTokenizerBase,
    *,
    apply_chat_template: bool,
    where: str,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[str, list[int]]:
    """Validate one prompt cell and return ``(text, token ids)``; see the module docstring for the rules
    (``chat_template_kwargs``: keywords of the chat template, for chat messages)."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where}: empty prompt")
        return prompt, list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    messages = check_messages(prompt, where)
    if apply_chat_template:
        text = render_messages(
            messages,
            tokenizer,
            add_generation_prompt=True,
            where=where,
            chat_template_kwargs=chat_template_kwargs,
        )
        # The template wrote the special tokens (BOS); adding them again would double the BOS.
        return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = "\n".join(m["content"] for m in messages)
    return text, list(tokenizer(text, add_special_tokens=True)["input_ids"])


def encode_response(text: str, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Response tokens (no special tokens) followed by EOS, so the model learns to stop."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [_eos_id(tokenizer)]


def _eos_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The EOS id, or DataError when the tokenizer has none."""
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no EOS token; responses need one to end")
    return int(tokenizer.eos_token_id)


# ----------------------------------------------------------------------------------------------------
# RL prompts
# ----------------------------------------------------------------------------------------------------


def load_prompts(
    files: Files,
    tokenizer: PreTrainedTokenizerBase,
    *,
    prompt_key: str = "prompt",
    max_prompt_length: int,
    apply_chat_template: bool = True,
    require_ground_truth: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[PromptRecord]:
    """Load RL prompts in verl's layout; prompts over ``max_prompt_length`` tokens are dropped and logged.
    Chat messages are rendered with the keywords ``chat_template_kwargs``
    (``data.apply_chat_template_kwargs``; a keyword the loader sets itself is a ConfigError).

    With ``require_ground_truth=False`` (a reward that needs none: a reward model, or a custom function
    that does without) a file needs only the prompt column, as TRL users keep prompts: a missing
    ``data_source`` is ``DEFAULT_DATA_SOURCE`` and a missing ``reward_model`` (or ground truth) None.

    Raises DataError on a missing file or column, a wrong type, an empty prompt, or when no prompt is
    left after filtering.
    """
    paths = as_paths(files)
    chat_template.check_own_keywords(chat_template_kwargs or {})
    records: list[PromptRecord] = []
    total = dropped = offset = 0
    for path in paths:
        hints = {
            prompt_key: "set data.prompt_key to the column that holds the prompts",
            "reward_model": "the rule reward needs reward_model.ground_truth (or a top-level ground_truth "
            "column, TRL's layout); a reward model (reward.style=model) or reward.custom_function can do "
            "without",
        }
        required = [prompt_key, "data_source", "reward_model"] if require_ground_truth else [prompt_key]
        try:
            rows = read_rows(path, required=required, hints=hints)
        except DataError:
            rows = read_rows(path, required=[], hints=hints) if require_ground_truth else []
            if not rows:
                raise
            # TRL's layout: a top-level ground_truth column stands in for reward_model
            trl = [c for c in required if c != "reward_model"] if TRL_GROUND_TRUTH in rows[0] else required
            check_columns(path, list(rows[0]), trl, hints)
        # After the read: a missing or malformed file is its one error line, with no progress line before it
        logger.info("start-up: tokenizing %d rows of %s", len(rows), path)
        if apply_chat_template:
            warn_mixed_prompts(path, [row[prompt_key] for row in rows], prompt_key)
        warn_string_prompts(path, [row[prompt_key] for row in rows], prompt_key, tokenizer)
        refuse_answered_prompts(path, [row[prompt_key] for row in rows], prompt_key)
        file_dropped = 0
        for i, row in enumerate(rows):
            text, ids = encode_prompt(
                row[prompt_key],
                tokenizer,
                apply_chat_template=apply_chat_template,
                where=cell_ref(path, i, prompt_key),
                chat_template_kwargs=chat_template_kwargs,
            )
            # Check every row, kept or not, so a bad file fails whatever the length limit.
            record = PromptRecord(
                input_ids=ids,
                prompt_text=text,
                data_source=_check_data_source(
                    row.get("data_source", DEFAULT_DATA_SOURCE), cell_ref(path, i, "data_source")
                ),
                ground_truth=_ground_truth(
                    _trl_ground_truth(row),
                    cell_ref(path, i, "reward_model"),
                    required=require_ground_truth,
                ),
                extra_info=_other_columns(row, prompt_key)
                | _extra_info(row.get("extra_info"), cell_ref(path, i, "extra_info")),
                index=offset + i,
                prompt=row[prompt_key],
            )
            if len(ids) > max_prompt_length:
                file_dropped += 1
            else:
                records.append(record)
        log_dropped(path, "prompts", file_dropped, len(rows), "data.max_prompt_length", max_prompt_length)
        total += len(rows)
        dropped += file_dropped
        offset += len(rows)
    names = ", ".join(map(str, paths))
    if total == 0:
        raise DataError(f"no prompts in {names}: the files have no rows")
    if not records:
        raise DataError(
            f"no prompts left in {names}: {dropped} of {total} were longer than "
            f"data.max_prompt_length={max_prompt_length} tokens and were dropped; raise data.max_prompt_length"
        )
    return records


def refuse_answered_prompts(path: Path, prompts: list[Any], column: str) -> None:
    """DataError when a chat prompt's last message is the assistant's (an SFT conversation used as RL
    prompts): the prompt would hold its own answer, rendered as a finished turn before the generation
    prompt, and the policy would be trained to answer again after reading it. Earlier assistant turns of a
    multi-turn chat are context and pass; only the last message decides. Names the first such row and how
    many of the file's rows end so (verl 0.9.1 renders these rows as they are)."""
    answered = [
        i
        for i, p in enumerate(prompts)
        if isinstance(p, list) and p and isinstance(p[-1], dict) and p[-1].get("role") == "assistant"
    ]
    if not answered:
        return
    first = answered[0]
    raise DataError(
        f"{cell_ref(path, first, column)}: the chat ends with an assistant message (message "
        f"{len(prompts[first]) - 1}), so as an RL prompt it holds its own answer ({len(answered)} of "
        f"{len(prompts)} rows end so): drop each row's last assistant message to use the file as prompts "
        "(earlier assistant turns may stay), or train on these conversations with the SFT stage "
        "(scripts/train_sft.py)"
    )


def warn_mixed_prompts(path: Path, prompts: list[Any], column: str) -> None:
    """Log a warning when a file holds both plain-string and chat-message prompts: the strings skip the
    chat template the messages get, so the two kinds reach the model in different formats."""
    first_string = next((i for i, p in enumerate(prompts) if isinstance(p, str)), None)
    first_chat = next((i for i, p in enumerate(prompts) if not isinstance(p, str)), None)
    if first_string is not None and first_chat is not None:
        logger.warning(
            "%s: column %r mixes plain strings (first: row %d), used as they are, and chat messages (first: "
            "row %d), rendered with the chat template: give every row the same kind",
            path,
            column,
            first_string,
            first_chat,
        )


def warn_string_prompts(
    path: Path, prompts: list[Any], column: str, tokenizer: PreTrainedTokenizerBase
) -> None:
    """Log a warning when every prompt of a file is a plain string and the tokenizer has a chat template:
    the strings reach the model without it (as verl and TRL use strings), which for a chat model is
    usually not the format it was tuned on. No key renders strings with the template: chat messages are
    what gets it (``data.apply_chat_template``)."""
    if not prompts or not all(isinstance(p, str) for p in prompts):
        return
    if getattr(tokenizer, "chat_template", None) is None:
        return
    logger.warning(
        "%s: every prompt in column %r is a plain string, used as it is: the tokenizer's chat template is "
        "not applied (data.apply_chat_template renders chat messages only); to have it applied, store each "
        "prompt as [{'role': 'user', 'content': ...}]",
        path,
        column,
    )


TRL_GROUND_TRUTH = "ground_truth"
"""TRL's top-level ground-truth column, taken as ``reward_model.ground_truth`` where that is absent."""

VERL_COLUMNS = ("data_source", "reward_model", "extra_info")
"""Columns of verl's layout that the loader reads itself (with the prompt's)."""

GROUP_COLUMNS = ("responses", "ranks", "scores", "logprobs", "chosen", "rejected")
"""Columns of offline groups and preference pairs (``ppo.offline``): the trainer's data, never copied into
a reward function's ``extra_info`` (a group's responses would ride along with every one of its rows)."""


def _trl_ground_truth(row: dict[str, Any]) -> Any:
    """The row's ``reward_model`` cell, with a top-level ``ground_truth`` (TRL's layout) as its ground
    truth when the cell has none."""
    value = row.get("reward_model")
    truth = row.get(TRL_GROUND_TRUTH)
    if truth is None or (isinstance(value, dict) and value.get("ground_truth") is not None):
        return value
    return {**(value if isinstance(value, dict) else {"style": "rule"}), "ground_truth": truth}


def _other_columns(row: dict[str, Any], prompt_key: str) -> dict[str, Any]:
    """The row's top-level columns other than the prompt and verl's own (``ground_truth`` included: TRL's
    reward functions receive every column): they reach the reward function inside ``extra_info``, whose
    own keys win."""
    own = (prompt_key, *VERL_COLUMNS, *GROUP_COLUMNS)
    return {k: v for k, v in row.items() if k not in own and v is not None}


def _check_data_source(value: Any, where: str) -> str:
    """A ``data_source`` cell as a non-empty string."""
    if not isinstance(value, str) or not value:
        raise DataError(f"{where}: expected a non-empty string naming the data source, got {value!r:.80}")
    return value


def _ground_truth(value: Any, where: str, *, required: bool = True) -> str | None:
    """``reward_model.ground_truth`` as a string (numbers are converted); None when absent and not
    ``required``."""
    if not required and (value is None or (isinstance(value, dict) and value.get("ground_truth") is None)):
        return None
    if not isinstance(value, dict) or value.get("ground_truth") is None:
        raise DataError(
            f"{where}: expected a struct {{'style': 'rule', 'ground_truth': ...}} with a ground truth, "
            f"got {value!r:.120}"
        )
    truth = value["ground_truth"]
    if not isinstance(truth, (str, int, float)) or isinstance(truth, bool):
        raise DataError(f"{where}: ground_truth must be a string or a number, got {type(truth).__name__}")
    return str(truth)


def _extra_info(value: Any, where: str) -> dict[str, Any]:
    """An ``extra_info`` cell as a dict ({} for null)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise DataError(f"{where}: expected a struct/dict or null, got {type(value).__name__}")
    return value


# ----------------------------------------------------------------------------------------------------
# The per-rank loader
# ----------------------------------------------------------------------------------------------------


class ShardedLoader:
    """Endless iterator over this rank's share of global prompt batches, resumable mid-epoch.

    Epoch ``e`` orders the records by a permutation drawn from ``numpy.random.default_rng([seed, e])``
    (or keeps file order when ``shuffle=False``) and cuts it into global batches of ``batch_size``
    prompts; rank ``r`` takes the contiguous slice ``[r * k, (r + 1) * k)`` with
    ``k = batch_size // world_size``. The global order depends only on (records, seed, batch_size), so
    a run resumed on another number of ranks continues the same global sequence.

    With ``drop_last=False`` the epoch's last, shorter batch is split as evenly as possible (ranks may
    get one prompt fewer, or none): callers must agree on counts across ranks (e.g. for validation).
    """

    def __init__(
        self,
        records: Sequence[PromptRecord],
        *,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        if batch_size <= 0 or world_size <= 0:
            raise DataError(f"batch_size={batch_size} and world_size={world_size} must be > 0")
        if batch_size % world_size:
            raise DataError(
                f"the global batch of {batch_size} prompts must divide evenly over {world_size} ranks: "
                f"make data.train_batch_size a multiple of {world_size}"
            )
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is outside [0, {world_size})")
        if not records:
            raise DataError("no prompts to load")
        if drop_last and len(records) < batch_size:
            raise DataError(
                f"the data set has {len(records)} prompts, fewer than one global batch of {batch_size}: "
                f"lower data.train_batch_size or add prompts"
            )
        self.records = list(records)
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        """Epoch of the next batch (before rolling over)."""
        self.batch_in_epoch = 0
        """Batches of ``epoch`` already returned."""
        self._order_epoch = -1
        self._order = np.arange(0)

    @property
    def steps_per_epoch(self) -> int:
        """Global batches per pass over the records."""
        n = len(self.records)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Record indices in the order of ``epoch`` (deterministic in ``seed`` and ``epoch``)."""
        n = len(self.records)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def global_batch_indices(self, epoch: int, batch: int) -> np.ndarray:
        """Record indices of global batch ``batch`` of ``epoch`` (all ranks together)."""
        if self._order_epoch != epoch:
            self._order, self._order_epoch = self.epoch_order(epoch), epoch
        return self._order[batch * self.batch_size : (batch + 1) * self.batch_size]

    def __iter__(self) -> Iterator[list[PromptRecord]]:
        return self

    def __next__(self) -> list[PromptRecord]:
        """This rank's records of the next step; rolls over to the next epoch after the last batch."""
        if self.batch_in_epoch >= self.steps_per_epoch:
            self.epoch += 1
            self.batch_in_epoch = 0
        indices = self.global_batch_indices(self.epoch, self.batch_in_epoch)
        self.batch_in_epoch += 1
        share = np.array_split(indices, self.world_size)[self.rank]  # equal slices for a full batch
        return [self.records[i] for i in share]

    def state_dict(self) -> dict[str, Any]:
        """Position (the next batch) plus what the position means; for the checkpoint."""
        return {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "seed": self.seed,
            "num_records": len(self.records),
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the batch after the one last returned when ``state`` was saved.

        Fails when the data set, seed or batch size differ, since the saved position would then point
        at other prompts.
        """
        mine = self.state_dict()
        changed = [
            f"{k}: checkpoint {state[k]!r}, now {mine[k]!r}"
            for k in ("seed", "num_records", "batch_size", "shuffle", "drop_last")
            if state[k] != mine[k]
        ]
        if changed:
            raise DataError(
                "cannot resume the prompt loader, the data order differs from the checkpoint's ("
                + "; ".join(changed)
                + "): resume with the same data files, trainer.seed and data.train_batch_size"
            )
        self.epoch = int(state["epoch"])
        self.batch_in_epoch = int(state["batch_in_epoch"])


def make_loader(records: Sequence[Any], cfg: PPOConfig | StageConfig, info: DistInfo) -> ShardedLoader:
    """This rank's contiguous share of each global batch, from a permutation seeded by
    ``(trainer.seed, epoch)``."""
    return ShardedLoader(
        records,
        batch_size=cfg.data.train_batch_size,
        rank=info.rank,
        world_size=info.world_size,
        seed=cfg.trainer.seed,
        shuffle=cfg.data.shuffle,
    )


def total_steps(cfg: PPOConfig | StageConfig, loader: ShardedLoader) -> int:
    """``trainer.total_training_steps``, or ``total_epochs`` passes over the training data."""
    return cfg.trainer.total_training_steps or loader.steps_per_epoch * cfg.trainer.total_epochs
