"""The syncer's round/quorum/membership state machine, driven by a fake clock."""

from __future__ import annotations

import pytest
from diloco_trainer.api.protocol import DROPPED_FOR_REFUSALS
from diloco_trainer.core.island_rounds import IslandRound
from diloco_trainer.syncer.errors import Refused
from diloco_trainer.syncer.state.rounds import (
    ACTIVE,
    DROPPED,
    LEFT,
    TIMED_OUT,
    Contribution,
    RoundPolicy,
    SyncState,
)


def make_state(
    *,
    quorum: int = 2,
    islands: int = 3,
    grace: float | None = 5.0,
    max_staleness: int = 2,
    timeout: float = 30.0,
    fragments: int = 1,
    overlap: int = 0,
    ordered_folds: bool = False,
) -> SyncState:
    policy = RoundPolicy(
        quorum=quorum,
        max_staleness=max_staleness,
        heartbeat_timeout=timeout,
        grace_seconds=grace,
        overlap_steps=overlap,
        ordered_folds=ordered_folds,
    )
    state = SyncState(policy, fragments)
    for i in range(islands):
        state.membership.join(f"island-{i}", 1, now=0.0)
    return state


def push(
    state: SyncState,
    island: str,
    now: float,
    *,
    fragment: int = 0,
    base: int | None = None,
    tokens: int = 100,
    steps: int = 10,
    push_id: str = "",
    step_time: float | None = None,
) -> dict:
    base = state.versions[fragment] if base is None else base
    lag = state.check_push(fragment, island, base)
    c = Contribution(
        island=island,
        base_version=base,
        lag=lag,
        tokens=tokens,
        steps=steps,
        loss=1.0,
        received_at=now,
        push_id=push_id,
        payload=f"{island}@{now}",
        step_time=step_time,
    )
    return state.accept_push(fragment, c, now).to_json()


def test_rounds_quorum_opens_grace_then_merges_when_it_expires() -> None:
    state = make_state(quorum=2, islands=3, grace=5.0)
    push(state, "island-0", 10.0)
    assert not state.merge_due(0, 100.0)  # one of two: no quorum, however long we wait
    push(state, "island-1", 11.0)
    assert state.rounds[0].quorum_since == 11.0
    assert state.next_deadline() == 16.0
    assert not state.merge_due(0, 15.9)
    assert state.merge_due(0, 16.0)
    taken = state.take_round(0, 16.0)
    assert [c.island for c in taken] == ["island-0", "island-1"]
    assert state.versions == [1]
    assert state.outer_step == 1
    assert state.rounds[0].pending == {}
    assert state.next_deadline() is None


def test_rounds_merges_at_once_when_every_active_island_contributed() -> None:
    state = make_state(quorum=1, islands=3, grace=60.0)
    for i in range(3):
        assert state.merge_due(0, 1.0) is (i == 3)
        push(state, f"island-{i}", 1.0)
    assert state.merge_due(0, 1.0)


def test_rounds_replacement_keeps_one_contribution_per_island() -> None:
    state = make_state(quorum=2, islands=2)
    first = push(state, "island-0", 1.0, tokens=100, steps=10)
    second = push(state, "island-0", 2.0, tokens=250, steps=25)
    assert first["replaced"] is False and second["replaced"] is True
    assert second["pending"] == 1
    # One island twice is still one contributor: no quorum of two.
    assert state.rounds[0].quorum_since is None
    push(state, "island-1", 3.0)
    taken = state.take_round(0, 3.0)
    by_island = {c.island: c for c in taken}
    assert by_island["island-0"].tokens == 250  # the newer push, not 100 + 250
    assert by_island["island-0"].payload == "island-0@2.0"
    assert len(taken) == 2


def test_rounds_repeated_push_id_gets_the_first_answer() -> None:
    state = make_state(quorum=1, islands=2, grace=10.0)
    answer = push(state, "island-0", 1.0, push_id="abc")
    previous = state.previous_answer(0, "island-0", "abc")
    assert previous is not None and previous.to_json() == answer
    assert state.previous_answer(0, "island-0", "other") is None
    assert state.previous_answer(0, "island-1", "abc") is None


