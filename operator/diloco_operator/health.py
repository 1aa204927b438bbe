"""Island health from pods, and the syncer membership changes it calls for (pure).

An island is healthy when every pod it should have (`STS-0` .. `STS-(replicas-1)`) exists, is not
being deleted, and is Ready. When a healthy island turns unhealthy the operator asks the syncer to
drop it from the quorum; when it is healthy again, to re-add it. Islands that have never been
healthy are left alone while they start, however slowly: the syncer's quorum waits for islands
that have not joined (up to islands.startupTimeoutSeconds, a safety net for a pod that stays
Pending). One whose pod crash-loops before it was ever healthy has failed, not started slowly: it
is dropped, so the quorum stops waiting for it, and re-added once healthy.

An island whose pods Kueue has not admitted (queueing.py) waits for quota: it is dropped with
that reason whether or not it was ever healthy, so neither the quorum nor the grace window waits
for it, and re-added like any dropped island once its pods are Ready (admitted, or re-admitted
after a preemption).

A pod on a node that stopped reporting (NotReady or Unknown) is not Ready in the API, but only
because the node lifecycle controller says so: it sets the pod's Ready condition False and leaves
ContainersReady as the kubelet last reported it (True), where a kubelet never reports a pod with
ready containers not Ready (our pods have no readiness gates). The control plane has lost the
kubelet, which says nothing of the learner and the syncer: a kubelet stopped or restarting, or a
node cut from the control plane only, leaves the learner training and heartbeating the syncer.
Such an island is not dropped: the syncer's own heartbeat timeout (sync.heartbeatTimeoutSeconds)
takes out of the quorum an island that really stopped reaching it, sooner than the node controller
marks a node NotReady, and takes it back when it heartbeats again; a drop here would only throw
away the pushes of an island that kept working. Once the pods are evicted (deleted) or report not
Ready themselves, the island is unhealthy as usual.

The operator re-adds only what it dropped for pod health or quota. An island the syncer
dropped itself for sending bad work again and again (its status says so:
protocol.DROPPED_FOR_REFUSALS) is left out, however healthy its pods are, and is not dropped
again either (that would overwrite the syncer's reason, and the next healthy pass would re-add
it).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from diloco_operator.queueing import WAITING_REASON, pod_gated, pod_queued
from diloco_operator.resources import COMPONENT_LABEL, COMPONENT_SYNCER, ISLAND_LABEL

ACTIVE = "active"
DROPPED = "dropped"
CRASH_LOOP_REASON = "CrashLoopBackOff"


@dataclass(frozen=True)
class PodView:
    """What the operator needs to know about one pod."""

    name: str
    island: str | None
    component: str | None
    ready: bool
    restarts: int
    crash_looping: bool
    gated: bool = False  # held by Kueue's admission gate (queueing.py)
    queued: bool = False  # carries a Kueue queue label
    # Not Ready only because its node stopped reporting (the module's docstring says how told).
    node_unreported: bool = False


def pod_view(pod: Mapping[str, Any]) -> PodView:
    """Summarise a pod object (as the API returns it)."""
    meta = pod.get("metadata", {})
    status = pod.get("status") or {}
    labels = meta.get("labels") or {}
    conditions = status.get("conditions") or []
    true = {c.get("type") for c in conditions if c.get("status") == "True"}
    ready_condition = "Ready" in true
    ready = (
        ready_condition and status.get("phase") == "Running" and not meta.get("deletionTimestamp")
    )
    containers = status.get("containerStatuses") or []
    restarts = sum(int(c.get("restartCount", 0)) for c in containers)
    crash = any(
        ((c.get("state") or {}).get("waiting") or {}).get("reason") == CRASH_LOOP_REASON
        for c in containers
    )
    return PodView(
        name=meta.get("name", ""),
        island=labels.get(ISLAND_LABEL),
        component=labels.get(COMPONENT_LABEL),
        ready=ready,
        restarts=restarts,
        crash_looping=crash,
        gated=pod_gated(pod),
        queued=pod_queued(pod),
        node_unreported=(
            not ready_condition
            and "ContainersReady" in true
            and status.get("phase") == "Running"
            and not meta.get("deletionTimestamp")
        ),
    )


@dataclass(frozen=True)
class IslandHealth:
    """One island's pods, summarised."""

    name: str
    desired_pods: int
    ready_pods: int
    restarts: int
    crash_looping_pods: int
    missing: tuple[str, ...]  # expected pods that do not exist
    not_ready: tuple[str, ...]  # expected pods that exist but are not Ready
    gated: int = 0  # pods Kueue has not admitted yet (its admission gate)
    queued: bool = False  # the island's pods are in a Kueue queue
    unreported: tuple[str, ...] = ()  # not Ready only because their node stopped reporting

    @property
    def node_unreported(self) -> bool:
        """Unhealthy only because the nodes of its not-Ready pods stopped reporting: every
        expected pod exists and none is not Ready by its own kubelet's word."""
        return (
            not self.healthy
            and not self.missing
            and bool(self.not_ready)
            and set(self.not_ready) == set(self.unreported)
        )

    @property
    def waiting_for_quota(self) -> bool:
        """Kueue holds the island's pods until its quota admits them (all or none: one
        StatefulSet is one pod group)."""
        return self.gated > 0 and not self.healthy

    @property
    def healthy(self) -> bool:
        """All expected pods exist and are Ready (an island of zero pods is not healthy)."""
        return self.desired_pods > 0 and self.ready_pods == self.desired_pods

    def describe(self) -> str:
        """A short reason for the island's state, naming the pods at fault."""
        if self.healthy:
            return f"all {self.desired_pods} pods Ready"
        parts = [f"{self.ready_pods}/{self.desired_pods} pods Ready"]
        if self.gated:
            parts.append(f"{self.gated} not admitted by Kueue yet")
        if self.missing:
            parts.append("missing: " + ", ".join(self.missing))
        if self.not_ready:
            parts.append("not Ready: " + ", ".join(self.not_ready))
        if self.unreported:
            parts.append("node not reporting: " + ", ".join(self.unreported))
        return "; ".join(parts)


