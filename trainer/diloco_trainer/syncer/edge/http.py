"""The syncer's HTTP edge: request parsing, bearer-token auth, routes and error bodies.

Thin by design: each route is a named handler of SyncerRoutes that parses and validates its input
(a bad field gets a 400 naming it; validation.py), then calls the service, whose Refused
exceptions become JSON errors {"error", "code"?} with their status (the `errors` middleware; a
Retry-After header with a 503 that has one). Bodies are read under the limits of limits.py
(size, time, concurrent pushes, JSON depth).
Routes and field names are in api/protocol.py. The handlers need only what SyncerService names,
so this module does not import the service (the service imports it to serve).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import payload, web
from aiohttp.abc import AbstractStreamWriter

from diloco_trainer.api import credentials, protocol
from diloco_trainer.api.contract import SyncerEnv
from diloco_trainer.api.credentials import Principal
from diloco_trainer.api.documents import MembershipRequest
from diloco_trainer.core.payloads import SplitBody
from diloco_trainer.syncer.edge.access import (
    PRINCIPAL,
    authenticate,
    principal_of,
    require_membership,
)
from diloco_trainer.syncer.edge.connections import mark_authenticated
from diloco_trainer.syncer.edge.limits import (
    PROBE_KEY,
    HttpLimits,
    Slots,
    push_share,
    read_body,
)
from diloco_trainer.syncer.errors import Refused
from diloco_trainer.syncer.intake import (
    MAX_REPLICAS,
    MAX_SECONDS,
    MAX_WIRE_INT,
    at_least,
    at_most,
    bounded_loss,
    island_name,
    json_too_deep,
    require_island,
    typed_field,
)
from diloco_trainer.syncer.state import CONTENT_TYPE as METRICS_CONTENT_TYPE
from diloco_trainer.syncer.state import Beat, Health, SyncerMetrics

log = logging.getLogger("diloco.syncer")

# Largest JSON body accepted on the small routes (join, heartbeat, leave, membership).
JSON_LIMIT = 64 * 1024
# Seconds the server waits for in-flight requests on SIGTERM (long-polls are answered at once).
SHUTDOWN_TIMEOUT = 10.0
# Seconds a stop waits for a running merge, scheduled jobs and the final checkpoint, each.
STOP_TIMEOUT = 60.0
SCHEDULER_KEY = web.AppKey("scheduler", asyncio.Task)

# The pushes metric's label for a refused push, by status.
REFUSAL_REASON = {
    400: "malformed",
    401: "unauthenticated",
    403: "forbidden",
    404: "unknown",
    408: "timeout",
    409: "stale",
    413: "too_large",
    503: "unavailable",
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# The longest `run` a pull may name (PushAnswer.run: service.Syncer.run, 16 hex digits).
MAX_RUN_CHARS = 64


# A full pull body's data is written this much at a time (SplitBodyPayload.write).
SEND_PIECE_BYTES = 4 * 2**20


class SplitBodyPayload(payload.Payload):
    """A SplitBody as aiohttp sends a body: its prefix, then its data's parts, with no copy
    joining them (the data is the syncer's published weights, P/F bytes, or the newest update's
    encoded tensors)."""

    _autoclose = True  # nothing to close: memory

    def __init__(self, value: SplitBody) -> None:
        super().__init__(value, content_type=protocol.SAFETENSORS_CONTENT_TYPE)
        self._body = value
        self._size = len(value)

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return bytes(self._body).decode(encoding, errors)

    async def as_bytes(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return bytes(self._body)

    async def write(self, writer: AbstractStreamWriter) -> None:
        # A piece at a time: the transport copies what the socket does not take at once into
        # its own buffer, and the writer drains it between pieces, so a pull holds at most a
        # piece of its body's bytes, not a second copy of them (P/F per puller).
        await writer.write(self._body.prefix)
        for data in self._body.parts:
            for start in range(0, data.nbytes, SEND_PIECE_BYTES):
                await writer.write(data[start : start + SEND_PIECE_BYTES])


class IslandRoutes(Protocol):
    """What the membership routes need (service/island_calls.IslandCalls)."""

    async def join(
        self, island: str, replicas: int, keeps_count: bool = False
    ) -> dict[str, Any]: ...

    async def heartbeat(self, island: str, progress: Beat) -> dict[str, Any]: ...

    async def leave(self, island: str) -> dict[str, Any]: ...

    async def set_membership(self, island: str, state: str, reason: str) -> dict[str, Any]: ...


class SyncerService(Protocol):
    """What the routes need of the syncer (service.Syncer)."""

    codec: str
    metrics: SyncerMetrics
    health: Health

    @property
    def islands(self) -> IslandRoutes: ...

    @property
    def failure(self) -> str | None: ...

    @property
    def outer_step(self) -> int: ...

    def push_limit(self, fragment: int) -> int: ...

    def region_islands(self, prefix: str) -> tuple[int, int]: ...

    async def pull(
        self, fragment: int, *, after: int, wait: float, have: int = -1, run: str = ""
    ) -> bytes | bytearray | memoryview | SplitBody | None: ...

    async def receive_push(
        self, fragment: int, body: bytes | bytearray, principal: Principal
    ) -> dict[str, Any]: ...

    def upload_started(self, fragment: int, island: str) -> float | None: ...

    def upload_ended(
        self, fragment: int, island: str, started: float, *, seconds: float | None
    ) -> None: ...

    async def status(self, *, digest: bool = False) -> dict[str, Any]: ...

    def fragment_merges(self, fragment: int, from_version: int = 0) -> dict[str, Any]: ...

    async def start(self) -> None: ...

    async def run_scheduler(self) -> None: ...

    def close_waiters(self) -> None: ...

    async def stop(
        self, timeout: float = 30.0, scheduler: asyncio.Task[None] | None = None
    ) -> None: ...


# ----- errors and request bodies ---------------------------------------------------------------


def error_response(status: int, message: str, code: str = "") -> web.Response:
    """The JSON error body {"error", "code"?} with `status`."""
    doc = {"error": message, "code": code} if code else {"error": message}
    return web.json_response(doc, status=status)


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refused and HTTP errors as JSON error bodies; anything else as a 500 (logged)."""
    try:
        return await handler(request)
    except Refused as err:
        resp = error_response(err.status, err.message, err.code)
        if err.retry_after is not None:
            resp.headers["Retry-After"] = str(max(1, round(err.retry_after)))
        if err.status == 408:
            resp.force_close()  # the rest of a slow body is not worth waiting for
        return resp
    except web.HTTPException as err:
        if err.status < 400:
            raise
        return error_response(err.status, err.reason or str(err))
    except Exception:
        log.exception("internal error on %s %s", request.method, request.path)
        return error_response(500, "internal error in the syncer; see its log")


