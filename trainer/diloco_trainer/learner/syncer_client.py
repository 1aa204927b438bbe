"""The learner's (and tools') async client of the syncer: JSON routes plus tensor bodies."""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
import safetensors.torch
import torch

from diloco_trainer.api.protocol import (
    KIND_FULL,
    KIND_UPDATES,
    META_CHECKSUM,
    META_CODEC,
    META_FINISHED,
    META_FRAGMENT,
    META_FROM_VERSION,
    META_KIND,
    META_OUTER_STEP,
    META_VERSION,
    ROUTE_FRAGMENT,
    ROUTE_HEARTBEAT,
    ROUTE_ISLAND,
    ROUTE_JOIN,
    ROUTE_LEAVE,
    ROUTE_PUSH,
    ROUTE_STATUS,
    SAFETENSORS_CONTENT_TYPE,
    JoinInfo,
    PushMeta,
    SyncerError,
)
from diloco_trainer.api.protocol import backoff as _backoff
from diloco_trainer.api.protocol import error_message as _error_message
from diloco_trainer.api.protocol import meta_bool as _meta_bool
from diloco_trainer.api.protocol import meta_int as _meta_int
from diloco_trainer.core.payloads import (
    PulledFragment,
    PulledUpdates,
    decode_body,
    split_update_chain,
)

log = logging.getLogger("diloco.wire")

# Server replies that mean "not now" rather than "no": retried like connection failures.
_RETRY_STATUSES = frozenset({502, 503, 504})


