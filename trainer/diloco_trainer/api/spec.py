"""The training configuration: the `spec` of a DiLoCoJob.

One schema serves three readers: `diloco run` (local), the trainer pods (the operator mounts the
spec as JSON in a ConfigMap) and the operator's CRD generator (which adds Kubernetes-only rules).
This module imports no torch so the operator can use it.

Field names are snake_case in Python and camelCase on the wire (YAML/JSON), like Kubernetes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from diloco_trainer.api.base import SpecModel
from diloco_trainer.api.data_spec import (
    DataFormat,
    DataSpec,
    IncludePattern,
    TokenizerSpec,
    TokenizerType,
)
from diloco_trainer.api.exposure import (
    ENDPOINT_PATTERN,
    NetworkPolicySpec,
    ServiceSpec,
    TLSSpec,
    exposure_problem,
)
from diloco_trainer.api.placement import ISLAND_OVERRIDES, IslandOverrides, IslandPlacement
from diloco_trainer.api.sync_spec import (
    Codec,
    MergeRule,
    MergeWait,
    PullCompression,
    SyncSpec,
    default_overlap_steps,
)
from diloco_trainer.api.training import InnerSpec, ModelSpec, OuterSpec, Precision, Preset

# The sections that live in their own modules, re-exported: `from diloco_trainer.api.spec import
# InnerSpec` keeps working for every reader.
__all__ = [
    "Codec",
    "DataFormat",
    "DataSpec",
    "IncludePattern",
    "InnerSpec",
    "MergeRule",
    "MergeWait",
    "ModelSpec",
    "OuterSpec",
    "Precision",
    "Preset",
    "PullCompression",
    "SyncSpec",
    "TokenizerSpec",
    "TokenizerType",
    "default_overlap_steps",
]

Parallelism = Literal["ddp", "fsdp"]

# sync.maxStaleness "auto": versions per island of the job (at quorum 1, M versions are about one
# round of work, so pushes about four rounds behind are refused as ancient).
STALE_VERSIONS_PER_ISLAND = 4

# stopAfter.tokens at most: a quintillion (an int64 in the CRD, and far beyond any job).
MAX_STOP_TOKENS = 10**18

# A DNS-1123 label fragment: island names become parts of pod and Service names.
DNS_PREFIX_PATTERN = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)?$"


class RegionSpec(SpecModel):
    """Another cluster of a multi-region job: its islands' name prefix and island count."""

    name_prefix: str = Field(
        max_length=20,
        pattern=DNS_PREFIX_PATTERN,
        description="That cluster's islands.namePrefix (its islands are PREFIX-island-N).",
    )
    count: int = Field(
        ge=1,
        le=512,
        description="Island records the syncer keeps for that cluster (its islands.count): at "
        "most this many of its islands are known at once, and its region credential holds 2 "
        "push slots per record.",
    )


