"""A run's input paths, checked before torch and transformers load (those imports take most of a minute
on a loaded machine): model folders, data files, the files and modules of user code. Imports only the
standard library, so every entry point can call it first thing (``cli.answer_early``)::

    problems = input_problems(cfg)   # one message per missing input, naming its key

``check_model_path`` is also what ``ppo.model_loading`` runs before ``from_pretrained``: a local-looking path
that does not exist fails at once with the key, never as a hub id (retries without a network).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The repository's root (the demo's ``assets/`` are built there)."""


class ModelPathError(FileNotFoundError):
    """A model or tokenizer path is neither a local folder nor a loadable hub id."""


def looks_local(path: str) -> bool:
    """Whether ``path`` can only mean a folder on disk, not a hub id."""
    # A hub id is ``name`` or ``org/name``: anything with a leading ./ ../ / ~, or more than one
    # separator, can only mean a folder on disk; so does ``org/name`` whose ``org`` is a local folder
    # (``assets/sft`` before ``make assets`` wrote it).
    if os.sep != "/" and os.sep in path:
        return True
    if path.startswith(("/", "./", "../", "~", ".")) or path.count("/") > 1:
        return True
    return "/" in path and os.path.isdir(path.split("/")[0])


def where(expanded: str) -> str:
    """The absolute path a relative one was looked for at, and the directory it is relative to."""
    if os.path.isabs(expanded):
        return expanded
    return f"{os.path.abspath(expanded)}, relative to the working directory {os.getcwd()}"


def check_model_path(path: str, config_key: str) -> str:
    """Expand ``~``; fail now, naming the config key, when a local-looking path does not exist. A path
    into the demo's ``assets/`` (``make assets`` writes it) is local whether or not ``assets`` exists
    yet: read as a hub id it would cost a minute of retries and blame the hub."""
    expanded = os.path.expanduser(str(path))
    if os.path.exists(expanded):
        if not os.path.isdir(expanded):
            raise ModelPathError(f"{config_key}={path!r} is a file; it must be a save_pretrained folder")
        return expanded
    assets = os.path.join(REPO, "assets")
    if (
        os.path.normpath(expanded).split(os.sep)[0] == "assets"
        or os.path.commonpath([os.path.abspath(expanded), assets]) == assets
    ):
        in_repo = os.path.join(REPO, expanded)  # an absolute path stays itself
        how = (
            f"it exists at {in_repo}: run from the repository's root, {REPO}"
            if os.path.isdir(in_repo) and os.getcwd() != REPO
            else "the demo's models are built by `make assets` (about 5 minutes on 2 cores), in the repository's root"
        )
        raise ModelPathError(f"{config_key}={path!r}: no such folder (looked for {where(expanded)}); {how}")
    if looks_local(str(path)):
        raise ModelPathError(
            f"{config_key}={path!r}: no such folder (looked for {where(expanded)}). "
            f"Set {config_key} to a save_pretrained folder or a hub id."
        )
    return expanded


HUB_TIMEOUT_S = 10.0
"""How long the start-up check waits for the hub's answer about a model id that is not cached."""


def _hf_home() -> str:
    """``HF_HOME``, by default ``$XDG_CACHE_HOME/huggingface`` (``~/.cache/huggingface``): the cache's and
    the saved token's folder."""
    return os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )


def hub_cache_dirs() -> list[str]:
    """Where transformers looks for downloaded models: ``HF_HUB_CACHE``, ``$HF_HOME/hub`` (``_hf_home``)
    and the older ``TRANSFORMERS_CACHE``."""
    dirs = [os.environ.get("HF_HUB_CACHE") or os.path.join(_hf_home(), "hub")]
    if os.environ.get("TRANSFORMERS_CACHE"):
        dirs.append(os.environ["TRANSFORMERS_CACHE"])
    return [os.path.expanduser(d) for d in dirs]


def _hub_token() -> str | None:
    """``HF_TOKEN``, or the token ``huggingface-cli login`` saved."""
    if os.environ.get("HF_TOKEN"):
        return os.environ["HF_TOKEN"]
    path = os.environ.get("HF_TOKEN_PATH") or os.path.join(_hf_home(), "token")
    try:
        return Path(path).read_text().strip() or None
    except OSError:
        return None