def test_rounds_staleness_within_limit_is_accepted_with_its_lag() -> None:
    state = make_state(quorum=1, islands=1, max_staleness=2)
    for _ in range(3):
        push(state, "island-0", 0.0)
        state.take_round(0, 0.0)
    assert state.versions == [3]
    assert state.check_push(0, "island-0", 1) == 2
    assert state.check_push(0, "island-0", 3) == 0


def test_rounds_staleness_beyond_limit_is_refused_naming_lag_and_limit() -> None:
    state = make_state(quorum=1, islands=1, max_staleness=2)
    for _ in range(3):
        push(state, "island-0", 0.0)
        state.take_round(0, 0.0)
    with pytest.raises(Refused) as err:
        state.check_push(0, "island-0", 0)
    assert err.value.status == 409
    assert "by 3" in err.value.message and "maxStaleness=2" in err.value.message
    with pytest.raises(Refused) as future:
        state.check_push(0, "island-0", 4)
    assert future.value.status == 409 and "newer" in future.value.message


def test_rounds_unknown_island_and_fragment_are_404() -> None:
    state = make_state(fragments=2)
    with pytest.raises(Refused) as island:
        state.check_push(0, "stranger", 0)
    assert island.value.status == 404 and "stranger" in island.value.message
    with pytest.raises(Refused) as frag:
        state.check_push(2, "island-0", 0)
    assert frag.value.status == 404 and "fragment 2" in frag.value.message


def test_rounds_dropping_an_island_completes_a_round() -> None:
    # K=2 of 3; two pushed; the third is dropped: every active island has contributed.
    state = make_state(quorum=2, islands=3, grace=60.0)
    push(state, "island-0", 1.0)
    push(state, "island-1", 1.0)
    assert not state.merge_due(0, 2.0)
    state.membership.set_state("island-2", DROPPED, "pods not ready", now=2.0)
    assert state.merge_due(0, 2.0)


def test_rounds_dropping_a_contributor_removes_its_pending_push() -> None:
    state = make_state(quorum=2, islands=3, grace=60.0)
    push(state, "island-0", 1.0)
    push(state, "island-1", 1.0)
    assert state.rounds[0].quorum_since == 1.0
    state.membership.set_state("island-1", DROPPED, "unhealthy", now=2.0)
    assert set(state.rounds[0].pending) == {"island-0"}
    # Two active islands remain: quorum 2 is not met any more until island-2 pushes.
    assert state.rounds[0].quorum_since is None
    push(state, "island-2", 3.0)
    assert state.merge_due(0, 3.0)  # both remaining active islands contributed


def test_rounds_dropped_island_is_refused_until_readded() -> None:
    state = make_state(quorum=1, islands=2)
    state.membership.set_state("island-0", DROPPED, "node lost", now=1.0)
    with pytest.raises(Refused) as err:
        state.check_push(0, "island-0", 0)
    assert err.value.status == 403 and "node lost" in err.value.message
    # A join does not undo an admin drop.
    state.membership.join("island-0", 1, now=2.0)
    assert state.membership.islands["island-0"].state == DROPPED
    assert state.membership.active() == {"island-1"}
    state.membership.set_state("island-0", ACTIVE, "healthy again", now=3.0)
    assert state.check_push(0, "island-0", 0) == 0


def test_rounds_admin_drop_keeps_the_syncers_refusal_reason() -> None:
    """An admin drop of an island the syncer already dropped for refused pushes (the operator
    seeing its pods fail at the same moment) keeps the refusal reason; a re-add replaces it."""
    state = make_state(quorum=1, islands=2)
    refused = f"{DROPPED_FOR_REFUSALS}: 3 pushes refused in a row"
    state.membership.islands["island-0"].state = DROPPED
    state.membership.islands["island-0"].reason = refused
    state.membership.set_state("island-0", DROPPED, "pods not ready", now=1.0)
    assert (
        state.membership.islands["island-0"].state,
        state.membership.islands["island-0"].reason,
    ) == (
        DROPPED,
        refused,
    )
    # An admin drop of an island dropped for another reason takes the new reason.
    state.membership.set_state("island-1", DROPPED, "node lost", now=1.0)
    state.membership.set_state("island-1", DROPPED, "pods not ready", now=2.0)
    assert state.membership.islands["island-1"].reason == "pods not ready"
    # An explicit re-add is the admin's decision and replaces it.
    state.membership.set_state("island-0", ACTIVE, "fixed by hand", now=3.0)
    assert (
        state.membership.islands["island-0"].state,
        state.membership.islands["island-0"].reason,
    ) == (
        ACTIVE,
        "fixed by hand",
    )


