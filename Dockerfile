# syntax=docker/dockerfile:1
# Images of diloco-operator, built from one Dockerfile:
#   docker build --target operator -t ghcr.io/diloco-operator/diloco-operator:0.1.0 .
#   docker build --target trainer  -t ghcr.io/diloco-operator/diloco-trainer:0.1.0 .
#   docker build --target trainer --build-arg TORCH_VARIANT=cu124 -t ...-trainer:0.1.0-cu124 .
# Without a Docker daemon (buildah, a locally made base image, local torch wheels):
#   hack/build-images.sh (README: "Building the images").
# `operator` is slim (kopf, kubernetes client; no torch). `trainer` runs learners and the syncer.
# The final stages hold no compilers or build tools and run as uid 65532.

# Pinned base image (a released patch tag, never :latest).
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

# ---------------------------------------------------------------------------------------------
# builder: the project wheel, plus wheels of the operator's dependencies so the operator stage
# installs offline from exactly these files.
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY trainer/ trainer/
COPY operator/ operator/
RUN pip wheel --no-deps --wheel-dir /wheels/project . \
 && pip wheel --wheel-dir /wheels/operator "$(ls /wheels/project/*.whl)[operator]"

# ---------------------------------------------------------------------------------------------
# runtime: what both final stages share: the non-root user and Python settings.
FROM ${PYTHON_IMAGE} AS runtime
# HOME=/tmp for every uid (pods may run as another non-root uid): caches and config of torch
# and the Kubernetes client land in the writable /tmp.
ENV HOME=/tmp \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# Same uid/gid as distroless "nonroot"; the chart's podSecurityContext uses it too. The chart
# mounts a writable emptyDir at /tmp and keeps the root filesystem read-only.
RUN groupadd --gid 65532 diloco \
 && useradd --uid 65532 --gid 65532 --home-dir /tmp --no-create-home \
      --shell /usr/sbin/nologin diloco
WORKDIR /tmp
LABEL org.opencontainers.image.source="https://github.com/diloco-operator/diloco-operator" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.description="diloco-operator: Decoupled DiLoCo training on Kubernetes"

# ---------------------------------------------------------------------------------------------
# operator: `diloco operator` (the chart passes its flags as args).
FROM runtime AS operator
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-index --find-links /wheels/operator \
      "$(ls /wheels/project/*.whl)[operator]" \
 && diloco --version
USER 65532:65532
ENTRYPOINT ["diloco"]
CMD ["operator"]

# ---------------------------------------------------------------------------------------------
# trainer: `diloco learner` / `diloco syncer` (the operator sets the args of each pod).
FROM runtime AS trainer
# Which torch: the range of pyproject.toml's trainer extra (tests/node/test_images.py checks that
# they agree), or one version (hack/build-images.sh pins the local wheel it found).
ARG TORCH_SPEC="torch>=2.2"
# Where torch comes from. Empty: PyPI, whose Linux x86_64 wheel is the CUDA 12 build (it runs on
# CPU too, but the image is several GB). One PyTorch variant from its own index instead:
#   --build-arg TORCH_VARIANT=cpu     https://download.pytorch.org/whl/cpu (CPU only, much smaller)
#   --build-arg TORCH_VARIANT=cu124   https://download.pytorch.org/whl/cu124 (one CUDA release)
# or any index (a mirror): --build-arg TORCH_INDEX_URL=https://... (wins over TORCH_VARIANT).
ARG TORCH_VARIANT=
ARG TORCH_INDEX_URL=
# Local torch wheels (pip --find-links: a URL, or a directory the builder mounts into RUN, as
# `buildah bud -v DIR:/mnt:ro` does); the index still serves torch's dependencies.
ARG TORCH_FIND_LINKS=
# torch first, on its own, so the trainer extra below keeps it and does not pull the default
# build; the extra is then installed with torch held at the version just installed: the one its
# metadata names (pip compares with that; torch.__version__ may add a local tag such as +cu132
# that PyPI's metadata lacks, and `torch==2.x.y+cu132` is then found nowhere).
RUN index="${TORCH_INDEX_URL:-${TORCH_VARIANT:+https://download.pytorch.org/whl/${TORCH_VARIANT}}}" \
 && pip install ${index:+--index-url "${index}"} \
      ${TORCH_FIND_LINKS:+--find-links "${TORCH_FIND_LINKS}"} "${TORCH_SPEC}"
# Only [trainer]: the [local] extra (rich, matplotlib: `diloco run`'s live view and plot) stays
# out of the image. That leaves out 109,960,130 bytes (105 MiB): `pip install --target DIR
# matplotlib rich` made 183,188,355, of which numpy and packaging (73,228,225) [trainer] has
# anyway; against a CPU torch 2.13 environment's site-packages, 1,500,620,910 -> 1,391,672,063
# bytes (-7.3%; less with a CUDA torch).
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install "$(ls /wheels/project/*.whl)[trainer]" \
      "torch==$(python -c 'from importlib.metadata import version; print(version("torch"))')" \
 && diloco --version
USER 65532:65532
ENTRYPOINT ["diloco"]
CMD ["learner"]