class IslandsSpec(IslandPlacement, SpecModel):
    """The M islands of compute (what each one gets: IslandPlacement's lookups)."""

    count: int = Field(2, ge=1, le=512, description="Number of islands M.")
    replicas: int = Field(
        1, ge=1, le=1024, description="Pods (DDP ranks) per island; rank 0 talks to the syncer."
    )
    parallelism: Parallelism = Field(
        "ddp",
        description="How an island's replicas share the model: ddp (every rank holds all of "
        "it) or fsdp (FSDP2: every rank holds 1/replicas of the parameters, gradients, "
        "optimizer state and pulled global weights; rank 0 gathers one fragment's "
        "pseudo-gradient at a time and pulls full fragments).",
    )
    name_prefix: str = Field(
        "",
        max_length=20,
        pattern=DNS_PREFIX_PATTERN,
        description="Prefix for island names, so islands of one job in several clusters never "
        "collide (e.g. 'eu' gives eu-island-0).",
    )
    shard_offset: int = Field(
        0,
        ge=0,
        description="Index of this cluster's first island among all data shards (multi-region).",
    )
    total_shards: int = Field(
        0,
        ge=0,
        description="Number of data shards across every cluster of the job; 0 means islands.count.",
    )
    startup_timeout_seconds: float = Field(
        600.0,
        gt=0,
        le=86400,
        description="How long the syncer's quorum waits for an island that has not joined yet "
        "and that nobody dropped (the operator drops islands whose pods fail; diloco run, "
        "islands whose processes all exited). A safety net only: slow starts are waited for.",
    )
    resources: dict[str, Any] = Field(
        default_factory=dict,
        description="Kubernetes resource requirements for every learner pod.",
    )
    template: dict[str, Any] = Field(
        default_factory=dict,
        description="Pod template overrides merged into the learner pods (nodeSelector, "
        "tolerations, affinity, ...).",
    )
    overrides: IslandOverrides = ISLAND_OVERRIDES
    regions: list[RegionSpec] = Field(
        default_factory=list,
        max_length=64,
        description="Multi-region, read by the syncer's cluster: the other clusters' island "
        "counts by namePrefix, each one's quota of the totalShards - count records the other "
        "regions share (at most that many in all; a region not listed is not admitted). "
        "Empty: those records are split max-min fair among the regions that ask.",
    )

    @model_validator(mode="after")
    def _regions(self) -> IslandsSpec:
        if not self.regions:
            return self
        prefixes = [r.name_prefix for r in self.regions]
        if self.name_prefix in prefixes:
            raise ValueError(
                f"islands.regions names this cluster's own prefix {self.name_prefix!r}: it "
                "lists the other clusters only (their namePrefix)"
            )
        if len(set(prefixes)) != len(prefixes):
            raise ValueError(f"islands.regions names a prefix twice: {prefixes}")
        others = self.other_regions_records()
        listed = sum(r.count for r in self.regions)
        if listed > others:
            raise ValueError(
                f"islands.regions counts {listed} islands in all, more than the other regions "
                f"have: totalShards - count = {others} (totalShards 0: shardOffset)"
            )
        return self

    def other_regions_records(self) -> int:
        """R: the island records of the other clusters of the job (total shards - count)."""
        total = self.total_shards or (self.shard_offset + self.count)
        return max(0, total - self.count)


class StopAfterSpec(SpecModel):
    """When the job is done (whichever comes first; neither means run forever)."""

    outer_steps: int | None = Field(
        None,
        ge=1,
        description="Stop after this many outer steps: rounds of work, one per islands x "
        "inner.steps inner steps merged into every fragment (whatever the quorum; with every "
        "island in every merge, the number of merges). With every island in every merge each "
        "trains outerSteps x inner.steps steps, and the job ends once all of that is merged, "
        "where the count stands one short too (a syncer restart from an older checkpoint: the "
        "merge that made up the lost round counts as one; one syncer, not syncer.shards).",
    )
    tokens: int | None = Field(
        None,
        ge=1,
        le=MAX_STOP_TOKENS,
        description="Stop at the first merge after which this many tokens are merged (the mean "
        "over fragments of the tokens each merged). Islands process more than that: the steps "
        "taken while the last merges and the final evaluation run, up to half a round plus "
        "sync.overlapSteps steps each.",
    )

    @field_validator("tokens", mode="before")
    @classmethod
    def _tokens_in_range(cls, value: Any) -> Any:
        """1e25 or 1e300 written as a number (or as YAML's string 1e25) is refused with the
        range, not with pydantic's integer-parsing message."""
        if isinstance(value, bool) or value is None:
            return value
        if isinstance(value, int):
            number: float = value  # pydantic refuses one below 1
        else:
            try:
                number = float(value)
            except (TypeError, ValueError):
                return value  # pydantic names the type
        if not math.isfinite(number) or number > MAX_STOP_TOKENS:
            raise ValueError(
                f"{value:g} is out of range: a whole number of tokens from 1 to 1e18 expected"
                if isinstance(value, (int, float))
                else f"{value} is out of range: a whole number of tokens from 1 to 1e18 expected"
            )
        if isinstance(value, int):
            return value
        if number != int(number):
            raise ValueError(f"{value} is not a whole number of tokens")
        return int(number)


