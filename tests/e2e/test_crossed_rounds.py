"""At K = M, two fragments' rounds that wait for each other's islands do not stall the job
(issues 46/47, syncer/state/crossed.py), on a live `diloco syncer` with each island's own
credential.

bench.hetero at 1,1,1,cpu, K = M = 4: the CPU island, let back into fragment 0's rounds after
refusals, pushed fragment 0 before fragment 1 where the fast islands pushed fragment 1 first;
each blocking learner then waited for the merge of the round it had pushed to, and each round
waited for the islands waiting in the other. No merge came until a learner's wait budget ran out
(4 s, 14 s, then 43 s). Here K = M = 3 with two fragments: island-2 pushes fragment 0, island-0
and island-1 fragment 1. Before, neither round ever merged (nobody pushes more here, as nobody
did there while waiting); now fragment 1's round, the one with more pushes, merges without
island-2 (incomplete), and the next pushes, in one order again, merge complete rounds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from diloco_trainer.api import credentials
from diloco_trainer.core.payloads import PulledFragment

from .conftest import SyncerHandle, deep_merge, wait_until
from .test_adversary import HONEST_VALUE, SPEC, filled, start_syncer
from .test_hostile import push_body

pytestmark = pytest.mark.e2e

JOB = "crossed-rounds"
ISLANDS = ("island-0", "island-1", "island-2")
# Seconds fragment 1's round has to merge once crossed (grace 0.1 s plus a step of 0.01 s
# here; on main it never merges).
MERGE_WAIT = 30
CROSSED = deep_merge(SPEC, {"sync": {"quorum": 3, "fragments": 2}})


@pytest.fixture
def syncer(tmp_path: Path) -> Iterator[SyncerHandle]:
    handle = start_syncer(tmp_path, CROSSED, JOB)
    try:
        yield handle
    finally:
        handle.proc.stop(timeout=10)


async def _join_and_pull(handle: SyncerHandle) -> list[dict[str, torch.Tensor]]:
    async with handle.client() as client:
        for island in ISLANDS:
            await client.join(island, 1)
        shapes = []
        for f in range(2):
            pulled = await client.pull_fragment(f, after=-1)
            assert isinstance(pulled, PulledFragment)  # after=-1: the full weights
            shapes.append(pulled.tensors)
        return shapes


def push_to(handle: SyncerHandle, island: str, fragment: int, shapes: list[dict[str, Any]]) -> None:
    """One accepted push of `island` to `fragment`, along the descent, on its current version."""
    token = credentials.island_token(handle.token, island)
    base = handle.status()["versions"][fragment]
    body = push_body(
        filled(shapes[fragment], HONEST_VALUE),
        island=island,
        baseVersion=base,
        steps=1,
        tokens=64,
        stepTime=0.01,
    )
    code, doc = handle.request("POST", f"/v1/fragments/{fragment}/push", body=body, token=token)
    assert code == 200 and doc["accepted"] is True, (island, fragment, code, doc)


def merged(handle: SyncerHandle, versions: list[int]) -> bool:
    return handle.status()["versions"] == versions


def test_k_equals_m_merges_crossed_rounds_instead_of_waiting_for_ever(
    syncer: SyncerHandle,
) -> None:
    shapes = asyncio.run(_join_and_pull(syncer))
    # One order first: every island pushes fragment 0, then fragment 1; both merge complete.
    for f in range(2):
        for island in ISLANDS:
            push_to(syncer, island, f, shapes)
    wait_until(lambda: merged(syncer, [1, 1]), timeout=60, what="the first rounds")
    # Crossed: island-2 pushes fragment 0 first, island-0 and island-1 fragment 1 first.
    push_to(syncer, "island-2", 0, shapes)
    push_to(syncer, "island-0", 1, shapes)
    push_to(syncer, "island-1", 1, shapes)
    wait_until(
        lambda: merged(syncer, [1, 2]),
        timeout=MERGE_WAIT,
        what="fragment 1's crossed round to merge without island-2",
    )
    doc = syncer.status()
    assert doc["pending"] == [1, 0] and doc["quorum"] == 3, doc  # K = M still: nobody left out
    last = syncer.merge_records()[-1]
    assert last["fragment"] == 1 and last["complete"] is False, last
    assert sorted(c["island"] for c in last["contributors"]) == ["island-0", "island-1"]
    # Uncrossed: each island's next push follows the one order again. island-0 and island-1
    # push fragment 0 (its round complete with island-2's pending push), then all three push
    # fragment 1: both merge complete.
    push_to(syncer, "island-0", 0, shapes)
    push_to(syncer, "island-1", 0, shapes)
    wait_until(lambda: merged(syncer, [2, 2]), timeout=60, what="fragment 0's full round")
    for island in ISLANDS:
        push_to(syncer, island, 1, shapes)
    wait_until(lambda: merged(syncer, [2, 3]), timeout=60, what="fragment 1's full round")
    records = syncer.merge_records()
    for record in records[-2:]:
        assert record["complete"] is True, record
        assert sorted(c["island"] for c in record["contributors"]) == list(ISLANDS)
