"""The syncer's side of each island's round (syncer/state/round_sizes.py): readings once per
reference round, H_i from the island's own step time, the push bound that follows, and a liar
that moves only its own round. Expected values derived by hand in the comments."""

from __future__ import annotations

from diloco_trainer.api.spec import parse_spec
from diloco_trainer.core.island_rounds import StepTimeReport
from diloco_trainer.syncer.state import IslandRecord, RoundSizes
from diloco_trainer.syncer.state.round_sizes import island_index


def _job(**inner: object) -> RoundSizes:
    spec = parse_spec(
        {
            "inner": {"steps": 30, "stepsPerIsland": "auto", **inner},
            "islands": {"count": 4, "overrides": [{"islands": [2], "innerSteps": 12}]},
            "sync": {"overlapSteps": 5},
        }
    )
    return RoundSizes(spec)


def _islands(times: list[float]) -> list[IslandRecord]:
    return [IslandRecord(name=f"island-{i}", step_time=t) for i, t in enumerate(times)]


def test_island_index() -> None:
    assert island_index("island-3") == 3
    assert island_index("eu-island-12") == 12
    assert island_index("node-3") is None


def test_a_slow_island_gets_a_third_of_the_round_at_its_first_report() -> None:
    sizes = _job()
    recs = _islands([1.0, 1.0, 1.0, 3.0])
    slow = recs[3]
    sizes.joined(slow)
    assert sizes.steps_of(slow, slow.name) == 30  # H until measured
    # every island has reported: its first report is read at once; t_ref = lower median of
    # 1,1,1,3 = 1 s, target 30 x 1 / 3 = 10 <= half of 30 with 4 claims: a probe, taken at once
    sizes.read(slow, recs, now=0.0)
    assert sizes.steps_of(slow, slow.name) == 10
    # the next reading only a reference round (H x t_ref = 30 s) later; the probe's cut left
    # one reading shorter pending (-1), so a reading of target 5 would cut to 5 at once
    assert slow.round is not None and slow.round.pending == -1
    recs[3].step_time = 6.0
    sizes.read(slow, recs, now=29.0)
    assert slow.round.pending == -1 and sizes.steps_of(slow, slow.name) == 10
    recs[3].step_time = 3.0
    sizes.read(slow, recs, now=30.0)  # reading 2 agrees
    assert sizes.steps_of(slow, slow.name) == 10
    # its pushes may carry 4 x the longer of its two last rounds + overlapSteps: 4 x 30 + 5
    assert sizes.max_push_steps(slow, slow.name) == 125
    # a fast island keeps H
    fast = recs[0]
    sizes.joined(fast)
    for now in (0.0, 30.0, 60.0, 90.0):
        sizes.read(fast, recs, now=now)
    assert sizes.steps_of(fast, fast.name) == 30
    assert sizes.max_push_steps(fast, fast.name) == 4 * 30 + 5


def test_a_liar_moves_only_its_own_round() -> None:
    sizes = _job()
    # island-3 claims a step time of 1 microsecond: the lower median of 1e-6, 1, 1, 2 is 1
    recs = _islands([1.0, 1.0, 2.0, 1e-6])
    honest = recs[0]
    sizes.joined(honest)
    for now in (0.0, 30.0, 60.0, 90.0, 120.0):
        sizes.read(honest, recs, now=now)
    assert sizes.steps_of(honest, honest.name) == 30  # its own 1 s against t_ref 1 s


def test_a_pinned_island_is_never_read() -> None:
    sizes = _job()
    recs = _islands([1.0, 1.0, 5.0, 1.0])
    pinned = recs[2]
    sizes.joined(pinned)
    for now in (0.0, 30.0, 60.0, 90.0):
        sizes.read(pinned, recs, now=now)
    assert sizes.steps_of(pinned, pinned.name) == 12
    assert sizes.max_push_steps(pinned, pinned.name) == 4 * 12 + 5


def test_fixed_rounds_are_never_read() -> None:
    sizes = _job(stepsPerIsland="fixed")
    recs = _islands([1.0, 1.0, 1.0, 3.0])
    slow = recs[3]
    sizes.joined(slow)
    for now in (0.0, 30.0, 60.0, 90.0):
        sizes.read(slow, recs, now=now)
    assert sizes.steps_of(slow, slow.name) == 30


def test_a_fresh_islands_first_report_before_its_peers_is_one_reading() -> None:
    sizes = _job()
    recs = _islands([1.0, 0.0, 1.0, 3.0])  # island-1 has not reported yet
    slow = recs[3]
    sizes.joined(slow)
    # 3 of 4 reported: the reference (lower median of 1, 1, 3 = 1) is not the job's yet, so
    # the probe is not taken at once; with 3 claims it is one reading: target 10, beyond the
    # band (below min(29, 30 / 1.4 - 1 = 20.4)), pending -1
    sizes.read(slow, recs, now=0.0)
    assert sizes.steps_of(slow, slow.name) == 30
    assert slow.round is not None and slow.round.pending == -1 and not slow.round.fresh
    sizes.read(slow, recs, now=29.0)  # H x t_ref = 30 s not passed: no reading
    assert sizes.steps_of(slow, slow.name) == 30
    sizes.read(slow, recs, now=30.0)  # the first regular reading confirms it: -2, cut to 10
    assert sizes.steps_of(slow, slow.name) == 10
    # a regular change starts the cooldown: nothing pending, 0 readings since
    assert slow.round.pending == 0 and slow.round.since_change == 0


def test_a_fresh_islands_first_report_before_two_claims_waits_for_its_second_probe() -> None:
    """Two of four reported: with fewer than three claims no probe is a reading, and in a job
    of four it starts no clock either: the report from its position + 2 on is read as its
    first (its learner's second probe)."""
    sizes = _job()
    recs = _islands([1.0, 0.0, 0.0, 3.0])
    slow = recs[3]
    sizes.joined(slow)
    slow.reported_step = 2
    sizes.read(slow, recs, now=0.0)  # t_ref = the fastest of 1, 3 = 1: target 10, no reading
    assert slow.round is not None and slow.round.fresh and slow.round.confirm_at == 4
    assert slow.round_read_at is None and sizes.steps_of(slow, slow.name) == 30
    slow.reported_step = 3
    sizes.read(slow, recs, now=0.5)  # not its second probe yet
    assert slow.round.fresh and slow.round_read_at is None
    recs[1].step_time = recs[2].step_time = 1.0  # its peers report
    slow.reported_step = 4  # its second probe: 4 of 4 claims, target 10 <= 15: taken at once
    sizes.read(slow, recs, now=1.0)
    assert sizes.steps_of(slow, slow.name) == 10 and not slow.round.fresh


def test_a_rejoined_island_is_read_a_reference_round_after_its_first_report() -> None:
    sizes = _job()
    recs = _islands([1.0, 1.0, 1.0, 3.0])
    slow = recs[3]
    sizes.joined(slow)
    sizes.read(slow, recs, now=0.0)  # first reading: 10
    sizes.joined(slow)  # its learner restarted: its round stays, its clock restarts
    recs[3].step_time = 1.0  # target 30 (a warm-up figure, say)
    sizes.read(slow, recs, now=100.0)  # starts the clock: no reading
    sizes.read(slow, recs, now=101.0)
    # no reading: the probe's pending -1 is as it was (a reading of target 30 sets +1)
    assert slow.round is not None and slow.round.pending == -1
    assert sizes.steps_of(slow, slow.name) == 10