def test_rounds_admin_preregistration_counts_only_after_join() -> None:
    state = make_state(quorum=2, islands=1)
    state.membership.set_state("island-9", ACTIVE, "", now=0.0)
    assert state.membership.active() == {"island-0"}
    with pytest.raises(Refused):
        state.check_push(0, "island-9", 0)
    state.membership.join("island-9", 2, now=1.0)
    assert state.membership.active() == {"island-0", "island-9"}


def test_rounds_timeout_and_revival() -> None:
    state = make_state(quorum=2, islands=2, grace=60.0, timeout=30.0)
    push(state, "island-0", 1.0)
    state.membership.heartbeat("island-1", 10.0)
    assert state.membership.expire(31.5) == ["island-0"]
    assert state.membership.islands["island-0"].state == TIMED_OUT
    assert state.membership.islands["island-1"].state == ACTIVE
    # island-0's pending push stays valid work; with one active island it alone is a quorum.
    assert state.effective_quorum() == 1
    assert state.rounds[0].quorum_since == 31.5
    state.membership.heartbeat("island-0", 32.0)
    assert state.membership.islands["island-0"].state == ACTIVE
    assert state.membership.expire(32.0) == []


def test_rounds_leave_and_rejoin() -> None:
    state = make_state(quorum=2, islands=2)
    state.membership.leave("island-1", 5.0)
    assert state.membership.islands["island-1"].state == LEFT
    assert state.membership.active() == {"island-0"}
    push(state, "island-0", 6.0)
    assert state.merge_due(0, 6.0)
    state.membership.join("island-1", 1, 7.0)
    assert state.membership.islands["island-1"].joins == 2
    assert state.membership.islands["island-1"].state == ACTIVE


def test_rounds_joining_island_raises_quorum_back() -> None:
    state = make_state(quorum=2, islands=1, grace=60.0)
    push(state, "island-0", 1.0)
    assert state.rounds[0].quorum_since == 1.0  # min(2, 1 active) = 1
    state.membership.join("island-1", 1, 2.0)
    assert state.rounds[0].quorum_since is None  # now 1 of 2


def test_rounds_fragments_are_independent() -> None:
    state = make_state(quorum=1, islands=2, grace=1.0, fragments=2)
    push(state, "island-0", 0.0, fragment=1)
    assert state.due_fragments(0.5) == []
    assert state.due_fragments(1.0) == [1]
    state.take_round(1, 1.0)
    assert state.versions == [0, 1]
    assert state.outer_step == 0


def test_rounds_auto_grace_floor_is_one_step() -> None:
    state = make_state(quorum=1, islands=2, grace=None, overlap=0, timeout=30.0)
    assert state.grace() == 1.0  # nothing measured yet
    push(state, "island-0", 0.0, step_time=0.2)
    push(state, "island-1", 0.0, step_time=0.4)
    assert state.grace() == pytest.approx(0.3)  # τ=0: no slack, floor = median step


def test_rounds_auto_grace_uses_half_the_slack() -> None:
    state = make_state(quorum=1, islands=1, grace=None, overlap=20, timeout=30.0)
    push(state, "island-0", 0.0, step_time=0.5)
    # slack = 20 * 0.5 - (0 + 0) = 10 s; γ = 0.5
    assert state.grace() == pytest.approx(5.0)


def decoupled_state(*, islands: int, offsets: tuple[int, ...]) -> SyncState:
    """K = 1 with learners that do not block (τ = 5, H = 20, auto grace, a 30 s timeout), one
    fragment per offset, `islands` joined at 0."""
    policy = RoundPolicy(
        quorum=1,
        max_staleness=2,
        heartbeat_timeout=30.0,
        grace_seconds=None,
        overlap_steps=5,
        inner_steps=20,
        offsets=offsets,
        learners_block=False,
    )
    state = SyncState(policy, len(offsets))
    for i in range(islands):
        state.membership.join(f"island-{i}", 1, now=0.0)
    return state


