"""Islands that start late (issue 9): a `quorum: 2` of 2 job waits for an island that has not
joined yet however long its processes take to start, past heartbeatTimeoutSeconds (the heartbeat
timeout is for islands that went silent, not for slow starts), so its first merge holds both
islands; and `diloco run` drops an island whose processes all exited before it joined, so the job
does not wait islands.startupTimeoutSeconds (the default 600 s) for it."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.local.run import LocalRun

from .conftest import wait_until
from .test_convergence import (  # noqa: F401  (local_run is a fixture)
    local_run,
    run_to_finish,
    status_of,
)

pytestmark = pytest.mark.e2e

HEARTBEAT = 5.0
OUTER_STEPS = 2


def two_island_job(make_spec: Callable[..., JobSpec]) -> JobSpec:
    """K = M = 2 with the default fragments and overlap, a short heartbeat timeout."""
    return make_spec(
        islands={"count": 2},
        inner={"steps": 5, "batchSize": 4, "seqLen": 32, "lr": 3e-3},
        sync={"quorum": 2, "graceSeconds": "auto", "heartbeatTimeoutSeconds": HEARTBEAT},
        stopAfter={"outerSteps": OUTER_STEPS},
        syncer={"checkpoint": {"everyOuterSteps": 100}, "evalEveryOuterSteps": 100},
    )


def merge_log(run: LocalRun) -> list[dict[str, Any]]:
    path = run.workdir / "syncer" / "merges.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def contributors(merge: dict[str, Any]) -> set[str]:
    return {c["island"] for c in merge["contributors"]}


def test_slow_start_an_island_starting_after_the_heartbeat_timeout_is_in_the_first_merge(
    make_spec: Callable[..., JobSpec],
    local_run: Callable[..., LocalRun],  # noqa: F811
) -> None:
    spec = two_island_job(make_spec)
    assert spec.islands.startup_timeout_seconds == 600  # the default: no tuning needed
    run = local_run(spec)
    run.start_syncer()
    ready_at = time.time()
    run.start_island(0)

    def island_0_waited() -> dict[str, Any] | None:
        """The syncer's status once island-0 has pushed and twice the heartbeat timeout has
        passed since the syncer was ready (the syncer's clock: same machine)."""
        doc = status_of(run)
        pushed = doc["islands"].get("island-0", {}).get("pushes", 0) >= 1
        return doc if pushed and doc["time"] > ready_at + 2 * HEARTBEAT else None

    waited = wait_until(island_0_waited, timeout=300, what="island-0 waiting for island-1")
    # island-1 has not joined: still awaited, it holds the quorum, nothing merged on island-0.
    assert waited["awaitedIslands"] == 1 and waited["quorum"] == 2, waited
    assert waited["versions"] == [0, 0], waited
    assert "island-1" not in waited["islands"]

    run.start_island(1)  # well after the heartbeat timeout
    status = run_to_finish(run, timeout=600)
    assert status.finished and status.outer_step == OUTER_STEPS
    merges = merge_log(run)
    assert merges and contributors(merges[0]) == {"island-0", "island-1"}, merges[0]


def test_slow_start_diloco_run_drops_an_island_whose_processes_exited_before_joining(
    make_spec: Callable[..., JobSpec],
    local_run: Callable[..., LocalRun],  # noqa: F811
) -> None:
    spec = two_island_job(make_spec)
    run = local_run(spec)
    run.start_syncer()
    run.start_island(0)
    for proc in run.start_island(1):
        proc.kill()  # long before it could import torch, let alone join
        proc.wait()
    # Without the drop the quorum would wait islands.startupTimeoutSeconds (600 s) for island-1.
    status = run_to_finish(run, timeout=300)
    assert status.finished and status.outer_step == OUTER_STEPS
    island = status.islands["island-1"]
    assert (island.state, island.joins) == ("dropped", 0), island
    assert "every process of the island exited" in island.reason, island
    assert all(contributors(m) == {"island-0"} for m in merge_log(run))
