"""Kueue per island (diloco_operator.queueing): islands labelled with the job's queue, the syncer
kept out of it, gated pods waiting for quota, the membership and the WaitingForQuota condition."""

from __future__ import annotations

import copy
from typing import Any

from diloco_operator import queueing, resources
from diloco_operator.api import parse_job_spec
from diloco_operator.conditions import CONDITION_TYPES, QUOTA_CONDITION, job_conditions
from diloco_operator.desired import DesiredChildren
from diloco_operator.health import ACTIVE, DROPPED, MembershipDecisions, island_health, pod_view
from diloco_operator.phase import decide_phase
from diloco_operator.resources import SPEC_HASH, TEMPLATE_HASH, JobRef, NetworkOptions

from .observations import observation

SPEC = {"image": "x", "islands": {"count": 2, "replicas": 2}}
NO_NETWORK = NetworkOptions(enabled=False)


def _job(**labels: str) -> JobRef:
    return JobRef(name="job", namespace="ns", uid="u1", pod_labels=tuple(sorted(labels.items())))


def _children(job: JobRef) -> list[dict[str, Any]]:
    return DesiredChildren().build(
        job,
        SPEC,
        parse_job_spec(SPEC),
        running=True,
        credential="c",
        network=NO_NETWORK,
    )


def _by_kind(children: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [c for c in children if c["kind"] == kind]


def test_queue_name_comes_from_the_jobs_kueue_label() -> None:
    assert queueing.queue_name(_job()) is None
    assert queueing.queue_name(_job(**{queueing.QUEUE_LABEL: " "})) is None
    assert queueing.queue_name(_job(**{queueing.QUEUE_LABEL: "team-a"})) == "team-a"


def test_a_job_without_a_queue_gets_the_children_it_always_got() -> None:
    job = _job(team="a")
    built = _children(job)
    again = queueing.queued_children(job, copy.deepcopy(built))
    assert again == built
    assert all(queueing.QUEUE_LABEL not in (c["metadata"].get("labels") or {}) for c in built)


def test_every_island_statefulset_carries_the_queue_and_priority() -> None:
    labels = {queueing.QUEUE_LABEL: "team-a", queueing.PRIORITY_CLASS_LABEL: "low"}
    plain, queued = _children(_job()), _children(_job(**labels))
    islands = _by_kind(queued, "StatefulSet")
    assert len(islands) == 2
    for sts in islands:
        assert sts["metadata"]["labels"][queueing.QUEUE_LABEL] == "team-a"
        assert sts["metadata"]["labels"][queueing.PRIORITY_CLASS_LABEL] == "low"
        assert sts["spec"]["template"]["metadata"]["labels"][queueing.QUEUE_LABEL] == "team-a"
    # Re-stamped: the planner sees the labelled object as a change from an unlabelled one.
    hashes = {c["metadata"]["annotations"][SPEC_HASH] for c in _by_kind(plain, "StatefulSet")}
    assert hashes.isdisjoint(c["metadata"]["annotations"][SPEC_HASH] for c in islands), (
        "queued islands must not keep the unqueued spec hash"
    )


def test_the_syncer_is_kept_outside_every_queue() -> None:
    labels = {queueing.QUEUE_LABEL: "team-a", queueing.PRIORITY_CLASS_LABEL: "low"}
    (syncer,) = _by_kind(_children(_job(**labels)), "Deployment")
    for meta in (syncer["metadata"], syncer["spec"]["template"]["metadata"]):
        assert not set(meta.get("labels") or {}) & set(queueing.SYNCER_UNQUEUED)
    # Without the queue the job's labels reach the syncer's pods as before (other schedulers).
    (plain,) = _by_kind(_children(_job(team="a")), "Deployment")
    assert plain["spec"]["template"]["metadata"]["labels"]["team"] == "a"


def test_queueing_changes_no_pod_template_hash_of_an_island() -> None:
    """The queue is a label of the StatefulSet: islands never roll for it."""
    labels = {queueing.QUEUE_LABEL: "team-a"}
    one = _by_kind(_children(_job(**labels)), "StatefulSet")
    built = _by_kind(
        queueing.queued_children(_job(**labels), _children(_job(**labels))), "StatefulSet"
    )
    assert [s["metadata"]["annotations"][TEMPLATE_HASH] for s in one] == [
        s["metadata"]["annotations"][TEMPLATE_HASH] for s in built
    ]


def test_a_queued_job_has_no_island_statefulsets_while_its_islands_are_down() -> None:
    """Suspended or finished, a queued job's islands are deleted (Kueue's scale-to-zero can leave
    a Workload holding quota: queueing.queued_children says why); the syncer and the islands'
    Services stay, and a job without a queue keeps its StatefulSets at zero replicas."""
    labels = {queueing.QUEUE_LABEL: "team-a"}

    def down(job: JobRef) -> list[dict[str, Any]]:
        return DesiredChildren().build(
            job, SPEC, parse_job_spec(SPEC), running=False, credential="c", network=NO_NETWORK
        )

    queued, plain = down(_job(**labels)), down(_job())
    assert _by_kind(queued, "StatefulSet") == []
    assert len(_by_kind(queued, "Deployment")) == 1 and len(_by_kind(queued, "Service")) == 3
    assert [s["spec"]["replicas"] for s in _by_kind(plain, "StatefulSet")] == [0, 0]
    # The keys read before the writes are those children's: no lookup of a deleted island.
    for job, built in ((_job(**labels), queued), (_job(), plain)):
        keys = resources.child_keys(job, parse_job_spec(SPEC), network=NO_NETWORK)
        kept = queueing.queued_keys(job, keys, islands_running=False)
        assert kept == [(c["kind"], c["metadata"]["name"]) for c in built]
    # Running again, the queued job's islands are back under the same names.
    names = {c["metadata"]["name"] for c in _by_kind(_children(_job(**labels)), "StatefulSet")}
    assert names == {"job-island-0", "job-island-1"}


def _pod(name: str, island: str, *, gated: bool, ready: bool, queue: str = "q") -> dict[str, Any]:
    labels = {"app.kubernetes.io/component": "learner", "diloco.dev/island": island}
    if queue:
        labels[queueing.QUEUE_LABEL] = queue
    spec: dict[str, Any] = {}
    if gated:
        spec["schedulingGates"] = [{"name": queueing.ADMISSION_GATE}]
    return {
        "metadata": {"name": name, "labels": labels},
        "spec": spec,
        "status": {
            "phase": "Running" if ready else "Pending",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


STS = {"island-0": "job-island-0", "island-1": "job-island-1"}


def _health(island1_gated: bool, island1_ready: bool = False, queue: str = "q"):
    pods = [
        _pod("job-island-0-0", "island-0", gated=False, ready=True, queue=queue),
        _pod("job-island-0-1", "island-0", gated=False, ready=True, queue=queue),
        _pod("job-island-1-0", "island-1", gated=island1_gated, ready=island1_ready, queue=queue),
        _pod("job-island-1-1", "island-1", gated=island1_gated, ready=island1_ready, queue=queue),
    ]
    return island_health(STS, 2, [pod_view(p) for p in pods])


def test_gated_pods_make_an_island_wait_for_quota() -> None:
    health = _health(island1_gated=True)
    assert not health["island-0"].waiting_for_quota and health["island-0"].queued
    assert health["island-1"].waiting_for_quota and health["island-1"].gated == 2
    assert "2 not admitted by Kueue yet" in health["island-1"].describe()
    assert queueing.waiting_islands(health.values()) == ["island-1"]
    assert not pod_view(_pod("p", "island-0", gated=False, ready=False)).gated


def test_an_island_waiting_for_quota_is_dropped_though_it_never_joined() -> None:
    """Never healthy, never crash-looping: without quota it would be left alone, and the
    syncer's quorum would wait for it; waiting for quota, it is dropped with that reason."""
    m = MembershipDecisions()
    (change,) = m.decide(_health(island1_gated=True), {}, islands_running=True)
    assert change.island == "island-1" and change.state == DROPPED
    assert change.reason.startswith(queueing.WAITING_REASON)
    m.acknowledge(change)
    assert m.decide(_health(island1_gated=True), {"island-1": DROPPED}, islands_running=True) == []
    # Admitted: gates gone, pods start (not Ready yet: still out), then Ready: re-added.
    starting = _health(island1_gated=False, island1_ready=False)
    assert m.decide(starting, {"island-1": DROPPED}, islands_running=True) == []
    (readd,) = m.decide(_health(False, True), {"island-1": DROPPED}, islands_running=True)
    assert readd.island == "island-1" and readd.state == ACTIVE


def test_a_preempted_island_is_dropped_for_quota_and_back_when_readmitted() -> None:
    m = MembershipDecisions()
    reported = {"island-0": ACTIVE, "island-1": ACTIVE}
    assert m.decide(_health(False, True), reported, islands_running=True) == []
    (drop,) = m.decide(_health(island1_gated=True), reported, islands_running=True)
    assert drop.state == DROPPED and drop.reason.startswith(queueing.WAITING_REASON)
    m.acknowledge(drop)
    reported["island-1"] = DROPPED
    (back,) = m.decide(_health(False, True), reported, islands_running=True)
    assert back.state == ACTIVE


def test_quota_condition_only_for_queued_jobs() -> None:
    assert queueing.quota_condition(_health(True, queue="").values()) is None
    status, reason, message = queueing.quota_condition(_health(True).values()) or (None, "", "")
    assert status is True and reason == "WaitingForQuota" and message.endswith("island-1")
    assert queueing.quota_condition(_health(False, True).values()) == (
        False,
        "Admitted",
        "every island with pods is admitted",
    )


def test_job_conditions_add_waiting_for_quota_after_the_standard_ones() -> None:
    obs = observation(islands=list(_health(island1_gated=True).values()))
    conditions = job_conditions(decide_phase(obs, None), obs, {})
    assert [c.type for c in conditions] == [*CONDITION_TYPES, QUOTA_CONDITION]
    assert conditions[-1].status == "True" and "island-1" in conditions[-1].message
    assert not any(c.type == "Failed" and c.status == "True" for c in conditions)
    suspended = observation(islands=obs.islands.values(), spec={"suspend": True})
    kinds = [c.type for c in job_conditions(decide_phase(suspended, None), suspended, {})]
    assert kinds == list(CONDITION_TYPES)


def test_a_queue_the_user_gave_the_syncer_itself_stays() -> None:
    labels = {queueing.QUEUE_LABEL: "team-a"}
    spec = {**SPEC, "syncer": {"template": {"metadata": {"labels": {queueing.QUEUE_LABEL: "ops"}}}}}
    children = DesiredChildren().build(
        _job(**labels), spec, parse_job_spec(spec), running=True, credential="c", network=NO_NETWORK
    )
    (syncer,) = _by_kind(children, "Deployment")
    assert syncer["spec"]["template"]["metadata"]["labels"][queueing.QUEUE_LABEL] == "ops"
