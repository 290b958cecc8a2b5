# One entry point for people and CI. Everything installs into ./.venv (Python) and
# ~/.cache/copse (Go-built cluster binaries); nothing is expected to be pre-installed
# beyond what the machine ships (Python 3.11, Go).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The install also compiles the router's C loops, so their source is part of the stamp.
NATIVE_SOURCES := setup.py router/copse/router/_native.c
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml $(NATIVE_SOURCES) | sha1sum | cut -c1-12)
PYTEST := $(BIN)/pytest
# Every subpackage of the copse namespace (mypy -p copse would only see the first source root).
COPSE_PACKAGES := $(notdir $(patsubst %/__init__.py,%,$(wildcard $(addsuffix /copse/*/__init__.py,operator planner router workers sim))))

.PHONY: venv test unit e2e lint crds cluster-up cluster-down demo bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml $(NATIVE_SOURCES)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@# setuptools' editable finder pins the namespace's subpackages at install time;
	@# listing the five source roots lets new subpackages import without a reinstall.
	@printf '%s\n' $(addprefix $(CURDIR)/,operator planner router workers sim) \
		> $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/copse-source-roots.pth
	@rm -f $(VENV)/.installed-* && touch $@

test:
	$(MAKE) unit
	$(MAKE) e2e

unit: venv
	$(PYTEST) tests -q -p no:cacheprovider

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
	$(BIN)/ruff check operator planner router workers sim tests e2e benchmarks setup.py
	$(BIN)/ruff format --check operator planner router workers sim tests e2e benchmarks setup.py
	$(BIN)/mypy $(addprefix -p copse.,$(COPSE_PACKAGES))
	$(BIN)/mypy tests e2e benchmarks

# helm lint --strict and helm template of charts/copse, with its default values and with every optional
# part on (ci/all-optional-values.yaml). helm is the one the cluster build caches (built if missing).
.PHONY: lint-chart
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

clean:
	rm -rf $(VENV)
