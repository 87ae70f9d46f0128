"""verl's keys and what each means here: the table, and the translation ``load_config`` applies with it
to a verl command line or YAML file (``from_verl``, ``verl_defaults``).

``VERL_KEYS`` lists, in our section names (``VERL_SECTIONS`` renames verl's first), every key of verl's
``ppo_trainer.yaml`` (and older spellings its examples still use) that is not ours as it is: renamed to
one of ours (``renamed_to``), accepted and ignored with a start-up warning because it changes nothing here
(vLLM's memory fraction, Ray), or refused with the reason (``rollout.name=vllm``). Keys verl shares with
us (``data.train_batch_size``) are not listed. Importing this module costs nothing but the standard
library and the schema (``ppo.config``, read for types only).
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Hashable, Mapping
from typing import TYPE_CHECKING, Any

from ppo.config_keys import Leaf, all_keys, closest_keys, show

if TYPE_CHECKING:
    from ppo.config import PPOConfig

VERL_SECTIONS = {
    "actor_rollout_ref.actor": "actor",
    "actor_rollout_ref.rollout": "rollout",
    "actor_rollout_ref.ref": "ref",
    "actor_rollout_ref.model": "model",
    "reward_model": "reward",
    # verl 0.9.1 moved the reward keys under `reward`; its older top-level spellings keep working.
    "reward.custom_reward_function": "custom_reward_function",
    "reward.reward_manager": "reward_manager",
    "reward.reward_model": "reward.model",
    "sandbox_fusion": "reward.sandbox_fusion",
}
"""verl's sections and ours of the same meaning: a key under one is first renamed into the other, then
looked up in ``VERL_KEYS`` (so ``actor.fsdp_config.param_offload``, half verl's, works too)."""


def renamed(path: tuple[Any, ...]) -> tuple[Any, ...]:
    """A key with verl's section names (``VERL_SECTIONS``) renamed into ours."""
    if not all(isinstance(p, str) for p in path):
        return path
    dotted = ".".join(path)
    for verl, ours in VERL_SECTIONS.items():
        if dotted == verl or dotted.startswith(verl + "."):
            return tuple((ours + dotted[len(verl) :]).split("."))
    return path


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


def _ignored(reason: str, harmless: tuple[Any, ...] = ()) -> VerlKey:
    return VerlKey(reason=reason, ignored=True, harmless=harmless)


def _refused(reason: str, harmless: tuple[Any, ...] = (None,)) -> VerlKey:
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
COMPILE = "it compiles verl's log-prob computation; here the chunked kernels (actor.kernels) compute it"
ENTROPY = "the entropy is always computed in chunks here, without the full logits (actor.kernels)"
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


def _global_micro(ours: str) -> VerlKey:
    return _refused(
        f"verl's deprecated global micro-batch size; give {ours} (sequences per GPU) = it / the number of GPUs"
    )


def _optim(role: str) -> dict[str, VerlKey]:
    """``<role>.optim``'s keys that verl has and we spell otherwise (lr, betas, weight_decay,
    lr_warmup_steps, lr_warmup_steps_ratio and min_lr_ratio match)."""
    p = f"{role}.optim"
    adamw = "the optimizer is torch.optim.AdamW here"
    return {
        f"{p}.warmup_style": renamed_to(f"{p}.lr_scheduler"),
        f"{p}.lr_scheduler_type": renamed_to(f"{p}.lr_scheduler"),
        f"{p}.clip_grad": renamed_to(f"{role}.grad_clip"),
        f"{p}.total_training_steps": _ignored(
            "verl fills it in from the run's length; here the schedule follows trainer.total_training_steps"
        ),
        f"{p}.num_cycles": _refused("the cosine schedule is half a cycle here (num_cycles=0.5)", (0.5,)),
        f"{p}.optimizer": _refused(adamw, ("AdamW", "adamw")),
        f"{p}.optimizer_impl": _refused(adamw, ("torch.optim",)),
        f"{p}.override_optimizer_config": _refused(f"the optimizer takes {p}.* alone here", (None, {})),
        # The schedule here counts optimizer steps from 0, as verl's default does.
        f"{p}.zero_indexed_step": _refused("the learning-rate schedule counts steps from 0 here", (True,)),
    }


def _fsdp(verl: str, ours: str, sp_key: str | None, dtype_key: str | None) -> dict[str, VerlKey]:
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
        # Accepted with param_offload=true (see _combine), refused alone; a frozen model has neither.
        **{
            f"{verl}.{k}": _refused(only_with_params, (False, None))
            if ours.split(".")[0] in ("actor", "critic")
            else _ignored("this model is frozen: it has no optimizer state or gradients", (False, None))
            for k in ("optimizer_offload", "grad_offload")
        },
        f"{verl}.wrap_policy.*": _ignored("FSDP2 shards each decoder layer, then the root, here"),
        f"{verl}.dtype": renamed_to(f"{ours}.mixed_precision.param_dtype", DTYPES),
        f"{verl}.mixed_precision.param_dtype": renamed_to(f"{ours}.mixed_precision.param_dtype", DTYPES),
        f"{verl}.mixed_precision.reduce_dtype": renamed_to(f"{ours}.mixed_precision.reduce_dtype", DTYPES),
        f"{verl}.mixed_precision.buffer_dtype": _ignored("buffers keep the model's dtype here"),
        f"{verl}.model_dtype": renamed_to(dtype_key, DTYPES)
        if dtype_key
        else _refused(same_dtype, ("fp32", "float32", None)),
        f"{verl}.use_orig_params": _ignored("FSDP2 has no flat parameters"),
        f"{verl}.seed": _ignored(SEEDED),
        f"{verl}.full_determinism": _refused("not available here", (False,)),
        f"{verl}.entropy_from_logits_with_chunking": _ignored(ENTROPY),
        f"{verl}.entropy_checkpointing": _ignored(ENTROPY),
        f"{verl}.use_torch_compile": _ignored(COMPILE),
        f"{verl}.forward_only": _ignored("verl sets it for each role"),
        f"{verl}.strategy": _refused(STRATEGY, ("fsdp", "fsdp2")),
        f"{verl}.entropy_from_logits_chunk_size": _ignored(ENTROPY),
        f"{verl}.use_no_sync_for_gradient_accumulation": _ignored(
            "gradients are reduced by FSDP2 as each micro-batch's backward ends here (memory and speed only)"
        ),
        f"{verl}.pad_to_length": _ignored(PACKED, (False,)),
        f"{verl}.pad_to_length_bucket": _ignored(PACKED),
        f"{verl}.turbo_config.*": _ignored(
            "settings of verl's VeOmni/Automodel engine; this trainer shards with FSDP2"
        ),
        **_qat(verl),
    }
    rules[f"{verl}.ulysses_sequence_parallel_size"] = (
        renamed_to(sp_key) if sp_key else _refused("this model runs without sequence parallelism here", (1,))
    )
    return rules


