"""Status computation: phases, conditions, progress figures, TTL."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from diloco_operator import api
from diloco_operator.health import IslandHealth, PodView
from diloco_operator.observation import Observation
from diloco_operator.phase import CRASH_LOOP_LIMIT, SYNCER_UNREACHABLE_DEADLINE
from diloco_operator.status import (
    compute_status,
    islands_should_run,
    status_changed,
    status_patch,
    ttl_expired,
)
from diloco_operator.times import rfc3339, time_field

T0 = datetime(2025, 1, 1, tzinfo=timezone.utc)


def _island(name: str, ready: int = 2, *, crash: int = 0, restarts: int = 0) -> IslandHealth:
    return IslandHealth(
        name=name,
        desired_pods=2,
        ready_pods=ready,
        restarts=restarts,
        crash_looping_pods=crash,
        missing=(),
        not_ready=(),
    )


SYNCER = {
    "outerStep": 12,
    "tokens": 4096,
    "loss": 2.5,
    "evalLoss": 2.7,
    "finished": False,
    "lastMergeTime": T0.timestamp(),
    "islands": {
        "island-0": {"state": "active", "lastPush": T0.timestamp()},
        "island-1": {"state": "dropped"},
    },
}


def _obs(
    *,
    islands: list[IslandHealth] | None = None,
    syncer: dict[str, Any] | None = SYNCER,
    spec: dict[str, Any] | None = None,
    now: datetime = T0,
    syncer_pods: tuple[PodView, ...] = (),
    rolling: tuple[str, ...] = (),
) -> Observation:
    islands = islands if islands is not None else [_island("island-0"), _island("island-1")]
    return Observation(
        generation=3,
        created=T0,
        spec=api.parse_job_spec({"image": "x", **(spec or {})}),
        islands={i.name: i for i in islands},
        syncer_pods=syncer_pods,
        syncer_status=syncer,
        syncer_error=None if syncer is not None else "connection refused",
        rolling=rolling,
        now=now,
    )


def _conditions(status: api.DiLoCoJobStatus) -> dict[str, api.Condition]:
    return {c.type: c for c in status.conditions}


def test_compute_status_running_with_progress_figures() -> None:
    status = compute_status(_obs(), None)
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
    half = [_island("island-0"), _island("island-1", ready=1)]
    assert compute_status(_obs(islands=half), None).phase == "Pending"
    running = status_patch(compute_status(_obs(), None))
    degraded = compute_status(_obs(islands=half), running)
    assert degraded.phase == "Degraded" and degraded.islands_summary == "1/2"
    assert _conditions(degraded)["Degraded"].reason == "IslandsNotReady"
    lost = compute_status(_obs(syncer=None), running)
    assert lost.phase == "Degraded" and _conditions(lost)["Degraded"].reason == "SyncerUnreachable"
    # Figures survive while the syncer is away.
    assert lost.outer_step == 12 and lost.loss == 2.5
    assert _conditions(lost)["SyncerReachable"].status == "False"


def test_compute_status_last_transition_time_changes_only_on_flip() -> None:
    first = status_patch(compute_status(_obs(), None))
    later = compute_status(_obs(now=T0 + timedelta(minutes=5)), first)
    assert _conditions(later)["Ready"].last_transition_time == rfc3339(T0)
    half = [_island("island-0"), _island("island-1", ready=0)]
    flipped = compute_status(_obs(islands=half, now=T0 + timedelta(minutes=6)), first)
    assert _conditions(flipped)["Ready"].last_transition_time == rfc3339(T0 + timedelta(minutes=6))


def test_compute_status_suspended() -> None:
    status = compute_status(_obs(spec={"suspend": True}, islands=[_island("island-0", 0)]), None)
    assert status.phase == "Suspended" and status.islands.desired == 0
    assert _conditions(status)["Suspended"].status == "True"
    assert _conditions(status)["Progressing"].status == "False"


def test_compute_status_suspended_counts_terminating_pods_as_nothing() -> None:
    """Just after a suspend the old pods are still Ready while they terminate: "0/0", not "2/0"."""
    status = compute_status(_obs(spec={"suspend": True}, islands=[_island("island-0", 2)]), None)
    assert status.islands_summary == "0/0" and status.islands.ready == 0


def test_compute_status_succeeded_is_sticky_and_stamps_finish() -> None:
    done = compute_status(_obs(syncer={**SYNCER, "finished": True}), None)
    assert done.phase == "Succeeded" and done.finished_time == rfc3339(T0)
    later = compute_status(_obs(syncer=None, now=T0 + timedelta(hours=1)), status_patch(done))
    assert later.phase == "Succeeded" and later.finished_time == rfc3339(T0)


def test_compute_status_fails_on_syncer_crash_loop() -> None:
    pod = PodView("job-syncer-x", None, "syncer", False, CRASH_LOOP_LIMIT, True)
    status = compute_status(_obs(syncer_pods=(pod,)), None)
    assert status.phase == "Failed"
    assert _conditions(status)["Failed"].reason == "SyncerCrashLoop"


def test_compute_status_fails_only_when_every_island_crash_loops() -> None:
    one = [_island("island-0", 0, crash=1, restarts=9), _island("island-1")]
    assert compute_status(_obs(islands=one), None).phase != "Failed"
    both = [_island(n, 0, crash=1, restarts=CRASH_LOOP_LIMIT) for n in ("island-0", "island-1")]
    assert _conditions(compute_status(_obs(islands=both), None))["Failed"].reason == (
        "IslandsCrashLoop"
    )


def test_compute_status_fails_after_syncer_deadline() -> None:
    before = compute_status(_obs(syncer=None, now=T0 + timedelta(seconds=10)), None)
    assert before.phase == "Pending"
    late = T0 + timedelta(seconds=SYNCER_UNREACHABLE_DEADLINE + 1)
    after = compute_status(_obs(syncer=None, now=late), status_patch(before))
    assert after.phase == "Failed" and "syncer has not answered" in after.message
    assert not islands_should_run(_obs().spec, status_patch(after))


def test_status_changed_ignores_identical_content() -> None:
    status = compute_status(_obs(), None)
    stored = status.model_dump(by_alias=True, mode="json", exclude_none=True)
    assert not status_changed(status, stored)
    assert status_changed(compute_status(_obs(syncer={**SYNCER, "outerStep": 13}), stored), stored)


def test_status_patch_nulls_clear_fields_and_nan_is_dropped() -> None:
    status = compute_status(_obs(syncer={**SYNCER, "loss": float("nan")}), None)
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
    running = status_patch(compute_status(_obs(now=late), None))
    lost = compute_status(_obs(syncer=None, now=late + timedelta(seconds=1)), running)
    assert lost.phase == "Degraded"
    assert _conditions(lost)["SyncerReachable"].reason == "SyncerUnreachable"
    much_later = late + timedelta(seconds=SYNCER_UNREACHABLE_DEADLINE + 2)
    assert compute_status(_obs(syncer=None, now=much_later), status_patch(lost)).phase == "Failed"
