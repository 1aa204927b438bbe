"""The syncer as the operator last saw it: its status document, typed, and the membership changes
it acknowledged since (pure).

The status (GET /v1/status) is parsed once, by the client, into api.documents.SyncerStatus, and
the policies (phase, conditions, progress, refusals, final weights, membership) read its fields,
never its keys. Between two reads the operator may set islands' states (PUT /v1/islands/{island},
syncer_calls.py); until the next read shows them, the policies must see those states (an island
dropped now counts as out of the quorum now), so they are kept beside the document, which stays
as the syncer wrote it, and laid over its islands here.

The document's `health` is not one of SyncerStatus's fields (the syncer has sent it since
syncer/state/problems.py, older syncers do not): SyncerHealth types it from the document's extra
keys, forgiving what it cannot read, since a syncer's health problems must not make its status
unreadable.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

from diloco_trainer.api.documents import Document, IslandStatus, SyncerStatus
from pydantic import (
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)

HEALTH_KEY = "health"  # the status document's key for syncer/state/problems.py's report


def _none_if_unreadable(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    try:
        return handler(value)
    except ValidationError:
        return None


def _unknown_problem_if_unreadable(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    try:
        return handler(value)
    except ValidationError:
        return HealthProblem()  # counted, as a problem of no known kind


def _empty_if_unreadable(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    try:
        return handler(value)
    except ValidationError:
        return []


class HealthProblem(Document):
    """One problem of the syncer's health report: its kind (syncer/state/problems.py) and how often
    it happened; None where the syncer sent something else. Its free text is never read."""

    kind: Annotated[StrictStr | None, WrapValidator(_none_if_unreadable)] = None
    count: Annotated[StrictInt | None, WrapValidator(_none_if_unreadable)] = None


class SyncerHealth(Document):
    """The status document's `health`: {"healthy", "problems": [{"kind", "count", ...}]}.

    Only `healthy: false` is a problem: anything else (missing, an older syncer, not a boolean)
    reads as healthy, as it always has.
    """

    healthy: Annotated[StrictBool | None, WrapValidator(_none_if_unreadable)] = None
    problems: Annotated[
        list[Annotated[HealthProblem, WrapValidator(_unknown_problem_if_unreadable)]],
        WrapValidator(_empty_if_unreadable),
    ] = Field(default_factory=list)

    @property
    def sick(self) -> bool:
        """The syncer reports a problem (healthy is false)."""
        return self.healthy is False

    @classmethod
    def of(cls, status: SyncerStatus) -> SyncerHealth:
        """The health report of a status document (healthy when it has none it can read)."""
        doc = (status.model_extra or {}).get(HEALTH_KEY)
        return cls.model_validate(doc) if isinstance(doc, Mapping) else cls()


@dataclass(frozen=True)
class SyncerView:
    """The syncer's status as last read, with the island states it acknowledged since."""

    status: SyncerStatus
    acknowledged: Mapping[str, str] = field(default_factory=dict)  # island -> state set since

    def island(self, name: str) -> IslandStatus | None:
        """What the syncer knows of island `name` (its state as last set), None if nothing."""
        info = self.status.islands.get(name)
        state = self.acknowledged.get(name)
        if state is None:
            return info
        if info is None:
            return IslandStatus(state=state)  # set before the syncer had heard of it
        return info.model_copy(update={"state": state})

    def islands(self) -> dict[str, IslandStatus]:
        """Every island the syncer knows, or was told of since the read, by name."""
        names = dict.fromkeys([*self.status.islands, *self.acknowledged])  # ordered, once each
        return {name: info for name in names if (info := self.island(name)) is not None}

    def island_states(self) -> dict[str, str]:
        """{island: state} for every island the syncer knows (as last set)."""
        return {name: info.state for name, info in self.islands().items()}

    def dropped_for_refusals(self) -> set[str]:
        """Islands the syncer dropped itself for refused pushes (their state and reason say so)."""
        return {name for name, info in self.islands().items() if info.dropped_for_refusals}

    def health(self) -> SyncerHealth:
        """The syncer's own health report."""
        return SyncerHealth.of(self.status)
