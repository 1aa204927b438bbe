"""The operator's API discovery against a server that accepts connections and never answers
(issue 22, finding 8): the Kubernetes client's discovery passes no timeout, so building the
client blocked its thread for ever, and every retry of the startup handler left one more such
thread. Now each discovery request has the operator's connect and read timeouts."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest
from diloco_operator import kube
from kubernetes import client


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A real listening socket on loopback that accepts every connection and never answers."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            held.append(conn)  # kept open, never read from or written to

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        server.close()


def test_kube_discovery_ends_against_a_server_that_never_answers(
    silent_server: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kube, "READ_TIMEOUT", 0.2)
    configuration = client.Configuration()
    configuration.host = f"http://127.0.0.1:{silent_server}"
    configuration.retries = 1  # urllib3 retries a read timeout of a GET: once here, not 3 times
    outcome: list[BaseException] = []

    def discover() -> None:
        try:
            kube.Kube(client.ApiClient(configuration))
        except BaseException as err:  # what ended it is checked below
            outcome.append(err)

    thread = threading.Thread(target=discover, daemon=True)
    thread.start()
    # Two reads of 0.2 s each (one retry): a bound with room for a loaded machine. Before the
    # timeout the thread was still waiting on the socket here, and for ever after.
    thread.join(timeout=20)
    assert not thread.is_alive(), "discovery still blocked on a server that never answers"
    assert len(outcome) == 1 and isinstance(outcome[0], kube._UNANSWERED), outcome