def island_health(
    statefulsets: Mapping[str, str], replicas: int | Mapping[str, int], pods: Iterable[PodView]
) -> dict[str, IslandHealth]:
    """Health of each island, given {island: StatefulSet name}, the replicas of every island
    (or {island: replicas}, islands.overrides giving some their own) and the job's pods."""
    by_name = {p.name: p for p in pods}
    out: dict[str, IslandHealth] = {}
    for island, sts in statefulsets.items():
        want = replicas if isinstance(replicas, int) else replicas[island]
        expected = [f"{sts}-{i}" for i in range(want)]
        present = [by_name[n] for n in expected if n in by_name and by_name[n].island == island]
        names = {p.name for p in present}
        out[island] = IslandHealth(
            name=island,
            desired_pods=want,
            ready_pods=sum(p.ready for p in present),
            restarts=sum(p.restarts for p in present),
            crash_looping_pods=sum(p.crash_looping for p in present),
            missing=tuple(n for n in expected if n not in names),
            not_ready=tuple(p.name for p in present if not p.ready),
            gated=sum(p.gated for p in present),
            queued=any(p.queued for p in present),
            unreported=tuple(p.name for p in present if not p.ready and p.node_unreported),
        )
    return out


def syncer_pods(pods: Iterable[PodView]) -> list[PodView]:
    """The job's syncer pods."""
    return [p for p in pods if p.component == COMPONENT_SYNCER]


@dataclass(frozen=True)
class MembershipChange:
    """One PUT /v1/islands/{island} to send."""

    island: str
    state: str  # ACTIVE or DROPPED
    reason: str


@dataclass
class MembershipDecisions:
    """What the operator decided and what the syncer acknowledged, per island (per job).

    Kept in the operator's memory. After an operator restart it is empty and is rebuilt from the
    syncer's reported states, so decisions survive restarts without being duplicated.
    """

    seen_healthy: set[str] = field(default_factory=set)
    wanted: dict[str, str] = field(default_factory=dict)
    acknowledged: dict[str, str] = field(default_factory=dict)

    def decide(
        self,
        health: Mapping[str, IslandHealth],
        syncer_states: Mapping[str, str] | None,
        *,
        islands_running: bool,
        is_own_island: Callable[[str], bool] = lambda _name: False,
        syncer_dropped: Collection[str] = frozenset(),
    ) -> list[MembershipChange]:
        """Update the decisions from fresh health (and the syncer's states, when known) and
        return the changes the syncer has not acknowledged yet.

        `health` covers the desired islands. `is_own_island` recognises this job's island names
        among those the syncer reports (a multi-region syncer also knows other clusters'
        islands): an own island that is no longer desired (scaled away) is dropped.
        While the job is suspended or finished, islands are down on purpose: no changes.
        `syncer_dropped`: islands the syncer dropped for refused pushes (SyncerView's
        dropped_for_refusals):
        forgotten here, so nothing is sent for them whatever their pods do.
        """
        reported = dict(syncer_states or {})
        if not islands_running:
            self.seen_healthy.clear()
            return []
        for name in syncer_dropped:
            self._forget(name)
        reasons: dict[str, str] = {}
        for name, island in health.items():
            if name in syncer_dropped:
                continue
            if island.healthy:
                self.seen_healthy.add(name)
                if self.wanted.get(name) == DROPPED or reported.get(name) == DROPPED:
                    self.wanted[name] = ACTIVE
                    reasons[name] = "island healthy again: " + island.describe()
            elif island.waiting_for_quota:
                # Out of the quorum until admitted: neither the quorum nor the grace window
                # waits for it (a dropped island is not awaited), and it is not failing.
                self.wanted[name] = DROPPED
                reasons[name] = f"{WAITING_REASON}: " + island.describe()
            elif island.node_unreported:
                # Left to the syncer's heartbeat timeout (the module's docstring says why).
                continue
            elif (
                name in self.seen_healthy
                or reported.get(name) == ACTIVE
                or island.crash_looping_pods
            ):
                self.wanted[name] = DROPPED
                reasons[name] = "island unhealthy: " + island.describe()
        known = set(self.wanted) | self.seen_healthy | {n for n in reported if is_own_island(n)}
        known -= set(syncer_dropped)
        for name in sorted(known - set(health)):
            if self.acknowledged.get(name) == DROPPED and reported.get(name) != ACTIVE:
                self._forget(name)  # removed and the syncer knows: nothing left to do
            elif self.wanted.get(name) == DROPPED or reported.get(name, ACTIVE) in (ACTIVE, ""):
                self.wanted[name] = DROPPED
                reasons[name] = "island removed from the job"
            else:
                self._forget(name)  # never active at the syncer: nothing to tell it
        changes = []
        for name, state in sorted(self.wanted.items()):
            contradicted = reported.get(name) in (ACTIVE, DROPPED) and reported[name] != state
            if self.acknowledged.get(name) != state or contradicted:
                reason = reasons.get(name) or f"island {state}"
                changes.append(MembershipChange(island=name, state=state, reason=reason))
        return changes

    def acknowledge(self, change: MembershipChange) -> None:
        """The syncer accepted a change."""
        self.acknowledged[change.island] = change.state

    def _forget(self, name: str) -> None:
        self.seen_healthy.discard(name)
        self.wanted.pop(name, None)
        self.acknowledged.pop(name, None)
