# smiquery: `make demo` and `make test` are the whole set-up (each creates .venv and installs what it needs).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install tools demo test lint typecheck check bench fixtures docker clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) scripts/demo.py

# Outside tools the tests use for real (promtool and prometheus; more as issues need them). Installed where we
# can (root with apt-get); elsewhere the tests that need them skip, except under CI=true where they fail.
tools:
	-scripts/install-prometheus

test: $(STAMP) tools
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check smiquery tests scripts
	$(VENV)/bin/ruff format --check smiquery

typecheck: $(STAMP)
	$(VENV)/bin/mypy

check: lint typecheck test

bench: $(STAMP)
	$(PY) scripts/bench_parse.py
	$(PY) scripts/bench_stream.py
	$(PY) scripts/bench_cli.py
	$(PY) scripts/bench_exporter.py

fixtures:
	scripts/record-fixtures tests/fixtures

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build dist
