"""Placement on a real control plane: the syncer's pod template, per-island overrides reaching
the StatefulSets and the scheduler, and `kubectl scale dj` through the scale subresource."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from diloco_trainer.api import contract

from hack.localcluster.harness import ControlPlane

from .operator_helpers import Cluster, OperatorProcess, job_manifest
from .waits import WAIT, wait_until

pytestmark = pytest.mark.cluster

ZONE = "topology.kubernetes.io/zone"  # each kwok node of hack/local-cluster is in its own zone


def _learners(job: str) -> str:
    return f"diloco.dev/job={job},app.kubernetes.io/component=learner"


def _zones(cluster: Cluster) -> dict[str, str]:
    """{node name: its zone}."""
    nodes = json.loads(cluster.cp.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    return {n["metadata"]["name"]: n["metadata"]["labels"][ZONE] for n in nodes}


def _pods_by_island(cluster: Cluster, job: str) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for pod in cluster.items("pods", _learners(job)):
        out.setdefault(pod["metadata"]["labels"]["diloco.dev/island"], []).append(pod)
    return out


def _env(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


@pytest.fixture
def priority_class(control_plane: ControlPlane, namespace: str) -> Iterator[str]:
    """A PriorityClass for this test (cluster-scoped: deleted afterwards)."""
    name = f"diloco-{namespace}"[:63]
    body = {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {"name": name},
        "value": 4242,
    }
    control_plane.apply(body)
    yield name
    control_plane.kubectl("delete", "priorityclass", name, "--ignore-not-found", check=False)


def test_operator_places_the_syncer_and_mixed_islands(
    cluster: Cluster, operator: OperatorProcess, priority_class: str
) -> None:
    cluster.cp.kubectl("create", "serviceaccount", "syncer-sa", "-n", cluster.ns)
    syncer_template = {
        "metadata": {"labels": {"team": "ml"}},
        "spec": {
            "nodeSelector": {ZONE: "zone-c"},
            "tolerations": [{"key": "diloco.dev/syncer", "operator": "Exists"}],
            "imagePullSecrets": [{"name": "regcred"}],
            "priorityClassName": priority_class,
            "serviceAccountName": "syncer-sa",
            "volumes": [{"name": "data", "emptyDir": {}}],
            "containers": [
                {"name": "syncer", "volumeMounts": [{"name": "data", "mountPath": "/d"}]}
            ],
        },
    }
    islands = {
        "count": 3,
        "replicas": 1,
        "resources": {"requests": {"cpu": "1"}},
        "template": {"spec": {"nodeSelector": {ZONE: "zone-a"}}},
        "overrides": [
            {
                "islands": [1],
                "replicas": 2,
                "resources": {"requests": {"cpu": "2"}},
                "nodeSelector": {ZONE: "zone-b"},
            }
        ],
    }
    cluster.apply(job_manifest("pl", islands=islands, syncer={"template": syncer_template}))
    wait_until(lambda: cluster.pods_ready(_learners("pl"), 4), WAIT, message="4 learners Ready")

    replicas = {
        s["metadata"]["name"]: s["spec"]["replicas"]
        for s in cluster.items("statefulsets", "diloco.dev/job=pl")
    }
    assert replicas == {"pl-island-0": 1, "pl-island-1": 2, "pl-island-2": 1}
    zones = _zones(cluster)
    pods = _pods_by_island(cluster, "pl")
    for island, zone, cpu, count in (
        ("island-0", "zone-a", "1", 1),
        ("island-1", "zone-b", "2", 2),
        ("island-2", "zone-a", "1", 1),
    ):
        assert len(pods[island]) == count, island
        for pod in pods[island]:
            assert zones[pod["spec"]["nodeName"]] == zone, pod["metadata"]["name"]
            assert pod["spec"]["containers"][0]["resources"]["requests"]["cpu"] == cpu
            assert _env(pod)[contract.WORLD_SIZE] == str(count)

    (syncer,) = wait_until(
        lambda: cluster.pods_ready("diloco.dev/job=pl,app.kubernetes.io/component=syncer", 1),
        WAIT,
        message="the syncer pod Ready",
    )
    spec = syncer["spec"]
    assert zones[spec["nodeName"]] == "zone-c"
    assert spec["serviceAccountName"] == "syncer-sa"
    assert spec["priorityClassName"] == priority_class and spec["priority"] == 4242
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert {"key": "diloco.dev/syncer", "operator": "Exists"} in spec["tolerations"]
    mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    assert mounts["data"] == "/d" and mounts["state"] == contract.STATE_MOUNT
    assert syncer["metadata"]["labels"]["team"] == "ml"

    status = wait_until(
        lambda: (st := cluster.status("pl")).get("islandsSummary") == "3/3" and st,
        WAIT,
        message="status 3/3",
    )
    desired = {i["name"]: i["desiredPods"] for i in status["islandStatuses"]}
    assert desired == {"island-0": 1, "island-1": 2, "island-2": 1}


def _scale_doc(cluster: Cluster, job: str) -> dict[str, Any]:
    path = f"/apis/diloco.dev/v1alpha1/namespaces/{cluster.ns}/dilocojobs/{job}/scale"
    return json.loads(cluster.cp.kubectl("get", "--raw", path).stdout)


def test_kubectl_scale_sets_the_number_of_islands(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    islands = {"count": 2, "replicas": 1, "overrides": [{"islands": [2, 3], "replicas": 2}]}
    cluster.apply(job_manifest("ks", islands=islands))
    wait_until(lambda: cluster.pods_ready(_learners("ks"), 2), WAIT, message="2 learners Ready")

    cluster.cp.kubectl("scale", "dj", "ks", "-n", cluster.ns, "--replicas", "4")
    assert cluster.job("ks")["spec"]["islands"]["count"] == 4
    # Islands 2 and 3 come up with their override's 2 ranks each.
    wait_until(lambda: cluster.pods_ready(_learners("ks"), 6), WAIT, message="6 learners Ready")
    sizes = {island: len(pods) for island, pods in _pods_by_island(cluster, "ks").items()}
    assert sizes == {"island-0": 1, "island-1": 1, "island-2": 2, "island-3": 2}
    scale = wait_until(
        lambda: (doc := _scale_doc(cluster, "ks"))["status"].get("replicas") == 4 and doc,
        WAIT,
        message="the scale subresource reports 4 ready islands",
    )
    assert scale["spec"]["replicas"] == 4

    cluster.cp.kubectl("scale", "dj", "ks", "-n", cluster.ns, "--replicas", "1")
    wait_until(
        lambda: cluster.names("statefulsets", "diloco.dev/job=ks") == {"ks-island-0"},
        WAIT,
        message="only island 0 left",
    )
    refused = cluster.cp.kubectl(
        "scale", "dj", "ks", "-n", cluster.ns, "--replicas", "0", check=False
    )
    assert refused.returncode != 0 and "islands.count" in refused.stderr, refused.stderr
    assert cluster.job("ks")["spec"]["islands"]["count"] == 1


def test_job_labels_and_annotations_reach_every_pod(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    manifest = job_manifest("lb", islands={"count": 2, "replicas": 1})
    manifest["metadata"]["labels"] = {"scheduling.example.com/pod-group": "lb"}
    manifest["metadata"]["annotations"] = {"scheduling.example.com/min-member": "3"}
    cluster.apply(manifest)  # kubectl apply adds its last-applied annotation: not passed on
    pods = wait_until(
        lambda: cluster.pods_ready("diloco.dev/job=lb", 3), WAIT, message="2 learners + syncer"
    )
    for pod in pods:
        meta = pod["metadata"]
        assert meta["labels"]["scheduling.example.com/pod-group"] == "lb", meta["name"]
        assert meta["annotations"]["scheduling.example.com/min-member"] == "3", meta["name"]
        assert not any(k.startswith("kubectl.kubernetes.io/") for k in meta["annotations"])
    assert {p["metadata"]["labels"]["app.kubernetes.io/component"] for p in pods} == {
        "learner",
        "syncer",
    }
