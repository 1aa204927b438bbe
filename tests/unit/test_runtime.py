"""One record per job: the newest job object, a fresh start on a new uid, orphan records."""

from __future__ import annotations

import asyncio

from diloco_operator.health import DROPPED, MembershipChange
from diloco_operator.runtime import DELETED, JobRuntime, Registry

from .operator_fakes import job_body, ready_pod


def _versioned(version: int, uid: str = "uid-1") -> dict:
    body = job_body(uid=uid)
    body["metadata"]["resourceVersion"] = str(version)
    return body


def test_job_runtime_keeps_the_newest_job_object() -> None:
    rt = JobRuntime(namespace="ns1", name="demo")
    assert asyncio.run(rt.see_job(_versioned(20)))
    assert not asyncio.run(rt.see_job(_versioned(15)))  # a late event of an older state
    assert rt.body is not None and rt.body["metadata"]["resourceVersion"] == "20"
    assert rt.uid == "uid-1"


def test_job_runtime_new_uid_starts_over_and_lists_again() -> None:
    rt = JobRuntime(namespace="ns1", name="demo")
    asyncio.run(rt.see_job(_versioned(20)))
    rt.membership.acknowledge(MembershipChange("island-0", DROPPED, "x"))
    rt.pods_listed = rt.children_listed = rt.credentials.checked = True
    rt.rollout, rt.phase = ["demo-island-0"], "Running"
    rt.see_pod(None, ready_pod("demo-island-0-0", "island-0"))
    assert asyncio.run(rt.see_job(_versioned(5, uid="uid-2")))  # older number, other object
    assert rt.uid == "uid-2" and rt.membership.acknowledged == {}
    assert not (rt.pods_listed or rt.children_listed or rt.credentials.checked)
    assert rt.rollout == [] and rt.phase is None
    assert len(rt.pods) == 1  # kept until the next list says otherwise


def test_job_runtime_pod_and_child_events() -> None:
    rt = JobRuntime(namespace="ns1", name="demo")
    pod = ready_pod("demo-island-0-0", "island-0", version=7)
    rt.see_pod(None, pod)
    assert [p.name for p in rt.pods.values()] == ["demo-island-0-0"]
    rt.see_pod(DELETED, {**pod, "metadata": {**pod["metadata"], "resourceVersion": "8"}})
    assert rt.pods.values() == []
    child = {"kind": "Service", "metadata": {"name": "demo-syncer", "resourceVersion": "3"}}
    rt.see_child("ADDED", child)
    assert list(rt.children.keys()) == [("Service", "demo-syncer")]


def test_registry_object_events_of_unknown_jobs() -> None:
    registry = Registry()
    assert registry.for_object_event("ns1", "demo", DELETED) is None  # no record for a deletion
    rt = registry.for_object_event("ns1", "demo", "MODIFIED")
    assert rt is not None and registry.find("ns1", "demo") is rt
    rt.see_pod(None, ready_pod("demo-island-0-0", "island-0"))
    registry.drop_if_orphan(rt)
    assert registry.find("ns1", "demo") is rt  # still holds a pod
    rt.see_pod(DELETED, ready_pod("demo-island-0-0", "island-0", version=60))
    registry.drop_if_orphan(rt)
    assert registry.find("ns1", "demo") is None


def test_registry_phase_counts_and_forget() -> None:
    registry = Registry()
    registry.job("ns1", "a").phase = "Running"
    registry.job("ns1", "b").phase = "Running"
    registry.job("ns2", "a").phase = "Failed"
    counts = registry.phase_counts()
    assert counts["Running"] == 2 and counts["Failed"] == 1 and counts["Pending"] == 0
    asyncio.run(registry.forget("ns1", "a"))
    assert registry.find("ns1", "a") is None and registry.phase_counts()["Running"] == 1
