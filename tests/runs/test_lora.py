"""Tests of ppo.lora: adapters on the tiny Llama, the reference as the actor without them, FSDP2 sharding
on 2 gloo ranks against an unsharded copy, merged rollout, trainable-only checkpoints, both exports.

The sharded checks run this file as a worker under ``torch.distributed.run`` (2 ranks; ``_worker`` at the
bottom); each compares with the same model unsharded on the same global batch::

    pytest tests/runs/test_lora.py     # 21 tests, ~45 s on a busy 2-core machine (~27 s of CPU)
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, LlamaConfig, LlamaForCausalLM

from ppo import lora
from ppo.config import ConfigError, LoRAConfig
from ppo.model_loading import load_causal_lm, load_critic
from ppo.models import causal_lm_logits, critic_values
from tests.helpers import Checks, assert_check, full_tensor, load_script, max_diff, worker_results

# peft 0.21 asks transformers 5 for the deprecated is_gradient_checkpointing when it wraps a model.
pytestmark = [
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
    pytest.mark.usefixtures("one_thread"),
]

RANK = 8
LAYERS = 3  # the tiny demo Llama: hidden 128, intermediate 512, 3 layers, vocab 103
LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def actor_lora(**overrides: Any) -> LoRAConfig:
    return LoRAConfig(**{"rank": RANK, "alpha": 16.0, **overrides})


def lora_actor(path: str | Path, **overrides: Any) -> nn.Module:
    model = load_causal_lm(str(path))
    return lora.apply_lora(model, actor_lora(**overrides), model_dtype="float32", config_key="actor.lora")


def perturb_adapters(model: nn.Module, seed: int = 1) -> None:
    """Nonzero ``B`` (fresh adapters start at 0, where adapted == base and nothing could be told apart)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)


def packed(lengths: list[int], seed: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed ``input_ids [T]`` and ``position_ids [T]`` of random sequences (ids above the specials)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.randint(3, vocab, (n,), generator=gen) for n in lengths])
    return ids, torch.cat([torch.arange(n) for n in lengths])


# ----------------------------------------------------------------------------------------------------
# Building, dtypes, reference (one process)
# ----------------------------------------------------------------------------------------------------


