"""The benchmarks, the package ``ppo_bench`` (its files in ``scripts/ppo_bench/``, installed with the project by
``make install``): each module measures one thing by driving the real code through its parameters, and runs
as ``python -m ppo_bench.<name>`` (``torchrun ... -m ppo_bench.<name>`` on
several ranks); ``--help`` says what it measures and how to read it, ``--json`` writes one object per row.

- ``kernels``: the log-prob paths (naive, from logits, fused, Liger), time and peak extra memory.
- ``rollout``: our ``generate`` on the FSDP2-sharded model against plain HF ``generate``.
- ``layout``: one PPO step's scoring and updates, packed against right-padded rows (``layout_padded``).
- ``sp``: Ulysses sequence parallelism's memory and outputs against one rank per sequence.
- ``overhead``: the trainer's fixed per-step CPU cost against TRL's PPOTrainer (``overhead_trl``).
- ``overhead_floor``: each phase of our step against the bare calls it consists of.
- ``scaling``: how a step's cost grows along one axis at a time (its ``turns`` axis in ``scaling_turns``).
- ``multi_turn``: a multi-turn preset's rollout, ``generate`` call by call.
- ``rewards``: the reward worker pool's throughput, and its timeouts and stops.
- ``checkpoint``: the stall of saving a checkpoint.
- ``stops``: how long user code that does not answer holds a run: a turn's stuck environment steps, and a
  SIGTERM while reward workers hang.
- ``compare_offline``: offline KL-PPO, DPO, offline SPPO and SimPO on one ranked file (its runs in
  ``compare_offline_runs``).
- ``distill``: on-policy distillation against GRPO from one SFT model: accuracy per step, per seed.
- ``recipes``: the reasoning-RL recipes ranked on the four-digit task, several seeds, one table and figure
  (``sabotage``: a recipe broken on purpose, run beside them to show the ranking sees it).

The shared harness: ``common`` (models, options, clocks, memory, output; torch), ``shapes`` (the random
models' architectures) and ``runs`` (a trainer run in its own process, its metrics and step clocks, fits and
figures; no torch).
"""
