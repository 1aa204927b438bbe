"""The syncer's routes behind the auth middleware with each kind of credential: an island's may
act only as that island, only admin (and root, and a region for its islands) may call the
membership route, and a refused request leaves the syncer's state exactly as it was."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from diloco_trainer.api import credentials, protocol
from diloco_trainer.syncer.edge.http import SyncerRoutes
from diloco_trainer.syncer.service.service import Syncer

from .test_syncer import body, delta
from .test_syncer_http_handlers import TOKEN, Handler, answer, request, state_of, with_syncer


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def island(name: str) -> str:
    return credentials.island_token(TOKEN, name)


async def call(
    routes: SyncerRoutes, handler: Handler, req_args: tuple[str, str, bytes], token: str, **kw: Any
) -> tuple[int, Any]:
    """The handler behind the auth middleware, as the application runs it."""
    method, path, data = req_args
    req = request(method, path, data, headers=bearer(token), **kw)

    async def authed(r: web.Request) -> web.StreamResponse:
        return await routes.auth(r, handler)

    return await answer(authed, req)


def _json(path: str, doc: Any) -> tuple[str, str, bytes]:
    return ("POST", path, json.dumps(doc).encode())


def test_credentials_syncer_island_token_acts_only_as_its_island(tmp_path: Any) -> None:
    async def scenario(syncer: Syncer, routes: SyncerRoutes) -> list[int]:
        await syncer.islands.join("island-0", 1)
        before = await state_of(syncer)
        mine = island("island-2")
        codes = [
            (await call(routes, routes.join, _json("/", {"island": "island-0"}), mine))[0],
            (await call(routes, routes.heartbeat, _json("/", {"island": "island-0"}), mine))[0],
            (await call(routes, routes.leave, _json("/", {"island": "island-0"}), mine))[0],
        ]
        good = body(syncer, 0, "island-0", delta(syncer, 0, 1))
        push = ("POST", "/v1/fragments/0/push", good)
        code, doc = await call(routes, routes.handle_push, push, mine, match_info={"fragment": "0"})
        codes.append(code)
        assert "island-2" in doc["error"] and "'island-0'" in doc["error"], doc
        assert await state_of(syncer) == before  # nothing was recorded for island-0
        metrics = syncer.metrics.render().decode()
        assert 'diloco_syncer_pushes_total{result="forbidden"} 1.0' in metrics
        # As itself it may, and it may read the status.
        code, _ = await call(routes, routes.join, _json("/", {"island": "island-2"}), mine)
        codes.append(code)
        codes.append((await call(routes, routes.status, ("GET", "/v1/status", b""), mine))[0])
        return codes

    assert with_syncer(tmp_path, scenario) == [403, 403, 403, 403, 200, 200]


def test_credentials_syncer_membership_route_is_the_operators(tmp_path: Any) -> None:
    async def scenario(syncer: Syncer, routes: SyncerRoutes) -> list[tuple[str, int]]:
        await syncer.islands.join("island-0", 1)
        await syncer.islands.join("island-1", 1)
        drop = json.dumps({"state": "dropped", "reason": "test"}).encode()
        tries = [
            ("island", island("island-0"), "island-0"),
            ("other region", credentials.region_token(TOKEN, "eu"), "island-0"),
            ("forged", "dlc1.admin..AAAA", "island-0"),
            ("region", credentials.region_token(TOKEN, ""), "island-1"),
            ("admin", credentials.admin_token(TOKEN), "island-0"),
        ]
        codes = []
        for what, token, name in tries:
            before = (await syncer.status())["islands"][name]["state"]
            code, doc = await call(
                routes, routes.membership, ("PUT", "/", drop), token, match_info={"island": name}
            )
            codes.append((what, code))
            after = (await syncer.status())["islands"][name]["state"]
            assert (after == protocol.STATE_DROPPED) == (code == 200), (what, doc)
            assert code == 200 or before == after
        return codes

    assert with_syncer(tmp_path, scenario) == [
        ("island", 403),
        ("other region", 403),
        ("forged", 403),
        ("region", 200),
        ("admin", 200),
    ]


def test_credentials_syncer_admin_token_cannot_act_as_an_island(tmp_path: Any) -> None:
    async def scenario(syncer: Syncer, routes: SyncerRoutes) -> int:
        admin = credentials.admin_token(TOKEN)
        code, doc = await call(routes, routes.join, _json("/", {"island": "island-0"}), admin)
        assert "admin" in doc["error"]
        assert syncer.state.membership.islands == {}
        return code

    assert with_syncer(tmp_path, scenario) == 403
