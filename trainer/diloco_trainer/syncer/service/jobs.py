"""The syncer's evaluations and checkpoints, of the live weights, in order.

They read θ_exact, the outer momentum and θ_pub where they are (no copy of P: a snapshot cost
one to three copies of the model at a time) while the service keeps them still: it runs them
after a merge with its merge lock held, so the next merge waits for them; pushes, pulls, probes
and heartbeats do not. The work runs in worker threads, and a checkpoint's files are written
and hashed a piece at a time (checkpoint.write_tensors). A failed job is logged and skipped: a
full disk must not stop training. A failed checkpoint write is a health problem (health.py, the
status document, a metric) until the next one succeeds. The JobQueue runs any job scheduled on
it one at a time, in order.

Evaluation runs at start, every syncer.evalEveryOuterSteps outer steps and at the finish (its
evalHistory entry appears shortly after the merge it follows), the finish's also when its outer
step was evaluated already but merges since then moved the weights (partial rounds at K < M,
the drain's last pushes: the same outer step twice, with more tokens); checkpoints every
syncer.checkpoint.everyOuterSteps outer steps, at the finish and when the syncer stops (SIGTERM)
with merges since the last one. evalHistory keeps the first evaluation and the last
EVAL_HISTORY - 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from diloco_trainer.api.documents import CheckpointRef
from diloco_trainer.api.manifest import CheckpointManifest
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.models.parts import TrainingParts, evaluate
from diloco_trainer.syncer.merging.global_model import GlobalModel, Tensors, TensorSnapshot
from diloco_trainer.syncer.merging.heap import trim
from diloco_trainer.syncer.state.gauges import SyncerMetrics
from diloco_trainer.syncer.state.problems import CHECKPOINT, CORRUPT, Health
from diloco_trainer.syncer.storage import checkpoint as ckpt

log = logging.getLogger("diloco.syncer")

# Evaluations kept in evalHistory (status and checkpoints): the first and the latest ones.
EVAL_HISTORY = 1000


class JobQueue:
    """Coroutines run one at a time, in order, by one worker task on the serving loop."""

    def __init__(self) -> None:
        # Created on the serving loop (start()).
        self._jobs: asyncio.Queue[Coroutine[Any, Any, object]] | None = None
        self._worker: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Create the queue and its worker (call on the serving loop)."""
        self._jobs = asyncio.Queue()
        self._worker = asyncio.create_task(self._run())

    def schedule(self, job: Coroutine[Any, Any, object]) -> None:
        assert self._jobs is not None
        self._jobs.put_nowait(job)

    async def _run(self) -> None:
        """Run scheduled jobs until cancelled; a failed one is logged and skipped."""
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
        """Wait until every scheduled job has finished."""
        if self._jobs is not None:
            await self._jobs.join()

    async def stop(self, timeout: float) -> None:
        """Let scheduled jobs finish (a checkpoint being written completes); stop the worker."""
        if self._worker is None:
            return
        try:
            await asyncio.wait_for(self.drain(), timeout)
        except TimeoutError:
            log.warning("stopping with evaluations or checkpoints still unfinished")
        self._worker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._worker


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
        # A second model to evaluate weight snapshots on while merges go on: a copy of the
        # module that shares the live parameters (no copy of P), whose parameter slots take a
        # snapshot's tensors for the length of one evaluation.
        live = parts.model
        names: dict[int, str] = {}
        for name, p in live.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), name)
        self._eval_model = copy.deepcopy(live, memo={id(p): p for p in live.parameters()})
        self._slots = [
            (module, attr, names[id(p)])
            for module in self._eval_model.modules()
            for attr, p in module._parameters.items()
            if p is not None
        ]

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

    def evaluate_snapshot(self, weights: Tensors) -> float:
        """The eval loss of a copy of the weights, on the second model (its parameter slots
        hold the copy's tensors while it evaluates, the live parameters again after)."""
        held = [(module, attr, module._parameters[attr]) for module, attr, _ in self._slots]
        try:
            for module, attr, name in self._slots:
                module._parameters[attr] = nn.Parameter(weights[name], requires_grad=False)
            with torch.no_grad():
                return evaluate(self.parts, self._eval_model)
        finally:
            for module, attr, p in held:
                module._parameters[attr] = p

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

    async def write(self, snap: CheckpointSnapshot) -> bool:
        """Write a checkpoint of `snap`; False (reported, not raised) when it failed."""
        step = snap.outer_step
        # Evaluations queued before this checkpoint have finished (jobs run in order).
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