def test_rounds_auto_grace_of_a_decoupled_job_uses_all_the_slack() -> None:
    """Learners that do not block (K < M with overlap): τ = H and γ = 1 (core/grace.py)."""
    state = decoupled_state(islands=2, offsets=(0,))
    push(state, "island-0", 0.0, step_time=0.5)
    push(state, "island-1", 0.0, step_time=0.5)
    # slack = 20 * 0.5 - (0 + 0) = 10 s, all of it; blocking learners would get 5 s.
    assert state.grace() == pytest.approx(10.0)


def test_rounds_auto_grace_of_a_round_ends_before_its_pushers_hold() -> None:
    """K = 1 of 3, H = 20, τ = 5, learners that do not block; island-2 runs rounds of H_i = 4 at
    0.8 s a step, the others 20 at 0.2 s. The job's window: spans (the median of the islands'
    in-flight seconds) 20 x 0.2 = 4, 4 and max(5, 4) x 0.8 = 4: 4 s. A round island-2 opened may
    wait only until island-2 would hold for its merge, 4 − 1 = 3 steps of 0.8 s: 2.4 s (its
    merge came back 3.2 s after its push before: it held at its bound). One island-0 opened:
    19 x 0.2 = 3.8 s. Every island in a round counts: with both, the shorter."""
    state = decoupled_state(islands=3, offsets=(0, 10))
    state.membership.islands["island-2"].round = IslandRound(4)
    push(state, "island-0", 0.0, fragment=1, step_time=0.2)
    push(state, "island-1", 0.0, fragment=1, step_time=0.2)
    state.take_round(1, 0.0)
    push(state, "island-2", 10.0, fragment=0, step_time=0.8)
    assert state.grace() == pytest.approx(4.0)
    assert state.grace(0) == pytest.approx(2.4)
    assert not state.merge_due(0, 12.39)  # island-0 and island-1 never reported: waited for
    assert state.merge_due(0, 12.4)
    assert state.next_deadline() == pytest.approx(12.4)
    push(state, "island-0", 20.0, fragment=1, step_time=0.2)
    assert state.grace(1) == pytest.approx(3.8)
    push(state, "island-2", 20.0, fragment=1, step_time=0.8)
    assert state.grace(1) == pytest.approx(2.4)


def test_rounds_auto_grace_is_capped_by_heartbeat_timeout() -> None:
    state = make_state(quorum=1, islands=1, grace=None, overlap=1000, timeout=3.0)
    push(state, "island-0", 0.0, step_time=1.0)
    assert state.grace() == 3.0


def test_rounds_merged_tokens_average_over_fragments() -> None:
    state = make_state(quorum=1, islands=1, fragments=2, grace=0.0)
    push(state, "island-0", 0.0, fragment=0, tokens=100)
    push(state, "island-0", 0.0, fragment=1, tokens=100)
    state.take_round(0, 0.0)
    state.take_round(1, 0.0)
    assert state.membership.statuses()["island-0"].merged_tokens == 100


def test_rounds_restore_islands_keeps_counters() -> None:
    state = make_state(quorum=1, islands=2)
    state.membership.set_state("island-1", DROPPED, "bad", now=1.0)
    saved = state.membership.statuses()
    fresh = SyncState(state.policy, 1, versions=[4])
    fresh.membership.restore(saved, now=100.0)
    assert fresh.membership.statuses()["island-1"].state == DROPPED
    assert fresh.membership.islands["island-0"].joins == 1
    assert fresh.membership.islands["island-0"].last_seen == 100.0
    assert fresh.versions == [4]


