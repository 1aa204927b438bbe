"""A learner's join after the syncer's last checkpoint, across a syncer restart (issues 46/47).

A syncer writes checkpoints after merges only, so an island that joined since the last one is
unknown to the restarted syncer (its record is not in the checkpoint). What a learner's link
(learner/syncer_link.SyncerLink, the real one, over real sockets to a real `diloco syncer`
killed with SIGKILL and started again on its state) does then: its next heartbeat is answered
404 and it joins again; the island's frame is the one it joined in (island tokens 0 both times:
nothing of it was merged in the checkpoint), and its next push is merged. A push that comes
before that heartbeat is answered 404 too: the link joins again and hands back the syncer's
fragment, `restarted`, whose push's steps the learner counts as work a restart took back and
trains again before it drains (syncer_restart.AfterRestart.count_merged; tests/unit/
test_learner_syncer_restart.py::test_a_push_refused_by_a_syncer_not_behind_its_base_is_received_
then_pushed_again). So a new island's join is no work to lose: its learner makes it again.

A *re-join* since the checkpoint of an island the checkpoint knows (a learner restarted
mid-job) comes back as the older join's record (its count base), answered 200. Its learner's
next heartbeat, answered by another run whose record counts fewer joins than its join left
(1 against 2), joins again keeping its count (learner/join_marks.join_unknown): the base is
then the island's merged tokens in the checkpoint, where its count starts. A learner whose join
the checkpoint holds does not (docs/algorithm.md, "A count's frame is kept across a syncer
restart"; two quick restarts: test_restart_counts.py).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from diloco_trainer.api import protocol
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.core.compress import encode_tensors
from diloco_trainer.learner import syncer_client
from diloco_trainer.learner.syncer_link import SyncerLink
from diloco_trainer.syncer.storage import checkpoint as ckpt

from .conftest import SyncerHandle, wait_until
from .test_syncer_restart import delta_for

pytestmark = pytest.mark.e2e

LATE = "island-1"


def late_spec(make_spec: Callable[..., JobSpec]) -> JobSpec:
    return make_spec(
        islands={"count": 2},
        sync={"fragments": 1, "quorum": 1, "graceSeconds": 0.1, "compression": "none"},
        stopAfter={"outerSteps": 1000},
        syncer={"checkpoint": {"everyOuterSteps": 1, "keep": 2}, "qualityGuard": {"patience": 0}},
    )


async def first_merge(
    handle: SyncerHandle, island: str = "island-0", steps: int = 4
) -> dict[str, torch.Tensor]:
    """`island` joins, pushes one pseudo-gradient of `steps` steps (64 tokens each) and waits
    for its merge (version 1)."""
    async with handle.client() as client:
        await client.join(island, 1)
        pulled = await client.pull_fragment(0, after=-1)
        assert pulled is not None
        meta = protocol.PushMeta(island, 0, 64 * steps, steps, 5.0, 0.01, "none")
        answer = await client.push_pseudo_gradient(
            0, encode_tensors(delta_for(pulled.tensors, seed=1), "none"), meta
        )
        assert answer.accepted, answer
        merged = await client.pull_fragment(0, after=0, wait=60)
        assert merged is not None and merged.version == 1
        return pulled.tensors


def wait_for_checkpoint(handle: SyncerHandle, outer_step: int) -> Path:
    """The checkpoint of `outer_step`, once it is the newest on the syncer's disk."""
    path = handle.state_dir / "checkpoints" / ckpt.checkpoint_name(outer_step)
    wait_until(
        lambda: ckpt.list_checkpoints(handle.state_dir)[-1:] == [path],
        timeout=120,
        what=f"the checkpoint of outer step {outer_step}",
    )
    return path


def checkpointed(
    syncer_proc: Callable[..., SyncerHandle], spec: JobSpec, pusher: str = "island-0"
) -> tuple[SyncerHandle, dict[str, torch.Tensor], SyncerLink]:
    """A syncer past its first merge (of `pusher`'s push) and that merge's checkpoint (outer
    step 1), the global weights, and the late island's learner link to it (not joined yet)."""
    first = syncer_proc(spec)
    tensors = asyncio.run(first_merge(first, pusher))
    wait_for_checkpoint(first, 1)
    link = SyncerLink(syncer_client.SyncerClient(first.url, first.token), island=LATE, replicas=1)
    return first, tensors, link


def test_a_learner_that_joined_after_the_last_checkpoint_joins_again_and_is_merged(
    syncer_proc: Callable[..., SyncerHandle], make_spec: Callable[..., JobSpec]
) -> None:
    spec = late_spec(make_spec)
    first, tensors, link = checkpointed(syncer_proc, spec)
    try:
        joined = link.submit(link.join(threading.Event())).result(timeout=60)
        assert joined.island_tokens == 0 and joined.versions == [1]
        assert first.status()["islands"][LATE]["joins"] == 1
        first.proc.kill()
        first.proc.wait(timeout=60)
        second = syncer_proc(spec, state_dir=first.state_dir, port=first.port, token=first.token)
        doc = second.status()
        assert doc["resumedFrom"].endswith(ckpt.checkpoint_name(1))
        assert LATE not in doc["islands"]  # the join came after the checkpoint: lost with it
        # The learner's heartbeat: 404 from the restarted syncer, which the link answers by
        # joining again (its _heartbeat, as the heartbeat loop calls it).
        link.progress.update(step=8, tokens=512, loss=4.0, step_time=0.01)
        state = link.submit(link._heartbeat(0, dict(link.progress), None)).result(timeout=60)
        assert state is None  # the 404's: no state answered, the join made instead
        island = second.status()["islands"][LATE]
        assert island["state"] == protocol.STATE_ACTIVE and island["joins"] == 1
        assert island["mergedTokens"] == 0  # its frame as at its first join: nothing merged
        # Its next push is merged by the restarted syncer (K = 1: at once, after the grace).
        meta = protocol.PushMeta(LATE, 1, 512, 8, 4.0, 0.01, "none")
        body = encode_tensors(delta_for(tensors, seed=2), "none")
        result = link.submit(link.sync_fragment(0, body, meta)).result(timeout=120)
        assert result.outcome == "merged" and not result.restarted, result.outcome
        assert result.pulled.version == 2
        last = second.merge_records()[-1]
        assert [c["island"] for c in last["contributors"]] == [LATE]
        assert last["tokens"] == 512
    finally:
        link.close(leave=False)


