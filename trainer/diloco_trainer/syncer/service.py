"""The syncer: a CPU service that merges islands' pseudo-gradients into the global model.

It holds the fp32 global weights, split into fragments by bytes, and the outer optimizer. Each
fragment runs rounds (rounds.py): pushes are validated against the model, collected per island
(a newer push from an island replaces its pending one), and merged once a quorum has reported and
the grace window has passed (or every active island has reported): token-weighted merge
(merge.py) times a staleness factor, then an outer Nesterov step on that fragment, version + 1,
and long-polling pullers wake up. Every merge is logged (status and state_dir/merges.jsonl) with
its contributors, their lags and normalised weights, so it can be reproduced.

Compressed pulls (sync.pullCompression, see published.py): besides the exact weights the outer
optimizer steps (θ_exact, `weights`) the syncer keeps the copy learners hold (θ_pub,
`published`; the same tensors when the pull codec is none). Each merge moves θ_pub towards θ_exact
by one encoded update, and the last few updates per fragment are kept, so a learner that says
which version it holds gets the updates since then instead of the full fragment. Learners compute
their pseudo-gradients against θ_pub; the outer step applies to θ_exact. Evaluations and the
digest's "weights" are θ_exact.

Concurrency: HTTP handlers run on one asyncio loop; heavy work (decoding a push, merging, the
outer step, evaluation, serialising fragments, checkpoints, digests) runs in worker threads. One
asyncio lock makes every state change atomic: a merge holds it from taking the round to
publishing the new fragment, so pushes wait for merges; decoding a push does not hold it.
Evaluations and checkpoints take a snapshot under the lock and run afterwards in a background
queue, in order, so neither learners nor the next merge wait for them. A request that fails
validation changes nothing: size, safetensors, metadata, membership/staleness and tensor
names/shapes/dtypes are all checked before the state is touched.

Evaluation runs at start, every syncer.evalEveryOuterSteps outer steps and at the finish (its
evalHistory entry appears shortly after the merge it follows). When stopAfter is reached, the
syncer evaluates, writes a checkpoint, and only then reports finished=true; it keeps serving
status and pulls afterwards.

The HTTP edge (validation, auth, routes) is syncer_http.py; this module is the engine and main().
A merge that raises (a bug, never bad input: input is validated first) leaves the round half
applied, so the syncer then refuses work with 503 and reports unhealthy on /healthz until it is
restarted from its last checkpoint (exit code 1 on shutdown).

Shutdown (SIGTERM/SIGINT): long-polls are answered (304) at once, the server stops accepting
requests and exits within SHUTDOWN_TIMEOUT seconds; it does NOT write a checkpoint. What a crash
or a stop can lose is what happened since the last checkpoint (at most
syncer.checkpoint.everyOuterSteps outer steps; merged fragments are published before that
checkpoint is written): islands that pushed into the lost rounds notice the syncer's older
versions (a 409 with code "ahead", or versions in status/join) and continue from them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import logging
import math
import ssl
import sys
import time
from collections import deque
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from diloco_trainer.api import protocol
from diloco_trainer.api.contract import ContractError, SyncerEnv
from diloco_trainer.api.spec import ConfigError, JobSpec, load_spec
from diloco_trainer.core import payloads
from diloco_trainer.core.compress import decode_tensors, expected_encoded
from diloco_trainer.core.fragments import fragment_offsets, split_fragments
from diloco_trainer.core.merge import (
    contribution_weight,
    merge_pseudo_gradients,
    staleness_factor,
    work_coverage,
)
from diloco_trainer.core.outer import OuterOptimizer
from diloco_trainer.core.published import (
    UpdateHistory,
    WeightUpdate,
    history_length,
    publish_update,
)
from diloco_trainer.models.parts import build_parts, evaluate
from diloco_trainer.syncer import checkpoint as ckpt
from diloco_trainer.syncer.http import SHUTDOWN_TIMEOUT, build_app, parse_push_meta, ssl_context
from diloco_trainer.syncer.metrics import SyncerMetrics
from diloco_trainer.syncer.rounds import Contribution, Refused, RoundPolicy, SyncState

log = logging.getLogger("diloco.syncer")

MERGE_LOG_FILE = "merges.jsonl"
RECENT_MERGES = 20
# Push size limit: exact encoded payload, plus 5%, plus header room (per-tensor JSON entries and
# metadata). Anything larger cannot be a valid push for this fragment.
BODY_SLACK_RATIO = 1.05
BODY_SLACK_BYTES = 64 * 1024
HEADER_BYTES_PER_KEY = 256
# The merge scheduler re-checks timeouts at least this often.
TICK_SECONDS = 0.5


def fragment_body_limit(expected: dict[str, torch.Size], codec: str) -> int:
    """The largest push body accepted for a fragment with these tensors under `codec`."""
    spec = expected_encoded(expected, codec)
    payload = sum(shape.numel() * dtype.itemsize for dtype, shape in spec.values())
    header = HEADER_BYTES_PER_KEY * len(spec) + BODY_SLACK_BYTES
    return int(payload * BODY_SLACK_RATIO) + header


# ----- the engine ------------------------------------------------------------------------------


class Syncer:
    """Global weights, outer optimizer, rounds and membership of one job."""

    def __init__(
        self,
        spec: JobSpec,
        *,
        job_name: str,
        state_dir: Path,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.spec = spec
        self.job_name = job_name
        self.state_dir = state_dir
        self.clock = clock
        self.codec = spec.sync.compression
        self.rule = spec.sync.merge
        self.metrics = SyncerMetrics()
        self.parts = build_parts(
            spec, shard_index=0, num_shards=spec.total_shards(), with_train=False
        )
        model = self.parts.model.float().cpu()
        model.requires_grad_(False)
        self.weights: dict[str, torch.Tensor] = dict(model.named_parameters())
        self.fragments = split_fragments(
            {n: t.numel() * t.element_size() for n, t in self.weights.items()},
            spec.sync.fragments,
        )
        self.expected = [{n: self.weights[n].shape for n in names} for names in self.fragments]
        self.body_limits = [fragment_body_limit(e, self.codec) for e in self.expected]
        # θ_pub: what learners hold. With pull codec none it is θ_exact itself (no copy).
        self.pull_compression = spec.sync.effective_pull_compression
        self.published: dict[str, torch.Tensor] = self.weights
        if self.pull_compression != "none":
            self.published = {n: t.clone() for n, t in self.weights.items()}
        self.full_bytes = [
            sum(self.weights[n].numel() * self.weights[n].element_size() for n in names)
            for names in self.fragments
        ]
        self.history = [
            UpdateHistory(
                history_length(
                    self.full_bytes[f],
                    sum(
                        shape.numel() * dtype.itemsize
                        for dtype, shape in expected_encoded(e, self.pull_compression).values()
                    ),
                    spec.sync.max_staleness,
                )
            )
            for f, e in enumerate(self.expected)
        ]
        self.pulls = {protocol.KIND_FULL: 0, protocol.KIND_UPDATES: 0}
        self.outer = OuterOptimizer(
            self.weights,
            lr=spec.outer.lr,
            momentum=spec.outer.momentum,
            nesterov=spec.outer.nesterov,
        )
        grace = spec.sync.grace_seconds
        self.state = SyncState(
            RoundPolicy(
                quorum=spec.sync.quorum,
                max_staleness=spec.sync.max_staleness,
                heartbeat_timeout=spec.sync.heartbeat_timeout_seconds,
                grace_seconds=None if grace == "auto" else float(grace),
                overlap_steps=spec.sync.overlap_steps,
                inner_steps=spec.inner.steps,
                offsets=tuple(fragment_offsets(spec.inner.steps, len(self.fragments))),
            ),
            len(self.fragments),
        )
        self.merged_tokens = [0.0] * len(self.fragments)
        self.eval_history: list[dict[str, Any]] = []
        self.initial_eval_loss: float | None = None
        self.loss: float | None = None
        self.merges: deque[dict[str, Any]] = deque(maxlen=RECENT_MERGES)
        self.merge_count = 0
        self.finished = False
        self.last_merge_time: float | None = None
        self.bytes_in = 0
        self.bytes_out = 0
        self.last_eval_step = -1
        self.last_checkpoint_step = -1
        self.resumed_from: str | None = None
        # Set when a merge failed half-way: the state can no longer be trusted, so the syncer
        # refuses work (503) and reports unhealthy until it is restarted from its checkpoint.
        self.failure: str | None = None
        self._closing = False
        self._jobs: asyncio.Queue[Coroutine[Any, Any, None]] | None = None
        self._worker: asyncio.Task[None] | None = None
        # A second model to evaluate weight snapshots on while merges go on.
        self._eval_model = copy.deepcopy(self.parts.model)
        self._spec_hash = ckpt.spec_hash(spec.to_json())
        # Created on the serving loop (start()).
        self.lock: asyncio.Lock | None = None
        self._poke: asyncio.Event | None = None
        self._published: list[asyncio.Event] = []
        self._bodies: list[tuple[tuple[int, int, bool], bytes]] = []
        # Update-chain bodies of the published version, by fragment and the puller's version.
        self._chains: list[dict[tuple[tuple[int, int, bool], int], bytes]] = [
            {} for _ in self.fragments
        ]
        self._resume_or_init()

    # ----- start-up ----------------------------------------------------------------------------

    def _resume_or_init(self) -> None:
        loaded = ckpt.load_latest(self.state_dir)
        if loaded is None:
            loss = evaluate(self.parts)
            self.initial_eval_loss = loss
            self._record_eval(loss)
            # The initial state is a pure function of the spec: nothing to checkpoint yet.
            self.last_checkpoint_step = 0
            log.info("fresh start: initial eval loss %.4f", loss)
        else:
            self._restore(loaded)
        self.finished = self._stop_reached()
        self.metrics.outer_step.set(self.state.outer_step)

    def _restore(self, loaded: ckpt.Checkpoint) -> None:
        m = loaded.manifest
        if m.get("fragments") != self.fragments:
            raise ConfigError(
                f"checkpoint {loaded.path} splits the model into different fragments than "
                f"sync.fragments={len(self.fragments)} does now; use a fresh state dir"
            )
        missing = set(self.weights) ^ set(loaded.weights)
        if missing:
            raise ConfigError(
                f"checkpoint {loaded.path} holds other tensors than the model "
                f"(differences: {sorted(missing)[:5]}); was model.preset changed?"
            )
        for name, t in loaded.weights.items():
            if t.shape != self.weights[name].shape:
                raise ConfigError(
                    f"checkpoint {loaded.path}: {name} has shape {tuple(t.shape)}, the model "
                    f"{tuple(self.weights[name].shape)}"
                )
        if m.get("specHash") != self._spec_hash:
            log.warning("the job spec changed since checkpoint %s; resuming anyway", loaded.path)
        with torch.no_grad():
            for name, t in loaded.weights.items():
                self.weights[name].copy_(t)
            if self.published is not self.weights:
                # θ_pub as learners hold it; a checkpoint without it (pull codec none, or an
                # older syncer) gives θ_exact, and learners then get full weights once.
                source = loaded.published
                if source is None or not _same_shapes(source, self.weights):
                    if source is not None:
                        log.warning("checkpoint %s: published weights do not match", loaded.path)
                    source = loaded.weights
                for name, t in source.items():
                    self.published[name].copy_(t)
        self.outer.load_state_tensors(loaded.momentum)
        self.state = SyncState(self.state.policy, len(self.fragments), versions=m["versions"])
        self.state.restore_islands(m.get("islands", {}), now=self.clock())
        self.state.restore_answers(m.get("pushAnswers", []))
        self.merged_tokens = [float(t) for t in m["fragmentTokens"]]
        self.eval_history = list(m.get("evalHistory", []))
        self.initial_eval_loss = m.get("initialEvalLoss")
        self.loss = m.get("loss")
        self.merge_count = int(m.get("merges", 0))
        self.last_merge_time = m.get("lastMergeTime")
        self.last_eval_step = self.last_checkpoint_step = loaded.outer_step
        self.resumed_from = str(loaded.path)
        log.info(
            "resumed from %s: outer step %d, versions %s",
            loaded.path,
            loaded.outer_step,
            self.state.versions,
        )

    async def start(self) -> None:
        """Create the loop-bound primitives and the pull bodies (call on the serving loop)."""
        self.lock = asyncio.Lock()
        self._poke = asyncio.Event()
        self._jobs = asyncio.Queue()
        self._worker = asyncio.create_task(self.run_jobs())
        self._published = [asyncio.Event() for _ in self.fragments]
        self._bodies = await asyncio.to_thread(
            lambda: [self._encode_fragment(f) for f in range(len(self.fragments))]
        )
        # Every island of the job (all regions) holds the quorum until it joins or times out.
        self.state.expect(self.spec.total_shards(), self.clock())

    # ----- derived figures ---------------------------------------------------------------------

    @property
    def tokens(self) -> int:
        """Tokens merged into the global model (each fragment's merges, averaged over fragments)."""
        return round(sum(self.merged_tokens) / len(self.merged_tokens))

    @property
    def eval_loss(self) -> float | None:
        return self.eval_history[-1]["evalLoss"] if self.eval_history else None

    def _stop_reached(self) -> bool:
        stop = self.spec.stop_after
        if stop.outer_steps is not None and self.state.outer_step >= stop.outer_steps:
            return True
        return stop.tokens is not None and self.tokens >= stop.tokens

    def _record_eval(
        self, loss: float, *, step: int | None = None, tokens: int | None = None
    ) -> None:
        step = self.state.outer_step if step is None else step
        self.eval_history.append(
            {
                "outerStep": step,
                "tokens": self.tokens if tokens is None else tokens,
                "evalLoss": loss,
                "time": self.clock(),
            }
        )
        self.last_eval_step = max(self.last_eval_step, step)
        self.metrics.eval_loss.set(loss)

    def digest(self) -> str:
        """sha256 of the global weights and the outer momentum (and θ_pub when kept apart)."""
        published = self.published if self.published is not self.weights else None
        return ckpt.state_digest(self.weights, self.outer.state_tensors(), published)

    def _encode_fragment(self, f: int) -> tuple[tuple[int, int, bool], bytes]:
        key = (self.state.versions[f], self.state.outer_step, self.finished)
        meta = {
            protocol.META_KIND: protocol.KIND_FULL,
            protocol.META_VERSION: key[0],
            protocol.META_FRAGMENT: f,
            protocol.META_OUTER_STEP: key[1],
            protocol.META_FINISHED: key[2],
        }
        return key, payloads.encode_body({n: self.published[n] for n in self.fragments[f]}, meta)

    async def _chain_body(self, f: int, key: tuple[int, int, bool], have: int) -> bytes | None:
        """The update-chain body from version `have` to the published `key`, when the history
        holds it and it is smaller than the fragment; else None."""
        if self.pull_compression == "none" or have < 0:
            return None
        cached = self._chains[f].get((key, have))
        if cached is not None:
            return cached
        chain = self.history[f].chain(have, key[0], self.full_bytes[f])
        if chain is None:
            return None
        meta = {
            protocol.META_KIND: protocol.KIND_UPDATES,
            protocol.META_VERSION: key[0],
            protocol.META_FROM_VERSION: have,
            protocol.META_FRAGMENT: f,
            protocol.META_OUTER_STEP: key[1],
            protocol.META_FINISHED: key[2],
            protocol.META_CODEC: self.pull_compression,
            protocol.META_CHECKSUM: chain[-1].checksum,
        }
        body = await asyncio.to_thread(
            payloads.encode_update_chain, [(u.version, u.encoded) for u in chain], meta
        )
        if self._bodies[f][0] == key:  # still the published version: keep it for other pullers
            self._chains[f][(key, have)] = body
        return body

    # ----- requests ----------------------------------------------------------------------------

    def check_fragment(self, fragment: int) -> None:
        """Refused(404) unless the fragment exists."""
        if not 0 <= fragment < len(self.fragments):
            raise Refused(404, f"fragment {fragment} does not exist (0..{len(self.fragments) - 1})")

    def _wake(self) -> None:
        if self._poke is not None:
            self._poke.set()

    def _locked(self) -> asyncio.Lock:
        assert self.lock is not None, "Syncer.start() was not called"
        if self.failure:
            raise Refused(503, f"the syncer failed and must be restarted: {self.failure}")
        return self.lock

    def close_waiters(self) -> None:
        """Answer every long-poll now (304): the server is shutting down."""
        self._closing = True
        for event in self._published:
            event.set()

    async def join(self, island: str, replicas: int) -> dict[str, Any]:
        """Register an island; returns the fragment layout and current versions."""
        async with self._locked():
            rec = self.state.join(island, replicas, self.clock())
            self._update_gauges()
        self._wake()
        log.info(
            "island %s joined (join %d, %d replicas, %s)", island, rec.joins, replicas, rec.state
        )
        return {
            "fragments": self.fragments,
            "versions": self.state.versions,
            "outerStep": self.state.outer_step,
            "finished": self.finished,
            "codec": self.codec,
            "pullCompression": self.pull_compression,
            "state": rec.state,
        }

    async def heartbeat(
        self, island: str, *, step: int, tokens: int, loss: float | None, step_time: float | None
    ) -> dict[str, Any]:
        """A learner's sign of life; returns its membership state and whether the job finished."""
        async with self._locked():
            rec = self.state.heartbeat(
                island, self.clock(), step=step, tokens=tokens, loss=loss, step_time=step_time
            )
            self._update_gauges()
        self._wake()
        return {"state": rec.state, "finished": self.finished, "versions": self.state.versions}

    async def leave(self, island: str) -> dict[str, Any]:
        """An island says goodbye."""
        async with self._locked():
            rec = self.state.leave(island, self.clock())
            self._update_gauges()
        self._wake()
        log.info("island %s left", island)
        return {"island": island, "state": rec.state}

    async def set_membership(self, island: str, state: str, reason: str) -> dict[str, Any]:
        """Admin: mark an island active or dropped."""
        async with self._locked():
            rec = self.state.set_admin_state(island, state, reason, self.clock())
            self._update_gauges()
        self._wake()
        log.info("island %s set %s by admin (%s)", island, state, reason or "no reason given")
        return {"island": island, "state": rec.state, "reason": rec.reason}

    async def push(self, fragment: int, body: bytes) -> dict[str, Any]:
        """Validate and record a pushed pseudo-gradient; Refused (state unchanged) on a problem."""
        self.check_fragment(fragment)
        try:
            flat, raw_meta = payloads.decode_body(body)
        except ValueError as err:
            raise Refused(400, f"push body: {err}") from None
        meta = parse_push_meta(raw_meta, self.codec)
        async with self._locked():
            early = self._finished_or_duplicate(fragment, meta)
            if early is not None:
                return early
            self.state.check_push(fragment, meta.island, meta.base_version)
        try:
            decoded = await asyncio.to_thread(
                decode_tensors, flat, self.codec, self.expected[fragment]
            )
        except ValueError as err:
            raise Refused(400, f"push to fragment {fragment}: {err}") from None
        async with self._locked():
            early = self._finished_or_duplicate(fragment, meta)
            if early is not None:
                return early
            now = self.clock()
            # Checked again: a merge or a drop may have happened while decoding.
            lag = self.state.check_push(fragment, meta.island, meta.base_version)
            answer = self.state.accept_push(
                fragment,
                Contribution(
                    island=meta.island,
                    base_version=meta.base_version,
                    lag=lag,
                    tokens=meta.tokens,
                    steps=meta.steps,
                    loss=meta.loss if math.isfinite(meta.loss) else None,
                    received_at=now,
                    push_id=meta.push_id,
                    payload=decoded,
                    step_time=meta.step_time or None,
                    sync_time=meta.sync_time or None,
                ),
                now,
            )
            self.bytes_in += len(body)
            self.metrics.bytes_in.inc(len(body))
            self._update_gauges()
        self._wake()
        return answer

    def _finished_or_duplicate(
        self, fragment: int, meta: protocol.PushMeta
    ) -> dict[str, Any] | None:
        if self.finished:
            return {
                "accepted": False,
                "finished": True,
                "version": self.state.versions[fragment],
                "pending": 0,
                "reason": "the job has finished",
            }
        prev = self.state.previous_answer(fragment, meta.island, meta.push_id)
        return {**prev, "duplicate": True} if prev is not None else None

    async def pull(self, fragment: int, *, after: int, wait: float, have: int = -1) -> bytes | None:
        """Fragment bytes once its version is > after (or the job finished); None after `wait`.

        The body is the chain of updates since version `have` when there is one (see
        _chain_body), else the full published weights.
        """
        self.check_fragment(fragment)
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
            published = self._published[fragment]
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._closing:
                return None
            try:
                await asyncio.wait_for(published.wait(), remaining)
            except asyncio.TimeoutError:
                return None

    async def status(self, *, digest: bool = False) -> dict[str, Any]:
        """The status document (see the module docstring of wire.py for the route).

        Without the digest it is read without waiting for a running merge; that is consistent
        because a merge changes versions, rounds and token counts together after its arithmetic
        (see _merge). With the digest it waits for the lock, so the weights match the versions.
        """
        if not digest:
            return self._status_doc()
        async with self._locked():
            doc = self._status_doc()
            doc["digest"] = await asyncio.to_thread(self.digest)
        return doc

    def _status_doc(self) -> dict[str, Any]:
        return {
            "jobName": self.job_name,
            "outerStep": self.state.outer_step,
            "versions": self.state.versions,
            "finished": self.finished,
            "quorum": self.state.effective_quorum(),
            "awaitedIslands": self.state.awaited_islands(),
            "quorumTarget": self.state.policy.quorum,
            "grace": self.state.grace(),
            "fragments": len(self.fragments),
            "pending": [len(r.pending) for r in self.state.rounds],
            "codec": self.codec,
            "pullCompression": self.pull_compression,
            "pulls": dict(self.pulls),
            "tokens": self.tokens,
            "loss": self.loss,
            "evalLoss": self.eval_loss,
            "initialEvalLoss": self.initial_eval_loss,
            "evalHistory": list(self.eval_history),
            "bytesIn": self.bytes_in,
            "bytesOut": self.bytes_out,
            "lastMergeTime": self.last_merge_time,
            "mergeCount": self.merge_count,
            "activeIslands": len(self.state.active_islands()),
            "islands": self.state.islands_json(),
            "merges": list(self.merges),
            "resumedFrom": self.resumed_from,
            "failure": self.failure,
            "time": self.clock(),
        }

    def _update_gauges(self) -> None:
        self.metrics.active_islands.set(len(self.state.active_islands()))
        self.metrics.outer_step.set(self.state.outer_step)
        self.metrics.tokens.set(self.tokens)

    # ----- merging -----------------------------------------------------------------------------

    async def tick(self) -> float | None:
        """One scheduler pass: expire silent islands, merge every due round. Returns the next
        grace deadline (clock time), if a round is waiting for one."""
        async with self._locked():
            now = self.clock()
            awaited = self.state.awaited_islands()
            expired = self.state.expire(now)
            if awaited and not self.state.awaited_islands():
                log.warning(
                    "%d island(s) of %d never joined within heartbeatTimeoutSeconds of the "
                    "syncer's start: merging without them",
                    awaited,
                    self.spec.total_shards(),
                )
            for island in expired:
                log.warning("island %s timed out: %s", island, self.state.islands[island].reason)
                self._update_gauges()
            if not self.finished:
                for f in self.state.due_fragments(now):
                    await self._merge(f)
                    if self.finished:
                        break
            return None if self.finished else self.state.next_deadline()

    async def run_scheduler(self) -> None:
        """tick() whenever something changed, a grace window ends, or TICK_SECONDS passed.

        An exception in a merge marks the syncer failed (see `failure`) and ends the scheduler.
        """
        assert self._poke is not None
        while True:
            try:
                deadline = await self.tick()
            except Exception as err:
                self.failure = f"merge failed: {type(err).__name__}: {err}"
                log.exception("%s; refusing work until restarted from the last checkpoint", err)
                return
            wait = TICK_SECONDS
            if deadline is not None:
                wait = min(wait, max(0.005, deadline - self.clock()))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._poke.wait(), wait)
            self._poke.clear()

    async def _merge(self, f: int) -> None:
        """Merge fragment f's round (lock held): weights, outer step, version, log, publish."""
        started = time.perf_counter()
        now = self.clock()
        grace, quorum = self.state.grace(), self.state.effective_quorum()
        # The round is closed only after the arithmetic, in one step with the token counters, so
        # a status read while the merge runs in its thread never sees a half-done merge.
        contributions = self.state.peek_round(f)
        max_staleness = self.state.policy.max_staleness
        raw = [
            contribution_weight(c.tokens, c.steps, self.rule)
            * staleness_factor(c.lag, max_staleness)
            for c in contributions
        ]
        coverage = 1.0
        if self.spec.sync.scale_partial_merges:
            coverage = work_coverage(
                [c.steps for c in contributions],
                self.spec.inner.steps,
                len(self.state.active_islands()),
            )

        new_version = self.state.versions[f] + 1

        def work() -> WeightUpdate | None:
            merged = merge_pseudo_gradients(
                [c.payload for c in contributions], raw, self.rule, self.parts.plain_merge_names
            )
            if coverage < 1.0:
                for t in merged.values():
                    t.mul_(coverage)
            self.outer.step(merged)
            if self.published is self.weights:
                return None
            return publish_update(
                self.weights, self.published, self.fragments[f], self.pull_compression, new_version
            )

        update = await asyncio.to_thread(work)
        if update is not None:
            self.history[f].append(update)
        seconds = time.perf_counter() - started
        taken = self.state.take_round(f, now)
        assert len(taken) == len(contributions) and all(
            a is b for a, b in zip(taken, contributions, strict=True)
        ), "a round changed while its merge ran (lock not held?)"
        total = sum(raw)
        shares = [w / total for w in raw]
        tokens = sum(c.tokens for c in contributions)
        self.merged_tokens[f] += tokens
        losses = [(c.loss, c.tokens) for c in contributions if c.loss is not None]
        if losses:
            self.loss = sum(v * t for v, t in losses) / sum(t for _, t in losses)
        self.merge_count += 1
        self.last_merge_time = now
        entry = {
            "version": self.state.versions[f],
            "fragment": f,
            "outerStep": self.state.outer_step,
            "time": now,
            "quorum": quorum,
            "grace": grace,
            "rule": self.rule,
            "coverage": coverage,
            "tokens": tokens,
            "mergeSeconds": seconds,
            "contributors": [
                {**c.log_entry(), "rawWeight": w, "weight": s}
                for c, w, s in zip(contributions, raw, shares, strict=True)
            ],
        }
        self.merges.append(entry)
        await asyncio.to_thread(ckpt.append_jsonl, self.state_dir / MERGE_LOG_FILE, entry)
        self.metrics.merges.inc()
        self.metrics.merge_seconds.observe(seconds)
        self._update_gauges()
        evaluated = await self._after_merge()
        parts = ", ".join(
            f"{c.island} w={s:.3f} lag={c.lag}" for c, s in zip(contributions, shares, strict=True)
        )
        log.info(
            "merged fragment %d -> version %d (outer step %d, %d tokens, %.3fs): %s%s",
            f,
            entry["version"],
            self.state.outer_step,
            tokens,
            seconds,
            parts,
            f"; eval loss {evaluated:.4f}" if evaluated is not None else "",
        )

    async def _after_merge(self) -> float | None:
        """Publish, evaluate, checkpoint and finish as due (lock held); returns an eval loss when
        one was computed here (the finish), else None.

        Normally the merged fragments are published first and the evaluation and checkpoint run
        in the background on snapshots, so learners and the next merge never wait for them. At
        the finish, evaluation and checkpoint complete before finished=true is published.
        """
        step = self.state.outer_step
        eval_due = step > self.last_eval_step and (
            step % self.spec.syncer.eval_every_outer_steps == 0
        )
        ckpt_due = step > self.last_checkpoint_step and (
            step % self.spec.syncer.checkpoint.every_outer_steps == 0
        )
        if not self._stop_reached():
            await self._publish()
            if eval_due:
                self._schedule(self._eval_job(self._snapshot(), step, self.tokens))
                self.last_eval_step = step
            if ckpt_due:
                self._schedule(self._checkpoint_job(self._checkpoint_snapshot()))
                self.last_checkpoint_step = step
            return None
        await self.drain()  # earlier evaluations land in evalHistory first
        loss = None
        if step > self.last_eval_step:
            loss = await asyncio.to_thread(evaluate, self.parts)
            self._record_eval(loss)
        await self._checkpoint_job(self._checkpoint_snapshot())
        self.last_checkpoint_step = step
        self.finished = True
        await self._publish()
        log.info("finished at outer step %d with %d tokens", step, self.tokens)
        return loss

    # ----- background work (evaluations and checkpoints on snapshots, in order) ----------------

    def _schedule(self, job: Coroutine[Any, Any, None]) -> None:
        assert self._jobs is not None
        self._jobs.put_nowait(job)

    async def run_jobs(self) -> None:
        """Run scheduled evaluations and checkpoints one at a time, in order, until cancelled.

        A failed job is logged and skipped: a full disk must not stop training.
        """
        assert self._jobs is not None
        while True:
            job = await self._jobs.get()
            try:
                await job
            except Exception:
                log.exception("background evaluation or checkpoint failed")
            finally:
                self._jobs.task_done()

    async def drain(self) -> None:
        """Wait until every scheduled evaluation and checkpoint has finished."""
        if self._jobs is not None:
            await self._jobs.join()

    async def stop(self, timeout: float = 30.0) -> None:
        """Let scheduled jobs finish (a checkpoint being written completes); stop the worker."""
        if self._worker is None:
            return
        try:
            await asyncio.wait_for(self.drain(), timeout)
        except asyncio.TimeoutError:
            log.warning("stopping with evaluations or checkpoints still unfinished")
        self._worker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._worker

    def _snapshot(self) -> dict[str, torch.Tensor]:
        return {n: t.detach().clone() for n, t in self.weights.items()}

    async def _eval_job(self, weights: dict[str, torch.Tensor], step: int, tokens: int) -> None:
        def run() -> float:
            with torch.no_grad():
                for name, p in self._eval_model.named_parameters():
                    p.copy_(weights[name])
            return evaluate(self.parts, self._eval_model)

        loss = await asyncio.to_thread(run)
        self._record_eval(loss, step=step, tokens=tokens)
        log.info("eval at outer step %d (%d tokens): loss %.4f", step, tokens, loss)

    async def _publish(self) -> None:
        """Re-encode changed fragments and wake their pullers."""
        stale = [
            f
            for f in range(len(self.fragments))
            if self._bodies[f][0] != (self.state.versions[f], self.state.outer_step, self.finished)
        ]
        fresh = await asyncio.to_thread(lambda: [self._encode_fragment(f) for f in stale])
        for f, body in zip(stale, fresh, strict=True):
            self._bodies[f] = body
            self._chains[f].clear()
            old, self._published[f] = self._published[f], asyncio.Event()
            old.set()

    def _checkpoint_snapshot(self) -> dict[str, Any]:
        """Everything a checkpoint of the current state needs, copied (lock held)."""
        return {
            "outer_step": self.state.outer_step,
            "weights": self._snapshot(),
            "momentum": {n: t.clone() for n, t in self.outer.state_tensors().items()},
            "published": (
                None
                if self.published is self.weights
                else {n: t.detach().clone() for n, t in self.published.items()}
            ),
            "manifest": {
                "jobName": self.job_name,
                "versions": self.state.versions,
                "fragments": self.fragments,
                "fragmentTokens": list(self.merged_tokens),
                "tokens": self.tokens,
                "initialEvalLoss": self.initial_eval_loss,
                "loss": self.loss,
                "merges": self.merge_count,
                "lastMergeTime": self.last_merge_time,
                "islands": self.state.islands_json(),
                "specHash": self._spec_hash,
                "codec": self.codec,
                "pullCompression": self.pull_compression,
                "pushAnswers": self.state.answers_json(),
                "time": self.clock(),
            },
        }

    async def _checkpoint_job(self, snap: dict[str, Any]) -> None:
        step = snap["outer_step"]
        # Evaluations queued before this checkpoint have finished (jobs run in order).
        history = [e for e in self.eval_history if e["outerStep"] <= step]
        path = await asyncio.to_thread(
            ckpt.save_checkpoint,
            self.state_dir,
            outer_step=step,
            weights=snap["weights"],
            momentum=snap["momentum"],
            manifest={**snap["manifest"], "evalHistory": history},
            keep=self.spec.syncer.checkpoint.keep,
            published=snap["published"],
        )
        log.info("checkpoint %s written", path)


