"""Every shell command in README.md and docs/*.md runs as written from a fresh shell after the set-up
(`make install`, `source .venv/bin/activate`).

The commands are the lines of the fenced code blocks marked ``bash``, ``sh`` or ``shell`` (a block
without a language is output or a transcript and is not run); ``\\`` joins lines, ``#`` starts a
comment, ``&&``, ``;``, ``||`` and ``|`` separate commands, ``VAR=value`` before a program sets its
environment, and a ``...`` argument stands for "your other arguments" and is left out. For each
command:

- the program is known: a target of the Makefile (``make``), a script of the repository (``python``,
  ``torchrun``, ``bash``, ``sbatch``), ``python -m pytest``, or a program of the shell or the
  environment (``tensorboard``, ``pip``, ``mkdir``, ...); ``python`` and ``torchrun`` are the plain
  names (the activated virtualenv's), never ``.venv/bin/...``;
- every ``--flag`` is one the script's argument parser defines (read from its source with ``ast``, or
  the entry points' shared parser, ``ppo.cli.command_line``), and torchrun's and sbatch's own options
  are ones they take;
- every file of the repository it names exists: a path starting with ``configs/``, ``scripts/``,
  ``docs/``, ``ppo_kernels/``, ``ppo/`` or ``tests/``. Other paths are exempt: what a command creates or
  reads after another has made it (``assets/``, ``outputs/``, ``data/``, ``models/``, ``logs/``), what
  the user supplies (``/path/to/...``, absolute paths, ``~``, hub ids), and placeholders (``<preset>``);
- for ``train_ppo.py`` and the stage scripts (also through ``sbatch``), ``--print-config`` passes on
  the command's arguments, in process (it answers before torch loads), validated for the world size
  the command launches (1 for ``python``, ``--nproc_per_node`` × ``--nnodes`` for ``torchrun``, the
  Slurm job's nodes × GPUs per node for ``sbatch``), or for its own ``--world-size``; and it names
  its validation files (``data.val_files``, on the line or in its preset), or its section of the page says
  it has none (the defaults name no data: such a run does not validate).
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

import ppo.config
from ppo import cli
from ppo.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"bash", "sh", "shell"}
SEPARATORS = {"&&", ";", "||", "|"}
REPO_DIRS = ("configs/", "scripts/", "docs/", "ppo_kernels/", "ppo/", "tests/")
ENTRY_POINTS = {
    "train_ppo.py": "PPOConfig",
    "scripts/train_sft.py": "SFTConfig",
    "scripts/train_reward_model.py": "RewardModelConfig",
    "scripts/train_dpo.py": "DPOConfig",
}
SHELL_PROGRAMS = {"cd", "source", "mkdir", "pip", "tensorboard", "wget", "export", "time", "git", "ls", "cat"}
TORCHRUN_FLAGS = {
    "-m",  # the script is a module: torchrun ... -m ppo_bench.sp
    "--module",
    "--nproc_per_node",
    "--nproc-per-node",
    "--nnodes",
    "--standalone",
    "--max-restarts",
    "--max_restarts",
    "--node_rank",
    "--node-rank",
    "--rdzv_backend",
    "--rdzv-backend",
    "--rdzv_endpoint",
    "--rdzv-endpoint",
    "--rdzv_id",
    "--rdzv-id",
    "--master_addr",
    "--master_port",
}
SBATCH_FLAGS = {"--nodes", "--time", "--partition", "--account", "--gpus-per-node", "--job-name", "--qos"}


@dataclass
class Command:
    page: str
    line: int
    argv: list[str]
    cwd: Path

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {shlex.join(self.argv)}"


def shell_blocks(path: Path) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of each fenced block marked bash/sh/shell."""
    blocks, current, start, fence = [], None, 0, None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        if fence is None and stripped.startswith("```"):
            fence = stripped[3:].strip().lower()
            current, start = [], number + 1
        elif fence is not None and stripped.startswith("```"):
            if fence in SHELL_LANGS:
                blocks.append((start, current))
            fence = current = None
        elif current is not None:
            current.append(line)
    return blocks


