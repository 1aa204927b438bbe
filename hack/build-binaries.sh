#!/usr/bin/env bash
# Build the binaries of a local Kubernetes control plane from pinned sources through
# the Go module proxy (no prebuilt downloads): etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, kubectl, kwok and helm.
#
# Versions live in hack/versions.env. Binaries go into a cache keyed by those versions:
#   ${DILOCO_K8S_CACHE:-$HOME/.cache/diloco-operator/k8s}/<k8s>-<etcd>-<kwok>-<helm>/bin
# When every binary is already there the script returns at once.
#
# Usage:
#   hack/build-binaries.sh                  build if needed; print the bin dir as last line
#   hack/build-binaries.sh --print-bin-dir  print the bin dir only (builds nothing)
#   hack/build-binaries.sh --check          exit 0 if every binary is cached, 1 otherwise
#   hack/build-binaries.sh --force          rebuild everything
set -euo pipefail

HACK_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=versions.env disable=SC1091
source "${HACK_DIR}/versions.env"

CACHE_ROOT=${DILOCO_K8S_CACHE:-${HOME:?neither DILOCO_K8S_CACHE nor HOME is set}/.cache/diloco-operator/k8s}
CACHE_KEY="${K8S_VERSION}-${ETCD_VERSION}-${KWOK_VERSION}-${HELM_VERSION}"
OUT_DIR="${CACHE_ROOT}/${CACHE_KEY}"
BIN_DIR="${OUT_DIR}/bin"
BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok helm)

log() { printf '[build-binaries] %s\n' "$*" >&2; }
die() { printf '[build-binaries] ERROR: %s\n' "$*" >&2; exit 1; }
# shellcheck source=lib/build-common.sh disable=SC1091
source "${HACK_DIR}/lib/build-common.sh"

is_built() { have_all "${BINARIES[@]}"; }
parse_build_args 2,15 "$@"

# Fast path: everything cached.
if [[ ${FORCE} -eq 0 ]] && is_built; then
  echo "${BIN_DIR}"
  exit 0
fi

# ---------------------------------------------------------------------------
# Toolchain, the cache entry's lock and the work dir (hack/lib/build-common.sh)
find_go
take_build_lock "${OUT_DIR}" "${CACHE_KEY}"
if [[ ${FORCE} -eq 0 ]] && is_built; then
  echo "${BIN_DIR}"
  exit 0
fi
begin_work_dir

# ---------------------------------------------------------------------------
# etcd: its server module carries relative replace directives, so `go install
# module@version` refuses it; a tiny wrapper module pins all etcd modules instead.
build_etcd() {
  needs_build etcd || return 0
  local t=${SECONDS} dir="${WORK_DIR}/etcd" m
  log "building etcd ${ETCD_VERSION} (first run only, ~2-4 min)..."
  mkdir -p "${dir}"
  {
    echo "module diloco.local/build/etcd"
    echo
    echo "go 1.26"
    echo
    echo "require ("
    for m in server api client/pkg client pkg; do
      echo "	go.etcd.io/etcd/${m}/v3 ${ETCD_VERSION}"
    done
    echo ")"
  } > "${dir}/go.mod"
  (
    cd "${dir}"
    GOFLAGS=-mod=mod retry "${GO}" build -trimpath -ldflags="-s -w" \
      -o "${STAGE_DIR}/etcd" go.etcd.io/etcd/server/v3
  ) || die "building etcd failed (see the go output above)"
  install_staged "${BIN_DIR}" etcd
  step_done "${t}"
}

# kwok and helm: `go install module/cmd/x@version` (no replace directives).
build_kwok() {
  needs_build kwok || return 0
  go_install kwok "${KWOK_VERSION}" "~3-5 min" "${BIN_DIR}" sigs.k8s.io/kwok/cmd/kwok
}

build_helm() {
  needs_build helm || return 0
  LDFLAGS_EXTRA="-X helm.sh/helm/v3/internal/version.version=${HELM_VERSION}" \
    go_install helm "${HELM_VERSION}" "~3-5 min" "${BIN_DIR}" helm.sh/helm/v3/cmd/helm
}

build_etcd
build_kwok
build_helm
build_kubernetes "first run only, ~15-30 min on 2 cores" \
  kube-apiserver kube-controller-manager kube-scheduler kubectl
finish_build binaries
