"""The DiLoCoJob API (`diloco.dev/v1alpha1`): spec and status models.

The spec schema is the trainer's `JobSpec` (one schema for `diloco run`, the pods and the CRD);
this module only tightens it where a cluster needs more than a local run (an image is required,
the pod template's shape is spelled out). The status models are the operator's own. `crd.py`
turns both into the CRD's OpenAPI schema, so these models are the single source of truth.
"""

from __future__ import annotations

from typing import Any, Literal

from diloco_trainer.api.spec import IslandsSpec, JobSpec, format_validation_error
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

GROUP = "diloco.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "DiLoCoJob"
PLURAL = "dilocojobs"
SINGULAR = "dilocojob"
SHORT_NAMES = ("dj",)

Phase = Literal["Pending", "Running", "Degraded", "Suspended", "Succeeded", "Failed"]
PHASES: tuple[str, ...] = ("Pending", "Running", "Degraded", "Suspended", "Succeeded", "Failed")
ConditionStatus = Literal["True", "False", "Unknown"]
IslandState = Literal["active", "dropped", "timedOut", "left", "unknown"]


class ClusterIslandsSpec(IslandsSpec):
    """The M islands of compute."""

    template: dict[str, Any] = Field(
        default_factory=dict,
        description="A PodTemplateSpec fragment merged into every learner pod: 'metadata' "
        "(labels, annotations) and 'spec' (nodeSelector, tolerations, affinity, volumes, ...). "
        "Maps merge key by key; containers, initContainers, volumes and env merge by name (the "
        "learner container is named 'learner'); other lists replace.",
    )


class DiLoCoJobSpec(JobSpec):
    """The spec of a DiLoCoJob: the trainer's JobSpec plus what a cluster needs."""

    image: str = Field(  # required here, optional for local runs
        ...,
        min_length=1,
        description="Trainer container image, used for the learner and syncer pods.",
    )
    islands: ClusterIslandsSpec = Field(default_factory=ClusterIslandsSpec)


class SpecError(ValueError):
    """A DiLoCoJob spec the operator cannot use; the message names the field."""


def parse_job_spec(data: dict[str, Any]) -> DiLoCoJobSpec:
    """Validate a DiLoCoJob spec as read from the API server (defaults already applied).

    The CRD refuses bad manifests first; this is the operator's second line (e.g. a CRD from an
    older chart), raising SpecError with every bad field named.
    """
    try:
        return DiLoCoJobSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(format_validation_error(err)) from None


class StatusModel(BaseModel):
    """Base for status sections: camelCase on the wire, unknown fields refused."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class Condition(StatusModel):
    """A metav1.Condition-style observation about the job."""

    type: str = Field(
        description="Ready, Progressing, Degraded, Suspended, Succeeded, Failed, SyncerReachable, "
        "NameConflict, SyncerHealthy, Checked (the pre-flight check of the spec, before any pod "
        "is created) or WaitingForQuota."
    )
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(
        "", description="One CamelCase word saying why the condition has this status."
    )
    message: str = Field("", description="Human-readable details.")
    last_transition_time: str = Field(
        "", description="When the status last changed (RFC 3339); not touched otherwise."
    )
    observed_generation: int = Field(
        0, ge=0, description="metadata.generation of the spec this condition was computed for."
    )


class IslandCounts(StatusModel):
    """How many islands are wanted, ready and in the syncer's quorum."""

    desired: int = Field(0, ge=0, description="Islands the spec asks for (0 while suspended).")
    ready: int = Field(0, ge=0, description="Islands whose pods all exist and are Ready.")
    active: int = Field(0, ge=0, description="Islands the syncer counts as active members.")


