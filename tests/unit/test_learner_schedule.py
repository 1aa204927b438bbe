"""The learner's pure step plan: which fragment is pushed, waited for, or applied at which step."""

from __future__ import annotations

import pytest
from diloco_trainer.core.fragments import fragment_offsets, fragments_due
from diloco_trainer.learner.step_plan import (
    ROUND_TIME_FACTOR,
    StepPlan,
    plan_step,
    schedule_start,
    starts_fresh,
    wait_budget,
)


def _simulate(
    steps: int,
    *,
    inner_steps: int,
    num_fragments: int,
    overlap: int,
    late: dict[int, int],
) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]:
    """Run plan_step like the learner does. `late[f] = k`: fragment f's merged result arrives k
    steps after the step it was needed at (0 = on time). Returns (pushes, applies, skips) as
    (step, fragment) pairs."""
    offsets = fragment_offsets(inner_steps, num_fragments)
    pushed_at: dict[int, int] = {}
    pushes, applies, skips = [], [], []
    for step in range(1, steps + 1):
        plan = plan_step(
            step,
            inner_steps=inner_steps,
            offsets=offsets,
            overlap=overlap,
            pushed_at=pushed_at,
        )
        for f in plan.push:
            pushed_at[f] = step
            pushes.append((step, f))
        skips.extend((step, f) for f in plan.skip)
        for f in (*plan.wait, *plan.poll):
            arrival = pushed_at[f] + overlap + late.get(f, 0)
            if step >= arrival:
                applies.append((step, f))
                del pushed_at[f]
    return pushes, applies, skips


def test_plan_step_single_fragment_no_overlap_pushes_and_waits_every_h_steps() -> None:
    plans = [plan_step(s, inner_steps=4, offsets=[0], overlap=0, pushed_at={}) for s in range(1, 9)]
    assert [s for s, p in zip(range(1, 9), plans, strict=True) if p.push] == [4, 8]
    assert plans[3] == StepPlan(push=(0,), wait=(0,))
    assert plans[0] == StepPlan()


def test_plan_step_overlap_applies_tau_steps_after_the_push() -> None:
    pushes, applies, skips = _simulate(24, inner_steps=8, num_fragments=4, overlap=2, late={})
    # offsets 0, 2, 4, 6: fragment 0 is due at 8, 16, 24; fragment 1 at 2, 10, 18; ... (the
    # first round's sync points 2, 4, 6 skipped, see below)
    assert pushes[:4] == [(8, 0), (10, 1), (12, 2), (14, 3)]
    assert all((s + 2, f) in applies for s, f in pushes if s + 2 <= 24)
    assert skips == [(2, 1), (4, 2), (6, 3)]
    # Exactly one fragment moves every other step: peak traffic falls by F.
    assert len({s for s, _ in pushes}) == len(pushes)


def test_fresh_job_pushes_no_fragment_before_a_whole_round() -> None:
    # H = 30, F = 2 (offsets 0, 15), τ = 5, from the job's start: fragment 1's sync point at step
    # 15 is skipped, so its first push comes at 45 with 45 steps (1.5 rounds) of work; from then
    # on both fragments sync every 30 steps, each applied 5 steps after its push.
    pushes, applies, skips = _simulate(120, inner_steps=30, num_fragments=2, overlap=5, late={})
    assert pushes == [(30, 0), (45, 1), (60, 0), (75, 1), (90, 0), (105, 1), (120, 0)]
    assert skips == [(15, 1)]
    assert applies == [(35, 0), (50, 1), (65, 0), (80, 1), (95, 0), (110, 1)]
    # Fragment 1 was pushed at 15 with half a round of work before issue 23.


def test_fresh_job_first_push_of_fragment_f_holds_one_round_plus_its_offset() -> None:
    # H = 8, F = 4 (offsets 0, 2, 4, 6): first pushes at 8, 10, 12, 14 = H + f·H/F steps of work.
    pushes, _, skips = _simulate(16, inner_steps=8, num_fragments=4, overlap=1, late={})
    assert pushes == [(8, 0), (10, 1), (12, 2), (14, 3), (16, 0)]
    assert skips == [(2, 1), (4, 2), (6, 3)]
    # One fragment, offset 0: its first sync point is step H itself, nothing changes.
    assert plan_step(8, inner_steps=8, offsets=[0], overlap=0, pushed_at={}) == StepPlan(
        push=(0,), wait=(0,)
    )


