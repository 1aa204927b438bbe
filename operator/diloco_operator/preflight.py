"""The pre-flight check of a job before its pods exist, for a user who has only kubectl.

The rules are `diloco check`'s that the spec alone answers (diloco_trainer/api/preflight.py: no
stop condition, a warm-up longer than the run, the built-in GPT's memory of a learner's step and
of the syncer's evaluation against the pods' `resources.limits`). The result is the job's
`Checked` condition (True: passed, with any warnings in its message; False: why it cannot run)
and, whenever what it says changes, an Event (`CheckFailed`, `CheckWarnings`, `CheckPassed`
after a failure).

A job whose check finds errors while it has not started (no phase yet, or Pending) is held: the
operator creates none of its children, and it stays Pending with the errors as its message,
until the spec is fixed (each edit is checked again). A job already past Pending is not
stopped by an edit that fails the check; its condition and an Event say what is wrong.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from diloco_trainer.api.preflight import spec_findings

from diloco_operator.api import DiLoCoJobSpec
from diloco_operator.events import post_event

CHECK_CONDITION = "Checked"
NOTE_KEY = "preflight"  # JobRuntime.notes: the last check message posted as an Event
HELD_PHASES = (None, "Pending")  # a failing check holds a job only before it has started


@dataclass(frozen=True)
class CheckResult:
    """What the check found for the job's current spec, and whether it holds the job."""

    errors: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    held: bool = False

    @property
    def ok(self) -> bool:
        return not self.errors

    def condition(self) -> tuple[bool, str, str]:
        """(status, reason, message) of the Checked condition."""
        if self.errors:
            return False, "CheckFailed", "; ".join(self.errors)
        if self.warnings:
            return True, "PassedWithWarnings", "; ".join(self.warnings)
        return True, "Passed", ""

    def held_message(self) -> str:
        """The job's status message while the check holds it."""
        return "pre-flight check failed, no pods created until the spec is fixed: " + "; ".join(
            self.errors
        )


def check_job(spec: DiLoCoJobSpec, status: Mapping[str, Any] | None) -> CheckResult:
    """The check of `spec`; held when it fails and the stored status has not started."""
    found = spec_findings(spec)
    phase = (status or {}).get("phase")
    return CheckResult(
        errors=tuple(found.errors),
        warnings=tuple(found.warnings),
        held=bool(found.errors) and phase in HELD_PHASES,
    )


def post_check_event(
    notes: MutableMapping[str, str], body: Mapping[str, Any], check: CheckResult
) -> None:
    """An Event when the check's verdict or message differs from the last one posted: the
    errors (Warning CheckFailed), the warnings (Warning CheckWarnings), or a pass after either
    (Normal CheckPassed). A clean pass the first time posts nothing."""
    status, reason, message = check.condition()
    said = f"{reason}: {message}"
    before = notes.get(NOTE_KEY)
    if said == before or (before is None and reason == "Passed"):
        return
    notes[NOTE_KEY] = said
    if not status:
        post_event(body, "Warning", "CheckFailed", message)
    elif check.warnings:
        post_event(body, "Warning", "CheckWarnings", message)
    else:
        post_event(body, "Normal", "CheckPassed", "the pre-flight check passes")
