"""Write a model folder with a real model's shapes and random weights, for GPU checks without a download.

The architecture is one of ``MODEL_CONFIGS`` (``tiny``, ``0.5b``, ``1.5b``, ``7b``: the Qwen2.5 shapes;
``ppo_bench.shapes``, from which the benchmarks build their random models too, their ``--model-config``), the
special token ids and the tokenizer from ``--tokenizer`` (the tiny character tokenizer of
make_tiny_assets.py, so the synthetic task's Parquet files work as data). Weights are initialized on
``--device`` (a 7B model initializes in seconds on a GPU, minutes on a CPU) in ``--dtype`` and saved with
``save_pretrained`` (safetensors), tokenizer beside them: a folder that ``model.path`` (and
``critic.model_path``) load like a downloaded checkpoint. Throughput and memory measured on it are those
of the real model; what it learns is not.

    python scripts/make_shaped_model.py --shape 0.5b --tokenizer assets/tokenizer --out /tmp/qwen05b
    python scripts/make_shaped_model.py --shape 7b --tokenizer assets/tokenizer --out /tmp/qwen7b \\
        --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from ppo_bench.shapes import MODEL_CONFIGS, model_config
from transformers import AutoModelForCausalLM, AutoTokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_shaped_model(shape: str, tokenizer: Path, out: Path, *, dtype: str, device: str, seed: int) -> Path:
    """Build ``shape`` with random weights and save it with ``tokenizer`` into ``out``; returns ``out``."""
    tok = AutoTokenizer.from_pretrained(tokenizer)
    config = model_config(shape)
    config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else config.pad_token_id
    config.eos_token_id = tok.eos_token_id if tok.eos_token_id is not None else config.eos_token_id
    if len(tok) > config.vocab_size:
        raise SystemExit(
            f"--tokenizer has {len(tok)} tokens, more than the {shape} model's {config.vocab_size}"
        )
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", required=True, choices=list(MODEL_CONFIGS))
    parser.add_argument("--tokenizer", type=Path, required=True, help="a tokenizer folder")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES), help="dtype of the saved weights")
    parser.add_argument("--device", default="cpu", help="where the weights are initialized")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = make_shaped_model(
        args.shape, args.tokenizer, args.out, dtype=args.dtype, device=args.device, seed=args.seed
    )
    print(f"wrote {args.shape}-shaped model ({args.dtype}, random weights) to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
