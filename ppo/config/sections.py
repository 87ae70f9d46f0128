"""The sections of a PPO run around its models: data, rollout, reward, algorithm, trainer, and the
subsections they hold (validation sampling, multi-turn, the overlong buffer, PRIME's reward model, the KL
controller, dynamic sampling). On-policy distillation's section is ``ppo.config.distillation``. The models' own sections (actor, critic, reference) are
``ppo.config.roles``. Each checks its own values in ``__post_init__``; the rules that span sections live
with the root, ``ppo.config.root``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ppo.choices import ADV_ESTIMATORS, rollout_rs_bounds
from ppo.config.errors import FieldError, _require, check_kl_kind
from ppo.config.shared import FSDPConfig, OptimConfig, RunTrainerConfig


@dataclass(kw_only=True)
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    """Parquet files of prompts in verl's layout (``prompt``, ``data_source``, ``reward_model``,
    ``extra_info``). Required: a run without them stops before any model loads."""
    val_files: list[str] = field(default_factory=list)
    """Parquet files for validation (greedy generation, scored by the rule reward). Unset: the run does
    not validate (``trainer.test_freq`` and ``trainer.val_before_train`` do nothing) and says so once at
    start-up."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a list of chat messages or a string."""
    max_prompt_length: int = 64
    """Prompts longer than this (in tokens, after the chat template) are dropped and counted."""
    max_response_length: int = 32
    """Most tokens generated per response."""
    train_batch_size: int = 32
    """Prompts per PPO step, over all ranks."""
    gen_batch_size: int | None = None
    """Prompts per generation round of dynamic sampling (``algorithm.filter_groups``; verl's key), or
    per step of PRIME's accuracy filter (``filter_accuracy``), over all ranks: a multiple of
    ``train_batch_size`` (each round draws ``gen_batch_size / train_batch_size`` batches from the
    loader), above it for the accuracy filter. Default: ``train_batch_size``."""
    val_batch_size: int = 256
    """Prompts per validation generation batch, over all ranks; the whole val set is scored."""
    max_val_samples: int = -1
    """Use at most this many validation prompts (-1: all)."""
    shuffle: bool = True
    """Shuffle the training prompts each epoch (deterministic in ``trainer.seed`` and the epoch)."""
    apply_chat_template: bool = True
    """Render chat-message prompts with the tokenizer's chat template (string prompts are used as
    they are)."""
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the tokenizer's ``apply_chat_template`` for training and validation prompts
    (verl's key), e.g. ``enable_thinking: false`` for Qwen3; a keyword the template does not use is
    warned about by name."""
    filter_accuracy: bool = False
    """PRIME's accuracy filter (verl recipe's key): each step samples ``gen_batch_size`` prompts and
    trains on ``train_batch_size`` of them, first those whose group accuracy (the share of the
    ``rollout.n`` responses scoring >= 1) lies within ``[accuracy_lower_bound, accuracy_upper_bound]``.
    Needs ``gen_batch_size`` above ``train_batch_size`` (verl recipe's ``data.oversample_factor``
    times it; its script's is 4): sampling only the batch would keep every group."""
    accuracy_lower_bound: float = 0.2
    """Lowest group accuracy the accuracy filter prefers (``filter_accuracy``)."""
    accuracy_upper_bound: float = 0.8
    """Highest group accuracy the accuracy filter prefers (``filter_accuracy``)."""

    def __post_init__(self) -> None:
        _require(
            self,
            "> 0",
            "max_prompt_length",
            "max_response_length",
            "train_batch_size",
            "gen_batch_size",
            "val_batch_size",
        )
        _require(self, "-1 or > 0", "max_val_samples")
        _require(self, "[0, 1]", "accuracy_lower_bound", "accuracy_upper_bound")


@dataclass(kw_only=True)
class ValKwargsConfig:
    """Sampling of the validation pass that measures exploration (verl's ``rollout.val_kwargs``)."""

    n: int = 1
    """Answers per validation prompt; with ``n > 1`` or ``do_sample`` the validation also logs
    ``val/mean@n``, ``val/pass@k`` (unbiased, k = 1, 2, 4, ..., n), ``val/best@k`` (verl's bootstrap,
    k = 2, 4, ..., n) and ``val/maj@n``."""
    do_sample: bool = False
    """Sample those answers (else greedy: n identical answers); the sampled mean is then the headline
    ``val/score`` (as verl's), the greedy pass's ``val/greedy_score``."""
    temperature: float = 1.0
    """Their sampling temperature."""
    top_p: float = 1.0
    """Their nucleus threshold (1 disables)."""
    top_k: int = 0
    """Their top-k (0 disables; verl's vLLM value -1 is 0 here)."""

    def __post_init__(self) -> None:
        _require(self, ">= 1", "n")
        _require(self, "> 0", "temperature")
        _require(self, "(0, 1]", "top_p")
        _require(self, ">= 0", "top_k")

    @property
    def enabled(self) -> bool:
        """Whether validation runs the n-answer pass (beside the greedy one)."""
        return self.n > 1 or self.do_sample


@dataclass(kw_only=True)
class MultiTurnConfig:
    """Multi-turn rollouts: the model writes, the user's environment answers, the model writes again
    (``ppo.multi_turn``; verl's ``rollout.multi_turn`` where it has the key)."""

    enable: bool = False
    """Run the turn loop for training rollouts and validation."""
    env: str | None = None
    """The environment class, ``path/to/file.py:Class`` or ``module:Class``, with ``reset(row)`` and
    ``step(action_text) -> (observation, reward, done)``; one instance per trajectory."""
    stop: list[str] = field(default_factory=list)
    """Strings that end a turn (e.g. ``</calc>``): the turn's text goes to ``step``. An EOS ends the
    trajectory."""
    max_assistant_turns: int | None = None
    """Most model turns per trajectory (None: as many as ``data.max_response_length`` allows)."""
    max_tool_response_length: int = 256
    """Most tokens of one observation; longer ones are cut and counted."""
    step_timeout_s: float = 30.0
    """A ``step`` call that runs longer ends its trajectory with reward 0 (counted); the class's ``__init__``
    (at start-up and per trajectory) and ``reset`` have the same limit, and one that runs longer is an
    error naming the class and the row."""

    def __post_init__(self) -> None:
        _require(self, ">= 1", "max_assistant_turns", "max_tool_response_length")
        _require(self, "> 0", "step_timeout_s")
        if self.enable and not self.env:
            raise FieldError(
                "enable=true needs the environment class: set rollout.multi_turn.env=path/to/file.py:Class",
                "env",
            )
        if any(not isinstance(x, str) or not x for x in self.stop):
            raise FieldError(f"stop={self.stop!r}: expected non-empty strings", "stop")
        if self.enable and not self.stop:
            raise FieldError(
                "enable=true with no stop strings: a turn ends at a stop string and its text goes to the "
                "environment's step, so without one the environment is never called; set "
                "rollout.multi_turn.stop=[...] (e.g. ['</tool_call>'])",
                "stop",
            )


@dataclass(kw_only=True)
class RolloutConfig:
    n: int = 4
    """Responses sampled per prompt."""
    temperature: float = 1.0
    """Sampling temperature; also divides the logits when log-probs are scored."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1 disables)."""
    top_k: int = 0
    """Top-k sampling (0 disables)."""
    do_sample: bool = True
    """Sample (True) or decode greedily (False) during training rollouts."""
    ignore_eos: bool = False
    """Always generate ``data.max_response_length`` tokens (for benchmarks)."""
    micro_batch_size_per_gpu: int = 64
    """Sequences per ``generate`` call on one rank."""
    val_do_sample: bool = False
    """Validation decodes greedily unless this is set."""
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)
    """A second validation pass of ``n`` answers per prompt (verl's key), for pass@k and majority vote."""
    source: Literal["generate", "dataset"] = "generate"
    """Where each step's responses come from: sampled from the actor, or read from the training file's
    ``responses`` column (offline RLHF: no sampling in the loop; validation still generates)."""
    offline_fraction: float | None = None
    """Share of each step's prompt groups whose responses come from the data set; the rest are sampled.
    Default: 1 with ``source=dataset``, 0 with ``source=generate``."""
    compile: bool | Literal["auto"] = "auto"
    """Decode with a static KV cache and a compiled decoding step (CUDA graphs): ``auto`` on CUDA."""
    reuse_prompt_cache: bool = True
    """Prefill each distinct prompt of a generation micro-batch once and copy its KV cache to its
    samples, and keep each multi-turn row's cache from turn to turn (only new tokens are prefilled);
    the same tokens as prefilling every copy (``ppo.rollout``)."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn rollouts with a user's environment or tool."""

    def __post_init__(self) -> None:
        _require(self, "[0, 1]", "offline_fraction")
        if self.source == "dataset" and self.offline_fraction not in (None, 1.0):
            raise FieldError(
                f"source=dataset reads every group from the data set, but rollout.offline_fraction="
                f"{self.offline_fraction}: to mix sampled and offline groups use rollout.source=generate "
                f"with rollout.offline_fraction in (0, 1)",
                "offline_fraction",
            )
        _require(self, "> 0", "n", "temperature", "micro_batch_size_per_gpu")
        _require(self, "(0, 1]", "top_p")
        _require(self, ">= 0", "top_k")


