"""The import structure: modules import downward only, type-level imports (``if TYPE_CHECKING:``)
included, so the step's data types sit below everything that uses them and ``Run`` stays at the top."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The project modules ``path`` imports (``import a.b``, ``from a import b``, ``from a.b import c``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def module_graph() -> dict[str, set[str]]:
    """``{module: modules it imports}`` over ``ppo``, ``ppo_kernels`` and ``train_ppo``."""
    files = {"train_ppo": ROOT / "train_ppo.py"}
    for package in ("ppo", "ppo_kernels"):
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            files[name] = path
    names = set(files)
    return {name: imports_of(path, names) - {name} for name, path in files.items()}


def test_no_import_circle() -> None:
    graph = module_graph()
    # A package imports its own modules (ppo.algorithms re-exports its parts): not an upward arrow.
    graph = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = path[path.index(module) :] + [module]
            raise AssertionError(f"import circle: {' -> '.join(cycle)}")
        if module in done:
            return
        for dep in sorted(graph[module]):
            visit(dep, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_only_the_top_takes_run() -> None:
    """``Run`` (what a PPO run is made of) is imported by train_ppo and validation only."""
    takers = {m for m, deps in module_graph().items() if "ppo.build" in deps}
    assert takers == {"train_ppo", "ppo.periodic_validation"}


def test_the_math_is_pure_torch() -> None:
    """``ppo.algorithms`` imports nothing of the project but itself and ``ppo.choices``, the
    dependency-free lists of allowed names it shares with the config schema."""
    for module, deps in module_graph().items():
        if module.startswith("ppo.algorithms"):
            assert all(d.startswith("ppo.algorithms") or d == "ppo.choices" for d in deps), (module, deps)
    assert module_graph()["ppo.choices"] == set()


WORKER_IMPORTS = """\
import sys
import ppo.reward_worker
print(" ".join(sorted(m for m in sys.modules if m.split(".")[0] not in (*sys.stdlib_module_names, "__main__"))))
"""


def test_the_reward_worker_imports_only_the_standard_library() -> None:
    """A reward worker (``python -m ppo.reward_worker``) loads ``ppo.rule_scoring``, ``ppo.user_code``
    and the standard library, never torch or the trainer: it starts in a fraction of a second (``-S``: no
    site-packages). ``ppo.environments`` (what ``--print-config`` checks a multi-turn environment with)
    loads ``ppo.user_code`` alone."""
    for module, loaded in (
        ("ppo.reward_worker", ["ppo", "ppo.reward_worker", "ppo.rule_scoring", "ppo.user_code"]),
        ("ppo.environments", ["ppo", "ppo.environments", "ppo.user_code"]),
    ):
        out = subprocess.run(
            [sys.executable, "-S", "-c", WORKER_IMPORTS.replace("ppo.reward_worker", module)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == loaded


def test_tests_take_helpers_from_one_module() -> None:
    """Fixtures live in tests/conftest.py and shared helpers in tests/helpers.py: no test file imports
    ``tests.conftest`` (pytest loads it; importing it twice would build its session fixtures' module
    again), and every test file is in one of the two rooms."""
    tests = ROOT / "tests"
    importers = [
        str(path.relative_to(ROOT))
        for path in sorted(tests.rglob("*.py"))
        if "tests.conftest" in imports_of(path, {"tests.conftest"})
    ]
    assert importers == []
    assert sorted(p.name for p in tests.glob("test_*.py")) == [], (
        "a test file belongs in tests/unit or tests/runs"
    )
