"""A job's conditions from its phase verdict (pure).

Each condition keeps its lastTransitionTime until its status flips, so `kubectl wait` and
dashboards see when a state began, not when the operator last looked.
"""

from __future__ import annotations

from diloco_operator.api import Condition
from diloco_operator.merge_waits import WAIT_CONDITION, wait_condition
from diloco_operator.observation import ConditionsByType, Observation
from diloco_operator.phase import LOST, NOT_YET_REACHED, Verdict
from diloco_operator.preflight import CHECK_CONDITION
from diloco_operator.queueing import quota_condition
from diloco_operator.syncer_view import SyncerView
from diloco_operator.times import rfc3339

CONDITION_TYPES = (
    "Ready",
    "Progressing",
    "Degraded",
    "Suspended",
    "Succeeded",
    "Failed",
    "SyncerReachable",
    "NameConflict",
    "SyncerHealthy",
    WAIT_CONDITION,  # islands idle waiting for merges (merge_waits.py)
)
# After CONDITION_TYPES, only for a job whose islands are in a Kueue queue (queueing.py):
# True while some island's pods wait for Kueue to admit them.
QUOTA_CONDITION = "WaitingForQuota"
ACTIVE_PHASES = ("Pending", "Running", "Degraded")


def condition(
    before: ConditionsByType,
    kind: str,
    status: bool,
    reason: str,
    message: str,
    obs: Observation,
) -> Condition:
    """One condition; its transition time is carried over from `before` unless it flipped."""
    value = "True" if status else "False"
    stored = before.get(kind) or {}
    since = stored.get("lastTransitionTime") if stored.get("status") == value else None
    return Condition(
        type=kind,
        status=value,
        reason=reason,
        message=message,
        last_transition_time=since or rfc3339(obs.now),
        observed_generation=obs.generation,
    )


def unreachable_reason(before: ConditionsByType) -> str:
    """LOST once the syncer has answered at least once, NOT_YET_REACHED before that."""
    stored = before.get("SyncerReachable") or {}
    if stored.get("status") == "True" or stored.get("reason") == LOST:
        return LOST
    return NOT_YET_REACHED


# The syncer's health problem kinds (syncer/state/problems.py) the operator names; anything else is
# reported as "Other". Only these words and counts reach the job's status, never the syncer's
# own text: a remote syncer's answers are not copied into the job (issue 10).
HEALTH_KINDS = {
    "checkpoint": "CheckpointFailing",
    "corruptCheckpoints": "CorruptCheckpoints",
    "merge": "ContributionsLeftOut",
    # The merge log (merges.jsonl) cannot be written (a full or read-only disk): the syncer goes
    # on, the checkpoints hold the state, but the same disk will fail them next (issue 22).
    "mergeLog": "MergeLogFailing",
    # An island's pushes all sit at the learned norm bound (a ratchet, or an island spending
    # what the bound allows): in a job of two the bound holds it, this names it (issue 46).
    "islandAtBound": "IslandPushesAtBound",
    # An island's pushes all move far less than the other island's per claimed step: work it
    # claims and does not carry (zero pushes claiming a round's most steps, a job of two, issue
    # 46); below 1/32 of it refused, and its claims leave the merges; up to 1/4 merged and named
    # only, which an honest island of unequal speed far down its cosine can also be
    # (bench/studies/faint_naming.py).
    "islandWorkUnsupported": "IslandWorkUnsupported",
    # An island's last pushes to a fragment were all refused (a guard that the other islands'
    # pushes set: the direction check, the learned bound, the work evidence): left out of the
    # rounds and the quorum until a push of it is accepted, so a K = M job merges without it.
    "islandLeftOut": "IslandLeftOut",
    # The syncer's quality guard ended the job: its eval loss kept rising above the best it had
    # reached (syncer.qualityGuard; one bad island of two, issue 46). The job's final checkpoint
    # is the best-evaluated one.
    "evalLossRose": "EvalLossRose",
    # A job of two ended for an island whose pushes all moved far less than the other island's
    # per claimed step while some were merged (faint noise with claims, which a job of two cannot
    # bound): its final checkpoint is the best-evaluated one (issue 46).
    "faintIslandEnded": "FaintIslandEnded",
}


