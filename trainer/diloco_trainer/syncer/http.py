"""The syncer's HTTP edge: request validation, bearer-token auth, routes and error bodies.

Thin by design: handlers parse and validate input (a bad field gets a 400 naming it), then call
the engine (syncer.Syncer), whose Refused exceptions become JSON errors {"error", "code"?} with
their status. Routes and field names are in wire.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import re
import ssl
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from diloco_trainer.api import protocol
from diloco_trainer.api.contract import SyncerEnv
from diloco_trainer.syncer.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from diloco_trainer.syncer.rounds import Refused

if TYPE_CHECKING:
    from diloco_trainer.syncer.service import Syncer

log = logging.getLogger("diloco.syncer")

# Largest JSON body accepted on the small routes (join, heartbeat, leave, membership).
JSON_LIMIT = 64 * 1024
ISLAND_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,251}[A-Za-z0-9])?$")
# Seconds the server waits for in-flight requests on SIGTERM (long-polls are answered at once).
SHUTDOWN_TIMEOUT = 10.0
SCHEDULER_KEY = web.AppKey("scheduler", asyncio.Task)

# ----- request validation (pure) -------------------------------------------------------------


def _typed(doc: dict[str, Any], key: str, where: str, kind: type, *, required: bool = True) -> Any:
    if key not in doc or doc[key] is None:
        if required:
            raise Refused(400, f"{where}.{key} is required")
        return None
    value = doc[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
        raise Refused(400, f"{where}.{key} must be {kind.__name__}, got {type(value).__name__}")
    if kind is float and not math.isfinite(value):
        raise Refused(400, f"{where}.{key} must be a finite number, got {value}")
    return value


def _at_least(value: float | None, minimum: float, where: str, key: str) -> None:
    if value is not None and value < minimum:
        raise Refused(400, f"{where}.{key} must be >= {minimum}, got {value}")


def _island_name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not ISLAND_NAME.match(value):
        raise Refused(
            400,
            f"{where}.island must be 1-253 letters, digits, '-', '_' or '.', starting and ending "
            f"with a letter or digit; got {value!r}",
        )
    return value


def parse_push_meta(meta: dict[str, str], codec: str) -> protocol.PushMeta:
    """Validate a push's safetensors metadata; Refused(400) naming the field."""
    doc: dict[str, Any] = {}
    for key, raw in meta.items():
        if (
            key == protocol.META_ISLAND
            or key == protocol.META_CODEC
            or key == protocol.META_PUSH_ID
        ):
            doc[key] = raw
            continue
        try:
            doc[key] = json.loads(raw)
        except ValueError:
            raise Refused(400, f"metadata.{key} is not a JSON value: {raw[:50]!r}") from None
    where = "metadata"
    island = _island_name(doc.get(protocol.META_ISLAND), where)
    base = _typed(doc, protocol.META_BASE_VERSION, where, int)
    tokens = _typed(doc, protocol.META_TOKENS, where, int)
    steps = _typed(doc, protocol.META_STEPS, where, int)
    loss = _typed(doc, protocol.META_LOSS, where, float, required=False)
    step_time = _typed(doc, protocol.META_STEP_TIME, where, float, required=False)
    sync_time = _typed(doc, protocol.META_SYNC_TIME, where, float, required=False)
    _at_least(base, 0, where, protocol.META_BASE_VERSION)
    _at_least(tokens, 1, where, protocol.META_TOKENS)
    _at_least(steps, 1, where, protocol.META_STEPS)
    _at_least(step_time, 0, where, protocol.META_STEP_TIME)
    _at_least(sync_time, 0, where, protocol.META_SYNC_TIME)
    got_codec = doc.get(protocol.META_CODEC, "")
    if got_codec != codec:
        raise Refused(
            400, f"metadata.codec {got_codec!r} does not match the job's sync.compression {codec!r}"
        )
    push_id = doc.get(protocol.META_PUSH_ID, "")
    if len(push_id) > 128:
        raise Refused(400, "metadata.pushId is longer than 128 characters")
    return protocol.PushMeta(
        island=island,
        base_version=base,
        tokens=tokens,
        steps=steps,
        loss=loss if loss is not None else float("nan"),
        step_time=step_time or 0.0,
        codec=codec,
        sync_time=sync_time or 0.0,
        push_id=push_id,
    )


