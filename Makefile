# Two entry points work on a fresh Linux machine (see README "Set-up" for the exact prerequisites):
#   make demo   - set everything up, then train a small GPT with ZeRO-3 + NVMe offload on 2 ranks, with async
#                 checkpoints, a SIGKILLed rank, a bitwise-checked resume and live Prometheus metrics (~3-4 min)
#   make demo-io - write and read a few GiB of tensors and print GB/s
#   make test   - set everything up, then run the whole test suite
# Prerequisites on a bare Debian/Ubuntu: apt-get install make g++ python3-dev python3-venv (Python 3.11+).
# No root is needed for anything below.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The torch requirement, installed first and passed to pip as written (so it may carry pip options).
# `torch==2.13.0` is the CPU build only where pip is configured for CPU wheels (this project's machines:
# a local wheel); on a standard machine it resolves to the multi-GB CUDA build from PyPI. CPU-only elsewhere:
#   make test TORCH='torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu'
TORCH  ?= torch==2.13.0
# Where scripts/install_prometheus.sh unpacks Debian's Prometheus when not root; put on PATH for the tests.
PROMETHEUS_DIR ?= $(CURDIR)/.cache/prometheus
export DSIO_PROMETHEUS_DIR := $(PROMETHEUS_DIR)
BUILD_DEPS := scikit-build-core pybind11 cmake ninja

.PHONY: all setup demo demo-io test lint bench bench-full bench-io bench-checkpoint bench-metrics readme-numbers prometheus gpu-check clean

all: setup

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { \
	  echo "make: dsio needs Python 3.11+; $(PYTHON) is $$($(PYTHON) -V 2>&1). Try: make PYTHON=python3.11 ..."; exit 1; }
	$(PYTHON) -m venv $(VENV)
	@# pip older than 21.3 cannot install PEP 660 editables: upgrade only then (a fresh 3.11 venv's pip is
	@# 23.x; the upgrade is a network round-trip, ~8 s of a fresh clone's set-up under load)
	$(BIN)/python -c 'import sys, pip; sys.exit(tuple(map(int, pip.__version__.split(".")[:2])) < (21, 3))' \
	  || $(BIN)/pip install -q --upgrade pip

$(VENV)/.stamp-deps: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q $(BUILD_DEPS)
	touch $@

