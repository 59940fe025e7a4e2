# trainguard: everything a fresh clone needs, from nothing but Python 3.11+.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
PYTEST := $(BIN)/python -m pytest --durations=25

.PHONY: setup lock test test-fast test-e2e test-torch-matrix check-client-install lint up demo bench clean

setup: $(STAMP)

# Exactly the versions in requirements/dev.lock (torch: its CPU build), then the project itself
# without its dependencies: a fresh clone installs what CI passed with, whatever was released
# since. `make lock` refreshes the locks on purpose; review their diff like code.
LOCK := requirements/dev.lock
$(STAMP): pyproject.toml $(LOCK)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -r $(LOCK)
	$(BIN)/python -m pip install -q --no-deps -e .
	$(BIN)/python -m pip check
	touch $(STAMP)

# The locks: dev.lock for `make setup` and CI, services.lock and client.lock for the images
# (client.lock leaves torch out: the image installs the build its TORCH_INDEX serves), each
# moved to the newest releases the ranges allow (--upgrade). The
# library's own ranges in pyproject.toml stay open for users. A local wheel directory
# (PIP_FIND_LINKS) or the CPU index supplies torch's CPU build.
TORCH_SOURCE ?= $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS),--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match)
COMPILE = $(BIN)/uv pip compile pyproject.toml -q --upgrade --python-version 3.11 \
	--python-platform x86_64-manylinux_2_28 -c requirements/constraints.txt $(TORCH_SOURCE)

lock: setup
	$(COMPILE) --extra dev --extra torch --extra gpu --extra services --extra embedded -o requirements/dev.lock
	$(COMPILE) --extra services -o requirements/services.lock
	$(COMPILE) --extra torch --extra gpu --extra agent --no-emit-package torch -o requirements/client.lock

lint: setup
	$(BIN)/ruff check libs tests bench scripts
	$(BIN)/mypy libs/trainguard
	$(BIN)/lint-imports

test-fast: setup
	$(PYTEST) tests/unit tests/integration

test-e2e: setup
	$(PYTEST) tests/e2e

# What CI runs: lint, then every tier (unit, integration, end-to-end gloo jobs).
test: lint
	$(PYTEST) tests

# The end-to-end tier on the other of the two newest torch releases that install here:
# .venv has 2.13.0 (CPU); this builds .venv-torch-2.14.1 (a CUDA build, ~5.5 GB) once and
# runs tests/e2e there. Not part of `make test` (CI time). TORCH_MATRIX=X.Y.Z picks another
# release, TORCH_MATRIX_TESTS a narrower set of test files.
TORCH_MATRIX       ?= 2.14.1
TORCH_MATRIX_TESTS ?= tests/e2e
MATRIX_VENV        := .venv-torch-$(TORCH_MATRIX)

test-torch-matrix:
	test -x $(MATRIX_VENV)/bin/python || $(PYTHON) -m venv $(MATRIX_VENV)
	$(MATRIX_VENV)/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$(TORCH_MATRIX)')" 2>/dev/null \
		|| $(MATRIX_VENV)/bin/python -m pip install -q "torch==$(TORCH_MATRIX)"
	$(MATRIX_VENV)/bin/python -m pip install -q -e ".[dev,torch,gpu,services,embedded]"
	$(MATRIX_VENV)/bin/python -c "import torch; print('torch', torch.__version__)"
	$(MATRIX_VENV)/bin/python -m pytest --durations=25 $(TORCH_MATRIX_TESTS)

# A fresh venv with only the base (client) requirements runs a Guard against a real
# nats-server, and the control plane's commands name the extra they lack.
check-client-install: setup
	$(BIN)/python scripts/check_client_install.py

bench: setup
	$(BIN)/python bench/run_all.py

up: setup
	$(BIN)/trainguard up

demo: setup
	$(BIN)/trainguard demo

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .trainguard
