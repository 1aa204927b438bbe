"""The WaitingForMerges rule (operator/diloco_operator/merge_waits.py, issue 45): an island
raised after 3 status reads in a row at a waiting share of 25% or more, cleared after 3 in a row
below 10%, held between the two; the condition, its one Event per episode, and an operator
restart taking up a stored episode. Expected values are derived by hand in the comments."""

from __future__ import annotations

from typing import Any

import pytest
from diloco_operator.conditions import job_conditions
from diloco_operator.merge_waits import (
    CLEAR_READS,
    CLEAR_SHARE,
    RAISE_READS,
    RAISE_SHARE,
    WAIT_CONDITION,
    WAIT_EVENT,
    IslandWaits,
    MergeWaits,
    counted_share,
    next_island,
    note_resumed,
    post_wait_event,
    read_waits,
    resumed,
    wait_condition,
)
from diloco_operator.phase import decide_phase
from diloco_operator.status import compute_status
from diloco_trainer.api.documents import IslandStatus

from .observations import observation, syncer_view

ISLANDS = ("island-0", "island-1")


def replay(shares: list[float | None]) -> list[bool]:
    """Whether the island is raised after each read of `shares`, from a fresh start."""
    waits, raised = IslandWaits(), []
    for share in shares:
        waits = next_island(waits, share)
        raised.append(waits.raised)
    return raised


def test_the_thresholds_are_the_documented_ones() -> None:
    assert (RAISE_SHARE, RAISE_READS, CLEAR_SHARE, CLEAR_READS) == (0.25, 3, 0.10, 3)


def test_an_island_is_raised_after_three_reads_in_a_row_at_a_quarter_or_more() -> None:
    # 0.25 counts (>=); the third read in a row raises.
    assert replay([0.25, 0.5, 0.9]) == [False, False, True]
    # A read below 0.25 (0.24) restarts the streak: raised only at the third after it.
    assert replay([0.3, 0.3, 0.24, 0.3, 0.3, 0.3]) == [False] * 5 + [True]
    # An unknown share (None) breaks a streak as a low share does.
    assert replay([0.4, 0.4, None, 0.4, 0.4]) == [False] * 5


def test_a_raised_island_clears_after_three_reads_in_a_row_below_a_tenth() -> None:
    up = [0.5, 0.5, 0.5]
    # Raised at read 3; 0.09, 0.0, None are three reads below 0.10: cleared at the third.
    assert replay([*up, 0.09, 0.0, None]) == [False, False, True, True, True, False]
    # Hysteresis: shares between 0.10 and 0.25 keep it raised however long they last (0.10
    # itself is not below 0.10) ...
    assert replay([*up, 0.2, 0.1, 0.15, 0.12, 0.2]) == [False, False] + [True] * 6
    # ... and a share of 0.10 or more restarts the clearing streak: 0.05, 0.05, 0.12, then
    # three below again clear it at the last read.
    assert replay([*up, 0.05, 0.05, 0.12, 0.05, 0.05, 0.05]) == [False, False] + [True] * 6 + [
        False
    ]
    # Cleared (read 6), it needs three reads at 0.25 or more again: raised at read 9.
    again = [*up, 0.0, 0.0, 0.0, 0.3, 0.3, 0.3]
    assert replay(again) == [False, False, True, True, True, False, False, False, True]


def test_a_share_counts_only_for_an_active_island_that_has_not_drained() -> None:
    assert counted_share(IslandStatus(state="active", waiting=0.5)) == 0.5
    assert counted_share(IslandStatus(state="active")) is None  # not reported
    assert counted_share(IslandStatus(state="timedOut", waiting=0.9)) is None  # stale
    assert counted_share(IslandStatus(state="active", drained=True, waiting=0.9)) is None
    assert counted_share(None) is None


def status_with(shares: dict[str, float | None], time: float) -> dict[str, Any]:
    islands = {
        name: {"state": "active", **({} if share is None else {"waiting": share})}
        for name, share in shares.items()
    }
    return {"time": time, "islands": islands}


def test_read_waits_counts_each_syncer_document_once_and_only_the_jobs_islands() -> None:
    waits = MergeWaits()
    doc = status_with({"island-0": 0.5, "island-1": 0.05, "other-0": 0.9}, time=100.0)
    for _ in range(3):  # the same document (clock 100) read three times: one read
        waits = read_waits(waits, syncer_view(doc), ISLANDS)
    assert waits.islands["island-0"] == IslandWaits(high=1, low=0, raised=False, share=0.5)
    assert waits.islands["island-1"] == IslandWaits(high=0, low=1, raised=False, share=0.05)
    assert "other-0" not in waits.islands  # another cluster's island at a shared syncer
    assert read_waits(waits, None, ISLANDS) is waits  # the syncer not reached: nothing read
    for t in (105.0, 110.0):
        waits = read_waits(waits, syncer_view({**doc, "time": t}), ISLANDS)
    assert waits.raised() == {"island-0": 0.5} and waits.read_at == 110.0


