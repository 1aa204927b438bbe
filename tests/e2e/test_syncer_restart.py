"""A syncer killed with SIGKILL comes back from its checkpoint with the same versions, weights and
outer momentum, and a client call made while it was down completes once it is back. A syncer
restarted for a changed syncer-side field (SIGTERM, then the new spec) loses no merge although no
periodic checkpoint was due."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

import pytest
import torch
from diloco_trainer.api import protocol
from diloco_trainer.api.documents import PushAnswer
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.core.compress import encode_tensors
from diloco_trainer.learner import syncer_client
from diloco_trainer.syncer.storage import checkpoint as ckpt

from .conftest import SyncerHandle, wait_until

pytestmark = pytest.mark.e2e

ROUNDS = 3


def restart_spec(make_spec: Callable[..., JobSpec]) -> JobSpec:
    return make_spec(
        # run_rounds pushes fp32 pseudo-gradients ("none"), whatever the default codec is.
        sync={"fragments": 2, "quorum": 1, "graceSeconds": 0.1, "compression": "none"},
        stopAfter={"outerSteps": 1000},
        # The quality guard off: its best checkpoint would stay beside these (random pushes
        # need not improve the loss); test_adversary_quality.py is its test.
        syncer={"checkpoint": {"everyOuterSteps": 1, "keep": 2}, "qualityGuard": {"patience": 0}},
    )


def delta_for(tensors: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: 1e-2 * torch.randn(t.shape, generator=g) for n, t in sorted(tensors.items())}


async def run_rounds(handle: SyncerHandle, rounds: int) -> dict[int, dict[str, torch.Tensor]]:
    """island-0 pushes a seeded pseudo-gradient per fragment per round and waits for each merge;
    returns the last pulled tensors per fragment."""
    last: dict[int, dict[str, torch.Tensor]] = {}
    async with handle.client() as client:
        info = await client.join("island-0", 1)
        for r in range(rounds):
            for f in range(len(info.fragments)):
                pulled = await client.pull_fragment(f, after=-1)
                assert pulled is not None
                meta = protocol.PushMeta("island-0", pulled.version, 256, 4, 5.0 - r, 0.01, "none")
                delta = delta_for(pulled.tensors, seed=100 * r + f)
                answer = await client.push_pseudo_gradient(f, encode_tensors(delta, "none"), meta)
                assert answer.accepted, answer
                merged = await client.pull_fragment(f, after=pulled.version, wait=60)
                assert merged is not None and merged.version == pulled.version + 1
                last[f] = merged.tensors
    return last


def test_syncer_restart_resumes_versions_weights_and_momentum(
    syncer_proc: Callable[..., SyncerHandle], make_spec: Callable[..., JobSpec]
) -> None:
    spec = restart_spec(make_spec)
    first = syncer_proc(spec)
    asyncio.run(run_rounds(first, ROUNDS))
    # Evaluations run in the background after each outer step: wait for the last one.
    wait_until(
        lambda: len(first.status()["evalHistory"]) == ROUNDS + 1,
        timeout=120,
        what="the evaluation of the last outer step",
    )
    before = first.status(digest=True)
    assert before["versions"] == [ROUNDS, ROUNDS] and before["outerStep"] == ROUNDS
    assert len(before["evalHistory"]) == ROUNDS + 1
    # keep=2: the two newest checkpoints, the last one at the current outer step (checkpoints
    # are written in the background, after the merged fragments are published).
    wait_until(
        lambda: (
            [p.name for p in ckpt.list_checkpoints(first.state_dir)]
            == [ckpt.checkpoint_name(ROUNDS - 1), ckpt.checkpoint_name(ROUNDS)]
        ),
        timeout=120,
        what="the checkpoints of the last two outer steps",
    )
    merge_log = [json.loads(x) for x in (first.state_dir / "merges.jsonl").read_text().splitlines()]
    assert [(m["fragment"], m["version"]) for m in merge_log] == [
        (f, v) for v in range(1, ROUNDS + 1) for f in (0, 1)
    ]
    assert all(m["contributors"][0]["weight"] == 1.0 for m in merge_log)

    first.proc.kill()
    first.proc.wait(timeout=60)
    second = syncer_proc(spec, state_dir=first.state_dir, token=first.token)
    after = second.status(digest=True)

    assert after["digest"] == before["digest"]  # weights and outer momentum, bit for bit
    assert after["versions"] == before["versions"]
    assert after["outerStep"] == before["outerStep"]
    assert after["tokens"] == before["tokens"]
    assert after["evalHistory"] == before["evalHistory"]
    assert after["initialEvalLoss"] == before["initialEvalLoss"]
    assert after["islands"]["island-0"]["joins"] == 1
    assert after["resumedFrom"].endswith(ckpt.checkpoint_name(ROUNDS))


def test_syncer_restart_client_call_made_while_down_completes(
    syncer_proc: Callable[..., SyncerHandle],
    make_spec: Callable[..., JobSpec],
    caplog: pytest.LogCaptureFixture,
) -> None:
    spec = restart_spec(make_spec)
    first = syncer_proc(spec)
    tensors = asyncio.run(run_rounds(first, 1))
    # Merged fragments are published before the checkpoint is written: wait for it on disk.
    wait_until(
        lambda: (
            ckpt.list_checkpoints(first.state_dir)[-1:]
            == [first.state_dir / "checkpoints" / ckpt.checkpoint_name(1)]
        ),
        timeout=120,
        what="the checkpoint of outer step 1",
    )
    first.proc.kill()
    first.proc.wait(timeout=60)
    caplog.set_level(logging.WARNING, logger="diloco.wire")

    async def push_while_down() -> tuple[PushAnswer, bool, SyncerHandle]:
        async with syncer_client.SyncerClient(first.url, first.token, retry_deadline=90) as client:
            meta = protocol.PushMeta("island-0", 1, 256, 4, 4.0, 0.01, "none")
            body = encode_tensors(delta_for(tensors[0], seed=7), "none")
            pending = asyncio.create_task(client.push_pseudo_gradient(0, body, meta))
            await asyncio.to_thread(
                wait_until,
                lambda: any("syncer unreachable" in r.getMessage() for r in caplog.records),
                timeout=60,
                what="the client to report that it retries",
            )
            waited = not pending.done()
            second = await asyncio.to_thread(
                syncer_proc, spec, state_dir=first.state_dir, port=first.port, token=first.token
            )
            return await asyncio.wait_for(pending, 60), waited, second

    answer, waited, second = asyncio.run(push_while_down())
    assert waited, "the push finished although no syncer was running"
    assert answer.accepted is True and answer.version == 1
    wait_until(
        lambda: second.status()["versions"] == [2, 1],
        timeout=120,
        what="the retried push to be merged by the restarted syncer",
    )


def test_syncer_restart_for_a_syncer_side_field_change_loses_no_merge(
    syncer_proc: Callable[..., SyncerHandle], make_spec: Callable[..., JobSpec]
) -> None:
    """What a running job's syncer goes through when a syncer-side field changes: the operator
    puts the new spec's hash on the syncer Deployment's pod template (Recreate), so the old pod
    gets SIGTERM and a new one starts with the new spec on the same state volume (the cluster
    half: tests/cluster/test_operator_membership.py::
    test_operator_restarts_the_syncer_for_a_syncer_side_field_only). No periodic checkpoint is
    due here (everyOuterSteps 1000): only the one written at SIGTERM keeps the merges."""

    def spec(grace: float) -> JobSpec:
        return make_spec(
            sync={"fragments": 2, "quorum": 1, "graceSeconds": grace, "compression": "none"},
            stopAfter={"outerSteps": 1000},
            # The guard off: its first best is checkpointed at once (no checkpoint before the
            # stop is this test's premise).
            syncer={"checkpoint": {"everyOuterSteps": 1000}, "qualityGuard": {"patience": 0}},
        )

    first = syncer_proc(spec(0.1))
    asyncio.run(run_rounds(first, ROUNDS))
    before = first.status(digest=True)
    assert before["versions"] == [ROUNDS, ROUNDS] and before["grace"] == 0.1
    assert ckpt.list_checkpoints(first.state_dir) == []  # nothing on disk yet

    first.proc.terminate()  # what the Deployment's rollout does to the old pod
    assert first.proc.wait(timeout=120) == 0
    assert "written at stop" in first.log_text()
    second = syncer_proc(spec(0.25), state_dir=first.state_dir, token=first.token)
    after = second.status(digest=True)

    assert after["grace"] == 0.25  # the new spec is in force ...
    assert "the job spec changed since checkpoint" in second.log_text()
    # ... and every merge is kept: weights and momentum bit for bit, versions, rounds, tokens.
    assert after["digest"] == before["digest"]
    assert after["versions"] == before["versions"]
    assert after["outerStep"] == before["outerStep"] == ROUNDS
    assert after["tokens"] == before["tokens"]
    assert after["resumedFrom"].endswith(ckpt.checkpoint_name(ROUNDS))
    asyncio.run(run_rounds(second, 1))  # and the job goes on from there
    assert second.status()["versions"] == [ROUNDS + 1, ROUNDS + 1]
