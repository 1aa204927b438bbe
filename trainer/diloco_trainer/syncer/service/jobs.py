"""The syncer's evaluations and checkpoints, of the live weights, in order.

They read θ_exact, the outer momentum and θ_pub where they are (no copy of P: a snapshot cost
one to three copies of the model at a time) while the service keeps them still: it runs them
after a merge with its merge lock held, so the next merge waits for them; pushes, pulls, probes
and heartbeats do not. The work runs in worker threads, and a checkpoint's files are written
and hashed a piece at a time (checkpoint.write_tensors). A failed job is logged and skipped: a
full disk must not stop training. A failed checkpoint write is a health problem (health.py, the
status document, a metric) until the next one succeeds.

Evaluation runs at start, every syncer.evalEveryOuterSteps outer steps and at the finish (its
evalHistory entry appears shortly after the merge it follows), the finish's also when its outer
step was evaluated already but merges since then moved the weights (partial rounds at K < M,
the drain's last pushes: the same outer step twice, with more tokens); checkpoints every
syncer.checkpoint.everyOuterSteps outer steps, at the finish and when the syncer stops (SIGTERM)
with merges since the last one. evalHistory keeps the first evaluation and the last
EVAL_HISTORY - 1.

The quality guard (syncer.qualityGuard, state/quality.py) reads these evaluations: while it is on,
an evaluation with the lowest loss so far writes a checkpoint of those weights at once (the
*best kept*), unless the best kept is under syncer.checkpoint.everyOuterSteps outer steps old
and its loss within (1 + margin) x this one (state/quality.best_due: at most one extra
checkpoint per interval, plus one each time the loss falls by more than the factor (1 + margin),
fewer than log(L_first / L_min) / log(1 + margin) a job); the pruning of syncer.checkpoint.keep
neither counts nor deletes the best, so the disk holds at most keep + 1 checkpoints; and after
`patience` evaluations in a row above (1 + margin) x the best evaluation, `after_merge` returns
the Trip and the service ends the job with the best kept as its final checkpoint (at most
(1 + margin) x the best evaluation, so below every rise; the trip's message names its outer
step and loss), the ones after it set aside (`rose-ckpt-*`: the newest on disk is the best).
Memory: the best is on disk
only, never another copy of the model in memory (the checkpoint is written from the live
tensors, as every checkpoint is). The guard's end of the job (a trip, or a finish whose final
evaluation rose) is written to the state dir before the checkpoints are set aside
(storage/guard_end.py), so a restarted syncer stays finished with the same final checkpoint and
problem (`restore_end`, called by startup.py). Before an end, the best is remembered by this
process only: a restarted syncer starts a new best at its next evaluation.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco_trainer.api.documents import CheckpointRef
from diloco_trainer.api.manifest import CheckpointManifest
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.models.parts import TrainingParts, evaluate
from diloco_trainer.syncer.merging import GlobalModel, TensorSnapshot, trim
from diloco_trainer.syncer.state import (
    CHECKPOINT,
    CORRUPT,
    EVAL_LOSS_ROSE,
    Health,
    Kept,
    SyncerMetrics,
    Trip,
    best_due,
    judged,
    tripped,
)
from diloco_trainer.syncer.storage import (
    FAINT_NAMED,
    FINAL_ROSE,
    TRIPPED,
    GuardEnd,
    write_guard_end,
)
from diloco_trainer.syncer.storage import checkpoint as ckpt

log = logging.getLogger("diloco.syncer")

# Evaluations kept in evalHistory (status and checkpoints): the first and the latest ones.
EVAL_HISTORY = 1000


class Evaluations:
    """Eval losses of the global weights (evalHistory) and how to compute them."""

    def __init__(
        self, parts: TrainingParts, metrics: SyncerMetrics, clock: Callable[[], float]
    ) -> None:
        self.parts = parts
        self.metrics = metrics
        self.clock = clock
        self.history: list[dict[str, Any]] = []
        self.initial_loss: float | None = None
        self.last_step = -1
        # Merged tokens of the latest evaluation: the finish evaluates the final weights when
        # merges since then moved them without completing an outer step (partial rounds at K < M
        # or the drain's last pushes), so the final eval loss is never of older weights.
        self.last_tokens = -1

    @property
    def latest(self) -> float | None:
        return self.history[-1]["evalLoss"] if self.history else None

    def evaluate_live(self) -> float:
        """The eval loss of the live global weights (θ_exact; the caller holds them still);
        the activations' heap pages go back to the system after it (memory.trim)."""
        try:
            return evaluate(self.parts)
        finally:
            trim()

    def record(self, loss: float, *, step: int, tokens: int) -> None:
        """Append an evalHistory entry for outer step `step`."""
        self.history.append(
            {"outerStep": step, "tokens": tokens, "evalLoss": loss, "time": self.clock()}
        )
        if len(self.history) > EVAL_HISTORY:  # the start of the curve stays, the middle goes
            del self.history[1 : len(self.history) - EVAL_HISTORY + 1]
        self.last_step = max(self.last_step, step)
        self.last_tokens = max(self.last_tokens, tokens)
        self.metrics.eval_loss.set(loss)

    def restore(self, manifest: CheckpointManifest, outer_step: int) -> None:
        history = [e.to_wire() for e in manifest.eval_history]
        self.history = history[:1] + history[1:][-(EVAL_HISTORY - 1) :]
        self.initial_loss = manifest.initial_eval_loss
        self.last_step = outer_step
        self.last_tokens = int(history[-1]["tokens"]) if history else -1