async def read_limited(
    request: web.Request, limit: int, too_big: str, limits: HttpLimits
) -> bytearray:
    """The whole request body, refusing (413) more than `limit` bytes whether or not the client
    declared a Content-Length (a chunked body is counted as it arrives), and (408) a body that
    pauses or takes too long (limits.read_body; how long follows `limit`: HttpLimits.body_time)."""
    if request.content_length is not None and request.content_length > limit:
        raise Refused(413, too_big)
    return await read_body(
        request.content,
        limit,
        too_big,
        pause=limits.header_timeout,
        total=limits.body_time(limit),
        size=request.content_length,
    )


async def json_object(request: web.Request, route: str, limits: HttpLimits) -> dict[str, Any]:
    """The request's JSON object body (at most JSON_LIMIT bytes, nested at most
    limits.MAX_JSON_DEPTH deep); Refused(400/408/413) otherwise."""
    raw = bytes(
        await read_limited(request, JSON_LIMIT, f"{route} body exceeds {JSON_LIMIT} bytes", limits)
    )
    if json_too_deep(raw):
        raise Refused(400, f"{route} body is nested too deep to be a {route} request")
    try:
        doc = json.loads(raw)
    except ValueError as err:
        raise Refused(400, f"{route} body is not valid JSON: {err}") from None
    if not isinstance(doc, dict):
        raise Refused(400, f"{route} body must be a JSON object")
    return doc


def fragment_arg(request: web.Request) -> int:
    """The {fragment} of the path; Refused(404) unless it is a decimal number."""
    raw = request.match_info["fragment"]
    if not raw.isdigit():
        raise Refused(404, f"fragment {raw!r} does not exist")
    try:
        return int(raw)
    except ValueError:
        raise Refused(404, f"fragment {raw!r} does not exist") from None


