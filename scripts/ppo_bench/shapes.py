"""The random models' shapes: a small Llama and Qwen2.5's (0.5B, 1.5B, 7B), with PPO's token ids. The
benchmarks build their models from them (``--model-config``), and ``scripts/make_shaped_model.py`` writes a
model folder of one of them.

    config = model_config("0.5b")     # a PretrainedConfig with PAD_ID, EOS_ID and dropout off
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import LlamaConfig, PretrainedConfig, Qwen2Config

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
