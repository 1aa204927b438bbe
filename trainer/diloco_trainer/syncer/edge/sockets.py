"""Listening sockets whose accepts wait for a connection's first bytes, for the syncer port
(limits.GuardedSite) and the probe port (probe_listener.HealthListener).

Why: a client of either port always speaks first (an HTTP request, or a TLS ClientHello), so a
connection that has sent nothing is of no use yet. With TCP_DEFER_ACCEPT (Linux) the kernel
keeps such a connection out of the accept queue until its first bytes come, or until
`defer_seconds` (rounded up to its SYN-ACK retransmits) have passed; one closed before it sent
anything never reaches the process. A churn of silent connections (open, never send, close,
thousands a second) then costs the kernel, not the event loop's accepts: on the syncer port it
filled the accept queue and kept an island's heartbeats out for a whole run (audit46, the
repeat audit of 2026-12-01, docs/adversaries.md); on the probe port it delayed the kubelet's
probes (probe_listener's module docstring).

Under TLS a connection reached the syncer port's ConnectionCap only once its handshake was done
(asyncio makes the protocol then; since ConnectionCap.take it is admitted as it is accepted), so
the cap's rules for a churning network never saw a churn whose connections each send a byte or a
record header and then nothing: each was accepted and began a handshake (an SSL object, a 256
KiB buffer) that it failed or held until the header timeout: island-0 made one heartbeat over
HTTPS in 9 s, where the plain syncer beside made 2-22 (bench/log/2026-12-01.md, "healthz_flood
--churn --target syncer --tls"). So a network prefix starts at most HANDSHAKES_PER_PREFIX
handshakes within HANDSHAKE_WINDOW; the rest of its connections are closed before theirs
(handshake_budget).

On the syncer port each IPv4 address listens in two accept lanes (laned_sockets, AcceptLanes):
the kernel queues a new connection from a network prefix that has authenticated (an island, an
admin) in the known lane, any other in the others' lane, a classic-BPF program steering the SYNs
within a SO_REUSEPORT pair of listeners. Why: a churn faster than the syncer accepts keeps the
accept queue full, and the kernel drops every SYN that finds it full, an island's too: on a
starved CPU (CI's; the syncer at a third of a core) island-0's heartbeats over HTTPS waited out
SYN retransmits, 2 in 5 s at 1.3 and 5.1 s, while the churn opened 275,000 connections
(tests/e2e/test_adversary_limits.py). A churn now fills the others' lane alone.
"""

from __future__ import annotations

import asyncio
import ctypes
import ipaddress
import logging
import socket
import ssl
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger("diloco.syncer")

# Seconds the kernel holds a connection that sent nothing before it is accepted anyway: the
# time a probe's request line has (connections.PROBE_WAIT).
DEFER_ACCEPT_SECONDS = 1
# TLS handshakes one network prefix (connections.prefix_of: /24, /64) starts on the syncer port
# within HANDSHAKE_WINDOW seconds (handshake_budget): an island's client keeps its connections open
# and opens a few at a time, the kubelet probes the probe listener; a prefix starting more is
# churning, and its next connections are closed before their handshakes (its honest clients
# retry a reset).
HANDSHAKES_PER_PREFIX = 32
HANDSHAKE_WINDOW = 1.0
# Network prefixes remembered (AcceptBudget's windows, the probe listener's address -> prefix
# cache) before those past their use are dropped.
REMEMBERED_PREFIXES = 4096


