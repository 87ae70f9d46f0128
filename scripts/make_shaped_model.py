"""Write a model folder with a real model's shapes and random weights, for GPU checks without a download.

The architecture is one of ``MODEL_CONFIGS`` (``tiny``, ``0.5b``, ``1.5b``, ``7b``: the Qwen2.5 shapes;
the benchmarks in scripts/bench/ build their random models from them too, their ``--model-config``), the
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
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PretrainedConfig, Qwen2Config

PAD_ID, EOS_ID = 0, 2
"""Token ids of the random models: prompts draw from ids >= 3."""


def _qwen2_5(
    *, hidden: int, mlp: int, layers: int, heads: int, kv_heads: int, vocab: int, tied: bool
) -> PretrainedConfig:
    """A Qwen2.5 model's architecture (its rotary base, norm epsilon and context length)."""
    return Qwen2Config(
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
    )


MODEL_CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    # A model of the CPU cost measurements in docs/platform.md: hidden 256, 4 layers, vocab 4096.
    "tiny": lambda: LlamaConfig(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=4096,
        max_position_embeddings=4096,
    ),
    # Qwen2.5-0.5B's shapes (494M parameters, tied embeddings).
    "0.5b": lambda: _qwen2_5(hidden=896, mlp=4864, layers=24, heads=14, kv_heads=2, vocab=151936, tied=True),
    # Qwen2.5-1.5B's shapes (1.54B parameters, tied embeddings).
    "1.5b": lambda: _qwen2_5(hidden=1536, mlp=8960, layers=28, heads=12, kv_heads=2, vocab=151936, tied=True),
    # Qwen2.5-7B's shapes (7.6B parameters, untied embeddings).
    "7b": lambda: _qwen2_5(hidden=3584, mlp=18944, layers=28, heads=28, kv_heads=4, vocab=152064, tied=False),
}


def model_config(name: str) -> PretrainedConfig:
    """The config of ``--model-config`` with PPO's token ids and dropout off."""
    if name not in MODEL_CONFIGS:
        raise SystemExit(f"--model-config must be one of {', '.join(MODEL_CONFIGS)}, got {name!r}")
    config = MODEL_CONFIGS[name]()
    config.pad_token_id, config.eos_token_id, config.bos_token_id = PAD_ID, EOS_ID, 1
    return config


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
