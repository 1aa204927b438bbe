"""Rank 0's link to the syncer: an asyncio loop on a daemon thread that joins, pushes
pseudo-gradients, long-polls for merged fragments and sends heartbeats while the training loop
goes on.

Compressed pulls (sync.pullCompression): rank 0 tells the syncer which version of a fragment it
holds, and may get the encoded weight updates since then instead of the full fragment; it applies
them to the weights it holds with the syncer's own float ops (published.add_updates), so it ends
up with the syncer's published weights bit for bit, and checks the syncer's checksum. On a mismatch
(or a malformed chain) it logs a warning and pulls the full fragment. The other ranks receive the
rebuilt fp32 weights by broadcast, as before.

On the host the chain is added into the held weights in place (HeldFragment.write), not into a
copy of them: its checksum is computed first without writing anything
(published.checksum_after_updates, a slice at a time), and only a chain that matches is added.
So a chain that fails its check, or a pull that fails before it, leaves the held weights as they
were; a write revoked by a push of the fragment again (FragmentState.base_rewritten) rebuilds into
a copy as before.

Syncer shards (syncer.shards, api/sharding.py): with several shard URLs in DILOCO_SYNCER_URL the
link talks to each through its own client; each fragment's push, pull and phase-alignment status
go to the shard that owns it; joins, heartbeats and goodbyes go to every shard (each holds the
whole membership), a shard that forgot the island (404, restarted) is joined again on its own, and
the job is finished once every shard has said so (a pulled fragment reads finished only then).

Refusals: a push refused as too stale (409) or from a dropped island (403) is discarded and the
current global fragment is pulled and applied in its place. A syncer that forgot the island (404,
e.g. restarted without it) is joined again, and so is one whose run, named in its heartbeat
answers, is not the one joined and whose record counts fewer of the island's joins than our join
left (join_unknown: it resumed from a checkpoint without our join): that join keeps our count
(keepsCount), its base the island's merged tokens in the checkpoint. Connection errors are retried
by the client with backoff. A push that a syncer accepted and then lost by restarting (the
restarted syncer refuses the pull for its merge: 409 restarted) ends its sync with PushLost at
once: the training loop pushes the fragment again (fragment_sync.py; docs/algorithm.md, "A syncer
restart").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor

from diloco_trainer.api.documents import JoinInfo
from diloco_trainer.api.protocol import ERROR_AHEAD, ERROR_RESTARTED, PushMeta, SyncerError
from diloco_trainer.api.sharding import merge_join, shard_of
from diloco_trainer.core.payloads import PulledFragment, PulledUpdates
from diloco_trainer.core.published import (
    add_updates,
    apply_updates,
    check_updates,
    checksum_after_updates,
    weights_checksum,
)
from diloco_trainer.host_memory import trim
from diloco_trainer.learner.device_copies import DeviceStager
from diloco_trainer.learner.join_marks import JoinMark, join_unknown
from diloco_trainer.learner.overlap import sync_latency
from diloco_trainer.learner.phase_alignment import lateness_within, merge_lateness
from diloco_trainer.learner.step_costs import WaitMeter
from diloco_trainer.learner.syncer_client import SyncerClient

# The learner's logger: the link runs inside the learner and its lines are part of that log.
log = logging.getLogger("diloco.learner")
T = TypeVar("T")

# Seconds one long-poll for a merged fragment asks the syncer to hold the request.
LONG_POLL_SECONDS = 20.0
# Seconds the training loop blocks at a time while it waits, so SIGTERM is noticed promptly.
WAIT_SLICE_SECONDS = 0.2


class PushLost(RuntimeError):
    """A sync's push was accepted by a syncer run that has since restarted without merging it
    (pending pushes are not checkpointed): no merge will carry it, so it must be pushed again.
    `version`: the fragment's version at the restarted syncer (-1: not known)."""

    def __init__(self, message: str, version: int) -> None:
        super().__init__(message)
        self.version = version


# write(version, add): run `add` (which writes the held tensors) if the holder still allows it,
# and say whether it ran (FragmentState.base_writer).
BaseWriter = Callable[[int, Callable[[], None]], bool]