# ----- routes ----------------------------------------------------------------------------------

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, message: str, code: str = "") -> web.Response:
    doc = {"error": message, "code": code} if code else {"error": message}
    return web.json_response(doc, status=status)


_REFUSAL_REASON = {
    400: "malformed",
    401: "unauthenticated",
    403: "forbidden",
    404: "unknown",
    409: "stale",
    413: "too_large",
}


async def read_limited(request: web.Request, limit: int, too_big: str) -> bytes:
    """The whole request body, refusing (413) more than `limit` bytes whether or not the client
    declared a Content-Length (a chunked body is counted as it arrives)."""
    if request.content_length is not None and request.content_length > limit:
        raise Refused(413, too_big)
    buf = bytearray()
    async for chunk in request.content.iter_any():
        buf += chunk
        if len(buf) > limit:
            raise Refused(413, too_big)
    return bytes(buf)


def build_app(syncer: Syncer, token: str) -> web.Application:
    """The aiohttp application serving `syncer` behind bearer-token auth."""
    expected = token.encode()

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except Refused as err:
            return _error(err.status, err.message, err.code)
        except web.HTTPException as err:
            if err.status < 400:
                raise
            return _error(err.status, err.reason or str(err))
        except Exception:
            log.exception("internal error on %s %s", request.method, request.path)
            return _error(500, "internal error in the syncer; see its log")

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in protocol.PUBLIC_ROUTES:
            return await handler(request)
        header = request.headers.get("Authorization", "")
        if not header:
            raise Refused(401, "missing bearer token: send 'Authorization: Bearer <token>'")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise Refused(401, "malformed Authorization header: expected 'Bearer <token>'")
        if not hmac.compare_digest(given.strip().encode(), expected):
            raise Refused(403, "invalid bearer token")
        return await handler(request)

    async def json_object(request: web.Request, route: str) -> dict[str, Any]:
        raw = await read_limited(request, JSON_LIMIT, f"{route} body exceeds {JSON_LIMIT} bytes")
        try:
            doc = json.loads(raw)
        except ValueError as err:
            raise Refused(400, f"{route} body is not valid JSON: {err}") from None
        if not isinstance(doc, dict):
            raise Refused(400, f"{route} body must be a JSON object")
        return doc

    def fragment_arg(request: web.Request) -> int:
        raw = request.match_info["fragment"]
        if not raw.isdigit():
            raise Refused(404, f"fragment {raw!r} does not exist")
        try:
            return int(raw)
        except ValueError:
            raise Refused(404, f"fragment {raw!r} does not exist") from None

    async def read_push_body(request: web.Request, fragment: int) -> bytes:
        syncer.check_fragment(fragment)
        limit = syncer.body_limits[fragment]
        too_big = (
            f"push body for fragment {fragment} exceeds {limit} bytes, the most a "
            f"{syncer.codec}-encoded pseudo-gradient of this fragment can take"
        )
        return await read_limited(request, limit, too_big)

    async def join(request: web.Request) -> web.Response:
        doc = await json_object(request, "join")
        island = _island_name(doc.get("island"), "join")
        replicas = _typed(doc, "replicas", "join", int, required=False) or 1
        _at_least(replicas, 1, "join", "replicas")
        return web.json_response(await syncer.join(island, replicas))

    async def pull(request: web.Request) -> web.Response:
        fragment = fragment_arg(request)
        try:
            after = int(request.query.get("after", "-1"))
            have = int(request.query.get("have", "-1"))
            wait = float(request.query.get("wait", "0"))
        except ValueError:
            raise Refused(400, "query after and have must be integers and wait a number") from None
        if not math.isfinite(wait) or wait < 0:
            raise Refused(400, f"query wait must be a number >= 0, got {wait}")
        body = await syncer.pull(fragment, after=after, wait=wait, have=have)
        if body is None:
            return web.Response(status=304)
        return web.Response(body=body, content_type=protocol.SAFETENSORS_CONTENT_TYPE)

    async def push(request: web.Request) -> web.Response:
        fragment = fragment_arg(request)
        try:
            body = await read_push_body(request, fragment)
            answer = await syncer.push(fragment, body)
        except Refused as err:
            syncer.metrics.pushes.labels(_REFUSAL_REASON.get(err.status, str(err.status))).inc()
            raise
        result = "accepted" if answer.get("accepted") else "finished"
        syncer.metrics.pushes.labels(result).inc()
        return web.json_response(answer)

    async def heartbeat(request: web.Request) -> web.Response:
        doc = await json_object(request, "heartbeat")
        island = _island_name(doc.get("island"), "heartbeat")
        step = _typed(doc, "step", "heartbeat", int, required=False) or 0
        tokens = _typed(doc, "tokens", "heartbeat", int, required=False) or 0
        loss = _typed(doc, "loss", "heartbeat", float, required=False)
        step_time = _typed(doc, "stepTime", "heartbeat", float, required=False)
        _at_least(step, 0, "heartbeat", "step")
        _at_least(tokens, 0, "heartbeat", "tokens")
        _at_least(step_time, 0, "heartbeat", "stepTime")
        answer = await syncer.heartbeat(
            island, step=step, tokens=tokens, loss=loss, step_time=step_time
        )
        return web.json_response(answer)

    async def leave(request: web.Request) -> web.Response:
        doc = await json_object(request, "leave")
        return web.json_response(await syncer.leave(_island_name(doc.get("island"), "leave")))

    async def membership(request: web.Request) -> web.Response:
        island = _island_name(request.match_info["island"], "path")
        doc = await json_object(request, "membership")
        state = _typed(doc, "state", "membership", str)
        if state not in protocol.ADMIN_STATES:
            raise Refused(
                400, f"membership.state must be one of {list(protocol.ADMIN_STATES)}, got {state!r}"
            )
        reason = _typed(doc, "reason", "membership", str, required=False) or ""
        return web.json_response(await syncer.set_membership(island, state, reason[:500]))

    async def status(request: web.Request) -> web.Response:
        digest = request.query.get("digest", "0") not in ("", "0", "false")
        return web.json_response(await syncer.status(digest=digest))

    async def healthz(request: web.Request) -> web.Response:
        if syncer.failure:
            return web.json_response({"ok": False, "error": syncer.failure}, status=503)
        return web.json_response({"ok": True})

    async def readyz(request: web.Request) -> web.Response:
        if syncer.failure:
            return web.json_response({"ready": False, "error": syncer.failure}, status=503)
        return web.json_response({"ready": True, "outerStep": syncer.state.outer_step})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(
            body=syncer.metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE}
        )

    async def on_startup(app: web.Application) -> None:
        await syncer.start()
        app[SCHEDULER_KEY] = asyncio.create_task(syncer.run_scheduler())

    async def on_shutdown(app: web.Application) -> None:
        syncer.close_waiters()

    async def on_cleanup(app: web.Application) -> None:
        task = app[SCHEDULER_KEY]
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await syncer.stop(timeout=SHUTDOWN_TIMEOUT)

    app = web.Application(middlewares=[errors, auth], client_max_size=JSON_LIMIT)
    app.router.add_post(protocol.ROUTE_JOIN, join)
    app.router.add_get(protocol.ROUTE_FRAGMENT, pull)
    app.router.add_post(protocol.ROUTE_PUSH, push)
    app.router.add_post(protocol.ROUTE_HEARTBEAT, heartbeat)
    app.router.add_post(protocol.ROUTE_LEAVE, leave)
    app.router.add_get(protocol.ROUTE_STATUS, status)
    app.router.add_put(protocol.ROUTE_ISLAND, membership)
    app.router.add_get(protocol.ROUTE_HEALTHZ, healthz)
    app.router.add_get(protocol.ROUTE_READYZ, readyz)
    app.router.add_get(protocol.ROUTE_METRICS, metrics)
    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    return app


def ssl_context(env: SyncerEnv) -> ssl.SSLContext | None:
    """The server's TLS context when the environment names a certificate and key."""
    if env.tls_cert_file is None or env.tls_key_file is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(env.tls_cert_file), str(env.tls_key_file))
    return ctx
