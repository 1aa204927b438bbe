"""Stopping the real node and undoing what it did to the machine (see realnode.py).

Order: cordon and drain through the API while the kubelet still runs (it stops each pod's
containers and sandbox, and CNI DEL removes the pod's veth, IP and iptables rules); stop
kube-proxy, the kubelet and CoreDNS, then the NetworkPolicy enforcer (it deletes its nftables
table, or we do: left behind, its rules would drop pod traffic); kill whatever containers are
left through containerd, then stop it and the shims it started (each named by our containerd's
socket in its arguments); unmount everything under DIR/node; delete the bridge, kube-proxy's and
our CNI network's iptables chains, the rules refusing the Service CIDR and the cgroup tree;
restore the sysctls. Each step goes on when one fails: `down` must always get as far as it can.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from .errors import info
from .mounts import unmount_all
from .netpolicy import stop_network_policies
from .nodeconfig import NodePaths
from .processes import pid_matches, signal_group
from .realnode import CLAIM_FILE, cgroup_dirs, ctr, read_claim, write_sysctl
from .settings import DRAIN_TIMEOUT, NODE_BRIDGE, NODE_NAME
from .state import Cluster

CNI_NETWORK = "diloco-real-node"
# The chains the kubelet itself makes (kube-proxy --cleanup leaves them).
KUBELET_CHAINS = ("KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "KUBE-IPTABLES-HINT")


def patch_node(c: Cluster, body: dict[str, Any]) -> None:
    req = urllib.request.Request(
        f"{c.server}/api/v1/nodes/{NODE_NAME}", data=json.dumps(body).encode(), method="PATCH"
    )
    req.add_header("Content-Type", "application/merge-patch+json")
    with urllib.request.urlopen(req, context=c.ssl_context(), timeout=10):
        pass


def node_pods(c: Cluster) -> list[dict[str, Any]]:
    return c.api("GET", f"/api/v1/pods?fieldSelector=spec.nodeName%3D{NODE_NAME}")["items"]


def drain(c: Cluster) -> None:
    """Cordon the node and delete its pods (2 s grace) while the kubelet runs; wait until the
    kubelet has stopped them all (bounded)."""
    if not (c.running("kube-apiserver") and c.running("kubelet")):
        return
    try:
        patch_node(c, {"spec": {"unschedulable": True}})
        pods = node_pods(c)
        for pod in pods:
            meta = pod["metadata"]
            with contextlib.suppress(urllib.error.HTTPError):
                c.api("DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                      {"gracePeriodSeconds": 2})  # fmt: skip
        deadline = time.monotonic() + DRAIN_TIMEOUT
        while pods and time.monotonic() < deadline:
            time.sleep(0.5)
            pods = node_pods(c)
        if pods:
            info(f"WARNING: {len(pods)} pod(s) still on {NODE_NAME} after {DRAIN_TIMEOUT}s")
    except (OSError, ValueError, KeyError, ssl.SSLError) as e:
        info(f"WARNING: draining {NODE_NAME} failed: {e}")


def kill_containers(paths: NodePaths, bin_dir: Path) -> None:
    """Kill and delete every task and container containerd still has (what the drain left)."""
    tasks = ctr(paths, bin_dir, "tasks", "ls", "-q", timeout=20)
    for task in tasks.stdout.split() if tasks.returncode == 0 else []:
        ctr(paths, bin_dir, "tasks", "kill", "--all", "--signal", "SIGKILL", task, timeout=20)
        ctr(paths, bin_dir, "tasks", "delete", "--force", task, timeout=30)
    containers = ctr(paths, bin_dir, "containers", "ls", "-q", timeout=20)
    for cid in containers.stdout.split() if containers.returncode == 0 else []:
        ctr(paths, bin_dir, "containers", "delete", cid, timeout=30)
    sandboxes = ctr(paths, bin_dir, "sandboxes", "ls", "-q", timeout=20)
    for sid in sandboxes.stdout.split() if sandboxes.returncode == 0 else []:
        ctr(paths, bin_dir, "sandboxes", "rm", "--force", sid, timeout=30)


def shim_pids(socket: Path) -> list[int]:
    """The shims of our containerd: containerd-shim-runc-v2 with `-address <our socket>`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        name = os.path.basename(argv[0].decode(errors="replace"))
        if name.startswith("containerd-shim") and os.fsencode(str(socket)) in argv:
            pids.append(int(entry.name))
    return pids


