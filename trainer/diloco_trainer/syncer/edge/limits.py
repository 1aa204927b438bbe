"""What the syncer's HTTP server allows any client (syncer.limits): time, connections, memory.

- Headers: a request's headers must arrive within headerTimeoutSeconds of the connection opening
  or of its previous response (aiohttp's keep-alive timer, which closes a connection whose next
  request has not been parsed by then; idle keep-alive connections close then too). A TLS
  handshake gets as long.
- Bodies (read_body): no pause longer than headerTimeoutSeconds, and the whole body within
  bodyTimeoutSeconds, else 408 and the connection is closed: a client trickling one byte every
  few seconds cannot hold a connection and its buffer for ever.
- Connections (connections.ConnectionCap): at most maxConnections at once, whom it replaces
  to make room and whom it refuses (connections.py).
- Push bodies (Slots): at most maxConcurrentPushes read at once (each up to a fragment's encoded
  size), and at most push_share of them for one credential (an island's: PUSHES_PER_ISLAND, so
  one island trickling bodies cannot hold every slot; a region's: PUSHES_PER_ISLAND x the island
  records it holds, never the local islands' slots); one more is answered 503 with Retry-After
  before its body is read. The learners' client retries 503s.
- JSON (json_too_deep): bodies nested deeper than MAX_JSON_DEPTH are refused (400) before they
  are parsed (Python's parser would raise RecursionError, a 500).

`serve` runs the application like aiohttp's run_app, on a GuardedSite.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web
from aiohttp.streams import StreamReader

from diloco_trainer.api import credentials, protocol
from diloco_trainer.api.credentials import Principal
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.syncer.edge.connections import (
    UNAUTHENTICATED_SECONDS,
    ConnectionCap,
    Probe,
    prefix_of,
)
from diloco_trainer.syncer.edge.sockets import (
    DEFER_ACCEPT_SECONDS,
    AcceptLanes,
    DeferredAcceptServer,
    handshake_budget,
    laned_sockets,
)
from diloco_trainer.syncer.errors import Refused

log = logging.getLogger("diloco.syncer")
# Connections the kernel queues for accept (capped by net.core.somaxconn): a burst of new
# connections beyond it has its SYNs dropped, and a probe among them retries only after a second.
LISTEN_BACKLOG = 4096
# How often serve's event loop tells a ProbeListener that it turns (seconds).
BEAT_SECONDS = 0.5
PROBE_KEY: web.AppKey[Probe] = web.AppKey("probe")
# Push bodies one island's credential may have read at once: two fragments' pushes overlapping
# (the 'auto' maxConcurrentPushes has room for two per island).
PUSHES_PER_ISLAND = 2
# Seconds a client is asked to wait when the syncer is at one of its limits.
BUSY_RETRY_AFTER = 2.0


@dataclass(frozen=True)
class HttpLimits:
    """syncer.limits, resolved."""

    header_timeout: float = 30.0
    body_timeout: float = 600.0
    max_connections: int = 512
    max_pushes: int = 8
    min_body_rate: float = 4 * 2**20  # bytes a second (syncer.limits.minBodyBytesPerSecond)

    def body_time(self, limit: int) -> float:
        """Seconds a body of up to `limit` bytes may take: bodyTimeoutSeconds, or longer when
        the body is so large that the slowest allowed transfer needs longer."""
        return max(self.body_timeout, limit / self.min_body_rate)

    @classmethod
    def from_spec(cls, spec: JobSpec) -> HttpLimits:
        lim = spec.syncer.limits
        pushes = lim.max_concurrent_pushes
        return cls(
            header_timeout=lim.header_timeout_seconds,
            body_timeout=lim.body_timeout_seconds,
            max_connections=lim.max_connections,
            max_pushes=2 * spec.total_shards() + 2 if pushes == "auto" else int(pushes),
            min_body_rate=float(lim.min_body_bytes_per_second),
        )


def push_share(principal: Principal, size: int, *, region: int = 0, local: int = 0) -> int:
    """The push slots of `size` one credential may hold: an island's PUSHES_PER_ISLAND; a
    region's PUSHES_PER_ISLAND x the island records it holds (`region`, at least one island's:
    admission.py bounds them by its fair share of the other regions' records), and never the
    PUSHES_PER_ISLAND x `local` slots of the syncer's own islands (`local`: 0 when the region is
    the syncer's own prefix), at least 1; the root's all. Refused(403) for a credential that may
    push as no island (admin): checked before a slot is taken, so it cannot hold one."""
    if principal.kind == credentials.ROOT:
        return size
    if principal.kind == credentials.ISLAND:
        return min(PUSHES_PER_ISLAND, size)
    if principal.kind == credentials.REGION:
        own = PUSHES_PER_ISLAND * max(1, region)
        return max(1, min(own, size - PUSHES_PER_ISLAND * local))
    raise Refused(403, f"{principal.describe()} may not push")


async def read_body(
    content: StreamReader,
    limit: int,
    too_big: str,
    *,
    pause: float,
    total: float,
    size: int | None = None,
) -> bytearray:
    """A request body of at most `limit` bytes (413 `too_big` beyond), each chunk within `pause`
    seconds and all of it within `total` (408 otherwise). With its declared `size`
    (Content-Length, at most `limit`) the chunks are copied into one buffer of that size as they
    come: no growing buffer copied as it grows, and the buffer itself is the body (no copy
    of it at the end)."""
    if size is not None and 0 <= size <= limit:
        return await _read_sized(content, size, pause=pause, total=total)
    buf = bytearray()
    deadline = time.monotonic() + total
    while chunk := await _chunk(content, len(buf), pause=pause, total=total, deadline=deadline):
        buf += chunk
        if len(buf) > limit:
            raise Refused(413, too_big)
    return buf


async def _chunk(
    content: StreamReader, got: int, *, pause: float, total: float, deadline: float
) -> bytes:
    """The next chunk of a body (b"" at its end), under read_body's time limits."""
    left = deadline - time.monotonic()
    try:
        async with asyncio.timeout(max(0.0, min(pause, left))):
            return await content.readany()
    except TimeoutError:
        why = "paused too long" if left > pause else f"took longer than {total:g}s"
        raise Refused(408, f"request body {why} (syncer.limits)", protocol.ERROR_TIMEOUT) from None
    except ConnectionResetError:
        # The client went away (a learner stopped or timed out): nothing the syncer did
        # wrong, and nobody to answer; a line, not an internal error with a traceback.
        log.info("a client closed its connection after %d bytes of its body", got)
        raise Refused(400, "the client closed the connection before its body ended") from None


