"""Build the tiny assets the CPU demo and the tests run on: tokenizer, models and the synthetic task.

    python scripts/make_tiny_assets.py --out assets --seed 0     # or: make assets
    python scripts/make_tiny_assets.py --out assets --seed 0 --teacher-only     # or: make teacher

Deterministic in the seed, no downloads, a few seconds. Writes::

    assets/tokenizer/       character-level tokenizer with a chat template (AutoTokenizer loads it)
    assets/base/            tiny Llama causal LM (hidden 128, 3 layers, 4 heads, ~0.8M params) + tokenizer
    assets/base_rm/         the same backbone with a 1-output sequence-classification head (reward model)
    assets/base_critic/     the same backbone with a 1-output token-classification head (critic)
    assets/base_teacher/    a larger tiny Llama (hidden 192, 4 layers, 6 heads, ~2.4M params), same tokenizer
    assets/data/train.parquet, val.parquet            RL prompts in verl's layout
    assets/data/sft_train.parquet, sft_val.parquet    prompt + answer demonstrations
    assets/data/pref_train.parquet, pref_val.parquet  prompt, chosen, rejected, mistake
    assets/data/sft_tools_train.parquet, sft_tools_val.parquet   the demonstrations, 40% calling a calculator
    assets/data/teacher_sft_train.parquet, teacher_sft_val.parquet   the same problems, every answer right

``--teacher-only`` writes only ``base_teacher/`` and the ``teacher_sft_*`` files (the tokenizer and every
other file as they are), for assets built before the teacher existed; give it the seed they were built
with, or the teacher learns from the student's validation problems.

``make assets`` then trains ``assets/sft`` and ``assets/rm`` on these files, fine-tunes ``assets/sft`` on
the tool-use demonstrations into ``assets/tools/sft`` (the start of ``configs/demo_cpu_tools.yaml``),
samples the offline groups of ``configs/demo_cpu_offline.yaml`` from the SFT model
(``assets/offline/train.parquet``, ``scripts/make_offline_data.py``), and trains ``assets/base_teacher``
on the clean demonstrations into ``assets/teacher``, the teacher that on-policy distillation distills into
the SFT model (``configs/sft_teacher_demo.yaml``; ``make teacher`` does only that).

The task (see docs/demo.md): two-digit addition, prompt ``[{"role": "user", "content": "23 +
48"}]``, answer in GSM8K form ``23 + 48 = 71\\n#### 71``. In the SFT training data 60% of the additions
that need a carry show the carry forgotten (the answer 10 too small), a systematic flaw that RL with the
rule reward then corrects; validation answers are always right, and so are all of the teacher's.
Validation problems are disjoint from training ones. ``make_task`` is the pure generator (tests import
this file by path).
"""

from __future__ import annotations

import argparse
import contextlib
import string
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import transformers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

DATA_SOURCE = "synthetic/arith"
"""``data_source`` of the task's rows; ``ppo.rewards`` scores it with the GSM8K rule."""
NUM_TRAIN = 4096
"""RL training prompts."""
NUM_VAL = 500
"""Validation problems (RL prompts, SFT and preference validation), disjoint from all training data."""
NUM_PREF_TRAIN = 4096
"""Preference pairs for reward-model training."""
CARRY_FLAW_FRACTION = 0.6
"""Share of the carry problems in the SFT training data whose demonstration forgets the carry."""
TOOL_FRACTION = 0.4
"""Share of the tool-use demonstrations (``sft_tools_*``) that call the calculator; the others are the
plain demonstrations with the task's flaw."""
MISTAKE_KINDS = ("slipped_carry", "wrong_final_line", "broken_format", "far_off")
"""Kinds of rejected answers in the preference data, mixed evenly."""

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
"""Ids 0..6: pad, bos, eos, unk, then the chat-role markers (each one token)."""
CHARACTERS = string.digits + string.ascii_letters + " " + string.punctuation + "\n"
"""The character vocabulary after the special tokens; anything else becomes ``<unk>``."""
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
"""``<s><|user|>23 + 48<|assistant|>`` for a prompt; an assistant turn ends with ``</s>``."""
MODEL_SHAPE = dict(
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=256,
)
"""The tiny Llama of docs/demo.md (813,696 parameters with the 103-token vocabulary)."""
TEACHER_SHAPE = dict(
    hidden_size=192,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=6,
    max_position_embeddings=MODEL_SHAPE["max_position_embeddings"],
    initializer_range=0.05,
)
"""The teacher's larger tiny Llama (2,400,576 parameters), same tokenizer and context as the student's.
Initialized with std 0.05 instead of Llama's 0.02: on clean data it then learns the units digit about 100
steps earlier (configs/sft_teacher_demo.yaml)."""
TEACHER_FILES = ("teacher_sft_train", "teacher_sft_val")
"""The data file stems ``--teacher-only`` writes."""
CARRY4_DIGITS = 4
"""The second task (``carry4/``): sums of two four-digit numbers, three places that can carry."""
CARRY4_DRAWS = 20_000
"""Problems drawn for it (repeats dropped): 500 for validation, the rest the SFT pool, 4096 of them the RL
prompts."""
CARRY4_FLAW_FRACTION = 0.5
"""Chance that its SFT demonstrations forget each carry (each place on its own): the answer is then
10, 100 or 1000 too small per forgotten carry."""
CARRY4_FILES = ("train", "val", "sft_train", "sft_val")
"""The data file stems of ``carry4/data``."""


