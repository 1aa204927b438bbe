"""Phase alignment, schedule positions and the re-warm-up after a mid-job join
(learner/schedule.py), with hand-derived values."""

from __future__ import annotations

from typing import Any

import pytest
from diloco_trainer.learner.schedule import (
    StepPlan,
    merge_lateness,
    phase_shift,
    plan_idle,
    rewarm_factor,
    schedule_positions,
)


def status(*merges: dict[str, Any], now: float = 100.0) -> dict[str, Any]:
    return {
        "time": now,
        "islands": {
            "a": {"stepTime": 0.1},
            "b": {"stepTime": 0.12},
            "slow": {"stepTime": 0.3},
        },
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
        fragment=0, island="a", base_version=4, accepted_version=6, pushed_ago=0.5, step_time=0.1
    )
    args.update(kw)
    return merge_lateness(doc, **args)


def test_merge_lateness_is_push_time_minus_the_latest_peer_merge_time() -> None:
    # Pushed at 100 - 0.5 = 99.5; b (0.12 s/step, within 1.5x of 0.1) merged version 5 at 98.
    assert lateness(status(merge(0, 5, 98.0, "b"))) == pytest.approx(1.5)


def test_merge_lateness_takes_the_latest_of_several_peer_merges() -> None:
    doc = status(merge(0, 5, 97.0, "b"), merge(0, 6, 99.0, "b"))
    assert lateness(doc) == pytest.approx(0.5)


def test_merge_lateness_ignores_stragglers_other_fragments_own_and_old_merges() -> None:
    doc = status(
        merge(0, 6, 99.0, "slow"),  # 3x slower: never in phase with us
        merge(1, 6, 99.2, "b"),  # another fragment
        merge(0, 4, 90.0, "b"),  # at or before our base version
        merge(0, 7, 99.4, "b"),  # after the version our push went in at
        merge(0, 5, 98.0, "a", "b"),  # we were part of it
    )
    assert lateness(doc) is None


def test_merge_lateness_counts_a_merge_with_one_peer_among_stragglers() -> None:
    assert lateness(status(merge(0, 5, 99.0, "slow", "b"))) == pytest.approx(0.5)


def test_merge_lateness_none_without_merges_between_base_and_push() -> None:
    assert lateness(status(merge(0, 5, 98.0, "b")), accepted_version=4) is None


def test_phase_shift_late_island_advances_by_half_its_lateness() -> None:
    # H = 30 at 0.1 s/step: a round is 3 s. 1 s late -> advance 1 / (2 * 0.1) = 5 steps.
    assert phase_shift(1.0, inner_steps=30, step_time=0.1) == -5


def test_phase_shift_wraps_into_half_a_round_and_delays_an_early_island() -> None:
    # 2.6 s after their merge is 0.4 s before their next one: delay 0.4 / 0.2 = 2 steps.
    assert phase_shift(2.6, inner_steps=30, step_time=0.1) == 2
    assert phase_shift(100 * 3.0 + 1.0, inner_steps=30, step_time=0.1) == -5


def test_phase_shift_is_capped_at_a_quarter_round() -> None:
    assert phase_shift(1.45, inner_steps=30, step_time=0.1) == -7  # 7.25 -> 7
    assert phase_shift(-1.45, inner_steps=30, step_time=0.1) == 7


def test_phase_shift_zero_under_half_a_step_or_without_timings() -> None:
    assert phase_shift(0.05, inner_steps=30, step_time=0.1) == 0
    assert phase_shift(1.0, inner_steps=30, step_time=0.0) == 0
    assert phase_shift(float("nan"), inner_steps=30, step_time=0.1) == 0


def test_phase_shifts_of_two_islands_close_their_gap() -> None:
    """b pushed at 0 and merged alone at g = 0.2 s; a pushed δ = 0.8 s later and merged alone
    at 1.0 s. Each learns of the other's merge: a is late by 0.6 s, b's next push (3.0 s) comes
    2.0 s after a's merge. Their shifts together move them δ closer: in phase."""
    step, h, delta, g = 0.1, 30, 0.8, 0.2
    shift_a = phase_shift(delta - g, inner_steps=h, step_time=step)
    shift_b = phase_shift(h * step - (delta + g), inner_steps=h, step_time=step)
    assert (shift_a, shift_b) == (-3, 5)
    assert (shift_b - shift_a) * step == pytest.approx(delta)


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