def test_rounds_saved_answers_hold_merged_pushes_only_and_restore() -> None:
    state = make_state(quorum=1, islands=2, fragments=2)
    first = push(state, "island-0", 1.0, fragment=0, push_id="a")
    state.take_round(0, 2.0)  # merged
    push(state, "island-1", 3.0, fragment=1, push_id="b")  # still pending
    saved = state.saved_answers()
    assert [e.to_json() for e in saved] == [
        {"island": "island-0", "fragment": 0, "pushId": "a", "answer": first}
    ]
    fresh = make_state(quorum=1, islands=2, fragments=2)
    fresh.restore_answers(saved)
    again = fresh.previous_answer(0, "island-0", "a")
    assert again is not None and again.to_json() == first
    assert fresh.previous_answer(1, "island-1", "b") is None  # its retry is accepted afresh
    assert fresh.previous_answer(0, "island-0", "other") is None


def test_rounds_islands_not_heard_of_hold_the_quorum_until_their_timeout() -> None:
    """K=2 of 2: the first island up does not merge alone while its peer's pod is starting."""
    state = make_state(quorum=2, islands=0, timeout=30.0)
    state.membership.expect(2, now=0.0)
    state.membership.join("island-0", 1, now=1.0)
    assert state.membership.awaited() == 1 and state.effective_quorum() == 2
    push(state, "island-0", 2.0)
    assert state.due_fragments(3.0) == []
    state.membership.join("island-1", 1, now=4.0)
    assert state.membership.awaited() == 0
    push(state, "island-1", 5.0)
    assert state.due_fragments(5.0) == [0]  # both contributed: no grace wait


def test_rounds_an_admin_drop_ends_the_wait_for_an_island_never_heard_of() -> None:
    state = make_state(quorum=2, islands=0, timeout=30.0)
    state.membership.expect(2, now=0.0)
    state.membership.join("island-0", 1, now=1.0)
    push(state, "island-0", 2.0)
    state.membership.set_state("island-1", DROPPED, "pod unschedulable", now=3.0)
    assert state.membership.awaited() == 0
    assert state.due_fragments(3.0) == [0]


def test_rounds_quorum_one_waits_the_grace_window_for_islands_not_joined_yet() -> None:
    state = make_state(quorum=1, islands=0, timeout=30.0)  # grace 5 s
    state.membership.expect(3, now=0.0)
    state.membership.join("island-0", 1, now=1.0)
    push(state, "island-0", 2.0)
    assert state.effective_quorum() == 1
    # Two islands of the job have not joined: they hold the grace window (2.0 + 5 = 7.0), not
    # the quorum, and no push prediction can end it early (they have reported nothing).
    assert not state.merge_due(0, 2.0) and not state.merge_due(0, 6.9)
    assert state.merge_due(0, 7.0)
    # Both join and push within the window: the round is complete at once.
    for i, t in ((1, 3.0), (2, 4.0)):
        state.membership.join(f"island-{i}", 1, now=t)
        push(state, f"island-{i}", t)
    assert state.membership.awaited() == 0 and state.merge_due(0, 4.0)


def test_rounds_outer_step_counts_rounds_of_work_not_merges() -> None:
    state = make_state(quorum=1, islands=2, grace=0.0)
    for i, (rounds, clock) in enumerate([(0, 0.5), (1, 1.0), (1, 1.5)]):
        push(state, f"island-{i % 2}", float(i))
        state.take_round(0, float(i), rounds=rounds, clock=clock)
    assert state.versions == [3]
    assert state.outer_step == 1  # three half-round merges: one round of work completed
    # Without the optimizer's figures a merge counts as a whole round.
    push(state, "island-0", 5.0)
    state.take_round(0, 5.0)
    assert state.outer_step == 2


