"""sync.lateMergeHold auto (issue 45, kept16): a learner that does not block for its merge (K < M)
holds its inner steps once a push is B = max(ceil(H_i / 2), τ) steps old and its merge is not
installed, up to the wait budget, so at most B steps are kept on top of a merge
(step_plan.late_merge_bound, holds_for_late_merge; FragmentSync._hold_late).

Driven step by step against test_learner_fragment_sync's fake link, whose merges are held back
(hold=True) until the test releases them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from diloco_trainer.api.spec import JobSpec, parse_spec
from diloco_trainer.learner.step_plan import holds_for_late_merge, late_merge_bound

from .test_learner_fragment_sync import make_sync, step
from .test_learner_step_cap import HeldLink, steps_in_thread, wait_for

H, TAU = 6, 1  # B = max(ceil(6 / 2), 1) = 3


def hold_spec(**sync: Any) -> JobSpec:
    """H = 6, τ = 1, K = 1 of 2 islands: a decoupled learner, B = 3."""
    return parse_spec(
        {
            "islands": {"count": 2},
            "inner": {"steps": H},
            "sync": {
                "fragments": 1,
                "overlapSteps": TAU,
                "quorum": 1,
                "compression": "none",
                **sync,
            },
        }
    )


def test_the_bound_is_half_a_round_rounded_up_never_before_the_overlap() -> None:
    assert late_merge_bound(30, (5, 5)) == 15  # H = 30, τ = 5: ceil(30 / 2)
    assert late_merge_bound(30, (1, 5)) == 15  # applyFrom arrival: the deadline, not the poll
    assert late_merge_bound(31, (5, 5)) == 16  # ceil(31 / 2)
    assert late_merge_bound(30, (20, 20)) == 20  # τ = 20 > 15: not held before the overlap
    assert late_merge_bound(1, (0, 0)) == 1
    with pytest.raises(ValueError):
        late_merge_bound(0, (0, 0))


def test_holds_at_h_30_from_15_steps_after_the_push() -> None:
    # H = 30, τ = 5, a merge out since the push at step p = 60: steps 61..74 are 1..14 steps
    # since it (no hold: the merge is polled each step as before); after step 75 (15) it holds.
    bound = late_merge_bound(30, (5, 5))
    p = 60
    held = [
        s
        for s in range(p + 1, p + 31)
        if holds_for_late_merge(blocking=False, steps_since_push=s - p, bound=bound)
    ]
    assert held[0] == 75
    # A learner that blocks (K = M or τ = 0) waits at its deadline already: never held here.
    assert not holds_for_late_merge(blocking=True, steps_since_push=15, bound=bound)
    # A push whose wait budget a hold spent already trains on (a dead syncer never stalls it).
    assert not holds_for_late_merge(blocking=False, steps_since_push=16, bound=15, given_up=True)
    assert not holds_for_late_merge(blocking=False, steps_since_push=15, bound=15, mode="off")
    with pytest.raises(ValueError):
        holds_for_late_merge(blocking=False, steps_since_push=15, bound=15, mode="always")
    with pytest.raises(ValueError):
        holds_for_late_merge(blocking=False, steps_since_push=-1, bound=15)


def test_a_late_merge_is_held_for_b_steps_after_the_push_and_keeps_b_steps() -> None:
    link = HeldLink(outer_lr=0.25)
    link.hold = True
    sync, w = make_sync(hold_spec(), link)
    assert not sync.blocking
    thread = steps_in_thread(sync, w, 12)
    # Pushed after step 6 (Δ = 0 − 6 = −6); steps 7, 8, 9 are 1, 2, 3 since it: after step 9
    # the learner holds (takes no step 10) until the merge is installed.
    wait_for(lambda: sync.late_held_since is not None, "the learner to hold")
    assert sync.position == 9 and thread.is_alive()
    assert torch.equal(w.detach(), torch.full((2,), 9.0))  # w += 1 per step taken
    assert [meta.steps for _, meta, _ in link.pushes] == [6]
    link.hold = False
    link.release()
    thread.join(timeout=30)
    assert not thread.is_alive() and sync.late_held_since is None
    assert sync.take_waited() > 0  # the hold counts as time waiting for the syncer
    # Merge: θ_global = 0 − 0.25·(−6) = 1.5; installed keeping the 3 steps: 1.5 + (9 − 6) = 4.5;
    # steps 10, 11, 12 then w = 7.5. The push at 12 carries steps 7..12 (6), 3 of them kept.
    assert sync.position == 12
    pushes = [meta for _, meta, _ in link.pushes]
    assert [m.steps for m in pushes] == [6, 6]
    assert [m.kept_steps for m in pushes] == [0, 3]


def test_off_trains_on_as_before() -> None:
    link = HeldLink(outer_lr=0.25)
    link.hold = True
    sync, w = make_sync(hold_spec(lateMergeHold="off"), link)
    for _ in range(11):
        assert step(sync, w) == {}  # no hold at 9: trains on, polling each step
    assert sync.position == 11 and 0 in sync.inflight
    assert sync.inflight[0].trained == 5 and sync.take_waited() < 0.05  # polls only


def test_a_fill_step_counts_towards_the_bound() -> None:
    # A step that moves no position (a fill or phase-delay step) is trained all the same and
    # kept on top of the merge: after the push at 6, step 7 is a fill step (position stays 6),
    # so the third step since the push is at position 8, and the learner holds there.
    link = HeldLink(outer_lr=0.25)
    link.hold = True
    sync, w = make_sync(hold_spec(), link)
    for _ in range(6):
        step(sync, w)
    assert sync.position == 6 and 0 in sync.inflight
    sync.fill.next = True
    step(sync, w)
    assert sync.position == 6 and sync.inflight[0].trained == 1
    thread = steps_in_thread(sync, w, 3)
    wait_for(lambda: sync.late_held_since is not None, "the learner to hold")
    assert sync.position == 8 and sync.inflight[0].trained == 3
    link.hold = False
    link.release()
    thread.join(timeout=30)
    assert not thread.is_alive() and 0 not in sync.inflight


def test_a_spent_budget_trains_on_and_a_push_again_holds_afresh() -> None:
    # No merge comes (a syncer down): the hold after step 9 lasts the wait budget (the heartbeat
    # timeout, 0.3 s here), then the learner trains on without holding for that push again.
    link = HeldLink(outer_lr=0.25)
    link.hold = True
    sync, w = make_sync(hold_spec(heartbeatTimeoutSeconds=0.3), link)
    for _ in range(8):
        step(sync, w)
    sync.take_waited()
    step(sync, w)  # step 9: held the budget out
    assert sync.take_waited() >= 0.3
    flight = sync.inflight[0]
    assert flight.hold_given_up and flight.trained == 3
    step(sync, w)  # step 10: no hold (given up)
    assert sync.take_waited() < 0.3 and sync.position == 10
    # The push made again (as resend_lost does after a syncer restart lost or refused it) is a
    # new push: its B steps count from it, so no hold at steps 11, 12, one after step 13.
    sync.push(0, flight.step, flight.window, again=True)
    assert sync.inflight[0].trained == 0 and not sync.inflight[0].hold_given_up
    for _ in range(2):
        step(sync, w)
        assert sync.take_waited() < 0.3
    step(sync, w)
    assert sync.take_waited() >= 0.3 and sync.inflight[0].hold_given_up


def test_a_refused_push_ends_the_hold() -> None:
    # The syncer refuses the push (400): its answer is taken like a merge's, the hold ends,
    # and nothing of that push is in flight to hold for.
    link = HeldLink(outer_lr=0.25)
    link.hold = True
    link.refuse = True
    sync, w = make_sync(hold_spec(), link)
    thread = steps_in_thread(sync, w, 10)
    wait_for(lambda: sync.late_held_since is not None, "the learner to hold")
    assert sync.position == 9
    link.hold = False
    link.release()
    thread.join(timeout=30)
    assert not thread.is_alive() and sync.position == 10
    assert sync.late_held_since is None and 0 not in sync.inflight
