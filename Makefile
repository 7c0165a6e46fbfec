# The two commands of the README: `make demo` (the main job) and `make test` (the whole suite).
# Both create/reuse .venv, install torch 2.13.0 first when no torch is present (a bare `torch` would pull a
# multi-GB CUDA build), then this package with its test extra.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-fast lab bench gpu-check screenshots

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps torchao==0.18.0  # the float8 extra (pyproject.toml), without touching torch
	touch $@

demo: setup
	$(PY) -m autopar_nb.demo

# the whole suite: each file's tests on one of two workers (module-scoped launches stay shared), then the tests
# that hold a wall-clock budget alone
test: setup
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "not serial"
	$(PY) -m pytest -q -m serial

# the inner loop: no worker processes, no browser, no Inductor compiles (the whole suite is `make test`)
test-fast: setup
	$(PY) -m pytest -q -m "not multiprocess and not browser and not slow"

# The README's pictures: the browser tests that take them write them into docs/img (JupyterLab and Debian's chromium,
# `apt-get install -y chromium`; the launch and tournament tests run CPU processes). tests/test_package.py checks that
# this writes every picture in docs/img and that the README shows each.
SCREENSHOT_TESTS := tests/test_browser.py tests/test_launch_browser.py
screenshots: setup
	AUTOPAR_SCREENSHOTS=docs/img $(PY) -m pytest -q $(SCREENSHOT_TESTS)

lab: setup
	$(PY) -m jupyterlab --ServerApp.root_dir=notebooks

bench: setup
	for b in bench/*.py; do $(PY) $$b || exit 1; done

# The one prepared GPU check (issue 16): on a CUDA host it writes BENCHMARKS.md's "## GPU" section in <= 8 minutes;
# on a CPU host it says so, checks its own plumbing and exits 0.
gpu-check: setup
	$(PY) bench/gpu_check.py
