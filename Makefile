# Quick start: `make run` (default experiment) and `make test` (the test suite).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
UV := $(VENV)/bin/uv
CONFIG ?= configs/quickstart.yaml

.PHONY: run test venv dev clean bench docs

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip uv
	$(UV) pip install -q -p $(PY) -e .
	touch $@

$(VENV)/.docs-installed: $(VENV)/.installed
	$(UV) pip install -q -p $(PY) -e ".[docs]"
	touch $@

# docs: tests/test_docs_build.py builds the site with Sphinx.
$(VENV)/.dev-installed: $(VENV)/.installed
	$(UV) pip install -q -p $(PY) -e ".[dev,plot,flax,docs]"
	touch $@

venv: $(VENV)/.installed
dev: $(VENV)/.dev-installed

run: $(VENV)/.installed
	$(PY) -m dpsco_jax run $(CONFIG)

# Byte-compiled modules are cached under .pytest_cache/ (PYTHONPYCACHEPREFIX: no __pycache__ in
# the tree), even where the environment sets PYTHONDONTWRITEBYTECODE: the suite starts ~45
# Python processes (xdist workers, CLI / 4-device / benchmark subprocesses) and each one spent
# ~3 s compiling jax, scipy and dpsco_jax from source. --dist loadgroup: tests/conftest.py's
# scheduler (pytest_xdist_make_scheduler) runs each file's tests on one worker, and the tests
# of one xdist_group together (the bench_gpu / bench_cost smokes, which run one after the other
# and load each other's programs from the run's one compilation cache, set up in conftest);
# xdist's own loadgroup grouped nothing under pytest 9.
test: $(VENV)/.dev-installed
	env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=$(CURDIR)/.pytest_cache/pycache \
	  $(PY) -m pytest -n 2 --dist loadgroup -q --durations=15 tests

# The documentation site, offline, warnings as errors: the results pages are generated from
# experiments/results/* first, then Sphinx (MyST pages + autodoc) builds docs/_build/html.
docs: $(VENV)/.docs-installed
	$(PY) docs/gen_results.py
	$(PY) -m sphinx -W --keep-going -q -b html docs docs/_build/html

bench: $(VENV)/.dev-installed
	$(PY) experiments/bench_core.py

clean:
	rm -rf $(VENV) .pytest_cache docs/_build
