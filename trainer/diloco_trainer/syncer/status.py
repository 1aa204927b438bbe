"""The syncer's documents of itself, assembled from its parts: the status document (GET
/v1/status, api/documents.SyncerStatus) and the manifest of a checkpoint
(api/manifest.CheckpointManifest). Both are built as their models; the parts are named one by
one (StatusSources), not reached through the service."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from diloco_trainer.api.documents import CheckpointRef, SyncerStatus
from diloco_trainer.api.manifest import CheckpointManifest
from diloco_trainer.syncer.gate import Gate
from diloco_trainer.syncer.global_model import GlobalModel
from diloco_trainer.syncer.health import Health
from diloco_trainer.syncer.jobs import BackgroundJobs
from diloco_trainer.syncer.merge_log import MergeLog
from diloco_trainer.syncer.publisher import Publisher
from diloco_trainer.syncer.rounds import SyncState


@dataclass(frozen=True)
class StatusSources:
    """The parts a syncer's documents of itself are read from."""

    job_name: str
    codec: str
    spec_hash: str
    state: SyncState
    model: GlobalModel
    publisher: Publisher
    merge_log: MergeLog
    jobs: BackgroundJobs
    gate: Gate
    health: Health
    clock: Callable[[], float]


@dataclass(frozen=True)
class Progress:
    """What the service itself keeps: whether the job finished or the syncer failed, bytes
    received, and the checkpoint it resumed from."""

    finished: bool
    failure: str | None
    bytes_in: int
    resumed_from: str | None


def status_document(s: StatusSources, p: Progress) -> SyncerStatus:
    """The status document of the syncer as it is now (read without the lock: see
    Syncer.status)."""
    state = s.state
    evaluations = s.jobs.evaluations
    return SyncerStatus(
        job_name=s.job_name,
        outer_step=state.outer_step,
        versions=state.versions,
        finished=p.finished,
        quorum=state.effective_quorum(),
        awaited_islands=state.membership.awaited(),
        quorum_target=state.policy.quorum,
        grace=state.grace(),
        fragments=len(s.model.fragments),
        pending=[len(r.pending) for r in state.rounds],
        codec=s.codec,
        pull_compression=s.model.pull_compression,
        pulls=dict(s.publisher.pulls),
        tokens=s.merge_log.tokens,
        loss=s.merge_log.loss,
        eval_loss=evaluations.latest,
        initial_eval_loss=evaluations.initial_loss,
        eval_history=list(evaluations.history),
        bytes_in=p.bytes_in,
        bytes_out=s.publisher.bytes_out,
        last_merge_time=s.merge_log.last_time,
        merge_count=s.merge_log.count,
        active_islands=len(state.membership.active()),
        islands=state.membership.statuses(),
        merges=list(s.merge_log.recent),
        refusals=s.gate.refusals_json(),
        resumed_from=p.resumed_from,
        checkpoint=latest_checkpoint(s.jobs, p.resumed_from),
        failure=p.failure,
        # Not a SyncerStatus field (its readers keep it as an extra): the syncer's health
        # problems, as /healthz lists them.
        health=s.health.to_json(),
        time=s.clock(),
    )


def latest_checkpoint(jobs: BackgroundJobs, resumed_from: str | None) -> CheckpointRef | None:
    """The newest checkpoint on disk: written by this process, else the one it resumed from (a
    syncer restarted after the finish serves the final weights from it)."""
    if jobs.checkpoints.latest is not None:
        return CheckpointRef.from_json(jobs.checkpoints.latest)
    if resumed_from:
        return CheckpointRef(path=resumed_from, outer_step=jobs.checkpoints.last_step)
    return None


def checkpoint_manifest(s: StatusSources) -> CheckpointManifest:
    """The manifest of a checkpoint of the syncer as it is now (lock held); the checkpoint
    writer adds the evaluations (jobs.Checkpoints) and stamps format and outer step."""
    state = s.state
    return CheckpointManifest(
        job_name=s.job_name,
        versions=state.versions,
        outer_step=state.outer_step,
        outer_progress=s.model.outer.progress_json(),
        work_clocks=state.clocks.to_json(),
        fragments=s.model.fragments,
        **s.merge_log.manifest(),
        initial_eval_loss=s.jobs.evaluations.initial_loss,
        islands=state.membership.statuses(),
        spec_hash=s.spec_hash,
        codec=s.codec,
        pull_compression=s.model.pull_compression,
        push_answers=state.saved_answers(),
        norm_history=s.gate.guard.history.to_json(),
        time=s.clock(),
    )
