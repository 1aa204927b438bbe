"""The syncer's probe listener (syncer/edge/probe_listener.py, issue 46): which port it is on in a
pod, what it answers for each route and a stalled event loop, served by a real listener over a
real socket."""

from __future__ import annotations

import http.client
import select
import socket
import ssl
import subprocess
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
from diloco_trainer.api import contract, protocol
from diloco_trainer.syncer.edge import probe_listener as health

from hack.localcluster.polling import poll_until
from hack.localcluster.ports import pick_ports


def _route_answer(route: str, strict: bool) -> tuple[int, dict[str, Any]]:
    """A stand-in for SyncerRoutes.probe that says which route and strictness it was asked."""
    return 200, {"route": route, "strict": strict}


def test_health_port_of_is_the_next_port_or_the_one_before_the_last() -> None:
    assert contract.health_port_of(8470) == 8471
    assert contract.health_port_of(1) == 2
    assert contract.health_port_of(65534) == 65535
    assert contract.health_port_of(65535) == 65534


def test_syncer_env_reads_the_health_port_and_defaults_to_none(tmp_path: Any) -> None:
    token = tmp_path / "token"
    token.write_text("t")
    base = {contract.TOKEN_FILE: str(token), contract.CONFIG_FILE: "spec.json"}
    assert contract.SyncerEnv.from_env(base).health_port == 0
    env = {**base, contract.SYNCER_HEALTH_PORT: "8471"}
    assert contract.SyncerEnv.from_env(env).health_port == 8471


def test_probe_answer_passes_the_route_through_while_the_loop_turns() -> None:
    at_limit = health.LOOP_STALL_SECONDS
    assert health.probe_answer(_route_answer, protocol.ROUTE_HEALTHZ, True, at_limit) == (
        200,
        {"route": "/healthz", "strict": True},
    )
    assert health.probe_answer(_route_answer, protocol.ROUTE_READYZ, False, 0.0) == (
        200,
        {"route": "/readyz", "strict": False},
    )


def test_probe_answer_fails_both_probes_once_the_loop_stalled() -> None:
    stalled = health.LOOP_STALL_SECONDS + 0.5
    status, doc = health.probe_answer(_route_answer, protocol.ROUTE_HEALTHZ, False, stalled)
    assert (status, doc["ok"], doc["code"]) == (503, False, "loop_stalled")
    assert f"{stalled:.1f}s" in doc["error"]
    status, doc = health.probe_answer(_route_answer, protocol.ROUTE_READYZ, False, stalled)
    assert (status, doc["ready"], doc["code"]) == (503, False, "loop_stalled")


def test_probe_answer_refuses_other_routes_even_with_a_stalled_loop() -> None:
    for idle in (0.0, health.LOOP_STALL_SECONDS + 1):
        status, doc = health.probe_answer(_route_answer, protocol.ROUTE_STATUS, False, idle)
        assert (status, doc["code"]) == (404, "not_found")


