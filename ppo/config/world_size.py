"""What the world size decides for a PPO run (``PPOConfig.validate``): prompts, mini-batches and
micro-batches divide evenly over the ranks, a token-budget micro-batch holds the longest sequence,
sequence-parallel and FSDP shard groups divide the world size, and a preset sized for a number of ranks
runs on that many. Each check returns its messages, so one error lists every number to change, and the
world sizes that would fit.
"""

from __future__ import annotations

from ppo.config.tree import PPOTree


def world_size_errors(cfg: PPOTree, world_size: int) -> list[str]:
    """One message per batch size or shard group that ``world_size`` ranks cannot run, then (when any)
    the world sizes these batch sizes fit; empty when the config fits."""
    errors = [
        *_planned_world_size_errors(cfg, world_size),
        *_batch_errors(cfg, world_size),
        *_token_budget_errors(cfg),
        *_shard_group_errors(cfg, world_size),
    ]
    if errors:
        fits = _fitting_world_sizes(cfg)
        if fits and world_size not in fits:
            errors.append(f"world sizes these batch sizes fit: {', '.join(map(str, fits))}")
    return errors


def _fitting_world_sizes(cfg: PPOTree) -> list[int]:
    """The numbers of ranks (up to ``data.train_batch_size``) that the batch sizes and shard groups divide
    evenly: what a world-size error offers instead."""
    return [
        w
        for w in range(1, cfg.data.train_batch_size + 1)
        if not _batch_errors(cfg, w) and not _shard_group_errors(cfg, w)
    ]


def _planned_world_size_errors(cfg: PPOTree, world_size: int) -> list[str]:
    """A preset sized for ``trainer.nnodes x trainer.n_gpus_per_node`` ranks runs on that many."""
    t, planned = cfg.trainer, cfg.trainer.planned_world_size
    if planned is None or planned == world_size:
        return []
    return [
        f"trainer.nnodes={t.nnodes} x trainer.n_gpus_per_node={t.n_gpus_per_node} "
        f"= {planned} ranks, but {world_size} run: the preset's batch sizes are sized for {planned}; "
        f"set trainer.nnodes and trainer.n_gpus_per_node to what you launch (or null)"
    ]


def _batch_errors(cfg: PPOTree, world_size: int) -> list[str]:
    """Prompts, mini-batches and micro-batches divide evenly over the ranks."""
    errors = []
    n = cfg.rollout.n
    bsz = cfg.data.train_batch_size
    sp = cfg.actor.ulysses_sequence_parallel_size
    if bsz % world_size:
        # Each rank samples all n responses of its own prompts, so groups (GRPO, RLOO, ranking)
        # never straddle ranks.
        errors.append(
            f"data.train_batch_size={bsz} prompts must divide evenly over {world_size} ranks: "
            f"make it a multiple of {world_size}"
        )
    a = cfg.actor
    roles = [("actor", a.ppo_mini_batch_size, a.use_dynamic_bsz, a.ppo_micro_batch_size_per_gpu)]
    if cfg.use_critic:
        c = cfg.critic
        roles.append(("critic", c.ppo_mini_batch_size, c.use_dynamic_bsz, c.ppo_micro_batch_size_per_gpu))
    if cfg.algorithm.adv_estimator == "prime":  # the PRM micro-batches as the actor does
        mini = cfg.reward.prime.mini_batch_size
        roles.append(("reward.prime", mini, a.use_dynamic_bsz, a.ppo_micro_batch_size_per_gpu))
    for role, mini, dynamic, micro in roles:
        if bsz % mini:
            errors.append(
                f"{role}.ppo_mini_batch_size={mini} must divide data.train_batch_size={bsz}: change one of them"
            )
            continue
        if (mini * n) % world_size:
            errors.append(
                f"{role}.ppo_mini_batch_size * rollout.n = {mini * n} sequences must divide evenly over "
                f"{world_size} ranks: change {role}.ppo_mini_batch_size or rollout.n"
            )
            continue
        # With sequence parallelism a group of sp ranks shares its members' sequences.
        per_group = mini * n * sp // world_size
        if not dynamic and per_group % micro:
            where = "rank" if sp == 1 else f"sequence-parallel group of {sp} ranks"
            errors.append(
                f"{role}: {per_group} sequences per {where} per mini-batch must be a multiple of "
                f"{role}.ppo_micro_batch_size_per_gpu={micro}: change it to a divisor of {per_group}, "
                f"or set {role}.use_dynamic_bsz=true"
            )
    return errors


def _token_budget_errors(cfg: PPOTree) -> list[str]:
    """A token-budget micro-batch (with its sequence-parallel ranks) holds the longest sequence."""
    errors = []
    sp = cfg.actor.ulysses_sequence_parallel_size
    max_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    for role, section in (("actor", cfg.actor), ("critic", cfg.critic)):
        budget = section.ppo_max_token_len_per_gpu
        if section.use_dynamic_bsz and budget * sp < max_len:
            ranks = f" (x {sp} sequence-parallel ranks)" if sp > 1 else ""
            errors.append(
                f"{role}.ppo_max_token_len_per_gpu={budget}{ranks} is below the longest sequence "
                f"(max_prompt_length + max_response_length = {max_len}): raise it"
            )
    return errors


def _shard_group_errors(cfg: PPOTree, world_size: int) -> list[str]:
    """Sequence-parallel and FSDP shard groups divide the world size."""
    errors = []
    for role in ("actor", "critic", "ref"):
        sp = getattr(cfg, role).ulysses_sequence_parallel_size
        if world_size % sp:
            errors.append(
                f"{role}.ulysses_sequence_parallel_size={sp} must divide the world size {world_size}"
            )
    for role in ("actor", "critic", "ref", "reward"):
        fsdp = getattr(cfg, role).fsdp
        if fsdp.fsdp_size > 0 and world_size % fsdp.fsdp_size:
            errors.append(f"{role}.fsdp.fsdp_size={fsdp.fsdp_size} must divide the world size {world_size}")
    return errors
