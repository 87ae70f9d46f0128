"""Turn GSM8K into the trainer's prompt files: ``train.parquet`` and ``test.parquet`` in verl's layout.

    python scripts/prepare_gsm8k.py                                  # datasets.load_dataset("openai/gsm8k", "main")
    python scripts/prepare_gsm8k.py --local-dir ~/gsm8k --out data/gsm8k   # no network

verl's flags (``examples/data_preprocess/gsm8k.py``) mean what they mean there: ``--local_save_dir`` and
its older ``--local_dir`` (underscore) name the output folder, as ``--out`` does; ``--local_dataset_path``
names a local copy of the input, as ``--local-dir`` (hyphen) does. An output folder that holds a raw
copy of GSM8K is refused (the two spellings of "local dir" are easy to mix up). ``--hdfs_dir`` is
refused: nothing is copied to HDFS here.

``--local-dir`` holds a copy of the data: the Hugging Face repository's Parquet files
(``main/train-00000-of-00001.parquet``, ``main/test-...``), or JSON lines with ``question`` and
``answer`` (``train.jsonl``, ``test.jsonl`` as in openai/grade-school-math). Files are looked for in
``<local-dir>/<subset>/`` if that folder exists, else in ``<local-dir>/``; a split's file name starts
with the split's name.

Each row becomes (as verl's ``examples/data_preprocess/gsm8k.py`` writes it)::

    prompt        [{"role": "user", "content": question + ' Let\'s think step by step and output the
                  final answer after "####".'}]
    data_source   "openai/gsm8k"           (ppo.rewards scores it with the GSM8K rule)
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": the number after the answer's "####", commas removed}
    extra_info    {"split", "index", "answer" (the full worked answer), "question" (as given)}

A row whose answer has no ``#### <number>`` line fails, naming the file and the row.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "openai/gsm8k"
"""``data_source`` of every row; ``ppo.rule_scoring.default_compute_score`` knows it."""
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
"""Appended to each question (verl's wording), so the policy learns the format the reward reads."""
DEFAULT_OUT = "data/gsm8k"
"""Where the files go by default; the GSM8K presets in configs/ read them from here."""
SPLITS = ("train", "test")

# The final line of a GSM8K answer: "#### 1,234" (a sign or decimals occur in some rows).
_FINAL_ANSWER = re.compile(r"####[ \t]*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")

SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        (
            "extra_info",
            pa.struct(
                [
                    ("split", pa.string()),
                    ("index", pa.int64()),
                    ("answer", pa.string()),
                    ("question", pa.string()),
                ]
            ),
        ),
    ]
)
"""Explicit, so every file has the same column types whatever its rows hold."""


class GSM8KError(ValueError):
    """The input is missing or malformed; the message names the file and the row."""


def extract_ground_truth(answer: str, where: str) -> str:
    """The number after the last ``####`` of a GSM8K answer, commas removed (``"1,000"`` -> ``"1000"``)."""
    matches = _FINAL_ANSWER.findall(answer)
    if not matches:
        last = answer.strip().splitlines()[-1] if answer.strip() else ""
        raise GSM8KError(f"{where}: the answer has no '#### <number>' line (its last line: {last!r:.80})")
    return matches[-1].replace(",", "")


def make_row(question: str, answer: str, split: str, index: int, where: str) -> dict[str, Any]:
    """One output row in verl's layout (see the module docstring)."""
    if not isinstance(question, str) or not question.strip():
        raise GSM8KError(f"{where}: 'question' must be a non-empty string, got {question!r:.80}")
    if not isinstance(answer, str):
        raise GSM8KError(f"{where}: 'answer' must be a string, got {type(answer).__name__}")
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": extract_ground_truth(answer, where)},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def convert(rows: Iterable[dict[str, Any]], split: str, source: str) -> list[dict[str, Any]]:
    """Rows with ``question`` and ``answer`` -> output rows; ``source`` names the input in errors."""
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise GSM8KError(
                f"{source}: row {i}: expected an object with 'question' and 'answer', got {row!r:.80}"
            )
        missing = [k for k in ("question", "answer") if k not in row]
        if missing:
            raise GSM8KError(f"{source}: row {i}: missing {', '.join(missing)}; it has {sorted(row)}")
        out.append(make_row(row["question"], row["answer"], split, i, f"{source}: row {i}"))
    if not out:
        raise GSM8KError(f"{source}: no rows")
    return out


def read_local(path: Path) -> list[dict[str, Any]]:
    """The rows of a Parquet or JSON-lines file; GSM8KError naming the file when it is neither, or a
    Parquet file lacks a column."""
    if path.suffix == ".parquet":
        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise GSM8KError(f"{path}: not a readable Parquet file ({reason})") from e
        missing = [c for c in ("question", "answer") if c not in table.column_names]
        if missing:
            raise GSM8KError(
                f"{path}: missing column {', '.join(map(repr, missing))}; it has {table.column_names}"
            )
        return table.to_pylist()
    rows = []
    try:
        with path.open(encoding="utf-8") as f:
            for i, line in enumerate(f):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise GSM8KError(f"{path}: line {i + 1} is not JSON: {e}") from e
    except UnicodeDecodeError as e:
        raise GSM8KError(f"{path}: not UTF-8 text, so not JSON lines ({e.reason} at byte {e.start})") from e
    return rows