class CheckpointSpec(SpecModel):
    """Syncer checkpoints: global weights, outer optimizer state and versions."""

    claim_name: str | None = Field(
        None, description="PersistentVolumeClaim for checkpoints (emptyDir when unset)."
    )
    every_outer_steps: int = Field(5, ge=1, description="Checkpoint every N outer steps.")
    keep: int = Field(2, ge=1, le=100, description="Checkpoints kept on disk.")
    allow_fresh_start_on_corrupt: bool = Field(
        False,
        description="With checkpoints on disk and none of them valid, start the job afresh (the "
        "corrupt ones are moved aside) instead of refusing to start.",
    )


class GuardsSpec(SpecModel):
    """Checks every pushed pseudo-gradient passes before it can touch the global model."""

    max_delta_norm: Annotated[float, Field(gt=0)] | Literal["auto"] = Field(
        "auto",
        description="Hard cap on a pushed pseudo-gradient's L2 norm (per fragment); 'auto': what "
        "AdamW can move the fragment in one round at most (4 x inner.lr per step and element).",
    )
    norm_factor: float = Field(
        10,
        ge=1,
        le=1e6,
        description="After warmupPushes accepted pushes of a fragment, a push whose norm is more "
        "than this many times the median of the fragment's recent accepted norms is refused.",
    )
    warmup_pushes: int = Field(
        8, ge=1, le=100000, description="Accepted pushes per fragment before normFactor applies."
    )
    max_refusals: int = Field(
        5,
        ge=0,
        le=100000,
        description="An island whose pushes are refused this many times in a row is dropped "
        "(with the reason); 0 never drops.",
    )
    remote_island_replicas: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="Replicas an island of another cluster (multi-region) may report; unset: "
        "islands.replicas.",
    )
    movement_factor: float = Field(
        1.5,
        ge=0,
        le=1000,
        description="In a job of fewer than three islands (no majority to learn a bound from), "
        "each merge's pseudo-gradient per round of work is clipped (shortened, its direction "
        "kept) to this many times the most one honest round of AdamW moves the fragment: "
        "inner.lr x inner.steps x sqrt(numel) / (1 - sync.mixAlpha). No island's word moves "
        "it, so a bad island of two moves the model per round of claimed work by at most that. "
        "An honest push of any length is within it: a step of the inner AdamW (betas 0.9, "
        "0.95) moves an element by at most about 1.17 x lr (docs/adversaries.md). Each merge "
        "record says the norm and the clip (movement, clip). With it on, a job of two also "
        "refuses a push whose pseudo-gradient moved less than 1/32 of the other island's "
        "movement per claimed step (work_unsupported: claimed work it does not carry; "
        "docs/algorithm.md). 0 turns both off.",
    )
    pair_clip: float = Field(
        0.0,
        ge=0,
        le=1000,
        description="In a job of two with movementFactor on: a push whose pseudo-gradient's norm "
        "is above this many times what the other island moves in the steps it claims (the "
        "other's recent median norm per claimed step x those steps, at most one round: H_i + "
        "sync.overlapSteps) is shortened to that (its direction kept) in its merge, so no push "
        "moves the model further than this many times an honest round of the other island does, "
        "whatever work it claims (issue 46's loud claims). 0 (default) turns it off: it also "
        "holds an honest island to its peer's movement (docs/algorithm.md, \"A job of two's "
        'pair clip").',
    )
    pair_credit: bool = Field(
        False,
        description="In a job of two with movementFactor on: a push's merge credits at most one "
        "round of its island's own steps (H_i + sync.overlapSteps, as the syncer sizes its "
        "rounds) as work, whatever it claims; its pseudo-gradient still moves the model in "
        "full (lr x its delta / 2), but the share of a round its merge counts, and so the outer "
        "momentum folds it triggers, is that round's at most (issue 46's loud claims: a push "
        "claiming 4 rounds folded the momentum twice). Where stop targets split the budget "
        "(K < M, or rounds that differ) it spends that round's tokens of stopAfter.tokens "
        "(tokens x credited / claimed steps), not its claim's; the rest its learner trains "
        "again. A legitimate push of several rounds (after refusals, a syncer restart) is "
        "credited one too. Off by default (docs/algorithm.md, "
        '"A job of two\'s pair credit").',
    )
    end_on_faint: bool = Field(
        False,
        description="In a job of two with movementFactor on and the quality guard on: end the "
        "job at its best-evaluated checkpoint (health problem faintIslandEnded) once an island's "
        "last 8 pushes to a fragment all moved less than 1/4 of the other island's movement per "
        "claimed step and some of them were merged (faint noise claiming work, which a job of "
        "two cannot bound). Off by default: an honest island much faster than the other under "
        "a cosine schedule, further down it, is named so too (bench/studies/faint_naming.py), "
        "and this would end its job; turn it on for islands of one pace.",
    )


