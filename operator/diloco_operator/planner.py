"""Pure reconcile planning: desired children + observed children -> what to change.

Level-triggered: the plan depends only on the two sets of objects, never on which event woke the
reconciler, so running it again after a partial failure finishes the job.

Island pod templates roll one island at a time: an island StatefulSet whose pod template changed
is updated only while no other island is mid-rollout (its new pods not all Ready yet). Islands with
no pods to disrupt (scaled to zero, or not Ready anyway) are updated at once. If an updated island
never becomes Ready (a bad image), the rollout stops there: the other islands keep training.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from diloco_operator.resources import SPEC_HASH, TEMPLATE_HASH

# Kinds the reconciler lists and may delete when no longer desired. The Secrets are absent on
# purpose (the operator may not list Secrets): credential_secrets.py writes them, garbage collection
# deletes them with the job.
MANAGED_KINDS = ("ConfigMap", "Service", "StatefulSet", "Deployment", "NetworkPolicy")

Key = tuple[str, str]  # (kind, name)


@dataclass
class Plan:
    """Changes that make the cluster match the spec."""

    apply: list[dict[str, Any]] = field(default_factory=list)  # create or update (server-side)
    delete: list[Key] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)  # StatefulSets held back by the rollout
    rolling: list[str] = field(default_factory=list)  # StatefulSets mid-rollout

    @property
    def empty(self) -> bool:
        """Nothing to do."""
        return not (self.apply or self.delete)


def key(obj: Mapping[str, Any]) -> Key:
    """(kind, name) of an object."""
    return obj["kind"], obj["metadata"]["name"]


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    """True when the object's controller owner reference points at `uid`."""
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(ref.get("uid") == uid for ref in refs)


def _annotation(obj: Mapping[str, Any], name: str) -> str | None:
    return (obj.get("metadata", {}).get("annotations") or {}).get(name)


def statefulset_in_flight(sts: Mapping[str, Any]) -> bool:
    """The StatefulSet controller has not finished rolling out the current template.

    The controller moves status.currentRevision to the update revision only once every pod runs
    it and is Ready, so a revision mismatch means "updated pods not Ready yet".
    """
    spec, status = sts.get("spec", {}), sts.get("status") or {}
    if status.get("observedGeneration", 0) < sts.get("metadata", {}).get("generation", 0):
        return True
    if spec.get("replicas", 1) == 0:
        return False
    return status.get("currentRevision") != status.get("updateRevision")


def _statefulset_ready(sts: Mapping[str, Any]) -> bool:
    replicas = sts.get("spec", {}).get("replicas", 1)
    return (sts.get("status") or {}).get("readyReplicas", 0) >= replicas


def plan_changes(
    desired: Iterable[dict[str, Any]], observed: Iterable[Mapping[str, Any]], *, job_uid: str
) -> Plan:
    """Compare desired and observed children (observed: objects as the API returns them)."""
    desired = list(desired)
    mine = {key(o): o for o in observed if owned_by(o, job_uid) and o["kind"] in MANAGED_KINDS}
    plan = Plan()
    candidates: list[dict[str, Any]] = []
    for want in desired:
        have = mine.get(key(want))
        if have is None:
            plan.apply.append(want)
            continue
        is_sts = want["kind"] == "StatefulSet"
        template_changed = _annotation(have, TEMPLATE_HASH) != _annotation(want, TEMPLATE_HASH)
        if is_sts and not template_changed and statefulset_in_flight(have):
            plan.rolling.append(key(want)[1])
        if _annotation(have, SPEC_HASH) == _annotation(want, SPEC_HASH):
            continue
        if not is_sts or not template_changed:
            plan.apply.append(want)  # e.g. replicas only: no pod template change
            continue
        no_pods_at_risk = (
            want["spec"]["replicas"] == 0
            or have.get("spec", {}).get("replicas", 1) == 0
            or not _statefulset_ready(have)
        )
        if no_pods_at_risk:
            plan.apply.append(want)
        else:
            candidates.append(want)
    for want in candidates:
        if plan.rolling:
            plan.waiting.append(key(want)[1])
        else:
            plan.apply.append(want)
            plan.rolling.append(key(want)[1])
    wanted = {key(w) for w in desired}
    plan.delete = sorted(k for k in mine if k not in wanted)
    return plan
