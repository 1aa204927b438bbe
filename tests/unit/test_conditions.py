"""The conditions of a job: one per type, transition times kept until a flip, reasons."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from diloco_operator.api import Condition
from diloco_operator.conditions import (
    CONDITION_TYPES,
    job_conditions,
    progressing,
    syncer_health,
    unreachable_reason,
)
from diloco_operator.observation import Observation
from diloco_operator.phase import LOST, NOT_YET_REACHED, decide_phase

from .observations import SYNCER, T0, island, observation, syncer_view


def _by_type(
    obs: Observation,
    previous: dict[str, Any] | None = None,
    before: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Condition]:
    verdict = decide_phase(obs, previous)
    return {c.type: c for c in job_conditions(verdict, obs, before or {})}


def test_job_conditions_one_of_each_type_in_order() -> None:
    obs = observation()
    verdict = decide_phase(obs, None)
    assert [c.type for c in job_conditions(verdict, obs, {})] == list(CONDITION_TYPES)


def test_job_conditions_running_job() -> None:
    conditions = _by_type(observation())
    assert conditions["Ready"].status == "True" and conditions["Ready"].reason == "Running"
    assert conditions["Progressing"].reason == "Training"
    assert conditions["Progressing"].message == "outer step 12"
    assert (
        conditions["Degraded"].status == "False" and conditions["Degraded"].reason == "AsExpected"
    )
    assert conditions["SyncerReachable"].reason == "StatusRead"
    assert all(c.observed_generation == 3 for c in conditions.values())


def test_job_conditions_degraded_names_not_ready_islands() -> None:
    half = [island("island-0"), island("island-1", ready=1)]
    conditions = _by_type(observation(islands=half), {"phase": "Running"})
    assert conditions["Degraded"].status == "True"
    assert conditions["Degraded"].reason == "IslandsNotReady"
    assert conditions["Degraded"].message == "1/2 islands ready"


def test_job_conditions_keep_transition_time_until_flip() -> None:
    before = {"Ready": {"status": "True", "lastTransitionTime": "2024-01-01T00:00:00Z"}}
    later = observation(now=T0 + timedelta(hours=1))
    assert _by_type(later, before=before)["Ready"].last_transition_time == "2024-01-01T00:00:00Z"
    half = [island("island-0"), island("island-1", ready=0)]
    flipped = _by_type(observation(islands=half, now=T0 + timedelta(hours=1)), before=before)
    assert flipped["Ready"].last_transition_time == "2025-01-01T01:00:00Z"


def test_unreachable_reason_lost_only_after_an_answer() -> None:
    assert unreachable_reason({}) == NOT_YET_REACHED
    assert unreachable_reason({"SyncerReachable": {"status": "True"}}) == LOST
    assert unreachable_reason({"SyncerReachable": {"status": "False", "reason": LOST}}) == LOST
    conditions = _by_type(observation(syncer=None))
    assert conditions["SyncerReachable"].status == "False"
    assert conditions["SyncerReachable"].reason == NOT_YET_REACHED
    assert conditions["SyncerReachable"].message == "connection refused"


def test_progressing_reports_rollout_while_active() -> None:
    obs = observation(rolling=["job-island-1"])
    reason, message = progressing(decide_phase(obs, None), obs)
    assert reason == "RollingUpdate" and message.endswith("job-island-1")
    suspended = observation(rolling=["job-island-1"], spec={"suspend": True})
    assert progressing(decide_phase(suspended, None), suspended)[0] == "Suspended"


def test_syncer_health_condition_names_problem_kinds_and_counts_never_syncer_text() -> None:
    assert syncer_health(None) == (False, "Unknown", "the syncer has not been reached")
    assert syncer_health(syncer_view({"outerStep": 3})) == (True, "Healthy", "")  # older syncer
    healthy = syncer_view({"health": {"healthy": True, "problems": []}})
    assert syncer_health(healthy) == (True, "Healthy", "")
    sick = {
        "health": {
            "healthy": False,
            "problems": [
                {"kind": "checkpoint", "message": "<html>disk full</html>", "count": 3},
                {"kind": "merge", "message": "left out island-2", "count": 1},
                {"kind": "<script>", "count": "many"},
            ],
        }
    }
    healthy, reason, message = syncer_health(syncer_view(sick))
    assert (healthy, reason) == (False, "CheckpointFailing")
    assert message == (
        "syncer health problems: CheckpointFailing (3 times), ContributionsLeftOut, Other"
    )
    assert syncer_health(syncer_view({"health": {"healthy": False, "problems": "x"}})) == (
        False,
        "Other",
        "syncer health problems: Other",
    )


def test_job_conditions_syncer_healthy_follows_the_syncer_status() -> None:
    obs = observation()
    assert obs.syncer is not None
    sick = {**SYNCER, "health": {"healthy": False, "problems": [{"kind": "checkpoint"}]}}
    conditions = _by_type(observation(syncer=sick))
    assert conditions["SyncerHealthy"].status == "False"
    assert conditions["SyncerHealthy"].reason == "CheckpointFailing"
    assert _by_type(obs)["SyncerHealthy"].status == "True"
