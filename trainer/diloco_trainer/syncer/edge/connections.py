"""Who gets a connection to the syncer's port (syncer.limits.maxConnections): the connection cap.

At most maxConnections at once, admitted as they are accepted, before any transport
(ConnectionCap.take; under TLS a prefix starts at most 32 handshakes a second, sockets.py), and
counted through a TLS handshake. Accepts wait for a connection's first bytes (or about a
second), and one its peer closed before a byte is closed uncounted (edge/sockets.py: a silent
churn stays out of the event loop). A connection is
*unauthenticated* until one of its requests passes the bearer-token check; an unauthenticated
one is closed UNAUTHENTICATED_SECONDS after it opened, and is the first to go when room is
needed (one that sent nothing yet, at least MIN_AGE old; else one that did, at least TALKING_AGE
old: a younger one, a probe's request on its way, is left to be served): a new connection takes
the place of the oldest unauthenticated one of its own address or network prefix (/24, /64) once
that address or prefix holds all but reserve_of(maxConnections) of them (16, at most an eighth
of the cap), and of the oldest unauthenticated one of anybody's once every connection is taken.
So N addresses of a network cannot take what one cannot, and no flood of idle or trickling
connections keeps a new one out: the kubelet's probes (it restarts a syncer whose probe fails,
losing the merges since its last checkpoint), the operator's calls and the learners get in. One
address also holds at most all but the reserve of them however it authenticated. A network prefix
that was admitted reserve_of(maxConnections) connections within the last MIN_AGE (less those that
authenticated since) takes no other's place (its new ones are answered busy instead), and its
unauthenticated connections may be replaced at any age (those of a prefix that is not churning only
once MIN_AGE or TALKING_AGE old), so a churn of connections each closed before MIN_AGE cannot keep
the connections young and taken (audit of 2026-12-01: two /24s churning thousands a second kept the
islands' new connections out; CI of the same day: a churn admitted while the cap had room filled
it); past half the cap's refusals answered busy in that window, its next are closed unanswered (a
probe among them whose request is already in when it is accepted still answered: request_line_in). A
connection that finds no room (every one taken and authenticated, or its address at its share with
none of its own to replace) is answered 503 with Retry-After and closed, unless it is a liveness or
readiness probe: that is answered as the route would (_Busy), so no traffic starves them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import socket
from collections import Counter, deque
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from aiohttp import web

from diloco_trainer.api import protocol

log = logging.getLogger("diloco.syncer")


# Connections no single peer address can take (ConnectionCap): room for the kubelet's probes
# and the operator's calls however many connections one client holds.
RESERVE_CONNECTIONS = 16
# Seconds a connection stays open with no request that passed the bearer-token check (at most
# the header timeout): an honest client sends one at once, the kubelet's probes are done by then.
UNAUTHENTICATED_SECONDS = 5.0
# Seconds a new connection is safe from being replaced: a probe's request reaches the server
# even behind a burst of thousands of connections accepted in one turn of the event loop.
MIN_AGE = 1.0
# Seconds a connection that found no room waits for its request line: a probe is answered.
PROBE_WAIT = 1.0
# Seconds a connection that sent bytes but no request that passed the bearer-token check is safe
# from being replaced: a probe's request is answered well within it, an island's request is
# authenticated as soon as its headers are in. Without it a flood whose connections each sent one
# byte was never replaced (only closed at UNAUTHENTICATED_SECONDS, then opened again): two /24s of
# them held every connection, and an island's new connections got 503 busy 36 times in 40 over
# 20 s (audit of 2026-12-01, docs/adversaries.md).
TALKING_AGE = 2 * MIN_AGE
# The network prefixes whose addresses share one address's room for unauthenticated connections.
IPV4_PREFIX = 24
IPV6_PREFIX = 64
# A liveness or readiness probe's answer: (status, JSON document) for a route and `strict`.
Probe = Callable[[str, bool], tuple[int, dict[str, Any]]]
_BUSY_BODY = b'{"error": "the syncer has too many connections open", "code": "busy"}'
_BUSY_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 2\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY)
)


def prefix_of(peer: str) -> str:
    """The network a peer address shares its room with: its /24 (IPv4, also IPv4-mapped IPv6)
    or /64 (IPv6); anything else (no address) is its own."""
    try:
        addr = ipaddress.ip_address(peer)
    except ValueError:
        return peer
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    bits = IPV4_PREFIX if addr.version == 4 else IPV6_PREFIX
    return str(ipaddress.ip_network(f"{addr}/{bits}", strict=False))


def probe_response(status: int, doc: dict[str, Any]) -> bytes:
    """A whole HTTP/1.1 answer with a JSON body, closing the connection."""
    body = json.dumps(doc).encode()
    reason = HTTPStatus(status).phrase
    return b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nConnection: close\r\n" % (
        status,
        reason.encode(),
    ) + b"Content-Length: %d\r\n\r\n%s" % (len(body), body)


class _Busy(asyncio.Protocol):
    """A connection that found no room: a liveness or readiness probe (its request line within
    PROBE_WAIT) is answered as its route would answer it, anything else 503 busy; closed either
    way."""

    def __init__(self, probe: Probe | None = None) -> None:
        self.probe = probe
        self.transport: asyncio.WriteTransport | None = None
        self.head = b""
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        self.transport = transport
        if self.probe is None:
            self._answer(b"")
            return
        self.timer = asyncio.get_running_loop().call_later(PROBE_WAIT, self._answer, b"")

    def data_received(self, data: bytes) -> None:
        self.head += data
        if b"\n" in self.head or len(self.head) > 1024:
            self._answer(self.head.split(b"\n", 1)[0])

    def _answer(self, line: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        if self.timer is not None:
            self.timer.cancel()
        self.transport.write(probe_answer(self.probe, line) or _BUSY_RESPONSE)
        self.transport.close()


def probe_answer(probe: Probe | None, line: bytes) -> bytes | None:
    """The answer to a request line that is a liveness or readiness probe (GET of a public
    route), as its route would answer it; None for any other line."""
    parts = line.split()
    if probe is None or len(parts) < 2 or parts[0] != b"GET":
        return None
    route, _, query = parts[1].decode("latin-1").partition("?")
    if route not in protocol.PUBLIC_ROUTES:
        return None
    strict = any(
        q.startswith("strict=") and q[7:] not in ("", "0", "false") for q in query.split("&")
    )
    return probe_response(*probe(route, strict))


def request_line_in(transport: asyncio.BaseTransport) -> bytes:
    """The first line a just-accepted connection has already sent, read at once without
    waiting (b"" when no whole line is in). A client sends its request right after the
    handshake, so by the time a busy loop accepts it a probe's request is usually in the
    socket: reading it costs one system call, where waiting for it (_Busy) holds the
    connection open up to PROBE_WAIT. Only for a connection about to be closed unanswered
    (shed): the bytes read are gone from the stream. Under TLS they are a handshake or a
    record, never a plain request line, so such a connection is closed as before."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return b""
    try:
        head = os.read(sock.fileno(), 1024)
    except OSError:  # nothing in yet (EAGAIN on the non-blocking socket), or reset
        return b""
    return head.split(b"\n", 1)[0] if b"\n" in head else b""

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()


