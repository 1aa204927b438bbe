"""The syncer's HTTP protocol, shared by the syncer (server) and the learners and tools (client).

Routes (all under the bearer token except /healthz and /readyz):

- ``POST /v1/join`` JSON {"island", "replicas"} -> {"fragments", "versions", "outerStep",
  "finished", "codec", "pullCompression"}.
- ``GET /v1/fragments/{f}?after=V&wait=S[&have=H]`` -> safetensors body of fragment f's fp32
  global weights (the published copy, see published.py), header metadata {"kind": "full",
  "version", "fragment", "outerStep", "finished"}; long-polls up to S seconds (capped at
  MAX_WAIT_SECONDS) for a version > V, then 304. A client that holds version H of the fragment
  may say so: when sync.pullCompression is not none, the syncer still keeps updates H+1..version and
  together they are smaller than the fragment, the body is that chain instead (``"kind":
  "updates"``): tensors named ``"{v}/{encoded key}"`` for each version v in H+1..version,
  metadata {"fromVersion": H, "codec", "checksum"} (of the weights at "version") besides the
  above. The client applies them in order (published.apply_updates) and checks the checksum;
  leaving out ``have`` (or have=-1) always gets the full weights. ``after`` is not the held
  version: a learner waits for the merge that carries its push, which may be newer than its base.
- ``POST /v1/fragments/{f}/push`` safetensors body of ``compress.encode_tensors(Δ_f, codec)`` with
  metadata {"island", "baseVersion", "tokens", "steps", "loss", "stepTime", "codec"} and the
  optional {"syncTime", "pushId"} -> {"accepted", "version", "pending"}.
- ``POST /v1/heartbeat`` {"island", "step", "tokens", "loss", "stepTime"} -> {"state", "finished"}.
- ``POST /v1/leave`` {"island"}; ``GET /v1/status[?digest=1]``; ``PUT /v1/islands/{island}``
  {"state", "reason"}; ``/healthz``, ``/readyz``, ``/metrics``.

Tensors travel as safetensors bytes (never pickle). Metadata lives in the safetensors header's
``__metadata__`` (a str -> str map): strings are stored as they are, numbers and booleans as JSON.

Retries: the client retries connection failures and 502/503/504 with exponential backoff until a
deadline, so a learner rides out a syncer restart. Pushes carry a ``pushId`` that stays the same
across retries of one call; the syncer answers a repeated id with its first answer, so a retried
push is never counted twice even when the first attempt was merged before its answer got lost.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import struct
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import safetensors.torch
import torch

log = logging.getLogger("diloco.wire")

API_PREFIX = "/v1"
ROUTE_JOIN = "/v1/join"
ROUTE_FRAGMENT = "/v1/fragments/{fragment}"
ROUTE_PUSH = "/v1/fragments/{fragment}/push"
ROUTE_HEARTBEAT = "/v1/heartbeat"
ROUTE_LEAVE = "/v1/leave"
ROUTE_STATUS = "/v1/status"
ROUTE_ISLAND = "/v1/islands/{island}"
ROUTE_HEALTHZ = "/healthz"
ROUTE_READYZ = "/readyz"
ROUTE_METRICS = "/metrics"
# Routes anyone may call (Kubernetes probes carry no token).
PUBLIC_ROUTES = frozenset({ROUTE_HEALTHZ, ROUTE_READYZ})

SAFETENSORS_CONTENT_TYPE = "application/octet-stream"
# The syncer caps a long-poll at this many seconds; clients ask for less or get 304 sooner.
MAX_WAIT_SECONDS = 60.0

STATE_ACTIVE = "active"
STATE_DROPPED = "dropped"
STATE_TIMED_OUT = "timedOut"
STATE_LEFT = "left"
ISLAND_STATES = (STATE_ACTIVE, STATE_DROPPED, STATE_TIMED_OUT, STATE_LEFT)
# The states the admin route accepts.
ADMIN_STATES = (STATE_ACTIVE, STATE_DROPPED)

# Machine-readable "code" in some error bodies ({"error": message, "code": code}).
ERROR_STALE = "stale"  # 409: baseVersion older than maxStaleness allows: pull, then push again
ERROR_AHEAD = "ahead"  # 409: baseVersion newer than the syncer's (it restarted from a checkpoint)
ERROR_UNKNOWN_ISLAND = "unknown_island"  # 404: join first (e.g. the syncer lost its state)
ERROR_DROPPED = "dropped"  # 403: the operator dropped this island

# Push metadata keys (safetensors header).
META_ISLAND = "island"
META_BASE_VERSION = "baseVersion"
META_TOKENS = "tokens"
META_STEPS = "steps"
META_LOSS = "loss"
META_STEP_TIME = "stepTime"
META_SYNC_TIME = "syncTime"
META_CODEC = "codec"
META_PUSH_ID = "pushId"
# Pull metadata keys.
META_VERSION = "version"
META_FRAGMENT = "fragment"
META_OUTER_STEP = "outerStep"
META_FINISHED = "finished"
META_KIND = "kind"  # KIND_FULL or KIND_UPDATES
META_FROM_VERSION = "fromVersion"  # updates: the version they start from (the client's `have`)
META_CHECKSUM = "checksum"  # updates: published.weights_checksum of the weights at `version`
KIND_FULL = "full"
KIND_UPDATES = "updates"
# An update chain's tensor names: "{version}{UPDATE_SEPARATOR}{encoded key}".
UPDATE_SEPARATOR = "/"

# The safetensors header is an 8-byte little-endian length followed by that much JSON.
_HEADER_LEN = struct.Struct("<Q")
# Larger headers are refused before JSON parsing (a real header for our models is a few KB).
MAX_HEADER_BYTES = 16 * 1024 * 1024


class SyncerError(RuntimeError):
    """The syncer refused a request (a 4xx) or stayed unreachable past the retry deadline."""

    def __init__(self, status: int, message: str, code: str = "") -> None:
        super().__init__(f"syncer answered {status}: {message}" if status else message)
        self.status = status
        self.message = message
        self.code = code  # one of the ERROR_* constants, or ""


@dataclass(frozen=True)
class PushMeta:
    """What a push says about its pseudo-gradient.

    tokens and steps count the island's work on this fragment since it last received the
    fragment (so a later push replaces an earlier pending one without double counting).
    """

    island: str
    base_version: int
    tokens: int
    steps: int
    loss: float
    step_time: float
    codec: str
    sync_time: float = 0.0  # seconds from the last push to receiving the merged fragment
    push_id: str = ""  # filled by SyncerClient.push when empty

    def to_metadata(self) -> dict[str, str]:
        """The safetensors header metadata for this push."""
        return encode_metadata(
            {
                META_ISLAND: self.island,
                META_BASE_VERSION: self.base_version,
                META_TOKENS: self.tokens,
                META_STEPS: self.steps,
                META_LOSS: self.loss,
                META_STEP_TIME: self.step_time,
                META_SYNC_TIME: self.sync_time,
                META_CODEC: self.codec,
                META_PUSH_ID: self.push_id,
            }
        )


@dataclass(frozen=True)
class JoinInfo:
    """The syncer's answer to a join: how parameters are split and where each fragment stands."""

    fragments: list[list[str]]
    versions: list[int]
    outer_step: int
    finished: bool
    codec: str
    pull_compression: str = (
        "none"  # codec of pulled weight updates (older syncers send full weights)
    )

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> JoinInfo:
        return cls(
            fragments=[list(f) for f in doc["fragments"]],
            versions=[int(v) for v in doc["versions"]],
            outer_step=int(doc["outerStep"]),
            finished=bool(doc["finished"]),
            codec=str(doc["codec"]),
            pull_compression=str(doc.get("pullCompression", "none")),
        )


