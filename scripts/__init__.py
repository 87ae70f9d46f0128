"""The repository's scripts: data preparation and model tools (run as files, ``python scripts/X.py``), the
SFT, reward-model and DPO stages, Slurm wrappers, and the benchmarks (``scripts.bench``, run as modules from
the repository root: ``python -m scripts.bench.kernels``)."""
