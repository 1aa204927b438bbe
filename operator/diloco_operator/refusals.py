"""Events for the contributions a job's syncer refused (pure deltas, then the posting).

The syncer counts the refused pushes of each island by reason since it started (its status
document's `refusals`, reasons from protocol.REFUSAL_REASONS). Each sync compares those counts
with the ones seen before (kept in the job's runtime record) and posts a Warning Event
`ContributionRefused` per island and reason whose count grew, and counts them in the operator's
metric. An Event names the island, the reason code and the counts only, never the syncer's text
(a remote syncer's answers are not copied into the job).

- A count lower than before means the syncer restarted (its counts start again at 0): the new
  count is all new refusals (as Prometheus reads a counter reset).
- After an operator restart the first counts seen are reported as new: an Event repeated rather
  than one lost (the message gives the total, so a repeat says nothing false).
- Only the job's own islands: a shared multi-region syncer also counts other clusters' islands,
  whose operators report them.

An island the syncer dropped for refused pushes gets one Warning Event `IslandDroppedBySyncer`
(again after it was re-added and dropped anew): the operator does not re-add it (health.py).

While the syncer reports the health problem `islandAtBound` (an island's pushes all sit at the
learned norm bound: a ratchet, issue 46) the job gets one Warning Event `IslandPushesAtBound`
(again once it cleared and came back); the SyncerHealthy condition names it too (conditions.py).
Likewise the health problem `islandWorkUnsupported` (an island's pushes all move far less than
the other island's per claimed step: zero pushes claiming work) gets one Warning Event
`IslandWorkUnsupported`, and the health problem `evalLossRose` (the syncer's quality guard
ended the job: its eval loss kept rising above the best) one Warning Event `EvalLossRose`, and
the health problem `faintIslandEnded` (a job of two ended for an island's faint pushes with
claims) one Warning Event `FaintIslandEnded`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from diloco_trainer.api.protocol import REFUSAL_REASONS

from diloco_operator import metrics
from diloco_operator.events import post_event
from diloco_operator.syncer_view import SyncerView

REFUSED = "ContributionRefused"
DROPPED_BY_SYNCER = "IslandDroppedBySyncer"
AT_BOUND = "IslandPushesAtBound"
AT_BOUND_KIND = "islandAtBound"  # the syncer's health problem kind (syncer/state/problems.py)
AT_BOUND_MESSAGE = (
    "the syncer reports an island whose pushes all sit at the learned norm bound (a ratchet, or "
    "an island pushing as far as the bound lets it); its status document's health names it"
)
WORK_UNSUPPORTED = "IslandWorkUnsupported"
WORK_UNSUPPORTED_KIND = "islandWorkUnsupported"  # syncer/state/problems.py
WORK_UNSUPPORTED_MESSAGE = (
    "the syncer reports an island whose pushes all move far less than the other island's per "
    "claimed step: work claimed that its pushes do not carry (below 1/32 of it they are refused "
    "and its claims leave the merges; between 1/32 and 1/4 they are merged, named only), or an "
    "honest island further down its lr schedule than the other (islands of unequal speed under a "
    "cosine); its status document's health names it"
)
LEFT_OUT = "IslandLeftOutOfRounds"
LEFT_OUT_KIND = "islandLeftOut"  # syncer/state/problems.py
LEFT_OUT_MESSAGE = (
    "the syncer reports an island whose last pushes to a fragment were all refused (its status "
    "document's refusals say why): no round waits for it and no quorum counts it until a push of "
    "it is accepted, so the other islands merge without it; its status document's health names it"
)
EVAL_LOSS_ROSE = "EvalLossRose"
EVAL_LOSS_ROSE_KIND = "evalLossRose"  # syncer/state/problems.py
EVAL_LOSS_ROSE_MESSAGE = (
    "the syncer's quality guard ended the job: its eval loss rose above syncer.qualityGuard's "
    "margin over the best for patience evaluations in a row (a bad island, or training that "
    "diverged); merging stopped and the final checkpoint is the best-evaluated one"
)
FAINT_ENDED = "FaintIslandEnded"
FAINT_ENDED_KIND = "faintIslandEnded"  # syncer/state/problems.py
FAINT_ENDED_MESSAGE = (
    "the syncer ended this job of two: an island's pushes all moved far less than the other "
    "island's per claimed step and some were merged (faint noise claiming work, which a job of two "
    "cannot bound); merging stopped and the final checkpoint is the best-evaluated one; its "
    "status document's health names the island"
)
# The syncer's health problems that each get one Warning Event while reported (again once they
# cleared and came back): kind -> (Event reason, message).
PROBLEM_EVENTS = {
    AT_BOUND_KIND: (AT_BOUND, AT_BOUND_MESSAGE),
    WORK_UNSUPPORTED_KIND: (WORK_UNSUPPORTED, WORK_UNSUPPORTED_MESSAGE),
    LEFT_OUT_KIND: (LEFT_OUT, LEFT_OUT_MESSAGE),
    EVAL_LOSS_ROSE_KIND: (EVAL_LOSS_ROSE, EVAL_LOSS_ROSE_MESSAGE),
    FAINT_ENDED_KIND: (FAINT_ENDED, FAINT_ENDED_MESSAGE),
}
# A reason this operator does not know (a newer syncer's): counted, never quoted.
OTHER = "other"
# Counts beyond this are not believed (int64, as everywhere in the job's status).
MAX_COUNT = 2**63 - 1

RefusalCounts = dict[tuple[str, str], int]  # (island, reason) -> refused pushes


@dataclass(frozen=True)
class RefusalNote:
    """Refusals of one island for one reason since the last look."""

    island: str
    reason: str
    new: int
    total: int  # since the syncer started

    def message(self) -> str:
        pushes = "push" if self.new == 1 else "pushes"
        return (
            f"{self.island}: {self.new} {pushes} refused ({self.reason}); "
            f"{self.total} since the syncer started"
        )


def refusal_counts(syncer: SyncerView | None, islands: Collection[str]) -> RefusalCounts | None:
    """(island, reason) -> count from the syncer's status, for the job's `islands` only;
    unknown reasons summed as OTHER, counts that are not positive int64s left out. None when
    the syncer was not reached."""
    if syncer is None:
        return None
    counts: RefusalCounts = {}
    for island, by_reason in syncer.status.refusals.items():
        if island not in islands:
            continue
        for reason, count in by_reason.items():
            if not 0 < count <= MAX_COUNT:
                continue
            key = (island, reason if reason in REFUSAL_REASONS else OTHER)
            counts[key] = min(MAX_COUNT, counts.get(key, 0) + count)
    return counts


def new_refusals(before: RefusalCounts | None, after: RefusalCounts) -> list[RefusalNote]:
    """What grew from `before` to `after` (None: nothing seen yet, all of `after` is new)."""
    notes = []
    for (island, reason), total in sorted(after.items()):
        seen = (before or {}).get((island, reason), 0)
        new = total - seen if total >= seen else total  # lower: the syncer restarted
        if new > 0:
            notes.append(RefusalNote(island=island, reason=reason, new=new, total=total))
    return notes


def dropped_message(island: str) -> str:
    return (
        f"{island}: dropped by the syncer for syncer.guards.maxRefusals refused pushes in a "
        "row; the operator does not re-add it while its pods are healthy"
    )


def post_refusal_events(
    body: Mapping[str, Any],
    syncer: SyncerView | None,
    islands: Collection[str],
    seen: RefusalCounts | None,
    posted: MutableMapping[str, str],
) -> RefusalCounts | None:
    """Post the Events for new refusals and new syncer drops of the job's `islands`; returns
    the counts to remember (`seen` unchanged while the syncer is not reached). `posted`: the
    one-off Events posted (the job's runtime notes)."""
    counts = refusal_counts(syncer, islands)
    if syncer is None or counts is None:
        return seen
    for note in new_refusals(seen, counts):
        metrics.REFUSED_CONTRIBUTIONS.labels(reason=note.reason).inc(note.new)
        post_event(body, "Warning", REFUSED, note.message())
    uid = body["metadata"].get("uid", "")
    dropped = syncer.dropped_for_refusals() & set(islands)
    for island in islands:
        key = f"{uid}/{DROPPED_BY_SYNCER}/{island}"
        if island not in dropped:
            posted.pop(key, None)  # re-added: a later drop is news again
        elif key not in posted:
            posted[key] = dropped_message(island)
            post_event(body, "Warning", DROPPED_BY_SYNCER, posted[key])
    kinds = {p.kind for p in syncer.health().problems}
    for kind, (reason, message) in PROBLEM_EVENTS.items():
        key = f"{uid}/{reason}"
        if kind not in kinds:
            posted.pop(key, None)  # cleared: a later report is news again
        elif key not in posted:
            posted[key] = message
            post_event(body, "Warning", reason, message)
    return counts
