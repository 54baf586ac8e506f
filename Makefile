# Two entry points for a fresh machine: `make setup` and `make test`.
PYTHON ?= python3

.PHONY: setup test test-fast lint report

setup:
	$(PYTHON) -m pip install -e '.[dev]'

test:
	$(PYTHON) -m pytest -q

test-fast:
	$(PYTHON) -m pytest -q -m 'not slow'

lint:
	ruff check src tests

report:
	cpool sim report --out report