@dataclass(frozen=True)
class CheckpointSnapshot:
    """Everything a checkpoint of one moment needs: the manifest, and the tensors (the live
    ones, kept still by the caller while the checkpoint is written)."""

    outer_step: int
    tensors: TensorSnapshot
    manifest: CheckpointManifest


# Takes a CheckpointSnapshot: its manifest on the loop, the live tensors by reference.
Snapshotter = Callable[[], Awaitable[CheckpointSnapshot]]


class Checkpoints:
    """Writes checkpoints of snapshots under state_dir, keeping the newest `keep`; a failed
    write is reported to `health` (and counted) instead of raised."""

    def __init__(
        self,
        state_dir: Path,
        keep: int,
        evaluations: Evaluations,
        health: Health,
        metrics: SyncerMetrics,
    ) -> None:
        self.state_dir = state_dir
        self.keep = keep
        self.evaluations = evaluations
        self.health = health
        self.metrics = metrics
        self.last_step = -1
        # The versions of the newest checkpoint written (or resumed from): a stop writes one
        # when merges happened since.
        self.last_versions: list[int] | None = None
        # {path, outerStep} of the newest checkpoint written: the status names it (the final
        # weights once the job finished).
        self.latest: dict[str, Any] | None = None
        # {path, outerStep} of the quality guard's best checkpoint (jobs.py's docstring), which
        # the pruning leaves alone.
        self.best: dict[str, Any] | None = None

    async def write(self, snap: CheckpointSnapshot) -> bool:
        """Write a checkpoint of `snap`; False (reported, not raised) when it failed."""
        step = snap.outer_step
        history = [e for e in self.evaluations.history if e["outerStep"] <= step]
        try:
            path = await asyncio.to_thread(
                ckpt.save_checkpoint,
                self.state_dir,
                outer_step=step,
                weights=snap.tensors.weights,
                momentum=snap.tensors.momentum,
                manifest={**snap.manifest.to_wire(), "evalHistory": history},
                keep=self.keep,
                published=snap.tensors.published,
                protect=None if self.best is None else Path(self.best["path"]),
            )
        except Exception as err:  # a full or read-only disk must not stop training
            log.exception("checkpoint at outer step %d failed", step)
            self.health.report(CHECKPOINT, f"checkpoint at outer step {step} failed: {err}")
            self.metrics.checkpoint_failures.inc()
            return False
        self.health.clear(CHECKPOINT, CORRUPT)
        self.last_versions = list(snap.manifest.versions)
        self.latest = {"path": str(path), "outerStep": step}
        log.info("checkpoint %s written", path)
        return True

    async def end_at_best(self, kind: str, message: str, now: float) -> None:
        """The quality guard ended the job: the best is the final checkpoint. Its end is
        written to the state dir first (storage/guard_end.py: a restart stays finished), then
        the checkpoints after the best are set aside; a failure of either is reported (the
        health problem checkpoint), not raised: this process ends the job all the same."""
        self.latest = self.best
        best = None if self.best is None else Path(self.best["path"])
        end = GuardEnd(
            kind=kind,
            message=message,
            best=None if best is None else best.name,
            best_step=0 if self.best is None else int(self.best["outerStep"]),
            time=now,
        )
        try:
            await asyncio.to_thread(write_guard_end, self.state_dir, end)
        except OSError as err:
            log.exception("writing the quality guard's end of the job failed")
            self.health.report(
                CHECKPOINT, f"the quality guard's end of the job was not written: {err}"
            )
        await self.set_aside_after_best()

    def restore_end(self, end: GuardEnd) -> None:
        """A restart after the guard's end (startup.py): the best is the final checkpoint
        again (None: the initial weights)."""
        best = end.best_path(self.state_dir)
        self.best = None if best is None else {"path": str(best), "outerStep": end.best_step}
        self.latest = self.best
        self.last_versions = None

    async def set_aside_after_best(self) -> None:
        """Set aside the checkpoints after the best (all of them with no best: the initial
        weights were the best); a failure is reported, not raised."""
        step = 0 if self.best is None else int(self.best["outerStep"])
        try:
            moved = await asyncio.to_thread(ckpt.set_aside_after, self.state_dir, step)
        except OSError as err:
            log.exception("setting aside the checkpoints after outer step %d failed", step)
            self.health.report(CHECKPOINT, f"setting aside checkpoints after the best: {err}")
            return
        for path in moved:
            log.warning("checkpoint set aside as %s: its weights rose above the best", path.name)


