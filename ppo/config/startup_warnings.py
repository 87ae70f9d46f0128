"""The start-up warnings of a PPO run (``PPOConfig.warnings``): keys that are set but do nothing in a run
that still trains, one message per group of keys, which the caller logs once. ``no_validation_warnings``
(no validation files) and ``repeated_file_warnings`` (a data file listed twice) serve the stages too.
"""

from __future__ import annotations

import os

from ppo.choices import GROUP_ESTIMATORS
from ppo.config.distillation import DistillationLossConfig
from ppo.config.roles import ActorConfig, PolicyLossConfig
from ppo.config.sections import AlgorithmConfig, KLControlConfig, RewardConfig
from ppo.config.tree import PPOTree


def startup_warnings(cfg: PPOTree) -> list[str]:
    """Every start-up warning of ``cfg``, in the order ``PPOConfig.warnings`` lists them."""
    return [
        *_kl_controller_warnings(cfg),
        *_greedy_group_warnings(cfg),
        *_recipe_warnings(cfg),
        *_critic_warmup_warnings(cfg),
        *_reward_function_warnings(cfg),
        *_reward_cap_warnings(cfg),
        *_distillation_warnings(cfg),
        *no_validation_warnings(cfg.data, cfg.trainer),
        *repeated_file_warnings(cfg.data),
    ]


def _kl_controller_warnings(cfg: PPOTree) -> list[str]:
    """The KL controller's keys without a KL penalty in the reward; the adaptive controller's keys with
    a fixed one."""
    k, default = cfg.algorithm.kl_ctrl, KLControlConfig()
    changed = [
        name
        for name in ("type", "kl_coef", "target_kl", "horizon", "fixed_warmup_steps")
        if getattr(k, name) != getattr(default, name)
    ]
    adaptive_only = [name for name in changed if name in ("target_kl", "horizon", "fixed_warmup_steps")]
    if not cfg.algorithm.use_kl_in_reward and changed:
        hint = " (the KL loss's weight is actor.kl_loss_coef)" if cfg.actor.use_kl_loss else ""
        return [
            f"algorithm.use_kl_in_reward=false: the reward has no KL penalty, so {_shown(k, changed)} "
            f"{'is' if len(changed) == 1 else 'are'} ignored{hint}"
        ]
    if k.type == "fixed" and adaptive_only:
        return [
            f"algorithm.kl_ctrl.type=fixed keeps the KL coefficient at algorithm.kl_ctrl.kl_coef={k.kl_coef}: "
            f"{_shown(k, adaptive_only)} only steer{'s' if len(adaptive_only) == 1 else ''} "
            f"algorithm.kl_ctrl.type=adaptive and {'is' if len(adaptive_only) == 1 else 'are'} ignored"
        ]
    return []


def _shown(kl_ctrl: KLControlConfig, names: list[str]) -> str:
    """``algorithm.kl_ctrl.<name>=<value>`` of each name, for a message."""
    return ", ".join(f"algorithm.kl_ctrl.{name}={getattr(kl_ctrl, name)}" for name in names)


def _greedy_group_warnings(cfg: PPOTree) -> list[str]:
    """Greedy rollouts compared within their group."""
    if cfg.rollout.do_sample or cfg.rollout.offline_fraction >= 1.0:
        return []
    # Greedy decoding gives every response to a prompt the same tokens: a baseline or a ranking
    # within the group then sees no difference (an entropy bonus still trains, and tests use that).
    if cfg.algorithm.adv_estimator in GROUP_ESTIMATORS:
        group = f"algorithm.adv_estimator={cfg.algorithm.adv_estimator}"
    elif cfg.reward.style == "ranking":
        group = "reward.style=ranking"
    else:
        return []
    return [
        f"rollout.do_sample=false decodes greedily, so the rollout.n={cfg.rollout.n} sampled "
        f"responses to a prompt are identical and {group} compares them within their group: every "
        f"advantage is 0; set rollout.do_sample=true"
    ]