class QualityGuardSpec(SpecModel):
    """The syncer's check of its own evaluations: a model whose eval loss keeps rising above the
    best it reached ends the job (syncer/state/quality.py; issue 46: one bad island of two)."""

    margin: float = Field(
        0.25,
        gt=0,
        le=10,
        description="An evaluation counts as a rise when its eval loss is above (1 + margin) x "
        "the best eval loss before it (0.25: 25%). It must sit above the job's honest swings: "
        "small noisy jobs (gpt-tiny, 64 tokens a step, outer momentum 0.9) swung up to 20% "
        "above their best mid-run, above 10% for 6 evaluations in a row; a bad island that "
        "holds the loss under the margin is not detected.",
    )
    patience: int = Field(
        5,
        ge=0,
        le=100000,
        description="After this many evaluations in a row that are rises, the syncer stops "
        "merging and ends the job (finished, the health problem evalLossRose, its final "
        "checkpoint the best-evaluated one); 0 turns the guard off. While on, an evaluation that "
        "is the best so far writes a checkpoint (kept beside syncer.checkpoint.keep's).",
    )

    warmup_outer_steps: int = Field(
        20,
        ge=0,
        le=1_000_000,
        description="Evaluations at outer steps up to this one are never rises (they still set "
        "the best, and a new best is checkpointed): early honest training overshoots under the "
        "outer Nesterov momentum (0.9 carries about 1 / (1 - 0.9) = 10 outer steps; a tiny "
        "honest job rose 13% over its best for 3 evaluations at outer steps 8-10), and the "
        "final checkpoint of a trip is the best one whenever it came, so waiting costs compute, "
        "not the model.",
    )

    @property
    def enabled(self) -> bool:
        return self.patience > 0


class LimitsSpec(SpecModel):
    """What the syncer's HTTP server allows any client."""

    header_timeout_seconds: float = Field(
        30,
        gt=0,
        le=3600,
        description="A request's headers must arrive within this many seconds of the connection "
        "opening or its previous request ending (idle keep-alive connections close then).",
    )
    body_timeout_seconds: float = Field(
        600,
        gt=0,
        le=86400,
        description="A request body must arrive within this many seconds in all, and with no "
        "pause longer than headerTimeoutSeconds.",
    )
    max_connections: int = Field(
        512, ge=1, le=1_000_000, description="Open connections; more are answered 503 and closed."
    )
    max_concurrent_pushes: Annotated[int, Field(ge=1, le=100000)] | Literal["auto"] = Field(
        "auto",
        description="Push bodies read at once (each up to a fragment's encoded size); more are "
        "answered 503 with Retry-After. 'auto': 2 x the job's islands + 2.",
    )
    min_body_bytes_per_second: int = Field(
        4 * 2**20,
        ge=1024,
        le=2**40,
        description="The slowest transfer a body is given time for: a push body of n bytes may "
        "take n / this many seconds when that is longer than bodyTimeoutSeconds, so the time "
        "allowed follows the model's size (a 1B-parameter fragment's int8 push is ~0.5 GB). "
        "Lower it for slow links between islands and the syncer.",
    )