def _qat(p: str) -> dict[str, VerlKey]:
    """verl's quantization-aware training (``<p>.qat``): refused when turned on."""
    return {
        f"{p}.qat.enable": _refused("quantization-aware training is not available here", (False,)),
        f"{p}.qat.*": _ignored("used only with qat.enable=true"),
    }


def _model(p: str, lora: str | None) -> dict[str, VerlKey]:
    """The model keys verl has for the actor (``actor_rollout_ref.model``), the critic and the reward
    model (``<role>.model``), in ``p``; ``lora``: the section their LoRA keys go to."""
    rules = {
        f"{p}.use_shm": _ignored("models load from the file system here"),
        f"{p}.external_lib": _refused(
            "no module is imported for the model here (model.trust_remote_code=true runs a checkpoint's own code)"
        ),
        f"{p}.override_config": _refused("the model's config is used as saved", (None, {})),
        f"{p}.enable_activation_offload": _refused(
            "activation offload is not available here; model.enable_gradient_checkpointing=true saves activations",
            (False, None),
        ),
        f"{p}.use_remove_padding": _ignored(PACKED, (True,)),
        f"{p}.tiled_mlp.enabled": _refused("tiled MLPs are not available here", (False,)),
        f"{p}.tiled_mlp.num_shards": _ignored("used only with tiled_mlp.enabled=true"),
        f"{p}.use_liger": _ignored("Liger's kernels: this trainer's are actor.kernels", (False,)),
        f"{p}.use_fused_kernels": renamed_to("actor.use_fused_kernels")
        if p == "model"
        else _ignored("fused kernels: actor.use_fused_kernels here"),
    }
    if lora:
        rules |= {
            f"{p}.lora_rank": renamed_to(f"{lora}.rank"),
            f"{p}.lora_alpha": renamed_to(f"{lora}.alpha"),
            f"{p}.target_modules": renamed_to(f"{lora}.target_modules"),
            f"{p}.exclude_modules": _refused(
                f"name the layers to adapt in {lora}.target_modules", (None, "")
            ),
        }
    rules |= {
        f"{p}.hf_config_path": _refused("the model's config is read from its path"),
        f"{p}.custom_chat_template": _refused(
            "prompts are rendered with the tokenizer's chat template: save yours in the tokenizer "
            "(tokenizer.chat_template) and point model.tokenizer_path at it"
        ),
        f"{p}.lora_adapter_path": _refused(
            "point the model's path at the adapter folder (its base model is read from adapter_config.json)"
        ),
        # verl's `model.lora` block is its Megatron engine's LoRA; with FSDP verl reads lora_rank.
        f"{p}.lora.rank": _refused(
            f"verl's Megatron LoRA block; with FSDP verl takes lora_rank, which is {lora}.rank here", (0,)
        ),
        f"{p}.lora.*": _ignored("verl's Megatron LoRA block, used only with lora.rank > 0"),
        f"{p}.target_parameters": _refused("LoRA adapts the layers of target_modules here", (None, [])),
        f"{p}.mtp.enable": _refused("multi-token prediction is not available here", (False,)),
        f"{p}.mtp.*": _ignored("used only with mtp.enable=true"),
        f"{p}.fused_kernel_options.*": _ignored("fused kernels: actor.kernels here"),
    }
    return rules


