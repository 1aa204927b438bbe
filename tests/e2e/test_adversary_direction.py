"""The direction check never refuses honest work (issue 22): three real learner islands train a
job to its end, every push of each checked against the other two's latest (direction.py: a
cosine below -0.5 is refused), and not one push is refused by it; every island stays active and the
eval loss falls. (With two islands the check needs a second other island and stays off.)"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from diloco_trainer.api import protocol
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.local.run import LocalRun

from .test_convergence import local_run  # noqa: F401  (a fixture)

pytestmark = pytest.mark.e2e

ISLANDS = 3


def test_adversary_direction_check_refuses_no_honest_push(
    make_spec: Callable[..., JobSpec],
    local_run: Callable[..., LocalRun],  # noqa: F811
) -> None:
    spec = make_spec(
        islands={"count": ISLANDS},
        inner={"steps": 5, "batchSize": 4, "seqLen": 32, "lr": 3e-3},
        outer={"lr": 0.5, "momentum": 0.5},
        # The job's own push codec (int8 with error feedback): the pushes a real job sends.
        sync={
            "quorum": 2,
            "graceSeconds": 0.5,
            "heartbeatTimeoutSeconds": 60,
            "compression": "int8",
        },
        stopAfter={"outerSteps": 8},
        syncer={"checkpoint": {"everyOuterSteps": 100}, "evalEveryOuterSteps": 4},
    )
    run = local_run(spec)
    run.start_syncer()
    for i in range(ISLANDS):
        run.start_island(i)
    status = asyncio.run(asyncio.wait_for(run.watch(time.monotonic()), 600)).to_json()
    assert status["finished"] and status["outerStep"] >= 8
    pushes = sum(i["pushes"] for i in status["islands"].values())
    assert pushes >= 2 * ISLANDS * 8 // 2  # the check ran on many pushes, not a handful
    # Neither the direction check nor the learned bound (both norm_outlier) refused a push, and
    # no learner held back for rounds pushed more steps than one push may carry (it holds at
    # that cap instead: learner/fragment_state.at_step_cap).
    outliers = {i: r for i, r in status["refusals"].items() if protocol.ERROR_NORM_OUTLIER in r}
    assert outliers == {}
    too_long = {i: r for i, r in status["refusals"].items() if protocol.ERROR_STEPS_RANGE in r}
    assert too_long == {}
    states = {name: i["state"] for name, i in status["islands"].items()}
    assert set(states.values()) <= {protocol.STATE_ACTIVE, protocol.STATE_LEFT}, states
    assert status["evalLoss"] < status["initialEvalLoss"]
