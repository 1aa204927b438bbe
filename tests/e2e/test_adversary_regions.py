"""Regions and the direction check against a live `diloco syncer` (issue 46), with each region's
and island's own credential over real sockets.

- Records: a remote region's credential ('eu') took both records the other regions share and
  locked another region ('ap') out; neither an admin drop nor its own leave freed them. Now the
  other regions' records are split fairly (admission.room_for): 'ap' gets one back at once,
  the admin's drop and a left record go to whoever asks, and 'eu' cannot take more back than an
  equal split.
- islands.regions: with each region's count in the spec, a region of 1 cannot take a second
  record while a region of 2 can, its credential holds 2 push slots per record, and an admin
  drop frees a record for its own region only.
- Push slots: a region's credential held all push slots but two (8 of 10) and the local islands'
  pushes got 503. Now it holds 2 x the island records it has, never the local islands' slots.
- Direction: an island that knows an honest island's direction pushes against it (accepted:
  -0.47 against the others' sum) and every push of the honest island was refused (-0.60 against
  the sum of the other two). Now a refusal needs a majority of the others each against it; a
  sign flip of both honest islands is still refused.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pytest
import torch
from diloco_trainer.api import credentials, protocol

from .conftest import SyncerHandle, deep_merge, wait_until
from .test_adversary import ADVERSARY, HONEST, SPEC, WARMUP, join_all, push_as, start_syncer
from .test_adversary_limits import read_head, start_push

pytestmark = pytest.mark.e2e

# Two local islands of a job of four: the other regions share R = 2 records; 'auto' push slots
# 2 x 4 + 2 = 10, of which the local islands keep 2 x 2.
REGIONS_SPEC = deep_merge(
    SPEC,
    {
        "islands": {"count": 2, "totalShards": 4},
        "syncer": {"limits": {"headerTimeoutSeconds": 30, "bodyTimeoutSeconds": 60}},
    },
)
PUSH_SLOTS = 10


@pytest.fixture
def regions(tmp_path: Path) -> Iterator[SyncerHandle]:
    handle = start_syncer(tmp_path, REGIONS_SPEC, "adversary-regions")
    try:
        yield handle
    finally:
        handle.proc.stop(timeout=10)


def join(handle: SyncerHandle, island: str, token: str) -> int:
    code, doc = handle.request(
        "POST", protocol.ROUTE_JOIN, json_body={"island": island, "replicas": 1}, token=token
    )
    assert code in (200, 503), (island, code, doc)
    if code == 503:
        assert doc["code"] == protocol.ERROR_NOT_ADMITTED, doc
    return int(code)


def remote_records(handle: SyncerHandle) -> list[str]:
    return sorted(n for n in handle.status()["islands"] if not n.startswith("island-"))


def test_adversary_region_cannot_keep_other_regions_records(regions: SyncerHandle) -> None:
    eu = credentials.region_token(regions.token, "eu")
    ap = credentials.region_token(regions.token, "ap")
    admin = credentials.admin_token(regions.token)
    assert [join(regions, f"eu-island-{i}", eu) for i in range(2)] == [200, 200]
    # ap asks: eu holds 2 >= 0 + 2, so it gives one back (its longer silent one).
    assert join(regions, "ap-island-0", ap) == 200
    assert remote_records(regions) == ["ap-island-0", "eu-island-1"]
    # An equal split now: neither region may take the other's.
    assert join(regions, "ap-island-1", ap) == 503
    assert join(regions, "eu-island-0", eu) == 503
    # The local islands keep their own records whatever the regions do.
    assert join(regions, "island-0", "") == 200 and join(regions, "island-1", "") == 200
    # The admin's drop frees eu's record for ap's second island...
    code, doc = regions.request(
        "PUT",
        "/v1/islands/eu-island-1",
        json_body={"state": "dropped", "reason": "squat"},
        token=admin,
    )
    assert code == 200, doc
    assert join(regions, "ap-island-1", ap) == 200
    assert remote_records(regions) == ["ap-island-0", "ap-island-1"]
    # ...and a record whose island left is anyone's: eu takes ap-island-1's, and ap cannot take
    # it back (1 and 1).
    ap_1 = credentials.island_token(regions.token, "ap-island-1")
    code, doc = regions.request(
        "POST", protocol.ROUTE_LEAVE, json_body={"island": "ap-island-1"}, token=ap_1
    )
    assert code == 200, doc
    assert join(regions, "eu-island-1", eu) == 200
    assert remote_records(regions) == ["ap-island-0", "eu-island-1"]
    assert join(regions, "ap-island-1", ap) == 503


def test_adversary_region_holds_only_its_islands_push_slots(regions: SyncerHandle) -> None:
    eu = credentials.region_token(regions.token, "eu")
    assert [join(regions, f"eu-island-{i}", eu) for i in range(2)] == [200, 200]
    shapes = join_all(regions, HONEST)
    held: list[socket.socket | BinaryIO] = []
    share = 2 * 2  # 2 x eu's 2 records (within 10 - 2 x 2 local islands)
    try:
        for i in range(PUSH_SLOTS):
            sock, reader = start_push(regions, eu)
            held += [reader, sock]  # the reader holds the socket open too
            if i < share:
                sock.sendall(b"\0")  # one byte of the body, then nothing: its slot stays taken
            else:  # refused before its body is read: the region holds its most (it held 8)
                answer = read_head(reader)
                assert answer.startswith(b"HTTP/1.1 503") and b"Retry-After" in answer, (i, answer)
        # Every local push goes through beside it: each island's two slots are free.
        version = regions.status()["versions"][0]
        value = {n: torch.full_like(t, 1e-3) for n, t in shapes.items()}
        codes = [push_as(regions, island, value)[0] for _ in range(4) for island in HONEST]
        assert codes == [200] * 8
        wait_until(lambda: regions.status()["versions"][0] > version, timeout=60, what="merge")
    finally:
        for sock in held:  # sockets and their readers
            sock.close()


def directions(shapes: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two honest islands' fixed directions: independent Gaussians of about 1e-3 per element
    (cosine about 0 over the sampled positions)."""
    g = torch.Generator().manual_seed(46)

    def one() -> dict[str, torch.Tensor]:
        return {n: 1e-3 * torch.randn(t.shape, generator=g) for n, t in shapes.items()}

    return one(), one()