@dataclass(frozen=True)
class HeldFragment:
    """The global weights of a fragment that rank 0 holds (its Δ base) and their version: what
    a chain of pulled updates is applied to. The tensors are written only through `write`."""

    version: int
    tensors: Mapping[str, Tensor]
    # The same weights on the learner's GPU, when it holds them there: the updates are then
    # applied on the device (DeviceStager.rebuild).
    on_device: Mapping[str, Tensor] | None = None
    # How a verified chain is added into `tensors` in place; None: they are never written, and
    # a chain is rebuilt into a copy of them.
    write: BaseWriter | None = None


@dataclass(frozen=True)
class SyncResult:
    """How a push of one fragment ended: the global weights to apply and what happened."""

    pulled: PulledFragment
    outcome: str  # "merged", or why the current fragment was taken instead
    seconds: float  # push sent to merged fragment received
    # Seconds the push came after a merge of its fragment by peers it was not part of
    # (phase_alignment.merge_lateness); None when there was none.
    lateness: float | None = None
    # Whether `lateness` is instead of the previous push within its merge (lateness_within).
    lateness_within: bool = False
    # The sync's latency less any wait for peers (overlap.sync_latency; None: not known).
    latency: float | None = None
    # `pulled`'s tensors already on the learner's GPU (SyncerLink's stager), or None.
    on_device: Mapping[str, Tensor] | None = None
    # The push was refused because the syncer restarted: its base is ahead of a syncer that
    # resumed from an older checkpoint (409 ahead), or the syncer forgot the island (404).
    # `pulled` is the restarted syncer's fragment; the learner pushes again from it at once
    # (fragment_sync.FragmentSync.receive; docs/algorithm.md, "A syncer restart").
    restarted: bool = False
    # Where the pull of the merge went, on the link's side (None: not a push's merge).
    pull_path: PullPath | None = None


@dataclass(frozen=True)
class PullPath:
    """The path of a merge from the syncer's answer to the result handed to the training thread
    (issue 45: at K = M a blocking learner waits through all of it). Seconds, and the wall time
    the result was ready (time.time()); `answered_at` = ready_at less the parts: about when the
    syncer answered the long-poll (a merge's record time at the syncer is the same clock on one
    machine)."""

    pull: float  # the answer's transfer and decoding (PullCost.pull_seconds; 0: not known)
    pull_bytes: int  # the answer's body
    # A chain of updates added into the held weights, its checksum checked (and, on a host,
    # the receipt made ready in the same worker thread).
    rebuild: float
    prepare: float  # the receipt made ready (θ_global − θ_push) apart, or staged on the GPU
    ready_at: float

    @property
    def answered_at(self) -> float:
        return self.ready_at - self.pull - self.rebuild - self.prepare

    def describe(self) -> str:
        """E.g. 'pull 0.012s (73048 bytes), rebuild 0.002s, receipt ready 0.001s, ready at
        1795986391.041' for the receipt's log line."""
        return (
            f"pull {self.pull:.3f}s ({self.pull_bytes} bytes), rebuild {self.rebuild:.3f}s, "
            f"receipt ready {self.prepare:.3f}s, ready at {self.ready_at:.3f}"
        )


