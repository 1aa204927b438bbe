"""Paths, names and deadlines of the local control plane (the only place they are written)."""

from __future__ import annotations

import os
from pathlib import Path

HACK_DIR = Path(__file__).resolve().parent.parent
ENTRY_POINT = HACK_DIR / "local-cluster"
BUILD_SCRIPT = HACK_DIR / "build-binaries.sh"
NODE_BUILD_SCRIPT = HACK_DIR / "build-node.sh"
KWOK_STAGES = HACK_DIR / "kwok-stages.yaml"
BINARIES = [
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "kwok",
]
# Start order; stop order is the reverse.
COMPONENTS = ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"]
# The ports state.json records, one per listener.
PORT_KEYS = ["etcd", "etcd_peer", "apiserver", "controller_manager", "scheduler", "kwok"]
# The real node's NetworkPolicy enforcer (kube-network-policies, netpolicy.py): its process name.
NETWORK_POLICIES = "network-policies"
# The real node (`up --real-node`): its processes in start order (stopped before COMPONENTS).
# `status` lists them, a reused cluster needs them all running, a start fails when one dies.
NODE_COMPONENTS = ["containerd", "coredns", "kubelet", "kube-proxy", NETWORK_POLICIES]
NODE_BINARIES = [
    "kubelet",
    "kube-proxy",
    "containerd",
    "ctr",
    "containerd-shim-runc-v2",
    "coredns",
    "pause",
    "cni/bridge",
    "cni/host-local",
    "cni/loopback",
    "cni/portmap",
]
NODE_NAME = "real-node-0"
# Outside kwok's POD_CIDR, whose fake pod IPs never carry traffic.
NODE_POD_CIDR = "10.245.0.0/24"
NODE_BRIDGE = "dlc-node0"
# Pods tolerate this to run on the real node; the kwok-only tests never see it.
NODE_TAINT_KEY = "diloco.dev/real-node"
NODE_LABEL = "diloco.dev/real-node"
CLUSTER_DNS_IP = "10.96.0.10"
CLUSTER_DOMAIN = "cluster.local"
PAUSE_IMAGE = "localhost/diloco/pause:1"
SERVICE_CIDR = "10.96.0.0/16"
SERVICE_FIRST_IP = "10.96.0.1"
POD_CIDR = "10.244.0.0/16"
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
STATE_FILE = "state.json"
# Ports chosen by any local-cluster on this machine, kept out of other picks for a while.
PORT_LEASE_FILE = Path("/tmp/diloco-local-cluster-ports.json")
PORT_LEASE_SECONDS = 900

# Deadlines (seconds) for each wait; generous because CI machines have 2 cores.
ETCD_TIMEOUT = 60
APISERVER_TIMEOUT = 180
COMPONENT_TIMEOUT = 120
NODES_TIMEOUT = 120
SA_TIMEOUT = 120
NODE_TIMEOUT = 240  # containerd, kubelet registration and Ready, CoreDNS, kube-proxy
DRAIN_TIMEOUT = 90  # `down`: the kubelet stopping the node's pods
# `up` as a whole: attempts, overall deadline, and the least time worth another attempt.
UP_ATTEMPTS = 3
UP_TIMEOUT = 900
MIN_ATTEMPT_SECONDS = 60


def default_dir() -> Path:
    return Path(os.environ.get("TMPDIR") or "/tmp") / "diloco-local-cluster"
