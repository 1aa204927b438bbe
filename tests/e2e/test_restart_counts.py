"""What a SIGKILLed and restarted syncer counts of an island's refused pushes (issues 46/47).

An island's heartbeat count runs ahead of its merged tokens by its refused pushes' tokens, which
its learner does not train again (IslandRecord.refused_tokens: out of its part of the budget,
stopAfter.tokens' targets, and in the bound on its count); the checkpoint keeps them
(SavedCount.refused), read back here. A real `diloco syncer`, killed and started again on its
state, and a learner's real link (learner/syncer_link.SyncerLink) over real sockets:

- a push refused as ahead of the restarted syncer (409 `ahead`: its base a merge the restart
  lost) is pushed again by the learner with every step since its base (learner/syncer_restart.
  resend_version) and merged: it is no refused push (until 2026-11-30 its tokens were counted
  refused, and merged: twice);
- a push refused by the restarted syncer before the learner's heartbeat re-joins keeping its
  count (learner/join_marks.join_unknown) is of that count: the re-join keeps it refused
  (until 2026-11-30 the re-join reset it to 0, as an ordinary join's new count does).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator

import pytest
import torch
from diloco_trainer.api import protocol
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.core.compress import encode_tensors
from diloco_trainer.learner import syncer_client
from diloco_trainer.learner.syncer_link import SyncerLink, SyncResult
from diloco_trainer.learner.syncer_restart import resend_version
from diloco_trainer.syncer.storage import checkpoint as ckpt

from .conftest import SyncerHandle
from .test_join_after_checkpoint import LATE, first_merge, late_spec, wait_for_checkpoint
from .test_syncer_restart import delta_for

pytestmark = pytest.mark.e2e

TOKENS_A_STEP = 64  # TINY_SPEC: batch 2 x seqLen 32


async def global_fragment(handle: SyncerHandle) -> dict[str, torch.Tensor]:
    async with handle.client() as client:
        pulled = await client.pull_fragment(0, after=-1)
        assert pulled is not None
        return pulled.tensors


def push(
    link: SyncerLink, tensors: dict[str, torch.Tensor], base: int, steps: int, seed: int
) -> SyncResult:
    """The link's push of `steps` steps on version `base`, and the merge it waits for."""
    meta = protocol.PushMeta(link.island, base, TOKENS_A_STEP * steps, steps, 4.0, 0.01, "none")
    body = encode_tensors(delta_for(tensors, seed=seed), "none")
    return link.submit(link.sync_fragment(0, body, meta)).result(timeout=120)


def restarted(
    syncer_proc: Callable[..., SyncerHandle], first: SyncerHandle, spec: JobSpec
) -> SyncerHandle:
    first.proc.kill()
    first.proc.wait(timeout=60)
    return syncer_proc(spec, state_dir=first.state_dir, port=first.port, token=first.token)


@contextlib.contextmanager
def late_island(
    syncer_proc: Callable[..., SyncerHandle], spec: JobSpec
) -> Iterator[tuple[SyncerHandle, SyncerLink, SyncerLink, dict[str, torch.Tensor]]]:
    """Both re-join tests' start: island-0's learner link joined; the late island's round of 8
    steps (512 tokens) merged as version 1 and checkpointed; the late island's learner link, not
    joined yet. Yields (the syncer, island-0's link, the late link, the global fragment) and
    closes both links."""
    first = syncer_proc(spec)
    early = SyncerLink(
        syncer_client.SyncerClient(first.url, first.token), island="island-0", replicas=1
    )
    link: SyncerLink | None = None
    try:
        early.submit(early.join(threading.Event())).result(timeout=60)
        tensors = asyncio.run(first_merge(first, LATE, steps=8))
        wait_for_checkpoint(first, 1)
        link = SyncerLink(
            syncer_client.SyncerClient(first.url, first.token), island=LATE, replicas=1
        )
        yield first, early, link, tensors
    finally:
        early.close(leave=False)
        if link is not None:
            link.close(leave=False)


def test_a_push_refused_as_ahead_and_pushed_again_is_counted_once(
    syncer_proc: Callable[..., SyncerHandle], make_spec: Callable[..., JobSpec]
) -> None:
    """island-0's pushes of 4 steps (256 tokens) on versions 0, 1 and 2 merge; the checkpoint
    of outer step 2 is the newest when the syncer is killed (one every 2), so the restarted
    syncer is at version 2, behind the learner's base 3. Its push of 8 steps (512 tokens) on 3
    is refused as ahead; it pushes them again on version 2 with the 4 steps trained since
    (12 steps, 768 tokens): merged (version 3), then a push on 3 (version 4, checkpointed).

    Counts: merged 256 x 2 + 768 + 256 = 1,536 (the first run's third merge, 256, is lost with
    it); refused 0. main: refused 512, the refused push's tokens that merged in the push made
    again (its part of the budget 512 below its merged work: its stop target 512 too far)."""
    spec = make_spec(
        sync={"fragments": 1, "quorum": 1, "graceSeconds": 0.1, "compression": "none"},
        stopAfter={"outerSteps": 1000},
        syncer={"checkpoint": {"everyOuterSteps": 2, "keep": 2}, "qualityGuard": {"patience": 0}},
    )
    first = syncer_proc(spec)
    tensors = asyncio.run(global_fragment(first))
    link = SyncerLink(
        syncer_client.SyncerClient(first.url, first.token), island="island-0", replicas=1
    )
    try:
        assert link.submit(link.join(threading.Event())).result(timeout=60).versions == [0]
        for base in (0, 1):
            merged = push(link, tensors, base, 4, seed=base)
            assert merged.outcome == "merged" and merged.pulled.version == base + 1
        wait_for_checkpoint(first, 2)
        merged = push(link, tensors, 2, 4, seed=2)
        assert merged.outcome == "merged" and merged.pulled.version == 3
        second = restarted(syncer_proc, first, spec)
        assert second.status()["versions"] == [2]
        refused = push(link, tensors, 3, 8, seed=3)
        assert refused.restarted and refused.outcome.startswith("push refused"), refused.outcome
        assert refused.pulled.version == 2
        again = resend_version(refused, 3)  # the learner's rule 2: on the syncer's version
        assert again == 2
        merged = push(link, tensors, again, 12, seed=4)
        assert merged.outcome == "merged" and merged.pulled.version == 3
        merged = push(link, tensors, 3, 4, seed=5)
        assert merged.outcome == "merged" and merged.pulled.version == 4
        counts = ckpt.load_checkpoint(wait_for_checkpoint(second, 4)).document.counts
        assert second.status()["islands"]["island-0"]["mergedTokens"] == 1_536
        assert counts["island-0"].refused == 0.0  # main: 512.0
        assert counts["island-0"].base == 0.0
    finally:
        link.close(leave=False)