# ----------------------------------------------------------------------------------------------------
# The synthetic task (pure)
# ----------------------------------------------------------------------------------------------------


def needs_carry(a: int, b: int) -> bool:
    """Whether ``a + b`` carries from the units into the tens."""
    return a % 10 + b % 10 >= 10


def worked_answer(a: int, b: int, result: int) -> str:
    """The GSM8K-style answer showing ``result`` (right or not): ``a + b = result\\n#### result``."""
    return f"{a} + {b} = {result}\n#### {result}"


def tool_answer(a: int, b: int) -> str:
    """The answer that calls the calculator of ``configs/calculator.py``: the model writes
    ``<calc>a+b</calc>``, the environment's observation ``<result>s</result>`` follows, then ``#### s``."""
    return f"<calc>{a}+{b}</calc><result>{a + b}</result>\n#### {a + b}"


def prompt_messages(a: int, b: int) -> list[dict[str, str]]:
    """The chat prompt of one problem."""
    return [{"role": "user", "content": f"{a} + {b}"}]


def split_problems(seed: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """All 8100 ordered pairs of two-digit numbers, shuffled, as (training pool of 7600, validation 500)."""
    problems = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    order = np.random.default_rng([seed, 0]).permutation(len(problems))
    shuffled = [problems[i] for i in order]
    return shuffled[NUM_VAL:], shuffled[:NUM_VAL]


def prompt_rows(problems: list[tuple[int, int]], split: str) -> list[dict[str, Any]]:
    """RL prompt rows in verl's layout."""
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": prompt_messages(a, b),
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": split, "index": i},
        }
        for i, (a, b) in enumerate(problems)
    ]


def sft_rows(problems: list[tuple[int, int]], flaw_fraction: float, rng: np.random.Generator) -> list[dict]:
    """Demonstrations; exactly ``round(flaw_fraction * carries)`` of the carry problems (picked at random)
    show the carry forgotten, i.e. an answer 10 too small."""
    carries = [i for i, (a, b) in enumerate(problems) if needs_carry(a, b)]
    num_flawed = round(flaw_fraction * len(carries))
    flawed = {carries[i] for i in rng.permutation(len(carries))[:num_flawed]}
    rows = []
    for i, (a, b) in enumerate(problems):
        shown = a + b - 10 if i in flawed else a + b
        rows.append(
            {
                "prompt": prompt_messages(a, b),
                "answer": worked_answer(a, b, shown),
                "ground_truth": str(a + b),
                "flawed": i in flawed,
                "data_source": DATA_SOURCE,
            }
        )
    return rows


def sft_tool_rows(rows: list[dict], tool_fraction: float, rng: np.random.Generator) -> list[dict]:
    """``rows`` (from ``sft_rows``) in which exactly ``round(tool_fraction * len(rows))``, picked at random,
    call the calculator (``tool_answer``, never flawed: the tool adds right); the others keep their
    demonstration, forgotten carries included. Column ``tool`` marks the calls."""
    chosen = set(rng.permutation(len(rows))[: round(tool_fraction * len(rows))].tolist())
    out = []
    for i, row in enumerate(rows):
        if i in chosen:
            a, b = (int(x) for x in row["prompt"][0]["content"].split(" + "))
            row = {**row, "answer": tool_answer(a, b), "flawed": False}
        out.append({**row, "tool": i in chosen})
    return out


