"""Phase alignment, schedule positions and the re-warm-up after a mid-job join
(learner/phase_alignment.py, learner/step_plan.py), with hand-derived values."""

from __future__ import annotations

from typing import Any

import pytest
from diloco_trainer.api.documents import FragmentMerges
from diloco_trainer.learner.phase_alignment import (
    lateness_within,
    merge_lateness,
    phase_shift,
    schedule_positions,
)
from diloco_trainer.learner.step_plan import StepPlan, blocks_for_merge, plan_idle, rewarm_factor


def status(*merges: dict[str, Any], now: float = 100.0) -> dict[str, Any]:
    """Fragment 0's merges as GET /v1/fragments/0/merges gives them (FragmentMerges).

    We are island-2 at 0.1 s/step: island-1 is a leader (sorts first, 0.12 s/step), island-3
    follows us, island-0 is a 3x straggler."""
    return {
        "fragment": 0,
        "time": now,
        "stepTimes": {"island-0": 0.3, "island-1": 0.12, "island-2": 0.1, "island-3": 0.1},
        "merges": list(merges),
    }


def merge(fragment: int, version: int, time: float, *islands: str) -> dict[str, Any]:
    return {
        "fragment": fragment,
        "version": version,
        "time": time,
        "contributors": [{"island": i} for i in islands],
    }


def lateness(doc: dict[str, Any], **kw: Any) -> float | None:
    args = dict(
        island="island-2",
        base_version=4,
        accepted_version=6,
        pushed_ago=0.5,
        step_time=0.1,
    )
    args.update(kw)
    return merge_lateness(FragmentMerges.from_json(doc), **args)


def timed(fragment: int, version: int, **received: float) -> dict[str, Any]:
    """A merge whose contributors carry the time the syncer took their push."""
    return {
        "fragment": fragment,
        "version": version,
        "time": 99.0,
        "contributors": [{"island": i, "receivedAt": t} for i, t in received.items()],
    }


def within(doc: dict[str, Any], **kw: Any) -> float | None:
    args = dict(version=4, island="island-2", step_time=0.1)
    args.update(kw)
    return lateness_within(FragmentMerges.from_json(doc), **args)


def test_lateness_within_a_merge_is_our_push_minus_the_first_leaders() -> None:
    # We (island-2) and island-1 were merged into version 4 of fragment 0. Island-1 reached the
    # syncer at 97.2, we at 97.9: 0.7 s late. Island-0 (a 3x straggler) is no leader.
    doc = status(timed(0, 4, **{"island-0": 90.0, "island-1": 97.2, "island-2": 97.9}))
    assert within(doc) == pytest.approx(0.7)
    # Early (negative): we reached it 0.4 s before island-1; island-3 follows us, not counted.
    doc = status(timed(0, 4, **{"island-1": 97.2, "island-2": 96.8, "island-3": 95.0}))
    assert within(doc) == pytest.approx(-0.4)


def test_lateness_within_a_merge_needs_that_merge_a_leader_and_both_times() -> None:
    doc = status(timed(0, 4, **{"island-1": 97.2, "island-2": 97.9}))
    assert within({**doc, "fragment": 1}) is None  # not that fragment
    assert within(doc, version=3) is None  # not that version
    assert within(doc, step_time=0.0) is None
    only_followers = status(timed(0, 4, **{"island-2": 97.9, "island-3": 97.0}))
    assert within(only_followers) is None
    old_syncer = status(merge(0, 4, 99.0, "island-1", "island-2"))  # no receivedAt
    assert within(old_syncer) is None
    # The leader ranking is merge_lateness's: the first leader by name, whatever its time.
    two = status(timed(0, 4, **{"island-1": 97.0, "island-2": 97.9}))
    two["stepTimes"]["island-0"] = 0.1  # island-0 at our speed: a leader now
    two["merges"][0]["contributors"].append({"island": "island-0", "receivedAt": 97.5})
    assert within(two) == pytest.approx(0.4)


def test_merge_lateness_is_push_time_minus_the_latest_leader_merge_time() -> None:
    # Pushed at 100 - 0.5 = 99.5; island-1 merged version 5 at 98.
    assert lateness(status(merge(0, 5, 98.0, "island-1"))) == pytest.approx(1.5)


def test_merge_lateness_takes_the_latest_of_several_leader_merges() -> None:
    doc = status(merge(0, 5, 97.0, "island-1"), merge(0, 6, 99.0, "island-1"))
    assert lateness(doc) == pytest.approx(0.5)


def test_merge_lateness_ignores_followers_stragglers_other_fragments_own_and_old_merges() -> None:
    doc = status(
        merge(0, 6, 99.0, "island-3"),  # sorts after us: it aligns to us, not we to it
        merge(0, 6, 99.0, "island-0"),  # 3x slower: never in phase with us
        merge(1, 6, 99.2, "island-1"),  # another fragment
        merge(0, 4, 90.0, "island-1"),  # at or before our base version
        merge(0, 7, 99.4, "island-1"),  # after the version our push went in at
        merge(0, 5, 98.0, "island-2", "island-1"),  # we were part of it
    )
    assert lateness(doc) is None


def test_merge_lateness_counts_a_merge_with_one_leader_among_others() -> None:
    assert lateness(status(merge(0, 5, 99.0, "island-0", "island-1"))) == pytest.approx(0.5)


