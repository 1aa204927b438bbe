"""One island against the rest, on a live `diloco syncer` with each island's own credential
(issue 22). The adversary pushes well-formed pseudo-gradients that play the learned norm bound
over time; the honest islands' pushes keep merging and they stay active.

- Near-zero flood (finding 1): after warm-up, 70 pushes of norm ~1e-10. The bound came from one
  window shared by all islands, so its median fell to ~1e-10, every honest push was refused as
  norm_outlier and five in a row dropped the honest islands.
- Ratchet (finding 2): pushes in a fixed direction at X, 5X, 25X ... up to the hard cap, each
  level long enough to fill the shared window, so each was within normFactor of the median it had
  raised itself: every push was accepted and the model was poisoned.

Now each island's norms are its own and the bound is the median over islands of their medians
(with a floor of one AdamW round): neither can move it. The helpers here (start, push_as,
honest_round) serve the other test_adversary_*.py modules too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from diloco_trainer.api import credentials, protocol
from diloco_trainer.core.payloads import PulledFragment

from .conftest import TINY_SPEC, SyncerHandle, deep_merge, wait_until
from .test_hostile import push_body, start

pytestmark = pytest.mark.e2e

HONEST = ("island-0", "island-1")
ADVERSARY = "island-2"
WARMUP = 4
NORM_FACTOR = 10
# An honest push moves every element by this much (TINY_SPEC: lr 1e-3, H = 4: about one
# round of AdamW at |m/sqrt(v)| ~ 1/4).
HONEST_VALUE = 1e-3
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
            "guards": {"warmupPushes": WARMUP, "normFactor": NORM_FACTOR, "maxRefusals": 5},
        },
    },
)


def start_syncer(
    tmp_path: Path, spec: dict[str, Any], name: str, extra_env: dict[str, str] | None = None
) -> SyncerHandle:
    """A live syncer of `spec` (stopped by the caller)."""
    return start(tmp_path, spec, name, extra_env)


@pytest.fixture
def syncer(tmp_path: Path) -> Iterator[SyncerHandle]:
    handle = start_syncer(tmp_path, SPEC, "adversary")
    try:
        yield handle
    finally:
        handle.proc.stop(timeout=10)


async def _join_and_pull(handle: SyncerHandle, islands: Sequence[str]) -> dict[str, torch.Tensor]:
    async with handle.client() as client:
        for island in islands:
            await client.join(island, 1)
        pulled = await client.pull_fragment(0, after=-1)
        assert isinstance(pulled, PulledFragment)  # after=-1: the full weights
        return pulled.tensors


def join_all(handle: SyncerHandle, islands: Sequence[str] = (*HONEST, ADVERSARY)) -> dict[str, Any]:
    """Join `islands` (admin token) and return fragment 0's tensors (the shapes of a Δ)."""
    return asyncio.run(_join_and_pull(handle, islands))


def filled(shapes: dict[str, torch.Tensor], value: float) -> dict[str, torch.Tensor]:
    """A pseudo-gradient of `value` in every element."""
    return {n: torch.full_like(t, value) for n, t in shapes.items()}


def push_as(
    handle: SyncerHandle,
    island: str,
    tensors: dict[str, torch.Tensor],
    *,
    steps: int = 1,
    tokens: int = 64,
    step_time: float = 0.01,
) -> tuple[int, Any]:
    """One push of `island` to fragment 0 with its own credential, on the current version;
    returns (status, answer)."""
    token = credentials.island_token(handle.token, island)
    base = handle.status()["versions"][0]
    body = push_body(
        tensors, island=island, baseVersion=base, steps=steps, tokens=tokens, stepTime=step_time
    )
    return handle.request("POST", "/v1/fragments/0/push", body=body, token=token)


def code_of(handle: SyncerHandle, island: str, tensors: dict[str, torch.Tensor]) -> int:
    """The status of one push (steps 1: the work rate is not what is tested)."""
    code, doc = push_as(handle, island, tensors)
    assert code in (200, 403, 422), (code, doc)  # 403: the island was dropped
    return int(code)