VERL_KEYS: dict[str, VerlKey] = {
    # ---------------------------------------------------------------- actor_rollout_ref.actor
    "actor.strategy": _refused(STRATEGY, ("fsdp", "fsdp2")),
    "actor.ppo_micro_batch_size": _global_micro("actor.ppo_micro_batch_size_per_gpu"),
    "actor.rollout_n": _ignored("verl fills it in from rollout.n"),
    "actor.use_remove_padding": _ignored(PACKED, (True,)),
    "actor.use_torch_compile": _ignored(COMPILE),
    "actor.entropy_from_logits_with_chunking": _ignored(ENTROPY),
    "actor.entropy_checkpointing": _ignored(ENTROPY),
    "actor.calculate_entropy": _ignored("the entropy is always computed and logged here (actor/entropy)"),
    "actor.tau_pos": _ignored("a parameter of verl's SAPO loss, which this trainer does not have"),
    "actor.tau_neg": _ignored("a parameter of verl's SAPO loss, which this trainer does not have"),
    "actor.use_prefix_grouper": _refused("not available here", (False,)),
    "actor.calculate_sum_pi_squared": _refused("not available here", (False,)),
    "actor.sum_pi_squared_checkpointing": _ignored("used only with calculate_sum_pi_squared"),
    "actor.freeze_vision_tower": _refused("vision-language models are not supported here", (False,)),
    "actor.data_loader_seed": _ignored(SEEDED),
    "actor.checkpoint.async_save": renamed_to("trainer.async_save"),
    "actor.checkpoint.*": _ignored("a checkpoint holds every model, optimizer and loader state here"),
    "actor.profiler.*": _ignored(PROFILER),
    "actor.router_replay.mode": _refused("MoE router replay is not available here", ("disabled",)),
    "actor.router_replay.*": _ignored("used only with router_replay.mode"),
    "actor.entropy_from_logits_chunk_size": _ignored(ENTROPY),
    "actor.pad_to_length": _ignored(PACKED, (False,)),
    "actor.policy_loss.dro_beta": _ignored(
        "a parameter of verl's DRO loss, which this trainer does not have"
    ),
    **_qat("actor"),
    # ---------------------------------------------------------------- actor_rollout_ref.ref
    "ref.log_prob_micro_batch_size": _global_micro("ref.log_prob_micro_batch_size_per_gpu"),
    "ref.log_prob_use_dynamic_bsz": _ignored(
        "the reference's forward uses actor.use_dynamic_bsz here (memory and speed only)"
    ),
    "ref.log_prob_max_token_len_per_gpu": _ignored(
        "the reference's forward uses actor.ppo_max_token_len_per_gpu here (memory and speed only)"
    ),
    "ref.model": _refused("the reference's weights are ref.model_path here"),
    "ref.model.path": renamed_to("ref.model_path"),
    "ref.strategy": _refused(STRATEGY, ("fsdp", "fsdp2")),
    "ref.rollout_n": _ignored("verl fills it in from rollout.n"),
    "ref.use_torch_compile": _ignored(COMPILE),
    "ref.entropy_from_logits_with_chunking": _ignored(ENTROPY),
    "ref.entropy_checkpointing": _ignored(ENTROPY),
    "ref.profiler.*": _ignored(PROFILER),
    "ref.router_replay.*": _ignored("MoE router replay is not available here"),
    "ref.entropy_from_logits_chunk_size": _ignored(ENTROPY),
    "ref.pad_to_length": _ignored(PACKED, (False,)),
    # ---------------------------------------------------------------- actor_rollout_ref.rollout
    # verl's scripts all name an engine; the sampling they ask for (n, temperature, top_p, top_k, lengths)
    # is the same with generate, and the engine's own settings are ignored (ENGINE rows below).
    "rollout.name": VerlKey(reason=ENGINE_NAME, ignored=("vllm", "sglang"), harmless=("hf", "???")),
    "rollout.mode": _ignored("verl's sync or async engine; generation runs in the training processes here"),
    "rollout.top_k": renamed_to("rollout.top_k", {-1: 0}),
    # Equal to the data's lengths (verl's default) they are dropped by from_verl; otherwise refused.
    "rollout.prompt_length": _refused("ours is data.max_prompt_length; give the value there"),
    "rollout.response_length": _refused("ours is data.max_response_length; give the value there"),
    "rollout.dtype": _ignored(
        "the rollout runs on the actor's weights, in actor.fsdp.mixed_precision.param_dtype"
    ),
    "rollout.enforce_eager": _ignored(f"{ENGINE}; compiled decoding is rollout.compile"),
    "rollout.micro_batch_size": _ignored(
        f"{ENGINE}; sequences per generate call on one rank are rollout.micro_batch_size_per_gpu"
    ),
    "rollout.log_prob_micro_batch_size": _ignored(
        "the old log-probs are scored in the actor's micro-batches here (memory and speed only)"
    ),
    "rollout.log_prob_micro_batch_size_per_gpu": _ignored(
        "the old log-probs are scored in the actor's micro-batches here (memory and speed only)"
    ),
    "rollout.log_prob_use_dynamic_bsz": _ignored("the old log-probs use actor.use_dynamic_bsz here"),
    "rollout.log_prob_max_token_len_per_gpu": _ignored(
        "the old log-probs use actor.ppo_max_token_len_per_gpu here"
    ),
    "rollout.over_sample_rate": _ignored(
        "verl's engine aborts the slowest requests of a batch; here every sampled response is completed and "
        "trained on",
        (0, 0.0),
    ),
    "rollout.calculate_log_probs": _ignored(
        "the sampler is the actor itself here; the trainer scores the old log-probs"
    ),
    # verl's 0 is greedy (ours: val_kwargs.do_sample=false, the default); its top_k -1 is our 0.
    "rollout.val_kwargs.temperature": renamed_to("rollout.val_kwargs.temperature", harmless=(0, 0.0)),
    "rollout.val_kwargs.top_k": renamed_to("rollout.val_kwargs.top_k", {-1: 0}),
    "rollout.multi_turn.enable": renamed_to("rollout.multi_turn.enable"),
    "rollout.multi_turn.max_assistant_turns": renamed_to("rollout.multi_turn.max_assistant_turns"),
    "rollout.multi_turn.max_tool_response_length": renamed_to("rollout.multi_turn.max_tool_response_length"),
    "rollout.multi_turn.tool_config_path": _ignored(TOOLS_IGNORED),
    "rollout.multi_turn.function_tool_path": _ignored(TOOLS_IGNORED),
    "rollout.multi_turn.interaction_config_path": _ignored(TOOLS_IGNORED),
    "rollout.multi_turn.*": _ignored(
        "verl's tool and agent-loop settings; here the environment is a class with reset and step "
        "(rollout.multi_turn.env) and turns end at rollout.multi_turn.stop"
    ),
    "rollout.skip_rollout": _refused("rollouts are always generated here", (False,)),
    "rollout.skip_dump_dir": _ignored("used only with rollout.skip_rollout=true"),
    "rollout.enable_rollout_routing_replay": _refused("MoE routing replay is not available here", (False,)),
    "rollout.quantization": _refused("the rollout runs on the actor's own (unquantized) weights"),
    "rollout.quantization_config_file": _refused("the rollout runs on the actor's own (unquantized) weights"),
    "rollout.mtp": _refused("multi-token prediction is not available here"),
    "rollout.profiler.*": _ignored(PROFILER),
    "rollout.mtp.enable": _refused("multi-token prediction is not available here", (False,)),
    "rollout.mtp.*": _ignored("used only with rollout.mtp.enable=true"),
    "rollout.full_determinism": _refused("not available here", (False,)),
    "rollout.seed": _ignored(SEEDED),
    "rollout.nnodes": _ignored(
        "verl's standalone rollout replicas; generation runs on the training ranks here"
    ),
    "rollout.n_gpus_per_node": _ignored(
        "verl's standalone rollout replicas; generation runs on the training ranks here"
    ),
    **_qat("rollout"),
    **{
        f"rollout.{k}": _ignored(ENGINE)
        for k in (
            "gpu_memory_utilization",
            "cudagraph_capture_sizes",
            "free_cache_engine",
            "tensor_model_parallel_size",
            "data_parallel_size",
            "expert_parallel_size",
            "pipeline_model_parallel_size",
            "max_num_batched_tokens",
            "max_model_len",
            "max_num_seqs",
            "enable_chunked_prefill",
            "enable_prefix_caching",
            "logprobs_mode",
            "scheduling_policy",
            "load_format",
            "disable_log_stats",
            "engine_kwargs.*",
            "multi_stage_wake_up",
            "layered_summon",
            "update_weights_bucket_megabytes",
            "checkpoint_engine.*",
            "skip_tokenizer_init",
            "prometheus.*",
            "agent.*",
            "trace.*",
            "router_config_path",
            "moe_load_balance_metrics_interval",
            "disaggregation.*",
        )
    },
    # ---------------------------------------------------------------- actor_rollout_ref.model
    **_model("model", "actor.lora"),
    "model.hf_config_path": _refused("the model's config is read from model.path"),
    "model.custom_chat_template": _refused(
        "prompts are rendered with the tokenizer's chat template: save yours in the tokenizer "
        "(tokenizer.chat_template) and point model.tokenizer_path at it"
    ),
    "model.lora_adapter_path": _refused(
        "point model.path at the adapter folder (its base model is read from adapter_config.json)"
    ),
    "model.fused_kernel_options.impl_backend": renamed_to("actor.kernels"),
    "actor_rollout_ref.hybrid_engine": _refused(
        "the actor and the rollout always share weights here", (True,)
    ),
    "actor_rollout_ref.nccl_timeout": renamed_to("trainer.dist_timeout_s"),
    # ---------------------------------------------------------------- critic
    "critic.model.path": renamed_to("critic.model_path"),
    "critic.model.tokenizer_path": _ignored("the critic reads the policy's tokens (model.tokenizer_path)"),
    "critic.model.trust_remote_code": _refused(
        "model.trust_remote_code applies to every model here", (False, None)
    ),
    "critic.model.enable_gradient_checkpointing": _ignored(
        "the critic follows model.enable_gradient_checkpointing here (memory and speed only)"
    ),
    **_model("critic.model", "critic.lora"),
    "critic.strategy": _refused(STRATEGY, ("fsdp", "fsdp2")),
    "critic.enable": _refused("the critic is used exactly when algorithm.adv_estimator=gae here"),
    "critic.rollout_n": _ignored("verl fills it in from rollout.n"),
    "critic.ppo_micro_batch_size": _global_micro("critic.ppo_micro_batch_size_per_gpu"),
    "critic.forward_micro_batch_size": _ignored(
        "the values' forward uses the critic's micro-batches here (memory and speed only)"
    ),
    "critic.forward_micro_batch_size_per_gpu": _ignored(
        "the values' forward uses the critic's micro-batches here (memory and speed only)"
    ),
    "critic.forward_max_token_len_per_gpu": _ignored(
        "the values' forward uses critic.ppo_max_token_len_per_gpu here (memory and speed only)"
    ),
    "critic.shuffle": _ignored("the critic's mini-batches are shuffled as actor.shuffle says"),
    "critic.data_loader_seed": _ignored(SEEDED),
    "critic.checkpoint.async_save": renamed_to("trainer.async_save"),
    "critic.checkpoint.*": _ignored("a checkpoint holds every model, optimizer and loader state here"),
    "critic.profiler.*": _ignored(PROFILER),
    "critic.loss_scale_factor": _refused(
        "the critic's loss is a token mean over the mini-batch here (critic.loss_agg_mode)", (None,)
    ),
    **_qat("critic"),
    # ---------------------------------------------------------------- reward_model
    "reward.enable": renamed_to("reward.style", {True: "model"}, harmless=(False, None)),
    "reward.model.path": renamed_to("reward.model_path"),
    "reward.model.input_tokenizer": _refused(
        "the reward model scores the policy's tokens: it must share the policy's tokenizer"
    ),
    "reward.model.trust_remote_code": _refused(
        "model.trust_remote_code applies to every model here", (False, None)
    ),
    **_model("reward.model", None),
    "reward.micro_batch_size": _global_micro("reward.micro_batch_size_per_gpu"),
    "reward.max_length": _refused(
        "the reward model scores whole sequences here (data.max_prompt_length + data.max_response_length)"
    ),
    "reward.use_dynamic_bsz": _ignored("the reward model's forward uses reward.micro_batch_size_per_gpu"),
    "reward.forward_max_token_len_per_gpu": _ignored(
        "the reward model's forward uses reward.micro_batch_size_per_gpu"
    ),
    # dapo: naive's scores plus the overlong penalty, which reward.overlong_buffer adds here.
    "reward.reward_manager": _refused(
        "only verl's naive and dapo reward managers (one score per response) exist here",
        ("naive", "dapo", None),
    ),
    # verl's newer DAPO scripts pass the overlong buffer to the reward manager as keyword arguments.
    **{
        f"reward.reward_kwargs.overlong_buffer_cfg.{k}": renamed_to(f"reward.overlong_buffer.{k}")
        for k in ("enable", "len", "penalty_factor")
    },
    "reward.reward_kwargs.overlong_buffer_cfg.log": _ignored(OVERLONG_LOGGED),
    "reward.overlong_buffer.log": _ignored(OVERLONG_LOGGED),
    "reward.reward_kwargs.max_resp_len": _ignored(
        "the overlong penalty's maximum length is data.max_response_length here"
    ),
    "reward.launch_reward_fn_async": _ignored("the reward function runs in the training processes here"),
    "reward.sandbox_fusion.url": _refused("no sandbox runs code here"),
    "reward.sandbox_fusion.*": _ignored("used only with reward_model.sandbox_fusion.url"),
    "reward.strategy": _refused(STRATEGY, ("fsdp", "fsdp2")),
    "reward.profiler.*": _ignored(PROFILER),
    # verl's PRIME recipe (recipe/prime): its implicit PRM is reward.prime here (algorithm.adv_estimator=prime).
    "reward.model.beta_train": renamed_to("reward.prime.beta_train"),
    "reward.model.update": renamed_to("reward.prime.update"),
    "reward.model.loss_type": renamed_to("reward.prime.loss_type"),
    "reward.model.ref_type": _refused("the PRM's reference is the run's frozen reference model", ("freeze",)),
    "reward.model.ref_path": _ignored(
        "the PRM and its reference are the run's reference model (ref.model_path, else model.path)"
    ),
    "reward.model.optim.grad_clip": renamed_to("reward.prime.grad_clip"),
    **{
        f"reward.model.optim.{k}": renamed_to(f"reward.prime.optim.{k}")
        for k in ("lr", "weight_decay", "betas", "lr_warmup_steps", "lr_warmup_steps_ratio", "min_lr_ratio")
    },
    "reward.model.optim.warmup_style": renamed_to("reward.prime.optim.lr_scheduler"),
    "reward.model.optim.lr_scheduler_type": renamed_to("reward.prime.optim.lr_scheduler"),
    "reward.model.optim.total_training_steps": _ignored(
        "verl fills it in from the run's length; here the schedule follows trainer.total_training_steps"
    ),
    "reward.prime_norm": renamed_to("reward.prime.prime_norm"),
    "reward.prime_granularity": _refused("the PRM rewards every response token here", ("token",)),
    "reward.lambda": _refused("the PRM's token rewards are used as they are here (lambda 0)", (0, 0.0)),
    "reward.prime_use_gt": _ignored("used only with reward_model.lambda > 0"),
    "reward.mini_batch_size": renamed_to("reward.prime.mini_batch_size"),
    "data.oversample_factor": _refused(
        "the accuracy filter samples data.gen_batch_size prompts a step here: set data.gen_batch_size to "
        "oversample_factor * data.train_batch_size",
        (1, 1.0),
    ),
    "data.filter_truncate": _ignored("the accuracy filter here filters by accuracy only", (False,)),
    # verl 0.9.1's reward model block (reward.reward_model, here reward.model after VERL_SECTIONS).
    "reward.model.enable": renamed_to("reward.style", {True: "model"}, harmless=(False, None)),
    "reward.model.model_path": renamed_to("reward.model_path"),
    **{
        f"reward.model.{k}": _ignored(REWARD_WORKERS)
        for k in ("enable_resource_pool", "n_gpus_per_node", "nnodes", "num_workers")
    },
    "reward.model.rollout.*": _ignored(
        "the reward model's inference engine in verl; here the reward model scores by a forward pass on "
        "the training ranks"
    ),
    # reward.num_workers (verl's Ray reward workers, 0.6.0's reward_model.num_workers) is ours with verl's
    # meaning: it starts nothing; the rule reward's per-rank process pool is reward.pool_workers.
    "reward.reward_loop_module_path": _refused("verl's reward loops do not exist here"),
    "reward.reward_loop_class_name": _refused("verl's reward loops do not exist here"),
    **{
        f"reward.{k}": _ignored(REWARD_WORKERS)
        for k in (
            "use_reward_loop",
            "reward_loop_source",
            "enable_resource_pool",
            "n_gpus_per_node",
            "nnodes",
            "rollout.*",
        )
    },
    # ---------------------------------------------------------------- custom_reward_function (see _combine)
    "custom_reward_function.reward_kwargs": renamed_to("reward.reward_kwargs"),
    "reward_manager.source": _refused("only verl's naive and dapo reward managers exist here", ("register",)),
    "reward_manager.name": _refused(
        "only verl's naive and dapo reward managers exist here", ("naive", "dapo", None)
    ),
    "reward_manager.module.path": _refused("only verl's naive and dapo reward managers exist here"),
    "reward_manager.module.name": _ignored("used only with reward_manager.module.path"),
    # ---------------------------------------------------------------- algorithm
    "algorithm.use_pf_ppo": _refused("preference-feedback PPO is not available here", (False,)),
    "algorithm.pf_ppo.*": _ignored("used only with algorithm.use_pf_ppo=true"),
    # verl's SPPO recipe: algorithm.sppo_eta is the beta of its soft-mean baseline (actor.sppo_eta, the
    # step size, is ours as it is).
    "algorithm.sppo_eta": renamed_to("algorithm.sppo_beta"),
    "algorithm.filter_groups.max_inflight_gen_batches": _ignored(
        "generation rounds run one after another in the training processes here"
    ),
    # verl 0.9.1's rollout correction. rollout_is (token|sequence) and its rollout_is_threshold are our
    # algorithm.rollout_is=true, rollout_is_level and rollout_is_threshold (_combine); 0.6.0's spellings
    # algorithm.rollout_is* are ours. The weights apply to responses another policy sampled (offline
    # data): the actor samples its own responses here, whose weight is 1.
    "algorithm.rollout_correction.rollout_is_batch_normalize": _refused(
        "the importance weights are not renormalized to mean 1 here", (False,)
    ),
    "algorithm.rollout_correction.bypass_mode": _refused(
        "the old log-probs are always the trainer's own here (verl's decoupled mode)", (False,)
    ),
    "algorithm.rollout_correction.loss_type": _ignored(
        "used only with bypass_mode=true", ("ppo_clip", "reinforce")
    ),
    # Rejection sampling: the actor trains on the offline responses' tokens within the bounds.
    "algorithm.rollout_correction.rollout_rs": renamed_to("algorithm.rollout_rs"),
    "algorithm.rollout_correction.rollout_rs_threshold": renamed_to("algorithm.rollout_rs_threshold"),
    "algorithm.rollout_correction.*": _ignored("not a setting of verl 0.9.1's rollout correction"),
    # ---------------------------------------------------------------- data
    "data.tokenizer": _refused("ours is model.tokenizer_path"),
    "data.use_shm": _ignored("data loads from the file system here"),
    "data.train_max_samples": _refused("every training prompt is used here; cut the file", (-1, None)),
    "data.val_max_samples": renamed_to("data.max_val_samples"),
    "data.reward_fn_key": _refused(
        "the rule scorer is chosen by the data_source column here", ("data_source",)
    ),
    # Without rollout.multi_turn.env they refuse the run (_combine): the turns would be lost.
    "data.tool_config_path": _ignored(TOOLS_IGNORED),
    "data.function_tool_path": _ignored(TOOLS_IGNORED),
    "data.audio_key": _refused("audio data is not supported here", ("audios",)),
    "data.mm_processor_kwargs": _refused("vision-language data is not supported here", (None, {})),
    "data.return_raw_input_ids": _ignored("prompts are rendered and tokenized once, at start-up, here"),
    "data.return_raw_chat": _ignored("prompts are rendered and tokenized once, at start-up, here"),
    "data.return_full_prompt": _ignored("prompts are rendered and tokenized once, at start-up, here"),
    "data.seed": _refused("ours is trainer.seed (which also seeds sampling and initialization)"),
    "data.dataloader_num_workers": _ignored("prompts are tokenized once, at start-up, here"),
    "data.validation_shuffle": _ignored("the whole validation set is scored here"),
    "data.filter_overlong_prompts": _ignored(
        "over-long prompts are always dropped and counted here, never truncated", (True,)
    ),
    "data.filter_overlong_prompts_workers": _ignored("prompts are tokenized once, at start-up, here"),
    # verl truncates only prompts over data.max_prompt_length; here those are dropped and counted.
    "data.truncation": VerlKey(
        reason="prompts are never truncated here: those over data.max_prompt_length are dropped and counted",
        ignored=("left", "right", "middle"),
        harmless=("error",),
    ),
    "data.trust_remote_code": _refused("model.trust_remote_code loads the tokenizer here", (False, None)),
    "data.image_key": _refused("vision-language data is not supported here", ("images",)),
    "data.video_key": _refused("vision-language data is not supported here", ("videos",)),
    "data.image_patch_size": _ignored("vision-language data is not supported here"),
    "data.return_multi_modal_inputs": _ignored("vision-language data is not supported here"),
    "data.custom_cls.path": _refused("prompts load from Parquet, JSON lines or a saved dataset folder here"),
    "data.custom_cls.name": _ignored("used only with data.custom_cls.path"),
    "data.sampler.class_path": _refused("curriculum samplers are not available here"),
    "data.sampler.class_name": _ignored("used only with data.sampler.class_path"),
    "data.datagen.path": _refused("dynamic data generation is not available here"),
    "data.datagen.name": _ignored("used only with data.datagen.path"),
    "data.apply_chat_template_kwargs": _refused(
        "the chat template is applied with its defaults here", (None, {})
    ),
    # ---------------------------------------------------------------- trainer (see _combine)
    "trainer.default_local_dir": renamed_to("trainer.output_dir"),
    "trainer.balance_batch": _ignored(
        "each rank trains on the responses it sampled here; micro-batches are balanced by length"
    ),
    "trainer.rollout_data_dir": _refused("rollouts are not written to files here"),
    "trainer.validation_data_dir": _refused("validation generations are not written to files here"),
    "trainer.esi_redundant_time": _ignored(
        "on a stop signal (SIGTERM, as Slurm sends before a job's time ends) a checkpoint is saved here"
    ),
    "trainer.val_only": _refused("there is no validation-only mode here", (False,)),
    "trainer.default_hdfs_dir": _refused("nothing is copied to HDFS here; copy trainer.output_dir yourself"),
    "trainer.del_local_ckpt_after_load": _refused("checkpoints are kept here", (False,)),
    "trainer.ray_wait_register_center_timeout": _ignored(RAY),
    "trainer.use_legacy_worker_impl": _ignored("verl's worker implementations; there are no workers here"),
    "trainer.npu_profile.*": _ignored(PROFILER),
    # ---------------------------------------------------------------- the rest of verl
    "global_profiler.*": _ignored(PROFILER),
    "hydra.*": _ignored(HYDRA),
    "defaults": _ignored(HYDRA),
    "ray_kwargs.*": _ignored(RAY),
    "ray_init.*": _ignored(RAY),
    "transfer_queue.*": _ignored("verl's transfer queue (Ray); there is none here"),
    "distillation.enabled": _refused("distillation from teacher models is not available here", (False,)),
    "distillation.*": _ignored("used only with distillation.enabled=true"),
    "skip.rollout.enable": _refused("rollouts are always generated here", (False,)),
    "skip.rollout_tq.enable": _refused("rollouts are always generated here", (False,)),
    "skip.async_rollout.enable": _refused("rollouts are always generated here", (False,)),
    "skip.*": _ignored("used only with skip.<stage>.enable=true"),
    "trainer.use_v1": _ignored("verl's choice between its trainer implementations; there is one here"),
    "trainer.v1.trainer_mode": _refused(
        "training here is synchronous: each step generates, then updates", ("sync",)
    ),
    "trainer.v1.*": _ignored("settings of verl's asynchronous trainer modes (trainer.v1.trainer_mode)"),
    "trainer.checkpoint_callback_class": _refused("no callback runs after a checkpoint here"),
    **_optim("actor"),
    **_optim("critic"),
    **_fsdp("actor.fsdp_config", "actor.fsdp", "actor.ulysses_sequence_parallel_size", "model.dtype"),
    **_fsdp("ref.fsdp_config", "ref.fsdp", "ref.ulysses_sequence_parallel_size", None),
    **_fsdp("critic.model.fsdp_config", "critic.fsdp", "critic.ulysses_sequence_parallel_size", None),
    # verl 0.9.1's critic has its FSDP settings in critic.fsdp, our section's name.
    **_fsdp("critic.fsdp", "critic.fsdp", "critic.ulysses_sequence_parallel_size", None),
    **_fsdp("reward.model.fsdp_config", "reward.fsdp", None, None),
    "reward.ulysses_sequence_parallel_size": _refused(
        "the reward model runs without sequence parallelism here", (1,)
    ),
}
"""Every key of verl's PPO trainer (``verl/trainer/config/ppo_trainer.yaml`` and the files it composes, plus
the older spellings its examples still use) that is not ours as it is, in our section names
(``VERL_SECTIONS``): renamed, accepted and ignored, or refused. Keys verl shares with us
(``data.train_batch_size``, ``actor.ppo_mini_batch_size``, ``algorithm.kl_ctrl.kl_coef``, ...) are not
listed. A later row wins over an earlier one of the same key (the optimizer and FSDP rows come last)."""

