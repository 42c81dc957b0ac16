# smiquery: `make demo` and `make test` are the whole set-up (each creates .venv and installs what it needs).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test lint typecheck check bench fixtures docker clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) scripts/demo.py

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check smiquery tests scripts
	$(VENV)/bin/ruff format --check smiquery

typecheck: $(STAMP)
	$(VENV)/bin/mypy

check: lint typecheck test

bench: $(STAMP)
	$(PY) scripts/bench_parse.py

fixtures:
	scripts/record-fixtures tests/fixtures

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build dist
