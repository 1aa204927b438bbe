"""The syncer's state: island records and membership, each fragment's rounds and work clocks,
the push answers kept for replays, stop targets, health problems and the metrics. Plain,
synchronous data and transitions (no event loop, no HTTP).

This face is what the other sub-packages use; the modules inside import each other directly."""

from __future__ import annotations

from diloco_trainer.syncer.state.gauges import CONTENT_TYPE, SyncerMetrics
from diloco_trainer.syncer.state.membership import Membership
from diloco_trainer.syncer.state.problems import (
    AT_BOUND,
    CHECKPOINT,
    CORRUPT,
    EVAL_LOSS_ROSE,
    FAINT_ENDED,
    LEFT_OUT,
    MERGE,
    WORK_UNSUPPORTED,
    Health,
)
from diloco_trainer.syncer.state.quality import Kept, Trip, best_due, judged, tripped
from diloco_trainer.syncer.state.records import (
    DROPPED,
    LEFT,
    TIMED_OUT,
    Beat,
    Contribution,
    IslandRecord,
    RoundPolicy,
    round_policy,
)
from diloco_trainer.syncer.state.round_sizes import RoundSizes
from diloco_trainer.syncer.state.rounds import (
    RoundsSnapshot,
    SavedRounds,
    SyncState,
    lost_with_restart,
)
from diloco_trainer.syncer.state.targets import (
    CountBound,
    budget_tokens,
    count_refused,
    done_range,
    drained_at_budget,
    horizon_seconds,
    lock_step_weights,
    merged_elsewhere,
    pace_of,
    pace_span_seconds,
    pace_wait_seconds,
    ready_to_split,
    running_islands,
    split_among,
    stop_reached,
    stop_targets,
)

__all__ = [
    "AT_BOUND",
    "CHECKPOINT",
    "CONTENT_TYPE",
    "CORRUPT",
    "DROPPED",
    "EVAL_LOSS_ROSE",
    "FAINT_ENDED",
    "LEFT",
    "LEFT_OUT",
    "MERGE",
    "TIMED_OUT",
    "WORK_UNSUPPORTED",
    "Beat",
    "Contribution",
    "CountBound",
    "Health",
    "IslandRecord",
    "Kept",
    "Membership",
    "RoundPolicy",
    "RoundSizes",
    "RoundsSnapshot",
    "SavedRounds",
    "SyncState",
    "SyncerMetrics",
    "Trip",
    "best_due",
    "budget_tokens",
    "count_refused",
    "done_range",
    "drained_at_budget",
    "horizon_seconds",
    "judged",
    "lock_step_weights",
    "lost_with_restart",
    "merged_elsewhere",
    "pace_of",
    "pace_span_seconds",
    "pace_wait_seconds",
    "ready_to_split",
    "round_policy",
    "running_islands",
    "split_among",
    "stop_reached",
    "stop_targets",
    "tripped",
]
