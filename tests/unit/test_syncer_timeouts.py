"""Timeouts that follow the model's size (issue 20): the syncer gives a body of up to `limit`
bytes max(bodyTimeoutSeconds, limit / minBodyBytesPerSecond), and the learner's client gives
each attempt of a push or pull its body's size over the same rate on top of its fixed timeout.
Real aiohttp servers on loopback; time passes for real (well under a second per case)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from aiohttp import web
from diloco_trainer.api.protocol import PushMeta, SyncerError
from diloco_trainer.api.spec import parse_spec
from diloco_trainer.learner.syncer_client import SyncerClient
from diloco_trainer.syncer.edge.http import errors, read_limited
from diloco_trainer.syncer.edge.limits import HttpLimits

MIB = 2**20


def test_body_time_is_the_spec_floor_or_the_body_over_the_slowest_rate() -> None:
    limits = HttpLimits(body_timeout=600.0, min_body_rate=4 * MIB)
    assert limits.body_time(1024 * MIB) == 600.0  # 256 s at 4 MiB/s: the floor holds
    assert limits.body_time(4096 * MIB) == 1024.0  # a 1B model's fragment in fp32
    spec = parse_spec(
        {"model": {"preset": "gpt-tiny"}, "syncer": {"limits": {"minBodyBytesPerSecond": MIB}}}
    )
    assert HttpLimits.from_spec(spec).min_body_rate == MIB
    assert HttpLimits.from_spec(spec).body_time(1200 * MIB) == 1200.0


async def _serve(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = site._server
    assert isinstance(server, asyncio.Server)
    return runner, server.sockets[0].getsockname()[1]


def test_a_large_body_may_take_longer_than_body_timeout_seconds() -> None:
    """bodyTimeoutSeconds 0.2, a 1 MiB limit at 1 MiB/s: 1 s for the body. One sent in two
    halves 0.4 s apart arrives whole (a fixed 0.2 s answered 408 before)."""
    got: list[int] = []

    async def scenario() -> bytes:
        async def push(request: web.Request) -> web.Response:
            limits = HttpLimits(header_timeout=5.0, body_timeout=0.2, min_body_rate=MIB)
            got.append(len(await read_limited(request, MIB, "too big", limits)))
            return web.Response(text="ok")

        app = web.Application(middlewares=[errors])
        app.router.add_post("/push", push)
        runner, port = await _serve(app)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            half = 256 * 1024
            writer.write(b"POST /push HTTP/1.1\r\nHost: x\r\nConnection: close\r\n")
            writer.write(f"Content-Length: {2 * half}\r\n\r\n".encode() + b"x" * half)
            await writer.drain()
            await asyncio.sleep(0.4)  # time passing: the body is slow, not a cue
            writer.write(b"y" * half)
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(), 30)
            writer.close()
            return answer
        finally:
            await runner.cleanup()

    answer = asyncio.run(scenario())
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert got == [512 * 1024]


@pytest.mark.parametrize(("rate", "ok"), [(MIB, True), (1024 * MIB, False)])
def test_a_push_attempt_gets_its_body_time_on_top_of_request_timeout(rate: int, ok: bool) -> None:
    """request_timeout 0.3 s, a syncer that answers a push after 0.6 s, a 0.5 MiB body: at
    1 MiB/s an attempt may take 0.3 + 0.5 = 0.8 s, so it is answered; at 1 GiB/s each attempt
    ends at ~0.3 s and the retries run out (the fixed timeout alone)."""

    async def scenario() -> str:
        async def push(request: web.Request) -> web.Response:
            await request.read()
            await asyncio.sleep(0.6)  # a slow merge of the fragment, for real time
            return web.json_response({"accepted": True, "version": 3, "pending": 1})

        app = web.Application()
        app.router.add_post("/v1/fragments/0/push", push)
        runner, port = await _serve(app)
        try:
            async with SyncerClient(
                f"http://127.0.0.1:{port}",
                "token",
                request_timeout=0.3,
                retry_deadline=1.0,
                min_body_bytes_per_second=rate,
            ) as client:
                encoded = {"w": torch.zeros(128 * 1024)}  # 0.5 MiB of fp32
                meta = PushMeta(
                    island="island-0",
                    base_version=0,
                    tokens=1,
                    steps=1,
                    loss=None,
                    step_time=None,
                    codec="none",
                )
                try:
                    answer = await client.push_pseudo_gradient(0, encoded, meta)
                except SyncerError as err:
                    return f"error {err}"
                return f"accepted {answer.version}"
        finally:
            await runner.cleanup()

    result = asyncio.run(scenario())
    assert (result == "accepted 3") is ok, result