def hub_problem(path: str, config_key: str) -> str | None:
    """Why the hub id ``path`` (``name`` or ``org/name``: not a folder here) cannot be loaded, asked before
    torch loads: None when the model is in the cache or the hub has it. Offline
    (``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE``) only the cache counts; online, the hub's model API
    (``HF_ENDPOINT``, with ``HF_TOKEN`` for private models) answers within ``HUB_TIMEOUT_S``. A folder
    that was meant (``models/my-sft`` run from the wrong directory) then fails in seconds, naming the key,
    instead of after transformers' retries."""
    if os.path.exists(os.path.expanduser(path)) or looks_local(path):
        return None
    caches = hub_cache_dirs()
    if any(os.path.isdir(os.path.join(d, "models--" + path.replace("/", "--"), "snapshots")) for d in caches):
        return None
    head = f"{config_key}={path!r}: no such folder (looked for {where(path)}), not in the Hugging Face cache ({caches[0]})"
    if any(
        os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE")
        for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    ):
        return f"{head}, and the hub is off (HF_HUB_OFFLINE). Set {config_key} to a save_pretrained folder."
    import urllib.error
    import urllib.parse
    import urllib.request

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    request = urllib.request.Request(f"{endpoint}/api/models/{urllib.parse.quote(path)}", method="GET")
    if token := _hub_token():
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=HUB_TIMEOUT_S):
            return None
    except urllib.error.HTTPError as e:
        if e.code in (401, 403, 404):
            private = "" if token else "; a private or gated model needs HF_TOKEN"
            return (
                f"{head}, and {endpoint} has no model {path!r} (HTTP {e.code}{private}). "
                f"Set {config_key} to a save_pretrained folder or a hub id."
            )
        return None  # the hub is up but answered oddly: let transformers try (and say what went wrong)
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        return (
            f"{head}, and {endpoint} could not be reached ({reason}). "
            f"Set {config_key} to a save_pretrained folder, or download the model first."
        )


def code_problem(spec: str, key: str) -> str | None:
    """Why ``spec`` (``path/to/file.py:name`` or ``module.path:name``) cannot be imported, if its file or
    module does not exist; the module is found, not run (its own errors show where it is imported)."""
    target = spec.rpartition(":")[0] or spec
    if target.endswith(".py") or "/" in target or "\\" in target:
        return None if Path(target).is_file() else f"{key}={spec!r}: file {target} does not exist"
    try:
        found = importlib.util.find_spec(target)
    except ModuleNotFoundError:
        found = None
    except Exception:  # a parent package that fails to import: reported where it is imported
        return None
    return None if found is not None else f"{key}={spec!r}: no module named {target!r} (is it on PYTHONPATH?)"


def input_problems(cfg: Any) -> list[str]:
    """One message per input of ``cfg`` (PPO's or a stage's config) that does not exist: the model folders
    the run loads, the data files, the reward functions' (each of a list) and the environment's file or
    module."""
    problems = []
    for key, path in _model_paths(cfg):
        try:
            check_model_path(path, key)
        except ModelPathError as e:
            problems.append(str(e))
            continue
        if problem := hub_problem(path, key):
            problems.append(problem)
    for key in ("train_files", "val_files", "eval_prompt_files"):
        for path in getattr(cfg.data, key, None) or []:
            if not os.path.exists(path):
                from ppo.data_files import missing_file  # pyarrow: only when there is a problem

                problems.append(f"data.{key}: {missing_file(Path(path))}")
    reward, rollout = getattr(cfg, "reward", None), getattr(cfg, "rollout", None)
    specs = []
    if reward is not None and isinstance(reward.custom_function, list):  # reward.custom_function[i]
        specs += [(f"reward.custom_function[{i}]", spec) for i, spec in enumerate(reward.custom_function)]
    elif reward is not None and reward.custom_function:
        specs.append(("reward.custom_function", reward.custom_function))
    if rollout is not None and rollout.multi_turn.enable and rollout.multi_turn.env:
        specs.append(("rollout.multi_turn.env", rollout.multi_turn.env))
    problems += [p for key, spec in specs if (p := code_problem(spec, key)) is not None]
    return problems + teacher_problems(cfg)