VERL_PARENTS = frozenset(
    ".".join(parts[:n])
    for key in VERL_KEYS
    for parts in [key.removesuffix(".*").split(".")]
    for n in range(1, len(parts) + (key.endswith(".*")))
) | frozenset({"custom_reward_function", "trainer", "actor_rollout_ref"})
"""The sections of verl's keys that a nested YAML mapping or section value is walked into."""

VERL_ONLY = ("actor_rollout_ref", "custom_reward_function", "reward_manager", "global_profiler", "ray_kwargs")
"""Top-level names only verl has (after ``VERL_SECTIONS``): a key under one that is not in
``VERL_KEYS`` is unknown."""

VERL_DEFAULTS = {
    "rollout.n": 1,
    "actor.optim.lr": 1e-6,
    "actor.optim.weight_decay": 0.01,
    "critic.optim.weight_decay": 0.01,
    "actor.use_dynamic_bsz": False,
    "critic.use_dynamic_bsz": False,
    "actor.fsdp.mixed_precision.param_dtype": "bfloat16",
    "critic.fsdp.mixed_precision.param_dtype": "bfloat16",
    "ref.fsdp.mixed_precision.param_dtype": "bfloat16",
    "data.train_batch_size": 1024,
    "data.max_prompt_length": 512,
    "data.max_response_length": 512,
    "actor.ppo_mini_batch_size": 256,
    "trainer.total_epochs": 30,
}
"""verl's defaults of the keys that change what a run trains (or, for the batch sizes, its memory);
when a config uses verl's spellings, those of them that differ from ours and that it leaves unset are
named in one start-up warning."""


