"""Crossed rounds at K = M (issues 46/47, syncer/state/crossed.py).

bench.hetero at 1,1,1,cpu, K = M = 4: the CPU island, let back into fragment 0's rounds,
pushed fragment 0 before fragment 1 where the fast islands pushed fragment 1 first. Fragment
0's round held its push and waited for theirs, fragment 1's held theirs and waited for its, and
each blocking learner waited for the merge of the round it pushed to: no merge until a wait
budget ran out (4 s, 14 s, 43 s, growing). Now such rounds are crossed, and the one of them with
the most pushes merges without the islands it lacks once they stayed crossed for the grace
window plus a step of the slowest of those.
"""

from __future__ import annotations

import pytest
from diloco_trainer.syncer.state.crossed import crossed_rounds, crossed_wait, round_to_close

from .test_rounds import make_state, push

ISLANDS = {"a", "b", "c", "d"}


def test_crossed_rounds_are_the_largest_set_whose_missing_islands_all_wait_in_it() -> None:
    # The bench's case: fragment 0 holds d (the CPU island), fragment 1 holds a, b, c. Fragment
    # 0 lacks a, b, c, each pending in fragment 1; fragment 1 lacks d, pending in fragment 0.
    assert crossed_rounds([{"d"}, {"a", "b", "c"}], ISLANDS) == {0, 1}
    # One order, lockstep: fragment 0 holds a, b (c, d still to push it), fragment 1 nothing
    # (its round merged): c and d have nothing pending, fragment 0 drops; fragment 1 is empty.
    assert crossed_rounds([{"a", "b"}, set()], ISLANDS) == frozenset()
    # One order with both open: a, b pushed fragment 0 then fragment 1; c pushed fragment 0 only;
    # d nothing. Fragment 0 lacks d (nothing pending): drops; then fragment 1 lacks c, d, whose
    # pending pushes are in no round left (c's in fragment 0): drops. Not crossed.
    assert crossed_rounds([{"a", "b", "c"}, {"a", "b"}], ISLANDS) == frozenset()
    # Two islands crossed, a third that pushed neither: fragment 0 lacks c and d, d has
    # nothing pending: it drops; fragment 1 lacks b and d: drops too. Not crossed (d's pushes
    # will come and complete them in its order).
    assert crossed_rounds([{"a", "b"}, {"a", "c"}], ISLANDS) == frozenset()
    # Without d they are: fragment 0 lacks c, pending in 1; fragment 1 lacks b, pending in 0.
    assert crossed_rounds([{"a", "b"}, {"a", "c"}], {"a", "b", "c"}) == {0, 1}
    # Three fragments in a cycle: each lacks the two islands pending in the others.
    assert crossed_rounds([{"a"}, {"b"}, {"c"}], {"a", "b", "c"}) == {0, 1, 2}
    # A cascade: fragment 0's round is complete (no part of it: it merges as any); fragment 1
    # (a) lacks c, pending only there: drops; fragment 2 (b) then lacks a, whose push is in
    # no round left: drops too.
    assert crossed_rounds([{"a", "b", "c"}, {"a"}, {"b"}], {"a", "b", "c"}) == frozenset()
    # Complete rounds are no part of it (they merge anyway).
    assert crossed_rounds([{"a", "b"}, {"a", "b"}], {"a", "b"}) == frozenset()


def test_the_round_closed_is_the_one_with_most_pushes_then_the_lowest_fragment() -> None:
    assert round_to_close({0, 1}, [{"d"}, {"a", "b", "c"}]) == 1
    assert round_to_close({0, 1}, [{"a", "c"}, {"b", "c"}]) == 0  # a tie: the lowest
    assert round_to_close(frozenset(), [{"a"}]) is None


def test_crossed_wait_is_the_grace_window_plus_the_slowest_lacking_islands_step() -> None:
    # grace 0.02 + max(0.04, unknown 0) = 0.06; the islands not lacking (a: 9 s) do not count.
    steps = {"a": 9.0, "c": None, "d": 0.04}
    assert crossed_wait(0.02, steps, {"c", "d"}) == pytest.approx(0.06)
    assert crossed_wait(0.02, steps, set()) == pytest.approx(0.02)
    # With the islands' rounds: a round of the slowest lacking island, (H_i + 1) x its step:
    # d at H = 5: 0.02 + 6 x 0.04 = 0.26 (a: 9 s, not lacking, still does not count).
    rounds = {"a": 30, "c": 5, "d": 5}
    assert crossed_wait(0.02, steps, {"c", "d"}, rounds) == pytest.approx(0.26)
    # CI's syncer restart (two islands a sync point apart, τ > 0, H = 5, 15 ms steps): the
    # lacking island pushes the round's fragment 45 ms after the crossing began; one step
    # (0.015 s) merged the round without it first, a round (0.09 s) waits for it.
    assert crossed_wait(0.0, {"x": 0.015}, {"x"}, {"x": 5}) == pytest.approx(0.09)


