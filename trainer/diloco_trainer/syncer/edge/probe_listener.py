"""The syncer's probe listener: /healthz and /readyz on a port of their own (SYNCER_HEALTH_PORT),
answered by a thread with its own event loop, so no traffic on the syncer port can delay them.

Why: on the syncer port a probe's connection waits in the kernel's accept queue behind every
connection that arrived before it, and the event loop accepts them in order (each costs Python
work: a protocol, a transport, the ConnectionCap's count). A flood of 4 addresses x 1,000
connections on 2 busy cores held probes there for up to 1.02 s although every one was answered
(bench/log/2026-11-29.md, "healthz_flood — 2026-11-29 00:01 UTC"). This listener's queue holds
only probes, and its thread takes the interpreter lock within the syncer's switch interval.

What it answers: the syncer port's answer for the route (SyncerRoutes.probe: its reads are of
attributes the event loop replaces whole, safe from another thread), except that an event loop
that has not turned for LOOP_STALL_SECONDS fails both probes (503, code "loop_stalled"): a hung
loop fails liveness here as a probe on the syncer port would by timing out. Any other path: 404.
Each connection gets one answer and is closed; one whose request line has not come within
PROBE_WAIT seconds is closed unanswered, and at most MAX_OPEN are open at once, so idle
connections hold none of it for long. The one that goes to make room is the oldest of the network
prefix (limits.prefix_of: /24, /64) holding the most open connections, not the oldest of all:
a churn of connections from a pod's address (open, never send, open the next, thousands a
second) closed the kubelet's probe connections before their request was read, 19 of 23 probes
(audit of 2026-12-01, docs/adversaries.md); now a flood closes its own first, and the
kubelet's, one connection from the node's address, goes only once no prefix holds more. (What
the churn still costs is CPU: every connection is accepted in Python, so probes wait behind it;
docs/adversaries.md, "Audit of 2026-12-01", has the figures.) The job's NetworkPolicy (when on,
operator resources/security.py) lets only the job's own pods reach this port and the Service
does not carry it: the kubelet probes from the node.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from diloco_trainer.api import protocol
from diloco_trainer.syncer.edge.limits import (
    PROBE_WAIT,
    Probe,
    prefix_of,
    probe_response,
)

log = logging.getLogger("diloco.syncer")

# Seconds the syncer's event loop may go without turning before the probes fail: the kubelet's
# probe timeout (operator resources/syncer.py PROBE_TIMEOUT_SECONDS), past which a probe on the
# syncer port would have failed too.
LOOP_STALL_SECONDS = 5.0
# Connections the probe listener keeps open at once, and queues for accept.
MAX_OPEN = 64
BACKLOG = 64


class _Prefixed(Protocol):
    prefix: str


_C = TypeVar("_C", bound=_Prefixed)
_NOT_FOUND = {"error": "the probe port serves /healthz and /readyz only", "code": "not_found"}


def probe_answer(
    probe: Probe, route: str, strict: bool, loop_idle: float
) -> tuple[int, dict[str, Any]]:
    """(status, document) for a GET of `route` on the probe port, the syncer's event loop having
    last turned `loop_idle` seconds ago: the route's own answer, 503 when the loop has stalled
    for more than LOOP_STALL_SECONDS, 404 for a route that is no probe."""
    if route not in protocol.PUBLIC_ROUTES:
        return 404, dict(_NOT_FOUND)
    if loop_idle > LOOP_STALL_SECONDS:
        why = f"the syncer's event loop has not turned for {loop_idle:.1f}s"
        key = "ready" if route == protocol.ROUTE_READYZ else "ok"
        return 503, {key: False, "error": why, "code": "loop_stalled"}
    return probe(route, strict)


def request_target(line: bytes) -> tuple[str, bool] | None:
    """(route, strict) of a GET request line; None for anything else."""
    parts = line.split()
    if len(parts) < 2 or parts[0] != b"GET":
        return None
    route, _, query = parts[1].decode("latin-1").partition("?")
    strict = any(
        q.startswith("strict=") and q[7:] not in ("", "0", "false") for q in query.split("&")
    )
    return route, strict


def make_room(open_: dict[_C, None], per_prefix: Counter[str]) -> _C:
    """The connection to close when one too many are open (`open_` oldest first, each with a
    `prefix`): the oldest of the prefix holding the most, so a flood from one network closes
    its own before anybody else's (of equal counts, the prefix of the oldest connection)."""
    most = max(per_prefix.values())
    return next(c for c in open_ if per_prefix[c.prefix] == most)


