"""Where a finished job's weights are, and warnings when they would be lost (pure + Events).

The syncer writes a checkpoint when the job reaches stopAfter and names it in its status
(`checkpoint`); the job's status names it as `finalCheckpoint` {path, outerStep, volume} and keeps
it while the syncer is away. Unless syncer.checkpoint.claimName names a PVC, the checkpoint
volume is an emptyDir: the weights go with the syncer pod, and ttlSecondsAfterFinished deletes
the job (and so the pod) a fixed time after it finishes. That combination is warned about with an
Event (once per job and message) rather than refused, so a job can still clean up after itself
once its weights were exported.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

from diloco_trainer.api import contract
from diloco_trainer.api.documents import SyncerStatus
from pydantic import ValidationError

from diloco_operator.api import DiLoCoJobSpec, FinalCheckpoint
from diloco_operator.events import post_event
from diloco_operator.resources import runs_local_syncer

EMPTY_DIR = "emptyDir"
AT_RISK = "FinalWeightsNotKept"
FINAL_CHECKPOINT = "FinalCheckpoint"


def checkpoint_volume(spec: DiLoCoJobSpec) -> str:
    """The syncer's checkpoint volume, in words: persistentVolumeClaim/NAME or emptyDir."""
    claim = spec.syncer.checkpoint.claim_name
    return f"persistentVolumeClaim/{claim}" if claim else EMPTY_DIR


def volume_path(path: str) -> str:
    """A path of the syncer's process made relative to its state volume (kept when outside)."""
    root = contract.STATE_MOUNT.rstrip("/") + "/"
    return path[len(root) :] if path.startswith(root) else path


def final_checkpoint(
    spec: DiLoCoJobSpec,
    syncer: SyncerStatus | None,
    previous: Mapping[str, Any] | None,
) -> FinalCheckpoint | None:
    """The final checkpoint from the finished syncer's status, else the one stored before."""
    if not runs_local_syncer(spec):
        return None  # the syncer and its checkpoints live in another cluster
    ref = syncer.checkpoint if syncer is not None and syncer.finished else None
    if ref is not None and ref.outer_step >= 0:
        return FinalCheckpoint(
            path=volume_path(ref.path), outer_step=ref.outer_step, volume=checkpoint_volume(spec)
        )
    stored = (previous or {}).get("finalCheckpoint")
    if not isinstance(stored, Mapping):
        return None
    try:
        return FinalCheckpoint.model_validate(stored)
    except ValidationError:
        return None


def weights_at_risk(spec: DiLoCoJobSpec) -> str | None:
    """Why ttlSecondsAfterFinished would delete the only copy of the weights, or None."""
    ttl = spec.ttl_seconds_after_finished
    if ttl is None or not runs_local_syncer(spec) or spec.syncer.checkpoint.claim_name:
        return None
    return (
        f"ttlSecondsAfterFinished ({ttl}) deletes the job {ttl} s after it finishes, and with it "
        "the syncer's emptyDir: the only copy of the trained weights. Set "
        "spec.syncer.checkpoint.claimName (a PersistentVolumeClaim) to keep them, or export "
        "them with `diloco export` before then (status.finalCheckpoint names the checkpoint)."
    )


def post_weight_events(
    posted: MutableMapping[str, str],
    body: Mapping[str, Any],
    spec: DiLoCoJobSpec,
    new_status: Mapping[str, Any],
) -> None:
    """Post the at-risk warning and the final checkpoint's location, each once per job and
    message (`posted`: what was posted, kept in the job's runtime record)."""
    uid = body["metadata"].get("uid", "")
    notes = []
    risk = weights_at_risk(spec)
    if risk:
        notes.append(("Warning", AT_RISK, risk))
    final = new_status.get("finalCheckpoint")
    if isinstance(final, Mapping):
        where = f"{final.get('path')} on {final.get('volume')}"
        step = final.get("outerStep")
        notes.append(("Normal", FINAL_CHECKPOINT, f"final weights (outer step {step}): {where}"))
    for kind, reason, message in notes:
        key = f"{uid}/{reason}"
        if posted.get(key) != message:
            posted[key] = message
            post_event(body, kind, reason, message)