def test_only_adapters_train_and_start_at_the_base(tiny_assets: Path) -> None:
    model = lora_actor(tiny_assets / "base")
    base = load_causal_lm(str(tiny_assets / "base"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * len(LINEAR) * LAYERS  # A and B on every linear layer of every block
    # r * (in + out) per layer: q, k, v, o are 128 -> 128; gate, up 128 -> 512; down 512 -> 128.
    expected = LAYERS * RANK * (4 * 256 + 3 * 640)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == expected
    assert all(not p.requires_grad for p in model.lm_head.parameters())  # the LM head stays frozen
    ids, pos = packed([9, 5], seed=0, vocab=base.config.vocab_size)
    with torch.no_grad():  # B = 0: the adapted model starts as the base model, exactly
        assert torch.equal(causal_lm_logits(model, ids, pos), causal_lm_logits(base, ids, pos))
    # Every build draws the same adapters (ranks must agree before fully_shard; runs must repeat).
    again = lora_actor(tiny_assets / "base")
    a = model.model.layers[1].mlp.down_proj.lora_A["default"].weight
    assert torch.equal(a, again.model.layers[1].mlp.down_proj.lora_A["default"].weight)
    assert a.abs().max() <= 1 / 512**0.5 and a.std() > 0.5 / (3 * 512) ** 0.5  # U(+-1/sqrt(fan_in))


def test_base_dtype_keeps_masters_and_buffers_in_model_dtype(tiny_assets: Path) -> None:
    critic = load_critic(str(tiny_assets / "base"), dtype="bfloat16")
    critic = lora.apply_lora(
        critic,
        LoRAConfig(rank=4, base_dtype="bfloat16"),
        model_dtype="float32",
        trainable_head="score",
        config_key="critic.lora",
    )
    dtypes = {n: (p.dtype, p.requires_grad) for n, p in critic.named_parameters()}
    for name, (dtype, trains) in dtypes.items():
        if ".lora_" in name or name.startswith("score."):  # the value head trains whole, in fp32
            assert (dtype, trains) == (torch.float32, True), name
        else:
            assert (dtype, trains) == (torch.bfloat16, False), name
    assert critic.model.rotary_emb.inv_freq.dtype == torch.float32  # buffers are not cast
    assert lora.load_dtype(LoRAConfig(rank=4, base_dtype="bfloat16"), "float32") == "bfloat16"
    assert lora.load_dtype(LoRAConfig(rank=0, base_dtype="bfloat16"), "float32") == "float32"


def test_merged_export_of_a_bf16_base_keeps_a_small_update(tiny_assets: Path, tmp_path: Path) -> None:
    model = load_causal_lm(str(tiny_assets / "base"), dtype="bfloat16")
    model = lora.apply_lora(
        model, actor_lora(base_dtype="bfloat16"), model_dtype="float32", config_key="actor.lora"
    )
    layer = model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(std=2e-5)  # a small update: entries ~6e-6, W ~ 0.02
    delta = layer.scaling["default"] * (layer.lora_B["default"].weight @ layer.lora_A["default"].weight)
    base = layer.base_layer.weight.float()
    lora.save_hf(model, None, tmp_path / "merged", is_main=True, merged=True)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")  # in the config's dtype
    merged = reloaded.model.layers[0].self_attn.q_proj.weight
    assert merged.dtype == torch.float32
    torch.testing.assert_close(merged - base, delta, atol=1e-8, rtol=1e-4)
    # What a bf16 file would have kept of it: W is on the bf16 grid, so W + d rounds back to W
    # wherever |d| < ulp(W) / 2; here most of the update.
    kept = ((base + delta).bfloat16().float() - base) * delta
    assert kept.sum() < 0.5 * (delta * delta).sum()


def test_reference_is_the_base_model(tiny_assets: Path) -> None:
    model = lora_actor(tiny_assets / "base")
    perturb_adapters(model)
    base = load_causal_lm(str(tiny_assets / "base"))
    ids, pos = packed([7, 11, 4], seed=1, vocab=base.config.vocab_size)
    with torch.no_grad():
        expected = causal_lm_logits(base, ids, pos)
        adapted = causal_lm_logits(model, ids, pos)
        with lora.adapters_disabled(model):
            reference = causal_lm_logits(model, ids, pos)
        with pytest.raises(KeyError), lora.adapters_disabled(model):
            raise KeyError("an error inside still switches the adapters back on")
        after = causal_lm_logits(model, ids, pos)
        with lora.adapters_disabled(base):  # a separately loaded reference: a no-op
            plain = causal_lm_logits(base, ids, pos)
    assert torch.equal(reference, expected)
    assert (adapted - expected).abs().max() > 1e-2  # the adapters do change the policy
    assert torch.equal(after, adapted) and torch.equal(plain, expected)
    assert all(p.requires_grad for n, p in model.named_parameters() if ".lora_" in n)


def test_target_modules_and_rank_errors(tiny_assets: Path) -> None:
    model = lora_actor(tiny_assets / "base", target_modules=["q_proj", "self_attn.v_proj"])
    adapted = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, LoraLayer)}
    assert adapted == {"q_proj", "v_proj"}

    def fails(match: str, **overrides: Any) -> None:
        with pytest.raises(ConfigError, match=match) as err:
            lora_actor(tiny_assets / "base", **overrides)
        assert "\n" not in str(err.value)

    names = re.escape(str(sorted(LINEAR)))
    fails(
        rf"actor.lora.target_modules=\['qkv'\]: 'qkv' matches no linear .* have {names}",
        target_modules=["qkv"],
    )
    fails(r"'lm_head' is outside the decoder layers", target_modules=["lm_head"])
    fails(
        r"actor.lora.rank=129 is larger than the smaller dimension of model.layers.0.self_attn.q_proj "
        r"\(128 -> 128\): use a rank of at most 128",
        rank=129,
    )
    critic = load_critic(str(tiny_assets / "base"))
    with pytest.raises(ConfigError, match="critic.lora.target_modules: 'score' is outside"):
        lora.apply_lora(
            critic,
            LoRAConfig(rank=4, target_modules=["score"]),
            model_dtype="float32",
            trainable_head="score",
            config_key="critic.lora",
        )