def _model_paths(cfg: Any) -> list[tuple[str, str]]:
    """``(key, path)`` of every model folder the run loads (an unset ``model.path`` is the config's own
    error: ``ppo.config.shared.unset_inputs``)."""
    paths = [("model.path", cfg.model.path)] if cfg.model.path else []
    if cfg.model.tokenizer_path:
        paths.append(("model.tokenizer_path", cfg.model.tokenizer_path))
    ref, critic, reward = (getattr(cfg, name, None) for name in ("ref", "critic", "reward"))
    if ref is not None and ref.model_path and getattr(cfg, "needs_reference", True):
        paths.append(("ref.model_path", ref.model_path))
    if critic is not None and critic.model_path and cfg.use_critic:
        paths.append(("critic.model_path", critic.model_path))
    if reward is not None and getattr(reward, "model_path", None):
        paths.append(("reward.model_path", reward.model_path))
    return paths + teacher_paths(cfg)


def teacher_paths(cfg: Any) -> list[tuple[str, str]]:
    """``(key, path)`` of each teacher of a distillation run (none otherwise)."""
    d = getattr(cfg, "distillation", None)
    if d is None or not d.enabled:
        return []
    return [
        (f"distillation.teacher_models.{name}.model_path", t.model_path)
        for name, t in d.teacher_models.items()
    ]


TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model", "special_tokens_map.json")
"""The files whose content is the tokenizer: a teacher must have the student's, byte for byte, where both
folders hold them (``tokenizer_config.json`` is compared on its special tokens only)."""
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _special_tokens(folder: str) -> dict[str, Any]:
    """The special tokens ``tokenizer_config.json`` names, {} without the file."""
    try:
        with open(os.path.join(folder, "tokenizer_config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    return {k: config.get(k) for k in SPECIAL_TOKENS}


def _vocab_size(folder: str) -> int | None:
    """``vocab_size`` of the model's ``config.json`` (None where the file does not say)."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            size = json.load(f).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return size if isinstance(size, int) else None


def teacher_problems(cfg: Any) -> list[str]:
    """What the local folders tell, before any model loads, against distilling each teacher into the
    student: a tokenizer file or special token that differs from the student's (the teacher's log-probs
    would be of other tokens), a vocabulary of another size, or ``topk`` not below the vocabulary."""
    problems: list[str] = []
    if not teacher_paths(cfg):
        return problems
    student = os.path.expanduser(cfg.model.tokenizer_path or cfg.model.path)
    student_key = "model.tokenizer_path" if cfg.model.tokenizer_path else "model.path"
    student_vocab = _vocab_size(os.path.expanduser(cfg.model.path))
    loss = cfg.distillation.distillation_loss
    for key, path in teacher_paths(cfg):
        folder = os.path.expanduser(path)
        if not os.path.isdir(folder):
            continue  # a hub id: transformers checks it when it loads
        if os.path.isdir(student):
            for name in TOKENIZER_FILES:
                mine, theirs = os.path.join(student, name), os.path.join(folder, name)
                if os.path.isfile(mine) and os.path.isfile(theirs) and _read(mine) != _read(theirs):
                    problems.append(
                        f"{key}={path}: its tokenizer differs from the student's ({student_key}={student}): "
                        f"{name} is not the same file; a teacher must share the student's tokenizer"
                    )
                    break
            else:
                mine, theirs = _special_tokens(student), _special_tokens(folder)
                differ = [k for k in SPECIAL_TOKENS if mine and theirs and mine.get(k) != theirs.get(k)]
                if differ:
                    problems.append(
                        f"{key}={path}: its special tokens differ from the student's ({student_key}={student}): "
                        + ", ".join(f"{k} {theirs.get(k)!r} vs {mine.get(k)!r}" for k in differ)
                    )
        vocab = _vocab_size(folder)
        if vocab is not None and student_vocab is not None and vocab != student_vocab:
            problems.append(
                f"{key}={path}: its vocabulary has {vocab} tokens and the student's (model.path) {student_vocab}; "
                "a teacher must share the student's tokenizer"
            )
        if vocab is not None and loss.use_topk and loss.topk >= vocab:
            problems.append(
                f"distillation.distillation_loss.topk={loss.topk} must be below the vocabulary of {key}={path} "
                f"({vocab} tokens)"
            )
    return problems


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
