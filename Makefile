# Two entry points for a fresh machine: `make up` starts a pool here, `make test` runs the tests.
#
# `make up` runs the pool from the project's own virtual environment, .venv/ in this directory: it
# is created the first time (python3 -m venv) with `pip install -e .` — what running needs, nothing
# else — and reused after that (made again only when pyproject.toml changes). Nothing is installed
# outside .venv/.
# `make test` and `make lint` use $(PYTHON): .venv's python once it exists, else the python3 on the
# PATH (CI installs '.[dev]' there first). They add the test tools ('.[dev]': pytest, hypothesis,
# ruff, mypy) to that python only when pytest is missing from it.
VENV ?= .venv
PYTHON ?= $(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/python,python3)
# Simulated devices unless this machine has NVIDIA GPUs (then NVML finds the real ones).
SIMULATE ?= $(shell command -v nvidia-smi >/dev/null 2>&1 || echo 2xA100-80GB,1xT4-16GB)

# The tests run in TEST_WORKERS processes (pytest-xdist), a test file per process at a time: most of
# them wait on servers, agents and jobs rather than compute. Each test file starts what it needs on
# ports, users and folders of its own, so files never meet.
TEST_WORKERS ?= 2
PYTEST = $(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25

.PHONY: setup up dev-tools test test-fast test-all-databases lint report

$(VENV)/.installed: pyproject.toml
	@test -x $(VENV)/bin/python || python3 -m venv $(VENV) || { \
	  echo "make: could not create $(VENV) (on Debian/Ubuntu: apt-get install python3-venv)" >&2; exit 1; }
	@echo "installing computepool and what it needs to run into $(VENV)/ (pip install -e .)"
	$(VENV)/bin/python -m pip install -q -e .
	@touch $@

setup: $(VENV)/.installed

up: setup
	$(VENV)/bin/cpool up $(if $(SIMULATE),--simulate $(SIMULATE)) $(ARGS)

dev-tools:
	@$(PYTHON) -c 'import pytest, xdist' >/dev/null 2>&1 || { \
	  echo "installing the test tools ('.[dev]') for $(PYTHON)"; $(PYTHON) -m pip install -q -e '.[dev]'; }

test: dev-tools
	$(PYTEST)

test-fast: dev-tools
	$(PYTEST) -m 'not slow'

# Every server test on SQLite and PostgreSQL (by default only the modules where the database matters
# run on both); on success it records the store's digest, so that CI runs the whole matrix only when
# src/computepool/store changed since.
test-all-databases: dev-tools
	CPOOL_TEST_ALL_DATABASES=1 $(PYTEST) tests/server
	scripts/store-digest.sh > .ci/store-digest

# The same three checks as CI (.ci/run): lint, formatting, types of the control plane.
lint: dev-tools
	$(PYTHON) -m ruff check src tests
	$(PYTHON) -m ruff format --check src tests
	$(PYTHON) -m mypy

report: setup
	$(VENV)/bin/cpool sim report --out report