class SyncerLink:
    """Rank 0's connection to the syncer on its own thread and event loop.

    The training loop never awaits anything: it submits coroutines and gets concurrent futures,
    which it may wait on (bounded) or just check.
    """

    def __init__(
        self,
        client: SyncerClient,
        *,
        island: str,
        replicas: int,
        stage_on: str | None = None,
        apply_on_device: bool = True,
    ) -> None:
        """`stage_on`: a GPU device to copy each merged fragment to on the link's side (no
        copy on the training thread; device_copies.DeviceStager); None: leave them on the host.
        `apply_on_device`: with `stage_on`, apply compressed updates there (PULL_APPLY_ENV)."""
        self.stager = DeviceStager(stage_on) if stage_on is not None else None
        self.apply_on_device = apply_on_device and self.stager is not None
        if self.stager is not None:
            log.info(
                "merged fragments go to %s on the link's thread; compressed updates are applied %s",
                self.stager.device,
                "there" if self.apply_on_device else "on the host, then staged",
            )
        # One client per syncer shard (one: no shards); `client` itself when there is one.
        self.clients = client.shard_clients()
        self._finished_shards: set[int] = set()
        self.island = island
        self.replicas = replicas
        self.finished = threading.Event()
        # K < M: the count of processed tokens at which the island drains, once the syncer set
        # it (syncer/state/targets.py; drain.py).
        self.stop_at: int | None = None
        # The island's round H_i as syncer shard 0 last named it (join and heartbeat answers;
        # inner.stepsPerIsland), None until it does: fragment_sync adopts it at a round boundary.
        self.inner_steps: int | None = None
        # K = M: whether syncer shard 0 said the budget is split per island (the islands' rounds
        # differ: core/island_rounds.split_budget); the island's share is then off (drain.py).
        self.split_budget = False
        # Latest figures for heartbeats; written by the training thread, read by the loop.
        self.progress: dict[str, Any] = {
            "step": 0,
            "tokens": 0,
            "loss": None,
            "step_time": None,
            "holding": False,  # fragment_sync sets it while the island holds at the step cap
            "drained": False,  # drain.py sets it once the island's share is done and merged
        }
        # Rank 0's waits for the syncer (FragmentSync.collect marks them): each heartbeat says
        # the share of the wall time since that shard's previous heartbeat they took.
        self.waits = WaitMeter(time.monotonic())
        # Pulls answered with a chain of updates, and chains that failed their check.
        self.pull_counts = {"updates": 0, "rebuildFailed": 0}
        # The link's trim of freed memory (_trim_soon) and whether one more was asked for.
        self._trim_task: asyncio.Task[None] | None = None
        self._trim_again = False
        # Per syncer shard, the island's last join of it (join_unknown; absent: none answered).
        self.joined: dict[int, JoinMark] = {}
        # Coroutines submit_later deferred, with their futures, until start_deferred.
        self._deferred: list[tuple[Coroutine[Any, Any, Any], Any]] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="syncer-link", daemon=True
        )
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run a coroutine on the link's loop."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def submit_later(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """A coroutine to run on the link's loop from the next `start_deferred` on; its future
        now (a future cancelled before then never starts it).

        Why (issue 45): waking the link's thread hands it the interpreter lock, and its first
        burst of Python (the push's task, its HTTP request) then held the training thread's
        Python in the sync path at every push: 8-12 ms of gpt-tiny's few-ms steps on two
        shared cores, most of the push's time there. The training loop starts what it deferred
        just before the next step's backward pass, which runs without the lock: the link's
        burst overlaps the backward instead of stopping the training thread."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._deferred.append((coro, future))
        return future

    def start_deferred(self) -> None:
        """Start what submit_later deferred, with one wake of the link's thread (the training
        thread: before a backward pass, and before it waits on any future)."""
        if not self._deferred:
            return
        batch, self._deferred = self._deferred, []
        self._loop.call_soon_threadsafe(self._start_batch, batch)

    def _start_batch(self, batch: list[tuple[Coroutine[Any, Any, Any], Any]]) -> None:
        """On the loop: a task per deferred coroutine, its outcome copied to its future and a
        cancel of the future passed on to the task (as run_coroutine_threadsafe does)."""
        for coro, future in batch:
            if future.cancelled():
                coro.close()
                continue
            task = self._loop.create_task(coro)
            task.add_done_callback(functools.partial(_settle, future))
            future.add_done_callback(functools.partial(self._cancel_task, task))

    def _cancel_task(self, task: asyncio.Task[Any], future: concurrent.futures.Future[Any]) -> None:
        if future.cancelled() and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(task.cancel)

    def _client(self, fragment: int) -> SyncerClient:
        """The client of the shard that owns `fragment`."""
        return self.clients[shard_of(fragment, len(self.clients))]

    def _shard_says(self, shard: int, finished: bool) -> bool:
        """Record that shard `shard` finished (when it says so); whether every shard has, which
        is when the job is finished (then `finished` is set)."""
        if finished:
            self._finished_shards.add(shard)
        if len(self._finished_shards) == len(self.clients):
            self.finished.set()
            return True
        return False

    def _pulled(self, fragment: int, pulled: PulledFragment) -> PulledFragment:
        """`pulled` finished only when every shard is (its own shard's word alone is not)."""
        done = self._shard_says(shard_of(fragment, len(self.clients)), pulled.finished)
        return pulled if pulled.finished == done else dataclasses.replace(pulled, finished=done)

    async def join(self, stop: threading.Event) -> JoinInfo:
        """Join every shard (one: the syncer), retrying each for as long as it is unreachable (it
        may start after us); their answers read as one (sharding.merge_join)."""
        infos = await asyncio.gather(*(self._join_shard(i, stop) for i in range(len(self.clients))))
        return merge_join(infos)

    async def _join_shard(
        self, shard: int, stop: threading.Event, *, keeps_count: bool = False
    ) -> JoinInfo:
        while True:
            try:
                info = await self.clients[shard].join(
                    self.island, self.replicas, keeps_count=keeps_count
                )
            except SyncerError as err:
                if err.status != 0 or stop.is_set():
                    raise
                log.warning("syncer still unreachable, trying again: %s", err)
                continue
            self._shard_says(shard, info.finished)
            self.joined[shard] = JoinMark(info.run, tuple(info.versions), info.joins)
            if shard == 0 and info.inner_steps is not None:
                self.inner_steps = info.inner_steps
            if shard == 0:
                self.split_budget = self.split_budget or info.split_budget
            return info

    async def pull_all(self, num_fragments: int) -> list[PulledFragment]:
        """The current global weights of every fragment, each from its shard."""
        pulled = []
        for f in range(num_fragments):
            got = await self._client(f).pull_fragment(f, after=-1)
            assert isinstance(got, PulledFragment), "a pull after version -1 without have is full"
            pulled.append(self._pulled(f, got))
        return pulled

    async def sync_fragment(
        self,
        fragment: int,
        encoded: Mapping[str, Tensor],
        meta: PushMeta,
        held: HeldFragment | None = None,
        within: bool = False,
        ready: Callable[[], None] | None = None,
        prepare: Callable[[Mapping[str, Tensor]], None] | None = None,
    ) -> SyncResult:
        """Push a pseudo-gradient, then long-poll for the merge that contains it.

        The syncer answers an accepted push with the fragment's version at that moment; the push
        sits in the round that produces the next version, so that is what we wait for. Waiting
        only for "newer than our base" would, whenever another merge slipped in first, hand us a
        version without our own work, and every later push would then be one version stale.

        A refused push (409 too stale, 403 dropped, 400/413 malformed) is logged and the current
        fragment is returned instead; an island the syncer forgot (404) joins again first.
        `ready`: the wait for `encoded`'s copies to the host (encode_for_wire), or a host
        learner's deferred encoding, called first (in a worker thread). `prepare`: run (in a
        worker thread) on the pulled fragment's host tensors before the result is handed back
        (a host learner's receipt made ready: FragmentState.receipt_preparer).
        """
        start = time.monotonic()
        if ready is not None:
            await asyncio.to_thread(ready)
        outcome = "merged"
        after = meta.base_version
        lateness, within_reading = None, False
        push_seconds: float | None = None
        push_bytes = 0
        restarted = False
        run = ""  # the syncer run that accepted the push (PushAnswer.run)
        try:
            reply = await self._client(fragment).push_pseudo_gradient(fragment, encoded, meta)
            push_seconds = time.monotonic() - start
            push_bytes = sum(t.numel() * t.element_size() for t in encoded.values())
            log.debug("fragment %d push answered %s", fragment, reply)
            self._hear_stop_at(reply.stop_at)
            if reply.accepted:
                after = max(after, reply.version)
                run = reply.run
                if after > meta.base_version or within:
                    lateness, within_reading = await self._lateness(
                        fragment, meta, after, time.monotonic(), within=within
                    )
        except SyncerError as err:
            after = -1
            outcome = f"push refused ({err})"
            restarted = err.code == ERROR_AHEAD or err.status == 404
            if err.status == 404:
                shard = shard_of(fragment, len(self.clients))
                await self._join_shard(shard, threading.Event())
                outcome = "rejoined the syncer"
            log.warning("fragment %d: %s; taking the current global fragment", fragment, outcome)
        # The push's encoded bytes (P/F int8 values a fragment) are not needed while its merge
        # is awaited and pulled: let them go now, not when the sync ends (`ready`, a deferred
        # encoding's closure, holds them too). ARCHITECTURE.md, "A learner's memory".
        del encoded, ready
        pulled, on_device, path = await self._take_merge(fragment, after, held, prepare, run)
        latency = None
        if push_seconds is not None and outcome == "merged":
            latency = _latency(push_seconds, push_bytes, pulled, path)
        return SyncResult(
            pulled=pulled,
            outcome=outcome,
            seconds=time.monotonic() - start,
            lateness=lateness,
            lateness_within=within_reading,
            latency=latency,
            on_device=on_device,
            restarted=restarted,
            pull_path=path,
        )

    async def _take_merge(
        self,
        fragment: int,
        after: int,
        held: HeldFragment | None,
        prepare: Callable[[Mapping[str, Tensor]], None] | None,
        run: str = "",
    ) -> tuple[PulledFragment, Mapping[str, Tensor] | None, PullPath]:
        """sync_fragment's pull of the merge after `after` (of a push syncer run `run`
        accepted): the fragment, its copy on the GPU (or None) and where the time went (its
        `prepare`: staging and preparing it; a chain's receipt is made ready in its rebuild's
        worker thread, counted there).

        Why so (issue 45): at K = M a blocking learner waits through everything between the
        merge and this result, and on two loaded cores each hop to a worker thread and back
        cost a few ms (gpt-tiny, L = 0: rebuild, receipt and trim 24 ms a merge, median, 18% of
        the waits): the receipt is made ready in the rebuild's hop, and the trim runs after
        the result is handed on."""
        once = _Once(prepare) if prepare is not None and self.stager is None else None
        pulled, on_device = await self._pull_newer(fragment, after, held, run, prepare=once)
        staged_at = time.monotonic()
        if self.stager is not None and on_device is None:
            on_device = await asyncio.to_thread(self.stager.stage, pulled.tensors)
        if once is not None and not once.ran:
            await asyncio.to_thread(once, pulled.tensors)
        staging = time.monotonic() - staged_at
        # This sync's freed buffers (its push, the pulled body) and the last receipt's (the
        # replaced base, the weights at that push) back to the system (host_memory.py), after
        # the result is handed on: nothing waits for it.
        self._trim_soon()
        path = PullPath(
            pull=pulled.cost.pull_seconds or 0.0,
            pull_bytes=pulled.cost.body_bytes,
            rebuild=pulled.cost.rebuild_seconds,
            prepare=staging,
            ready_at=time.time(),
        )
        return pulled, on_device, path

    def _trim_soon(self) -> None:
        """host_memory.trim in a worker thread, off every sync's path; one at a time (a trim
        asked for while one runs runs once after it, for the buffers freed meanwhile)."""
        if self._trim_task is not None and not self._trim_task.done():
            self._trim_again = True
            return

        async def trims() -> None:
            while True:
                self._trim_again = False
                await asyncio.to_thread(trim)
                if not self._trim_again:
                    return

        self._trim_task = self._loop.create_task(trims())

    async def _lateness(
        self, fragment: int, meta: PushMeta, accepted: int, answered: float, *, within: bool
    ) -> tuple[float | None, bool]:
        """Merges of the fragment happened between our base and our push: how late were we?
        Else, `within`: how late was our previous push in its merge
        (phase_alignment.lateness_within)? One read of the fragment's merges from our base on
        (FragmentMerges: a kilobyte or two, where the whole status document is tens of
        kilobytes and at K < M was read after every push: issue 45, "frag47"); a failure only
        skips phase alignment once. (lateness, whether within)"""
        try:
            doc = await self._client(fragment).fragment_merges(fragment, meta.base_version)
        except SyncerError as err:
            log.debug("merges read for phase alignment failed: %s", err)
            return None, False
        late = merge_lateness(
            doc,
            island=self.island,
            base_version=meta.base_version,
            accepted_version=accepted,
            pushed_ago=time.monotonic() - answered,
            step_time=meta.step_time,
        )
        if late is not None or not within:
            return late, False
        of_previous = lateness_within(
            doc, version=meta.base_version, island=self.island, step_time=meta.step_time
        )
        return of_previous, of_previous is not None

    async def _version(self, fragment: int) -> int:
        """The fragment's version at its shard now; -1 when the status cannot be read."""
        try:
            return (await self._client(fragment).status()).versions[fragment]
        except SyncerError:
            return -1

    async def versions(self, num_fragments: int) -> list[int]:
        """Each fragment's version at the syncer shard that owns it (one status read a shard):
        after a restart, what it resumed from (fragment_sync.FragmentSync._make_up)."""
        docs = await asyncio.gather(*(client.status() for client in self.clients))
        return [docs[shard_of(f, len(self.clients))].versions[f] for f in range(num_fragments)]

    async def resync(self, fragment: int) -> SyncResult:
        """The current global fragment, when a sync went wrong in a way a retry cannot fix."""
        start = time.monotonic()
        pulled, _ = await self._pull_newer(fragment, -1)
        return SyncResult(pulled=pulled, outcome="resynced", seconds=time.monotonic() - start)

    async def _pull_newer(
        self,
        fragment: int,
        after: int,
        held: HeldFragment | None = None,
        run: str = "",
        *,
        prepare: _Once | None = None,
    ) -> tuple[PulledFragment, Mapping[str, Tensor] | None]:
        """The fragment's global weights at a version > `after` (long-polling until there is
        one); as updates to `held` when the syncer offers them. (The weights, the same on the
        learner's GPU when they were rebuilt there, else None.) `run`: the syncer run that
        accepted the push this waits for; PushLost when a restarted syncer says it lost it.
        `prepare`: run on a rebuilt chain's host weights in the rebuild's worker thread, once
        they match the syncer's checksum (not run otherwise: `prepare.ran` says)."""
        while True:
            try:
                pulled = await self._client(fragment).pull_fragment(
                    fragment,
                    after=after,
                    wait=LONG_POLL_SECONDS,
                    have=held.version if held is not None else -1,
                    run=run,
                )
                if isinstance(pulled, PulledUpdates):
                    began = time.monotonic()
                    rebuilt, on_device = await self._rebuild(fragment, pulled, held, prepare)
                    cost = dataclasses.replace(
                        pulled.cost, rebuild_seconds=time.monotonic() - began
                    )
                    return self._pulled(
                        fragment, dataclasses.replace(rebuilt, cost=cost)
                    ), on_device
                if pulled is not None:
                    return self._pulled(fragment, pulled), None
                # A whole long-poll without a merge: if the syncer went back to an older
                # checkpoint our base is ahead of it, and waiting for "newer" could take long.
                status = await self._client(fragment).status()
                self._shard_says(shard_of(fragment, len(self.clients)), status.finished)
                if status.versions[fragment] < after:
                    log.warning(
                        "fragment %d: the syncer is at version %s, behind our base %d "
                        "(restarted from a checkpoint?); taking its current fragment",
                        fragment,
                        status.versions[fragment],
                        after,
                    )
                    after = -1
            except SyncerError as err:
                if err.code == ERROR_RESTARTED:
                    raise PushLost(err.message, await self._version(fragment)) from err
                # Unreachable past the client's retry deadline, or refused: keep trying, slowly;
                # the training loop goes on meanwhile.
                log.warning("fragment %d: pull failed (%s), trying again", fragment, err)
                await asyncio.sleep(WAIT_SLICE_SECONDS * 25)

    async def _rebuild(
        self,
        fragment: int,
        chain: PulledUpdates,
        held: HeldFragment | None,
        prepare: _Once | None = None,
    ) -> tuple[PulledFragment, Mapping[str, Tensor] | None]:
        """The weights `chain` leads to from `held`, checked against the syncer's checksum, and
        the same on the GPU when they were rebuilt there; the full fragment (pulled again) when
        they do not match or the chain is malformed."""
        if held is None or chain.from_version != held.version:
            problem = f"they start from version {chain.from_version}, not the one held"
        else:
            try:
                on_device, tensors, checksum = await asyncio.to_thread(
                    self._apply, held, chain, prepare
                )
            except ValueError as err:
                problem = str(err)
            else:
                if checksum == chain.checksum:
                    self.pull_counts["updates"] += 1
                    pulled = PulledFragment(
                        fragment=chain.fragment,
                        version=chain.version,
                        outer_step=chain.outer_step,
                        finished=chain.finished,
                        tensors=tensors,
                    )
                    return pulled, on_device
                problem = f"checksum {checksum} differs from the syncer's {chain.checksum}"
        self.pull_counts["rebuildFailed"] += 1
        log.warning(
            "fragment %d: the %d update(s) %d..%d do not rebuild the syncer's weights (%s); "
            "pulling the full fragment",
            fragment,
            len(chain.updates),
            chain.from_version + 1,
            chain.version,
            problem,
        )
        full = await self._client(fragment).pull_fragment(fragment, after=-1)
        assert isinstance(full, PulledFragment), "a pull without have is full"
        return full, None

    def _apply(
        self, held: HeldFragment, chain: PulledUpdates, prepare: _Once | None = None
    ) -> tuple[Mapping[str, Tensor] | None, dict[str, Tensor], str]:
        """`chain` applied to `held` (on a worker thread): on the GPU when the learner holds
        the weights there, else on the host, into `held`'s own tensors when it allows it and
        the result's checksum is the syncer's (else nothing is written); then, on the host and
        only when the checksum is the syncer's, `prepare` on the result in the same thread. (on
        the GPU or None, on the host, the host tensors' checksum)"""
        check_updates({n: t.shape for n, t in held.tensors.items()}, chain.updates, chain.codec)
        if self.stager is not None and self.apply_on_device and held.on_device is not None:
            on_device, host = self.stager.rebuild(held.on_device, chain.updates, chain.codec)
            return on_device, host, weights_checksum(host)
        tensors: dict[str, Tensor] | None = None
        if held.write is not None and all(in_place_ok(t) for t in held.tensors.values()):
            checksum = checksum_after_updates(held.tensors, chain.updates, chain.codec)
            if checksum != chain.checksum:
                return None, {}, checksum  # refused: the held weights are as they were
            if held.write(
                chain.version, lambda: add_updates(held.tensors, chain.updates, chain.codec)
            ):
                tensors = dict(held.tensors)
        if tensors is None:
            tensors = apply_updates(held.tensors, chain.updates, chain.codec)
            checksum = weights_checksum(tensors)
        if prepare is not None and checksum == chain.checksum:
            prepare(tensors)
        return None, tensors, checksum

    async def heartbeats(self, interval: float) -> None:
        """Report progress to every shard every `interval` seconds, each shard on its own (one
        that is down never holds up the others' heartbeats); notice when the job finished."""
        shards = range(len(self.clients))
        await asyncio.gather(*(self._heartbeats_to(shard, interval) for shard in shards))

    def report(
        self, *, step: int, tokens: int, loss: float | None, step_time: float | None
    ) -> None:
        """The training thread's latest figures for the heartbeats. Updated in place: the flags
        fragment_sync and drain.py keep in `progress` stay (a dict put in its place once lost
        them, and every heartbeat after the first step failed)."""
        self.progress.update(step=step, tokens=tokens, loss=loss, step_time=step_time)

    async def awaited(self) -> int:
        """Islands of the job the syncer has not heard of yet (shard 0's status: every island
        joins every shard); learner/start_together.py."""
        return (await self.clients[0].status()).awaited_islands

    async def report_now(self) -> None:
        """One heartbeat to every shard now, outside the timer (a change the syncer should not
        wait an interval for: the island drained)."""
        progress = dict(self.progress)
        await asyncio.gather(
            *(self._heartbeat(s, progress, None) for s in range(len(self.clients)))
        )

    async def _heartbeats_to(self, shard: int, interval: float) -> None:
        last_state = None
        while True:
            last_state = await self._heartbeat(shard, dict(self.progress), last_state)
            await asyncio.sleep(interval)

    async def _heartbeat(
        self, shard: int, progress: dict[str, Any], last_state: str | None
    ) -> str | None:
        """One heartbeat to one shard; the island's state it answered (or `last_state`)."""
        try:
            reply = await self.clients[shard].heartbeat(
                self.island,
                step=progress["step"],
                tokens=progress["tokens"],
                loss=progress["loss"],
                step_time=progress["step_time"],
                holding=progress["holding"],
                drained=progress["drained"],
                waiting=self.waits.share_since(shard, time.monotonic()),
            )
        except SyncerError as err:
            log.warning("heartbeat failed: %s", err)
            if err.status == 404:  # the syncer forgot us (restarted without our record)
                await self._join_shard(shard, threading.Event())
            return last_state
        self._shard_says(shard, reply.finished)
        joined = self.joined.get(shard)
        if joined is not None and join_unknown(joined, reply.run, reply.resumed, reply.joins):
            log.info("the syncer restarted, maybe without our join: joining again, same count")
            await self._join_shard(shard, threading.Event(), keeps_count=True)
        elif joined is not None and reply.run:  # this run holds our join's record (join_unknown)
            self.joined[shard] = JoinMark(reply.run, joined.versions, joined.joins)
        if shard == 0 and reply.inner_steps is not None:
            self.inner_steps = reply.inner_steps
        if shard == 0:  # once split, split for the job (island_rounds.split_budget)
            self.split_budget = self.split_budget or reply.split_budget
        self._hear_stop_at(reply.stop_at)
        if reply.state != last_state:
            where = f" (syncer shard {shard})" if len(self.clients) > 1 else ""
            log.info("syncer says this island is %s%s", reply.state, where)
        return reply.state

    def _hear_stop_at(self, stop_at: int | None) -> None:
        """A heartbeat's or push's stop target (syncer/state/targets.py): the lowest stands."""
        if stop_at is not None:
            self.stop_at = min(stop_at, self.stop_at or stop_at)

    def close(self, *, leave: bool) -> None:
        """Cancel everything in flight, then (optionally) say goodbye to every shard, and stop
        the loop."""

        async def goodbye(client: SyncerClient) -> None:
            try:
                await asyncio.wait_for(client.leave(self.island), timeout=2.0)
                log.info("left the syncer at %s", client.base_url)
            except (TimeoutError, SyncerError) as err:
                log.warning("could not say goodbye to the syncer: %s", err)

        async def shutdown() -> None:
            # Heartbeats and syncs first: a heartbeat after the goodbye would make the island
            # active again (a sign of life).
            me = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not me]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if leave:  # every shard at once
                await asyncio.gather(*(goodbye(client) for client in self.clients))
            for client in self.clients:
                await client.close()

        for coro, future in self._deferred:  # never started: nothing of them to cancel
            coro.close()
            future.cancel()
        self._deferred = []
        try:
            self.submit(shutdown()).result(timeout=15.0)
        except (concurrent.futures.TimeoutError, RuntimeError) as err:
            log.warning("syncer link did not shut down cleanly: %s", err)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)