def commands(path: Path) -> list[Command]:
    """The commands of a page's shell blocks, as argument lists."""
    found = []
    for start, lines in shell_blocks(path):
        joined, first = "", None
        for offset, line in enumerate(lines):
            first = start + offset if first is None else first
            if line.rstrip().endswith("\\"):
                joined += line.rstrip()[:-1] + " "
                continue
            joined += line
            tokens = [t for t in shlex.split(joined, comments=True) if t != "..."]
            cwd, argv = ROOT, []
            for token in [*tokens, ";"]:
                if token in SEPARATORS:
                    if argv:
                        while argv and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", argv[0]):
                            argv.pop(0)  # VAR=value before the program
                        if argv and argv[0] == "cd" and len(argv) > 1:
                            cwd = (cwd / argv[1]).resolve()
                        if argv:
                            found.append(Command(path.relative_to(ROOT).as_posix(), first, argv, cwd))
                    argv = []
                else:
                    argv.append(token)
            joined, first = "", None
    return found


ALL = [c for page in PAGES for c in commands(page)]


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M))


def script_flags(script: Path) -> set[str]:
    """The option strings a script's argparse parser defines (its own source and the scripts/ modules it
    imports), or the entry points' shared parser."""
    if script.relative_to(ROOT).as_posix() in ENTRY_POINTS:
        parser = cli.command_line("")
        return {s for action in parser._actions for s in action.option_strings}
    flags, seen, todo = {"-h", "--help"}, set(), [script]
    while todo:
        path = todo.pop()
        if path in seen or not path.exists():
            continue
        seen.add(path)
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                flags |= {
                    a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")
                }
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
                names += [a.name for a in node.names]
                todo += [script.parent / f"{n.split('.')[-1]}.py" for n in names if n]
    return flags


def named_paths(args: list[str]) -> list[str]:
    """Repository paths an argument list names: arguments, values of key=value and --flag=value, items
    of [a,b] lists."""
    paths = []
    for arg in args:
        value = arg.split("=", 1)[1] if "=" in arg else arg
        for item in value.strip("[]").split(","):
            item = item.strip().strip("'\"")
            if ":" in item and not item.startswith("/"):
                item = item.split(":", 1)[0]  # file.py:function
            if item.startswith(REPO_DIRS) and not re.search(r"[<>{}*]", item):
                paths.append(item)
    return paths


def print_config(entry: str, args: list[str], world_size: int | None) -> str | None:
    """``--print-config`` on an entry point's arguments, in process: None when it passes, else why."""
    argv = [a for a in args if a != "--print-config"]
    schema = getattr(ppo.config, ENTRY_POINTS[entry])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cfg, ns = cli.parse_cli(argv, schema)
        except ConfigError as e:
            return f"config error: {e}"
        except SystemExit:  # argparse refused the command line
            return err.getvalue().strip()
        if ns.world_size is None and world_size is not None:
            ns.world_size = world_size
        ns.allow_missing_paths = True  # the docs' commands name the reader's files (/path/to/model)
        code = cli.print_config(cfg, ns)
    return None if code == 0 else err.getvalue().strip()


NO_VALIDATION = re.compile(r"no validation files|no `?data\.val_files`?|data\.val_files=\[\]", re.IGNORECASE)
"""How a page says that a command has no validation files."""


def validation_problem(c: Command, entry: str, args: list[str]) -> str | None:
    """Why the command of ``entry`` (its config valid) leaves its validation files unsaid: it names none,
    on the line or in its preset, and its section of the page does not say it has none."""
    cfg, _ = cli.parse_cli(
        [a for a in args if a != "--print-config"], getattr(ppo.config, ENTRY_POINTS[entry])
    )
    if cfg.data.val_files or any(a.startswith("data.val_files=") for a in args):  # named, or [] said
        return None
    page = ROOT / c.page
    lines = page.read_text().splitlines() if page.is_file() else []  # a test's made-up page: no section
    start = max(
        (i for i in range(c.line) if lines[i].startswith("#") and not lines[i].startswith("# ")), default=0
    )
    end = next((i for i in range(c.line, len(lines)) if lines[i].startswith("## ")), len(lines))
    if NO_VALIDATION.search("\n".join(lines[start:end])):
        return None
    return "it names no data.val_files: name them, or say in its section that it has none"