def _listener(
    info: tuple[Any, ...], *, backlog: int, defer_seconds: int, reuse_port: bool = False
) -> socket.socket:
    """One non-blocking socket listening at getaddrinfo's `info` (family, type, proto, _,
    address) as listening_sockets says; in a SO_REUSEPORT group when `reuse_port`."""
    family, kind, proto, _, address = info
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        if hasattr(socket, "TCP_DEFER_ACCEPT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, defer_seconds)
        sock.bind(address)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def listening_sockets(
    host: str, port: int, *, backlog: int, defer_seconds: int = DEFER_ACCEPT_SECONDS
) -> list[socket.socket]:
    """Non-blocking sockets listening on `host`'s addresses (as asyncio's create_server binds
    them: SO_REUSEADDR, IPv6 sockets IPv6 only) with an accept queue of `backlog`, accepts
    deferred until a connection's first bytes or `defer_seconds` (TCP_DEFER_ACCEPT, where the
    system has it). OSError when one cannot bind."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    socks: list[socket.socket] = []
    try:
        for info in dict.fromkeys(infos):
            socks.append(_listener(info, backlog=backlog, defer_seconds=defer_seconds))
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


def laned_sockets(
    host: str, port: int, *, backlog: int, defer_seconds: int = DEFER_ACCEPT_SECONDS
) -> tuple[list[socket.socket], AcceptLanes]:
    """listening_sockets, with each IPv4 address in two accept lanes (AcceptLanes: the known
    lane's socket first, then the others'; IPv6 addresses and a system without SO_REUSEPORT in
    one), and the lanes' steering. OSError when one cannot bind. A fixed port that another
    listener holds is refused as without lanes: it is bound once without SO_REUSEPORT first, so
    a second syncer (of the same user, whom SO_REUSEPORT would let in) never shares the port."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    socks: list[socket.socket] = []
    pairs: list[tuple[socket.socket, socket.socket]] = []
    try:
        for info in dict.fromkeys(infos):
            if info[0] != socket.AF_INET or not hasattr(socket, "SO_REUSEPORT"):
                socks.append(_listener(info, backlog=backlog, defer_seconds=defer_seconds))
                continue
            if info[4][1]:  # a fixed port: held by another listener? (bind raises)
                _listener(info, backlog=1, defer_seconds=0).close()
            known = _listener(info, backlog=backlog, defer_seconds=defer_seconds, reuse_port=True)
            socks.append(known)
            address = (info[4][0], known.getsockname()[1])  # port 0: the one it was given
            others = _listener(
                (*info[:4], address), backlog=backlog, defer_seconds=defer_seconds, reuse_port=True
            )
            socks.append(others)
            pairs.append((known, others))
        lanes = AcceptLanes(pairs)
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks, lanes


def peer_closed(conn: socket.socket) -> bool:
    """Whether an accepted non-blocking socket's peer closed it before sending a byte (it reads
    end-of-stream; peeked, so nothing is taken from the stream, a TLS handshake's included)."""
    try:
        return conn.recv(1, socket.MSG_PEEK) == b""
    except (BlockingIOError, InterruptedError):
        return False  # nothing in yet
    except OSError:
        return True  # reset


def accept_queued(
    sock: socket.socket, limit: int, take: Callable[[socket.socket, Any], None], who: str
) -> None:
    """The listening socket is readable: hand `take` each (connection, peer) it queued, at most
    `limit` at a time, so the loop turns between."""
    for _ in range(limit):
        try:
            conn, peer = sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as err:  # out of file descriptors, or the connection aborted
            log.warning("%s could not accept a connection: %s", who, err)
            return
        take(conn, peer)


class AcceptBudget:
    """At most `budget` connections of one network prefix served in a window of `window`
    seconds (fixed windows, each starting at the first connection after the last one ended: at
    most 2 x `budget` in any `window`); the rest are shed."""

    def __init__(self, budget: int, window: float) -> None:
        self.budget, self.window = budget, window
        self.windows: dict[str, tuple[float, int]] = {}  # prefix -> (its window's start, served)

    def admit(self, prefix: str, now: float) -> bool:
        """Whether a connection of `prefix` at `now` is served (counted) or shed (not counted)."""
        start, served = self.windows.get(prefix, (now, 0))
        if now - start >= self.window:
            start, served = now, 0
        if served >= self.budget:
            return False
        if len(self.windows) >= REMEMBERED_PREFIXES and prefix not in self.windows:
            self.windows = {k: w for k, w in self.windows.items() if now - w[0] < self.window}
        self.windows[prefix] = (start, served + 1)
        return True


def handshake_budget(
    prefix: Callable[[str], str],
    budget: int = HANDSHAKES_PER_PREFIX,
    window: float = HANDSHAKE_WINDOW,
) -> Callable[[Any], bool]:
    """DeferredAcceptServer's `admit` under TLS: whether a connection from `peer` (accept's
    address) may start a handshake, at most `budget` of its network prefix (`prefix` of its
    host) within `window` seconds (AcceptBudget; the module docstring says why)."""
    budgets = AcceptBudget(budget, window)

    def admit(peer: Any) -> bool:
        host = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        return budgets.admit(prefix(host), time.monotonic())

    return admit


# Linux's option that steers a SO_REUSEPORT group's new connections by a classic BPF program
# (asm-generic/socket.h; Python's socket module does not name it), and the program's opcodes
# (linux/filter.h): load a word at an offset from the network header, AND, jump if equal, return.
SO_ATTACH_REUSEPORT_CBPF = 51
_LD_W_ABS, _ALU_AND_K, _JEQ_K, _RET_K = 0x20, 0x54, 0x15, 0x06
_SKF_NET_OFF = -0x100000
_IPV4_SOURCE = 12  # the source address's offset in an IPv4 header
# The lanes' indexes in a pair's SO_REUSEPORT group: the order of their listen calls.
KNOWN_LANE, OTHERS_LANE = 0, 1
# Network prefixes the known lane takes, the least recently authenticated dropped past it: a
# jump's offset is 8 bits, so a program tests at most 255 (a job's islands, admins and regions
# come from a few).
KNOWN_PREFIXES = 200
# Connections taken from the others' lane in one turn of the event loop (the known lane's: the
# backlog): a churn's queue is drained in short turns, so an island's connection beside it is
# served (a TLS handshake takes several turns) without waiting behind thousands.
OTHERS_BATCH = 256


def lane_program(prefixes: Sequence[str], bits: int) -> list[tuple[int, int, int, int]]:
    """The classic BPF program, (code, jt, jf, k) each, that returns KNOWN_LANE for an IPv4
    packet whose source is in one of `prefixes` (IPv4 networks of `bits` bits, as
    connections.prefix_of names them; any other skipped) and OTHERS_LANE for any other packet:
    the source address masked to `bits`, then compared with each network."""
    nets: list[int] = []
    for prefix in prefixes:
        try:
            net = ipaddress.ip_network(prefix)
        except ValueError:
            continue
        if isinstance(net, ipaddress.IPv4Network) and net.prefixlen == bits:
            nets.append(int(net.network_address))
    nets = nets[-KNOWN_PREFIXES:]
    mask = (0xFFFFFFFF << (32 - bits)) & 0xFFFFFFFF
    source = (_SKF_NET_OFF + _IPV4_SOURCE) & 0xFFFFFFFF
    program = [(_LD_W_ABS, 0, 0, source), (_ALU_AND_K, 0, 0, mask)]
    # A match jumps over the networks after it and the others' return, to the known lane's.
    program += [(_JEQ_K, len(nets) - i, 0, net) for i, net in enumerate(nets)]
    return [*program, (_RET_K, 0, 0, OTHERS_LANE), (_RET_K, 0, 0, KNOWN_LANE)]


def attach_lane_program(sock: socket.socket, program: Sequence[tuple[int, int, int, int]]) -> None:
    """Steer the SO_REUSEPORT group of `sock` by `program` (the kernel copies it). OSError where
    the system refuses it."""
    code = ctypes.create_string_buffer(b"".join(struct.pack("=HBBI", *ins) for ins in program))
    fprog = struct.pack("HP", len(program), ctypes.addressof(code))  # struct sock_fprog
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF, fprog)