def test_the_condition_names_the_islands_their_shares_and_what_to_change() -> None:
    assert wait_condition(None) == (False, "NotReported", "")
    unknown = MergeWaits({"island-0": IslandWaits(share=None)})
    assert wait_condition(unknown) == (False, "NotReported", "")
    calm = MergeWaits({"island-0": IslandWaits(share=0.3, high=2)})
    assert wait_condition(calm) == (False, "NotWaiting", "")
    waits = MergeWaits(
        {
            "island-0": IslandWaits(raised=True, share=0.625),
            "island-1": IslandWaits(share=0.05),
            "island-2": IslandWaits(raised=True, share=0.2),
        }
    )
    status, reason, message = wait_condition(waits)
    assert (status, reason) == (True, WAIT_EVENT)
    assert "island-0 62%, island-2 20%" in message and "island-1" not in message
    for knob in ("inner.steps", "sync.compression", "sync.fragments", "sync.overlapSteps"):
        assert knob in message
    assert "docs/cluster.md" in message


def test_the_job_carries_the_condition_and_each_islands_share() -> None:
    doc = status_with({"island-0": 0.5, "island-1": None}, time=1.0)
    raised = MergeWaits({"island-0": IslandWaits(raised=True, share=0.5)}, read_at=1.0)
    obs = observation(syncer=doc)
    conditions = {c.type: c for c in job_conditions(decide_phase(obs, None), obs, {})}
    assert conditions[WAIT_CONDITION].status == "False"  # no reads: nothing raised
    obs = observation(syncer=doc, waits=raised)
    status = compute_status(obs, None)
    by_type = {c.type: c for c in status.conditions}
    assert by_type[WAIT_CONDITION].status == "True"
    assert by_type[WAIT_CONDITION].reason == WAIT_EVENT
    assert [e.waiting for e in status.island_statuses] == [0.5, None]
    assert status.waiting_summary == "50% -"  # kubectl get -o wide's Waiting column
    # A suspended (or finished) job's islands wait for nothing: not raised, whatever was read.
    suspended = compute_status(observation(syncer=doc, waits=raised, spec={"suspend": True}), None)
    assert suspended.phase == "Suspended"
    assert {c.type: c for c in suspended.conditions}[WAIT_CONDITION].status == "False"
    wire = status.model_dump(by_alias=True, mode="json", exclude_none=True)
    assert wire["islandStatuses"][0]["waiting"] == 0.5
    assert "waiting" not in wire["islandStatuses"][1]


@pytest.fixture
def posted_events(caplog: pytest.LogCaptureFixture) -> Any:
    """The Events posted (events.post_event logs each: 'ns/job: REASON message'), as reasons."""
    caplog.set_level("INFO", logger="diloco_operator")

    def reasons() -> list[str]:
        return [
            r.getMessage().split(": ", 1)[1].split(" ", 1)[0]
            for r in caplog.records
            if r.name == "diloco_operator"
        ]

    return reasons


def test_one_event_per_episode_not_per_sync(posted_events: Any) -> None:
    body = {"metadata": {"uid": "u1", "namespace": "ns", "name": "job"}}
    notes: dict[str, str] = {}
    up = MergeWaits({"island-0": IslandWaits(raised=True, share=0.5)})
    down = MergeWaits({"island-0": IslandWaits(share=0.0)})
    for waits in (down, up, up, up, down, down, up, up):
        post_wait_event(body, waits, notes)
    # Two episodes (reads 2-4 and 7-8): two Events.
    assert posted_events() == [WAIT_EVENT] * 2


def test_an_operator_restart_takes_up_a_stored_episode_without_a_new_event(
    posted_events: Any,
) -> None:
    stored = {
        "conditions": [{"type": WAIT_CONDITION, "status": "True"}],
        "islandStatuses": [
            {"name": "island-0", "waiting": 0.4},
            {"name": "island-1", "waiting": 0.05},  # below 0.10: not taken up
            {"name": "island-2"},
        ],
    }
    waits = resumed(stored)
    assert waits.raised() == {"island-0": 0.4}
    # The next read at 0.12 (between the thresholds) keeps it raised: no flap to False.
    body = {"metadata": {"uid": "u1", "namespace": "ns", "name": "job"}}
    notes: dict[str, str] = {}
    note_resumed(body, waits, notes)
    doc = status_with({"island-0": 0.12, "island-1": 0.05, "island-2": None}, time=7.0)
    waits = read_waits(waits, syncer_view(doc), ("island-0", "island-1", "island-2"))
    assert waits.raised() == {"island-0": 0.12}
    post_wait_event(body, waits, notes)
    assert posted_events() == []  # posted before the restart
    # A stored condition that is False (or none) takes nothing up.
    assert resumed({**stored, "conditions": [{"type": WAIT_CONDITION, "status": "False"}]}) == (
        MergeWaits()
    )
    assert resumed(None) == MergeWaits()
