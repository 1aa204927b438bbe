"""The publisher: what pullers get, and when.

It keeps each fragment's full pull body (the θ_pub fragment at its published version: θ_pub's
own memory after a prefix, or a copy of θ_exact with pull codec none; see encode),
the last few encoded updates of θ_pub per fragment (update_history.py: the newest in memory, the
older ones in files under the state dir) and the update-chain bodies built from them, and one
event per fragment that long-polling pullers wait on. The service calls `publish` after a merge
(lock held); `pull` serves and long-polls without the lock.

A learner that says which version it holds (`have`) gets the updates since then instead of the
full fragment when the history still holds them all and together they are smaller: the newest
update alone (what every learner at K = M asks for) is served from its own tensors, a longer
chain is built once per version and puller's version into a body of its own.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from diloco_trainer.api import protocol
from diloco_trainer.core import payloads
from diloco_trainer.core.compress import expected_encoded
from diloco_trainer.core.published import WeightUpdate, history_length
from diloco_trainer.syncer.merging import GlobalModel
from diloco_trainer.syncer.serving.update_history import (
    Housekeeping,
    SpilledUpdateHistory,
    chain_body,
)
from diloco_trainer.syncer.state import SyncerMetrics

log = logging.getLogger("diloco.syncer")

# What a body was encoded at: (fragment version, outer step, finished).
BodyKey = tuple[int, int, bool]
# A pull body: a full one is a SplitBody whose data is θ_pub's own memory (compressed pulls:
# no copy) or a torch copy of θ_exact at its version (pull codec none); an update chain's is
# the newest update's own tensors (no copy), or for a longer chain a buffer written by torch
# copies and file reads (update_history.chain_body): building one in a worker thread never
# holds the interpreter lock for a P-sized copy.
Body = bytes | bytearray | memoryview | payloads.SplitBody


@dataclass(frozen=True)
class PullSnapshot:
    """Pulls answered by kind (full, updates) and bytes sent (Publisher.snapshot)."""

    pulls: dict[str, int]
    bytes_out: int


class _Dropped:
    """The last references to bodies a publish replaced, let go where it runs (a worker
    thread): freeing P/F-sized memory blocks the thread that frees it (munmap: 40 ms for 256 MB
    here), and on the event loop, where install runs, that held up every long-poll its publish
    had just woken (the merge's path to pullable, bench/log/2026-11-26.md, "syncer_scale —
    2026-11-26 23:08"). A body still being sent goes with its last response instead."""

    def __init__(self, *held: object) -> None:
        self.held = list(held)

    def __call__(self) -> None:
        self.held.clear()


class Publisher:
    """Encoded pull bodies, update chains and long-poll wake-ups of one job's fragments."""

    def __init__(
        self,
        model: GlobalModel,
        *,
        max_staleness: int,
        metrics: SyncerMetrics,
        history_dir: Path | None = None,
    ) -> None:
        """`history_dir`: where the older updates go, a folder per fragment (emptied now: what
        a previous process left there is of versions it published); None: kept in memory."""
        self.model = model
        self.metrics = metrics
        if history_dir is not None:
            shutil.rmtree(history_dir, ignore_errors=True)
        self.history = [
            SpilledUpdateHistory(
                history_length(
                    model.full_bytes[f],
                    sum(
                        shape.numel() * dtype.itemsize
                        for dtype, shape in expected_encoded(e, model.pull_compression).values()
                    ),
                    max_staleness,
                ),
                None if history_dir is None else history_dir / f"fragment-{f}",
            )
            for f, e in enumerate(model.expected)
        ]
        self._housekeeping: set[asyncio.Future[None]] = set()  # the histories' file work
        self.pulls = {protocol.KIND_FULL: 0, protocol.KIND_UPDATES: 0}
        self.bytes_out = 0
        self.closing = False
        # Created on the serving loop (start()).
        self._events: list[asyncio.Event] = []
        self._bodies: list[tuple[BodyKey, Body]] = []
        # Update-chain bodies of the published version, by fragment and the puller's version.
        self._chains: list[dict[tuple[BodyKey, int], Body]] = [{} for _ in model.fragments]
        # Pull codec none: each fragment's copy of θ_exact at a version (the live tensors move
        # at its next merge, while the body may still be served), reused for a new outer step.
        self._copies: dict[int, tuple[int, torch.Tensor]] = {}
        # Per fragment: its last merge's seconds from the round's take to its body (bodies say
        # it: learners fit their overlap to it, learner/overlap.fit_overlap); None before one.
        self._merge_seconds: list[float | None] = [None for _ in model.fragments]

    def snapshot(self) -> PullSnapshot:
        """Its figures as they are now."""
        return PullSnapshot(pulls=dict(self.pulls), bytes_out=self.bytes_out)

    async def start(self, keys: list[BodyKey]) -> None:
        """Create the events and encode every fragment at `keys` (call on the serving loop)."""
        self._events = [asyncio.Event() for _ in self.model.fragments]
        # Another shard's fragments (never served here: 421 at the edge) get an empty body
        # that is never re-encoded.
        self._bodies = await asyncio.to_thread(
            lambda: [
                self.encode(f, keys[f]) if self.model.owns(f) else (keys[f], b"")
                for f in range(len(self.model.fragments))
            ]
        )

    def record_update(self, f: int, update: WeightUpdate | None) -> None:
        """Keep θ_pub's update of fragment f (None: θ_pub is θ_exact, nothing to keep); the
        previous one goes to its file in a worker thread (served from memory until it is)."""
        if update is not None:
            self._in_background(self.history[f].append(update))

    def _in_background(self, work: Housekeeping) -> None:
        """Run a history's file work in a worker thread (inline without a running loop)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            work()
            return
        task = loop.run_in_executor(None, work)
        self._housekeeping.add(task)
        task.add_done_callback(self._housekept)

    def _housekept(self, task: asyncio.Future[None]) -> None:
        self._housekeeping.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("update history file work failed", exc_info=task.exception())

    async def housekeeping_done(self) -> None:
        """Wait for the histories' file work in flight (tests, a stop)."""
        while self._housekeeping:
            await asyncio.gather(*list(self._housekeeping), return_exceptions=True)

    async def publish(self, keys: list[BodyKey]) -> None:
        """Re-encode the fragments whose key changed and wake their pullers (lock held), one
        fragment at a time, new versions first: a merged fragment is pullable as soon as its
        own body is, not after the others whose outer step only changed."""
        stale = [f for f in self.model.owned if self._bodies[f][0] != keys[f]]
        stale.sort(key=lambda f: self._bodies[f][0][0] == keys[f][0])  # new versions first
        for f in stale:
            self.install(f, await asyncio.to_thread(self.encode, f, keys[f]))

    def body_key(self, f: int) -> BodyKey:
        """The key fragment f's served body was encoded at."""
        return self._bodies[f][0]

    def merged(
        self, f: int, update: WeightUpdate | None, body: tuple[BodyKey, Body] | None
    ) -> None:
        """A merge of fragment f, on the loop: its θ_pub update kept (record_update) and its
        new body served now (install), unless `body` is None (published later: the finish, or
        a body whose key no longer fits)."""
        self.record_update(f, update)
        if body is not None:
            self.install(f, body)

    def install(self, f: int, body: tuple[BodyKey, Body]) -> None:
        """Serve a body built by `encode` as fragment f's (on the loop) and wake its pullers.
        The bodies it replaces are let go in a worker thread (_Dropped)."""
        dropped = _Dropped(self._bodies[f], self._chains[f])
        self._bodies[f] = body
        self._chains[f] = {}
        old, self._events[f] = self._events[f], asyncio.Event()
        old.set()
        self._in_background(dropped)

    def close_waiters(self) -> None:
        """Answer every long-poll now (304): the server is shutting down."""
        self.closing = True
        for event in self._events:
            event.set()

    async def pull(self, fragment: int, *, after: int, wait: float, have: int) -> Body | None:
        """Fragment bytes once its version is > after (or the job finished); None after `wait`.

        The body is the chain of updates since version `have` when there is one (see
        _chain_body), else the full published weights.
        """
        if not self.model.owns(fragment):
            raise ValueError(f"fragment {fragment} is another syncer shard's")
        deadline = time.monotonic() + max(0.0, min(wait, protocol.MAX_WAIT_SECONDS))
        while True:
            key, body = self._bodies[fragment]
            version, _, finished = key
            if version > after or finished:
                chain = await self._chain_body(fragment, key, have)
                if chain is not None:
                    body = chain
                self.pulls[protocol.KIND_FULL if chain is None else protocol.KIND_UPDATES] += 1
                self.bytes_out += len(body)
                self.metrics.bytes_out.inc(len(body))
                return body
            published = self._events[fragment]
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.closing:
                return None
            try:
                await asyncio.wait_for(published.wait(), remaining)
            except TimeoutError:
                return None

    def encode(
        self, f: int, key: BodyKey, merge_seconds: float | None = None
    ) -> tuple[BodyKey, Body]:
        """Fragment f's full pull body at `key`: θ_pub's own memory with a new prefix, or with
        pull codec none a copy of θ_exact made once per version (a worker thread: P/F-sized).
        `merge_seconds`: the merge that made the version, so far (kept for later bodies)."""
        if merge_seconds is not None:
            self._merge_seconds[f] = merge_seconds
        tensors = self.model.published_fragment(f)
        data = self.model.published_data.get(f)
        if data is None:  # θ_pub is θ_exact: its bytes at this version, copied once
            version, data = self._copies.get(f, (-1, None))
            if data is None or version != key[0]:
                data, views = payloads.body_data(tensors)
                for name, view in views.items():
                    view.copy_(tensors[name])
                self._copies[f] = (key[0], data)
        meta = {
            protocol.META_KIND: protocol.KIND_FULL,
            protocol.META_VERSION: key[0],
            protocol.META_FRAGMENT: f,
            protocol.META_OUTER_STEP: key[1],
            protocol.META_FINISHED: key[2],
            **self._timing(f),
        }
        return key, payloads.split_body(data, tensors, meta)

    def _timing(self, f: int) -> dict[str, float]:
        seconds = self._merge_seconds[f]
        return {} if seconds is None else {protocol.META_MERGE_SECONDS: round(seconds, 6)}

    async def _chain_body(self, f: int, key: BodyKey, have: int) -> Body | None:
        """The update-chain body from version `have` to the published `key`, when the history
        holds it and it is smaller than the fragment; else None."""
        if self.model.pull_compression == "none" or have < 0:
            return None
        cached = self._chains[f].get((key, have))
        if cached is not None:
            return cached
        chain = self.history[f].chain(have, key[0], self.model.full_bytes[f])
        if chain is None:
            return None
        meta = {
            protocol.META_KIND: protocol.KIND_UPDATES,
            protocol.META_VERSION: key[0],
            protocol.META_FROM_VERSION: have,
            protocol.META_FRAGMENT: f,
            protocol.META_OUTER_STEP: key[1],
            protocol.META_FINISHED: key[2],
            protocol.META_CODEC: self.model.pull_compression,
            protocol.META_CHECKSUM: chain[-1].checksum,
            **self._timing(f),
        }
        try:
            if len(chain) == 1 and chain[0].encoded() is not None:
                # the newest update's own tensors after a prefix: no copy, no thread to wait for
                body: Body = chain_body(chain, meta)
            else:
                body = await asyncio.to_thread(chain_body, chain, meta)
        except OSError as err:  # an older update's file went (it left the history) or failed
            log.warning("fragment %d: no update chain from version %d (%s)", f, have, err)
            return None
        if self._bodies[f][0] == key:  # still the published version: keep it for other pullers
            self._chains[f][(key, have)] = body
        return body
