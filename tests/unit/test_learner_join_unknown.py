"""A learner's join that a restarted syncer may lack (learner/join_marks.join_unknown), and the
count frame that joining again gives the restored record (issue 46: "a crash loses at most the
work since the last checkpoint")."""

from __future__ import annotations

from diloco_trainer.learner.join_marks import JoinMark, join_unknown
from diloco_trainer.syncer.state.rounds import Contribution, RoundPolicy, SyncState


def test_a_join_at_or_past_the_resumed_versions_on_every_fragment_is_joined_again() -> None:
    # The run resumed from a checkpoint of versions [3, 2].
    resumed = [3, 2]
    assert join_unknown(JoinMark("run-a", (3, 2)), "run-b", resumed)  # at them: maybe after it
    assert join_unknown(JoinMark("run-a", (4, 2)), "run-b", resumed)  # past them (a newer run)
    # Below on one fragment: the join came before the merge that made version 2 of fragment 1,
    # which the checkpoint holds, so it holds the join's record too.
    assert not join_unknown(JoinMark("run-a", (3, 1)), "run-b", resumed)
    assert not join_unknown(JoinMark("run-a", (2, 5)), "run-b", resumed)


def test_told_the_records_joins_a_run_lacks_a_join_iff_it_counts_fewer() -> None:
    """The join left the record at 2 joins. A run whose record counts 1 restored a checkpoint
    without it: joined again, also where the versions say no (two restarts, the second run
    resumed at [5, 4] from a checkpoint its predecessor wrote past the join at [3, 2]: main
    False). A record of 2 (or 3: a join since, say the link's own after a 404) holds it: not
    joined again, also where the versions say maybe (at them). The same run: never."""
    assert join_unknown(JoinMark("run-a", (3, 2), 2), "run-c", [5, 4], 1)
    assert join_unknown(JoinMark("run-a", (3, 2), 2), "run-b", [3, 2], 1)
    assert not join_unknown(JoinMark("run-a", (3, 2), 2), "run-b", [3, 2], 2)
    assert not join_unknown(JoinMark("run-a", (3, 2), 2), "run-b", [3, 2], 3)
    assert not join_unknown(JoinMark("run-a", (3, 2), 2), "run-a", [3, 2], 1)
    # Either side not told (an older syncer): the versions decide.
    assert join_unknown(JoinMark("run-a", (3, 2)), "run-b", [3, 2], 2)
    assert not join_unknown(JoinMark("run-a", (3, 2), 2), "run-c", [5, 4])


def test_no_join_again_without_a_restart_or_what_to_compare() -> None:
    assert not join_unknown(JoinMark("run-a", (3, 2)), "run-a", [3, 2])  # same run: no restart
    assert not join_unknown(JoinMark("", (3, 2)), "run-b", [3, 2])  # joined an older syncer
    assert not join_unknown(JoinMark("run-a", (3, 2)), "", [3, 2])  # answered by an older one
    assert not join_unknown(JoinMark("run-a", (3, 2)), "run-b", [])  # versions not told


def merged(state: SyncState, island: str, tokens: int, now: float) -> None:
    """One push of `island` with `tokens`, merged alone (K = 1)."""
    base = state.versions[0]
    c = Contribution(
        island=island,
        base_version=base,
        lag=state.check_push(0, island, base),
        tokens=tokens,
        steps=10,
        loss=1.0,
        received_at=now,
        payload=f"{island}@{now}",
    )
    state.accept_push(0, c, now)
    state.take_round(0, now)


def checkpointed_after_a_later_join(refused: float = 0.0) -> SyncState:
    """island-1 joins (base 0) and 600 of its tokens merge; `refused` of its tokens are refused
    (a 422); the syncer checkpoints (base 0, merged 600); its learner restarts and joins again
    (base 600: it counts from 0 there). The syncer state restarted from that checkpoint."""
    policy = RoundPolicy(
        quorum=1, max_staleness=2, heartbeat_timeout=30.0, grace_seconds=None, overlap_steps=0
    )
    state = SyncState(policy, 1)
    state.membership.join("island-1", 1, 0.0)
    merged(state, "island-1", 600, 1.0)
    state.membership.refused_push("island-1", refused, fragment=0, base=1)
    saved, counts = state.membership.statuses(), state.membership.counts()
    assert counts["island-1"].base == 0.0
    state.membership.join("island-1", 1, 2.0)  # the learner restarted: a join after it
    assert state.membership.islands["island-1"].count_base == 600.0
    restarted = SyncState(policy, 1, versions=list(state.versions))
    restarted.membership.restore(saved, 3.0, counts)
    return restarted


def test_a_join_that_keeps_its_count_counts_from_the_checkpoints_merged_tokens() -> None:
    """After the restart the learner's push of 300 tokens (its steps since its join, pushed
    again) merges: merged 600 + 300 = 900. Its count is 500 (300 merged, 200 held), so its part
    is 600 + 500 = 1,100 = 900 merged + 200 held. The restored record's base (0, the older
    join's) reads 0 + 500 = 500, below the 900 merged; an ordinary join's (900, merged now)
    900 + 500 = 1,400, the 300 counted twice; a join that keeps its count: 600 + 500 = 1,100."""
    restarted = checkpointed_after_a_later_join()
    members = restarted.membership
    assert members.islands["island-1"].count_base == 0.0  # the older join's frame
    merged(restarted, "island-1", 300, 4.0)
    assert members.islands["island-1"].merged_tokens == 900.0
    rec = members.join("island-1", 1, 5.0, keeps_count=True)
    assert rec.count_base == 600.0 and rec.count_base + 500 == 1100
    # Once: a later join of this run (its learner restarted now) counts from the merged tokens.
    assert members.join("island-1", 1, 6.0, keeps_count=True).count_base == 900.0


def test_an_ordinary_join_after_a_restart_counts_from_the_merged_tokens_now() -> None:
    """A learner restarted after the syncer's restart counts from 0 at its join: base 900."""
    restarted = checkpointed_after_a_later_join()
    merged(restarted, "island-1", 300, 4.0)
    assert restarted.membership.join("island-1", 1, 5.0).count_base == 900.0


def test_a_join_that_keeps_its_count_keeps_this_runs_refusals_only() -> None:
    """The checkpoint's record holds 100 refused tokens of the older join's count; the
    restarted run refuses 40 of the learner's (a 422) and one of 30 as ahead (on version 2, its
    fragment at 1), then the learner's heartbeat joins again keeping its count: refused
    100 + 40 - 100 = 40, of its count (main: 0, reset as by a new count), the 30 still pending.
    Its next push, on 1, carries the 30 (pushed again with every step since): 40. A later
    ordinary join: 0."""
    restarted = checkpointed_after_a_later_join(refused=100.0)
    members = restarted.membership
    rec = members.islands["island-1"]
    assert rec.refused_tokens == 100.0
    members.refused_push("island-1", 40.0, fragment=0, base=1)
    members.refused_push("island-1", 30.0, fragment=0, base=2, ahead=True)
    assert members.join("island-1", 1, 5.0, keeps_count=True).refused_tokens == 40.0
    members.pushed("island-1", 0, 1)
    assert rec.refused_tokens == 40.0 and not rec.ahead_refused
    assert members.join("island-1", 1, 6.0, keeps_count=True).refused_tokens == 0.0
