"""Decoupled quality (issue 9): three identical islands at quorum 1 land close to quorum 3 at
equal tokens, with the job's defaults for everything else (fragments, overlap, grace window,
merge rule).

The issue's target, 5%, is what this test asserts. Measured on a loaded 2-core machine (a
benchmark running beside it) after the decoupled grace window was sized from H: quorum 1 at
1.032x, 1.005x, 0.994x and 0.993x of quorum 3 (35-36 merges at quorum 1); before
that change it ended 3-6% behind, and 1.82x before Delayed Nesterov.

At K = 1 every island's push may open a merge of its own; what keeps the quality is the outer
update (folded per round of work, not per merge), the overlap steps being kept, and islands
pulling each other into the same merges (phase alignment). Real syncer and learner processes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from diloco_trainer.api.spec import JobSpec, SyncSpec
from diloco_trainer.local.run import LocalRun

from .conftest import deep_merge
from .test_convergence import local_run, run_to_finish, status_of

__all__ = ["local_run"]  # the fixture, used by name below

pytestmark = pytest.mark.e2e

ISLANDS = 3
# H = 20 is the smallest H at which the default overlap is its full 5 steps (min(5, H // 4)):
# the grace window lives in those steps. At H = 10 (overlap 2) and ~15 ms steps there is no
# room for one, and quorum 1 ended 4-10% behind quorum 3 (3-4% at H = 20).
INNER_STEPS = 20
# Quorum 1 may land this far from quorum 3 (issue 9's target).
TOLERANCE = 0.05
STEPS = 240  # per island, at K = M: 12 rounds
BATCH, SEQ = 8, 32
BUDGET = ISLANDS * STEPS * BATCH * SEQ
QUALITY_SPEC: dict[str, Any] = {
    "data": {"evalTokens": 4096},
    "islands": {"count": ISLANDS},
    "inner": {
        "steps": INNER_STEPS,
        "batchSize": BATCH,
        "seqLen": SEQ,
        "lr": 3e-3,
        "warmupSteps": 10,
    },
    "outer": {"lr": 0.7, "momentum": 0.9, "nesterov": True},
    "sync": {
        "graceSeconds": "auto",
        "heartbeatTimeoutSeconds": 30,
        # the job's default codec (the e2e base spec pins fp32 for hand-made pushes)
        "compression": SyncSpec.model_fields["compression"].default,
    },
    "stopAfter": {"outerSteps": None, "tokens": BUDGET},
    "syncer": {"checkpoint": {"everyOuterSteps": 1000}, "evalEveryOuterSteps": 1000},
}


def final_loss(
    quorum: int, make_spec: Callable[..., JobSpec], local_run: Callable[..., LocalRun]
) -> dict[str, Any]:
    spec = make_spec(**deep_merge(QUALITY_SPEC, {"sync": {"quorum": quorum}}))
    run = local_run(spec)
    run.start_syncer()
    for i in range(ISLANDS):
        run.start_island(i)
    run_to_finish(run, timeout=300)
    status = status_of(run)
    run.stop_all(timeout=5)  # free the CPU for the next run
    return status


def test_quorum_1_lands_within_5_percent_of_quorum_3_at_equal_tokens(
    make_spec: Callable[..., JobSpec], local_run: Callable[..., LocalRun]
) -> None:
    started = time.monotonic()
    full = final_loss(ISLANDS, make_spec, local_run)
    one = final_loss(1, make_spec, local_run)
    for status in (full, one):
        assert status["finished"]
        # The budget, to within a step an island (the drain rounds each part down).
        assert status["tokens"] > BUDGET - ISLANDS * BATCH * SEQ, status["tokens"]
        assert status["evalLoss"] < 0.8 * status["initialEvalLoss"], "did not train"
    k1, k3 = one["evalLoss"], full["evalLoss"]
    assert abs(k1 - k3) <= TOLERANCE * k3, (
        f"quorum 1: {k1:.4f}, quorum 3: {k3:.4f} ({k1 / k3:.3f}x) after "
        f"{time.monotonic() - started:.0f}s; merges at quorum 1: {one['mergeCount']}"
    )
