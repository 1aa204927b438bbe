"""A merge at quorum waits for the pushes on their way (issue 45), on a live `diloco syncer`
over real sockets, each island with its own credential.

At K = 1 of 3 with a grace window of 0.1 s, island-1's push body starts to arrive first and
island-0's right after; both come as over a slow link (a body in two halves, PAUSE apart). Before
the rule island-0's push merged alone 0.1 s after it was in, and island-1's made a version of
its own: every learner's pull then carries two. Now the merge waits for island-1's body, on its
way since before the quorum, until about two uploads from its start (core/grace.
upload_wait_until), and both merge together. A request that is not an island's authenticated,
size-declared push within the limit (no credential, a wrong one, an oversized body) is never
waited for: the same round merges alone after its window.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import torch
from diloco_trainer.api import credentials, protocol

from .conftest import TINY_SPEC, SyncerHandle, deep_merge, wait_until
from .test_adversary import filled, join_all
from .test_hostile import push_body, start

pytestmark = pytest.mark.e2e

GRACE = 0.1
# The pause inside a slow body: the typical upload the wait is sized from (two of them).
PAUSE = 1.5
SPEC = deep_merge(
    TINY_SPEC,
    {
        "islands": {"count": 3},
        "sync": {
            "fragments": 1,
            "quorum": 1,
            "graceSeconds": GRACE,
            "heartbeatTimeoutSeconds": 3600,
            "compression": "none",
        },
        "stopAfter": {"outerSteps": 100000},
        "syncer": {"checkpoint": {"everyOuterSteps": 100000}, "evalEveryOuterSteps": 100000},
    },
)


@pytest.fixture
def syncer(tmp_path: Path) -> Iterator[SyncerHandle]:
    handle = start(tmp_path, SPEC, "uploads")
    try:
        yield handle
    finally:
        handle.proc.stop(timeout=10)


class SlowPush:
    """One push over its own socket, sent as a slow link would: the request's headers and the
    first half of its body now (`begin`), the rest later (`finish`)."""

    def __init__(
        self, handle: SyncerHandle, body: bytes, token: str | None, *, length: int | None = None
    ) -> None:
        url = urlparse(handle.url)
        self.sock = socket.create_connection((url.hostname, url.port), timeout=30)
        self.body = body
        head = [
            "POST /v1/fragments/0/push HTTP/1.1",
            f"Host: {url.hostname}:{url.port}",
            f"Content-Type: {protocol.SAFETENSORS_CONTENT_TYPE}",
            f"Content-Length: {len(body) if length is None else length}",
            "Connection: close",
        ]
        if token is not None:
            head.append(f"Authorization: Bearer {token}")
        self.head = ("\r\n".join(head) + "\r\n\r\n").encode()

    def begin(self) -> None:
        self.sock.sendall(self.head + self.body[: len(self.body) // 2])

    def finish(self) -> int:
        """The rest of the body; the answer's status."""
        # answered and closed already (401, 403, 413): its status is still there to read
        with contextlib.suppress(OSError):
            self.sock.sendall(self.body[len(self.body) // 2 :])
        return self.status()

    def status(self) -> int:
        raw = b""
        while chunk := self.sock.recv(65536):
            raw += chunk
        self.sock.close()
        return int(raw.split(b" ", 2)[1])


def body_of(handle: SyncerHandle, shapes: dict[str, torch.Tensor], island: str) -> bytes:
    base = handle.status()["versions"][0]
    return push_body(filled(shapes, 1e-3), island=island, baseVersion=base, steps=4, tokens=128)


def syncer_time_past(handle: SyncerHandle, moment: float) -> dict[str, Any]:
    """The status once the syncer's own clock is past `moment` (no sleep of ours)."""
    return wait_until(
        lambda: (doc := handle.status())["time"] > moment and doc,
        timeout=30,
        what=f"the syncer's clock past {moment}",
    )


def test_a_merge_waits_for_a_push_on_its_way_and_both_merge_together(
    syncer: SyncerHandle,
) -> None:
    shapes = join_all(syncer, ("island-0", "island-1", "island-2"))
    token = {i: credentials.island_token(syncer.token, i) for i in ("island-0", "island-1")}
    on_the_way = SlowPush(syncer, body_of(syncer, shapes, "island-1"), token["island-1"])
    on_the_way.begin()
    quorum = SlowPush(syncer, body_of(syncer, shapes, "island-0"), token["island-0"])
    quorum.begin()
    syncer_time_past(syncer, syncer.status()["time"] + PAUSE)  # a slow link's upload
    assert quorum.finish() == 200  # the quorum: K = 1, window 0.1 s
    accepted_at = syncer.status()["time"]
    # Three windows on: before the rule island-0 had merged alone by now.
    doc = syncer_time_past(syncer, accepted_at + 3 * GRACE)
    assert doc["versions"] == [0], "the merge did not wait for island-1's push on its way"
    assert on_the_way.finish() == 200
    wait_until(lambda: syncer.status()["versions"] == [1], timeout=30, what="the merge")
    (merge,) = syncer.merge_records()
    assert sorted(c["island"] for c in merge["contributors"]) == ["island-0", "island-1"]


def test_no_wait_for_a_request_that_is_not_an_islands_own_push_within_the_limit(
    syncer: SyncerHandle,
) -> None:
    shapes = join_all(syncer, ("island-0", "island-1", "island-2"))
    body = body_of(syncer, shapes, "island-1")
    token = credentials.island_token(syncer.token, "island-1")
    limit = 64 * len(body)  # far past any fragment's limit for this Δ
    strangers = [
        SlowPush(syncer, body, None),  # no credential
        SlowPush(syncer, body, token + "x"),  # a wrong one
        SlowPush(syncer, body, token, length=limit),  # oversized by its Content-Length
    ]
    for stranger in strangers:
        stranger.begin()
    code, _ = syncer.request(
        "POST",
        "/v1/fragments/0/push",
        body=body_of(syncer, shapes, "island-0"),
        token=credentials.island_token(syncer.token, "island-0"),
    )
    assert code == 200
    # It merges alone after its window: none of the three was waited for.
    wait_until(lambda: syncer.status()["versions"] == [1], timeout=30, what="the lone merge")
    (merge,) = syncer.merge_records()
    assert [c["island"] for c in merge["contributors"]] == ["island-0"]
    assert [s.status() for s in strangers] == [401, 403, 413]


# An island's accepted bodies sent slowly on purpose (audit of 2026-12-01, docs/adversaries.md).
TRICKLE = 2.0


def push_at_once(handle: SyncerHandle, shapes: dict[str, torch.Tensor], token: str) -> None:
    """island-0's push, its body sent whole at once (an upload of milliseconds): accepted."""
    code, _ = handle.request(
        "POST", "/v1/fragments/0/push", body=body_of(handle, shapes, "island-0"), token=token
    )
    assert code == 200


def test_an_island_trickling_its_pushes_does_not_hold_the_others_merges(
    syncer: SyncerHandle,
) -> None:
    """island-2's three accepted bodies each take TRICKLE; island-0's one takes milliseconds.
    The wait for island-2's next body is sized from the lower median over the islands of each
    one's median upload (core/grace.typical_upload): island-0's, so island-0's quorum push
    merges after the grace window. With one shared window of every body (main before the
    audit) the median was TRICKLE and the round waited 2 x TRICKLE = 4 s for island-2."""
    shapes = join_all(syncer, ("island-0", "island-1", "island-2"))
    token = {i: credentials.island_token(syncer.token, i) for i in ("island-0", "island-2")}
    for version in (1, 2, 3):
        slow = SlowPush(syncer, body_of(syncer, shapes, "island-2"), token["island-2"])
        slow.begin()
        syncer_time_past(syncer, syncer.status()["time"] + TRICKLE)
        assert slow.finish() == 200
        wait_until(lambda v=version: syncer.status()["versions"] == [v], timeout=30, what="merge")
    push_at_once(syncer, shapes, token["island-0"])
    wait_until(lambda: syncer.status()["versions"] == [4], timeout=30, what="island-0's merge")
    on_the_way = SlowPush(syncer, body_of(syncer, shapes, "island-2"), token["island-2"])
    on_the_way.begin()
    push_at_once(syncer, shapes, token["island-0"])
    accepted_at = syncer.status()["time"]
    # The grace window (0.1 s) and the typical upload's two x milliseconds are long past at
    # 1 s; the shared median's wait would end at 4 s.
    doc = syncer_time_past(syncer, accepted_at + 1.0)
    assert doc["versions"] == [5], "island-2's trickled uploads held island-0's merge"
    (*_, merge) = syncer.merge_records()
    assert [c["island"] for c in merge["contributors"]] == ["island-0"]
    assert on_the_way.finish() in (200, 409)
