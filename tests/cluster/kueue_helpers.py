"""What the Kueue tests build on: Kueue's queue objects and reads of its state (their fixtures,
`kueue_plane`, `kueue_cluster` and `kueue_operator`, live in conftest.py)."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hack.localcluster.harness import ControlPlane, KueueManager

from .operator_helpers import (
    Cluster,
    LocalSyncer,
    create_token_secret,
    job_manifest,
    start_local_syncer,
)

API = "kueue.x-k8s.io/v1beta2"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
ADMISSION_GATE = "kueue.x-k8s.io/admission"
FLAVOR = "default-flavor"


@dataclass(frozen=True)
class KueuePlane:
    """A control plane of its own with Kueue's manager running in it."""

    cp: ControlPlane
    kueue: KueueManager


def flavor() -> dict[str, Any]:
    return {"apiVersion": API, "kind": "ResourceFlavor", "metadata": {"name": FLAVOR}}


def cluster_queue(name: str, cpu: str) -> dict[str, Any]:
    """A ClusterQueue of `cpu` CPUs for every namespace; a workload of a higher priority
    preempts lower ones in it."""
    cpu_quota = {"name": "cpu", "nominalQuota": cpu}
    return {
        "apiVersion": API,
        "kind": "ClusterQueue",
        "metadata": {"name": name},
        "spec": {
            "namespaceSelector": {},
            "preemption": {"withinClusterQueue": "LowerPriority"},
            "resourceGroups": [
                {
                    "coveredResources": ["cpu"],
                    "flavors": [{"name": FLAVOR, "resources": [cpu_quota]}],
                }
            ],
        },
    }


def local_queue(name: str, cluster_queue_name: str) -> dict[str, Any]:
    return {
        "apiVersion": API,
        "kind": "LocalQueue",
        "metadata": {"name": name},
        "spec": {"clusterQueue": cluster_queue_name},
    }


def priority_class(name: str, value: int) -> dict[str, Any]:
    return {
        "apiVersion": API,
        "kind": "WorkloadPriorityClass",
        "metadata": {"name": name},
        "value": value,
    }


def statefulset(
    name: str, queue: str, *, replicas: int = 1, cpu: str = "1", priority: str = ""
) -> dict[str, Any]:
    """A plain StatefulSet in a Kueue queue (the smoke test's, and the other workloads that
    take quota from the islands)."""
    labels = {QUEUE_LABEL: queue}
    if priority:
        labels[PRIORITY_LABEL] = priority
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": replicas,
            "serviceName": name,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "containers": [
                        {"name": "c", "image": "busybox", "resources": {"requests": {"cpu": cpu}}}
                    ]
                },
            },
        },
    }


def make_queues(cluster: Cluster, cpu: str, name: str = "") -> str:
    """A ClusterQueue of `cpu` CPUs (named after the namespace: cluster-scoped) and a
    LocalQueue in the test's namespace pointing at it; the LocalQueue's name."""
    cq = name or f"cq-{cluster.ns}"
    cluster.cp.apply([flavor(), cluster_queue(cq, cpu)])
    cluster.apply(local_queue("lq", cq))
    return "lq"


def cpu_in_use(cp: ControlPlane, cluster_queue_name: str) -> float:
    """The CPUs a ClusterQueue's admitted workloads hold (its status.flavorsUsage)."""
    cq = cp.kubectl_json("get", "clusterqueue", cluster_queue_name)
    total = 0.0
    for usage in (cq.get("status") or {}).get("flavorsUsage") or []:
        for resource in usage.get("resources") or []:
            if resource.get("name") == "cpu":
                total += cpu_value(str(resource.get("total", "0")))
    return total


def cpu_value(quantity: str) -> float:
    """A CPU quantity ('2', '500m') in CPUs."""
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def gated(pod: dict[str, Any]) -> bool:
    """The pod is held by Kueue's admission gate."""
    gates = (pod.get("spec") or {}).get("schedulingGates") or []
    return any(g.get("name") == ADMISSION_GATE for g in gates)


def pods_of(cluster: Cluster, selector: str) -> list[dict[str, Any]]:
    return cluster.items("pods", selector)


def workloads(cluster: Cluster) -> list[dict[str, Any]]:
    return cluster.items("workloads.kueue.x-k8s.io")


def admitted(workload: dict[str, Any]) -> bool:
    conditions = (workload.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Admitted" and c["status"] == "True" for c in conditions)


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=1, sort_keys=True)[:4000]


# ------------------------------------------------------------------------------ queued jobs

ISLAND_CPU = "1"


def queued_manifest(name: str, queue: str, islands: int, quorum: int) -> dict[str, Any]:
    """A DiLoCoJob in `queue`: `islands` islands of one pod asking one CPU each."""
    manifest = job_manifest(
        name,
        islands={"count": islands, "replicas": 1, "resources": {"requests": {"cpu": ISLAND_CPU}}},
        sync={"quorum": quorum},
    )
    manifest["metadata"]["labels"] = {QUEUE_LABEL: queue}
    return manifest


@contextmanager
def remote_syncer_for(
    cluster: Cluster, manifest: dict[str, Any], workdir: Path
) -> Iterator[LocalSyncer]:
    """A real syncer on loopback serving `manifest` (its token in the namespace, the job pointed
    at it), stopped with its learners on exit."""
    syncer = start_local_syncer(manifest, workdir)
    try:
        create_token_secret(cluster.cp, cluster.ns, syncer.secret_name, syncer.token)
        manifest["spec"]["syncer"] = {"endpoint": syncer.url, "tokenSecretName": syncer.secret_name}
        yield syncer
    finally:
        syncer.stop()


def syncer_status(syncer: LocalSyncer, digest: bool = False) -> dict[str, Any]:
    """GET /v1/status (with ?digest=1: the sha256 of the weights and momentum)."""
    url = syncer.url + "/v1/status" + ("?digest=1" if digest else "")
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {syncer.token}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return dict(json.loads(resp.read()))


def island_index(island: str) -> int:
    return int(island.rsplit("-", 1)[1])


def waiting_for_quota(cluster: Cluster, job: str) -> list[str]:
    """The islands the job's WaitingForQuota condition names (empty when False or absent)."""
    cond = condition(cluster.status(job), "WaitingForQuota")
    if cond.get("status") != "True":
        return []
    return [i.strip() for i in cond.get("message", "").split(":", 1)[1].split(",")]


def island_pods_running(cluster: Cluster, job: str, island: str) -> bool:
    """The island's pod exists, is not gated and runs (kwok)."""
    pods = cluster.items("pods", f"diloco.dev/job={job},diloco.dev/island={island}")
    return bool(pods) and all(
        not gated(p) and (p.get("status") or {}).get("phase") == "Running" for p in pods
    )


def island_pods_gated(cluster: Cluster, job: str, island: str) -> bool:
    pods = cluster.items("pods", f"diloco.dev/job={job},diloco.dev/island={island}")
    return bool(pods) and all(gated(p) for p in pods)


def contributed(status: dict[str, Any], island: str) -> bool:
    """A merge of the syncer's recent ones holds a push of `island`."""
    return any(
        c.get("island") == island
        for m in status.get("merges") or []
        for c in m.get("contributors") or []
    )