class _ProbeConnection(asyncio.Protocol):
    """One probe: its request line within PROBE_WAIT is answered, then the connection closed."""

    def __init__(self, listener: HealthListener) -> None:
        self.listener = listener
        self.transport: asyncio.WriteTransport | None = None
        self.head = b""
        self.timer: asyncio.TimerHandle | None = None
        self.prefix = ""  # the peer's network (limits.prefix_of): whom it makes room with

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.prefix = prefix_of(str(peer[0])) if isinstance(peer, tuple) and peer else ""
        self.listener.opened(self)
        self.timer = asyncio.get_running_loop().call_later(self.listener.wait, self.close)

    def data_received(self, data: bytes) -> None:
        self.head += data
        if b"\n" not in self.head and len(self.head) <= 1024:
            return
        target = request_target(self.head.split(b"\n", 1)[0])
        if target is None:
            answer = probe_response(400, {"error": "not a GET request", "code": "bad_request"})
        else:
            answer = probe_response(*self.listener.answer(*target))
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(answer)
        self.close()

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.listener.closed(self)


class HealthListener:
    """The probe listener's thread and event loop. `start` binds (OSError when the port is taken)
    and returns once it listens; `beat` is called on the syncer's event loop (limits.serve)."""

    def __init__(
        self,
        probe: Probe,
        host: str,
        port: int,
        *,
        ssl_context: ssl.SSLContext | None = None,
        clock: Callable[[], float] = time.monotonic,
        wait: float = PROBE_WAIT,
    ) -> None:
        self.probe, self.host, self.port, self.ssl_context = probe, host, port, ssl_context
        self.clock = clock
        self.wait = wait  # seconds a connection has to send its request line
        self.last_beat = clock()
        self.open: dict[_ProbeConnection, None] = {}  # oldest first
        self.per_prefix: Counter[str] = Counter()  # open connections per network prefix
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self._stopped: asyncio.Event | None = None

    def beat(self) -> None:
        """The syncer's event loop turned (a float assignment: atomic for the reading thread)."""
        self.last_beat = self.clock()

    def answer(self, route: str, strict: bool) -> tuple[int, dict[str, Any]]:
        return probe_answer(self.probe, route, strict, self.clock() - self.last_beat)

    def opened(self, conn: _ProbeConnection) -> None:
        self.open[conn] = None
        self.per_prefix[conn.prefix] += 1
        if len(self.open) > MAX_OPEN:  # forgotten now: the next one over closes the next oldest
            victim = make_room(self.open, self.per_prefix)
            self._forget(victim)
            victim.close()

    def closed(self, conn: _ProbeConnection) -> None:
        self._forget(conn)

    def _forget(self, conn: _ProbeConnection) -> None:
        if self.open.pop(conn, False) is None:
            self.per_prefix[conn.prefix] -= 1
            if self.per_prefix[conn.prefix] <= 0:
                del self.per_prefix[conn.prefix]

    def start(self) -> None:
        ready: list[BaseException | None] = []
        started = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self.loop = loop
            try:
                loop.run_until_complete(self._serve(ready, started))
            except BaseException as err:  # a bind error goes to start()'s caller
                if not started.is_set():
                    ready.append(err)
                    started.set()
                else:
                    log.exception("the probe listener stopped")
            finally:
                loop.close()

        self.thread = threading.Thread(target=run, name="probe-listener", daemon=True)
        self.thread.start()
        started.wait()
        if ready and ready[0] is not None:
            raise ready[0]

    async def _serve(self, ready: list[BaseException | None], started: threading.Event) -> None:
        loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        server = await loop.create_server(
            lambda: _ProbeConnection(self),
            self.host,
            self.port,
            ssl=self.ssl_context,
            ssl_handshake_timeout=self.wait if self.ssl_context else None,
            reuse_address=True,
            backlog=BACKLOG,
        )
        ready.append(None)
        started.set()
        async with server:
            await self._stopped.wait()

    def stop(self) -> None:
        """Stop listening and end the thread."""
        loop, stopped = self.loop, self._stopped
        if loop is not None and stopped is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(stopped.set)
        if self.thread is not None:
            self.thread.join(timeout=5)
