"""Builders of operator Observations and of the syncer's typed status for the phase,
conditions, progress, refusals and membership tests."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from diloco_operator import api
from diloco_operator.health import IslandHealth, PodView
from diloco_operator.merge_waits import MergeWaits
from diloco_operator.observation import Observation
from diloco_operator.syncer_view import SyncerView
from diloco_trainer.api.documents import SyncerStatus

T0 = datetime(2025, 1, 1, tzinfo=UTC)

SYNCER: dict[str, Any] = {
    "outerStep": 12,
    "versions": [12],
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


def syncer_status(doc: Mapping[str, Any]) -> SyncerStatus:
    """A status document as the operator's client parses it; the fields every syncer sends
    (outerStep, versions, finished) default to a fresh job's."""
    return SyncerStatus.from_json({"outerStep": 0, "versions": [0], "finished": False, **doc})


def syncer_view(
    doc: Mapping[str, Any] | None, acknowledged: Mapping[str, str] | None = None
) -> SyncerView | None:
    """The operator's view of a syncer that answered with `doc` (None: not reached)."""
    if doc is None:
        return None
    return SyncerView(syncer_status(doc), dict(acknowledged or {}))


def island(name: str, ready: int = 2, *, crash: int = 0, restarts: int = 0) -> IslandHealth:
    """An island of two pods, `ready` of them Ready."""
    return IslandHealth(
        name=name,
        desired_pods=2,
        ready_pods=ready,
        restarts=restarts,
        crash_looping_pods=crash,
        missing=(),
        not_ready=(),
    )


def observation(
    *,
    islands: Sequence[IslandHealth] | None = None,
    syncer: dict[str, Any] | None = SYNCER,
    spec: dict[str, Any] | None = None,
    now: datetime = T0,
    syncer_pods: Sequence[PodView] = (),
    rolling: Sequence[str] = (),
    waits: MergeWaits | None = None,
) -> Observation:
    """Two healthy islands and a reachable syncer unless told otherwise."""
    islands = islands if islands is not None else [island("island-0"), island("island-1")]
    return Observation(
        generation=3,
        created=T0,
        spec=api.parse_job_spec({"image": "x", **(spec or {})}),
        islands={i.name: i for i in islands},
        syncer_pods=syncer_pods,
        syncer=syncer_view(syncer),
        syncer_error=None if syncer is not None else "connection refused",
        rolling=rolling,
        now=now,
        waits=waits,
    )


def crash_looping_syncer(restarts: int) -> PodView:
    """The syncer pod in CrashLoopBackOff after `restarts` restarts."""
    return PodView(
        name="job-syncer-abc",
        island=None,
        component="syncer",
        ready=False,
        restarts=restarts,
        crash_looping=True,
    )
