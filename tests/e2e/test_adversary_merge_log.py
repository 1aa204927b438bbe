"""A merge log the syncer cannot write, on a live `diloco syncer` (issue 22, finding 6).

The merge log (state_dir/merges.jsonl) made unwritable mid-run (read-only or a full disk): the
next merge committed the weights, then raised; the syncer marked itself failed, answered 503 on
every route including /healthz, and a SIGTERM then skipped the final checkpoint, so the restart
lost the merges since the last one. Now the write fails soft: the honest islands keep merging,
/healthz stays ok with the `mergeLog` problem listed, a stop writes its final checkpoint and the
restart has every merge; the entries kept meanwhile are written once the log can be again.

The fault is real: merges.jsonl is replaced by a directory, which no process (root included) can
append to (IsADirectoryError, an OSError as from a full disk).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from diloco_trainer.api import protocol
from diloco_trainer.local import launch

from .conftest import SyncerHandle, wait_until
from .test_adversary import HONEST, SPEC, honest_active, honest_round, join_all, start_syncer

pytestmark = pytest.mark.e2e

MERGE_LOG = "mergeLog"  # syncer/merging/merge_log.py's health problem kind


@pytest.fixture
def syncer(tmp_path: Path) -> Iterator[SyncerHandle]:
    handle = start_syncer(tmp_path, SPEC, "adversary-merge-log")
    try:
        yield handle
    finally:
        handle.proc.stop(timeout=10)


def restart(handle: SyncerHandle) -> None:
    """Start the syncer again on the same state dir, token and port (after it stopped)."""
    handle.proc = launch.start_syncer(
        handle.files,
        port=handle.port,
        state_dir=handle.state_dir,
        job_name="adversary-merge-log",
        log_file=handle.log_file,
        extra_env={"OMP_NUM_THREADS": "1"},
    )
    launch.wait_ready(handle.url, handle.token, timeout=90, proc=handle.proc)


def logged_versions(path: Path) -> list[int]:
    return [json.loads(line)["version"] for line in path.read_text().splitlines()]


def settled(handle: SyncerHandle) -> dict[str, Any]:
    """The status once no push waits in an open round (each honest push may merge on its own
    with quorum 1, so how many merges a round of pushes makes is not fixed)."""
    wait_until(lambda: handle.status()["pending"] == [0], timeout=60, what="no pending push")
    return handle.status()


def test_adversary_unwritable_merge_log_loses_no_merge(syncer: SyncerHandle) -> None:
    shapes = join_all(syncer, HONEST)
    for _ in range(2):
        honest_round(syncer, shapes)
    written = settled(syncer)["versions"][0]
    log_file = syncer.state_dir / "merges.jsonl"
    assert logged_versions(log_file) == list(range(1, written + 1))
    log_file.rename(log_file.with_name("merges.jsonl.aside"))
    log_file.mkdir()  # from now on no write of the merge log can succeed
    for _ in range(3):
        honest_round(syncer, shapes)  # merges go on
    assert syncer.request("GET", protocol.ROUTE_READYZ, token=None)[0] == 200
    code, health = syncer.request("GET", protocol.ROUTE_HEALTHZ, token=None)
    assert code == 200 and health["ok"] is True
    assert [p["kind"] for p in health["problems"]] == [MERGE_LOG]
    before = settled(syncer)
    merged = before["versions"][0]
    assert merged >= written + 3 and before["mergeCount"] == merged
    assert syncer.proc.stop(timeout=60) == 0  # a normal stop, with its final checkpoint
    restart(syncer)
    after = syncer.status()
    assert (after["versions"], after["mergeCount"]) == ([merged], merged)  # no merge lost
    assert honest_active(syncer) == dict.fromkeys(HONEST, protocol.STATE_ACTIVE)
    log_file.rmdir()  # the disk is writable again
    join_all(syncer, HONEST)
    honest_round(syncer, shapes)
    now = settled(syncer)
    # The merges since are written (those kept in memory went with the stop: the checkpoint
    # holds their state), and the problem is gone.
    assert logged_versions(log_file) == list(range(merged + 1, now["versions"][0] + 1))
    assert now["health"]["healthy"] is True