@dataclass(kw_only=True)
class OverlongBufferConfig:
    """DAPO's soft overlong punishment (Yu et al. 2025; verl's ``reward_model.overlong_buffer``)."""

    enable: bool = False
    """Add ``overlong_penalty`` to every response's score."""
    len: int = 0
    """The buffer: a response longer than ``data.max_response_length - len`` tokens (EOS included) is
    penalized, linearly more up to ``-penalty_factor`` at ``data.max_response_length``."""
    penalty_factor: float = 1.0
    """The penalty at the maximum length (verl 0.9.1 has no default: its DAPO scripts give it, 1.0)."""

    def __post_init__(self) -> None:
        _require(self, ">= 0", "len", "penalty_factor")


@dataclass(kw_only=True)
class PrimeConfig:
    """PRIME's implicit process reward model (Cui et al. 2025; verl recipe ``reward_model.*``): a copy of
    the reference model trained on the outcome labels; ``beta_train * (log pi_prm - log pi_ref)`` of each
    response token is its process reward (``algorithm.adv_estimator=prime``)."""

    beta_train: float = 0.05
    """beta of the implicit reward, in the PRM's loss and its token rewards (verl recipe's
    ``reward_model.model.beta_train``)."""
    update: Literal["before", "after"] = "before"
    """``before``: train the PRM on the step's outcome labels, then score the responses with it (two
    forwards); ``after``: the rewards are the training forward's, before each mini-batch's update
    (verl recipe's ``reward_model.model.update``)."""
    prime_norm: Literal["batch_norm", "none"] = "batch_norm"
    """``batch_norm``: divide the token rewards by the batch's largest absolute reverse cumulative sum
    (over all ranks); ``none``: use them as they are (verl recipe's ``reward_model.prime_norm``)."""
    loss_type: Literal["ce"] = "ce"
    """The PRM's loss: ``ce``, binary cross-entropy of the implicit outcome reward against the label."""
    mini_batch_size: int | None = None
    """Prompts per PRM optimizer step, over all ranks; default ``actor.ppo_mini_batch_size``. The verl
    recipe's ``reward_model.mini_batch_size`` counts responses: it is translated to that / ``rollout.n``."""
    grad_clip: float = 10.0
    """Gradient-norm clip of the PRM's updates."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6))
    """The PRM's optimizer (verl recipe's ``reward_model.model.optim``)."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """Sharding of the PRM."""

    def __post_init__(self) -> None:
        _require(self, "> 0", "beta_train", "mini_batch_size")
        _require(self, ">= 0", "grad_clip")


@dataclass(kw_only=True)
class RewardConfig:
    style: Literal["rule", "model", "ranking", "dataset"] = "rule"
    """``rule``: scorer chosen by ``data_source``; ``model``: a trained reward model; ``ranking``: scores
    from the ranks of the ``rollout.n`` responses to a prompt (``rank_scores``), ranked by the data's
    ``ranks`` column for offline groups and by ``ranking_by`` for sampled ones; ``dataset``: the
    offline data's ``scores`` column."""
    model_path: str | None = None
    """Reward model folder for ``style=model`` (or ``ranking_by=model``)."""
    custom_function: str | list[str] | None = None
    """A user's scorer (or a list of them, TRL's ``reward_funcs``, whose scores are summed with
    ``weights``): ``module.path:function`` or ``file.py:function`` (``:function`` may be left out: it
    is then ``compute_score``, as verl's), called by keyword as verl calls it,
    ``fn(data_source=, solution_str=, ground_truth=, extra_info=, **reward_kwargs)``, returning a number
    or a dict with a ``"score"`` number (its other number-valued keys are logged as ``reward/extra/<key>``).
    A function with a parameter named ``prompts``, ``completions``, ``completion_ids`` or ``trainer_state``
    is TRL's kind: called once per batch with those and the data's other columns, returning a list of
    numbers (None where it does not apply)."""
    weights: list[float] | None = None
    """Weight of each ``custom_function`` in the score (TRL's ``reward_weights``); default 1 each."""
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of ``custom_function`` (verl's ``custom_reward_function.reward_kwargs``)."""
    format_score: float = 0.0
    """GSM8K scorer: score of a well-formed but wrong answer."""
    ranking_by: Literal["rule", "model"] = "rule"
    """What ``style=ranking`` ranks sampled responses by."""
    rank_scores: Literal["best", "linear"] = "best"
    """``style=ranking``: ``best`` scores 1 for the best response of a group (ties share it) and 0 for
    the others; ``linear`` scores ``1 - rank / (k - 1)`` for rank 0 (best) to k - 1."""
    micro_batch_size_per_gpu: int = 16
    """Sequences per reward-model forward on one rank."""
    pool_workers: int = 0
    """Score the rule reward in this many worker processes per rank, each call limited to ``timeout_s``
    (0: in the trainer's own process, where a failing function stops the run at once). verl's
    ``reward.num_workers`` (its Ray reward workers) is not this key: it is ignored, with a note."""
    timeout_s: float = 60.0
    """With ``pool_workers > 0``: a call that runs longer is abandoned (its worker replaced) and scored
    ``error_score``, counted in ``reward/timeouts``."""
    error_score: float = 0.0
    """With ``pool_workers > 0``: the score of a response whose call timed out, raised or returned no
    number (``reward/timeouts``, ``reward/errors``); a step whose every call failed stops the run."""
    total_timeout_s: float | None = None
    """With ``pool_workers > 0``: the most seconds one rank spends scoring a step's responses (a round of
    dynamic sampling and a validation pass are each capped on their own); past it the calls still running
    are abandoned (their workers replaced) and every response not scored yet scores ``error_score``,
    counted in ``reward/timeouts``. None: no cap (a step whose calls all hang costs
    ``ceil(responses / pool_workers) * timeout_s``)."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO's length penalty near ``data.max_response_length``, added to every score."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """Sharding of the reward model (``style=model`` or ``ranking_by=model``); ``param_offload`` keeps it
    on CPU."""
    prime: PrimeConfig = field(default_factory=PrimeConfig)
    """PRIME's implicit process reward model (``algorithm.adv_estimator=prime``)."""

    def functions(self) -> list[str]:
        """``custom_function`` as a list (empty when unset)."""
        if self.custom_function is None:
            return []
        return [self.custom_function] if isinstance(self.custom_function, str) else list(self.custom_function)

    def __post_init__(self) -> None:
        functions = [self.custom_function] if isinstance(self.custom_function, str) else self.custom_function
        if functions is not None and not functions:
            raise FieldError(
                "custom_function is an empty list: name a function or leave the key out", "custom_function"
            )
        if self.weights is not None:
            if functions is None:
                raise FieldError(
                    "weights is set but custom_function is not: it weighs custom functions", "weights"
                )
            if len(self.weights) != len(functions):
                raise FieldError(
                    f"weights has {len(self.weights)} values for {len(functions)} custom_function(s): give one each",
                    "weights",
                )
        _require(self, "> 0", "micro_batch_size_per_gpu", "timeout_s", "total_timeout_s")
        _require(self, ">= 0", "pool_workers")


@dataclass(kw_only=True)
class KLControlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"
    """Fixed coefficient, or adaptive toward ``target_kl`` (Ziegler et al. 2019)."""
    kl_coef: float = 0.001
    """(Initial) KL coefficient."""
    target_kl: float = 0.1
    """Adaptive: the KL per sequence the controller steers to."""
    horizon: int = 10000
    """Adaptive: steps (in samples) over which the error is corrected."""
    fixed_warmup_steps: int = 0
    """Adaptive: keep the coefficient fixed for this many steps, then adapt."""

    def __post_init__(self) -> None:
        _require(self, ">= 0", "kl_coef", "fixed_warmup_steps")
        _require(self, "> 0", "target_kl", "horizon")


@dataclass(kw_only=True)
class FilterGroupsConfig:
    """DAPO's dynamic sampling (Yu et al. 2025; verl's ``algorithm.filter_groups``): groups whose responses
    all score alike carry no signal for a group baseline; they are dropped and more prompts generated."""

    enable: bool = False
    """Drop such groups and generate ``data.gen_batch_size`` more prompts a round until
    ``data.train_batch_size`` groups are left."""
    metric: Literal["acc", "score", "seq_reward"] = "acc"
    """What must differ within a group: ``acc`` (the rule's verdict, score >= 1), ``score`` (the score
    before the overlong penalty) or ``seq_reward`` (the score with it)."""
    max_num_gen_batches: int = 0
    """Give up with an error after this many generation rounds in one step (0: no limit)."""

    def __post_init__(self) -> None:
        _require(self, ">= 0", "max_num_gen_batches")


@dataclass(kw_only=True)
class AlgorithmConfig:
    adv_estimator: Literal[ADV_ESTIMATORS] = "gae"
    """Advantages: ``gae`` with a critic; ``reinforce_plus_plus`` (discounted returns whitened over the
    batch); the group baselines ``grpo``, ``rloo``, ``reinforce_plus_plus_baseline`` (minus the group
    mean, whitened over the batch) and ``opo`` (minus the length-weighted group mean); ``prime``: RLOO
    over an implicit process reward model's token rewards and over the outcome score, summed as returns
    and whitened (verl's PRIME recipe; the PRM is ``reward.prime``)."""
    gamma: float = 1.0
    """Discount factor of GAE and REINFORCE++."""
    lam: float = 1.0
    """GAE lambda."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide by the group's standard deviation."""
    use_kl_in_reward: bool = False
    """Subtract kl_coef * KL(actor || ref) from every token's reward."""
    kl_penalty: str = "kl"
    """KL estimator in the reward: kl|k1, abs, mse|k2, low_var_kl|k3, full."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """Controller of the in-reward KL coefficient."""
    rollback_kl: float = 0.0
    """Restore the last checkpoint when the step's KL to the reference exceeds this (0 disables)."""
    rollback_lr_factor: float = 0.5
    """Multiply the learning rates by this after a rollback."""
    max_rollbacks: int = 3
    """Stop after this many rollbacks in a row."""
    rollout_is_threshold: float | None = None
    """Importance weights between the policy an update starts from and the one that sampled the
    responses (verl's key): for offline groups whose data has the sampler's ``logprobs``. A number
    turns on their computation and ``mismatch/*`` metrics, and is the truncation ``C`` of the weights
    ``min(pi_old / pi_data, C)``; null: off."""
    rollout_is: bool = False
    """Multiply each token's policy-gradient loss by its truncated weight (needs
    ``rollout_is_threshold``); false computes the metrics only."""
    rollout_is_level: Literal["token", "sequence", "geometric"] = "token"
    """Weights per token, per sequence (the product of its token ratios), or their geometric mean."""
    rollout_is_mode: Literal["truncate"] = "truncate"
    """How weights above the threshold are bounded: truncated to it (verl's ``truncate``)."""
    rollout_rs: str | None = None
    """Rejection sampling (verl 0.9.1's ``rollout_correction.rollout_rs``): comma-separated criteria, all
    of which a token must pass to be trained: ``token_k1|k2|k3`` per token, ``seq_sum_*``, ``seq_mean_*``
    (k1, k2, k3) and ``seq_max_*`` (k2, k3) per sequence, of the divergence between the policy an update
    starts from and the one that sampled the offline responses (k1 = -log r, k2 = (log r)^2 / 2,
    k3 = r - 1 - log r, r = pi_old / pi_data). Rejected tokens leave the actor's loss and its token
    counts (``mismatch/rollout_rs_*``); responses without the sampler's ``logprobs`` are kept. null: off."""
    rollout_rs_threshold: str | None = None
    """Bounds of ``rollout_rs``: one for all criteria or one per criterion, comma-separated; a ``*_k1``
    criterion takes ratio bounds ``lower_upper`` (one number: the upper, its reciprocal the lower), the
    others one upper bound (e.g. ``0.05``)."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO's dynamic sampling."""
    reward_dpo_coef: float = 5.0
    """PRIME: weight of the implicit process rewards' RLOO returns (verl recipe's key)."""
    reward_gt_coef: float = 5.0
    """PRIME: weight of the outcome score's RLOO return (verl recipe's key). Not 0 together with
    ``reward_dpo_coef``: every advantage would be 0."""
    sppo_target: Literal["win_rate", "softmean"] = "win_rate"
    """SPPO's target per response (``actor.policy_loss.loss_mode=sppo``): ``win_rate``, the paper's
    ``actor.sppo_eta * (P - 1/2)`` with ``P`` the share of its group's other responses it beats by score
    (ties 1/2; offline groups under ``reward.style=ranking``: by the data's ranks); ``softmean``, verl
    recipe's ``actor.sppo_eta * (r - softmean_beta(r))`` with ``r`` the summed token rewards and the soft
    mean over the whole batch (all ranks)."""
    sppo_beta: float = 1.0
    """SPPO with ``sppo_target=softmean``: the soft mean's beta (0: the mean, large: towards the
    maximum), not a step size (that is ``actor.sppo_eta``). verl's SPPO recipe writes it
    ``algorithm.sppo_eta``, which is translated to this key."""

    @property
    def reads_data_logprobs(self) -> bool:
        """The offline data's sampler log-probs are read: importance weights, their metrics, or rejection."""
        return self.rollout_is_threshold is not None or self.rollout_rs is not None

    def __post_init__(self) -> None:
        if self.kl_penalty != "full":
            check_kl_kind(self.kl_penalty, "kl_penalty")
        _require(self, "> 1", "rollout_is_threshold")
        _require(self, ">= 0", "sppo_beta")
        if self.rollout_is and self.rollout_is_threshold is None:
            raise FieldError(
                "rollout_is=true applies importance weights, whose truncation rollout_is_threshold is unset "
                "(e.g. 2.0)",
                "rollout_is",
                "rollout_is_threshold",
            )
        if self.rollout_rs is not None:
            if self.rollout_rs_threshold is None:
                raise FieldError(
                    "rollout_rs rejects tokens beyond bounds, which rollout_rs_threshold must give (e.g. 0.05)",
                    "rollout_rs",
                    "rollout_rs_threshold",
                )
            try:
                rollout_rs_bounds(self.rollout_rs, self.rollout_rs_threshold)
            except ValueError as err:
                raise FieldError(str(err), "rollout_rs", "rollout_rs_threshold") from None
        _require(self, "[0, 1]", "gamma", "lam")
        _require(self, ">= 0", "rollback_kl", "max_rollbacks")
        _require(self, "(0, 1]", "rollback_lr_factor")


@dataclass(kw_only=True)
class TrainerConfig(RunTrainerConfig):
    """PPO's ``trainer`` section: the keys every run has, and PPO's own."""

    n_gpus_per_node: int | None = None
    """Ranks per node the preset is sized for (verl's key). With ``nnodes``, a run on another number of
    ranks stops at start-up, and ``--print-config`` validates for ``nnodes * n_gpus_per_node``; unset:
    any world size (torchrun's decides)."""
    nnodes: int | None = None
    """Nodes the preset is sized for (verl's key); see ``n_gpus_per_node``."""
    critic_warmup: int = 0
    """Steps at the start that train only the critic (the actor is frozen)."""
    val_before_train: bool = True
    """Validate once before the first step."""
    log_val_generations: int = 0
    """Write this many (prompt, response, score) rows of each validation, the first validation prompts
    (the same ones every time), to ``output_dir/generations.jsonl`` and TensorBoard's text tab (verl's key)."""
    save_hf_on_end: bool = False
    """Export the final actor with ``save_pretrained`` to ``output_dir/hf``."""
    profile_steps: list[int] = field(default_factory=list)
    """Steps to record with the torch profiler (counted from 1)."""
    warn_entropy_below: float = 0.0
    """Warn when the policy entropy falls below this (0 disables)."""
    rollback_val_drop: float = 0.0
    """Roll back when the validation score falls this much (relative) below the best (0 disables)."""
    max_skipped_steps: int = 3
    """Stop with an error after this many steps in a row skipped for a non-finite reward."""

    @property
    def planned_world_size(self) -> int | None:
        """``nnodes * n_gpus_per_node`` when either is set (the other counts as 1), else None."""
        if self.nnodes is None and self.n_gpus_per_node is None:
            return None
        return (self.nnodes or 1) * (self.n_gpus_per_node or 1)

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self, "> 0", "n_gpus_per_node", "nnodes", "profile_steps")
        _require(self, ">= 0", "critic_warmup", "warn_entropy_below", "log_val_generations")
        _require(self, "[0, 1)", "rollback_val_drop")
        _require(self, ">= 1", "max_skipped_steps")