# One URL of syncer.shardEndpoints.
ShardEndpoint = Annotated[
    str,
    Field(
        min_length=1,
        pattern=ENDPOINT_PATTERN,
        description="A syncer shard's URL: scheme://host[:port] only.",
    ),
]


class SyncerSpec(SpecModel):
    """The syncer: a CPU service that merges pseudo-gradients."""

    endpoint: str = Field(
        "",
        pattern=ENDPOINT_PATTERN,
        description="URL of a syncer run elsewhere (another cluster): scheme://host[:port] only. "
        "When set, this job runs only its islands. https:// unless on loopback or a cluster "
        "Service name (or with tls.allowInsecureEndpoint).",
    )
    port: int = Field(
        8470,
        ge=1,
        le=65535,
        description="Syncer HTTP port. In a pod the kubelet's probes (/healthz, /readyz) go to "
        "the next port (the one before for 65535), served apart from this one's traffic.",
    )
    resources: dict[str, Any] = Field(
        default_factory=dict, description="Kubernetes resource requirements for the syncer."
    )
    template: dict[str, Any] = Field(
        default_factory=dict,
        description="A PodTemplateSpec fragment merged into the syncer pod, like "
        "islands.template (the container is named 'syncer').",
    )
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    service: ServiceSpec = Field(default_factory=ServiceSpec)
    tls: TLSSpec = Field(default_factory=TLSSpec)
    token_secret_name: str | None = Field(
        None,
        description="Secret with key 'token': the job's root token (generated when unset), or "
        "in another cluster of a multi-region job that cluster's region credential.",
    )
    eval_every_outer_steps: int = Field(
        1, ge=1, description="Evaluate the global weights every N outer steps."
    )
    guards: GuardsSpec = Field(default_factory=GuardsSpec)
    quality_guard: QualityGuardSpec = Field(default_factory=QualityGuardSpec)
    limits: LimitsSpec = Field(default_factory=LimitsSpec)
    shards: int = Field(
        1,
        ge=1,
        le=256,
        description="Syncer processes (pods), each owning a disjoint set of fragments: fragment "
        "f belongs to shard f mod shards (at most sync.fragments). Learners push and pull each "
        "fragment at its shard and join every shard; a shard restarted from its checkpoint "
        "loses at most its checkpoint cadence while the others go on merging (docs/shards.md).",
    )
    shard_endpoints: list[ShardEndpoint] = Field(
        default_factory=list,
        max_length=256,
        description="URLs of a sharded syncer run elsewhere (another cluster), one per "
        "syncer.shards in shard order, instead of syncer.endpoint: this job then runs only its "
        "islands, which route each fragment to its shard. Each URL follows syncer.endpoint's "
        "rules.",
    )

    @property
    def remote(self) -> bool:
        """Whether the job's syncer runs elsewhere (syncer.endpoint or syncer.shardEndpoints)."""
        return bool(self.endpoint or self.shard_endpoints)

    @model_validator(mode="after")
    def _exposure(self) -> SyncerSpec:
        problem = exposure_problem(self.endpoint, self.service.type, self.tls)
        if problem:
            raise ValueError(problem)
        for i, url in enumerate(self.shard_endpoints):
            problem = exposure_problem(url, self.service.type, self.tls)
            if problem:
                raise ValueError(problem.replace("syncer.endpoint", f"syncer.shardEndpoints[{i}]"))
        return self


