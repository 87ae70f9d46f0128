"""What the benchmarks share about the trainer's runs, without torch: train_ppo's command line for a short
run, torchrun's command and the environment of a run in its own process, the run's ``metrics.jsonl``, the
clocks of its steps (in the trainer's process: a logging handler on its step lines; from outside: the CPU
clocks of its process tree, read as each step's line appears), and what the numbers become: power-law fits
and figures. Not a benchmark itself; common.py holds the half that needs torch.

Nothing here imports torch, so a benchmark that only starts runs (compare_offline.py) answers ``--help`` and
refuses bad input at once: importing common.py (torch, transformers, ppo) takes seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import yaml

ROOT = Path(__file__).resolve().parents[2]


def repo_script(name: str) -> Any:
    """A plain script of ``scripts/`` (run as a file, not a module of this package), loaded by its path:
    ``repo_script("make_tiny_assets")``."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


"""The repository root: where runs start (``cwd``) and what they import first."""

# ----------------------------------------------------------------------------------------------------
# A run in its own process
# ----------------------------------------------------------------------------------------------------


def torchrun_command(nproc: int) -> list[str]:
    """torchrun of this interpreter on one machine, ``nproc`` ranks; the script and its arguments follow."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def run_env(threads: int) -> dict[str, str]:
    """This process's environment for a run started from the repository root: ``threads`` OpenMP threads a
    process (a rank under torchrun), the repository first on ``PYTHONPATH``."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": path}


def run_overrides(
    *, model: Path, prompts: Path, out_dir: Path, steps: int, seed: int, logger: str, settings: list[str]
) -> list[str]:
    """train_ppo's command line for a benchmark's run of ``steps`` steps: the policy ``model`` (also the
    critic's backbone), the prompt file ``prompts`` and no validation set, the benchmark's own
    ``settings`` (sizes, algorithm), then the run's bookkeeping: ``logger`` (``[jsonl]``,
    ``[console,jsonl]``), no validation before training, no resume, no checkpoint, ``seed``, ``out_dir``."""
    return [
        f"model.path={model}",
        f"data.train_files=[{prompts}]",
        "data.val_files=[]",
        *settings,
        f"trainer.total_training_steps={steps}",
        f"trainer.logger={logger}",
        "trainer.val_before_train=false",
        "trainer.resume_mode=disable",
        "trainer.save_freq=-1",
        f"trainer.seed={seed}",
        f"trainer.output_dir={out_dir}",
    ]