def _recipe_warnings(cfg: PPOTree) -> list[str]:
    """Recipe keys set where they do nothing."""
    out = []
    a, d, alg = cfg.actor, cfg.data, cfg.algorithm
    mode, loss = a.policy_loss.loss_mode, a.policy_loss
    default = PolicyLossConfig()
    used = {
        "clip_cov": ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"),
        "kl_cov": ("kl_cov_ratio", "ppo_kl_coef"),
    }
    unused = [
        f"actor.policy_loss.{k}={getattr(loss, k)}"
        for k in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")
        if getattr(loss, k) != getattr(default, k) and k not in used.get(mode, ())
    ]
    if unused:
        out.append(f"actor.policy_loss.loss_mode={mode} does not use {', '.join(unused)}")
    sppo_keys = {
        "actor.sppo_eta": (a.sppo_eta, ActorConfig().sppo_eta),
        "actor.sppo_refresh_steps": (a.sppo_refresh_steps, ActorConfig().sppo_refresh_steps),
        "algorithm.sppo_target": (alg.sppo_target, AlgorithmConfig().sppo_target),
        "algorithm.sppo_beta": (alg.sppo_beta, AlgorithmConfig().sppo_beta),
    }
    # verl's SPPO recipe writes the soft mean's beta algorithm.sppo_eta (translated to sppo_beta), and
    # its step size actor.sppo_eta: a warning about sppo_beta names both, so that whoever wrote the one
    # finds the other.
    beta_means = (
        f"algorithm.sppo_beta (verl's SPPO recipe writes it algorithm.sppo_eta) is the beta of the soft-mean "
        f"baseline of algorithm.sppo_target=softmean, not a step size; SPPO's step size eta is "
        f"actor.sppo_eta={a.sppo_eta}"
    )
    if mode != "sppo" and any(value != default for value, default in sppo_keys.values()):
        given = ", ".join(f"{k}={v}" for k, (v, d) in sppo_keys.items() if v != d)
        beta_set = alg.sppo_beta != AlgorithmConfig().sppo_beta
        out.append(
            f"actor.policy_loss.loss_mode={mode} does not use {given} (SPPO's keys)"
            + (f"; {beta_means}" if beta_set else "")
        )
    if mode == "sppo" and alg.sppo_target == "win_rate" and alg.sppo_beta != AlgorithmConfig().sppo_beta:
        out.append(
            f"algorithm.sppo_target=win_rate does not use algorithm.sppo_beta={alg.sppo_beta}: {beta_means}, "
            f"which the win-rate target uses; verl's SPPO recipe trains on algorithm.sppo_target=softmean"
        )
    if a.loss_scale_factor is not None and a.loss_agg_mode != "seq-mean-token-sum-norm":
        out.append(
            f"actor.loss_scale_factor={a.loss_scale_factor} divides only loss_agg_mode=seq-mean-token-sum-norm, "
            f"not actor.loss_agg_mode={a.loss_agg_mode}: it is ignored"
        )
    f, o = alg.filter_groups, cfg.reward.overlong_buffer
    if not f.enable and (
        (d.gen_batch_size != d.train_batch_size and not d.filter_accuracy) or f.max_num_gen_batches
    ):
        out.append(
            "algorithm.filter_groups.enable=false: data.gen_batch_size and "
            "algorithm.filter_groups.max_num_gen_batches are used by dynamic sampling only and are ignored"
        )
    if not o.enable and o.len:
        out.append(f"reward.overlong_buffer.enable=false: reward.overlong_buffer.len={o.len} is ignored")
    if alg.adv_estimator in ("reinforce_plus_plus_baseline", "opo") and cfg.rollout.n == 1:
        out.append(
            f"algorithm.adv_estimator={alg.adv_estimator} with rollout.n=1: a group of one has baseline 0, so "
            f"each advantage is the response's own score"
        )
    v = cfg.rollout.val_kwargs
    if v.n > 1 and not v.do_sample:
        out.append(
            f"rollout.val_kwargs.n={v.n} with rollout.val_kwargs.do_sample=false: the {v.n} greedy answers to a "
            f"prompt are identical, so best@k and maj@n equal the greedy accuracy; set do_sample=true"
        )
    return out


def _critic_warmup_warnings(cfg: PPOTree) -> list[str]:
    """A critic warm-up without a critic."""
    warmup = cfg.trainer.critic_warmup
    if warmup > 1 and not cfg.use_critic:
        return [
            f"trainer.critic_warmup={warmup} with algorithm.adv_estimator={cfg.algorithm.adv_estimator}, "
            f"which has no critic: steps 1 to {warmup - 1} train nothing; set trainer.critic_warmup=0"
        ]
    return []


def _reward_cap_warnings(cfg: PPOTree) -> list[str]:
    """``reward.total_timeout_s`` caps the reward workers' scoring: without workers it does nothing."""
    r = cfg.reward
    if r.total_timeout_s is None or r.pool_workers > 0:
        return []
    return [
        f"reward.total_timeout_s={r.total_timeout_s} caps the scoring in reward workers and is ignored with "
        "reward.pool_workers=0 (the trainer's process limits each call to reward.timeout_s)"
    ]


