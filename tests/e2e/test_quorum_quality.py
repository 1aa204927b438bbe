"""Decoupled quality (issue 9): three identical islands at quorum 1 land close to quorum 3 at
equal tokens, with the job's defaults for everything else (fragments, overlap, grace window,
merge rule).

The issue's target, 5%, is what this test asserts, on the mean of two runs a quorum at exactly
equal tokens (the budget, interpolated over each run's evaluations: at K = M a fresh job's fill
steps take it 15-19% past the budget, so final losses are not at equal tokens, and a CI run
compared them at 1.060x). Measured on a loaded 2-core machine (a CI run beside it), one run a
quorum: 1.007x and 1.043x at equal tokens (final losses 1.011x, 1.057x). Earlier, final losses
after the decoupled grace window was sized from H: 1.032x, 1.005x, 0.994x and 0.993x; before
that change 3-6% behind, and 1.82x before Delayed Nesterov.

At K = 1 every island's push may open a merge of its own; what keeps the quality is the outer
update (folded per round of work, not per merge), the overlap steps being kept, and islands
pulling each other into the same merges (phase alignment). Real syncer and learner processes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import pytest
from diloco_trainer.api.spec import JobSpec, SyncSpec
from diloco_trainer.local.run import LocalRun

from hack.localcluster.chaos_measure import loss_at_tokens

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
RUNS = 2  # a quorum, interleaved; their mean loss at equal tokens is compared
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
    # an evaluation every outer step: the losses are compared at the budget, interpolated
    "syncer": {"checkpoint": {"everyOuterSteps": 1000}, "evalEveryOuterSteps": 1},
}


def loss_at(status: dict[str, Any], tokens: int) -> float:
    """The run's eval loss at `tokens` merged tokens, interpolated over its evalHistory. At
    K = M the job ends once every island drained, its fill steps' tokens on top of the budget
    (docs/algorithm.md, "Fill steps at K = M": up to a round per fragment at a fresh job's first
    merges, 15% over it here), so the final losses are not at equal tokens."""
    history = [(int(e["tokens"]), float(e["evalLoss"])) for e in status["evalHistory"]]
    return loss_at_tokens(history, tokens)


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
    # Two runs a quorum, interleaved so that the load falls on both: one run's loss moves by
    # several % with its merges' timing (equal tokens: 1.007x and 1.043x in two runs a pair).
    runs: dict[int, list[dict[str, Any]]] = {quorum: [] for quorum in (ISLANDS, 1)}
    for _ in range(RUNS):
        for quorum, statuses in runs.items():
            statuses.append(final_loss(quorum, make_spec, local_run))
    everyone = [status for statuses in runs.values() for status in statuses]
    for status in everyone:
        assert status["finished"]
        # The budget, to within a step an island (the drain rounds each part down).
        assert status["tokens"] > BUDGET - ISLANDS * BATCH * SEQ, status["tokens"]
        assert status["evalLoss"] < 0.8 * status["initialEvalLoss"], "did not train"
    # equal tokens: the budget, or the fewest of the runs' merged tokens if one ended short of
    # it (by less than a step an island, asserted above)
    tokens = min(BUDGET, *(int(s["evalHistory"][-1]["tokens"]) for s in everyone))
    k3, k1 = (statistics.fmean(loss_at(s, tokens) for s in runs[q]) for q in (ISLANDS, 1))
    assert abs(k1 - k3) <= TOLERANCE * k3, (
        f"quorum 1: {k1:.4f}, quorum 3: {k3:.4f} ({k1 / k3:.3f}x, means of {RUNS}) at "
        f"{tokens} tokens (final: {[s['tokens'] for s in everyone]}) after "
        f"{time.monotonic() - started:.0f}s; merges at quorum 1: "
        f"{[s['mergeCount'] for s in runs[1]]}"
    )
