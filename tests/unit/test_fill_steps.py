"""Merge waits at K = M filled with steps: an island at H's (step_plan.fills_drift, issue 45): its
peers' drift filled, up to a cap a push; a slow island's by that rule too and past the cap by its
merge period (step_plan.fills_wait, issue 47), hand-derived schedules in units of a fast island's
step (H = 20, merges every 20)."""

from __future__ import annotations

import concurrent.futures
import logging
import re
import threading

import pytest
from diloco_trainer.learner.fill_steps import FillSteps
from diloco_trainer.learner.fragment_sync import FragmentSync
from diloco_trainer.learner.step_plan import (
    FILL_ROOM,
    FillFragment,
    drift_fill_cap,
    fills_drift,
    fills_wait,
    first_fill_cap,
    merge_period,
    steps_to_due,
)
from torch import nn

from .test_learner_fragment_sync import FakeLink, make_spec, make_sync, step

ROOM = FILL_ROOM  # 0.2: 4 of a 20 s merge period


def test_merge_period_is_the_shortest_of_the_latest_intervals() -> None:
    assert merge_period([]) is None
    assert merge_period([5.0]) is None
    assert merge_period([0.0, 10.0]) == 10.0
    # gaps 20, 20.5, 19.5, 20: the shortest, 19.5
    assert merge_period([0.0, 20.0, 40.5, 60.0, 80.0]) == 19.5
    # a late merge (a gap of 30, a fill step's lateness, say) does not lengthen it (a median
    # of 20, 30, 30, 30 would be 30: fills feeding on their own lateness)
    assert merge_period([0.0, 20.0, 40.0, 70.0, 90.0]) == 20.0
    assert merge_period([0.0, 20.0, 50.0, 80.0, 110.0]) == 20.0
    # only the last four gaps: 10, then 20, 20, 20, 22 -> 20
    assert merge_period([0.0, 10.0, 30.0, 50.0, 70.0, 92.0]) == 20.0
    assert merge_period([0.0, 0.0]) is None  # no increase: no period


def test_steps_to_due() -> None:
    # H_i = 3, fragment 0 due at 3, 6, 9; fragment 1 (offset 1) at 4, 7, 10
    assert steps_to_due(4, 3, 0) == 2  # 6
    assert steps_to_due(4, 3, 1) == 3  # 7
    assert steps_to_due(6, 3, 0) == 3  # 9: due at 6 itself is behind
    assert steps_to_due(5, 3, 0) == 1
    with pytest.raises(ValueError):
        steps_to_due(1, 0, 0)


def _fill(now: float, t: float, frags: list[FillFragment], waited: int = 0) -> bool:
    return fills_wait(
        now=now, step_time=t, period=20.0, room=ROOM, fragments=frags, waited=frags[waited]
    )


def test_a_5x_island_fills_one_step_a_round() -> None:
    """5x, H = 20: H_i = floor(0.9 x 4) = 3, a 15 s round of the 20 s merge period; one fragment,
    τ = 1: pushed at position 3 (t = 15), waits at 4 (t = 20) for the merge due at 20."""
    wait = FillFragment(due_in=2, last_arrival=0.0, in_flight=True)
    # its next push, a fill step and 2 positions on, at 20 + 3 x 5 = 35 <= 40 - 0.2 x 20 = 36
    assert _fill(20.0, 5.0, [wait])
    # the merge not there after the fill step (t = 25): overdue by more than the room (24)
    assert not _fill(25.0, 5.0, [wait])
    # with 3 positions to its push (an H_i of 4 steps, 20 s): 20 + 20 = 40 > 36, no fill
    assert not _fill(20.0, 5.0, [FillFragment(due_in=3, last_arrival=0.0, in_flight=True)])


