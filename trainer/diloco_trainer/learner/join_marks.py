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


def join_unknown(joined: JoinMark, run: str, resumed: list[int]) -> bool:
    """Whether syncer run `run`, started at `resumed` (each fragment's version it resumed
    from), lacks the island's last join `joined` and must be joined again.

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
    if not run or not joined.run or run == joined.run or len(resumed) != len(joined.versions):
        return False
    return all(j >= r for j, r in zip(joined.versions, resumed, strict=True))
