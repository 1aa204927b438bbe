"""The syncer's documents of itself: the status document (GET /v1/status, typed by
api/documents.SyncerStatus) and the manifest of a checkpoint."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from diloco_trainer.syncer.service import Syncer


def status_document(s: Syncer) -> dict[str, Any]:
    """The status document of the syncer as it is now (read without the lock: see
    Syncer.status)."""
    return {
        "jobName": s.job_name,
        "outerStep": s.state.outer_step,
        "versions": s.state.versions,
        "finished": s.finished,
        "quorum": s.state.effective_quorum(),
        "awaitedIslands": s.state.awaited_islands(),
        "quorumTarget": s.state.policy.quorum,
        "grace": s.state.grace(),
        "fragments": len(s.model.fragments),
        "pending": [len(r.pending) for r in s.state.rounds],
        "codec": s.codec,
        "pullCompression": s.model.pull_compression,
        "pulls": dict(s.publisher.pulls),
        "tokens": s.tokens,
        "loss": s.merge_log.loss,
        "evalLoss": s.jobs.evaluations.latest,
        "initialEvalLoss": s.jobs.evaluations.initial_loss,
        "evalHistory": list(s.jobs.evaluations.history),
        "bytesIn": s.bytes_in,
        "bytesOut": s.publisher.bytes_out,
        "lastMergeTime": s.merge_log.last_time,
        "mergeCount": s.merge_log.count,
        "activeIslands": len(s.state.active_islands()),
        "islands": s.state.islands_json(),
        "merges": list(s.merge_log.recent),
        "refusals": s.gate.refusals_json(),
        "resumedFrom": s.resumed_from,
        "checkpoint": latest_checkpoint(s),
        "failure": s.failure,
        "health": s.health.to_json(),
        "time": s.clock(),
    }


def latest_checkpoint(s: Syncer) -> dict[str, Any] | None:
    """{path, outerStep} of the newest checkpoint on disk: written by this process, else the one
    it resumed from (a syncer restarted after the finish serves the final weights from it)."""
    if s.jobs.checkpoints.latest is not None:
        return dict(s.jobs.checkpoints.latest)
    if s.resumed_from:
        return {"path": s.resumed_from, "outerStep": s.jobs.checkpoints.last_step}
    return None


def checkpoint_manifest(s: Syncer) -> dict[str, Any]:
    """The manifest of a checkpoint of the syncer as it is now (lock held)."""
    return {
        "jobName": s.job_name,
        "versions": s.state.versions,
        "outerProgress": s.model.outer.progress_json(),
        "workClocks": s.state.clocks_json(),
        "fragments": s.model.fragments,
        **s.merge_log.manifest(),
        "initialEvalLoss": s.jobs.evaluations.initial_loss,
        "islands": s.state.islands_json(),
        "specHash": s.spec_hash,
        "codec": s.codec,
        "pullCompression": s.model.pull_compression,
        "pushAnswers": s.state.answers_json(),
        "normHistory": s.gate.guard.history.to_json(),
        "time": s.clock(),
    }