def test_a_3x_island_fills_every_other_period() -> None:
    """3x, H = 20: H_i = floor(0.9 x 6.67) = 6, 18 s of the 20 s period; τ = 1. Applied at M = 0,
    pushed at position 6 (t = 15), waits at 7 (t = 18): its push 5 positions on."""
    assert _fill(18.0, 3.0, [FillFragment(due_in=5, last_arrival=0.0, in_flight=True)])
    # 18 + 3 x 6 = 36 <= 40 - 4 (the fill room, exactly). The fill step ends at 21 (the merge
    # applied), the push at 36, the wait at 39 for the merge at 40: 39 + 18 = 57 > 56, it
    # blocks; applied at 40, its wait at 58: 58 + 18 = 76 <= 76, fills again: 6.5 steps a
    # period of its 6.67
    assert not _fill(39.0, 3.0, [FillFragment(due_in=5, last_arrival=20.0, in_flight=True)])
    assert _fill(58.0, 3.0, [FillFragment(due_in=5, last_arrival=40.0, in_flight=True)])
    # a step of 3.1 at 18: 18 + 18.6 = 36.6 > 36, blocks
    assert not _fill(18.0, 3.1, [FillFragment(due_in=5, last_arrival=0.0, in_flight=True)])


def test_every_fragments_next_push_must_stay_on_time() -> None:
    """Two fragments, 5x, H_i = 3 (offsets 0, 1), τ = 1; fast islands' merges of fragment 0 at
    0, 20, 40 and of fragment 1 at 10, 30."""
    # t = 20: fragment 0 waited (pushed at 15, its merge due at 20: next push 2 on, merge 40);
    # fragment 1 just pushed (merge 30, its next push 3 on feeds the merge at 50):
    # 20 + 15 = 35 <= 40 - 4 and 20 + 20 = 40 <= 50 - 4
    f0 = FillFragment(due_in=2, last_arrival=0.0, in_flight=True)
    f1 = FillFragment(due_in=3, last_arrival=10.0, in_flight=True)
    assert _fill(20.0, 5.0, [f0, f1], waited=0)
    # t = 30: fragment 1 waited (merge due 30); fragment 0 applied at 20.1, due 1 on and its
    # push feeds the merge at 40.1: 30 + 10 = 40 > 36.1, no fill (its push would be late)
    f0 = FillFragment(due_in=1, last_arrival=20.1, in_flight=False)
    f1 = FillFragment(due_in=2, last_arrival=10.0, in_flight=True)
    assert not _fill(30.0, 5.0, [f0, f1], waited=1)
    # with its merge at 25.1 (its next at 45.1): 30 + 10 = 40 <= 41.1, fills
    f0 = FillFragment(due_in=1, last_arrival=25.1, in_flight=False)
    assert _fill(30.0, 5.0, [f0, f1], waited=1)


def test_no_fill_without_a_step_time_or_a_period() -> None:
    wait = FillFragment(due_in=2, last_arrival=0.0, in_flight=True)
    for step_time, period, room in ((0.0, 20.0, ROOM), (5.0, 0.0, ROOM), (5.0, 20.0, 1.0)):
        assert not fills_wait(
            now=20.0, step_time=step_time, period=period, room=room, fragments=[wait], waited=wait
        )


def test_a_drift_mid_job_stops_the_fills() -> None:
    """The 5x island slows mid-job (a node replaced by an older one) before its syncer cuts its
    round: a fill step puts its push, 2 positions on, at 20 + 3 t against 36; at 7x (21 s a
    round, late already) none."""
    wait = FillFragment(due_in=2, last_arrival=0.0, in_flight=True)
    assert _fill(20.0, 5.0, [wait])
    assert _fill(20.0, 16 / 3, [wait])  # 20 + 16 = 36 <= 36
    assert not _fill(20.0, 5.5, [wait])  # 36.5 > 36
    assert not _fill(21.0, 7.0, [wait])


