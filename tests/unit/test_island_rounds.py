"""Each island's round sized to its speed (core/island_rounds.py): the reference step time, the
target H_i, the hysteresis, and what the spec fixes. Every expected value is derived by hand in
the comment beside it."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from diloco_trainer.api.spec import ConfigError, parse_spec
from diloco_trainer.core.island_rounds import (
    AGE_STEPS,
    CHECK_STEPS,
    JOIN_LOAD_RATIO,
    RECENT_READINGS,
    IslandRound,
    RoundLimits,
    StepTimeReport,
    aged_past_join,
    check_restores,
    check_round,
    clear_of_join_load,
    eager_down,
    first_reading_now,
    in_band,
    judged_ratio,
    late_is_beyond,
    next_round,
    outgrown,
    probe_moves,
    probe_readings,
    probe_step_time,
    reference_step_time,
    remembered,
    report_weight,
    restores_cut,
    sized_steps,
    split_budget,
    target_steps,
)


def test_reference_is_the_lower_median_of_three_or_more_claims() -> None:
    assert reference_step_time([1.0, 1.0, 1.0, 3.0]) == 1.0  # sorted 1,1,1,3: lower median 1
    assert reference_step_time([4.0, 2.0, 1.0, 1.0]) == 1.0  # sorted 1,1,2,4: lower median 1
    assert reference_step_time([1.0, 2.0, 3.0]) == 2.0  # odd count: the median itself
    # a liar claiming a tiny step time moves it only to the next honest claim
    assert reference_step_time([1e-6, 1.0, 1.0, 3.0]) == 1.0
    assert reference_step_time([1e-6, 1.0, 2.0, 4.0]) == 1.0
    # so does a liar claiming a huge one
    assert reference_step_time([1.0, 1.0, 3.0, 86400.0]) == 1.0


def test_reference_with_fewer_than_three_claims_is_the_fastest() -> None:
    assert reference_step_time([1.0, 3.0]) == 1.0
    assert reference_step_time([2.0]) == 2.0
    # zero, negative and non-finite claims are no claims
    assert reference_step_time([0.0, -1.0, math.nan, math.inf, 2.0]) == 2.0
    assert reference_step_time([]) is None


def test_target_steps_hand_derived() -> None:
    # H = 30, t_ref = 1 s: T = 30 s
    def h(own: float | None, reference: float | None = 1.0) -> int:
        return target_steps(inner_steps=30, reference=reference, own=own, floor=4, ceiling=30)

    assert h(1.0) == 30  # 30 / 1
    assert h(3.0) == 10  # 30 / 3
    assert h(2.0) == 15
    assert h(4.0) == 7  # 7.5 rounded down: its round ends before the reference's
    assert h(2.9) == 10  # 10.34 rounded down
    assert h(0.5) == 30  # 60, capped at the ceiling H
    assert h(100.0) == 4  # 0.3 rounded down is 0: the floor
    assert h(None) == 30  # no reading yet: H
    assert h(3.0, reference=None) == 30
    assert target_steps(inner_steps=30, reference=1.0, own=0.5, floor=4, ceiling=45) == 45
    with pytest.raises(ValueError):
        target_steps(inner_steps=30, reference=1.0, own=1.0, floor=0, ceiling=30)


def _schedule(start: int, targets: list[int], *, probe: bool = False) -> list[int]:
    """H_i after each reading of `targets`; with `probe`, the first is a probe (confirmed)."""
    state = IslandRound(start)
    out = []
    for i, target in enumerate(targets):
        state = next_round(state, target, confirmed=probe and i == 0)
        out.append(state.steps)
    return out


def test_a_mid_job_slowdown_shrinks_the_round_after_two_readings() -> None:
    # H = 30; the island's node is replaced by one 3x slower before its third reading: targets
    # 30, 30, then 10. Reading 3 is the first beyond the band (20.4..42, pending -1), reading
    # 4 confirms it (pending -2, a fresh island has no cooldown): H_i = 10 from reading 4 on.
    assert _schedule(30, [30, 30, 10, 10, 10, 10]) == [30, 30, 30, 10, 10, 10]


def test_no_single_reading_moves_a_round_not_even_the_first() -> None:
    # a fresh island (no reading yet) 3x slower: its first regular reading's target 10 is one
    # reading (pending -1), the second confirms it (issue 47: island-0 of the FSDP job of two
    # was cut to 5 of 10 on its first regular reading alone)
    assert _schedule(30, [10, 10, 10]) == [30, 10, 10]
    # one reading beyond the band between readings within it: never a change
    assert _schedule(30, [10, 30, 30]) == [30, 30, 30]
    # a probe is two readings (confirmed: both its steps that slow): taken at once; it starts
    # no cooldown (since_change stays at COOLDOWN_READINGS = 3) and leaves one reading shorter
    # pending (-1)
    assert next_round(IslandRound(30), 10, confirmed=True) == IslandRound(10, -1, 3, fresh=False)
    # ... unless within the band, or within the cooldown of a change
    assert next_round(IslandRound(30), 25, confirmed=True).steps == 30
    assert next_round(IslandRound(10, since_change=0), 4, confirmed=True).steps == 10


def test_one_step_is_never_a_change() -> None:
    # at 3 steps a round, 4 is 33% away but only one step: noise, never taken
    assert _schedule(3, [4, 4, 4, 2, 2, 4]) == [3] * 6
    # two steps are: from 3 to 5 on the second reading
    assert _schedule(3, [5, 5]) == [3, 5]


def test_a_recovery_waits_for_the_cooldown() -> None:
    # Readings 1, 2 at target 10 set 10 at reading 2 (since 0). Speed back at reading 4:
    # targets 30 at readings 4, 5 are confirmed by reading 5 (since 3 >= 3): H_i = 30 from
    # reading 5. Had it come back at reading 3, reading 4 would confirm it only 2 readings after
    # the change, and reading 5 is the first one the cooldown allows.
    assert _schedule(30, [10, 10, 10, 30, 30, 30, 30]) == [30, 10, 10, 10, 30, 30, 30]
    assert _schedule(30, [10, 10, 30, 30, 30, 30]) == [30, 10, 10, 10, 30, 30]


def test_a_probes_cut_goes_back_at_two_contrary_readings() -> None:
    # the probe (reading 1, confirmed) sets 10 with no cooldown: readings 2, 3 at target 30
    # take it back at reading 3 (two in a row; since 2 < 3 would have held it after a regular
    # change)
    assert _schedule(30, [10, 30, 30, 30], probe=True) == [10, 10, 30, 30]
    # a genuinely slow island's readings agree with its probe: it stays
    assert _schedule(30, [10, 10, 11, 9, 10], probe=True) == [10] * 5


def test_a_probes_cut_is_sized_further_by_one_regular_reading() -> None:
    # the probe cut 30 to 10 (the faster of two steps under-reads a slow island); the first
    # regular reading, target 5, is beyond 10's band (below min(9, 10 / 1.4 - 1 = 6.14)) in the
    # probe's direction: with the probe's pending -1 it is the second reading, taken at once
    assert _schedule(30, [10, 5, 5, 5], probe=True) == [10, 5, 5, 5]
    # after that regular change the cooldown holds again: a way back needs since >= 3
    assert _schedule(30, [10, 5, 10, 10, 10], probe=True) == [10, 5, 5, 5, 10]
    # a regular change leaves nothing pending and starts the cooldown: 10 at reading 2 (since
    # 0), target 5 at readings 3, 4 (pending -2 at since 2 < 3), taken at reading 5
    assert _schedule(30, [10, 10, 5, 5, 5, 5]) == [30, 10, 10, 10, 5, 5]


def test_no_oscillation_under_noise_or_alternating_readings() -> None:
    # within the band of 30 (30 / 1.4 - 1 = 20.4 .. 30 x 1.4 = 42): never a change
    assert _schedule(30, [26, 34, 35, 25, 36, 24, 30]) == [30] * 7
    # after a first reading within the band: a reading beyond it between two within it resets the
    # count each time, never confirmed
    assert _schedule(30, [30, 10, 30, 10, 30, 10, 30, 10]) == [30] * 8
    # beyond it on both sides in turn: the direction flips, never two in a row the same way
    assert _schedule(30, [30, 10, 50, 10, 50, 10, 50]) == [30] * 7


def test_limits_from_the_spec() -> None:
    spec = parse_spec(
        {
            "inner": {"steps": 30, "stepsPerIsland": "auto"},
            "islands": {"count": 4, "overrides": [{"islands": [2], "innerSteps": 12}]},
        }
    )
    limits = RoundLimits.from_spec(spec)
    assert (limits.floor, limits.ceiling) == (4, 30)  # ceil(30 / 8) = 4, H
    assert limits.steps_of(2, IslandRound(20)) == 12  # pinned wins
    assert limits.steps_of(1, IslandRound(20)) == 20  # measured
    assert limits.steps_of(1, None) == 30  # no reading yet
    assert limits.most_steps() == 30
    fixed = RoundLimits.from_spec(parse_spec({"inner": {"steps": 30, "stepsPerIsland": "fixed"}}))
    assert fixed.steps_of(1, IslandRound(10)) == 30  # stepsPerIsland fixed: always H
    default = RoundLimits.from_spec(parse_spec({"inner": {"steps": 30}}))
    assert default.auto and default.steps_of(1, IslandRound(10)) == 10  # auto by default
    wide = RoundLimits.from_spec(
        parse_spec({"inner": {"steps": 30, "minSteps": 10, "maxSteps": 60}})
    )
    assert (wide.floor, wide.ceiling, wide.most_steps()) == (10, 60, 60)


@pytest.mark.parametrize(
    ("inner", "field"),
    [
        ({"steps": 30, "minSteps": 31}, "inner.minSteps"),
        ({"steps": 30, "maxSteps": 29}, "inner.maxSteps"),
        ({"steps": 30, "stepsPerIsland": "fast"}, "spec.inner.stepsPerIsland"),
    ],
)
def test_bad_limits_name_the_field(inner: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parse_spec({"inner": inner})


def test_a_bad_pin_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"spec\.islands\.overrides\.0\.innerSteps"):
        parse_spec({"islands": {"overrides": [{"islands": [0], "innerSteps": 0}]}})


def test_adopt_round_only_at_a_round_boundary() -> None:
    from diloco_trainer.learner.step_plan import adopt_round

    assert adopt_round(30, 30, 10) == 10  # round 1's end: 1 x 10
    assert adopt_round(90, 30, 10) == 30  # round 3's end: 3 x 10
    assert adopt_round(40, 10, 30) == 120  # longer again: round 4's end, 4 x 30
    assert adopt_round(45, 30, 10) is None  # mid-round
    assert adopt_round(0, 30, 10) == 0  # a fresh job's first round: at once, in place
    assert adopt_round(9, 30, 10) == 9  # still below H_i
    # at or past it: back to H_i - 1 = 9, so the next step, 10, is fragment 0's first sync point
    # (in place, fragment 1's at 15 would come before fragment 0's at 20)
    assert adopt_round(10, 30, 10) == 9
    assert adopt_round(15, 30, 10) == 9
    assert adopt_round(29, 30, 10) == 9
    assert adopt_round(5, 20, 3) == 2  # a 4x island's probe answered at its step 5: push at 3
    assert adopt_round(4, 20, 1) == 0  # H_i 1: the next step, 1, pushes
    assert adopt_round(30, 30, 10) == 10  # the first round's end is a boundary (above)
    assert adopt_round(15, 30, 40) == 15  # a longer round: below it
    assert adopt_round(60, 30, 30) is None  # no change
    assert adopt_round(60, 30, None) is None  # the syncer named none


def test_probe_step_time_is_the_mean_capped_at_the_band_above_the_faster_step() -> None:
    # WARMUP_STEPS = 1, PROBE_STEPS = 2: the mean of steps 2 and 3, at most 1.4 x the faster
    assert probe_step_time([]) is None
    assert probe_step_time([5.0, 1.0]) is None
    assert probe_step_time([5.0, 1.0, 1.2]) == pytest.approx(1.1)  # the mean (cap 1.4)
    assert probe_step_time([5.0, 3.0, 2.5, 9.0]) == pytest.approx(2.75)  # the mean (cap 3.5)
    # one noisy step (6x) beside a normal one: the mean 3.5 is capped at 1.4 x 1.0, so against
    # a reference of 1.0 its target is within the band, far from halving the round
    assert probe_step_time([5.0, 6.0, 1.0]) == pytest.approx(1.4)
    assert target_steps(inner_steps=20, reference=1.0, own=1.4, floor=3, ceiling=20) == 14
    assert in_band(20, 14)


def test_step_time_report_probes_then_averages_the_steps_after_it() -> None:
    report = StepTimeReport()
    assert report.add(5.0) is False and report.value is None  # warm-up
    assert report.add(1.0) is False and report.value is None
    assert report.add(2.0) is True and report.value == 1.4  # the probe: min(1.5, 1.4 x 1.0)
    # after it: the mean of the steps since the probe (the probe left out) ...
    assert report.add(2.5) is False and report.value == pytest.approx(2.5)
    report.add(1.5)
    assert report.value == pytest.approx(2.0)  # (2.5 + 1.5) / 2
    for _ in range(8):
        report.add(2.0)
    assert report.value == pytest.approx(2.0)  # the mean of ten steps of 2 on average
    # ... an EMA from the tenth step on: weight max(1/11, 0.1) = 0.1
    report.add(3.0)
    assert report.value == pytest.approx(0.9 * 2.0 + 0.1 * 3.0)  # 2.1
    assert report_weight(1) == 1.0 and report_weight(4) == 0.25
    assert report_weight(10) == pytest.approx(0.1) and report_weight(50) == pytest.approx(0.1)


def test_first_reading_now_needs_every_active_islands_report() -> None:
    assert first_reading_now(fresh=True, reported=4, active=4) is True
    assert first_reading_now(fresh=True, reported=3, active=4) is False
    assert first_reading_now(fresh=False, reported=4, active=4) is False  # a rejoin
    assert first_reading_now(fresh=True, reported=0, active=0) is False


def test_a_probe_moves_a_round_only_when_it_at_least_halves_it() -> None:
    # PROBE_MOVE_SHARE = 0.5 of a round of 20: targets up to 10, with 3 or more claims
    assert probe_moves(20, 6, claims=4) is True  # 3x slower: 20 / 3 -> 6
    assert probe_moves(20, 10, claims=3) is True  # exactly half
    assert probe_moves(20, 11, claims=4) is False  # 1.8x: the regular readings decide
    assert probe_moves(20, 20, claims=4) is False  # as fast as the reference


def test_in_a_job_of_two_a_probe_never_acts() -> None:
    # two claims: the reference is the other island's own probe (the faster claim); even a
    # target at the floor waits for the regular readings
    assert probe_moves(10, 2, claims=2) is False
    assert probe_moves(20, 6, claims=2) is False
    assert probe_moves(20, 6, claims=1) is False


def test_band_is_forty_percent_of_step_time_less_the_rounding_step() -> None:
    # H_i = 20: low = min(19, 20 / 1.4 - 1 = 13.29), high = max(21, 20 x 1.4 = 28)
    assert in_band(20, 14) and not in_band(20, 13)
    assert in_band(20, 28) and not in_band(20, 29)
    # H_i = 10: low = min(9, 10 / 1.4 - 1 = 6.14), high = max(11, 14)
    assert in_band(10, 7) and not in_band(10, 6)
    assert in_band(10, 14) and not in_band(10, 15)
    # H_i = 3: one step either way is always inside (low = min(2, 1.14), high = max(4, 4.2))
    assert in_band(3, 2) and in_band(3, 4) and not in_band(3, 1) and not in_band(3, 5)


def test_equal_islands_keep_h_under_loaded_machine_noise() -> None:
    """Identical islands on a loaded 2-core machine: an island's step-time readings ±30% beside
    the reference's (the lower median, itself noisy). H = 20, floor 3, ceiling 20. Targets by
    hand, floor(20 x t_ref / t_i): 20 x 1.0 / 1.3 = 15.38 -> 15; 20 x 0.8 / 1.1 = 14.55 -> 14;
    20 x 1.0 / 1.4 = 14.29 -> 14; 20 x 1.0 / 1.25 = 16; 20 x 0.7 / 0.98 = 14.29 -> 14;
    20 x 1.0 / 0.7 = 28.6 -> the ceiling 20. Every one is within the band (>= 13.29): H_i stays
    20 throughout, from the first (fresh) reading on. The band of 20% of the steps it replaced
    (|target - 20| <= 4) had taken 15 at the first reading and shrunk the round to it."""
    readings = [
        (1.0, 1.3),
        (1.0, 1.3),
        (0.8, 1.1),
        (1.0, 1.4),
        (1.0, 1.25),
        (0.7, 0.98),
        (1.0, 0.7),
        (1.0, 1.3),
        (1.0, 1.3),
        (1.0, 1.4),
    ]
    targets = [
        target_steps(inner_steps=20, reference=ref, own=own, floor=3, ceiling=20)
        for ref, own in readings
    ]
    assert targets == [15, 15, 14, 14, 16, 14, 20, 15, 15, 14]
    assert _schedule(20, targets) == [20] * len(targets)


def test_a_one_and_a_half_times_slower_island_is_beyond_the_band() -> None:
    # 20 x 1.0 / 1.5 = 13.33 -> 13 < 13.29: taken at the second reading; the mixes
    # 1,1,2,4 (targets 10 and 5) are far beyond it too
    assert target_steps(inner_steps=20, reference=1.0, own=1.5, floor=3, ceiling=20) == 13
    assert _schedule(20, [13, 13]) == [20, 13]
    assert _schedule(20, [10, 10]) == [20, 10] and _schedule(20, [5, 5]) == [20, 5]


def test_split_budget_once_any_round_differs_from_h() -> None:
    # every round H (= 20): each island keeps its share, as stepsPerIsland fixed
    assert not split_budget(inner_steps=20, rounds=[20, 20, 20, 20], split=False)
    assert not split_budget(inner_steps=20, rounds=[], split=False)
    # one island at 6 (3x slower): split
    assert split_budget(inner_steps=20, rounds=[20, 20, 20, 6], split=False)
    # back to H everywhere: still split (the shares counted rounds of H, the budget was spent
    # unevenly meanwhile)
    assert split_budget(inner_steps=20, rounds=[20, 20, 20, 20], split=True)


def test_a_probe_is_two_readings_one_or_none() -> None:
    # every one of 4 reported and the target at most half the round: taken at once
    assert probe_readings(20, 6, fresh=True, reported=4, active=4) == 2
    # 3 of 4 reported (a peer started late): one reading, whatever the target
    assert probe_readings(20, 6, fresh=True, reported=3, active=4) == 1
    # every one reported, target 13 > 10 (the probe read 1.5x): one reading
    assert probe_readings(20, 13, fresh=True, reported=4, active=4) == 1
    # a job of two, or two of four reported: no majority brackets the reference, no reading
    assert probe_readings(10, 2, fresh=True, reported=2, active=2) == 0
    assert probe_readings(20, 6, fresh=True, reported=2, active=4) == 0
    # a rejoin's first report: warm-up again, no reading
    assert probe_readings(20, 6, fresh=False, reported=4, active=4) == 0


def test_a_probe_of_one_reading_is_confirmed_by_the_next_reading_only() -> None:
    # probe target 13 of 20: beyond the band (below 20 / 1.4 - 1 = 13.29), pending -1
    probed = next_round(IslandRound(20), 13)
    assert probed == IslandRound(20, -1, 4, fresh=False)
    # the next reading, target 6: -2 and 5 readings since the last change (>= 3): cut to 6
    assert next_round(probed, 6) == IslandRound(6, 0, 0, fresh=False)
    # or the next reading in the band (target 18): nothing pending, H kept
    assert next_round(probed, 18) == IslandRound(20, 0, 5, fresh=False)


def test_sized_steps_leaves_a_slow_island_room_at_k_equals_m() -> None:
    def sized(own: float, room: float = 0.1) -> int:
        return sized_steps(inner_steps=20, reference=0.25, own=own, floor=3, ceiling=20, room=room)

    assert sized(0.75) == 6  # 3x: 20 / 3 = 6.67, x 0.9 = 6.0 -> 6 (target_steps: 6 too)
    assert sized(1.0) == 4  # 4x: 5, x 0.9 = 4.5 -> 4 (target_steps: 5, as long as the reference)
    assert sized(0.5) == 9  # 2x: 10 x 0.9 = 9 (target_steps: 10)
    assert sized(0.3) == 15  # 1.2x: 16.67 x 0.9 = 15 (target_steps: 16)
    assert sized(0.25) == 20  # at the reference: 20, the ceiling, no room taken
    assert sized(0.2) == 20  # faster: 25, the ceiling
    assert sized(8.0) == 3  # 32x: 0.625 x 0.9 -> 0, the floor 3
    assert sized(1.0, room=0.0) == 5  # K < M: target_steps
    assert sized_steps(inner_steps=20, reference=None, own=1.0, floor=3, ceiling=20, room=0.1) == 20


def test_a_change_sets_the_sized_round_and_a_later_reading_keeps_it() -> None:
    # two readings of target 5 (a 4x island) at K = M, sized 4: the change sets 4
    one = next_round(IslandRound(20), 5, sized=4)
    assert one == IslandRound(20, -1, 4, fresh=False)
    assert next_round(one, 5, sized=4) == IslandRound(4, 0, 0, fresh=False)
    # a probe's change (confirmed) sets the target, 5: its learner takes it in place only
    # while below it, and its position is 3 or 4 when the answer comes
    assert next_round(IslandRound(20), 5, confirmed=True, sized=4) == IslandRound(
        5, -1, 3, fresh=False
    )
    # later readings of the same speed (target 5) are inside 4's band (up to max(5, 5.6)):
    # the room never moves a round by itself
    later = next_round(IslandRound(4, 0, 0, fresh=False), 5, sized=4)
    assert later == IslandRound(4, 0, 1, fresh=False)
    # for every x the room's round floor(0.9 x) keeps floor(x) inside its band
    for tenth in range(10, 400):
        x = tenth / 10
        assert in_band(max(1, math.floor(0.9 * x + 1e-9)), math.floor(x)), x
    # a sized round that does not move the way the target does is ignored (the target's taken)
    up = next_round(IslandRound(4, 1, 3, fresh=False), 7, sized=4)
    assert up == IslandRound(7, 0, 0, fresh=False)


def test_at_k_equals_m_a_round_below_the_ceiling_is_beyond_the_band_when_late() -> None:
    assert late_is_beyond(room=0.1, steps=6, ceiling=20) is True  # K = M, cut already
    assert late_is_beyond(room=0.1, steps=20, ceiling=20) is False  # at the ceiling: the band
    assert late_is_beyond(room=0.0, steps=6, ceiling=20) is False  # K < M
    # a round of 6 read at target 5 (3.5x: 20 / 3.5 = 5.71): inside 6's band (down to 3.29)
    # but late: one reading pending, then the second sets sized 5 (floor(5.71 x 0.9) = 5)
    one = next_round(IslandRound(6, 0, 5, fresh=False), 5, sized=5, late=True)
    assert one == IslandRound(6, -1, 6, fresh=False)
    assert next_round(one, 5, sized=5, late=True) == IslandRound(5, 0, 0, fresh=False)
    # without `late` the band keeps 6
    assert next_round(IslandRound(6, 0, 5, fresh=False), 5, sized=5) == IslandRound(
        6, 0, 6, fresh=False
    )
    # late is the sized round below the round: a 4x island's 5 (exact 5, target 5) sizes 4:
    # with one pending, cut to 4; a 3.3x island's (exact 6.06, sized 5) round of 5 is not late
    assert next_round(IslandRound(5, -1, 5, fresh=False), 5, sized=4, late=True) == IslandRound(
        4, 0, 0, fresh=False
    )
    assert next_round(IslandRound(5, -1, 5, fresh=False), 6, sized=5, late=True) == IslandRound(
        5, 0, 6, fresh=False
    )


def test_the_second_probe_is_reported_at_once_and_capped() -> None:
    report = StepTimeReport()
    report.add(5.0)  # warm-up
    report.add(1.0)
    assert report.add(1.0) is True and report.value == 1.0  # the probe
    # the second probe: steps 4-5 (3.0, 1.0), mean 2.0 capped at 1.4 x 1.0: reported at once
    assert report.add(3.0) is False and report.value == pytest.approx(3.0)
    assert report.add(1.0) is True and report.value == pytest.approx(1.4)
    # then the running mean of the steps since the probe again: (3 + 1 + 2) / 3
    assert report.add(2.0) is False and report.value == pytest.approx(2.0)


def test_a_longer_round_needs_a_reading_beyond_the_band_of_the_one_that_set_it() -> None:
    # 3.6 x 1.4 = 5.04 > 4.8: not outgrown; 3.42 x 1.4 = 4.788 <= 4.8 and 3.0 x 1.4 = 4.2: are
    assert not outgrown(4.8, 3.6)
    assert outgrown(4.8, 3.42) and outgrown(4.8, 3.0)
    assert outgrown(None, 3.6) and outgrown(4.8, None)  # unknown: the band alone, as before
    # a round of 3 set at 4.8x: a reading of 3.6x (target 5, beyond 3's band up to 4.2) is no
    # reading for a longer round; nothing pending, the anchor kept
    held = next_round(IslandRound(3, since_change=3, anchor=4.8), 5, ratio=3.6)
    assert (held.steps, held.pending, held.anchor) == (3, 0, 4.8)
    # 3.0x is: pending +1, then the second in a row takes it, and 3.0 anchors the new round
    first = next_round(IslandRound(3, since_change=3, anchor=4.8), 6, ratio=3.0)
    assert (first.steps, first.pending) == (3, 1)
    second = next_round(first, 6, ratio=3.0)
    assert (second.steps, second.pending, second.anchor) == (6, 0, 3.0)
    # a shorter round never asks the anchor: 6 set at 3.0x, 6.0x twice (target 3, below
    # min(5, 6 / 1.4 - 1 = 3.29)) cuts it to 3, anchored at 6.0
    down = next_round(
        next_round(IslandRound(6, since_change=3, anchor=3.0), 3, ratio=6.0), 3, ratio=6.0
    )
    assert (down.steps, down.anchor) == (3, 6.0)


def test_a_peers_step_time_judges_a_fresh_island_once_aged_past_its_join() -> None:
    """aged_past_join (issue 47): a peer with no step time at the join (mark None) reports only
    of the load since; one that had counts after AGE_STEPS = 10 steps since, or when idle."""
    assert AGE_STEPS == 10
    assert aged_past_join(mark=None, step=None, idle=False)  # all it reports came after
    assert aged_past_join(mark=None, step=3, idle=False)
    assert not aged_past_join(mark=3, step=None, idle=False)  # no report since its rejoin
    assert not aged_past_join(mark=3, step=3, idle=False)  # no step since the join
    assert not aged_past_join(mark=3, step=12, idle=False)  # 9 steps: 0.9^9 = 39% before it
    assert aged_past_join(mark=3, step=13, idle=False)  # 10 steps
    assert aged_past_join(mark=3, step=5, idle=True)  # waiting (K = M): it loads no core


def test_a_clear_slowdown_is_read_at_once_only_at_k_equal_m() -> None:
    """clear_of_join_load: 4x the reference or more, at K = M (room > 0); the join's load read
    identical islands up to 2.5x."""
    assert JOIN_LOAD_RATIO == 4.0
    assert clear_of_join_load(ratio=4.0, room=0.1)
    assert clear_of_join_load(ratio=6.0, room=0.1)
    assert not clear_of_join_load(ratio=3.99, room=0.1)
    assert not clear_of_join_load(ratio=2.5, room=0.1)
    assert not clear_of_join_load(ratio=6.0, room=0.0)  # K < M: as before


def test_at_k_equals_m_a_move_down_needs_no_cooldown_and_the_first_leaves_one_pending() -> None:
    """eager_down: K = M only."""
    assert eager_down(room=0.1) is True
    assert eager_down(room=0.0) is False
    # a probe of one reading pending (target 13 of 20), then its second probe: target 10,
    # beyond 20's band (below 13.29), two in a row: cut to the sized round 9 (K = M's room). The
    # round's first move by a reading: at K = M it starts no cooldown (since 3) and leaves one
    # reading down pending, as a probe's cut does; at K < M the cooldown starts, nothing pending
    probed = IslandRound(20, -1, 4, fresh=False)
    assert next_round(probed, 10, sized=9, ratio=2.0, eager=True) == IslandRound(
        9, -1, 3, fresh=False, anchor=2.0
    )
    assert next_round(probed, 10, sized=9, ratio=2.0) == IslandRound(
        9, 0, 0, fresh=False, anchor=2.0
    )
    # from there one reading of a 4x island (target 5 below 9's band, 9 / 1.4 - 1 = 5.43;
    # sized 4) cuts it to 4 at once; not the first move: nothing pending, no cooldown
    cut = IslandRound(9, -1, 3, fresh=False, anchor=2.0)
    assert next_round(cut, 5, sized=4, late=True, ratio=4.0, eager=True) == IslandRound(
        4, 0, 3, fresh=False, anchor=4.0
    )
    # a move down right after a move up (since 0): two late readings in a row (sized 3 < 6)
    # cut at the second at K = M; at K < M the cooldown holds it (three readings)
    upped = IslandRound(6, 0, 0, fresh=False, anchor=3.0)
    one = next_round(upped, 4, sized=3, late=True, ratio=4.8, eager=True)
    assert one == IslandRound(6, -1, 1, fresh=False, anchor=3.0)
    assert next_round(one, 4, sized=3, late=True, ratio=4.8, eager=True) == IslandRound(
        3, 0, 3, fresh=False, anchor=4.8
    )
    assert next_round(one, 4, sized=3, late=True, ratio=4.8) == IslandRound(
        6, -2, 2, fresh=False, anchor=3.0
    )
    # a move up still waits for the cooldown (since 2 < 3), eager or not
    cooling = IslandRound(3, 1, 1, fresh=False, anchor=4.8)
    assert next_round(cooling, 6, sized=6, ratio=3.0, eager=True) == IslandRound(
        3, 2, 2, fresh=False, anchor=4.8
    )
    # and a probe's cut (two readings at once) is as before: target, one pending, since 3
    assert next_round(IslandRound(20), 6, confirmed=True, sized=5, ratio=3.3, eager=True) == (
        IslandRound(6, -1, 3, fresh=False, anchor=3.3)
    )


def test_the_check_is_the_plain_mean_of_ten_steps_past_the_second_probe_reported_at_once() -> None:
    assert CHECK_STEPS == 10
    report = StepTimeReport()
    report.add(5.0)  # warm-up
    report.add(2.0)
    assert report.add(2.0) is True and report.value == 2.0  # the probe
    report.add(2.0)
    assert report.add(2.0) is True and report.value == 2.0  # the second probe
    # steps 6-15: 3.0 then nine of 1.0; only the tenth is reported at once, with their plain
    # mean (3 + 9) / 10 = 1.2, where the running report since the probe is, at the same step,
    # the mean of its first ten steps (2 + 2 + 3 + 7 x 1) / 10 = 1.4, then an EMA of 0.1 over
    # two steps of 1.0: 0.9 x 1.4 + 0.1 = 1.36, 0.9 x 1.36 + 0.1 = 1.324
    assert report.add(3.0) is False
    for _ in range(8):
        assert report.add(1.0) is False
    assert report.add(1.0) is True and report.value == pytest.approx(1.2)
    # then the running report again: the 13th step since the probe, 0.9 x 1.324 + 0.1 x 1.0
    assert report.add(1.0) is False and report.value == pytest.approx(0.9 * 1.324 + 0.1)


def test_a_probes_cut_goes_back_at_its_check_only_when_it_reads_beyond_the_band_and_outgrown() -> (
    None
):
    # (no round cut recorded here, a restarted syncer's: the band of the cut round and outgrown
    # alone decide) probe11: cut to 14 of 30 on a probe of 2.0x (anchor 2.0); the check reads
    # 1.0x: target 30,
    # beyond 14's band (up to max(15, 19.6)) and outgrown (1.0 x 1.4 <= 2.0): back to 30 as
    # two readings, one up left pending, no cooldown started
    cut = IslandRound(14, -1, 3, fresh=False, anchor=2.0)
    assert check_restores(cut, 30, ratio=1.0)
    assert next_round(cut, 30, confirmed=True, ratio=1.0) == IslandRound(
        30, 1, 3, fresh=False, anchor=1.0
    )
    # a check of 1.45x: target floor(30 / 1.45) = 20, beyond the band, but 1.45 x 1.4 = 2.03 >
    # 2.0 not outgrown: a regular reading
    assert not check_restores(cut, 20, ratio=1.45)
    # a 3x island cut on the same probe reads 3x at its check: target 10, no move up
    assert not check_restores(cut, 10, ratio=3.0)
    # 1.35x: target floor(22.2) = 22 > 19.6 and 1.89 <= 2.0: back to 22
    assert check_restores(cut, 22, ratio=1.35)
    # within the band (target 19 <= 19.6): no move
    assert not check_restores(cut, 19, ratio=1.0)


def test_a_probes_cut_goes_back_at_its_check_when_it_reads_within_the_band_of_the_round_cut() -> (
    None
):
    # probe13, busy12's main run (K = M, L = 50%): an identical island cut 30 -> 17 on a second
    # probe of 1.508x (anchor 1.508); its check read 1.212x: target floor(30 / 1.212) =
    # floor(24.75) = 24, beyond 17's band (up to max(18, 23.8)) but not outgrown (1.212 x 1.4 =
    # 1.697 > 1.508), so on main it stayed cut; 24 is within 30's band (down to min(29, 30 /
    # 1.4 - 1) = 20.43): it restores, back to 30
    cut = IslandRound(17, -1, 3, fresh=False, anchor=1.508, check_at=14, cut_from=30)
    assert not outgrown(1.508, 1.212)
    assert check_restores(cut, 24, ratio=1.212)
    assert check_round(cut, 24) == 30
    # the same without the round cut recorded: outgrown alone, not restored
    no_record = IslandRound(17, -1, 3, fresh=False, anchor=1.508, check_at=14)
    assert not check_restores(no_record, 24, ratio=1.212)
    # within the cut round's own band as well (K = 1: cut to 20, band up to max(21, 28); a check
    # of 1.125x, target floor(26.67) = 26, not outgrown of 1.5: 1.575 > 1.5): back to 30
    k1 = IslandRound(20, 0, 0, fresh=False, anchor=1.5, check_at=14, cut_from=30)
    assert check_restores(k1, 26, ratio=1.125)
    # the edge of 30's band: target 21 (t_i / t_ref <= 30 / 21 = 1.43) restores; a check of
    # 1.4375x, target floor(20.87) = 20, is below it and not outgrown (2.01 > 1.508): stays cut
    assert check_restores(cut, 21, ratio=1.42)
    assert not check_restores(cut, 20, ratio=1.4375)
    # a 3x island cut 30 -> 15 on a 2x probe reads 3x at its check: target 10, stays cut; were
    # it to read 1.43x, the band's edge and outgrown of 2.0 (2.0 / 1.4) agree: target 20 no,
    # 21 yes
    slow = IslandRound(15, -1, 3, fresh=False, anchor=2.0, check_at=14, cut_from=30)
    assert not check_restores(slow, 10, ratio=3.0)
    assert not check_restores(slow, 20, ratio=1.45)
    assert check_restores(slow, 21, ratio=1.42)


def test_a_check_that_restores_goes_back_to_the_round_cut_when_within_its_band() -> None:
    # cut from 30 to 16: a check of target 26 is within 30's band (down to min(29, 30 / 1.4 - 1)
    # = 20.43): back to 30; target 20 is not: back to 20 only
    cut = IslandRound(16, -1, 3, fresh=False, anchor=2.0, check_at=14, cut_from=30)
    assert check_round(cut, 26) == 30
    assert check_round(cut, 21) == 30
    assert check_round(cut, 20) == 20
    # no round recorded (a restarted syncer): the target
    assert check_round(IslandRound(16, -1, 3, fresh=False, anchor=2.0), 26) == 26


def test_a_reading_within_the_band_of_the_round_a_probe_cut_sends_it_back() -> None:
    # busy12's island cut 30 -> 17 on a 1.508x probe, the round cut kept (cut_from 30): a
    # regular reading of 1.15x (target floor(30 / 1.15) = 26, within 30's band down to 20.43)
    # counts for a move up though not outgrown (1.15 x 1.4 = 1.61 > 1.508); the second in a
    # row sends it to 30, not to 26
    cut = IslandRound(17, 0, 3, fresh=False, anchor=1.508, cut_from=30)
    assert restores_cut(cut, 26) and not outgrown(1.508, 1.15)
    first = next_round(cut, 26, ratio=1.15)
    assert (first.steps, first.pending) == (17, 1)
    second = next_round(replace(first, cut_from=30), 26, ratio=1.15)
    assert (second.steps, second.anchor) == (30, 1.15)
    # the same without the round cut recorded: not outgrown, no move
    plain = next_round(IslandRound(17, 0, 3, fresh=False, anchor=1.508), 26, ratio=1.15)
    assert (plain.steps, plain.pending) == (17, 0)
    # within the cut round's own band (K = 1: 20, band up to 28): still a reading up
    k1 = IslandRound(20, 0, 3, fresh=False, anchor=1.5, cut_from=30)
    assert next_round(k1, 26, ratio=1.15).pending == 1
    # a reading below 30's band (target 20: 1.5x) is no restore; at 17 it is a regular
    # reading within 17's band: no move
    assert not restores_cut(cut, 20)
    assert next_round(cut, 20, ratio=1.5).pending == 0


def test_a_regular_reading_is_judged_with_the_last_five() -> None:
    """judged_ratio (hetero18): the last RECENT_READINGS = 5 regular readings, the latest last;
    at K = M the reading itself, or for a longer round the slowest of them; at K < M their
    lower median."""
    assert RECENT_READINGS == 5
    recent: tuple[float, ...] = ()
    for r in (3.0, 1.2, 4.5, 1.1, 2.0, 1.3):
        recent = remembered(recent, r)
    assert recent == (1.2, 4.5, 1.1, 2.0, 1.3)  # the first 3.0 has left
    assert judged_ratio(recent, room=0.1, longer=True) == 4.5  # the slowest
    assert judged_ratio(recent, room=0.1, longer=False) == 1.3  # the reading itself
    # K < M: sorted 1.1, 1.2, 1.3, 2.0, 4.5 -> 1.3; of four, 1.1, 1.2, 2.0, 4.5 -> the lower 1.2
    assert judged_ratio(recent, room=0.0, longer=True) == 1.3
    assert judged_ratio((1.2, 4.5, 1.1, 2.0), room=0.0, longer=False) == 1.2
    assert judged_ratio((2.5,), room=0.0, longer=False) == 2.5
    with pytest.raises(ValueError):
        judged_ratio((), room=0.1, longer=False)
