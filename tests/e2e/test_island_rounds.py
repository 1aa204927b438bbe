"""Islands of different speeds (inner.stepsPerIsland auto, core/island_rounds.py) in real
processes: an island slowed 3x (DILOCO_SLOWDOWN=3) beside a fast one is given a shorter round by
the syncer, its learner adopts it, and from then on both islands push at about the same rate."""

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

H = 12
FAST, SLOW = "island-0", "island-1"


def test_a_slow_island_gets_a_shorter_round_and_pushes_at_the_fast_ones_pace(
    make_spec: Callable[..., JobSpec],
    local_run: Callable[..., LocalRun],  # noqa: F811
) -> None:
    spec = make_spec(
        islands={"count": 2},
        inner={"steps": H, "stepsPerIsland": "auto", "batchSize": 4, "seqLen": 32, "lr": 3e-3},
        # heartbeats every second (timeout / 4): the syncer reads step times from them
        sync={"quorum": 1, "graceSeconds": "auto", "heartbeatTimeoutSeconds": 4},
        stopAfter={"outerSteps": 40},
        syncer={"checkpoint": {"everyOuterSteps": 100}, "evalEveryOuterSteps": 100},
    )
    run = local_run(spec, slowdowns={1: 3.0})
    start_synchronised(run)
    status = run_to_finish(run, timeout=600)

    # H_i = round(H x t_fast / t_slow): about 12 / 3 = 4; well under H whatever the load
    slow_steps, fast_steps = status.islands[SLOW].inner_steps, status.islands[FAST].inner_steps
    assert fast_steps == H
    assert slow_steps is not None and slow_steps <= H // 2, slow_steps
    merges = [
        MergeRecord.model_validate_json(line)
        for line in (run.workdir / "syncer" / "merges.jsonl").read_text().splitlines()
    ]
    pushes = [(m.version, c) for m in merges for c in m.contributors]
    # the slow island's pushes shrank to its new round (its kept overlap steps ride along)
    slow_pushes = [c for _, c in pushes if c.island == SLOW]
    adopted = next(i for i, c in enumerate(slow_pushes) if c.steps < H)
    assert slow_pushes[-1].steps < H, [c.steps for c in slow_pushes]
    # from its first short push on, it pushes about as often as the fast island; with a fixed
    # H it would push a third as often
    since = slow_pushes[adopted].received_at
    assert since is not None
    later = [c.island for _, c in pushes if c.received_at is not None and c.received_at >= since]
    assert later.count(SLOW) >= 0.6 * later.count(FAST), (later.count(SLOW), later.count(FAST))
