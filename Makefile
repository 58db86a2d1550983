# Two commands do all the set-up: `make demo` and `make test` (see README.md).
# torch is pinned through constraints.txt: torch==2.13.0 is the machine-local CPU build,
# any other torch requirement downloads several GB of CUDA wheels.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PIP_INSTALL := $(PIP) install -q -c constraints.txt

.PHONY: demo test lint bench bench-all clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q -U pip

# The demo installs the package as a user would (a plain, non-editable install prints no
# build warnings); the dev set-up installs it editable for working on the code.
$(VENV)/.base-installed: pyproject.toml constraints.txt | $(PY)
	$(PIP_INSTALL) .
	touch $@

$(VENV)/.dev-installed: pyproject.toml constraints.txt | $(PY)
	$(PIP_INSTALL) -e ".[dev,tf,dask,image,plot]"
	touch $@ $(VENV)/.base-installed

demo: $(VENV)/.base-installed
	$(PY) examples/demo.py

lint: $(VENV)/.dev-installed
	$(VENV)/bin/ruff check h5store tests benchmarks examples
	$(VENV)/bin/lint-imports

test: $(VENV)/.dev-installed lint
	$(PY) -m pytest

# Serving speed on your own file: `make bench FILE=my.h5 BENCH_ARGS="--feature mel --workers 0,2,4"`.
# Without FILE, on the demo's file (built by `make demo` when missing). The library's own
# benchmarks against baselines are benchmarks/bench_*.py (results in benchmarks/RESULTS.md).
FILE ?= demo-data/speech.h5
BENCH_ARGS ?=
bench: $(VENV)/.base-installed
	@test -f "$(FILE)" || [ "$(FILE)" != "demo-data/speech.h5" ] || $(MAKE) demo
	$(VENV)/bin/h5store bench "$(FILE)" $(BENCH_ARGS)

# Every table of benchmarks/RESULTS.md, each script writing its own section (~1 hour;
# `make bench-all BENCH_ALL_ARGS=--quick` for a smoke run, `--only serve,cold` for a subset).
BENCH_ALL_ARGS ?=
bench-all: $(VENV)/.dev-installed
	$(PY) benchmarks/run_all.py $(BENCH_ALL_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
