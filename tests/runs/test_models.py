"""Tests of ppo.model_loading and ppo.models: loading, packed forwards, FSDP2 sharding, generation and
export.

Tiny Llama models are built from a config, saved with ``save_pretrained`` and loaded back through the
real ``from_pretrained`` path (no hub). The sharded checks run this file as a gloo worker under
``torch.distributed.run`` (2 ranks; 1 rank in-process; see ``_worker`` at the bottom) and compare every sharded
result with an unsharded copy of the same model on the same global batch::

    pytest tests/runs/test_models.py            # all, about 40 s on 2 cores
    pytest tests/runs/test_models.py -m "not slow"
"""

from __future__ import annotations

import contextlib
import json
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from tokenizers import Tokenizer, models, pre_tokenizers
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ppo.attention import PACKED_ATTENTION, resolve_attn_implementation, varlen_sdpa_attention
from ppo.config import FSDPConfig, MixedPrecisionConfig
from ppo.input_paths import ModelPathError
from ppo.model_loading import load_causal_lm, load_critic, load_reward_model, load_tokenizer
from ppo.models import (
    causal_lm_hidden,
    causal_lm_logits,
    count_parameters,
    critic_values,
    enable_gradient_checkpointing,
    lm_head_weight,
    reward_scores,
    save_hf,
)
from ppo.sharding import (
    _no_op_hook,
    decoder_layers,
    fsdp_modules,
    full_state_dict,
    gathered_for_generation,
    shard_model,
)
from tests.helpers import (
    GRAD_RTOL,
    VOCAB,
    Checks,
    assert_check,
    base_args,
    full_tensor,
    grad_rel_diff,
    max_diff,
    read_results,
    rel_diff,
    run,
    tiny_config,
    train,
    worker_results,
)