# ----- routes ----------------------------------------------------------------------------------


class SyncerRoutes:
    """The syncer's route handlers and auth middleware, each callable alone."""

    def __init__(self, syncer: SyncerService, token: str, limits: HttpLimits | None = None) -> None:
        self.syncer = syncer
        self._root = token  # the job's root token: every credential is checked against it
        self.limits = limits or HttpLimits()
        self.push_slots = Slots(self.limits.max_pushes, "push bodies")

    @web.middleware
    async def auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Bearer-token auth on every route but the public probes; who the token speaks for
        (syncer/edge/access.py) is kept on the request for the routes that act as an island."""
        if request.path in protocol.PUBLIC_ROUTES:
            return await handler(request)
        header = request.headers.get("Authorization", "")
        if not header:
            raise Refused(401, "missing bearer token: send 'Authorization: Bearer <token>'")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise Refused(401, "malformed Authorization header: expected 'Bearer <token>'")
        request[PRINCIPAL] = authenticate(self._root, given.strip())
        mark_authenticated(request.transport)  # no longer the first to go (connections.py)
        return await handler(request)

    async def join(self, request: web.Request) -> web.Response:
        doc = await json_object(request, "join", self.limits)
        island = island_name(doc.get("island"), "join")
        require_island(principal_of(request), island, "join")
        replicas = typed_field(doc, "replicas", "join", int, required=False) or 1
        at_least(replicas, 1, "join", "replicas")
        at_most(replicas, MAX_REPLICAS, "join", "replicas")
        # Its learner joins again, counting on, because this run may lack its last join.
        keeps = typed_field(doc, "keepsCount", "join", bool, required=False) or False
        return web.json_response(await self.syncer.islands.join(island, replicas, keeps))

    async def pull(self, request: web.Request) -> web.Response:
        fragment = fragment_arg(request)
        try:
            after = int(request.query.get("after", "-1"))
            have = int(request.query.get("have", "-1"))
            wait = float(request.query.get("wait", "0"))
        except ValueError:
            raise Refused(400, "query after and have must be integers and wait a number") from None
        if not math.isfinite(wait) or wait < 0:
            raise Refused(400, f"query wait must be a number >= 0, got {wait}")
        run = request.query.get("run", "")
        if len(run) > MAX_RUN_CHARS:
            raise Refused(400, f"query run must be at most {MAX_RUN_CHARS} characters")
        began = time.monotonic()
        body = await self.syncer.pull(fragment, after=after, wait=wait, have=have, run=run)
        if body is None:
            return web.Response(status=304)
        # A full body or the one-update chain: its prefix, then its data as it is in memory.
        sent = SplitBodyPayload(body) if isinstance(body, SplitBody) else body
        held = {protocol.HEADER_HELD_SECONDS: f"{time.monotonic() - began:.6f}"}
        return web.Response(body=sent, content_type=protocol.SAFETENSORS_CONTENT_TYPE, headers=held)

    async def handle_push(self, request: web.Request) -> web.Response:
        """POST /v1/fragments/{f}/push: the body read under its limits, then the service's push
        path (Syncer.receive_push: who may push, the metadata, admission, guards, the round)."""
        fragment = fragment_arg(request)
        principal = principal_of(request)
        try:
            # Who may push, and how many bodies at once, before a slot is taken (limits.py).
            share = self._push_share(principal)
            with self.push_slots.take(principal, share):
                answer = await self._receive_push(request, fragment, principal)
        except Refused as err:
            named = err.code in (*protocol.CONTRIBUTION_REFUSALS, protocol.ERROR_BUSY)
            reason = err.code if named else REFUSAL_REASON.get(err.status, str(err.status))
            self.syncer.metrics.pushes.labels(reason).inc()
            raise
        result = "accepted" if answer.get("accepted") else "finished"
        self.syncer.metrics.pushes.labels(result).inc()
        return web.json_response(answer)

    async def _receive_push(
        self, request: web.Request, fragment: int, principal: Principal
    ) -> dict[str, Any]:
        """The body read and handed to the service, told to the rounds while it arrives: a
        merge at quorum waits a while for a push on its way (state/uploads.py). Only where
        nothing in the body is needed to know it: the verified credential is one island's own
        (it names the pusher; root, admin and region credentials may push as several) and the
        body declared a size within the fragment's limit (an oversized or undeclared one is
        refused or counted as it comes, and never told)."""
        limit = self.syncer.push_limit(fragment)  # Refused(404) for no such fragment
        declared = request.content_length
        started = None
        if principal.kind == credentials.ISLAND and declared is not None and declared <= limit:
            started = self.syncer.upload_started(fragment, principal.scope)
        if started is None:
            body = await self._read_push_body(request, fragment)
            return await self.syncer.receive_push(fragment, body, principal)
        began = time.monotonic()
        seconds = None
        try:
            body = await self._read_push_body(request, fragment)
            took = time.monotonic() - began
            answer = await self.syncer.receive_push(fragment, body, principal)
            if answer.get("accepted") and not answer.get("duplicate"):
                seconds = took
            return answer
        finally:
            self.syncer.upload_ended(fragment, principal.scope, started, seconds=seconds)

    def _push_share(self, principal: Principal) -> int:
        """limits.push_share, with a region's island records and the local islands."""
        if principal.kind != credentials.REGION:
            return push_share(principal, self.push_slots.size)
        region, local = self.syncer.region_islands(principal.scope)
        return push_share(principal, self.push_slots.size, region=region, local=local)

    async def _read_push_body(self, request: web.Request, fragment: int) -> bytearray:
        limit = self.syncer.push_limit(fragment)
        too_big = (
            f"push body for fragment {fragment} exceeds {limit} bytes, the most a "
            f"{self.syncer.codec}-encoded pseudo-gradient of this fragment can take"
        )
        return await read_limited(request, limit, too_big, self.limits)

    async def heartbeat(self, request: web.Request) -> web.Response:
        doc = await json_object(request, "heartbeat", self.limits)
        island = island_name(doc.get("island"), "heartbeat")
        require_island(principal_of(request), island, "heartbeat")
        step = typed_field(doc, "step", "heartbeat", int, required=False) or 0
        tokens = typed_field(doc, "tokens", "heartbeat", int, required=False) or 0
        loss = typed_field(doc, "loss", "heartbeat", float, required=False)
        step_time = typed_field(doc, "stepTime", "heartbeat", float, required=False)
        holding = typed_field(doc, "holding", "heartbeat", bool, required=False) or False
        drained = typed_field(doc, "drained", "heartbeat", bool, required=False) or False
        # A share of wall time (learner/step_costs.WaitMeter): finite (typed_field), in [0, 1].
        waiting = typed_field(doc, "waiting", "heartbeat", float, required=False)
        at_least(step, 0, "heartbeat", "step")
        at_least(tokens, 0, "heartbeat", "tokens")
        at_least(step_time, 0, "heartbeat", "stepTime")
        at_most(step, MAX_WIRE_INT, "heartbeat", "step")
        at_most(tokens, MAX_WIRE_INT, "heartbeat", "tokens")
        at_most(step_time, MAX_SECONDS, "heartbeat", "stepTime")  # the job's limit: islands
        at_least(waiting, 0, "heartbeat", "waiting")
        at_most(waiting, 1, "heartbeat", "waiting")
        bounded_loss(loss, "heartbeat")
        beat = Beat(
            step,
            tokens,
            loss=loss,
            step_time=step_time,
            holding=holding,
            drained=drained,
            waiting=waiting,
        )
        answer = await self.syncer.islands.heartbeat(island, beat)
        return web.json_response(answer)

    async def leave(self, request: web.Request) -> web.Response:
        doc = await json_object(request, "leave", self.limits)
        island = island_name(doc.get("island"), "leave")
        require_island(principal_of(request), island, "leave")
        return web.json_response(await self.syncer.islands.leave(island))

    async def membership(self, request: web.Request) -> web.Response:
        island = island_name(request.match_info["island"], "path")
        require_membership(principal_of(request), island)
        doc = await json_object(request, "membership", self.limits)
        state = typed_field(doc, "state", "membership", str)
        if state not in protocol.ADMIN_STATES:
            raise Refused(
                400, f"membership.state must be one of {list(protocol.ADMIN_STATES)}, got {state!r}"
            )
        reason = typed_field(doc, "reason", "membership", str, required=False) or ""
        wanted = MembershipRequest(state=state, reason=reason[:500])
        answer = await self.syncer.islands.set_membership(island, wanted.state, wanted.reason)
        return web.json_response(answer)

    async def status(self, request: web.Request) -> web.Response:
        digest = request.query.get("digest", "0") not in ("", "0", "false")
        return web.json_response(await self.syncer.status(digest=digest))

    async def fragment_merges(self, request: web.Request) -> web.Response:
        fragment = fragment_arg(request)
        try:
            from_version = int(request.query.get("from", "0"))
        except ValueError:
            raise Refused(400, "query from must be an integer (a version)") from None
        return web.json_response(self.syncer.fragment_merges(fragment, from_version))

    def probe(self, route: str, strict: bool) -> tuple[int, dict[str, Any]]:
        """A probe's answer, (status, document), for its route: the routes below, and a
        connection that found no room (connections._Busy), answer the same.

        /healthz: 503 when the syncer failed (a restart is needed). Problems a restart does not
        fix (checkpoints failing: a restart would lose what was merged since the last one) are
        listed with 200, or 503 with ?strict=1 (for monitoring rather than liveness).
        /readyz: 503 when the syncer failed, else ready with its outer step."""
        failure = self.syncer.failure
        if route == protocol.ROUTE_READYZ:
            if failure:
                return 503, {"ready": False, "error": failure}
            return 200, {"ready": True, "outerStep": self.syncer.outer_step}
        if failure:
            return 503, {"ok": False, "error": failure}
        health = self.syncer.health.to_json()
        if health["healthy"]:
            return 200, {"ok": True}
        return (503 if strict else 200), {"ok": True, **health}

    async def healthz(self, request: web.Request) -> web.Response:
        strict = request.query.get("strict", "0") not in ("", "0", "false")
        status, doc = self.probe(protocol.ROUTE_HEALTHZ, strict)
        return web.json_response(doc, status=status)

    async def readyz(self, request: web.Request) -> web.Response:
        status, doc = self.probe(protocol.ROUTE_READYZ, False)
        return web.json_response(doc, status=status)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.syncer.metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE}
        )

    # ----- the application's life ----------------------------------------------------------------

    async def on_startup(self, app: web.Application) -> None:
        await self.syncer.start()
        app[SCHEDULER_KEY] = asyncio.create_task(self.syncer.run_scheduler())

    async def on_shutdown(self, app: web.Application) -> None:
        self.syncer.close_waiters()

    async def on_cleanup(self, app: web.Application) -> None:
        # The scheduler stops once a running merge has finished; then the final checkpoint.
        await self.syncer.stop(timeout=STOP_TIMEOUT, scheduler=app[SCHEDULER_KEY])


