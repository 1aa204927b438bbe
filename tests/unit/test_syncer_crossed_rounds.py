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
from diloco_trainer.syncer.state.rounds import RoundPolicy, SyncState

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


def test_crossed_rounds_of_learners_that_do_not_block_count_held_islands_and_the_quorum() -> None:
    # K = 2, islands a and b each alone in a round, both held at the step cap: each round is
    # short of the quorum (1 < 2) and lacks the other, held with its push in the other round.
    assert crossed_rounds([{"a"}, {"b"}], {"a", "b"}, quorum=2, held={"a", "b"}) == {0, 1}
    # b not held: it pushes on (fragment 0 at its next sync point), so fragment 0 drops; then
    # fragment 1 lacks a, whose push is in no round left: drops too. Not crossed.
    assert crossed_rounds([{"a"}, {"b"}], {"a", "b"}, quorum=2, held={"a"}) == frozenset()
    # A third island c, active and not held (nothing pending): both rounds lack it and it will
    # push them, so neither is crossed, held or not (the blocking rule says the same).
    abc = {"a", "b", "c"}
    assert crossed_rounds([{"a"}, {"b"}], abc, quorum=2, held={"a", "b"}) == frozenset()
    # c has pushed fragment 1: its round has the quorum (2 of 2, merges as any round): no part
    # of it; fragment 0 lacks b, whose push is in no round left, and c (not held): drops.
    assert crossed_rounds([{"a"}, {"b", "c"}], abc, quorum=2, held={"a", "b"}) == frozenset()
    # K = 3 of 3 non-blocking (τ > 0), c held too with its push beside a's in fragment 0: 2 < 3
    # pushes there, 1 < 3 in fragment 1; fragment 0 lacks b (held, in 1), fragment 1 lacks a
    # and c (held, in 0): crossed.
    held3 = crossed_rounds([{"a", "c"}, {"b"}], abc, quorum=3, held=abc)
    assert held3 == {0, 1}
    # The same pending pushes with blocking learners (held None): the same set.
    assert crossed_rounds([{"a", "c"}, {"b"}], abc) == held3


def decoupled_state(*, islands: int, expected: int) -> SyncState:
    """K = 2, two fragments, learners that do not block (K < M, τ > 0), H = 6, grace 0.2 s,
    a 600 s start-up timeout; `islands` joined at 0 of `expected`."""
    policy = RoundPolicy(
        quorum=2,
        max_staleness=2,
        heartbeat_timeout=4.0,
        grace_seconds=0.2,
        startup_timeout=600.0,
        overlap_steps=1,
        inner_steps=6,
        offsets=(0, 3),
        learners_block=False,
    )
    state = SyncState(policy, 2)
    state.membership.expect(expected, now=0.0)
    for i in range(islands):
        state.membership.join(f"island-{i}", 1, now=0.0)
    return state


def hold(state: SyncState, island: str, now: float, *, holding: bool = True) -> None:
    """A heartbeat saying whether the island's learner holds at the step cap."""
    state.membership.heartbeat(island, now, step=30, tokens=3000, step_time=0.05, holding=holding)


def test_k_below_m_merges_the_round_of_two_islands_held_at_the_step_cap_crossed() -> None:
    """CI's test_drain_at_k_below_m_stops_each_island_at_its_target[3-2] (drain48): K = 2 of 3,
    island-2 never up (awaited: the quorum stays 2 for its 600 s start-up timeout). Island-0's
    push of fragment 0 (t = 10) and island-1's of fragment 1 (t = 10.1) are each alone in their
    round, and each island then holds at the step cap (heartbeats at 10.4 and 10.5): it pushes
    nothing more, the other fragment included, until its own push is merged. Before, nothing
    merged until t = 600. Now crossed from 10.5; fragment 0 (one push each: the lowest) merges
    without island-1 at 10.5 + grace 0.2 + (H + 1) x island-1's step 0.05 = 10.5 + 0.2 + 0.35
    = 11.05."""
    state = decoupled_state(islands=2, expected=3)
    assert state.membership.awaited() == 1 and state.effective_quorum() == 2
    push(state, "island-0", 10.0, fragment=0, step_time=0.05)
    push(state, "island-1", 10.1, fragment=1, step_time=0.05)
    hold(state, "island-0", 10.4)
    # island-1 still trains (it pushes fragment 0 at its next sync point): nothing crossed.
    assert state.crossed_round(10.4) is None and state.due_fragments(10.45) == []
    hold(state, "island-1", 10.5)
    assert state.crossed_round(10.5) == (0, pytest.approx(11.05))
    assert state.next_deadline() == pytest.approx(11.05)
    assert state.due_fragments(11.04) == []
    assert state.due_fragments(11.05) == [0]  # fragment 1 waits: island-0 pushes it next
    taken = state.take_round(0, 11.05)
    assert [c.island for c in taken] == ["island-0"]
    # Island-0 takes the merge and steps on: its heartbeat no longer holds; fragment 1 then
    # waits for its push as any round (no crossing left).
    hold(state, "island-0", 11.2, holding=False)
    assert state.crossed_round(11.2) is None and state.due_fragments(300.0) == []
    push(state, "island-0", 11.3, fragment=1, step_time=0.05)
    assert state.due_fragments(11.3 + 0.2) == [1]  # the quorum of 2, awaited island-2's window


def test_k_below_m_does_not_merge_held_rounds_a_third_active_island_will_complete() -> None:
    """As above, but island-2 joined and trains (not held, nothing pending): it will push both
    fragments, each then at its quorum of 2, so no round is crossed and nothing merges short:
    at t = 300 still nothing. Island-2's push of fragment 1 at 300 brings that round to its
    quorum (2 of 2): due at the grace window's end, 300 + 0.2 (held island-0, missing, counts
    as overdue: arriving now, within the window)."""
    state = decoupled_state(islands=3, expected=3)
    push(state, "island-0", 10.0, fragment=0, step_time=0.05)
    push(state, "island-1", 10.1, fragment=1, step_time=0.05)
    hold(state, "island-0", 10.4)
    hold(state, "island-1", 10.5)
    hold(state, "island-2", 10.5, holding=False)
    assert state.crossed_round(10.5) is None
    assert state.due_fragments(11.05) == [] and state.due_fragments(300.0) == []
    push(state, "island-2", 300.0, fragment=1, step_time=0.05)
    assert state.crossed_round(300.0) is None
    assert state.due_fragments(300.19) == [] and state.due_fragments(300.2) == [1]
