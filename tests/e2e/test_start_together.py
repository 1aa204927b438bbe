"""A fresh decoupled job's islands take their first step together (learner/start_together.py):
at K = 1 of 2 an island whose processes start seconds after the other's would otherwise push
every fragment that much later, and the first merges would hold one island's work each. Here
island-1 is started only once island-0 says it waits for it; the first merge of each fragment
then holds both islands."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from diloco_trainer.api.documents import MergeRecord
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.local.run import LocalRun

from .conftest import wait_until
from .test_convergence import (  # noqa: F401  (local_run is a fixture)
    local_run,
    run_to_finish,
)

pytestmark = pytest.mark.e2e


def test_start_together_a_late_island_is_in_the_first_merges(
    make_spec: Callable[..., JobSpec],
    local_run: Callable[..., LocalRun],  # noqa: F811
) -> None:
    spec = make_spec(
        islands={"count": 2},
        inner={"steps": 6},
        # A short fixed window: without the wait, island-0's first pushes merge alone long
        # before island-1's processes have imported torch.
        sync={"quorum": 1, "fragments": 2, "graceSeconds": 0.5, "heartbeatTimeoutSeconds": 120},
        stopAfter={"outerSteps": 3},
    )
    run = local_run(spec)
    run.start_syncer()
    run.start_island(0)
    first = run.logs / "island-0-rank0.log"
    wait_until(
        lambda: first.exists() and "waiting for 1 island(s) to join" in first.read_text(),
        timeout=120,
        what="island-0 waiting for island-1 before its first step",
    )
    run.start_island(1)
    status = run_to_finish(run, timeout=600)
    run.wait_learners(timeout=60)
    run.stop_all(timeout=30)

    assert status.finished
    log = first.read_text()
    assert "every island has joined after" in log, log[-2000:]
    merges = [
        MergeRecord.model_validate_json(line)
        for line in (run.workdir / "syncer" / "merges.jsonl").read_text().splitlines()
    ]
    # The first merge of each fragment holds both islands' first pushes.
    for f in (0, 1):
        firsts = [m for m in merges if m.fragment == f][:1]
        assert [sorted(c.island for c in m.contributors) for m in firsts] == [
            ["island-0", "island-1"]
        ], (f, merges)
