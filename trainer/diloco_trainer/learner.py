"""`diloco learner`: one rank of one island.

An island runs H inner AdamW steps on its data shard between syncs of each parameter fragment, and
talks only to the syncer (rank 0 does; with WORLD_SIZE > 1 the ranks are a DDP group and rank 0
broadcasts what it receives).

Schedule (steps counted from 1, see `plan_step`):
- Fragment f is *due* at inner step t when `fragments_due(t, H, offsets)` lists it. Then rank 0
  computes Δ_f = θ_global_f − θ_local_f in fp32 on the CPU, encodes it with the job's codec and
  pushes it in the background, with the base version and the tokens, steps, mean loss and step time
  counted since it last *received* fragment f (so nothing is counted twice).
- Training goes on for τ = sync.overlapSteps steps. After step t+τ the merged fragment is applied:
  θ_f ← α·θ_f,local + (1−α)·θ_f,global (α = sync.mixAlpha); θ_global_f becomes the new base and the
  fragment's counters restart.
- A fragment that is due while its previous push is still unapplied is skipped (its counters keep
  running), so a pseudo-gradient is never sent twice on the same base.

Waiting policy: at step t+τ rank 0 waits for a version newer than the pushed base (the background
task long-polls the syncer for it), but at most `wait_budget(...)` seconds: the larger of the
syncer's heartbeat timeout (after which a dead island no longer holds a quorum back) and three
times the recently measured push-to-merge time. If nothing arrived by then the learner keeps
training and applies the fragment after the first later step at which it has arrived (a
non-blocking check every step). So a learner never deadlocks on a syncer that is down or a quorum
that cannot form; it just trains locally until the syncer answers.

Compressed pulls (sync.pullCompression): rank 0 tells the syncer which version of a fragment it
holds, and may get the encoded weight updates since then instead of the full fragment; it applies
them to the weights it holds with the syncer's own float ops (published.apply_updates), so it ends
up with the syncer's published weights bit for bit, and checks the syncer's checksum. On a mismatch
(or a malformed chain) it logs a warning and pulls the full fragment. The other ranks receive the
rebuilt fp32 weights by broadcast, as before.

Refusals: a push refused as too stale (409) or from a dropped island (403) is discarded and the
current global fragment is pulled and applied in its place. A syncer that forgot the island (404,
e.g. restarted without it) is joined again. Connection errors are retried by the client with
backoff.

Restarts: a learner that restarts simply joins again and takes the current global weights. Its inner
AdamW state starts fresh (the Decoupled DiLoCo paper keeps stale state; we have none to keep since
learners hold no checkpoint), and its learning-rate schedule continues from outerStep·H.

DDP: every rank runs the same steps. After each inner step all ranks take part in one all-reduce
(MAX) of a small int tensor: rank 0 fills in which fragments apply now and whether the job finished,
every rank adds its own stop request (SIGTERM). Then rank 0 broadcasts the tensors of each fragment
that applies, in a fixed order. So the collectives are the same on every rank.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import hashlib
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from diloco_trainer import compress
from diloco_trainer.config import ConfigError, JobSpec, load_spec
from diloco_trainer.contract import ContractError, LearnerEnv
from diloco_trainer.fragments import fragment_offsets, fragments_due
from diloco_trainer.parts import build_parts, inner_lr, make_inner_optimizer, set_lr
from diloco_trainer.published import apply_updates, weights_checksum
from diloco_trainer.wire import (
    JoinInfo,
    PulledFragment,
    PulledUpdates,
    PushMeta,
    SyncerClient,
    SyncerError,
)

log = logging.getLogger("diloco.learner")
T = TypeVar("T")

# How many times the recent push-to-merge time a learner waits before it trains on without the
# merged fragment.
ROUND_TIME_FACTOR = 3.0


@dataclass(frozen=True)
class StepPlan:
    """What a learner does with its fragments after inner step `step`.

    push: due now and idle: compute Δ and push it.
    skip: due now, but the previous push of the fragment is not applied yet: keep accumulating.
    wait: the merged fragment is needed now: wait (bounded) for it, then apply it.
    poll: overdue (an earlier bounded wait ran out): apply it only if it has already arrived.
    """

    push: tuple[int, ...] = ()
    skip: tuple[int, ...] = ()
    wait: tuple[int, ...] = ()
    poll: tuple[int, ...] = ()


def plan_step(
    step: int,
    *,
    inner_steps: int,
    offsets: Sequence[int],
    overlap: int,
    pushed_at: Mapping[int, int],
    abandoned: frozenset[int] = frozenset(),
) -> StepPlan:
    """Decide what happens to each fragment after inner step `step` (counted from 1).

    `pushed_at` maps each fragment with a push in flight (pushed, merged result not applied yet) to
    the step it was pushed at. A fragment pushed at step s is applied after step s + overlap; with
    overlap 0 that is the very step it is pushed at, so it appears in both `push` and `wait`.

    `abandoned` are in-flight fragments whose merged result is overdue by more than the wait
    budget (e.g. the syncer restarted and lost the pending push): when one is due again it is
    pushed afresh (same base, counters since the last receipt; the syncer replaces an island's
    pending push) instead of skipped, so a lost push cannot stall the fragment for good.
    """
    if step < 1:
        raise ValueError(f"inner steps are counted from 1, got {step}")
    if overlap < 0:
        raise ValueError(f"sync.overlapSteps must be >= 0, got {overlap}")
    due = fragments_due(step, inner_steps, offsets)
    push = tuple(f for f in due if f not in pushed_at or f in abandoned)
    skip = tuple(f for f in due if f in pushed_at and f not in abandoned)
    apply_at = dict(pushed_at)
    apply_at.update({f: step for f in push})
    wait = tuple(sorted(f for f, s in apply_at.items() if s + overlap == step))
    poll = tuple(sorted(f for f, s in apply_at.items() if s + overlap < step))
    return StepPlan(push=push, skip=skip, wait=wait, poll=poll)


def wait_budget(round_times: Sequence[float], heartbeat_timeout: float) -> float:
    """Seconds to block for a merged fragment before training on without it.

    At least the heartbeat timeout (a dead island stops counting towards the quorum after that, so
    a reachable quorum merges within it) and at least ROUND_TIME_FACTOR times the slowest recent
    push-to-merge time (a legitimately slow quorum, e.g. K = M with a straggler).
    """
    if heartbeat_timeout <= 0:
        raise ValueError(f"sync.heartbeatTimeoutSeconds must be > 0, got {heartbeat_timeout}")
    recent = max((t for t in round_times if math.isfinite(t) and t >= 0), default=0.0)
    return max(heartbeat_timeout, ROUND_TIME_FACTOR * recent)


def schedule_start(versions: Sequence[int], inner_steps: int, offsets: Sequence[int]) -> int:
    """The inner step count a joining learner starts from, so that its first push is of the
    fragment the syncer merges next (and its own schedule is in phase with the others').

    Within a round fragments are due in the order of their positions (offset, or H for offset 0),
    so the fragment merged next is the first in that order with the lowest version. The learner
    starts right after the preceding position, giving it a full slot of training before that
    push. Why it matters: with a quorum of every island and F > 1, an island out of phase would
    wait for fragment f while another waits for fragment g from it, each blocking the other until
    the wait budget runs out. With F = 1, or everything at version v, the start is 0.
    """
    if len(versions) != len(offsets):
        raise ValueError(f"{len(versions)} versions for {len(offsets)} fragments")
    positions = [off % inner_steps or inner_steps for off in offsets]
    order = sorted(range(len(offsets)), key=lambda f: (positions[f], f))
    lowest = min(versions)
    nxt = next(f for f in order if versions[f] == lowest)
    return max([0, *(p for p in positions if p < positions[nxt])])


# ---------------------------------------------------------------------------------------------
# Rank 0's link to the syncer: an asyncio loop on a daemon thread.

# Seconds one long-poll for a merged fragment asks the syncer to hold the request.
LONG_POLL_SECONDS = 20.0
# Seconds the training loop blocks at a time while it waits, so SIGTERM is noticed promptly.
WAIT_SLICE_SECONDS = 0.2
# Log a progress line every this many inner steps.
LOG_EVERY_STEPS = 20


@dataclass(frozen=True)
class HeldFragment:
    """The global weights of a fragment that rank 0 holds (its Δ base) and their version: what
    a chain of pulled updates is applied to. The tensors are never written to."""

    version: int
    tensors: Mapping[str, Tensor]


@dataclass(frozen=True)
class SyncResult:
    """How a push of one fragment ended: the global weights to apply and what happened."""

    pulled: PulledFragment
    outcome: str  # "merged", or why the current fragment was taken instead
    seconds: float  # push sent to merged fragment received


def encode_delta(
    delta: Mapping[str, Tensor], codec: str, feedback: compress.ErrorFeedback | None
) -> dict[str, Tensor]:
    """Encode a pseudo-gradient for the wire, carrying the codec's error forward when asked."""
    if feedback is None:
        return compress.encode_tensors(delta, codec)
    sent = {n: feedback.compensate(n, d) for n, d in delta.items()}
    encoded = compress.encode_tensors(sent, codec)
    decoded = compress.decode_tensors(encoded, codec, {n: t.shape for n, t in sent.items()})
    for n, t in sent.items():
        feedback.record(n, t, decoded[n])
    return encoded


class SyncerLink:
    """Rank 0's connection to the syncer on its own thread and event loop.

    The training loop never awaits anything: it submits coroutines and gets concurrent futures,
    which it may wait on (bounded) or just check.
    """

    def __init__(self, client: SyncerClient, *, island: str, replicas: int) -> None:
        self.client = client
        self.island = island
        self.replicas = replicas
        self.finished = threading.Event()
        # Latest figures for heartbeats; written by the training thread, read by the loop.
        self.progress: dict[str, Any] = {"step": 0, "tokens": 0, "loss": None, "step_time": None}
        # Pulls answered with a chain of updates, and chains that failed their check.
        self.pull_counts = {"updates": 0, "rebuildFailed": 0}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="syncer-link", daemon=True
        )
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run a coroutine on the link's loop."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def join(self, stop: threading.Event) -> JoinInfo:
        """Join, retrying for as long as the syncer is unreachable (it may start after us)."""
        while True:
            try:
                info = await self.client.join(self.island, self.replicas)
            except SyncerError as err:
                if err.status != 0 or stop.is_set():
                    raise
                log.warning("syncer still unreachable, trying again: %s", err)
                continue
            if info.finished:
                self.finished.set()
            return info

    async def pull_all(self, num_fragments: int) -> list[PulledFragment]:
        """The current global weights of every fragment."""
        pulled = []
        for f in range(num_fragments):
            got = await self.client.pull_fragment(f, after=-1)
            assert isinstance(got, PulledFragment), "a pull after version -1 without have is full"
            pulled.append(got)
        return pulled

    async def sync_fragment(
        self,
        fragment: int,
        encoded: Mapping[str, Tensor],
        meta: PushMeta,
        held: HeldFragment | None = None,
    ) -> SyncResult:
        """Push a pseudo-gradient, then long-poll for the merge that contains it.

        The syncer answers an accepted push with the fragment's version at that moment; the push
        sits in the round that produces the next version, so that is what we wait for. Waiting
        only for "newer than our base" would, whenever another merge slipped in first, hand us a
        version without our own work, and every later push would then be one version stale.

        A refused push (409 too stale, 403 dropped, 400/413 malformed) is logged and the current
        fragment is returned instead; an island the syncer forgot (404) joins again first.
        """
        start = time.monotonic()
        outcome = "merged"
        after = meta.base_version
        try:
            reply = await self.client.push(fragment, encoded, meta)
            log.debug("fragment %d push answered %s", fragment, reply)
            if reply.get("accepted"):
                after = max(after, int(reply.get("version", after)))
        except SyncerError as err:
            after = -1
            outcome = f"push refused ({err})"
            if err.status == 404:
                await self.join(threading.Event())
                outcome = "rejoined the syncer"
            log.warning("fragment %d: %s; taking the current global fragment", fragment, outcome)
        pulled = await self._pull_newer(fragment, after, held)
        if pulled.finished:
            self.finished.set()
        return SyncResult(pulled=pulled, outcome=outcome, seconds=time.monotonic() - start)

    async def resync(self, fragment: int) -> SyncResult:
        """The current global fragment, when a sync went wrong in a way a retry cannot fix."""
        start = time.monotonic()
        pulled = await self._pull_newer(fragment, -1)
        return SyncResult(pulled=pulled, outcome="resynced", seconds=time.monotonic() - start)

    async def _pull_newer(
        self, fragment: int, after: int, held: HeldFragment | None = None
    ) -> PulledFragment:
        """The fragment's global weights at a version > `after` (long-polling until there is
        one); as updates to `held` when the syncer offers them."""
        while True:
            try:
                pulled = await self.client.pull_fragment(
                    fragment,
                    after=after,
                    wait=LONG_POLL_SECONDS,
                    have=held.version if held is not None else -1,
                )
                if isinstance(pulled, PulledUpdates):
                    return await self._rebuild(fragment, pulled, held)
                if pulled is not None:
                    return pulled
                # A whole long-poll without a merge: if the syncer went back to an older
                # checkpoint our base is ahead of it, and waiting for "newer" could take long.
                status = await self.client.status()
                if status.get("finished"):
                    self.finished.set()
                if int(status["versions"][fragment]) < after:
                    log.warning(
                        "fragment %d: the syncer is at version %s, behind our base %d "
                        "(restarted from a checkpoint?); taking its current fragment",
                        fragment,
                        status["versions"][fragment],
                        after,
                    )
                    after = -1
            except SyncerError as err:
                # Unreachable past the client's retry deadline, or refused: keep trying, slowly;
                # the training loop goes on meanwhile.
                log.warning("fragment %d: pull failed (%s), trying again", fragment, err)
                await asyncio.sleep(WAIT_SLICE_SECONDS * 25)

    async def _rebuild(
        self, fragment: int, chain: PulledUpdates, held: HeldFragment | None
    ) -> PulledFragment:
        """The weights `chain` leads to from `held`, checked against the syncer's checksum; the
        full fragment (pulled again) when they do not match or the chain is malformed."""
        if held is None or chain.from_version != held.version:
            problem = f"they start from version {chain.from_version}, not the one held"
        else:
            try:
                tensors = await asyncio.to_thread(
                    apply_updates, held.tensors, chain.updates, chain.codec
                )
                checksum = await asyncio.to_thread(weights_checksum, tensors)
            except ValueError as err:
                problem = str(err)
            else:
                if checksum == chain.checksum:
                    self.pull_counts["updates"] += 1
                    return PulledFragment(
                        fragment=chain.fragment,
                        version=chain.version,
                        outer_step=chain.outer_step,
                        finished=chain.finished,
                        tensors=tensors,
                    )
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
        full = await self.client.pull_fragment(fragment, after=-1)
        assert isinstance(full, PulledFragment), "a pull without have is full"
        return full

    async def heartbeats(self, interval: float) -> None:
        """Report progress every `interval` seconds; notice when the job finished."""
        last_state = None
        while True:
            p = dict(self.progress)
            try:
                reply = await self.client.heartbeat(
                    self.island,
                    step=p["step"],
                    tokens=p["tokens"],
                    loss=p["loss"],
                    step_time=p["step_time"],
                )
                if reply.get("finished"):
                    self.finished.set()
                state = reply.get("state")
                if state != last_state:
                    log.info("syncer says this island is %s", state)
                    last_state = state
            except SyncerError as err:
                log.warning("heartbeat failed: %s", err)
                if err.status == 404:  # the syncer forgot us (restarted without our record)
                    await self.join(threading.Event())
            await asyncio.sleep(interval)

    def close(self, *, leave: bool) -> None:
        """Cancel everything in flight (optionally saying goodbye first) and stop the loop."""

        async def shutdown() -> None:
            if leave:
                try:
                    await asyncio.wait_for(self.client.leave(self.island), timeout=2.0)
                    log.info("left the syncer")
                except (SyncerError, asyncio.TimeoutError) as err:
                    log.warning("could not say goodbye to the syncer: %s", err)
            me = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not me]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.client.close()

        try:
            self.submit(shutdown()).result(timeout=15.0)
        except (concurrent.futures.TimeoutError, RuntimeError) as err:
            log.warning("syncer link did not shut down cleanly: %s", err)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)


