"""Typed JSON documents of the syncer's routes (torch-free): one definition each, written by the
syncer and read by the learners, the operator and the local runner (api/manifest.py holds the
checkpoint manifest).

Each model parses a decoded JSON object with `from_json` and gives the wire form (camelCase keys)
back with `to_json` (every field) or `to_wire` (the fields given: what the syncer writes); in
Python the fields are snake_case (``status.outer_step``). Parsing is
forward compatible: keys a newer syncer adds are kept (to_json gives them back) and otherwise
ignored, and fields an older syncer did not send take neutral defaults. A document with a field of
the wrong type, or without a field every syncer sends (the required ones below), is refused with a
DocumentError that names each problem.

Island states stay plain strings here (a newer syncer may report a state this code does not know,
and one unknown island must not make the whole status unreadable): compare them with the
protocol.STATE_* constants, or use IslandStatus.known_state.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from diloco_trainer.api.protocol import (
    ISLAND_STATES,
    STATE_ACTIVE,
    IslandState,
    dropped_for_refusals,
)

_D = TypeVar("_D", bound="Document")

# Offending values are quoted in error messages up to this many characters.
_MAX_QUOTED = 80


class DocumentError(ValueError):
    """A JSON document that does not have the documented shape."""


def _problems(name: str, err: ValidationError) -> str:
    """One line per problem: where (dotted camelCase path), what, and the value found."""
    lines = []
    for e in err.errors(include_url=False):
        if not e["loc"]:  # a check of the whole document: its message says what is wrong
            lines.append(e["msg"].removeprefix("Value error, "))
            continue
        where = ".".join(str(p) for p in e["loc"])
        found = "" if e["type"] == "missing" else f" (got {repr(e['input'])[:_MAX_QUOTED]})"
        lines.append(f"{where}: {e['msg']}{found}")
    return f"malformed {name}: " + "; ".join(lines)


class Document(BaseModel):
    """Base of the syncer's JSON documents: camelCase on the wire, extra keys kept, immutable."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="allow", frozen=True
    )

    @classmethod
    def from_json(cls: type[_D], doc: Any) -> _D:
        """Parse a decoded JSON object; DocumentError (a ValueError) when it is malformed."""
        if not isinstance(doc, Mapping):
            raise DocumentError(
                f"malformed {cls.__name__}: expected a JSON object, got {type(doc).__name__}"
            )
        try:
            return cls.model_validate(doc)
        except ValidationError as err:
            raise DocumentError(_problems(cls.__name__, err)) from None

    def to_json(self) -> dict[str, Any]:
        """The wire form: camelCase keys, JSON types, extra keys included."""
        return self.model_dump(by_alias=True, mode="json")

    def to_wire(self) -> dict[str, Any]:
        """The wire form of the fields given when the document was made (by its writer, or
        present in what was parsed): what the syncer sends and stores, so a field the writer
        leaves out is the reader's default, and a parsed document comes back as it was read."""
        return self.model_dump(by_alias=True, mode="json", exclude_unset=True)


# ----- answers to the learner routes ---------------------------------------------------------


class JoinInfo(Document):
    """POST /v1/join: how parameters are split into fragments and where each fragment stands."""

    fragments: list[list[str]]
    versions: list[int]
    outer_step: int
    finished: bool
    codec: str
    pull_compression: str = "none"  # codec of pulled weight updates (older syncers: full weights)
    state: str = STATE_ACTIVE  # the island's membership state after the join
    # The island's tokens merged into the global model so far (its record's mergedTokens): a
    # learner restarted mid-job resumes its data stream there instead of replaying it from the
    # first batch. 0 from older syncers and for a new island.
    island_tokens: int = 0
    # The island's round H_i (inner steps between pushes of a fragment: inner.stepsPerIsland);
    # its learner adopts it at its next round boundary. Absent (older syncers): inner.steps.
    inner_steps: int | None = Field(None, ge=1)
    # K = M: the token budget is split per island by stop targets, not 1/M each (the islands'
    # rounds differ or did: core/island_rounds.split_budget). Once true, true for the job.
    split_budget: bool = False
    # The syncer run that answered (PushAnswer.run): a learner whose heartbeat is answered by
    # another run (the syncer restarted since this join) may have to join again
    # (learner/join_marks.join_unknown). Absent: older syncers.
    run: str = ""
    # The island's joins in the syncer's record, this one included (IslandStatus.joins): a
    # later run whose record counts fewer lacks this join (join_unknown). Absent: older syncers.
    joins: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _one_version_per_fragment(self) -> JoinInfo:
        if len(self.versions) != len(self.fragments):
            raise ValueError(f"{len(self.versions)} versions for {len(self.fragments)} fragments")
        return self


