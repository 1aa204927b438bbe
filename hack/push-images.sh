#!/usr/bin/env bash
# `make push-images REGISTRY=...`: build the operator and trainer images (hack/build-images.sh,
# no Docker daemon; cached by content) and push them to REGISTRY as
#   REGISTRY/diloco-operator:TAG and REGISTRY/diloco-trainer:TAG
# TAG defaults to the chart's appVersion, so `helm install ... --set image.repository=
# REGISTRY/diloco-operator` and `diloco submit JOB --registry REGISTRY` name exactly these.
#
# Instead of pushing (a cluster without a registry it can pull from):
#   LOAD=kind   load them into the kind cluster (`kind load image-archive`; KIND_CLUSTER: its name)
#   LOAD=node   import them into this project's real node (`hack/local-cluster load-image`;
#               DILOCO_CLUSTER_DIR: its --dir)
# The images keep the REGISTRY/... names there, and pods (imagePullPolicy IfNotPresent) find them.
#
# Copies with buildah (which hack/build-images.sh installs). A registry that wants a login:
# `buildah login REGISTRY` first.
# Root, as hack/build-images.sh.
set -euo pipefail

HACK_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(cd "${HACK_DIR}/.." && pwd)
log() { printf '[push-images] %s\n' "$*" >&2; }
die() { printf '[push-images] ERROR: %s\n' "$*" >&2; exit 1; }

REGISTRY=${REGISTRY:-}
[[ -n "${REGISTRY}" ]] || die "REGISTRY is not set: make push-images REGISTRY=registry.example.com/you"
REGISTRY=${REGISTRY%/}
LOAD=${LOAD:-}
case "${LOAD}" in ""|kind|node) ;; *) die "LOAD=${LOAD}: expected kind or node (or unset: push)" ;; esac
TAG=${TAG:-$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "${REPO_DIR}/charts/diloco-operator/Chart.yaml")}
[[ -n "${TAG}" ]] || die "no TAG and no appVersion in charts/diloco-operator/Chart.yaml"

ARCHIVES=$(bash "${HACK_DIR}/build-images.sh" | tail -n 1)
[[ -f "${ARCHIVES}/operator.tar" && -f "${ARCHIVES}/trainer.tar" ]] \
  || die "hack/build-images.sh left no archives in ${ARCHIVES}"

STORAGE=${DILOCO_BUILDAH_ROOT:-${HOME:?}/.cache/diloco-operator/buildah}
bh() {
  buildah --root "${STORAGE}/root" --runroot "${STORAGE}/run" \
    --storage-driver "${DILOCO_BUILDAH_DRIVER:-vfs}" "$@"
}
# copy SRC DEST: one image between transports (oci-archive:, docker://, docker-archive:),
# through buildah's storage (the image is removed from it afterwards).
copy() {
  local id
  id=$(bh pull --quiet "$1")
  bh push --quiet "${id}" "$2"
  bh rmi "${id}" >/dev/null
}

WORK=$(mktemp -d)
trap 'rm -rf "${WORK}"' EXIT
for name in operator trainer; do
  dest="${REGISTRY}/diloco-${name}:${TAG}"
  src="oci-archive:${ARCHIVES}/${name}.tar"
  case "${LOAD}" in
    "")
      log "${name}: pushing ${dest}"
      copy "${src}" "docker://${dest}"
      ;;
    kind)
      copy "${src}" "docker-archive:${WORK}/${name}.tar:${dest}"
      log "${name}: loading ${dest} into kind"
      kind load image-archive "${WORK}/${name}.tar" ${KIND_CLUSTER:+--name "${KIND_CLUSTER}"}
      ;;
    node)
      copy "${src}" "docker-archive:${WORK}/${name}.tar:${dest}"
      log "${name}: importing ${dest} into the real node"
      "${HACK_DIR}/local-cluster" load-image "${WORK}/${name}.tar" \
        ${DILOCO_CLUSTER_DIR:+--dir "${DILOCO_CLUSTER_DIR}"}
      ;;
  esac
done
log "done: ${REGISTRY}/diloco-operator:${TAG} and ${REGISTRY}/diloco-trainer:${TAG}"
