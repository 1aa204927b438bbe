"""Stop targets at K < M (and at K = M with per-island rounds): how many tokens each island
processes before it drains, so that the islands together process stopAfter and every token of
it is merged (learner/drain.py).

At K = M the islands run in lock step and each trains its share, 1/M of the budget, on its own
(drain.share_steps), while every island's round is H (inner.stepsPerIsland fixed, or auto
before any island's H_i moved). Once rounds differ (auto moved one, or an override's innerSteps
pins one: core/island_rounds.split_budget, for the rest of the job) 1/M each would leave the job
short of the budget at the drain: there the syncer sets targets at K = M too, splitting what is
left by each island's tokens per round, H_i x its tokens per step (lock_step_weights). An
island hears of the split in its next answer, up to a heartbeat interval later, and drains at
its share until then: the targets wait until every island still training has heard
(ready_to_split), and one that drained is final, its merged tokens done and no target split to
it (running_islands); a split over all of them at once counted on the drained ones training on,
and the job stalled at the drain (issues 45/47; docs/algorithm.md, "A split in the job's last
seconds").

At K < M they run at their own pace: an equal share would idle the fast
islands behind a straggler, and without a stop the job ends at the first merge that reaches the
budget, the work each island did after its last merged push lost (up to half a round plus τ
steps an island). So the syncer, which hears every island's count of processed tokens in its
heartbeats, splits what is left of the budget among the active islands in proportion to their
pace (measured between reports more than half a heartbeat interval apart: pace_of) once it is
close: when what is left takes the islands less than `horizon` seconds at
their pace (a few heartbeat intervals, so each learner hears its target before it reaches it).
The targets are fixed then (a later change of pace moves nothing), sent in each heartbeat
answer (`stopAt`, in the learner's own count), and a learner drains once its count reaches its
target. Once every active island has drained the job finishes if the merged tokens are the
budget but for that rounding (drained_at_budget); an island dropped after the targets were set
leaves its remainder undone, so the others, drained short of the budget, train on after their
wait (learner/drain.py) until it is reached. One that joins after the targets gets none and
trains on until the finish.

An island whose pace is unknown (no two heartbeats with a growing count: a learner just up, or
one that never reports its tokens) is waited for only `pace_wait_seconds` after its first join
(its learner heartbeats at once and every interval, so a live one has measured its pace by
then; a rejoin does not restart the wait, or an island rejoining every few seconds held it);
past that it is left out of the split (split_among), as a late joiner is: no target, it trains
on until the finish, and its merged tokens count as done. Before, the targets waited for every
running island's pace, so one island that never sent its count (an adversary, or a broken
learner) left every other without a target: none drained, and the job ended at the first merge
that reached the budget, each island's work since its last merged push lost (issue 46). An
island without a target holds neither the split, nor the targeted islands' last rounds, nor
the finish (SyncState.split_to, untargeted): the job ends once the targeted islands have
drained at the budget, or at the first merge that reaches it.

A count is the island's own word, and no island's may move another's target beyond what its own
record and the spec support (issue 46: one heartbeat with a count of 2^50 made what was left
negative, and every other island drained at its current count, 5 steps into the job). An
island whose count grew faster than it could process (CountBound.rate, from the step time its
pushes' credit fills at, plus a capped push: count_refused) is left out of the split at once,
as one without a pace is; within that, its part of what is done is its count less its refused
pushes' tokens (counted by its learner, never merged: Pace.base), held between its merged
tokens and those plus a capped push (done_range: an honest learner holds at most a capped push
of each fragment unmerged); its target, in its learner's count, gives it the refused tokens to
train again, so the job still ends at the budget. An island with a target that never drains
holds the finish only as long as the others' wait budget: they train on after it
(learner/drain.py).

Pure: the service calls `stop_targets` with the islands' records under its lock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from diloco_trainer.api.spec import JobSpec
from diloco_trainer.syncer.state.records import IslandRecord

# Learners heartbeat every min(LEARNER_BEAT_SECONDS, heartbeatTimeoutSeconds / 4) seconds
# (learner/loop.py); targets are set this many such intervals before the budget is reached.
LEARNER_BEAT_SECONDS = 5.0
HORIZON_BEATS = 3
# An island's unknown pace holds the split this many intervals after its join (split_among).
PACE_WAIT_BEATS = 3
# A pace is measured over at least this many intervals (pace_of): a learner reports its first
# steps' times at once (the syncer sizes its round from them), so its first reports come
# milliseconds apart, and a rate over those is noise (seen: targets of 11,136 and 27,200
# tokens for two like islands, set 60 ms after their joins; the first to drain waited in vain).
PACE_SPAN_BEATS = 0.5
# A split that is a whole number of steps but for float rounding stays that number.
ROUNDING = 1e-6


@dataclass(frozen=True)
class CountBound:
    """What an island's heartbeat count may claim, from its own record and the job's spec (the
    service computes it under its lock; count_refused, done_range): no other island's count or
    claim enters it."""

    rate: float  # tokens a second its count may grow at: RATE_ALLOWANCE x its tokens a step
    # over its work-rate step time (intake/guards.WorkRate: the rate its pushes may claim)
    ahead: float  # tokens its count may run ahead of its merged ones: the step cap's steps
    # (core/push_bounds.max_push_steps, 4 x H + τ) x its tokens a step, plus the tokens of
    # its pushes refused since its join (IslandRecord.refused_tokens: not retrained)


@dataclass(frozen=True)
class Pace:
    """An island's processed tokens at a time, and its rate (tokens per second)."""

    base: float  # the merged tokens its learner's count starts from (its last join), less its
    # refused pushes' tokens (IslandRecord.refused_tokens): counted, never merged
    tokens: int  # its learner's count at `at`
    at: float
    rate: float


