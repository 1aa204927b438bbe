#!/usr/bin/env bash
# Build the binaries of a local Kubernetes control plane from pinned sources through
# the Go module proxy (no prebuilt downloads): etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, kubectl, kwok and helm; and Kueue's manager with the
# CRDs, RBAC and webhook manifests of the same module (the cluster tier's admission tests).
#
# Versions live in hack/versions.env. Binaries go into a cache keyed by those versions:
#   ${DILOCO_K8S_CACHE:-$HOME/.cache/diloco-operator/k8s}/<k8s>-<etcd>-<kwok>-<helm>/bin
# Kueue has its own entry beside bin/, keyed by its version (a bump rebuilds only Kueue):
#   .../<k8s>-<etcd>-<kwok>-<helm>/kueue-<kueue>/{bin/kueue,config/{crd,rbac,webhook}}
# When everything is already there the script returns at once.
#
# Usage:
#   hack/build-binaries.sh                  build if needed; print the bin dir as last line
#   hack/build-binaries.sh --print-bin-dir  print the bin dir only (builds nothing)
#   hack/build-binaries.sh --print-kueue-dir  print Kueue's directory only (builds nothing)
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
KUEUE_DIR="${OUT_DIR}/kueue-${KUEUE_VERSION}"
# The manifests Kueue's manager needs installed (hack/localcluster/kueue.py reads them from here,
# so that a cleaned Go module cache does not take them away).
KUEUE_CONFIG=(crd rbac webhook)

log() { printf '[build-binaries] %s\n' "$*" >&2; }
die() { printf '[build-binaries] ERROR: %s\n' "$*" >&2; exit 1; }
# shellcheck source=lib/build-common.sh disable=SC1091
source "${HACK_DIR}/lib/build-common.sh"

kueue_built() { [[ -x "${KUEUE_DIR}/bin/kueue" && -f "${KUEUE_DIR}/config/.complete" ]]; }
is_built() { have_all "${BINARIES[@]}" && kueue_built; }
[[ ${1:-} == --print-kueue-dir ]] && { echo "${KUEUE_DIR}"; exit 0; }
parse_build_args 2,19 "$@"

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

# Kueue: `go install sigs.k8s.io/kueue/cmd/kueue@version` (no replace directives), its version
# stamped in; then the module's config/components/{crd,rbac,webhook} copied beside it.
build_kueue() {
  [[ ${FORCE} -eq 1 ]] || ! kueue_built || return 0
  local m=sigs.k8s.io/kueue c t src
  mkdir -p "${KUEUE_DIR}/bin"
  if [[ ${FORCE} -eq 1 ]] || [[ ! -x "${KUEUE_DIR}/bin/kueue" ]]; then
    LDFLAGS_EXTRA="-X ${m}/pkg/version.GitVersion=${KUEUE_VERSION} -X ${m}/pkg/version.GitCommit=${KUEUE_VERSION}" \
      go_install kueue "${KUEUE_VERSION}" "~15 min of CPU: ~8 min on an idle 2-core machine" "${KUEUE_DIR}/bin" "${m}/cmd/kueue"
  fi
  t=${SECONDS}
  log "copying Kueue ${KUEUE_VERSION}'s manifests (${KUEUE_CONFIG[*]})..."
  src=$(cd "${WORK_DIR}" && GOFLAGS='' retry "${GO}" mod download -json "${m}@${KUEUE_VERSION}" \
    | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p') \
    || die "downloading ${m}@${KUEUE_VERSION} from the module proxy failed"
  [[ -d "${src}/config/components" ]] || die "no config/components in ${m}@${KUEUE_VERSION} (${src})"
  rm -rf "${KUEUE_DIR}/config"
  mkdir -p "${KUEUE_DIR}/config"
  for c in "${KUEUE_CONFIG[@]}"; do
    cp -R "${src}/config/components/${c}" "${KUEUE_DIR}/config/${c}"
  done
  chmod -R u+w "${KUEUE_DIR}/config"
  touch "${KUEUE_DIR}/config/.complete"
  step_done "${t}"
}

build_etcd
build_kwok
build_helm
build_kubernetes "first run only, ~15-30 min on 2 cores" \
  kube-apiserver kube-controller-manager kube-scheduler kubectl
build_kueue
finish_build binaries
