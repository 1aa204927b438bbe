"""The syncer port's accepts (edge/sockets.py): deferred until a connection's first bytes, a
connection its peer closed before sending a byte closed on the spot, no protocol made (audit46:
a churn of silent connections to the syncer port kept an island's heartbeats out), and the
kernel's accept lanes, known network prefixes apart from the rest (a churn that outpaces the
accepts fills only the others' queue)."""

from __future__ import annotations

import asyncio
import select
import socket

import pytest
from diloco_trainer.syncer.edge.sockets import (
    KNOWN_PREFIXES,
    DeferredAcceptServer,
    lane_program,
    laned_sockets,
    listening_sockets,
    peer_closed,
)


class _Echo(asyncio.Protocol):
    """Answers its first bytes with them, counting the protocols made."""

    made = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        _Echo.made += 1
        assert isinstance(transport, asyncio.WriteTransport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)


def test_listening_socket_defers_accepts() -> None:
    (sock,) = listening_sockets("127.0.0.1", 0, backlog=8)
    try:
        # Linux reads TCP_DEFER_ACCEPT back rounded up to whole SYN-ACK retransmit periods:
        # DEFER_ACCEPT_SECONDS = 1 reads back as at least 1 (0 would mean no deferral).
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT) >= 1
        assert sock.getblocking() is False
    finally:
        sock.close()


def test_peer_closed_reads_end_of_stream_only() -> None:
    a, b = socket.socketpair()
    try:
        b.setblocking(False)
        assert peer_closed(b) is False  # nothing sent yet: open
        a.send(b"G")
        assert peer_closed(b) is False  # a byte in: open, and the byte still there (peeked)
        assert b.recv(1) == b"G"
        a.close()
        assert peer_closed(b) is True  # end of stream
    finally:
        b.close()


def test_a_connection_closed_before_accept_gets_no_protocol() -> None:
    async def scenario() -> tuple[int, int, bytes]:
        _Echo.made = 0
        server = DeferredAcceptServer(
            listening_sockets("127.0.0.1", 0, backlog=8), _Echo, backlog=8
        )
        port = server.sockets[0].getsockname()[1]
        try:
            loop = asyncio.get_running_loop()
            # Three that connect and close without a byte (the churn), then one that speaks.
            for _ in range(3):
                silent = socket.create_connection(("127.0.0.1", port))
                silent.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"ping")
            echoed = await asyncio.wait_for(reader.readexactly(4), timeout=10)
            writer.close()
            deadline = loop.time() + 10
            while server.closed_unread < 3 and loop.time() < deadline:  # a condition, not a sleep
                await asyncio.sleep(0.01)
            return server.closed_unread, _Echo.made, echoed
        finally:
            server.close()

    closed_unread, made, echoed = asyncio.run(scenario())
    # 3 closed before a byte: accepted (their FIN completes the deferred handshake) and closed
    # with no protocol; 1 that sent "ping": 1 protocol, which answered it.
    assert (closed_unread, made, echoed) == (3, 1, b"ping")


def test_lane_program_steers_known_prefixes_to_lane_0() -> None:
    # ld [net + 12] (the IPv4 source: SKF_NET_OFF = -0x100000, as a u32 0xFFF00000, + 12);
    # and #0xFFFFFF00 (/24); one jeq a network, its jt landing on the last instruction (ret 0,
    # the known lane): from pc 2, 2 + 1 + 2 = 5, from pc 3, 3 + 1 + 1 = 5; else ret 1.
    assert lane_program(["10.1.2.0/24", "192.168.0.0/24"], 24) == [
        (0x20, 0, 0, 0xFFF0000C),
        (0x54, 0, 0, 0xFFFFFF00),
        (0x15, 2, 0, 0x0A010200),
        (0x15, 1, 0, 0xC0A80000),
        (0x06, 0, 0, 1),
        (0x06, 0, 0, 0),
    ]
    # Not IPv4 networks of the lanes' bits: skipped (an IPv6 /64, a /16, a peer with no
    # address); none left: every packet to the others' lane.
    assert lane_program(["fd00::/64", "127.0.0.0/16", "peer"], 24) == [
        (0x20, 0, 0, 0xFFF0000C),
        (0x54, 0, 0, 0xFFFFFF00),
        (0x06, 0, 0, 1),
        (0x06, 0, 0, 0),
    ]


def test_lane_program_keeps_the_most_recent_prefixes_its_jumps_reach() -> None:
    prefixes = [f"10.0.{i}.0/24" for i in range(KNOWN_PREFIXES + 1)]
    program = lane_program(prefixes, 24)
    tests = [ins for ins in program if ins[0] == 0x15]
    # 10.0.0.0/24, the oldest, dropped; the first test jumps over the 199 after it and ret 1.
    assert len(tests) == KNOWN_PREFIXES and tests[0] == (0x15, KNOWN_PREFIXES, 0, 0x0A000100)
    assert max(jt for _, jt, _, _ in program) <= 255


def _lane_of(socks: list[socket.socket], port: int, source: str) -> list[int]:
    """The indexes of `socks` a connection from `source` is queued in (accepted and closed)."""
    with socket.socket() as client:
        client.bind((source, 0))
        client.connect(("127.0.0.1", port))
        ready, _, _ = select.select(socks, [], [], 5)
        for sock in ready:
            conn, _ = sock.accept()
            conn.close()
    return [socks.index(sock) for sock in ready]


def test_laned_sockets_queue_an_authenticated_prefix_apart() -> None:
    """The real kernel's steering: a connection from a prefix the lanes were told of is queued in
    the known lane's socket (index 0), any other in the others' (1)."""
    socks, lanes = laned_sockets("127.0.0.1", 0, backlog=8, defer_seconds=0)
    try:
        assert len(socks) == 2 and lanes.steered
        port = socks[0].getsockname()[1]
        assert socks[1].getsockname()[1] == port
        assert lanes.others(socks[1]) and not lanes.others(socks[0])
        # None known yet: every connection in the others' lane.
        assert [_lane_of(socks, port, "127.0.5.1") for _ in range(3)] == [[1]] * 3
        lanes.known("127.0.5.0/24")
        assert [_lane_of(socks, port, "127.0.5.9") for _ in range(3)] == [[0]] * 3
        assert [_lane_of(socks, port, "127.0.6.1") for _ in range(3)] == [[1]] * 3
    finally:
        for sock in socks:
            sock.close()


def test_laned_sockets_refuse_a_port_another_listener_holds() -> None:
    """SO_REUSEPORT would let a second syncer of the same user share a fixed port with the
    first: it is refused as without lanes."""
    socks, _ = laned_sockets("127.0.0.1", 0, backlog=8)
    port = socks[0].getsockname()[1]
    try:
        with pytest.raises(OSError):
            laned_sockets("127.0.0.1", port, backlog=8)
    finally:
        for sock in socks:
            sock.close()
    again, _ = laned_sockets("127.0.0.1", port, backlog=8)  # free again once they are closed
    for sock in again:
        sock.close()
