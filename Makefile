# The two front-door commands: `make run` and `make test`. Each creates .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
LISTEN ?= 127.0.0.1:50051
CONFIG ?=

.PHONY: run test bench reproduce proto lint clean

# the C fast path is compiled by the install: a changed source re-installs
$(VENV)/.installed: pyproject.toml clients/python/pyproject.toml kvrouterd/index/_native.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]' -e clients/python
	touch $@

run: $(VENV)/.installed  ## serve on $(LISTEN) with the embedded default config (or CONFIG=file)
	$(VENV)/bin/kvrouterd serve --listen $(LISTEN) $(if $(CONFIG),--config $(CONFIG))

test: $(VENV)/.installed  ## the whole test suite
	$(PY) -m pytest -q

bench: $(VENV)/.installed  ## in-process and gRPC benchmarks (reports, never asserts)
	$(VENV)/bin/kvrouterd bench

reproduce: $(VENV)/.installed  ## regenerate every table of docs/results.md into docs/results/reproduce (sim reproduce)
	$(VENV)/bin/kvrouterd sim reproduce --jobs 2 --out docs/results/reproduce

proto: $(VENV)/.installed  ## regenerate kvrouterd/_generated and the SDK's copy from proto/
	$(PY) proto/generate.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
