"""Nothing a syncer answers reaches the job's status: a fixed message per class of failure."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from diloco_operator.syncer_errors import condition_message, credentials_error
from diloco_trainer.api.client import SyncerJsonClient
from diloco_trainer.api.protocol import ERROR_MALFORMED, ROUTE_STATUS, SyncerError
from diloco_trainer.local.launch import free_port

URL = "https://syncer.example:8470"
SECRET = "<html>internal admin page: password=hunter2</html>"


@pytest.mark.parametrize(
    ("err", "expected"),
    [
        (SyncerError(0, f"unreachable: {SECRET}"), "did not answer"),
        (SyncerError(200, SECRET, ERROR_MALFORMED), "not its document"),
        (SyncerError(302, SECRET), "redirect (HTTP 302)"),
        (SyncerError(403, SECRET), "refused the operator's credential (HTTP 403)"),
        (SyncerError(404, SECRET), "refused the request (HTTP 404)"),
        (SyncerError(500, SECRET), "failed (HTTP 500)"),
    ],
)
def test_operator_syncer_errors_fixed_message_per_class(err: SyncerError, expected: str) -> None:
    message = condition_message(err, URL)
    assert expected in message and URL in message
    assert "hunter2" not in message and "html" not in message


def test_operator_syncer_errors_own_credential_problems_are_named() -> None:
    err = credentials_error("token Secret tok (key token) not found")
    assert condition_message(err, URL) == (
        "no credential to call the syncer with: token Secret tok (key token) not found"
    )


def test_operator_syncer_errors_client_follows_no_redirect() -> None:
    """A syncer endpoint redirecting elsewhere (an internal page) is an error, not followed."""
    hits: list[str] = []

    async def redirect(request: web.Request) -> web.Response:
        hits.append(request.path)
        raise web.HTTPFound("/internal")

    async def internal(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.json_response({"outerStep": 1, "versions": [1], "finished": False})

    async def run() -> SyncerError:
        app = web.Application()
        app.router.add_get(ROUTE_STATUS, redirect)
        app.router.add_get("/internal", internal)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with SyncerJsonClient(f"http://127.0.0.1:{port}", "t") as client:
                with pytest.raises(SyncerError) as caught:
                    await client.status()
        finally:
            await runner.cleanup()
        return caught.value

    err = asyncio.run(run())
    assert err.status == 302 and hits == [ROUTE_STATUS]
    assert "redirect" in condition_message(err, URL)
