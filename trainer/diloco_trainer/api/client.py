"""The one async client of the syncer's JSON routes (torch-free).

The operator, the local runner and the learners all talk to the syncer through SyncerJsonClient;
the learner's SyncerClient (learner/syncer_client.py) adds the two tensor-body routes (pull a
fragment, push a pseudo-gradient) on top of the same request loop.

Retry policy, one for every route: connection failures, timeouts and 502/503/504 answers are
retried with exponential backoff (`backoff`: 0.2 s doubling, at most 5 s apart) until
`retry_deadline` seconds after the call began, then SyncerError with status 0. Each attempt is cut
at `request_timeout` (plus a long-poll's wait) and at the time left before the deadline, so a
syncer that accepts connections and never answers costs the deadline, not the timeout. Any other
unsuccessful status raises SyncerError at once with the syncer's message and code (a 4xx is a
refusal: the same request would be refused again). A success whose body is not the documented JSON
raises SyncerError with code protocol.ERROR_MALFORMED.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import ssl
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar, cast
from urllib.parse import quote

import aiohttp

from diloco_trainer.api.documents import (
    Document,
    DocumentError,
    FragmentMerges,
    HeartbeatAnswer,
    JoinInfo,
    MembershipAnswer,
    MembershipRequest,
    SyncerStatus,
    parse_json_object,
)
from diloco_trainer.api.protocol import (
    ERROR_MALFORMED,
    ROUTE_HEARTBEAT,
    ROUTE_ISLAND,
    ROUTE_JOIN,
    ROUTE_LEAVE,
    ROUTE_MERGES,
    ROUTE_STATUS,
    SAFETENSORS_CONTENT_TYPE,
    SyncerError,
    error_message,
)
from diloco_trainer.api.sharding import (
    URL_SEPARATOR,
    merge_heartbeat,
    merge_join,
    merge_status,
    shard_of,
    split_urls,
)

log = logging.getLogger("diloco.wire")

# Server replies that mean "not now" rather than "no": retried like connection failures.
RETRY_STATUSES = frozenset({502, 503, 504})
# Failures of one attempt that a later attempt may not have (the syncer restarting, a dropped
# connection, a body cut short).
_RETRY_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError)

C = TypeVar("C", bound="SyncerJsonClient")
D = TypeVar("D", bound=Document)
# The shortest attempt: aiohttp reads a total timeout of 0 as "no timeout at all".
_MIN_ATTEMPT_SECONDS = 0.01


def backoff(attempt: int, *, base: float = 0.2, cap: float = 5.0) -> float:
    """Seconds to wait before retry number `attempt` + 1: base, 2*base, 4*base, ... at most cap."""
    return min(cap, base * 2.0**attempt)


class SyncerJsonClient:
    """Async client of one syncer's JSON routes (one aiohttp session, created on first use:
    create, use and close the client inside one event loop).

    `ca_file` (a path) or `ca_data` (PEM text) verify an https syncer against the job's CA;
    `retry_log_level` is the level of the line logged before each retry (the operator, which
    polls and reports failures itself, keeps it at DEBUG).
    """

    def __init__(
        self,
        base_url: str,
        token: str,
        ca_file: str | Path | None = None,
        *,
        ca_data: str | None = None,
        retry_deadline: float = 600.0,
        request_timeout: float = 120.0,
        retry_log_level: int = logging.WARNING,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.retry_deadline = retry_deadline
        self.request_timeout = request_timeout
        self.retry_log_level = retry_log_level
        self._ssl: ssl.SSLContext | None = (
            ssl.create_default_context(cafile=str(ca_file) if ca_file else None, cadata=ca_data)
            if ca_file or ca_data
            else None
        )
        self._session: aiohttp.ClientSession | None = None
        self._shards: list[SyncerJsonClient] | None = None  # see _fan_out

    def shard_clients(self: C) -> list[C]:
        """One client per syncer shard, in shard order, when `base_url` lists several
        (comma-separated, api/sharding.py), each with this client's token, CA and timeouts
        (made once; closing this client closes them); else [self]."""
        if URL_SEPARATOR not in self.base_url:
            return [self]
        if self._shards is None:
            urls = split_urls(self.base_url)
            self._shards = [copy.copy(self) for _ in urls]
            for client, url in zip(self._shards, urls, strict=True):
                client.base_url = url
                client._session = None
                client._shards = None
        # copies of self: of self's class, whatever the attribute's declared type says
        return cast(list[C], self._shards)

    def _fan_out(self) -> list[SyncerJsonClient] | None:
        """The shards' clients when `base_url` lists several syncer shards, else None: the JSON
        routes then ask every shard and read the answers as one syncer's (api/sharding.py), so
        the operator and `diloco run` see a sharded syncer as one."""
        return self.shard_clients() if URL_SEPARATOR in self.base_url else None

    async def __aenter__(self: C) -> C:
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
        """Close the HTTP session (every shard's)."""
        for shard in self._shards or []:
            await shard.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        data: bytes | memoryview | None = None,
        params: Mapping[str, str] | None = None,
        extra_timeout: float = 0.0,
        ok: tuple[int, ...] = (200,),
        headers_out: dict[str, str] | None = None,
    ) -> tuple[int, bytes]:
        """(status, body) of the first answer whose status is in `ok`, under the retry policy
        (module docstring). `data` is sent as a safetensors body, `json_body` as JSON;
        `headers_out`, when given, gets that answer's headers."""
        url = self.base_url + path
        deadline = time.monotonic() + self.retry_deadline
        attempt = 0
        headers = {"Content-Type": SAFETENSORS_CONTENT_TYPE} if data is not None else None
        while True:
            left = max(_MIN_ATTEMPT_SECONDS, deadline - time.monotonic())
            timeout = aiohttp.ClientTimeout(total=min(self.request_timeout + extra_timeout, left))
            try:
                async with self._get_session().request(
                    method,
                    url,
                    json=json_body,
                    data=data,
                    params=params,
                    headers=headers,
                    timeout=timeout,
                    allow_redirects=False,  # the syncer never redirects: a 3xx is an error
                ) as resp:
                    body = await resp.read()
                    if resp.status in ok:
                        if headers_out is not None:
                            headers_out.update(resp.headers)
                        return resp.status, body
                    if resp.status not in RETRY_STATUSES:
                        raise SyncerError(resp.status, *error_message(body))
                    problem = f"syncer answered {resp.status}"
            except _RETRY_ERRORS as err:
                problem = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
            delay = backoff(attempt)
            if time.monotonic() + delay > deadline:
                raise SyncerError(
                    0,
                    f"syncer {self.base_url} unreachable for {self.retry_deadline:g}s "
                    f"({method} {path}): {problem}",
                )
            log.log(
                self.retry_log_level, "syncer unreachable, retrying in %.1fs (%s)", delay, problem
            )
            await asyncio.sleep(delay)
            attempt += 1

    async def document(
        self,
        model: type[D],
        method: str,
        path: str,
        *,
        json_body: Any = None,
        data: bytes | memoryview | None = None,
        params: Mapping[str, str] | None = None,
    ) -> D:
        """The answer to a request, parsed as `model`; SyncerError (code ERROR_MALFORMED, the
        answer's status) when it is not that document."""
        status, raw = await self.request(
            method, path, json_body=json_body, data=data, params=params
        )
        try:
            return model.from_json(parse_json_object(raw, model.__name__))
        except DocumentError as err:
            raise SyncerError(status, f"{method} {path}: {err}", ERROR_MALFORMED) from None

    async def join(self, island: str, replicas: int, *, keeps_count: bool = False) -> JoinInfo:
        """Register (or re-register) an island; returns the fragment layout and versions.
        `keeps_count`: its learner did not restart and keeps counting its tokens from its last
        join, which the syncer, restarted since, may lack (learner/join_marks.join_unknown)."""
        shards = self._fan_out()
        if shards is not None:
            joins = (c.join(island, replicas, keeps_count=keeps_count) for c in shards)
            return merge_join(await asyncio.gather(*joins))
        body: dict[str, Any] = {"island": island, "replicas": replicas}
        if keeps_count:  # left out otherwise: a syncer before the field never sees it
            body["keepsCount"] = True
        return await self.document(JoinInfo, "POST", ROUTE_JOIN, json_body=body)

    async def heartbeat(
        self,
        island: str,
        *,
        step: int = 0,
        tokens: int = 0,
        loss: float | None = None,
        step_time: float | None = None,
        holding: bool = False,
        drained: bool = False,
        waiting: float | None = None,
    ) -> HeartbeatAnswer:
        """Tell the syncer the island is alive (how far it got, whether it holds at the step
        cap, whether it has drained: its share done and merged, the share of its wall time it
        waited for the syncer: None, not known, is left out); returns its state."""
        shards = self._fan_out()
        if shards is not None:
            answers = await asyncio.gather(
                *(c.heartbeat(island, step=step, tokens=tokens, loss=loss, step_time=step_time,
                              holding=holding, drained=drained, waiting=waiting)
                  for c in shards)
            )  # fmt: skip
            return merge_heartbeat(answers)
        body = {"island": island, "step": step, "tokens": tokens, "loss": loss}
        body["stepTime"] = step_time
        body["holding"] = holding
        body["drained"] = drained
        if waiting is not None:  # left out, not null: a syncer before the field never sees it
            body["waiting"] = waiting
        return await self.document(HeartbeatAnswer, "POST", ROUTE_HEARTBEAT, json_body=body)

    async def leave(self, island: str) -> MembershipAnswer:
        """Say goodbye: the island leaves the quorum until it joins again."""
        shards = self._fan_out()
        if shards is not None:
            return (await asyncio.gather(*(c.leave(island) for c in shards)))[0]
        body = {"island": island}
        return await self.document(MembershipAnswer, "POST", ROUTE_LEAVE, json_body=body)

    async def status(self, digest: bool = False) -> SyncerStatus:
        """The syncer's status document (with the digest of weights + momentum when asked)."""
        shards = self._fan_out()
        if shards is not None:
            return merge_status(await asyncio.gather(*(c.status(digest) for c in shards)))
        params = {"digest": "1"} if digest else None
        return await self.document(SyncerStatus, "GET", ROUTE_STATUS, params=params)

    async def fragment_merges(self, fragment: int, from_version: int = 0) -> FragmentMerges:
        """Fragment `fragment`'s recent merges of `from_version` or later, with the syncer's
        clock and the islands' step times (phase alignment's read: FragmentMerges), from the
        shard that owns it."""
        shards = self._fan_out()
        if shards is not None:
            owner = shards[shard_of(fragment, len(shards))]
            return await owner.fragment_merges(fragment, from_version)
        params = {"from": str(from_version)}
        path = ROUTE_MERGES.format(fragment=fragment)
        return await self.document(FragmentMerges, "GET", path, params=params)

    async def set_membership(self, island: str, state: str, reason: str = "") -> MembershipAnswer:
        """Admin: mark an island active or dropped (protocol.ADMIN_STATES), at every shard."""
        shards = self._fan_out()
        if shards is not None:
            calls = (c.set_membership(island, state, reason) for c in shards)
            return (await asyncio.gather(*calls))[0]
        path = ROUTE_ISLAND.format(island=quote(island, safe=""))
        body = MembershipRequest(state=state, reason=reason).to_wire()
        return await self.document(MembershipAnswer, "PUT", path, json_body=body)
