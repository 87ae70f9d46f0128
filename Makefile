# Two commands: `make demo` and `make test`. Both start with `make install`.
PY := .venv/bin/python
# Where no CUDA is present, torch's CPU build is installed. Set TORCH_INDEX to a CPU wheel index
# (e.g. --index-url https://download.pytorch.org/whl/cpu) on machines whose pip would pick a CUDA build.
TORCH_VERSION := 2.13.0
TORCH_INDEX ?=
NPROC ?= 2

.PHONY: install assets demo test lint format clean

install: .venv/.installed

.venv/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	@if $(PY) -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then \
		echo "keeping the installed CUDA build of torch"; \
	elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PY) -m pip install torch==$(TORCH_VERSION); \
	else \
		$(PY) -m pip install torch==$(TORCH_VERSION) $(TORCH_INDEX); \
	fi
	$(PY) -m pip install -e '.[dev]'
	touch $@

assets: install
	$(PY) scripts/make_tiny_assets.py --out assets --seed 0

demo: assets

test: install
	$(PY) -m pytest -q

lint: install
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

format: install
	.venv/bin/ruff format .
	.venv/bin/ruff check --fix .

clean:
	rm -rf .venv assets outputs