def budget_tokens(spec: JobSpec) -> int | None:
    """stopAfter.tokens when it is what ends the job (before stopAfter.outerSteps' rounds of
    M x H steps of the spec's island tokens would); None otherwise. An outer-step budget keeps
    no targets at K < M: its rounds are the outer optimizer's folds of partial merges, which
    targets rounded to whole steps could leave a fraction short of the last one."""
    stop = spec.stop_after
    if stop.tokens is None:
        return None
    rounds = outer_steps_tokens(spec)
    if rounds is not None and rounds <= stop.tokens:
        return None
    return stop.tokens


def outer_steps_tokens(spec: JobSpec) -> int | None:
    """stopAfter.outerSteps in tokens: that many rounds of M x H steps of the spec's island
    tokens (None without it). What the islands train at K = M, each on its share of
    outerSteps x H steps (learner/drain.share_steps)."""
    stop = spec.stop_after
    if stop.outer_steps is None:
        return None
    islands = max(spec.islands.count, spec.total_shards())
    step_tokens = spec.inner.tokens_per_step * spec.islands.replicas
    return stop.outer_steps * islands * spec.inner.steps * step_tokens


def beat_seconds(heartbeat_timeout: float) -> float:
    """A learner's heartbeat interval (learner/loop.py)."""
    return min(LEARNER_BEAT_SECONDS, heartbeat_timeout / 4)


def horizon_seconds(heartbeat_timeout: float) -> float:
    """How long before the budget is reached the targets are set."""
    return HORIZON_BEATS * beat_seconds(heartbeat_timeout)


def pace_wait_seconds(heartbeat_timeout: float) -> float:
    """How long after its first join an island's unknown pace holds the split: PACE_WAIT_BEATS of
    its learner's heartbeat intervals (two reports PACE_SPAN_BEATS apart measure a pace; the
    rest is room for a slow first step)."""
    return PACE_WAIT_BEATS * beat_seconds(heartbeat_timeout)


def pace_span_seconds(heartbeat_timeout: float) -> float:
    """The least time between the reports a pace is measured from (PACE_SPAN_BEATS)."""
    return PACE_SPAN_BEATS * beat_seconds(heartbeat_timeout)


def pace_of(rec: IslandRecord, min_span: float = 0.0) -> Pace | None:
    """The island's pace from its first and latest reports since it joined; None before two
    more than `min_span` seconds apart (pace_span_seconds)."""
    if rec.first_report is None or rec.reported_tokens is None or rec.reported_at is None:
        return None
    first_tokens, first_at = rec.first_report
    if rec.reported_at - first_at <= min_span or rec.reported_tokens <= first_tokens:
        return None
    rate = (rec.reported_tokens - first_tokens) / (rec.reported_at - first_at)
    # Its refused pushes' tokens are in its count but will never merge: out of its part (what
    # it has done towards the budget), so its target (part - base + share) gives it them to
    # train again; counted in, the job ended short by them and every island waited in vain
    # (adv17: a push refused as too stale after a syncer restart, tests/e2e/test_drain.py).
    base = rec.count_base - rec.refused_tokens
    return Pace(base, rec.reported_tokens, rec.reported_at, rate)


