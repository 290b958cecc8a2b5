# One entry point for people and CI. Everything installs into ./.venv (Python) and
# ~/.cache/copse (Go-built cluster binaries); nothing is expected to be pre-installed
# beyond what the machine ships (Python 3.11, Go).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The install also compiles the router's C loops, so their source is part of the stamp.
NATIVE_SOURCES := setup.py router/copse/router/_native.c
# Installed without their declared dependencies (for tests): the ModelExpress client the operator
# configures workers for, its gRPC client only, without the engine-side torch and model streamer.
NO_DEPS_PACKAGES := modelexpress==0.7.0
STAMP := $(VENV)/.installed-$(shell (cat pyproject.toml $(NATIVE_SOURCES); echo '$(NO_DEPS_PACKAGES)') | sha1sum | cut -c1-12)
PYTEST := $(BIN)/pytest
# Every subpackage of the copse namespace (mypy -p copse would only see the first source root).
COPSE_PACKAGES := $(notdir $(patsubst %/__init__.py,%,$(wildcard $(addsuffix /copse/*/__init__.py,operator planner router workers sim))))

.PHONY: venv test unit e2e lint docs docs-screenshot asan lint-chart crds cluster-up cluster-down demo bench-dynamo clean

venv: $(STAMP)

$(STAMP): pyproject.toml $(NATIVE_SOURCES)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps $(NO_DEPS_PACKAGES)
	@# setuptools' editable finder pins the namespace's subpackages at install time;
	@# listing the five source roots lets new subpackages import without a reinstall.
	@printf '%s\n' $(addprefix $(CURDIR)/,operator planner router workers sim) \
		> $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/copse-source-roots.pth
	@rm -f $(VENV)/.installed-* && touch $@

test:
	$(MAKE) unit
	$(MAKE) e2e

# The router's and the twin's tests run twice: with the compiled loops, then with the Python ones
# (what runs where the extension cannot be built; COPSE_ROUTER_NATIVE=0 forces them).
unit: venv
	$(PYTEST) tests -q -p no:cacheprovider
	COPSE_ROUTER_NATIVE=0 $(PYTEST) tests/router tests/sim -q -p no:cacheprovider

# Against $KUBECONFIG only with COPSE_E2E_USE_KUBECONFIG=1; otherwise the local control plane
# (reused if `make cluster-up` runs it, else started and stopped by the session). The build runs
# first, outside pytest, so a cold cache shows per-component progress and no test timeout covers it.
e2e: venv
	@if [ "$$COPSE_E2E_USE_KUBECONFIG" != 1 ]; then $(BIN)/copse cluster build >/dev/null; fi
	$(PYTEST) e2e -q -p no:cacheprovider -m e2e --timeout=600

cluster-up: venv
	$(BIN)/copse cluster up

cluster-down: venv
	$(BIN)/copse cluster down

lint: venv
	$(BIN)/ruff check operator planner router workers sim tests e2e benchmarks docs/hooks setup.py
	$(BIN)/ruff format --check operator planner router workers sim tests e2e benchmarks docs/hooks setup.py
	$(BIN)/mypy $(addprefix -p copse.,$(COPSE_PACKAGES))
	MYPYPATH=benchmarks $(BIN)/mypy tests e2e benchmarks
	$(MAKE) docs
	$(MAKE) asan

# The documentation site into site/, with --strict: a broken link or anchor, a page missing from the
# nav or a stale generated page fails. The reference pages are generated from the code during the
# build (docs/hooks/copse_docs.py).
docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir site

# The dashboard picture of the docs (docs/screenshots/dashboard.png): a live fleet of mocked engines
# behind the router, scraped for two minutes into tests/fixtures/dashboard-scrapes.json.gz, then the
# dashboard's queries evaluated over that recording and drawn (no Grafana involved).
docs-screenshot: venv
	$(BIN)/python -m tests.docs.dashboard record
	$(BIN)/python -m tests.docs.dashboard render

# The router's C loops built with AddressSanitizer (into .asan/, the venv's build untouched) and
# the tests that drive them run against that build (copse.router.loops loads the file that
# COPSE_ROUTER_NATIVE names). PYTHONMALLOC=malloc: freed Python objects are poisoned too, not
# recycled by pymalloc; no leak report (CPython keeps memory for its lifetime); --capture=sys
# leaves stderr alone, so that a sanitizer report reaches the terminal before the process ends.
ASAN_CC ?= gcc
ASAN_TESTS := $(addprefix tests/router/,test_native.py test_cost.py test_indexer.py test_approx.py \
	test_sequences.py test_core.py) tests/sim/test_replay.py
asan: venv
	@set -e; rm -rf .asan; \
	CC=$(ASAN_CC) CFLAGS="-fsanitize=address -fno-omit-frame-pointer -g" LDFLAGS="-fsanitize=address" \
		$(BIN)/python setup.py --quiet build_ext --build-lib .asan/lib --build-temp .asan/build; \
	so="$$(find .asan/lib -name '_native*.so')"; \
	test -n "$$so" || { echo "make asan: the AddressSanitizer build of _native.c failed (see above)"; exit 1; }; \
	echo "== $(ASAN_TESTS) against $$so"; \
	ASAN_OPTIONS=detect_leaks=0 PYTHONMALLOC=malloc LD_PRELOAD="$$($(ASAN_CC) -print-file-name=libasan.so)" \
		COPSE_ROUTER_NATIVE="$$so" $(PYTEST) -q -p no:cacheprovider --capture=sys $(ASAN_TESTS)

# helm lint --strict and helm template of charts/copse, with its default values and with every optional
# part on (ci/all-optional-values.yaml). helm is the one the cluster build caches (built if missing).
lint-chart: venv
	@set -e; \
	helm="$$($(BIN)/python -c 'from copse.cluster import binaries_for; print(binaries_for().helm)')"; \
	test -x "$$helm" || $(BIN)/copse cluster build >/dev/null; \
	for values in charts/copse/values.yaml charts/copse/ci/all-optional-values.yaml; do \
		echo "== $$values"; \
		"$$helm" lint --strict charts/copse -f "$$values"; \
		"$$helm" template copse charts/copse -f "$$values" >/dev/null; \
	done

crds: venv
	$(BIN)/copse api crds --out crds
	rm -rf charts/copse/crds && cp -r crds charts/copse/crds

# The main job: local cluster with fake NVL72 racks, operator, placement, router + mocked
# engines replaying Mooncake (KV-aware vs round-robin), planner dry-run. See `copse demo --help`.
demo: venv
	$(BIN)/copse demo

# Dynamo's own KV router and mocker (ai-dynamo 1.6.1, in a venv of their own under ~/.cache/copse/dynamo-peer,
# made on first use) replaying the Mooncake trace next to copse's; never part of `make test`.
bench-dynamo: venv
	$(BIN)/python benchmarks/dynamo_peer.py

clean:
	rm -rf $(VENV)
