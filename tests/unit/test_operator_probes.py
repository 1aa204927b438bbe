"""The operator's readiness follows whether the API server answers (probes.py, kube.py): a call
that times out makes it not ready, the next answer ready again; liveness stays up."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
import urllib3
from aiohttp.test_utils import TestClient, TestServer
from diloco_operator import kube as kube_module
from diloco_operator import probes
from diloco_operator.kube import ApiUnavailable, Kube
from diloco_operator.probes import ApiHealth
from kubernetes.client.exceptions import ApiException


class Clock:
    """Monotonic seconds that move a little on every reading (and jump when told)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 0.001
        return self.now


def test_operator_probes_ready_follows_answers_and_failures() -> None:
    clock = Clock()
    health = ApiHealth(clock=clock)
    assert health.ready() == (False, "the API server has not answered yet")
    health.answered()
    assert health.ready() == (True, "")
    clock.now += 1
    health.unanswered("ReadTimeoutError: read timed out")
    ready, why = health.ready()
    assert not ready and "ReadTimeoutError" in why
    clock.now += 1
    health.answered()
    assert health.ready() == (True, "")
    clock.now += probes.STALE_AFTER + 1  # nothing answered for a while (a call may hang)
    ready, why = health.ready()
    assert not ready and "no answer" in why


def test_operator_probes_endpoints_report_readiness_and_liveness() -> None:
    clock = Clock()
    health = ApiHealth(clock=clock)

    async def scenario() -> list[tuple[int, int]]:
        async with TestClient(TestServer(probes.health_app(health))) as client:
            codes = []
            for outcome in (health.answered, lambda: health.unanswered("timed out")):
                outcome()
                ready = await client.get("/readyz")
                live = await client.get("/healthz")
                codes.append((ready.status, live.status))
            return codes

    assert asyncio.run(scenario()) == [(200, 200), (503, 200)]


def _kube_with(health: ApiHealth, monkeypatch: pytest.MonkeyPatch) -> Kube:
    monkeypatch.setattr(kube_module, "API_HEALTH", health)
    return Kube.__new__(Kube)  # _run needs no client


def test_operator_probes_calls_carry_timeouts_and_report_their_outcome(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    health = ApiHealth(clock=Clock())
    kube = _kube_with(health, monkeypatch)
    seen: dict[str, Any] = {}

    def answers(**kwargs: Any) -> str:
        seen.update(kwargs)
        return "ok"

    def times_out(**kwargs: Any) -> str:
        raise urllib3.exceptions.ReadTimeoutError(None, "/api", "Read timed out.")  # type: ignore[arg-type]

    def refuses(**kwargs: Any) -> str:
        raise ApiException(status=409, reason="Conflict")

    assert asyncio.run(kube._run(answers)) == "ok"
    assert seen["_request_timeout"] == (kube_module.CONNECT_TIMEOUT, kube_module.READ_TIMEOUT)
    assert health.ready()[0]
    with pytest.raises(ApiUnavailable):
        asyncio.run(kube._run(times_out))
    assert not health.ready()[0]
    with pytest.raises(ApiException):
        asyncio.run(kube._run(refuses))
    assert health.ready()[0]  # an error status is an answer


def test_operator_probes_a_silent_api_server_ends_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that accepts the connection and never answers: the call fails on its deadline."""
    health = ApiHealth(clock=Clock())
    kube = _kube_with(health, monkeypatch)
    monkeypatch.setattr(kube_module, "READ_TIMEOUT", 0.5)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/version"
    pool = urllib3.PoolManager(retries=False)

    def call(_request_timeout: tuple[float, float]) -> Any:
        connect, read = _request_timeout
        return pool.request("GET", url, timeout=urllib3.Timeout(connect=connect, read=read))

    try:
        with pytest.raises(ApiUnavailable):
            asyncio.run(kube._run(call))
    finally:
        listener.close()
    assert not health.ready()[0]