def combine(a: dict[str, torch.Tensor], x: float, b: dict[str, torch.Tensor], y: float) -> Any:
    return {n: x * a[n] + y * b[n] for n in a}


def test_adversary_cannot_turn_the_direction_check_against_an_honest_island(
    tmp_path: Path,
) -> None:
    handle = start_syncer(tmp_path, SPEC, "adversary-direction")
    try:
        shapes = join_all(handle)
        d0, d1 = directions(shapes)
        for _ in range(WARMUP):
            assert [push_as(handle, i, d)[0] for i, d in zip(HONEST, (d0, d1), strict=True)] == [
                200,
                200,
            ]
        # The adversary knows island-0's direction and pushes against it, leaning towards
        # island-1's enough to stay above -0.5 against the others' sum: -0.7/(1.044 x 1.414)
        # = -0.474. Accepted: it is the adversary's vote now.
        code, doc = push_as(handle, ADVERSARY, combine(d0, -1.0, d1, 0.3))
        assert code == 200, doc
        # island-0 against island-1's (0) and the adversary's (-0.958) votes: -0.60 against their
        # sum, below -0.5 (it was refused, push after push), but one of two is no majority.
        codes = [push_as(handle, HONEST[0], d0) for _ in range(8)]
        assert [c for c, _ in codes] == [200] * 8, codes[0]
        # A sign flip of both honest islands is still refused: -0.707 against each, -1 in all.
        flip = [push_as(handle, ADVERSARY, combine(d0, -1.0, d1, -1.0)) for _ in range(3)]
        assert [c for c, _ in flip] == [422] * 3, flip[0]
        assert all(d["code"] == protocol.ERROR_NORM_OUTLIER for _, d in flip)
        assert "points against" in flip[0][1]["error"]
        doc = handle.status()
        assert {i: doc["islands"][i]["state"] for i in HONEST} == dict.fromkeys(
            HONEST, protocol.STATE_ACTIVE
        )
        assert set(doc["refusals"]) == {ADVERSARY}
    finally:
        handle.proc.stop(timeout=10)


# islands.regions: two local islands of a job of five, the other regions' R = 3 records are
# eu's 2 and ap's 1 by the spec; 'auto' push slots 2 x 5 + 2 = 12.
QUOTA_SPEC = deep_merge(
    REGIONS_SPEC,
    {
        "islands": {
            "totalShards": 5,
            "regions": [{"namePrefix": "eu", "count": 2}, {"namePrefix": "ap", "count": 1}],
        }
    },
)


@pytest.fixture
def quotas(tmp_path: Path) -> Iterator[SyncerHandle]:
    handle = start_syncer(tmp_path, QUOTA_SPEC, "adversary-region-quotas")
    try:
        yield handle
    finally:
        handle.proc.stop(timeout=10)


def test_adversary_region_keeps_to_its_islands_regions_count(quotas: SyncerHandle) -> None:
    eu = credentials.region_token(quotas.token, "eu")
    ap = credentials.region_token(quotas.token, "ap")
    xx = credentials.region_token(quotas.token, "xx")
    admin = credentials.admin_token(quotas.token)
    # ap (count 1) cannot take a second record although one is free; eu (count 2) can.
    assert join(quotas, "ap-island-0", ap) == 200
    assert join(quotas, "ap-island-1", ap) == 503
    assert [join(quotas, f"eu-island-{i}", eu) for i in range(3)] == [200, 200, 503]
    assert join(quotas, "xx-island-0", xx) == 503  # a region islands.regions does not list
    assert remote_records(quotas) == ["ap-island-0", "eu-island-0", "eu-island-1"]
    # ap's credential holds 2 push slots for its 1 record (it would get 12 - 2 x 2 = 8 with
    # all of R): the third is refused before its body is read.
    held: list[socket.socket | BinaryIO] = []
    try:
        for i in range(3):
            sock, reader = start_push(quotas, ap)
            held += [reader, sock]
            if i < 2:
                sock.sendall(b"\0")  # its slot stays taken
            else:
                answer = read_head(reader)
                assert answer.startswith(b"HTTP/1.1 503"), answer
    finally:
        for sock in held:
            sock.close()
    # The admin's drop frees ap's record for ap, never for eu (at its count).
    code, doc = quotas.request(
        "PUT",
        "/v1/islands/ap-island-0",
        json_body={"state": "dropped", "reason": "squat"},
        token=admin,
    )
    assert code == 200, doc
    assert join(quotas, "eu-island-2", eu) == 503
    assert join(quotas, "ap-island-1", ap) == 200
    assert remote_records(quotas) == ["ap-island-1", "eu-island-0", "eu-island-1"]