class _Counted(asyncio.Protocol):
    """A connection counted by its ConnectionCap from accept to close: once admitted, its real
    protocol (aiohttp's request handler) is made when its first bytes arrive, so a silent one
    costs a count and a timer, not a handler (a flood of thousands is accepted on one event loop
    beside the probes); _Busy's when it found no room."""

    def __init__(self, cap: ConnectionCap) -> None:
        self.cap = cap
        self.admitted = False
        self.inner: Any = None  # aiohttp's handler, from its first bytes; else `busy` answers
        self.busy: _Busy | None = None
        self.transport: asyncio.BaseTransport | None = None
        self.peer = ""
        self.prefix = ""
        self.authenticated = False
        self.heard = False  # any bytes arrived
        self.opened = 0.0  # loop time of its accept
        self.evicted = False
        self.shed = False  # refused as its prefix churns: closed unanswered (ConnectionCap._refuse)
        self.timer: asyncio.TimerHandle | None = None
        # Its socket while it waits for its transport, when admitted at accept (ConnectionCap.
        # take): an eviction meanwhile shuts it down.
        self.sock: socket.socket | None = None
        self.decided = False  # admitted or refused already, at accept
        # Counted among its prefix's recent admissions (ConnectionCap._churning) until it
        # leaves the window or authenticates.
        self.young = False

    def decide(self, peer: Any, opened: float) -> bool:
        """Admit it (ConnectionCap.admit) as a connection of `peer` accepted at loop time
        `opened`."""
        self.peer = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        self.prefix = prefix_of(self.peer)
        self.opened = opened
        self.decided = True
        self.admitted = self.cap.admit(self)
        return self.admitted

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport, self.sock = transport, None
        if not self.decided:  # not through ConnectionCap.take: decided now
            self.decide(transport.get_extra_info("peername"), asyncio.get_running_loop().time())
        if self.evicted:  # replaced while its transport was being made
            transport.abort()  # type: ignore[attr-defined]
            return
        if not self.admitted:
            if self.shed:
                # A probe whose request is already in is answered (one write, no timer):
                # /healthz from inside a churning network still answers (issue 46's "the
                # same flood from the address that checks /healthz"); anything else closed.
                answer = probe_answer(self.cap.probe, request_line_in(transport))
                if answer is None:
                    transport.abort()  # type: ignore[attr-defined]
                else:
                    assert isinstance(transport, asyncio.WriteTransport)
                    transport.write(answer)
                    transport.close()
                return
            self.busy = _Busy(self.cap.probe)
            self.busy.connection_made(transport)
            return
        self.timer = asyncio.get_running_loop().call_later(
            self.cap.unauthenticated_seconds, self._silent
        )

    def mark_authenticated(self) -> None:
        """One of its requests passed the bearer-token check: no longer the first to go."""
        if self.inner is not None and not self.authenticated and not self.evicted:
            self.authenticated = True
            self.cap.authenticated(self)
            if self.timer is not None:
                self.timer.cancel()

    def _silent(self) -> None:
        if not self.authenticated and self.transport is not None:
            self.cap.silent += 1
            self.transport.close()

    def evict(self) -> None:
        """Make room for a newer connection: closed now, no longer counted."""
        self.evicted = True
        if self.timer is not None:
            self.timer.cancel()
        if self.transport is not None:
            self.transport.abort()  # type: ignore[attr-defined]
        elif self.sock is not None:  # its transport (or TLS handshake) under way: ends it
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)

    def data_received(self, data: bytes) -> None:
        if self.admitted and not self.evicted:
            if self.inner is None:
                self.heard = True
                self.cap.heard(self)
                self.inner = self.cap.server()
                self.inner.connection_made(self.transport)
            self.inner.data_received(data)
        elif self.busy is not None:
            self.busy.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.admitted:
            self.cap.closed(self)
            if self.inner is not None:
                self.inner.connection_lost(exc)
        elif self.busy is not None:
            self.busy.connection_lost(exc)