def _slow_island() -> tuple[FragmentSync, FakeLink, nn.Parameter, list[float]]:
    """A learner at K = M (2 of 2), H = 8, τ = 1, one fragment, whose syncer names H_i = 4;
    its clock for fill steps is `now[0]`, steps of 1 s, merges every 10 s (the last at 20:
    version 3, so its waits are past the fragment's first merge, first_fill_cap's)."""
    spec = make_spec(quorum=2, overlapSteps=1, overlapMode="fixed")
    spec = spec.model_copy(update={"inner": spec.inner.model_copy(update={"steps": 8})})
    link = FakeLink(outer_lr=1.0)
    link.inner_steps = 4
    sync, w = make_sync(spec, link, version=3)
    sync.step_time = 1.0
    now = [0.0]
    sync.fill.clock = lambda: now[0]
    sync.fill.arrivals = {0: [0.0, 10.0, 20.0]}
    return sync, link, w, now


def test_a_slow_island_fills_its_merge_wait_and_its_next_push_carries_the_fill_steps() -> None:
    sync, link, w, now = _slow_island()
    for _ in range(3):
        step(sync, w)
    assert sync.round_steps == 4  # adopted in its first round (step_plan.adopt_round)
    link.hold = True  # the merge of the push at position 4 is not back until release()
    step(sync, w)
    assert [meta.steps for _, meta, _ in link.pushes] == [4]
    now[0] = 25.0  # step 5, τ after the push: its wait. Its next push 3 positions on:
    step(sync, w)  # 25 + 1 x 4 = 29 <= (max(20 + 10, 25) + 10) - 0.2 x 10 = 38: a fill step
    assert (sync.position, sync.fill.next, sync.fill.filling) == (5, True, {0})
    now[0] = 26.0
    step(sync, w)  # the fill step (position 5 still); not back: 30 <= 38, fills again
    assert (sync.position, sync.fill.steps) == (5, 2)
    link.release()
    now[0] = 27.0
    assert step(sync, w) != {}  # the second fill step; the merge polled and applied
    assert (sync.position, sync.fill.next, sync.fill.filling) == (5, False, set())
    for _ in range(3):  # positions 6, 7, 8: pushed at 8
        step(sync, w)
    # the push carries τ's step, the two fill steps and the round's 3: 6 steps
    assert [meta.steps for _, meta, _ in link.pushes] == [4, 6]
    # the fill steps are no part of a round: step 1 at 8 / 8 (before the adoption), steps 2-5
    # and 8-10 at 8 / 4 each: 1 + 7 x 2 = 15 (with the fill steps counted it would be 19)
    assert sync.round_work == 15.0


def test_an_overdue_merge_is_waited_for_past_the_cap_and_an_island_at_h_fills_by_its_cap() -> None:
    sync, link, w, now = _slow_island()
    for _ in range(4):
        step(sync, w)
    now[0] = 32.5  # the merge due at 30 is overdue by more than the room (2 s)
    link.hold = True
    sync.inflight[0].future = concurrent.futures.Future()  # not back
    # the drift rule first, a slow island's too (issue 47): cap floor(0.2 x 8) = 1, none taken
    # since the push, so it fills, overdue or not
    assert sync.fill.drift_cap == 1 and sync.fill.fills(sync, 0)
    sync.fill.since_push[0] = 1  # at the cap: fills_wait alone, and the merge is overdue
    assert not sync.fill.fills(sync, 0)
    now[0] = 25.0  # not overdue: fills_wait fills past the cap (29 <= 38, as above)
    assert sync.fill.fills(sync, 0)
    # H: an island at H takes fill steps by fills_drift (its cap) alone, never by the period
    sync.round_steps = 8
    assert not sync.fill.fills(sync, 0)  # 1 since the push: the cap
    sync.fill.since_push[0] = 0
    now[0] = 32.5
    assert sync.fill.fills(sync, 0)


