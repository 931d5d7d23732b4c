# Two entry points work on a fresh machine (Python 3.10+ and gcc, nothing else):
#   make demo   - set everything up, then write and read a few GiB of tensors and print GB/s
#   make test   - set everything up, then run the whole test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch first, pinned: a bare or newer `torch` would make pip download a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
BUILD_DEPS := scikit-build-core pybind11 cmake ninja

.PHONY: all setup demo test lint bench bench-io bench-checkpoint bench-metrics prometheus gpu-check clean

all: setup

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.stamp-deps: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q $(BUILD_DEPS)
	touch $@

# The native core is rebuilt whenever csrc/ changes (editable install: Python edits need no rebuild).
# A new top-level package needs a fresh editable install too (the redirect maps packages at install time).
$(VENV)/.stamp-build: $(VENV)/.stamp-deps $(wildcard csrc/*) CMakeLists.txt $(wildcard */__init__.py)
	$(BIN)/pip install -q --no-build-isolation -e ".[test,dev,bench]"
	touch $@

setup: $(VENV)/.stamp-build

demo: setup
	$(BIN)/python examples/demo.py

# The Grafana test scrapes a live dsio process with a real Prometheus (Debian's package).
prometheus:
	@command -v prometheus >/dev/null 2>&1 || bash scripts/install_prometheus.sh

test: setup prometheus
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check dsio dstrain tests bench examples
	$(BIN)/ruff format --check dsio dstrain tests bench examples
	$(BIN)/mypy

bench: bench-io bench-checkpoint bench-metrics
	$(BIN)/python bench/summary.py

bench-io: setup
	$(BIN)/python bench/io.py

bench-checkpoint: setup
	$(BIN)/python bench/checkpoint.py

bench-metrics: setup prometheus
	$(BIN)/python bench/metrics_overhead.py

clean:
	rm -rf build $(VENV) .pytest_cache .mypy_cache .ruff_cache

# On the GPU machine (through the device tool): build there, gpu tests, GPU benchmark.
gpu-check:
	bash scripts/gpu_check.sh $${OUT:-/tmp/dsio-gpu-out}
