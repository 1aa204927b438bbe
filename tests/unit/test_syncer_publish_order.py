"""syncer/serving/publisher.py: a publish encodes and wakes one fragment at a time, the fragments
with a new version first (a merged fragment is pullable before the others are re-encoded for their
changed outer step); the bodies a publish replaces are let go off the loop."""

from __future__ import annotations

import asyncio
import threading
import weakref
from pathlib import Path

import torch
from diloco_trainer.api.spec import parse_spec
from diloco_trainer.core import payloads
from diloco_trainer.syncer.service.service import Syncer
from diloco_trainer.syncer.serving.publisher import BodyKey

SPEC = {
    "model": {"preset": "gpt-tiny"},
    "data": {"evalTokens": 1024},
    "islands": {"count": 2},
    "inner": {"steps": 4, "batchSize": 8, "seqLen": 16},
    "sync": {"quorum": 2, "fragments": 3},
}


def test_new_versions_are_published_first_and_each_wakes_its_pullers(tmp_path: Path) -> None:
    async def scenario() -> tuple[list[int], list[list[bool]]]:
        syncer = Syncer(parse_spec(SPEC), job_name="unit", state_dir=tmp_path, clock=lambda: 1.0)
        await syncer.start()
        publisher = syncer.publisher
        events = list(publisher._events)
        order: list[int] = []
        woken: list[list[bool]] = []
        encode = publisher.encode

        def recording(f: int, key: BodyKey) -> tuple[BodyKey, bytes]:
            order.append(f)
            woken.append([e.is_set() for e in events])  # who was woken before this encode
            return encode(f, key)

        publisher.encode = recording  # type: ignore[method-assign]
        # Fragment 2 merged (version 1) and closed the outer step: 0 and 1 change outer step only.
        await publisher.publish([(0, 1, False), (0, 1, False), (1, 1, False)])
        woken.append([e.is_set() for e in events])
        return order, woken

    order, woken = asyncio.run(scenario())
    assert order == [2, 0, 1]
    # Fragment 2's pullers were woken before fragment 0 was encoded, 0's before 1's.
    assert woken == [
        [False, False, False],
        [False, False, True],
        [True, False, True],
        [True, True, True],
    ]


def test_a_replaced_body_is_let_go_in_a_worker_thread_not_on_the_loop(tmp_path: Path) -> None:
    # Freeing a P/F-sized body blocks the thread that frees it (munmap): on the loop it held up
    # the long-polls its own publish had woken. install lets it go in a worker thread, and a
    # one-update chain is served without a thread hop.
    async def scenario() -> tuple[int, list[int]]:
        syncer = Syncer(parse_spec(SPEC), job_name="unit", state_dir=tmp_path, clock=lambda: 1.0)
        await syncer.start()
        publisher = syncer.publisher
        freed: list[int] = []
        data = torch.ones(1024).numpy()  # a body's part is a view of such an array
        weakref.finalize(data, lambda: freed.append(threading.get_ident()))
        key = publisher.body_key(0)
        publisher._bodies[0] = (key, payloads.SplitBody(b"", (data.data,)))
        del data  # the replaced body holds the last reference
        assert freed == []
        publisher.install(0, publisher.encode(0, (key[0] + 1, key[1], key[2])))
        await publisher.housekeeping_done()
        await syncer.stop()
        return threading.get_ident(), freed

    loop_thread, freed = asyncio.run(scenario())
    assert len(freed) == 1
    assert freed[0] != loop_thread
