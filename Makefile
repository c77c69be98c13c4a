# Two commands on a fresh machine: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEVICES := XLA_FLAGS=--xla_force_host_platform_device_count=8

.PHONY: demo test lint bench install clean docs

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Runtime install plus the `train` extra (progress bar, loss-curve PNG) the demo uses.
$(VENV)/.base: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e ".[train]"
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
	$(DEVICES) $(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --durations=30

lint: $(VENV)/.test
	$(BIN)/ruff check blox tests examples benchmarks
	$(BIN)/ruff format --check blox tests examples benchmarks

# Each script rewrites its own section of docs/benchmarks.md; a missing script is skipped.
BENCHES := core_overhead train_step layers_speed transformer_speed cnn_speed ckpt_speed data_speed parallel_speed pipeline_speed context_speed moe_speed ts_speed rl_speed

bench: $(VENV)/.test
	for b in $(BENCHES); do \
	  if [ -f benchmarks/$$b.py ]; then $(BIN)/python benchmarks/$$b.py --out docs/benchmarks.md || exit 1; fi; \
	done

# The documentation site (mkdocs.yml) into site/: offline, and strict (any warning, a
# broken link or a docstring mkdocstrings cannot parse, fails the build).
$(VENV)/.docs: pyproject.toml $(VENV)/.base
	$(BIN)/pip install -q -e ".[docs]"
	touch $@

docs: $(VENV)/.docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis site
