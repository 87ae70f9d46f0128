"""On-policy distillation's section of a PPO run (verl 0.9.1's ``distillation.*``): the teachers, the
row field that routes each row to one, and the loss. The rules that span sections (the estimator without
the task's loss, the recipes it is not combined with) live with the root, ``ppo.config.root``; the
warnings for keys that do nothing with ``ppo.config.startup_warnings``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ppo.choices import DISTILLATION_LOSS_MODES
from ppo.config.errors import FieldError, _require


@dataclass(kw_only=True)
class TeacherModelConfig:
    """One teacher of on-policy distillation (verl 0.9.1's ``distillation.teacher_models.<name>``): a
    frozen causal LM of the student's tokenizer, loaded once and sharded over all ranks as the reference
    is (``ref.fsdp``). verl's ``num_replicas`` and ``inference.*`` (its vLLM/SGLang servers) have no
    meaning here: teachers score the packed sequences in this process group."""

    key: str | None = None
    """The value of a row's ``distillation.teacher_key`` field that this teacher scores; with one
    teacher every row goes to it and the key is not needed."""
    model_path: str | None = None
    """The teacher's ``save_pretrained`` folder (or hub id)."""


VERL_TEACHER_KEYS = ("num_replicas", "inference", "_target_")
"""Keys of a verl teacher entry that say how verl serves it (replicas, the inference engine); accepted
here and ignored with a start-up warning (``_target_`` silently)."""


@dataclass(kw_only=True)
class DistillationLossConfig:
    """The distillation loss (verl 0.9.1's ``distillation.distillation_loss``; defaults are its yaml's)."""

    loss_mode: str = "k3"
    """Per-token loss on the student's samples: the reverse-KL estimators ``kl``/``k1``, ``abs``,
    ``mse``/``k2``, ``low_var_kl``/``k3`` of the sampled token's student and teacher log-probs, or
    ``forward_kl_topk``: ``sum_k p_t(k) (log p_t(k) - log q_s(k))`` over the teacher's ``topk`` tokens,
    clamped at 0."""
    topk: int = 32
    """Tokens per position of the teacher's top-k (``loss_mode=forward_kl_topk``)."""
    use_task_rewards: bool = True
    """Train on the task's PPO/GRPO loss too: loss = task loss + ``distillation_loss_coef`` x the
    distillation loss. false: the distillation loss alone (no advantages, KL loss or entropy bonus; the
    reward is still scored and logged, and validation uses it)."""
    distillation_loss_coef: float = 1.0
    """Weight of the distillation loss when ``use_task_rewards`` (1 otherwise)."""
    loss_max_clamp: float | None = None
    """Clamp each token's loss to ``[-loss_max_clamp, loss_max_clamp]`` before it is aggregated (or
    becomes an advantage); null: no clamp."""
    log_prob_min_clamp: float | None = None
    """``forward_kl_topk``: clamp both models' top-k log-probs from below before the KL; null: none."""
    use_policy_gradient: bool = False
    """true: each token's negative distillation loss (detached) is the advantage of a clipped
    policy-gradient loss (the Thinking Machines recipe; use ``k1``); false: the loss is backpropagated
    directly (use ``k3`` or ``forward_kl_topk``)."""
    policy_loss_mode: Literal["vanilla"] = "vanilla"
    """The policy-gradient loss with ``use_policy_gradient`` (verl supports only vanilla)."""
    clip_ratio: float = 0.2
    """PPO clip of that loss (verl's yaml sets low and high to 0.2 as well)."""
    clip_ratio_low: float = 0.2
    """Lower clip of that loss's ratio."""
    clip_ratio_high: float = 0.2
    """Upper clip of that loss's ratio."""

    @property
    def use_topk(self) -> bool:
        """The loss needs the teacher's top-k log-probs and ids (else its log-prob of the sampled token)."""
        return self.loss_mode == "forward_kl_topk"

    def __post_init__(self) -> None:
        if self.loss_mode not in DISTILLATION_LOSS_MODES:
            raise FieldError(
                f"loss_mode={self.loss_mode!r} is not a distillation loss; valid: "
                f"{', '.join(DISTILLATION_LOSS_MODES)}",
                "loss_mode",
            )
        _require(self, "> 0", "topk", "loss_max_clamp")
        _require(self, ">= 0", "distillation_loss_coef", "clip_ratio", "clip_ratio_low", "clip_ratio_high")
        if self.loss_mode in ("kl", "k1") and not self.use_policy_gradient:
            raise FieldError(
                f"loss_mode={self.loss_mode} backpropagated directly does not learn from the teacher (the "
                f"gradient of log q_s - log p_t does not depend on p_t): set use_policy_gradient=true, or "
                f"loss_mode=k3 or forward_kl_topk",
                "loss_mode",
                "use_policy_gradient",
            )


@dataclass(kw_only=True)
class DistillationConfig:
    """On-policy distillation (verl 0.9.1's ``distillation.*``): the student (the actor) trains on its own
    samples with the teachers' per-token log-probs as the signal."""

    enabled: bool = False
    """Distill from ``teacher_models``."""
    teacher_models: dict[str, Any] = field(default_factory=dict)
    """Teachers by name, each ``{key, model_path}`` (``TeacherModelConfig``). One teacher scores every
    row; several route each row to the teacher whose ``key`` is the row's ``teacher_key`` field. An entry
    with neither key nor model_path is verl's empty default (``teacher_model``) and is left out."""
    teacher_key: str = "data_source"
    """The row field that picks its teacher when there are several: ``data_source`` or a field of the
    row's ``extra_info``."""
    distillation_loss: DistillationLossConfig = field(default_factory=DistillationLossConfig)
    """The loss."""

    def __post_init__(self) -> None:
        self.ignored_keys: list[str] = []  # verl's serving keys seen in the entries (a start-up warning)
        teachers = {}
        for name, entry in (self.teacher_models or {}).items():
            where = f"teacher_models.{name}"
            if isinstance(entry, TeacherModelConfig):
                teachers[name] = entry
                continue
            if not isinstance(entry, dict):
                raise FieldError(f"{where} must be a mapping with key and model_path, got {entry!r}", where)
            unknown = sorted(k for k in entry if k not in ("key", "model_path", *VERL_TEACHER_KEYS))
            if unknown:
                raise FieldError(
                    f"{where}.{unknown[0]} is not a teacher key (a teacher takes key and model_path)",
                    f"{where}.{unknown[0]}",
                )
            for k in ("key", "model_path"):
                if entry.get(k) is not None and not isinstance(entry[k], str):
                    raise FieldError(f"{where}.{k} must be a string, got {entry[k]!r}", f"{where}.{k}")
            if entry.get("key") is None and entry.get("model_path") is None:
                continue  # verl's placeholder entry
            serving = [f"distillation.{where}.{k}" for k in entry if k in ("num_replicas", "inference")]
            self.ignored_keys += serving
            teachers[name] = TeacherModelConfig(key=entry.get("key"), model_path=entry.get("model_path"))
        self.teacher_models = teachers
        if not self.enabled:
            return
        if not teachers:
            raise FieldError(
                "enabled=true needs a teacher: set distillation.teacher_models.teacher_model.model_path=<folder>",
                "enabled",
                "teacher_models",
            )
        for name, teacher in teachers.items():
            if not teacher.model_path:
                raise FieldError(
                    f"teacher_models.{name} has no model_path", f"teacher_models.{name}.model_path"
                )
        if len(teachers) > 1:
            keys = [t.key for t in teachers.values()]
            for name, teacher in teachers.items():
                if teacher.key is None:
                    raise FieldError(
                        f"teacher_models.{name} has no key: with several teachers each one names the "
                        f"{self.teacher_key} value of the rows it scores",
                        f"teacher_models.{name}.key",
                    )
            if len(set(keys)) < len(keys):
                twice = sorted({k for k in keys if keys.count(k) > 1})
                raise FieldError(f"teacher_models: two teachers have the key {twice[0]!r}", "teacher_models")