def test_request_target_reads_the_route_and_strict() -> None:
    assert health.request_target(b"GET /healthz?strict=1 HTTP/1.1\r") == ("/healthz", True)
    assert health.request_target(b"GET /healthz?strict=0&x=1 HTTP/1.1") == ("/healthz", False)
    assert health.request_target(b"GET /readyz HTTP/1.1") == ("/readyz", False)
    assert health.request_target(b"POST /healthz HTTP/1.1") is None
    assert health.request_target(b"") is None


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _get(port: int, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        answer = conn.getresponse()
        return answer.status, answer.read().decode()
    finally:
        conn.close()


@pytest.fixture
def listener() -> Any:
    clock = _Clock()
    port = pick_ports(1, set())[0]
    probes = health.HealthListener(_route_answer, "127.0.0.1", port, clock=clock)
    probes.start()
    try:
        yield probes, port, clock
    finally:
        probes.stop()


def test_listener_answers_probes_on_its_own_thread(listener: Any) -> None:
    probes, port, clock = listener
    assert _get(port, "/healthz?strict=1") == (200, '{"route": "/healthz", "strict": true}')
    assert _get(port, "/readyz")[0] == 200
    assert _get(port, "/v1/status")[0] == 404
    clock.now += health.LOOP_STALL_SECONDS + 1  # no beat from the syncer's loop since
    assert _get(port, "/healthz")[0] == 503
    probes.beat()
    assert _get(port, "/healthz")[0] == 200
    assert probes.thread is not None and probes.thread.is_alive()


def test_listener_start_raises_when_its_port_is_taken(listener: Any) -> None:
    _, port, _ = listener
    with pytest.raises(OSError):
        health.HealthListener(_route_answer, "127.0.0.1", port).start()


def test_listener_stop_ends_its_thread_and_frees_the_port() -> None:
    port = pick_ports(1, set())[0]
    probes = health.HealthListener(_route_answer, "127.0.0.1", port)
    probes.start()
    probes.stop()
    assert probes.thread is not None and not probes.thread.is_alive()
    with pytest.raises(ConnectionRefusedError):
        _get(port, "/healthz")


def _closed_unanswered(sock: socket.socket) -> bool:
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True


def test_listener_closes_the_oldest_connection_beyond_max_open() -> None:
    port = pick_ports(1, set())[0]
    # Idle connections wait for their request line longer than the test: only the cap closes one
    # (the accept budget, test_listener_sheds_silent_connections_of_a_prefix_past_its_budget's,
    # is lifted past them).
    probes = health.HealthListener(
        _route_answer, "127.0.0.1", port, wait=60.0, accept_budget=health.MAX_OPEN + 1
    )
    probes.start()
    held = [socket.create_connection(("127.0.0.1", port), timeout=30)]
    try:
        # The first is open (a byte short of a request line keeps it waiting, unanswered) ...
        held[0].sendall(b"GET /hea")
        held += [
            socket.create_connection(("127.0.0.1", port), timeout=30)
            for _ in range(health.MAX_OPEN)
        ]
        # ... until one more than MAX_OPEN are: closed without an answer (a reset when its bytes
        # were still unread), the newest kept.
        assert _closed_unanswered(held[0])
        held[-1].sendall(b"GET /readyz HTTP/1.1\r\n\r\n")
        assert held[-1].recv(1024).startswith(b"HTTP/1.1 200 OK")
        assert _get(port, "/healthz")[0] == 200
    finally:
        for sock in held:
            sock.close()
        probes.stop()


def test_listener_closes_a_connection_without_a_request_line(listener: Any) -> None:
    _, port, _ = listener
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /healthz")  # no line end: closed unanswered after PROBE_WAIT
        assert _closed_unanswered(sock)


def test_listener_serves_https_with_the_syncer_port_certificate(tmp_path: Any) -> None:
    """With TLS the pod's probes keep their HTTPS scheme: the listener takes the syncer port's
    context."""
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"),
            *("-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
    )
    server_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_side.load_cert_chain(str(cert), str(key))
    port = pick_ports(1, set())[0]
    probes = health.HealthListener(_route_answer, "127.0.0.1", port, ssl_context=server_side)
    probes.start()
    try:
        client = ssl.create_default_context(cafile=str(cert))
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=client)
        conn.request("GET", "/readyz")
        answer = conn.getresponse()
        assert (answer.status, answer.read()) == (200, b'{"route": "/readyz", "strict": false}')
        conn.close()
    finally:
        probes.stop()


@dataclass(eq=False)
class _Conn:
    prefix: str


def test_make_room_closes_the_oldest_of_the_prefix_holding_the_most() -> None:
    """Audit of 2026-12-01: the oldest of all went, so a churn of a pod's connections closed the
    kubelet's probe before its request was read. Hand-worked: the kubelet's one connection (the
    oldest of all) stays while a flood prefix holds more."""
    kubelet, a1, a2, b1, a3 = (
        _Conn("10.0.0.0/24"),
        _Conn("10.1.0.0/24"),
        _Conn("10.1.0.0/24"),
        _Conn("10.2.0.0/24"),
        _Conn("10.1.0.0/24"),
    )
    open_ = dict.fromkeys([kubelet, a1, a2, b1, a3])
    per_prefix = Counter(c.prefix for c in open_)  # 10.1: 3, 10.0: 1, 10.2: 1
    assert health.make_room(open_, per_prefix) is a1
    # Equal counts: the prefix of the oldest connection, its oldest (the old rule's choice).
    even = dict.fromkeys([kubelet, b1])
    assert health.make_room(even, Counter(c.prefix for c in even)) is kubelet


def test_accept_budget_sheds_a_prefix_past_its_budget_within_a_window() -> None:
    """Hand-worked, budget 2 a window of 1 s: a prefix's third connection within its window is
    shed (and not counted), another prefix has a budget of its own, and a window starts anew at
    the first connection after the last one ended."""
    budget = health.AcceptBudget(2, 1.0)
    a, b = "10.1.0.0/24", "10.2.0.0/24"
    assert budget.admit(a, 0.0)  # a's window [0, 1): 1 served
    assert budget.admit(a, 0.5)  # 2 served: the budget
    assert not budget.admit(a, 0.9)  # a third within the window: shed
    assert budget.admit(b, 0.9)  # b's own window [0.9, 1.9): 1 served
    assert budget.admit(a, 1.0)  # 1.0 - 0.0 >= 1.0: a's window [1, 2), 1 served
    assert budget.admit(a, 1.5)  # 2 served
    assert not budget.admit(a, 1.99)  # shed again
    assert budget.windows == {a: (1.0, 2), b: (0.9, 1)}  # shed connections counted nowhere


