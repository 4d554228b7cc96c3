# Set-up is the same for every target: a venv, the CPU torch wheel pinned first (an
# unpinned torch would pull a multi-GB CUDA build), then the project with its dev extra.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_PIN ?= torch==2.13.0

.PHONY: setup demo test test-slow proto bench-engine clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/pdcluster demo-cluster

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow tests

bench-engine: $(STAMP)
	$(BIN)/pdcluster bench engine --json bench-engine.json

clean:
	rm -rf $(VENV) build *.egg-info
