"""Decoupling: with a quorum K < M, an island slowed 3x (DILOCO_SLOWDOWN=3) does not hold the
others back. Rounds keep completing at the fast islands' pace, most of them without the straggler,
and the straggler still contributes now and then."""

from __future__ import annotations

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

OUTER_STEPS = 10
SLOW = "island-2"


def test_slow_island_does_not_hold_back_the_quorum(
    make_spec: Callable[..., JobSpec],
    local_run: Callable[..., LocalRun],  # noqa: F811
) -> None:
    spec = make_spec(
        islands={"count": 3},
        # every island H: the decoupling of K < M alone (by default, stepsPerIsland auto, the
        # slow island's rounds shrink to its pace and it joins most merges instead:
        # tests/e2e/test_island_rounds.py)
        inner={"steps": 5, "stepsPerIsland": "fixed", "batchSize": 4, "seqLen": 32, "lr": 3e-3},
        sync={"quorum": 2, "graceSeconds": "auto", "heartbeatTimeoutSeconds": 30},
        stopAfter={"outerSteps": OUTER_STEPS},
        syncer={"checkpoint": {"everyOuterSteps": 100}, "evalEveryOuterSteps": 100},
    )
    run = local_run(spec, slowdowns={2: 3.0})
    # Lined up at their joins (start_synchronised), the learners' own start-together rule
    # (learner/start_together.py) has them take their first step together. The whole job is
    # about a second at the fast pace: a learner that came up a second after the others on a
    # loaded host (start-up skew beyond that rule's 30 s is possible too) found it run without
    # it: the slow island's, or a fast one's, with the slow island then in the quorum.
    start_synchronised(run)
    status = run_to_finish(run, timeout=600)

    merges = [
        MergeRecord.model_validate_json(line)
        for line in (run.workdir / "syncer" / "merges.jsonl").read_text().splitlines()
    ]
    contributors = [{c.island for c in m.contributors} for m in merges]
    without_slow = [c for c in contributors if SLOW not in c]
    with_slow = [c for c in contributors if SLOW in c]
    # The job stops at the first merge that completes OUTER_STEPS rounds of work. A merge
    # carries its pushes' share of a round (core/outer.py), so one can complete two and the
    # final outer step pass OUTER_STEPS by one: every merge before the last was short of it.
    assert status.outer_step in (OUTER_STEPS, OUTER_STEPS + 1)
    assert merges[-1].outer_step == status.outer_step
    assert all(m.outer_step < OUTER_STEPS for m in merges[:-1]), [m.outer_step for m in merges]
    # Rounds completed at the fast islands' pace: most merges did not wait for the straggler
    # (lock-step with it would put it in every merge).
    assert len(without_slow) >= len(merges) // 2, contributors
    # ...and every such merge had both fast islands (the quorum), none ran on one island alone.
    assert all(c == {"island-0", "island-1"} for c in without_slow), contributors
    # The straggler is slowed, not excluded: its work still gets merged.
    assert with_slow, contributors
    islands = status.islands
    assert islands[SLOW].pushes < min(islands["island-0"].pushes, islands["island-1"].pushes)