# ---------------------------------------------------------------------------------------------
# The training loop.


@dataclass
class FragmentCounters:
    """An island's work on one fragment since it last received that fragment."""

    tokens: int = 0
    steps: int = 0
    loss_sum: float = 0.0
    time_sum: float = 0.0

    def add(self, tokens: int, loss: float, step_time: float) -> None:
        self.tokens += tokens
        self.steps += 1
        self.loss_sum += loss
        self.time_sum += step_time

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / self.steps if self.steps else 0.0

    @property
    def mean_step_time(self) -> float:
        return self.time_sum / self.steps if self.steps else 0.0


@dataclass
class InFlight:
    """A pushed fragment whose merged result is not applied yet."""

    step: int  # inner step it was pushed at
    started: float  # time.monotonic() of the push
    future: concurrent.futures.Future[SyncResult]


@dataclass
class FragmentState:
    """Rank 0's view of one fragment."""

    names: list[str]
    version: int = -1
    base: dict[str, Tensor] = field(default_factory=dict)  # fp32 CPU θ_global at `version`
    counters: FragmentCounters = field(default_factory=FragmentCounters)
    last_sync_seconds: float = 0.0


def weights_digest(model: nn.Module) -> str:
    """sha256 of every parameter's bytes, in order: DDP ranks of one island must agree on it."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def pick_device(requested: str) -> str:
    """'auto' means CUDA when available, else CPU."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ContractError(f"DILOCO_DEVICE={requested} but CUDA is not available")
    return requested