def test_a_push_before_the_heartbeat_joins_again_and_is_counted_as_taken_back(
    syncer_proc: Callable[..., SyncerHandle], make_spec: Callable[..., JobSpec]
) -> None:
    """The same restart, the late island's push first: answered 404, the link joins again and
    hands back the syncer's fragment (version 1) marked `restarted`, which the learner counts
    as a push a restart took back (its steps trained again before the drain); the push after it
    is merged."""
    spec = late_spec(make_spec)
    first, tensors, link = checkpointed(syncer_proc, spec)
    try:
        link.submit(link.join(threading.Event())).result(timeout=60)
        first.proc.kill()
        first.proc.wait(timeout=60)
        second = syncer_proc(spec, state_dir=first.state_dir, port=first.port, token=first.token)
        assert LATE not in second.status()["islands"]
        meta = protocol.PushMeta(LATE, 1, 512, 8, 4.0, 0.01, "none")
        body = encode_tensors(delta_for(tensors, seed=2), "none")
        refused = link.submit(link.sync_fragment(0, body, meta)).result(timeout=120)
        assert refused.outcome == "rejoined the syncer" and refused.restarted
        assert refused.pulled.version == 1
        assert second.status()["islands"][LATE]["joins"] == 1
        again = link.submit(link.sync_fragment(0, body, meta)).result(timeout=120)
        assert again.outcome == "merged" and again.pulled.version == 2
    finally:
        link.close(leave=False)


def test_a_learner_that_rejoined_after_the_last_checkpoint_joins_again_keeping_its_count(
    syncer_proc: Callable[..., SyncerHandle], make_spec: Callable[..., JobSpec]
) -> None:
    """The late island's first join and push (512 tokens, 8 steps: with island-0 joined, the
    two islands' round of work; merged: version 1) are in the checkpoint of outer step 1 (its
    count base 0); its learner then restarts and joins again (base 512, the island's merged
    tokens: it counts from 0 there), and the syncer is killed.
    The restarted syncer holds the older join's record (joins 1, base 0); the learner's
    heartbeat, answered by the new run that resumed at version 1, where its join was, joins
    again keeping its count: base 512, which the next checkpoint keeps. island-0's learner,
    which joined at version 0, before the merge the checkpoint holds, does not join again."""
    spec = late_spec(make_spec)
    first = syncer_proc(spec)
    early = SyncerLink(
        syncer_client.SyncerClient(first.url, first.token), island="island-0", replicas=1
    )
    link: SyncerLink | None = None
    try:
        assert early.submit(early.join(threading.Event())).result(timeout=60).versions == [0]
        tensors = asyncio.run(first_merge(first, LATE, steps=8))
        wait_for_checkpoint(first, 1)
        link = SyncerLink(
            syncer_client.SyncerClient(first.url, first.token), island=LATE, replicas=1
        )
        joined = link.submit(link.join(threading.Event())).result(timeout=60)
        assert joined.island_tokens == 512 and joined.versions == [1]
        assert first.status()["islands"][LATE]["joins"] == 2
        first.proc.kill()
        first.proc.wait(timeout=60)
        second = syncer_proc(spec, state_dir=first.state_dir, port=first.port, token=first.token)
        doc = second.status()
        assert doc["resumedFrom"].endswith(ckpt.checkpoint_name(1))
        assert doc["islands"][LATE]["joins"] == 1  # the checkpoint's record: the first join's
        assert doc["islands"]["island-0"]["joins"] == 1
        for each in (early, link):
            each.progress.update(step=8, tokens=512, loss=4.0, step_time=0.01)
            state = each.submit(each._heartbeat(0, dict(each.progress), None)).result(timeout=60)
            assert state == protocol.STATE_ACTIVE  # answered 200 by the new run
        islands = second.status()["islands"]
        assert islands[LATE]["joins"] == 2  # joined again, keeping its count
        assert islands["island-0"]["joins"] == 1  # the checkpoint holds its join
        # The next merge's checkpoint keeps the frames: the late island's base is the 512 it
        # had merged in the checkpoint (the older join's 0 before), island-0's stays 0.
        meta = protocol.PushMeta(LATE, 1, 512, 8, 4.0, 0.01, "none")
        body = encode_tensors(delta_for(tensors, seed=2), "none")
        result = link.submit(link.sync_fragment(0, body, meta)).result(timeout=120)
        assert result.outcome == "merged" and result.pulled.version == 2
        counts = ckpt.load_checkpoint(wait_for_checkpoint(second, 2)).document.counts
        assert counts[LATE].base == 512.0
        assert counts["island-0"].base == 0.0
    finally:
        early.close(leave=False)
        if link is not None:
            link.close(leave=False)
