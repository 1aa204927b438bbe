"""One lock per fragment: while fragment 0 merges (held inside its worker thread, the only way to
act mid-merge on cue), heartbeats, status and pushes to fragment 1 answer; a push to fragment 0
waits for its merge and joins the next round; an island dropped mid-merge leaves the round, not
the merge; mergeSeconds runs until the new version is pullable."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import torch
from diloco_trainer.core import payloads
from diloco_trainer.syncer.service import startup
from diloco_trainer.syncer.service.service import Syncer
from diloco_trainer.syncer.state.records import Beat

from .test_syncer import FakeClock, body, delta, make_spec, run, started

TWO = {"fragments": 2}


async def _round_of_three(syncer: Syncer, f: int) -> None:
    for i in range(3):
        answer = await syncer.receive_push(
            f, body(syncer, f, f"island-{i}", delta(syncer, f, i), tokens=100)
        )
        assert answer["accepted"], answer


def _hold(syncer: Syncer) -> tuple[threading.Event, threading.Event]:
    """Hold the next outer step inside its worker thread until released."""
    entered, release = threading.Event(), threading.Event()
    real_step = syncer.model.outer.step

    def held_step(merged: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> int:
        entered.set()
        release.wait(30)
        syncer.model.outer.step = real_step  # type: ignore[method-assign]
        return real_step(merged, *args, **kwargs)

    syncer.model.outer.step = held_step  # type: ignore[method-assign]
    return entered, release


def test_a_merge_holds_only_its_own_fragment(tmp_path: Path) -> None:
    async def scenario() -> dict[str, Any]:
        syncer = await started(make_spec(sync=TWO), tmp_path, FakeClock())
        for i in range(3):
            await syncer.islands.join(f"island-{i}", 1)
        await _round_of_three(syncer, 0)
        entered, release = _hold(syncer)
        merge = asyncio.create_task(syncer.tick())
        assert await asyncio.to_thread(entered.wait, 30), "the merge never started"
        beat = await asyncio.wait_for(
            syncer.islands.heartbeat("island-0", Beat(4, 100, loss=3.0, step_time=0.1)), 5
        )
        other = await asyncio.wait_for(
            syncer.receive_push(1, body(syncer, 1, "island-0", delta(syncer, 1, 7))), 5
        )
        status = await asyncio.wait_for(syncer.status(), 5)
        # A push to the merging fragment is recorded only after the merge (its answer's version
        # is the merged one; recorded before, the merge's record would refuse a round it grew).
        same = asyncio.create_task(
            syncer.receive_push(0, body(syncer, 0, "island-2", delta(syncer, 0, 9)))
        )
        release.set()
        await merge
        later = await asyncio.wait_for(same, 30)
        after = await syncer.status()
        await syncer.stop()
        return {
            "beat": beat,
            "other": other,
            "status": status,
            "later": later,
            "after": after,
        }

    out = run(scenario())
    assert out["beat"]["state"] == "active"
    assert out["other"]["accepted"] and out["other"]["version"] == 0
    assert out["status"]["versions"] == [0, 0] and out["status"]["pending"] == [3, 1]
    # The push that waited is the first of fragment 0's next round, on the merged version 1.
    assert out["later"]["accepted"] and out["later"]["version"] == 1
    assert out["later"]["pending"] == 1
    assert out["after"]["versions"] == [1, 0] and out["after"]["pending"] == [1, 1]


def test_an_island_dropped_mid_merge_leaves_the_round_not_the_merge(tmp_path: Path) -> None:
    async def scenario() -> dict[str, Any]:
        syncer = await started(make_spec(sync=TWO), tmp_path, FakeClock())
        for i in range(3):
            await syncer.islands.join(f"island-{i}", 1)
        await _round_of_three(syncer, 0)
        entered, release = _hold(syncer)
        merge = asyncio.create_task(syncer.tick())
        assert await asyncio.to_thread(entered.wait, 30), "the merge never started"
        await syncer.islands.set_membership("island-2", "dropped", "test")
        release.set()
        await merge
        doc = await syncer.status()
        await syncer.stop()
        return doc

    doc = run(scenario())
    assert doc["health"]["healthy"], doc["health"]
    assert doc["versions"] == [1, 0] and doc["pending"] == [0, 0]
    # Each island's tokens count once per fragment merged, averaged over the two fragments.
    assert doc["islands"]["island-2"]["mergedTokens"] == 50
    assert doc["merges"][-1]["contributors"][2]["island"] == "island-2"


def test_merge_seconds_run_until_the_new_version_is_pullable(tmp_path: Path) -> None:
    async def scenario() -> tuple[float, float, bytes | bytearray | memoryview | None, int]:
        syncer = await started(make_spec(sync=TWO), tmp_path, FakeClock())
        for i in range(3):
            await syncer.islands.join(f"island-{i}", 1)
        await _round_of_three(syncer, 0)
        # Hold the new pull body's encoding: the time it is held belongs to mergeSeconds.
        entered, release = threading.Event(), threading.Event()
        real_encode = syncer.publisher.encode

        def held_encode(f: int, key: Any, merge_seconds: float | None = None) -> Any:
            entered.set()
            release.wait(30)
            return real_encode(f, key, merge_seconds)

        syncer.publisher.encode = held_encode  # type: ignore[method-assign]
        merge = asyncio.create_task(syncer.tick())
        assert await asyncio.to_thread(entered.wait, 30), "the body was never encoded"
        held_from = time.perf_counter()
        await asyncio.to_thread(threading.Event().wait, 0.3)  # time passing, not a cue
        held = time.perf_counter() - held_from
        release.set()
        await merge
        seconds = syncer.merge_log.recent[-1].merge_seconds
        pulled = await syncer.pull(0, after=0, wait=0)
        await syncer.stop()
        return held, seconds, pulled, syncer.state.versions[0]

    held, seconds, pulled, version = run(scenario())
    assert version == 1
    assert seconds >= held
    assert pulled is not None, "the merged version was not pullable when the merge returned"
    assert payloads.decode_body(pulled)[1]["version"] == "1"


def test_pending_pushes_wait_on_disk_and_leave_with_their_round(tmp_path: Path) -> None:
    """Each folded push's encoded tensors are a file under the state dir while its round is
    open (memory flat in the number of islands), gone once the round merged; a restart empties
    what a previous process left."""

    async def scenario() -> tuple[int, int]:
        syncer = await started(make_spec(sync=TWO), tmp_path, FakeClock())
        for i in range(3):
            await syncer.islands.join(f"island-{i}", 1)
        await _round_of_three(syncer, 0)
        waiting = len(list((tmp_path / startup.PENDING_DIR).iterdir()))
        await syncer.tick()
        await syncer.stop()
        return waiting, len(list((tmp_path / startup.PENDING_DIR).iterdir()))

    assert run(scenario()) == (3, 0)
    (tmp_path / startup.PENDING_DIR / "left-over.safetensors").write_bytes(b"x")
    Syncer(make_spec(sync=TWO), job_name="unit", state_dir=tmp_path, clock=FakeClock())
    assert not (tmp_path / startup.PENDING_DIR).exists()


def test_the_scheduler_ends_at_a_stop_even_without_its_cancel(tmp_path: Path) -> None:
    """A stop marks the syncer stopping before it cancels the scheduler, so a scheduler whose
    cancel was lost (Python 3.11's wait_for could swallow one: two benchmark syncers never
    exited) still ends at its next pass. Here the stop is given no scheduler to cancel."""

    async def scenario() -> bool:
        syncer = await started(make_spec(sync=TWO), tmp_path, FakeClock())
        scheduler = asyncio.create_task(syncer.run_scheduler())
        await asyncio.sleep(0)  # the scheduler runs its first pass
        await syncer.stop()
        await asyncio.wait_for(scheduler, 30)
        return scheduler.done() and not scheduler.cancelled()

    assert run(scenario())


def test_a_fragments_momentum_is_made_by_its_first_push_not_its_first_merge(
    tmp_path: Path,
) -> None:
    # The outer momentum of a fragment (1/F x of zeroed pages) is made as its first push is
    # folded, so the first merge's path to pullable does not allocate it; the other fragment
    # has none until a push of its own.
    async def scenario() -> tuple[set[str], set[str], set[str]]:
        syncer = await started(make_spec(sync=TWO), tmp_path, FakeClock())
        for i in range(3):
            await syncer.islands.join(f"island-{i}", 1)
        before = set(syncer.model.outer.state_tensors())
        answer = await syncer.receive_push(
            0, body(syncer, 0, "island-0", delta(syncer, 0, 1), tokens=100)
        )
        assert answer["accepted"], answer
        after_push = set(syncer.model.outer.state_tensors())
        await syncer.stop()
        return before, after_push, set(syncer.model.fragments[0])

    before, after_push, fragment0 = run(scenario())
    assert before == set()
    assert after_push == fragment0
