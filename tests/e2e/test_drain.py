"""The drain at K = M (learner/drain.py): each island trains exactly its share of
stopAfter.tokens, pushes what its two streamed fragments still hold (partial rounds) and the job
finishes with every processed token merged: stopAfter.tokens met exactly, not overshot."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from diloco_trainer.api.documents import MergeRecord
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.local.run import LocalRun

from .test_convergence import (  # noqa: F401  (local_run is a fixture)
    local_run,
    run_to_finish,
    start_synchronised,
)

pytestmark = pytest.mark.e2e

ISLANDS = 2
STEPS = 20  # each island's share: 20 steps, not a multiple of H = 6
STEP_TOKENS = 2 * 32  # batchSize x seqLen


def test_drain_merges_every_processed_token_and_stops_at_the_budget(
    make_spec: Callable[..., JobSpec],
    local_run: Callable[..., LocalRun],  # noqa: F811
) -> None:
    budget = ISLANDS * STEPS * STEP_TOKENS
    spec = make_spec(
        islands={"count": ISLANDS},
        inner={"steps": 6},
        sync={"quorum": ISLANDS, "fragments": 2, "graceSeconds": 5},
        stopAfter={"outerSteps": None, "tokens": budget},
    )
    run = local_run(spec)
    start_synchronised(run)
    status = run_to_finish(run, timeout=600)
    run.stop_all(timeout=30)  # the learners exit on the finish: their logs are complete

    assert status.finished and status.tokens == budget  # exactly: nothing past the budget
    merges = [
        MergeRecord.model_validate_json(line)
        for line in (run.workdir / "syncer" / "merges.jsonl").read_text().splitlines()
    ]
    for island in (f"island-{i}" for i in range(ISLANDS)):
        # Every step the island took is in both fragments' merges, the last of each a partial
        # round (20 = 3 x 6 + 2 for fragment 0; 20 = 9 + 6 + 5 for fragment 1, whose first
        # push holds a round and a half).
        for f in (0, 1):
            steps = [c.steps for m in merges if m.fragment == f for c in m.contributors
                     if c.island == island]  # fmt: skip
            assert sum(steps) == STEPS, (island, f, steps)
            assert steps[-1] < spec.inner.steps, (island, f, steps)
        log = (run.logs / f"{island}-rank0.log").read_text()
        assert re.search(r"step \d+: this island's share of stopAfter is done: draining", log)
        assert f"the job has finished: exiting after {STEPS} steps" in log
        assert status.islands[island].merged_tokens == STEPS * STEP_TOKENS
