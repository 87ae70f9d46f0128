"""What one of verl's keys can mean here, and the rows the table of ``ppo.verl_keys`` is built from.

``VerlKey`` is one row's meaning: renamed to one of our keys (``renamed_to``), accepted and ignored with a
start-up warning because it changes nothing here (``ignored``), or refused with the reason (``refused``).
Beside it: the reasons many rows share (``ENGINE``, ``RAY``, ``PACKED``, ...), verl's short dtype names,
and the rows verl repeats for each role (its optimizer, FSDP, model and quantization-aware-training keys:
``optim_keys``, ``fsdp_keys``, ``model_keys``, ``qat_keys``). ``ppo.verl_keys`` writes its table with them;
``ppo.verl_translation`` reads a row's fields. Standard library only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class VerlKey:
    """What one of verl's keys (or, ending in ``.*``, every key of a verl section) means here.

    A value in ``harmless`` states what this trainer does anyway and is accepted silently; otherwise
    the key is renamed to ``ours`` (through ``values``), or accepted and ignored with a start-up warning
    (``ignored``: True for every value, or the values it covers), or refused with ``reason``."""

    ours: str | None = None
    """Our key of the same meaning."""
    values: Mapping[Any, Any] = dataclasses.field(default_factory=dict)
    """verl's values that we spell differently (its -1 for "no top-k" is our 0)."""
    reason: str = ""
    """Why the key does not apply here (for an ignored or a refused value)."""
    harmless: tuple[Any, ...] = ()
    """Values that state what this trainer does anyway (``multi_turn.enable=false``)."""
    ignored: bool | tuple[Any, ...] = False
    """Accepted with a warning, because it changes nothing here (a vLLM memory fraction)."""


def renamed_to(key: str, values: Mapping[Any, Any] | None = None, harmless: tuple[Any, ...] = ()) -> VerlKey:
    return VerlKey(ours=key, values=values or {}, harmless=harmless)


def ignored(reason: str, harmless: tuple[Any, ...] = ()) -> VerlKey:
    return VerlKey(reason=reason, ignored=True, harmless=harmless)


def refused(reason: str, harmless: tuple[Any, ...] = (None,)) -> VerlKey:
    return VerlKey(reason=reason, harmless=harmless)


ENGINE = (
    "a setting of verl's inference engine (vLLM, SGLang); this trainer samples with Hugging Face generate "
    "on the actor's own weights, in the training processes"
)
ENGINE_NAME = (
    "verl's inference engine; this trainer samples with Hugging Face generate on the actor's own weights, "
    "in the training processes (the same n, temperature, top_p, top_k and lengths), so the engine's own "
    "settings (gpu_memory_utilization, tensor_model_parallel_size, max_num_batched_tokens, enforce_eager, "
    "free_cache_engine, ...) are ignored"
)
TOOLS = (
    "verl's tools, interactions and agent loop do not run here, and without them the run would be "
    "single-turn; here a multi-turn rollout talks to an environment class: write "
    "rollout.multi_turn.enable=true rollout.multi_turn.env=path/to/file.py:Class (reset(row) -> first "
    "observation or None; step(action_text) -> (observation, reward, done)) and rollout.multi_turn.stop=[...] "
    "(the strings that end a turn)"
)
TOOLS_IGNORED = (
    "verl's tool and interaction settings; the environment of rollout.multi_turn.env answers the turns here"
)
HYDRA = (
    "Hydra's composition of verl's config files; the file is read alone here, over this trainer's "
    "defaults (configs/verl_base.yaml holds verl 0.9.1's)"
)
RAY = "a Ray setting; this trainer is one SPMD program under torchrun, without Ray"
PROFILER = "verl's profiler; this trainer's is trainer.profile_steps (the torch profiler)"
PACKED = "sequences are always packed without padding here"
COMPILE = (
    "it compiles verl's log-prob computation; here the chunked kernels (actor.kernel_backend) compute it"
)
ENTROPY = "the entropy is always computed in chunks here, without the full logits (actor.kernel_backend)"
SEEDED = "everything is seeded from trainer.seed here"
OVERLONG_LOGGED = (
    "the overlong penalty is always logged here (reward/overlong_penalty, reward/overlong_ratio)"
)
STRATEGY = "this trainer shards with FSDP2 (fully_shard per decoder layer)"
REWARD_WORKERS = (
    "verl's reward workers (Ray actors, and their GPUs); here each rank scores its own responses (a "
    "reward model is sharded over every rank), and reward.pool_workers starts a per-rank process pool "
    "for the rule reward"
)
DTYPES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
"""verl's short dtype names."""


