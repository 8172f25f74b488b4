# Two set-up commands: `make demo` and `make test`. Each creates .venv with the pinned
# dependencies on first use and reuses it afterwards.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint venv clean

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements-dev.txt
	$(BIN)/pip install --quiet --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/elasticpp demo

lint: $(STAMP)
	$(BIN)/ruff check elasticpp tests bench
	$(BIN)/ruff format --check elasticpp tests bench
	$(BIN)/mypy --strict elasticpp/plan elasticpp/checkpoint

test: lint
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV)
