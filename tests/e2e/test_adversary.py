"""One island against the rest, on a live `diloco syncer` with the island's own credential
(issue 22, finding 1): after warm-up it pushes 70 near-zero pseudo-gradients to a fragment, each
accepted. The learned norm bound came from one window shared by all islands, so its median fell
to ~1e-10, every honest push was refused as norm_outlier and five in a row dropped the honest
islands. Now each island's norms are its own and the bound is the median over islands (with a
floor of one AdamW round): the honest islands' pushes all merge and they stay active."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from diloco_trainer.api import credentials, protocol
from diloco_trainer.core.payloads import PulledFragment

from .conftest import TINY_SPEC, SyncerHandle, deep_merge
from .test_hostile import push_body, start

pytestmark = pytest.mark.e2e

HONEST = ("island-0", "island-1")
ADVERSARY = "island-2"
WARMUP = 4
SPEC = deep_merge(
    TINY_SPEC,
    {
        "islands": {"count": 3},
        "sync": {
            "fragments": 1,
            "quorum": 1,
            "graceSeconds": 0.1,
            "heartbeatTimeoutSeconds": 3600,
            "compression": "none",
        },
        "stopAfter": {"outerSteps": 100000},
        "syncer": {
            "checkpoint": {"everyOuterSteps": 100000},
            "evalEveryOuterSteps": 100000,
            "guards": {"warmupPushes": WARMUP, "normFactor": 10, "maxRefusals": 5},
        },
    },
)


@pytest.fixture
def syncer(tmp_path: Path) -> Iterator[SyncerHandle]:
    handle = start(tmp_path, SPEC, "adversary")
    try:
        yield handle
    finally:
        handle.proc.stop(timeout=10)


async def _shapes(handle: SyncerHandle) -> dict[str, torch.Tensor]:
    async with handle.client() as client:
        for island in (*HONEST, ADVERSARY):
            await client.join(island, 1)
        pulled = await client.pull_fragment(0, after=-1)
        assert isinstance(pulled, PulledFragment)  # after=-1: the full weights
        return pulled.tensors


def push_as(handle: SyncerHandle, island: str, tensors: dict[str, torch.Tensor]) -> int:
    """One push of `island` with its own credential (steps 1: the work rate is not tested
    here); returns the status."""
    token = credentials.island_token(handle.token, island)
    base = handle.status()["versions"][0]
    body = push_body(tensors, island=island, baseVersion=base, steps=1, tokens=64)
    code, doc = handle.request("POST", "/v1/fragments/0/push", body=body, token=token)
    assert code in (200, 422), (code, doc)
    return int(code)


def test_adversary_near_zero_flood_cannot_get_honest_islands_refused(
    syncer: SyncerHandle,
) -> None:
    shapes = asyncio.run(_shapes(syncer))
    honest = {n: torch.full_like(t, 1e-3) for n, t in shapes.items()}
    tiny = {n: torch.full_like(t, 1e-12) for n, t in shapes.items()}
    for _ in range(WARMUP):
        assert [push_as(syncer, island, honest) for island in HONEST] == [200, 200]
    flood = [push_as(syncer, ADVERSARY, tiny) for _ in range(70)]
    assert flood == [200] * 70  # each is accepted: small is not wrong
    after = [push_as(syncer, island, honest) for _ in range(6) for island in HONEST]
    assert after == [200] * 12
    doc = syncer.status()
    states = {i: doc["islands"][i]["state"] for i in HONEST}
    assert states == dict.fromkeys(HONEST, protocol.STATE_ACTIVE)
    assert doc["refusals"] == {}
