"""The plan's shortcut between sync points (issue 45: FragmentSync._plan skips τ's fit, the
abandoned pushes and skip_once where nothing is due, and collect answers a poll of a merge not
back at once): the same decisions as the full plan."""

from __future__ import annotations

from typing import Any

import pytest
from diloco_trainer.learner.step_plan import StepPlan, plan_step

from tests.unit.test_learner_fragment_sync import FakeLink, make_spec, make_sync, step

H = 30
OFFSETS = [0, 15]  # fragment_offsets(30, 2): fragment 0 due at 30, 60, ...; fragment 1 at 15, 45


def full_plan(position: int, pushed_at: dict[int, int], windows: Any) -> StepPlan:
    """The plan as _plan makes it at a sync point: τ 5 for a push now (window (1, 29)), both
    fragments abandoned and fragment 1 to skip once; none of it may matter between them."""
    return plan_step(
        position,
        inner_steps=H,
        offsets=OFFSETS,
        overlap=5,
        pushed_at=pushed_at,
        abandoned=frozenset({0, 1}),
        deadline=29,
        poll_from=1,
        windows=windows,
        skip_once=frozenset({1}),
    )


def shortcut_plan(position: int, pushed_at: dict[int, int], windows: Any) -> StepPlan:
    """_plan's call where nothing is due: overlap 0 and nothing else but the flights."""
    return plan_step(
        position, inner_steps=H, offsets=OFFSETS, overlap=0, pushed_at=pushed_at, windows=windows
    )


@pytest.mark.parametrize("position", [*range(31, 45), *range(46, 60)])
def test_plan_step_between_sync_points_reads_only_the_flights_windows(position: int) -> None:
    # Fragment 0 pushed at 30 with window (1, 3), fragment 1 at 15 with (2, 40).
    pushed_at, windows = {0: 30, 1: 15}, {0: (1, 3), 1: (2, 40)}
    plan = shortcut_plan(position, pushed_at, windows)
    assert plan == full_plan(position, pushed_at, windows)
    # By hand: fragment 0 waited for at 30 + 3 = 33, polled from 30 + 1 = 31 on otherwise;
    # fragment 1 waited for at 15 + 40 = 55, polled from 15 + 2 = 17 on otherwise.
    assert plan.push == plan.skip == ()
    assert plan.wait == tuple(f for f, at in ((0, 33), (1, 55)) if position == at)
    assert plan.poll == tuple(f for f, at in ((0, 33), (1, 55)) if position != at)


def test_plan_step_at_a_sync_point_still_differs_with_tau_and_skip_once() -> None:
    # The shortcut is only for positions where nothing is due: at 45 (fragment 1's sync point)
    # skip_once holds fragment 1 back, where without it fragment 1 is pushed and polled from
    # 45 + 0 (overlap 0) on: the full plan's arguments matter there.
    full = full_plan(45, {}, {})
    assert (full.push, full.skip) == ((), (1,))
    short = shortcut_plan(45, {}, {})
    assert (short.push, short.wait) == ((1,), (1,))


def test_fragment_sync_polls_a_merge_not_back_and_takes_it_once_back() -> None:
    # K < M (2 islands, quorum 1): nothing blocks. H = 4, τ 2 (overlapSteps, fixed): fragment 0
    # is pushed at position 4 and its merge held back by the fake syncer. Position 5: 4 + 2 not
    # reached, not asked for. 6 = 4 + 2: asked for without blocking (collect's poll), not back:
    # still in flight, and the poll starts what is deferred, as wait does. Back before 7: taken
    # at 7 and applied.
    link = FakeLink(outer_lr=0.25)
    link.hold = True
    sync, w = make_sync(make_spec(quorum=1, overlapMode="fixed"), link)
    polled: list[int] = []
    link.start_deferred = lambda: polled.append(sync.position)  # type: ignore[method-assign]
    for _ in range(4):
        assert step(sync, w) == {}
    assert 0 in sync.inflight and len(link.pushes) == 1
    polled.clear()  # the push's own hand-over
    assert step(sync, w) == {}  # position 5
    assert polled == []
    assert step(sync, w) == {}  # position 6: asked for, not back
    assert 0 in sync.inflight and polled == [6]
    link.release()
    assert set(step(sync, w)) == {0}  # position 7: back, applied
    assert 0 not in sync.inflight and sync.fragments[0].version == 1
