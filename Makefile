# Development tasks. `make demo` and `make test` create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PLUGINS := $(wildcard plugins/*/pyproject.toml)
# Where pip looks for torch: pip's own configuration, plus TORCH_INDEX when set, e.g.
#   make install TORCH_INDEX=https://download.pytorch.org/whl/cpu     (the CPU build, no CUDA libraries)
# (passed to pip as PIP_EXTRA_INDEX_URL). Unset, nothing but pip's configured indexes is contacted.
TORCH_INDEX ?=
ifneq ($(strip $(TORCH_INDEX)),)
export PIP_EXTRA_INDEX_URL := $(TORCH_INDEX)
endif

.PHONY: install demo test compile-gate lint bench-dispatch

# Test processes (pytest-xdist); each test file runs whole in one of them, so a file's tests
# that share a build directory or a port never overlap.
TEST_JOBS ?= 2

$(STAMP): pyproject.toml $(PLUGINS)
	$(PYTHON) -m venv $(VENV)
	# torch 2.13.0 is pinned (from pip's indexes, plus TORCH_INDEX when set); triton runs its
	# kernels on the CPU under TRITON_INTERPRET=1 in the tests; transformers for the tests of
	# experts_implementation="megablocks" (pure Python, with tokenizers, safetensors, huggingface_hub).
	$(BIN)/pip install --quiet torch==2.13.0 triton==3.6.0 pytest "numpy<2.4" ruff==0.17.6 mypy==2.4.1 "setuptools>=64" hypothesis==6.170.17 pytest-xdist==3.8.0 transformers==5.24.0
	$(BIN)/pip install --quiet -e . $(foreach p,$(PLUGINS),-e $(dir $(p)))
	# Megatron-Core's unfused permute/unpermute are the oracle of tests/test_moe_permute.py: pure
	# Python, imported on the CPU beside torch; --no-deps keeps its GPU requirements out.
	$(BIN)/pip install --quiet --no-deps megatron-core==0.16.1
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/megablocks backends list
	$(BIN)/megablocks demo

test: $(STAMP)
	# The gate: the conformance kit on every installed backend that serves the CPU (Triton's kernels
	# under its interpreter; the reference is the kit's oracle, checked against numpy by the suite),
	# then the test suite (README, "Quick start": about 1-3 and 4-8 minutes of wall-clock time on the
	# 2-core CI machine). --quick: the full set's larger shapes would take the interpreter many
	# minutes; they are for accelerators.
	TRITON_INTERPRET=1 $(BIN)/megablocks backends check --device cpu --quick
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile

# The ahead-of-time compile gate: every backend's kernels compiled for AMD and NVIDIA targets on the
# CPU (no GPU) and checked against each arch's limits; two targets at a time (one process each).
# Triton's on-disk cache (kept in the checkout) makes a rerun of unchanged kernels quick.
COMPILE_TARGETS := gfx90a,gfx942,gfx950,sm_80,sm_90a,sm_100a
compile-gate: $(STAMP)
	TRITON_CACHE_DIR=$(CURDIR)/.triton-cache $(BIN)/megablocks backends compile \
		--target $(COMPILE_TARGETS) --shapes training,decode --jobs 2

LINTED := megablocks_core plugins tests benchmarks examples

# ruff (lint and format) on everything; mypy on the packages (files in pyproject.toml).
lint: $(STAMP)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/mypy

bench-dispatch: $(STAMP)
	$(BIN)/python benchmarks/dispatch_overhead.py