def test_a_probe_near_the_reference_waits_for_the_regular_reading() -> None:
    sizes = _job()
    recs = _islands([1.0, 1.0, 1.0, 1.5])  # target 30 x 1 / 1.5 = 20: more than half of 30
    noisy = recs[3]
    sizes.joined(noisy)
    sizes.read(noisy, recs, now=0.0)  # every island reported, but the probe is no reading
    assert sizes.steps_of(noisy, noisy.name) == 30
    recs[3].step_time = 1.1  # its regular reading, H x t_ref = 30 s later: target 27, within 20%
    sizes.read(noisy, recs, now=30.0)
    assert sizes.steps_of(noisy, noisy.name) == 30
    assert noisy.round is not None and not noisy.round.fresh


def test_the_budget_is_split_once_a_round_moves_and_stays_split() -> None:
    """No pin: while every island's round is H, no split (each island keeps its share of 1/M,
    as with stepsPerIsland fixed); the slow island's round moving to 10 splits it for good."""
    spec = parse_spec({"inner": {"steps": 30, "stepsPerIsland": "auto"}, "islands": {"count": 4}})
    sizes = RoundSizes(spec)
    recs = _islands([1.0, 1.0, 1.0, 1.0])
    for rec in recs:
        sizes.joined(rec)
    # equal islands, readings within the band (target 30 x 1 / 1.3 = 23): all keep H, no split
    recs[3].step_time = 1.3
    for now in (0.0, 30.0, 60.0, 90.0):
        sizes.read(recs[3], recs, now=now)
    assert sizes.steps_of(recs[3], recs[3].name) == 30 and not sizes.split
    # island-3 slows to 3 s (K < M: a regular reading is judged at the lower median of its last
    # five, core/island_rounds.judged_ratio): [1.3 x 3, 3.0] and [1.3 x 3, 3.0 x 2] read 1.3,
    # target 23, in the band; [1.3 x 2, 3.0 x 3] reads 3.0, target 10, beyond: one pending;
    # [1.3, 3.0 x 4] the second in a row -> 10, and split
    recs[3].step_time = 3.0
    sizes.read(recs[3], recs, now=120.0)
    sizes.read(recs[3], recs, now=150.0)
    assert sizes.steps_of(recs[3], recs[3].name) == 30 and not sizes.split
    sizes.read(recs[3], recs, now=180.0)
    sizes.read(recs[3], recs, now=210.0)
    assert sizes.steps_of(recs[3], recs[3].name) == 10 and sizes.split
    # it recovers: [3.0 x 4, 1.0] and [3.0 x 3, 1.0 x 2] read 3.0; [3.0 x 2, 1.0 x 3] reads 1.0,
    # target 30 (outgrown of 3.0 and after the cooldown's three readings): one pending; the next
    # takes it: its round is H again, still split
    recs[3].step_time = 1.0
    for now in (240.0, 270.0, 300.0):
        sizes.read(recs[3], recs, now=now)
    assert sizes.steps_of(recs[3], recs[3].name) == 10
    sizes.read(recs[3], recs, now=330.0)
    assert sizes.steps_of(recs[3], recs[3].name) == 30 and sizes.split


def test_a_pin_other_than_h_splits_the_budget_from_the_start() -> None:
    assert _job().split  # island 2 pinned at 12, H = 30


def _steps_to_rounds(
    count: int, inner_steps: int, steps: list[list[float]], quorum: int = 1
) -> dict[int, list[tuple[int, int]]]:
    """A job of `count` islands at inner.steps `inner_steps` (stepsPerIsland auto, floor
    ceil(H/8), ceiling H, sync.quorum `quorum`) whose learners take `steps` (island -> each
    step's seconds, from one start): each step's report (the learner's StepTimeReport) reaches
    the syncer in a heartbeat at the step's end, in time order, and is read
    (RoundSizes.read). Returns each island's
    changes of H_i, as (its step at the heartbeat that made it, the new H_i)."""
    spec = parse_spec(
        {
            "inner": {"steps": inner_steps, "stepsPerIsland": "auto"},
            "islands": {"count": count},
            "sync": {"quorum": quorum},
        }
    )
    sizes = RoundSizes(spec)
    recs = _islands([0.0] * count)
    for rec in recs:
        rec.step_time = None
        sizes.joined(rec)
    reports = [StepTimeReport() for _ in recs]
    beats = sorted(
        (sum(times[: k + 1]), i, k + 1) for i, times in enumerate(steps) for k in range(len(times))
    )
    changes: dict[int, list[tuple[int, int]]] = {i: [] for i in range(count)}
    for now, i, step in beats:
        reports[i].add(steps[i][step - 1])
        recs[i].step_time = reports[i].value  # membership.heartbeat keeps the last report
        recs[i].reported_step = step - 1  # its learner reports its position before it moves
        before = sizes.steps_of(recs[i], recs[i].name)
        sizes.read(recs[i], recs, now)
        after = sizes.steps_of(recs[i], recs[i].name)
        if after != before:
            changes[i].append((step, after))
    return changes


# Times are binary fractions (0.25, 0.75, ...) so the hand-derived clock is exact.
FAST, SLOW, WARM = 0.25, 0.75, 1.0


def test_a_genuinely_slow_island_of_four_is_cut_by_its_probe() -> None:
    """1,1,1,3 at H = 20 (floor 3): every island's step 1 is warm-up (1 s). The fast islands' probes
    (the mean of steps 2, 3, at most 1.4 x the faster: 0.25 s) come at 1.5 s, island-3's (0.75) at
    2.5 s, when all four have reported: t_ref = lower median of 0.25 x 3, 0.75 = 0.25, target
    floor(20 x 0.25 / 0.75) = 6 <= 10 with 4 claims: cut to 6 at its step 3 (in place in its
    first round). Its regular readings (every 20 x 0.25 = 5 s) read 0.75 again: target 6, in
    the band; the fast islands' read target 20: they keep H."""
    fast = [WARM] + [FAST] * 80
    slow = [WARM] + [SLOW] * 27
    changes = _steps_to_rounds(4, 20, [fast, fast, fast, slow])
    assert changes == {0: [], 1: [], 2: [], 3: [(3, 6)]}


def test_a_noisy_then_normal_island_of_four_is_not_cut() -> None:
    """Identical islands; island-3's step 2 is 6x slow (1.5 s, a warm-up on a shared CPU),
    then it runs at 0.25 s like the others. Its probe is the mean of steps 2, 3 (0.875 s)
    capped at 1.4 x the faster (0.35 s): target floor(20 x 0.25 / 0.35) = 14, not half the
    round, no cut (the plain mean, target floor(20 x 0.25 / 0.875) = 5, cut it at once before
    issue 47's confirmation). Its later reports are the mean of the
    steps after the probe, 0.25 s: H throughout."""
    fast = [WARM] + [FAST] * 80
    noisy = [WARM, 1.5] + [FAST] * 74
    changes = _steps_to_rounds(4, 20, [fast, fast, fast, noisy])
    assert changes == {0: [], 1: [], 2: [], 3: []}