def cpu_budget() -> int:
    """CPUs this process may use: its affinity, capped by a cgroup v2 CPU quota (pod limits)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpus = cpus or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cpus


def configure_threads(device: str) -> None:
    """Intra-op threads: OMP_NUM_THREADS when set (diloco run sets it), else the CPU budget."""
    raw = os.environ.get("OMP_NUM_THREADS", "")
    if raw.isdigit() and int(raw) > 0:
        torch.set_num_threads(int(raw))
    elif device == "cpu":
        torch.set_num_threads(cpu_budget())


class Learner:
    """One rank of one island; rank 0 also owns the SyncerLink."""

    def __init__(self, spec: JobSpec, env: LearnerEnv, device: str, stop: threading.Event):
        self.spec = spec
        self.env = env
        self.device = device
        self.stop = stop
        self.rank0 = env.rank == 0
        self.distributed = env.world_size > 1
        self.parts = build_parts(
            spec,
            shard_index=env.island_index,
            num_shards=spec.total_shards(),
            rank=env.rank,
            world_size=env.world_size,
            device=device,
        )
        if self.parts.train is None:
            raise ConfigError("model.entrypoint returned no train stream (TrainingParts.train)")
        self.model = self.parts.model
        self.model.train()
        self.params: dict[str, nn.Parameter] = dict(self.model.named_parameters())
        self.train_model: nn.Module = self.model
        if self.distributed:
            self.train_model = nn.parallel.DistributedDataParallel(
                self.model, device_ids=[torch.cuda.current_device()] if device == "cuda" else None
            )
        self.optimizer = make_inner_optimizer(spec, self.model)
        self.fragments: list[FragmentState] = []
        self.inflight: dict[int, InFlight] = {}
        self.results: dict[int, SyncResult] = {}  # rank 0: arrived results applied this step
        self.round_times: list[float] = []
        self.error_feedback = compress.ErrorFeedback() if spec.sync.error_feedback else None
        self.link: SyncerLink | None = None
        self.tokens = 0

    # -- collectives (every rank runs exactly the same sequence) --------------------------------

    def _exchange_start(
        self, fragment_of: dict[str, int] | None, start: tuple[int, int]
    ) -> tuple[list[list[str]], int, int]:
        """Rank 0 knows the fragment of each parameter (from the syncer), the schedule start and
        the learning-rate schedule offset; share them so every rank runs the same steps."""
        names = list(self.params)
        owner = [fragment_of.get(n, -1) for n in names] if fragment_of is not None else []
        owner = owner or [-1] * len(names)
        word = torch.tensor([*start, *owner], dtype=torch.int64, device=self._comm_device())
        if self.distributed:
            dist.broadcast(word, src=0)
        first, lr_offset, *owner = word.tolist()
        num = max(owner, default=-1) + 1
        layout = [[n for n, f in zip(names, owner, strict=True) if f == g] for g in range(num)]
        return layout, first, lr_offset

    def _control(self, apply: Sequence[int], finished: bool) -> tuple[list[int], bool, bool]:
        """All-reduce(MAX) of [stop, finished, apply mask...]: rank 0's plan, anyone's stop."""
        stop = self.stop.is_set()
        if not self.distributed:
            return list(apply), finished, stop
        word = torch.zeros(2 + len(self.layout), dtype=torch.int64, device=self._comm_device())
        word[0] = int(stop)
        if self.rank0:
            word[1] = int(finished)
            for f in apply:
                word[2 + f] = 1
        dist.all_reduce(word, op=dist.ReduceOp.MAX)
        flags = word.tolist()
        return [f for f in range(len(self.layout)) if flags[2 + f]], bool(flags[1]), bool(flags[0])

    def _apply(self, fragments: Sequence[int], alpha: float) -> None:
        """θ_f ← α·θ_f,local + (1−α)·θ_f,global for each fragment, global from rank 0."""
        with torch.no_grad():
            for f in fragments:
                tensors = self.results[f].pulled.tensors if self.rank0 else {}
                for name in self.layout[f]:
                    p = self.params[name]
                    if self.rank0:
                        g = tensors[name].to(device=p.device, dtype=torch.float32)
                    else:
                        g = torch.empty(p.shape, dtype=torch.float32, device=p.device)
                    if self.distributed:
                        dist.broadcast(g, src=0)
                    if alpha == 0.0:
                        p.copy_(g)
                    else:
                        p.mul_(alpha).add_(g.to(p.dtype), alpha=1.0 - alpha)

    def _comm_device(self) -> str:
        return self.device if self.device.startswith("cuda") else "cpu"

    # -- rank 0: syncer bookkeeping ------------------------------------------------------------

    def _wait(self, future: concurrent.futures.Future[Any], timeout: float) -> bool:
        """Block up to `timeout` for a future; give up early on SIGTERM or a finished job."""
        deadline = time.monotonic() + timeout
        while not future.done():
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.stop.is_set():
                return False
            if self.link is not None and self.link.finished.is_set():
                return False
            concurrent.futures.wait([future], timeout=min(remaining, WAIT_SLICE_SECONDS))
        return True

    def _join(self) -> JoinInfo | None:
        """Rank 0: join and fetch every fragment's global weights (kept as the Δ bases)."""
        assert self.link is not None
        future = self.link.submit(self.link.join(self.stop))
        if not self._wait(future, float("inf")):
            return None
        info = future.result()
        names = set(self.params)
        listed = [n for frag in info.fragments for n in frag]
        if set(listed) != names or len(listed) != len(names):
            missing, extra = names - set(listed), set(listed) - names
            raise ConfigError(
                "the syncer's model does not match this learner's (check model.preset/entrypoint): "
                f"missing {sorted(missing)[:5]}, unknown {sorted(extra)[:5]}"
            )
        pulled_future = self.link.submit(self.link.pull_all(len(info.fragments)))
        if not self._wait(pulled_future, float("inf")):
            return None
        for f, pulled in enumerate(pulled_future.result()):
            self.results[f] = SyncResult(pulled=pulled, outcome="joined", seconds=0.0)
        self.fragments = [FragmentState(names=list(frag)) for frag in info.fragments]
        log.info(
            "joined the syncer at outer step %d: %d fragment(s), versions %s, codec %s, "
            "pull codec %s",
            info.outer_step,
            len(info.fragments),
            info.versions,
            info.codec,
            info.pull_compression,
        )
        return info

    def _take_result(self, f: int, step: int) -> None:
        """Record an arrived fragment as the new base (rank 0, before _apply)."""
        result = self.results[f]
        state = self.fragments[f]
        pulled = result.pulled
        for name in self.layout[f]:
            if tuple(pulled.tensors[name].shape) != tuple(self.params[name].shape):
                raise ValueError(
                    f"fragment {f}: tensor {name} has shape {tuple(pulled.tensors[name].shape)}, "
                    f"the model has {tuple(self.params[name].shape)}"
                )
        # The pulled tensors are ours (fresh from the wire) and never written to: no copy needed.
        state.base = {n: pulled.tensors[n].to(torch.float32) for n in self.layout[f]}
        state.version = pulled.version
        state.counters = FragmentCounters()
        if result.outcome == "joined":
            log.info("fragment %d: took version %d (joined)", f, pulled.version)
        else:
            state.last_sync_seconds = result.seconds
            self.round_times = [*self.round_times[-7:], result.seconds]
            log.info(
                "step %d: fragment %d applied version %d (%s, %.2fs after the push)",
                step,
                f,
                pulled.version,
                result.outcome,
                result.seconds,
            )
        if pulled.finished and self.link is not None:
            self.link.finished.set()

    def _push(self, f: int, step: int) -> None:
        """Compute Δ_f = θ_global − θ_local (fp32, CPU), encode it and push it in the background."""
        assert self.link is not None
        state = self.fragments[f]
        delta = {
            n: state.base[n] - self.params[n].detach().to("cpu", torch.float32)
            for n in self.layout[f]
        }
        codec = self.spec.sync.compression
        encoded = encode_delta(delta, codec, self.error_feedback)
        c = state.counters
        meta = PushMeta(
            island=self.env.island,
            base_version=state.version,
            tokens=c.tokens,
            steps=c.steps,
            loss=c.mean_loss,
            step_time=c.mean_step_time,
            codec=codec,
            sync_time=state.last_sync_seconds,
        )
        old = self.inflight.get(f)
        if old is not None:
            old.future.cancel()
            log.warning("step %d: fragment %d overdue, pushing it again", step, f)
        held = HeldFragment(version=state.version, tensors=state.base)
        future = self.link.submit(self.link.sync_fragment(f, encoded, meta, held))
        self.inflight[f] = InFlight(step=step, started=time.monotonic(), future=future)
        nbytes = sum(t.numel() * t.element_size() for t in encoded.values())
        log.info(
            "step %d: fragment %d pushed (base version %d, %d bytes %s, %d tokens in %d steps)",
            step,
            f,
            state.version,
            nbytes,
            codec,
            c.tokens,
            c.steps,
        )

    def _collect(self, f: int, *, block: float) -> bool:
        """Rank 0: has fragment f's sync finished (waiting up to `block` s)? Stores the result."""
        flight = self.inflight[f]
        if not self._wait(flight.future, block):
            return False
        try:
            self.results[f] = flight.future.result()
        except (concurrent.futures.CancelledError, Exception) as err:
            # The sync task only ends in an exception on a bug or a refused pull (auth): start
            # over from the current global fragment rather than train on alone for ever.
            log.error("fragment %d: sync failed (%s); resyncing", f, err)
            assert self.link is not None
            flight.future = self.link.submit(self.link.resync(f))
            return False
        del self.inflight[f]
        return True

    def _plan_syncs(self, step: int) -> list[int]:
        """Rank 0 after inner step `step`: push what is due, collect what is needed."""
        budget = wait_budget(self.round_times, self.spec.sync.heartbeat_timeout_seconds)
        now = time.monotonic()
        overlap = self.spec.sync.overlap_steps
        abandoned = frozenset(
            f
            for f, fl in self.inflight.items()
            if not fl.future.done() and now - fl.started > budget + overlap * self._step_time
        )
        plan = plan_step(
            step,
            inner_steps=self.spec.inner.steps,
            offsets=self.offsets,
            overlap=overlap,
            pushed_at={f: fl.step for f, fl in self.inflight.items()},
            abandoned=abandoned,
        )
        for f in plan.push:
            self._push(f, step)
        apply = []
        for f in plan.wait:
            started = time.monotonic()
            if self._collect(f, block=budget):
                apply.append(f)
                waited = time.monotonic() - started
                if waited > 0.05:
                    log.info("step %d: waited %.2fs for fragment %d", step, waited, f)
            elif not self.stop.is_set() and not self._finished():
                log.warning(
                    "step %d: fragment %d not merged within %.0fs; training on without it",
                    step,
                    f,
                    budget,
                )
        apply.extend(f for f in plan.poll if self._collect(f, block=0.0))
        for f in apply:
            self._take_result(f, step)
        return sorted(apply)

    def _finished(self) -> bool:
        return self.link is not None and self.link.finished.is_set()

    # -- the loop -------------------------------------------------------------------------------

    def _inner_step(self, schedule_step: int) -> tuple[float, int]:
        set_lr(self.optimizer, inner_lr(self.spec, schedule_step))
        assert self.parts.train is not None
        batch = self.parts.train.next_batch()
        loss = self.parts.loss_fn(self.train_model, batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.spec.inner.grad_clip > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.inner.grad_clip)
        self.optimizer.step()
        return float(loss.item()), batch.tokens * self.env.world_size

    def run(self) -> int:
        """Join, train until the job finishes or SIGTERM; the exit code."""
        info: JoinInfo | None = None
        fragment_of: dict[str, int] | None = None
        try:
            if self.rank0 and not self.stop.is_set():
                client = SyncerClient(self.env.syncer_url, self.env.token, self.env.ca_file)
                self.link = SyncerLink(client, island=self.env.island, replicas=self.env.world_size)
                info = self._join()
                if info is not None:
                    fragment_of = {n: f for f, names in enumerate(info.fragments) for n in names}
            return self._train(info, fragment_of)
        finally:
            if self.link is not None:
                self.link.close(leave=self.stop.is_set())

    def _train(self, info: JoinInfo | None, fragment_of: dict[str, int] | None) -> int:
        inner_steps = self.spec.inner.steps
        start = (0, 0)
        if info is not None:
            offsets = fragment_offsets(inner_steps, len(info.fragments))
            first = schedule_start(info.versions, inner_steps, offsets)
            start = (first, info.outer_step * inner_steps)
        self.layout, first, lr_offset = self._exchange_start(fragment_of, start)
        if not self.layout:  # rank 0 was stopped before it had joined: every rank gets []
            log.info("stopped before joining the syncer")
            return 0
        self.offsets = fragment_offsets(inner_steps, len(self.layout))
        # Everyone starts from the global weights (overwrite, whatever mixAlpha says).
        joined = list(range(len(self.layout))) if info is not None else []
        apply, finished, stopped = self._control(joined, self._finished())
        if self.rank0:
            for f in apply:
                self._take_result(f, 0)
        self._apply(apply, alpha=0.0)
        self.results.clear()
        if finished or stopped:
            log.info("nothing to do: %s", "the job has finished" if finished else "stopped")
            return 0
        if self.rank0:
            assert self.link is not None
            interval = min(5.0, self.spec.sync.heartbeat_timeout_seconds / 4)
            self.link.submit(self.link.heartbeats(interval))
        self._step_time = 0.0
        window_tokens, window_start, loss_ema = 0, time.monotonic(), None
        # The schedule step (fragments_due); the learning rate counts the steps run instead.
        step = first
        if first:
            log.info("starting at schedule step %d, in phase with the other islands", first)
        while True:
            step += 1
            t0 = time.perf_counter()
            loss, tokens = self._inner_step(lr_offset + step - first - 1)
            if self.device.startswith("cuda"):
                torch.cuda.synchronize()
            compute = time.perf_counter() - t0
            if self.env.slowdown > 1:
                time.sleep((self.env.slowdown - 1.0) * compute)  # a deliberate straggler
            step_time = time.perf_counter() - t0
            ema = 0.9 * self._step_time + 0.1 * step_time
            self._step_time = ema if self._step_time else step_time
            loss_ema = loss if loss_ema is None else 0.9 * loss_ema + 0.1 * loss
            self.tokens += tokens
            window_tokens += tokens
            apply: list[int] = []
            if self.rank0:
                assert self.link is not None
                for state in self.fragments:
                    state.counters.add(tokens, loss, step_time)
                self.link.progress = {
                    "step": step,
                    "tokens": self.tokens,
                    "loss": loss_ema,
                    "step_time": self._step_time,
                }
                if step % LOG_EVERY_STEPS == 0:
                    now = time.monotonic()
                    log.info(
                        "step %d loss %.4f tokens %d (%.0f tokens/s)",
                        step,
                        loss_ema,
                        self.tokens,
                        window_tokens / max(now - window_start, 1e-9),
                    )
                    window_tokens, window_start = 0, now
                apply = self._plan_syncs(step)
            apply, finished, stopped = self._control(apply, self._finished())
            self._apply(apply, alpha=self.spec.sync.mix_alpha)
            for f in apply:
                self.results.pop(f, None)
            if finished or stopped:
                log.info(
                    "%s after %d steps; weights digest %s",
                    "the job has finished: exiting" if finished else "stopping on request",
                    step - first,
                    weights_digest(self.model),
                )
                return 0


