"""The command line every entry point shares: ``--config X.yaml``, ``section.key=value`` overrides,
``--print-config`` and ``--world-size``; the one-line config error; ``--help`` and ``--print-config``
answered, and missing inputs reported, before torch loads (``answer_early``)::

    cfg, args = parse_cli(sys.argv[1:], PPOConfig)          # what every entry point does
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
import typing
from pathlib import Path
from typing import Any

from ppo.config import ConfigError, PPOConfig, validate_stage
from ppo.config_keys import COMMAND_LINE
from ppo.config_loader import load_config, to_yaml
from ppo.input_paths import input_problems

C = typing.TypeVar("C")

OVERRIDES_HELP = """\
overrides: section.key=value, values parsed as YAML (true, [1,5], null, 1e-6); they win over --config.
A key that takes a string gets the text as typed (experiment_name=010 is 010); a # is part of the value.
PPO also takes verl's spellings: actor_rollout_ref.actor.optim.lr=1e-6 is actor.optim.lr, and a verl
key that changes nothing here (rollout.gpu_memory_utilization) is named in a start-up warning."""


PPO_KEYS_HELP = """\
main keys: model.path (the policy), data.train_files and data.val_files, data.train_batch_size (prompts a
step), rollout.n (responses a prompt), algorithm.adv_estimator (gae, grpo, rloo, ...), actor.optim.lr,
reward.custom_function (file.py:function), trainer.output_dir, trainer.total_training_steps."""

CONFIG_REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
"""The generated reference of every config key (``scripts/config_reference.py``)."""


def user_help(doc: str) -> str:
    """What ``--help`` shows of an entry point's docstring: its summary and its example commands (the
    paragraphs up to the indented examples, and those); what follows them is for readers of the code."""
    paragraphs = doc.strip("\n").split("\n\n")
    shown = paragraphs[:1]
    for paragraph in paragraphs[1:]:
        if not all(line.startswith("    ") for line in paragraph.splitlines()):
            break
        shown.append(paragraph)
    return "\n\n".join(shown)


def command_line(description: str, schema: type[Any] | None = None) -> argparse.ArgumentParser:
    """The parser of every entry point: ``--config X.yaml``, ``key.sub=value`` overrides,
    ``--print-config`` and ``--world-size N``. ``--help`` shows the summary and example commands of
    ``description`` (the script's docstring, ``user_help``), the options, the main keys of ``schema``'s
    runs (PPO's) and where the reference of every key is."""
    epilog = [OVERRIDES_HELP, *([PPO_KEYS_HELP] if schema is PPOConfig else [])]
    epilog.append(
        f"every key, its default and meaning: {CONFIG_REFERENCE}\n"
        "(--print-config prints the resolved config of a command line)"
    )
    parser = argparse.ArgumentParser(
        description=user_help(description),
        epilog="\n\n".join(epilog),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", action="append", default=None, help="YAML preset over the defaults")
    parser.add_argument(
        "--config-path",
        default=None,
        help="verl's (Hydra's) spelling: with --config-name, the folder of the YAML file (--config DIR/NAME.yaml)",
    )
    parser.add_argument("--config-name", default=None, help="verl's (Hydra's) spelling: the YAML file's name")
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config (validated) and exit"
    )
    parser.add_argument(
        "--allow-missing-paths",
        action="store_true",
        help="with --print-config: a missing model folder, data file or reward/environment file is a warning, "
        "not an error (checking a command on a machine that cannot see the files of the one it will run on)",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="with --print-config: validate for this many ranks (default: trainer.nnodes x "
        "trainer.n_gpus_per_node where a preset sets them)",
    )
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides (see below)")
    return parser


def parse_cli(
    argv: list[str] | None, cls: type[C] | None = None, description: str = ""
) -> tuple[C, argparse.Namespace]:
    """The command line every entry point shares (``command_line``), loaded into ``cls`` (default
    ``PPOConfig``). ``args.notes`` lists the keys that were accepted but do nothing here, for the caller
    to log once."""
    args = command_line(description, cls or PPOConfig).parse_args(argv)
    if args.world_size is not None and args.world_size < 1:
        raise ConfigError(f"--world-size must be >= 1, got {args.world_size} (from {COMMAND_LINE})")
    args.notes = []
    return load_config(config_file(args), args.overrides, cls, notes=args.notes), args


def config_file(args: argparse.Namespace) -> str | None:
    """``--config``, or verl's ``--config-path DIR --config-name NAME`` (``DIR/NAME.yaml``); one preset a
    run (``args.config`` becomes that file)."""
    presets = args.config if isinstance(args.config, list) else [args.config] if args.config else []
    if len(presets) > 1:
        raise ConfigError(
            f"--config is given {len(presets)} times ({', '.join(presets)}): a run takes one preset; give "
            f"the keys of the others as key=value overrides (from {COMMAND_LINE})"
        )
    args.config = presets[0] if presets else None
    if args.config_name is None:
        if args.config_path is not None:
            raise ConfigError(f"--config-path={args.config_path} needs --config-name (from {COMMAND_LINE})")
        return args.config
    if args.config is not None:
        raise ConfigError(f"give --config or --config-path/--config-name, not both (from {COMMAND_LINE})")
    name = args.config_name if args.config_name.endswith((".yaml", ".yml")) else f"{args.config_name}.yaml"
    return os.path.join(args.config_path or ".", name)


def print_config(cfg: Any, args: argparse.Namespace) -> int:
    """``--print-config``: validate ``cfg`` for ``--world-size`` (a PPO preset's planned world size when
    not given), print it as YAML and the start-up warnings a run would log (on stderr); the exit code: 2
    with the problems on stderr when the config is invalid, or when an input it names is missing (a model
    folder, a data file, the reward function's or the environment's file) unless
    ``--allow-missing-paths`` (a preset checked on a machine that cannot see the files), else 0."""
    try:
        world_size = args.world_size
        if world_size is None and isinstance(cfg, PPOConfig):
            world_size = cfg.trainer.planned_world_size
        if world_size is not None:
            cfg.validate(world_size) if isinstance(cfg, PPOConfig) else validate_stage(cfg, world_size)
    except ConfigError as e:
        return config_error(e)
    print(to_yaml(cfg), end="")
    problems = inputs_problems(cfg)
    problems += environment_problems(cfg, problems)
    missing_is_error = not args.allow_missing_paths
    if _is_main():
        for warning in [*args.notes, *cfg.warnings(), *([] if missing_is_error else problems)]:
            print(f"warning: {warning}", file=sys.stderr)
        if missing_is_error:
            for problem in problems:
                print(f"error: {problem}", file=sys.stderr)
            if problems:
                print(
                    "error: --print-config found missing inputs (exit 2); --allow-missing-paths checks the "
                    "rest on a machine that cannot see them",
                    file=sys.stderr,
                )
    return 2 if problems and missing_is_error else 0


def inputs_problems(cfg: Any) -> list[str]:
    """One message per input the run cannot start without: the unset ones (``model.path``,
    ``data.train_files``: their defaults name nothing), else those it names that do not exist
    (``input_paths.input_problems``: looked up only once every input is named)."""
    return cfg.unset_inputs() or input_problems(cfg)


def environment_problems(cfg: Any, problems: list[str]) -> list[str]:
    """Why the multi-turn environment class cannot serve the run (``environments.check_environment``:
    imported, its methods checked, one instance made), as the trainer's start-up would refuse it; nothing
    when multi-turn is off or its file is already among ``problems``."""
    multi_turn = getattr(getattr(cfg, "rollout", None), "multi_turn", None)
    if (
        multi_turn is None
        or not multi_turn.enable
        or any(p.startswith("rollout.multi_turn.env=") for p in problems)
    ):
        return []
    from ppo.environments import check_environment
    from ppo.user_code import UserCodeError

    try:
        check_environment(multi_turn.env, timeout_s=multi_turn.step_timeout_s)
    except UserCodeError as e:
        return [str(e)]
    return []


def config_error(error: ConfigError) -> int:
    """Report a config error (on rank 0: under torchrun every rank parses alike); exit code 2."""
    if _is_main():
        print(f"config error: {error}", file=sys.stderr)
    return 2


REPORT_DELAY_S = 10.0
"""How long ranks other than 0 wait before reporting a failure that every rank sees (rank 0's report
then ends the job under torchrun, and the error is said once)."""


def _is_main() -> bool:
    return os.environ.get("RANK", "0") == "0"


def answer_early(argv: list[str] | None, description: str, schema: type[Any]) -> None:
    """``--help`` and ``--print-config``, answered before an entry point imports torch and transformers
    (seconds); exits when it answered, else returns and the run goes on, unless an input the config names
    is missing (``input_paths.input_problems``: a model folder, a data file, a reward function's file or
    module), which ends it here with one line and exit code 2. ``schema``: the entry point's config
    class (``ppo.config`` imports no torch), which ``--print-config`` loads.

    An entry point calls it first thing::

        if __name__ == "__main__":
            cli.answer_early(sys.argv[1:], __doc__, PPOConfig)
    """
    signal.signal(signal.SIGINT, _interrupted_at_start)  # runner.main restores Ctrl-C's KeyboardInterrupt
    args = command_line(description, schema).parse_args(
        argv
    )  # --help, or a malformed command line, exits here
    try:
        cfg, args = parse_cli(argv, schema, description)
    except ConfigError as e:
        if args.print_config:
            sys.exit(config_error(e))
        return  # the run reports it (and records it for torchrun)
    if args.print_config:
        sys.exit(print_config(cfg, args))
    problems = inputs_problems(cfg)  # an unset or missing model, data file or reward module: seconds
    if problems:
        message = " | ".join(problems)
        if _is_main():
            print(f"error: {message}", file=sys.stderr)
        else:
            # Rank 0 reports it; under torchrun its exit ends this rank first, so that the failure
            # summary names the root cause once, not once per rank.
            time.sleep(REPORT_DELAY_S)
        _record_for_torchrun(message)
        sys.exit(2)


def _interrupted_at_start(signum: int, frame: Any) -> None:
    """Ctrl-C before the run has begun (while torch and transformers import): one line, exit code 130,
    not the traceback of whatever import it interrupted."""
    if _is_main():
        print("interrupted during start-up: nothing was started or saved", file=sys.stderr)
    raise SystemExit(130)


def _record_for_torchrun(message: str) -> None:
    """Write ``message`` to this rank's torchrun error file (``TORCHELASTIC_ERROR_FILE``), in the format
    of torch.distributed.elastic's ``ErrorHandler`` (``runner.ErrorFile``), so that torchrun's failure
    summary names it; nothing without torchrun."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        info = {"py_callstack": message, "timestamp": str(int(time.time()))}
        with contextlib.suppress(OSError):
            Path(path).write_text(json.dumps({"message": {"message": message, "extraInfo": info}}))
