"""Phase alignment: moving a learner's schedule into phase with its peers'.

Identical islands should push a fragment at the same moment, so that one merge carries all of
their work (at K < M a lone push opens a merge of its own, and at K = 1 two islands a fraction of
a second apart never meet again: every merge is one island's). Start-up skew is never absorbed by
itself, because each island times its pushes by its own step count. So a learner that learns of
a merge of a fragment it was not part of, between the version it last received and its push,
made by a *leader* (an island at about its own speed whose name sorts before its own), moves its
schedule onto the leader's:

  x = (its push time − that merge's time), wrapped into [−R/2, R/2) with R = H · step time
  (the wall time per step, everything between steps included),
  (x > 0: it pushed after the leader; x < 0: it is early for the leader's next merge),
  shift = −x in steps (PHASE_GAIN), at most H/4 per round (positive: delay, negative: advance).

Why a leader, and not both islands moving halfway towards each other: each sees the other's
lone merge, and two islands half a round apart each find the other "late" by R/2, minus the
merge's own latency: both advance, and they stay half a round apart for ever (seen in a smoke
run). With an order, the first island (by name) keeps its clock and every other one converges
on it; when it leaves, the next one in the order is the leader. Islands much slower or faster
than this one (a straggler) are never in phase with it and are ignored (PEER_SPEED_RATIO). The
shift moves the schedule position a learner reports and pushes by, not its learning rate, and
is taken one position per inner step (see schedule_positions).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from diloco_trainer.api.documents import FragmentMerges, MergeRecord

# Merges by islands whose step time is within this factor of ours count for phase alignment.
PEER_SPEED_RATIO = 1.5
# Share of the measured offset a learner corrects per round. The whole of it: the leader does not
# move, so a reading's noise is not compounded. Half (tried) averages noise but converged too
# slowly for short jobs: in tests/e2e/test_quorum_quality.py (12 rounds) quorum 1 ended 4-8%
# behind quorum 3 with half against 2-4% with the whole.
PHASE_GAIN = 1.0


def _is_leader(
    step_times: Mapping[str, float], name: str, *, island: str, step_time: float
) -> bool:
    """Whether `name` leads `island`: named before it, with a step time within
    PEER_SPEED_RATIO of its own (FragmentMerges.step_times)."""
    other = step_times.get(name)
    if not other or name >= island:
        return False
    return 1 / PEER_SPEED_RATIO <= float(other) / step_time <= PEER_SPEED_RATIO


def _own_merges(doc: FragmentMerges) -> list[MergeRecord]:
    return [m for m in doc.merges if m.fragment == doc.fragment]


def merge_lateness(
    doc: FragmentMerges,
    *,
    island: str,
    base_version: int,
    accepted_version: int,
    pushed_ago: float,
    step_time: float,
) -> float | None:
    """Seconds by which this island's push of the fragment came after the latest merge of it by
    a leader (an island at about its speed, named before it) that it was not part of, among
    versions base_version+1 .. accepted_version; None when there is none.

    `doc` is the fragment's recent merges (GET /v1/fragments/{f}/merges), read `pushed_ago`
    seconds after the push was accepted (so the push happened at doc.time − pushed_ago on the
    syncer's clock).
    """
    if accepted_version <= base_version or step_time <= 0:
        return None
    pushed_at = doc.time - pushed_ago

    def leaders(m: MergeRecord) -> list[str]:
        names = [c.island for c in m.contributors]
        if island in names:
            return []
        return [
            n for n in names if _is_leader(doc.step_times, n, island=island, step_time=step_time)
        ]

    merges = [
        m for m in _own_merges(doc) if base_version < m.version <= accepted_version and leaders(m)
    ]
    if not merges:
        return None
    # Follow the first island of all, not whichever leader merged last: a leader that is itself
    # still moving into phase is no fixed point (every follower chased every move in a run).
    first = min(n for m in merges for n in leaders(m))
    latest = max((m for m in merges if first in leaders(m)), key=lambda m: m.version)
    return pushed_at - latest.time


def lateness_within(
    doc: FragmentMerges, *, version: int, island: str, step_time: float
) -> float | None:
    """Seconds by which this island's push reached the syncer after the first leader's (see
    merge_lateness) in their merge `version` of the fragment (receivedAt, the syncer's clock;
    negative: before it); None when that merge is not in `doc` or lacks either time.

    For learners that do not block, whose merge is `version` = the base of their next push. A
    grace window long enough to hold the whole round never makes an island miss a merge, so
    merge_lateness never fires: an island that started late stayed late for good and the
    islands ahead of it applied each merge most of a round after their push (examples/local.yaml
    at quorum 2: 1.05x quorum 3's loss). The reading is of the previous push: the learner skips
    readings of pushes made before its last shift, which would correct the same offset twice.
    """
    if step_time <= 0:
        return None
    for m in _own_merges(doc):
        if m.version != version:
            continue
        times = {c.island: c.received_at for c in m.contributors if c.received_at is not None}
        leaders = sorted(
            n for n in times if _is_leader(doc.step_times, n, island=island, step_time=step_time)
        )
        if island not in times or not leaders:
            return None
        return times[island] - times[leaders[0]]
    return None


# A reading within a merge (lateness_within) moves the schedule only when it is at least this
# share of a round. Those readings are of pushes that met in one merge, so their noise is all
# there is once islands are in phase: on two shared cores they jitter by 1-6 steps a round at
# H = 30 (0.02-0.17 s at 0.027 s a step), and correcting each one made identical islands chase
# each other (advance 6, delay 1, delay 2, advance 4, ...), their work per push 24-33 steps, and
# K = 1 ended 1.5-4% behind K = M (bench/log/2026-11-24.md, "decoupled_quality — 2026-11-24 09:48").
# An offset under an eighth of a round costs the islands ahead at most that many steps of staleness
# on the merge they apply; the offset the rule exists for (a start-up lag of 10-18 steps of 50 in
# examples/local.yaml) is well above it. Readings of a missed merge (merge_lateness) have no dead
# band: missing one is news.
WITHIN_DEADBAND = 1 / 8


def phase_shift(
    lateness: float, *, inner_steps: int, step_time: float, within: bool = False
) -> int:
    """Steps to move this island's schedule by, given `lateness` (see merge_lateness, or
    lateness_within when `within`): positive delays its next pushes, negative brings them
    forward; 0 when under half a step, or for a reading within a merge under WITHIN_DEADBAND of
    a round."""
    if inner_steps < 1 or step_time <= 0 or not math.isfinite(lateness):
        return 0
    period = inner_steps * step_time
    x = (lateness + period / 2) % period - period / 2  # into [−R/2, R/2)
    if within and abs(x) < WITHIN_DEADBAND * period:
        return 0
    steps = round(-PHASE_GAIN * x / step_time)
    limit = inner_steps // 4
    return max(-limit, min(limit, steps))


def schedule_positions(position: int, pending: int) -> tuple[list[int], int]:
    """The schedule positions one inner step passes through, and the shift still pending.

    Normally one (position + 1). While a delay is pending (pending > 0) a step passes through
    none: the island trains without moving its schedule. While an advance is pending
    (pending < 0) a step passes through two, so the pushes due at both happen one step early.
    """
    if pending > 0:
        return [], pending - 1
    if pending < 0:
        return [position + 1, position + 2], pending + 1
    return [position + 1], 0