def test_a_long_warm_up_cut_of_an_island_of_four_goes_back_at_its_check() -> None:
    """Island-3's steps 2 and 3 both slow (1.5 s, 1.25 s), then 0.25 s. Its probe (the mean
    1.375 s, under 1.4 x 1.25; at 3.75 s) confirms itself: target floor(20 x 0.25 / 1.375) = 3,
    cut at step 3 (anchor 1.375 / 0.25 = 5.5); its check is due at reported step 2 + 2 + 10 =
    14. Its second probe (steps 4-5, 0.25 s) is no reading (a reference round, 5 s, has not
    passed). Its check, the mean of steps 6-15 (0.25 s) reported at once at step 15 (6.25 s),
    has target 20, beyond 3's band (up to max(4, 4.2)) and outgrown (1.0 x 1.4 <= 5.5): back
    to 20 at step 15, as two readings. Before the check (issue 47, probe11) it went back at
    two regular readings a reference round apart, steps 23 and 43. The fast islands keep H."""
    fast = [WARM] + [FAST] * 80
    noisy = [WARM, 1.5, 1.25] + [FAST] * 60
    changes = _steps_to_rounds(4, 20, [fast, fast, fast, noisy])
    assert changes == {0: [], 1: [], 2: [], 3: [(3, 3), (15, 20)]}


def test_an_identical_island_cut_by_both_probes_goes_back_at_its_check() -> None:
    """bench/busy_link seed 1 at K = M (issue 47, probe11) in binary fractions: four identical
    islands at H = 30 (floor 4), island-3's steps 2-5 slowed by its peers' start-up (0.5 s, 2x),
    then 0.25 s like them. Its probe (0.5 s, at 2 s) has target floor(30 x 0.25 / 0.5) = 15 <=
    15 with four claims: cut to 15 at step 3, anchor 2.0, check due at reported step 14. Its
    second probe (0.5 s too) is no reading. Its check, the mean of steps 6-15 (0.25 s), at once
    at step 15: target 30, beyond 15's band (up to 21) and outgrown (1.4 <= 2.0): back to 30 at
    step 15, 15 x 0.25 + 1 = 4.75 s in, under one reference round (7.5 s) after the cut. At
    K = M (quorum 4) the same: a move up keeps the cooldown rule, which a probe's cut never
    started. Later readings (0.25 s) keep 30."""
    fast = [WARM] + [FAST] * 120
    joined = [WARM] + [2 * FAST] * 4 + [FAST] * 100
    for quorum in (1, 4):
        changes = _steps_to_rounds(4, 30, [fast, fast, fast, joined], quorum=quorum)
        assert changes == {0: [], 1: [], 2: [], 3: [(3, 15), (15, 30)]}


def test_a_check_a_little_slow_goes_back_to_h_not_its_own_target() -> None:
    """As above, but island-3 runs 1.125x from step 6 (0.28125 s). Its probe (0.5 s): cut to 15
    at step 3, anchor 2.0. Its check (mean of steps 6-15, 0.28125 s, at 1 + 2 + 2.8125 =
    5.8125 s, before its first regular reading at 2 + 7.5 = 9.5 s): t_ref 0.25 (lower median
    of 0.25 x 3, 0.28125), ratio 1.125, target floor(30 / 1.125) = 26, beyond 15's band (up to
    21), outgrown (1.575 <= 2.0): it restores, and 26 is within 30's band (down to 20.43), so
    back to 30 (check_round). Back to 26, at K = M a later reading (target 26, sized floor(26.67
    x 0.9) = 24 < 26: late below the ceiling) cut it to 24 (probe11: bench/busy_link seed 0,
    16 -> 26 -> 25). At 30 the band holds (1.125x is inside it): 30 kept at K = 1 and K = M."""
    fast = [WARM] + [FAST] * 160
    joined = [WARM] + [2 * FAST] * 4 + [0.28125] * 120
    for quorum in (1, 4):
        changes = _steps_to_rounds(4, 30, [fast, fast, fast, joined], quorum=quorum)
        assert changes == {0: [], 1: [], 2: [], 3: [(3, 15), (15, 30)]}


def test_a_second_probes_cut_goes_back_at_its_check_at_any_quorum() -> None:
    """Identical islands at H = 30 (floor 4); island-3's steps 2-5 at 0.40625 s (1.625x), then
    0.25 s. Its probe (0.40625 s at 1.8125 s): target floor(30 / 1.625) = 18, not half the
    round: one reading pending, second probe due at reported step 4. Its second probe (0.40625
    s at 2.625 s, t_ref 0.25): target 18 again, two in a row: cut at step 5, to 18 at K = 1
    (starting a cooldown) and to the sized floor(18.46 x 0.9) = 16 at K = M (eager_down: none);
    check due at reported step 4 + 10 = 14. Its check (steps 6-15, 0.25 s, at 5.125 s, before a
    regular reading, 1.8125 + 7.5 = 9.3125 s): target 30, beyond 18's (16's) band and outgrown
    (1.4 <= 1.625): back to 30 at step 15, at K = 1 too (a restoring check needs no cooldown)."""
    fast = [WARM] + [FAST] * 160
    joined = [WARM] + [0.40625] * 4 + [FAST] * 120
    assert _steps_to_rounds(4, 30, [fast, fast, fast, joined]) == {
        0: [],
        1: [],
        2: [],
        3: [(5, 18), (15, 30)],
    }
    assert _steps_to_rounds(4, 30, [fast, fast, fast, joined], quorum=4) == {
        0: [],
        1: [],
        2: [],
        3: [(5, 16), (15, 30)],
    }


def test_an_identical_island_cut_at_1_5x_goes_back_at_a_check_within_hs_band() -> None:
    """probe13 (issue 45), busy12's main run in binary fractions: identical islands at H = 30
    (floor 4); island-3's steps 2-5 at 0.375 s (1.5x: its peers' start-up), then 0.28125 s
    (1.125x, within the band of H). Its probe (0.375 s at 1.75 s, t_ref 0.25): target floor(30 /
    1.5) = 20, not half the round: one reading pending, second probe due at reported step 4.
    Its second probe (0.375 s at 2.5 s): target 20 again, two in a row: cut at step 5, to 20 at
    K = 1 and to the sized floor(20 x 0.9) = 18 at K = M, anchor 1.5; check due at reported
    step 14. Its check (steps 6-15, 0.28125 s, at 2.5 + 2.8125 = 5.3125 s, before a regular
    reading, 2.5 + 7.5 = 10 s after the second probe's): ratio 1.125, target
    floor(26.67) = 26, within 20's band (up to 28) at K = 1, beyond 18's (up to 25.2) at K = M
    but not outgrown (1.125 x 1.4 = 1.575 > 1.5): on main both stayed cut, and every later
    reading (target 26) too. 26 is within 30's band (down to 20.43): back to 30 at step 15
    (check_restores). Later readings (1.125-1.2x: target 25-26) keep 30."""
    fast = [WARM] + [FAST] * 160
    joined = [WARM] + [1.5 * FAST] * 4 + [0.28125] * 120
    assert _steps_to_rounds(4, 30, [fast, fast, fast, joined]) == {
        0: [],
        1: [],
        2: [],
        3: [(5, 20), (15, 30)],
    }
    assert _steps_to_rounds(4, 30, [fast, fast, fast, joined], quorum=4) == {
        0: [],
        1: [],
        2: [],
        3: [(5, 18), (15, 30)],
    }


