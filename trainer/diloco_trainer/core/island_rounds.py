"""Each island's round (its H_i inner steps between pushes of a fragment), sized to its speed.

A job may mix hardware: an island three times slower than the others that takes H steps per
round pushes every third of their rounds, so at K = M everyone waits for it and at K < M its
pushes arrive stale. Here each island's round is sized so that islands push at about the same
wall time (Async Local-SGD, Liu et al. 2024, arXiv 2401.09135: "dynamic local updates", local
steps proportional to a worker's speed; the merge already weighs each push by its tokens):

    T   = H x t_ref                     the round's wall time (H = inner.steps)
    H_i = clamp(floor(T / t_i), floor, ceiling)

rounded down, so that a slow island's round ends no later than the reference's: at K = M the
islands at the reference speed never wait for it (speeds 1,1,1,3 and H = 20: 6 steps of 3 = 18
of the others' 20; rounded to nearest, 7 steps = 21 made every fast island wait a step each round,
5% of its time), and the slow island idles under one of its steps a round instead. At K = M a
change leaves it more room (sized_steps, LOCK_STEP_ROOM): its round at most 90% of the
reference round's time, since every merge waits for the last push and a round that rounding
down left as long as the others' was late half the time under load. What the rounding and the
room leave idle, its learner fills with steps that count in its next push: while the merge it
waits for is out, up to a cap a push (learner/step_plan.fills_drift, a merge then at most one of
its steps late), and past the cap when they delay no push past the room (fills_wait).

t_i is island i's measured step time (its heartbeats' stepTime) and t_ref a robust reference
step time of the job (reference_step_time): the lower median of the islands' step times once
MAJORITY_CLAIMS islands report one. Why not the fastest island's: a step time is the island's
own word, and one island claiming a tiny step time would shrink every other island's H to the
floor (more pushes, less work in each). The lower median lies between two honest claims while
fewer than half the islands lie, so a liar moves only its own H; the lower rather than the
plain median so that with an even count the reference is an island's own time, e.g. speeds
1,1,2,4 give t_ref = 1 and rounds H, H, H/2, H/4 that all take H x 1 s, where the plain median
(1.5) would give the 2x island 0.75 H steps and a round 1.5x the fast islands'. With fewer claims
(a job of one or two islands) there is no majority to lean on, and t_ref is the fastest claim:
an island of two that lies about its speed can then shrink the other's round down to the floor,
no further (README "Security": what M = 2 cannot promise).

The ceiling is H by default (inner.maxSteps): an island at or above the reference speed keeps the
round the user chose, since a longer round changes the optimisation (DiLoCo's loss per token
grows with H); slow islands take fewer steps. The floor (inner.minSteps, default H/8 rounded up)
keeps a very slow island's pushes from carrying a handful of steps each (its Δ is then mostly
noise at a full sync's cost).

Hysteresis (next_round): step times are noisy (warm-up, compiles, a shared machine's load), and an
H that follows every reading makes islands' phases and the merges' work fractions jump. A new
H_i is taken only when CONFIRMATIONS readings in a row lie beyond the band (in_band) in the same
direction, and at most once per COOLDOWN_READINGS readings (at K = M not for a move down:
eager_down). The band is one of step times, not
of steps: a target is within it while the island's step time is within CHANGE_FRACTION of the
time its current round assumes, i.e. target >= H_i / (1 + CHANGE_FRACTION) less the one step
that target_steps' rounding down may take, and target <= H_i x (1 + CHANGE_FRACTION) (and one
step either way is always within it). So an island at H whose readings are up to 40% above the
reference's keeps H, whatever H is: identical islands on a loaded 2-core machine read ±30% apart
(issue 47: a band of 20% of the steps, i.e. 25% of step time less the rounding, shrank equal
islands' rounds on noise and left tests/e2e/test_convergence.py 5% short of its token
baseline). The price: an island up to 1.4x slower keeps H, and at K = M the others wait for it
(up to 29% of their time); the mixes the benchmark measures (1,1,1,3 and 1,1,2,4) are far
beyond the band (one reading per reference round, so the new H has run a few rounds
before it can change again).
A longer round also needs the reading to have outgrown the one that set the current round
(IslandRound.anchor, outgrown): below the ceiling at K = M a round moves down on any reading that
says it is late (late_is_beyond) and, at a few steps, back up on one only 1.15x faster, and under
load a 3x island's H_i went 20, 6, 4, 3, 5, 3 within 30 s (bench/hetero, load 12).
A regular reading is judged with the island's last RECENT_READINGS regular readings
(judged_ratio): at K = M a longer round needs the slowest of them to allow it, at K < M a round
follows their lower median (hetero18: a CPU island's load-driven step time, read one reading at
a time, moved its H_i 9-13 times a run).
An island that slows down for good mid-job (a preempted node replaced by an older one) so gets
its smaller round at its second slow reading at K = M (at K < M its fourth: three of five).
No single reading moves a round, an island's first included (issue 47: with
inner.stepsPerIsland auto, tests/e2e/test_fsdp_island.py's identical FSDP bf16 islands of a job
of two were cut under load, island-1 to 2 of 10 on its probe at step 2 and island-0 to 5 on its
first regular reading at step 10).

A slow island's first round is still short: a mixed job's slow islands start at H, and at K = M
every fast island waits for each of their long rounds until they change
(bench/log/2026-11-29.md, "hetero — 2026-11-29 02:13": 16% of the fast islands' time with two
readings and a round boundary to wait for; "03:59": 2.2 s of their 3.3 s of waits, the first
reading a reference round after the first heartbeat). So a learner reports no step time until it
has PROBE_STEPS steps clear of its warm-up, and then their mean, but at most 1.4 times the
fastest (probe_step_time: each step a reading, so a probe that cuts has every step beyond the
band), at once rather than at its next heartbeat (StepTimeReport; then the mean of the steps
after it, the probe left out). The syncer reads a fresh island's probe at once when every active
island has reported one (first_reading_now: before that the reference could be the slow island's
own time) and takes it, as two readings, only when its target at least halves the round
(probe_moves) and at least MAJORITY_CLAIMS islands report; else, with that many reporting, as
one reading, which its learner's second probe (the next PROBE_STEPS steps, reported and read
at once: StepTimeReport, IslandRound.confirm_at) confirms or clears (probe_readings: under load
a 3x island's probe read under 2x, or came before a late peer's, and the regular readings,
heartbeats a second apart, came after its first round's end). In a job of two the reference
is the other island's own probe and nothing brackets it, so there a probe is no reading at all.
A fresh island's first reports (its probes) are judged only against peers' step times aged past
its join (aged_past_join, RoundSizes._aged): a peer that had a step time when it joined counts
once it has stepped AGE_STEPS steps since (its report, the mean of its steps since its probe or
an EMA of weight 0.1, then mostly of the load since the join), or while idle (its reports since
the join at one step: it waits for a merge at K = M and loads no core); a peer that had none
counts at once. The reading is held back while a peer is not aged, a reference round after the
join at most, then made against the aged ones alone. Why (issue 47): on a shared host the
islands that start first have the cores to themselves, and a late island's first steps, beside
them and the later ones' start-ups, read ~2x their probes: identical islands were cut
(tests/e2e/test_identical_rounds.py; 4 of 10 at K = 4 under load 12, 12-13 of 30 in
bench/busy_link). Idle peers count so that a slow island that joins last at K = M, whose peers
wait for its first push, is still cut in its first round (counting only peers whose readings
began after the join ran it at H: bench/log/2026-11-29.md, "hetero — 2026-11-29 15:44 UTC").
The price: a first cut comes a peer's heartbeat or two later (heartbeats are
min(5 s, heartbeatTimeoutSeconds / 4) apart), and an idle peer's step time is as old as its
last steps (a late island contended by others' start-ups can still read slow against it).
At K = M a report that reads JOIN_LOAD_RATIO (4x) or more against every claim is read at once
all the same (clear_of_join_load): beyond any join's load seen, and a slow island's late first
cut made every fast island wait for its long rounds.
A probe's cut starts no cooldown and leaves a reading in its direction pending (next_round):
two steps may under-read a slow island, and its first regular reading may cut it further
alone. It is checked at once against the mean of the CHECK_STEPS steps past the second probe
(check_restores, IslandRound.check_at): one that reads the island within the band of the round
cut sends it back there (check_round), whatever the probe read, and one beyond the cut round's
band the other way and outgrown of the probe's reading sends it to its own target, since the
regular readings come at heartbeats, 5 s apart by default, and an identical island cut on two
start-up probes kept 14 of 30 for an 8 s job (and one cut on 1.5x probes, checked at 1.2x, not
outgrown, kept 17 of 30 to its step 204: bench/busy_link, busy12's main runs); the round cut
is kept while the cut round stands, and a later reading within its band counts for going
back too (restores_cut: a check can still read the start-up). Its learner,
still within its first round, adopts the new H_i at once (learner/step_plan.adopt_round: in
place below it, else its next step ends the round), so a 3x slower island's first round is
about H/3 steps too, not H.
At K = M a move to a shorter round needs no cooldown and starts none, and a round's first move
by a reading (its second probe's, or its regular readings') leaves one reading pending as a
probe's does (eager_down): under the join's load both probes can read a 3x island under 2x, and
it was cut late and shallow, then deeper a cooldown at a time, every merge waiting for it.

`inner.stepsPerIsland: fixed` turns all this off (every island H), and
`islands.overrides[i].innerSteps` pins an island's H_i.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from diloco_trainer.api.spec import JobSpec

# The lower median counts as the reference once this many islands report a step time (a
# majority of honest claims then brackets it); with fewer, the fastest claim.
MAJORITY_CLAIMS = 3
# A reading moves H_i only when the island's step time is beyond this share of what its current
# H_i assumes (in_band) ...
CHANGE_FRACTION = 0.4
# ... in this many readings in a row, in the same direction ...
CONFIRMATIONS = 2
# ... and at least this many readings after H_i last changed.
COOLDOWN_READINGS = 3
# A learner's first steps are warm-up (allocations, caches, the first batches): its reported step
# time leaves out this many ...
WARMUP_STEPS = 1
# ... and its first report (the probe) is read from the next this many steps, each a reading of
# its own (probe_step_time). Two: a probe that cuts a round needs both slow, the second step
# confirming the first (issue 47: one noisy early reading cut identical FSDP islands under load),
# and a 4x slower island's round at H = 20 is 5 steps, so its H_i must arrive (report, heartbeat
# answer) before its position reaches it for the first round to be cut in place: the probe
# completes at step 3, as the plain mean of steps 2-3 it replaced did.
PROBE_STEPS = 2
# At K = M every merge waits for the last island's push: a change sizes a slow island's round to
# end at least this share of the reference round early (sized_steps), room for the noise of its
# round's wall time against the others'.
LOCK_STEP_ROOM = 0.1
# The reported step time's EMA weight of each step after the probe (as the learner's own EMA).
REPORT_EMA = 0.1
# The probe's reading moves a fresh island's round only to at most this share of it (the island
# at least 1 / PROBE_MOVE_SHARE times slower than the reference, every probe step beyond the
# band: probe_step_time): two
# steps on a shared machine are noisy, and an identical island shrunk on noise runs short rounds
# until the hysteresis brings it back; a nearer target waits for the regular readings.
PROBE_MOVE_SHARE = 0.5
# A probe's cut is checked once its learner has stepped this many more steps past its second
# probe: their plain mean, reported at once (StepTimeReport), read at once by the syncer
# (IslandRound.check_at), and when it reads the island within the band of the round cut, or
# beyond the cut round's band the other way and outgrown of the probe's reading, the round goes
# back at once (check_restores, next_round's `confirmed`). Ten steps clear of the start-up
# against the probe's two (issue 47, probe11: an identical island whose probe and second probe
# both ran beside its peers' start-up read 2.0x, was cut to 14 of 30, and at heartbeats 5 s
# apart got one regular reading in an 8 s job).
CHECK_STEPS = 10
# A fresh island's first reports are judged only against peers' step times that reflect the load
# since it joined (aged_past_join): a peer's report counts once it has taken this many steps
# since the join (its reported step time is the mean of its steps since its probe, an EMA of
# weight REPORT_EMA from the tenth: after 1 / REPORT_EMA steps, 65% of it is theirs) ...
AGE_STEPS = 10
# ... but at K = M a fresh island whose report reads at least this many times the reference of
# every claim, aged or not, is read at once (clear_of_join_load): beyond what a join's load
# made identical islands read.
JOIN_LOAD_RATIO = 4.0
# A regular reading is judged with the island's last this many regular readings (judged_ratio):
# at K = M a longer round needs the slowest of them to ask for it, at K < M a round follows
# their median (odd: a reading's own value).
RECENT_READINGS = 5


def reference_step_time(step_times: Sequence[float]) -> float | None:
    """The job's reference step time t_ref: the lower median of the positive, finite claims
    once MAJORITY_CLAIMS islands report one; with fewer, the smallest; None with none."""
    known = sorted(t for t in step_times if t > 0 and math.isfinite(t))
    if not known:
        return None
    if len(known) < MAJORITY_CLAIMS:
        return known[0]
    return statistics.median_low(known)


def aged_past_join(*, mark: int | None, step: int | None, idle: bool) -> bool:
    """Whether a peer's reported step time may judge a fresh island's first reports: it reflects
    the load since the island joined. `mark`: the peer's reported step when the island joined
    (None: it had reported no step time then, so all it reports came after); `step`: its
    reported step now; `idle`: its reports since the join show it not stepping (it waits for a
    merge at K = M, and loads no core).

    Why (issue 47): on a shared host the islands that start first have the cores to
    themselves, and the ones that start late run their first steps beside the early ones and
    the later ones' start-ups. Against the early islands' probes a late island's read ~2x
    (tests/e2e/test_identical_rounds.py: island-1's probe read 1.96x and its second probe 1.83x
    the reference, an identical island cut to 4 of 10; bench/busy_link: equal islands cut to
    12-13 of 30). A peer still stepping counts after AGE_STEPS steps since the join; an idle
    one at once (a slow island that joins last at K = M finds its peers waiting for it: they
    load nothing, and its first round is the one to cut)."""
    if mark is None:
        return True
    if step is None:
        return False
    return idle or step - mark >= AGE_STEPS


def clear_of_join_load(*, ratio: float, room: float) -> bool:
    """Whether a fresh island's report, read `ratio` (t_i / t_ref) against every claim, aged past
    its join or not, is read at once at K = M (`room` > 0) rather than wait for its peers to age
    (aged_past_join): at least JOIN_LOAD_RATIO.

    Why (issue 47): waiting cost a slow island that joined last at K = M its first cut; in
    bench/hetero ("hetero — 2026-11-29 18:16 UTC") a 3x island that joined 0.4-0.9 s after its
    peers waited for a peer to age, was cut first at its step 13 (to 8 of 20), then 5, 4, 3 by
    step 54, and the fast islands waited for those rounds: 0.00-1.72 s of K = M merge waits a
    run, mean 0.79 s, against 0.08 s before the aged reference. The join's load made identical
    islands read at most 2.5x (tests/e2e/test_identical_rounds.py: 2.0x the lower median, 2.5x
    the fastest; bench/busy_link cut equal islands to 12-13 of 30, about 2.4x): 4x is 1.6x
    beyond the worst of those, so an identical island still waits, and a slow island's deep
    cut, if the early peers' probes flattered them, costs it only idle time that its learner
    fills at K = M (learner/step_plan.fills_drift, fills_wait). At K < M no one waits for a late
    push, and the rule is as before."""
    return room > 0 and ratio >= JOIN_LOAD_RATIO - 1e-9


def probe_step_time(times: Sequence[float]) -> float | None:
    """A learner's first reported step time from its first steps' `times` (seconds, in order):
    the mean of the PROBE_STEPS steps after WARMUP_STEPS, but at most 1 + CHANGE_FRACTION times
    the fastest of them; None until there are that many.

    Each probe step is a reading. A probe cuts a round when it is at least twice the reference
    (probe_moves), so with the cap only when the steps' mean is (the size: the fastest step
    alone under-read bench/hetero's 3x island as under 2x under load, and it waited for two
    regular readings at H) *and* every step is beyond the band, at least 2 / 1.4 = 1.43 times
    the reference: one noisy step beside a normal one never cuts an island (issue 47:
    tests/e2e/test_fsdp_island.py's identical FSDP islands under load, island-1's mean of steps
    2-3 over 5x the other's)."""
    if len(times) < WARMUP_STEPS + PROBE_STEPS:
        return None
    probe = times[WARMUP_STEPS : WARMUP_STEPS + PROBE_STEPS]
    return min(sum(probe) / len(probe), (1 + CHANGE_FRACTION) * min(probe))


@dataclass
class StepTimeReport:
    """The step time a learner reports in its heartbeats: None through its probe, then
    probe_step_time, then the mean of the steps after the probe, an EMA (REPORT_EMA) once it has
    1 / REPORT_EMA of them (report_weight). The learner's own step-time EMA (overlap, waits)
    still counts every step; this one leaves the warm-up out, since the syncer reads a fresh
    island's first report at once (first_reading_now), and the probe out of what follows it,
    so the syncer's next readings are readings of their own: an EMA seeded from a probe slowed
    by warm-up kept 0.9^10 = 35% of it ten steps on, enough for two readings in a row beyond
    the band (test_island_rounds.py)."""

    value: float | None = None
    first: list[float] | None = None  # the steps so far, until the probe is complete
    after: int = 0  # steps since the probe
    running: float = 0.0  # their mean, then EMA
    second: list[float] | None = None  # the steps after the probe, until the second probe
    check: list[float] | None = None  # the CHECK_STEPS steps after the second probe

    def add(self, seconds: float) -> bool:
        """One step's seconds; True when this step completes the probe or the second probe
        (report it now).

        The second probe: the PROBE_STEPS steps after the probe, capped as the probe is
        (probe_step_time), reported at once; the syncer reads it at once when the probe was one
        reading pending (probe_readings, RoundSizes.read), as the second of the two a change
        needs. Afterwards the report is the running mean again (the cap only in that report),
        but for the check: the plain mean of the CHECK_STEPS steps after the second probe,
        reported at once too, a probe's cut read against it (IslandRound.check_at)."""
        if self.value is not None:
            self.after += 1
            weight = report_weight(self.after)
            self.running = (1 - weight) * self.running + weight * seconds
            self.value = self.running
            if self.after > PROBE_STEPS + CHECK_STEPS:
                return False
            if self.after > PROBE_STEPS:
                # the check: the plain mean of the CHECK_STEPS steps after the second probe,
                # clear of the start-up, reported at once (a probe's cut is read against it)
                self.check = [*(self.check or []), seconds]
                if self.after < PROBE_STEPS + CHECK_STEPS:
                    return False
                self.value = sum(self.check) / len(self.check)
                self.check = None
                return True
            self.second = [*(self.second or []), seconds]
            if self.after < PROBE_STEPS:
                return False
            self.value = probe_step_time([0.0] * WARMUP_STEPS + self.second)
            self.second = None
            return True
        self.first = [*(self.first or []), seconds]
        self.value = probe_step_time(self.first)
        if self.value is None:
            return False
        self.first = None
        return True


def report_weight(after: int) -> float:
    """The weight of the `after`-th step since the probe in the reported step time: 1 / after
    (a plain mean of those steps, the probe's value replaced by the first) until that is below
    REPORT_EMA, then REPORT_EMA."""
    return max(1.0 / after, REPORT_EMA) if after >= 1 else 1.0


def first_reading_now(*, fresh: bool, reported: int, active: int) -> bool:
    """Whether the syncer reads an island's first report at once rather than a reference round
    later: a fresh island's (no reading yet, its learner reports no warm-up) once all `active`
    islands have `reported` a step time, so that the reference is the job's and not one built
    from whoever reported first (alone, a slow island is its own reference: target H)."""
    return fresh and active > 0 and reported >= active


def probe_moves(current: int, target: int, *, claims: int) -> bool:
    """Whether a fresh island's probe reading (first_reading_now) is taken at once: only when its
    target is at most PROBE_MOVE_SHARE of its round (the probe steps' mean that slow and every one
    beyond the band: probe_step_time) and at least MAJORITY_CLAIMS islands report a step time
    (`claims`). With fewer, the reference is the other island's own probe, itself two noisy steps,
    with no majority to bracket it: in a job of two a probe never acts, and the island's round moves
    only on regular readings (two in a row, next_round). Else its report starts its clock."""
    return claims >= MAJORITY_CLAIMS and target <= PROBE_MOVE_SHARE * current


def probe_readings(current: int, target: int, *, fresh: bool, reported: int, active: int) -> int:
    """How many readings a fresh island's first report (its learner's probe) counts as at the
    syncer: 2 when it is taken at once (first_reading_now and probe_moves: every active island
    has reported, at least MAJORITY_CLAIMS, and it at least halves the round); else 1 when at
    least MAJORITY_CLAIMS islands report a step time (a reading like a regular one: beyond the
    band it is one reading pending, and the island's first regular reading a reference round
    later, if beyond the band the same way, moves the round); else 0, its report only starts
    its clock (a rejoin, whose first steps are warm-up again; a job of two, whose reference is
    the other island's own probe, issue 47's tests/e2e/test_fsdp_island.py).

    Why a probe that does not act still counts (issue 47): under load a 3x slower island's two
    probe steps read 2-2.5x against its peers' probes (their steps slowed by the others'
    start-up), short of probe_moves' half, and with two regular readings to wait for its change
    came after its first round's end (3 reference rounds), so it ran its second round at H too
    and at K = M every merge of that round waited for it (fast islands' utilisation 0.80-0.89x
    of equal speeds, bench/RESULTS.md "hetero"). With the probe as the first of the two, its
    first regular reading (1-1.6 reference rounds in) decides, before that boundary. Two steps
    both beyond the band (probe_step_time's cap) and a reference round of steps beyond it the
    same way are still two readings in a row."""
    if not fresh or reported < MAJORITY_CLAIMS:
        return 0
    now = first_reading_now(fresh=fresh, reported=reported, active=active)
    return 2 if now and probe_moves(current, target, claims=reported) else 1


def target_steps(
    *, inner_steps: int, reference: float | None, own: float | None, floor: int, ceiling: int
) -> int:
    """H_i for an island of step time `own` beside the reference: clamp(floor(H x t_ref / t_i),
    floor, ceiling). Without both times, H (clamped too)."""
    if floor < 1 or ceiling < floor:
        raise ValueError(f"need 1 <= floor <= ceiling, got {floor}, {ceiling}")
    if reference is None or own is None or own <= 0 or not math.isfinite(own):
        raw = inner_steps
    else:
        raw = math.floor(inner_steps * reference / own + 1e-9)  # 1e-9: 30 x 0.3 / 0.1 is 90
    return min(ceiling, max(floor, raw))


def sized_steps(
    *,
    inner_steps: int,
    reference: float | None,
    own: float | None,
    floor: int,
    ceiling: int,
    room: float,
) -> int:
    """The H_i a change of an island's round sets (next_round's `sized`): target_steps, but for an
    island slower than the ceiling allows, floor(H x t_ref / t_i x (1 - room)), so that its
    round's wall time is at most 1 - room of the reference round's. `room` is LOCK_STEP_ROOM at
    K = M and 0 at K < M.

    Why (issue 47): at K = M every merge waits for the last push, and target_steps' rounding
    down leaves a slow island no room when H x t_ref / t_i is just above a whole number: under
    load bench/hetero's 3x island ran about 4x (it sleeps 2x its compute, and its compute is
    contended too), was given 5 of 20 steps, a round as long as the reference round, and pushed
    last in 16 of 37 merges, by 0.94 s in all (fast islands' utilisation 0.936x of equal speeds;
    bench/log/2026-11-29.md, "hetero"). The readings that decide a change are still
    target_steps' (the band is unchanged), and a reading of the same step time after the change
    is inside the band of the round it set (floor(x) <= max(floor(0.9 x) + 1, 1.4 floor(0.9
    x)) for every x >= 1), so the room never moves a round by itself."""
    target = target_steps(
        inner_steps=inner_steps, reference=reference, own=own, floor=floor, ceiling=ceiling
    )
    if reference is None or own is None or own <= 0 or not math.isfinite(own) or room <= 0:
        return target
    exact = inner_steps * reference / own
    if exact >= ceiling:
        return ceiling
    return min(ceiling, max(floor, math.floor(exact * (1 - room) + 1e-9)))


@dataclass(frozen=True)
class IslandRound:
    """One island's round size and the readings that may change it."""

    steps: int  # H_i now
    pending: int = 0  # readings in a row beyond CHANGE_FRACTION: > 0 longer, < 0 shorter
    since_change: int = COOLDOWN_READINGS  # readings since H_i last changed (a fresh one may)
    fresh: bool = True  # no reading yet: its probe may be read at once (first_reading_now)
    # The reported step from which its next report is read at once (its learner's second
    # probe, StepTimeReport), set when its probe was one reading pending (probe_readings)
    confirm_at: int | None = None
    # The step time over the reference (t_i / t_ref) of the reading that set `steps`, None
    # while no reading has (H, a pin, a restarted syncer's innerSteps): a longer round needs a
    # reading beyond the band of it (outgrown), not only of the round it set
    anchor: float | None = None
    # The reported step from which its next report (its learner's check, CHECK_STEPS steps past
    # its second probe) is read at once, set by a probe's cut: it sends the round back when it
    # reads the island beyond the band of the cut round the other way (RoundSizes.read)
    check_at: int | None = None
    # The round a probe's cut replaced, kept while the cut round stands: its check, or any later
    # reading, sends it back there when it reads the island within that round's band
    # (restores_cut)
    cut_from: int | None = None
    # Its last RECENT_READINGS regular readings' t_i / t_ref, the latest last (remembered): a
    # regular reading is judged with them (judged_ratio)
    recent: tuple[float, ...] = ()


def in_band(steps: int, target: int) -> bool:
    """Whether a reading's `target` (target_steps) leaves a round of `steps` as it is: the step
    time it implies within CHANGE_FRACTION of the one `steps` assumes, on either side.

    Below: target_steps rounds H x t_ref / t_i down, so a step time exactly (1 + CHANGE_FRACTION)
    times the assumed one gives a target up to a step under steps / (1 + CHANGE_FRACTION); that
    step is inside. One step either way is always inside: at a few steps a round one step is a
    large share, and H_i flipped 3 <-> 4 with the load's noise (bench/hetero, 1,1,2,4)."""
    low = min(steps - 1.0, steps / (1 + CHANGE_FRACTION) - 1.0)
    high = max(steps + 1.0, steps * (1 + CHANGE_FRACTION))
    return low - 1e-9 <= target <= high + 1e-9


def outgrown(anchor: float | None, ratio: float | None) -> bool:
    """Whether a reading of step time `ratio` (t_i / t_ref) may lengthen a round that a reading
    of `anchor` set: only when the island is faster than that reading beyond the band
    (ratio x (1 + CHANGE_FRACTION) <= anchor); always when either is unknown.

    Why (issue 47): a round below the ceiling moves down on any reading that says it is late at
    K = M (late_is_beyond: no band below), while the band of its steps lets it up on a reading
    only 1.15x faster at a few steps (3 -> 5 needs target 5 > 4.2: t_i / t_ref <= 4 where 4.8
    set 3). Under load a 3x island's readings spread over 3.5-5x, and its H_i went 20, 6, 4,
    3, 5, 3 within 30 s (bench/hetero, load 12): every move down was followed by one up on the
    next fast pair of readings. Measured against the reading that set the round, a move up
    needs the island to have sped up beyond the band, as a move off H always did."""
    if anchor is None or ratio is None:
        return True
    return ratio * (1 + CHANGE_FRACTION) <= anchor + 1e-9


def restores_cut(current: IslandRound, target: int) -> bool:
    """Whether a reading of `target` (target_steps) sends a round a probe cut back to the round
    it replaced (`current.cut_from`, kept while the cut round stands): the target is within that
    round's band (in_band), so the island reads as fast as an island at that round may and keep
    it. Its check (check_restores) and any later reading (next_round, as a reading for a longer
    round that need not have outgrown the probe's) go back by it.

    Why later readings too (probe13's "left"): a check that read beyond the band (a start-up's
    load lasting past the check's ten steps, or a stale reference: busy12's run whose check read
    1.52x against an idle peer's start-up time) left the cut to readings that must outgrow the
    probe's, 1.4x faster than it: an identical island cut on a 1.5x probe needs a reading of
    1.077x or less, and busy12's cut island read 0.96-1.46x its peers' (median 1.12x) for the
    rest of its job, at 17 of 30 (utilisation 0.819, the run's other seed 0.900). Two readings in a
    row within the band of 30 (t_i / t_ref <= 1.43) now send it back, as the check does; a slow
    island never reads within it (a 2x island's readings 2.3-3.0x, a 3x one's 3.5-5x:
    bench/hetero), and one that does keeps that round as any island within the band would."""
    before = current.cut_from
    return before is not None and before > current.steps and in_band(before, target)


def check_restores(current: IslandRound, target: int, *, ratio: float | None) -> bool:
    """Whether a probe's cut goes back at its check (the learner's mean of CHECK_STEPS steps
    past its second probe, read at once: IslandRound.check_at), counted as the two readings a
    change needs (next_round's `confirmed`): its `target` is within the band of the round the
    cut replaced (`current.cut_from`, in_band: the check reads the island as that round assumed,
    whatever the probe read), or beyond the band of the cut round upward with its `ratio` (t_i /
    t_ref) outgrown of the reading that set it (outgrown; a cut with no round recorded, a
    restarted syncer's). Else the check is a regular reading.

    Why (issue 47, probe11): a probe and a second probe are two steps each, and an island that
    joins beside its peers' start-up runs both under it; the regular readings that were to send
    such a cut back come at heartbeats, 5 s apart by default, where gpt-tiny's reference round
    is 0.3-0.8 s: in bench/busy_link (seed 1, K = M, 240 steps) an identical island read 2.0x
    at both probes, was cut to 14 of 30 and kept it for the job (one regular reading in 8 s;
    utilisation 0.855 against 0.938). Ten steps clear of the start-up read it at 1x.

    Why the band of the round cut and not only outgrown (issue 45, probe13): outgrown asks the
    check to read 1.4x faster than the probe, which a probe that cut at 1.4-2x does not leave
    room for under load. In busy12's main runs (bench/busy_link, K = M, L = 50%, load 4-6) an
    identical island-3 read 1.51x at its probe and 1.51x at its second probe (cut 30 -> 17,
    the sized floor(19.9 x 0.9), anchor 1.508), and 1.21x at its check (target floor(30 /
    1.212) = 24, beyond 17's band, up to 23.8, but 1.21 x 1.4 = 1.70 > 1.508: not outgrown);
    its learner's 20-step windows then read 0.96-1.46x its peers' (median 1.12x), no later
    reading moved it (a move up needed <= 1.077x), and it ran 17 of 30 until its step 204, the
    job's last second (utilisation 0.819, the run's other seed 0.900). A check within 30's band
    (target >= 21 at H = 30: t_i / t_ref <= 30 / 21 = 1.43) reads the island as fast as an
    island at H may be and keep H, so the cut was the start-up's: back to it (check_round). A
    slow island's check reads it slow: a 3x island cut on a 2x probe reads about 3x (target
    10), and even a 1.45x check (target 20) is below 30's band, so it stays cut (where the
    band's 1.43x equals outgrown of a 2.0x probe, nothing changes: only cuts at probes under 2x
    gain). A move up still leaves a move down to two readings (and at K = M a round back at
    the ceiling has the band)."""
    if restores_cut(current, target):
        return True
    return (
        target > current.steps
        and not in_band(current.steps, target)
        and outgrown(current.anchor, ratio)
    )


def check_round(current: IslandRound, target: int) -> int:
    """The round a check that restores (check_restores) sets: the one the cut replaced
    (`current.cut_from`) when `target` is within its band (in_band: the check reads the island as
    that round assumed, the cut was the start-up's), else `target`.

    Why (probe11): back to the check's own target left an identical island below the ceiling
    (bench/busy_link seed 0, K = M: cut to 16 of 30 at its second probe, its check read 1.13x,
    back to 26), where at K = M any reading that says late cuts it (late_is_beyond: to 25 at its
    step 221) and a move up needs a reading 1.4x faster (outgrown)."""
    if restores_cut(current, target) and current.cut_from is not None:
        return current.cut_from
    return target


def next_round(
    current: IslandRound,
    target: int,
    *,
    confirmed: bool = False,
    sized: int | None = None,
    late: bool = False,
    ratio: float | None = None,
    eager: bool = False,
) -> IslandRound:
    """The island's round after one reading whose target H_i is `target` (target_steps).

    A change needs CONFIRMATIONS readings in a row beyond the band in the same direction, and
    COOLDOWN_READINGS since the last change; a fresh island's first reading is no exception (it
    was, until issue 47: identical FSDP islands under load, island-0's first regular reading
    alone cut it to 5 of 10). `confirmed`: the reading is already two (a probe, whose steps
    each show the target: probe_step_time, probe_moves), so it counts as the CONFIRMATIONS;
    the change it makes starts no cooldown and leaves one reading in its direction pending.
    `sized` (sized_steps): the round a regular change sets, where it differs from the target
    that decides it (K = M's room), never past the current round the other way; a probe's
    change sets the target (chosen while its learner took a cut in place only below it, a step
    or two after the probe: a 4x island's 5 of 20 in place, where the room's 4 came a step late
    and it ran its first round at H; since, a cut heard past it ends the first round at the next
    step, step_plan.adopt_round). `late` (late_is_beyond): a sized round below
    the current one is beyond the band, however near. `ratio`: the reading's t_i / t_ref; a
    reading for a longer round counts only when it has outgrown the one that set the current
    round (outgrown), and a change keeps its ratio as the new round's anchor. `eager`
    (K = M: eager_down): a move to a shorter round needs no cooldown and starts none, and the
    island's first move by a reading (no anchor yet) leaves one reading in its direction
    pending, as a probe's change does."""
    since = current.since_change + 1
    # A round a probe cut, read within the band of the round it replaced: the cut was the
    # start-up's (restores_cut), whatever the probe read, and even within the cut round's band.
    restores = restores_cut(current, target)
    direction = 0
    if restores:
        direction = 1
    elif not in_band(current.steps, target):
        direction = 1 if target > current.steps else -1
    elif late and sized is not None and sized < current.steps:
        direction = -1
    if direction > 0 and not (outgrown(current.anchor, ratio) or restores):
        direction = 0
    if direction == 0:
        return IslandRound(current.steps, 0, since, fresh=False, anchor=current.anchor)
    same = current.pending * direction > 0
    pending = current.pending + direction if same else direction
    if confirmed:
        pending = direction * max(abs(pending), CONFIRMATIONS)
    down_now = eager and direction < 0
    if abs(pending) >= CONFIRMATIONS and (since >= COOLDOWN_READINGS or down_now):
        if not confirmed and sized is not None and (sized - current.steps) * direction > 0:
            target = sized
        if direction > 0 and restores and current.cut_from is not None:
            target = current.cut_from
        if down_now and not confirmed:
            # At K = M (eager_down) a shorter round needs no cooldown and starts none, and the
            # first one (no reading had set the round) leaves one reading pending, as a probe's
            # cut does: the first rounds' readings are the join's, and a slow island read short
            # of its pace was cut late and shallow, then deeper a cooldown at a time.
            first = direction if current.anchor is None else 0
            return IslandRound(target, first, COOLDOWN_READINGS, fresh=False, anchor=ratio)
        if confirmed:
            # A probe's change starts no cooldown: should two regular readings in a row
            # disagree (two steps of a long warm-up cut an island of a job of three or more),
            # the round goes back at the second, two reference rounds on rather than three.
            # And it leaves one reading in its direction pending: the probe has shown the island
            # slow, and the first regular reading (a reference round of steps, where the probe
            # is two: bench/hetero's 3x island probed 2.2x under load, cut to 9 of 20, and ran
            # two readings at 9 before its regular readings took it to 5) may size it further
            # that way alone.
            return IslandRound(target, direction, COOLDOWN_READINGS, fresh=False, anchor=ratio)
        return IslandRound(target, 0, 0, fresh=False, anchor=ratio)
    return IslandRound(current.steps, pending, since, fresh=False, anchor=current.anchor)


def remembered(recent: Sequence[float], ratio: float) -> tuple[float, ...]:
    """An island's last RECENT_READINGS regular readings (t_i / t_ref) after one of `ratio`."""
    return (*recent, ratio)[-RECENT_READINGS:]


def judged_ratio(recent: Sequence[float], *, room: float, longer: bool) -> float:
    """The step time over the reference (t_i / t_ref) that a regular reading is judged at, from
    the island's last RECENT_READINGS regular readings `recent` (remembered: the reading itself
    last). At K = M (`room` > 0): the reading itself, but for a longer round (`longer`: its own
    target above the island's round) the slowest of them. At K < M: their lower median.

    Why (issue 47, hetero18): a CPU island beside accelerators steps at the pace its host's load
    allows, 1.1-4.5x the fast islands' within a run, and a reading (its heartbeat's step time,
    an EMA of its last ten steps or so) says only what the last second's load was. Judged one
    reading at a time, its round followed the load: at K = M its H_i moved 9-13 times a run
    (20 14 11 10 15 10 18 42 12 27 15 11 10 against H = 50: up on two fast readings, down on the
    next two slow ones). At K = M every merge waits for the last push, and the island fills its
    idle with fill steps (learner/fill_steps.py) that count in its next push, so its round is
    to fit its slow spells: it moves down on a reading as before (eager_down, late_is_beyond)
    and up only when its last RECENT_READINGS readings all leave room for it, to the round the
    slowest of them allows (and outgrown of the reading that set its round, as before). At K < M
    no one waits for a push and nothing fills: its round follows the median of its last
    readings, which one or two seconds of load do not move (a lasting slowdown moves it once
    three of the five read it, two readings later than one reading at a time did). Probes,
    checks and a reading that sends a probe's cut back (restores_cut: the cut rested on
    start-up steps) are read alone, as before.

    >>> judged_ratio([3.6, 4.8, 3.0], room=0.1, longer=True)  # K = M, for a longer round
    4.8
    >>> judged_ratio([3.6, 4.8, 3.0], room=0.1, longer=False)  # K = M, the reading itself
    3.0
    >>> judged_ratio([3.6, 4.8, 3.0, 1.2], room=0.0, longer=False)  # K < M: lower median
    3.0
    """
    if not recent:
        raise ValueError("judged_ratio needs at least the reading itself")
    if room > 0:
        return max(recent) if longer else recent[-1]
    return statistics.median_low(recent)


def late_is_beyond(*, room: float, steps: int, ceiling: int) -> bool:
    """Whether a reading whose sized round (sized_steps) is below the island's round `steps`
    counts as beyond the band (next_round's `late`): at K = M (`room` > 0) for an island
    already below the ceiling. Such a reading says its round takes more than 1 - room of the
    reference round (floor(0.9 H x t_ref / t_i) < H_i), and at K = M every merge waits for
    whatever it runs past the reference round; the band's 1.4x let it: bench/hetero's 3x
    island, cut to 6 of 20 by a probe that read 3x, ran 3.3-3.6x under load (target 5, inside
    6's band down to 3.3) and pushed last in 24 of 36 merges, 2.0 s of the fast islands' waits
    (0.875x of equal speeds; bench/log/2026-11-29.md, "hetero — 2026-11-29 11:17 UTC"). Two
    readings in a row are still needed, and a change sets the sized round, which a reading of
    the same speed leaves alone (its sized round is that round). An island at the ceiling
    keeps the band: identical islands read ±30% apart."""
    return room > 0 and steps < ceiling


def eager_down(*, room: float) -> bool:
    """Whether a move to a shorter round skips the cooldown (next_round's `eager`): at K = M
    (`room` > 0). The first such move by a reading (not a probe's, which does so already) also
    leaves one reading in its direction pending.

    Why (issue 47): at K = M every merge waits for the last push, and a slow island's readings
    in its first rounds are the join's: its probe and second probe, two steps each, read a 3x
    island under 2x when its compute ran fast or its peers' early steps slow (bench/hetero: 1.9x
    and 1.7x where it ran 4.2x), and it was cut late and shallow (to 10 at its step 12, to 8
    at 30), then deeper a cooldown (three readings) at a time (20, 8, 5, 4, 3 by its step 54),
    every fast island waiting for each long round (0.76-1.98 s a run). A move down is already
    taken on any reading that says the round is late (late_is_beyond), two in a row; a move
    up still needs the cooldown and a reading 1.4x faster than the one that set the round
    (outgrown), so readings that flip between two speeds move it down once and stay. The price:
    a round cut too deep idles (at K = M its learner fills the idle with fill steps), where a
    round cut too little made every other island wait. At K < M no one waits for a push."""
    return room > 0


@dataclass(frozen=True)
class RoundLimits:
    """What the spec fixes of every island's round (inner.*, islands.overrides[].innerSteps)."""

    inner_steps: int  # H
    auto: bool  # inner.stepsPerIsland == auto
    floor: int
    ceiling: int
    pinned: dict[int, int]  # island index -> its override's innerSteps

    @classmethod
    def from_spec(cls, spec: JobSpec) -> RoundLimits:
        inner = spec.inner
        pinned = {
            i: entry.inner_steps
            for entry in spec.islands.overrides
            if entry.inner_steps is not None
            for i in entry.islands
        }
        return cls(
            inner_steps=inner.steps,
            auto=inner.steps_per_island == "auto",
            floor=inner.min_steps_resolved,
            ceiling=inner.max_steps_resolved,
            pinned=pinned,
        )

    @property
    def varies(self) -> bool:
        """Whether islands may run rounds of different lengths (stepsPerIsland auto, or an
        override pinning an H_i other than H): the K = M drain's shares then come from the
        syncer (syncer/state/targets.py), which knows every island's H_i."""
        return self.auto or any(h != self.inner_steps for h in self.pinned.values())

    @property
    def pins_differ(self) -> bool:
        """Whether the spec itself gives some island a round other than H (an override's
        innerSteps): the K = M budget is then split by the syncer from the start (split_budget)."""
        return any(h != self.inner_steps for h in self.pinned.values())

    def fixed_steps(self, index: int | None) -> int | None:
        """H_i when the spec fixes it (a pin, or stepsPerIsland fixed); None when measured."""
        if index is not None and index in self.pinned:
            return self.pinned[index]
        return None if self.auto else self.inner_steps

    def steps_of(self, index: int | None, current: IslandRound | None) -> int:
        """The island's H_i now: the spec's when it fixes one, else its round's (H at first)."""
        fixed = self.fixed_steps(index)
        if fixed is not None:
            return fixed
        return current.steps if current is not None else self.inner_steps

    def most_steps(self) -> int:
        """The longest round any island may be given (the push bounds' H)."""
        return max([self.inner_steps, self.ceiling, *self.pinned.values()])


def split_budget(*, inner_steps: int, rounds: Iterable[int], split: bool) -> bool:
    """K = M: whether stopAfter.tokens is split per island by the syncer (stop targets by tokens
    per round, syncer/state/targets.lock_step_weights) rather than met by each island's share of
    1/M (learner/drain.share_steps), after the islands' rounds `rounds` (their H_i) are seen.

    `split`: whether it already was. Once any island's round differs from H (`inner_steps`) the
    split holds for the rest of the job: the shares count rounds of H, so a job whose rounds
    ever differed has spent its budget unevenly (a 3x slower island's rounds of H/3 carried a
    third of the tokens) and a share of 1/M no longer adds up to the budget. While every round is
    H, inner.stepsPerIsland auto keeps the shares exactly as fixed does: every island drains at
    its own step count, with no wait for a pace or a horizon (issue 47: with targets only, a short
    job at K = M passed stopAfter.tokens by a step an island, 2,656 merged of 2,560)."""
    return split or any(h != inner_steps for h in rounds)
