"""Island health from pods and the membership changes it calls for."""

from __future__ import annotations

from typing import Any

from diloco_operator.health import (
    ACTIVE,
    DROPPED,
    MembershipDecisions,
    island_health,
    pod_view,
    syncer_pods,
)

from .observations import syncer_view


def _pod(
    name: str,
    island: str | None = "island-0",
    *,
    ready: bool = True,
    phase: str = "Running",
    deleting: bool = False,
    restarts: int = 0,
    waiting: str | None = None,
    component: str = "learner",
) -> dict[str, Any]:
    labels = {"app.kubernetes.io/component": component}
    if island:
        labels["diloco.dev/island"] = island
    meta: dict[str, Any] = {"name": name, "labels": labels}
    if deleting:
        meta["deletionTimestamp"] = "2024-01-01T00:00:00Z"
    state = {"waiting": {"reason": waiting}} if waiting else {"running": {}}
    return {
        "metadata": meta,
        "status": {
            "phase": phase,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": [{"name": "learner", "restartCount": restarts, "state": state}],
        },
    }


STS = {"island-0": "job-island-0", "island-1": "job-island-1"}


def _health(*pods: dict[str, Any], replicas: int = 2):
    return island_health(STS, replicas, [pod_view(p) for p in pods])


def test_pod_view_ready_needs_condition_phase_and_no_deletion() -> None:
    assert pod_view(_pod("a")).ready
    assert not pod_view(_pod("a", ready=False)).ready
    assert not pod_view(_pod("a", phase="Pending")).ready
    assert not pod_view(_pod("a", deleting=True)).ready
    view = pod_view(_pod("a", restarts=7, waiting="CrashLoopBackOff"))
    assert view.crash_looping and view.restarts == 7


def test_island_health_all_pods_ready() -> None:
    health = _health(
        _pod("job-island-0-0"),
        _pod("job-island-0-1"),
        _pod("job-island-1-0", "island-1"),
        _pod("job-island-1-1", "island-1", ready=False),
    )
    assert health["island-0"].healthy and health["island-0"].ready_pods == 2
    assert not health["island-1"].healthy
    assert health["island-1"].not_ready == ("job-island-1-1",)
    assert "job-island-1-1" in health["island-1"].describe()


def test_island_health_missing_pod_is_unhealthy() -> None:
    health = _health(_pod("job-island-0-0"))
    assert not health["island-0"].healthy
    assert health["island-0"].missing == ("job-island-0-1",)
    # Pods beyond `replicas` (a scale-down in progress) do not count.
    assert _health(_pod("job-island-0-0"), _pod("job-island-0-5"), replicas=1)["island-0"].healthy


def test_island_health_zero_replicas_is_not_healthy() -> None:
    assert not _health(replicas=0)["island-0"].healthy


def test_syncer_pods_and_states() -> None:
    views = [pod_view(_pod("s", None, component="syncer")), pod_view(_pod("job-island-0-0"))]
    assert [p.name for p in syncer_pods(views)] == ["s"]
    view = syncer_view({"islands": {"island-0": {"state": "active"}}})
    assert view is not None and view.island_states() == {"island-0": "active"}


def _ready(*islands: str) -> dict:
    pods = []
    for island in islands:
        pods += [_pod(f"job-{island}-0", island), _pod(f"job-{island}-1", island)]
    return _health(*pods)


def test_membership_never_healthy_island_is_left_alone() -> None:
    m = MembershipDecisions()
    assert m.decide(_ready("island-0"), {}, islands_running=True) == []


def test_membership_crash_looping_island_that_never_joined_is_dropped_then_readded() -> None:
    """A pod in CrashLoopBackOff has failed, not started slowly: the syncer's quorum must stop
    waiting for the island (it awaits islands that have not joined); Pending pods are waited for."""
    m = MembershipDecisions()
    pending = _health(_pod("job-island-1-0", "island-1", ready=False, phase="Pending"))
    assert m.decide(pending, {}, islands_running=True) == []
    crash = _pod("job-island-1-0", "island-1", ready=False, waiting="CrashLoopBackOff")
    (change,) = m.decide(_health(crash), {}, islands_running=True)
    assert (change.island, change.state) == ("island-1", DROPPED)
    assert "island unhealthy" in change.reason
    m.acknowledge(change)
    ok = [_pod(f"job-island-1-{i}", "island-1") for i in range(2)]
    (back,) = m.decide(_health(*ok), {"island-1": DROPPED}, islands_running=True)
    assert (back.island, back.state) == ("island-1", ACTIVE)


def test_membership_drop_then_readd() -> None:
    m = MembershipDecisions()
    assert m.decide(_ready("island-0", "island-1"), None, islands_running=True) == []
    (change,) = m.decide(_ready("island-0"), None, islands_running=True)
    assert (change.island, change.state) == ("island-1", DROPPED)
    assert "island unhealthy" in change.reason and "missing" in change.reason
    # Not acknowledged (syncer unreachable): asked again next time.
    assert m.decide(_ready("island-0"), None, islands_running=True) == [change]
    m.acknowledge(change)
    assert m.decide(_ready("island-0"), {"island-1": DROPPED}, islands_running=True) == []
    (back,) = m.decide(_ready("island-0", "island-1"), {"island-1": DROPPED}, islands_running=True)
    assert (back.island, back.state) == ("island-1", ACTIVE)
    m.acknowledge(back)
    assert (
        m.decide(_ready("island-0", "island-1"), {"island-1": ACTIVE}, islands_running=True) == []
    )


