"""The syncer: a CPU service that merges islands' pseudo-gradients into the global model.

One job's `Syncer` holds the parts start-up built (startup.py): the state (state/: records,
membership, rounds, clocks), the gate on what enters (intake/), the global model and the merge
(merging/), what learners pull (serving/), the checkpoints (storage/) and the background
evaluations and checkpoints (jobs.py). The HTTP edge (edge/http.py) calls it; it runs the two
sequences that cross the parts: a push (push.py: read, admit, measure, judge, record, fold) and
a merge (`_merge`: take, prepare, commit, encode, record, serve), ARCHITECTURE.md's "The path of
a push" in twelve calls. The island calls (join, heartbeat, leave, the admin's membership
change) are island_calls.py's, on `Syncer.islands`.

Concurrency (control.py): HTTP handlers run on one asyncio loop; heavy work (decoding a push,
merging, the outer step, evaluation, serialising fragments, checkpoints, digests) runs in worker
threads. Three kinds of lock: one asyncio lock (`Control.locked()`) makes every state change
atomic and is held only for short, P-free steps; one lock per fragment (`fragment_lock`) keeps a
fragment's fold and its merge apart (a push folds holding its own fragment's lock, a merge holds
its fragment's from taking the round to publishing it, so a push never waits on another
fragment's merge, and heartbeats, joins and status never wait on one); and `merging`, which the
scheduler holds for each merge, so merges run one at a time and a stop or a digest waits for the
running one, and the whole-model steps after a merge (evaluation and checkpoint of the live
weights, publishing the other fragments' outer step) see no merge half-applied. A request that
fails validation changes nothing: size, safetensors, metadata, membership/staleness and tensor
names/shapes/dtypes are all checked before the state is touched.

Hostile and broken input (README's Security section; intake/gate.py, merging/merger.py): only the
job's own island names join, a push passes the guards (finite, norm bounds, steps and tokens of
one round) before it joins a round, and a merge whose input cannot be merged leaves out the
contributions at fault.

When stopAfter is reached (or all but the drain's rounding, every island drained:
state/targets.py), the syncer evaluates, writes a checkpoint, and only then reports
finished=true; it keeps serving status and pulls afterwards. A stop (SIGTERM) lets a running
merge finish and writes a checkpoint of what was merged since the last one. A merge that raises
while applying the outer step (a bug: its input was checked) leaves the round half applied, so
the syncer then refuses work with 503 and reports unhealthy on /healthz until it is restarted
from its last checkpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from diloco_trainer.api import credentials
from diloco_trainer.api.contract import ContractError
from diloco_trainer.api.credentials import Principal
from diloco_trainer.api.documents import FragmentMerges, SyncerStatus
from diloco_trainer.api.protocol import ERROR_RESTARTED
from diloco_trainer.api.sharding import ERROR_WRONG_SHARD, WRONG_SHARD_STATUS
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.cpus import configure_threads
from diloco_trainer.syncer.edge import server
from diloco_trainer.syncer.errors import Refused
from diloco_trainer.syncer.intake import fragment_body_limit, step_time_limit
from diloco_trainer.syncer.merging import LeftOut, describe_merge, return_freed_memory, trim
from diloco_trainer.syncer.service import startup
from diloco_trainer.syncer.service.control import Control
from diloco_trainer.syncer.service.island_calls import IslandCalls
from diloco_trainer.syncer.service.jobs import CheckpointSnapshot
from diloco_trainer.syncer.service.push import PushPath
from diloco_trainer.syncer.service.status_document import (
    Identity,
    RunState,
    checkpoint_manifest,
    finite_only,
    status_document,
)
from diloco_trainer.syncer.serving import Body, BodyKey
from diloco_trainer.syncer.state import (
    EVAL_LOSS_ROSE,
    FAINT_ENDED,
    Trip,
    drained_at_budget,
    lost_with_restart,
    stop_reached,
)

__all__ = ["Syncer", "main"]

log = logging.getLogger("diloco.syncer")

# The merge scheduler re-checks timeouts at least this often.
TICK_SECONDS = 0.5
# Who an in-process caller (a test, a tool) pushes as: the job's root credential.
ROOT = Principal(credentials.ROOT)


class Syncer:
    """One job's syncer: the parts start-up built (startup.SyncerParts: the global model, rounds
    and membership, the merge, the publisher, the merge log and the background jobs), behind one
    asyncio lock."""

    def __init__(
        self,
        spec: JobSpec,
        *,
        job_name: str,
        state_dir: Path,
        clock: Callable[[], float] = time.time,
        config_file: Path | None = None,
        shard: int = 0,  # which of syncer.shards (shard_scope.py)
    ) -> None:
        """Build the parts (startup.build: ConfigError when every checkpoint on disk is corrupt)
        and take them over."""
        return_freed_memory()  # before the first P-sized buffer (memory.py)
        built = startup.build(
            spec, state_dir=state_dir, clock=clock, config_file=config_file, shard=shard
        )
        self.spec = spec
        self.job_name = job_name
        self.state_dir = state_dir
        self.clock = clock
        self.codec: str = spec.sync.compression  # the routes read it as a plain str
        self.metrics = built.metrics
        self.health = built.health
        self.parts = built.parts  # the model, data and evaluation (models/parts.py)
        self.model = built.model
        self.publisher = built.publisher
        self.state = built.state
        self.merge_log = built.merge_log
        self.merger = built.merger
        self.jobs = built.jobs
        self.gate = built.gate
        self.spec_hash = built.spec_hash
        self.resumed_from = built.resumed_from
        # This run of the syncer: named in every push answer, so a learner waiting for the merge
        # of its push can tell a restarted syncer (which lost it) from the one that took it.
        self.run = secrets.token_hex(8)
        # Each fragment's version when this run started (lost_with_restart).
        self.resumed_versions = list(self.state.versions)
        # The largest push body each fragment accepts (validation.fragment_body_limit).
        self.body_limits = [fragment_body_limit(e, self.codec) for e in self.model.expected]
        self.control = Control(len(self.model.fragments), clock, finished=built.finished)
        self.pushes = PushPath(
            self.control,
            state=self.state,
            gate=self.gate,
            model=self.model,
            codec=self.codec,
            metrics=self.metrics,
        )
        self.pushes.max_step_time = step_time_limit(spec.sync.heartbeat_timeout_seconds)
        self.islands = IslandCalls(
            self.control,
            state=self.state,
            gate=self.gate,
            model=self.model,
            codec=self.codec,
            spec=spec,
            run=self.run,
            resumed=self.resumed_versions,
        )
        self.pushes.stop_target = self.islands.stop_target
        # Read when /metrics is scraped: always the current figures, and no sequence has to
        # remember to update them.
        self.metrics.active_islands.set_function(lambda: len(self.state.membership.active()))
        self.metrics.outer_step.set_function(lambda: self.state.outer_step)
        self.metrics.tokens.set_function(lambda: self.tokens)
        self.identity = Identity(
            job_name=job_name,
            codec=self.codec,
            pull_compression=self.model.pull_compression,
            fragments=len(self.model.fragments),
            spec_hash=self.spec_hash,
        )

    # ----- start-up and shutdown ---------------------------------------------------------------

    async def start(self) -> None:
        """Create the loop-bound primitives and the pull bodies (call on the serving loop)."""
        self.control.start()
        await self.publisher.start(self._body_keys())
        # Every island of the job (all regions) holds the quorum until it joins or times out.
        self.state.membership.expect(self.spec.total_shards(), self.clock())

    def close_waiters(self) -> None:
        """Answer every long-poll now (304): the server is shutting down."""
        self.publisher.close_waiters()

    async def stop(
        self, timeout: float = 30.0, scheduler: asyncio.Task[None] | None = None
    ) -> None:
        """Stop the scheduler once a running merge has finished, let scheduled jobs finish,
        write a checkpoint of what was merged since the last one, stop the worker."""
        self.control.stopping = True  # the scheduler ends at its next pass, cancel lost or not
        if scheduler is not None:
            if self.merging is not None:
                async with self.merging:  # a merge holds it from its start to its publish
                    scheduler.cancel()
            else:
                scheduler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await scheduler
        await self.jobs.stop(
            timeout,
            final=None if self.failure else (self.state.versions, self._checkpoint_snapshot),
        )
        # The update history's file work in flight (spills, deletions) ends before the process:
        # a spill cut off would leave a partial file in the state dir until the next start.
        await self.publisher.housekeeping_done()
        # Merge-log lines kept in memory while the log was unwritable are written now if it can
        # be again, else counted as lost on the log (the checkpoints hold the state either way).
        await asyncio.to_thread(self.merge_log.close)

    # ----- derived figures ---------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.control.finished

    @property
    def failure(self) -> str | None:
        """Why a merge failed half-way (the syncer then refuses work until restarted)."""
        return self.control.failure

    @property
    def merging(self) -> asyncio.Lock | None:
        return self.control.merging

    @property
    def fragments(self) -> list[list[str]]:
        return self.model.fragments

    @property
    def outer_step(self) -> int:
        return self.state.outer_step

    @property
    def bytes_in(self) -> int:
        """Bytes of accepted push bodies."""
        return self.pushes.bytes_in

    @property
    def tokens(self) -> int:
        """Tokens merged into the global model (each fragment's merges, averaged over fragments)."""
        return self.merge_log.tokens

    def digest(self) -> str:
        """sha256 of the global weights and the outer momentum (and θ_pub when kept apart)."""
        return self.model.digest()

    def stop_reached(self) -> bool:
        """Whether the job ends now: stopAfter is reached, or but for the drain's rounding with
        every active island drained (learner/drain.py, targets.drained_at_budget).

        At K = M with every island on its 1/M share (no split: rounds of H) the budget in
        tokens ends the job only once every active island has drained: the shares count
        positions, and fill steps at H (learner/step_plan.fills_drift) put tokens on top of
        them, which reached the budget a merge before the drains' last ones and left the
        islands' work since their last merged push unmerged (busy_link: 2.4-2.7% of it)."""
        if stop_reached(self.spec, outer_step=self.state.outer_step, tokens=self.tokens):
            stop = self.spec.stop_after
            by_steps = stop.outer_steps is not None and self.state.outer_step >= stop.outer_steps
            return by_steps or not self.shares_kept() or self.state.all_drained()
        # An island the budget was not split to (no pace, or joined since) holds no finish: it
        # has no target to drain at (SyncState.untargeted, issue 46), nor its step of slack.
        exempt = self.state.untargeted()
        active = [r for r in self.state.membership.active_records() if r.name not in exempt]
        # outerSteps in tokens only for one syncer: a syncer shard that restarted from an older
        # checkpoint counts its own fragments' merges again while the islands' tokens stand, so
        # the tokens said drained before its outer steps were made up (CI rehearsal of fdcda5e:
        # tests/e2e/test_shards.py's restarted shard finished at outer step 8 of 10).
        one_syncer = self.spec.syncer.shards <= 1
        return self.state.all_drained() and drained_at_budget(
            self.spec, self.tokens, active, shares_kept=self.shares_kept() and one_syncer
        )

    def shares_kept(self) -> bool:
        """Whether the islands drain on their own 1/M shares of stopAfter (K = M, every round
        H: learner/drain.share_steps), not on stop targets (K < M, or rounds that differ)."""
        islands = max(self.spec.islands.count, self.spec.total_shards())
        return self.spec.sync.quorum >= islands and not self.gate.rounds.split

    def _body_keys(self) -> list[BodyKey]:
        """What each fragment's pull body says now: (version, outer step, finished)."""
        return [(v, self.state.outer_step, self.finished) for v in self.state.versions]

    # ----- requests ----------------------------------------------------------------------------

    def check_fragment(self, fragment: int) -> None:
        """Refused(404) unless the fragment exists, 421 when another syncer shard owns it."""
        n = len(self.model.fragments)
        if not 0 <= fragment < n:
            raise Refused(404, f"fragment {fragment} does not exist (0..{n - 1})")
        if not self.model.owns(fragment):  # the HTTP edge refuses it first (shard_scope.py)
            raise Refused(
                WRONG_SHARD_STATUS,
                f"fragment {fragment} is another syncer shard's",
                ERROR_WRONG_SHARD,
            )

    def push_limit(self, fragment: int) -> int:
        """The largest push body `fragment` accepts; Refused(404) when it does not exist."""
        self.check_fragment(fragment)
        return self.body_limits[fragment]

    def region_islands(self, prefix: str) -> tuple[int, int]:
        """For a region credential's push slots (edge/limits.push_share): the island records
        region `prefix` holds, and the syncer's own islands whose slots it must leave (0 when
        `prefix` is the syncer's own)."""
        admission = self.gate.admission
        local = 0 if prefix == admission.prefix else admission.count
        held = admission.held_by(self.state.membership.islands, prefix)
        quota = None if prefix == admission.prefix else admission.quota(prefix)
        # islands.regions: never more than its count's slots, even with records left over from
        # an older spec that gave it more.
        return (held if quota is None else min(held, quota)), local

    async def receive_push(
        self, fragment: int, body: bytes | bytearray, principal: Principal = ROOT
    ) -> dict[str, Any]:
        """A pushed pseudo-gradient, from its body to its round (push.py: the whole path);
        Refused, with nothing changed, on a problem. Returns the PushAnswer."""
        self.check_fragment(fragment)
        answer = await self.pushes.receive(fragment, body, principal)
        # This run's name on every answer, a replayed one too: a push answered again after a
        # restart (merged before it: saved answers) is waited for from this run.
        return answer.model_copy(update={"run": self.run}).to_wire()

    def upload_started(self, fragment: int, island: str) -> float | None:
        """An island's push body for `fragment` began to arrive (edge/http.py: its own verified
        credential named the island, its declared size is within the limit): a merge of that
        fragment at quorum waits for it a while (state/uploads.py). Returns the start to hand
        to upload_ended, or None when nothing was recorded (no such fragment here, or an island
        the rounds do not span). Synchronous: nothing awaited, so nothing interleaves."""
        if self.finished or self.control.failure:
            return None
        if not 0 <= fragment < len(self.model.fragments) or not self.model.owns(fragment):
            return None
        now = self.clock()
        return now if self.state.upload_started(fragment, island, now) else None

    def upload_ended(
        self, fragment: int, island: str, started: float, *, seconds: float | None
    ) -> None:
        """The request upload_started recorded ended; `seconds`: how long its body took to
        arrive, when the push was accepted (else None). Wakes the scheduler: a merge it held
        may be due now."""
        self.state.upload_ended(fragment, island, started, seconds=seconds)
        self.control.wake()

    async def pull(
        self, fragment: int, *, after: int, wait: float, have: int = -1, run: str = ""
    ) -> Body | None:
        """Fragment bytes once its version is > after (or the job finished); None after `wait`.
        The body is the chain of updates since version `have` when the publisher has one.

        `run`: the syncer run that accepted the push whose merge the caller waits for (its
        PushAnswer.run). From another run (this syncer restarted since) when this run resumed at
        or before `after`, no merge of this run carries the push: pending pushes are not
        checkpointed (a merge of other islands' pushes past `after` is not its merge). Refused
        409 `restarted` at once, so the learner pushes it again into this run's open round now,
        not after a wait budget and a round late (docs/algorithm.md, "A syncer restart")."""
        self.check_fragment(fragment)
        resumed = self.resumed_versions[fragment]
        if lost_with_restart(run, self.run, after=after, resumed=resumed):
            raise Refused(
                409,
                f"fragment {fragment}'s push accepted by syncer run {run} was lost when the "
                f"syncer restarted (this is run {self.run}, resumed at version {resumed}, now "
                f"at {self.state.versions[fragment]}); push it again",
                ERROR_RESTARTED,
            )
        return await self.publisher.pull(fragment, after=after, wait=wait, have=have)

    async def status(self, *, digest: bool = False) -> dict[str, Any]:
        """The status document (SyncerStatus; see api/protocol.py for the route).

        Without the digest it is read without waiting for a running merge; that is consistent
        because a merge changes versions, rounds and token counts together after its arithmetic
        (see merge.py). With the digest it waits for a running merge, so the weights match the
        versions.
        """
        if not digest:
            return finite_only(self._status().to_wire())
        self.control.locked()  # Refused(503) once failed
        assert self.merging is not None
        async with self.merging:
            doc = self._status()
            weights = await asyncio.to_thread(self.digest)
        return finite_only(doc.model_copy(update={"digest": weights}).to_wire())

    def fragment_merges(self, fragment: int, from_version: int = 0) -> dict[str, Any]:
        """GET /v1/fragments/{f}/merges (FragmentMerges; see api/protocol.py for the route): what
        phase alignment reads after a push, without the rest of the status document."""
        self.check_fragment(fragment)
        islands = self.state.membership.islands
        doc = FragmentMerges(
            fragment=fragment,
            time=self.clock(),
            step_times={n: r.step_time for n, r in sorted(islands.items()) if r.step_time},
            merges=self.merge_log.merges_of(fragment, from_version),
        )
        return finite_only(doc.to_wire())

    def _status(self) -> SyncerStatus:
        progress = RunState(
            finished=self.finished,
            failure=self.failure,
            bytes_in=self.bytes_in,
            resumed_from=self.resumed_from,
            run=self.run,
        )
        return status_document(
            self.identity,
            progress,
            rounds=self.state.snapshot(),
            merges=self.merge_log.snapshot(),
            pulls=self.publisher.snapshot(),
            jobs=self.jobs.snapshot(),
            refusals=self.gate.refusals_json(),
            health=self.health.to_json(),
            time=self.clock(),
        )

    # ----- merging -----------------------------------------------------------------------------

    async def tick(self) -> float | None:
        """One scheduler pass: expire silent islands, merge every due round (one at a time, the
        lock not held). Returns the next grace deadline (clock time), if a round is waiting."""
        async with self.control.locked():
            now = self.clock()
            members = self.state.membership
            awaited = members.awaited()
            expired = members.expire(now)
            if awaited and not members.awaited():
                log.warning(
                    "%d island(s) of %d never joined within islands.startupTimeoutSeconds "
                    "(%.0fs) of the syncer's start, and nobody dropped them: merging without them",
                    awaited,
                    self.spec.total_shards(),
                    self.spec.islands.startup_timeout_seconds,
                )
            for island in expired:
                log.warning("island %s timed out: %s", island, members.islands[island].reason)
            faint = self._faint_end()
            due = [] if self.finished or faint else self.state.due_fragments(now)
            # Every island drained, nothing to merge (a heartbeat said so, or a drop): finish.
            drained = not (self.finished or due or faint) and self.stop_reached()
        assert self.merging is not None
        if faint is not None:
            async with self.merging:
                if not self.finished:
                    await self._end_faint(faint)
            return None
        for f in due:
            async with self.merging:
                await self._merge(f)
            if self.finished:
                break
        if drained:
            async with self.merging:
                if not self.finished:
                    await self._finish()
        return None if self.finished else self.state.next_deadline(self.clock())

    async def run_scheduler(self) -> None:
        """tick() whenever something changed, a grace window ends, or TICK_SECONDS passed.

        An exception in a merge marks the syncer failed (see `failure`) and ends the scheduler.
        """
        poke = self.control.poke
        assert poke is not None
        while not self.control.stopping:
            try:
                deadline = await self.tick()
            except Exception as err:
                self.control.failure = f"merge failed: {type(err).__name__}: {err}"
                self.metrics.healthy.set(0)
                log.exception("%s; refusing work until restarted from the last checkpoint", err)
                return
            wait = TICK_SECONDS
            if deadline is not None:
                wait = min(wait, max(0.005, deadline - self.clock()))
            # Not wait_for: 3.11's can swallow a cancel that comes as its timeout fires.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await poke.wait()
            poke.clear()

    def _log_crossed(self, f: int, now: float) -> None:
        """Say so when fragment f's round merges because it is crossed (state/crossed.py):
        without a quorum, so without islands that pushed to another crossed round first."""
        crossed = self.state.crossed_round(now)
        if crossed is None or crossed[0] != f or self.state.rounds[f].quorum_since is not None:
            return
        lacking = sorted(self.state.spanning() - set(self.state.rounds[f].pending))
        log.warning(
            "fragment %d's round merges without %s: crossed with another fragment's round, "
            "each waiting for islands whose pushes wait in the other (K = M, or held at the "
            "step cap)",
            f,
            lacking,
        )

    async def _merge(self, f: int) -> None:
        """Merge fragment f's round, steps 7-12 of a push's path (ARCHITECTURE.md, "The path of
        a push"; merging/merger.py's steps), holding f's lock throughout and the service's lock
        for the steps that change state; then log, evaluate and checkpoint as due. mergeSeconds
        runs from the round's take to its new version being pullable (12)."""
        async with self.control.fragment_lock(f):
            async with self.control.locked():
                now = self.clock()
                if self.finished or not self.state.merge_due(f, now):
                    return  # the round changed since the scheduler looked (a drop)
                started = time.perf_counter()
                merge = self.merger.take(self.state, f, now)  # 7.
                self._log_crossed(f, now)
            new_version = self.state.versions[f] + 1  # only this merge moves f's version
            # The other fragments' rounds, for the new body's outer step: no other merge runs
            # meanwhile (the merging lock), so they are read here, on the loop.
            others = [r.rounds for g, r in enumerate(self.state.rounds) if g != f]
            worked = await asyncio.to_thread(
                self._merge_work, merge, new_version, others, started
            )  # 8.-10.
            if isinstance(worked, LeftOut):
                async with self.control.locked():
                    self.merger.recover(self.state, merge, worked)
                return
            result, body = worked
            async with self.control.locked():
                seconds = time.perf_counter() - started
                entry = self.merger.record(self.state, merge, result, seconds)  # 11.
                # Not at the finish: _after_merge publishes it once, finished (else pulled twice).
                fits = body[0] == self._body_keys()[f] and not self.stop_reached()
                self.publisher.merged(f, result.update, body if fits else None)  # 12.
            del body
        await asyncio.to_thread(self.merge_log.write, entry)
        # The merge's small temporaries back to the system once it is pullable (merging/heap.py).
        await asyncio.to_thread(trim)
        self.merger.logged(seconds)
        log.info("%s", describe_merge(entry))
        await self._after_merge()

    def _merge_work(
        self, merge: Any, new_version: int, others: list[int], started: float
    ) -> LeftOut | tuple[Any, Any]:
        """Steps 8-10 of a merge of fragment `merge`'s round, in one worker thread: prepare
        (LeftOut: an offender left out, nothing committed), commit, and f's new pull body,
        built before the round closes so that it is pullable the moment the version moves (its
        key is checked again then: publish re-encodes it if the outer step came out otherwise).

        One thread, not one per step (issue 45): at K = M every island waits through the merge,
        and on two loaded cores each hop from the loop to a worker thread and back cost a few
        ms of it."""
        prepared = self.merger.prepare(merge)  # 8.
        if isinstance(prepared, LeftOut):
            return prepared
        f = merge.fragment
        result = self.model.commit_merge(f, prepared, new_version=new_version)  # 9.
        del prepared  # the merged pseudo-gradient (1/F x) goes before the new body comes
        outer_step = min([result.rounds, *others])
        body = self.publisher.encode(  # 10.
            f, (new_version, outer_step, self.finished), time.perf_counter() - started
        )
        return result, body

    async def _after_merge(self) -> None:
        """Publish, evaluate, checkpoint and finish as due (merge lock held). Every evaluation
        logs its own line (jobs.py), the final one once, whether a merge or a drain ends the job.

        Normally the merged fragments are published first, then the evaluation and checkpoint
        read the live weights (jobs.py): learners never wait for them, the next merge does. At
        the finish, evaluation and checkpoint complete before finished=true is published.
        """
        step = self.state.outer_step
        if not self.stop_reached():
            await self.publisher.publish(self._body_keys())
            trip = await self.jobs.after_merge(step, self.tokens, self._checkpoint_snapshot)
            if trip is not None:
                await self._end_degraded(trip)
            return
        await self._finish()

    def _faint_end(self) -> str | None:
        """Why a job of two ends now for an island's faint claims (gate.Gate.faint_end), or
        None: only with syncer.guards.endOnFaint (off by default: an honest island of unequal
        speed far down its cosine is named too), the quality guard on and a best checkpoint it
        kept to end at (a job with none, evaluations off or rare, keeps the naming only: ending
        it would throw away the honest island's work up to now)."""
        if self.finished or not self.spec.syncer.guards.end_on_faint:
            return None
        if not self.spec.syncer.quality_guard.enabled or self.jobs.kept is None:
            return None
        return self.gate.faint_end()

    async def _end_faint(self, message: str) -> None:
        """A job of two ends for an island's faint claims (merge lock held): no more merges,
        finished=true (learners stop), its final checkpoint the best-evaluated one, as the
        quality guard's trip (jobs.end_faint), and the health problem FAINT_ENDED, which never
        clears (issue 46: one bad island of two cannot be bounded, only stopped)."""
        self.health.report(FAINT_ENDED, message)
        await self.jobs.end_faint(message)
        self.control.finished = True
        await self.publisher.publish(self._body_keys())
        best = self.jobs.snapshot().checkpoint
        log.error(
            "work evidence: %s; final checkpoint %s",
            message,
            best.path if best is not None else "none (the initial weights were the best)",
        )

    async def _end_degraded(self, trip: Trip) -> None:
        """The quality guard tripped (jobs.py, state/quality.py): stop merging and end the job
        (finished=true, so learners stop) with the best-evaluated checkpoint as its final one
        (the status's `checkpoint`, which the operator names as the job's finalCheckpoint), and
        the health problem evalLossRose, which never clears (merge lock held)."""
        message = self.jobs.trip_message(trip)
        self.health.report(EVAL_LOSS_ROSE, message)
        await self.jobs.end_tripped(message)
        self.control.finished = True
        await self.publisher.publish(self._body_keys())
        best = self.jobs.snapshot().checkpoint
        log.error(
            "quality guard: %s; final checkpoint %s",
            message,
            best.path if best is not None else "none (the initial weights were the best)",
        )

    async def _finish(self) -> None:
        """Evaluate and checkpoint the final state, then publish finished=true (merge lock
        held)."""
        step = self.state.outer_step
        await self.jobs.finish(step, self.tokens, self._checkpoint_snapshot)
        self.control.finished = True
        await self.publisher.publish(self._body_keys())
        short = not stop_reached(self.spec, outer_step=step, tokens=self.tokens)
        why = " (every island drained, the budget less its rounding to steps)" if short else ""
        log.info("finished at outer step %d with %d tokens%s", step, self.tokens, why)

    async def _checkpoint_snapshot(self) -> CheckpointSnapshot:
        """Everything a checkpoint of the current state needs (merge lock held, or at a stop no
        merge left to run): the manifest, and the live tensors, which no merge moves until the
        checkpoint is written (jobs.py)."""
        manifest = checkpoint_manifest(
            self.identity,
            rounds=self.state.saved(),
            fragments=self.model.fragments,
            outer_progress=self.model.outer.progress_json(),
            merge_counters=self.merge_log.manifest(),
            initial_eval_loss=self.jobs.snapshot().initial_eval_loss,
            norm_history=self.gate.norm_history(),
            guards=self.gate.saved_guards(),
            time=self.clock(),
        )
        outer_step = self.state.outer_step
        tensors = self.model.live_tensors()
        return CheckpointSnapshot(outer_step=outer_step, tensors=tensors, manifest=manifest)


def main(args: argparse.Namespace) -> int:
    """`diloco syncer`: serve the job in $DILOCO_CONFIG_FILE until SIGTERM (exit 0), or exit 1
    after a failed merge, or 2 for a bad environment or config (see server.py). Its torch
    threads follow the pod's CPU limit (cpus.py), as a learner's do."""
    try:
        configure_threads()
    except ContractError as err:
        print(f"diloco syncer: {err}", file=sys.stderr)
        return 2
    return server.run(Syncer)