def global_micro(ours: str) -> VerlKey:
    return refused(
        f"verl's deprecated global micro-batch size; give {ours} (sequences per GPU) = it / the number of GPUs"
    )


def optim_keys(role: str) -> dict[str, VerlKey]:
    """``<role>.optim``'s keys that verl has and we spell otherwise (lr, betas, weight_decay,
    lr_warmup_steps, lr_warmup_steps_ratio and min_lr_ratio match)."""
    p = f"{role}.optim"
    adamw = "the optimizer is torch.optim.AdamW here"
    return {
        f"{p}.warmup_style": renamed_to(f"{p}.lr_scheduler"),
        f"{p}.lr_scheduler_type": renamed_to(f"{p}.lr_scheduler"),
        f"{p}.clip_grad": renamed_to(f"{role}.grad_clip"),
        f"{p}.total_training_steps": ignored(
            "verl fills it in from the run's length; here the schedule follows trainer.total_training_steps"
        ),
        f"{p}.num_cycles": refused("the cosine schedule is half a cycle here (num_cycles=0.5)", (0.5,)),
        f"{p}.optimizer": refused(adamw, ("AdamW", "adamw")),
        f"{p}.optimizer_impl": refused(adamw, ("torch.optim",)),
        f"{p}.override_optimizer_config": refused(f"the optimizer takes {p}.* alone here", (None, {})),
        # The schedule here counts optimizer steps from 0, as verl's default does.
        f"{p}.zero_indexed_step": refused("the learning-rate schedule counts steps from 0 here", (True,)),
    }


def fsdp_keys(verl: str, ours: str, sp_key: str | None, dtype_key: str | None) -> dict[str, VerlKey]:
    """A role's ``fsdp_config`` (``verl``) as our ``fsdp`` section (``ours``); ``sp_key``: the role's
    sequence-parallel size; ``dtype_key``: where its ``model_dtype`` goes (None: every model loads in
    model.dtype)."""
    rules = {
        f"{verl}.{k}": renamed_to(f"{ours}.{k}")
        for k in ("param_offload", "reshard_after_forward", "fsdp_size", "forward_prefetch")
    }
    only_with_params = (
        f"the optimizer state is offloaded with the parameters here: set {ours}.param_offload=true "
        "(it keeps parameters, gradients and optimizer state on CPU)"
    )
    same_dtype = "every model loads in model.dtype here"
    rules |= {
        # FSDP2's CPUOffloadPolicy, which is what our param_offload is.
        f"{verl}.offload_policy": renamed_to(f"{ours}.param_offload", harmless=(False,)),
        # Accepted with param_offload=true (see verl_translation._combine), refused alone; a frozen model
        # has neither.
        **{
            f"{verl}.{k}": refused(only_with_params, (False, None))
            if ours.split(".")[0] in ("actor", "critic")
            else ignored("this model is frozen: it has no optimizer state or gradients", (False, None))
            for k in ("optimizer_offload", "grad_offload")
        },
        f"{verl}.wrap_policy.*": ignored("FSDP2 shards each decoder layer, then the root, here"),
        f"{verl}.dtype": renamed_to(f"{ours}.mixed_precision.param_dtype", DTYPES),
        f"{verl}.mixed_precision.param_dtype": renamed_to(f"{ours}.mixed_precision.param_dtype", DTYPES),
        f"{verl}.mixed_precision.reduce_dtype": renamed_to(f"{ours}.mixed_precision.reduce_dtype", DTYPES),
        f"{verl}.mixed_precision.buffer_dtype": ignored("buffers keep the model's dtype here"),
        f"{verl}.model_dtype": renamed_to(dtype_key, DTYPES)
        if dtype_key
        else refused(same_dtype, ("fp32", "float32", None)),
        f"{verl}.use_orig_params": ignored("FSDP2 has no flat parameters"),
        f"{verl}.seed": ignored(SEEDED),
        f"{verl}.full_determinism": refused("not available here", (False,)),
        f"{verl}.entropy_from_logits_with_chunking": ignored(ENTROPY),
        f"{verl}.entropy_checkpointing": ignored(ENTROPY),
        f"{verl}.use_torch_compile": ignored(COMPILE),
        f"{verl}.forward_only": ignored("verl sets it for each role"),
        f"{verl}.strategy": refused(STRATEGY, ("fsdp", "fsdp2")),
        f"{verl}.entropy_from_logits_chunk_size": ignored(ENTROPY),
        f"{verl}.use_no_sync_for_gradient_accumulation": ignored(
            "gradients are reduced by FSDP2 as each micro-batch's backward ends here (memory and speed only)"
        ),
        f"{verl}.pad_to_length": ignored(PACKED, (False,)),
        f"{verl}.pad_to_length_bucket": ignored(PACKED),
        f"{verl}.turbo_config.*": ignored(
            "settings of verl's VeOmni/Automodel engine; this trainer shards with FSDP2"
        ),
        **qat_keys(verl),
    }
    rules[f"{verl}.ulysses_sequence_parallel_size"] = (
        renamed_to(sp_key) if sp_key else refused("this model runs without sequence parallelism here", (1,))
    )
    return rules