def syncer_health(syncer: SyncerView | None) -> tuple[bool, str, str]:
    """(healthy, reason, message) of the SyncerHealthy condition from the syncer's health report
    (syncer_view.SyncerHealth).

    Unknown while the syncer is not reached (status False, reason Unknown); a syncer without a
    `health` field (older versions) counts as healthy.
    """
    if syncer is None:
        return False, "Unknown", "the syncer has not been reached"
    health = syncer.health()
    if not health.sick:
        return True, "Healthy", ""
    reasons: list[str] = []
    for problem in health.problems:
        reason = HEALTH_KINDS.get(problem.kind, "Other") if problem.kind is not None else "Other"
        count = problem.count
        times = f" ({count} times)" if count is not None and count > 1 else ""
        reasons.append(reason + times)
    if not reasons:
        reasons = ["Other"]
    return False, reasons[0].split(" ")[0], "syncer health problems: " + ", ".join(reasons[:8])


def progressing(verdict: Verdict, obs: Observation) -> tuple[str, str]:
    """(reason, message) of the Progressing condition."""
    if obs.rolling and verdict.phase in ACTIVE_PHASES:
        return "RollingUpdate", "updating islands one at a time: " + ", ".join(obs.rolling)
    if verdict.phase == "Pending":
        return "Starting", verdict.message
    if verdict.phase in ("Running", "Degraded"):
        syncer = obs.syncer
        return "Training", f"outer step {syncer.status.outer_step if syncer else '?'}"
    return verdict.phase, verdict.message


def job_conditions(verdict: Verdict, obs: Observation, before: ConditionsByType) -> list[Condition]:
    """The conditions of CONDITION_TYPES, in that order, then CHECK_CONDITION when the
    pre-flight check ran, then QUOTA_CONDITION for a job in a Kueue queue whose islands should
    run."""
    quota = quota_condition(obs.islands.values()) if verdict.running else None
    extra = [] if quota is None else [condition(before, QUOTA_CONDITION, *quota, obs)]
    if obs.check is not None:  # the pre-flight check (preflight.py), before the quota
        extra.insert(0, condition(before, CHECK_CONDITION, *obs.check.condition(), obs))
    return _standard_conditions(verdict, obs, before) + extra


def _standard_conditions(
    verdict: Verdict, obs: Observation, before: ConditionsByType
) -> list[Condition]:
    phase, message, failure = verdict.phase, verdict.message, verdict.failure
    degraded = phase == "Degraded"
    degraded_reason = "IslandsNotReady" if verdict.ready < verdict.desired else "SyncerUnreachable"
    reachable = verdict.reachable
    return [
        condition(before, "Ready", phase == "Running", phase, message, obs),
        condition(before, "Progressing", phase in ACTIVE_PHASES, *progressing(verdict, obs), obs),
        condition(
            before,
            "Degraded",
            degraded,
            degraded_reason if degraded else "AsExpected",
            message if degraded else "",
            obs,
        ),
        condition(
            before,
            "Suspended",
            phase == "Suspended",
            "Suspended" if obs.spec.suspend else "NotSuspended",
            "",
            obs,
        ),
        condition(
            before,
            "Succeeded",
            phase == "Succeeded",
            "Finished" if verdict.finished else "NotFinished",
            "",
            obs,
        ),
        condition(
            before,
            "Failed",
            phase == "Failed",
            failure.reason if failure else "NoFailure",
            failure.message if failure else "",
            obs,
        ),
        condition(
            before,
            "SyncerReachable",
            reachable,
            "StatusRead" if reachable else unreachable_reason(before),
            "" if reachable else (obs.syncer_error or "no answer"),
            obs,
        ),
        condition(
            before,
            "NameConflict",
            bool(obs.conflicts),
            "NameTaken" if obs.conflicts else "NoConflict",
            "; ".join(obs.conflicts),
            obs,
        ),
        condition(before, "SyncerHealthy", *syncer_health(obs.syncer), obs),
        # Only while the job trains: a finished or suspended job's islands wait for nothing.
        condition(
            before,
            WAIT_CONDITION,
            *wait_condition(obs.waits if phase in ACTIVE_PHASES else None),
            obs,
        ),
    ]
