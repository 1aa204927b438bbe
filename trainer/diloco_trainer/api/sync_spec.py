"""The `sync` section of the spec: how and when islands exchange pseudo-gradients (re-exported
by api/spec.py, whose JobSpec holds it). It imports no torch, like the rest of the spec."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from diloco_trainer.api.base import SpecModel

Codec = Literal["none", "fp16", "bf16", "int8", "int4"]
PullCompression = Literal["auto", "none", "fp16", "bf16", "int8", "int4"]
MergeRule = Literal["tokens", "mean", "rda"]
MergeWait = Literal["overlap", "nextPush"]  # core/grace.MERGE_WAITS
ApplyFrom = Literal["overlap", "arrival"]  # learner/step_plan.APPLY_FROMS
OverlapMode = Literal["auto", "fixed"]  # learner/overlap.OVERLAP_MODES
LateMergeRule = Literal["keep", "eager"]  # learner/mixing.LATE_MERGE_RULES
LateMergeHold = Literal["auto", "off"]  # learner/step_plan.LATE_MERGE_HOLDS
OverlapCovers = Literal["sync", "merge"]  # learner/overlap.OVERLAP_COVERS


def default_overlap_steps(inner_steps: int) -> int:
    """τ when sync.overlapSteps is unset: 5 steps (Streaming DiLoCo: about free), at most a
    quarter of a round so a short H still leaves most of the round between apply and next push."""
    return min(5, inner_steps // 4)


class SyncSpec(SpecModel):
    """How and when islands exchange pseudo-gradients."""

    quorum: int = Field(
        1, ge=1, le=512, description="K: islands whose pseudo-gradients open a merge."
    )
    grace_seconds: float | Literal["auto"] = Field(
        "auto",
        description="After the quorum, wait this long for more islands; 'auto' derives it from "
        "measured step and sync times (Decoupled DiLoCo).",
    )
    fragments: int = Field(
        2,
        ge=1,
        le=256,
        description="F: parameter fragments synced at staggered steps (streaming; a model with a "
        "single tensor needs 1).",
    )
    overlap_steps: int | None = Field(
        None,
        ge=0,
        le=10000,
        description="τ: inner steps that run while a sync is in flight; the steps are kept when "
        "the merged fragment arrives. Unset: min(5, inner.steps // 4). The τ of "
        "sync.overlapMode fixed and of a decoupled learner (K < M); with auto, a learner that "
        "blocks for its merge fits τ up to inner.steps - 1 (or this, if larger; 0 is no "
        "overlap in every mode).",
    )
    overlap_mode: OverlapMode = Field(
        "auto",
        description="auto: a learner that blocks for its merge (K = M) overlaps each push with "
        "the fewest steps that hide its measured sync latency (its push, the syncer's merge, its "
        "pull) up to a wait of 1% of a round, at most inner.steps - 1 or overlapSteps if larger "
        "(one step until a sync is measured); a decoupled one (K < M), which never waits, is "
        "fitted the same way up to overlapSteps (from there it applies a merge that has "
        "arrived). fixed: always overlapSteps. docs/learner.md prices both.",
    )
    overlap_covers: OverlapCovers = Field(
        "sync",
        description="What sync.overlapMode auto fits a blocking learner's overlap to. sync: its "
        "own measured sync latency (its push, the syncer's merge, its pull), without the wait "
        "for its peers' pushes. merge: the whole time from its push to the merged fragment, "
        "that wait included (over a link the islands share, mostly the link carrying the other "
        "pushes). docs/learner.md prices both.",
    )
    merge_wait: MergeWait = Field(
        "overlap",
        description="When a learner that blocks for its merge (K = M, or overlapSteps 0) waits "
        "for a merge that is late. overlap: overlapSteps steps after the push. nextPush: only "
        "at the last step before the fragment is due again (inner.steps - 1 steps after the "
        "push), training on and checking every step until then; a merge on time is applied "
        "after overlapSteps steps under both, a late one keeps up to inner.steps - 1 local steps "
        "on top of it. Opt-in: docs/learner.md prices it.",
    )
    apply_from: ApplyFrom = Field(
        "overlap",
        description="From when a learner applies the merge of its push. overlap: from "
        "overlapSteps steps after the push (a merge back sooner waits until then, and those "
        "local steps are kept on top of it). arrival: from the step after the push, as soon as "
        "it has arrived; overlapSteps is then only how many steps a learner that blocks for its "
        "merge (K = M, with sync.mergeWait overlap) trains on before it waits, so a merge back "
        "in 1-2 steps keeps only those. Opt-in: docs/learner.md prices it.",
    )
    late_merge_rule: LateMergeRule = Field(
        "keep",
        description="Where a learner trains from while its push is merged. keep: on from its "
        "own weights at the push; the merge installs θ_global + (θ_now − θ_push). eager: right "
        "after the push it moves the fragment to its guess of the merge, θ_proxy = θ_base − "
        "(lr·(1+β)·Δ/w + β²·u), from its own per-round Δ/w and the last update u it received "
        "(sync outer lr and momentum; lr·Δ/w + β·u without Nesterov), and the merge installs "
        "θ_global + (θ_now − θ_proxy), so the steps it keeps were taken near the merged weights. "
        "Not with islands.parallelism fsdp (keep). docs/algorithm.md derives and prices it.",
    )
    late_merge_hold: LateMergeHold = Field(
        "auto",
        description="A learner that does not block for its merge (quorum below the islands, "
        "overlapSteps > 0): auto: once a push is B steps old (never before its overlapSteps) "
        "and its merge not installed, it holds its inner steps until it is (at most the wait "
        "budget a blocking learner's merge wait has, then it trains on). B is ceil(H_i / 2) "
        "where its recent syncs say the link cannot carry its traffic (fragments x their mean "
        "latency above its round's time), so at most half a round is kept on top of a merge; "
        "else H_i - 1, the step before the fragment's next push. off: it never holds for a "
        "merge, however late (only at the step cap). docs/algorithm.md prices it.",
    )
    compression: Codec = Field("int8", description="Codec for pseudo-gradients on the wire.")
    pull_compression: PullCompression = Field(
        "auto",
        description="Codec for the global weights learners pull. 'none': every pull sends the "
        "fragment's full fp32 weights. A codec: a learner gets the encoded weight updates since "
        "the version it holds instead, when the syncer still keeps them and they are smaller "
        "(what the codec drops is carried into the next update; a checksum guards each chain). "
        "'auto': the same as sync.compression.",
    )
    merge: MergeRule = Field(
        "tokens",
        description="tokens: weighted by tokens x tokens-per-step; mean: plain mean; rda: "
        "radial-directional averaging with token weights.",
    )
    max_staleness: Annotated[int, Field(ge=0, le=1000)] | Literal["auto"] = Field(
        "auto",
        description="A pseudo-gradient based on a version more than this many versions old is "
        "refused (the learner pulls and goes on); 'auto': 4 x the job's islands, about four "
        "rounds of work at quorum 1. Every fresher one is merged; staleness beyond one round of "
        "work is discounted by (1 + excess rounds)^-1/2, and a stale one feeds the outer "
        "momentum only (1 + lag in rounds)^-2 of its pseudo-gradient (docs/algorithm.md).",
    )
    mix_alpha: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="On receiving a fragment: θ = α·θ_local + (1-α)·θ_global (0 overwrites).",
    )
    error_feedback: bool = Field(
        False, description="Carry each island's quantisation error into its next push."
    )
    scale_partial_merges: bool = Field(
        True,
        description="Deprecated, ignored (kept so older manifests validate): every merge moves "
        "the model by the share of a round of work it carries and the outer momentum is folded "
        "once per round of work (Delayed Nesterov), whatever the quorum.",
    )
    heartbeat_timeout_seconds: float = Field(
        30,
        gt=0,
        le=3600,
        description="An island silent this long leaves the quorum. Also the longest a fresh "
        "job's islands wait for each other before their first step when learners do not "
        "block (quorum < islands): they start together so their pushes meet in one merge.",
    )

    @property
    def effective_pull_compression(self) -> str:
        """The codec of pulled weight updates ('auto' resolved to sync.compression)."""
        return self.compression if self.pull_compression == "auto" else self.pull_compression

    @model_validator(mode="after")
    def _grace_non_negative(self) -> SyncSpec:
        if self.grace_seconds != "auto" and float(self.grace_seconds) < 0:
            raise ValueError("sync.graceSeconds must be 'auto' or a number >= 0")
        return self
