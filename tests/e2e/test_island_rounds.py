"""Islands of different speeds (inner.stepsPerIsland auto, core/island_rounds.py) in real
processes: an island slowed 3x (DILOCO_SLOWDOWN=3) beside a fast one is given a shorter round by
the syncer, its learner adopts it, and from then on both islands push at about the same rate."""

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


def test_at_k_equal_m_the_token_budget_is_split_by_each_islands_round(
    make_spec: Callable[..., JobSpec],
    local_run: Callable[..., LocalRun],  # noqa: F811
) -> None:
    """K = M with a 3x slower island on a shorter round: the syncer's stop targets split the
    budget by H_i x tokens per step (syncer/state/targets.lock_step_weights), so every island
    drains with the job at the budget but for a step each, all of it merged. (1/M each, counted
    in rounds of H, drained the job short of it and trained on to the budget's merge.)"""
    step_tokens = 4 * 32  # batchSize x seqLen
    # about 30 rounds of H + H/3 steps: heartbeats every second, the targets come 3 s early
    budget = 30 * (H + H // 3) * step_tokens
    spec = make_spec(
        islands={"count": 2},
        inner={"steps": H, "stepsPerIsland": "auto", "batchSize": 4, "seqLen": 32, "lr": 3e-3},
        sync={"quorum": 2, "fragments": 2, "heartbeatTimeoutSeconds": 4},
        stopAfter={"outerSteps": None, "tokens": budget},
        syncer={"checkpoint": {"everyOuterSteps": 100}, "evalEveryOuterSteps": 100},
    )
    run = local_run(spec, slowdowns={1: 3.0})
    start_synchronised(run)
    status = run_to_finish(run, timeout=600)
    run.wait_learners(timeout=60)  # a drained learner hears of the finish in a heartbeat
    run.stop_all(timeout=30)

    assert "the budget is near: stop targets" in (run.logs / "syncer.log").read_text()
    slow_steps = status.islands[SLOW].inner_steps
    assert slow_steps is not None and slow_steps < H, slow_steps
    merges = [
        MergeRecord.model_validate_json(line)
        for line in (run.workdir / "syncer" / "merges.jsonl").read_text().splitlines()
    ]
    processed = 0
    for island in (FAST, SLOW):
        log = (run.logs / f"{island}-rank0.log").read_text()
        assert "this island's part of the job is done" in log, island
        steps = int(re.findall(r"the job has finished: exiting after (\d+) steps", log)[-1])
        processed += steps * step_tokens
        for f in (0, 1):  # every step it took is in both fragments' merges
            merged = [c.steps for m in merges if m.fragment == f for c in m.contributors
                      if c.island == island]  # fmt: skip
            assert sum(merged) == steps, (island, f, merged)
    # whole steps within the budget, short of it by less than a step of each island
    assert status.tokens == processed <= budget, (status.tokens, processed)
    assert processed > budget - 2 * step_tokens, processed