def test_an_island_cut_at_1_5x_that_runs_1_5x_stays_cut_at_its_check() -> None:
    """As above, but island-3 runs 1.5x throughout (0.375 s): its check reads 1.5x, target 20,
    below 30's band (20.43): no move up; a regular reading within 20's band (K = 1) and 18's
    (K = M: its sized floor(20 x 0.9) = 18 is not below 18, not late): it stays cut."""
    fast = [WARM] + [FAST] * 160
    slow = [WARM] + [1.5 * FAST] * 120
    assert _steps_to_rounds(4, 30, [fast, fast, fast, slow]) == {
        0: [],
        1: [],
        2: [],
        3: [(5, 20)],
    }
    assert _steps_to_rounds(4, 30, [fast, fast, fast, slow], quorum=4) == {
        0: [],
        1: [],
        2: [],
        3: [(5, 18)],
    }


def test_a_slow_island_cut_by_its_probe_stays_cut_at_its_check() -> None:
    """1,1,1,3 at H = 40 (floor 5): island-3 at 0.75 s, its steps 2-5 under-read by the join
    (0.5 s, 2x). Its probe (0.5 s at 2 s): target floor(40 x 0.25 / 0.5) = 20 <= 20, cut to 20
    at step 3, anchor 2.0, one reading shorter pending, check due at reported step 14. Its
    check (the mean of steps 6-15, 0.75 s, at step 15: 1 + 4 x 0.5 + 10 x 0.75 = 10.5 s, before
    its first regular reading could come, 2 + 40 x 0.25 = 12 s) reads 3x: target floor(40 / 3)
    = 13, no move up (check_restores) but a regular reading: beyond 20's band (down to 13.29),
    with the probe's pending one two readings, cooldown passed (the probe's cut started none):
    cut to 13 at step 15 at K = 1; at K = M to the sized floor(13.33 x 0.9) = 12. Later
    readings (its mean since the probe, 0.72-0.75 s: target 13, sized 12) keep it."""
    fast = [WARM] + [FAST] * 200
    slow = [WARM] + [2 * FAST] * 4 + [SLOW] * 60
    assert _steps_to_rounds(4, 40, [fast, fast, fast, slow]) == {
        0: [],
        1: [],
        2: [],
        3: [(3, 20), (15, 13)],
    }
    assert _steps_to_rounds(4, 40, [fast, fast, fast, slow], quorum=4) == {
        0: [],
        1: [],
        2: [],
        3: [(3, 20), (15, 12)],
    }


def test_in_a_job_of_two_a_noisy_warm_up_never_cuts() -> None:
    """tests/e2e/test_fsdp_island.py's failure by hand: identical islands of a job of two at H = 10
    (floor 2), island-1's steps 2 and 3 slow (1.5 s, 1.25 s: FSDP's warm-up on a shared CPU), then
    0.25 s. Its probe (1.375 s at 3.75 s; island-0's 0.25 s came at 1.5 s) has target floor(10 x
    0.25 / 1.375) = 1, the floor 2, but with 2 claims a probe never acts: it starts the clock. Its
    regular readings, every 10 x 0.25 = 2.5 s, read the mean of its steps after the
    probe, 0.25 s: target 10, in the band. (An EMA seeded from the probe read 0.25 + 0.9^10 x
    1.125 = 0.64 s ten steps on, target 3, and 0.25 + 0.9^20 x 1.125 = 0.39 s ten more on,
    target 6 < 10 / 1.4 - 1 = 6.14: two readings in a row beyond the band, a cut.) Island-0 is never
    beyond the band either: its own 0.25 s against t_ref = min(0.25, island-1's claim)."""
    fast = [WARM] + [FAST] * 60
    noisy = [WARM, 1.5, 1.25] + [FAST] * 50
    assert _steps_to_rounds(2, 10, [fast, noisy]) == {0: [], 1: []}


def test_in_a_job_of_two_a_slow_island_is_cut_at_its_second_regular_reading() -> None:
    """A job of two at H = 10 (floor 2), island-1 3x slower (0.75 s). Its probe (0.75 s at
    2.5 s) has target floor(10 x 0.25 / 0.75) = 3 but does not act (2 claims): it starts the
    clock. Readings every 10 x 0.25 = 2.5 s at its heartbeats (steps end at 1 + 0.75 (k - 1)):
    the first at 5.5 s (step 7: 5.5 - 2.5 >= 2.5), target 3, pending; the second at 8.5 s
    (step 11), confirmed: cut to 3. Island-0 keeps H."""
    fast = [WARM] + [FAST] * 60
    slow = [WARM] + [SLOW] * 20
    assert _steps_to_rounds(2, 10, [fast, slow]) == {0: [], 1: [(11, 3)]}


def test_a_slow_islands_probe_before_a_late_peers_report_is_one_reading() -> None:
    """1,1,1,3 at H = 20 (floor 3) with island-2 started late (its step 1 ends at 4 s: a process
    start on a loaded machine); the others' step 1 is warm-up (1 s). Island-3's probe (0.75 s,
    the mean of its steps 2, 3) comes at 2.5 s, before island-2 has reported: 3 of 4 claims,
    so it is not taken at once (first_reading_now), but with 3 claims it is one reading: t_ref
    = lower median of 0.25, 0.25, 0.75 = 0.25, target floor(20 x 0.25 / 0.75) = 6, beyond the
    band (below 20 / 1.4 - 1 = 13.3): pending, and its next report from its reported position 2
    + 2 = 4 on (its step 5, 4 s: its second probe, steps 4-5, 0.75 s) is read at once: t_ref
    still 0.25 (island-2's step 1 ends at 4 s, no report), target 6, confirmed: cut to 6 at
    step 5, in place (its position below 6). Before the probe counted (a clock start only) two
    regular readings a reference round (5 s) apart cut it at step 17 (13 s); under load, with
    heartbeats a second apart, that came after its step 20, and it ran its second round at H.
    The fast islands keep H."""
    fast = [WARM] + [FAST] * 80
    late = [4.0] + [FAST] * 70
    slow = [WARM] + [SLOW] * 27
    changes = _steps_to_rounds(4, 20, [fast, fast, late, slow])
    assert changes == {0: [], 1: [], 2: [], 3: [(5, 6)]}


def test_a_probe_slowed_less_than_half_is_one_reading() -> None:
    """1,1,1,3 at H = 20, every island reporting, but the fast islands' first steps slowed by
    the others' start-up (0.5 s for steps 2-5, then 0.25 s) so that island-3's probe (0.75 s at
    2.5 s) reads only 1.5x: at 2.5 s the fast islands' reports are their probes' 0.5 s followed
    by their step 4 (0.5 s; their heartbeats at 2.5 s come before island-3's), t_ref 0.5, target
    floor(20 x 0.5 / 0.75) = 13, not half the round (no cut at once) but beyond the band (below
    13.29): one reading pending. Its second probe (steps 4-5, 0.75 s) at 4 s is read at once:
    the fast islands' steps end at 3 + 0.25 (k - 5) from step 5, at step 9 then, their report
    the mean of steps 4-9 ((2 x 0.5 + 4 x 0.25) / 6 = 0.333), t_ref 0.333, target floor(20 x
    0.333 / 0.75) = floor(8.9) = 8, beyond the band the same way: cut to 8 at step 5, in place.
    Its later readings (t_ref falling to 0.25, target 6) stay in 8's band (down to 4.71) at
    K = 1. Waiting for two regular readings instead cut it at step 18."""
    fast = [WARM] + [2 * FAST] * 4 + [FAST] * 80
    slow = [WARM] + [SLOW] * 30
    changes = _steps_to_rounds(4, 20, [fast, fast, fast, slow])
    assert changes == {0: [], 1: [], 2: [], 3: [(5, 8)]}