VERL_NULL_IS_DEFAULT = frozenset(
    {
        "actor.ppo_micro_batch_size_per_gpu",
        "ref.log_prob_micro_batch_size_per_gpu",
        "critic.ppo_micro_batch_size_per_gpu",
        "reward.micro_batch_size_per_gpu",
        "data.val_batch_size",
    }
)
"""Keys verl shares with us whose verl default is null ("derived", or "all at once"), where ours is a
number: null takes our default."""

VERL_HOMONYMS: frozenset[str] = frozenset()
"""Our keys that verl's older spelling means otherwise: their row applies to that spelling alone. None
now: ``reward.num_workers``, which was our per-rank pool, means verl's reward workers as
``reward_model.num_workers`` does (the pool is ``reward.pool_workers``)."""

VERL_VALUES: dict[str, dict[Any, Any]] = {"algorithm.filter_groups.metric": {"reward": "seq_reward"}}
"""Values of keys verl shares with us that only verl spells that way, in either spelling of the key
(verl's ``reward``: the score with the overlong penalty, before KL, is our ``seq_reward``)."""

VERL_LENGTHS = {
    "rollout.prompt_length": "data.max_prompt_length",
    "rollout.response_length": "data.max_response_length",
}
"""verl's engine lengths, which it derives from the data's; here the data's alone."""

