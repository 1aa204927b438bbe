"""A child whose name an object the job does not own already has is left alone and reported
(children.py), through the sync's condition and Event."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from diloco_operator import resources
from diloco_operator.children import (
    Conflict,
    holder_of,
    read_children,
    write_child,
    write_children,
)
from diloco_operator.kube import Kube
from diloco_operator.resources import JobRef
from diloco_operator.runtime import JobRuntime
from diloco_operator.sync import sync_job

from .operator_fakes import FakeKube, job_body

JOB = JobRef(name="a-b", namespace="ns1", uid="uid-ab")
OTHER = JobRef(name="a", namespace="ns1", uid="uid-a")


def _sts(owner: JobRef) -> dict[str, Any]:
    """StatefulSet a-b-island-0 as `owner` builds it (job a with prefix b, or job a-b)."""
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {
            "name": "a-b-island-0",
            "namespace": "ns1",
            "labels": {"diloco.dev/job": owner.name},
            "annotations": {},
            "ownerReferences": [resources.owner_reference(owner)],
        },
        "spec": {"replicas": 1},
    }


def _write(kube: FakeKube, obj: dict[str, Any], owned: bool) -> Any:
    return asyncio.run(write_child(cast(Kube, kube), obj, job_uid=JOB.uid, owned=owned))


def test_operator_children_another_jobs_object_is_not_taken() -> None:
    kube = FakeKube(job_body("a-b", uid=JOB.uid))
    kube.objects[("StatefulSet", "a-b-island-0")] = _sts(OTHER)
    result = _write(kube, _sts(JOB), owned=False)
    assert result == Conflict("StatefulSet", "a-b-island-0", "DiLoCoJob a")
    assert kube.methods() == ["get"]  # never applied over it
    owner = kube.objects[("StatefulSet", "a-b-island-0")]["metadata"]["ownerReferences"]
    assert owner[0]["uid"] == OTHER.uid
    assert "StatefulSet a-b-island-0" in result.message() and "DiLoCoJob a" in result.message()


def test_operator_children_new_is_created_and_own_is_applied_with_force() -> None:
    kube = FakeKube(job_body("a-b", uid=JOB.uid))
    stored = _write(kube, _sts(JOB), owned=False)
    assert kube.methods() == ["get", "apply"] and stored["metadata"]["name"] == "a-b-island-0"
    kube.calls.clear()
    _write(kube, _sts(JOB), owned=True)
    assert kube.methods() == ["apply"]
    kube.calls.clear()
    ours = _sts(JOB)
    ours["metadata"]["annotations"][resources.SPEC_HASH] = "same"
    kube.objects[("StatefulSet", "a-b-island-0")] = ours
    _write(kube, ours, owned=False)  # ours with the desired content, not in the watch's view yet
    assert kube.methods() == ["get"]  # nothing to write (e.g. after a restart)
    kube.calls.clear()
    changed = _sts(JOB)
    changed["metadata"]["annotations"][resources.SPEC_HASH] = "new"
    _write(kube, changed, owned=False)
    assert kube.methods() == ["get", "apply"]


def test_operator_children_holder_of_names_owner_or_label() -> None:
    assert holder_of(_sts(OTHER)) == "DiLoCoJob a"
    unowned = _sts(OTHER)
    unowned["metadata"]["ownerReferences"] = []
    assert holder_of(unowned) == "DiLoCoJob a (by its label)"
    unowned["metadata"]["labels"] = {}
    assert "no owner" in holder_of(unowned)


def test_operator_children_sync_reports_a_name_conflict_and_recovers() -> None:
    body = job_body("a-b", uid=JOB.uid, islands={"count": 1, "replicas": 1})
    kube = FakeKube(body)
    kube.objects[("StatefulSet", "a-b-island-0")] = _sts(OTHER)
    rt = JobRuntime(namespace="ns1", name="a-b")
    asyncio.run(rt.see_job(body))
    asyncio.run(sync_job(cast(Kube, kube), rt, reconcile=True, poll_syncer=False))
    assert rt.body is not None
    conditions = {c["type"]: c for c in rt.body["status"]["conditions"]}
    conflict = conditions["NameConflict"]
    assert (conflict["status"], conflict["reason"]) == ("True", "NameTaken")
    assert "StatefulSet a-b-island-0" in conflict["message"]
    assert kube.objects[("StatefulSet", "a-b-island-0")]["metadata"]["labels"] == {
        "diloco.dev/job": "a"
    }
    # Job a goes away: the next reconcile creates ours and the condition clears.
    del kube.objects[("StatefulSet", "a-b-island-0")]
    asyncio.run(sync_job(cast(Kube, kube), rt, reconcile=True, poll_syncer=False))
    conditions = {c["type"]: c for c in rt.body["status"]["conditions"]}
    assert (conditions["NameConflict"]["status"], rt.conflicts) == ("False", [])
    owner = kube.objects[("StatefulSet", "a-b-island-0")]["metadata"]["ownerReferences"]
    assert owner[0]["uid"] == JOB.uid


def test_operator_children_read_beforehand_are_not_read_again() -> None:
    kube = FakeKube(job_body("a-b", uid=JOB.uid))
    kube.objects[("StatefulSet", "a-b-island-0")] = _sts(OTHER)
    new = {**_sts(JOB), "kind": "Service"}  # absent: read as None beforehand
    read = asyncio.run(
        read_children(
            cast(Kube, kube), "ns1", [("StatefulSet", "a-b-island-0"), ("Service", "a-b-island-0")]
        )
    )
    assert read[("Service", "a-b-island-0")] is None
    kube.calls.clear()
    stored, conflicts = asyncio.run(
        write_children(cast(Kube, kube), [_sts(JOB), new], [], job_uid=JOB.uid, read=read)
    )
    # No second read: the other job's StatefulSet is left alone, the absent Service created.
    assert kube.calls == [("apply", "Service/a-b-island-0")]
    assert conflicts == [Conflict("StatefulSet", "a-b-island-0", "DiLoCoJob a")]
    assert [o["metadata"]["name"] for o in stored] == ["a-b-island-0"]
    kube.calls.clear()
    asyncio.run(write_children(cast(Kube, kube), [_sts(JOB)], [], job_uid=JOB.uid))
    assert kube.methods() == ["get"]  # not read beforehand: read here, as before