def read_metrics(out_dir: Path) -> list[dict[str, Any]]:
    """The lines of a run's ``out_dir/metrics.jsonl``, one dict per logged step."""
    text = (out_dir / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


# ----------------------------------------------------------------------------------------------------
# The clocks of a run's steps
# ----------------------------------------------------------------------------------------------------

STEP_LINE = re.compile(r"\bstep (\d+)/(\d+)\b")
"""The trainer's per-step console line (``MetricsLogger``'s progress prefix)."""


class StepClock(logging.Handler):
    """Records the CPU and wall clocks at each of the trainer's step lines (logging's public API), for a
    run in this process (``train_ppo.main``): add it to the ``ppo`` logger."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.marks: list[tuple[int, float, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        match = STEP_LINE.search(record.getMessage())
        if match:
            self.marks.append((int(match.group(1)), time.process_time(), time.perf_counter()))

    def step_times(self, skip: int = 2) -> tuple[list[float], list[float]]:
        """(CPU, wall) seconds of each step after the first ``skip``."""
        pairs = zip(self.marks, self.marks[1:], strict=False)
        kept = [(b[1] - a[1], b[2] - a[2]) for a, b in pairs if b[0] > skip]
        return [c for c, _ in kept], [w for _, w in kept]


@dataclasses.dataclass
class StepEnd:
    """When one step's line appeared in a process's ``metrics.jsonl``, and the CPU clocks of the process
    (with its children: a torchrun agent's ranks) at that moment."""

    wall_s: float
    """``time.perf_counter()``."""
    cpu_s: float | None
    """Seconds its threads have run on a core (``process_clocks``; None off Linux)."""
    wait_s: float | None
    """The machine's seconds so far during which some runnable task waited for a core."""
    lines: int
    """How many new lines this poll found (more than one: the steps' clocks cannot be told apart)."""


def process_clocks(pid: int) -> tuple[float, float] | tuple[None, None]:
    """(on-core seconds of ``pid``'s threads and of every process below it, from each thread's
    ``se.sum_exec_runtime`` in ``/proc/<pid>/task/<tid>/sched``; the machine's seconds during which some
    runnable task waited for a core, ``/proc/pressure/cpu``'s ``some total``), or (None, None) where the
    files are missing (not Linux, or the process is gone)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (name)": state, ppid, ...
        except (OSError, IndexError):
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    pids, cpu_ms, seen = [pid], 0.0, False
    while pids:
        current = pids.pop()
        pids += parents.get(current, [])
        tasks = Path(f"/proc/{current}/task")
        try:
            tids = [t.name for t in tasks.iterdir()]
        except OSError:
            continue
        for tid in tids:
            try:
                text = (tasks / tid / "sched").read_text()
            except OSError:
                continue  # a thread that ended between the listing and the read
            for line in text.splitlines():
                if line.startswith("se.sum_exec_runtime"):
                    cpu_ms, seen = cpu_ms + float(line.split(":")[1]), True
    try:
        pressure = Path("/proc/pressure/cpu").read_text().split("\n")[0]
        waited_us = int(pressure.rsplit("total=", 1)[1])
    except (OSError, IndexError, ValueError):
        return None, None
    return (cpu_ms / 1e3, waited_us / 1e6) if seen else (None, None)


def watch_step_ends(
    procs: list[subprocess.Popen], files: list[Path], poll_s: float = 0.01
) -> list[list[StepEnd]]:
    """Until every process has exited: for each process, each step's end as seen by polling its
    ``metrics.jsonl`` every ``poll_s`` (the trainer writes and flushes a line at the end of a step), with
    the process tree's CPU clocks read then (``process_clocks``; only when a line appeared, so the
    polling itself costs next to nothing)."""
    ends: list[list[StepEnd]] = [[] for _ in files]
    sizes = [0 for _ in files]

    def poll() -> None:
        for i, (proc, path) in enumerate(zip(procs, files, strict=True)):
            try:
                size = path.stat().st_size
            except OSError:
                continue
            if size == sizes[i]:
                continue
            sizes[i] = size
            lines = path.read_text().count("\n")
            new = lines - sum(e.lines for e in ends[i])
            if new > 0:
                cpu, wait = process_clocks(proc.pid)
                ends[i].append(StepEnd(time.perf_counter(), cpu, wait, new))

    while any(p.poll() is None for p in procs):
        poll()
        time.sleep(poll_s)
    poll()
    return ends


def step_clocks(ends: list[StepEnd]) -> dict[int, tuple[float, float]]:
    """Step number -> (CPU seconds of the process tree, the machine's waiting seconds) during that step, for the steps
    whose start and end were both seen on their own (a poll that found one new line after one that
    did); the first step's start is not seen."""
    out = {}
    step = 0
    for prev, end in zip([None, *ends], ends, strict=False):
        step += end.lines
        ok = prev is not None and end.lines == 1 and end.cpu_s is not None and prev.cpu_s is not None
        if ok:
            out[step] = (end.cpu_s - prev.cpu_s, end.wait_s - prev.wait_s)
    return out


def overlapping_steps(ends: list[list[float]]) -> list[set[int]]:
    """Per process, the steps (1-based) that ran while every other process was training: step ``s`` runs
    from step ``s - 1``'s end to its own (step 1 is never kept: its start is not seen), and is kept when
    that lies between every other process's first and last step ends. ``ends``: per process, the wall
    time of each step's end, in order."""
    kept = []
    for i, mine in enumerate(ends):
        others = [e for j, e in enumerate(ends) if j != i]
        lo = max((e[0] for e in others), default=-math.inf)
        hi = min((e[-1] for e in others), default=math.inf)
        kept.append({s + 1 for s in range(1, len(mine)) if mine[s - 1] >= lo and mine[s] <= hi})
    return kept


# ----------------------------------------------------------------------------------------------------
# A run's command and its numbers, from its metrics.jsonl rows
# ----------------------------------------------------------------------------------------------------

EPS = 1e-9
"""Accuracies are counts over the prompts; a sum like 0.768 + 0.15 must not miss 0.918 by a rounding."""
SKIP_STEPS = 1
"""Steps left out of the time means (the first warms up)."""


class InputError(ValueError):
    """Bad input found before any training: one line, exit code 2."""


class CommandError(RuntimeError):
    """A run failed: its command and the last lines of its log, exit code 1."""


def yaml_value(value: Any) -> str:
    """A config value as an override writes it (YAML: ``true``, ``0.05``, ``low_var_kl``)."""
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n...").strip()


def check_command(
    args: list[str], nproc: int, script: str = "train_ppo.py", *, files_later: bool = False
) -> None:
    """InputError (the trainer's message on one line) when ``script`` refuses ``args`` for ``nproc`` ranks: an
    unknown ``--extra`` key, a batch that does not divide. Nothing is written. ``files_later``: data files
    that the comparison writes before the run may be missing now."""
    cmd = [sys.executable, str(ROOT / script), *args, "--print-config", "--world-size", str(nproc)]
    proc = subprocess.run(
        cmd + (["--allow-missing-paths"] if files_later else []), capture_output=True, text=True, cwd=ROOT
    )
    if proc.returncode != 0:
        lines = [line.strip() for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
        raise InputError(
            f"{Path(script).name} refuses the command: {' '.join(lines[-6:]) or f'exit code {proc.returncode}'}"
        )


def accuracy_key(rows: list[dict[str, Any]]) -> str | None:
    """The greedy validation accuracy's key in a run's rows: ``val/greedy_accuracy`` (sampled validation
    renames the greedy pass), else ``val/accuracy``, else ``val/score`` (no rule); None without validation."""
    for key in ("val/greedy_accuracy", "val/accuracy", "val/score"):
        if any(key in r for r in rows):
            return key
    return None


def accuracy_curve(rows: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(step, greedy validation accuracy) of every validated step, in step order (step 0: before training)."""
    key = accuracy_key(rows)
    if key is None:
        return []
    return sorted((int(r["step"]), float(r[key])) for r in rows if key in r)


def steps_to_gain(curve: list[tuple[int, float]], gain: float) -> int | None:
    """The first validated step whose accuracy is at least the start's (the first point) plus ``gain``;
    None if none is."""
    if not curve:
        return None
    start = curve[0][1]
    return next((step for step, acc in curve[1:] if acc >= start + gain - EPS), None)


def drop_after_peak(curve: list[tuple[int, float]]) -> float:
    """The peak accuracy minus the lowest validated after it (from its first occurrence on; 0 when nothing
    after it is lower)."""
    if not curve:
        return 0.0
    values = [acc for _, acc in curve]
    first_peak = values.index(max(values))
    return max(values) - min(values[first_peak:])


def mean_after_warmup(rows: list[dict[str, Any]], key: str) -> float | None:
    """The mean of ``key`` over the training steps after the first ``SKIP_STEPS`` (all of them when the
    run is shorter); None where the run never logs it."""
    timed = [r for r in rows if key in r and "timing_s/step" in r]
    kept = [r for r in timed if r["step"] > SKIP_STEPS] or timed
    return statistics.fmean(r[key] for r in kept) if kept else None


def train_step_s(rows: list[dict[str, Any]]) -> float | None:
    """Mean seconds of a training step without its validation (``timing_s/step - timing_s/testing``),
    over the steps after the first ``SKIP_STEPS``."""
    steps = [r for r in rows if "timing_s/step" in r]
    kept = [r for r in steps if r["step"] > SKIP_STEPS] or steps
    if not kept:
        return None
    return statistics.fmean(r["timing_s/step"] - r.get("timing_s/testing", 0.0) for r in kept)


# ----------------------------------------------------------------------------------------------------
# A comparison over asset sets: its options, its folder, its runs one after the other
# ----------------------------------------------------------------------------------------------------


def comparison_parser(module: str, doc: str, *, out: str, test_freq: int) -> argparse.ArgumentParser:
    """The command line of a comparison that trains runs on asset sets (``make assets SEED=N ASSETS=DIR``),
    ``python -m ppo_bench.<module>`` with ``doc`` as its help: ``--assets`` (repeat), ``--seeds``,
    ``--steps``, ``--test-freq``, ``--nproc``, ``--out``, ``--overwrite``, ``--json``, ``--plot``; ``out`` and
    ``test_freq`` are the defaults. The module adds its own options."""
    p = argparse.ArgumentParser(
        prog=f"python -m ppo_bench.{module}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--assets",
        action="append",
        default=None,
        metavar="DIR",
        help="an asset set (repeat; default: assets)",
    )
    p.add_argument(
        "--seeds", type=int, nargs="+", default=None, help="trainer.seed per asset set (default 0, 1, ...)"
    )
    p.add_argument("--steps", type=int, default=50, help="training steps of every run")
    p.add_argument("--test-freq", type=int, default=test_freq, help="validate every this many steps")
    p.add_argument("--nproc", type=int, default=2, help="ranks of every torchrun")
    p.add_argument("--out", default=out, help="the comparison's folder")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier comparison in --out")
    p.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    p.add_argument("--plot", default=None, help="the figure's path (default OUT/curves.png)")
    return p


def parse_names(option: str, text: str, choices: Any, what: str) -> list[str]:
    """A comma-separated list of names (``--methods``, ``--recipes``) in the order given; InputError on an
    empty list, or a name not in ``choices`` or given twice (``what``: the singular, for the message)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in choices]
    if unknown or not names:
        raise InputError(
            f"{option} {text!r}: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(choices)}"
        )
    if len(set(names)) != len(names):
        raise InputError(f"{option} {text!r}: a {what} named twice")
    return names


def asset_sets(args: argparse.Namespace) -> tuple[list[Path], list[int]]:
    """``--assets`` (default ``assets``) and their seeds (default 0, 1, ...), with ``--steps``,
    ``--test-freq`` and ``--nproc`` checked; InputError with one line."""
    assets = [Path(a) for a in (args.assets or ["assets"])]
    seeds = list(range(len(assets))) if args.seeds is None else args.seeds
    if len(seeds) != len(assets):
        raise InputError(
            f"--assets given {len(assets)} time(s) but --seeds has {len(seeds)} value(s): one seed per asset set"
        )
    if len(set(seeds)) != len(seeds):
        raise InputError(f"--seeds {' '.join(map(str, seeds))}: each seed once (its runs go to OUT/seed<N>)")
    for option in ("--steps", "--test-freq", "--nproc"):  # those of the comparison's options it has
        value = getattr(args, option[2:].replace("-", "_"), 1)
        if value < 1:
            raise InputError(f"{option} {value}: at least 1")
    return assets, seeds


def earlier_outputs(out: Path, outputs: tuple[str, ...]) -> list[Path]:
    """What an earlier comparison left in ``out``: the files and folders ``outputs`` and ``seed*`` folders."""
    if not out.is_dir():
        return []
    return [out / n for n in outputs if (out / n).exists()] + sorted(
        p for p in out.glob("seed*") if p.is_dir()
    )


def check_out(out: Path, outputs: tuple[str, ...], overwrite: bool) -> None:
    """InputError when ``out`` is a file, or holds an earlier comparison and ``overwrite`` is not given."""
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file")
    earlier = earlier_outputs(out, outputs)
    if earlier and not overwrite:
        raise InputError(
            f"--out {out} holds an earlier comparison ({', '.join(p.name for p in earlier)}): pass --overwrite "
            f"to replace it, or choose another --out"
        )


def clear_out(out: Path, outputs: tuple[str, ...]) -> None:
    """Delete an earlier comparison's ``outputs`` and ``seed*`` folders from ``out`` (nothing else), then make
    sure ``out`` exists."""
    for path in earlier_outputs(out, outputs):
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    out.mkdir(parents=True, exist_ok=True)


def train_in_turn(
    runs: list[dict[str, Any]],
    *,
    steps: int,
    name: str,
    numbers: Callable[[list[dict[str, Any]]], dict[str, Any]],
    run_logged: Callable[[list[str], Path], float],
    progress: TextIO,
) -> None:
    """Train ``runs`` one after the other (they share the machine's cores): each run's ``command`` with
    ``run_logged`` (its log in ``dir/train.log``), then its ``wall_s`` and ``numbers(metrics rows)`` join the
    run's dict and its ``train_args`` leave it. A progress line a run names its seed and ``run[name]``.
    CommandError when a run logged other than ``steps`` steps (``numbers``' ``steps``) or no validation at
    step 0 (its ``curve``)."""
    for i, run in enumerate(runs, 1):
        run_dir = Path(run["dir"])
        run_dir.mkdir(parents=True)
        print(
            f"[{i}/{len(runs)}] seed {run['seed']} {run[name]} ({steps} steps) ...",
            end=" ",
            file=progress,
            flush=True,
        )
        run["wall_s"] = run_logged(run["command"], run_dir / "train.log")
        rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
        run.update(numbers(rows))
        if run["steps"] != steps or not run["curve"] or run["curve"][0][0] != 0:
            raise CommandError(
                f"seed {run['seed']} {run[name]} logged {run['steps']} of {steps} steps or no validation "
                f"before training; see {run_dir / 'train.log'}"
            )
        print(
            f"{run['wall_s']:.0f} s, accuracy {run['start']:.3f} -> {run['final']:.3f}",
            file=progress,
            flush=True,
        )
        del run["train_args"]


def reuse_earlier(
    runs: list[dict[str, Any]],
    earlier: Path,
    numbers: Callable[[list[dict[str, Any]]], dict[str, Any]],
    name: str = "entry",
) -> list[dict[str, Any]]:
    """Copy into each run's folder what the comparison in ``earlier`` (its ``results.json``) trained for the
    same seed and ``run[name]`` with the same command (its folder's path aside), where that run's
    ``metrics.jsonl`` is still there: that file and ``train.log``; the run gets the earlier wall time,
    ``numbers(metrics rows)`` and ``reused_from``, and loses ``train_args``. Returns the runs left to train."""
    before = {(r["seed"], r[name]): r for r in json.loads((earlier / "results.json").read_text())["runs"]}
    left = []
    for run in runs:
        old = before.get((run["seed"], run[name]))
        same = (
            old is not None and [a.replace(old["dir"], run["dir"]) for a in old["command"]] == run["command"]
        )
        if not same or not (Path(old["dir"]) / "metrics.jsonl").is_file():
            left.append(run)
            continue
        run_dir = Path(run["dir"])
        run_dir.mkdir(parents=True)
        for file in ("metrics.jsonl", "train.log"):
            if (Path(old["dir"]) / file).is_file():
                shutil.copy2(Path(old["dir"]) / file, run_dir / file)
        run.update(numbers(read_metrics(run_dir)), wall_s=old["wall_s"], reused_from=old["dir"])
        del run["train_args"]
    return left


def check_doc(path: Path, markers: tuple[str, str]) -> str:
    """``--doc``'s text; InputError when the file or one of its two ``markers`` lines is missing."""
    try:
        text = path.read_text()
    except OSError as e:
        raise InputError(f"--doc {path}: cannot read it ({e.strerror})") from None
    lines = text.splitlines()
    for marker in markers:
        if lines.count(marker) != 1:
            raise InputError(
                f"--doc {path}: needs the line {marker} exactly once (found {lines.count(marker)})"
            )
    if lines.index(markers[0]) > lines.index(markers[1]):
        raise InputError(f"--doc {path}: {markers[0]} must come before {markers[1]}")
    return text


def write_doc(doc: Path, section: str, markers: tuple[str, str]) -> None:
    """Replace the lines between the two ``markers`` lines of ``doc`` by ``section`` (nothing else changes)."""
    text = check_doc(doc, markers)
    head, rest = text.split(markers[0] + "\n", 1)
    _, tail = rest.split(markers[1], 1)
    doc.write_text(head + markers[0] + "\n" + section + markers[1] + tail)


def doc_link(path: Path, doc: Path) -> str:
    """How ``doc`` links the file at ``path``: relative to the doc's folder where it lies below it, else absolute."""
    try:
        return path.resolve().relative_to(doc.resolve().parent).as_posix()
    except ValueError:
        return path.resolve().as_posix()


def parquet_rows(path: Path) -> int | None:
    """Rows of a Parquet file (what one standard error of an accuracy is over); None where it cannot be read."""
    try:
        import pyarrow.parquet as pq

        return int(pq.read_metadata(path).num_rows)
    except (OSError, ImportError, ValueError):
        return None


def machine() -> str:
    """The CPU's model name and core count (``/proc/cpuinfo``), for a line that says where figures were measured."""
    try:
        names = [
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ]
    except OSError:
        names = []
    return f"{os.cpu_count()} cores" + (f" of {names[0]}" if names else "")


# ----------------------------------------------------------------------------------------------------
# Fits and figures
# ----------------------------------------------------------------------------------------------------


def fit_exponent(work: list[float], values: list[float]) -> tuple[float, float]:
    """``(k, c)`` of ``value = c * work^k``, least squares on ``log value = log c + k log work``.

    ``k = cov(log w, log v) / var(log w)``; needs two distinct positive ``work`` values and positive
    ``values``.
    """
    if len(work) != len(values) or len(set(work)) < 2:
        raise ValueError("fit_exponent needs two or more distinct work values, one value each")
    if min(work) <= 0 or min(values) <= 0:
        raise ValueError("fit_exponent needs positive work and values (a log-log fit)")
    lx = [math.log(w) for w in work]
    ly = [math.log(v) for v in values]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    k = sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / sum((a - mx) ** 2 for a in lx)
    return k, math.exp(my - k * mx)


def fit_line(work: list[float], values: list[float]) -> float:
    """The slope ``b`` of ``value = a + b * work`` (least squares)."""
    mx, my = statistics.fmean(work), statistics.fmean(values)
    return sum((a - mx) * (b - my) for a, b in zip(work, values, strict=True)) / sum(
        (a - mx) ** 2 for a in work
    )


def pyplot() -> Any:
    """matplotlib's ``pyplot`` on the Agg backend (files only, no display), imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> None:
    """``fig`` laid out tight and written to ``path`` (its folder made) at 120 dpi, then closed."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
