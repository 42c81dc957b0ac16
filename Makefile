# smiquery: `make demo` and `make test` are the whole set-up (each creates .venv and installs what it needs).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DOCKER ?= docker
VERSION = $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
STAMP := $(VENV)/.installed
CORE_STAMP := $(VENV)/.installed-core

.PHONY: install tools demo test lint typecheck check bench soak fixtures docker docs docs-screens clean

# The core; the tests also need the dev tools, TensorFlow (CPU) and matplotlib.
$(CORE_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[fast]'
	touch $(CORE_STAMP)

$(STAMP): $(CORE_STAMP)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,docs,export,k8s,keras-test,lightning,plot,fast]'
	touch $(STAMP)

install: $(STAMP)

# The demo ends with a plot: the core plus the plot extra (matplotlib).
DEMO_STAMP := $(VENV)/.installed-demo
$(DEMO_STAMP): $(CORE_STAMP)
	$(PY) -m pip install -q -e '.[fast,plot]'
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(PY) scripts/demo.py

# Outside tools the tests use for real: prometheus/promtool, victoria-metrics (the fleet tests' second engine),
# slurm-wlm and munge (a real one-node Slurm), buildah (+ debootstrap), hadolint, kubernetes-validate,
# check-jsonschema, chromium (opens `report --html` pages headless). Installed where we can (root with apt-get, pip
# into the venv); elsewhere the tests that need them skip, except under CI=true where they fail.
tools: $(STAMP)
	-scripts/install-prometheus
	-scripts/install-victoria-metrics
	-scripts/install-slurm
	-scripts/install-chromium
	-scripts/install-container-tools $(VENV)

# Most tests wait on nvidia-smi stand-ins rather than compute, so pytest-xdist's TEST_WORKERS processes keep 2 cores
# busy (TEST_WORKERS=0: one process). Sources are byte-compiled first: with PYTHONDONTWRITEBYTECODE set, every fake
# nvidia-smi the tests spawn would compile smiquery again.
TEST_WORKERS ?= 4
test: $(STAMP) tools
	$(PY) -m compileall -q smiquery
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup

lint: $(STAMP)
	$(VENV)/bin/ruff check smiquery tests scripts
	$(VENV)/bin/ruff format --check smiquery

typecheck: $(STAMP)
	$(VENV)/bin/mypy

check: lint typecheck test

bench: $(STAMP)
	$(PY) scripts/bench_parse.py
	$(PY) scripts/bench_report.py
	$(PY) scripts/bench_stream.py
	$(PY) scripts/bench_cli.py
	$(PY) scripts/bench_start.py
	$(PY) scripts/bench_exporter.py
	$(PY) scripts/bench_compat.py
	$(PY) scripts/bench_pmon.py
	$(PY) scripts/bench_details.py
	$(PY) scripts/bench_aio.py

# Hours of an 8-GPU stream with random faults, compressed into minutes (MINUTES=3).
soak: $(STAMP)
	$(PY) scripts/soak.py --minutes $${MINUTES:-3}

# Both images, on a host with Docker (tests build them with buildah instead; see docker/README.md).
docker:
	$(DOCKER) build -f docker/Dockerfile.tensorflow --build-arg SMIQUERY_VERSION=$(VERSION) -t smiquery-tensorflow:$(VERSION) -t smiquery-tensorflow:latest .
	$(DOCKER) build -f docker/Dockerfile.exporter --build-arg SMIQUERY_VERSION=$(VERSION) -t smiquery-exporter:$(VERSION) -t smiquery-exporter:latest .

# The docs site (mkdocs.yml, docs/) into site/; --strict: a broken link, anchor or docstring fails.
# docs-screens captures the screens and pictures the pages show (tmux; prometheus and chromium where installed).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs-screens: $(STAMP)
	$(PY) scripts/make_docs_screens.py

fixtures:
	scripts/record-fixtures tests/fixtures

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build dist site
