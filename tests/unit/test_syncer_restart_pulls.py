"""A restarted syncer says at once that it lost a push (docs/algorithm.md, "A syncer restart"):
each run of the syncer has its own name, given in every push answer; a pull for the merge of a
push that another run accepted is refused 409 `restarted` when this run resumed at or before it
(pending pushes are not checkpointed), whatever it merged since, and the learner's link turns
that into PushLost with the fragment's version."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from diloco_trainer.api import protocol
from diloco_trainer.api.protocol import SyncerError
from diloco_trainer.learner.syncer_link import PushLost
from diloco_trainer.syncer.edge.http import MAX_RUN_CHARS
from diloco_trainer.syncer.errors import Refused
from diloco_trainer.syncer.state import lost_with_restart

from .test_syncer import FakeClock, body, delta, make_spec, run, started
from .test_syncer_pull import pull_spec, served_link


@pytest.mark.parametrize(
    ("accepted_by", "after", "resumed", "lost"),
    [
        ("old", 3, 2, True),  # resumed from before the round the push was in
        ("old", 3, 3, True),  # resumed at that round's start: the pending push is gone
        ("old", 3, 4, False),  # resumed after its merge: the merge carries it
        ("new", 3, 3, False),  # this run took it: it is pending here
        ("", 3, 2, False),  # a learner that names no run: waits as before
    ],
)
def test_lost_with_restart(accepted_by: str, after: int, resumed: int, lost: bool) -> None:
    assert lost_with_restart(accepted_by, "new", after=after, resumed=resumed) is lost


def test_a_restarted_syncer_refuses_the_pull_for_a_push_it_lost(tmp_path: Path) -> None:
    spec = pull_spec(compression="none")

    async def first() -> tuple[str, int]:
        syncer = await started(spec, tmp_path, FakeClock())
        await syncer.islands.join("island-0", 1)
        await syncer.receive_push(0, body(syncer, 0, "island-0", delta(syncer, 0, 1)))
        await syncer.tick()  # merged: version 1, checkpointed (everyOuterSteps 1)
        answer = await syncer.receive_push(0, body(syncer, 0, "island-0", delta(syncer, 0, 2)))
        # pending in the round that makes version 2 (quorum 1: merged at the next tick)
        assert (await syncer.status())["run"] == answer["run"] != ""
        await syncer.stop()  # the process dies before that merge
        return answer["run"], answer["version"]

    async def second(old_run: str, after: int) -> tuple[str, Refused, bool]:
        syncer = await started(spec, tmp_path, FakeClock())
        assert syncer.state.versions == [1] and syncer.run != old_run
        with pytest.raises(Refused) as refused:
            await syncer.pull(0, after=after, wait=0, run=old_run)
        mine = await syncer.pull(0, after=after, wait=0, run=syncer.run)
        await syncer.stop()
        return syncer.run, refused.value, mine is None

    old_run, after = run(first())
    assert after == 1
    new_run, refused, waits = run(second(old_run, after))
    assert (refused.status, refused.code) == (409, protocol.ERROR_RESTARTED)
    assert new_run in str(refused) and old_run in str(refused)
    assert waits  # its own run's push would be pending: the long-poll just waits (304 at once)


def test_a_restarted_syncer_refuses_it_after_other_merges_passed_the_push(
    tmp_path: Path,
) -> None:
    """adv17: K = 1 (quorum 1). island-0's push is pending in the round that makes version 2
    when the syncer stops; the restarted run resumes at version 1, and island-1's push merges
    (version 2) before island-0's pull for the merge after 1 comes. Version 2 is not island-0's
    merge: the pull is refused 409 `restarted` (its learner pushes it again). Main: version 2
    was served as its merge, and its steps were lost without a word."""
    spec = make_spec(
        islands={"count": 2},
        sync={"quorum": 1, "graceSeconds": 0, "compression": "none"},
        syncer={"checkpoint": {"everyOuterSteps": 1, "keep": 2}},
    )

    async def first() -> tuple[str, int]:
        syncer = await started(spec, tmp_path, FakeClock())
        for name in ("island-0", "island-1"):
            await syncer.islands.join(name, 1)
        await syncer.receive_push(0, body(syncer, 0, "island-0", delta(syncer, 0, 1)))
        await syncer.tick()  # merged: version 1
        answer = await syncer.receive_push(0, body(syncer, 0, "island-0", delta(syncer, 0, 2)))
        await syncer.stop()  # checkpointed at version 1; the pending push is not kept
        return answer["run"], answer["version"]

    async def second(old_run: str, after: int) -> tuple[list[int], Refused]:
        syncer = await started(spec, tmp_path, FakeClock())
        try:
            await syncer.receive_push(0, body(syncer, 0, "island-1", delta(syncer, 0, 3)))
            await syncer.tick()
            versions = list(syncer.state.versions)
            with pytest.raises(Refused) as refused:
                await syncer.pull(0, after=after, wait=0, run=old_run)
            return versions, refused.value
        finally:
            await syncer.stop()

    old_run, after = run(first())
    assert after == 1
    versions, refused = run(second(old_run, after))
    assert versions == [2]
    assert (refused.status, refused.code) == (409, protocol.ERROR_RESTARTED)
    assert "resumed at version 1, now at 2" in str(refused)


def test_the_link_ends_a_sync_whose_push_a_restart_lost(tmp_path: Path) -> None:
    """Over HTTP: the link's pull for the merge of a push another run took ends at once in
    PushLost carrying the fragment's version, instead of long-polling for it."""

    async def scenario() -> PushLost:
        async with served_link(tmp_path) as (syncer, link):
            future = link.submit(link._pull_newer(0, 0, None, "a-run-before-the-restart"))
            with pytest.raises(PushLost) as lost:
                await asyncio.wait_for(asyncio.wrap_future(future), timeout=10)
            assert syncer.state.versions == [0]
            return lost.value

    lost = run(scenario())
    assert lost.version == 0


def test_a_pull_naming_an_overlong_run_is_refused_400(tmp_path: Path) -> None:
    async def scenario() -> tuple[SyncerError, list[int]]:
        async with served_link(tmp_path) as (syncer, link):
            client = link.clients[0]
            with pytest.raises(SyncerError) as refused:
                await client.pull_fragment(0, after=0, wait=0, run="r" * (MAX_RUN_CHARS + 1))
            return refused.value, syncer.state.versions

    refused, versions = run(scenario())
    assert refused.status == 400 and "run" in refused.message
    assert versions == [0]
