"""The operator's API discovery against a server that accepts connections and never answers
(issue 22, finding 8): the Kubernetes client's discovery passes no timeout, so building the
client blocked its thread for ever, and every retry of the startup handler left one more such
thread. Now each discovery request has the operator's connect and read timeouts."""

from __future__ import annotations

import asyncio
import hashlib
import http.server
import json
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from diloco_operator import kube
from kubernetes import client
from kubernetes.dynamic import DynamicClient


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


def _library_cache_file(host: str) -> Path:
    """Where the client's default discovery keeps its cache for `host` (kubernetes.dynamic)."""
    digest = hashlib.md5(host.encode("utf-8"), usedforsecurity=False).hexdigest()
    return Path(tempfile.gettempdir()) / f"osrcp-{digest}.json"


def test_kube_discovery_asks_the_server_whatever_cache_file_another_process_left(
    silent_server: int,
    slow_discovery: tuple[int, list[float], threading.Event],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The client's default discovery reads a cache file named by the server's URL in the shared
    temporary directory: one an earlier process left for the same address answered discovery
    without a request, so building the client against a server that never answers succeeded
    (the test above flaked when a port came round again). Here the library itself writes that
    file (discovery from a server that answers, moved to the silent server's name): its own
    client then builds against the silent server; the operator's asks the server and fails."""
    served, _, _ = slow_discovery
    answering = client.Configuration()
    answering.host = f"http://127.0.0.1:{served}"
    DynamicClient(client.ApiClient(answering))  # the library's default: writes its cache file
    silent = client.Configuration()
    silent.host = f"http://127.0.0.1:{silent_server}"
    silent.retries = 1
    stale = _library_cache_file(silent.host)
    _library_cache_file(answering.host).replace(stale)
    monkeypatch.setattr(kube, "READ_TIMEOUT", 0.2)
    try:
        DynamicClient(client.ApiClient(silent))  # answered by the file: no request made
        with pytest.raises(kube._UNANSWERED):
            kube.Kube(client.ApiClient(silent))
        assert not list(Path(tempfile.gettempdir()).glob("diloco-operator-discovery-*"))
    finally:
        stale.unlink(missing_ok=True)


# Discovery documents of a small API server: the core group and apps/v1 with StatefulSets.
_DISCOVERY = {
    "/version": {"major": "1", "minor": "36", "gitVersion": "v1.36.4"},
    "/api": {"kind": "APIVersions", "versions": ["v1"]},
    "/api/v1": {"kind": "APIResourceList", "groupVersion": "v1", "resources": []},
    "/apis": {
        "kind": "APIGroupList",
        "groups": [
            {
                "name": "apps",
                "versions": [{"groupVersion": "apps/v1", "version": "v1"}],
                "preferredVersion": {"groupVersion": "apps/v1", "version": "v1"},
            }
        ],
    },
    "/apis/apps/v1": {
        "kind": "APIResourceList",
        "groupVersion": "apps/v1",
        "resources": [
            {
                "name": "statefulsets",
                "singularName": "statefulset",
                "namespaced": True,
                "kind": "StatefulSet",
                "verbs": ["get", "list"],
            }
        ],
    },
}
SLOW_PATH = "/apis/apps/v1"  # asked for when a StatefulSet's resource is first looked up
HOLD_SECONDS = 10.0


@pytest.fixture
def slow_discovery() -> Iterator[tuple[int, list[float], threading.Event]]:
    """A real HTTP server answering discovery; its answer to SLOW_PATH waits (up to HOLD_SECONDS)
    until the test releases it. Yields (port, when SLOW_PATH was asked for, release)."""
    asked: list[float] = []
    release = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            if path == SLOW_PATH:
                asked.append(time.monotonic())
                release.wait(HOLD_SECONDS)
            doc = _DISCOVERY.get(path)
            self.send_response(200 if doc else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps(doc or {"kind": "Status", "code": 404}).encode())

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], asked, release
    finally:
        release.set()
        server.shutdown()
        server.server_close()


def test_a_kinds_first_lookup_runs_off_the_event_loop(
    slow_discovery: tuple[int, list[float], threading.Event],
) -> None:
    """The first call for a kind looks its resource up, which asks the API server. With the
    answer held back, the event loop still runs: it notices the request within moments and
    releases the answer itself. A lookup on the loop held it until the server gave up waiting
    (HOLD_SECONDS), so the loop noticed only then."""
    port, asked, release = slow_discovery
    configuration = client.Configuration()
    configuration.host = f"http://127.0.0.1:{port}"
    k = kube.Kube(client.ApiClient(configuration))

    async def look_up() -> tuple[float, object]:
        call = asyncio.ensure_future(k.get("StatefulSet", "default", "absent"))
        while not asked:  # the loop's own polling: it runs only while the loop is free
            await asyncio.sleep(0.01)
        noticed_after = time.monotonic() - asked[0]
        release.set()
        return noticed_after, await asyncio.wait_for(call, 60)

    noticed_after, answer = asyncio.run(asyncio.wait_for(look_up(), 120))
    assert noticed_after < HOLD_SECONDS / 2, f"the loop was held {noticed_after:.1f}s"
    assert answer is None  # the server has no such StatefulSet: the kind was found, not the object