def check_script(c: Command, script: str, args: list[str], world_size: int | None) -> list[str]:
    path = (c.cwd / script).resolve()
    if not path.exists():
        return [f"no such script {script}"]
    problems = []
    flags = script_flags(path)
    for arg in args:
        if arg.startswith("-") and arg.split("=", 1)[0] not in flags:
            problems.append(f"{script} has no option {arg.split('=', 1)[0]}")
    rel = path.relative_to(ROOT).as_posix()
    if rel in ENTRY_POINTS and not {"-h", "--help"} & set(args):
        why = print_config(rel, args, world_size)
        if why:
            problems.append(f"--print-config fails: {why}")
        elif unsaid := validation_problem(c, rel, args):
            problems.append(unsaid)
    return problems


def module_path(module: str) -> str:
    """The file of a module of the project, by pyproject.toml's package-dir: ``ppo_bench.kernels`` ->
    ``scripts/ppo_bench/kernels.py``, ``ppo.cli`` -> ``ppo/cli.py``."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        package_dir = tomllib.load(f)["tool"]["setuptools"].get("package-dir", {})
    top, _, rest = module.partition(".")
    folder = package_dir.get(top, top)
    return "/".join([folder, *rest.split(".")]) + ".py" if rest else f"{folder}/__init__.py"


def split_options(args: list[str], takes_value: set[str]) -> tuple[dict[str, str], list[str]]:
    """Leading --options of a launcher (``--opt=v``, ``--opt v`` for those in ``takes_value``, flags)
    and the rest."""
    options, i = {}, 0
    while i < len(args) and args[i].startswith("-"):
        name, _, value = args[i].partition("=")
        if not value and name in takes_value and i + 1 < len(args):
            i += 1
            value = args[i]
        options[name] = value
        i += 1
    return options, args[i:]


def check(c: Command) -> list[str]:
    program, args = c.argv[0], c.argv[1:]
    problems = [
        f"the repository's file {p} does not exist" for p in named_paths(args) if not (c.cwd / p).exists()
    ]
    if program.startswith(".venv/"):
        return [*problems, f"use plain {Path(program).name} (the activated virtualenv's), not {program}"]
    if program == "make":
        targets = make_targets()
        problems += [
            f"no make target {t}" for t in args if "=" not in t and not t.startswith("-") and t not in targets
        ]
    elif program in ("python", "python3"):
        if args[:2] == ["-m", "pytest"]:
            return problems
        if args[0] == "-m":  # a module of the repository, run from its root: python -m ppo_bench.kernels
            return problems + check_script(c, module_path(args[1]), args[2:], 1)
        problems += check_script(c, args[0], args[1:], 1)  # one process
    elif program == "torchrun":
        options, rest = split_options(args, TORCHRUN_FLAGS - {"--standalone", "-m", "--module"})
        problems += [f"torchrun has no option {o}" for o in options if o not in TORCHRUN_FLAGS]
        nproc = options.get("--nproc_per_node", options.get("--nproc-per-node", "1"))
        nnodes = options.get("--nnodes", "1")
        world = int(nproc) * int(nnodes) if nproc.isdigit() and nnodes.isdigit() else None
        script = module_path(rest[0]) if {"-m", "--module"} & set(options) else rest[0]
        problems += check_script(c, script, rest[1:], world)
    elif program == "sbatch":
        options, rest = split_options(args, SBATCH_FLAGS)
        problems += [f"sbatch option {o} is not one these docs use" for o in options if o not in SBATCH_FLAGS]
        job = c.cwd / rest[0]
        if not job.exists():
            return [*problems, f"no such Slurm script {rest[0]}"]
        text = job.read_text()
        default = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.M))
        nodes = int(options.get("--nodes", default.get("nodes", "1")))
        gpus = int(options.get("--gpus-per-node", default.get("gpus-per-node", "8")))
        entry = re.search(r"^ENTRY=(\S+)", text, re.M).group(1)
        why = print_config(entry, ["--config", *rest[1:2], *rest[2:]], nodes * gpus)
        if why:
            problems.append(f"--print-config of {entry} fails: {why}")
    elif program == "bash":
        if not (c.cwd / args[0]).exists():
            problems.append(f"no such script {args[0]}")
    elif program not in SHELL_PROGRAMS:
        problems.append(f"unknown program {program}: teach tests/unit/test_docs_commands.py what it is")
    return problems


def test_the_pages_hold_commands():
    # README's set-up, demo, own-model and verl commands at least; a parser that finds nothing tests nothing
    readme = [c for c in ALL if c.page == "README.md"]
    assert [c.argv[:2] for c in readme[:2]] == [["make", "demo"], ["make", "test"]]
    assert sum(c.argv[0] == "torchrun" for c in ALL) >= 10


@pytest.mark.parametrize("command", ALL, ids=str)
def test_command_runs_as_written(command: Command):
    assert check(command) == [], str(command)


def test_a_bad_command_is_caught():
    def bad(line: str) -> list[str]:
        argv = shlex.split(line)
        return check(Command("x.md", 1, argv, ROOT))

    assert bad("python train_ppo.py --config configs/demo_cpu.yaml --no-such-flag")
    assert bad("python train_ppo.py --config configs/no_such_preset.yaml")
    assert bad("torchrun --nproc_per_node=3 train_ppo.py --config configs/demo_cpu.yaml")  # 32 prompts over 3
    assert bad("python train_ppo.py --config configs/demo_cpu.yaml actor.kl_coef=0.1")
    assert bad("make no-such-target")
    assert bad(".venv/bin/python train_ppo.py --print-config")
    assert bad("python scripts/make_offline_data.py --no-such-flag")
    assert bad("sbatch --nodes=3 scripts/slurm/ppo.sbatch configs/qwen2_5_7b_gsm8k.yaml")
    assert not bad("torchrun --nproc_per_node=2 train_ppo.py --config configs/demo_cpu.yaml")
    assert not bad("python scripts/make_offline_data.py --from-pairs data/p.parquet --out data/o.parquet")
    assert bad("python -m ppo_bench.no_such_benchmark")
    assert bad("python -m ppo_bench.kernels --no-such-flag")
    assert bad("torchrun --nproc_per_node=2 -m ppo_bench.sp --no-such-flag")
    assert not bad("torchrun --nproc_per_node=2 -m ppo_bench.sp --sp 2 --seq-len 16384")
    assert not bad("python -m ppo_bench.kernels --shapes 4096x256x32000 --json")
    # The defaults name no model and no data; validation files are named, or said to be none.
    run = "python train_ppo.py model.path=/m data.train_files=[/t.parquet]"
    assert bad("python train_ppo.py data.train_files=[/t.parquet]") == [
        "--print-config fails: config error: model.path is not set: give the policy's save_pretrained folder "
        "or hub id"
    ]
    assert check(Command("README.md", 1, shlex.split(run), ROOT)) == [
        "it names no data.val_files: name them, or say in its section that it has none"
    ]
    assert not check(Command("README.md", 1, shlex.split(run + " data.val_files=[]"), ROOT))
    assert not check(Command("README.md", 1, shlex.split(run + " data.val_files=[/v.parquet]"), ROOT))


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a page's headings (code blocks left out; a repeated heading gets -1, -2...)."""
    found, in_code = set(), False
    for line in path.read_text().splitlines():
        if line.strip().startswith("```"):
            in_code = not in_code
        elif not in_code and (m := re.match(r"#{1,6} (.+)", line)):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n, unique = 0, slug
            while unique in found:
                n += 1
                unique = f"{slug}-{n}"
            found.add(unique)
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_between_pages_resolve(page: Path):
    """Every relative link of a page names a file that exists, and an anchor that its page has."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(target)
    assert broken == [], f"{page.relative_to(ROOT)}: broken links {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_files_named_in_the_text_exist(page: Path):
    """A repository file a page names in its text (``tests/runs/test_stop.py::test_x``,
    ``configs/demo_cpu.yaml``) exists: files move, and the pages must follow."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    named = re.findall(
        r"(?<![\w./-])((?:configs|scripts|docs|ppo_kernels|ppo|tests)/[\w./-]+\.(?:py|yaml|md|sh|sbatch|png))",
        text,
    )
    missing = sorted({p for p in named if not (ROOT / p).exists()})
    assert missing == [], f"{page.relative_to(ROOT)} names files that do not exist: {missing}"
