"""Where a job's pods run: per-island overrides of the learner pods (torch-free spec types).

One job can mix node types: `islands.overrides` gives some islands their own replicas,
resources, node selector and pod template fragment. Islands run with DDP inside, but talk to the
syncer and to each other only through it, so islands of different sizes and hardware are fine:
the syncer weighs each push by the tokens it carries. An index at or beyond `islands.count` is
ignored, so scaling down never has to edit the overrides.

What each island gets is read from the spec through IslandPlacement, which IslandsSpec
inherits (`spec.islands.replicas_of(2)`): the operator builds pods from it, the syncer admits
the largest island's ranks and `diloco run` starts each island's. How those pods are built (the
user's templates merged into ours) is the operator's (resources/placement.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from pydantic import AfterValidator, Field

from diloco_trainer.api.base import SpecModel

MAX_ISLAND_INDEX = 511  # islands.count is at most 512
IslandIndex = Annotated[
    int, Field(ge=0, le=MAX_ISLAND_INDEX, description="An island's index (island-I has index I).")
]


class IslandOverride(SpecModel):
    """Placement and size of some islands, instead of the islands.* defaults."""

    islands: list[IslandIndex] = Field(
        min_length=1,
        max_length=MAX_ISLAND_INDEX + 1,
        description="Indexes of the islands this entry applies to (island-I has index I); "
        "indexes >= islands.count are ignored.",
    )
    replicas: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="Pods (DDP ranks) of these islands; unset: islands.replicas.",
    )
    inner_steps: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="Pins these islands' rounds to this many inner steps between pushes of a "
        "fragment (H_i), whatever inner.stepsPerIsland says; unset: inner.steps, or measured "
        "with inner.stepsPerIsland auto.",
    )
    resources: dict[str, Any] = Field(
        default_factory=dict,
        description="Resource requirements of these islands' learner containers, instead of "
        "islands.resources (empty: islands.resources).",
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict,
        description="Merged key by key into these islands' pod nodeSelector (after "
        "islands.template).",
    )
    template: dict[str, Any] = Field(
        default_factory=dict,
        description="A PodTemplateSpec fragment merged into these islands' pods after "
        "islands.template (the same merge rules).",
    )


def _disjoint(overrides: list[IslandOverride]) -> list[IslandOverride]:
    seen: set[int] = set()
    for entry in overrides:
        twice = seen.intersection(entry.islands)
        if twice:
            raise ValueError(f"island {min(twice)} is named by more than one override")
        seen.update(entry.islands)
    return overrides


IslandOverrides = Annotated[list[IslandOverride], AfterValidator(_disjoint)]

ISLAND_OVERRIDES: Any = Field(
    default_factory=list,
    max_length=MAX_ISLAND_INDEX + 1,
    description="Per-island placement and size (replicas, resources, nodeSelector, template), "
    "so one job can mix node types; each island index in at most one entry.",
)


class IslandPlacement:
    """The per-island lookups of the islands section (IslandsSpec, whose fields these read)."""

    if TYPE_CHECKING:  # IslandsSpec's fields (api/spec.py)
        count: int
        replicas: int
        resources: dict[str, Any]
        overrides: list[IslandOverride]

    def override_of(self, index: int) -> IslandOverride | None:
        """The override entry naming island `index`, if any."""
        for entry in self.overrides:
            if index in entry.islands:
                return entry
        return None

    def replicas_of(self, index: int) -> int:
        """Pods (DDP ranks) of island `index`: its override's replicas, else islands.replicas."""
        entry = self.override_of(index)
        if entry is not None and entry.replicas is not None:
            return entry.replicas
        return self.replicas

    def resources_of(self, index: int) -> dict[str, Any]:
        """Resource requirements of island `index`'s learners: its override's, if it sets
        any, else islands.resources (the spec's own dict: copy it before changing it)."""
        entry = self.override_of(index)
        return entry.resources if entry is not None and entry.resources else self.resources

    def max_replicas(self) -> int:
        """The most replicas any island of this cluster runs (what the syncer admits)."""
        return max(self.replicas_of(i) for i in range(self.count))
