"""The phase of a job: the rule order, stickiness and the unreachable-syncer deadline."""

from __future__ import annotations

from datetime import timedelta

from diloco_operator.phase import (
    CRASH_LOOP_LIMIT,
    SYNCER_UNREACHABLE_DEADLINE,
    decide_phase,
    finished_time,
    job_failure,
)

from .observations import SYNCER, T0, crash_looping_syncer, island, observation


def test_decide_phase_running_when_every_island_ready_and_syncer_answers() -> None:
    verdict = decide_phase(observation(), None)
    assert (verdict.phase, verdict.ready, verdict.desired) == ("Running", 2, 2)
    assert verdict.running and verdict.reachable and verdict.failure is None
    assert verdict.message == "2/2 islands ready"


def test_decide_phase_pending_before_first_running_degraded_after() -> None:
    half = [island("island-0"), island("island-1", ready=1)]
    assert decide_phase(observation(islands=half), None).phase == "Pending"
    assert decide_phase(observation(islands=half), {"phase": "Running"}).phase == "Degraded"
    assert decide_phase(observation(islands=half), {"phase": "Degraded"}).phase == "Degraded"


def test_decide_phase_waiting_for_syncer_named_in_message() -> None:
    pending = decide_phase(observation(syncer=None), None)
    assert pending.phase == "Pending" and pending.message.endswith("waiting for the syncer")
    degraded = decide_phase(observation(syncer=None), {"phase": "Running"})
    assert degraded.phase == "Degraded"
    assert degraded.message.endswith("syncer unreachable: connection refused")


def test_decide_phase_succeeded_wins_over_failure_and_suspend() -> None:
    obs = observation(
        syncer={**SYNCER, "finished": True},
        spec={"suspend": True},
        syncer_pods=[crash_looping_syncer(CRASH_LOOP_LIMIT)],
    )
    verdict = decide_phase(obs, None)
    assert verdict.phase == "Succeeded" and verdict.finished and verdict.failure is None
    assert not verdict.running and (verdict.ready, verdict.desired) == (0, 0)


def test_decide_phase_failed_is_sticky_with_its_reason() -> None:
    stored = {
        "phase": "Failed",
        "conditions": [{"type": "Failed", "status": "True", "reason": "X", "message": "why"}],
    }
    verdict = decide_phase(observation(), stored)
    assert verdict.phase == "Failed" and verdict.message == "why"
    assert verdict.failure is not None and verdict.failure.reason == "X"


def test_decide_phase_suspended_counts_no_islands() -> None:
    verdict = decide_phase(observation(spec={"suspend": True}), {"phase": "Running"})
    assert verdict.phase == "Suspended" and (verdict.ready, verdict.desired) == (0, 0)


def test_job_failure_syncer_crash_loop_needs_the_restart_limit() -> None:
    below = observation(syncer_pods=[crash_looping_syncer(CRASH_LOOP_LIMIT - 1)])
    assert job_failure(below, {}) is None
    at = job_failure(observation(syncer_pods=[crash_looping_syncer(CRASH_LOOP_LIMIT)]), {})
    assert at is not None and at.reason == "SyncerCrashLoop" and "job-syncer-abc" in at.message


def test_job_failure_islands_only_when_all_crash_loop() -> None:
    bad = island("island-0", 0, crash=1, restarts=CRASH_LOOP_LIMIT)
    one_bad = observation(islands=[bad, island("island-1")])
    assert job_failure(one_bad, {}) is None
    failure = job_failure(observation(islands=[bad, bad]), {})
    assert failure is not None and failure.reason == "IslandsCrashLoop"


def test_job_failure_deadline_from_creation_or_loss_of_contact() -> None:
    late = T0 + timedelta(seconds=SYNCER_UNREACHABLE_DEADLINE)
    never = job_failure(observation(syncer=None, now=late), {})
    assert never is not None and never.reason == "SyncerUnreachable"
    lost_at = T0 + timedelta(seconds=600)
    lost = {
        "SyncerReachable": {
            "status": "False",
            "reason": "SyncerUnreachable",
            "lastTransitionTime": "2025-01-01T00:10:00Z",
        }
    }
    assert job_failure(observation(syncer=None, now=late), lost) is None
    after = lost_at + timedelta(seconds=SYNCER_UNREACHABLE_DEADLINE)
    assert job_failure(observation(syncer=None, now=after), lost) is not None
    # Reachable a moment ago: the clock starts now.
    just_lost = {"SyncerReachable": {"status": "True"}}
    assert job_failure(observation(syncer=None, now=late), just_lost) is None


def test_finished_time_stamped_once_in_final_phases() -> None:
    assert finished_time("Running", {"finishedTime": "x"}, T0) is None
    assert finished_time("Failed", None, T0) == "2025-01-01T00:00:00Z"
    kept = finished_time("Succeeded", {"finishedTime": "2024-12-31T00:00:00Z"}, T0)
    assert kept == "2024-12-31T00:00:00Z"