def test_starts_fresh_only_when_nothing_has_merged() -> None:
    assert starts_fresh([0, 0])
    assert not starts_fresh([0, 1])
    assert not starts_fresh([3, 3])


def test_plan_step_late_fragment_is_polled_then_applied_and_next_push_skipped() -> None:
    # Fragment 0 arrives 6 steps late: applied at step 4 + 1 + 6 = 11, after its next due step 8.
    pushes, applies, skips = _simulate(12, inner_steps=4, num_fragments=1, overlap=1, late={0: 6})
    assert pushes == [(4, 0), (12, 0)]
    assert (11, 0) in applies
    assert skips == [(8, 0)]


def test_plan_step_in_flight_fragment_is_polled_every_step_after_its_apply_step() -> None:
    plan = plan_step(7, inner_steps=4, offsets=[0, 2], overlap=1, pushed_at={0: 4})
    assert plan.poll == (0,)
    assert plan.wait == ()
    plan = plan_step(5, inner_steps=4, offsets=[0, 2], overlap=1, pushed_at={0: 4})
    assert plan.wait == (0,)
    assert plan.poll == ()


def test_plan_step_refuses_step_zero_and_negative_overlap() -> None:
    with pytest.raises(ValueError, match="from 1"):
        plan_step(0, inner_steps=4, offsets=[0], overlap=0, pushed_at={})
    with pytest.raises(ValueError, match="overlapSteps"):
        plan_step(1, inner_steps=4, offsets=[0], overlap=-1, pushed_at={})


def test_wait_budget_is_heartbeat_timeout_or_a_multiple_of_the_slowest_round() -> None:
    assert wait_budget([], 30.0) == 30.0
    assert wait_budget([1.0, 2.0], 30.0) == 30.0
    assert wait_budget([1.0, 20.0], 30.0) == ROUND_TIME_FACTOR * 20.0
    assert wait_budget([float("nan"), -1.0], 5.0) == 5.0
    with pytest.raises(ValueError, match="heartbeatTimeoutSeconds"):
        wait_budget([], 0.0)


def test_plan_step_abandoned_fragment_is_pushed_again_when_due() -> None:
    plan = plan_step(
        8, inner_steps=4, offsets=[0], overlap=1, pushed_at={0: 4}, abandoned=frozenset({0})
    )
    assert plan.push == (0,)
    assert plan.skip == ()
    # Re-pushed now, so it is applied overlap steps later, not polled now.
    assert plan.poll == ()
    assert plan.wait == ()


def test_schedule_start_is_zero_for_a_fresh_job_and_a_round_on_for_one_in_phase() -> None:
    assert schedule_start([0, 0, 0, 0], 8, fragment_offsets(8, 4)) == 0
    # A running job whose fragments are all at one version: phase 0, a round (H) on, so the
    # joiner's first push (fragment 1 at 5 + 2 = 7 of H = 5) is not skipped as a first round's.
    assert schedule_start([7], 10, fragment_offsets(10, 1)) == 10
    assert schedule_start([3, 3], 5, fragment_offsets(5, 2)) == 5
    assert plan_step(7, inner_steps=5, offsets=[0, 2], overlap=1, pushed_at={}).push == (1,)


def test_schedule_start_puts_the_next_merged_fragment_first() -> None:
    # H = 5, F = 2: offsets [0, 2], so fragment 1 is due at step 2 and fragment 0 at step 5.
    offsets = fragment_offsets(5, 2)
    # Fragment 1 already merged this round (version 2), fragment 0 not yet (1): start after
    # step 2 (a round on: 5 + 2), so the first push (at step 10) is fragment 0's, after three
    # steps of training.
    start = schedule_start([1, 2], 5, offsets)
    assert start == 7
    first_due = next(s for s in range(start + 1, start + 6) if fragments_due(s, 5, offsets))
    assert (first_due, fragments_due(first_due, 5, offsets)) == (10, [0])
    # F = 4, H = 8 (due at 2, 4, 6, 8 for fragments 1, 2, 3, 0): 1 and 2 merged -> 3 next.
    assert schedule_start([4, 5, 5, 4], 8, fragment_offsets(8, 4)) == 8 + 4


def test_schedule_start_refuses_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="versions"):
        schedule_start([1, 2], 5, [0])
