# The two set-up commands are `make serve` and `make test`; both install what they need first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
HOST   ?= 127.0.0.1
PORT   ?= 8000
STAMP  := $(VENV)/.installed

.PHONY: install serve test test-slow lint bench-service clean

# Re-installs only when pyproject.toml changes, so a second `make install` is instant.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[train,loadtest,dev]"
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(PY) -m service --host $(HOST) --port $(PORT)

test: $(STAMP)
	$(PY) -m pytest -q

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

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

lint: $(STAMP)
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
