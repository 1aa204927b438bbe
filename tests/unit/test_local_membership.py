"""`diloco run` tells the syncer about islands whose processes are gone (local/run.py
island_changes): an island none of whose processes is alive is dropped, so the quorum stops
waiting for it; a dropped island with a live process again is re-added."""

from __future__ import annotations

from diloco_trainer.local.run import island_changes


def test_local_membership_an_island_is_dropped_only_when_every_process_exited() -> None:
    alive = {"island-0": [True, True], "island-1": [False, True], "island-2": [False, False]}
    assert island_changes(alive, set()) == (["island-2"], [])


def test_local_membership_an_island_is_dropped_once() -> None:
    alive = {"island-0": [True], "island-1": [False]}
    assert island_changes(alive, {"island-1"}) == ([], [])


def test_local_membership_a_dropped_island_started_again_is_re_added() -> None:
    alive = {"island-0": [True], "island-1": [False, True], "island-2": [False]}
    assert island_changes(alive, {"island-1", "island-2"}) == ([], ["island-1"])


def test_local_membership_an_island_without_processes_is_left_alone() -> None:
    # Not started yet (no processes at all): nothing says it failed.
    assert island_changes({"island-0": []}, set()) == ([], [])
    assert island_changes({}, {"island-3"}) == ([], [])
