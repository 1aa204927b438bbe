"""An island whose node stopped reporting is left to the syncer's heartbeat timeout, not dropped
(health.py's docstring says why). The pods below are written as the API holds them: the kubelet's
own report, and the node lifecycle controller's MarkPodsNotReady (Ready set False, ContainersReady
left as the kubelet last said)."""

from __future__ import annotations

from typing import Any

from diloco_operator.health import ACTIVE, DROPPED, MembershipDecisions, island_health, pod_view

STS = {"island-0": "job-island-0", "island-1": "job-island-1"}


def _pod(
    name: str,
    island: str,
    *,
    ready: bool,
    containers_ready: bool,
    deleting: bool = False,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "labels": {"app.kubernetes.io/component": "learner", "diloco.dev/island": island},
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-11-26T07:55:00Z"
    word = {True: "True", False: "False"}
    return {
        "metadata": meta,
        "status": {
            "phase": "Running",
            "conditions": [
                {"type": "Initialized", "status": "True"},
                {"type": "Ready", "status": word[ready]},
                {"type": "ContainersReady", "status": word[containers_ready]},
                {"type": "PodScheduled", "status": "True"},
            ],
            "containerStatuses": [
                {
                    "name": "learner",
                    "ready": containers_ready,
                    "restartCount": 0,
                    "state": {"running": {}},
                }
            ],
        },
    }


def running(name: str, island: str) -> dict[str, Any]:
    """Ready, as the kubelet reports a pod whose containers pass their probes."""
    return _pod(name, island, ready=True, containers_ready=True)


def unreported(name: str, island: str) -> dict[str, Any]:
    """What the node controller leaves of `running` when its node goes NotReady."""
    return _pod(name, island, ready=False, containers_ready=True)


def failing(name: str, island: str) -> dict[str, Any]:
    """Not Ready by its own kubelet's word (a readiness probe failing)."""
    return _pod(name, island, ready=False, containers_ready=False)


def _health(*pods: dict[str, Any]):
    return island_health(STS, 1, [pod_view(p) for p in pods])


def test_pod_view_tells_a_node_that_stopped_reporting_from_a_failing_pod() -> None:
    assert not pod_view(running("a", "island-0")).node_unreported
    view = pod_view(unreported("a", "island-0"))
    assert not view.ready and view.node_unreported
    assert not pod_view(failing("a", "island-0")).node_unreported
    # Evicted from the NotReady node (deleted): gone, however its containers last looked.
    evicted = _pod("a", "island-0", ready=False, containers_ready=True, deleting=True)
    assert not pod_view(evicted).node_unreported


def test_island_health_unreported_only_when_every_not_ready_pod_is() -> None:
    health = island_health(
        STS,
        2,
        [
            pod_view(unreported("job-island-0-0", "island-0")),
            pod_view(unreported("job-island-0-1", "island-0")),
            pod_view(unreported("job-island-1-0", "island-1")),
            pod_view(failing("job-island-1-1", "island-1")),
        ],
    )
    assert health["island-0"].node_unreported and not health["island-0"].healthy
    assert "node not reporting: job-island-0-0, job-island-0-1" in health["island-0"].describe()
    assert not health["island-1"].node_unreported  # one pod fails by its own kubelet's word
    # A missing pod is never a node that stopped reporting.
    one = island_health(STS, 2, [pod_view(unreported("job-island-0-0", "island-0"))])
    assert not one["island-0"].node_unreported


def test_membership_node_not_ready_drops_nothing_then_a_real_failure_drops() -> None:
    """The chaos run's node NotReady: both islands' pods kept running and heartbeating the syncer,
    which reported both active; before this rule both were dropped for '0/1 pods Ready'."""
    m = MembershipDecisions()
    both_active = {"island-0": ACTIVE, "island-1": ACTIVE}
    calm = _health(running("job-island-0-0", "island-0"), running("job-island-1-0", "island-1"))
    assert m.decide(calm, both_active, islands_running=True) == []
    not_ready = _health(
        unreported("job-island-0-0", "island-0"), unreported("job-island-1-0", "island-1")
    )
    assert m.decide(not_ready, both_active, islands_running=True) == []
    # The node back: nothing was dropped, so nothing to re-add.
    assert m.decide(calm, both_active, islands_running=True) == []
    # A learner failing its probe by its own kubelet's report is dropped as before.
    fails = _health(failing("job-island-0-0", "island-0"), running("job-island-1-0", "island-1"))
    (change,) = m.decide(fails, both_active, islands_running=True)
    assert (change.island, change.state) == ("island-0", DROPPED)
    assert change.reason == "island unhealthy: 0/1 pods Ready; not Ready: job-island-0-0"


def test_membership_evicted_from_a_not_ready_node_is_dropped() -> None:
    """The taint manager evicts pods of a node NotReady for longer than their toleration: a
    pod being deleted is gone, and the island is dropped."""
    m = MembershipDecisions()
    both_active = {"island-0": ACTIVE, "island-1": ACTIVE}
    calm = _health(running("job-island-0-0", "island-0"), running("job-island-1-0", "island-1"))
    assert m.decide(calm, both_active, islands_running=True) == []
    evicted = _pod("job-island-1-0", "island-1", ready=False, containers_ready=True, deleting=True)
    health = _health(unreported("job-island-0-0", "island-0"), evicted)
    (change,) = m.decide(health, both_active, islands_running=True)
    assert (change.island, change.state) == ("island-1", DROPPED)
