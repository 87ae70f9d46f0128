"""Reading data files: the formats a data file of the project may come in, and the errors and log lines
that name a file, a row and a column.

``read_rows`` reads any of ``FORMATS`` into the same rows (dicts by column; a key that a JSON row lacks
is None, as a Parquet null), after checking that the file exists and has the columns its caller requires:

- Parquet (``.parquet``), as verl and ``scripts/prepare_gsm8k.py`` write it;
- JSON lines (``.jsonl``) or JSON (``.json``: a list of rows, one row, or JSON lines as
  ``Dataset.to_json`` writes them), as TRL users keep prompts;
- a folder written by ``datasets``' ``save_to_disk`` (one split's folder, not a ``DatasetDict``'s).

``read_parquet`` reads Parquet only (offline groups, SFT and preference files). Nothing here knows what
the rows mean: the prompt layout (verl's columns, TRL's) and its checks are in ``ppo.data``, preference
pairs and SFT examples in ``ppo.stage_data``, offline groups in ``ppo.offline``, and each of them reads
through this module. Bad input raises ``DataError`` naming the file, the row and the column
(``cell_ref``); a missing file's error says how to make it (``missing_file``, which
``ppo.input_paths`` also uses to report missing data files before torch loads).

Usage::

    for path in as_paths(files):
        rows = read_rows(path, required=["prompt"], hints={"prompt": "set data.prompt_key to ..."})
        for i, row in enumerate(rows):
            where = cell_ref(path, i, "prompt")  # "train.parquet: row 3, column 'prompt'"
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

logger = logging.getLogger("ppo")

Files = str | os.PathLike | Sequence[str | os.PathLike]
"""One path or a list of paths."""

MAX_ROWS_LISTED = 5
"""How many row numbers a log line about skipped rows lists."""

FORMATS = (
    "Parquet (.parquet), JSON lines (.jsonl), JSON (.json: a list of rows, or JSON lines as "
    "Dataset.to_json writes them) or a folder written by datasets' save_to_disk"
)
"""What ``read_rows`` reads (prompt files)."""

DEMO_ASSETS = Path(__file__).resolve().parents[1] / "assets"
"""Where ``make assets`` writes the demo's models and data."""


class DataError(ValueError):
    """A data file is missing or malformed; the message names the file, the row and the column."""


# ----------------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------------


def as_paths(files: Files) -> list[Path]:
    """One path or a list of paths as a non-empty list of ``Path``."""
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    paths = [Path(f) for f in files]
    if not paths:
        raise DataError(f"no data files given: pass at least one ({FORMATS})")
    return paths


def missing_file(path: Path) -> DataError:
    """The error for a data file that does not exist: how to make it."""
    if path.parts[:1] == ("assets",) or Path(os.path.abspath(path)).is_relative_to(DEMO_ASSETS):
        how = "`make assets` builds the demo's data (and models) under assets/, in the repository's root"
    elif "gsm8k" in str(path).lower():
        how = "`python scripts/prepare_gsm8k.py --out <folder>` writes GSM8K's train.parquet and test.parquet"
    else:
        how = f"prompt files are {FORMATS}; scripts/prepare_gsm8k.py writes GSM8K's, `make assets` the demo's"
    return DataError(f"{path}: no such data file; {how}")


def parquet_columns(path: Path) -> list[str]:
    """Column names of a Parquet file; DataError when it is missing or not Parquet."""
    if not path.exists():
        raise missing_file(path)
    if not path.is_file():
        raise DataError(f"{path}: a folder, not a Parquet file")
    try:
        return pq.read_schema(path).names
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: cannot be read as Parquet: {e}") from e