def test_at_k_equals_m_a_slow_island_under_read_by_its_probes_is_cut_deeper_at_one_reading() -> (
    None
):
    """1,1,1,3 at H = 20 (floor 3), K = M = 4: the fast islands' steps 2-5 slowed by the join
    (0.5 s, then 0.25 s: step k >= 5 ends at 3 + 0.25 (k - 5) s), island-3 at 0.75 s (step k
    ends at 1 + 0.75 (k - 1) s). Its probe (0.75 s, step 3 at 2.5 s) against the fast islands'
    step-4 reports (0.5 s, heard first at 2.5 s): t_ref 0.5, target floor(20 x 0.5 / 0.75) =
    13, one reading pending. Its second probe (steps 4-5, 0.75 s, at 4.0 s) against the fast
    islands' step 9 (the mean of steps 4-9, (2 x 0.5 + 4 x 0.25) / 6 = 0.333 s): target
    floor(8.89) = 8, two in a row: cut to the sized floor(0.9 x 8.89) = 8 at step 5. The join
    made both probes read it 1.5x and 2.25x where it runs 3x.
    Its next reading a reference round on: at 9.25 s (step 12; at 8.5 s 4.5 s had passed, under
    20 x t_ref), the fast islands at step 30, their report the mean of steps 4-13 (0.3 s) then
    an EMA of 0.1 over 17 steps of 0.25 s: 0.25 + 0.05 x 0.9^17 = 0.2583 s, 20 x 0.2583 =
    5.17 <= 5.25 s; island-3's the mean of its steps 4-12, 0.75 s: target floor(6.89) = 6, in
    8's band (down to 4.71) but late at K = M (sized floor(6.2) = 6 < 8). The second probe's
    cut was the round's first move, which at K = M leaves one reading pending (eager_down): cut
    to 6 at step 12. Before, with the cooldown (three readings) and nothing pending, it ran
    rounds of 8 (a round of 8 x 3 = 24 of the fast islands' 20 step times, every merge waiting
    for it) until step 26. At K = 1 (no room, no late rule) 6 is inside 8's band: 8 kept."""
    fast = [WARM] + [2 * FAST] * 4 + [FAST] * 120
    slow = [WARM] + [SLOW] * 40
    changes = _steps_to_rounds(4, 20, [fast, fast, fast, slow], quorum=4)
    assert changes == {0: [], 1: [], 2: [], 3: [(5, 8), (12, 6)]}
    changes = _steps_to_rounds(4, 20, [fast, fast, fast, slow], quorum=1)
    assert changes == {0: [], 1: [], 2: [], 3: [(5, 8)]}


def test_at_k_equals_m_a_slow_island_round_leaves_room() -> None:
    """1,1,1,4 at H = 20 (floor 3), K = M = 4. Island-3's probe (1.0 s, the mean of its steps 2,
    3) at 3 s, the fast islands' reports 0.25 s: t_ref 0.25, target floor(20 x 0.25 / 1.0) = 5
    <= 10, taken at once and set as it is (5, in place while the learner is below it), one
    reading shorter pending. Its first regular reading, at its first heartbeat a reference
    round (5 s) on (its steps end at k s: step 8), target 5, sized floor(5 x 0.9) = 4 < 5: late
    at K = M, with the pending one two readings: 4 (4 s against the reference round's 5 s).
    Later readings (sized 4) leave it. At K = 1 the same schedule keeps 5 (no room: a late push
    delays no one)."""
    fast = [WARM] + [FAST] * 80
    slow = [WARM] + [1.0] * 20
    assert _steps_to_rounds(4, 20, [fast, fast, fast, slow], quorum=4) == {
        0: [],
        1: [],
        2: [],
        3: [(3, 5), (8, 4)],
    }
    assert _steps_to_rounds(4, 20, [fast, fast, fast, slow]) == {0: [], 1: [], 2: [], 3: [(3, 5)]}


def test_at_k_equals_m_identical_islands_keep_h() -> None:
    """The room changes only the round a change sets, never whether a reading changes it:
    identical islands at K = M with island-3 reading 1.3125x (0.328125 s: target floor(20 /
    1.3125) = floor(15.24) = 15, inside H's band down to 13.29, where floor(15.24 x 0.9) = 13
    would be beyond it) keep H; its steps read as they are (its probe and reports their
    mean)."""
    fast = [WARM] + [FAST] * 80
    noisy = [WARM] + [0.328125] * 64
    assert _steps_to_rounds(4, 20, [fast, fast, fast, noisy], quorum=4) == {
        0: [],
        1: [],
        2: [],
        3: [],
    }


def test_at_k_equals_m_a_slow_island_that_slows_further_is_cut_at_one_reading() -> None:
    """1,1,1,3 at H = 20, K = M = 4; island-3's steps 2, 3 take 0.75 s (3x), then 0.875 s
    (3.5x). Its probe (0.75 s at 2.5 s) has target floor(20 x 0.25 / 0.75) = 6 <= 10: cut at
    step 3 to sized floor(6.67 x 0.9) = 6, one reading shorter left pending. Its first regular
    reading, at its first heartbeat 20 x 0.25 = 5 s after the probe (its steps end at 2.5 +
    0.875 (k - 3): step 9, 7.75 s), reads 0.875 s (its mean of steps 4-9): 20 x 0.25 / 0.875 =
    5.71, target 5, inside 6's band (down to 3.29) but below it, late at K = M: with the
    pending one, two readings, cut to sized floor(5.71 x 0.9) = 5 at step 9. Later readings
    (target 5) leave 5. At K = 1 the band keeps 6."""
    fast = [WARM] + [FAST] * 80
    slower = [WARM, SLOW, SLOW] + [0.875] * 20
    lock_step = _steps_to_rounds(4, 20, [fast, fast, fast, slower], quorum=4)
    assert lock_step == {0: [], 1: [], 2: [], 3: [(3, 6), (9, 5)]}
    assert _steps_to_rounds(4, 20, [fast, fast, fast, slower]) == {0: [], 1: [], 2: [], 3: [(3, 6)]}


def test_a_second_probe_in_the_band_clears_the_first() -> None:
    """Identical islands at H = 20; island-3's steps 2-3 slow (0.375 s), then 0.25 s. Its probe
    (0.375 s at 1.75 s, every island reporting) has target floor(20 x 0.25 / 0.375) = 13, beyond
    the band (below 13.29), not half: one reading pending. Its second probe (steps 4-5, 0.25 s,
    at 2.25 s) has target 20, in the band: nothing pending, no cut, then or later."""
    fast = [WARM] + [FAST] * 80
    noisy = [WARM, 0.375, 0.375] + [FAST] * 78
    assert _steps_to_rounds(4, 20, [fast, fast, fast, noisy], quorum=4) == {
        0: [],
        1: [],
        2: [],
        3: [],
    }


