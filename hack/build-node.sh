#!/usr/bin/env bash
# Build the binaries of one real Kubernetes node from pinned sources through the Go
# module proxy: kubelet and kube-proxy (the control plane's Kubernetes release),
# containerd + ctr + containerd-shim-runc-v2, the CNI plugins bridge, host-local,
# loopback and portmap, CoreDNS, and kube-network-policies (the NetworkPolicy enforcer).
# runc, iptables, conntrack, nft and the node tier's static busybox come from Debian's packages
# (NODE_HOST_NEEDS in hack/lib/build-common.sh; runc needs cgo and libseccomp): apt-get
# installs them when they are missing and we are root.
#
# Versions live in hack/versions.env. Binaries go into a cache keyed by those versions:
#   ${DILOCO_NODE_CACHE:-$HOME/.cache/diloco-operator/node}/<k8s>-<containerd>-<cni>-<coredns>/bin
# (CNI plugins in .../cni/; the enforcer in .../network-policies/<its version>/, linked from
# bin/kube-network-policies, so bumping its version rebuilds it alone). When every binary is
# already there the script returns at once.
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
# The enforcer's file is keyed by its version and our patch's revision (build_network_policies).
NETPOL_KEY="${KUBE_NETWORK_POLICIES_VERSION}-xt1"
NETPOL_BIN="network-policies/${NETPOL_KEY}/kube-network-policies"
BINARIES=(kubelet kube-proxy containerd ctr containerd-shim-runc-v2 coredns pause
  cni/bridge cni/host-local cni/loopback cni/portmap "${NETPOL_BIN}" kube-network-policies)
log() { printf '[build-node] %s\n' "$*" >&2; }
die() { printf '[build-node] ERROR: %s\n' "$*" >&2; exit 1; }
# shellcheck source=lib/build-common.sh disable=SC1091
source "${HACK_DIR}/lib/build-common.sh"
# Host tools from Debian's packages (NODE_HOST_NEEDS, hack/lib/build-common.sh).
HOST_TOOLS=("${NODE_HOST_NEEDS[@]}")

have_host_tools() { [[ -z "$(missing_tools "${HOST_TOOLS[@]}")" ]]; }
is_built() { have_all "${BINARIES[@]}" && have_host_tools; }
parse_build_args 2,20 "$@"

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

# kube-network-policies: enforces standard NetworkPolicy on the node. Packets of a new
# connection to or from a pod are queued to it (nfqueue) from an nftables table it writes
# itself over netlink (github.com/google/nftables), and it answers accept or drop after
# evaluating the policies that select either end. Its rules use nftables' `queue` statement,
# which needs the kernel's nft_queue (CONFIG_NFT_QUEUE); the kernels of this project's machines
# lack it (the rule is refused with "netlink receive: no such file or directory") but have
# xtables' NFQUEUE target and nft_compat, which queue to the same nfnetlink_queue with the same
# number and bypass flag. So the enforcer is built against a copy of its google/nftables with
# one change: a Queue expression is sent as the compat target NFQUEUE (revision 3) instead of
# nft_queue. Nothing of its policy evaluation changes. The rest is `go build` through a
# wrapper module, like the Kubernetes binaries.
build_network_policies() {
  needs_build "${NETPOL_BIN}" kube-network-policies || return 0
  local t=${SECONDS} dir="${WORK_DIR}/network-policies" m=sigs.k8s.io/kube-network-policies
  local modfile nft_version nft_src
  log "building kube-network-policies ${KUBE_NETWORK_POLICIES_VERSION} (first run only; ~15 min on 2 busy cores)..."
  mkdir -p "${dir}"
  modfile=$(cd "${dir}" && GOFLAGS='' retry "${GO}" mod download -json "${m}@${KUBE_NETWORK_POLICIES_VERSION}" \
    | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p') \
    || die "downloading ${m}@${KUBE_NETWORK_POLICIES_VERSION} from the module proxy failed"
  [[ -f "${modfile}" ]] || die "could not locate go.mod of ${m}@${KUBE_NETWORK_POLICIES_VERSION}"
  nft_version=$(sed -n 's#^[[:space:]]*github.com/google/nftables \(v[^[:space:]]*\).*#\1#p' "${modfile}")
  [[ -n "${nft_version}" ]] || die "${modfile} requires no github.com/google/nftables"
  nft_src=$(cd "${dir}" && GOFLAGS='' retry "${GO}" mod download -json "github.com/google/nftables@${nft_version}" \
    | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p') \
    || die "downloading github.com/google/nftables@${nft_version} failed"
  [[ -d "${nft_src}" ]] || die "could not locate the source of github.com/google/nftables@${nft_version}"
  cp -r "${nft_src}" "${dir}/nftables"
  chmod -R u+w "${dir}/nftables"
  sed -i 's/^func (e \*Queue) marshal(fam byte)/func (e *Queue) marshalNftQueue(fam byte)/' \
    "${dir}/nftables/expr/queue.go"
  grep -q '^func (e \*Queue) marshalNftQueue(fam byte)' "${dir}/nftables/expr/queue.go" \
    || die "github.com/google/nftables@${nft_version}: expr/queue.go has no Queue.marshal to patch"
  cat > "${dir}/nftables/expr/queue_xtables.go" <<'GO'
package expr

// Patched in by diloco-operator's hack/build-node.sh: the queue expression as xtables' NFQUEUE
// target (nft_compat) for kernels without nft_queue. xt_NFQ_info_v3 is {queuenum, queues_total,
// flags} as native-endian u16, padded to 8 bytes; its flags have nft_queue's values (1 bypass,
// 2 cpu fanout).

import (
	"encoding/binary"

	"github.com/google/nftables/xt"
)

func (e *Queue) marshal(fam byte) ([]byte, error) {
	total := e.Total
	if total == 0 {
		total = 1
	}
	info := make(xt.Unknown, 8)
	binary.NativeEndian.PutUint16(info[0:], e.Num)
	binary.NativeEndian.PutUint16(info[2:], total)
	binary.NativeEndian.PutUint16(info[4:], uint16(e.Flag&(QueueFlagBypass|QueueFlagFanout)))
	return (&Target{Name: "NFQUEUE", Rev: 3, Info: &info}).marshal(fam)
}
GO
  printf 'module diloco.local/build/kube-network-policies\n\ngo 1.26\n\nrequire %s %s\n\nreplace github.com/google/nftables => ./nftables\n' \
    "${m}" "${KUBE_NETWORK_POLICIES_VERSION}" > "${dir}/go.mod"
  (
    cd "${dir}"
    GOFLAGS=-mod=mod retry "${GO}" build -trimpath -ldflags="-s -w" \
      -o "${STAGE_DIR}/kube-network-policies" "${m}/cmd"
  ) || die "building kube-network-policies ${KUBE_NETWORK_POLICIES_VERSION} failed (see the go output above)"
  mkdir -p "${BIN_DIR}/network-policies/${NETPOL_KEY}"
  install_staged "${BIN_DIR}/network-policies/${NETPOL_KEY}" kube-network-policies
  ln -sfn "${NETPOL_BIN}" "${BIN_DIR}/kube-network-policies"
  step_done "${t}"
}

install_host_tools
build_pause
build_cni
build_containerd
build_coredns
build_network_policies
# kubelet and kube-proxy: the control plane's wrapper go.mod (hack/lib/build-common.sh).
build_kubernetes "first run only; ~5-10 min after build-binaries.sh, ~20 min cold" \
  kubelet kube-proxy
finish_build "node binaries"
