#!/usr/bin/env bash
# Build the binaries of one real Kubernetes node from pinned sources through the Go
# module proxy: kubelet and kube-proxy (the control plane's Kubernetes release),
# containerd + ctr + containerd-shim-runc-v2, the CNI plugins bridge, host-local,
# loopback and portmap, and CoreDNS. runc, iptables, conntrack and the node tier's static
# busybox come from Debian's packages (NODE_HOST_NEEDS in hack/lib/build-common.sh; runc needs
# cgo and libseccomp): apt-get installs them when they are missing and we are root.
#
# Versions live in hack/versions.env. Binaries go into a cache keyed by those versions:
#   ${DILOCO_NODE_CACHE:-$HOME/.cache/diloco-operator/node}/<k8s>-<containerd>-<cni>-<coredns>/bin
# (CNI plugins in .../cni/). When every binary is already there the script returns at once.
#
# Usage:
#   hack/build-node.sh                  build if needed; print the bin dir as last line
#   hack/build-node.sh --print-bin-dir  print the bin dir only (builds nothing)
#   hack/build-node.sh --check          exit 0 if every binary and host tool is there, 1 otherwise
#   hack/build-node.sh --force          rebuild everything
set -euo pipefail

HACK_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=versions.env disable=SC1091
source "${HACK_DIR}/versions.env"

CACHE_ROOT=${DILOCO_NODE_CACHE:-${HOME:?neither DILOCO_NODE_CACHE nor HOME is set}/.cache/diloco-operator/node}
CACHE_KEY="${K8S_VERSION}-${CONTAINERD_VERSION}-${CNI_PLUGINS_VERSION}-${COREDNS_VERSION}"
OUT_DIR="${CACHE_ROOT}/${CACHE_KEY}"
BIN_DIR="${OUT_DIR}/bin"
CNI_DIR="${BIN_DIR}/cni"
BINARIES=(kubelet kube-proxy containerd ctr containerd-shim-runc-v2 coredns pause
  cni/bridge cni/host-local cni/loopback cni/portmap)
log() { printf '[build-node] %s\n' "$*" >&2; }
die() { printf '[build-node] ERROR: %s\n' "$*" >&2; exit 1; }
# shellcheck source=lib/build-common.sh disable=SC1091
source "${HACK_DIR}/lib/build-common.sh"
# Host tools from Debian's packages (NODE_HOST_NEEDS, hack/lib/build-common.sh).
HOST_TOOLS=("${NODE_HOST_NEEDS[@]}")

have_all() {
  local b
  for b in "$@"; do
    [[ -x "${BIN_DIR}/${b}" ]] || return 1
  done
}

have_host_tools() { [[ -z "$(missing_tools "${HOST_TOOLS[@]}")" ]]; }

FORCE=0
case "${1:-}" in
  --print-bin-dir) echo "${BIN_DIR}"; exit 0 ;;
  --check) have_all "${BINARIES[@]}" && have_host_tools; exit $? ;;
  --force) FORCE=1 ;;
  "") ;;
  -h|--help) sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) die "unknown argument: $1 (try --help)" ;;
esac

# install_host_tools: runc, iptables, conntrack, iproute2 and busybox-static from Debian.
install_host_tools() { install_debian_tools "${HOST_TOOLS[@]}"; }

# Fast path: everything cached.
if [[ ${FORCE} -eq 0 ]] && have_all "${BINARIES[@]}"; then
  install_host_tools
  echo "${BIN_DIR}"
  exit 0
fi

# ---------------------------------------------------------------------------
# Toolchain and the cache entry's lock (hack/lib/build-common.sh)
find_go
take_build_lock "${OUT_DIR}" "${CACHE_KEY}"
if [[ ${FORCE} -eq 0 ]] && have_all "${BINARIES[@]}"; then
  install_host_tools
  echo "${BIN_DIR}"
  exit 0
fi

WORK_DIR=$(mktemp -d "${OUT_DIR}/build.XXXXXX")
cleanup() { rm -rf "${WORK_DIR}"; }
trap cleanup EXIT
STAGE_DIR="${WORK_DIR}/out"
mkdir -p "${STAGE_DIR}" "${BIN_DIR}" "${CNI_DIR}"

# Static binaries like the control plane's (and the same Go build cache entries).
export CGO_ENABLED=0
export GOWORK=off
START_ALL=${SECONDS}

# install_staged DEST NAME...: move freshly built binaries into the cache atomically.
install_staged() {
  local dest=$1 b
  shift
  for b in "$@"; do
    [[ -x "${STAGE_DIR}/${b}" ]] || die "build did not produce ${b}"
    mv -f "${STAGE_DIR}/${b}" "${dest}/${b}"
  done
}

needs_build() {
  [[ ${FORCE} -eq 1 ]] && return 0
  ! have_all "$@"
}

step_done() {
  log "  done in $(( SECONDS - $1 ))s"
}

retry() {
  "$@" && return 0
  log "  failed; retrying once..."
  "$@"
}

# go_install NAME VERSION ESTIMATE DEST PKG...: `go install pkg@version` for modules
# without replace directives (containerd, the CNI plugins and CoreDNS have none).
go_install() {
  local name=$1 version=$2 estimate=$3 dest=$4 t=${SECONDS} p bins=()
  shift 4
  log "building ${name} ${version} (first run only, ${estimate})..."
  for p in "$@"; do
    (
      cd "${WORK_DIR}"
      GOFLAGS='' GOBIN="${STAGE_DIR}" retry "${GO}" install -trimpath -ldflags="-s -w ${LDFLAGS_EXTRA:-}" "${p}@${version}"
    ) || die "building ${p}@${version} failed (see the go output above)"
    bins+=("${p##*/}")
  done
  install_staged "${dest}" "${bins[@]}"
  step_done "${t}"
}

