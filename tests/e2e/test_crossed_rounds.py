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

At K < M (drain48) the same holds where the islands a round lacks are held at the step cap: a
round with one push under a quorum of 2, each island's learner holding until its own push
merges, merges without the held island instead of waiting out the start-up timeout.
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
# K = 2 of 3 with τ = 1 (inner.steps 4: learners that do not block), island-2 never up: it
# holds the quorum at 2 for its start-up timeout (600 s, longer than the test's waits).
HELD = deep_merge(
    SPEC,
    {
        "islands": {"startupTimeoutSeconds": 600},
        "sync": {"quorum": 2, "fragments": 2, "overlapSteps": 1},
    },
)


@pytest.fixture
def syncer(tmp_path: Path) -> Iterator[SyncerHandle]:
    handle = start_syncer(tmp_path, CROSSED, JOB)
    try:
        yield handle
    finally:
        handle.proc.stop(timeout=10)


@pytest.fixture
def held_syncer(tmp_path: Path) -> Iterator[SyncerHandle]:
    handle = start_syncer(tmp_path, HELD, JOB)
    try:
        yield handle
    finally:
        handle.proc.stop(timeout=10)


async def _join_and_pull(
    handle: SyncerHandle, islands: tuple[str, ...] = ISLANDS
) -> list[dict[str, torch.Tensor]]:
    async with handle.client() as client:
        for island in islands:
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


def beat(handle: SyncerHandle, island: str, *, holding: bool) -> None:
    """A heartbeat of `island` saying whether its learner holds at the step cap."""
    token = credentials.island_token(handle.token, island)
    doc = {"island": island, "step": 40, "tokens": 2560, "stepTime": 0.01, "holding": holding}
    code, answer = handle.request("POST", "/v1/heartbeat", json_body=doc, token=token)
    assert code == 200, (island, code, answer)


def test_k_below_m_merges_crossed_rounds_of_islands_held_at_the_step_cap(
    held_syncer: SyncerHandle,
) -> None:
    """CI's tests/e2e/test_drain.py [3-2] (drain48): K = 2 of 3, island-2 never up. island-0's
    push of fragment 0 and island-1's of fragment 1 each alone in their round, both learners
    held at the step cap (they push nothing more until their push merges). On main neither
    round merged before island-2's 600 s start-up timeout; now fragment 0's (one push each: the
    lowest) merges without island-1 within the grace window plus a round of island-1 (0.1 +
    (4 + 1) x 0.01 s), and island-0, let go, pushes fragment 1: that round then has its quorum."""
    syncer = held_syncer
    shapes = asyncio.run(_join_and_pull(syncer, ISLANDS[:2]))
    assert syncer.status()["quorum"] == 2  # island-2 awaited: min(2, 2 joined + 1)
    for f in range(2):  # one order first: both push each fragment, each round merges at 2
        for island in ISLANDS[:2]:
            push_to(syncer, island, f, shapes)
    wait_until(lambda: merged(syncer, [1, 1]), timeout=60, what="the first rounds")
    push_to(syncer, "island-0", 0, shapes)
    push_to(syncer, "island-1", 1, shapes)
    beat(syncer, "island-0", holding=True)
    beat(syncer, "island-1", holding=True)
    wait_until(
        lambda: merged(syncer, [2, 1]),
        timeout=MERGE_WAIT,
        what="fragment 0's crossed round to merge without island-1",
    )
    doc = syncer.status()
    assert doc["pending"] == [0, 1] and doc["quorum"] == 2, doc
    last = syncer.merge_records()[-1]
    assert last["fragment"] == 0 and last["complete"] is False, last
    assert [c["island"] for c in last["contributors"]] == ["island-0"]
    log = syncer.log_file.read_text()
    assert "fragment 0's round merges without ['island-1']: crossed" in log
    # island-0 took the merge and steps on: it pushes fragment 1, whose round has its quorum.
    beat(syncer, "island-0", holding=False)
    push_to(syncer, "island-0", 1, shapes)
    wait_until(lambda: merged(syncer, [2, 2]), timeout=60, what="fragment 1's round at quorum")
    last = syncer.merge_records()[-1]
    assert sorted(c["island"] for c in last["contributors"]) == ["island-0", "island-1"]