def test_a_slow_island_that_reports_before_its_peers_is_read_at_its_second_probe() -> None:
    """1,1,1,3 at H = 20; the fast islands start late (their step 1 ends at 3 s), island-3
    first (1 s). Its probe (0.75 s) at 2.5 s finds 1 claim, its own: no reading, but in a job
    of four not the clock's start either: its next report from its reported position 2 + 2 = 4
    on is read as its first. Step 4 (3.25 s, position 3): not yet. Step 5 (4 s): its second
    probe (steps 4-5, 0.75 s); the fast islands' steps end at 3 + 0.25 (k - 1), their probe at
    3.5 s, their step 5 at 4 s (their second probe, 0.25 s, read before island-3's): 4 of 4
    claims, t_ref 0.25, target 6 <= 10: taken at once, cut to 6 at step 5, in place. Before
    (the probe starting its clock), two regular readings cut it at step 17, after a first
    round at H under load."""
    fast = [3.0] + [FAST] * 80
    slow = [WARM] + [SLOW] * 27
    assert _steps_to_rounds(4, 20, [fast, fast, fast, slow]) == {0: [], 1: [], 2: [], 3: [(5, 6)]}
    # in a job of two the probe before its peer's report starts its clock as before: two
    # regular readings (10 x 0.25 = 2.5 s apart, from 2.5 s: steps 7 and 11) cut it to 3
    assert _steps_to_rounds(2, 10, [[3.0] + [FAST] * 60, slow]) == {0: [], 1: [(11, 3)]}


def _job_of_four(inner_steps: int, quorum: int = 1) -> tuple[RoundSizes, list[IslandRecord]]:
    spec = parse_spec(
        {
            "inner": {"steps": inner_steps, "stepsPerIsland": "auto"},
            "islands": {"count": 4},
            "sync": {"quorum": quorum},
        }
    )
    recs = _islands([0.0] * 4)
    for rec in recs:
        rec.step_time = None
    return RoundSizes(spec), recs


def _report(
    sizes: RoundSizes, recs: list[IslandRecord], i: int, t: float, step: int, now: float
) -> int:
    recs[i].step_time, recs[i].reported_step = t, step
    sizes.read(recs[i], recs, now)
    return sizes.steps_of(recs[i], recs[i].name)


def test_at_k_equals_m_a_slow_islands_noisy_readings_do_not_oscillate() -> None:
    """1,1,1,3 at H = 20 (floor 3), K = M = 4, the fast islands at 1.0 s; island-3's readings
    (its step time over t_ref = 1.0, one per 20 s) spread over 3.6-4.8x, as a 3x island's did
    at a load of 12 (bench/hetero: H_i 20, 6, 4, 3, 5, 3 within 30 s).
    - 3.3 (probe, 4 claims): target floor(20 / 3.3) = 6 <= 10: cut to 6, pending -1, anchor 3.3.
    - 4.1: target 4 in 6's band, but sized floor(18 / 4.1) = 4 < 6 is late at K = M: with the
      pending one two readings, cut to 4 (anchor 4.1; a move down at K = M starts no cooldown,
      eager_down, and this is not the round's first move: nothing left pending).
    - 4.8 x 3: sized floor(18 / 4.8) = 3 < 4, late: pending -1, -2: taken at the second, 3,
      anchor 4.8 (before eager_down at the third, after the cooldown's three readings).
    - 3.6 x 3: target floor(20 / 3.6) = 5, beyond 3's band (above 4.2), sized floor(5.0) = 5.
      Before: taken at the third, 5; then 4.8 x 3 late again (sized 3 < 5): 3; then 5 again.
      Now 3.6 x 1.4 = 5.04 > 4.8: not faster than the reading that set 3 beyond the band,
      no reading for a longer round; 4.8 (target 4, sized 3) leaves 3.
    - 3.0 x 2: target 6, but a reading for a longer round is judged at the slowest of the
      island's last five regular readings (core/island_rounds.judged_ratio; the probe and the
      4.1, its check, are read alone): 3.6 of [3.6 x 3, 3.0 x 2], target 5, not outgrown of
      4.8. Before hetero18 the second 3.0 took it to 6.
    - 3.0 x 4 more (a real speed-up, 3.0 x 1.4 = 4.2 <= 4.8): the slowest of the last five is
      3.6 until the fifth 3.0 in a row; then target 6, sized floor(6.67 x 0.9) = 6, one pending,
      and the sixth 3.0 takes it: 6."""
    sizes, recs = _job_of_four(20, quorum=4)
    for i in range(3):
        recs[i].step_time = 1.0
    slow = recs[3]
    sizes.joined(slow)
    readings = [3.3, 4.1, 4.8, 4.8, 4.8, 3.6, 3.6, 3.6, 4.8, 4.8, 4.8, 3.6, 3.6, 3.6]
    readings += [3.0] * 6
    schedule = [
        _report(sizes, recs, 3, r, 2 + 20 * k, now=20.0 * k) for k, r in enumerate(readings)
    ]
    assert schedule == [6, 4, 4, 3, *[3] * 15, 6]


def test_at_k_equals_m_a_cpu_island_keeps_the_round_of_its_slow_spells() -> None:
    """A job of two at K = M = 2, H = 50 (floor 7), the fast island at 1.0 s (the reference:
    the fastest of two claims); a CPU island whose step time follows its host's load, read once
    a reference round (50 s), as hetero17's did (1.2-4.5x).
    - 3.0 (its first report: a job of two's probe is no reading, it starts the clock).
    - 3.0, 3.0: target floor(50 / 3) = 16, below 50's band (50 / 1.4 - 1 = 34.7), twice: cut
      to the sized round floor(16.67 x 0.9) = 15 (anchor 3.0; its first move by a reading at
      K = M: one reading down left pending, eager_down).
    - 1.2, 1.2 (a quiet second or two): target 41. Judged one at a time (before hetero18) that
      is beyond 15's band (up to 21) and outgrown of 3.0 (1.2 x 1.4 <= 3.0), and the second
      took it to sized floor(41.67 x 0.9) = 37; the next 3.0, 3.0 (target 16, sized 15 < 37,
      late) took it back to 15: two moves for nothing, and the fast island waited for each
      37-step round that the load caught. Now a reading for a longer round is judged at the
      slowest of the last five: 3.0 (of [3.0, 3.0, 1.2] and [3.0, 3.0, 1.2, 1.2]), target 16,
      within 15's band: it stays 15, and 3.0, 3.0 leave it there.
    - 1.2 x 6 (a real speed-up): the last five hold a 3.0 until the fifth 1.2 in a row; then
      the slowest is 1.2: target 41, sized 37, one pending, and the sixth takes it: 37."""
    spec = parse_spec(
        {
            "inner": {"steps": 50, "stepsPerIsland": "auto"},
            "islands": {"count": 2},
            "sync": {"quorum": 2},
        }
    )
    sizes = RoundSizes(spec)
    recs = _islands([1.0, 3.0])
    for rec in recs:
        sizes.joined(rec)
    readings = [3.0, 3.0, 3.0, 1.2, 1.2, 3.0, 3.0, *[1.2] * 6]
    schedule = [
        _report(sizes, recs, 1, r, 2 + 50 * k, now=50.0 * k) for k, r in enumerate(readings)
    ]
    assert schedule == [50, 50, 15, 15, 15, 15, 15, *[15] * 5, 37]