def rejected_answer(a: int, b: int, kind: str, rng: np.random.Generator) -> str:
    """A wrong answer of the given mistake kind.

    ``slipped_carry``: off by ten (carry forgotten, or a spurious one where there is no carry);
    ``wrong_final_line``: the worked line is right but the ``####`` line differs by 1-9;
    ``broken_format``: the right sum but no readable ``#### <number>`` line;
    ``far_off``: a random number more than 10 away from the sum.
    """
    r = a + b
    if kind == "slipped_carry":
        wrong = r - 10 if needs_carry(a, b) else r + 10
        return worked_answer(a, b, wrong)
    if kind == "wrong_final_line":
        delta = int(rng.integers(1, 10)) * (1 if rng.random() < 0.5 else -1)
        return f"{a} + {b} = {r}\n#### {r + delta}"
    if kind == "broken_format":
        variants = (
            f"{a} + {b} = {r}",
            f"{a} + {b} = {r}\n### {r}",
            f"{a} + {b} = {r}\n{r} ####",
            f"{a} + {b} =\n#### ",
        )
        return variants[int(rng.integers(len(variants)))]
    if kind == "far_off":
        wrong = r
        while abs(wrong - r) <= 10:
            wrong = int(rng.integers(20, 199))
        return worked_answer(a, b, wrong)
    raise ValueError(f"unknown mistake kind {kind!r}; known: {MISTAKE_KINDS}")


def preference_rows(problems: list[tuple[int, int]], rng: np.random.Generator) -> list[dict[str, Any]]:
    """One pair per problem: the right worked answer against a mistake; kinds evenly mixed at random."""
    kinds = [MISTAKE_KINDS[i % len(MISTAKE_KINDS)] for i in range(len(problems))]
    kinds = [kinds[i] for i in rng.permutation(len(kinds))]
    return [
        {
            "prompt": prompt_messages(a, b),
            "chosen": worked_answer(a, b, a + b),
            "rejected": rejected_answer(a, b, kind, rng),
            "mistake": kind,
            "ground_truth": str(a + b),
            "data_source": DATA_SOURCE,
        }
        for (a, b), kind in zip(problems, kinds, strict=True)
    ]


def make_task(seed: int) -> dict[str, list[dict[str, Any]]]:
    """Every data file's rows, keyed by file stem (``train``, ``val``, ``sft_train``, ``sft_val``,
    ``pref_train``, ``pref_val``, ``sft_tools_train``, ``sft_tools_val``, ``teacher_sft_train``,
    ``teacher_sft_val``). Pure and deterministic in ``seed``."""
    pool, val = split_problems(seed)
    pref_order = np.random.default_rng([seed, 1]).permutation(len(pool))[:NUM_PREF_TRAIN]
    sft_train = sft_rows(pool, CARRY_FLAW_FRACTION, np.random.default_rng([seed, 2]))
    sft_val = sft_rows(val, 0.0, np.random.default_rng([seed, 3]))
    return {
        "train": prompt_rows(pool[:NUM_TRAIN], "train"),
        "val": prompt_rows(val, "val"),
        "sft_train": sft_train,
        "sft_val": sft_val,
        "pref_train": preference_rows([pool[i] for i in pref_order], np.random.default_rng([seed, 4])),
        "pref_val": preference_rows(val, np.random.default_rng([seed, 5])),
        "sft_tools_train": sft_tool_rows(sft_train, TOOL_FRACTION, np.random.default_rng([seed, 6])),
        "sft_tools_val": sft_tool_rows(sft_val, TOOL_FRACTION, np.random.default_rng([seed, 7])),
        # The teacher's demonstrations: the student's problems with every answer right.
        "teacher_sft_train": sft_rows(pool, 0.0, np.random.default_rng([seed, 8])),
        "teacher_sft_val": sft_val,
    }