def count_refused(rec: IslandRecord, pace: Pace, bound: CountBound) -> str | None:
    """Why the island's count is outside what it could have processed (None: within it): it
    grew since its first report (since its join) by more than `bound.rate` over the time between
    plus `bound.ahead` (a burst of a capped round's steps: reports come between steps, and a
    learner's first steps run before its step time is known). Such an island is left out of
    the split (split_among), as one whose pace is unknown past the wait: its count would move
    the others' targets (one count of 2^50 drained every island 5 steps into the job)."""
    if rec.first_report is None:
        return None
    first_tokens, first_at = rec.first_report
    grown = pace.tokens - first_tokens
    most = bound.rate * max(0.0, pace.at - first_at) + bound.ahead
    if grown <= most * (1 + ROUNDING):
        return None
    return (
        f"its heartbeat count (tokens) grew by {grown} in {pace.at - first_at:.3g}s, more than "
        f"it could process ({most:.0f}: {bound.rate:.4g} tokens/s + {bound.ahead:.0f})"
    )


def done_range(rec: IslandRecord, bound: CountBound) -> tuple[float, float]:
    """The least and most of the budget the island's record says it has processed: its merged
    tokens, and those plus what its learner may hold unmerged, `bound.ahead` less its refused
    pushes' tokens (the step cap: the refused ones are out of its part already, Pace.base).
    stop_targets counts its count within these."""
    most = rec.merged_tokens + max(0.0, bound.ahead - rec.refused_tokens)
    return rec.merged_tokens, most


def split_among(
    running: Iterable[IslandRecord],
    *,
    now: float,
    wait: float,
    min_span: float = 0.0,
    bounds: dict[str, CountBound] | None = None,
) -> list[IslandRecord] | None:
    """The islands still training that the budget is split among: those whose pace is known
    (pace_of); None while one without a pace first joined less than `wait` seconds ago (its
    learner's first heartbeats measure it: the split waits for it). One without a pace `wait`
    seconds after its first join (`pace_since`; none known: waited out) is left out: no island's
    silence
    holds the others' targets (see the module docstring). `min_span`: pace_of's. `bounds`
    (each island's CountBound): one whose count grew beyond its bound is left out at once
    (count_refused), not waited for."""
    split = []
    for rec in running:
        pace = pace_of(rec, min_span)
        if pace is not None:
            bound = None if bounds is None else bounds.get(rec.name)
            if bound is None or count_refused(rec, pace, bound) is None:
                split.append(rec)
        elif rec.pace_since is not None and now - rec.pace_since < wait:
            return None
    return split


def stop_targets(
    paces: dict[str, Pace],
    *,
    done_elsewhere: float,
    budget: int,
    step_tokens: dict[str, int],
    now: float,
    horizon: float,
    weights: dict[str, float] | None = None,
    done_ranges: dict[str, tuple[float, float]] | None = None,
) -> dict[str, int] | None:
    """Each island's target in its learner's count, or None while the islands are more than
    `horizon` seconds from the budget at their pace.

    `paces`: the active islands'; `done_elsewhere`: tokens merged from islands not among them
    (dropped, left). Each island is projected to `now` at its rate; what is left of the budget
    is split in proportion to the rates and each target rounded down to a whole step of that
    island (`step_tokens`): together they stay within the budget, so no merge reaches it before
    every island's last push is in (the job then ends once all have drained). An island already
    past the budget's split gets its projected count: it drains at once.

    `weights` (K = M, lock_step_weights): split what is left in these proportions instead of
    the rates; when is still judged by the rates.

    `done_ranges` (done_range: from each island's own record): an island's part of what is done
    is its count (base + projected) held within its range, so that no island's self-reported
    count moves another's target by more than its record supports (a count of 2^50 would make
    `left` negative, and every other island's target its current count).
    """
    rate = sum(p.rate for p in paces.values())
    if not paces or rate <= 0:
        return None
    projected = {n: p.tokens + p.rate * max(0.0, now - p.at) for n, p in paces.items()}
    parts = {n: p.base + projected[n] for n, p in paces.items()}
    if done_ranges is not None:
        for n, (least, most) in done_ranges.items():
            if n in parts:
                parts[n] = min(max(parts[n], least), most)
    done = done_elsewhere + sum(parts.values())
    left = budget - done
    if left > horizon * rate:
        return None
    shares = {n: p.rate for n, p in paces.items()} if weights is None else weights
    total = sum(shares[n] for n in paces)
    if total <= 0:
        return None
    targets = {}
    for n, p in paces.items():
        # From its part as counted in `done` (its count held within its range), so that the
        # targets and what is done add up to the budget: a count projected low (a pace measured
        # since the join's slow start) raised to the island's merged tokens in `done` but not
        # here left the targets short of the budget by the difference, and the islands drained
        # short of it and trained on (tests/e2e/test_island_rounds.py, K = M).
        count = parts[n] - p.base + max(0.0, left) * shares[n] / total
        step = max(1, step_tokens[n])
        targets[n] = step * math.floor(count / step + ROUNDING)
    return targets