def test_whole_request_is_a_line_end_or_head_bytes() -> None:
    assert health.whole_request(b"GET /healthz HTTP/1.1\r\nHost: x")
    assert not health.whole_request(b"GET /healthz HTTP/1.1")  # its line end still to come
    assert not health.whole_request(b"x" * (health.HEAD_BYTES - 1))
    assert health.whole_request(b"x" * health.HEAD_BYTES)  # as much as is read: answered 400


def test_listener_sheds_silent_connections_of_a_prefix_past_its_budget() -> None:
    """Issue 46: a churn of connections that never send costs the listener an accept and a close
    each once their prefix is past its AcceptBudget; a probe of the same prefix whose request is
    in when it is accepted is answered all the same."""
    port = pick_ports(1, set())[0]
    # A window longer than the test and a wait for request lines as long: only the budget closes.
    probes = health.HealthListener(
        _route_answer, "127.0.0.1", port, wait=60.0, accept_budget=2, accept_window=60.0
    )
    probes.start()
    silent = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(3)]
    try:
        # Silent, they are accepted once their deferral ends (TCP_DEFER_ACCEPT): two are served
        # (open, waiting for a request line), the third is closed unread.
        poll_until(
            lambda: probes.shed == 1 and len(probes.open) == 2,
            timeout=20,
            interval=0.01,
            what="the third one shed",
        )
        closed, _, _ = select.select(silent, [], [], 10)
        assert len(closed) == 1 and _closed_unanswered(closed[0])
        # A probe from the same prefix (127.0.0.0/24), past its budget, is answered: its request
        # is in when it is accepted, and it is answered there, no transport made.
        assert _get(port, "/healthz") == (200, '{"route": "/healthz", "strict": false}')
        # (the listener counts it after its answer is sent)
        poll_until(
            lambda: probes.answered_at_accept == 1,
            timeout=20,
            interval=0.01,
            what="the probe counted as answered",
        )
        assert probes.shed == 1 and len(probes.open) == 2
    finally:
        for sock in silent:
            sock.close()
        probes.stop()


def test_listener_sheds_partial_requests_of_many_prefixes_past_the_total_budget() -> None:
    """Audit36 (the repeat audit of 2026-12-01): connections that each send one byte, from many
    /24s, were each within their prefix's AcceptBudget, and 64 /24s at 32 a second held the
    kubelet's probe in the accept queue for up to 5 s. Now all prefixes together are served
    at most total_accept_budget a window, read only for a connection its own prefix's budget
    admits (so one churning prefix's shed connections take none of the others' room)."""
    port = pick_ports(1, set())[0]
    # Per prefix 2, all together 3, in a window longer than the test; a long wait for request
    # lines: only the budgets close a connection.
    probes = health.HealthListener(
        _route_answer,
        "127.0.0.1",
        port,
        wait=60.0,
        accept_budget=2,
        accept_window=60.0,
        total_accept_budget=3,
    )
    probes.start()
    held: list[socket.socket] = []

    def one_byte_from(source: str) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0))
        sock.sendall(b"G")  # accepted at once (its first bytes are in), no request line
        held.append(sock)
        return sock

    try:
        # 127.0.1.0/24: 2 served (its budget; the total's count 2), the 3rd shed by its prefix
        # (the total's count stays 2: shed = 1).
        for n in range(3):
            one_byte_from("127.0.1.2")
            poll_until(
                lambda n=n: probes.shed + len(probes.open) == n + 1,
                timeout=20,
                interval=0.01,
                what=f"127.0.1.2's connection {n + 1} taken",
            )
        assert (probes.shed, len(probes.open)) == (1, 2)
        # 127.0.2.0/24, within its own budget: served, the total's count 3 = its budget.
        one_byte_from("127.0.2.2")
        poll_until(lambda: len(probes.open) == 3, timeout=20, interval=0.01, what="127.0.2.2's")
        # 127.0.3.0/24, within its own budget but past the total's: closed unread (shed = 2).
        third = one_byte_from("127.0.3.2")
        poll_until(lambda: probes.shed == 2, timeout=20, interval=0.01, what="127.0.3.2's shed")
        assert len(probes.open) == 3
        closed, _, _ = select.select([third], [], [], 10)
        assert closed == [third] and _closed_unanswered(third)
        # The kubelet's probe, its request in when it is accepted, is answered past both budgets.
        assert _get(port, "/healthz") == (200, '{"route": "/healthz", "strict": false}')
    finally:
        for sock in held:
            sock.close()
        probes.stop()
