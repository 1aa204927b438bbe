"""The one JSON client of the syncer (api/client.py) over real loopback sockets: an aiohttp app
plays the syncer. Its retry policy, its errors, and the typed documents it returns."""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import pytest
from aiohttp import web
from diloco_trainer.api import protocol
from diloco_trainer.api.client import SyncerJsonClient, backoff
from diloco_trainer.api.documents import MembershipAnswer, SyncerStatus
from diloco_trainer.local.launch import free_port

STATUS = {"outerStep": 3, "versions": [3, 4], "finished": False, "islands": {}}


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def _app(calls: list[Any], *, fail_first: int = 0, status_body: Any = None) -> web.Application:
    async def status(request: web.Request) -> web.Response:
        calls.append(("GET", request.headers.get("Authorization")))
        if len([c for c in calls if c[0] == "GET"]) <= fail_first:
            return web.json_response({"error": "warming up"}, status=503)
        return web.json_response(STATUS if status_body is None else status_body)

    async def island(request: web.Request) -> web.Response:
        body = await request.json()
        calls.append(("PUT", request.match_info["island"], body))
        if body["state"] not in protocol.ADMIN_STATES:
            return web.json_response(
                {"error": "state must be active or dropped", "code": "bad_state"}, status=400
            )
        if body["state"] == protocol.STATE_ACTIVE:
            return web.json_response({"error": "merge failed"}, status=500)
        return web.json_response(
            {"island": request.match_info["island"], "state": body["state"], "reason": "r"}
        )

    app = web.Application()
    app.router.add_get(protocol.ROUTE_STATUS, status)
    app.router.add_put(protocol.ROUTE_ISLAND, island)
    return app


def test_api_client_retries_503_then_returns_typed_documents(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def run() -> tuple[SyncerStatus, MembershipAnswer]:
        calls: list[Any] = []
        runner, url = await _serve(_app(calls, fail_first=2))
        try:
            async with SyncerJsonClient(url + "/", "t0k", retry_deadline=30) as client:
                status = await client.status()  # after two 503s
                answer = await client.set_membership("eu-island-1", "dropped", "pods not Ready")
        finally:
            await runner.cleanup()
        assert [c for c in calls if c[0] == "GET"] == [("GET", "Bearer t0k")] * 3
        assert calls[-1] == ("PUT", "eu-island-1", {"state": "dropped", "reason": "pods not Ready"})
        return status, answer

    caplog.set_level(logging.WARNING, logger="diloco.wire")
    status, answer = asyncio.run(run())
    assert (status.outer_step, status.versions, status.islands) == (3, [3, 4], {})
    assert (answer.island, answer.state) == ("eu-island-1", protocol.STATE_DROPPED)
    assert sum("retrying in" in r.getMessage() for r in caplog.records) == 2


def test_api_client_4xx_raises_at_once_with_code() -> None:
    async def run() -> tuple[protocol.SyncerError, int]:
        calls: list[Any] = []
        runner, url = await _serve(_app(calls))
        try:
            async with SyncerJsonClient(url, "t") as client:
                with pytest.raises(protocol.SyncerError, match="state must be") as info:
                    await client.set_membership("island-0", "bogus", "")
        finally:
            await runner.cleanup()
        return info.value, len(calls)

    err, calls = asyncio.run(run())
    assert (err.status, err.code, calls) == (400, "bad_state", 1)
    assert not err.unavailable  # a refusal: the operator does not mark the syncer unreachable


def test_api_client_500_is_not_retried_but_counts_as_unavailable() -> None:
    async def run() -> tuple[protocol.SyncerError, int]:
        calls: list[Any] = []
        runner, url = await _serve(_app(calls))
        try:
            async with SyncerJsonClient(url, "t") as client:
                with pytest.raises(protocol.SyncerError) as info:
                    await client.set_membership("island-0", protocol.STATE_ACTIVE, "")
        finally:
            await runner.cleanup()
        return info.value, len(calls)

    err, calls = asyncio.run(run())
    assert (err.status, err.message, calls) == (500, "merge failed", 1)
    assert err.unavailable


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ({"outerStep": "three", "versions": [], "finished": False}, "outerStep"),
        ([1, 2, 3], "expected a JSON object"),
    ],
)
def test_api_client_malformed_answer_raises_at_once(body: Any, problem: str) -> None:
    async def run() -> tuple[protocol.SyncerError, int]:
        calls: list[Any] = []
        runner, url = await _serve(_app(calls, status_body=body))
        try:
            async with SyncerJsonClient(url, "t") as client:
                with pytest.raises(protocol.SyncerError) as info:
                    await client.status()
        finally:
            await runner.cleanup()
        return info.value, len(calls)

    err, calls = asyncio.run(run())
    assert (err.status, err.code, calls) == (200, protocol.ERROR_MALFORMED, 1)
    assert problem in err.message and "/v1/status" in err.message
    assert not err.unavailable


def test_api_client_unreachable_within_deadline() -> None:
    async def run() -> protocol.SyncerError:
        url = f"http://127.0.0.1:{free_port()}"  # nobody listens
        async with SyncerJsonClient(url, "t", retry_deadline=1.0) as client:
            with pytest.raises(protocol.SyncerError, match="/v1/status") as info:
                await client.status()
        return info.value

    err = asyncio.run(run())
    assert err.status == 0 and err.unavailable and "unreachable" in err.message


def test_api_client_black_holed_syncer_costs_the_deadline_not_the_timeout() -> None:
    """A syncer that accepts connections and never answers: the 1 s deadline ends the call,
    not the 120 s per-request timeout. (No wall-clock assertion: the guard below is 60x the
    deadline, so only a client that ignores its deadline trips it, however loaded the machine.)
    """

    async def run() -> protocol.SyncerError:
        with socket.socket() as hole:  # listens, never accepts: requests get no answer
            hole.bind(("127.0.0.1", 0))
            hole.listen(16)
            url = f"http://127.0.0.1:{hole.getsockname()[1]}"
            async with SyncerJsonClient(
                url, "t", retry_deadline=1.0, request_timeout=120.0
            ) as client:
                with pytest.raises(protocol.SyncerError, match="/v1/status") as info:
                    await asyncio.wait_for(client.status(), timeout=60)
        return info.value

    err = asyncio.run(run())
    assert err.status == 0 and "TimeoutError" in err.message


def test_api_client_backoff_doubles_up_to_its_cap() -> None:
    assert [backoff(a) for a in range(7)] == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
    assert backoff(3, base=0.1, cap=0.5) == 0.5