def test_drift_fill_cap_is_a_fifth_of_h_rounded_down() -> None:
    assert FILL_ROOM == 0.2
    assert drift_fill_cap(30) == 6  # a push of at most 36 steps
    assert drift_fill_cap(20) == 4
    assert drift_fill_cap(10) == 2
    assert drift_fill_cap(8) == 1  # 1.6
    assert drift_fill_cap(4) == 0  # 0.8: no fill steps at all
    assert drift_fill_cap(30, 0.1) == 3


def test_an_island_at_h_fills_while_every_push_is_under_the_cap() -> None:
    assert fills_drift(since_push=[0], cap=6)
    assert fills_drift(since_push=[5, 2], cap=6)  # the 6th of fragment 0's push
    assert not fills_drift(since_push=[6, 0], cap=6)  # fragment 0's push has 6: a 7th is over
    assert not fills_drift(since_push=[0, 6], cap=6)  # any fragment's
    assert not fills_drift(since_push=[0], cap=0)  # H < 5: none


def test_first_fill_cap_is_a_round() -> None:
    # H = 30: a first merge's wait takes up to 30 fill steps (a push of at most τ + 60, inside
    # the syncer's 4 x 30 + τ); none where the drift cap is 0 (fixed rounds, H < 5)
    assert first_fill_cap(30, drift_fill_cap(30)) == 30
    assert first_fill_cap(10, drift_fill_cap(10)) == 10
    assert first_fill_cap(4, drift_fill_cap(4)) == 0  # drift cap floor(0.8) = 0
    assert first_fill_cap(30, 0) == 0


def test_an_island_at_h_fills_its_first_merge_wait_up_to_a_round_then_the_cap() -> None:
    """K = M (2 of 2), H = 10 (the syncer's H_i too), τ = 1, one fragment, a fresh job (version
    0): the first merge's wait (the start-up offset) is filled up to first_fill_cap = H = 10
    fill steps; the second's up to drift_fill_cap = floor(0.2 x 10) = 2, as before."""
    spec = make_spec(quorum=2, overlapSteps=1, overlapMode="fixed")
    spec = spec.model_copy(update={"inner": spec.inner.model_copy(update={"steps": 10})})
    link = FakeLink(outer_lr=1.0)
    link.inner_steps = 10
    sync, w = make_sync(spec, link)
    assert (sync.fill.drift_cap, sync.fill.first_cap, sync.fill.arrivals) == (2, 10, {})
    for _ in range(9):
        step(sync, w)
    link.hold = True  # the merge of the push at position 10 is not back until release()
    step(sync, w)
    assert [meta.steps for _, meta, _ in link.pushes] == [10]
    step(sync, w)  # position 11, τ after the push: its wait, filled (0 of 10 since the push)
    assert (sync.position, sync.fill.next, sync.fill.since_push) == (11, True, {0: 1})
    assert sync.fill.cap(sync, 0) == 10  # version 0: the fragment's first merge
    for n in range(2, 11):  # fill steps 1-9, the merge not back: n - 1 < 10, fills again
        step(sync, w)
        assert (sync.position, sync.fill.steps, sync.fill.since_push) == (11, n, {0: n})
    assert not sync.fill.fills(sync, 0)  # an 11th would be over a round: it would block
    link.release()
    assert step(sync, w) != {}  # the 10th fill step; the merge waited for (back) and applied
    assert (sync.position, sync.fill.next, sync.fill.filling) == (11, False, set())
    for _ in range(8):  # positions 12-19
        step(sync, w)
    link.hold = True
    step(sync, w)  # position 20: pushed
    # the push carries τ's step, the 10 fill steps and positions 12-20: 1 + 10 + 9 = 20 = 2 x H
    assert [meta.steps for _, meta, _ in link.pushes] == [10, 20]
    assert sync.fill.since_push == {0: 0}
    # the fill steps are no part of a round: 20 positions at 10 / 10 each (30 with them)
    assert sync.round_work == 20.0
    # the second merge (version 1 held): the cap, 2, as at any later wait
    step(sync, w)  # position 21: its wait, filled (0 of 2)
    assert (sync.position, sync.fill.since_push, sync.fill.cap(sync, 0)) == (21, {0: 1}, 2)
    step(sync, w)  # the first fill step; not back: 1 < 2, fills again
    assert (sync.position, sync.fill.steps, sync.fill.since_push) == (21, 12, {0: 2})
    assert not sync.fill.fills(sync, 0)  # a third would be over the cap: it would block
    link.release()
    assert step(sync, w) != {}


