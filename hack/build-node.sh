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

have_host_tools() { [[ -z "$(missing_tools "${HOST_TOOLS[@]}")" ]]; }
is_built() { have_all "${BINARIES[@]}" && have_host_tools; }
parse_build_args 2,17 "$@"

# install_host_tools: runc, iptables, conntrack, iproute2 and busybox-static from Debian.
install_host_tools() { install_debian_tools "${HOST_TOOLS[@]}"; }

# Fast path: every binary cached (the host tools are installed if missing).
if [[ ${FORCE} -eq 0 ]] && have_all "${BINARIES[@]}"; then
  install_host_tools
  echo "${BIN_DIR}"
  exit 0
fi

# ---------------------------------------------------------------------------
# Toolchain, the cache entry's lock and the work dir (hack/lib/build-common.sh)
find_go
take_build_lock "${OUT_DIR}" "${CACHE_KEY}"
if [[ ${FORCE} -eq 0 ]] && have_all "${BINARIES[@]}"; then
  install_host_tools
  echo "${BIN_DIR}"
  exit 0
fi

# Static binaries like the control plane's (and the same Go build cache entries).
begin_work_dir
mkdir -p "${CNI_DIR}"

# containerd, the CNI plugins and CoreDNS: `go install pkg@version` (no replace directives).
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

install_host_tools
build_pause
build_cni
build_containerd
build_coredns
# kubelet and kube-proxy: the control plane's wrapper go.mod (hack/lib/build-common.sh).
build_kubernetes "first run only; ~5-10 min after build-binaries.sh, ~20 min cold" \
  kubelet kube-proxy
finish_build "node binaries"
