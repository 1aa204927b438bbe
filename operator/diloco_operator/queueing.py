"""Kueue: each island admitted on its own, the syncer kept outside the quota (pure).

A job joins a Kueue LocalQueue the way Kueue users mark any workload: the label
`kueue.x-k8s.io/queue-name` on the DiLoCoJob. The operator then

- labels every island StatefulSet with it: Kueue's StatefulSet integration admits one
  StatefulSet as one pod group, so each island is admitted (or preempted) on its own, against
  its own quota, while the others train (docs/kueue.md says why this integration);
- keeps the syncer out of the job's queue: its pod template loses the queue label (and the
  workload priority label) the job's labels would otherwise pass on. The syncer is one CPU
  process that holds the job's merged weights; an island admitted while the syncer waited
  would hold quota for nothing, and a syncer suspended by Kueue would lose its state with an
  emptyDir. Platforms that must account for it put a ResourceQuota on the namespace.

An island's pods that carry Kueue's admission scheduling gate are "waiting for quota": the
membership drops the island at the syncer (so neither the quorum nor the grace window waits for
it), and re-adds it once its pods are Ready, as it re-adds any island that was dropped. A job
without the label gets exactly the children it got before.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from diloco_operator.resources.naming import JobRef, stamp

# Kueue's names (sigs.k8s.io/kueue/pkg/controller/constants and .../jobs/pod/constants).
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_CLASS_LABEL = "kueue.x-k8s.io/priority-class"
ADMISSION_GATE = "kueue.x-k8s.io/admission"
# The labels the syncer must not carry: either would put it into a queue of its own.
SYNCER_UNQUEUED = (QUEUE_LABEL, PRIORITY_CLASS_LABEL)

WAITING_REASON = "waiting for quota"


def queue_name(job: JobRef) -> str | None:
    """The LocalQueue the job's islands are admitted through, None when it has none."""
    value = dict(job.pod_labels).get(QUEUE_LABEL, "").strip()
    return value or None


def queued_children(
    job: JobRef, children: Iterable[dict[str, Any]], *, islands_running: bool = True
) -> list[dict[str, Any]]:
    """The job's children with the queue applied: island StatefulSets labelled, the syncer's
    pods unlabelled. Without a queue the same objects come back untouched.

    While a queued job's islands are down (suspended or finished) it has no island
    StatefulSets at all: they are deleted, not scaled to zero. Kueue (v0.17.0, issue
    kubernetes-sigs/kueue#12232) releases a scaled-to-zero StatefulSet's quota only if the
    garbage collector deletes its Workload, and it removes the StatefulSet's owner reference
    from the Workload when the replicas reach zero: if the pods were gone first (a loaded
    control plane), the garbage collector had already dropped their references, so the Workload
    is left with no owner, is never collected, and holds the job's quota for good (seen in CI:
    a ClusterQueue's usage still 2 CPUs three minutes after a suspend). A deleted StatefulSet is
    an owner that disappears, which the garbage collector always follows up: the Workload goes
    once its pods have. Resuming creates them again under the same names."""
    queue = queue_name(job)
    out = list(children)
    if queue is None:
        return out
    if not islands_running:
        out = [child for child in out if child["kind"] != "StatefulSet"]
    inherited = {k: v for k, v in job.pod_labels if k in SYNCER_UNQUEUED}
    return [_queued(child, inherited) for child in out]


def queued_keys(
    job: JobRef, keys: Iterable[tuple[str, str]], *, islands_running: bool
) -> list[tuple[str, str]]:
    """resources.child_keys as queued_children leaves them: a queued job whose islands are
    down has no island StatefulSets, so none is read before the writes (a suspended job's
    reconciles would otherwise look each one up, and find nothing, every time)."""
    if islands_running or queue_name(job) is None:
        return list(keys)
    return [k for k in keys if k[0] != "StatefulSet"]


def _queued(child: dict[str, Any], inherited: Mapping[str, str]) -> dict[str, Any]:
    """One child with the job's Kueue labels (`inherited`) applied as the module says."""
    if child["kind"] == "StatefulSet":
        out = copy.deepcopy(child)
        out["metadata"].setdefault("labels", {}).update(inherited)
        return stamp(out)
    if child["kind"] == "Deployment":
        # Only what the job's labels passed on: a queue the user gave the syncer itself
        # (spec.syncer.template) is theirs to keep.
        template_labels = child["spec"]["template"]["metadata"].get("labels") or {}
        if not any(template_labels.get(k) == v for k, v in inherited.items()):
            return child
        out = copy.deepcopy(child)
        for meta in (out["metadata"], out["spec"]["template"]["metadata"]):
            labels = meta.get("labels") or {}
            for key, value in inherited.items():
                if labels.get(key) == value:
                    del labels[key]
        return stamp(out)
    return child


def pod_gated(pod: Mapping[str, Any]) -> bool:
    """The pod is held by Kueue's admission gate: its pod group has no quota yet."""
    gates = (pod.get("spec") or {}).get("schedulingGates") or []
    return any(isinstance(g, Mapping) and g.get("name") == ADMISSION_GATE for g in gates)


def pod_queued(pod: Mapping[str, Any]) -> bool:
    """The pod belongs to a Kueue queue (the label Kueue reads)."""
    return bool(((pod.get("metadata") or {}).get("labels") or {}).get(QUEUE_LABEL))


class QueuedIsland(Protocol):
    """What the quota view reads of an island's health (health.IslandHealth)."""

    @property
    def name(self) -> str: ...

    @property
    def queued(self) -> bool: ...

    @property
    def waiting_for_quota(self) -> bool: ...


def waiting_islands(islands: Iterable[QueuedIsland]) -> list[str]:
    """The islands whose pods wait for Kueue's admission, in the given order."""
    return [i.name for i in islands if i.waiting_for_quota]


def quota_condition(islands: Iterable[QueuedIsland]) -> tuple[bool, str, str] | None:
    """(status, reason, message) of the WaitingForQuota condition; None for a job none of
    whose pods is queued (no queue label, or no pods yet), which gets no such condition."""
    islands = list(islands)
    if not any(i.queued for i in islands):
        return None
    waiting = waiting_islands(islands)
    if not waiting:
        return False, "Admitted", "every island with pods is admitted"
    return True, "WaitingForQuota", f"{WAITING_REASON}: " + ", ".join(waiting)