EOS = 2  # tiny_config's eos id


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer over ``w0 .. w124`` plus unk/bos/eos, with no pad token."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": EOS, **{f"w{i}": i + 3 for i in range(VOCAB - 3)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def save_tiny(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a random tiny causal LM and the tokenizer to ``path``."""
    torch.manual_seed(seed)
    LlamaForCausalLM(tiny_config(**overrides)).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def random_sequences(lengths: list[int], seed: int) -> list[torch.Tensor]:
    """Token ids ``[len]`` per sequence, avoiding the special ids 0-2."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen) for n in lengths]


def pack(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``input_ids [T]``, ``position_ids [T]`` restarting at 0 per sequence, ``cu_seqlens [B+1]``."""
    input_ids = torch.cat(seqs)
    position_ids = torch.cat([torch.arange(len(s)) for s in seqs])
    cu_seqlens = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    return input_ids, position_ids, cu_seqlens


def pad_right(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids [B, T_max]`` (pad id 0) and ``attention_mask [B, T_max]``."""
    t_max = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), t_max, dtype=torch.long)
    mask = torch.zeros(len(seqs), t_max, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
    return ids, mask


def packed_nll_sum(logits: torch.Tensor, input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Sum of next-token NLL within each packed sequence (the last token of each predicts nothing)."""
    logprobs = torch.log_softmax(logits.float()[:-1], dim=-1)
    nll = -logprobs.gather(-1, input_ids[1:, None])[:, 0]  # [T-1]
    valid = torch.ones_like(nll, dtype=torch.bool)
    valid[cu_seqlens[1:-1] - 1] = False  # the pair (last of seq i, first of seq i+1) is not a target
    return nll[valid].sum()


# Tiny matmuls gain nothing from threads, and on a shared 2-core machine two OpenMP threads that
# spin-wait for each other made this file ~10x slower (a 1-thread torchrun worker was not).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny_llama"))


# ----------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------


def test_load_tokenizer_uses_eos_as_pad(tiny_dir: Path) -> None:
    tok = load_tokenizer(str(tiny_dir))
    assert tok.pad_token == "</s>" and tok.pad_token_id == EOS
    assert tok("w0 w5")["input_ids"] == [3, 8]


def test_load_causal_lm_from_saved_folder(tiny_dir: Path) -> None:
    model = load_causal_lm(str(tiny_dir), dtype="bfloat16")
    assert isinstance(model, LlamaForCausalLM)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.config._attn_implementation == PACKED_ATTENTION  # auto on CPU
    reference = AutoModelForCausalLM.from_pretrained(tiny_dir)
    fp32 = load_causal_lm(str(tiny_dir))
    for (name, a), (_, b) in zip(fp32.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_dropout_is_disabled(tmp_path: Path) -> None:
    save_tiny(tmp_path, attention_dropout=0.3)
    assert load_causal_lm(str(tmp_path)).config.attention_dropout == 0.0
    assert load_critic(str(tmp_path)).config.classifier_dropout == 0.0


def test_override_config_sets_fields_before_the_weights_load(tmp_path: Path) -> None:
    """verl's DAPO override (``max_position_embeddings``) on a Qwen2 folder the test saved: the loaded
    model's config has it, and the weights are the saved ones."""
    torch.manual_seed(0)
    Qwen2ForCausalLM(tiny_config(Qwen2Config)).save_pretrained(tmp_path)
    model = load_causal_lm(str(tmp_path), override_config={"max_position_embeddings": 32768})
    assert model.config.max_position_embeddings == 32768
    saved = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert saved.config.max_position_embeddings == 128
    for (name, a), (_, b) in zip(model.named_parameters(), saved.named_parameters(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.slow
def test_verls_override_config_key_on_the_trainers_command_line(
    tiny_assets: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """verl's DAPO line (``+actor_rollout_ref.model.override_config.max_position_embeddings``) on
    ``train_ppo``: the exported model carries the field; a misspelt field stops the run with one line."""
    key = "+actor_rollout_ref.model.override_config"
    bad = base_args(tiny_assets, tmp_path / "bad", steps=1) + [f"{key}.max_position_embedingz=512"]
    assert run(bad) == 2
    assert (
        f"model.override_config.max_position_embedingz: the model config (LlamaConfig at {tiny_assets / 'base'}) "
        "has no such field; did you mean model.override_config.max_position_embeddings?"
    ) in caplog.text
    out = tmp_path / "good"
    train(
        tiny_assets,
        out,
        f"{key}.max_position_embeddings=512",
        "trainer.val_before_train=false",
        "trainer.save_hf_on_end=true",
        steps=1,
    )
    assert json.loads((tiny_assets / "base" / "config.json").read_text())["max_position_embeddings"] == 256
    assert json.loads((out / "hf" / "config.json").read_text())["max_position_embeddings"] == 512
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["model"]["override_config"] == {"max_position_embeddings": 512}


def test_dropout_set_by_override_config_takes_effect(tmp_path: Path) -> None:
    """Loading turns dropout off unless ``override_config`` sets it, which verl's actor would train with:
    training-mode forwards then drop attention probabilities (another seed, other logits); eval-mode ones
    equal those of a plain load. A critic's head dropout is set the same way."""
    save_tiny(tmp_path, attention_dropout=0.3)
    (ids,) = random_sequences([12], seed=3)
    pos = torch.arange(12)
    plain = load_causal_lm(str(tmp_path)).train()
    dropped = load_causal_lm(str(tmp_path), override_config={"attention_dropout": 0.5}).train()
    assert (plain.config.attention_dropout, dropped.config.attention_dropout) == (0.0, 0.5)

    def logits(model: nn.Module, seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        return causal_lm_logits(model, ids, pos).detach()

    assert torch.equal(logits(plain, 1), logits(plain, 2))  # no dropout: the seed changes nothing
    assert torch.equal(logits(dropped, 1), logits(dropped, 1))
    assert max_diff(logits(dropped, 1), logits(dropped, 2)) > 1e-2
    assert torch.equal(logits(dropped.eval(), 1), logits(plain.eval(), 2))
    critic = load_critic(str(tmp_path), override_config={"classifier_dropout": 0.2})
    assert critic.config.classifier_dropout == 0.2 and critic.dropout.p == 0.2


@pytest.mark.parametrize("loader,key", [(load_causal_lm, "model.path"), (load_critic, "critic.model_path")])
def test_missing_folder_names_path_and_key(
    tmp_path: Path, loader: Callable[..., nn.Module], key: str
) -> None:
    missing = str(tmp_path / "no_such_model")
    with pytest.raises(FileNotFoundError) as err:
        loader(missing)
    assert isinstance(err.value, ModelPathError)
    assert missing in str(err.value) and key in str(err.value)
    with pytest.raises(ModelPathError, match="model.tokenizer_path"):
        load_tokenizer("./no_such_tokenizer")


def test_resolve_attn_implementation() -> None:
    assert resolve_attn_implementation("auto", "cpu") == PACKED_ATTENTION
    assert resolve_attn_implementation("sdpa", "cpu") == "sdpa"
    assert resolve_attn_implementation("eager", "cpu") == "eager"
    if not _has_flash_attn():
        with pytest.raises(ImportError, match="flash-attn"):
            resolve_attn_implementation("flash_attention_2", "cuda")
    else:
        with pytest.raises(ValueError, match="CUDA"):
            resolve_attn_implementation("flash_attention_2", "cpu")


def _has_flash_attn() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def test_critic_fresh_head_is_zero_and_trained_head_survives_reload(tiny_dir: Path, tmp_path: Path) -> None:
    critic = load_critic(str(tiny_dir))
    assert critic.score.out_features == 1
    assert all(bool((p == 0).all()) for p in critic.score.parameters())
    input_ids, position_ids, _ = pack(random_sequences([4, 6], seed=1))
    values = critic_values(critic, input_ids, position_ids)
    assert values.shape == (10,) and values.dtype == torch.float32
    assert bool((values == 0).all())  # zero head: every value starts at 0

    # The backbone came from the causal LM; a trained head must not be re-zeroed on reload.
    lm = load_causal_lm(str(tiny_dir))
    assert torch.equal(critic.model.embed_tokens.weight, lm.model.embed_tokens.weight)
    with torch.no_grad():
        critic.score.weight.normal_()
        critic.score.bias.fill_(0.5)
    critic.save_pretrained(tmp_path)
    reloaded = load_critic(str(tmp_path))
    assert torch.equal(reloaded.score.weight, critic.score.weight)
    assert torch.allclose(
        critic_values(reloaded, input_ids, position_ids), critic_values(critic, input_ids, position_ids)
    )


def test_reward_model_save_and_reload(tiny_dir: Path, tmp_path: Path) -> None:
    reward_model = load_reward_model(str(tiny_dir))
    assert reward_model.score.out_features == 1
    input_ids, position_ids, cu_seqlens = pack(random_sequences([3, 5, 2], seed=2))
    scores = reward_scores(reward_model, input_ids, position_ids, cu_seqlens)
    assert scores.shape == (3,) and scores.dtype == torch.float32
    save_hf(reward_model, load_tokenizer(str(tiny_dir)), str(tmp_path), is_main=True)
    # The attention implementation is a runtime choice that transformers does not serialize: the folder
    # loads anywhere, with transformers' default (sdpa), without ppo's registration.
    assert reward_model.config._attn_implementation == PACKED_ATTENTION
    assert PACKED_ATTENTION not in (tmp_path / "config.json").read_text()
    reloaded = load_reward_model(str(tmp_path))
    # Equal weights, but a freshly loaded tensor may take another matmul path: 1-ulp differences.
    torch.testing.assert_close(
        reward_scores(reloaded, input_ids, position_ids, cu_seqlens), scores, atol=1e-6, rtol=0
    )
    assert all(
        torch.equal(p, q) for p, q in zip(reloaded.parameters(), reward_model.parameters(), strict=True)
    )
    with pytest.raises(ValueError, match="cu_seqlens"):
        reward_scores(reward_model, input_ids, position_ids, torch.tensor([0, 3, 9]))


# ----------------------------------------------------------------------------------------------------
# Packed forwards against padded ones
# ----------------------------------------------------------------------------------------------------


LENGTHS = [5, 9, 3]


@contextlib.contextmanager
def recording_sdpa_queries() -> Iterator[list[int]]:
    """Query lengths of every ``scaled_dot_product_attention`` call inside (all layers)."""
    original = torch.nn.functional.scaled_dot_product_attention
    lengths: list[int] = []

    def recorded(query: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        lengths.append(query.shape[-2])
        return original(query, *args, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = recorded
    try:
        yield lengths
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


@pytest.mark.parametrize("attn", [PACKED_ATTENTION, "sdpa", "eager"])
def test_packed_logits_equal_padded(tiny_dir: Path, attn: str) -> None:
    model = load_causal_lm(str(tiny_dir), attn_implementation=attn)
    seqs = random_sequences(LENGTHS, seed=3)
    input_ids, position_ids, cu_seqlens = pack(seqs)
    with torch.no_grad(), recording_sdpa_queries() as query_lengths:
        packed = causal_lm_logits(model, input_ids, position_ids)  # [17, V]
    # Per packed sequence (sum l_i^2 work) with PACKED_ATTENTION; one dense T x T call per layer with
    # sdpa; none with eager. (The tiny model has grouped-query attention: 4 heads over 2.)
    expected_lengths = {PACKED_ATTENTION: LENGTHS, "sdpa": [sum(LENGTHS)], "eager": []}[attn]
    assert query_lengths == expected_lengths * 2, query_lengths  # 2 layers
    with torch.no_grad():
        ids, mask = pad_right(seqs)
        padded = model(input_ids=ids, attention_mask=mask).logits  # [3, 9, V]
        hidden = causal_lm_hidden(model, input_ids, position_ids)
        from_hidden = hidden @ lm_head_weight(model).T
        # Control: the same tokens packed with one running position range attend across sequences.
        unrestarted = causal_lm_logits(model, input_ids, torch.arange(len(input_ids)))
    assert packed.shape == (sum(LENGTHS), VOCAB) and hidden.shape == (sum(LENGTHS), 64)
    for i, n in enumerate(LENGTHS):
        torch.testing.assert_close(
            packed[cu_seqlens[i] : cu_seqlens[i + 1]], padded[i, :n], atol=1e-5, rtol=0
        )
    torch.testing.assert_close(from_hidden, packed, atol=1e-5, rtol=0)
    assert (unrestarted[LENGTHS[0] :] - packed[LENGTHS[0] :]).abs().max() > 1e-3


def test_packed_critic_values_and_reward_scores_equal_padded(tiny_dir: Path) -> None:
    critic = load_critic(str(tiny_dir))
    reward_model = load_reward_model(str(tiny_dir))
    with torch.no_grad():
        critic.score.weight.normal_()  # a zero head would make every comparison trivially equal
        critic.score.bias.fill_(0.1)
    seqs = random_sequences(LENGTHS, seed=4)
    input_ids, position_ids, cu_seqlens = pack(seqs)
    ids, mask = pad_right(seqs)
    with torch.no_grad():
        values = critic_values(critic, input_ids, position_ids)
        padded_values = critic(input_ids=ids, attention_mask=mask).logits[..., 0]  # [3, 9]
        scores = reward_scores(reward_model, input_ids, position_ids, cu_seqlens)
        # One unpadded sequence per call: HF's own pooling reads its last token.
        single = torch.stack([reward_model(input_ids=s[None]).logits[0, 0] for s in seqs])
    for i, n in enumerate(LENGTHS):
        torch.testing.assert_close(
            values[cu_seqlens[i] : cu_seqlens[i + 1]], padded_values[i, :n], atol=1e-5, rtol=0
        )
    torch.testing.assert_close(scores, single, atol=1e-5, rtol=0)
    assert scores.std() > 0
    assert critic.config._attn_implementation == reward_model.config._attn_implementation == PACKED_ATTENTION


def test_varlen_sdpa_attention_against_block_diagonal_sdpa() -> None:
    """The attention function alone, forward and backward, against sdpa with the dense block mask."""
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 6, 1, 4]
    total = sum(lengths)
    module = nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True  # 4 query heads over 2 key/value heads
    q, k, v = (torch.randn(1, h, total, 8, generator=gen, requires_grad=True) for h in (4, 2, 2))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    got, _ = varlen_sdpa_attention(module, q, k, v, None, scaling=0.3, position_ids=position_ids)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    block_causal = (seq[:, None] == seq[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()
    want, _ = sdpa_attention_forward(module, q, k, v, block_causal[None, None], scaling=0.3)
    assert got.shape == want.shape == (1, total, 4, 8)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    grad_out = torch.randn(got.shape, generator=gen)
    grads = torch.autograd.grad(got, (q, k, v), grad_out)
    want_grads = torch.autograd.grad(want, (q, k, v), grad_out)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)
    # A packed row that needs more than plain causal attention fails instead of attending wrongly.
    with pytest.raises(NotImplementedError, match="sliding_window"):
        varlen_sdpa_attention(module, q, k, v, None, position_ids=position_ids, sliding_window=2)


def test_packed_attention_gradients_equal_padded(tiny_dir: Path) -> None:
    """Backward through PACKED_ATTENTION: the packed NLL's gradients equal those of the padded batch."""
    seqs = random_sequences(LENGTHS, seed=7)
    input_ids, position_ids, cu_seqlens = pack(seqs)
    packed_model = load_causal_lm(str(tiny_dir)).train()
    packed_nll_sum(causal_lm_logits(packed_model, input_ids, position_ids), input_ids, cu_seqlens).backward()

    padded_model = load_causal_lm(str(tiny_dir), attn_implementation="sdpa").train()
    ids, mask = pad_right(seqs)
    logprobs = torch.log_softmax(padded_model(input_ids=ids, attention_mask=mask).logits[:, :-1], dim=-1)
    nll = -logprobs.gather(-1, ids[:, 1:, None])[..., 0]  # [B, T_max - 1]
    (nll * mask[:, 1:]).sum().backward()  # the mask of the target token: real pairs only

    padded_grads = dict(padded_model.named_parameters())
    for name, param in packed_model.named_parameters():
        assert param.grad is not None and param.grad.abs().max() > 0, name
        assert rel_diff(param.grad, padded_grads[name].grad) <= GRAD_RTOL, name


def test_packed_attention_generate_equals_sdpa(tiny_dir: Path) -> None:
    """Left padding, an attention mask and a KV cache: PACKED_ATTENTION generates sdpa's tokens."""
    ours = load_causal_lm(str(tiny_dir)).eval()
    sdpa = load_causal_lm(str(tiny_dir), attn_implementation="sdpa").eval()
    assert ours.config._attn_implementation == PACKED_ATTENTION
    prompts = random_sequences([3, 7, 5, 1], seed=8)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), EOS)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = p
        mask[i, width - len(p) :] = 1
    kwargs: dict[str, Any] = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=EOS)
    with torch.no_grad():
        for batch, batch_mask in ((ids, mask), (prompts[1][None], None)):  # padded batch; one sequence
            expected = sdpa.generate(batch, attention_mask=batch_mask, **kwargs)
            got = ours.generate(batch, attention_mask=batch_mask, **kwargs)
            assert torch.equal(got, expected), (got, expected)
        # Sampling draws the same tokens from the same distributions.
        sampled = []
        for model in (ours, sdpa):
            torch.manual_seed(0)
            sampled.append(model.generate(ids, attention_mask=mask, **{**kwargs, "do_sample": True}))
    assert torch.equal(*sampled)


def test_packed_attention_sliding_window_falls_back_to_sdpa_mask(tmp_path: Path) -> None:
    """A sliding-window layer gets sdpa's dense mask (the window matters within a sequence)."""
    torch.manual_seed(0)
    # Layer 0 full attention, layer 1 a window of 4 tokens.
    config = tiny_config(Qwen2Config, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    ours, sdpa = (load_causal_lm(str(tmp_path), attn_implementation=a) for a in (PACKED_ATTENTION, "sdpa"))
    seqs = random_sequences(LENGTHS, seed=9)
    input_ids, position_ids, cu_seqlens = pack(seqs)
    ids, mask = pad_right(seqs)
    with torch.no_grad(), recording_sdpa_queries() as query_lengths:
        packed = causal_lm_logits(ours, input_ids, position_ids)
    with torch.no_grad():
        padded = sdpa(input_ids=ids, attention_mask=mask).logits
    assert query_lengths == [*LENGTHS, sum(LENGTHS)]  # full layer per sequence, sliding layer dense
    for i, n in enumerate(LENGTHS):
        torch.testing.assert_close(
            packed[cu_seqlens[i] : cu_seqlens[i + 1]], padded[i, :n], atol=1e-5, rtol=0
        )


# ----------------------------------------------------------------------------------------------------
# Structure, checkpointing, export (one process)
# ----------------------------------------------------------------------------------------------------


def test_decoder_layers_finds_llama_and_gpt2_blocks(tiny_dir: Path) -> None:
    llama = load_causal_lm(str(tiny_dir))
    assert decoder_layers(llama) is llama.model.layers
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=32))
    assert decoder_layers(gpt2) is gpt2.transformer.h
    with pytest.raises(ValueError, match="decoder layers of Linear"):
        decoder_layers(nn.Linear(2, 2))


def test_count_parameters_counts_tied_weights_once(tmp_path: Path) -> None:
    model = LlamaForCausalLM(tiny_config(tie_word_embeddings=True))
    # embed (128*64) + 2 layers * (q 64*64 + k,v 2*64*32 + o 64*64 + mlp 3*64*128 + 2 norms 64) + norm 64
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert count_parameters(model) == 128 * 64 + 2 * per_layer + 64
    model.model.norm.weight.requires_grad_(False)
    assert count_parameters(model, trainable_only=True) == 128 * 64 + 2 * per_layer


def test_gradient_checkpointing_same_gradients_no_warning(tiny_dir: Path) -> None:
    input_ids, position_ids, cu_seqlens = pack(random_sequences(LENGTHS, seed=5))
    grads = []
    for checkpointing in (False, True):
        model = load_causal_lm(str(tiny_dir)).train()
        if checkpointing:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # transformers 5 deprecates gradient_checkpointing_enable
                enable_gradient_checkpointing(model)
        calls = _count_calls([layer.mlp for layer in decoder_layers(model)])
        packed_nll_sum(causal_lm_logits(model, input_ids, position_ids), input_ids, cu_seqlens).backward()
        # Checkpointing runs each layer's forward again in the backward.
        assert sum(calls) == (2 if checkpointing else 1) * len(calls)
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        assert rel_diff(grads[1][name], grad) <= GRAD_RTOL, name


def _count_calls(modules: list[nn.Module]) -> list[int]:
    """Forward calls per module, filled in as they happen. (Count a layer's MLP, not the layer:
    transformers 5 checkpoints ``forward``, so the layer's own hooks run once either way.)"""
    calls = [0] * len(modules)
    for i, module in enumerate(modules):
        module.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


def test_save_hf_roundtrip_without_process_group(tiny_dir: Path, tmp_path: Path) -> None:
    model = load_causal_lm(str(tiny_dir))
    assert shard_model(model, None, FSDPConfig(), device="cpu") is model  # one process: nothing to shard
    state_dict = full_state_dict(model)
    assert state_dict is not None and state_dict.keys() == model.state_dict().keys()
    save_hf(model, load_tokenizer(str(tiny_dir)), str(tmp_path), is_main=True)
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "tokenizer.json").is_file()
    input_ids, position_ids, _ = pack(random_sequences(LENGTHS, seed=6))
    with torch.no_grad():
        expected = causal_lm_logits(model, input_ids, position_ids)
        got = causal_lm_logits(load_causal_lm(str(tmp_path)), input_ids, position_ids)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------------------------------
# Sharded on gloo ranks (this file is the worker; see _worker below)
# ----------------------------------------------------------------------------------------------------


DIST_CHECKS = [
    "sharded_logits",
    "sharded_values_and_scores",
    "sharded_critic_quiet",
    "step_grads_logits",
    "step_grads_fused_head",
    "step_params",
    "hsdp_grads",
    "generate_tokens",
    "generate_no_collective",
    "generate_reshards_after",
    "generate_first_then_step",  # the 1-rank run stops here
    "save_hf_reload",
    "save_hf_critic_reload",
    "checkpointing_grads",
    "tied_grads_and_save",
    "offload_bf16",
    "generate_bf16_tokens",
    "count_parameters_sharded",
]


# One rank runs the same code on a 1-rank mesh; sections 1-5 of the worker are enough to show it.
ONE_RANK_CHECKS = DIST_CHECKS[: DIST_CHECKS.index("generate_first_then_step") + 1]


def save_worker_models(root: Path) -> None:
    save_tiny(root / "model")
    save_tiny(root / "tied", seed=1, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``_worker`` on 2 gloo ranks under torchrun, with a 60 s process-group timeout."""
    root = tmp_path_factory.mktemp("two_ranks")
    save_worker_models(root)
    out = root / "results.json"
    return worker_results(__file__, root, out, ",".join(DIST_CHECKS), out=out)


@pytest.mark.slow
@pytest.mark.parametrize("check", DIST_CHECKS)
def test_two_ranks(two_rank_results: dict[str, Any], check: str) -> None:
    assert_check(two_rank_results, check)


@pytest.fixture(scope="module")
def one_rank_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``_worker`` in this process on a 1-rank gloo group (a second torchrun would cost ~15 s)."""
    import torch.distributed as dist

    root = tmp_path_factory.mktemp("one_rank")
    save_worker_models(root)
    out = root / "results.json"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    log = ""
    try:
        _worker(root, out, ONE_RANK_CHECKS)
    except Exception:
        log = traceback.format_exc()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return read_results(out, log)


@pytest.mark.slow
@pytest.mark.parametrize("check", ONE_RANK_CHECKS)
def test_one_rank_mesh(one_rank_results: dict[str, Any], check: str) -> None:
    assert_check(one_rank_results, check)


def _worker(root: Path, out: Path, wanted: list[str]) -> None:
    """Sharded checks, each against an unsharded copy on the same global batch; rank 0 writes results.

    Stops once every check in ``wanted`` has a result (the sections run in the order of DIST_CHECKS).
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from ppo.distributed import init_distributed, make_mesh

    info = init_distributed(device="cpu", timeout_s=60)  # a bug fails within a minute, not 30
    rank, world = info.rank, info.world_size
    checks = Checks(out, info.is_main)
    record, within = checks.record, checks.within

    path = str(root / "model")
    mesh = make_mesh(info)
    fsdp = FSDPConfig()

    # The global batch: 4 sequences, each rank holds every world-th one.
    seqs = random_sequences([7, 4, 9, 5], seed=10)
    all_ids, all_pos, all_cu = pack(seqs)
    ids, pos, cu = pack(seqs[rank::world])
    num_targets = sum(len(s) - 1 for s in seqs)  # global count of predicted tokens

    def global_loss(model: nn.Module, fused: bool, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        input_ids, position_ids, cu_seqlens = batch
        if fused:
            logits = causal_lm_hidden(model, input_ids, position_ids) @ lm_head_weight(model).T
        else:
            logits = causal_lm_logits(model, input_ids, position_ids)
        return packed_nll_sum(logits, input_ids, cu_seqlens) / num_targets

    with checks:  # an exception becomes the _error check; the process group ends here
        # 1. Forward: sharded logits equal the unsharded model's.
        ref = load_causal_lm(path).train()
        model = shard_model(load_causal_lm(path), mesh, fsdp, device="cpu").train()
        with torch.no_grad():
            within(
                "sharded_logits",
                max_diff(causal_lm_logits(model, all_ids, all_pos), causal_lm_logits(ref, all_ids, all_pos)),
                1e-5,
            )

        # 2. Critic values and reward scores through a sharded root.
        critic_ref, reward_ref = load_critic(path), load_reward_model(path)
        with torch.no_grad():
            critic_ref.score.weight.normal_(generator=torch.Generator().manual_seed(0))
        critic = load_critic(path)
        critic.load_state_dict(critic_ref.state_dict())
        critic = shard_model(critic, mesh, fsdp, device="cpu")
        reward = shard_model(load_reward_model(path), mesh, fsdp, device="cpu")
        with torch.no_grad():
            diff = max(
                max_diff(
                    critic_values(critic, all_ids, all_pos), critic_values(critic_ref, all_ids, all_pos)
                ),
                max_diff(
                    reward_scores(reward, all_ids, all_pos, all_cu),
                    reward_scores(reward_ref, all_ids, all_pos, all_cu),
                ),
            )
        within("sharded_values_and_scores", diff, 1e-5)
        # torch >= 2.13 warns on every forward of a root whose output is a view (heads reshape a Linear's
        # output); nothing here modifies outputs in place, so sharding silences it (ppo.sharding).
        with warnings.catch_warnings(record=True) as caught:
            critic_values(critic, all_ids, all_pos).sum().backward()  # with gradients, as in an update
        critic.zero_grad(set_to_none=True)
        noise = [str(w.message)[:120] for w in caught if "view tensor" in str(w.message)]
        record("sharded_critic_quiet", not noise, noise or "no view-tensor warning")

        # 3. One training step: each rank its half, the loss divided by the global target count.
        global_loss(ref, False, (all_ids, all_pos, all_cu)).backward()
        global_loss(model, False, (ids, pos, cu)).backward()
        within("step_grads_logits", grad_rel_diff(model, ref), GRAD_RTOL)
        model.zero_grad(set_to_none=True)
        # Fused-head path: hidden states and the head weight, used outside the head's own forward.
        global_loss(model, True, (ids, pos, cu)).backward()
        within("step_grads_fused_head", grad_rel_diff(model, ref), GRAD_RTOL)
        for m in (model, ref):
            # eps well above the rounding noise of gradients (~1e-9 here, from the summation order):
            # AdamW divides a gradient by its own magnitude, so with the default eps=1e-8 an element
            # with |g| ~ 1e-8 moves by ~lr/4 on noise alone (measured 1.7e-5, nothing wrong).
            opt = torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-4, weight_decay=0.1)
            opt.step()
        ref_params = dict(ref.named_parameters())
        within(
            "step_params",
            max(max_diff(full_tensor(p), ref_params[n]) for n, p in model.named_parameters()),
            1e-6,
        )

        # 4. Hybrid sharding (replicate 2 x shard 1): gradients still sum over all ranks.
        hsdp = shard_model(load_causal_lm(path), make_mesh(info, fsdp_size=1), fsdp, device="cpu").train()
        ref2 = load_causal_lm(path).train()
        global_loss(hsdp, False, (ids, pos, cu)).backward()
        global_loss(ref2, False, (all_ids, all_pos, all_cu)).backward()
        within("hsdp_grads", grad_rel_diff(hsdp, ref2), GRAD_RTOL)
        del hsdp, ref2

        # 5. Generation with the parameters gathered once.
        model.eval()
        ref.eval()
        prompts = torch.stack(random_sequences([6, 6], seed=11))
        gen_kwargs: dict[str, Any] = dict(
            max_new_tokens=5,
            min_new_tokens=5,
            do_sample=False,
            pad_token_id=EOS,
            attention_mask=torch.ones_like(prompts),
        )
        with torch.no_grad(), counting_collectives() as counter:
            causal_lm_logits(model, all_ids, all_pos)
            gathers_outside = counter["n"]
            with gathered_for_generation(model):
                # Entering gathered each layer once; generating must make no collective: no gathers,
                # and not the per-step all-reduce of generate(synced_gpus=True) either.
                counter["n"] = 0
                plain = all(not isinstance(p, DTensor) for p in model.parameters())
                tokens = model.generate(prompts, **gen_kwargs)
                collectives_inside = counter["n"]
        with torch.no_grad():
            expected = ref.generate(prompts, **gen_kwargs)
        record("generate_tokens", torch.equal(tokens, expected), f"{tokens.tolist()} vs {expected.tolist()}")
        record(
            "generate_no_collective",
            # One rank has nothing to gather: FSDP2 then skips the collective.
            plain and collectives_inside == 0 and (gathers_outside > 0 or world == 1),
            f"params unsharded: {plain}; collectives inside: {collectives_inside}, in a plain forward: "
            f"{gathers_outside}",
        )
        with torch.no_grad():
            causal_lm_logits(model, all_ids, all_pos)
        layer_params = [p for layer in decoder_layers(model) for p in layer.parameters()]
        record(
            "generate_reshards_after",
            all(isinstance(p, DTensor) for p in layer_params),
            "layers are sharded again after a forward that follows the context",
        )

        # 5b. The trainer's order: a fresh model's first forwards are a rollout (FSDP's forward hooks
        # bypassed inside the context), then a training step, which must match the unsharded one.
        fresh = shard_model(load_causal_lm(path), mesh, fsdp, device="cpu").eval()
        fresh_ref = load_causal_lm(path).eval()
        states = [module._get_fsdp_state() for module in fsdp_modules(fresh)]

        def forward_hooks() -> list[Callable[..., Any]]:
            handles = [h for s in states for h in (s._pre_forward_hook_handle, s._post_forward_hook_handle)]
            return [h.hooks_dict_ref()[h.id] for h in handles]

        installed = forward_hooks()
        with torch.no_grad(), gathered_for_generation(fresh):
            bypassed = all(hook is _no_op_hook for hook in forward_hooks())
            tokens = fresh.generate(prompts, **gen_kwargs)
        restored = forward_hooks() == installed
        with torch.no_grad():
            expected = fresh_ref.generate(prompts, **gen_kwargs)
        fresh.train()
        fresh_ref.train()
        global_loss(fresh, False, (ids, pos, cu)).backward()
        global_loss(fresh_ref, False, (all_ids, all_pos, all_cu)).backward()
        diff = grad_rel_diff(fresh, fresh_ref)
        for m in (fresh, fresh_ref):
            torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-4, weight_decay=0.1).step()  # eps: see 3.
        ref_params = dict(fresh_ref.named_parameters())
        param_diff = max(max_diff(full_tensor(p), ref_params[n]) for n, p in fresh.named_parameters())
        record(
            "generate_first_then_step",
            torch.equal(tokens, expected)
            and bypassed
            and restored
            and diff <= GRAD_RTOL
            and param_diff <= 1e-6,
            f"tokens equal: {torch.equal(tokens, expected)}; hooks bypassed inside: {bypassed}, restored: "
            f"{restored}; grads {diff=:.3g}; params {param_diff=:.3g}",
        )
        del fresh, fresh_ref

        if all(check in checks.results for check in wanted):
            dist.barrier()
            return

        # 6. Export: save_hf from shards, reload with from_pretrained, same logits.
        with torch.no_grad():
            sharded_logits = causal_lm_logits(model, all_ids, all_pos)
        export = root / "export"
        save_hf(model, load_tokenizer(path), str(export), is_main=info.is_main)
        reloaded = AutoModelForCausalLM.from_pretrained(export)
        with torch.no_grad():
            reloaded_logits = causal_lm_logits(reloaded, all_ids, all_pos)
        architectures = reloaded.config.architectures
        diff = max_diff(reloaded_logits, sharded_logits)
        record(
            "save_hf_reload",
            diff <= 1e-5 and architectures == ["LlamaForCausalLM"],
            f"{diff=:.3g} {architectures=}",
        )

        save_hf(critic, None, str(root / "critic"), is_main=info.is_main)
        with torch.no_grad():
            diff = max_diff(
                critic_values(load_critic(str(root / "critic")), all_ids, all_pos),
                critic_values(critic_ref, all_ids, all_pos),
            )
        within("save_hf_critic_reload", diff, 1e-5)
        del critic, reward, model, ref

        # 7. Activation checkpointing + sharding + prefetch: same gradients, layers run twice.
        ref = load_causal_lm(path).train()
        prefetching = FSDPConfig(forward_prefetch=True)
        model = shard_model(load_causal_lm(path), mesh, prefetching, device="cpu").train()
        enable_gradient_checkpointing(model)
        calls = _count_calls([layer.mlp for layer in decoder_layers(model)])
        global_loss(model, False, (ids, pos, cu)).backward()
        global_loss(ref, False, (all_ids, all_pos, all_cu)).backward()
        diff = grad_rel_diff(model, ref)
        record(
            "checkpointing_grads", diff <= GRAD_RTOL and calls == [2, 2], f"{diff=:.3g}, layer calls {calls}"
        )
        del model, ref

        # 8. Tied embeddings (one parameter for embed and head) in the root group.
        tied_path = str(root / "tied")
        ref = load_causal_lm(tied_path).train()
        model = shard_model(load_causal_lm(tied_path), mesh, fsdp, device="cpu").train()
        global_loss(model, True, (ids, pos, cu)).backward()
        global_loss(ref, False, (all_ids, all_pos, all_cu)).backward()
        diff = grad_rel_diff(model, ref)
        save_hf(model, None, str(root / "tied_export"), is_main=info.is_main)
        reloaded = load_causal_lm(str(root / "tied_export"))
        with torch.no_grad():
            save_diff = max_diff(
                causal_lm_logits(reloaded, all_ids, all_pos), causal_lm_logits(ref, all_ids, all_pos)
            )
        tied = reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
        record(
            "tied_grads_and_save",
            diff <= GRAD_RTOL and save_diff <= 1e-5 and tied,
            f"{diff=:.3g} {save_diff=:.3g} {tied=}",
        )

        # 9. bf16 compute with CPU offload: bf16 logits near the fp32 ones, fp32 sharded grads, generate.
        mixed = FSDPConfig(param_offload=True, mixed_precision=MixedPrecisionConfig(param_dtype="bfloat16"))
        model = shard_model(load_causal_lm(path), mesh, mixed, device="cpu").train()
        ref = load_causal_lm(path)
        logits = causal_lm_logits(model, ids, pos)
        with torch.no_grad():
            rel = rel_diff(logits, causal_lm_logits(ref, ids, pos))
        global_loss(model, False, (ids, pos, cu)).backward()
        grads_ok = all(
            p.grad.dtype == torch.float32 and bool(p.grad.isfinite().all()) for p in model.parameters()
        )
        with torch.no_grad(), gathered_for_generation(model):
            tokens = model.generate(prompts, **gen_kwargs)
        record(
            "offload_bf16",
            logits.dtype == torch.bfloat16 and rel < 5e-2 and grads_ok and tokens.shape == (2, 11),
            f"{logits.dtype=} {rel=:.3g} {grads_ok=} {tuple(tokens.shape)=}",
        )
        # Without the context FSDP's hooks run (and gather) at every step and cast the inputs to bf16;
        # skipping them must not change a token. (Both ranks decode 5 steps: min_new_tokens.)
        with torch.no_grad():
            hooked_tokens = model.generate(prompts, **gen_kwargs)
        record(
            "generate_bf16_tokens",
            torch.equal(tokens, hooked_tokens),
            f"{tokens.tolist()} vs {hooked_tokens.tolist()}",
        )
        # DTensor.numel() is the global size: the count does not shrink with sharding.
        count, expected_count = count_parameters(model), count_parameters(ref)
        record("count_parameters_sharded", count == expected_count, f"{count} vs {expected_count}")
        dist.barrier()


@contextlib.contextmanager
def counting_collectives() -> Iterator[dict[str, int]]:
    """Count every ``torch.distributed.all_gather*`` / ``all_reduce*`` / ``reduce_scatter*`` /
    ``broadcast*`` call inside (FSDP2 and transformers' generate call them via ``dist.``)."""
    import torch.distributed as dist

    counter = {"n": 0}
    prefixes = ("all_gather", "all_reduce", "reduce_scatter", "broadcast")
    originals = {name: getattr(dist, name) for name in dir(dist) if name.startswith(prefixes)}

    def counting(original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            counter["n"] += 1
            return original(*args, **kwargs)

        return counted

    for name, original in originals.items():
        setattr(dist, name, counting(original))
    try:
        yield counter
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3].split(","))
