"""The syncer: a CPU service that merges islands' pseudo-gradients into the global model.

Each fragment runs rounds (rounds.py): pushes are validated against the model, collected per
island (a newer push from an island replaces its pending one), and merged once a quorum has
reported and the grace window has passed (or every active island has reported): the global model
(global_model.py) merges the round and takes an outer step (Delayed Nesterov, folded per round of
work) on that fragment, version + 1,
the publisher (publisher.py) re-encodes the fragment and wakes long-polling pullers, the merge log
(merge_log.py) records the merge so it can be reproduced, and evaluations and checkpoints run in
the background (jobs.py). The HTTP edge is http.py, the process server.py.

This module is the thin service that wires those rooms. Concurrency: HTTP handlers run on one
asyncio loop; heavy work (decoding a push, merging, the outer step, evaluation, serialising
fragments, checkpoints, digests) runs in worker threads. One asyncio lock makes every state change
atomic: a merge holds it from taking the round to publishing the new fragment, so pushes wait for
merges; decoding a push does not hold it. A request that fails validation changes nothing: size,
safetensors, metadata, membership/staleness and tensor names/shapes/dtypes are all checked before
the state is touched.

Hostile and broken input (README's Security section; gate.py): only the job's own island names
join, a push passes the guards (finite, norm bounds, steps and tokens of one round) before it
joins a round, and a merge whose input cannot be merged leaves out the contributions at fault.

When stopAfter is reached, the syncer evaluates, writes a checkpoint, and only then reports
finished=true; it keeps serving status and pulls afterwards. A stop (SIGTERM) lets a running merge
finish and writes a checkpoint of what was merged since the last one. A merge that raises while
applying the outer step (a bug: its input was checked) leaves the round half applied, so the
syncer then refuses work with 503 and reports unhealthy on /healthz until it is restarted from its
last checkpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from diloco_trainer.api import protocol
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.models.parts import build_parts
from diloco_trainer.syncer import checkpoint as ckpt
from diloco_trainer.syncer import server, startup
from diloco_trainer.syncer.gate import Gate
from diloco_trainer.syncer.global_model import GlobalModel
from diloco_trainer.syncer.health import MERGE, Health
from diloco_trainer.syncer.jobs import BackgroundJobs, CheckpointSnapshot
from diloco_trainer.syncer.merge_log import MergeLog, describe_merge
from diloco_trainer.syncer.metrics import SyncerMetrics
from diloco_trainer.syncer.publisher import BodyKey, Publisher
from diloco_trainer.syncer.records import round_policy
from diloco_trainer.syncer.rounds import Refused, SyncState
from diloco_trainer.syncer.status import checkpoint_manifest, status_document
from diloco_trainer.syncer.validation import decode_measured, push_contribution, read_push

__all__ = ["Syncer", "main"]

log = logging.getLogger("diloco.syncer")

# The merge scheduler re-checks timeouts at least this often.
TICK_SECONDS = 0.5


class Syncer:
    """One job's syncer: the global model, rounds and membership, the publisher, the merge log
    and the background jobs, behind one asyncio lock."""

    def __init__(
        self,
        spec: JobSpec,
        *,
        job_name: str,
        state_dir: Path,
        clock: Callable[[], float] = time.time,
        config_file: Path | None = None,
    ) -> None:
        self.spec = spec
        self.job_name = job_name
        self.state_dir = state_dir
        self.clock = clock
        self.codec = spec.sync.compression
        self.metrics = SyncerMetrics()
        self.health = Health(clock, self.metrics.healthy)
        self.parts = build_parts(
            spec, shard_index=0, num_shards=spec.total_shards(), with_train=False
        )
        self.model = GlobalModel(spec, self.parts.model, self.parts.plain_merge_names)
        n = len(self.model.fragments)
        self.publisher = Publisher(
            self.model, max_staleness=spec.staleness_bound(), metrics=self.metrics
        )
        self.state = SyncState(round_policy(spec, n), n)
        self.merge_log = MergeLog(n, state_dir)
        self.jobs = BackgroundJobs(
            spec,
            self.parts,
            self.model,
            state_dir=state_dir,
            metrics=self.metrics,
            clock=clock,
            health=self.health,
        )
        self.gate = Gate(
            spec,
            numels=[sum(self.model.weights[n].numel() for n in x) for x in self.fragments],
            weight_norms=self.model.fragment_norms(),
            metrics=self.metrics,
            health=self.health,
            config_file=config_file,
        )
        self.finished = False
        self.bytes_in = 0
        self.resumed_from: str | None = None
        # Set when a merge failed half-way: the state can no longer be trusted, so the syncer
        # refuses work (503) and reports unhealthy until it is restarted from its checkpoint.
        self.failure: str | None = None
        self.spec_hash = ckpt.spec_hash(spec.to_json())
        # Created on the serving loop (start()).
        self.lock: asyncio.Lock | None = None
        self._poke: asyncio.Event | None = None
        startup.resume_or_init(self)  # ConfigError: every checkpoint on disk is corrupt
        if self.resumed_from:
            self.gate.recalibrate(self.model.fragment_norms())

    # ----- start-up and shutdown ---------------------------------------------------------------

    async def start(self) -> None:
        """Create the loop-bound primitives and the pull bodies (call on the serving loop)."""
        self.lock = asyncio.Lock()
        self._poke = asyncio.Event()
        self.jobs.queue.start()
        await self.publisher.start(self._body_keys())
        # Every island of the job (all regions) holds the quorum until it joins or times out.
        self.state.expect(self.spec.total_shards(), self.clock())

    def close_waiters(self) -> None:
        """Answer every long-poll now (304): the server is shutting down."""
        self.publisher.close_waiters()

    async def stop(
        self, timeout: float = 30.0, scheduler: asyncio.Task[None] | None = None
    ) -> None:
        """Stop the scheduler once a running merge has finished, let scheduled jobs finish,
        write a checkpoint of what was merged since the last one, stop the worker."""
        if scheduler is not None:
            if self.lock is not None:
                async with self.lock:  # a merge holds the lock from start to publish
                    scheduler.cancel()
            else:
                scheduler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await scheduler
        await self.jobs.stop(
            timeout,
            final=None if self.failure else (self.state.versions, self._checkpoint_snapshot),
        )

    # ----- derived figures ---------------------------------------------------------------------

    @property
    def fragments(self) -> list[list[str]]:
        return self.model.fragments

    @property
    def outer_step(self) -> int:
        return self.state.outer_step

    @property
    def tokens(self) -> int:
        """Tokens merged into the global model (each fragment's merges, averaged over fragments)."""
        return self.merge_log.tokens

    def digest(self) -> str:
        """sha256 of the global weights and the outer momentum (and θ_pub when kept apart)."""
        return self.model.digest()

    def stop_reached(self) -> bool:
        stop = self.spec.stop_after
        if stop.outer_steps is not None and self.state.outer_step >= stop.outer_steps:
            return True
        return stop.tokens is not None and self.tokens >= stop.tokens

    def _body_keys(self) -> list[BodyKey]:
        """What each fragment's pull body says now: (version, outer step, finished)."""
        return [(v, self.state.outer_step, self.finished) for v in self.state.versions]

    def _update_gauges(self) -> None:
        self.metrics.active_islands.set(len(self.state.active_islands()))
        self.metrics.outer_step.set(self.state.outer_step)
        self.metrics.tokens.set(self.tokens)

    # ----- requests ----------------------------------------------------------------------------

    def check_fragment(self, fragment: int) -> None:
        """Refused(404) unless the fragment exists."""
        if not 0 <= fragment < len(self.model.fragments):
            raise Refused(
                404, f"fragment {fragment} does not exist (0..{len(self.model.fragments) - 1})"
            )

    def push_limit(self, fragment: int) -> int:
        """The largest push body `fragment` accepts; Refused(404) when it does not exist."""
        self.check_fragment(fragment)
        return self.model.body_limits[fragment]

    def _wake(self) -> None:
        if self._poke is not None:
            self._poke.set()

    def _locked(self) -> asyncio.Lock:
        assert self.lock is not None, "Syncer.start() was not called"
        if self.failure:
            raise Refused(503, f"the syncer failed and must be restarted: {self.failure}")
        return self.lock

    async def join(self, island: str, replicas: int) -> dict[str, Any]:
        """Register an island; returns the fragment layout and current versions."""
        async with self._locked():
            self.gate.admit(self.state, island, self.clock())
            rec = self.state.join(island, replicas, self.clock())
            self._update_gauges()
        self._wake()
        log.info(
            "island %s joined (join %d, %d replicas, %s)", island, rec.joins, replicas, rec.state
        )
        return {
            "fragments": self.model.fragments,
            "versions": self.state.versions,
            "outerStep": self.state.outer_step,
            "finished": self.finished,
            "codec": self.codec,
            "pullCompression": self.model.pull_compression,
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
            if island not in self.state.islands:
                self.gate.admit(self.state, island, self.clock())
            rec = self.state.set_admin_state(island, state, reason, self.clock())
            self._update_gauges()
        self._wake()
        log.info("island %s set %s by admin (%s)", island, state, reason or "no reason given")
        return {"island": island, "state": rec.state, "reason": rec.reason}

    async def push(self, fragment: int, body: bytes) -> dict[str, Any]:
        """Validate and record a pushed pseudo-gradient; Refused (state unchanged) on a problem.
        A refusal of its content (400 from decoding, 422 from the guards) counts towards the
        island's refusals in a row."""
        self.check_fragment(fragment)
        flat, meta = read_push(body, self.codec)
        try:
            return await self._push(fragment, flat, meta, len(body))
        except Refused as err:
            if err.status in (400, 422):
                await self._refused(fragment, meta.island, err)
            raise

    async def _push(
        self, fragment: int, flat: dict[str, Any], meta: protocol.PushMeta, size: int
    ) -> dict[str, Any]:
        async with self._locked():
            early = self._finished_or_duplicate(fragment, meta)
            if early is not None:
                return early
            self.state.check_push(fragment, meta.island, meta.base_version)
            self.gate.check_work(self.state, meta.island, tokens=meta.tokens, steps=meta.steps)
        decoded, stats = await asyncio.to_thread(
            decode_measured, fragment, flat, self.codec, self.model.expected[fragment]
        )
        async with self._locked():
            early = self._finished_or_duplicate(fragment, meta)
            if early is not None:
                return early
            now = self.clock()
            # Checked again: a merge or a drop may have happened while decoding.
            lag = self.state.check_push(fragment, meta.island, meta.base_version)
            self.gate.check_delta(fragment, stats)
            contribution = push_contribution(meta, lag=lag, payload=decoded, now=now)
            answer = self.state.accept_push(fragment, contribution, now)
            self.gate.accepted(fragment, meta.island, stats)
            self.bytes_in += size
            self.metrics.bytes_in.inc(size)
            self._update_gauges()
        self._wake()
        return answer

    async def _refused(self, fragment: int, island: str, err: Refused) -> None:
        async with self._locked():
            dropped = self.gate.refused(self.state, fragment, island, err, self.clock())
            if dropped:
                self._update_gauges()
        if dropped:
            self._wake()

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
        The body is the chain of updates since version `have` when the publisher has one."""
        self.check_fragment(fragment)
        return await self.publisher.pull(fragment, after=after, wait=wait, have=have)

    async def status(self, *, digest: bool = False) -> dict[str, Any]:
        """The status document (see api/protocol.py for the route).

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
        return status_document(self)

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
                    "%d island(s) of %d never joined within islands.startupTimeoutSeconds "
                    "(%.0fs) of the syncer's start, and nobody dropped them: merging without them",
                    awaited,
                    self.spec.total_shards(),
                    self.spec.islands.startup_timeout_seconds,
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
                self.metrics.healthy.set(0)
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
        prepared = await self.gate.prepare(self.model, self.state, f, contributions, now)
        if prepared is None:
            return
        result = await asyncio.to_thread(
            self.model.commit_merge, f, prepared, new_version=self.state.versions[f] + 1
        )
        self.publisher.record_update(f, result.update)
        seconds = time.perf_counter() - started
        taken = self.state.take_round(
            f, now, rounds=result.rounds, clock=result.clock, merge_seconds=seconds
        )
        assert len(taken) == len(contributions) and all(
            a is b for a, b in zip(taken, contributions, strict=True)
        ), "a round changed while its merge ran (lock not held?)"
        entry = self.merge_log.record(
            f,
            contributions,
            result,
            version=self.state.versions[f],
            outer_step=self.state.outer_step,
            time=now,
            quorum=quorum,
            grace=grace,
            rule=self.spec.sync.merge,
            seconds=seconds,
        )
        await asyncio.to_thread(self.merge_log.write, entry)
        self.metrics.merges.inc()
        self.metrics.merge_seconds.observe(seconds)
        self.health.clear(MERGE)
        self._update_gauges()
        evaluated = await self._after_merge()
        eval_note = f"; eval loss {evaluated:.4f}" if evaluated is not None else ""
        log.info("%s%s", describe_merge(entry), eval_note)

    async def _after_merge(self) -> float | None:
        """Publish, evaluate, checkpoint and finish as due (lock held); returns an eval loss when
        one was computed here (the finish), else None.

        Normally the merged fragments are published first and the evaluation and checkpoint run
        in the background on snapshots, so learners and the next merge never wait for them. At
        the finish, evaluation and checkpoint complete before finished=true is published.
        """
        step = self.state.outer_step
        if not self.stop_reached():
            await self.publisher.publish(self._body_keys())
            self.jobs.after_merge(step, self.tokens, self._checkpoint_snapshot)
            return None
        loss = await self.jobs.finish(step, self.tokens, self._checkpoint_snapshot)
        self.finished = True
        await self.publisher.publish(self._body_keys())
        log.info("finished at outer step %d with %d tokens", step, self.tokens)
        return loss

    def _checkpoint_snapshot(self) -> CheckpointSnapshot:
        """Everything a checkpoint of the current state needs, copied (lock held)."""
        return CheckpointSnapshot(
            outer_step=self.state.outer_step,
            tensors=self.model.tensor_snapshot(),
            manifest=checkpoint_manifest(self),
        )


def main(args: argparse.Namespace) -> int:
    """`diloco syncer`: serve the job in $DILOCO_CONFIG_FILE until SIGTERM (exit 0), or exit 1
    after a failed merge, or 2 for a bad environment or config (see server.py)."""
    return server.run(Syncer)