def lock_step_weights(round_steps: dict[str, int], step_tokens: dict[str, int]) -> dict[str, float]:
    """K = M with rounds of different lengths (inner.stepsPerIsland): each island's tokens per
    round, H_i x its tokens per step. Every merge there needs every island, so the islands run
    the same number of rounds, and what is left of the budget takes each island
    left x H_i·b_i / Σ_j H_j·b_j tokens: all of them reach their targets in the same round.
    (A split by measured pace is the same in expectation, but noisy; 1/M each assumed rounds of
    H and left a job whose slow islands run shorter rounds short of the budget at the drain.)"""
    return {n: float(max(1, round_steps[n]) * max(1, step_tokens[n])) for n in round_steps}


def running_islands(active: Iterable[IslandRecord]) -> list[IslandRecord]:
    """The active islands still training: those that have not said they drained. A drained
    island's part is done and merged (learner/drain.py): its tokens count as final
    (merged_elsewhere), and a target split to it would never be trained."""
    return [r for r in active if not r.drained]


def ready_to_split(running: Iterable[IslandRecord], heard: set[str]) -> bool:
    """K = M: whether every island still training has heard that the budget is split (`heard`:
    the islands whose answers said so). One that has not drains on its share of 1/M
    (learner/drain.py) however the split would set its target: 300 steps where a split by H_i
    gave it 306 left the job short at the drain by more than drained_at_budget's slack, and
    every island waited for a finish that never came (issues 45/47). Those that drained before
    hearing it are final; the rest, once all have heard, share what is left."""
    return all(r.name in heard for r in running)


def merged_elsewhere(records: Iterable[IslandRecord], active: set[str]) -> float:
    """Tokens merged from islands outside `active` (dropped, left, or drained: their work
    counts towards the budget as it is)."""
    return sum(r.merged_tokens for r in records if r.name not in active)


def drained_at_budget(
    spec: JobSpec, tokens: int, active: Iterable[IslandRecord], *, shares_kept: bool = False
) -> bool:
    """Whether `tokens` merged are stopAfter but for the drain's rounding: short of it by at
    most a step of each active island (shares and targets are rounded down to whole steps).
    Every active island having drained ends the job only then: short by more, work was lost (a
    syncer restarted from an older checkpoint, an island dropped with its share undone) and the
    learners, drained, train on after their wait (learner/drain.py) until stopAfter is reached.

    stopAfter.tokens, or (`shares_kept`: K = M, every round H) stopAfter.outerSteps in tokens,
    the fewer. The islands drain there on outerSteps x H steps each, and the outer steps can
    fall short of outerSteps once they are in: a syncer restart from an older checkpoint lost a
    merged round, the islands trained it again, and its made-up merge of 1.6 rounds folded once
    (core/outer.split_fraction: a complete merge is one fold) while the drain's partial pushes
    stayed open; fragment 0 stood at 11 of 12 folds with 18,880 tokens merged of 15,360, and
    both islands waited out their budget for a finish (tests/e2e/test_learner_restart.py).
    The service passes `shares_kept` for one syncer only (Syncer.stop_reached)."""
    budgets = [] if spec.stop_after.tokens is None else [spec.stop_after.tokens]
    rounds = outer_steps_tokens(spec) if shares_kept else None
    if rounds is not None:
        budgets.append(rounds)
    if not budgets:
        return False
    slack = sum(spec.inner.tokens_per_step * max(1, r.replicas) for r in active)
    return min(budgets) - tokens <= slack


def stop_reached(spec: JobSpec, *, outer_step: int, tokens: int) -> bool:
    """Whether the job's stopAfter is reached at `outer_step` with `tokens` merged."""
    stop = spec.stop_after
    if stop.outer_steps is not None and outer_step >= stop.outer_steps:
        return True
    return stop.tokens is not None and tokens >= stop.tokens
