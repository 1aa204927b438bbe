"""sync.lateMergeHold auto (issue 45, kept16, hold17): a learner that does not block for its merge
(K < M) holds its inner steps once a push is B steps old and its merge is not installed, up to
the wait budget, so at most B steps are kept on top of a merge: B = max(ceil(H_i / 2), τ) where
its recent syncs say the link cannot carry its traffic (F · mean latency > H_i · step time),
else max(H_i − 1, τ) (step_plan.link_bound, late_merge_bound, holds_for_late_merge;
FragmentSync._hold_late).

Driven step by step against test_learner_fragment_sync's fake link, whose merges are held back
(hold=True) until the test releases them, on its fake clock (every step 0.1 s of wall time)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from diloco_trainer.api.spec import JobSpec, parse_spec
from diloco_trainer.learner.fragment_sync import FragmentSync
from diloco_trainer.learner.step_plan import holds_for_late_merge, late_merge_bound, link_bound
from torch import nn

from .test_learner_fragment_sync import FakeLink, make_sync, step
from .test_learner_step_cap import HeldLink, steps_in_thread, wait_for

# Over a link slower than its traffic B = max(ceil(6 / 2), 1) = 3; elsewhere max(6 − 1, 1) = 5.
H, TAU = 6, 1
# A sync latency over the fake clock's round (H steps of 0.1 s: 0.6 s) at F = 1, and one under.
SLOW, FAST = 0.7, 0.5


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


def link_bound_sync(spec: JobSpec, link: FakeLink) -> tuple[FragmentSync, nn.Parameter]:
    """make_sync's learner with one sync measured at SLOW (0.7 s a fragment, F = 1) against a
    round of 6 steps of 0.1 s: F · ℓ = 0.7 > 0.6, the link slower than its traffic."""
    sync, w = make_sync(spec, link)
    sync.overlap_fit.net_latencies.append(SLOW)
    assert sync.overlap_fit.judge_link(0.1, 0)  # as receive judges it at each sync measured
    return sync, w


def test_the_link_is_slower_than_its_traffic_when_a_rounds_syncs_outlast_the_round() -> None:
    # H = 4 steps of 0.25 s: a round of 1.0 s.
    # F = 2, latencies 0.5 and 0.75 s: 2 · 0.625 = 1.25 s > 1.0 s; at F = 1 0.625 s < 1.0 s.
    assert link_bound([0.5, 0.75], fragments=2, inner_steps=4, step_time=0.25)
    assert not link_bound([0.5, 0.75], fragments=1, inner_steps=4, step_time=0.25)
    # 2 · 0.375 = 0.75 s < 1.0 s; exactly the round (2 · 0.5 = 1.0 s) is not slower than it.
    assert not link_bound([0.25, 0.5], fragments=2, inner_steps=4, step_time=0.25)
    assert not link_bound([0.5, 0.5], fragments=2, inner_steps=4, step_time=0.25)
    # The mean, not the slowest: three syncs of 0.25 s and one of 1.75 s, mean 0.625 s < 1.0 s.
    assert not link_bound([0.25, 0.25, 0.25, 1.75], fragments=1, inner_steps=4, step_time=0.25)
    # A round's steps are H_i's: at H_i = 2 the round is 0.5 s, and 0.625 s outlasts it.
    assert link_bound([0.25, 0.25, 0.25, 1.75], fragments=1, inner_steps=2, step_time=0.25)
    # Readings that are not latencies are left out: 0.75 s alone, 2 · 0.75 = 1.5 s > 1.0 s.
    assert link_bound([math.nan, -1.0, 0.75], fragments=2, inner_steps=4, step_time=0.25)
    # Nothing measured: no evidence of a slow link.
    assert not link_bound([], fragments=2, inner_steps=4, step_time=0.25)
    assert not link_bound([math.inf], fragments=2, inner_steps=4, step_time=0.25)
    assert not link_bound([0.75], fragments=2, inner_steps=4, step_time=0.0)
    with pytest.raises(ValueError):
        link_bound([0.75], fragments=0, inner_steps=4, step_time=0.25)
    with pytest.raises(ValueError):
        link_bound([0.75], fragments=2, inner_steps=0, step_time=0.25)


def test_the_bound_is_half_a_round_over_a_slow_link_else_the_step_before_the_next_push() -> None:
    # Over a link slower than its traffic: ceil(H_i / 2), never before the overlap.
    assert late_merge_bound(30, (5, 5), link_bound=True) == 15  # H = 30, τ = 5: ceil(30 / 2)
    assert late_merge_bound(30, (1, 5), link_bound=True) == 15  # applyFrom arrival: deadline
    assert late_merge_bound(31, (5, 5), link_bound=True) == 16  # ceil(31 / 2)
    assert late_merge_bound(30, (20, 20), link_bound=True) == 20  # τ = 20 > 15
    assert late_merge_bound(1, (0, 0), link_bound=True) == 1
    # Elsewhere: H_i − 1, the last step before the fragment is due again, never below 1.
    assert late_merge_bound(30, (5, 5), link_bound=False) == 29
    assert late_merge_bound(31, (1, 5), link_bound=False) == 30
    assert late_merge_bound(2, (1, 1), link_bound=False) == 1
    assert late_merge_bound(1, (0, 0), link_bound=False) == 1  # H − 1 = 0: at least a step
    with pytest.raises(ValueError):
        late_merge_bound(0, (0, 0), link_bound=True)


def test_holds_at_h_30_from_15_steps_after_the_push_over_a_slow_link_else_from_29() -> None:
    # H = 30, τ = 5, a merge out since the push at step p = 60: steps 61..74 are 1..14 steps
    # since it (no hold: the merge is polled each step as before); after step 75 (15) it holds.
    bound = late_merge_bound(30, (5, 5), link_bound=True)
    p = 60
    held = [
        s
        for s in range(p + 1, p + 31)
        if holds_for_late_merge(blocking=False, steps_since_push=s - p, bound=bound)
    ]
    assert held[0] == 75
    # Where the link carries the traffic: after step 89 (29 since it), the last before the
    # fragment's next push at 90, so that push carries the merge.
    near = late_merge_bound(30, (5, 5), link_bound=False)
    assert [
        s
        for s in range(p + 1, p + 31)
        if holds_for_late_merge(blocking=False, steps_since_push=s - p, bound=near)
    ] == [89, 90]
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
    sync, w = link_bound_sync(hold_spec(), link)
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


def test_no_hold_once_the_syncer_sent_stop_targets() -> None:
    # The rule: B = 3 here, 3 steps since the push hold; with stop targets (the drain under way)
    # they do not, nor any count past B.
    assert holds_for_late_merge(blocking=False, steps_since_push=3, bound=3)
    assert not any(
        holds_for_late_merge(blocking=False, steps_since_push=n, bound=3, stop_targets=True)
        for n in range(3, 13)
    )
    # The learner: the syncer named a stop target (4,096 tokens, not reached) before the push at
    # 6; its merge held back, it trains on past step 9 (3 since the push) polling, as with off:
    # a drained peer's last merge may wait for this learner's next push (CI's test_drain).
    link = HeldLink(outer_lr=0.25)
    link.hold = True
    link.stop_at = 4096
    sync, w = link_bound_sync(hold_spec(), link)
    for _ in range(11):
        assert step(sync, w) == {}
    assert sync.position == 11 and sync.inflight[0].trained == 5
    assert sync.late_held_since is None and sync.take_waited() < 0.05


def test_off_trains_on_as_before() -> None:
    link = HeldLink(outer_lr=0.25)
    link.hold = True
    sync, w = link_bound_sync(hold_spec(lateMergeHold="off"), link)
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
    sync, w = link_bound_sync(hold_spec(), link)
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
    sync, w = link_bound_sync(hold_spec(heartbeatTimeoutSeconds=0.3), link)
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
    sync, w = link_bound_sync(hold_spec(), link)
    thread = steps_in_thread(sync, w, 10)
    wait_for(lambda: sync.late_held_since is not None, "the learner to hold")
    assert sync.position == 9
    link.hold = False
    link.release()
    thread.join(timeout=30)
    assert not thread.is_alive() and sync.position == 10
    assert sync.late_held_since is None and 0 not in sync.inflight


def test_where_the_link_carries_the_traffic_a_late_merge_is_held_at_h_minus_1() -> None:
    # No sync measured (or one of 0.5 s, under the 0.6 s round): pushed after step 6, steps
    # 7..11 are 1..5 since it; after step 11 (H − 1 = 5) it holds, not after step 9.
    for measured in ([], [FAST]):
        link = HeldLink(outer_lr=0.25)
        link.hold = True
        sync, w = make_sync(hold_spec(), link)
        sync.overlap_fit.net_latencies.extend(measured)
        assert not sync.overlap_fit.judge_link(0.1, 0)
        thread = steps_in_thread(sync, w, 12)
        wait_for(lambda sync=sync: sync.late_held_since is not None, "the learner to hold")
        assert sync.position == 11 and thread.is_alive()
        assert torch.equal(w.detach(), torch.full((2,), 11.0))
        link.hold = False
        link.release()
        thread.join(timeout=30)
        assert not thread.is_alive() and sync.late_held_since is None
        # θ_global = 0 − 0.25·(−6) = 1.5, installed keeping 5 steps: 1.5 + (11 − 6) = 6.5; step
        # 12: 7.5 and the fragment's push there, not skipped, carries steps 7..12, 5 of them kept.
        assert sync.position == 12 and torch.equal(w.detach(), torch.full((2,), 7.5))
        pushes = [meta for _, meta, _ in link.pushes]
        assert [m.steps for m in pushes] == [6, 6]
        assert [m.kept_steps for m in pushes] == [0, 5]


def test_the_bound_follows_the_latencies_the_learner_measures() -> None:
    # Every merge says 0.7 s of latency (F · ℓ = 0.7 > 0.6 s a round). The first push (after
    # step 6) has nothing measured: held after step 11 (H − 1). Its merge measures 0.7 s, so the
    # push after step 12 is held after step 15 (ceil(6 / 2) = 3 since it).
    link = HeldLink(outer_lr=0.25, latency=SLOW)
    link.hold = True
    sync, w = make_sync(hold_spec(), link)
    thread = steps_in_thread(sync, w, 18)
    wait_for(lambda: sync.late_held_since is not None, "the first hold")
    assert sync.position == 11 and list(sync.overlap_fit.net_latencies) == []
    link.release()  # the merge of the push at 6; the one of the push at 12 is held back again
    wait_for(lambda: sync.position > 11 and sync.late_held_since is not None, "the second hold")
    assert sync.position == 15 and list(sync.overlap_fit.net_latencies) == [SLOW]
    assert sync.overlap_fit.slow_link  # judged at the receipt: 0.7 s > 6 steps of 0.1 s
    link.hold = False
    link.release()
    thread.join(timeout=30)
    assert not thread.is_alive() and sync.position == 18
    assert [m.kept_steps for _, m, _ in link.pushes] == [0, 5, 3]
