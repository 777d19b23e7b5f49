# The two set-up commands of the README: `make demo` and `make test`.
# Both create .venv with the system python3 and install what they need into it.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint typecheck bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.core: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(VENV)/.dev: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@ $(VENV)/.core

demo: $(VENV)/.core
	$(BIN)/tokenline demo

lint: $(VENV)/.dev
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

typecheck: $(VENV)/.dev
	$(BIN)/mypy --strict src

# Two test processes: most of the suite's time is spent waiting on worker processes,
# servers and timers, not on a core; each test uses a store, schema or key prefix of its
# own. Two, not one per core: the drill's liveness bounds hold on a loaded 2-core machine.
test: lint typecheck
	$(BIN)/pytest -n 2 --dist worksteal

bench: $(VENV)/.dev
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