class AcceptLanes:
    """The syncer port's accept lanes: for each IPv4 address a (known, others) pair of
    listening sockets in one SO_REUSEPORT group, steered by lane_program over the network
    prefixes that authenticated (`known`: the KNOWN_PREFIXES most recent). Where the system
    refuses the program the kernel spreads new connections over both sockets, as one lane."""

    def __init__(self, pairs: list[tuple[socket.socket, socket.socket]], bits: int = 24) -> None:
        self.pairs, self.bits = pairs, bits
        self.prefixes: OrderedDict[str, None] = OrderedDict()
        self.steered = bool(pairs)
        self._steer()

    def others(self, sock: socket.socket) -> bool:
        """Whether `sock` is an others' lane."""
        return any(sock is others for _, others in self.pairs)

    def known(self, prefix: str) -> None:
        """`prefix` authenticated: the kernel queues its new connections in the known lane."""
        if prefix in self.prefixes:
            self.prefixes.move_to_end(prefix)
            return
        self.prefixes[prefix] = None
        while len(self.prefixes) > KNOWN_PREFIXES:
            self.prefixes.popitem(last=False)
        self._steer()

    def _steer(self) -> None:
        if not self.steered:
            return
        program = lane_program(list(self.prefixes), self.bits)
        try:
            for known, _ in self.pairs:
                attach_lane_program(known, program)
        except OSError as err:
            self.steered = False
            log.warning("the syncer port's connections are not steered into lanes: %s", err)


