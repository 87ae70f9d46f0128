"""verl 0.9.1's keys and what each means here: the table ``load_config`` translates a verl command line
or YAML file with (``ppo.verl_translation`` applies it).

``VERL_KEYS`` lists, in our section names (``VERL_SECTIONS`` renames verl's first), every key of verl's
``ppo_trainer.yaml`` (and older spellings its examples still use) that is not ours as it is: renamed to
one of ours (``renamed_to``), accepted and ignored with a start-up warning because it changes nothing here
(vLLM's memory fraction, Ray), or refused with the reason (``rollout.name=vllm``). Keys verl shares with
us (``data.train_batch_size``) are not listed. The sets below it say what else the translation needs to
know of verl: the sections a YAML mapping is walked into, verl's defaults that differ from ours, the
values only verl spells its way. Data only: importing this module costs the standard library and
``ppo.verl_rules``, whose ``VerlKey`` and row constructors the table is written with.
"""

from __future__ import annotations

from typing import Any

from ppo.verl_rules import (
    COMPILE,
    ENGINE,
    ENGINE_NAME,
    ENTROPY,
    HYDRA,
    OVERLONG_LOGGED,
    PACKED,
    PROFILER,
    RAY,
    REWARD_WORKERS,
    SEEDED,
    STRATEGY,
    TOOLS_IGNORED,
    VerlKey,
    fsdp_keys,
    global_micro,
    ignored,
    model_keys,
    optim_keys,
    qat_keys,
    refused,
    renamed_to,
)

TEACHERS = "teachers are models of this run, sharded over all its ranks like the reference (no resource pool)"

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