def test_a_wait_past_the_cap_is_logged_as_a_merge_wait(caplog: pytest.LogCaptureFixture) -> None:
    """The same job as above, but joined at version 3 (a running job's: its first wait is
    drift, capped at 2, not the start-up's); the merge comes back 0.3 s after the cap's two fill
    steps, so the third step's settle blocks for it: that wait is logged as any merge wait
    (bench.studies.km_waits reads "waited ...s for fragment f"; before, a wait past the cap went
    unlogged)."""
    spec = make_spec(quorum=2, overlapSteps=1, overlapMode="fixed")
    spec = spec.model_copy(update={"inner": spec.inner.model_copy(update={"steps": 10})})
    link = FakeLink(outer_lr=1.0)
    link.inner_steps = 10
    sync, w = make_sync(spec, link, version=3)
    for _ in range(9):
        step(sync, w)
    link.hold = True
    for _ in range(3):  # the push at 10, τ's step at 11 and the first fill step
        step(sync, w)
    assert sync.fill.since_push == {0: 2} and not sync.fill.fills(sync, 0)
    timer = threading.Timer(0.3, link.release)  # the merge back while the next step blocks
    timer.start()
    with caplog.at_level(logging.INFO, logger="diloco.learner"):
        assert step(sync, w) != {}  # the second fill step, then the wait past the cap
    timer.join()
    waits = [r.getMessage() for r in caplog.records if "for fragment 0 (after" in r.getMessage()]
    assert len(waits) == 1, waits
    assert re.fullmatch(
        r"step 11: waited (\d+\.\d\d)s for fragment 0 \(after 2 fill steps\)", waits[0]
    )
    assert float(waits[0].split()[3][:-1]) >= 0.05


def test_fixed_rounds_take_no_fill_step_at_h() -> None:
    """inner.stepsPerIsland fixed: cap 0, so an island at H blocks as before (exact budgets,
    repeatable runs); auto at H = 8: cap floor(1.6) = 1."""
    sync, _, w, _ = _slow_island()
    for _ in range(4):
        step(sync, w)
    sync.inflight[0].future = concurrent.futures.Future()  # not back
    sync.round_steps = 8
    assert sync.fill.drift_cap == 1 and sync.fill.fills(sync, 0)
    spec = sync.spec.model_copy(
        update={"inner": sync.spec.inner.model_copy(update={"steps_per_island": "fixed"})}
    )
    fixed = FillSteps(spec)
    fixed.since_push = dict(sync.fill.since_push)
    assert fixed.drift_cap == 0
    sync.fill = fixed
    assert not sync.fill.fills(sync, 0)


