"""The project's top-level import names are its own: no installed distribution and no common companion
of a PPO trainer ships a module of the same name.

Two distributions that ship one import name shadow each other in every process: which one wins depends
on the working directory and ``sys.path``. transformers 5.25 requires Hugging Face's ``kernels``, whose
import name was this project's kernel package's until it became ``ppo_kernels``; with both installed,
``import transformers`` failed from the repository root and ``scripts/`` imported the other one.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import pkgutil
import tomllib

from tests.helpers import ROOT, load_script

COMPANION_IMPORT_NAMES = {
    "accelerate",
    "deepspeed",
    "flash_attn",
    "kernels",  # Hugging Face's hub kernels, a requirement of transformers >= 5.25
    "liger_kernel",
    "megatron",
    "openrlhf",
    "peft",
    "sglang",
    "trl",
    "verl",
    "vllm",
}
"""Import names of packages that are often installed beside a PPO trainer (or required by one of its
dependencies), whether or not this machine has them."""


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def project_metadata() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def package_folders() -> set[str]:
    """The package folders at the repository root (the tests' own left out)."""
    return {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file() and p.name != "tests"}


def our_import_names() -> set[str]:
    """The packages pyproject.toml installs, and any package folder at the repository root (a new
    package counts before it is added to pyproject.toml)."""
    listed = set(project_metadata()["tool"]["setuptools"]["packages"])
    return {name.split(".")[0] for name in listed} | package_folders()


def test_the_package_folders_are_the_installed_packages() -> None:
    """Every package is installed: the root's folders, and the benchmarks from ``scripts/ppo_bench``
    (the package-dir of pyproject.toml; ``scripts`` itself is no package: verl ships one of that name)."""
    setuptools = project_metadata()["tool"]["setuptools"]
    assert package_folders() == {"ppo", "ppo_kernels"}
    assert set(setuptools["packages"]) == {"ppo", "ppo_kernels", "ppo_bench"}
    assert setuptools["package-dir"] == {"ppo_bench": "scripts/ppo_bench"}
    assert (ROOT / "scripts" / "ppo_bench" / "__init__.py").is_file()
    assert not (ROOT / "scripts" / "__init__.py").exists()


def test_no_installed_distribution_ships_our_import_names() -> None:
    own = _canonical(project_metadata()["project"]["name"])
    shipped = importlib.metadata.packages_distributions()
    clashes = {
        name: others
        for name in sorted(our_import_names())
        if (others := sorted({d for d in shipped.get(name, []) if _canonical(d) != own}))
    }
    assert not clashes, f"import names of ours that installed distributions also ship: {clashes}"


def test_no_common_companion_ships_our_import_names() -> None:
    assert not our_import_names() & COMPANION_IMPORT_NAMES


def test_every_module_imports() -> None:
    """Every module of the packages (the benchmarks of ``ppo_bench`` included), the entry point and
    every script imports with the installed releases, the scripts also as the files they run as (CI's
    release lanes run this first: an upstream release that removed a name we import fails here, naming
    the module)."""
    importers = {
        info.name: functools.partial(importlib.import_module, info.name)
        for package in sorted(our_import_names())
        for info in pkgutil.walk_packages(importlib.import_module(package).__path__, prefix=f"{package}.")
    }
    importers["train_ppo"] = functools.partial(importlib.import_module, "train_ppo")
    for script in sorted((ROOT / "scripts").glob("*.py")):
        importers[f"scripts/{script.name}"] = functools.partial(load_script, script.stem)
    failed = {}
    for name, load in importers.items():
        try:
            load()
        except Exception as e:  # noqa: BLE001 - every failure is named below
            failed[name] = f"{type(e).__name__}: {e}"
    assert not failed, "modules that do not import:\n" + "\n".join(f"{k}: {v}" for k, v in failed.items())