def honest_round(handle: SyncerHandle, shapes: dict[str, torch.Tensor], **meta: Any) -> None:
    """Each honest island pushes once, each push is accepted and fragment 0 merges."""
    version = handle.status()["versions"][0]
    for island in HONEST:
        code, doc = push_as(handle, island, filled(shapes, HONEST_VALUE), **meta)
        assert code == 200 and doc["accepted"] is True, (island, code, doc)
    wait_until(lambda: handle.status()["versions"][0] > version, timeout=60, what="honest merge")


def honest_active(handle: SyncerHandle) -> dict[str, str]:
    doc = handle.status()
    return {i: doc["islands"][i]["state"] for i in HONEST}


def test_adversary_near_zero_flood_cannot_get_honest_islands_refused(
    syncer: SyncerHandle,
) -> None:
    shapes = join_all(syncer)
    honest = filled(shapes, HONEST_VALUE)
    for _ in range(WARMUP):
        assert [code_of(syncer, island, honest) for island in HONEST] == [200, 200]
    flood = [code_of(syncer, ADVERSARY, filled(shapes, 1e-12)) for _ in range(70)]
    assert flood == [200] * 70  # each is accepted: small is not wrong
    after = [code_of(syncer, island, honest) for _ in range(6) for island in HONEST]
    assert after == [200] * 12
    assert honest_active(syncer) == dict.fromkeys(HONEST, protocol.STATE_ACTIVE)
    assert syncer.status()["refusals"] == {}


# The ratchet's levels, each PER_LEVEL pushes (more than half of the old shared window of 64
# norms: enough to move its median to the level), then five times as far.
RATCHET = [HONEST_VALUE * 5**k for k in range(7)]  # 1e-3 .. 15.6 per element
PER_LEVEL = 34


def test_adversary_ratchet_cannot_raise_the_bound(syncer: SyncerHandle) -> None:
    shapes = join_all(syncer)
    for _ in range(WARMUP):
        honest_round(syncer, shapes)
    accepted: dict[float, int] = {}
    for value in RATCHET:
        codes = [code_of(syncer, ADVERSARY, filled(shapes, value)) for _ in range(PER_LEVEL)]
        accepted[value] = codes.count(200)
        honest_round(syncer, shapes)  # the honest islands merge at every level
    # The bound is NORM_FACTOR x the honest median (1e-3 per element): 1e-2 per element, and the
    # floor (lr x H = 4e-3 per element) is below it. The adversary's levels 1e-3 and 5e-3 are
    # within it, 2.5e-2 and beyond never are, however long it pushes at the level below.
    bound = NORM_FACTOR * HONEST_VALUE
    assert {v: n for v, n in accepted.items() if v > bound} == {v: 0 for v in RATCHET if v > bound}
    assert accepted[RATCHET[0]] == PER_LEVEL and accepted[RATCHET[1]] == PER_LEVEL
    assert honest_active(syncer) == dict.fromkeys(HONEST, protocol.STATE_ACTIVE)
    doc = syncer.status()
    assert doc["islands"][ADVERSARY]["state"] == protocol.STATE_DROPPED  # its own outliers
    assert set(doc["refusals"]) == {ADVERSARY}


def test_adversary_sign_flip_is_refused_by_direction(syncer: SyncerHandle) -> None:
    """An island pushing the negation of what the others push, at five times their norm (inside
    the learned bound of ten times), would move the model backwards with its merge weight. The
    direction check (cosine with the others' latest pushes below -0.5) refuses it; the refusals
    never count towards dropping it (the others decide them), and the honest islands merge."""
    shapes = join_all(syncer)
    for _ in range(WARMUP):
        honest_round(syncer, shapes)
    flipped = filled(shapes, -5 * HONEST_VALUE)
    codes = [push_as(syncer, ADVERSARY, flipped) for _ in range(10)]
    assert [c for c, _ in codes] == [422] * 10, codes[0]
    assert all(d["code"] == protocol.ERROR_NORM_OUTLIER for _, d in codes)
    assert "points against" in codes[0][1]["error"]
    honest_round(syncer, shapes)
    doc = syncer.status()
    assert doc["islands"][ADVERSARY]["state"] == protocol.STATE_ACTIVE  # refused, not dropped
    assert honest_active(syncer) == dict.fromkeys(HONEST, protocol.STATE_ACTIVE)
