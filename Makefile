# Two entry points for a fresh machine: `make up` starts a pool here, `make test` runs the tests.
PYTHON ?= python3
# Simulated devices unless this machine has NVIDIA GPUs (then NVML finds the real ones).
SIMULATE ?= $(shell command -v nvidia-smi >/dev/null 2>&1 || echo 2xA100-80GB,1xT4-16GB)

.PHONY: setup up test test-fast lint report

setup:
	$(PYTHON) -m pip install -q -e '.[dev]'

up: setup
	cpool up $(if $(SIMULATE),--simulate $(SIMULATE))

test: setup
	$(PYTHON) -m pytest -q

test-fast: setup
	$(PYTHON) -m pytest -q -m 'not slow'

# The same three checks as CI (.ci/run): lint, formatting, types of the control plane.
lint:
	ruff check src tests
	ruff format --check src tests
	$(PYTHON) -m mypy

report:
	cpool sim report --out report
