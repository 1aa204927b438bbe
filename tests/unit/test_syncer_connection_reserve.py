"""The syncer's connection cap keeps a reserve no single client can take (issue 22, finding 4):
~530 idle connections from one client made /healthz answer 503 for as long as they were held,
and a kubelet restarts a syncer whose liveness probe fails. A real GuardedSite on loopback; the
flood comes from 127.0.0.2, the probe from 127.0.0.1."""

from __future__ import annotations

import asyncio

from aiohttp import web
from diloco_trainer.syncer.edge.limits import ConnectionCap, GuardedSite, HttpLimits, reserve_of

FLOOD, PROBE = "127.0.0.2", "127.0.0.1"
# A reply's end: each answer here is small, and the busy one closes its connection.
READ_TIMEOUT = 30.0


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def open_from(port: int, source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


def test_limits_reserve_sizes() -> None:
    # At most 16, at most an eighth of the cap.
    assert [reserve_of(n) for n in (1, 8, 16, 64, 512)] == [0, 1, 2, 8, 16]


def test_limits_one_client_cannot_take_the_probe_reserve() -> None:
    async def scenario() -> tuple[list[bytes], bytes, dict[str, int]]:
        app = web.Application()
        app.router.add_get("/healthz", healthz)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = GuardedSite(runner, "127.0.0.1", 0, limits=HttpLimits(max_connections=8))
        await site.start()
        try:
            server = site._server
            assert isinstance(server, asyncio.Server)
            port = server.sockets[0].getsockname()[1]
            cap = site.cap
            assert isinstance(cap, ConnectionCap) and cap.per_peer == 7  # 8 - reserve 1
            held = [await open_from(port, FLOOD) for _ in range(8)]  # idle: no request sent
            # The 8th is answered busy and closed (read to the end: closed server-side).
            busy = [await asyncio.wait_for(reader.read(), READ_TIMEOUT) for reader, _ in held[7:]]
            reader, writer = await open_from(port, PROBE)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            probe = await asyncio.wait_for(reader.read(), READ_TIMEOUT)
            writer.close()
            peers = dict(cap.peers)
            for _, w in held:
                w.close()
            return busy, probe, peers
        finally:
            await runner.cleanup()

    busy, probe, peers = asyncio.run(scenario())
    assert all(b.startswith(b"HTTP/1.1 503") and b'"busy"' in b for b in busy), busy
    assert probe.startswith(b"HTTP/1.1 200") and b'{"ok": true}' in probe, probe
    assert peers == {FLOOD: 7}  # the probe's connection was closed by then
