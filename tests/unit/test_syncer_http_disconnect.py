"""A client that goes away in the middle of its push body (issue 22, finding 8): one info line,
no internal error and no traceback. A real aiohttp server on loopback with the syncer's error
middleware and body reader; the client is a raw socket that sends part of a body and closes."""

from __future__ import annotations

import asyncio
import logging

import pytest
from aiohttp import web
from diloco_trainer.syncer.edge.http import errors, read_limited
from diloco_trainer.syncer.edge.limits import HttpLimits
from diloco_trainer.syncer.errors import Refused


def test_a_client_gone_mid_body_is_an_info_line_not_an_internal_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    outcome: list[BaseException | bytes] = []

    async def scenario() -> None:
        done = asyncio.Event()

        async def push(request: web.Request) -> web.Response:
            try:
                body = await read_limited(request, 1 << 20, "too big", HttpLimits())
                outcome.append(body)
            except Refused as err:
                outcome.append(err)
                raise
            finally:
                done.set()
            return web.Response(text="ok")

        app = web.Application(middlewares=[errors])
        app.router.add_post("/push", push)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            server = site._server
            assert isinstance(server, asyncio.Server)
            port = server.sockets[0].getsockname()[1]
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /push HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
            writer.write(b"x" * 1000)
            await writer.drain()
            writer.close()
            await writer.wait_closed()
            await asyncio.wait_for(done.wait(), 30)
        finally:
            await runner.cleanup()

    with caplog.at_level(logging.INFO, logger="diloco.syncer"):
        asyncio.run(scenario())
    assert len(outcome) == 1 and isinstance(outcome[0], Refused)
    assert outcome[0].status == 400 and "closed the connection" in outcome[0].message
    mine = [r for r in caplog.records if r.name == "diloco.syncer"]
    assert [r.levelno for r in mine] == [logging.INFO], [r.getMessage() for r in mine]
    assert "after 1000 bytes" in mine[0].getMessage() and mine[0].exc_info is None
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