@dataclass(frozen=True)
class PulledFragment:
    """A fragment's fp32 global weights at `version`."""

    fragment: int
    version: int
    outer_step: int
    finished: bool
    tensors: dict[str, torch.Tensor] = field(repr=False)


@dataclass(frozen=True)
class PulledUpdates:
    """A fragment's encoded weight updates from_version+1..version (apply them in order to the
    weights at from_version, then compare `checksum`)."""

    fragment: int
    version: int
    from_version: int
    outer_step: int
    finished: bool
    codec: str
    checksum: str
    updates: list[dict[str, torch.Tensor]] = field(repr=False)

    @property
    def nbytes(self) -> int:
        """Payload bytes of every update."""
        return sum(t.numel() * t.element_size() for u in self.updates for t in u.values())


def encode_update_chain(
    updates: list[tuple[int, Mapping[str, torch.Tensor]]], metadata: Mapping[str, Any]
) -> bytes:
    """Safetensors bytes of encoded updates [(version, encoded tensors)], named by version."""
    tensors = {
        f"{version}{UPDATE_SEPARATOR}{key}": t.detach().contiguous()
        for version, encoded in updates
        for key, t in encoded.items()
    }
    return safetensors.torch.save(tensors, metadata=encode_metadata(metadata))


def split_update_chain(
    tensors: Mapping[str, torch.Tensor], from_version: int, version: int
) -> list[dict[str, torch.Tensor]]:
    """The per-version encoded dicts of a chain, in order; ValueError unless it holds exactly the
    versions from_version+1..version."""
    by_version: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        head, sep, key = name.partition(UPDATE_SEPARATOR)
        if not sep or not head.isdigit() or not key:
            raise ValueError(f"update chain tensor {name!r} is not named 'VERSION/KEY'")
        by_version.setdefault(int(head), {})[key] = t
    want = list(range(from_version + 1, version + 1))
    if sorted(by_version) != want or not want:
        raise ValueError(
            f"update chain holds versions {sorted(by_version)}, expected {want[:1]}..{want[-1:]}"
        )
    return [by_version[v] for v in want]