class IslandEntry(StatusModel):
    """One island as seen from its pods and from the syncer."""

    name: str = Field(description="Island name, e.g. island-0 or eu-island-0.")
    ready_pods: int = Field(0, ge=0, description="Ready pods of the island.")
    desired_pods: int = Field(0, ge=0, description="Pods the island should have.")
    healthy: bool = Field(False, description="All pods exist and are Ready.")
    in_quorum: bool = Field(False, description="The syncer counts this island as active.")
    state: IslandState = Field(
        "unknown",
        description="Membership state reported by the syncer (active, dropped, timedOut, left), "
        "or unknown when the syncer has not been reached or has never heard of the island.",
    )
    last_push: str | None = Field(
        None, description="When the syncer last accepted a pseudo-gradient from it (RFC 3339)."
    )
    restarts: int = Field(0, ge=0, description="Container restarts summed over the island's pods.")
    waiting_for_quota: bool = Field(
        False,
        description="Kueue has not admitted the island's pods yet (its admission gate): the "
        "island waits for quota, is not failed, and joins once admitted (docs/kueue.md).",
    )
    holding: bool = Field(
        False,
        description="The island's learner holds its inner steps at the step cap: a fragment "
        "carries the most steps one push may (4 x inner.steps + sync.overlapSteps) and the "
        "syncer has not merged or answered it yet; it steps on once it does. As the syncer "
        "last heard it from the island's heartbeats.",
    )
    drained: bool = Field(
        False,
        description="The island's learner has trained its share of stopAfter, pushed all of "
        "it and seen it merged, and waits for the job to finish (docs/algorithm.md, the "
        "drain); it trains on if the finish does not come within its wait budget. As the "
        "syncer last heard it from the island's heartbeats.",
    )
    step_time: float | None = Field(
        None,
        ge=0,
        description="Seconds per inner step of the island's learner, as its heartbeats last "
        "told the syncer (a recent average).",
    )
    waiting: float | None = Field(
        None,
        ge=0,
        le=1,
        description="The share of the island's learner's wall time (0..1) it spent blocked on "
        "the syncer instead of training (merge waits, the step cap's and the late merge's "
        "holds) between its two latest heartbeats, as the syncer last heard it; absent while "
        "not reported (an older learner). Sustained at 0.25 or more, the job's WaitingForMerges "
        "condition names the island and what to change (docs/cluster.md).",
    )
    inner_steps: int | None = Field(
        None,
        ge=1,
        description="The island's round H_i: inner steps between two pushes of a fragment. "
        "inner.steps, or with inner.stepsPerIsland auto what the syncer sized from the "
        "island's step time (islands.overrides[].innerSteps pins it); its learner adopts it at "
        "its next round boundary.",
    )


class FinalCheckpoint(StatusModel):
    """Where the finished job's weights are: the syncer's final checkpoint."""

    path: str = Field(
        description="The checkpoint directory inside the volume (e.g. "
        "checkpoints/ckpt-000000100); `diloco export` reads it."
    )
    outer_step: int = Field(ge=0, description="The outer step the checkpoint holds.")
    volume: str = Field(
        description="persistentVolumeClaim/NAME (outlives the job), or emptyDir: deleted with "
        "the syncer pod, and with the job (ttlSecondsAfterFinished): export the weights first."
    )


class DiLoCoJobStatus(StatusModel):
    """The observed state of a DiLoCoJob, written by the operator."""

    phase: Phase = Field(
        "Pending",
        description="Pending, Running, Degraded, Suspended, Succeeded or Failed (see the "
        "conditions for why).",
    )
    observed_generation: int = Field(
        0, ge=0, description="metadata.generation of the spec last reconciled."
    )
    conditions: list[Condition] = Field(
        default_factory=list, description="Latest observations of the job's state."
    )
    islands: IslandCounts = Field(default_factory=IslandCounts)
    islands_summary: str = Field("0/0", description="'ready/desired' islands, for kubectl get.")
    rounds_summary: str | None = Field(
        None,
        description="Each island's round, in island order, for kubectl get -o wide: 'H_i@step "
        "time' (e.g. '30@0.05s 10@0.15s'), '-' for what the syncer has not reported.",
    )
    waiting_summary: str | None = Field(
        None,
        description="Each island's share of its wall time waiting for the syncer's merges, in "
        "island order, for kubectl get -o wide (e.g. '62% 4%'), '-' for one not reported.",
    )
    island_statuses: list[IslandEntry] = Field(
        default_factory=list, description="Per-island state, one entry per desired island."
    )
    outer_step: int | None = Field(
        None, ge=0, description="Merges completed by the syncer (min over fragments)."
    )
    tokens: int | None = Field(None, ge=0, description="Tokens merged into the global weights.")
    loss: float | None = Field(None, description="Latest training loss reported to the syncer.")
    eval_loss: float | None = Field(None, description="Latest held-out loss of the global weights.")
    last_sync_time: str | None = Field(
        None, description="When the syncer last merged pseudo-gradients (RFC 3339)."
    )
    progress: str | None = Field(
        None, description="How far towards stopAfter (the nearer limit), e.g. '35%'."
    )
    eta: str | None = Field(
        None, description="Time left at the pace since the syncer started, e.g. '4m10s'."
    )
    finished_time: str | None = Field(
        None, description="When the job reached Succeeded or Failed (RFC 3339)."
    )
    message: str = Field("", description="Why the job is in its phase, in words.")
    final_checkpoint: FinalCheckpoint | None = Field(
        None, description="Where the final weights are, once the job has succeeded."
    )
