"""The operator's liveness and readiness: /healthz and /readyz on --health-port.

Liveness (/healthz) is the event loop answering at all. Readiness (/readyz) is the API server
answering the operator: every Kubernetes call reports its outcome here (kube.py), and a probe
asks the API server for its version every PROBE_INTERVAL seconds, so an API server that accepts
connections and never answers makes the operator not ready within about PROBE_INTERVAL +
kube.PROBE_TIMEOUT seconds, instead of leaving it hung and green; the next answer makes it ready
again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web

from diloco_operator import metrics

log = logging.getLogger("diloco_operator")

PROBE_INTERVAL = 5.0
# Without an answer for this long (no call answered, the probe included), the operator is not
# ready even when no call has failed yet (one may be waiting for its timeout).
STALE_AFTER = 20.0


@dataclass
class ApiHealth:
    """When the API server last answered and last failed to (monotonic seconds)."""

    clock: Callable[[], float] = time.monotonic
    last_answer: float | None = None
    last_failure: float | None = None
    failure: str = ""
    started: float = field(default=0.0)

    def __post_init__(self) -> None:
        self.started = self.clock()

    def answered(self) -> None:
        """A call got an answer (an HTTP error status counts)."""
        self.last_answer = self.clock()
        metrics.API_READY.set(1)

    def unanswered(self, reason: str) -> None:
        """A call timed out or its connection failed."""
        self.last_failure, self.failure = self.clock(), reason
        metrics.API_READY.set(0)
        log.warning("the API server did not answer: %s", reason)

    def ready(self) -> tuple[bool, str]:
        """(ready, why not): an answer since the last failure, and not too long ago."""
        now = self.clock()
        if self.last_answer is None:
            return False, "the API server has not answered yet"
        if self.last_failure is not None and self.last_failure > self.last_answer:
            return False, f"the API server did not answer: {self.failure}"
        if now - self.last_answer > STALE_AFTER:
            return False, f"no answer from the API server for {now - self.last_answer:.0f}s"
        return True, ""


API_HEALTH = ApiHealth()


async def probe_forever(ping: Callable[[], Awaitable[None]], health: ApiHealth) -> None:
    """Ask the API server every PROBE_INTERVAL seconds (ping records its own outcome)."""
    while True:
        try:
            await ping()
        except Exception as err:  # timeouts are recorded by ping; anything else is too
            if health.last_failure is None or health.last_failure < health.clock() - 1:
                health.unanswered(f"probe failed: {type(err).__name__}")
        await asyncio.sleep(PROBE_INTERVAL)


def health_app(health: ApiHealth) -> web.Application:
    """/healthz (the loop answers) and /readyz (the API server answers us)."""

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def readyz(request: web.Request) -> web.Response:
        ready, why = health.ready()
        if ready:
            return web.json_response({"ready": True})
        return web.json_response({"ready": False, "reason": why}, status=503)

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app


async def serve(port: int, health: ApiHealth, host: str = "0.0.0.0") -> web.AppRunner:
    """Serve health_app on `port`; the runner (cleanup() stops it)."""
    runner = web.AppRunner(health_app(health), handle_signals=False, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
