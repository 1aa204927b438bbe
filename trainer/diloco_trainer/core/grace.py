"""The auto grace window (sync.graceSeconds "auto"), from timings that exclude the window itself.

Decoupled DiLoCo waits, after a round's quorum, at most γ·slack for more islands, with
slack = τ·t_step − (t_quorum + t_sync): the window lives inside the τ steps a learner computes
while its push is in flight, so waiting costs no learner a step. τ is how many steps a push may be
in flight before its island would lose a step (`in_flight_steps`): the overlap for learners that
block for their merge, but H for those that do not (K < M with overlap): they train on and apply
the merge at the first step it is there, and only the fragment's next push, H steps later, needs
it. With τ = overlap there (5 steps of 47 ms in bench/decoupled_quality) the window was about one
step, while identical islands time-sharing two cores pushed 0.3-0.8 s apart: every merge at K = 1
was one or two islands', never the round (1.07x K=M's loss). What goes in:

- t_step: the learners' median inner-step time (they report it); with per-island rounds
  (inner.stepsPerIsland) τ·t_step is taken island by island, τ_i·t_i, and its median used
  (in_flight_seconds): at K < M τ_i = H_i, so a slow island's short round counts as the wall
  time it takes, not as H of the median step time. A round's own window spans no more than
  the islands already in it can train on before they hold for its merge (round_in_flight:
  H_i − 1 of their own t_i at K < M): the median's span outlasted a slow island's short round;
- t_quorum: the syncer's own measure, from a round's first push to its quorum;
- t_sync: the NET sync time, transfers plus the merge, never the wait: the learners' reported
  sync time (push sent to merged fragment received) minus what the syncer held that push
  (received to published, which holds the quorum wait and the previous window). Feeding the
  gross time back made the window shrink itself: a longer window gave longer sync times, a
  smaller slack and a shorter window, round after round.

FLOOR: never less than one learner step, so islands in lock step that push a fraction of a step
apart all make the round even when τ = 0 leaves no slack (the cost is at most one step a round);
CAP: never more than the heartbeat timeout, when a silent island is given up on anyway. Before
any step time is known the window is `default` seconds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

GAMMA = 0.5  # share of the slack when learners block for their merge
GAMMA_DECOUPLED = 1.0  # ... and when they do not (K < M with overlap): see share_of_slack


def blocks_for_merge(*, quorum: int, islands: int, overlap: int) -> bool:
    """Whether a learner blocks (up to its wait budget) at a fragment's apply step until the
    merge of its push arrives, or only checks for it every step and trains on meanwhile.

    A synchronous job (K = M: every merge needs every island) or one without overlap (τ = 0,
    plain DiLoCo) blocks, so rounds stay in lock step. A decoupled job (K < M, τ > 0) never
    does: its merge may need another island's push, and waiting for one cost the fast islands
    a fifth of their time beside a 3x straggler at K = 2 of 4 (bench/decoupled_quality). The
    merge is applied, keeping the steps taken since the push, at the first step it is there.
    Shared by the learner (whether to wait) and the syncer (how long a grace window is free).
    """
    return overlap == 0 or quorum >= islands


MERGE_WAITS = ("overlap", "nextPush")  # sync.mergeWait


def merge_wait_steps(*, merge_wait: str, overlap: int, inner_steps: int) -> int:
    """Steps after a push at which a blocking learner (blocks_for_merge) waits for its merge.

    "overlap" (the default): τ, the overlap. "nextPush": the last step before the fragment is due
    again, max(τ, H − 1), so its next push still carries the merge of this one (K = M stays in
    lock step) while a late merge costs max(0, L − (H − 1)·t) a round instead of max(0, L − τ·t).
    Between τ and that step the learner only checks for the merge (applied at the first step it
    is there, the steps since the push kept), so a merge that is on time is applied τ steps after
    the push under both rules; a late one lands with up to H − 1 local steps kept on top of it.
    """
    if merge_wait not in MERGE_WAITS:
        raise ValueError(
            f"sync.mergeWait must be one of {', '.join(MERGE_WAITS)}, got {merge_wait!r}"
        )
    if overlap < 0 or inner_steps < 0:
        raise ValueError(f"overlap and inner steps must be >= 0, got {overlap} and {inner_steps}")
    if merge_wait == "overlap":
        return overlap
    return max(overlap, inner_steps - 1)


def in_flight_steps(*, learners_block: bool, overlap_steps: int, inner_steps: int) -> int:
    """Steps a push may be in flight before its island loses a step: τ = overlap_steps when the
    learners block for their merge; H = inner_steps when they do not (the merge is needed only by
    the fragment's next push, H steps later). Without a schedule (inner_steps 0): the overlap."""
    if learners_block or inner_steps < 1:
        return overlap_steps
    return max(overlap_steps, inner_steps)


def in_flight_seconds(
    *, learners_block: bool, overlap_steps: int, rounds: Sequence[tuple[int, float]]
) -> float | None:
    """τ·t_step in seconds with each island's own round (inner.stepsPerIsland): the median over
    the islands of in_flight_steps(H_i) x t_i, for `rounds` of (H_i, t_i) with t_i > 0; None
    with none.

    With every H_i = H it is τ x the median step time, as before. With per-island rounds a
    decoupled job's slow island is in flight for its own H_i steps of its own t_i (about
    H x t_ref, the same wall time as the others' rounds): τ = H times the median step time
    would overstate it for a job whose islands are mostly slow, by t_median / t_ref."""
    spans = sorted(
        in_flight_steps(learners_block=learners_block, overlap_steps=overlap_steps, inner_steps=h)
        * t
        for h, t in rounds
        if t > 0 and math.isfinite(t)
    )
    if not spans:
        return None
    middle = len(spans) // 2
    return spans[middle] if len(spans) % 2 else (spans[middle - 1] + spans[middle]) / 2


def round_in_flight(
    job: float | None,
    pending: Sequence[tuple[int, float]],
    *,
    learners_block: bool,
    overlap_steps: int,
) -> float | None:
    """τ·t_step in seconds for one round's window: the job's (`job`, in_flight_seconds), but no
    longer than the shortest span of the islands already in the round (`pending`: their
    (H_i, t_i), t_i > 0), each counted to the step where its learner stops training on without
    the merge: H_i − 1 steps of its own t_i where learners do not block (at least one step:
    learner/step_plan.late_merge_bound, where the learner holds for a late merge), τ where they
    do, or without a schedule (H_i 0: in_flight_steps). `job` with none known.

    Why: the window lives inside the steps a pushing island trains while its push is in flight,
    so that it costs no island a step; the job's span is the median island's. With per-island
    rounds a slow island's own span is shorter: a 4x island at H_i = 4 beside fast islands at
    H = 20 has 3 of its 0.8 s steps before it holds, against the fast islands' 4 s round, so a
    round it opened waited up to the window for the fast islands' pushes and its merges came back
    3.2 s after its push: it held at its bound on 36 pushes, 17% of its time, and its merged
    tokens fell 16.5% under its compute share (bench.hetero --pace-step-ms 200, 1,1,2,4 at K = 1,
    bench/log/2026-12-03.md, "Paced steps (issues 47 and 45)"). Identical islands' spans
    differ by their step-time noise and one step (H − 1 against H): a window about 5% shorter.

    >>> round_in_flight(4.0, [(4, 0.8)], learners_block=False, overlap_steps=5)  # 3 x 0.8 s
    2.4000000000000004
    >>> round_in_flight(4.0, [(20, 0.2), (20, 0.21)], learners_block=False, overlap_steps=5)
    3.8000000000000003
    >>> round_in_flight(4.0, [], learners_block=False, overlap_steps=5)
    4.0
    >>> round_in_flight(None, [(0, 0.5)], learners_block=False, overlap_steps=5)  # no schedule
    2.5
    """
    spans = [
        (overlap_steps if learners_block or h < 1 else max(1, h - 1)) * t
        for h, t in pending
        if t > 0 and math.isfinite(t)
    ]
    if not spans:
        return job
    return min(spans) if job is None else min(job, *spans)


def share_of_slack(*, learners_block: bool) -> float:
    """γ, the share of the slack the auto window may use: ½ when learners block for their merge,
    all of it when they do not.

    The two mistakes cost differently. Where learners block (K = M, or no overlap), a window
    longer than the slack idles every island, so half is kept as a margin for noisy timings.
    Where they do not (K < M with overlap), a window past the slack costs no step: at worst the
    first island to push finds its merge not back at the fragment's next push, skips that push
    and sends two rounds' work with the one after. A window too short splits a round of
    identical islands across merges, for good: on two shared cores islands pushed 0.3-0.5 s apart
    while ½ of the slack was 0.27 s, and K = 2 and K = 1 merged two or three islands' work for
    rounds on end (1.023x and 1.015x K = M's loss over 3 seeds; with a 0.6 s window, every merge
    was a whole round and both were within 1%; bench/log/2026-11-24.md, "decoupled_quality —
    2026-11-24 08:38"). The window still closes early when every island expected before it has
    pushed (expected_push_time).
    """
    return GAMMA if learners_block else GAMMA_DECOUPLED


def net_sync_time(reported: float, held: float) -> float:
    """A learner's sync time without the time the syncer held its push: max(0, reported − held)."""
    return max(0.0, reported - held)


def grace_window(
    *,
    step_time: float | None,
    overlap_steps: int,
    quorum_wait: float,
    sync_net: float,
    cap: float,
    default: float,
    gamma: float = GAMMA,
    in_flight: float | None = None,
) -> float:
    """min(cap, max(step_time, γ·max(0, τ·t_step − (t_quorum + t_sync_net)))); see the module
    docstring. `default` (capped) when no step time is known. `in_flight`, when given, is
    τ·t_step in seconds measured per island (in_flight_seconds) and stands in for
    overlap_steps x step_time."""
    for name, value in (("quorum_wait", quorum_wait), ("sync_net", sync_net), ("cap", cap)):
        if not (math.isfinite(value) and value >= 0.0):
            raise ValueError(f"{name} must be finite and >= 0, got {value}")
    if overlap_steps < 0:
        raise ValueError(f"overlap steps must be >= 0, got {overlap_steps}")
    if not step_time or step_time <= 0.0:
        return min(default, cap)
    span = overlap_steps * step_time if in_flight is None else in_flight
    slack = span - (quorum_wait + sync_net)
    return min(cap, max(step_time, gamma * max(slack, 0.0)))


def expected_push_time(
    *,
    inner_steps: int,
    offsets: Sequence[int],
    fragment: int,
    reported_step: int,
    reported_at: float,
    step_time: float,
    pushed_since_report: bool,
    now: float,
) -> float | None:
    """When an island should push `fragment` (clock time, never before `now`): its latest
    progress report (step `reported_step` at `reported_at`) plus the steps to the fragment's next
    sync point at `step_time` each; None without a schedule (inner_steps 0 or no offset).

    Fragment f is pushed after the step s with s % H == offset % H (fragments.fragments_due); at
    the sync point itself, a push that came after the report means the next one is H steps away.
    An overdue island counts as arriving now.
    """
    if inner_steps < 1 or fragment >= len(offsets):
        return None
    steps = (offsets[fragment] - reported_step) % inner_steps
    if steps == 0 and pushed_since_report:
        steps = inner_steps
    return max(now, reported_at + steps * step_time)


# How many typical uploads a merge waits for a push whose body is on its way (upload_wait_until).
UPLOAD_FACTOR = 2.0


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def typical_upload(per_island: Mapping[str, Sequence[float]]) -> float | None:
    """The typical upload seconds the merge's wait for pushes on their way is sized from: each
    island's median of its recent accepted bodies' seconds, then the LOWER median over the
    islands that have one (the smaller of two; of four the second smallest). None when no
    island has a usable figure (NaN and negatives are not).

    Why per island, and the lower median: one island whose accepted bodies trickle in (legal up
    to sync.bodyTimeoutSeconds) would otherwise fill the shared window and lift every other
    island's wait towards the cap, holding each round of a fragment that long (audit of
    2026-12-01, docs/adversaries.md: a merge came 15.07 s after its push, against 0.11 s). Over
    islands, one island's figure is the largest at worst, so it cannot move the lower median of
    two or more (at M = 2 the smaller is the honest island's or lower); an honest island on a
    slower link than the rest is then waited for about the others' upload, and its push, if
    later, merges in the next round as before the wait existed."""
    medians = []
    for seconds in per_island.values():
        usable = [s for s in seconds if math.isfinite(s) and s >= 0.0]
        if usable:
            medians.append(_median(usable))
    if not medians:
        return None
    return sorted(medians)[(len(medians) - 1) // 2]


def upload_wait_until(*, started: float, typical: float | None, grace: float, cap: float) -> float:
    """Until when a merge whose quorum is met waits for a push of the same fragment whose body
    began to arrive at `started` (an island's authenticated request, its declared size within
    the fragment's limit: syncer/state/uploads.py): started + min(cap, max(grace,
    UPLOAD_FACTOR x `typical`)), `typical` being the typical upload (typical_upload; None, none
    known: the grace window alone).

    Why: at K < M over a link slower than the islands' traffic, the auto grace window falls to
    one step (its slack, τ·t_step − t_sync, is gone), while pushes that left their islands
    together reach the syncer one upload apart through the link they share. The first merges
    alone; each later push of that sync point makes a version of its own, so every pull carries
    a chain of them and the link, already the bottleneck, carries more (docs/algorithm.md,
    "A merge waits for the pushes on the way"). A push on the way since `started` arrives
    about one upload later; twice that leaves a margin for the link's swings and for the
    others' bodies sharing it, and a push stalled longer (a stuck or slow-loris sender) holds
    the merge no longer than that: the wait is a hint, never a condition of the merge.
    `cap`: the longest any merge waits (the heartbeat timeout, as the grace window's)."""
    for name, value in (("grace", grace), ("cap", cap)):
        if not (math.isfinite(value) and value >= 0.0):
            raise ValueError(f"{name} must be finite and >= 0, got {value}")
    usual = typical if typical is not None and math.isfinite(typical) and typical >= 0 else 0.0
    return started + min(cap, max(grace, UPLOAD_FACTOR * usual))