def test_rounds_lag_is_counted_in_rounds_of_work() -> None:
    state = make_state(quorum=1, islands=2, grace=0.0, max_staleness=3)
    # Versions 1..4 after merges of 0.25 rounds each: clocks 0.25, 0.5, 0.75, 1.0.
    for v in range(1, 5):
        push(state, "island-0", float(v))
        state.take_round(0, float(v), rounds=v // 4, clock=0.25 * v)
    assert state.lag_rounds(0, 4) == 0.0
    assert state.lag_rounds(0, 3) == pytest.approx(0.25)
    assert state.lag_rounds(0, 1) == pytest.approx(0.75)
    # The table keeps maxStaleness + 1 versions (1..4); version 0 counts from the oldest.
    assert state.clocks.to_json() == [[[1, 0.25], [2, 0.5], [3, 0.75], [4, 1.0]]]
    assert state.lag_rounds(0, 0) == pytest.approx(0.75)


def test_rounds_clocks_and_rounds_survive_a_checkpoint() -> None:
    state = make_state(quorum=1, islands=1, grace=0.0)
    for v in range(1, 3):
        push(state, "island-0", float(v))
        state.take_round(0, float(v), rounds=0, clock=0.4 * v)
    policy = state.policy
    restored = SyncState(policy, 1, versions=state.versions, rounds=[0])
    restored.clocks.restore(state.clocks.to_json())
    assert restored.lag_rounds(0, 1) == pytest.approx(0.4)
    assert restored.outer_step == 0
    # A checkpoint from before rounds were counted: each merge was an outer step.
    assert SyncState(policy, 1, versions=[7]).outer_step == 7


def test_rounds_auto_grace_excludes_the_time_the_syncer_held_a_push() -> None:
    """The learner's sync time (push sent -> merge received) includes the quorum wait and the
    window; only the rest (transfers) and the merge time count against the slack."""
    state = make_state(quorum=1, islands=1, grace=None, overlap=20, timeout=60.0)
    push(state, "island-0", 10.0, step_time=0.5)
    # Merge at 14 s taking 1 s: the syncer held the push 5 s.
    state.take_round(0, 14.0, merge_seconds=1.0)
    base = state.versions[0]
    c = Contribution(
        island="island-0",
        base_version=base,
        lag=0,
        tokens=100,
        steps=10,
        loss=1.0,
        received_at=30.0,
        step_time=0.5,
        sync_time=6.5,  # 5 s held + 1.5 s of transfers
    )
    state.accept_push(0, c, 30.0)
    assert state.membership.islands["island-0"].transfer_time == pytest.approx(1.5)
    # slack = 20·0.5 − (0 quorum wait + 1.5 transfer + 1.0 merge) = 7.5; γ = 0.5.
    assert state.grace() == pytest.approx(3.75)


def test_rounds_take_round_credits_what_the_merge_took_after_a_drop() -> None:
    """A merge runs without the service's lock: an island dropped while it ran has left the
    round, but its push was merged, so the round closes crediting the merged contributions."""
    state = make_state(quorum=2, islands=2, grace=5.0)
    push(state, "island-0", 1.0, tokens=100)
    push(state, "island-1", 2.0, tokens=300)
    merged = state.peek_round(0)
    state.membership.set_state("island-1", DROPPED, "admin", 3.0)
    assert list(state.rounds[0].pending) == ["island-0"]
    taken = state.take_round(0, 3.0, merged=merged)
    assert taken == merged
    assert state.versions == [1] and state.rounds[0].pending == {}
    assert state.membership.islands["island-1"].merged_tokens == 300


def test_rounds_take_round_refuses_a_round_that_grew_during_its_merge() -> None:
    state = make_state(quorum=1, islands=2, grace=5.0)
    push(state, "island-0", 1.0)
    merged = state.peek_round(0)
    push(state, "island-1", 2.0)
    with pytest.raises(ValueError, match="gained a push"):
        state.take_round(0, 3.0, merged=merged)


def drain(state: SyncState, island: str, now: float) -> None:
    """What a drained learner's heartbeat does (learner/drain.py)."""
    state.membership.heartbeat(island, now, drained=True)


def test_rounds_a_drained_island_is_not_waited_for() -> None:
    # K = M = 3 with a grace window of 600 s: without the drain, two pushes are no quorum.
    state = make_state(quorum=3, islands=3, grace=600.0)
    push(state, "island-0", 10.0)
    push(state, "island-1", 10.0)
    assert not state.merge_due(0, 11.0)
    drain(state, "island-2", 12.0)
    assert state.merge_due(0, 12.0)  # nobody else will push: due at once, no quorum
    state.take_round(0, 12.0)
    assert not state.merge_due(0, 13.0)  # an empty round is never due


def test_rounds_a_round_still_waits_for_an_island_that_has_not_drained() -> None:
    state = make_state(quorum=3, islands=3, grace=600.0)
    drain(state, "island-0", 1.0)
    push(state, "island-1", 10.0)
    assert not state.merge_due(0, 11.0)  # island-2 trains on and will push
    push(state, "island-2", 12.0)
    assert state.merge_due(0, 12.0)


def test_rounds_all_drained_needs_every_active_island_drained_and_nothing_pending() -> None:
    state = make_state(quorum=3, islands=3)
    assert not state.all_drained()
    drain(state, "island-0", 1.0)
    drain(state, "island-1", 1.0)
    assert not state.all_drained()  # island-2 has not drained
    push(state, "island-2", 2.0)
    drain(state, "island-2", 3.0)
    assert not state.all_drained()  # its push is still pending
    state.take_round(0, 4.0)
    assert state.all_drained()
    # A heartbeat without the flag (the island trains on) undoes it.
    state.membership.heartbeat("island-1", 5.0)
    assert not state.all_drained()


def test_rounds_all_drained_leaves_dropped_islands_out_but_needs_one_active() -> None:
    state = make_state(quorum=2, islands=2)
    drain(state, "island-0", 1.0)
    state.membership.set_state("island-1", DROPPED, "gone", 2.0)
    assert state.all_drained()  # the dropped island's share is not coming
    state.membership.set_state("island-0", DROPPED, "gone too", 3.0)
    assert not state.all_drained()  # nobody active: nothing was done, nothing finishes


def test_rounds_an_untargeted_island_holds_no_drained_round_nor_the_finish() -> None:
    """Issue 46 (adv15): K = 2 of 3, the budget split to islands 0 and 1 only (split_to: island-2
    never reported its pace). Island-1 drained; island-0's last push is its round's only one
    (quorum 2): with island-2 counted it waited for island-2's push for ever (grace 600 s, and
    island-2 never pushes that fragment); untargeted, it is not waited for: due at once. Once
    island-0 drained too, the finish is not held by island-2 nor by its pending push; a
    targeted island's pending push still holds it, and with every active island untargeted
    nothing finishes."""
    state = make_state(quorum=2, islands=3, grace=600.0)
    drain(state, "island-1", 1.0)
    push(state, "island-0", 2.0)
    assert not state.merge_due(0, 2.0)  # main's rule: island-2 may push
    assert state.untargeted() == set()  # no split yet: every active island holds it
    state.split_to = frozenset({"island-0", "island-1"})
    assert state.untargeted() == {"island-2"}
    assert state.merge_due(0, 2.0)
    state.take_round(0, 2.0)
    assert not state.all_drained()  # island-0 has not drained
    drain(state, "island-0", 3.0)
    assert state.all_drained()  # main: False, island-2 never drains
    push(state, "island-2", 4.0)
    assert state.all_drained()  # its pending push is no part of the split
    push(state, "island-1", 5.0)
    assert not state.all_drained()  # a targeted island's push is pending
    state.split_to = frozenset({"island-9"})
    assert not state.all_drained()  # nobody of the split active: nothing finishes


def test_rounds_an_island_that_never_joined_holds_no_drained_round_nor_the_finish() -> None:
    """Issue 46: K = 2 of M = 3, the third island never up (within its start-up timeout of
    600 s). Island-1 drained; island-0's last push is the round's only one: one push, quorum 2
    (2 active + 1 not joined, capped at K), so no quorum however long, and with the grace
    window of 600 s no window either. Nobody else will push (island-1 drained, island-2 has no
    part of the budget): the round is due at once, and once island-0 drained too, with nothing
    pending, every active island has drained."""
    state = make_state(quorum=2, islands=0, grace=600.0, timeout=600.0)
    state.membership.expect(3, now=0.0)
    for i in (0, 1):
        state.membership.join(f"island-{i}", 1, now=1.0)
    assert state.membership.awaited() == 1 and state.effective_quorum() == 2
    drain(state, "island-1", 10.0)
    push(state, "island-0", 11.0)
    assert state.rounds[0].quorum_since is None  # one push of a quorum of two
    assert state.merge_due(0, 11.0)  # main: False until 600 s later (the start-up timeout)
    state.take_round(0, 11.0)
    assert not state.all_drained()  # island-0 has not drained
    drain(state, "island-0", 12.0)
    assert state.membership.awaited() == 1
    assert state.all_drained()  # main: False, the job waited for island-2
    push(state, "island-0", 13.0)  # it trains on after all (its wait ended): pending again
    assert not state.all_drained()


def test_rounds_auto_grace_of_a_decoupled_job_counts_each_islands_round() -> None:
    """inner.stepsPerIsland: τ·t_step is each island's H_i x its own step time (the median).
    Islands at 0.5 s on H = 20 and at 1.5 s on H_i = 6: spans 10 s and 9 s, median 9.5 s, all of
    it (γ = 1). On the job's H it was 20 x median(0.5, 1.5) = 20 s."""
    policy = RoundPolicy(
        quorum=1,
        max_staleness=2,
        heartbeat_timeout=30.0,
        grace_seconds=None,
        overlap_steps=5,
        inner_steps=20,
        offsets=(0,),
        learners_block=False,
    )
    state = SyncState(policy, 1)
    for i in range(2):
        state.membership.join(f"island-{i}", 1, now=0.0)
    state.membership.islands["island-1"].round = IslandRound(6)
    push(state, "island-0", 0.0, step_time=0.5)
    push(state, "island-1", 0.0, step_time=1.5)
    assert state.grace() == pytest.approx(9.5)


def test_a_round_of_every_island_folds_in_island_order_a_partial_quorum_as_pushes_come() -> None:
    """SyncState.fold_order: at K = M the islands the round spans, sorted (island-10 before
    island-2: names compare as text); at K < M, or when the learners' apply steps depend on
    timing (RoundPolicy.ordered_folds off), None (arrival order)."""

    def ordered(quorum: int, islands: int) -> SyncState:
        return make_state(quorum=quorum, islands=islands, ordered_folds=True)

    state = ordered(quorum=3, islands=3)
    assert state.fold_order(0) == ["island-0", "island-1", "island-2"]
    state.membership.join("island-10", 1, now=0.0)  # a fourth island: K = 3 < 4 now
    assert state.fold_order(0) is None
    every = ordered(quorum=4, islands=3)
    every.membership.join("island-10", 1, now=0.0)
    assert every.fold_order(0) == ["island-0", "island-1", "island-10", "island-2"]
    assert ordered(quorum=2, islands=3).fold_order(0) is None
    assert make_state(quorum=3, islands=3).fold_order(0) is None  # ordered_folds off


def test_only_learners_that_apply_merges_at_fixed_steps_get_ordered_folds() -> None:
    """round_policy's ordered_folds (records.merges_applied_at_fixed_steps): τ = 0, or a fixed
    τ applied from τ steps after the push, waited for there, every island's round H; not the
    fitted τ (the default), applyFrom arrival (τ > 0), mergeWait nextPush, stepsPerIsland auto."""
    from diloco_trainer.api.spec import parse_spec
    from diloco_trainer.syncer.state.records import round_policy

    def ordered(sync: dict, inner: dict | None = None) -> bool:
        spec = parse_spec(
            {
                "model": {"preset": "gpt-tiny"},
                "islands": {"count": 3},
                "inner": {"steps": 20, "stepsPerIsland": "fixed", **(inner or {})},
                "sync": {"quorum": 3, **sync},
            }
        )
        return round_policy(spec, 2).ordered_folds

    assert ordered({"overlapSteps": 0})
    assert ordered({"overlapSteps": 0, "applyFrom": "arrival"})  # τ = 0: the same rule
    assert ordered({"overlapSteps": 3, "overlapMode": "fixed"})
    assert not ordered({})  # overlapMode auto: τ fitted to measured latency
    assert not ordered({"overlapSteps": 3})
    assert not ordered({"overlapSteps": 3, "overlapMode": "fixed", "applyFrom": "arrival"})
    assert not ordered({"overlapSteps": 0, "mergeWait": "nextPush"})
    assert not ordered({"overlapSteps": 0}, {"stepsPerIsland": "auto"})