VERL_KEYS: dict[str, VerlKey] = {
    # ---------------------------------------------------------------- actor_rollout_ref.actor
    "actor.strategy": refused(STRATEGY, ("fsdp", "fsdp2")),
    "actor.ppo_micro_batch_size": global_micro("actor.ppo_micro_batch_size_per_gpu"),
    "actor.rollout_n": ignored("verl fills it in from rollout.n"),
    "actor.use_remove_padding": ignored(PACKED, (True,)),
    "actor.use_torch_compile": ignored(COMPILE),
    "actor.entropy_from_logits_with_chunking": ignored(ENTROPY),
    "actor.entropy_checkpointing": ignored(ENTROPY),
    "actor.calculate_entropy": ignored("the entropy is always computed and logged here (actor/entropy)"),
    "actor.tau_pos": ignored("a parameter of verl's SAPO loss, which this trainer does not have"),
    "actor.tau_neg": ignored("a parameter of verl's SAPO loss, which this trainer does not have"),
    "actor.calculate_sum_pi_squared": refused("not available here", (False,)),
    "actor.sum_pi_squared_checkpointing": ignored("used only with calculate_sum_pi_squared"),
    "actor.freeze_vision_tower": refused("vision-language models are not supported here", (False,)),
    "actor.data_loader_seed": ignored(SEEDED),
    "actor.checkpoint.async_save": renamed_to("trainer.async_save"),
    "actor.checkpoint.*": ignored("a checkpoint holds every model, optimizer and loader state here"),
    "actor.profiler.*": ignored(PROFILER),
    "actor.router_replay.mode": refused("MoE router replay is not available here", ("disabled",)),
    "actor.router_replay.*": ignored("used only with router_replay.mode"),
    "actor.entropy_from_logits_chunk_size": ignored(ENTROPY),
    "actor.pad_to_length": ignored(PACKED, (False,)),
    "actor.policy_loss.dro_beta": ignored("a parameter of verl's DRO loss, which this trainer does not have"),
    **qat_keys("actor"),
    # ---------------------------------------------------------------- actor_rollout_ref.ref
    "ref.log_prob_micro_batch_size": global_micro("ref.log_prob_micro_batch_size_per_gpu"),
    "ref.log_prob_use_dynamic_bsz": ignored(
        "the reference's forward uses actor.use_dynamic_bsz here (memory and speed only)"
    ),
    "ref.log_prob_max_token_len_per_gpu": ignored(
        "the reference's forward uses actor.ppo_max_token_len_per_gpu here (memory and speed only)"
    ),
    "ref.model": refused("the reference's weights are ref.model_path here"),
    "ref.model.path": renamed_to("ref.model_path"),
    "ref.strategy": refused(STRATEGY, ("fsdp", "fsdp2")),
    "ref.rollout_n": ignored("verl fills it in from rollout.n"),
    "ref.use_torch_compile": ignored(COMPILE),
    "ref.entropy_from_logits_with_chunking": ignored(ENTROPY),
    "ref.entropy_checkpointing": ignored(ENTROPY),
    "ref.profiler.*": ignored(PROFILER),
    "ref.router_replay.*": ignored("MoE router replay is not available here"),
    "ref.entropy_from_logits_chunk_size": ignored(ENTROPY),
    "ref.pad_to_length": ignored(PACKED, (False,)),
    # ---------------------------------------------------------------- actor_rollout_ref.rollout
    # verl's scripts all name an engine; the sampling they ask for (n, temperature, top_p, top_k, lengths)
    # is the same with generate, and the engine's own settings are ignored (ENGINE rows below).
    "rollout.name": VerlKey(reason=ENGINE_NAME, ignored=("vllm", "sglang"), harmless=("hf", "???")),
    "rollout.mode": ignored("verl's sync or async engine; generation runs in the training processes here"),
    "rollout.top_k": renamed_to("rollout.top_k", {-1: 0}),
    # Equal to the data's lengths (verl's default) they are dropped by from_verl; otherwise refused.
    "rollout.prompt_length": refused("ours is data.max_prompt_length; give the value there"),
    "rollout.response_length": refused("ours is data.max_response_length; give the value there"),
    "rollout.dtype": ignored(
        "the rollout runs on the actor's weights, in actor.fsdp.mixed_precision.param_dtype"
    ),
    "rollout.enforce_eager": ignored(f"{ENGINE}; compiled decoding is rollout.compile"),
    "rollout.micro_batch_size": ignored(
        f"{ENGINE}; sequences per generate call on one rank are rollout.micro_batch_size_per_gpu"
    ),
    "rollout.log_prob_micro_batch_size": ignored(
        "the old log-probs are scored in the actor's micro-batches here (memory and speed only)"
    ),
    "rollout.log_prob_micro_batch_size_per_gpu": ignored(
        "the old log-probs are scored in the actor's micro-batches here (memory and speed only)"
    ),
    "rollout.log_prob_use_dynamic_bsz": ignored("the old log-probs use actor.use_dynamic_bsz here"),
    "rollout.log_prob_max_token_len_per_gpu": ignored(
        "the old log-probs use actor.ppo_max_token_len_per_gpu here"
    ),
    "rollout.over_sample_rate": ignored(
        "verl's engine aborts the slowest requests of a batch; here every sampled response is completed and "
        "trained on",
        (0, 0.0),
    ),
    "rollout.calculate_log_probs": ignored(
        "the sampler is the actor itself here; the trainer scores the old log-probs"
    ),
    # verl's 0 is greedy (ours: val_kwargs.do_sample=false, the default); its top_k -1 is our 0.
    "rollout.val_kwargs.temperature": renamed_to("rollout.val_kwargs.temperature", harmless=(0, 0.0)),
    "rollout.val_kwargs.top_k": renamed_to("rollout.val_kwargs.top_k", {-1: 0}),
    "rollout.multi_turn.enable": renamed_to("rollout.multi_turn.enable"),
    "rollout.multi_turn.max_assistant_turns": renamed_to("rollout.multi_turn.max_assistant_turns"),
    "rollout.multi_turn.max_tool_response_length": renamed_to("rollout.multi_turn.max_tool_response_length"),
    "rollout.multi_turn.tool_config_path": ignored(TOOLS_IGNORED),
    "rollout.multi_turn.function_tool_path": ignored(TOOLS_IGNORED),
    "rollout.multi_turn.interaction_config_path": ignored(TOOLS_IGNORED),
    "rollout.multi_turn.*": ignored(
        "verl's tool and agent-loop settings; here the environment is a class with reset and step "
        "(rollout.multi_turn.env) and turns end at rollout.multi_turn.stop"
    ),
    "rollout.skip_rollout": refused("rollouts are always generated here", (False,)),
    "rollout.skip_dump_dir": ignored("used only with rollout.skip_rollout=true"),
    "rollout.enable_rollout_routing_replay": refused("MoE routing replay is not available here", (False,)),
    "rollout.quantization": refused("the rollout runs on the actor's own (unquantized) weights"),
    "rollout.quantization_config_file": refused("the rollout runs on the actor's own (unquantized) weights"),
    "rollout.mtp": refused("multi-token prediction is not available here"),
    "rollout.profiler.*": ignored(PROFILER),
    "rollout.mtp.enable": refused("multi-token prediction is not available here", (False,)),
    "rollout.mtp.*": ignored("used only with rollout.mtp.enable=true"),
    "rollout.full_determinism": refused("not available here", (False,)),
    "rollout.seed": ignored(SEEDED),
    "rollout.nnodes": ignored(
        "verl's standalone rollout replicas; generation runs on the training ranks here"
    ),
    "rollout.n_gpus_per_node": ignored(
        "verl's standalone rollout replicas; generation runs on the training ranks here"
    ),
    **qat_keys("rollout"),
    **{
        f"rollout.{k}": ignored(ENGINE)
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
    **model_keys("model", "actor.lora"),
    "model.hf_config_path": refused("the model's config is read from model.path"),
    "model.custom_chat_template": refused(
        "prompts are rendered with the tokenizer's chat template: save yours in the tokenizer "
        "(tokenizer.chat_template) and point model.tokenizer_path at it"
    ),
    "model.lora_adapter_path": refused(
        "point model.path at the adapter folder (its base model is read from adapter_config.json)"
    ),
    "model.fused_kernel_options.impl_backend": renamed_to("actor.kernel_backend"),
    "actor_rollout_ref.hybrid_engine": refused(
        "the actor and the rollout always share weights here", (True,)
    ),
    "actor_rollout_ref.nccl_timeout": renamed_to("trainer.dist_timeout_s"),
    # ---------------------------------------------------------------- critic
    "critic.model.path": renamed_to("critic.model_path"),
    "critic.model.tokenizer_path": ignored("the critic reads the policy's tokens (model.tokenizer_path)"),
    "critic.model.trust_remote_code": refused(
        "model.trust_remote_code applies to every model here", (False, None)
    ),
    "critic.model.enable_gradient_checkpointing": ignored(
        "the critic follows model.enable_gradient_checkpointing here (memory and speed only)"
    ),
    **model_keys("critic.model", "critic.lora"),
    "critic.strategy": refused(STRATEGY, ("fsdp", "fsdp2")),
    "critic.enable": refused("the critic is used exactly when algorithm.adv_estimator=gae here"),
    "critic.rollout_n": ignored("verl fills it in from rollout.n"),
    "critic.ppo_micro_batch_size": global_micro("critic.ppo_micro_batch_size_per_gpu"),
    "critic.forward_micro_batch_size": ignored(
        "the values' forward uses the critic's micro-batches here (memory and speed only)"
    ),
    "critic.forward_micro_batch_size_per_gpu": ignored(
        "the values' forward uses the critic's micro-batches here (memory and speed only)"
    ),
    "critic.forward_max_token_len_per_gpu": ignored(
        "the values' forward uses critic.ppo_max_token_len_per_gpu here (memory and speed only)"
    ),
    "critic.shuffle": ignored("the critic's mini-batches are shuffled as actor.shuffle says"),
    "critic.data_loader_seed": ignored(SEEDED),
    "critic.checkpoint.async_save": renamed_to("trainer.async_save"),
    "critic.checkpoint.*": ignored("a checkpoint holds every model, optimizer and loader state here"),
    "critic.profiler.*": ignored(PROFILER),
    "critic.loss_scale_factor": refused(
        "the critic's loss is a token mean over the mini-batch here (critic.loss_agg_mode)", (None,)
    ),
    **qat_keys("critic"),
    # ---------------------------------------------------------------- reward_model
    "reward.enable": renamed_to("reward.style", {True: "model"}, harmless=(False, None)),
    "reward.model.path": renamed_to("reward.model_path"),
    "reward.model.input_tokenizer": refused(
        "the reward model scores the policy's tokens: it must share the policy's tokenizer"
    ),
    "reward.model.trust_remote_code": refused(
        "model.trust_remote_code applies to every model here", (False, None)
    ),
    **model_keys("reward.model", None),
    "reward.micro_batch_size": global_micro("reward.micro_batch_size_per_gpu"),
    "reward.max_length": refused(
        "the reward model scores whole sequences here (data.max_prompt_length + data.max_response_length)"
    ),
    "reward.use_dynamic_bsz": ignored("the reward model's forward uses reward.micro_batch_size_per_gpu"),
    "reward.forward_max_token_len_per_gpu": ignored(
        "the reward model's forward uses reward.micro_batch_size_per_gpu"
    ),
    # dapo: naive's scores plus the overlong penalty, which reward.overlong_buffer adds here.
    "reward.reward_manager": refused(
        "only verl's naive and dapo reward managers (one score per response) exist here",
        ("naive", "dapo", None),
    ),
    # verl's newer DAPO scripts pass the overlong buffer to the reward manager as keyword arguments.
    **{
        f"reward.reward_kwargs.overlong_buffer_cfg.{k}": renamed_to(f"reward.overlong_buffer.{k}")
        for k in ("enable", "len", "penalty_factor")
    },
    "reward.reward_kwargs.overlong_buffer_cfg.log": ignored(OVERLONG_LOGGED),
    "reward.overlong_buffer.log": ignored(OVERLONG_LOGGED),
    "reward.reward_kwargs.max_resp_len": ignored(
        "the overlong penalty's maximum length is data.max_response_length here"
    ),
    "reward.launch_reward_fn_async": ignored("the reward function runs in the training processes here"),
    "reward.sandbox_fusion.url": refused("no sandbox runs code here"),
    "reward.sandbox_fusion.*": ignored("used only with reward_model.sandbox_fusion.url"),
    "reward.strategy": refused(STRATEGY, ("fsdp", "fsdp2")),
    "reward.profiler.*": ignored(PROFILER),
    # verl's PRIME recipe (recipe/prime): its implicit PRM is reward.prime here (algorithm.adv_estimator=prime).
    "reward.model.beta_train": renamed_to("reward.prime.beta_train"),
    "reward.model.update": renamed_to("reward.prime.update"),
    "reward.model.loss_type": renamed_to("reward.prime.loss_type"),
    "reward.model.ref_type": refused("the PRM's reference is the run's frozen reference model", ("freeze",)),
    "reward.model.ref_path": ignored(
        "the PRM and its reference are the run's reference model (ref.model_path, else model.path)"
    ),
    "reward.model.optim.grad_clip": renamed_to("reward.prime.grad_clip"),
    **{
        f"reward.model.optim.{k}": renamed_to(f"reward.prime.optim.{k}")
        for k in ("lr", "weight_decay", "betas", "lr_warmup_steps", "lr_warmup_steps_ratio", "min_lr_ratio")
    },
    "reward.model.optim.warmup_style": renamed_to("reward.prime.optim.lr_scheduler"),
    "reward.model.optim.lr_scheduler_type": renamed_to("reward.prime.optim.lr_scheduler"),
    "reward.model.optim.total_training_steps": ignored(
        "verl fills it in from the run's length; here the schedule follows trainer.total_training_steps"
    ),
    "reward.prime_norm": renamed_to("reward.prime.prime_norm"),
    "reward.prime_granularity": refused("the PRM rewards every response token here", ("token",)),
    "reward.lambda": refused("the PRM's token rewards are used as they are here (lambda 0)", (0, 0.0)),
    "reward.prime_use_gt": ignored("used only with reward_model.lambda > 0"),
    "reward.mini_batch_size": renamed_to("reward.prime.mini_batch_size"),
    "data.oversample_factor": refused(
        "the accuracy filter samples data.gen_batch_size prompts a step here: set data.gen_batch_size to "
        "oversample_factor * data.train_batch_size",
        (1, 1.0),
    ),
    "data.filter_truncate": ignored("the accuracy filter here filters by accuracy only", (False,)),
    # verl 0.9.1's reward model block (reward.reward_model, here reward.model after VERL_SECTIONS).
    "reward.model.enable": renamed_to("reward.style", {True: "model"}, harmless=(False, None)),
    "reward.model.model_path": renamed_to("reward.model_path"),
    **{
        f"reward.model.{k}": ignored(REWARD_WORKERS)
        for k in ("enable_resource_pool", "n_gpus_per_node", "nnodes", "num_workers")
    },
    "reward.model.rollout.*": ignored(
        "the reward model's inference engine in verl; here the reward model scores by a forward pass on "
        "the training ranks"
    ),
    # verl's Ray reward workers (0.6.0's reward_model.num_workers); the rule reward's per-rank process pool
    # is reward.pool_workers, which a config written for verl does not set.
    "reward.num_workers": ignored(REWARD_WORKERS),
    "reward.reward_loop_module_path": refused("verl's reward loops do not exist here"),
    "reward.reward_loop_class_name": refused("verl's reward loops do not exist here"),
    **{
        f"reward.{k}": ignored(REWARD_WORKERS)
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
    "reward_manager.source": refused("only verl's naive and dapo reward managers exist here", ("register",)),
    "reward_manager.name": refused(
        "only verl's naive and dapo reward managers exist here", ("naive", "dapo", None)
    ),
    "reward_manager.module.path": refused("only verl's naive and dapo reward managers exist here"),
    "reward_manager.module.name": ignored("used only with reward_manager.module.path"),
    # ---------------------------------------------------------------- algorithm
    "algorithm.use_pf_ppo": refused("preference-feedback PPO is not available here", (False,)),
    "algorithm.pf_ppo.*": ignored("used only with algorithm.use_pf_ppo=true"),
    # verl's SPPO recipe: algorithm.sppo_eta is the beta of its soft-mean baseline (actor.sppo_eta, the
    # step size, is ours as it is).
    "algorithm.sppo_eta": VerlKey(
        ours="algorithm.sppo_beta",
        reason="the beta of the soft-mean baseline (algorithm.sppo_target=softmean), as in verl's SPPO recipe; "
        "the step size eta is actor.sppo_eta",
    ),
    "algorithm.filter_groups.max_inflight_gen_batches": ignored(
        "generation rounds run one after another in the training processes here"
    ),
    # verl 0.9.1's rollout correction. rollout_is (token|sequence) and its rollout_is_threshold are our
    # algorithm.rollout_is=true, rollout_is_level and rollout_is_threshold (verl_translation._combine);
    # 0.6.0's spellings algorithm.rollout_is* are ours. The weights apply to responses another policy
    # sampled (offline data): the actor samples its own responses here, whose weight is 1.
    "algorithm.rollout_correction.rollout_is_batch_normalize": refused(
        "the importance weights are not renormalized to mean 1 here", (False,)
    ),
    "algorithm.rollout_correction.bypass_mode": refused(
        "the old log-probs are always the trainer's own here (verl's decoupled mode)", (False,)
    ),
    "algorithm.rollout_correction.loss_type": ignored(
        "used only with bypass_mode=true", ("ppo_clip", "reinforce")
    ),
    # Rejection sampling: the actor trains on the offline responses' tokens within the bounds.
    "algorithm.rollout_correction.rollout_rs": renamed_to("algorithm.rollout_rs"),
    "algorithm.rollout_correction.rollout_rs_threshold": renamed_to("algorithm.rollout_rs_threshold"),
    "algorithm.rollout_correction.*": ignored("not a setting of verl 0.9.1's rollout correction"),
    # ---------------------------------------------------------------- data
    "data.tokenizer": refused("ours is model.tokenizer_path"),
    "data.use_shm": ignored("data loads from the file system here"),
    "data.train_max_samples": refused("every training prompt is used here; cut the file", (-1, None)),
    "data.val_max_samples": renamed_to("data.max_val_samples"),
    "data.reward_fn_key": refused(
        "the rule scorer is chosen by the data_source column here", ("data_source",)
    ),
    # Without rollout.multi_turn.env they refuse the run, whose turns would be lost
    # (verl_translation._combine).
    "data.tool_config_path": ignored(TOOLS_IGNORED),
    "data.function_tool_path": ignored(TOOLS_IGNORED),
    "data.audio_key": refused("audio data is not supported here", ("audios",)),
    "data.mm_processor_kwargs": refused("vision-language data is not supported here", (None, {})),
    "data.return_raw_input_ids": ignored("prompts are rendered and tokenized once, at start-up, here"),
    "data.return_raw_chat": ignored("prompts are rendered and tokenized once, at start-up, here"),
    "data.return_full_prompt": ignored("prompts are rendered and tokenized once, at start-up, here"),
    "data.seed": refused("ours is trainer.seed (which also seeds sampling and initialization)"),
    "data.dataloader_num_workers": ignored("prompts are tokenized once, at start-up, here"),
    "data.validation_shuffle": ignored("the whole validation set is scored here"),
    "data.filter_overlong_prompts": ignored(
        "over-long prompts are always dropped and counted here, never truncated", (True,)
    ),
    "data.filter_overlong_prompts_workers": ignored("prompts are tokenized once, at start-up, here"),
    # verl truncates only prompts over data.max_prompt_length; here those are dropped and counted.
    "data.truncation": VerlKey(
        reason="prompts are never truncated here: those over data.max_prompt_length are dropped and counted",
        ignored=("left", "right", "middle"),
        harmless=("error",),
    ),
    "data.trust_remote_code": refused("model.trust_remote_code loads the tokenizer here", (False, None)),
    "data.image_key": refused("vision-language data is not supported here", ("images",)),
    "data.video_key": refused("vision-language data is not supported here", ("videos",)),
    "data.image_patch_size": ignored("vision-language data is not supported here"),
    "data.return_multi_modal_inputs": ignored("vision-language data is not supported here"),
    "data.custom_cls.path": refused("prompts load from Parquet, JSON lines or a saved dataset folder here"),
    "data.custom_cls.name": ignored("used only with data.custom_cls.path"),
    "data.sampler.class_path": refused("curriculum samplers are not available here"),
    "data.sampler.class_name": ignored("used only with data.sampler.class_path"),
    "data.datagen.path": refused("dynamic data generation is not available here"),
    "data.datagen.name": ignored("used only with data.datagen.path"),
    # ---------------------------------------------------------------- trainer (see _combine)
    "trainer.default_local_dir": renamed_to("trainer.output_dir"),
    "trainer.balance_batch": ignored(
        "each rank trains on the responses it sampled here; micro-batches are balanced by length"
    ),
    "trainer.rollout_data_dir": refused("rollouts are not written to files here"),
    "trainer.validation_data_dir": refused("validation generations are not written to files here"),
    "trainer.esi_redundant_time": ignored(
        "on a stop signal (SIGTERM, as Slurm sends before a job's time ends) a checkpoint is saved here"
    ),
    "trainer.val_only": refused("there is no validation-only mode here", (False,)),
    "trainer.default_hdfs_dir": refused("nothing is copied to HDFS here; copy trainer.output_dir yourself"),
    "trainer.del_local_ckpt_after_load": refused("checkpoints are kept here", (False,)),
    "trainer.ray_wait_register_center_timeout": ignored(RAY),
    "trainer.use_legacy_worker_impl": ignored("verl's worker implementations; there are no workers here"),
    "trainer.npu_profile.*": ignored(PROFILER),
    # ---------------------------------------------------------------- the rest of verl
    # verl's steps count from 1, as ours; the torch profiler records them (its trace in trainer.output_dir/profile).
    "global_profiler.steps": renamed_to("trainer.profile_steps", harmless=(None,)),
    "global_profiler.tool": ignored(
        "the steps of global_profiler.steps are recorded with the torch profiler here", ("torch", None)
    ),
    "global_profiler.save_path": ignored(
        "the profiler's trace is written to trainer.output_dir/profile here", ("outputs/profile", None)
    ),
    "global_profiler.*": ignored(PROFILER),
    "hydra.*": ignored(HYDRA),
    "defaults": ignored(HYDRA),
    "ray_kwargs.*": ignored(RAY),
    "ray_init.*": ignored(RAY),
    "transfer_queue.*": ignored("verl's transfer queue (Ray); there is none here"),
    "distillation.n_gpus_per_node": ignored(TEACHERS),
    "distillation.nnodes": ignored(TEACHERS),
    "distillation.distillation_loss.use_chunked_topk": ignored(
        "the top-k log-probs are always computed in chunks of tokens here, without the [tokens, vocab] logits"
    ),
    "distillation.distillation_loss.chunked_topk_chunk_size": ignored(
        "the kernels size their token chunks by memory here"
    ),
    "skip.rollout.enable": refused("rollouts are always generated here", (False,)),
    "skip.rollout_tq.enable": refused("rollouts are always generated here", (False,)),
    "skip.async_rollout.enable": refused("rollouts are always generated here", (False,)),
    "skip.*": ignored("used only with skip.<stage>.enable=true"),
    "trainer.use_v1": ignored("verl's choice between its trainer implementations; there is one here"),
    "trainer.v1.trainer_mode": refused(
        "training here is synchronous: each step generates, then updates", ("sync",)
    ),
    "trainer.v1.*": ignored("settings of verl's asynchronous trainer modes (trainer.v1.trainer_mode)"),
    "trainer.checkpoint_callback_class": refused("no callback runs after a checkpoint here"),
    **optim_keys("actor"),
    **optim_keys("critic"),
    **fsdp_keys("actor.fsdp_config", "actor.fsdp", "actor.ulysses_sequence_parallel_size", "model.dtype"),
    **fsdp_keys("ref.fsdp_config", "ref.fsdp", "ref.ulysses_sequence_parallel_size", None),
    **fsdp_keys("critic.model.fsdp_config", "critic.fsdp", "critic.ulysses_sequence_parallel_size", None),
    # verl 0.9.1's critic has its FSDP settings in critic.fsdp, our section's name.
    **fsdp_keys("critic.fsdp", "critic.fsdp", "critic.ulysses_sequence_parallel_size", None),
    **fsdp_keys("reward.model.fsdp_config", "reward.fsdp", None, None),
    "reward.ulysses_sequence_parallel_size": refused(
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
now (``reward.num_workers`` is verl's reward workers in either spelling: ignored, with a note; the pool
is ``reward.pool_workers``)."""

VERL_VALUES: dict[str, dict[Any, Any]] = {"algorithm.filter_groups.metric": {"reward": "seq_reward"}}
"""Values of keys verl shares with us that only verl spells that way, in either spelling of the key
(verl's ``reward``: the score with the overlong penalty, before KL, is our ``seq_reward``)."""

VERL_LENGTHS = {
    "rollout.prompt_length": "data.max_prompt_length",
    "rollout.response_length": "data.max_response_length",
}
"""verl's engine lengths, which it derives from the data's; here the data's alone."""

VERL_MAPPINGS = frozenset({"custom_reward_function.reward_kwargs", "critic.model.override_config"})
"""verl's renamed keys whose value is a mapping, set key by key (``+custom_reward_function.reward_kwargs.a=1``)."""
