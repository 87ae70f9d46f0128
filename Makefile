# Two commands: `make demo` and `make test`. Both start with `make install`.
PY := .venv/bin/python
NPROC ?= 2

.PHONY: install lock assets demo test test-fast lint format clean

# make install: the virtualenv .venv with the exact versions of a lock in locks/ (hashes checked), then the
# project itself, editable. LOCK=auto takes locks/cuda.txt where nvidia-smi lists a GPU (torch from PyPI
# with its CUDA libraries) and locks/cpu.txt elsewhere (torch's CPU build, found through TORCH_CPU_LINKS);
# LOCK=none installs from pyproject.toml's ranges instead. The locks are for CPython 3.11 on Linux x86_64
# (PYTHON picks the interpreter that creates .venv); elsewhere install with LOCK=none.
PYTHON ?= python3
LOCK ?= auto
TORCH_CPU_LINKS ?= $(or $(PIP_FIND_LINKS),https://download.pytorch.org/whl/cpu/torch/)

install: .venv/.installed

.venv/.installed: pyproject.toml locks/cpu.txt locks/cuda.txt
	test -x $(PY) || $(PYTHON) -m venv .venv
	@lock='$(LOCK)'; \
	if [ "$$lock" = auto ]; then \
		if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then lock=locks/cuda.txt; \
		else lock=locks/cpu.txt; fi; \
	fi; \
	if [ "$$lock" = none ]; then \
		echo "$(PY) -m pip install -e '.[dev]'  (pyproject.toml's ranges, no lock)"; \
		$(PY) -m pip install -e '.[dev]' || exit 1; \
	else \
		where=$$($(PY) -c "import platform, sys; print('%d.%d-%s-%s' % (*sys.version_info[:2], sys.platform, platform.machine()))"); \
		if [ "$$where" != 3.11-linux-x86_64 ]; then \
			echo "make install: $$lock is for CPython 3.11 on Linux x86_64 and .venv is $$where: rm -r .venv and make install PYTHON=python3.11, or make install LOCK=none (pyproject.toml's ranges)" >&2; \
			exit 2; \
		fi; \
		links=; [ "$$lock" = locks/cpu.txt ] && links='--find-links $(TORCH_CPU_LINKS)'; \
		echo "$(PY) -m pip install --require-hashes $$links -r $$lock"; \
		$(PY) -m pip install --require-hashes $$links -r $$lock || exit 1; \
		$(PY) -m pip install --no-deps --no-build-isolation -e . || exit 1; \
	fi
	touch $@

# The locks from pyproject.toml's ranges and the torch build of locks/{cpu,cuda}.in, newest releases first
# (uv pip compile, with every file's hash), with the dev extra and the trackers whose tests `make test`
# runs (mlflow, swanlab, clearml: about 185 MB and 2.5 minutes of pip install). Commit them with the
# change that needs them; CI's newest lane tells when a newer release inside the ranges has come out and
# passes.
UV_COMPILE := .venv/bin/uv pip compile pyproject.toml --extra dev --extra mlflow --extra swanlab \
	--extra clearml --generate-hashes --python-version 3.11 \
	--python-platform x86_64-manylinux_2_28 --custom-compile-command 'make lock' --quiet
lock: install
	$(UV_COMPILE) locks/cpu.in --find-links $(TORCH_CPU_LINKS) -o locks/cpu.txt
	$(UV_COMPILE) locks/cuda.in -o locks/cuda.txt

# Tiny tokenizer, models and task; SFT on the flawed demonstrations (assets/sft, the PPO actor's start);
# the second task's SFT, four-digit sums (assets/carry4/sft, the start of configs/demo_cpu_carry4.yaml,
# about 4.5 minutes more) and its offline groups (assets/carry4/offline);
# the teacher of on-policy distillation, a larger tiny Llama (assets/base_teacher) SFT'd on the same
# problems with every answer right (assets/teacher; `make teacher` trains only it); that SFT model
# fine-tuned on demonstrations of which 40% call a calculator (assets/tools/sft, the start of
# configs/demo_cpu_tools.yaml); the reward model (assets/rm); offline groups for configs/demo_cpu_offline.yaml: 4 samples from
# the SFT model for each of the first 2048 training prompts, ranked by the rule (assets/offline). Final
# numbers go to assets/metrics.json. About 8 minutes on 2 cores (5m44s measured before the teacher, which
# adds 2.5; 14m30s and 17m35s measured for SEED=1 and 2 while other jobs shared the cores).
# SEED=1 builds another task split, initialization and data order (the presets' seed is 0);
# ASSETS=dir writes the whole set to another folder (run a preset on it with model.path=dir/sft etc.).
SEED ?= 0
ASSETS ?= assets
A := $(ASSETS)
SFT_PATHS := model.path=$(A)/base data.train_files=[$(A)/data/sft_train.parquet] \
	data.val_files=[$(A)/data/sft_val.parquet] data.eval_prompt_files=[$(A)/data/val.parquet] \
	trainer.output_dir=$(A)/runs/sft trainer.save_path=$(A)/sft trainer.seed=$(SEED)
RM_PATHS := model.path=$(A)/sft data.train_files=[$(A)/data/pref_train.parquet] \
	data.val_files=[$(A)/data/pref_val.parquet] trainer.output_dir=$(A)/runs/rm trainer.save_path=$(A)/rm \
	trainer.seed=$(SEED)
TEACHER_PATHS := model.path=$(A)/base_teacher data.train_files=[$(A)/data/teacher_sft_train.parquet] \
	data.val_files=[$(A)/data/teacher_sft_val.parquet] data.eval_prompt_files=[$(A)/data/val.parquet] \
	trainer.output_dir=$(A)/runs/teacher trainer.save_path=$(A)/teacher trainer.seed=$(SEED)
TRAIN_TEACHER := .venv/bin/torchrun --standalone --nproc_per_node=$(NPROC) scripts/train_sft.py \
	--config configs/sft_teacher_demo.yaml $(TEACHER_PATHS)
# The summary's lines that `make teacher` prints too (python; m: the metrics.json): how a stage that stopped
# before its planned steps is named, the teacher's numbers.
STOPPED_EARLY := early = lambda s: ('; STOPPED EARLY after %d of %d steps: resume it with trainer.resume_mode=auto' % (m[s + '_steps'], m[s + '_steps_planned'])) if m.get(s + '_stopped_early') else '';
TEACHER_LINE := print('teacher model $(A)/teacher: greedy accuracy %(teacher_val_accuracy).3f, one sample at T=1 %(teacher_sample_accuracy).3f, pass@%(teacher_eval_samples_per_prompt)d %(teacher_pass_at_k).3f (%(teacher_eval_prompts)d val problems; %(teacher_steps)d steps in %(teacher_train_time_s).0f s' % m + early('teacher') + ')');
CARRY4_PATHS := model.path=$(A)/base data.train_files=[$(A)/carry4/data/sft_train.parquet] \
	data.val_files=[$(A)/carry4/data/sft_val.parquet] data.eval_prompt_files=[$(A)/carry4/data/val.parquet] \
	trainer.output_dir=$(A)/carry4/runs/sft trainer.save_path=$(A)/carry4/sft trainer.seed=$(SEED)
TRAIN_CARRY4 := .venv/bin/torchrun --standalone --nproc_per_node=$(NPROC) scripts/train_sft.py \
	--config configs/sft_carry4_demo.yaml $(CARRY4_PATHS)
CARRY4_LINE := m = json.load(open('$(A)/carry4/metrics.json')); \
	print('four-digit SFT $(A)/carry4/sft: greedy accuracy %(sft_val_accuracy).3f, one sample at T=1 %(sft_sample_accuracy).3f, pass@%(sft_eval_samples_per_prompt)d %(sft_pass_at_k).3f (%(sft_steps)d steps in %(sft_train_time_s).0f s' % m + early('sft') + ')');
# The four-digit task's offline groups (assets/carry4/offline, as assets/offline for the two-digit task: 4
# samples of its SFT model for each of the first 2048 training prompts, ranked by the rule; about 30 s).
OFFLINE_CARRY4 := OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node=$(NPROC) \
	scripts/make_offline_data.py --model $(A)/carry4/sft --data $(A)/carry4/data/train.parquet \
	--out $(A)/carry4/offline/train.parquet --k 4 --max-prompts 2048 --shard-size 512 --max-prompt-length 16 \
	--max-response-length 32 --seed $(SEED) --metrics $(A)/carry4/metrics.json
OFFLINE_CARRY4_LINE := m = json.load(open('$(A)/carry4/metrics.json')); \
	print('four-digit offline data $(A)/carry4/offline: %(offline_groups)d groups of %(offline_group_size)d, mean rule score %(offline_mean_score).3f, %(offline_unequal_share).2f of groups with unequal scores (%(offline_time_s).0f s)' % m);
TOOLS_PATHS := model.path=$(A)/sft data.train_files=[$(A)/data/sft_tools_train.parquet] \
	data.val_files=[$(A)/data/sft_tools_val.parquet] trainer.output_dir=$(A)/tools/runs/sft \
	trainer.save_path=$(A)/tools/sft trainer.seed=$(SEED)

assets: install
	rm -rf $(A)/runs $(A)/metrics.json $(A)/offline $(A)/tools $(A)/carry4/runs $(A)/carry4/metrics.json \
		$(A)/carry4/offline
	$(PY) scripts/make_tiny_assets.py --out $(A) --seed $(SEED)
	.venv/bin/torchrun --standalone --nproc_per_node=$(NPROC) scripts/train_sft.py --config configs/sft_demo.yaml $(SFT_PATHS)
	$(TRAIN_TEACHER)
	$(TRAIN_CARRY4)
	.venv/bin/torchrun --standalone --nproc_per_node=$(NPROC) scripts/train_sft.py --config configs/sft_tools_demo.yaml $(TOOLS_PATHS)
	.venv/bin/torchrun --standalone --nproc_per_node=$(NPROC) scripts/train_reward_model.py --config configs/rm_demo.yaml $(RM_PATHS)
	OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node=$(NPROC) scripts/make_offline_data.py \
		--model $(A)/sft --data $(A)/data/train.parquet --out $(A)/offline/train.parquet --k 4 \
		--max-prompts 2048 --shard-size 512 --max-prompt-length 16 --max-response-length 28 --seed $(SEED) \
		--metrics $(A)/metrics.json
	$(OFFLINE_CARRY4)
	@$(PY) -c "import json; m = json.load(open('$(A)/metrics.json')); \
	$(STOPPED_EARLY) \
	print('SFT model    $(A)/sft: greedy accuracy %(sft_val_accuracy).3f, one sample at T=1 %(sft_sample_accuracy).3f, pass@%(sft_eval_samples_per_prompt)d %(sft_pass_at_k).3f (%(sft_eval_prompts)d val problems; %(sft_steps)d steps in %(sft_train_time_s).0f s' % m + early('sft') + ')'); \
	print('reward model $(A)/rm:  held-out accuracy %(rm_val_accuracy).3f, margin %(rm_val_margin).2f (%(rm_steps)d steps in %(rm_train_time_s).0f s' % m + early('rm') + ')'); \
	print('  by mistake: ' + ', '.join('%s %.3f' % kv for kv in m['rm_val_accuracy_by_mistake'].items())); \
	print('offline data $(A)/offline: %(offline_groups)d groups of %(offline_group_size)d from %(offline_prompts)d prompts, mean rule score %(offline_mean_score).3f, %(offline_unequal_share).2f of groups with unequal scores (%(offline_time_s).0f s)' % m); \
	$(TEACHER_LINE) \
	$(CARRY4_LINE) \
	$(OFFLINE_CARRY4_LINE) \
	print('all numbers: $(A)/metrics.json, $(A)/carry4/metrics.json')"

# Only the teacher of `make assets` (assets/base_teacher, its clean demonstrations, assets/teacher; its
# numbers join assets/metrics.json), for assets built before they had one: SEED must be the one they were
# built with, or the teacher trains on the student's validation problems. About 2.5 minutes on 2 cores.
.PHONY: teacher
teacher: install
	rm -rf $(A)/runs/teacher
	$(PY) scripts/make_tiny_assets.py --out $(A) --seed $(SEED) --teacher-only
	$(TRAIN_TEACHER)
	@$(PY) -c "import json; m = json.load(open('$(A)/metrics.json')); $(STOPPED_EARLY) $(TEACHER_LINE)"

# Only the second task of `make assets` (carry4/data, its SFT model assets/carry4/sft and its offline groups
# assets/carry4/offline), for assets built
# before they had it: SEED must be the one they were built with (the SFT starts from $(A)/base). About 4.5
# minutes on 2 cores.
.PHONY: carry4
carry4: install
	rm -rf $(A)/carry4/runs $(A)/carry4/metrics.json $(A)/carry4/offline
	$(PY) scripts/make_tiny_assets.py --out $(A) --seed $(SEED) --carry4-only
	$(TRAIN_CARRY4)
	$(OFFLINE_CARRY4)
	@$(PY) -c "import json; $(STOPPED_EARLY) $(CARRY4_LINE) $(OFFLINE_CARRY4_LINE)"

# PPO on the SFT model with the true reward (GAE, adaptive KL in the reward), then its curves. The assets
# are built only when they are missing (`make assets` rebuilds them); `make demo` reruns the PPO demo from
# step 0, `make demo-resume` continues a stopped one from its last checkpoint (or says it has finished).
.PHONY: demo-resume check-assets
DEMO_PPO := OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node=$(NPROC) train_ppo.py \
	--config configs/demo_cpu.yaml
check-assets: install
	@if test -d $(A)/sft -a -d $(A)/rm -a -d $(A)/teacher -a -d $(A)/carry4/sft -a -f $(A)/metrics.json; then \
		echo "using the assets in $(A) (\`make assets\` rebuilds them)"; \
	else $(MAKE) assets; fi

demo: check-assets
	$(DEMO_PPO) trainer.resume_mode=disable trainer.overwrite=true
	$(PY) scripts/plot_run.py outputs/demo_cpu

# GRPO on the second task, four-digit sums (docs/demo.md: it does not saturate in 100 steps), then its curves.
.PHONY: demo-carry4
demo-carry4: check-assets
	OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node=$(NPROC) train_ppo.py \
		--config configs/demo_cpu_carry4.yaml trainer.resume_mode=disable trainer.overwrite=true
	$(PY) scripts/plot_run.py outputs/demo_cpu_carry4

demo-resume: check-assets
	$(DEMO_PPO) trainer.resume_mode=auto
	$(PY) scripts/plot_run.py outputs/demo_cpu

# Offline KL-PPO, DPO and SimPO on the ranked file, from the same SFT model, the same number of steps,
# three strengths each; every final model's greedy accuracy and KL to the SFT model in one table and
# plot (outputs/compare_offline; scripts/ppo_bench/compare_offline.py; about 6 minutes on 2 cores). Uses the
# assets as they are (never rebuilds them); replaces an earlier comparison. COMPARE_ARGS: more
# options, e.g. COMPARE_ARGS="--methods dpo,simpo".
.PHONY: compare-offline
COMPARE_ARGS ?=
compare-offline: install
	@test -d $(A)/sft -a -f $(A)/offline/train.parquet || { \
		echo "compare-offline needs $(A)/sft and $(A)/offline/train.parquet: run \`make assets$(if $(filter-out assets,$(A)), ASSETS=$(A))\` first"; \
		exit 2; }
	$(PY) -m ppo_bench.compare_offline --sft $(A)/sft --train-file $(A)/offline/train.parquet \
		--val-file $(A)/data/val.parquet --nproc $(NPROC) --overwrite $(COMPARE_ARGS)

# Shared prompts and the kept rollout cache, on and off side by side by phase (scripts/ppo_bench/prefix.py:
# 2 ranks, the tiny shape, prompts 16-1,024, responses 32/256, G 1-16, the demo's shapes, multi-turn;
# about 28 minutes on 2 cores): the table in outputs/prefix/table.txt, the figure beside it.
.PHONY: bench-prefix
bench-prefix: install
	@mkdir -p outputs/prefix
	$(PY) -m ppo_bench.prefix --figure outputs/prefix/speedups.png | tee outputs/prefix/table.txt

# The whole suite, the parity tests against the released verl included (parity-env: a few seconds, once).
# Its two rooms run at once, a pytest process each (most tests keep one core busy, so on 2 cores the
# suite takes the longer room's time, not the sum); tests/runs' output follows tests/unit's, whole.
test: install parity-env trl-env
	@mkdir -p .pytest_cache; $(PY) -m pytest -q -o cache_dir=.pytest_cache/runs tests/runs > .pytest_cache/runs.log 2>&1 & runs=$$!; \
	trap 'kill $$runs 2>/dev/null' INT TERM; \
	$(PY) -m pytest -q -o cache_dir=.pytest_cache/unit tests/unit; unit=$$?; \
	wait $$runs; status=$$?; echo "== tests/runs"; cat .pytest_cache/runs.log; \
	test $$unit -eq 0 -a $$status -eq 0

# The math of ppo/algorithms against the released verl 0.9.1 (tests/unit/test_parity_verl.py; docs/coming_from_verl.md).
# verl's wheel goes into .verl091/ without its dependencies, with only the small packages that importing
# its core_algos and rollout_corr_helper needs (no ray, vllm or flash-attn); the tests put the folder on
# sys.path and skip without it. Built once (a few seconds), then the parity tests run in seconds.
VERL_SIDE := verl==0.9.1 tensordict==0.10.0 omegaconf==2.4.0 antlr4-python3-runtime==4.9.3 pyvers==0.2.3 \
	cloudpickle==3.1.3 codetiming==1.4.0 orjson==3.13.0
.PHONY: parity parity-env
parity-env: .verl091/.installed

.verl091/.installed: Makefile | install
	rm -rf .verl091
	$(PY) -m pip install -q --no-deps --target .verl091 $(VERL_SIDE)
	$(PY) -c 'import sys; print("%d.%d" % sys.version_info[:2])' > $@  # its compiled modules' Python

# TRL's shipped reward functions (trl.rewards: think_format_reward, get_soft_overlong_punishment,
# accuracy_reward with math-verify) go into .trl_side/ without TRL's dependencies (the project's cover what
# trl.rewards imports); tests/*/test_trl_rewards.py import them as a user's reward file does, and skip
# without the folder. A few seconds, once.
TRL_SIDE := trl==1.12.0 math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
.PHONY: trl-env
trl-env: .trl_side/.installed

.trl_side/.installed: Makefile | install
	rm -rf .trl_side
	$(PY) -m pip install -q --no-deps --target .trl_side $(TRL_SIDE)
	touch $@

parity: parity-env
	$(PY) -m pytest -q tests/unit/test_parity_verl.py

# The inner loop: everything but the tests marked slow (2-rank runs, end-to-end trainer runs).
test-fast: install
	$(PY) -m pytest -q -m "not slow"

# The fast in-process room only (tests/unit: math, config, data, kernels, parsing), slow ones left out.
.PHONY: test-unit
test-unit: install
	$(PY) -m pytest -q -m "not slow" tests/unit

# docs/configuration.md, the config reference, generated from the schema's field docstrings
# (scripts/config_reference.py; tests/unit/test_config_reference.py fails when it is stale).
.PHONY: docs
docs: install
	$(PY) scripts/config_reference.py

lint: install
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

format: install
	.venv/bin/ruff format .
	.venv/bin/ruff check --fix .

clean:
	rm -rf .venv .verl091 .trl_side assets outputs
