"""The island's last join of each syncer shard, and whether a restarted syncer run may lack it
(issue 46: a learner restarted after the syncer's last checkpoint came back, after a syncer
restart, as its older join's record, and never joined again). Pure: learner/syncer_link.py
keeps the marks and joins again (docs/algorithm.md, "A count's frame is kept across a syncer
restart")."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class JoinMark:
    """The island's last join of one syncer shard: the run that answered it (JoinInfo.run; a
    later run whose checkpoint holds that join's record) and the fragments' versions then."""

    run: str
    versions: tuple[int, ...]
    # The island's joins in the syncer's record after it (JoinInfo.joins; None: not told).
    joins: int | None = None


def join_unknown(joined: JoinMark, run: str, resumed: list[int], joins: int | None = None) -> bool:
    """Whether syncer run `run`, started at `resumed` (each fragment's version it resumed
    from), whose record of the island counts `joins` joins, lacks the island's last join
    `joined` and must be joined again.

    Told the joins (both answers): iff the record counts fewer than the join left it with.
    The record a run restores is its checkpoint's, which holds the join or an older one, and
    the run counts every join it answers: that tells it also after two restarts whose second
    run resumed from a checkpoint its predecessor wrote past the join's versions, unheard by
    the learner (the versions below say "no" then: the checkpoint was written after a merge
    past the join, which the record still lacks, restored from the checkpoint before it).
    Not told (an older syncer), the versions decide:

    The run resumed from a checkpoint of `resumed`, written at those versions: a join of an
    earlier run at a version below them on some fragment came before a merge the checkpoint
    holds, so the checkpoint holds the join's record too (its count base, the island's merged
    tokens at the join: SavedCount). A join at or past them on every fragment may have come
    after the checkpoint was written, so the run may hold an older join's record, whose count
    base is below what the learner counts from: the learner joins again keeping its count
    (syncer/state/membership.Membership.join's keeps_count), which sets the base to the
    island's merged tokens in the checkpoint, where the learner's count (its processed tokens
    since that join, none of them merged into the checkpoint) starts. Had
    the checkpoint held the join after all (written after it, no merge between), that is the
    base the join set: joining again changes nothing of the frame (docs/algorithm.md, "A
    count's frame is kept across a syncer restart"). Same run, no run named (an older syncer)
    or versions not told: False."""
    if not run or not joined.run or run == joined.run:
        return False
    if joins is not None and joined.joins is not None:
        return joins < joined.joins
    if len(resumed) != len(joined.versions):
        return False
    return all(j >= r for j, r in zip(joined.versions, resumed, strict=True))