async def _read_sized(content: StreamReader, size: int, *, pause: float, total: float) -> bytearray:
    """read_body of a body that declared its size: each chunk copied into place."""
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    deadline = time.monotonic() + total
    while chunk := await _chunk(content, got, pause=pause, total=total, deadline=deadline):
        if got + len(chunk) > size:
            raise Refused(400, f"request body is longer than its Content-Length ({size})")
        view[got : got + len(chunk)] = chunk
        got += len(chunk)
    if got != size:
        raise Refused(400, f"request body ended after {got} of its {size} bytes")
    return buf


class Slots:
    """At most `size` of something at once, and at most `most` of them for one owner (one event
    loop: no lock needed)."""

    def __init__(self, size: int, what: str) -> None:
        self.size = size
        self.what = what
        self.used = 0
        self.owners: dict[Hashable, int] = {}  # slots held per owner; only owners holding one

    @contextlib.contextmanager
    def take(self, owner: Hashable = None, most: int | None = None) -> Iterator[None]:
        """Hold a slot; Refused(503, busy, Retry-After) when none is free, or `owner` holds
        `most` already."""
        held = self.owners.get(owner, 0)
        if self.used >= self.size or (most is not None and held >= most):
            mine = f" ({held} of them for this credential, its most)" if held else ""
            raise Refused(
                503,
                f"the syncer is reading {self.used} {self.what} already{mine} (syncer.limits); "
                "retry",
                protocol.ERROR_BUSY,
                retry_after=BUSY_RETRY_AFTER,
            )
        self.used += 1
        self.owners[owner] = held + 1
        try:
            yield
        finally:
            self.used -= 1
            left = self.owners[owner] - 1
            if left:
                self.owners[owner] = left
            else:
                del self.owners[owner]


