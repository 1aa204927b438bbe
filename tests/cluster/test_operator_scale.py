"""Changing islands.count, suspend and the image: whole islands come and go, others untouched."""

from __future__ import annotations

import time

import pytest
from diloco_operator.planner import statefulset_in_flight

from .operator_helpers import Cluster, OperatorProcess, job_manifest
from .waits import WAIT, wait_until

pytestmark = pytest.mark.cluster

ISLAND_PODS = "diloco.dev/job=sc,app.kubernetes.io/component=learner"


def _islands(cluster: Cluster) -> set[str]:
    return cluster.names("statefulsets", "diloco.dev/job=sc")


def _island_set(count: int) -> set[str]:
    return {f"sc-island-{i}" for i in range(count)}


def _uids_of(uids: dict[str, str], islands: range) -> dict[str, str]:
    return {
        pod: uid
        for pod, uid in uids.items()
        if any(pod.startswith(f"sc-island-{i}-") for i in islands)
    }


def test_operator_scales_islands_4_6_3(cluster: Cluster, operator: OperatorProcess) -> None:
    cluster.apply(job_manifest("sc", islands={"count": 4, "replicas": 2}))
    wait_until(lambda: cluster.pods_ready(ISLAND_PODS, 8), WAIT, message="8 learner pods Ready")
    assert _islands(cluster) == _island_set(4)
    pods_before = cluster.pod_uids(ISLAND_PODS)
    generations = {
        s["metadata"]["name"]: s["metadata"]["generation"]
        for s in cluster.items("statefulsets", "diloco.dev/job=sc")
    }

    cluster.patch_spec("sc", {"islands": {"count": 6}})
    wait_until(lambda: cluster.pods_ready(ISLAND_PODS, 12), WAIT, message="12 learner pods Ready")
    assert _islands(cluster) == _island_set(6)
    after_up = cluster.pod_uids(ISLAND_PODS)
    assert _uids_of(after_up, range(4)) == pods_before, "existing islands' pods were replaced"
    for sts in cluster.items("statefulsets", "diloco.dev/job=sc"):
        name = sts["metadata"]["name"]
        if name in generations:
            assert sts["metadata"]["generation"] == generations[name], f"{name} was modified"

    cluster.patch_spec("sc", {"islands": {"count": 3}})
    wait_until(lambda: _islands(cluster) == _island_set(3), WAIT, message="3 StatefulSets")
    wait_until(
        lambda: set(cluster.pod_uids(ISLAND_PODS)) == set(_uids_of(after_up, range(3))),
        WAIT,
        message="pods of islands 3-5 gone",
    )
    assert cluster.pod_uids(ISLAND_PODS) == _uids_of(pods_before, range(3))
    # Deleted in the same reconcile as the StatefulSets, but not awaited above.
    wait_until(
        lambda: cluster.names("services", "diloco.dev/job=sc") == _island_set(3) | {"sc-syncer"},
        WAIT,
        message="the Services of islands 3-5 gone, the others kept",
    )
    wait_until(
        lambda: cluster.status("sc").get("islandsSummary") == "3/3", WAIT, message="status 3/3"
    )


def test_operator_suspend_and_resume(cluster: Cluster, operator: OperatorProcess) -> None:
    cluster.apply(job_manifest("sc", islands={"count": 2, "replicas": 2}))
    wait_until(lambda: cluster.pods_ready(ISLAND_PODS, 4), WAIT, message="4 learner pods Ready")
    syncer_pods = cluster.pod_uids("diloco.dev/job=sc,app.kubernetes.io/component=syncer")
    assert len(syncer_pods) == 1
    sts_uids = {s["metadata"]["name"]: s["metadata"]["uid"] for s in cluster.items("statefulsets")}

    cluster.patch_spec("sc", {"suspend": True})
    wait_until(lambda: not cluster.items("pods", ISLAND_PODS), WAIT, message="learner pods gone")
    assert all(s["spec"]["replicas"] == 0 for s in cluster.items("statefulsets"))
    status = wait_until(
        lambda: (st := cluster.status("sc")).get("phase") == "Suspended" and st,
        WAIT,
        message="Suspended",
    )
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions["Suspended"] == "True" and status["islandsSummary"] == "0/0"
    # The syncer keeps running (and keeps its state): same pod.
    assert cluster.pod_uids("diloco.dev/job=sc,app.kubernetes.io/component=syncer") == syncer_pods

    cluster.patch_spec("sc", {"suspend": False})
    wait_until(lambda: cluster.pods_ready(ISLAND_PODS, 4), WAIT, message="pods back after resume")
    assert {s["metadata"]["name"]: s["metadata"]["uid"] for s in cluster.items("statefulsets")} == (
        sts_uids
    )
    wait_until(lambda: cluster.status("sc").get("phase") != "Suspended", WAIT, message="resumed")
    assert cluster.pod_uids("diloco.dev/job=sc,app.kubernetes.io/component=syncer") == syncer_pods


def test_operator_rolls_image_one_island_at_a_time(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    cluster.apply(job_manifest("sc", islands={"count": 3, "replicas": 2}))
    wait_until(lambda: cluster.pods_ready(ISLAND_PODS, 6), WAIT, message="6 learner pods Ready")
    # The operator judges islands by their StatefulSet status, which trails the pods: an island
    # whose status does not show its pods Ready yet has nothing to disrupt and is updated at
    # once, by design. Start the rollout only when every island counts as Ready there too.
    wait_until(
        lambda: (
            all(
                (s.get("status") or {}).get("readyReplicas", 0) == 2
                and not statefulset_in_flight(s)
                for s in cluster.items("statefulsets", "diloco.dev/job=sc")
            )
            and len(cluster.items("statefulsets", "diloco.dev/job=sc")) == 3
        ),
        WAIT,
        message="3 island StatefulSets report 2 Ready replicas",
    )
    cluster.patch_spec("sc", {"image": "diloco-trainer:v2"})

    order: list[str] = []
    deadline = time.monotonic() + 300
    while True:
        statefulsets = cluster.items("statefulsets", "diloco.dev/job=sc")
        in_flight = []
        for sts in sorted(statefulsets, key=lambda s: s["metadata"]["name"]):
            name = sts["metadata"]["name"]
            image = sts["spec"]["template"]["spec"]["containers"][0]["image"]
            if image != "diloco-trainer:v2":
                continue
            if name not in order:
                order.append(name)
            st = sts.get("status") or {}
            settled = (
                st.get("observedGeneration", 0) >= sts["metadata"]["generation"]
                and st.get("currentRevision") == st.get("updateRevision")
                and st.get("readyReplicas", 0) == sts["spec"]["replicas"]
            )
            if not settled:
                in_flight.append(name)
        assert len(in_flight) <= 1, f"several islands rolling at once: {in_flight}"
        pods = cluster.items("pods", ISLAND_PODS)
        done = len(order) == 3 and not in_flight and len(pods) == 6
        if done and all(p["spec"]["containers"][0]["image"] == "diloco-trainer:v2" for p in pods):
            break
        assert time.monotonic() < deadline, f"rollout incomplete: order={order}"
        time.sleep(0.1)  # polling interval of the observation loop, not a synchronisation
    assert order == ["sc-island-0", "sc-island-1", "sc-island-2"]