class PushAnswer(Document):
    """POST /v1/fragments/{f}/push: whether the pseudo-gradient was taken and the fragment's
    version then (the push is in the round that makes version + 1)."""

    accepted: bool
    version: int
    pending: int = 0  # contributions in the fragment's open round
    replaced: bool = False  # it replaced the island's earlier pending push
    duplicate: bool = False  # a retry of a push already answered (this is that first answer)
    finished: bool = False  # the job has finished: nothing is accepted any more
    reason: str = ""  # why it was not accepted
    inner_steps: int | None = Field(None, ge=1)  # the island's H_i now (as in JoinInfo)
    # The island's stop target once set (as in HeartbeatAnswer): a push is answered every few
    # steps, a heartbeat once a beat, and a target set late (the split held for an island's
    # pace, or islands that sped up near the end) came after the island had passed it. A replayed
    # answer carries the target as it is now. Absent: none yet.
    stop_at: int | None = None
    # The syncer run that answered (made at its start-up; a restart is a new run): a learner
    # names it when it pulls the merge of this push, so that a restarted syncer, which lost the
    # push with its pending rounds, says so at once (protocol.ERROR_RESTARTED). Absent: older.
    run: str = ""


class HeartbeatAnswer(Document):
    """POST /v1/heartbeat: the island's membership state and whether the job finished."""

    state: str
    finished: bool
    versions: list[int] = Field(default_factory=list)
    # K < M, near the budget: the count of processed tokens (the learner's own, as it reports
    # them) at which the island drains (syncer/state/targets.py). Absent: none yet.
    stop_at: int | None = None
    inner_steps: int | None = Field(None, ge=1)  # the island's H_i now (as in JoinInfo)
    split_budget: bool = False  # as in JoinInfo
    # The syncer run that answered (JoinInfo.run) and each fragment's version when it started
    # (what it resumed from): a learner that joined another run at or past those versions
    # joined after the checkpoint it resumed from, which therefore lacks that join, and joins
    # again (learner/join_marks.join_unknown). Absent: older syncers.
    run: str = ""
    resumed: list[int] = Field(default_factory=list)
    # The island's joins in this run's record (JoinInfo.joins): fewer than the learner's last
    # join said, the run lacks that join, whatever its versions. Absent: older syncers.
    joins: int | None = Field(None, ge=0)


class MembershipAnswer(Document):
    """POST /v1/leave and PUT /v1/islands/{island}: the island's state afterwards."""

    island: str
    state: str
    reason: str = ""


class MembershipRequest(Document):
    """PUT /v1/islands/{island}: the admin's (the operator's) drop or re-add of an island; the
    syncer checks `state` against protocol.ADMIN_STATES and keeps at most 500 characters of
    `reason`."""

    state: str
    reason: str = ""


# ----- the status document (GET /v1/status) --------------------------------------------------


