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
prefix (connections.prefix_of: /24, /64) holding the most open connections, not the oldest of all:
a churn of connections from a pod's address (open, never send, open the next, thousands a
second) closed the kubelet's probe connections before their request was read, 19 of 23 probes
(audit of 2026-12-01, docs/adversaries.md); now a flood closes its own first, and the
kubelet's, one connection from the node's address, goes only once no prefix holds more. (What
the churn then cost was time: the probes waited behind it, up to 4-10 s; the accept path below
bounds that, docs/adversaries.md, "Audit of 2026-12-01".) The job's NetworkPolicy (when on,
operator resources/security.py) lets only the job's own pods reach this port and the Service
does not carry it: the kubelet probes from the node.

How it accepts: its own accept loop on the listening socket, not asyncio's server (which makes a
task, a transport and a protocol for every connection before anything is known of it), so that
what a churn of connections costs is bounded before that work (take_accepted):
- the socket defers accepts until a connection's first bytes are in (TCP_DEFER_ACCEPT, Linux:
  edge/sockets.py, as the syncer port's), so
  the kubelet's probe is accepted with its request and answered on the spot, with no transport,
  timer or further wake-up; one closed before it sent anything is closed at once;
- a connection still silent (past the deferral, or where there is none) or with part of a request
  line is served as before, unless its network prefix (connections.prefix_of) had ACCEPT_BUDGET such
  within the last ACCEPT_WINDOW, or all prefixes together TOTAL_ACCEPT_BUDGET: then it is closed
  at once, unread (AcceptBudget). A prefix, or many, churning connections that never send (or
  send a byte and no more) cost the listener an accept and a close each, and the kubelet's
  probe, whose request is in when it is accepted, is answered whatever its prefix.
  Under TLS the request cannot be read before the handshake: every connection that has not
  closed is under the budgets, so there a churn from many prefixes can shed the kubelet's.
  Under the audit's churn (4 /24s) probes took up to 0.108 s against main's 5.2-10.0 s
  (bench/log/2026-12-01.md, "healthz_flood --churn").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from diloco_trainer.api import protocol
from diloco_trainer.syncer.edge.connections import (
    PROBE_WAIT,
    Probe,
    prefix_of,
    probe_response,
)
from diloco_trainer.syncer.edge.sockets import (
    REMEMBERED_PREFIXES,
    AcceptBudget,
    accept_queued,
    listening_sockets,
)

log = logging.getLogger("diloco.syncer")

# Seconds the syncer's event loop may go without turning before the probes fail: the kubelet's
# probe timeout (operator resources/syncer.py PROBE_TIMEOUT_SECONDS), past which a probe on the
# syncer port would have failed too.
LOOP_STALL_SECONDS = 5.0
# Connections the probe listener keeps open at once.
MAX_OPEN = 64
# Connections the kernel queues for accept (capped by net.core.somaxconn), and at most accepted a
# turn of the loop: under the audit's churn (4 /24s, ~15,000 connections a second) a queue of 64
# overflowed and the kubelet's connection was dropped (its retries come after 1 s, then 3 s);
# with each churning connection an accept and a close (take_accepted) a queue of 1024 drains
# within tens of milliseconds. With asyncio's accept (main before issue 46's fix) a longer queue
# only made probes wait longer (bench/log/2026-12-01.md, "healthz_flood --churn").
BACKLOG = 1024
# Connections of one network prefix served within ACCEPT_WINDOW seconds without a whole request
# line when accepted (AcceptBudget): half of MAX_OPEN, so a churning prefix holds at most half the
# listener's room; the kubelet sends a few probes a period, each accepted with its request.
ACCEPT_BUDGET = 32
ACCEPT_WINDOW = 1.0
# Such connections of all prefixes together served within ACCEPT_WINDOW (AcceptBudget under the
# key ALL_PREFIXES, counted after a prefix's own budget admits one): the bound per prefix holds
# a churn from a few networks, not from many (audit46, the repeat audit of 2026-12-01: one-byte
# connections from 64 /24s, 32 served a second each, held the kubelet's probe in the accept queue
# for up to 5 s; 8 /24s, 256 a second, were within 1.1 s at the same load). A probe whose
# request is in when it is accepted is answered before either budget is read.
TOTAL_ACCEPT_BUDGET = 4 * ACCEPT_BUDGET
ALL_PREFIXES = "*"
# Bytes read of a connection when it is accepted: a probe's request line fits (request_target).
HEAD_BYTES = 1024


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


def whole_request(head: bytes) -> bool:
    """Whether `head` (a connection's first bytes) is as much of a request as the listener
    reads: a line end, or HEAD_BYTES without one (answered 400 then)."""
    return b"\n" in head or len(head) >= HEAD_BYTES


def answer_head(listener: HealthListener, head: bytes) -> bytes:
    """The whole HTTP answer to a request whose first line is in `head`."""
    target = request_target(head.split(b"\n", 1)[0])
    if target is None:
        return probe_response(400, {"error": "not a GET request", "code": "bad_request"})
    return probe_response(*listener.answer(*target))