# The native core is rebuilt whenever csrc/ changes (editable install: Python edits need no rebuild).
# A new package (top-level or nested) needs a fresh editable install too (the redirect maps modules at install time).
$(VENV)/.stamp-build: $(VENV)/.stamp-deps $(wildcard csrc/*) CMakeLists.txt $(shell find dsio dstrain -name __init__.py)
	$(BIN)/pip install -q --no-build-isolation -e ".[test,dev,bench]"
	touch $@

setup: $(VENV)/.stamp-build

# DEMO_OUT: where the table, JSON and PNG go (stem), e.g. make demo DEMO_OUT=bench/results/demo-2026-11-30;
# DEVICE=cuda runs it on GPUs (NCCL); DEMO_ARGS passes more options (python demo/train_demo.py --help).
DEMO_WORK ?= build/demo-run
DEMO_OUT  ?= $(DEMO_WORK)/demo
demo: setup
	$(BIN)/python demo/train_demo.py --work $(DEMO_WORK) --out $(DEMO_OUT) $(DEMO_ARGS)

demo-io: setup
	$(BIN)/python examples/demo.py

# The Grafana test scrapes a live dsio process with a real Prometheus (Debian's package: apt-get install as
# root, else `apt-get download` + `dpkg -x` into $(PROMETHEUS_DIR)). Never fails make: without Prometheus that
# one test skips and says how to enable it (under DSIO_CI=1, as in .ci/run, it fails instead).
prometheus:
	@bash scripts/install_prometheus.sh >/dev/null || echo "make: no Prometheus here; tests/dsio/test_grafana.py will skip"

# The suite on TEST_WORKERS pytest-xdist workers (0: in this one process). Whole files go to a worker
# (loadfile: a module's fixture, e.g. a checkpoint trained once for its tests, is made once). Much of a
# test's wall is spent waiting on launched 2-rank groups and interpreters: a second worker runs another
# file meanwhile (~630 CPU-s for the whole suite; measured: bench/results/suite-time-2026-12-01.md).
# Then the tests marked `alone` (a latency they measure is what tests beside them would spoil) run by
# themselves in one process, from the files the first part's collection listed (--alone-list, in
# tests/conftest.py: no second collection of the whole suite; without the list, all files); make fails
# if either part does.
TEST_WORKERS ?= 2
ALONE_LIST := $(CURDIR)/build/alone-tests.txt
test: setup prometheus
	export PATH="$(PROMETHEUS_DIR)/bin:$$PATH"; rc=0; mkdir -p build; rm -f $(ALONE_LIST); \
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not alone" --alone-list $(ALONE_LIST) \
	  || rc=$$?; \
	$(BIN)/python -m pytest -q -m alone $$(cat $(ALONE_LIST) 2>/dev/null) || rc=$$?; \
	exit $$rc

lint: setup
	$(BIN)/ruff check dsio dstrain tests bench examples demo scripts/readme_numbers.py
	$(BIN)/ruff format --check dsio dstrain tests bench examples demo scripts/readme_numbers.py
	$(BIN)/mypy

# `make bench`: every benchmark driver's quick mode (each a few seconds on a quiet machine), a smoke test of the
# tools, not a measurement: results and the summary page go to $(BENCH_QUICK), never bench/results. Real runs:
# `make bench-full` (io, checkpoint, metrics) or a driver's own command (its docstring; bench/results/README.md).
# GPU-only drivers (bench/gpu_io.py, bench/pipe_nccl.py) run on the GPU machine (`make gpu-check`);
# bench/experiments/ holds one-issue experiments, run by hand.
BENCH_QUICK ?= $(CURDIR)/build/bench-quick
QUICK := DSIO_BENCH_RESULTS=$(BENCH_QUICK) PATH="$(PROMETHEUS_DIR)/bin:$$PATH" $(BIN)/python
bench: setup prometheus
	mkdir -p $(BENCH_QUICK)
	$(QUICK) bench/io.py --quick
	$(QUICK) bench/checkpoint.py --quick
	$(QUICK) bench/ckpt_blocked.py --quick
	$(QUICK) bench/metrics_overhead.py --quick
	$(QUICK) bench/train.py --quick
	$(QUICK) bench/pipe.py --quick
	$(QUICK) bench/moe.py --quick
	$(QUICK) bench/onebit.py --quick
	$(QUICK) bench/bigmodel.py --quick
	$(QUICK) bench/offload.py --quick
	$(QUICK) bench/offload_gpu.py --quick
	$(QUICK) bench/activation_checkpointing.py --quick
	$(QUICK) bench/flops_profiler.py --label quick
	$(QUICK) bench/summary.py

bench-full: bench-io bench-checkpoint bench-metrics
	$(BIN)/python bench/summary.py

# README's tables are generated from bench/results/*.json (tests/test_readme_numbers.py fails when they drift).
readme-numbers: setup
	$(BIN)/python scripts/readme_numbers.py

bench-io: setup
	$(BIN)/python bench/io.py

bench-checkpoint: setup
	$(BIN)/python bench/checkpoint.py

bench-metrics: setup prometheus
	PATH="$(PROMETHEUS_DIR)/bin:$$PATH" $(BIN)/python bench/metrics_overhead.py

clean:
	rm -rf build $(VENV) .pytest_cache .mypy_cache .ruff_cache .cache

# On the GPU machine (through the device tool): build there, gpu tests, GPU benchmark.
gpu-check:
	bash scripts/gpu_check.sh $${OUT:-/tmp/dsio-gpu-out}
