"""A learner's link lets a push's encoded bytes go once the push is answered, not when its merge is
pulled: a round later or more, another P/(4F) bytes per fragment in flight (ARCHITECTURE.md, "A
learner's memory"). A real syncer behind a real HTTP server; its merge never comes (quorum 2,
one island pushes), so the link waits in its long-poll for the whole test."""

from __future__ import annotations

import asyncio
import weakref
from pathlib import Path

from aiohttp.test_utils import TestServer
from diloco_trainer.api import protocol
from diloco_trainer.core.compress import encode_tensors
from diloco_trainer.learner import syncer_client
from diloco_trainer.learner.syncer_link import SyncerLink
from diloco_trainer.syncer.edge.http import build_app
from diloco_trainer.syncer.service.service import Syncer

from .test_syncer import FakeClock, delta, make_spec, run

# Long enough for a loaded machine's HTTP round trip; the loop below ends as soon as it can.
PUSH_ANSWERED_WITHIN = 30.0


def test_a_push_s_encoded_bytes_are_let_go_while_its_merge_is_awaited(tmp_path: Path) -> None:
    spec = make_spec(
        islands={"count": 2},
        sync={"quorum": 2, "graceSeconds": 1000, "compression": "int8"},
    )

    async def scenario() -> tuple[bool, bool, int]:
        syncer = Syncer(spec, job_name="unit", state_dir=tmp_path, clock=FakeClock())
        server = TestServer(build_app(syncer, "tok"), host="127.0.0.1")
        await server.start_server()
        url = str(server.make_url("")).rstrip("/")
        link = SyncerLink(syncer_client.SyncerClient(url, "tok"), island="island-0", replicas=1)
        try:
            await syncer.islands.join("island-0", 1)
            await syncer.islands.join("island-1", 1)
            encoded = encode_tensors(delta(syncer, 0, 7), "int8")
            held = [weakref.ref(t) for t in encoded.values()]
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
            loop = asyncio.get_running_loop()
            deadline = loop.time() + PUSH_ANSWERED_WITHIN
            # Polled on this loop, which also serves the syncer (wait_until would block it).
            while any(r() is not None for r in held) and loop.time() < deadline:
                await asyncio.sleep(0.02)
            let_go = all(r() is None for r in held)
            pending = not future.done()  # still waiting for the merge: no second island pushed
            folded = syncer.state.versions[0]
            future.cancel()
            return let_go, pending, folded
        finally:
            await asyncio.to_thread(link.close, leave=False)
            await server.close()

    let_go, pending, version = run(scenario())
    assert pending, "the merge came: nothing to wait for, the test proves nothing"
    assert version == 0
    assert let_go, "the link still holds the push's encoded tensors while it awaits the merge"