def test_at_k_below_m_a_round_follows_the_median_of_the_last_five_readings() -> None:
    """The same job at K = 1 (no room, no eager moves down; a change needs two readings in a
    row beyond the band and three since the last, core/island_rounds.next_round) and the same
    CPU island; a regular reading is judged at the lower median of its last five.
    - 3.0 (its clock starts), then 3.0, 3.0: [3.0] and [3.0, 3.0] read 3.0, target 16, below
      50's band twice: 16 (anchor 3.0; the cooldown starts). 3.0 x 3 more: in the band.
    - 1.2, 1.2 (a quiet spell): [3.0 x 4, 1.2] and [3.0 x 3, 1.2 x 2] read 3.0: it stays 16.
      Read one at a time (before hetero18) they were target 41, beyond 16's band and outgrown
      of 3.0, past the cooldown: 41 at the second; then 3.0 x 3 took it back to 16 at the
      third (the cooldown): 50 50 16 16 16 16 16 41 41 41 16.
    - 3.0 x 3: [3.0 x 2, 1.2 x 2, 3.0] and on read 3.0: 16.
    - 6.0 x 4 (a lasting slowdown): [1.2, 3.0 x 3, 6.0] and [3.0 x 3, 6.0 x 2] read 3.0;
      [3.0 x 2, 6.0 x 3] reads 6.0, target floor(50 / 6) = 8, below 16's band (16 / 1.4 - 1 =
      10.4): one pending; the fourth 6.0 takes it: 8 (one at a time: at the third, 8)."""
    spec = parse_spec(
        {
            "inner": {"steps": 50, "stepsPerIsland": "auto"},
            "islands": {"count": 2},
            "sync": {"quorum": 1},
        }
    )
    sizes = RoundSizes(spec)
    recs = _islands([1.0, 3.0])
    for rec in recs:
        sizes.joined(rec)
    readings = [*[3.0] * 6, 1.2, 1.2, 3.0, 3.0, 3.0, *[6.0] * 4]
    schedule = [
        _report(sizes, recs, 1, r, 2 + 50 * k, now=50.0 * k) for k, r in enumerate(readings)
    ]
    assert schedule == [50, 50, *[16] * 12, 8]


def _k4(inner_steps: int = 10) -> RoundSizes:
    return RoundSizes(
        parse_spec(
            {
                "inner": {"steps": inner_steps, "stepsPerIsland": "auto"},
                "islands": {"count": 4},
                "sync": {"quorum": 4},
            }
        )
    )


def _beat(rec: IslandRecord, step: int, step_time: float, now: float) -> None:
    """What membership.heartbeat keeps of a report (its step, when it changed, the time)."""
    if step != rec.reported_step:
        rec.reported_since = now
    rec.reported_step, rec.reported_at, rec.step_time = step, now, step_time


def test_a_late_identical_islands_probe_waits_for_peers_aged_past_its_join() -> None:
    """Issue 47's failure (tests/e2e/test_identical_rounds.py, the same schedule at 1/100 of
    the time): 4 identical islands, K = 4, H = 10. island-0 and island-2 probe (step 3) at 0.05
    and 0.0625 s with the cores to themselves; island-1 joins at 1.0 s (marks: 3, 3; island-3 no
    step time: None), probes 0.125 s at 1.3 s; island-3 (joined at 1.1 s) 0.0875 s at 1.35 s.

    Joined without its peers (the rule before), island-1's probe is judged against every
    report: lower median of 0.05, 0.0625, 0.125 = 0.0625, target 5, 3 of 4 reported: one reading
    pending; its second probe at 1.5 s (0.1125) against 0.05, 0.0625, 0.0875, 0.1125 -> 0.0625,
    target 5 beyond the band (below 6.14): cut to floor(0.9 x 5.56) = 5.

    Joined with its peers (the service's join): island-0's and island-2's reports predate the
    join (marks 3, no step since): not aged; its reports wait unread while 1.3 - 1.0 and 1.5 -
    1.0 s are under the reference round 10 x 0.0625 = 0.625 s. At 1.6 s both peers have stepped
    10 steps past their marks (step 13, 0.1 and 0.1125 s: the load since the join): t_ref =
    lower median of 0.1125, 0.1, 0.1125, 0.0875 = 0.1, target floor(10 x 0.1 / 0.1125) = 8,
    inside the band: H."""
    for production in (False, True):
        sizes = _k4()
        recs = [IslandRecord(name=f"island-{i}") for i in range(4)]
        late = recs[1]
        sizes.joined(recs[0], recs, now=0.0)
        sizes.joined(recs[2], recs, now=0.1)
        _beat(recs[0], 3, 0.05, 0.3)
        _beat(recs[2], 3, 0.0625, 0.4)
        sizes.joined(late, recs, now=1.0) if production else sizes.joined(late)
        sizes.joined(recs[3], recs, now=1.1)
        _beat(late, 3, 0.125, 1.3)
        sizes.read(late, recs, 1.3)
        _beat(recs[3], 3, 0.0875, 1.35)
        _beat(late, 5, 0.1125, 1.5)
        sizes.read(late, recs, 1.5)
        if not production:
            assert sizes.steps_of(late, late.name) == 5
            continue
        assert late.round is not None and late.round.fresh and late.round_read_at is None
        assert sizes.steps_of(late, late.name) == 10
        _beat(recs[0], 13, 0.1, 1.55)
        _beat(recs[2], 13, 0.1125, 1.56)
        _beat(late, 6, 0.1125, 1.6)
        sizes.read(late, recs, 1.6)
        assert not late.round.fresh and late.round.pending == 0
        assert sizes.steps_of(late, late.name) == 10


def _joins_after_three_probes(sizes: RoundSizes) -> tuple[list[IslandRecord], IslandRecord]:
    """Three islands join at 0 s and probe (0.05 s a step, at marks 3, reported at 0.5 s); the
    fourth joins at 1.0 s, before any of them has aged past its join. The records and the fourth."""
    recs = [IslandRecord(name=f"island-{i}") for i in range(4)]
    for i in range(3):
        sizes.joined(recs[i], recs, now=0.0)
        _beat(recs[i], 3, 0.05, 0.5)
    sizes.joined(recs[3], recs, now=1.0)
    return recs, recs[3]


def test_a_fresh_islands_reports_are_read_a_reference_round_after_its_join_at_the_latest() -> None:
    """Peers that neither step nor report again (a heartbeat every 5 s, say) hold a fresh island's
    first reading back at most a reference round: island-3 joins at 1.0 s beside three peers
    whose probes (0.05 s, marks 3) are not aged; its probe (0.15 s) at 1.2 s waits (0.2 s < 10 x
    0.05); at 1.6 s, 0.6 s after the join, it is read against the aged claims alone: its own,
    1 claim, fewer than three: no reading; in a job of four its report at step 5 + 2 = 7 is read
    as its first (confirm_at) rather than a reference round on."""
    sizes = _k4()
    recs, slow = _joins_after_three_probes(sizes)
    _beat(slow, 3, 0.15, 1.2)
    sizes.read(slow, recs, 1.2)
    assert slow.round is not None and slow.round.fresh and slow.round.confirm_at is None
    _beat(slow, 5, 0.15, 1.6)
    sizes.read(slow, recs, 1.6)
    assert slow.round.fresh and slow.round.confirm_at == 7 and slow.round_read_at is None
    # its peers wait at their round's end (step 10: a report at a new step, then the same step
    # again, idle) and it reports from step 7: t_ref = lower median of 0.05 x 3, 0.15 = 0.05,
    # target floor(10 x 0.05 / 0.15) = 3 <= 5, all four reporting: cut to 3 at once
    for i in range(3):
        _beat(recs[i], 10, 0.05, 1.7)
        _beat(recs[i], 10, 0.05, 1.8)
    _beat(slow, 7, 0.15, 1.9)
    sizes.read(slow, recs, 1.9)
    assert sizes.steps_of(slow, slow.name) == 3


