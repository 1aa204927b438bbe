# One entry point for set-up, the local demo and the tests. Every target installs what it needs.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-unit test-e2e test-cluster test-node lint crd bench clean binaries node images

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

## demo: run the shipped example locally (syncer + islands as processes); no cluster needed.
## Everything lands in runs/local-demo/ (weights, logs, summary.json, loss.png); --fresh: a new
## demo each time (the previous folder is moved aside)
demo: $(STAMP)
	$(BIN)/diloco run examples/local.yaml --fresh

## test: lint, build what the tiers need (control plane, real node, images: cached by version),
## then every test tier (unit, e2e processes, real control plane, real node; kind where Docker is)
test: $(STAMP) lint binaries node images
	$(BIN)/python -m pytest -ra tests

## binaries: build the control plane's pinned binaries before any test starts, with progress
## (about 15 minutes on 2 cores the first time; cached by version, seconds afterwards)
binaries:
	bash hack/build-binaries.sh

## node: build the real node's pinned binaries (kubelet, kube-proxy, containerd, CNI plugins,
## CoreDNS) and install runc/iptables from Debian if missing; cached by version
node:
	bash hack/build-node.sh

## images: the operator and trainer images from the Dockerfile without a Docker daemon (root;
## buildah, debootstrap): OCI archives under ~/.cache/diloco-operator/images, cached by content
images:
	bash hack/build-images.sh

## test-node: the control plane with one real node (root), the tier alone
test-node: $(STAMP) binaries node
	$(BIN)/python -m pytest -ra tests/node

test-unit: $(STAMP)
	$(BIN)/python -m pytest -ra tests/unit

test-e2e: $(STAMP)
	$(BIN)/python -m pytest -ra tests/e2e

test-cluster: $(STAMP) binaries
	$(BIN)/python -m pytest -ra tests/cluster

## lint: ruff (lint and format), the type checker (mypy, configured in pyproject.toml), the import contracts
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

## bench: every benchmark with its CPU defaults (each <= 15 min on 2 cores); appends to bench/log/DAY.md
BENCH_STAMP := $(VENV)/.installed-bench
$(BENCH_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	for b in syncer_throughput convergence bandwidth decoupling goodput operator_scale; do \
	  $(BIN)/python -m bench.$$b || exit 1; done

## crd: regenerate crds/ and the chart's copy from the pydantic models
crd: $(STAMP)
	$(BIN)/diloco crd -o crds/dilocojob.yaml
	mkdir -p charts/diloco-operator/crds
	cp crds/dilocojob.yaml charts/diloco-operator/crds/dilocojob.yaml

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