def find_split_file(local_dir: Path, subset: str, split: str) -> Path:
    """The one file of ``split`` in ``local_dir/subset`` (or ``local_dir``): Parquet, else JSON lines."""
    folder = local_dir / subset if (local_dir / subset).is_dir() else local_dir
    for pattern in (f"{split}*.parquet", f"{split}*.jsonl", f"{split}*.json"):
        found = sorted(folder.glob(pattern))
        if len(found) > 1:
            raise GSM8KError(f"{folder}: several {split} files {[p.name for p in found]}; keep one")
        if found:
            return found[0]
    raise GSM8KError(f"{folder}: no {split}*.parquet or {split}*.jsonl file")


def load_hub(subset: str) -> dict[str, tuple[list[dict[str, Any]], str]]:
    """Both splits from the Hugging Face hub (needs the network and the ``datasets`` package); a
    GSM8KError saying to use ``--local-dir`` when either is missing."""
    offline = "without network, download a copy elsewhere and pass --local-dir (see --help)"
    try:
        import datasets  # imported here: only this path needs it, and it is slow to import
    except ImportError as e:
        raise GSM8KError(
            f"reading {DATA_SOURCE} from the hub needs the datasets package ({e}); {offline}"
        ) from e
    try:
        ds = datasets.load_dataset(DATA_SOURCE, subset)
    except Exception as e:  # offline, hub down, unknown subset: datasets and huggingface_hub raise many kinds
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise GSM8KError(
            f"could not load {DATA_SOURCE} ({subset}) from the Hugging Face hub ({type(e).__name__}: {reason}); "
            f"{offline}"
        ) from e
    return {split: (list(ds[split]), f"{DATA_SOURCE}[{subset}/{split}]") for split in SPLITS}


def write_parquet(rows: list[dict[str, Any]], path: Path) -> None:
    """Write rows with the fixed schema, atomically (a partial file never has the final name)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".parquet.tmp")
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), tmp)
    tmp.replace(path)


def raw_copy_in(folder: Path, subset: str) -> Path | None:
    """A file of a raw GSM8K copy (``question`` and ``answer``, as ``--local-dir`` reads) in ``folder``, or
    None: what must never be mistaken for the output folder."""
    for split in SPLITS:
        try:
            path = find_split_file(folder, subset, split)
        except GSM8KError:
            continue
        if path.suffix != ".parquet" or "question" in pq.read_schema(path).names:
            return path
    return None


def _path(text: str) -> Path:
    return Path(text).expanduser()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--local-dir",
        "--local_dataset_path",
        dest="local_dir",
        type=_path,
        default=None,
        help="input: a local copy (Parquet or jsonl); verl's --local_dataset_path",
    )
    parser.add_argument("--subset", default="main", help="GSM8K configuration: main or socratic")
    parser.add_argument(
        "--out",
        "--local_save_dir",
        "--local_dir",
        dest="out",
        type=_path,
        default=Path(DEFAULT_OUT),
        help="output folder; verl's --local_save_dir and --local_dir (with an underscore: the output)",
    )
    parser.add_argument("--hdfs_dir", default=None, help="verl's copy to HDFS: refused here")
    args = parser.parse_args(argv)
    if args.hdfs_dir is not None:
        print(
            f"error: --hdfs_dir {args.hdfs_dir}: nothing is copied to HDFS here; copy {args.out} yourself",
            file=sys.stderr,
        )
        return 2
    try:
        raw = raw_copy_in(args.out, args.subset) if args.out.is_dir() else None
    except (pa.ArrowException, OSError):
        raw = None  # unreadable: not a copy this script could read either
    if raw is not None:
        print(
            f"error: the output folder {args.out} holds a raw copy of GSM8K ({raw}): to read it, pass it with "
            f"--local-dir (hyphen; verl's --local_dataset_path); name the output folder with --out (verl's "
            f"--local_save_dir, or --local_dir with an underscore)",
            file=sys.stderr,
        )
        return 2
    try:
        if args.local_dir is not None:
            inputs = {}
            for split in SPLITS:
                path = find_split_file(args.local_dir, args.subset, split)
                inputs[split] = (read_local(path), str(path))
        else:
            inputs = load_hub(args.subset)
        outputs = {split: convert(rows, split, source) for split, (rows, source) in inputs.items()}
    except GSM8KError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # Write only once every split converted, so a bad row leaves no half-prepared folder behind.
    for split, rows in outputs.items():
        try:
            write_parquet(rows, args.out / f"{split}.parquet")
        except OSError as e:
            print(f"error: cannot write {args.out / f'{split}.parquet'}: {e.strerror or e}", file=sys.stderr)
            return 2
        print(f"{args.out / f'{split}.parquet'}: {len(rows)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
