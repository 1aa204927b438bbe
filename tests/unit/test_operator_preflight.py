"""The operator's pre-flight check (preflight.py): which jobs it holds, the Checked condition,
the held job's status, and the Events (one per change of what the check says)."""

from __future__ import annotations

import dataclasses
import logging
from datetime import timedelta

import pytest
from diloco_operator import api
from diloco_operator.preflight import CheckResult, check_job, post_check_event
from diloco_operator.status import compute_status

from .observations import T0, observation

# gpt-tiny at seqLen 64 x batch 8: a learner step needs about 0.40 GiB (tests/unit/
# test_preflight.py derives it); 256Mi cannot hold it.
TOO_SMALL = {"islands": {"resources": {"limits": {"memory": "256Mi"}}}}
MEMORY_ERROR = (
    "islands.resources.limits.memory (0.25 GiB): a learner step needs about 0.40 GiB "
    "(inner.seqLen x inner.batchSize)"
)


def spec(**fields: object) -> api.DiLoCoJobSpec:
    base = {
        "image": "x",
        "model": {"preset": "gpt-tiny"},
        "inner": {"seqLen": 64, "batchSize": 8, "steps": 50, "warmupSteps": 20},
        "stopAfter": {"outerSteps": 20},
    }
    return api.parse_job_spec({**base, **fields})


@pytest.mark.parametrize(
    ("phase", "held"),
    [(None, True), ("Pending", True), ("Running", False), ("Degraded", False)],
)
def test_failing_check_holds_only_a_job_that_has_not_started(phase: str | None, held: bool) -> None:
    check = check_job(spec(**TOO_SMALL), {"phase": phase} if phase else None)
    assert check.errors == (MEMORY_ERROR,)
    assert check.held is held
    assert check.condition() == (False, "CheckFailed", MEMORY_ERROR)


def test_passing_check_and_warnings() -> None:
    clean = check_job(spec(), None)
    assert clean == CheckResult() and clean.condition() == (True, "Passed", "")
    warned = check_job(spec(stopAfter={}), None)
    assert not warned.held and warned.errors == ()
    status, reason, message = warned.condition()
    assert (status, reason) == (True, "PassedWithWarnings")
    assert message.startswith("stopAfter: neither outerSteps nor tokens is set")


def test_held_job_is_pending_with_the_errors_and_never_fails_for_its_absent_syncer() -> None:
    check = check_job(spec(**TOO_SMALL), None)
    # An hour on, no syncer ever answered: without the hold that is Failed (unreachable).
    obs = observation(islands=[], syncer=None, spec=TOO_SMALL, now=T0 + timedelta(hours=1))
    held = compute_status(dataclasses.replace(obs, check=check), {"phase": "Pending"})
    assert held.phase == "Pending"
    assert held.message == (
        "pre-flight check failed, no pods created until the spec is fixed: " + MEMORY_ERROR
    )
    checked = {c.type: c for c in held.conditions}["Checked"]
    assert (checked.status, checked.reason, checked.message) == (
        "False",
        "CheckFailed",
        MEMORY_ERROR,
    )
    assert compute_status(obs, {"phase": "Pending"}).phase == "Failed"  # the same, unchecked


def test_events_once_per_change_of_what_the_check_says(caplog: pytest.LogCaptureFixture) -> None:
    body = {"metadata": {"namespace": "ns", "name": "job"}}
    notes: dict[str, str] = {}
    caplog.set_level(logging.INFO, logger="diloco_operator")

    def posted() -> list[str]:
        lines = [r.getMessage() for r in caplog.records]
        caplog.clear()
        return lines

    post_check_event(notes, body, check_job(spec(), None))
    assert posted() == []  # a clean first pass says nothing
    failing = check_job(spec(**TOO_SMALL), None)
    post_check_event(notes, body, failing)
    post_check_event(notes, body, failing)
    assert posted() == [f"ns/job: CheckFailed {MEMORY_ERROR}"]
    post_check_event(notes, body, check_job(spec(), None))
    assert posted() == ["ns/job: CheckPassed the pre-flight check passes"]
