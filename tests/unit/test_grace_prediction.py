"""The grace window is not spent waiting for an island that cannot push in time: each island's last
progress report (step, step time) predicts when it reaches the fragment's sync point."""

from __future__ import annotations

from diloco_trainer.core.island_rounds import IslandRound
from diloco_trainer.syncer.state.rounds import Contribution, RoundPolicy, SyncState

H = 20


def make_state(*, fragments: int = 1, grace: float = 5.0) -> SyncState:
    policy = RoundPolicy(
        quorum=2,
        max_staleness=2,
        heartbeat_timeout=30.0,
        grace_seconds=grace,
        inner_steps=H,
        offsets=tuple(f * H // fragments for f in range(fragments)),
    )
    state = SyncState(policy, fragments)
    for i in range(3):
        state.membership.join(f"island-{i}", 1, now=0.0)
    return state


def push(
    state: SyncState, island: str, now: float, fragment: int = 0, step_time: float = 0.1
) -> None:
    base = state.versions[fragment]
    lag = state.check_push(fragment, island, base)
    state.accept_push(
        fragment,
        Contribution(
            island=island,
            base_version=base,
            lag=lag,
            tokens=100,
            steps=H,
            loss=3.0,
            received_at=now,
            step_time=step_time,
        ),
        now,
    )


def quorum_of_two_at(state: SyncState, now: float, fragment: int = 0) -> None:
    """island-0 and island-1 (0.1 s/step) push fragment `fragment` at `now`."""
    for island in ("island-0", "island-1"):
        state.membership.heartbeat(island, now, step=H, step_time=0.1)
        push(state, island, now, fragment)


def test_grace_skipped_when_the_missing_island_is_far_from_its_sync_point() -> None:
    state = make_state()
    # island-2 is 3x slower and 4 steps into its round: 16 steps x 0.3 s = 4.8 s after its
    # report, 3.8 s after the quorum; the window closes 5 s after the quorum, so it would make it.
    state.membership.heartbeat("island-2", 9.0, step=4, step_time=0.3)
    quorum_of_two_at(state, 10.0)
    assert not state.merge_due(0, 10.0)
    # One report later it is slower than it looked: 2 s/step, 16 steps to go = 32 s. No wait.
    state.membership.heartbeat("island-2", 10.0, step=4, step_time=2.0)
    assert state.merge_due(0, 10.0)


def test_grace_waits_for_an_island_about_to_push() -> None:
    state = make_state()
    state.membership.heartbeat(
        "island-2", 10.0, step=H - 1, step_time=0.3
    )  # one step from its push
    quorum_of_two_at(state, 10.0)
    assert not state.merge_due(0, 10.0)
    assert not state.merge_due(0, 14.9)
    assert state.merge_due(0, 15.0)  # the window still ends on time


def test_grace_waits_for_an_island_that_never_reported_progress() -> None:
    state = make_state()  # island-2 joined but sent no heartbeat: nothing to predict from
    quorum_of_two_at(state, 10.0)
    assert not state.merge_due(0, 10.0)
    assert state.merge_due(0, 15.0)


def test_grace_prediction_uses_each_fragments_sync_point() -> None:
    state = make_state(fragments=2)  # offsets 0 and 10
    # island-2 (1 s/step) has done step 8: fragment 1 syncs after step 10 (2 s away, inside the
    # window), fragment 0 after step 20 (12 s away, beyond it).
    state.membership.heartbeat("island-2", 10.0, step=8, step_time=1.0)
    quorum_of_two_at(state, 10.0, fragment=0)
    quorum_of_two_at(state, 10.0, fragment=1)
    assert state.merge_due(0, 10.0)
    assert not state.merge_due(1, 10.0)


def test_grace_prediction_extrapolates_from_the_report_time() -> None:
    state = make_state()
    # Reported step 2 at t=0 with 1 s/step: by t=16 it should be at step 18, 2 s from its push,
    # inside the window opened at t=16 (read literally, step 2 would put it 18 s away, beyond).
    state.membership.heartbeat("island-2", 0.0, step=2, step_time=1.0)
    quorum_of_two_at(state, 16.0)
    assert not state.merge_due(0, 16.0)


def test_grace_prediction_off_without_a_schedule() -> None:
    """Policies without inner_steps (the default) keep the plain grace window."""
    policy = RoundPolicy(quorum=2, max_staleness=2, heartbeat_timeout=30.0, grace_seconds=5.0)
    state = SyncState(policy, 1)
    for i in range(3):
        state.membership.join(f"island-{i}", 1, now=0.0)
    state.membership.heartbeat("island-2", 10.0, step=1, step_time=100.0)
    quorum_of_two_at(state, 10.0)
    assert not state.merge_due(0, 10.0)
    assert state.merge_due(0, 15.0)


def test_grace_waits_for_an_overdue_island() -> None:
    """Its sync point passed by its own pace but no push came: it may be just late, so wait."""
    state = make_state()
    state.membership.heartbeat(
        "island-2", 0.0, step=10, step_time=0.3
    )  # due at t=3, long overdue at t=10
    quorum_of_two_at(state, 10.0)
    assert not state.merge_due(0, 10.0)
    assert state.merge_due(0, 15.0)


def test_grace_prediction_knows_a_merged_push_from_one_in_flight() -> None:
    """An island reporting its sync step with no push since is about to push (wait); one whose
    push came after that report was merged in an earlier round and is a whole round away."""
    state = make_state()
    state.membership.heartbeat("island-2", 9.0, step=H, step_time=1.0)
    quorum_of_two_at(state, 10.0)
    assert not state.merge_due(0, 10.0)

    state = make_state()
    state.membership.heartbeat("island-2", 9.0, step=H, step_time=1.0)
    push(state, "island-2", 9.5, step_time=1.0)  # its push for step H: merged alone into version 1
    state.take_round(0, 9.5)
    quorum_of_two_at(state, 10.0)  # the next round's quorum, without island-2
    assert state.merge_due(0, 10.0)  # H more steps at 1 s/step: far beyond the 5 s window


def test_grace_prediction_counts_in_the_islands_own_round() -> None:
    """inner.stepsPerIsland: island-2 runs rounds of H_i = 6 (round_sizes.py), and its
    learner's positions count in its own round: fragment 0 is due after step 12. At step 8 and
    1 s/step, reported at t = 10: 4 steps, at 14 s, before the window closes at 15 s: wait.
    Counted in the job's H = 20 it would be 12 steps, at 22 s, beyond it: no wait."""
    state = make_state()
    state.membership.islands["island-2"].round = IslandRound(6)
    state.membership.heartbeat("island-2", 10.0, step=8, step_time=1.0)
    quorum_of_two_at(state, 10.0)
    assert not state.merge_due(0, 10.0)  # expected at 14 s
    assert state.merge_due(0, 15.0)

    state = make_state()  # the same island on the job's H: 12 steps of 1 s, beyond the window
    state.membership.heartbeat("island-2", 10.0, step=8, step_time=1.0)
    quorum_of_two_at(state, 10.0)
    assert state.merge_due(0, 10.0)


def test_grace_prediction_uses_the_offsets_of_the_islands_round() -> None:
    """Two fragments: the job's offsets are 0 and 10 (H = 20); an island on H_i = 8 syncs
    fragment 1 at positions with p % 8 == 4 (fragment_offsets(8, 2) = [0, 4]). At step 2 and
    2 s/step: fragment 1 is 2 steps = 4 s away (inside the 5 s window: wait); on the job's
    offsets it would be 8 steps = 16 s away (no wait)."""
    state = make_state(fragments=2)
    state.membership.islands["island-2"].round = IslandRound(8)
    state.membership.heartbeat("island-2", 10.0, step=2, step_time=2.0)
    quorum_of_two_at(state, 10.0, fragment=1)
    assert not state.merge_due(1, 10.0)
