"""Islands whose accelerators idle waiting for merges (issue 45): the WaitingForMerges condition
and its Event (a pure rule over the syncer's status reads, then the posting).

Each island's learner says in its heartbeats what share of its wall time since the heartbeat
before it spent blocked on the syncer instead of training (merge waits, the step cap's and the
late merge's holds: the trainer's learner/step_costs.WaitMeter); the syncer shows the latest in
its status (IslandStatus.waiting). On a link slower than the job's traffic that share is large
(K = 1 learners trained 8-24% of the wall in bench.busy_link) and nothing else tells the user.

The rule, per island, over the syncer's status documents as the operator reads them (every
triggers.STATUS_INTERVAL; a document read twice counts once, by its clock):

- raised after RAISE_READS reads in a row with a share of RAISE_SHARE or more;
- cleared after CLEAR_READS reads in a row below CLEAR_SHARE (hysteresis: a share between the
  two keeps the island as it was). A share not known (an older learner, none reported yet), an
  island not active at the syncer (its share is stale) and a drained island (it waits for the
  finish, not for a merge) read as below CLEAR_SHARE.

The job's condition WaitingForMerges is True while any island is raised, its message naming
them, their latest shares and what to change; one Warning Event `IslandsWaitForMerges` is posted
when it turns True (one per episode, not per sync; again once it cleared and came back).

An operator restart forgets the streaks: the stored condition, when True, is taken up again with
the islands whose stored share (status.islandStatuses[].waiting) is CLEAR_SHARE or more, and
its Event is not posted again (resumed).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from diloco_trainer.api.documents import IslandStatus

from diloco_operator.events import post_event
from diloco_operator.syncer_view import SyncerView

WAIT_CONDITION = "WaitingForMerges"
WAIT_EVENT = "IslandsWaitForMerges"
RAISE_SHARE = 0.25  # a quarter of the accelerators' time idle: worth changing the job for
RAISE_READS = 3  # status reads in a row (~15 s at STATUS_INTERVAL 5 s): not one slow merge
CLEAR_SHARE = 0.10
CLEAR_READS = 3
DOCS = "docs/cluster.md, 'WaitingForMerges'"


@dataclass(frozen=True)
class IslandWaits:
    """One island's streaks: reads in a row at or above RAISE_SHARE (high) and below
    CLEAR_SHARE (low), whether it is raised, and its latest share (None: not known)."""

    high: int = 0
    low: int = 0
    raised: bool = False
    share: float | None = None


@dataclass(frozen=True)
class MergeWaits:
    """Every island's streaks, and the clock of the syncer document counted last."""

    islands: Mapping[str, IslandWaits] = field(default_factory=dict)
    read_at: float | None = None

    def raised(self) -> dict[str, float | None]:
        """The raised islands and their latest shares, in the order they were read."""
        return {name: w.share for name, w in self.islands.items() if w.raised}


def next_island(before: IslandWaits, share: float | None) -> IslandWaits:
    """One more read of an island's share (None: not known, read as below CLEAR_SHARE)."""
    high = before.high + 1 if share is not None and share >= RAISE_SHARE else 0
    low = before.low + 1 if share is None or share < CLEAR_SHARE else 0
    raised = low < CLEAR_READS if before.raised else high >= RAISE_READS
    return IslandWaits(high=high, low=low, raised=raised, share=share)


def counted_share(info: IslandStatus | None) -> float | None:
    """The share an island's status entry counts with: None when not known, not active (its
    last share is stale) or drained (it waits for the finish, not for merges)."""
    if info is None or info.known_state != "active" or info.drained:
        return None
    return info.waiting


def read_waits(
    before: MergeWaits, syncer: SyncerView | None, islands: Collection[str]
) -> MergeWaits:
    """`before` after one status read of the job's `islands`; unchanged when the syncer was not
    reached or the document is the one counted last (the same clock)."""
    if syncer is None or (before.read_at is not None and syncer.status.time == before.read_at):
        return before
    return MergeWaits(
        islands={
            name: next_island(
                before.islands.get(name, IslandWaits()), counted_share(syncer.island(name))
            )
            for name in islands
        },
        read_at=syncer.status.time,
    )


def resumed(previous: Mapping[str, Any] | None) -> MergeWaits:
    """The streaks an operator takes up from the job's stored status (after its restart): the
    islands whose stored share is CLEAR_SHARE or more raised, when the stored condition is
    True; nothing otherwise."""
    status = previous or {}
    stored = [c for c in status.get("conditions") or [] if isinstance(c, dict)]
    if not any(c.get("type") == WAIT_CONDITION and c.get("status") == "True" for c in stored):
        return MergeWaits()
    islands = {}
    for entry in status.get("islandStatuses") or []:
        share = entry.get("waiting") if isinstance(entry, dict) else None
        if isinstance(share, (int, float)) and share >= CLEAR_SHARE and "name" in entry:
            islands[str(entry["name"])] = IslandWaits(raised=True, share=float(share))
    return MergeWaits(islands=islands)


def wait_condition(waits: MergeWaits | None) -> tuple[bool, str, str]:
    """(status, reason, message) of the WaitingForMerges condition."""
    raised = waits.raised() if waits is not None else {}
    if not raised:
        known = waits is not None and any(w.share is not None for w in waits.islands.values())
        return False, "NotWaiting" if known else "NotReported", ""
    shares = ", ".join(
        f"{name} {'?' if share is None else f'{share:.0%}'}" for name, share in raised.items()
    )
    return (
        True,
        WAIT_EVENT,
        f"islands idle waiting for the syncer's merges (share of their wall time, "
        f"{RAISE_READS} status reads in a row at {RAISE_SHARE:.0%} or more): {shares}. The link "
        "to the syncer (or the syncer) is slower than the islands' sync traffic. To keep the "
        "accelerators busy: more inner steps between syncs (inner.steps), smaller pushes "
        "(sync.compression), more fragments streamed (sync.fragments), or more steps "
        f"overlapped (sync.overlapSteps); {DOCS}",
    )


def post_wait_event(
    body: Mapping[str, Any], waits: MergeWaits | None, posted: MutableMapping[str, str]
) -> None:
    """One Warning Event when the condition turns True (`posted`: the job's runtime notes, where
    its key stays until the condition clears)."""
    raised, reason, message = wait_condition(waits)
    key = f"{body['metadata'].get('uid', '')}/{WAIT_EVENT}"
    if not raised:
        posted.pop(key, None)  # cleared: the next episode is news again
    elif key not in posted:
        posted[key] = message
        post_event(body, "Warning", reason, message)


def note_resumed(
    body: Mapping[str, Any], waits: MergeWaits, posted: MutableMapping[str, str]
) -> None:
    """An episode taken up from the stored status (resumed) was posted before the restart."""
    if waits.raised():
        posted.setdefault(f"{body['metadata'].get('uid', '')}/{WAIT_EVENT}", "resumed")
