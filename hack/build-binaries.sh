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

have_all() {
  local b
  for b in "$@"; do
    [[ -x "${BIN_DIR}/${b}" ]] || return 1
  done
}

FORCE=0
case "${1:-}" in
  --print-bin-dir) echo "${BIN_DIR}"; exit 0 ;;
  --check) have_all "${BINARIES[@]}"; exit $? ;;
  --force) FORCE=1 ;;
  "") ;;
  -h|--help) sed -n '2,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) die "unknown argument: $1 (try --help)" ;;
esac

# Fast path: everything cached.
if [[ ${FORCE} -eq 0 ]] && have_all "${BINARIES[@]}"; then
  echo "${BIN_DIR}"
  exit 0
fi

# ---------------------------------------------------------------------------
# Toolchain and the cache entry's lock (hack/lib/build-common.sh)
find_go
take_build_lock "${OUT_DIR}" "${CACHE_KEY}"
if [[ ${FORCE} -eq 0 ]] && have_all "${BINARIES[@]}"; then
  echo "${BIN_DIR}"
  exit 0
fi

WORK_DIR=$(mktemp -d "${OUT_DIR}/build.XXXXXX")
cleanup() { rm -rf "${WORK_DIR}"; }
trap cleanup EXIT
STAGE_DIR="${WORK_DIR}/out"
mkdir -p "${STAGE_DIR}" "${BIN_DIR}"

export CGO_ENABLED=0
# Never pick up a go.work or go.mod from the caller's directory.
export GOWORK=off
START_ALL=${SECONDS}

# install_staged NAME...: move freshly built binaries into the cache atomically.
install_staged() {
  local b
  for b in "$@"; do
    [[ -x "${STAGE_DIR}/${b}" ]] || die "build did not produce ${b}"
    mv -f "${STAGE_DIR}/${b}" "${BIN_DIR}/${b}"
  done
}

needs_build() {
  [[ ${FORCE} -eq 1 ]] && return 0
  ! have_all "$@"
}

step_done() {
  log "  done in $(( SECONDS - $1 ))s"
}

# retry CMD...: run a go command, once more if it fails (module proxy hiccups); the Go
# build cache keeps what was compiled, so the second try resumes where the first stopped.
retry() {
  "$@" && return 0
  log "  failed; retrying once..."
  "$@"
}

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
  install_staged etcd
  step_done "${t}"
}

# ---------------------------------------------------------------------------
# Kubernetes: k8s.io/kubernetes points its staging modules at ./staging/..., which
# a dependent module cannot see. The wrapper go.mod replaces each of them with the
# published k8s.io/<name> module of the matching version.
build_kubernetes() {
  local bins=(kube-apiserver kube-controller-manager kube-scheduler kubectl)
  needs_build "${bins[@]}" || return 0
  local t=${SECONDS} dir="${WORK_DIR}/kubernetes" modfile staging minor ldflags pkgs=() b
  log "building kube-apiserver, kube-controller-manager, kube-scheduler, kubectl ${K8S_VERSION} (first run only, ~15-30 min on 2 cores)..."
  mkdir -p "${dir}"
  modfile=$(cd "${dir}" && GOFLAGS='' retry "${GO}" mod download -json "k8s.io/kubernetes@${K8S_VERSION}" \
    | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p') \
    || die "downloading k8s.io/kubernetes@${K8S_VERSION} from the module proxy failed"
  [[ -f "${modfile}" ]] || die "could not locate go.mod of k8s.io/kubernetes@${K8S_VERSION}"
  staging=$(sed -n 's#^[[:space:]]*\(k8s\.io/[A-Za-z0-9._-]*\) => \./staging/.*#\1#p' "${modfile}")
  [[ -n "${staging}" ]] || die "found no staging replace directives in ${modfile}"
  {
    echo "module diloco.local/build/kubernetes"
    echo
    echo "go 1.26"
    echo
    echo "require k8s.io/kubernetes ${K8S_VERSION}"
    echo
    echo "replace ("
    local m
    for m in ${staging}; do
      echo "	${m} => ${m} ${K8S_STAGING_VERSION}"
    done
    echo ")"
  } > "${dir}/go.mod"

  minor=${K8S_VERSION#v*.}
  minor=${minor%%.*}
  ldflags="-s -w"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X ${pkg}.gitVersion=${K8S_VERSION} -X ${pkg}.gitMajor=1 -X ${pkg}.gitMinor=${minor}"
    ldflags+=" -X ${pkg}.gitTreeState=clean -X ${pkg}.gitCommit=${K8S_VERSION}"
  done
  for b in "${bins[@]}"; do
    pkgs+=("k8s.io/kubernetes/cmd/${b}")
  done
  (
    cd "${dir}"
    GOFLAGS=-mod=mod retry "${GO}" build -trimpath -ldflags="${ldflags}" -o "${STAGE_DIR}/" "${pkgs[@]}"
  ) || die "building Kubernetes ${K8S_VERSION} failed (see the go output above)"
  install_staged "${bins[@]}"
  step_done "${t}"
}

# ---------------------------------------------------------------------------
# go install module/cmd/x@version for modules without replace directives.
go_install() {
  local name=$1 pkg=$2 version=$3 estimate=$4 ldflags=${5:-}
  needs_build "${name}" || return 0
  local t=${SECONDS}
  log "building ${name} ${version} (first run only, ${estimate})..."
  (
    cd "${WORK_DIR}"
    GOFLAGS='' GOBIN="${STAGE_DIR}" retry "${GO}" install -trimpath -ldflags="-s -w ${ldflags}" "${pkg}@${version}"
  ) || die "building ${name} ${version} failed (see the go output above)"
  install_staged "${name}"
  step_done "${t}"
}

build_etcd
go_install kwok sigs.k8s.io/kwok/cmd/kwok "${KWOK_VERSION}" "~3-5 min"
go_install helm helm.sh/helm/v3/cmd/helm "${HELM_VERSION}" "~3-5 min" \
  "-X helm.sh/helm/v3/internal/version.version=${HELM_VERSION}"
build_kubernetes

have_all "${BINARIES[@]}" || die "some binaries are missing from ${BIN_DIR} after the build"
cp "${HACK_DIR}/versions.env" "${OUT_DIR}/versions.env"
log "all binaries built in $(( SECONDS - START_ALL ))s"
echo "${BIN_DIR}"