class IslandStatus(Document):
    """What the syncer knows about one island (the status document's ``islands`` values)."""

    state: str  # one of protocol.ISLAND_STATES from this version's syncer
    reason: str = ""  # why the admin route set the state
    joins: int = 0
    replicas: int = 0
    last_seen: float = 0.0  # seconds since the epoch (syncer clock) of its last sign of life
    last_push: float | None = None
    pushes: int = 0
    tokens: int = 0  # tokens it reports having consumed (heartbeats)
    merged_tokens: int = 0  # its tokens in merges, averaged over fragments
    loss: float | None = None
    step: int = 0
    step_time: float | None = None
    # Its learner holds its inner steps at the step cap (a fragment carries the most one push
    # may and the syncer has not answered it; learner/fragment_sync.py), as its latest heartbeat
    # said. Absent (a syncer before this field): not holding.
    holding: StrictBool = False
    # Its learner has trained its share of stopAfter and every push of it was merged: it pushes
    # nothing more and waits for the finish (learner/drain.py). Absent: not drained.
    drained: StrictBool = False
    # The share of its learner's wall time, over the window since the heartbeat before its
    # latest, that it spent blocked on the syncer instead of training (merge waits, the step
    # cap's and the late merge's holds: learner/step_costs.WaitMeter), as its latest heartbeat
    # said; 0..1. Absent: not known (a learner or syncer before this field, or no heartbeat yet).
    waiting: float | None = Field(None, ge=0, le=1)
    # Its round H_i as the syncer measured it (inner.stepsPerIsland auto): absent until the
    # first change from inner.steps, and with stepsPerIsland fixed.
    inner_steps: int | None = Field(None, ge=1)

    @property
    def known_state(self) -> IslandState | None:
        """The state when it is one this code knows, else None (a newer syncer's state)."""
        return self.state if self.state in ISLAND_STATES else None

    @property
    def dropped_for_refusals(self) -> bool:
        """The syncer dropped it for refused pushes (protocol.DROPPED_FOR_REFUSALS), not the
        admin route: the operator leaves it out."""
        return dropped_for_refusals(self.state, self.reason)


class EvalPoint(Document):
    """One evaluation of the global weights (the status document's ``evalHistory``)."""

    outer_step: int
    tokens: int = 0
    eval_loss: float | None = None
    time: float | None = None


class MergeContributor(Document):
    """One island's part in a merge."""

    island: str
    base_version: int = 0
    lag: int = 0
    tokens: int = 0
    steps: int = 0
    loss: float | None = None
    received_at: float | None = None  # when the syncer took the push (its clock; phase alignment)
    work: float = 0.0  # its work in rounds (core/contributions.py)
    discount: float = 1.0  # its staleness discount
    scale: float = 1.0  # the scale applied to its pseudo-gradient
    raw_weight: float = 0.0
    weight: float = 0.0  # its share (the raw weights normalised to sum to 1)
    # Of its steps, those trained before its base was installed (the push's keptSteps; docs/
    # algorithm.md, "A push's kept steps are recorded").
    kept_steps: int = 0


class MergeRecord(Document):
    """One merge (the status document's recent ``merges``, and one line of merges.jsonl: the
    syncer writes each as a MergeRecord)."""

    version: int
    fragment: int
    outer_step: int = 0
    time: float = 0.0
    quorum: int = 0
    grace: float = 0.0
    rule: str = ""
    fraction: float = 1.0  # the share of a round of work it carried (core/contributions.py)
    # The share of it that entered the outer momentum (core/contributions.momentum_share: below
    # 1 only when a contributor's base was stale).
    momentum: float = 1.0
    complete: bool = False  # it held every island's push, so it closed the round (core/outer.py)
    rounds: int = 0  # the fragment's completed rounds of work after it
    tokens: int = 0
    merge_seconds: float = 0.0
    # The movement cap of a job of two (syncer.guards.movementFactor): the norm of the merged
    # pseudo-gradient per round of work before the clip (None: not read, the cap is off or the
    # job has three or more islands) and what the clip multiplied it by (1: not clipped).
    movement: float | None = None
    clip: float = 1.0
    contributors: list[MergeContributor] = Field(default_factory=list)


