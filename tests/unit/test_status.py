"""Status computation: phases, conditions, progress figures, TTL."""

from __future__ import annotations

from datetime import timedelta

from diloco_operator import api
from diloco_operator.health import PodView
from diloco_operator.phase import CRASH_LOOP_LIMIT, SYNCER_UNREACHABLE_DEADLINE
from diloco_operator.status import (
    compute_status,
    islands_should_run,
    status_changed,
    status_patch,
    ttl_expired,
)
from diloco_operator.times import rfc3339, time_field

from .observations import SYNCER, T0, island, observation


def _conditions(status: api.DiLoCoJobStatus) -> dict[str, api.Condition]:
    return {c.type: c for c in status.conditions}


def test_compute_status_running_with_progress_figures() -> None:
    status = compute_status(observation(), None)
    assert status.phase == "Running"
    assert status.islands == api.IslandCounts(desired=2, ready=2, active=1)
    assert status.islands_summary == "2/2"
    assert (status.outer_step, status.tokens, status.loss, status.eval_loss) == (12, 4096, 2.5, 2.7)
    assert status.last_sync_time == rfc3339(T0)
    entry = status.island_statuses[0]
    assert (entry.name, entry.in_quorum, entry.last_push) == ("island-0", True, rfc3339(T0))
    assert status.island_statuses[1].state == "dropped" and not status.island_statuses[1].in_quorum
    cond = _conditions(status)
    assert cond["Ready"].status == "True" and cond["Degraded"].status == "False"
    assert all(c.observed_generation == 3 for c in status.conditions)


def test_compute_status_pending_until_first_running_then_degraded() -> None:
    half = [island("island-0"), island("island-1", ready=1)]
    assert compute_status(observation(islands=half), None).phase == "Pending"
    running = status_patch(compute_status(observation(), None))
    degraded = compute_status(observation(islands=half), running)
    assert degraded.phase == "Degraded" and degraded.islands_summary == "1/2"
    assert _conditions(degraded)["Degraded"].reason == "IslandsNotReady"
    lost = compute_status(observation(syncer=None), running)
    assert lost.phase == "Degraded" and _conditions(lost)["Degraded"].reason == "SyncerUnreachable"
    # Figures survive while the syncer is away.
    assert lost.outer_step == 12 and lost.loss == 2.5
    assert _conditions(lost)["SyncerReachable"].status == "False"


def test_compute_status_last_transition_time_changes_only_on_flip() -> None:
    first = status_patch(compute_status(observation(), None))
    later = compute_status(observation(now=T0 + timedelta(minutes=5)), first)
    assert _conditions(later)["Ready"].last_transition_time == rfc3339(T0)
    half = [island("island-0"), island("island-1", ready=0)]
    flipped = compute_status(observation(islands=half, now=T0 + timedelta(minutes=6)), first)
    assert _conditions(flipped)["Ready"].last_transition_time == rfc3339(T0 + timedelta(minutes=6))


def test_compute_status_suspended() -> None:
    status = compute_status(
        observation(spec={"suspend": True}, islands=[island("island-0", 0)]), None
    )
    assert status.phase == "Suspended" and status.islands.desired == 0
    assert _conditions(status)["Suspended"].status == "True"
    assert _conditions(status)["Progressing"].status == "False"


def test_compute_status_suspended_counts_terminating_pods_as_nothing() -> None:
    """Just after a suspend the old pods are still Ready while they terminate: "0/0", not "2/0"."""
    status = compute_status(
        observation(spec={"suspend": True}, islands=[island("island-0", 2)]), None
    )
    assert status.islands_summary == "0/0" and status.islands.ready == 0


def test_compute_status_succeeded_is_sticky_and_stamps_finish() -> None:
    done = compute_status(observation(syncer={**SYNCER, "finished": True}), None)
    assert done.phase == "Succeeded" and done.finished_time == rfc3339(T0)
    later = compute_status(
        observation(syncer=None, now=T0 + timedelta(hours=1)), status_patch(done)
    )
    assert later.phase == "Succeeded" and later.finished_time == rfc3339(T0)


def test_compute_status_fails_on_syncer_crash_loop() -> None:
    pod = PodView("job-syncer-x", None, "syncer", False, CRASH_LOOP_LIMIT, True)
    status = compute_status(observation(syncer_pods=(pod,)), None)
    assert status.phase == "Failed"
    assert _conditions(status)["Failed"].reason == "SyncerCrashLoop"


def test_compute_status_fails_only_when_every_island_crash_loops() -> None:
    one = [island("island-0", 0, crash=1, restarts=9), island("island-1")]
    assert compute_status(observation(islands=one), None).phase != "Failed"
    both = [island(n, 0, crash=1, restarts=CRASH_LOOP_LIMIT) for n in ("island-0", "island-1")]
    assert _conditions(compute_status(observation(islands=both), None))["Failed"].reason == (
        "IslandsCrashLoop"
    )


def test_compute_status_fails_after_syncer_deadline() -> None:
    before = compute_status(observation(syncer=None, now=T0 + timedelta(seconds=10)), None)
    assert before.phase == "Pending"
    late = T0 + timedelta(seconds=SYNCER_UNREACHABLE_DEADLINE + 1)
    after = compute_status(observation(syncer=None, now=late), status_patch(before))
    assert after.phase == "Failed" and "syncer has not answered" in after.message
    assert not islands_should_run(observation().spec, status_patch(after))


def test_status_changed_ignores_identical_content() -> None:
    status = compute_status(observation(), None)
    stored = status.model_dump(by_alias=True, mode="json", exclude_none=True)
    assert not status_changed(status, stored)
    assert status_changed(
        compute_status(observation(syncer={**SYNCER, "outerStep": 13}), stored), stored
    )


def test_status_patch_nulls_clear_fields_and_nan_is_dropped() -> None:
    status = compute_status(observation(syncer={**SYNCER, "loss": float("nan")}), None)
    patch = status_patch(status)
    assert patch["loss"] is None and patch["finishedTime"] is None


def test_ttl_expired() -> None:
    spec = api.parse_job_spec({"image": "x", "ttlSecondsAfterFinished": 60})
    done = {"phase": "Succeeded", "finishedTime": rfc3339(T0)}
    assert not ttl_expired(spec, done, T0 + timedelta(seconds=59))
    assert ttl_expired(spec, done, T0 + timedelta(seconds=60))
    assert not ttl_expired(spec, {"phase": "Running"}, T0 + timedelta(days=1))
    assert not ttl_expired(api.parse_job_spec({"image": "x"}), done, T0 + timedelta(days=1))


def test_time_field_accepts_unix_seconds_and_iso() -> None:
    assert time_field(T0.timestamp()) == "2025-01-01T00:00:00Z"
    assert time_field("2025-01-01T00:00:00+00:00") == "2025-01-01T00:00:00Z"
    assert time_field(None) is None and time_field(0) is None and time_field("garbage") is None


def test_compute_status_deadline_counts_from_loss_of_contact() -> None:
    late = T0 + timedelta(seconds=SYNCER_UNREACHABLE_DEADLINE * 2)
    running = status_patch(compute_status(observation(now=late), None))
    lost = compute_status(observation(syncer=None, now=late + timedelta(seconds=1)), running)
    assert lost.phase == "Degraded"
    assert _conditions(lost)["SyncerReachable"].reason == "SyncerUnreachable"
    much_later = late + timedelta(seconds=SYNCER_UNREACHABLE_DEADLINE + 2)
    assert (
        compute_status(observation(syncer=None, now=much_later), status_patch(lost)).phase
        == "Failed"
    )
