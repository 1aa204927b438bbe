"""The kwok fake nodes, and the waits that end `up`: nodes Ready, the default ServiceAccount."""

from __future__ import annotations

import urllib.error
from typing import Any

from .components import budget
from .errors import ClusterError, info
from .objects import node_ready
from .processes import wait_for
from .settings import KWOK_NODE_ANNOTATION, NODES_TIMEOUT, SA_TIMEOUT
from .state import Cluster

ZONES = "abcd"


def node_names(count: int) -> list[str]:
    return [f"kwok-node-{i}" for i in range(count)]


def fake_node(name: str, index: int) -> dict[str, Any]:
    resources = {"cpu": "64", "memory": "256Gi", "pods": "110", "ephemeral-storage": "1Ti"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "node-role.kubernetes.io/agent": "",
                "type": "kwok",
                "topology.kubernetes.io/zone": f"zone-{ZONES[index % len(ZONES)]}",
            },
        },
        "spec": {},
        "status": {"allocatable": dict(resources), "capacity": dict(resources)},
    }


def create_nodes(c: Cluster, count: int) -> None:
    """Create the kwok nodes; wait until they are Ready and the default ServiceAccount exists."""
    names = node_names(count)
    info(f"creating {len(names)} fake nodes")
    for i, node in enumerate(names):
        try:
            c.api("POST", "/api/v1/nodes", fake_node(node, i))
        except urllib.error.HTTPError as e:
            if e.code != 409:
                raise ClusterError(
                    f"creating node {node} failed: HTTP {e.code} {e.read()[:500]!r}",
                    "kube-apiserver",
                    retryable=True,
                ) from e

    def nodes_ready() -> bool:
        items = c.api("GET", "/api/v1/nodes")["items"]
        ready = {n["metadata"]["name"] for n in items if node_ready(n)}
        return ready.issuperset(names)

    wait_for(
        "the fake nodes to become Ready and lose the not-ready taint",
        nodes_ready,
        budget(c, NODES_TIMEOUT),
        component="kwok",
        alive=c.check_alive,
    )
    wait_for(
        "the 'default' ServiceAccount (service-account controller)",
        lambda: default_service_account(c),
        budget(c, SA_TIMEOUT),
        component="kube-controller-manager",
        alive=c.check_alive,
    )


def default_service_account(c: Cluster) -> bool:
    try:
        c.api("GET", "/api/v1/namespaces/default/serviceaccounts/default")
        return True
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return False
        raise
