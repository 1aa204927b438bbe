"""A merge at quorum waits for the pushes on their way (issue 45): core/grace.upload_wait_until,
syncer/state/uploads.py and SyncState.merge_due / next_deadline, driven by a fake clock. Every
expected time is derived by hand in the comments."""

from __future__ import annotations

import math

import pytest
from diloco_trainer.core import grace
from diloco_trainer.syncer.state.rounds import DROPPED, Contribution, RoundPolicy, SyncState


def test_upload_wait_is_two_typical_uploads_from_its_start_at_least_grace_at_most_cap() -> None:
    # typical 0.4: 2 x 0.4 = 0.8 > grace 0.1: 10 + 0.8
    assert grace.upload_wait_until(started=10.0, typical=0.4, grace=0.1, cap=30.0) == pytest.approx(
        10.8
    )
    # the grace window when longer: max(1.0, 0.8) = 1.0
    assert grace.upload_wait_until(started=10.0, typical=0.4, grace=1.0, cap=30.0) == pytest.approx(
        11.0
    )
    # the cap when shorter: min(0.5, 0.8) = 0.5
    assert grace.upload_wait_until(started=10.0, typical=0.4, grace=0.1, cap=0.5) == pytest.approx(
        10.5
    )
    # none known (or not usable): the grace window alone
    assert grace.upload_wait_until(started=10.0, typical=None, grace=0.3, cap=30.0) == 10.3
    assert grace.upload_wait_until(started=10.0, typical=math.nan, grace=0.3, cap=30.0) == 10.3
    with pytest.raises(ValueError, match="grace"):
        grace.upload_wait_until(started=0.0, typical=None, grace=math.inf, cap=1.0)


def test_the_typical_upload_is_the_lower_median_over_islands_of_each_ones_median() -> None:
    # one island: its median, 0.4 of 0.2, 0.4, 0.6; an even count averages the middle two
    assert grace.typical_upload({"a": [0.6, 0.2, 0.4]}) == pytest.approx(0.4)
    assert grace.typical_upload({"a": [0.2, 0.4, 0.6, 1.0]}) == pytest.approx(0.5)
    # two islands, one trickling (medians 0.3 and 8.0): the smaller, 0.3; a shared median of
    # all five bodies would read 0.4 here and 8.0 once the trickler has the window's majority
    assert grace.typical_upload({"a": [0.2, 0.3, 0.4], "b": [8.0, 8.0]}) == pytest.approx(0.3)
    assert grace.typical_upload({"a": [0.3], "b": [8.0, 8.0, 8.0]}) == pytest.approx(0.3)
    # three: the middle (0.3 of 0.3, 0.5, 8.0 -> 0.5); four: the second smallest (0.5)
    medians = {"a": [0.3], "b": [0.5], "c": [8.0]}
    assert grace.typical_upload(medians) == pytest.approx(0.5)
    assert grace.typical_upload({**medians, "d": [0.9]}) == pytest.approx(0.5)
    # unusable figures (NaN, negative) are not counted; no island with one: None
    assert grace.typical_upload({"a": [math.nan, -1.0, 0.3]}) == pytest.approx(0.3)
    assert grace.typical_upload({"a": [math.nan], "b": []}) is None
    assert grace.typical_upload({}) is None


def make_state(*, quorum: int = 1, islands: int = 3, grace_s: float = 0.5) -> SyncState:
    policy = RoundPolicy(
        quorum=quorum, max_staleness=4, heartbeat_timeout=30.0, grace_seconds=grace_s
    )
    state = SyncState(policy, 1)
    for i in range(islands):
        state.membership.join(f"island-{i}", 1, now=0.0)
    return state


def push(state: SyncState, island: str, now: float) -> None:
    base = state.versions[0]
    c = Contribution(
        island=island,
        base_version=base,
        lag=state.check_push(0, island, base),
        tokens=100,
        steps=10,
        loss=1.0,
        received_at=now,
        push_id=f"{island}@{now}",
        payload=None,
    )
    state.accept_push(0, c, now)