@dataclass(frozen=True)
class JobsSnapshot:
    """Evaluations and checkpoints as the status document shows them (BackgroundJobs.snapshot)."""

    eval_loss: float | None  # the latest evaluation
    initial_eval_loss: float | None
    eval_history: list[dict[str, Any]]  # api/documents.EvalPoint's wire form
    checkpoint: CheckpointRef | None  # the newest written by this process
    checkpoint_step: int  # the outer step of the newest written or resumed from


class BackgroundJobs:
    """Evaluations and checkpoints of the global model: when they are due, and the queue they
    run on. The service calls these with its lock held."""

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
        self.queue = JobQueue()
        self.evaluations = Evaluations(parts, metrics, clock)
        self.checkpoints = Checkpoints(
            state_dir, spec.syncer.checkpoint.keep, self.evaluations, health, metrics
        )

    def start(self) -> None:
        """Start the worker the jobs run on (on the serving loop)."""
        self.queue.start()

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
        return loss

    def restore(self, manifest: CheckpointManifest, outer_step: int) -> None:
        """Continue from a checkpoint's evaluations and step."""
        self.evaluations.restore(manifest, outer_step)
        self.checkpoints.last_step = outer_step
        self.checkpoints.last_versions = list(manifest.versions)

    def _eval_due(self, step: int) -> bool:
        return self.evaluates and step > self.evaluations.last_step

    async def after_merge(self, step: int, tokens: int, snapshot: Snapshotter) -> None:
        """The evaluation and checkpoint due at outer step `step`, of the live weights (no copy
        of P): the caller keeps them still (the service's merge lock: the next merge waits,
        pushes, pulls and probes do not), the work runs in worker threads, off the loop."""
        if self._eval_due(step) and step % self.eval_every == 0:
            await self.queue.drain()  # jobs scheduled before land in evalHistory first
            loss = await asyncio.to_thread(self.evaluations.evaluate_live)
            self.evaluations.record(loss, step=step, tokens=tokens)
            log.info("eval at outer step %d (%d tokens): loss %.4f", step, tokens, loss)
        if step > self.checkpoints.last_step and step % self.checkpoint_every == 0:
            await self.checkpoints.write(await snapshot())
            self.checkpoints.last_step = step

    async def finish(self, step: int, tokens: int, snapshot: Snapshotter) -> float | None:
        """Evaluate (unless the latest evaluation is of these weights: this step and these
        tokens) and checkpoint the final state, after every scheduled job; returns the eval
        loss computed here, if any."""
        await self.queue.drain()  # earlier evaluations land in evalHistory first
        loss = None
        if self._eval_due(step) or (self.evaluates and tokens > self.evaluations.last_tokens):
            loss = await asyncio.to_thread(self.evaluations.evaluate_live)
            self.evaluations.record(loss, step=step, tokens=tokens)
            # Logged here: a finish after every island drained follows no merge line to carry it.
            log.info("final eval at outer step %d (%d tokens): loss %.4f", step, tokens, loss)
        await self.checkpoints.write(await snapshot())
        self.checkpoints.last_step = step
        return loss

    async def final_checkpoint(self, versions: list[int], snapshot: Snapshotter) -> bool:
        """At a stop, after every scheduled job: a checkpoint when anything was merged since the
        last one (so a restart loses nothing merged); True when one was written."""
        await self.queue.drain()
        if versions == self.checkpoints.last_versions or not any(versions):
            return False
        return await self.checkpoints.write(await snapshot())

    async def stop(
        self,
        timeout: float,
        final: tuple[list[int], Snapshotter] | None = None,
    ) -> None:
        """Write the final checkpoint (`final`: the versions and their snapshot; each step
        within `timeout`), let scheduled jobs finish and stop the worker."""
        if final is not None:
            try:
                if await asyncio.wait_for(self.final_checkpoint(*final), timeout):
                    log.info("checkpoint of versions %s written at stop", final[0])
            except TimeoutError:
                log.warning("stopping without a final checkpoint: it took over %gs", timeout)
        await self.queue.stop(timeout)
