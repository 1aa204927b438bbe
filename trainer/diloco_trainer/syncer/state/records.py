"""The syncer's records: island membership states, the round policy, what it knows of each
island, pending contributions and open rounds (plain data; the transitions are membership.py,
the round state machine rounds.py).

Membership. States: active, dropped (by the admin route; stays dropped until re-added), timedOut
(no heartbeat, join or push for heartbeatTimeoutSeconds; active again on its next sign of life),
left (said goodbye; active again when it joins). Only islands that have joined count as active:
the admin route may pre-register an island, but it joins the quorum when it first joins.

Awaited islands. Islands of the job that have not joined yet and were not dropped (expect():
count minus the records that joined or were dropped) hold the quorum, not the grace window, until
they join or are dropped, however long their processes take to start: the operator drops islands
whose pods fail, `diloco run` islands whose processes all exited. Only if nobody says anything
are they given up on, islands.startupTimeoutSeconds after the syncer's start (a safety net, not a
start-up budget: the heartbeat timeout is for islands that went silent, not for slow starts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from diloco_trainer.api.documents import IslandStatus
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.core.fragments import fragment_offsets
from diloco_trainer.core.grace import blocks_for_merge
from diloco_trainer.core.island_rounds import IslandRound

ACTIVE = "active"
DROPPED = "dropped"
TIMED_OUT = "timedOut"
LEFT = "left"


@dataclass(frozen=True)
class Beat:
    """One heartbeat: what it reports of an island's training, as the route checked it (http.py):
    handed down unchanged to the membership (service.py -> membership_routes.py)."""

    step: int = 0
    tokens: int = 0
    loss: float | None = None
    step_time: float | None = None
    holding: bool = False  # held at the step cap or draining (learner/fragment_sync.py, drain.py)
    drained: bool = False  # its share done and merged, nothing more to push (learner/drain.py)
    # The share of its wall time since its previous heartbeat blocked on the syncer (0..1;
    # None: not said, an older learner): learner/step_costs.WaitMeter.
    waiting: float | None = None


@dataclass(frozen=True)
class RoundPolicy:
    """The sync settings the state machine needs (from JobSpec.sync)."""

    quorum: int
    max_staleness: int
    heartbeat_timeout: float
    grace_seconds: float | None  # None means "auto"
    # How long islands that never joined (and were not dropped) hold the quorum; see above.
    startup_timeout: float = 600.0
    overlap_steps: int = 0
    # The learners' schedule (H and each fragment's sync offset), for predicting when a missing
    # island will push; inner_steps 0 turns the prediction off.
    inner_steps: int = 0
    offsets: tuple[int, ...] = ()
    # Whether the learners block for their merge (core/grace.blocks_for_merge): if not, a push may
    # be in flight for H steps at no cost, and the auto grace window is sized from that.
    learners_block: bool = True
    # Fold a round of every island in island order, not arrival order (SyncState.fold_order):
    # for jobs whose learners apply each merge at a fixed step (merges_applied_at_fixed_steps),
    # the only ones a seed can repeat; the others keep the shorter merge path.
    ordered_folds: bool = False


@dataclass(frozen=True)
class AheadRefusal:
    """A push refused as ahead of the syncer (409 `ahead`), its tokens not counted yet
    (IslandRecord.ahead_refused)."""

    base: int  # its baseVersion
    tokens: float  # its tokens as refused_tokens counts them (capped, averaged over fragments)


def ahead_carried(refused: AheadRefusal, base_version: int) -> bool:
    """Whether the island's next push to the fragment, on `base_version`, carries the steps of
    its push `refused` as ahead, whose tokens are then not refused (they merge with it).

    A learner's version of a fragment only goes forward, but for a base a restart lost, which
    it counts as the syncer's older version, keeping every step since that base (the push made
    again: learner/syncer_restart.resend_version, rule 2, and the merges made up, rule 3); a
    push on a version at or past the refused base came after a receipt at or past it, which
    kept only the steps since the refused push (FragmentState.receive): its steps were
    dropped, never to merge (docs/algorithm.md, "A syncer restart")."""
    return base_version < refused.base


@dataclass(frozen=True)
class MergedPush:
    """An island's latest merged push to a fragment since its last join
    (IslandRecord.merged_pushes)."""

    base: int  # its baseVersion
    tokens: float  # its merged tokens, averaged over fragments as merged_tokens counts them


def carried_again(merged: MergedPush | None, base_version: int) -> float:
    """The tokens (averaged over fragments) of the island's merged push `merged` that its push
    on `base_version` to the same fragment carries again: all of them when it is on the same
    base, else none.

    A learner's base moves only when it receives a merge, and it keeps every step since its
    base until then; so a push on the base of one of its pushes that merged is one whose merge
    it never received, pushed again with every step since that base (the overdue push made
    again: learner/fragment_sync.py). Seen across a syncer restart (adv17's e2e test under
    load, 4 failing runs): the old run merged the push and checkpointed it at its stop, the
    learner's pull for that merge outlasted its hold while the syncer was down, and it pushed
    the fragment again, 12 steps on the base of the 6 merged. Accepted, those 6 steps merged
    twice; refused as too stale, all 12 were counted as refused (never merged) though 6 were.
    Either way the island's part of the budget (targets.Pace.base) was 6 steps short of its
    merged work, its target 6 steps long, and the job ended 192 tokens past its budget."""
    if merged is None or base_version != merged.base:
        return 0.0
    return merged.tokens


@dataclass
class IslandRecord:
    """What the syncer knows about one island (also persisted in checkpoints)."""

    name: str
    state: str = ACTIVE
    reason: str = ""
    joins: int = 0
    replicas: int = 0
    last_seen: float = 0.0
    last_push: float | None = None
    pushes: int = 0
    tokens: int = 0  # tokens the island reports having consumed in all (heartbeats)
    merged_tokens: float = 0.0  # its merged tokens, averaged over fragments (see take_round)
    loss: float | None = None
    step: int = 0
    step_time: float | None = None
    # Its learner holds at the step cap or drains (pushing nothing until a merge), as its latest
    # heartbeat said (not persisted: a restarted syncer hears it again with the next heartbeat).
    holding: bool = False
    # Its learner has done its share of the job's budget and every push of it was merged: it
    # pushes nothing more (learner/drain.py). Not persisted, as `holding`.
    drained: bool = False
    # The share of its learner's wall time blocked on the syncer, as its latest heartbeat said
    # (None: that heartbeat did not say). Not persisted, as `holding`.
    waiting: float | None = None
    sync_time: float | None = None
    # Its latest net sync time (reported sync time minus what the syncer held the push; see
    # core/grace.py), not persisted.
    transfer_time: float | None = None
    # The latest progress report and when it came (not persisted: a restarted syncer waits for
    # the next heartbeat before it predicts anything).
    reported_step: int | None = None
    reported_at: float | None = None
    # Its pace for the stop targets (targets.py): the tokens its learner counts (the latest
    # heartbeat's), the merged tokens it had at its last join (where that count starts:
    # persisted, checkpoints' `counts`, as its learner keeps counting from there across a
    # syncer restart), and its first report since (tokens, time; not persisted).
    reported_tokens: int | None = None
    count_base: float = 0.0
    first_report: tuple[int, float] | None = None
    # The tokens of its pushes refused since its last join, averaged over fragments as
    # merged_tokens is (each at most a capped push's): its learner does not train them again,
    # so its count runs ahead of its merged tokens by them for good (targets.CountBound; out of
    # its part of what is done, targets.Pace.base).
    # Persisted with count_base (the count it explains goes on across a restart). Also the
    # tokens of its merged pushes beyond their credited round (syncer.guards.pairCredit: the
    # budget counts a round's, core/contributions.credited_tokens): counted, not merged.
    refused_tokens: float = 0.0
    # Per fragment, its latest push refused as ahead (409 `ahead`: its base a merge a syncer
    # restart lost) whose tokens are not counted in refused_tokens yet: its learner pushes it
    # again with every step since the base (learner/syncer_restart.resend_version), which is
    # then merged, unless the syncer merged past the base meanwhile. Its next push to the
    # fragment says which (ahead_carried). Not persisted (a restart loses the pending count).
    ahead_refused: dict[int, AheadRefusal] = field(default_factory=dict)
    # Per fragment, its latest merged push since its last join (carried_again: a push on the
    # same base carries its steps again). Persisted with count_base (SavedCount.merged): the
    # push made again may reach the restarted syncer.
    merged_pushes: dict[int, MergedPush] = field(default_factory=dict)
    # Its merged tokens in the checkpoint this syncer run resumed from, until its first join in
    # this run (Membership.join's keeps_count: the base of a join the checkpoint lacks). Not
    # persisted: set by Membership.restore.
    restored_merged: float | None = None
    # Its refused tokens in that checkpoint (SavedCount.refused), until that join: those this
    # run counted since are of its learner's count, which that join keeps. Not persisted.
    restored_refused: float = 0.0
    # Since when the syncer waits for that pace: its first join, or the restore of its record by
    # a restarted syncer (targets.split_among: past a bound, an island without one is left out
    # of the split; a rejoin does not restart the wait). Not persisted.
    pace_since: float | None = None
    # Its round (H_i, inner.stepsPerIsland: round_sizes.py), the H_i before its last change (its
    # learner may run it until its next round boundary) and when its step time was last read.
    # H_i is persisted (innerSteps), the rest not: a restarted syncer reads afresh.
    round: IslandRound | None = None
    round_before: int | None = None
    round_read_at: float | None = None
    # Since when its reported step has been what it is (a peer idle since another island's
    # join: core/island_rounds.aged_past_join), and, for its own first reports, when it last
    # joined and its peers' reported steps then (None: judged against every peer), not persisted.
    reported_since: float | None = None
    joined_at: float | None = None
    peer_marks: dict[str, int | None] | None = None

    def to_status(self) -> IslandStatus:
        """The status/checkpoint form (IslandStatus: camelCase on the wire)."""
        return IslandStatus(
            state=self.state,
            reason=self.reason,
            joins=self.joins,
            replicas=self.replicas,
            last_seen=self.last_seen,
            last_push=self.last_push,
            pushes=self.pushes,
            tokens=self.tokens,
            merged_tokens=round(self.merged_tokens),
            loss=self.loss,
            step=self.step,
            step_time=self.step_time,
            holding=self.holding,
            drained=self.drained,
            waiting=self.waiting,
            inner_steps=self.round.steps if self.round is not None else None,
        )

    @classmethod
    def from_status(cls, name: str, doc: IslandStatus) -> IslandRecord:
        """The record saved by to_status() (a checkpoint's `islands`)."""
        return cls(
            name=name,
            state=doc.state,
            reason=doc.reason,
            joins=doc.joins,
            replicas=doc.replicas,
            last_seen=doc.last_seen,
            last_push=doc.last_push,
            pushes=doc.pushes,
            tokens=doc.tokens,
            merged_tokens=float(doc.merged_tokens),
            loss=doc.loss,
            step=doc.step,
            step_time=doc.step_time,
            round=IslandRound(doc.inner_steps) if doc.inner_steps else None,
        )


@dataclass
class Contribution:
    """One island's pending pseudo-gradient for one fragment."""

    island: str
    base_version: int
    lag: int
    tokens: int
    steps: int
    loss: float | None
    received_at: float
    push_id: str = ""
    step_time: float | None = None
    sync_time: float | None = None
    # Of its steps, those trained before its base was installed (PushMeta.kept_steps): recorded
    # in the merge log, counted by no rule (docs/algorithm.md, "A push's kept steps are
    # recorded").
    kept_steps: int = 0
    # What its Δ is multiplied by in its merge (syncer.guards.pairClip in a job of two: held to
    # what the other island moves in its claimed steps; intake/guards.pair_clip); 1: as pushed.
    clip: float = 1.0
    # The most of its steps its merge credits as work (syncer.guards.pairCredit in a job of two:
    # one round of its own, H_i + sync.overlapSteps; intake/guards.pair_credit); None: all.
    credit_steps: int | None = None
    # The most of its steps the budget counts the tokens of (core/contributions.credited_tokens):
    # credit_steps where stop targets give an island its uncredited tokens back (K < M, or
    # K = M once rounds differ), None on K = M's 1/M shares (intake/gate.judge_push says why).
    budget_steps: int | None = None
    # Its pseudo-gradient as a name -> tensor mapping (opaque here): the syncer keeps it encoded
    # (payload.EncodedPayload) and folds the decoded values into the round as it arrives.
    payload: Any = field(default=None, repr=False)


@dataclass
class FragmentRound:
    """The open round of one fragment."""

    version: int = 0
    rounds: int = 0  # rounds of work merged into the fragment (outer-optimizer folds)
    pending: dict[str, Contribution] = field(default_factory=dict)
    first_push_at: float | None = None
    quorum_since: float | None = None


def merges_applied_at_fixed_steps(spec: JobSpec) -> bool:
    """Whether every learner applies each merge at a step its schedule fixes, whenever the merge
    comes back: no overlap, or a fixed one (sync.overlapMode fixed, applied from τ steps after
    the push), waited for there (sync.mergeWait overlap), with every island's round H
    (inner.stepsPerIsland fixed). Measured latencies (the fitted τ, applyFrom arrival,
    mergeWait nextPush, H_i) decide the step otherwise, so such a job cannot repeat."""
    sync = spec.sync
    if sync.merge_wait != "overlap" or spec.inner.steps_per_island != "fixed":
        return False
    return sync.overlap_steps == 0 or (
        sync.overlap_mode == "fixed" and sync.apply_from == "overlap"
    )


def round_policy(spec: JobSpec, fragments: int) -> RoundPolicy:
    """The round state machine's settings for a job split into `fragments`."""
    grace = spec.sync.grace_seconds
    return RoundPolicy(
        quorum=spec.sync.quorum,
        max_staleness=spec.staleness_bound(),
        heartbeat_timeout=spec.sync.heartbeat_timeout_seconds,
        grace_seconds=None if grace == "auto" else float(grace),
        startup_timeout=spec.islands.startup_timeout_seconds,
        overlap_steps=spec.sync.overlap_steps or 0,  # None only before the spec fills it in
        inner_steps=spec.inner.steps,
        offsets=tuple(fragment_offsets(spec.inner.steps, fragments)),
        learners_block=blocks_for_merge(
            quorum=spec.sync.quorum,
            islands=max(spec.islands.count, spec.total_shards()),
            overlap=spec.sync.overlap_steps or 0,
        ),
        ordered_folds=merges_applied_at_fixed_steps(spec),
    )
