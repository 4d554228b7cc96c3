# Set-up is the same for every target: a venv, the CPU torch wheel pinned first (an
# unpinned torch would pull a multi-GB CUDA build), then the project with its dev extra.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_PIN ?= torch==2.13.0

.PHONY: setup kernels demo test test-slow proto bench-engine docs clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e '.[dev,models]'
	touch $(STAMP)

setup: $(STAMP) kernels

# The CPU attention kernel, compiled for this machine (~30 s once, then cached; a no-op load
# after). Built here so that no engine or Ray actor pays for it on its first step.
kernels: $(STAMP)
	$(BIN)/python -m engine.attention.cpu_ext

demo: $(STAMP) kernels
	$(BIN)/pdcluster demo-cluster

# The import rules first (pyproject.toml's [tool.importlinter], docs/architecture.md), then the suite.
test: $(STAMP) kernels
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -q --durations=25 tests

test-slow: $(STAMP) kernels
	$(BIN)/python -m pytest -q -m slow tests

# The multi-node suite (root: it makes network namespaces; not part of `make test`): three namespaced
# hosts on one bridge (scripts/netns_cluster.py), Ray head + router / prefill pool / decode pool,
# KV across hosts over NIXL (UCX TCP) and gRPC, listeners, node loss and return (recovery times
# printed), a pool scaled onto a fourth host that joins and back (times printed). Everything it makes (namespaces, veths, bridge, processes) is removed, also on failure.
.PHONY: test-multinode
test-multinode: $(STAMP) kernels
	$(BIN)/python -m pytest -q -s -m multinode tests/multinode

bench-engine: $(STAMP)
	$(BIN)/pdcluster bench engine --json bench-engine.json

# docs/configuration.md is generated from cluster/config.py's models (a unit test fails while it is
# stale). Written to a temporary file first, so a failed render leaves the committed page as it was.
docs: $(STAMP)
	$(BIN)/python -m cluster.config_doc > docs/configuration.md.tmp || { rm -f docs/configuration.md.tmp; exit 1; }
	mv docs/configuration.md.tmp docs/configuration.md

clean:
	rm -rf $(VENV) build *.egg-info
