"""The syncer's membership and work clocks as rooms of their own: what membership tells its owner
(the round machine) of each change, and the work-clock table, by hand."""

from __future__ import annotations

import pytest
from diloco_trainer.api.protocol import DROPPED_FOR_REFUSALS
from diloco_trainer.syncer.errors import Refused
from diloco_trainer.syncer.state.clocks import WorkClocks
from diloco_trainer.syncer.state.membership import Membership
from diloco_trainer.syncer.state.records import ACTIVE, DROPPED, LEFT, TIMED_OUT


class Heard:
    """A MembershipEvents owner that writes down what it hears."""

    def __init__(self) -> None:
        self.events: list[tuple[str, ...]] = []

    def withdrawn(self, island: str, now: float, *, forgotten: bool) -> None:
        self.events.append(("withdrawn", island, "forgotten" if forgotten else "dropped"))

    def membership_changed(self, now: float) -> None:
        self.events.append(("changed", str(now)))


def members(heard: Heard) -> Membership:
    return Membership(heartbeat_timeout=30.0, startup_timeout=600.0, events=heard)


def test_membership_tells_its_owner_of_each_change() -> None:
    heard = Heard()
    m = members(heard)
    m.join("island-0", 1, now=1.0)
    m.join("island-1", 2, now=2.0)
    assert heard.events == [("changed", "1.0"), ("changed", "2.0")]
    heard.events.clear()
    m.set_state("island-1", DROPPED, "pod failed", now=3.0)
    assert heard.events == [("withdrawn", "island-1", "dropped"), ("changed", "3.0")]
    heard.events.clear()
    m.forget("island-1", now=4.0)
    assert heard.events == [("withdrawn", "island-1", "forgotten"), ("changed", "4.0")]
    assert m.active() == {"island-0"} and "island-1" not in m.islands


def test_membership_transitions_by_hand() -> None:
    m = members(Heard())
    m.expect(3, now=0.0)
    m.join("island-0", 1, now=1.0)
    assert m.awaited() == 2  # three expected, one joined
    m.set_state("island-2", DROPPED, "unschedulable", now=2.0)
    assert m.awaited() == 1  # a dropped island is no longer awaited
    # Silent for 31 s > 30 s: timed out; its next sign of life makes it active again.
    assert m.expire(32.0) == ["island-0"]
    assert m.islands["island-0"].state == TIMED_OUT
    m.heartbeat("island-0", 33.0, step=5)
    assert (m.islands["island-0"].state, m.islands["island-0"].step) == (ACTIVE, 5)
    m.leave("island-0", 34.0)
    assert (m.islands["island-0"].state, m.islands["island-0"].reason) == (LEFT, "left")
    # After the start-up timeout (600 s from 0), nobody is awaited any more.
    m.expire(601.0)
    assert m.awaited() == 0
    with pytest.raises(Refused) as err:
        m.heartbeat("island-9", 40.0)
    assert err.value.status == 404


def test_membership_admin_drop_keeps_the_syncers_refusal_reason() -> None:
    m = members(Heard())
    m.join("island-0", 1, now=0.0)
    ours = f"{DROPPED_FOR_REFUSALS}: 5 pushes refused in a row"
    m.set_state("island-0", DROPPED, ours, now=1.0)
    m.set_state("island-0", DROPPED, "operator: pod unhealthy", now=2.0)
    assert m.islands["island-0"].reason == ours  # the operator still sees why it was dropped
    m.set_state("island-0", ACTIVE, "re-added", now=3.0)
    assert (m.islands["island-0"].state, m.islands["island-0"].reason) == (ACTIVE, "re-added")


def test_work_clocks_by_hand() -> None:
    # One fragment at version 2 with 1 round done; keep 3 versions.
    clocks = WorkClocks([2], [1], keep=3)
    clocks.record(0, 3, 1.5)  # a half-round merge
    clocks.record(0, 4, 2.0)
    assert clocks.lag_rounds(0, 4) == 0.0
    assert clocks.lag_rounds(0, 2) == pytest.approx(1.0)  # 2.0 - 1.0
    clocks.record(0, 5, 2.25)  # version 2 falls out of the table (keep 3: 3, 4, 5)
    assert clocks.to_json() == [[[3, 1.5], [4, 2.0], [5, 2.25]]]
    assert clocks.lag_rounds(0, 2) == pytest.approx(0.75)  # from the oldest held: 2.25 - 1.5
    # Restored at version 4: a pair beyond it is ignored.
    restored = WorkClocks([4], [2], keep=3)
    restored.restore([[[3, 1.5], [4, 2.0], [5, 2.25]]])
    assert restored.to_json() == [[[3, 1.5], [4, 2.0]]]


@pytest.mark.parametrize("flag", ["holding", "drained"])
def test_membership_heartbeat_says_whether_the_island_holds_or_drained(flag: str) -> None:
    """`holding` (the learner at its step cap) and `drained` (its part of stopAfter done and
    merged, learner/drain.py) are what the island's latest heartbeat said: set by one that says
    so, cleared by the next that does not, and in the island's status entry."""
    m = members(Heard())
    m.join("island-0", 1, now=0.0)
    assert not getattr(m.islands["island-0"].to_status(), flag)
    m.heartbeat("island-0", 1.0, step=40, **{flag: True})
    assert m.islands["island-0"].to_status().to_wire()[flag] is True
    m.heartbeat("island-0", 2.0, step=40)
    assert m.islands["island-0"].to_status().to_wire()[flag] is False


def test_membership_heartbeat_keeps_the_waiting_share_its_latest_heartbeat_said() -> None:
    """`waiting` (the share of the learner's wall time blocked on the syncer) is the latest
    heartbeat's: a heartbeat without it (an older learner) makes it unknown again, not 0."""
    m = members(Heard())
    m.join("island-0", 1, now=0.0)
    assert m.islands["island-0"].to_status().waiting is None
    m.heartbeat("island-0", 1.0, step=40, waiting=0.75)
    assert m.islands["island-0"].to_status().waiting == 0.75
    m.heartbeat("island-0", 2.0, step=41, waiting=0.0)
    assert m.islands["island-0"].to_status().waiting == 0.0
    m.heartbeat("island-0", 3.0, step=42)
    assert m.islands["island-0"].to_status().waiting is None
