"""A learner's link lets a push's encoded bytes go once the push is answered, not when its merge is
pulled: a round later or more, another P/(4F) bytes per fragment in flight (ARCHITECTURE.md, "A
learner's memory"). A real syncer behind a real HTTP server; its merge never comes (quorum 2,
one island pushes), so the link waits in its long-poll for the whole test."""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from pathlib import Path

from diloco_trainer.api import protocol
from diloco_trainer.core.compress import encode_tensors

from .test_syncer import delta, make_spec, run
from .test_syncer_pull import served_link

# Long enough for a loaded machine's HTTP round trip; the wait ends as soon as the last is freed.
PUSH_ANSWERED_WITHIN = 30.0


def test_a_push_s_encoded_bytes_are_let_go_while_its_merge_is_awaited(tmp_path: Path) -> None:
    spec = make_spec(
        islands={"count": 2},
        sync={"quorum": 2, "graceSeconds": 1000, "compression": "int8"},
    )

    async def scenario() -> tuple[bool, bool, int]:
        async with served_link(tmp_path, spec, ("island-0", "island-1")) as (syncer, link):
            encoded = encode_tensors(delta(syncer, 0, 7), "int8")
            # Each tensor's finalizer counts down; the last one freed (on whichever thread
            # lets it go) wakes this loop, which also serves the syncer.
            loop = asyncio.get_running_loop()
            freed = asyncio.Event()
            left = [len(encoded)]

            def one_freed() -> None:
                left[0] -= 1
                if left[0] == 0:
                    loop.call_soon_threadsafe(freed.set)

            # (A comprehension: a loop variable would keep the last tensor alive here.)
            watched = [weakref.finalize(t, one_freed) for t in encoded.values()]
            meta = protocol.PushMeta(
                island="island-0",
                base_version=syncer.state.versions[0],
                tokens=100,
                steps=4,
                loss=3.0,
                step_time=0.01,
                codec="int8",
            )
            future = link.submit(link.sync_fragment(0, encoded, meta))
            del encoded  # the learner keeps none of it (FragmentSync.push)
            # A timeout is reported below: the link still holds them.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(freed.wait(), PUSH_ANSWERED_WITHIN)
            let_go = freed.is_set()
            pending = not future.done()  # still waiting for the merge: no second island pushed
            folded = syncer.state.versions[0]
            future.cancel()
            assert len(watched) == 2 * len(delta(syncer, 0, 7))  # int8: values and scales
            return let_go, pending, folded

    let_go, pending, version = run(scenario())
    assert pending, "the merge came: nothing to wait for, the test proves nothing"
    assert version == 0
    assert let_go, "the link still holds the push's encoded tensors while it awaits the merge"
