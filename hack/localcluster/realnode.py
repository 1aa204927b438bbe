"""`up --real-node`: one real node beside the kwok ones (containerd + runc, kubelet, kube-proxy
in iptables mode, CoreDNS as a host process behind the kube-dns Service, and the NetworkPolicy
enforcer kube-network-policies: netpolicy.py).

Host changes it makes, all recorded in state.json under "real_node" so `down` undoes them
(nodeteardown.py): sysctls (ip_forward, bridge-nf-call-iptables, and those the kubelet sets:
its kernel tunables, kube-proxy's route_localnet), a cgroup tree CGROUP_ROOT in every
hierarchy, the CNI bridge NODE_BRIDGE, iptables chains (kube-proxy's KUBE-*, CNI's CNI-*),
rules refusing un-DNATed traffic to the Service CIDR, the enforcer's nftables table, and a
machine-wide claim file (one real node
per machine: port 53 on the node's IP, iptables and the kubelet's cgroups are the machine's).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.error
from pathlib import Path
from typing import Any

from .components import budget, built_bin_dir, https_ok, insecure_ctx
from .errors import ClusterError, info
from .netpolicy import rbac_objects as network_policies_rbac
from .netpolicy import start_network_policies
from .nodeconfig import (
    CGROUP_ROOT,
    NodePaths,
    cni_conflist,
    containerd_toml,
    coredns_rbac,
    corefile,
    dump,
    kube_dns_objects,
    kube_proxy_config,
    kubelet_config,
    kubelet_labels,
)
from .objects import node_ready
from .ociimage import pause_image, write_archive
from .pki import kubeconfig_yaml
from .ports import pick_ports
from .processes import pid_matches, start_ticks, wait_for
from .settings import (
    NODE_BINARIES,
    NODE_BUILD_SCRIPT,
    NODE_NAME,
    NODE_TIMEOUT,
    PAUSE_IMAGE,
    SERVICE_CIDR,
)
from .state import Cluster

NODE_PORT_KEYS = [
    "kubelet",
    "kubelet_healthz",
    "kube_proxy_healthz",
    "kube_proxy_metrics",
    "coredns_health",
    "coredns_ready",
    "containerd_stream",
    "network_policies_metrics",
]
# Set by us (ip_forward: the pods' traffic to Services is routed back onto the bridge), by
# the kubelet (its kernel tunables) and by kube-proxy; restored by `down`.
SYSCTLS = [
    "net/ipv4/ip_forward",
    "net/bridge/bridge-nf-call-iptables",
    "net/ipv4/conf/all/route_localnet",
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
]
CLAIM_FILE = Path("/run/diloco-real-node.json")
HOST_TOOLS = ["runc", "iptables", "ip", "nft", "unshare"]
SERVICE_CIDR_COMMENT = "diloco real node: Service CIDR not DNATed by kube-proxy"


def resolve_node_bin_dir() -> Path:
    """hack/build-node.sh (at once when cached) or DILOCO_NODE_BIN_DIR: the node's bin dir."""
    return built_bin_dir(
        NODE_BUILD_SCRIPT, "DILOCO_NODE_BIN_DIR", NODE_BINARIES, "real node's binaries"
    )


def host_tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin")
    if found is None:
        raise ClusterError(
            f"the real node needs '{name}': `make node` (hack/build-node.sh) installs it "
            "from Debian"
        )
    return found


def preflight() -> None:
    """What no retry can fix: root, the host tools, cgroups, no other real node running."""
    if os.geteuid() != 0:
        raise ClusterError("--real-node needs root (containerd, runc, iptables, cgroups)")
    for tool in HOST_TOOLS:
        host_tool(tool)
    if not Path("/sys/fs/cgroup").is_dir():
        raise ClusterError("--real-node needs cgroups mounted under /sys/fs/cgroup")
    other = read_claim()
    if other and pid_matches(other["pid"], "", other.get("start"), check_exe=False):
        raise ClusterError(
            f"another real node is running (cluster {other['dir']}); one per machine: "
            f"`hack/local-cluster down --dir {other['dir']}` first"
        )


def read_claim() -> dict[str, Any] | None:
    try:
        return json.loads(CLAIM_FILE.read_text())
    except (OSError, ValueError):
        return None


def node_ip() -> str:
    """The source address of the default route: the kubelet's InternalIP and CoreDNS's."""
    out = subprocess.run(
        [host_tool("ip"), "-4", "-o", "route", "get", "1.1.1.1"], capture_output=True, text=True
    ).stdout.split()
    if "src" not in out:
        raise ClusterError("cannot find this machine's IPv4 address (`ip route get 1.1.1.1`)")
    return out[out.index("src") + 1]


def read_sysctl(key: str) -> str | None:
    try:
        return Path("/proc/sys", key).read_text().strip()
    except OSError:
        return None


def write_sysctl(key: str, value: str) -> None:
    try:
        Path("/proc/sys", key).write_text(value + "\n")
    except OSError as e:
        raise ClusterError(f"cannot set {key.replace('/', '.')}={value}: {e}") from e


