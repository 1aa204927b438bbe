"""Crossed rounds: rounds that wait for each other's islands (issues 46/47, drain48).

A blocking learner (K = M) pushes a fragment, trains τ steps, then waits for that push's merge
before it trains on to its next sync point. So every island pushes its fragments' rounds in one
order, and as long as all islands agree on it each round is completed by islands that have
nothing of theirs pending: the earliest round in that order never waits on another round.

They can disagree: an island left out of one fragment's rounds (refused_runs.py) and let back in
comes back with its own schedule (its H_i and phase moved while it was out; bench.hetero's CPU
island at 1,1,1,cpu: fragment 0 pushed before fragment 1 where the others pushed fragment 1
first). Then fragment 0's round holds the CPU island's push and waits for the fast islands',
while fragment 1's holds the fast islands' and waits for the CPU island's, and each island waits
for the merge of the round it pushed to. Nothing merges until a learner's wait budget runs out
(3 x the recent push-to-merge time, so each such wait makes the next one longer: 4 s, 14 s,
then 38 s and about 110 s without a merge in quorum17's run).

The rule: the rounds are *crossed* when there is a set S of open rounds, each holding some push
and lacking some island it spans, in which every island a round of S lacks has a push pending
in a round of S. (S is the largest such set: start from every open, incomplete round and drop
each one that lacks an island with nothing pending in the rounds left, until none drops.) If
the islands pushed in one order, the round earliest in it lacks only islands with nothing
pending (they push in that order too), so it drops, then the next, and S is empty: S is
non-empty only when their orders disagree. Of S, the round holding the most pushes (the lowest
fragment on a tie) is merged without the islands it lacks, as a round of K - n: their work is
not lost (their next push to it carries it, one version behind), and the merge lets those
waiting for it push on, which undoes the crossing (their order and the others' agree again).

With blocking learners (RoundPolicy.learners_block) only at K = M with every island of the
job joined (a quorum of K < M ends such a round without the islands it lacks). Learners that do
not block (K < M, τ > 0) push on past an unmerged push, so a pending push alone makes no
island wait, but a learner whose fragment holds the most steps one push may carry stops at the
step cap (learner/fragment_sync.py: it pushes nothing more, not even the other fragments, until
that fragment's merge arrives; its heartbeats say `holding`). Two such islands cross (CI's
tests/e2e/test_drain.py at K = 2 of 3, the third never up: island-0 held at the cap with its push
alone in fragment 0's round, island-1 with its push alone in fragment 1's, each round one push
under a quorum of 2, nothing merged until the third island's start-up timeout, 600 s). So there
the rule reads the same with two changes: a round is incomplete while it holds fewer pushes than
the quorum (SyncState.effective_quorum: a round at quorum merges as any), and only the islands
held at the step cap count as waiting in S (`held`). An island a round lacks that is not held
(or holds nothing pending in S) will push it, as a third active island does: S drops the round
and nothing fires until that push has come and the round is still short.

Either way only once S has held for the grace window plus a round (H_i + 1 steps) of the slowest
island the chosen round lacks (SyncState.merge_due; crossed_wait says why): a heartbeat's
`holding` may be a step stale, and a round lets an island that was about to push do so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set


def crossed_rounds(
    pending: Sequence[Set[str]],
    spanned: Set[str],
    *,
    quorum: int | None = None,
    held: Set[str] | None = None,
) -> frozenset[int]:
    """The fragments of the largest set of crossed rounds (module docstring): `pending[f]` the
    islands with a push in fragment f's open round, `spanned` the islands every round waits
    for (active, not left out, drained or untargeted). Empty when no round is crossed.

    Learners that do not block: `quorum`, the pushes that complete a round (one with as many
    is no part of it), and `held`, the islands that push nothing until a merge (at the step
    cap); None (blocking learners): every spanned island completes a round, and every island
    with a push pending waits for its merge."""
    crossed = {
        f
        for f, p in enumerate(pending)
        if p and spanned - p and (quorum is None or len(p) < quorum)
    }
    while crossed:
        holders = set().union(*(pending[f] for f in crossed))
        if held is not None:
            holders &= held
        keep = {f for f in crossed if spanned - pending[f] <= holders}
        if keep == crossed:
            break
        crossed = keep
    return frozenset(crossed)


def round_to_close(crossed: Set[int], pending: Sequence[Set[str]]) -> int | None:
    """Of crossed rounds, the one merged without the islands it lacks: the most pushes, the
    lowest fragment on a tie (None when none is crossed)."""
    if not crossed:
        return None
    return min(crossed, key=lambda f: (-len(pending[f]), f))


def crossed_wait(
    grace: float,
    step_times: Mapping[str, float | None],
    lacking: Set[str],
    rounds: Mapping[str, int] | None = None,
) -> float:
    """How long the chosen round must stay crossed before it merges: the grace window plus
    the longest round of the islands it lacks, (H_i + 1) x its step time (as last reported;
    unknown counts 0; H_i from `rounds`, 0 when not known: one step).

    A round, not a step: a learner that overlaps its pushes (τ > 0) pushes its next fragment
    before it waits for the last one's merge, so two islands a sync point apart (after a syncer
    restart, CI's test_learner_rides_out_a_syncer_restart) hold pushes of different fragments
    for a moment and cross, then each reaches its next sync point of the other fragment within
    a round and the crossing undoes itself. Merged after one step (reenter's first form), such
    a round went without an island that was about to push, and at K = M the drain's lock step
    then ended short: both islands drained and waited a 60 s budget for a finish. A true
    crossing (blocking learners that push nothing more) still merges within a round of the
    slowest lacking island, against the 4-150 s of wait budgets before."""
    waits = [((rounds or {}).get(n, 0) + 1) * (step_times.get(n) or 0.0) for n in lacking]
    return grace + max(waits, default=0.0)