class FragmentMerges(Document):
    """GET /v1/fragments/{f}/merges?from=V: the recent merges of one fragment from version V on,
    with what phase alignment reads beside them (learner/phase_alignment.py): the syncer's clock
    and each island's step time. A learner at K < M reads it after each accepted push; the whole
    status document it read before carried every fragment's merges, every island's record and up
    to 1,000 evaluations (23-27 KB a push at gpt-tiny, eight fragments: issue 45, "frag47"), and
    held only the last RECENT_MERGES merges of all fragments, so at eight fragments the merge a
    reading needed was often gone."""

    fragment: int
    time: float  # the syncer's clock when it wrote the document
    # Each island's step time as it last reported it (seconds; islands with none are left out).
    step_times: dict[str, float] = Field(default_factory=dict)
    merges: list[MergeRecord] = Field(default_factory=list)  # oldest first


class CheckpointRef(Document):
    """The newest checkpoint on the syncer's disk (the final weights once finished)."""

    path: str  # the ckpt-* directory, as the syncer's process sees it
    outer_step: int


class SyncerStatus(Document):
    """GET /v1/status: the job's progress, rounds, islands and recent merges.

    `to_json()` gives the syncer's document back exactly (a test checks this against a real
    syncer), so the syncer can build its answer as a SyncerStatus.
    """

    outer_step: int  # outer steps completed: rounds of work, the least of any fragment
    versions: list[int]  # each fragment's version (merges so far)
    finished: bool
    job_name: str = ""
    quorum: int = 0  # the effective quorum: min(K, active + awaited islands)
    awaited_islands: int = 0  # islands of the job not heard of yet
    quorum_target: int = 0  # K (sync.quorum)
    grace: float = 0.0  # the grace window, seconds
    fragments: int = 0
    pending: list[int] = Field(default_factory=list)  # contributions in each open round
    codec: str = ""
    pull_compression: str = "none"
    pulls: dict[str, int] = Field(default_factory=dict)  # answered pulls by kind (full, updates)
    tokens: int = 0  # tokens merged into the global model
    loss: float | None = None  # training loss of the latest merge's contributions
    eval_loss: float | None = None
    initial_eval_loss: float | None = None
    eval_history: list[EvalPoint] = Field(default_factory=list)
    bytes_in: int = 0
    bytes_out: int = 0
    last_merge_time: float | None = None
    merge_count: int = 0
    active_islands: int = 0
    islands: dict[str, IslandStatus] = Field(default_factory=dict)
    merges: list[MergeRecord] = Field(default_factory=list)
    # Pushes of known islands the syncer refused since it started: {island: {reason: count}},
    # reasons from protocol.REFUSAL_REASONS (older syncers: none).
    refusals: dict[str, dict[str, int]] = Field(default_factory=dict)
    resumed_from: str | None = None  # the checkpoint the syncer resumed from
    run: str = ""  # this run of the syncer (PushAnswer.run): a restart is a new one
    checkpoint: CheckpointRef | None = None  # the newest checkpoint written or resumed from
    failure: str | None = None  # why the syncer stopped taking work (it must be restarted)
    time: float = 0.0  # the syncer's clock when it wrote the document
    digest: str | None = None  # sha256 of weights + momentum (only with ?digest=1)

    def to_json(self) -> dict[str, Any]:
        doc = super().to_json()
        if self.digest is None:  # asked for only: the plain document has no such key
            del doc["digest"]
        return doc

    def island_states(self) -> dict[str, str]:
        """{island: state} for every island the syncer knows."""
        return {name: info.state for name, info in self.islands.items()}

    def dropped_for_refusals(self) -> set[str]:
        """Islands the syncer dropped itself for refused pushes."""
        return {name for name, info in self.islands.items() if info.dropped_for_refusals}


def parse_json_object(raw: bytes | str, what: str) -> dict[str, Any]:
    """A JSON object from an HTTP body; DocumentError naming `what` when it is not one."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DocumentError(f"malformed {what}: not JSON ({err})") from None
    if not isinstance(doc, dict):
        raise DocumentError(f"malformed {what}: expected a JSON object, got {type(doc).__name__}")
    return doc