def stop_shims(socket: Path) -> None:
    """The shims outlive containerd by design; ours go once their containers are gone."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = shim_pids(socket)
        for pid in pids:
            signal_group(pid, sig)
        deadline = time.monotonic() + 5
        while pids and time.monotonic() < deadline:
            time.sleep(0.1)
            pids = [p for p in pids if pid_matches(p, "", None, check_exe=False)]


def run_quiet(argv: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return subprocess.CompletedProcess(argv, 1, "", str(e))


def cni_masquerade_rules(listing: str) -> list[tuple[int, str]]:
    """(rule number, target chain) of our network's rules in `iptables -t nat -L POSTROUTING
    -n --line-numbers` output, highest number first (deleting keeps the others' numbers)."""
    found = []
    for line in listing.splitlines():
        fields = line.split()
        if len(fields) > 1 and fields[0].isdigit() and f'name: "{CNI_NETWORK}"' in line:
            found.append((int(fields[0]), fields[1]))
    return sorted(found, reverse=True)


def kubelet_hooks(rules: str) -> list[list[str]]:
    """The rules (`iptables -S` lines, as argument lists without -A) that jump from another
    chain into one of the kubelet's chains."""
    hooks = []
    for rule in rules.splitlines():
        args = rule.split()
        jump = args[args.index("-j") + 1] if "-j" in args[:-1] else ""
        if args and args[0] == "-A" and jump in KUBELET_CHAINS and args[1] not in KUBELET_CHAINS:
            hooks.append(args[1:])
    return hooks


def remove_cni_chains() -> None:
    """Masquerade rules (and their CNI-* chains) of our network that a missed CNI DEL left."""
    listing = run_quiet(["iptables", "-t", "nat", "-L", "POSTROUTING", "-n", "--line-numbers"])
    for number, chain in cni_masquerade_rules(listing.stdout):
        run_quiet(["iptables", "-t", "nat", "-D", "POSTROUTING", str(number)])
        if chain.startswith("CNI-"):
            run_quiet(["iptables", "-t", "nat", "-F", chain])
            run_quiet(["iptables", "-t", "nat", "-X", chain])


def remove_kubelet_chains() -> None:
    """Unhook and delete the kubelet's chains (IPv4 and IPv6, every table it uses)."""
    for tool in ("iptables", "ip6tables"):
        for table in ("filter", "nat", "mangle"):
            for hook in kubelet_hooks(run_quiet([tool, "-t", table, "-S"]).stdout):
                run_quiet([tool, "-t", table, "-D", *hook])
            for chain in KUBELET_CHAINS:
                run_quiet([tool, "-t", table, "-F", chain])
                run_quiet([tool, "-t", table, "-X", chain])


def remove_cgroups() -> None:
    """rmdir the cgroup tree bottom-up (only empty cgroups can go; processes are gone)."""
    for top in cgroup_dirs():
        if not top.exists():
            continue
        dirs = sorted(
            (p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True
        )
        for d in [*dirs, top]:
            with contextlib.suppress(OSError):
                d.rmdir()


def restore_host(record: dict[str, Any], bin_dir: Path) -> None:
    run_quiet(["ip", "link", "delete", NODE_BRIDGE])
    for rule in record.get("service_cidr_rules") or []:
        run_quiet(["iptables", "-D", *rule])
    kube_proxy = bin_dir / "kube-proxy"
    if kube_proxy.exists():
        run_quiet([str(kube_proxy), "--cleanup"])
    remove_cni_chains()
    remove_kubelet_chains()
    remove_cgroups()
    for key, value in (record.get("sysctls") or {}).items():
        if value is not None:
            with contextlib.suppress(Exception):
                write_sysctl(key, value)
    claim = read_claim()
    if claim and claim.get("dir") == record["dir"]:
        CLAIM_FILE.unlink(missing_ok=True)


def stop_real_node(c: Cluster) -> None:
    """Tear the real node down (before the control plane stops: the drain needs it)."""
    record = c.state.get("real_node")
    if not record:
        return
    paths = NodePaths(c.dir / "node")
    bin_dir = Path(record.get("bin_dir", ""))
    drain(c)
    for name in ("kube-proxy", "kubelet", "coredns"):
        c.stop(name)
    stop_network_policies(c, "nft")
    if c.running("containerd"):
        kill_containers(paths, bin_dir)
    c.stop("containerd")
    stop_shims(paths.socket)
    left = unmount_all(paths.root)
    if left:
        info(f"WARNING: still mounted under {paths.root}: {', '.join(left[:5])}")
    restore_host({**record, "dir": str(c.dir)}, bin_dir)
    c.state.pop("real_node", None)
    if c.persist:
        with contextlib.suppress(OSError):
            c.save()