class ProbeListener(Protocol):
    """What serve runs beside the site (edge/probe_listener.py's HealthListener)."""

    port: int

    def start(self) -> None: ...
    def beat(self) -> None: ...
    def stop(self) -> None: ...


class GuardedSite(web.BaseSite):
    """A TCP site whose connections go through a ConnectionCap, with a TLS handshake timeout."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        limits: HttpLimits,
        ssl_context: ssl.SSLContext | None = None,
        defer_accept_seconds: int = DEFER_ACCEPT_SECONDS,
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context)
        self.host, self.port, self.limits = host, port, limits
        self.defer_accept_seconds = defer_accept_seconds  # 0: accepted as they connect
        self.cap: ConnectionCap | None = None
        self.lanes: AcceptLanes | None = None

    @property
    def name(self) -> str:
        return f"{'https' if self._ssl_context else 'http'}://{self.host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        app = getattr(self._runner, "app", None)
        self.cap = ConnectionCap(
            server,
            self.limits.max_connections,
            probe=app.get(PROBE_KEY) if app is not None else None,
            unauthenticated_seconds=min(UNAUTHENTICATED_SECONDS, self.limits.header_timeout),
        )
        # Sockets of our own, accepts deferred until a connection's first bytes, and an accept
        # loop that closes a connection its peer closed already unserved (edge/sockets.py: a
        # silent churn costs an accept and a close each, not a transport; audit46).
        socks, lanes = laned_sockets(
            self.host, self.port, backlog=LISTEN_BACKLOG, defer_seconds=self.defer_accept_seconds
        )
        # A prefix that authenticated is queued by the kernel in the known accept lane, where no
        # churn of others fills the queue (edge/sockets.py).
        self.cap.on_authenticated = lanes.known
        self.lanes = lanes
        self._server = DeferredAcceptServer(
            socks,
            self.cap,
            backlog=LISTEN_BACKLOG,
            take=self.cap.take,
            ssl_context=self._ssl_context,
            ssl_handshake_timeout=self.limits.header_timeout if self._ssl_context else None,
            admit=handshake_budget(prefix_of) if self._ssl_context else None,
            lanes=lanes,
        )


class ListenError(Exception):
    """The syncer could not bind its port or its probe port (taken, not permitted): said in one
    line and exit 1 by the command (edge/server.py), not a traceback."""


def serve(
    app: web.Application,
    *,
    host: str,
    port: int,
    limits: HttpLimits,
    ssl_context: ssl.SSLContext | None,
    shutdown_timeout: float,
    probes: ProbeListener | None = None,
) -> None:
    """Run `app` until SIGTERM/SIGINT (as aiohttp's run_app does) on a GuardedSite; the
    keep-alive timeout is the header timeout. `probes` (edge/probe_listener.py), when given, starts
    listening once the site does (after the application's startup, as the site) and is told
    every BEAT_SECONDS that this event loop turns."""
    runner = web.AppRunner(
        app,
        handle_signals=True,
        shutdown_timeout=shutdown_timeout,
        access_log=None,
        keepalive_timeout=limits.header_timeout,
    )

    async def main() -> None:
        await runner.setup()
        try:
            try:
                site = GuardedSite(runner, host, port, limits=limits, ssl_context=ssl_context)
                await site.start()
            except OSError as err:
                raise ListenError(f"cannot listen on {host}:{port}: {err.strerror or err}") from err
            if probes is not None:
                try:
                    probes.start()
                except OSError as err:
                    raise ListenError(
                        f"cannot listen on {host}:{probes.port} (the probe port,"
                        f" DILOCO_SYNCER_HEALTH_PORT): {err.strerror or err}"
                    ) from err
            while True:
                if probes is not None:
                    probes.beat()
                await asyncio.sleep(BEAT_SECONDS if probes is not None else 3600)
        finally:
            if probes is not None:
                probes.stop()
            await runner.cleanup()

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    task = loop.create_task(main())
    try:
        loop.run_until_complete(task)
    except (web.GracefulExit, KeyboardInterrupt):
        pass
    finally:
        try:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    loop.run_until_complete(task)
        finally:
            left = asyncio.all_tasks(loop)
            for t in left:
                t.cancel()
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