def carries(a: int, b: int, digits: int = CARRY4_DIGITS) -> list[bool]:
    """Whether ``a + b`` carries out of each of its ``digits - 1`` lower places (units first)."""
    out, carry = [], False
    for place in range(digits - 1):
        carry = (a // 10**place) % 10 + (b // 10**place) % 10 + carry >= 10
        out.append(carry)
    return out


def carry4_problems(seed: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``CARRY4_DRAWS`` random pairs of four-digit numbers without repeats, in draw order, as (SFT pool,
    500 validation problems)."""
    rng = np.random.default_rng([seed, 10])
    low, high = 10 ** (CARRY4_DIGITS - 1), 10**CARRY4_DIGITS
    first = rng.integers(low, high, CARRY4_DRAWS).tolist()
    second = rng.integers(low, high, CARRY4_DRAWS).tolist()
    unique = list(dict.fromkeys(zip(first, second, strict=True)))
    return unique[NUM_VAL:], unique[:NUM_VAL]


def carry4_sft_rows(
    problems: list[tuple[int, int]], flaw_fraction: float, rng: np.random.Generator
) -> list[dict]:
    """Demonstrations of the second task: each carry of each problem is forgotten with chance
    ``flaw_fraction`` (one draw per carrying place, units first), which makes the answer ``10**(place + 1)``
    too small; column ``forgotten`` counts them."""
    rows = []
    for a, b in problems:
        shown, forgotten = a + b, 0
        for place, carried in enumerate(carries(a, b)):
            if carried and rng.random() < flaw_fraction:
                shown -= 10 ** (place + 1)
                forgotten += 1
        rows.append(
            {
                "prompt": prompt_messages(a, b),
                "answer": worked_answer(a, b, shown),
                "ground_truth": str(a + b),
                "forgotten": forgotten,
                "data_source": DATA_SOURCE,
            }
        )
    return rows


def make_carry4_task(seed: int) -> dict[str, list[dict[str, Any]]]:
    """The second task's rows (``CARRY4_FILES``), pure and deterministic in ``seed``: four-digit sums,
    SFT demonstrations that forget half the carries, RL prompts and validation (always right)."""
    pool, val = carry4_problems(seed)
    return {
        "train": prompt_rows(pool[:NUM_TRAIN], "train"),
        "val": prompt_rows(val, "val"),
        "sft_train": carry4_sft_rows(pool, CARRY4_FLAW_FRACTION, np.random.default_rng([seed, 11])),
        "sft_val": carry4_sft_rows(val, 0.0, np.random.default_rng([seed, 12])),
    }


def write_task(out_dir: Path, seed: int, names: tuple[str, ...] | None = None) -> dict[str, int]:
    """Write the task's Parquet files under ``out_dir`` (those of ``names``, default all); returns rows per
    file stem."""
    out_dir.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for name, rows in make_task(seed).items():
        if names is not None and name not in names:
            continue
        pq.write_table(pa.Table.from_pylist(rows), out_dir / f"{name}.parquet")
        sizes[name] = len(rows)
    return sizes


# ----------------------------------------------------------------------------------------------------
# Tokenizer and models
# ----------------------------------------------------------------------------------------------------


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: special tokens, then one token per character of ``CHARACTERS``.

    Plain text gets a BOS (like Llama); the chat template writes its own BOS, so rendered chats are
    tokenized with ``add_special_tokens=False``. Decoding concatenates characters.
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(CHARACTERS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
        model_max_length=MODEL_SHAPE["max_position_embeddings"],
        chat_template=CHAT_TEMPLATE,
    )


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' "newly initialized weights" (the point here) and its progress bars, then
    restore the caller's settings."""
    verbosity = transformers.logging.get_verbosity()
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.utils.logging.enable_progress_bar()


def llama_config(tokenizer: PreTrainedTokenizerFast, shape: dict[str, Any]) -> LlamaConfig:
    """A Llama of ``shape`` (``MODEL_SHAPE``, ``TEACHER_SHAPE``) over ``tokenizer``'s vocabulary."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **shape,
    )


def build_models(out: Path, tokenizer: PreTrainedTokenizerFast, seed: int) -> int:
    """Save the random-init causal LM to ``out/base`` and its reward-model and critic variants next to it
    (same backbone, fresh 1-output heads). Returns the causal LM's parameter count."""
    config = llama_config(tokenizer, MODEL_SHAPE)
    with quiet_transformers():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        model.save_pretrained(out / "base")
        tokenizer.save_pretrained(out / "base")
        torch.manual_seed(seed + 1)
        rm = AutoModelForSequenceClassification.from_pretrained(out / "base", num_labels=1)
        rm.config.pad_token_id = tokenizer.pad_token_id  # the head reads the last non-pad token
        rm.save_pretrained(out / "base_rm")
        tokenizer.save_pretrained(out / "base_rm")
        torch.manual_seed(seed + 2)
        critic = AutoModelForTokenClassification.from_pretrained(out / "base", num_labels=1)
        critic.save_pretrained(out / "base_critic")
        tokenizer.save_pretrained(out / "base_critic")
    return sum(p.numel() for p in model.parameters())


def build_teacher(out: Path, tokenizer: PreTrainedTokenizerFast, seed: int) -> int:
    """Save the teacher's random-init causal LM (``TEACHER_SHAPE``) and ``tokenizer`` to
    ``out/base_teacher``. Returns its parameter count."""
    with quiet_transformers():
        torch.manual_seed(seed + 3)  # seed .. seed + 2 initialize the student, its reward model and critic
        model = LlamaForCausalLM(llama_config(tokenizer, TEACHER_SHAPE))
        model.save_pretrained(out / "base_teacher")
        tokenizer.save_pretrained(out / "base_teacher")
    return sum(p.numel() for p in model.parameters())


def write_carry4_task(out: Path, seed: int) -> dict[str, int]:
    """Write the second task's files (``make_carry4_task``) to ``out/carry4/data``; returns each file's rows
    under ``carry4/<stem>``."""
    (out / "carry4" / "data").mkdir(parents=True, exist_ok=True)
    sizes = {}
    for name, rows in make_carry4_task(seed).items():
        pq.write_table(pa.Table.from_pylist(rows), out / "carry4" / "data" / f"{name}.parquet")
        sizes[f"carry4/{name}"] = len(rows)
    return sizes


def build_assets(out: Path, seed: int) -> dict[str, Any]:
    """Build everything under ``out``; returns a summary (sizes, parameter counts, token counts)."""
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(out / "tokenizer")
    num_params = build_models(out, tokenizer, seed)
    num_teacher_params = build_teacher(out, tokenizer, seed)
    sizes = write_task(out / "data", seed) | write_carry4_task(out, seed)
    prompt = tokenizer.apply_chat_template(
        prompt_messages(23, 48), add_generation_prompt=True, tokenize=False
    )
    return {
        "vocab_size": len(tokenizer),
        "num_params": num_params,
        "num_teacher_params": num_teacher_params,
        "rows": sizes,
        "example_prompt": prompt,
        "prompt_tokens": len(tokenizer(prompt, add_special_tokens=False)["input_ids"]),
        "response_tokens": len(tokenizer(worked_answer(23, 48, 71), add_special_tokens=False)["input_ids"])
        + 1,
    }


def main(argv: list[str] | None = None) -> None:
    """Command line: ``--out DIR --seed N [--teacher-only | --carry4-only]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("assets"), help="output folder (default: assets)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and the weights")
    parser.add_argument(
        "--teacher-only",
        action="store_true",
        help="write only base_teacher/ and the teacher_sft_* data (assets built with the same --seed)",
    )
    parser.add_argument(
        "--carry4-only",
        action="store_true",
        help="write only the four-digit task's carry4/data (assets built with the same --seed)",
    )
    args = parser.parse_args(argv)
    if args.teacher_only and args.carry4_only:
        parser.error("--teacher-only and --carry4-only: give one")
    t0 = time.perf_counter()
    out = args.out
    if args.carry4_only:
        rows = write_carry4_task(out, args.seed)
    elif args.teacher_only:
        num_teacher_params = build_teacher(out, build_tokenizer(), args.seed)
        rows = write_task(out / "data", args.seed, TEACHER_FILES)
    else:
        s = build_assets(out, args.seed)
        num_teacher_params, rows = s["num_teacher_params"], s["rows"]
        print(f"tokenizer  {out / 'tokenizer'}  ({s['vocab_size']} tokens, character level)")
        print(
            f"models     {out / 'base'}, {out / 'base_rm'}, {out / 'base_critic'}  ({s['num_params']:,} params)"
        )
    if not args.carry4_only:
        print(f"teacher    {out / 'base_teacher'}  ({num_teacher_params:,} params)")
    for name, n in rows.items():
        folder = out / name.rpartition("/")[0] / "data" if "/" in name else out / "data"
        print(f"data       {folder / name.rpartition('/')[2]}.parquet  ({n} rows)")
    if not (args.teacher_only or args.carry4_only):
        print(
            f"example    prompt {s['example_prompt']!r} = {s['prompt_tokens']} tokens, "
            f"response '23 + 48 = 71\\n#### 71' + eos = {s['response_tokens']} tokens"
        )
    print(f"done in {time.perf_counter() - t0:.1f} s (seed {args.seed})")


if __name__ == "__main__":
    main()
