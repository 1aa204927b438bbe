"""The real node: containers from a locally made image run on it, Service names resolve through
CoreDNS, and a ClusterIP Service reaches a pod on the same node (kube-proxy's iptables rules
and the CNI bridge). kwok nodes stay beside it, and the real node's taint keeps every pod that
does not tolerate it away.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import subprocess
from typing import Any

import pytest

from hack.localcluster.harness import ControlPlane, poll_until
from hack.localcluster.realnode import host_tool
from hack.localcluster.settings import (
    CLUSTER_DNS_IP,
    NODE_LABEL,
    NODE_NAME,
    NODE_TAINT_KEY,
    SERVICE_CIDR,
)

POD_TIMEOUT = 180.0


def on_real_node(name: str, image: str, command: list[str], **spec: Any) -> dict[str, Any]:
    """A pod pinned to the real node (its label and taint), image never pulled (no registry)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "nodeSelector": {NODE_LABEL: "true"},
            "tolerations": [{"key": NODE_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}],
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {"name": "main", "image": image, "imagePullPolicy": "Never", "command": command}
            ],
            **spec,
        },
    }


def pod_phase(cp: ControlPlane, ns: str, name: str) -> str:
    return cp.kubectl_json("get", "pod", name, "-n", ns).get("status", {}).get("phase", "")


def wait_phase(cp: ControlPlane, ns: str, name: str, phases: set[str]) -> str:
    """Poll until the pod's phase is one of `phases`; the failure names the pod's state."""

    def reached() -> str | None:
        phase = pod_phase(cp, ns, name)
        return phase if phase in phases else None

    try:
        return poll_until(reached, timeout=POD_TIMEOUT, what=f"pod {ns}/{name} in {phases}")
    except TimeoutError as e:
        state = cp.kubectl("describe", "pod", name, "-n", ns, check=False).stdout[-3000:]
        raise AssertionError(f"{e}\n{state}") from e


def logs(cp: ControlPlane, ns: str, name: str) -> str:
    return cp.kubectl("logs", name, "-n", ns).stdout


def test_real_node_registers_ready_tainted_beside_kwok(node_cluster: ControlPlane) -> None:
    nodes = {n["metadata"]["name"]: n for n in node_cluster.kubectl_json("get", "nodes")["items"]}
    real = nodes[NODE_NAME]
    taints = {t["key"]: t["effect"] for t in real["spec"].get("taints", [])}
    assert taints.get(NODE_TAINT_KEY) == "NoSchedule"
    assert real["metadata"]["labels"][NODE_LABEL] == "true"
    ready = [c for c in real["status"]["conditions"] if c["type"] == "Ready"]
    assert ready and ready[0]["status"] == "True"
    assert real["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://2.")
    assert real["status"]["nodeInfo"]["kubeletVersion"] == "v1.36.4"
    assert any(name.startswith("kwok-node-") for name in nodes)


def test_pod_from_local_image_runs_on_real_node(
    node_cluster: ControlPlane, node_ns: str, busybox_image: str
) -> None:
    pod = on_real_node(
        "hello", busybox_image, ["sh", "-c", "echo hello from $(hostname) as $(id -u)"]
    )
    pod["spec"]["securityContext"] = {"runAsUser": 65532, "runAsNonRoot": True}
    node_cluster.apply(pod, node_ns)
    assert wait_phase(node_cluster, node_ns, "hello", {"Succeeded", "Failed"}) == "Succeeded"
    assert logs(node_cluster, node_ns, "hello").strip() == "hello from hello as 65532"
    placed = node_cluster.kubectl_json("get", "pod", "hello", "-n", node_ns)
    assert placed["spec"]["nodeName"] == NODE_NAME


def test_untolerating_pod_stays_off_real_node(node_cluster: ControlPlane, node_ns: str) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "plain"},
        "spec": {"containers": [{"name": "main", "image": "any:never-pulled"}]},
    }
    node_cluster.apply(pod, node_ns)
    node = poll_until(
        lambda: node_cluster.kubectl_json("get", "pod", "plain", "-n", node_ns)["spec"].get(
            "nodeName"
        ),
        timeout=60,
        what="pod plain scheduled",
    )
    assert node.startswith("kwok-node-")