class ConnectionCap:
    """Protocol factory: aiohttp's server for up to `size` open connections, counted per peer
    address and network prefix (the module docstring says who makes room for whom); _Busy for a
    connection that finds none."""

    def __init__(
        self,
        server: web.Server,
        size: int,
        *,
        probe: Probe | None = None,
        unauthenticated_seconds: float = UNAUTHENTICATED_SECONDS,
    ) -> None:
        self.server = server
        self.size = size
        self.probe = probe
        self.unauthenticated_seconds = unauthenticated_seconds
        self.min_age = MIN_AGE
        self.talking_age = TALKING_AGE
        self.per_peer = max(1, size - reserve_of(size))
        self.open = 0
        self.refused = 0
        self.evictions = 0  # unauthenticated connections closed to make room
        self.silent = 0  # unauthenticated connections closed for their time
        self.peers: Counter[str] = Counter()  # admitted connections per peer address
        # Unauthenticated connections, oldest first: those that sent nothing yet, those that
        # did (a probe's request on its way; they go second), and their number per address and
        # prefix.
        self.waiting: dict[_Counted, None] = {}
        self.talking: dict[_Counted, None] = {}
        self.unauthenticated: Counter[str] = Counter()
        # Admissions of the last churn_window seconds, oldest first, and their number per prefix:
        # a prefix at young_share of them takes no other connection's place (_churning).
        self.young_share = max(1, reserve_of(size))
        self.churn_window = MIN_AGE  # the age below which _evict_oldest replaces none
        # Each entry is (loop time, prefix, admitted, the connection); refusals are counted as
        # well, so that a churning prefix's first max(RESERVE_CONNECTIONS, size // 2) refusals a
        # window are answered busy (a probe among them answered) and the rest shed (_refuse). An
        # admission whose connection authenticated is no longer counted (authenticated).
        self.recent: deque[tuple[float, str, bool, _Counted]] = deque()
        self.recent_per_prefix: Counter[tuple[str, bool]] = Counter()
        self.shed_at_accept = 0  # shed before a transport was made (take)
        # Told each authenticated connection's network prefix (GuardedSite: AcceptLanes.known).
        self.on_authenticated: Callable[[str], None] | None = None

    def __call__(self) -> asyncio.Protocol:
        return _Counted(self)

    def take(self, sock: socket.socket, peer: Any) -> _Counted | None:
        """A connection just accepted (DeferredAcceptServer's `take`), admitted before any
        transport is made: its protocol, or None when it was shed (closed here; a probe whose
        request line is in answered first, as _Counted does). Why: a churn of connections that
        each send one byte is accepted at once, and each went through a transport and a
        protocol before admit shed it: at 6,000-14,000 a second from 4 processes on the
        syncer's 2 cores a new connection waited out SYN retransmits, 6-12 s (session 37,
        bench.healthz_flood --churn --target syncer --send G)."""
        conn = _Counted(self)
        if conn.decide(peer, asyncio.get_running_loop().time()) or not conn.shed:
            conn.sock = sock
            return conn
        self.shed_at_accept += 1
        try:  # under TLS a handshake's bytes, never a request line: closed unanswered
            head = sock.recv(1024)
        except OSError:  # nothing in yet, or reset
            head = b""
        answer = probe_answer(self.probe, head.split(b"\n", 1)[0]) if b"\n" in head else None
        if answer is not None:
            with contextlib.suppress(OSError):  # a probe's answer fits an empty send buffer
                sock.send(answer)
        sock.close()
        return None

    def admit(self, conn: _Counted) -> bool:
        """Count `conn`, making room as the module docstring says; False when there is none
        (`conn.shed` when its prefix is churning: closed at once, not answered)."""
        churning = self._churning(conn.prefix, conn.opened)
        for key in {conn.peer, conn.prefix}:
            if self.unauthenticated[key] >= self.per_peer and (
                churning or not self._evict_oldest(_of(key))
            ):
                return self._refuse(
                    conn, churning, f"{self.unauthenticated[key]} unauthenticated from {key}"
                )
        if self.peers[conn.peer] >= self.per_peer and (
            churning or not self._evict_oldest(lambda c: c.peer == conn.peer)
        ):
            return self._refuse(conn, churning, f"{self.peers[conn.peer]} open from {conn.peer}")
        if self.open >= self.size and (churning or not self._evict_oldest(lambda c: True)):
            return self._refuse(conn, churning, f"{self.open} open, all authenticated or young")
        self._note(conn, admitted=True)
        self.open += 1
        self.peers[conn.peer] += 1
        self.waiting[conn] = None
        for key in {conn.peer, conn.prefix}:
            self.unauthenticated[key] += 1
        return True

    def _churning(self, prefix: str, now: float) -> bool:
        """Whether `prefix` was admitted young_share connections within the last churn_window
        (MIN_AGE) seconds (forgetting older admissions as it goes): then a new one of it takes
        no other's place. Young connections are never replaced (_evict_oldest), so without this
        bound a prefix opening connections faster than they age kept every connection young,
        and an island's new one found none to replace (audit of 2026-12-01, docs/adversaries.md)."""
        while self.recent and self.recent[0][0] <= now - self.churn_window:
            _, old, admitted, conn = self.recent.popleft()
            if admitted and not conn.young:
                continue  # authenticated in the window: uncounted then
            conn.young = False
            self._forget_recent(old, admitted)
        return self.recent_per_prefix[prefix, True] >= self.young_share

    def _note(self, conn: _Counted, *, admitted: bool) -> None:
        self.recent.append((conn.opened, conn.prefix, admitted, conn))
        self.recent_per_prefix[conn.prefix, admitted] += 1
        conn.young = admitted

    def _forget_recent(self, prefix: str, admitted: bool) -> None:
        self.recent_per_prefix[prefix, admitted] -= 1
        if self.recent_per_prefix[prefix, admitted] <= 0:
            del self.recent_per_prefix[prefix, admitted]

    def authenticated(self, conn: _Counted) -> None:
        """`conn` passed the bearer-token check: no longer the first to go, and no longer one of
        its prefix's recent admissions. Why the latter: an island (or the test that stands in
        for one) that opens young_share connections a second while a flood holds the cap was
        taken for a churn, and its next connection got 503 busy where it would have taken a
        flood connection's place (CI of c2152aa: the 9th heartbeat in a second of
        tests/e2e/test_adversary_audit.py). A churn without a credential never authenticates,
        so it is counted as before; an island's own connections cannot churn others out, as
        only unauthenticated connections are replaced."""
        if conn.young:
            conn.young = False
            self._forget_recent(conn.prefix, True)
        self._forget_waiting(conn)
        if self.on_authenticated is not None:
            self.on_authenticated(conn.prefix)

    def closed(self, conn: _Counted) -> None:
        """`conn` closed (after its eviction too: it was uncounted then)."""
        if conn.evicted:
            return
        self._uncount(conn)

    def _uncount(self, conn: _Counted) -> None:
        self.open -= 1
        self.peers[conn.peer] -= 1
        if self.peers[conn.peer] <= 0:
            del self.peers[conn.peer]
        self._forget_waiting(conn)

    def heard(self, conn: _Counted) -> None:
        """`conn`'s first bytes arrived: it goes after the silent ones."""
        if self.waiting.pop(conn, False) is None:
            self.talking[conn] = None

    def _forget_waiting(self, conn: _Counted) -> None:
        if self.waiting.pop(conn, False) is None or self.talking.pop(conn, False) is None:
            for key in {conn.peer, conn.prefix}:
                self.unauthenticated[key] -= 1
                if self.unauthenticated[key] <= 0:
                    del self.unauthenticated[key]

    def _evict_oldest(self, which: Callable[[_Counted], bool]) -> bool:
        """Close the oldest silent unauthenticated connection `which` accepts, of those at
        least MIN_AGE old, else the oldest that sent something of those at least TALKING_AGE
        old, else (any age) the oldest silent one, then the oldest that sent something, of a
        churning prefix (_churned); False when none. One that sent something younger (a probe's
        request on its way) is left to be served, unless its prefix churns."""
        now = asyncio.get_running_loop().time()
        victim = None
        for queue, age in ((self.waiting, self.min_age), (self.talking, self.talking_age)):
            for c in queue:  # oldest first: stop at the first one too young
                if c.opened > now - age:
                    break
                if which(c):
                    victim = c
                    break
            if victim is not None:
                break
        if victim is None:
            victim = self._churned_victim(which)
        if victim is None:
            return False
        self._uncount(victim)
        victim.evict()
        self.evictions += 1
        if self.evictions == 1 or self.evictions % 1000 == 0:
            log.warning(
                "%d unauthenticated connections closed to make room (the latest from %s; "
                "syncer.limits)",
                self.evictions,
                victim.peer,
            )
        return True

    def _churned_victim(self, which: Callable[[_Counted], bool]) -> _Counted | None:
        """The oldest unauthenticated connection `which` accepts, silent ones first, of a
        prefix admitted young_share or more connections within churn_window: its young ones
        are not protected. Why: _churning stops such a prefix taking others' places, but while
        the cap has room its connections are admitted, and a churn whose connections live
        about a second (accepted when TCP_DEFER_ACCEPT gives up on them, or on their one
        byte) filled the cap with ones too young to replace, and an island's heartbeat got 503
        busy (CI of 2026-12-01, tests/e2e/test_adversary_limits.py's silent churn; the one-byte
        churn, portchurn46). An honest network's connection still unauthenticated goes only
        while its network opens connections that fast and every one is taken (the client
        retries a reset)."""
        churned = {
            prefix
            for (prefix, admitted), n in self.recent_per_prefix.items()
            if admitted and n >= self.young_share
        }
        if not churned:
            return None
        for queue in (self.waiting, self.talking):
            for c in queue:
                if c.prefix in churned and which(c):
                    return c
        return None

    def _refuse(self, conn: _Counted, churning: bool, why: str) -> bool:
        """No room for `conn` (False, admit's answer): answered busy, or shed (closed at once,
        unanswered) when its prefix is churning and has had max(RESERVE_CONNECTIONS, half the
        cap) refusals answered in the window already (256 at the default 512): a
        _Busy answer keeps each connection open up to PROBE_WAIT, and under a churn of
        thousands a second that made an island's heartbeats wait longer, not shorter (audit of
        2026-12-01); the first ones are still answered, so a probe among a burst of an honest
        network's connections is, and an idle flood's overflow is answered busy as before (an
        honest client retries a 503 or a reset, tests/e2e/test_adversary_limits.py). A shed
        probe whose request is in when it is accepted is answered all the same (_Counted)."""
        answered = self.recent_per_prefix[conn.prefix, False]
        conn.shed = churning and answered >= max(RESERVE_CONNECTIONS, self.size // 2)
        self._note(conn, admitted=False)
        self.refused += 1
        if self.refused == 1 or self.refused % 1000 == 0:
            more = f", {conn.prefix} churning" if churning else ""
            log.warning("%s connections%s: refusing more (syncer.limits)", why, more)
        return False


def _of(key: str) -> Callable[[_Counted], bool]:
    """Whether a connection is of an address or prefix."""
    return lambda conn: key in (conn.peer, conn.prefix)


def mark_authenticated(transport: asyncio.BaseTransport | None) -> None:
    """The connection of a request that passed the bearer-token check is authenticated (its
    protocol is the ConnectionCap's, also under TLS: the TLS transport hands it the same)."""
    proto = transport.get_protocol() if transport is not None else None
    if isinstance(proto, _Counted):
        proto.mark_authenticated()


def reserve_of(size: int) -> int:
    """The connections one peer address cannot take: RESERVE_CONNECTIONS, at most an eighth of
    the cap (a small cap keeps most of it for the one client it may have: the connections it
    closed are counted until the server has seen them close)."""
    return min(RESERVE_CONNECTIONS, size // 8)
