"""The operator's syncer client over real loopback sockets (an aiohttp app plays the syncer)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
from aiohttp import web
from diloco_operator.syncer_client import (
    SyncerClient,
    SyncerRequestError,
    SyncerUnavailable,
    backoff_delays,
)
from diloco_trainer.local.launch import free_port


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def _app(calls: list[Any], *, fail_first: int = 0) -> web.Application:
    async def status(request: web.Request) -> web.Response:
        calls.append(("GET", request.headers.get("Authorization")))
        if len([c for c in calls if c[0] == "GET"]) <= fail_first:
            return web.json_response({"error": "warming up"}, status=503)
        return web.json_response({"outerStep": 3, "islands": {}})

    async def island(request: web.Request) -> web.Response:
        body = await request.json()
        calls.append(("PUT", request.match_info["island"], body))
        if body["state"] not in ("active", "dropped"):
            return web.json_response({"error": "state must be active or dropped"}, status=400)
        return web.json_response({"island": request.match_info["island"], "state": body["state"]})

    app = web.Application()
    app.router.add_get("/v1/status", status)
    app.router.add_put("/v1/islands/{island}", island)
    return app


def test_syncer_client_status_and_membership_with_token() -> None:
    async def run() -> None:
        calls: list[Any] = []
        runner, url = await _serve(_app(calls, fail_first=2))
        try:
            async with SyncerClient(url + "/", "t0k") as client:
                assert (await client.status())["outerStep"] == 3  # after two 503s
                answer = await client.set_membership("eu-island-1", "dropped", "pods not Ready")
        finally:
            await runner.cleanup()
        assert answer == {"island": "eu-island-1", "state": "dropped"}
        assert [c for c in calls if c[0] == "GET"] == [("GET", "Bearer t0k")] * 3
        assert calls[-1] == ("PUT", "eu-island-1", {"state": "dropped", "reason": "pods not Ready"})

    asyncio.run(run())


def test_syncer_client_4xx_is_not_retried() -> None:
    async def run() -> None:
        calls: list[Any] = []
        runner, url = await _serve(_app(calls))
        try:
            async with SyncerClient(url, "t") as client:
                with pytest.raises(SyncerRequestError, match="state must be") as info:
                    await client.set_membership("island-0", "bogus", "")
        finally:
            await runner.cleanup()
        assert info.value.status == 400 and len(calls) == 1

    asyncio.run(run())


def test_syncer_client_unreachable_within_deadline() -> None:
    async def run() -> None:
        url = f"http://127.0.0.1:{free_port()}"  # nobody listens
        async with SyncerClient(url, "t", deadline=1.0) as client:
            with pytest.raises(SyncerUnavailable, match="/v1/status"):
                await client.status()

    asyncio.run(run())


def test_syncer_client_black_holed_syncer_costs_the_deadline_not_the_timeout() -> None:
    """A syncer that accepts connections and never answers: the 1 s deadline ends the call,
    not the 120 s per-request timeout. (No wall-clock assertion: the guard below is 60x the
    deadline, so only a client that ignores its deadline trips it, however loaded the machine.)
    """

    async def run() -> None:
        with socket.socket() as hole:  # listens, never accepts: requests get no answer
            hole.bind(("127.0.0.1", 0))
            hole.listen(16)
            url = f"http://127.0.0.1:{hole.getsockname()[1]}"
            async with SyncerClient(url, "t", timeout=120.0, deadline=1.0) as client:
                with pytest.raises(SyncerUnavailable, match="/v1/status"):
                    await asyncio.wait_for(client.status(), timeout=60)

    asyncio.run(run())


def test_backoff_delays_grow_and_fit_budget() -> None:
    delays = backoff_delays(1.5)
    assert delays == [0.1, 0.2, 0.4, 0.8] and sum(delays) <= 1.5
    assert backoff_delays(0.05) == []
