# Quick start: `make demo` and `make test` work on a fresh machine with Python 3.11 and make.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export NO_TESTS := make test: pytest collected no tests (exit 5): the suite is missing or broken

.PHONY: demo test lint install clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "vitlab needs Python 3.11 or newer: set PYTHON=...")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
# pip byte-compiles the ~16,500 installed .py files one after another (63 s of a 130 s install on
# 2 cores); compileall does it on every core (44 s). The .pyc files are needed: with
# PYTHONDONTWRITEBYTECODE set, imports would compile again in every process (12.7 -> 24 s for the
# suite's imports). torch ships one file in Python 3.12 syntax, left out; any other that fails is
# shown and the install goes on (the .pyc files are a cache).
	$(BIN)/python -m pip install --no-compile -e '.[dev]'
	$(BIN)/python -m compileall -q -j 0 -x 'py312_intrinsics\.py$$' $(VENV)/lib \
	  || echo "make: the files above did not compile; Python reads their source on import"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/vitlab models
	$(BIN)/vitlab cost B/16
	BIN=$(BIN) bash scripts/demo.sh

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

test: lint
# one worker a CPU, each taking whole files (module fixtures built once), longest first
# (tests/conftest.py); then the tests timed against the wall clock, alone
# (pytest's exit 5, no test collected, means the suite is missing or broken: said, and a failure)
	$(BIN)/python -m pytest -q -n logical --dist loadfile --no-loadscope-reorder -m 'not serial' \
	  --durations=15 || { rc=$$?; [ $$rc -ne 5 ] || echo "$$NO_TESTS" >&2; exit $$rc; }
	$(BIN)/python -m pytest -q -m serial || { rc=$$?; [ $$rc -ne 5 ] || echo "$$NO_TESTS" >&2; exit $$rc; }

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache
