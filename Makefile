# Two commands do all the set-up: `make demo` and `make test` (see README.md).
# torch is pinned through constraints.txt: torch==2.13.0 is the machine-local CPU build,
# any other torch requirement downloads several GB of CUDA wheels.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PIP_INSTALL := $(PIP) install -q -c constraints.txt

.PHONY: demo test lint bench bench-all clean chromium

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q -U pip

# The demo installs the package as a user would (a plain, non-editable install prints no
# build warnings); the dev set-up installs it editable for working on the code.
$(VENV)/.base-installed: pyproject.toml constraints.txt | $(PY)
	$(PIP_INSTALL) .
	touch $@

$(VENV)/.dev-installed: pyproject.toml constraints.txt | $(PY) chromium
	$(PIP_INSTALL) -e ".[dev,tf,dask,image,plot,s3]"
	touch $@ $(VENV)/.base-installed

# The report's browser test (tests/test_report.py) renders it in Debian's chromium. Installed
# here when missing and we are root (CI: .ci/run); otherwise a line says so and the test skips.
# Order-only above: checking costs nothing and never re-runs the pip install.
chromium:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "make: installing chromium for the report's browser test (apt-get, a few minutes)"; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 \
	    || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1; } \
	    || echo "make: chromium could not be installed (apt-get failed): the report's browser test will be skipped"; \
	else echo "make: no /usr/bin/chromium and not root: the report's browser test will be skipped (apt-get install chromium)"; fi

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
# The bench extra and litdata add the baselines only benchmarks use, kept out of the test set-up.
BENCH_ALL_ARGS ?=
$(VENV)/.bench-installed: pyproject.toml constraints.txt $(VENV)/.dev-installed
	$(PIP_INSTALL) -e ".[dev,tf,dask,image,plot,s3,bench]"
	$(PIP) install -q --no-deps "litdata==0.2.76"  # not its torchvision: see the bench extra
	touch $@

bench-all: $(VENV)/.bench-installed
	$(PY) benchmarks/run_all.py $(BENCH_ALL_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