def test_k_equals_m_merges_the_crossed_round_with_most_pushes_without_its_lacking_island() -> None:
    """K = M = 3, two fragments, grace 0.5 s: island-2 pushed fragment 0 at t = 10 (step time
    0.25 s), island-0 and island-1 fragment 1 at t = 11 and 12. Neither round has its quorum of
    3, each lacks islands pending in the other: crossed since 12. Fragment 1 (two pushes)
    merges at 12 + 0.5 + 0.25 = 12.75 without island-2; fragment 0 does not."""
    state = make_state(quorum=3, islands=3, grace=0.5, fragments=2)
    push(state, "island-2", 10.0, fragment=0, step_time=0.25)
    assert state.crossed_round(10.0) is None  # fragment 1 empty: nothing crossed
    push(state, "island-0", 11.0, fragment=1, step_time=0.01)
    assert state.crossed_round(11.0) is None  # fragment 0 lacks island-1, nothing pending
    push(state, "island-1", 12.0, fragment=1, step_time=0.01)
    assert state.crossed_round(12.0) == (1, pytest.approx(12.75))
    assert state.next_deadline() == pytest.approx(12.75)
    assert state.rounds[1].quorum_since is None  # no quorum: only the crossing merges it
    assert not state.merge_due(1, 12.7) and not state.merge_due(0, 12.7)
    assert state.merge_due(1, 12.75) and not state.merge_due(0, 12.75)
    taken = state.take_round(1, 12.75)
    assert sorted(c.island for c in taken) == ["island-0", "island-1"]
    # The crossing is undone: fragment 1's round is empty, fragment 0 waits as any round.
    assert state.crossed_round(12.8) is None and not state.merge_due(0, 100.0)


def test_a_change_in_the_crossed_rounds_starts_their_wait_again() -> None:
    """Crossed at 12 (due 12.75); island-0 pushes fragment 1 again at 12.5 (a replacement:
    the same islands pending, so the same crossing, still due 12.75). Island-2 then pushes
    fragment 1 at 12.6: fragment 1 holds all three (complete, merges as any round), and
    fragment 0 (island-2 alone) lacks islands pending in no crossed round: none crossed."""
    state = make_state(quorum=3, islands=3, grace=0.5, fragments=2)
    push(state, "island-2", 10.0, fragment=0, step_time=0.25)
    push(state, "island-0", 11.0, fragment=1, step_time=0.01)
    push(state, "island-1", 12.0, fragment=1, step_time=0.01)
    assert state.crossed_round(12.0) == (1, pytest.approx(12.75))
    push(state, "island-0", 12.5, fragment=1, step_time=0.01)
    assert state.crossed_round(12.5) == (1, pytest.approx(12.75))
    push(state, "island-2", 12.6, fragment=1, step_time=0.25)
    assert state.crossed_round(12.6) is None
    assert state.merge_due(1, 12.6)  # complete: at once, as before


def test_k_below_m_never_crosses() -> None:
    """K = 2 of 3: a quorum of 2 ends each round, nothing waits for the third (no crossing);
    the same pushes at K = M cross."""
    state = make_state(quorum=2, islands=3, grace=0.5, fragments=2)
    push(state, "island-2", 10.0, fragment=0)
    push(state, "island-0", 11.0, fragment=1)
    push(state, "island-1", 11.0, fragment=0)
    assert state.crossed_round(12.0) is None
    km = make_state(quorum=3, islands=3, grace=0.5, fragments=2)
    push(km, "island-2", 10.0, fragment=0)
    push(km, "island-0", 11.0, fragment=1)
    push(km, "island-1", 11.0, fragment=1)
    assert km.crossed_round(11.0) == (1, pytest.approx(11.5))  # steps unknown: the grace alone