def _init_distributed(env: LearnerEnv, device: str) -> None:
    """DDP inside the island: gloo on CPU, NCCL on CUDA; rank 0's pod is the master."""
    if device == "cuda":
        torch.cuda.set_device(env.rank % torch.cuda.device_count())
    dist.init_process_group(
        backend="nccl" if device.startswith("cuda") else "gloo",
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
    )


def main(args: argparse.Namespace) -> int:
    """`diloco learner`: everything comes from the environment (contract.py)."""
    try:
        env = LearnerEnv.from_env()
    except ContractError as err:
        logging.basicConfig(level=logging.INFO)
        log.error("%s", err)
        return 2
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s {env.island}/{env.rank} %(name)s: %(message)s",
    )
    try:
        spec = load_spec(env.config_file)
        device = pick_device(env.device)
    except (ConfigError, ContractError) as err:
        log.error("%s", err)
        return 2
    configure_threads(device)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("got %s: leaving after this step", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if env.world_size > 1:
        _init_distributed(env, device)
    try:
        learner = Learner(spec, env, device, stop)
        log.info(
            "island %s rank %d/%d on %s with %d thread(s), shard %d of %d, syncer %s",
            env.island,
            env.rank,
            env.world_size,
            device,
            torch.get_num_threads(),
            env.island_index,
            spec.total_shards(),
            env.syncer_url,
        )
        code = learner.run()
    except (ConfigError, SyncerError, ValueError) as err:
        log.error("%s", err)
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    log.info("exiting with code %d", code)
    return code