def serve_and_query(cp: ControlPlane, ns: str, image: str) -> str:
    """A busybox httpd pod behind a ClusterIP Service, and a client pod on the same node that
    resolves the Service's name and fetches from it; the client's output."""
    server = on_real_node(
        "web",
        image,
        [
            "sh",
            "-c",
            "mkdir -p /tmp/www && echo served-by-$(hostname) > /tmp/www/index.html "
            "&& exec httpd -f -p 8080 -h /tmp/www",
        ],
        restartPolicy="Always",
    )
    server["spec"]["containers"][0]["readinessProbe"] = {
        "tcpSocket": {"port": 8080},
        "periodSeconds": 1,
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]},
    }
    cp.apply([server, service], ns)
    cp.kubectl("wait", "--for=condition=Ready", "pod/web", "-n", ns, "--timeout=180s")
    client = on_real_node(
        "client",
        image,
        # busybox's wget crashes in a static build (glibc's getservbyname); nc does not.
        [
            "sh",
            "-c",
            f"nslookup web.{ns}.svc.cluster.local && "
            "printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 10 web 80",
        ],
    )
    cp.apply(client, ns)
    phase = wait_phase(cp, ns, "client", {"Succeeded", "Failed"})
    out = logs(cp, ns, "client")
    assert phase == "Succeeded", out
    return out


def test_service_name_resolves_and_cluster_ip_reaches_pod(
    node_cluster: ControlPlane, node_ns: str, busybox_image: str
) -> None:
    out = serve_and_query(node_cluster, node_ns, busybox_image)
    cluster_ip = node_cluster.kubectl_json("get", "service", "web", "-n", node_ns)["spec"][
        "clusterIP"
    ]
    assert f"Server:\t\t{CLUSTER_DNS_IP}" in out or CLUSTER_DNS_IP in out.splitlines()[0], out
    assert cluster_ip in out, out  # the name resolved to the Service's ClusterIP
    assert "200 OK" in out and out.strip().endswith("served-by-web"), out


def test_pod_reaches_api_server_through_kubernetes_service(
    node_cluster: ControlPlane, node_ns: str, busybox_image: str
) -> None:
    """The apiserver advertises the node's IP (loopback is no endpoint a pod can reach), so
    an in-cluster client's connection to kubernetes.default.svc:443 is accepted."""
    endpoints = node_cluster.kubectl_json(
        "get", "endpointslices", "-n", "default", "-l", "kubernetes.io/service-name=kubernetes"
    )["items"]
    node = node_cluster.kubectl_json("get", "node", NODE_NAME)
    internal = [a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP"]
    assert [e["addresses"] for e in endpoints[0]["endpoints"]] == [internal]
    pod = on_real_node(
        "api",
        busybox_image,
        ["sh", "-c", "nc -w 10 kubernetes.default.svc 443 </dev/null && echo open"],
    )
    node_cluster.apply(pod, node_ns)
    assert wait_phase(node_cluster, node_ns, "api", {"Succeeded", "Failed"}) == "Succeeded"
    assert logs(node_cluster, node_ns, "api").strip() == "open"


def test_unprogrammed_cluster_ip_is_unreachable_not_routed_off_the_machine(
    node_cluster: ControlPlane,
) -> None:
    """An address of the Service CIDR that kube-proxy has not (yet) programmed fails at once
    with "no route to host" instead of following the default route off the machine (where
    something answered a learner's join with a bare 404 before the node refused it). Programmed
    ClusterIPs still work from pods and from the host
    (test_service_name_resolves_and_cluster_ip_reaches_pod, the job's tests)."""
    network = ipaddress.ip_network(SERVICE_CIDR)
    unused = str(network.broadcast_address - 1)  # the allocator hands out low addresses first
    rules = subprocess.run(
        [host_tool("iptables"), "-S", "OUTPUT"], capture_output=True, text=True, check=True
    ).stdout
    assert any(SERVICE_CIDR in r and "REJECT" in r for r in rules.splitlines()), rules
    with pytest.raises(OSError) as refused:
        socket.create_connection((unused, 80), timeout=5).close()
    assert refused.value.errno == errno.EHOSTUNREACH, refused.value