def with_one_upload_of(state: SyncState, seconds: float) -> None:
    """An accepted push's body that took `seconds` (the typical upload from then on)."""
    assert state.upload_started(0, "island-2", 1.0)
    push(state, "island-2", 1.0 + seconds)
    state.upload_ended(0, "island-2", 1.0, seconds=seconds)
    state.take_round(0, 1.0 + seconds)


def test_a_merge_at_quorum_waits_for_a_missing_islands_push_on_its_way() -> None:
    state = make_state(quorum=1, grace_s=0.5)
    with_one_upload_of(state, 1.0)  # median upload 1.0 s: a wait of 2.0 s from a body's start
    assert state.upload_started(0, "island-1", 9.5)  # island-1's body arriving since 9.5
    push(state, "island-0", 10.0)  # the quorum (K = 1): the window closes at 10.5
    # without the body on its way due at 10.5; with it held until 9.5 + 2 x 1.0 = 11.5
    assert not state.merge_due(0, 10.6)
    assert not state.merge_due(0, 11.49)
    assert state.next_deadline() == 10.5  # the window alone (no `now`)
    assert state.next_deadline(10.6) == 11.5  # the held round's timer: the wait's end
    assert state.merge_due(0, 11.5)  # the wait is over: merged without it
    # the body arrives in time instead: it is in the merge, due at once (window passed)
    push(state, "island-1", 11.0)
    state.upload_ended(0, "island-1", 9.5, seconds=1.5)
    assert state.merge_due(0, 11.0)
    assert [c.island for c in state.take_round(0, 11.0)] == ["island-0", "island-1"]


def test_a_refused_or_ended_body_holds_nothing_and_adds_no_upload_time() -> None:
    state = make_state(quorum=1, grace_s=0.5)
    with_one_upload_of(state, 1.0)
    assert state.upload_started(0, "island-1", 9.5)
    push(state, "island-0", 10.0)
    assert not state.merge_due(0, 10.6)
    state.upload_ended(0, "island-1", 9.5, seconds=None)  # refused: nothing to wait for
    assert state.merge_due(0, 10.6)  # the window (10.5) is past
    # its seconds did not count: the typical upload is still 1.0 (a wait of 2.0 from 20.0)
    state.take_round(0, 10.6)
    assert state.upload_started(0, "island-1", 20.0)
    push(state, "island-0", 20.5)
    assert state.next_deadline(21.1) == 22.0


def test_only_a_missing_spanning_island_on_a_known_fragment_is_waited_for() -> None:
    state = make_state(quorum=1, grace_s=0.5)
    with_one_upload_of(state, 1.0)
    assert not state.upload_started(1, "island-1", 9.5)  # no fragment 1: nothing recorded
    assert not state.upload_started(0, "island-9", 9.5)  # no such island
    state.membership.set_state("island-1", DROPPED, "admin", now=9.0)
    assert not state.upload_started(0, "island-1", 9.5)  # dropped: the rounds do not span it
    state.set_unsupported(frozenset({"island-0"}), 9.0)
    assert not state.upload_started(0, "island-0", 9.5)  # left out by the gate: nor this one
    state.set_unsupported(frozenset(), 9.0)
    # an island whose push is pending already: its next body replaces it, no wait for it
    push(state, "island-0", 10.0)
    assert state.upload_started(0, "island-0", 10.1)
    assert state.merge_due(0, 10.6)


def test_a_newer_body_of_the_same_island_stands_in_for_the_older() -> None:
    state = make_state(quorum=1, grace_s=0.5)
    with_one_upload_of(state, 1.0)
    assert state.upload_started(0, "island-1", 9.0)
    assert state.upload_started(0, "island-1", 9.5)  # a retry: it replaces the first
    state.upload_ended(0, "island-1", 9.0, seconds=None)  # the first ends: the retry holds
    push(state, "island-0", 10.0)
    # ... but its wait counts from the island's first body of the round: 9.0 + 2.0 = 11.0
    assert not state.merge_due(0, 10.99)
    assert state.merge_due(0, 11.0)


