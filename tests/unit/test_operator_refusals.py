"""The operator's Events for contributions a syncer refused (refusals.py): counts read from the
syncer's status, deltas between looks, and what is posted (expectations derived by hand)."""

from __future__ import annotations

from typing import Any

import pytest
from diloco_operator import metrics
from diloco_operator.refusals import (
    AT_BOUND,
    AT_BOUND_MESSAGE,
    DROPPED_BY_SYNCER,
    OTHER,
    REFUSED,
    RefusalNote,
    dropped_message,
    new_refusals,
    post_refusal_events,
    refusal_counts,
)
from diloco_trainer.api import protocol
from diloco_trainer.api.documents import DocumentError

from .observations import syncer_view

CAP = protocol.ERROR_NORM_CAP
OUTLIER = protocol.ERROR_NORM_OUTLIER
INVALID = protocol.REFUSAL_INVALID
OWN = ("island-0", "island-1")
JOB = {"metadata": {"name": "demo", "namespace": "ns", "uid": "u1"}}
BANNED = "refused_pushes: 3 pushes refused in a row (syncer.guards.maxRefusals); the last: x"


def test_refusal_counts_keep_own_islands_and_known_reasons() -> None:
    status = syncer_view(
        {
            "refusals": {
                "island-0": {CAP: 2, OUTLIER: 1},
                "island-1": {"<b>free text</b>": 4, "weird": 1, INVALID: 0},
                "eu-island-0": {CAP: 9},  # another cluster's island of a shared syncer
            }
        }
    )
    assert refusal_counts(status, OWN) == {
        ("island-0", CAP): 2,
        ("island-0", OUTLIER): 1,
        ("island-1", OTHER): 5,  # unknown reasons summed, never quoted; zero left out
    }


@pytest.mark.parametrize("count", [-1, 0, 2**63])
def test_refusal_counts_leave_out_what_is_not_a_count(count: int) -> None:
    assert refusal_counts(syncer_view({"refusals": {"island-0": {CAP: count}}}), OWN) == {}


@pytest.mark.parametrize(
    "doc", [{"island-0": {CAP: 1.5}}, {"island-0": {CAP: None}}, {"island-9": "x"}]
)
def test_refusal_counts_that_are_not_numbers_make_the_status_unreadable(doc: Any) -> None:
    with pytest.raises(DocumentError, match="refusals"):  # the client refuses the document
        syncer_view({"refusals": doc})


def test_refusal_counts_none_while_the_syncer_is_not_reached() -> None:
    assert refusal_counts(None, OWN) is None
    assert refusal_counts(syncer_view({}), OWN) == {}  # an older syncer: no refusals field


def test_new_refusals_are_the_growth_since_the_last_look() -> None:
    before = {("island-0", CAP): 2, ("island-1", OUTLIER): 1}
    after = {("island-0", CAP): 5, ("island-1", OUTLIER): 1, ("island-1", INVALID): 1}
    assert new_refusals(before, after) == [
        RefusalNote("island-0", CAP, new=3, total=5),
        RefusalNote("island-1", INVALID, new=1, total=1),
    ]
    assert new_refusals(after, after) == []


def test_new_refusals_after_a_syncer_restart_count_from_zero() -> None:
    # 7 refusals seen, the syncer restarted (its counts start at 0) and has refused 2 since.
    assert new_refusals({("island-0", CAP): 7}, {("island-0", CAP): 2}) == [
        RefusalNote("island-0", CAP, new=2, total=2)
    ]


def test_new_refusals_first_look_reports_everything() -> None:
    assert new_refusals(None, {("island-1", CAP): 4}) == [RefusalNote("island-1", CAP, 4, 4)]


def test_refusal_note_message_names_island_reason_and_counts() -> None:
    assert RefusalNote("island-1", CAP, 1, 1).message() == (
        "island-1: 1 push refused (norm_above_cap); 1 since the syncer started"
    )
    assert RefusalNote("island-0", OUTLIER, 3, 5).message() == (
        "island-0: 3 pushes refused (norm_outlier); 5 since the syncer started"
    )


def _posted(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The Events post_event logged: 'REASON message' each."""
    return [r.getMessage().split(": ", 1)[1] for r in caplog.records if r.name == "diloco_operator"]


def _metric(reason: str) -> float:
    return metrics.REFUSED_CONTRIBUTIONS.labels(reason=reason)._value.get()


def test_post_refusal_events_once_per_growth(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="diloco_operator")
    notes: dict[str, str] = {}
    before_metric = _metric(CAP)
    status = syncer_view({"refusals": {"island-1": {CAP: 2}}, "islands": {}})
    seen = post_refusal_events(JOB, status, OWN, None, notes)
    assert seen == {("island-1", CAP): 2}
    seen = post_refusal_events(JOB, status, OWN, seen, notes)  # the same status: nothing new
    seen = post_refusal_events(JOB, None, OWN, seen, notes)  # syncer away: counts kept
    assert seen == {("island-1", CAP): 2}
    status = syncer_view({"refusals": {"island-1": {CAP: 3}}, "islands": {}})
    seen = post_refusal_events(JOB, status, OWN, seen, notes)
    assert _posted(caplog) == [
        f"{REFUSED} island-1: 2 pushes refused (norm_above_cap); 2 since the syncer started",
        f"{REFUSED} island-1: 1 push refused (norm_above_cap); 3 since the syncer started",
    ]
    assert _metric(CAP) - before_metric == 3


def test_post_refusal_events_island_dropped_by_the_syncer_once_per_drop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="diloco_operator")
    notes: dict[str, str] = {}
    dropped = syncer_view({"islands": {"island-1": {"state": "dropped", "reason": BANNED}}})
    readded = syncer_view({"islands": {"island-1": {"state": "active", "reason": "re-added"}}})
    for status in (dropped, dropped, readded, dropped):
        post_refusal_events(JOB, status, OWN, {}, notes)
    drops = [m for m in _posted(caplog) if m.startswith(DROPPED_BY_SYNCER)]
    assert len(drops) == 2  # the first drop, and the one after the re-add
    assert drops[0] == f"{DROPPED_BY_SYNCER} {dropped_message('island-1')}"
    assert "the last" not in drops[0]  # the syncer's own text stays out


def test_post_refusal_events_island_at_bound_once_per_report(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 46: the syncer's islandAtBound health problem is one Warning Event per report (not
    the syncer's text), again after it cleared."""
    caplog.set_level("INFO", logger="diloco_operator")
    notes: dict[str, str] = {}
    problem = {"kind": "islandAtBound", "count": 3, "message": "island-1's last 8 pushes ..."}
    sick = syncer_view({"islands": {}, "health": {"healthy": False, "problems": [problem]}})
    well = syncer_view({"islands": {}, "health": {"healthy": True, "problems": []}})
    for status in (sick, sick, well, sick):
        post_refusal_events(JOB, status, OWN, {}, notes)
    posted = [m for m in _posted(caplog) if m.startswith(AT_BOUND)]
    assert posted == [f"{AT_BOUND} {AT_BOUND_MESSAGE}"] * 2