def encode_metadata(values: Mapping[str, Any]) -> dict[str, str]:
    """Strings as they are; numbers and booleans as JSON (safetensors metadata is str -> str)."""
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in values.items()}


def encode_body(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]) -> bytes:
    """Serialise tensors and metadata as safetensors bytes.

    Tensors are made contiguous and given their own storage, because safetensors refuses views
    and tensors that share memory (tied weights).
    """
    own = {name: t.detach().contiguous().clone() for name, t in tensors.items()}
    return safetensors.torch.save(own, metadata=encode_metadata(metadata))


def read_metadata(body: bytes) -> dict[str, str]:
    """The ``__metadata__`` map of a safetensors body; ValueError when the header is malformed."""
    if len(body) < _HEADER_LEN.size:
        raise ValueError("body is too short to be safetensors")
    (n,) = _HEADER_LEN.unpack_from(body)
    if n > MAX_HEADER_BYTES or _HEADER_LEN.size + n > len(body):
        raise ValueError("safetensors header length is out of range")
    try:
        header = json.loads(body[_HEADER_LEN.size : _HEADER_LEN.size + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"safetensors header is not JSON: {err}") from None
    if not isinstance(header, dict):
        raise ValueError("safetensors header is not a JSON object")
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise ValueError("safetensors __metadata__ must map strings to strings")
    return meta


def decode_body(body: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Parse a safetensors body into (tensors, metadata); ValueError for anything malformed."""
    meta = read_metadata(body)
    try:
        tensors = safetensors.torch.load(body)
    except Exception as err:  # the Rust parser raises its own error types
        raise ValueError(f"body is not valid safetensors: {err}") from None
    return tensors, meta


def _meta_int(meta: Mapping[str, str], key: str) -> int:
    try:
        return int(json.loads(meta[key]))
    except (KeyError, ValueError, TypeError):
        raise ValueError(f"metadata {key!r} must be an integer") from None


def _meta_bool(meta: Mapping[str, str], key: str) -> bool:
    return meta.get(key, "false") == "true"


def _backoff(attempt: int, *, base: float = 0.2, cap: float = 5.0) -> float:
    return min(cap, base * 2**attempt)


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


def _error_message(body: bytes) -> tuple[str, str]:
    """(message, code) from an error body."""
    try:
        doc = json.loads(body)
        if isinstance(doc, dict) and "error" in doc:
            return str(doc["error"]), str(doc.get("code", ""))
    except (ValueError, UnicodeDecodeError):
        pass
    return body[:500].decode("utf-8", "replace"), ""