class JobSpec(SpecModel):
    """The spec of a DiLoCoJob."""

    image: str | None = Field(None, description="Trainer container image (required in a cluster).")
    model: ModelSpec = Field(default_factory=ModelSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    islands: IslandsSpec = Field(default_factory=IslandsSpec)
    inner: InnerSpec = Field(default_factory=InnerSpec)
    outer: OuterSpec = Field(default_factory=OuterSpec)
    sync: SyncSpec = Field(default_factory=SyncSpec)
    stop_after: StopAfterSpec = Field(default_factory=StopAfterSpec)
    syncer: SyncerSpec = Field(default_factory=SyncerSpec)
    network_policy: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec)
    suspend: bool = Field(False, description="Scale islands to zero; the syncer keeps its state.")
    ttl_seconds_after_finished: int | None = Field(
        None, ge=0, description="Delete the job this long after it succeeds or fails."
    )

    @model_validator(mode="after")
    def _cross_field(self) -> JobSpec:
        if self.sync.overlap_steps is None:
            self.sync.overlap_steps = default_overlap_steps(self.inner.steps)
        # The syncer's quorum counts every cluster's islands: with totalShards set (multi-region)
        # the job may expect more islands than this cluster runs.
        limit = max(self.islands.count, self.islands.total_shards)
        if self.sync.quorum > limit and not self.syncer.remote:
            raise ValueError(
                f"sync.quorum ({self.sync.quorum}) must be <= islands.count "
                f"({self.islands.count}) or islands.totalShards ({self.islands.total_shards})"
            )
        if self.syncer.shards > self.sync.fragments:
            raise ValueError(
                f"syncer.shards ({self.syncer.shards}) must be <= sync.fragments "
                f"({self.sync.fragments}): every shard owns at least one fragment"
            )
        if self.syncer.shards > 1 and self.syncer.endpoint:
            raise ValueError(
                "syncer.shards must be 1 with syncer.endpoint set: name a sharded syncer run "
                "elsewhere by syncer.shardEndpoints, one URL per shard"
            )
        ends = self.syncer.shard_endpoints
        if ends and (self.syncer.endpoint or len(ends) != self.syncer.shards):
            raise ValueError(
                f"syncer.shardEndpoints lists {len(ends)} URL(s): it needs one per syncer.shards "
                f"({self.syncer.shards}) and syncer.endpoint unset"
            )
        return self

    def total_shards(self) -> int:
        """Data shards across the whole job (all clusters)."""
        return self.islands.total_shards or (self.islands.shard_offset + self.islands.count)

    def staleness_bound(self) -> int:
        """sync.maxStaleness, 'auto' resolved: STALE_VERSIONS_PER_ISLAND x the job's islands."""
        if self.sync.max_staleness == "auto":
            return STALE_VERSIONS_PER_ISLAND * self.total_shards()
        return self.sync.max_staleness

    def to_json(self) -> str:
        """The camelCase JSON the pods receive."""
        return json.dumps(self.model_dump(by_alias=True, mode="json"), sort_keys=True)


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the field."""


# Pydantic names the member of a union it tried ("float", "literal['auto']"); users know only
# the field, so those tags are dropped from locations.
_UNION_TAGS = frozenset({"float", "int", "str", "bool", "dict", "list", "none"})


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and (
        "[" in part or part in _UNION_TAGS or part.startswith("constrained-")
    )


def format_validation_error(err: ValidationError, prefix: str = "spec") -> str:
    """One line per bad field, each naming it in manifest (camelCase) form."""
    problems: dict[str, list[str]] = {}
    for e in err.errors():
        parts = [to_camel(str(p)) for p in e["loc"] if not _is_union_tag(p)]
        loc = ".".join([prefix, *parts])
        msgs = problems.setdefault(loc, [])
        msg = e["msg"].removeprefix("Value error, ")
        if msg not in msgs:
            msgs.append(msg)
    return "\n".join(f"{loc}: {'; or '.join(msgs)}" for loc, msgs in problems.items())


def parse_spec(data: dict[str, Any]) -> JobSpec:
    """Validate a spec dict, raising ConfigError with every bad field named."""
    try:
        return JobSpec.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None


def load_spec(path: str | Path) -> JobSpec:
    """Load a JobSpec from YAML or JSON: either a whole DiLoCoJob manifest or a bare spec."""
    path = Path(path)
    try:  # read from the file, so pyyaml's marks name it (not "<unicode string>") and a
        with path.open("rb") as stream:  # non-UTF-8 file is a YAMLError, not a traceback
            doc = yaml.safe_load(stream)
    except OSError as err:
        raise ConfigError(f"cannot read config {path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}") from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a mapping, got {type(doc).__name__}")
    if doc.get("kind") == "DiLoCoJob":
        doc = doc.get("spec") or {}
    return parse_spec(doc)
