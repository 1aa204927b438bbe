"""An island's tokens in the status: a push proves work the heartbeats may not have reported yet.

Before issue 23 accept_push never set the island's tokens, so an island that had pushed (and
whose heartbeat had not come yet) showed 0 tokens processed.
"""

from __future__ import annotations

from diloco_trainer.syncer.state.rounds import Contribution, RoundPolicy, SyncState


def make_state(fragments: int = 1) -> SyncState:
    policy = RoundPolicy(quorum=1, max_staleness=4, heartbeat_timeout=30.0, grace_seconds=0.0)
    state = SyncState(policy, fragments)
    state.membership.join("island-0", 1, now=0.0)
    return state


def push(state: SyncState, now: float, *, tokens: int, fragment: int = 0) -> None:
    base = state.versions[fragment]
    lag = state.check_push(fragment, "island-0", base)
    c = Contribution(
        island="island-0",
        base_version=base,
        lag=lag,
        tokens=tokens,
        steps=1,
        loss=1.0,
        received_at=now,
        push_id=f"p{now}-{fragment}",
    )
    state.accept_push(fragment, c, now)


def tokens(state: SyncState) -> int:
    return state.snapshot().islands["island-0"].tokens


def test_a_push_sets_the_islands_tokens() -> None:
    state = make_state()
    push(state, 1.0, tokens=1000)
    assert tokens(state) == 1000  # 0 before the fix


def test_tokens_add_up_over_merged_pushes_and_a_replacing_push_is_not_counted_twice() -> None:
    state = make_state()
    push(state, 1.0, tokens=1000)
    state.take_round(0, 1.0)
    push(state, 2.0, tokens=500)
    assert tokens(state) == 1500  # 1000 merged + 500 pending
    # A later push replaces the pending one and covers its work: 800 since the merge, not 1300.
    push(state, 3.0, tokens=800)
    assert tokens(state) == 1800


def test_fragments_each_prove_the_islands_work_and_the_largest_counts() -> None:
    state = make_state(fragments=2)
    push(state, 1.0, tokens=600, fragment=0)
    push(state, 1.5, tokens=300, fragment=1)  # the half-round fragment has seen less
    assert tokens(state) == 600


def test_a_heartbeat_with_more_tokens_wins_and_a_push_never_lowers_them() -> None:
    state = make_state()
    state.membership.heartbeat("island-0", 1.0, step=50, tokens=5000)
    push(state, 2.0, tokens=1000)
    assert tokens(state) == 5000