def _latency(
    push_seconds: float, push_bytes: int, pulled: PulledFragment, path: PullPath
) -> float | None:
    """A merged sync's latency less any wait for peers (overlap.sync_latency): what
    sync.overlapMode auto fits τ to; the receipt made ready or staged counts with the rebuild."""
    return sync_latency(
        push_seconds=push_seconds,
        push_bytes=push_bytes,
        merge_seconds=pulled.cost.merge_seconds,
        pull_bytes=pulled.cost.body_bytes,
        pull_seconds=pulled.cost.pull_seconds,
        rebuild_seconds=pulled.cost.rebuild_seconds + path.prepare,
    )


class _Once:
    """A receipt's preparer (FragmentState.receipt_preparer) that says whether it ran: the
    link runs it in a chain's rebuild hop when it can, else in a hop of its own."""

    def __init__(self, prepare: Callable[[Mapping[str, Tensor]], None]) -> None:
        self.prepare = prepare
        self.ran = False

    def __call__(self, tensors: Mapping[str, Tensor]) -> None:
        self.prepare(tensors)
        self.ran = True


def in_place_ok(t: Tensor) -> bool:
    """Whether a held tensor can take a chain in place: fp32, contiguous, on the host (what
    published.checksum_after_updates reads and apply_updates' result is)."""
    return t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu"


def _settle(future: concurrent.futures.Future[Any], task: asyncio.Task[Any]) -> None:
    """Copy a finished task's outcome to its future (SyncerLink.submit_later's), unless the
    future was cancelled meanwhile."""
    if future.cancelled():
        return
    try:
        if task.cancelled():
            future.cancel()
        elif task.exception() is not None:
            future.set_exception(task.exception())
        else:
            future.set_result(task.result())
    except concurrent.futures.InvalidStateError:
        pass  # cancelled by the training thread between the check and the set
