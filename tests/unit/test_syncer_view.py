"""The operator's view of a syncer (syncer_view.py, runtime.SyncerConnection): the typed status as
read, the island states set since laid over it, and the health report read forgivingly."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from diloco_operator.runtime import SyncerConnection
from diloco_operator.status_progress import island_statuses
from diloco_operator.syncer_view import SyncerHealth, SyncerView
from diloco_trainer.api.documents import IslandStatus

from .observations import SYNCER, T0, observation, syncer_status, syncer_view

BANNED = "refused_pushes: 3 pushes refused in a row (syncer.guards.maxRefusals); the last: x"
ISLANDS = {
    "island-0": {"state": "active", "reason": "readded", "lastPush": 100.0, "pushes": 4},
    "island-1": {"state": "dropped", "reason": BANNED},
}


def test_syncer_view_lays_the_states_set_since_the_read_over_the_status() -> None:
    view = syncer_view({"islands": ISLANDS}, {"island-0": "dropped", "island-5": "active"})
    assert view is not None
    dropped = view.island("island-0")
    # Only the state changes: what the syncer said of the island otherwise stays.
    assert dropped is not None and (dropped.state, dropped.reason) == ("dropped", "readded")
    assert (dropped.last_push, dropped.pushes) == (100.0, 4)
    assert view.island("island-5") == IslandStatus(state="active")  # not heard of before
    assert view.island("island-9") is None
    assert view.island_states() == {
        "island-0": "dropped",
        "island-1": "dropped",
        "island-5": "active",
    }
    # The document itself is the syncer's, untouched.
    assert view.status.island_states() == {"island-0": "active", "island-1": "dropped"}


def test_syncer_view_dropped_for_refusals_reads_state_and_reason_as_last_set() -> None:
    view = syncer_view({"islands": ISLANDS})
    assert view is not None and view.dropped_for_refusals() == {"island-1"}
    readded = syncer_view({"islands": ISLANDS}, {"island-1": "active"})
    assert readded is not None and readded.dropped_for_refusals() == set()


def test_syncer_link_keeps_acknowledged_states_until_the_next_read() -> None:
    link = SyncerConnection()
    assert link.view is None and link.error == "not contacted yet"
    link.acknowledge("island-0", "dropped")  # nothing read yet: nothing to lay it over
    link.read(syncer_status({"islands": ISLANDS}))
    view = link.view
    assert view is not None and link.error is None and dict(view.acknowledged) == {}
    link.acknowledge("island-0", "dropped")
    view = link.view
    assert view is not None and view.island_states()["island-0"] == "dropped"
    link.read(syncer_status({"islands": ISLANDS}))  # the syncer's own word replaces it
    view = link.view
    assert view is not None and view.island_states()["island-0"] == "active"
    link.acknowledge("island-0", "dropped")
    link.lost("connection refused")
    assert link.view is None and link.error == "connection refused"
    link.read(syncer_status({"islands": ISLANDS}))
    view = link.view
    assert view is not None and view.island_states()["island-0"] == "active"


def test_island_statuses_show_a_drop_the_syncer_acknowledged_since_the_read() -> None:
    obs = observation()
    dropped = dataclasses.replace(obs, syncer=syncer_view(SYNCER, {"island-0": "dropped"}))
    (before, _) = island_statuses(obs, running=True)
    (after, _) = island_statuses(dropped, running=True)
    assert (before.state, before.in_quorum) == ("active", True)
    assert (after.state, after.in_quorum) == ("dropped", False)
    assert after.last_push == before.last_push == T0.strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.mark.parametrize(
    ("health", "sick", "problems"),
    [
        (None, False, []),  # an older syncer: no report
        ("broken", False, []),  # not an object: read as no report
        ({"healthy": True, "problems": []}, False, []),
        ({"healthy": "false"}, False, []),  # only the boolean false is a problem
        ({"healthy": 0}, False, []),
        ({"healthy": False}, True, []),
        ({"healthy": False, "problems": "x"}, True, []),
        (
            {"healthy": False, "problems": [{"kind": "merge", "count": 2, "message": "m"}, 7]},
            True,
            [("merge", 2), (None, None)],  # an entry that is no object: a problem of no kind
        ),
        ({"healthy": False, "problems": [{"kind": 3, "count": "many"}]}, True, [(None, None)]),
    ],
)
def test_syncer_health_reads_what_it_can_of_the_report(
    health: Any, sick: bool, problems: list[tuple[str | None, int | None]]
) -> None:
    doc = {} if health is None else {"health": health}
    report = SyncerHealth.of(syncer_status(doc))
    assert report.sick is sick
    assert [(p.kind, p.count) for p in report.problems] == problems


def test_syncer_view_health_is_the_report_of_its_status() -> None:
    view = SyncerView(syncer_status({"health": {"healthy": False, "problems": [{"kind": "x"}]}}))
    assert view.health().sick and [p.kind for p in view.health().problems] == ["x"]