VERL_MAPPINGS = frozenset({"custom_reward_function.reward_kwargs"})
"""verl's renamed keys whose value is a mapping, set key by key (``+custom_reward_function.reward_kwargs.a=1``)."""


# ----------------------------------------------------------------------------------------------------
# The translation
# ----------------------------------------------------------------------------------------------------


def _verl_key(key: str) -> VerlKey | None:
    """The entry of ``VERL_KEYS`` for ``key``: its own, or that of the deepest entry over it (a
    ``section.*``, or a key whose value is a mapping: ``model.override_config``)."""
    if key in VERL_KEYS:
        return VERL_KEYS[key]
    parts = key.split(".")
    for n in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:n])
        over = VERL_KEYS.get(prefix)
        if prefix + ".*" in VERL_KEYS:
            return VERL_KEYS[prefix + ".*"]
        if over is not None and over.ours is None:
            return over
        if over is not None and prefix in VERL_MAPPINGS:  # a key inside a renamed mapping
            return renamed_to(over.ours + key[len(prefix) :])
    return VERL_KEYS.get(key + ".*")


def _among(value: Any, values: tuple[Any, ...]) -> bool:
    """``value in values`` where True is not 1 and False is not 0."""
    return any(type(value) is type(v) and value == v for v in values) or (
        isinstance(value, float) and any(type(v) is int and value == v for v in values)
    )


