# Two commands on a fresh machine: `make demo` and `make test`. Installs use uv and the committed uv.lock.
SHELL := /bin/bash
UV ?= $(shell command -v uv 2>/dev/null || echo "$(HOME)/.local/bin/uv")
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: install demo test lint typecheck unit bench clean

$(UV):
	python3 -m pip install --user --quiet uv || python3 -m pip install --quiet uv

install: $(UV)
	$(UV) sync --frozen --python python3

lint: install
	$(VENV)/bin/ruff check airflow_provider_sky dags_examples tests benchmarks
	$(VENV)/bin/ruff format --check airflow_provider_sky dags_examples tests benchmarks

typecheck: install
	$(VENV)/bin/mypy

unit: install
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

## Install, lint (ruff), type-check (mypy), run every test.
test: lint typecheck unit

## Install, then run sky_hello and sky_fail_fast under a real scheduler + triggerer (SQLite, local backend).
demo: install
	$(PY) -m airflow_provider_sky.dev.demo

bench: install
	$(PY) -m benchmarks.run

clean:
	rm -rf .airflow-demo .pytest_cache .mypy_cache .ruff_cache
