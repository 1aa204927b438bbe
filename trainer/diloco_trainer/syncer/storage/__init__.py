"""The syncer's checkpoints on disk: written a tensor at a time with their hashes, listed,
verified and loaded; and the quality guard's end of a job beside them (guard_end).

This face is what the other sub-packages use; the modules inside import each other directly."""

from __future__ import annotations

from diloco_trainer.syncer.storage import checkpoint, guard_end
from diloco_trainer.syncer.storage.checkpoint import (
    CHECKPOINTS_DIR,
    MANIFEST_FILE,
    list_checkpoints,
    load_checkpoint,
    write_tensors_unhashed,
)
from diloco_trainer.syncer.storage.guard_end import (
    FAINT_NAMED,
    FINAL_ROSE,
    TRIPPED,
    GuardEnd,
    read_guard_end,
    write_guard_end,
)

__all__ = [
    "CHECKPOINTS_DIR",
    "FAINT_NAMED",
    "FINAL_ROSE",
    "MANIFEST_FILE",
    "TRIPPED",
    "GuardEnd",
    "checkpoint",
    "guard_end",
    "list_checkpoints",
    "load_checkpoint",
    "read_guard_end",
    "write_guard_end",
    "write_tensors_unhashed",
]