def _same_shapes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[n].shape == b[n].shape for n in a)


def main(args: argparse.Namespace) -> int:
    """`diloco syncer`: serve the job in $DILOCO_CONFIG_FILE until SIGTERM (exit 0), or exit 1
    after a failed merge, or 2 for a bad environment or config."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        env = SyncerEnv.from_env()
        spec = load_spec(env.config_file)
    except (ContractError, ConfigError) as err:
        print(f"diloco syncer: {err}", file=sys.stderr)
        return 2
    try:
        tls = ssl_context(env)
    except (OSError, ssl.SSLError) as err:
        print(f"diloco syncer: cannot load TLS certificate or key: {err}", file=sys.stderr)
        return 2
    try:
        syncer = Syncer(spec, job_name=env.job_name, state_dir=env.state_dir)
    except ConfigError as err:
        print(f"diloco syncer: {err}", file=sys.stderr)
        return 2
    log.info(
        "syncer for job %s serving %s on port %d: %d fragments, outer step %d, versions %s",
        env.job_name,
        "https" if tls else "http",
        env.port,
        len(syncer.fragments),
        syncer.state.outer_step,
        syncer.state.versions,
    )
    web.run_app(
        build_app(syncer, env.token),
        host="0.0.0.0",
        port=env.port,
        ssl_context=tls,
        print=None,
        access_log=None,
        handle_signals=True,
        shutdown_timeout=SHUTDOWN_TIMEOUT,
    )
    if syncer.failure:
        log.error("syncer stopped after a failure: %s", syncer.failure)
        return 1
    log.info("syncer stopped")
    return 0