def _three_x_island() -> tuple[FragmentSync, FakeLink, nn.Parameter, list[float]]:
    """A 3x island at K = M (2 of 2), H = 20, τ = 1, one fragment, whose syncer names H_i =
    floor(0.9 x 20 / 3) = 6 (core/island_rounds.sized_steps); in units of a fast island's step:
    its steps take 3.1 (3x plus its share of the sync path: bench.hetero --emulate-step-ms 50
    read 0.15-0.16 s), merges every 20, the last at 40 (version 3: past the first merge). Cap
    floor(0.2 x 20) = 4 (counted in H)."""
    spec = make_spec(quorum=2, overlapSteps=1, overlapMode="fixed")
    spec = spec.model_copy(update={"inner": spec.inner.model_copy(update={"steps": 20})})
    link = FakeLink(outer_lr=1.0)
    link.inner_steps = 6
    sync, w = make_sync(spec, link, version=3)
    sync.step_time = 3.1
    now = [0.0]
    sync.fill.clock = lambda: now[0]
    sync.fill.arrivals = {0: [0.0, 20.0, 40.0]}
    for _ in range(5):
        step(sync, w)
    assert sync.round_steps == 6  # adopted in its first round
    link.hold = True  # the merge of the push at position 6 is not back until release()
    step(sync, w)
    assert [meta.steps for _, meta, _ in link.pushes] == [6]
    # Its wait, τ after the push (position 7), at 58: its 6 steps of 3.1 (18.6) ended 1.4 short
    # of the merge due at 60; applied at 40.
    now[0] = 58.0
    return sync, link, w, now


def test_a_3x_island_fills_its_merge_wait_by_the_drift_rule() -> None:
    """Issue 47: fills_wait alone never let the 3x island fill (its push 5 positions on, a step
    later: 58 + 3.1 x 6 = 76.6 > (max(40 + 20, 58) + 20) - 0.2 x 20 = 76), so it idled to 60,
    its round's slack beyond the room (18.6 of 20) lost every round: 0.87-0.89 of its compute
    share merged. The drift rule fills: the merge at 60 comes during the fill step (58-61.1),
    which is its only one; the island resumes at 61.1, 1.1 after the merge (at most one of its
    steps), and its next push, 5 steps on, at 61.1 + 15.5 = 76.6 still precedes the fast
    islands' at 80: the merge after is not late."""
    sync, link, w, now = _three_x_island()
    wait = FillFragment(due_in=5, last_arrival=40.0, in_flight=True)
    assert not fills_wait(
        now=58.0, step_time=3.1, period=20.0, room=ROOM, fragments=[wait], waited=wait
    )
    step(sync, w)  # position 7: the wait, filled (0 of 4 since the push)
    assert (sync.position, sync.fill.next, sync.fill.filling) == (7, True, {0})
    assert sync.fill.since_push == {0: 1}
    link.release()  # back during the fill step
    now[0] = 61.1
    assert step(sync, w) != {}  # the fill step; the merge polled and applied
    assert (sync.position, sync.fill.next, sync.fill.steps) == (7, False, 1)
    for _ in range(5):  # positions 8-12: pushed at 12
        step(sync, w)
    # the push carries τ's step, the fill step and the round's 5: 7 steps of its 6-step round
    assert [meta.steps for _, meta, _ in link.pushes] == [6, 7]
    assert sync.fill.since_push == {0: 0}


def test_a_3x_island_stops_filling_at_the_cap_when_the_merge_does_not_come() -> None:
    """A peer gone: the merge due at 60 never comes. The 3x island takes 4 fill steps (the cap,
    floor(0.2 x 20), counted in H: floor(0.2 x 6) would be 1, and 0 for a 4x or 5x island's
    H_i of 4 or 3), 58 to 70.4, then blocks as before: fills_wait too says no (overdue by 10.4,
    more than 0.2 x 20). Its push then carries 6 + 4 = 10 steps, under an island at H's capped
    24."""
    sync, link, w, now = _three_x_island()
    for n in range(1, 5):
        step(sync, w)  # the wait at 7, then fill steps 1-3 (the merge not back)
        now[0] += 3.1
        assert (sync.position, sync.fill.next, sync.fill.since_push) == (7, True, {0: n})
    assert sync.fill.steps == 4 and sync.fill.drift_cap == 4
    assert not sync.fill.fills(sync, 0)  # at 70.4: the cap, and overdue for fills_wait
    link.release()  # so that the fourth fill step's settle, which blocks, returns
    assert step(sync, w) != {}
    assert (sync.position, sync.fill.next, sync.fill.steps) == (7, False, 4)