def test_bodies_sent_again_and_again_hold_a_round_once() -> None:
    """A slow-loris island: each time the wait for its body ends it cuts the request and sends
    another. Each new body would start a new wait and hold the K < M rounds for ever; the wait
    counts from its first body since the fragment's last merge, so the round merges at
    9.0 + 2 x 1.0 = 11.0 whatever it sends after; the next round's wait starts again."""
    state = make_state(quorum=1, grace_s=0.5)
    with_one_upload_of(state, 1.0)
    assert state.upload_started(0, "island-1", 9.0)
    push(state, "island-0", 10.0)
    assert not state.merge_due(0, 10.9)
    sent = 9.0
    for t in (10.9, 11.0, 11.5, 12.5):  # cut and sent again
        state.upload_ended(0, "island-1", sent, seconds=None)
        assert state.upload_started(0, "island-1", t)
        sent = t
        assert state.merge_due(0, t + 0.01) is (t + 0.01 >= 11.0), t
    assert [c.island for c in state.take_round(0, 12.6)] == ["island-0"]
    # The next round: island-1's body still on its way since 12.5 counts from 12.5 (it is this
    # round's push): island-0's push at 13.0 waits until 12.5 + 2.0 = 14.5, once.
    push(state, "island-0", 13.0)
    assert not state.merge_due(0, 14.49)
    assert state.upload_started(0, "island-1", 14.4)  # sent again: still from 12.5
    assert state.merge_due(0, 14.5)


def test_k_equals_m_is_unchanged_the_quorum_waits_for_every_island_anyway() -> None:
    state = make_state(quorum=3, grace_s=0.5)
    assert state.upload_started(0, "island-2", 9.0)
    push(state, "island-0", 10.0)
    push(state, "island-1", 10.0)
    assert not state.merge_due(0, 100.0)  # no quorum without island-2, body or not
    push(state, "island-2", 10.2)
    state.upload_ended(0, "island-2", 9.0, seconds=1.2)
    assert state.merge_due(0, 10.2)  # all pushed: at once


def test_one_island_trickling_its_bodies_does_not_lengthen_the_wait_for_anothers() -> None:
    """Audit of 2026-12-01 (docs/adversaries.md): island-2's accepted bodies took 8 s each; the
    wait for island-1's body is sized from the lower median over islands of each one's median
    uploads, min(1.0, 8.0) = 1.0, so 2 x 1.0 from its start, not 2 x 8.0 (a shared window the
    trickler fills: 16 s, capped at the heartbeat timeout's 30)."""
    state = make_state(quorum=1, grace_s=0.5)
    for k in range(3):  # island-2: three accepted bodies of 8 s
        start = 1.0 + 10.0 * k
        assert state.upload_started(0, "island-2", start)
        push(state, "island-2", start + 8.0)
        state.upload_ended(0, "island-2", start, seconds=8.0)
        state.take_round(0, start + 8.0)
    assert state.upload_started(0, "island-1", 40.0)  # island-1: one body of 1 s
    push(state, "island-1", 41.0)
    state.upload_ended(0, "island-1", 40.0, seconds=1.0)
    state.take_round(0, 41.0)
    assert state.upload_started(0, "island-1", 49.5)  # its next body, on its way since 49.5
    push(state, "island-0", 50.0)  # the quorum; the window closes at 50.5
    assert not state.merge_due(0, 51.49)
    assert state.merge_due(0, 51.5)  # 49.5 + 2 x 1.0, not 49.5 + 16
    # the trickler's own body is waited for no longer than the others' typical upload either
    state.take_round(0, 51.5)
    assert state.upload_started(0, "island-2", 59.5)
    push(state, "island-0", 60.0)
    assert not state.merge_due(0, 61.49)
    assert state.merge_due(0, 61.5)  # 59.5 + 2 x 1.0