def save_adapter_folder(base: Path, out: Path, *, critic: bool = False) -> Path:
    """A peft adapter folder (as an SFT or reward-model stage with LoRA would save) with random weights."""
    torch.manual_seed(3)
    model = (
        AutoModelForTokenClassification.from_pretrained(base, num_labels=1)
        if critic
        else AutoModelForCausalLM.from_pretrained(base)
    )
    config = PeftLoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "down_proj"],
        init_lora_weights=False,
        task_type="TOKEN_CLS" if critic else "CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    if critic:
        with torch.no_grad():
            peft_model.base_model.model.score.modules_to_save["default"].weight.normal_()
    peft_model.save_pretrained(out)
    return out


def test_adapter_folder_as_model_path(tiny_assets: Path, tmp_path: Path) -> None:
    base = tiny_assets / "base"
    folder = str(save_adapter_folder(base, tmp_path / "sft_adapter"))
    trained = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), folder)
    assert lora.base_model_path(folder, config_key="model.path") == str(base)
    assert lora.base_model_path(str(base), config_key="model.path") == str(base)
    model = load_causal_lm(lora.base_model_path(folder, config_key="model.path"))
    model = lora.apply_lora(
        model, actor_lora(), model_dtype="float32", config_key="actor.lora", init_from=folder
    )
    perturb_adapters(model)
    ids, pos = packed([6, 9], seed=2, vocab=model.config.vocab_size)
    with torch.no_grad():
        expected = causal_lm_logits(trained, ids, pos)
        with lora.adapters_disabled(model):  # the reference is the policy the run started from
            torch.testing.assert_close(causal_lm_logits(model, ids, pos), expected, atol=1e-5, rtol=0)
    assert not any(".loaded." in n for n, _ in model.named_parameters())

    # A critic from a reward model's adapter folder keeps that folder's trained head.
    critic_folder = str(save_adapter_folder(base, tmp_path / "rm_adapter", critic=True))
    trained_critic = PeftModel.from_pretrained(
        AutoModelForTokenClassification.from_pretrained(base, num_labels=1), critic_folder
    )
    critic = load_critic(lora.base_model_path(critic_folder, config_key="critic.model_path"))
    critic = lora.apply_lora(
        critic,
        LoRAConfig(rank=0),
        model_dtype="float32",
        trainable_head="score",
        config_key="critic.lora",
        init_from=critic_folder,
    )
    with torch.no_grad():
        expected = trained_critic(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits[
            0, :, 0
        ]
        torch.testing.assert_close(critic_values(critic, ids, pos), expected, atol=1e-5, rtol=0)
    assert all(p.requires_grad for p in critic.parameters())  # rank 0: everything trains, merged

    with pytest.raises(ConfigError, match="actor.lora.save_merged=false, but the model path"):
        lora.apply_lora(
            load_causal_lm(str(base)),
            actor_lora(save_merged=False),
            model_dtype="float32",
            config_key="actor.lora",
            init_from=folder,
        )


def test_adapter_folder_of_another_base_fails(tiny_assets: Path, tmp_path: Path) -> None:
    folder = save_adapter_folder(tiny_assets / "base", tmp_path / "adapter")
    other = tmp_path / "narrow"
    config = LlamaConfig.from_pretrained(tiny_assets / "base")
    config.intermediate_size = 256
    LlamaForCausalLM(config).save_pretrained(other)
    adapter_config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(
        json.dumps({**adapter_config, "base_model_name_or_path": str(other)})
    )
    with pytest.raises(
        ConfigError,
        match=r"model.path='.*adapter' is an adapter folder trained on another base "
        r"model than the '.*narrow' it names: .*down_proj.lora_A.weight is \[4, 512\]",
    ) as err:
        lora.base_model_path(str(folder), config_key="model.path")
    assert "\n" not in str(err.value)
    (folder / "adapter_config.json").write_text(
        json.dumps({**adapter_config, "base_model_name_or_path": str(tmp_path / "gone")})
    )
    with pytest.raises(ConfigError, match=r"critic.model_path=.* whose base model .*gone' cannot be loaded"):
        lora.base_model_path(str(folder), config_key="critic.model_path")


# ----------------------------------------------------------------------------------------------------
# Sharded on 2 gloo ranks (this file is the worker; see _worker below)
# ----------------------------------------------------------------------------------------------------


DIST_CHECKS = [
    "actor_step_equals_unsharded",
    "base_untouched_no_grads",
    "critic_step_equals_unsharded",
    "export_critic",
    "reference_equals_base_model",
    "bf16_base_fp32_adapters",
    "generate_merged_equals_active",
    "generate_leaves_shards_unchanged",
    "checkpoint_trainable_only",
    "checkpoint_small",
    "checkpoint_resumes_exactly",
    "export_merged_plain_transformers",
    "export_adapter_loads_with_peft",
]


@pytest.fixture(scope="module")
def two_rank_results(tiny_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``_worker`` on 2 gloo ranks under torchrun, with a 60 s process-group timeout."""
    root = tmp_path_factory.mktemp("lora_two_ranks")
    out = root / "results.json"
    results = worker_results(__file__, tiny_assets, root, out, out=out)
    results["_root"] = str(root)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("check", DIST_CHECKS)
def test_two_ranks(two_rank_results: dict[str, Any], check: str) -> None:
    assert_check(two_rank_results, check)


@pytest.mark.slow
def test_export_script_from_two_rank_checkpoint(
    two_rank_results: dict[str, Any], tiny_assets: Path, tmp_path: Path
) -> None:
    """scripts/export_hf.py on one rank from the 2-rank checkpoint (DCP reshards): merged by default
    (the config's save_merged), the adapter folder with --adapter; both equal the worker's exports."""
    root = Path(two_rank_results["_root"])
    ckpt = root / "run" / "checkpoints" / "step_00000001"
    if not (ckpt / "COMPLETE").is_file():
        pytest.fail(f"the worker wrote no checkpoint:\n{two_rank_results['_log']}")
    export_hf = load_script("export_hf")
    assert export_hf.main([str(root / "run"), str(tmp_path / "merged")]) == 0
    assert export_hf.main([str(ckpt), str(tmp_path / "adapter"), "--adapter"]) == 0
    assert sorted(os.listdir(tmp_path / "adapter")) == sorted(os.listdir(root / "export_adapter"))
    ids = torch.tensor([[1, 5, 20, 21, 22, 6, 9]])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    worker_merged = AutoModelForCausalLM.from_pretrained(root / "export_merged")
    adapter = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_assets / "base"), tmp_path / "adapter"
    )
    with torch.no_grad():
        expected = worker_merged(ids).logits
        torch.testing.assert_close(merged(ids).logits, expected, atol=0, rtol=0)
        torch.testing.assert_close(adapter(ids).logits, expected, atol=1e-5, rtol=0)
    assert export_hf.main([str(ckpt), str(tmp_path / "x"), "--critic", "--adapter"]) == 2  # no critic LoRA


def _worker(assets: Path, root: Path, out: Path) -> None:
    """Sharded LoRA checks against an unsharded copy on the same global batch; rank 0 writes results."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ppo import checkpoint_files, sharding
    from ppo.config import FSDPConfig, MixedPrecisionConfig, PPOConfig
    from ppo.config_loader import to_yaml
    from ppo.distributed import init_distributed, make_mesh
    from ppo.model_loading import load_tokenizer
    from ppo.models import causal_lm_hidden, enable_gradient_checkpointing, lm_head_weight

    torch.set_num_threads(1)
    info = init_distributed(device="cpu", timeout_s=60)
    rank, world = info.rank, info.world_size
    checks = Checks(out, info.is_main)
    record = checks.record

    base_path = str(assets / "base")
    mesh = make_mesh(info)
    vocab = load_causal_lm(base_path).config.vocab_size
    lengths = [7, 4, 9, 5]
    gen = torch.Generator().manual_seed(10)
    seqs = [torch.randint(3, vocab, (n,), generator=gen) for n in lengths]
    num_targets = sum(n - 1 for n in lengths)

    def batch(part: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids = torch.cat(part)
        pos = torch.cat([torch.arange(len(s)) for s in part])
        first = torch.zeros_like(ids, dtype=torch.bool)  # the first token of each sequence is no target
        first[torch.tensor([0] + [len(s) for s in part[:-1]]).cumsum(0)] = True
        return ids, pos, first

    mine, everything = batch(seqs[rank::world]), batch(seqs)

    def nll(logits: torch.Tensor, ids: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """Summed next-token NLL within each packed sequence over the global target count."""
        logprobs = torch.log_softmax(logits.float()[:-1], -1).gather(-1, ids[1:, None])[:, 0]
        return -(logprobs * ~first[1:]).sum() / num_targets

    def actor_loss(model: nn.Module, part: tuple[torch.Tensor, ...], fused: bool) -> torch.Tensor:
        ids, pos, first = part
        if fused:  # the fused LM-head path: hidden states and the (frozen) head weight
            logits = causal_lm_hidden(model, ids, pos) @ lm_head_weight(model).T
        else:
            logits = causal_lm_logits(model, ids, pos)
        return nll(logits, ids, first)

    def adamw(model: nn.Module) -> torch.optim.Optimizer:
        # eps well above fp32 summation noise of the gradients (see tests/runs/test_models.py, step_params)
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, eps=1e-4)

    def params_diff(sharded: nn.Module, ref: nn.Module) -> float:
        ref_params = dict(ref.named_parameters())
        return max(max_diff(full_tensor(p), ref_params[n]) for n, p in sharded.named_parameters())

    def sharded_actor(fsdp: FSDPConfig | None = None, **overrides: Any) -> nn.Module:
        model = lora_actor(base_path, **overrides)
        enable_gradient_checkpointing(model)
        return sharding.shard_model(model.train(), mesh, fsdp or FSDPConfig(), device="cpu")

    with checks:  # an exception becomes the _error check; the process group ends here
        # 1. One LoRA update: sharded (fused head, gradient checkpointing, prefetch) = unsharded.
        model = sharded_actor(FSDPConfig(forward_prefetch=True))
        ref = lora_actor(base_path).train()
        frozen_before = {
            n: full_tensor(p).clone() for n, p in model.named_parameters() if not p.requires_grad
        }
        for m, part, fused in ((model, mine, True), (ref, everything, False)):
            actor_loss(m, part, fused).backward()
            adamw(m).step()
        diff = params_diff(model, ref)
        record("actor_step_equals_unsharded", diff <= 1e-6, f"max |param diff| = {diff:.3g}")
        untouched = all(
            torch.equal(full_tensor(p), frozen_before[n])
            for n, p in model.named_parameters()
            if n in frozen_before
        )
        grads = {n for n, p in model.named_parameters() if p.grad is not None}
        record(
            "base_untouched_no_grads",
            untouched and grads and all(".lora_" in n for n in grads),
            f"frozen unchanged: {untouched}; grads on {sorted(grads)[:3]}...",
        )

        # 2. Critic: adapters + the value head, one update on a value loss.
        def critic_loss(critic: nn.Module, part: tuple[torch.Tensor, ...]) -> torch.Tensor:
            ids, pos, _ = part
            return ((critic_values(critic, ids, pos) - 0.5) ** 2).sum() / len(everything[0])

        def lora_critic() -> nn.Module:
            return lora.apply_lora(
                load_critic(base_path),
                LoRAConfig(rank=4),
                model_dtype="float32",
                trainable_head="score",
                config_key="critic.lora",
            ).train()

        critic = sharding.shard_model(lora_critic(), mesh, FSDPConfig(), device="cpu")
        critic_ref = lora_critic()
        for m, part in ((critic, mine), (critic_ref, everything)):
            critic_loss(m, part).backward()
            adamw(m).step()
        diff = params_diff(critic, critic_ref)
        head_moved = full_tensor(critic.score.weight).abs().max().item() > 0
        record("critic_step_equals_unsharded", diff <= 1e-6 and head_moved, f"{diff=:.3g} {head_moved=}")
        # Exports of the critic: merged (loads with load_critic) and adapters + head (loads with peft).
        ids, pos, _ = everything
        with torch.no_grad():
            expected = critic_values(critic_ref, ids, pos)
        lora.save_hf(critic, None, root / "critic_merged", is_main=info.is_main, merged=True)
        lora.save_hf(critic, None, root / "critic_adapter", is_main=info.is_main, merged=False)
        base_critic = AutoModelForTokenClassification.from_pretrained(base_path, num_labels=1)
        with torch.no_grad():
            merged_diff = max_diff(
                critic_values(load_critic(str(root / "critic_merged")), ids, pos), expected
            )
            peft_critic = PeftModel.from_pretrained(base_critic, root / "critic_adapter")
            adapter_diff = max_diff(critic_values(peft_critic, ids, pos), expected)
        record(
            "export_critic", max(merged_diff, adapter_diff) <= 1e-5, f"{merged_diff=:.3g} {adapter_diff=:.3g}"
        )
        del critic, critic_ref

        # 3. Reference: the sharded actor with its adapters off = a separately loaded base model.
        base = load_causal_lm(base_path)
        ids, pos, _ = everything
        with torch.no_grad():
            expected = causal_lm_logits(base, ids, pos)
            with lora.adapters_disabled(model):
                reference = causal_lm_logits(model, ids, pos)
            moved = max_diff(causal_lm_logits(model, ids, pos), expected)
        diff = max_diff(reference, expected)
        record(
            "reference_equals_base_model", diff <= 1e-5 and moved > 1e-3, f"{diff=:.3g}, adapted {moved=:.3g}"
        )

        # 4. bf16 frozen base with fp32 adapters in one fully_shard group, gathered in bf16 and in fp32.
        details = []
        for param_dtype in ("bfloat16", "float32"):
            fsdp = FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype=param_dtype))
            mixed = sharded_actor(fsdp, base_dtype="bfloat16")
            actor_loss(mixed, mine, False).backward()
            dtypes = {(p.dtype, p.requires_grad, p.grad is not None) for p in mixed.parameters()}
            details.append((param_dtype, sorted(map(str, dtypes))))
        ok = all(
            d == sorted(map(str, {(torch.bfloat16, False, False), (torch.float32, True, True)}))
            for _, d in details
        )
        record("bf16_base_fp32_adapters", ok, details)
        del mixed

        # 5. Greedy rollout, adapters merged into the gathered weights = adapters active = unsharded.
        model.eval()
        ref.eval()
        prompts = torch.stack([torch.randint(3, vocab, (6,), generator=gen) for _ in range(3)])
        kwargs: dict[str, Any] = dict(
            max_new_tokens=8,
            min_new_tokens=8,
            do_sample=False,
            pad_token_id=0,
            attention_mask=torch.ones_like(prompts),
        )
        params_before = {n: full_tensor(p).clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            with sharding.gathered_for_generation(model), lora.merged_for_generation(model):
                merged_inside = all(m.merged for _, m in lora.lora_layers(model))
                merged_tokens = model.generate(prompts, **kwargs)
            with sharding.gathered_for_generation(model):
                active_tokens = model.generate(prompts, **kwargs)
            expected_tokens = ref.generate(prompts, **kwargs)
        record(
            "generate_merged_equals_active",
            merged_inside
            and torch.equal(merged_tokens, active_tokens)
            and torch.equal(active_tokens, expected_tokens),
            f"{merged_inside=} {merged_tokens.tolist()} {active_tokens.tolist()} {expected_tokens.tolist()}",
        )
        unchanged = all(torch.equal(full_tensor(p), params_before[n]) for n, p in model.named_parameters())
        merged_after = any(m.merged for _, m in lora.lora_layers(model))
        record(
            "generate_leaves_shards_unchanged",
            unchanged and not merged_after,
            f"{unchanged=} {merged_after=}",
        )

        # 6. Checkpoint: only adapters and their optimizer state; the resume repeats the next step exactly.
        model.train()
        cfg = PPOConfig()
        cfg.model.path = base_path
        cfg.actor.lora = actor_lora()
        opt = adamw(model)
        actor_loss(model, mine, True).backward()
        opt.step()
        opt.zero_grad()
        run = root / "run"
        ckpt = checkpoint_files.save(
            run,
            1,
            models={"actor": model},
            optimizers={"actor": opt},
            schedulers={},
            extra={},
            config_yaml=to_yaml(cfg),
            rank=rank,
            world_size=world,
            keep=0,
        )
        metadata = dcp.FileSystemReader(str(ckpt / "dcp")).read_metadata().state_dict_metadata
        tensors = {k: v for k, v in metadata.items() if hasattr(v, "size")}
        bad = [k for k in metadata if ".lora_" not in k and not k.startswith("actor.optim.param_groups.")]
        record(
            "checkpoint_trainable_only", tensors and not bad, f"{len(metadata)} keys; not adapters: {bad[:4]}"
        )
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        # Adapters + Adam's two moments, fp32, and one step counter per adapter tensor: nothing else.
        num_bytes = sum(math.prod(v.size) * v.properties.dtype.itemsize for v in tensors.values())
        counters = sum(
            math.prod(v.size) * v.properties.dtype.itemsize for k, v in tensors.items() if k.endswith(".step")
        )
        size = sum(f.stat().st_size for f in (ckpt / "dcp").iterdir())
        full = 3 * 4 * sum(p.numel() for p in base.parameters())  # full fine-tuning: weights + 2 moments
        record(
            "checkpoint_small",
            num_bytes - counters == 3 * 4 * trainable and size < 0.2 * full,
            f"tensors {num_bytes} bytes ({counters} of step counters) for {trainable} trainable parameters; "
            f"files {size} bytes, full fine-tuning's tensors {full} bytes",
        )

        # 7. Exports of the trained sharded model (as the checkpoint holds it).
        model.eval()
        tokenizer = load_tokenizer(base_path)
        with torch.no_grad(), sharding.gathered_for_generation(model):
            trained_tokens = model.generate(prompts, **kwargs)
        with torch.no_grad():
            trained_logits = causal_lm_logits(model, ids, pos)
        lora.save_hf(model, tokenizer, root / "export_merged", is_main=info.is_main, merged=True)
        plain = AutoModelForCausalLM.from_pretrained(root / "export_merged")
        with safe_open(str(root / "export_merged" / "model.safetensors"), "pt") as f:
            leftovers = [k for k in f.keys() if "lora" in k or "base_layer" in k]
        with torch.no_grad():
            tokens = plain.generate(prompts, **kwargs)
        record(
            "export_merged_plain_transformers",
            torch.equal(tokens, trained_tokens)
            and not leftovers
            and type(plain).__name__ == "LlamaForCausalLM",
            f"{tokens.tolist()} vs {trained_tokens.tolist()}; adapter keys left: {leftovers[:2]}",
        )
        lora.save_hf(model, tokenizer, root / "export_adapter", is_main=info.is_main, merged=False)
        adapter_config = json.loads((root / "export_adapter" / "adapter_config.json").read_text())
        loaded = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(base_path), root / "export_adapter"
        )
        with torch.no_grad():
            diff = max_diff(causal_lm_logits(loaded, ids, pos), trained_logits)
        size = (root / "export_adapter" / "adapter_model.safetensors").stat().st_size
        record(
            "export_adapter_loads_with_peft",
            diff <= 1e-5
            and sorted(adapter_config["target_modules"]) == sorted(LINEAR)
            and size < 0.1 * full / 3,
            f"{diff=:.3g} target_modules={adapter_config['target_modules']} {size=}",
        )
        model.train()

        def next_step(m: nn.Module, o: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
            actor_loss(m, mine, True).backward()
            o.step()
            return {n: full_tensor(p).clone() for n, p in m.named_parameters() if p.requires_grad}

        straight = next_step(model, opt)
        resumed_model = sharded_actor()
        resumed_opt = adamw(resumed_model)
        checkpoint_files.load(
            ckpt,
            models={"actor": resumed_model},
            optimizers={"actor": resumed_opt},
            schedulers={},
            rank=rank,
            world_size=world,
        )
        resumed = next_step(resumed_model, resumed_opt)
        exact = all(torch.equal(resumed[n], straight[n]) for n in straight)
        record("checkpoint_resumes_exactly", exact, "adapters after the step after the checkpoint")
        del resumed_model, resumed_opt

        dist.barrier()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
