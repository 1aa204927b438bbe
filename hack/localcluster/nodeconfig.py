"""The real node's configuration files and API objects, as pure functions of its paths and ports.

Everything the node writes lives under DIR/node (NodePaths), so `down` can find and remove it:
containerd's root, state and socket, runc's state, the CNI config and IP allocations, the
kubelet's root dir and pod logs. JSON is written where the reader accepts YAML (kubelet and
kube-proxy configs), TOML for containerd.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .settings import (
    CLUSTER_DNS_IP,
    CLUSTER_DOMAIN,
    NODE_BRIDGE,
    NODE_LABEL,
    NODE_NAME,
    NODE_POD_CIDR,
    NODE_TAINT_KEY,
    PAUSE_IMAGE,
)

# Kubelet and runc create the pods' cgroups below this, in every cgroup hierarchy; `down`
# removes the tree. One real node per machine (iptables and port 53 are machine-wide too).
CGROUP_ROOT = "/diloco-real-node"


@dataclass(frozen=True)
class NodePaths:
    """Where the node's files go (all under DIR/node)."""

    root: Path

    @property
    def containerd_root(self) -> Path:
        return self.root / "containerd" / "root"

    @property
    def containerd_state(self) -> Path:
        return self.root / "containerd" / "state"

    @property
    def containerd_config(self) -> Path:
        return self.root / "containerd" / "config.toml"

    @property
    def socket(self) -> Path:
        # Unix socket paths are limited to 108 bytes: keep this one short.
        return self.root / "ctrd.sock"

    @property
    def runc_root(self) -> Path:
        return self.root / "runc"

    @property
    def cni_conf_dir(self) -> Path:
        return self.root / "cni" / "net.d"

    @property
    def cni_data_dir(self) -> Path:
        return self.root / "cni" / "ipam"

    @property
    def kubelet_root(self) -> Path:
        return self.root / "kubelet"

    @property
    def kubelet_config(self) -> Path:
        return self.root / "kubelet-config.yaml"

    @property
    def pod_logs(self) -> Path:
        return self.root / "pod-logs"

    @property
    def kube_proxy_config(self) -> Path:
        return self.root / "kube-proxy-config.yaml"

    @property
    def corefile(self) -> Path:
        return self.root / "Corefile"

    def kubeconfig(self, user: str) -> Path:
        return self.root / f"{user}.kubeconfig"


def containerd_toml(paths: NodePaths, bin_dir: Path, runc: str, stream_port: int) -> str:
    """containerd 2.4 (config version 4): own root, state and socket; CRI with the local pause
    image, runc with cgroupfs (cgroup v1 here) and its state under DIR/node/runc, CNI config
    and plugins from our dirs, netns mounts under the state dir instead of /var/run/netns."""
    cri_rt = "plugins.'io.containerd.cri.v1.runtime'"
    runc_rt = f"{cri_rt}.containerd.runtimes.runc"
    return f"""version = 4
root = "{paths.containerd_root}"
state = "{paths.containerd_state}"
# NRI would listen on /var/run/nri/nri.sock, machine-wide; the rest only warn without cgo.
disabled_plugins = ["io.containerd.nri.v1.nri", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.erofs", "io.containerd.differ.v1.erofs",
  "io.containerd.mount-handler.v1.erofs"]

[plugins.'io.containerd.server.v1.grpc']
  address = "{paths.socket}"

[plugins.'io.containerd.server.v1.ttrpc']
  address = "{paths.socket}.ttrpc"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{PAUSE_IMAGE}"

[{cri_rt}]
  netns_mounts_under_state_dir = true
  # No CAP_SYS_RESOURCE in this VM's root: negative oom_score_adj (pause -998, Guaranteed
  # pods -997) cannot be written; clamp to containerd's own instead of failing the sandbox.
  restrict_oom_score_adj = true
  enable_unprivileged_ports = true
  enable_unprivileged_icmp = true
  [{cri_rt}.containerd]
    default_runtime_name = "runc"
  [{runc_rt}]
    runtime_type = "io.containerd.runc.v2"
  [{runc_rt}.options]
    BinaryName = "{runc}"
    Root = "{paths.runc_root}"
    SystemdCgroup = false
  [{cri_rt}.cni]
    bin_dirs = ["{bin_dir / "cni"}"]
    conf_dir = "{paths.cni_conf_dir}"
    max_conf_num = 1

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "{stream_port}"
"""


