# Development tasks. `make demo`, `make example` and `make test` create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PLUGINS := $(wildcard plugins/*/pyproject.toml)

.PHONY: install demo example test lint bench-dispatch

$(STAMP): pyproject.toml $(PLUGINS)
	$(PYTHON) -m venv $(VENV)
	# torch 2.13.0 is pinned so pip takes the CPU wheel; triton runs its kernels on the CPU
	# under TRITON_INTERPRET=1 in the tests.
	$(BIN)/pip install --quiet torch==2.13.0 triton==3.6.0 pytest hypothesis==6.170.17 "numpy<2.4" ruff==0.17.6 "setuptools>=64"
	$(BIN)/pip install --quiet -e . $(foreach p,$(PLUGINS),-e $(dir $(p)))
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/megablocks backends list
	$(BIN)/megablocks demo

example: $(STAMP)
	$(BIN)/megablocks backends list
	$(BIN)/megablocks example

test: $(STAMP)
	# The conformance kit's full set on the reference backend, then the test suite.
	$(BIN)/megablocks backends check reference --device cpu
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check src plugins tests benchmarks examples

bench-dispatch: $(STAMP)
	$(BIN)/python benchmarks/dispatch_overhead.py
