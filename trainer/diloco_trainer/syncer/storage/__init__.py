"""The syncer's checkpoints on disk: written a tensor at a time with their hashes, listed,
verified and loaded.

This face is what the other sub-packages use; the modules inside import each other directly."""

from __future__ import annotations

from diloco_trainer.syncer.storage import checkpoint
from diloco_trainer.syncer.storage.checkpoint import (
    CHECKPOINTS_DIR,
    MANIFEST_FILE,
    list_checkpoints,
    load_checkpoint,
    write_tensors_unhashed,
)

__all__ = [
    "CHECKPOINTS_DIR",
    "MANIFEST_FILE",
    "checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "write_tensors_unhashed",
]
