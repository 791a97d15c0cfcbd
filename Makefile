# The two set-up commands are `make serve` and `make test`; both install what they need first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
HOST   ?= 127.0.0.1
PORT   ?= 8000
# Serving needs only the base dependencies (no torch); the suite needs the training, load-test and dev
# extras too. One venv, one stamp per level: `make serve` on a fresh clone never pulls torch, and a
# stamp re-installs only when pyproject.toml changes, so a second `make` is instant.
SERVE_STAMP    := $(VENV)/.installed-serve
LOADTEST_STAMP := $(VENV)/.installed-loadtest
STAMP          := $(VENV)/.installed
LOCUST_ARGS    ?= --headless -u 2 -r 2 -t 10s
# ONNX Runtime's own telemetry (service/__init__.py): off for every tool make runs, unless set
export ORT_DISABLE_TELEMETRY ?= 1

.PHONY: install serve loadtest test test-slow quickstart lint bench-service clean

# No `pip install --upgrade pip`: any pip >= 21.3 installs this project editable, and the upgrade is a
# network round trip on every fresh clone.
$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(SERVE_STAMP): pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -q -e .
	touch $@

$(LOADTEST_STAMP): $(SERVE_STAMP)
	$(PY) -m pip install -q -e ".[loadtest]"
	touch $@

$(STAMP): $(SERVE_STAMP)
	$(PY) -m pip install -q -e ".[train,loadtest,dev]"
	touch $@

install: $(STAMP)

serve: $(SERVE_STAMP)
	$(PY) -m service --host $(HOST) --port $(PORT)

# Locust against a running `make serve` (the committed texts in loadtest/data/ need no training data).
loadtest: $(LOADTEST_STAMP)
	$(VENV)/bin/locust -f loadtest/ $(LOCUST_ARGS) --host http://$(HOST):$(PORT)

test: $(STAMP)
	$(PY) -m pytest -q

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# The README's quick start, run from a fresh clone of HEAD (what .ci/run checks after `make test`).
quickstart:
	.ci/quickstart.sh

bench-service: $(STAMP)
	$(PY) benchmarks/service_bench.py --bundle models/classify-linformer

# Reliability (issue #12); each writes its results under benchmarks/results/. The load generator pins itself
# to core 1 and the server to core 0 (taskset).
.PHONY: fuzz soak overload
$(VENV)/.fuzz-installed: $(STAMP)
	$(PY) -m pip install -q -e ".[fuzz]"
	touch $@

fuzz: $(VENV)/.fuzz-installed
	$(PY) -m benchmarks.fuzz

soak: $(STAMP)
	$(PY) -m benchmarks.soak

overload: $(STAMP)
	$(PY) -m benchmarks.overload
	$(PY) -m benchmarks.overload --bundle translate-linformer

lint: $(STAMP)
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
