"""One JSON line of the figures scripts/gpu_check.sh measured (the GPU tables of docs/performance.md).

Reads what gpu_check.sh wrote under its output folder; a stage that did not run (or failed) gives nulls,
so the line is always printed and always has the same keys:

- ``kernel_tests``: passed / failed / skipped counts from ``pytest.txt``.
- ``kernels``: from ``kernels.jsonl``, per ``TxHxV`` shape, ``ms`` and ``extra_gib`` of each path
  and mode (``fused_fwd+bwd_ms``, ``fused_fwd+bwd_gib``, ``from_logits_fwd_ms``, ...).
- ``rollout``: from ``rollout.jsonl`` (ppo_bench.rollout --compiled), ms per decoding step of plain HF
  generate and of the compiled rollout, their ratio, and the compiled path's greedy token match.
- ``ppo_<name>``: from ``ppo_<name>/metrics.jsonl``, the median over every step but the first (which
  compiles and warms up) of the step's time, its phases, MFU both ways, throughput and peak memory.
- ``prefix``: from ``prefix.jsonl`` (ppo_bench.prefix --json: the prompt once per group, off and on), per
  point and mode (``grpo_p1024_r32_g8/on``) the seconds of the rollout, scoring, updates and step and their
  speedups against off (``PREFIX_KEYS``), and ``checks``: each target's line -> true, false or null (not
  measured).

    python scripts/gpu_summary.py outputs/gpu_check
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

PPO_KEYS = {
    "step_s": "timing_s/step",
    "gen_s": "timing_s/gen",
    "old_log_prob_s": "timing_s/old_log_prob",
    "ref_s": "timing_s/ref",
    "values_s": "timing_s/values",
    "update_critic_s": "timing_s/update_critic",
    "update_actor_s": "timing_s/update_actor",
    "mfu_actor": "perf/mfu/actor",
    "mfu_actor_verl": "perf/mfu/actor_verl",
    "throughput": "perf/throughput",
    "max_memory_gib": "perf/max_memory_gib",
    "response_length": "response_length/mean",
}
"""Summary key -> metrics.jsonl key of a PPO run."""
PREFIX_KEYS = ("gen_s", "score_s", "update_s", "step_s", "gen_x", "score_x", "update_x", "step_x")
"""The figures of each ppo_bench.prefix row kept in the summary."""


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line.startswith("{"):
            rows.append(json.loads(line))
    return rows


def kernel_tests(out: Path) -> dict[str, int] | None:
    """Counts of pytest's last summary line (``3 passed, 1 skipped in 12.0s``)."""
    path = out / "pytest.txt"
    if not path.is_file():
        return None
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", path.read_text()):
        counts["errors" if word.startswith("error") else word] = int(n)
    return counts


def kernels(out: Path) -> dict[str, dict[str, float]]:
    """``{"TxHxV": {"<path>_<mode>_ms": ms, "<path>_<mode>_gib": extra GiB}}``."""
    found: dict[str, dict[str, float]] = {}
    for row in _jsonl(out / "kernels.jsonl"):
        shape = found.setdefault(f"{row['T']}x{row['H']}x{row['V']}", {})
        shape[f"{row['path']}_{row['mode']}_ms"] = row["ms"]
        shape[f"{row['path']}_{row['mode']}_gib"] = row["extra_gib"]
    return found


def rollout(out: Path) -> dict[str, float | None]:
    rows = {r["path"]: r for r in _jsonl(out / "rollout.jsonl")}
    hf, compiled = rows.get("hf_generate"), rows.get("ppo_compiled")
    return {
        "hf_decode_ms": hf["decode_ms"] if hf else None,
        "sharded_decode_ms": rows["ppo_rollout"]["decode_ms"] if "ppo_rollout" in rows else None,
        "compiled_decode_ms": compiled["decode_ms"] if compiled else None,
        "compiled_speedup": hf["time_s"] / compiled["time_s"] if hf and compiled else None,
        "compiled_match": compiled["match"] if compiled else None,
    }


def ppo_run(folder: Path) -> dict[str, float | int | None]:
    """Medians over the run's steps after the first (nulls where the run wrote nothing)."""
    steps = [r for r in _jsonl(folder / "metrics.jsonl") if "timing_s/step" in r]
    counted = steps[1:] or steps
    summary: dict[str, float | int | None] = {"steps": len(counted)}
    for name, key in PPO_KEYS.items():
        values = [r[key] for r in counted if r.get(key) is not None]
        summary[name] = statistics.median(values) if values else None
    return summary


def prefix(out: Path) -> dict[str, Any]:
    """``{"<estimator>_p<P>_r<R>_g<G>[_t<turns>]/<mode>": {PREFIX_KEYS}, "checks": {line: verdict}}``;
    empty where the stage did not run."""
    found: dict[str, Any] = {}
    for row in _jsonl(out / "prefix.jsonl"):
        if row.get("kind") == "point":
            turns = f"_t{row['turns']}" if row["turns"] else ""
            name = f"{row['estimator']}_p{row['prompt_len']}_r{row['response_len']}_g{row['n']}{turns}"
            found[f"{name}/{row['mode']}"] = {key: row.get(key) for key in PREFIX_KEYS}
        elif row.get("kind") == "check":
            found.setdefault("checks", {})[row["check"]] = row["pass"]
    return found


def summarize(out: Path) -> dict[str, Any]:
    device = (out / "device.txt").read_text().strip() if (out / "device.txt").is_file() else None
    summary: dict[str, Any] = {
        "device": device,
        "kernel_tests": kernel_tests(out),
        "kernels": kernels(out),
        "rollout": rollout(out),
        "prefix": prefix(out),
    }
    for folder in sorted(out.glob("ppo_*")):
        if folder.is_dir():
            summary[folder.name] = ppo_run(folder)
    return summary


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python scripts/gpu_summary.py OUT_FOLDER", file=sys.stderr)
        return 2
    print(json.dumps(summarize(Path(args[0])), sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