def _optional(cls: type, dotted: str) -> bool:
    """Whether the field at ``dotted`` in ``cls`` takes null."""
    typ: Any = cls
    for part in dotted.split("."):
        typ = typing.get_type_hints(typ)[part]
    return type(None) in typing.get_args(typ)


def _value(leaves: list[Leaf], cls: type, dotted: str) -> Any:
    """The value ``dotted`` takes: its last given value, else ``cls``'s default."""
    for leaf in reversed(leaves):
        if leaf.key == dotted:
            return leaf.value
    value: Any = cls()
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def from_verl(leaves: list[Leaf], cls: type, errors: list[str], notes: list[str]) -> tuple[list[Leaf], bool]:
    """``leaves`` in our keys: verl's renamed (``VERL_KEYS``), those that change nothing here dropped
    with a message in ``notes``, those that cannot be taken dropped with one in ``errors``. Our own keys
    and unknown ones pass through (``_build`` names the unknown). Also whether any key was verl's."""
    out = []
    verl_spelled = False
    our_keys = set(all_keys(cls))
    ignored: dict[str, list[str]] = {}  # reason -> the keys it covers, for one warning each
    for leaf in _combine(_last_given(leaves, notes), errors, notes):
        key = leaf.key
        rule = _verl_key(key)
        if (
            rule is not None
            and key in our_keys
            and (leaf.given == key or (rule.ours is None and key not in VERL_HOMONYMS))
        ):
            # Our key, written our way (verl's values apply to verl's spelling: rollout.top_k=-1 is an
            # error, actor_rollout_ref.rollout.top_k=-1 our 0), or ours since the table was written;
            # a homonym's row applies to verl's other spelling (reward_model.num_workers).
            rule = None
        if key in VERL_VALUES and isinstance(leaf.value, Hashable):
            leaf = dataclasses.replace(leaf, value=VERL_VALUES[key].get(leaf.value, leaf.value))
        if key in VERL_LENGTHS and leaf.value == _value(leaves, cls, VERL_LENGTHS[key]):
            continue  # verl's default: the data's length
        if leaf.parts[-1] == "_target_" or (leaf.value is None and key in VERL_NULL_IS_DEFAULT):
            # verl's dataclass to instantiate; verl's null for "derive it", which our default does.
            verl_spelled = True
            continue
        shown = f"{leaf.given}={show.repr(leaf.value)} (from {leaf.source})"
        if isinstance(leaf.value, str) and "${" in leaf.value:  # any key: verl's YAML files have them
            errors.append(f"{shown}: an OmegaConf interpolation, which is not resolved here; give the value")
            continue
        if rule is None:
            if leaf.parts[0] in VERL_ONLY:
                close = closest_keys(key, list(VERL_KEYS) + all_keys(cls))
                hint = f"; did you mean {' or '.join(close)}?" if close else ""
                errors.append(
                    f"unknown config key {leaf.given!r} (from {leaf.source}): not a key of verl's{hint}"
                )
            else:
                out.append(leaf)
            continue
        verl_spelled |= rule.ours != key or leaf.given != key
        value = leaf.value
        if _among(value, rule.harmless):
            continue
        elif rule.ours is not None:
            value = rule.values.get(value, value) if isinstance(value, Hashable) else value
            if value is None and not _optional(cls, rule.ours):
                continue  # verl's null: "derive it"; here the field's default does
            out.append(Leaf(leaf.given, tuple(rule.ours.split(".")), value, leaf.source))
        elif rule.ignored is True or (rule.ignored and _among(value, rule.ignored)):
            ignored.setdefault(rule.reason, []).append(shown)
        else:
            errors.append(f"{shown}: {rule.reason}")
    for reason, shown_keys in ignored.items():
        notes.append(f"{', '.join(shown_keys)} {'is' if len(shown_keys) == 1 else 'are'} ignored: {reason}")
    return _last_given(out, notes), verl_spelled


def _last_given(leaves: list[Leaf], notes: list[str]) -> list[Leaf]:
    """Each key's last value only, as in Hydra: a later value replaces an earlier one (even one that
    would be refused), so a verl script's ``$@`` overrides work. A key given in two spellings with
    different values is named in ``notes``. A mapping's value (``reward.reward_kwargs``) is merged key by
    key instead, so it is kept."""
    last = {leaf.key: i for i, leaf in enumerate(leaves) if not isinstance(leaf.value, dict)}
    out = []
    for i, leaf in enumerate(leaves):
        later = leaves[last.get(leaf.key, i)]
        if later is leaf:
            out.append(leaf)
        elif later.given != leaf.given and repr(later.value) != repr(leaf.value):
            notes.append(
                f"{leaf.given}={show.repr(leaf.value)} (from {leaf.source}) and {later.given}="
                f"{show.repr(later.value)} (from {later.source}) set one key, {leaf.key}: the last given "
                f"({later.given}) is taken"
            )
    return out


def verl_defaults(cfg: PPOConfig, leaves: list[Leaf]) -> str | None:
    """The warning that names the keys of ``VERL_DEFAULTS`` that this run uses, leaves unset and has
    another default than verl's; None when there are none."""
    given = {".".join(map(str, leaf.parts[:n])) for leaf in leaves for n in range(1, len(leaf.parts) + 1)}
    unused = {"critic": not cfg.use_critic, "ref": not cfg.needs_reference}
    defaults = type(cfg)()
    differ = []
    for key, verl_value in VERL_DEFAULTS.items():
        mine: Any = defaults
        for part in key.split("."):
            mine = getattr(mine, part)
        if key not in given and mine != verl_value and not unused.get(key.partition(".")[0]):
            differ.append(f"{key}={mine} (verl: {verl_value})")
    if not differ:
        return None
    return (
        "verl's defaults differ from this trainer's for keys this config leaves unset: "
        + ", ".join(differ)
        + "; set them to train as verl would"
    )