def build_app(
    syncer: SyncerService, token: str, limits: HttpLimits | None = None
) -> web.Application:
    """The aiohttp application serving `syncer` behind bearer-token auth."""
    routes = SyncerRoutes(syncer, token, limits)
    app = web.Application(middlewares=[errors, routes.auth], client_max_size=JSON_LIMIT)
    app.router.add_post(protocol.ROUTE_JOIN, routes.join)
    app.router.add_get(protocol.ROUTE_FRAGMENT, routes.pull)
    app.router.add_post(protocol.ROUTE_PUSH, routes.handle_push)
    app.router.add_get(protocol.ROUTE_MERGES, routes.fragment_merges)
    app.router.add_post(protocol.ROUTE_HEARTBEAT, routes.heartbeat)
    app.router.add_post(protocol.ROUTE_LEAVE, routes.leave)
    app.router.add_get(protocol.ROUTE_STATUS, routes.status)
    app.router.add_put(protocol.ROUTE_ISLAND, routes.membership)
    app.router.add_get(protocol.ROUTE_HEALTHZ, routes.healthz)
    app.router.add_get(protocol.ROUTE_READYZ, routes.readyz)
    app.router.add_get(protocol.ROUTE_METRICS, routes.metrics)
    app[PROBE_KEY] = routes.probe  # also answered to connections that find no room
    app.on_startup.append(routes.on_startup)
    app.on_shutdown.append(routes.on_shutdown)
    app.on_cleanup.append(routes.on_cleanup)
    return app


def ssl_context(env: SyncerEnv) -> ssl.SSLContext | None:
    """The server's TLS context when the environment names a certificate and key."""
    if env.tls_cert_file is None or env.tls_key_file is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(env.tls_cert_file), str(env.tls_key_file))
    return ctx