@dataclass(frozen=True)
class JobsSnapshot:
    """Evaluations and checkpoints as the status document shows them (BackgroundJobs.snapshot)."""

    eval_loss: float | None  # the latest evaluation
    initial_eval_loss: float | None
    eval_history: list[dict[str, Any]]  # api/documents.EvalPoint's wire form
    checkpoint: CheckpointRef | None  # the newest written by this process
    checkpoint_step: int  # the outer step of the newest written or resumed from


class BackgroundJobs:
    """Evaluations and checkpoints of the global model: when they are due, run in worker
    threads. The service calls these with its lock held."""

    def __init__(
        self,
        spec: JobSpec,
        parts: TrainingParts,
        model: GlobalModel,
        *,
        state_dir: Path,
        metrics: SyncerMetrics,
        clock: Callable[[], float],
        health: Health,
        evaluates: bool = True,
    ) -> None:
        """`evaluates`: False on a syncer shard, which holds only its own fragments (no
        process holds the whole model to evaluate: evaluate the exported model instead)."""
        self.model = model
        self.evaluates = evaluates
        self.eval_every = spec.syncer.eval_every_outer_steps
        self.checkpoint_every = spec.syncer.checkpoint.every_outer_steps
        self.evaluations = Evaluations(parts, metrics, clock)
        self.guard = spec.syncer.quality_guard
        # The best eval loss of this process's evaluations (the quality guard's reference).
        self.best_loss: float | None = None
        # The eval losses since that best (the last `patience` of them are what is judged).
        self.since_best: list[float] = []
        # The outer step and eval loss of the best checkpoint (Checkpoints.best): what a trip
        # exports (None: the initial weights).
        self.kept: Kept | None = None
        self.tripped = False
        self.checkpoints = Checkpoints(
            state_dir, spec.syncer.checkpoint.keep, self.evaluations, health, metrics
        )

    def snapshot(self) -> JobsSnapshot:
        """Their figures as they are now."""
        latest = self.checkpoints.latest
        return JobsSnapshot(
            eval_loss=self.evaluations.latest,
            initial_eval_loss=self.evaluations.initial_loss,
            eval_history=list(self.evaluations.history),
            checkpoint=None if latest is None else CheckpointRef.from_json(latest),
            checkpoint_step=self.checkpoints.last_step,
        )

    def evaluate_initial(self, *, step: int, tokens: int) -> float | None:
        """Evaluate the initial weights (a fresh start) and record it (None: no evaluation)."""
        # The initial state is a pure function of the spec: nothing to checkpoint yet.
        self.checkpoints.last_step = 0
        if not self.evaluates:
            return None
        loss = self.evaluations.evaluate_live()
        self.evaluations.initial_loss = loss
        self.evaluations.record(loss, step=step, tokens=tokens)
        if self.guard.enabled:
            self.best_loss = loss  # the initial weights: a function of the spec, no checkpoint
        return loss

    def restore(self, manifest: CheckpointManifest, outer_step: int) -> None:
        """Continue from a checkpoint's evaluations and step."""
        self.evaluations.restore(manifest, outer_step)
        self.checkpoints.last_step = outer_step
        self.checkpoints.last_versions = list(manifest.versions)

    def _eval_due(self, step: int) -> bool:
        return self.evaluates and step > self.evaluations.last_step

    async def after_merge(self, step: int, tokens: int, snapshot: Snapshotter) -> Trip | None:
        """The evaluation and checkpoint due at outer step `step`, of the live weights (no copy
        of P): the caller keeps them still (the service's merge lock: the next merge waits,
        pushes, pulls and probes do not), the work runs in worker threads, off the loop.
        Returns the quality guard's Trip when this evaluation tripped it (nothing is
        checkpointed then: the caller ends the job with the best checkpoint)."""
        if self._eval_due(step) and step % self.eval_every == 0:
            loss = await asyncio.to_thread(self.evaluations.evaluate_live)
            self.evaluations.record(loss, step=step, tokens=tokens)
            log.info("eval at outer step %d (%d tokens): loss %.4f", step, tokens, loss)
            trip = await self._judge(loss, step, snapshot)
            if trip is not None:
                return trip
        if step > self.checkpoints.last_step and step % self.checkpoint_every == 0:
            await self.checkpoints.write(await snapshot())
            self.checkpoints.last_step = step
        return None

    async def _judge(self, loss: float, step: int, snapshot: Snapshotter) -> Trip | None:
        """The quality guard on the evaluation just recorded: a new best is checkpointed now
        (and protected from pruning), else it and the evaluations since the best are judged
        (state/quality.tripped)."""
        if not self.guard.enabled:
            return None
        if self.best_loss is None or loss < self.best_loss:
            self.best_loss, self.since_best = loss, []
            every, margin = self.checkpoint_every, self.guard.margin
            if step > 0 and best_due(step, loss, self.kept, every=every, margin=margin):
                if await self.checkpoints.write(await snapshot()):
                    self.checkpoints.best = self.checkpoints.latest
                    self.kept = Kept(outer_step=step, loss=loss)
                # Written or failed (reported), as the regular checkpoint's: not tried twice.
                self.checkpoints.last_step = max(self.checkpoints.last_step, step)
            return None
        if not judged(step, self.guard.warmup_outer_steps):
            return None  # the outer momentum's early overshoot (state/quality.py)
        self.since_best = [*self.since_best, loss][-self.guard.patience :]
        losses = [self.best_loss, *self.since_best]
        return tripped(losses, margin=self.guard.margin, patience=self.guard.patience)

    def trip_message(self, trip: Trip) -> str:
        """The trip's health problem, naming the model the job ends with (the best kept)."""
        return trip.message(self.guard.margin, self.kept)

    async def end_tripped(self, message: str) -> None:
        """After a trip: the status names the best checkpoint as the final one (None when no
        evaluation after the start was the best: the initial weights, a function of the
        spec), the end is written to the state dir and the checkpoints after the best are set
        aside (the newest on disk is the best: a restart resumes from it and stays finished,
        `diloco export` of the state dir takes it), and a stop writes no checkpoint of the
        weights that rose."""
        self.checkpoints.last_versions = None
        self.tripped = True
        await self.checkpoints.end_at_best(TRIPPED, message, self.evaluations.clock())

    async def end_faint(self, message: str) -> None:
        """A job of two ends for an island's faint claims (gate.Gate.faint_end), as a trip does:
        the best checkpoint is the final one, the end written to the state dir (kind
        FAINT_NAMED), the checkpoints after the best set aside, and a stop writes none."""
        self.checkpoints.last_versions = None
        self.tripped = True
        await self.checkpoints.end_at_best(FAINT_NAMED, message, self.evaluations.clock())

    def restore_end(self, end: GuardEnd) -> None:
        """A restart after the guard ended the job (startup.py): finished as before, its final
        checkpoint the best, and a stop writes no checkpoint."""
        self.checkpoints.restore_end(end)
        self.tripped = True

    async def finish(self, step: int, tokens: int, snapshot: Snapshotter) -> float | None:
        """Evaluate (unless the latest evaluation is of these weights: this step and these
        tokens) and checkpoint the final state; returns the eval
        loss computed here, if any."""
        loss = None
        if self._eval_due(step) or (self.evaluates and tokens > self.evaluations.last_tokens):
            loss = await asyncio.to_thread(self.evaluations.evaluate_live)
            self.evaluations.record(loss, step=step, tokens=tokens)
            # Every evaluation's line is logged here, the final one once (the merge's own line
            # does not repeat it).
            log.info("final eval at outer step %d (%d tokens): loss %.4f", step, tokens, loss)
        await self.checkpoints.write(await snapshot())
        self.checkpoints.last_step = step
        await self._keep_best_at_finish()
        return loss

    async def _keep_best_at_finish(self) -> None:
        """At the budget's finish, with the guard on: a final eval loss above (1 + margin) x
        the best checkpoint's (a run of rises shorter than patience when the budget ran out)
        makes the best checkpoint the final one, with the health problem evalLossRose; so a
        job's final checkpoint is never above (1 + margin) x its best kept one."""
        final, kept = self.evaluations.latest, self.kept
        limit = 1 + self.guard.margin
        if not self.guard.enabled or final is None or kept is None:
            return
        if not final > limit * kept.loss:
            return
        message = (
            f"final eval loss {final:.4f} above {limit:g} x the best checkpoint's "
            f"({kept.loss:.4f}): the final checkpoint is that best one (outer step "
            f"{kept.outer_step})"
        )
        await self.checkpoints.end_at_best(FINAL_ROSE, message, self.evaluations.clock())
        self.checkpoints.health.report(EVAL_LOSS_ROSE, message)

    async def final_checkpoint(self, versions: list[int], snapshot: Snapshotter) -> bool:
        """At a stop: a checkpoint when anything was merged since the
        last one (so a restart loses nothing merged); True when one was written. None after
        the quality guard tripped: the weights that rose are not the job's to keep."""
        if self.tripped or versions == self.checkpoints.last_versions or not any(versions):
            return False
        return await self.checkpoints.write(await snapshot())

    async def stop(
        self,
        timeout: float,
        final: tuple[list[int], Snapshotter] | None = None,
    ) -> None:
        """Write the final checkpoint (`final`: the versions and their snapshot; each step
        within `timeout`)."""
        if final is not None:
            try:
                if await asyncio.wait_for(self.final_checkpoint(*final), timeout):
                    log.info("checkpoint of versions %s written at stop", final[0])
            except TimeoutError:
                log.warning("stopping without a final checkpoint: it took over %gs", timeout)
