"""syncer/publisher.py: a publish encodes and wakes one fragment at a time, the fragments with a
new version first (a merged fragment is pullable before the others are re-encoded for their
changed outer step)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from diloco_trainer.api.spec import parse_spec
from diloco_trainer.syncer.publisher import BodyKey
from diloco_trainer.syncer.service import Syncer

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
