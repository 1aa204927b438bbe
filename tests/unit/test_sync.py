"""The sync of one job against an in-memory API: it lists once, then works from the watches."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import kopf
import pytest
from diloco_operator import resources
from diloco_operator.api import parse_job_spec
from diloco_operator.kube import Kube
from diloco_operator.resources import JobRef
from diloco_operator.runtime import DELETED, JobRuntime
from diloco_operator.sync import POD_READS, RESYNC_INTERVAL, resync_interval, sync_job

from .operator_fakes import FakeKube, job_body, ready_pod


def _sync(kube: FakeKube, rt: JobRuntime, *, reconcile: bool, poll: bool = False) -> bool:
    return asyncio.run(sync_job(cast(Kube, kube), rt, reconcile=reconcile, poll_syncer=poll))


def _runtime(body: dict[str, Any]) -> JobRuntime:
    rt = JobRuntime(namespace="ns1", name=body["metadata"]["name"])
    asyncio.run(rt.see_job(body))
    return rt


CHILDREN = {
    "ConfigMap/demo-config",
    "NetworkPolicy/demo-network",
    "Service/demo-island-0",
    "Service/demo-island-1",
    "StatefulSet/demo-island-0",
    "StatefulSet/demo-island-1",
}
LISTED_KINDS = ["ConfigMap", "Deployment", "NetworkPolicy", "Pod", "Service", "StatefulSet"]


def test_sync_job_first_sync_of_a_new_job_reads_each_child_once_and_creates_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    body = job_body(syncer={})  # a generated token Secret: created on the first sync
    kube = FakeKube(body)
    rt = _runtime(body)
    # This operator has read pods before (POD_READS is process-wide: set here so the test does
    # not depend on which test ran first; unconfirmed, a new job's pods are listed on purpose).
    monkeypatch.setattr(POD_READS, "confirmed", True)
    assert _sync(kube, rt, reconcile=True)
    # A job never synced (no status) has nothing of its own to list.
    assert "list_labelled" not in kube.methods()
    # Children the job does not own yet are read first (never applied over someone else's),
    # each once, all before the first write: token Secret and reads, island Secret, children.
    applied = [d for m, d in kube.calls if m == "apply" and not d.startswith("Secret/")]
    read = [d for m, d in kube.calls if m == "get" and not d.startswith("Secret/")]
    wanted = CHILDREN | {"Deployment/demo-syncer", "Service/demo-syncer"}
    assert set(applied) == wanted and sorted(read) == sorted(wanted)
    first_apply = kube.methods().index("apply")
    assert kube.calls[first_apply] == ("apply", "Secret/demo-island-tokens")
    assert {m for m, _ in kube.calls[:first_apply]} == {"create", "get"}
    assert kube.calls.index(("create", "Secret/demo-token")) < first_apply
    assert kube.methods()[-1] == "patch_job_status"
    assert rt.body is not None and rt.body["status"]["phase"] == "Pending"


def test_sync_job_first_sync_after_a_restart_lists_and_reads_only_what_it_does_not_own() -> None:
    body = job_body()
    kube = FakeKube(body)
    _sync(kube, _runtime(body), reconcile=True)
    assert kube.job is not None and kube.job.get("status")  # synced before the "restart"
    rt = _runtime(kube.job)  # a new operator process: nothing seen yet
    kube.calls.clear()
    assert _sync(kube, rt, reconcile=True)
    assert sorted(d for m, d in kube.calls if m == "list_labelled") == LISTED_KINDS
    # The listing shows every child as the job's: none is read, none is written again.
    touched = {d for m, d in kube.calls if m in ("get", "apply") and not d.startswith("Secret/")}
    assert touched == set()
    assert set(rt.children.keys()) == {tuple(c.split("/")) for c in CHILDREN}


def test_sync_job_steady_state_reads_no_list_and_no_job() -> None:
    body = job_body()
    kube = FakeKube(body)
    rt = _runtime(body)
    _sync(kube, rt, reconcile=True)
    for index in range(2):  # the pod watch delivers the islands' pods
        rt.see_pod(None, ready_pod(f"demo-island-{index}-0", f"island-{index}"))
    kube.calls.clear()
    assert _sync(kube, rt, reconcile=True)
    # Children match what the apply answers left in the cache; only the status changed (2/2).
    assert kube.calls == [("patch_job_status", "Pending")]
    assert rt.body is not None and rt.body["status"]["islandsSummary"] == "2/2"
    kube.calls.clear()
    _sync(kube, rt, reconcile=False)
    assert kube.calls == []  # nothing changed: no request at all


def test_sync_job_recreates_a_child_its_watch_saw_deleted() -> None:
    body = job_body()
    kube = FakeKube(body)
    rt = _runtime(body)
    _sync(kube, rt, reconcile=True)
    gone = kube.objects.pop(("StatefulSet", "demo-island-1"))
    gone["metadata"]["resourceVersion"] = "999"
    rt.see_child(DELETED, gone)
    kube.calls.clear()
    _sync(kube, rt, reconcile=True)
    assert [d for m, d in kube.calls if m in ("apply", "create", "list_labelled")] == [
        "StatefulSet/demo-island-1"
    ]


def test_sync_job_scaled_down_deletes_from_the_cache_view() -> None:
    body = job_body()
    kube = FakeKube(body)
    rt = _runtime(body)
    _sync(kube, rt, reconcile=True)
    smaller = job_body(islands={"count": 1, "replicas": 1})
    smaller["metadata"]["resourceVersion"] = "500"
    asyncio.run(rt.see_job(smaller))
    kube.calls.clear()
    _sync(kube, rt, reconcile=True)
    deleted = sorted(d for m, d in kube.calls if m == "delete")
    assert deleted == ["Service/demo-island-1", "StatefulSet/demo-island-1"]
    assert "list_labelled" not in kube.methods()
    assert ("StatefulSet", "demo-island-1") not in set(rt.children.keys())


def test_sync_job_resync_reads_the_job_and_lists_again() -> None:
    body = job_body()
    kube = FakeKube(body)
    rt = _runtime(body)
    _sync(kube, rt, reconcile=True, poll=True)
    kube.calls.clear()
    _sync(kube, rt, reconcile=True, poll=True)
    assert "list_labelled" not in kube.methods() and "get_job" not in kube.methods()
    rt.resynced_at -= RESYNC_INTERVAL
    kube.calls.clear()
    _sync(kube, rt, reconcile=False, poll=True)
    assert kube.methods()[0] == "get_job"
    assert sorted(d for m, d in kube.calls if m == "list_labelled") == ["Pod"]
    _sync(kube, rt, reconcile=True, poll=True)  # the children follow at the next reconcile
    assert sorted(d for m, d in kube.calls if m == "list_labelled") == [
        "ConfigMap",
        "Deployment",
        "NetworkPolicy",
        "Pod",
        "Service",
        "StatefulSet",
    ]


def test_sync_job_resyncs_are_spread_over_a_quarter_of_the_interval() -> None:
    intervals = [resync_interval("ns1", f"job-{i}") for i in range(200)]
    assert all(RESYNC_INTERVAL * 0.75 <= t <= RESYNC_INTERVAL for t in intervals)
    assert max(intervals) - min(intervals) > RESYNC_INTERVAL * 0.2  # spread, not one moment
    assert resync_interval("ns1", "job-7") == intervals[7]  # fixed per job
    body = job_body()
    kube = FakeKube(body)
    rt = _runtime(body)
    _sync(kube, rt, reconcile=True, poll=True)
    rt.resynced_at -= resync_interval("ns1", "demo") - 1.0  # one second before it is due
    kube.calls.clear()
    _sync(kube, rt, reconcile=False, poll=True)
    assert "get_job" not in kube.methods()
    rt.resynced_at -= 1.0
    _sync(kube, rt, reconcile=False, poll=True)
    assert kube.methods()[0] == "get_job"


def test_sync_job_builds_the_children_again_only_when_an_input_changed() -> None:
    body = job_body()
    kube = FakeKube(body)
    rt = _runtime(body)
    _sync(kube, rt, reconcile=True)
    builds = rt.desired.builds
    for _ in range(3):
        _sync(kube, rt, reconcile=True)
    assert rt.desired.builds == builds  # same job, spec, credential: the same objects
    bigger = job_body(islands={"count": 3, "replicas": 1})
    bigger["metadata"]["resourceVersion"] = "500"
    asyncio.run(rt.see_job(bigger))
    kube.calls.clear()
    _sync(kube, rt, reconcile=True)
    assert rt.desired.builds == builds + 1
    applied = {d for m, d in kube.calls if m == "apply"}
    assert applied == {
        "ConfigMap/demo-config",
        "Service/demo-island-2",
        "StatefulSet/demo-island-2",
    }
    spec = parse_job_spec(bigger["spec"])
    fresh = resources.build_children(
        JobRef.from_body(bigger), spec, islands_running=True, network=rt.network
    )
    assert rt.desired.children == fresh  # what a fresh build gives


def test_sync_job_reports_a_job_found_gone() -> None:
    body = job_body()
    kube = FakeKube(body)
    rt = _runtime(body)
    kube.job = None
    assert not _sync(kube, rt, reconcile=True)  # the status patch finds no job
    rt.resynced_at -= RESYNC_INTERVAL
    assert not _sync(kube, rt, reconcile=False, poll=True)  # the resync finds no job


def test_sync_job_generated_token_checked_once_per_resync() -> None:
    body = job_body(syncer={})
    kube = FakeKube(body)
    rt = _runtime(body)
    _sync(kube, rt, reconcile=True)
    assert ("create", "Secret/demo-token") in kube.calls
    assert ("apply", "Secret/demo-island-tokens") in kube.calls
    kube.calls.clear()
    _sync(kube, rt, reconcile=True)
    secret_calls = [d for m, d in kube.calls if "secret" in m or d.startswith("Secret/")]
    assert secret_calls == []


def test_sync_job_waits_for_the_job_and_leaves_deleted_jobs_alone() -> None:
    kube = FakeKube(job_body())
    unseen = JobRuntime(namespace="ns1", name="demo")
    assert _sync(kube, unseen, reconcile=True) and kube.calls == []
    deleting = job_body()
    deleting["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    assert _sync(kube, _runtime(deleting), reconcile=True) and kube.calls == []


def test_sync_job_invalid_spec_is_permanent() -> None:
    body = job_body(syncer={}, sync={"quorum": 5})  # 5 of 2 in-cluster islands
    rt = _runtime(body)
    with pytest.raises(kopf.PermanentError, match="quorum"):
        _sync(FakeKube(body), rt, reconcile=True)
    assert rt.spec_error is not None and "quorum" in rt.spec_error
