"""The learner's (and tools') async client of the syncer: the JSON routes of the api client plus
the two tensor-body routes (pull a fragment's weights, push a pseudo-gradient).

Retries, deadlines and errors are those of api.client.SyncerJsonClient (one request loop for
every route); this module only encodes and decodes safetensors bodies.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

import torch

from diloco_trainer.api.client import SyncerJsonClient
from diloco_trainer.api.documents import DocumentError, PushAnswer, parse_json_object
from diloco_trainer.api.protocol import (
    ERROR_MALFORMED,
    HEADER_HELD_SECONDS,
    KIND_FULL,
    KIND_UPDATES,
    META_CHECKSUM,
    META_CODEC,
    META_FINISHED,
    META_FRAGMENT,
    META_FROM_VERSION,
    META_KIND,
    META_MERGE_SECONDS,
    META_OUTER_STEP,
    META_VERSION,
    ROUTE_FRAGMENT,
    ROUTE_PUSH,
    PushMeta,
    SyncerError,
    meta_bool,
    meta_int,
    meta_seconds,
)
from diloco_trainer.core.payloads import (
    PullCost,
    PulledFragment,
    PulledUpdates,
    decode_body_unlocked,
    encode_body_buffer,
    split_update_chain,
)

# The slowest transfer a tensor body is given time for (the syncer's default
# syncer.limits.minBodyBytesPerSecond): each attempt of a push or pull of n bytes gets n / this
# many seconds on top of request_timeout, so a large model's fragments are not cut off at a
# fixed 120 s (a push's answer also waits for its fold, and for its fragment's merge).
MIN_BODY_BYTES_PER_SECOND = 4 * 2**20


def pull_seconds(elapsed: float, headers: Mapping[str, str]) -> float | None:
    """A pull's own seconds (request, transfer, decoding): its `elapsed` time less what the
    syncer says it held the request (HEADER_HELD_SECONDS: the long-poll's wait for the merge);
    None when it did not say (an older syncer)."""
    named = {k.lower(): v for k, v in headers.items()}  # header names are case-insensitive
    held = meta_seconds(named, HEADER_HELD_SECONDS.lower())
    return None if held is None else max(0.0, elapsed - held)


class SyncerClient(SyncerJsonClient):
    """Async client of the syncer: join, heartbeat, leave, status, set_membership (inherited)
    plus pull_fragment and push_pseudo_gradient.

    Connection errors and 502/503/504 are retried with exponential backoff until `retry_deadline`
    seconds have passed since the call began; then SyncerError (status 0). Any other unsuccessful
    status raises SyncerError at once with the syncer's message (see api/client.py). Each attempt
    of a body's transfer gets `body_seconds` of its size on top of request_timeout (a pull:
    the size of the fragment's last full pull).
    """

    def __init__(
        self,
        *args: Any,
        min_body_bytes_per_second: float = MIN_BODY_BYTES_PER_SECOND,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if not min_body_bytes_per_second > 0:
            raise ValueError(f"min_body_bytes_per_second must be > 0: {min_body_bytes_per_second}")
        self.min_body_rate = float(min_body_bytes_per_second)
        self._full_bytes: dict[int, int] = {}  # fragment -> bytes of its last full pull

    def body_seconds(self, nbytes: int) -> float:
        """Seconds an attempt may add for a body of `nbytes` (the slowest transfer allowed)."""
        return nbytes / self.min_body_rate

    async def pull_fragment(
        self, fragment: int, *, after: int = -1, wait: float = 0, have: int = -1, run: str = ""
    ) -> PulledFragment | PulledUpdates | None:
        """Fragment `fragment`'s global weights if its version is > `after`, waiting up to `wait`
        seconds for one; None when nothing newer came in time.

        With `have` >= 0 (the version this client holds) the syncer may answer with the chain of
        updates since then (PulledUpdates) instead of the full weights (PulledFragment).
        `run`: the syncer run that accepted the push whose merge this waits for
        (PushAnswer.run): a restarted syncer refuses the pull at once (409 restarted) when it
        resumed at or before `after`, since it lost that push.
        """
        params = {"after": str(after), "wait": str(wait)}
        if have >= 0:
            params["have"] = str(have)
        if run:
            params["run"] = run
        headers: dict[str, str] = {}
        began = time.monotonic()
        status, body = await self.request(
            "GET",
            ROUTE_FRAGMENT.format(fragment=fragment),
            params=params,
            extra_timeout=wait + self.body_seconds(self._full_bytes.get(fragment, 0)),
            ok=(200, 304),
            headers_out=headers,
        )
        if status == 304:
            return None
        tensors, meta = decode_body_unlocked(body)
        version = meta_int(meta, META_VERSION)
        cost = PullCost(
            merge_seconds=meta_seconds(meta, META_MERGE_SECONDS),
            body_bytes=len(body),
            pull_seconds=pull_seconds(time.monotonic() - began, headers),
        )
        if meta.get(META_KIND, KIND_FULL) == KIND_UPDATES:
            from_version = meta_int(meta, META_FROM_VERSION)
            return PulledUpdates(
                fragment=meta_int(meta, META_FRAGMENT),
                version=version,
                from_version=from_version,
                outer_step=meta_int(meta, META_OUTER_STEP),
                finished=meta_bool(meta, META_FINISHED),
                codec=meta.get(META_CODEC, ""),
                checksum=meta.get(META_CHECKSUM, ""),
                updates=split_update_chain(tensors, from_version, version),
                cost=cost,
            )
        self._full_bytes[fragment] = len(body)  # the next pull's time follows its size
        return PulledFragment(
            fragment=meta_int(meta, META_FRAGMENT),
            version=version,
            outer_step=meta_int(meta, META_OUTER_STEP),
            finished=meta_bool(meta, META_FINISHED),
            tensors=tensors,
            cost=cost,
        )

    async def push_pseudo_gradient(
        self, fragment: int, tensors_encoded: Mapping[str, torch.Tensor], meta: PushMeta
    ) -> PushAnswer:
        """Push fragment `fragment`'s encoded pseudo-gradient; a retry of this call sends the same
        pushId, so the syncer answers it with its first answer (PushAnswer.duplicate)."""
        if not meta.push_id:
            meta = PushMeta(**{**meta.__dict__, "push_id": uuid.uuid4().hex})
        # Written by torch copies, the interpreter lock released (safetensors' save held it for
        # 40-90 ms per gpt-125m push, beside a GPU learner's training thread): the same bytes.
        body = encode_body_buffer(tensors_encoded, meta.to_metadata())
        path = ROUTE_PUSH.format(fragment=fragment)
        status, raw = await self.request(
            "POST", path, data=body, extra_timeout=self.body_seconds(len(body))
        )
        try:
            return PushAnswer.from_json(parse_json_object(raw, PushAnswer.__name__))
        except DocumentError as err:
            raise SyncerError(status, f"POST {path}: {err}", ERROR_MALFORMED) from None