class SyncerClient:
    """Async client of the syncer (one aiohttp session, created on first use).

    Connection errors and 502/503/504 are retried with exponential backoff (0.2 s doubling, at most
    5 s apart) until `retry_deadline` seconds have passed since the call began; then SyncerError
    (status 0). Any other non-success status raises SyncerError at once with the syncer's message.
    """

    def __init__(
        self,
        base_url: str,
        token: str,
        ca_file: str | Path | None = None,
        *,
        retry_deadline: float = 600.0,
        request_timeout: float = 120.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.retry_deadline = retry_deadline
        self.request_timeout = request_timeout
        self._ssl: ssl.SSLContext | None = (
            ssl.create_default_context(cafile=str(ca_file)) if ca_file else None
        )
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> SyncerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(ssl=self._ssl) if self._ssl else None
            self._session = aiohttp.ClientSession(
                connector=connector, headers={"Authorization": f"Bearer {self.token}"}
            )
        return self._session

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        data: bytes | None = None,
        params: Mapping[str, str] | None = None,
        extra_timeout: float = 0.0,
        ok: tuple[int, ...] = (200,),
    ) -> tuple[int, bytes]:
        url = self.base_url + path
        deadline = time.monotonic() + self.retry_deadline
        attempt = 0
        headers = {"Content-Type": SAFETENSORS_CONTENT_TYPE} if data is not None else None
        timeout = aiohttp.ClientTimeout(total=self.request_timeout + extra_timeout)
        while True:
            try:
                async with self._get_session().request(
                    method,
                    url,
                    json=json_body,
                    data=data,
                    params=params,
                    headers=headers,
                    timeout=timeout,
                ) as resp:
                    body = await resp.read()
                    if resp.status in ok:
                        return resp.status, body
                    if resp.status not in _RETRY_STATUSES:
                        raise SyncerError(resp.status, *_error_message(body))
                    problem = f"syncer answered {resp.status}"
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as err:
                problem = f"{type(err).__name__}: {err}"
            delay = _backoff(attempt)
            if time.monotonic() + delay > deadline:
                raise SyncerError(
                    0,
                    f"syncer {self.base_url} unreachable for {self.retry_deadline:.0f}s "
                    f"({method} {path}): {problem}",
                )
            log.warning("syncer unreachable, retrying in %.1fs (%s)", delay, problem)
            await asyncio.sleep(delay)
            attempt += 1

    async def _json(self, method: str, path: str, body: Any = None, **kw: Any) -> dict[str, Any]:
        _, raw = await self._request(method, path, json_body=body, **kw)
        return json.loads(raw)

    async def join(self, island: str, replicas: int) -> JoinInfo:
        """Register (or re-register) an island; returns the fragment layout and versions."""
        doc = await self._json("POST", ROUTE_JOIN, {"island": island, "replicas": replicas})
        return JoinInfo.from_json(doc)

    async def pull_fragment(
        self, fragment: int, *, after: int = -1, wait: float = 0, have: int = -1
    ) -> PulledFragment | PulledUpdates | None:
        """Fragment `fragment`'s global weights if its version is > `after`, waiting up to `wait`
        seconds for one; None when nothing newer came in time.

        With `have` >= 0 (the version this client holds) the syncer may answer with the chain of
        updates since then (PulledUpdates) instead of the full weights (PulledFragment).
        """
        params = {"after": str(after), "wait": str(wait)}
        if have >= 0:
            params["have"] = str(have)
        status, body = await self._request(
            "GET",
            ROUTE_FRAGMENT.format(fragment=fragment),
            params=params,
            extra_timeout=wait,
            ok=(200, 304),
        )
        if status == 304:
            return None
        tensors, meta = decode_body(body)
        version = _meta_int(meta, META_VERSION)
        if meta.get(META_KIND, KIND_FULL) == KIND_UPDATES:
            from_version = _meta_int(meta, META_FROM_VERSION)
            return PulledUpdates(
                fragment=_meta_int(meta, META_FRAGMENT),
                version=version,
                from_version=from_version,
                outer_step=_meta_int(meta, META_OUTER_STEP),
                finished=_meta_bool(meta, META_FINISHED),
                codec=meta.get(META_CODEC, ""),
                checksum=meta.get(META_CHECKSUM, ""),
                updates=split_update_chain(tensors, from_version, version),
            )
        return PulledFragment(
            fragment=_meta_int(meta, META_FRAGMENT),
            version=version,
            outer_step=_meta_int(meta, META_OUTER_STEP),
            finished=_meta_bool(meta, META_FINISHED),
            tensors=tensors,
        )

    async def push(
        self, fragment: int, tensors_encoded: Mapping[str, torch.Tensor], meta: PushMeta
    ) -> dict[str, Any]:
        """Push fragment `fragment`'s encoded pseudo-gradient; returns {"accepted", "version",
        "pending"} (and "duplicate": true when a retry hit an already accepted push)."""
        if not meta.push_id:
            meta = PushMeta(**{**meta.__dict__, "push_id": uuid.uuid4().hex})
        body = safetensors.torch.save(
            {k: v.detach().contiguous() for k, v in tensors_encoded.items()},
            metadata=meta.to_metadata(),
        )
        _, raw = await self._request("POST", ROUTE_PUSH.format(fragment=fragment), data=body)
        return json.loads(raw)

    async def heartbeat(
        self,
        island: str,
        *,
        step: int = 0,
        tokens: int = 0,
        loss: float | None = None,
        step_time: float | None = None,
    ) -> dict[str, Any]:
        """Tell the syncer the island is alive; returns {"state", "finished"}."""
        body = {"island": island, "step": step, "tokens": tokens, "loss": loss}
        body["stepTime"] = step_time
        return await self._json("POST", ROUTE_HEARTBEAT, body)

    async def status(self, digest: bool = False) -> dict[str, Any]:
        """The syncer's status document (with "digest" of weights + momentum when asked)."""
        params = {"digest": "1"} if digest else None
        return await self._json("GET", ROUTE_STATUS, params=params)

    async def set_membership(self, island: str, state: str, reason: str = "") -> dict[str, Any]:
        """Admin: mark an island active or dropped."""
        return await self._json(
            "PUT", ROUTE_ISLAND.format(island=island), {"state": state, "reason": reason}
        )

    async def leave(self, island: str) -> dict[str, Any]:
        """Say goodbye: the island leaves the quorum until it joins again."""
        return await self._json("POST", ROUTE_LEAVE, {"island": island})