def read_parquet(
    path: Path, *, required: Sequence[str], hints: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Read a whole Parquet file as row dicts, after checking it exists and has the ``required`` columns.

    ``hints`` maps a column to a remedy appended to its missing-column error (e.g. which config key
    names it). Structs come back as dicts, lists as lists.
    """
    columns = parquet_columns(path)
    check_columns(path, columns, required, hints)
    try:
        return pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: cannot be read as Parquet: {e}") from e


def check_columns(
    path: Path, columns: list[str], required: Sequence[str], hints: dict[str, str] | None
) -> None:
    """DataError unless ``columns`` (of the file at ``path``) hold every ``required`` one; ``hints`` as in
    ``read_parquet``."""
    missing = [c for c in required if c not in columns]
    if missing:
        hint = "".join(f"; {hints[c]}" for c in missing if hints and c in hints)
        raise DataError(f"{path}: missing column(s) {', '.join(map(repr, missing))}; it has {columns}{hint}")


def read_rows(
    path: Path, *, required: Sequence[str], hints: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """The rows of a data file in any of ``FORMATS``, as ``read_parquet`` returns them (dicts; a key that
    a JSON row lacks is None, as a Parquet null), after checking it exists and has the ``required``
    columns (``hints`` as in ``read_parquet``)."""
    if not path.exists():
        raise missing_file(path)
    if path.is_dir():
        rows, columns = _read_saved_dataset(path)
    elif path.suffix.lower() in (".json", ".jsonl"):
        rows, columns = _read_json(path)
    else:
        return read_parquet(path, required=required, hints=hints)
    if rows:  # a file without rows has no columns to check; the caller says it is empty
        check_columns(path, columns, required, hints)
    return rows


def _read_json(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows and columns of a JSON file: a list of rows (or one row), or JSON lines."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text, so not JSON ({e.reason} at byte {e.start})") from e
    except OSError as e:
        raise DataError(f"{path}: cannot be read: {e.strerror or e}") from e
    try:
        whole = json.loads(text) if text.strip() else []
    except json.JSONDecodeError as e:
        if e.msg != "Extra data":  # one document, broken
            raise DataError(f"{path}: line {e.lineno}, column {e.colno}: not valid JSON ({e.msg})") from e
        whole = None  # several documents: JSON lines
    if whole is None:
        rows, where = [], []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path}: line {number} is not valid JSON ({e.msg} at column {e.colno}); a JSON-lines file "
                    f"holds one row (a JSON object) per line"
                ) from e
            where.append(f"line {number}")
    else:
        rows = whole if isinstance(whole, list) else [whole]
        where = [f"row {i}" for i in range(len(rows))] if isinstance(whole, list) else ["line 1"]
    for row, at in zip(rows, where, strict=True):
        if not isinstance(row, dict):
            raise DataError(f"{path}: {at}: expected a JSON object (one row), got {type(row).__name__}")
    columns = list(dict.fromkeys(k for row in rows for k in row))
    return [{c: row.get(c) for c in columns} for row in rows], columns


def _read_saved_dataset(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows and columns of a folder written by ``datasets.Dataset.save_to_disk``."""
    if (path / "dataset_dict.json").is_file():
        try:
            splits = json.loads((path / "dataset_dict.json").read_text()).get("splits") or []
        except (OSError, ValueError, AttributeError):
            splits = []
        example = f", e.g. {path / splits[0]}" if splits else ""
        raise DataError(f"{path}: a DatasetDict folder (splits {splits}); give one split's folder{example}")
    if not (path / "state.json").is_file():
        raise DataError(
            f"{path}: a folder, but not one written by datasets' save_to_disk (no state.json); give {FORMATS}"
        )
    try:
        import datasets  # slow to import: only a saved dataset needs it

        dataset = datasets.load_from_disk(str(path))
    except Exception as e:  # datasets raises many kinds for a damaged folder
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise DataError(f"{path}: cannot be read as a saved dataset ({type(e).__name__}: {reason})") from e
    return dataset.to_list(), list(dataset.column_names)


# ----------------------------------------------------------------------------------------------------
# Errors and log lines that name a file, a row and a column
# ----------------------------------------------------------------------------------------------------


def cell_ref(path: Path, row: int, column: str) -> str:
    """The ``file: row i, column 'c'`` prefix of an error message."""
    return f"{path}: row {row}, column {column!r}"


def row_list(rows: list[int]) -> str:
    """The first few row numbers for a log line."""
    shown = ", ".join(map(str, rows[:MAX_ROWS_LISTED]))
    return shown + (f", ... ({len(rows)} in all)" if len(rows) > MAX_ROWS_LISTED else "")


def log_dropped(path: Path, what: str, dropped: int, total: int, limit_key: str, limit: int) -> None:
    """Log how many rows of a file were loaded, or how many of how many were too long."""
    # INFO, so only rank 0 prints it (the other ranks log warnings only).
    if dropped:
        logger.info(
            "%s: dropped %d of %d %s longer than %s=%d tokens", path, dropped, total, what, limit_key, limit
        )
    else:
        logger.info("%s: loaded %d %s", path, total, what)