def test_a_slow_island_joining_last_at_k_equal_m_is_cut_at_its_probe_against_idle_peers() -> None:
    """1,1,1,3 at K = M, H = 10: the fast islands ran their first round and wait at its end
    (step 10) for the slow island's push; they report step 10 again after its join (idle):
    their 0.05 s count at once. Its probe (0.15 s, step 3): t_ref = lower median of 0.05 x 3,
    0.15 = 0.05, target floor(10 / 3) = 3 <= 5 with 4 of 4 reporting: cut to 3 at its probe (the
    rule of last session that counted only peers whose readings began after the join left it at
    H: bench/log/2026-11-29.md, "hetero — 2026-11-29 15:44 UTC")."""
    sizes = _k4()
    recs = [IslandRecord(name=f"island-{i}") for i in range(4)]
    for i in range(3):
        sizes.joined(recs[i], recs, now=0.0)
        _beat(recs[i], 3, 0.05, 0.2)
        _beat(recs[i], 10, 0.05, 0.6)
    slow = recs[3]
    sizes.joined(slow, recs, now=1.0)
    for i in range(3):
        _beat(recs[i], 10, 0.05, 1.1)
    _beat(slow, 3, 0.15, 1.2)
    sizes.read(slow, recs, 1.2)
    assert sizes.steps_of(slow, slow.name) == 3


def test_at_k_equal_m_a_clear_slowdown_is_read_without_waiting_for_peers_to_age() -> None:
    """core/island_rounds.clear_of_join_load: the schedule above (island-3 joins at 1.0 s beside
    three peers whose probes, 0.05 s at marks 3, are not aged; its probe at 1.2 s). At 0.2 s it
    reads 4x the lower median of every claim (0.05, 0.05, 0.05, 0.2 -> 0.05): read at once at
    K = M, target floor(10 x 0.05 / 0.2) = 2 (the floor, ceil(10 / 8) = 2) <= 5 with 4 of 4
    reporting: cut to 2 at its probe. At 0.195 s (3.9x) it waits as before (the 3x island above
    waits too); at K = 1 (no room) a 4x report waits as well."""
    for step_time, quorum, expected in ((0.2, 4, 2), (0.195, 4, 10), (0.2, 1, 10)):
        sizes = RoundSizes(
            parse_spec(
                {
                    "inner": {"steps": 10, "stepsPerIsland": "auto"},
                    "islands": {"count": 4},
                    "sync": {"quorum": quorum},
                }
            )
        )
        recs, slow = _joins_after_three_probes(sizes)
        _beat(slow, 3, step_time, 1.2)
        sizes.read(slow, recs, 1.2)
        assert sizes.steps_of(slow, slow.name) == expected, (step_time, quorum)
        assert slow.round is not None and slow.round.fresh == (expected == 10)


def test_a_cut_whose_check_read_slow_goes_back_on_later_readings_within_hs_band() -> None:
    """probe13's "left" (issue 45): as above, but island-3's start-up load lasts through its
    check: steps 2-15 at 0.375 s (1.5x; step 15 ends at 1 + 14 x 0.375 = 6.25 s), then
    0.28125 s (1.125x, within H's band). Probe and second probe 1.5x: cut at step 5 to 20
    (K = 1) / 18 (K = M), anchor 1.5, the round cut (30) kept. Its check (steps 6-15, 0.375 s,
    read at step 15, 6.25 s): target floor(30 / 1.5) = 20, below 30's band (down to min(29,
    30 / 1.4 - 1) = 20.43): not restored; a regular reading that moves nothing. Regular readings
    come a reference round (30 x 0.25 = 7.5 s) after the last: at the first heartbeat past
    13.75 s, step 42 (6.25 + 27 x 0.28125 = 13.84 s), and past 21.34 s, step 69 (6.25 + 54 x
    0.28125 = 21.44 s). The report is then the EMA (0.1) of its steps since the probe, 0.28125 +
    0.09375 x 0.9^27 = 0.2867 s at step 42 (ratio 1.147, target floor(26.16) = 26) and ~0.2813 s
    at 69 (target 26): within 30's band, and at K = 1 within 20's own (up to 28) too. On main
    neither moved it (a move up had to outgrow the probe's 1.5x: 1.5 / 1.4 = 1.071x at most,
    and at K = 1 the band of 20 held it): it kept 20 / 18 of 30 for good. Now two readings in a
    row within 30's band (restores_cut) send it back at step 69, to 30, the round cut, not to
    their own target (26); later readings (target 26) keep 30."""
    fast = [WARM] + [FAST] * 200
    joined = [WARM] + [1.5 * FAST] * 14 + [0.28125] * 160
    for quorum, cut in ((1, 20), (4, 18)):
        changes = _steps_to_rounds(4, 30, [fast, fast, fast, joined], quorum=quorum)
        assert changes == {0: [], 1: [], 2: [], 3: [(5, cut), (69, 30)]}


def test_a_slow_island_cut_at_its_probe_stays_cut_on_readings_beyond_hs_band() -> None:
    """The rule's other side: island-3 runs at 0.375 s (1.5x) for good. Probe, second probe and
    check 1.5x: cut at step 5 as above; every later reading reads 1.5x (target 20, below 30's
    band down to 20.43): it keeps its cut round at K = 1 and K = M."""
    fast = [WARM] + [FAST] * 200
    slow = [WARM] + [1.5 * FAST] * 140
    for quorum, cut in ((1, 20), (4, 18)):
        changes = _steps_to_rounds(4, 30, [fast, fast, fast, slow], quorum=quorum)
        assert changes == {0: [], 1: [], 2: [], 3: [(5, cut)]}


def test_a_reading_that_restores_a_probes_cut_is_read_alone_not_with_the_last_five() -> None:
    """K = 1, H = 30, four islands, the fast three at 1.0 s. Island-3:
    - 2.0 (its probe, all four reporting): target 15 <= half of 30: cut to 15, the round cut
      (30) kept, its check 12 steps on.
    - 2.0 (its check: target 15, within 15's band, not within 30's, down to 20.43): stays.
    - 2.0, 2.0 (regular readings; the last five [2.0] and [2.0, 2.0]): stays.
    - 1.1, 1.1: target 27, within 30's band (restores_cut): read alone, as before the last five
      (the lower median of [2.0, 2.0, 1.1] is 2.0, target 15, which would hold the cut a
      reading longer): one pending, then back to 30, the round cut."""
    sizes, recs = _job_of_four(30, quorum=1)
    for i in range(3):
        recs[i].step_time = 1.0
    sizes.joined(recs[3])
    readings = [2.0, 2.0, 2.0, 2.0, 1.1, 1.1, 1.1]
    schedule = [
        _report(sizes, recs, 3, r, 2 + 20 * k, now=30.0 * k) for k, r in enumerate(readings)
    ]
    assert schedule == [15, 15, 15, 15, 15, 30, 30]
