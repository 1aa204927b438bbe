"""The job's status document from what the operator observed (pure).

`compute_status` only assembles: the phase comes from `phase.decide_phase`, the conditions from
`conditions.job_conditions`, the progress figures and island entries from `progress`. The rest
of this module compares and writes status documents and answers the two questions the sync asks
of a stored status (should islands run, is the finished job past its TTL).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from diloco_operator.api import DiLoCoJobSpec, DiLoCoJobStatus, IslandCounts
from diloco_operator.conditions import job_conditions
from diloco_operator.final_weights import final_checkpoint
from diloco_operator.observation import Observation, conditions_by_type
from diloco_operator.phase import FINAL_PHASES, decide_phase, finished_time
from diloco_operator.status_progress import (
    carried_progress,
    island_statuses,
    job_completion,
    rounds_summary,
    waiting_summary,
)
from diloco_operator.times import parse_time


def compute_status(obs: Observation, previous: Mapping[str, Any] | None) -> DiLoCoJobStatus:
    """The new status, given the observation and the status currently stored (or None)."""
    verdict = decide_phase(obs, previous)
    if obs.check is not None and obs.check.held:  # no children until the spec passes
        verdict = replace(verdict, phase="Pending", message=obs.check.held_message(), failure=None)
    islands = island_statuses(obs, verdict.running)
    syncer = obs.syncer.status if obs.syncer is not None else None
    progress = carried_progress(syncer, previous)
    completion = job_completion(obs.spec.stop_after, syncer, previous)
    return DiLoCoJobStatus(
        phase=verdict.phase,
        observed_generation=obs.generation,
        conditions=job_conditions(verdict, obs, conditions_by_type(previous)),
        islands=IslandCounts(
            desired=verdict.desired,
            ready=verdict.ready,
            active=sum(i.in_quorum for i in islands),
        ),
        islands_summary=f"{verdict.ready}/{verdict.desired}",
        rounds_summary=rounds_summary(islands),
        waiting_summary=waiting_summary(islands),
        island_statuses=islands,
        outer_step=progress.outer_step,
        tokens=progress.tokens,
        loss=progress.loss,
        eval_loss=progress.eval_loss,
        last_sync_time=progress.last_sync_time,
        progress=completion.progress,
        eta=completion.eta,
        finished_time=finished_time(verdict.phase, previous, obs.now),
        message=verdict.message,
        final_checkpoint=final_checkpoint(obs.spec, syncer, previous),
    )


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