def cgroup_dirs() -> list[Path]:
    """CGROUP_ROOT in every mounted hierarchy (v1 controllers, name=systemd, the cgroup2 one)."""
    base = Path("/sys/fs/cgroup")
    if (base / "cgroup.controllers").exists():  # pure cgroup v2
        return [base / CGROUP_ROOT.strip("/")]
    return [
        d / CGROUP_ROOT.strip("/")
        for d in sorted(base.iterdir())
        if d.is_dir() and not d.is_symlink()
    ]


def write_node_files(
    c: Cluster, paths: NodePaths, bin_dir: Path, ip: str, ports: dict[str, int]
) -> None:
    for d in (paths.containerd_root, paths.containerd_state, paths.runc_root, paths.cni_conf_dir):
        d.mkdir(parents=True, exist_ok=True)
    for d in (paths.cni_data_dir, paths.kubelet_root, paths.pod_logs):
        d.mkdir(parents=True, exist_ok=True)
    runc = host_tool("runc")
    paths.containerd_config.write_text(
        containerd_toml(paths, bin_dir, runc, ports["containerd_stream"])
    )
    (paths.cni_conf_dir / "10-diloco.conflist").write_text(dump(cni_conflist(paths)))
    paths.kubelet_config.write_text(dump(kubelet_config(paths, ip, ports, c.pki / "ca.crt")))
    paths.kube_proxy_config.write_text(dump(kube_proxy_config(paths, ports)))
    paths.corefile.write_text(corefile(paths, ip, ports))
    for user in ("kubelet", "kube-proxy", "coredns"):
        text = kubeconfig_yaml(
            c.state["name"], c.server, c.pki / "ca.crt", user,
            cert=c.pki / f"{user}.crt", key=c.pki / f"{user}.key",
        )  # fmt: skip
        paths.kubeconfig(user).write_text(text)
        os.chmod(paths.kubeconfig(user), 0o600)