def qat_keys(p: str) -> dict[str, VerlKey]:
    """verl's quantization-aware training (``<p>.qat``): refused when turned on."""
    return {
        f"{p}.qat.enable": refused("quantization-aware training is not available here", (False,)),
        f"{p}.qat.*": ignored("used only with qat.enable=true"),
    }


def override_config_key(p: str) -> dict[str, VerlKey]:
    """verl's ``<p>.override_config``: ours for the actor (``model``) and the critic, refused for others."""
    if p == "model":
        return {}  # the same key here
    if p == "critic.model":
        return {f"{p}.override_config": renamed_to("critic.override_config")}
    return {f"{p}.override_config": refused("this model's config is used as saved", (None, {}))}


def model_keys(p: str, lora: str | None) -> dict[str, VerlKey]:
    """The model keys verl has for the actor (``actor_rollout_ref.model``), the critic and the reward
    model (``<role>.model``), in ``p``; ``lora``: the section their LoRA keys go to."""
    rules = {
        f"{p}.use_shm": ignored("models load from the file system here"),
        f"{p}.external_lib": refused(
            "no module is imported for the model here (model.trust_remote_code=true runs a checkpoint's own code)"
        ),
        **override_config_key(p),
        f"{p}.enable_activation_offload": refused(
            "activation offload is not available here; model.enable_gradient_checkpointing=true saves activations",
            (False, None),
        ),
        f"{p}.use_remove_padding": ignored(PACKED, (True,)),
        f"{p}.tiled_mlp.enabled": refused("tiled MLPs are not available here", (False,)),
        f"{p}.tiled_mlp.num_shards": ignored("used only with tiled_mlp.enabled=true"),
        f"{p}.use_liger": ignored("Liger's kernels: this trainer's are actor.kernel_backend", (False,)),
        f"{p}.use_fused_kernels": renamed_to("actor.use_fused_kernels")
        if p == "model"
        else ignored("fused kernels: actor.use_fused_kernels here"),
    }
    if lora:
        rules |= {
            f"{p}.lora_rank": renamed_to(f"{lora}.rank"),
            f"{p}.lora_alpha": renamed_to(f"{lora}.alpha"),
            f"{p}.target_modules": renamed_to(f"{lora}.target_modules"),
            f"{p}.exclude_modules": refused(f"name the layers to adapt in {lora}.target_modules", (None, "")),
        }
    rules |= {
        f"{p}.hf_config_path": refused("the model's config is read from its path"),
        f"{p}.custom_chat_template": refused(
            "prompts are rendered with the tokenizer's chat template: save yours in the tokenizer "
            "(tokenizer.chat_template) and point model.tokenizer_path at it"
        ),
        f"{p}.lora_adapter_path": refused(
            "point the model's path at the adapter folder (its base model is read from adapter_config.json)"
        ),
        # verl's `model.lora` block is its Megatron engine's LoRA; with FSDP verl reads lora_rank.
        f"{p}.lora.rank": refused(
            f"verl's Megatron LoRA block; with FSDP verl takes lora_rank, which is {lora}.rank here", (0,)
        ),
        f"{p}.lora.*": ignored("verl's Megatron LoRA block, used only with lora.rank > 0"),
        f"{p}.target_parameters": refused("LoRA adapts the layers of target_modules here", (None, [])),
        f"{p}.mtp.enable": refused("multi-token prediction is not available here", (False,)),
        f"{p}.mtp.*": ignored("used only with mtp.enable=true"),
        f"{p}.fused_kernel_options.*": ignored("fused kernels: actor.kernel_backend here"),
    }
    return rules