def _reward_function_warnings(cfg: PPOTree) -> list[str]:
    """The reward function's keys without a function: ``reward_kwargs`` go to ``reward.custom_function``
    only; ``timeout_s`` and ``error_score`` limit a function's calls (``error_score``: in reward workers)."""
    r, default = cfg.reward, RewardConfig()
    if r.custom_function is not None:
        return []
    unused = [f"reward.reward_kwargs={r.reward_kwargs}"] if r.reward_kwargs else []
    if r.pool_workers == 0:
        unused += [
            f"reward.{name}={getattr(r, name)}"
            for name in ("timeout_s", "error_score")
            if getattr(r, name) != getattr(default, name)
        ]
    if not unused:
        return []
    return [
        f"reward.custom_function is not set (the built-in rule scores): {', '.join(unused)} "
        f"{'is' if len(unused) == 1 else 'are'} ignored"
    ]


def _distillation_warnings(cfg: PPOTree) -> list[str]:
    """Distillation keys that do nothing: teachers without ``distillation.enabled``, verl's serving keys,
    the loss keys of another mode, and, without the task's loss, the keys of that loss and the reward."""
    d = cfg.distillation
    loss, default = d.distillation_loss, DistillationLossConfig()
    if not d.enabled:
        return (
            [
                f"distillation.enabled=false: distillation.teacher_models ({', '.join(d.teacher_models)}) is ignored"
            ]
            if (d.teacher_models)
            else []
        )
    out = []
    if d.ignored_keys:
        out.append(
            f"{', '.join(sorted(set(d.ignored_keys)))}: verl's serving settings of a teacher mean nothing here "
            "(teachers are sharded over this run's ranks like the reference) and are ignored"
        )
    p = "distillation.distillation_loss"
    for reason, keys, off in (
        (f"{p}.loss_mode={loss.loss_mode}", ("topk", "log_prob_min_clamp"), not loss.use_topk),
        (
            f"{p}.use_policy_gradient=false",
            ("clip_ratio", "clip_ratio_low", "clip_ratio_high"),
            not loss.use_policy_gradient,
        ),
        (f"{p}.use_task_rewards=false", ("distillation_loss_coef",), not loss.use_task_rewards),
    ):
        unused = [
            f"{p}.{k}={getattr(loss, k)}" for k in keys if off and getattr(loss, k) != getattr(default, k)
        ]
        if unused:
            out.append(f"{reason}: {', '.join(unused)} {'is' if len(unused) == 1 else 'are'} ignored")
    if not loss.use_task_rewards:
        a = cfg.actor
        task = [
            f"{k}={v}"
            for k, v, on in (
                ("actor.use_kl_loss", a.use_kl_loss, a.use_kl_loss),
                (
                    "algorithm.use_kl_in_reward",
                    cfg.algorithm.use_kl_in_reward,
                    cfg.algorithm.use_kl_in_reward,
                ),
                ("actor.entropy_coeff", a.entropy_coeff, bool(a.entropy_coeff)),
            )
            if on
        ]
        if task:
            out.append(
                f"{p}.use_task_rewards=false trains on the distillation loss alone: {', '.join(task)} "
                f"{'does' if len(task) == 1 else 'do'} nothing"
            )
        if cfg.reward.custom_function is not None:
            out.append(
                f"{p}.use_task_rewards=false: the scores of reward.custom_function={cfg.reward.custom_function} "
                "do not train the student (they are logged as critic/score/*, and validation uses them)"
            )
    return out


def no_validation_warnings(data: object, trainer: object) -> list[str]:
    """No ``data.val_files``: the run does not validate, and the trainer keys set on that act through
    validation (the validation interval, PPO's validation before training, its logged generations and
    its roll-back on a falling score) do nothing."""
    if getattr(data, "val_files", None):
        return []
    keys = ("test_freq", "val_before_train", "log_val_generations", "rollback_val_drop")
    values = {key: getattr(trainer, key) for key in keys if hasattr(trainer, key)}
    on = [
        f"trainer.{key}={str(value).lower() if isinstance(value, bool) else value}"
        for key, value in values.items()
        if value > 0  # True > 0: val_before_train on
    ]
    idle = f": {', '.join(on)} {'does' if len(on) == 1 else 'do'} nothing" if on else ""
    return [f"data.val_files is not set, so this run does not validate{idle}"]


def repeated_file_warnings(data: object) -> list[str]:
    """A file listed twice in one of ``data``'s file lists: its rows would count twice."""
    out = []
    for key in ("train_files", "val_files", "eval_prompt_files"):
        seen: set[str] = set()
        for path in getattr(data, key, None) or []:
            normal = os.path.normpath(os.path.abspath(path))
            if normal in seen:
                out.append(f"data.{key} lists {path} twice: its rows are read (and weigh) twice")
            seen.add(normal)
    return out