def ctr(
    paths: NodePaths, bin_dir: Path, *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """`ctr` against the node's containerd, in the CRI's namespace (k8s.io)."""
    return subprocess.run(
        [str(bin_dir / "ctr"), "--address", str(paths.socket), "--namespace", "k8s.io", *args],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def import_image(paths: NodePaths, bin_dir: Path, archive: Path) -> str:
    """`ctr images import` of an OCI archive; the names it imported."""
    proc = ctr(paths, bin_dir, "images", "import", "--all-platforms", str(archive), timeout=600)
    if proc.returncode != 0:
        raise ClusterError(
            f"ctr images import {archive} failed: {proc.stderr.strip()[-800:]}", "containerd"
        )
    return proc.stdout.strip()


def node_env(bin_dir: Path) -> dict[str, str]:
    """containerd finds its shim on PATH; iptables and runc live in /usr/sbin."""
    path = os.environ.get("PATH", "/usr/bin:/bin")
    return {**os.environ, "PATH": f"{bin_dir}:{path}:/usr/sbin:/sbin"}


def create_objects(c: Cluster, objects: list[tuple[str, dict[str, Any]]]) -> None:
    for collection, obj in objects:
        try:
            c.api("POST", collection, obj)
        except urllib.error.HTTPError as e:
            if e.code != 409:
                raise ClusterError(
                    f"creating {obj['kind']} {obj['metadata']['name']} failed: "
                    f"HTTP {e.code} {e.read()[:300]!r}",
                    "kube-apiserver", retryable=True,
                ) from e  # fmt: skip


def service_cidr_rules() -> list[list[str]]:
    """iptables rules (chain and match, without -A/-D) that refuse traffic to the Service CIDR
    that kube-proxy did not DNAT.

    kube-proxy rewrites a ClusterIP to a pod's address before the filter table sees the packet,
    but only once it has programmed that Service; until then (seconds after a Service is made)
    a connection to the new ClusterIP followed the default route off the machine, and whatever
    answered there gave a learner's join at job start an HTTP 404 with an empty body. These
    rules make it fail at once with "no route to host", which the syncer client retries. (A
    route of type unreachable would also refuse the host's own traffic to programmed Services:
    the host routes before its OUTPUT DNAT.)"""
    match = ["-d", SERVICE_CIDR, "-m", "comment", "--comment", SERVICE_CIDR_COMMENT]
    reject = ["-j", "REJECT", "--reject-with", "icmp-host-unreachable"]
    return [[chain, *match, *reject] for chain in ("OUTPUT", "FORWARD")]


def prepare_host(c: Cluster) -> dict[str, Any]:
    """Claim the machine's real node, record then set the sysctls, make the cgroup root."""
    CLAIM_FILE.write_text(
        json.dumps({"dir": str(c.dir), "pid": os.getpid(), "start": start_ticks(os.getpid())})
    )
    record: dict[str, Any] = {"sysctls": {k: read_sysctl(k) for k in SYSCTLS}}
    c.state["real_node"] = record
    c.save()
    write_sysctl("net/ipv4/ip_forward", "1")
    if read_sysctl("net/bridge/bridge-nf-call-iptables") is None:
        raise ClusterError(
            "the kernel has no bridge netfilter (net.bridge.bridge-nf-call-iptables)"
        )
    write_sysctl("net/bridge/bridge-nf-call-iptables", "1")
    record["service_cidr_rules"] = service_cidr_rules()
    c.save()  # recorded first: `down` deletes only rules that exist
    for rule in record["service_cidr_rules"]:
        subprocess.run([host_tool("iptables"), "-A", *rule], check=True, capture_output=True)
    for d in cgroup_dirs():
        d.mkdir(exist_ok=True)
    return record


def wait_http(c: Cluster, name: str, url: str) -> None:
    """Wait until a component's plain-HTTP health URL answers 200."""
    what = f"{name} {url.rsplit('/', 1)[1]}"
    ctx = insecure_ctx()
    wait_for(
        what,
        lambda: https_ok(url, ctx),
        budget(c, NODE_TIMEOUT),
        component=name,
        alive=c.check_alive,
    )


def start_real_node(c: Cluster, bin_dir: Path) -> None:
    """Start containerd, CoreDNS, the kubelet and kube-proxy; return once the node is Ready
    and every component answers its health check."""
    preflight()
    paths = NodePaths(c.dir / "node")
    ip = c.state.get("advertise_address") or node_ip()  # the apiserver's, when up set it
    record = prepare_host(c)
    ports = dict(
        zip(
            NODE_PORT_KEYS,
            pick_ports(len(NODE_PORT_KEYS), set(c.state["ports"].values())),
            strict=True,
        )
    )
    record.update(node_ip=ip, ports=ports, bin_dir=str(bin_dir), cgroup_root=CGROUP_ROOT)
    c.save()
    write_node_files(c, paths, bin_dir, ip, ports)
    env = node_env(bin_dir)
    start_containerd(c, paths, bin_dir, env)
    # Pointed at the node's containerd, the claim now names a process that lives as long as it.
    containerd = c.processes()["containerd"]
    CLAIM_FILE.write_text(
        json.dumps({"dir": str(c.dir), "pid": containerd["pid"], "start": containerd["start"]})
    )
    create_objects(c, coredns_rbac() + kube_dns_objects(ip) + network_policies_rbac())
    info("starting coredns...")
    c.start("coredns", [str(bin_dir / "coredns"), "-conf", str(paths.corefile)], env=env)
    wait_http(c, "coredns", f"http://127.0.0.1:{ports['coredns_ready']}/ready")
    start_kubelet(c, paths, bin_dir, ip, env)
    info("starting kube-proxy...")
    c.start(
        "kube-proxy",
        [str(bin_dir / "kube-proxy"), f"--config={paths.kube_proxy_config}", "--v=1"],
        env=env,
    )
    wait_http(c, "kube-proxy", f"http://127.0.0.1:{ports['kube_proxy_healthz']}/healthz")
    tools = {"unshare": host_tool("unshare"), "nft": host_tool("nft")}
    start_network_policies(
        c, paths.root / "network-policies", bin_dir, tools,
        ports["network_policies_metrics"], budget(c, NODE_TIMEOUT),
    )  # fmt: skip


def start_containerd(c: Cluster, paths: NodePaths, bin_dir: Path, env: dict[str, str]) -> None:
    info("starting containerd...")
    c.start(
        "containerd",
        [str(bin_dir / "containerd"), "--config", str(paths.containerd_config)],
        env=env,
    )
    wait_for(
        "containerd to answer on its socket",
        lambda: ctr(paths, bin_dir, "version", timeout=10).returncode == 0,
        budget(c, NODE_TIMEOUT),
        component="containerd",
        alive=c.check_alive,
    )
    archive = write_archive(
        pause_image(bin_dir / "pause", PAUSE_IMAGE), paths.root / "images" / "pause.tar"
    )
    import_image(paths, bin_dir, archive)


def start_kubelet(
    c: Cluster, paths: NodePaths, bin_dir: Path, ip: str, env: dict[str, str]
) -> None:
    info(f"starting kubelet ({NODE_NAME}, {ip})...")
    argv = [
        str(bin_dir / "kubelet"),
        f"--config={paths.kubelet_config}",
        f"--kubeconfig={paths.kubeconfig('kubelet')}",
        f"--root-dir={paths.kubelet_root}",
        f"--cert-dir={paths.root / 'kubelet-pki'}",
        f"--hostname-override={NODE_NAME}",
        f"--node-ip={ip}",
        f"--node-labels={kubelet_labels()}",
        "--v=1",
    ]
    c.start("kubelet", argv, env=env)

    def ready() -> bool:
        try:
            return node_ready(c.api("GET", f"/api/v1/nodes/{NODE_NAME}"))
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return False
            raise

    wait_for(f"node {NODE_NAME} to register and become Ready", ready, budget(c, NODE_TIMEOUT),
             component="kubelet", alive=c.check_alive)  # fmt: skip
