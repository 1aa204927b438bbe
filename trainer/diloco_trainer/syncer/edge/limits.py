"""What the syncer's HTTP server allows any client (syncer.limits): time, connections, memory.

- Headers: a request's headers must arrive within headerTimeoutSeconds of the connection opening
  or of its previous response (aiohttp's keep-alive timer, which closes a connection whose next
  request has not been parsed by then; idle keep-alive connections close then too). A TLS
  handshake gets as long.
- Bodies (read_body): no pause longer than headerTimeoutSeconds, and the whole body within
  bodyTimeoutSeconds, else 408 and the connection is closed: a client trickling one byte every
  few seconds cannot hold a connection and its buffer for ever.
- Connections (ConnectionCap): at most maxConnections at once, counted from the TCP accept (so TLS
  handshakes count). A connection is *unauthenticated* until one of its requests passes the
  bearer-token check; an unauthenticated one is closed UNAUTHENTICATED_SECONDS after it opened,
  and is the first to go when room is needed (one that sent nothing yet, at least MIN_AGE old;
  else one that did, at least TALKING_AGE old: a younger one, a probe's request on its way, is
  left to be served): a new connection takes the place of
  the oldest unauthenticated one of its own address or network prefix (/24, /64) once that address
  or prefix holds all but reserve_of(maxConnections) of them (16, at most an eighth of the cap), and
  of the oldest unauthenticated one of anybody's once every connection is taken. So N addresses
  of a network cannot take what one cannot, and no flood of idle or trickling connections keeps
  a new one out: the kubelet's probes (it restarts a syncer whose probe fails, losing the
  merges since its last checkpoint), the operator's calls and the learners get in. One address
  also holds at most all but the reserve of them however it authenticated. A network prefix
  that was admitted reserve_of(maxConnections) connections within the last MIN_AGE takes no
  other's place (its new ones are answered busy instead), so a churn of connections each closed
  before MIN_AGE, which no rule above may replace, holds at most that many young ones per prefix
  and the rest can be replaced (audit of 2026-12-01: two /24s churning thousands a second kept
  the islands' new connections out); past half the cap's refusals answered busy in that window,
  its next are closed unanswered (a probe among them whose request is already in when it is
  accepted still answered: request_line_in). A connection that
  finds no room (every one taken and authenticated, or its address at its share with none of
  its own to replace) is answered 503 with Retry-After and closed, unless it is a liveness or
  readiness probe: that is answered as the route would (_Busy), so no traffic starves them.
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
import ipaddress
import json
import logging
import os
import ssl
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Protocol

from aiohttp import web
from aiohttp.streams import StreamReader

from diloco_trainer.api import credentials, protocol
from diloco_trainer.api.credentials import Principal
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.syncer.errors import Refused

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
# Connections the kernel queues for accept (capped by net.core.somaxconn): a burst of new
# connections beyond it has its SYNs dropped, and a probe among them retries only after a second.
LISTEN_BACKLOG = 4096
# The network prefixes whose addresses share one address's room for unauthenticated connections.
IPV4_PREFIX = 24
IPV6_PREFIX = 64
# How often serve's event loop tells a ProbeListener that it turns (seconds).
BEAT_SECONDS = 0.5
# A liveness or readiness probe's answer: (status, JSON document) for a route and `strict`.
Probe = Callable[[str, bool], tuple[int, dict[str, Any]]]
PROBE_KEY: web.AppKey[Probe] = web.AppKey("probe")
# Push bodies one island's credential may have read at once: two fragments' pushes overlapping
# (the 'auto' maxConcurrentPushes has room for two per island).
PUSHES_PER_ISLAND = 2
# Seconds a client is asked to wait when the syncer is at one of its limits.
BUSY_RETRY_AFTER = 2.0
_BUSY_BODY = b'{"error": "the syncer has too many connections open", "code": "busy"}'
_BUSY_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 2\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY)
)


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

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        self.prefix = prefix_of(self.peer)
        self.transport = transport
        self.opened = asyncio.get_running_loop().time()
        if not self.cap.admit(self):
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
        self.admitted = True
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
        # Each entry is (loop time, prefix, admitted); refusals are counted as well, so that a
        # churning prefix's first max(RESERVE_CONNECTIONS, size // 2) refusals a window are
        # answered busy (a probe among them answered) and the rest shed (_refuse).
        self.recent: deque[tuple[float, str, bool]] = deque()
        self.recent_per_prefix: Counter[tuple[str, bool]] = Counter()

    def __call__(self) -> asyncio.Protocol:
        return _Counted(self)

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
            _, old, admitted = self.recent.popleft()
            self.recent_per_prefix[old, admitted] -= 1
            if self.recent_per_prefix[old, admitted] <= 0:
                del self.recent_per_prefix[old, admitted]
        return self.recent_per_prefix[prefix, True] >= self.young_share

    def _note(self, conn: _Counted, *, admitted: bool) -> None:
        self.recent.append((conn.opened, conn.prefix, admitted))
        self.recent_per_prefix[conn.prefix, admitted] += 1

    def authenticated(self, conn: _Counted) -> None:
        self._forget_waiting(conn)

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
        old; False when none. One that sent something younger (a probe's request on its way) is
        left to be served."""
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
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context)
        self.host, self.port, self.limits = host, port, limits
        self.cap: ConnectionCap | None = None

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
        self._server = await asyncio.get_running_loop().create_server(
            self.cap,
            self.host,
            self.port,
            ssl=self._ssl_context,
            ssl_handshake_timeout=self.limits.header_timeout if self._ssl_context else None,
            reuse_address=True,
            backlog=LISTEN_BACKLOG,
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
