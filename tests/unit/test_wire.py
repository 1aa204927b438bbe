"""The wire protocol: safetensors bodies and the SyncerClient's retries and errors, against a small
real aiohttp server on loopback."""

from __future__ import annotations

import asyncio
import json
import logging
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import safetensors.torch
import torch
from aiohttp import web
from aiohttp.test_utils import TestServer
from diloco_trainer.api import protocol
from diloco_trainer.api.documents import JoinInfo, PushAnswer
from diloco_trainer.core import payloads
from diloco_trainer.learner import syncer_client
from diloco_trainer.local import launch


def test_wire_body_roundtrip_keeps_tensors_and_typed_metadata() -> None:
    tensors = {"a": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.ones(4).half()}
    body = payloads.encode_body(tensors, {"version": 3, "finished": True, "island": "island-0"})
    got, meta = payloads.decode_body(body)
    assert meta == {"version": "3", "finished": "true", "island": "island-0"}
    assert torch.equal(got["a"], tensors["a"]) and got["b"].dtype == torch.float16


def test_wire_encode_body_accepts_views_and_shared_storage() -> None:
    base = torch.randn(4, 4)
    body = payloads.encode_body({"t": base.t(), "same": base, "again": base}, {})
    got, _ = payloads.decode_body(body)
    assert torch.equal(got["t"], base.t()) and torch.equal(got["again"], base)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"short", "too short"),
        (struct.pack("<Q", 1 << 40) + b"{}", "out of range"),
        (struct.pack("<Q", 5) + b"nope!", "not JSON"),
        (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
        (struct.pack("<Q", 26) + b'{"__metadata__": {"a": 1}}', "strings to strings"),
    ],
)
def test_wire_read_metadata_refuses_malformed_headers(body: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        protocol.read_metadata(body)


def test_wire_decode_body_refuses_truncated_data() -> None:
    body = payloads.encode_body({"a": torch.ones(100)}, {})
    with pytest.raises(ValueError, match="not valid safetensors"):
        payloads.decode_body(body[:-10])


def test_wire_push_meta_metadata_is_json_typed() -> None:
    meta = protocol.PushMeta(
        "island-1", 4, 1024, 8, 2.5, 0.1, "int8", sync_time=0.3, push_id="x", kept_steps=3
    )
    assert meta.to_metadata() == {
        "island": "island-1",
        "baseVersion": "4",
        "tokens": "1024",
        "steps": "8",
        "loss": "2.5",
        "stepTime": "0.1",
        "syncTime": "0.3",
        "codec": "int8",
        "pushId": "x",
        "keptSteps": "3",
    }


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def serve(routes: list[tuple[str, str, Handler]], test: Callable[[str], Awaitable[Any]]) -> Any:
    """Run `test(base_url)` against a real aiohttp server with these routes."""

    async def main() -> Any:
        app = web.Application()
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        try:
            return await test(str(server.make_url("")).rstrip("/"))
        finally:
            await server.close()

    return asyncio.run(main())


def test_wire_client_retries_503_and_keeps_the_push_id(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[dict[str, str]] = []

    async def push(request: web.Request) -> web.Response:
        body = await request.read()
        seen.append({**protocol.read_metadata(body), "auth": request.headers["Authorization"]})
        if len(seen) < 3:
            return web.json_response({"error": "busy"}, status=503)
        return web.json_response({"accepted": True, "version": 0, "pending": 1})

    async def test(url: str) -> PushAnswer:
        async with syncer_client.SyncerClient(url, "tok", retry_deadline=30) as client:
            meta = protocol.PushMeta("island-0", 0, 10, 1, 1.0, 0.1, "none")
            return await client.push_pseudo_gradient(0, {"w": torch.zeros(3)}, meta)

    caplog.set_level(logging.WARNING, logger="diloco.wire")
    answer = serve([("POST", protocol.ROUTE_PUSH, push)], test)
    assert answer.accepted is True and answer.pending == 1
    assert len(seen) == 3
    assert len({s["pushId"] for s in seen}) == 1 and seen[0]["pushId"]
    assert all(s["auth"] == "Bearer tok" for s in seen)
    assert sum("syncer unreachable, retrying in" in r.getMessage() for r in caplog.records) == 2


def test_wire_client_raises_refusals_at_once_with_code() -> None:
    calls = 0

    async def push(request: web.Request) -> web.Response:
        nonlocal calls
        calls += 1
        return web.json_response({"error": "too old", "code": protocol.ERROR_STALE}, status=409)

    async def test(url: str) -> protocol.SyncerError:
        async with syncer_client.SyncerClient(url, "tok") as client:
            meta = protocol.PushMeta("island-0", 0, 10, 1, 1.0, 0.1, "none")
            with pytest.raises(protocol.SyncerError) as err:
                await client.push_pseudo_gradient(0, {"w": torch.zeros(3)}, meta)
            return err.value

    err = serve([("POST", protocol.ROUTE_PUSH, push)], test)
    assert (err.status, err.code, err.message) == (409, protocol.ERROR_STALE, "too old")
    assert calls == 1


def test_wire_client_gives_up_after_the_deadline() -> None:
    port = launch.free_port()  # nothing listens there

    async def test() -> protocol.SyncerError:
        async with syncer_client.SyncerClient(
            f"http://127.0.0.1:{port}", "t", retry_deadline=0.5
        ) as c:
            with pytest.raises(protocol.SyncerError) as err:
                await c.status()
            return err.value

    err = asyncio.run(test())
    assert err.status == 0 and "unreachable" in err.message


def test_wire_client_pull_parses_metadata_and_304() -> None:
    async def pull(request: web.Request) -> web.Response:
        after = int(request.query["after"])
        if after >= 5:
            return web.Response(status=304)
        meta = {"version": 5, "fragment": 1, "outerStep": 4, "finished": False}
        return web.Response(body=payloads.encode_body({"w": torch.ones(2)}, meta))

    async def test(url: str) -> tuple[Any, Any]:
        async with syncer_client.SyncerClient(url, "tok") as client:
            return (
                await client.pull_fragment(1, after=4),
                await client.pull_fragment(1, after=5, wait=0.1),
            )

    got, none = serve([("GET", protocol.ROUTE_FRAGMENT, pull)], test)
    assert (got.fragment, got.version, got.outer_step, got.finished) == (1, 5, 4, False)
    assert torch.equal(got.tensors["w"], torch.ones(2))
    assert none is None


def test_wire_client_json_routes_send_the_documented_bodies() -> None:
    bodies: dict[str, Any] = {}

    def record(name: str, answer: dict[str, Any]) -> Handler:
        async def handler(request: web.Request) -> web.Response:
            bodies[name] = await request.json() if request.can_read_body else None
            bodies[name + ".query"] = dict(request.query)
            return web.json_response(answer)

        return handler

    join_answer = {
        "fragments": [["a", "b"], ["c"]],
        "versions": [2, 1],
        "outerStep": 1,
        "finished": False,
        "codec": "int8",
    }

    heartbeat_answer = {"state": "active", "finished": False, "versions": [2, 1]}
    membership_answer = {"island": "island-3", "state": "dropped", "reason": "unhealthy"}
    leave_answer = {"island": "island-3", "state": "left"}
    status_answer = {"outerStep": 1, "versions": [2, 1], "finished": False, "digest": "d1"}
    merges_answer = {
        "fragment": 1,
        "time": 5.0,
        "stepTimes": {"island-3": 0.5},
        "merges": [{"version": 1, "fragment": 1, "contributors": [{"island": "island-3"}]}],
    }

    async def test(url: str) -> list[Any]:
        async with syncer_client.SyncerClient(url, "tok") as client:
            return [
                await client.join("island-3", 2),
                await client.heartbeat(
                    "island-3",
                    step=7,
                    tokens=99,
                    loss=2.0,
                    step_time=0.5,
                    holding=True,
                    drained=True,
                ),
                await client.set_membership("island-3", "dropped", "unhealthy"),
                await client.leave("island-3"),
                await client.status(digest=True),
                await client.fragment_merges(1, 1),
            ]

    info, beat, membership, leave, status, merges = serve(
        [
            ("POST", protocol.ROUTE_JOIN, record("join", join_answer)),
            ("POST", protocol.ROUTE_HEARTBEAT, record("heartbeat", heartbeat_answer)),
            ("PUT", protocol.ROUTE_ISLAND, record("membership", membership_answer)),
            ("POST", protocol.ROUTE_LEAVE, record("leave", leave_answer)),
            ("GET", protocol.ROUTE_STATUS, record("status", status_answer)),
            ("GET", protocol.ROUTE_MERGES, record("merges", merges_answer)),
        ],
        test,
    )
    assert info == JoinInfo(
        fragments=[["a", "b"], ["c"]], versions=[2, 1], outer_step=1, finished=False, codec="int8"
    )
    assert (beat.state, beat.versions) == (protocol.STATE_ACTIVE, [2, 1])
    assert (membership.state, membership.reason) == (protocol.STATE_DROPPED, "unhealthy")
    assert leave.state == protocol.STATE_LEFT
    assert (status.outer_step, status.digest) == (1, "d1")
    assert bodies["join"] == {"island": "island-3", "replicas": 2}
    assert bodies["heartbeat"] == {
        "island": "island-3",
        "step": 7,
        "tokens": 99,
        "loss": 2.0,
        "stepTime": 0.5,
        "holding": True,
        "drained": True,
    }
    assert bodies["membership"] == {"state": "dropped", "reason": "unhealthy"}
    assert bodies["leave"] == {"island": "island-3"}
    assert bodies["status.query"] == {"digest": "1"}
    assert (merges.fragment, merges.step_times) == (1, {"island-3": 0.5})
    assert [m.contributors[0].island for m in merges.merges] == ["island-3"]
    assert bodies["merges.query"] == {"from": "1"}


def test_wire_safetensors_body_is_plain_safetensors() -> None:
    # Other tools (and other languages) can read our bodies with the stock library.
    body = payloads.encode_body({"w": torch.full((2, 2), 3.0)}, {"version": 1})
    assert torch.equal(safetensors.torch.load(body)["w"], torch.full((2, 2), 3.0))
    header_len = struct.unpack("<Q", body[:8])[0]
    assert json.loads(body[8 : 8 + header_len])["__metadata__"] == {"version": "1"}
