"""Readiness of Kubernetes objects given as parsed JSON (nodes, pods, custom resources)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Taints the node lifecycle controller keeps on a node until it has seen it Ready.
NOT_READY_TAINTS = {"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"}


def condition_status(obj: Mapping[str, Any], kind: str) -> str | None:
    """status of the first status.conditions entry of type `kind` ("True"/"False"/...), or None."""
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == kind:
            return c.get("status")
    return None


def node_ready(node: Mapping[str, Any]) -> bool:
    """Ready, and schedulable: the node lifecycle controller removes the not-ready taint some
    time after the Ready condition turns True, and until then no pod lands on the node."""
    taints = {t.get("key") for t in (node.get("spec") or {}).get("taints") or []}
    if taints & NOT_READY_TAINTS:
        return False
    return condition_status(node, "Ready") == "True"


def pod_ready(pod: Mapping[str, Any]) -> bool:
    """The pod's Ready condition is True (what StatefulSets and endpoints go by)."""
    return condition_status(pod, "Ready") == "True"