build_containerd() {
  needs_build containerd ctr containerd-shim-runc-v2 || return 0
  local m=github.com/containerd/containerd/v2
  LDFLAGS_EXTRA="-X ${m}/version.Version=${CONTAINERD_VERSION} -X ${m}/version.Package=${m}" \
    go_install containerd "${CONTAINERD_VERSION}" "~3-6 min" "${BIN_DIR}" \
    "${m}/cmd/containerd" "${m}/cmd/ctr" "${m}/cmd/containerd-shim-runc-v2"
}

build_cni() {
  needs_build cni/bridge cni/host-local cni/loopback cni/portmap || return 0
  local m=github.com/containernetworking/plugins/plugins
  go_install "CNI plugins" "${CNI_PLUGINS_VERSION}" "~1-3 min" "${CNI_DIR}" \
    "${m}/main/bridge" "${m}/ipam/host-local" "${m}/main/loopback" "${m}/meta/portmap"
}

build_coredns() {
  needs_build coredns || return 0
  go_install coredns "${COREDNS_VERSION}" "~3-6 min" "${BIN_DIR}" github.com/coredns/coredns
}

# pause: the pod sandbox's process. There is no registry to pull registry.k8s.io/pause
# from, so a 20-line Go program stands in for it; `local-cluster up --real-node` wraps it
# into an OCI image and imports it into the node's containerd.
build_pause() {
  needs_build pause || return 0
  local t=${SECONDS} dir="${WORK_DIR}/pause"
  log "building pause (the pod sandbox process, a few seconds)..."
  mkdir -p "${dir}"
  printf 'module diloco.local/build/pause\n\ngo 1.26\n' > "${dir}/go.mod"
  cat > "${dir}/main.go" <<'GO'
// pause: PID 1 of every pod sandbox. Sleeps until SIGINT/SIGTERM and reaps the zombies
// of a shared process namespace, like registry.k8s.io/pause.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sig := make(chan os.Signal, 8)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range sig {
		if s != syscall.SIGCHLD {
			return
		}
		for {
			var ws syscall.WaitStatus
			if pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil); pid <= 0 || err != nil {
				break
			}
		}
	}
}
GO
  (cd "${dir}" && GOFLAGS='' "${GO}" build -trimpath -ldflags="-s -w" -o "${STAGE_DIR}/pause" .) \
    || die "building pause failed (see the go output above)"
  install_staged "${BIN_DIR}" pause
  step_done "${t}"
}

# Kubernetes: the same wrapper go.mod as hack/build-binaries.sh (k8s.io/kubernetes points
# its staging modules at ./staging/..., so each is replaced by its published version), so
# the Go module and build caches of the control plane's build are reused.
build_kubernetes() {
  local bins=(kubelet kube-proxy)
  needs_build "${bins[@]}" || return 0
  local t=${SECONDS} dir="${WORK_DIR}/kubernetes" modfile staging minor ldflags pkgs=() b m
  log "building kubelet, kube-proxy ${K8S_VERSION} (first run only; ~5-10 min after build-binaries.sh, ~20 min cold)..."
  mkdir -p "${dir}"
  modfile=$(cd "${dir}" && GOFLAGS='' retry "${GO}" mod download -json "k8s.io/kubernetes@${K8S_VERSION}" \
    | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p') \
    || die "downloading k8s.io/kubernetes@${K8S_VERSION} from the module proxy failed"
  [[ -f "${modfile}" ]] || die "could not locate go.mod of k8s.io/kubernetes@${K8S_VERSION}"
  staging=$(sed -n 's#^[[:space:]]*\(k8s\.io/[A-Za-z0-9._-]*\) => \./staging/.*#\1#p' "${modfile}")
  [[ -n "${staging}" ]] || die "found no staging replace directives in ${modfile}"
  {
    printf 'module diloco.local/build/kubernetes\n\ngo 1.26\n\nrequire k8s.io/kubernetes %s\n\nreplace (\n' "${K8S_VERSION}"
    for m in ${staging}; do
      printf '\t%s => %s %s\n' "${m}" "${m}" "${K8S_STAGING_VERSION}"
    done
    printf ')\n'
  } > "${dir}/go.mod"
  minor=${K8S_VERSION#v*.}
  minor=${minor%%.*}
  ldflags="-s -w"
  for m in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X ${m}.gitVersion=${K8S_VERSION} -X ${m}.gitMajor=1 -X ${m}.gitMinor=${minor}"
    ldflags+=" -X ${m}.gitTreeState=clean -X ${m}.gitCommit=${K8S_VERSION}"
  done
  for b in "${bins[@]}"; do
    pkgs+=("k8s.io/kubernetes/cmd/${b}")
  done
  (
    cd "${dir}"
    GOFLAGS=-mod=mod retry "${GO}" build -trimpath -ldflags="${ldflags}" -o "${STAGE_DIR}/" "${pkgs[@]}"
  ) || die "building kubelet/kube-proxy ${K8S_VERSION} failed (see the go output above)"
  install_staged "${BIN_DIR}" "${bins[@]}"
  step_done "${t}"
}

install_host_tools
build_pause
build_cni
build_containerd
build_coredns
build_kubernetes

have_all "${BINARIES[@]}" || die "some binaries are missing from ${BIN_DIR} after the build"
cp "${HACK_DIR}/versions.env" "${OUT_DIR}/versions.env"
log "all node binaries built in $(( SECONDS - START_ALL ))s"
echo "${BIN_DIR}"
