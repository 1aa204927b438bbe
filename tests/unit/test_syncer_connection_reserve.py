"""The syncer's connection cap (syncer/edge/limits.py) against idle floods (issue 22, finding 4;
issue 46): ~530 idle connections from one client, then from two addresses, made /healthz
answer 503 for as long as they were held, and a kubelet restarts a syncer whose liveness probe
fails. Now an unauthenticated connection is the first to go: a new one takes the place of the
oldest unauthenticated one of its address or network prefix at their share, or of anybody's
when every connection is taken; one finding no room still gets its probe answered. A real
GuardedSite on loopback."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from diloco_trainer.syncer.edge.connections import (
    ConnectionCap,
    mark_authenticated,
    prefix_of,
    reserve_of,
)
from diloco_trainer.syncer.edge.limits import PROBE_KEY, GuardedSite, HttpLimits
from diloco_trainer.syncer.edge.sockets import HANDSHAKES_PER_PREFIX, DeferredAcceptServer

from bench.healthz_flood import make_certificate

FLOOD, NEIGHBOUR, PROBE = "127.0.0.2", "127.0.0.3", "127.0.0.1"  # one /24
# A reply's end: each answer here is small, and the server closes the connections read to end.
READ_TIMEOUT = 30.0
GET_HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def authed(request: web.Request) -> web.Response:
    """Stands in for a route behind the bearer-token check (http.py's auth middleware)."""
    mark_authenticated(request.transport)
    return web.json_response({"authenticated": True})


def probe(route: str, strict: bool) -> tuple[int, dict[str, Any]]:
    return 200, {"ok": True, "route": route, "strict": strict}


async def open_from(port: int, source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def ask(port: int, source: str, request: bytes) -> bytes:
    reader, writer = await open_from(port, source)
    writer.write(request)
    try:
        return await asyncio.wait_for(reader.read(), READ_TIMEOUT)
    finally:
        writer.close()


async def server_side(done: Callable[[], bool]) -> None:
    """Until `done` holds of the server's counts (it runs on this event loop: each turn lets it
    accept and read), READ_TIMEOUT at most."""
    async with asyncio.timeout(READ_TIMEOUT):
        while not done():
            await asyncio.sleep(0)  # yield one turn of the loop to the server


async def sent_before_accept(port: int, source: str, request: bytes) -> bytes:
    """`request` sent on a plain socket whose handshake the kernel completed before the server
    (on this event loop, which does not run meanwhile) accepted it: its bytes are in when the
    server's protocol sees the connection. The answer, b"" when closed unanswered."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    try:
        sock.bind((source, 0))
        sock.connect(("127.0.0.1", port))  # blocking: the listen backlog completes it
        sock.sendall(request)
        sock.setblocking(False)
        chunks = []
        async with asyncio.timeout(READ_TIMEOUT):
            while chunk := await loop.sock_recv(sock, 65536):
                chunks.append(chunk)
        return b"".join(chunks)
    except ConnectionResetError:
        return b""
    finally:
        sock.close()


def serving(
    limits: HttpLimits,
    scenario: Callable[[int, ConnectionCap], Awaitable[Any]],
    ssl_context: ssl.SSLContext | None = None,
) -> Any:
    """Run `scenario(port, cap)` against a GuardedSite with /healthz, /auth and the probe
    (serving HTTPS with `ssl_context` when given)."""

    async def main() -> Any:
        app = web.Application()
        app.router.add_get("/healthz", healthz)
        app.router.add_get("/auth", authed)
        app[PROBE_KEY] = probe
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        # Accepted as they connect (no TCP_DEFER_ACCEPT): these tests are of the cap's rules
        # for idle connections in the order they came; with the deferral an idle one is
        # accepted only after its SYN-ACK retransmits, in the kernel's order
        # (tests/unit/test_syncer_deferred_accept.py has the deferral's own tests).
        site = GuardedSite(
            runner, "127.0.0.1", 0, limits=limits, ssl_context=ssl_context, defer_accept_seconds=0
        )
        await site.start()
        try:
            server = site._server
            assert isinstance(server, DeferredAcceptServer) and isinstance(site.cap, ConnectionCap)
            return await scenario(server.sockets[0].getsockname()[1], site.cap)
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def test_limits_reserve_sizes() -> None:
    # At most 16, at most an eighth of the cap.
    assert [reserve_of(n) for n in (1, 8, 16, 64, 512)] == [0, 1, 2, 8, 16]


@pytest.mark.parametrize(
    ("peer", "prefix"),
    [
        ("10.1.2.3", "10.1.2.0/24"),
        ("127.0.0.200", "127.0.0.0/24"),
        ("::ffff:10.1.2.3", "10.1.2.0/24"),  # IPv4-mapped: its IPv4 network
        ("2001:db8:1:2:3:4:5:6", "2001:db8:1:2::/64"),
        ("", ""),  # no address (a Unix socket): its own
    ],
)
def test_limits_a_peer_shares_its_room_with_its_network(peer: str, prefix: str) -> None:
    assert prefix_of(peer) == prefix


def test_limits_an_idle_flood_makes_room_from_its_own_oldest() -> None:
    async def scenario(port: int, cap: ConnectionCap) -> tuple[bytes, bytes, bytes, dict[str, int]]:
        assert cap.per_peer == 7  # 8 - reserve 1
        cap.min_age = 0.0  # any age may be replaced (the next test keeps the young ones)
        cap.churn_window = 0.0  # and no admission is recent (the churn rule: its own test)
        held = [await open_from(port, FLOOD) for _ in range(8)]  # idle: no request sent
        # The 8th took the place of the first (closed by the server: read to its end).
        first = await asyncio.wait_for(held[0][0].read(), READ_TIMEOUT)
        # A neighbour of the flood's /24 shares its room: it takes the oldest's place too.
        neighbour = await ask(port, NEIGHBOUR, GET_HEALTHZ)
        second = await asyncio.wait_for(held[1][0].read(), READ_TIMEOUT)
        peers = dict(cap.peers)
        for _, w in held:
            w.close()
        return first, neighbour, second, peers

    first, neighbour, second, peers = serving(HttpLimits(max_connections=8), scenario)
    assert first == b"" and second == b""  # evicted, not answered
    assert neighbour.startswith(b"HTTP/1.1 200") and b'{"ok": true}' in neighbour, neighbour
    assert peers == {FLOOD: 6}  # the neighbour's connection was closed by then


def test_limits_a_full_cap_of_authenticated_connections_still_answers_probes() -> None:
    async def scenario(port: int, cap: ConnectionCap) -> tuple[bytes, bytes, bytes]:
        reader, writer = await open_from(port, FLOOD)  # authenticated, kept alive: no room left
        writer.write(b"GET /auth HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(reader.readuntil(b"}"), READ_TIMEOUT)).startswith(
            b"HTTP/1.1 200"
        )
        assert cap.open == 1 and not cap.waiting
        busy_probe = await ask(port, PROBE, b"GET /healthz?strict=1 HTTP/1.1\r\nHost: x\r\n\r\n")
        busy_other = await ask(port, PROBE, b"GET /auth HTTP/1.1\r\nHost: x\r\n\r\n")
        silent = await ask(port, PROBE, b"")  # no request line: busy after PROBE_WAIT
        writer.close()
        return busy_probe, busy_other, silent

    busy_probe, busy_other, silent = serving(HttpLimits(max_connections=1), scenario)
    assert busy_probe.startswith(b"HTTP/1.1 200"), busy_probe
    assert busy_probe.endswith(b'{"ok": true, "route": "/healthz", "strict": true}')
    assert busy_other.startswith(b"HTTP/1.1 503") and b'"busy"' in busy_other, busy_other
    assert silent.startswith(b"HTTP/1.1 503") and b'"busy"' in silent, silent


def test_limits_an_unauthenticated_connection_is_closed_after_its_time() -> None:
    async def scenario(port: int, cap: ConnectionCap) -> tuple[bytes, bytes, int]:
        cap.unauthenticated_seconds = 0.2
        kept_reader, kept = await open_from(port, PROBE)
        kept.write(b"GET /auth HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.wait_for(kept_reader.readuntil(b"}"), READ_TIMEOUT)
        idle_reader, idle = await open_from(port, FLOOD)
        closed = await asyncio.wait_for(idle_reader.read(), READ_TIMEOUT)  # the server closed it
        # The authenticated one outlived it and still answers.
        kept.write(b"GET /auth HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        again = await asyncio.wait_for(kept_reader.read(), READ_TIMEOUT)
        idle.close()
        kept.close()
        return closed, again, cap.silent

    closed, again, silent = serving(HttpLimits(max_connections=8), scenario)
    assert closed == b"" and silent == 1
    assert again.startswith(b"HTTP/1.1 200"), again


def test_limits_a_young_connection_is_not_replaced() -> None:
    """A connection younger than MIN_AGE keeps its place (a probe's request may still be on its
    way behind a burst): one more from the full address is answered busy instead."""

    async def scenario(port: int, cap: ConnectionCap) -> tuple[bytes, int]:
        assert cap.min_age == 1.0
        held = [await open_from(port, FLOOD) for _ in range(8)]
        busy = await asyncio.wait_for(held[7][0].read(), READ_TIMEOUT)
        evictions = cap.evictions
        for _, w in held:
            w.close()
        return busy, evictions

    busy, evictions = serving(HttpLimits(max_connections=8), scenario)
    assert busy.startswith(b"HTTP/1.1 503") and b'"busy"' in busy, busy
    assert evictions == 0


def test_limits_a_talking_connection_is_replaced_once_talking_age_old() -> None:
    """Audit of 2026-12-01: connections that each sent one byte were never replaced, so they held
    every connection until their time ran out. Now the oldest of them goes once it is
    TALKING_AGE old (the silent ones first); a younger one keeps its place."""

    async def scenario(port: int, cap: ConnectionCap) -> tuple[bytes, bytes, bytes, int]:
        assert cap.talking_age == 2.0  # 2 x MIN_AGE
        cap.min_age = 0.0
        cap.churn_window = 0.0  # no admission is recent (the churn rule: its own test)
        held = [await open_from(port, FLOOD) for _ in range(7)]  # per_peer 7 of 8: its share
        for _, w in held:
            w.write(b"G")  # a byte of a request line: talking, never authenticated
        await server_side(lambda: len(cap.talking) == 7)  # the server has read every byte
        assert not cap.waiting
        # Young talkers: one more from the flood's /24 finds no room to take.
        young = await ask(port, NEIGHBOUR, GET_HEALTHZ)
        cap.talking_age = 0.0  # as if TALKING_AGE had passed: the oldest goes, the first held
        neighbour = await ask(port, NEIGHBOUR, GET_HEALTHZ)
        first = await asyncio.wait_for(held[0][0].read(), READ_TIMEOUT)
        evictions = cap.evictions
        for _, w in held:
            w.close()
        return young, neighbour, first, evictions

    young, neighbour, first, evictions = serving(HttpLimits(max_connections=8), scenario)
    # The probe that found no room is still answered (_Busy), as the route would.
    assert young.startswith(b"HTTP/1.1 200") and b'"route": "/healthz"' in young, young
    assert neighbour.startswith(b"HTTP/1.1 200") and b'{"ok": true}' in neighbour, neighbour
    assert first == b"" and evictions == 1


def test_limits_a_churning_prefix_takes_no_other_connections_place() -> None:
    """Audit of 2026-12-01: a churn of connections, each closed before MIN_AGE, kept every
    connection young, and young ones are never replaced: an island's new connection got 503.
    Now a prefix admitted young_share connections within churn_window (MIN_AGE) takes no
    other's place: its next max(RESERVE_CONNECTIONS, 32 // 2) = 16 are answered busy, the rest
    closed unanswered.
    Cap 32: reserve_of(32) = min(16, 32 // 8) = 4 = young_share; per_peer 32 - 4 = 28."""
    churn, other, newcomer = "127.0.1.2", "127.0.2.2", "127.0.3.2"  # three /24s
    auth = GET_HEALTHZ.replace(b"/healthz", b"/auth")

    async def refused(source: str) -> bytes:
        try:
            return await ask(port_of[0], source, auth)
        except ConnectionResetError:
            return b""

    port_of: list[int] = []

    async def scenario(port: int, cap: ConnectionCap) -> tuple[list[bytes], bytes, int, int, int]:
        port_of.append(port)
        assert cap.young_share == 4 and cap.per_peer == 28 and cap.churn_window == 1.0
        cap.min_age = 0.0  # any connection may be replaced by age (the churn rule alone)
        held = [await open_from(port, churn) for _ in range(4)]  # 4 admitted within 1 s
        held += [await open_from(port, other) for _ in range(28)]  # the cap's 32 taken
        await server_side(lambda: cap.open == 32)  # the server has accepted them all
        # 17 more of the churning /24 would each take the oldest's place: the first 16 are
        # answered busy instead, the 17th closed unanswered.
        answers = [await refused(churn) for _ in range(17)]
        # Shed from here on; a probe of the churning /24 whose request is in the socket before
        # the server accepts it is still answered (one read at accept), an /auth request not.
        sent_first = [await sent_before_accept(port, churn, r) for r in (GET_HEALTHZ, auth)]
        evictions, shed_at_accept = cap.evictions, cap.shed_at_accept
        # A newcomer's /24 admitted none: it takes the oldest's place (the churn's first).
        answer = await ask(port, newcomer, GET_HEALTHZ)
        for _, w in held:
            w.close()
        return answers + sent_first, answer, evictions, cap.evictions, shed_at_accept

    answers, answer, before, after, shed = serving(HttpLimits(max_connections=32), scenario)
    assert all(a.startswith(b"HTTP/1.1 503") and b'"busy"' in a for a in answers[:16]), answers
    assert answers[16] == b""  # shed: no _Busy held open for each of a churn's thousands
    probe_answer, auth_answer = answers[17:]
    assert probe_answer.startswith(b"HTTP/1.1 200") and b'"route": "/healthz"' in probe_answer
    assert auth_answer == b""  # shed all the same: only a probe is answered
    # The three shed were shed as they were accepted (ConnectionCap.take), no transport made: a
    # churn's thousands a second cost an accept, an admit, a read and a close each.
    assert shed == 3
    assert before == 0  # the churn replaced nobody
    assert answer.startswith(b"HTTP/1.1 200") and b'{"ok": true}' in answer, answer
    assert after == 1  # the newcomer replaced one


@pytest.mark.parametrize("one_byte", [False, True])
def test_limits_a_churning_prefixs_young_connections_make_room(one_byte: bool) -> None:
    """CI of 2026-12-01: a churn admitted while the cap had room filled it with connections too
    young to replace (each lived about a second), and an island's request got 503 busy. Now
    the unauthenticated connections of a prefix admitted young_share within churn_window are
    replaced at any age, silent or having sent a byte (the one-byte churn), the oldest first;
    a prefix that is not churning keeps its young ones (the next test).
    Cap 32: young_share = reserve_of(32) = 4, per_peer 28. Two churning /24s hold 16 each."""
    churn_a, churn_b, newcomer = "127.0.1.2", "127.0.2.2", "127.0.3.2"  # three /24s
    auth = GET_HEALTHZ.replace(b"/healthz", b"/auth")

    async def scenario(port: int, cap: ConnectionCap) -> tuple[bytes, int, bytes, int]:
        cap.min_age = cap.talking_age = 60.0  # no connection here is old enough by age
        cap.churn_window = 60.0  # both /24s stay churning for the whole test
        held = []
        for source in (churn_a, churn_b):
            for _ in range(16):
                reader, writer = await open_from(port, source)
                if one_byte:
                    writer.write(b"G")
                held.append((reader, writer))
        await server_side(lambda: cap.open == 32 and len(cap.talking) == (32 if one_byte else 0))
        oldest = next(iter(cap.waiting or cap.talking))
        answer = await ask(port, newcomer, auth)  # takes the oldest churner's place
        evicted_first = oldest.evicted
        # The evicted one (the first opened) reads its end, unanswered.
        gone = await asyncio.wait_for(held[0][0].read(), READ_TIMEOUT)
        for _, w in held:
            w.close()
        return answer, cap.evictions, gone + (b"evicted" if evicted_first else b""), cap.refused

    answer, evictions, gone, refused = serving(HttpLimits(max_connections=32), scenario)
    assert answer.startswith(b"HTTP/1.1 200") and b'"authenticated": true' in answer, answer
    assert gone == b"evicted"  # the churn's oldest (churn_a's first) went, closed unanswered
    assert evictions == 1 and refused == 0


def test_limits_young_connections_of_quiet_prefixes_are_still_kept() -> None:
    """The rule above only for a churning prefix: the cap full of young unauthenticated
    connections from 11 /24s of 3 each (under young_share 4 a window: none churning), a
    newcomer's request finds no room and is answered 503 busy, no connection replaced.
    Cap 32: 11 x 3 = 33 - 1 (the last /24 opens 2)."""
    auth = GET_HEALTHZ.replace(b"/healthz", b"/auth")

    async def scenario(port: int, cap: ConnectionCap) -> tuple[bytes, int]:
        cap.min_age = cap.talking_age = 60.0
        cap.churn_window = 60.0
        sources = [f"127.0.{10 + i}.2" for i in range(11) for _ in range(3)][:32]
        held = [await open_from(port, source) for source in sources]
        await server_side(lambda: cap.open == 32)
        answer = await ask(port, "127.0.3.2", auth)
        for _, w in held:
            w.close()
        return answer, cap.evictions

    answer, evictions = serving(HttpLimits(max_connections=32), scenario)
    assert answer.startswith(b"HTTP/1.1 503") and b'"busy"' in answer, answer
    assert evictions == 0


def test_limits_connections_that_authenticated_do_not_make_their_prefix_churn() -> None:
    """CI of c2152aa: an island's heartbeats on new connections, 9 within a second while a
    flood held the cap, made its /24 a churning one (young_share admissions within
    churn_window) and the 9th got 503 busy where it would have taken a flood connection's
    place. Now an admission whose connection authenticated is no longer counted: the island
    opens 6 (> young_share 4) within the window, each kept open so each must replace one,
    and all 6 are answered 200, 6 flood connections replaced.
    Cap 32: young_share = reserve_of(32) = 4; the flood 11 /24s of 3 (none churning)."""
    keep_alive = b"GET /auth HTTP/1.1\r\nHost: x\r\n\r\n"

    async def authenticated_and_held(port: int) -> tuple[bytes, asyncio.StreamWriter]:
        reader, writer = await open_from(port, "127.0.3.2")
        writer.write(keep_alive)
        answer = b""
        async with asyncio.timeout(READ_TIMEOUT):
            while not answer.startswith(b"HTTP/1.1 503") and b"true}" not in answer:
                chunk = await reader.read(4096)
                if not chunk:
                    break
                answer += chunk
        return answer, writer

    async def scenario(port: int, cap: ConnectionCap) -> tuple[list[bytes], int, int]:
        cap.min_age = cap.talking_age = 0.0  # the flood's connections are replaceable by age
        cap.churn_window = 60.0  # the island's 6 admissions all fall within one window
        sources = [f"127.0.{10 + i}.2" for i in range(11) for _ in range(3)][:32]
        held = [(await open_from(port, source))[1] for source in sources]
        await server_side(lambda: cap.open == 32)
        answers = []
        for _ in range(6):
            answer, writer = await authenticated_and_held(port)
            answers.append(answer)
            held.append(writer)
        for w in held:
            w.close()
        return answers, cap.evictions, cap.refused

    answers, evictions, refused = serving(HttpLimits(max_connections=32), scenario)
    assert all(a.startswith(b"HTTP/1.1 200") and b'"authenticated": true' in a for a in answers), (
        answers
    )
    assert evictions == 6 and refused == 0


def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A certificate valid for IP 127.0.0.1 (its own CA) and its key (the openssl CLI)."""
    return make_certificate(tmp_path)


TLS_RECORD_HEADER = (
    b"\x16\x03\x01\x01\x01"  # a handshake record of 257 bytes begins: a handshake waits
)
OTHER_NETWORK = "127.0.9.1"  # not FLOOD's /24


def test_limits_tls_a_churning_prefix_starts_few_handshakes_and_another_gets_in(
    tmp_path: Path,
) -> None:
    """Under TLS the ConnectionCap sees a connection only once its handshake is done, so a
    churn of connections that each send a TLS record's header and nothing more was never
    counted or replaced: each held a handshake (until the header timeout, 60 s here) and an
    island's heartbeats over HTTPS timed out (bench/log/2026-12-01.md, "healthz_flood --churn
    --target syncer --tls"). Now one network prefix starts at most HANDSHAKES_PER_PREFIX (32)
    handshakes a window (sockets.handshake_budget): of 100 such connections from FLOOD's /24,
    opened at once, at least 100 - 2 x 32 = 36 (fixed windows: at most two in any second) are
    closed before a handshake, and a client of another /24 is served its /healthz over HTTPS.
    Before the fix none was closed (the wait below timed out)."""
    cert, key = self_signed(tmp_path)
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(str(cert), str(key))
    client_side = ssl.create_default_context(cafile=str(cert))
    many = 100

    async def scenario(port: int, cap: ConnectionCap) -> tuple[int, bytes]:
        writers, reads = [], []
        for _ in range(many):
            reader, writer = await open_from(port, FLOOD)
            writer.write(TLS_RECORD_HEADER)
            writers.append(writer)
            reads.append(asyncio.ensure_future(reader.read()))  # b"" once the server closes it
        try:
            await server_side(
                lambda: sum(r.done() for r in reads) >= many - 2 * HANDSHAKES_PER_PREFIX
            )
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, local_addr=(OTHER_NETWORK, 0), ssl=client_side
            )
            writer.write(GET_HEALTHZ)
            answer = await asyncio.wait_for(reader.read(), READ_TIMEOUT)
            writer.close()
            return sum(r.done() for r in reads), answer
        finally:
            for r in reads:
                r.cancel()
            for w in writers:
                w.close()

    closed, answer = serving(
        HttpLimits(header_timeout=60.0, max_connections=512), scenario, ssl_context=server_context
    )
    assert closed >= many - 2 * HANDSHAKES_PER_PREFIX, closed
    assert answer.startswith(b"HTTP/1.1 200"), answer


def test_limits_a_connection_replaced_before_its_transport_is_made_is_shut() -> None:
    """ConnectionCap.take admits a connection as it is accepted, before its transport is made;
    one replaced meanwhile has its socket shut down (its peer reads the end), not left open
    and uncounted. Cap 1 (per_peer 1), any age replaceable."""

    async def scenario() -> tuple[bool, bool, int, int, bytes]:
        cap = ConnectionCap(web.Server(healthz), 1)
        cap.min_age = 0.0
        with socket.create_server(("127.0.0.1", 0)) as listener:
            port = listener.getsockname()[1]
            clients, taken = [], []
            try:
                for source in ("127.0.1.2", "127.0.2.2"):  # two /24s
                    clients.append(socket.create_connection(("127.0.0.1", port), 10, (source, 0)))
                    conn, peer = listener.accept()
                    conn.setblocking(False)
                    taken.append(cap.take(conn, peer))
                first, second = taken
                assert first is not None and second is not None  # both admitted at accept
                read = clients[0].recv(1)  # blocking, within the timeout: the end, or a hang
                return (
                    first.evicted,
                    second.admitted,
                    cap.open,
                    cap.evictions,
                    read,
                )
            finally:
                for c in clients:
                    c.close()

    evicted, admitted, open_, evictions, read = asyncio.run(scenario())
    assert evicted and admitted and (open_, evictions) == (1, 1)
    assert read == b""  # the replaced one's socket was shut down


def test_limits_a_failed_tls_handshake_is_uncounted(tmp_path: Path) -> None:
    """Under TLS a connection is counted from its accept (ConnectionCap.take), through its
    handshake; one whose handshake fails (a churn's one byte) is uncounted, not left taking a
    place for ever."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(*self_signed(tmp_path))

    async def scenario(port: int, cap: ConnectionCap) -> tuple[int, int, bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"G\r\n\r\n")  # not a TLS record: the handshake fails
        answer = await asyncio.wait_for(reader.read(), READ_TIMEOUT)
        writer.close()
        await server_side(lambda: len(cap.recent) == 1 and cap.open == 0)
        return len(cap.recent), cap.open, answer

    noted, open_, answer = serving(HttpLimits(), scenario, ssl_context=context)
    assert (noted, open_) == (1, 0)  # admitted at accept, uncounted when its handshake failed
    assert b"HTTP" not in answer