def test_merge_lateness_none_without_merges_between_base_and_push() -> None:
    assert lateness(status(merge(0, 5, 98.0, "island-1")), accepted_version=4) is None


def test_merge_lateness_follows_the_first_island_not_the_latest_leader() -> None:
    doc = {
        "fragment": 0,
        "time": 100.0,
        "stepTimes": {n: 0.1 for n in ("a0", "a1", "a2")},
        "merges": [merge(0, 5, 98.0, "a0"), merge(0, 6, 99.0, "a1")],
    }
    assert lateness(doc, island="a2") == pytest.approx(1.5)  # 99.5 - 98, not 99.5 - 99


def test_merge_lateness_none_for_the_first_island_in_the_order() -> None:
    doc = status(merge(0, 5, 98.0, "island-1"))
    assert lateness(doc, island="island-0", step_time=0.12) is None


def test_phase_shift_late_island_advances_by_its_lateness() -> None:
    # H = 30 at 0.1 s/step: a round is 3 s. 0.6 s late -> advance 6 steps.
    assert phase_shift(0.6, inner_steps=30, step_time=0.1) == -6


def test_phase_shift_wraps_into_half_a_round_and_delays_an_early_island() -> None:
    # 2.6 s after the leader's merge is 0.4 s before its next one: delay 4 steps.
    assert phase_shift(2.6, inner_steps=30, step_time=0.1) == 4
    assert phase_shift(100 * 3.0 + 0.6, inner_steps=30, step_time=0.1) == -6


def test_phase_shift_is_capped_at_a_quarter_round() -> None:
    assert phase_shift(1.0, inner_steps=30, step_time=0.1) == -7
    assert phase_shift(-1.0, inner_steps=30, step_time=0.1) == 7


def test_phase_shift_zero_under_half_a_step_or_without_timings() -> None:
    assert phase_shift(0.04, inner_steps=30, step_time=0.1) == 0
    assert phase_shift(0.5, inner_steps=30, step_time=0.0) == 0
    assert phase_shift(float("nan"), inner_steps=30, step_time=0.1) == 0


def test_phase_shift_within_a_merge_ignores_offsets_under_an_eighth_of_a_round() -> None:
    # H = 30, 0.1 s a step: a round is 3 s, an eighth of it 0.375 s (3.75 steps).
    assert phase_shift(0.3, inner_steps=30, step_time=0.1, within=True) == 0  # 3 steps: noise
    assert phase_shift(-0.3, inner_steps=30, step_time=0.1, within=True) == 0
    assert phase_shift(0.4, inner_steps=30, step_time=0.1, within=True) == -4  # 4 steps late
    assert phase_shift(-0.5, inner_steps=30, step_time=0.1, within=True) == 5  # 5 steps early
    assert phase_shift(2.8, inner_steps=30, step_time=0.1, within=True) == 0  # wraps to -0.2 s
    # A missed merge (merge_lateness) has no dead band: the same 0.3 s moves 3 steps.
    assert phase_shift(0.3, inner_steps=30, step_time=0.1) == -3


def test_phase_shift_brings_a_follower_onto_its_leaders_schedule() -> None:
    """The leader merges at 0.2 s into every 3 s round; the follower pushes at 1.2 s: 1 s late,
    it moves 7 steps (the cap), then the remaining 3: on the leader's merge from round 3."""
    step, h = 0.1, 30
    push, offsets = 1.2, []
    for round_start in (0.0, 3.0, 6.0, 9.0):
        lateness = push - (round_start + 0.2)
        offsets.append(round(lateness, 6))
        push += h * step + phase_shift(lateness, inner_steps=h, step_time=step) * step
    assert offsets == [1.0, 0.3, 0.0, 0.0]


def test_schedule_positions_one_per_step_none_while_delaying_two_while_advancing() -> None:
    assert schedule_positions(10, 0) == ([11], 0)
    assert schedule_positions(10, 2) == ([], 1)
    assert schedule_positions(10, -2) == ([11, 12], -1)


def test_plan_idle_polls_only_fragments_past_their_apply_step() -> None:
    plan = plan_idle(10, overlap=2, pushed_at={0: 8, 1: 9})
    assert plan == StepPlan(poll=(0,))


def test_rewarm_factor_repeats_the_warm_up_after_a_mid_job_join() -> None:
    assert rewarm_factor(0, warmup_steps=10, joined_mid_job=True) == pytest.approx(0.1)
    assert rewarm_factor(4, warmup_steps=10, joined_mid_job=True) == pytest.approx(0.5)
    assert rewarm_factor(9, warmup_steps=10, joined_mid_job=True) == 1.0
    assert rewarm_factor(10, warmup_steps=10, joined_mid_job=True) == 1.0


def test_rewarm_factor_is_1_at_the_job_start_or_without_warm_up() -> None:
    assert rewarm_factor(0, warmup_steps=10, joined_mid_job=False) == 1.0
    assert rewarm_factor(0, warmup_steps=0, joined_mid_job=True) == 1.0


def test_blocks_for_merge_only_when_synchronous_or_without_overlap() -> None:
    assert blocks_for_merge(quorum=4, islands=4, overlap=5)
    assert blocks_for_merge(quorum=1, islands=4, overlap=0)
    assert not blocks_for_merge(quorum=2, islands=4, overlap=5)
    assert not blocks_for_merge(quorum=1, islands=4, overlap=1)