def test_a_push_refused_before_the_join_that_keeps_the_count_stays_refused(
    syncer_proc: Callable[..., SyncerHandle], make_spec: Callable[..., JobSpec]
) -> None:
    """test_join_after_checkpoint's re-join: the late island's 512 tokens merged (version 1,
    checkpointed), its learner restarted and joined again (base 512), the syncer killed; the
    restarted syncer holds the older join's record (base 0). Before the learner's heartbeat,
    its push claiming 1,000 steps (64 tokens) is refused (422: over its step cap), which its
    learner does not train again: 64 refused, of the count it keeps. Its heartbeat joins again
    keeping that count (base 512) and its next push merges (version 2, checkpointed):
    base 512, refused 64. main: refused 0, so its count ran 64 ahead of its part for good."""
    spec = late_spec(make_spec)
    with late_island(syncer_proc, spec) as (first, _early, link, tensors):
        assert link.submit(link.join(threading.Event())).result(timeout=60).island_tokens == 512
        second = restarted(syncer_proc, first, spec)
        assert second.status()["islands"][LATE]["joins"] == 1  # the older join's record
        meta = protocol.PushMeta(LATE, 1, TOKENS_A_STEP, 1_000, 4.0, 0.01, "none")
        body = encode_tensors(delta_for(tensors, seed=3), "none")
        refused = link.submit(link.sync_fragment(0, body, meta)).result(timeout=120)
        assert refused.outcome.startswith("push refused") and not refused.restarted
        assert "422" in refused.outcome, refused.outcome
        link.progress.update(step=9, tokens=576, loss=4.0, step_time=0.01)
        state = link.submit(link._heartbeat(0, dict(link.progress), None)).result(timeout=60)
        assert state == protocol.STATE_ACTIVE
        assert second.status()["islands"][LATE]["joins"] == 2  # joined again, keeping its count
        merged = push(link, tensors, 1, 8, seed=4)
        assert merged.outcome == "merged" and merged.pulled.version == 2
        counts = ckpt.load_checkpoint(wait_for_checkpoint(second, 2)).document.counts
        assert counts[LATE].base == 512.0
        assert counts[LATE].refused == 64.0  # main: 0.0


def test_a_join_lost_with_two_quick_restarts_is_made_again(
    syncer_proc: Callable[..., SyncerHandle], make_spec: Callable[..., JobSpec]
) -> None:
    """The re-join above (base 512, at version 1, the record's second join), then two restarts:
    the second run resumes from the checkpoint of version 1 (the first join's record, base 0),
    merges island-0's round (version 2) and checkpoints it before the late learner hears from
    it, and is killed; the third resumes at version 2, past the join's versions. The learner's
    heartbeat, answered with the record's 1 join against its join's 2, joins again keeping its
    count: base 512 in the third run's next checkpoint. main: base 0 (its versions [1] below the
    resumed [2], it never joined again), so its part of the budget read 512 below its merged
    work (merged 1,024, of which 512 after the join: part 0 + 512, not 512 + 512)."""
    spec = late_spec(make_spec)
    with late_island(syncer_proc, spec) as (first, early, link, tensors):
        joined = link.submit(link.join(threading.Event())).result(timeout=60)
        assert (joined.island_tokens, joined.versions, joined.joins) == (512, [1], 2)
        second = restarted(syncer_proc, first, spec)
        merged = push(early, tensors, 1, 8, seed=3)  # island-0's round: version 2
        assert merged.outcome == "merged" and merged.pulled.version == 2
        wait_for_checkpoint(second, 2)
        third = restarted(syncer_proc, second, spec)
        assert third.status()["versions"] == [2]
        assert third.status()["islands"][LATE]["joins"] == 1  # the first join's record
        link.progress.update(step=9, tokens=576, loss=4.0, step_time=0.01)
        state = link.submit(link._heartbeat(0, dict(link.progress), None)).result(timeout=60)
        assert state == protocol.STATE_ACTIVE
        assert third.status()["islands"][LATE]["joins"] == 2  # main: 1
        merged = push(link, tensors, 2, 8, seed=4)
        assert merged.outcome == "merged" and merged.pulled.version == 3
        counts = ckpt.load_checkpoint(wait_for_checkpoint(third, 3)).document.counts
        assert third.status()["islands"][LATE]["mergedTokens"] == 1_024
        assert counts[LATE].base == 512.0  # main: 0.0
