# Two commands on a fresh machine: `make demo` and `make test`. Installs use uv and the committed uv.lock;
# `make test` also installs the system tools the SSH tests need (apt-get, as root), see system-deps.
SHELL := /bin/bash
UV ?= $(shell command -v uv 2>/dev/null || echo "$(HOME)/.local/bin/uv")
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: install system-deps demo test lint typecheck unit bench clean

$(UV):
	python3 -m pip install --user --quiet uv || python3 -m pip install --quiet uv

install: $(UV)
	$(UV) sync --frozen --python python3

# The system tools the SSH tests and `make bench` use, as tool=Debian package. The tests start real sshd
# daemons (openssh-server, ssh-keygen from openssh-client, users made with useradd from passwd); the ranks use
# setsid (util-linux) and ps (procps); figure 2 of `make bench` compares with pdsh.
SYSTEM_DEPS := sshd=openssh-server ssh-keygen=openssh-client pdsh=pdsh setsid=util-linux ps=procps useradd=passwd
# 1: a tool that cannot be installed is an error (CI); else the SSH tests are skipped and the run says so
SYSTEM_DEPS_STRICT ?=

## Install the missing system tools with apt-get when we are root (or `sudo -n` works); else say what is
## missing and go on (pytest then lists the skipped tests and the command that fixes it).
system-deps:
	@missing=(); \
	for dep in $(SYSTEM_DEPS); do \
	  tool=$${dep%%=*}; pkg=$${dep#*=}; \
	  command -v "$$tool" >/dev/null 2>&1 || [ -x "/usr/sbin/$$tool" ] || [ -x "/sbin/$$tool" ] || missing+=("$$pkg"); \
	done; \
	[ $${#missing[@]} -eq 0 ] && exit 0; \
	if [ "$$(id -u)" = 0 ]; then sudo=; fix=; \
	elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo="sudo -n"; fix="sudo "; \
	else sudo=no; fix="sudo "; fi; \
	if [ "$$sudo" != no ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "system-deps: installing $${missing[*]} (apt-get)"; \
	  if $$sudo apt-get update -qq && \
	     $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$${missing[@]}"; then \
	    exit 0; \
	  fi; \
	  echo "system-deps: apt-get failed"; \
	elif [ "$$sudo" = no ]; then \
	  echo "system-deps: missing $${missing[*]}; not root and no passwordless sudo, so not installed"; \
	else \
	  echo "system-deps: missing $${missing[*]}; no apt-get here, install them with your package manager"; \
	fi; \
	echo "system-deps: without them the SSH tests are skipped (pytest lists them at the end) and make bench" \
	  "stops; fix: $${fix}apt-get update && $${fix}apt-get install -y --no-install-recommends $${missing[*]}"; \
	[ -z "$(SYSTEM_DEPS_STRICT)" ]

lint: install
	$(VENV)/bin/ruff check airflow_provider_sky dags_examples tests benchmarks
	$(VENV)/bin/ruff format --check airflow_provider_sky dags_examples tests benchmarks

typecheck: install
	$(VENV)/bin/mypy

unit: install system-deps
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

## Install (Python and, where it can, system tools), lint (ruff), type-check (mypy), run every test.
test: system-deps lint typecheck unit

## Install, then run sky_hello and sky_fail_fast under a real scheduler + triggerer (SQLite, local backend).
demo: install
	$(PY) -m airflow_provider_sky.dev.demo

bench: install system-deps
	$(PY) -m benchmarks.run

clean:
	rm -rf .airflow-demo .pytest_cache .mypy_cache .ruff_cache