class DeferredAcceptServer(asyncio.AbstractServer):
    """asyncio's server for `socks` (listening_sockets), with an accept loop of its own: a
    connection whose peer has closed it already is closed on the spot, with no transport or
    protocol made; any other is served by `factory` (connect_accepted_socket, TLS when
    `ssl_context`), or by the protocol `take` gives for it (None: `take` closed it, e.g.
    connections.ConnectionCap.take, which sheds a churn's before any transport), unless `admit`
    (handshake_budget) refuses its peer first: closed at once, before a TLS handshake; an others'
    accept lane of `lanes` (AcceptLanes) OTHERS_BATCH connections a turn. Why: with
    accepts deferred, a silent churn's connections reach the process as they close, thousands a
    second, and asyncio's server made a transport and a protocol for each before anything was
    known of it: the accept queue overflowed and an island's new connections waited out SYN
    retransmits (audit46: 3-4 s, and 503s while the dead ones were counted)."""

    def __init__(
        self,
        socks: list[socket.socket],
        factory: Callable[[], asyncio.Protocol],
        *,
        backlog: int,
        ssl_context: ssl.SSLContext | None = None,
        ssl_handshake_timeout: float | None = None,
        take: Callable[[socket.socket, Any], asyncio.Protocol | None] | None = None,
        admit: Callable[[Any], bool] | None = None,
        lanes: AcceptLanes | None = None,
    ) -> None:
        self.socks, self.factory, self.backlog, self.take = socks, factory, backlog, take
        self.lanes = lanes
        self.ssl_context, self.ssl_handshake_timeout = ssl_context, ssl_handshake_timeout
        self.admit = admit
        self.loop = asyncio.get_running_loop()
        self.closed_unread = 0  # connections closed by their peer before they were accepted
        self.shed = 0  # connections `admit` refused: closed before a handshake
        self._adopting: set[asyncio.Task[None]] = set()
        self._serving = True
        for sock in socks:
            self.loop.add_reader(sock.fileno(), self._accept, sock)

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        return tuple(self.socks)

    def _accept(self, sock: socket.socket) -> None:
        others = self.lanes is not None and self.lanes.others(sock)
        accept_queued(sock, OTHERS_BATCH if others else self.backlog, self._take, "the syncer")

    def _take(self, conn: socket.socket, peer: Any) -> None:
        conn.setblocking(False)
        if peer_closed(conn):
            conn.close()
            self.closed_unread += 1
            return
        if self.admit is not None and not self.admit(peer):
            conn.close()
            self.shed += 1
            if self.shed == 1 or self.shed % 10000 == 0:
                log.warning(
                    "%d connections of churning networks closed before a handshake", self.shed
                )
            return
        proto = None
        if self.take is not None:
            proto = self.take(conn, peer)
            if proto is None:
                return  # shed and closed before any transport
        task = self.loop.create_task(self._adopt(conn, proto))
        self._adopting.add(task)
        task.add_done_callback(self._adopting.discard)

    async def _adopt(self, conn: socket.socket, proto: asyncio.Protocol | None) -> None:
        try:
            await self.loop.connect_accepted_socket(
                self.factory if proto is None else lambda: proto,
                conn,
                ssl=self.ssl_context,
                ssl_handshake_timeout=self.ssl_handshake_timeout,
            )
        except (OSError, ssl.SSLError, TimeoutError) as err:  # gone, or a failed handshake
            log.debug("a connection failed before it was served: %s", err)
            conn.close()
            if proto is not None:  # taken, never made: told it is gone (uncounted)
                proto.connection_lost(err)

    def close(self) -> None:
        if not self._serving:
            return
        self._serving = False
        for sock in self.socks:
            self.loop.remove_reader(sock.fileno())
            sock.close()
        for task in list(self._adopting):
            task.cancel()

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self.loop

    def is_serving(self) -> bool:
        return self._serving

    async def start_serving(self) -> None:
        pass  # serving from construction

    async def serve_forever(self) -> None:
        raise NotImplementedError("serve runs the loop")

    async def wait_closed(self) -> None:
        pass  # closed in close(): nothing is left to wait for
