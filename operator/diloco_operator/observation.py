"""What the status of a job is computed from: one snapshot gathered by the sync (plain data)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from diloco_operator.api import DiLoCoJobSpec
from diloco_operator.health import IslandHealth, PodView
from diloco_operator.merge_waits import MergeWaits
from diloco_operator.preflight import CheckResult
from diloco_operator.syncer_view import SyncerView


@dataclass(frozen=True)
class Observation:
    """Everything the status is computed from, gathered by the sync of a job."""

    generation: int
    created: datetime
    spec: DiLoCoJobSpec
    islands: Mapping[str, IslandHealth]  # desired islands, in index order
    syncer_pods: Sequence[PodView]  # empty with a remote syncer
    syncer: SyncerView | None  # its /v1/status (and states set since), None when not reached
    syncer_error: str | None
    rolling: Sequence[str]  # island StatefulSets mid-rollout
    now: datetime
    conflicts: Sequence[str] = ()  # children left alone: another object holds their name
    check: CheckResult | None = None  # the pre-flight check (preflight.py); None: not run
    # The islands' waits for merges over the status reads so far (merge_waits.py); None: none.
    waits: MergeWaits | None = None


ConditionsByType = Mapping[str, Mapping[str, Any]]


def conditions_by_type(previous: Mapping[str, Any] | None) -> dict[str, Mapping[str, Any]]:
    """The stored status's conditions, keyed by type (malformed entries skipped)."""
    items = (previous or {}).get("conditions") or []
    return {c["type"]: c for c in items if isinstance(c, dict) and isinstance(c.get("type"), str)}
