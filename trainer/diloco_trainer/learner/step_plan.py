"""The learner's pure step plan: which fragments are pushed, skipped, waited for or applied
after each inner step, how long to wait for a merged fragment, and where a joining learner's
schedule starts. How many steps a push overlaps (τ, fitted with sync.overlapMode auto) is
overlap.py's; how an island moves its schedule into phase with its peers' is
phase_alignment.py's.

Schedule (steps counted from 1, see `plan_step`):
- Fragment f is *due* at inner step t when `fragments_due(t, H, offsets)` lists it. Then rank 0
  computes Δ_f = θ_global_f − θ_local_f in fp32 on the CPU, encodes it with the job's codec and
  pushes it in the background, with the base version and the tokens, steps, mean loss and step time
  counted since it last *received* fragment f (so nothing is counted twice).
- Training goes on for τ = sync.overlapSteps steps. After step t+τ the merged fragment is applied,
  keeping the τ steps taken since the push: θ_f ← θ_global_f + (θ_f,now − θ_f,push) (mixing.py says
  why); θ_global_f becomes the new base and the fragment's counters keep only the steps since the
  push (they are in the next Δ). With sync.applyFrom "arrival" it is applied after the first
  step from t+1 at which it has arrived (`poll_from_steps`), keeping only the steps it took to
  come back; τ is then only where a blocking learner starts to wait.
- Steps are counted in schedule positions, which move one per inner step except while the island
  shifts its phase towards its peers' (phase_alignment.py).
- A fragment that is due while its previous push is still unapplied is skipped (its counters keep
  running), so a pseudo-gradient is never sent twice on the same base.
- No fragment is pushed at a schedule position below H (plan_step says why): positions below H
  are a fresh job's first round, where fragment f > 0 then first syncs at H + f·H/F with
  1 + f/F rounds in its push. A learner that joins a running job starts at H or later
  (schedule_start), so it meets the merges the others push to.

Waiting policy: in a decoupled job (K < M, τ > 0) rank 0 never waits: it checks every step whether
the merge of its push has arrived and applies it then (`blocks_for_merge`). Otherwise, at step t+τ
rank 0 waits for the version the syncer named when it accepted the push (the background task
long-polls the syncer for it), but at most `wait_budget(...)` seconds: the larger of the
syncer's heartbeat timeout (after which a dead island no longer holds a quorum back) and three
times the recently measured push-to-merge time. If nothing arrived by then the learner keeps
training and applies the fragment after the first later step at which it has arrived (a
non-blocking check every step). So a learner never deadlocks on a syncer that is down or a quorum
that cannot form; it just trains locally until the syncer answers. A slow island at K = M (its
round H_i below H) whose merge has not come may instead take a fill step (`fills_drift`, then
`fills_wait`): a step that moves no position, so that the idle end of its round counts in its
next pushes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from diloco_trainer.core.fragments import fragments_due
from diloco_trainer.core.grace import blocks_for_merge

__all__ = ["blocks_for_merge"]  # the learner's rule, kept in core so the syncer shares it

APPLY_FROMS = ("overlap", "arrival")  # sync.applyFrom
# An in-flight fragment's (first poll, wait deadline) in steps after its push (plan_step).
Window = tuple[int, int]


def poll_from_steps(*, apply_from: str, overlap: int) -> int:
    """Steps after its push from which an arrived merge of a fragment is applied (sync.applyFrom).

    "overlap" (the default): τ, so every merge keeps τ local steps on top of it, however early it
    came back. "arrival": the step after the push (min(1, τ): with τ = 0 the push step itself
    waits), so a merge back in L < τ steps keeps L steps, not τ. Why: at K = M on gpt-mini the τ = 5
    kept steps cost 1.0-1.6% of the loss against τ = 1 (bench/log/2026-11-26.md, "gpt-mini against
    torchft in real processes") (figure not found in the log), while the merges came back in a step
    or two; τ stays the most a learner trains on before it waits, so a slow syncer's latency is
    hidden as before.
    """
    if apply_from not in APPLY_FROMS:
        raise ValueError(
            f"sync.applyFrom must be one of {', '.join(APPLY_FROMS)}, got {apply_from!r}"
        )
    if overlap < 0:
        raise ValueError(f"sync.overlapSteps must be >= 0, got {overlap}")
    return overlap if apply_from == "overlap" else min(1, overlap)


# How many times the recent push-to-merge time a learner waits before it trains on without the
# merged fragment.
ROUND_TIME_FACTOR = 3.0


@dataclass(frozen=True)
class StepPlan:
    """What a learner does with its fragments after inner step `step`.

    push: due now and idle: compute Δ and push it.
    skip: due now, but the previous push of the fragment is not applied yet: keep accumulating.
    wait: the merged fragment is needed now: wait (bounded) for it, then apply it.
    poll: overdue (an earlier bounded wait ran out): apply it only if it has already arrived.
    """

    push: tuple[int, ...] = ()
    skip: tuple[int, ...] = ()
    wait: tuple[int, ...] = ()
    poll: tuple[int, ...] = ()


def starts_fresh(versions: Sequence[int]) -> bool:
    """Whether a learner joining with these fragment versions starts with the job (nothing merged
    yet), so that its first round is every island's first round (see plan_step)."""
    return all(v == 0 for v in versions)


def plan_step(
    step: int,
    *,
    inner_steps: int,
    offsets: Sequence[int],
    overlap: int,
    pushed_at: Mapping[int, int],
    abandoned: frozenset[int] = frozenset(),
    deadline: int | None = None,
    poll_from: int | None = None,
    windows: Mapping[int, Window] | None = None,
    skip_once: frozenset[int] = frozenset(),
) -> StepPlan:
    """Decide what happens to each fragment after inner step `step` (counted from 1).

    `pushed_at` maps each fragment with a push in flight (pushed, merged result not applied yet) to
    the step it was pushed at. A fragment pushed at step s is applied after step s + overlap; with
    overlap 0 that is the very step it is pushed at, so it appears in both `push` and `wait`.

    `abandoned` are in-flight fragments whose merged result is overdue by more than the wait
    budget (e.g. the syncer restarted and lost the pending push): when one is due again it is
    pushed afresh (same base, counters since the last receipt; the syncer replaces an island's
    pending push) instead of skipped, so a lost push cannot stall the fragment for good.

    `deadline` (core/grace.merge_wait_steps; the overlap when None) is how many steps after its
    push a fragment is waited for: from `overlap` steps after the push until then it is only
    polled (applied if it has arrived), so sync.mergeWait "nextPush" waits for a late merge
    just before the fragment is due again instead of τ steps after the push.

    `poll_from` (poll_from_steps; the overlap when None) is how many steps after its push a
    fragment is first polled: sync.applyFrom "arrival" polls from the step after the push, so a
    merge that came back early is applied then, before the wait at `deadline`.

    `windows` gives an in-flight fragment its own (poll_from, deadline), those of the τ it was
    pushed with (sync.overlapMode auto fits τ between pushes); a fragment pushed now, or one
    not in it, has `poll_from` and `deadline`.

    `skip_once`: due fragments not pushed now, their push made already (one made up after a
    syncer restart stands for the next sync point: fragment_sync._make_up).

    A fragment due at a step below H is skipped: those steps are a fresh job's first round
    (schedule_start starts every later join at H or later), so every island skips alike and each
    fragment's first push holds its stagger plus a whole round (1 + f/F rounds). Pushed at its
    first sync point, fragment f > 0 took an outer step on f/F of a round of a fresh model, and
    that early step was all that 2 streamed fragments cost at K = M in bench/studies/ablation
    (issue 23; docs/algorithm.md has the figures).
    """
    if step < 1:
        raise ValueError(f"inner steps are counted from 1, got {step}")
    if overlap < 0:
        raise ValueError(f"sync.overlapSteps must be >= 0, got {overlap}")
    deadline = overlap if deadline is None else deadline
    if deadline < overlap:
        raise ValueError(f"a merge's wait deadline ({deadline}) precedes the overlap ({overlap})")
    poll_from = overlap if poll_from is None else poll_from
    if not 0 <= poll_from <= overlap:
        raise ValueError(f"a merge's first poll ({poll_from}) is not within 0..{overlap}")
    for first, last in (windows or {}).values():
        if not 0 <= first <= last:
            raise ValueError(f"a merge's first poll ({first}) is not within 0..{last}")
    due = fragments_due(step, inner_steps, offsets)
    early = step < inner_steps  # a fresh job's first round: no push yet
    held = {f for f in pushed_at if f not in abandoned} | skip_once
    push = tuple(f for f in due if not early and f not in held)
    skip = tuple(f for f in due if f not in push)
    apply_at = dict(pushed_at)
    apply_at.update({f: step for f in push})
    window = {f: (poll_from, deadline) for f in apply_at}
    window.update({f: w for f, w in (windows or {}).items() if f in pushed_at and f not in push})
    wait = tuple(sorted(f for f, s in apply_at.items() if s + window[f][1] == step))
    poll = tuple(
        sorted(
            f for f, s in apply_at.items() if s + window[f][0] <= step and s + window[f][1] != step
        )
    )
    return StepPlan(push=push, skip=skip, wait=wait, poll=poll)


def plan_idle(
    position: int,
    *,
    overlap: int,
    pushed_at: Mapping[int, int],
    poll_from: int | None = None,
    windows: Mapping[int, Window] | None = None,
) -> StepPlan:
    """The plan for an inner step that does not move the schedule (a phase delay): nothing is
    due; fragments from their first poll on (`poll_from` steps after the push, as in plan_step;
    the overlap when None; an in-flight fragment's own from `windows`) are applied if they have
    arrived (no waiting)."""
    start = overlap if poll_from is None else poll_from
    first = {f: (windows or {}).get(f, (start, start))[0] for f in pushed_at}
    return StepPlan(poll=tuple(sorted(f for f, s in pushed_at.items() if s + first[f] <= position)))


def wait_budget(round_times: Sequence[float], heartbeat_timeout: float) -> float:
    """Seconds to block for a merged fragment before training on without it.

    At least the heartbeat timeout (a dead island stops counting towards the quorum after that, so
    a reachable quorum merges within it) and at least ROUND_TIME_FACTOR times the slowest recent
    push-to-merge time (a legitimately slow quorum, e.g. K = M with a straggler).
    """
    if heartbeat_timeout <= 0:
        raise ValueError(f"sync.heartbeatTimeoutSeconds must be > 0, got {heartbeat_timeout}")
    recent = max((t for t in round_times if math.isfinite(t) and t >= 0), default=0.0)
    return max(heartbeat_timeout, ROUND_TIME_FACTOR * recent)


def link_bound(
    latencies: Sequence[float], *, fragments: int, inner_steps: int, step_time: float
) -> bool:
    """Whether a learner's own syncs say its link cannot carry its traffic: a round's F syncs
    (one per fragment), each taking the mean of its recent sync latencies, take longer than
    the round's H_i inner steps of `step_time` wall seconds (F · mean(ℓ) > H_i · t).

    `latencies` are the learner's recent net sync latencies (SyncResult.latency: the push's
    transfer, the syncer's merge, the pull and rebuild, never a wait for peers' pushes, so a
    slow peer or the grace window reads as no link); `step_time` its wall seconds per inner
    step with no hold in them (a hold is not training; the measure is the same held or not).
    Why F · ℓ: the islands push a fragment at the same sync point through the link they share,
    so one fragment's sync carries about 1/F of a round's traffic of every island and its
    latency is about L · round / F (L: the round's traffic over the link's rate, over the
    round's compute time); F · ℓ > round is L > 100%, where the merges fall behind by more
    each round unless the learner slows to the link. The mean, not the slowest: one slow sync
    (a first merge, a burst of load) is not a link slower than its traffic. Nothing measured
    (no latency, no step time): False.
    """
    if fragments < 1 or inner_steps < 1:
        raise ValueError(f"fragments ({fragments}) and inner steps ({inner_steps}) must be >= 1")
    seen = [t for t in latencies if math.isfinite(t) and t >= 0]
    if not seen or not math.isfinite(step_time) or step_time <= 0:
        return False
    return fragments * sum(seen) / len(seen) > inner_steps * step_time


def late_merge_bound(inner_steps: int, window: Window, *, link_bound: bool) -> int:
    """B: the most steps a learner that does not block for its merge (K < M) trains past a push
    before it holds for that push's merge (holds_for_late_merge). Where its link cannot carry
    its traffic (`link_bound`, the rule above): ceil(H_i / 2). Elsewhere: H_i − 1, the last
    step before the fragment is due again (sync.mergeWait nextPush's point), so the next push
    of the fragment always carries its merge and no push is skipped for it. Never before the
    push's wait deadline (its τ; window = (first poll, deadline) in steps after the push), so
    a merge is never held for before the overlap it was pushed with; never below 1.

    Why: the steps trained between a push and the install of its merge are kept on top of the
    merge (sync.lateMergeRule keep) and go into the next push, trained from the weights before
    it (FragmentState.kept_steps, k = kept / H_i). On a link slower than its traffic k reached
    0.9-1.5 rounds at K = 1 and the loss 1.25-1.59x its L = 0; at k <= 0.3 no loss
    (bench/log/2026-11-30.md, kone14, kept15); ceil(H_i / 2) there brought it to 1.003-1.043x
    (kept16), H_i − 1 only to 1.050-1.075x. Where the link carries the traffic a merge is back
    within about L / F of a round (k below 1/2 at F = 2, below 1 at F = 1) and a hold at H_i / 2
    only idled the accelerator on the merges late by load (kept16: 0.341 and 0.799 at a pinned
    50%); at H_i − 1 it holds only where the push would otherwise be skipped (hold17).
    """
    if inner_steps < 1:
        raise ValueError(f"inner steps must be >= 1, got {inner_steps}")
    bound = math.ceil(inner_steps / 2) if link_bound else inner_steps - 1
    return max(bound, 1, window[1])


LATE_MERGE_HOLDS = ("auto", "off")  # sync.lateMergeHold


def holds_for_late_merge(
    *,
    blocking: bool,
    steps_since_push: int,
    bound: int,
    given_up: bool = False,
    mode: str = "auto",
    stop_targets: bool = False,
) -> bool:
    """Whether a learner holds its inner steps, after the step it just took, until the merge of
    a push in flight is installed: one that does not block for its merge (blocks_for_merge
    false: K < M), whose push is `steps_since_push` inner steps old (every step it trained,
    a fill or phase-delay step too, counted from the push: those are the steps its receipt
    keeps), at `bound` (late_merge_bound) or more, and that has not already held the push's
    wait budget out (`given_up`: a syncer down or a quorum that cannot form; it trains on, as
    without the rule, until that push's merge arrives or it is pushed again). A blocking learner
    (K = M, τ = 0) waits at its deadline already (plan_step), never later than B.
    `mode` is sync.lateMergeHold: "off" never holds.
    Nor once the syncer has sent stop targets (`stop_targets`: the budget is near, K < M): the
    islands drain then, and a drained island pushes nothing more while its own last merge may
    wait for this learner's next push, so a hold for a merge that needs the drained island's
    push would wait out the budget (CI: test_drain's K = 2 of 3, 4 s, 5 steps trained past the
    drain and never merged); the steps kept so near the end are at most a round's.
    """
    if mode not in LATE_MERGE_HOLDS:
        raise ValueError(
            f"sync.lateMergeHold must be one of {', '.join(LATE_MERGE_HOLDS)}, got {mode!r}"
        )
    if steps_since_push < 0 or bound < 1:
        raise ValueError(f"steps since a push ({steps_since_push}) < 0 or bound ({bound}) < 1")
    return (
        mode == "auto"
        and not blocking
        and not given_up
        and not stop_targets
        and steps_since_push >= bound
    )


def schedule_start(versions: Sequence[int], inner_steps: int, offsets: Sequence[int]) -> int:
    """The inner step count a joining learner starts from, so that its first push is of the
    fragment the syncer merges next (and its own schedule is in phase with the others').

    Within a round fragments are due in the order of their positions (offset, or H for offset 0),
    so the fragment merged next is the first in that order with the lowest version. The learner
    starts right after the preceding position, giving it a full slot of training before that
    push. Why it matters: with a quorum of every island and F > 1, an island out of phase would
    wait for fragment f while another waits for fragment g from it, each blocking the other until
    the wait budget runs out.

    A join into a running job (some fragment merged: not `starts_fresh`) starts a round later in
    the same phase, at H or later, so plan_step's first-round rule (no push below step H) is a
    fresh job's alone: a joiner must push at the sync points the running islands push at. A
    fresh job starts at 0; so, with F = 1 or everything at version v, does the phase.
    """
    if len(versions) != len(offsets):
        raise ValueError(f"{len(versions)} versions for {len(offsets)} fragments")
    positions = [off % inner_steps or inner_steps for off in offsets]
    order = sorted(range(len(offsets)), key=lambda f: (positions[f], f))
    lowest = min(versions)
    nxt = next(f for f in order if versions[f] == lowest)
    start = max([0, *(p for p in positions if p < positions[nxt])])
    return start if starts_fresh(versions) else start + inner_steps


def adopt_round(position: int, current: int, offered: int | None) -> int | None:
    """The schedule position from which a learner whose rounds are `current` inner steps goes on
    with rounds of `offered` (its H_i from the syncer, inner.stepsPerIsland), or None: not now.

    At a round boundary (a position at which fragment 0 is due, `current` or later) and to the
    same round count k in the new length: position k·H becomes k·H_i, so every fragment's next
    sync point stays at its place in the round (offset f·H_i/F after it) and no position falls
    below H_i again (plan_step's first-round rule). The pushes in flight move by the same
    number of positions (their apply windows are relative). In a fresh job's first round
    (position below `current`, nothing pushed yet) at once: in place while the position is
    still below H_i, so a slow island's first round is short too (at K = M every other island
    waits for it); at or past H_i, back to H_i - 1, so that the next step is H_i, fragment 0's
    first sync point, and every other fragment's follows it in its place (left in place there,
    fragment 1's sync point, H_i·(1 + 1/F) and on, could come before fragment 0's first, the
    islands' fragments out of phase, and at K = M each island then waits for a fragment the
    other pushes only after its own wait: bench/hetero, 1,1,2,4, waits of 12-15 s, a wait
    budget each). Its first push then carries the steps it ran, a few more than H_i.

    Why not wait for the round's end there (issue 47): a slow island's probe completes at step
    3 and the syncer's answer reaches its learner a step or two later, so a cut to H_i of 3-5
    (a 4-6x slower island; H = 20, the floor 3) came past H_i and the island ran its whole
    first round at H, 20 steps at 4x, which every island waited for at K = M
    (bench/log/2026-11-29.md, "hetero — 2026-11-29 14:30 UTC": cut to 3 at its step 2, taken
    at its step 20).
    """
    if offered is None or offered < 1 or offered == current:
        return None
    if position < current:
        return min(position, offered - 1)
    if position % current:
        return None
    return position // current * offered


def rewarm_factor(steps_run: int, *, warmup_steps: int, joined_mid_job: bool) -> float:
    """Multiplier on the inner learning rate after a learner (re)joins a running job.

    A restarted learner has a fresh AdamW (its state died with the process: learners keep no
    checkpoint), exactly like every learner at the job's start, so it gets the same linear
    warm-up (inner.warmupSteps) again on top of the schedule's rate: a fresh Adam's first steps
    are about lr in size in every coordinate. An island that joins at the start (or a job without
    warm-up) is not affected.
    """
    if not joined_mid_job or warmup_steps <= 0 or steps_run >= warmup_steps:
        return 1.0
    return (steps_run + 1) / warmup_steps


# A merge period (merge_period) is the shortest of at most this many intervals between a
# fragment's latest merges.
PERIOD_SAMPLES = 4
# A fill step leaves every push at least this share of a merge period early (fills_wait): twice
# the room a slow island's round is sized with at K = M (core/island_rounds.LOCK_STEP_ROOM).
FILL_ROOM = 0.2


def drift_fill_cap(inner_steps: int, room: float = FILL_ROOM) -> int:
    """The most fill steps a push of an island at H may carry at K = M (fills_drift): room x H,
    rounded down (H = 30: 6, a push of at most 36 steps)."""
    return math.floor(room * inner_steps + 1e-9)


def first_fill_cap(inner_steps: int, drift_cap: int) -> int:
    """The most fill steps a push may carry at K = M while the merge waited for is its
    fragment's first in a fresh job (issue 45, offset45): a round, H (H = 30: a push then
    carries up to a round more than its own, at most 2.5·H with fragment 1 of 2's first push
    of 1.5·H, inside the syncer's bound of 4·H + τ); 0 where fills_drift's cap is 0
    (inner.stepsPerIsland fixed, H < 5).

    That wait is the islands' start-up offset (the last island's first push; bench.studies.
    km_waits: 70-92% of the first merges' waits at L = 0, 0-76% at 50%), seconds where a
    round is one or two, so ⌊0.2·H⌋ fill steps took a part of it and the learner blocked for
    the rest. Filling it costs no merge anything (fills_drift: a fill step is taken only while
    the merge is not back, so the learner resumes at most a step after it) and lines the islands
    up as blocking did (no fill step moves a schedule position). Bounded by a round, not open:
    an island whose pods wait for a node holds the others' first merge, and each early island
    then blocks after one round of fill steps, as after ⌊0.2·H⌋ before; the early islands'
    next push carries up to 2·H steps once (a merge's token imbalance up to 2x, against 1.2x
    after)."""
    return inner_steps if drift_cap > 0 else 0


def fills_drift(*, since_push: Sequence[int], cap: int) -> bool:
    """Whether a learner at K = M (any island: at H, or a slow one, which past the cap may still
    fill by fills_wait), at a merge wait whose merge has not come, takes a fill step: while every
    fragment's next push would carry at most `cap` fill steps (`since_push`: the fill steps each
    has taken since its last push; drift_fill_cap), i.e. at most (1 + room) x H steps at H, and
    H_i + room x H for a slow island (the cap counted in H, not H_i: floor(0.2 x H_i) is 0 for
    H_i < 5, a 4x or 5x island at H = 20; and H_i + room x H stays under an island at H's
    capped push, so the token imbalance in a merge is no larger than at identical speeds).

    At identical speeds such a wait is a peer's drift (bench/RESULTS.md "busy_link": a start-up
    offset the first merge closes, then step-time noise and steady speed gaps between processes),
    not slack a slow round left, so there is no period to plan by: the learner steps on while the
    merge is not back. It cannot run away: a fill step is only taken while the merge waited for
    has not come, so it never delays that merge (every push in it is in), and the learner takes
    up its schedule at most one step time after the merge came (the fill step under way then;
    a slow island's step: a 3x island's is 3 of the fast islands' step times, but its round is
    sized to at most 0.9 of theirs and rounded down, so that slack absorbs most of it).
    So each merge of the learner's next pushes comes at most one step time later than if it had
    blocked, whatever happened before: a merge's time is the latest of its pushes, and every
    island's push is at most its own round plus one step after the merge it last waited for.
    The period does not compound (each merge resets it), and no period estimate is read. The cap
    bounds what a peer that is gone or far behind costs (a push of (1 + room) x H steps, then the
    learner blocks as before) and the token imbalance between the islands' pushes of a merge."""
    return cap > 0 and all(n < cap for n in since_push)


def merge_period(arrivals: Sequence[float]) -> float | None:
    """The wall seconds between a fragment's merges, from the times its latest merges arrived
    (in order; time.monotonic()): the shortest of the last PERIOD_SAMPLES intervals, None before
    two arrivals or when they do not increase.

    The shortest, not a median (tried first): a fill step that makes a merge late lengthens the
    interval it ends, and a median of intervals so lengthened let the next fill steps make the
    merges later still (bench/hetero 1,1,2,4 at K = 4, both slow islands filling: the fast
    islands' utilisation 0.843x and 0.921x of equal speeds against 0.996x and 0.999x on main's
    code; bench/log/2026-11-29.md, "hetero (hetero9): fill steps on the median period"). A late
    merge never shortens an interval (the fast islands wait for it, then run a whole round)."""
    recent = list(arrivals)[-(PERIOD_SAMPLES + 1) :]
    gaps = [b - a for a, b in itertools.pairwise(recent) if b > a]
    return min(gaps) if gaps else None


def steps_to_due(position: int, inner_steps: int, offset: int) -> int:
    """How many positions after `position` a fragment of this `offset` is next due (>= 1;
    fragments_due: step % H == offset % H)."""
    if inner_steps < 1:
        raise ValueError(f"inner steps must be >= 1, got {inner_steps}")
    return (offset - position - 1) % inner_steps + 1


@dataclass(frozen=True)
class FillFragment:
    """What fills_wait needs of one fragment: steps until it is next due, when its latest merge
    arrived (time.monotonic()), and whether a push of it is in flight (its merge not applied)."""

    due_in: int
    last_arrival: float
    in_flight: bool


def fills_wait(
    *,
    now: float,
    step_time: float,
    period: float,
    room: float,
    fragments: Sequence[FillFragment],
    waited: FillFragment,
) -> bool:
    """Whether a learner at a merge wait whose merge has not arrived takes a *fill step* (an
    inner step that moves no schedule position; its tokens count in the fragments' next pushes)
    rather than block: a slow island at K = M (inner.stepsPerIsland auto, its round H_i below
    H), whose round ends early by design (core/island_rounds.sized_steps: at most 1 - room of the
    reference round, and rounded down) and idled the rest of every round.

    Merges come every `period` seconds (merge_period). The push of fragment g that comes
    `due_in` positions on feeds the merge expected at: its in-flight merge's expected arrival,
    max(last_arrival + period, now), plus a period; or, with nothing in flight, last_arrival +
    period. A fill step delays every push by one step, so it is taken only when each push, one
    step later, still comes at least room x period before that merge (`room`: FILL_ROOM, twice
    the room of the island's round):

        now + step_time x (1 + due_in_g) <= expected merge_g - room x period, for every g,

    and only while the merge waited for (`waited`, among `fragments`) is not overdue by more
    than room x period (a peer late or gone: the learner blocks, up to its wait budget, as
    before). So at the reference pace a fill step leaves every push twice the room the round
    was sized with: it takes only the slack that rounding the round down left beyond that, and
    the fast islands wait for none on average (their expected wait is the noise beyond the
    room, as before; with the room alone, 0.1, and a median period, two slow islands filling
    were late for 1.9-3.3 s of a run's merges against 0.2-1.0 s without fill steps,
    bench/log/2026-11-29.md, "hetero (hetero9): fill steps on the median period"). The slow
    island steps through what was its idle wait, its merged-token share nearer its compute share
    (issue 47: at K = M a 5x island's 3 of 20 steps, 15 of the fast islands' 20 step times,
    merged 0.76-0.93x its compute share; bench/RESULTS.md "hetero")."""
    if step_time <= 0 or period <= 0 or not (0 <= room < 1):
        return False
    if waited.in_flight and now > waited.last_arrival + period * (1 + room):
        return False
    for g in fragments:
        expected = max(g.last_arrival + period, now) if g.in_flight else g.last_arrival
        merge = expected + period
        if now + step_time * (1 + g.due_in) > merge - room * period + 1e-9:
            return False
    return True
