# Quick start: `make demo` and `make test` work on a fresh machine with Python 3.11 and make.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint install clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "vitlab needs Python 3.11 or newer: set PYTHON=...")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e '.[dev]'
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
	$(BIN)/python -m pytest -q --durations=15

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache
