"""A job's phase from what the operator observed (pure).

Phase rules, in order (the first that applies wins):

1. Succeeded: the syncer reports `finished: true` (stopAfter reached, or its quality guard ended
   the job: the health problem evalLossRose, or it ended a job of two for an island's faint
   claims: faintIslandEnded; the message says which). Sticky.
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

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from diloco_operator.observation import ConditionsByType, Observation, conditions_by_type
from diloco_operator.syncer_view import SyncerView
from diloco_operator.times import parse_time, rfc3339

CRASH_LOOP_LIMIT = 5
SYNCER_UNREACHABLE_DEADLINE = 900.0
FINAL_PHASES = ("Succeeded", "Failed")
# Reasons of SyncerReachable=False: lost after an answer, or never reached.
LOST = "SyncerUnreachable"
NOT_YET_REACHED = "NotYetReached"


# The message of a job the syncer's quality guard ended (syncer.qualityGuard; issue 46).
GUARD_KIND = "evalLossRose"
GUARD_ENDED = (
    "the syncer's quality guard judged the model: its eval loss rose above syncer.qualityGuard's "
    "margin over the best (patience evaluations in a row: the job ended before spec.stopAfter; "
    "or at the finish); SyncerHealthy says EvalLossRose, finalCheckpoint is the best-evaluated "
    "model"
)


# The message of a job of two the syncer ended for an island's faint claims (issue 46).
FAINT_KIND = "faintIslandEnded"
FAINT_ENDED = (
    "the syncer ended this job of two before spec.stopAfter: an island's pushes moved far less "
    "than the other island's for the work they claimed, and some were merged; SyncerHealthy says "
    "FaintIslandEnded, finalCheckpoint is the best-evaluated model"
)


def guard_ended(syncer: SyncerView) -> bool:
    """Whether the syncer reports that its quality guard ended the job."""
    return any(p.kind == GUARD_KIND for p in syncer.health().problems)


def faint_ended(syncer: SyncerView) -> bool:
    """Whether the syncer reports that it ended a job of two for an island's faint claims."""
    return any(p.kind == FAINT_KIND for p in syncer.health().problems)


@dataclass(frozen=True)
class Failure:
    """Why a job failed: a condition reason and a message naming what failed."""

    reason: str
    message: str


@dataclass(frozen=True)
class Verdict:
    """The phase and the figures the conditions and the summary are built from."""

    phase: str
    message: str
    finished: bool  # the syncer reached stopAfter (now or before)
    failure: Failure | None
    running: bool  # islands should have pods: not finished, failed or suspended
    ready: int  # healthy islands (0 while not running)
    desired: int  # islands wanted (0 while not running)
    reachable: bool  # the syncer answered this time


def job_failure(obs: Observation, before: ConditionsByType) -> Failure | None:
    """Why the job has failed now, or None; `before` holds the stored conditions by type."""
    for pod in obs.syncer_pods:
        if pod.crash_looping and pod.restarts >= CRASH_LOOP_LIMIT:
            return Failure(
                "SyncerCrashLoop", f"syncer pod {pod.name} crash-looped {pod.restarts} times"
            )
    islands = list(obs.islands.values())
    if islands and all(i.crash_looping_pods and i.restarts >= CRASH_LOOP_LIMIT for i in islands):
        return Failure(
            "IslandsCrashLoop",
            f"every island has pods in CrashLoopBackOff (>= {CRASH_LOOP_LIMIT} restarts)",
        )
    if obs.syncer is None:
        down = (obs.now - _unreachable_since(obs, before)).total_seconds()
        if down >= SYNCER_UNREACHABLE_DEADLINE:
            return Failure(
                "SyncerUnreachable",
                f"the syncer has not answered for {int(down)}s "
                f"(deadline {int(SYNCER_UNREACHABLE_DEADLINE)}s): {obs.syncer_error or 'unknown'}",
            )
    return None


def _unreachable_since(obs: Observation, before: ConditionsByType) -> datetime:
    reachable = before.get("SyncerReachable") or {}
    if reachable.get("status") == "True":
        return obs.now  # just lost
    if reachable.get("reason") == LOST:
        return parse_time(reachable.get("lastTransitionTime")) or obs.created
    return obs.created  # never reached yet


def _sticky_or_new_failure(
    obs: Observation, previous: Mapping[str, Any], before: ConditionsByType
) -> Failure | None:
    if previous.get("phase") == "Failed":  # final: keep the reason it failed for
        failed = before.get("Failed") or {}
        return Failure(failed.get("reason") or "Failed", failed.get("message") or "")
    return job_failure(obs, before)


def decide_phase(obs: Observation, previous: Mapping[str, Any] | None) -> Verdict:
    """The job's phase given the observation and the status currently stored (or None)."""
    previous = previous or {}
    before = conditions_by_type(previous)
    prev_phase = previous.get("phase") or "Pending"
    syncer = obs.syncer
    reachable = syncer is not None
    finished = prev_phase == "Succeeded" or (syncer is not None and syncer.status.finished)
    failure = None if finished else _sticky_or_new_failure(obs, previous, before)
    running = not (finished or failure or obs.spec.suspend)
    desired = len(obs.islands) if running else 0
    # Pods still terminating after a suspend or the finish are not islands anyone wants: count
    # none, so the summary never reads "2/0".
    ready = sum(i.healthy for i in obs.islands.values()) if running else 0
    counts = f"{ready}/{desired} islands ready"
    if finished and syncer is not None and faint_ended(syncer):
        phase, message = "Succeeded", FAINT_ENDED
    elif finished and syncer is not None and guard_ended(syncer):
        phase, message = "Succeeded", GUARD_ENDED
    elif finished:
        phase, message = "Succeeded", "the syncer reached spec.stopAfter"
    elif failure:
        phase, message = "Failed", failure.message
    elif obs.spec.suspend:
        phase, message = "Suspended", "spec.suspend is true: islands scaled to zero"
    elif ready == desired and reachable:
        phase, message = "Running", counts
    elif prev_phase in ("Running", "Degraded"):
        phase = "Degraded"
        message = counts + ("" if reachable else f"; syncer unreachable: {obs.syncer_error}")
    else:
        phase, message = "Pending", counts + ("" if reachable else "; waiting for the syncer")
    return Verdict(
        phase=phase,
        message=message,
        finished=finished,
        failure=failure,
        running=running,
        ready=ready,
        desired=desired,
        reachable=reachable,
    )


def finished_time(phase: str, previous: Mapping[str, Any] | None, now: datetime) -> str | None:
    """When the job reached a final phase (stamped once, kept after); None before that."""
    if phase not in FINAL_PHASES:
        return None
    return (previous or {}).get("finishedTime") or rfc3339(now)
