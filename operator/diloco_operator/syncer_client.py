"""A small async client for the two syncer routes the operator uses.

`GET /v1/status` (progress and island states) and `PUT /v1/islands/{island}` (membership), with
the job's bearer token. Connection failures and 5xx answers are retried with exponential backoff
within one short deadline (a few seconds), then reported as SyncerUnavailable: the caller records
a condition and tries again on its next pass, so the operator never blocks on (or crashes because
of) a missing syncer.
The operator image has no torch, so this does not reuse the trainer's wire.SyncerClient.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Any
from urllib.parse import quote

import aiohttp

log = logging.getLogger(__name__)


class SyncerUnavailable(RuntimeError):
    """The syncer did not answer (or answered 5xx) within the retry budget."""


class SyncerRequestError(RuntimeError):
    """The syncer refused a request (4xx); retrying will not help."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"syncer answered {status}: {message}")
        self.status = status


def backoff_delays(budget: float, *, first: float = 0.1, cap: float = 2.0) -> list[float]:
    """Exponential delays (first, 2*first, ... capped) whose sum stays within `budget`."""
    delays, delay, total = [], first, 0.0
    while total + delay <= budget:
        delays.append(delay)
        total += delay
        delay = min(delay * 2, cap)
    return delays


class SyncerClient:
    """Talks to one job's syncer. Reuses one HTTP session; close() it when done."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        ca_data: str | None = None,
        timeout: float = 2.0,
        deadline: float = 3.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"}
        self._ssl: ssl.SSLContext | bool = (
            ssl.create_default_context(cadata=ca_data) if ca_data else True
        )
        self._timeout = timeout
        self._deadline = deadline
        self._delays = backoff_delays(deadline / 2)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> SyncerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(headers=self._headers)
        return self._session

    async def _request(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        url = self.base_url + path
        last = ""
        loop = asyncio.get_running_loop()
        # One deadline for all attempts, so a black-holed syncer costs at most `deadline`.
        deadline = loop.time() + self._deadline
        for attempt in range(len(self._delays) + 1):
            if attempt:
                await asyncio.sleep(self._delays[attempt - 1])
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            try:
                async with self._get_session().request(
                    method,
                    url,
                    json=body,
                    ssl=self._ssl,
                    timeout=aiohttp.ClientTimeout(total=min(self._timeout, remaining)),
                ) as resp:
                    if resp.status >= 500:
                        last = f"{resp.status} {await resp.text()}"
                        continue
                    payload = await resp.json(content_type=None) if resp.content_length != 0 else {}
                    if resp.status >= 400:
                        message = payload.get("error") if isinstance(payload, dict) else payload
                        raise SyncerRequestError(resp.status, str(message))
                    if not isinstance(payload, dict):
                        raise SyncerRequestError(resp.status, "expected a JSON object")
                    return payload
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as err:
                last = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
                log.debug("syncer %s %s failed (%s), attempt %d", method, url, last, attempt + 1)
        raise SyncerUnavailable(f"{method} {url}: {last}")

    async def status(self) -> dict[str, Any]:
        """GET /v1/status: outerStep, tokens, loss, islands{name: {state, lastPush}}, finished."""
        return await self._request("GET", "/v1/status")

    async def set_membership(self, island: str, state: str, reason: str) -> dict[str, Any]:
        """PUT /v1/islands/{island} {"state", "reason"}: drop an island or re-add it."""
        path = f"/v1/islands/{quote(island, safe='')}"
        return await self._request("PUT", path, {"state": state, "reason": reason})
