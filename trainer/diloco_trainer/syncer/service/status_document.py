"""The syncer's documents of itself, assembled from its parts' typed snapshots: the status
document (GET /v1/status, api/documents.SyncerStatus) and the manifest of a checkpoint
(api/manifest.CheckpointManifest). Each part says what it shows (SyncState.snapshot and .saved,
MergeLog.snapshot, Publisher.snapshot, BackgroundJobs.snapshot); this module only puts them
together, so it reads no part's insides and knows nothing of the service."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from diloco_trainer.api.documents import CheckpointRef, SyncerStatus
from diloco_trainer.api.manifest import CheckpointManifest, SavedGuards
from diloco_trainer.syncer.merging import MergeLogSnapshot
from diloco_trainer.syncer.service.jobs import JobsSnapshot
from diloco_trainer.syncer.serving import PullSnapshot
from diloco_trainer.syncer.state import RoundsSnapshot, SavedRounds


@dataclass(frozen=True)
class Identity:
    """What does not change while a syncer runs."""

    job_name: str
    codec: str
    pull_compression: str
    fragments: int
    spec_hash: str


@dataclass(frozen=True)
class RunState:
    """What the service itself keeps: whether the job finished or the syncer failed, bytes
    received, the checkpoint it resumed from and the name of this run (Syncer.run)."""

    finished: bool
    failure: str | None
    bytes_in: int
    resumed_from: str | None
    run: str = ""


def status_document(
    identity: Identity,
    progress: RunState,
    *,
    rounds: RoundsSnapshot,
    merges: MergeLogSnapshot,
    pulls: PullSnapshot,
    jobs: JobsSnapshot,
    refusals: dict[str, dict[str, int]],
    health: dict[str, Any],
    time: float,
) -> SyncerStatus:
    """The status document from the parts' snapshots (taken without the lock: see
    Syncer.status)."""
    return SyncerStatus(
        job_name=identity.job_name,
        outer_step=rounds.outer_step,
        versions=rounds.versions,
        finished=progress.finished,
        quorum=rounds.quorum,
        awaited_islands=rounds.awaited_islands,
        quorum_target=rounds.quorum_target,
        grace=rounds.grace,
        fragments=identity.fragments,
        pending=rounds.pending,
        codec=identity.codec,
        pull_compression=identity.pull_compression,
        pulls=pulls.pulls,
        tokens=merges.tokens,
        loss=merges.loss,
        eval_loss=jobs.eval_loss,
        initial_eval_loss=jobs.initial_eval_loss,
        eval_history=jobs.eval_history,
        bytes_in=progress.bytes_in,
        bytes_out=pulls.bytes_out,
        last_merge_time=merges.last_time,
        merge_count=merges.count,
        active_islands=rounds.active_islands,
        islands=rounds.islands,
        merges=merges.recent,
        refusals=refusals,
        resumed_from=progress.resumed_from,
        run=progress.run,
        checkpoint=latest_checkpoint(jobs, progress.resumed_from),
        failure=progress.failure,
        # Not a SyncerStatus field (its readers keep it as an extra): the syncer's health
        # problems, as /healthz lists them.
        health=health,
        time=time,
    )


def finite_only(value: Any) -> Any:
    """A JSON document with every non-finite number (inf, -inf, nan) replaced by None: the
    status document is read by JSON parsers that refuse `Infinity` and `NaN` (issue 46: a push
    loss of 1e308 summed to inf). The edge bounds what comes in (validation.MAX_LOSS); this
    keeps whatever is computed from it out of the document too."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_only(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_only(v) for v in value]
    return value


def latest_checkpoint(jobs: JobsSnapshot, resumed_from: str | None) -> CheckpointRef | None:
    """The newest checkpoint on disk: written by this process, else the one it resumed from (a
    syncer restarted after the finish serves the final weights from it)."""
    if jobs.checkpoint is not None:
        return jobs.checkpoint
    if resumed_from:
        return CheckpointRef(path=resumed_from, outer_step=jobs.checkpoint_step)
    return None


def checkpoint_manifest(
    identity: Identity,
    *,
    rounds: SavedRounds,
    fragments: list[list[str]],
    outer_progress: dict[str, dict[str, float]],
    merge_counters: dict[str, Any],
    initial_eval_loss: float | None,
    norm_history: list[list[float]],
    guards: SavedGuards,
    time: float,
) -> CheckpointManifest:
    """The manifest of a checkpoint of the syncer as it is now (lock held); the checkpoint
    writer adds the evaluations (jobs.Checkpoints) and stamps format and outer step.
    `merge_counters` are MergeLog.manifest()'s fields."""
    return CheckpointManifest(
        job_name=identity.job_name,
        versions=rounds.versions,
        outer_step=rounds.outer_step,
        outer_progress=outer_progress,
        work_clocks=rounds.work_clocks,
        fragments=fragments,
        **merge_counters,
        initial_eval_loss=initial_eval_loss,
        islands=rounds.islands,
        counts=rounds.counts,
        spec_hash=identity.spec_hash,
        codec=identity.codec,
        pull_compression=identity.pull_compression,
        push_answers=rounds.push_answers,
        norm_history=norm_history,
        guards=guards,
        time=time,
    )
