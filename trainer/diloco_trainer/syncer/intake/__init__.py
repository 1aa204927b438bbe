"""What the syncer takes in: which islands may exist (admission), who may act as which island
(rights), a push's body read and checked (validation, payload), the guards on its work and
values (guards, direction), and the gate that applies them per island.

This face is what the other sub-packages use; the modules inside import each other directly."""

from __future__ import annotations

from diloco_trainer.syncer.intake.admission import Admission, admitted_records
from diloco_trainer.syncer.intake.gate import Gate
from diloco_trainer.syncer.intake.guards import (
    ContributionGuard,
    DeltaStats,
    clip_scale,
    delta_stats,
    make_guard,
    movement_caps,
)
from diloco_trainer.syncer.intake.payload import EncodedPayload
from diloco_trainer.syncer.intake.rights import require_island
from diloco_trainer.syncer.intake.validation import (
    MAX_REPLICAS,
    MAX_SECONDS,
    MAX_WIRE_INT,
    IncomingPush,
    at_least,
    at_most,
    bounded_loss,
    fragment_body_limit,
    island_name,
    json_too_deep,
    measure_push,
    read_push,
    step_time_limit,
    typed_field,
)

__all__ = [
    "MAX_REPLICAS",
    "MAX_SECONDS",
    "MAX_WIRE_INT",
    "Admission",
    "ContributionGuard",
    "DeltaStats",
    "EncodedPayload",
    "Gate",
    "IncomingPush",
    "admitted_records",
    "at_least",
    "at_most",
    "bounded_loss",
    "clip_scale",
    "delta_stats",
    "fragment_body_limit",
    "island_name",
    "json_too_deep",
    "make_guard",
    "measure_push",
    "movement_caps",
    "read_push",
    "require_island",
    "step_time_limit",
    "typed_field",
]
