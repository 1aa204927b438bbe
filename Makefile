# One entry point for set-up, the local demo and the tests. Every target installs what it needs.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# What `diloco run` needs and nothing else (no dev tools): the demo's install.
RUN_STAMP := $(VENV)/.installed-run
# Installs go through hack/venv_install.py: torch's CPU build first where the platform allows
# (Linux x86_64: the PyTorch CPU index, PyPI when it cannot be reached; TORCH_WHEELS=DIR: a local
# wheel, as CI passes), so no CUDA build lands on a CPU machine.
INSTALL := $(BIN)/python hack/venv_install.py

.PHONY: push-images demo test test-unit test-e2e test-cluster test-node lint crd bench clean binaries node images

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(RUN_STAMP): pyproject.toml hack/venv_install.py | $(BIN)/python
	$(INSTALL) trainer,local
	touch $(RUN_STAMP)

$(STAMP): pyproject.toml hack/venv_install.py | $(BIN)/python
	$(INSTALL) dev
	touch $(STAMP) $(RUN_STAMP)

## demo: run the shipped example locally (syncer + islands as processes); no cluster needed.
## Installs only what `diloco run` needs ([trainer,local], torch's CPU build).
## Everything lands in runs/local-demo/ (weights, logs, summary.json, loss.png); --fresh: a new
## demo each time (the previous folder is moved aside)
demo: $(RUN_STAMP)
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

## push-images: build both images (as `images`) and push them to REGISTRY=registry.example.com/you
## as REGISTRY/diloco-{operator,trainer}:<chart appVersion>; LOAD=kind or LOAD=node loads them
## into kind or the local real node instead (root; hack/push-images.sh)
push-images:
	REGISTRY="$(REGISTRY)" LOAD="$(LOAD)" bash hack/push-images.sh

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
$(BENCH_STAMP): pyproject.toml hack/venv_install.py | $(BIN)/python
	$(INSTALL) bench
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
