"""Awaited islands (syncer/state/rounds.py, records.py): islands of the job that have not joined
hold the quorum until they join or are dropped, however slowly they start; only the long start-up
timeout (islands.startupTimeoutSeconds) gives up on them when nobody says anything. The heartbeat
timeout is for islands that went silent, not for slow starts (issue 9: a quorum 2 of 2 job merged on
one island because five processes took longer than heartbeatTimeoutSeconds to start)."""

from __future__ import annotations

import pytest
from diloco_trainer.api.spec import ConfigError, parse_spec
from diloco_trainer.syncer.state.records import round_policy
from diloco_trainer.syncer.state.rounds import (
    ACTIVE,
    DROPPED,
    TIMED_OUT,
    Contribution,
    RoundPolicy,
    SyncState,
)

HEARTBEAT = 10.0
STARTUP = 60.0


def fresh(quorum: int = 2, islands: int = 2) -> SyncState:
    """A syncer that just started at t=0 for a job of `islands` islands, none joined yet."""
    policy = RoundPolicy(
        quorum=quorum,
        max_staleness=4,
        heartbeat_timeout=HEARTBEAT,
        grace_seconds=5.0,
        startup_timeout=STARTUP,
    )
    state = SyncState(policy, 1)
    state.membership.expect(islands, now=0.0)
    return state


def push(state: SyncState, island: str, now: float) -> None:
    lag = state.check_push(0, island, state.versions[0])
    contribution = Contribution(
        island=island,
        base_version=state.versions[0],
        lag=lag,
        tokens=100,
        steps=10,
        loss=None,
        received_at=now,
    )
    state.accept_push(0, contribution, now)


def alive(state: SyncState, island: str, until: float) -> None:
    """`island` heartbeats every 5 s (half the heartbeat timeout) up to `until`, expiring as the
    server's ticks do."""
    t = 5.0
    while t <= until:
        state.membership.heartbeat(island, t)
        state.membership.expire(t)
        t += 5.0


def test_rounds_startup_a_slow_island_holds_the_quorum_past_the_heartbeat_timeout() -> None:
    state = fresh()
    state.membership.join("island-0", 1, now=1.0)
    push(state, "island-0", 2.0)
    # 3 x the heartbeat timeout after the syncer's start, island-1 has still not joined: it is
    # awaited (2 islands - 1 joined), the quorum stays min(K=2, 1 active + 1 awaited) = 2.
    alive(state, "island-0", until=30.0)
    assert state.membership.awaited() == 1
    assert state.effective_quorum() == 2
    assert state.due_fragments(30.0) == []
    state.membership.join("island-1", 1, now=31.0)
    assert state.membership.awaited() == 0
    push(state, "island-1", 32.0)
    assert state.due_fragments(32.0) == [0]  # both contributed: no grace wait
    merged = state.take_round(0, 32.0)
    assert [c.island for c in merged] == ["island-0", "island-1"]


def test_rounds_startup_given_up_only_after_the_startup_timeout() -> None:
    state = fresh()
    state.membership.join("island-0", 1, now=1.0)
    push(state, "island-0", 2.0)
    alive(state, "island-0", until=STARTUP)  # the last tick at t=60 is not past the timeout
    assert state.membership.awaited() == 1 and state.due_fragments(STARTUP) == []
    state.membership.heartbeat("island-0", STARTUP + 1)
    state.membership.expire(STARTUP + 1)
    assert state.membership.awaited() == 0 and state.effective_quorum() == 1
    assert state.due_fragments(STARTUP + 1) == [0]


def test_rounds_startup_a_drop_ends_the_wait_and_a_re_add_restores_it() -> None:
    state = fresh(quorum=3, islands=3)
    state.membership.join("island-0", 1, now=1.0)
    push(state, "island-0", 2.0)
    assert state.membership.awaited() == 2 and state.effective_quorum() == 3
    # Pre-registered by the admin route but not joined: still awaited (it has not joined).
    state.membership.set_state("island-1", ACTIVE, "pod scheduled", now=3.0)
    assert state.membership.awaited() == 2
    # Dropped (its processes exited, its pod failed): no longer awaited, quorum 1 + 1 = 2.
    state.membership.set_state("island-2", DROPPED, "every process exited", now=4.0)
    assert state.membership.awaited() == 1 and state.effective_quorum() == 2
    state.membership.set_state("island-1", DROPPED, "pod unschedulable", now=5.0)
    assert state.membership.awaited() == 0 and state.effective_quorum() == 1
    assert state.due_fragments(5.0) == [0]
    # Re-added before it joined (its pod came back): awaited again.
    state.membership.set_state("island-2", ACTIVE, "pod ready", now=6.0)
    assert state.membership.awaited() == 1 and state.effective_quorum() == 2


def test_rounds_startup_an_island_that_joined_and_went_silent_is_not_awaited() -> None:
    state = fresh()
    state.membership.join("island-0", 1, now=1.0)
    state.membership.join("island-1", 1, now=1.0)
    alive(state, "island-0", until=15.0)  # island-1 silent since t=1: timed out at t=15
    assert state.membership.islands["island-1"].state == TIMED_OUT
    # It joined once, so the heartbeat timeout governs it, not the start-up wait.
    assert state.membership.awaited() == 0 and state.effective_quorum() == 1


def test_rounds_startup_islands_restored_from_a_checkpoint_are_not_awaited() -> None:
    state = fresh()
    before = SyncState(state.policy, 1)
    before.membership.join("island-0", 1, now=0.0)
    state.membership.restore(before.membership.statuses(), now=1.0)
    assert state.membership.awaited() == 1  # island-1 never joined before the restart


def test_rounds_startup_timeout_comes_from_the_spec() -> None:
    assert round_policy(parse_spec({}), 1).startup_timeout == 600.0
    spec = parse_spec({"islands": {"startupTimeoutSeconds": 90}})
    assert round_policy(spec, 1).startup_timeout == 90.0
    with pytest.raises(ConfigError, match="startupTimeoutSeconds"):
        parse_spec({"islands": {"startupTimeoutSeconds": 0}})