def _combine(leaves: list[Leaf], errors: list[str], notes: list[str]) -> list[Leaf]:
    """verl's keys whose meaning here takes two of them, as ours: ``custom_reward_function.path`` and
    ``.name`` make ``reward.custom_function=path:name``; ``trainer.resume_mode=resume_path`` with
    ``trainer.resume_from_path=P`` makes ``trainer.resume_mode=P``; ``max_actor_ckpt_to_keep`` and
    ``max_critic_ckpt_to_keep`` make ``trainer.max_ckpt_to_keep``; ``optimizer_offload=true`` (or
    ``grad_offload``) is what ``param_offload=true`` does here, so it is accepted beside it."""
    last = {leaf.key: leaf for leaf in leaves}  # a later value of a key wins, as for every key
    taken = {
        "custom_reward_function.path",
        "custom_reward_function.name",
        "trainer.resume_from_path",
        "trainer.max_actor_ckpt_to_keep",
        "trainer.max_critic_ckpt_to_keep",
        "algorithm.rollout_correction.rollout_is",
        "algorithm.rollout_correction.rollout_is_threshold",
    }
    path, name = last.get("custom_reward_function.path"), last.get("custom_reward_function.name")
    function_at = function = None
    if path is not None and path.value is not None:
        spec = f"{os.path.expanduser(str(path.value))}:"
        spec += name.value if name is not None and name.value is not None else "compute_score"
        given = "custom_reward_function.path" + (" and .name" if name is not None else "")
        function = Leaf(given, ("reward", "custom_function"), spec, path.source)
        position = {id(leaf): i for i, leaf in enumerate(leaves)}
        function_at = max((p for p in (path, name) if p is not None), key=lambda p: position[id(p)])
    dropped = _without_turns(last, errors)
    out = []
    for leaf in leaves:
        key = leaf.key
        if any(leaf is d for d in dropped):
            continue
        if key.endswith((".optimizer_offload", ".grad_offload")) and leaf.value is True:
            fsdp = key.rpartition(".")[0]
            role = fsdp.removesuffix(".fsdp_config").removesuffix(".model")
            offload = [
                last[k].value
                for k in (f"{fsdp}.param_offload", f"{fsdp}.offload_policy", f"{role}.fsdp.param_offload")
                if k in last
            ]
            if True in offload:
                continue
        if key == "trainer.resume_mode" and leaf.value == "resume_path":
            path = last.get("trainer.resume_from_path")
            if path is None or path.value is None:
                errors.append(
                    f"trainer.resume_mode=resume_path (from {leaf.source}) needs trainer.resume_from_path "
                    f"(or give the checkpoint's path as trainer.resume_mode)"
                )
                continue
            leaf = Leaf(
                "trainer.resume_mode and trainer.resume_from_path", leaf.parts, path.value, path.source
            )
        if key not in taken:
            out.append(leaf)
        elif leaf is function_at:  # where it was given, so that a later reward.custom_function wins
            out.append(function)
        elif key == "algorithm.rollout_correction.rollout_is":
            out += _rollout_is(leaf, last.get("algorithm.rollout_correction.rollout_is_threshold"), errors)
    if function is None and name is not None and name.value not in (None, "compute_score"):
        notes.append(
            f"custom_reward_function.name={name.value!r} (from {name.source}) is ignored: no "
            f"custom_reward_function.path names the file it is in"
        )
    resume_from = last.get("trainer.resume_from_path")
    resume_mode = last.get("trainer.resume_mode")
    if (
        resume_from is not None
        and resume_from.value is not None
        and (resume_mode is None or resume_mode.value != "resume_path")
    ):
        notes.append(
            f"trainer.resume_from_path={resume_from.value!r} (from {resume_from.source}) is ignored: as in verl, "
            f"it is read only with trainer.resume_mode=resume_path"
        )
    keep = [
        last[k] for k in ("trainer.max_actor_ckpt_to_keep", "trainer.max_critic_ckpt_to_keep") if k in last
    ]
    keep = [leaf for leaf in keep if leaf.value is not None]
    if len({repr(leaf.value) for leaf in keep}) > 1:
        errors.append(
            "trainer.max_actor_ckpt_to_keep and trainer.max_critic_ckpt_to_keep differ "
            f"({keep[0].value} and {keep[1].value}): one checkpoint holds both here; set trainer.max_ckpt_to_keep"
        )
    elif keep:
        out.append(Leaf(keep[0].given, ("trainer", "max_ckpt_to_keep"), keep[0].value, keep[0].source))
    return out


def _without_turns(last: dict[str, Leaf], errors: list[str]) -> list[Leaf]:
    """verl's multi-turn keys (its tools, ``multi_turn.enable`` in verl's spelling) without our
    ``rollout.multi_turn.env``: one error that says what to write instead (the run would otherwise train
    single-turn without a word); returns those leaves, which are then left out."""
    env = last.get("rollout.multi_turn.env")
    if env is not None and env.value is not None:
        return []
    keys = (
        "data.tool_config_path",
        "data.function_tool_path",
        "rollout.multi_turn.tool_config_path",
        "rollout.multi_turn.function_tool_path",
        "rollout.multi_turn.interaction_config_path",
    )
    turns = [last[k] for k in keys if k in last and last[k].value is not None]
    enable = last.get("rollout.multi_turn.enable")
    if enable is not None and enable.given != enable.key and _among(enable.value, (True, "true", "True")):
        turns.insert(0, enable)
    if turns:
        given = ", ".join(f"{leaf.given}={show.repr(leaf.value)} (from {leaf.source})" for leaf in turns)
        errors.append(f"{given}: {TOOLS}")
    return turns


def _rollout_is(level: Leaf, threshold: Leaf | None, errors: list[str]) -> list[Leaf]:
    """verl 0.9.1's ``algorithm.rollout_correction.rollout_is`` (null, token or sequence) with its
    ``rollout_is_threshold`` (verl's default 2.0; a number truncates the weights, verl's TIS) as our
    ``algorithm.rollout_is``, ``rollout_is_level`` and ``rollout_is_threshold``. Alone, the threshold is
    verl's default of a switched-off correction: nothing."""
    if level.value is None:
        return []
    if level.value not in ("token", "sequence"):
        errors.append(
            f"{level.given}={show.repr(level.value)} (from {level.source}) must be null, token or sequence"
        )
        return []
    bound: Any = 2.0 if threshold is None else threshold.value  # verl's default
    if isinstance(bound, str) and "_" in bound:
        errors.append(
            f"{threshold.given}={show.repr(bound)} (from {threshold.source}): a lower_upper pair is verl's "
            "IcePop (weights outside the bounds zeroed); here the weights are truncated at one upper bound"
        )
        return []
    source = threshold or level
    return [
        Leaf(level.given, ("algorithm", "rollout_is"), True, level.source),
        Leaf(level.given, ("algorithm", "rollout_is_level"), level.value, level.source),
        Leaf(source.given, ("algorithm", "rollout_is_threshold"), bound, source.source),
    ]