def cni_conflist(paths: NodePaths) -> dict[str, Any]:
    """bridge + host-local (allocations under DIR/node) + portmap; masquerade leaving the
    pod range, the bridge as the pods' gateway (hairpin: a pod reaches itself via a Service)."""
    return {
        "cniVersion": "1.0.0",
        "name": "diloco-real-node",
        "plugins": [
            {
                "type": "bridge",
                "bridge": NODE_BRIDGE,
                "isGateway": True,
                "ipMasq": True,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "dataDir": str(paths.cni_data_dir),
                    "ranges": [[{"subnet": NODE_POD_CIDR}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def kubelet_config(
    paths: NodePaths, node_ip: str, ports: dict[str, int], ca_file: Path
) -> dict[str, Any]:
    """The KubeletConfiguration. cgroup v1 needs failCgroupV1: false (1.35+); cgroupfs
    because no systemd runs here; the node registers tainted so only pods that tolerate
    NODE_TAINT_KEY land on it (kwok-only tests never see it)."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": CGROUP_ROOT,
        "cgroupsPerQOS": True,
        "failSwapOn": False,
        "containerRuntimeEndpoint": f"unix://{paths.socket}",
        "address": node_ip,
        "port": ports["kubelet"],
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": ports["kubelet_healthz"],
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": False},
            "x509": {"clientCAFile": str(ca_file)},
        },
        "authorization": {"mode": "AlwaysAllow"},
        "clusterDNS": [CLUSTER_DNS_IP],
        "clusterDomain": CLUSTER_DOMAIN,
        "resolvConf": "/etc/resolv.conf",
        "podLogsDir": str(paths.pod_logs),
        "registerWithTaints": [{"key": NODE_TAINT_KEY, "value": "true", "effect": "NoSchedule"}],
        "serializeImagePulls": False,
        # A shared development disk: never evict or garbage-collect images for space.
        "evictionHard": {"memory.available": "50Mi", "nodefs.available": "1%"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "nodeStatusReportFrequency": "10s",
        "syncFrequency": "10s",
        "fileCheckFrequency": "10s",
        "maxPods": 30,
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
    }


def kubelet_labels() -> str:
    # Not node-role.kubernetes.io/*: a kubelet may not set labels under kubernetes.io itself.
    return f"{NODE_LABEL}=true"


def kube_proxy_config(paths: NodePaths, ports: dict[str, int]) -> dict[str, Any]:
    """iptables mode; conntrack sysctls left alone (0 = do not touch) since the VM's are
    fine and not ours to change; NodePorts on the node's own IPs only (not on localhost, which
    would need route_localnet=1 machine-wide)."""
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(paths.kubeconfig("kube-proxy"))},
        "hostnameOverride": NODE_NAME,
        "mode": "iptables",
        "clusterCIDR": NODE_POD_CIDR,
        "nodePortAddresses": ["primary"],
        "healthzBindAddress": f"127.0.0.1:{ports['kube_proxy_healthz']}",
        "metricsBindAddress": f"127.0.0.1:{ports['kube_proxy_metrics']}",
        "conntrack": {
            "maxPerCore": 0,
            "min": 0,
            "tcpEstablishedTimeout": "0s",
            "tcpCloseWaitTimeout": "0s",
        },
    }


def corefile(paths: NodePaths, node_ip: str, ports: dict[str, int]) -> str:
    """CoreDNS on the node's IP, port 53 (the kube-dns Service points there): cluster.local
    from the API server, the rest forwarded to the host's resolvers."""
    return f""".:53 {{
    bind {node_ip}
    errors
    health 127.0.0.1:{ports["coredns_health"]}
    ready 127.0.0.1:{ports["coredns_ready"]}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {paths.kubeconfig("coredns")}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    forward . /etc/resolv.conf
    cache 30
}}
"""


def dump(obj: dict[str, Any]) -> str:
    """JSON, which the kubelet and kube-proxy read as YAML."""
    return json.dumps(obj, indent=2) + "\n"


def coredns_rbac() -> list[tuple[str, dict[str, Any]]]:
    """(collection path, object): what CoreDNS's kubernetes plugin reads, for system:coredns."""
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": "diloco:coredns"},
        "rules": [
            {
                "apiGroups": [""],
                "resources": ["services", "pods", "namespaces"],
                "verbs": ["list", "watch"],
            },
            {
                "apiGroups": ["discovery.k8s.io"],
                "resources": ["endpointslices"],
                "verbs": ["list", "watch"],
            },
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": "diloco:coredns"},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": "diloco:coredns",
        },
        "subjects": [
            {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "system:coredns"}
        ],
    }
    base = "/apis/rbac.authorization.k8s.io/v1"
    return [(f"{base}/clusterroles", role), (f"{base}/clusterrolebindings", binding)]


def kube_dns_objects(node_ip: str) -> list[tuple[str, dict[str, Any]]]:
    """The kube-dns Service at CLUSTER_DNS_IP (no selector: CoreDNS is a host process) and
    its EndpointSlice pointing at the node's IP, port 53."""
    ports = [
        {"name": "dns", "port": 53, "protocol": "UDP"},
        {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
    ]
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": "kube-dns",
            "namespace": "kube-system",
            "labels": {"k8s-app": "kube-dns"},
        },
        "spec": {"clusterIP": CLUSTER_DNS_IP, "ports": [{**p, "targetPort": 53} for p in ports]},
    }
    slice_ = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "kube-dns-host",
            "namespace": "kube-system",
            "labels": {
                "kubernetes.io/service-name": "kube-dns",
                "endpointslice.kubernetes.io/managed-by": "local-cluster.diloco.dev",
            },
        },
        "addressType": "IPv4",
        "endpoints": [
            {"addresses": [node_ip], "conditions": {"ready": True}, "nodeName": NODE_NAME}
        ],
        "ports": ports,
    }
    return [
        ("/api/v1/namespaces/kube-system/services", service),
        ("/apis/discovery.k8s.io/v1/namespaces/kube-system/endpointslices", slice_),
    ]