class _ProbeConnection(asyncio.Protocol):
    """One probe: its request line within PROBE_WAIT is answered, then the connection closed."""

    def __init__(self, listener: HealthListener, head: bytes = b"") -> None:
        self.listener = listener
        self.transport: asyncio.WriteTransport | None = None
        self.head = head  # what was read of it when it was accepted
        self.timer: asyncio.TimerHandle | None = None
        self.prefix = ""  # the peer's network (connections.prefix_of): whom it makes room with

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        self.transport = transport
        self.prefix = self.listener.prefix(transport.get_extra_info("peername"))
        self.listener.opened(self)
        self.timer = asyncio.get_running_loop().call_later(self.listener.wait, self.close)

    def data_received(self, data: bytes) -> None:
        self.head += data
        if not whole_request(self.head):
            return
        answer = answer_head(self.listener, self.head)
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
        accept_budget: int = ACCEPT_BUDGET,
        accept_window: float = ACCEPT_WINDOW,
        total_accept_budget: int = TOTAL_ACCEPT_BUDGET,
    ) -> None:
        self.probe, self.host, self.port, self.ssl_context = probe, host, port, ssl_context
        self.clock = clock  # the probe answers' clock (the loop's beats)
        self.wait = wait  # seconds a connection has to send its request line
        self.budget = AcceptBudget(accept_budget, accept_window)
        self.total_budget = AcceptBudget(total_accept_budget, accept_window)
        self.prefixes: dict[str, str] = {}  # peer address -> its network prefix
        self.answered_at_accept = 0  # connections answered as they were accepted
        self.shed = 0  # closed unread, their prefix (or all prefixes) past its AcceptBudget
        self._adopting: set[asyncio.Task[None]] = set()
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

    def prefix(self, peer: Any) -> str:
        """The network prefix of a peer address (connections.prefix_of, remembered: a churn of one
        address would parse it thousands of times a second)."""
        address = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        prefix = self.prefixes.get(address)
        if prefix is None:
            if len(self.prefixes) >= REMEMBERED_PREFIXES:
                self.prefixes.clear()
            prefix = self.prefixes[address] = prefix_of(address)
        return prefix

    def take_accepted(self, conn: socket.socket, peer: Any) -> None:
        """A connection just accepted (the module docstring's order): closed at once when it
        has closed already, answered at once when its request line is in, closed unread when
        its prefix is past its AcceptBudget or all prefixes together past theirs (read only
        for a connection its own prefix's budget admits, so a churning prefix's shed ones use
        none of the others' room), else served by a _ProbeConnection."""
        conn.setblocking(False)
        try:  # under TLS the bytes are the handshake's: peeked at, left for it
            head = conn.recv(HEAD_BYTES, socket.MSG_PEEK if self.ssl_context else 0)
        except (BlockingIOError, InterruptedError):
            head = None  # nothing sent yet
        except OSError:
            head = b""  # reset
        if head == b"":
            conn.close()
            return
        if head is not None and self.ssl_context is None and whole_request(head):
            with contextlib.suppress(OSError):  # the answer fits an empty send buffer
                conn.send(answer_head(self, head))
            conn.close()
            self.answered_at_accept += 1
            return
        now = time.monotonic()
        if not (
            self.budget.admit(self.prefix(peer), now) and self.total_budget.admit(ALL_PREFIXES, now)
        ):
            self.shed += 1
            conn.close()
            return
        read = b"" if self.ssl_context or head is None else head  # TLS bytes were only peeked
        task = asyncio.get_running_loop().create_task(self._adopt(conn, read))
        self._adopting.add(task)
        task.add_done_callback(self._adopting.discard)

    async def _adopt(self, conn: socket.socket, head: bytes) -> None:
        """Serve `conn` (`head`: what was read of it) with a _ProbeConnection."""
        try:
            await asyncio.get_running_loop().connect_accepted_socket(
                lambda: _ProbeConnection(self, head),
                conn,
                ssl=self.ssl_context,
                ssl_handshake_timeout=self.wait if self.ssl_context else None,
            )
        except (OSError, ssl.SSLError, TimeoutError) as err:  # gone, or a failed handshake
            log.debug("a probe connection failed before it was served: %s", err)
            conn.close()

    def _accept(self, sock: socket.socket) -> None:
        accept_queued(sock, BACKLOG, self.take_accepted, "the probe listener")

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
        socks = listening_sockets(self.host, self.port, backlog=BACKLOG)
        ready.append(None)
        started.set()
        try:
            for sock in socks:
                loop.add_reader(sock.fileno(), self._accept, sock)
            await self._stopped.wait()
        finally:
            for sock in socks:
                loop.remove_reader(sock.fileno())
                sock.close()
            for task in list(self._adopting):
                task.cancel()
            for conn in list(self.open):
                conn.close()

    def stop(self) -> None:
        """Stop listening and end the thread."""
        loop, stopped = self.loop, self._stopped
        if loop is not None and stopped is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(stopped.set)
        if self.thread is not None:
            self.thread.join(timeout=5)
