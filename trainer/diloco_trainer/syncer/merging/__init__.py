"""The merge: a round's contributions folded as they arrive (folding), merged and applied by the
outer step to the global model (merger, global_model, merge_checks), logged (merge_log); the
heap returned to the system after large temporaries (heap).

This face is what the other sub-packages use; the modules inside import each other directly."""

from __future__ import annotations

from diloco_trainer.syncer.merging.global_model import GlobalModel, TensorSnapshot
from diloco_trainer.syncer.merging.heap import return_freed_memory, trim
from diloco_trainer.syncer.merging.merge_log import MergeLog, MergeLogSnapshot, describe_merge
from diloco_trainer.syncer.merging.merger import LeftOut, Merger

__all__ = [
    "GlobalModel",
    "LeftOut",
    "MergeLog",
    "MergeLogSnapshot",
    "Merger",
    "TensorSnapshot",
    "describe_merge",
    "return_freed_memory",
    "trim",
]