def test_membership_after_operator_restart_uses_syncer_states() -> None:
    m = MembershipDecisions()  # fresh memory: the syncer's view tells what was active
    changes = m.decide(
        _ready("island-0"), {"island-0": DROPPED, "island-1": ACTIVE}, islands_running=True
    )
    assert {(c.island, c.state) for c in changes} == {("island-0", ACTIVE), ("island-1", DROPPED)}


def test_membership_resends_when_syncer_contradicts() -> None:
    m = MembershipDecisions()
    m.decide(_ready("island-0", "island-1"), None, islands_running=True)
    (change,) = m.decide(_ready("island-0"), None, islands_running=True)
    m.acknowledge(change)
    # The syncer restarted and forgot: it reports the island active again.
    (again,) = m.decide(_ready("island-0"), {"island-1": ACTIVE}, islands_running=True)
    assert (again.island, again.state) == ("island-1", DROPPED)


def test_membership_removed_island_dropped_once_then_forgotten() -> None:
    m = MembershipDecisions()
    m.decide(_ready("island-0", "island-1"), None, islands_running=True)
    only0 = {"island-0": _ready("island-0")["island-0"]}
    (change,) = m.decide(only0, {"island-1": ACTIVE}, islands_running=True, is_own_island=_own)
    assert (change.island, change.state, change.reason) == (
        "island-1",
        DROPPED,
        "island removed from the job",
    )
    m.acknowledge(change)
    assert m.decide(only0, {"island-1": DROPPED}, islands_running=True, is_own_island=_own) == []
    assert "island-1" not in m.wanted and "island-1" not in m.seen_healthy


def test_membership_other_clusters_islands_untouched() -> None:
    m = MembershipDecisions()
    only0 = {"island-0": _ready("island-0")["island-0"]}
    states = {"island-0": ACTIVE, "eu-island-0": ACTIVE}
    assert m.decide(only0, states, islands_running=True, is_own_island=_own) == []


def test_membership_suspended_job_changes_nothing() -> None:
    m = MembershipDecisions()
    m.decide(_ready("island-0", "island-1"), None, islands_running=True)
    assert m.decide(_ready(), {"island-0": ACTIVE}, islands_running=False) == []


def _own(name: str) -> bool:
    return name.startswith("island-")


# The syncer's reason for an island it dropped itself (gate.py), and the operator's for one it
# dropped for pod health.
BANNED = "refused_pushes: 3 pushes refused in a row (syncer.guards.maxRefusals); the last: x"
UNHEALTHY = "island unhealthy: 1/2 pods Ready; not Ready: job-island-1-1"


def _dropped(**islands: tuple[str, str]) -> set[str]:
    """The islands a syncer reporting these (state, reason) dropped for refused pushes."""
    doc = {name.replace("_", "-"): {"state": s, "reason": r} for name, (s, r) in islands.items()}
    view = syncer_view({"islands": doc})
    assert view is not None
    return view.dropped_for_refusals()


def test_syncer_dropped_islands_reads_the_reason_code() -> None:
    dropped = _dropped(
        island_0=(ACTIVE, ""),
        island_1=(DROPPED, BANNED),
        island_2=(DROPPED, UNHEALTHY),
        island_3=(ACTIVE, BANNED),  # re-added by the admin route: the old reason is no ban
    )
    assert dropped == {"island-1"}


def test_membership_island_the_syncer_dropped_is_not_readded_while_healthy() -> None:
    """Before the fix, the second decide re-added island-1 (its pods are Ready, the syncer says
    dropped): the operator undid the syncer's drop every 5 s."""
    m = MembershipDecisions()
    both = _ready("island-0", "island-1")
    assert m.decide(both, {"island-0": ACTIVE, "island-1": ACTIVE}, islands_running=True) == []
    states = {"island-0": ACTIVE, "island-1": DROPPED}
    banned = _dropped(island_0=(ACTIVE, ""), island_1=(DROPPED, BANNED))
    assert m.decide(both, states, islands_running=True, syncer_dropped=banned) == []
    # Its pods fail and come back: nothing is sent either way (a drop would replace the
    # syncer's reason with the operator's, and the next healthy pass would re-add it).
    only0 = _ready("island-0")
    assert m.decide(only0, states, islands_running=True, syncer_dropped=banned) == []
    assert m.decide(both, states, islands_running=True, syncer_dropped=banned) == []
    assert "island-1" not in m.wanted and "island-1" not in m.seen_healthy


def test_membership_syncer_drop_overrides_the_operators_own_readd() -> None:
    """The operator dropped island-1 for its pods and re-added it (acknowledged active); then
    the syncer dropped it for bad work. The acknowledged 'active' is not sent again as a
    contradiction."""
    m = MembershipDecisions()
    both = _ready("island-0", "island-1")
    m.decide(both, None, islands_running=True)
    (drop,) = m.decide(_ready("island-0"), None, islands_running=True)
    m.acknowledge(drop)
    (back,) = m.decide(both, {"island-1": DROPPED}, islands_running=True)
    assert (back.island, back.state) == ("island-1", ACTIVE)
    m.acknowledge(back)
    banned = {"island-1"}
    assert m.decide(both, {"island-1": DROPPED}, islands_running=True, syncer_dropped=banned) == []


def test_membership_island_the_operator_dropped_is_readded_once_healthy() -> None:
    """The same syncer view with the operator's reason: the island comes back (after an
    operator restart too, from the syncer's states alone)."""
    m = MembershipDecisions()
    states = {"island-0": ACTIVE, "island-1": DROPPED}
    banned = _dropped(island_0=(ACTIVE, ""), island_1=(DROPPED, UNHEALTHY))
    assert banned == set()
    (back,) = m.decide(
        _ready("island-0", "island-1"), states, islands_running=True, syncer_dropped=banned
    )
    assert (back.island, back.state) == ("island-1", ACTIVE)
