"""syncer/service/jobs.py's evaluations of snapshots: on a second module that shares the live
parameters (no copy of P), the snapshot's tensors in its slots only while it evaluates."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
from diloco_trainer.api.spec import parse_spec
from diloco_trainer.syncer.service.service import Syncer

SPEC = {
    "model": {"preset": "gpt-tiny"},
    "data": {"evalTokens": 1024},
    "islands": {"count": 2},
    "inner": {"steps": 4, "batchSize": 8, "seqLen": 16},
    "sync": {"quorum": 2, "fragments": 1},
}


async def started(state_dir: Path) -> Syncer:
    syncer = Syncer(parse_spec(SPEC), job_name="unit", state_dir=state_dir, clock=lambda: 1000.0)
    await syncer.start()
    return syncer


def test_a_snapshot_is_evaluated_without_a_copy_of_the_model(tmp_path: Path) -> None:
    syncer = asyncio.run(started(tmp_path))
    evaluations = syncer.jobs.evaluations
    live = dict(syncer.model.weights)
    # The second module holds the live parameters themselves: no second copy of P.
    second = dict(evaluations._eval_model.named_parameters())
    assert second.keys() == live.keys() and all(second[n] is live[n] for n in live)
    snapshot = syncer.model.snapshot()
    before = evaluations.evaluate_live()
    assert evaluations.evaluate_snapshot(snapshot) == before
    with torch.no_grad():  # the live weights move on (a merge); the snapshot stays
        for t in live.values():
            t.mul_(0.5)
    moved = evaluations.evaluate_live()
    assert moved != before
    assert evaluations.evaluate_snapshot(snapshot) == before
    # After each evaluation the slots hold the live parameters again, not the snapshot.
    assert all(p is live[n] for n, p in evaluations._eval_model.named_parameters())
    assert evaluations.evaluate_snapshot(dict(live)) == moved
