# Two commands on a fresh machine: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEVICES := XLA_FLAGS=--xla_force_host_platform_device_count=8

.PHONY: demo test lint bench install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Runtime install (what a user gets from `pip install blox`).
$(VENV)/.base: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

# Test extras; PyTorch CPU is a test-only numerical reference.
$(VENV)/.test: pyproject.toml $(VENV)/.base
	$(BIN)/pip install -q -e ".[test]" "torch==2.13.0"
	touch $@

install: $(VENV)/.base

demo: $(VENV)/.base
	$(BIN)/python examples/mlp_regression.py

test: $(VENV)/.test
	$(BIN)/ruff check blox tests examples benchmarks
	$(DEVICES) $(BIN)/python -m pytest -q -p no:cacheprovider

lint: $(VENV)/.test
	$(BIN)/ruff check blox tests examples benchmarks
	$(BIN)/ruff format --check blox tests examples benchmarks

bench: $(VENV)/.test
	$(BIN)/python benchmarks/core_overhead.py --out docs/benchmarks.md

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
