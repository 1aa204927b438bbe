"""The job's status from what the operator observed (pure).

Phase rules, in order (the first that applies wins):

1. Succeeded: the syncer reports `finished: true` (stopAfter reached). Sticky.
2. Failed (sticky), when one of:
   - the syncer pod is in CrashLoopBackOff with at least CRASH_LOOP_LIMIT restarts;
   - every desired island has a pod in CrashLoopBackOff with at least CRASH_LOOP_LIMIT restarts
     (no island can train; one bad island only degrades the job);
   - the syncer has been unreachable for SYNCER_UNREACHABLE_DEADLINE seconds without a break
     (counted from the job's creation when it was never reached).
3. Suspended: spec.suspend is true.
4. Running: every desired island is healthy and the syncer answers.
5. Degraded: the job was Running or Degraded before and is not now.
6. Pending: still starting (or resuming).

After Succeeded or Failed the reconciler scales the islands to zero, and the job is deleted
ttlSecondsAfterFinished after `finishedTime`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from diloco_operator.api import (
    Condition,
    DiLoCoJobSpec,
    DiLoCoJobStatus,
    IslandCounts,
    IslandStatus,
)
from diloco_operator.health import ACTIVE, IslandHealth, PodView

CRASH_LOOP_LIMIT = 5
SYNCER_UNREACHABLE_DEADLINE = 900.0
KNOWN_ISLAND_STATES = ("active", "dropped", "timedOut", "left")
LOST = "SyncerUnreachable"
NOT_YET_REACHED = "NotYetReached"
FINAL_PHASES = ("Succeeded", "Failed")
CONDITION_TYPES = (
    "Ready",
    "Progressing",
    "Degraded",
    "Suspended",
    "Succeeded",
    "Failed",
    "SyncerReachable",
)


def rfc3339(moment: datetime) -> str:
    """UTC time in the form Kubernetes uses: 2024-01-02T03:04:05Z."""
    return moment.astimezone(timezone.utc).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str | None) -> datetime | None:
    """Parse an RFC 3339 time as written by rfc3339() or the API server."""
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def time_field(value: Any) -> str | None:
    """A syncer time (Unix seconds or an ISO string) as RFC 3339, None when absent."""
    if value is None or value == "":
        return None
    if isinstance(value, (int, float)):
        if value <= 0:
            return None
        return rfc3339(datetime.fromtimestamp(float(value), tz=timezone.utc))
    parsed = parse_time(str(value))
    return rfc3339(parsed) if parsed else None


@dataclass(frozen=True)
class Observation:
    """Everything the status is computed from, gathered by the handlers."""

    generation: int
    created: datetime
    spec: DiLoCoJobSpec
    islands: Mapping[str, IslandHealth]  # desired islands, in index order
    syncer_pods: Sequence[PodView]  # empty with a remote syncer
    syncer_status: Mapping[str, Any] | None  # /v1/status, None when not reached
    syncer_error: str | None
    rolling: Sequence[str]  # island StatefulSets mid-rollout
    now: datetime


def _condition(
    previous: Mapping[str, Mapping[str, Any]],
    kind: str,
    status: bool,
    reason: str,
    message: str,
    obs: Observation,
) -> Condition:
    value = "True" if status else "False"
    before = previous.get(kind) or {}
    since = before.get("lastTransitionTime") if before.get("status") == value else None
    return Condition(
        type=kind,
        status=value,
        reason=reason,
        message=message,
        last_transition_time=since or rfc3339(obs.now),
        observed_generation=obs.generation,
    )


def _failure(obs: Observation, previous: Mapping[str, Mapping[str, Any]]) -> tuple[str, str] | None:
    """(reason, message) when the job has failed, else None."""
    for pod in obs.syncer_pods:
        if pod.crash_looping and pod.restarts >= CRASH_LOOP_LIMIT:
            return "SyncerCrashLoop", f"syncer pod {pod.name} crash-looped {pod.restarts} times"
    islands = list(obs.islands.values())
    if islands and all(i.crash_looping_pods and i.restarts >= CRASH_LOOP_LIMIT for i in islands):
        return "IslandsCrashLoop", (
            f"every island has pods in CrashLoopBackOff (>= {CRASH_LOOP_LIMIT} restarts)"
        )
    if obs.syncer_status is None:
        reachable = previous.get("SyncerReachable") or {}
        since = obs.created  # never reached yet
        if reachable.get("status") == "True":
            since = obs.now  # just lost
        elif reachable.get("reason") == LOST:
            since = parse_time(reachable.get("lastTransitionTime")) or obs.created
        down = (obs.now - since).total_seconds()
        if down >= SYNCER_UNREACHABLE_DEADLINE:
            return "SyncerUnreachable", (
                f"the syncer has not answered for {int(down)}s "
                f"(deadline {int(SYNCER_UNREACHABLE_DEADLINE)}s): {obs.syncer_error or 'unknown'}"
            )
    return None


def _unreachable_reason(before: Mapping[str, Mapping[str, Any]]) -> str:
    """LOST once the syncer has answered at least once, NOT_YET_REACHED before that."""
    previous = before.get("SyncerReachable") or {}
    if previous.get("status") == "True" or previous.get("reason") == LOST:
        return LOST
    return NOT_YET_REACHED


def _island_statuses(obs: Observation, running: bool) -> list[IslandStatus]:
    syncer_islands = (obs.syncer_status or {}).get("islands") or {}
    out = []
    for name, island in obs.islands.items():
        info = syncer_islands.get(name) or {}
        state = info.get("state") if info.get("state") in KNOWN_ISLAND_STATES else "unknown"
        out.append(
            IslandStatus(
                name=name,
                ready_pods=island.ready_pods,
                desired_pods=island.desired_pods if running else 0,
                healthy=island.healthy,
                in_quorum=state == ACTIVE,
                state=state,
                last_push=time_field(info.get("lastPush")),
                restarts=island.restarts,
            )
        )
    return out


def compute_status(obs: Observation, previous: Mapping[str, Any] | None) -> DiLoCoJobStatus:
    """The new status, given the observation and the status currently stored (or None)."""
    previous = previous or {}
    before = {c.get("type"): c for c in previous.get("conditions") or [] if isinstance(c, dict)}
    prev_phase = previous.get("phase") or "Pending"
    syncer = obs.syncer_status
    reachable = syncer is not None
    finished = prev_phase == "Succeeded" or bool(syncer and syncer.get("finished"))
    failure = None
    if not finished:
        if prev_phase == "Failed":
            failed_before = before.get("Failed") or {}
            failure = (failed_before.get("reason") or "Failed", failed_before.get("message") or "")
        else:
            failure = _failure(obs, before)
    running = not (finished or failure or obs.spec.suspend)
    desired = len(obs.islands) if running else 0
    # Pods still terminating after a suspend or the finish are not islands anyone wants: count
    # none, so the summary never reads "2/0".
    ready = sum(i.healthy for i in obs.islands.values()) if running else 0
    island_statuses = _island_statuses(obs, running)
    active = sum(i.in_quorum for i in island_statuses)

    if finished:
        phase, message = "Succeeded", "the syncer reached spec.stopAfter"
    elif failure:
        phase, message = "Failed", failure[1]
    elif obs.spec.suspend:
        phase, message = "Suspended", "spec.suspend is true: islands scaled to zero"
    elif ready == desired and reachable:
        phase, message = "Running", f"{ready}/{desired} islands ready"
    elif prev_phase in ("Running", "Degraded"):
        phase = "Degraded"
        message = f"{ready}/{desired} islands ready" + (
            "" if reachable else f"; syncer unreachable: {obs.syncer_error}"
        )
    else:
        phase = "Pending"
        message = f"{ready}/{desired} islands ready" + (
            "" if reachable else "; waiting for the syncer"
        )

    degraded_reason = "IslandsNotReady" if ready < desired else "SyncerUnreachable"
    if obs.rolling and phase in ("Pending", "Running", "Degraded"):
        progress = ("RollingUpdate", "updating islands one at a time: " + ", ".join(obs.rolling))
    elif phase == "Pending":
        progress = ("Starting", message)
    elif phase in ("Running", "Degraded"):
        progress = ("Training", f"outer step {syncer.get('outerStep') if syncer else '?'}")
    else:
        progress = (phase, message)
    c = _condition
    conditions = [
        c(before, "Ready", phase == "Running", phase, message, obs),
        c(before, "Progressing", phase in ("Pending", "Running", "Degraded"), *progress, obs),
        c(
            before,
            "Degraded",
            phase == "Degraded",
            degraded_reason if phase == "Degraded" else "AsExpected",
            message if phase == "Degraded" else "",
            obs,
        ),
        c(
            before,
            "Suspended",
            phase == "Suspended",
            "Suspended" if obs.spec.suspend else "NotSuspended",
            "",
            obs,
        ),
        c(
            before,
            "Succeeded",
            phase == "Succeeded",
            "Finished" if finished else "NotFinished",
            "",
            obs,
        ),
        c(
            before,
            "Failed",
            phase == "Failed",
            failure[0] if failure else "NoFailure",
            failure[1] if failure else "",
            obs,
        ),
        c(
            before,
            "SyncerReachable",
            reachable,
            "StatusRead" if reachable else _unreachable_reason(before),
            "" if reachable else (obs.syncer_error or "no answer"),
            obs,
        ),
    ]

    def carried(name: str) -> Any:
        # Keep the last progress figures while the syncer is away.
        return syncer.get(name) if syncer is not None else previous.get(name)

    finished_time = previous.get("finishedTime")
    if phase in FINAL_PHASES and not finished_time:
        finished_time = rfc3339(obs.now)
    last_sync = time_field(syncer.get("lastMergeTime")) if syncer else previous.get("lastSyncTime")
    return DiLoCoJobStatus(
        phase=phase,
        observed_generation=obs.generation,
        conditions=conditions,
        islands=IslandCounts(desired=desired, ready=ready, active=active),
        islands_summary=f"{ready}/{desired}",
        island_statuses=island_statuses,
        outer_step=_int_or_none(carried("outerStep")),
        tokens=_int_or_none(carried("tokens")),
        loss=_float_or_none(carried("loss")),
        eval_loss=_float_or_none(carried("evalLoss")),
        last_sync_time=last_sync,
        finished_time=finished_time if phase in FINAL_PHASES else None,
        message=message,
    )


def _int_or_none(value: Any) -> int | None:
    try:
        return None if value is None else max(0, int(value))
    except (TypeError, ValueError):
        return None


def _float_or_none(value: Any) -> float | None:
    try:
        number = None if value is None else float(value)
    except (TypeError, ValueError):
        return None
    if number is None or number != number or number in (float("inf"), float("-inf")):
        return None  # JSON has no NaN: the API server would refuse the patch
    return number


def status_patch(status: DiLoCoJobStatus) -> dict[str, Any]:
    """The merge-patch body for the status subresource (None values delete stale fields)."""
    return status.model_dump(by_alias=True, mode="json")


def status_changed(new: DiLoCoJobStatus, current: Mapping[str, Any] | None) -> bool:
    """True when writing `new` would change the stored status."""
    stored = {k: v for k, v in (current or {}).items() if v is not None}
    fresh = new.model_dump(by_alias=True, mode="json", exclude_none=True)
    return _strip_none(fresh) != _strip_none(stored)


def _strip_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_strip_none(v) for v in value]
    return value


def ttl_expired(spec: DiLoCoJobSpec, status: Mapping[str, Any] | None, now: datetime) -> bool:
    """The finished job is past spec.ttlSecondsAfterFinished and should be deleted."""
    if spec.ttl_seconds_after_finished is None or not status:
        return False
    if status.get("phase") not in FINAL_PHASES:
        return False
    finished = parse_time(status.get("finishedTime"))
    if finished is None:
        return False
    return now >= finished + timedelta(seconds=spec.ttl_seconds_after_finished)


def islands_should_run(spec: DiLoCoJobSpec, status: Mapping[str, Any] | None) -> bool:
    """Islands get pods unless the job is suspended or has finished."""
    phase = (status or {}).get("phase")
    return not spec.suspend and phase not in FINAL_PHASES
